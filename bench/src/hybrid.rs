//! `ccm-bench --cloud hybrid`: one Rust core with two providers (two sims of two providerID
//! schemes, "a" and "b", each with the latency and rate limit of the flags), half the Nodes and
//! Services each. Measures, per provider: the join (provider A's Nodes found by name lookups,
//! B's labelled by their kubelets, `ccm-rs.dev/provider=b`), the load balancers (unclassed
//! Services to A, a class to B), the calls each provider got, and cross-talk (a load balancer,
//! a backend or a providerID on the wrong provider). Then provider B is throttled to a
//! twentieth of its rate and more Nodes join both: A's must join as fast as before.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ccm_harness::ControlPlane;
use ccm_harness::cluster::{NodeBuilder, UNINITIALIZED_TAINT, load_balancer_ip, load_balancer_service};
use ccm_provider_sim::AdminClient;
use ccm_provider_sim::config::RateLimit;
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use serde::Serialize;

use crate::Args;
use crate::scenarios::{
    CoreProcess, calls, create_all, create_namespace, delete_services, node_name, ready, sim_config, start_sim_with, until,
};

const CLASS_B: &str = "b.bench.ccm-rs.dev/lb";
const PROVIDER_LABEL: &str = "ccm-rs.dev/provider";

/// One provider's figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Side {
    /// Nodes that joined through it.
    pub nodes: usize,
    /// How they were assigned to it: `lookup` (no label: every provider asked by name) or
    /// `label` (the kubelet's `ccm-rs.dev/provider`).
    pub assigned_by: String,
    /// Seconds from the first Node created to every Node of this provider initialised.
    pub join_seconds: f64,
    /// The floor of the join: its provider calls at the provider's rate limit.
    pub join_floor_seconds: f64,
    /// Provider calls during the join, by method.
    pub join_calls: BTreeMap<String, u64>,
    /// Load balancers made by it.
    pub services: usize,
    /// Seconds from the first Service created to every one of this provider with an address.
    pub lb_seconds: f64,
    /// Provider calls while the load balancers were made, by method.
    pub lb_calls: BTreeMap<String, u64>,
    /// Nodes that joined while provider B was throttled.
    pub throttled_nodes: usize,
    /// Seconds until those were initialised (NaN when not within the timeout).
    pub throttled_join_seconds: f64,
    /// Cross-talk found: load balancers, backends or providerIDs of the other provider's.
    pub cross_talk: Vec<String>,
}

/// The run's figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// Provider A (unclassed Services, Nodes by lookup).
    pub a: Side,
    /// Provider B (a class, labelled Nodes; throttled in the last phase).
    pub b: Side,
    /// The join's floor in API writes: two writes per Node (status, then labels, providerID
    /// and taint), both providers' Nodes over one `--kube-api-qps` budget (less its burst).
    pub join_write_floor_seconds: f64,
    /// B's rate limit in the throttled phase, calls per second.
    pub throttled_rate: f64,
    /// CPU seconds of the core in all.
    pub cpu_seconds: f64,
    /// Its peak resident memory, MiB.
    pub peak_rss_mib: f64,
}

impl Report {
    /// The table.
    pub fn table(&self) -> String {
        let row = |name: &str, a: String, b: String| format!("{name:<44} {a:>14} {b:>14}\n");
        let calls =
            |c: &BTreeMap<String, u64>| c.iter().filter(|(m, _)| !m.starts_with("IdentityService/")).map(|(_, n)| n).sum::<u64>();
        let mut t = row("two providers, one core", "provider a".into(), "provider b".into());
        t += &row(
            "Nodes (assigned by)",
            format!("{} ({})", self.a.nodes, self.a.assigned_by),
            format!("{} ({})", self.b.nodes, self.b.assigned_by),
        );
        t += &row("join: all initialised (s)", format!("{:.2}", self.a.join_seconds), format!("{:.2}", self.b.join_seconds));
        t += &row(
            "join: cloud floor, calls / rate limit (s)",
            format!("{:.2}", self.a.join_floor_seconds),
            format!("{:.2}", self.b.join_floor_seconds),
        );
        let both = format!("{:.2}", self.join_write_floor_seconds);
        t += &row("join: API floor, all writes / qps (s)", both.clone(), both);
        t += &row("join: cloud calls", calls(&self.a.join_calls).to_string(), calls(&self.b.join_calls).to_string());
        t += &row("load balancers", self.a.services.to_string(), self.b.services.to_string());
        t += &row(
            "load balancers: all with an address (s)",
            format!("{:.2}", self.a.lb_seconds),
            format!("{:.2}", self.b.lb_seconds),
        );
        t += &row("load balancers: cloud calls", calls(&self.a.lb_calls).to_string(), calls(&self.b.lb_calls).to_string());
        t += &row(
            &format!("B throttled to {}/s: Nodes joining", self.throttled_rate),
            self.a.throttled_nodes.to_string(),
            self.b.throttled_nodes.to_string(),
        );
        t += &row(
            "B throttled: all initialised (s)",
            format!("{:.2}", self.a.throttled_join_seconds),
            format!("{:.2}", self.b.throttled_join_seconds),
        );
        t += &row("cross-talk found", self.a.cross_talk.len().to_string(), self.b.cross_talk.len().to_string());
        t += &format!("core: {:.2} CPU s, peak RSS {:.1} MiB\n", self.cpu_seconds, self.peak_rss_mib);
        t
    }

    /// Figures that were not measured.
    pub fn missing(&self) -> Vec<String> {
        let mut missing = Vec::new();
        for (name, side) in [("a", &self.a), ("b", &self.b)] {
            if !side.join_seconds.is_finite() || side.join_seconds <= 0.0 {
                missing.push(format!("{name}.join_seconds"));
            }
            if !side.throttled_join_seconds.is_finite() {
                missing.push(format!("{name}.throttled_join_seconds"));
            }
            if !side.cross_talk.is_empty() {
                missing.push(format!("{name}: cross-talk: {}", side.cross_talk.join("; ")));
            }
        }
        missing
    }
}

fn initialised(n: &Node) -> bool {
    n.spec.as_ref().and_then(|s| s.taints.as_ref()).is_none_or(|t| !t.iter().any(|t| t.key == UNINITIALIZED_TAINT))
}

/// Creates Nodes `range` of `tag`, uninitialised and Ready, labelled for provider `label` if
/// given.
async fn join(
    client: &kube::Client,
    nodes: &Api<Node>,
    tag: &str,
    range: std::ops::Range<usize>,
    label: Option<&str>,
) -> anyhow::Result<()> {
    let first = range.start;
    create_all(range.len(), |k| {
        let (client, nodes, tag) = (client.clone(), nodes.clone(), tag.to_string());
        let label = label.map(String::from);
        async move {
            let name = node_name(&tag, first + k);
            let mut b = NodeBuilder::new(&name).uninitialized().label("bench", "hybrid").label("kubernetes.io/hostname", &name);
            if let Some(l) = &label {
                b = b.label(PROVIDER_LABEL, l);
            }
            b.address("Hostname", &name).create(&client).await?;
            ready(&nodes, &name).await
        }
    })
    .await
}

/// Waits until every Node named `tag-n<i>` for `i` in `range` is initialised; the time taken
/// since `started` (NaN after `timeout`).
async fn joined(
    nodes: &Api<Node>,
    tag: &str,
    range: std::ops::Range<usize>,
    started: Instant,
    timeout: Duration,
) -> anyhow::Result<f64> {
    let names: std::collections::BTreeSet<String> = range.map(|i| node_name(tag, i)).collect();
    let done = until(&format!("{tag}'s Nodes initialised"), timeout, async || {
        let listed = nodes.list(&ListParams::default().labels("bench=hybrid")).await?.items;
        let n = listed.iter().filter(|n| n.metadata.name.as_ref().is_some_and(|x| names.contains(x)) && initialised(n)).count();
        Ok((n >= names.len()).then_some(()))
    })
    .await;
    Ok(if done.is_ok() { started.elapsed().as_secs_f64() } else { f64::NAN })
}

fn floor(calls: &BTreeMap<String, u64>, rate: f64) -> f64 {
    calls.iter().filter(|(m, _)| !m.starts_with("IdentityService/")).map(|(_, n)| *n).sum::<u64>() as f64 / rate
}

/// Runs the two-provider scenario.
pub async fn run(cp: &ControlPlane, args: &Args) -> anyhow::Result<Report> {
    let client = cp.client().await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let ns = "bench-hybrid";
    create_namespace(&client, ns).await?;
    let services: Api<Service> = Api::namespaced(client.clone(), ns);
    let half = (args.nodes / 2).max(1);
    let extra = (args.churn).max(1);
    let sides = [("ha", "a", None), ("hb", "b", Some(CLASS_B))];
    let dir = tempfile::tempdir()?;
    let mut sims = Vec::new();
    for (tag, scheme, class) in sides {
        let mut config = sim_config(&Args { nodes: half, churn: extra, ..args.clone() }, tag);
        config.provider_id_scheme = format!("bench{scheme}");
        config.load_balancers.classes = class.map(String::from).into_iter().collect();
        config.load_balancers.address_pool = vec![if scheme == "a" { "198.18.0.0/16" } else { "198.19.0.0/16" }.into()];
        let sub = dir.path().join(scheme);
        std::fs::create_dir_all(&sub)?;
        sims.push(start_sim_with(config, &sub).await?);
    }
    let (admin_a, admin_b): (&AdminClient, &AdminClient) = (&sims[0].2, &sims[1].2);
    let kubeconfig = cp.kubeconfig_path().display().to_string();
    let log = std::path::PathBuf::from(format!("{}.hybrid.log", args.json.display()));
    let mut cmd = tokio::process::Command::new(std::env::current_exe()?);
    cmd.arg("__core").args([
        format!("--kubeconfig={kubeconfig}"),
        format!("--provider-endpoint=a={}", sims[0].3),
        format!("--provider-endpoint=b={}", sims[1].3),
        "--cluster-name=bench".into(),
        "--leader-elect=false".into(),
        "--secure-port=0".into(),
        "--controllers=cloud-node,service".into(),
        format!("--service-namespace={ns}"),
        "--node-exclude-selector=bench!=hybrid".into(),
        format!("--kube-api-qps={}", args.kube_api_qps),
        format!("--kube-api-burst={}", args.kube_api_burst),
        format!("--log-level={}", args.core_log),
    ]);
    let mut process = CoreProcess::spawn(&mut cmd, &log, "the core")?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    if let Some(status) = process.exited()? {
        bail!("the core exited at start ({status}); see {}", log.display());
    }
    let mut report = Report { throttled_rate: (args.rate_limit / 20.0).max(0.1), ..Default::default() };
    report.a.assigned_by = "lookup".into();
    report.b.assigned_by = "label".into();
    (report.a.nodes, report.b.nodes) = (half, half);

    // The join: A's Nodes unlabelled, B's labelled, all at once.
    admin_a.reset_calls().await?;
    admin_b.reset_calls().await?;
    let started = Instant::now();
    let (ja, jb) = tokio::join!(join(&client, &nodes, "ha", 0..half, None), join(&client, &nodes, "hb", 0..half, Some("b")));
    ja?;
    jb?;
    let timeout = Duration::from_secs(600);
    let (ta, tb) = tokio::join!(joined(&nodes, "ha", 0..half, started, timeout), joined(&nodes, "hb", 0..half, started, timeout));
    (report.a.join_seconds, report.b.join_seconds) = (ta?, tb?);
    report.a.join_calls = calls(admin_a).await?;
    report.b.join_calls = calls(admin_b).await?;
    report.join_write_floor_seconds = ((4 * half) as f64 - f64::from(args.kube_api_burst)).max(0.0) / args.kube_api_qps;
    report.a.join_floor_seconds = floor(&report.a.join_calls, args.rate_limit);
    report.b.join_floor_seconds = floor(&report.b.join_calls, args.rate_limit);
    eprintln!("   join: a {:.1} s, b {:.1} s", report.a.join_seconds, report.b.join_seconds);

    // Load balancers: half unclassed (A's), half of B's class.
    admin_a.reset_calls().await?;
    admin_b.reset_calls().await?;
    let per_side = (args.services / 2).max(1);
    (report.a.services, report.b.services) = (per_side, per_side);
    let started = Instant::now();
    create_all(per_side * 2, |i| {
        let services = services.clone();
        async move {
            let mut svc = load_balancer_service(ns, &format!("lb-{i}"), &[80]);
            if i % 2 == 1 {
                svc.spec.as_mut().context("spec")?.load_balancer_class = Some(CLASS_B.into());
            }
            services.create(&PostParams::default(), &svc).await.with_context(|| format!("service lb-{i}"))?;
            Ok(())
        }
    })
    .await?;
    let addressed = async |odd: bool| {
        until("every Service with an address", Duration::from_secs(600), async || {
            let listed = services.list(&ListParams::default()).await?.items;
            let ours = |s: &&Service| s.spec.as_ref().is_some_and(|sp| sp.load_balancer_class.is_some() == odd);
            let done = listed.iter().filter(ours).filter(|s| load_balancer_ip(s).is_some()).count();
            Ok((done >= per_side).then(|| started.elapsed().as_secs_f64()))
        })
        .await
    };
    let (la, lb) = tokio::join!(addressed(false), addressed(true));
    (report.a.lb_seconds, report.b.lb_seconds) = (la?, lb?);
    report.a.lb_calls = calls(admin_a).await?;
    report.b.lb_calls = calls(admin_b).await?;
    eprintln!("   load balancers: a {:.1} s, b {:.1} s", report.a.lb_seconds, report.b.lb_seconds);

    // Cross-talk: every load balancer, backend and providerID on its own provider.
    let listed = nodes.list(&ListParams::default().labels("bench=hybrid")).await?.items;
    for (side, admin, tag, scheme, other) in
        [(&mut report.a, admin_a, "ha", "bencha://", "hb-"), (&mut report.b, admin_b, "hb", "benchb://", "ha-")]
    {
        for n in listed.iter().filter(|n| n.metadata.name.as_ref().is_some_and(|x| x.starts_with(&format!("{tag}-")))) {
            let id = n.spec.as_ref().and_then(|s| s.provider_id.clone()).unwrap_or_default();
            if !id.starts_with(scheme) {
                side.cross_talk.push(format!("Node {:?} has providerID {id:?}", n.metadata.name));
            }
        }
        let state = admin.state().await?;
        for l in &state.load_balancers {
            let classed = l.service.rsplit('-').next().and_then(|i| i.parse::<usize>().ok()).is_some_and(|i| i % 2 == 1);
            if classed != (tag == "hb") {
                side.cross_talk.push(format!("load balancer of {} here", l.service));
            }
            if let Some(n) = l.nodes.iter().find(|n| n.starts_with(other)) {
                side.cross_talk.push(format!("{} has the other provider's Node {n}", l.service));
            }
        }
    }

    // B throttled to a twentieth of its rate: more Nodes join both; A's must not wait for B.
    admin_b.set_rate_limit(Some(RateLimit { rps: report.throttled_rate, burst: 1 })).await?;
    (report.a.throttled_nodes, report.b.throttled_nodes) = (extra, extra);
    let started = Instant::now();
    let (ja, jb) = tokio::join!(
        join(&client, &nodes, "ha", half..half + extra, Some("a")),
        join(&client, &nodes, "hb", half..half + extra, Some("b"))
    );
    ja?;
    jb?;
    let (ta, tb) = tokio::join!(
        joined(&nodes, "ha", half..half + extra, started, Duration::from_secs(600)),
        joined(&nodes, "hb", half..half + extra, started, Duration::from_secs(600))
    );
    (report.a.throttled_join_seconds, report.b.throttled_join_seconds) = (ta?, tb?);
    eprintln!(
        "   B throttled: a's {} Nodes in {:.2} s, b's in {:.2} s",
        extra, report.a.throttled_join_seconds, report.b.throttled_join_seconds
    );
    admin_b.set_rate_limit(Some(RateLimit { rps: args.rate_limit, burst: args.rate_limit.ceil() as u32 })).await?;

    report.cpu_seconds = process.cpu_seconds();
    report.peak_rss_mib = process.rss_mib().1;
    delete_services(&services, Duration::from_secs(120)).await?;
    process.stop().await;
    nodes.delete_collection(&DeleteParams::default(), &ListParams::default().labels("bench=hybrid")).await?;
    let _ = Api::<Namespace>::all(client.clone()).delete(ns, &DeleteParams::default()).await;
    for (task, stop, _, _) in sims {
        let _ = stop.send(());
        let _ = task.await;
    }
    Ok(report)
}
