//! The service controller (`service-lb-controller`): a cloud load balancer for every Service
//! of type LoadBalancer without a `loadBalancerClass` (or of `--load-balancer-class`).
//!
//! - The finalizer `service.kubernetes.io/load-balancer-cleanup` is added before the first
//!   Ensure and removed only after EnsureLoadBalancerDeleted succeeded, so nothing leaks.
//! - Ensure is called only when what the provider sees changed (ports, type, source ranges,
//!   affinity, requested IP, traffic policy, health-check port, IP families, annotations);
//!   a change of the node set alone is UpdateLoadBalancerHosts.
//! - The node set ([`hosts`]): Nodes with a providerID, not being deleted, and whose
//!   `node.kubernetes.io/exclude-from-external-load-balancers` label, when present, reads as
//!   false (upstream parses it as a Go boolean: an empty or unparsable value excludes).
//!   Readiness plays no part, nor does the cluster autoscaler's `ToBeDeletedByClusterAutoscaler`
//!   taint (KEP-3458: the Node drains through kube-proxy's health check and leaves when deleted). Node changes are coalesced for 50 ms, then every load balancer
//!   whose set changed is updated.
//! - Source ranges are upstream's: `spec.loadBalancerSourceRanges`, or when empty the
//!   `service.beta.kubernetes.io/load-balancer-source-ranges` annotation, each trimmed of
//!   whitespace, in canonical form, duplicates merged. A malformed one is a Warning Event and
//!   no provider call.
//! - Nothing leaks when the finalizer is bypassed ([`orphans`]): a Service the controller knew
//!   to have a load balancer that is deleted without the finalizer (or leaves type
//!   LoadBalancer without it) has its load balancer deleted from the event. After a restart, a
//!   sweep at start and every `--load-balancer-resync-period` lists the provider's load
//!   balancers (when it advertises listing) and deletes those named by our scheme for this
//!   cluster whose Service UID no longer exists, each confirmed by a read of the Service, at
//!   most `--max-load-balancer-deletions` per sweep (more, and it deletes none).
//! - Names ([`naming`]): the name a load balancer was made under is recorded on its Service
//!   and kept; a rename happens only when the operator allows it.
//! - Keys back off per Service (see `queue.rs`); a retry reads the newest Service from the
//!   cache. The controller's own writes (the finalizer, the status) are not changes: they
//!   never cut a backoff short.
//!
//! What the provider is sent is made at the boundary, once per reconcile
//! ([`crate::provider::convert::LoadBalancerRequest`]); this module speaks Kubernetes' types.

mod endpoints;
mod hosts;
mod naming;
mod orphans;
mod record;
mod repair;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ccm_protocol::Error;
use ccm_protocol::lock::Lock;
use k8s_openapi::api::core::v1::{LoadBalancerIngress, Node, Service};
use kube::runtime::reflector::ObjectRef;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::runner::{self, Done, Watches};
use super::{Context, Tasks};
use crate::events::{EventType, reason};
use crate::informer::Change;
use crate::provider::Changes;
use crate::provider::convert::{LoadBalancerRequest, target_port};
use crate::queue::{Outcome, QueueConfig, WorkQueue};
use crate::wellknown::{
    ANNOTATION_LOAD_BALANCER_ENSURED, ANNOTATION_LOAD_BALANCER_NAME, ANNOTATION_LOAD_BALANCER_PROVIDER, ANNOTATION_NODE_SELECTOR,
    ANNOTATION_SOURCE_RANGES, FINALIZER,
};

use hosts::{HostSet, HostSetCache};

/// The controller's name.
pub const NAME: &str = "service-lb-controller";

/// What the controller's queue holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Key {
    /// A Service, by `namespace/name`: its load balancer brought to what it asks for.
    Service(String),
    /// The load balancer of a Service that is gone (or no longer wants one), by Service UID.
    Orphan(String),
    /// One pass that updates the hosts of every load balancer whose Service is as it was
    /// ensured, with BatchUpdateLoadBalancerHosts (when the provider advertises it).
    Hosts,
}

/// A Service's `namespace/name`.
fn service_key(svc: &Service) -> String {
    format!("{}/{}", svc.metadata.namespace.as_deref().unwrap_or_default(), svc.metadata.name.as_deref().unwrap_or_default())
}

fn has_finalizer(svc: &Service) -> bool {
    svc.metadata.finalizers.as_ref().is_some_and(|f| f.iter().any(|f| f == FINALIZER))
}

/// Whether the Service is of type LoadBalancer, whatever its class and state.
fn is_type_load_balancer(svc: &Service) -> bool {
    svc.spec.as_ref().and_then(|s| s.type_.as_deref()) == Some("LoadBalancer")
}

fn has_ingress(svc: &Service) -> bool {
    svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|l| l.ingress.as_ref()).is_some_and(|i| !i.is_empty())
}

/// What the controller acts on: what the provider sees, deletion, and the finalizer of a
/// Service that no longer wants a load balancer. The finalizer of one that does is the
/// controller's own write, so its appearance is no news (it would cut a backoff short).
fn fingerprint(svc: &Service) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    provider_fingerprint(svc).hash(&mut h);
    let deleting = svc.metadata.deletion_timestamp.is_some();
    deleting.hash(&mut h);
    let wants = is_type_load_balancer(svc) && !deleting;
    (has_finalizer(svc) && !wants).hash(&mut h);
    // The node selector chooses hosts, not what the provider sees: a change of it is news
    // (an UpdateLoadBalancerHosts), never an Ensure.
    svc.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_NODE_SELECTOR)).hash(&mut h);
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

/// What the provider sees of a Service; a change of it means a new Ensure. Source ranges are
/// hashed as written (the annotation's with the annotations), as upstream compares them: they
/// are read once, by the reconcile, not at every event.
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
        spec.load_balancer_source_ranges.hash(&mut h);
        spec.session_affinity.hash(&mut h);
        spec.session_affinity_config.as_ref().and_then(|c| c.client_ip.as_ref()).and_then(|c| c.timeout_seconds).hash(&mut h);
        spec.load_balancer_ip.hash(&mut h);
        spec.external_traffic_policy.hash(&mut h);
        spec.health_check_node_port.hash(&mut h);
        spec.ip_families.hash(&mut h);
    }
    // The core's own record of the load balancer name is not the Service's spec: writing it
    // is no change (it never cuts a backoff short, never calls for an Ensure).
    let annotations: BTreeMap<&String, &String> = svc
        .metadata
        .annotations
        .iter()
        .flatten()
        .filter(|(k, _)| {
            ![
                ANNOTATION_LOAD_BALANCER_NAME,
                ANNOTATION_LOAD_BALANCER_PROVIDER,
                ANNOTATION_NODE_SELECTOR,
                ANNOTATION_LOAD_BALANCER_ENSURED,
            ]
            .contains(&k.as_str())
        })
        .collect();
    annotations.hash(&mut h);
    // Labels go to the provider but, as in upstream's needsUpdate, a label change alone is no
    // reason for an Ensure (and must not cut a failing Service's backoff short).
    h.finish()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ensured {
    spec: u64,
    hosts: u64,
    /// How many hosts it has.
    count: usize,
    /// When it was recorded ([`State::record`]): a repair acts only on what it read before.
    at: u64,
    /// Taken from the Service's record by a new process whose provider lists load
    /// balancers: its hosts wait for the first sweep's listing to say whether the cloud has
    /// the current ones already ([`record`]).
    unconfirmed: bool,
}

impl Ensured {
    /// What a load balancer is once given `spec` and `backends`.
    fn of(spec: u64, backends: &HostSet) -> Self {
        Self { spec, hosts: backends.hosts, count: backends.count, at: 0, unconfirmed: false }
    }
}

/// How many refused recorded names the controller remembers (each is told once).
const REFUSED_NAMES_KEPT: usize = 4096;

/// What the controller keeps between reconciles, under one lock.
#[derive(Default)]
struct State {
    /// What was last applied per Service (`namespace/name`): the spec fingerprint and the
    /// node set's.
    ensured: HashMap<String, Ensured>,
    /// When the node set last changed, for the node-sync latency metric.
    node_change_at: Option<Instant>,
    /// Load balancers to delete whose Service is gone or no longer wants one, by Service UID:
    /// the last Service seen (or, from a sweep, its namespace, name and UID).
    orphans: HashMap<String, Service>,
    /// UIDs of Services whose load balancer this controller deleted through the finalizer.
    cleaned: HashSet<String>,
    /// The load balancer name of each Service, by UID, as last ensured (the cache may not
    /// show the recording annotation yet).
    names: HashMap<String, String>,
    /// The last non-empty node set of each node selector in use (the empty key: every
    /// backend), which a load balancer of that selector keeps when its set is emptied.
    last_backends: HashMap<String, Arc<HostSet>>,
    /// Services told that their load balancer keeps its name (once per process).
    kept_names: HashSet<String>,
    /// Services told that the name recorded on them is not theirs, with that name (once per
    /// process and name; forgotten past [`REFUSED_NAMES_KEPT`], so that a user writing name
    /// after name cannot grow it without bound).
    refused_names: HashSet<(String, String)>,
    /// Counts the records of `ensured`.
    records: u64,
    /// Services whose load balancer was found gone from the cloud and is being made again.
    repairing: HashSet<String>,
    /// Services whose record on the Service is not to be taken (their load balancer was
    /// found gone since it was written), until a full Ensure records anew.
    void_records: HashSet<String>,
    /// Whether the first sweep listed the load balancers (or failed to): records taken since
    /// need no confirmation of their hosts.
    swept: bool,
    /// When load balancers were last made again by the repair reads (their bound's window).
    repaired_at: std::collections::VecDeque<Instant>,
    /// Whether what earlier holders of the Lease made again was read into `repaired_at`.
    repairs_loaded: bool,
    /// Services whose load balancer a reconcile or the bulk hosts pass is mutating now: the
    /// other leaves it alone meanwhile (see [`Claim`]).
    mutating: HashSet<String>,
}

/// A Service's load balancer claimed for one mutation at a time in this process, whichever
/// path mutates it (its own key or the bulk hosts pass); given back when dropped. With the
/// service controller's Lease (one process at a time, released only once its mutations ended)
/// that is one mutation of a load balancer in flight across every replica's sidecar.
pub(super) struct Claim<'a> {
    controller: &'a ServiceController,
    key: String,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.controller.state().mutating.remove(&self.key);
    }
}

impl State {
    /// Records what the load balancer of Service `k` is now.
    fn record(&mut self, k: String, mut ensured: Ensured) {
        self.records += 1;
        ensured.at = self.records;
        self.ensured.insert(k, ensured);
    }
}

/// The service controller.
pub struct ServiceController {
    ctx: Context,
    queue: Arc<WorkQueue<Key>>,
    state: Mutex<State>,
    /// The current node set.
    host_set: HostSetCache,
    /// The Services' ready pod endpoints, watched when the provider forwards to pods.
    endpoints: Arc<endpoints::EndpointIndex>,
    /// Whether the provider forwards to pods (read once, when it is first known).
    pod_endpoints: AtomicBool,
    /// Wakes the host syncer: the node set changed.
    nodes_changed: Notify,
    /// The provider's epochs as last seen: a new one means its state may be lost.
    epochs: AtomicU64,
    /// The provider's connections as last seen.
    connected: AtomicU64,
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
            state: Default::default(),
            host_set: Default::default(),
            endpoints: Default::default(),
            pod_endpoints: Default::default(),
            nodes_changed: Notify::new(),
            epochs: AtomicU64::new(0),
            connected: AtomicU64::new(0),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.locked()
    }

    /// Claims Service `k`'s load balancer for a mutation; `None` while another path has it.
    pub(super) fn claim(&self, k: &str) -> Option<Claim<'_>> {
        self.state().mutating.insert(k.to_string()).then(|| Claim { controller: self, key: k.to_string() })
    }

    /// Whether the Service's load balancer is this controller's provider's, by its class (see
    /// [`crate::provider::set::Providers::service_owner`]): with one provider, no class, a
    /// class it advertises, or `--load-balancer-class`.
    fn ours(&self, svc: &Service) -> bool {
        self.ctx.serves_service(svc)
    }

    /// Whether the Service should have a load balancer of this controller's now: ours, of
    /// type LoadBalancer, not being deleted. One that does not but carries the finalizer has
    /// its load balancer deleted.
    fn wants_load_balancer(&self, svc: &Service) -> bool {
        self.ours(svc) && is_type_load_balancer(svc) && svc.metadata.deletion_timestamp.is_none()
    }

    /// Whether a reconcile has something to do for the Service: make, keep or delete its
    /// load balancer.
    fn queued_for(&self, svc: &Service) -> bool {
        self.wants_load_balancer(svc) || (self.ours(svc) && has_finalizer(svc))
    }

    /// Runs until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        runner::run(self, stop).await;
    }

    /// A Service changed: queued when it wants or has a load balancer of ours; one that
    /// left without the finalizer has its load balancer deleted.
    fn service_changed(&self, change: Change<Service>) {
        match change {
            Change::Applied { new, .. } => {
                let k = service_key(&new);
                if self.queued_for(&new) {
                    self.queue.add_changed(Key::Service(k), fingerprint(&new));
                } else if self.ours(&new) && self.state().ensured.remove(&k).is_some() {
                    // It left type LoadBalancer with its finalizer removed by someone else.
                    self.orphaned(&new, "no longer wants a load balancer and has no finalizer");
                }
            }
            Change::Deleted(svc) => {
                let k = service_key(&svc);
                self.queue.forget(&Key::Service(k.clone()));
                let uid = svc.metadata.uid.clone().unwrap_or_default();
                let (knew, cleaned) = {
                    let mut state = self.state();
                    (state.ensured.remove(&k).is_some() || has_ingress(&svc), state.cleaned.remove(&uid))
                };
                if knew && !cleaned && self.ours(&svc) && is_type_load_balancer(&svc) {
                    self.orphaned(&svc, "was deleted without the finalizer");
                }
            }
        }
    }

    /// The provider may have lost its state (a new epoch): every load balancer gets a full
    /// Ensure at once, not at its next change or resync.
    fn ensure_all_again(&self) {
        self.state().ensured.clear();
        let mut queued = 0;
        for svc in self.ctx.services.sorted() {
            if self.wants_load_balancer(&svc) {
                self.queue.add(Key::Service(service_key(&svc)));
                queued += 1;
            }
        }
        tracing::warn!(services = queued, "the provider's state may be lost (a new epoch); ensuring every load balancer again");
    }

    /// What the provider is sent of `svc`, under `load_balancer_name`: made once per
    /// reconcile, from source ranges already read ([`source_ranges`]).
    fn request(&self, svc: &Service, load_balancer_name: String, source_ranges: Vec<String>) -> LoadBalancerRequest {
        let sends_endpoints = self.sends_endpoints(svc);
        let service_key = service_key(svc);
        let endpoints = |p: &k8s_openapi::api::core::v1::ServicePort| {
            if !sends_endpoints || p.node_port.unwrap_or(0) != 0 {
                return Vec::new();
            }
            let name = p.name.as_deref().unwrap_or_default();
            self.endpoints.port_endpoints(&service_key, name, p.protocol.as_deref().unwrap_or("TCP"))
        };
        LoadBalancerRequest::new(svc, &self.ctx.options.cluster_name, load_balancer_name, source_ranges, endpoints)
    }

    async fn reconcile_one(&self, key: &Key) -> Outcome {
        let k = match key {
            Key::Orphan(uid) => return self.delete_orphan(uid).await,
            Key::Hosts => return self.update_all_hosts().await,
            Key::Service(k) => k,
        };
        // The bulk hosts pass has its load balancer in a call now: after it.
        let Some(_claim) = self.claim(k) else {
            return Outcome::RequeueAfter(std::time::Duration::from_millis(500));
        };
        let (ns, name) = k.split_once('/').unwrap_or(("", k));
        // Always the newest Service: never a copy from before a failure.
        let Some(svc) = self.ctx.services.store().get(&ObjectRef::new(name).within(ns)) else {
            return Outcome::Success;
        };
        let fp = fingerprint(&svc);
        let result = match self.recorded_provider_holds(&svc).await {
            Ok(true) if self.wants_load_balancer(&svc) => self.ensure(&svc).await,
            Ok(true) if has_finalizer(&svc) && self.ours(&svc) => self.delete(&svc).await,
            Ok(_) => Ok(()),
            Err(error) => Err(error),
        };
        match result {
            Ok(()) => Outcome::Success,
            // Throttled is no failure: the backoff does not grow while the cloud paces us.
            Err(SyncError::Provider(error)) => Outcome::of_provider_error(Some(fp), &error),
            Err(SyncError::Kube(kube::Error::Api(status))) if status.code == 404 && self.ours(&svc) => {
                match self.gone_from_api(&svc).await {
                    Ok(true) => Outcome::Success,
                    Ok(false) | Err(_) => {
                        tracing::warn!(service = %k, "writing the service failed: it was not found");
                        Outcome::Retry { fingerprint: Some(fp), retry_after: None }
                    }
                }
            }
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
        let k = service_key(svc);
        if self.ctx.provider.identity().is_some_and(|i| !i.serves_load_balancers()) {
            return Ok(());
        }
        if self.ctx.provider.identity().is_none() {
            return Err(SyncError::Provider(Error::unavailable("provider not ready")));
        }
        let checked = source_ranges(svc).and_then(|ranges| Ok((ranges, hosts::node_selector(svc)?)));
        let (ranges, selector) = match checked {
            Ok(checked) => checked,
            Err(why) => {
                tracing::warn!(service = %k, %why, "invalid service; no load balancer until it is fixed");
                let note = format!("Invalid service: {why}");
                self.ctx.event(NAME, svc, EventType::Warning, reason::SYNC_LOAD_BALANCER_FAILED, note).await;
                return Err(SyncError::Invalid);
            }
        };
        let (lb_name, old_name) = self.naming(svc, &ranges).await.map_err(SyncError::Provider)?;
        self.record_finalizer(svc, &lb_name, old_name.is_none()).await?;
        let last = {
            let mut state = self.state();
            if let Some(uid) = svc.metadata.uid.clone() {
                state.names.insert(uid, lb_name.clone());
            }
            // A rename waiting is a full Ensure under the new name.
            state.ensured.get(&k).copied().filter(|_| old_name.is_none())
        };
        // New to this process (a restart, a new leader): what the Service's record says was
        // ensured, when it is of the Service as it is now.
        let void = self.state().void_records.contains(&k);
        let recorded = match last {
            None if old_name.is_none() && !void => self.ensured_by_record(svc, &lb_name),
            _ => None,
        };
        if let Some(e) = recorded {
            self.state().record(k.clone(), e);
        }
        let last = last.or(recorded);
        let backends = self.backends_for(svc, &lb_name, selector.as_ref(), last).await.map_err(SyncError::Provider)?;
        // The hosts the cloud was found to have may have been taken as given meanwhile.
        let last = last.map(|e| self.state().ensured.get(&k).copied().filter(|now| now.spec == e.spec).unwrap_or(e));
        let ensured = Ensured::of(self.ensured_spec(svc), &backends);
        match last {
            Some(e) if e.spec == ensured.spec && e.hosts == ensured.hosts => Ok(()),
            // Hosts alone, after a change of leader: the first sweep's listing tells whether
            // the cloud has them already; else one bulk pass for all of them.
            Some(e) if e.spec == ensured.spec && e.unconfirmed => Ok(()),
            Some(e)
                if e.spec == ensured.spec
                    && recorded.is_some()
                    && self.ctx.provider.identity().is_some_and(|i| i.bulk_hosts()) =>
            {
                self.queue.add(Key::Hosts);
                Ok(())
            }
            Some(e) if e.spec == ensured.spec => {
                self.update_hosts(svc, self.request(svc, lb_name, ranges), &backends, ensured).await
            }
            _ => self.ensure_load_balancer(svc, self.request(svc, lb_name, ranges), &backends, old_name, ensured).await,
        }
    }

    /// Adds the finalizer when it is missing, and records `lb_name` when it is not the name
    /// recorded (`record`: not while a rename waits, whose new name is recorded once the old
    /// load balancer is gone): before the load balancer is made under it.
    async fn record_finalizer(&self, svc: &Service, lb_name: &str, record: bool) -> Result<(), SyncError> {
        let record = record && naming::annotated_name(svc) != Some(lb_name);
        // With several providers, whose load balancer it is, recorded before it is made.
        let provider = self.ctx.providers.several().then(|| self.ctx.provider.name());
        let recorded_provider =
            svc.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_LOAD_BALANCER_PROVIDER)).map(String::as_str);
        let record_provider = provider.filter(|p| recorded_provider != Some(*p));
        if has_finalizer(svc) && !record && record_provider.is_none() {
            return Ok(());
        }
        let mut finalizers = svc.metadata.finalizers.clone().unwrap_or_default();
        if !has_finalizer(svc) {
            finalizers.push(FINALIZER.into());
        }
        let mut metadata = serde_json::json!({ "finalizers": finalizers, "resourceVersion": svc.metadata.resource_version });
        let mut annotations = serde_json::Map::new();
        if record {
            annotations.insert(ANNOTATION_LOAD_BALANCER_NAME.into(), lb_name.into());
        }
        if let Some(p) = record_provider {
            annotations.insert(ANNOTATION_LOAD_BALANCER_PROVIDER.into(), p.into());
        }
        if !annotations.is_empty() {
            metadata["annotations"] = serde_json::Value::Object(annotations);
        }
        let patch = serde_json::json!({ "metadata": metadata });
        self.ctx.patch_service(svc, &patch).await.map_err(SyncError::Kube)?;
        Ok(())
    }

    /// EnsureLoadBalancer, the status written, a waiting rename finished.
    async fn ensure_load_balancer(
        &self,
        svc: &Service,
        lb: LoadBalancerRequest,
        backends: &HostSet,
        old_name: Option<String>,
        ensured: Ensured,
    ) -> Result<(), SyncError> {
        let k = service_key(svc);
        let lb_name = lb.load_balancer_name().to_string();
        let renamed_from = old_name.map(|old| lb.named(&old));
        self.ctx.event(NAME, svc, EventType::Normal, reason::ENSURING_LOAD_BALANCER, "Ensuring load balancer".into()).await;
        let forgotten = self.forget_record(svc).await?;
        let ingress = match self.ctx.cloud().ensure_load_balancer(lb, backends.provider()).await {
            Ok(ingress) => {
                self.ctx.metrics.load_balancer_sync();
                tracing::debug!(service = %k, load_balancer = %lb_name, hosts = backends.count, "load balancer ensured");
                ingress
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
                let note = format!("Error syncing load balancer: {error}");
                self.ctx.event(NAME, svc, EventType::Warning, reason::SYNC_LOAD_BALANCER_FAILED, note).await;
                return Err(SyncError::Provider(error));
            }
        };
        self.write_status(svc, ingress).await.map_err(SyncError::Kube)?;
        if let Some(old) = renamed_from {
            self.finish_rename(svc, old, &lb_name).await?;
        }
        let repaired = {
            let mut state = self.state();
            state.record(k.clone(), ensured);
            state.void_records.remove(&k);
            state.repairing.remove(&k)
        };
        if repaired {
            let note = format!(
                "Load balancer {lb_name} was gone from the cloud (deleted outside Kubernetes): made it again{}",
                if has_ingress(svc) { "; its address may have changed" } else { "" }
            );
            self.ctx.event(NAME, svc, EventType::Warning, reason::LOAD_BALANCER_RECREATED, note).await;
            self.ctx.metrics.load_balancer_repairs("recreated", 1);
        }
        self.ctx.event(NAME, svc, EventType::Normal, reason::ENSURED_LOAD_BALANCER, "Ensured load balancer".into()).await;
        // Not kept, the next process ensures it again: nothing worse.
        if let Err(error) = self.write_record(svc, &lb_name, ensured, forgotten).await {
            tracing::warn!(service = %k, ?error, "recording what was ensured failed; a new leader will ensure it again");
        }
        Ok(())
    }

    /// Writes `ingress` as the Service's `status.loadBalancer`, unless it is that already.
    async fn write_status(&self, svc: &Service, ingress: Vec<LoadBalancerIngress>) -> Result<(), kube::Error> {
        let current =
            svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|l| l.ingress.as_deref()).unwrap_or_default();
        if current == ingress.as_slice() {
            return Ok(());
        }
        let patch = serde_json::json!({ "status": { "loadBalancer": { "ingress": ingress } } });
        self.ctx.patch_service_status(svc, &patch).await
    }

    /// A write found no Service of this one's name: read again from the API server, and when
    /// it is gone (no object of its name, or another under it), the load balancer made for it
    /// is deleted. The cache lagged its deletion (a new leader's cache that missed it): no
    /// finalizer and no Service are left to delete what was made from the stale copy.
    /// Whether it was (an error: kept, retried).
    async fn gone_from_api(&self, svc: &Service) -> Result<bool, SyncError> {
        let (ns, name) =
            (svc.metadata.namespace.as_deref().unwrap_or_default(), svc.metadata.name.as_deref().unwrap_or_default());
        let api: kube::Api<Service> = kube::Api::namespaced(self.ctx.client.clone(), ns);
        let now = api.get_opt(name).await.map_err(SyncError::Kube)?;
        if now.is_some_and(|n| n.metadata.uid == svc.metadata.uid) {
            return Ok(false);
        }
        tracing::warn!(service = %service_key(svc), "the Service is gone from the API server while the cache still held it; deleting the load balancer made for it");
        self.delete_every_name(svc).await.map_err(SyncError::Provider)?;
        let mut state = self.state();
        state.ensured.remove(&service_key(svc));
        if let Some(uid) = svc.metadata.uid.clone() {
            state.cleaned.insert(uid);
        }
        Ok(true)
    }

    async fn delete(&self, svc: &Service) -> Result<(), SyncError> {
        if self.ctx.provider.identity().is_none() {
            return Err(SyncError::Provider(Error::unavailable("provider not ready")));
        }
        let k = service_key(svc);
        self.ctx.event(NAME, svc, EventType::Normal, reason::DELETING_LOAD_BALANCER, "Deleting load balancer".into()).await;
        if let Err(error) = self.delete_every_name(svc).await {
            let note = format!("Error deleting load balancer: {error}");
            self.ctx.event(NAME, svc, EventType::Warning, reason::DELETE_LOAD_BALANCER_FAILED, note).await;
            return Err(SyncError::Provider(error));
        }
        {
            let mut state = self.state();
            state.ensured.remove(&k);
            if let Some(uid) = svc.metadata.uid.clone() {
                state.cleaned.insert(uid);
            }
        }
        if svc.metadata.deletion_timestamp.is_none() {
            self.write_status(svc, Vec::new()).await.map_err(SyncError::Kube)?;
        }
        let finalizers: Vec<String> =
            svc.metadata.finalizers.clone().unwrap_or_default().into_iter().filter(|f| f != FINALIZER).collect();
        // The record goes with the load balancer: a Service that wants one again gets it made.
        let patch = serde_json::json!({ "metadata": {
            "finalizers": finalizers,
            "resourceVersion": svc.metadata.resource_version,
            "annotations": { ANNOTATION_LOAD_BALANCER_ENSURED: null },
        } });
        match self.ctx.patch_service(svc, &patch).await {
            Ok(()) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(SyncError::Kube(e)),
        }
        self.ctx.event(NAME, svc, EventType::Normal, reason::DELETED_LOAD_BALANCER, "Deleted load balancer".into()).await;
        Ok(())
    }
}

impl runner::Controller for ServiceController {
    type Key = Key;
    const NAME: &'static str = NAME;
    const WATCHES: Watches = Watches { nodes: true, services: true, provider: true };

    fn ctx(&self) -> &Context {
        &self.ctx
    }

    fn queue(&self) -> Option<Arc<WorkQueue<Key>>> {
        Some(self.queue.clone())
    }

    fn workers(&self) -> usize {
        self.ctx.options.concurrent_service_syncs.max(1)
    }

    fn resync(&self, queue: &WorkQueue<Key>) {
        let seen = *self.ctx.provider.changes().borrow();
        self.epochs.store(seen.epochs, Ordering::Release);
        self.connected.store(seen.connected, Ordering::Release);
        for svc in self.ctx.services.sorted() {
            if self.queued_for(&svc) {
                queue.add_changed(Key::Service(service_key(&svc)), fingerprint(&svc));
            }
        }
    }

    fn on_service(&self, change: Option<Change<Service>>, queue: &WorkQueue<Key>) {
        match change {
            Some(change) => self.service_changed(change),
            None => {
                for svc in self.ctx.services.sorted() {
                    if self.queued_for(&svc) {
                        queue.add(Key::Service(service_key(&svc)));
                    }
                }
            }
        }
    }

    fn on_node(&self, change: Option<Change<Node>>, _queue: &WorkQueue<Key>) {
        self.node_changed(change);
    }

    fn on_provider(&self, now: Changes, queue: &WorkQueue<Key>) {
        if self.epochs.swap(now.epochs, Ordering::AcqRel) != now.epochs {
            self.ensure_all_again();
        }
        // Connected: the Services of the classes it advertises are known to be its own now.
        if self.connected.swap(now.connected, Ordering::AcqRel) != now.connected {
            self.resync(queue);
        }
    }

    async fn reconcile(&self, keys: &[Key]) -> Vec<Done> {
        let mut done = Vec::with_capacity(keys.len());
        for key in keys {
            done.push(self.reconcile_one(key).await.into());
        }
        done
    }

    /// The node-sync latency: from a change of the node set to every load balancer following it.
    fn idle(&self) {
        if let Some(at) = self.state().node_change_at.take() {
            self.ctx.metrics.service_node_sync(at.elapsed());
        }
    }

    fn spawn(self: &Arc<Self>, _queue: &Arc<WorkQueue<Key>>, stop: &CancellationToken, tasks: &mut Tasks) {
        tasks.spawn(self.clone().host_syncer(stop.clone()));
        tasks.spawn(self.clone().sweep_loop(stop.clone()));
        tasks.spawn(self.clone().repair_loop(stop.clone()));
        tasks.spawn(self.clone().endpoint_feed(stop.clone()));
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
