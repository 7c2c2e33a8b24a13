//! The health and metrics server on `--secure-port`: `/healthz`, `/livez`, `/readyz` and
//! `/metrics`. HTTPS with a self-signed certificate made at start (as upstream does without
//! `--tls-cert-file`), or plain HTTP with `--insecure-serving` for local runs and tests.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;

use crate::metrics::Metrics;

/// What `/readyz` checks.
pub trait Readiness: Send + Sync + 'static {
    /// `Ok` when ready, or the reasons why not.
    fn ready(&self) -> Result<(), Vec<String>>;
}

struct Shared {
    metrics: Metrics,
    readiness: Arc<dyn Readiness>,
}

/// The router.
pub fn router(metrics: Metrics, readiness: Arc<dyn Readiness>) -> axum::Router {
    let shared = Arc::new(Shared { metrics, readiness });
    axum::Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/livez", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(shared)
}

async fn readyz(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    match s.readiness.ready() {
        Ok(()) => (StatusCode::OK, "ok".to_string()),
        Err(reasons) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready:\n{}\n", reasons.join("\n"))),
    }
}

async fn metrics_text(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    ([(axum::http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], s.metrics.encode())
}

/// Binds `addr` and serves until `stop`. Returns the bound address (port 0 picks one).
pub async fn serve(
    addr: SocketAddr,
    insecure: bool,
    app: axum::Router,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding the health server on {addr}"))?;
    let bound = listener.local_addr()?;
    if insecure {
        tokio::spawn(async move {
            let shutdown = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            if let Err(error) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
                tracing::error!(%error, "health server failed");
            }
        });
        return Ok(bound);
    }
    let acceptor = tls_acceptor()?;
    tokio::spawn(async move {
        loop {
            let (tcp, _) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(error) => {
                        tracing::warn!(%error, "accept failed");
                        continue;
                    }
                },
                _ = stop.wait_for(|s| *s) => return,
            };
            let acceptor = acceptor.clone();
            let app = app.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else { return };
                let service = TowerToHyperService::new(app);
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    Ok(bound)
}

fn tls_acceptor() -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    let key = rcgen::KeyPair::generate().context("generating the serving key")?;
    let params = rcgen::CertificateParams::new(vec!["localhost".to_string(), "cloud-controller-manager".to_string()])?;
    let cert = params.self_signed(&key).context("self-signing the serving certificate")?;
    let der_key =
        rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).map_err(|e| anyhow::anyhow!("serving key: {e}"))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], der_key)?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}
