package adapter

import (
	pb "github.com/ccm-rs/go-adapter/gen/cloudprovider/v1"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
)

var addressTypes = map[pb.NodeAddressType]v1.NodeAddressType{
	pb.NodeAddressType_NODE_ADDRESS_TYPE_HOSTNAME:     v1.NodeHostName,
	pb.NodeAddressType_NODE_ADDRESS_TYPE_INTERNAL_IP:  v1.NodeInternalIP,
	pb.NodeAddressType_NODE_ADDRESS_TYPE_EXTERNAL_IP:  v1.NodeExternalIP,
	pb.NodeAddressType_NODE_ADDRESS_TYPE_INTERNAL_DNS: v1.NodeInternalDNS,
	pb.NodeAddressType_NODE_ADDRESS_TYPE_EXTERNAL_DNS: v1.NodeExternalDNS,
}

// toNodeAddresses converts protocol addresses; unspecified types are dropped.
func toNodeAddresses(in []*pb.NodeAddress) []v1.NodeAddress {
	out := make([]v1.NodeAddress, 0, len(in))
	for _, a := range in {
		if t, ok := addressTypes[a.GetType()]; ok {
			out = append(out, v1.NodeAddress{Type: t, Address: a.GetAddress()})
		}
	}
	return out
}

// fromNodeAddresses converts Kubernetes addresses; types the protocol lacks are dropped.
func fromNodeAddresses(in []v1.NodeAddress) []*pb.NodeAddress {
	out := make([]*pb.NodeAddress, 0, len(in))
	for _, a := range in {
		for pt, kt := range addressTypes {
			if kt == a.Type {
				out = append(out, &pb.NodeAddress{Type: pt, Address: a.Address})
			}
		}
	}
	return out
}

// lookupNode is the v1.Node an InstanceLookup describes: name, providerID, addresses and
// labels, which is what providers read of a Node to find its instance.
func lookupNode(l *pb.InstanceLookup) *v1.Node {
	labels := map[string]string{}
	for k, v := range l.GetLabels() {
		labels[k] = v
	}
	if l.GetHostname() != "" {
		if _, ok := labels[v1.LabelHostname]; !ok {
			labels[v1.LabelHostname] = l.GetHostname()
		}
	}
	return &v1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: l.GetNodeName(), Labels: labels},
		Spec:       v1.NodeSpec{ProviderID: l.GetProviderId()},
		Status:     v1.NodeStatus{Addresses: toNodeAddresses(l.GetAddresses())},
	}
}

// backendNodes are the v1.Nodes of a load balancer's backends. The protocol carries no
// conditions: the core has chosen the set already (upstream's stable node set ignores
// readiness too), so every Node is given Ready=True for providers that still filter on it.
func backendNodes(in []*pb.LoadBalancerNode) []*v1.Node {
	out := make([]*v1.Node, 0, len(in))
	for _, n := range in {
		labels := map[string]string{}
		for k, v := range n.GetLabels() {
			labels[k] = v
		}
		out = append(out, &v1.Node{
			ObjectMeta: metav1.ObjectMeta{Name: n.GetName(), Labels: labels},
			Spec:       v1.NodeSpec{ProviderID: n.GetProviderId()},
			Status: v1.NodeStatus{
				Addresses:  toNodeAddresses(n.GetAddresses()),
				Conditions: []v1.NodeCondition{{Type: v1.NodeReady, Status: v1.ConditionTrue}},
			},
		})
	}
	return out
}

var protocols = map[pb.Protocol]v1.Protocol{
	pb.Protocol_PROTOCOL_TCP:  v1.ProtocolTCP,
	pb.Protocol_PROTOCOL_UDP:  v1.ProtocolUDP,
	pb.Protocol_PROTOCOL_SCTP: v1.ProtocolSCTP,
}

// toService is the v1.Service a LoadBalancerService describes, with every field the protocol
// carries: name, namespace, UID, labels, annotations, type, ports (name, protocol, port, node
// port, appProtocol, targetPort), session affinity and its timeout, source ranges, IP
// families and policy, requested IP, external IPs, external traffic policy, health check node
// port, allocateLoadBalancerNodePorts, load balancer class, and the current ingress.
func toService(s *pb.LoadBalancerService) *v1.Service {
	svc := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{
			Name:        s.GetName(),
			Namespace:   s.GetNamespace(),
			UID:         types.UID(s.GetUid()),
			Annotations: map[string]string{},
			Labels:      map[string]string{},
		},
		Spec: v1.ServiceSpec{
			Type:                     v1.ServiceTypeLoadBalancer,
			LoadBalancerSourceRanges: s.GetSourceRanges(),
			LoadBalancerIP:           s.GetRequestedIp(),
			HealthCheckNodePort:      int32(s.GetHealthCheckNodePort()),
			SessionAffinity:          v1.ServiceAffinityNone,
			ExternalTrafficPolicy:    v1.ServiceExternalTrafficPolicyCluster,
			ExternalIPs:              s.GetExternalIps(),
		},
	}
	for k, v := range s.GetLabels() {
		svc.Labels[k] = v
	}
	if s.AllocateLoadBalancerNodePorts != nil {
		allocate := s.GetAllocateLoadBalancerNodePorts()
		svc.Spec.AllocateLoadBalancerNodePorts = &allocate
	}
	policies := map[pb.IpFamilyPolicy]v1.IPFamilyPolicy{
		pb.IpFamilyPolicy_IP_FAMILY_POLICY_SINGLE_STACK:       v1.IPFamilyPolicySingleStack,
		pb.IpFamilyPolicy_IP_FAMILY_POLICY_PREFER_DUAL_STACK:  v1.IPFamilyPolicyPreferDualStack,
		pb.IpFamilyPolicy_IP_FAMILY_POLICY_REQUIRE_DUAL_STACK: v1.IPFamilyPolicyRequireDualStack,
	}
	if p, ok := policies[s.GetIpFamilyPolicy()]; ok {
		svc.Spec.IPFamilyPolicy = &p
	}
	svc.Status.LoadBalancer = toLoadBalancerStatus(s.GetCurrentStatus())
	for k, v := range s.GetAnnotations() {
		svc.Annotations[k] = v
	}
	for _, p := range s.GetPorts() {
		protocol, ok := protocols[p.GetProtocol()]
		if !ok {
			protocol = v1.ProtocolTCP
		}
		port := v1.ServicePort{
			Name:     p.GetName(),
			Protocol: protocol,
			Port:     int32(p.GetPort()),
			NodePort: int32(p.GetNodePort()),
		}
		if a := p.GetAppProtocol(); a != "" {
			port.AppProtocol = &a
		}
		if t := p.GetTargetPort(); t != "" {
			port.TargetPort = intstr.Parse(t)
		}
		svc.Spec.Ports = append(svc.Spec.Ports, port)
	}
	if s.GetSessionAffinity() == pb.SessionAffinity_SESSION_AFFINITY_CLIENT_IP {
		svc.Spec.SessionAffinity = v1.ServiceAffinityClientIP
		if t := int32(s.GetSessionAffinityTimeoutSeconds()); t > 0 {
			svc.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: &t}}
		}
	}
	if s.GetExternalTrafficPolicy() == pb.ExternalTrafficPolicy_EXTERNAL_TRAFFIC_POLICY_LOCAL {
		svc.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
	}
	for _, f := range s.GetIpFamilies() {
		switch f {
		case pb.IpFamily_IP_FAMILY_IPV4:
			svc.Spec.IPFamilies = append(svc.Spec.IPFamilies, v1.IPv4Protocol)
		case pb.IpFamily_IP_FAMILY_IPV6:
			svc.Spec.IPFamilies = append(svc.Spec.IPFamilies, v1.IPv6Protocol)
		}
	}
	if c := s.GetLoadBalancerClass(); c != "" {
		svc.Spec.LoadBalancerClass = &c
	}
	return svc
}

// toLoadBalancerStatus is the Kubernetes status of a protocol status (the Service's current ingress).
func toLoadBalancerStatus(in *pb.LoadBalancerStatus) v1.LoadBalancerStatus {
	out := v1.LoadBalancerStatus{}
	for _, i := range in.GetIngress() {
		ingress := v1.LoadBalancerIngress{IP: i.GetIp(), Hostname: i.GetHostname()}
		switch i.GetIpMode() {
		case pb.IpMode_IP_MODE_VIP:
			mode := v1.LoadBalancerIPModeVIP
			ingress.IPMode = &mode
		case pb.IpMode_IP_MODE_PROXY:
			mode := v1.LoadBalancerIPModeProxy
			ingress.IPMode = &mode
		}
		for _, p := range i.GetPorts() {
			status := v1.PortStatus{Port: int32(p.GetPort()), Protocol: protocols[p.GetProtocol()]}
			if e := p.GetError(); e != "" {
				status.Error = &e
			}
			ingress.Ports = append(ingress.Ports, status)
		}
		out.Ingress = append(out.Ingress, ingress)
	}
	return out
}

// fromStatus is the protocol's load balancer status: ingress IPs or hostnames, IP modes and
// per-port status.
func fromStatus(in *v1.LoadBalancerStatus) *pb.LoadBalancerStatus {
	out := &pb.LoadBalancerStatus{}
	if in == nil {
		return out
	}
	for _, i := range in.Ingress {
		ingress := &pb.LoadBalancerIngress{Ip: i.IP, Hostname: i.Hostname}
		if i.IPMode != nil {
			switch *i.IPMode {
			case v1.LoadBalancerIPModeVIP:
				ingress.IpMode = pb.IpMode_IP_MODE_VIP
			case v1.LoadBalancerIPModeProxy:
				ingress.IpMode = pb.IpMode_IP_MODE_PROXY
			}
		}
		for _, p := range i.Ports {
			status := &pb.PortStatus{Port: uint32(p.Port), Protocol: pb.Protocol_PROTOCOL_TCP}
			for pt, kt := range protocols {
				if kt == p.Protocol {
					status.Protocol = pt
				}
			}
			if p.Error != nil {
				status.Error = *p.Error
			}
			ingress.Ports = append(ingress.Ports, status)
		}
		out.Ingress = append(out.Ingress, ingress)
	}
	return out
}
