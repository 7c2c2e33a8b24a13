//! The gRPC server of a provider: Identity derived from the services given, every call
//! validated, observed and error-mapped, on a unix socket or TCP, with grpc.health.v1 and a
//! graceful stop on SIGTERM.

use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use ccm_proto::v1::identity_service_server::{IdentityService, IdentityServiceServer};
use ccm_proto::v1::image_credentials_service_server::{ImageCredentialsService, ImageCredentialsServiceServer};
use ccm_proto::v1::instances_service_server::{InstancesService, InstancesServiceServer};
use ccm_proto::v1::load_balancers_service_server::{LoadBalancersService, LoadBalancersServiceServer};
use ccm_proto::v1::node_metadata_service_server::{NodeMetadataService, NodeMetadataServiceServer};
use ccm_proto::v1::routes_service_server::{RoutesService, RoutesServiceServer};
use ccm_proto::v1::tags_service_server::{TagsService, TagsServiceServer};
use ccm_proto::v1::{self as pb, InstanceState, ServiceType};
use tokio::time::Instant;
use tonic::{Code, Request, Response, Status};

use crate::error::{Error, Result};
use crate::locks::ObjectLocks;
use crate::names::NameLimits;
use crate::page::PageRequest;
use crate::provider::{Answered, ImageCredentials, Instances, LoadBalancers, NodeMetadata, Probe, Readiness, Routes, Tags};
use crate::validate;

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
}

impl From<crate::tls::TlsError> for ServeError {
    fn from(e: crate::tls::TlsError) -> Self {
        Self::Tls(e.to_string())
    }
}

/// Where a server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    /// A unix socket path ending in `.sock`.
    Unix(PathBuf),
    /// A TCP address.
    Tcp(SocketAddr),
}

impl FromStr for Listen {
    type Err = ServeError;

    fn from_str(s: &str) -> std::result::Result<Self, ServeError> {
        let bad = |reason: &str| ServeError::Address { address: s.to_string(), reason: reason.to_string() };
        if let Some(path) = s.strip_prefix("unix://") {
            if !path.starts_with('/') {
                return Err(bad("a unix socket path must be absolute (unix:///path/provider.sock)"));
            }
            if !path.ends_with(".sock") {
                return Err(bad("a unix socket path must end in .sock"));
            }
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        let hostport = s.strip_prefix("tcp://").or_else(|| s.strip_prefix("http://")).unwrap_or(s);
        hostport.parse().map(Self::Tcp).map_err(|_| bad("expected unix:///path.sock, tcp://host:port or http://host:port"))
    }
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unix(p) => write!(f, "unix://{}", p.display()),
            Self::Tcp(a) => write!(f, "http://{a}"),
        }
    }
}

/// Binds a unix socket: creates the parent directory, replaces a stale socket file (one no
/// server answers on), refuses to replace anything else, and sets `mode` on the socket.
pub fn bind_unix(path: &Path, mode: u32) -> std::result::Result<tokio::net::UnixListener, ServeError> {
    let err = |source| ServeError::Bind { path: path.display().to_string(), source };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(err)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    "another server is listening on this socket",
                )));
            }
            std::fs::remove_file(path).map_err(err)?;
        }
        Ok(_) => {
            return Err(err(std::io::Error::new(std::io::ErrorKind::AlreadyExists, "path exists and is not a socket")));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    // Bound in a private directory (mode 0700) beside it, given its mode there and renamed into
    // place: the socket is never reachable at `path` with a wider mode than asked. (A path so
    // long that the staging one would pass the 107 bytes a socket address holds is bound in
    // place.)
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let staging = tempfile::Builder::new().prefix(".bind-").tempdir_in(parent).map_err(err)?;
    let staged = staging.path().join("s");
    let target = if staged.as_os_str().len() <= 107 { staged.as_path() } else { path };
    let listener = tokio::net::UnixListener::bind(target).map_err(err)?;
    std::fs::set_permissions(target, std::fs::Permissions::from_mode(mode)).map_err(err)?;
    if target != path {
        std::fs::rename(target, path).map_err(err)?;
    }
    Ok(listener)
}

/// Resolves when the process gets SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => std::future::pending::<()>().await,
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
    tls: Option<crate::tls::TlsFiles>,
    insecure_tcp: bool,
}

impl ProviderServer {
    /// A server for the plugin `name` (see [`valid_plugin_name`]) at `vendor_version`.
    pub fn new(name: impl Into<String>, vendor_version: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            vendor_version: vendor_version.into(),
            manifest: Default::default(),
            provider_id_scheme: String::new(),
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
            tls: None,
            insecure_tcp: false,
        }
    }

    /// The scheme of the providerIDs this provider issues (`"sim"` for `sim://…`), so the core
    /// can leave other providers' Nodes alone.
    pub fn provider_id_scheme(mut self, scheme: impl Into<String>) -> Self {
        self.provider_id_scheme = scheme.into();
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

    /// The mode of a unix socket (default 0600: only the owner may connect).
    pub fn socket_mode(mut self, mode: u32) -> Self {
        self.socket_mode = mode;
        self
    }

    /// The capabilities this server advertises, derived from the services it was given.
    pub fn capabilities(&self) -> pb::GetPluginCapabilitiesResponse {
        let mut caps = pb::GetPluginCapabilitiesResponse::default();
        if let Some(i) = &self.instances {
            caps.services.push(ServiceType::Instances as i32);
            caps.instances = Some(i.capabilities());
        }
        if self.tags.is_some() {
            caps.services.push(ServiceType::Tags as i32);
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
        caps
    }

    /// Serves on `listen` until SIGTERM or SIGINT, then stops gracefully and removes the
    /// socket file.
    pub async fn serve(self, listen: &Listen) -> std::result::Result<(), ServeError> {
        self.serve_with_shutdown(listen, shutdown_signal()).await
    }

    /// Serves on `listen` until `shutdown` resolves.
    pub async fn serve_with_shutdown(
        self,
        listen: &Listen,
        shutdown: impl Future<Output = ()> + Send,
    ) -> std::result::Result<(), ServeError> {
        if !valid_plugin_name(&self.name) {
            return Err(ServeError::PluginName(self.name));
        }
        let mode = self.socket_mode;
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
        let router = self.into_router(builder).await;
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

// === impl IdentityAdapter ===

struct IdentityAdapter {
    info: pb::GetPluginInfoResponse,
    caps: pb::GetPluginCapabilitiesResponse,
    probe: Option<Arc<dyn Probe>>,
    obs: Observers,
}

#[tonic::async_trait]
impl IdentityService for IdentityAdapter {
    async fn get_plugin_info(
        &self,
        _: Request<pb::GetPluginInfoRequest>,
    ) -> std::result::Result<Response<pb::GetPluginInfoResponse>, Status> {
        self.obs.call("IdentityService/GetPluginInfo", async { Ok(self.info.clone()) }).await
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<pb::GetPluginCapabilitiesRequest>,
    ) -> std::result::Result<Response<pb::GetPluginCapabilitiesResponse>, Status> {
        self.obs.call("IdentityService/GetPluginCapabilities", async { Ok(self.caps.clone()) }).await
    }

    async fn probe(&self, _: Request<pb::ProbeRequest>) -> std::result::Result<Response<pb::ProbeResponse>, Status> {
        self.obs
            .call("IdentityService/Probe", async {
                let readiness = match &self.probe {
                    Some(p) => p.probe().await?,
                    None => Readiness::Ready,
                };
                Ok(match readiness {
                    Readiness::Ready => pb::ProbeResponse { ready: true, ..Default::default() },
                    Readiness::NotReady(message) => pb::ProbeResponse { ready: false, message, ..Default::default() },
                })
            })
            .await
    }
}

/// A batch of lookups: checks its size, gives each invalid lookup its own item error, passes
/// the valid ones to the provider in one call, and returns one answer per lookup, in request
/// order, each naming its lookup. The provider's answers are put in order by the lookups they
/// name ([`in_order`]), so a provider that sorts or groups its reads cannot hand one lookup's
/// answer to another.
async fn batch<T>(
    lookups: &[pb::InstanceLookup],
    call: impl AsyncFnOnce(Vec<pb::InstanceLookup>) -> Result<Vec<Answered<T>>>,
) -> Result<Vec<Answered<T>>> {
    validate::batch_size(lookups.len())?;
    let (checked, valid) = checked(lookups, |l| validate::lookup(Some(l)).cloned());
    let keys: Vec<pb::LookupKey> = valid.iter().map(Answered::<()>::key).collect();
    let answers = in_order(&keys, call(valid).await?)?;
    let answers = merge("lookups", checked, answers.into_iter().map(|a| a.result).collect())?;
    Ok(lookups.iter().zip(answers).map(|(l, result)| Answered::to(l, result)).collect())
}

/// `answers` in the order of `asked`, by the lookup each names: they must name exactly the
/// lookups asked, each once; anything else is the provider's bug, refused as INTERNAL rather
/// than sent for the caller to sort out.
fn in_order<T>(asked: &[pb::LookupKey], answers: Vec<Answered<T>>) -> Result<Vec<Answered<T>>> {
    if answers.len() != asked.len() {
        return Err(Error::internal(format!("provider answered {} of {} lookups", answers.len(), asked.len())));
    }
    let mut named: std::collections::HashMap<(String, String), Vec<Answered<T>>> = std::collections::HashMap::new();
    for a in answers.into_iter().rev() {
        named.entry((a.lookup.provider_id.clone(), a.lookup.node_name.clone())).or_default().push(a);
    }
    asked
        .iter()
        .map(|k| {
            named.get_mut(&(k.provider_id.clone(), k.node_name.clone())).and_then(Vec::pop).ok_or_else(|| {
                Error::internal(format!(
                    "provider gave no answer for node {:?} (providerID {:?}): it answered a lookup it was not given, or one twice",
                    k.node_name, k.provider_id
                ))
            })
        })
        .collect()
}

/// The object key of route `name` in table `table` ("" is the default table).
fn route_key(table: &str, name: &str) -> String {
    format!("route {table}/{name}")
}

/// Each item's check, and the items that passed it (as `check` returns them), in order.
fn checked<I, V>(items: &[I], check: impl Fn(&I) -> Result<V>) -> (Vec<Result<()>>, Vec<V>) {
    let mut valid = Vec::with_capacity(items.len());
    let checks = items.iter().map(|item| check(item).map(|v| valid.push(v))).collect();
    (checks, valid)
}

/// One answer per item: its check's error, or the provider's answer for it (the answers are
/// for the items that passed, in order; any other count is the provider's bug).
fn merge<T>(what: &str, checks: Vec<Result<()>>, answers: Vec<Result<T>>) -> Result<Vec<Result<T>>> {
    let expected = checks.iter().filter(|c| c.is_ok()).count();
    if answers.len() != expected {
        return Err(Error::internal(format!("provider answered {} of {expected} {what}", answers.len())));
    }
    let mut answers = answers.into_iter();
    Ok(checks
        .into_iter()
        .map(|c| c.and_then(|()| answers.next().unwrap_or_else(|| Err(Error::internal("missing answer")))))
        .collect())
}

/// INVALID_ARGUMENT when a name is listed twice.
fn distinct<'a>(what: &str, names: impl IntoIterator<Item = &'a str>) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    match names.into_iter().find(|n| !seen.insert(*n)) {
        Some(twice) => Err(Error::invalid_argument(format!("{what} {twice:?} is listed twice"))),
        None => Ok(()),
    }
}

// === impl InstancesAdapter ===

struct InstancesAdapter {
    inner: Arc<dyn Instances>,
    ttl: Option<prost_types::Duration>,
    obs: Observers,
}

/// Terminated instances do not exist, whatever the provider's metadata says.
fn existing(m: Option<pb::InstanceMetadata>) -> Option<pb::InstanceMetadata> {
    m.filter(|m| m.state() != InstanceState::Terminated)
}

#[tonic::async_trait]
impl InstancesService for InstancesAdapter {
    async fn instance_exists(
        &self,
        req: Request<pb::InstanceExistsRequest>,
    ) -> std::result::Result<Response<pb::InstanceExistsResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("InstancesService/InstanceExists", async {
                let lookup = validate::lookup(req.instance.as_ref())?;
                Ok(pb::InstanceExistsResponse { exists: self.inner.instance_exists(lookup).await? })
            })
            .await
    }

    async fn instance_shutdown(
        &self,
        req: Request<pb::InstanceShutdownRequest>,
    ) -> std::result::Result<Response<pb::InstanceShutdownResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("InstancesService/InstanceShutdown", async {
                let lookup = validate::lookup(req.instance.as_ref())?;
                Ok(match self.inner.instance_shutdown(lookup).await? {
                    Some(shutdown) => pb::InstanceShutdownResponse { exists: true, shutdown },
                    None => pb::InstanceShutdownResponse { exists: false, shutdown: false },
                })
            })
            .await
    }

    async fn instance_metadata(
        &self,
        req: Request<pb::InstanceMetadataRequest>,
    ) -> std::result::Result<Response<pb::InstanceMetadataResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("InstancesService/InstanceMetadata", async {
                let lookup = validate::lookup(req.instance.as_ref())?;
                let metadata = existing(self.inner.instance_metadata(lookup).await?);
                Ok(pb::InstanceMetadataResponse { exists: metadata.is_some(), metadata, cache_ttl: self.ttl })
            })
            .await
    }

    async fn batch_instance_metadata(
        &self,
        req: Request<pb::BatchInstanceMetadataRequest>,
    ) -> std::result::Result<Response<pb::BatchInstanceMetadataResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("InstancesService/BatchInstanceMetadata", async {
                let answers = batch(&req.instances, async |valid| self.inner.batch_instance_metadata(&valid).await).await?;
                let results = answers
                    .into_iter()
                    .map(|answer| {
                        let lookup = Some(answer.lookup);
                        match answer.result {
                            Ok(m) => {
                                let metadata = existing(m);
                                pb::InstanceMetadataResult { exists: metadata.is_some(), metadata, error: None, lookup }
                            }
                            Err(e) => pb::InstanceMetadataResult {
                                exists: false,
                                metadata: None,
                                error: Some(e.to_item_error()),
                                lookup,
                            },
                        }
                    })
                    .collect();
                Ok(pb::BatchInstanceMetadataResponse { results, cache_ttl: self.ttl })
            })
            .await
    }

    async fn list_instances(
        &self,
        req: Request<pb::ListInstancesRequest>,
    ) -> std::result::Result<Response<pb::ListInstancesResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("InstancesService/ListInstances", async {
                let page = PageRequest::new(req.page_size, req.page_token);
                page.after()?;
                let page = self.inner.list_instances(&page).await?;
                Ok(pb::ListInstancesResponse {
                    instances: page.items,
                    next_page_token: page.next_page_token,
                    cache_ttl: self.ttl,
                })
            })
            .await
    }
}

// === impl TagsAdapter ===

struct TagsAdapter {
    inner: Arc<dyn Tags>,
    ttl: Option<prost_types::Duration>,
    obs: Observers,
}

#[tonic::async_trait]
impl TagsService for TagsAdapter {
    async fn get_instance_tags(
        &self,
        req: Request<pb::GetInstanceTagsRequest>,
    ) -> std::result::Result<Response<pb::GetInstanceTagsResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("TagsService/GetInstanceTags", async {
                let lookup = validate::lookup(req.instance.as_ref())?;
                let tags = self.inner.instance_tags(lookup).await?;
                Ok(pb::GetInstanceTagsResponse { exists: tags.is_some(), tags: tags.unwrap_or_default(), cache_ttl: self.ttl })
            })
            .await
    }

    async fn batch_get_instance_tags(
        &self,
        req: Request<pb::BatchGetInstanceTagsRequest>,
    ) -> std::result::Result<Response<pb::BatchGetInstanceTagsResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("TagsService/BatchGetInstanceTags", async {
                let answers = batch(&req.instances, async |valid| self.inner.batch_instance_tags(&valid).await).await?;
                let results = answers
                    .into_iter()
                    .map(|answer| {
                        let lookup = Some(answer.lookup);
                        match answer.result {
                            Ok(tags) => pb::InstanceTagsResult {
                                exists: tags.is_some(),
                                tags: tags.unwrap_or_default(),
                                error: None,
                                lookup,
                            },
                            Err(e) => pb::InstanceTagsResult {
                                exists: false,
                                tags: Default::default(),
                                error: Some(e.to_item_error()),
                                lookup,
                            },
                        }
                    })
                    .collect();
                Ok(pb::BatchGetInstanceTagsResponse { results, cache_ttl: self.ttl })
            })
            .await
    }
}

// === impl RoutesAdapter ===

struct RoutesAdapter {
    inner: Arc<dyn Routes>,
    /// One mutation per route at a time.
    locks: ObjectLocks,
    ipv6: bool,
    ttl: Option<prost_types::Duration>,
    obs: Observers,
}

#[tonic::async_trait]
impl RoutesService for RoutesAdapter {
    async fn list_route_tables(
        &self,
        req: Request<pb::ListRouteTablesRequest>,
    ) -> std::result::Result<Response<pb::ListRouteTablesResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("RoutesService/ListRouteTables", async {
                let page = PageRequest::new(req.page_size, req.page_token);
                page.after()?;
                let page = self.inner.list_route_tables(&page).await?;
                Ok(pb::ListRouteTablesResponse { tables: page.items, next_page_token: page.next_page_token })
            })
            .await
    }

    async fn list_routes(
        &self,
        req: Request<pb::ListRoutesRequest>,
    ) -> std::result::Result<Response<pb::ListRoutesResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("RoutesService/ListRoutes", async {
                let page = PageRequest::new(req.page_size, req.page_token);
                page.after()?;
                let page = self.inner.list_routes(&req.cluster_name, &req.table_id, &page).await?;
                Ok(pb::ListRoutesResponse { routes: page.items, next_page_token: page.next_page_token, cache_ttl: self.ttl })
            })
            .await
    }

    async fn create_route(
        &self,
        req: Request<pb::CreateRouteRequest>,
    ) -> std::result::Result<Response<pb::CreateRouteResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("RoutesService/CreateRoute", async {
                let route = validate::route(req.route.as_ref(), self.ipv6)?.clone();
                let _held = self.locks.lock([route_key(&route.table_id, &route.name)]).await;
                Ok(pb::CreateRouteResponse { route: Some(self.inner.create_route(&req.cluster_name, route).await?) })
            })
            .await
    }

    async fn delete_route(
        &self,
        req: Request<pb::DeleteRouteRequest>,
    ) -> std::result::Result<Response<pb::DeleteRouteResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("RoutesService/DeleteRoute", async {
                validate::route_name(&req.name)?;
                let _held = self.locks.lock([route_key(&req.table_id, &req.name)]).await;
                self.inner.delete_route(&req.cluster_name, &req.table_id, &req.name).await?;
                Ok(pb::DeleteRouteResponse {})
            })
            .await
    }

    async fn resolve_route_tables(
        &self,
        req: Request<pb::ResolveRouteTablesRequest>,
    ) -> std::result::Result<Response<pb::ResolveRouteTablesResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("RoutesService/ResolveRouteTables", async {
                validate::batch_size(req.targets.len())?;
                let answers = self.inner.resolve_route_tables(&req.targets).await?;
                let keys: Vec<pb::LookupKey> = req.targets.iter().map(Answered::<()>::target_key).collect();
                let assignments = in_order(&keys, answers)?
                    .into_iter()
                    .map(|a| {
                        let target = Some(pb::RouteTarget { node_name: a.lookup.node_name, provider_id: a.lookup.provider_id });
                        match a.result {
                            Ok(table_ids) => pb::RouteTableAssignment { table_ids, error: None, target },
                            Err(e) => pb::RouteTableAssignment { table_ids: Vec::new(), error: Some(e.to_item_error()), target },
                        }
                    })
                    .collect();
                Ok(pb::ResolveRouteTablesResponse { assignments })
            })
            .await
    }

    async fn apply_routes(
        &self,
        req: Request<pb::ApplyRoutesRequest>,
    ) -> std::result::Result<Response<pb::ApplyRoutesResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("RoutesService/ApplyRoutes", async {
                validate::batch_size(req.deletes.len() + req.creates.len())?;
                distinct("route to delete", req.deletes.iter().map(String::as_str))?;
                distinct("route to create", req.creates.iter().map(|r| r.name.as_str()))?;
                if let Some(r) = req.creates.iter().find(|r| !r.table_id.is_empty() && r.table_id != req.table_id) {
                    let why = format!("route {:?} names table {:?} in a call for table {:?}", r.name, r.table_id, req.table_id);
                    return Err(Error::invalid_argument(why));
                }
                let (delete_checks, deletes) = checked(&req.deletes, |n| validate::route_name(n).map(|()| n.clone()));
                let (create_checks, creates) = checked(&req.creates, |r| {
                    let mut route = validate::route(Some(r), self.ipv6)?.clone();
                    route.table_id.clone_from(&req.table_id);
                    Ok(route)
                });
                let names = deletes.iter().chain(creates.iter().map(|r| &r.name));
                let _held = self.locks.lock(names.map(|n| route_key(&req.table_id, n)).collect::<Vec<_>>()).await;
                let applied = self.inner.apply_routes(&req.cluster_name, &req.table_id, &deletes, creates).await?;
                let deletes = merge("deletes", delete_checks, applied.deletes)?;
                let creates = merge("creates", create_checks, applied.creates)?;
                Ok(pb::ApplyRoutesResponse {
                    deletes: deletes
                        .into_iter()
                        .map(|r| pb::RouteDeleteResult { error: r.err().map(|e| e.to_item_error()) })
                        .collect(),
                    creates: creates
                        .into_iter()
                        .map(|r| match r {
                            Ok(route) => pb::RouteResult { route: Some(route), error: None },
                            Err(e) => pb::RouteResult { route: None, error: Some(e.to_item_error()) },
                        })
                        .collect(),
                })
            })
            .await
    }
}

// === impl LoadBalancersAdapter ===

struct LoadBalancersAdapter {
    inner: Arc<dyn LoadBalancers>,
    /// One mutation per load balancer at a time.
    locks: ObjectLocks,
    limits: NameLimits,
    obs: Observers,
}

#[tonic::async_trait]
impl LoadBalancersService for LoadBalancersAdapter {
    async fn get_load_balancer(
        &self,
        req: Request<pb::GetLoadBalancerRequest>,
    ) -> std::result::Result<Response<pb::GetLoadBalancerResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("LoadBalancersService/GetLoadBalancer", async {
                let service = validate::load_balancer_ref(req.service.as_ref(), &self.limits)?;
                let status = self.inner.get_load_balancer(service).await?;
                Ok(pb::GetLoadBalancerResponse { exists: status.is_some(), status })
            })
            .await
    }

    async fn ensure_load_balancer(
        &self,
        req: Request<pb::EnsureLoadBalancerRequest>,
    ) -> std::result::Result<Response<pb::EnsureLoadBalancerResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("LoadBalancersService/EnsureLoadBalancer", async {
                let service = validate::load_balancer_spec(req.service.as_ref(), &self.limits)?;
                let _held = self.locks.lock([service.load_balancer_name.clone()]).await;
                let status = self.inner.ensure_load_balancer(service, &req.nodes).await?;
                Ok(pb::EnsureLoadBalancerResponse { status: Some(status) })
            })
            .await
    }

    async fn update_load_balancer_hosts(
        &self,
        req: Request<pb::UpdateLoadBalancerHostsRequest>,
    ) -> std::result::Result<Response<pb::UpdateLoadBalancerHostsResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("LoadBalancersService/UpdateLoadBalancerHosts", async {
                let service = validate::load_balancer_ref(req.service.as_ref(), &self.limits)?;
                let _held = self.locks.lock([service.load_balancer_name.clone()]).await;
                self.inner.update_load_balancer_hosts(service, &req.nodes).await?;
                Ok(pb::UpdateLoadBalancerHostsResponse {})
            })
            .await
    }

    async fn ensure_load_balancer_deleted(
        &self,
        req: Request<pb::EnsureLoadBalancerDeletedRequest>,
    ) -> std::result::Result<Response<pb::EnsureLoadBalancerDeletedResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("LoadBalancersService/EnsureLoadBalancerDeleted", async {
                let service = validate::load_balancer_ref(req.service.as_ref(), &self.limits)?;
                let _held = self.locks.lock([service.load_balancer_name.clone()]).await;
                self.inner.ensure_load_balancer_deleted(service).await?;
                Ok(pb::EnsureLoadBalancerDeletedResponse {})
            })
            .await
    }

    async fn list_load_balancers(
        &self,
        req: Request<pb::ListLoadBalancersRequest>,
    ) -> std::result::Result<Response<pb::ListLoadBalancersResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("LoadBalancersService/ListLoadBalancers", async {
                let page = PageRequest::new(req.page_size, req.page_token);
                page.after()?;
                let page = self.inner.list_load_balancers(&req.cluster_name, &page).await?;
                Ok(pb::ListLoadBalancersResponse { load_balancers: page.items, next_page_token: page.next_page_token })
            })
            .await
    }

    async fn batch_update_load_balancer_hosts(
        &self,
        req: Request<pb::BatchUpdateLoadBalancerHostsRequest>,
    ) -> std::result::Result<Response<pb::BatchUpdateLoadBalancerHostsResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("LoadBalancersService/BatchUpdateLoadBalancerHosts", async {
                validate::batch_size(req.services.len())?;
                distinct("load balancer", req.services.iter().map(|s| s.load_balancer_name.as_str()))?;
                let (checks, valid) = checked(&req.services, |s| validate::load_balancer_ref(Some(s), &self.limits).cloned());
                let _held = self.locks.lock(valid.iter().map(|s| s.load_balancer_name.clone()).collect::<Vec<_>>()).await;
                let answers = self.inner.batch_update_load_balancer_hosts(&valid, &req.nodes).await?;
                let results = merge("load balancers", checks, answers)?
                    .into_iter()
                    .map(|r| pb::HostsUpdateResult { error: r.err().map(|e| e.to_item_error()) })
                    .collect();
                Ok(pb::BatchUpdateLoadBalancerHostsResponse { results })
            })
            .await
    }
}

// === impl NodeMetadataAdapter ===

struct NodeMetadataAdapter {
    inner: Arc<dyn NodeMetadata>,
    obs: Observers,
}

#[tonic::async_trait]
impl NodeMetadataService for NodeMetadataAdapter {
    async fn get_node_metadata(
        &self,
        _: Request<pb::GetNodeMetadataRequest>,
    ) -> std::result::Result<Response<pb::GetNodeMetadataResponse>, Status> {
        self.obs
            .call("NodeMetadataService/GetNodeMetadata", async {
                let metadata = self.inner.node_metadata().await?;
                ccm_protocol::answer::node_metadata(&metadata)?;
                Ok(pb::GetNodeMetadataResponse { metadata: Some(metadata) })
            })
            .await
    }
}

// === impl ImageCredentialsAdapter ===

struct ImageCredentialsAdapter {
    inner: Arc<dyn ImageCredentials>,
    obs: Observers,
}

#[tonic::async_trait]
impl ImageCredentialsService for ImageCredentialsAdapter {
    async fn get_image_credentials(
        &self,
        req: Request<pb::GetImageCredentialsRequest>,
    ) -> std::result::Result<Response<pb::GetImageCredentialsResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("ImageCredentialsService/GetImageCredentials", async {
                crate::registry::image_host(&req.image)?;
                let answer = self.inner.image_credentials(&req).await?;
                crate::registry::check_answer(&answer)?;
                Ok(answer)
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
