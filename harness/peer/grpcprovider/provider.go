// Package grpcprovider is a cloudprovider.Interface that forwards every call to a
// cloudprovider.v1 endpoint (a provider sidecar) over gRPC, so that upstream's
// cloud-controller-manager can drive any provider written for ccm-rs.
//
// It registers itself as the cloud provider "ccm-rs-grpc". Its --cloud-config file is JSON or
// YAML:
//
//	endpoint: unix:///var/run/ccm/provider.sock   # required
//	callTimeout: 30s                             # per call, when the caller sets no deadline
package grpcprovider

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
	"sync"
	"time"

	pb "github.com/ccm-rs/go-adapter/gen/cloudprovider/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	cloudprovider "k8s.io/cloud-provider"
	"sigs.k8s.io/yaml"
)

// ProviderName is the name this provider registers under (--cloud-provider).
const ProviderName = "ccm-rs-grpc"

func init() {
	cloudprovider.RegisterCloudProvider(ProviderName, func(config io.Reader) (cloudprovider.Interface, error) {
		if config == nil {
			return nil, errors.New("--cloud-config is required: a file with `endpoint: unix:///path/provider.sock`")
		}
		raw, err := io.ReadAll(config)
		if err != nil {
			return nil, fmt.Errorf("reading the cloud config: %w", err)
		}
		var c Config
		if err := yaml.UnmarshalStrict(raw, &c); err != nil {
			return nil, fmt.Errorf("parsing the cloud config: %w", err)
		}
		return New(c)
	})
}

// Config is the --cloud-config file.
type Config struct {
	// Endpoint is unix:///path.sock, or host:port for TCP.
	Endpoint string `json:"endpoint"`
	// CallTimeout bounds each call whose context has no deadline (default 30s).
	CallTimeout string `json:"callTimeout,omitempty"`
}

// Cloud forwards cloudprovider.Interface calls to a cloudprovider.v1 endpoint.
type Cloud struct {
	conn      *grpc.ClientConn
	timeout   time.Duration
	instances pb.InstancesServiceClient
	routes    pb.RoutesServiceClient
	lbs       pb.LoadBalancersServiceClient
	identity  pb.IdentityServiceClient

	mu     sync.Mutex
	caps   *pb.GetPluginCapabilitiesResponse
	tables []string
}

// New connects (lazily) to the endpoint of c.
func New(c Config) (*Cloud, error) {
	if c.Endpoint == "" {
		return nil, errors.New("cloud config: endpoint is required")
	}
	timeout := 30 * time.Second
	if c.CallTimeout != "" {
		d, err := time.ParseDuration(c.CallTimeout)
		if err != nil {
			return nil, fmt.Errorf("cloud config: callTimeout: %w", err)
		}
		timeout = d
	}
	target := c.Endpoint
	if strings.HasPrefix(target, "tcp://") || strings.HasPrefix(target, "http://") {
		target = strings.TrimPrefix(strings.TrimPrefix(target, "tcp://"), "http://")
	}
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("connecting to %s: %w", c.Endpoint, err)
	}
	return &Cloud{
		conn:      conn,
		timeout:   timeout,
		instances: pb.NewInstancesServiceClient(conn),
		routes:    pb.NewRoutesServiceClient(conn),
		lbs:       pb.NewLoadBalancersServiceClient(conn),
		identity:  pb.NewIdentityServiceClient(conn),
	}, nil
}

func (c *Cloud) ctx(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, c.timeout)
}

// capabilities reads GetPluginCapabilities once it answers.
func (c *Cloud) capabilities(ctx context.Context) (*pb.GetPluginCapabilitiesResponse, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.caps != nil {
		return c.caps, nil
	}
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	caps, err := c.identity.GetPluginCapabilities(ctx, &pb.GetPluginCapabilitiesRequest{})
	if err != nil {
		return nil, fmt.Errorf("GetPluginCapabilities: %w", err)
	}
	c.caps = caps
	return caps, nil
}

func (c *Cloud) serves(service pb.ServiceType) bool {
	caps, err := c.capabilities(context.Background())
	if err != nil {
		// Not known yet: say yes, so that the controllers start; calls fail until it answers.
		return true
	}
	for _, s := range caps.GetServices() {
		if s == service {
			return true
		}
	}
	return false
}

// Initialize is a no-op: the connection is made on first use.
func (c *Cloud) Initialize(clientBuilder cloudprovider.ControllerClientBuilder, stop <-chan struct{}) {}

// LoadBalancer forwards to LoadBalancersService.
func (c *Cloud) LoadBalancer() (cloudprovider.LoadBalancer, bool) {
	return c, c.serves(pb.ServiceType_SERVICE_TYPE_LOAD_BALANCERS)
}

// Instances is not implemented: InstancesV2 is.
func (c *Cloud) Instances() (cloudprovider.Instances, bool) { return nil, false }

// InstancesV2 forwards to InstancesService.
func (c *Cloud) InstancesV2() (cloudprovider.InstancesV2, bool) {
	return c, c.serves(pb.ServiceType_SERVICE_TYPE_INSTANCES)
}

// Zones is deprecated upstream; InstanceMetadata carries zones.
func (c *Cloud) Zones() (cloudprovider.Zones, bool) { return nil, false }

// Clusters is not implemented.
func (c *Cloud) Clusters() (cloudprovider.Clusters, bool) { return nil, false }

// Routes forwards to RoutesService.
func (c *Cloud) Routes() (cloudprovider.Routes, bool) {
	return c, c.serves(pb.ServiceType_SERVICE_TYPE_ROUTES)
}

// ProviderName is "ccm-rs-grpc".
func (c *Cloud) ProviderName() string { return ProviderName }

// HasClusterID is true: cloudprovider.v1 scopes routes and load balancers by cluster name.
func (c *Cloud) HasClusterID() bool { return true }

// === InstancesV2 ===

func lookup(node *v1.Node) *pb.InstanceLookup {
	l := &pb.InstanceLookup{ProviderId: node.Spec.ProviderID, NodeName: node.Name, Labels: node.Labels}
	if h, ok := node.Labels[v1.LabelHostname]; ok {
		l.Hostname = h
	}
	for _, a := range node.Status.Addresses {
		l.Addresses = append(l.Addresses, toAddress(a))
	}
	return l
}

// InstanceExists asks InstanceExists.
func (c *Cloud) InstanceExists(ctx context.Context, node *v1.Node) (bool, error) {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	r, err := c.instances.InstanceExists(ctx, &pb.InstanceExistsRequest{Instance: lookup(node)})
	if err != nil {
		return false, fmt.Errorf("InstanceExists %s: %w", node.Name, err)
	}
	return r.GetExists(), nil
}

// InstanceShutdown asks InstanceShutdown.
func (c *Cloud) InstanceShutdown(ctx context.Context, node *v1.Node) (bool, error) {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	r, err := c.instances.InstanceShutdown(ctx, &pb.InstanceShutdownRequest{Instance: lookup(node)})
	if err != nil {
		return false, fmt.Errorf("InstanceShutdown %s: %w", node.Name, err)
	}
	if !r.GetExists() {
		return false, cloudprovider.InstanceNotFound
	}
	return r.GetShutdown(), nil
}

// InstanceMetadata asks InstanceMetadata (one call per Node: upstream has no batch read).
func (c *Cloud) InstanceMetadata(ctx context.Context, node *v1.Node) (*cloudprovider.InstanceMetadata, error) {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	r, err := c.instances.InstanceMetadata(ctx, &pb.InstanceMetadataRequest{Instance: lookup(node)})
	if err != nil {
		return nil, fmt.Errorf("InstanceMetadata %s: %w", node.Name, err)
	}
	if !r.GetExists() {
		return nil, cloudprovider.InstanceNotFound
	}
	m := r.GetMetadata()
	out := &cloudprovider.InstanceMetadata{
		ProviderID:       m.GetProviderId(),
		InstanceType:     m.GetInstanceType(),
		Zone:             m.GetZone(),
		Region:           m.GetRegion(),
		AdditionalLabels: m.GetAdditionalLabels(),
	}
	for _, a := range m.GetAddresses() {
		if addr, ok := fromAddress(a); ok {
			out.NodeAddresses = append(out.NodeAddresses, addr)
		}
	}
	return out, nil
}

var addressTypes = map[v1.NodeAddressType]pb.NodeAddressType{
	v1.NodeHostName:    pb.NodeAddressType_NODE_ADDRESS_TYPE_HOSTNAME,
	v1.NodeInternalIP:  pb.NodeAddressType_NODE_ADDRESS_TYPE_INTERNAL_IP,
	v1.NodeExternalIP:  pb.NodeAddressType_NODE_ADDRESS_TYPE_EXTERNAL_IP,
	v1.NodeInternalDNS: pb.NodeAddressType_NODE_ADDRESS_TYPE_INTERNAL_DNS,
	v1.NodeExternalDNS: pb.NodeAddressType_NODE_ADDRESS_TYPE_EXTERNAL_DNS,
}

func toAddress(a v1.NodeAddress) *pb.NodeAddress {
	return &pb.NodeAddress{Type: addressTypes[a.Type], Address: a.Address}
}

func fromAddress(a *pb.NodeAddress) (v1.NodeAddress, bool) {
	for k, v := range addressTypes {
		if v == a.GetType() {
			return v1.NodeAddress{Type: k, Address: a.GetAddress()}, true
		}
	}
	return v1.NodeAddress{}, false
}

// === Routes ===

// routeTables lists the provider's tables once.
func (c *Cloud) routeTables(ctx context.Context) ([]string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.tables != nil {
		return c.tables, nil
	}
	var ids []string
	token := ""
	for {
		r, err := c.routes.ListRouteTables(ctx, &pb.ListRouteTablesRequest{PageToken: token})
		if err != nil {
			return nil, fmt.Errorf("ListRouteTables: %w", err)
		}
		for _, t := range r.GetTables() {
			ids = append(ids, t.GetId())
		}
		if token = r.GetNextPageToken(); token == "" {
			break
		}
	}
	c.tables = ids
	return ids, nil
}

// ListRoutes lists every table's routes of the cluster.
func (c *Cloud) ListRoutes(ctx context.Context, clusterName string) ([]*cloudprovider.Route, error) {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	tables, err := c.routeTables(ctx)
	if err != nil {
		return nil, err
	}
	var out []*cloudprovider.Route
	for _, table := range tables {
		token := ""
		for {
			r, err := c.routes.ListRoutes(ctx, &pb.ListRoutesRequest{ClusterName: clusterName, TableId: table, PageToken: token})
			if err != nil {
				return nil, fmt.Errorf("ListRoutes %s: %w", table, err)
			}
			for _, route := range r.GetRoutes() {
				out = append(out, &cloudprovider.Route{
					Name:            route.GetName(),
					TargetNode:      types.NodeName(route.GetTarget().GetNodeName()),
					DestinationCIDR: route.GetDestinationCidr(),
					Blackhole:       route.GetBlackhole(),
				})
			}
			if token = r.GetNextPageToken(); token == "" {
				break
			}
		}
	}
	return out, nil
}

// tablesFor is every table a node's route goes to: the one table, or what ResolveRouteTables
// says when the provider has several.
func (c *Cloud) tablesFor(ctx context.Context, node types.NodeName) ([]string, error) {
	tables, err := c.routeTables(ctx)
	if err != nil {
		return nil, err
	}
	caps, err := c.capabilities(ctx)
	if err != nil {
		return nil, err
	}
	if !caps.GetRoutes().GetMultipleTables() {
		return tables, nil
	}
	r, err := c.routes.ResolveRouteTables(ctx, &pb.ResolveRouteTablesRequest{Targets: []*pb.RouteTarget{{NodeName: string(node)}}})
	if err != nil {
		return nil, fmt.Errorf("ResolveRouteTables %s: %w", node, err)
	}
	if len(r.GetAssignments()) != 1 {
		return nil, fmt.Errorf("ResolveRouteTables %s: %d answers for one target", node, len(r.GetAssignments()))
	}
	a := r.GetAssignments()[0]
	if a.GetError() != nil {
		return nil, fmt.Errorf("ResolveRouteTables %s: %s", node, a.GetError().GetMessage())
	}
	return a.GetTableIds(), nil
}

// CreateRoute creates the route, named after nameHint (the Node's UID), in its tables.
func (c *Cloud) CreateRoute(ctx context.Context, clusterName string, nameHint string, route *cloudprovider.Route) error {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	tables, err := c.tablesFor(ctx, route.TargetNode)
	if err != nil {
		return err
	}
	for _, table := range tables {
		_, err := c.routes.CreateRoute(ctx, &pb.CreateRouteRequest{
			ClusterName: clusterName,
			Route: &pb.Route{
				Name:            nameHint,
				Target:          &pb.RouteTarget{NodeName: string(route.TargetNode)},
				DestinationCidr: route.DestinationCIDR,
				TableId:         table,
			},
		})
		if err != nil && status.Code(err) != codes.AlreadyExists {
			return fmt.Errorf("CreateRoute %s in %s: %w", route.DestinationCIDR, table, err)
		}
	}
	return nil
}

// DeleteRoute deletes the route by name from every table.
func (c *Cloud) DeleteRoute(ctx context.Context, clusterName string, route *cloudprovider.Route) error {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	tables, err := c.routeTables(ctx)
	if err != nil {
		return err
	}
	for _, table := range tables {
		if _, err := c.routes.DeleteRoute(ctx, &pb.DeleteRouteRequest{ClusterName: clusterName, TableId: table, Name: route.Name}); err != nil {
			return fmt.Errorf("DeleteRoute %s in %s: %w", route.Name, table, err)
		}
	}
	return nil
}

// === LoadBalancer ===

var protocols = map[v1.Protocol]pb.Protocol{v1.ProtocolTCP: pb.Protocol_PROTOCOL_TCP, v1.ProtocolUDP: pb.Protocol_PROTOCOL_UDP, v1.ProtocolSCTP: pb.Protocol_PROTOCOL_SCTP}

func (c *Cloud) service(clusterName string, svc *v1.Service) *pb.LoadBalancerService {
	s := &pb.LoadBalancerService{
		ClusterName:         clusterName,
		Namespace:           svc.Namespace,
		Name:                svc.Name,
		Uid:                 string(svc.UID),
		LoadBalancerName:    cloudprovider.DefaultLoadBalancerName(svc),
		SourceRanges:        svc.Spec.LoadBalancerSourceRanges,
		RequestedIp:         svc.Spec.LoadBalancerIP,
		HealthCheckNodePort: uint32(svc.Spec.HealthCheckNodePort),
		Annotations:         svc.Annotations,
		SessionAffinity:     pb.SessionAffinity_SESSION_AFFINITY_NONE,
	}
	if svc.Spec.LoadBalancerClass != nil {
		s.LoadBalancerClass = *svc.Spec.LoadBalancerClass
	}
	for _, p := range svc.Spec.Ports {
		s.Ports = append(s.Ports, &pb.ServicePort{Name: p.Name, Protocol: protocols[p.Protocol], Port: uint32(p.Port), NodePort: uint32(p.NodePort)})
	}
	if svc.Spec.SessionAffinity == v1.ServiceAffinityClientIP {
		s.SessionAffinity = pb.SessionAffinity_SESSION_AFFINITY_CLIENT_IP
		if cfg := svc.Spec.SessionAffinityConfig; cfg != nil && cfg.ClientIP != nil && cfg.ClientIP.TimeoutSeconds != nil {
			s.SessionAffinityTimeoutSeconds = uint32(*cfg.ClientIP.TimeoutSeconds)
		}
	}
	for _, f := range svc.Spec.IPFamilies {
		if f == v1.IPv6Protocol {
			s.IpFamilies = append(s.IpFamilies, pb.IpFamily_IP_FAMILY_IPV6)
		} else {
			s.IpFamilies = append(s.IpFamilies, pb.IpFamily_IP_FAMILY_IPV4)
		}
	}
	if svc.Spec.ExternalTrafficPolicy == v1.ServiceExternalTrafficPolicyLocal {
		s.ExternalTrafficPolicy = pb.ExternalTrafficPolicy_EXTERNAL_TRAFFIC_POLICY_LOCAL
	} else {
		s.ExternalTrafficPolicy = pb.ExternalTrafficPolicy_EXTERNAL_TRAFFIC_POLICY_CLUSTER
	}
	return s
}

func lbNodes(nodes []*v1.Node) []*pb.LoadBalancerNode {
	out := make([]*pb.LoadBalancerNode, 0, len(nodes))
	for _, n := range nodes {
		node := &pb.LoadBalancerNode{Name: n.Name, ProviderId: n.Spec.ProviderID, Labels: n.Labels}
		for _, a := range n.Status.Addresses {
			node.Addresses = append(node.Addresses, toAddress(a))
		}
		out = append(out, node)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

func toStatus(s *pb.LoadBalancerStatus) *v1.LoadBalancerStatus {
	out := &v1.LoadBalancerStatus{}
	for _, i := range s.GetIngress() {
		ingress := v1.LoadBalancerIngress{IP: i.GetIp(), Hostname: i.GetHostname()}
		switch i.GetIpMode() {
		case pb.IpMode_IP_MODE_VIP:
			mode := v1.LoadBalancerIPModeVIP
			ingress.IPMode = &mode
		case pb.IpMode_IP_MODE_PROXY:
			mode := v1.LoadBalancerIPModeProxy
			ingress.IPMode = &mode
		}
		out.Ingress = append(out.Ingress, ingress)
	}
	return out
}

// GetLoadBalancer asks GetLoadBalancer.
func (c *Cloud) GetLoadBalancer(ctx context.Context, clusterName string, svc *v1.Service) (*v1.LoadBalancerStatus, bool, error) {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	r, err := c.lbs.GetLoadBalancer(ctx, &pb.GetLoadBalancerRequest{Service: c.service(clusterName, svc)})
	if err != nil {
		return nil, false, fmt.Errorf("GetLoadBalancer %s/%s: %w", svc.Namespace, svc.Name, err)
	}
	if !r.GetExists() {
		return nil, false, nil
	}
	return toStatus(r.GetStatus()), true, nil
}

// GetLoadBalancerName is upstream's default name ("a" and the Service UID, 32 characters).
func (c *Cloud) GetLoadBalancerName(ctx context.Context, clusterName string, svc *v1.Service) string {
	return cloudprovider.DefaultLoadBalancerName(svc)
}

// EnsureLoadBalancer asks EnsureLoadBalancer.
func (c *Cloud) EnsureLoadBalancer(ctx context.Context, clusterName string, svc *v1.Service, nodes []*v1.Node) (*v1.LoadBalancerStatus, error) {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	r, err := c.lbs.EnsureLoadBalancer(ctx, &pb.EnsureLoadBalancerRequest{Service: c.service(clusterName, svc), Nodes: lbNodes(nodes)})
	if err != nil {
		return nil, fmt.Errorf("EnsureLoadBalancer %s/%s: %w", svc.Namespace, svc.Name, err)
	}
	return toStatus(r.GetStatus()), nil
}

// UpdateLoadBalancer asks UpdateLoadBalancerHosts.
func (c *Cloud) UpdateLoadBalancer(ctx context.Context, clusterName string, svc *v1.Service, nodes []*v1.Node) error {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	_, err := c.lbs.UpdateLoadBalancerHosts(ctx, &pb.UpdateLoadBalancerHostsRequest{Service: c.service(clusterName, svc), Nodes: lbNodes(nodes)})
	if err != nil {
		return fmt.Errorf("UpdateLoadBalancerHosts %s/%s: %w", svc.Namespace, svc.Name, err)
	}
	return nil
}

// EnsureLoadBalancerDeleted asks EnsureLoadBalancerDeleted.
func (c *Cloud) EnsureLoadBalancerDeleted(ctx context.Context, clusterName string, svc *v1.Service) error {
	ctx, cancel := c.ctx(ctx)
	defer cancel()
	if _, err := c.lbs.EnsureLoadBalancerDeleted(ctx, &pb.EnsureLoadBalancerDeletedRequest{Service: c.service(clusterName, svc)}); err != nil {
		return fmt.Errorf("EnsureLoadBalancerDeleted %s/%s: %w", svc.Namespace, svc.Name, err)
	}
	return nil
}
