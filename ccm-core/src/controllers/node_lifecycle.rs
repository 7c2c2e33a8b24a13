//! The node lifecycle controller (`cloud-node-lifecycle-controller`): every
//! `--node-monitor-period`, asks the provider about the instances of NotReady Nodes: an
//! explicit "does not exist" deletes the Node, a shut-down instance gets the shutdown taint, a
//! running one loses it. An error, a timeout or a rate limit changes nothing. Deletions are
//! bounded: none in a zone whose Nodes are mostly NotReady, or at all when every Node is (an
//! outage, not gone instances), and none when the provider calls Ready Nodes' instances gone
//! too (up to eight are asked alongside: a provider that calls half of them gone is not
//! believed about the rest); each refusal is a Warning Event. Deletions the provider's word
//! and these checks allow are paced, not refused: at most `--max-node-deletions` (or
//! `--max-node-deletion-share` of the Nodes) in any `--node-deletion-window`, oldest Node
//! first, the rest asked about again when the window frees room (a Normal Event each). So a
//! genuine mass termination is cleaned up in `ceil(gone / bound)` windows, while a lying
//! provider or an outage deletes nothing; and the bound holds across passes, whatever the
//! Nodes' recheck schedules. A Ready Node is
//! never deleted and loses the shutdown taint without the provider being asked (as upstream:
//! a recovered Node must not stay unschedulable through a cloud outage); with every Node Ready
//! this controller makes no provider call at all.
//!
//! A NotReady Node whose state does not change is asked about less and less often: first at
//! the next pass, then after twice the interval each time, up to [`MAX_RECHECK`] (5 s, 10 s,
//! 20 s … 5 min with the default period, and at that interval a tenth later), all that are due
//! (or half-way there) in one batch. An answer the node controller's periodic refresh read
//! (the same BatchInstanceMetadata, in this process) since a Node's last question stands for
//! the question: at steady state a NotReady Node costs no call of its own.
//! A change of the Node (its Ready condition, taints, providerID) or of the provider's answer
//! (running, shut down, gone) starts it at the period again.
//!
//! Non-graceful node shutdown, with `--out-of-service-after`: a NotReady Node whose instance
//! every answer has called shut down for that long (two answers at least; an error or another
//! answer starts the count again) gets `node.kubernetes.io/out-of-service=nodeshutdown:NoExecute`
//! and the annotation that says this controller added it, with a Normal Event; its pods are
//! then force-deleted and their volumes detached by kube-controller-manager. The same bounds
//! as deletion hold (a disrupted zone, more than `--max-node-deletions` at once, a provider that
//! says Ready Nodes' instances are shut down or gone: none is tainted, a Warning Event each). A
//! Node so tainted is asked about once Ready, and loses the taint and the annotation when its
//! instance runs; an out-of-service taint this controller did not add is never removed.

use ccm_protocol::lock::Lock;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Taint};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::runner::{self, Done, Watches};
use super::{Context, Tasks};
use crate::events::{EventType, reason};
use crate::node_util;
use crate::provider::convert::{Instance, InstanceLookups, InstanceState};
use crate::queue::{Outcome, WorkQueue};
use crate::wellknown::{
    self, ANNOTATION_OUT_OF_SERVICE, OUT_OF_SERVICE_VALUE, TAINT_OUT_OF_SERVICE, TAINT_SHUTDOWN, TAINT_UNINITIALIZED,
};

/// The controller's name.
pub const NAME: &str = "cloud-node-lifecycle-controller";

/// How many Ready Nodes' instances a pass that would delete Nodes asks about too, as a check
/// of the provider's answer (one more call per 500 at most, only in such a pass).
const WITNESSES: usize = 8;

/// How long a Node may stay uninitialised before the lifecycle controller asks about its
/// instance too: a Node registers NotReady, often before its instance shows in the cloud's
/// reads; one still uninitialised after this is stuck (its instance may be gone) and would
/// otherwise stay for ever.
const UNINITIALIZED_GRACE: Duration = Duration::from_secs(300);

/// How long ago the Node registered (zero when unknown).
fn registered_for(node: &Node) -> Duration {
    node.metadata
        .creation_timestamp
        .as_ref()
        .and_then(|t| crate::clock::now().duration_since(t.0).try_into().ok())
        .unwrap_or_default()
}

/// The longest a NotReady Node whose state does not change waits between two questions.
pub const MAX_RECHECK: Duration = Duration::from_secs(300);

/// When a NotReady Node is asked about next.
#[derive(Debug, Clone, Copy)]
struct Recheck {
    /// The Node's state when it was last asked about.
    state: u64,
    /// The provider's last answer: (exists, shut down); `None` after an error.
    answer: Option<(bool, bool)>,
    /// When that question was asked.
    at: Instant,
    /// The current interval.
    interval: Duration,
    /// When it is due.
    due: Instant,
    /// Since when every answer has said the instance is shut down (the first of them), and
    /// how many answers said so; reset by any other answer or an error.
    shut_down: Option<(Instant, u32)>,
}

/// What was done (deletions, or out-of-service taints) in the last window: at most `bound` in
/// any window, however the passes fall.
#[derive(Debug, Default)]
struct Budget {
    /// When each action of the current window was taken, oldest first.
    done: std::collections::VecDeque<Instant>,
    /// Whether what earlier holders of the Lease spent was read ([`crate::leader::Ledger`]).
    loaded: bool,
}

impl Budget {
    /// How many more may be done at `now` under `bound` per `window`, and when the next one
    /// frees (`None` when nothing was done in the window).
    fn left(&mut self, bound: usize, window: Duration, now: Instant) -> (usize, Option<Instant>) {
        while self.done.front().is_some_and(|t| now.saturating_duration_since(*t) >= window) {
            self.done.pop_front();
        }
        (bound.saturating_sub(self.done.len()), self.done.front().map(|t| *t + window))
    }

    fn spend(&mut self, now: Instant) {
        self.done.push_back(now);
    }

    /// Restamps one action counted at the provisional `at` as done `now` (its write came
    /// back): the window runs from when it landed, which is no later than now.
    fn landed(&mut self, at: Instant, now: Instant) {
        if let Some(slot) = self.done.iter_mut().find(|t| **t == at) {
            *slot = now;
        }
        self.done.make_contiguous().sort();
    }
}

/// How late, at most, an action counted against the window is taken to land at the API
/// server: it is counted (and recorded on the Lease for the next holder) as done this long
/// after it was decided, is not sent once that time has passed (asked about again at the
/// next pass), and is restamped when its write comes back. A holder that dies in between
/// leaves the next one a window that starts later than the action landed, never earlier.
const LANDS_WITHIN: Duration = Duration::from_secs(30);

/// The lifecycle controllers' actions over every provider (with several providers, each
/// runs on its own Nodes): `--max-node-deletions` and `--max-node-deletion-share` bound them
/// over all Nodes too, so that two providers' passes together never do more than one would.
#[derive(Debug, Default)]
pub(crate) struct Overall {
    deletions: Mutex<Budget>,
    outs_of_service: Mutex<Budget>,
}

impl Overall {
    fn budget(&self, act: Act) -> std::sync::MutexGuard<'_, Budget> {
        match act {
            Act::Delete => self.deletions.locked(),
            Act::OutOfService => self.outs_of_service.locked(),
        }
    }
}

/// Which instance a Node stands for: a shutdown count is about one instance only.
fn instance_of(node: &Node) -> (Option<&str>, Option<&str>) {
    (node.metadata.uid.as_deref(), node_util::provider_id(node))
}

/// What of a Node starts its interval anew when it changes: its identity, Ready condition
/// status and reason, taints and providerID (not heartbeat times).
fn state_of(node: &Node) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    node.metadata.uid.hash(&mut h);
    node_util::ready_status(node).hash(&mut h);
    node_util::provider_id(node).hash(&mut h);
    for t in node.spec.as_ref().and_then(|s| s.taints.as_ref()).into_iter().flatten() {
        (&t.key, &t.value, &t.effect).hash(&mut h);
    }
    h.finish()
}

/// The schedule of the NotReady Nodes' questions.
#[derive(Debug)]
struct Rechecks {
    /// The first interval (`--node-monitor-period`).
    period: Duration,
    /// `--out-of-service-after`: a Node shut down is asked about again when it may be tainted.
    out_of_service_after: Option<Duration>,
    /// By Node name, with the instance it was asked about.
    by_node: HashMap<String, (Recheck, u64)>,
}

/// A hash of [`instance_of`].
fn instance_key(node: &Node) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    instance_of(node).hash(&mut h);
    h.finish()
}

impl Rechecks {
    /// Of the NotReady `candidates`, those to ask about now: new ones, changed ones, and those
    /// due or half-way to due (so that Nodes that went NotReady apart share batches).
    fn due(&mut self, candidates: Vec<Arc<Node>>, now: Instant) -> Vec<Arc<Node>> {
        let rechecks = &mut self.by_node;
        let names: std::collections::HashSet<&str> = candidates.iter().map(|n| node_util::name(n)).collect();
        rechecks.retain(|name, _| names.contains(name.as_str()));
        // Within `slack` of being due (a new or changed Node always is).
        let within = |n: &Arc<Node>, slack: fn(Duration) -> Duration| match rechecks.get(node_util::name(n)) {
            Some((r, _)) if r.state == state_of(n) => r.due.saturating_duration_since(now) <= slack(r.interval),
            _ => true,
        };
        if !candidates.iter().any(|n| within(n, |_| Duration::ZERO)) {
            return Vec::new();
        }
        candidates.into_iter().filter(|n| within(n, |interval| interval / 2)).collect()
    }

    /// After asking about `node`: its next question after twice the interval, or after the
    /// period when the Node or the answer changed.
    fn asked(&mut self, node: &Node, answer: Option<(bool, bool)>, now: Instant) {
        let (period, rechecks) = (self.period, &mut self.by_node);
        let state = state_of(node);
        let instance = instance_key(node);
        let before = rechecks.get(node_util::name(node));
        let interval = match before {
            Some((r, _)) if r.state == state && (r.answer == answer || answer.is_none()) => (r.interval * 2).min(MAX_RECHECK),
            _ => period,
        };
        let shut_down = match (answer, before) {
            (Some((true, true)), Some((r, i))) if *i == instance => r.shut_down.map(|(since, n)| (since, n + 1)),
            _ => None,
        }
        .or((answer == Some((true, true))).then_some((now, 1)));
        // At the longest interval, a little later: the node controller's refresh, reading
        // every instance each --node-status-update-frequency (5 min), answers first.
        let mut due = now + if interval == MAX_RECHECK { interval + interval / 10 } else { interval };
        // A Node that may be taken out of service is asked about when its time comes.
        if let (Some(after), Some((since, _))) = (self.out_of_service_after, shut_down)
            && !node_util::has_taint(node, TAINT_OUT_OF_SERVICE)
        {
            due = due.min((since + after).max(now + period));
        }
        rechecks
            .insert(node_util::name(node).to_string(), (Recheck { state, answer, at: now, interval, due, shut_down }, instance));
    }

    /// Whether an answer about `node`'s instance read at `at` by another controller of this
    /// process (the node refresh, the same call) stands for the question now due: the Node
    /// is unchanged since its last question, the answer is newer than that question, and
    /// asked at `at` it would not be due yet.
    fn answered_by(&self, node: &Node, at: Instant, now: Instant) -> bool {
        self.by_node.get(node_util::name(node)).is_some_and(|(r, instance)| {
            r.state == state_of(node) && *instance == instance_key(node) && at > r.at && at + r.interval > now
        })
    }

    /// Asks about `node` again by `at` at the latest (a Node whose action waits for room in
    /// the window).
    fn ask_by(&mut self, node: &Node, at: Instant) {
        if let Some((r, _)) = self.by_node.get_mut(node_util::name(node)) {
            r.due = r.due.min(at);
        }
    }

    /// How long the instance of `node` has been shut down by every answer since, when that
    /// is `--out-of-service-after` or more and at least two answers said so.
    fn out_of_service_for(&self, node: &Node, now: Instant) -> Option<Duration> {
        let after = self.out_of_service_after?;
        let (r, instance) = self.by_node.get(node_util::name(node))?;
        let (since, answers) = r.shut_down?;
        let lasted = now.saturating_duration_since(since);
        (*instance == instance_key(node) && answers >= 2 && lasted >= after).then_some(lasted)
    }
}

/// What one pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pass {
    /// Nodes asked about.
    pub checked: usize,
    /// Of those, Nodes whose answer came from the node refresh's read (no call).
    pub answered_by_refresh: usize,
    /// Nodes deleted.
    pub deleted: Vec<String>,
    /// Nodes tainted as shut down.
    pub tainted: Vec<String>,
    /// Nodes whose shutdown taint was removed.
    pub untainted: Vec<String>,
    /// Nodes whose lookup failed (left alone).
    pub errors: usize,
    /// Nodes reported gone but not deleted: in a disrupted zone, or the provider not believed.
    pub refused: Vec<String>,
    /// Nodes reported gone (or shut down long enough), whose deletion (or out-of-service
    /// taint) waits for room in the window.
    pub deferred: Vec<String>,
    /// Nodes given the out-of-service taint.
    pub out_of_service: Vec<String>,
    /// Nodes whose out-of-service taint (ours) was removed.
    pub back_in_service: Vec<String>,
    /// Nodes shut down long enough for the out-of-service taint but not given it (the same
    /// bounds as deletion).
    pub out_of_service_refused: Vec<String>,
}

/// What the lifecycle controller would do to Nodes on the provider's word, under one set of
/// bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Act {
    /// Delete Nodes whose instance is gone.
    Delete,
    /// Taint Nodes whose instance is shut down out of service.
    OutOfService,
}

impl Act {
    /// What is done, for messages: "deleted", "taken out of service".
    fn done(self) -> &'static str {
        match self {
            Act::Delete => "deleted",
            Act::OutOfService => "taken out of service",
        }
    }

    /// The Event reason of an action waiting for room in the window.
    fn deferred_reason(self) -> &'static str {
        match self {
            Act::Delete => reason::NODE_DELETION_DEFERRED,
            Act::OutOfService => reason::NODE_OUT_OF_SERVICE_DEFERRED,
        }
    }

    /// Its key in the Lease's ledger, for the Nodes of provider `provider`.
    fn ledger_key(self, provider: &str) -> String {
        match self {
            Act::Delete => format!("node-deletions.{provider}"),
            Act::OutOfService => format!("node-out-of-service.{provider}"),
        }
    }

    /// What the provider said, for messages.
    fn reported(self) -> &'static str {
        match self {
            Act::Delete => "gone",
            Act::OutOfService => "shut down",
        }
    }

    /// Whether a witness's answer (a Ready Node's instance) says what the pass would act on.
    fn denies(self, answer: Option<&Instance>) -> bool {
        match answer.map(|m| m.state) {
            None | Some(InstanceState::Terminated) => true,
            Some(InstanceState::Stopped) => self == Act::OutOfService,
            Some(_) => false,
        }
    }
}

/// A Node's zone label ("" without one: the Nodes without a zone count as one zone).
fn zone_of(node: &Node) -> &str {
    node.metadata.labels.as_ref().and_then(|l| l.get(wellknown::LABEL_ZONE)).map_or("", String::as_str)
}

/// The zones where Nodes are not deleted, with (NotReady, all) counts, as
/// kube-controller-manager's disruption modes: every zone when every Node is NotReady, more
/// than two of them (the API server or the network is more likely down than every instance;
/// one or two Nodes say too little), and a zone partially
/// disrupted (more than two and at least `threshold` of its Nodes NotReady, not all). A zone
/// whose Nodes are all NotReady while others are fine is not held back (its instances are
/// asked like any others; as upstream evicts from it at the normal rate).
fn disrupted_zones(ready: &[Arc<Node>], not_ready: &[Arc<Node>], threshold: f64) -> BTreeMap<String, (usize, usize)> {
    let everything_down = ready.is_empty() && not_ready.len() > 2;
    let mut zones: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for node in ready {
        zones.entry(zone_of(node).to_string()).or_default().1 += 1;
    }
    for node in not_ready {
        let entry = zones.entry(zone_of(node).to_string()).or_default();
        entry.0 += 1;
        entry.1 += 1;
    }
    zones.retain(|_, (down, all)| everything_down || (*down < *all && *down > 2 && *down as f64 >= threshold * *all as f64));
    zones
}

fn has_annotation(node: &Node, key: &str) -> bool {
    node.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(key))
}

/// What a pass's actions are bounded by.
struct Bounds<'a> {
    /// The disrupted zones, with their (NotReady, all) counts.
    disrupted: &'a BTreeMap<String, (usize, usize)>,
    /// The Ready Nodes (witnesses of the provider's word).
    ready: &'a [Arc<Node>],
    /// All managed Nodes.
    total: usize,
}

/// What the lifecycle controller keeps between passes.
struct State {
    /// When each NotReady Node is asked about next.
    rechecks: Rechecks,
    /// Deletions in the current window.
    deletions: Budget,
    /// Out-of-service taints in the current window.
    outs_of_service: Budget,
}

impl State {
    fn budget(&mut self, act: Act) -> &mut Budget {
        match act {
            Act::Delete => &mut self.deletions,
            Act::OutOfService => &mut self.outs_of_service,
        }
    }
}

/// The lifecycle controller: one pass over the cache every `--node-monitor-period` (one key,
/// requeued after the period), on the runner like every controller.
pub struct NodeLifecycleController {
    ctx: Context,
    state: Mutex<State>,
}

/// The lifecycle controller's one key: the pass.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EveryNode;

impl NodeLifecycleController {
    /// A controller over `ctx`.
    pub fn new(ctx: Context) -> Self {
        let period = ctx.options.node_monitor_period.max(Duration::from_millis(100));
        let out_of_service_after = ctx.options.out_of_service_after;
        let rechecks = Rechecks { period, out_of_service_after, by_node: HashMap::new() };
        Self { ctx, state: Mutex::new(State { rechecks, deletions: Budget::default(), outs_of_service: Budget::default() }) }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.locked()
    }

    /// Runs a pass every `--node-monitor-period` until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        runner::run(self, stop).await;
    }

    /// One pass over the cache.
    pub async fn pass(&self) -> Pass {
        let mut pass = Pass::default();
        if self.ctx.provider.identity().is_none() {
            return pass;
        }
        let managed: Vec<Arc<Node>> = self
            .ctx
            .managed_nodes()
            // A Node still being initialised is the node controller's, for a while: one that
            // never was (its instance went before it could be) is asked about as any other.
            .filter(|n| !node_util::has_taint(n, TAINT_UNINITIALIZED) || registered_for(n) >= UNINITIALIZED_GRACE)
            .collect();
        let (ready, candidates): (Vec<Arc<Node>>, Vec<Arc<Node>>) = managed.into_iter().partition(|n| node_util::is_ready(n));
        for node in ready.iter().filter(|n| node_util::has_taint(n, TAINT_SHUTDOWN)) {
            let name = node_util::name(node).to_string();
            match self.set_shutdown_taint(node, false).await {
                Ok(()) => pass.untainted.push(name),
                Err(error) => {
                    tracing::warn!(node = %name, %error, "removing the shutdown taint from a Ready node failed");
                    pass.errors += 1;
                }
            }
        }
        self.return_to_service(&ready, &mut pass).await;
        let disrupted = disrupted_zones(&ready, &candidates, self.ctx.options.unhealthy_zone_threshold);
        let not_ready = candidates.len();
        let now = Instant::now();
        let candidates = self.state().rechecks.due(candidates, now);
        if candidates.is_empty() {
            return pass;
        }
        pass.checked = candidates.len();
        // What the node refresh read since a Node's last question answers it: no call of its own.
        let (mut answered, mut asked) = (Vec::new(), Vec::new());
        for node in candidates {
            match self.ctx.provider.recent_state(&node) {
                Some((at, state)) if self.state().rechecks.answered_by(&node, at, now) => answered.push((node, at, Ok(state))),
                _ => asked.push(node),
            }
        }
        pass.answered_by_refresh = answered.len();
        let lookups = InstanceLookups::of(asked.iter().map(|n| n.as_ref()));
        let results = match asked.is_empty() {
            true => Vec::new(),
            false => self.ctx.provider.instance_metadata(&lookups).await,
        };
        let results = asked.into_iter().zip(results).map(|(node, r)| (node, now, r.map(|m| m.map(|m| m.state))));
        let mut gone = Vec::new();
        let mut shut_down = Vec::new();
        for (node, at, result) in answered.into_iter().chain(results) {
            let node = &node;
            let name = node_util::name(node).to_string();
            match result {
                Err(error) => {
                    // Never read as "gone".
                    self.state().rechecks.asked(node, None, at);
                    tracing::warn!(node = %name, %error, "instance check failed; node left as is");
                    self.ctx.report_invalid(NAME, node.as_ref(), &error).await;
                    pass.errors += 1;
                }
                Ok(state) => {
                    let exists = state.is_some_and(|s| s != InstanceState::Terminated);
                    let shutdown = state == Some(InstanceState::Stopped);
                    self.state().rechecks.asked(node, Some((exists, shutdown)), at);
                    if shutdown
                        && !node_util::has_taint(node, TAINT_OUT_OF_SERVICE)
                        && let Some(lasted) = self.state().rechecks.out_of_service_for(node, now)
                    {
                        shut_down.push((node.clone(), lasted));
                    }
                    if !exists && node_util::provider_id(node).is_none() && self.ctx.providers.several() {
                        // Its provider is only what the ccm-rs.dev/provider label claims: a
                        // provider deletes no Node it never knew (none initialised it).
                        let why = "no providerID: its provider is named only by the ccm-rs.dev/provider label, and a provider \
                                   deletes no Node it never knew; delete it by hand if its machine is gone";
                        self.refuse(Act::Delete, node, why).await;
                        pass.refused.push(name);
                    } else if !exists {
                        gone.push(node.clone());
                    } else if shutdown && !node_util::has_taint(node, TAINT_SHUTDOWN) {
                        match self.set_shutdown_taint(node, true).await {
                            Ok(()) => pass.tainted.push(name),
                            Err(error) => {
                                tracing::warn!(node = %name, %error, "tainting the node failed");
                                pass.errors += 1;
                            }
                        }
                    } else if !shutdown && node_util::has_taint(node, TAINT_SHUTDOWN) {
                        match self.set_shutdown_taint(node, false).await {
                            Ok(()) => pass.untainted.push(name),
                            Err(error) => {
                                tracing::warn!(node = %name, %error, "removing the shutdown taint failed");
                                pass.errors += 1;
                            }
                        }
                    }
                }
            }
        }
        let bounds = Bounds { disrupted: &disrupted, ready: &ready, total: ready.len() + not_ready };
        let (gone, counted_at) = self.within_bounds(Act::Delete, gone, &bounds, &mut pass).await;
        let before = pass.deleted.len();
        self.delete_gone(gone, counted_at, &mut pass).await;
        self.landed(Act::Delete, counted_at, pass.deleted.len() - before).await;
        let lasted: HashMap<String, Duration> =
            shut_down.iter().map(|(n, lasted)| (node_util::name(n).to_string(), *lasted)).collect();
        let shut_down = shut_down.into_iter().map(|(n, _)| n).collect();
        let (shut_down, counted_at) = self.within_bounds(Act::OutOfService, shut_down, &bounds, &mut pass).await;
        let before = pass.out_of_service.len();
        for node in shut_down {
            // Not sent past the time it was counted at (see LANDS_WITHIN).
            if Instant::now() >= counted_at {
                break;
            }
            let lasted = lasted.get(node_util::name(&node)).copied().unwrap_or_default();
            self.take_out_of_service(&node, lasted, &mut pass).await;
        }
        self.landed(Act::OutOfService, counted_at, pass.out_of_service.len() - before).await;
        pass
    }

    /// Of the Nodes the provider's word would have `act` on, those it may now: none in a
    /// disrupted zone, none at all when the provider says the same of Ready Nodes' instances
    /// (each a Warning Event, in the pass's refusals); of the rest, oldest first, as many as
    /// the window has room for, the others asked about again when it frees (each a Normal
    /// Event, in the pass's deferrals). Those returned are counted against the window.
    /// With them, the provisional time they were counted at ([`LANDS_WITHIN`]).
    async fn within_bounds(
        &self,
        act: Act,
        nodes: Vec<Arc<Node>>,
        bounds: &Bounds<'_>,
        pass: &mut Pass,
    ) -> (Vec<Arc<Node>>, Instant) {
        let refused = match act {
            Act::Delete => &mut pass.refused,
            Act::OutOfService => &mut pass.out_of_service_refused,
        };
        let (blocked, nodes): (Vec<Arc<Node>>, Vec<Arc<Node>>) =
            nodes.into_iter().partition(|n| bounds.disrupted.contains_key(zone_of(n)));
        for node in &blocked {
            let zone = zone_of(node);
            let (not_ready, all) = bounds.disrupted.get(zone).copied().unwrap_or_default();
            let why = format!(
                "zone {zone:?} is disrupted ({not_ready} of its {all} Nodes NotReady): no Node of it is {} until most are Ready again",
                act.done()
            );
            self.refuse(act, node, &why).await;
            refused.push(node_util::name(node).to_string());
        }
        if nodes.is_empty() {
            return (nodes, Instant::now());
        }
        let mut nodes = match self.doubt(act, bounds.ready, nodes).await {
            Ok(confirmed) => confirmed,
            Err((why, nodes)) => {
                tracing::warn!(nodes = nodes.len(), "refusing to act on Nodes ({}): {why}", act.done());
                for node in &nodes {
                    self.refuse(act, node, &why).await;
                    refused.push(node_util::name(node).to_string());
                }
                return (Vec::new(), Instant::now());
            }
        };
        if nodes.is_empty() {
            return (nodes, Instant::now());
        }
        // What earlier holders of the Lease spent in the window counts (once per tenure); no
        // action while it cannot be read.
        let key = act.ledger_key(self.ctx.provider.name());
        if let Some(ledger) = &self.ctx.ledger
            && !self.state().budget(act).loaded
        {
            match ledger.load(&key).await {
                Ok(times) => {
                    let mut state = self.state();
                    let budget = state.budget(act);
                    budget.done = times.into();
                    budget.loaded = true;
                }
                Err(error) => {
                    tracing::warn!(error = %crate::metrics::chain(&error), "not acting on Nodes ({}) until what was spent in the window can be read", act.done());
                    return (Vec::new(), Instant::now());
                }
            }
        }
        let options = &self.ctx.options;
        let share = (options.max_node_deletion_share * bounds.total as f64).ceil().max(1.0) as usize;
        let bound = options.max_node_deletions.min(share);
        let window = options.node_deletion_window;
        let now = Instant::now();
        let (mut left, mut frees) = self.state().budget(act).left(bound, window, now);
        // With several providers, the same bounds over every provider's Nodes: the room left
        // there is taken at once, so that another provider's pass cannot take it too.
        if self.ctx.providers.several() {
            let all = self.ctx.over_all_nodes().managed_nodes().count().max(bounds.total);
            let all_share = (options.max_node_deletion_share * all as f64).ceil().max(1.0) as usize;
            let mut overall = self.ctx.lifecycle_overall.budget(act);
            let (all_left, all_frees) = overall.left(options.max_node_deletions.min(all_share), window, now);
            if all_left < left {
                left = all_left;
                frees = all_frees.max(frees);
            }
            for _ in 0..left.min(nodes.len()) {
                overall.spend(now);
            }
        }
        nodes.sort_by(|a, b| {
            let created = |n: &Node| n.metadata.creation_timestamp.as_ref().map(|t| t.0);
            (created(a), node_util::name(a)).cmp(&(created(b), node_util::name(b)))
        });
        let held = nodes.split_off(left.min(nodes.len()));
        if !held.is_empty() {
            let next = frees.unwrap_or(now + window);
            // The same words on every pass (no count, no time), so that the Event of a Node
            // deferred pass after pass is one series counted up.
            let why = format!(
                "its instance is reported {}, and at most {bound} Nodes are {} in any {} (--max-node-deletions={}, \
                 --max-node-deletion-share={}, --node-deletion-window): asked about again when the window has room",
                act.reported(),
                act.done(),
                humantime::format_duration(window),
                options.max_node_deletions,
                options.max_node_deletion_share,
            );
            tracing::info!(
                nodes = held.len(),
                bound,
                next_in_s = next.saturating_duration_since(now).as_secs_f64().ceil(),
                "pacing ({}): {why}",
                act.done()
            );
            for node in &held {
                self.state().rechecks.ask_by(node, next);
                match act {
                    Act::Delete => self.ctx.metrics.node_deletions("deferred", 1),
                    Act::OutOfService => self.ctx.metrics.out_of_service_taints("deferred", 1),
                }
                self.ctx
                    .event(
                        NAME,
                        node.as_ref(),
                        EventType::Normal,
                        act.deferred_reason(),
                        format!("Not yet {}: {why}", act.done()),
                    )
                    .await;
                pass.deferred.push(node_util::name(node).to_string());
            }
        }
        let spent: Vec<Instant> = {
            let mut state = self.state();
            for _ in &nodes {
                state.budget(act).spend(now + LANDS_WITHIN);
            }
            state.budget(act).done.iter().copied().collect()
        };
        // Recorded on the Lease before anything is done: the next holder counts it.
        if !nodes.is_empty()
            && let Some(ledger) = &self.ctx.ledger
            && let Err(error) = ledger.record(&key, &spent).await
        {
            tracing::warn!(error = %crate::metrics::chain(&error), "not acting on Nodes ({}): the window's record was not kept", act.done());
            return (Vec::new(), Instant::now());
        }
        (nodes, now + LANDS_WITHIN)
    }

    /// Restamps the `landed` actions counted at `at` as done now (their writes came back), and
    /// records the window again for the next holder of the Lease. When that record fails the
    /// Lease keeps the later, provisional times: the next holder waits a little longer.
    async fn landed(&self, act: Act, at: Instant, landed: usize) {
        if landed == 0 {
            return;
        }
        let now = Instant::now();
        let spent: Vec<Instant> = {
            let mut state = self.state();
            let budget = state.budget(act);
            for _ in 0..landed {
                budget.landed(at, now);
            }
            budget.done.iter().copied().collect()
        };
        if let Some(ledger) = &self.ctx.ledger
            && let Err(error) = ledger.record(&act.ledger_key(self.ctx.provider.name()), &spent).await
        {
            tracing::debug!(error = %crate::metrics::chain(&error), "the window's record keeps the provisional times ({})", act.done());
        }
    }

    /// Deletes the Nodes whose instance is gone (within the bounds already).
    async fn delete_gone(&self, gone: Vec<Arc<Node>>, counted_at: Instant, pass: &mut Pass) {
        for node in &gone {
            // Not sent past the time it was counted at: a deletion held up that long (a slow
            // API server, a stop that let the pass finish) is asked about again next pass.
            if Instant::now() >= counted_at {
                tracing::info!(node = %node_util::name(node), "not deleting the node now: the window counted it as done by now; asked about again");
                break;
            }
            let name = node_util::name(node).to_string();
            match self.delete(node).await {
                Ok(()) => {
                    self.ctx.metrics.node_deletions("deleted", 1);
                    pass.deleted.push(name);
                }
                Err(error) => {
                    tracing::warn!(node = %name, %error, "deleting the node failed");
                    self.ctx
                        .event(
                            NAME,
                            node.as_ref(),
                            EventType::Warning,
                            reason::DELETING_NODE_FAILED,
                            format!("Error deleting node: {error}"),
                        )
                        .await;
                    pass.errors += 1;
                }
            }
        }
    }

    /// The `candidates` whose instance the provider still reports gone (or shut down) when
    /// asked again in one call with up to [`WITNESSES`] Ready Nodes' instances, which exist;
    /// or, with the candidates, why its word is not to be believed: it calls half of the
    /// witnesses gone too, or cannot answer (a lost account, another region, an empty cache:
    /// wrong about the cloud rather than right about the Nodes). One call for both, so that a
    /// provider that lies in one answer and not in the next cannot pass its lie on a
    /// candidate off with a true answer about the witnesses.
    async fn doubt(
        &self,
        act: Act,
        ready: &[Arc<Node>],
        candidates: Vec<Arc<Node>>,
    ) -> Result<Vec<Arc<Node>>, (String, Vec<Arc<Node>>)> {
        let witnesses: Vec<&Arc<Node>> = ready.iter().filter(|n| node_util::provider_id(n).is_some()).take(WITNESSES).collect();
        if witnesses.is_empty() {
            // Every Node NotReady (or none initialised): nothing to check the provider's word
            // against. The Nodes wait for one that is Ready (a replacement joining is one).
            let why = "no Ready Node's instance to check the provider's answer against, so it is not trusted".to_string();
            return Err((why, candidates));
        }
        let lookups = InstanceLookups::of(witnesses.iter().map(|n| n.as_ref()).chain(candidates.iter().map(|n| n.as_ref())));
        let mut answers = self.ctx.provider.instance_metadata(&lookups).await;
        let of_candidates = answers.split_off(witnesses.len().min(answers.len()));
        let mut denied = Vec::new();
        for (node, answer) in witnesses.iter().zip(answers) {
            match answer {
                Err(error) => {
                    let why = format!(
                        "the provider could not confirm the instance of Ready Node {} ({error}), so its other answers are not trusted",
                        node_util::name(node)
                    );
                    return Err((why, candidates));
                }
                Ok(m) if act.denies(m.as_ref()) => denied.push(node_util::name(node).to_string()),
                Ok(_) => {}
            }
        }
        // A Ready Node whose instance just went is Ready for a while yet: one such Node is a
        // scale-down in progress, half of them a provider that is wrong.
        if !denied.is_empty() && denied.len() * 2 >= witnesses.len() {
            let why = format!(
                "the provider also says the instances of {} of {} Ready Nodes ({}) are {}, so its answer is not trusted",
                denied.len(),
                witnesses.len(),
                denied.join(", "),
                act.reported()
            );
            return Err((why, candidates));
        }
        // Each candidate only on the same answer again; any other answer (an error above all)
        // leaves it for its next check.
        Ok(candidates
            .into_iter()
            .zip(of_candidates)
            .filter_map(|(node, answer)| {
                let again = answer.as_ref().is_ok_and(|m| act.denies(m.as_ref()));
                if !again {
                    tracing::info!(node = %node_util::name(&node), "the provider no longer says the same of the node's instance; left as is");
                }
                again.then_some(node)
            })
            .collect())
    }

    async fn refuse(&self, act: Act, node: &Node, why: &str) {
        match act {
            Act::Delete => {
                tracing::warn!(node = %node_util::name(node), "not deleting the node although its instance is reported gone: {why}");
                self.ctx.metrics.node_deletions("refused", 1);
                self.ctx
                    .event(NAME, node, EventType::Warning, reason::NODE_DELETION_REFUSED, format!("Not deleting the node: {why}"))
                    .await;
            }
            Act::OutOfService => {
                tracing::warn!(node = %node_util::name(node), "not tainting the node out of service although its instance is reported shut down: {why}");
                self.ctx.metrics.out_of_service_taints("refused", 1);
                let note = format!("Not adding the {TAINT_OUT_OF_SERVICE} taint: {why}");
                self.ctx.event(NAME, node, EventType::Warning, reason::NODE_OUT_OF_SERVICE_REFUSED, note).await;
            }
        }
    }

    /// Adds the out-of-service taint and the annotation that says this controller added it.
    async fn take_out_of_service(&self, node: &Node, lasted: Duration, pass: &mut Pass) {
        let name = node_util::name(node).to_string();
        let mut taints = node_util::taints_without(node, TAINT_OUT_OF_SERVICE);
        taints.push(Taint {
            key: TAINT_OUT_OF_SERVICE.into(),
            value: Some(OUT_OF_SERVICE_VALUE.into()),
            effect: "NoExecute".into(),
            time_added: None,
        });
        let since = crate::clock::now().to_string();
        match self.patch_taints(node, taints, Some(Some(since))).await {
            Ok(()) => {
                let lasted = humantime::format_duration(Duration::from_secs(lasted.as_secs()));
                tracing::info!(node = %name, %lasted, "node taken out of service: its instance is shut down");
                self.ctx.metrics.out_of_service_taints("added", 1);
                let note = format!(
                    "Added the taint {TAINT_OUT_OF_SERVICE}={OUT_OF_SERVICE_VALUE}:NoExecute: the provider has reported the instance shut down for {lasted} and the Node is NotReady; its pods are force-deleted and their volumes detached"
                );
                self.ctx.event(NAME, node, EventType::Normal, reason::NODE_OUT_OF_SERVICE, note).await;
                pass.out_of_service.push(name);
            }
            Err(error) => {
                tracing::warn!(node = %name, %error, "adding the out-of-service taint failed");
                pass.errors += 1;
            }
        }
    }

    /// Ready Nodes that carry the out-of-service annotation (this controller's taint) are
    /// asked about: those whose instance runs lose the taint and the annotation. An error or
    /// another answer leaves them as they are.
    async fn return_to_service(&self, ready: &[Arc<Node>], pass: &mut Pass) {
        let ours: Vec<&Arc<Node>> = ready.iter().filter(|n| has_annotation(n, ANNOTATION_OUT_OF_SERVICE)).collect();
        if ours.is_empty() {
            return;
        }
        let lookups = InstanceLookups::of(ours.iter().map(|n| n.as_ref()));
        let answers = self.ctx.provider.instance_metadata(&lookups).await;
        for (node, answer) in ours.into_iter().zip(answers) {
            let name = node_util::name(node).to_string();
            let running = match &answer {
                Ok(Some(m)) => m.state == InstanceState::Running,
                Ok(None) => false,
                Err(error) => {
                    tracing::warn!(node = %name, %error, "instance check of a node out of service failed; the taint stays");
                    pass.errors += 1;
                    false
                }
            };
            if !running {
                continue;
            }
            let had_taint = node_util::has_taint(node, TAINT_OUT_OF_SERVICE);
            match self.patch_taints(node, node_util::taints_without(node, TAINT_OUT_OF_SERVICE), Some(None)).await {
                Ok(()) if had_taint => {
                    tracing::info!(node = %name, "node back in service: its instance runs and it is Ready");
                    self.ctx.metrics.out_of_service_taints("removed", 1);
                    let note = format!("Removed the taint {TAINT_OUT_OF_SERVICE}: the instance runs again and the Node is Ready");
                    self.ctx.event(NAME, node.as_ref(), EventType::Normal, reason::NODE_BACK_IN_SERVICE, note).await;
                    pass.back_in_service.push(name);
                }
                Ok(()) => {}
                Err(error) => {
                    tracing::warn!(node = %name, %error, "removing the out-of-service taint failed");
                    pass.errors += 1;
                }
            }
        }
    }

    async fn delete(&self, node: &Node) -> Result<(), kube::Error> {
        let name = node_util::name(node);
        tracing::info!(node = %name, "deleting node: its instance no longer exists");
        self.ctx
            .event(
                NAME,
                node,
                EventType::Normal,
                reason::DELETING_NODE,
                format!("Deleting node {name} because it does not exist in the cloud provider"),
            )
            .await;
        // Only the Node we looked at: a re-registered Node of the same name has another UID.
        self.ctx.delete_node(node).await
    }

    async fn set_shutdown_taint(&self, node: &Node, on: bool) -> Result<(), kube::Error> {
        let mut taints = node_util::taints_without(node, TAINT_SHUTDOWN);
        if on {
            taints.push(Taint { key: TAINT_SHUTDOWN.into(), effect: "NoSchedule".into(), value: None, time_added: None });
        }
        self.patch_taints(node, taints, None).await
    }

    /// Replaces the Node's taints (guarded by the resourceVersion read), and sets
    /// (`Some(Some(since))`) or removes (`Some(None)`) the out-of-service annotation.
    async fn patch_taints(
        &self,
        node: &Node,
        taints: Vec<Taint>,
        out_of_service: Option<Option<String>>,
    ) -> Result<(), kube::Error> {
        let mut patch = serde_json::json!({
            "metadata": { "resourceVersion": node.metadata.resource_version },
            "spec": { "taints": taints },
        });
        if let Some(since) = out_of_service {
            patch["metadata"]["annotations"] = serde_json::json!({ ANNOTATION_OUT_OF_SERVICE: since });
        }
        self.ctx.patch_node(node_util::name(node), &patch).await.map(|_| ())
    }
}

impl runner::Controller for NodeLifecycleController {
    type Key = EveryNode;
    const NAME: &'static str = NAME;
    /// Nothing but the period starts a pass (a missed change is seen by the next one), so no
    /// change is subscribed to: a subscriber would wake on every heartbeat of every Node.
    const WATCHES: Watches = Watches { nodes: false, services: false, provider: false };

    fn ctx(&self) -> &Context {
        &self.ctx
    }

    /// The first pass is scheduled once the Node cache is synced (see `spawn`).
    fn resync(&self, _queue: &WorkQueue<EveryNode>) {}

    /// The first pass one period after the Node cache is synced, as every later one.
    fn spawn(self: &Arc<Self>, queue: &Arc<WorkQueue<EveryNode>>, stop: &CancellationToken, tasks: &mut Tasks) {
        let (ctx, queue, stop) = (self.ctx.clone(), queue.clone(), stop.clone());
        tasks.spawn(async move {
            tokio::select! {
                _ = ctx.nodes.wait_synced() => queue.add_after(EveryNode, ctx.options.node_monitor_period),
                _ = stop.cancelled() => return,
            }
            stop.cancelled().await;
        });
    }

    async fn reconcile(&self, _keys: &[EveryNode]) -> Vec<Done> {
        let pass = self.pass().await;
        // A pass that met errors is counted as failed, but the next one still comes after
        // the period: each of its Nodes is asked about again then.
        vec![Done { outcome: Outcome::RequeueAfter(self.ctx.options.node_monitor_period), failed: pass.errors > 0 }]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn nodes(zone: &str, n: usize) -> Vec<Arc<Node>> {
        (0..n)
            .map(|i| {
                let labels = [(wellknown::LABEL_ZONE.to_string(), zone.to_string())].into();
                Arc::new(Node {
                    metadata: ObjectMeta { name: Some(format!("{zone}-{i}")), labels: Some(labels), ..Default::default() },
                    ..Default::default()
                })
            })
            .collect()
    }

    #[test]
    fn an_answer_read_by_the_refresh_stands_for_a_question_only_when_newer_and_about_the_same_node() {
        let mut r = Rechecks { period: Duration::from_secs(5), out_of_service_after: None, by_node: HashMap::new() };
        let node = nodes("a", 1).remove(0);
        let start = Instant::now();
        assert!(!r.answered_by(&node, start, start), "a Node never asked about is asked");
        r.asked(&node, Some((true, false)), start);
        let later = start + Duration::from_secs(5);
        assert!(!r.answered_by(&node, start, later), "not newer than its own question");
        assert!(r.answered_by(&node, start + Duration::from_secs(2), later), "read since: it stands");
        assert!(
            !r.answered_by(&node, start + Duration::from_secs(1), start + Duration::from_secs(60)),
            "read too long ago to put the question off"
        );
        let mut changed = node.clone();
        Arc::make_mut(&mut changed).spec.get_or_insert_default().provider_id = Some("sim://z/other".into());
        assert!(!r.answered_by(&changed, start + Duration::from_secs(2), later), "another instance: asked");
    }

    #[test]
    fn an_unchanged_not_ready_node_is_asked_less_and_less_often_and_a_change_starts_it_again() {
        let mut r = Rechecks { period: Duration::from_secs(5), out_of_service_after: None, by_node: HashMap::new() };
        let node = |ready: &str| {
            let mut n = nodes("a", 1).remove(0);
            let status = k8s_openapi::api::core::v1::NodeStatus {
                conditions: Some(vec![k8s_openapi::api::core::v1::NodeCondition {
                    type_: "Ready".into(),
                    status: ready.into(),
                    ..Default::default()
                }]),
                ..Default::default()
            };
            Arc::make_mut(&mut n).status = Some(status);
            n
        };
        let start = Instant::now();
        let mut asked_at = Vec::new();
        let mut t = start;
        while t < start + Duration::from_secs(3600) {
            if !r.due(vec![node("False")], t).is_empty() {
                asked_at.push((t - start).as_secs());
                r.asked(&node("False"), Some((true, false)), t);
            }
            t += Duration::from_secs(5);
        }
        // At the longest interval, 5 min and a tenth: the node refresh (every 5 min) answers first.
        assert_eq!(&asked_at[..8], &[0, 5, 15, 35, 75, 155, 315, 645], "doubling from the period");
        assert!(asked_at.windows(2).all(|w| w[1] - w[0] <= 330), "at most 5.5 min apart: {asked_at:?}");
        assert!(asked_at.len() <= 20, "{} questions in an hour", asked_at.len());
        // The Node changes (Ready flips to Unknown): asked at once, then after the period.
        assert_eq!(r.due(vec![node("Unknown")], t).len(), 1);
        r.asked(&node("Unknown"), Some((true, false)), t);
        assert!(r.due(vec![node("Unknown")], t + Duration::from_secs(4)).is_empty());
        assert_eq!(r.due(vec![node("Unknown")], t + Duration::from_secs(5)).len(), 1);
        // The answer changes (shut down): the period again.
        r.asked(&node("Unknown"), Some((true, true)), t + Duration::from_secs(5));
        assert_eq!(r.due(vec![node("Unknown")], t + Duration::from_secs(10)).len(), 1);
        // Another Node half-way to due joins a batch that is due anyway.
        let other = {
            let mut n = node("False");
            Arc::make_mut(&mut n).metadata.name = Some("b-0".into());
            n
        };
        let mut r = Rechecks { period: Duration::from_secs(5), out_of_service_after: None, by_node: HashMap::new() };
        r.asked(&node("False"), Some((true, false)), start);
        r.asked(&other, Some((true, false)), start + Duration::from_secs(2));
        assert_eq!(r.due(vec![node("False"), other.clone()], start + Duration::from_secs(5)).len(), 2);
    }

    #[test]
    fn out_of_service_needs_every_answer_shut_down_for_the_delay_and_two_answers() {
        let after = Duration::from_secs(30);
        let mut r = Rechecks { period: Duration::from_secs(5), out_of_service_after: Some(after), by_node: HashMap::new() };
        let node = nodes("a", 1).remove(0);
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let stopped = Some((true, true));
        r.asked(&node, stopped, at(0));
        assert_eq!(r.out_of_service_for(&node, at(3600)), None, "a single answer is never enough");
        // The doubling would ask at 5, 15, 35 s: the Node is asked when its delay is up.
        r.asked(&node, stopped, at(5));
        r.asked(&node, stopped, at(15));
        assert_eq!(r.by_node["a-0"].0.due, at(30), "asked again when the delay is up, not at 35 s");
        assert_eq!(r.out_of_service_for(&node, at(29)), None, "not before the delay");
        r.asked(&node, stopped, at(30));
        assert_eq!(r.out_of_service_for(&node, at(30)), Some(after));
        // An error starts the count again, as does a running instance.
        r.asked(&node, None, at(35));
        assert_eq!(r.out_of_service_for(&node, at(36)), None);
        r.asked(&node, stopped, at(40));
        r.asked(&node, stopped, at(70));
        assert_eq!(r.out_of_service_for(&node, at(70)), Some(after));
        r.asked(&node, Some((true, false)), at(75));
        r.asked(&node, stopped, at(80));
        assert_eq!(r.out_of_service_for(&node, at(200)), None, "one answer since it ran");
        // Another instance under the same Node name (a new UID) starts it again.
        r.asked(&node, stopped, at(205));
        assert!(r.out_of_service_for(&node, at(240)).is_some());
        let mut other = node.clone();
        Arc::make_mut(&mut other).metadata.uid = Some("another".into());
        assert_eq!(r.out_of_service_for(&other, at(240)), None);
        r.asked(&other, stopped, at(240));
        assert_eq!(r.out_of_service_for(&other, at(400)), None, "one answer about the new instance");
        // Off without the flag.
        let mut off = Rechecks { period: Duration::from_secs(5), out_of_service_after: None, by_node: HashMap::new() };
        for s in [0, 100, 200] {
            off.asked(&node, stopped, at(s));
        }
        assert_eq!(off.out_of_service_for(&node, at(300)), None);
    }

    #[test]
    fn the_bound_holds_over_any_window_and_frees_as_it_slides() {
        let (bound, window) = (2, Duration::from_secs(60));
        let mut b = Budget::default();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(b.left(bound, window, at(0)), (2, None));
        b.spend(at(0));
        // A pass 36 s later (another Node's recheck) finds room for one only.
        assert_eq!(b.left(bound, window, at(36)), (1, Some(at(60))));
        b.spend(at(36));
        assert_eq!(b.left(bound, window, at(50)), (0, Some(at(60))), "two in the window: none more");
        assert_eq!(b.left(bound, window, at(60)), (1, Some(at(96))), "the first slid out");
        assert_eq!(b.left(bound, window, at(96)), (2, None));
        // Four gone at once with a bound of two: two now, two a window later, never more.
        let mut b = Budget::default();
        let mut done = Vec::new();
        let mut waiting = 4;
        for s in (0..300).step_by(5) {
            let (left, _) = b.left(bound, window, at(s));
            for _ in 0..left.min(waiting) {
                b.spend(at(s));
                done.push(s);
                waiting -= 1;
            }
        }
        assert_eq!(done, vec![0, 0, 60, 60], "the whole termination in two windows");
    }

    #[test]
    fn an_action_counts_from_when_it_landed_never_from_before() {
        let (bound, window) = (1, Duration::from_secs(60));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        // Counted at a provisional time half a minute ahead: the window is full until then
        // and for a window after it.
        let mut b = Budget::default();
        b.spend(at(0) + LANDS_WITHIN);
        assert_eq!(b.left(bound, window, at(10)), (0, Some(at(90))));
        // The write came back at 3 s: the window runs from there.
        b.landed(at(0) + LANDS_WITHIN, at(3));
        assert_eq!(b.left(bound, window, at(62)), (0, Some(at(63))));
        assert_eq!(b.left(bound, window, at(63)), (1, None));
        // Restamping keeps the times in order (the oldest frees first).
        let mut b = Budget::default();
        b.spend(at(1));
        b.spend(at(2) + LANDS_WITHIN);
        b.landed(at(2) + LANDS_WITHIN, at(4));
        assert_eq!(b.done.iter().copied().collect::<Vec<_>>(), vec![at(1), at(4)]);
    }

    #[test]
    fn a_witness_shut_down_denies_only_the_out_of_service_taint() {
        let meta = |state: ccm_proto::v1::InstanceState| {
            let mut m = ccm_proto::v1::InstanceMetadata::default();
            m.set_state(state);
            Instance::from(m)
        };
        assert!(Act::Delete.denies(None) && Act::OutOfService.denies(None));
        assert!(Act::Delete.denies(Some(&meta(ccm_proto::v1::InstanceState::Terminated))));
        assert!(!Act::Delete.denies(Some(&meta(ccm_proto::v1::InstanceState::Stopped))));
        assert!(Act::OutOfService.denies(Some(&meta(ccm_proto::v1::InstanceState::Stopped))));
        assert!(!Act::OutOfService.denies(Some(&meta(ccm_proto::v1::InstanceState::Running))));
    }

    #[test]
    fn disruption_is_most_of_a_zone_or_everything_down() {
        let zones = |ready: Vec<Arc<Node>>, down: Vec<Arc<Node>>| disrupted_zones(&ready, &down, 0.55);
        // Everything NotReady: every zone held back, but not for one or two Nodes.
        assert_eq!(zones(vec![], [nodes("a", 2), nodes("b", 1)].concat()).len(), 2);
        assert!(zones(vec![], nodes("a", 2)).is_empty(), "two Nodes say too little");
        // A zone mostly NotReady (more than two, at least 55%), others fine.
        let z = zones([nodes("a", 2), nodes("b", 10)].concat(), nodes("a", 3));
        assert_eq!(z.into_iter().collect::<Vec<_>>(), vec![("a".to_string(), (3, 5))]);
        assert!(zones(nodes("a", 3), nodes("a", 3)).is_empty(), "half is below the threshold");
        assert!(zones(nodes("a", 10), nodes("a", 2)).is_empty(), "two NotReady is no disruption");
        // A zone entirely NotReady while another is fine: its instances are asked as any.
        assert!(zones(nodes("b", 5), nodes("a", 4)).is_empty());
    }
}
