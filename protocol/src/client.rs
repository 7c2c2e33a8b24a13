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
    /// Plaintext TCP to a host other than this one, not allowed explicitly.
    #[error(
        "provider endpoint {0}: plaintext TCP to another host carries every call (node and load balancer data, and the \
         power to change them) in the clear; use a unix socket or mutual TLS (--provider-tls-cert-file, …), or allow it \
         explicitly (--provider-allow-insecure-tcp)"
    )]
    Insecure(String),
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

/// A channel that connects on first use and reconnects after failures. Plaintext TCP
/// (`tcp://`, `http://`) only to a loopback address ([`plaintext_allowed`]).
pub fn connect_lazy(address: &str) -> Result<Channel, ClientError> {
    connect_lazy_allowing(address, false)
}

/// [`connect_lazy`], also over plaintext TCP to another host when `insecure_tcp`.
pub fn connect_lazy_allowing(address: &str, insecure_tcp: bool) -> Result<Channel, ClientError> {
    if !insecure_tcp && !plaintext_allowed(address) {
        return Err(ClientError::Insecure(address.to_string()));
    }
    Ok(endpoint(address)?.connect_lazy())
}

/// Whether `address` may be dialled without TLS: a unix socket, or TCP to a loopback address
/// (`127.0.0.0/8`, `::1`, `localhost`): traffic that never leaves the host (a sidecar in the
/// same pod, a test).
pub fn plaintext_allowed(address: &str) -> bool {
    let Some(rest) = address.strip_prefix("tcp://").or_else(|| address.strip_prefix("http://")) else {
        return true; // unix sockets; https is TLS; anything else is refused by `endpoint`
    };
    let host = rest.rsplit_once(':').map_or(rest, |(host, _)| host).trim_start_matches('[').trim_end_matches(']');
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plaintext_tcp_only_to_this_host_unless_allowed() {
        for ok in ["unix:///run/p.sock", "tcp://127.0.0.1:9000", "http://[::1]:9000", "tcp://localhost:9000"] {
            assert!(plaintext_allowed(ok), "{ok}");
        }
        for refused in ["tcp://10.0.0.5:9000", "http://provider.example:9000", "tcp://0.0.0.0:9000"] {
            assert!(!plaintext_allowed(refused), "{refused}");
            let err = connect_lazy(refused).expect_err(refused).to_string();
            assert!(err.contains("--provider-allow-insecure-tcp"), "{err}");
        }
    }

    #[tokio::test]
    async fn plaintext_tcp_to_another_host_when_allowed() {
        assert!(connect_lazy_allowing("tcp://10.0.0.5:9000", true).is_ok());
    }
}
