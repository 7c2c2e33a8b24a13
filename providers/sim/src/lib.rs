//! # ccm-provider-sim
//!
//! A simulated cloud behind `cloudprovider.v1`, with real API semantics: instances with
//! states, route tables with quotas, load balancers with an address pool and a name limit,
//! a metadata view of one instance, latency, a rate limit answered with RetryInfo, injected
//! faults and eventual consistency. An admin API on its own socket changes the cloud and
//! reads call counters ([`admin`], [`client::AdminClient`]); an instance metadata service
//! ([`metadata`]) tells each instance about itself, and the kubelet-side plugin ([`plugin`])
//! serves that over NodeMetadataService and ImageCredentialsService.

pub mod admin;
pub mod calls;
pub mod client;
pub mod cloud;
pub mod config;
pub mod dataplane;
pub mod metadata;
pub mod plugin;
pub mod provider;

use std::sync::Arc;

use ccm_provider_sdk::metrics::CallMetrics;
use ccm_provider_sdk::{Listen, ProviderServer};
use prometheus_client::registry::Registry;
use tokio::sync::watch;

pub use client::AdminClient;
pub use config::Config;

/// The sim's version, as served by GetPluginInfo.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Where the sim serves.
#[derive(Debug, Clone)]
pub struct Endpoints {
    /// cloudprovider.v1.
    pub provider: Listen,
    /// The admin API, if wanted.
    pub admin: Option<Listen>,
    /// The instance metadata service, if wanted.
    pub metadata: Option<Listen>,
    /// The provider's Prometheus metrics at `/metrics` (`--metrics-listen`), if wanted.
    pub metrics: Option<Listen>,
}

impl Endpoints {
    /// cloudprovider.v1 on `provider`, nothing else.
    pub fn provider(provider: Listen) -> Self {
        Self { provider, admin: None, metadata: None, metrics: None }
    }
}

/// Runs the sim: cloudprovider.v1, and the admin API and metadata service when asked for,
/// until `shutdown` resolves.
pub async fn run(
    config: Config,
    endpoints: Endpoints,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve(config, endpoints, None, shutdown).await
}

/// [`run`], serving cloudprovider.v1 over mutual TLS when `tls` gives the files (a TCP
/// endpoint only).
pub async fn serve(
    config: Config,
    endpoints: Endpoints,
    tls: Option<ccm_provider_sdk::tls::TlsFiles>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let cloud = Arc::new(cloud::Cloud::new(&config)?);
    let calls = Arc::new(calls::Calls::default());
    let mut registry = Registry::default();
    let metrics = Arc::new(CallMetrics::register(&mut registry));
    let registry = Arc::new(registry);
    let provider = Arc::new(match &config.dataplane {
        Some(dataplane) => provider::SimProvider::with_dataplane(cloud.clone(), dataplane::Pusher::new(dataplane)?),
        None => provider::SimProvider::new(cloud.clone()),
    });

    let mut server = ProviderServer::new(config.plugin_name.clone(), VERSION)
        .manifest("cloud", "sim")
        .provider_id_scheme(cloud.scheme())
        // The sim's cloud lives in this process: a restart starts it again from its config.
        .epoch(format!("{:016x}", rand::random::<u64>()))
        .instances(provider.clone())
        .tags(provider.clone())
        .routes(provider.clone())
        .load_balancers(provider.clone())
        .probe(provider.clone())
        .observe(calls.clone())
        .observe(metrics);
    if cloud.serves_node_metadata() {
        server = server.node_metadata(provider.clone());
    }
    if let Some(files) = tls {
        server = server.tls(files);
    }
    server = server
        .allow_insecure_tcp(config.allow_insecure_tcp)
        .allow_insecure_metrics(config.allow_insecure_metrics)
        .socket_mode(config.socket_mode);
    if let Some(limit) = config.api.rate_limit.filter(|_| !config.api.undeclared_rate_limit) {
        // Every call of the sim's services is one call through its API gate.
        server = server.call_rate(limit.rps, limit.burst);
    }
    if let Some(listen) = endpoints.metrics.clone() {
        server = server.metrics(listen, registry.clone());
    }

    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    let mut side = Vec::new();
    if let Some(listen) = endpoints.admin {
        let app = admin::router(Arc::new(admin::Admin { cloud: cloud.clone(), calls, registry }));
        let stop = stopped(stop_rx.clone());
        side.push(tokio::spawn(async move { admin::serve_router(app, &listen, stop).await }));
    }
    if let Some(listen) = endpoints.metadata {
        let app = metadata::router(cloud.clone());
        let stop = stopped(stop_rx.clone());
        tracing::info!(endpoint = %listen, "serving the instance metadata service");
        side.push(tokio::spawn(async move { admin::serve_router(app, &listen, stop).await }));
    }
    let result = server.serve_with_shutdown(&endpoints.provider, stopped(stop_rx)).await;
    for task in side {
        // The side servers stop on the same signal; give them a moment to finish gracefully
        // (each removes its own socket file).
        match tokio::time::timeout(std::time::Duration::from_secs(5), task).await {
            Ok(Ok(Err(error))) => tracing::warn!(%error, "a side server failed"),
            Err(_) => tracing::warn!("a side server did not stop in time"),
            _ => {}
        }
    }
    result.map_err(Into::into)
}
