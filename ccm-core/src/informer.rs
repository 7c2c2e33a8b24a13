//! One watch per resource kind, shared by every controller: a reflector store that
//! controllers read, and a fan-out of changes (with the previous version, so a controller can
//! tell whether a field it acts on changed).
//!
//! Objects are slimmed before they are stored: managed fields and other bulk no controller
//! reads are dropped, so memory grows with what the controllers use, not with object size.

use ccm_protocol::lock::Lock;
use std::collections::HashSet;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;

use futures::StreamExt;
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::{broadcast, watch};
use tokio_util::sync::CancellationToken;

/// A change seen by the shared watch.
#[derive(Debug, Clone)]
pub enum Change<K> {
    /// Added or updated; `old` is the previous version, when there was one.
    Applied {
        /// Before.
        old: Option<Arc<K>>,
        /// After.
        new: Arc<K>,
    },
    /// Deleted (also for objects that vanished while the watch was down).
    Deleted(Arc<K>),
}

/// A shared watch of one kind.
#[derive(Clone)]
pub struct Informer<K: Resource + Clone + 'static>
where
    K::DynamicType: Eq + Hash + Clone,
{
    store: Store<K>,
    changes: broadcast::Sender<Change<K>>,
    synced: watch::Receiver<bool>,
    failures: Arc<std::sync::Mutex<Failures>>,
}

/// The watch's current run of failures: since when, the last one and when it came.
#[derive(Debug, Default)]
struct Failures {
    since: Option<tokio::time::Instant>,
    last: Option<(tokio::time::Instant, String)>,
}

/// A run of failures is over when no failure came for this long (the watcher retries with a
/// backoff of at most 30 s; a recovered watch of a quiet kind sends nothing to say so).
const FAILURE_RUN_GAP: std::time::Duration = std::time::Duration::from_secs(40);

/// The watch's backoff: client-go's reflector's (0.8 s, doubling, at most 30 s, jittered, and
/// back to the start after 2 minutes without a failure), as kube-runtime's default, with the
/// jitter of [`crate::clock::jitter`] (a simulation's seed decides it).
struct WatchBackoff {
    next: std::time::Duration,
    last: Option<tokio::time::Instant>,
}

impl WatchBackoff {
    const FIRST: std::time::Duration = std::time::Duration::from_millis(800);
    const MAX: std::time::Duration = std::time::Duration::from_secs(30);
    const RESET_AFTER: std::time::Duration = std::time::Duration::from_secs(120);
}

impl Default for WatchBackoff {
    fn default() -> Self {
        Self { next: Self::FIRST, last: None }
    }
}

impl Iterator for WatchBackoff {
    type Item = std::time::Duration;

    fn next(&mut self) -> Option<std::time::Duration> {
        let now = tokio::time::Instant::now();
        if self.last.is_some_and(|l| now.saturating_duration_since(l) > Self::RESET_AFTER) {
            self.next = Self::FIRST;
        }
        self.last = Some(now);
        let base = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        Some(base.mul_f64(1.0 + crate::clock::jitter()).min(Self::MAX))
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

impl<K> Informer<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Eq + Hash + Clone + Default,
{
    /// Starts watching `api`; `slim` removes what controllers do not need before storing.
    /// The watch runs under `supervisor` until `stop` (one that ends or panics before fails
    /// the process).
    pub fn start(
        api: Api<K>,
        config: watcher::Config,
        slim: fn(&mut K),
        supervisor: &crate::supervisor::Supervisor,
        stop: CancellationToken,
    ) -> Self {
        let (store, writer) = reflector::store::<K>();
        let (changes, _) = broadcast::channel(16_384);
        let (synced_tx, synced) = watch::channel(false);
        let failures: Arc<std::sync::Mutex<Failures>> = Default::default();
        let failing = failures.clone();
        let sender = changes.clone();
        let name = format!("the {} watch", K::kind(&Default::default()));
        supervisor.spawn(&name, &stop.clone(), async move {
            let mut stream = watcher::watcher(api, config).backoff(WatchBackoff::default()).boxed();
            let mut relay = Relay::new(writer, sender, synced_tx);
            loop {
                let event = tokio::select! {
                    e = stream.next() => e,
                    _ = stop.cancelled() => return,
                };
                let Some(event) = event else { return };
                match event {
                    Ok(mut event) => {
                        *failing.locked() = Failures::default();
                        match &mut event {
                            Event::Apply(obj) | Event::InitApply(obj) | Event::Delete(obj) => slim(obj),
                            Event::Init | Event::InitDone => {}
                        }
                        relay.handle(event);
                    }
                    Err(error) => {
                        tracing::warn!(%error, kind = %K::kind(&Default::default()), "watch failed; retrying with backoff");
                        let now = tokio::time::Instant::now();
                        let mut f = failing.locked();
                        let ongoing = f.last.as_ref().is_some_and(|(at, _)| now.duration_since(*at) < FAILURE_RUN_GAP);
                        if !ongoing {
                            f.since = Some(now);
                        }
                        f.last = Some((now, error.to_string()));
                    }
                }
            }
        });
        Self { store, changes, synced, failures }
    }

    /// How long the watch has been failing, with its last error: `None` while it works (or
    /// since no failure came for 40 s).
    pub fn failing(&self) -> Option<(std::time::Duration, String)> {
        let f = self.failures.locked();
        let (at, error) = f.last.as_ref()?;
        if at.elapsed() >= FAILURE_RUN_GAP {
            return None;
        }
        Some((f.since.unwrap_or(*at).elapsed(), error.clone()))
    }

    /// The cache.
    pub fn store(&self) -> &Store<K> {
        &self.store
    }

    /// Every cached object, by namespace and name: where the order of the objects decides
    /// the order of work, one run repeats it (the store's own order is a hash map's).
    pub fn sorted(&self) -> Vec<Arc<K>> {
        let all = self.store.state();
        // Sorted by keys read once (a comparison that went through each object's metadata
        // took most of the sort's time at 20,000 Nodes); the keys are unique, so the order is
        // the same as a stable sort's.
        let mut keyed: Vec<_> = all.iter().map(|o| (o.meta().namespace.as_deref(), o.meta().name.as_deref(), o)).collect();
        keyed.sort_unstable_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        keyed.into_iter().map(|(_, _, o)| o.clone()).collect()
    }

    /// A new subscription to changes. A subscriber that falls behind gets
    /// `RecvError::Lagged` and should re-read the whole store.
    pub fn subscribe(&self) -> broadcast::Receiver<Change<K>> {
        self.changes.subscribe()
    }

    /// Whether the first listing is in the store.
    pub fn synced(&self) -> bool {
        *self.synced.borrow()
    }

    /// Waits for the first listing.
    pub async fn wait_synced(&self) {
        let mut synced = self.synced.clone();
        let _ = synced.wait_for(|s| *s).await;
    }
}

/// Turns watch events into the store's contents and the controllers' changes.
///
/// ## Warning: a re-list
///
/// On a (re-)list (`Init`, `InitApply`…, `InitDone`: after a `410 Expired`, an API server
/// restart, etcd compaction or a long disconnect) kube-runtime's `Writer` buffers the listed
/// objects and swaps them into the store only at `InitDone`: right after an `InitApply` the
/// store still holds the old copy. A change announced then would carry `new == old`, and a
/// controller reading the store would act on the old object, so an edit made while the watch
/// was away would wait for the 12–24 h resync. The relay therefore holds the listed keys and
/// announces them after the swap: every listed object whose resourceVersion differs from the
/// stored one (or that is new) as `Applied` with the store's new copy, every stored object the
/// listing lacks as `Deleted`. Unchanged objects are not announced (a re-list of 20,000 Nodes
/// is not 20,000 changes).
struct Relay<K: Resource + Clone + 'static>
where
    K::DynamicType: Eq + Hash + Clone,
{
    writer: reflector::store::Writer<K>,
    reader: Store<K>,
    changes: broadcast::Sender<Change<K>>,
    synced: watch::Sender<bool>,
    /// During a listing: the keys stored before it began.
    before: Option<HashSet<ObjectRef<K>>>,
    /// During a listing: each listed key with the copy stored before it began, in order.
    listed: Vec<(ObjectRef<K>, Option<Arc<K>>)>,
    /// During a listing: the keys listed so far.
    seen: HashSet<ObjectRef<K>>,
}

impl<K> Relay<K>
where
    K: Resource + Clone + Debug + Send + Sync + 'static,
    K::DynamicType: Eq + Hash + Clone + Default,
{
    fn new(writer: reflector::store::Writer<K>, changes: broadcast::Sender<Change<K>>, synced: watch::Sender<bool>) -> Self {
        let reader = writer.as_reader();
        Self { writer, reader, changes, synced, before: None, listed: Vec::new(), seen: HashSet::new() }
    }

    fn handle(&mut self, event: Event<K>) {
        match &event {
            Event::Init => {
                self.before = Some(self.reader.state().iter().map(|o| ObjectRef::from_obj(o.as_ref())).collect());
                self.listed.clear();
                self.seen.clear();
                self.writer.apply_watcher_event(&event);
            }
            Event::InitApply(obj) => {
                let key = ObjectRef::from_obj(obj);
                let old = self.reader.get(&key);
                self.writer.apply_watcher_event(&event);
                // In the listing's order (the API server's: by name), so that what follows
                // the listing is announced in an order one run repeats.
                if self.seen.insert(key.clone()) {
                    self.listed.push((key, old));
                }
            }
            Event::Apply(obj) => {
                let key = ObjectRef::from_obj(obj);
                let old = self.reader.get(&key);
                self.writer.apply_watcher_event(&event);
                // The store's own copy: no second deep copy per event.
                let new = self.reader.get(&key).unwrap_or_else(|| Arc::new(obj.clone()));
                let _ = self.changes.send(Change::Applied { old, new });
            }
            Event::Delete(obj) => {
                self.writer.apply_watcher_event(&event);
                let _ = self.changes.send(Change::Deleted(Arc::new(obj.clone())));
            }
            Event::InitDone => {
                let mut gone: Vec<Arc<K>> = self
                    .before
                    .take()
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|k| !self.seen.contains(k))
                    .filter_map(|k| self.reader.get(&k))
                    .collect();
                gone.sort_by(|a, b| {
                    (a.meta().namespace.as_deref(), a.meta().name.as_deref())
                        .cmp(&(b.meta().namespace.as_deref(), b.meta().name.as_deref()))
                });
                self.writer.apply_watcher_event(&event);
                self.seen.clear();
                for (key, old) in std::mem::take(&mut self.listed) {
                    let Some(new) = self.reader.get(&key) else { continue };
                    let version = |o: &K| o.meta().resource_version.clone();
                    if old.as_deref().is_some_and(|old| version(old).is_some() && version(old) == version(&new)) {
                        continue;
                    }
                    let _ = self.changes.send(Change::Applied { old, new });
                }
                for obj in gone {
                    let _ = self.changes.send(Change::Deleted(obj));
                }
                let _ = self.synced.send(true);
            }
        }
    }
}

/// Drops from a Node what no controller reads: managed fields, images, volumes, the
/// last-applied annotation, daemon endpoints and node info.
pub fn slim_node(node: &mut k8s_openapi::api::core::v1::Node) {
    node.metadata.managed_fields = None;
    if let Some(a) = node.metadata.annotations.as_mut() {
        a.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
    if let Some(status) = node.status.as_mut() {
        status.images = None;
        status.volumes_attached = None;
        status.volumes_in_use = None;
        status.daemon_endpoints = None;
        status.node_info = None;
        status.capacity = None;
        status.allocatable = None;
        status.config = None;
        status.features = None;
        status.runtime_handlers = None;
    }
}

/// Drops from a Service what no controller reads: managed fields and the last-applied
/// annotation (other annotations go to the provider).
pub fn slim_service(service: &mut k8s_openapi::api::core::v1::Service) {
    service.metadata.managed_fields = None;
    if let Some(a) = service.metadata.annotations.as_mut() {
        a.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    fn object(name: &str, version: &str, value: &str) -> ConfigMap {
        let mut o = ConfigMap::default();
        o.metadata.name = Some(name.into());
        o.metadata.namespace = Some("ns".into());
        o.metadata.resource_version = Some(version.into());
        o.data = Some([("value".to_string(), value.to_string())].into());
        o
    }

    fn value(o: &ConfigMap) -> String {
        o.data.as_ref().and_then(|d| d.get("value")).cloned().unwrap_or_default()
    }

    struct Fixture {
        relay: Relay<ConfigMap>,
        changes: broadcast::Receiver<Change<ConfigMap>>,
        store: Store<ConfigMap>,
        synced: watch::Receiver<bool>,
    }

    impl Fixture {
        fn new() -> Self {
            let (store, writer) = reflector::store::<ConfigMap>();
            let (tx, changes) = broadcast::channel(64);
            let (synced_tx, synced) = watch::channel(false);
            Self { relay: Relay::new(writer, tx, synced_tx), changes, store, synced }
        }

        fn list(&mut self, objects: &[ConfigMap]) {
            self.relay.handle(Event::Init);
            for o in objects {
                self.relay.handle(Event::InitApply(o.clone()));
            }
            self.relay.handle(Event::InitDone);
        }

        /// The changes announced so far, as (name, old value, new value, value in the store
        /// when the change is read) or (name, "deleted").
        fn changes(&mut self) -> Vec<(String, Option<String>, String, String)> {
            let mut out = Vec::new();
            while let Ok(change) = self.changes.try_recv() {
                match change {
                    Change::Applied { old, new } => {
                        let name = new.metadata.name.clone().unwrap_or_default();
                        let stored = self.store.get(&ObjectRef::from_obj(new.as_ref())).map(|o| value(&o)).unwrap_or_default();
                        out.push((name, old.map(|o| value(&o)), value(&new), stored));
                    }
                    Change::Deleted(o) => {
                        out.push((o.metadata.name.clone().unwrap_or_default(), None, "deleted".into(), String::new()))
                    }
                }
            }
            out.sort();
            out
        }
    }

    #[test]
    fn a_relist_announces_every_object_changed_while_away_with_its_new_copy_stored() {
        let mut f = Fixture::new();
        f.list(&[object("a", "1", "a1"), object("b", "2", "b1"), object("d", "3", "d1")]);
        assert!(*f.synced.borrow());
        assert_eq!(f.changes().len(), 3, "the first listing announces every object");

        // The watch was away (410 Expired, an API server restart): a changed, b unchanged,
        // c new, d deleted. Nothing is announced before the listing is complete, because
        // the store swaps the listing in only at its end.
        f.relay.handle(Event::Init);
        for o in [object("a", "7", "a2"), object("b", "2", "b1"), object("c", "8", "c1")] {
            f.relay.handle(Event::InitApply(o));
        }
        assert!(f.changes().is_empty(), "announced before the store holds the listing");
        f.relay.handle(Event::InitDone);
        assert_eq!(
            f.changes(),
            vec![
                ("a".into(), Some("a1".into()), "a2".into(), "a2".into()),
                ("c".into(), None, "c1".into(), "c1".into()),
                ("d".into(), None, "deleted".into(), String::new()),
            ],
            "the changed object with its old and new copy (and the store already new), the new one, the deleted one; not the unchanged one"
        );
    }

    #[test]
    fn watch_events_carry_the_previous_and_the_stored_copy() {
        let mut f = Fixture::new();
        f.list(&[object("a", "1", "a1")]);
        f.changes();
        f.relay.handle(Event::Apply(object("a", "2", "a2")));
        f.relay.handle(Event::Delete(object("a", "3", "a2")));
        assert_eq!(
            f.changes(),
            vec![
                ("a".into(), None, "deleted".into(), String::new()),
                ("a".into(), Some("a1".into()), "a2".into(), String::new()),
            ]
        );
    }
}
