package adapter

import (
	"fmt"
	"runtime"
	"strconv"
	"testing"

	"google.golang.org/protobuf/proto"

	pb "github.com/ccm-rs/go-adapter/gen/cloudprovider/v1"
)

// nodeSet is n Nodes as the core sends them in every EnsureLoadBalancer and hosts update: a
// name, a providerID, two addresses and the labels a managed node group's Node carries.
func nodeSet(n int) []*pb.LoadBalancerNode {
	nodes := make([]*pb.LoadBalancerNode, n)
	for i := range nodes {
		ip := fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255)
		name := "ip-" + ip + ".eu-west-1.compute.internal"
		zone := "eu-west-1" + string(rune('a'+i%3))
		nodes[i] = &pb.LoadBalancerNode{
			Name:       name,
			ProviderId: "aws:///" + zone + "/i-0" + strconv.FormatInt(int64(0x1000000000000000+i), 16),
			Addresses: []*pb.NodeAddress{
				{Type: pb.NodeAddressType_NODE_ADDRESS_TYPE_INTERNAL_IP, Address: ip},
				{Type: pb.NodeAddressType_NODE_ADDRESS_TYPE_HOSTNAME, Address: name},
			},
			Labels: map[string]string{
				"kubernetes.io/hostname":                   name,
				"kubernetes.io/arch":                       "amd64",
				"kubernetes.io/os":                         "linux",
				"beta.kubernetes.io/arch":                  "amd64",
				"beta.kubernetes.io/os":                    "linux",
				"node.kubernetes.io/instance-type":         "m6i.large",
				"beta.kubernetes.io/instance-type":         "m6i.large",
				"topology.kubernetes.io/region":            "eu-west-1",
				"topology.kubernetes.io/zone":              zone,
				"failure-domain.beta.kubernetes.io/region": "eu-west-1",
				"failure-domain.beta.kubernetes.io/zone":   zone,
				"eks.amazonaws.com/nodegroup":              "workers-" + strconv.Itoa(i%8),
			},
		}
	}
	return nodes
}

// BenchmarkNodeSetHeldPerCall measures what one load balancer call in flight holds in a
// provider built with the go-adapter: the request decoded and its hosts made into v1.Nodes for
// the cloudprovider.Interface, live until the call returns. The core has up to one call per
// service worker and a bulk update in flight, so a provider sidecar needs about that many
// times this beside its own memory. Run with
//
//	go test ./adapter -run '^$' -bench NodeSetHeldPerCall -benchtime 3x
//
// It reports the encoded request (what crosses the socket) and the heap held per call.
func BenchmarkNodeSetHeldPerCall(b *testing.B) {
	for _, n := range []int{1000, 5000, 20000} {
		b.Run(strconv.Itoa(n)+"-nodes", func(b *testing.B) {
			svc := &pb.LoadBalancerService{ClusterName: "c", Namespace: "ns", Name: "web", LoadBalancerName: "c-ns-web",
				Ports: []*pb.ServicePort{{Protocol: pb.Protocol_PROTOCOL_TCP, Port: 80, NodePort: 30080}}}
			wire, err := proto.Marshal(&pb.EnsureLoadBalancerRequest{Service: svc, Nodes: nodeSet(n)})
			if err != nil {
				b.Fatal(err)
			}
			var held uint64
			for b.Loop() {
				var before, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				request := &pb.EnsureLoadBalancerRequest{}
				if err := proto.Unmarshal(wire, request); err != nil {
					b.Fatal(err)
				}
				hosts := backendNodes(request.GetNodes())
				runtime.GC()
				runtime.ReadMemStats(&after)
				if len(hosts) != n || len(request.GetNodes()) != n {
					b.Fatalf("%d hosts of %d", len(hosts), n)
				}
				held = after.HeapAlloc - before.HeapAlloc
			}
			b.ReportMetric(float64(len(wire))/(1<<20), "MiB-encoded")
			b.ReportMetric(float64(held)/(1<<20), "MiB-held/call")
		})
	}
}
