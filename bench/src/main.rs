//! `ccm-bench`: the Rust core and upstream's cloud-controller-manager (harness/peer, forwarding
//! to the same cloudprovider.v1 sidecar), one after the other on the same API server, each with
//! a fresh simulated cloud of the same latency and rate limit, under the same workload; prints
//! a table side by side with ratios and writes the figures as JSON.
//!
//! Each core runs as its own process, so its CPU time and memory are its own. Latencies are
//! measured from the API change to the call reaching the sim (its timestamps), not from logs.

mod aws;
mod growth;
mod hybrid;
mod replicas;
mod report;
mod scenarios;
mod selectors;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;

// The simulated cloud (in this process) allocates a great deal when Services have 20,000 Nodes
// as backends; glibc's allocator made it, not the core, the bottleneck on 2 cores.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Benchmarks the Rust core against upstream's cloud-controller-manager.
#[derive(Debug, Clone, Parser)]
#[command(name = "ccm-bench", version, about)]
pub struct Args {
    /// Nodes that join together (and get routes).
    #[arg(long, default_value_t = 100)]
    pub nodes: usize,
    /// LoadBalancer Services created together.
    #[arg(long, default_value_t = 20)]
    pub services: usize,
    /// Node changes (add, remove, exclude) for the churn latency.
    #[arg(long, default_value_t = 9)]
    pub churn: usize,
    /// How long the steady state is observed (a status update per Node every `--status-period`).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub steady: Duration,
    /// How often each Node's status is written in the steady states: 10 s is the kubelet's
    /// heartbeat before node Leases; a large cluster's kubelets write it every 5 min
    /// (`nodeStatusReportFrequency`) when nothing changed, their heartbeats going to Leases,
    /// which the core does not watch.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub status_period: Duration,
    /// How long the steady state with 1% of the Nodes NotReady and 1% shut down is observed
    /// (what the lifecycle controller costs); 0 leaves it out.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub unhealthy: Duration,
    /// The simulated cloud API's latency per call, in milliseconds.
    #[arg(long, default_value_t = 20)]
    pub latency_ms: u64,
    /// The simulated cloud's account-wide rate limit, in calls per second.
    #[arg(long, default_value_t = 20.0)]
    pub rate_limit: f64,
    /// The API server budget of both cores (`--kube-api-qps`); the join's floor is 2 writes
    /// per Node at this rate.
    #[arg(long, default_value_t = 20.0)]
    pub kube_api_qps: f64,
    /// Both cores' `--kube-api-burst`.
    #[arg(long, default_value_t = 30)]
    pub kube_api_burst: u32,
    /// The simulated cloud offers the bulk calls (ApplyRoutes, BatchUpdateLoadBalancerHosts;
    /// one cloud call per 500 items). Upstream's interface has no bulk call, so only our core
    /// uses them; the floors are then per bulk call.
    #[arg(long)]
    pub bulk: bool,
    /// Which cores: `rust`, `rust-musl` (the binary the images ship, from `--core-binary`),
    /// `upstream` (routes on a 10 s timer), `upstream-watch` (upstream with the watch-based
    /// route reconciliation feature gate on); default: all but `rust-musl`. With `--cloud aws`:
    /// `rust` and `upstream` (aws-cloud-controller-manager); default both.
    #[arg(long, value_delimiter = ',')]
    pub cores: Vec<String>,
    /// The cloud: `sim` (the simulated cloud behind the same sidecar for every core) or `aws`
    /// (the real AWS provider on moto: our core with ccm-provider-aws, upstream's
    /// aws-cloud-controller-manager; AWS calls counted at moto), or `hybrid` (one Rust core
    /// with two providers, two sims of two schemes: calls and latencies per provider,
    /// cross-talk, and one provider throttled while the other's Nodes join), or `selectors`
    /// (one Rust core: Services choosing their backends by node selector over
    /// `--selectors` pools, node changes one at a time; then the load balancer repair reads
    /// of a provider that cannot list, over `--repair-period`), or `replicas` (two Rust
    /// replicas, one killed: time to a new leader per controller and the work redone, with one
    /// Lease for all and with a Lease per controller shared by the replicas).
    #[arg(long, default_value = "sim", value_parser = ["sim", "aws", "hybrid", "selectors", "replicas"])]
    pub cloud: String,
    /// With `--cloud selectors`: how many node pools (distinct selectors) the Services choose among.
    #[arg(long, default_value_t = 10)]
    pub selectors: usize,
    /// With `--cloud selectors`: the core's `--load-balancer-repair-period` (the reads of one
    /// period are counted, then three load balancers are deleted by hand).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub repair_period: Duration,
    /// Where to write the figures as JSON.
    #[arg(long, default_value = "ccm-bench.json")]
    pub json: PathBuf,
    /// The `rust-musl` core's binary: the static build the images ship, as
    /// `deploy/images/build-binaries.sh target/musl cloud-controller-manager` makes it. Also
    /// `NAME=PATH`, repeatable: a core NAME (for `--cores`) running that binary, so that builds
    /// (allocators, say) compare in one run.
    #[arg(long)]
    pub core_binary: Vec<String>,
    /// upstream's binary; default: `harness/envtest/setup.sh peer` builds (or finds) it.
    #[arg(long)]
    pub peer: Option<PathBuf>,
    /// Log filter of the cores (their stderr goes to <json>.<core>.log).
    #[arg(long, default_value = "info")]
    pub core_log: String,
    /// Exit with an error unless every figure of every core was measured (for CI).
    #[arg(long)]
    pub check: bool,
    /// A large-cluster run of this many Nodes, one command per size for `--fit`: Services
    /// 200 at 1000 Nodes, else 5000; a Node's status every 5 min; 10 min of steady state and
    /// of 1% unhealthy; `--kube-api-qps 200 --kube-api-burst 300`; the bulk calls; 3 churn
    /// changes; the figures in `results-<size>-nodes.json`. Flags given as well win.
    #[arg(long)]
    pub size: Option<usize>,
    /// Runs nothing: fits the reports (`--json` files of runs at several sizes) for growth
    /// with the Nodes, projects to 65,000 and 100,000 Nodes, writes the fit to `--json` and
    /// the plot to `--plot`.
    #[arg(long, value_delimiter = ',')]
    pub fit: Vec<PathBuf>,
    /// With `--fit`: the core whose figures are fitted (default: rust-musl, else rust).
    #[arg(long)]
    pub fit_core: Option<String>,
    /// With `--fit`: the API server budget the projections assume (default: the largest
    /// run's `--kube-api-qps`).
    #[arg(long)]
    pub assume_qps: Option<f64>,
    /// With `--fit`: where the SVG plot goes (default: `--json` with `.svg`).
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    // `ccm-bench __core …` is the Rust core itself, run as a child process.
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if argv.get(1).is_some_and(|a| a == "__core") {
        argv.remove(1);
        let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("runtime")?;
        let code = runtime.block_on(ccm_core::runtime::main_with_args(argv));
        std::process::exit(if code == std::process::ExitCode::SUCCESS { 0 } else { 1 });
    }
    let matches = <Args as clap::CommandFactory>::command().get_matches();
    let mut args = <Args as clap::FromArgMatches>::from_arg_matches(&matches)?;
    if let Some(size) = args.size {
        apply_size(&mut args, size, |id| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine));
    }
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::new("warn")).with_writer(std::io::stderr).init();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("runtime")?;
    runtime.block_on(async {
        // Ctrl-C or SIGTERM ends the run as a failure would: what it started (the cores, the
        // provider sidecars, the API server and etcd) is stopped by their drops, not orphaned.
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).context("listening for SIGTERM")?;
        tokio::select! {
            result = run(args) => result,
            _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted (SIGINT): stopped what the run had started")),
            _ = terminate.recv() => Err(anyhow::anyhow!("terminated (SIGTERM): stopped what the run had started")),
        }
    })
}

async fn run(mut args: Args) -> anyhow::Result<()> {
    if !args.fit.is_empty() {
        return fit(&args);
    }
    if args.nodes + args.churn > scenarios::MAX_NODES {
        anyhow::bail!(
            "--nodes: at most {} Nodes with the churn's (one /24 each of the pod network {})",
            scenarios::MAX_NODES,
            scenarios::CLUSTER_CIDR
        );
    }
    let mut known: Vec<String> = match args.cloud.as_str() {
        "aws" => vec!["rust".into(), "upstream".into()],
        // Upstream's cloud-controller-manager serves one provider, and knows no node selector.
        "hybrid" | "selectors" | "replicas" => vec!["rust".into()],
        _ => vec!["rust".into(), "rust-musl".into(), "upstream".into(), "upstream-watch".into()],
    };
    let binaries = core_binaries(&args.core_binary)?;
    if known.iter().any(|k| k == "rust-musl") {
        known.extend(binaries.keys().filter(|k| k.as_str() != "rust-musl").cloned());
    }
    if args.cores.is_empty() {
        args.cores = known.iter().filter(|c| !binaries.contains_key(*c) && c.as_str() != "rust-musl").cloned().collect();
    }
    for core in &args.cores {
        if !known.contains(core) {
            anyhow::bail!("--cores: unknown core {core:?} for --cloud {} ({})", args.cloud, known.join(", "));
        }
        if core == "rust-musl" && !binaries.contains_key(core) {
            anyhow::bail!(
                "the rust-musl core needs --core-binary (build it: deploy/images/build-binaries.sh target/musl cloud-controller-manager)"
            );
        }
    }
    if args.cloud == "aws" {
        return run_aws(&args).await;
    }
    if args.cloud == "hybrid" {
        eprintln!("starting the control plane");
        let cp = tokio::task::spawn_blocking(ccm_harness::ControlPlane::start).await??;
        eprintln!("== two providers, one core: {} Nodes, {} Services", args.nodes, args.services);
        let report = hybrid::run(&cp, &args).await?;
        return publish(&args, &report.table(), &report, report.missing());
    }
    if args.cloud == "selectors" {
        eprintln!("starting the control plane");
        let cp = tokio::task::spawn_blocking(ccm_harness::ControlPlane::start).await??;
        eprintln!("== backends per Service: {} Nodes, {} Services, {} selectors", args.nodes, args.services, args.selectors);
        let report = selectors::run(&cp, &args).await?;
        return publish(&args, &report.table(), &report, report.missing());
    }
    if args.cloud == "replicas" {
        eprintln!("starting the control plane");
        let cp = tokio::task::spawn_blocking(ccm_harness::ControlPlane::start).await??;
        eprintln!("== two replicas, one killed: {} Nodes, {} Services", args.nodes, args.services);
        let report = replicas::run(&cp, &args).await?;
        return publish(&args, &report.table(), &report, report.missing());
    }
    let peer = match &args.peer {
        Some(p) => Some(p.clone()),
        None if args.cores.iter().any(|c| c.starts_with("upstream")) => Some(ccm_harness::Assets::tool("peer")?),
        None => None,
    };
    eprintln!("starting the control plane");
    let cp = tokio::task::spawn_blocking(ccm_harness::ControlPlane::start).await??;
    let mut results: BTreeMap<String, report::Figures> = BTreeMap::new();
    for core in &args.cores {
        eprintln!(
            "== {core}: {} Nodes, {} Services, {} churn changes, steady {:?}",
            args.nodes, args.services, args.churn, args.steady
        );
        let figures = scenarios::run_core(&cp, &args, core, peer.as_deref()).await.with_context(|| format!("core {core}"))?;
        results.insert(core.clone(), figures);
    }
    let report = report::Report::new(&args, results);
    publish(&args, &report.table(), &report, report.missing())
}

/// `--size N`: the large-cluster settings of a size, except where `given(flag)`.
fn apply_size(args: &mut Args, size: usize, given: impl Fn(&str) -> bool) {
    let set = |flag: &str| !given(flag);
    if set("nodes") {
        args.nodes = size;
    }
    if set("services") {
        args.services = if size <= 1000 { 200 } else { 5000 };
    }
    if set("churn") {
        args.churn = 3;
    }
    if set("steady") {
        args.steady = Duration::from_secs(600);
    }
    if set("unhealthy") {
        args.unhealthy = Duration::from_secs(600);
    }
    if set("status_period") {
        args.status_period = Duration::from_secs(300);
    }
    if set("kube_api_qps") {
        args.kube_api_qps = 200.0;
    }
    if set("kube_api_burst") {
        args.kube_api_burst = 300;
    }
    if set("bulk") {
        args.bulk = true;
    }
    if set("json") {
        args.json = PathBuf::from(format!("results-{size}-nodes.json"));
    }
    // Our core, and the binaries named (upstream's takes hours at these sizes: `--cores` asks).
    if args.cores.is_empty() {
        args.cores =
            std::iter::once("rust".to_string()).chain(core_binaries(&args.core_binary).unwrap_or_default().into_keys()).collect();
    }
}

/// `--fit`: the growth of the reports given, printed, written and plotted.
fn fit(args: &Args) -> anyhow::Result<()> {
    let qps = match args.assume_qps {
        Some(q) => q,
        None => {
            let largest = growth::fit_files(&args.fit, args.fit_core.as_deref(), 1.0)?;
            largest.points.last().map_or(200.0, |p| p.kube_api_qps)
        }
    };
    let growth = growth::fit_files(&args.fit, args.fit_core.as_deref(), qps)?;
    let plot = args.plot.clone().unwrap_or_else(|| args.json.with_extension("svg"));
    std::fs::write(&plot, growth.svg()).with_context(|| format!("writing {}", plot.display()))?;
    eprintln!("plot written to {}", plot.display());
    publish(args, &growth.table(), &growth, Vec::new())
}

/// The cores `--core-binary` names: `PATH` is `rust-musl`, `NAME=PATH` is NAME; each a file.
pub fn core_binaries(given: &[String]) -> anyhow::Result<BTreeMap<String, PathBuf>> {
    let mut out = BTreeMap::new();
    for g in given {
        let (name, path) = match g.split_once('=') {
            Some((name, path)) => (name.to_string(), PathBuf::from(path)),
            None => ("rust-musl".to_string(), PathBuf::from(g)),
        };
        if ["rust", "upstream", "upstream-watch"].contains(&name.as_str()) || name.is_empty() {
            anyhow::bail!("--core-binary {g}: {name:?} cannot name a binary");
        }
        if !path.is_file() {
            anyhow::bail!("--core-binary {g}: {} is no file", path.display());
        }
        if out.insert(name.clone(), path).is_some() {
            anyhow::bail!("--core-binary: {name} given twice");
        }
    }
    Ok(out)
}

/// Prints the table, writes the JSON, and with `--check` fails on figures not measured.
fn publish(args: &Args, table: &str, report: &impl serde::Serialize, missing: Vec<String>) -> anyhow::Result<()> {
    println!("{table}");
    std::fs::write(&args.json, serde_json::to_string_pretty(report)?)
        .with_context(|| format!("writing {}", args.json.display()))?;
    eprintln!("figures written to {}", args.json.display());
    if args.check && !missing.is_empty() {
        anyhow::bail!("figures not measured: {}", missing.join(", "));
    }
    Ok(())
}

async fn run_aws(args: &Args) -> anyhow::Result<()> {
    eprintln!("starting the control plane");
    let cp = tokio::task::spawn_blocking(ccm_harness::ControlPlane::start).await??;
    let report = aws::run(&cp, args).await?;
    publish(args, &report.table(), &report, report.missing())
}
