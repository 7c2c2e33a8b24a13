package adapter

import (
	"context"
	"fmt"
	"net"

	pb "github.com/ccm-rs/go-adapter/gen/cloudprovider/v1"
	"google.golang.org/grpc/codes"
	cloudprovider "k8s.io/cloud-provider"
	"k8s.io/klog/v2"
)

// loadBalancers serves LoadBalancersService from cloudprovider.LoadBalancer. The provider
// names its load balancers itself (GetLoadBalancerName, usually upstream's `a` + UID), so the
// core's load_balancer_name is only logged next to it: existing load balancers are found as
// the provider always found them.
type loadBalancers struct {
	pb.UnimplementedLoadBalancersServiceServer
	lb cloudprovider.LoadBalancer
	// locks serialise the mutations of each load balancer.
	locks *objectLocks
	// concurrency bounds the UpdateLoadBalancer calls one BatchUpdateLoadBalancerHosts makes.
	concurrency int
}

func (s *loadBalancers) service(in *pb.LoadBalancerService) (*pb.LoadBalancerService, error) {
	if in == nil || in.GetUid() == "" || in.GetName() == "" || in.GetNamespace() == "" {
		return nil, invalidArgument("INVALID_ARGUMENT", "the Service's namespace, name and UID are required")
	}
	if in.GetLoadBalancerName() == "" {
		return nil, invalidArgument("INVALID_ARGUMENT", "load_balancer_name is required")
	}
	for _, r := range in.GetSourceRanges() {
		if _, _, err := net.ParseCIDR(r); err != nil {
			return nil, invalidArgument("INVALID_ARGUMENT", fmt.Sprintf("source range %q is not a CIDR", r))
		}
	}
	if ip := in.GetRequestedIp(); ip != "" && net.ParseIP(ip) == nil {
		return nil, invalidArgument("INVALID_ARGUMENT", fmt.Sprintf("requested IP %q is not an IP", ip))
	}
	return in, nil
}

// lbKey names a Service's load balancer for objectLocks.
func lbKey(in *pb.LoadBalancerService) string {
	return "load balancer " + in.GetNamespace() + "/" + in.GetName() + " (" + in.GetUid() + ")"
}

func (s *loadBalancers) GetLoadBalancer(ctx context.Context, req *pb.GetLoadBalancerRequest) (*pb.GetLoadBalancerResponse, error) {
	return bounded(ctx, func(ctx context.Context) (*pb.GetLoadBalancerResponse, error) {
		in, err := s.service(req.GetService())
		if err != nil {
			return nil, err
		}
		status, exists, err := s.lb.GetLoadBalancer(ctx, in.GetClusterName(), toService(in))
		if err != nil {
			return nil, toStatus(err)
		}
		if !exists {
			return &pb.GetLoadBalancerResponse{}, nil
		}
		return &pb.GetLoadBalancerResponse{Exists: true, Status: fromStatus(status)}, nil
	})
}

func (s *loadBalancers) EnsureLoadBalancer(ctx context.Context, req *pb.EnsureLoadBalancerRequest) (*pb.EnsureLoadBalancerResponse, error) {
	return mutation(ctx, s.locks, lbKey(req.GetService()), func(ctx context.Context) (*pb.EnsureLoadBalancerResponse, error) {
		in, err := s.service(req.GetService())
		if err != nil {
			return nil, err
		}
		if len(in.GetPorts()) == 0 {
			return nil, invalidArgument("INVALID_ARGUMENT", "a load balancer needs at least one port")
		}
		svc := toService(in)
		klog.V(2).InfoS("ensuring load balancer", "service", in.GetNamespace()+"/"+in.GetName(),
			"providerName", s.lb.GetLoadBalancerName(ctx, in.GetClusterName(), svc), "coreName", in.GetLoadBalancerName(),
			"nodes", len(req.GetNodes()))
		status, err := s.lb.EnsureLoadBalancer(ctx, in.GetClusterName(), svc, backendNodes(req.GetNodes()))
		if err != nil {
			return nil, toStatus(err)
		}
		return &pb.EnsureLoadBalancerResponse{Status: fromStatus(status)}, nil
	})
}

func (s *loadBalancers) UpdateLoadBalancerHosts(ctx context.Context, req *pb.UpdateLoadBalancerHostsRequest) (*pb.UpdateLoadBalancerHostsResponse, error) {
	return mutation(ctx, s.locks, lbKey(req.GetService()), func(ctx context.Context) (*pb.UpdateLoadBalancerHostsResponse, error) {
		in, err := s.service(req.GetService())
		if err != nil {
			return nil, err
		}
		svc := toService(in)
		if err := s.lb.UpdateLoadBalancer(ctx, in.GetClusterName(), svc, backendNodes(req.GetNodes())); err != nil {
			// The protocol's NOT_FOUND for an absent load balancer (so the core ensures it
			// anew); providers say so in their own words, so ask.
			if _, exists, getErr := s.lb.GetLoadBalancer(ctx, in.GetClusterName(), svc); getErr == nil && !exists {
				return nil, newStatus(codes.NotFound, "NOT_FOUND", fmt.Sprintf("load balancer of %s/%s does not exist: %v", in.GetNamespace(), in.GetName(), err), 0)
			}
			return nil, toStatus(err)
		}
		return &pb.UpdateLoadBalancerHostsResponse{}, nil
	})
}

func (s *loadBalancers) EnsureLoadBalancerDeleted(ctx context.Context, req *pb.EnsureLoadBalancerDeletedRequest) (*pb.EnsureLoadBalancerDeletedResponse, error) {
	return mutation(ctx, s.locks, lbKey(req.GetService()), func(ctx context.Context) (*pb.EnsureLoadBalancerDeletedResponse, error) {
		in, err := s.service(req.GetService())
		if err != nil {
			return nil, err
		}
		if err := s.lb.EnsureLoadBalancerDeleted(ctx, in.GetClusterName(), toService(in)); err != nil {
			return nil, toStatus(err)
		}
		return &pb.EnsureLoadBalancerDeletedResponse{}, nil
	})
}

// ListLoadBalancers: cloudprovider.LoadBalancer cannot list.
func (s *loadBalancers) ListLoadBalancers(context.Context, *pb.ListLoadBalancersRequest) (*pb.ListLoadBalancersResponse, error) {
	return nil, unimplemented("cloudprovider.LoadBalancer has no call that lists load balancers")
}

// BatchUpdateLoadBalancerHosts: cloudprovider.LoadBalancer has no bulk call, so each load
// balancer is its own UpdateLoadBalancer, up to s.concurrency at a time, each answering for
// itself.
func (s *loadBalancers) BatchUpdateLoadBalancerHosts(ctx context.Context, req *pb.BatchUpdateLoadBalancerHostsRequest) (*pb.BatchUpdateLoadBalancerHostsResponse, error) {
	if n := len(req.GetServices()); n > maxBatch {
		return nil, invalidArgument("INVALID_ARGUMENT", fmt.Sprintf("%d load balancers; at most %d are allowed", n, maxBatch))
	}
	out := &pb.BatchUpdateLoadBalancerHostsResponse{Results: make([]*pb.HostsUpdateResult, len(req.GetServices()))}
	each(len(req.GetServices()), s.concurrency, func(i int) {
		one := &pb.UpdateLoadBalancerHostsRequest{Service: req.GetServices()[i], Nodes: req.GetNodes()}
		out.Results[i] = &pb.HostsUpdateResult{}
		if _, err := s.UpdateLoadBalancerHosts(ctx, one); err != nil {
			out.Results[i].Error = itemError(err)
		}
	})
	return out, nil
}
