//! With several providers: which provider a new Node belongs to when it has neither a
//! providerID nor the `ccm-rs.dev/provider` label. Each provider of
//! `--node-provider-lookup-order` is asked, by the Node's name and addresses, whether it knows
//! the instance (one BatchInstanceMetadata per 500 Nodes and provider when it batches reads).
//! Exactly one that knows it: that provider's node controller is told at once (a batch of
//! found Nodes is one batch of its own), initialises the Node and writes the label with the
//! rest, no write of its own. Two or more: a Warning Event `ProviderConflict`, and the Node
//! stays tainted until an operator labels it; none, or a provider that could not answer
//! (down, throttled, not yet connected): asked again after a backoff. Never a guess.
//!
//! The label is the record once the Node is initialised; an operator sets it (on the kubelet,
//! `--node-labels=ccm-rs.dev/provider=NAME`) to skip the lookups.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use ccm_protocol::limits::MAX_BATCH;
use ccm_protocol::lock::Lock;
use k8s_openapi::api::core::v1::Node;
use kube::runtime::reflector::ObjectRef;
use tokio_util::sync::CancellationToken;

use super::Context;
use super::runner::{self, Done, Watches};
use crate::events::{EventType, reason};
use crate::informer::Change;
use crate::node_util;
use crate::provider::convert::InstanceLookups;
use crate::provider::set::Owner;
use crate::queue::{Outcome, WorkQueue};
use crate::wellknown::{LABEL_PROVIDER, TAINT_UNINITIALIZED};

/// Its name in logs and metrics; its Events are the node controller's.
pub const NAME: &str = "cloud-node-provider-lookup";

/// How long a Node waits, from its creation, for a provider to know its instance before a
/// Warning `ProviderNotFound` says none does.
pub const UNKNOWN_AFTER: std::time::Duration = std::time::Duration::from_secs(5 * 60);

/// Whether a Node waits for its provider to be found by lookups.
fn needs_lookup(ctx: &Context, node: &Node) -> bool {
    node_util::has_taint(node, TAINT_UNINITIALIZED)
        && node.metadata.deletion_timestamp.is_none()
        && node_util::provider_id(node).is_none()
        && !ctx.excluded(node)
        && ctx.providers.owner(node) == Owner::Unresolved
}

/// What the lookups act on: a change of it looks again at once.
fn fingerprint(node: &Node) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    node_util::provider_id(node).hash(&mut h);
    node.metadata.labels.as_ref().and_then(|l| l.get(LABEL_PROVIDER)).hash(&mut h);
    node_util::addresses(node).iter().for_each(|a| (&a.type_, &a.address).hash(&mut h));
    h.finish()
}

/// The lookups of Nodes without a provider.
pub struct OwnerResolver {
    ctx: Context,
    /// Nodes told to have a label naming no provider of this core, with that label: told once
    /// per value.
    told: std::sync::Mutex<std::collections::HashMap<String, String>>,
}

/// The provider a waiting Node's label names when this core has no such provider.
fn unknown_label<'a>(ctx: &Context, node: &'a Node) -> Option<&'a str> {
    let label = node.metadata.labels.as_ref()?.get(LABEL_PROVIDER)?;
    let waiting = node_util::has_taint(node, TAINT_UNINITIALIZED)
        && node.metadata.deletion_timestamp.is_none()
        && node_util::provider_id(node).is_none()
        && !ctx.excluded(node);
    (waiting && !ctx.providers.all().iter().any(|p| p.name() == label)).then_some(label.as_str())
}

impl OwnerResolver {
    /// Over `ctx` (every provider's).
    pub fn new(ctx: Context) -> Self {
        Self { ctx: ctx.over_all_nodes(), told: Default::default() }
    }

    /// Runs until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        runner::run(self, stop).await;
    }

    fn enqueue(&self, node: &Node, queue: &WorkQueue<String>) {
        if needs_lookup(&self.ctx, node) {
            queue.add_changed(node_util::name(node).to_string(), fingerprint(node));
        } else if let Some(label) = unknown_label(&self.ctx, node) {
            let name = node_util::name(node);
            if self.told.locked().get(name).map(String::as_str) != Some(label) {
                queue.add_changed(name.to_string(), fingerprint(node));
            }
        }
    }

    /// A Warning Event, once per label value, on a waiting Node whose label names no provider.
    async fn tell_unknown(&self, node: &Node, label: &str) {
        let name = node_util::name(node);
        if self.told.locked().insert(name.to_string(), label.to_string()).as_deref() == Some(label) {
            return;
        }
        let names: Vec<&str> = self.ctx.providers.all().iter().map(|p| p.name()).collect();
        let note = format!(
            "{LABEL_PROVIDER}={label} names no provider of this cloud-controller-manager (they are: {}); the Node is left alone",
            names.join(", ")
        );
        tracing::warn!(node = %name, provider = %label, "the node's provider label names no configured provider; left alone");
        self.ctx.event(super::node::NAME, node, EventType::Warning, reason::UNKNOWN_PROVIDER, note).await;
    }

    /// Which providers know each Node's instance (by name), in lookup order; `Err` for a Node
    /// some provider could not answer about.
    async fn ask(&self, nodes: &[Arc<Node>]) -> Vec<Result<Vec<String>, String>> {
        let lookups = InstanceLookups::of(nodes.iter().map(|n| n.as_ref()));
        let mut found: Vec<Result<Vec<String>, String>> = vec![Ok(Vec::new()); nodes.len()];
        for provider in self.ctx.providers.lookup_order() {
            if provider.identity().is_none() {
                let (_, why) = provider.readiness();
                for f in found.iter_mut() {
                    *f = Err(format!("provider {} cannot be asked: {why}", provider.name()));
                }
                continue;
            }
            let answers = provider.instance_metadata(&lookups).await;
            for (f, answer) in found.iter_mut().zip(answers) {
                match (f.as_mut(), answer) {
                    (Ok(names), Ok(Some(_))) => names.push(provider.name().to_string()),
                    (Ok(_), Ok(None)) => {}
                    (Ok(_), Err(error)) => *f = Err(format!("provider {}: {error}", provider.name())),
                    (Err(_), _) => {}
                }
            }
        }
        found
    }

    /// What the lookups of one Node came to; the provider that alone knows it, if one does.
    async fn resolve(&self, node: &Node, found: Result<Vec<String>, String>) -> (Outcome, Option<usize>) {
        let name = node_util::name(node);
        let retry = Outcome::Retry { fingerprint: Some(fingerprint(node)), retry_after: None };
        let outcome = match found.as_deref() {
            Err(why) => {
                tracing::warn!(node = %name, %why, "cannot tell which provider the node belongs to; asking again later");
                retry
            }
            Ok([]) => {
                tracing::info!(node = %name, "no provider knows the node's instance (yet); asking again later");
                // A kubelet may register before its cloud lists the instance: said only once the
                // Node has waited long enough for that (one Event series, counted up).
                let waited = node.metadata.creation_timestamp.as_ref().map(|t| crate::clock::now().duration_since(t.0));
                if waited.is_some_and(|w| w.as_secs() >= UNKNOWN_AFTER.as_secs() as i64) {
                    let note = format!(
                        "No provider of --node-provider-lookup-order knows the instance of this Node: it stays \
                         uninitialised and no provider deletes it. Label it {LABEL_PROVIDER}=NAME (or start its \
                         kubelet with --node-labels={LABEL_PROVIDER}=NAME), or delete it if its machine is gone"
                    );
                    self.ctx.event(super::node::NAME, node, EventType::Warning, reason::PROVIDER_NOT_FOUND, note).await;
                }
                retry
            }
            Ok([owner]) => {
                let Some(index) = self.ctx.providers.all().iter().position(|p| p.name() == owner) else {
                    return (retry, None);
                };
                tracing::info!(node = %name, provider = %owner, "the node's instance is known to one provider");
                let note = format!("The instance is known to provider {owner} alone ({LABEL_PROVIDER}={owner})");
                self.ctx.event(super::node::NAME, node, EventType::Normal, reason::PROVIDER_ASSIGNED, note).await;
                return (Outcome::Success, Some(index));
            }
            Ok(owners) => {
                let note = format!(
                    "The instance is known to providers {}: the Node stays uninitialised; label it {LABEL_PROVIDER}=NAME \
                     (or start its kubelet with --node-labels={LABEL_PROVIDER}=NAME) to say whose it is",
                    owners.join(" and ")
                );
                tracing::warn!(node = %name, providers = ?owners, "the node's instance is known to several providers; not guessing");
                self.ctx.event(super::node::NAME, node, EventType::Warning, reason::PROVIDER_CONFLICT, note).await;
                retry
            }
        };
        (outcome, None)
    }
}

impl runner::Controller for OwnerResolver {
    type Key = String;
    const NAME: &'static str = NAME;
    const WATCHES: Watches = Watches { nodes: true, services: false, provider: false };

    fn ctx(&self) -> &Context {
        &self.ctx
    }

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
            Some(Change::Applied { new, .. }) => {
                if node_util::provider_id(&new).is_some() {
                    self.ctx.providers.forget(node_util::name(&new));
                }
                self.enqueue(&new, queue);
            }
            Some(Change::Deleted(node)) => {
                self.ctx.providers.forget(node_util::name(&node));
                self.told.locked().remove(node_util::name(&node));
            }
            None => self.resync(queue),
        }
    }

    async fn reconcile(&self, keys: &[String]) -> Vec<Done> {
        let mut outcomes = vec![Done::from(Outcome::Success); keys.len()];
        let mut todo: Vec<(usize, Arc<Node>)> = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let Some(node) = self.ctx.nodes.store().get(&ObjectRef::new(key)) else { continue };
            if needs_lookup(&self.ctx, &node) {
                todo.push((i, node));
            } else if let Some(label) = unknown_label(&self.ctx, &node) {
                self.tell_unknown(&node, label).await;
            }
        }
        if todo.is_empty() {
            return outcomes;
        }
        let nodes: Vec<Arc<Node>> = todo.iter().map(|(_, n)| n.clone()).collect();
        let found = self.ask(&nodes).await;
        let mut owned: Vec<Vec<&Node>> = vec![Vec::new(); self.ctx.providers.all().len()];
        for ((i, node), found) in todo.iter().zip(found) {
            let (outcome, owner) = self.resolve(node, found).await;
            outcomes[*i] = outcome.into();
            if let Some(list) = owner.and_then(|o| owned.get_mut(o)) {
                list.push(node.as_ref());
            }
        }
        // Each provider's node controller gets its Nodes of this batch together: one batch
        // read of its own.
        for (index, nodes) in owned.iter().enumerate() {
            self.ctx.providers.found(index, nodes);
        }
        outcomes
    }
}
