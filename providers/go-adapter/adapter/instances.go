package adapter

import (
	"context"
	"errors"
	"fmt"
	"sync"

	pb "github.com/ccm-rs/go-adapter/gen/cloudprovider/v1"
	"google.golang.org/grpc/codes"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	cloudprovider "k8s.io/cloud-provider"
)

// instances serves InstancesService from InstancesV2, or from Instances and Zones for
// providers that have only the older interfaces.
type instances struct {
	pb.UnimplementedInstancesServiceServer
	cloud     cloudprovider.Interface
	v2        cloudprovider.InstancesV2
	v1        cloudprovider.Instances
	zones     cloudprovider.Zones
	batchSize int
}

// read is what the cloud says of one instance: its metadata and state, or absent. Three
// interface calls, since the interface has no call that answers all: InstanceMetadata,
// InstanceExists and InstanceShutdown, together when the Node has a providerID (providers
// that batch their cloud reads, as AWS does, coalesce them into one). A Node without one is
// resolved by InstanceMetadata first, so that the other two look the instance up by its
// providerID rather than each by name. "Exists" with no metadata (nil, nil) is an error,
// never "absent": the core would delete the Node of a NotReady instance that exists.
func (s *instances) read(ctx context.Context, l *pb.InstanceLookup) (*pb.InstanceMetadata, bool, error) {
	node := lookupNode(l)
	if s.v2 != nil {
		return s.readV2(ctx, node)
	}
	return s.readV1(ctx, node)
}

func (s *instances) readV2(ctx context.Context, node *v1.Node) (*pb.InstanceMetadata, bool, error) {
	var (
		wg       sync.WaitGroup
		meta     *cloudprovider.InstanceMetadata
		exists   bool
		shutdown bool
		metaErr  error
		existErr error
		shutErr  error
	)
	if node.Spec.ProviderID == "" {
		meta, metaErr = s.v2.InstanceMetadata(ctx, node)
		if metaErr == nil && meta != nil && meta.ProviderID != "" {
			node = node.DeepCopy()
			node.Spec.ProviderID = meta.ProviderID
		}
	} else {
		wg.Add(1)
		go func() { defer wg.Done(); meta, metaErr = s.v2.InstanceMetadata(ctx, node) }()
	}
	wg.Add(2)
	go func() { defer wg.Done(); exists, existErr = s.v2.InstanceExists(ctx, node) }()
	go func() { defer wg.Done(); shutdown, shutErr = s.v2.InstanceShutdown(ctx, node) }()
	wg.Wait()
	if errors.Is(existErr, cloudprovider.InstanceNotFound) {
		exists, existErr = false, nil
	}
	if existErr != nil {
		return nil, false, existErr
	}
	if !exists {
		return nil, false, nil
	}
	if errors.Is(metaErr, cloudprovider.InstanceNotFound) || errors.Is(shutErr, cloudprovider.InstanceNotFound) {
		return nil, false, fmt.Errorf("the provider says the instance of node %q exists and is not found: %v", node.Name, errors.Join(metaErr, shutErr))
	}
	if metaErr != nil {
		return nil, false, metaErr
	}
	if shutErr != nil && !errors.Is(shutErr, cloudprovider.NotImplemented) {
		return nil, false, shutErr
	}
	if meta == nil {
		return nil, false, fmt.Errorf("the provider says the instance of node %q exists but returned no metadata", node.Name)
	}
	out := &pb.InstanceMetadata{
		ProviderId:       meta.ProviderID,
		InstanceType:     meta.InstanceType,
		Zone:             meta.Zone,
		Region:           meta.Region,
		Addresses:        fromNodeAddresses(meta.NodeAddresses),
		AdditionalLabels: meta.AdditionalLabels,
		State:            pb.InstanceState_INSTANCE_STATE_RUNNING,
		NodeName:         node.Name,
		InstanceId:       instanceID(meta.ProviderID),
	}
	if out.ProviderId == "" {
		out.ProviderId = node.Spec.ProviderID
	}
	if shutdown {
		out.State = pb.InstanceState_INSTANCE_STATE_STOPPED
	}
	return out, true, nil
}

func (s *instances) readV1(ctx context.Context, node *v1.Node) (*pb.InstanceMetadata, bool, error) {
	providerID := node.Spec.ProviderID
	if providerID == "" {
		id, err := cloudprovider.GetInstanceProviderID(ctx, s.cloud, types.NodeName(node.Name))
		if errors.Is(err, cloudprovider.InstanceNotFound) {
			return nil, false, nil
		}
		if err != nil {
			return nil, false, err
		}
		providerID = id
	}
	exists, err := s.v1.InstanceExistsByProviderID(ctx, providerID)
	if errors.Is(err, cloudprovider.InstanceNotFound) || (err == nil && !exists) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	addresses, err := s.v1.NodeAddressesByProviderID(ctx, providerID)
	if err != nil {
		return nil, false, err
	}
	instanceType, err := s.v1.InstanceTypeByProviderID(ctx, providerID)
	if err != nil && !errors.Is(err, cloudprovider.NotImplemented) {
		return nil, false, err
	}
	out := &pb.InstanceMetadata{
		ProviderId:   providerID,
		InstanceId:   instanceID(providerID),
		InstanceType: instanceType,
		Addresses:    fromNodeAddresses(addresses),
		State:        pb.InstanceState_INSTANCE_STATE_RUNNING,
		NodeName:     node.Name,
	}
	if s.zones != nil {
		zone, err := s.zones.GetZoneByProviderID(ctx, providerID)
		if err != nil && !errors.Is(err, cloudprovider.NotImplemented) {
			return nil, false, err
		}
		out.Zone, out.Region = zone.FailureDomain, zone.Region
	}
	shutdown, err := s.v1.InstanceShutdownByProviderID(ctx, providerID)
	if err != nil && !errors.Is(err, cloudprovider.NotImplemented) {
		return nil, false, err
	}
	if shutdown {
		out.State = pb.InstanceState_INSTANCE_STATE_STOPPED
	}
	return out, true, nil
}

// checkLookup refuses a lookup that names no instance: neither providerID nor node name.
func checkLookup(l *pb.InstanceLookup) error {
	if l.GetProviderId() == "" && l.GetNodeName() == "" {
		return invalidArgument("INVALID_ARGUMENT", "an instance lookup needs a providerID or a node name")
	}
	return nil
}

// instanceID is the last path element of a providerID (`aws:///us-east-1a/i-0abc` → `i-0abc`).
func instanceID(providerID string) string {
	for i := len(providerID) - 1; i >= 0; i-- {
		if providerID[i] == '/' {
			return providerID[i+1:]
		}
	}
	return providerID
}

func (s *instances) InstanceMetadata(ctx context.Context, req *pb.InstanceMetadataRequest) (*pb.InstanceMetadataResponse, error) {
	return bounded(ctx, func(ctx context.Context) (*pb.InstanceMetadataResponse, error) {
		if err := checkLookup(req.GetInstance()); err != nil {
			return nil, err
		}
		meta, exists, err := s.read(ctx, req.GetInstance())
		if err != nil {
			return nil, toStatus(err)
		}
		return &pb.InstanceMetadataResponse{Exists: exists, Metadata: meta}, nil
	})
}

func (s *instances) InstanceExists(ctx context.Context, req *pb.InstanceExistsRequest) (*pb.InstanceExistsResponse, error) {
	return bounded(ctx, func(ctx context.Context) (*pb.InstanceExistsResponse, error) {
		if err := checkLookup(req.GetInstance()); err != nil {
			return nil, err
		}
		node := lookupNode(req.GetInstance())
		var (
			exists bool
			err    error
		)
		if s.v2 != nil {
			exists, err = s.v2.InstanceExists(ctx, node)
		} else {
			_, exists, err = s.readV1(ctx, node)
		}
		if errors.Is(err, cloudprovider.InstanceNotFound) {
			return &pb.InstanceExistsResponse{Exists: false}, nil
		}
		if err != nil {
			return nil, toStatus(err)
		}
		return &pb.InstanceExistsResponse{Exists: exists}, nil
	})
}

func (s *instances) InstanceShutdown(ctx context.Context, req *pb.InstanceShutdownRequest) (*pb.InstanceShutdownResponse, error) {
	return bounded(ctx, func(ctx context.Context) (*pb.InstanceShutdownResponse, error) {
		if err := checkLookup(req.GetInstance()); err != nil {
			return nil, err
		}
		meta, exists, err := s.read(ctx, req.GetInstance())
		if err != nil {
			return nil, toStatus(err)
		}
		return &pb.InstanceShutdownResponse{Exists: exists, Shutdown: exists && meta.GetState() == pb.InstanceState_INSTANCE_STATE_STOPPED}, nil
	})
}

// BatchInstanceMetadata reads each instance with its own calls, at most batchSize at once,
// each with its own error, in request order.
func (s *instances) BatchInstanceMetadata(ctx context.Context, req *pb.BatchInstanceMetadataRequest) (*pb.BatchInstanceMetadataResponse, error) {
	return bounded(ctx, func(ctx context.Context) (*pb.BatchInstanceMetadataResponse, error) {
		if len(req.GetInstances()) > maxBatch {
			return nil, invalidArgument("INVALID_ARGUMENT", fmt.Sprintf("at most %d instances per call, got %d", maxBatch, len(req.GetInstances())))
		}
		results := make([]*pb.InstanceMetadataResult, len(req.GetInstances()))
		each(len(req.GetInstances()), s.batchSize, func(i int) {
			l := req.GetInstances()[i]
			// Each result names its lookup: the core matches answers by it, not by position.
			key := &pb.LookupKey{ProviderId: l.GetProviderId(), NodeName: l.GetNodeName()}
			if err := checkLookup(l); err != nil {
				results[i] = &pb.InstanceMetadataResult{Lookup: key, Error: &pb.ItemError{Code: int32(codes.InvalidArgument), Message: err.Error(), Reason: "INVALID_ARGUMENT"}}
				return
			}
			meta, exists, err := s.read(ctx, l)
			if err != nil {
				results[i] = &pb.InstanceMetadataResult{Lookup: key, Error: itemError(err)}
				return
			}
			results[i] = &pb.InstanceMetadataResult{Lookup: key, Exists: exists, Metadata: meta}
		})
		return &pb.BatchInstanceMetadataResponse{Results: results}, nil
	})
}

// ListInstances: cloudprovider.Interface cannot list instances.
func (s *instances) ListInstances(context.Context, *pb.ListInstancesRequest) (*pb.ListInstancesResponse, error) {
	return nil, unimplemented("cloudprovider.Interface has no call that lists instances")
}
