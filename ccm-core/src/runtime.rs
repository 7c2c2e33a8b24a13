//! Wires the process together: Kubernetes client, provider client, shared Node watch, health
//! server, leader election and the enabled controllers; stops gracefully on SIGTERM and
//! fail-stops when the leader lease is lost.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Node, Service};
use kube::Api;
use kube::runtime::watcher;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::controllers::{Context, registry};
use crate::credentials::Credentials;
use crate::http::{self, Readiness};
use crate::informer::{Informer, slim_node, slim_service};
use crate::leader::{self, Election, Leading};
use crate::metrics::Metrics;
use crate::options::Options;
use crate::provider::Provider;
use crate::provider::set::Providers;

/// How often the provider is probed (Probe is answered by the sidecar, not the cloud API).
pub const PROBE_PERIOD: Duration = Duration::from_secs(10);

struct Ready {
    providers: Arc<Providers>,
    nodes: Informer<Node>,
    services: Informer<Service>,
    metrics: Metrics,
    watch_failure_threshold: Duration,
}

impl Readiness for Ready {
    fn ready(&self) -> Result<(), Vec<String>> {
        let mut reasons = Vec::new();
        if let Some(why) = self.metrics.failure() {
            reasons.push(format!("failing: {why}"));
        }
        // Each provider on its own line: one that is down is told by name (its work waits;
        // the others' goes on).
        for provider in self.providers.all() {
            let (ok, why) = provider.readiness();
            if !ok {
                reasons.push(format!("provider {} ({}): {why}", provider.name(), provider.endpoint()));
            }
        }
        reasons.extend(self.providers.conflicts());
        if !self.nodes.synced() {
            reasons.push("node cache not synced".into());
        }
        if !self.services.synced() {
            reasons.push("service cache not synced".into());
        }
        for (kind, failing) in [("node", self.nodes.failing()), ("service", self.services.failing())] {
            if let Some((how_long, error)) = failing.filter(|(d, _)| *d >= self.watch_failure_threshold) {
                reasons.push(format!("the {kind} watch has been failing for {}s: {error}", how_long.as_secs()));
            }
        }
        if reasons.is_empty() { Ok(()) } else { Err(reasons) }
    }
}

async fn kube_config(options: &Options) -> anyhow::Result<kube::Config> {
    Ok(match &options.kubeconfig {
        Some(path) => {
            let kubeconfig =
                kube::config::Kubeconfig::read_from(path).with_context(|| format!("reading --kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await.context("loading --kubeconfig")?
        }
        None => kube::Config::incluster().context("no --kubeconfig given and not running in a cluster")?,
    })
    .and_then(|mut config| {
        if let Some(master) = &options.upstream.master {
            config.cluster_url = master.parse().with_context(|| format!("--master {master:?} is not a URL"))?;
        }
        Ok(config)
    })
}

/// `config` with the controllers' timeouts: a connect timeout, and `read` for the next byte
/// of any answer, counted from when the request was sent (a pooled connection's idle time
/// does not count), so that a half-open connection fails a write or a watch instead of hanging
/// it; watches are renewed by the API server before that ([`watch_timeout`]).
pub fn with_timeouts(mut config: kube::Config, read: Duration) -> kube::Config {
    config.connect_timeout = Some(Duration::from_secs(10));
    config.read_timeout = Some(read);
    config.write_timeout = Some(read);
    config.reset_reader_on_write = true;
    config
}

/// The server-side timeout of each watch request: 15 s within the read timeout, so that a
/// quiet watch ends and is renewed (from its resourceVersion, no listing) before the read
/// timeout could take it for a dead connection; and kube-runtime's idle timeout (this + 5 s)
/// catches one whose end never arrives.
fn watch_timeout(read: Duration) -> u32 {
    u32::try_from(read.as_secs().saturating_sub(15).max(5)).unwrap_or(u32::MAX)
}

/// The delegated checks of the health and metrics server, as upstream's: with the
/// kubeconfigs given, else with the pod's own in-cluster credentials whatever `--kubeconfig`
/// says (static-pod manifests pass one), else without an authenticator or authoriser, which
/// lets only the always-allowed paths through (and `system:masters`). Plain HTTP
/// (`--insecure-serving`) is never checked: it is the operator's explicit choice.
async fn delegation(options: &Options) -> anyhow::Result<Option<Arc<crate::delegation::Delegation>>> {
    if options.insecure_serving {
        return Ok(None);
    }
    let client_from = async |path: &std::path::Path, flag: &str| -> anyhow::Result<kube::Client> {
        let kubeconfig =
            kube::config::Kubeconfig::read_from(path).with_context(|| format!("reading {flag} {}", path.display()))?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .with_context(|| format!("loading {flag} {}", path.display()))?;
        kube::Client::try_from(config).with_context(|| format!("{flag}: building the client"))
    };
    let in_cluster = || -> anyhow::Result<Option<kube::Client>> {
        if std::env::var_os("KUBERNETES_SERVICE_HOST").is_none() {
            return Ok(None);
        }
        let config = kube::Config::incluster().context("in-cluster credentials for delegated authentication")?;
        Ok(Some(kube::Client::try_from(config).context("building the delegated authentication client")?))
    };
    let authn = options.authentication_kubeconfig.as_deref();
    let authz = options.authorization_kubeconfig.as_deref().or(authn);
    let authentication = match authn.or(authz) {
        Some(path) => Some(client_from(path, "--authentication-kubeconfig").await?),
        None => in_cluster()?,
    };
    let authorization = match authz {
        Some(path) => Some(client_from(path, "--authorization-kubeconfig").await?),
        None => in_cluster()?,
    };
    if authentication.is_none() {
        tracing::warn!("no --authentication-kubeconfig and not in a cluster: every request to the secure port is anonymous");
    }
    if authorization.is_none() {
        tracing::warn!(
            "no --authorization-kubeconfig and not in a cluster: only --authorization-always-allow-paths and system:masters are allowed on the secure port"
        );
    }
    Ok(Some(Arc::new(crate::delegation::Delegation::new(
        authentication,
        authorization,
        options.authorization_always_allow_paths.clone(),
    ))))
}

/// When this environment variable is set (non-empty), the binaries parse and check their
/// arguments, print `<binary>: arguments ok` and exit without starting anything: how the
/// deploy tests prove that the arguments a chart or manifest renders are accepted.
pub const CHECK_ARGS_ENV: &str = "CCM_CHECK_ARGS";

/// The `cloud-controller-manager` command: parses `args` (the program name first), sets up
/// logging, runs until SIGTERM or SIGINT, and reports how it ended.
pub async fn main_with_args(args: impl IntoIterator<Item = std::ffi::OsString>) -> std::process::ExitCode {
    use clap::Parser;
    let options = match Options::try_parse_from(args) {
        Ok(options) => options,
        Err(e) => e.exit(),
    };
    match crate::version::request(options.version.as_deref()) {
        Ok(crate::version::Request::Print) => {
            println!("{}", crate::version::line(None));
            return std::process::ExitCode::SUCCESS;
        }
        Ok(crate::version::Request::Raw) => {
            println!("{}", crate::version::raw(None));
            return std::process::ExitCode::SUCCESS;
        }
        Ok(crate::version::Request::Report(_) | crate::version::Request::Run) => {}
        Err(error) => {
            eprintln!("cloud-controller-manager: {error}");
            return std::process::ExitCode::from(2);
        }
    }
    if std::env::var_os(CHECK_ARGS_ENV).is_some_and(|v| !v.is_empty()) {
        return match options.validate() {
            Ok(()) => {
                println!("cloud-controller-manager: arguments ok");
                std::process::ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("cloud-controller-manager: {error}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    let format = if options.log_format() == "json" { crate::logging::Format::Json } else { crate::logging::Format::Text };
    crate::logging::init(format, &options.log_filter());
    if let Some(crate::options::Command::ReleaseFinalizers { wait }) = &options.command {
        return match release_finalizers(&options, *wait).await {
            Ok(count) => {
                println!("cloud-controller-manager: removed the load balancer finalizer from {count} Service(s)");
                std::process::ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("cloud-controller-manager release-finalizers: {error:#}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    for note in options.upstream_notes() {
        tracing::info!("{note}");
    }
    match run(options).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("{error:#}");
            eprintln!("cloud-controller-manager: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn release_finalizers(options: &Options, wait: Duration) -> anyhow::Result<usize> {
    let client = kube::Client::try_from(kube_config(options).await?).context("building the Kubernetes client")?;
    Ok(crate::uninstall::release_finalizers(
        &client,
        &options.leader_elect_resource_namespace,
        &options.leader_elect_resource_name,
        options.service_namespace.as_deref(),
        options.load_balancer_class.as_deref(),
        wait,
    )
    .await?)
}

/// Runs the cloud-controller-manager until SIGTERM or SIGINT (Ok) or until it must stop (Err).
pub async fn run(options: Options) -> anyhow::Result<()> {
    run_until(options, terminated()).await
}

/// Resolves at the first SIGTERM (what the kubelet sends) or SIGINT (a terminal's Ctrl-C); never
/// when the handlers cannot be installed, so the process then runs until killed.
async fn terminated() {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut term) = signal(SignalKind::terminate()) else { return std::future::pending().await };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// Runs the cloud-controller-manager until `shutdown` resolves (Ok) or until it must stop,
/// such as after losing the leader lease (Err).
pub async fn run_until(options: Options, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
    options.validate()?;
    let config = with_timeouts(kube_config(&options).await?, options.kube_api_read_timeout);
    let metrics = Metrics::new();
    let client = metrics.kube_client(config.clone())?;
    let tls = options.provider_tls_cert_file.as_ref().map(|cert| ccm_protocol::tls::TlsFiles {
        cert: cert.clone(),
        key: options.provider_tls_key_file.clone().unwrap_or_default(),
        ca: options.provider_tls_ca_file.clone().unwrap_or_default(),
    });
    // One client per provider: each with its own connection, concurrency limit, throttle
    // gate, identity, epochs and readiness, so that one provider's trouble stays its own.
    let mut providers = Vec::new();
    let access = crate::provider::access::access(&options)?;
    for (name, endpoint) in options.provider_endpoints()? {
        let provider = match access.peer_uids.get(&name) {
            Some(&uid) => crate::provider::access::checked_unix_channel(&endpoint, uid).map(|channel| {
                Provider::over(
                    channel,
                    &endpoint,
                    options.provider_call_timeout,
                    options.provider_max_concurrency,
                    metrics.clone(),
                )
            }),
            None => Provider::connect(
                &endpoint,
                tls.as_ref().map(|files| (files, options.provider_tls_server_name.as_deref())),
                options.provider_allow_insecure_tcp,
                options.provider_call_timeout,
                options.provider_max_concurrency,
                metrics.clone(),
            ),
        }
        .with_context(|| format!("--provider-endpoint {name}={endpoint}"))?
        .named(&name)
        .with_max_retry_after(options.provider_max_retry_after)
        .with_mutation_timeout(options.provider_mutation_timeout);
        providers.push(provider);
    }
    let lease_client = leader::client(&config, options.leader_elect_renew_deadline, &metrics)?;
    let parts = Parts { client, lease_client, providers, metrics, identity: None, config: Some(config) };
    run_with(options, parts, shutdown).await
}

/// What [`run_with`] runs on: the clients and the provider, made from the flags by
/// [`run_until`], or by a simulation that runs the core against a model of the API server
/// and an in-process provider.
pub struct Parts {
    /// The controllers' client (its watches, reads and writes).
    pub client: kube::Client,
    /// The Lease's client (short timeouts of its own).
    pub lease_client: kube::Client,
    /// The providers, in `--provider-endpoint` order (one, named `default`, for the plain form).
    pub providers: Vec<Provider>,
    /// The metrics the clients and the provider report to.
    pub metrics: Metrics,
    /// The leader election identity, if not `<hostname>_<pid>_<random>`.
    pub identity: Option<String>,
    /// The configuration `client` was made from: the controllers' own credentials
    /// (`--use-service-account-credentials`) are made from it, and need it.
    pub config: Option<kube::Config>,
}

/// Runs the core on `parts` until `shutdown` resolves (Ok) or until it must stop (Err).
pub async fn run_with(options: Options, parts: Parts, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
    options.validate()?;
    let options = Arc::new(options);
    let enabled = options.enabled_controllers()?;
    let Parts { client, lease_client, providers, metrics, identity, config } = parts;
    let providers = Arc::new(match <[Provider; 1]>::try_from(providers) {
        Ok([provider]) => Providers::single(provider, options.provider_rules()),
        Err(providers) if providers.is_empty() => anyhow::bail!("no provider to run with"),
        Err(providers) => Providers::new(providers, options.provider_rules()),
    });

    // One cancellation tree: `root` ends the process's background work (watches, the health
    // server, the provider's probe); `shutdown`, its child, is cancelled by the signal and
    // stops the controllers first. Background tasks are tracked and joined before returning.
    let root = CancellationToken::new();
    let shutdown_token = root.child_token();
    let background = TaskTracker::new();
    let signalled = shutdown_token.clone();
    background.spawn(async move {
        tokio::select! {
            _ = shutdown => signalled.cancel(),
            _ = signalled.cancelled() => {}
        }
    });
    let stop = root.clone();
    let supervisor = crate::supervisor::Supervisor::new(background.clone(), shutdown_token.clone(), metrics.clone());
    let credentials = match (&config, options.use_service_account_credentials) {
        (Some(config), true) => {
            let credentials =
                Credentials::new(config.clone(), options.service_account_names, metrics.clone(), supervisor.clone())?;
            Some(Arc::new(credentials))
        }
        (None, true) => {
            anyhow::bail!("--use-service-account-credentials needs a kubeconfig to make the controllers' clients from")
        }
        _ => None,
    };
    let access = crate::provider::access::access(&options)?;
    if !access.tokens.is_empty() {
        let config = config.as_ref().context("--provider-token needs a kubeconfig to request tokens with")?;
        crate::credentials::hand_over(config, access.tokens.clone(), &metrics, &supervisor, stop.clone())
            .context("--provider-token")?;
    }
    for provider in providers.all() {
        supervisor.spawn("a provider's probe", &stop, provider.clone().watch(PROBE_PERIOD, stop.clone()));
    }
    let watcher_config = watcher::Config::default().page_size(500).timeout(watch_timeout(options.kube_api_read_timeout));
    let nodes = Informer::start(Api::<Node>::all(client.clone()), watcher_config.clone(), slim_node, &supervisor, stop.clone());
    let service_api = match &options.service_namespace {
        Some(ns) => Api::<Service>::namespaced(client.clone(), ns),
        None => Api::<Service>::all(client.clone()),
    };
    let services = Informer::start(service_api, watcher_config, slim_service, &supervisor, stop.clone());

    let ready = Arc::new(Ready {
        providers: providers.clone(),
        nodes: nodes.clone(),
        services: services.clone(),
        metrics: metrics.clone(),
        watch_failure_threshold: options.watch_failure_threshold,
    });
    if options.secure_port != 0 {
        let ready = ready.clone();
        let delegation = delegation(&options).await?;
        let checked = delegation.is_some();
        let app = http::router(metrics.clone(), ready, delegation, access.clone());
        let addr = SocketAddr::new(options.bind_address, options.secure_port);
        let tls = match (&options.tls_cert_file, &options.tls_private_key_file) {
            _ if options.insecure_serving => http::Tls::None,
            (Some(cert), Some(key)) => http::Tls::Files { cert: cert.clone(), key: key.clone() },
            _ => http::Tls::SelfSigned,
        };
        let bound = http::serve(addr, tls, app, &background, stop.clone()).await?;
        tracing::info!(address = %bound, tls = !options.insecure_serving, delegated_auth = checked, "serving /healthz, /readyz and /metrics");
    }

    let ctx = Context::new(client.clone(), providers, nodes, services, metrics.clone(), options.clone())?;
    let groups = leader::plan(&options, &enabled)?;
    let result = if groups.is_empty() {
        run_controllers(ctx, credentials, &enabled, shutdown_token.clone(), None).await.map_err(anyhow::Error::from)
    } else {
        // With shared Leases, a replica whose /readyz fails is given no controller Lease while
        // a ready one competes for it, and hands over those it holds.
        // Every live replica may run controllers that call the cloud through its own sidecar:
        // each paces to its share of the provider's declared call rate.
        let sharing = ctx.providers.clone();
        let election = Election::new(&options, lease_client, metrics.clone())
            .with_readiness(Arc::new(move |_lease: &str| ready.ready().is_ok()))
            .with_sharing(Arc::new(move |replicas| {
                for provider in sharing.all() {
                    provider.share_rate(replicas);
                }
            }));
        let election = match identity {
            Some(identity) => election.with_identity(identity),
            None => election,
        };
        election
            .lead(groups, &shutdown_token, move |group, leading, stop| {
                let (ctx, credentials) =
                    (ctx.with_fence(Some(leading.fence.clone())).with_ledger(Some(leading.ledger.clone())), credentials.clone());
                async move { run_controllers(ctx, credentials, &group.controllers, stop, Some(leading)).await }
            })
            .await
            .map_err(anyhow::Error::from)
    };
    // A critical background task that failed is the process's failure, whatever the
    // controllers made of the stop it caused.
    let result = match supervisor.failure() {
        Some(why) if result.is_ok() => Err(anyhow::anyhow!(why)),
        _ => result,
    };
    root.cancel();
    background.close();
    if tokio::time::timeout(Duration::from_secs(5), background.wait()).await.is_err() {
        tracing::warn!("background tasks did not stop within 5 s");
    }
    result
}

/// Runs the enabled controllers until SIGTERM, or until leadership is lost (an error: the
/// process exits so that a restart rejoins the election cleanly).
async fn run_controllers(
    ctx: Context,
    credentials: Option<Arc<Credentials>>,
    enabled: &std::collections::BTreeSet<&'static str>,
    stop: CancellationToken,
    leading: Option<Leading>,
) -> Result<(), RunError> {
    // The controllers' own token: cancelled on `stop`, and when they must end for any other
    // reason (the lead lost, a controller failed).
    let ctl_stop = stop.child_token();
    // With --use-service-account-credentials, each controller writes as its own ServiceAccount;
    // the shared watches keep the process's credentials.
    let ctx_for = async |name: &str| -> Result<Context, RunError> {
        let own = ctx.for_controller();
        match &credentials {
            Some(c) => Ok(own.with_client(c.client_for(name, ctl_stop.clone()).await?)),
            None => Ok(own),
        }
    };
    let mut tasks: Vec<(&'static str, tokio::task::JoinHandle<()>)> = Vec::new();
    for controller in registry::CONTROLLERS.iter().filter(|c| enabled.contains(c.name)) {
        let run = (controller.start)(ctx_for(controller.name).await?, ctl_stop.clone())?;
        tasks.push((controller.name, tokio::spawn(run)));
    }
    for (name, _) in &tasks {
        ctx.metrics.controller_running(name, true);
    }
    let lost = async {
        match &leading {
            Some(l) => l.lost.cancelled().await,
            None => std::future::pending::<()>().await,
        }
    };
    // A controller runs until told to stop: one that ends first (a panic above all) is a
    // failure of the process, not a silent loss of that controller.
    let ended = async {
        if tasks.is_empty() {
            return std::future::pending().await;
        }
        let (result, i, _) = futures::future::select_all(tasks.iter_mut().map(|(_, t)| t)).await;
        (i, result)
    };
    // Biased: the controllers' token is a child of `stop`, so on shutdown they end at once;
    // the stop is what happened, not a controller ending by itself.
    let outcome = tokio::select! {
        biased;
        _ = stop.cancelled() => Ok(()),
        _ = lost => Err(None),
        (i, result) = ended => Err(Some((i, result))),
    };
    ctl_stop.cancel();
    for (name, _) in &tasks {
        ctx.metrics.controller_running(name, false);
    }
    for (name, t) in tasks.iter_mut() {
        if outcome.is_err() {
            // The lead is lost (or the process is failing): nothing more is written, not even
            // an in-flight reconcile's next request (the renew deadline is shorter than the
            // lease: another replica cannot have taken over yet).
            t.abort();
        } else {
            // Given 5 s to stop, and longer while a mutation it sent is in flight (aborted, it
            // would leave the provider running it with nobody waiting for the answer); then
            // aborted, so that nothing of it runs once the Lease is released (a Lease handed
            // over is taken by another replica at once).
            // The lead lost meanwhile (another group's loss stopped this one, and its own
            // follows): aborted at once, its calls with it, before another replica can take over.
            // Once its mutations ended, another 5 s to write down what their answers said
            // (each such write counts in flight until it ends).
            let grace = async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                if let Some(l) = &leading {
                    l.fence.quiesced().await;
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    l.fence.quiesced().await;
                }
            };
            let lost = async {
                match &leading {
                    Some(l) => l.lost.cancelled().await,
                    None => std::future::pending::<()>().await,
                }
            };
            let stopped = tokio::select! {
                _ = &mut *t => true,
                _ = grace => false,
                _ = lost => false,
            };
            if !stopped {
                tracing::warn!(controller = *name, "did not stop within 5 s of its mutations' end; aborted");
                t.abort();
                let _ = (&mut *t).await;
            }
        }
    }
    match outcome {
        Ok(()) => {
            tracing::info!("stopped");
            Ok(())
        }
        Err(None) => Err(RunError::LeaseLost),
        Err(Some((i, result))) => {
            let name = tasks.get(i).map_or("a controller", |(n, _)| *n);
            ctx.metrics.set_failed(format!("{name} ended unexpectedly"));
            match result {
                Err(e) if e.is_panic() => Err(RunError::Panicked(name)),
                _ => Err(RunError::Ended(name)),
            }
        }
    }
}

/// Why the controllers stopped, other than for shutdown: each is the end of the process, so
/// that a restart rejoins the election and starts every controller afresh.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The Lease was lost.
    #[error("lost the leader lease; exiting so that a restart rejoins the election")]
    LeaseLost,
    /// A controller panicked.
    #[error("{0} panicked; exiting so that the process is restarted")]
    Panicked(&'static str),
    /// A controller ended by itself.
    #[error("{0} ended unexpectedly; exiting so that the process is restarted")]
    Ended(&'static str),
    /// A controller's own credentials could not be made.
    #[error(transparent)]
    Credentials(#[from] crate::credentials::CredentialsError),
    /// A controller's flags do not fit together.
    #[error(transparent)]
    Config(#[from] crate::controllers::ConfigError),
}
