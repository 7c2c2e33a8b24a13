//! What `ccm-bench` prints and writes: each core's figures, the physical floors beside them, and
//! the table of every core side by side with their ratios.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::Args;

/// What one core did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Figures {
    /// Seconds from the first Node created to every Node initialised.
    pub join_seconds: f64,
    /// Provider calls during the join, by method.
    pub join_calls: BTreeMap<String, u64>,
    /// Seconds from the first Service created to every Service with an address.
    pub lb_seconds: f64,
    /// Provider calls while the load balancers were created, by method.
    pub lb_calls: BTreeMap<String, u64>,
    /// From a podCIDR set to its route in the cloud, in milliseconds.
    pub route_p50_ms: u64,
    /// The same, 99th percentile.
    pub route_p99_ms: u64,
    /// Seconds until every route existed (NaN when some were still missing after 120 s).
    pub routes_seconds: f64,
    /// Routes still missing 120 s after the podCIDRs were set.
    pub routes_missing: usize,
    /// From a Node added, removed or excluded to UpdateLoadBalancerHosts reaching the cloud,
    /// per load balancer, in milliseconds.
    pub churn_p50_ms: u64,
    /// The same, 99th percentile.
    pub churn_p99_ms: u64,
    /// (change, load balancer) pairs that did not reach the cloud within 120 s.
    pub churn_timeouts: usize,
    /// How long the steady state was observed, in seconds.
    pub steady_seconds: f64,
    /// Provider calls per hour at steady state, by method (none at all is a figure too).
    pub steady_calls_per_hour: BTreeMap<String, f64>,
    /// Of those, calls that reach the cloud API (all but IdentityService).
    pub steady_cloud_calls_per_hour: f64,
    /// ListRoutes calls per hour at steady state.
    pub steady_list_routes_per_hour: f64,
    /// CPU seconds the core used during the steady state.
    pub steady_cpu_seconds: f64,
    /// How long the steady state with 1% NotReady and 1% shut down was observed, in seconds.
    pub unhealthy_seconds: f64,
    /// Its cloud calls per hour (all but IdentityService), by method.
    pub unhealthy_calls_per_hour: BTreeMap<String, f64>,
    /// Its cloud calls per hour in all.
    pub unhealthy_cloud_calls_per_hour: f64,
    /// CPU seconds the core used in all.
    pub total_cpu_seconds: f64,
    /// CPU seconds of the core during the join.
    pub join_cpu_seconds: f64,
    /// CPU seconds of the core while the load balancers were created.
    pub lb_cpu_seconds: f64,
    /// CPU seconds of the core while the routes were created.
    pub routes_cpu_seconds: f64,
    /// CPU seconds of the core during the churn.
    pub churn_cpu_seconds: f64,
    /// (change, load balancer) updates the churn saw reach the cloud.
    pub churn_updates: usize,
    /// CPU milliseconds per unit of work, scenario by scenario.
    pub per_unit: PerUnit,
    /// Resident memory at the end of the steady state, MiB.
    pub rss_steady_mib: f64,
    /// Peak resident memory, MiB.
    pub rss_peak_mib: f64,
}

/// CPU milliseconds per unit of work, so that cores doing different amounts of work compare.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PerUnit {
    /// Per Node initialised (the join).
    pub node_initialised: f64,
    /// Per load balancer made.
    pub load_balancer_made: f64,
    /// Per route created.
    pub route_created: f64,
    /// Per load balancer whose hosts a node change updated (the churn).
    pub load_balancer_update: f64,
}

/// The physical limits of the scenarios: the least time the API server budget and the
/// cloud's rate limit allow, whatever the core does.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Floors {
    /// Join: 2 writes per Node (the providerID and addresses, the taint removed) at
    /// --kube-api-qps, or the instance reads (500 a batch) at the rate limit, the longer.
    /// Every floor counts the bursts: a token bucket's first second's worth is free.
    pub join_seconds: f64,
    /// Load balancers: an Ensure per Service at the rate limit, or 2 writes per Service (the
    /// finalizer, the status) at --kube-api-qps, the longer.
    pub lb_seconds: f64,
    /// Routes: a create per route (or a bulk call per 500) at the rate limit.
    pub routes_seconds: f64,
    /// Churn: an update per load balancer (or a bulk call per 500) at the rate limit, for the
    /// last load balancer of a change, in milliseconds.
    pub churn_ms: f64,
}

impl Floors {
    /// The floors of `args`' run: `calls` at the cloud's rate limit take one call's latency
    /// and what the bucket's burst (one second's worth) does not cover; `writes` at
    /// --kube-api-qps what --kube-api-burst does not.
    fn of(args: &Args) -> Self {
        let (nodes, services) = (args.nodes as f64, args.services as f64);
        let cloud = |calls: f64| args.latency_ms as f64 / 1000.0 + (calls - args.rate_limit.ceil()).max(0.0) / args.rate_limit;
        let kube = |writes: f64| (writes - f64::from(args.kube_api_burst)).max(0.0) / args.kube_api_qps;
        let per_call = |items: f64| if args.bulk { (items / 500.0).ceil() } else { items };
        Self {
            join_seconds: kube(2.0 * nodes).max(cloud((nodes / 500.0).ceil())),
            lb_seconds: cloud(services).max(kube(2.0 * services)),
            routes_seconds: cloud(per_call(nodes)),
            churn_ms: cloud(per_call(services)) * 1000.0,
        }
    }
}

/// Every core's figures, and what they ran under.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Nodes joining.
    pub nodes: usize,
    /// Services.
    pub services: usize,
    /// Churn changes.
    pub churn: usize,
    /// Steady state seconds.
    pub steady_seconds: u64,
    /// Seconds between two status writes of a Node in the steady states.
    pub status_period_seconds: u64,
    /// Simulated API latency.
    pub latency_ms: u64,
    /// Simulated rate limit.
    pub rate_limit: f64,
    /// Both cores' --kube-api-qps.
    pub kube_api_qps: f64,
    /// Whether the sim offered the bulk calls.
    pub bulk: bool,
    /// The physical limits each scenario could reach, at best.
    pub floors: Floors,
    /// The machine.
    pub machine: String,
    /// Figures by core.
    pub cores: BTreeMap<String, Figures>,
}

impl Report {
    /// The report of a run.
    pub fn new(args: &Args, cores: BTreeMap<String, Figures>) -> Self {
        Self {
            nodes: args.nodes,
            services: args.services,
            churn: args.churn,
            steady_seconds: args.steady.as_secs(),
            status_period_seconds: args.status_period.as_secs(),
            latency_ms: args.latency_ms,
            rate_limit: args.rate_limit,
            kube_api_qps: args.kube_api_qps,
            bulk: args.bulk,
            floors: Floors::of(args),
            machine: machine(),
            cores,
        }
    }

    /// Figures that were not measured (a scenario that saw nothing), as `core: figure`.
    pub fn missing(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (core, f) in &self.cores {
            let checks = [
                ("join_seconds", f.join_seconds > 0.0),
                ("join_calls", !f.join_calls.is_empty()),
                ("lb_seconds", f.lb_seconds > 0.0),
                ("lb_calls", !f.lb_calls.is_empty()),
                ("route latency", f.route_p99_ms > 0 || f.routes_missing == self.nodes),
                ("routes_seconds", !f.routes_seconds.is_nan() || f.routes_missing > 0),
                ("churn latency", self.churn == 0 || f.churn_p99_ms > 0 || f.churn_timeouts > 0),
                ("steady state", f.steady_seconds > 0.0),
                ("total_cpu_seconds", f.total_cpu_seconds > 0.0),
                ("rss", f.rss_steady_mib > 0.0 && f.rss_peak_mib >= f.rss_steady_mib),
            ];
            out.extend(checks.iter().filter(|(_, ok)| !ok).map(|(name, _)| format!("{core}: {name}")));
        }
        out
    }

    /// A table, one column per core, and the ratio of each upstream column to the Rust one.
    pub fn table(&self) -> String {
        let rows: Vec<Row<Figures>> = vec![
            ("join: all initialised (s)", |f| f.join_seconds),
            ("join: provider calls", |f| f.join_calls.values().sum::<u64>() as f64),
            ("load balancers: all addressed (s)", |f| f.lb_seconds),
            ("load balancers: provider calls", |f| f.lb_calls.values().sum::<u64>() as f64),
            ("routes: podCIDR to route p50 (ms)", |f| f.route_p50_ms as f64),
            ("routes: podCIDR to route p99 (ms)", |f| f.route_p99_ms as f64),
            ("routes: all created (s)", |f| f.routes_seconds),
            ("routes: missing after 120 s", |f| f.routes_missing as f64),
            ("churn: node change to LB p50 (ms)", |f| f.churn_p50_ms as f64),
            ("churn: node change to LB p99 (ms)", |f| f.churn_p99_ms as f64),
            ("churn: changes not seen in 120 s", |f| f.churn_timeouts as f64),
            ("CPU ms per Node initialised", |f| f.per_unit.node_initialised),
            ("CPU ms per load balancer made", |f| f.per_unit.load_balancer_made),
            ("CPU ms per route created", |f| f.per_unit.route_created),
            ("CPU ms per load balancer update", |f| f.per_unit.load_balancer_update),
            ("steady: cloud calls per hour", |f| f.steady_cloud_calls_per_hour),
            ("steady: ListRoutes per hour", |f| f.steady_list_routes_per_hour),
            ("1% NotReady, 1% shut down: calls/hour", |f| {
                if f.unhealthy_seconds > 0.0 { f.unhealthy_cloud_calls_per_hour } else { f64::NAN }
            }),
            ("steady: CPU seconds", |f| f.steady_cpu_seconds),
            ("total CPU seconds", |f| f.total_cpu_seconds),
            ("RSS at steady state (MiB)", |f| f.rss_steady_mib),
            ("peak RSS (MiB)", |f| f.rss_peak_mib),
        ];
        let mut out = format!(
            "{} Nodes, {} LoadBalancer Services, {} churn changes, {} s steady state (a Node's status every {} s); cloud API {} ms \
             per call, {} calls/s{}; --kube-api-qps {}\n{}\n\n",
            self.nodes,
            self.services,
            self.churn,
            self.steady_seconds,
            self.status_period_seconds,
            self.latency_ms,
            self.rate_limit,
            if self.bulk { ", bulk calls offered" } else { "" },
            self.kube_api_qps,
            self.machine
        );
        out.push_str(&side_by_side(&self.cores, &rows));
        let fl = self.floors;
        let against: Vec<(Row<Figures>, f64)> = vec![
            (("join: all initialised (s)", |f| f.join_seconds), fl.join_seconds),
            (("load balancers: all addressed (s)", |f| f.lb_seconds), fl.lb_seconds),
            (("routes: all created (s)", |f| f.routes_seconds), fl.routes_seconds),
            (("churn: node change to LB p99 (ms)", |f| f.churn_p99_ms as f64), fl.churn_ms),
        ];
        out.push_str(&format!("\n{:38}{:>16}", "against the physical floor", "floor"));
        for n in self.cores.keys() {
            out.push_str(&format!("{:>22}", format!("{n}/floor")));
        }
        out.push('\n');
        for ((label, value), floor) in against {
            out.push_str(&format!("{label:38}{:>16}", fmt(floor)));
            for f in self.cores.values() {
                out.push_str(&format!("{:>22}", ratio(value(f), floor)));
            }
            out.push('\n');
        }
        out.push_str("\nprovider calls per hour at steady state, by method:\n");
        for (name, f) in &self.cores {
            out.push_str(&format!("  {name}:\n"));
            for (m, n) in &f.steady_calls_per_hour {
                out.push_str(&format!("    {m:50} {n:>10.0}\n"));
            }
        }
        if self.cores.values().any(|f| f.unhealthy_seconds > 0.0) {
            out.push_str("\ncloud calls per hour with 1% of the Nodes NotReady and 1% shut down, by method:\n");
            for (name, f) in &self.cores {
                out.push_str(&format!("  {name} ({:.0} s):\n", f.unhealthy_seconds));
                for (m, n) in &f.unhealthy_calls_per_hour {
                    out.push_str(&format!("    {m:50} {n:>10.0}\n"));
                }
            }
        }
        out
    }
}

/// A table row: its label and how to read it from a core's figures.
pub(crate) type Row<F> = (&'static str, fn(&F) -> f64);

/// The rows for every core side by side, with a ratio column (core / rust) per other core.
pub(crate) fn side_by_side<F>(cores: &BTreeMap<String, F>, rows: &[Row<F>]) -> String {
    let names: Vec<&String> = cores.keys().collect();
    let rust = cores.get("rust");
    let mut out = format!("{:38}", "figure");
    for n in &names {
        out.push_str(&format!("{:>16}", n));
    }
    for n in names.iter().filter(|n| n.as_str() != "rust" && rust.is_some()) {
        out.push_str(&format!("{:>22}", format!("{n}/rust")));
    }
    out.push('\n');
    for (label, value) in rows {
        out.push_str(&format!("{label:38}"));
        for n in &names {
            out.push_str(&format!("{:>16}", fmt(value(&cores[*n]))));
        }
        if let Some(r) = rust {
            for n in names.iter().filter(|n| n.as_str() != "rust") {
                out.push_str(&format!("{:>22}", ratio(value(&cores[*n]), value(r))));
            }
        }
        out.push('\n');
    }
    out
}

/// `a / b` as "2.5x"; "-" when either is unknown or both are 0, "inf" for a / 0.
fn ratio(a: f64, b: f64) -> String {
    if a.is_nan() || b.is_nan() {
        "-".into()
    } else if b > 0.0 {
        format!("{:.2}x", a / b)
    } else if a > 0.0 {
        "inf".into()
    } else {
        "-".into()
    }
}

fn fmt(v: f64) -> String {
    if v.is_nan() {
        return "-".into();
    }
    if v >= 100.0 || v.fract() == 0.0 { format!("{v:.0}") } else { format!("{v:.2}") }
}

pub(crate) fn machine() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|s| s.trim().to_string())
        })
        .unwrap_or_default();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| t.lines().next().map(|l| l.split_whitespace().nth(1).unwrap_or("0").parse::<u64>().unwrap_or(0)))
        .unwrap_or(0);
    format!("{cpus} CPUs ({model}), {} GiB", mem / 1024 / 1024)
}
