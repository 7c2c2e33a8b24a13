//! `ccm-bench --cloud aws`: the real AWS provider against moto, driven by our core (through
//! `ccm-provider-aws`, the go-adapter sidecar) and by upstream's `aws-cloud-controller-manager`
//! of the same release, one after the other, each with a fresh moto and the same workload.
//! The figure operators care about is AWS API calls: they are counted at moto's front door
//! (every request that is not the fixture's own), by service and action.
//!
//! Per core: the Nodes (named like the instances' private DNS names, with the `uninitialized`
//! taint and a podCIDR each) and the LoadBalancer Services are created together; convergence
//! is every Node initialised, every podCIDR a route in moto's route table and every Service a
//! classic ELB with its hostname in the Service's status. Then one Node is excluded from load
//! balancers (until every ELB has deregistered its instance), and then the steady state: the
//! Nodes' heartbeats only, for `--steady`, with the calls made extrapolated to an hour.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ccm_harness::ControlPlane;
use ccm_harness::aws::{AWS_ENV, Moto, Sidecar};
use ccm_harness::cluster::{NodeBuilder, load_balancer_service};
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde::Serialize;
use serde_json::Value;

use crate::Args;
use crate::report::{Row, machine, side_by_side};
use crate::scenarios::{CoreProcess, create_all, ready, until};

const CLUSTER_CIDR: &str = "10.244.0.0/16";
const EXCLUDE_LABEL: &str = "node.kubernetes.io/exclude-from-external-load-balancers";

/// What one core did against moto.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AwsFigures {
    /// Seconds from the workload created to every Node, route and load balancer in place.
    pub converge_seconds: f64,
    /// AWS calls until then, by `service:Action`.
    pub converge_calls: BTreeMap<String, u64>,
    /// Seconds from one Node excluded to its instance deregistered from every ELB.
    pub exclude_seconds: f64,
    /// AWS calls for that change.
    pub exclude_calls: BTreeMap<String, u64>,
    /// How long the steady state was observed, in seconds.
    pub steady_seconds: f64,
    /// AWS calls per hour at steady state, by `service:Action`.
    pub steady_calls_per_hour: BTreeMap<String, f64>,
    /// Their sum.
    pub steady_total_per_hour: f64,
    /// CPU seconds of the core's processes (ours: core and sidecar) in all.
    pub total_cpu_seconds: f64,
    /// Peak resident memory of the core's processes, MiB (ours: core plus sidecar).
    pub rss_peak_mib: f64,
}

/// Every core's figures against moto, and what they ran under.
#[derive(Debug, Serialize)]
pub struct AwsReport {
    pub cloud: &'static str,
    pub nodes: usize,
    pub services: usize,
    pub steady_seconds: u64,
    pub machine: String,
    pub cores: BTreeMap<String, AwsFigures>,
}

impl AwsReport {
    pub fn table(&self) -> String {
        let rows: Vec<Row<AwsFigures>> = vec![
            ("converge: all in place (s)", |f| f.converge_seconds),
            ("converge: AWS calls", |f| total(&f.converge_calls) as f64),
            ("exclude a node: deregistered (s)", |f| f.exclude_seconds),
            ("exclude a node: AWS calls", |f| total(&f.exclude_calls) as f64),
            ("steady: AWS calls per hour", |f| f.steady_total_per_hour),
            ("total CPU seconds", |f| f.total_cpu_seconds),
            ("peak RSS (MiB)", |f| f.rss_peak_mib),
        ];
        let mut out = format!(
            "AWS provider (k8s.io/cloud-provider-aws) on moto: {} Nodes, {} classic ELBs, {} s steady state\n{}\n\n",
            self.nodes, self.services, self.steady_seconds, self.machine
        );
        out.push_str(&side_by_side(&self.cores, &rows));
        for (title, pick) in [
            (
                "AWS calls until converged",
                (|f| f.converge_calls.iter().map(|(k, v)| (k.clone(), *v as f64)).collect())
                    as fn(&AwsFigures) -> BTreeMap<String, f64>,
            ),
            ("AWS calls per hour at steady state", |f| f.steady_calls_per_hour.clone()),
        ] {
            out.push_str(&format!("\n{title}, by action:\n"));
            for (name, f) in &self.cores {
                out.push_str(&format!("  {name}:\n"));
                for (action, n) in pick(f) {
                    out.push_str(&format!("    {action:50} {n:>10.0}\n"));
                }
            }
        }
        out
    }

    /// Figures that were not measured (for `--check`).
    pub fn missing(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (core, f) in &self.cores {
            if total(&f.converge_calls) == 0 {
                out.push(format!("{core}: converge calls"));
            }
            if f.steady_seconds <= 0.0 {
                out.push(format!("{core}: steady state"));
            }
            if f.total_cpu_seconds <= 0.0 || f.rss_peak_mib <= 0.0 {
                out.push(format!("{core}: CPU and memory"));
            }
        }
        out
    }
}

fn total(calls: &BTreeMap<String, u64>) -> u64 {
    calls.values().sum()
}

/// `after - before`, per action.
fn since(after: &BTreeMap<String, u64>, before: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .filter_map(|(k, n)| {
            let d = n.saturating_sub(before.get(k).copied().unwrap_or(0));
            (d > 0).then(|| (k.clone(), d))
        })
        .collect()
}

/// The binaries: moto's python, ccm-provider-aws, upstream's aws-cloud-controller-manager.
pub struct Tools {
    python: PathBuf,
    sidecar: PathBuf,
    upstream: PathBuf,
}

impl Tools {
    /// Found or built by `harness/envtest/setup.sh` (moto, aws, aws-upstream).
    pub fn find() -> anyhow::Result<Self> {
        Ok(Self {
            python: ccm_harness::Assets::tool("moto")?,
            sidecar: ccm_harness::Assets::tool("aws")?,
            upstream: ccm_harness::Assets::tool("aws-upstream")?,
        })
    }
}

/// The processes of one core.
struct Running {
    core: CoreProcess,
    sidecar: Option<(Sidecar, CoreProcessStats)>,
}

/// CPU and memory of a process we did not spawn through [`CoreProcess`].
struct CoreProcessStats {
    pid: u32,
}

impl CoreProcessStats {
    fn cpu_seconds(&self) -> f64 {
        crate::scenarios::cpu_seconds_of(self.pid)
    }
    fn rss_peak_mib(&self) -> f64 {
        crate::scenarios::rss_mib_of(self.pid).1
    }
}

impl Running {
    fn cpu_seconds(&self) -> f64 {
        self.core.cpu_seconds() + self.sidecar.as_ref().map_or(0.0, |(_, s)| s.cpu_seconds())
    }
    fn rss_peak_mib(&self) -> f64 {
        self.core.rss_mib().1 + self.sidecar.as_ref().map_or(0.0, |(_, s)| s.rss_peak_mib())
    }
}

async fn start(
    cp: &ControlPlane,
    args: &Args,
    tools: &Tools,
    core: &str,
    moto: &Moto,
    cluster: &str,
    dir: &Path,
) -> anyhow::Result<Running> {
    let kubeconfig = cp.kubeconfig_path();
    let log = PathBuf::from(format!("{}.aws-{core}.log", args.json.display()));
    if core == "rust" {
        let sidecar = Sidecar::aws(&tools.sidecar, dir, moto, cluster, kubeconfig).await?;
        let pid = sidecar.pid().context("the sidecar's pid")?;
        let mut cmd = tokio::process::Command::new(std::env::current_exe()?);
        cmd.arg("__core").args([
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--provider-endpoint={}", sidecar.endpoint),
            format!("--cluster-name={cluster}"),
            format!("--cluster-cidr={CLUSTER_CIDR}"),
            "--leader-elect=false".into(),
            "--secure-port=0".into(),
            "--provider-call-timeout=30s".into(),
            format!("--log-level={}", args.core_log),
        ]);
        let core = CoreProcess::spawn(&mut cmd, &log, "the Rust core")?;
        return Ok(Running { core, sidecar: Some((sidecar, CoreProcessStats { pid })) });
    }
    let config = dir.join("cloud.conf");
    std::fs::write(&config, moto.cloud_config(cluster)).context("writing the cloud config")?;
    let mut cmd = tokio::process::Command::new(&tools.upstream);
    cmd.args([
        "--cloud-provider=aws".to_string(),
        format!("--cloud-config={}", config.display()),
        format!("--kubeconfig={}", kubeconfig.display()),
        format!("--cluster-name={cluster}"),
        format!("--cluster-cidr={CLUSTER_CIDR}"),
        "--allocate-node-cidrs=false".into(),
        "--configure-cloud-routes=true".into(),
        "--leader-elect=false".into(),
        "--secure-port=0".into(),
        "--v=1".into(),
    ])
    .envs(AWS_ENV);
    Ok(Running { core: CoreProcess::spawn(&mut cmd, &log, "aws-cloud-controller-manager")?, sidecar: None })
}

fn strings(v: &Value, key: &str) -> Vec<String> {
    v[key].as_array().map(|l| l.iter().filter_map(|s| s.as_str().map(String::from)).collect()).unwrap_or_default()
}

/// Runs the workload against `core` (`rust` or `upstream`) and cleans up after it.
pub async fn run_core(cp: &ControlPlane, args: &Args, tools: &Tools, core: &str, subnet: u8) -> anyhow::Result<AwsFigures> {
    let tag = if core == "rust" { "rs" } else { "up" };
    let cluster = format!("bench-aws-{tag}");
    let client = cp.client().await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let ns = format!("bench-aws-{tag}");
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &Namespace { metadata: ObjectMeta { name: Some(ns.clone()), ..Default::default() }, ..Default::default() },
        )
        .await
        .with_context(|| format!("creating namespace {ns}"))?;
    let services: Api<Service> = Api::namespaced(client.clone(), &ns);
    let mut moto = Moto::start(&tools.python, &cluster, args.nodes, subnet).await?;
    let instances = moto.instances();
    let dir = tempfile::tempdir()?;
    let mut running = start(cp, args, tools, core, &moto, &cluster, dir.path()).await?;
    // Let the core start and list (an empty cluster) before anything is measured.
    tokio::time::sleep(Duration::from_secs(5)).await;
    if let Some(status) = running.core.exited()? {
        bail!("{core} exited at start ({status}); see {}.aws-{core}.log", args.json.display());
    }
    let mut f = AwsFigures::default();
    let label = format!("bench-aws={tag}");

    // === converge: Nodes, routes and load balancers together ===
    let before = moto.calls().await?;
    let started = Instant::now();
    create_all(instances.len(), |i| {
        let (client, nodes, tag, name) = (client.clone(), nodes.clone(), tag.to_string(), instances[i].private_dns.clone());
        async move {
            NodeBuilder::new(&name)
                .uninitialized()
                .label("bench-aws", &tag)
                .label("kubernetes.io/hostname", &name)
                .address("Hostname", &name)
                .pod_cidr(&format!("10.244.{}.0/24", i + 1))
                .create(&client)
                .await?;
            ready(&nodes, &name).await
        }
    })
    .await?;
    create_all(args.services, |i| {
        let services = services.clone();
        let svc = load_balancer_service(&ns, &format!("lb-{i}"), &[80]);
        async move {
            services.create(&PostParams::default(), &svc).await.with_context(|| format!("creating Service lb-{i}"))?;
            Ok(())
        }
    })
    .await?;
    let want_routes = instances.len();
    until("every Node initialised, route and load balancer in place", Duration::from_secs(600), async || {
        let listed = nodes.list(&ListParams::default().labels(&label)).await?.items;
        let initialised = listed.iter().filter(|n| n.spec.as_ref().and_then(|s| s.provider_id.as_ref()).is_some()).count();
        let routes = moto.query("routes").await?;
        let routed =
            routes.as_array().map_or(0, |r| r.iter().filter(|r| r["instance"].as_str().is_some_and(|i| !i.is_empty())).count());
        let addressed = services
            .list(&ListParams::default())
            .await?
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
        Ok((initialised == instances.len() && routed >= want_routes && addressed == args.services).then_some(()))
    })
    .await?;
    f.converge_seconds = started.elapsed().as_secs_f64();
    let now = moto.calls().await?;
    f.converge_calls = since(&now, &before);
    eprintln!("   converged in {:.1} s with {} AWS calls", f.converge_seconds, total(&f.converge_calls));

    // === one Node excluded from load balancers ===
    let before = now;
    let excluded = &instances[0];
    let started = Instant::now();
    let patch = serde_json::json!({ "metadata": { "labels": { EXCLUDE_LABEL: "true" } } });
    nodes.patch(&excluded.private_dns, &PatchParams::default(), &Patch::Merge(&patch)).await.context("excluding a Node")?;
    until("the excluded Node's instance deregistered from every ELB", Duration::from_secs(300), async || {
        let elbs = moto.query("elbs").await?;
        let list = elbs.as_array().cloned().unwrap_or_default();
        Ok((list.len() == args.services && list.iter().all(|lb| !strings(lb, "instances").contains(&excluded.id))).then_some(()))
    })
    .await?;
    f.exclude_seconds = started.elapsed().as_secs_f64();
    // Calls the change still causes (a last describe) land in the next seconds.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let now = moto.calls().await?;
    f.exclude_calls = since(&now, &before);
    eprintln!("   excluded in {:.1} s with {} AWS calls", f.exclude_seconds, total(&f.exclude_calls));

    // === steady state: heartbeats only ===
    let before = now;
    let names: Vec<String> = instances.iter().map(|i| i.private_dns.clone()).collect();
    f.steady_seconds = crate::scenarios::heartbeats(&nodes, &names, args.steady, args.status_period).await.as_secs_f64();
    let steady = since(&moto.calls().await?, &before);
    let per_hour = |n: u64| n as f64 * 3600.0 / f.steady_seconds;
    f.steady_calls_per_hour = steady.iter().map(|(k, n)| (k.clone(), per_hour(*n))).collect();
    f.steady_total_per_hour = per_hour(total(&steady));
    f.total_cpu_seconds = running.cpu_seconds();
    f.rss_peak_mib = running.rss_peak_mib();
    eprintln!("   steady: {:.0} AWS calls/hour", f.steady_total_per_hour);

    // === clean up: Services first (their finalizers need the core), then Nodes ===
    crate::scenarios::delete_services(&services, Duration::from_secs(120)).await?;
    running.core.stop().await;
    if let Some((sidecar, _)) = running.sidecar.take() {
        let kept = format!("{}.aws-{core}.sidecar.log", args.json.display());
        if let Err(e) = std::fs::write(&kept, sidecar.log_text()) {
            eprintln!("   keeping the sidecar's log in {kept}: {e}");
        }
    }
    nodes.delete_collection(&DeleteParams::default(), &ListParams::default().labels(&label)).await?;
    let _ = Api::<Namespace>::all(client).delete(&ns, &DeleteParams::default()).await;
    Ok(f)
}

/// `ccm-bench --cloud aws`: every core of `args.cores` (`rust`, `upstream`) in turn.
pub async fn run(cp: &ControlPlane, args: &Args) -> anyhow::Result<AwsReport> {
    let tools = Tools::find()?;
    let mut cores = BTreeMap::new();
    for (k, core) in args.cores.iter().enumerate() {
        eprintln!("== aws/{core}: {} Nodes, {} Services, steady {:?}", args.nodes, args.services, args.steady);
        let subnet = u8::try_from(k + 1).context("too many cores")?;
        cores.insert(core.clone(), run_core(cp, args, &tools, core, subnet).await.with_context(|| format!("core {core}"))?);
    }
    Ok(AwsReport {
        cloud: "aws (moto)",
        nodes: args.nodes,
        services: args.services,
        steady_seconds: args.steady.as_secs(),
        machine: machine(),
        cores,
    })
}
