//! `ccm-bench --cloud replicas`: what losing a replica costs, with one Lease for every
//! controller (the default) and with a Lease per controller shared by the replicas
//! (`--leader-elect-per-controller`).
//!
//! For each mode, two core processes (the production Lease timing: 15 s, renew 10 s, retry
//! 2 s) on one sim, the Nodes joining with podCIDRs (routes) and the Services. Once all is in
//! place, the replica that leads the service controller is killed (SIGKILL: its Leases must
//! expire) and a Node joins a second later. Measured: per controller, the seconds until the
//! other replica leads it; the joining Node's time to initialised; the cloud calls (by
//! method) and the API writes (by verb and resource, the benchmark's own left out) that the
//! new leaders made until the cloud was quiet for 5 s: the work redone. With a Lease per
//! controller, also the time until both replicas lead some controllers after start, and, once
//! the killed replica is back, until it has its share again, with that handover's calls and
//! writes.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ccm_harness::ControlPlane;
use ccm_harness::cluster::{NodeBuilder, UNINITIALIZED_TAINT, load_balancer_ip, load_balancer_service};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};

use serde::Serialize;

use crate::Args;
use crate::scenarios::{
    CLUSTER_CIDR, CoreProcess, calls, create_all, create_namespace, delete_services, node_name, pod_cidr, ready, sim_config,
    start_sim_with, until,
};

/// The controllers both replicas run, as their Leases are named.
const CONTROLLERS: [&str; 4] =
    ["cloud-node-controller", "cloud-node-lifecycle-controller", "node-route-controller", "service-lb-controller"];
/// The production Lease timing (upstream's defaults).
const LEASE: Duration = Duration::from_secs(15);

/// One mode's figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Mode {
    /// `one-lease` or `lease-per-controller`.
    pub mode: String,
    /// Seconds from both replicas started until each leads some controller (a Lease per
    /// controller only).
    pub shared_after_seconds: Option<f64>,
    /// Seconds until the Nodes, routes and load balancers were all in place.
    pub setup_seconds: f64,
    /// Controllers the killed replica led.
    pub lost: Vec<String>,
    /// Per controller, seconds from the kill until the other replica led it (0: it led it
    /// already).
    pub new_leader_seconds: BTreeMap<String, f64>,
    /// A Node created a second after the kill: seconds until initialised.
    pub join_during_loss_seconds: f64,
    /// Cloud calls from the kill until the cloud was quiet for 5 s, by method (those refused
    /// for the rate limit as `<method> refused`).
    pub redone_calls: BTreeMap<String, u64>,
    /// API writes in that time, by verb and resource (the benchmark's own left out).
    pub redone_writes: BTreeMap<String, u64>,
    /// Seconds from the killed replica's return until it led its share again.
    pub rebalanced_seconds: Option<f64>,
    /// Cloud calls of that handover, by method.
    pub handover_calls: BTreeMap<String, u64>,
    /// API writes of that handover.
    pub handover_writes: BTreeMap<String, u64>,
}

/// The run's figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    pub nodes: usize,
    pub services: usize,
    pub lease_seconds: u64,
    pub modes: Vec<Mode>,
}

fn total(m: &BTreeMap<String, u64>) -> u64 {
    m.values().sum()
}

impl Report {
    /// The table.
    pub fn table(&self) -> String {
        let mut t = format!(
            "two replicas, one killed (SIGKILL): {} Nodes, {} Services, Lease {} s (renew 10 s, retry 2 s)\n",
            self.nodes, self.services, self.lease_seconds
        );
        let header: Vec<&str> = self.modes.iter().map(|m| m.mode.as_str()).collect();
        t += &format!("{:<58}", "figure");
        for h in &header {
            t += &format!(" {h:>22}");
        }
        t += "\n";
        let row = |t: &mut String, name: &str, f: &dyn Fn(&Mode) -> String| {
            *t += &format!("{name:<58}");
            for m in &self.modes {
                *t += &format!(" {:>22}", f(m));
            }
            *t += "\n";
        };
        let secs = |v: Option<f64>| v.map_or("-".to_string(), |s| format!("{s:.1}"));
        row(&mut t, "both replicas leading some controller (s after start)", &|m| secs(m.shared_after_seconds));
        row(&mut t, "setup: Nodes, routes, load balancers in place (s)", &|m| format!("{:.1}", m.setup_seconds));
        row(&mut t, "controllers the killed replica led", &|m| m.lost.len().to_string());
        for c in CONTROLLERS {
            row(&mut t, &format!("new leader of {c} (s)"), &|m| {
                m.new_leader_seconds.get(c).map_or("-".into(), |s| if *s == 0.0 { "kept".into() } else { format!("{s:.1}") })
            });
        }
        row(&mut t, "a Node joining 1 s after the kill: initialised (s)", &|m| format!("{:.1}", m.join_during_loss_seconds));
        let refused = |c: &BTreeMap<String, u64>| c.iter().filter(|(k, _)| k.ends_with(" refused")).map(|(_, v)| v).sum::<u64>();
        row(&mut t, "work redone: cloud calls (of them refused, rate limit)", &|m| {
            format!("{} ({})", total(&m.redone_calls), refused(&m.redone_calls))
        });
        row(&mut t, "work redone: API writes", &|m| total(&m.redone_writes).to_string());
        row(&mut t, "killed replica back: leading its share again (s)", &|m| secs(m.rebalanced_seconds));
        row(&mut t, "  that handover: cloud calls (refused)", &|m| match m.rebalanced_seconds {
            Some(_) => format!("{} ({})", total(&m.handover_calls), refused(&m.handover_calls)),
            None => "-".into(),
        });
        row(&mut t, "  that handover: API writes", &|m| {
            if m.rebalanced_seconds.is_some() { total(&m.handover_writes).to_string() } else { "-".into() }
        });
        for m in &self.modes {
            t += &format!("\n{}: work redone after the kill, by method\n", m.mode);
            for (k, v) in m.redone_calls.iter().chain(&m.redone_writes) {
                t += &format!("  {k:<56} {v:>8}\n");
            }
            if m.rebalanced_seconds.is_some() {
                t += &format!("{}: the handover to the returned replica\n", m.mode);
                for (k, v) in m.handover_calls.iter().chain(&m.handover_writes) {
                    t += &format!("  {k:<56} {v:>8}\n");
                }
            }
        }
        t
    }

    /// Figures not measured.
    pub fn missing(&self) -> Vec<String> {
        let mut missing = Vec::new();
        for m in &self.modes {
            for c in CONTROLLERS {
                if !m.new_leader_seconds.contains_key(c) {
                    missing.push(format!("{}: new leader of {c}", m.mode));
                }
            }
            if !m.join_during_loss_seconds.is_finite() || m.join_during_loss_seconds == 0.0 {
                missing.push(format!("{}: join during the loss", m.mode));
            }
            if m.mode == "lease-per-controller" && (m.shared_after_seconds.is_none() || m.rebalanced_seconds.is_none()) {
                missing.push(format!("{}: the replicas never shared the controllers", m.mode));
            }
        }
        missing
    }
}

/// API writes so far (POST, PUT, PATCH, DELETE), by verb and resource, Leases left out, from
/// the API server's `apiserver_request_total`.
async fn api_writes(client: &kube::Client) -> anyhow::Result<BTreeMap<String, u64>> {
    let request = http::Request::get("/metrics").body(Vec::new()).context("metrics request")?;
    let text = client.request_text(request).await.context("the API server's metrics")?;
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with("apiserver_request_total{")) {
        let Some((labels, value)) = line.rsplit_once(' ') else { continue };
        let label = |name: &str| {
            labels.split(&format!("{name}=\"")).nth(1).and_then(|r| r.split('"').next()).unwrap_or_default().to_string()
        };
        let (verb, resource, sub) = (label("verb"), label("resource"), label("subresource"));
        if !["POST", "PUT", "PATCH", "DELETE"].contains(&verb.as_str()) || resource == "leases" || resource.is_empty() {
            continue;
        }
        let key = if sub.is_empty() { format!("{verb} {resource}") } else { format!("{verb} {resource}/{sub}") };
        *out.entry(key).or_default() += value.parse::<f64>().unwrap_or(0.0) as u64;
    }
    Ok(out)
}

fn diff(after: &BTreeMap<String, u64>, before: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .filter_map(|(k, v)| {
            let d = v.saturating_sub(before.get(k).copied().unwrap_or(0));
            (d > 0).then(|| (k.clone(), d))
        })
        .collect()
}

/// The holder of each controller's Lease (`None`: not held).
async fn holders(leases: &Api<Lease>, base: &str, per_controller: bool) -> BTreeMap<&'static str, Option<String>> {
    let mut out = BTreeMap::new();
    let one = match per_controller {
        true => None,
        false => Some(holder(leases, base).await),
    };
    for c in CONTROLLERS {
        let h = match &one {
            Some(h) => h.clone(),
            None => holder(leases, &format!("{base}-{c}")).await,
        };
        out.insert(c, h);
    }
    out
}

/// How long the Nodes, routes and load balancers may take to be in place.
const SETUP_LIMIT: Duration = Duration::from_secs(900);
/// How long after that the replicas may take to share the controllers.
const SPREAD_LIMIT: Duration = Duration::from_secs(180);

/// The replicas (identities' `HOSTNAME` prefixes) that hold some of the Leases `h`.
fn leading_hosts(h: &BTreeMap<&'static str, Option<String>>) -> std::collections::BTreeSet<String> {
    h.values().flatten().map(|i| i.split('_').next().unwrap_or_default().to_string()).collect()
}

async fn holder(leases: &Api<Lease>, name: &str) -> Option<String> {
    leases.get_opt(name).await.ok().flatten()?.spec?.holder_identity.filter(|h| !h.is_empty())
}

struct Replica {
    process: CoreProcess,
    /// Its identity's prefix (`HOSTNAME`).
    host: String,
}

fn start_replica(
    args: &Args,
    kubeconfig: &str,
    endpoint: &str,
    ns: &str,
    per_controller: bool,
    host: &str,
    run: usize,
) -> anyhow::Result<Replica> {
    let log = std::path::PathBuf::from(format!("{}.replicas-{ns}-{host}-{run}.log", args.json.display()));
    let mut cmd = tokio::process::Command::new(std::env::current_exe()?);
    cmd.env("HOSTNAME", host).arg("__core").args([
        format!("--kubeconfig={kubeconfig}"),
        format!("--provider-endpoint={endpoint}"),
        "--cluster-name=bench".into(),
        format!("--cluster-cidr={CLUSTER_CIDR}"),
        "--leader-elect=true".into(),
        format!("--leader-elect-resource-namespace={ns}"),
        "--leader-elect-resource-name=ccm".into(),
        format!("--leader-elect-lease-duration={}s", LEASE.as_secs()),
        "--leader-elect-renew-deadline=10s".into(),
        "--leader-elect-retry-period=2s".into(),
        format!("--leader-elect-per-controller={per_controller}"),
        "--secure-port=0".into(),
        format!("--service-namespace={ns}"),
        format!("--node-exclude-selector=bench!={ns}"),
        format!("--kube-api-qps={}", args.kube_api_qps),
        format!("--kube-api-burst={}", args.kube_api_burst),
        format!("--log-level={}", args.core_log),
    ]);
    let process = CoreProcess::spawn(&mut cmd, &log, "a replica")?;
    Ok(Replica { process, host: host.to_string() })
}

/// Cloud calls by method, those the cloud refused for its rate limit counted apart
/// (`<method> refused`): a refused call is a retry, not work done.
async fn calls_by_outcome(admin: &ccm_provider_sim::AdminClient) -> anyhow::Result<BTreeMap<String, u64>> {
    let mut out = BTreeMap::new();
    for c in admin.calls().await?.counts {
        let refused = matches!(c.code.as_str(), "RESOURCE_EXHAUSTED" | "ResourceExhausted");
        let key = if refused { format!("{} refused", c.method) } else { c.method };
        *out.entry(key).or_default() += c.count;
    }
    Ok(out)
}

/// Waits until the cloud has had no call for `quiet`, at most `limit`.
async fn quiet(admin: &ccm_provider_sim::AdminClient, quiet: Duration, limit: Duration) -> anyhow::Result<()> {
    let started = Instant::now();
    let (mut last, mut since) = (total(&calls(admin).await?), Instant::now());
    while started.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = total(&calls(admin).await?);
        if now != last {
            (last, since) = (now, Instant::now());
        } else if since.elapsed() >= quiet {
            break;
        }
    }
    Ok(())
}

/// Node `i` of this run, joining as a kubelet registers it (`uninitialized`, a podCIDR),
/// then Ready.
async fn joining_node(client: &kube::Client, nodes: &Api<Node>, ns: &str, tag: &str, i: usize) -> anyhow::Result<()> {
    let name = node_name(tag, i);
    let cidr = pod_cidr(i);
    NodeBuilder::new(&name)
        .uninitialized()
        .label("bench", ns)
        .address("Hostname", &name)
        .pod_cidr(&cidr)
        .create(client)
        .await
        .with_context(|| format!("node {name}"))?;
    ready(nodes, &name).await
}

fn initialised(n: &Node) -> bool {
    n.spec.as_ref().and_then(|s| s.taints.as_ref()).is_none_or(|t| !t.iter().any(|t| t.key == UNINITIALIZED_TAINT))
}

async fn run_mode(cp: &ControlPlane, args: &Args, per_controller: bool) -> anyhow::Result<Mode> {
    let (tag, mode) = if per_controller { ("rp", "lease-per-controller") } else { ("r1", "one-lease") };
    let client = cp.client().await?;
    let ns = format!("bench-{tag}");
    create_namespace(&client, &ns).await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let services: Api<Service> = Api::namespaced(client.clone(), &ns);
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let dir = tempfile::tempdir()?;
    let mut config = sim_config(args, tag);
    // The route table's room and the instances: the Nodes, and the one that joins during the loss.
    config.route_tables[0].max_routes = (args.nodes + 16) as u32;
    let (sim, stop_sim, admin, endpoint) = start_sim_with(config, dir.path()).await?;
    let kubeconfig = cp.kubeconfig_path().display().to_string();
    let mut report = Mode { mode: mode.into(), ..Default::default() };

    let started = Instant::now();
    let a = start_replica(args, &kubeconfig, &endpoint, &ns, per_controller, "replica-a", 0)?;
    let b = start_replica(args, &kubeconfig, &endpoint, &ns, per_controller, "replica-b", 0)?;
    let mut replicas = vec![a, b];
    // How long after start both replicas lead some controller: watched from the start, while
    // the Nodes and load balancers are made, not only once they are in place.
    // It gives up with the setup's deadline and the wait below, so it never outlives the run.
    let spread = per_controller.then(|| {
        let leases = leases.clone();
        tokio::spawn(async move {
            while started.elapsed() < SETUP_LIMIT + SPREAD_LIMIT {
                let h = holders(&leases, "ccm", true).await;
                if h.values().all(Option::is_some) && leading_hosts(&h).len() == 2 {
                    return Some(started.elapsed().as_secs_f64());
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            None
        })
    });
    let label = format!("bench={ns}");
    create_all(args.nodes, |i| {
        let (client, nodes, ns) = (client.clone(), nodes.clone(), ns.clone());
        async move { joining_node(&client, &nodes, &ns, tag, i).await }
    })
    .await?;
    create_all(args.services, |j| {
        let (services, ns) = (services.clone(), ns.clone());
        async move {
            let svc = load_balancer_service(&ns, &format!("lb-{j}"), &[80]);
            services.create(&PostParams::default(), &svc).await.with_context(|| format!("service lb-{j}"))?;
            Ok(())
        }
    })
    .await?;
    until("Nodes, routes and load balancers in place", SETUP_LIMIT, async || {
        let listed = nodes.list(&ListParams::default().labels(&label)).await?.items;
        let done = listed.iter().filter(|n| initialised(n)).count();
        let routes: usize = admin.route_tables().await?.iter().map(|t| t.routes.len()).sum();
        let addressed =
            services.list(&ListParams::default()).await?.items.iter().filter(|s| load_balancer_ip(s).is_some()).count();
        Ok((done >= args.nodes && routes >= args.nodes && addressed >= args.services).then_some(()))
    })
    .await?;
    report.setup_seconds = started.elapsed().as_secs_f64();
    if let Some(spread) = spread {
        let seconds = spread
            .await
            .context("the task watching the Leases")?
            .context("both replicas leading some controller: not within 180 s after the setup's limit")?;
        report.shared_after_seconds = Some(seconds);
    }
    quiet(&admin, Duration::from_secs(5), Duration::from_secs(120)).await?;
    eprintln!(
        "   {mode}: in place after {:.1} s, leading: {:?}",
        report.setup_seconds,
        holders(&leases, "ccm", per_controller).await
    );

    // The kill: the replica that leads the service controller.
    let before = holders(&leases, "ccm", per_controller).await;
    let victim_host = before
        .get("service-lb-controller")
        .cloned()
        .flatten()
        .and_then(|h| h.split('_').next().map(str::to_string))
        .context("nobody leads the service controller")?;
    let victim = replicas.iter().position(|r| r.host == victim_host).context("the leader is not one of the replicas")?;
    let survivor_host = replicas[1 - victim].host.clone();
    report.lost = before
        .iter()
        .filter(|(_, h)| h.as_deref().is_some_and(|h| h.starts_with(&format!("{victim_host}_"))))
        .map(|(c, _)| c.to_string())
        .collect();
    admin.reset_calls().await?;
    let writes_before = api_writes(&client).await?;
    let killed = replicas.remove(victim);
    let killed_at = Instant::now();
    killed.process.kill().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let joiner = node_name(tag, args.nodes);
    let joined_at = Instant::now();
    joining_node(&client, &nodes, &ns, tag, args.nodes).await?;
    let mut joined = None;
    let deadline = Instant::now() + LEASE * 4 + Duration::from_secs(120);
    while Instant::now() < deadline {
        let h = holders(&leases, "ccm", per_controller).await;
        for (c, holder) in &h {
            if !report.new_leader_seconds.contains_key(*c)
                && holder.as_deref().is_some_and(|h| h.starts_with(&format!("{survivor_host}_")))
            {
                let t = if before.get(c).cloned().flatten().is_some_and(|b| b.starts_with(&format!("{survivor_host}_"))) {
                    0.0
                } else {
                    killed_at.elapsed().as_secs_f64()
                };
                report.new_leader_seconds.insert(c.to_string(), t);
            }
        }
        if joined.is_none() && nodes.get_opt(&joiner).await?.is_some_and(|n| initialised(&n)) {
            joined = Some(joined_at.elapsed().as_secs_f64());
        }
        if joined.is_some() && report.new_leader_seconds.len() == CONTROLLERS.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    report.join_during_loss_seconds = joined.unwrap_or(f64::NAN);
    quiet(&admin, Duration::from_secs(5), Duration::from_secs(300)).await?;
    report.redone_calls = calls_by_outcome(&admin).await?;
    let mut writes = diff(&api_writes(&client).await?, &writes_before);
    // The benchmark's own: the joining Node, its addresses and its Ready condition.
    for (own, n) in [("POST nodes", 1), ("PATCH nodes/status", 2)] {
        if let Some(v) = writes.get_mut(own) {
            *v = v.saturating_sub(n);
        }
    }
    writes.retain(|_, v| *v > 0);
    report.redone_writes = writes;
    eprintln!(
        "   {mode}: killed {victim_host} (led {:?}); new leaders {:?}; joining Node initialised after {:.1} s; redone: {} calls, {} writes",
        report.lost,
        report.new_leader_seconds,
        report.join_during_loss_seconds,
        total(&report.redone_calls),
        total(&report.redone_writes)
    );

    // The killed replica returns.
    if per_controller {
        admin.reset_calls().await?;
        let writes_before = api_writes(&client).await?;
        let returned_at = Instant::now();
        replicas.push(start_replica(args, &kubeconfig, &endpoint, &ns, per_controller, &victim_host, 1)?);
        until("the returned replica leading its share", LEASE * 4 + Duration::from_secs(60), async || {
            let h = holders(&leases, "ccm", true).await;
            Ok((h.values().all(Option::is_some) && leading_hosts(&h).len() == 2).then_some(()))
        })
        .await?;
        report.rebalanced_seconds = Some(returned_at.elapsed().as_secs_f64());
        quiet(&admin, Duration::from_secs(5), Duration::from_secs(300)).await?;
        report.handover_calls = calls_by_outcome(&admin).await?;
        report.handover_writes = diff(&api_writes(&client).await?, &writes_before);
        eprintln!(
            "   {mode}: back, sharing again after {:.1} s: {} calls, {} writes",
            report.rebalanced_seconds.unwrap_or(f64::NAN),
            total(&report.handover_calls),
            total(&report.handover_writes)
        );
    }

    delete_services(&services, Duration::from_secs(120)).await?;
    for r in replicas {
        r.process.stop().await;
    }
    nodes.delete_collection(&DeleteParams::default(), &ListParams::default().labels(&label)).await?;
    let _ = Api::<Namespace>::all(client.clone()).delete(&ns, &DeleteParams::default()).await;
    let _ = stop_sim.send(());
    let _ = sim.await;
    Ok(report)
}

/// Runs both modes.
pub async fn run(cp: &ControlPlane, args: &Args) -> anyhow::Result<Report> {
    if args.nodes == 0 || args.services == 0 {
        bail!("--cloud replicas needs Nodes and Services");
    }
    let mut report = Report { nodes: args.nodes, services: args.services, lease_seconds: LEASE.as_secs(), modes: Vec::new() };
    for per_controller in [false, true] {
        report.modes.push(run_mode(cp, args, per_controller).await?);
    }
    Ok(report)
}
