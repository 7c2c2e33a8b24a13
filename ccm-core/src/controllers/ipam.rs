//! The node IPAM controller (`node-ipam-controller`, `--allocate-node-cidrs`): gives each Node
//! without podCIDRs one from each `--cluster-cidr` (dual-stack: an IPv4 and an IPv6 one), of
//! `--node-cidr-mask-size-ipv4` / `-ipv6`, as kube-controller-manager's range allocator does,
//! so that a cluster gets podCIDRs and routes from one process. Event-driven: a Node added
//! without podCIDRs is given them at once; the CIDRs of Nodes that exist (whoever set them)
//! are never given again; a deleted Node's are free again. No provider call.
//!
//! With `--cidr-allocator-type=CloudAllocator` the podCIDRs come from the cloud instead (GCP's
//! alias ranges, AWS's prefix delegation): a Node with a providerID and no podCIDRs is given
//! the `pod_cidrs` of its instance's metadata (one BatchInstanceMetadata per 500 Nodes), with
//! the record `ccm-rs.dev/pod-cidrs-from-cloud`; when the provider says the cloud routes them
//! (`pod_cidrs_routed`), NetworkUnavailable is cleared here and the route controller makes no
//! route for them. A Node whose podCIDRs differ from its instance's keeps them (a Warning
//! Event): podCIDRs are never overwritten. A cloud that gave none yet is asked again later.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};

use ccm_protocol::lock::Lock;
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use kube::runtime::reflector::ObjectRef;
use std::sync::Mutex;
use tokio_util::sync::CancellationToken;

use super::runner::{self, Done, Watches};
use super::{ConfigError, Context};
use crate::events::{EventType, reason};
use crate::informer::Change;
use crate::node_util;
use crate::provider::convert::{Instance, InstanceLookups};
use crate::queue::{Outcome, QueueConfig, WorkQueue};
use crate::wellknown::{ANNOTATION_POD_CIDRS_FROM_CLOUD, CONDITION_NETWORK_UNAVAILABLE};

/// The controller's name.
pub const NAME: &str = "node-ipam-controller";

/// The most node CIDRs one cluster CIDR is split into (a /8 in /24s is 65,536).
const MAX_SUBNETS: u32 = 1 << 20;

/// One cluster CIDR cut into node CIDRs of one size, with those in use.
#[derive(Debug, Clone)]
pub struct Range {
    cluster: IpNet,
    mask: u8,
    used: BTreeSet<u32>,
    next: u32,
}

impl Range {
    /// `cluster` in node CIDRs of prefix length `mask`.
    pub fn new(cluster: IpNet, mask: u8) -> Result<Self, ConfigError> {
        if mask < cluster.prefix_len() || mask > cluster.max_prefix_len() {
            return Err(ConfigError::Mismatch(format!("a node CIDR mask of /{mask} does not fit in --cluster-cidr {cluster}")));
        }
        let bits = u32::from(mask - cluster.prefix_len());
        if bits > MAX_SUBNETS.trailing_zeros() {
            return Err(ConfigError::Mismatch(format!(
                "--cluster-cidr {cluster} in /{mask}s is more than {MAX_SUBNETS} node CIDRs; use a larger node CIDR mask"
            )));
        }
        Ok(Self { cluster: cluster.trunc(), mask, used: BTreeSet::new(), next: 0 })
    }

    fn count(&self) -> u32 {
        1 << u32::from(self.mask - self.cluster.prefix_len())
    }

    /// The index of `cidr` in this range, if it is one of its node CIDRs.
    fn index_of(&self, cidr: &IpNet) -> Option<u32> {
        if cidr.prefix_len() != self.mask || !self.cluster.contains(cidr) {
            return None;
        }
        let shift = u32::from(cidr.max_prefix_len() - self.mask);
        let offset = match (cidr.network(), self.cluster.network()) {
            (std::net::IpAddr::V4(a), std::net::IpAddr::V4(b)) => u128::from(u32::from(a) - u32::from(b)),
            (std::net::IpAddr::V6(a), std::net::IpAddr::V6(b)) => u128::from(a) - u128::from(b),
            _ => return None,
        };
        u32::try_from(offset >> shift).ok()
    }

    fn at(&self, index: u32) -> IpNet {
        let shift = u32::from(self.cluster.max_prefix_len() - self.mask);
        let addr = match self.cluster.network() {
            std::net::IpAddr::V4(b) => {
                let step = u64::from(index) << shift;
                std::net::IpAddr::V4(std::net::Ipv4Addr::from(u32::from(b).wrapping_add(step as u32)))
            }
            std::net::IpAddr::V6(b) => {
                std::net::IpAddr::V6(std::net::Ipv6Addr::from(u128::from(b) + (u128::from(index) << shift)))
            }
        };
        IpNet::new(addr, self.mask).unwrap_or(self.cluster)
    }

    /// Marks `cidr` in use (a Node has it); whether it is one of this range's.
    pub fn occupy(&mut self, cidr: &IpNet) -> bool {
        self.index_of(cidr).map(|i| self.used.insert(i)).is_some()
    }

    /// How many node CIDRs are taken.
    pub fn in_use(&self) -> usize {
        self.used.len()
    }

    /// Frees `cidr`.
    pub fn release(&mut self, cidr: &IpNet) {
        if let Some(i) = self.index_of(cidr) {
            self.used.remove(&i);
        }
    }

    /// The next free node CIDR, taken; `None` when the range is full.
    pub fn allocate(&mut self) -> Option<IpNet> {
        let count = self.count();
        for step in 0..count {
            let i = (self.next + step) % count;
            if self.used.insert(i) {
                self.next = (i + 1) % count;
                return Some(self.at(i));
            }
        }
        None
    }
}

/// The CIDRs one Node holds, and which Node object it is (a Node deleted and made again under
/// its name is another holder).
#[derive(Debug, Clone)]
struct Holding {
    uid: String,
    cidrs: Vec<IpNet>,
}

/// What node IPAM keeps: the ranges and the CIDRs each Node holds.
struct State {
    ranges: Vec<Range>,
    /// The CIDRs given or seen, by Node name, to free when it goes.
    held: HashMap<String, Holding>,
    /// How many Nodes hold each CIDR (one, unless someone else gave one twice).
    holders: HashMap<IpNet, usize>,
    /// Whether every CIDR the API server's Nodes hold was read fresh from it (not from the
    /// cache) since this tenure began or the cache was last re-listed: nothing is given
    /// before, so that a CIDR the last holder gave just before its tenure ended, which the
    /// cache may not show yet, is never given twice.
    confirmed: bool,
    /// CIDRs given by a write whose outcome is unknown (a timeout, a dropped connection, a
    /// server error: it may have landed): taken until the next fresh read of every Node
    /// shows whether a Node holds them, never handed out again before.
    pending: Vec<IpNet>,
}

impl State {
    /// Takes what a fresh read of every Node shows, and frees the CIDRs of writes whose
    /// outcome was unknown that no Node holds.
    fn confirm_with(&mut self, nodes: &[Node]) {
        for node in nodes {
            self.occupy(node);
        }
        let pending = std::mem::take(&mut self.pending);
        let unheld: Vec<IpNet> = pending.into_iter().filter(|cidr| !self.holders.contains_key(cidr)).collect();
        self.release(&unheld);
        self.confirmed = true;
    }

    /// Takes the CIDRs `node` has, whoever set them; a Node of its name held before under
    /// another UID is gone, and what it held is free.
    fn occupy(&mut self, node: &Node) {
        let name = node_util::name(node);
        let uid = node.metadata.uid.as_deref().unwrap_or_default();
        match self.held.get(name) {
            // podCIDRs never change once set.
            Some(h) if h.uid == uid => return,
            Some(_) => {
                self.free(name);
            }
            None => {}
        }
        let cidrs: Vec<IpNet> = node_util::pod_cidrs(node).iter().filter_map(|c| c.parse().ok()).collect();
        if !cidrs.is_empty() {
            self.hold(name, uid, cidrs);
        }
    }

    /// Records that the Node `name` (of `uid`) holds `cidrs`, once (the watch may show the
    /// CIDRs given before the patch that gave them answers).
    fn hold(&mut self, name: &str, uid: &str, cidrs: Vec<IpNet>) {
        if let Some(h) = self.held.get(name) {
            if h.uid == uid && h.cidrs == cidrs {
                return;
            }
            self.free(name);
        }
        for cidr in &cidrs {
            for range in &mut self.ranges {
                range.occupy(cidr);
            }
            *self.holders.entry(*cidr).or_default() += 1;
        }
        self.held.insert(name.to_string(), Holding { uid: uid.to_string(), cidrs });
    }

    /// Frees what the Node `name` held (those of its CIDRs no other Node holds); what was freed.
    fn free(&mut self, name: &str) -> Vec<IpNet> {
        let Some(gone) = self.held.remove(name) else { return Vec::new() };
        let mut freed = Vec::new();
        for cidr in gone.cidrs {
            let left = self.holders.get_mut(&cidr).map(|n| {
                *n = n.saturating_sub(1);
                *n
            });
            if left == Some(0) {
                self.holders.remove(&cidr);
                freed.push(cidr);
            }
        }
        self.release(&freed);
        freed
    }

    fn release(&mut self, cidrs: &[IpNet]) {
        for cidr in cidrs {
            for range in &mut self.ranges {
                range.release(cidr);
            }
        }
    }

    /// One CIDR from each range, or the cluster CIDR that is full (none taken then).
    fn take(&mut self) -> Result<Vec<IpNet>, IpNet> {
        let mut given = Vec::new();
        for i in 0..self.ranges.len() {
            match self.ranges[i].allocate() {
                Some(cidr) => given.push(cidr),
                None => {
                    let full = self.ranges[i].cluster;
                    self.release(&given);
                    return Err(full);
                }
            }
        }
        Ok(given)
    }
}

/// The node IPAM controller.
pub struct IpamController {
    ctx: Context,
    state: Mutex<State>,
    /// `--cidr-allocator-type=CloudAllocator`: podCIDRs from the cloud.
    cloud: bool,
    /// Nodes (by UID and podCIDRs) the cloud allocator has nothing more to do for: a Node's
    /// heartbeats do not ask the cloud again.
    settled: Mutex<HashSet<(String, Vec<String>)>>,
    /// Whether the provider's lack of pod CIDRs was reported.
    reported: AtomicBool,
}

impl IpamController {
    /// A controller over `ctx`; fails on CIDRs and masks that do not fit together.
    pub fn new(ctx: Context) -> Result<Self, ConfigError> {
        let o = &ctx.options;
        let cloud = o.cloud_allocator();
        let mut ranges = Vec::new();
        // The cloud allocator hands out no range: --cluster-cidr is the route controller's.
        for text in o.cluster_cidr.iter().filter(|_| !cloud) {
            let cidr: IpNet = text.parse().map_err(|_| ConfigError::not_a_cidr("--cluster-cidr", text))?;
            let mask = match cidr {
                IpNet::V4(_) => o.node_cidr_mask_size_ipv4.or(o.node_cidr_mask_size).unwrap_or(24),
                IpNet::V6(_) => o.node_cidr_mask_size_ipv6.unwrap_or(64),
            };
            ranges.push(Range::new(cidr, mask)?);
        }
        let state =
            Mutex::new(State { ranges, held: HashMap::new(), holders: HashMap::new(), confirmed: false, pending: Vec::new() });
        Ok(Self { ctx, state, cloud, settled: Default::default(), reported: AtomicBool::new(false) })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.locked()
    }

    /// Publishes what the ranges hold (`ccm_node_ipam_cidrs_in_use`).
    fn publish(&self) {
        if self.cloud {
            return;
        }
        let (in_use, pending) = {
            let state = self.state();
            let in_use: Vec<(String, usize)> = state.ranges.iter().map(|r| (r.cluster.to_string(), r.in_use())).collect();
            (in_use, state.pending.len())
        };
        self.ctx.metrics.node_ipam_cidrs(&in_use, pending);
    }

    /// Runs until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        if !self.ctx.options.allocate_node_cidrs() {
            stop.cancelled().await;
            return;
        }
        if !self.cloud && self.state().ranges.is_empty() {
            tracing::warn!("--allocate-node-cidrs needs --cluster-cidr; node IPAM is off");
            stop.cancelled().await;
            return;
        }
        runner::run(self, stop).await;
    }

    /// Reads every Node from the API server (not the cache) and takes the CIDRs they hold:
    /// what the last holder of the Lease gave may not be in the cache yet.
    async fn confirm(&self) -> Result<(), kube::Error> {
        let api: kube::Api<Node> = kube::Api::all(self.ctx.client.clone());
        let mut params = kube::api::ListParams::default().limit(500);
        let mut read = Vec::new();
        loop {
            let page = api.list(&params).await?;
            read.extend(page.items);
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(next) => params = params.continue_token(&next),
                None => break,
            }
        }
        self.state().confirm_with(&read);
        tracing::debug!(nodes = read.len(), "node IPAM read every Node's pod CIDRs from the API server");
        Ok(())
    }

    /// Gives `node` its podCIDRs, if it has none and is this process's to manage; false when
    /// its write's outcome is unknown (retried once every Node was read again).
    async fn allocate(&self, node: &Node) -> bool {
        let name = node_util::name(node).to_string();
        let uid = node.metadata.uid.as_deref().unwrap_or_default();
        if !node_util::pod_cidrs(node).is_empty()
            || self.state().held.get(&name).is_some_and(|h| h.uid == uid)
            || self.ctx.ignores(node)
            || node.metadata.deletion_timestamp.is_some()
        {
            return true;
        }
        // A Node of this name held CIDRs under another UID: that Node is gone.
        self.state().occupy(node);
        let taken = self.state().take();
        let given = match taken {
            Ok(given) => given,
            Err(full) => {
                let note = format!("Node {name} status is now: CIDRNotAvailable ({full} is full)");
                tracing::warn!(node = %name, "no pod CIDR left for the node");
                self.ctx.event(NAME, node, EventType::Warning, reason::CIDR_NOT_AVAILABLE, note).await;
                return true;
            }
        };
        let cidrs: Vec<String> = given.iter().map(IpNet::to_string).collect();
        let patch = serde_json::json!({
            "metadata": { "resourceVersion": node.metadata.resource_version },
            "spec": { "podCIDR": cidrs.first(), "podCIDRs": cidrs },
        });
        match self.ctx.patch_node(&name, &patch).await {
            Ok(_) => {
                tracing::info!(node = %name, pod_cidrs = ?cidrs, "pod CIDRs allocated");
                self.state().hold(&name, uid, given);
                true
            }
            // Refused by the API server (a conflict: the Node changed, or someone else set
            // its CIDRs): nothing was written; read again from the next event, the CIDRs go
            // back.
            Err(error) if matches!(&error, kube::Error::Api(status) if (400..500).contains(&status.code)) => {
                self.state().release(&given);
                tracing::warn!(node = %name, %error, "setting the node's pod CIDRs failed");
                let note = format!("Node {name} status is now: CIDRAssignmentFailed ({error})");
                self.ctx.event(NAME, node, EventType::Warning, reason::CIDR_ASSIGNMENT_FAILED, note).await;
                true
            }
            // Anything else may have landed: the CIDRs stay taken until every Node is read
            // again (then freed if no Node holds them), so none is given to two Nodes.
            Err(error) => {
                {
                    let mut state = self.state();
                    state.pending.extend(given);
                    state.confirmed = false;
                }
                tracing::warn!(node = %name, %error, "setting the node's pod CIDRs failed and may have landed; its CIDRs are kept until every Node is read again");
                false
            }
        }
    }
}

impl IpamController {
    /// The cloud allocator's pass over `keys` (Node names): the Nodes that need their
    /// instance's pod CIDRs asked for, one batch read, then each written, left, or retried.
    async fn allocate_from_cloud(&self, keys: &[String]) -> Vec<Done> {
        let mut done: Vec<Done> = keys.iter().map(|_| Outcome::Success.into()).collect();
        let Some(identity) = self.ctx.provider.identity() else {
            return keys.iter().map(|_| Outcome::Retry { fingerprint: None, retry_after: None }.into()).collect();
        };
        if !identity.pod_cidrs() {
            if !self.reported.swap(true, Ordering::AcqRel) {
                tracing::warn!(
                    provider = %identity.name,
                    "--cidr-allocator-type=CloudAllocator, but the provider gives no pod CIDRs (InstancesCapabilities.pod_cidrs): Nodes get none here"
                );
            }
            return done;
        }
        let mut asked = Vec::new();
        for (i, name) in keys.iter().enumerate() {
            let Some(node) = self.ctx.nodes.store().get(&ObjectRef::new(name)) else { continue };
            if self.ctx.ignores(&node) || node.metadata.deletion_timestamp.is_some() || node_util::provider_id(&node).is_none() {
                continue;
            }
            if self.settled.locked().contains(&settled_key(&node)) {
                continue;
            }
            asked.push((i, node));
        }
        if asked.is_empty() {
            return done;
        }
        let lookups = InstanceLookups::of(asked.iter().map(|(_, n)| n.as_ref()));
        let answers = self.ctx.provider.instance_metadata(&lookups).await;
        for ((i, node), answer) in asked.into_iter().zip(answers) {
            done[i] = match answer {
                Ok(Some(instance)) => self.give(&node, &instance, identity.pod_cidrs_routed()).await.into(),
                // Gone: the lifecycle controller's to judge; nothing to give.
                Ok(None) => Outcome::Success.into(),
                Err(error) => {
                    tracing::debug!(node = %node_util::name(&node), %error, "reading the instance's pod CIDRs failed");
                    Outcome::of_provider_error(None, &error).into()
                }
            };
        }
        done
    }

    /// Gives `node` its instance's pod CIDRs (`routed`: the cloud routes them, so
    /// NetworkUnavailable is cleared too); never changes podCIDRs it has.
    async fn give(&self, node: &Node, instance: &Instance, routed: bool) -> Outcome {
        let name = node_util::name(node).to_string();
        let cloud = &instance.pod_cidrs;
        if cloud.is_empty() {
            let note = format!("Node {name} status is now: CIDRNotAvailable (the cloud gave its instance no pod CIDRs yet)");
            self.ctx.event(NAME, node, EventType::Warning, reason::CIDR_NOT_AVAILABLE, note).await;
            // Prefix delegation can come after the instance: asked again, after the longest backoff.
            return Outcome::Retry { fingerprint: None, retry_after: Some(self.ctx.options.reconcile_backoff_max) };
        }
        let have = node_util::pod_cidrs(node);
        if !have.is_empty() && !same_cidrs(&have, cloud) {
            let note = format!(
                "Node {name} has podCIDRs {} but the cloud gave its instance {}: the Node keeps its own (podCIDRs are never changed)",
                have.join(", "),
                cloud.join(", ")
            );
            tracing::warn!(node = %name, have = ?have, cloud = ?cloud, "the node's podCIDRs differ from its instance's; left as they are");
            self.ctx.event(NAME, node, EventType::Warning, reason::CIDR_ASSIGNMENT_FAILED, note).await;
            self.settled.locked().insert(settled_key(node));
            return Outcome::Success;
        }
        let recorded = node.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_POD_CIDRS_FROM_CLOUD));
        let record = cloud.join(",");
        if have.is_empty() || recorded != Some(&record) {
            let mut patch = serde_json::json!({
                "metadata": {
                    "resourceVersion": node.metadata.resource_version,
                    "annotations": { ANNOTATION_POD_CIDRS_FROM_CLOUD: record },
                },
            });
            if have.is_empty() {
                patch["spec"] = serde_json::json!({ "podCIDR": cloud.first(), "podCIDRs": cloud });
            }
            if let Err(error) = self.ctx.patch_node(&name, &patch).await {
                // A conflict (the Node changed) is read again from its next event.
                tracing::warn!(node = %name, %error, "setting the node's pod CIDRs from the cloud failed");
                let note = format!("Node {name} status is now: CIDRAssignmentFailed ({error})");
                self.ctx.event(NAME, node, EventType::Warning, reason::CIDR_ASSIGNMENT_FAILED, note).await;
                return Outcome::Retry { fingerprint: None, retry_after: None };
            }
            tracing::info!(node = %name, pod_cidrs = ?cloud, "pod CIDRs from the cloud set");
        }
        if routed && !network_available(node) {
            let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(crate::clock::now());
            let patch = serde_json::json!({ "status": { "conditions": [{
                "type": CONDITION_NETWORK_UNAVAILABLE, "status": "False", "reason": "RouteCreated",
                "message": "The cloud routes the pod CIDRs it gave the instance",
                "lastTransitionTime": now, "lastHeartbeatTime": now,
            }]}});
            if let Err(error) = self.ctx.patch_node_conditions(&name, &patch).await {
                tracing::warn!(node = %name, %error, "clearing NetworkUnavailable failed");
                return Outcome::Retry { fingerprint: None, retry_after: None };
            }
        }
        // Settled once the Node shows the CIDRs (its next event carries them, and the record).
        if !have.is_empty() {
            self.settled.locked().insert(settled_key(node));
        }
        Outcome::Success
    }
}

/// A Node as the cloud allocator settles it: its UID and podCIDRs.
fn settled_key(node: &Node) -> (String, Vec<String>) {
    (node.metadata.uid.clone().unwrap_or_default(), node_util::pod_cidrs(node))
}

/// Whether two lists name the same CIDRs (in any order, as canonical networks).
fn same_cidrs(a: &[String], b: &[String]) -> bool {
    let set = |l: &[String]| {
        l.iter().map(|c| c.parse::<IpNet>().map(|n| n.trunc().to_string()).unwrap_or_else(|_| c.clone())).collect::<BTreeSet<_>>()
    };
    set(a) == set(b)
}

/// Whether the Node's NetworkUnavailable condition is False already.
fn network_available(node: &Node) -> bool {
    let conditions = node.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions.into_iter().flatten().any(|c| c.type_ == CONDITION_NETWORK_UNAVAILABLE && c.status == "False")
}

impl runner::Controller for IpamController {
    type Key = String;
    const NAME: &'static str = NAME;
    const WATCHES: Watches = Watches { nodes: true, services: false, provider: false };

    fn ctx(&self) -> &Context {
        &self.ctx
    }

    /// Node IPAM writes only within the write budget; its queue adds no limit of its own.
    fn queue_config(&self) -> QueueConfig {
        let o = &self.ctx.options;
        QueueConfig { base_delay: o.reconcile_backoff_base, max_delay: o.reconcile_backoff_max, qps: 1e6, burst: 1_000_000 }
    }

    /// Every CIDR a Node has is taken, whoever set it, before any is given; the CIDRs of Nodes
    /// the (re-listed) cache no longer has are free; and the next allocation confirms them
    /// with a fresh read first.
    fn resync(&self, queue: &WorkQueue<String>) {
        let nodes = self.ctx.nodes.sorted();
        {
            let mut state = self.state();
            let names: HashSet<&str> = nodes.iter().map(|n| node_util::name(n)).collect();
            let gone: Vec<String> = state.held.keys().filter(|n| !names.contains(n.as_str())).cloned().collect();
            for name in gone {
                state.free(&name);
            }
            for node in &nodes {
                state.occupy(node);
            }
            state.confirmed = false;
        }
        self.publish();
        for node in &nodes {
            queue.add(node_util::name(node).to_string());
        }
    }

    fn on_node(&self, change: Option<Change<Node>>, queue: &WorkQueue<String>) {
        match change {
            Some(Change::Applied { new, .. }) => {
                self.state().occupy(&new);
                queue.add(node_util::name(&new).to_string());
            }
            Some(Change::Deleted(node)) => {
                let name = node_util::name(&node).to_string();
                queue.forget(&name);
                if self.cloud {
                    let uid = node.metadata.uid.clone().unwrap_or_default();
                    self.settled.locked().retain(|(u, _)| *u != uid);
                }
                let freed = {
                    let mut state = self.state();
                    // Only what this Node object held: one made again under its name since
                    // holds its own.
                    let same = state.held.get(&name).is_some_and(|h| Some(&h.uid) == node.metadata.uid.as_ref());
                    if same { state.free(&name) } else { Vec::new() }
                };
                // Nodes that waited for a free CIDR get it now.
                if !freed.is_empty() {
                    for waiting in self.ctx.nodes.sorted() {
                        queue.add(node_util::name(&waiting).to_string());
                    }
                }
            }
            None => self.resync(queue),
        }
        self.publish();
    }

    /// The cloud allocator reads 500 instances a call.
    fn batch(&self) -> usize {
        if self.cloud { ccm_protocol::limits::MAX_BATCH } else { 1 }
    }

    async fn reconcile(&self, keys: &[String]) -> Vec<Done> {
        if self.cloud {
            return self.allocate_from_cloud(keys).await;
        }
        if !self.state().confirmed
            && let Err(error) = self.confirm().await
        {
            tracing::warn!(%error, "reading the Nodes' pod CIDRs from the API server failed; no CIDR is given until it succeeds");
            return keys.iter().map(|_| Outcome::Retry { fingerprint: None, retry_after: None }.into()).collect();
        }
        let mut done = Vec::with_capacity(keys.len());
        for name in keys {
            // The newest Node: one changed since it was queued is judged as it is now.
            let settled = match self.ctx.nodes.store().get(&ObjectRef::new(name)) {
                Some(node) => self.allocate(&node).await,
                None => true,
            };
            // A refused write is retried from the Node's next change, as upstream's
            // allocator; one of unknown outcome after every Node was read again.
            done.push(if settled { Outcome::Success } else { Outcome::Retry { fingerprint: None, retry_after: None } }.into());
        }
        self.publish();
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().expect("cidr")
    }

    #[test]
    fn ranges_hand_out_each_node_cidr_once() {
        let mut r = Range::new(net("10.244.0.0/22"), 24).expect("range");
        r.occupy(&net("10.244.1.0/24"));
        let got: Vec<IpNet> = std::iter::from_fn(|| r.allocate()).collect();
        assert_eq!(got, vec![net("10.244.0.0/24"), net("10.244.2.0/24"), net("10.244.3.0/24")]);
        assert_eq!(r.allocate(), None, "full");
        r.release(&net("10.244.2.0/24"));
        assert_eq!(r.allocate(), Some(net("10.244.2.0/24")));
        assert!(!r.occupy(&net("10.245.0.0/24")), "not of this range");
        assert!(!r.occupy(&net("10.244.0.0/25")), "not of its size");
    }

    #[test]
    fn ipv6_ranges_and_bad_masks() {
        let mut r = Range::new(net("fd00:10::/48"), 64).expect("range");
        assert_eq!(r.allocate(), Some(net("fd00:10::/64")));
        assert_eq!(r.allocate(), Some(net("fd00:10:0:1::/64")));
        assert!(Range::new(net("10.0.0.0/16"), 8).is_err(), "a mask wider than the cluster CIDR");
        assert!(Range::new(net("fd00::/8"), 64).is_err(), "too many node CIDRs");
        let mut small = Range::new(net("10.0.0.0/31"), 32).expect("range");
        assert_eq!(small.allocate(), Some(net("10.0.0.0/32")));
        assert_eq!(small.allocate(), Some(net("10.0.0.1/32")));
    }

    fn node(name: &str, uid: &str, cidrs: &[&str]) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some(name.to_string());
        n.metadata.uid = Some(uid.to_string());
        if !cidrs.is_empty() {
            n.spec = Some(k8s_openapi::api::core::v1::NodeSpec {
                pod_cidrs: Some(cidrs.iter().map(|c| c.to_string()).collect()),
                pod_cidr: Some(cidrs[0].to_string()),
                ..Default::default()
            });
        }
        n
    }

    fn state() -> State {
        let ranges = vec![Range::new(net("10.244.0.0/22"), 24).expect("range")];
        State { ranges, held: HashMap::new(), holders: HashMap::new(), confirmed: false, pending: Vec::new() }
    }

    #[test]
    fn a_node_made_again_under_its_name_frees_what_the_old_one_held() {
        let mut s = state();
        s.occupy(&node("a", "uid-1", &["10.244.0.0/24"]));
        assert_eq!(s.take(), Ok(vec![net("10.244.1.0/24")]), "the held CIDR is not given");
        // The same Node again changes nothing; another Node object of its name without CIDRs
        // means the first is gone.
        s.occupy(&node("a", "uid-1", &["10.244.0.0/24"]));
        s.occupy(&node("a", "uid-2", &[]));
        assert!(!s.held.contains_key("a"));
        assert_eq!(s.take(), Ok(vec![net("10.244.2.0/24")]));
        assert_eq!(s.take(), Ok(vec![net("10.244.3.0/24")]));
        assert_eq!(s.take(), Ok(vec![net("10.244.0.0/24")]), "the old Node's CIDR was freed");
    }

    #[test]
    fn a_cidr_two_nodes_hold_is_free_only_when_both_are_gone() {
        let mut s = state();
        s.occupy(&node("a", "uid-a", &["10.244.0.0/24"]));
        s.occupy(&node("b", "uid-b", &["10.244.0.0/24"]));
        assert_eq!(s.free("a"), Vec::<IpNet>::new(), "b still holds it");
        assert_eq!(s.take(), Ok(vec![net("10.244.1.0/24")]));
        assert_eq!(s.free("b"), vec![net("10.244.0.0/24")]);
        assert_eq!(s.free("b"), Vec::<IpNet>::new(), "freed once");
        assert_eq!(s.take(), Ok(vec![net("10.244.2.0/24")]));
        assert_eq!(s.take(), Ok(vec![net("10.244.3.0/24")]));
        assert_eq!(s.take(), Ok(vec![net("10.244.0.0/24")]));
        assert_eq!(s.take(), Err(net("10.244.0.0/22")), "full");
    }

    #[test]
    fn cidrs_of_a_write_of_unknown_outcome_are_given_again_only_when_no_node_holds_them() {
        let ranges = vec![Range::new(net("10.244.0.0/23"), 24).expect("range")];
        let mut state = State { ranges, held: HashMap::new(), holders: HashMap::new(), confirmed: false, pending: Vec::new() };
        let landed = state.take().expect("a CIDR");
        let lost = state.take().expect("a CIDR");
        state.pending.extend(landed.iter().chain(&lost).copied());
        state.confirmed = false;
        assert!(state.take().is_err(), "nothing pending is handed out before the Nodes are read again");
        // The fresh read shows the first write landed, the second not.
        let landed_text = landed[0].to_string();
        state.confirm_with(&[node("a", "uid-a", &[landed_text.as_str()])]);
        assert!(state.confirmed && state.pending.is_empty());
        assert_eq!(state.take().expect("a CIDR"), lost, "the CIDR no Node holds is free again");
        assert!(state.take().is_err(), "the one a Node holds is not");
    }

    #[test]
    fn cidrs_held_twice_by_one_node_are_counted_once() {
        let mut s = state();
        let given = s.take().expect("a CIDR");
        // The watch shows the CIDRs before the patch's answer records them.
        s.occupy(&node("a", "uid-a", &["10.244.0.0/24"]));
        s.hold("a", "uid-a", given.clone());
        assert_eq!(s.free("a"), given, "freed when its Node goes");
    }
}
