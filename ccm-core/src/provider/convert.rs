//! Kubernetes objects to `cloudprovider.v1` messages and back, at the one boundary where the
//! core talks to the provider.

use ccm_proto::v1 as pb;
use k8s_openapi::api::core::v1::{Node, NodeAddress};

use crate::node_util::{addresses, name, provider_id};

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
