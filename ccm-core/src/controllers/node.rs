//! The node controller (`cloud-node-controller`): initialises Nodes that carry the
//! `uninitialized` taint from the provider's facts, then removes the taint; and refreshes the
//! addresses of initialised Nodes periodically with batched reads.
//!
//! - One initialisation per Node in flight: keys are de-duplicated by the queue, and a Node
//!   this controller just initialised is not initialised again while the cache still shows
//!   the version from before its own write.
//! - Concurrent initialisations share one BatchInstanceMetadata (and one
//!   BatchGetInstanceTags) call when the provider advertises batch reads: each worker takes
//!   every ready key at once.
//! - Two writes per Node: its status (addresses), then labels, providerID and taints together,
//!   guarded by the resourceVersion read.
//! - Trust, but verify: a Node that registered with metadata from the node plugin (providerID
//!   and zone, region and instance type labels set by its kubelet) is initialised from the
//!   same batch read as any other; a claimed zone, region or instance type that differs from
//!   the cloud's answer is corrected and recorded as a `NodeMetadataCorrected` Event.

use ccm_protocol::lock::Lock;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ccm_protocol::Error;
use ccm_protocol::labels::{valid_label_key, valid_label_value};
use ccm_protocol::limits::MAX_BATCH;
use futures::future::join_all;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::runtime::reflector::ObjectRef;
use tokio_util::sync::CancellationToken;

use super::runner::{self, Done, Watches};
use super::{Context, sleep_or_stop};
use super::{node_addresses, tag_labels};
use crate::events::{EventType, reason};
use crate::informer::Change;
use crate::labels;
use crate::node_util;
use crate::provider::PerLookup;
use crate::provider::convert::{Instance, InstanceLookups};
use crate::queue::{Outcome, WorkQueue};
use crate::wellknown::{self, ANNOTATION_TAG_LABELS, TAINT_UNINITIALIZED};

/// The controller's name, in Events, metrics and logs.
pub const NAME: &str = "cloud-node-controller";

/// Whether a Node waits for initialisation by this controller.
pub fn needs_init(ctx: &Context, node: &Node) -> bool {
    node_util::has_taint(node, TAINT_UNINITIALIZED) && !ctx.ignores(node) && node.metadata.deletion_timestamp.is_none()
}

/// Whether an initialised Node lacks GA topology labels whose beta counterparts it carries.
fn needs_labels(ctx: &Context, node: &Node) -> bool {
    !node_util::has_taint(node, TAINT_UNINITIALIZED)
        && node.metadata.deletion_timestamp.is_none()
        && !ctx.ignores(node)
        && !node_addresses::missing_ga_labels(node).is_empty()
}

/// What initialisation acts on; a change of it retries a failing Node at once.
fn fingerprint(node: &Node) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    node_util::provider_id(node).hash(&mut h);
    node.metadata.annotations.as_ref().and_then(|a| a.get(wellknown::ANNOTATION_PROVIDED_NODE_IP)).hash(&mut h);
    node_util::has_taint(node, TAINT_UNINITIALIZED).hash(&mut h);
    h.finish()
}

fn resource_version(node: &Node) -> u64 {
    node.metadata.resource_version.as_deref().and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// The node controller.
pub struct NodeController {
    ctx: Context,
    /// Nodes this controller initialised, with the resourceVersion its write produced: until
    /// the cache shows that version, the cached Node is stale and must not be initialised again.
    written: Mutex<HashMap<String, u64>>,
    /// The provider's connections as last seen.
    connected: std::sync::atomic::AtomicU64,
}

impl NodeController {
    /// A controller over `ctx`.
    pub fn new(ctx: Context) -> Self {
        let connected = std::sync::atomic::AtomicU64::new(ctx.provider.changes().borrow().connected);
        Self { ctx, written: Default::default(), connected }
    }

    /// Runs until `stop`: the event feed, the workers and the periodic address refresh.
    pub async fn run(self, stop: CancellationToken) {
        runner::run(self, stop).await;
    }

    fn enqueue(&self, node: &Node, queue: &WorkQueue<String>) {
        if needs_init(&self.ctx, node) || needs_labels(&self.ctx, node) {
            queue.add_changed(node_util::name(node).to_string(), fingerprint(node));
        }
    }

    /// Initialises the Nodes named `keys`; one outcome per key.
    async fn initialise(&self, keys: &[String]) -> Vec<Outcome> {
        // A fault hook for the supervision test only: a reconcile that panics.
        // A test hook of debug builds only (the e2e suite's supervision test): the release
        // binary the images ship has none.
        #[cfg(debug_assertions)]
        if std::env::var_os("CCM_TEST_PANIC_IN_RECONCILE").is_some() {
            panic!("CCM_TEST_PANIC_IN_RECONCILE is set: a reconcile panics");
        }
        let mut outcomes = vec![Outcome::Success; keys.len()];
        // Read the newest Node from the cache, never a copy from before a failure.
        let mut todo: Vec<(usize, Arc<Node>)> = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let Some(node) = self.ctx.nodes.store().get(&ObjectRef::new(key)) else { continue };
            if needs_labels(&self.ctx, &node) {
                outcomes[i] = self.add_ga_labels(&node).await;
                continue;
            }
            if !needs_init(&self.ctx, &node) {
                continue;
            }
            let stale = self.written.locked().get(key).is_some_and(|rv| resource_version(&node) < *rv);
            if stale {
                continue;
            }
            todo.push((i, node));
        }
        if todo.is_empty() {
            return outcomes;
        }
        if self.ctx.provider.identity().is_none() {
            for (i, node) in &todo {
                outcomes[*i] = Outcome::Retry { fingerprint: Some(fingerprint(node)), retry_after: None };
            }
            tracing::info!(nodes = todo.len(), "provider not ready; node initialisation waits");
            return outcomes;
        }
        let lookups = InstanceLookups::of(todo.iter().map(|(_, n)| n.as_ref()));
        let metadata = self.ctx.provider.instance_metadata(&lookups).await;
        let tags = match self.tag_source() {
            Some(source) => Some(self.tags_of(source, &lookups, &metadata).await),
            None => None,
        };
        let results = join_all(todo.iter().zip(metadata).enumerate().map(|(j, ((_, node), meta))| {
            let tags = tags.as_ref().map(|t| t[j].clone());
            self.initialise_one(node.clone(), meta, tags)
        }))
        .await;
        for ((i, _), outcome) in todo.iter().zip(results) {
            outcomes[*i] = outcome;
        }
        outcomes
    }

    /// Adds the GA topology labels an initialised Node lacks from their beta counterparts, as
    /// upstream does for Nodes of older kubelets and images. No provider call.
    async fn add_ga_labels(&self, node: &Node) -> Outcome {
        let name = node_util::name(node);
        let labels = node_addresses::missing_ga_labels(node);
        let patch = serde_json::json!({ "metadata": { "labels": labels } });
        match self.ctx.patch_node(name, &patch).await {
            Ok(_) => {
                tracing::info!(node = %name, labels = ?labels, "GA topology labels added from their beta counterparts");
                Outcome::Success
            }
            Err(error) => {
                tracing::warn!(node = %name, %error, "adding GA topology labels failed");
                Outcome::Retry { fingerprint: Some(fingerprint(node)), retry_after: None }
            }
        }
    }

    async fn initialise_one(
        &self,
        node: Arc<Node>,
        meta: Result<Option<Instance>, Error>,
        tags: Option<Result<BTreeMap<String, String>, Error>>,
    ) -> Outcome {
        let name = node_util::name(&node).to_string();
        let retry = |error: &Error| Outcome::Retry { fingerprint: Some(fingerprint(&node)), retry_after: error.retry_after() };
        let meta = match meta {
            Ok(Some(m)) => m,
            Ok(None) => {
                // Not (yet) an instance the cloud knows: keep the taint and look again later;
                // the lifecycle controller decides about deleting it.
                tracing::info!(node = %name, "no instance found for node; will retry");
                return Outcome::Retry { fingerprint: Some(fingerprint(&node)), retry_after: None };
            }
            Err(error) => {
                tracing::warn!(node = %name, provider = %self.ctx.provider.name(), %error, "instance lookup failed");
                self.ctx.report_invalid(NAME, node.as_ref(), &error).await;
                return retry(&error);
            }
        };
        match self.apply(&node, &meta, tags).await {
            Ok(rv) => {
                self.written.locked().insert(name.clone(), rv);
                tracing::info!(node = %name, provider_id = %meta.provider_id, "node initialised");
                if let Some(created) = node.metadata.creation_timestamp.as_ref() {
                    let since = crate::clock::now().duration_since(created.0);
                    self.ctx.metrics.node_initialised(Duration::try_from(since).unwrap_or_default());
                }
                self.ctx.event(NAME, node.as_ref(), EventType::Normal, reason::SYNCED, "Node synced successfully".into()).await;
                Outcome::Success
            }
            Err(InitError::Invalid(why)) => {
                tracing::warn!(node = %name, %why, "node cannot be initialised");
                self.ctx.event(NAME, node.as_ref(), EventType::Warning, reason::NODE_INITIALIZATION_FAILED, why).await;
                Outcome::Retry { fingerprint: Some(fingerprint(&node)), retry_after: None }
            }
            Err(InitError::Provider(error)) => {
                tracing::warn!(node = %name, %error, "reading the instance's tags failed");
                retry(&error)
            }
            Err(InitError::Kube(error)) => {
                tracing::warn!(node = %name, %error, "writing the node failed");
                Outcome::Retry { fingerprint: Some(fingerprint(&node)), retry_after: None }
            }
        }
    }

    /// Writes what the cloud says onto the Node: status first, then labels, providerID and
    /// taints in one patch. Returns the resourceVersion of the last write.
    async fn apply(
        &self,
        node: &Node,
        meta: &Instance,
        tags: Option<Result<BTreeMap<String, String>, Error>>,
    ) -> Result<u64, InitError> {
        let name = node_util::name(node);
        let addresses = node_addresses::desired_addresses(node, &meta.addresses).map_err(InitError::Invalid)?;
        if node_util::provider_id(node).is_none() && meta.provider_id.is_empty() {
            return Err(InitError::Invalid(format!(
                "the provider found the instance of node {name} but reported no providerID for it"
            )));
        }
        // Zone, region and instance type are the cloud's: what a Node claims for them (a
        // kubelet that set them from the node's metadata) is verified against the cloud's
        // answer and corrected. Other labels are only added where the Node has none.
        let mut labels = Labels::default();
        for (key, value) in [
            (wellknown::LABEL_ZONE, &meta.zone),
            (wellknown::LABEL_REGION, &meta.region),
            (wellknown::LABEL_INSTANCE_TYPE, &meta.instance_type),
        ] {
            if !value.is_empty() {
                labels.owned.insert(key.to_string(), value.clone());
            }
        }
        // GA labels from the beta ones a Node of an older kubelet carries, where the cloud
        // said nothing of its own.
        labels.offered.extend(node_addresses::missing_ga_labels(node));
        // With several providers, the Node records whose it is (the lookups' finding, kept).
        if self.ctx.providers.several() {
            labels.offered.insert(wellknown::LABEL_PROVIDER.to_string(), self.ctx.provider.name().to_string());
        }
        for (k, v) in &meta.additional_labels {
            if !labels::reserved_label_domain(k) && valid_label_key(k) && valid_label_value(v) {
                labels.offered.insert(k.clone(), v.clone());
            }
        }
        let mut skipped = Vec::new();
        match tags {
            Some(Ok(tags)) => {
                let (from_tags, invalid) = tag_labels::labels_of(&self.ctx.options.node_tag_label_prefix, tags);
                skipped = invalid;
                labels.from_tags.extend(from_tags.keys().cloned());
                labels.offered.extend(from_tags);
            }
            Some(Err(error)) => return Err(InitError::Provider(error)),
            None => {}
        }

        // Two writes, each guarded by the resourceVersion it builds on. A conflict (someone
        // else wrote the Node meanwhile) re-reads the Node and tries again with the same cloud
        // answer: no second provider call.
        let mut node = node.clone();
        let mut attempt = 0;
        let (written, corrected) = loop {
            attempt += 1;
            match self.write(&node, &addresses, &labels, &meta.provider_id).await {
                Ok(written) => break written,
                Err(kube::Error::Api(s)) if s.code == 409 && attempt < 5 => {
                    node = Api::<Node>::all(self.ctx.client.clone()).get(name).await.map_err(InitError::Kube)?;
                    if !node_util::has_taint(&node, TAINT_UNINITIALIZED) {
                        return Ok(resource_version(&node));
                    }
                }
                Err(e) => return Err(InitError::Kube(e)),
            }
        };
        if !corrected.is_empty() {
            let note = format!("the Node's claims differ from the cloud's; corrected: {}", corrected.join("; "));
            tracing::warn!(node = %name, corrections = %corrected.join("; "), "node metadata corrected from the cloud");
            self.ctx.event(NAME, &node, EventType::Warning, reason::NODE_METADATA_CORRECTED, note).await;
        }
        if !skipped.is_empty() {
            let note = format!("instance tags that are not valid label keys or values were not copied: {}", skipped.join(", "));
            self.ctx.event(NAME, &node, EventType::Warning, reason::INVALID_INSTANCE_TAGS, note).await;
        }
        Ok(written.parse().unwrap_or(0))
    }

    /// The status write (only when addresses change), then labels, providerID and taints.
    /// Returns the resourceVersion written and the corrections made to what it claimed.
    async fn write(
        &self,
        node: &Node,
        addresses: &[k8s_openapi::api::core::v1::NodeAddress],
        labels: &Labels,
        provider_id: &str,
    ) -> Result<(String, Vec<String>), kube::Error> {
        let name = node_util::name(node);
        let mut version = node.metadata.resource_version.clone();
        // An instance without addresses (yet) keeps what its kubelet reported, as upstream.
        if !addresses.is_empty() && !node_addresses::same_addresses(&node_util::addresses(node), addresses) {
            let patch = serde_json::json!({ "metadata": { "resourceVersion": version }, "status": { "addresses": addresses } });
            version = Some(self.ctx.patch_node_status(name, &patch).await?);
        }
        let (changes, corrected) = labels.patch(node);
        let mut spec = serde_json::json!({ "taints": node_util::taints_without(node, TAINT_UNINITIALIZED) });
        if node_util::provider_id(node).is_none() {
            spec["providerID"] = serde_json::Value::String(provider_id.to_string());
        }
        let mut patch = serde_json::json!({ "metadata": { "labels": changes, "resourceVersion": version }, "spec": spec });
        // The labels made from tags are recorded as ours: only those follow the tags later.
        let from_tags: BTreeSet<&String> = changes.keys().filter(|k| labels.from_tags.contains(*k)).collect();
        if !from_tags.is_empty() {
            let owned = tag_labels::owned(node).into_iter().chain(from_tags.into_iter().cloned()).collect();
            patch["metadata"]["annotations"] = serde_json::json!({ ANNOTATION_TAG_LABELS: tag_labels::record(&owned) });
        }
        Ok((self.ctx.patch_node(name, &patch).await?, corrected))
    }

    /// With several providers: takes the Nodes the name lookups found to be its provider's.
    async fn found_loop(self: Arc<Self>, queue: Arc<WorkQueue<String>>, stop: CancellationToken) {
        use tokio::sync::broadcast::error::RecvError;
        let mut found = self.ctx.providers.announcements();
        let own = self.ctx.providers.all().iter().position(|p| p.name() == self.ctx.provider.name());
        loop {
            let next = tokio::select! {
                next = found.recv() => next,
                _ = stop.cancelled() => return,
            };
            match next {
                Ok((index, names)) if Some(index) == own => {
                    for name in names.iter() {
                        if let Some(node) = self.ctx.nodes.store().get(&ObjectRef::new(name)) {
                            self.enqueue(&node, &queue);
                        }
                    }
                }
                Ok(_) => {}
                Err(RecvError::Lagged(_)) => runner::Controller::resync(self.as_ref(), &queue),
                Err(RecvError::Closed) => return std::future::pending().await,
            }
        }
    }

    async fn refresh_loop(self: Arc<Self>, stop: CancellationToken) {
        self.ctx.nodes.wait_synced().await;
        while sleep_or_stop(self.ctx.options.node_status_update_frequency, &stop).await {
            match self.refresh().await {
                Ok((0, 0)) => {}
                Ok((addresses, labels)) => tracing::info!(addresses, labels, "nodes refreshed from the cloud"),
                Err(error) => tracing::warn!(%error, "node refresh failed"),
            }
        }
    }

    /// Where instance tags come from, when they become labels (the provider serves Tags and
    /// a prefix is set): the metadata answers, when the provider puts them there
    /// (`metadata_tags`), or TagsService.
    fn tag_source(&self) -> Option<TagSource> {
        let identity = self.ctx.provider.identity()?;
        if !identity.serves_tags() || self.ctx.options.node_tag_label_prefix.is_empty() {
            return None;
        }
        Some(if identity.metadata_tags() { TagSource::Metadata } else { TagSource::Tags })
    }

    /// Each lookup's tags: from `metadata` (its answers to the same lookups) or read.
    async fn tags_of(
        &self,
        source: TagSource,
        lookups: &InstanceLookups,
        metadata: &PerLookup<Option<Instance>>,
    ) -> PerLookup<BTreeMap<String, String>> {
        match source {
            TagSource::Tags => self.ctx.provider.instance_tags(lookups).await,
            TagSource::Metadata => metadata
                .iter()
                .map(|m| match m {
                    Ok(Some(m)) => Ok(m.tags.clone()),
                    Ok(None) => Err(Error::not_found("the instance does not exist")),
                    Err(e) => Err(e.clone()),
                })
                .collect(),
        }
    }

    /// The initialised Nodes the periodic refresh looks at, and their lookups.
    fn initialised_nodes(&self) -> (Vec<Arc<Node>>, InstanceLookups) {
        let nodes: Vec<Arc<Node>> = self
            .ctx
            .managed_nodes()
            .filter(|n| node_util::provider_id(n).is_some() && !node_util::has_taint(n, TAINT_UNINITIALIZED))
            .collect();
        let lookups = InstanceLookups::of(nodes.iter().map(|n| n.as_ref()));
        (nodes, lookups)
    }

    /// Refreshes every initialised Node from the cloud, one batch read per 500 Nodes (and one
    /// BatchGetInstanceTags per 500 unless the metadata carries the tags): its addresses, and
    /// its tag labels (see [`NodeController::sync_tag_labels`]). Returns how many Nodes' addresses and labels were
    /// written.
    pub async fn refresh(&self) -> Result<(usize, usize), kube::Error> {
        if self.ctx.provider.identity().is_none() {
            return Ok((0, 0));
        }
        let (nodes, lookups) = self.initialised_nodes();
        let metadata = self.ctx.provider.instance_metadata(&lookups).await;
        let addresses = self.refresh_addresses(&nodes, &metadata).await?;
        let labels = match self.tag_source() {
            Some(source) => self.sync_tag_labels(&nodes, self.tags_of(source, &lookups, &metadata).await).await?,
            None => 0,
        };
        Ok((addresses, labels))
    }

    /// Brings the Nodes' tag labels to their instances' tags (`tags`, one answer per Node):
    /// the labels this controller owns follow their tags, a new tag's label is added where
    /// the Node has none of that key; a user's label is never touched. A Node whose tags could
    /// not be read is left as it is. Returns the Nodes written.
    async fn sync_tag_labels(
        &self,
        nodes: &[Arc<Node>],
        tags: PerLookup<BTreeMap<String, String>>,
    ) -> Result<usize, kube::Error> {
        let mut written = 0;
        for (node, answer) in nodes.iter().zip(tags) {
            let name = node_util::name(node);
            let tags = match answer {
                Ok(tags) => tags,
                Err(error) => {
                    tracing::debug!(node = %name, %error, "reading the instance's tags failed; its labels stay");
                    self.ctx.report_invalid(NAME, node.as_ref(), &error).await;
                    continue;
                }
            };
            let (desired, _) = tag_labels::labels_of(&self.ctx.options.node_tag_label_prefix, tags);
            let Some(change) = tag_labels::sync(node, &desired) else { continue };
            // Guarded by the version read: a label a user set meanwhile is never overwritten.
            let patch = serde_json::json!({ "metadata": {
                "resourceVersion": node.metadata.resource_version,
                "labels": change.labels,
                "annotations": { ANNOTATION_TAG_LABELS: (!change.owned.is_empty()).then(|| tag_labels::record(&change.owned)) },
            }});
            match self.ctx.patch_node(name, &patch).await {
                Ok(_) => {
                    tracing::info!(node = %name, labels = ?change.labels, "tag labels follow the instance's tags");
                    written += 1;
                }
                // Changed meanwhile: the next period looks again.
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(error) => return Err(error),
            }
        }
        Ok(written)
    }

    /// Writes the Nodes' addresses from `metadata` (one answer per Node), a status patch only
    /// where something changed. Returns the Nodes written.
    async fn refresh_addresses(&self, nodes: &[Arc<Node>], metadata: &PerLookup<Option<Instance>>) -> Result<usize, kube::Error> {
        let mut patched = 0;
        for (node, result) in nodes.iter().zip(metadata) {
            let meta = match result {
                Ok(Some(meta)) => meta,
                Ok(None) => continue,
                Err(error) => {
                    self.ctx.report_invalid(NAME, node.as_ref(), error).await;
                    continue;
                }
            };
            let Ok(addresses) = node_addresses::desired_addresses(node, &meta.addresses) else { continue };
            if addresses.is_empty() || node_addresses::same_addresses(&node_util::addresses(node), &addresses) {
                continue;
            }
            let patch = serde_json::json!({ "status": { "addresses": addresses } });
            self.ctx.patch_node_status(node_util::name(node), &patch).await?;
            patched += 1;
        }
        Ok(patched)
    }
}

impl runner::Controller for NodeController {
    type Key = String;
    const NAME: &'static str = NAME;
    const WATCHES: Watches = Watches { nodes: true, services: false, provider: true };

    fn ctx(&self) -> &Context {
        &self.ctx
    }

    fn workers(&self) -> usize {
        self.ctx.options.concurrent_node_syncs
    }

    /// Connected: the Nodes of its providerID schemes are known to be its own now.
    fn on_provider(&self, now: crate::provider::Changes, queue: &WorkQueue<String>) {
        if self.connected.swap(now.connected, std::sync::atomic::Ordering::AcqRel) != now.connected {
            self.resync(queue);
        }
    }

    /// Concurrent initialisations share one batch read.
    fn batch(&self) -> usize {
        MAX_BATCH
    }

    fn resync(&self, queue: &WorkQueue<String>) {
        for node in self.ctx.nodes.sorted() {
            self.enqueue(&node, queue);
        }
    }

    fn on_node(&self, change: Option<Change<Node>>, queue: &WorkQueue<String>) {
        match change {
            Some(Change::Applied { new, .. }) => self.enqueue(&new, queue),
            Some(Change::Deleted(node)) => {
                let name = node_util::name(&node).to_string();
                queue.forget(&name);
                self.written.locked().remove(&name);
            }
            None => self.resync(queue),
        }
    }

    async fn reconcile(&self, keys: &[String]) -> Vec<Done> {
        self.initialise(keys).await.into_iter().map(Done::from).collect()
    }

    fn spawn(self: &Arc<Self>, queue: &Arc<WorkQueue<String>>, stop: &CancellationToken, tasks: &mut super::Tasks) {
        tasks.spawn(self.clone().refresh_loop(stop.clone()));
        if self.ctx.providers.several() {
            tasks.spawn(self.clone().found_loop(queue.clone(), stop.clone()));
        }
    }
}

/// Where instance tags are read from.
#[derive(Debug, Clone, Copy)]
enum TagSource {
    /// The instance metadata answers (`InstancesCapabilities.metadata_tags`).
    Metadata,
    /// TagsService.
    Tags,
}

/// The labels initialisation sets: the cloud's own (corrected when a Node claims otherwise)
/// and offered ones (added only where the Node has none).
#[derive(Debug, Default)]
struct Labels {
    owned: BTreeMap<String, String>,
    offered: BTreeMap<String, String>,
    /// Which offered labels are made from instance tags.
    from_tags: BTreeSet<String>,
}

impl Labels {
    /// The label changes for `node`, and a description of each claim corrected.
    fn patch(&self, node: &Node) -> (BTreeMap<String, String>, Vec<String>) {
        let current = node.metadata.labels.clone().unwrap_or_default();
        let mut changes = BTreeMap::new();
        let mut corrected = Vec::new();
        for (k, v) in &self.owned {
            match current.get(k) {
                Some(claimed) if claimed == v => {}
                Some(claimed) => {
                    corrected.push(format!("{k} was {claimed:?}, the cloud says {v:?}"));
                    changes.insert(k.clone(), v.clone());
                }
                None => {
                    changes.insert(k.clone(), v.clone());
                }
            }
        }
        for (k, v) in &self.offered {
            if !current.contains_key(k) && !self.owned.contains_key(k) {
                changes.insert(k.clone(), v.clone());
            }
        }
        (changes, corrected)
    }
}

#[derive(Debug)]
enum InitError {
    Invalid(String),
    Provider(Error),
    Kube(kube::Error),
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn node(labels: &[(&str, &str)]) -> Node {
        let labels = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Node { metadata: ObjectMeta { name: Some("n".into()), labels: Some(labels), ..Default::default() }, ..Default::default() }
    }

    #[test]
    fn cloud_owned_labels_are_corrected_and_others_only_added() {
        let mut labels = Labels::default();
        labels.owned.insert(wellknown::LABEL_ZONE.into(), "zone-b".into());
        labels.owned.insert(wellknown::LABEL_REGION.into(), "region".into());
        labels.offered.insert("tags.cloudprovider.dev/team".into(), "payments".into());
        labels.offered.insert("tags.cloudprovider.dev/owner".into(), "cloud".into());

        let claimed = node(&[
            (wellknown::LABEL_ZONE, "zone-a"),
            (wellknown::LABEL_REGION, "region"),
            ("tags.cloudprovider.dev/owner", "me"),
        ]);
        let (changes, corrected) = labels.patch(&claimed);
        assert_eq!(
            changes,
            BTreeMap::from([
                (wellknown::LABEL_ZONE.to_string(), "zone-b".to_string()),
                ("tags.cloudprovider.dev/team".to_string(), "payments".to_string()),
            ]),
            "the wrong zone is corrected, the right region and the user's label left alone"
        );
        assert_eq!(corrected, vec!["topology.kubernetes.io/zone was \"zone-a\", the cloud says \"zone-b\"".to_string()]);

        let (changes, corrected) = labels.patch(&node(&[]));
        assert_eq!(changes.len(), 4);
        assert!(corrected.is_empty(), "adding a missing label is not a correction");
    }
}
