//! The load balancers' node sets: which Nodes are backends, each Service's choice among them
//! (its `ccm-rs.dev/load-balancer-node-selector`), each set built once per change and shared
//! by every Service choosing it, the node feed that updates the hosts of only the load
//! balancers whose own set changed (one BatchUpdateLoadBalancerHosts per set and 500 load
//! balancers when the provider offers it), and the rule that an emptied set never empties a
//! load balancer.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use ccm_protocol::Error;
use ccm_protocol::lock::Lock;
use k8s_openapi::api::core::v1::{Node, Service};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Ensured, Key, NAME, ServiceController, SyncError, has_finalizer, has_ingress, service_key, source_ranges};
use crate::controllers::Context;
use crate::events::{EventType, reason};
use crate::informer::Change;
use crate::labels::{Op, parse_selector, selector_matches};
use crate::node_util;
use crate::provider::convert::LoadBalancerRequest;
use crate::provider::encoded::Backends;
use crate::queue::Outcome;
use crate::wellknown::{ANNOTATION_NODE_SELECTOR, LABEL_EXCLUDE};

/// How many selectors' last non-empty sets are kept before those no Service uses are dropped.
const LAST_SETS_KEPT: usize = 256;
/// How long Node changes are coalesced before the load balancers' hosts follow them.
const NODE_COALESCE: Duration = Duration::from_millis(50);
/// Whether the exclusion label keeps a Node out of load balancers: present and not one of
/// Go's `strconv.ParseBool` false values, as upstream reads it.
fn excluded_by_label(node: &Node) -> bool {
    let value = node.metadata.labels.as_ref().and_then(|l| l.get(LABEL_EXCLUDE));
    value.is_some_and(|v| !matches!(v.as_str(), "0" | "f" | "F" | "false" | "FALSE" | "False"))
}

/// Whether a Node is a load balancer backend. The cluster autoscaler's
/// `ToBeDeletedByClusterAutoscaler` taint plays no part (KEP-3458): a Node being scaled down
/// stays a backend while kube-proxy's health check drains it, and leaves when it is deleted
/// or excluded. (Upstream ignores the taint's arrival but drops the Node at the next sync for
/// another reason, cutting its connections then; here the taint never changes the hosts.)
/// With several providers, a load balancer's backends are its provider's Nodes, or every
/// Node when `--load-balancer-backends-all-nodes` names its provider.
fn is_backend(ctx: &Context, node: &Node) -> bool {
    node_util::provider_id(node).is_some()
        && node.metadata.deletion_timestamp.is_none()
        && !excluded_by_label(node)
        && if ctx.all_backends() { !ctx.excluded(node) } else { !ctx.ignores(node) }
}

/// A Service's choice among the backends: its `ccm-rs.dev/load-balancer-node-selector`, a
/// Kubernetes label selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct NodeSelector {
    /// As written (trimmed): the key of its node set.
    text: String,
    terms: Vec<(String, Op)>,
}

impl NodeSelector {
    fn matches(&self, node: &Node) -> bool {
        static NO_LABELS: std::collections::BTreeMap<String, String> = std::collections::BTreeMap::new();
        selector_matches(&self.terms, node.metadata.labels.as_ref().unwrap_or(&NO_LABELS))
    }
}

/// The Service's node selector: `None` without one (every backend), an error saying what is
/// wrong with a malformed one.
pub(super) fn node_selector(svc: &Service) -> Result<Option<NodeSelector>, String> {
    let annotation = svc.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_NODE_SELECTOR));
    let Some(text) = annotation.map(|t| t.trim()).filter(|t| !t.is_empty()) else { return Ok(None) };
    let terms = parse_selector(text).map_err(|why| format!("{ANNOTATION_NODE_SELECTOR}: {why}"))?;
    Ok(Some(NodeSelector { text: text.to_string(), terms }))
}

/// The key of a Service's node set: its selector's text, empty for every backend.
fn set_key(selector: Option<&NodeSelector>) -> &str {
    selector.map_or("", |s| s.text.as_str())
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
pub(super) struct HostSet {
    /// How many backends.
    pub(super) count: usize,
    /// Their fingerprint.
    pub(super) hosts: u64,
    /// The backends, by name, until the provider's form is made from them; then released, so
    /// that the set keeps no old version of a Node alive (heartbeats replace every Node every
    /// 10 s).
    nodes: Mutex<Vec<Arc<Node>>>,
    /// As the provider is sent them (made when first needed: the node feed only compares
    /// fingerprints), converted and encoded once for every EnsureLoadBalancer and
    /// UpdateLoadBalancerHosts of this set.
    backends: OnceLock<Backends>,
}

impl HostSet {
    fn new(backends: Vec<Arc<Node>>) -> Self {
        let hosts = hosts_of(&backends);
        Self { count: backends.len(), hosts, nodes: Mutex::new(backends), backends: Default::default() }
    }

    /// The backends as the provider is sent them.
    pub(super) fn provider(&self) -> &Backends {
        self.backends.get_or_init(|| {
            let nodes = std::mem::take(&mut *self.nodes.locked());
            Backends::new(nodes.iter().map(|n| n.as_ref()))
        })
    }

    pub(super) fn is_empty(&self) -> bool {
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

/// The [`HostSet`]s last built, one per node selector in use, valid while no Node change a
/// load balancer sees came since.
#[derive(Debug, Default)]
pub(super) struct HostSetCache {
    /// Bumped by the node feed on every such change.
    generation: std::sync::atomic::AtomicU64,
    /// By selector (empty: every backend): the set, the generation it was built at and the
    /// provider identity it was built under (which Nodes are ignored depends on it).
    built: Mutex<HashMap<String, Built>>,
}

/// A node set with the generation and provider identity it was built at.
type Built = (u64, usize, Arc<HostSet>);

/// A load balancer whose hosts a bulk pass updates: its Service, what the provider is sent of
/// it, and what it is once done.
type Todo = (Arc<Service>, LoadBalancerRequest, Ensured);

impl ServiceController {
    /// A Node changed (`None`: changes were missed): when what a load balancer sees of it
    /// changed, the node set is built anew at its next use and the host syncer is woken.
    pub(super) fn node_changed(&self, change: Option<Change<Node>>) {
        if let Some(Change::Applied { old, new }) = &change {
            let before = old.as_deref().map(|o| (is_backend(&self.ctx, o), node_fingerprint(o)));
            if before == Some((is_backend(&self.ctx, new), node_fingerprint(new))) {
                return;
            }
        }
        self.host_set.generation.fetch_add(1, Ordering::AcqRel);
        self.nodes_changed.notify_one();
    }

    /// After a Node change (and 50 ms of quiet coalescing), queues the load balancer Services
    /// whose own node set changed (those of one selector share a set); one bulk pass when the
    /// provider updates hosts in bulk. A Service whose selector is malformed keeps what it
    /// has. Services in backoff stay there: `add` carries no news.
    pub(super) async fn host_syncer(self: Arc<Self>, stop: CancellationToken) {
        let mut last: HashMap<String, u64> = HashMap::new();
        loop {
            tokio::select! {
                _ = self.nodes_changed.notified() => {}
                _ = stop.cancelled() => return,
            }
            tokio::time::sleep(NODE_COALESCE).await;
            let mut now: HashMap<String, u64> = HashMap::new();
            let mut changed = Vec::new();
            for svc in self.ctx.services.sorted() {
                if !self.wants_load_balancer(&svc) {
                    continue;
                }
                let Ok(selector) = node_selector(&svc) else { continue };
                let key = set_key(selector.as_ref());
                let hosts = match now.get(key) {
                    Some(h) => *h,
                    None => {
                        let h = self.backends(selector.as_ref()).hosts;
                        now.insert(key.to_string(), h);
                        h
                    }
                };
                // A set not seen before (a selector just written) is news too: its Services
                // compare it with what they were given, at no cost when they have it.
                if last.get(key) != Some(&hosts) {
                    changed.push(svc);
                }
            }
            // The kept sets of selectors no Service uses any more go.
            self.state().last_backends.retain(|k, _| now.contains_key(k));
            last = now;
            // No load balancer whose set changed, nothing to update (a cluster's join before
            // its Services, a node of a pool no selector chooses).
            if changed.is_empty() {
                continue;
            }
            self.state().node_change_at.get_or_insert(Instant::now());
            if self.ctx.provider.identity().is_some_and(|i| i.bulk_hosts()) {
                // Ahead of any backlog of Services (thousands being made, a re-list): behind
                // them, each ensured Service's own sync would update its hosts alone first,
                // one call each (757 calls at 20,000 Nodes, and minutes of node-change latency).
                self.queue.add_first(Key::Hosts);
                continue;
            }
            for svc in changed {
                self.queue.add(Key::Service(service_key(&svc)));
            }
        }
    }

    /// The current node set of `selector` (`None`: every backend): the one last built, unless
    /// a Node change a load balancer sees (or a new provider identity) came since.
    pub(super) fn backends(&self, selector: Option<&NodeSelector>) -> Arc<HostSet> {
        let identity = self.ctx.provider.identity();
        let identity_key = identity.as_ref().map_or(0, |i| Arc::as_ptr(i) as usize);
        // Read before the store: a change during the build leaves the set stale, and it is
        // built again at the next call.
        let generation = self.host_set.generation.load(Ordering::Acquire);
        let key = set_key(selector);
        let mut built = self.host_set.built.locked();
        if let Some((g, i, set)) = built.get(key)
            && *g == generation
            && *i == identity_key
        {
            return set.clone();
        }
        let set = Arc::new(HostSet::new(self.backend_nodes(selector)));
        // Sets of an older generation (or of selectors no longer used) are dropped.
        built.retain(|_, (g, i, _)| *g == generation && *i == identity_key);
        built.insert(key.to_string(), (generation, identity_key, set.clone()));
        set
    }

    /// The backends in the cache that `selector` chooses, by name.
    fn backend_nodes(&self, selector: Option<&NodeSelector>) -> Vec<Arc<Node>> {
        let mut nodes: Vec<Arc<Node>> = self
            .ctx
            .nodes
            .store()
            .state()
            .into_iter()
            .filter(|n| is_backend(&self.ctx, n) && selector.is_none_or(|s| s.matches(n)))
            .collect();
        nodes.sort_by(|a, b| node_util::name(a).cmp(node_util::name(b)));
        nodes
    }

    /// The Nodes the load balancer should have (those its selector chooses); `None` when it
    /// is to be left as it is. An empty set never empties a load balancer that had hosts
    /// (`last`, or, unknown since this process started, its ingress): it keeps the last
    /// non-empty set of its selector (every backend without one), and a spec change or a
    /// repair is applied with those hosts. When no such set was seen since this process
    /// started (a new leader), the hosts the load balancer has in the cloud are kept, where
    /// the provider reports them; otherwise (or when it was found gone from the cloud) it is
    /// ensured with none, as upstream does. An error when the cloud could not be read.
    pub(super) async fn backends_for(
        &self,
        svc: &Service,
        lb_name: &str,
        selector: Option<&NodeSelector>,
        last: Option<Ensured>,
    ) -> Result<Arc<HostSet>, Error> {
        let backends = self.backends(selector);
        let key = set_key(selector);
        let had_hosts = last.map_or_else(|| has_ingress(svc), |e| e.count > 0);
        if !backends.is_empty() {
            self.remember_backends(key, &backends);
            return Ok(backends);
        }
        if !had_hosts {
            let note = match selector {
                None => "There are no available nodes for LoadBalancer".to_string(),
                Some(s) => format!("There are no available nodes for LoadBalancer matching the node selector {:?}", s.text),
            };
            self.ctx.event(NAME, svc, EventType::Warning, reason::UNAVAILABLE_LOAD_BALANCER, note).await;
            return Ok(backends);
        }
        // An empty node set is far likelier a listing glitch (an API server that came back
        // empty, every Node excluded by a bad label, a selector's label moved) than a cluster
        // that wants its load balancers cut off.
        tracing::warn!(service = %service_key(svc), "no Node is a load balancer backend; the load balancer keeps its hosts");
        let note = match selector {
            None => "No Node is a load balancer backend now: the load balancer keeps its current hosts \
                     instead of being emptied, until a Node is one again"
                .to_string(),
            Some(s) => format!(
                "No load balancer backend matches the node selector {:?} now: the load balancer keeps its \
                 current hosts instead of being emptied, until a Node matches again",
                s.text
            ),
        };
        self.ctx.event(NAME, svc, EventType::Warning, reason::UNAVAILABLE_LOAD_BALANCER, note).await;
        let (kept, repairing) = {
            let state = self.state();
            (state.last_backends.get(key).cloned(), state.repairing.contains(&service_key(svc)))
        };
        if let Some(kept) = kept {
            return Ok(kept);
        }
        if repairing {
            return Ok(backends);
        }
        // None seen since this process started: the hosts it has in the cloud.
        let found = self.ctx.provider.read_load_balancer(self.request(svc, lb_name.to_string(), Vec::new())).await?;
        let Some(hosts) = found.and_then(|f| f.hosts) else { return Ok(backends) };
        let hosts: std::collections::HashSet<String> = hosts.into_iter().collect();
        let nodes: Vec<Arc<Node>> =
            self.ctx.nodes.store().state().into_iter().filter(|n| hosts.contains(node_util::name(n))).collect();
        let set = Arc::new(HostSet::new(nodes));
        if !set.is_empty() {
            self.remember_backends(key, &set);
        }
        // The cloud has them (as far as they are Nodes still: hosts of Nodes deleted since
        // are not taken away either, as the leader before kept them): nothing to update.
        if let Some(e) = self.state().ensured.get_mut(&service_key(svc)) {
            e.hosts = set.hosts;
            e.count = set.count;
        }
        Ok(set)
    }

    /// Keeps `backends` as the last non-empty set of the selector keyed `key`. The sets of
    /// selectors no Service uses any more are dropped when many are kept.
    fn remember_backends(&self, key: &str, backends: &Arc<HostSet>) {
        let mut state = self.state();
        let known = state.last_backends.get(key).is_some_and(|b| Arc::ptr_eq(b, backends));
        if known {
            return;
        }
        state.last_backends.insert(key.to_string(), backends.clone());
        if state.last_backends.len() > LAST_SETS_KEPT {
            drop(state);
            let in_use: std::collections::HashSet<String> = self
                .ctx
                .services
                .sorted()
                .iter()
                .filter_map(|svc| node_selector(svc).ok().map(|s| set_key(s.as_ref()).to_string()))
                .collect();
            self.state().last_backends.retain(|k, _| in_use.contains(k));
        }
    }

    /// After the node set changed, with a provider that updates hosts in bulk: one
    /// BatchUpdateLoadBalancerHosts per 500 load balancers whose Service is as it was last
    /// ensured under its recorded name (its spec and, when it is given pods, its pods). Every
    /// other Service (not ensured yet, changed, being renamed, or with no backend left, which
    /// keeps its hosts) takes its own reconcile, and so does each load balancer whose item
    /// failed: at once when it failed for good, after the item's RetryInfo (or the first
    /// backoff) when transiently, then with its own per-key backoff. Only a failure of the
    /// whole call retries the pass: one failing load balancer must not hold back the others'
    /// next node change (the shared key's backoff grows to minutes and a node change cannot
    /// cut it short).
    pub(super) async fn update_all_hosts(&self) -> Outcome {
        let Some(identity) = self.ctx.provider.identity() else {
            return Outcome::of_provider_error(None, &Error::unavailable("provider not ready"));
        };
        if !identity.serves_load_balancers() {
            return Outcome::Success;
        }
        // By node set (selector), in the order first seen: one call per set and 500.
        let mut groups: Vec<(String, Arc<HostSet>, Vec<Todo>)> = Vec::new();
        let mut group_of: HashMap<String, usize> = HashMap::new();
        // The load balancers in this pass's calls, claimed until they end.
        let mut claims = Vec::new();
        for svc in self.ctx.services.sorted() {
            if !self.wants_load_balancer(&svc) {
                continue;
            }
            let k = service_key(&svc);
            let Ok(selector) = node_selector(&svc) else {
                // Malformed: its own reconcile reports it, and its load balancer keeps what it has.
                self.queue.add(Key::Service(k));
                continue;
            };
            let uid = svc.metadata.uid.as_deref().unwrap_or_default();
            let (last, name) = {
                let state = self.state();
                (state.ensured.get(&k).copied(), state.names.get(uid).cloned())
            };
            let ranges = source_ranges(&svc);
            let as_ensured = last.is_some_and(|e| e.spec == self.ensured_spec(&svc))
                && has_finalizer(&svc)
                && name.is_some()
                && super::naming::annotated_name(&svc) == name.as_deref()
                && ranges.is_ok();
            let key = set_key(selector.as_ref());
            let i = match group_of.get(key) {
                Some(i) => *i,
                None => {
                    groups.push((key.to_string(), self.backends(selector.as_ref()), Vec::new()));
                    group_of.insert(key.to_string(), groups.len() - 1);
                    groups.len() - 1
                }
            };
            let backends = &groups[i].1;
            match (last, name) {
                // Its hosts wait for the first sweep's listing.
                (Some(e), Some(_)) if e.unconfirmed => {}
                (Some(e), Some(name)) if as_ensured && !backends.is_empty() => {
                    if e.hosts != backends.hosts {
                        // Its own reconcile is mutating it now: that one (queued again)
                        // brings the hosts along.
                        let Some(claim) = self.claim(&k) else {
                            self.queue.add(Key::Service(k));
                            continue;
                        };
                        claims.push(claim);
                        let ensured = Ensured::of(e.spec, backends);
                        let request = self.request(&svc, name, ranges.unwrap_or_default());
                        groups[i].2.push((svc.clone(), request, ensured));
                    }
                }
                _ => self.queue.add(Key::Service(k)),
            }
        }
        let mut call_failed = None;
        for (key, backends, todo) in groups.into_iter().filter(|(_, _, todo)| !todo.is_empty()) {
            if let Some(error) = self.update_group_hosts(&key, &backends, todo).await {
                call_failed.get_or_insert(error);
            }
        }
        drop(claims);
        match call_failed {
            Some(error) => Outcome::of_provider_error(None, &error),
            None => Outcome::Success,
        }
    }

    /// One BatchUpdateLoadBalancerHosts (per 500) pointing `todo`'s load balancers at
    /// `backends`; the transient error of a call that failed as a whole, if any.
    async fn update_group_hosts(&self, key: &str, backends: &Arc<HostSet>, todo: Vec<Todo>) -> Option<Error> {
        if !backends.is_empty() {
            self.remember_backends(key, backends);
        }
        let services: Vec<LoadBalancerRequest> = todo.iter().map(|(_, lb, _)| lb.clone()).collect();
        tracing::debug!(load_balancers = services.len(), hosts = backends.count, selector = %key, "updating load balancers' hosts in bulk");
        let started = Instant::now();
        let results = self.ctx.cloud().batch_update_load_balancer_hosts(&services, backends.provider()).await;
        let (results, call_failed) = results;
        for ((svc, _, ensured), result) in todo.into_iter().zip(results) {
            self.ctx.metrics.hosts_update(started.elapsed(), result.is_err());
            let k = service_key(&svc);
            match result {
                Ok(()) => {
                    self.state().record(k, ensured);
                    let note = format!("Updated load balancer with new hosts ({})", ensured.count);
                    self.ctx.event(NAME, svc.as_ref(), EventType::Normal, reason::UPDATED_LOAD_BALANCER, note).await;
                }
                // A call that failed as a whole is the pass's to retry (below): its load
                // balancers are still not as ensured, the others are.
                Err(_) if call_failed.as_ref().is_some_and(Error::is_transient) => {}
                Err(error) if error.is_transient() => {
                    tracing::debug!(service = %k, %error, "updating the load balancer's hosts failed; retried alone");
                    self.queue.add_after(Key::Service(k), error.retry_after().unwrap_or_else(|| self.queue.backoff(1)));
                }
                Err(error) => {
                    tracing::warn!(service = %k, %error, "updating the load balancer's hosts failed");
                    let note = format!("Error updating load balancer with new hosts: {error}");
                    self.ctx.event(NAME, svc.as_ref(), EventType::Warning, reason::UPDATE_LOAD_BALANCER_FAILED, note).await;
                    // A load balancer that vanished is made again as a repair (within its
                    // bound); while the bound has no room, the hosts update is retried.
                    if matches!(error, Error::NotFound { .. }) && !self.found_gone(&k).await {
                        self.queue.add_after(Key::Service(k), self.queue.backoff(1));
                        continue;
                    }
                    self.queue.add(Key::Service(k));
                }
            }
        }
        call_failed.filter(Error::is_transient)
    }

    /// UpdateLoadBalancerHosts: the spec is what was ensured, only the Nodes changed.
    pub(super) async fn update_hosts(
        &self,
        svc: &Service,
        lb: LoadBalancerRequest,
        backends: &HostSet,
        ensured: Ensured,
    ) -> Result<(), SyncError> {
        let k = service_key(svc);
        tracing::debug!(service = %k, hosts = backends.count, "updating the load balancer's hosts");
        let started = Instant::now();
        let r = self.ctx.cloud().update_load_balancer_hosts(lb, backends.provider()).await;
        self.ctx.metrics.hosts_update(started.elapsed(), r.is_err());
        match r {
            Ok(_) => {
                self.state().record(k, ensured);
                let note = format!("Updated load balancer with new hosts ({})", ensured.count);
                self.ctx.event(NAME, svc, EventType::Normal, reason::UPDATED_LOAD_BALANCER, note).await;
                Ok(())
            }
            Err(error @ Error::RateLimited { .. }) => Err(SyncError::Provider(error)),
            Err(error) => {
                let note = format!("Error updating load balancer with new hosts: {error}");
                self.ctx.event(NAME, svc, EventType::Warning, reason::UPDATE_LOAD_BALANCER_FAILED, note).await;
                // A load balancer that vanished gets a full Ensure next time (whatever its
                // record says), as a repair within its bound.
                if matches!(error, Error::NotFound { .. }) {
                    self.found_gone(&k).await;
                }
                Err(SyncError::Provider(error))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

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
}
