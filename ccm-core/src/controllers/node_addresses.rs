//! Upstream's rules for what the node controller writes from the cloud's answer: the
//! addresses a Node should have (the kubelet's `--node-ip` first) and the GA topology labels it
//! lacks.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Node, NodeAddress};

use crate::node_util::addresses;
use crate::wellknown::{ANNOTATION_PROVIDED_NODE_IP, BETA_LABELS};

/// The GA topology labels a Node lacks while it carries their beta counterparts, with the
/// beta values. GA labels that exist are never changed here (see `ccm-core/README.md`).
pub fn missing_ga_labels(node: &Node) -> BTreeMap<String, String> {
    let Some(labels) = node.metadata.labels.as_ref() else { return BTreeMap::new() };
    BETA_LABELS
        .iter()
        .filter(|(_, ga)| !labels.contains_key(*ga))
        .filter_map(|(beta, ga)| labels.get(*beta).map(|v| (ga.to_string(), v.clone())))
        .collect()
}

/// Parses `alpha.kubernetes.io/provided-node-ip` as upstream does: one IP, or a dual-stack
/// pair (one IPv4 and one IPv6, neither unspecified), comma-separated.
pub fn parse_provided_node_ip(text: &str) -> Result<Vec<IpAddr>, String> {
    let mut ips = Vec::new();
    for part in text.split(',').map(str::trim) {
        let ip: IpAddr = part
            .parse()
            .map_err(|_| format!("annotation {ANNOTATION_PROVIDED_NODE_IP}={text:?}: {part:?} is not an IP address"))?;
        ips.push(ip);
    }
    let dual_pair = ips.len() == 2 && ips[0].is_ipv4() != ips[1].is_ipv4();
    if ips.len() > 2 || (ips.len() == 2 && !dual_pair) {
        return Err(format!(
            "annotation {ANNOTATION_PROVIDED_NODE_IP}={text:?} must hold one IP or a dual-stack pair (one IPv4, one IPv6)"
        ));
    }
    if ips.len() == 2 && ips.iter().any(IpAddr::is_unspecified) {
        return Err(format!("annotation {ANNOTATION_PROVIDED_NODE_IP}={text:?}: a dual-stack pair cannot hold 0.0.0.0 or ::"));
    }
    Ok(ips)
}

/// The addresses a Node should have, by upstream's rules: the cloud's addresses; when the
/// kubelet was given node IPs (`--node-ip`, seen in `alpha.kubernetes.io/provided-node-ip`),
/// every cloud address equal to one of them first, and of each address type such an address
/// has, only those (so a secondary InternalIP the administrator excluded is not advertised);
/// each node IP must be among the cloud's addresses, or this fails. The Node's own Hostname
/// address is kept when the cloud reports none. Empty when the cloud reports no address at
/// all: the Node keeps the addresses it has.
pub fn desired_addresses(node: &Node, cloud: &[NodeAddress]) -> Result<Vec<NodeAddress>, String> {
    let mut out: Vec<NodeAddress> = Vec::new();
    for a in cloud.iter().cloned() {
        let ip_type = a.type_ == "InternalIP" || a.type_ == "ExternalIP";
        if ip_type && a.address.parse::<IpAddr>().is_err() {
            return Err(format!("the provider reported {:?} as an {}, which is not an IP", a.address, a.type_));
        }
        if !out.contains(&a) {
            out.push(a);
        }
    }
    let provided = node.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_PROVIDED_NODE_IP));
    if out.is_empty() && provided.is_none() {
        // Nothing from the cloud: the Node keeps what its kubelet reported.
        return Ok(out);
    }
    if let Some(provided) = provided {
        let mut enforced: Vec<NodeAddress> = Vec::new();
        for ip in parse_provided_node_ip(provided)? {
            let before = enforced.len();
            enforced.extend(out.iter().filter(|a| a.address.parse::<IpAddr>().ok() == Some(ip)).cloned());
            if enforced.len() == before {
                return Err(format!("provided node IP {ip} is not one of the instance's addresses"));
            }
        }
        let enforced_types: Vec<String> = enforced.iter().map(|a| a.type_.clone()).collect();
        enforced.extend(out.into_iter().filter(|a| !enforced_types.contains(&a.type_)));
        out = enforced;
    }
    if !out.iter().any(|a| a.type_ == "Hostname")
        && let Some(hostname) = addresses(node).into_iter().find(|a| a.type_ == "Hostname")
    {
        out.push(hostname);
    }
    Ok(out)
}

/// Whether two address lists say the same: for every address type, the same addresses in the
/// same order (the first InternalIP is the Node's primary address, so order within a type
/// matters); how the types interleave does not.
pub fn same_addresses(a: &[NodeAddress], b: &[NodeAddress]) -> bool {
    fn by_type(list: &[NodeAddress]) -> BTreeMap<&str, Vec<&str>> {
        let mut m: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for x in list {
            m.entry(x.type_.as_str()).or_default().push(x.address.as_str());
        }
        m
    }
    a.len() == b.len() && by_type(a) == by_type(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wellknown::{LABEL_INSTANCE_TYPE, LABEL_ZONE};
    use k8s_openapi::api::core::v1::NodeStatus;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn cloud() -> Vec<NodeAddress> {
        vec![
            NodeAddress { type_: "InternalIP".into(), address: "10.0.0.5".into() },
            NodeAddress { type_: "InternalIP".into(), address: "10.0.1.5".into() },
            NodeAddress { type_: "ExternalIP".into(), address: "198.51.100.5".into() },
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

    fn order(got: &[NodeAddress]) -> Vec<String> {
        got.iter().map(|a| format!("{}={}", a.type_, a.address)).collect()
    }

    #[test]
    fn a_provided_node_ip_is_the_only_address_of_its_type_and_hostname_is_kept() {
        let got = desired_addresses(&node(Some("10.0.1.5")), &cloud()).expect("ok");
        assert_eq!(order(&got), vec!["InternalIP=10.0.1.5", "ExternalIP=198.51.100.5", "Hostname=n.local"]);
        let plain = desired_addresses(&node(None), &cloud()).expect("ok");
        assert_eq!(
            order(&plain),
            vec!["InternalIP=10.0.0.5", "InternalIP=10.0.1.5", "ExternalIP=198.51.100.5", "Hostname=n.local"]
        );
    }

    #[test]
    fn a_node_ip_of_both_types_and_dual_stack_pairs() {
        let mut cloud = cloud();
        cloud.push(NodeAddress { type_: "ExternalIP".into(), address: "10.0.1.5".into() });
        cloud.push(NodeAddress { type_: "InternalIP".into(), address: "fd00::5".into() });
        cloud.push(NodeAddress { type_: "InternalIP".into(), address: "fd00::6".into() });
        let got = desired_addresses(&node(Some("10.0.1.5")), &cloud).expect("ok");
        assert_eq!(order(&got), vec!["InternalIP=10.0.1.5", "ExternalIP=10.0.1.5", "Hostname=n.local"]);
        let got = desired_addresses(&node(Some("10.0.0.5,fd00::6")), &cloud).expect("ok");
        assert_eq!(
            order(&got),
            vec![
                "InternalIP=10.0.0.5",
                "InternalIP=fd00::6",
                "ExternalIP=198.51.100.5",
                "ExternalIP=10.0.1.5",
                "Hostname=n.local"
            ]
        );
    }

    #[test]
    fn a_provided_node_ip_the_cloud_lacks_or_garbage_fails() {
        assert!(desired_addresses(&node(Some("10.9.9.9")), &cloud()).is_err());
        assert!(desired_addresses(&node(Some("not-an-ip")), &cloud()).is_err());
        assert!(parse_provided_node_ip("10.0.0.5,10.0.1.5").is_err(), "two of one family");
        assert!(parse_provided_node_ip("10.0.0.5,fd00::5,fd00::6").is_err(), "three");
        assert!(parse_provided_node_ip("0.0.0.0,::").is_err(), "unspecified pair");
        assert_eq!(parse_provided_node_ip("fd00::5, 10.0.0.5").expect("pair").len(), 2);
    }

    #[test]
    fn addresses_compare_per_type_in_order() {
        let a = |t: &str, ip: &str| NodeAddress { type_: t.into(), address: ip.into() };
        let one = [a("InternalIP", "10.0.0.1"), a("ExternalIP", "1.2.3.4"), a("Hostname", "h")];
        let interleaved = [a("ExternalIP", "1.2.3.4"), a("Hostname", "h"), a("InternalIP", "10.0.0.1")];
        assert!(same_addresses(&one, &interleaved), "types interleaved differently: the same");
        let two = [a("InternalIP", "10.0.0.1"), a("InternalIP", "10.0.0.2")];
        let swapped = [a("InternalIP", "10.0.0.2"), a("InternalIP", "10.0.0.1")];
        assert!(!same_addresses(&two, &swapped), "a new primary InternalIP is a change");
        assert!(!same_addresses(&one[..2], &one), "an address added");
    }

    #[test]
    fn beta_labels_give_missing_ga_ones_only() {
        let mut n = node(None);
        n.metadata.labels = Some(
            [
                ("failure-domain.beta.kubernetes.io/zone".to_string(), "z1".to_string()),
                ("beta.kubernetes.io/instance-type".to_string(), "big".to_string()),
                (LABEL_INSTANCE_TYPE.to_string(), "other".to_string()),
            ]
            .into(),
        );
        assert_eq!(missing_ga_labels(&n), BTreeMap::from([(LABEL_ZONE.to_string(), "z1".to_string())]));
    }
}
