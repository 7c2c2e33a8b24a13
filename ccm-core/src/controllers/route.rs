//! The route controller (`node-route-controller`): each Node podCIDR routed to its instance,
//! reconciled on informer events (KEP-5237), never on a timer.
//!
//! - Triggers: a Node added, deleted, excluded or no longer excluded, or a change of
//!   `spec.podCIDRs` or `status.addresses`, of a Node that has podCIDRs (or that the cloud's
//!   routes still name). Heartbeats, labels and conditions trigger nothing, and neither do
//!   Nodes that join without podCIDRs nor excluded ones. A burst
//!   is coalesced: the reconcile starts `--route-coalesce-delay` after the first trigger, and
//!   never sooner than `--route-min-interval` after the previous one, nor than 3 times its own
//!   computation after it (a reconcile computes over every Node: at most a quarter of a CPU,
//!   however large the cluster). `--route-reconciliation-period`, when given, adds upstream's
//!   periodic reconcile (a listing every period).
//! - The cloud's routes are listed once, then kept up to date from the outcomes of this
//!   controller's own creates and deletes: steady state lists nothing. A safety resync re-lists
//!   at a random time between `--route-resync-period` and twice it; what it finds that the
//!   kept state did not know is counted as corrections. Any error forgets the kept state, so
//!   the next reconcile re-lists.
//! - Only routes inside `--cluster-cidr` and of `--cluster-name` are ever touched.
//! - A table quota: routes are created in a deterministic order (node name, CIDR) until the
//!   table is full; Nodes left without a route get `NetworkUnavailable=True` and one
//!   `FailedToCreateRoute` Event, and the controller does not retry them in a loop. So does
//!   a Node with podCIDRs in a zone no route table covers (ResolveRouteTables names none for
//!   it, or fails for it); both count in `ccm_nodes_without_route`.

use ccm_protocol::lock::Lock;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use ccm_protocol::Error;
use futures::StreamExt;
use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Node, NodeAddress};
use kube::Api;
use kube::runtime::reflector::ObjectRef;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Context;
use super::runner::{self, Done, Watches};
use crate::events::{EventType, reason};
use crate::informer::Change;
use crate::node_util::{self, pod_cidrs};
use crate::provider::Changes as ProviderChanges;
use crate::provider::convert::{Route, RouteCapabilities, RouteTable, RouteTarget};
use crate::queue::{Outcome, QueueConfig, WorkQueue};
use crate::wellknown::ANNOTATION_POD_CIDRS_FROM_CLOUD;
use crate::wellknown::CONDITION_NETWORK_UNAVAILABLE as CONDITION;

/// The controller's name.
pub const NAME: &str = "node-route-controller";

/// Whether a Node change matters to routes.
pub fn relevant(old: Option<&Node>, new: &Node) -> bool {
    let Some(old) = old else { return true };
    pod_cidrs(old) != pod_cidrs(new)
        || node_util::addresses(old) != node_util::addresses(new)
        || node_util::provider_id(old) != node_util::provider_id(new)
}

/// The route name for a Node's CIDR: readable, deterministic, at most 253 characters.
pub fn route_name(cluster: &str, node: &str, cidr: &str) -> String {
    let clean: String = cidr.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '-' }).collect();
    let name = format!("{cluster}-{node}-{clean}");
    if name.len() <= 253 {
        return name;
    }
    // At a character boundary: a cluster or Node name need not be ASCII.
    let mut cut = 236;
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}-{:016x}", &name[..cut], stable_hash(&name))
}

/// SipHash-1-3 with zero keys over the name's bytes and a 0xff terminator: what
/// `std`'s `DefaultHasher` gives a `str` today (so names stored by earlier releases still
/// match), fixed here because `DefaultHasher`'s algorithm may change with any Rust release,
/// and names stored in the cloud must not.
fn stable_hash(name: &str) -> u64 {
    use std::hash::Hasher;
    let mut h = siphasher::sip::SipHasher13::new_with_keys(0, 0);
    h.write(name.as_bytes());
    h.write_u8(0xff);
    h.finish()
}

#[derive(Debug, Clone, Default)]
struct Known {
    tables: Vec<RouteTable>,
    /// Table id → route name → route.
    routes: BTreeMap<String, BTreeMap<String, Route>>,
}

impl Known {
    fn keys(&self) -> BTreeSet<(String, String, String)> {
        self.routes
            .iter()
            .flat_map(|(t, routes)| routes.values().map(move |r| (t.clone(), r.name.clone(), r.destination_cidr.clone())))
            .collect()
    }
}

/// What one reconcile did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouteSync {
    /// Routes created.
    pub created: u64,
    /// Routes deleted.
    pub deleted: u64,
    /// Drift found by a resync.
    pub corrections: u64,
    /// Nodes left without a route (quota).
    pub without_route: BTreeSet<String>,
    /// Nodes with podCIDRs for which the provider resolves no route table (none, or an
    /// error), and why: left without a route too.
    pub untabled: BTreeMap<String, String>,
    /// Cloud routes kept for a Node although another tool named them (adopted).
    pub adopted: u64,
    /// Routes no wanted route serves that were kept: their Node is still there with that
    /// podCIDR (excluded, being deleted, or missing from the table resolution).
    pub kept: u64,
    /// More routes were stale than one reconcile deletes (`--max-route-deletions`).
    pub deletions_left: bool,
    /// Deletions held back because their Node was found gone only just now: when the first
    /// of them is due.
    pub deferred: Option<Duration>,
}

/// What the Nodes want: table id → route name → (Node name, route).
type Desired = BTreeMap<String, BTreeMap<String, (String, Route)>>;

/// The route tables of each (Node name, providerID), as resolved.
type Tables = HashMap<(String, String), Vec<String>>;

/// What the deletes did: (table, route name) and the result.
type Deleted = Vec<((String, String), Result<(), Error>)>;

/// What the creates did: Node, the route asked for, and the result.
type Created = Vec<(String, Route, Result<Route, Error>)>;

/// What one reconcile will change: (table, route name) to delete, (Node, route) to create.
#[derive(Debug, Default)]
struct Changes {
    deletes: Vec<(String, String)>,
    creates: Vec<(String, Route)>,
}

/// What one table needs.
#[derive(Debug, Default, PartialEq)]
struct TablePlan {
    /// Our route name → the name of the cloud route that serves it under another name.
    adopted: BTreeMap<String, String>,
    /// Cloud routes to delete.
    deletes: Vec<String>,
    /// Routes to create, with their Node.
    missing: Vec<(String, Route)>,
}

fn same_address_set(a: &[NodeAddress], b: &[NodeAddress]) -> bool {
    a.len() == b.len() && a.iter().all(|x| b.contains(x)) && b.iter().all(|x| a.contains(x))
}

/// Whether a cloud route serves a wanted one: the same destination and target Node (and
/// instance, when both say), not a blackhole, and, when the provider records target
/// addresses, the same set of them. Names play no part: a route another tool made (upstream's
/// cloud-controller-manager before a migration, an administrator) is adopted, not replaced.
fn serves(have: &Route, want: &Route, addresses: bool) -> bool {
    let default = RouteTarget::default();
    let (h, w) = (have.target.as_ref().unwrap_or(&default), want.target.as_ref().unwrap_or(&default));
    !have.blackhole
        && have.destination_cidr == want.destination_cidr
        && h.node_name == w.node_name
        && (w.provider_id.is_empty() || h.provider_id.is_empty() || node_util::same_instance(&h.provider_id, &w.provider_id))
        && (!addresses || same_address_set(&have.target_addresses, &want.target_addresses))
}

/// Matches a table's cloud routes to the wanted ones: each wanted route is served by the
/// cloud route of its own name if that one serves it, else by any unmatched one that does;
/// cloud routes inside the cluster CIDRs that serve none are deleted.
fn plan_table(
    have: &BTreeMap<String, Route>,
    want: &BTreeMap<String, (String, Route)>,
    addresses: bool,
    in_cluster: impl Fn(&str) -> bool,
) -> TablePlan {
    let mut by_destination: HashMap<&str, Vec<&Route>> = HashMap::new();
    for route in have.values() {
        by_destination.entry(route.destination_cidr.as_str()).or_default().push(route);
    }
    let mut used: HashSet<&str> = HashSet::new();
    let mut plan = TablePlan::default();
    for (ours, (node, w)) in want {
        let candidates = by_destination.get(w.destination_cidr.as_str()).map(Vec::as_slice).unwrap_or_default();
        let found = have
            .get(ours)
            .filter(|h| !used.contains(h.name.as_str()) && serves(h, w, addresses))
            .or_else(|| candidates.iter().copied().find(|h| !used.contains(h.name.as_str()) && serves(h, w, addresses)));
        match found {
            Some(h) => {
                used.insert(h.name.as_str());
                if h.name != *ours {
                    plan.adopted.insert(ours.clone(), h.name.clone());
                }
            }
            None => plan.missing.push((node.clone(), w.clone())),
        }
    }
    plan.deletes = have
        .values()
        .filter(|r| in_cluster(&r.destination_cidr) && !used.contains(r.name.as_str()))
        .map(|r| r.name.clone())
        .collect();
    plan
}

/// The route controller's tables as it knows them, and the reconcile that brings them to what
/// the Nodes want; one reconcile at a time (the runner's one worker holds it).
struct Routes {
    ctx: Context,
    cluster_cidrs: Vec<IpNet>,
    known: Option<Known>,
    /// What the last listing plus our own changes said, kept across a resync to count drift.
    previous: Option<Known>,
    resolved: HashMap<(String, String), Vec<String>>,
    /// The Nodes of the last table resolution that got no table, and why.
    untabled: BTreeMap<String, String>,
    conditions: ConditionWriter,
    /// Routes created or deleted by the last reconcile, failed or not.
    progress: u64,
    /// Set when the provider came back as another provider (the count of identity changes
    /// then): no route is deleted until the next full resync.
    paused: Option<u64>,
    /// Cloud routes adopted (table, name), so each is logged once.
    adopted: HashSet<(String, String)>,
    /// Nodes without podCIDRs that the cloud's routes still name, as of the last reconcile
    /// (shared with the trigger, see [`RouteController::matters`]).
    unrouted: Arc<std::sync::Mutex<HashSet<String>>>,
    /// The last reconcile's time at work on the CPU: its own computation over the Nodes,
    /// not its waits on the cloud and the API server.
    busy: Duration,
    /// When each Node that routes still name was first read as gone from the API server.
    absent_since: HashMap<String, Instant>,
}

/// How long a Node is gone before the routes that name it are deleted (see
/// `Routes::confirm_deletions`).
const ABSENT_GRACE: Duration = Duration::from_secs(10);

/// Times `f` into `busy` (a reconcile's synchronous work over the Nodes).
fn timed<T>(busy: &mut Duration, f: impl FnOnce() -> T) -> T {
    let started = std::time::Instant::now();
    let out = f();
    *busy += started.elapsed();
    out
}

/// Whether the Node's podCIDRs are the ones the cloud gave its instance (recorded by the cloud
/// allocator).
fn cloud_routed(node: &Node) -> bool {
    let record = node.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_POD_CIDRS_FROM_CLOUD));
    record.is_some_and(|r| {
        let recorded: BTreeSet<&str> = r.split(',').map(str::trim).collect();
        let have = pod_cidrs(node);
        !have.is_empty() && have.iter().all(|c| recorded.contains(c.as_str()))
    })
}

/// Writes the Nodes' NetworkUnavailable conditions in the background (one task of the
/// controller's own, see [`RouteController`]'s `spawn`: it ends with the controller), one batch
/// after the other, so that a reconcile does not wait for hundreds of status writes before the
/// next one can create routes. A condition written and not yet in the cache is not written
/// twice; one that another writer changed since is written again.
#[derive(Clone)]
struct ConditionWriter {
    ctx: Context,
    /// The batches for the writing task.
    batches: tokio::sync::mpsc::UnboundedSender<Vec<ConditionWrite>>,
    /// The writing task's end of `batches`, until it starts.
    receiver: Arc<std::sync::Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<Vec<ConditionWrite>>>>>,
    /// The status last written, by Node UID (a recreated Node starts afresh).
    written: Written,
    /// Nodes whose Event of being left without a route (a full table, no table) was recorded.
    reported: Arc<std::sync::Mutex<HashSet<String>>>,
}

/// What this controller last wrote to each Node's NetworkUnavailable, by Node UID.
type Written = Arc<std::sync::Mutex<HashMap<String, Wrote>>>;

/// One condition written (or being written).
#[derive(Debug, Clone, PartialEq)]
struct Wrote {
    /// Whether the Node's routes existed (status False).
    ok: bool,
    /// The Node's resourceVersion our write gave it; `None` while the write is in flight.
    version: Option<String>,
}

/// The NetworkUnavailable status and reason of `node`, if it has the condition.
fn network_condition(node: &Node) -> Option<(&str, Option<&str>)> {
    let conditions = node.status.as_ref()?.conditions.as_ref()?;
    conditions.iter().find(|c| c.type_ == CONDITION).map(|c| (c.status.as_str(), c.reason.as_deref()))
}

/// Whether the cache's `cached` resourceVersion is older than `ours`: as etcd's revisions
/// (comparable since Kubernetes 1.34); not older when either is not one.
fn older(cached: Option<&str>, ours: &str) -> bool {
    match (cached.and_then(|c| c.parse::<u64>().ok()), ours.parse::<u64>().ok()) {
        (Some(c), Some(o)) => c < o,
        _ => false,
    }
}

impl Routes {
    fn new(ctx: Context) -> Result<Self, super::ConfigError> {
        let cluster_cidrs = ctx
            .options
            .cluster_cidr
            .iter()
            .map(|c| c.parse::<IpNet>().map_err(|_| super::ConfigError::not_a_cidr("--cluster-cidr", c)))
            .collect::<Result<Vec<_>, _>>()?;
        let ctx_for_conditions = ctx.clone();
        Ok(Self {
            ctx,
            cluster_cidrs,
            known: None,
            previous: None,
            resolved: HashMap::new(),
            untabled: BTreeMap::new(),
            progress: 0,
            paused: None,
            adopted: HashSet::new(),
            unrouted: Default::default(),
            busy: Duration::ZERO,
            absent_since: HashMap::new(),
            conditions: {
                let (batches, receiver) = tokio::sync::mpsc::unbounded_channel();
                ConditionWriter {
                    ctx: ctx_for_conditions,
                    batches,
                    receiver: Arc::new(std::sync::Mutex::new(Some(receiver))),
                    written: Default::default(),
                    reported: Default::default(),
                }
            },
        })
    }

    async fn list(&self, caps: &RouteCapabilities) -> Result<Known, Error> {
        let mut known = Known { tables: self.ctx.provider.list_route_tables().await?, ..Default::default() };
        if known.tables.is_empty() {
            return Err(Error::internal("the provider lists no route table"));
        }
        if !caps.multiple_tables {
            known.tables.truncate(1);
        }
        let cluster = &self.ctx.options.cluster_name;
        for table in &known.tables {
            let routes = self.ctx.provider.list_routes(cluster, &table.id).await?;
            known.routes.insert(table.id.clone(), routes.into_iter().map(|r| (r.name.clone(), r)).collect());
        }
        Ok(known)
    }

    /// Why a cloud route no wanted route serves must stay, if it must: it is deleted only on
    /// evidence that it is stale: its Node gone from the API, its podCIDR changed, its
    /// instance another, or the route a blackhole. A Node
    /// excluded from the controllers, being deleted or drained, or left out of a short or
    /// failed ResolveRouteTables answer keeps its routes (a route in a table the Node's
    /// resolved tables no longer name is stale, when they were resolved).
    fn still_wanted(&self, route: &Route, want: &BTreeMap<String, (String, Route)>, tables: &Tables) -> Option<String> {
        if route.blackhole {
            return None; // it serves nothing (its instance is gone)
        }
        // No target: no Node to judge it by, so no evidence that it is stale. Kept.
        let Some(target) = route.target.as_ref() else {
            return Some(format!("route {:?} names no target: kept without evidence it is stale", route.name));
        };
        if want.values().any(|(node, w)| *node == target.node_name && w.destination_cidr == route.destination_cidr) {
            return None; // replaced by the route the Node wants (new addresses, say)
        }
        let node = self.ctx.nodes.store().get(&ObjectRef::new(&target.node_name))?;
        if !pod_cidrs(&node).contains(&route.destination_cidr) {
            return None; // its podCIDR changed
        }
        let instance = node_util::provider_id(&node).unwrap_or_default();
        if !target.provider_id.is_empty() && !instance.is_empty() && !node_util::same_instance(&target.provider_id, instance) {
            return None; // the Node is another instance now
        }
        let key = (target.node_name.clone(), node_util::provider_id(&node).unwrap_or_default().to_string());
        match tables.get(&key) {
            Some(resolved) if !resolved.contains(&route.table_id) && !self.ctx.ignores(&node) => None,
            _ => Some(format!("node {} still has podCIDR {}", target.node_name, route.destination_cidr)),
        }
    }

    /// Keeps the deletions whose evidence the API server confirms: a route that is no
    /// blackhole and not being replaced is deleted because the Node cache says its Node is
    /// gone or has another podCIDR, and a cache can be stale (a watch that was cut, a replica that just took the
    /// lead after a partition). Each such Node is read from the API server; one that is
    /// there with the route's destination, or a read that fails, keeps the route.
    ///
    /// A Node found gone (or there without a podCIDR yet) is so for [`ABSENT_GRACE`] before its
    /// route is deleted: one deleted and made again under its name (a kubelet re-registering)
    /// may be given the same podCIDR at once (node IPAM of a new leader hands out the lowest
    /// free one), and the route then is its own.
    async fn confirm_deletions(&mut self, changes: &mut Changes, known: &Known, sync: &mut RouteSync) {
        let mut confirmed = Vec::with_capacity(changes.deletes.len());
        let now = Instant::now();
        let mut absent = HashSet::new();
        for (table, name) in std::mem::take(&mut changes.deletes) {
            let route = known.routes.get(&table).and_then(|r| r.get(&name));
            let target = route.filter(|r| !r.blackhole).and_then(|r| r.target.as_ref().map(|t| (r, t)));
            // A route replaced (the Node's new addresses) goes with its replacement created.
            let replaced = |(route, target): &(&Route, &RouteTarget)| {
                changes.creates.iter().any(|(node, r)| *node == target.node_name && r.destination_cidr == route.destination_cidr)
            };
            let Some((route, target)) = target.filter(|t| !replaced(t)) else {
                confirmed.push((table, name));
                continue;
            };
            let read = Api::<Node>::all(self.ctx.client.clone()).get_opt(&target.node_name).await;
            // A Node of that name without any podCIDR yet (made again, waiting for node IPAM)
            // is as good as gone for the grace: it may be given the same one.
            let read = match read {
                Ok(Some(node)) if pod_cidrs(&node).is_empty() && node.metadata.deletion_timestamp.is_none() => Ok(None),
                other => other,
            };
            let kept = match read {
                Ok(Some(node)) => {
                    let instance = node_util::provider_id(&node).unwrap_or_default();
                    let same_instance = target.provider_id.is_empty()
                        || instance.is_empty()
                        || node_util::same_instance(&target.provider_id, instance);
                    (node.metadata.deletion_timestamp.is_none()
                        && same_instance
                        && pod_cidrs(&node).contains(&route.destination_cidr))
                    .then(|| {
                        format!(
                            "node {} still has podCIDR {} (read from the API server)",
                            target.node_name, route.destination_cidr
                        )
                    })
                }
                Ok(None) => {
                    absent.insert(target.node_name.clone());
                    let since = *self.absent_since.entry(target.node_name.clone()).or_insert(now);
                    let due = (since + ABSENT_GRACE).saturating_duration_since(now);
                    (!due.is_zero()).then(|| {
                        sync.deferred = Some(sync.deferred.map_or(due, |d| d.min(due)));
                        format!("node {} was found gone only just now; deleted if it still is in {due:?}", target.node_name)
                    })
                }
                // Kept, and looked at again after the grace: nothing else may come to say so
                // (the Node's deletion was the last event).
                Err(error) => {
                    sync.deferred = Some(sync.deferred.map_or(ABSENT_GRACE, |d| d.min(ABSENT_GRACE)));
                    Some(format!(
                        "reading node {} to confirm the route is stale failed: {error}; read again in {ABSENT_GRACE:?}",
                        target.node_name
                    ))
                }
            };
            match kept {
                Some(why) => {
                    sync.kept += 1;
                    tracing::info!(table = %table, route = %name, "route kept: {why}");
                }
                None => confirmed.push((table, name)),
            }
        }
        changes.deletes = confirmed;
        // Only Nodes still found gone are remembered.
        self.absent_since.retain(|node, _| absent.contains(node));
    }

    fn in_cluster(&self, cidr: &str) -> bool {
        cidr.parse::<IpNet>().is_ok_and(|net| self.cluster_cidrs.iter().any(|c| c.contains(&net)))
    }

    async fn tables_for(&mut self, nodes: &[(String, String)], known: &Known, caps: &RouteCapabilities) -> Result<Tables, Error> {
        let default = known.tables.first().map(|t| t.id.clone()).unwrap_or_default();
        if !caps.multiple_tables {
            return Ok(nodes.iter().map(|n| (n.clone(), vec![default.clone()])).collect());
        }
        let missing: Vec<(String, String)> = nodes.iter().filter(|n| !self.resolved.contains_key(*n)).cloned().collect();
        let targets: Vec<RouteTarget> =
            missing.iter().map(|(name, id)| RouteTarget { node_name: name.clone(), provider_id: id.clone() }).collect();
        let answers = self.ctx.provider.resolve_route_tables(&targets).await?;
        self.untabled.clear();
        for (node, answer) in missing.into_iter().zip(answers) {
            match answer {
                Err(e) => {
                    tracing::warn!(node = %node.0, error = %e, "no route table for node");
                    self.untabled.insert(node.0, format!("the provider resolved no route table for it ({e})"));
                }
                Ok(table_ids) => {
                    self.resolved.insert(node, table_ids);
                }
            }
        }
        for node in nodes.iter().filter(|n| self.resolved.get(*n).is_some_and(Vec::is_empty)) {
            self.untabled.insert(node.0.clone(), "the provider names no route table for it".to_string());
        }
        Ok(nodes.iter().filter_map(|n| self.resolved.get(n).map(|t| (n.clone(), t.clone()))).collect())
    }

    /// One full reconcile: what the cloud has, what the Nodes want, the plan between them,
    /// then the plan applied. `Ok(None)` when there is nothing to do (provider without Routes).
    pub async fn reconcile(&mut self) -> Result<Option<RouteSync>, Error> {
        let Some(identity) = self.ctx.provider.identity() else { return Err(Error::unavailable("provider not ready")) };
        if !identity.serves_routes() {
            return Ok(None);
        }
        let caps = identity.route_capabilities();
        let mut sync = RouteSync::default();
        self.busy = Duration::ZERO;
        let mut known = self.known_routes(&caps, &mut sync).await?;
        let nodes: Vec<Arc<Node>> = timed(&mut self.busy, || self.ctx.managed_nodes().collect());
        let (desired, tables) = self.desired(&nodes, &known, &caps).await?;
        sync.untabled = std::mem::take(&mut self.untabled);
        let mut busy = self.busy;
        let (targeted, mut changes) = timed(&mut busy, || {
            // Nodes the cloud's routes point at now: one left without podCIDRs still has its
            // routes until they are deleted, and its network is unavailable meanwhile.
            let targeted: HashSet<String> = known
                .routes
                .values()
                .flat_map(|routes| routes.values())
                .filter(|r| self.in_cluster(&r.destination_cidr))
                .filter_map(|r| r.target.as_ref().map(|t| t.node_name.clone()))
                .collect();
            let changes = self.plan(&known, &desired, &tables, &caps, &mut sync);
            (targeted, changes)
        });
        // Not held over the cloud calls: the cache replaces these copies meanwhile (a burst of
        // podCIDRs, the conditions written below), and holding them would keep both.
        drop(nodes);
        self.confirm_deletions(&mut changes, &known, &mut sync).await;
        let first_error = self.apply(changes, &mut known, &mut sync).await;
        timed(&mut busy, || {
            let nodes: Vec<Arc<Node>> = self.ctx.managed_nodes().collect();
            let mut without: BTreeMap<String, String> =
                sync.without_route.iter().map(|n| (n.clone(), "the route table is full (provider quota)".to_string())).collect();
            without.extend(sync.untabled.iter().map(|(n, why)| (n.clone(), why.clone())));
            self.conditions.update(&nodes, &desired, &known, &without, &targeted, caps.target_addresses);
            // What a Node without podCIDRs can still change: the routes that name it.
            let mut unrouted = targeted;
            for node in nodes.iter().filter(|n| node_util::has_pod_cidrs(n)) {
                unrouted.remove(node_util::name(node));
            }
            *self.unrouted.locked() = unrouted.into_iter().collect();
        });
        self.busy = busy;
        // Ours again, as the cloud now is. (A reconcile that failed before here leaves none:
        // the next one lists afresh, as after any failure.)
        self.known = Some(known);
        self.progress = sync.created + sync.deleted;
        match first_error {
            Some(e) => Err(e),
            None => Ok(Some(sync)),
        }
    }

    /// The cloud's routes: as last known, or listed afresh after a resync (counting, and
    /// reporting, what changed behind the controller's back since the previous listing).
    /// Taken, not copied (at 20,000 Nodes every copy is megabytes): the reconcile gives them
    /// back when it is done.
    async fn known_routes(&mut self, caps: &RouteCapabilities, sync: &mut RouteSync) -> Result<Known, Error> {
        if self.known.is_none() {
            let fresh = self.list(caps).await?;
            if let Some(before) = self.previous.take() {
                let (a, b) = (before.keys(), fresh.keys());
                sync.corrections = a.symmetric_difference(&b).filter(|(_, _, cidr)| self.in_cluster(cidr)).count() as u64;
                if sync.corrections > 0 {
                    tracing::warn!(
                        corrections = sync.corrections,
                        "the resync found routes that changed behind the controller's back"
                    );
                    let note = format!(
                        "The resync found {} of the cluster's routes missing or changed behind the controller's back: \
                         missing ones are made again, stale ones deleted only on evidence",
                        sync.corrections
                    );
                    self.ctx.event(NAME, &self.ctx.lease(), EventType::Warning, reason::ROUTES_DRIFTED, note).await;
                }
            }
            self.known = Some(fresh);
        }
        Ok(self.known.take().unwrap_or_default())
    }

    /// What the Nodes want, table → route name → (Node, route), and each Node's tables.
    async fn desired(
        &mut self,
        nodes: &[Arc<Node>],
        known: &Known,
        caps: &RouteCapabilities,
    ) -> Result<(Desired, Tables), Error> {
        let started = std::time::Instant::now();
        // PodCIDRs the cloud gave and routes itself need no route (see `ipam.rs`).
        let routed = self.ctx.provider.identity().is_some_and(|i| i.pod_cidrs_routed());
        let nodes: Vec<&Arc<Node>> = nodes.iter().filter(|n| !(routed && cloud_routed(n))).collect();
        let targets: Vec<(String, String)> = nodes
            .iter()
            .filter(|n| node_util::has_pod_cidrs(n))
            .map(|n| (node_util::name(n).to_string(), node_util::provider_id(n).unwrap_or_default().to_string()))
            .collect();
        self.busy += started.elapsed();
        let tables = self.tables_for(&targets, known, caps).await?;
        let started = std::time::Instant::now();
        let mut desired = Desired::new();
        for node in nodes {
            let name = node_util::name(node).to_string();
            let provider_id = node_util::provider_id(node).unwrap_or_default().to_string();
            let Some(node_tables) = tables.get(&(name.clone(), provider_id.clone())) else { continue };
            for cidr in pod_cidrs(node).into_iter().filter(|c| self.in_cluster(c)) {
                for table in node_tables {
                    let target_addresses = if caps.target_addresses { node_util::addresses(node) } else { Vec::new() };
                    let route = Route {
                        name: route_name(&self.ctx.options.cluster_name, &name, &cidr),
                        target: Some(RouteTarget { node_name: name.clone(), provider_id: provider_id.clone() }),
                        destination_cidr: cidr.clone(),
                        table_id: table.clone(),
                        blackhole: false,
                        target_addresses,
                    };
                    desired.entry(table.clone()).or_default().insert(route.name.clone(), (name.clone(), route));
                }
            }
        }
        self.busy += started.elapsed();
        Ok((desired, tables))
    }

    /// The routes to delete and create: per table, what [`plan_table`] finds, deletions only
    /// on evidence ([`RouteController::still_wanted`]), creations within the table's room,
    /// no deletions while the provider's identity changed, at most `--max-route-deletions`.
    fn plan(
        &mut self,
        known: &Known,
        desired: &Desired,
        tables: &Tables,
        caps: &RouteCapabilities,
        sync: &mut RouteSync,
    ) -> Changes {
        let mut changes = Changes::default();
        let (no_routes, none_wanted) = (BTreeMap::new(), BTreeMap::new());
        for table in &known.tables {
            let have = known.routes.get(&table.id).unwrap_or(&no_routes);
            let want = desired.get(&table.id).unwrap_or(&none_wanted);
            let plan = plan_table(have, want, caps.target_addresses, |cidr| self.in_cluster(cidr));
            for (ours, theirs) in &plan.adopted {
                if self.adopted.insert((table.id.clone(), theirs.clone())) {
                    tracing::info!(table = %table.id, route = %theirs, instead_of = %ours, "adopted a route made under another name");
                }
            }
            sync.adopted += plan.adopted.len() as u64;
            for name in plan.deletes {
                match have.get(&name).and_then(|r| self.still_wanted(r, want, tables)) {
                    Some(why) => {
                        sync.kept += 1;
                        tracing::debug!(table = %table.id, route = %name, "route kept: {why}");
                    }
                    None => changes.deletes.push((table.id.clone(), name)),
                }
            }
            let max = if table.max_routes > 0 { table.max_routes } else { caps.max_routes_per_table } as usize;
            let remaining = have.len() - changes.deletes.iter().filter(|(t, _)| *t == table.id).count();
            let mut room = if max > 0 { max.saturating_sub(remaining) } else { usize::MAX };
            // Deterministic order: by node name, then CIDR.
            let mut missing = plan.missing;
            missing.sort_by(|a, b| (&a.0, &a.1.destination_cidr).cmp(&(&b.0, &b.1.destination_cidr)));
            for (node, route) in missing {
                if room == 0 {
                    sync.without_route.insert(node);
                    continue;
                }
                room -= 1;
                changes.creates.push((node, route));
            }
        }
        if self.paused.is_some() && !changes.deletes.is_empty() {
            tracing::warn!(
                deletes = changes.deletes.len(),
                "stale routes kept: deletions pause since the provider's identity changed, until the next full resync"
            );
            sync.kept += changes.deletes.len() as u64;
            changes.deletes.clear();
        }
        // At most --max-route-deletions in one reconcile; the rest wait for the next one.
        let cap = self.ctx.options.max_route_deletions;
        if changes.deletes.len() > cap {
            tracing::warn!(
                deletes = changes.deletes.len(),
                cap,
                "more stale routes than one reconcile deletes; the rest at the next"
            );
            changes.deletes.truncate(cap);
            sync.deletions_left = true;
        }
        changes
    }

    /// Deletes, then creates (`--concurrent-route-syncs` calls at a time, or, when the
    /// provider advertises bulk_apply, one ApplyRoutes per table and 500 items), keeping
    /// `known` as the cloud now is; the first error, if any (a full table is not one: its Node
    /// is counted without a route).
    async fn apply(&self, changes: Changes, known: &mut Known, sync: &mut RouteSync) -> Option<Error> {
        let (deleted, created) = if self.ctx.provider.identity().is_some_and(|i| i.bulk_routes()) {
            self.apply_in_bulk(changes).await
        } else {
            self.apply_one_by_one(changes).await
        };
        let mut first_error = None;
        for ((table, name), result) in deleted {
            match result {
                Ok(()) => {
                    sync.deleted += 1;
                    known.routes.entry(table).or_default().remove(&name);
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        for (node, wanted, result) in created {
            match result {
                Ok(route) => {
                    sync.created += 1;
                    known.routes.entry(wanted.table_id.clone()).or_default().insert(route.name.clone(), route);
                }
                // A full table is not an error to retry: the Node is left without a route.
                Err(Error::QuotaExceeded { .. }) => {
                    sync.without_route.insert(node);
                }
                Err(e) => {
                    // Upstream's Event on every failed create (aggregated into a series).
                    if let Some(n) = self.ctx.nodes.store().get(&ObjectRef::new(&node)) {
                        let note = format!("Could not create route {} for node {node}: {e}", wanted.destination_cidr);
                        self.ctx.event(NAME, n.as_ref(), EventType::Warning, reason::FAILED_TO_CREATE_ROUTE, note).await;
                    }
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error
    }

    /// Deletes, then creates, one call each, `--concurrent-route-syncs` at a time.
    async fn apply_one_by_one(&self, changes: Changes) -> (Deleted, Created) {
        let concurrency = self.ctx.options.concurrent_route_syncs.max(1);
        let cluster = self.ctx.options.cluster_name.clone();
        let provider = self.ctx.cloud();
        let deleted: Deleted = futures::stream::iter(changes.deletes)
            .map(|(table, name)| {
                let (provider, cluster) = (provider.clone(), cluster.clone());
                async move {
                    let r = provider.delete_route(&cluster, &table, &name).await;
                    ((table, name), r)
                }
            })
            .buffer_unordered(concurrency)
            .collect()
            .await;
        let created: Created = futures::stream::iter(changes.creates)
            .map(|(node, route)| {
                let (provider, cluster) = (provider.clone(), cluster.clone());
                async move {
                    let r = provider.create_route(&cluster, route.clone()).await;
                    (node, route, r)
                }
            })
            .buffer_unordered(concurrency)
            .collect()
            .await;
        (deleted, created)
    }

    /// Deletes, then creates, with ApplyRoutes: each table's changes in calls of 500 items.
    async fn apply_in_bulk(&self, changes: Changes) -> (Deleted, Created) {
        let cluster = &self.ctx.options.cluster_name;
        let mut by_table: BTreeMap<String, Changes> = BTreeMap::new();
        for (table, name) in changes.deletes {
            by_table.entry(table.clone()).or_default().deletes.push((table, name));
        }
        for (node, route) in changes.creates {
            by_table.entry(route.table_id.clone()).or_default().creates.push((node, route));
        }
        let (mut deleted, mut created) = (Vec::new(), Vec::new());
        for (table, changes) in by_table {
            let names = changes.deletes.iter().map(|(_, name)| name.clone()).collect();
            let routes = changes.creates.iter().map(|(_, r)| r.clone()).collect();
            let (d, c) = self.ctx.cloud().apply_routes(cluster, &table, names, routes).await;
            deleted.extend(changes.deletes.into_iter().zip(d));
            created.extend(changes.creates.into_iter().zip(c).map(|((node, route), r)| (node, route, r)));
        }
        (deleted, created)
    }
}

/// One Node's NetworkUnavailable to write: whether its routes exist, and why it is left
/// without one (a full table, no table), if so.
struct ConditionWrite {
    name: String,
    uid: String,
    ok: bool,
    without: Option<String>,
}

impl ConditionWriter {
    /// Works out each Node's condition now and writes the changed ones in the background.
    fn update(
        &self,
        nodes: &[Arc<Node>],
        desired: &Desired,
        known: &Known,
        without_route: &BTreeMap<String, String>,
        targeted: &HashSet<String>,
        addresses: bool,
    ) {
        let mut wanted: HashMap<&str, Vec<(&String, &Route)>> = HashMap::new();
        for (table, routes) in desired {
            for (node, route) in routes.values() {
                wanted.entry(node.as_str()).or_default().push((table, route));
            }
        }
        let mut by_destination: HashMap<(&str, &str), Vec<&Route>> = HashMap::new();
        for (table, routes) in &known.routes {
            for route in routes.values() {
                by_destination.entry((table.as_str(), route.destination_cidr.as_str())).or_default().push(route);
            }
        }
        let served = |table: &str, want: &Route| {
            by_destination
                .get(&(table, want.destination_cidr.as_str()))
                .is_some_and(|routes| routes.iter().any(|have| serves(have, want, addresses)))
        };
        // Names and UIDs, not the Nodes: the writes take a while, and the copies they would
        // pin are replaced in the cache meanwhile (their podCIDRs, this very condition).
        let mut todo: Vec<ConditionWrite> = Vec::new();
        {
            let mut written = self.written.locked();
            // `nodes` are every managed Node: what was written for one no longer here is
            // forgotten (the map grew with every Node the cluster ever had).
            let live: HashSet<&str> = nodes.iter().filter_map(|n| n.metadata.uid.as_deref()).collect();
            written.retain(|uid, _| live.contains(uid.as_str()));
            for node in nodes {
                let name = node_util::name(node);
                let ok = match wanted.get(name) {
                    Some(routes) => routes.iter().all(|(table, route)| served(table, route)),
                    // No podCIDR, yet cloud routes still point at it (upstream: NoRouteCreated).
                    None if !node_util::has_pod_cidrs(node) && targeted.contains(name) => false,
                    // PodCIDRs, and no table to route them in.
                    None if without_route.contains_key(name) => false,
                    None => continue,
                };
                let (status, reason) = if ok { ("False", "RouteCreated") } else { ("True", "NoRouteCreated") };
                let uid = node.metadata.uid.clone().unwrap_or_default();
                if network_condition(node) == Some((status, Some(reason))) {
                    // As of this version (a later difference is another writer's).
                    let version = Some(node.metadata.resource_version.clone().unwrap_or_default());
                    written.insert(uid, Wrote { ok, version });
                    continue;
                }
                // Written already, and the cache does not show it yet: not again. Once the
                // cache is as new as our write, a difference is another writer's change.
                let pending = written.get(&uid).is_some_and(|w| {
                    w.ok == ok && w.version.as_deref().is_none_or(|v| older(node.metadata.resource_version.as_deref(), v))
                });
                if pending {
                    continue;
                }
                written.insert(uid.clone(), Wrote { ok, version: None });
                todo.push(ConditionWrite { name: name.to_string(), uid, ok, without: without_route.get(name).cloned() });
            }
        }
        if todo.is_empty() {
            return;
        }
        if self.batches.send(todo).is_err() {
            // The writing task is gone (the controller is stopping): the next holder writes.
            tracing::debug!("the route controller's condition writer has stopped");
        }
    }

    /// Writes the batches [`ConditionWriter::update`] sends, in order, until `stop`.
    async fn run(self, stop: CancellationToken) {
        let Some(mut batches) = self.receiver.locked().take() else {
            stop.cancelled().await;
            return;
        };
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                batch = batches.recv() => match batch {
                    Some(todo) => self.write(todo).await,
                    None => {
                        stop.cancelled().await;
                        return;
                    }
                },
            }
        }
    }

    /// Whether the change of a Node's NetworkUnavailable between `old` and `new` is another
    /// writer's (not what this controller last wrote), which it must put right.
    fn changed_by_another(&self, old: &Node, new: &Node) -> bool {
        let (before, after) = (network_condition(old), network_condition(new));
        if before == after {
            return false;
        }
        let uid = new.metadata.uid.as_deref().unwrap_or_default();
        let ours = self
            .written
            .locked()
            .get(uid)
            .map(|w| if w.ok { ("False", Some("RouteCreated")) } else { ("True", Some("NoRouteCreated")) });
        ours.is_some_and(|ours| after != Some(ours))
    }

    async fn write(&self, todo: Vec<ConditionWrite>) {
        for ConditionWrite { name, uid, ok, without } in todo {
            let name = name.as_str();
            let (status, reason, message) = if ok {
                ("False", "RouteCreated", "RouteController created a route")
            } else {
                ("True", "NoRouteCreated", "RouteController failed to create a route")
            };
            let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(crate::clock::now());
            let patch = serde_json::json!({ "status": { "conditions": [{
                "type": CONDITION, "status": status, "reason": reason, "message": message,
                "lastTransitionTime": now, "lastHeartbeatTime": now,
            }]}});
            match self.ctx.patch_node_conditions(name, &patch).await {
                Ok(node) => {
                    let mut written = self.written.locked();
                    if let Some(w) = written.get_mut(&uid).filter(|w| w.ok == ok) {
                        w.version = node.metadata.resource_version;
                    }
                }
                Err(error) => {
                    tracing::warn!(node = %name, %error, "updating NetworkUnavailable failed");
                    // Not written after all: the next reconcile tries again.
                    self.written.locked().remove(&uid);
                }
            }
            let first_report = !ok && without.is_some() && self.reported.locked().insert(name.to_string());
            let node = first_report.then(|| self.ctx.nodes.store().get(&ObjectRef::new(name))).flatten();
            if let Some(node) = node.filter(|n| n.metadata.uid.as_deref() == Some(uid.as_str())) {
                let note = format!("Could not create a route: {}", without.unwrap_or_default());
                self.ctx.event(NAME, node.as_ref(), EventType::Warning, reason::FAILED_TO_CREATE_ROUTE, note).await;
            }
            if ok {
                self.reported.locked().remove(name);
            }
        }
    }
}

/// The time to the next safety resync: upstream's period when asked for (a full listing every
/// period, as upstream does), else `--route-resync-period` jittered up to twice it.
fn resync_delay(options: &crate::options::Options) -> Duration {
    if let Some(period) = options.route_reconciliation_period {
        return period;
    }
    let base = options.route_resync_period;
    base + base.mul_f64(crate::clock::jitter())
}

/// The route controller's one key: the cluster's route tables, reconciled as a whole.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RouteTables;

/// What the triggers leave for the next reconcile.
struct Pending {
    /// The provider changed (its state may be lost): list everything again.
    relist: bool,
    /// The provider's changes as last seen.
    seen: ProviderChanges,
    /// The provider came back as another provider (the count of identity changes then).
    paused: Option<u64>,
    /// When the next safety resync is due.
    resync_at: Instant,
    /// No reconcile before this: the last one's computation times [`BUSY_SHARE`].
    cool_until: Option<Instant>,
}

/// A reconcile computes over every Node (measured: 50 ms at 5000 Nodes with a route each,
/// 190 ms at 20,000). From its start to the next one's is at least this many times its
/// computation, as well as `--route-min-interval`: reconciles compute at most a quarter of the
/// time however large the cluster. Latency is kept over CPU below that (a twentieth doubled
/// the route latency at 20,000 Nodes), so a burst's reconciles still cost more per route in a
/// larger cluster.
const BUSY_SHARE: u32 = 4;

/// The route controller (see the module's documentation), on the runner: one key, coalesced
/// triggers (`--route-coalesce-delay`), at most one reconcile per `--route-min-interval` (the
/// queue's rate), the queue's backoff after a failure, a safety resync as a delayed requeue.
pub struct RouteController {
    ctx: Context,
    routes: tokio::sync::Mutex<Routes>,
    pending: std::sync::Mutex<Pending>,
    /// [`Routes::unrouted`], read by the trigger.
    unrouted: Arc<std::sync::Mutex<HashSet<String>>>,
    /// [`Routes`]' condition writer: its task, and what it wrote (read by the trigger).
    conditions: ConditionWriter,
}

impl RouteController {
    /// A controller over `ctx`.
    pub fn new(ctx: Context) -> Result<Self, super::ConfigError> {
        let routes = Routes::new(ctx.clone())?;
        let pending = Pending {
            relist: false,
            seen: *ctx.provider.changes().borrow(),
            paused: None,
            resync_at: Instant::now() + resync_delay(&ctx.options),
            cool_until: None,
        };
        let unrouted = routes.unrouted.clone();
        let conditions = routes.conditions.clone();
        Ok(Self { ctx, routes: tokio::sync::Mutex::new(routes), pending: std::sync::Mutex::new(pending), unrouted, conditions })
    }

    /// Whether a change of this Node can change the routes or the Nodes' conditions: it has
    /// podCIDRs, or the cloud's routes name it. A Node without podCIDRs (one that joins, before
    /// IPAM gives it one) wants no route, and a reconcile over every Node would find nothing
    /// to do.
    fn matters(&self, node: &Node) -> bool {
        node_util::has_pod_cidrs(node) || self.unrouted.locked().contains(node_util::name(node))
    }

    /// Whether a change of a Node can change the routes or the conditions: see
    /// [`RouteController::matters`]. Excluded Nodes want no route either, except that one
    /// whose exclusion changes joins or leaves the Nodes that do; a deletion is evidence for
    /// its routes whoever the Node was.
    fn triggers(&self, change: &Change<Node>) -> bool {
        match change {
            Change::Applied { old, new } => {
                let old = old.as_deref();
                let joins_or_leaves = old.is_some_and(|o| self.ctx.ignores(o) != self.ctx.ignores(new));
                let wanted = |n: &Node| !self.ctx.ignores(n) && self.matters(n);
                let condition_undone = old.is_some_and(|o| self.conditions.changed_by_another(o, new));
                (joins_or_leaves || relevant(old, new) || condition_undone) && (wanted(new) || old.is_some_and(wanted))
            }
            Change::Deleted(node) => self.matters(node),
        }
    }

    /// Runs until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        // Off, it still lives until stop: a controller task that ends is a failing process.
        if !self.ctx.options.configure_cloud_routes {
            tracing::info!(provider = %self.ctx.provider.name(), "--configure-cloud-routes=false: the route controller is off");
            stop.cancelled().await;
            return;
        }
        if self.routes.lock().await.cluster_cidrs.is_empty() {
            tracing::warn!(provider = %self.ctx.provider.name(), "the route controller needs --cluster-cidr; it is off");
            stop.cancelled().await;
            return;
        }
        runner::run(self, stop).await;
    }

    /// One reconcile, on the evidence the triggers left: a full listing at a resync or after
    /// the provider changed, the kept state otherwise.
    pub async fn reconcile(&self) -> Done {
        let mut routes = self.routes.lock().await;
        let now = Instant::now();
        if let Some(until) = self.pending.locked().cool_until.filter(|until| *until > now) {
            return Done { outcome: Outcome::RequeueAfter(until - now), failed: false };
        }
        let (relist, seen, resync) = {
            let mut p = self.pending.locked();
            if let Some(paused) = p.paused.take() {
                routes.paused = Some(paused);
            }
            let resync = now >= p.resync_at;
            if resync {
                p.resync_at = now + resync_delay(&self.ctx.options);
            }
            (std::mem::take(&mut p.relist), p.seen, resync)
        };
        if relist && routes.paused == Some(seen.identities) {
            let note = "The provider came back as another provider (its name or providerID scheme changed): \
                        route deletions pause until the next full resync confirms it"
                .to_string();
            self.ctx.event(NAME, &self.ctx.lease(), EventType::Warning, reason::ROUTE_DELETIONS_PAUSED, note).await;
        }
        if resync || relist {
            // A resync, or a provider that may have lost its state: list everything again.
            routes.previous = routes.known.take();
            routes.resolved.clear();
        }
        if resync && routes.paused.take_if(|p| *p == seen.identities).is_some() {
            tracing::info!("the resync confirmed the provider's new identity; route deletions resume");
        }
        routes.progress = 0;
        let result = routes.reconcile().await;
        let until_resync = {
            let mut p = self.pending.locked();
            let now = Instant::now();
            // Within `--route-min-interval` the queue's rate already holds the next one back.
            let cool = routes.busy * BUSY_SHARE;
            p.cool_until = (cool > self.ctx.options.route_min_interval).then(|| now + cool - routes.busy);
            tracing::debug!(busy = ?routes.busy, "route reconcile done");
            p.resync_at.saturating_duration_since(now)
        };
        let outcome = match &result {
            Ok(Some(sync)) => {
                let without = sync.without_route.len() + sync.untabled.len();
                self.ctx.metrics.route_sync(sync.created, sync.deleted, sync.corrections, without);
                // Deletions left over by the cap: the next reconcile after the interval.
                if sync.deletions_left {
                    Outcome::RequeueAfter(self.ctx.options.route_min_interval)
                } else if let Some(due) = sync.deferred {
                    Outcome::RequeueAfter(due.max(self.ctx.options.route_min_interval).min(until_resync))
                } else {
                    Outcome::RequeueAfter(until_resync)
                }
            }
            Ok(None) => Outcome::RequeueAfter(until_resync),
            // The provider throttled some of the calls but the rest went through: go on as
            // soon as it allows, without escalating the backoff (progress is not a failure),
            // keeping what we know of the tables (our own writes are in it).
            Err(error) if error.retry_after().is_some() && routes.progress > 0 => {
                let wait = error.retry_after().unwrap_or_default().max(Duration::from_millis(100));
                tracing::debug!(%error, progress = routes.progress, retry_in = ?wait, "route reconcile throttled; continuing");
                Outcome::Throttled { fingerprint: None, retry_after: wait }
            }
            Err(error) => {
                routes.known = None;
                tracing::warn!(%error, "route reconcile failed; retried with backoff");
                self.ctx.report_invalid_listing(NAME, error).await;
                Outcome::Retry { fingerprint: None, retry_after: error.retry_after() }
            }
        };
        Done { outcome, failed: result.is_err() }
    }

    /// A trigger: the reconcile starts `--route-coalesce-delay` after the first of a burst
    /// (a key in backoff waits its turn).
    fn trigger(&self, queue: &WorkQueue<RouteTables>) {
        queue.add_after(RouteTables, self.ctx.options.route_coalesce_delay);
    }
}

impl runner::Controller for RouteController {
    type Key = RouteTables;
    const NAME: &'static str = NAME;
    const WATCHES: Watches = Watches { nodes: true, services: false, provider: true };

    fn ctx(&self) -> &Context {
        &self.ctx
    }

    /// At most one reconcile per `--route-min-interval`: the queue's rate, one at a time.
    fn queue_config(&self) -> QueueConfig {
        let o = &self.ctx.options;
        let min = o.route_min_interval.as_secs_f64();
        let qps = if min > 0.0 { 1.0 / min } else { 1e6 };
        QueueConfig { base_delay: o.reconcile_backoff_base, max_delay: o.reconcile_backoff_max, qps, burst: 1 }
    }

    /// Once the Node cache is synced: the first reconcile, the provider as it is now, and the
    /// first safety resync a period away.
    fn resync(&self, queue: &WorkQueue<RouteTables>) {
        {
            let mut p = self.pending.locked();
            p.seen = *self.ctx.provider.changes().borrow();
            p.resync_at = Instant::now() + resync_delay(&self.ctx.options);
        }
        self.trigger(queue);
    }

    /// Node additions and deletions, and changes of podCIDRs, addresses or providerID.
    fn on_node(&self, change: Option<Change<Node>>, queue: &WorkQueue<RouteTables>) {
        if change.as_ref().is_none_or(|c| self.triggers(c)) {
            self.trigger(queue);
        }
    }

    fn on_provider(&self, now: ProviderChanges, queue: &WorkQueue<RouteTables>) {
        {
            let mut p = self.pending.locked();
            if now != p.seen {
                p.relist = true;
            }
            if now.identities != p.seen.identities {
                p.paused = Some(now.identities);
            }
            p.seen = now;
        }
        self.trigger(queue);
    }

    async fn reconcile(&self, _keys: &[RouteTables]) -> Vec<Done> {
        vec![RouteController::reconcile(self).await]
    }

    /// The condition writer, as one of the controller's tasks: it ends with them.
    fn spawn(self: &Arc<Self>, _queue: &Arc<WorkQueue<RouteTables>>, stop: &CancellationToken, tasks: &mut super::Tasks) {
        tasks.spawn(self.conditions.clone().run(stop.clone()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeAddress, NodeSpec, NodeStatus};

    fn node(cidrs: &[&str], ip: &str, label: &str) -> Node {
        Node {
            metadata: kube::api::ObjectMeta {
                name: Some("n".into()),
                labels: Some([("x".to_string(), label.to_string())].into()),
                ..Default::default()
            },
            spec: Some(NodeSpec { pod_cidrs: Some(cidrs.iter().map(|s| s.to_string()).collect()), ..Default::default() }),
            status: Some(NodeStatus {
                addresses: Some(vec![NodeAddress { type_: "InternalIP".into(), address: ip.into() }]),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn only_cidrs_addresses_and_membership_trigger() {
        let a = node(&["10.244.1.0/24"], "10.0.0.1", "a");
        assert!(relevant(None, &a));
        assert!(!relevant(Some(&a), &node(&["10.244.1.0/24"], "10.0.0.1", "b")), "labels do not trigger");
        assert!(relevant(Some(&a), &node(&["10.244.2.0/24"], "10.0.0.1", "a")));
        assert!(relevant(Some(&a), &node(&["10.244.1.0/24"], "10.0.0.2", "a")));
    }

    fn route(name: &str, node: &str, cidr: &str, ip: &str) -> Route {
        Route {
            name: name.into(),
            target: Some(RouteTarget { node_name: node.into(), provider_id: String::new() }),
            destination_cidr: cidr.into(),
            target_addresses: vec![NodeAddress { type_: "InternalIP".into(), address: ip.into() }],
            ..Default::default()
        }
    }

    fn want(routes: &[Route]) -> BTreeMap<String, (String, Route)> {
        routes
            .iter()
            .map(|r| (r.name.clone(), (r.target.as_ref().map(|t| t.node_name.clone()).unwrap_or_default(), r.clone())))
            .collect()
    }

    fn have(routes: &[Route]) -> BTreeMap<String, Route> {
        routes.iter().map(|r| (r.name.clone(), r.clone())).collect()
    }

    #[test]
    fn routes_of_other_names_are_adopted_and_foreign_cidrs_left_alone() {
        let ours = route("c-a-10.244.1.0-24", "a", "10.244.1.0/24", "10.0.0.1");
        let theirs = route("kubernetes-3f2a", "a", "10.244.1.0/24", "10.0.0.1");
        let stale = route("kubernetes-9c1b", "gone", "10.244.9.0/24", "10.0.0.9");
        let foreign = route("vpn", "a", "192.168.0.0/16", "10.0.0.1");
        let plan =
            plan_table(&have(&[theirs, stale, foreign]), &want(std::slice::from_ref(&ours)), false, |c| c.starts_with("10.244."));
        assert_eq!(plan.adopted, BTreeMap::from([(ours.name.clone(), "kubernetes-3f2a".to_string())]));
        assert_eq!(plan.deletes, vec!["kubernetes-9c1b".to_string()], "only the stale route inside the cluster CIDR");
        assert!(plan.missing.is_empty(), "nothing to create: no traffic gap");
    }

    #[test]
    fn a_route_of_our_name_is_preferred_and_changed_addresses_replace_it() {
        let ours = route("c-a-10.244.1.0-24", "a", "10.244.1.0/24", "10.0.0.1");
        let twin = route("other", "a", "10.244.1.0/24", "10.0.0.1");
        let plan = plan_table(&have(&[ours.clone(), twin]), &want(std::slice::from_ref(&ours)), false, |_| true);
        assert!(plan.adopted.is_empty());
        assert_eq!(plan.deletes, vec!["other".to_string()], "one route per destination is enough");
        let moved = route("c-a-10.244.1.0-24", "a", "10.244.1.0/24", "10.0.0.2");
        let plan = plan_table(&have(std::slice::from_ref(&ours)), &want(std::slice::from_ref(&moved)), true, |_| true);
        assert_eq!(plan.deletes, vec![ours.name.clone()]);
        assert_eq!(plan.missing, vec![("a".to_string(), moved.clone())]);
        let plan = plan_table(&have(std::slice::from_ref(&ours)), &want(&[moved]), false, |_| true);
        assert_eq!(plan, TablePlan::default(), "addresses do not matter when the provider does not record them");
        let mut hole = ours.clone();
        hole.blackhole = true;
        let plan = plan_table(&have(&[hole]), &want(std::slice::from_ref(&ours)), false, |_| true);
        assert_eq!((plan.deletes.len(), plan.missing.len()), (1, 1), "a blackhole is replaced");
    }

    /// `stable_hash("prod-node-10.244.1.0-24")`, pinned: a change of it renames stored routes.
    const STABLE_HASH_PINNED: u64 = 8_174_590_117_312_416_362;

    #[test]
    fn route_names_are_readable_and_bounded() {
        assert_eq!(route_name("prod", "node-1", "10.244.1.0/24"), "prod-node-1-10.244.1.0-24");
        assert_eq!(route_name("prod", "node-1", "fd00:10:244:1::/64"), "prod-node-1-fd00-10-244-1---64");
        let long = route_name("prod", &"n".repeat(300), "10.244.1.0/24");
        assert_eq!(long.len(), 253);
        assert_ne!(long, route_name("prod", &"n".repeat(301), "10.244.1.0/24"));
        // A cluster name that is not ASCII: cut at a character boundary, no panic.
        let wide = route_name(&"é".repeat(150), "node-1", "10.244.1.0/24");
        assert!(wide.len() <= 253 && wide.is_char_boundary(wide.len()), "{wide}");
        // Stored in the cloud: the same name across Rust releases, and the one earlier
        // releases stored (std's DefaultHasher, SipHash-1-3 with zero keys).
        let name = format!("prod-{}-10.244.1.0-24", "n".repeat(300));
        use std::hash::{Hash, Hasher};
        let mut std_hash = std::collections::hash_map::DefaultHasher::new();
        name.hash(&mut std_hash);
        assert_eq!(stable_hash(&name), std_hash.finish(), "the names earlier releases stored");
        assert_eq!(stable_hash("prod-node-10.244.1.0-24"), STABLE_HASH_PINNED);
    }
}
