//! Load balancers whose Service is gone: deleted from the event when the finalizer was
//! bypassed, and found after a restart by a sweep of the provider's listing, each confirmed by
//! a read of the Service, at most `--max-load-balancer-deletions` a sweep. The same listing
//! finds the load balancers removed or changed behind the core's back ([`super::repair`]).

use std::sync::Arc;
use std::time::Duration;

use ccm_protocol::Error;
use ccm_protocol::names::{load_balancer_name, upstream_load_balancer_name};
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use tokio_util::sync::CancellationToken;

use super::{Key, NAME, ServiceController, service_key};
use crate::events::{EventType, reason};
use crate::provider::convert::ListedLoadBalancer;
use crate::queue::Outcome;
use crate::wellknown::ANNOTATION_LOAD_BALANCER_NAME;

impl ServiceController {
    /// Queues the deletion of the load balancer of `svc`, a Service gone or no longer wanting
    /// one.
    pub(super) fn orphaned(&self, svc: &Service, why: &str) {
        let Some(uid) = svc.metadata.uid.clone().filter(|u| !u.is_empty()) else { return };
        tracing::info!(service = %service_key(svc), %uid, "service {why}; deleting its load balancer");
        self.state().orphans.insert(uid.clone(), svc.clone());
        self.queue.add(Key::Orphan(uid));
    }

    /// Sweeps for orphaned load balancers once the caches are synced and the provider is
    /// known, then every `--load-balancer-resync-period` (jittered up to twice it).
    pub(super) async fn sweep_loop(self: Arc<Self>, stop: CancellationToken) {
        self.ctx.services.wait_synced().await;
        while self.ctx.provider.identity().is_none() {
            if !crate::controllers::sleep_or_stop(Duration::from_secs(1), &stop).await {
                return;
            }
        }
        loop {
            match self.sweep().await {
                Ok(n) if n > 0 => tracing::info!(orphans = n, "load balancers of gone Services queued for deletion"),
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(%error, "listing load balancers failed; nothing deleted, next sweep at the next resync");
                    self.ctx.report_invalid_listing(NAME, &error).await;
                }
            }
            let period = self.ctx.options.load_balancer_resync_period;
            if period.is_zero() {
                // At start only; the task lives on until stop (one that ends is a failure).
                stop.cancelled().await;
                return;
            }
            let wait = period + period.mul_f64(crate::clock::jitter());
            if !crate::controllers::sleep_or_stop(wait, &stop).await {
                return;
            }
        }
    }

    /// Lists the cluster's load balancers and queues the deletion of those named by our scheme
    /// for a Service UID that no longer exists (checked in the cache, then by reading the
    /// Service). Returns how many were queued. A failed page aborts the sweep.
    pub async fn sweep(&self) -> Result<usize, Error> {
        let Some(identity) = self.ctx.provider.identity() else { return Ok(0) };
        if !identity.lists_load_balancers() {
            return Ok(0);
        }
        let limits = identity.name_limits();
        let cluster = self.ctx.options.cluster_name.clone();
        self.adopt_records();
        let before = self.ensured_snapshot();
        let listed = match self.ctx.provider.list_load_balancers(&cluster).await {
            Ok(listed) => listed,
            Err(error) => {
                self.confirm_recorded_hosts(None);
                return Err(error);
            }
        };
        self.confirm_recorded_hosts(Some(&listed));
        // The same listing finds load balancers removed behind our back (see `repair.rs`).
        self.repair_from_listing(&before, &listed).await;
        let known: std::collections::HashSet<String> =
            self.ctx.services.store().state().iter().filter_map(|s| s.metadata.uid.clone()).collect();
        let pending: std::collections::HashSet<String> = self.state().orphans.keys().cloned().collect();
        let scope = self.ctx.options.service_namespace.as_deref();
        let suspects: Vec<ListedLoadBalancer> = listed
            .into_iter()
            .filter(|l| !l.uid.is_empty() && !known.contains(&l.uid) && !pending.contains(&l.uid))
            .filter(|l| scope.is_none_or(|ns| ns == l.namespace))
            // Ours by name, and of this cluster: a readable name carries the cluster; an
            // upstream one (`a` + UID) does not, so it needs the provider's record of the
            // cluster it was ensured with. A listing that strays into another cluster's load
            // balancers (UIDs this cluster never had) deletes none of them.
            .filter(|l| l.cluster_name.is_empty() || l.cluster_name == cluster)
            .filter(|l| {
                load_balancer_name(&cluster, &l.namespace, &l.name, &l.uid, &limits) == l.load_balancer_name
                    || (upstream_load_balancer_name(&l.uid, &limits) == l.load_balancer_name && l.cluster_name == cluster)
            })
            .collect();
        // The cache may lag: only a read of the Service that finds it gone (or under
        // another UID) confirms it.
        let mut confirmed = Vec::new();
        for l in suspects {
            let api: Api<Service> = Api::namespaced(self.ctx.client.clone(), &l.namespace);
            match api.get_opt(&l.name).await {
                Ok(Some(svc)) if svc.metadata.uid.as_deref() == Some(l.uid.as_str()) => {}
                Ok(_) => confirmed.push(l),
                Err(error) => {
                    tracing::warn!(service = %format!("{}/{}", l.namespace, l.name), %error, "could not confirm that the service is gone; its load balancer stays")
                }
            }
        }
        let max = self.ctx.options.max_load_balancer_deletions;
        if confirmed.len() > max {
            let names: Vec<&str> = confirmed.iter().map(|l| l.load_balancer_name.as_str()).collect();
            tracing::warn!(
                orphans = confirmed.len(),
                max,
                load_balancers = ?names,
                "more load balancers look orphaned than --max-load-balancer-deletions allows in one sweep; deleting none"
            );
            self.ctx.metrics.load_balancer_orphans("refused", confirmed.len() as u64);
            return Ok(0);
        }
        for l in &confirmed {
            let svc = Service {
                metadata: kube::api::ObjectMeta {
                    namespace: Some(l.namespace.clone()),
                    name: Some(l.name.clone()),
                    uid: Some(l.uid.clone()),
                    annotations: Some([(ANNOTATION_LOAD_BALANCER_NAME.to_string(), l.load_balancer_name.clone())].into()),
                    ..Default::default()
                },
                ..Default::default()
            };
            self.orphaned(&svc, "is gone (found by the load balancer sweep)");
        }
        Ok(confirmed.len())
    }

    /// Deletes the load balancer of a gone Service (queue key `!<uid>`).
    pub(super) async fn delete_orphan(&self, uid: &str) -> Outcome {
        let Some(svc) = self.state().orphans.get(uid).cloned() else {
            return Outcome::Success;
        };
        // Wanted again (same UID: the type changed back): the normal path owns it.
        let back =
            self.ctx.services.store().state().into_iter().any(|s| s.metadata.uid.as_deref() == Some(uid) && self.queued_for(&s));
        if back {
            self.state().orphans.remove(uid);
            return Outcome::Success;
        }
        if self.ctx.provider.identity().is_none() {
            return Outcome::Retry { fingerprint: None, retry_after: None };
        }
        let name = self.lb_name(&svc);
        match self.delete_every_name(&svc).await {
            Ok(()) => {
                self.state().orphans.remove(uid);
                self.ctx.metrics.load_balancer_orphans("deleted", 1);
                tracing::info!(service = %service_key(&svc), %uid, load_balancer = %name, "deleted the load balancer of a gone service");
                let note = format!("Deleted load balancer {name}: its Service is gone or no longer wants one");
                self.ctx.event(NAME, &svc, EventType::Normal, reason::DELETED_LOAD_BALANCER, note).await;
                Outcome::Success
            }
            Err(error) => {
                tracing::warn!(service = %service_key(&svc), %uid, %error, "deleting the load balancer of a gone service failed");
                Outcome::of_provider_error(None, &error)
            }
        }
    }
}
