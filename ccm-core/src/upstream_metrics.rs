//! Upstream's metric names, with upstream's labels, beside the core's own `ccm_*` metrics, so
//! that dashboards and alerts written for upstream's cloud-controller-manager keep working:
//! work queues (`workqueue_*{name}`), leader election, the controllers running, the service,
//! route and node controllers' own, and the process's.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NameLabels {
    name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    code: String,
    host: String,
    method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VerbLabels {
    host: String,
    verb: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ManagedLabels {
    name: String,
    manager: String,
}

/// Upstream's work queue histograms: 1 ms to about 16 minutes.
fn queue_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 20))
}

/// Upstream's metrics.
#[derive(Clone)]
pub struct UpstreamMetrics {
    rest_requests: Family<RequestLabels, Counter>,
    rest_latency: Family<VerbLabels, Histogram, fn() -> Histogram>,
    rest_rate_limiter: Family<VerbLabels, Histogram, fn() -> Histogram>,
    workqueue_depth: Family<NameLabels, Gauge>,
    workqueue_adds: Family<NameLabels, Counter>,
    workqueue_retries: Family<NameLabels, Counter>,
    workqueue_work_duration: Family<NameLabels, Histogram, fn() -> Histogram>,
    workqueue_queue_duration: Family<NameLabels, Histogram, fn() -> Histogram>,
    workqueue_unfinished: Family<NameLabels, Gauge<f64, AtomicU64>>,
    workqueue_longest: Family<NameLabels, Gauge<f64, AtomicU64>>,
    leader_election_master_status: Family<NameLabels, Gauge>,
    running_managed_controllers: Family<ManagedLabels, Gauge>,
    route_sync: Counter,
    loadbalancer_sync: Counter,
    nodesync_latency: Histogram,
    update_host_latency: Histogram,
    nodesync_error: Counter,
    taint_removal_delay: Histogram,
    initial_node_sync_delay: Histogram,
    cpu_seconds: Counter<f64, AtomicU64>,
    resident_memory: Gauge,
    virtual_memory: Gauge,
    start_time: Gauge<f64, AtomicU64>,
    open_fds: Gauge,
    max_fds: Gauge,
}

impl UpstreamMetrics {
    /// Registers every metric in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            rest_requests: Family::default(),
            rest_latency: Family::new_with_constructor(queue_histogram),
            rest_rate_limiter: Family::new_with_constructor(queue_histogram),
            workqueue_depth: Family::default(),
            workqueue_adds: Family::default(),
            workqueue_retries: Family::default(),
            workqueue_work_duration: Family::new_with_constructor(queue_histogram),
            workqueue_queue_duration: Family::new_with_constructor(queue_histogram),
            workqueue_unfinished: Family::default(),
            workqueue_longest: Family::default(),
            leader_election_master_status: Family::default(),
            running_managed_controllers: Family::default(),
            route_sync: Counter::default(),
            loadbalancer_sync: Counter::default(),
            nodesync_latency: Histogram::new(exponential_buckets(1.0, 2.0, 15)),
            update_host_latency: Histogram::new(exponential_buckets(1.0, 2.0, 15)),
            nodesync_error: Counter::default(),
            taint_removal_delay: Histogram::new(exponential_buckets(1.0, 2.0, 15)),
            initial_node_sync_delay: Histogram::new(exponential_buckets(1.0, 2.0, 15)),
            cpu_seconds: Counter::default(),
            resident_memory: Gauge::default(),
            virtual_memory: Gauge::default(),
            start_time: Gauge::default(),
            open_fds: Gauge::default(),
            max_fds: Gauge::default(),
        };
        registry.register(
            "rest_client_requests",
            "Number of HTTP requests, partitioned by status code, method, and host",
            m.rest_requests.clone(),
        );
        registry.register(
            "rest_client_request_duration_seconds",
            "Request latency in seconds. Broken down by verb, and host",
            m.rest_latency.clone(),
        );
        registry.register(
            "rest_client_rate_limiter_duration_seconds",
            "Client side rate limiter latency in seconds. Broken down by verb, and host",
            m.rest_rate_limiter.clone(),
        );
        registry.register("workqueue_depth", "Current depth of workqueue", m.workqueue_depth.clone());
        registry.register("workqueue_adds", "Total number of adds handled by workqueue", m.workqueue_adds.clone());
        registry.register("workqueue_retries", "Total number of retries handled by workqueue", m.workqueue_retries.clone());
        registry.register(
            "workqueue_work_duration_seconds",
            "How long in seconds processing an item from workqueue takes",
            m.workqueue_work_duration.clone(),
        );
        registry.register(
            "workqueue_queue_duration_seconds",
            "How long in seconds an item stays in workqueue before being requested",
            m.workqueue_queue_duration.clone(),
        );
        registry.register(
            "workqueue_unfinished_work_seconds",
            "How many seconds of work has been done that is in progress and hasn't been observed by work_duration",
            m.workqueue_unfinished.clone(),
        );
        registry.register(
            "workqueue_longest_running_processor_seconds",
            "How many seconds has the longest running processor for workqueue been running",
            m.workqueue_longest.clone(),
        );
        registry.register(
            "leader_election_master_status",
            "Gauge of if the reporting system is master of the relevant lease, 0 indicates backup, 1 indicates master",
            m.leader_election_master_status.clone(),
        );
        registry.register(
            "running_managed_controllers",
            "Indicates where instances of a controller are currently running",
            m.running_managed_controllers.clone(),
        );
        registry.register(
            "route_controller_route_sync",
            "A metric counting the amount of times routes have been synced",
            m.route_sync.clone(),
        );
        registry.register(
            "service_controller_loadbalancer_sync",
            "A metric counting the amount of times any load balancer has been configured",
            m.loadbalancer_sync.clone(),
        );
        registry.register(
            "service_controller_nodesync_latency_seconds",
            "A metric measuring the latency for nodesync which updates loadbalancer hosts on cluster node updates",
            m.nodesync_latency.clone(),
        );
        registry.register(
            "service_controller_update_loadbalancer_host_latency_seconds",
            "A metric measuring the latency for updating each load balancer hosts",
            m.update_host_latency.clone(),
        );
        registry.register(
            "service_controller_nodesync_error",
            "A metric counting the amount of times any load balancer has been configured and errored, as an effect of node/service changes on the cluster",
            m.nodesync_error.clone(),
        );
        registry.register(
            "node_controller_cloud_provider_taint_removal_delay_seconds",
            "Number of seconds after node creation when NodeController removed the cloud-provider taint of a single node",
            m.taint_removal_delay.clone(),
        );
        registry.register(
            "node_controller_initial_node_sync_delay_seconds",
            "Number of seconds after node creation when NodeController finished the initial synchronization of a single node",
            m.initial_node_sync_delay.clone(),
        );
        registry.register("process_cpu_seconds", "Total user and system CPU time spent in seconds", m.cpu_seconds.clone());
        registry.register("process_resident_memory_bytes", "Resident memory size in bytes", m.resident_memory.clone());
        registry.register("process_virtual_memory_bytes", "Virtual memory size in bytes", m.virtual_memory.clone());
        registry.register(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds",
            m.start_time.clone(),
        );
        registry.register("process_open_fds", "Number of open file descriptors", m.open_fds.clone());
        registry.register("process_max_fds", "Maximum number of open file descriptors", m.max_fds.clone());
        m
    }

    pub(crate) fn rest_request(&self, host: &str, method: &str, code: &str, elapsed: Duration) {
        let labels = RequestLabels { code: code.to_string(), host: host.to_string(), method: method.to_string() };
        self.rest_requests.get_or_create(&labels).inc();
        let labels = VerbLabels { host: host.to_string(), verb: method.to_string() };
        self.rest_latency.get_or_create(&labels).observe(elapsed.as_secs_f64());
    }

    pub(crate) fn rate_limited(&self, host: &str, verb: &str, waited: Duration) {
        let labels = VerbLabels { host: host.to_string(), verb: verb.to_string() };
        self.rest_rate_limiter.get_or_create(&labels).observe(waited.as_secs_f64());
    }

    pub(crate) fn queue_depth(&self, name: &str, depth: usize) {
        self.workqueue_depth.get_or_create(&label(name)).set(depth as i64);
    }

    pub(crate) fn queue_work(&self, name: &str, waits: &[Duration], unfinished: Duration, longest: Duration) {
        let labels = label(name);
        let histogram = self.workqueue_queue_duration.get_or_create(&labels);
        for wait in waits {
            histogram.observe(wait.as_secs_f64());
        }
        self.workqueue_unfinished.get_or_create(&labels).set(unfinished.as_secs_f64());
        self.workqueue_longest.get_or_create(&labels).set(longest.as_secs_f64());
    }

    pub(crate) fn queue_adds(&self, name: &str, adds: u64) {
        self.workqueue_adds.get_or_create(&label(name)).inc_by(adds);
    }

    pub(crate) fn reconcile(&self, name: &str, elapsed: Duration, failed: bool) {
        self.workqueue_work_duration.get_or_create(&label(name)).observe(elapsed.as_secs_f64());
        if failed {
            self.workqueue_retries.get_or_create(&label(name)).inc();
        }
    }

    pub(crate) fn lease_held(&self, lease: &str, held: bool) {
        self.leader_election_master_status.get_or_create(&label(lease)).set(i64::from(held));
    }

    pub(crate) fn controller_running(&self, name: &str, running: bool) {
        let labels = ManagedLabels { name: name.to_string(), manager: "cloud-controller-manager".into() };
        self.running_managed_controllers.get_or_create(&labels).set(i64::from(running));
    }

    pub(crate) fn route_sync(&self) {
        self.route_sync.inc();
    }

    pub(crate) fn load_balancer_sync(&self) {
        self.loadbalancer_sync.inc();
    }

    pub(crate) fn node_sync(&self, elapsed: Duration) {
        self.nodesync_latency.observe(elapsed.as_secs_f64());
    }

    pub(crate) fn hosts_update(&self, elapsed: Duration, failed: bool) {
        self.update_host_latency.observe(elapsed.as_secs_f64());
        if failed {
            self.nodesync_error.inc();
        }
    }

    pub(crate) fn node_initialised(&self, since_creation: Duration) {
        self.taint_removal_delay.observe(since_creation.as_secs_f64());
        self.initial_node_sync_delay.observe(since_creation.as_secs_f64());
    }

    /// Reads the process's figures from /proc, for a scrape.
    pub(crate) fn refresh_process(&self) {
        let Some(p) = ProcessFigures::read() else { return };
        let cpu = self.cpu_seconds.get();
        if p.cpu_seconds > cpu {
            self.cpu_seconds.inc_by(p.cpu_seconds - cpu);
        }
        self.resident_memory.set(p.resident as i64);
        self.virtual_memory.set(p.virtual_size as i64);
        self.start_time.set(p.start_time);
        self.open_fds.set(p.open_fds as i64);
        self.max_fds.set(p.max_fds as i64);
    }
}

/// A tower layer counting and timing a Kubernetes client's requests as client-go's
/// `rest_client_*` metrics do.
#[derive(Clone)]
pub struct RestClientLayer {
    metrics: UpstreamMetrics,
    host: String,
}

impl RestClientLayer {
    pub(crate) fn new(metrics: UpstreamMetrics, host: String) -> Self {
        Self { metrics, host }
    }
}

impl<S> tower::Layer<S> for RestClientLayer {
    type Service = RestClientService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RestClientService { inner, metrics: self.metrics.clone(), host: self.host.clone() }
    }
}

/// The service of [`RestClientLayer`].
#[derive(Clone)]
pub struct RestClientService<S> {
    inner: S,
    metrics: UpstreamMetrics,
    host: String,
}

impl<S, B, R> tower::Service<http::Request<B>> for RestClientService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = std::pin::Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let method = request.method().to_string();
        let started = std::time::Instant::now();
        let future = self.inner.call(request);
        let (metrics, host) = (self.metrics.clone(), self.host.clone());
        Box::pin(async move {
            let result = future.await;
            let code = match &result {
                Ok(response) => response.status().as_u16().to_string(),
                Err(_) => "<error>".to_string(),
            };
            metrics.rest_request(&host, &method, &code, started.elapsed());
            result
        })
    }
}

fn label(name: &str) -> NameLabels {
    NameLabels { name: name.to_string() }
}

/// What /proc says of this process.
#[derive(Debug, Clone, PartialEq)]
struct ProcessFigures {
    cpu_seconds: f64,
    resident: u64,
    virtual_size: u64,
    start_time: f64,
    open_fds: u64,
    max_fds: u64,
}

impl ProcessFigures {
    fn read() -> Option<Self> {
        // Clock ticks and pages: the Linux values every mainstream kernel uses.
        const TICKS: f64 = 100.0;
        const PAGE: u64 = 4096;
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // Fields after the command name (which may hold spaces, inside parentheses).
        let rest = stat.rsplit_once(')')?.1;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let number = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
        // Field 3 is the state (index 0 here); utime 14, stime 15, starttime 22, vsize 23, rss 24.
        let (utime, stime, start, vsize, rss) = (number(11)?, number(12)?, number(19)?, number(20)?, number(21)?);
        let boot = std::fs::read_to_string("/proc/stat")
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("btime ").and_then(|v| v.trim().parse::<u64>().ok()))?;
        let open_fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count() as u64).unwrap_or(0);
        let max_fds = std::fs::read_to_string("/proc/self/limits")
            .ok()?
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .and_then(|l| l.split_whitespace().nth(3).and_then(|v| v.parse().ok()))
            .unwrap_or(0);
        Some(Self {
            cpu_seconds: (utime + stime) as f64 / TICKS,
            resident: rss * PAGE,
            virtual_size: vsize,
            start_time: boot as f64 + start as f64 / TICKS,
            open_fds,
            max_fds,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_process_reads_itself() {
        let p = ProcessFigures::read().expect("/proc");
        assert!(p.resident > 1 << 20, "{p:?}");
        assert!(p.virtual_size >= p.resident, "{p:?}");
        assert!(p.open_fds >= 3 && p.max_fds >= p.open_fds, "{p:?}");
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs_f64();
        assert!(p.start_time <= now + 1.0 && p.start_time > now - 3600.0, "{p:?}");
    }

    #[test]
    fn upstreams_names_are_exposed() {
        let mut registry = Registry::default();
        let m = UpstreamMetrics::register(&mut registry);
        m.queue_depth("service", 3);
        m.queue_adds("service", 1);
        m.reconcile("service", Duration::from_millis(5), true);
        m.lease_held("cloud-controller-manager", true);
        m.controller_running("service-lb-controller", true);
        m.route_sync();
        m.refresh_process();
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        for series in [
            "workqueue_depth{name=\"service\"} 3",
            "workqueue_adds_total{name=\"service\"} 1",
            "workqueue_retries_total{name=\"service\"} 1",
            "workqueue_work_duration_seconds_count{name=\"service\"} 1",
            "leader_election_master_status{name=\"cloud-controller-manager\"} 1",
            "running_managed_controllers{name=\"service-lb-controller\",manager=\"cloud-controller-manager\"} 1",
            "route_controller_route_sync_total 1",
            "process_resident_memory_bytes ",
            "process_cpu_seconds_total ",
        ] {
            assert!(text.contains(series), "{series} missing:\n{text}");
        }
    }
}
