//! `ccm-bench --cloud selectors`: backends chosen per Service, and load balancers repaired.
//!
//! One Rust core (the service controller) on a sim that cannot list load balancers, as every
//! Go provider the adapter serves. The Nodes are spread over `--selectors` pools (label
//! `pool=p<k>`), and each Service chooses one pool with `ccm-rs.dev/load-balancer-node-selector`.
//! Then, one at a time, a Node is added to a pool, removed from one, or moved between two: the
//! figures are which load balancers' hosts changed (only the affected pools' should), the calls
//! each change cost, and the latency until every affected load balancer had its new hosts,
//! beside the floor (the affected load balancers' calls at the cloud's rate limit). Without
//! selectors every load balancer would take every change: that figure is the Services count.
//!
//! Then the repair reads: with `--load-balancer-repair-period` at `--repair-period`, the
//! GetLoadBalancer calls of one period (one per load balancer) give the calls an hour at the
//! default period of 24 h; three load balancers deleted behind the core's back are made again
//! within a period.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ccm_harness::ControlPlane;
use ccm_harness::cluster::{NodeBuilder, load_balancer_ip, load_balancer_service};
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde::Serialize;

use crate::Args;
use crate::scenarios::{
    CoreProcess, calls, create_all, create_namespace, delete_services, instance_id, instance_ip, node_name, percentile,
    sim_config, start_sim_with, until,
};

const TAG: &str = "sel";
const SELECTOR: &str = "ccm-rs.dev/load-balancer-node-selector";
/// The methods that change a load balancer.
const WRITES: [&str; 3] = [
    "LoadBalancersService/UpdateLoadBalancerHosts",
    "LoadBalancersService/BatchUpdateLoadBalancerHosts",
    "LoadBalancersService/EnsureLoadBalancer",
];

/// One node change.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Change {
    /// What changed: `add`, `remove` or `move`.
    pub kind: String,
    /// Load balancers whose selector chooses a pool the change touched.
    pub affected: usize,
    /// Load balancers whose hosts changed.
    pub touched: usize,
    /// Touched load balancers that were not affected (must be 0).
    pub wrongly_touched: usize,
    /// Load balancer write calls it cost (served by the cloud).
    pub calls: u64,
    /// Write calls the cloud refused for its rate limit (retried after its RetryInfo).
    pub throttled: u64,
    /// Milliseconds until every affected load balancer had its new hosts (NaN-free: the
    /// timeout when not all did).
    pub all_ms: u64,
}

/// The run's figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// Nodes.
    pub nodes: usize,
    /// LoadBalancer Services.
    pub services: usize,
    /// Distinct node selectors (pools).
    pub selectors: usize,
    /// Seconds until every load balancer had its address and its pool's Nodes.
    pub setup_seconds: f64,
    /// The node changes.
    pub changes: Vec<Change>,
    /// Median load balancer writes per change.
    pub calls_per_change_p50: u64,
    /// Median affected load balancers per change.
    pub affected_per_change_p50: u64,
    /// Load balancers a change would touch without selectors: every one.
    pub without_selectors_per_change: usize,
    /// Latency from a change to an affected load balancer's new hosts, p50 and p99 (ms).
    pub hosts_p50_ms: u64,
    /// As above, p99.
    pub hosts_p99_ms: u64,
    /// The floor of one change: its affected load balancers' calls at the sustained rate limit
    /// (ms, median; the sim's burst lets a small change beat it).
    pub floor_p50_ms: u64,
    /// The repair period used for the reads.
    pub repair_period_seconds: f64,
    /// GetLoadBalancer calls in one repair period.
    pub repair_reads_per_period: u64,
    /// The same, per hour at the default period of 24 h.
    pub repair_reads_per_hour_at_default: f64,
    /// Load balancers deleted behind the core's back, and seconds until all were made again.
    pub deleted_by_hand: usize,
    /// Seconds until they were all back (NaN when not within three periods).
    pub recreated_seconds: f64,
    /// CPU seconds of the core.
    pub cpu_seconds: f64,
    /// Its peak resident memory, MiB.
    pub peak_rss_mib: f64,
}

impl Report {
    /// The table.
    pub fn table(&self) -> String {
        let row = |name: &str, v: String| format!("{name:<60} {v:>14}\n");
        let mut t = format!(
            "backends per Service: {} Nodes, {} Services, {} selectors; repair reads without listing\n",
            self.nodes, self.services, self.selectors
        );
        t += &row("setup: every load balancer on its pool (s)", format!("{:.2}", self.setup_seconds));
        for c in &self.changes {
            t += &row(
                &format!("change {:<6}: affected / touched / wrong / calls (throttled)", c.kind),
                format!("{} / {} / {} / {} ({})", c.affected, c.touched, c.wrongly_touched, c.calls, c.throttled),
            );
        }
        t += &row("load balancer writes per change (median)", self.calls_per_change_p50.to_string());
        t += &row("without selectors, every load balancer per change", self.without_selectors_per_change.to_string());
        t += &row("hosts updated: p50 / p99 (ms)", format!("{} / {}", self.hosts_p50_ms, self.hosts_p99_ms));
        t += &row("floor at the sustained rate: affected calls / limit (ms, median)", self.floor_p50_ms.to_string());
        t += &row("  (the sim's burst lets a change of few calls beat it)", String::new());
        t += &row(
            &format!("repair reads per period ({:.0} s)", self.repair_period_seconds),
            self.repair_reads_per_period.to_string(),
        );
        t += &row("repair reads per hour at the default 24 h", format!("{:.1}", self.repair_reads_per_hour_at_default));
        t += &row(
            &format!("{} deleted by hand: all made again (s)", self.deleted_by_hand),
            format!("{:.1}", self.recreated_seconds),
        );
        t += &format!("core: {:.2} CPU s, peak RSS {:.1} MiB\n", self.cpu_seconds, self.peak_rss_mib);
        t
    }

    /// Figures not measured, or wrong.
    pub fn missing(&self) -> Vec<String> {
        let mut missing = Vec::new();
        for (i, c) in self.changes.iter().enumerate() {
            if c.wrongly_touched > 0 {
                missing.push(format!("change {i} ({}) touched {} load balancers it does not affect", c.kind, c.wrongly_touched));
            }
            if c.touched < c.affected {
                missing.push(format!("change {i} ({}) reached {} of {} affected load balancers", c.kind, c.touched, c.affected));
            }
        }
        if !self.recreated_seconds.is_finite() {
            missing.push("recreated_seconds".into());
        }
        if self.repair_reads_per_period == 0 {
            missing.push("repair_reads_per_period".into());
        }
        missing
    }
}

fn pool(i: usize, selectors: usize) -> String {
    format!("p{}", i % selectors)
}

/// A Node of instance `i`, initialised (providerID), in pool `pool`.
async fn node(client: &kube::Client, i: usize, pool: &str) -> anyhow::Result<()> {
    let name = node_name(TAG, i);
    NodeBuilder::new(&name)
        .label("bench", "selectors")
        .label("pool", pool)
        .provider_id(&format!("sim://{}/{}", crate::scenarios::ZONE, instance_id(TAG, i)))
        .address("InternalIP", &instance_ip(i))
        .create(client)
        .await
        .with_context(|| format!("node {name}"))?;
    Ok(())
}

/// Load balancer name → pool of its Service, from the sim's state.
async fn pools_of(admin: &ccm_provider_sim::AdminClient, selectors: usize) -> anyhow::Result<HashMap<String, String>> {
    let state = admin.state().await?;
    Ok(state
        .load_balancers
        .into_iter()
        .filter_map(|l| {
            let i: usize = l.service.rsplit('-').next()?.parse().ok()?;
            Some((l.name, pool(i, selectors)))
        })
        .collect())
}

/// Load balancer write calls the cloud served, and those it refused for its rate limit.
async fn writes(admin: &ccm_provider_sim::AdminClient) -> anyhow::Result<(u64, u64)> {
    let (mut served, mut refused) = (0, 0);
    for c in admin.calls().await?.counts.into_iter().filter(|c| WRITES.contains(&c.method.as_str())) {
        match c.code.as_str() {
            "RESOURCE_EXHAUSTED" | "ResourceExhausted" => refused += c.count,
            _ => served += c.count,
        }
    }
    Ok((served, refused))
}

/// Runs the scenario.
pub async fn run(cp: &ControlPlane, args: &Args) -> anyhow::Result<Report> {
    let selectors = args.selectors.max(1);
    let client = cp.client().await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let ns = "bench-selectors";
    create_namespace(&client, ns).await?;
    let services: Api<Service> = Api::namespaced(client.clone(), ns);
    let dir = tempfile::tempdir()?;
    let mut config = sim_config(args, TAG);
    config.load_balancers.list = false;
    let (sim, stop_sim, admin, endpoint) = start_sim_with(config, dir.path()).await?;
    let kubeconfig = cp.kubeconfig_path().display().to_string();
    let log = std::path::PathBuf::from(format!("{}.selectors.log", args.json.display()));
    let mut cmd = tokio::process::Command::new(std::env::current_exe()?);
    cmd.arg("__core").args([
        format!("--kubeconfig={kubeconfig}"),
        format!("--provider-endpoint={endpoint}"),
        "--cluster-name=bench".into(),
        "--leader-elect=false".into(),
        "--secure-port=0".into(),
        "--controllers=service".into(),
        format!("--service-namespace={ns}"),
        "--node-exclude-selector=bench!=selectors".into(),
        format!("--load-balancer-repair-period={}s", args.repair_period.as_secs()),
        format!("--kube-api-qps={}", args.kube_api_qps),
        format!("--kube-api-burst={}", args.kube_api_burst),
        format!("--log-level={}", args.core_log),
    ]);
    let mut process = CoreProcess::spawn(&mut cmd, &log, "the core")?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    if let Some(status) = process.exited()? {
        bail!("the core exited at start ({status}); see {}", log.display());
    }
    let mut report = Report { nodes: args.nodes, services: args.services, selectors, ..Default::default() };

    // Setup: the Nodes in their pools, then the Services, each choosing one pool.
    let started = Instant::now();
    create_all(args.nodes, |i| {
        let client = client.clone();
        async move { node(&client, i, &pool(i, selectors)).await }
    })
    .await?;
    create_all(args.services, |j| {
        let services = services.clone();
        async move {
            let mut svc = load_balancer_service(ns, &format!("lb-{j}"), &[80]);
            svc.metadata.annotations = Some([(SELECTOR.to_string(), format!("pool={}", pool(j, selectors)))].into());
            services.create(&PostParams::default(), &svc).await.with_context(|| format!("service lb-{j}"))?;
            Ok(())
        }
    })
    .await?;
    let mut per_pool: HashMap<String, usize> = HashMap::new();
    for i in 0..args.nodes {
        *per_pool.entry(pool(i, selectors)).or_default() += 1;
    }
    until("every load balancer on its pool", Duration::from_secs(900), async || {
        let listed = services.list(&ListParams::default()).await?.items;
        let addressed = listed.iter().filter(|s| load_balancer_ip(s).is_some()).count();
        let hosts = admin.hosts_summary().await?;
        let pools = pools_of(&admin, selectors).await?;
        let right = hosts.iter().filter(|h| pools.get(&h.name).is_some_and(|p| per_pool.get(p) == Some(&h.hosts))).count();
        Ok((addressed >= args.services && right >= args.services).then_some(()))
    })
    .await?;
    report.setup_seconds = started.elapsed().as_secs_f64();
    eprintln!("   setup: {:.1} s", report.setup_seconds);
    let lb_pools = pools_of(&admin, selectors).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;

    // The changes, one at a time.
    let mut latencies = Vec::new();
    let mut floors = Vec::new();
    let mut next_new = args.nodes;
    for c in 0..args.churn.max(3) {
        let p = c % selectors;
        let (kind, touched_pools): (&str, BTreeSet<String>) = match c % 3 {
            0 => ("add", [pool(p, selectors)].into()),
            1 => ("remove", [pool(p, selectors)].into()),
            _ => ("move", [pool(p, selectors), pool(p + 1, selectors)].into()),
        };
        let before = writes(&admin).await?;
        let at = crate::scenarios::now_ms();
        match kind {
            "add" => {
                node(&client, next_new, &pool(p, selectors)).await?;
                next_new += 1;
            }
            "remove" => {
                let victim = find_in_pool(&nodes, &pool(p, selectors)).await?.context("no node to remove")?;
                nodes.delete(&victim, &DeleteParams::default()).await.context("removing a node")?;
            }
            _ => {
                let moved = find_in_pool(&nodes, &pool(p, selectors)).await?.context("no node to move")?;
                let patch = serde_json::json!({ "metadata": { "labels": { "pool": pool(p + 1, selectors) } } });
                nodes.patch(&moved, &PatchParams::default(), &Patch::Merge(&patch)).await.context("moving a node")?;
            }
        }
        let affected: BTreeSet<&String> = lb_pools.iter().filter(|(_, pl)| touched_pools.contains(*pl)).map(|(n, _)| n).collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen: HashMap<String, u64> = HashMap::new();
        while Instant::now() < deadline && affected.iter().any(|a| !seen.contains_key(*a)) {
            for lb in admin.hosts_summary().await? {
                if lb.hosts_changed_at_unix_ms >= at {
                    seen.entry(lb.name).or_insert(lb.hosts_changed_at_unix_ms - at);
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Quiet, so that a late update of an unaffected load balancer is seen too.
        tokio::time::sleep(Duration::from_secs(1)).await;
        for lb in admin.hosts_summary().await? {
            if lb.hosts_changed_at_unix_ms >= at {
                seen.entry(lb.name).or_insert(lb.hosts_changed_at_unix_ms - at);
            }
        }
        let after = writes(&admin).await?;
        let reached: Vec<u64> = affected.iter().filter_map(|a| seen.get(*a).copied()).collect();
        let change = Change {
            kind: kind.into(),
            affected: affected.len(),
            touched: seen.len(),
            wrongly_touched: seen.keys().filter(|n| !affected.contains(n)).count(),
            calls: after.0 - before.0,
            throttled: after.1 - before.1,
            all_ms: if reached.len() == affected.len() { reached.iter().copied().max().unwrap_or(0) } else { 60_000 },
        };
        eprintln!(
            "   {kind}: {} affected, {} touched ({} wrongly), {} calls ({} throttled), all in {} ms",
            change.affected, change.touched, change.wrongly_touched, change.calls, change.throttled, change.all_ms
        );
        latencies.extend(reached);
        let floor = if args.bulk { 1.0 } else { affected.len() as f64 };
        floors.push((floor / args.rate_limit * 1000.0) as u64);
        report.changes.push(change);
    }
    latencies.sort_unstable();
    (report.hosts_p50_ms, report.hosts_p99_ms) = (percentile(&latencies, 50.0), percentile(&latencies, 99.0));
    let mut per_change: Vec<u64> = report.changes.iter().map(|c| c.calls).collect();
    per_change.sort_unstable();
    report.calls_per_change_p50 = percentile(&per_change, 50.0);
    let mut affected: Vec<u64> = report.changes.iter().map(|c| c.affected as u64).collect();
    affected.sort_unstable();
    report.affected_per_change_p50 = percentile(&affected, 50.0);
    floors.sort_unstable();
    report.floor_p50_ms = percentile(&floors, 50.0);
    report.without_selectors_per_change = args.services;

    // Repair reads: one period of GetLoadBalancer calls, then three load balancers deleted.
    let period = args.repair_period;
    report.repair_period_seconds = period.as_secs_f64();
    let gets = async || -> anyhow::Result<u64> {
        Ok(calls(&admin).await?.get("LoadBalancersService/GetLoadBalancer").copied().unwrap_or(0))
    };
    // The reads start within a period of the first load balancer (the core looks for
    // load balancers to read once a period while it has none); then two periods, halved.
    let started_at = gets().await?;
    until("the repair reads started", period * 3, async || Ok((gets().await? > started_at).then_some(()))).await?;
    let first = gets().await?;
    tokio::time::sleep(period * 2).await;
    report.repair_reads_per_period = (gets().await? - first) / 2;
    report.repair_reads_per_hour_at_default = report.repair_reads_per_period as f64 / 24.0;
    let names: Vec<String> = lb_pools.keys().take(3).cloned().collect();
    report.deleted_by_hand = names.len();
    let started = Instant::now();
    for n in &names {
        admin.remove_load_balancer(n).await?;
    }
    let back = until("the deleted load balancers made again", period * 3, async || {
        let state = admin.state().await?;
        let present = names.iter().filter(|n| state.load_balancers.iter().any(|l| &l.name == *n)).count();
        Ok((present == names.len()).then_some(()))
    })
    .await;
    report.recreated_seconds = if back.is_ok() { started.elapsed().as_secs_f64() } else { f64::NAN };
    eprintln!(
        "   repair: {} reads a period of {:?}; {} deleted by hand back in {:.1} s",
        report.repair_reads_per_period, period, report.deleted_by_hand, report.recreated_seconds
    );

    report.cpu_seconds = process.cpu_seconds();
    report.peak_rss_mib = process.rss_mib().1;
    delete_services(&services, Duration::from_secs(120)).await?;
    process.stop().await;
    nodes.delete_collection(&DeleteParams::default(), &ListParams::default().labels("bench=selectors")).await?;
    let _ = Api::<Namespace>::all(client.clone()).delete(ns, &DeleteParams::default()).await;
    let _ = stop_sim.send(());
    let _ = sim.await;
    Ok(report)
}

/// A Node of `pool`, if any.
async fn find_in_pool(nodes: &Api<Node>, pool: &str) -> anyhow::Result<Option<String>> {
    let listed = nodes.list(&ListParams::default().labels(&format!("bench=selectors,pool={pool}"))).await?.items;
    Ok(listed.into_iter().filter_map(|n| n.metadata.name).min())
}
