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
    providers: crate::provider::access::Access,
}

/// The router; with `delegation`, every request passes its checks first. The metrics of the
/// providers of `providers` (`--provider-metrics`) are at `/metrics/providers/NAME`.
pub fn router(
    metrics: Metrics,
    readiness: Arc<dyn Readiness>,
    delegation: Option<Arc<Delegation>>,
    providers: crate::provider::access::Access,
) -> axum::Router {
    let shared = Arc::new(Shared { metrics, readiness, providers });
    let router = axum::Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/livez", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/metrics/providers/{name}", get(provider_metrics))
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

/// A provider's own metrics, read from its metrics socket when asked (nothing is kept).
async fn provider_metrics(
    State(s): State<Arc<Shared>>,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> axum::response::Response {
    let Some(path) = s.providers.metrics.get(&name) else {
        return (StatusCode::NOT_FOUND, format!("no --provider-metrics for a provider named {name:?}\n")).into_response();
    };
    match crate::provider::access::scrape(path, s.providers.peer_uids.get(&name).copied()).await {
        Ok((content_type, body)) => ([(axum::http::header::CONTENT_TYPE, content_type)], body).into_response(),
        Err(error) => {
            let error = crate::metrics::chain(&error);
            tracing::warn!(provider = %name, %error, "reading the provider's metrics failed");
            (StatusCode::BAD_GATEWAY, format!("the provider's metrics: {error}\n")).into_response()
        }
    }
}

/// How often the certificate files are checked for a change.
const RELOAD_CHECK: std::time::Duration = std::time::Duration::from_secs(2);

/// The most connections served at once; more wait, unaccepted, in the kernel's backlog (a
/// flood of connections costs no memory of the process).
pub const MAX_CONNECTIONS: usize = 256;

/// How long a client has for its TLS handshake, and for the headers of each request: a client
/// that opens a connection and sends nothing holds it no longer.
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Binds `addr` and serves, on `tasks`, until `stop`. Returns the bound address (port 0 picks
/// one). Connections in flight at `stop` are not waited for (they are probes and scrapes).
/// At most [`MAX_CONNECTIONS`] at once, each with [`HANDSHAKE_TIMEOUT`] for its handshake and
/// each request's headers.
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
        Tls::None => None,
        Tls::SelfSigned => Some(Arc::new(CertResolver::new(self_signed()?, None))),
        Tls::Files { cert, key } => {
            let loaded = load_pem(&cert, &key)?;
            let resolver = Arc::new(CertResolver::new(loaded, Some((cert, key))));
            tasks.spawn(resolver.clone().watch(stop.clone()));
            Some(resolver)
        }
    };
    let acceptor = match resolver {
        None => None,
        Some(resolver) => {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let config = rustls::ServerConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| ServeError::Certificate(e.to_string()))?
                .with_no_client_auth()
                .with_cert_resolver(resolver);
            Some(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
        }
    };
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tasks.spawn(async move {
        loop {
            let slot = tokio::select! {
                slot = slots.clone().acquire_owned() => match slot { Ok(s) => s, Err(_) => return },
                _ = stop.cancelled() => return,
            };
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
            let (acceptor, app) = (acceptor.clone(), app.clone());
            tokio::spawn(async move {
                let _slot = slot;
                match acceptor {
                    None => {
                        // A client that sends nothing is let go (hyper's header timeout starts
                        // only after it has found out the protocol from the first bytes).
                        let mut first = [0u8; 1];
                        if let Ok(Ok(n)) = tokio::time::timeout(HANDSHAKE_TIMEOUT, tcp.peek(&mut first)).await
                            && n > 0
                        {
                            serve_connection(tcp, app).await;
                        }
                    }
                    Some(acceptor) => {
                        if let Ok(Ok(tls)) = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                            serve_connection(tls, app).await;
                        }
                    }
                }
            });
        }
    });
    Ok(bound)
}

/// Serves one connection, HTTP/1.1 or HTTP/2, with [`HANDSHAKE_TIMEOUT`] for each request's
/// headers.
async fn serve_connection<I>(io: I, app: axum::Router)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(HANDSHAKE_TIMEOUT);
    builder.http2().timer(hyper_util::rt::TokioTimer::new()).keep_alive_timeout(HANDSHAKE_TIMEOUT);
    let _ = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(app)).await;
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn fetch(addr: SocketAddr) -> std::io::Result<String> {
        let mut c = tokio::net::TcpStream::connect(addr).await?;
        c.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await?;
        let mut out = String::new();
        c.read_to_string(&mut out).await?;
        Ok(out)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn silent_connections_are_capped_and_closed() {
        let app = axum::Router::new().route("/healthz", get(|| async { "ok" }));
        let (tasks, stop) = (TaskTracker::new(), CancellationToken::new());
        let addr = serve("127.0.0.1:0".parse().expect("addr"), Tls::None, app, &tasks, stop.clone()).await.expect("serve");
        // Every slot taken by a client that sends nothing.
        let mut silent = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            silent.push(tokio::net::TcpStream::connect(addr).await.expect("connect"));
        }
        // One more waits, unserved, while they hold their slots…
        let waiting = tokio::spawn(fetch(addr));
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        assert!(!waiting.is_finished(), "a connection beyond the cap was served at once");
        // …until the header timeout closes them: each silent client sees its end.
        let mut first = silent.remove(0);
        let mut byte = [0u8; 1];
        let closed = tokio::time::timeout(HANDSHAKE_TIMEOUT + std::time::Duration::from_secs(3), first.read(&mut byte)).await;
        assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "a silent connection was kept: {closed:?}");
        let answer = tokio::time::timeout(std::time::Duration::from_secs(5), waiting).await.expect("served").expect("join");
        assert!(answer.expect("answer").starts_with("HTTP/1.1 200"), "the waiting client is served once slots free");
        stop.cancel();
    }
}
