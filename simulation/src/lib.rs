//! # ccm-simulation
//!
//! A deterministic, seeded simulation of the core (two replicas of it, each with its provider
//! sidecar) against a model of the API server ([`api`]) and the sim cloud, on virtual time.
//! One seed decides the whole run: the cloud's capabilities, the cluster's events (Nodes
//! joining, going NotReady, instances stopped and terminated, podCIDRs set, Services
//! created, edited and deleted) and the faults (provider errors, throttling with absurd
//! RetryInfo, hangs, slow mutations, reordered, short and lying batch answers, sidecar
//! restarts with a new epoch, API server restarts that compact history, partitions, late
//! answers, replicas killed and restarted).
//!
//! Scripted scenarios ([`Scenario`]) replay, on the same world and checks, the steps that
//! showed a defect from outside: a late Lease renewal then silence, one load balancer's bulk
//! item failing, half-open controller connections.
//!
//! Invariants, checked while it runs (at the API server and at the cloud) and after:
//! - no Node deleted whose instance exists; every Node's providerID names its own instance;
//! - no route or load balancer removed for a live Node or Service;
//! - no load balancer called for by another Service than the one it was made for (a name a
//!   user recorded on their Service steers nothing);
//! - at most one mutation of an object in flight;
//! - no write, to the API or to the cloud, by a replica that does not hold the Lease;
//! - after the faults stop, convergence within [`SETTLE_BOUND`]: every Node initialised,
//!   Nodes of terminated instances deleted, routes equal to the podCIDRs, every LoadBalancer
//!   Service addressed with its ports and hosts equal to its backends, no leaked load balancer;
//! - work queues no deeper than the objects there are, and the heap a seed's world holds
//!   bounded ([`HEAP_BOUND`], and [`STEADY_GROWTH_BOUND`] over the steady state);
//! - then a quiet steady state: no mutation of the cloud, and a bounded rate of API requests.

pub mod api;
pub mod sidecar;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use ccm_core::metrics::Metrics;
use ccm_core::provider::Provider;
use ccm_core::runtime::{Parts, run_with};
use ccm_provider_sim::cloud::Cloud;
use ccm_provider_sim::config::{Address, Config, Fault, FaultCode, InstanceSpec, Lie, RateLimit, State as InstanceState};
use clap::Parser as _;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde_json::{Value, json};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::api::{Key, Link, Model, Net, Who};
use crate::sidecar::{Shared, Sidecar};

/// How long faults and events go on.
pub const CHAOS: Duration = Duration::from_secs(8 * 60);
/// The bound on convergence once the faults stop.
pub const SETTLE_BOUND: Duration = Duration::from_secs(12 * 60);
/// The quiet time after convergence in which nothing may change the cloud.
pub const STEADY: Duration = Duration::from_secs(3 * 60);
/// How soon the world converges again after, at rest, the service controller's leader's
/// sidecar comes back with a new epoch and the cloud's state lost: the next provider probe
/// (10 s) sees the epoch, then an Ensure per load balancer and a route resync.
pub const EPOCH_BOUND: Duration = Duration::from_secs(45);
/// How long after convergence steady state begins: a replica's read timeout (75 s), watch
/// backoff (30 s) and reconcile backoff (60 s) run out first.
pub const STEADY_AFTER: Duration = Duration::from_secs(180);
/// The most API requests per minute of steady state, per Lease the replicas keep (its holder
/// renews it and the others try it every 2 s; watches renewed every minute, Event-free).
pub const STEADY_REQUESTS_PER_MINUTE: u64 = 120;

/// Every kind of fault the schedule draws (as [`Report::faults`] names them).
pub const FAULT_KINDS: &[&str] = &[
    "provider errors",
    "throttling with RetryInfo",
    "account rate limit",
    "hangs",
    "slow mutations",
    "reordered batch answers",
    "short batch answers",
    "every instance said gone",
    "empty listings",
    "sidecar restarts (new epoch)",
    "API server restarts (watch history compacted)",
    "partitions",
    "late answers",
    "replicas killed",
    "API latency",
    "one load balancer's items failing",
    "watches cut, then history compacted",
    "Lease answered late, then silent",
    "providerIDs in the kubelet's form",
    "half-open connections",
    "a Service records another's load balancer name",
    "the cloud answers an address no host can reach",
];

const CLUSTER: &str = "sim";
const NAMESPACE: &str = "default";
const MAX_NODES: usize = 9;
const MAX_SERVICES: usize = 4;
const TAINT: &str = "node.cloudprovider.kubernetes.io/uninitialized";

thread_local! {
    static START: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// Virtual time since the run began.
pub fn elapsed() -> Duration {
    START.with(std::cell::Cell::get).map_or(Duration::ZERO, |s| s.elapsed())
}

// Heap accounting: each seed runs on one thread (a current-thread runtime), so the bytes
// allocated on it and not freed are what its world holds.
#[global_allocator]
static ALLOCATOR: alloc_metrics::MetricAlloc<std::alloc::System> = alloc_metrics::MetricAlloc::new(std::alloc::System);

thread_local! {
    static HEAP_BASE: std::cell::Cell<isize> = const { std::cell::Cell::new(0) };
}

/// The most heap a seed's world may hold at any step: the model, both replicas and their
/// sidecars, for at most 9 Nodes and 4 Services; what grows without bound crosses it.
pub const HEAP_BOUND: i64 = 64 << 20;
/// The most that heap may grow over the steady state, where nothing changes: caches and
/// queues full, only Lease renewals (kept in the model's bounded watch history) and watch
/// renewals go on.
pub const STEADY_GROWTH_BOUND: i64 = 1 << 20;

/// The heap a seed's world holds now, and the most it has held.
struct Heap {
    peak: i64,
}

impl Heap {
    fn now() -> i64 {
        let base = HEAP_BASE.with(std::cell::Cell::get);
        i64::try_from(alloc_metrics::thread_metrics().allocated_bytes - base).unwrap_or(i64::MAX)
    }

    /// Reads it, keeps the peak, and checks the bound.
    fn check(&mut self, model: &Model) -> i64 {
        let now = Self::now();
        if now > self.peak {
            self.peak = now;
            if now > HEAP_BOUND {
                model.violation(format!("the world holds {} MiB of heap (bound {} MiB)", now >> 20, HEAP_BOUND >> 20));
            }
        }
        now
    }
}

/// What one seed did and found.
#[derive(Debug, Clone)]
pub struct Report {
    pub seed: u64,
    /// Broken invariants, with the virtual time of each.
    pub violations: Vec<String>,
    /// How long convergence took after the faults stopped (None: it did not).
    pub converged_after: Option<Duration>,
    /// The schedule: what happened when.
    pub schedule: Vec<String>,
    /// The kinds of fault injected.
    pub faults: BTreeSet<&'static str>,
    /// API requests the replicas made.
    pub requests: u64,
    /// The digest of the observable steps (requests and mutations with their times).
    pub digest: u64,
    /// The most heap the seed's world held (the model, the sidecars and both replicas), bytes.
    pub peak_heap: i64,
    /// How much that heap grew over the steady state, bytes.
    pub steady_growth: i64,
    /// The modes the seed ran and the mode events it had.
    pub modes: BTreeSet<&'static str>,
    /// The controllers some replica ran.
    pub controllers: BTreeSet<String>,
}

/// Every mode the seeded mix runs the core in (as [`Report::modes`] names them): a test
/// fails when one is not exercised ([`Summary::modes`]).
pub const MODE_KINDS: &[&str] = &[
    "one Lease",
    "a Lease per controller",
    "three replicas",
    "node IPAM (RangeAllocator)",
    "node IPAM (CloudAllocator)",
    "node selectors",
    "a selector matching no Node",
    "load balancer repair",
    "load balancers deleted behind the core",
    "load balancer hosts changed behind the core",
    "a declared call rate",
    "tagging",
    "a replica not ready (its sidecar down)",
    "a Node made again under its name",
    "two providers in one cluster",
    "load balancer repair by reads",
    "the provider's state in the cloud (no epoch)",
    "a change of leader at rest",
    "a new epoch that lost the provider's state",
    "a new epoch at rest that lost the provider's state",
    "a zone lost: instances terminated at once",
    "the holder killed while it spent a bound",
];

/// Which node IPAM a seed runs, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Ipam {
    /// The kubelets' (the world's) podCIDRs.
    #[default]
    Off,
    /// `--allocate-node-cidrs` with the range allocator, over a small cluster CIDR: a CIDR
    /// leaked or given twice shows.
    Range,
    /// `--cidr-allocator-type=CloudAllocator`: the cloud's pod CIDRs.
    Cloud,
}

/// The modes of one seed, drawn from a stream of their own.
#[derive(Debug, Clone)]
pub struct Modes {
    pub per_controller: bool,
    pub replicas: usize,
    pub ipam: Ipam,
    pub selectors: bool,
    pub repair: bool,
    pub declared_rate: Option<(f64, u32)>,
    pub tagging: bool,
    /// A second provider ("metal") beside the sim: its own cloud, its Nodes (found by its
    /// label or by asking both), and Services of its `loadBalancerClass`.
    pub two_providers: bool,
    /// With repair: by one read per load balancer over `--load-balancer-repair-period` (the
    /// sweep only at start), under the bound kept on the Lease across tenures.
    pub repair_reads: bool,
    /// The sidecars advertise no epoch: their state is the shared cloud's.
    pub no_epoch: bool,
}

impl Modes {
    /// The seed's modes; seeds of the scripted scenarios run the classic one (one Lease, two
    /// replicas, nothing else).
    fn draw(rng: &mut StdRng, scenario: bool) -> Self {
        let classic = Self {
            per_controller: false,
            replicas: 2,
            ipam: Ipam::Off,
            selectors: false,
            repair: false,
            declared_rate: None,
            tagging: false,
            two_providers: false,
            repair_reads: false,
            no_epoch: false,
        };
        if scenario {
            return classic;
        }
        let per_controller = rng.random_bool(0.4);
        let replicas = if per_controller && rng.random_bool(0.5) { 3 } else { 2 };
        let ipam = match rng.random_range(0..10) {
            0..=2 => Ipam::Range,
            3 => Ipam::Cloud,
            _ => Ipam::Off,
        };
        Self {
            per_controller,
            replicas,
            ipam,
            selectors: rng.random_bool(0.3),
            repair: rng.random_bool(0.3),
            declared_rate: rng.random_bool(0.25).then_some((2.0, 4)),
            tagging: rng.random_bool(0.3),
            // Drawn from a stream of its own ([`simulate`]).
            two_providers: false,
            repair_reads: false,
            no_epoch: false,
        }
    }

    /// The names of the modes, for [`Report::modes`].
    fn names(&self) -> Vec<&'static str> {
        let mut names = vec![if self.per_controller { "a Lease per controller" } else { "one Lease" }];
        if self.replicas == 3 {
            names.push("three replicas");
        }
        match self.ipam {
            Ipam::Range => names.push("node IPAM (RangeAllocator)"),
            Ipam::Cloud => names.push("node IPAM (CloudAllocator)"),
            Ipam::Off => {}
        }
        for (on, name) in [
            (self.selectors, "node selectors"),
            (self.repair, "load balancer repair"),
            (self.declared_rate.is_some(), "a declared call rate"),
            (self.tagging, "tagging"),
            (self.two_providers, "two providers in one cluster"),
            (self.repair && self.repair_reads, "load balancer repair by reads"),
            (self.no_epoch, "the provider's state in the cloud (no epoch)"),
        ] {
            if on {
                names.push(name);
            }
        }
        names
    }
}

/// How soon a controller held by a replica that is not ready goes to a ready one (with a
/// Lease per controller): the ready one live for a lease duration, the hand over at the next
/// retry period, and a lease duration for the Lease to be taken.
const SERVED_BOUND: Duration = Duration::from_secs(75);

/// The most Node deletions per window the simulation's core may make
/// (`--max-node-deletions`, checked over every replica at the API server).
const MAX_NODE_DELETIONS: usize = 3;
/// Its `--node-deletion-window`.
const NODE_DELETION_WINDOW: Duration = Duration::from_secs(60);
/// The cluster CIDR of node IPAM's range allocator: 16 /24s for at most a dozen live Nodes.
const IPAM_CLUSTER_CIDR: &str = "10.244.0.0/20";
/// The cloud's pod CIDR pool (CloudAllocator), inside the cluster CIDR the routes are for.
const CLOUD_POD_CIDRS: &str = "10.244.128.0/17";
/// The label node selectors select on, and its values.
const POOL: &str = "pool";
/// `--max-load-balancer-repairs`, and the repair period of the seeds that repair by reads.
const MAX_REPAIRS: usize = 1;
const REPAIR_PERIOD: Duration = Duration::from_secs(120);
/// The second provider's name (and providerID scheme), and the `loadBalancerClass` it serves.
const METAL: &str = "metal";
const METAL_CLASS: &str = "metal.example/lb";
/// The second provider's pod CIDR pool (CloudAllocator).
const METAL_POD_CIDRS: &str = "10.244.64.0/18";

/// The core's flags in the simulation: the defaults where they matter (the Lease timing, and
/// the resync periods, 12 h for routes and 1 h for load balancers, longer than a run: every
/// change must arrive by its event, as in production); the deletion window and backoffs
/// shorter, so that a run converges in minutes.
fn core_args(modes: &Modes) -> Vec<String> {
    let mut args: Vec<String> = [
        "cloud-controller-manager",
        "--provider-endpoint=unix:///run/sim/provider.sock",
        "--secure-port=0",
        "--cluster-name=sim",
        "--cluster-cidr=10.244.0.0/16",
        "--leader-elect-lease-duration=15s",
        "--leader-elect-renew-deadline=10s",
        "--leader-elect-retry-period=2s",
        "--node-monitor-period=5s",
        "--provider-call-timeout=10s",
        "--provider-max-concurrency=8",
        "--provider-mutation-timeout=5m",
        "--provider-max-retry-after=60s",
        "--reconcile-backoff-base=1s",
        "--reconcile-backoff-max=60s",
        "--node-deletion-window=1m",
        "--max-node-deletions=3",
        // The bound is the count alone (a share of at most nine Nodes would be one), so that
        // a zone lost spends it and a holder that forgets what was spent shows.
        "--max-node-deletion-share=1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if modes.per_controller {
        args.push("--leader-elect-per-controller".into());
    }
    if modes.two_providers {
        args.retain(|a| !a.starts_with("--provider-endpoint="));
        args.extend([
            "--provider-endpoint=sim=unix:///run/sim/provider.sock".into(),
            format!("--provider-endpoint={METAL}=unix:///run/sim/{METAL}.sock"),
        ]);
    }
    match modes.ipam {
        Ipam::Off => {}
        Ipam::Range => {
            args.retain(|a| !a.starts_with("--cluster-cidr="));
            args.extend([
                format!("--cluster-cidr={IPAM_CLUSTER_CIDR}"),
                "--allocate-node-cidrs=true".into(),
                "--node-cidr-mask-size=24".into(),
            ]);
        }
        Ipam::Cloud => args.extend(["--allocate-node-cidrs=true".into(), "--cidr-allocator-type=CloudAllocator".into()]),
    }
    if modes.repair && modes.repair_reads {
        // The sweep only at start; a read of each load balancer every two minutes, at most
        // one made again in any two minutes (a cleanup of two spends it) over every tenure ([`Model::repair_bound`]).
        args.extend([
            "--load-balancer-resync-period=0s".into(),
            format!("--load-balancer-repair-period={}s", REPAIR_PERIOD.as_secs()),
            format!("--max-load-balancer-repairs={MAX_REPAIRS}"),
        ]);
    } else if modes.repair {
        // Sweeps (which repair) within a run; at most one made again per sweep.
        args.extend(["--load-balancer-resync-period=2m".into(), format!("--max-load-balancer-repairs={MAX_REPAIRS}")]);
    }
    if modes.tagging {
        args.extend(["--controllers=*,tagging".into(), "--instance-tags=team=sim".into()]);
    }
    args
}

struct Replica {
    slot: usize,
    incarnation: u32,
    identity: String,
    net: Arc<Net>,
    /// The Lease client's own connection (the controllers' is `net`).
    lease_net: Arc<Net>,
    sidecar: Sidecar,
    /// The second provider's sidecar, with two providers.
    metal_sidecar: Option<Sidecar>,
    epochs: u32,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
    metrics: Metrics,
    /// When it started.
    started: Instant,
}

impl Replica {
    /// Its sidecars die with it.
    fn stop_sidecars(&self) {
        self.sidecar.stop();
        if let Some(metal) = &self.metal_sidecar {
            metal.stop();
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Life {
    Running,
    Stopped,
    Terminated,
}

struct NodeRec {
    name: String,
    instance: String,
    /// Whether its instance is the second provider's.
    metal: bool,
    /// Whether its Node names its provider by label (else the core asks the providers).
    labelled: bool,
    cidr: Option<String>,
    life: Life,
    ready: bool,
    /// Its `pool` label (node selectors select on it).
    pool: &'static str,
}

struct ServiceRec {
    name: String,
    ports: Vec<i32>,
    /// Its `loadBalancerSourceRanges` (a user's access restriction).
    ranges: Vec<String>,
    deleted: bool,
    /// Whether it selects its Nodes (`pool=a`).
    selects: bool,
    /// Whether it is of the second provider's `loadBalancerClass`.
    metal: bool,
}

/// A fault that ends at a time.
enum Active {
    Provider(Fault),
    RateLimit,
    Partition(usize),
    SlowAnswers(usize),
    /// The Lease's answers come late; then its connection goes silent for the duration.
    LeaseLate(usize, Duration),
    LeaseSilent(usize),
    HalfOpen(usize),
    WatchesCut(usize),
    /// An instance's addresses (of the second provider's cloud, if so), put back after the
    /// cloud answered others.
    Addresses(bool, String, Vec<Address>),
    /// A replica's sidecar is down (its /readyz fails): it comes back with a new epoch.
    SidecarDown(usize),
    /// The replica that holds the named controller's Lease (or the one Lease) is killed then,
    /// in the middle of what it was spending a bound on.
    KillHolderOf(&'static str),
}

struct World {
    rng: StdRng,
    /// The cloud's answers of addresses no host can reach: drawn from a stream of their own,
    /// so that adding them left every seed's schedule as it was.
    address_rng: StdRng,
    model: Arc<Model>,
    cloud: Arc<Cloud>,
    /// The second provider's cloud, with two providers, and the stream its choices are drawn
    /// from (so that adding it left every other seed's draws as they were).
    metal: Option<Arc<Cloud>>,
    provider_rng: StdRng,
    shared: Shared,
    nodes: Vec<NodeRec>,
    services: Vec<ServiceRec>,
    next_node: usize,
    next_service: usize,
    replicas: Vec<Option<Replica>>,
    /// When a stopped replica slot comes back.
    restart_at: Vec<Option<Instant>>,
    incarnations: Vec<u32>,
    active: Vec<(Instant, Active)>,
    schedule: Vec<String>,
    faults: BTreeSet<&'static str>,
    /// The seed's modes, and the stream their events are drawn from (so that adding modes
    /// left the classic schedule's draws as they were).
    modes: Modes,
    mode_rng: StdRng,
    /// The modes and mode events the run exercised.
    exercised: BTreeSet<&'static str>,
    /// The controllers some replica ran (their work queues took keys).
    controllers: BTreeSet<String>,
    /// Since when each slot's sidecar is down (the replica not ready).
    sidecar_down: Vec<Option<Instant>>,
    /// Since when no fault but sidecars down is active.
    undisturbed_since: Instant,
}

fn node_object(name: &str, cidr: Option<&str>) -> Value {
    let now = ccm_core::clock::now().to_string();
    let mut spec = json!({ "taints": [{ "key": TAINT, "value": "true", "effect": "NoSchedule" }] });
    if let Some(cidr) = cidr {
        spec["podCIDR"] = json!(cidr);
        spec["podCIDRs"] = json!([cidr]);
    }
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": name, "labels": { "kubernetes.io/hostname": name } },
        "spec": spec,
        "status": {
            "conditions": [{ "type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status", "lastHeartbeatTime": now, "lastTransitionTime": now }],
            "addresses": [{ "type": "Hostname", "address": name }]
        }
    })
}

fn service_object(name: &str, ports: &[i32]) -> Value {
    let ports: Vec<Value> = ports
        .iter()
        .map(|p| json!({ "name": format!("p{p}"), "port": p, "protocol": "TCP", "targetPort": p, "nodePort": 30000 + p }))
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": { "name": name, "namespace": NAMESPACE },
        "spec": { "type": "LoadBalancer", "ports": ports, "selector": { "app": name }, "externalTrafficPolicy": "Cluster" },
        "status": { "loadBalancer": {} }
    })
}

impl World {
    fn log(&mut self, what: String) {
        tracing::info!("world: {what}");
        self.schedule.push(format!("t={:.1}s {what}", elapsed().as_secs_f64()));
    }

    fn start_replica(&mut self, slot: usize) {
        self.incarnations[slot] += 1;
        let incarnation = self.incarnations[slot];
        let identity = format!("replica-{slot}-{incarnation}");
        let (net, lease_net) = (Arc::new(Net::default()), Arc::new(Net::default()));
        let sidecar = Sidecar::start(&self.cloud, &self.model, &identity, &format!("epoch-{slot}-{incarnation}-0"), &self.shared);
        let link = Link { model: self.model.clone(), who: Who::Replica(identity.clone()), net: net.clone() };
        let lease_link = Link { net: lease_net.clone(), ..link.clone() };
        let options = match ccm_core::options::Options::try_parse_from(core_args(&self.modes)) {
            Ok(options) => options,
            Err(e) => panic!("the simulation's core flags: {e}"),
        };
        // The clients' timeouts and the provider's limits are the core's own, from its flags,
        // as `run_until` sets them.
        let base = kube::Config::new(http::Uri::from_static("http://api.sim"));
        let controllers = ccm_core::runtime::with_timeouts(base, options.kube_api_read_timeout);
        let lease = ccm_core::leader::lease_config(&controllers, options.leader_elect_renew_deadline);
        let metrics = Metrics::new();
        let (timeout, concurrency) = (options.provider_call_timeout, options.provider_max_concurrency);
        let client = |sidecar: &Sidecar, name: &str| {
            Provider::over(sidecar.channel(), &format!("{name}://in-process"), timeout, concurrency, metrics.clone())
                .with_max_retry_after(options.provider_max_retry_after)
                .with_mutation_timeout(options.provider_mutation_timeout)
        };
        let mut providers = vec![client(&sidecar, "sim")];
        let metal_sidecar = self.metal.as_ref().map(|metal| {
            Sidecar::start(metal, &self.model, &identity, &format!("{METAL}-epoch-{slot}-{incarnation}"), &self.shared)
        });
        if let Some(metal) = &metal_sidecar {
            providers = vec![client(&sidecar, "sim").named("sim"), client(metal, METAL).named(METAL)];
        }
        let parts = Parts {
            client: link.clone().client(&controllers),
            lease_client: lease_link.client(&lease),
            providers,
            metrics: metrics.clone(),
            identity: Some(identity.clone()),
            config: None,
        };
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        let task = tokio::spawn(async move { run_with(options, parts, stop.cancelled_owned()).await });
        self.log(format!("{identity} starts"));
        self.replicas[slot] = Some(Replica {
            slot,
            incarnation,
            identity,
            net,
            lease_net,
            sidecar,
            metal_sidecar,
            epochs: 0,
            shutdown,
            task,
            metrics,
            started: Instant::now(),
        });
        self.sidecar_down[slot] = None;
    }

    /// Stops a replica as a kill does: cut from the API server and the cloud at once (its
    /// sidecar dies with its calls in flight); what is left of it then stops.
    fn kill_replica(&mut self, slot: usize, back_in: Duration) {
        if let Some(r) = self.replicas[slot].take() {
            r.net.down.store(true, std::sync::atomic::Ordering::Relaxed);
            r.lease_net.down.store(true, std::sync::atomic::Ordering::Relaxed);
            r.stop_sidecars();
            r.shutdown.cancel();
            self.model.wake_watches();
            self.log(format!(
                "{} killed (slot {} back in {}s, incarnation {})",
                r.identity,
                r.slot,
                back_in.as_secs(),
                r.incarnation
            ));
        }
        self.restart_at[slot] = Some(Instant::now() + back_in);
    }

    /// Restarts replicas whose process ended (a lost Lease ends it: the kubelet restarts it)
    /// or whose time to come back has come.
    fn tend_replicas(&mut self) {
        for slot in 0..self.replicas.len() {
            let ended = self.replicas[slot].as_ref().is_some_and(|r| r.task.is_finished());
            if ended && let Some(r) = self.replicas[slot].take() {
                r.net.down.store(true, std::sync::atomic::Ordering::Relaxed);
                r.lease_net.down.store(true, std::sync::atomic::Ordering::Relaxed);
                r.stop_sidecars();
                self.log(format!("{} exited; restarting", r.identity));
                self.restart_at[slot] = Some(Instant::now() + Duration::from_secs(1));
            }
            if self.replicas[slot].is_none() && self.restart_at[slot].is_some_and(|t| Instant::now() >= t) {
                self.restart_at[slot] = None;
                self.start_replica(slot);
            }
        }
    }

    fn add_node(&mut self) {
        self.add_node_in(None, None);
    }

    fn zone(k: usize) -> &'static str {
        if k.is_multiple_of(2) { "sim-region-1a" } else { "sim-region-1b" }
    }

    /// The cloud of a Node's instance (or of a Service's load balancer).
    fn cloud_of(&self, metal: bool) -> &Arc<Cloud> {
        match &self.metal {
            Some(cloud) if metal => cloud,
            _ => &self.cloud,
        }
    }

    /// The address of an instance: `10.0.x.y` in the sim's cloud, `10.1.x.y` in the second.
    fn own_address(instance: &str) -> String {
        let (net, k) = match instance.strip_prefix("m-") {
            Some(k) => (1, k),
            None => (0, instance.trim_start_matches("i-")),
        };
        let k: usize = k.parse().unwrap_or(0);
        format!("10.{net}.{}.{}", k / 250, k % 250 + 1)
    }

    /// The Node object of node record `i`, as its kubelet registers it.
    fn node_json(&self, i: usize) -> Value {
        let rec = &self.nodes[i];
        let mut node = node_object(&rec.name, rec.cidr.as_deref());
        node["metadata"]["labels"][POOL] = json!(rec.pool);
        if rec.labelled {
            node["metadata"]["labels"][ccm_core::wellknown::LABEL_PROVIDER] = json!(METAL);
        }
        node
    }

    /// A Node joins, in `zone` (by default, its number's), of the second provider's cloud when
    /// `metal` says so (by default, drawn when there is one).
    fn add_node_in(&mut self, zone: Option<&'static str>, metal: Option<bool>) {
        self.next_node += 1;
        let k = self.next_node;
        let name = format!("node-{k}");
        let metal = match metal {
            Some(metal) => metal && self.metal.is_some(),
            None => self.metal.is_some() && self.provider_rng.random_bool(0.35),
        };
        let labelled = metal && self.provider_rng.random_bool(0.5);
        let instance = if metal { format!("m-{k:04}") } else { format!("i-{k:04}") };
        let zone = zone.unwrap_or(Self::zone(k));
        let spec = InstanceSpec {
            id: instance.clone(),
            name: name.clone(),
            zone: zone.into(),
            addresses: vec![Address { kind: "InternalIP".into(), address: Self::own_address(&instance) }],
            ..Default::default()
        };
        if let Err(e) = self.cloud_of(metal).add_instance(spec, Duration::ZERO) {
            self.model.violation(format!("the world could not add instance {instance}: {e}"));
            return;
        }
        let cidr = self.rng.random_bool(0.7).then(|| format!("10.244.{k}.0/24"));
        // With node IPAM the core gives the podCIDRs.
        let cidr = cidr.filter(|_| self.modes.ipam == Ipam::Off);
        let pool = if self.modes.selectors && self.mode_rng.random_bool(0.5) { "b" } else { "a" };
        self.nodes.push(NodeRec {
            name: name.clone(),
            instance: instance.clone(),
            metal,
            labelled,
            cidr: cidr.clone(),
            life: Life::Running,
            ready: true,
            pool,
        });
        let mut node = self.node_json(self.nodes.len() - 1);
        // Some kubelets set a valid providerID of their own, in another form than the cloud's
        // (the zone they believed): the Node keeps it and is initialised all the same.
        if self.rng.random_bool(0.25) {
            let scheme = self.cloud_of(metal).scheme().to_string();
            node["spec"]["providerID"] = json!(format!("{scheme}://zone-the-kubelet-said/{instance}"));
            self.faults.insert("providerIDs in the kubelet's form");
        }
        self.model.create(&Key::node(&name), node);
        let of = if metal { format!(", of {METAL}{}", if labelled { " by label" } else { "" }) } else { String::new() };
        self.log(format!("node {name} joins (instance {instance}{of}, podCIDR {cidr:?})"));
    }

    fn set_ready(&mut self, i: usize, ready: bool) {
        let name = self.nodes[i].name.clone();
        self.nodes[i].ready = ready;
        let now = ccm_core::clock::now().to_string();
        self.model.update(&Key::node(&name), |node| {
            let status = if ready { "True" } else { "Unknown" };
            node["status"]["conditions"] =
                json!([{ "type": "Ready", "status": status, "reason": "Sim", "message": "", "lastHeartbeatTime": now, "lastTransitionTime": now }]);
        });
    }

    fn live_nodes(&self) -> Vec<usize> {
        (0..self.nodes.len()).filter(|&i| self.nodes[i].life != Life::Terminated).collect()
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> Option<T> {
        (!from.is_empty()).then(|| from[self.rng.random_range(0..from.len())])
    }

    fn provider_fault(&mut self, kind: &'static str, fault: Fault, lasts: Duration) {
        self.faults.insert(kind);
        self.log(format!("fault {kind} for {}s: {fault:?}", lasts.as_secs()));
        self.active.push((Instant::now() + lasts, Active::Provider(fault)));
        self.apply_faults();
    }

    fn apply_faults(&self) {
        let faults = self
            .active
            .iter()
            .filter_map(|(_, a)| match a {
                Active::Provider(f) => Some(f.clone()),
                _ => None,
            })
            .collect::<Vec<Fault>>();
        // The second provider's cloud has the same trouble.
        if let Some(metal) = &self.metal {
            metal.set_faults(faults.clone());
        }
        self.cloud.set_faults(faults);
    }

    fn expire_faults(&mut self, all: bool) {
        let now = Instant::now();
        let (ended, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.active).into_iter().partition(|(t, _)| all || *t <= now);
        self.active = kept;
        for (_, fault) in ended {
            match fault {
                Active::Provider(_) => {}
                Active::RateLimit => self.cloud.set_rate_limit(None),
                Active::Partition(slot) => {
                    if let Some(r) = &self.replicas[slot] {
                        r.net.down.store(false, std::sync::atomic::Ordering::Relaxed);
                        r.lease_net.down.store(false, std::sync::atomic::Ordering::Relaxed);
                    }
                }
                Active::LeaseLate(slot, silent) => {
                    if let Some(r) = &self.replicas[slot] {
                        r.lease_net.write_answer_delay_ms.store(0, std::sync::atomic::Ordering::Relaxed);
                        r.lease_net.down.store(true, std::sync::atomic::Ordering::Relaxed);
                        self.log(format!("{}'s Lease connection silent for {}s", r.identity, silent.as_secs()));
                        self.active.push((now + silent, Active::LeaseSilent(slot)));
                    }
                }
                Active::HalfOpen(slot) => {
                    if let Some(r) = &self.replicas[slot] {
                        r.net.half_open.store(false, std::sync::atomic::Ordering::Relaxed);
                    }
                }
                Active::SidecarDown(slot) => {
                    self.sidecar_down[slot] = None;
                    if let Some(r) = self.replicas[slot].as_mut() {
                        r.epochs += 1;
                        let epoch = format!("epoch-{}-{}-{}", r.slot, r.incarnation, r.epochs);
                        r.sidecar.restart(&self.cloud, &self.model, &r.identity, &epoch, &self.shared);
                        let identity = r.identity.clone();
                        self.log(format!("{identity}'s sidecar is back as {epoch}"));
                    }
                }
                Active::Addresses(metal, instance, addresses) => {
                    let _ = self.cloud_of(metal).set_addresses(&instance, addresses);
                }
                // Not when the faults end: the world is then left to converge.
                Active::KillHolderOf(controller) if !all => {
                    if let Some(slot) = self.holder_slot(&self.model.clone(), controller) {
                        self.exercised.insert("the holder killed while it spent a bound");
                        self.log(format!("the holder of {controller} killed mid-window"));
                        let back_in = Duration::from_secs(self.mode_rng.random_range(1..=10));
                        self.kill_replica(slot, back_in);
                    }
                }
                Active::KillHolderOf(_) => {}
                Active::LeaseSilent(slot) => {
                    if let Some(r) = &self.replicas[slot] {
                        r.lease_net.down.store(false, std::sync::atomic::Ordering::Relaxed);
                    }
                }
                Active::WatchesCut(slot) => {
                    if let Some(r) = &self.replicas[slot] {
                        r.net.watches_down.store(false, std::sync::atomic::Ordering::Relaxed);
                    }
                    self.model.compact();
                    self.log("history compacted".into());
                }
                Active::SlowAnswers(slot) => {
                    if let Some(r) = &self.replicas[slot] {
                        r.net.answer_delay_ms.store(0, std::sync::atomic::Ordering::Relaxed);
                        r.lease_net.answer_delay_ms.store(0, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
        }
        self.apply_faults();
    }

    /// The cloud answers an instance's address that no other host can reach (its metadata
    /// service's link-local address, loopback, IPv6 link-local) for a while: the core refuses
    /// the answer, and the Node keeps the address it had ([`World::check_identities`]).
    fn unreachable_address(&mut self) {
        let live: Vec<usize> = (0..self.nodes.len()).filter(|&i| self.nodes[i].life != Life::Terminated).collect();
        let Some(i) = (!live.is_empty()).then(|| live[self.address_rng.random_range(0..live.len())]) else { return };
        let lasts = Duration::from_secs(self.address_rng.random_range(5..=90));
        let (instance, metal) = (self.nodes[i].instance.clone(), self.nodes[i].metal);
        let own = vec![Address { kind: "InternalIP".into(), address: Self::own_address(&instance) }];
        let bad = ["169.254.169.254", "127.0.0.1", "fe80::1"][self.address_rng.random_range(0..3)];
        let answered = vec![Address { kind: "InternalIP".into(), address: bad.into() }];
        if self.cloud_of(metal).set_addresses(&instance, answered).is_ok() {
            self.faults.insert("the cloud answers an address no host can reach");
            self.log(format!("instance {instance} answered with address {bad} for {}s", lasts.as_secs()));
            self.active.push((Instant::now() + lasts, Active::Addresses(metal, instance, own)));
        }
    }

    /// An event of the seed's modes (drawn from their own stream): Nodes relabelled out of a
    /// selector (all of them, now and then), load balancers deleted or changed in the cloud
    /// behind the core's back, a Node deleted and made again under its name, a replica whose
    /// sidecar is down for a while (not ready).
    fn mode_event(&mut self) {
        let lasts = Duration::from_secs(self.mode_rng.random_range(10..=150));
        match self.mode_rng.random_range(0..10) {
            0..=1 if self.modes.selectors => {
                let live = self.live_nodes();
                if self.mode_rng.random_bool(0.3) {
                    // Every Node leaves pool a: a selector that matches none.
                    for i in live {
                        self.relabel(i, "b");
                    }
                    self.exercised.insert("a selector matching no Node");
                    self.log("every Node relabelled pool=b: the selector pool=a matches none".into());
                } else if !live.is_empty() {
                    let i = live[self.mode_rng.random_range(0..live.len())];
                    let pool = if self.nodes[i].pool == "a" { "b" } else { "a" };
                    self.relabel(i, pool);
                    self.log(format!("node {} relabelled pool={pool}", self.nodes[i].name));
                }
            }
            2..=3 if self.modes.repair => {
                let live: Vec<usize> = (0..self.services.len()).filter(|&i| !self.services[i].deleted).collect();
                if live.is_empty() {
                    return;
                }
                let s = &self.services[live[self.mode_rng.random_range(0..live.len())]];
                let (name, cloud) = (s.name.clone(), self.cloud_of(s.metal).clone());
                // Where repairs go by reads, now and then a cleanup deletes every load balancer
                // at once: more than the repair bound, across changes of leader.
                if self.modes.repair_reads && self.provider_rng.random_bool(0.5) {
                    let gone: Vec<String> = live
                        .iter()
                        .filter_map(|&i| {
                            let s = &self.services[i];
                            let lb = self.load_balancer_name(&s.name)?;
                            self.cloud_of(s.metal).remove_load_balancer(&lb).is_ok().then(|| s.name.clone())
                        })
                        .collect();
                    if !gone.is_empty() {
                        self.exercised.insert("load balancers deleted behind the core");
                        self.log(format!("the load balancers of {gone:?} deleted in the cloud at once behind the core"));
                        // The leader is killed while it repairs: its successor must count
                        // what it spent.
                        let at = Duration::from_secs(self.mode_rng.random_range(5..=40));
                        self.active.push((Instant::now() + at, Active::KillHolderOf(ccm_core::controllers::service::NAME)));
                    }
                    return;
                }
                let Some(lb) = self.load_balancer_name(&name) else { return };
                if self.mode_rng.random_bool(0.6) {
                    if cloud.remove_load_balancer(&lb).is_ok() {
                        self.exercised.insert("load balancers deleted behind the core");
                        self.log(format!("load balancer {lb} of {name} deleted in the cloud behind the core"));
                    }
                } else if cloud.set_load_balancer_hosts_by_hand(&lb, Vec::new()).is_ok() {
                    self.exercised.insert("load balancer hosts changed behind the core");
                    self.log(format!("load balancer {lb} of {name} given no hosts by hand in the cloud"));
                }
            }
            4..=5 => {
                let live: Vec<usize> = self.live_nodes().into_iter().filter(|&i| self.nodes[i].life == Life::Running).collect();
                if live.is_empty() {
                    return;
                }
                let i = live[self.mode_rng.random_range(0..live.len())];
                let name = self.nodes[i].name.clone();
                self.model.delete(&Key::node(&name));
                self.model.create(&Key::node(&name), self.node_json(i));
                self.nodes[i].ready = true;
                self.exercised.insert("a Node made again under its name");
                self.log(format!("node {name} deleted and made again under its name"));
            }
            6..=7 => {
                let slot = self.mode_rng.random_range(0..self.replicas.len());
                if self.active.iter().any(|(_, a)| matches!(a, Active::SidecarDown(s) if *s == slot)) {
                    return;
                }
                self.take_sidecar_down(slot, lasts);
            }
            8..=9 => {
                // A zone is lost: several instances terminated at once, more than the deletion
                // window allows, and the lifecycle controller's holder killed while it works
                // through them: its successor must count what it spent.
                let running: Vec<usize> =
                    self.live_nodes().into_iter().filter(|&i| self.nodes[i].life == Life::Running).collect();
                let lost = self.mode_rng.random_range(4..=5).min(running.len().saturating_sub(1));
                if lost < 2 {
                    return;
                }
                let mut gone = Vec::new();
                for &i in running.iter().take(lost) {
                    let id = self.nodes[i].instance.clone();
                    let _ = self.cloud_of(self.nodes[i].metal).set_instance_state(&id, InstanceState::Terminated);
                    self.nodes[i].life = Life::Terminated;
                    self.set_ready(i, false);
                    gone.push(self.nodes[i].name.clone());
                }
                self.exercised.insert("a zone lost: instances terminated at once");
                self.log(format!("a zone lost: the instances of {gone:?} terminated at once"));
                let at = Duration::from_secs(self.mode_rng.random_range(5..=40));
                self.active.push((Instant::now() + at, Active::KillHolderOf(ccm_core::controllers::node_lifecycle::NAME)));
            }
            _ => {}
        }
    }

    /// Restarts the sidecar of the replica in `slot` with a new epoch (losing state as
    /// [`Self::lose_state_with_epoch`] says); false when the slot is empty.
    fn restart_sidecar(&mut self, slot: usize) -> bool {
        let Some(r) = self.replicas[slot].as_mut() else { return false };
        r.epochs += 1;
        let epoch = format!("epoch-{}-{}-{}", r.slot, r.incarnation, r.epochs);
        r.sidecar.restart(&self.cloud, &self.model, &r.identity, &epoch, &self.shared);
        self.log(format!("sidecar of replica slot {slot} restarts as {epoch}"));
        self.lose_state_with_epoch(slot);
        true
    }

    /// The service controller's leader's sidecar restarts at rest with its state lost: the
    /// world must converge again within [`EPOCH_BOUND`], with nothing else going on.
    async fn epoch_lost_at_rest(&mut self, model: &Model) {
        let Some(slot) = self.service_leader_slot(model) else { return };
        if !self.restart_sidecar(slot) {
            return;
        }
        self.exercised.insert("a new epoch at rest that lost the provider's state");
        let lost = Instant::now();
        while lost.elapsed() < EPOCH_BOUND {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if self.unconverged().is_none() {
                self.log(format!("converged {}s after a new epoch lost the cloud's state", lost.elapsed().as_secs()));
                return;
            }
        }
        let why = self.unconverged().unwrap_or_default();
        model.violation(format!(
            "not converged {}s after the service controller's leader's sidecar came back with a new epoch and the cloud's state lost: {why}",
            EPOCH_BOUND.as_secs()
        ));
    }

    /// A new epoch says the provider's state may be lost: the sidecar of the replica that
    /// leads the service (route) controller comes back with every load balancer (route) of
    /// the cluster gone from the cloud, which only the new epoch tells the core. (Other
    /// replicas' sidecars share the cloud: their restart loses nothing.) Where sidecars
    /// advertise no epoch the state is the cloud's and survives.
    fn lose_state_with_epoch(&mut self, slot: usize) {
        let Some(identity) = self.replicas[slot].as_ref().map(|r| r.identity.clone()) else { return };
        if self.modes.no_epoch {
            return;
        }
        if self.model.leads_for(&identity, ccm_core::controllers::service::NAME) {
            let lbs: Vec<String> = self
                .cloud
                .load_balancers(CLUSTER)
                .into_iter()
                .filter_map(|lb| self.cloud.remove_load_balancer(&lb.load_balancer_name).is_ok().then_some(lb.name))
                .collect();
            if !lbs.is_empty() {
                self.exercised.insert("a new epoch that lost the provider's state");
                self.log(format!("the restart lost the cloud's load balancers of {lbs:?}"));
            }
        }
        if self.model.leads_for(&identity, ccm_core::controllers::route::NAME) {
            let mut lost = 0;
            for table in self.cloud.route_tables() {
                for route in self.cloud.routes(CLUSTER, &table.id).unwrap_or_default() {
                    lost += usize::from(self.cloud.delete_route(CLUSTER, &table.id, &route.name).is_ok());
                }
            }
            if lost > 0 {
                self.exercised.insert("a new epoch that lost the provider's state");
                self.log(format!("the restart lost the cloud's {lost} routes"));
            }
        }
    }

    /// Slot `slot`'s sidecar goes down for `lasts` (the replica is not ready), then comes back
    /// with a new epoch.
    fn take_sidecar_down(&mut self, slot: usize, lasts: Duration) {
        if let Some(r) = &self.replicas[slot] {
            r.sidecar.stop();
            self.sidecar_down[slot] = Some(Instant::now());
            self.exercised.insert("a replica not ready (its sidecar down)");
            self.log(format!("{}'s sidecar down for {}s (the replica is not ready)", r.identity, lasts.as_secs()));
            self.active.push((Instant::now() + lasts, Active::SidecarDown(slot)));
        }
    }

    /// The slot of the running replica of `identity`.
    /// The slot of the replica that leads the service controller now.
    fn service_leader_slot(&self, model: &Model) -> Option<usize> {
        self.holder_slot(model, ccm_core::controllers::service::NAME)
    }

    /// The slot of the replica that leads `controller` now (or holds the one Lease).
    fn holder_slot(&self, model: &Model, controller: &str) -> Option<usize> {
        let holders = model.holders();
        let leader = holders.get(controller).or_else(|| holders.get("*"))?;
        self.slot_of(leader)
    }

    fn slot_of(&self, identity: &str) -> Option<usize> {
        (0..self.replicas.len()).find(|&s| self.replicas[s].as_ref().is_some_and(|r| r.identity == identity))
    }

    /// The calls of every sidecar together stayed within the rate they declared: in any 30 s,
    /// at most the rate's calls, its burst, and the calls each replica may have had in flight
    /// (they are counted when they end, so that a hang's end bunches them).
    fn check_call_rate(&self) {
        let Some((per_second, burst)) = self.modes.declared_rate else { return };
        const WINDOW: Duration = Duration::from_secs(30);
        let all = self.shared.calls.lock().unwrap_or_else(|p| p.into_inner()).clone();
        // Each provider's budget is its own.
        for (provider, mut calls) in all {
            calls.sort();
            let bound = (per_second * WINDOW.as_secs_f64()) as usize + burst as usize + 8 * self.replicas.len();
            let mut start = 0;
            for end in 0..calls.len() {
                while calls[end].saturating_sub(calls[start]) >= WINDOW {
                    start += 1;
                }
                if end + 1 - start > bound {
                    self.model.violation(format!(
                        "{} calls reached {provider}'s cloud in the 30 s before t={:.1}s, summed over every sidecar (declared {per_second}/s, burst {burst}: bound {bound})",
                        end + 1 - start,
                        calls[end].as_secs_f64()
                    ));
                    break;
                }
            }
        }
    }

    fn relabel(&mut self, i: usize, pool: &'static str) {
        self.nodes[i].pool = pool;
        let name = self.nodes[i].name.clone();
        self.model.update(&Key::node(&name), |n| n["metadata"]["labels"][POOL] = json!(pool));
    }

    /// One step of the schedule: a cluster event or a fault, chosen by the seed.
    fn act(&mut self) {
        const METHODS: &[&str] = &[
            "*",
            "EnsureLoadBalancer",
            "UpdateLoadBalancerHosts",
            "BatchUpdateLoadBalancerHosts",
            "CreateRoute",
            "ApplyRoutes",
            "BatchGetInstanceMetadata",
            "GetInstanceMetadata",
            "ListRoutes",
            "EnsureLoadBalancerDeleted",
        ];
        let lasts = Duration::from_secs(self.rng.random_range(5..=90));
        if self.address_rng.random_bool(3.0 / 116.0) {
            self.unreachable_address();
        }
        if self.mode_rng.random_bool(0.15) {
            self.mode_event();
        }
        let roll = self.rng.random_range(0..113);
        match roll {
            0..=11 => {
                // Now and then a scale-up: several Nodes join at once (and are read in one
                // batch).
                let joining = if self.rng.random_bool(0.3) { self.rng.random_range(2..=3) } else { 1 };
                for _ in 0..joining {
                    if self.nodes.len() < MAX_NODES {
                        self.add_node();
                    }
                }
            }
            12..=17 => {
                let live = self.live_nodes();
                if let Some(i) = self.pick(&live) {
                    let ready = !self.nodes[i].ready || self.nodes[i].life != Life::Running;
                    let ready = ready && self.nodes[i].life == Life::Running;
                    self.log(format!("node {} Ready={ready}", self.nodes[i].name));
                    self.set_ready(i, ready);
                }
            }
            18..=22 => {
                let live = self.live_nodes();
                if let Some(i) = self.pick(&live) {
                    let (name, id) = (self.nodes[i].name.clone(), self.nodes[i].instance.clone());
                    let (state, life) = if self.nodes[i].life == Life::Stopped {
                        (InstanceState::Running, Life::Running)
                    } else {
                        (InstanceState::Stopped, Life::Stopped)
                    };
                    let _ = self.cloud_of(self.nodes[i].metal).set_instance_state(&id, state);
                    self.log(format!("instance {id} of {name} now {life:?}"));
                    self.nodes[i].life = life.clone();
                    self.set_ready(i, life == Life::Running);
                }
            }
            23..=27 => {
                let live = self.live_nodes();
                if let Some(i) = self.pick(&live) {
                    let (name, id) = (self.nodes[i].name.clone(), self.nodes[i].instance.clone());
                    let _ = self.cloud_of(self.nodes[i].metal).set_instance_state(&id, InstanceState::Terminated);
                    self.nodes[i].life = Life::Terminated;
                    self.set_ready(i, false);
                    self.log(format!("instance {id} of {name} terminated"));
                }
            }
            28..=31 => {
                let without: Vec<usize> = (0..self.nodes.len())
                    .filter(|&i| self.nodes[i].cidr.is_none() && self.nodes[i].life != Life::Terminated)
                    .filter(|_| self.modes.ipam == Ipam::Off)
                    .collect();
                if let Some(i) = self.pick(&without) {
                    let name = self.nodes[i].name.clone();
                    let cidr = format!("10.244.{}.0/24", name.trim_start_matches("node-"));
                    self.model.update(&Key::node(&name), |n| {
                        n["spec"]["podCIDR"] = json!(cidr);
                        n["spec"]["podCIDRs"] = json!([cidr]);
                    });
                    self.log(format!("node {name} podCIDR {cidr}"));
                    self.nodes[i].cidr = Some(cidr);
                }
            }
            32..=37 => {
                if self.services.iter().filter(|s| !s.deleted).count() < MAX_SERVICES {
                    self.create_service();
                }
            }
            38..=42 => {
                let live: Vec<usize> = (0..self.services.len()).filter(|&i| !self.services[i].deleted).collect();
                if let Some(i) = self.pick(&live) {
                    let port = 8000 + self.rng.random_range(0..50);
                    let s = &mut self.services[i];
                    if s.ports.len() > 1 && s.ports.contains(&80) {
                        s.ports.retain(|p| *p == 80);
                    } else if !s.ports.contains(&port) {
                        s.ports.push(port);
                    }
                    // A third of the edits also restrict or open access (drawn from the port,
                    // so that no seed's schedule changes).
                    if port % 3 == 0 {
                        s.ranges = if s.ranges.is_empty() { vec!["203.0.113.0/24".to_string()] } else { Vec::new() };
                    }
                    let (name, ports, ranges) = (s.name.clone(), s.ports.clone(), s.ranges.clone());
                    let spec = service_object(&name, &ports)["spec"]["ports"].clone();
                    self.model.update(&Key::service(NAMESPACE, &name), |svc| {
                        svc["spec"]["ports"] = spec;
                        svc["spec"]["loadBalancerSourceRanges"] = json!(ranges);
                    });
                    self.log(format!("service {name} ports {ports:?} source ranges {ranges:?}"));
                }
            }
            43..=45 => {
                let live: Vec<usize> = (0..self.services.len()).filter(|&i| !self.services[i].deleted).collect();
                if let Some(i) = self.pick(&live) {
                    self.services[i].deleted = true;
                    let name = self.services[i].name.clone();
                    self.model.delete(&Key::service(NAMESPACE, &name));
                    self.log(format!("service {name} deleted"));
                }
            }
            46..=52 => {
                let method = self.pick(METHODS).unwrap_or("*");
                let code = *[FaultCode::Unavailable, FaultCode::Internal, FaultCode::DeadlineExceeded]
                    .get(self.rng.random_range(0..3))
                    .unwrap_or(&FaultCode::Unavailable);
                let fault = Fault { method: method.into(), down: true, code, ..Default::default() };
                self.provider_fault("provider errors", fault, lasts);
            }
            53..=56 => {
                let method = self.pick(METHODS).unwrap_or("*");
                // Throttled, with a RetryInfo far beyond any sane wait (the core caps it).
                let retry_after = if self.rng.random_bool(0.5) { 36_000_000 } else { 5_000 };
                let fault = Fault {
                    method: method.into(),
                    down: true,
                    code: FaultCode::RateLimited,
                    retry_after_ms: Some(retry_after),
                    ..Default::default()
                };
                self.provider_fault("throttling with RetryInfo", fault, lasts);
            }
            57..=59 => {
                self.faults.insert("account rate limit");
                self.cloud.set_rate_limit(Some(RateLimit { rps: 0.5, burst: 2 }));
                self.log(format!("fault account rate limit 0.5/s for {}s", lasts.as_secs()));
                self.active.push((Instant::now() + lasts, Active::RateLimit));
            }
            60..=63 => {
                let method = self.pick(METHODS).unwrap_or("*");
                let hang = self.rng.random_range(11_000..=70_000);
                let fault = Fault { method: method.into(), delay_ms: Some(hang), ..Default::default() };
                self.provider_fault("hangs", fault, lasts);
            }
            64..=66 => {
                let fault = Fault { method: "EnsureLoadBalancer".into(), delay_ms: Some(12_000), ..Default::default() };
                self.provider_fault("slow mutations", fault, lasts);
            }
            67..=70 => {
                let lie = *[Lie::Reorder, Lie::ShortBatch, Lie::AllGone, Lie::EmptyListing]
                    .get(self.rng.random_range(0..4))
                    .unwrap_or(&Lie::Reorder);
                let kind = match lie {
                    Lie::Reorder => "reordered batch answers",
                    Lie::ShortBatch => "short batch answers",
                    Lie::AllGone => "every instance said gone",
                    _ => "empty listings",
                };
                let fault = Fault { method: "*".into(), lie: Some(lie), ..Default::default() };
                self.provider_fault(kind, fault, lasts);
            }
            71..=73 => {
                let slot = self.rng.random_range(0..self.replicas.len());
                if self.restart_sidecar(slot) {
                    self.faults.insert("sidecar restarts (new epoch)");
                }
            }
            74..=78 => {
                self.faults.insert("API server restarts (watch history compacted)");
                self.model.restart();
                self.log("the API server restarts; history compacted".into());
            }
            79..=83 => {
                let slot = self.rng.random_range(0..self.replicas.len());
                if let Some(r) = &self.replicas[slot] {
                    r.net.down.store(true, std::sync::atomic::Ordering::Relaxed);
                    r.lease_net.down.store(true, std::sync::atomic::Ordering::Relaxed);
                    self.model.wake_watches();
                    self.faults.insert("partitions");
                    self.log(format!("{} partitioned from the API server for {}s", r.identity, lasts.as_secs()));
                    self.active.push((Instant::now() + lasts, Active::Partition(slot)));
                }
            }
            84..=88 => {
                let slot = self.rng.random_range(0..self.replicas.len());
                let delay = self.rng.random_range(1_000..=12_000);
                if let Some(r) = &self.replicas[slot] {
                    r.net.answer_delay_ms.store(delay, std::sync::atomic::Ordering::Relaxed);
                    r.lease_net.answer_delay_ms.store(delay, std::sync::atomic::Ordering::Relaxed);
                    self.faults.insert("late answers");
                    self.log(format!("{} gets answers {delay} ms late for {}s", r.identity, lasts.as_secs()));
                    self.active.push((Instant::now() + lasts, Active::SlowAnswers(slot)));
                }
            }
            89..=92 => {
                let slot = self.rng.random_range(0..self.replicas.len());
                self.faults.insert("replicas killed");
                let back_in = Duration::from_secs(self.rng.random_range(1..=30));
                self.kill_replica(slot, back_in);
            }
            93..=94 => {
                // The replica's watches stall and fail (an overloaded API server, a half-open
                // watch connection) while its other requests, the Lease's too, go through;
                // by the time they come back, the history they left off at is compacted.
                let slot = self.rng.random_range(0..self.replicas.len());
                if let Some(r) = &self.replicas[slot] {
                    r.net.watches_down.store(true, std::sync::atomic::Ordering::Relaxed);
                    self.model.wake_watches();
                    self.faults.insert("watches cut, then history compacted");
                    self.log(format!("{} loses its watches for {}s", r.identity, lasts.as_secs()));
                    self.active.push((Instant::now() + lasts, Active::WatchesCut(slot)));
                }
            }
            96..=99 => {
                // One load balancer's items fail (a bulk hosts call fails that entry alone):
                // the others must keep following the Nodes.
                let live: Vec<usize> = (0..self.services.len()).filter(|&i| !self.services[i].deleted).collect();
                let Some(i) = self.pick(&live) else { return };
                let key = Key::service(NAMESPACE, &self.services[i].name);
                let uid =
                    self.model.get(&key).and_then(|s| s.pointer("/metadata/uid").and_then(Value::as_str).map(str::to_string));
                let Some(uid) = uid else { return };
                // Upstream's name: "a" and the UID without dashes, 32 characters.
                let name: String = format!("a{}", uid.replace('-', "")).chars().take(32).collect();
                let method =
                    *["BatchUpdateLoadBalancerHosts", "UpdateLoadBalancerHosts"].get(self.rng.random_range(0..2)).unwrap_or(&"*");
                let code = if self.rng.random_bool(0.5) { FaultCode::Unavailable } else { FaultCode::RateLimited };
                let retry_after_ms = (code == FaultCode::RateLimited).then_some(36_000_000);
                let fault =
                    Fault { method: method.into(), down: true, code, subject: Some(name), retry_after_ms, ..Default::default() };
                self.provider_fault("one load balancer's items failing", fault, lasts);
            }
            100..=105 => {
                // The leader's Lease renewals are answered late (its renewal still lands at
                // once), then its Lease connection goes silent while its controllers' connection
                // works: the standby takes the Lease 15 s after the last renewal it saw, and the
                // old leader must have stopped writing by then.
                let leader = self.leader().unwrap_or(0);
                let late = self.rng.random_range(5_000..=7_600);
                // Long enough for one renewal to be answered late before the silence.
                let for_ = Duration::from_millis(late + self.rng.random_range(1_000..=4_000));
                let silent = Duration::from_secs(self.rng.random_range(20..=60));
                if let Some(r) = &self.replicas[leader] {
                    r.lease_net.write_answer_delay_ms.store(late, std::sync::atomic::Ordering::Relaxed);
                    self.faults.insert("Lease answered late, then silent");
                    self.log(format!("{}'s Lease answers {late} ms late for {}s", r.identity, for_.as_secs()));
                    self.active.push((Instant::now() + for_, Active::LeaseLate(leader, silent)));
                }
            }
            106..=109 => {
                // The controllers' connections go half-open (a NAT or load balancer in front of
                // the API server forgot them): writes and watches hang, with no error, while
                // the Lease's own connection renews. Only the client's timeouts end them.
                let slot = self.leader().unwrap_or(0);
                if let Some(r) = &self.replicas[slot] {
                    r.net.half_open.store(true, std::sync::atomic::Ordering::Relaxed);
                    self.faults.insert("half-open connections");
                    self.log(format!("{}'s controller connections half-open for {}s", r.identity, lasts.as_secs()));
                    self.active.push((Instant::now() + lasts, Active::HalfOpen(slot)));
                }
            }
            110..=112 => {
                // A user who may edit one Service writes another Service's load balancer name
                // on it (the annotation the core records names in): the core must ignore it,
                // and neither ensure, read nor delete the other's load balancer for it.
                let live: Vec<usize> = (0..self.services.len()).filter(|&i| !self.services[i].deleted).collect();
                let (Some(thief), Some(victim)) = (self.pick(&live), self.pick(&live)) else { return };
                let (thief, victim) = (self.services[thief].name.clone(), self.services[victim].name.clone());
                if thief == victim {
                    // Or a new name of the Service's own form (any prefix, the hash of its
                    // UID): no second load balancer may be made for it.
                    let Some(uid) = self
                        .model
                        .get(&Key::service(NAMESPACE, &thief))
                        .and_then(|svc| svc.pointer("/metadata/uid").and_then(Value::as_str).map(str::to_string))
                    else {
                        return;
                    };
                    let readable = ccm_protocol::names::load_balancer_name("c", "n", "s", &uid, &Default::default());
                    let forged = format!("forged-{}", readable.rsplit('-').next().unwrap_or_default());
                    self.model.update(&Key::service(NAMESPACE, &thief), |svc| {
                        svc["metadata"]["annotations"]["ccm-rs.dev/load-balancer-name"] = json!(forged);
                    });
                    self.faults.insert("a Service records another's load balancer name");
                    self.log(format!("service {thief} records a name of its own form, {forged}"));
                    return;
                }
                let Some(stolen) = self.load_balancer_name(&victim) else { return };
                self.model.update(&Key::service(NAMESPACE, &thief), |svc| {
                    svc["metadata"]["annotations"]["ccm-rs.dev/load-balancer-name"] = json!(stolen);
                });
                self.faults.insert("a Service records another's load balancer name");
                self.log(format!("service {thief} records {victim}'s load balancer name {stolen}"));
            }
            _ => {
                let latency = self.rng.random_range(0..=2_000);
                self.model.latency_ms.store(latency, std::sync::atomic::Ordering::Relaxed);
                self.faults.insert("API latency");
                self.log(format!("API latency up to {latency} ms"));
            }
        }
    }

    /// Ends every fault: the cloud answers, partitions heal, every instance that is not
    /// terminated runs and its kubelet is Ready.
    fn calm(&mut self) {
        self.expire_faults(true);
        self.model.latency_ms.store(20, std::sync::atomic::Ordering::Relaxed);
        for i in 0..self.nodes.len() {
            if self.nodes[i].life == Life::Stopped {
                let _ = self.cloud_of(self.nodes[i].metal).set_instance_state(&self.nodes[i].instance, InstanceState::Running);
                self.nodes[i].life = Life::Running;
            }
            if self.nodes[i].life == Life::Running && !self.nodes[i].ready {
                self.set_ready(i, true);
            }
        }
        // With two providers, a Node that never had a providerID, whose instance is gone, is no
        // provider's to delete: no provider knew it (a provider label only claims it), and the
        // core never guesses (ccm-core/README.md, "Which provider a Node belongs to"). The
        // operator deletes it, as the Warning `ProviderNotFound` or `NodeDeletionRefused` asks.
        if self.metal.is_some() {
            for i in 0..self.nodes.len() {
                let name = self.nodes[i].name.clone();
                let Some(node) = self.model.get(&Key::node(&name)) else { continue };
                let known = node.pointer("/spec/providerID").is_some();
                if self.nodes[i].life == Life::Terminated && !known {
                    self.model.delete(&Key::node(&name));
                    self.log(format!("the operator deletes node {name}, which no provider knows (its instance is gone)"));
                }
            }
        }
        // The Nodes of terminated instances wait, by design, for a Ready Node to witness the
        // provider's word, and for their zone not to look disrupted (most of its Nodes
        // NotReady): a replacement joins the zone of each, as an autoscaling group's would.
        let dead: Vec<(&'static str, bool)> = self
            .nodes
            .iter()
            .filter(|n| n.life == Life::Terminated && self.model.get(&Key::node(&n.name)).is_some())
            .map(|n| (Self::zone(n.name.trim_start_matches("node-").parse().unwrap_or(0)), n.metal))
            .collect();
        for (zone, metal) in dead {
            self.add_node_in(Some(zone), Some(metal));
        }
        if self.live_nodes().is_empty() {
            self.add_node();
        }
        for slot in 0..self.replicas.len() {
            if self.replicas[slot].is_none() {
                self.restart_at[slot] = Some(Instant::now());
            }
        }
        self.tend_replicas();
        self.log("faults end; every instance not terminated runs and is Ready".into());
    }

    /// Bounded queues: a work queue holds each key once, so no controller's queue may be
    /// deeper than the objects there are (plus the few keys of its own, such as the
    /// bulk-hosts key).
    fn check_queues(&mut self) {
        self.check_identities();
        self.check_served();
        let bound = self.nodes.len() + self.services.len() + 4;
        let mut ran = Vec::new();
        for r in self.replicas.iter().flatten() {
            let text = r.metrics.encode();
            for line in text.lines().filter(|l| l.starts_with("ccm_workqueue_depth{")) {
                let depth = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
                if depth > bound as f64 {
                    self.model.violation(format!("{}: {line} (bound {bound})", r.identity));
                }
            }
            // The controllers that ran: their queues took keys.
            for line in text.lines().filter_map(|l| l.strip_prefix("ccm_workqueue_adds_total{controller=\"")) {
                let (controller, rest) = line.split_once('"').unwrap_or_default();
                // With several providers, each provider's instance: `name[provider]`.
                let controller = controller.split('[').next().unwrap_or_default();
                if rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0) > 0.0 {
                    ran.push(controller.to_string());
                }
            }
        }
        self.controllers.extend(ran);
    }

    /// How many Leases the replicas keep: one, or one per controller and a member Lease per
    /// replica.
    fn leases(&self) -> usize {
        if self.modes.per_controller { self.expected_controllers().len() + self.replicas.len() } else { 1 }
    }

    /// With a Lease per controller, no controller stays with a replica that cannot serve it
    /// (its sidecar down for [`SERVED_BOUND`]) while another has been ready that long.
    fn check_served(&mut self) {
        if !self.modes.per_controller {
            return;
        }
        let now = Instant::now();
        // Only while nothing else is wrong (a fault of the cloud makes every replica unready
        // for a while), for long enough.
        if self.active.iter().any(|(_, a)| !matches!(a, Active::SidecarDown(_) | Active::Addresses(..))) {
            self.undisturbed_since = now;
            return;
        }
        if now.saturating_duration_since(self.undisturbed_since) < SERVED_BOUND {
            return;
        }
        let up_for = |slot: usize| {
            self.replicas[slot].as_ref().map(|r| (r.identity.clone(), self.sidecar_down[slot].is_none(), r.started))
        };
        let ready: Vec<String> = (0..self.replicas.len())
            .filter_map(up_for)
            .filter(|(_, up, started)| *up && now.saturating_duration_since(*started) >= SERVED_BOUND)
            .map(|(id, _, _)| id)
            .collect();
        if ready.is_empty() {
            return;
        }
        for (controller, holder) in self.model.holders() {
            let slot = self.slot_of(&holder);
            let Some(since) = slot.and_then(|s| self.sidecar_down[s]) else { continue };
            if now.saturating_duration_since(since) > SERVED_BOUND {
                self.model.violation(format!(
                    "{controller} is held by {holder}, whose sidecar has been down for {}s, while {ready:?} are ready",
                    now.saturating_duration_since(since).as_secs()
                ));
            }
        }
    }

    /// With the range allocator, the holder of node IPAM takes exactly the CIDRs the Nodes
    /// hold (and those of writes of unknown outcome, until every Node is read again): a CIDR
    /// still taken after its Node is gone is a leak that a small cluster CIDR turns into
    /// Nodes that never get one.
    fn cidrs_leaked(&self, nodes: &[Value]) -> Option<String> {
        if self.modes.ipam != Ipam::Range {
            return None;
        }
        let holder = self.holder_slot(&self.model, ccm_core::controllers::ipam::NAME)?;
        let text = self.replicas[holder].as_ref()?.metrics.encode();
        let gauge = |prefix: &str| {
            text.lines()
                .find(|l| l.starts_with(prefix))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse::<f64>().ok())
                .map(|v| v as usize)
        };
        let in_use = gauge("ccm_node_ipam_cidrs_in_use{")?;
        let pending = gauge("ccm_node_ipam_cidrs_pending").unwrap_or(0);
        let held: BTreeSet<&str> = nodes.iter().filter_map(|n| n.pointer("/spec/podCIDR").and_then(Value::as_str)).collect();
        (in_use < held.len() || in_use > held.len() + pending).then(|| {
            format!(
                "node IPAM's holder counts {in_use} CIDRs taken ({pending} of writes of unknown outcome); the Nodes hold {}",
                held.len()
            )
        })
    }

    /// The controllers the seed's core runs.
    fn expected_controllers(&self) -> Vec<&'static str> {
        use ccm_core::controllers::{ipam, node, node_lifecycle, route, service, tagging};
        let mut names = vec![node::NAME, node_lifecycle::NAME, route::NAME, service::NAME];
        if self.modes.ipam != Ipam::Off {
            names.push(ipam::NAME);
        }
        if self.modes.tagging {
            names.push(tagging::NAME);
        }
        names
    }

    /// Every Node's providerID, once set, names its own instance (a reordered batch answer
    /// must not hand one Node another's identity: the field is immutable, so a swap is for
    /// ever).
    fn check_identities(&self) {
        // No two Nodes share a podCIDR (node IPAM gives each once; the world never does).
        let mut owners: std::collections::BTreeMap<String, String> = std::collections::BTreeMap::new();
        for node in self.model.list("v1/nodes") {
            let name = node.pointer("/metadata/name").and_then(Value::as_str).unwrap_or_default().to_string();
            for cidr in node.pointer("/spec/podCIDRs").and_then(Value::as_array).into_iter().flatten() {
                let cidr = cidr.as_str().unwrap_or_default().to_string();
                if let Some(other) = owners.insert(cidr.clone(), name.clone()) {
                    self.model.violation(format!("Nodes {other} and {name} share the podCIDR {cidr}"));
                }
            }
        }
        for rec in &self.nodes {
            let Some(node) = self.model.get(&Key::node(&rec.name)) else { continue };
            // No address the cloud answered that no host can reach is ever written.
            for address in node.pointer("/status/addresses").and_then(Value::as_array).into_iter().flatten() {
                let text = address["address"].as_str().unwrap_or_default();
                if let Ok(ip) = text.parse::<std::net::IpAddr>() {
                    let local = match ip {
                        std::net::IpAddr::V4(v4) => v4.is_link_local() || v4.is_loopback(),
                        std::net::IpAddr::V6(v6) => v6.is_unicast_link_local() || v6.is_loopback(),
                    };
                    if local {
                        self.model.violation(format!("Node {} has the address {text}, which no other host can reach", rec.name));
                    }
                }
            }
            let id = node.pointer("/spec/providerID").and_then(Value::as_str).unwrap_or_default();
            let scheme = format!("{}://", self.cloud_of(rec.metal).scheme());
            if !id.is_empty() && (id.rsplit('/').next() != Some(rec.instance.as_str()) || !id.starts_with(&scheme)) {
                self.model.violation(format!("Node {} has providerID {id}, not its instance {}", rec.name, rec.instance));
            }
        }
    }

    /// Why the world has not converged yet, if it has not.
    /// With tagging, what the tagging controller promises: the instance of `node` carries the
    /// cluster's tags; and always, the Node's tag labels are its instance's tags (the node
    /// refresh, every 5 minutes, brings them).
    fn tags_unsettled(&self, node: &Value, name: &str, cloud: &ccm_provider_sim::admin::Snapshot) -> Option<String> {
        let terminated = ccm_provider_sim::config::State::Terminated;
        let instance = cloud.instances.iter().find(|i| i.name == name && i.state != terminated)?;
        if self.modes.tagging && instance.tags.get("team").map(String::as_str) != Some("sim") {
            return Some(format!("instance {} of Node {name} lacks the tag team=sim ({:?})", instance.id, instance.tags));
        }
        let prefix = "tags.cloudprovider.dev/";
        let labels: BTreeMap<String, String> = node
            .pointer("/metadata/labels")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
            .filter_map(|(k, v)| Some((k.strip_prefix(prefix)?.to_string(), v.as_str()?.to_string())))
            .collect();
        let tags = &instance.tags;
        (labels != *tags).then(|| format!("Node {name} has tag labels {labels:?}, its instance the tags {tags:?}"))
    }

    fn unconverged(&self) -> Option<String> {
        if !self.replicas.iter().flatten().any(|r| self.model.leads(&r.identity)) {
            return Some("no replica leads".into());
        }
        // Every controller served: with a Lease per controller, each one's held.
        let holders = self.model.holders();
        if !holders.contains_key("*") {
            for controller in self.expected_controllers() {
                if !holders.contains_key(controller) {
                    return Some(format!("no replica leads {controller}"));
                }
            }
        }
        let snapshot = self.cloud.snapshot();
        let metal = self.metal.as_ref().map(|m| m.snapshot());
        let snapshot_of = |metal_side: bool| match &metal {
            Some(m) if metal_side => m,
            _ => &snapshot,
        };
        let nodes = self.model.list("v1/nodes");
        let name_of = |n: &Value| n.pointer("/metadata/name").and_then(Value::as_str).unwrap_or_default().to_string();
        let mut backends = BTreeSet::new();
        let mut routes_wanted = BTreeSet::new();
        for node in &nodes {
            let name = name_of(node);
            let rec = self.nodes.iter().find(|r| r.name == name)?;
            if rec.life == Life::Terminated {
                return Some(format!("Node {name} of a terminated instance still exists"));
            }
            let provider_id = node.pointer("/spec/providerID").and_then(Value::as_str).unwrap_or_default();
            let tainted = node
                .pointer("/spec/taints")
                .and_then(Value::as_array)
                .is_some_and(|t| t.iter().any(|t| t["key"].as_str() == Some(TAINT)));
            if provider_id.is_empty() || tainted {
                return Some(format!("Node {name} is not initialised"));
            }
            if let Some(why) = self.tags_unsettled(node, &name, snapshot_of(rec.metal)) {
                return Some(why);
            }
            let pool = node.pointer(&format!("/metadata/labels/{POOL}")).and_then(Value::as_str).unwrap_or("a").to_string();
            backends.insert((name.clone(), pool, rec.metal));
            let cidr = node.pointer("/spec/podCIDR").and_then(Value::as_str).map(str::to_string);
            if self.modes.ipam != Ipam::Off && cidr.is_none() {
                return Some(format!("Node {name} has no podCIDR from node IPAM"));
            }
            // The cloud routes the pod CIDRs it gives (alias ranges): no route is made for them.
            // Each provider routes its own Nodes' pod networks.
            if let Some(cidr) = cidr.filter(|_| self.modes.ipam != Ipam::Cloud) {
                routes_wanted.insert((rec.metal, name, cidr));
            }
        }
        if let Some(why) = self.cidrs_leaked(&nodes) {
            return Some(why);
        }
        let routes: BTreeSet<(bool, String, String)> = [false, true]
            .into_iter()
            .filter(|m| !m || metal.is_some())
            .flat_map(|m| {
                snapshot_of(m)
                    .route_tables
                    .iter()
                    .flat_map(|t| &t.routes)
                    .filter(|r| r.cluster == CLUSTER)
                    .map(move |r| (m, r.node_name.clone(), r.destination_cidr.clone()))
            })
            .collect();
        if routes != routes_wanted {
            return Some(format!("routes {routes:?}, wanted {routes_wanted:?}"));
        }
        let mut wanted_lbs = BTreeSet::new();
        for s in &self.services {
            let key = Key::service(NAMESPACE, &s.name);
            let object = self.model.get(&key);
            if s.deleted {
                if object.is_some() {
                    return Some(format!("Service {} is still being deleted", s.name));
                }
                continue;
            }
            let Some(svc) = object else { return Some(format!("Service {} vanished", s.name)) };
            let ingress = svc.pointer("/status/loadBalancer/ingress").and_then(Value::as_array).is_some_and(|a| !a.is_empty());
            if !ingress {
                return Some(format!("Service {} has no ingress", s.name));
            }
            let service = format!("{NAMESPACE}/{}", s.name);
            let Some(lb) = snapshot_of(s.metal).load_balancers.iter().find(|l| l.service == service) else {
                return Some(format!("Service {} has no load balancer", s.name));
            };
            let ports: BTreeSet<u32> = s.ports.iter().map(|p| u32::try_from(*p).unwrap_or(0)).collect();
            if lb.ports.iter().copied().collect::<BTreeSet<u32>>() != ports {
                return Some(format!("load balancer of {} has ports {:?}, wanted {ports:?}", s.name, lb.ports));
            }
            if lb.source_ranges != s.ranges {
                return Some(format!("load balancer of {} admits {:?}, wanted {:?}", s.name, lb.source_ranges, s.ranges));
            }
            let hosts: BTreeSet<String> = lb.nodes.iter().cloned().collect();
            // A provider's load balancers have its own Nodes behind them.
            let wanted: BTreeSet<String> = backends
                .iter()
                .filter(|(_, pool, metal)| (!s.selects || pool == "a") && *metal == s.metal)
                .map(|(n, _, _)| n.clone())
                .collect();
            // An empty node set (a selector that matches no Node, a provider left without
            // Nodes) keeps the hosts the load balancer had: the core never empties one.
            if hosts != wanted && !wanted.is_empty() {
                return Some(format!("load balancer of {} has hosts {hosts:?}, wanted {wanted:?}", s.name));
            }
            wanted_lbs.insert(service);
        }
        let every_lb = snapshot.load_balancers.iter().chain(metal.iter().flat_map(|m| &m.load_balancers));
        if let Some(leaked) = every_lb.clone().find(|l| !wanted_lbs.contains(&l.service)) {
            return Some(format!("load balancer {} of {} leaked", leaked.name, leaked.service));
        }
        // One load balancer per Service, in its own provider's cloud.
        if let Some(s) = self.services.iter().filter(|s| !s.deleted).find(|s| {
            let service = format!("{NAMESPACE}/{}", s.name);
            every_lb.clone().filter(|l| l.service == service).count() > 1
        }) {
            return Some(format!("Service {} has more than one load balancer (in one cloud or both)", s.name));
        }
        None
    }
}

/// Runs one seed to the end and reports.
pub fn run_seed(seed: u64) -> Report {
    run(seed, None)
}

/// Runs one scripted scenario (a test the simulation grew from a defect) to the end, with
/// the same world, invariants, convergence and steady-state checks as a seed.
pub fn run_scenario(scenario: Scenario) -> Report {
    run(scenario as u64, Some(scenario))
}

fn run(seed: u64, scenario: Option<Scenario>) -> Report {
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_all().start_paused(true);
    // The runtime's own random choices (which ready branch of a `select!` goes first) from the
    // seed too.
    #[cfg(tokio_unstable)]
    builder.rng_seed(tokio::runtime::RngSeed::from_bytes(&seed.to_le_bytes()));
    let runtime = match builder.build() {
        Ok(rt) => rt,
        Err(e) => {
            return Report {
                seed,
                violations: vec![format!("no runtime: {e}")],
                converged_after: None,
                schedule: Vec::new(),
                faults: BTreeSet::new(),
                requests: 0,
                digest: 0,
                peak_heap: 0,
                steady_growth: 0,
                modes: BTreeSet::new(),
                controllers: BTreeSet::new(),
            };
        }
    };
    HEAP_BASE.with(|b| b.set(alloc_metrics::thread_metrics().allocated_bytes));
    let report = runtime.block_on(simulate(seed, scenario));
    // Tasks the replicas leave behind end with the runtime.
    runtime.shutdown_background();
    report
}

async fn simulate(seed: u64, scenario: Option<Scenario>) -> Report {
    START.with(|s| s.set(Some(Instant::now())));
    ccm_core::clock::seed_jitter(Some(seed));
    ccm_core::clock::follow_virtual_time(Some(k8s_openapi::jiff::Timestamp::from_second(1_798_761_600).unwrap_or_default()));
    let mut rng = StdRng::seed_from_u64(seed);
    // Drawn in this order (a seed's schedule depends on it).
    let (bulk_routes, bulk_hosts, batch_reads) = (rng.random_bool(0.5), rng.random_bool(0.5), rng.random_bool(0.7));
    let mut config = Config { bulk_routes, batch_reads, ..Default::default() };
    config.load_balancers.bulk_hosts = bulk_hosts;
    config.api.latency_ms = rng.random_range(0..=300);
    if scenario == Some(Scenario::OneLoadBalancerItemFailing) {
        config.load_balancers.bulk_hosts = true;
    }
    let mut mode_rng = StdRng::seed_from_u64(seed ^ 0x6d0d_e5ee);
    let mut modes = Modes::draw(&mut mode_rng, scenario.is_some());
    if scenario == Some(Scenario::NotReadyReplica) {
        modes.per_controller = true;
    }
    if modes.ipam == Ipam::Cloud {
        config.pod_cidrs = Some(ccm_provider_sim::config::PodCidrConfig {
            pools: vec![CLOUD_POD_CIDRS.into()],
            mask_v4: 24,
            // Alias ranges: the cloud routes them.
            routed: true,
            ..Default::default()
        });
    }
    config.set_tags = modes.tagging;
    let cloud = match Cloud::new(&config) {
        Ok(c) => Arc::new(c),
        Err(e) => panic!("the sim cloud's configuration: {e}"),
    };
    let model = Model::new(seed, cloud.clone());
    // Two providers in one cluster, for a share of the seeds: drawn from a stream of their
    // own, so that every other seed runs as it did.
    let mut provider_rng = StdRng::seed_from_u64(seed ^ 0x0002_c10d);
    modes.two_providers = scenario.is_none() && provider_rng.random_bool(0.2);
    modes.repair_reads = modes.repair && provider_rng.random_bool(0.5);
    modes.no_epoch = scenario.is_none() && provider_rng.random_bool(0.5);
    if modes.repair_reads {
        *model.repair_bound.lock().unwrap_or_else(|p| p.into_inner()) = Some((MAX_REPAIRS, REPAIR_PERIOD));
    }
    let metal = modes.two_providers.then(|| {
        let mut metal = Config {
            plugin_name: format!("{METAL}.cloudprovider.dev"),
            provider_id_scheme: METAL.into(),
            bulk_routes: provider_rng.random_bool(0.5),
            batch_reads: provider_rng.random_bool(0.7),
            ..Default::default()
        };
        metal.load_balancers.bulk_hosts = provider_rng.random_bool(0.5);
        metal.load_balancers.classes = vec![METAL_CLASS.into()];
        metal.load_balancers.address_pool = vec!["198.51.100.0/24".into()];
        metal.api.latency_ms = provider_rng.random_range(0..=300);
        metal.pod_cidrs = config
            .pod_cidrs
            .clone()
            .map(|p| ccm_provider_sim::config::PodCidrConfig { pools: vec![METAL_POD_CIDRS.into()], ..p });
        metal.set_tags = modes.tagging;
        match Cloud::new(&metal) {
            Ok(c) => Arc::new(c),
            Err(e) => panic!("the second cloud's configuration: {e}"),
        }
    });
    if let Some(metal) = &metal {
        model.add_cloud(metal.clone());
    }
    *model.deletion_bound.lock().unwrap_or_else(|p| p.into_inner()) = Some((MAX_NODE_DELETIONS, NODE_DELETION_WINDOW));
    let replicas = modes.replicas;
    let shared = Shared { declared: modes.declared_rate, no_epoch: modes.no_epoch, ..Default::default() };
    let mut world = World {
        rng,
        address_rng: StdRng::seed_from_u64(seed ^ 0x0add_7e55),
        model: model.clone(),
        cloud,
        metal,
        provider_rng,
        shared,
        nodes: Vec::new(),
        services: Vec::new(),
        next_node: 0,
        next_service: 0,
        replicas: (0..replicas).map(|_| None).collect(),
        restart_at: vec![None; replicas],
        incarnations: vec![0; replicas],
        active: Vec::new(),
        schedule: Vec::new(),
        faults: BTreeSet::new(),
        exercised: modes.names().into_iter().collect(),
        modes,
        mode_rng,
        controllers: BTreeSet::new(),
        sidecar_down: vec![None; replicas],
        undisturbed_since: Instant::now(),
    };
    world.log(format!("modes: {:?}", world.modes));
    // An experiment, not the mix: mutations that outlive their calls, as a provider that
    // ignores cancellation runs them (the Go adapter's old `context.WithoutCancel`).
    if std::env::var_os("CCM_SIM_DETACHED_MUTATIONS").is_some() {
        world.shared.detached.store(true, std::sync::atomic::Ordering::Relaxed);
        world.log("mutations outlive their calls (CCM_SIM_DETACHED_MUTATIONS)".into());
    }
    world.log(format!(
        "cloud: bulk routes {}, bulk hosts {}, batch reads {}, latency {} ms",
        config.bulk_routes, config.load_balancers.bulk_hosts, config.batch_reads, config.api.latency_ms
    ));
    let initial = world.rng.random_range(2..=5);
    for _ in 0..initial {
        world.add_node();
    }
    for slot in 0..world.replicas.len() {
        world.start_replica(slot);
    }
    let mut heap = Heap { peak: 0 };
    let mut steady_growth = 0;
    let start = Instant::now();
    if let Some(scenario) = scenario {
        world.script(scenario).await;
    }
    while scenario.is_none() && start.elapsed() < CHAOS {
        let next = Instant::now() + Duration::from_millis(world.rng.random_range(500..=20_000));
        // Faults end when they said they would, not at the next step.
        while let Some(end) = world.active.iter().map(|(t, _)| *t).filter(|t| *t < next).min() {
            tokio::time::sleep_until(end).await;
            world.expire_faults(false);
        }
        tokio::time::sleep_until(next).await;
        world.expire_faults(false);
        world.tend_replicas();
        world.check_queues();
        heap.check(&model);
        world.act();
    }
    world.calm();
    let calm = Instant::now();
    let mut converged_after = None;
    while calm.elapsed() < SETTLE_BOUND {
        tokio::time::sleep(Duration::from_secs(5)).await;
        world.tend_replicas();
        world.check_queues();
        heap.check(&model);
        if world.unconverged().is_none() {
            converged_after = Some(calm.elapsed());
            break;
        }
    }
    match converged_after {
        Some(after) => {
            world.log(format!("converged {}s after the faults ended", after.as_secs()));
            // Steady state: nothing changes, so nothing may change the cloud, and the API
            // sees a bounded rate of requests.
            // The world can look converged while a replica is not yet done: a leader that took
            // over at the end syncs everything once, and one whose connections went half-open
            // has requests hung until its read timeout (75 s), then retries them after a watch
            // backoff (up to 30 s) and a reconcile backoff (up to 60 s here). Steady state
            // begins once all that has run out.
            tokio::time::sleep(STEADY_AFTER).await;
            let (requests, mutations) = (model.requests.load(std::sync::atomic::Ordering::Relaxed), model.mutations());
            // Where the provider's state lives in the cloud, a change of leader at rest: the
            // service controller's leader is killed and comes back a second later (a crash, a
            // rolling update). The new leaders must not change the cloud: what each load
            // balancer was ensured as is recorded on its Service.
            if world.modes.no_epoch
                && let Some(slot) = world.service_leader_slot(&model)
            {
                world.exercised.insert("a change of leader at rest");
                world.kill_replica(slot, Duration::from_secs(1));
            }
            let steady = Instant::now();
            // The heap is measured from once a killed leader's replacement has started and
            // filled its caches (its predecessor's are gone with it).
            let mut held = heap.check(&model);
            if world.modes.no_epoch {
                while steady.elapsed() < Duration::from_secs(45) {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    world.tend_replicas();
                }
                held = heap.check(&model);
            }
            while steady.elapsed() < STEADY {
                tokio::time::sleep(Duration::from_secs(5)).await;
                // Only where a handover costs nothing: elsewhere each sidecar's own epoch
                // makes a new leader ensure everything again, by design.
                if world.modes.no_epoch {
                    world.tend_replicas();
                }
            }
            steady_growth = heap.check(&model) - held;
            // Each Lease renewed in the steady state fills the model's (bounded) history: a
            // Lease per controller, and a member Lease per replica, count.
            let leases = world.leases();
            let growth_bound = STEADY_GROWTH_BOUND * i64::try_from(leases).unwrap_or(1).max(1);
            if steady_growth > growth_bound {
                model.violation(format!(
                    "the heap grew by {} KiB in {} min of steady state (bound {} KiB)",
                    steady_growth >> 10,
                    STEADY.as_secs() / 60,
                    growth_bound >> 10
                ));
            }
            let requests = model.requests.load(std::sync::atomic::Ordering::Relaxed) - requests;
            let minutes = STEADY.as_secs() / 60;
            // Per Lease: its holder renews it and every other replica tries it every retry
            // period (a read and a write, or a read).
            let per_minute = STEADY_REQUESTS_PER_MINUTE * u64::try_from(leases).unwrap_or(1).max(1);
            if requests > per_minute * minutes {
                model.violation(format!(
                    "{requests} API requests in {minutes} min of steady state (bound {})",
                    per_minute * minutes
                ));
            }
            let changed = model.mutations() - mutations;
            if changed > 0 {
                let calls = model.mutation_log().split_off(usize::try_from(mutations).unwrap_or(0));
                model.violation(format!("{changed} cloud mutations in {minutes} min of steady state (bound 0): {calls:?}"));
            }
            if let Some(why) = world.unconverged() {
                model.violation(format!("diverged in the steady state: {why}"));
            }
            // Where sidecars advertise an epoch, at rest the service controller's leader's
            // sidecar comes back with a new one and the cloud's load balancers and routes gone:
            // only the new epoch says so, and the core must make them again at once.
            // After a change of leader (whose new leader ensures everything under its own
            // sidecar's epoch: every record on the Services is then one of the hosts as they
            // are, under the epoch the next restart makes old).
            if !world.modes.no_epoch {
                if let Some(slot) = world.service_leader_slot(&model) {
                    world.kill_replica(slot, Duration::from_secs(1));
                }
                let killed = Instant::now();
                while killed.elapsed() < Duration::from_secs(90) {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    world.tend_replicas();
                }
                match world.unconverged() {
                    Some(why) => model.violation(format!("not converged 90s after the leader was killed at rest: {why}")),
                    None => world.epoch_lost_at_rest(&model).await,
                }
            }
        }
        None => {
            let why = world.unconverged().unwrap_or_default();
            model.violation(format!("not converged {}s after the faults ended: {why}", SETTLE_BOUND.as_secs()));
        }
    }
    for r in world.replicas.iter().flatten() {
        r.shutdown.cancel();
    }
    for r in world.replicas.iter_mut().flatten() {
        let _ = tokio::time::timeout(Duration::from_secs(30), &mut r.task).await;
    }
    world.check_call_rate();
    if let Some(path) = std::env::var_os("CCM_SIM_TRACE") {
        let _ = std::fs::write(path, model.steps().join("\n"));
    }
    ccm_core::clock::follow_virtual_time(None);
    ccm_core::clock::seed_jitter(None);
    Report {
        seed,
        violations: model.violations(),
        converged_after,
        schedule: world.schedule,
        faults: world.faults,
        requests: model.requests.load(std::sync::atomic::Ordering::Relaxed),
        digest: model.digest(),
        peak_heap: heap.peak,
        steady_growth,
        modes: world.exercised,
        controllers: world.controllers,
    }
}

/// A scripted run: the steps an outside review took to show a defect, replayed on the
/// simulation's world (see [`run_scenario`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// The leader's Lease renewal is answered 7.4 s late, then its Lease connection goes
    /// silent while its controllers' connection works and work keeps arriving: the standby
    /// takes the Lease, and the old leader must not write after that (the fence counts from
    /// when the renewal was sent, not from its answer).
    LateRenewalThenSilence = 1,
    /// One load balancer's item of every bulk hosts call fails (UNAVAILABLE) for two minutes;
    /// a Node that joins 40 s into it must reach the other load balancers at once, not after
    /// the failing item's backoff.
    OneLoadBalancerItemFailing = 2,
    /// The leader's controller connections go half-open for 30 s (writes and watches hang
    /// without an error) while its Lease connection renews, and work arrives meanwhile: the
    /// client's read timeout must end the hung requests so that it converges.
    HalfOpenConnections = 3,
    /// A Lease per controller, two replicas: the sidecar of the replica that leads the
    /// service controller goes down for three minutes (its /readyz fails) and a Service is
    /// made meanwhile: the other replica, ready, must be given the controller within
    /// [`SERVED_BOUND`] (issue 55's defect 3).
    NotReadyReplica = 4,
}

/// How soon a Node must reach the healthy load balancers while another's items fail.
pub const HOSTS_WHILE_ONE_FAILS: Duration = Duration::from_secs(10);

impl World {
    fn create_service(&mut self) -> String {
        self.next_service += 1;
        let name = format!("svc-{}", self.next_service);
        let ports = vec![80];
        let mut object = service_object(&name, &ports);
        let selects = self.modes.selectors && self.mode_rng.random_bool(0.5);
        if selects {
            object["metadata"]["annotations"] = json!({ ccm_core::wellknown::ANNOTATION_NODE_SELECTOR: format!("{POOL}=a") });
        }
        let metal = self.metal.is_some() && self.provider_rng.random_bool(0.4);
        if metal {
            object["spec"]["loadBalancerClass"] = json!(METAL_CLASS);
        }
        self.model.create(&Key::service(NAMESPACE, &name), object);
        let selector = if selects { " (node selector pool=a)" } else { "" };
        let class = if metal { format!(" (class {METAL_CLASS})") } else { String::new() };
        self.log(format!("service {name} created{selector}{class}"));
        self.services.push(ServiceRec { name: name.clone(), ports, ranges: Vec::new(), deleted: false, selects, metal });
        name
    }

    fn edit_ports(&mut self, i: usize, port: i32) {
        let s = &mut self.services[i];
        if s.ports.contains(&port) {
            s.ports.retain(|p| *p != port);
        } else {
            s.ports.push(port);
        }
        let (name, ports) = (s.name.clone(), s.ports.clone());
        let spec = service_object(&name, &ports)["spec"]["ports"].clone();
        self.model.update(&Key::service(NAMESPACE, &name), |svc| svc["spec"]["ports"] = spec);
        self.log(format!("service {name} ports {ports:?}"));
    }

    /// The name the core gives the load balancer of Service `name` (upstream's: "a" and the
    /// UID without dashes, 32 characters).
    fn load_balancer_name(&self, name: &str) -> Option<String> {
        let svc = self.model.get(&Key::service(NAMESPACE, name))?;
        let uid = svc.pointer("/metadata/uid").and_then(Value::as_str)?;
        Some(format!("a{}", uid.replace('-', "")).chars().take(32).collect())
    }

    fn leader(&self) -> Option<usize> {
        (0..self.replicas.len()).find(|&s| self.replicas[s].as_ref().is_some_and(|r| self.model.leads(&r.identity)))
    }

    /// Two Services, a minute to settle, and the replica that leads then.
    async fn settled_leader(&mut self) -> Option<usize> {
        for _ in 0..2 {
            self.create_service();
        }
        tokio::time::sleep(Duration::from_secs(60)).await;
        let leader = self.leader();
        if leader.is_none() {
            self.model.violation("no replica leads a minute in");
        }
        leader
    }

    async fn script(&mut self, scenario: Scenario) {
        match scenario {
            Scenario::LateRenewalThenSilence => {
                let Some(leader) = self.settled_leader().await else { return };
                // The renewal written in the next 2 s (one, at the 2 s retry period) is answered
                // 7.4 s late; the next finds the connection silent.
                let late = Duration::from_millis(7_400);
                let lease_net = self.replicas[leader].as_ref().map(|r| r.lease_net.clone());
                let Some(lease_net) = lease_net else { return };
                lease_net.write_answer_delay_ms.store(7_400, std::sync::atomic::Ordering::Relaxed);
                self.faults.insert("Lease answered late, then silent");
                self.log(format!("replica slot {leader}'s Lease renewals answered 7.4 s late"));
                tokio::time::sleep(late + Duration::from_secs(2)).await;
                lease_net.write_answer_delay_ms.store(0, std::sync::atomic::Ordering::Relaxed);
                lease_net.down.store(true, std::sync::atomic::Ordering::Relaxed);
                self.log(format!("replica slot {leader}'s Lease connection silent"));
                // Work keeps coming for the whole time the lead changes hands: a port edited
                // every half second (an Ensure, its Events) and a Node every 3 s.
                for step in 0..50 {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    self.tend_replicas();
                    let live: Vec<usize> = (0..self.services.len()).filter(|&i| !self.services[i].deleted).collect();
                    if let Some(&i) = live.get(step % live.len().max(1)) {
                        self.edit_ports(i, 9000);
                    }
                    if step % 6 == 0 && self.nodes.len() < MAX_NODES {
                        self.add_node();
                    }
                }
                lease_net.down.store(false, std::sync::atomic::Ordering::Relaxed);
            }
            Scenario::NotReadyReplica => {
                if self.settled_leader().await.is_none() {
                    return;
                }
                let holder = self.model.holders().get(ccm_core::controllers::service::NAME).cloned();
                let Some(slot) = holder.and_then(|h| self.slot_of(&h)) else { return };
                self.take_sidecar_down(slot, Duration::from_secs(180));
                self.create_service();
                for _ in 0..30 {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    self.check_queues();
                }
            }
            Scenario::HalfOpenConnections => {
                let Some(leader) = self.settled_leader().await else { return };
                let net = self.replicas[leader].as_ref().map(|r| r.net.clone());
                let Some(net) = net else { return };
                net.half_open.store(true, std::sync::atomic::Ordering::Relaxed);
                self.faults.insert("half-open connections");
                self.log(format!("replica slot {leader}'s controller connections half-open for 30s"));
                tokio::time::sleep(Duration::from_secs(5)).await;
                self.add_node();
                self.edit_ports(0, 9000);
                tokio::time::sleep(Duration::from_secs(25)).await;
                net.half_open.store(false, std::sync::atomic::Ordering::Relaxed);
                self.log("new connections work again".into());
                self.add_node();
                tokio::time::sleep(Duration::from_secs(30)).await;
            }
            Scenario::OneLoadBalancerItemFailing => {
                let names: Vec<String> = (0..3).map(|_| self.create_service()).collect();
                tokio::time::sleep(Duration::from_secs(60)).await;
                let lbs: Vec<Option<String>> = names.iter().map(|n| self.load_balancer_name(n)).collect();
                let Some(sick) = lbs[0].clone() else { return };
                let fault = Fault {
                    method: "BatchUpdateLoadBalancerHosts".into(),
                    down: true,
                    code: FaultCode::Unavailable,
                    subject: Some(sick.clone()),
                    ..Default::default()
                };
                self.provider_fault("one load balancer's items failing", fault, Duration::from_secs(120));
                // Nodes join now and then, so that the sick item fails and backs off.
                for _ in 0..4 {
                    tokio::time::sleep(Duration::from_secs(10)).await;
                    self.add_node();
                }
                tokio::time::sleep(Duration::from_secs(10)).await;
                self.add_node();
                let (joined, name) = (Instant::now(), self.nodes[self.nodes.len() - 1].name.clone());
                let healthy: Vec<String> = lbs.iter().skip(1).flatten().cloned().collect();
                loop {
                    let snapshot = self.cloud.snapshot();
                    let reached = healthy
                        .iter()
                        .all(|lb| snapshot.load_balancers.iter().any(|l| &l.name == lb && l.nodes.iter().any(|n| n == &name)));
                    if reached {
                        self.log(format!("node {name} reached the healthy load balancers in {:?}", joined.elapsed()));
                        break;
                    }
                    if joined.elapsed() > HOSTS_WHILE_ONE_FAILS {
                        self.model.violation(format!(
                            "node {name} had not reached the healthy load balancers {}s after it joined, while {sick}'s items failed",
                            HOSTS_WHILE_ONE_FAILS.as_secs()
                        ));
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                tokio::time::sleep(Duration::from_secs(30)).await;
            }
        }
    }
}

/// What many seeds found.
#[derive(Debug, Default)]
pub struct Summary {
    pub seeds: u64,
    /// The seeds that broke an invariant, with what they broke.
    pub failed: Vec<Report>,
    /// How many seeds injected each kind of fault.
    pub faults: std::collections::BTreeMap<&'static str, u64>,
    /// Convergence times of the seeds that converged.
    pub convergence: Vec<Duration>,
    /// Wall time.
    pub took: Duration,
    /// The most heap any seed's world held, bytes.
    pub peak_heap: i64,
    /// The most any seed's heap grew over its steady state, bytes.
    pub steady_growth: i64,
    /// How many seeds ran each mode (or had each mode event).
    pub modes: std::collections::BTreeMap<&'static str, u64>,
    /// How many seeds ran each controller.
    pub controllers: std::collections::BTreeMap<String, u64>,
}

impl Summary {
    /// The longest convergence time seen.
    pub fn longest(&self) -> Option<Duration> {
        self.convergence.iter().max().copied()
    }

    /// The median convergence time.
    pub fn median(&self) -> Option<Duration> {
        let mut c = self.convergence.clone();
        c.sort();
        c.get(c.len() / 2).copied()
    }

    /// Seeds run per second of wall time.
    pub fn rate(&self) -> f64 {
        self.seeds as f64 / self.took.as_secs_f64().max(1e-9)
    }

    /// A printable account.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let secs = |d: Option<Duration>| d.map_or("-".to_string(), |d| format!("{}s", d.as_secs()));
        out.push_str(&format!(
            "seeds: {}  failed: {}  wall: {:.1}s  seeds/s: {:.2}\nconvergence after the faults end: median {}, longest {} (bound {}s)\n",
            self.seeds,
            self.failed.len(),
            self.took.as_secs_f64(),
            self.rate(),
            secs(self.median()),
            secs(self.longest()),
            SETTLE_BOUND.as_secs()
        ));
        out.push_str(&format!(
            "heap of a seed's world: largest {:.1} MiB (bound {} MiB), largest growth over a steady state {} KiB (bound {} KiB per Lease kept)\n",
            self.peak_heap as f64 / f64::from(1 << 20),
            HEAP_BOUND >> 20,
            self.steady_growth >> 10,
            STEADY_GROWTH_BOUND >> 10
        ));
        out.push_str("modes in the mix (seeds that ran each):\n");
        for (mode, n) in &self.modes {
            out.push_str(&format!("  {mode}: {n}\n"));
        }
        out.push_str("controllers in the mix (seeds that ran each):\n");
        for (controller, n) in &self.controllers {
            out.push_str(&format!("  {controller}: {n}\n"));
        }
        out.push_str("faults in the mix (seeds that had each):\n");
        for (kind, n) in &self.faults {
            out.push_str(&format!("  {kind}: {n}\n"));
        }
        for report in &self.failed {
            out.push_str(&format!(
                "seed {} broke {} invariant(s); replay: CCM_SIM_SEED={} ccm-simulate\n",
                report.seed,
                report.violations.len(),
                report.seed
            ));
            for v in report.violations.iter().take(5) {
                out.push_str(&format!("  {v}\n"));
            }
        }
        out
    }
}

/// Runs `seeds` on `jobs` threads (each seed on a runtime of its own, on virtual time).
pub fn run_seeds(seeds: std::ops::Range<u64>, jobs: usize) -> Summary {
    let started = std::time::Instant::now();
    let next = std::sync::atomic::AtomicU64::new(seeds.start);
    let reports = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..jobs.max(1) {
            scope.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if seed >= seeds.end {
                        break;
                    }
                    let report = run_seed(seed);
                    reports.lock().unwrap_or_else(|p| p.into_inner()).push(report);
                }
            });
        }
    });
    let mut summary = Summary { took: started.elapsed(), ..Default::default() };
    let mut reports = reports.into_inner().unwrap_or_else(|p| p.into_inner());
    reports.sort_by_key(|r| r.seed);
    for report in reports {
        summary.seeds += 1;
        for mode in &report.modes {
            *summary.modes.entry(mode).or_default() += 1;
        }
        for controller in &report.controllers {
            *summary.controllers.entry(controller.clone()).or_default() += 1;
        }
        for kind in &report.faults {
            *summary.faults.entry(kind).or_default() += 1;
        }
        if let Some(c) = report.converged_after {
            summary.convergence.push(c);
        }
        summary.peak_heap = summary.peak_heap.max(report.peak_heap);
        summary.steady_growth = summary.steady_growth.max(report.steady_growth);
        if !report.violations.is_empty() {
            summary.failed.push(report);
        }
    }
    summary
}
