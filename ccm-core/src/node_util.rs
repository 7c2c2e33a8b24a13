//! Well-known names and small helpers about Nodes: taints, conditions, labels, addresses.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ccm_proto::v1 as pb;
use k8s_openapi::api::core::v1::{Node, NodeAddress, Taint};

/// Set by a kubelet started with `--cloud-provider=external`; removed once initialised.
pub const TAINT_UNINITIALIZED: &str = "node.cloudprovider.kubernetes.io/uninitialized";
/// Put on Nodes whose instance is shut down.
pub const TAINT_SHUTDOWN: &str = "node.cloudprovider.kubernetes.io/shutdown";
/// The IP(s) the kubelet was told to use (`--node-ip`), which the cloud's addresses must hold.
pub const ANNOTATION_PROVIDED_NODE_IP: &str = "alpha.kubernetes.io/provided-node-ip";
/// Zone label.
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
/// Region label.
pub const LABEL_REGION: &str = "topology.kubernetes.io/region";
/// Instance type label.
pub const LABEL_INSTANCE_TYPE: &str = "node.kubernetes.io/instance-type";

/// Whether the Node carries a taint with this key.
pub fn has_taint(node: &Node, key: &str) -> bool {
    node.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == key))
}

/// The Node's taints without `key`.
pub fn taints_without(node: &Node, key: &str) -> Vec<Taint> {
    node.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default().into_iter().filter(|t| t.key != key).collect()
}

/// The status of the Ready condition; `None` when there is none.
pub fn ready_status(node: &Node) -> Option<&str> {
    node.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == "Ready").map(|c| c.status.as_str())
}

/// Ready=True. Unknown, False or no condition count as not ready (upstream semantics).
pub fn is_ready(node: &Node) -> bool {
    ready_status(node) == Some("True")
}

/// The Node's providerID, when set.
pub fn provider_id(node: &Node) -> Option<&str> {
    node.spec.as_ref()?.provider_id.as_deref().filter(|p| !p.is_empty())
}

/// The Node's name.
pub fn name(node: &Node) -> &str {
    node.metadata.name.as_deref().unwrap_or_default()
}

/// The Node's status addresses.
pub fn addresses(node: &Node) -> Vec<NodeAddress> {
    node.status.as_ref().and_then(|s| s.addresses.clone()).unwrap_or_default()
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

/// The addresses a Node should have: the cloud's, with the provided node IP(s) first when the
/// kubelet was given one (each must be among the cloud's addresses, or this fails), and the
/// Node's own Hostname address kept when the cloud reports none.
pub fn desired_addresses(node: &Node, cloud: &[pb::NodeAddress]) -> Result<Vec<NodeAddress>, String> {
    let mut out: Vec<NodeAddress> = Vec::new();
    for a in cloud.iter().filter_map(from_proto_address) {
        let ip_type = a.type_ == "InternalIP" || a.type_ == "ExternalIP";
        if ip_type && a.address.parse::<IpAddr>().is_err() {
            return Err(format!("the provider reported {:?} as an {}, which is not an IP", a.address, a.type_));
        }
        if !out.contains(&a) {
            out.push(a);
        }
    }
    if let Some(provided) = node.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_PROVIDED_NODE_IP)) {
        let mut first = Vec::new();
        for text in provided.split(',').map(str::trim) {
            let ip: IpAddr = text
                .parse()
                .map_err(|_| format!("annotation {ANNOTATION_PROVIDED_NODE_IP}={provided:?} is not an IP address"))?;
            let matching: Vec<NodeAddress> =
                out.iter().filter(|a| a.address.parse::<IpAddr>().ok() == Some(ip)).cloned().collect();
            if matching.is_empty() {
                return Err(format!("provided node IP {ip} is not one of the instance's addresses"));
            }
            first.extend(matching);
        }
        out.retain(|a| !first.contains(a));
        first.extend(out);
        out = first;
    }
    if !out.iter().any(|a| a.type_ == "Hostname")
        && let Some(hostname) = addresses(node).into_iter().find(|a| a.type_ == "Hostname")
    {
        out.push(hostname);
    }
    Ok(out)
}

pub use ccm_provider_sdk::validate::{valid_label_key, valid_label_value};

/// Whether a label key is in a domain the core never sets from provider data
/// (`kubernetes.io`, `k8s.io` and their subdomains).
pub fn reserved_label_domain(key: &str) -> bool {
    let Some((prefix, _)) = key.split_once('/') else { return false };
    ["kubernetes.io", "k8s.io"].iter().any(|d| prefix == *d || prefix.ends_with(&format!(".{d}")))
}

/// Parses a label selector of `k=v`, `k==v`, `k!=v`, `k` and `!k` terms joined by commas.
pub fn parse_selector(text: &str) -> Result<Vec<(String, Op)>, String> {
    let mut terms = Vec::new();
    for term in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let parsed = if let Some((k, v)) = term.split_once("!=") {
            (k.trim().to_string(), Op::NotEquals(v.trim().to_string()))
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            (k.trim().to_string(), Op::Equals(v.trim().to_string()))
        } else if let Some(k) = term.strip_prefix('!') {
            (k.trim().to_string(), Op::Absent)
        } else {
            (term.to_string(), Op::Present)
        };
        if !valid_label_key(&parsed.0) {
            return Err(format!("{term:?}: {:?} is not a label key", parsed.0));
        }
        terms.push(parsed);
    }
    if terms.is_empty() {
        return Err(format!("empty label selector {text:?}"));
    }
    Ok(terms)
}

/// One selector requirement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `k=v`.
    Equals(String),
    /// `k!=v`.
    NotEquals(String),
    /// `k`.
    Present,
    /// `!k`.
    Absent,
}

/// Whether labels match every term.
pub fn selector_matches(terms: &[(String, Op)], labels: &BTreeMap<String, String>) -> bool {
    terms.iter().all(|(k, op)| match op {
        Op::Equals(v) => labels.get(k) == Some(v),
        Op::NotEquals(v) => labels.get(k) != Some(v),
        Op::Present => labels.contains_key(k),
        Op::Absent => !labels.contains_key(k),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::NodeStatus;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn cloud() -> Vec<pb::NodeAddress> {
        vec![
            pb::NodeAddress { r#type: pb::NodeAddressType::InternalIp as i32, address: "10.0.0.5".into() },
            pb::NodeAddress { r#type: pb::NodeAddressType::InternalIp as i32, address: "10.0.1.5".into() },
            pb::NodeAddress { r#type: pb::NodeAddressType::ExternalIp as i32, address: "198.51.100.5".into() },
        ]
    }

    fn node(provided: Option<&str>) -> Node {
        let mut n = Node {
            metadata: ObjectMeta { name: Some("n".into()), ..Default::default() },
            status: Some(NodeStatus {
                addresses: Some(vec![NodeAddress { type_: "Hostname".into(), address: "n.local".into() }]),
                ..Default::default()
            }),
            ..Default::default()
        };
        if let Some(ip) = provided {
            n.metadata.annotations = Some([(ANNOTATION_PROVIDED_NODE_IP.to_string(), ip.to_string())].into());
        }
        n
    }

    #[test]
    fn provided_node_ip_goes_first_and_hostname_is_kept() {
        let got = desired_addresses(&node(Some("10.0.1.5")), &cloud()).expect("ok");
        let order: Vec<&str> = got.iter().map(|a| a.address.as_str()).collect();
        assert_eq!(order, vec!["10.0.1.5", "10.0.0.5", "198.51.100.5", "n.local"]);
        let plain = desired_addresses(&node(None), &cloud()).expect("ok");
        assert_eq!(plain[0].address, "10.0.0.5");
    }

    #[test]
    fn a_provided_node_ip_the_cloud_lacks_or_garbage_fails() {
        assert!(desired_addresses(&node(Some("10.9.9.9")), &cloud()).is_err());
        assert!(desired_addresses(&node(Some("not-an-ip")), &cloud()).is_err());
    }

    #[test]
    fn label_rules() {
        assert!(valid_label_key("tags.cloudprovider.dev/team"));
        assert!(valid_label_key("team"));
        assert!(!valid_label_key("tags.cloudprovider.dev/has space"));
        assert!(!valid_label_key("Tags.Example/x"));
        assert!(!valid_label_key(&format!("p/{}", "x".repeat(64))));
        assert!(valid_label_value("") && valid_label_value("a.b-c_d"));
        assert!(!valid_label_value("-a") && !valid_label_value("a b"));
        assert!(reserved_label_domain("node.kubernetes.io/x") && reserved_label_domain("k8s.io/x"));
        assert!(!reserved_label_domain("example.com/x") && !reserved_label_domain("plain"));
    }

    #[test]
    fn selectors() {
        let terms = parse_selector("type=virtual-kubelet,!gpu").expect("parse");
        let mut labels = BTreeMap::from([("type".to_string(), "virtual-kubelet".to_string())]);
        assert!(selector_matches(&terms, &labels));
        labels.insert("gpu".into(), "1".into());
        assert!(!selector_matches(&terms, &labels));
        assert!(parse_selector("").is_err());
        assert!(parse_selector("bad key=1").is_err());
    }
}
