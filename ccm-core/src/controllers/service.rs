//! The service controller (`service-lb-controller`): a cloud load balancer for every Service
//! of type LoadBalancer without a `loadBalancerClass` (or of `--load-balancer-class`).
//!
//! - The finalizer `service.kubernetes.io/load-balancer-cleanup` is added before the first
//!   Ensure and removed only after EnsureLoadBalancerDeleted succeeded, so nothing leaks.
//! - Ensure is called only when what the provider sees changed (ports, type, source ranges,
//!   affinity, requested IP, traffic policy, health-check port, IP families, annotations);
//!   a change of the node set alone is UpdateLoadBalancerHosts.
//! - The node set: Nodes with a providerID, not being deleted, without the
//!   `ToBeDeletedByClusterAutoscaler` taint, and whose
//!   `node.kubernetes.io/exclude-from-external-load-balancers` label, when present, reads as
//!   false (upstream parses it as a Go boolean: an empty or unparsable value excludes).
//!   Readiness plays no part. Node changes are coalesced for 50 ms, then every load balancer
//!   whose set changed is updated.
//! - Source ranges are upstream's: `spec.loadBalancerSourceRanges`, or when empty the
//!   `service.beta.kubernetes.io/load-balancer-source-ranges` annotation, each trimmed of
//!   whitespace, in canonical form, duplicates merged. A malformed one is a Warning Event and
//!   no provider call.
//! - Nothing leaks when the finalizer is bypassed: a Service the controller knew to have a
//!   load balancer that is deleted without the finalizer (or leaves type LoadBalancer without
//!   it) has its load balancer deleted from the event. After a restart, a sweep at start and
//!   every `--load-balancer-resync-period` lists the provider's load balancers (when it
//!   advertises listing) and deletes those named by our scheme for this cluster whose Service
//!   UID no longer exists, each confirmed by a read of the Service, at most
//!   `--max-load-balancer-deletions` per sweep (more, and it deletes none).
//! - Keys back off per Service (see `queue.rs`); a retry reads the newest Service from the
//!   cache. The controller's own writes (the finalizer, the status) are not changes: they
//!   never cut a backoff short.

use ccm_protocol::lock::Lock;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ccm_proto::v1::{self as pb, ServiceType};
use ccm_protocol::Error;
use ccm_protocol::names::{NameLimits, load_balancer_name, upstream_load_balancer_name};
use k8s_openapi::api::core::v1::{Node, Service};
use kube::Api;
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::ObjectRef;
use tokio::sync::Notify;
use tokio::sync::broadcast::{self, error::RecvError};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Context;
use crate::informer::Change;
use crate::node_util;
use crate::options::LoadBalancerNaming;
use crate::provider::convert;
use crate::provider::encoded::EncodedNodes;
use crate::queue::{Outcome, QueueConfig, WorkQueue};
use crate::wellknown::{ANNOTATION_LOAD_BALANCER_NAME, ANNOTATION_SOURCE_RANGES, FINALIZER, LABEL_EXCLUDE, TAINT_TO_BE_DELETED};

/// The controller's name.
pub const NAME: &str = "service-lb-controller";
const NODE_COALESCE: Duration = Duration::from_millis(50);
/// Queue keys of load balancers whose Service is gone: this prefix and the Service UID
/// (never a `namespace/name`: `!` is not allowed in either).
const ORPHAN_KEY: char = '!';
/// The queue key of one pass that updates the hosts of every load balancer whose Service is
/// as it was ensured, with BatchUpdateLoadBalancerHosts (when the provider advertises it).
const HOSTS_KEY: &str = "*hosts";

fn key(svc: &Service) -> String {
    format!("{}/{}", svc.metadata.namespace.as_deref().unwrap_or_default(), svc.metadata.name.as_deref().unwrap_or_default())
}

fn recorded_name(svc: &Service) -> Option<&str> {
    svc.metadata.annotations.as_ref()?.get(ANNOTATION_LOAD_BALANCER_NAME).map(String::as_str).filter(|n| !n.is_empty())
}

fn has_finalizer(svc: &Service) -> bool {
    svc.metadata.finalizers.as_ref().is_some_and(|f| f.iter().any(|f| f == FINALIZER))
}

fn is_load_balancer_type(svc: &Service) -> bool {
    svc.spec.as_ref().and_then(|s| s.type_.as_deref()) == Some("LoadBalancer")
}

fn has_ingress(svc: &Service) -> bool {
    svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|l| l.ingress.as_ref()).is_some_and(|i| !i.is_empty())
}

fn is_load_balancer(svc: &Service) -> bool {
    svc.spec.as_ref().and_then(|s| s.type_.as_deref()) == Some("LoadBalancer") && svc.metadata.deletion_timestamp.is_none()
}

/// What the controller acts on: what the provider sees, deletion, and the finalizer of a
/// Service that no longer wants a load balancer. The finalizer of one that does is the
/// controller's own write, so its appearance is no news (it would cut a backoff short).
fn fingerprint(svc: &Service) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    provider_fingerprint(svc).hash(&mut h);
    svc.metadata.deletion_timestamp.is_some().hash(&mut h);
    (has_finalizer(svc) && !is_load_balancer(svc)).hash(&mut h);
    h.finish()
}

/// The Service's source ranges as upstream reads them: the spec's, or when it has none the
/// annotation's (comma-separated); each trimmed, in canonical form (host bits cleared),
/// duplicates merged, in first-seen order. Empty: no restriction.
pub fn source_ranges(svc: &Service) -> Result<Vec<String>, String> {
    let spec: Vec<String> = svc.spec.as_ref().and_then(|s| s.load_balancer_source_ranges.clone()).unwrap_or_default();
    let (origin, texts): (&str, Vec<String>) = if !spec.is_empty() {
        ("spec.loadBalancerSourceRanges", spec)
    } else {
        let annotation = svc.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_SOURCE_RANGES));
        match annotation.map(|v| v.trim()).filter(|v| !v.is_empty()) {
            Some(v) => (ANNOTATION_SOURCE_RANGES, v.split(',').map(str::to_string).collect()),
            None => return Ok(Vec::new()),
        }
    };
    let mut out: Vec<String> = Vec::new();
    for text in &texts {
        let net: ipnet::IpNet =
            text.trim().parse().map_err(|_| format!("{origin}: {text:?} is not a CIDR (such as 10.0.0.0/8)"))?;
        let canonical = net.trunc().to_string();
        if !out.contains(&canonical) {
            out.push(canonical);
        }
    }
    Ok(out)
}

/// Whether the exclusion label keeps a Node out of load balancers: present and not one of
/// Go's `strconv.ParseBool` false values, as upstream reads it.
fn excluded_by_label(node: &Node) -> bool {
    let value = node.metadata.labels.as_ref().and_then(|l| l.get(LABEL_EXCLUDE));
    value.is_some_and(|v| !matches!(v.as_str(), "0" | "f" | "F" | "false" | "FALSE" | "False"))
}

/// What the provider sees of a Service; a change of it means a new Ensure.
fn provider_fingerprint(svc: &Service) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    if let Some(spec) = &svc.spec {
        spec.type_.hash(&mut h);
        spec.load_balancer_class.hash(&mut h);
        for p in spec.ports.iter().flatten() {
            (&p.name, &p.protocol, p.port, p.node_port, &p.app_protocol, target_port(p)).hash(&mut h);
        }
        spec.external_ips.hash(&mut h);
        spec.allocate_load_balancer_node_ports.hash(&mut h);
        spec.ip_family_policy.hash(&mut h);
        source_ranges(svc).hash(&mut h);
        spec.session_affinity.hash(&mut h);
        spec.session_affinity_config.as_ref().and_then(|c| c.client_ip.as_ref()).and_then(|c| c.timeout_seconds).hash(&mut h);
        spec.load_balancer_ip.hash(&mut h);
        spec.external_traffic_policy.hash(&mut h);
        spec.health_check_node_port.hash(&mut h);
        spec.ip_families.hash(&mut h);
    }
    // The core's own record of the load balancer name is not the Service's spec: writing it
    // is no change (it never cuts a backoff short, never calls for an Ensure).
    let annotations: BTreeMap<&String, &String> =
        svc.metadata.annotations.iter().flatten().filter(|(k, _)| *k != ANNOTATION_LOAD_BALANCER_NAME).collect();
    annotations.hash(&mut h);
    // Labels go to the provider but, as in upstream's needsUpdate, a label change alone is no
    // reason for an Ensure (and must not cut a failing Service's backoff short).
    h.finish()
}

/// A port's targetPort as text (a number or a port name); empty when unset.
fn target_port(p: &k8s_openapi::api::core::v1::ServicePort) -> String {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    match &p.target_port {
        Some(IntOrString::Int(n)) => n.to_string(),
        Some(IntOrString::String(s)) => s.clone(),
        None => String::new(),
    }
}

/// The Service's status.loadBalancer in the protocol's terms.
fn current_status(svc: &Service) -> pb::LoadBalancerStatus {
    let ingress = svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|l| l.ingress.clone()).unwrap_or_default();
    let protocol = |p: &str| match p {
        "UDP" => pb::Protocol::Udp,
        "SCTP" => pb::Protocol::Sctp,
        _ => pb::Protocol::Tcp,
    } as i32;
    pb::LoadBalancerStatus {
        ingress: ingress
            .into_iter()
            .map(|i| pb::LoadBalancerIngress {
                ip: i.ip.unwrap_or_default(),
                hostname: i.hostname.unwrap_or_default(),
                ip_mode: match i.ip_mode.as_deref() {
                    Some("Proxy") => pb::IpMode::Proxy,
                    Some("VIP") => pb::IpMode::Vip,
                    _ => pb::IpMode::Unspecified,
                } as i32,
                ports: i
                    .ports
                    .unwrap_or_default()
                    .into_iter()
                    .map(|p| pb::PortStatus {
                        port: p.port.max(0) as u32,
                        protocol: protocol(&p.protocol),
                        error: p.error.unwrap_or_default(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// Whether a Node is a load balancer backend.
pub fn is_backend(ctx: &Context, node: &Node) -> bool {
    node_util::provider_id(node).is_some()
        && node.metadata.deletion_timestamp.is_none()
        && !excluded_by_label(node)
        && !node_util::has_taint(node, TAINT_TO_BE_DELETED)
        && !ctx.ignores(node)
}

/// What of a Node a provider may select backends on (name, providerID, labels, addresses),
/// hashed into `h` without copying it.
fn hash_node(node: &Node, h: &mut impl Hasher) {
    node_util::name(node).hash(h);
    node_util::provider_id(node).hash(h);
    node.metadata.labels.hash(h);
    for a in node.status.as_ref().and_then(|s| s.addresses.as_ref()).into_iter().flatten() {
        (&a.type_, &a.address).hash(h);
    }
}

/// A fingerprint of what a load balancer sees of a Node.
fn node_fingerprint(node: &Node) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    hash_node(node, &mut h);
    h.finish()
}

/// The load balancers' node set as of one state of the Node cache: built once per change of
/// what a load balancer sees of the Nodes and shared by every Service's reconcile (at 5000
/// Services, building it per Service was most of the controller's CPU).
#[derive(Debug, Default)]
struct HostSet {
    /// How many backends.
    count: usize,
    /// Their fingerprint.
    hosts: u64,
    /// The backends, by name, until `proto` is made from them; then released, so that the set
    /// keeps no old version of a Node alive (heartbeats replace every Node every 10 s).
    nodes: Mutex<Vec<Arc<Node>>>,
    /// As the protocol sends them, made when first needed (the node feed only compares
    /// fingerprints).
    proto: std::sync::OnceLock<Vec<pb::LoadBalancerNode>>,
    /// Encoded once for every EnsureLoadBalancer and UpdateLoadBalancerHosts of this set.
    encoded: std::sync::OnceLock<EncodedNodes>,
}

impl HostSet {
    fn new(backends: Vec<Arc<Node>>) -> Self {
        let hosts = hosts_of(&backends);
        Self { count: backends.len(), hosts, nodes: Mutex::new(backends), proto: Default::default(), encoded: Default::default() }
    }

    /// The backends as the protocol sends them.
    fn proto(&self) -> &[pb::LoadBalancerNode] {
        self.proto.get_or_init(|| {
            let nodes = std::mem::take(&mut *self.nodes.locked());
            nodes
                .iter()
                .map(|n| pb::LoadBalancerNode {
                    name: node_util::name(n).to_string(),
                    provider_id: node_util::provider_id(n).unwrap_or_default().to_string(),
                    addresses: node_util::addresses(n).iter().map(convert::to_proto_address).collect(),
                    labels: n.metadata.labels.clone().unwrap_or_default().into_iter().collect(),
                })
                .collect()
        })
    }

    /// The backends encoded as a request's `nodes`.
    fn encoded(&self) -> &EncodedNodes {
        self.encoded.get_or_init(|| EncodedNodes::new(self.proto()))
    }

    fn is_empty(&self) -> bool {
        self.count == 0
    }
}

/// The fingerprint of a node set.
fn hosts_of(backends: &[Arc<Node>]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for n in backends {
        hash_node(n, &mut h);
    }
    h.finish()
}

/// The [`HostSet`] last built, valid while no Node change a load balancer sees came since.
#[derive(Debug, Default)]
struct HostSetCache {
    /// Bumped by the node feed on every such change.
    generation: std::sync::atomic::AtomicU64,
    /// The set, the generation it was built at and the provider identity it was built under
    /// (which Nodes are ignored depends on it).
    built: Mutex<Option<(u64, usize, Arc<HostSet>)>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ensured {
    spec: u64,
    hosts: u64,
    /// How many hosts it has.
    count: usize,
}

/// The service controller.
pub struct ServiceController {
    ctx: Context,
    queue: Arc<WorkQueue<String>>,
    /// What was last applied per Service: the spec fingerprint and the node set's.
    ensured: Mutex<HashMap<String, Ensured>>,
    /// When the node set last changed, for the node-sync latency metric.
    node_change_at: Mutex<Option<Instant>>,
    /// Load balancers to delete whose Service is gone or no longer wants one, by Service UID:
    /// the last Service seen (or, from a sweep, its namespace, name and UID).
    orphans: Mutex<HashMap<String, Service>>,
    /// UIDs of Services whose load balancer this controller deleted through the finalizer.
    cleaned: Mutex<std::collections::HashSet<String>>,
    /// The load balancer name of each Service, by UID, as last ensured (the cache may not
    /// show the recording annotation yet).
    names: Mutex<HashMap<String, String>>,
    /// The current node set.
    host_set: HostSetCache,
    /// The last non-empty node set, which a load balancer keeps when the set is emptied.
    last_backends: Mutex<Arc<HostSet>>,
    /// Services told that their load balancer keeps its name (once per process).
    kept_names: Mutex<std::collections::HashSet<String>>,
    /// The Services' ready pod endpoints, watched when the provider forwards to pods.
    endpoints: Arc<super::endpoints::EndpointIndex>,
    /// Whether the provider forwards to pods (read once, when it is first known).
    pod_endpoints: std::sync::atomic::AtomicBool,
}

impl ServiceController {
    /// A controller over `ctx`.
    pub fn new(ctx: Context) -> Self {
        let o = &ctx.options;
        let config =
            QueueConfig { base_delay: o.reconcile_backoff_base, max_delay: o.reconcile_backoff_max, qps: 100.0, burst: 500 };
        Self {
            ctx,
            queue: Arc::new(WorkQueue::new(config)),
            ensured: Default::default(),
            node_change_at: Default::default(),
            orphans: Default::default(),
            cleaned: Default::default(),
            names: Default::default(),
            host_set: Default::default(),
            last_backends: Default::default(),
            kept_names: Default::default(),
            endpoints: Default::default(),
            pod_endpoints: Default::default(),
        }
    }

    /// Whether `svc`'s load balancer is given pod endpoints: the provider forwards to pods and
    /// a port of the Service has no node port.
    fn sends_endpoints(&self, svc: &Service) -> bool {
        self.pod_endpoints.load(Ordering::Acquire)
            && svc.spec.as_ref().is_some_and(|s| s.ports.iter().flatten().any(|p| p.node_port.unwrap_or(0) == 0))
    }

    /// What was ensured of a Service: what the provider sees of its spec and, when it is
    /// given pod endpoints, of those.
    fn ensured_spec(&self, svc: &Service) -> u64 {
        if !self.sends_endpoints(svc) {
            return provider_fingerprint(svc);
        }
        let mut h = std::collections::hash_map::DefaultHasher::new();
        provider_fingerprint(svc).hash(&mut h);
        self.endpoints.fingerprint(&key(svc)).hash(&mut h);
        h.finish()
    }

    /// Once the provider is known: when it forwards to pods, watches EndpointSlices and
    /// queues each Service given endpoints whose endpoints changed (a plain trigger: a Service
    /// in backoff waits its turn).
    async fn endpoint_feed(self: Arc<Self>, stop: CancellationToken) {
        let mut changes = self.ctx.provider.changes();
        let identity = loop {
            if let Some(identity) = self.ctx.provider.identity() {
                break identity;
            }
            tokio::select! {
                _ = changes.changed() => {}
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stop.cancelled() => return,
            }
        };
        if !identity.pod_endpoints() {
            // Nothing to watch; a task of the controller that ends is its failure, so this
            // one waits for the stop like the others.
            stop.cancelled().await;
            return;
        }
        self.pod_endpoints.store(true, Ordering::Release);
        tracing::info!("the provider forwards to pods: watching EndpointSlices for Services without node ports");
        let api = match &self.ctx.options.service_namespace {
            Some(ns) => Api::namespaced(self.ctx.client.clone(), ns),
            None => Api::all(self.ctx.client.clone()),
        };
        let config = kube::runtime::watcher::Config::default().page_size(500);
        let this = self.clone();
        let changed = move |service: &str| {
            let (ns, name) = service.split_once('/').unwrap_or(("", service));
            if let Some(svc) = this.ctx.services.store().get(&ObjectRef::new(name).within(ns))
                && this.wants_lb(&svc)
                && this.sends_endpoints(&svc)
            {
                this.queue.add(service.to_string());
            }
        };
        self.endpoints.watch(api, config, changed, stop.clone()).await;
        // The watch ends only at the stop (or when its stream does, which is a failure).
        if !stop.is_cancelled() {
            tracing::error!("the EndpointSlice watch ended");
        }
    }

    fn handled(&self, svc: &Service) -> bool {
        let class = svc.spec.as_ref().and_then(|s| s.load_balancer_class.as_deref());
        class.is_none() || class == self.ctx.options.load_balancer_class.as_deref()
    }

    fn wants_lb(&self, svc: &Service) -> bool {
        svc.spec.as_ref().and_then(|s| s.type_.as_deref()) == Some("LoadBalancer")
            && self.handled(svc)
            && svc.metadata.deletion_timestamp.is_none()
    }

    fn interesting(&self, svc: &Service) -> bool {
        (self.wants_lb(svc) || has_finalizer(svc)) && self.handled(svc)
    }

    /// Runs until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        let this = Arc::new(self);
        // Subscribed before any worker builds a node set, so no change is missed.
        let node_changes = this.ctx.nodes.subscribe();
        let mut tasks = super::Tasks::default();
        tasks.spawn(this.clone().feed(stop.clone()));
        tasks.spawn(this.clone().node_feed(node_changes, stop.clone()));
        tasks.spawn(this.clone().sweep_loop(stop.clone()));
        tasks.spawn(this.clone().endpoint_feed(stop.clone()));
        for _ in 0..this.ctx.options.concurrent_service_syncs.max(1) {
            tasks.spawn(this.clone().worker());
        }

        tasks.supervise(NAME, &stop).await;
        this.queue.shutdown();
        // Dropped: every task aborted.
    }

    async fn feed(self: Arc<Self>, stop: CancellationToken) {
        let mut changes = self.ctx.services.subscribe();
        self.ctx.services.wait_synced().await;
        self.ctx.nodes.wait_synced().await;
        for svc in self.ctx.services.sorted() {
            if self.interesting(&svc) {
                self.queue.add_changed(key(&svc), fingerprint(&svc));
            }
        }
        let mut provider = self.ctx.provider.changes();
        let mut epochs = provider.borrow_and_update().epochs;
        loop {
            let change = tokio::select! {
                c = changes.recv() => c,
                _ = stop.cancelled() => return,
                Ok(()) = provider.changed() => {
                    let now = provider.borrow_and_update().epochs;
                    if now != epochs {
                        epochs = now;
                        self.ensure_all_again();
                    }
                    continue;
                }
            };
            match change {
                Ok(Change::Applied { new, .. }) => {
                    if self.interesting(&new) {
                        self.ctx.metrics.queue_add(NAME);
                        self.queue.add_changed(key(&new), fingerprint(&new));
                    } else if self.handled(&new) && self.ensured.locked().contains_key(&key(&new)) {
                        // It left type LoadBalancer with its finalizer removed by someone else.
                        self.ensured.locked().remove(&key(&new));
                        self.orphaned(&new, "no longer wants a load balancer and has no finalizer");
                    }
                }
                Ok(Change::Deleted(svc)) => {
                    let k = key(&svc);
                    self.queue.forget(&k);
                    let knew = self.ensured.locked().remove(&k).is_some() || has_ingress(&svc);
                    let uid = svc.metadata.uid.clone().unwrap_or_default();
                    let cleaned = self.cleaned.locked().remove(&uid);
                    if knew && !cleaned && self.handled(&svc) && is_load_balancer_type(&svc) {
                        self.orphaned(&svc, "was deleted without the finalizer");
                    }
                }
                Err(RecvError::Lagged(_)) => {
                    for svc in self.ctx.services.sorted() {
                        if self.interesting(&svc) {
                            self.queue.add(key(&svc));
                        }
                    }
                }
                Err(RecvError::Closed) => return,
            }
            self.ctx.metrics.queue_state(NAME, &self.queue);
        }
    }

    /// The provider may have lost its state (a new epoch): every load balancer gets a full
    /// Ensure at once, not at its next change or resync.
    fn ensure_all_again(&self) {
        self.ensured.locked().clear();
        let mut queued = 0;
        for svc in self.ctx.services.sorted() {
            if self.wants_lb(&svc) {
                self.queue.add(key(&svc));
                queued += 1;
            }
        }
        tracing::warn!(services = queued, "the provider's state may be lost (a new epoch); ensuring every load balancer again");
    }

    /// Queues the deletion of the load balancer of `svc`, a Service gone or no longer wanting
    /// one.
    fn orphaned(&self, svc: &Service, why: &str) {
        let Some(uid) = svc.metadata.uid.clone().filter(|u| !u.is_empty()) else { return };
        tracing::info!(service = %key(svc), %uid, "service {why}; deleting its load balancer");
        self.orphans.locked().insert(uid.clone(), svc.clone());
        self.queue.add(format!("{ORPHAN_KEY}{uid}"));
    }

    /// Sweeps for orphaned load balancers once the caches are synced and the provider is
    /// known, then every `--load-balancer-resync-period` (jittered up to twice it).
    async fn sweep_loop(self: Arc<Self>, stop: CancellationToken) {
        self.ctx.services.wait_synced().await;
        while self.ctx.provider.identity().is_none() {
            if !super::sleep_or_stop(Duration::from_secs(1), &stop).await {
                return;
            }
        }
        loop {
            match self.sweep().await {
                Ok(n) if n > 0 => tracing::info!(orphans = n, "load balancers of gone Services queued for deletion"),
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(%error, "listing load balancers failed; nothing deleted, next sweep at the next resync");
                    self.ctx.report_invalid_listing(NAME, &error).await;
                }
            }
            let period = self.ctx.options.load_balancer_resync_period;
            if period.is_zero() {
                // At start only; the task lives on until stop (one that ends is a failure).
                stop.cancelled().await;
                return;
            }
            let wait = period + period.mul_f64(crate::clock::jitter());
            if !super::sleep_or_stop(wait, &stop).await {
                return;
            }
        }
    }

    /// Lists the cluster's load balancers and queues the deletion of those named by our scheme
    /// for a Service UID that no longer exists (checked in the cache, then by reading the
    /// Service). Returns how many were queued. A failed page aborts the sweep.
    pub async fn sweep(&self) -> Result<usize, Error> {
        let Some(identity) = self.ctx.provider.identity() else { return Ok(0) };
        let caps = identity.capabilities.load_balancers.clone().unwrap_or_default();
        if !identity.serves(ServiceType::LoadBalancers) || !caps.list {
            return Ok(0);
        }
        let limits = NameLimits::from_capabilities(&caps);
        let cluster = self.ctx.options.cluster_name.clone();
        let listed = self.ctx.provider.list_load_balancers(&cluster).await?;
        let known: std::collections::HashSet<String> =
            self.ctx.services.store().state().iter().filter_map(|s| s.metadata.uid.clone()).collect();
        let pending: std::collections::HashSet<String> = self.orphans.locked().keys().cloned().collect();
        let scope = self.ctx.options.service_namespace.as_deref();
        let suspects: Vec<pb::LoadBalancerSummary> = listed
            .into_iter()
            .filter(|l| !l.uid.is_empty() && !known.contains(&l.uid) && !pending.contains(&l.uid))
            .filter(|l| scope.is_none_or(|ns| ns == l.namespace))
            // Ours by name, and of this cluster: a readable name carries the cluster; an
            // upstream one (`a` + UID) does not, so it needs the provider's record of the
            // cluster it was ensured with. A listing that strays into another cluster's load
            // balancers (UIDs this cluster never had) deletes none of them.
            .filter(|l| l.cluster_name.is_empty() || l.cluster_name == cluster)
            .filter(|l| {
                load_balancer_name(&cluster, &l.namespace, &l.name, &l.uid, &limits) == l.load_balancer_name
                    || (upstream_load_balancer_name(&l.uid, &limits) == l.load_balancer_name && l.cluster_name == cluster)
            })
            .collect();
        // The cache may lag: only a read of the Service that finds it gone (or under
        // another UID) confirms it.
        let mut confirmed = Vec::new();
        for l in suspects {
            let api: Api<Service> = Api::namespaced(self.ctx.client.clone(), &l.namespace);
            match api.get_opt(&l.name).await {
                Ok(Some(svc)) if svc.metadata.uid.as_deref() == Some(l.uid.as_str()) => {}
                Ok(_) => confirmed.push(l),
                Err(error) => {
                    tracing::warn!(service = %format!("{}/{}", l.namespace, l.name), %error, "could not confirm that the service is gone; its load balancer stays")
                }
            }
        }
        let max = self.ctx.options.max_load_balancer_deletions;
        if confirmed.len() > max {
            let names: Vec<&str> = confirmed.iter().map(|l| l.load_balancer_name.as_str()).collect();
            tracing::warn!(
                orphans = confirmed.len(),
                max,
                load_balancers = ?names,
                "more load balancers look orphaned than --max-load-balancer-deletions allows in one sweep; deleting none"
            );
            self.ctx.metrics.load_balancer_orphans("refused", confirmed.len() as u64);
            return Ok(0);
        }
        for l in &confirmed {
            let svc = Service {
                metadata: kube::api::ObjectMeta {
                    namespace: Some(l.namespace.clone()),
                    name: Some(l.name.clone()),
                    uid: Some(l.uid.clone()),
                    annotations: Some([(ANNOTATION_LOAD_BALANCER_NAME.to_string(), l.load_balancer_name.clone())].into()),
                    ..Default::default()
                },
                ..Default::default()
            };
            self.orphaned(&svc, "is gone (found by the load balancer sweep)");
        }
        Ok(confirmed.len())
    }

    /// Deletes the load balancer of a gone Service (queue key `!<uid>`).
    async fn delete_orphan(&self, uid: &str) -> Outcome {
        let Some(svc) = self.orphans.locked().get(uid).cloned() else {
            return Outcome::Success;
        };
        // Wanted again (same UID: the type changed back): the normal path owns it.
        let back =
            self.ctx.services.store().state().into_iter().any(|s| s.metadata.uid.as_deref() == Some(uid) && self.interesting(&s));
        if back {
            self.orphans.locked().remove(uid);
            return Outcome::Success;
        }
        if self.ctx.provider.identity().is_none() {
            return Outcome::Retry { fingerprint: None, retry_after: None };
        }
        let name = self.lb_name(&svc);
        match self.delete_every_name(&svc).await {
            Ok(()) => {
                self.orphans.locked().remove(uid);
                self.ctx.metrics.load_balancer_orphans("deleted", 1);
                tracing::info!(service = %key(&svc), %uid, load_balancer = %name, "deleted the load balancer of a gone service");
                let note = format!("Deleted load balancer {name}: its Service is gone or no longer wants one");
                self.ctx.event(NAME, &svc, false, "DeletedLoadBalancer", note).await;
                Outcome::Success
            }
            Err(error) => {
                tracing::warn!(service = %key(&svc), %uid, %error, "deleting the load balancer of a gone service failed");
                Outcome::of_provider_error(None, &error)
            }
        }
    }

    /// Deletes `svc`'s load balancer under every name it may have: the one it was made under
    /// (either naming's when that was never recorded) and the configured naming's (a rename
    /// half done). Each name is the Service's own (it holds its UID), so none can be another
    /// Service's load balancer.
    async fn delete_every_name(&self, svc: &Service) -> Result<(), Error> {
        let mut names = vec![self.lb_name(svc)];
        match recorded_name(svc) {
            Some(recorded) => names.push(recorded.to_string()),
            // Never recorded (made by upstream, or by an older core): either naming's.
            None => names.extend([LoadBalancerNaming::Upstream, LoadBalancerNaming::Readable].map(|n| self.name_under(svc, n))),
        }
        names.push(self.name_under(svc, self.ctx.options.load_balancer_naming));
        names.sort();
        names.dedup();
        for name in names {
            self.ctx.provider.ensure_load_balancer_deleted(self.ctx.fence(), self.lb_service_named(svc, name)).await?;
        }
        if let Some(uid) = svc.metadata.uid.as_deref() {
            self.names.locked().remove(uid);
        }
        Ok(())
    }

    /// Watches the node set; on a change (after 50 ms of quiet coalescing) queues every
    /// load balancer Service. Services in backoff stay there: `add` carries no news.
    async fn node_feed(self: Arc<Self>, mut changes: broadcast::Receiver<Change<Node>>, stop: CancellationToken) {
        let notify = Arc::new(Notify::new());
        let waker = notify.clone();
        let this = self.clone();
        let stop2 = stop.clone();
        // Aborted with this task (a Tasks guard), not left running if the feed is aborted.
        let mut syncer = super::Tasks::default();
        syncer.spawn(async move {
            let mut last = this.hosts_fingerprint();
            loop {
                tokio::select! {
                    _ = waker.notified() => {}
                    _ = stop2.cancelled() => return,
                }
                tokio::time::sleep(NODE_COALESCE).await;
                // No load balancer, nothing to update (a cluster's join before its Services).
                let services = this.ctx.services.sorted();
                if !services.iter().any(|s| this.wants_lb(s)) {
                    continue;
                }
                let now = this.hosts_fingerprint();
                if now == last {
                    continue;
                }
                last = now;
                this.node_change_at.locked().get_or_insert(Instant::now());
                if this.ctx.provider.identity().is_some_and(|i| i.bulk_hosts()) {
                    this.queue.add(HOSTS_KEY.to_string());
                    continue;
                }
                for svc in services {
                    if this.wants_lb(&svc) {
                        this.queue.add(key(&svc));
                    }
                }
            }
        });
        loop {
            let change = tokio::select! {
                c = changes.recv() => c,
                _ = stop.cancelled() => break,
            };
            match change {
                Ok(Change::Applied { old, new }) => {
                    let before = old.as_deref().map(|o| (is_backend(&self.ctx, o), node_fingerprint(o)));
                    if before != Some((is_backend(&self.ctx, &new), node_fingerprint(&new))) {
                        self.host_set.generation.fetch_add(1, Ordering::AcqRel);
                        notify.notify_one();
                    }
                }
                Ok(Change::Deleted(_)) | Err(RecvError::Lagged(_)) => {
                    self.host_set.generation.fetch_add(1, Ordering::AcqRel);
                    notify.notify_one();
                }
                Err(RecvError::Closed) => break,
            }
        }
        drop(syncer);
    }

    /// The current node set: the one last built, unless a Node change a load balancer sees
    /// (or a new provider identity) came since.
    fn backends(&self) -> Arc<HostSet> {
        let identity = self.ctx.provider.identity();
        let identity_key = identity.as_ref().map_or(0, |i| Arc::as_ptr(i) as usize);
        // Read before the store: a change during the build leaves the set stale, and it is
        // built again at the next call.
        let generation = self.host_set.generation.load(Ordering::Acquire);
        let mut built = self.host_set.built.locked();
        if let Some((g, i, set)) = built.as_ref()
            && *g == generation
            && *i == identity_key
        {
            return set.clone();
        }
        let set = Arc::new(HostSet::new(self.backend_nodes()));
        *built = Some((generation, identity_key, set.clone()));
        set
    }

    /// The backends in the cache, by name.
    fn backend_nodes(&self) -> Vec<Arc<Node>> {
        let mut nodes: Vec<Arc<Node>> = self.ctx.nodes.store().state().into_iter().filter(|n| is_backend(&self.ctx, n)).collect();
        nodes.sort_by(|a, b| node_util::name(a).cmp(node_util::name(b)));
        nodes
    }

    /// The node set's fingerprint, as [`ServiceController::backends`] has it (the same set the
    /// workers will use: a fingerprint read from a cache ahead of the set would be lost).
    fn hosts_fingerprint(&self) -> u64 {
        self.backends().hosts
    }

    async fn worker(self: Arc<Self>) {
        while let Some(k) = self.queue.next().await {
            let started = Instant::now();
            let outcome = self.reconcile(&k).await;
            self.ctx.metrics.reconcile(NAME, started.elapsed(), matches!(outcome, Outcome::Retry { .. }));
            self.queue.done(&k, outcome);
            self.ctx.metrics.queue_state(NAME, &self.queue);
            let idle = self.queue.stats().depth == 0;
            if idle && let Some(at) = self.node_change_at.locked().take() {
                self.ctx.metrics.service_node_sync(at.elapsed());
            }
        }
    }

    /// The protocol's view of a Service. Its source ranges must have been checked with
    /// [`source_ranges`]; a malformed one is left out here.
    fn limits(&self) -> NameLimits {
        self.ctx
            .provider
            .identity()
            .and_then(|i| i.capabilities.load_balancers.clone())
            .map(|c| NameLimits::from_capabilities(&c))
            .unwrap_or_default()
    }

    /// The name of `svc`'s load balancer under `naming`.
    fn name_under(&self, svc: &Service, naming: LoadBalancerNaming) -> String {
        let uid = svc.metadata.uid.as_deref().unwrap_or_default();
        match naming {
            LoadBalancerNaming::Upstream => upstream_load_balancer_name(uid, &self.limits()),
            LoadBalancerNaming::Readable => load_balancer_name(
                &self.ctx.options.cluster_name,
                svc.metadata.namespace.as_deref().unwrap_or_default(),
                svc.metadata.name.as_deref().unwrap_or_default(),
                uid,
                &self.limits(),
            ),
        }
    }

    /// The name `svc`'s load balancer has: the one it was made under (as this controller
    /// last ensured it, or as recorded on the Service), unless renaming is allowed; else the
    /// configured naming's.
    fn lb_name(&self, svc: &Service) -> String {
        if !self.ctx.options.allow_load_balancer_renaming {
            let uid = svc.metadata.uid.as_deref().unwrap_or_default();
            if let Some(name) = self.names.locked().get(uid) {
                return name.clone();
            }
            if let Some(name) = recorded_name(svc) {
                return name.to_string();
            }
        }
        self.name_under(svc, self.ctx.options.load_balancer_naming)
    }

    /// The name to ensure `svc`'s load balancer under, and the old name to delete after (a
    /// rename the operator allowed). A load balancer made before its name was recorded (by
    /// upstream's cloud-controller-manager, or by this core under the other naming) is looked
    /// up under the other naming first, and kept under it when it exists there.
    async fn naming(&self, svc: &Service) -> Result<(String, Option<String>), Error> {
        let naming = self.ctx.options.load_balancer_naming;
        let configured = self.name_under(svc, naming);
        let recorded = recorded_name(svc).map(str::to_string);
        if let Some(recorded) = recorded {
            if recorded == configured {
                return Ok((configured, None));
            }
            if self.ctx.options.allow_load_balancer_renaming {
                return Ok((configured, Some(recorded)));
            }
            if self.kept_names.locked().insert(key(svc)) {
                let note = format!(
                    "The load balancer keeps its name {recorded}; --load-balancer-naming would name it {configured} \
                     (--allow-load-balancer-renaming makes it anew under that name, usually with a new address)"
                );
                self.ctx.event(NAME, svc, false, "LoadBalancerNameKept", note).await;
            }
            return Ok((recorded, None));
        }
        if !has_ingress(svc) {
            return Ok((configured, None));
        }
        let other = match naming {
            LoadBalancerNaming::Upstream => LoadBalancerNaming::Readable,
            LoadBalancerNaming::Readable => LoadBalancerNaming::Upstream,
        };
        let other = self.name_under(svc, other);
        if self.ctx.provider.get_load_balancer(self.lb_service_named(svc, other.clone())).await?.is_some() {
            tracing::info!(service = %key(svc), load_balancer = %other, "adopted a load balancer made under the other naming");
            return Ok((other, None));
        }
        Ok((configured, None))
    }

    fn lb_service_named(&self, svc: &Service, load_balancer_name: String) -> pb::LoadBalancerService {
        let spec = svc.spec.clone().unwrap_or_default();
        let (ns, name, uid) = (
            svc.metadata.namespace.clone().unwrap_or_default(),
            svc.metadata.name.clone().unwrap_or_default(),
            svc.metadata.uid.clone().unwrap_or_default(),
        );
        let protocol = |p: Option<&str>| match p.unwrap_or("TCP") {
            "UDP" => pb::Protocol::Udp,
            "SCTP" => pb::Protocol::Sctp,
            _ => pb::Protocol::Tcp,
        } as i32;
        let sends_endpoints = self.sends_endpoints(svc);
        let service_key = key(svc);
        let endpoints = |p: &k8s_openapi::api::core::v1::ServicePort| {
            if !sends_endpoints || p.node_port.unwrap_or(0) != 0 {
                return Vec::new();
            }
            let name = p.name.as_deref().unwrap_or_default();
            self.endpoints.port_endpoints(&service_key, name, p.protocol.as_deref().unwrap_or("TCP"))
        };
        pb::LoadBalancerService {
            cluster_name: self.ctx.options.cluster_name.clone(),
            load_balancer_name,
            namespace: ns,
            name,
            uid,
            ports: spec
                .ports
                .iter()
                .flatten()
                .map(|p| pb::ServicePort {
                    name: p.name.clone().unwrap_or_default(),
                    protocol: protocol(p.protocol.as_deref()),
                    port: p.port.max(0) as u32,
                    node_port: p.node_port.unwrap_or(0).max(0) as u32,
                    app_protocol: p.app_protocol.clone().unwrap_or_default(),
                    target_port: target_port(p),
                    endpoints: endpoints(p),
                })
                .collect(),
            session_affinity: if spec.session_affinity.as_deref() == Some("ClientIP") {
                pb::SessionAffinity::ClientIp
            } else {
                pb::SessionAffinity::None
            } as i32,
            session_affinity_timeout_seconds: spec
                .session_affinity_config
                .and_then(|c| c.client_ip)
                .and_then(|c| c.timeout_seconds)
                .unwrap_or(0)
                .max(0) as u32,
            source_ranges: source_ranges(svc).unwrap_or_default(),
            ip_families: spec
                .ip_families
                .unwrap_or_default()
                .iter()
                .map(|f| if f == "IPv6" { pb::IpFamily::Ipv6 } else { pb::IpFamily::Ipv4 } as i32)
                .collect(),
            requested_ip: spec.load_balancer_ip.unwrap_or_default(),
            external_traffic_policy: if spec.external_traffic_policy.as_deref() == Some("Local") {
                pb::ExternalTrafficPolicy::Local
            } else {
                pb::ExternalTrafficPolicy::Cluster
            } as i32,
            health_check_node_port: spec.health_check_node_port.unwrap_or(0).max(0) as u32,
            annotations: svc
                .metadata
                .annotations
                .clone()
                .unwrap_or_default()
                .into_iter()
                .filter(|(k, _)| k != ANNOTATION_LOAD_BALANCER_NAME)
                .collect(),
            load_balancer_class: spec.load_balancer_class.unwrap_or_default(),
            external_ips: spec.external_ips.unwrap_or_default(),
            allocate_load_balancer_node_ports: spec.allocate_load_balancer_node_ports,
            ip_family_policy: match spec.ip_family_policy.as_deref() {
                Some("SingleStack") => pb::IpFamilyPolicy::SingleStack,
                Some("PreferDualStack") => pb::IpFamilyPolicy::PreferDualStack,
                Some("RequireDualStack") => pb::IpFamilyPolicy::RequireDualStack,
                _ => pb::IpFamilyPolicy::Unspecified,
            } as i32,
            labels: svc.metadata.labels.clone().unwrap_or_default().into_iter().collect(),
            current_status: Some(current_status(svc)),
        }
    }

    async fn reconcile(&self, k: &str) -> Outcome {
        if let Some(uid) = k.strip_prefix(ORPHAN_KEY) {
            return self.delete_orphan(uid).await;
        }
        if k == HOSTS_KEY {
            return self.update_all_hosts().await;
        }
        let (ns, name) = k.split_once('/').unwrap_or(("", k));
        // Always the newest Service: never a copy from before a failure.
        let Some(svc) = self.ctx.services.store().get(&ObjectRef::new(name).within(ns)) else {
            return Outcome::Success;
        };
        let fp = fingerprint(&svc);
        let result = if self.wants_lb(&svc) {
            self.ensure(&svc).await
        } else if has_finalizer(&svc) && self.handled(&svc) {
            self.delete(&svc).await
        } else {
            Ok(())
        };
        match result {
            Ok(()) => Outcome::Success,
            // Throttled is no failure: the backoff does not grow while the cloud paces us.
            Err(SyncError::Provider(error)) => Outcome::of_provider_error(Some(fp), &error),
            Err(SyncError::Kube(error)) => {
                tracing::warn!(service = %k, %error, "writing the service failed");
                Outcome::Retry { fingerprint: Some(fp), retry_after: None }
            }
            // Retried when the Service changes, and otherwise after the longest backoff.
            Err(SyncError::Invalid) => {
                Outcome::Retry { fingerprint: Some(fp), retry_after: Some(self.ctx.options.reconcile_backoff_max) }
            }
        }
    }

    /// Brings a Service's load balancer to what it asks for: the finalizer (and the name)
    /// recorded first, then only the hosts updated when the spec is what was ensured last, or
    /// a full Ensure.
    async fn ensure(&self, svc: &Service) -> Result<(), SyncError> {
        let k = key(svc);
        if self.ctx.provider.identity().is_some_and(|i| !i.serves(ServiceType::LoadBalancers)) {
            return Ok(());
        }
        if self.ctx.provider.identity().is_none() {
            return Err(SyncError::Provider(Error::unavailable("provider not ready")));
        }
        if let Err(why) = source_ranges(svc) {
            tracing::warn!(service = %k, %why, "invalid service; no load balancer until it is fixed");
            self.ctx.event(NAME, svc, true, "SyncLoadBalancerFailed", format!("Invalid service: {why}")).await;
            return Err(SyncError::Invalid);
        }
        let (lb_name, old_name) = self.naming(svc).await.map_err(SyncError::Provider)?;
        self.record_finalizer(svc, &lb_name, old_name.is_none()).await?;
        if let Some(uid) = svc.metadata.uid.clone() {
            self.names.locked().insert(uid, lb_name.clone());
        }
        // A rename waiting is a full Ensure under the new name.
        let last = self.ensured.locked().get(&k).copied().filter(|_| old_name.is_none());
        let Some(backends) = self.backends_for(svc, last).await else { return Ok(()) };
        let ensured = Ensured { spec: self.ensured_spec(svc), hosts: backends.hosts, count: backends.count };
        match last {
            Some(e) if e.spec == ensured.spec && e.hosts == ensured.hosts => Ok(()),
            Some(e) if e.spec == ensured.spec => {
                self.update_hosts(svc, self.lb_service_named(svc, lb_name), backends.encoded(), ensured).await
            }
            _ => {
                let lb = self.lb_service_named(svc, lb_name);
                self.ensure_load_balancer(svc, lb, backends.encoded(), old_name, ensured).await
            }
        }
    }

    /// Adds the finalizer when it is missing, and records `lb_name` when it is not the name
    /// recorded (`record`: not while a rename waits, whose new name is recorded once the old
    /// load balancer is gone): before the load balancer is made under it.
    async fn record_finalizer(&self, svc: &Service, lb_name: &str, record: bool) -> Result<(), SyncError> {
        let record = record && recorded_name(svc) != Some(lb_name);
        if has_finalizer(svc) && !record {
            return Ok(());
        }
        let mut finalizers = svc.metadata.finalizers.clone().unwrap_or_default();
        if !has_finalizer(svc) {
            finalizers.push(FINALIZER.into());
        }
        let mut metadata = serde_json::json!({ "finalizers": finalizers, "resourceVersion": svc.metadata.resource_version });
        if record {
            metadata["annotations"] = serde_json::json!({ ANNOTATION_LOAD_BALANCER_NAME: lb_name });
        }
        self.ctx.kube_write_permit().await;
        let patch = serde_json::json!({ "metadata": metadata });
        let api: Api<Service> = Api::namespaced(self.ctx.client.clone(), svc.metadata.namespace.as_deref().unwrap_or_default());
        let name = svc.metadata.name.as_deref().unwrap_or_default();
        api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await.map_err(SyncError::Kube)?;
        Ok(())
    }

    /// The Nodes the load balancer should have; `None` when it is to be left as it is. An
    /// empty set never empties a load balancer that had hosts (`last`, or, unknown since this
    /// process started, its ingress): it keeps the last hosts it was given.
    async fn backends_for(&self, svc: &Service, last: Option<Ensured>) -> Option<Arc<HostSet>> {
        let backends = self.backends();
        let had_hosts = last.map_or_else(|| has_ingress(svc), |e| e.count > 0);
        if backends.is_empty() && had_hosts {
            // An empty node set is far likelier a listing glitch (an API server that came back
            // empty, every Node excluded by a bad label) than a cluster that wants its load
            // balancers cut off: the load balancer keeps the last hosts it was given (a spec
            // change is still applied, with them), or, with none known since this process
            // started, is left as it is.
            tracing::warn!(service = %key(svc), "no Node is a load balancer backend; the load balancer keeps its hosts");
            let note = "No Node is a load balancer backend now: the load balancer keeps its current hosts \
                        instead of being emptied, until a Node is one again"
                .to_string();
            self.ctx.event(NAME, svc, true, "UnAvailableLoadBalancer", note).await;
            let last = self.last_backends.locked().clone();
            return (!last.is_empty()).then_some(last);
        }
        if backends.is_empty() {
            let note = "There are no available nodes for LoadBalancer".to_string();
            self.ctx.event(NAME, svc, true, "UnAvailableLoadBalancer", note).await;
        } else {
            self.remember_backends(&backends);
        }
        Some(backends)
    }

    /// Keeps `backends` as the last non-empty set.
    fn remember_backends(&self, backends: &Arc<HostSet>) {
        *self.last_backends.locked() = backends.clone();
    }

    /// After the node set changed, with a provider that updates hosts in bulk: one
    /// BatchUpdateLoadBalancerHosts per 500 load balancers whose Service is as it was last
    /// ensured under its recorded name. Every other Service (not ensured yet, changed, being
    /// renamed, or with no backend left, which keeps its hosts) takes its own reconcile, and
    /// so does each load balancer whose item failed: at once when it failed for good, after
    /// the item's RetryInfo (or the first backoff) when transiently, then with its own
    /// per-key backoff. Only a failure of the whole call retries the pass: one failing load
    /// balancer must not hold back the others' next node change (the shared key's backoff
    /// grows to minutes and a node change cannot cut it short).
    async fn update_all_hosts(&self) -> Outcome {
        let Some(identity) = self.ctx.provider.identity() else {
            return Outcome::of_provider_error(None, &Error::unavailable("provider not ready"));
        };
        if !identity.serves(ServiceType::LoadBalancers) {
            return Outcome::Success;
        }
        let backends = self.backends();
        let hosts = backends.hosts;
        let mut todo = Vec::new();
        for svc in self.ctx.services.sorted() {
            if !self.wants_lb(&svc) {
                continue;
            }
            let k = key(&svc);
            let last = self.ensured.locked().get(&k).copied();
            let uid = svc.metadata.uid.as_deref().unwrap_or_default();
            let name = self.names.locked().get(uid).cloned();
            let as_ensured = last.is_some_and(|e| e.spec == provider_fingerprint(&svc))
                && has_finalizer(&svc)
                && name.is_some()
                && recorded_name(&svc) == name.as_deref()
                && source_ranges(&svc).is_ok();
            match (last, name) {
                (Some(e), Some(name)) if as_ensured && !backends.is_empty() => {
                    if e.hosts != hosts {
                        let ensured = Ensured { spec: e.spec, hosts, count: backends.count };
                        todo.push((svc.clone(), self.lb_service_named(&svc, name), ensured));
                    }
                }
                _ => self.queue.add(k),
            }
        }
        if todo.is_empty() {
            return Outcome::Success;
        }
        self.remember_backends(&backends);
        let services: Vec<pb::LoadBalancerService> = todo.iter().map(|(_, lb, _)| lb.clone()).collect();
        let started = Instant::now();
        let results = self.ctx.provider.batch_update_load_balancer_hosts(self.ctx.fence(), &services, backends.proto()).await;
        let (results, call_failed) = results;
        for ((svc, _, ensured), result) in todo.into_iter().zip(results) {
            self.ctx.metrics.hosts_update(started.elapsed(), result.is_err());
            let k = key(&svc);
            match result {
                Ok(()) => {
                    self.ensured.locked().insert(k, ensured);
                    let note = format!("Updated load balancer with new hosts ({})", ensured.count);
                    self.ctx.event(NAME, svc.as_ref(), false, "UpdatedLoadBalancer", note).await;
                }
                // A call that failed as a whole is the pass's to retry (below): its load
                // balancers are still not as ensured, the others are.
                Err(_) if call_failed.as_ref().is_some_and(Error::is_transient) => {}
                Err(error) if error.is_transient() => {
                    tracing::debug!(service = %k, %error, "updating the load balancer's hosts failed; retried alone");
                    self.queue.add_after(k, error.retry_after().unwrap_or_else(|| self.queue.backoff(1)));
                }
                Err(error) => {
                    tracing::warn!(service = %k, %error, "updating the load balancer's hosts failed");
                    let note = format!("Error updating load balancer with new hosts: {error}");
                    self.ctx.event(NAME, svc.as_ref(), true, "UpdateLoadBalancerFailed", note).await;
                    // A load balancer that vanished gets a full Ensure.
                    if matches!(error, Error::NotFound { .. }) {
                        self.ensured.locked().remove(&k);
                    }
                    self.queue.add(k);
                }
            }
        }
        match call_failed {
            Some(error) if error.is_transient() => Outcome::of_provider_error(None, &error),
            _ => Outcome::Success,
        }
    }

    /// UpdateLoadBalancerHosts: the spec is what was ensured, only the Nodes changed.
    async fn update_hosts(
        &self,
        svc: &Service,
        lb: pb::LoadBalancerService,
        nodes: &EncodedNodes,
        ensured: Ensured,
    ) -> Result<(), SyncError> {
        let k = key(svc);
        let started = Instant::now();
        let r = self.ctx.provider.update_load_balancer_hosts(self.ctx.fence(), lb, nodes).await;
        self.ctx.metrics.hosts_update(started.elapsed(), r.is_err());
        match r {
            Ok(_) => {
                self.ensured.locked().insert(k, ensured);
                let note = format!("Updated load balancer with new hosts ({})", ensured.count);
                self.ctx.event(NAME, svc, false, "UpdatedLoadBalancer", note).await;
                Ok(())
            }
            Err(error @ Error::RateLimited { .. }) => Err(SyncError::Provider(error)),
            Err(error) => {
                let note = format!("Error updating load balancer with new hosts: {error}");
                self.ctx.event(NAME, svc, true, "UpdateLoadBalancerFailed", note).await;
                // A load balancer that vanished gets a full Ensure next time.
                if matches!(error, Error::NotFound { .. }) {
                    self.ensured.locked().remove(&k);
                }
                Err(SyncError::Provider(error))
            }
        }
    }

    /// EnsureLoadBalancer, the status written, a waiting rename finished.
    async fn ensure_load_balancer(
        &self,
        svc: &Service,
        lb: pb::LoadBalancerService,
        nodes: &EncodedNodes,
        old_name: Option<String>,
        ensured: Ensured,
    ) -> Result<(), SyncError> {
        let k = key(svc);
        let lb_name = lb.load_balancer_name.clone();
        self.ctx.event(NAME, svc, false, "EnsuringLoadBalancer", "Ensuring load balancer".into()).await;
        let status = match self.ctx.provider.ensure_load_balancer(self.ctx.fence(), lb, nodes).await {
            Ok(status) => {
                self.ctx.metrics.load_balancer_sync();
                status
            }
            // The cloud pacing the controller is no failure to report (at 5000 Services, two
            // refused attempts for each made would be 10,000 Warnings and log lines).
            Err(error @ Error::RateLimited { .. }) => {
                tracing::debug!(service = %k, %error, "ensuring the load balancer waits for the cloud's rate limit");
                return Err(SyncError::Provider(error));
            }
            // An answer that failed the checks: reported as such (the README's promise), not
            // as a failed sync; nothing of it is written.
            Err(error) if crate::provider::check::is_invalid(&error) => {
                self.ctx.report_invalid(NAME, svc, &error).await;
                return Err(SyncError::Provider(error));
            }
            Err(error) => {
                tracing::warn!(service = %k, %error, "ensuring the load balancer failed");
                self.ctx.event(NAME, svc, true, "SyncLoadBalancerFailed", format!("Error syncing load balancer: {error}")).await;
                return Err(SyncError::Provider(error));
            }
        };
        self.write_status(svc, &status).await.map_err(SyncError::Kube)?;
        if let Some(old) = old_name {
            self.finish_rename(svc, &old, &lb_name).await?;
        }
        self.ensured.locked().insert(k, ensured);
        self.ctx.event(NAME, svc, false, "EnsuredLoadBalancer", "Ensured load balancer".into()).await;
        Ok(())
    }

    /// After a load balancer was made under its new name (--allow-load-balancer-renaming):
    /// the old one is deleted, then the new name recorded.
    async fn finish_rename(&self, svc: &Service, old: &str, new: &str) -> Result<(), SyncError> {
        let lb = self.lb_service_named(svc, old.to_string());
        self.ctx.provider.ensure_load_balancer_deleted(self.ctx.fence(), lb).await.map_err(SyncError::Provider)?;
        let patch = serde_json::json!({ "metadata": { "annotations": { ANNOTATION_LOAD_BALANCER_NAME: new } } });
        let api: Api<Service> = Api::namespaced(self.ctx.client.clone(), svc.metadata.namespace.as_deref().unwrap_or_default());
        self.ctx.kube_write_permit().await;
        api.patch(svc.metadata.name.as_deref().unwrap_or_default(), &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(SyncError::Kube)?;
        tracing::info!(service = %key(svc), %old, %new, "load balancer renamed");
        let note =
            format!("Renamed load balancer {old} to {new} (--allow-load-balancer-renaming): made anew, the old one deleted");
        self.ctx.event(NAME, svc, false, "RenamedLoadBalancer", note).await;
        Ok(())
    }

    async fn write_status(&self, svc: &Service, status: &pb::LoadBalancerStatus) -> Result<(), kube::Error> {
        let ingress: Vec<serde_json::Value> = status
            .ingress
            .iter()
            .map(|i| {
                let mut v = serde_json::Map::new();
                if !i.ip.is_empty() {
                    v.insert("ip".into(), i.ip.clone().into());
                    let mode = if i.ip_mode() == pb::IpMode::Proxy { "Proxy" } else { "VIP" };
                    v.insert("ipMode".into(), mode.into());
                }
                if !i.hostname.is_empty() {
                    v.insert("hostname".into(), i.hostname.clone().into());
                }
                if !i.ports.is_empty() {
                    let ports: Vec<serde_json::Value> = i
                        .ports
                        .iter()
                        .map(|p| {
                            let protocol = match p.protocol() {
                                pb::Protocol::Udp => "UDP",
                                pb::Protocol::Sctp => "SCTP",
                                _ => "TCP",
                            };
                            let mut port = serde_json::json!({ "port": p.port, "protocol": protocol });
                            if !p.error.is_empty() {
                                port["error"] = p.error.clone().into();
                            }
                            port
                        })
                        .collect();
                    v.insert("ports".into(), ports.into());
                }
                serde_json::Value::Object(v)
            })
            .collect();
        let current = serde_json::to_value(
            svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|l| l.ingress.clone()).unwrap_or_default(),
        )
        .unwrap_or_default();
        if current == serde_json::Value::Array(ingress.clone()) {
            return Ok(());
        }
        let api: Api<Service> = Api::namespaced(self.ctx.client.clone(), svc.metadata.namespace.as_deref().unwrap_or_default());
        let patch = serde_json::json!({ "status": { "loadBalancer": { "ingress": ingress } } });
        self.ctx.kube_write_permit().await;
        api.patch_status(svc.metadata.name.as_deref().unwrap_or_default(), &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(|_| ())
    }

    async fn delete(&self, svc: &Service) -> Result<(), SyncError> {
        if self.ctx.provider.identity().is_none() {
            return Err(SyncError::Provider(Error::unavailable("provider not ready")));
        }
        let k = key(svc);
        self.ctx.event(NAME, svc, false, "DeletingLoadBalancer", "Deleting load balancer".into()).await;
        if let Err(error) = self.delete_every_name(svc).await {
            self.ctx.event(NAME, svc, true, "DeleteLoadBalancerFailed", format!("Error deleting load balancer: {error}")).await;
            return Err(SyncError::Provider(error));
        }
        self.ensured.locked().remove(&k);
        if let Some(uid) = svc.metadata.uid.clone() {
            self.cleaned.locked().insert(uid);
        }
        if svc.metadata.deletion_timestamp.is_none() {
            self.write_status(svc, &pb::LoadBalancerStatus::default()).await.map_err(SyncError::Kube)?;
        }
        let finalizers: Vec<String> =
            svc.metadata.finalizers.clone().unwrap_or_default().into_iter().filter(|f| f != FINALIZER).collect();
        let patch =
            serde_json::json!({ "metadata": { "finalizers": finalizers, "resourceVersion": svc.metadata.resource_version } });
        let api: Api<Service> = Api::namespaced(self.ctx.client.clone(), svc.metadata.namespace.as_deref().unwrap_or_default());
        self.ctx.kube_write_permit().await;
        match api.patch(svc.metadata.name.as_deref().unwrap_or_default(), &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(SyncError::Kube(e)),
        }
        self.ctx.event(NAME, svc, false, "DeletedLoadBalancer", "Deleted load balancer".into()).await;
        Ok(())
    }
}

#[derive(Debug)]
enum SyncError {
    Provider(Error),
    Kube(kube::Error),
    /// The Service itself is wrong (an Event says how); no provider call was made.
    Invalid,
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ServiceSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn svc(spec: &[&str], annotation: Option<&str>) -> Service {
        let annotations = annotation.map(|a| [(ANNOTATION_SOURCE_RANGES.to_string(), a.to_string())].into());
        Service {
            metadata: ObjectMeta { annotations, ..Default::default() },
            spec: Some(ServiceSpec {
                load_balancer_source_ranges: Some(spec.iter().map(|s| s.to_string()).collect()),
                ..Default::default()
            }),
            status: None,
        }
    }

    #[test]
    fn source_ranges_are_trimmed_merged_and_the_spec_wins() {
        let got = source_ranges(&svc(&[" 10.0.0.0/8", "10.0.0.0/8 ", "192.168.1.7/24"], Some("1.2.3.0/24"))).expect("ok");
        assert_eq!(got, vec!["10.0.0.0/8".to_string(), "192.168.1.0/24".into()]);
        let got = source_ranges(&svc(&[], Some(" 1.2.3.0/24 , fd00::/8,1.2.3.0/24"))).expect("ok");
        assert_eq!(got, vec!["1.2.3.0/24".to_string(), "fd00::/8".into()]);
        assert_eq!(source_ranges(&svc(&[], Some("  "))).expect("ok"), Vec::<String>::new());
        let err = source_ranges(&svc(&["10.0.0.0/99"], None)).expect_err("bad");
        assert!(err.contains("spec.loadBalancerSourceRanges") && err.contains("10.0.0.0/99"), "{err}");
        assert!(source_ranges(&svc(&[], Some("1.2.3.0/24,"))).is_err(), "an empty item, as upstream");
    }

    #[test]
    fn the_exclusion_label_reads_as_a_go_boolean() {
        let node = |v: Option<&str>| Node {
            metadata: ObjectMeta { labels: v.map(|v| [(LABEL_EXCLUDE.to_string(), v.to_string())].into()), ..Default::default() },
            ..Default::default()
        };
        assert!(!excluded_by_label(&node(None)));
        for keep in ["false", "False", "FALSE", "0", "f", "F"] {
            assert!(!excluded_by_label(&node(Some(keep))), "{keep:?} keeps the node");
        }
        for exclude in ["", "true", "1", "yes", "no", "garbage"] {
            assert!(excluded_by_label(&node(Some(exclude))), "{exclude:?} excludes the node");
        }
    }

    #[test]
    fn the_finalizer_of_a_load_balancer_service_is_no_news() {
        let mut s = svc(&[], None);
        if let Some(spec) = s.spec.as_mut() {
            spec.type_ = Some("LoadBalancer".into());
        }
        let before = fingerprint(&s);
        s.metadata.finalizers = Some(vec![FINALIZER.into()]);
        assert_eq!(fingerprint(&s), before);
        if let Some(spec) = s.spec.as_mut() {
            spec.type_ = Some("ClusterIP".into());
        }
        let with = fingerprint(&s);
        s.metadata.finalizers = None;
        assert_ne!(fingerprint(&s), with, "for a Service leaving LoadBalancer, the finalizer matters");
    }
}
