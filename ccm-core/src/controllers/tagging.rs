//! The tagging controller (`tagging-controller`, `tagging` in `--controllers`): writes the
//! cluster's tags (`--instance-tags`) and allow-listed Node labels
//! (`--instance-tags-from-labels`) to each Node's instance with BatchSetInstanceTags, one call
//! per 500 Nodes, as AWS's tagging controller does for billing and ownership, for every cloud
//! whose provider writes tags (`TagsCapabilities.set_tags`).
//!
//! It owns only the keys it wrote, recorded on the Node in `ccm-rs.dev/instance-tags` (as the
//! node controller records the labels it makes from tags):
//! - a key the instance lacks is added, and recorded before it is written (a crash between
//!   the two leaves a key recorded that the next pass writes or removes, never a tag nobody
//!   knows is ours);
//! - a recorded key is updated when its value changes, and removed when the flag (or label)
//!   drops it, then unrecorded;
//! - a key the instance has with another value that is not recorded is someone else's: left
//!   alone, with a Warning Event `InstanceTagConflict` (once per Node and key per process);
//!   one it has with the same value stays theirs.
//!
//! Event-driven: a Node is looked at when it gets its providerID, when an allow-listed label
//! or the record changes, and at start (one BatchGetInstanceTags per 500 Nodes to see what the
//! instances have). Steady state makes no call.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use ccm_protocol::lock::Lock;
use k8s_openapi::api::core::v1::Node;
use kube::runtime::reflector::ObjectRef;
use tokio_util::sync::CancellationToken;

use super::runner::{self, Done, Watches};
use super::{ConfigError, Context};
use crate::events::{EventType, reason};
use crate::informer::Change;
use crate::node_util;
use crate::provider::TagChange;
use crate::provider::convert::InstanceLookups;
use crate::queue::{Outcome, QueueConfig, WorkQueue};
use crate::wellknown::ANNOTATION_INSTANCE_TAGS;

/// The controller's name.
pub const NAME: &str = "tagging-controller";

/// The tagging controller.
pub struct TaggingController {
    ctx: Context,
    /// `--instance-tags`.
    tags: BTreeMap<String, String>,
    /// `--instance-tags-from-labels`.
    from_labels: BTreeSet<String>,
    /// (Node UID, key) conflicts reported.
    reported: Mutex<HashSet<(String, String)>>,
    /// Whether a provider that writes no tags was reported.
    unsupported: AtomicBool,
}

/// The keys of the Node's instance tags the controller wrote, as recorded on it.
pub fn owned(node: &Node) -> BTreeSet<String> {
    let record = node.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_INSTANCE_TAGS));
    record.into_iter().flat_map(|r| r.split(',')).map(str::trim).filter(|k| !k.is_empty()).map(str::to_string).collect()
}

/// What one pass does to one instance: the change to write, the keys recorded before it is
/// written and after it succeeded, and the keys someone else has with another value.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// What to write.
    pub change: TagChange,
    /// The record while writing: what was recorded, and every key about to be set.
    pub claim: BTreeSet<String>,
    /// The record once written: the claim without the keys removed.
    pub after: BTreeSet<String>,
    /// Keys the instance has with another value that are not ours.
    pub conflicts: Vec<String>,
}

/// The plan that brings an instance with `current` tags, of which the controller owns
/// `owned`, to `desired`.
pub fn plan(desired: &BTreeMap<String, String>, current: &BTreeMap<String, String>, owned: &BTreeSet<String>) -> Plan {
    let mut p = Plan::default();
    for (k, v) in desired {
        match current.get(k) {
            Some(have) if have == v => {}
            Some(_) if !owned.contains(k) => p.conflicts.push(k.clone()),
            _ => {
                p.change.set.insert(k.clone(), v.clone());
            }
        }
    }
    p.change.remove = owned.iter().filter(|k| !desired.contains_key(*k)).cloned().collect();
    p.claim = owned.iter().cloned().chain(p.change.set.keys().cloned()).collect();
    p.after = p.claim.iter().filter(|k| !p.change.remove.contains(k)).cloned().collect();
    p
}

impl TaggingController {
    /// A controller over `ctx`; fails on tags given two values.
    pub fn new(ctx: Context) -> Result<Self, ConfigError> {
        let tags = ctx.options.instance_tags().map_err(ConfigError::Mismatch)?;
        let from_labels =
            ctx.options.instance_tags_from_labels.iter().map(|l| l.trim().to_string()).filter(|l| !l.is_empty()).collect();
        Ok(Self { ctx, tags, from_labels, reported: Default::default(), unsupported: AtomicBool::new(false) })
    }

    /// Runs until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        if self.tags.is_empty() && self.from_labels.is_empty() {
            tracing::info!("the tagging controller has no tags to write (--instance-tags, --instance-tags-from-labels)");
            stop.cancelled().await;
            return;
        }
        runner::run(self, stop).await;
    }

    /// The tags `node`'s instance should have.
    fn desired(&self, node: &Node) -> BTreeMap<String, String> {
        let mut desired = self.tags.clone();
        let labels = node.metadata.labels.iter().flatten();
        desired.extend(labels.filter(|(k, _)| self.from_labels.contains(*k)).map(|(k, v)| (k.clone(), v.clone())));
        desired
    }

    /// What of a Node the controller acts on.
    fn fingerprint(&self, node: &Node) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        node_util::provider_id(node).hash(&mut h);
        self.desired(node).hash(&mut h);
        owned(node).hash(&mut h);
        node.metadata.deletion_timestamp.is_some().hash(&mut h);
        h.finish()
    }

    /// Whether `node` is one to tag now.
    fn wanted(&self, node: &Node) -> bool {
        node_util::provider_id(node).is_some() && node.metadata.deletion_timestamp.is_none() && !self.ctx.ignores(node)
    }

    /// Writes the record `keys` on `node`.
    async fn record(&self, node: &Node, keys: &BTreeSet<String>) -> Result<(), kube::Error> {
        let value =
            if keys.is_empty() { serde_json::Value::Null } else { keys.iter().cloned().collect::<Vec<_>>().join(",").into() };
        let patch = serde_json::json!({ "metadata": { "annotations": { ANNOTATION_INSTANCE_TAGS: value } } });
        self.ctx.patch_node(node_util::name(node), &patch).await.map(|_| ())
    }

    /// One pass over `keys` (Node names): their instances' tags read, the plans recorded,
    /// written in one call, and the records finished.
    async fn tag(&self, keys: &[String]) -> Vec<Done> {
        let mut done: Vec<Done> = keys.iter().map(|_| Outcome::Success.into()).collect();
        let retry = || Outcome::Retry { fingerprint: None, retry_after: None };
        let Some(identity) = self.ctx.provider.identity() else {
            return keys.iter().map(|_| retry().into()).collect();
        };
        if !identity.sets_tags() {
            if !self.unsupported.swap(true, Ordering::AcqRel) {
                tracing::warn!(
                    provider = %identity.name,
                    "the tagging controller has tags to write, but the provider writes none (TagsCapabilities.set_tags): no instance is tagged"
                );
            }
            return done;
        }
        let nodes: Vec<(usize, std::sync::Arc<Node>)> = keys
            .iter()
            .enumerate()
            .filter_map(|(i, name)| Some((i, self.ctx.nodes.store().get(&ObjectRef::new(name))?)))
            .filter(|(_, n)| self.wanted(n))
            .collect();
        if nodes.is_empty() {
            return done;
        }
        let lookups = InstanceLookups::of(nodes.iter().map(|(_, n)| n.as_ref()));
        let current = self.ctx.provider.instance_tags(&lookups).await;
        // Plans, and the claims recorded before anything is written.
        let mut todo = Vec::new();
        for ((i, node), current) in nodes.into_iter().zip(current) {
            let current = match current {
                Ok(current) => current,
                Err(error) => {
                    tracing::debug!(node = %node_util::name(&node), %error, "reading the instance's tags failed");
                    done[i] = Outcome::of_provider_error(None, &error).into();
                    continue;
                }
            };
            let owned = owned(&node);
            let plan = plan(&self.desired(&node), &current, &owned);
            self.report_conflicts(&node, &plan.conflicts, &current).await;
            if plan.change.set.is_empty() && plan.change.remove.is_empty() {
                continue;
            }
            if plan.claim != owned
                && let Err(error) = self.record(&node, &plan.claim).await
            {
                tracing::warn!(node = %node_util::name(&node), %error, "recording the instance tags to write failed");
                done[i] = retry().into();
                continue;
            }
            todo.push((i, node, plan));
        }
        if todo.is_empty() {
            return done;
        }
        let lookups = InstanceLookups::of(todo.iter().map(|(_, n, _)| n.as_ref()));
        let changes: Vec<TagChange> = todo.iter().map(|(_, _, p)| p.change.clone()).collect();
        let written = self.ctx.cloud().batch_set_instance_tags(&lookups, &changes).await;
        let mut tagged = 0;
        for ((i, node, plan), result) in todo.into_iter().zip(written) {
            let name = node_util::name(&node);
            match result {
                Ok(true) => {
                    tagged += 1;
                    if plan.after != plan.claim
                        && let Err(error) = self.record(&node, &plan.after).await
                    {
                        // Recorded still: removed again (absent is fine) at the next pass.
                        tracing::warn!(node = %name, %error, "unrecording removed instance tags failed");
                        done[i] = retry().into();
                    }
                }
                // Gone: the lifecycle controller's to judge.
                Ok(false) => {}
                Err(error) if error.is_transient() => done[i] = Outcome::of_provider_error(None, &error).into(),
                Err(error) => {
                    tracing::warn!(node = %name, %error, "writing the instance's tags failed");
                    let note = format!("Writing tags to the Node's instance failed: {error}");
                    self.ctx.event(NAME, node.as_ref(), EventType::Warning, reason::INSTANCE_TAGS_FAILED, note).await;
                    // Retried when the Node or the flags change, and after the longest backoff.
                    done[i] =
                        Outcome::Retry { fingerprint: None, retry_after: Some(self.ctx.options.reconcile_backoff_max) }.into();
                }
            }
        }
        if tagged > 0 {
            tracing::info!(instances = tagged, "instance tags written");
        }
        done
    }

    /// A Warning Event per Node and key someone else tagged with another value (once each).
    async fn report_conflicts(&self, node: &Node, conflicts: &[String], current: &BTreeMap<String, String>) {
        let uid = node.metadata.uid.clone().unwrap_or_default();
        for k in conflicts {
            if !self.reported.locked().insert((uid.clone(), k.clone())) {
                continue;
            }
            let have = current.get(k).map(String::as_str).unwrap_or_default();
            let note = format!(
                "The instance has tag {k:?} with value {have:?}, not written by this controller: left as it is \
                 (remove it in the cloud for the cluster's value to be written)"
            );
            self.ctx.event(NAME, node, EventType::Warning, reason::INSTANCE_TAG_CONFLICT, note).await;
        }
    }
}

impl runner::Controller for TaggingController {
    type Key = String;
    const NAME: &'static str = NAME;
    const WATCHES: Watches = Watches { nodes: true, services: false, provider: true };

    fn ctx(&self) -> &Context {
        &self.ctx
    }

    fn queue_config(&self) -> QueueConfig {
        let o = &self.ctx.options;
        QueueConfig { base_delay: o.reconcile_backoff_base, max_delay: o.reconcile_backoff_max, qps: 1e6, burst: 1_000_000 }
    }

    /// 500 Nodes a call.
    fn batch(&self) -> usize {
        ccm_protocol::limits::MAX_BATCH
    }

    fn resync(&self, queue: &WorkQueue<String>) {
        for node in self.ctx.nodes.sorted() {
            if self.wanted(&node) {
                queue.add_changed(node_util::name(&node).to_string(), self.fingerprint(&node));
            }
        }
    }

    fn on_node(&self, change: Option<Change<Node>>, queue: &WorkQueue<String>) {
        match change {
            Some(Change::Applied { old, new }) => {
                if old.as_deref().map(|o| self.fingerprint(o)) != Some(self.fingerprint(&new)) && self.wanted(&new) {
                    queue.add_changed(node_util::name(&new).to_string(), self.fingerprint(&new));
                }
            }
            Some(Change::Deleted(node)) => queue.forget(&node_util::name(&node).to_string()),
            None => self.resync(queue),
        }
    }

    async fn reconcile(&self, keys: &[String]) -> Vec<Done> {
        self.tag(keys).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn set(keys: &[&str]) -> BTreeSet<String> {
        keys.iter().map(|k| k.to_string()).collect()
    }

    #[test]
    fn only_keys_the_controller_owns_are_changed_or_removed() {
        let desired = map(&[("team", "core"), ("env", "prod"), ("cost", "42"), ("user", "mine")]);
        let current = map(&[("env", "dev"), ("cost", "41"), ("user", "mine"), ("old", "x"), ("theirs", "y")]);
        let owned = set(&["cost", "old"]);
        let p = plan(&desired, &current, &owned);
        assert_eq!(p.change.set, map(&[("team", "core"), ("cost", "42")]), "added where absent, updated where owned");
        assert_eq!(p.change.remove, vec!["old".to_string()], "an owned key the flag dropped");
        assert_eq!(p.conflicts, vec!["env".to_string()], "someone else's value is left alone");
        assert_eq!(p.claim, set(&["cost", "old", "team"]), "recorded before writing");
        assert_eq!(p.after, set(&["cost", "team"]));
        assert!(!p.claim.contains("user"), "a tag already there with the same value stays its owner's");
    }

    #[test]
    fn nothing_to_do_is_an_empty_plan() {
        let desired = map(&[("team", "core")]);
        let p = plan(&desired, &desired, &set(&["team"]));
        assert!(p.change.set.is_empty() && p.change.remove.is_empty() && p.conflicts.is_empty());
        assert_eq!(p.after, set(&["team"]));
    }
}
