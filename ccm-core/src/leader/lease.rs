//! Leader election on a `coordination.k8s.io` Lease, fenced.
//!
//! As client-go's leader election: the holder renews every `--leader-elect-retry-period`, and
//! a holder whose last successful renewal is older than `--leader-elect-renew-deadline` has
//! lost the lead, whatever the reason (the API server unreachable, a half-open connection,
//! the Lease taken by another). The renew deadline is shorter than the lease duration, so the
//! loss is known here before another replica may take the Lease: the caller stops acting at
//! once, and nothing this process writes after that can overlap a new leader's writes.
//!
//! Every renewal attempt runs under the remaining deadline (`tokio::time::timeout_at`) on a
//! client whose connect, read and write timeouts are the renew deadline: a request that hangs
//! cannot keep the lead alive. Taking a Lease another holds requires it to be expired both by
//! its `renewTime` on the wall clock and by what this process observed (its holder and
//! `renewTime` unchanged for a whole lease duration), so a skewed clock cannot make two
//! leaders. Writes are conditional on the `resourceVersion` read (a conflict is "not ours").

use ccm_protocol::lock::Lock;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Api;
use kube::api::PostParams;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// What to elect on.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The Lease's namespace and name.
    pub namespace: String,
    pub name: String,
    /// This process's holder identity.
    pub identity: String,
    /// How long a Lease holds without renewal.
    pub lease_duration: Duration,
    /// How long the holder may go without a successful renewal before it stops acting.
    pub renew_deadline: Duration,
    /// How often to try (acquiring, and renewing).
    pub retry_period: Duration,
    /// Labels and annotations the holder keeps on the Lease (a member Lease is labelled as
    /// one, and says which controller Leases its replica competes for).
    pub labels: std::collections::BTreeMap<String, String>,
    pub annotations: std::collections::BTreeMap<String, String>,
    /// Annotations whose value changes while the Lease is held (a member Lease's readiness,
    /// a controller's [`super::Ledger`]), written with each renewal.
    pub live_annotations: Option<std::sync::Arc<LiveAnnotations>>,
}

/// Annotations written with every renewal of a Lease, and how far they are written.
#[derive(Debug)]
pub struct LiveAnnotations {
    /// The annotations, and the count of changes made to them.
    values: std::sync::Mutex<(std::collections::BTreeMap<String, String>, u64)>,
    /// The count of changes the last successful write of the Lease carried.
    written: tokio::sync::watch::Sender<u64>,
}

impl Default for LiveAnnotations {
    fn default() -> Self {
        Self { values: Default::default(), written: tokio::sync::watch::channel(0).0 }
    }
}

impl LiveAnnotations {
    /// Sets `key` to `value` from the next write on; the change's number, for
    /// [`LiveAnnotations::until_written`].
    pub fn set(&self, key: &str, value: String) -> u64 {
        let mut values = self.values.locked();
        values.0.insert(key.to_string(), value);
        values.1 += 1;
        values.1
    }

    /// Forgets every value: a new tenure carries nothing of an earlier one (what the Lease
    /// holds now is what its controllers read, and an older value of this process's would
    /// overwrite what holders in between recorded).
    fn clear(&self) {
        self.values.locked().0.clear();
    }

    fn snapshot(&self) -> (std::collections::BTreeMap<String, String>, u64) {
        self.values.locked().clone()
    }

    fn wrote(&self, change: u64) {
        self.written.send_if_modified(|w| {
            let newer = change > *w;
            if newer {
                *w = change;
            }
            newer
        });
    }

    #[cfg(test)]
    pub fn wrote_for_test(&self, change: u64) {
        self.wrote(change);
    }

    /// Returns once a write of the Lease carrying change `change` succeeded.
    pub async fn until_written(&self, change: u64) {
        let mut written = self.written.subscribe();
        // The sender lives as long as `self`: the wait cannot fail while we are here.
        let _ = written.wait_for(|w| *w >= change).await;
    }
}

/// The lead, held: `lost` is cancelled when it is lost (and the renewing task ends);
/// [`Leadership::release`] gives the Lease up (the task clears its holder) and ends the task.
/// `fence` says, at any instant, whether the lead is still certain.
pub struct Leadership {
    pub lost: CancellationToken,
    pub fence: Fence,
    release: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Leadership {
    /// Gives the Lease up, unless it is lost already (then it is never written again), and
    /// waits until the renewing task has ended.
    pub async fn release(self) {
        self.release.cancel();
        if let Err(error) = self.task.await {
            tracing::error!(%error, "leader election: the renewing task failed");
        }
    }
}

/// Whether this process may still write as the leader: until its last successful renewal
/// plus the renew deadline, on the monotonic clock. Checked before every write, it closes the
/// gap a stopped process (SIGSTOP, a frozen VM) would otherwise have: resumed past its lease,
/// a controller may run before the renewing task notices the loss.
///
/// It also counts the mutations of the cloud sent under this lead that have not ended
/// ([`Fence::mutation`]): a Lease given up on purpose (a handover, a shutdown) is released
/// only once they have ([`Fence::quiesced`]), so that the next holder's mutations of an object
/// never overlap this one's, whatever the provider does with a cancelled call.
#[derive(Debug, Clone, Default)]
pub struct Fence {
    until: std::sync::Arc<std::sync::Mutex<Option<Instant>>>,
    flight: std::sync::Arc<Flight>,
}

/// The mutations in flight under one lead.
#[derive(Debug, Default)]
struct Flight {
    state: std::sync::Mutex<FlightState>,
    ended: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct FlightState {
    /// Sent and not answered yet.
    running: usize,
    /// The latest deadline of a mutation whose caller stopped waiting for its answer (the
    /// provider may go on with it until then).
    abandoned_until: Option<Instant>,
}

/// A mutation in flight under a lead: [`InFlight::ended`] once its answer came; dropped
/// without it (its caller was aborted), the mutation counts as running until its deadline.
#[derive(Debug)]
pub struct InFlight {
    flight: std::sync::Arc<Flight>,
    deadline: Instant,
    ended: bool,
}

impl InFlight {
    /// The provider answered (or the deadline passed): the mutation is over.
    pub fn ended(mut self) {
        self.ended = true;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut state = self.flight.state.locked();
        state.running = state.running.saturating_sub(1);
        if !self.ended && state.abandoned_until.is_none_or(|t| t < self.deadline) {
            state.abandoned_until = Some(self.deadline);
        }
        drop(state);
        self.flight.ended.notify_waiters();
    }
}

impl Fence {
    fn set(&self, until: Option<Instant>) {
        *self.until.locked() = until;
    }

    /// True while the lead is certain.
    pub fn holds(&self) -> bool {
        self.until.locked().is_some_and(|t| Instant::now() < t)
    }

    /// Returns while the lead is certain; never, once it is not (the caller's task is about
    /// to be aborted: the write it was about to make is not made).
    pub async fn check(&self) {
        if !self.holds() {
            tracing::warn!("the lead is no longer certain: holding a write back for good");
            std::future::pending::<()>().await;
        }
    }

    /// Counts a mutation about to be sent, whose deadline is `deadline`, until it ends.
    pub fn mutation(&self, deadline: Instant) -> InFlight {
        self.flight.state.locked().running += 1;
        InFlight { flight: self.flight.clone(), deadline, ended: false }
    }

    /// How many mutations are in flight, counting those abandoned before their deadline.
    pub fn in_flight(&self) -> usize {
        let state = self.flight.state.locked();
        state.running + usize::from(state.abandoned_until.is_some_and(|t| t > Instant::now()))
    }

    /// Returns once every mutation sent under this lead and still awaited was answered (or
    /// gave up at its deadline); those abandoned are not waited for.
    pub async fn answered(&self) {
        loop {
            let ended = self.flight.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            if self.flight.state.locked().running == 0 {
                return;
            }
            ended.await;
        }
    }

    /// Returns once no mutation sent under this lead can still be running: every one
    /// answered, and the deadline of every one abandoned passed.
    pub async fn quiesced(&self) {
        loop {
            let ended = self.flight.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            let (running, until) = {
                let state = self.flight.state.locked();
                (state.running, state.abandoned_until)
            };
            match (running, until) {
                (0, None) => return,
                (0, Some(t)) if t <= Instant::now() => return,
                (0, Some(t)) => tokio::time::sleep_until(t).await,
                _ => ended.await,
            }
        }
    }
}

/// A client for the Lease only, from `config`: its connect, read and write timeouts are the
/// renew deadline (the controllers' client keeps long reads for its watches).
pub fn client(
    config: &kube::Config,
    renew_deadline: Duration,
    metrics: &crate::metrics::Metrics,
) -> Result<kube::Client, kube::Error> {
    metrics.kube_client(lease_config(config, renew_deadline))
}

/// The configuration of the Lease's client (see [`client`]).
pub fn lease_config(config: &kube::Config, renew_deadline: Duration) -> kube::Config {
    let mut config = config.clone();
    config.connect_timeout = Some(renew_deadline);
    config.read_timeout = Some(renew_deadline);
    config.write_timeout = Some(renew_deadline);
    config
}

/// The Lease as last read, and when this process saw its holder or renewal change.
#[derive(Debug, Default)]
pub struct Observed {
    record: Option<(String, Option<MicroTime>)>,
    at: Option<Instant>,
    /// Since when the Lease has been seen free to take (absent, released or expired), in a row.
    available: Option<Instant>,
}

impl Observed {
    /// Records what was read; true when it is unchanged for a whole `duration`.
    fn stale(&mut self, holder: &str, renewed: &Option<MicroTime>, duration: Duration) -> bool {
        let record = Some((holder.to_string(), renewed.clone()));
        if self.record != record {
            self.record = record;
            self.at = Some(Instant::now());
        }
        self.at.is_some_and(|at| at.elapsed() > duration)
    }

    /// Records whether the Lease is free to take; true once it has been for `patience`.
    fn waited(&mut self, available: bool, patience: Duration) -> bool {
        if !available {
            self.available = None;
            return false;
        }
        self.available.get_or_insert_with(Instant::now).elapsed() >= patience
    }
}

fn now() -> MicroTime {
    MicroTime(crate::clock::now())
}

/// Takes or renews the Lease for `s.identity`: true when it is ours afterwards, false when
/// another holds it (or won a race for it), or when it is free but has not been for
/// `patience` yet (a replica that does not prefer this Lease leaves it to one that does).
pub async fn try_acquire_or_renew(
    api: &Api<Lease>,
    s: &Settings,
    observed: &mut Observed,
    patience: Duration,
) -> Result<bool, kube::Error> {
    let seconds = i32::try_from(s.lease_duration.as_secs().max(1)).unwrap_or(i32::MAX);
    let mut annotations = s.annotations.clone();
    // Taking the Lease (not renewing it), the live values of an earlier tenure are not
    // carried: see `LiveAnnotations::clear`.
    let taking = |annotations: &mut std::collections::BTreeMap<String, String>| {
        *annotations = s.annotations.clone();
        if let Some(live) = &s.live_annotations {
            live.clear();
        }
    };
    let mut change = 0;
    if let Some(live) = &s.live_annotations {
        let (values, n) = live.snapshot();
        annotations.extend(values);
        change = n;
    }
    let wrote = |ok: bool| {
        if let (true, Some(live)) = (ok, &s.live_annotations) {
            live.wrote(change);
        }
        ok
    };
    let labels = (!s.labels.is_empty()).then(|| s.labels.clone());
    let Some(mut lease) = api.get_opt(&s.name).await? else {
        if !observed.waited(true, patience) {
            return Ok(false);
        }
        taking(&mut annotations);
        let annotations = (!annotations.is_empty()).then_some(annotations);
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(s.name.clone()),
                namespace: Some(s.namespace.clone()),
                annotations,
                labels,
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(s.identity.clone()),
                lease_duration_seconds: Some(seconds),
                acquire_time: Some(now()),
                renew_time: Some(now()),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        };
        return match api.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(wrote(true)),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e),
        };
    };
    let spec = lease.spec.clone().unwrap_or_default();
    let holder = spec.holder_identity.clone().unwrap_or_default();
    let ours = holder == s.identity;
    if !ours {
        let available = holder.is_empty() || {
            let duration = Duration::from_secs(u64::try_from(spec.lease_duration_seconds.unwrap_or(seconds).max(1)).unwrap_or(1));
            let wall_expired = spec.renew_time.as_ref().is_none_or(|t| {
                let expires = t.0.as_millisecond() + i64::try_from(duration.as_millis()).unwrap_or(i64::MAX);
                expires < crate::clock::now().as_millisecond()
            });
            let seen_expired = observed.stale(&holder, &spec.renew_time, duration);
            wall_expired && seen_expired
        };
        if !observed.waited(available, patience) {
            return Ok(false);
        }
        if !holder.is_empty() {
            tracing::info!(lease = %s.name, previous = %holder, "leader election: the Lease expired; taking it");
        }
        taking(&mut annotations);
    }
    let annotations = (!annotations.is_empty()).then_some(annotations);
    if let Some(annotations) = annotations {
        lease.metadata.annotations.get_or_insert_with(Default::default).extend(annotations);
    }
    if let Some(labels) = labels {
        lease.metadata.labels.get_or_insert_with(Default::default).extend(labels);
    }
    lease.spec = Some(LeaseSpec {
        holder_identity: Some(s.identity.clone()),
        lease_duration_seconds: Some(seconds),
        acquire_time: if ours { spec.acquire_time } else { Some(now()) },
        renew_time: Some(now()),
        lease_transitions: Some(spec.lease_transitions.unwrap_or(0) + i32::from(!ours)),
        ..spec
    });
    // Conditional on the resourceVersion read: a concurrent writer makes this a conflict.
    // Renewing our own Lease, a conflict is an error (retried within the renew deadline:
    // someone annotated it), not a loss; taking it, another won the race.
    match api.replace(&s.name, &PostParams::default(), &lease).await {
        Ok(_) => Ok(wrote(true)),
        Err(kube::Error::Api(e)) if e.code == 409 && !ours => Ok(false),
        Err(e) => Err(e),
    }
}

/// Clears the holder if it is still us, so that another replica takes over at once.
async fn release(api: &Api<Lease>, s: &Settings) {
    let result = async {
        let Some(mut lease) = api.get_opt(&s.name).await? else { return Ok(()) };
        let spec = lease.spec.clone().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(s.identity.as_str()) {
            return Ok(());
        }
        lease.spec = Some(LeaseSpec { holder_identity: None, renew_time: Some(now()), ..spec });
        api.replace(&s.name, &PostParams::default(), &lease).await.map(|_| ())
    };
    match tokio::time::timeout(s.renew_deadline, result).await {
        Ok(Ok(())) => tracing::info!(lease = %s.name, "leader election: released the Lease"),
        Ok(Err(error)) => tracing::warn!(lease = %s.name, %error, "leader election: releasing the Lease failed"),
        Err(_) => tracing::warn!(lease = %s.name, "leader election: releasing the Lease timed out"),
    }
}

/// Waits until `s.identity` holds the Lease, trying every retry period; `None` when `stop`
/// is cancelled first. `patience` says, at each try, how long the Lease must have been free
/// before this process takes it (zero: at once). The returned lead is renewed in the
/// background until lost or released.
pub async fn acquire(
    client: &kube::Client,
    s: &Settings,
    stop: &CancellationToken,
    patience: impl Fn() -> Duration,
) -> Option<Leadership> {
    let api: Api<Lease> = Api::namespaced(client.clone(), &s.namespace);
    let mut observed = Observed::default();
    loop {
        // The lead counts from when the winning request was sent, not from its answer: an
        // answer that comes late must not stretch the fence past the Lease others see.
        let sent = Instant::now();
        let attempt = tokio::time::timeout(s.renew_deadline, try_acquire_or_renew(&api, s, &mut observed, patience())).await;
        match attempt {
            Ok(Ok(true)) => return Some(hold(api, s.clone(), sent, observed)),
            Ok(Ok(false)) => {}
            Ok(Err(error)) => tracing::warn!(lease = %s.name, %error, "leader election: reading or taking the Lease failed"),
            Err(_) => tracing::warn!(lease = %s.name, "leader election: no answer from the API server within the renew deadline"),
        }
        tokio::select! {
            _ = tokio::time::sleep(s.retry_period) => {}
            _ = stop.cancelled() => return None,
        }
        if stop.is_cancelled() {
            return None;
        }
    }
}

/// The Lease, just taken by a request sent at `last`: renewed in the background every retry
/// period until it is lost or released.
pub fn hold(api: Api<Lease>, s: Settings, mut last: Instant, mut observed: Observed) -> Leadership {
    let (lost, give_up) = (CancellationToken::new(), CancellationToken::new());
    let fence = Fence::default();
    fence.set(Some(last + s.renew_deadline));
    let renewed = fence.clone();
    let (lost_tx, released) = (lost.clone(), give_up.clone());
    let task = tokio::spawn(async move {
        // However this task ends, a panic included, the lead is lost unless it was released.
        let on_exit = lost_tx.clone().drop_guard();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(s.retry_period) => {}
                _ = released.cancelled() => {
                    renewed.set(None);
                    on_exit.disarm();
                    release(&api, &s).await;
                    return;
                }
            }
            let deadline = last + s.renew_deadline;
            let sent = Instant::now();
            match tokio::time::timeout_at(deadline, try_acquire_or_renew(&api, &s, &mut observed, Duration::ZERO)).await {
                Ok(Ok(true)) => {
                    // Anchored to when the renewal was sent (see above).
                    last = sent;
                    renewed.set(Some(last + s.renew_deadline));
                    continue;
                }
                Ok(Ok(false)) => tracing::error!(lease = %s.name, "leader election: another holder has the Lease"),
                Ok(Err(error)) if Instant::now() < deadline => {
                    tracing::warn!(lease = %s.name, %error, "leader election: renewing the Lease failed; retrying");
                    continue;
                }
                Ok(Err(error)) => {
                    tracing::error!(lease = %s.name, %error, "leader election: not renewed within the renew deadline")
                }
                Err(_) => tracing::error!(lease = %s.name, "leader election: not renewed within the renew deadline"),
            }
            // Lost: say so, and never write the Lease again (another may hold it).
            renewed.set(None);
            lost_tx.cancel();
            return;
        }
    });
    Leadership { lost, fence, release: give_up, task }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `quiesced` has returned after letting the runtime run.
    async fn returned(fence: &Fence) -> bool {
        tokio::time::timeout(Duration::from_millis(1), fence.quiesced()).await.is_ok()
    }

    #[tokio::test(start_paused = true)]
    async fn a_lead_is_quiet_once_every_mutation_answered_and_abandoned_ones_reached_their_deadline() {
        let fence = Fence::default();
        assert!(returned(&fence).await, "nothing sent");
        let answered = fence.mutation(Instant::now() + Duration::from_secs(30));
        let abandoned = fence.mutation(Instant::now() + Duration::from_secs(10));
        assert_eq!(fence.in_flight(), 2);
        assert!(!returned(&fence).await, "two running");
        answered.ended();
        assert!(!returned(&fence).await, "one running");
        // Its caller was aborted: the provider may go on with it until its deadline.
        drop(abandoned);
        assert_eq!(fence.in_flight(), 1);
        let waiter = tokio::spawn({
            let fence = fence.clone();
            async move { fence.quiesced().await }
        });
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert!(!waiter.is_finished(), "an abandoned mutation counts until its deadline");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(waiter.await.is_ok());
        assert_eq!(fence.in_flight(), 0);
        assert!(returned(&fence).await);
    }

    /// A replica that takes a controller Lease again after a handover carries nothing of its
    /// first tenure: what the holder in between recorded stays (it was overwritten before).
    #[tokio::test]
    async fn a_second_tenure_keeps_what_the_holder_in_between_spent() {
        use std::sync::{Arc, Mutex};
        let store: Arc<Mutex<Option<serde_json::Value>>> = Default::default();
        let shared = store.clone();
        let service = tower::service_fn(move |request: http::Request<kube::client::Body>| {
            let store = shared.clone();
            async move {
                use http_body_util::BodyExt as _;
                let (parts, body) = request.into_parts();
                let bytes = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                let mut stored = store.lock().expect("test");
                let (code, value) = if parts.method == http::Method::GET {
                    match stored.as_ref() {
                        Some(v) => (200, v.clone()),
                        None => (
                            404,
                            serde_json::json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"}),
                        ),
                    }
                } else {
                    let mut v: serde_json::Value = serde_json::from_slice(&bytes).expect("test");
                    let rv = stored
                        .as_ref()
                        .and_then(|o| o["metadata"]["resourceVersion"].as_str().and_then(|s| s.parse::<u64>().ok()))
                        .unwrap_or(0)
                        + 1;
                    v["metadata"]["resourceVersion"] = serde_json::json!(rv.to_string());
                    *stored = Some(v.clone());
                    (if parts.method == http::Method::POST { 201 } else { 200 }, v)
                };
                let response = http::Response::builder()
                    .status(code)
                    .header("content-type", "application/json")
                    .body(http_body_util::Full::new(bytes::Bytes::from(serde_json::to_vec(&value).expect("test"))))
                    .expect("test");
                Ok::<_, std::convert::Infallible>(response)
            }
        });
        let client = kube::Client::new(service, "ns");
        let api: Api<Lease> = Api::namespaced(client, "ns");
        let settings = |identity: &str, live: &Arc<LiveAnnotations>| Settings {
            namespace: "ns".into(),
            name: "l".into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
            labels: Default::default(),
            annotations: Default::default(),
            live_annotations: Some(live.clone()),
        };
        let key = "ccm-rs.dev/spent.node-deletions.default";
        let spent = |store: &Arc<Mutex<Option<serde_json::Value>>>| {
            store.lock().expect("test").as_ref().and_then(|l| l["metadata"]["annotations"][key].as_str().map(str::to_string))
        };
        // As leader/mod.rs lead_group: one LiveAnnotations per group, kept across tenures.
        let (live_a, live_b) = (Arc::new(LiveAnnotations::default()), Arc::new(LiveAnnotations::default()));
        let (sa, sb) = (settings("a", &live_a), settings("b", &live_b));
        let (mut oa, mut ob) = (Observed::default(), Observed::default());
        // Tenure 1: A deletes one Node (recorded at 1000).
        assert!(try_acquire_or_renew(&api, &sa, &mut oa, Duration::ZERO).await.expect("test"));
        live_a.set(key, "1000".into());
        assert!(try_acquire_or_renew(&api, &sa, &mut oa, Duration::ZERO).await.expect("test"));
        release(&api, &sa).await;
        // B takes it over, reads 1000, deletes another (recorded: 1000,2000).
        assert!(try_acquire_or_renew(&api, &sb, &mut ob, Duration::ZERO).await.expect("test"));
        assert_eq!(spent(&store).as_deref(), Some("1000"));
        live_b.set(key, "1000,2000".into());
        assert!(try_acquire_or_renew(&api, &sb, &mut ob, Duration::ZERO).await.expect("test"));
        assert_eq!(spent(&store).as_deref(), Some("1000,2000"));
        release(&api, &sb).await;
        // The Lease is handed back to A: its controllers read the record after this write.
        assert!(try_acquire_or_renew(&api, &sa, &mut oa, Duration::ZERO).await.expect("test"));
        assert_eq!(spent(&store).as_deref(), Some("1000,2000"), "B's deletion is still counted after A takes the Lease again");
    }
}
