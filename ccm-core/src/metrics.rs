//! Prometheus metrics of the core: provider calls, work queues, reconciles, leadership.

use ccm_protocol::lock::Lock;
use std::sync::Arc;
use std::sync::atomic::AtomicI64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    provider: String,
    method: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabels {
    provider: String,
    method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LeaseLabels {
    lease: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClusterCidrLabels {
    cluster_cidr: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ControllerLabels {
    controller: String,
}

fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// Every metric the core exports; cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    provider_calls: Family<CallLabels, Counter>,
    provider_latency: Family<MethodLabels, Histogram, fn() -> Histogram>,
    invalid_answers: Family<MethodLabels, Counter>,
    queue_depth: Family<ControllerLabels, Gauge>,
    queue_adds: Family<ControllerLabels, Counter>,
    queue_retries: Family<ControllerLabels, Counter>,
    reconcile_latency: Family<ControllerLabels, Histogram, fn() -> Histogram>,
    reconcile_errors: Family<ControllerLabels, Counter>,
    leader: Gauge<i64, AtomicI64>,
    leases: Family<LeaseLabels, Gauge>,
    handovers: Family<LeaseLabels, Counter>,
    held: Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
    route_syncs: Counter,
    routes_created: Counter,
    routes_deleted: Counter,
    route_corrections: Counter,
    nodes_without_route: Gauge<i64, AtomicI64>,
    service_node_sync: Histogram,
    orphans: Family<OutcomeLabels, Counter>,
    repairs: Family<OutcomeLabels, Counter>,
    node_deletions: Family<OutcomeLabels, Counter>,
    out_of_service: Family<OutcomeLabels, Counter>,
    cidrs_in_use: Family<ClusterCidrLabels, Gauge>,
    cidrs_pending: Gauge<i64, AtomicI64>,
    events_dropped: Counter,
    /// Why the process is failing (a controller ended), for /readyz.
    failure: Arc<std::sync::Mutex<Option<String>>>,
    /// Upstream's names for the same figures, and its others.
    upstream: crate::upstream_metrics::UpstreamMetrics,
    /// The API server's host, as the `host` label of the client metrics.
    api_host: Arc<std::sync::Mutex<String>>,
}

/// Upstream's work queue name for a controller's queue.
fn queue_name(controller: &str) -> &str {
    crate::controllers::registry::named(controller).map_or(controller, |c| c.queue)
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// All metrics, registered.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let provider_calls = Family::<CallLabels, Counter>::default();
        let provider_latency = Family::<MethodLabels, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram);
        let queue_depth = Family::<ControllerLabels, Gauge>::default();
        let invalid_answers = Family::<MethodLabels, Counter>::default();
        let queue_adds = Family::<ControllerLabels, Counter>::default();
        let queue_retries = Family::<ControllerLabels, Counter>::default();
        let reconcile_latency = Family::<ControllerLabels, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram);
        let reconcile_errors = Family::<ControllerLabels, Counter>::default();
        let leader = Gauge::<i64, AtomicI64>::default();
        let leases = Family::<LeaseLabels, Gauge>::default();
        let handovers = Family::<LeaseLabels, Counter>::default();
        let route_syncs = Counter::default();
        let routes_created = Counter::default();
        let routes_deleted = Counter::default();
        let route_corrections = Counter::default();
        let nodes_without_route = Gauge::<i64, AtomicI64>::default();
        let service_node_sync = latency_histogram();
        let orphans = Family::<OutcomeLabels, Counter>::default();
        let repairs = Family::<OutcomeLabels, Counter>::default();
        let node_deletions = Family::<OutcomeLabels, Counter>::default();
        let out_of_service = Family::<OutcomeLabels, Counter>::default();
        let events_dropped = Counter::default();
        let cidrs_in_use = Family::<ClusterCidrLabels, Gauge>::default();
        let cidrs_pending = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "ccm_node_ipam_cidrs_in_use",
            "Node CIDRs node IPAM's range allocator counts as taken, by cluster CIDR (held by a Node, or given by a write of unknown outcome); kept by the holder of the node IPAM Lease",
            cidrs_in_use.clone(),
        );
        registry.register(
            "ccm_node_ipam_cidrs_pending",
            "Node CIDRs given by a write of unknown outcome, kept taken until every Node is read again",
            cidrs_pending.clone(),
        );
        registry.register(
            "ccm_events_dropped",
            "Events not recorded because 1000 already waited for the Event write budget (--kube-api-qps)",
            events_dropped.clone(),
        );
        registry.register(
            "ccm_node_out_of_service_taints",
            "The out-of-service taint on Nodes whose instance is shut down (--out-of-service-after): added, removed, or refused (over the deletion bounds, a disrupted zone, a provider not believed)",
            out_of_service.clone(),
        );
        registry.register(
            "ccm_node_deletions",
            "Nodes whose instance is gone: deleted, or refused (over --max-node-deletions, or in a disrupted zone)",
            node_deletions.clone(),
        );
        registry.register(
            "ccm_load_balancer_orphans",
            "Load balancers whose Service is gone: deleted, or refused (a sweep over --max-load-balancer-deletions)",
            orphans.clone(),
        );
        registry.register(
            "ccm_load_balancer_repairs",
            "Load balancers changed behind the core's back: made again (gone from the cloud), given their hosts again (hosts drifted), or refused (over --max-load-balancer-repairs, or a listing that missed every one)",
            repairs.clone(),
        );
        registry.register(
            "ccm_service_node_sync_duration_seconds",
            "From a change of the load balancer node set to every load balancer updated",
            service_node_sync.clone(),
        );
        registry.register("ccm_route_syncs", "Full route reconciles", route_syncs.clone());
        registry.register("ccm_routes_created", "Routes created", routes_created.clone());
        registry.register("ccm_routes_deleted", "Routes deleted", routes_deleted.clone());
        registry.register(
            "ccm_route_corrections",
            "Routes found missing or stale at a resync that no Node event explained (drift)",
            route_corrections.clone(),
        );
        registry.register(
            "ccm_nodes_without_route",
            "Nodes with a podCIDR but no route (a full route table, or no table the provider names for them)",
            nodes_without_route.clone(),
        );
        registry.register(
            "ccm_provider_calls",
            "Calls to the providers, by provider (its --provider-endpoint name), method and gRPC code",
            provider_calls.clone(),
        );
        registry.register(
            "ccm_provider_call_duration_seconds",
            "Latency of provider calls, by provider and method",
            provider_latency.clone(),
        );
        registry.register(
            "ccm_provider_invalid_answers",
            "Provider answers refused as invalid (another instance, a foreign providerID scheme, a bad IP, a repeated page token), by provider and method",
            invalid_answers.clone(),
        );
        registry.register("ccm_workqueue_depth", "Keys ready or in process, by controller", queue_depth.clone());
        registry.register("ccm_workqueue_adds", "Keys added to the queue, by controller", queue_adds.clone());
        registry.register(
            "ccm_workqueue_retries",
            "Reconciles scheduled for retry after a failure, by controller",
            queue_retries.clone(),
        );
        registry.register("ccm_reconcile_duration_seconds", "Reconcile latency, by controller", reconcile_latency.clone());
        registry.register("ccm_reconcile_errors", "Failed reconciles, by controller", reconcile_errors.clone());
        registry.register("ccm_leader_is_leader", "1 while this process holds at least one of its leader Leases", leader.clone());
        registry.register("ccm_leader_lease_held", "1 while this process holds the Lease, by Lease name", leases.clone());
        registry.register(
            "ccm_leader_handovers",
            "Leases this process gave up to the replica they are assigned to (--leader-elect-per-controller), by Lease name",
            handovers.clone(),
        );
        let upstream = crate::upstream_metrics::UpstreamMetrics::register(&mut registry);
        Self {
            upstream,
            api_host: Default::default(),
            registry: Arc::new(registry),
            provider_calls,
            provider_latency,
            invalid_answers,
            queue_depth,
            queue_adds,
            queue_retries,
            reconcile_latency,
            reconcile_errors,
            leader,
            leases,
            handovers,
            held: Default::default(),
            route_syncs,
            routes_created,
            routes_deleted,
            route_corrections,
            nodes_without_route,
            service_node_sync,
            orphans,
            repairs,
            out_of_service,
            events_dropped,
            node_deletions,
            cidrs_in_use,
            cidrs_pending,
            failure: Default::default(),
        }
    }

    /// Marks the process as failing (/readyz says why until it exits).
    pub fn set_failed(&self, why: String) {
        *self.failure.locked() = Some(why);
    }

    /// Why the process is failing, if it is.
    pub fn failure(&self) -> Option<String> {
        self.failure.locked().clone()
    }

    /// An Event dropped because too many waited for the write budget.
    pub fn event_dropped(&self) {
        self.events_dropped.inc();
    }

    /// Nodes deleted by the lifecycle controller, or refused by its bounds.
    pub fn node_deletions(&self, outcome: &str, n: u64) {
        self.node_deletions.get_or_create(&OutcomeLabels { outcome: outcome.into() }).inc_by(n);
    }

    /// Out-of-service taints added, removed or refused.
    pub fn out_of_service_taints(&self, outcome: &str, n: u64) {
        self.out_of_service.get_or_create(&OutcomeLabels { outcome: outcome.into() }).inc_by(n);
    }

    /// A node set change fully applied to load balancers.
    pub fn service_node_sync(&self, elapsed: Duration) {
        self.service_node_sync.observe(elapsed.as_secs_f64());
        self.upstream.node_sync(elapsed);
    }

    /// Load balancers repaired (`recreated`, `hosts`), or repairs refused (`refused`).
    pub fn load_balancer_repairs(&self, outcome: &str, n: u64) {
        self.repairs.get_or_create(&OutcomeLabels { outcome: outcome.into() }).inc_by(n);
    }

    /// Orphaned load balancers deleted, or refused by the deletion bound.
    pub fn load_balancer_orphans(&self, outcome: &str, n: u64) {
        self.orphans.get_or_create(&OutcomeLabels { outcome: outcome.into() }).inc_by(n);
    }

    /// One full route reconcile, with what it changed.
    pub fn route_sync(&self, created: u64, deleted: u64, corrections: u64, without_route: usize) {
        self.route_syncs.inc();
        self.upstream.route_sync();
        self.routes_created.inc_by(created);
        self.routes_deleted.inc_by(deleted);
        self.route_corrections.inc_by(corrections);
        self.nodes_without_route.set(without_route as i64);
    }

    /// One provider call attempt.
    pub fn provider_call(&self, provider: &str, method: &str, code: tonic::Code, elapsed: Duration) {
        let code = ccm_protocol::error::code_name(code).to_string();
        let (provider, method) = (provider.to_string(), method.to_string());
        self.provider_calls.get_or_create(&CallLabels { provider: provider.clone(), method: method.clone(), code }).inc();
        self.provider_latency.get_or_create(&MethodLabels { provider, method }).observe(elapsed.as_secs_f64());
    }

    /// A provider answer refused as invalid.
    pub fn invalid_answer(&self, provider: &str, method: &str) {
        self.invalid_answers.get_or_create(&MethodLabels { provider: provider.to_string(), method: method.to_string() }).inc();
    }

    /// A queue's depth.
    pub fn queue_depth(&self, controller: &str, depth: usize) {
        self.queue_depth.get_or_create(&ControllerLabels { controller: controller.into() }).set(depth as i64);
        self.upstream.queue_depth(queue_name(controller), depth);
    }

    /// A work queue's state: its depth, how long the keys taken since the last call waited,
    /// the work in process (upstream's `workqueue_queue_duration_seconds`,
    /// `workqueue_unfinished_work_seconds`, `workqueue_longest_running_processor_seconds`).
    pub fn queue_state<K: Clone + Eq + std::hash::Hash>(&self, controller: &str, queue: &crate::queue::WorkQueue<K>) {
        let stats = queue.stats();
        self.queue_depth(controller, stats.depth);
        self.upstream.queue_work(queue_name(controller), &queue.take_waits(), stats.unfinished, stats.longest);
        let adds = queue.take_adds();
        if adds > 0 {
            self.queue_adds.get_or_create(&ControllerLabels { controller: controller.into() }).inc_by(adds);
            self.upstream.queue_adds(queue_name(controller), adds);
        }
    }

    /// One reconcile, and whether it failed.
    pub fn reconcile(&self, controller: &str, elapsed: Duration, failed: bool) {
        let labels = ControllerLabels { controller: controller.into() };
        self.upstream.reconcile(queue_name(controller), elapsed, failed);
        self.reconcile_latency.get_or_create(&labels).observe(elapsed.as_secs_f64());
        if failed {
            self.reconcile_errors.get_or_create(&labels).inc();
            self.queue_retries.get_or_create(&labels).inc();
        }
    }

    /// Whether this process holds the Lease `lease`; `ccm_leader_is_leader` is 1 while it
    /// holds any.
    pub fn lease_held(&self, lease: &str, held: bool) {
        self.leases.get_or_create(&LeaseLabels { lease: lease.to_string() }).set(i64::from(held));
        self.upstream.lease_held(lease, held);
        let mut set = self.held.locked();
        if held {
            set.insert(lease.to_string());
        } else {
            set.remove(lease);
        }
        self.leader.set(i64::from(!set.is_empty()));
    }

    /// A Lease handed over to the replica it is assigned to.
    pub fn lease_handed_over(&self, lease: &str) {
        self.handovers.get_or_create(&LeaseLabels { lease: lease.to_string() }).inc();
    }

    /// A Kubernetes client for `config` whose requests are counted and timed
    /// (`rest_client_requests_total`, `rest_client_request_duration_seconds`).
    pub fn kube_client(&self, config: kube::Config) -> Result<kube::Client, kube::Error> {
        let host = config.cluster_url.authority().map(|a| a.to_string()).unwrap_or_default();
        host.clone_into(&mut self.api_host.locked());
        let builder = kube::client::ClientBuilder::try_from(config)?;
        Ok(builder.with_layer(&crate::upstream_metrics::RestClientLayer::new(self.upstream.clone(), host)).build())
    }

    /// How long a write waited for the client-side budget (`rest_client_rate_limiter_duration_seconds`).
    pub fn rate_limited(&self, waited: Duration) {
        let host = self.api_host.locked().clone();
        self.upstream.rate_limited(&host, "write", waited);
    }

    /// What node IPAM's range allocator holds: CIDRs taken per cluster CIDR, and those of
    /// writes of unknown outcome.
    pub fn node_ipam_cidrs(&self, in_use: &[(String, usize)], pending: usize) {
        for (cluster, n) in in_use {
            self.cidrs_in_use
                .get_or_create(&ClusterCidrLabels { cluster_cidr: cluster.clone() })
                .set(i64::try_from(*n).unwrap_or(i64::MAX));
        }
        self.cidrs_pending.set(i64::try_from(pending).unwrap_or(i64::MAX));
    }

    /// Whether a controller runs in this process (upstream's `running_managed_controllers`).
    pub fn controller_running(&self, controller: &str, running: bool) {
        self.upstream.controller_running(controller, running);
    }

    /// A load balancer ensured (upstream's `service_controller_loadbalancer_sync_total`).
    pub fn load_balancer_sync(&self) {
        self.upstream.load_balancer_sync();
    }

    /// One UpdateLoadBalancerHosts, its latency and whether it failed.
    pub fn hosts_update(&self, elapsed: Duration, failed: bool) {
        self.upstream.hosts_update(elapsed, failed);
    }

    /// A Node initialised, so long after it was created.
    pub fn node_initialised(&self, since_creation: Duration) {
        self.upstream.node_initialised(since_creation);
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        self.upstream.refresh_process();
        let mut text = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            tracing::warn!(error = %e, "encoding metrics failed");
        }
        text
    }
}

/// An error and its sources, `outer: inner: …`, as `{:#}` prints an `anyhow::Error`: for log
/// fields and Events, where the cause is what the operator needs.
pub fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
