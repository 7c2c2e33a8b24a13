//! Prometheus metrics of a provider: the calls its server answers
//! (`cloudprovider_server_*`, [`CallMetrics`]) beside whatever the provider registers of its
//! own (its cloud API's latency, errors, throttling), served at `/metrics` on an endpoint of
//! their own ([`crate::ProviderServer::metrics`], a sidecar's `--metrics-listen`):
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use ccm_provider_sdk::{ProviderServer, metrics::CallMetrics};
//! # use prometheus_client::registry::Registry;
//! let mut registry = Registry::default();
//! let calls = Arc::new(CallMetrics::register(&mut registry));
//! // registry.register("mycloud_api_requests", "…", my_counter.clone());
//! let server = ProviderServer::new("mycloud.example.com", "1.0.0")
//!     .observe(calls)
//!     .metrics("unix:///var/run/ccm/metrics.sock".parse().expect("endpoint"), Arc::new(registry));
//! ```

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tonic::Code;

use crate::server::{CallObserver, Listen, ServeError};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    method: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabels {
    method: String,
}

/// `cloudprovider_server_calls_total{method,code}` and
/// `cloudprovider_server_call_duration_seconds{method}`; register with [`CallMetrics::register`]
/// and hand to [`crate::ProviderServer::observe`].
#[derive(Debug, Clone)]
pub struct CallMetrics {
    calls: Family<CallLabels, Counter>,
    duration: Family<MethodLabels, Histogram>,
}

impl Default for CallMetrics {
    fn default() -> Self {
        Self {
            calls: Family::default(),
            duration: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.0005, 2.0, 16))),
        }
    }
}

impl CallMetrics {
    /// New metrics, registered in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register("cloudprovider_server_calls", "Calls answered, by method and gRPC code", m.calls.clone());
        registry.register("cloudprovider_server_call_duration_seconds", "Time to answer a call, by method", m.duration.clone());
        m
    }
}

pub use ccm_protocol::error::code_name;

impl CallObserver for CallMetrics {
    fn observe(&self, method: &'static str, code: Code, elapsed: Duration) {
        self.calls.get_or_create(&CallLabels { method: method.to_string(), code: code_name(code).to_string() }).inc();
        self.duration.get_or_create(&MethodLabels { method: method.to_string() }).observe(elapsed.as_secs_f64());
    }
}

/// Serves `registry` in Prometheus' text format at `GET /metrics` on `listen` (plain HTTP
/// over TCP, or a unix socket of `mode`) until `shutdown` resolves.
pub async fn serve(
    registry: Arc<Registry>,
    listen: &Listen,
    mode: u32,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let registry = registry.clone();
            async move {
                let mut text = String::new();
                match prometheus_client::encoding::text::encode(&mut text, &registry) {
                    Ok(()) => (
                        axum::http::StatusCode::OK,
                        [(axum::http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
                        text,
                    ),
                    Err(e) => (
                        axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                        [(axum::http::header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                        format!("encoding the metrics failed: {e}"),
                    ),
                }
            }
        }),
    );
    let bind_error = |source| ServeError::Bind { path: listen.to_string(), source };
    tracing::info!(endpoint = %listen, "serving the provider's metrics at /metrics");
    match listen {
        Listen::Tcp(addr) => {
            let listener = tokio::net::TcpListener::bind(addr).await.map_err(bind_error)?;
            axum::serve(listener, app).with_graceful_shutdown(shutdown).await.map_err(bind_error)
        }
        Listen::Unix(path) => {
            let listener = crate::server::bind_unix(path, mode)?;
            let result = axum::serve(listener, app).with_graceful_shutdown(shutdown).await.map_err(bind_error);
            let _ = std::fs::remove_file(path);
            result
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_calls_by_method_and_code() {
        let mut registry = Registry::default();
        let m = CallMetrics::register(&mut registry);
        m.observe("InstancesService/InstanceExists", Code::Ok, Duration::from_millis(2));
        m.observe("InstancesService/InstanceExists", Code::ResourceExhausted, Duration::from_millis(1));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        assert!(
            text.contains(
                r#"cloudprovider_server_calls_total{method="InstancesService/InstanceExists",code="RESOURCE_EXHAUSTED"} 1"#
            ),
            "{text}"
        );
        assert!(text.contains("cloudprovider_server_call_duration_seconds_count"), "{text}");
    }

    #[tokio::test]
    async fn the_registry_is_served_at_metrics() {
        let mut registry = Registry::default();
        let calls = CallMetrics::register(&mut registry);
        calls.observe("InstancesService/InstanceExists", Code::Ok, Duration::from_millis(3));
        let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        let addr = probe.local_addr().expect("addr");
        drop(probe);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            serve(Arc::new(registry), &Listen::Tcp(addr), 0o600, async move {
                let _ = stopped.await;
            })
            .await
        });
        let mut text = String::new();
        for _ in 0..100 {
            if let Ok(mut s) = tokio::net::TcpStream::connect(addr).await {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.expect("write");
                s.read_to_string(&mut text).await.expect("read");
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(
            text.contains("cloudprovider_server_calls_total{method=\"InstancesService/InstanceExists\",code=\"OK\"} 1"),
            "{text}"
        );
        let _ = stop.send(());
        server.await.expect("joined").expect("stopped cleanly");
    }
}
