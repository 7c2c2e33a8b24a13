//! One runner for every controller: the shared watches' changes → the controller's triggers →
//! its work queue → N workers → metrics, all supervised as one controller.
//!
//! A controller says only what a change triggers ([`Controller::on_node`],
//! [`Controller::on_service`], [`Controller::on_provider`], [`Controller::resync`]: keys, with
//! a fingerprint of what it acts on when it has one) and how keys are reconciled
//! ([`Controller::reconcile`]: one [`Done`] per key). The queue's rules hold for every
//! controller alike (`queue.rs`): a backoff a resync cannot cut short, batches, throttling
//! not counted as a failure, one reconcile per key at a time.
//!
//! kube-runtime's `applier(reconcile, error_policy, ctx, store, queue)` is the model; the
//! difference is the queue.

use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Service};
use tokio::sync::broadcast::{self, error::RecvError};
use tokio_util::sync::CancellationToken;

use super::{Context, Tasks};
use crate::informer::Change;
use crate::provider::Changes;
use crate::queue::{Outcome, QueueConfig, WorkQueue};

/// How long the workers have to finish the reconciles in hand once told to stop.
const STOP_GRACE: Duration = Duration::from_secs(30);

/// Which of the process's shared watches feed a controller. The runner waits for each one's
/// cache before the first [`Controller::resync`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Watches {
    /// The Node watch ([`Controller::on_node`]).
    pub nodes: bool,
    /// The Service watch ([`Controller::on_service`]).
    pub services: bool,
    /// The provider's identity and epochs ([`Controller::on_provider`]).
    pub provider: bool,
}

/// How the reconcile of one key ended: the queue's [`Outcome`], and whether it counts as a
/// failure in the metrics (a periodic pass that went on past an error is not retried sooner,
/// yet failed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Done {
    /// What the queue does with the key.
    pub outcome: Outcome,
    /// Counted as a failed reconcile.
    pub failed: bool,
}

impl From<Outcome> for Done {
    fn from(outcome: Outcome) -> Self {
        let failed = matches!(outcome, Outcome::Retry { .. });
        Self { outcome, failed }
    }
}

/// A controller, as the runner runs it.
pub trait Controller: Send + Sync + Sized + 'static {
    /// What its queue holds (names, never objects: a reconcile reads the newest object).
    type Key: Clone + Eq + Hash + Send + Sync + std::fmt::Debug + 'static;

    /// Its name (its row in `registry.rs`).
    const NAME: &'static str;

    /// The watches that feed it.
    const WATCHES: Watches;

    /// Its context.
    fn ctx(&self) -> &Context;

    /// Its queue's settings: by default the reconcile backoff flags and the queue's rate.
    fn queue_config(&self) -> QueueConfig {
        let o = &self.ctx().options;
        QueueConfig { base_delay: o.reconcile_backoff_base, max_delay: o.reconcile_backoff_max, ..Default::default() }
    }

    /// Its own work queue, when its own tasks add keys too; by default the runner makes one
    /// from [`Controller::queue_config`].
    fn queue(&self) -> Option<Arc<WorkQueue<Self::Key>>> {
        None
    }

    /// How many workers take keys at once.
    fn workers(&self) -> usize {
        1
    }

    /// How many ready keys a worker takes at once (one overall rate-limit token for them all:
    /// a batch costs one provider call).
    fn batch(&self) -> usize {
        1
    }

    /// Queues what the caches say needs a look, once the watched caches are synced (a
    /// controller whose changes were missed, [`Controller::on_node`] with `None`, usually
    /// does the same again).
    fn resync(&self, queue: &WorkQueue<Self::Key>);

    /// A Node changed; `None`: changes were missed, re-read the cache.
    fn on_node(&self, _change: Option<Change<Node>>, _queue: &WorkQueue<Self::Key>) {}

    /// A Service changed; `None`: changes were missed, re-read the cache.
    fn on_service(&self, _change: Option<Change<Service>>, _queue: &WorkQueue<Self::Key>) {}

    /// The provider changed: connected, a new identity or a new epoch (its state may be lost).
    fn on_provider(&self, _now: Changes, _queue: &WorkQueue<Self::Key>) {}

    /// Reconciles `keys` (at most [`Controller::batch`]): one [`Done`] per key, in order.
    fn reconcile(&self, keys: &[Self::Key]) -> impl Future<Output = Vec<Done>> + Send;

    /// Called when a worker finds the queue empty after a reconcile.
    fn idle(&self) {}

    /// Tasks of its own beside the feed and the workers (timers, a watch of its own), run and
    /// supervised with them: one that ends before the stop is the controller's failure.
    fn spawn(self: &Arc<Self>, _queue: &Arc<WorkQueue<Self::Key>>, _stop: &CancellationToken, _tasks: &mut Tasks) {}
}

/// Runs `controller` until `stop`: its feed, its workers and its own tasks; a task that ends
/// first (a panic above all) ends it with a panic, for the process supervisor to see. Once
/// stopped, the workers finish the reconciles in hand (at most [`STOP_GRACE`], or until the
/// provider answered the mutations they sent).
pub async fn run<C: Controller>(controller: C, stop: CancellationToken) {
    let controller = Arc::new(controller);
    let queue = controller.queue().unwrap_or_else(|| Arc::new(WorkQueue::new(controller.queue_config())));
    let mut tasks = Tasks::default();
    // Subscribed before anything runs, so that no change is missed.
    let nodes = C::WATCHES.nodes.then(|| controller.ctx().nodes.subscribe());
    let services = C::WATCHES.services.then(|| controller.ctx().services.subscribe());
    tasks.spawn(feed(controller.clone(), queue.clone(), nodes, services, stop.clone()));
    for _ in 0..controller.workers().max(1) {
        tasks.spawn(worker(controller.clone(), queue.clone()));
    }
    controller.spawn(&queue, &stop, &mut tasks);
    tasks.supervise(&controller.ctx().instance_name(C::NAME), &stop).await;
    queue.shutdown();
    // A reconcile whose mutation is still awaited is not cut off at the grace: dropped, the
    // call would leave the provider running it with nobody waiting for the answer, and the
    // Lease held until its deadline (minutes). Its call ends by its own deadline.
    let ctx = controller.ctx().clone();
    tasks
        .join_until(async move {
            tokio::time::sleep(STOP_GRACE).await;
            ctx.mutations_answered().await;
        })
        .await;
}

/// The next change of a subscription, or never when there is none.
async fn next<K: Clone>(changes: &mut Option<broadcast::Receiver<Change<K>>>) -> Result<Change<K>, RecvError> {
    match changes {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Waits for the watched caches, resyncs, then hands every change to the controller.
async fn feed<C: Controller>(
    controller: Arc<C>,
    queue: Arc<WorkQueue<C::Key>>,
    mut nodes: Option<broadcast::Receiver<Change<Node>>>,
    mut services: Option<broadcast::Receiver<Change<Service>>>,
    stop: CancellationToken,
) {
    let ctx = controller.ctx().clone();
    let name = ctx.instance_name(C::NAME);
    let synced = async {
        if C::WATCHES.nodes {
            ctx.nodes.wait_synced().await;
        }
        if C::WATCHES.services {
            ctx.services.wait_synced().await;
        }
    };
    tokio::select! {
        _ = synced => {}
        _ = stop.cancelled() => return,
    }
    let mut provider = C::WATCHES.provider.then(|| ctx.provider.changes());
    if let Some(p) = provider.as_mut() {
        p.borrow_and_update();
    }
    controller.resync(&queue);
    ctx.metrics.queue_state(&name, &queue);
    // The queue's metrics after a change, at most every FEED_METRICS_INTERVAL: every Node
    // heartbeat reaches every controller, and a key the change added is reported by the
    // worker that takes it anyway.
    let mut reported = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            change = next(&mut nodes) => match change {
                Ok(change) => controller.on_node(Some(change), &queue),
                Err(RecvError::Lagged(missed)) => {
                    tracing::warn!(controller = %name, missed, "node changes were missed; re-reading the cache");
                    controller.on_node(None, &queue);
                }
                Err(RecvError::Closed) => return,
            },
            change = next(&mut services) => match change {
                Ok(change) => controller.on_service(Some(change), &queue),
                Err(RecvError::Lagged(missed)) => {
                    tracing::warn!(controller = %name, missed, "service changes were missed; re-reading the cache");
                    controller.on_service(None, &queue);
                }
                Err(RecvError::Closed) => return,
            },
            Some(now) = async {
                match provider.as_mut() {
                    Some(p) => p.changed().await.ok().map(|()| *p.borrow_and_update()),
                    None => std::future::pending().await,
                }
            } => controller.on_provider(now, &queue),
        }
        if reported.elapsed() >= FEED_METRICS_INTERVAL {
            ctx.metrics.queue_state(&name, &queue);
            reported = tokio::time::Instant::now();
        }
    }
}

/// How often the feed reports its queue's metrics at most.
const FEED_METRICS_INTERVAL: Duration = Duration::from_millis(250);

/// Takes keys (up to a batch), reconciles them, reports each outcome to the queue and the
/// metrics; ends when the queue is shut down.
async fn worker<C: Controller>(controller: Arc<C>, queue: Arc<WorkQueue<C::Key>>) {
    let metrics = controller.ctx().metrics.clone();
    let name = controller.ctx().instance_name(C::NAME);
    loop {
        let keys = queue.next_batch(controller.batch().max(1)).await;
        if keys.is_empty() {
            return;
        }
        let started = tokio::time::Instant::now();
        let done = controller.reconcile(&keys).await;
        debug_assert_eq!(done.len(), keys.len(), "{}: one outcome per key", C::NAME);
        let elapsed = started.elapsed();
        let mut done = done.into_iter();
        for key in &keys {
            // A missing outcome (a controller's bug) retries its key rather than losing it.
            let d = done.next().unwrap_or_else(|| Outcome::Retry { fingerprint: None, retry_after: None }.into());
            metrics.reconcile(&name, elapsed, d.failed);
            queue.done(key, d.outcome);
        }
        metrics.queue_state(&name, &queue);
        if queue.stats().depth == 0 {
            controller.idle();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_counts_as_failed_and_other_outcomes_do_not() {
        assert!(Done::from(Outcome::Retry { fingerprint: None, retry_after: None }).failed);
        assert!(!Done::from(Outcome::Success).failed);
        assert!(!Done::from(Outcome::Throttled { fingerprint: None, retry_after: Duration::from_secs(1) }).failed);
        assert!(!Done::from(Outcome::RequeueAfter(Duration::from_secs(1))).failed);
    }
}
