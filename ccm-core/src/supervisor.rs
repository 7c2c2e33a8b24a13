//! The background tasks the process cannot do without: the Node and Service watches, the
//! provider's probe, the controllers' token renewal. One that ends before it is told to, a
//! panic above all, ends the process (with its name, `/readyz` failing meanwhile) instead of
//! leaving it running on a cache that no longer follows the cluster or a token about to
//! expire. A restart then starts everything afresh, as for a controller that ends.

use ccm_protocol::lock::Lock;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::metrics::Metrics;

/// Spawns and watches the critical background tasks.
#[derive(Clone)]
pub struct Supervisor {
    tasks: TaskTracker,
    /// Cancelled when one fails: the process's controllers stop on it.
    fail: CancellationToken,
    failure: Arc<Mutex<Option<String>>>,
    metrics: Metrics,
}

impl Supervisor {
    /// Tasks run on `tasks`; a failure cancels `fail` and is reported to `metrics`.
    pub fn new(tasks: TaskTracker, fail: CancellationToken, metrics: Metrics) -> Self {
        Self { tasks, fail, failure: Default::default(), metrics }
    }

    /// Runs `task`, which should run until `stop`: if it ends (or panics) before `stop` is
    /// cancelled, the process fails.
    pub fn spawn(&self, name: &str, stop: &CancellationToken, task: impl Future<Output = ()> + Send + 'static) {
        let this = self.clone();
        let (name, stop) = (name.to_string(), stop.clone());
        self.tasks.spawn(async move {
            let ended = AssertUnwindSafe(task).catch_unwind().await;
            if stop.is_cancelled() {
                return;
            }
            let why = match ended {
                Ok(()) => format!("{name} ended before it was told to stop"),
                Err(panic) => {
                    let message = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    format!("{name} panicked: {message}")
                }
            };
            tracing::error!("{why}; exiting so that the process is restarted");
            this.metrics.set_failed(why.clone());
            this.failure.locked().get_or_insert(why);
            this.fail.cancel();
        });
    }

    /// Why a task failed, if one did.
    pub fn failure(&self) -> Option<String> {
        self.failure.locked().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_task_that_panics_or_ends_early_fails_the_process_and_one_told_to_stop_does_not() {
        let (tasks, fail, stop) = (TaskTracker::new(), CancellationToken::new(), CancellationToken::new());
        let s = Supervisor::new(tasks.clone(), fail.clone(), Metrics::new());
        let told = stop.clone();
        s.spawn("the node watch", &stop, async move { told.cancelled().await });
        tokio::task::yield_now().await;
        assert!(s.failure().is_none() && !fail.is_cancelled());
        s.spawn("the lease renewer", &stop, async { panic!("bad answer") });
        tokio::time::timeout(std::time::Duration::from_secs(5), fail.cancelled()).await.expect("the process fails");
        assert_eq!(s.failure().as_deref(), Some("the lease renewer panicked: bad answer"));
        stop.cancel();
        tasks.close();
        tasks.wait().await;
    }
}
