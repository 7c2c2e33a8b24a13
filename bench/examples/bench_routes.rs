//! Benchmark: N Nodes get podCIDRs; measures the latency from each podCIDR being set on the
//! API server to its route existing in the sim (the sim stamps each route's creation time),
//! once with all podCIDRs set in a burst and once with one every 100 ms; then counts
//! ListRoutes calls at steady state under heartbeat-like Node updates.
//!
//! `cargo run -p ccm-bench --example bench_routes -- [NODES] [STEADY_SECONDS]` (defaults 200, 60)

#[path = "bench/mod.rs"]
mod bench;

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bench::{World, arg, cloud_calls, percentile, print_calls};
use ccm_harness::cluster::{NodeBuilder, set_ready};
use ccm_provider_sim::Config;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn cidr(i: usize) -> String {
    format!("10.{}.{}.0/24", 64 + i / 256, i % 256)
}

async fn set_cidr(api: &Api<Node>, name: &str, cidr: &str) -> anyhow::Result<u64> {
    let patch = serde_json::json!({ "spec": { "podCIDR": cidr, "podCIDRs": [cidr] } });
    let at = now_ms();
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
    Ok(at)
}

async fn latencies(world: &World, set_at: &HashMap<String, u64>) -> anyhow::Result<Vec<u64>> {
    loop {
        let state = world.admin.state().await?;
        let created: HashMap<String, u64> = state
            .route_tables
            .iter()
            .flat_map(|t| t.routes.iter())
            .map(|r| (r.destination_cidr.clone(), r.created_at_unix_ms))
            .collect();
        if set_at.keys().all(|c| created.contains_key(c)) {
            let mut l: Vec<u64> = set_at.iter().map(|(c, at)| created[c].saturating_sub(*at)).collect();
            l.sort_unstable();
            return Ok(l);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn report(label: &str, l: &[u64]) {
    println!(
        "{label}: {} routes; latency p50 {} ms, p90 {} ms, p99 {} ms, max {} ms",
        l.len(),
        percentile(l, 50.0),
        percentile(l, 90.0),
        percentile(l, 99.0),
        l.last().copied().unwrap_or(0)
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let (nodes, steady) = (arg(1, 200) as usize, arg(2, 60));
    println!("bench_routes: {nodes} nodes, {steady}s steady state");
    let mut config = Config::default();
    config.route_tables[0].max_routes = 0;
    config.api.latency_ms = 5;
    for i in 0..nodes {
        config.instances.push(bench::instance(format!("i-{i:05}"), format!("bench-{i:05}"), "sim-region-1a"));
    }
    let mut world = World::start(config).await?;
    world.start_core(&["--controllers=route", "--cluster-cidr=10.64.0.0/10"])?;
    let api: Api<Node> = Api::all(world.client.clone());
    futures::stream::iter(0..nodes)
        .for_each_concurrent(32, |i| {
            let client = world.client.clone();
            async move {
                let name = format!("bench-{i:05}");
                let _ = NodeBuilder::new(&name).create(&client).await;
                let _ = set_ready(&client, &name, "True").await;
            }
        })
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    world.admin.reset_calls().await?;

    // Half the Nodes get their podCIDR in one burst.
    let half = nodes / 2;
    let burst: Vec<(String, u64)> = futures::stream::iter(0..half)
        .map(|i| {
            let api = api.clone();
            async move {
                let name = format!("bench-{i:05}");
                let at = set_cidr(&api, &name, &cidr(i)).await.unwrap_or(0);
                (cidr(i), at)
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    let l = latencies(&world, &burst.into_iter().collect()).await?;
    println!("\n== podCIDRs set in a burst");
    report("burst", &l);

    // The other half one at a time, every 100 ms.
    let mut trickle = HashMap::new();
    for i in half..nodes {
        trickle.insert(cidr(i), set_cidr(&api, &format!("bench-{i:05}"), &cidr(i)).await?);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let l = latencies(&world, &trickle).await?;
    println!("== podCIDRs set one every 100 ms");
    report("trickle", &l);
    println!("provider calls so far:");
    print_calls(&world.calls().await?);

    // Steady state: heartbeats (Ready condition and a label) on every Node every 10 s.
    world.admin.reset_calls().await?;
    let started = std::time::Instant::now();
    let mut round = 0;
    while started.elapsed() < Duration::from_secs(steady) {
        futures::stream::iter(0..nodes)
            .for_each_concurrent(32, |i| {
                let (client, api) = (world.client.clone(), api.clone());
                async move {
                    let name = format!("bench-{i:05}");
                    let _ = set_ready(&client, &name, "True").await;
                    let patch = serde_json::json!({ "metadata": { "labels": { "heartbeat": round.to_string() } } });
                    let _ = api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await;
                }
            })
            .await;
        round += 1;
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
    let calls = world.calls().await?;
    let lists = calls.get("RoutesService/ListRoutes").copied().unwrap_or(0);
    println!("\n== steady state, {}s with {round} heartbeat rounds on {nodes} nodes", started.elapsed().as_secs());
    print_calls(&calls);
    println!(
        "cloud API calls: {}; ListRoutes: {lists} (a 10 s timer makes 360 an hour; ours: {:.0} an hour plus one safety resync every 12-24 h)",
        cloud_calls(&calls),
        lists as f64 * 3600.0 / started.elapsed().as_secs_f64()
    );
    world.stop();
    Ok(())
}
