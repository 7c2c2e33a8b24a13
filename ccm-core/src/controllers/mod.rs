//! The controllers, and what they share.

pub mod ipam;
pub mod node;
pub mod node_addresses;
pub mod node_lifecycle;
pub mod owners;
pub mod registry;
pub mod route;
pub mod runner;
pub mod service;
pub mod tag_labels;
pub mod tagging;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::events::{Note, Recorder};
use ccm_protocol::Error;
use ccm_protocol::ratelimit::TokenBucket;
use k8s_openapi::api::core::v1::{Node, Service};
use kube::api::{Patch, PatchParams};
use kube::{Api, Resource};
use tokio_util::sync::CancellationToken;

use crate::informer::Informer;
use crate::labels::{self, Op};
use crate::metrics::Metrics;
use crate::node_util;
use crate::options::Options;
use crate::provider::Provider;
use crate::provider::set::{Owner, Providers};

/// Which Nodes a context's controllers manage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// Every Node a provider of this core owns (or may own, once resolved).
    All,
    /// The Nodes of the provider at this index.
    Provider(usize),
}

/// A controller that cannot start: flags whose values do not fit together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A flag's value does not parse.
    #[error("{flag} {value:?}: {why}")]
    Invalid { flag: &'static str, value: String, why: String },
    /// Values that parse but do not fit together.
    #[error("{0}")]
    Mismatch(String),
}

impl ConfigError {
    /// `--cluster-cidr` values that are not CIDRs.
    pub fn not_a_cidr(flag: &'static str, value: &str) -> Self {
        Self::Invalid { flag, value: value.to_string(), why: "not a CIDR".into() }
    }
}

/// What every controller gets.
#[derive(Clone)]
pub struct Context {
    /// Kubernetes client.
    pub client: kube::Client,
    /// The provider this context acts for (with several providers, each controller runs once
    /// per provider, each run on a context of its own provider: [`Context::for_provider`]).
    pub provider: Provider,
    /// Every provider, and the rules of which Nodes and Services are whose.
    pub providers: Arc<Providers>,
    /// Which Nodes this context's controllers manage.
    scope: Scope,
    /// Deletions and out-of-service taints of the lifecycle controllers of every provider,
    /// bounded over all of them as each is bounded over its own Nodes.
    pub(crate) lifecycle_overall: Arc<node_lifecycle::Overall>,
    /// The shared Node watch.
    pub nodes: Informer<Node>,
    /// The shared Service watch.
    pub services: Informer<Service>,
    /// Metrics.
    pub metrics: Metrics,
    /// Flags.
    pub options: Arc<Options>,
    /// `--node-exclude-selector`s, parsed.
    pub exclude: Arc<Vec<Vec<(String, Op)>>>,
    kube_writes: Arc<TokenBucket>,
    /// Events have a budget of their own (upstream records them through a client of its own).
    event_writes: Arc<TokenBucket>,
    /// The lead this context writes under, if any (none without leader election).
    fence: Option<crate::leader::Fence>,
    /// The controllers' Lease's ledger (without leader election: none, what is spent is
    /// counted in this process only).
    pub ledger: Option<crate::leader::Ledger>,
    /// The Event recorder, kept, so that repeated Events are aggregated into a series (a count
    /// and the last time) as client-go's recorder does.
    recorder: Arc<Recorder>,
}

impl Context {
    /// The shared context.
    pub fn new(
        client: kube::Client,
        providers: Arc<Providers>,
        nodes: Informer<Node>,
        services: Informer<Service>,
        metrics: Metrics,
        options: Arc<Options>,
    ) -> Result<Self, ConfigError> {
        let exclude = options
            .node_exclude_selector
            .iter()
            .map(|s| {
                labels::parse_selector(s).map_err(|why| ConfigError::Invalid {
                    flag: "--node-exclude-selector",
                    value: s.clone(),
                    why,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let exclude = Arc::new(exclude);
        let kube_writes = Arc::new(TokenBucket::new(f64::from(options.kube_api_qps), options.kube_api_burst));
        let event_writes = Arc::new(TokenBucket::new(f64::from(options.kube_api_qps), options.kube_api_burst));
        let recorder = Arc::new(Recorder::new(client.clone()));
        let Some(provider) = providers.all().first().cloned() else {
            return Err(ConfigError::Mismatch("no provider".into()));
        };
        Ok(Self {
            client,
            provider,
            providers,
            scope: Scope::All,
            lifecycle_overall: Default::default(),
            nodes,
            services,
            metrics,
            options,
            exclude,
            kube_writes,
            event_writes,
            fence: None,
            ledger: None,
            recorder,
        })
    }

    /// The same context, writing through another client (a controller's own credentials).
    pub fn with_client(&self, client: kube::Client) -> Self {
        Self { recorder: Arc::new(Recorder::new(client.clone())), client, ..self.clone() }
    }

    /// The same context with write budgets of its own: each controller gets
    /// `--kube-api-qps`/`--kube-api-burst` for its writes (and the same again for its Events),
    /// as each of upstream's controllers gets a client, and a rate limiter, of its own.
    pub fn for_controller(&self) -> Self {
        let (qps, burst) = (f64::from(self.options.kube_api_qps), self.options.kube_api_burst);
        Self {
            kube_writes: Arc::new(TokenBucket::new(qps, burst)),
            event_writes: Arc::new(TokenBucket::new(qps, burst)),
            ..self.clone()
        }
    }

    /// The same context acting for the provider at `index` of [`Providers::all`], on its Nodes
    /// and Services only.
    pub fn for_provider(&self, index: usize) -> Self {
        let provider = self.providers.all().get(index).cloned().unwrap_or_else(|| self.provider.clone());
        Self { provider, scope: Scope::Provider(index), ..self.clone() }
    }

    /// The same context managing every Node of every provider (its provider's calls still
    /// go to its provider alone): the routes of `--routes-provider`, node IPAM.
    pub fn over_all_nodes(&self) -> Self {
        Self { scope: Scope::All, ..self.clone() }
    }

    /// The name a controller instance of this context goes by in logs and metrics:
    /// `controller`, with the provider's name in brackets when there are several providers.
    pub fn instance_name(&self, controller: &str) -> String {
        match self.scope {
            Scope::Provider(_) if self.providers.several() => format!("{controller}[{}]", self.provider.name()),
            _ => controller.to_string(),
        }
    }

    /// The same context, writing only while `fence` holds.
    pub fn with_fence(&self, fence: Option<crate::leader::Fence>) -> Self {
        Self { fence, ..self.clone() }
    }

    /// Returns once every mutation this context sent under its lead and still awaits was
    /// answered (at once without a lead).
    pub async fn mutations_answered(&self) {
        if let Some(fence) = &self.fence {
            fence.answered().await;
        }
    }

    /// The same, keeping what is spent under bounds that span tenures on `ledger` (the
    /// controllers' Lease).
    pub fn with_ledger(&self, ledger: Option<crate::leader::Ledger>) -> Self {
        Self { ledger, ..self.clone() }
    }

    /// Waits for a token of `--kube-api-qps`/`--kube-api-burst` before a write to the API;
    /// never returns once the lead it writes under is lost. The write is counted in flight
    /// under the lead until [`written`] (a Lease given up waits for it: its answer could
    /// otherwise land after the next holder began).
    async fn kube_write_permit(&self) -> Option<crate::leader::InFlight> {
        let started = tokio::time::Instant::now();
        self.kube_writes.acquire().await;
        self.metrics.rate_limited(started.elapsed());
        self.lead_permit().await;
        self.write_in_flight()
    }

    /// A write to the API about to be sent under the lead, counted until it ends (dropped
    /// unended, until [`API_WRITE_DEADLINE`]).
    fn write_in_flight(&self) -> Option<crate::leader::InFlight> {
        self.fence.as_ref().map(|f| f.mutation(tokio::time::Instant::now() + API_WRITE_DEADLINE))
    }

    /// Merge-patches the Node `name` (its metadata or spec) under the write budget and the
    /// lead; the resourceVersion written. Every write of the controllers goes through these
    /// methods, which take the permit themselves: a new write cannot forget the fence.
    pub async fn patch_node(&self, name: &str, patch: &serde_json::Value) -> Result<String, kube::Error> {
        let flight = self.kube_write_permit().await;
        written(flight, node_util::patch(&self.client, name, false, patch).await)
    }

    /// Merge-patches the Node `name`'s status under the write budget and the lead; the
    /// resourceVersion written.
    pub async fn patch_node_status(&self, name: &str, patch: &serde_json::Value) -> Result<String, kube::Error> {
        let flight = self.kube_write_permit().await;
        written(flight, node_util::patch(&self.client, name, true, patch).await)
    }

    /// Patches the Node `name`'s conditions (a strategic merge: by condition type) under the
    /// write budget and the lead.
    pub async fn patch_node_conditions(&self, name: &str, patch: &serde_json::Value) -> Result<Node, kube::Error> {
        let flight = self.kube_write_permit().await;
        let api: Api<Node> = Api::all(self.client.clone());
        written(flight, api.patch_status(name, &PatchParams::default(), &Patch::Strategic(patch)).await)
    }

    /// Deletes `node`, only the one looked at (a re-registered Node of the same name has
    /// another UID), under the write budget and the lead. A Node already gone is no error.
    pub async fn delete_node(&self, node: &Node) -> Result<(), kube::Error> {
        use kube::api::{DeleteParams, Preconditions};
        let params = DeleteParams {
            preconditions: Some(Preconditions { uid: node.metadata.uid.clone(), resource_version: None }),
            ..Default::default()
        };
        let flight = self.kube_write_permit().await;
        let api: Api<Node> = Api::all(self.client.clone());
        match written(flight, api.delete(node_util::name(node), &params).await) {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Merge-patches `svc` (its metadata or spec) under the write budget and the lead.
    pub async fn patch_service(&self, svc: &Service, patch: &serde_json::Value) -> Result<(), kube::Error> {
        let api: Api<Service> = Api::namespaced(self.client.clone(), svc.metadata.namespace.as_deref().unwrap_or_default());
        let flight = self.kube_write_permit().await;
        let r = api.patch(svc.metadata.name.as_deref().unwrap_or_default(), &PatchParams::default(), &Patch::Merge(patch)).await;
        written(flight, r).map(|_| ())
    }

    /// Merge-patches `svc`'s status under the write budget and the lead.
    pub async fn patch_service_status(&self, svc: &Service, patch: &serde_json::Value) -> Result<(), kube::Error> {
        let api: Api<Service> = Api::namespaced(self.client.clone(), svc.metadata.namespace.as_deref().unwrap_or_default());
        let flight = self.kube_write_permit().await;
        let name = svc.metadata.name.as_deref().unwrap_or_default();
        let r = api.patch_status(name, &PatchParams::default(), &Patch::Merge(patch)).await;
        written(flight, r).map(|_| ())
    }

    /// Returns while this context may act as the leader (always without leader election);
    /// never once the lead is lost.
    pub async fn lead_permit(&self) {
        if let Some(fence) = &self.fence {
            fence.check().await;
        }
    }

    /// The provider's calls that change the cloud, under the lead this context acts under.
    pub fn cloud(&self) -> crate::provider::fenced::FencedProvider {
        self.provider.fenced(self.fence.clone())
    }

    /// Whether the node controllers leave this Node alone: excluded by the operator's selector,
    /// or not this context's provider's (see [`Providers::owner`]).
    pub fn ignores(&self, node: &Node) -> bool {
        if self.excluded(node) {
            return true;
        }
        match (self.scope, self.providers.owner(node)) {
            (Scope::Provider(i), owner) => owner != Owner::Provider(i),
            (Scope::All, owner) => owner == Owner::Nobody,
        }
    }

    /// Whether the operator's `--node-exclude-selector` excludes this Node.
    pub fn excluded(&self, node: &Node) -> bool {
        static NO_LABELS: BTreeMap<String, String> = BTreeMap::new();
        let labels = node.metadata.labels.as_ref().unwrap_or(&NO_LABELS);
        self.exclude.iter().any(|terms| labels::selector_matches(terms, labels))
    }

    /// Whether a LoadBalancer Service is this context's provider's, by its class.
    pub fn serves_service(&self, svc: &Service) -> bool {
        match (self.scope, self.providers.service_owner(svc)) {
            (Scope::Provider(i), owner) => owner == Some(i),
            (Scope::All, owner) => owner.is_some(),
        }
    }

    /// Whether this context's provider's load balancers get every Node as a backend
    /// (`--load-balancer-backends-all-nodes`), not only its own Nodes.
    pub fn all_backends(&self) -> bool {
        match self.scope {
            Scope::Provider(i) => self.providers.all_backends(i),
            Scope::All => self.providers.all_backends(0),
        }
    }

    /// The cached Nodes this process manages: not ignored (see [`Context::ignores`]) and not
    /// being deleted.
    pub fn managed_nodes(&self) -> impl Iterator<Item = Arc<Node>> + '_ {
        self.nodes.sorted().into_iter().filter(|n| !self.ignores(n) && n.metadata.deletion_timestamp.is_none())
    }

    /// Records an Event on an object in the background (best effort: a failure is logged,
    /// never fatal, and never delays the reconcile that reported it). Events have their own
    /// `--kube-api-qps`/`--kube-api-burst` budget, as upstream's event recorder has its own client.
    pub async fn event<K: Resource<DynamicType = ()>>(
        &self,
        controller: &str,
        object: &K,
        event_type: crate::events::EventType,
        reason: &str,
        note: String,
    ) {
        if self.fence.as_ref().is_some_and(|f| !f.holds()) {
            return; // no writes once the lead is lost, Events included
        }
        let Some(place) = self.recorder.enqueue() else {
            tracing::debug!(reason, "too many Events wait for the write budget; this one is dropped");
            self.metrics.event_dropped();
            return;
        };
        let note = Note {
            controller: controller.to_string(),
            regarding: object.object_ref(&()),
            event_type,
            reason: reason.to_string(),
            note: bounded_note(note),
        };
        let this = self.clone();
        tokio::spawn(async move {
            this.event_writes.acquire().await;
            // Checked again when it is sent: a queued Event is dropped once the lead is lost.
            if this.fence.as_ref().is_some_and(|f| !f.holds()) {
                this.metrics.event_dropped();
                return;
            }
            let flight = this.write_in_flight();
            if let Err(error) = written(flight, this.recorder.publish(&note, this.fence.as_ref()).await) {
                let object = note.regarding.name.as_deref().unwrap_or_default();
                tracing::warn!(%object, %error, reason = %note.reason, "recording an event failed");
            }
            drop(place);
        });
    }
}

impl Context {
    /// Records a Warning Event `InvalidProviderAnswer` on `object` when `error` is about an
    /// invalid provider answer (other errors are the caller's to report).
    pub async fn report_invalid<K: Resource<DynamicType = ()>>(&self, controller: &str, object: &K, error: &Error) {
        if crate::provider::check::is_invalid(error) {
            self.event(
                controller,
                object,
                crate::events::EventType::Warning,
                crate::events::reason::INVALID_PROVIDER_ANSWER,
                error.to_string(),
            )
            .await;
        }
    }

    /// [`Context::report_invalid`] for an answer about no one object (a route or load
    /// balancer listing): the Event is recorded on the core's leader Lease.
    pub async fn report_invalid_listing(&self, controller: &str, error: &Error) {
        self.report_invalid(controller, &self.lease(), error).await;
    }

    /// The core's leader Lease, which Events about the whole cluster's cloud state are
    /// recorded on (the involved object need not exist: leader election may be off).
    pub fn lease(&self) -> k8s_openapi::api::coordination::v1::Lease {
        k8s_openapi::api::coordination::v1::Lease {
            metadata: kube::api::ObjectMeta {
                name: Some(self.options.leader_elect_resource_name.clone()),
                namespace: Some(self.options.leader_elect_resource_namespace.clone()),
                ..Default::default()
            },
            ..Default::default()
        }
    }
}

/// The longest Event note the API server accepts (events.k8s.io/v1: 1 kB); a provider's error
/// text can be longer.
const MAX_NOTE: usize = 1024;

/// `note` cut to [`MAX_NOTE`] bytes at a character boundary, marked with "…" when cut, so that
/// a long provider message never costs the Event.
fn bounded_note(note: String) -> String {
    if note.len() <= MAX_NOTE {
        return note;
    }
    let mut end = MAX_NOTE - '…'.len_utf8();
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &note[..end])
}

/// How long a write to the API dropped before its answer (its task aborted) counts as in
/// flight: the client's request may still reach the API server until then.
const API_WRITE_DEADLINE: Duration = Duration::from_secs(15);

/// Ends the write `flight` counted, passing its `result` on.
fn written<T>(flight: Option<crate::leader::InFlight>, result: T) -> T {
    if let Some(flight) = flight {
        flight.ended();
    }
    result
}

/// A controller's own tasks (its feed, workers, timers), aborted when dropped: a controller
/// task aborted on a lost lead takes them with it, instead of leaving workers that outlive it
/// and go on writing.
#[derive(Default)]
pub struct Tasks(Vec<tokio::task::JoinHandle<()>>);

impl Tasks {
    /// Runs `task` as one of them.
    pub fn spawn(&mut self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.0.push(tokio::spawn(task));
    }

    /// [`supervise`]s them: returns on `stop`, or goes on with the panic of one that ended.
    pub async fn supervise(&mut self, name: &str, stop: &CancellationToken) {
        supervise(name, &mut self.0, stop).await;
    }

    /// Waits (at most `grace` for each) for them to end; those still running are aborted.
    pub async fn join(self, grace: Duration) {
        self.join_until(tokio::time::sleep(grace)).await;
    }

    /// Waits for them to end until `until` does; those still running then are aborted.
    pub async fn join_until(mut self, until: impl std::future::Future<Output = ()>) {
        tokio::pin!(until);
        let mut over = false;
        for t in self.0.iter_mut() {
            if !over {
                tokio::select! {
                    _ = &mut *t => continue,
                    _ = &mut until => over = true,
                }
            }
            t.abort();
        }
    }
}

impl Drop for Tasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Waits for `stop` while `tasks` (a controller's feeds and workers) run. A task that ends
/// first, a panic above all, is the controller's failure: the others are aborted and the
/// panic goes on (or one is raised), so that the controller's own task ends with it and the
/// process supervisor sees it, instead of the controller going on without its workers.
/// The task that ended is taken out of `tasks` (it must not be awaited again).
pub async fn supervise(name: &str, tasks: &mut Vec<tokio::task::JoinHandle<()>>, stop: &CancellationToken) {
    if tasks.is_empty() {
        stop.cancelled().await;
        return;
    }
    let ended = tokio::select! {
        _ = stop.cancelled() => return,
        (result, index, _) = futures::future::select_all(tasks.iter_mut()) => {
            drop(tasks.swap_remove(index));
            result
        }
    };
    // Told to stop at the same time: a task that saw it first (a feed) is no failure, and the
    // others (a worker with a mutation in hand) are left to end as a stop lets them.
    if stop.is_cancelled() && !ended.as_ref().is_err_and(|e| e.is_panic()) {
        return;
    }
    for t in tasks.iter() {
        t.abort();
    }
    match ended {
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        _ => panic!("{name}: a task of the controller ended before it was told to stop"),
    }
}

/// Sleeps `period`, or returns false when `stop` fires first.
pub async fn sleep_or_stop(period: Duration, stop: &CancellationToken) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(period) => true,
        _ = stop.cancelled() => false,
    }
}

#[cfg(test)]
mod tests {

    #[tokio::test]
    async fn a_controller_aborted_on_a_lost_lead_takes_its_workers_with_it() {
        use std::sync::atomic::{AtomicU32, Ordering};
        let writes = Arc::new(AtomicU32::new(0));
        let counted = writes.clone();
        // A controller's run: a worker that would go on writing, supervised until stop.
        let controller = tokio::spawn(async move {
            let mut tasks = Tasks::default();
            tasks.spawn(async move {
                loop {
                    counted.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            });
            tasks.supervise("test", &CancellationToken::new()).await;
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        controller.abort();
        let _ = controller.await;
        let after = writes.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(writes.load(Ordering::SeqCst), after, "a worker went on after its controller was aborted");
    }

    use super::*;

    #[test]
    fn event_notes_fit_the_api_servers_limit() {
        assert_eq!(bounded_note("short".into()), "short");
        let long = "é".repeat(2000);
        let cut = bounded_note(long.clone());
        assert!(cut.len() <= MAX_NOTE && cut.ends_with('…'), "{}", cut.len());
        assert!(long.starts_with(cut.trim_end_matches('…')));
        let exact = "a".repeat(MAX_NOTE);
        assert_eq!(bounded_note(exact.clone()), exact);
    }
}
