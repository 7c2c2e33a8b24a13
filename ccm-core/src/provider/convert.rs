//! Kubernetes objects to `cloudprovider.v1` messages and back, at the one boundary where the
//! core talks to the provider.

use ccm_proto::v1 as pb;
use ccm_protocol::answer;
use k8s_openapi::api::core::v1::{LoadBalancerIngress, Node, NodeAddress, PortStatus, Service, ServicePort};

use crate::node_util::{addresses, name, provider_id};
use crate::wellknown::ANNOTATION_LOAD_BALANCER_NAME;

/// The instances behind some Nodes, as the provider is asked about them (one lookup per Node,
/// in order).
#[derive(Debug, Clone, Default)]
pub struct InstanceLookups(pub(crate) Vec<pb::InstanceLookup>);

impl InstanceLookups {
    /// One lookup per Node, in order.
    pub fn of<'a>(nodes: impl IntoIterator<Item = &'a Node>) -> Self {
        Self(nodes.into_iter().map(lookup).collect())
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// An instance's state, as the cloud reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstanceState {
    /// The provider did not say.
    Unknown,
    /// Running.
    Running,
    /// Stopped (shut down), not gone.
    Stopped,
    /// Terminated: gone.
    Terminated,
}

/// What the cloud says of one instance, checked ([`ccm_protocol::answer::instance`]) and in
/// Kubernetes' terms.
#[derive(Debug, Clone, PartialEq)]
pub struct Instance {
    /// Its providerID.
    pub provider_id: String,
    /// Its addresses (those of a type Kubernetes has).
    pub addresses: Vec<NodeAddress>,
    /// Zone, region and instance type; empty when the cloud has none.
    pub zone: String,
    /// The region.
    pub region: String,
    /// The instance type.
    pub instance_type: String,
    /// Labels the provider offers for its Node.
    pub additional_labels: std::collections::BTreeMap<String, String>,
    /// Its tags, when the provider puts them in the metadata.
    pub tags: std::collections::BTreeMap<String, String>,
    /// Its state.
    pub state: InstanceState,
    /// The pod CIDRs the cloud gave it (checked by `answer::pod_cidrs`), when the provider
    /// advertises them.
    pub pod_cidrs: Vec<String>,
}

impl From<pb::InstanceMetadata> for Instance {
    fn from(m: pb::InstanceMetadata) -> Self {
        let state = match m.state() {
            pb::InstanceState::Running => InstanceState::Running,
            pb::InstanceState::Stopped => InstanceState::Stopped,
            pb::InstanceState::Terminated => InstanceState::Terminated,
            _ => InstanceState::Unknown,
        };
        Self {
            addresses: m.addresses.iter().filter_map(from_proto_address).collect(),
            provider_id: m.provider_id,
            zone: m.zone,
            region: m.region,
            instance_type: m.instance_type,
            additional_labels: m.additional_labels.into_iter().collect(),
            tags: m.tags.into_iter().collect(),
            state,
            pod_cidrs: m.pod_cidrs,
        }
    }
}

/// What a provider needs to find the instance behind a Node.
pub fn lookup(node: &Node) -> pb::InstanceLookup {
    let labels = node.metadata.labels.clone().unwrap_or_default();
    pb::InstanceLookup {
        provider_id: provider_id(node).unwrap_or_default().to_string(),
        node_name: name(node).to_string(),
        addresses: addresses(node).iter().map(to_proto_address).collect(),
        hostname: labels.get("kubernetes.io/hostname").cloned().unwrap_or_default(),
        labels: labels.into_iter().collect(),
    }
}

/// A Kubernetes address type to the protocol's.
pub fn to_proto_address(a: &NodeAddress) -> pb::NodeAddress {
    use pb::NodeAddressType as T;
    let t = match a.type_.as_str() {
        "Hostname" => T::Hostname,
        "InternalIP" => T::InternalIp,
        "ExternalIP" => T::ExternalIp,
        "InternalDNS" => T::InternalDns,
        "ExternalDNS" => T::ExternalDns,
        _ => T::Unspecified,
    };
    pb::NodeAddress { r#type: t as i32, address: a.address.clone() }
}

/// The protocol's address to Kubernetes'; `None` for an unspecified type.
pub fn from_proto_address(a: &pb::NodeAddress) -> Option<NodeAddress> {
    use pb::NodeAddressType as T;
    let t = match a.r#type() {
        T::Hostname => "Hostname",
        T::InternalIp => "InternalIP",
        T::ExternalIp => "ExternalIP",
        T::InternalDns => "InternalDNS",
        T::ExternalDns => "ExternalDNS",
        T::Unspecified => return None,
    };
    Some(NodeAddress { type_: t.into(), address: a.address.clone() })
}

/// A Kubernetes protocol name (`TCP`, `UDP`, `SCTP`; TCP when unset, as the API defaults it)
/// to the protocol's.
pub fn protocol(name: Option<&str>) -> pb::Protocol {
    match name.unwrap_or("TCP") {
        "UDP" => pb::Protocol::Udp,
        "SCTP" => pb::Protocol::Sctp,
        _ => pb::Protocol::Tcp,
    }
}

/// The protocol's protocol to its Kubernetes name.
pub fn protocol_name(protocol: pb::Protocol) -> &'static str {
    match protocol {
        pb::Protocol::Udp => "UDP",
        pb::Protocol::Sctp => "SCTP",
        _ => "TCP",
    }
}

/// A port's targetPort as text (a number or a port name); empty when unset.
pub fn target_port(p: &ServicePort) -> String {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    match &p.target_port {
        Some(IntOrString::Int(n)) => n.to_string(),
        Some(IntOrString::String(s)) => s.clone(),
        None => String::new(),
    }
}

/// A pod endpoint a load balancer may forward a port to directly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortEndpoint {
    /// The pod's address.
    pub address: String,
    /// The pod's port.
    pub port: u32,
    /// The Node the pod runs on.
    pub node_name: String,
}

/// What the core sends of a Service to ensure, update or delete its load balancer, made once
/// per reconcile; [`LoadBalancerRequest::named`] gives it under each name it is asked about.
#[derive(Debug, Clone)]
pub struct LoadBalancerRequest(pb::LoadBalancerService);

impl LoadBalancerRequest {
    /// `svc` as a load balancer of `cluster_name` named `load_balancer_name`. `source_ranges`
    /// are the Service's, already read and checked (they are read once per reconcile);
    /// `endpoints` gives the pod endpoints of a port, when its load balancer is given them.
    pub fn new(
        svc: &Service,
        cluster_name: &str,
        load_balancer_name: String,
        source_ranges: Vec<String>,
        endpoints: impl Fn(&ServicePort) -> Vec<PortEndpoint>,
    ) -> Self {
        let spec = svc.spec.clone().unwrap_or_default();
        let ports = spec
            .ports
            .iter()
            .flatten()
            .map(|p| pb::ServicePort {
                name: p.name.clone().unwrap_or_default(),
                protocol: protocol(p.protocol.as_deref()) as i32,
                port: p.port.max(0) as u32,
                node_port: p.node_port.unwrap_or(0).max(0) as u32,
                app_protocol: p.app_protocol.clone().unwrap_or_default(),
                target_port: target_port(p),
                endpoints: endpoints(p)
                    .into_iter()
                    .map(|e| pb::PortEndpoint { address: e.address, port: e.port, node_name: e.node_name })
                    .collect(),
            })
            .collect();
        let affinity = if spec.session_affinity.as_deref() == Some("ClientIP") {
            pb::SessionAffinity::ClientIp
        } else {
            pb::SessionAffinity::None
        };
        let traffic_policy = if spec.external_traffic_policy.as_deref() == Some("Local") {
            pb::ExternalTrafficPolicy::Local
        } else {
            pb::ExternalTrafficPolicy::Cluster
        };
        let family_policy = match spec.ip_family_policy.as_deref() {
            Some("SingleStack") => pb::IpFamilyPolicy::SingleStack,
            Some("PreferDualStack") => pb::IpFamilyPolicy::PreferDualStack,
            Some("RequireDualStack") => pb::IpFamilyPolicy::RequireDualStack,
            _ => pb::IpFamilyPolicy::Unspecified,
        };
        Self(pb::LoadBalancerService {
            cluster_name: cluster_name.to_string(),
            load_balancer_name,
            namespace: svc.metadata.namespace.clone().unwrap_or_default(),
            name: svc.metadata.name.clone().unwrap_or_default(),
            uid: svc.metadata.uid.clone().unwrap_or_default(),
            ports,
            session_affinity: affinity as i32,
            session_affinity_timeout_seconds: spec
                .session_affinity_config
                .and_then(|c| c.client_ip)
                .and_then(|c| c.timeout_seconds)
                .unwrap_or(0)
                .max(0) as u32,
            source_ranges,
            ip_families: spec
                .ip_families
                .unwrap_or_default()
                .iter()
                .map(|f| if f == "IPv6" { pb::IpFamily::Ipv6 } else { pb::IpFamily::Ipv4 } as i32)
                .collect(),
            requested_ip: spec.load_balancer_ip.unwrap_or_default(),
            external_traffic_policy: traffic_policy as i32,
            health_check_node_port: spec.health_check_node_port.unwrap_or(0).max(0) as u32,
            // The core's own records (the name, what was ensured) are not the Service's: no
            // provider sees them.
            annotations: svc
                .metadata
                .annotations
                .clone()
                .unwrap_or_default()
                .into_iter()
                .filter(|(k, _)| k != ANNOTATION_LOAD_BALANCER_NAME && k != crate::wellknown::ANNOTATION_LOAD_BALANCER_ENSURED)
                .collect(),
            load_balancer_class: spec.load_balancer_class.unwrap_or_default(),
            external_ips: spec.external_ips.unwrap_or_default(),
            allocate_load_balancer_node_ports: spec.allocate_load_balancer_node_ports,
            ip_family_policy: family_policy as i32,
            labels: svc.metadata.labels.clone().unwrap_or_default().into_iter().collect(),
            current_status: Some(current_status(svc)),
        })
    }

    /// The same Service, asked about under `load_balancer_name`.
    pub fn named(&self, load_balancer_name: &str) -> Self {
        Self(pb::LoadBalancerService { load_balancer_name: load_balancer_name.to_string(), ..self.0.clone() })
    }

    /// The load balancer's name.
    pub fn load_balancer_name(&self) -> &str {
        &self.0.load_balancer_name
    }

    /// The message.
    pub fn proto(&self) -> &pb::LoadBalancerService {
        &self.0
    }

    /// A request of a message made by hand (a test's, a tool's).
    pub fn from_proto(service: pb::LoadBalancerService) -> Self {
        Self(service)
    }

    /// The message, taken.
    pub fn into_proto(self) -> pb::LoadBalancerService {
        self.0
    }
}

/// The Service's status.loadBalancer in the protocol's terms (what the load balancer had).
fn current_status(svc: &Service) -> pb::LoadBalancerStatus {
    let ingress = svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|l| l.ingress.as_ref());
    pb::LoadBalancerStatus {
        ingress: ingress
            .into_iter()
            .flatten()
            .map(|i| pb::LoadBalancerIngress {
                ip: i.ip.clone().unwrap_or_default(),
                hostname: i.hostname.clone().unwrap_or_default(),
                ip_mode: match i.ip_mode.as_deref() {
                    Some("Proxy") => pb::IpMode::Proxy,
                    Some("VIP") => pb::IpMode::Vip,
                    _ => pb::IpMode::Unspecified,
                } as i32,
                ports: i
                    .ports
                    .iter()
                    .flatten()
                    .map(|p| pb::PortStatus {
                        port: p.port.max(0) as u32,
                        protocol: protocol(Some(&p.protocol)) as i32,
                        error: p.error.clone().unwrap_or_default(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// A load balancer's status as the Service's `status.loadBalancer.ingress`: an address's
/// `ipMode` is `Proxy` when the provider says so, else `VIP`.
pub fn ingress(status: &pb::LoadBalancerStatus) -> Vec<LoadBalancerIngress> {
    status
        .ingress
        .iter()
        .map(|i| {
            let ip = (!i.ip.is_empty()).then(|| i.ip.clone());
            let ports: Vec<PortStatus> = i
                .ports
                .iter()
                .map(|p| PortStatus {
                    port: i32::try_from(p.port).unwrap_or(i32::MAX),
                    protocol: protocol_name(p.protocol()).to_string(),
                    error: (!p.error.is_empty()).then(|| p.error.clone()),
                })
                .collect();
            LoadBalancerIngress {
                ip_mode: ip.as_ref().map(|_| if i.ip_mode() == pb::IpMode::Proxy { "Proxy" } else { "VIP" }.to_string()),
                ip,
                hostname: (!i.hostname.is_empty()).then(|| i.hostname.clone()),
                ports: (!ports.is_empty()).then_some(ports),
            }
        })
        .collect()
}

/// A route's target: a Node and its instance.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouteTarget {
    /// The Node's name.
    pub node_name: String,
    /// Its providerID; empty when not known.
    pub provider_id: String,
}

/// A cloud route, as the route controller plans with it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Route {
    /// Its name in the cloud.
    pub name: String,
    /// The Node it routes to; none when the provider cannot say.
    pub target: Option<RouteTarget>,
    /// The destination: a Node's podCIDR.
    pub destination_cidr: String,
    /// Its table.
    pub table_id: String,
    /// Whether it routes nowhere (its instance is gone).
    pub blackhole: bool,
    /// The target's addresses, when the provider records them.
    pub target_addresses: Vec<NodeAddress>,
}

impl From<pb::Route> for Route {
    fn from(r: pb::Route) -> Self {
        Self {
            target: r.target.map(|t| RouteTarget { node_name: t.node_name, provider_id: t.provider_id }),
            target_addresses: r.target_addresses.iter().filter_map(from_proto_address).collect(),
            name: r.name,
            destination_cidr: r.destination_cidr,
            table_id: r.table_id,
            blackhole: r.blackhole,
        }
    }
}

impl From<&Route> for pb::Route {
    fn from(r: &Route) -> Self {
        Self {
            name: r.name.clone(),
            target: r.target.as_ref().map(pb::RouteTarget::from),
            destination_cidr: r.destination_cidr.clone(),
            table_id: r.table_id.clone(),
            blackhole: r.blackhole,
            target_addresses: r.target_addresses.iter().map(to_proto_address).collect(),
        }
    }
}

impl From<&RouteTarget> for pb::RouteTarget {
    fn from(t: &RouteTarget) -> Self {
        Self { node_name: t.node_name.clone(), provider_id: t.provider_id.clone() }
    }
}

/// A route table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouteTable {
    /// Its id.
    pub id: String,
    /// How many routes it holds at most; 0 when the provider says only per provider.
    pub max_routes: u32,
}

impl From<pb::RouteTable> for RouteTable {
    fn from(t: pb::RouteTable) -> Self {
        Self { id: t.id, max_routes: t.max_routes }
    }
}

/// What a provider's RoutesService can do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouteCapabilities {
    /// Routes may live in several tables (ResolveRouteTables says which).
    pub multiple_tables: bool,
    /// Routes record their target's addresses.
    pub target_addresses: bool,
    /// The routes a table holds at most; 0 when unbounded.
    pub max_routes_per_table: u32,
}

impl From<Option<&pb::RoutesCapabilities>> for RouteCapabilities {
    fn from(c: Option<&pb::RoutesCapabilities>) -> Self {
        c.map_or_else(Self::default, |c| Self {
            multiple_tables: c.multiple_tables,
            target_addresses: c.target_addresses,
            max_routes_per_table: c.max_routes_per_table,
        })
    }
}

/// A load balancer the provider lists, as recorded at Ensure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedLoadBalancer {
    /// Its name.
    pub load_balancer_name: String,
    /// The cluster it was ensured for; empty when the provider did not record it.
    pub cluster_name: String,
    /// Its Service's namespace.
    pub namespace: String,
    /// Its Service's name.
    pub name: String,
    /// Its Service's UID; empty when the provider did not record it.
    pub uid: String,
    /// Its backends now, by Node name and sorted, when the provider reports them.
    pub hosts: Option<Vec<String>>,
}

impl ListedLoadBalancer {
    /// The listing's item, its reported backends checked ([`answer::hosts`]).
    pub fn checked(l: pb::LoadBalancerSummary) -> Result<Self, String> {
        let hosts =
            l.hosts.map(sorted_hosts).transpose().map_err(|why| format!("load balancer {:?}: {why}", l.load_balancer_name))?;
        Ok(Self {
            load_balancer_name: l.load_balancer_name,
            cluster_name: l.cluster_name,
            namespace: l.namespace,
            name: l.name,
            uid: l.uid,
            hosts,
        })
    }
}

/// Reported backends, checked and sorted by name.
pub fn sorted_hosts(h: pb::LoadBalancerHosts) -> Result<Vec<String>, String> {
    answer::hosts(&h)?;
    let mut names = h.node_names;
    names.sort();
    Ok(names)
}

/// A Node as a load balancer backend.
pub fn load_balancer_node(node: &Node) -> pb::LoadBalancerNode {
    pb::LoadBalancerNode {
        name: name(node).to_string(),
        provider_id: provider_id(node).unwrap_or_default().to_string(),
        addresses: addresses(node).iter().map(to_proto_address).collect(),
        labels: node.metadata.labels.clone().unwrap_or_default().into_iter().collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_goes_to_the_service_and_comes_back_the_same() {
        let status = pb::LoadBalancerStatus {
            ingress: vec![
                pb::LoadBalancerIngress {
                    ip: "192.0.2.7".into(),
                    ip_mode: pb::IpMode::Proxy as i32,
                    ports: vec![pb::PortStatus { port: 53, protocol: pb::Protocol::Udp as i32, error: "Pending".into() }],
                    ..Default::default()
                },
                pb::LoadBalancerIngress { hostname: "lb.example".into(), ..Default::default() },
            ],
        };
        let ingress = ingress(&status);
        let json = serde_json::to_value(&ingress).expect("serializes");
        assert_eq!(
            json,
            serde_json::json!([
                { "ip": "192.0.2.7", "ipMode": "Proxy", "ports": [{ "port": 53, "protocol": "UDP", "error": "Pending" }] },
                { "hostname": "lb.example" },
            ])
        );
        let svc = Service {
            status: Some(k8s_openapi::api::core::v1::ServiceStatus {
                load_balancer: Some(k8s_openapi::api::core::v1::LoadBalancerStatus { ingress: Some(ingress) }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let back = current_status(&svc);
        assert_eq!(back.ingress[0], status.ingress[0]);
        assert_eq!(back.ingress[1].hostname, "lb.example");
    }
}
