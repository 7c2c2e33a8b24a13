//! The `cloudprovider.v1` protocol between the generic cloud-controller-manager core and a
//! cloud's provider sidecar. The `.proto` files next to this crate are the protocol
//! reference: every service, RPC, message and field is documented there.

/// Generated messages, clients (`*_client`) and servers (`*_server`) of `cloudprovider.v1`.
pub mod v1 {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("cloudprovider.v1");
}

/// The `domain` of every `google.rpc.ErrorInfo` this protocol's errors carry.
pub const ERROR_DOMAIN: &str = "cloudprovider.v1";
