//! The scenarios, run against one core at a time: join burst, load balancers, routes, node
//! churn, steady state.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use ccm_harness::ControlPlane;
use ccm_harness::cluster::{NodeBuilder, UNINITIALIZED_TAINT, load_balancer_ip, load_balancer_service};
use ccm_provider_sdk::Listen;
use ccm_provider_sim::config::{Address, ApiConfig, InstanceSpec, RateLimit, RouteTableSpec};
use ccm_provider_sim::{AdminClient, Config, Endpoints};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};

use crate::Args;
use crate::report::{Figures, PerUnit};

pub(crate) const ZONE: &str = "sim-region-1a";
/// The cluster's pod network: a /24 per Node, room for [`MAX_NODES`], beside the instances'
/// addresses (10.128.0.0/9). (A /10 once left the Nodes past 16,384 without routes, as
/// `--cluster-cidr` says it should.)
pub(crate) const CLUSTER_CIDR: &str = "10.0.0.0/9";

/// The Nodes (with the churn's) that [`CLUSTER_CIDR`] has a /24 for.
pub(crate) const MAX_NODES: usize = 1 << 15;
const EXCLUDE_LABEL: &str = "node.kubernetes.io/exclude-from-external-load-balancers";
/// How many API requests the workload sends at once.
const PARALLEL: usize = 32;

pub(crate) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

pub(crate) fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// CPU seconds (user + system) of process `pid` so far.
pub(crate) fn cpu_seconds_of(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    // Fields after the command (which may contain spaces) are space-separated; utime and
    // stime are the 14th and 15th fields, in clock ticks (USER_HZ, 100 on Linux).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    (ticks(11) + ticks(12)) as f64 / 100.0
}

/// (current, peak) resident memory of process `pid` in MiB.
pub(crate) fn rss_mib_of(pid: u32) -> (f64, f64) {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { return (0.0, 0.0) };
    let kb = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    (kb("VmRSS:"), kb("VmHWM:"))
}

/// A core process.
pub(crate) struct CoreProcess {
    child: tokio::process::Child,
    pid: u32,
}

impl CoreProcess {
    /// Starts `cmd` with its stdout and stderr in `log`.
    pub(crate) fn spawn(cmd: &mut tokio::process::Command, log: &Path, what: &str) -> anyhow::Result<Self> {
        let file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let child =
            cmd.stdout(file.try_clone()?).stderr(file).kill_on_drop(true).spawn().with_context(|| format!("starting {what}"))?;
        let pid = child.id().context("the process's pid")?;
        Ok(Self { child, pid })
    }

    /// The exit status, if it has exited.
    pub(crate) fn exited(&mut self) -> anyhow::Result<Option<std::process::ExitStatus>> {
        Ok(self.child.try_wait()?)
    }

    /// CPU seconds (user + system) so far: a wrapper's and its core's together.
    pub(crate) fn cpu_seconds(&self) -> f64 {
        cpu_seconds_of(self.pid) + children_of(self.pid).into_iter().map(cpu_seconds_of).sum::<f64>()
    }

    /// (current, peak) resident memory in MiB: the core's, not its wrapper's (a profiler's
    /// own memory in the core's process counts).
    pub(crate) fn rss_mib(&self) -> (f64, f64) {
        let core = children_of(self.pid).into_iter().map(rss_mib_of).max_by(|a, b| a.1.total_cmp(&b.1));
        core.unwrap_or_else(|| rss_mib_of(self.pid))
    }

    /// Kills it (SIGKILL: nothing is released) and reaps it.
    pub(crate) async fn kill(mut self) {
        signal_children(self.pid, "KILL");
        let _ = self.child.kill().await;
    }

    /// Stops it (SIGTERM, then SIGKILL after 15 s). A core run under `CCM_BENCH_CORE_WRAPPER`
    /// is the wrapper's child: the core is stopped and the wrapper (a profiler) left to end
    /// by itself and write what it recorded, so that no core outlives the run.
    pub(crate) async fn stop(mut self) {
        if !signal_children(self.pid, "TERM") {
            let _ = tokio::process::Command::new("kill").args(["-TERM", &self.pid.to_string()]).status().await;
        }
        if tokio::time::timeout(Duration::from_secs(15), self.child.wait()).await.is_err() {
            signal_children(self.pid, "KILL");
            let _ = self.child.kill().await;
        }
    }
}

/// Sends SIG`signal` to the children of `pid` (a wrapper's core); whether there were any.
fn signal_children(pid: u32, signal: &str) -> bool {
    std::process::Command::new("pkill")
        .args([format!("-{signal}"), "-P".into(), pid.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The children of `pid`: a wrapper's core.
fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|c| c.parse().ok())
        .collect()
}

/// A core dropped while running (a run that failed) takes a wrapper's core with it, as
/// `kill_on_drop` takes the process itself.
impl Drop for CoreProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            signal_children(self.pid, "KILL");
        }
    }
}

async fn start_core(
    cp: &ControlPlane,
    args: &Args,
    core: &str,
    peer: Option<&Path>,
    endpoint: &str,
    dir: &Path,
) -> anyhow::Result<CoreProcess> {
    let kubeconfig = cp.kubeconfig_path().display().to_string();
    let log = PathBuf::from(format!("{}.{core}.log", args.json.display()));
    let binaries = crate::core_binaries(&args.core_binary)?;
    let mut cmd = match core {
        _ if core == "rust" || binaries.contains_key(core) => {
            // `rust` is this benchmark's own build of the core (`ccm-bench __core`); `rust-musl`
            // the binary the images ship (--core-binary), and any other binary named there,
            // with the same flags.
            let (binary, sub) = match binaries.get(core) {
                Some(b) => (b.clone(), None),
                None => (std::env::current_exe()?, Some("__core")),
            };
            // CCM_BENCH_CORE_WRAPPER=heaptrack (or another profiler) runs the core under it.
            let mut c = match std::env::var_os("CCM_BENCH_CORE_WRAPPER") {
                Some(wrapper) => {
                    let mut c = tokio::process::Command::new(wrapper);
                    c.arg(&binary);
                    c
                }
                None => tokio::process::Command::new(&binary),
            };
            c.args(sub).args([
                format!("--kubeconfig={kubeconfig}"),
                format!("--provider-endpoint={endpoint}"),
                "--cluster-name=bench".into(),
                format!("--cluster-cidr={CLUSTER_CIDR}"),
                "--leader-elect=false".into(),
                "--secure-port=0".into(),
                format!("--kube-api-qps={}", args.kube_api_qps),
                format!("--kube-api-burst={}", args.kube_api_burst),
                format!("--log-level={}", args.core_log),
            ]);
            c
        }
        _ => {
            let peer = peer.context("no upstream binary")?;
            let config = dir.join("cloud.yaml");
            std::fs::write(&config, format!("endpoint: {endpoint}\n"))?;
            let mut c = tokio::process::Command::new(peer);
            c.args([
                "--cloud-provider=ccm-rs-grpc".to_string(),
                format!("--cloud-config={}", config.display()),
                format!("--kubeconfig={kubeconfig}"),
                "--cluster-name=bench".into(),
                format!("--cluster-cidr={CLUSTER_CIDR}"),
                "--allocate-node-cidrs=false".into(),
                "--configure-cloud-routes=true".into(),
                "--leader-elect=false".into(),
                "--secure-port=0".into(),
                format!("--kube-api-qps={}", args.kube_api_qps),
                format!("--kube-api-burst={}", args.kube_api_burst),
                "--v=1".into(),
            ]);
            if core == "upstream-watch" {
                c.arg("--feature-gates=CloudControllerManagerWatchBasedRoutesReconciliation=true");
            }
            c
        }
    };
    CoreProcess::spawn(&mut cmd, &log, core)
}

pub(crate) async fn calls(admin: &AdminClient) -> anyhow::Result<BTreeMap<String, u64>> {
    let mut out = BTreeMap::new();
    for c in admin.calls().await?.counts {
        *out.entry(c.method).or_default() += c.count;
    }
    Ok(out)
}

/// Polls `check` every 250 ms until it returns Some, or fails after `timeout`.
pub(crate) async fn until<T>(
    what: &str,
    timeout: Duration,
    mut check: impl AsyncFnMut() -> anyhow::Result<Option<T>>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await? {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

pub(crate) fn node_name(tag: &str, i: usize) -> String {
    format!("{tag}-n{i}")
}

pub(crate) fn instance_id(tag: &str, i: usize) -> String {
    format!("i-{tag}-{i}")
}

/// The private address of instance `i`: Nodes the churn adds already initialised carry it, as
/// the address refresh would give them (else its first pass changes every load balancer's
/// hosts in the steady state).
pub(crate) fn instance_ip(i: usize) -> String {
    format!("10.{}.{}.{}", 128 + i / 65536, (i / 256) % 256, i % 256)
}

/// Node `i`'s podCIDR, one /24 of [`CLUSTER_CIDR`] (`i` below [`MAX_NODES`]).
pub(crate) fn pod_cidr(i: usize) -> String {
    format!("10.{}.{}.0/24", (i / 256) % 128, i % 256)
}

pub(crate) async fn create_all<F, Fut>(count: usize, make: F) -> anyhow::Result<()>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(0..count).map(make).buffer_unordered(PARALLEL).collect().await;
    results.into_iter().collect()
}

pub(crate) async fn ready(api: &Api<Node>, name: &str) -> anyhow::Result<()> {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let patch = serde_json::json!({ "status": { "conditions": [{
        "type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": now, "lastTransitionTime": now
    }] } });
    api.patch_status(name, &PatchParams::default(), &Patch::Strategic(&patch))
        .await
        .with_context(|| format!("heartbeat {name}"))?;
    Ok(())
}

/// Status updates as kubelets write them, every Node every `period`, spread evenly, for
/// `steady`: what a quiet cluster sends. Returns how long it ran.
pub(crate) async fn heartbeats(nodes: &Api<Node>, names: &[String], steady: Duration, period: Duration) -> Duration {
    let started = Instant::now();
    let beat = period.checked_div(names.len().max(1) as u32).unwrap_or_default();
    while started.elapsed() < steady {
        for name in names {
            if started.elapsed() >= steady {
                break;
            }
            let _ = ready(nodes, name).await;
            tokio::time::sleep(beat).await;
        }
    }
    started.elapsed()
}

/// Creates the namespace `ns` of one run.
pub(crate) async fn create_namespace(client: &kube::Client, ns: &str) -> anyhow::Result<()> {
    let namespace = Namespace { metadata: ObjectMeta { name: Some(ns.into()), ..Default::default() }, ..Default::default() };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .with_context(|| format!("creating namespace {ns}"))?;
    Ok(())
}

/// Runs every scenario against `core` and cleans up after it.
pub async fn run_core(cp: &ControlPlane, args: &Args, core: &str, peer: Option<&Path>) -> anyhow::Result<Figures> {
    // Each core's Nodes, namespace and instances are its own.
    let tag = match core {
        "rust" => "rs".to_string(),
        "rust-musl" => "rm".to_string(),
        "upstream" => "up".to_string(),
        "upstream-watch" => "uw".to_string(),
        other => format!("b{}", args.cores.iter().position(|c| c == other).unwrap_or(0)),
    };
    let tag = tag.as_str();
    let client = cp.client().await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let ns = format!("bench-{tag}");
    create_namespace(&client, &ns).await?;
    let services: Api<Service> = Api::namespaced(client.clone(), &ns);

    let dir = tempfile::tempdir()?;
    let (sim, stop_sim, admin, endpoint) = start_sim(args, tag, dir.path()).await?;
    let mut process = start_core(cp, args, core, peer, &endpoint, dir.path()).await?;
    // Let the core start and list (an empty cluster) before anything is measured.
    tokio::time::sleep(Duration::from_secs(3)).await;
    if let Some(status) = process.exited()? {
        bail!("{core} exited at start ({status}); see {}.{core}.log", args.json.display());
    }
    let mut f = Figures::default();

    let bench = Bench {
        args,
        tag,
        client: client.clone(),
        nodes: nodes.clone(),
        services: services.clone(),
        ns: ns.clone(),
        label: format!("bench={tag}"),
        admin,
    };
    // The core's CPU seconds since the last lap.
    let mut mark = process.cpu_seconds();
    let mut lap = |process: &CoreProcess| {
        let now = process.cpu_seconds();
        std::mem::replace(&mut mark, now).mul_add(-1.0, now)
    };
    bench.join_burst(&mut f).await?;
    f.join_cpu_seconds = lap(&process);
    bench.load_balancers(&mut f).await?;
    f.lb_cpu_seconds = lap(&process);
    bench.routes(&mut f).await?;
    f.routes_cpu_seconds = lap(&process);
    bench.churn(&mut f).await?;
    f.churn_cpu_seconds = lap(&process);
    let per = |cpu: f64, units: usize| cpu * 1000.0 / units.max(1) as f64;
    eprintln!(
        "   CPU: join {:.1} s, load balancers {:.1} s, routes {:.1} s, churn {:.1} s",
        f.join_cpu_seconds, f.lb_cpu_seconds, f.routes_cpu_seconds, f.churn_cpu_seconds
    );
    f.per_unit = PerUnit {
        node_initialised: per(f.join_cpu_seconds, args.nodes),
        load_balancer_made: per(f.lb_cpu_seconds, args.services),
        route_created: per(f.routes_cpu_seconds, args.nodes - f.routes_missing),
        load_balancer_update: per(f.churn_cpu_seconds, f.churn_updates),
    };
    bench.steady(&mut f, &mut process).await?;
    bench.unhealthy(&mut f).await?;
    bench.clean_up(process).await?;
    let _ = Api::<Namespace>::all(client.clone()).delete(&ns, &DeleteParams::default()).await;
    let _ = stop_sim.send(());
    let _ = sim.await;
    Ok(f)
}

/// A fresh simulated cloud for one core: the joining instances and the ones churn adds, one
/// route table with room for them all, an address pool; its provider and admin sockets in `dir`.
async fn start_sim(args: &Args, tag: &str, dir: &Path) -> anyhow::Result<RunningSim> {
    start_sim_with(sim_config(args, tag), dir).await
}

/// A running sim: its task, what stops it, its admin client and its provider endpoint.
pub(crate) type RunningSim = (tokio::task::JoinHandle<anyhow::Result<()>>, tokio::sync::oneshot::Sender<()>, AdminClient, String);

/// The simulated cloud of one core's run: `args.nodes + args.churn` instances named for `tag`,
/// one route table with room for them all, the latency and rate limit of the flags.
pub(crate) fn sim_config(args: &Args, tag: &str) -> Config {
    // A fresh cloud: the joining instances and the ones churn adds.
    let total = args.nodes + args.churn;
    let mut config = Config {
        api: ApiConfig {
            latency_ms: args.latency_ms,
            jitter_ms: 0,
            rate_limit: Some(RateLimit { rps: args.rate_limit, burst: args.rate_limit.ceil() as u32 }),
            // Declared in the sim's capabilities: our core paces its calls to it (upstream's
            // framework has no such thing and finds the limit by being refused).
            undeclared_rate_limit: false,
            consistency_delay_ms: 0,
        },
        route_tables: vec![RouteTableSpec {
            id: "rt-main".into(),
            name: "main".into(),
            max_routes: (total + 16) as u32,
            zones: Vec::new(),
        }],
        ..Config::default()
    };
    config.load_balancers.address_pool = vec!["198.18.0.0/15".into()];
    config.bulk_routes = args.bulk;
    config.load_balancers.bulk_hosts = args.bulk;
    for i in 0..total {
        config.instances.push(InstanceSpec {
            id: instance_id(tag, i),
            name: node_name(tag, i),
            zone: ZONE.into(),
            instance_type: "sim.large".into(),
            state: Default::default(),
            addresses: vec![Address { kind: "InternalIP".into(), address: instance_ip(i) }],
            tags: Default::default(),
            ..Default::default()
        });
    }
    config
}

/// Starts a sim of `config` with its provider and admin sockets in `dir`.
pub(crate) async fn start_sim_with(config: Config, dir: &Path) -> anyhow::Result<RunningSim> {
    let (provider, admin_sock) = (dir.join("provider.sock"), dir.join("admin.sock"));
    let (stop_sim, sim_stopped) = tokio::sync::oneshot::channel::<()>();
    let endpoints = Endpoints {
        provider: Listen::Unix(provider.clone()),
        admin: Some(Listen::Unix(admin_sock.clone())),
        metadata: None,
        metrics: None,
    };
    let sim = tokio::spawn(ccm_provider_sim::run(config, endpoints, async move {
        let _ = sim_stopped.await;
    }));
    while tokio::net::UnixStream::connect(&admin_sock).await.is_err() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let admin = AdminClient::new(format!("unix://{}", admin_sock.display()));
    let endpoint = format!("unix://{}", provider.display());
    Ok((sim, stop_sim, admin, endpoint))
}

/// Deletes every Service of `services` and waits up to `wait` for them to be gone (their
/// finalizers need the core, so it runs until then); a timeout is reported, not an error.
pub(crate) async fn delete_services(services: &Api<Service>, wait: Duration) -> anyhow::Result<()> {
    services.delete_collection(&DeleteParams::default(), &ListParams::default()).await?;
    let gone =
        until("Services deleted", wait, async || Ok(services.list(&ListParams::default()).await?.items.is_empty().then_some(())))
            .await;
    if let Err(e) = gone {
        eprintln!("   cleanup: {e:#}");
    }
    Ok(())
}

/// One core's run: its namespace and its cloud, what every scenario uses.
struct Bench<'a> {
    args: &'a Args,
    tag: &'a str,
    client: kube::Client,
    nodes: Api<Node>,
    services: Api<Service>,
    ns: String,
    /// The label selector of this run's Nodes.
    label: String,
    admin: AdminClient,
}

impl Bench<'_> {
    /// N Nodes created together, `uninitialized`: time until all are initialised, and calls.
    async fn join_burst(&self, f: &mut Figures) -> anyhow::Result<()> {
        let Self { args, tag, client, nodes, label, admin, .. } = self;
        admin.reset_calls().await?;
        let started = Instant::now();
        create_all(args.nodes, |i| {
            let (client, nodes, tag) = (client.clone(), nodes.clone(), tag.to_string());
            async move {
                let name = node_name(&tag, i);
                NodeBuilder::new(&name)
                    .uninitialized()
                    .label("bench", &tag)
                    .label("kubernetes.io/hostname", &name)
                    .address("Hostname", &name)
                    .create(&client)
                    .await?;
                ready(&nodes, &name).await
            }
        })
        .await?;
        let want = args.nodes;
        until("every Node initialised", Duration::from_secs(600), async || {
            let listed = nodes.list(&ListParams::default().labels(label)).await?.items;
            let done = listed
                .iter()
                .filter(|n| {
                    n.spec
                        .as_ref()
                        .and_then(|s| s.taints.as_ref())
                        .is_none_or(|t| !t.iter().any(|t| t.key == UNINITIALIZED_TAINT))
                })
                .count();
            Ok((done >= want).then_some(()))
        })
        .await?;
        f.join_seconds = started.elapsed().as_secs_f64();
        f.join_calls = calls(admin).await?;
        eprintln!("   join: {:.1} s, {} provider calls", f.join_seconds, f.join_calls.values().sum::<u64>());
        Ok(())
    }

    /// M LoadBalancer Services created together: time until all have an address, and calls.
    async fn load_balancers(&self, f: &mut Figures) -> anyhow::Result<()> {
        let Self { args, services, ns, admin, .. } = self;
        admin.reset_calls().await?;
        let started = Instant::now();
        // The default NodePort range holds 2768 ports: beyond 2000 Services, none allocates one
        // (`allocateLoadBalancerNodePorts: false`, as load balancers that reach pods directly).
        let node_ports = args.services <= 2000;
        create_all(args.services, |i| {
            let services = services.clone();
            let ns = ns.clone();
            async move {
                let mut svc = load_balancer_service(&ns, &format!("lb-{i}"), &[80]);
                if let Some(spec) = svc.spec.as_mut().filter(|_| !node_ports) {
                    spec.allocate_load_balancer_node_ports = Some(false);
                }
                services.create(&PostParams::default(), &svc).await.with_context(|| format!("service lb-{i}"))?;
                Ok(())
            }
        })
        .await?;
        let want = args.services;
        until("every Service with an address", Duration::from_secs(600), async || {
            let listed = services.list(&ListParams::default()).await?.items;
            let done = listed.iter().filter(|s| load_balancer_ip(s).is_some()).count();
            Ok((done >= want).then_some(()))
        })
        .await?;
        f.lb_seconds = started.elapsed().as_secs_f64();
        f.lb_calls = calls(admin).await?;
        eprintln!("   load balancers: {:.1} s, {} provider calls", f.lb_seconds, f.lb_calls.values().sum::<u64>());
        Ok(())
    }

    /// podCIDRs set on every Node together: latency from each change to its route, time until all exist.
    async fn routes(&self, f: &mut Figures) -> anyhow::Result<()> {
        let Self { args, tag, nodes, admin, .. } = self;
        let set_at: std::sync::Arc<std::sync::Mutex<HashMap<String, u64>>> = Default::default();
        let started = Instant::now();
        create_all(args.nodes, |i| {
            let (nodes, set_at, tag) = (nodes.clone(), set_at.clone(), tag.to_string());
            async move {
                let name = node_name(&tag, i);
                let cidr = pod_cidr(i);
                set_at.lock().map_err(|_| anyhow::anyhow!("lock"))?.insert(name.clone(), now_ms());
                let patch = serde_json::json!({ "spec": { "podCIDR": cidr, "podCIDRs": [cidr] } });
                nodes
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .with_context(|| format!("podCIDR of {name}"))?;
                Ok(())
            }
        })
        .await?;
        // A core that gives up on a route (and waits for its next resync) is reported, not waited for.
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut done_at = None;
        let routes = loop {
            let tables = admin.route_tables().await?;
            let routes: Vec<(String, u64)> = tables
                .iter()
                .flat_map(|t| t.routes.iter())
                .filter(|r| r.cluster == "bench")
                .map(|r| (r.node_name.clone(), r.created_at_unix_ms))
                .collect();
            if routes.len() >= args.nodes {
                done_at = Some(started.elapsed());
                break routes;
            }
            if Instant::now() > deadline {
                break routes;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        f.routes_missing = args.nodes.saturating_sub(routes.len());
        f.routes_seconds = done_at.map_or(f64::NAN, |d| d.as_secs_f64());
        let set_at = set_at.lock().map_err(|_| anyhow::anyhow!("lock"))?.clone();
        let mut lat: Vec<u64> = routes.iter().filter_map(|(n, at)| set_at.get(n).map(|s| at.saturating_sub(*s))).collect();
        lat.sort_unstable();
        (f.route_p50_ms, f.route_p99_ms) = (percentile(&lat, 50.0), percentile(&lat, 99.0));
        eprintln!(
            "   routes: p50 {} ms, p99 {} ms, all in {:.1} s, {} missing",
            f.route_p50_ms, f.route_p99_ms, f.routes_seconds, f.routes_missing
        );
        Ok(())
    }

    /// Nodes added, removed and excluded one at a time: latency until every load balancer's hosts follow.
    async fn churn(&self, f: &mut Figures) -> anyhow::Result<()> {
        let Self { args, tag, client, nodes, admin, .. } = self;
        let mut lat = Vec::new();
        for change in 0..args.churn {
            let at = now_ms();
            match change % 3 {
                0 => {
                    let i = args.nodes + change;
                    let name = node_name(tag, i);
                    NodeBuilder::new(&name)
                        .label("bench", tag)
                        .label("kubernetes.io/hostname", &name)
                        .provider_id(&format!("sim://{ZONE}/{}", instance_id(tag, i)))
                        .address("InternalIP", &instance_ip(i))
                        .address("Hostname", &name)
                        .create(client)
                        .await?;
                    ready(nodes, &name).await?;
                }
                1 => {
                    nodes.delete(&node_name(tag, change), &DeleteParams::default()).await.context("removing a node")?;
                }
                _ => {
                    let patch = serde_json::json!({ "metadata": { "labels": { EXCLUDE_LABEL: "true" } } });
                    nodes
                        .patch(&node_name(tag, change), &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                        .context("excluding a node")?;
                }
            }
            let deadline = Instant::now() + Duration::from_secs(120);
            let mut seen: HashMap<String, u64> = HashMap::new();
            while Instant::now() < deadline && seen.len() < args.services {
                for lb in admin.hosts_summary().await? {
                    if lb.hosts_changed_at_unix_ms >= at {
                        seen.entry(lb.name).or_insert(lb.hosts_changed_at_unix_ms - at);
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            f.churn_timeouts += args.services.saturating_sub(seen.len());
            f.churn_updates += seen.len();
            lat.extend(seen.into_values());
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        lat.sort_unstable();
        (f.churn_p50_ms, f.churn_p99_ms) = (percentile(&lat, 50.0), percentile(&lat, 99.0));
        eprintln!("   churn: p50 {} ms, p99 {} ms, {} not seen", f.churn_p50_ms, f.churn_p99_ms, f.churn_timeouts);
        Ok(())
    }

    /// Heartbeats only: calls per hour, CPU and memory of the core.
    async fn steady(&self, f: &mut Figures, process: &mut CoreProcess) -> anyhow::Result<()> {
        let Self { args, nodes, label, admin, .. } = self;
        // Let the churn's last changes (a route to delete, a load balancer to update) settle first,
        // so they are not counted as steady-state traffic.
        tokio::time::sleep(Duration::from_secs(12)).await;
        let names: Vec<String> =
            nodes.list(&ListParams::default().labels(label)).await?.items.into_iter().filter_map(|n| n.metadata.name).collect();
        admin.reset_calls().await?;
        let cpu_before = process.cpu_seconds();
        let elapsed = heartbeats(nodes, &names, args.steady, args.status_period).await.as_secs_f64();
        f.steady_seconds = elapsed;
        let per_hour = |n: u64| n as f64 * 3600.0 / elapsed;
        let steady = calls(admin).await?;
        f.steady_calls_per_hour = steady.iter().map(|(m, n)| (m.clone(), per_hour(*n))).collect();
        f.steady_cloud_calls_per_hour =
            per_hour(steady.iter().filter(|(m, _)| !m.starts_with("IdentityService/")).map(|(_, n)| n).sum());
        f.steady_list_routes_per_hour = per_hour(steady.get("RoutesService/ListRoutes").copied().unwrap_or(0));
        f.steady_cpu_seconds = process.cpu_seconds() - cpu_before;
        f.total_cpu_seconds = process.cpu_seconds();
        (f.rss_steady_mib, f.rss_peak_mib) = process.rss_mib();
        eprintln!(
            "   steady: {:.0} cloud calls/hour, {:.0} ListRoutes/hour, {:.2} CPU s, RSS {:.1} MiB (peak {:.1})",
            f.steady_cloud_calls_per_hour, f.steady_list_routes_per_hour, f.steady_cpu_seconds, f.rss_steady_mib, f.rss_peak_mib
        );
        Ok(())
    }

    /// 1% of the Nodes NotReady (their heartbeats stop, Ready False) and 1% shut down (the
    /// instance stopped, its Node NotReady), at least one of each, the rest beating on: the
    /// cloud calls per hour that costs.
    async fn unhealthy(&self, f: &mut Figures) -> anyhow::Result<()> {
        let Self { args, tag, nodes, label, admin, .. } = self;
        if args.unhealthy.is_zero() {
            return Ok(());
        }
        let mut names: Vec<String> =
            nodes.list(&ListParams::default().labels(label)).await?.items.into_iter().filter_map(|n| n.metadata.name).collect();
        names.sort();
        let k = (names.len() / 100).max(1).min(names.len() / 2);
        let (down, healthy) = names.split_at(2 * k);
        for (j, name) in down.iter().enumerate() {
            if j >= k {
                let index = name.rsplit_once("-n").and_then(|(_, i)| i.parse::<usize>().ok()).context("a bench Node's index")?;
                admin.instance_action(&instance_id(tag, index), "stop").await?;
            }
            let patch = serde_json::json!({ "status": { "conditions": [{
                "type": "Ready", "status": "False", "reason": "KubeletNotReady",
                "lastHeartbeatTime": k8s_openapi::jiff::Timestamp::now().to_string(),
            }] } });
            nodes.patch_status(name, &PatchParams::default(), &Patch::Strategic(&patch)).await?;
        }
        admin.reset_calls().await?;
        let elapsed = heartbeats(nodes, healthy, args.unhealthy, args.status_period).await.as_secs_f64();
        f.unhealthy_seconds = elapsed;
        let cloud: BTreeMap<String, u64> =
            calls(admin).await?.into_iter().filter(|(m, _)| !m.starts_with("IdentityService/")).collect();
        let per_hour = |n: u64| n as f64 * 3600.0 / elapsed;
        f.unhealthy_cloud_calls_per_hour = per_hour(cloud.values().sum());
        f.unhealthy_calls_per_hour = cloud.into_iter().map(|(m, n)| (m, per_hour(n))).collect();
        eprintln!(
            "   {k} NotReady and {k} shut down: {:.0} cloud calls/hour over {elapsed:.0} s",
            f.unhealthy_cloud_calls_per_hour
        );
        Ok(())
    }

    /// Services first (their finalizers need the core), then the core stopped, then the Nodes.
    async fn clean_up(&self, process: CoreProcess) -> anyhow::Result<()> {
        let Self { nodes, services, label, .. } = self;
        delete_services(services, Duration::from_secs(300)).await?;
        process.stop().await;
        nodes.delete_collection(&DeleteParams::default(), &ListParams::default().labels(label)).await?;
        Ok(())
    }
}
