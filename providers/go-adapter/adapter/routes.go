package adapter

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"sort"
	"strings"

	pb "github.com/ccm-rs/go-adapter/gen/cloudprovider/v1"
	"google.golang.org/grpc/codes"
	"k8s.io/apimachinery/pkg/types"
	cloudprovider "k8s.io/cloud-provider"
)

// defaultTable is the one route table the adapter lists: cloudprovider.Routes has no tables
// (a provider with several handles them inside CreateRoute).
const defaultTable = "default"

// routes serves RoutesService from cloudprovider.Routes. Providers key routes by destination
// and target, not by the name the core chooses (CreateRoute's nameHint), and many invent a
// name only when listing (AWS routes have none): the adapter names every route by its
// destination and target (routeName), so that CreateRoute answers without listing, and
// deletes by finding the route of that name in a fresh listing.
type routes struct {
	pb.UnimplementedRoutesServiceServer
	routes cloudprovider.Routes
	name   string
	ipv6   bool
	// concurrency bounds the single-route calls one ApplyRoutes makes.
	concurrency int
	// locks serialise the mutations of each route.
	locks *objectLocks
}

func (s *routes) ListRouteTables(_ context.Context, req *pb.ListRouteTablesRequest) (*pb.ListRouteTablesResponse, error) {
	if req.GetPageToken() != "" {
		return nil, invalidArgument("INVALID_PAGE_TOKEN", fmt.Sprintf("malformed page token %q", req.GetPageToken()))
	}
	return &pb.ListRouteTablesResponse{Tables: []*pb.RouteTable{{Id: defaultTable, Name: s.name + " routes"}}}, nil
}

func (s *routes) checkTable(table string) error {
	if table != "" && table != defaultTable {
		return invalidArgument("UNKNOWN_ROUTE_TABLE", fmt.Sprintf("route table %q does not exist", table))
	}
	return nil
}

// routeName is the route's name in the protocol: its destination and target node, which is
// what identifies a route to cloudprovider.Routes (a hash of the node's name past 253
// characters).
func routeName(destination string, node types.NodeName) string {
	name := destination + ">" + string(node)
	if len(name) <= 253 {
		return name
	}
	sum := sha256.Sum256([]byte(node))
	return destination + ">" + hex.EncodeToString(sum[:16])
}

func toRoute(r *cloudprovider.Route) *pb.Route {
	return &pb.Route{
		Name:            routeName(r.DestinationCIDR, r.TargetNode),
		Target:          &pb.RouteTarget{NodeName: string(r.TargetNode)},
		DestinationCidr: r.DestinationCIDR,
		TableId:         defaultTable,
		Blackhole:       r.Blackhole,
		TargetAddresses: fromNodeAddresses(r.TargetNodeAddresses),
	}
}

// list is the cluster's routes, sorted by routeName.
func (s *routes) list(ctx context.Context, cluster string) ([]*cloudprovider.Route, error) {
	all, err := s.routes.ListRoutes(ctx, cluster)
	if err != nil {
		return nil, err
	}
	sort.Slice(all, func(i, j int) bool {
		return routeName(all[i].DestinationCIDR, all[i].TargetNode) < routeName(all[j].DestinationCIDR, all[j].TargetNode)
	})
	return all, nil
}

// ListRoutes pages through the provider's listing by name: a page token is the hex of the
// last name served, so routes added or removed between pages shift nothing.
func (s *routes) ListRoutes(ctx context.Context, req *pb.ListRoutesRequest) (*pb.ListRoutesResponse, error) {
	return bounded(ctx, func(ctx context.Context) (*pb.ListRoutesResponse, error) {
		if err := s.checkTable(req.GetTableId()); err != nil {
			return nil, err
		}
		var after string
		if t := req.GetPageToken(); t != "" {
			b, err := hex.DecodeString(t)
			if err != nil || len(b) == 0 {
				return nil, invalidArgument("INVALID_PAGE_TOKEN", fmt.Sprintf("malformed page token %q", t))
			}
			after = string(b)
		}
		all, err := s.list(ctx, req.GetClusterName())
		if err != nil {
			return nil, toStatus(err)
		}
		size := int(req.GetPageSize())
		if size <= 0 || size > 1000 {
			size = 1000
		}
		out := &pb.ListRoutesResponse{}
		for _, r := range all {
			route := toRoute(r)
			if after != "" && route.Name <= after {
				continue
			}
			if len(out.Routes) == size {
				out.NextPageToken = hex.EncodeToString([]byte(out.Routes[len(out.Routes)-1].Name))
				break
			}
			out.Routes = append(out.Routes, route)
		}
		return out, nil
	})
}

// CreateRoute is idempotent: a route to the same destination and target is returned as it
// is; one to the same destination and another target is ALREADY_EXISTS.
func (s *routes) CreateRoute(ctx context.Context, req *pb.CreateRouteRequest) (*pb.CreateRouteResponse, error) {
	return mutation(ctx, s.locks, "route "+req.GetRoute().GetName(), func(ctx context.Context) (*pb.CreateRouteResponse, error) {
		want := req.GetRoute()
		if want == nil || want.GetName() == "" || want.GetDestinationCidr() == "" || want.GetTarget().GetNodeName() == "" {
			return nil, invalidArgument("INVALID_ARGUMENT", "a route needs a name, a destination and a target node")
		}
		if err := s.checkTable(want.GetTableId()); err != nil {
			return nil, err
		}
		if _, parsed, err := net.ParseCIDR(want.GetDestinationCidr()); err != nil || parsed.String() != want.GetDestinationCidr() {
			return nil, invalidArgument("INVALID_ARGUMENT", fmt.Sprintf("destination %q is not a CIDR in canonical form", want.GetDestinationCidr()))
		}
		if !s.ipv6 && strings.Contains(want.GetDestinationCidr(), ":") {
			return nil, invalidArgument("INVALID_ARGUMENT", fmt.Sprintf("destination %s: IPv6 routes are not advertised", want.GetDestinationCidr()))
		}
		answer := func(r *cloudprovider.Route) *pb.CreateRouteResponse {
			route := toRoute(r)
			route.Target.ProviderId = want.GetTarget().GetProviderId()
			return &pb.CreateRouteResponse{Route: route}
		}
		find := func() (*cloudprovider.Route, error) {
			all, err := s.list(ctx, req.GetClusterName())
			if err != nil {
				return nil, err
			}
			for _, r := range all {
				if r.DestinationCIDR == want.GetDestinationCidr() {
					return r, nil
				}
			}
			return nil, nil
		}
		route := &cloudprovider.Route{
			Name:                want.GetName(),
			TargetNode:          types.NodeName(want.GetTarget().GetNodeName()),
			TargetNodeAddresses: toNodeAddresses(want.GetTargetAddresses()),
			DestinationCIDR:     want.GetDestinationCidr(),
		}
		// Create first, as upstream's route controller does (the core creates only what its
		// listing lacks); a failure is looked into: the same route there already is success,
		// the destination routed elsewhere ALREADY_EXISTS.
		if err := s.routes.CreateRoute(ctx, req.GetClusterName(), want.GetName(), route); err != nil {
			existing, findErr := find()
			if findErr != nil || existing == nil {
				return nil, toStatus(err)
			}
			if string(existing.TargetNode) != want.GetTarget().GetNodeName() {
				return nil, newStatus(codes.AlreadyExists, "ALREADY_EXISTS",
					fmt.Sprintf("destination %s is routed to %s already", want.GetDestinationCidr(), existing.TargetNode), 0)
			}
			return answer(existing), nil
		}
		return answer(route), nil
	})
}

// DeleteRoute deletes the route of that name in the provider's listing; absent is OK.
func (s *routes) DeleteRoute(ctx context.Context, req *pb.DeleteRouteRequest) (*pb.DeleteRouteResponse, error) {
	return mutation(ctx, s.locks, "route "+req.GetName(), func(ctx context.Context) (*pb.DeleteRouteResponse, error) {
		if req.GetName() == "" {
			return nil, invalidArgument("INVALID_ARGUMENT", "a route name is required")
		}
		if err := s.checkTable(req.GetTableId()); err != nil {
			return nil, err
		}
		all, err := s.list(ctx, req.GetClusterName())
		if err != nil {
			return nil, toStatus(err)
		}
		for _, r := range all {
			if routeName(r.DestinationCIDR, r.TargetNode) == req.GetName() {
				if err := s.routes.DeleteRoute(ctx, req.GetClusterName(), r); err != nil {
					return nil, toStatus(err)
				}
			}
		}
		return &pb.DeleteRouteResponse{}, nil
	})
}

// ResolveRouteTables: every target's routes go to the one table; each assignment names its
// target.
func (s *routes) ResolveRouteTables(_ context.Context, req *pb.ResolveRouteTablesRequest) (*pb.ResolveRouteTablesResponse, error) {
	out := &pb.ResolveRouteTablesResponse{}
	for _, t := range req.GetTargets() {
		target := &pb.RouteTarget{NodeName: t.GetNodeName(), ProviderId: t.GetProviderId()}
		out.Assignments = append(out.Assignments, &pb.RouteTableAssignment{TableIds: []string{defaultTable}, Target: target})
	}
	return out, nil
}

// ApplyRoutes: cloudprovider.Routes has no bulk call, so each item is its single call
// (DeleteRoute, then CreateRoute), up to s.concurrency at a time, every delete before any
// create; each item answers for itself.
func (s *routes) ApplyRoutes(ctx context.Context, req *pb.ApplyRoutesRequest) (*pb.ApplyRoutesResponse, error) {
	if n := len(req.GetDeletes()) + len(req.GetCreates()); n > maxBatch {
		return nil, invalidArgument("INVALID_ARGUMENT", fmt.Sprintf("%d items; at most %d are allowed", n, maxBatch))
	}
	if err := s.checkTable(req.GetTableId()); err != nil {
		return nil, err
	}
	out := &pb.ApplyRoutesResponse{
		Deletes: make([]*pb.RouteDeleteResult, len(req.GetDeletes())),
		Creates: make([]*pb.RouteResult, len(req.GetCreates())),
	}
	each(len(req.GetDeletes()), s.concurrency, func(i int) {
		one := &pb.DeleteRouteRequest{ClusterName: req.GetClusterName(), TableId: req.GetTableId(), Name: req.GetDeletes()[i]}
		out.Deletes[i] = &pb.RouteDeleteResult{}
		if _, err := s.DeleteRoute(ctx, one); err != nil {
			out.Deletes[i].Error = itemError(err)
		}
	})
	each(len(req.GetCreates()), s.concurrency, func(i int) {
		one := &pb.CreateRouteRequest{ClusterName: req.GetClusterName(), Route: req.GetCreates()[i]}
		made, err := s.CreateRoute(ctx, one)
		if err != nil {
			out.Creates[i] = &pb.RouteResult{Error: itemError(err)}
			return
		}
		out.Creates[i] = &pb.RouteResult{Route: made.GetRoute()}
	})
	return out, nil
}
