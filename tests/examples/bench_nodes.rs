//! Benchmark: N Nodes joining together against a provider limited to R calls/s, then steady
//! state. Prints provider calls by method, wall time to initialise every Node, and steady-state
//! calls per hour (measured over a shorter refresh period and scaled to the 5-minute default).
//!
//! `cargo run -p ccm-e2e --example bench_nodes -- [NODES] [RPS] [REFRESH_SECONDS] [STEADY_SECONDS]`
//! Defaults: 500 Nodes, 20 calls/s, refresh every 20 s, 60 s of steady state.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ccm_e2e::ControlPlane;
use ccm_e2e::cluster::{NodeBuilder, set_ready};
use ccm_provider_sim::config::{InstanceSpec, RateLimit};
use ccm_provider_sim::{AdminClient, Config};
use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::Api;

fn arg(n: usize, default: u64) -> u64 {
    std::env::args().nth(n).and_then(|a| a.parse().ok()).unwrap_or(default)
}

async fn counts(admin: &AdminClient) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for c in admin.calls().await.expect("calls").counts {
        *out.entry(c.method).or_default() += c.count;
    }
    out
}

fn cloud_calls(c: &BTreeMap<String, u64>) -> u64 {
    c.iter().filter(|(m, _)| !m.starts_with("IdentityService/")).map(|(_, n)| n).sum()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let (nodes, rps, refresh, steady) = (arg(1, 500) as usize, arg(2, 20), arg(3, 20), arg(4, 60));
    println!("bench_nodes: {nodes} nodes, provider limited to {rps} calls/s, refresh every {refresh}s, {steady}s steady state");
    let cp = tokio::task::spawn_blocking(ControlPlane::start).await??;
    let client = cp.client().await?;

    let dir = tempfile::tempdir()?;
    let mut config = Config::default();
    config.api.rate_limit = Some(RateLimit { rps: rps as f64, burst: rps as u32 });
    config.api.latency_ms = 5;
    for i in 0..nodes {
        config.instances.push(InstanceSpec {
            id: format!("i-{i:05}"),
            name: format!("bench-{i:05}"),
            zone: format!("sim-region-1{}", ["a", "b", "c"][i % 3]),
            instance_type: "sim.large".into(),
            state: Default::default(),
            addresses: Vec::new(),
            tags: BTreeMap::from([("pool".to_string(), "bench".to_string())]),
        });
    }
    let sock = dir.path().join("provider.sock");
    let admin_sock = dir.path().join("admin.sock");
    let (stop_sim, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(ccm_provider_sim::run(
        config,
        ccm_provider_sdk::Listen::Unix(sock.clone()),
        Some(ccm_provider_sdk::Listen::Unix(admin_sock.clone())),
        async move {
            let _ = rx.await;
        },
    ));
    while tokio::net::UnixStream::connect(&admin_sock).await.is_err() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let admin = AdminClient::new(format!("unix://{}", admin_sock.display()));

    let kubeconfig = cp.kubeconfig_path().display().to_string();
    let endpoint = format!("unix://{}", sock.display());
    let refresh_flag = format!("--node-status-update-frequency={refresh}s");
    let options = ccm_core::options::Options::try_parse_from([
        "cloud-controller-manager",
        "--kubeconfig",
        &kubeconfig,
        "--provider-endpoint",
        &endpoint,
        "--leader-elect=false",
        "--secure-port=0",
        "--kube-api-qps=200",
        "--kube-api-burst=400",
        &refresh_flag,
    ])?;
    let (stop_core, rx) = tokio::sync::oneshot::channel::<()>();
    let core = tokio::spawn(ccm_core::runtime::run_until(options, async move {
        let _ = rx.await;
    }));
    tokio::time::sleep(Duration::from_secs(1)).await;
    admin.reset_calls().await?;

    // All Nodes register at once, as kubelets with --cloud-provider=external would.
    let started = Instant::now();
    futures::stream::iter(0..nodes)
        .for_each_concurrent(32, |i| {
            let client = client.clone();
            async move {
                let name = format!("bench-{i:05}");
                if let Err(e) = NodeBuilder::new(&name).uninitialized().address("Hostname", &name).create(&client).await {
                    eprintln!("create {name}: {e:#}");
                }
            }
        })
        .await;
    let created = started.elapsed();
    let api: Api<Node> = Api::all(client.clone());
    let taint = "node.cloudprovider.kubernetes.io/uninitialized";
    loop {
        let list = api.list(&Default::default()).await?;
        let pending = list
            .items
            .iter()
            .filter(|n| n.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == taint)))
            .count();
        if pending == 0 && list.items.len() >= nodes {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            anyhow::bail!("{pending} nodes still uninitialised after 10 minutes");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let initialised = started.elapsed();
    let join_calls = counts(&admin).await;
    println!("\n== {nodes} nodes joining together");
    println!("created in {:.1}s; all initialised after {:.1}s", created.as_secs_f64(), initialised.as_secs_f64());
    println!("provider calls (cloud API): {}", cloud_calls(&join_calls));
    for (m, n) in &join_calls {
        println!("  {m:50} {n}");
    }

    // Steady state: every Node Ready, as their kubelets would report.
    futures::stream::iter(0..nodes)
        .for_each_concurrent(32, |i| {
            let client = client.clone();
            async move {
                let _ = set_ready(&client, &format!("bench-{i:05}"), "True").await;
            }
        })
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    admin.reset_calls().await?;
    tokio::time::sleep(Duration::from_secs(steady)).await;
    let steady_calls = counts(&admin).await;
    let cloud = cloud_calls(&steady_calls);
    let refreshes = steady as f64 / refresh as f64;
    let per_refresh = cloud as f64 / refreshes;
    println!("\n== steady state, {steady}s with refresh every {refresh}s ({refreshes:.1} refreshes)");
    for (m, n) in &steady_calls {
        println!("  {m:50} {n}");
    }
    println!("cloud API calls: {cloud} ({per_refresh:.1} per refresh)");
    println!("scaled to the 5m default refresh: {:.0} cloud API calls per hour for {nodes} nodes", per_refresh * 12.0);

    let _ = stop_core.send(());
    let _ = core.await;
    let _ = stop_sim.send(());
    Ok(())
}
