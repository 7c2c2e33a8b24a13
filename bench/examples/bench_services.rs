//! Benchmark: M Services of type LoadBalancer created together (time until all have an
//! address, with the default `--kube-api-qps`), then node changes: the latency from each
//! change on the API server to every load balancer's backends changing in the sim (the sim
//! stamps each load balancer's last backend change).
//!
//! `cargo run -p ccm-bench --example bench_services -- [SERVICES] [CHANGES]` (defaults 200, 10;
//! the node-change latency is measured over the first 100 load balancers' worth of Services).

#[path = "bench/mod.rs"]
mod bench;

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bench::{World, arg, percentile, print_calls};
use ccm_harness::cluster::NodeBuilder;
use ccm_provider_sim::Config;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use kube::api::PostParams;

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn service(i: usize) -> Service {
    serde_json::from_value(serde_json::json!({
        "metadata": { "name": format!("svc-{i:04}"), "namespace": "default" },
        "spec": { "type": "LoadBalancer", "selector": { "app": "x" }, "ports": [{ "name": "http", "port": 80, "protocol": "TCP" }] }
    }))
    .expect("service")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let (services, changes) = (arg(1, 200) as usize, arg(2, 10) as usize);
    println!("bench_services: {services} services, {changes} node changes");
    let mut config = Config::default();
    config.load_balancers.address_pool = vec!["203.0.113.0/24".into(), "198.51.100.0/24".into(), "192.0.2.0/24".into()];
    for i in 0..changes + 3 {
        config.instances.push(bench::instance(format!("i-{i:04}"), format!("node-{i:04}"), "sim-region-1a"));
    }
    let mut world = World::start(config).await?;
    let client = world.client.clone();
    for i in 0..3 {
        NodeBuilder::new(format!("node-{i:04}")).provider_id(&format!("sim://sim-region-1a/i-{i:04}")).create(&client).await?;
    }
    // The core's defaults, except what World sets (no leader election, more API budget than
    // the default is given only where said).
    world.start_core(&["--controllers=service", "--kube-api-qps=20", "--kube-api-burst=30"])?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    world.admin.reset_calls().await?;

    let api: Api<Service> = Api::namespaced(client.clone(), "default");
    let started = Instant::now();
    futures::stream::iter(0..services)
        .for_each_concurrent(32, |i| {
            let api = api.clone();
            async move {
                let _ = api.create(&PostParams::default(), &service(i)).await;
            }
        })
        .await;
    loop {
        let list = api.list(&Default::default()).await?;
        let with = list
            .items
            .iter()
            .filter(|s| {
                s.status
                    .as_ref()
                    .and_then(|s| s.load_balancer.as_ref())
                    .and_then(|l| l.ingress.as_ref())
                    .is_some_and(|i| !i.is_empty())
            })
            .count();
        if with >= services {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            anyhow::bail!("only {with} of {services} services have addresses after 10 minutes");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("\n== {services} services created together");
    println!(
        "all had addresses after {:.1}s (default --kube-api-qps=20: a finalizer and a status write per Service)",
        started.elapsed().as_secs_f64()
    );
    print_calls(&world.calls().await?);

    // Node changes: each adds a backend; every load balancer must follow.
    let mut latencies = Vec::new();
    for c in 0..changes {
        let i = c + 3;
        let before = now_ms();
        NodeBuilder::new(format!("node-{i:04}")).provider_id(&format!("sim://sim-region-1a/i-{i:04}")).create(&client).await?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let state = world.admin.state().await?;
            let done: BTreeMap<&str, u64> = state
                .load_balancers
                .iter()
                .filter(|l| l.nodes.contains(&format!("node-{i:04}")))
                .map(|l| (l.name.as_str(), l.hosts_changed_at_unix_ms))
                .collect();
            if done.len() >= state.load_balancers.len() {
                latencies.extend(done.values().map(|at| at.saturating_sub(before)));
                break;
            }
            if Instant::now() > deadline {
                anyhow::bail!("node change {c} reached only {} load balancers", done.len());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    latencies.sort_unstable();
    println!("\n== {changes} node additions, each reaching {services} load balancers");
    println!(
        "node change to UpdateLoadBalancerHosts in the sim: p50 {} ms, p90 {} ms, p99 {} ms, max {} ms ({} samples)",
        percentile(&latencies, 50.0),
        percentile(&latencies, 90.0),
        percentile(&latencies, 99.0),
        latencies.last().copied().unwrap_or(0),
        latencies.len()
    );
    world.stop();
    Ok(())
}
