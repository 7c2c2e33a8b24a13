//! The kubelet-side node plugin: NodeMetadataService (and optionally ImageCredentialsService)
//! with IdentityService beside it, on a unix socket on each node.
//!
//! A provider's plugin is its [`NodeMetadata`](crate::NodeMetadata) implementation plus a
//! few lines:
//!
//! ```no_run
//! # use std::sync::Arc;
//! # struct Imds;
//! # #[ccm_provider_sdk::async_trait]
//! # impl ccm_provider_sdk::NodeMetadata for Imds {
//! #     async fn node_metadata(&self) -> ccm_provider_sdk::Result<ccm_provider_sdk::proto::InstanceMetadata> {
//! #         unimplemented!()
//! #     }
//! # }
//! # async fn run() -> Result<(), ccm_provider_sdk::server::ServeError> {
//! use ccm_provider_sdk::{ProviderServer, node_plugin};
//! let name = "example.cloudprovider.dev";
//! ProviderServer::new(name, "1.0.0")
//!     .provider_id_scheme("example")
//!     .node_metadata(Arc::new(Imds))
//!     .serve(&node_plugin::default_listen(name))
//!     .await
//! # }
//! ```
//!
//! The socket is created with mode 0600 (the kubelet and `ccm-node-metadata` run as root);
//! `ccm-node-metadata` on the node reads it before the kubelet starts and as the kubelet's
//! image credential provider.

use std::net::IpAddr;
use std::path::PathBuf;

use ccm_proto::v1::{InstanceMetadata, NodeAddressType};

use crate::error::{Error, Result};
use crate::server::Listen;
use crate::validate::valid_label_value;

/// Where node plugins put their sockets: the kubelet's plugin directory.
pub const PLUGIN_DIR: &str = "/var/lib/kubelet/plugins";
/// The socket file name inside a plugin's directory.
pub const SOCKET_NAME: &str = "node-metadata.sock";

/// The default socket of the plugin named `plugin_name`:
/// `/var/lib/kubelet/plugins/<plugin_name>/node-metadata.sock`.
pub fn default_socket(plugin_name: &str) -> PathBuf {
    PathBuf::from(PLUGIN_DIR).join(plugin_name).join(SOCKET_NAME)
}

/// [`default_socket`] as a listen address.
pub fn default_listen(plugin_name: &str) -> Listen {
    Listen::Unix(default_socket(plugin_name))
}

/// Checks a NodeMetadata answer: an instance id and a providerID of the form
/// `<scheme>://<rest>`, zone, region and instance type usable as label values, addresses
/// that are IP addresses (or names, for Hostname and DNS types), no whitespace anywhere a
/// kubelet flag carries it.
pub fn check_metadata(m: &InstanceMetadata) -> Result<()> {
    let bad = |what: String| Err(Error::internal(format!("invalid node metadata: {what}")));
    if m.instance_id.is_empty() {
        return bad("no instance_id".into());
    }
    match m.provider_id.split_once("://") {
        Some((scheme, rest)) if !scheme.is_empty() && !rest.is_empty() => {}
        _ => return bad(format!("provider_id {:?} is not <scheme>://<id>", m.provider_id)),
    }
    if m.provider_id.chars().any(|c| c.is_whitespace() || c == ',' || c.is_control()) {
        return bad(format!("provider_id {:?} contains whitespace or a comma", m.provider_id));
    }
    for (field, value) in [("zone", &m.zone), ("region", &m.region), ("instance_type", &m.instance_type)] {
        if !valid_label_value(value) {
            return bad(format!("{field} {value:?} is not a valid label value"));
        }
    }
    for a in &m.addresses {
        let kind = NodeAddressType::try_from(a.r#type).unwrap_or(NodeAddressType::Unspecified);
        match kind {
            NodeAddressType::InternalIp | NodeAddressType::ExternalIp => {
                if a.address.parse::<IpAddr>().is_err() {
                    return bad(format!("address {:?} of type {} is not an IP address", a.address, kind.as_str_name()));
                }
            }
            NodeAddressType::Hostname | NodeAddressType::InternalDns | NodeAddressType::ExternalDns => {
                if a.address.is_empty() || a.address.chars().any(|c| c.is_whitespace() || c.is_control()) {
                    return bad(format!("address {:?} of type {} is not a name", a.address, kind.as_str_name()));
                }
            }
            NodeAddressType::Unspecified => return bad(format!("address {:?} has no type", a.address)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ccm_proto::v1::NodeAddress;

    fn good() -> InstanceMetadata {
        InstanceMetadata {
            instance_id: "i-1".into(),
            provider_id: "sim://zone-a/i-1".into(),
            zone: "zone-a".into(),
            region: "region".into(),
            instance_type: "m.large".into(),
            addresses: vec![NodeAddress { r#type: NodeAddressType::InternalIp as i32, address: "10.0.0.1".into() }],
            ..Default::default()
        }
    }

    #[test]
    fn default_socket_is_under_the_kubelet_plugin_dir() {
        let p = default_socket("sim.cloudprovider.dev");
        assert_eq!(p, PathBuf::from("/var/lib/kubelet/plugins/sim.cloudprovider.dev/node-metadata.sock"));
        assert!(matches!(default_listen("x"), Listen::Unix(p) if p.extension().is_some_and(|e| e == "sock")));
    }

    #[test]
    fn metadata_checks() {
        assert!(check_metadata(&good()).is_ok());
        type Change = fn(&mut InstanceMetadata);
        let cases: [(&str, Change); 7] = [
            ("instance_id", |m| m.instance_id.clear()),
            ("provider_id", |m| m.provider_id = "i-1".into()),
            ("provider_id", |m| m.provider_id = "sim://a b".into()),
            ("zone", |m| m.zone = "zone a".into()),
            ("instance_type", |m| m.instance_type = "-x".into()),
            ("not an IP", |m| m.addresses[0].address = "ten".into()),
            ("no type", |m| m.addresses[0].r#type = 0),
        ];
        for (want, change) in cases {
            let mut m = good();
            change(&mut m);
            let err = check_metadata(&m).expect_err(want);
            assert!(err.to_string().contains(want), "{err} should mention {want}");
        }
    }
}
