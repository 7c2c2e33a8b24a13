//! Benchmark: N Nodes joining together against a provider limited to R calls/s, then steady
//! state. Prints provider calls by method, wall time to initialise every Node, and steady-state
//! calls per hour (measured over a shorter refresh period and scaled to the 5-minute default).
//!
//! `cargo run -p ccm-bench --example bench_nodes -- [NODES] [RPS] [REFRESH_SECONDS] [STEADY_SECONDS]`
//! Defaults: 500 Nodes, 20 calls/s, refresh every 20 s, 60 s of steady state.

#[path = "bench/mod.rs"]
mod bench;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bench::{World, arg, cloud_calls, print_calls};
use ccm_harness::cluster::{NodeBuilder, set_ready};
use ccm_provider_sim::Config;
use ccm_provider_sim::config::RateLimit;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::Api;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let (nodes, rps, refresh, steady) = (arg(1, 500) as usize, arg(2, 20), arg(3, 20), arg(4, 60));
    println!("bench_nodes: {nodes} nodes, provider limited to {rps} calls/s, refresh every {refresh}s, {steady}s steady state");
    let mut config = Config::default();
    config.api.rate_limit = Some(RateLimit { rps: rps as f64, burst: rps as u32 });
    config.api.latency_ms = 5;
    for i in 0..nodes {
        let mut spec =
            bench::instance(format!("i-{i:05}"), format!("bench-{i:05}"), &format!("sim-region-1{}", ["a", "b", "c"][i % 3]));
        spec.tags = BTreeMap::from([("pool".to_string(), "bench".to_string())]);
        config.instances.push(spec);
    }
    let mut world = World::start(config).await?;
    let refresh_flag = format!("--node-status-update-frequency={refresh}s");
    world.start_core(&["--controllers=cloud-node,cloud-node-lifecycle", &refresh_flag])?;
    let (client, admin) = (world.client.clone(), world.admin.clone());
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
    let join_calls = world.calls().await?;
    println!("\n== {nodes} nodes joining together");
    println!("created in {:.1}s; all initialised after {:.1}s", created.as_secs_f64(), initialised.as_secs_f64());
    println!("provider calls (cloud API): {}", cloud_calls(&join_calls));
    print_calls(&join_calls);

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
    let steady_calls = world.calls().await?;
    let cloud = cloud_calls(&steady_calls);
    let refreshes = steady as f64 / refresh as f64;
    let per_refresh = cloud as f64 / refreshes;
    println!("\n== steady state, {steady}s with refresh every {refresh}s ({refreshes:.1} refreshes)");
    print_calls(&steady_calls);
    println!("cloud API calls: {cloud} ({per_refresh:.1} per refresh)");
    println!("scaled to the 5m default refresh: {:.0} cloud API calls per hour for {nodes} nodes", per_refresh * 12.0);

    world.stop();
    Ok(())
}
