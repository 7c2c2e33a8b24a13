//! Leader election, all of it: which Lease guards which controllers ([`plan`]), holding one
//! Lease, renewed and fenced ([`lease`]), and [`Election::lead`], which competes for every
//! group's Lease and runs the group's controllers while it is held.
//!
//! The caller hands over one [`CancellationToken`] (the process's shutdown); each group's
//! controllers get a [`Leading`] that says when its Lease is lost, and a stop token that is
//! cancelled on shutdown or when any group lost its Lease (so that a restart rejoins the
//! election cleanly).

mod lease;
mod ledger;
mod members;
mod plan;

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use tokio_util::sync::CancellationToken;

pub use lease::{Fence, InFlight, client, lease_config};
pub use ledger::{ANNOTATION_SPENT, Ledger, LedgerError};
pub use members::{ANNOTATION_LEASES, ANNOTATION_READY, LABEL_MEMBERS_OF, MAX_MEMBERS, Members, ReadyFor, SharedBy, View};
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
    /// `--leader-elect-resource-name`: the member Leases' base.
    base: String,
    /// Share the groups with other replicas (member Leases; several groups only).
    share: bool,
    metrics: Metrics,
    /// Whether this replica can serve a controller Lease now (shared Leases only).
    ready_for: members::ReadyFor,
    /// Told how many replicas are live (shared Leases only).
    shared_by: members::SharedBy,
}

/// A group's Lease, held: `lost` is cancelled the moment it is lost; `fence` answers, before
/// every write, whether it is still certain.
#[derive(Debug, Clone)]
pub struct Leading {
    pub lost: CancellationToken,
    pub fence: Fence,
    /// What the group's controllers spent under bounds that span tenures, on its Lease.
    pub ledger: Ledger,
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
            base: options.leader_elect_resource_name.clone(),
            share: options.leader_elect_per_controller,
            metrics,
            ready_for: std::sync::Arc::new(|_| true),
            shared_by: std::sync::Arc::new(|_| {}),
        }
    }

    /// With shared Leases, `shared_by` is told after every read of the member Leases how many
    /// replicas are live: each may be running controllers that call the one cloud.
    pub fn with_sharing(mut self, shared_by: members::SharedBy) -> Self {
        self.shared_by = shared_by;
        self
    }

    /// With shared Leases, a replica is given a controller Lease only while `ready_for` it
    /// says it can serve it, and hands over those it holds when it stops being able to.
    pub fn with_readiness(mut self, ready_for: members::ReadyFor) -> Self {
        self.ready_for = ready_for;
        self
    }

    /// The same election as `identity` (a simulation runs several replicas in one process).
    pub fn with_identity(mut self, identity: impl Into<String>) -> Self {
        self.identity = identity.into();
        self
    }

    /// Competes for every Lease of `groups` at once (a group with `after` only once that group
    /// leads) and, while a group's Lease is held, runs `run(group, leading, stop)`. Ends `Ok`
    /// once every group stopped for `shutdown`; with the first error when a Lease was lost or
    /// `run` failed, after stopping the other groups. With `--leader-elect-per-controller`,
    /// the replicas share the groups ([`members`]): a group assigned to another live replica
    /// is handed over (its `stop` cancelled, then its Lease released) and competed for again.
    pub async fn lead<F, Fut, E>(&self, groups: Vec<LeaseGroup>, shutdown: &CancellationToken, run: F) -> Result<(), LeadError<E>>
    where
        F: Fn(LeaseGroup, Leading, CancellationToken) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<(), E>> + Send,
        E: std::error::Error + Send + 'static,
    {
        // Every group stops when the process shuts down or one group lost its Lease.
        let stop = shutdown.child_token();
        let (members, membership) = match self.share && groups.len() > 1 && groups.iter().all(|g| g.after.is_none()) {
            true => {
                let leases: Vec<String> = groups.iter().map(|g| g.lease.clone()).collect();
                let (members, task) = Members::start(
                    self.client.clone(),
                    &self.base,
                    &self.settings(&self.base),
                    &leases,
                    self.ready_for.clone(),
                    self.shared_by.clone(),
                    stop.clone(),
                );
                (Some(members), Some(task))
            }
            false => (None, None),
        };
        let acquired: Vec<CancellationToken> = groups.iter().map(|_| CancellationToken::new()).collect();
        let mut tasks = tokio::task::JoinSet::new();
        for (i, group) in groups.into_iter().enumerate() {
            let after = group.after.and_then(|j| acquired.get(j)).cloned();
            let (election, stop, acquired, run) = (self.clone(), stop.clone(), acquired[i].clone(), run.clone());
            let members = members.clone();
            tasks.spawn(async move { election.lead_group(group, after, acquired, members, stop, run).await });
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
        // The member Lease is released once every group stopped.
        stop.cancel();
        if let Some(task) = membership
            && let Err(error) = task.await
        {
            tracing::error!(%error, "leader election: the member task failed");
        }
        result
    }

    fn settings(&self, name: &str) -> lease::Settings {
        lease::Settings {
            namespace: self.namespace.clone(),
            name: name.to_string(),
            identity: self.identity.clone(),
            lease_duration: self.lease_duration,
            renew_deadline: self.renew_deadline,
            retry_period: self.retry_period,
            labels: Default::default(),
            annotations: Default::default(),
            live_annotations: None,
        }
    }

    async fn lead_group<F, Fut, E>(
        self,
        group: LeaseGroup,
        after: Option<CancellationToken>,
        acquired: CancellationToken,
        members: Option<Members>,
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
        let mut settings = self.settings(&group.lease);
        let live = std::sync::Arc::new(lease::LiveAnnotations::default());
        settings.live_annotations = Some(live.clone());
        let ledger = Ledger::new(
            kube::Api::namespaced(self.client.clone(), &self.namespace),
            group.lease.clone(),
            live,
            self.renew_deadline,
        );
        // How long a Lease handed over must be held before it is handed over again: a lease
        // duration, doubled each time no other replica took it (a replica assigned a Lease
        // it does not compete for would otherwise bounce it back and forth).
        let mut hold_for = self.lease_duration;
        let mut handed_over_at: Option<Instant> = None;
        loop {
            tracing::info!(identity = %self.identity, lease = %group.lease, ?controllers, "waiting to acquire the lease");
            // A Lease assigned to another replica is taken only after it has been free for two
            // retry periods: the assigned replica, trying every retry period, gets it first.
            let patience = || match &members {
                Some(m) if !m.view().mine(&group.lease) => self.retry_period * 2,
                _ => Duration::ZERO,
            };
            let Some(held) = lease::acquire(&self.client, &settings, &stop, patience).await else { return Ok(()) };
            if let Some(at) = handed_over_at.take() {
                if at.elapsed() < self.lease_duration * 2 {
                    hold_for = (hold_for * 2).min(Duration::from_secs(600));
                    tracing::warn!(lease = %group.lease, hold_for = ?hold_for, "leader election: no replica took the Lease handed over; keeping it longer before trying again");
                } else {
                    hold_for = self.lease_duration;
                }
            }
            tracing::info!(identity = %self.identity, lease = %group.lease, ?controllers, "acquired the lease; starting its controllers");
            // "Acquired" is a token too: cancelled once, it lets the groups that wait for this one go.
            acquired.cancel();
            let lease_name = group.lease.clone();
            self.metrics.lease_held(&lease_name, true);
            let leading = Leading { lost: held.lost.clone(), fence: held.fence.clone(), ledger: ledger.clone() };
            let group_stop = stop.child_token();
            let running = run(group.clone(), leading, group_stop.clone());
            tokio::pin!(running);
            let since = Instant::now();
            let hand_over = async {
                let Some(members) = &members else { return std::future::pending().await };
                loop {
                    tokio::time::sleep(self.retry_period).await;
                    if let Some(to) = members::hand_over_to(&members.view(), &group.lease, self.lease_duration)
                        && since.elapsed() >= hold_for
                    {
                        return to;
                    }
                }
            };
            let (result, handed) = tokio::select! {
                result = &mut running => (result, false),
                to = hand_over => {
                    tracing::info!(lease = %group.lease, to = %to, ?controllers, "leader election: handing the Lease over to the replica it is assigned to; stopping its controllers");
                    group_stop.cancel();
                    ((&mut running).await, true)
                }
            };
            self.metrics.lease_held(&lease_name, false);
            // Released only once every mutation made under it has ended (or its deadline
            // passed): the next holder's must not overlap them. A Lease lost meanwhile is
            // not released at all.
            if !held.lost.is_cancelled() && held.fence.in_flight() > 0 {
                tracing::info!(lease = %group.lease, in_flight = held.fence.in_flight(), "leader election: waiting for the mutations made under the Lease to end before releasing it");
                tokio::select! {
                    _ = held.fence.quiesced() => {}
                    _ = held.lost.cancelled() => {}
                }
            }
            held.release().await;
            result.map_err(|source| LeadError::Group { lease: lease_name.clone(), source })?;
            if !handed || stop.is_cancelled() {
                return Ok(());
            }
            self.metrics.lease_handed_over(&lease_name);
            handed_over_at = Some(Instant::now());
        }
    }
}
