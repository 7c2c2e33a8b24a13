//! Connecting to a provider endpoint: `unix:///path/provider.sock`, `http://host:port` or
//! `tcp://host:port`, and `https://host:port` with mutual TLS ([`connect_lazy_tls`]).

use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

/// Errors connecting to a provider.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The address is not one this client understands.
    #[error("invalid provider endpoint {0:?}: expected unix:///path.sock, http://host:port or tcp://host:port")]
    Address(String),
    /// The TLS files cannot be used, or TLS was asked for a unix socket.
    #[error("provider TLS: {0}")]
    Tls(String),
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

pub use crate::limits::MAX_MESSAGE_SIZE;

/// Connects now; fails when nothing answers.
pub async fn connect(address: &str) -> Result<Channel, ClientError> {
    endpoint(address)?.connect().await.map_err(|source| ClientError::Connect { address: address.to_string(), source })
}

/// A channel that connects on first use and reconnects after failures.
pub fn connect_lazy(address: &str) -> Result<Channel, ClientError> {
    Ok(endpoint(address)?.connect_lazy())
}

/// [`connect_lazy`] over mutual TLS ([`crate::tls`]): `https://host:port` (or `tcp://`),
/// checking the provider's certificate for `server_name` (default: the host dialled).
pub fn connect_lazy_tls(address: &str, files: &crate::tls::TlsFiles, server_name: Option<&str>) -> Result<Channel, ClientError> {
    let rest = address
        .strip_prefix("https://")
        .or_else(|| address.strip_prefix("tcp://"))
        .ok_or_else(|| ClientError::Tls(format!("{address}: TLS needs a TCP endpoint, https://host:port")))?;
    let host = rest.rsplit_once(':').map_or(rest, |(host, _)| host).trim_start_matches('[').trim_end_matches(']');
    let config = files.client_config(server_name.unwrap_or(host)).map_err(|e| ClientError::Tls(e.to_string()))?;
    let endpoint = endpoint(&format!("https://{rest}"))?;
    Ok(endpoint.tls_config(config).map_err(|e| ClientError::Tls(e.to_string()))?.connect_lazy())
}
