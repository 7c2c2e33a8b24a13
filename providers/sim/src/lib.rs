//! # ccm-provider-sim
//!
//! A simulated cloud behind `cloudprovider.v1`, with real API semantics: instances with
//! states, route tables with quotas, load balancers with an address pool and a name limit,
//! a metadata view of one instance, latency, a rate limit answered with RetryInfo, injected
//! faults and eventual consistency. An admin API on its own socket changes the cloud and
//! reads call counters ([`admin`], [`client::AdminClient`]).

pub mod admin;
pub mod calls;
pub mod client;
pub mod cloud;
pub mod config;
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

/// Runs the sim: cloudprovider.v1 on `listen` and, when given, the admin API on
/// `admin_listen`, until `shutdown` resolves.
pub async fn run(
    config: Config,
    listen: Listen,
    admin_listen: Option<Listen>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let cloud = Arc::new(cloud::Cloud::new(&config)?);
    let calls = Arc::new(calls::Calls::default());
    let mut registry = Registry::default();
    let metrics = Arc::new(CallMetrics::register(&mut registry));
    let provider = Arc::new(provider::SimProvider::new(cloud.clone()));

    let mut server = ProviderServer::new(config.plugin_name.clone(), VERSION)
        .manifest("cloud", "sim")
        .provider_id_scheme(cloud::PROVIDER_ID_SCHEME.trim_end_matches("://"))
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

    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    let admin_socket = match &admin_listen {
        Some(Listen::Unix(path)) => Some(path.clone()),
        _ => None,
    };
    let admin_task = match admin_listen {
        Some(admin_listen) => {
            let admin = Arc::new(admin::Admin { cloud, calls, registry });
            let stop = stopped(stop_rx.clone());
            Some(tokio::spawn(async move { admin::serve(admin, &admin_listen, stop).await }))
        }
        None => None,
    };
    let result = server.serve_with_shutdown(&listen, stopped(stop_rx)).await;
    if let Some(task) = admin_task {
        // The admin server stops on the same signal; give it a moment to finish gracefully.
        if tokio::time::timeout(std::time::Duration::from_secs(5), task).await.is_err() {
            tracing::warn!("the admin server did not stop in time");
        }
    }
    if let Some(path) = admin_socket {
        let _ = std::fs::remove_file(path);
    }
    result.map_err(Into::into)
}
