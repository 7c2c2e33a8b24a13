//! A model of the Kubernetes API server, served to the core's `kube::Client` as a tower
//! service ([`Link`]), one link per replica.
//!
//! What it models, because the core depends on it: objects with `resourceVersion` and `uid`;
//! list (one page) and watch from a resourceVersion, with bookmarks, the server's watch
//! timeout, `410 Expired` for a version compacted away (then the client re-lists); create
//! (409 when it exists), replace and patch guarded by `resourceVersion` (409 on a mismatch),
//! JSON merge patches and the strategic merge of `status.conditions` by type; the status
//! subresource; deletion with preconditions and finalizers. Faults: latency, a restart (open
//! watches end and old versions are compacted), a partition of one replica, late answers.
//!
//! It also checks, at the moment a write arrives, the invariants that only the API server
//! sees: a replica writes only while it holds the Lease, and a Node is deleted only when its
//! instance is gone.

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use ccm_provider_sim::cloud::Cloud;
use ccm_provider_sim::config::State as InstanceState;
use futures::StreamExt as _;
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt as _;
use http_body_util::combinators::BoxBody;
use rand::{Rng as _, SeedableRng as _};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

/// The Lease the replicas elect on.
pub const LEASE_NAMESPACE: &str = "kube-system";
pub const LEASE_NAME: &str = "cloud-controller-manager";
const LEASES: &str = "coordination.k8s.io/v1/leases";

/// Whether `lease` is held by `identity` and its last renewal is within its duration on the
/// (virtual) wall clock.
fn held_by(lease: &Value, identity: &str) -> bool {
    let spec = &lease["spec"];
    if spec["holderIdentity"].as_str() != Some(identity) {
        return false;
    }
    let duration = spec["leaseDurationSeconds"].as_i64().unwrap_or(0);
    let renewed = spec["renewTime"].as_str().and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok());
    renewed.is_some_and(|t| ccm_core::clock::now().as_millisecond() <= t.as_millisecond() + duration * 1000)
}

/// How many watch events are kept; a watch from an older version gets `410 Expired`.
const LOG_KEPT: usize = 4000;
/// How often an open watch gets a bookmark.
const BOOKMARK_EVERY: Duration = Duration::from_secs(30);

/// An object's place: its resource (`v1/nodes`, `coordination.k8s.io/v1/leases`), namespace
/// (empty for cluster-scoped) and name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Key {
    pub resource: String,
    pub namespace: String,
    pub name: String,
}

impl Key {
    pub fn node(name: &str) -> Self {
        Self { resource: "v1/nodes".into(), namespace: String::new(), name: name.into() }
    }

    pub fn service(namespace: &str, name: &str) -> Self {
        Self { resource: "v1/services".into(), namespace: namespace.into(), name: name.into() }
    }
}

struct Entry {
    rv: u64,
    key: Key,
    kind: &'static str,
    object: Value,
}

struct State {
    rv: u64,
    uids: u64,
    /// Where UIDs come from (seeded).
    ids: rand::rngs::StdRng,
    objects: BTreeMap<Key, Value>,
    log: VecDeque<Entry>,
    /// The oldest version a watch may start from.
    floor: u64,
    /// Bumped by a restart: every watch opened before it ends.
    generation: u64,
    /// When each Node was last given a podCIDR it did not have (virtual time).
    cidr_given: BTreeMap<String, Duration>,
}

/// The model API server, shared by every replica's link and by the world that plays the
/// kubelets and the users.
pub struct Model {
    state: Mutex<State>,
    changed: watch::Sender<u64>,
    rng: Mutex<rand::rngs::StdRng>,
    /// The clouds (one per provider), to check deletions against.
    clouds: Mutex<Vec<Arc<Cloud>>>,
    /// The longest request latency, in ms.
    pub latency_ms: AtomicU64,
    violations: Mutex<Vec<String>>,
    trace: Mutex<u64>,
    /// Requests served.
    pub requests: AtomicU64,
    mutations: AtomicU64,
    mutation_log: Mutex<Vec<String>>,
    /// `--max-node-deletions` per `--node-deletion-window`, checked over every replica.
    pub deletion_bound: Mutex<Option<(usize, Duration)>>,
    /// When replicas deleted Nodes (virtual time since the run began).
    /// The times of the Node deletions in the window, per provider (its providerID scheme).
    node_deletions: Mutex<BTreeMap<String, Vec<Duration>>>,
    /// `--max-load-balancer-repairs` per `--load-balancer-repair-period`, when the seed repairs
    /// by reads, and every time (Unix ms) a holder of the service controller's Lease recorded
    /// a load balancer made again, in any tenure.
    pub repair_bound: Mutex<Option<(usize, Duration)>>,
    repairs_spent: Mutex<BTreeMap<String, std::collections::BTreeSet<i64>>>,
    /// Every traced step, when kept (`CCM_SIM_TRACE`).
    steps: Mutex<Option<Vec<String>>>,
}

/// A Status answer.
fn status(code: StatusCode, reason: &str, message: impl Into<String>) -> (StatusCode, Value) {
    let message = message.into();
    (
        code,
        json!({ "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message, "reason": reason, "code": code.as_u16() }),
    )
}

fn rv_of(object: &Value) -> Option<&str> {
    object.pointer("/metadata/resourceVersion").and_then(Value::as_str).filter(|v| !v.is_empty())
}

/// RFC 7386 merge of `patch` into `target`; with `strategic`, a list of conditions is merged
/// by `type` (the strategic merge key of conditions), as the API server does.
fn merge(target: &mut Value, patch: &Value, strategic: bool, field: &str) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v, strategic, k);
                }
            }
        }
        (Value::Array(t), Value::Array(p)) if strategic && field == "conditions" => {
            for item in p {
                let kind = item.get("type");
                match t.iter_mut().find(|c| c.get("type") == kind) {
                    Some(existing) => merge(existing, item, strategic, ""),
                    None => t.push(item.clone()),
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

impl State {
    fn record(&mut self, key: &Key, kind: &'static str, object: &Value) {
        self.log.push_back(Entry { rv: self.rv, key: key.clone(), kind, object: object.clone() });
        while self.log.len() > LOG_KEPT {
            if let Some(old) = self.log.pop_front() {
                self.floor = old.rv;
            }
        }
    }

    fn bump(&mut self, object: &mut Value) {
        self.rv += 1;
        object["metadata"]["resourceVersion"] = json!(self.rv.to_string());
    }

    /// Stores `object` at `key` as a change (or removes it when it is being deleted and has no
    /// finalizer left), records the watch event, and returns what was stored.
    fn store(&mut self, key: &Key, mut object: Value) -> Value {
        self.bump(&mut object);
        if key.resource == "v1/nodes" {
            let cidr = |o: Option<&Value>| o.and_then(|o| o.pointer("/spec/podCIDR")).and_then(Value::as_str).map(str::to_string);
            let now = cidr(Some(&object));
            if now.is_some() && cidr(self.objects.get(key)) != now {
                self.cidr_given.insert(key.name.clone(), crate::elapsed());
            }
        }
        let gone = object.pointer("/metadata/deletionTimestamp").is_some_and(|v| !v.is_null())
            && object.pointer("/metadata/finalizers").and_then(Value::as_array).is_none_or(Vec::is_empty);
        if gone {
            self.objects.remove(key);
            self.record(key, "DELETED", &object);
        } else {
            let kind = if self.objects.insert(key.clone(), object.clone()).is_some() { "MODIFIED" } else { "ADDED" };
            self.record(key, kind, &object);
        }
        object
    }

    fn create(&mut self, key: &Key, mut object: Value) -> Result<Value, (StatusCode, Value)> {
        if self.objects.contains_key(key) {
            return Err(status(StatusCode::CONFLICT, "AlreadyExists", format!("{} {:?} already exists", key.resource, key.name)));
        }
        self.uids += 1;
        let meta = &mut object["metadata"];
        meta["name"] = json!(key.name);
        if !key.namespace.is_empty() {
            meta["namespace"] = json!(key.namespace);
        }
        // Random, as the API server's are (from the seed): load balancer names are cut from
        // them, and names cut from sequential UIDs would collide.
        let (a, b) = (self.ids.random::<u64>(), self.ids.random::<u64>());
        meta["uid"] = json!(format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            a >> 32,
            (a >> 16) & 0xffff,
            a & 0xfff,
            b >> 52,
            b & 0xffff_ffff_ffff
        ));
        meta["creationTimestamp"] =
            json!(ccm_core::clock::now().round(k8s_openapi::jiff::Unit::Second).unwrap_or_default().to_string());
        Ok(self.store(key, object))
    }

    fn delete(&mut self, key: &Key, uid: Option<&str>) -> Result<Value, (StatusCode, Value)> {
        let Some(mut object) = self.objects.get(key).cloned() else {
            return Err(status(StatusCode::NOT_FOUND, "NotFound", format!("{} {:?} not found", key.resource, key.name)));
        };
        if let Some(uid) = uid
            && object.pointer("/metadata/uid").and_then(Value::as_str) != Some(uid)
        {
            return Err(status(StatusCode::CONFLICT, "Conflict", format!("Precondition failed: UID in precondition: {uid}")));
        }
        if object.pointer("/metadata/deletionTimestamp").is_none_or(Value::is_null) {
            object["metadata"]["deletionTimestamp"] = json!(ccm_core::clock::now().to_string());
        }
        Ok(self.store(key, object))
    }
}

/// Who sends a request: the world (kubelets, users), or a replica's controllers or Lease
/// client, by leader election identity.
#[derive(Debug, Clone)]
pub enum Who {
    World,
    Replica(String),
}

impl Model {
    pub fn new(seed: u64, cloud: Arc<Cloud>) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State {
                rv: 0,
                uids: 0,
                ids: rand::rngs::StdRng::seed_from_u64(seed ^ 0x0a1d),
                objects: BTreeMap::new(),
                log: VecDeque::new(),
                floor: 0,
                generation: 0,
                cidr_given: BTreeMap::new(),
            }),
            changed: watch::channel(0).0,
            rng: Mutex::new(rand::rngs::StdRng::seed_from_u64(seed ^ 0x05ee_da91)),
            clouds: Mutex::new(vec![cloud]),
            latency_ms: AtomicU64::new(20),
            violations: Mutex::new(Vec::new()),
            trace: Mutex::new(0xcbf2_9ce4_8422_2325),
            requests: AtomicU64::new(0),
            mutations: AtomicU64::new(0),
            mutation_log: Mutex::new(Vec::new()),
            deletion_bound: Mutex::new(None),
            node_deletions: Mutex::new(BTreeMap::new()),
            repair_bound: Mutex::new(None),
            repairs_spent: Mutex::new(BTreeMap::new()),
            steps: Mutex::new(std::env::var_os("CCM_SIM_TRACE").map(|_| Vec::new())),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn notify(&self) {
        self.changed.send_modify(|n| *n += 1);
    }

    /// Records a broken invariant.
    pub fn violation(&self, what: impl Into<String>) {
        let (what, at) = (what.into(), crate::elapsed().as_secs_f64());
        let mut violations = self.violations.lock().unwrap_or_else(|p| p.into_inner());
        // A standing violation (found again at each check) is reported once, when first seen.
        if violations.iter().any(|v| v.split_once(": ").is_some_and(|(_, seen)| seen == what)) {
            return;
        }
        let what = format!("t={at:.1}s: {what}");
        tracing::error!("{what}");
        violations.push(what);
    }

    /// The invariants broken so far.
    pub fn violations(&self) -> Vec<String> {
        self.violations.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Folds an observable step into the run's trace digest (two runs of one seed that
    /// take the same steps at the same virtual times have the same digest).
    pub fn trace(&self, step: &str) {
        if let Some(steps) = self.steps.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            steps.push(format!("{:>10} {step}", crate::elapsed().as_millis()));
        }
        let mut h = self.trace.lock().unwrap_or_else(|p| p.into_inner());
        for b in crate::elapsed().as_millis().to_le_bytes().iter().chain(step.as_bytes()) {
            *h = (*h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    /// Counts a mutation of the cloud.
    pub fn mutated(&self, what: String) {
        self.mutations.fetch_add(1, Ordering::Relaxed);
        self.mutation_log.lock().unwrap_or_else(|p| p.into_inner()).push(what);
    }

    /// Every mutation of the cloud so far, in order.
    pub fn mutation_log(&self) -> Vec<String> {
        self.mutation_log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Mutations of the cloud so far.
    pub fn mutations(&self) -> u64 {
        self.mutations.load(Ordering::Relaxed)
    }

    /// The steps traced, when kept.
    pub fn steps(&self) -> Vec<String> {
        self.steps.lock().unwrap_or_else(|p| p.into_inner()).clone().unwrap_or_default()
    }

    /// The trace digest so far.
    pub fn digest(&self) -> u64 {
        *self.trace.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `identity` holds the Lease now: it is the holder, and its last renewal is
    /// within the lease duration on the (virtual) wall clock.
    ///
    /// With a Lease per controller (`<name>-<controller>`), holding any of them is leading.
    pub fn leads(&self, identity: &str) -> bool {
        let state = self.lock();
        state.objects.iter().any(|(key, lease)| {
            let controller_lease = key.name.strip_prefix(&format!("{LEASE_NAME}-")).is_some_and(|c| !c.starts_with("member-"));
            key.resource == LEASES
                && key.namespace == LEASE_NAMESPACE
                && (key.name == LEASE_NAME || controller_lease)
                && held_by(lease, identity)
        })
    }

    /// Whether `identity` may act for `controller` now: it holds the one Lease, or that
    /// controller's own.
    pub fn leads_for(&self, identity: &str, controller: &str) -> bool {
        let state = self.lock();
        let held = |name: &str| {
            let key = Key { resource: LEASES.into(), namespace: LEASE_NAMESPACE.into(), name: name.into() };
            state.objects.get(&key).is_some_and(|l| held_by(l, identity))
        };
        held(LEASE_NAME) || held(&format!("{LEASE_NAME}-{controller}"))
    }

    /// Who holds each controller Lease now (the one Lease as `*`).
    pub fn holders(&self) -> std::collections::BTreeMap<String, String> {
        let state = self.lock();
        let mut out = std::collections::BTreeMap::new();
        for (key, lease) in &state.objects {
            if key.resource != LEASES || key.namespace != LEASE_NAMESPACE {
                continue;
            }
            let Some(holder) = lease.pointer("/spec/holderIdentity").and_then(Value::as_str) else { continue };
            let name = if key.name == LEASE_NAME { Some("*") } else { key.name.strip_prefix(&format!("{LEASE_NAME}-")) };
            if let Some(name) = name.filter(|n| !n.starts_with("member-"))
                && held_by(lease, holder)
            {
                out.insert(name.to_string(), holder.to_string());
            }
        }
        out
    }

    /// One object, as stored.
    pub fn get(&self, key: &Key) -> Option<Value> {
        self.lock().objects.get(key).cloned()
    }

    /// Every object of `resource`.
    pub fn list(&self, resource: &str) -> Vec<Value> {
        self.lock().objects.iter().filter(|(k, _)| k.resource == resource).map(|(_, v)| v.clone()).collect()
    }

    /// Creates an object as the world (a kubelet registering, a user).
    pub fn create(&self, key: &Key, object: Value) -> Option<Value> {
        let created = self.lock().create(key, object).ok();
        self.notify();
        created
    }

    /// Changes an object as the world; false when it does not exist.
    /// How long ago the Node `name` was last given a podCIDR it did not have.
    pub fn cidr_given_ago(&self, name: &str) -> Option<Duration> {
        self.lock().cidr_given.get(name).map(|t| crate::elapsed().saturating_sub(*t))
    }

    pub fn update(&self, key: &Key, change: impl FnOnce(&mut Value)) -> bool {
        let done = {
            let mut state = self.lock();
            match state.objects.get(key).cloned() {
                Some(mut object) => {
                    change(&mut object);
                    state.store(key, object);
                    true
                }
                None => false,
            }
        };
        self.notify();
        done
    }

    /// Deletes an object as the world (finalizers hold it).
    pub fn delete(&self, key: &Key) {
        let _ = self.lock().delete(key, None);
        self.notify();
    }

    /// The API server restarts: every open watch ends, and versions before now are
    /// compacted (a watch from one gets `410 Expired`, and the client re-lists).
    pub fn restart(&self) {
        {
            let mut state = self.lock();
            state.generation += 1;
            state.floor = state.rv;
            state.log.clear();
        }
        self.notify();
    }

    /// Compacts history: a watch from a version before now gets `410 Expired` (open watches
    /// go on).
    pub fn compact(&self) {
        {
            let mut state = self.lock();
            state.floor = state.rv;
            state.log.clear();
        }
        self.notify();
    }

    /// Wakes every watch (a partition began: the cut ones notice).
    pub fn wake_watches(&self) {
        self.notify();
    }

    fn latency(&self) -> Duration {
        let max = self.latency_ms.load(Ordering::Relaxed);
        Duration::from_millis(self.rng.lock().unwrap_or_else(|p| p.into_inner()).random_range(0..=max))
    }

    /// Serves one request.
    async fn handle<B>(self: &Arc<Self>, who: &Who, net: &Arc<Net>, request: Request<B>) -> Response<Body>
    where
        B: http_body::Body<Data = Bytes>,
        B::Error: std::fmt::Display,
    {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let (parts, body) = request.into_parts();
        let body = match body.collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return reply(status(StatusCode::BAD_REQUEST, "BadRequest", format!("reading the body: {e}"))),
        };
        let Some(path) = Path::parse(parts.uri.path()) else {
            return reply(status(StatusCode::NOT_FOUND, "NotFound", format!("no such path {}", parts.uri.path())));
        };
        let query: BTreeMap<String, String> = parts
            .uri
            .query()
            .unwrap_or_default()
            .split('&')
            .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
            .collect();
        let write = parts.method != Method::GET;
        if let Who::Replica(identity) = who {
            self.trace(&format!("{identity} {} {}", parts.method, parts.uri.path()));
            let lease_write = path.resource == "coordination.k8s.io/v1/leases";
            // Services are the service controller's to write, Nodes the node controllers'
            // (with a Lease per controller, holding another one's Lease is not enough).
            use ccm_core::controllers::{ipam, node, node_lifecycle, route, service, tagging};
            let writers: &[&str] = match path.resource.as_str() {
                "v1/services" => &[service::NAME],
                "v1/nodes" => &[node::NAME, node_lifecycle::NAME, route::NAME, ipam::NAME, tagging::NAME],
                _ => &[],
            };
            let leads = match writers {
                [] => self.leads(identity),
                writers => writers.iter().any(|c| self.leads_for(identity, c)),
            };
            if write && !lease_write && !leads {
                self.violation(format!(
                    "{identity} wrote ({} {}) without holding the Lease of a controller that writes them ({writers:?})",
                    parts.method,
                    parts.uri.path()
                ));
            }
        }
        let Some(name) = path.name.clone() else {
            return match parts.method {
                Method::GET if query.get("watch").is_some_and(|w| w == "true" || w == "1") => self.watch(&path, &query, net),
                Method::GET => self.list_reply(&path),
                Method::POST => {
                    let object: Value = match serde_json::from_slice(&body) {
                        Ok(v) => v,
                        Err(e) => return reply(status(StatusCode::BAD_REQUEST, "BadRequest", e.to_string())),
                    };
                    let name = object.pointer("/metadata/name").and_then(Value::as_str).unwrap_or_default().to_string();
                    let key = Key { resource: path.resource.clone(), namespace: path.namespace.clone(), name };
                    let result = self.lock().create(&key, object);
                    self.notify();
                    match result {
                        Ok(object) => json_reply(StatusCode::CREATED, &object),
                        Err(e) => reply(e),
                    }
                }
                _ => reply(status(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "not on a collection")),
            };
        };
        let key = Key { resource: path.resource.clone(), namespace: path.namespace.clone(), name };
        let answer = match parts.method {
            Method::GET => self.get(&key).ok_or_else(|| status(StatusCode::NOT_FOUND, "NotFound", format!("{key:?} not found"))),
            Method::PUT => {
                let object: Value = serde_json::from_slice(&body).unwrap_or_default();
                let mut state = self.lock();
                match state.objects.get(&key) {
                    None => Err(status(StatusCode::NOT_FOUND, "NotFound", format!("{key:?} not found"))),
                    Some(current) if rv_of(&object).is_some_and(|v| Some(v) != rv_of(current)) => Err(status(
                        StatusCode::CONFLICT,
                        "Conflict",
                        "the object has been modified; please apply your changes to the latest version and try again",
                    )),
                    Some(current) => {
                        let mut object = object;
                        object["metadata"]["uid"] = current["metadata"]["uid"].clone();
                        object["metadata"]["creationTimestamp"] = current["metadata"]["creationTimestamp"].clone();
                        Ok(state.store(&key, object))
                    }
                }
            }
            Method::PATCH => {
                let strategic = parts
                    .headers
                    .get(http::header::CONTENT_TYPE)
                    .is_some_and(|v| v.as_bytes().starts_with(b"application/strategic"));
                let patch: Value = serde_json::from_slice(&body).unwrap_or_default();
                let mut state = self.lock();
                match state.objects.get(&key).cloned() {
                    None => Err(status(StatusCode::NOT_FOUND, "NotFound", format!("{key:?} not found"))),
                    Some(current) if rv_of(&patch).is_some_and(|v| Some(v) != rv_of(&current)) => Err(status(
                        StatusCode::CONFLICT,
                        "Conflict",
                        "the object has been modified; please apply your changes to the latest version and try again",
                    )),
                    Some(current) => {
                        let mut merged = current.clone();
                        merge(&mut merged, &patch, strategic, "");
                        merged["metadata"]["uid"] = current["metadata"]["uid"].clone();
                        if path.subresource.as_deref() == Some("status") {
                            let mut only_status = current.clone();
                            only_status["status"] = merged["status"].clone();
                            merged = only_status;
                        } else if !current["status"].is_null() {
                            merged["status"] = current["status"].clone();
                        }
                        Ok(state.store(&key, merged))
                    }
                }
            }
            Method::DELETE => {
                let options: Value = serde_json::from_slice(&body).unwrap_or_default();
                let uid = options.pointer("/preconditions/uid").and_then(Value::as_str);
                if key.resource == "v1/nodes"
                    && let Who::Replica(identity) = who
                {
                    self.check_node_deletion(identity, &key.name);
                }
                self.lock().delete(&key, uid)
            }
            _ => Err(status(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", parts.method.to_string())),
        };
        if write {
            self.notify();
        }
        if let Ok(lease) = &answer
            && write
            && key.resource == LEASES
        {
            self.check_repairs_spent(lease);
        }
        match answer {
            Ok(object) => json_reply(StatusCode::OK, &object),
            Err(e) => reply(e),
        }
    }

    /// The load balancers made again in any repair period, over every tenure of every replica:
    /// each holder records the times of its repairs on the Lease before it makes one, and the
    /// union of every record a Lease ever carried may hold at most the bound in any period (a
    /// holder that started the period afresh, or overwrote what an earlier one spent, shows).
    fn check_repairs_spent(&self, lease: &Value) {
        let Some((max, period)) = *self.repair_bound.lock().unwrap_or_else(|p| p.into_inner()) else { return };
        let prefix = format!("{}load-balancer-repairs", ccm_core::leader::ANNOTATION_SPENT);
        let Some(annotations) = lease.pointer("/metadata/annotations").and_then(Value::as_object) else { return };
        let period_ms = i64::try_from(period.as_millis()).unwrap_or(i64::MAX);
        let mut spent = self.repairs_spent.lock().unwrap_or_else(|p| p.into_inner());
        // One key per provider: each provider's bound is its own.
        for (key, value) in annotations.iter().filter(|(k, _)| k.starts_with(&prefix)) {
            let times = spent.entry(key.clone()).or_default();
            times.extend(value.as_str().unwrap_or_default().split(',').filter_map(|t| t.trim().parse::<i64>().ok()));
            let sorted: Vec<i64> = times.iter().copied().collect();
            if let Some(w) = sorted.windows(max + 1).find(|w| w[max] - w[0] < period_ms) {
                let holder = lease.pointer("/spec/holderIdentity").and_then(Value::as_str).unwrap_or_default();
                self.violation(format!(
                    "{} load balancers made again within {}s ({key}, latest recorded by {holder}; bound {max} per --load-balancer-repair-period of {}s): {w:?}",
                    max + 1,
                    (w[max] - w[0]) / 1000,
                    period.as_secs()
                ));
                times.clear();
            }
        }
    }

    /// A second provider's cloud (two providers in one cluster).
    pub fn add_cloud(&self, cloud: Arc<Cloud>) {
        self.clouds.lock().unwrap_or_else(|p| p.into_inner()).push(cloud);
    }

    /// A Node may be deleted only when its instance is gone (terminated or removed), and at
    /// most the bound per window of its provider, over every replica and tenure.
    fn check_node_deletion(&self, identity: &str, name: &str) {
        let Some(node) = self.get(&Key::node(name)) else { return };
        let provider_id = node.pointer("/spec/providerID").and_then(Value::as_str).unwrap_or_default();
        let id = provider_id.rsplit('/').next().unwrap_or_default();
        let clouds = self.clouds.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut scheme = provider_id.split_once("://").map(|(s, _)| s.to_string());
        for cloud in &clouds {
            let snapshot = cloud.snapshot();
            let Some(instance) = snapshot.instances.iter().find(|i| (!id.is_empty() && i.id == id) || i.name == name) else {
                continue;
            };
            scheme.get_or_insert_with(|| cloud.scheme().to_string());
            if instance.state != InstanceState::Terminated {
                self.violation(format!("{identity} deleted Node {name} whose instance {} is {:?}", instance.id, instance.state));
            }
        }
        // The deletion bound holds over the whole cluster: every replica, every tenure (per
        // provider, with several).
        let bound = *self.deletion_bound.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((max, window)) = bound {
            let now = crate::elapsed();
            let scheme = scheme.unwrap_or_default();
            let mut all = self.node_deletions.lock().unwrap_or_else(|p| p.into_inner());
            let deletions = all.entry(scheme.clone()).or_default();
            deletions.retain(|t| now.saturating_sub(*t) < window);
            deletions.push(now);
            if deletions.len() > max {
                self.violation(format!(
                    "{identity} deleted Node {name}: {} Node deletions of provider {scheme} in {}s (bound {max} per --node-deletion-window)",
                    deletions.len(),
                    window.as_secs()
                ));
            }
        }
    }

    fn list_reply(&self, path: &Path) -> Response<Body> {
        let state = self.lock();
        let items: Vec<&Value> = state
            .objects
            .iter()
            .filter(|(k, _)| k.resource == path.resource && (path.namespace.is_empty() || k.namespace == path.namespace))
            .map(|(_, v)| v)
            .collect();
        let list = json!({ "apiVersion": path.api_version(), "kind": format!("{}List", path.kind()), "metadata": { "resourceVersion": state.rv.to_string() }, "items": items });
        json_reply(StatusCode::OK, &list)
    }

    fn watch(self: &Arc<Self>, path: &Path, query: &BTreeMap<String, String>, net: &Arc<Net>) -> Response<Body> {
        let from: u64 = query.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
        let timeout = Duration::from_secs(query.get("timeoutSeconds").and_then(|v| v.parse().ok()).unwrap_or(300));
        let bookmarks = query.get("allowWatchBookmarks").is_some_and(|v| v == "true");
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        let (model, path, net) = (self.clone(), path.clone(), net.clone());
        let generation = self.lock().generation;
        tokio::spawn(async move {
            let mut changed = model.changed.subscribe();
            let deadline = tokio::time::Instant::now() + timeout;
            let mut last = from;
            let line = |v: Value| {
                let mut b = serde_json::to_vec(&v).unwrap_or_default();
                b.push(b'\n');
                Bytes::from(b)
            };
            loop {
                let batch: Result<Vec<Value>, Option<Value>> = {
                    let state = model.lock();
                    if state.generation != generation
                        || net.down.load(Ordering::Relaxed)
                        || net.watches_down.load(Ordering::Relaxed)
                    {
                        Err(None)
                    } else if last < state.floor {
                        let (_, s) =
                            status(StatusCode::GONE, "Expired", format!("too old resource version: {last} ({})", state.floor));
                        Err(Some(json!({ "type": "ERROR", "object": s })))
                    } else {
                        let from = last;
                        let events: Vec<Value> = state
                            .log
                            .iter()
                            .filter(|e| e.rv > from && e.key.resource == path.resource)
                            .filter(|e| path.namespace.is_empty() || e.key.namespace == path.namespace)
                            .map(|e| json!({ "type": e.kind, "object": e.object }))
                            .collect();
                        last = state.log.back().map_or(last, |e| e.rv.max(last));
                        Ok(events)
                    }
                };
                match batch {
                    Ok(events) => {
                        for event in events {
                            if tx.send(line(event)).await.is_err() {
                                return;
                            }
                        }
                    }
                    Err(last_word) => {
                        if let Some(event) = last_word {
                            let _ = tx.send(line(event)).await;
                        }
                        return;
                    }
                }
                tokio::select! {
                    _ = changed.changed() => {}
                    _ = tokio::time::sleep(BOOKMARK_EVERY), if bookmarks => {
                        let mark = json!({ "type": "BOOKMARK", "object": { "apiVersion": path.api_version(), "kind": path.kind(), "metadata": { "resourceVersion": last.to_string() } } });
                        if tx.send(line(mark)).await.is_err() {
                            return;
                        }
                    }
                    _ = tokio::time::sleep_until(deadline) => return,
                }
            }
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx).map(|b| Ok::<_, Infallible>(http_body::Frame::data(b)));
        let mut response = Response::new(BoxBody::new(http_body_util::StreamBody::new(stream)));
        response.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
        response
    }
}

/// The body of an answer.
pub type Body = BoxBody<Bytes, Infallible>;

fn json_reply(code: StatusCode, object: &Value) -> Response<Body> {
    let bytes = Bytes::from(serde_json::to_vec(object).unwrap_or_default());
    let mut response = Response::new(BoxBody::new(http_body_util::Full::new(bytes)));
    *response.status_mut() = code;
    response.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    response
}

fn reply((code, body): (StatusCode, Value)) -> Response<Body> {
    json_reply(code, &body)
}

/// A request's path, parsed.
#[derive(Debug, Clone)]
struct Path {
    resource: String,
    namespace: String,
    name: Option<String>,
    subresource: Option<String>,
}

impl Path {
    fn parse(path: &str) -> Option<Self> {
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (gv, rest) = match segments.as_slice() {
            ["api", v, rest @ ..] => ((*v).to_string(), rest),
            ["apis", g, v, rest @ ..] => (format!("{g}/{v}"), rest),
            _ => return None,
        };
        let (namespace, rest) = match rest {
            ["namespaces", ns, rest @ ..] if !rest.is_empty() => ((*ns).to_string(), rest),
            _ => (String::new(), rest),
        };
        let (resource, name, sub) = match rest {
            [r] => (*r, None, None),
            [r, n] => (*r, Some((*n).to_string()), None),
            [r, n, s] => (*r, Some((*n).to_string()), Some((*s).to_string())),
            _ => return None,
        };
        Some(Self { resource: format!("{gv}/{resource}"), namespace, name, subresource: sub })
    }

    fn api_version(&self) -> String {
        self.resource.rsplit_once('/').map(|(gv, _)| gv.to_string()).unwrap_or_default()
    }

    fn kind(&self) -> &'static str {
        match self.resource.rsplit('/').next() {
            Some("nodes") => "Node",
            Some("services") => "Service",
            Some("leases") => "Lease",
            Some("events") => "Event",
            _ => "Object",
        }
    }
}

/// One replica's network to the API server: cut (requests fail, watches end), or answering
/// late.
#[derive(Debug, Default)]
pub struct Net {
    pub down: AtomicBool,
    /// Only its watches fail (and open ones end).
    pub watches_down: AtomicBool,
    pub answer_delay_ms: AtomicU64,
    /// Its connections go half-open (see [`Link::client`]).
    pub half_open: AtomicBool,
    /// Answers to writes alone come this late (a Lease renewal's, after its read went
    /// through).
    pub write_answer_delay_ms: AtomicU64,
}

/// A replica's connection to the model: what its `kube::Client` is built on.
#[derive(Clone)]
pub struct Link {
    pub model: Arc<Model>,
    pub who: Who,
    pub net: Arc<Net>,
}

impl Link {
    /// A `kube::Client` over this link as the core builds its own (kube's stack): HTTP/1 over
    /// connections with the connect, read and write timeouts of `config` (which the core's
    /// own functions set: `runtime::with_timeouts`, `leader::lease_config`), each connection
    /// an in-memory pipe to the model, which a half-open fault silences.
    pub fn client(self, config: &kube::Config) -> kube::Client {
        use kube::client::ConfigExt as _;
        let link = self;
        let connector = tower::service_fn(move |_: http::Uri| {
            let link = link.clone();
            async move {
                let (ours, theirs) = tokio::io::duplex(256 * 1024);
                let (server, net) = (link.clone(), link.net.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
                        let mut link = server.clone();
                        async move { tower::Service::call(&mut link, request).await }
                    });
                    let io = hyper_util::rt::TokioIo::new(theirs);
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
                });
                let dead = net.half_open.load(Ordering::Relaxed);
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(Wire { io: ours, net, dead }))
            }
        });
        let mut connector = hyper_timeout::TimeoutConnector::new(connector);
        connector.set_connect_timeout(config.connect_timeout);
        connector.set_read_timeout(config.read_timeout);
        connector.set_write_timeout(config.write_timeout);
        connector.set_reset_reader_on_write(config.reset_reader_on_write);
        let client = hyper_util::client::legacy::Builder::new(hyper_util::rt::TokioExecutor::new())
            .build::<_, kube::client::Body>(connector);
        let service = tower::ServiceBuilder::new().layer(config.base_uri_layer()).service(client);
        kube::Client::new(service, "default")
    }
}

/// The replica's end of one connection to the model. Half-open (the fault came while it was
/// open, or it was opened during the fault), it swallows what is written and never yields
/// another byte, for ever, as a TCP connection whose peer vanished: only the client's own
/// timeouts end what waits on it.
struct Wire {
    io: tokio::io::DuplexStream,
    net: Arc<Net>,
    dead: bool,
}

impl Wire {
    fn dead(&mut self) -> bool {
        self.dead |= self.net.half_open.load(Ordering::Relaxed);
        self.dead
    }
}

impl tokio::io::AsyncRead for Wire {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut tokio::io::ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        if self.dead() {
            return Poll::Pending;
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Wire {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        if self.dead() {
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.dead() {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.dead() {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl hyper_util::client::legacy::connect::Connection for Wire {
    fn connected(&self) -> hyper_util::client::legacy::connect::Connected {
        hyper_util::client::legacy::connect::Connected::new()
    }
}

impl<B> tower::Service<Request<B>> for Link
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: std::fmt::Display,
{
    type Response = Response<Body>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, std::io::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let link = self.clone();
        Box::pin(async move {
            let refused = || std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "partitioned from the API server");
            let watch = request.uri().query().is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"));
            if link.net.down.load(Ordering::Relaxed) || (watch && link.net.watches_down.load(Ordering::Relaxed)) {
                tokio::time::sleep(Duration::from_millis(200)).await;
                return Err(refused());
            }
            tokio::time::sleep(link.model.latency()).await;
            let write = request.method() != http::Method::GET;
            let response = link.model.handle(&link.who, &link.net, request).await;
            let mut delay = link.net.answer_delay_ms.load(Ordering::Relaxed);
            if write {
                delay = delay.max(link.net.write_answer_delay_ms.load(Ordering::Relaxed));
            }
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            if link.net.down.load(Ordering::Relaxed) {
                return Err(refused());
            }
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_patches_replace_lists_and_strategic_ones_merge_conditions_by_type() {
        let mut node =
            json!({ "status": { "conditions": [{ "type": "Ready", "status": "True" }], "addresses": [{ "type": "a" }] } });
        merge(&mut node, &json!({ "status": { "addresses": [] } }), false, "");
        assert_eq!(node["status"]["addresses"], json!([]));
        let patch = json!({ "status": { "conditions": [{ "type": "NetworkUnavailable", "status": "False" }] } });
        merge(&mut node, &patch, true, "");
        assert_eq!(node["status"]["conditions"].as_array().map(Vec::len), Some(2));
        merge(&mut node, &json!({ "metadata": { "labels": { "a": "b" } } }), false, "");
        merge(&mut node, &json!({ "metadata": { "labels": { "a": null } } }), false, "");
        assert_eq!(node["metadata"]["labels"], json!({}));
    }

    #[test]
    fn paths_parse_as_the_api_server_reads_them() {
        let p = Path::parse("/api/v1/namespaces/ns/services/web/status").expect("path");
        assert_eq!((p.resource.as_str(), p.namespace.as_str()), ("v1/services", "ns"));
        assert_eq!((p.name.as_deref(), p.subresource.as_deref()), (Some("web"), Some("status")));
        let p = Path::parse("/apis/coordination.k8s.io/v1/namespaces/kube-system/leases").expect("path");
        assert_eq!((p.resource.as_str(), p.name), ("coordination.k8s.io/v1/leases", None));
        assert_eq!(Path::parse("/api/v1/nodes").map(|p| p.kind()), Some("Node"));
    }
}
