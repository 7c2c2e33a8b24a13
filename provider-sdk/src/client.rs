//! Connecting to a provider endpoint: `unix:///path/provider.sock`, `http://host:port` or
//! `tcp://host:port`.

use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

/// Errors connecting to a provider.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The address is not one this client understands.
    #[error("invalid provider endpoint {0:?}: expected unix:///path.sock, http://host:port or tcp://host:port")]
    Address(String),
    /// The connection failed.
    #[error("cannot connect to provider at {address}")]
    Connect {
        /// The endpoint.
        address: String,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
}

/// The tonic endpoint for an address, with a connect timeout and keep-alive.
pub fn endpoint(address: &str) -> Result<Endpoint, ClientError> {
    let uri = if let Some(rest) = address.strip_prefix("tcp://") {
        format!("http://{rest}")
    } else if address.starts_with("unix:///") || address.starts_with("http://") || address.starts_with("https://") {
        address.to_string()
    } else {
        return Err(ClientError::Address(address.to_string()));
    };
    Ok(Endpoint::from_shared(uri)
        .map_err(|_| ClientError::Address(address.to_string()))?
        .connect_timeout(Duration::from_secs(5))
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_while_idle(true))
}

/// The largest message either side of cloudprovider.v1 sends or accepts: 64 MiB, where gRPC's
/// default is 4 MiB. An EnsureLoadBalancer for 5000 Nodes with their labels is about 7 MB.
pub const MAX_MESSAGE_SIZE: usize = 64 << 20;

/// Connects now; fails when nothing answers.
pub async fn connect(address: &str) -> Result<Channel, ClientError> {
    endpoint(address)?.connect().await.map_err(|source| ClientError::Connect { address: address.to_string(), source })
}

/// A channel that connects on first use and reconnects after failures.
pub fn connect_lazy(address: &str) -> Result<Channel, ClientError> {
    Ok(endpoint(address)?.connect_lazy())
}
