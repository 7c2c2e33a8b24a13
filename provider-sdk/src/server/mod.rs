//! The gRPC server of a provider: Identity derived from the services given, every call
//! validated, observed and error-mapped, on a unix socket or TCP, with grpc.health.v1 and a
//! graceful stop on SIGTERM.

mod identity;
mod instances;
mod items;
mod listen;
mod load_balancers;
mod node;
mod routes;
mod tags;

pub use listen::{Listen, bind_unix, shutdown_signal};

use identity::IdentityAdapter;
use instances::InstancesAdapter;

use load_balancers::LoadBalancersAdapter;
use node::{ImageCredentialsAdapter, NodeMetadataAdapter};
use routes::RoutesAdapter;
use tags::TagsAdapter;

use std::sync::Arc;
use std::time::Duration;

use ccm_proto::v1::identity_service_server::IdentityServiceServer;
use ccm_proto::v1::image_credentials_service_server::ImageCredentialsServiceServer;
use ccm_proto::v1::instances_service_server::InstancesServiceServer;
use ccm_proto::v1::load_balancers_service_server::LoadBalancersServiceServer;
use ccm_proto::v1::node_metadata_service_server::NodeMetadataServiceServer;
use ccm_proto::v1::routes_service_server::RoutesServiceServer;
use ccm_proto::v1::tags_service_server::TagsServiceServer;
use ccm_proto::v1::{self as pb, ServiceType};
use tokio::time::Instant;
use tonic::{Code, Response, Status};

use crate::error::{Error, Result};
use crate::locks::ObjectLocks;
use crate::names::NameLimits;
use crate::provider::{ImageCredentials, Instances, LoadBalancers, NodeMetadata, Probe, Routes, Tags};

/// A generated service server with cloudprovider.v1's message limits
/// ([`crate::client::MAX_MESSAGE_SIZE`] each way).
macro_rules! limited {
    ($server:expr) => {
        $server
            .max_decoding_message_size(crate::client::MAX_MESSAGE_SIZE)
            .max_encoding_message_size(crate::client::MAX_MESSAGE_SIZE)
    };
}

/// Errors starting or running a server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The listen address is not `unix:///….sock`, `tcp://host:port` or `http://host:port`.
    #[error("invalid listen address {address:?}: {reason}")]
    Address {
        /// The address given.
        address: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The plugin name breaks the naming rule.
    #[error("invalid plugin name {0:?}: use at most 63 lowercase letters, digits, '-' and '.', starting with a letter")]
    PluginName(String),
    /// The socket could not be prepared or bound.
    #[error("cannot listen on {path}")]
    Bind {
        /// Where.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Serving failed.
    #[error("grpc server failed")]
    Transport(#[source] tonic::transport::Error),
    /// The TLS files cannot be used, or TLS was asked for on a unix socket.
    #[error("TLS: {0}")]
    Tls(String),
    /// Plaintext TCP on an address other hosts can reach, not allowed explicitly.
    #[error(
        "{0}: plaintext TCP that other hosts can reach would carry every call in the clear; serve mutual TLS, a unix \
         socket or loopback, or allow it explicitly (--allow-insecure-tcp)"
    )]
    Insecure(String),
    /// The metrics asked for over plaintext TCP on an address other hosts can reach, not
    /// allowed explicitly.
    #[error(
        "metrics endpoint {0}: plain HTTP on an address other hosts can reach serves the provider's metrics to anyone; \
         serve them on a unix socket (the core serves them again behind its authentication, --provider-metrics) or on \
         loopback, or allow it explicitly (--allow-insecure-metrics)"
    )]
    InsecureMetrics(String),
    /// A unix socket mode that gives others access, or denies the owner.
    #[error("socket mode {0:#o}: expected owner read and write, and nothing for others (0600, 0660)")]
    SocketMode(u32),
}

impl From<crate::tls::TlsError> for ServeError {
    fn from(e: crate::tls::TlsError) -> Self {
        Self::Tls(e.to_string())
    }
}

/// Sees every call a server answers: which method, which code, how long it took.
pub trait CallObserver: Send + Sync + 'static {
    /// Called once per RPC after it finished. `method` is like `"InstancesService/InstanceExists"`.
    fn observe(&self, method: &'static str, code: Code, elapsed: Duration);
}

fn cache_hint(ttl: Option<Duration>) -> Option<prost_types::Duration> {
    ttl.and_then(|d| prost_types::Duration::try_from(d).ok())
}

/// Checks a plugin name: 1 to 63 of `[a-z0-9.-]`, starting with a letter, ending with a
/// letter or digit.
pub fn valid_plugin_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    !name.is_empty()
        && name.len() <= 63
        && bytes[0].is_ascii_lowercase()
        && bytes[bytes.len() - 1].is_ascii_alphanumeric()
        && bytes.iter().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-' || *b == b'.')
}

#[derive(Clone, Default)]
struct Observers(Arc<Vec<Arc<dyn CallObserver>>>);

impl Observers {
    async fn call<T>(
        &self,
        method: &'static str,
        fut: impl Future<Output = Result<T>>,
    ) -> std::result::Result<Response<T>, Status> {
        let start = Instant::now();
        let result = fut.await;
        let code = result.as_ref().map_or_else(Error::code, |_| Code::Ok);
        for o in self.0.iter() {
            o.observe(method, code, start.elapsed());
        }
        result.map(Response::new).map_err(Error::into_status)
    }
}

/// Builds and runs a provider's gRPC server.
pub struct ProviderServer {
    name: String,
    vendor_version: String,
    manifest: std::collections::HashMap<String, String>,
    provider_id_scheme: String,
    additional_provider_id_schemes: Vec<String>,
    epoch: String,
    instances: Option<Arc<dyn Instances>>,
    tags: Option<Arc<dyn Tags>>,
    routes: Option<Arc<dyn Routes>>,
    load_balancers: Option<Arc<dyn LoadBalancers>>,
    node_metadata: Option<Arc<dyn NodeMetadata>>,
    image_credentials: Option<Arc<dyn ImageCredentials>>,
    probe: Option<Arc<dyn Probe>>,
    observers: Vec<Arc<dyn CallObserver>>,
    socket_mode: u32,
    call_rate: Option<pb::CallRate>,
    tls: Option<crate::tls::TlsFiles>,
    insecure_tcp: bool,
    insecure_metrics: bool,
    metrics: Option<(Listen, Arc<prometheus_client::registry::Registry>)>,
}

impl ProviderServer {
    /// A server for the plugin `name` (see [`valid_plugin_name`]) at `vendor_version`.
    pub fn new(name: impl Into<String>, vendor_version: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            vendor_version: vendor_version.into(),
            manifest: Default::default(),
            provider_id_scheme: String::new(),
            additional_provider_id_schemes: Vec::new(),
            epoch: String::new(),
            instances: None,
            tags: None,
            routes: None,
            load_balancers: None,
            node_metadata: None,
            image_credentials: None,
            probe: None,
            observers: Vec::new(),
            socket_mode: 0o600,
            call_rate: None,
            tls: None,
            insecure_tcp: false,
            insecure_metrics: false,
            metrics: None,
        }
    }

    /// Serves `registry` (the provider's own metrics, and [`crate::metrics::CallMetrics`] if
    /// registered there and observed) at `/metrics` on `listen`, beside the gRPC endpoint and
    /// until it stops (a sidecar's `--metrics-listen`; see [`crate::metrics`]).
    pub fn metrics(mut self, listen: Listen, registry: Arc<prometheus_client::registry::Registry>) -> Self {
        self.metrics = Some((listen, registry));
        self
    }

    /// The scheme of the providerIDs this provider issues (`"sim"` for `sim://…`), so the core
    /// can leave other providers' Nodes alone.
    pub fn provider_id_scheme(mut self, scheme: impl Into<String>) -> Self {
        self.provider_id_scheme = scheme.into();
        self
    }

    /// More schemes whose providerIDs this provider issues, beside
    /// [`ProviderServer::provider_id_scheme`] (a provider of two product lines of one cloud,
    /// each with its own providerID form): a core serving several providers routes Nodes of
    /// every one of them here.
    pub fn additional_provider_id_scheme(mut self, scheme: impl Into<String>) -> Self {
        self.additional_provider_id_schemes.push(scheme.into());
        self
    }

    /// The generation of the provider's state, served in GetPluginInfo: a provider that keeps
    /// state in memory (lost when it restarts) sets a new value at each start, and the core then
    /// lists routes and ensures load balancers again at once. Leave it unset when the state
    /// lives in the cloud.
    pub fn epoch(mut self, epoch: impl Into<String>) -> Self {
        self.epoch = epoch.into();
        self
    }

    /// Adds a manifest entry to GetPluginInfo.
    pub fn manifest(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.manifest.insert(key.into(), value.into());
        self
    }

    /// Serves InstancesService.
    pub fn instances<T: Instances>(mut self, svc: Arc<T>) -> Self {
        self.instances = Some(svc);
        self
    }

    /// Serves TagsService.
    pub fn tags<T: Tags>(mut self, svc: Arc<T>) -> Self {
        self.tags = Some(svc);
        self
    }

    /// Serves RoutesService.
    pub fn routes<T: Routes>(mut self, svc: Arc<T>) -> Self {
        self.routes = Some(svc);
        self
    }

    /// Serves LoadBalancersService.
    pub fn load_balancers<T: LoadBalancers>(mut self, svc: Arc<T>) -> Self {
        self.load_balancers = Some(svc);
        self
    }

    /// Serves NodeMetadataService.
    pub fn node_metadata<T: NodeMetadata>(mut self, svc: Arc<T>) -> Self {
        self.node_metadata = Some(svc);
        self
    }

    /// Serves ImageCredentialsService.
    pub fn image_credentials<T: ImageCredentials>(mut self, svc: Arc<T>) -> Self {
        self.image_credentials = Some(svc);
        self
    }

    /// Answers Probe with this; without it the plugin is always ready.
    pub fn probe<T: Probe>(mut self, probe: Arc<T>) -> Self {
        self.probe = Some(probe);
        self
    }

    /// Reports every call to `observer` (metrics, call counters).
    pub fn observe<T: CallObserver>(mut self, observer: Arc<T>) -> Self {
        self.observers.push(observer);
        self
    }

    /// Serves TCP with mutual TLS: this certificate and key, and a client certificate signed
    /// by the CA required (see [`crate::tls`]). Not for unix sockets.
    pub fn tls(mut self, files: crate::tls::TlsFiles) -> Self {
        self.tls = Some(files);
        self
    }

    /// Serves plaintext TCP on addresses other hosts can reach (refused by default: only
    /// loopback is served without TLS).
    pub fn allow_insecure_tcp(mut self, allow: bool) -> Self {
        self.insecure_tcp = allow;
        self
    }

    /// Serves the metrics ([`ProviderServer::metrics`]) over plain HTTP on an address other
    /// hosts can reach (refused by default: a unix socket or loopback needs nothing).
    pub fn allow_insecure_metrics(mut self, allow: bool) -> Self {
        self.insecure_metrics = allow;
        self
    }

    /// The mode of unix sockets, the gRPC one and the metrics one (default 0600: only the
    /// owner may connect; 0660: the directory's group too, as a core running as another
    /// user of the pod's fsGroup). A mode with bits for others is refused when serving.
    pub fn socket_mode(mut self, mode: u32) -> Self {
        self.socket_mode = mode;
        self
    }

    /// Declares the rate at which the caller may send calls that reach the cloud (every call
    /// but identity calls): `per_second` on average, `burst` at once after a quiet spell. Give
    /// your cloud's API budget for this plugin divided by the cloud calls one of its calls
    /// makes. The core paces its calls to it instead of learning the limit from refusals
    /// (it still honours RetryInfo). A `per_second` that is not finite and above zero
    /// declares nothing.
    pub fn call_rate(mut self, per_second: f64, burst: u32) -> Self {
        self.call_rate = (per_second.is_finite() && per_second > 0.0).then_some(pb::CallRate { per_second, burst });
        self
    }

    /// The capabilities this server advertises, derived from the services it was given.
    pub fn capabilities(&self) -> pb::GetPluginCapabilitiesResponse {
        let mut caps = pb::GetPluginCapabilitiesResponse::default();
        if let Some(i) = &self.instances {
            caps.services.push(ServiceType::Instances as i32);
            caps.instances = Some(i.capabilities());
        }
        if let Some(t) = &self.tags {
            caps.services.push(ServiceType::Tags as i32);
            caps.tags = Some(t.capabilities());
        }
        if let Some(r) = &self.routes {
            caps.services.push(ServiceType::Routes as i32);
            caps.routes = Some(r.capabilities());
        }
        if let Some(l) = &self.load_balancers {
            caps.services.push(ServiceType::LoadBalancers as i32);
            caps.load_balancers = Some(l.capabilities());
        }
        if self.node_metadata.is_some() {
            caps.services.push(ServiceType::NodeMetadata as i32);
        }
        if self.image_credentials.is_some() {
            caps.services.push(ServiceType::ImageCredentials as i32);
        }
        caps.call_rate = self.call_rate;
        caps
    }

    /// Serves on `listen` until SIGTERM or SIGINT, then stops gracefully and removes the
    /// socket file.
    pub async fn serve(self, listen: &Listen) -> std::result::Result<(), ServeError> {
        self.serve_with_shutdown(listen, shutdown_signal()).await
    }

    /// Serves on `listen` until `shutdown` resolves.
    pub async fn serve_with_shutdown(
        mut self,
        listen: &Listen,
        shutdown: impl Future<Output = ()> + Send,
    ) -> std::result::Result<(), ServeError> {
        if !valid_plugin_name(&self.name) {
            return Err(ServeError::PluginName(self.name));
        }
        let mode = self.socket_mode;
        if mode & 0o600 != 0o600 || mode & !0o770 != 0 {
            return Err(ServeError::SocketMode(mode));
        }
        if let Some((Listen::Tcp(addr), _)) = &self.metrics
            && !self.insecure_metrics
            && !addr.ip().is_loopback()
        {
            return Err(ServeError::InsecureMetrics(addr.to_string()));
        }
        if let Listen::Tcp(addr) = listen
            && self.tls.is_none()
            && !self.insecure_tcp
            && !addr.ip().is_loopback()
        {
            return Err(ServeError::Insecure(listen.to_string()));
        }
        let mut builder = tonic::transport::Server::builder();
        if let Some(files) = &self.tls {
            if matches!(listen, Listen::Unix(_)) {
                return Err(ServeError::Tls(format!("{listen}: TLS is for TCP endpoints; a unix socket's file mode guards it")));
            }
            builder = builder.tls_config(files.server_config()?).map_err(|e| ServeError::Tls(e.to_string()))?;
        }
        let (stop_metrics, metrics_stopped) = tokio::sync::oneshot::channel::<()>();
        // A metrics endpoint that cannot be served (its socket taken, its port in use) stops
        // the provider too: a sidecar that runs on without its metrics would go unnoticed.
        let (metrics_failed, failed) = tokio::sync::oneshot::channel::<ServeError>();
        let metrics = self.metrics.take().map(|(listen, registry)| {
            tokio::spawn(async move {
                let stopped = async move {
                    let _ = metrics_stopped.await;
                };
                if let Err(error) = crate::metrics::serve(registry, &listen, mode, stopped).await {
                    tracing::error!(error = %error, endpoint = %listen, "serving the provider's metrics failed");
                    let _ = metrics_failed.send(error);
                }
            })
        });
        let router = self.into_router(builder).await;
        let failed = async move {
            match failed.await {
                Ok(error) => error,
                // No metrics endpoint, or it stopped cleanly: nothing to stop for.
                Err(_) => std::future::pending().await,
            }
        };
        let result = tokio::select! {
            result = Self::serve_router(router, listen, mode, shutdown) => result,
            // The gRPC socket may be left behind, stale: the next start replaces it.
            error = failed => Err(error),
        };
        let _ = stop_metrics.send(());
        if let Some(task) = metrics {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        result
    }

    async fn serve_router(
        router: tonic::transport::server::Router,
        listen: &Listen,
        mode: u32,
        shutdown: impl Future<Output = ()> + Send,
    ) -> std::result::Result<(), ServeError> {
        match listen {
            Listen::Unix(path) => {
                let listener = bind_unix(path, mode)?;
                tracing::info!(endpoint = %listen, "serving cloudprovider.v1");
                let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
                let result = router.serve_with_incoming_shutdown(incoming, shutdown).await;
                let _ = std::fs::remove_file(path);
                result.map_err(ServeError::Transport)
            }
            Listen::Tcp(addr) => {
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|source| ServeError::Bind { path: addr.to_string(), source })?;
                tracing::info!(endpoint = %listen, "serving cloudprovider.v1");
                let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
                router.serve_with_incoming_shutdown(incoming, shutdown).await.map_err(ServeError::Transport)
            }
        }
    }

    /// Serves the connections `incoming` yields (a listener of the caller's own, or a
    /// simulation's in-memory streams), in plaintext, until `shutdown` resolves.
    pub async fn serve_incoming<S, IO, E>(
        self,
        incoming: S,
        shutdown: impl Future<Output = ()> + Send,
    ) -> std::result::Result<(), ServeError>
    where
        S: futures::Stream<Item = std::result::Result<IO, E>> + Send,
        IO: tonic::transport::server::Connected + tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
        IO::ConnectInfo: Clone + Send + Sync + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        if !valid_plugin_name(&self.name) {
            return Err(ServeError::PluginName(self.name));
        }
        let router = self.into_router(tonic::transport::Server::builder()).await;
        router.serve_with_incoming_shutdown(incoming, shutdown).await.map_err(ServeError::Transport)
    }

    async fn into_router(self, mut builder: tonic::transport::Server) -> tonic::transport::server::Router {
        let caps = self.capabilities();
        let obs = Observers(Arc::new(self.observers));
        let (health, health_service) = tonic_health::server::health_reporter();
        health.set_service_status("", tonic_health::ServingStatus::Serving).await;
        let identity = IdentityAdapter {
            info: pb::GetPluginInfoResponse {
                name: self.name,
                vendor_version: self.vendor_version,
                manifest: self.manifest,
                provider_id_scheme: self.provider_id_scheme,
                additional_provider_id_schemes: self.additional_provider_id_schemes,
                epoch: self.epoch,
            },
            caps,
            probe: self.probe,
            obs: obs.clone(),
        };
        health.set_serving::<IdentityServiceServer<IdentityAdapter>>().await;
        let mut router = builder.add_service(health_service).add_service(limited!(IdentityServiceServer::new(identity)));
        if let Some(inner) = self.instances {
            health.set_serving::<InstancesServiceServer<InstancesAdapter>>().await;
            let ttl = cache_hint(inner.cache_ttl());
            router = router.add_service(limited!(InstancesServiceServer::new(InstancesAdapter { inner, ttl, obs: obs.clone() })));
        }
        if let Some(inner) = self.tags {
            health.set_serving::<TagsServiceServer<TagsAdapter>>().await;
            let ttl = cache_hint(inner.cache_ttl());
            router = router.add_service(limited!(TagsServiceServer::new(TagsAdapter { inner, ttl, obs: obs.clone() })));
        }
        if let Some(inner) = self.routes {
            health.set_serving::<RoutesServiceServer<RoutesAdapter>>().await;
            let ipv6 = inner.capabilities().ipv6;
            let ttl = cache_hint(inner.cache_ttl());
            router = router.add_service(limited!(RoutesServiceServer::new(RoutesAdapter {
                inner,
                locks: ObjectLocks::default(),
                ipv6,
                ttl,
                obs: obs.clone()
            })));
        }
        if let Some(inner) = self.load_balancers {
            health.set_serving::<LoadBalancersServiceServer<LoadBalancersAdapter>>().await;
            let limits = NameLimits::from_capabilities(&inner.capabilities());
            router = router.add_service(limited!(LoadBalancersServiceServer::new(LoadBalancersAdapter {
                inner,
                locks: ObjectLocks::default(),
                limits,
                obs: obs.clone()
            })));
        }
        if let Some(inner) = self.node_metadata {
            health.set_serving::<NodeMetadataServiceServer<NodeMetadataAdapter>>().await;
            router =
                router.add_service(limited!(NodeMetadataServiceServer::new(NodeMetadataAdapter { inner, obs: obs.clone() })));
        }
        if let Some(inner) = self.image_credentials {
            health.set_serving::<ImageCredentialsServiceServer<ImageCredentialsAdapter>>().await;
            router = router.add_service(limited!(ImageCredentialsServiceServer::new(ImageCredentialsAdapter { inner, obs })));
        }
        router
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn listen_addresses() {
        assert_eq!("unix:///run/p.sock".parse::<Listen>().ok(), Some(Listen::Unix("/run/p.sock".into())));
        assert!(matches!("http://127.0.0.1:9000".parse::<Listen>(), Ok(Listen::Tcp(_))));
        assert!(matches!("tcp://127.0.0.1:9000".parse::<Listen>(), Ok(Listen::Tcp(_))));
        for bad in ["unix:///run/p", "unix://relative.sock", "nonsense", "http://host-without-port"] {
            assert!(bad.parse::<Listen>().is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn metrics_on_the_network_and_sockets_open_to_others_are_refused() {
        let dir = tempfile::tempdir().expect("dir");
        let grpc = Listen::Unix(dir.path().join("provider.sock"));
        let registry = Arc::new(prometheus_client::registry::Registry::default());
        let open: Listen = "http://0.0.0.0:0".parse().expect("listen");
        let err = ProviderServer::new("test.example", "0")
            .metrics(open.clone(), registry.clone())
            .serve_with_shutdown(&grpc, async {})
            .await
            .expect_err("refused");
        assert!(matches!(err, ServeError::InsecureMetrics(_)) && err.to_string().contains("--allow-insecure-metrics"), "{err}");
        ProviderServer::new("test.example", "0")
            .metrics(open, registry.clone())
            .allow_insecure_metrics(true)
            .serve_with_shutdown(&grpc, async {})
            .await
            .expect("allowed explicitly");
        // Its metrics socket already served by another: the provider stops, saying so.
        let taken = dir.path().join("taken.sock");
        let _holder = bind_unix(&taken, 0o600).expect("another server");
        let err = ProviderServer::new("test.example", "0")
            .metrics(Listen::Unix(taken), registry.clone())
            .serve_with_shutdown(&Listen::Unix(dir.path().join("other.sock")), std::future::pending())
            .await
            .expect_err("stops when its metrics cannot be served");
        assert!(err.to_string().contains("taken.sock") || format!("{err:?}").contains("taken.sock"), "{err}");
        for mode in [0o666, 0o604, 0o400, 0o1660] {
            let err = ProviderServer::new("test.example", "0").socket_mode(mode).serve_with_shutdown(&grpc, async {}).await;
            assert!(matches!(err, Err(ServeError::SocketMode(_))), "{mode:o}: {err:?}");
        }
        // 0660: both sockets take the mode (the group of a pod's fsGroup reaches them).
        let metrics = Listen::Unix(dir.path().join("metrics.sock"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            ProviderServer::new("test.example", "0")
                .socket_mode(0o660)
                .metrics(metrics, registry)
                .serve_with_shutdown(&grpc, async move {
                    let _ = stopped.await;
                })
                .await
        });
        for name in ["provider.sock", "metrics.sock"] {
            let path = dir.path().join(name);
            let mut mode = 0;
            for _ in 0..100 {
                if let Ok(meta) = std::fs::metadata(&path) {
                    mode = meta.permissions().mode() & 0o777;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(mode, 0o660, "{name}");
        }
        let _ = stop.send(());
        server.await.expect("join").expect("served");
    }

    #[tokio::test]
    async fn plaintext_tcp_is_served_only_on_loopback_unless_allowed() {
        let open: Listen = "tcp://0.0.0.0:0".parse().expect("listen");
        let err = ProviderServer::new("test.example", "0").serve_with_shutdown(&open, async {}).await.expect_err("refused");
        assert!(matches!(err, ServeError::Insecure(_)) && err.to_string().contains("--allow-insecure-tcp"), "{err}");
        // Loopback, or allowed explicitly: served (until the shutdown, which is at once here).
        let local: Listen = "tcp://127.0.0.1:0".parse().expect("listen");
        ProviderServer::new("test.example", "0").serve_with_shutdown(&local, async {}).await.expect("loopback is served");
        ProviderServer::new("test.example", "0")
            .allow_insecure_tcp(true)
            .serve_with_shutdown(&open, async {})
            .await
            .expect("allowed");
    }

    #[test]
    fn plugin_names() {
        for good in ["sim.cloudprovider.dev", "a", "aws-ccm.example.com"] {
            assert!(valid_plugin_name(good), "{good}");
        }
        for bad in ["", "Sim", "1abc", "abc-", "a_b", &"a".repeat(64)] {
            assert!(!valid_plugin_name(bad), "{bad}");
        }
    }

    #[test]
    fn stale_sockets_are_replaced_and_files_are_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.sock");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async {
            let first = bind_unix(&path, 0o600).expect("bind");
            // A live server on the socket is not replaced.
            assert!(bind_unix(&path, 0o600).is_err());
            drop(first);
            // Its file is left behind, stale: replaced.
            let second = bind_unix(&path, 0o600).expect("rebind over stale socket");
            let mode = std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
            // It answers at its path, and nothing of the staging is left beside it.
            assert!(tokio::net::UnixStream::connect(&path).await.is_ok(), "the renamed socket accepts");
            let mut left: Vec<String> = std::fs::read_dir(dir.path())
                .expect("dir")
                .map(|e| e.expect("entry").file_name().to_string_lossy().into())
                .collect();
            left.sort();
            assert_eq!(left, vec!["p.sock".to_string()]);
            drop(second);
        });
        let file = dir.path().join("f.sock");
        std::fs::write(&file, b"not a socket").expect("write");
        assert!(bind_unix(&file, 0o600).is_err());
        assert_eq!(std::fs::read(&file).expect("read"), b"not a socket");
    }
}
