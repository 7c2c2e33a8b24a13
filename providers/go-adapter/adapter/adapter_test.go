package adapter

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ccm-rs/go-adapter/fakecloud"
	pb "github.com/ccm-rs/go-adapter/gen/cloudprovider/v1"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	cloudprovider "k8s.io/cloud-provider"
	"k8s.io/cloud-provider/api"
	"k8s.io/cloud-provider/fake"
)

// serve runs the adapter for cloud on a real unix socket and returns a client connection.
func serve(t *testing.T, cloud cloudprovider.Interface, opts Options) *grpc.ClientConn {
	t.Helper()
	opts.Listen = "unix://" + filepath.Join(t.TempDir(), "provider.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, cloud, opts) }()
	path := opts.Listen[len("unix://"):]
	deadline := time.Now().Add(5 * time.Second)
	for {
		if c, err := net.Dial("unix", path); err == nil {
			_ = c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the adapter did not listen on %s", path)
		}
		time.Sleep(10 * time.Millisecond)
	}
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = conn.Close()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return conn
}

func fakeCloud() *fake.Cloud {
	return &fake.Cloud{
		EnableInstancesV2:  true,
		ExistsByProviderID: true,
		Provider:           "fake",
		ProviderID:         map[types.NodeName]string{"node-a": "fake://zone-a/i-a"},
		InstanceTypes:      map[types.NodeName]string{"fake://zone-a/i-a": "fake.large"},
		Addresses:          []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: "10.0.0.1"}, {Type: v1.NodeHostName, Address: "node-a"}},
		Zone:               cloudprovider.Zone{FailureDomain: "zone-a", Region: "region-1"},
		AdditionalLabels:   map[string]string{"example.com/pool": "gold"},
		RouteMap:           map[string]*fake.Route{},
		ExternalIP:         net.ParseIP("192.0.2.10"),
	}
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return c
}

func TestIdentityAdvertisesWhatTheCloudOffers(t *testing.T) {
	cloud := fakeCloud()
	cloud.DisableRoutes = true
	conn := serve(t, cloud, Options{BatchReads: true})
	id := pb.NewIdentityServiceClient(conn)
	info, err := id.GetPluginInfo(ctx(t), &pb.GetPluginInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.GetName() != "fake.go-adapter.ccm-rs.dev" || info.GetProviderIdScheme() != "fake" {
		t.Errorf("info %v", info)
	}
	caps, err := id.GetPluginCapabilities(ctx(t), &pb.GetPluginCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	got := map[pb.ServiceType]bool{}
	for _, s := range caps.GetServices() {
		got[s] = true
	}
	if !got[pb.ServiceType_SERVICE_TYPE_INSTANCES] || !got[pb.ServiceType_SERVICE_TYPE_LOAD_BALANCERS] || got[pb.ServiceType_SERVICE_TYPE_ROUTES] {
		t.Errorf("services %v: instances and load balancers, no routes", caps.GetServices())
	}
	if !caps.GetInstances().GetBatchReads() {
		t.Error("batch reads as configured")
	}
	if _, err := pb.NewRoutesServiceClient(conn).ListRouteTables(ctx(t), &pb.ListRouteTablesRequest{}); status.Code(err) != codes.Unimplemented {
		t.Errorf("an unadvertised service answers UNIMPLEMENTED, got %v", err)
	}
}

func TestInstanceMetadataIsTranslated(t *testing.T) {
	cloud := fakeCloud()
	conn := serve(t, cloud, Options{})
	instances := pb.NewInstancesServiceClient(conn)
	lookup := &pb.InstanceLookup{NodeName: "node-a"}
	r, err := instances.InstanceMetadata(ctx(t), &pb.InstanceMetadataRequest{Instance: lookup})
	if err != nil {
		t.Fatal(err)
	}
	m := r.GetMetadata()
	if !r.GetExists() || m.GetProviderId() != "fake://zone-a/i-a" || m.GetInstanceId() != "i-a" || m.GetZone() != "zone-a" ||
		m.GetRegion() != "region-1" || m.GetState() != pb.InstanceState_INSTANCE_STATE_RUNNING ||
		m.GetAdditionalLabels()["example.com/pool"] != "gold" {
		t.Errorf("metadata %v", r)
	}
	if len(m.GetAddresses()) != 2 || m.GetAddresses()[0].GetType() != pb.NodeAddressType_NODE_ADDRESS_TYPE_INTERNAL_IP {
		t.Errorf("addresses %v", m.GetAddresses())
	}

	cloud.NodeShutdown = true
	r, err = instances.InstanceMetadata(ctx(t), &pb.InstanceMetadataRequest{Instance: lookup})
	if err != nil || r.GetMetadata().GetState() != pb.InstanceState_INSTANCE_STATE_STOPPED {
		t.Errorf("a shut down instance is STOPPED: %v %v", r, err)
	}
	cloud.ExistsByProviderID = false
	r, err = instances.InstanceMetadata(ctx(t), &pb.InstanceMetadataRequest{Instance: lookup})
	if err != nil || r.GetExists() {
		t.Errorf("InstanceExists false is exists=false: %v %v", r, err)
	}
	cloud.ExistsByProviderID = true
	cloud.OverrideInstanceMetadata = func(context.Context, *v1.Node) (*cloudprovider.InstanceMetadata, error) { return nil, nil }
	if _, err := instances.InstanceMetadata(ctx(t), &pb.InstanceMetadataRequest{Instance: lookup}); status.Code(err) != codes.Unavailable {
		t.Errorf("exists with no metadata is an error, never absent: %v", err)
	}
	cloud.OverrideInstanceMetadata = func(context.Context, *v1.Node) (*cloudprovider.InstanceMetadata, error) {
		return nil, cloudprovider.InstanceNotFound
	}
	if _, err := instances.InstanceMetadata(ctx(t), &pb.InstanceMetadataRequest{Instance: lookup}); status.Code(err) != codes.Unavailable {
		t.Errorf("metadata InstanceNotFound while InstanceExists says true is an error, never absent: %v", err)
	}
	cloud.ExistsByProviderID = false
	r, err = instances.InstanceMetadata(ctx(t), &pb.InstanceMetadataRequest{Instance: lookup})
	if err != nil || r.GetExists() {
		t.Errorf("InstanceNotFound and not existing is exists=false: %v %v", r, err)
	}
}

func TestBatchReadsAnswerPerItemInOrder(t *testing.T) {
	cloud := fakeCloud()
	cloud.OverrideInstanceMetadata = func(_ context.Context, node *v1.Node) (*cloudprovider.InstanceMetadata, error) {
		switch node.Name {
		case "slow-down":
			return nil, api.NewRetryError("throttled", 3*time.Second)
		case "broken":
			return nil, errors.New("cloud API error")
		}
		return &cloudprovider.InstanceMetadata{ProviderID: "fake://z/" + node.Name}, nil
	}
	conn := serve(t, cloud, Options{BatchConcurrency: 2})
	var lookups []*pb.InstanceLookup
	for _, n := range []string{"a", "slow-down", "b", "broken", "c"} {
		lookups = append(lookups, &pb.InstanceLookup{NodeName: n})
	}
	r, err := pb.NewInstancesServiceClient(conn).BatchInstanceMetadata(ctx(t), &pb.BatchInstanceMetadataRequest{Instances: lookups})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.GetResults()) != 5 {
		t.Fatalf("%d results", len(r.GetResults()))
	}
	for i, want := range []string{"fake://z/a", "", "fake://z/b", "", "fake://z/c"} {
		if got := r.GetResults()[i].GetMetadata().GetProviderId(); got != want {
			t.Errorf("result %d: %q, want %q", i, got, want)
		}
		// Every result, errors included, names the lookup it answers.
		key, asked := r.GetResults()[i].GetLookup(), lookups[i]
		if key.GetNodeName() != asked.GetNodeName() || key.GetProviderId() != asked.GetProviderId() {
			t.Errorf("result %d names %v, asked %v", i, key, asked)
		}
	}
	throttled := r.GetResults()[1].GetError()
	if codes.Code(throttled.GetCode()) != codes.ResourceExhausted || throttled.GetRetryAfterMs() != 3000 || throttled.GetReason() != "RATE_LIMITED" {
		t.Errorf("api.RetryError is RESOURCE_EXHAUSTED with its delay: %v", throttled)
	}
	if codes.Code(r.GetResults()[3].GetError().GetCode()) != codes.Unavailable {
		t.Errorf("other errors are transient: %v", r.GetResults()[3].GetError())
	}
}

func TestRetryErrorsCarryRetryInfo(t *testing.T) {
	cloud := fakeCloud()
	cloud.OverrideInstanceMetadata = func(context.Context, *v1.Node) (*cloudprovider.InstanceMetadata, error) {
		return nil, api.NewRetryError("slow down", 1500*time.Millisecond)
	}
	conn := serve(t, cloud, Options{})
	_, err := pb.NewInstancesServiceClient(conn).InstanceMetadata(ctx(t), &pb.InstanceMetadataRequest{Instance: &pb.InstanceLookup{NodeName: "x"}})
	st := status.Convert(err)
	var delay time.Duration
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			delay = ri.GetRetryDelay().AsDuration()
		}
	}
	if st.Code() != codes.ResourceExhausted || delay != 1500*time.Millisecond {
		t.Errorf("got %v with delay %v", st, delay)
	}
}

func TestAPanickingProviderCostsOneCallNotTheSidecar(t *testing.T) {
	cloud := fakeCloud()
	cloud.OverrideInstanceMetadata = func(_ context.Context, node *v1.Node) (*cloudprovider.InstanceMetadata, error) {
		if node.Name == "boom" {
			var m *cloudprovider.InstanceMetadata
			_ = m.Zone // a nil dereference, as on an unexpected cloud reply
		}
		return &cloudprovider.InstanceMetadata{ProviderID: "fake://zone-a/i-a"}, nil
	}
	instances := pb.NewInstancesServiceClient(serve(t, cloud, Options{}))
	_, err := instances.InstanceMetadata(ctx(t), &pb.InstanceMetadataRequest{Instance: &pb.InstanceLookup{NodeName: "boom"}})
	if status.Code(err) != codes.Internal {
		t.Fatalf("a panic answers INTERNAL: %v", err)
	}
	// In a batch too (the items run on goroutines of their own).
	batch := &pb.BatchInstanceMetadataRequest{Instances: []*pb.InstanceLookup{{NodeName: "node-a"}, {NodeName: "boom"}}}
	if _, err := instances.BatchInstanceMetadata(ctx(t), batch); status.Code(err) != codes.Internal {
		t.Fatalf("a panic in a batch answers INTERNAL: %v", err)
	}
	// The sidecar lives on.
	if _, err := instances.InstanceMetadata(ctx(t), &pb.InstanceMetadataRequest{Instance: &pb.InstanceLookup{NodeName: "node-a"}}); err != nil {
		t.Fatalf("after a panic, the next call: %v", err)
	}
}

func TestRoutesAreIdempotentAndPaginated(t *testing.T) {
	// The fake of fakecloud: the bare fake keeps a failed create's error for every later call.
	cloud, err := fakecloud.New(fakecloud.Config{ExternalIP: "192.0.2.10"})
	if err != nil {
		t.Fatal(err)
	}
	conn := serve(t, cloud, Options{})
	routes := pb.NewRoutesServiceClient(conn)
	create := func(name, node, cidr string) (*pb.CreateRouteResponse, error) {
		return routes.CreateRoute(ctx(t), &pb.CreateRouteRequest{ClusterName: "c", Route: &pb.Route{
			Name: name, Target: &pb.RouteTarget{NodeName: node}, DestinationCidr: cidr,
		}})
	}
	for i, cidr := range []string{"10.244.1.0/24", "10.244.2.0/24", "10.244.3.0/24"} {
		if _, err := create("ours-"+cidr, []string{"a", "b", "c"}[i], cidr); err != nil {
			t.Fatal(err)
		}
	}
	again, err := create("ours-again", "a", "10.244.1.0/24")
	if err != nil {
		t.Fatalf("creating an existing route again is OK: %v", err)
	}
	if again.GetRoute().GetName() != "10.244.1.0/24>a" {
		t.Errorf("answered with the route's name (destination and target): %v", again.GetRoute())
	}
	if _, err := create("other", "b", "10.244.1.0/24"); status.Code(err) != codes.AlreadyExists {
		t.Errorf("the same destination to another node: %v", err)
	}
	var names []string
	token := ""
	for {
		page, err := routes.ListRoutes(ctx(t), &pb.ListRoutesRequest{ClusterName: "c", PageSize: 2, PageToken: token})
		if err != nil {
			t.Fatal(err)
		}
		if len(page.GetRoutes()) > 2 {
			t.Fatalf("page of %d", len(page.GetRoutes()))
		}
		for _, r := range page.GetRoutes() {
			names = append(names, r.GetName())
		}
		if token = page.GetNextPageToken(); token == "" {
			break
		}
	}
	if len(names) != 3 {
		t.Errorf("listed %v", names)
	}
	if _, err := routes.DeleteRoute(ctx(t), &pb.DeleteRouteRequest{ClusterName: "c", Name: names[0]}); err != nil {
		t.Fatal(err)
	}
	if _, err := routes.DeleteRoute(ctx(t), &pb.DeleteRouteRequest{ClusterName: "c", Name: names[0]}); err != nil {
		t.Errorf("deleting an absent route is OK: %v", err)
	}
	if len(cloud.RouteMap) != 2 {
		t.Errorf("%d routes left", len(cloud.RouteMap))
	}
	if _, err := routes.ListRoutes(ctx(t), &pb.ListRoutesRequest{ClusterName: "c", PageToken: "zz"}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("a malformed token: %v", err)
	}
}

func TestLoadBalancerServicesAreTranslated(t *testing.T) {
	cloud := fakeCloud()
	conn := serve(t, cloud, Options{})
	lbs := pb.NewLoadBalancersServiceClient(conn)
	svc := &pb.LoadBalancerService{
		ClusterName: "c", Namespace: "ns", Name: "web", Uid: "0a1b2c3d-0000-1111-2222-333344445555", LoadBalancerName: "c-ns-web-1234",
		Ports:                         []*pb.ServicePort{{Name: "http", Protocol: pb.Protocol_PROTOCOL_TCP, Port: 80, NodePort: 30080, AppProtocol: "http", TargetPort: "web"}, {Name: "dns", Protocol: pb.Protocol_PROTOCOL_UDP, Port: 53, NodePort: 30053, TargetPort: "5353"}},
		ExternalIps:                   []string{"198.51.100.1"},
		IpFamilyPolicy:                pb.IpFamilyPolicy_IP_FAMILY_POLICY_PREFER_DUAL_STACK,
		Labels:                        map[string]string{"team": "web"},
		CurrentStatus:                 &pb.LoadBalancerStatus{Ingress: []*pb.LoadBalancerIngress{{Hostname: "lb.example.com"}}},
		SessionAffinity:               pb.SessionAffinity_SESSION_AFFINITY_CLIENT_IP,
		SessionAffinityTimeoutSeconds: 600,
		SourceRanges:                  []string{"10.0.0.0/8"},
		IpFamilies:                    []pb.IpFamily{pb.IpFamily_IP_FAMILY_IPV4, pb.IpFamily_IP_FAMILY_IPV6},
		RequestedIp:                   "192.0.2.10",
		ExternalTrafficPolicy:         pb.ExternalTrafficPolicy_EXTERNAL_TRAFFIC_POLICY_LOCAL,
		HealthCheckNodePort:           32000,
		Annotations:                   map[string]string{"example.com/lb": "fast"},
		LoadBalancerClass:             "example.com/lb",
	}
	nodes := []*pb.LoadBalancerNode{{Name: "node-a", ProviderId: "fake://zone-a/i-a", Labels: map[string]string{"pool": "x"}}}
	r, err := lbs.EnsureLoadBalancer(ctx(t), &pb.EnsureLoadBalancerRequest{Service: svc, Nodes: nodes})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.GetStatus().GetIngress()) != 1 || r.GetStatus().GetIngress()[0].GetIp() != "192.0.2.10" || len(r.GetStatus().GetIngress()[0].GetPorts()) != 2 {
		t.Errorf("status %v", r.GetStatus())
	}
	if len(cloud.EnsureCalls) != 1 {
		t.Fatalf("%d ensure calls", len(cloud.EnsureCalls))
	}
	got := cloud.EnsureCalls[0].Service
	spec := got.Spec
	if got.Namespace != "ns" || got.Name != "web" || string(got.UID) != svc.GetUid() || got.Annotations["example.com/lb"] != "fast" ||
		spec.Type != v1.ServiceTypeLoadBalancer || len(spec.Ports) != 2 || spec.Ports[1].Protocol != v1.ProtocolUDP || spec.Ports[1].NodePort != 30053 ||
		spec.SessionAffinity != v1.ServiceAffinityClientIP || *spec.SessionAffinityConfig.ClientIP.TimeoutSeconds != 600 ||
		spec.LoadBalancerSourceRanges[0] != "10.0.0.0/8" || len(spec.IPFamilies) != 2 || spec.IPFamilies[1] != v1.IPv6Protocol ||
		spec.LoadBalancerIP != "192.0.2.10" || spec.ExternalTrafficPolicy != v1.ServiceExternalTrafficPolicyLocal ||
		spec.HealthCheckNodePort != 32000 || *spec.LoadBalancerClass != "example.com/lb" ||
		*spec.Ports[0].AppProtocol != "http" || spec.Ports[0].TargetPort.String() != "web" || spec.Ports[1].TargetPort.IntValue() != 5353 ||
		spec.ExternalIPs[0] != "198.51.100.1" || *spec.IPFamilyPolicy != v1.IPFamilyPolicyPreferDualStack || got.Labels["team"] != "web" ||
		spec.AllocateLoadBalancerNodePorts != nil || got.Status.LoadBalancer.Ingress[0].Hostname != "lb.example.com" {
		t.Errorf("service as the provider saw it: %+v", got)
	}
	if n := cloud.EnsureCalls[0].Hosts; len(n) != 1 || n[0].Spec.ProviderID != "fake://zone-a/i-a" || n[0].Labels["pool"] != "x" {
		t.Errorf("nodes %+v", n)
	}
	if _, err := lbs.UpdateLoadBalancerHosts(ctx(t), &pb.UpdateLoadBalancerHostsRequest{Service: svc}); err != nil || len(cloud.UpdateCalls) != 1 {
		t.Errorf("update: %v, %d calls", err, len(cloud.UpdateCalls))
	}
	if _, err := lbs.EnsureLoadBalancerDeleted(ctx(t), &pb.EnsureLoadBalancerDeletedRequest{Service: svc}); err != nil {
		t.Error(err)
	}
	if _, err := lbs.EnsureLoadBalancer(ctx(t), &pb.EnsureLoadBalancerRequest{Service: &pb.LoadBalancerService{Name: "x"}}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("a Service without namespace and UID: %v", err)
	}
	if _, err := lbs.ListLoadBalancers(ctx(t), &pb.ListLoadBalancersRequest{}); status.Code(err) != codes.Unimplemented {
		t.Errorf("listing: %v", err)
	}
}

func TestInstancesAndZonesServeProvidersWithoutInstancesV2(t *testing.T) {
	cloud := fakeCloud()
	cloud.EnableInstancesV2 = false
	cloud.ExtID = map[types.NodeName]string{"node-a": "i-a"}
	cloud.InstanceTypes = map[types.NodeName]string{"fake://i-a": "fake.small"}
	conn := serve(t, cloud, Options{})
	instances := pb.NewInstancesServiceClient(conn)
	r, err := instances.InstanceMetadata(ctx(t), &pb.InstanceMetadataRequest{Instance: &pb.InstanceLookup{NodeName: "node-a"}})
	if err != nil {
		t.Fatal(err)
	}
	m := r.GetMetadata()
	if !r.GetExists() || m.GetProviderId() != "fake://i-a" || m.GetInstanceId() != "i-a" || m.GetInstanceType() != "fake.small" ||
		m.GetZone() != "zone-a" || m.GetRegion() != "region-1" || len(m.GetAddresses()) != 2 {
		t.Errorf("metadata from Instances and Zones: %v", r)
	}
	cloud.ExistsByProviderID = false
	r, err = instances.InstanceMetadata(ctx(t), &pb.InstanceMetadataRequest{Instance: &pb.InstanceLookup{ProviderId: "fake://i-a"}})
	if err != nil || r.GetExists() {
		t.Errorf("an instance that no longer exists: %v %v", r, err)
	}
	if _, err := instances.InstanceMetadata(ctx(t), &pb.InstanceMetadataRequest{Instance: &pb.InstanceLookup{}}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("a lookup naming no instance: %v", err)
	}
}

func TestUnixSocketsAreOwnerOnlyFromTheStart(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "provider.sock")
	l, err := Listen("unix://"+path, 0)
	if err != nil {
		t.Fatal(err)
	}
	info, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if info.Mode()&os.ModeSocket == 0 || info.Mode().Perm() != 0o600 {
		t.Errorf("socket mode %v, want a socket with 0600", info.Mode())
	}
	entries, err := os.ReadDir(dir)
	if err != nil || len(entries) != 1 {
		t.Errorf("nothing beside the socket: %v %v", entries, err)
	}
	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("the renamed socket accepts: %v", err)
	}
	_ = conn.Close()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("closing removes the socket: %v", err)
	}
}

func TestAGroupSocketModeIsTheModeFromTheStart(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "provider.sock")
	cloud := fakeCloud()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, cloud, Options{Listen: "unix://" + path, SocketMode: 0o660}) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	}()
	var info os.FileInfo
	var err error
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if info, err = os.Lstat(path); err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	if info.Mode()&os.ModeSocket == 0 || info.Mode().Perm() != 0o660 {
		t.Errorf("socket mode %v, want a socket with 0660", info.Mode())
	}
	if entries, err := os.ReadDir(dir); err != nil || len(entries) != 1 {
		t.Errorf("nothing beside the socket: %v %v", entries, err)
	}
}

func TestSocketModesForOthersOrWithoutOwnerReadWriteAreRefused(t *testing.T) {
	for _, mode := range []os.FileMode{0o600, 0o660, 0o640, 0o770, 0o700} {
		if err := CheckSocketMode(mode); err != nil {
			t.Errorf("%#o refused: %v", uint32(mode), err)
		}
	}
	for _, mode := range []os.FileMode{0o666, 0o604, 0o601, 0o777, 0o400, 0o200, 0o060, 0o1660, 0o2660, 0o4660, os.ModeSetgid | 0o660} {
		if err := CheckSocketMode(mode); err == nil {
			t.Errorf("%#o accepted", uint32(mode))
		}
		path := filepath.Join(t.TempDir(), "provider.sock")
		if l, err := Listen("unix://"+path, mode); err == nil {
			_ = l.Close()
			t.Errorf("Listen with %#o accepted", uint32(mode))
		}
		if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("a refused mode %#o left a file: %v", uint32(mode), err)
		}
	}
	err := Serve(context.Background(), fakeCloud(), Options{Listen: "unix://" + filepath.Join(t.TempDir(), "p.sock"), SocketMode: 0o666})
	if err == nil || !strings.Contains(err.Error(), "at most 0770") {
		t.Errorf("Serve with 0666: %v", err)
	}
}

func TestASocketAnotherProcessServesIsNotReplaced(t *testing.T) {
	path := filepath.Join(t.TempDir(), "provider.sock")
	first, err := Listen("unix://"+path, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	before, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	second, err := Listen("unix://"+path, 0)
	if err == nil {
		_ = second.Close()
		t.Fatal("a second Listen took the place of a live socket")
	}
	want := "another process serves unix://" + path + "; refusing to replace it"
	if !strings.Contains(err.Error(), want) {
		t.Errorf("the refusal %q does not say %q", err, want)
	}
	after, err := os.Lstat(path)
	if err != nil || !os.SameFile(before, after) {
		t.Fatalf("the live socket was touched: %v", err)
	}
	accepted := make(chan error, 1)
	go func() {
		c, err := first.Accept()
		if err == nil {
			_ = c.Close()
		}
		accepted <- err
	}()
	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("the first listener no longer answers: %v", err)
	}
	_ = conn.Close()
	if err := <-accepted; err != nil {
		t.Errorf("the first listener: %v", err)
	}
}

func TestAStaleSocketIsReplaced(t *testing.T) {
	path := filepath.Join(t.TempDir(), "provider.sock")
	// What a killed process leaves: the file of a socket nobody listens on.
	dead, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	dead.(*net.UnixListener).SetUnlinkOnClose(false)
	_ = dead.Close()
	if info, err := os.Lstat(path); err != nil || info.Mode()&os.ModeSocket == 0 {
		t.Fatalf("no stale socket to replace: %v", err)
	}
	l, err := Listen("unix://"+path, 0)
	if err != nil {
		t.Fatalf("a stale socket is replaced: %v", err)
	}
	defer l.Close()
	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("the new socket accepts: %v", err)
	}
	_ = conn.Close()
}

func TestAFileThatIsNotASocketIsNeverRemoved(t *testing.T) {
	path := filepath.Join(t.TempDir(), "provider.sock")
	if err := os.WriteFile(path, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	l, err := Listen("unix://"+path, 0)
	if err == nil {
		_ = l.Close()
		t.Fatal("a regular file was replaced by a socket")
	}
	if !strings.Contains(err.Error(), "is not a socket") {
		t.Errorf("the refusal: %v", err)
	}
	if b, err := os.ReadFile(path); err != nil || string(b) != "keep me" {
		t.Errorf("the file was changed: %q %v", b, err)
	}
}

func TestClosingLeavesAnotherProcesssFileAlone(t *testing.T) {
	path := filepath.Join(t.TempDir(), "provider.sock")
	l, err := Listen("unix://"+path, 0)
	if err != nil {
		t.Fatal(err)
	}
	// Someone removed the socket and put their own file there.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("theirs"), 0o600); err != nil {
		t.Fatal(err)
	}
	_ = l.Close()
	if b, err := os.ReadFile(path); err != nil || string(b) != "theirs" {
		t.Errorf("closing removed a file it had not bound: %q %v", b, err)
	}
}

func TestLoadBalancerCallsForFiveThousandNodesFitTheWire(t *testing.T) {
	cloud := fakeCloud()
	conn := serve(t, cloud, Options{})
	lbs := pb.NewLoadBalancersServiceClient(conn)
	svc := &pb.LoadBalancerService{
		ClusterName: "c", Namespace: "ns", Name: "web", Uid: "0a1b2c3d-0000-1111-2222-333344445555", LoadBalancerName: "c-ns-web-1234",
		Ports: []*pb.ServicePort{{Name: "http", Protocol: pb.Protocol_PROTOCOL_TCP, Port: 80, NodePort: 30080}},
	}
	nodes := make([]*pb.LoadBalancerNode, 5000)
	for i := range nodes {
		name := fmt.Sprintf("ip-10-0-%d-%d.eu-west-1.compute.internal", i/256, i%256)
		labels := map[string]string{"kubernetes.io/hostname": name}
		for j := range 20 {
			labels[fmt.Sprintf("example.com/label-%02d", j)] = "a-label-value-of-some-length"
		}
		nodes[i] = &pb.LoadBalancerNode{Name: name, ProviderId: "fake://zone-a/i-" + name, Labels: labels}
	}
	request := &pb.UpdateLoadBalancerHostsRequest{Service: svc, Nodes: nodes}
	if size := proto.Size(request); size <= 4<<20 {
		t.Fatalf("the request is %d bytes, under gRPC's default limit: the test would prove nothing", size)
	}
	if _, err := lbs.UpdateLoadBalancerHosts(ctx(t), request); err != nil {
		t.Fatalf("5000 nodes: %v", err)
	}
	if n := len(cloud.UpdateCalls); n != 1 || len(cloud.UpdateCalls[0].Hosts) != 5000 {
		t.Errorf("%d update calls", n)
	}
}

func TestBulkCallsAnswerPerItemInOrder(t *testing.T) {
	cloud, err := fakecloud.New(fakecloud.Config{ExternalIP: "192.0.2.10"})
	if err != nil {
		t.Fatal(err)
	}
	conn := serve(t, cloud, Options{Bulk: true, BatchConcurrency: 2})
	caps, err := pb.NewIdentityServiceClient(conn).GetPluginCapabilities(ctx(t), &pb.GetPluginCapabilitiesRequest{})
	if err != nil || !caps.GetRoutes().GetBulkApply() || !caps.GetLoadBalancers().GetBulkUpdateHosts() {
		t.Fatalf("bulk calls advertised with Bulk: %v %v", caps, err)
	}
	routes := pb.NewRoutesServiceClient(conn)
	route := func(node, cidr string) *pb.Route {
		return &pb.Route{Name: "r-" + node, Target: &pb.RouteTarget{NodeName: node}, DestinationCidr: cidr}
	}
	applied, err := routes.ApplyRoutes(ctx(t), &pb.ApplyRoutesRequest{ClusterName: "c", Creates: []*pb.Route{
		route("a", "10.244.1.0/24"), route("b", "10.244.2.0/24"), route("bad", "10.244.3.1/24"), route("c", "10.244.4.0/24"),
	}})
	if err != nil {
		t.Fatal(err)
	}
	if len(applied.GetCreates()) != 4 || len(applied.GetDeletes()) != 0 {
		t.Fatalf("answers %v", applied)
	}
	for i, want := range []string{"10.244.1.0/24>a", "10.244.2.0/24>b", "", "10.244.4.0/24>c"} {
		got := applied.GetCreates()[i]
		if want == "" {
			if got.GetError().GetCode() != int32(codes.InvalidArgument) || got.GetRoute() != nil {
				t.Errorf("a malformed CIDR fails its own item: %v", got)
			}
		} else if got.GetError() != nil || got.GetRoute().GetName() != want {
			t.Errorf("item %d: %v, want route %s", i, got, want)
		}
	}
	// Deletes come before creates: the same destination moves to another node in one call.
	applied, err = routes.ApplyRoutes(ctx(t), &pb.ApplyRoutesRequest{
		ClusterName: "c", Deletes: []string{"10.244.1.0/24>a", "absent"}, Creates: []*pb.Route{route("d", "10.244.1.0/24")},
	})
	if err != nil || len(applied.GetDeletes()) != 2 || applied.GetDeletes()[0].GetError() != nil || applied.GetDeletes()[1].GetError() != nil ||
		applied.GetCreates()[0].GetError() != nil {
		t.Fatalf("delete and create in one call: %v %v", applied, err)
	}
	if len(cloud.RouteMap) != 3 {
		t.Errorf("%d routes, want 3", len(cloud.RouteMap))
	}
	if _, err := routes.ApplyRoutes(ctx(t), &pb.ApplyRoutesRequest{ClusterName: "c", Deletes: make([]string, 501)}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("501 items: %v", err)
	}

	lbs := pb.NewLoadBalancersServiceClient(conn)
	svc := func(name string) *pb.LoadBalancerService {
		return &pb.LoadBalancerService{ClusterName: "c", Namespace: "ns", Name: name, Uid: "uid-" + name, LoadBalancerName: "c-ns-" + name,
			Ports: []*pb.ServicePort{{Protocol: pb.Protocol_PROTOCOL_TCP, Port: 80, NodePort: 30080}}}
	}
	for _, name := range []string{"one", "two"} {
		if _, err := lbs.EnsureLoadBalancer(ctx(t), &pb.EnsureLoadBalancerRequest{Service: svc(name)}); err != nil {
			t.Fatal(err)
		}
	}
	nodes := []*pb.LoadBalancerNode{{Name: "node-a", ProviderId: "fake://zone-a/i-a"}}
	hosts, err := lbs.BatchUpdateLoadBalancerHosts(ctx(t), &pb.BatchUpdateLoadBalancerHostsRequest{
		Nodes: nodes, Services: []*pb.LoadBalancerService{svc("one"), svc("gone"), svc("two")},
	})
	if err != nil || len(hosts.GetResults()) != 3 {
		t.Fatalf("hosts: %v %v", hosts, err)
	}
	if hosts.GetResults()[0].GetError() != nil || hosts.GetResults()[2].GetError() != nil {
		t.Errorf("existing load balancers updated: %v", hosts)
	}
	if e := hosts.GetResults()[1].GetError(); e.GetCode() != int32(codes.NotFound) || e.GetReason() != "NOT_FOUND" {
		t.Errorf("an absent load balancer is NOT_FOUND in its own item: %v", e)
	}
	if len(cloud.UpdateCalls) != 2 {
		t.Errorf("%d UpdateLoadBalancer calls, want 2", len(cloud.UpdateCalls))
	}
}

// slowBalancers is upstream's fake load balancer taking `delay` per EnsureLoadBalancer and
// counting how many run at once.
type slowBalancers struct {
	cloudprovider.LoadBalancer
	delay   time.Duration
	mu      sync.Mutex
	running int
	most    int
	calls   int
}

func (s *slowBalancers) EnsureLoadBalancer(ctx context.Context, cluster string, svc *v1.Service, nodes []*v1.Node) (*v1.LoadBalancerStatus, error) {
	s.mu.Lock()
	s.running++
	s.calls++
	if s.running > s.most {
		s.most = s.running
	}
	s.mu.Unlock()
	defer func() { s.mu.Lock(); s.running--; s.mu.Unlock() }()
	time.Sleep(s.delay)
	return s.LoadBalancer.EnsureLoadBalancer(ctx, cluster, svc, nodes)
}

type slowCloud struct {
	*fake.Cloud
	lb *slowBalancers
}

func (c slowCloud) LoadBalancer() (cloudprovider.LoadBalancer, bool) { return c.lb, true }

func TestAMutationStillRunningAfterItsCallerTimedOutIsNotRunTwice(t *testing.T) {
	cloud := fakeCloud()
	slow := &slowBalancers{LoadBalancer: cloud, delay: 1500 * time.Millisecond}
	lbs := pb.NewLoadBalancersServiceClient(serve(t, slowCloud{cloud, slow}, Options{}))
	svc := &pb.LoadBalancerService{ClusterName: "c", Namespace: "default", Name: "web", Uid: "u-1", LoadBalancerName: "aweb",
		Ports: []*pb.ServicePort{{Port: 80, NodePort: 30080, Protocol: pb.Protocol_PROTOCOL_TCP}}}
	req := &pb.EnsureLoadBalancerRequest{Service: svc}
	short := func() context.Context {
		c, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		t.Cleanup(cancel)
		return c
	}
	// The caller gives up; the cloud call goes on.
	if _, err := lbs.EnsureLoadBalancer(short(), req); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("first call: %v, want DEADLINE_EXCEEDED", err)
	}
	// A retry with a short deadline is refused while the first still runs, as retryable.
	_, err := lbs.EnsureLoadBalancer(short(), req)
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("retry during the first: %v, want UNAVAILABLE", err)
	}
	// One with time enough waits for the first, then runs.
	if _, err := lbs.EnsureLoadBalancer(ctx(t), req); err != nil {
		t.Fatalf("a retry with time enough: %v", err)
	}
	slow.mu.Lock()
	defer slow.mu.Unlock()
	if slow.most != 1 || slow.calls != 2 {
		t.Errorf("%d EnsureLoadBalancer ran at once (want 1), %d in all (want 2)", slow.most, slow.calls)
	}
}
