//! One watch per resource kind, shared by every controller: a reflector store that
//! controllers read, and a fan-out of changes (with the previous version, so a controller can
//! tell whether a field it acts on changed).
//!
//! Objects are slimmed before they are stored: managed fields and other bulk no controller
//! reads are dropped, so memory grows with what the controllers use, not with object size.

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
use tokio_util::task::TaskTracker;

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

impl<K> Informer<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Eq + Hash + Clone + Default,
{
    /// Starts watching `api`; `slim` removes what controllers do not need before storing.
    /// The watch runs on `tasks` until `stop`.
    pub fn start(api: Api<K>, config: watcher::Config, slim: fn(&mut K), tasks: &TaskTracker, stop: CancellationToken) -> Self {
        let (store, mut writer) = reflector::store::<K>();
        let (changes, _) = broadcast::channel(16_384);
        let (synced_tx, synced) = watch::channel(false);
        let failures: Arc<std::sync::Mutex<Failures>> = Default::default();
        let failing = failures.clone();
        let sender = changes.clone();
        let reader = store.clone();
        tasks.spawn(async move {
            let mut stream = watcher::watcher(api, config).default_backoff().boxed();
            // Keys present before a re-list, to notice objects deleted while disconnected.
            let mut before: Option<HashSet<ObjectRef<K>>> = None;
            let mut seen: HashSet<ObjectRef<K>> = HashSet::new();
            loop {
                let event = tokio::select! {
                    e = stream.next() => e,
                    _ = stop.cancelled() => return,
                };
                let Some(event) = event else { return };
                let mut event = match event {
                    Ok(event) => {
                        *failing.lock().unwrap_or_else(|p| p.into_inner()) = Failures::default();
                        event
                    }
                    Err(error) => {
                        tracing::warn!(%error, kind = %K::kind(&Default::default()), "watch failed; retrying with backoff");
                        let now = tokio::time::Instant::now();
                        let mut f = failing.lock().unwrap_or_else(|p| p.into_inner());
                        let ongoing = f.last.as_ref().is_some_and(|(at, _)| now.duration_since(*at) < FAILURE_RUN_GAP);
                        if !ongoing {
                            f.since = Some(now);
                        }
                        f.last = Some((now, error.to_string()));
                        continue;
                    }
                };
                match &mut event {
                    Event::Apply(obj) | Event::InitApply(obj) => slim(obj),
                    Event::Delete(obj) => slim(obj),
                    _ => {}
                }
                match &event {
                    Event::Init => {
                        before = Some(reader.state().iter().map(|o| ObjectRef::from_obj(o.as_ref())).collect());
                        seen.clear();
                    }
                    Event::Apply(obj) | Event::InitApply(obj) => {
                        let key = ObjectRef::from_obj(obj);
                        let old = reader.get(&key);
                        writer.apply_watcher_event(&event);
                        // The store's own copy: no second deep copy per event.
                        let new = reader.get(&key).unwrap_or_else(|| Arc::new(obj.clone()));
                        seen.insert(key);
                        let _ = sender.send(Change::Applied { old, new });
                        continue;
                    }
                    Event::Delete(obj) => {
                        writer.apply_watcher_event(&event);
                        let _ = sender.send(Change::Deleted(Arc::new(obj.clone())));
                        continue;
                    }
                    Event::InitDone => {
                        let gone: Vec<Arc<K>> = before
                            .take()
                            .unwrap_or_default()
                            .into_iter()
                            .filter(|k| !seen.contains(k))
                            .filter_map(|k| reader.get(&k))
                            .collect();
                        writer.apply_watcher_event(&event);
                        for obj in gone {
                            let _ = sender.send(Change::Deleted(obj));
                        }
                        let _ = synced_tx.send(true);
                        continue;
                    }
                }
                writer.apply_watcher_event(&event);
            }
        });
        Self { store, changes, synced, failures }
    }

    /// How long the watch has been failing, with its last error: `None` while it works (or
    /// since no failure came for 40 s).
    pub fn failing(&self) -> Option<(std::time::Duration, String)> {
        let f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
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
