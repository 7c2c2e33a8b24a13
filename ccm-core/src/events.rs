//! Event recording in bounded memory.
//!
//! An Event repeated within six minutes (same controller, object, type and reason, whatever
//! its note says) is not created again: the first one's series is counted up, keeping the
//! first note, as client-go's `events` recorder does. The count is written at the second
//! occurrence and then at most every [`SERIES_REFRESH`] (in between it is counted in memory),
//! so that a condition a controller reports on every pass costs one write per object and
//! reason, not one per pass. What
//! that takes is remembered for at most [`MAX_SERIES`] Events, the least recently repeated
//! forgotten first (client-go's correlator keeps 4096 too); a forgotten one is created anew
//! when it comes again. At most [`MAX_PENDING`] Events wait for the Event write budget; more
//! are dropped and counted, as client-go's broadcaster drops them when its queue is full, so
//! that a burst of Events never holds memory or delays a reconcile.
//!
//! (kube-runtime's `Recorder` keeps every Event it sent, whole, for six minutes and scans them
//! all on every publish: at 5000 Nodes and 5000 Services that was 80 MiB of the core's peak.)

use ccm_protocol::lock::Lock;
use std::hash::{Hash, Hasher};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use lru::LruCache;

/// How many Events' series are remembered.
pub const MAX_SERIES: usize = 4096;
/// How many Events may wait for the write budget at once.
pub const MAX_PENDING: usize = 1000;
/// How long after its last occurrence an Event is still counted up rather than created anew.
pub const SERIES_WINDOW: SignedDuration = SignedDuration::from_secs(6 * 60);
/// How often a repeating Event's count is written, at most, after its second occurrence.
pub const SERIES_REFRESH: SignedDuration = SignedDuration::from_secs(5 * 60);

/// An Event's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    /// Something went as it should.
    Normal,
    /// Something a user may have to act on.
    Warning,
}

impl EventType {
    /// As the API spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Normal => "Normal",
            Self::Warning => "Warning",
        }
    }
}

/// Every Event reason the controllers record, in one place: users alert on them, and
/// upstream's are kept as upstream spells them.
pub mod reason {
    /// A Node was initialised from the cloud (upstream's).
    pub const SYNCED: &str = "Synced";
    /// A Node cannot be initialised from the cloud's answer.
    pub const NODE_INITIALIZATION_FAILED: &str = "NodeInitializationFailed";
    /// A Node's claimed zone, region or instance type was corrected from the cloud's.
    pub const NODE_METADATA_CORRECTED: &str = "NodeMetadataCorrected";
    /// Instance tags that cannot be labels were not copied.
    pub const INVALID_INSTANCE_TAGS: &str = "InvalidInstanceTags";
    /// With several providers: more than one provider knows the instance of a Node that has
    /// neither providerID nor provider label; it is left uninitialised (never guessed).
    pub const PROVIDER_CONFLICT: &str = "ProviderConflict";
    /// With several providers: a Node waiting for initialisation names, in its
    /// `ccm-rs.dev/provider` label, a provider this core does not have; it is left alone.
    pub const UNKNOWN_PROVIDER: &str = "UnknownProvider";
    /// With several providers: no provider has known the instance of a Node without
    /// providerID nor provider label for [`crate::controllers::owners::UNKNOWN_AFTER`]; it
    /// stays uninitialised, and is deleted by no one (the core never guesses whose it is).
    pub const PROVIDER_NOT_FOUND: &str = "ProviderNotFound";
    /// With several providers: the one provider that knows a Node's instance was recorded on
    /// it (the `ccm-rs.dev/provider` label).
    pub const PROVIDER_ASSIGNED: &str = "ProviderAssigned";
    /// A provider answer failed the protocol's checks; nothing of it was acted on.
    pub const INVALID_PROVIDER_ANSWER: &str = "InvalidProviderAnswer";
    /// Route deletions pause: the provider came back as another provider.
    pub const ROUTE_DELETIONS_PAUSED: &str = "RouteDeletionsPaused";
    /// A resync found routes changed behind the controller's back.
    pub const ROUTES_DRIFTED: &str = "RoutesDrifted";
    /// A Node's route could not be created (upstream's).
    pub const FAILED_TO_CREATE_ROUTE: &str = "FailedToCreateRoute";
    /// No pod CIDR is left for a Node (upstream's).
    pub const CIDR_NOT_AVAILABLE: &str = "CIDRNotAvailable";
    /// A Node's pod CIDRs could not be written (upstream's).
    pub const CIDR_ASSIGNMENT_FAILED: &str = "CIDRAssignmentFailed";
    /// A Node whose instance is gone is deleted (upstream's).
    pub const DELETING_NODE: &str = "DeletingNode";
    /// Deleting a Node failed.
    pub const DELETING_NODE_FAILED: &str = "DeletingNodeFailed";
    /// A Node deletion waits for room under the deletion bound.
    pub const NODE_DELETION_DEFERRED: &str = "NodeDeletionDeferred";
    /// A Node deletion is refused (the evidence did not hold).
    pub const NODE_DELETION_REFUSED: &str = "NodeDeletionRefused";
    /// A shut-down Node is taken out of service.
    pub const NODE_OUT_OF_SERVICE: &str = "NodeOutOfService";
    /// Taking a Node out of service waits for room under its bound.
    pub const NODE_OUT_OF_SERVICE_DEFERRED: &str = "NodeOutOfServiceDeferred";
    /// Taking a Node out of service is refused.
    pub const NODE_OUT_OF_SERVICE_REFUSED: &str = "NodeOutOfServiceRefused";
    /// A Node taken out of service is back.
    pub const NODE_BACK_IN_SERVICE: &str = "NodeBackInService";
    /// Ensuring a load balancer starts (upstream's).
    pub const ENSURING_LOAD_BALANCER: &str = "EnsuringLoadBalancer";
    /// A load balancer was ensured (upstream's).
    pub const ENSURED_LOAD_BALANCER: &str = "EnsuredLoadBalancer";
    /// Ensuring a load balancer failed, or the Service is invalid (upstream's).
    pub const SYNC_LOAD_BALANCER_FAILED: &str = "SyncLoadBalancerFailed";
    /// A load balancer's hosts were updated (upstream's).
    pub const UPDATED_LOAD_BALANCER: &str = "UpdatedLoadBalancer";
    /// Updating a load balancer's hosts failed (upstream's).
    pub const UPDATE_LOAD_BALANCER_FAILED: &str = "UpdateLoadBalancerFailed";
    /// No Node is a load balancer backend (upstream's).
    pub const UNAVAILABLE_LOAD_BALANCER: &str = "UnAvailableLoadBalancer";
    /// Deleting a load balancer starts (upstream's).
    pub const DELETING_LOAD_BALANCER: &str = "DeletingLoadBalancer";
    /// A load balancer was deleted (upstream's).
    pub const DELETED_LOAD_BALANCER: &str = "DeletedLoadBalancer";
    /// Deleting a load balancer failed (upstream's).
    pub const DELETE_LOAD_BALANCER_FAILED: &str = "DeleteLoadBalancerFailed";
    /// A load balancer keeps the name it was made under.
    pub const LOAD_BALANCER_NAME_KEPT: &str = "LoadBalancerNameKept";
    /// A load balancer was made anew under its new name.
    pub const RENAMED_LOAD_BALANCER: &str = "RenamedLoadBalancer";
    /// A Service's recorded load balancer name is not one of its own (ours; upstream records none).
    pub const LOAD_BALANCER_NAME_REFUSED: &str = "LoadBalancerNameRefused";
    /// A Service's recorded provider holds no load balancer of it (ours; upstream has one provider).
    pub const LOAD_BALANCER_PROVIDER_REFUSED: &str = "LoadBalancerProviderRefused";
    /// An instance has a tag of a key the tagging controller writes, with another value.
    pub const INSTANCE_TAG_CONFLICT: &str = "InstanceTagConflict";
    /// Writing tags to an instance failed.
    pub const INSTANCE_TAGS_FAILED: &str = "InstanceTagsFailed";
    /// A load balancer gone from the cloud (deleted behind the core's back) was made again.
    pub const LOAD_BALANCER_RECREATED: &str = "LoadBalancerRecreated";
    /// A load balancer's backends were changed behind the core's back; it is given its own again.
    pub const LOAD_BALANCER_HOSTS_DRIFTED: &str = "LoadBalancerHostsDrifted";
}

/// One Event to record.
#[derive(Debug, Clone)]
pub struct Note {
    /// The reporting controller.
    pub controller: String,
    /// The object it is about.
    pub regarding: ObjectReference,
    /// Normal or Warning.
    pub event_type: EventType,
    /// Why (CamelCase).
    pub reason: String,
    /// What happened, for a human.
    pub note: String,
}

impl Note {
    fn key(&self) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        // Not the note: an Event whose text changes (a count, a time) is one series.
        (&self.controller, self.event_type, &self.reason).hash(&mut h);
        let r = &self.regarding;
        (&r.api_version, &r.kind, &r.namespace, &r.name, &r.uid).hash(&mut h);
        h.finish()
    }

    /// The namespace the Event is written to: the object's, or `default` for a cluster-scoped
    /// object (as client-go).
    fn namespace(&self) -> String {
        self.regarding.namespace.clone().filter(|n| !n.is_empty()).unwrap_or_else(|| "default".into())
    }
}

/// An Event sent, as far as counting it up needs.
#[derive(Debug)]
struct Sent {
    name: String,
    count: i32,
    last: Timestamp,
    /// When its count was last written (or it was created).
    written: Timestamp,
}

/// What to write for one occurrence.
#[derive(Debug, PartialEq)]
enum Write {
    /// A new Event of this name.
    Create { name: String },
    /// The existing Event's series, now at `count`.
    Count { name: String, count: i32 },
    /// Counted up in memory; the count is written later.
    Held,
}

/// How many locks the Event series are spread over.
const STRIPES: usize = 64;

/// Records Events through one client.
pub struct Recorder {
    client: kube::Client,
    series: Mutex<LruCache<u64, Sent>>,
    /// Occurrences of one series are written one after the other (by the series' stripe):
    /// a count sent before the Event it counts was created would find nothing, and a second
    /// Event of the series would be made.
    stripes: Vec<tokio::sync::Mutex<()>>,
    pending: AtomicUsize,
    dropped: AtomicUsize,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder").field("pending", &self.pending.load(Ordering::Relaxed)).finish_non_exhaustive()
    }
}

/// A place in the line of Events waiting for the write budget, given back when dropped.
pub struct Pending(Arc<Recorder>);

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.pending.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Recorder {
    /// A recorder writing through `client`.
    pub fn new(client: kube::Client) -> Self {
        let capacity = NonZeroUsize::new(MAX_SERIES).unwrap_or(NonZeroUsize::MIN);
        Self {
            client,
            series: Mutex::new(LruCache::new(capacity)),
            stripes: (0..STRIPES).map(|_| tokio::sync::Mutex::new(())).collect(),
            pending: AtomicUsize::new(0),
            dropped: AtomicUsize::new(0),
        }
    }

    /// A place in the line, or `None` (the Event is dropped and counted) when
    /// [`MAX_PENDING`] Events already wait.
    pub fn enqueue(self: &Arc<Self>) -> Option<Pending> {
        if self.pending.fetch_add(1, Ordering::Relaxed) >= MAX_PENDING {
            self.pending.fetch_sub(1, Ordering::Relaxed);
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(Pending(self.clone()))
    }

    /// How many Events were dropped because too many waited.
    pub fn dropped(&self) -> usize {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Decides whether `note`, occurring at `now`, makes a new Event or counts up a recent one,
    /// and remembers it.
    fn occur(&self, note: &Note, now: Timestamp) -> Write {
        let key = note.key();
        let mut series = self.series.locked();
        if let Some(sent) = series.get_mut(&key)
            && now.duration_since(sent.last) < SERIES_WINDOW
        {
            sent.count = sent.count.saturating_add(1);
            sent.last = now;
            if sent.count > 2 && now.duration_since(sent.written) < SERIES_REFRESH {
                return Write::Held;
            }
            sent.written = now;
            return Write::Count { name: sent.name.clone(), count: sent.count };
        }
        let base = note.regarding.name.as_deref().unwrap_or(&note.controller);
        let name = event_name(base, now.as_nanosecond());
        series.put(key, Sent { name: name.clone(), count: 1, last: now, written: now });
        Write::Create { name }
    }

    /// Forgets `note`'s series (its Event could not be written, or is gone).
    fn forget(&self, note: &Note) {
        self.series.locked().pop(&note.key());
    }

    /// Writes one occurrence of `note`: a new Event, or the count of the recent one. `fence`,
    /// when the writes are made under a lead, is checked before each: the count's answer may
    /// come late, after the lead is lost, and the new Event that a gone one needs is then not
    /// written.
    pub async fn publish(&self, note: &Note, fence: Option<&crate::leader::Fence>) -> Result<(), kube::Error> {
        let _series = self.stripes[(note.key() % STRIPES as u64) as usize].lock().await;
        // Checked again once the series' earlier write ended: the lead may be gone by now.
        if fence.is_some_and(|f| !f.holds()) {
            return Ok(());
        }
        let now = crate::clock::now();
        let api: Api<Event> = Api::namespaced(self.client.clone(), &note.namespace());
        let result = match self.occur(note, now) {
            Write::Held => Ok(()),
            Write::Create { name } => api.create(&PostParams::default(), &new_event(note, name, now)).await.map(|_| ()),
            Write::Count { name, count } => {
                let series = EventSeries { count, last_observed_time: MicroTime(now) };
                let patch = serde_json::json!({ "series": series });
                match api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                    // Gone (the API server's Event TTL): a new one.
                    Err(kube::Error::Api(s)) if s.code == 404 => {
                        self.forget(note);
                        if fence.is_some_and(|f| !f.holds()) {
                            return Ok(());
                        }
                        let Write::Create { name } = self.occur(note, now) else { return Ok(()) };
                        api.create(&PostParams::default(), &new_event(note, name, now)).await.map(|_| ())
                    }
                    other => other.map(|_| ()),
                }
            }
        };
        if result.is_err() {
            self.forget(note);
        }
        result
    }
}

/// `<object>.<nanoseconds in hex>`, as client-go names Events, cut to the 253 characters an
/// object name may have: a Node's name may already be that long. The object's part is cut at
/// a character boundary and loses a trailing `.` or `-`, so that the name stays a DNS
/// subdomain.
fn event_name(base: &str, nanos: i128) -> String {
    let suffix = format!(".{nanos:x}");
    let mut cut = base.len().min(253 - suffix.len());
    while !base.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}{suffix}", base[..cut].trim_end_matches(['.', '-']))
}

/// The API server refuses an Event whose note is over 1 KiB: a longer one (a provider's long
/// error, a list of Nodes) is cut to fit, on a character boundary, and says so.
pub const MAX_NOTE_BYTES: usize = 1024;

fn bounded_note(text: &str) -> String {
    const CUT: &str = " … (cut)";
    if text.len() <= MAX_NOTE_BYTES {
        return text.to_string();
    }
    let mut end = MAX_NOTE_BYTES - CUT.len();
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{CUT}", &text[..end])
}

fn new_event(note: &Note, name: String, now: Timestamp) -> Event {
    Event {
        metadata: ObjectMeta { name: Some(name), namespace: Some(note.namespace()), ..Default::default() },
        action: Some(note.reason.clone()),
        reason: Some(note.reason.clone()),
        note: Some(bounded_note(&note.note)),
        type_: Some(note.event_type.as_str().into()),
        event_time: Some(MicroTime(now)),
        regarding: Some(note.regarding.clone()),
        // Upstream's component (`service-controller`, `route_controller` …), which
        // `--field-selector source=…` and alert rules select; ours names the instance.
        reporting_controller: Some(
            crate::controllers::registry::named(&note.controller).map_or(note.controller.as_str(), |c| c.component).to_string(),
        ),
        reporting_instance: Some(note.controller.clone()),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_notes_are_cut_to_what_the_api_server_takes() {
        assert_eq!(bounded_note("short"), "short");
        let exact = "a".repeat(MAX_NOTE_BYTES);
        assert_eq!(bounded_note(&exact), exact);
        // Multi-byte characters across the cut: still valid UTF-8, within the bound.
        let long = "é".repeat(MAX_NOTE_BYTES);
        let cut = bounded_note(&long);
        assert!(cut.len() <= MAX_NOTE_BYTES && cut.ends_with("(cut)") && cut.starts_with("éé"), "{} bytes", cut.len());
    }

    #[test]
    fn event_names_of_the_longest_objects_fit() {
        let nanos = 1_764_000_000_123_456_789_i128;
        assert_eq!(event_name("node-a", nanos), format!("node-a.{nanos:x}"));
        let long = format!("{}.{}", "a".repeat(200), "b".repeat(52)); // 253, a valid Node name
        let name = event_name(&long, nanos);
        assert_eq!(name.len(), 253, "{name}");
        let cut = event_name(&format!("{}-{}", "a".repeat(235), "b".repeat(17)), nanos);
        assert!(cut.len() <= 253 && !cut.contains("-."), "a label must not end with '-': {cut}");
    }

    fn recorder() -> Recorder {
        // Never used to write: `occur` only decides.
        let config = kube::Config::new("http://127.0.0.1:9".parse().expect("url"));
        Recorder::new(kube::Client::try_from(config).expect("client"))
    }

    fn note(name: &str, reason: &str, text: &str) -> Note {
        Note {
            controller: "service-controller".into(),
            regarding: ObjectReference {
                kind: Some("Service".into()),
                namespace: Some("ns".into()),
                name: Some(name.into()),
                uid: Some(format!("uid-{name}")),
                ..Default::default()
            },
            event_type: EventType::Normal,
            reason: reason.into(),
            note: text.into(),
        }
    }

    /// Two occurrences of one series at once (a new leader's first pass): the count is
    /// written after the Event it counts was created, not before (a 404, then a second
    /// Event).
    #[tokio::test]
    async fn occurrences_at_once_make_one_event() {
        use std::sync::{Arc, Mutex};
        // Events by name, and how many were created; creates answer 100 ms late.
        let store: Arc<Mutex<(usize, std::collections::HashSet<String>)>> = Default::default();
        let shared = store.clone();
        let service = tower::service_fn(move |request: http::Request<kube::client::Body>| {
            let store = shared.clone();
            async move {
                use http_body_util::BodyExt as _;
                let (parts, body) = request.into_parts();
                let bytes = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                let (code, value) = if parts.method == http::Method::POST {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    let v: serde_json::Value = serde_json::from_slice(&bytes).expect("test");
                    let name = v["metadata"]["name"].as_str().unwrap_or_default().to_string();
                    let mut s = store.lock().expect("test");
                    s.0 += 1;
                    s.1.insert(name);
                    (201, v)
                } else {
                    let name = parts.uri.path().rsplit('/').next().unwrap_or_default().to_string();
                    if store.lock().expect("test").1.contains(&name) {
                        (
                            200,
                            serde_json::json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": name}, "eventTime": null}),
                        )
                    } else {
                        let status = serde_json::json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"});
                        (404, status)
                    }
                };
                let response = http::Response::builder()
                    .status(code)
                    .header("content-type", "application/json")
                    .body(http_body_util::Full::new(bytes::Bytes::from(serde_json::to_vec(&value).expect("test"))))
                    .expect("test");
                Ok::<_, std::convert::Infallible>(response)
            }
        });
        let r = Arc::new(Recorder::new(kube::Client::new(service, "ns")));
        let n = note("a", "UnAvailableLoadBalancer", "There are no available nodes for LoadBalancer");
        let (a, b) = (r.clone(), r.clone());
        let (n1, n2) = (n.clone(), n.clone());
        let first = tokio::spawn(async move { a.publish(&n1, None).await });
        let second = tokio::spawn(async move { b.publish(&n2, None).await });
        first.await.expect("join").expect("first");
        second.await.expect("join").expect("second");
        assert_eq!(store.lock().expect("test").0, 1, "one Event for the series");
    }

    #[tokio::test]
    async fn a_repeat_within_the_window_counts_up_the_same_event() {
        let r = recorder();
        let t0 = Timestamp::now();
        let n = note("a", "EnsuredLoadBalancer", "Ensured load balancer");
        let Write::Create { name } = r.occur(&n, t0) else { panic!("first occurrence must create") };
        assert_eq!(r.occur(&n, t0 + SignedDuration::from_secs(60)), Write::Count { name: name.clone(), count: 2 });
        // Counted in memory, written once SERIES_REFRESH passed since the last write.
        assert_eq!(r.occur(&n, t0 + SignedDuration::from_secs(300)), Write::Held);
        assert_eq!(r.occur(&n, t0 + SignedDuration::from_secs(361)), Write::Count { name, count: 4 });
        // Six minutes after the last occurrence: a new Event.
        assert!(matches!(r.occur(&n, t0 + SignedDuration::from_secs(361 + 361)), Write::Create { .. }));
    }

    #[tokio::test]
    async fn a_condition_reported_every_pass_is_one_event_whose_count_is_written_rarely() {
        // 8 Nodes deferred on every 2 s pass for 30 s, with a note that changes each pass.
        let r = recorder();
        let t0 = Timestamp::now();
        let mut writes = 0;
        let mut creates = 0;
        for pass in 0..15 {
            for node in 0..8 {
                let n = note(&format!("node-{node}"), "NodeDeletionDeferred", &format!("asked again in {} s", 30 - 2 * pass));
                match r.occur(&n, t0 + SignedDuration::from_secs(2 * pass)) {
                    Write::Create { .. } => creates += 1,
                    Write::Count { .. } => writes += 1,
                    Write::Held => {}
                }
            }
        }
        assert_eq!(creates, 8, "one Event per Node and reason");
        assert_eq!(writes, 8, "its count written once (at 2) in 30 s");
    }

    #[tokio::test]
    async fn another_reason_or_object_is_another_event_and_another_note_is_not() {
        let r = recorder();
        let t0 = Timestamp::now();
        assert!(matches!(r.occur(&note("a", "R", "x"), t0), Write::Create { .. }));
        assert!(matches!(r.occur(&note("a", "S", "x"), t0), Write::Create { .. }));
        assert!(matches!(r.occur(&note("b", "R", "x"), t0), Write::Create { .. }));
        // Another note of the same reason and object counts up the first.
        assert!(matches!(r.occur(&note("a", "R", "y"), t0), Write::Count { count: 2, .. }));
    }

    #[tokio::test]
    async fn memory_is_bounded_forgetting_the_least_recent() {
        let r = recorder();
        let t0 = Timestamp::now();
        for i in 0..(MAX_SERIES + 100) {
            r.occur(&note(&format!("svc-{i}"), "R", "x"), t0);
        }
        assert_eq!(r.series.lock().expect("lock").len(), MAX_SERIES);
        // The oldest were forgotten (a new Event), the newest are counted up.
        assert!(matches!(r.occur(&note("svc-0", "R", "x"), t0), Write::Create { .. }));
        assert!(matches!(r.occur(&note(&format!("svc-{}", MAX_SERIES + 99), "R", "x"), t0), Write::Count { .. }));
    }

    #[tokio::test]
    async fn the_line_is_bounded_and_places_are_given_back() {
        let r = Arc::new(recorder());
        let held: Vec<_> = (0..MAX_PENDING).map(|_| r.enqueue().expect("room")).collect();
        assert!(r.enqueue().is_none());
        assert_eq!(r.dropped(), 1);
        drop(held);
        assert!(r.enqueue().is_some());
    }

    #[test]
    fn a_cluster_scoped_object_s_events_go_to_default() {
        let mut n = note("node-1", "Synced", "Node synced successfully");
        n.regarding.namespace = None;
        assert_eq!(n.namespace(), "default");
    }
}
