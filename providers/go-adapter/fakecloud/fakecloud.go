// Package fakecloud is upstream's fake cloud (k8s.io/cloud-provider/fake) made consistent
// enough to be served as a cloud: registered as "fake", its instances read from a JSON cloud
// config. cmd/ccm-provider-fake serves it; the adapter's tests use it where the bare fake's
// spy behaviour would hide what the adapter does.
package fakecloud

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"sync"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	cloudprovider "k8s.io/cloud-provider"
	"k8s.io/cloud-provider/fake"
)

// ProviderName is the name the cloud registers under.
const ProviderName = "fake"

// Config is the cloud config: the cloud's zone, region, load balancer address and instances.
type Config struct {
	Zone       string     `json:"zone"`
	Region     string     `json:"region"`
	ExternalIP string     `json:"externalIP"`
	Instances  []Instance `json:"instances"`
}

// Instance is one instance of the cloud.
type Instance struct {
	Name       string           `json:"name"`
	ProviderID string           `json:"providerID"`
	Type       string           `json:"type"`
	Addresses  []v1.NodeAddress `json:"addresses"`
}

// Register registers the cloud with k8s.io/cloud-provider under ProviderName.
func Register() {
	cloudprovider.RegisterCloudProvider(ProviderName, func(r io.Reader) (cloudprovider.Interface, error) {
		if r == nil {
			return nil, fmt.Errorf("the fake cloud needs --cloud-config (a JSON list of instances)")
		}
		var c Config
		if err := json.NewDecoder(r).Decode(&c); err != nil {
			return nil, fmt.Errorf("reading the fake cloud's --cloud-config: %w", err)
		}
		return New(c)
	})
}

// Cloud is upstream's fake.Cloud, filled from the config. The fake is a test spy, not a
// consistent cloud: it answers "exists" for every instance or load balancer at once, keeps
// one address list for all instances, and its Get, Update and Delete of a load balancer do
// not look at what Ensure made. Those answers are made per item here; everything else
// (routes, instance metadata through the fake's own override hook, Ensure, the call
// records) is the fake's own code.
type Cloud struct {
	*fake.Cloud
	instances map[string]Instance               // by providerID
	names     map[string]string                 // node name to providerID
	mu        sync.Mutex                        // guards status and the fake's Balancers, which it writes unguarded
	status    map[string]*v1.LoadBalancerStatus // by load balancer name: the ensured ones
}

// New is the cloud of c.
func New(c Config) (*Cloud, error) {
	ip := net.ParseIP(c.ExternalIP)
	if ip == nil {
		return nil, fmt.Errorf("the fake cloud's externalIP %q is not an IP address", c.ExternalIP)
	}
	f := &fake.Cloud{
		Provider:           ProviderName,
		EnableInstancesV2:  true,
		ExistsByProviderID: true,
		Zone:               cloudprovider.Zone{FailureDomain: c.Zone, Region: c.Region},
		ExternalIP:         ip,
		ProviderID:         map[types.NodeName]string{},
		InstanceTypes:      map[types.NodeName]string{},
		RouteMap:           map[string]*fake.Route{},
		Balancers:          map[string]fake.Balancer{},
	}
	out := &Cloud{Cloud: f, instances: map[string]Instance{}, names: map[string]string{}, status: map[string]*v1.LoadBalancerStatus{}}
	for _, i := range c.Instances {
		if i.Name == "" || i.ProviderID == "" {
			return nil, fmt.Errorf("a fake instance needs a name and a providerID: %+v", i)
		}
		out.instances[i.ProviderID] = i
		out.names[i.Name] = i.ProviderID
		f.ProviderID[types.NodeName(i.Name)] = i.ProviderID
		f.InstanceTypes[types.NodeName(i.ProviderID)] = i.Type // the fake looks types up by providerID
		f.Machines = append(f.Machines, types.NodeName(i.Name))
	}
	f.OverrideInstanceMetadata = out.metadata
	return out, nil
}

// lookup is the instance a Node stands for: by providerID, else by name.
func (c *Cloud) lookup(node *v1.Node) (Instance, bool) {
	id := node.Spec.ProviderID
	if id == "" {
		id = c.names[node.Name]
	}
	i, ok := c.instances[id]
	return i, ok
}

func (c *Cloud) InstancesV2() (cloudprovider.InstancesV2, bool) { return c, true }

func (c *Cloud) InstanceExists(ctx context.Context, node *v1.Node) (bool, error) {
	if _, ok := c.lookup(node); !ok {
		return false, nil
	}
	return c.Cloud.InstanceExists(ctx, node)
}

func (c *Cloud) InstanceShutdown(ctx context.Context, node *v1.Node) (bool, error) {
	if _, ok := c.lookup(node); !ok {
		return false, cloudprovider.InstanceNotFound
	}
	return c.Cloud.InstanceShutdown(ctx, node)
}

// metadata is the fake's OverrideInstanceMetadata hook: the fake keeps one address list
// for all instances.
func (c *Cloud) metadata(_ context.Context, node *v1.Node) (*cloudprovider.InstanceMetadata, error) {
	i, ok := c.lookup(node)
	if !ok {
		return nil, cloudprovider.InstanceNotFound
	}
	return &cloudprovider.InstanceMetadata{
		ProviderID:    i.ProviderID,
		InstanceType:  i.Type,
		NodeAddresses: i.Addresses,
		Zone:          c.Cloud.Zone.FailureDomain,
		Region:        c.Cloud.Zone.Region,
	}, nil
}

func (c *Cloud) LoadBalancer() (cloudprovider.LoadBalancer, bool) { return c, true }

// GetLoadBalancer answers from the load balancers ensured and not deleted since, with the
// status Ensure gave (the fake's own answers "exists" for all or none, without ports).
func (c *Cloud) GetLoadBalancer(ctx context.Context, clusterName string, service *v1.Service) (*v1.LoadBalancerStatus, bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	status, exists := c.status[c.GetLoadBalancerName(ctx, clusterName, service)]
	return status, exists, nil
}

func (c *Cloud) EnsureLoadBalancer(ctx context.Context, clusterName string, service *v1.Service, nodes []*v1.Node) (*v1.LoadBalancerStatus, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	status, err := c.Cloud.EnsureLoadBalancer(ctx, clusterName, service, nodes)
	if err == nil {
		c.status[c.GetLoadBalancerName(ctx, clusterName, service)] = status
	}
	return status, err
}

// UpdateLoadBalancer fails for a load balancer that does not exist, as a cloud's does (the
// fake's accepts any).
func (c *Cloud) UpdateLoadBalancer(ctx context.Context, clusterName string, service *v1.Service, nodes []*v1.Node) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	name := c.GetLoadBalancerName(ctx, clusterName, service)
	if _, ok := c.status[name]; !ok {
		return fmt.Errorf("load balancer %s not found", name)
	}
	return c.Cloud.UpdateLoadBalancer(ctx, clusterName, service, nodes)
}

func (c *Cloud) EnsureLoadBalancerDeleted(ctx context.Context, clusterName string, service *v1.Service) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	name := c.GetLoadBalancerName(ctx, clusterName, service)
	delete(c.status, name)
	delete(c.Cloud.Balancers, name)
	return c.Cloud.EnsureLoadBalancerDeleted(ctx, clusterName, service)
}

func (c *Cloud) Routes() (cloudprovider.Routes, bool) { return c, true }

// CreateRoute fails for a route that exists, as a cloud's does, without the fake's habit of
// keeping that error for every later call.
func (c *Cloud) CreateRoute(ctx context.Context, clusterName string, nameHint string, route *cloudprovider.Route) error {
	routes, err := c.Cloud.ListRoutes(ctx, clusterName)
	if err != nil {
		return err
	}
	for _, r := range routes {
		if r.DestinationCIDR == route.DestinationCIDR {
			return fmt.Errorf("a route to %s exists already (to %s)", r.DestinationCIDR, r.TargetNode)
		}
	}
	return c.Cloud.CreateRoute(ctx, clusterName, nameHint, route)
}
