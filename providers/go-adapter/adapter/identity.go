package adapter

import (
	"context"

	pb "github.com/ccm-rs/go-adapter/gen/cloudprovider/v1"
)

// identity serves IdentityService: the plugin's name, the services registered, and Probe.
type identity struct {
	pb.UnimplementedIdentityServiceServer
	opts     Options
	services []pb.ServiceType
}

func (s *identity) GetPluginInfo(context.Context, *pb.GetPluginInfoRequest) (*pb.GetPluginInfoResponse, error) {
	return &pb.GetPluginInfoResponse{
		Name:             s.opts.Name,
		VendorVersion:    s.opts.Version,
		ProviderIdScheme: s.opts.ProviderIDScheme,
		Manifest:         map[string]string{"adapter": "github.com/ccm-rs/go-adapter"},
	}, nil
}

func (s *identity) GetPluginCapabilities(context.Context, *pb.GetPluginCapabilitiesRequest) (*pb.GetPluginCapabilitiesResponse, error) {
	out := &pb.GetPluginCapabilitiesResponse{Services: s.services}
	for _, t := range s.services {
		switch t {
		case pb.ServiceType_SERVICE_TYPE_INSTANCES:
			out.Instances = &pb.InstancesCapabilities{BatchReads: s.opts.BatchReads}
		case pb.ServiceType_SERVICE_TYPE_ROUTES:
			out.Routes = &pb.RoutesCapabilities{Ipv6: s.opts.RoutesIPv6, ProviderNames: true, BulkApply: s.opts.Bulk}
		case pb.ServiceType_SERVICE_TYPE_LOAD_BALANCERS:
			out.LoadBalancers = &pb.LoadBalancersCapabilities{BulkUpdateHosts: s.opts.Bulk, Classes: s.opts.LoadBalancerClasses}
		}
	}
	if s.opts.CallRate > 0 {
		out.CallRate = &pb.CallRate{PerSecond: s.opts.CallRate, Burst: s.opts.CallBurst}
	}
	return out, nil
}

// Probe: the interface has no health call; a running adapter is ready.
func (s *identity) Probe(context.Context, *pb.ProbeRequest) (*pb.ProbeResponse, error) {
	return &pb.ProbeResponse{Ready: true}, nil
}
