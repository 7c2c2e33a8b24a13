//! The health and metrics server on `--secure-port`: `/healthz`, `/livez`, `/readyz` and
//! `/metrics`. HTTPS with the certificate of `--tls-cert-file`/`--tls-private-key-file`
//! (reloaded when the files change, as cert-manager rotates them), else a self-signed one made
//! at start (as upstream does); or plain HTTP with `--insecure-serving` for local runs and tests.
//!
//! Requests outside `--authorization-always-allow-paths` can be authenticated and authorised by
//! delegation to the API server, as upstream's: a bearer token is checked with a TokenReview,
//! then the user's right to the path with a SubjectAccessReview (`get` on the non-resource URL
//! `/metrics`); see [`crate::delegation`].

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::delegation::Delegation;
use crate::metrics::Metrics;

/// Why the health server could not start, or a certificate could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The address could not be bound.
    #[error("binding the health server on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// A certificate or key file could not be read or holds nothing usable.
    #[error("{flag} {path}: {why}")]
    File { flag: &'static str, path: std::path::PathBuf, why: String },
    /// The serving key or certificate could not be made or used.
    #[error("the serving certificate: {0}")]
    Certificate(String),
}

/// What `/readyz` checks.
pub trait Readiness: Send + Sync + 'static {
    /// `Ok` when ready, or the reasons why not.
    fn ready(&self) -> Result<(), Vec<String>>;
}

struct Shared {
    metrics: Metrics,
    readiness: Arc<dyn Readiness>,
}

/// The router; with `delegation`, every request passes its checks first.
pub fn router(metrics: Metrics, readiness: Arc<dyn Readiness>, delegation: Option<Arc<Delegation>>) -> axum::Router {
    let shared = Arc::new(Shared { metrics, readiness });
    let router = axum::Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/livez", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(shared);
    match delegation {
        Some(d) => router.layer(axum::middleware::from_fn_with_state(d, crate::delegation::check)),
        None => router,
    }
}

/// Where the serving certificate comes from.
#[derive(Debug, Clone)]
pub enum Tls {
    /// Plain HTTP (`--insecure-serving`).
    None,
    /// A self-signed certificate made at start.
    SelfSigned,
    /// PEM files, reloaded when they change.
    Files {
        /// The certificate (chain), PEM.
        cert: std::path::PathBuf,
        /// Its private key, PEM.
        key: std::path::PathBuf,
    },
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

/// How often the certificate files are checked for a change.
const RELOAD_CHECK: std::time::Duration = std::time::Duration::from_secs(2);

/// Binds `addr` and serves, on `tasks`, until `stop`. Returns the bound address (port 0 picks
/// one). Connections in flight at `stop` are not waited for (they are probes and scrapes).
pub async fn serve(
    addr: SocketAddr,
    tls: Tls,
    app: axum::Router,
    tasks: &TaskTracker,
    stop: CancellationToken,
) -> Result<SocketAddr, ServeError> {
    let bind = |source| ServeError::Bind { addr, source };
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(bind)?;
    let bound = listener.local_addr().map_err(bind)?;
    let resolver = match tls {
        Tls::None => {
            tasks.spawn(async move {
                let shutdown = async move {
                    stop.cancelled().await;
                };
                if let Err(error) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
                    tracing::error!(%error, "health server failed");
                }
            });
            return Ok(bound);
        }
        Tls::SelfSigned => Arc::new(CertResolver::new(self_signed()?, None)),
        Tls::Files { cert, key } => {
            let loaded = load_pem(&cert, &key)?;
            let resolver = Arc::new(CertResolver::new(loaded, Some((cert, key))));
            tasks.spawn(resolver.clone().watch(stop.clone()));
            resolver
        }
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ServeError::Certificate(e.to_string()))?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    tasks.spawn(async move {
        loop {
            let (tcp, _) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(error) => {
                        tracing::warn!(%error, "accept failed");
                        continue;
                    }
                },
                _ = stop.cancelled() => return,
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

type Files = (std::path::PathBuf, std::path::PathBuf);

/// The serving certificate, swapped in place when its files change.
#[derive(Debug)]
struct CertResolver {
    current: std::sync::RwLock<Arc<rustls::sign::CertifiedKey>>,
    files: Option<Files>,
}

impl CertResolver {
    fn new(key: rustls::sign::CertifiedKey, files: Option<Files>) -> Self {
        Self { current: std::sync::RwLock::new(Arc::new(key)), files }
    }

    /// Reloads the files whenever their contents change, until `stop`. A file that does not
    /// parse (say, half written) keeps the previous certificate and is tried again.
    async fn watch(self: Arc<Self>, stop: CancellationToken) {
        let Some((cert, key)) = self.files.clone() else { return };
        let read = |cert: &std::path::Path, key: &std::path::Path| (std::fs::read(cert).ok(), std::fs::read(key).ok());
        let mut seen = read(&cert, &key);
        loop {
            tokio::select! {
                _ = tokio::time::sleep(RELOAD_CHECK) => {}
                _ = stop.cancelled() => return,
            }
            let now = read(&cert, &key);
            if now == seen {
                continue;
            }
            match load_pem(&cert, &key) {
                Ok(loaded) => {
                    if let Ok(mut current) = self.current.write() {
                        *current = Arc::new(loaded);
                    }
                    seen = now;
                    tracing::info!(cert = %cert.display(), "serving certificate reloaded");
                }
                Err(error) => {
                    tracing::warn!(error = %format!("{error:#}"), "serving certificate changed but does not load; keeping the previous one")
                }
            }
        }
    }
}

impl rustls::server::ResolvesServerCert for CertResolver {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<rustls::sign::CertifiedKey>> {
        self.current.read().ok().map(|c| c.clone())
    }
}

fn certified(
    chain: Vec<rustls::pki_types::CertificateDer<'static>>,
    key: rustls::pki_types::PrivateKeyDer<'static>,
) -> Result<rustls::sign::CertifiedKey, ServeError> {
    let signing =
        rustls::crypto::ring::sign::any_supported_type(&key).map_err(|e| ServeError::Certificate(format!("serving key: {e}")))?;
    Ok(rustls::sign::CertifiedKey::new(chain, signing))
}

fn load_pem(cert: &std::path::Path, key: &std::path::Path) -> Result<rustls::sign::CertifiedKey, ServeError> {
    use rustls::pki_types::pem::PemObject as _;
    let file = |flag, path: &std::path::Path, why: String| ServeError::File { flag, path: path.to_path_buf(), why };
    let chain = rustls::pki_types::CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| file("--tls-cert-file", cert, e.to_string()))?;
    if chain.is_empty() {
        return Err(file("--tls-cert-file", cert, "no certificate in it".into()));
    }
    let key =
        rustls::pki_types::PrivateKeyDer::from_pem_file(key).map_err(|e| file("--tls-private-key-file", key, e.to_string()))?;
    certified(chain, key)
}

fn self_signed() -> Result<rustls::sign::CertifiedKey, ServeError> {
    let failed = |what: &str, e: &dyn std::fmt::Display| ServeError::Certificate(format!("{what}: {e}"));
    let key = rcgen::KeyPair::generate().map_err(|e| failed("generating the serving key", &e))?;
    let params = rcgen::CertificateParams::new(vec!["localhost".to_string(), "cloud-controller-manager".to_string()])
        .map_err(|e| failed("the certificate's names", &e))?;
    let cert = params.self_signed(&key).map_err(|e| failed("self-signing the serving certificate", &e))?;
    let der_key = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).map_err(|e| failed("serving key", &e))?;
    certified(vec![cert.der().clone()], der_key)
}
