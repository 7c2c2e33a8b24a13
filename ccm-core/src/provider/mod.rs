//! The client of the provider sidecar: a lazily connected channel that reconnects by itself,
//! the plugin's identity and capabilities read at start and after every reconnect, readiness
//! from Probe, a deadline on every call, retries of retryable codes honouring RetryInfo, calls
//! paced to the rate the plugin declares, a client-side concurrency limit, and metrics by method, code and latency. The typed methods
//! the controllers call are in [`api`]; the checks their answers pass in [`check`].

pub mod access;
mod api;
pub mod check;
pub mod convert;
pub mod encoded;
pub mod fenced;
pub mod set;

pub use api::{PerLookup, TagChange};

use ccm_protocol::lock::Lock;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use ccm_proto::v1::identity_service_client::IdentityServiceClient;
use ccm_proto::v1::{self as pb, ServiceType};
use ccm_protocol::Error;
use ccm_protocol::client::ClientError;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::metrics::Metrics;

/// Retries of a transient error inside one call, before the error goes to the work queue.
const ATTEMPTS: u32 = 3;
/// A RetryInfo delay longer than this is not waited out inside a call: the caller's queue
/// backs off instead, so a worker is not held.
const MAX_INLINE_WAIT: Duration = Duration::from_secs(2);
/// Calls go out at this share of the rate a provider declares: sent exactly at it, a call
/// that arrives a few milliseconds early (the calls' own jitter) finds the cloud's bucket a
/// hair short and is refused (seen at 4 calls/s, burst 1: 248 ms after the one before).
const PACE_MARGIN: f64 = 0.98;
/// The name of the provider of a plain `--provider-endpoint` (no `NAME=`).
pub const DEFAULT_NAME: &str = "default";
/// How often an unreachable or unready provider is probed again.
const RECONNECT_PERIOD: Duration = Duration::from_secs(1);
/// The longest RetryInfo delay honoured unless `--provider-max-retry-after` says otherwise.
const DEFAULT_MAX_RETRY_AFTER: Duration = Duration::from_secs(300);
/// The deadline of a call that changes the cloud unless `--provider-mutation-timeout` says
/// otherwise.
const DEFAULT_MUTATION_TIMEOUT: Duration = Duration::from_secs(300);

fn identity_client(channel: Channel) -> IdentityServiceClient<Channel> {
    IdentityServiceClient::new(channel).max_decoding_message_size(ccm_protocol::client::MAX_MESSAGE_SIZE)
}

/// What the plugin said about itself.
#[derive(Debug, Clone, PartialEq)]
pub struct Identity {
    /// Plugin name.
    pub name: String,
    /// Plugin version.
    pub vendor_version: String,
    /// The scheme of its providerIDs; empty when it does not say.
    pub provider_id_scheme: String,
    /// More schemes of its providerIDs (GetPluginInfo's `additional_provider_id_schemes`).
    pub additional_schemes: Vec<String>,
    /// The generation of its state; empty when its state lives in the cloud.
    pub epoch: String,
    /// Capabilities.
    pub capabilities: pb::GetPluginCapabilitiesResponse,
}

impl Identity {
    /// Whether a service is advertised.
    pub fn serves(&self, service: ServiceType) -> bool {
        self.capabilities.services.contains(&(service as i32))
    }

    /// Whether a providerID is this provider's (always, when it advertises no scheme).
    pub fn owns(&self, provider_id: &str) -> bool {
        self.provider_id_scheme.is_empty()
            || ccm_protocol::names::provider_id_scheme(provider_id).is_some_and(|scheme| self.has_scheme(scheme))
    }

    /// Whether `scheme` is one of its providerID schemes.
    pub fn has_scheme(&self, scheme: &str) -> bool {
        self.schemes().any(|s| s == scheme)
    }

    /// Its providerID schemes: the main one first, none when it advertises none.
    pub fn schemes(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.provider_id_scheme.as_str())
            .chain(self.additional_schemes.iter().map(String::as_str))
            .filter(|s| !s.is_empty())
    }

    /// The `spec.loadBalancerClass` values its load balancers serve (capability).
    pub fn load_balancer_classes(&self) -> &[String] {
        self.capabilities.load_balancers.as_ref().map_or(&[], |c| c.classes.as_slice())
    }

    /// Whether `other` is another provider than this one (another name or providerID scheme),
    /// rather than this one at another version.
    pub fn is_other_than(&self, other: &Identity) -> bool {
        self.name != other.name
            || self.provider_id_scheme != other.provider_id_scheme
            || self.additional_schemes != other.additional_schemes
    }

    /// Whether batch instance reads are advertised.
    pub fn batch_reads(&self) -> bool {
        self.capabilities.instances.as_ref().is_some_and(|c| c.batch_reads)
    }

    /// Whether instance metadata carries the pod CIDRs the cloud gave (`pod_cidrs`).
    pub fn pod_cidrs(&self) -> bool {
        self.capabilities.instances.as_ref().is_some_and(|c| c.pod_cidrs)
    }

    /// Whether the cloud routes the pod CIDRs it gives (no route needed for them).
    pub fn pod_cidrs_routed(&self) -> bool {
        self.pod_cidrs() && self.capabilities.instances.as_ref().is_some_and(|c| c.pod_cidrs_routed)
    }

    /// Whether BatchSetInstanceTags is advertised.
    pub fn sets_tags(&self) -> bool {
        self.serves(ServiceType::Tags) && self.capabilities.tags.as_ref().is_some_and(|c| c.set_tags)
    }

    /// Whether instance metadata answers carry the tags (no TagsService call needed).
    pub fn metadata_tags(&self) -> bool {
        self.capabilities.instances.as_ref().is_some_and(|c| c.metadata_tags)
    }

    /// Whether ApplyRoutes is advertised.
    pub fn bulk_routes(&self) -> bool {
        self.capabilities.routes.as_ref().is_some_and(|c| c.bulk_apply)
    }

    /// Whether BatchUpdateLoadBalancerHosts is advertised.
    pub fn bulk_hosts(&self) -> bool {
        self.capabilities.load_balancers.as_ref().is_some_and(|c| c.bulk_update_hosts)
    }

    /// Whether the load balancers forward to pods where a Service has no node ports (the core
    /// then sends each such port's endpoints).
    pub fn pod_endpoints(&self) -> bool {
        self.capabilities.load_balancers.as_ref().is_some_and(|c| c.pod_endpoints)
    }

    /// Whether LoadBalancersService is advertised.
    pub fn serves_load_balancers(&self) -> bool {
        self.serves(ServiceType::LoadBalancers)
    }

    /// Whether RoutesService is advertised.
    pub fn serves_routes(&self) -> bool {
        self.serves(ServiceType::Routes)
    }

    /// Whether TagsService is advertised.
    pub fn serves_tags(&self) -> bool {
        self.serves(ServiceType::Tags)
    }

    /// Whether the provider lists load balancers (the orphan sweep needs it).
    pub fn lists_load_balancers(&self) -> bool {
        self.serves_load_balancers() && self.capabilities.load_balancers.as_ref().is_some_and(|c| c.list)
    }

    /// The provider's limits on load balancer names.
    pub fn name_limits(&self) -> ccm_protocol::names::NameLimits {
        self.capabilities.load_balancers.as_ref().map(ccm_protocol::names::NameLimits::from_capabilities).unwrap_or_default()
    }

    /// What its RoutesService can do.
    pub fn route_capabilities(&self) -> convert::RouteCapabilities {
        convert::RouteCapabilities::from(self.capabilities.routes.as_ref())
    }
}

/// The provider client; cheap to clone.
#[derive(Clone)]
pub struct Provider {
    channel: Channel,
    /// Its name in `--provider-endpoint=NAME=…` (`default` for the plain form): in logs,
    /// metrics, `/readyz` and the Node label that assigns Nodes to it.
    name: Arc<str>,
    endpoint: String,
    timeout: Duration,
    limit: Arc<Semaphore>,
    /// Until when the provider asked every caller to hold back (its last RetryInfo): calls
    /// wait for it before they start, instead of each finding out by being refused.
    throttled_until: Arc<std::sync::Mutex<Option<Instant>>>,
    /// The pace the provider declared for its calls (its capabilities' `call_rate`): every
    /// call but identity calls takes a token first, so that they are not sent only to be
    /// refused.
    pace: Arc<std::sync::Mutex<Option<Pace>>>,
    /// How many replicas' sidecars share the declared rate ([`Provider::share_rate`]).
    sharers: Arc<std::sync::atomic::AtomicUsize>,
    /// The longest RetryInfo delay honoured.
    max_retry_after: Duration,
    /// The deadline of a call that changes the cloud.
    mutation_timeout: Duration,
    metrics: Metrics,
    state: Arc<RwLock<State>>,
    changes: Arc<tokio::sync::watch::Sender<Changes>>,
    /// Wakes [`Provider::watch`] when a call finds the connection broken.
    broken: Arc<tokio::sync::Notify>,
    /// What the last instance reads said of each instance's state (shared by the controllers
    /// of this process: the lifecycle controller takes the node refresh's answers).
    recent: Arc<std::sync::Mutex<api::instances::RecentStates>>,
}

/// How often the provider changed under the core since it started: counters the controllers
/// watch ([`Provider::changes`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Changes {
    /// Times it came back with another epoch: its state may be lost, so routes are listed and
    /// load balancers ensured again.
    pub epochs: u64,
    /// Times it came back as another provider (name or providerID scheme): route deletions
    /// pause until a full resync under the new identity.
    pub identities: u64,
    /// Times its identity was read where there was none (its first connection): what is its
    /// (Nodes of its schemes, Services of its classes) is known from then on.
    pub connected: u64,
}

/// A declared call rate and the bucket that paces calls to it.
struct Pace {
    per_second: f64,
    burst: u32,
    /// How many replicas' sidecars share the rate (this process paces to its share).
    sharers: usize,
    bucket: Arc<ccm_protocol::ratelimit::TokenBucket>,
}

impl Pace {
    /// `per_second` and `burst` shared by `sharers` processes: each paces to its part (a
    /// burst of at least one call), so that the calls of all of them together stay within the
    /// rate the provider declared for its cloud.
    fn new(per_second: f64, burst: u32, sharers: usize) -> Self {
        let sharers = sharers.max(1);
        let n = sharers as f64;
        let part_burst = (burst as usize / sharers).max(1) as u32;
        let bucket = Arc::new(ccm_protocol::ratelimit::TokenBucket::new(per_second * PACE_MARGIN / n, part_burst));
        Self { per_second, burst, sharers, bucket }
    }
}

/// The rate a plugin declared, if it is one the core can pace to (finite, above zero; a burst
/// of 0 read as 1), or why not.
fn declared_rate(rate: Option<&pb::CallRate>) -> Result<Option<(f64, u32)>, String> {
    match rate {
        None => Ok(None),
        Some(r) if r.per_second.is_finite() && r.per_second > 0.0 => Ok(Some((r.per_second, r.burst.max(1)))),
        Some(r) => Err(format!("call_rate.per_second is {}, not a finite number above zero", r.per_second)),
    }
}

#[derive(Debug, Default)]
struct State {
    identity: Option<Arc<Identity>>,
    ready: bool,
    reason: String,
}

impl Provider {
    /// A client of `endpoint`; nothing is dialled until the first call.
    pub fn new(endpoint: &str, timeout: Duration, concurrency: usize, metrics: Metrics) -> Result<Self, ClientError> {
        Self::connect(endpoint, None, false, timeout, concurrency, metrics)
    }

    /// [`Provider::new`], over mutual TLS when `tls` gives the files (and the name the
    /// provider's certificate must be for, if not the endpoint's host); without TLS, TCP to
    /// another host only when `insecure_tcp` (`--provider-allow-insecure-tcp`).
    pub fn connect(
        endpoint: &str,
        tls: Option<(&ccm_protocol::tls::TlsFiles, Option<&str>)>,
        insecure_tcp: bool,
        timeout: Duration,
        concurrency: usize,
        metrics: Metrics,
    ) -> Result<Self, ClientError> {
        let channel = match tls {
            Some((files, name)) => ccm_protocol::client::connect_lazy_tls(endpoint, files, name)?,
            None => ccm_protocol::client::connect_lazy_allowing(endpoint, insecure_tcp)?,
        };
        Ok(Self::over(channel, endpoint, timeout, concurrency, metrics))
    }

    /// A client over `channel`, made by the caller (a simulation's in-memory connection),
    /// reporting `endpoint` as where it talks to.
    pub fn over(channel: Channel, endpoint: &str, timeout: Duration, concurrency: usize, metrics: Metrics) -> Self {
        Self {
            channel,
            name: Arc::from(DEFAULT_NAME),
            endpoint: endpoint.to_string(),
            timeout,
            limit: Arc::new(Semaphore::new(concurrency.max(1))),
            throttled_until: Default::default(),
            pace: Default::default(),
            sharers: Arc::new(std::sync::atomic::AtomicUsize::new(1)),
            max_retry_after: DEFAULT_MAX_RETRY_AFTER,
            mutation_timeout: DEFAULT_MUTATION_TIMEOUT,
            metrics,
            state: Arc::new(RwLock::new(State { reason: "provider not contacted yet".into(), ..Default::default() })),
            changes: Arc::new(tokio::sync::watch::channel(Changes::default()).0),
            broken: Default::default(),
            recent: Default::default(),
        }
    }

    /// The same client under the name `name` (its `--provider-endpoint=NAME=…`).
    pub fn named(mut self, name: &str) -> Self {
        self.name = Arc::from(name);
        self
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The same client honouring RetryInfo delays of at most `max` (default 5 minutes).
    pub fn with_max_retry_after(mut self, max: Duration) -> Self {
        self.max_retry_after = max;
        self
    }

    /// The same client giving calls that change the cloud a deadline of `timeout` (default 5
    /// minutes) instead of the call timeout.
    pub fn with_mutation_timeout(mut self, timeout: Duration) -> Self {
        self.mutation_timeout = timeout;
        self
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The identity read at the last (re)connect, if any (shared: controllers ask for it per
    /// Node on hot paths).
    pub fn identity(&self) -> Option<Arc<Identity>> {
        self.state.read().unwrap_or_else(|p| p.into_inner()).identity.clone()
    }

    /// The provider's changes of epoch and identity so far, to wait on.
    pub fn changes(&self) -> tokio::sync::watch::Receiver<Changes> {
        self.changes.subscribe()
    }

    /// Announces what a newly read identity says against the one before it: called once the
    /// new identity is the one [`Self::identity`] gives, so that a controller woken by the
    /// change reads the new epoch, not the old one (a service controller woken early took its
    /// records, keyed by the old epoch, as current and ensured nothing).
    fn compare(&self, before: Option<&Identity>, now: &Identity) {
        let Some(before) = before else { return };
        if before.is_other_than(now) {
            tracing::warn!(
                before = %before.name, before_scheme = %before.provider_id_scheme,
                now = %now.name, now_scheme = %now.provider_id_scheme,
                "the provider came back as another provider; route deletions pause until a full resync"
            );
            self.changes.send_modify(|c| c.identities += 1);
        }
        if !before.epoch.is_empty() && !now.epoch.is_empty() && before.epoch != now.epoch {
            tracing::warn!(before = %before.epoch, now = %now.epoch, "the provider's state may be lost (a new epoch); routes and load balancers are synced again now");
            self.changes.send_modify(|c| c.epochs += 1);
        }
    }

    /// Whether the provider is ready, and why not.
    pub fn readiness(&self) -> (bool, String) {
        let s = self.state.read().unwrap_or_else(|p| p.into_inner());
        (s.ready && s.identity.is_some(), s.reason.clone())
    }

    fn set_state(&self, ready: bool, reason: String, identity: Option<Option<Identity>>) {
        let mut s = self.state.write().unwrap_or_else(|p| p.into_inner());
        s.ready = ready;
        s.reason = reason;
        if let Some(identity) = identity {
            if let Some(identity) = &identity {
                self.set_pace(identity.capabilities.call_rate.as_ref());
            }
            let first = s.identity.is_none() && identity.is_some();
            s.identity = identity.map(Arc::new);
            drop(s);
            if first {
                self.changes.send_modify(|c| c.connected += 1);
            }
        }
    }

    /// Paces calls to the rate the provider declared: a new bucket (full) when the rate
    /// changed, none when it declares none or one that is not a rate.
    fn set_pace(&self, declared: Option<&pb::CallRate>) {
        let wanted = declared_rate(declared).unwrap_or_else(|problem| {
            tracing::warn!(provider = %self.name, %problem, "the provider declared an invalid call rate; its calls are not paced");
            None
        });
        let sharers = self.sharers.load(std::sync::atomic::Ordering::Relaxed).max(1);
        let mut pace = self.pace.locked();
        if pace.as_ref().map(|p| (p.per_second, p.burst, p.sharers)) == wanted.map(|(r, b)| (r, b, sharers)) {
            return;
        }
        *pace = wanted.map(|(per_second, burst)| {
            tracing::info!(provider = %self.name, per_second, burst, sharers, "pacing calls to the provider's declared call rate");
            Pace::new(per_second, burst, sharers)
        });
    }

    /// Shares the provider's declared call rate among `sharers` replicas (the live members with
    /// `--leader-elect-per-controller`, each with its own sidecar over the one cloud): this
    /// process paces to `1/sharers` of it from now on.
    pub fn share_rate(&self, sharers: usize) {
        let sharers = sharers.max(1);
        if self.sharers.swap(sharers, std::sync::atomic::Ordering::Relaxed) == sharers {
            return;
        }
        let mut pace = self.pace.locked();
        if let Some(p) = pace.as_mut() {
            tracing::info!(provider = %self.name, per_second = p.per_second, sharers, "the provider's call rate is shared with other replicas");
            *p = Pace::new(p.per_second, p.burst, sharers);
        }
    }

    /// Waits for a token of the declared call rate, if the provider declared one.
    async fn wait_for_pace(&self) {
        let bucket = self.pace.locked().as_ref().map(|p| p.bucket.clone());
        if let Some(bucket) = bucket {
            bucket.acquire().await;
        }
    }

    /// Waits while the provider has asked every caller to hold back.
    async fn wait_out_throttle(&self) {
        loop {
            let until = *self.throttled_until.locked();
            match until {
                Some(t) if t > Instant::now() => tokio::time::sleep_until(t).await,
                _ => return,
            }
        }
    }

    /// Calls the provider: a deadline on every attempt, up to three attempts for transient
    /// codes, paced to the call rate the provider declared, waiting out RetryInfo delays
    /// up to 2 s (longer ones are returned, for the caller's queue to back off), never
    /// retrying UNIMPLEMENTED or other final codes. A RetryInfo delay, at most
    /// `--provider-max-retry-after`, holds back every call of this process but identity calls,
    /// not only the refused one.
    async fn call<M: Clone, T>(
        &self,
        method: &'static str,
        message: M,
        rpc: impl AsyncFn(Channel, Request<M>) -> Result<Response<T>, Status>,
    ) -> Result<T, Error> {
        self.invoke(None, false, method, message, rpc).await
    }

    /// [`Provider::call`] for calls that change the cloud (mutations): every attempt, retries
    /// included, waits for `fence` first, so that none is sent once the lead it is made under
    /// is lost; the deadline is `--provider-mutation-timeout`; and a mutation that timed out
    /// is not retried here: it may still be running in the provider, and a second attempt
    /// would make two mutations of one object at once. Its work queue retries it after a
    /// backoff (by when the provider has finished it or, as the SDK and the Go adapter do,
    /// holds the retry until it has).
    async fn call_fenced<M: Clone, T>(
        &self,
        fence: Option<&crate::leader::Fence>,
        method: &'static str,
        message: M,
        rpc: impl AsyncFn(Channel, Request<M>) -> Result<Response<T>, Status>,
    ) -> Result<T, Error> {
        self.invoke(fence, true, method, message, rpc).await
    }

    /// One call, as [`Provider::call`] (`mutation` false) or [`Provider::call_fenced`].
    async fn invoke<M: Clone, T>(
        &self,
        fence: Option<&crate::leader::Fence>,
        mutation: bool,
        method: &'static str,
        message: M,
        rpc: impl AsyncFn(Channel, Request<M>) -> Result<Response<T>, Status>,
    ) -> Result<T, Error> {
        let timeout = if mutation { self.mutation_timeout } else { self.timeout };
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut request = Request::new(message.clone());
            request.set_timeout(timeout);
            let started = Instant::now();
            // Identity calls (Probe above all) are not held back: readiness must not wait for
            // the end of a RetryInfo.
            if !method.starts_with("IdentityService/") {
                self.wait_out_throttle().await;
                self.wait_for_pace().await;
            }
            let result = {
                let _permit = self.limit.acquire().await.map_err(|_| Error::unavailable("provider client closed"))?;
                // At send time, after every wait: a lead lost while this call waited for the
                // throttle or a slot sends nothing.
                if let Some(fence) = fence {
                    fence.check().await;
                }
                // Counted under the lead until answered: a Lease given up is released only
                // once nothing sent under it can still run (dropped unanswered, it counts
                // until its deadline).
                let flight = fence.filter(|_| mutation).map(|f| f.mutation(Instant::now() + timeout));
                let answer = tokio::time::timeout(timeout + Duration::from_secs(1), rpc(self.channel.clone(), request)).await;
                if let Some(flight) = flight {
                    flight.ended();
                }
                answer
            };
            let result =
                result.unwrap_or_else(|_| Err(Status::deadline_exceeded(format!("{method}: no answer within the deadline"))));
            let code = result.as_ref().map_or_else(Status::code, |_| tonic::Code::Ok);
            self.metrics.provider_call(&self.name, method, code, started.elapsed());
            let status = match result {
                Ok(response) => return Ok(response.into_inner()),
                Err(status) => status,
            };
            let error = Error::from_status(&status).with_retry_after_at_most(self.max_retry_after);
            if connection_lost(&status) {
                // The connection broke: the identity is re-read when it comes back. The probe
                // loop is woken when it just broke, not by every call while it stays broken
                // (its own calls among them): it looks again every second then.
                let was_ready = self.readiness().0;
                // With the causes: a refused peer (--provider-peer-uid), a missing socket.
                self.set_state(false, format!("provider unreachable: {}", crate::metrics::chain(&status)), None);
                if was_ready {
                    self.broken.notify_one();
                }
            }
            let wait = error.retry_after().unwrap_or(Duration::from_millis(100 * u64::from(attempt)));
            if let Some(delay) = error.retry_after() {
                let until = Instant::now() + delay;
                let mut gate = self.throttled_until.locked();
                if gate.is_none_or(|t| t < until) {
                    *gate = Some(until);
                }
            }
            let timed_out = matches!(status.code(), tonic::Code::DeadlineExceeded | tonic::Code::Cancelled);
            if !error.is_transient() || attempt >= ATTEMPTS || wait > MAX_INLINE_WAIT || (mutation && timed_out) {
                tracing::debug!(method, %error, attempt, "provider call failed");
                return Err(error);
            }
            tokio::time::sleep(wait).await;
        }
    }

    /// Reads the plugin's info and capabilities and probes it; updates readiness.
    pub async fn refresh(&self) -> Result<Identity, Error> {
        let info = self
            .call("IdentityService/GetPluginInfo", pb::GetPluginInfoRequest {}, async |ch, r| {
                identity_client(ch).get_plugin_info(r).await
            })
            .await;
        let info = match info {
            Ok(info) => info,
            Err(e) => {
                // A lost connection's reason, with its causes, was set by the call itself.
                if e.code() != tonic::Code::Unavailable || self.readiness().1.is_empty() {
                    self.set_state(false, format!("provider unreachable: {e}"), None);
                }
                return Err(e);
            }
        };
        let capabilities = self
            .call("IdentityService/GetPluginCapabilities", pb::GetPluginCapabilitiesRequest {}, async |ch, r| {
                identity_client(ch).get_plugin_capabilities(r).await
            })
            .await?;
        let identity = Identity {
            name: info.name,
            vendor_version: info.vendor_version,
            provider_id_scheme: info.provider_id_scheme,
            additional_schemes: info.additional_provider_id_schemes,
            epoch: info.epoch,
            capabilities,
        };
        let before = self.identity();
        let probe =
            self.call("IdentityService/Probe", pb::ProbeRequest {}, async |ch, r| identity_client(ch).probe(r).await).await;
        match probe {
            Ok(p) if p.ready => self.set_state(true, String::new(), Some(Some(identity.clone()))),
            Ok(p) => self.set_state(false, format!("provider not ready: {}", p.message), Some(Some(identity.clone()))),
            Err(e) => self.set_state(false, format!("provider probe failed: {e}"), Some(Some(identity.clone()))),
        }
        self.compare(before.as_deref(), &identity);
        Ok(identity)
    }

    /// Reads the provider's info and probes it every `period` until `stop`; re-reads its whole
    /// identity (capabilities too) whenever it was unreachable, had none, or its info changed
    /// (a restart, an upgrade), and logs when it changes.
    pub async fn watch(self, period: Duration, stop: CancellationToken) {
        loop {
            let had = self.identity();
            let (ready, _) = self.readiness();
            // A provider restarted between two probes is reached again by the channel without
            // an error: its info, read every period, tells (another epoch, name or version).
            let same = match (&had, ready) {
                (Some(had), true) => {
                    let info = self
                        .call("IdentityService/GetPluginInfo", pb::GetPluginInfoRequest {}, async |ch, r| {
                            identity_client(ch).get_plugin_info(r).await
                        })
                        .await;
                    info.is_ok_and(|i| {
                        i.name == had.name
                            && i.vendor_version == had.vendor_version
                            && i.provider_id_scheme == had.provider_id_scheme
                            && i.additional_provider_id_schemes == had.additional_schemes
                            && i.epoch == had.epoch
                    })
                }
                _ => false,
            };
            if !same {
                match self.refresh().await {
                    Ok(identity) if had.as_deref() != Some(&identity) => {
                        tracing::info!(provider = %self.name, plugin = %identity.name, version = %identity.vendor_version, "provider identity read");
                    }
                    Ok(_) => {}
                    Err(error) => {
                        tracing::warn!(provider = %self.name, endpoint = %self.endpoint, %error, "provider not reachable")
                    }
                }
            } else {
                let probe = self
                    .call("IdentityService/Probe", pb::ProbeRequest {}, async |ch, r| identity_client(ch).probe(r).await)
                    .await;
                match probe {
                    Ok(p) if p.ready => self.set_state(true, String::new(), None),
                    Ok(p) => self.set_state(false, format!("provider not ready: {}", p.message), None),
                    Err(e) => self.set_state(false, format!("provider probe failed: {e}"), None),
                }
            }
            // While it is unreachable or not ready, look again every second: a restarted
            // provider is back (and its identity re-read) at once, not a period later.
            let wait = if self.readiness().0 { period } else { period.min(RECONNECT_PERIOD) };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = self.broken.notified() => {}
                _ = stop.cancelled() => return,
            }
        }
    }
}

/// Whether a failed call's status is about the connection (it could not be made, or it broke),
/// not an answer of the provider's: tonic makes such a status from the transport's error and
/// keeps that error as its source; a status read off the wire, or made here for a deadline,
/// has none.
fn connection_lost(status: &Status) -> bool {
    status.code() == tonic::Code::Unavailable && std::error::Error::source(status).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_refused_connection_is_lost_and_a_provider_answer_is_not() {
        let dir = tempfile::tempdir().expect("dir");
        let endpoint = format!("unix://{}", dir.path().join("nobody.sock").display());
        let channel = ccm_protocol::client::connect_lazy(&endpoint).expect("endpoint");
        let status = identity_client(channel).probe(pb::ProbeRequest {}).await.expect_err("nothing listens");
        assert!(connection_lost(&status), "{status:?}");
        assert!(!connection_lost(&Status::unavailable("transport: the cloud's API is down")), "an answer, whatever it says");
        assert!(!connection_lost(&Status::deadline_exceeded("no answer within the deadline")));
    }

    #[test]
    fn a_declared_call_rate_is_paced_to_only_when_it_is_a_rate() {
        let rate = |per_second, burst| pb::CallRate { per_second, burst };
        assert_eq!(declared_rate(None), Ok(None));
        assert_eq!(declared_rate(Some(&rate(20.0, 40))), Ok(Some((20.0, 40))));
        assert_eq!(declared_rate(Some(&rate(0.5, 0))), Ok(Some((0.5, 1))), "a burst of 0 is one call");
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let problem = declared_rate(Some(&rate(bad, 5))).expect_err("not a rate");
            assert!(problem.contains("call_rate.per_second"), "{problem}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn calls_wait_for_the_declared_pace_until_it_is_withdrawn() {
        let provider =
            Provider::new("unix:///nonexistent/provider.sock", Duration::from_secs(1), 4, Metrics::default()).expect("client");
        provider.set_pace(Some(&pb::CallRate { per_second: 2.0, burst: 1 }));
        let started = Instant::now();
        for _ in 0..3 {
            provider.wait_for_pace().await;
        }
        // One at once, then one every 500 ms and the margin (1/1.96 s, to whole milliseconds).
        assert_eq!(started.elapsed(), Duration::from_millis(2 * 511), "paced just below the declared rate");
        // A new identity without a rate: no pacing any more.
        provider.set_pace(None);
        let started = Instant::now();
        for _ in 0..10 {
            provider.wait_for_pace().await;
        }
        assert_eq!(started.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn replicas_sharing_the_rate_each_pace_to_their_part() {
        let provider =
            Provider::new("unix:///nonexistent/provider.sock", Duration::from_secs(1), 4, Metrics::default()).expect("client");
        provider.set_pace(Some(&pb::CallRate { per_second: 10.0, burst: 4 }));
        provider.share_rate(2);
        let started = Instant::now();
        for _ in 0..12 {
            provider.wait_for_pace().await;
        }
        // A burst of 2, then 10 more at 5 a second (less the margin): about 2.04 s.
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(2000) && took < Duration::from_millis(2100), "{took:?}");
        // Alone again: the whole rate.
        provider.share_rate(1);
        let started = Instant::now();
        for _ in 0..14 {
            provider.wait_for_pace().await;
        }
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(1000) && took < Duration::from_millis(1050), "{took:?}");
    }
}
