//! Leader election, all of it: which Lease guards which controllers ([`plan`]), holding one
//! Lease, renewed and fenced ([`lease`]), and [`Election::lead`], which competes for every
//! group's Lease and runs the group's controllers while it is held.
//!
//! The caller hands over one [`CancellationToken`] (the process's shutdown); each group's
//! controllers get a [`Leading`] that says when its Lease is lost, and a stop token that is
//! cancelled on shutdown or when any group lost its Lease (so that a restart rejoins the
//! election cleanly).

mod lease;
mod plan;

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

pub use lease::{Fence, client, lease_config};
pub use plan::{COMPONENT, ControllerLeader, LeaseGroup, MIGRATION_GROUP, MigrationConfig, PlanError, plan};

use crate::metrics::Metrics;
use crate::options::Options;

/// Why leading ended: a group's controllers failed (losing the Lease among the ways), or a
/// task of the election itself did.
#[derive(Debug, thiserror::Error)]
pub enum LeadError<E: std::error::Error + 'static> {
    /// The controllers run under `lease` ended with an error.
    #[error("Lease {lease}")]
    Group {
        lease: String,
        #[source]
        source: E,
    },
    /// A task of the election panicked or was cancelled.
    #[error("a leader election task failed")]
    Task(#[source] tokio::task::JoinError),
}

/// Who competes, where, and with what timing.
#[derive(Clone)]
pub struct Election {
    client: kube::Client,
    namespace: String,
    identity: String,
    lease_duration: Duration,
    renew_deadline: Duration,
    retry_period: Duration,
    metrics: Metrics,
}

/// A group's Lease, held: `lost` is cancelled the moment it is lost; `fence` answers, before
/// every write, whether it is still certain.
#[derive(Debug, Clone)]
pub struct Leading {
    pub lost: CancellationToken,
    pub fence: Fence,
}

impl Election {
    /// An election on `--leader-elect-resource-namespace` with the `--leader-elect-*` timing,
    /// as `<hostname>_<pid>_<random>` (unique across restarts of a pod).
    pub fn new(options: &Options, client: kube::Client, metrics: Metrics) -> Self {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into());
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        Self {
            client,
            namespace: options.leader_elect_resource_namespace.clone(),
            identity: format!("{host}_{}_{nanos:08x}", std::process::id()),
            lease_duration: options.leader_elect_lease_duration,
            renew_deadline: options.leader_elect_renew_deadline,
            retry_period: options.leader_elect_retry_period.max(Duration::from_millis(200)),
            metrics,
        }
    }

    /// The same election as `identity` (a simulation runs several replicas in one process).
    pub fn with_identity(mut self, identity: impl Into<String>) -> Self {
        self.identity = identity.into();
        self
    }

    /// Competes for every Lease of `groups` at once (a group with `after` only once that group
    /// leads) and, while a group's Lease is held, runs `run(group, leading, stop)`. Ends `Ok`
    /// once every group stopped for `shutdown`; with the first error when a Lease was lost or
    /// `run` failed, after stopping the other groups.
    pub async fn lead<F, Fut, E>(&self, groups: Vec<LeaseGroup>, shutdown: &CancellationToken, run: F) -> Result<(), LeadError<E>>
    where
        F: Fn(LeaseGroup, Leading, CancellationToken) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<(), E>> + Send,
        E: std::error::Error + Send + 'static,
    {
        // Every group stops when the process shuts down or one group lost its Lease.
        let stop = shutdown.child_token();
        let acquired: Vec<CancellationToken> = groups.iter().map(|_| CancellationToken::new()).collect();
        let mut tasks = tokio::task::JoinSet::new();
        for (i, group) in groups.into_iter().enumerate() {
            let after = group.after.and_then(|j| acquired.get(j)).cloned();
            let (election, stop, acquired, run) = (self.clone(), stop.clone(), acquired[i].clone(), run.clone());
            tasks.spawn(async move { election.lead_group(group, after, acquired, stop, run).await });
        }
        let mut result = Ok(());
        while let Some(done) = tasks.join_next().await {
            let outcome = done.map_err(LeadError::Task).and_then(|r| r);
            if let Err(e) = outcome {
                stop.cancel();
                if result.is_ok() {
                    result = Err(e);
                }
            }
        }
        result
    }

    async fn lead_group<F, Fut, E>(
        self,
        group: LeaseGroup,
        after: Option<CancellationToken>,
        acquired: CancellationToken,
        stop: CancellationToken,
        run: F,
    ) -> Result<(), LeadError<E>>
    where
        F: Fn(LeaseGroup, Leading, CancellationToken) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: std::error::Error + 'static,
    {
        if let Some(other) = after {
            tokio::select! {
                _ = other.cancelled() => {}
                _ = stop.cancelled() => return Ok(()),
            }
        }
        let controllers: Vec<&str> = group.controllers.iter().copied().collect();
        tracing::info!(identity = %self.identity, lease = %group.lease, ?controllers, "waiting to acquire the lease");
        let settings = lease::Settings {
            namespace: self.namespace.clone(),
            name: group.lease.clone(),
            identity: self.identity.clone(),
            lease_duration: self.lease_duration,
            renew_deadline: self.renew_deadline,
            retry_period: self.retry_period,
        };
        let Some(held) = lease::acquire(&self.client, &settings, &stop).await else { return Ok(()) };
        tracing::info!(identity = %self.identity, lease = %group.lease, ?controllers, "acquired the lease; starting its controllers");
        // "Acquired" is a token too: cancelled once, it lets the groups that wait for this one go.
        acquired.cancel();
        let lease_name = group.lease.clone();
        self.metrics.lease_held(&lease_name, true);
        let leading = Leading { lost: held.lost.clone(), fence: held.fence.clone() };
        let result = run(group, leading, stop).await.map_err(|source| LeadError::Group { lease: lease_name.clone(), source });
        self.metrics.lease_held(&lease_name, false);
        held.release().await;
        result
    }
}
