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

use std::path::PathBuf;

pub use ccm_protocol::answer::node_metadata as check_metadata;

use crate::server::Listen;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_socket_is_under_the_kubelet_plugin_dir() {
        let p = default_socket("sim.cloudprovider.dev");
        assert_eq!(p, PathBuf::from("/var/lib/kubelet/plugins/sim.cloudprovider.dev/node-metadata.sock"));
        assert!(matches!(default_listen("x"), Listen::Unix(p) if p.extension().is_some_and(|e| e == "sock")));
    }
}
