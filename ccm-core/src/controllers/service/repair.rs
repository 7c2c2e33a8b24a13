//! Load balancers changed behind the core's back: one deleted in the cloud's console is made
//! again, one whose backends were changed by hand is given its own again.
//!
//! - Where the provider lists load balancers, the sweep that lists them for orphans
//!   ([`super::orphans`]) also finds the load balancers this process made that the listing
//!   misses: no extra call. Where it cannot (every Go provider the adapter serves), or the
//!   sweep runs only at start (`--load-balancer-resync-period=0s`), one GetLoadBalancer per
//!   load balancer, spread over `--load-balancer-repair-period`.
//! - The evidence rules of deletions: a load balancer is made again only when a complete
//!   listing misses it **and** a GetLoadBalancer that names it says it does not exist (an
//!   explicit `exists=false`; an error or a timeout is nothing), and only when nothing was
//!   written to it since before the cloud was asked (a mutation in flight, a rename, a delete
//!   all win). A listing that misses every load balancer this process made (more than one)
//!   makes none again; at most `--max-load-balancer-repairs` are made again per sweep (per
//!   repair period without listing), the rest at the next.
//! - Hosts: only where the provider reports them, and only for a load balancer whose node set
//!   is the one it was last given (one about to be updated is left to that update).
//! - The repair itself goes through the Service's queue key, which claims the load balancer
//!   against the bulk hosts pass ([`super::Claim`]), so there is never a second mutation of one
//!   load balancer in flight; the Event `LoadBalancerRecreated` says it was made again once
//!   that succeeded.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use kube::runtime::reflector::ObjectRef;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::hosts::node_selector;
use super::{Ensured, Key, NAME, ServiceController, has_finalizer, naming, service_key};
use crate::events::{EventType, reason};
use crate::provider::convert::ListedLoadBalancer;

/// The most names one drift Event lists of each side.
const NAMES_IN_EVENT: usize = 5;

impl ServiceController {
    /// What this process made, as of now: read before the cloud is asked, so that a repair
    /// acts only on load balancers nothing was written to since.
    pub(super) fn ensured_snapshot(&self) -> HashMap<String, Ensured> {
        self.state().ensured.clone()
    }

    /// The Service of key `k` and the name its load balancer was made under, when it still
    /// wants that load balancer (not being deleted or renamed).
    fn made(&self, k: &str) -> Option<(Arc<Service>, String)> {
        let (ns, name) = k.split_once('/')?;
        let svc = self.ctx.services.store().get(&ObjectRef::new(name).within(ns))?;
        if !self.wants_load_balancer(&svc) || !has_finalizer(&svc) {
            return None;
        }
        let lb_name = self.state().names.get(svc.metadata.uid.as_deref()?).cloned()?;
        (naming::annotated_name(&svc) == Some(lb_name.as_str())).then_some((svc, lb_name))
    }

    /// After a complete listing taken after `before` was read: the load balancers this
    /// process made that it misses are read one by one and made again when the read confirms
    /// them gone; those it lists with hosts other than the ones given are given them again.
    pub(super) async fn repair_from_listing(&self, before: &HashMap<String, Ensured>, listed: &[ListedLoadBalancer]) {
        let by_name: HashMap<&str, &ListedLoadBalancer> = listed.iter().map(|l| (l.load_balancer_name.as_str(), l)).collect();
        let mut keys: Vec<&String> = before.keys().collect();
        keys.sort();
        let (mut made, mut missing) = (0, Vec::new());
        for k in keys {
            let Some((svc, lb_name)) = self.made(k) else { continue };
            made += 1;
            match by_name.get(lb_name.as_str()) {
                None => missing.push((svc, k, lb_name)),
                Some(listed) => {
                    if let Some(hosts) = &listed.hosts {
                        self.check_hosts(&svc, k, before[k], &lb_name, hosts).await;
                    }
                }
            }
        }
        if missing.is_empty() {
            return;
        }
        if missing.len() == made && made > 1 {
            tracing::warn!(
                missing = missing.len(),
                "the load balancer listing misses every load balancer this process made; taken as a wrong answer, none is made again"
            );
            self.ctx.metrics.load_balancer_repairs("refused", missing.len() as u64);
            return;
        }
        let max = self.ctx.options.max_load_balancer_repairs;
        if missing.len() > max {
            tracing::warn!(
                missing = missing.len(),
                max,
                "more load balancers are missing than --max-load-balancer-repairs allows in one sweep; the rest at the next"
            );
            self.ctx.metrics.load_balancer_repairs("refused", (missing.len() - max) as u64);
        }
        for (svc, k, lb_name) in missing.into_iter().take(max) {
            // Confirmed by a read that names it: a listing can lag a create, or be wrong.
            match self.ctx.provider.read_load_balancer(self.request(&svc, lb_name.clone(), Vec::new())).await {
                Ok(None) => self.recreate(k, before[k], &lb_name),
                Ok(Some(found)) => {
                    if let Some(hosts) = &found.hosts {
                        self.check_hosts(&svc, k, before[k], &lb_name, hosts).await;
                    }
                }
                Err(error) => {
                    tracing::warn!(service = %k, load_balancer = %lb_name, %error, "the listing misses the load balancer but reading it failed; left as it is")
                }
            }
        }
    }

    /// Without listing: one GetLoadBalancer per load balancer this process made, spread over
    /// `--load-balancer-repair-period`; a provider that lists is left to the sweep.
    pub(super) async fn repair_loop(self: Arc<Self>, stop: CancellationToken) {
        self.ctx.services.wait_synced().await;
        loop {
            let period = self.ctx.options.load_balancer_repair_period;
            if period.is_zero() {
                stop.cancelled().await;
                return;
            }
            // A provider that lists is looked at by the sweep, unless the sweep runs only at
            // start (`--load-balancer-resync-period=0s`): then by these reads too.
            let sweeps = !self.ctx.options.load_balancer_resync_period.is_zero();
            let lists = self.ctx.provider.identity().map(|i| i.lists_load_balancers() && sweeps);
            self.adopt_records();
            let mut keys: Vec<String> = self.state().ensured.keys().cloned().collect();
            if lists != Some(false) || keys.is_empty() {
                // Not known yet, listed by the sweep, or nothing made yet: looked at again soon.
                if !crate::controllers::sleep_or_stop(period.min(Duration::from_secs(60)), &stop).await {
                    return;
                }
                continue;
            }
            keys.sort();
            // Each read at its own point of the period, however long the reads take: the
            // period is the cycle, so the calls an hour are what the flag says.
            let gap = period / keys.len() as u32;
            let cycle = Instant::now();
            for (i, k) in keys.iter().enumerate() {
                let at = cycle + gap * (i as u32 + 1);
                if !crate::controllers::sleep_or_stop(at.saturating_duration_since(Instant::now()), &stop).await {
                    return;
                }
                self.check_one(k, period).await;
            }
        }
    }

    /// Reads the load balancer of Service `k`: made again when it is gone (within the bound
    /// over `window`), given its hosts again when they drifted.
    async fn check_one(&self, k: &str, window: Duration) {
        let Some(before) = self.state().ensured.get(k).copied() else { return };
        let Some((svc, lb_name)) = self.made(k) else { return };
        match self.ctx.provider.read_load_balancer(self.request(&svc, lb_name.clone(), Vec::new())).await {
            Ok(None) => {
                if self.repair_budget(window).await {
                    self.recreate(k, before, &lb_name);
                } else {
                    tracing::warn!(
                        service = %k,
                        load_balancer = %lb_name,
                        max = self.ctx.options.max_load_balancer_repairs,
                        "the load balancer is gone from the cloud, but --max-load-balancer-repairs were made again in this repair period; it waits"
                    );
                    self.ctx.metrics.load_balancer_repairs("refused", 1);
                }
            }
            Ok(Some(found)) => {
                if let Some(hosts) = &found.hosts {
                    self.check_hosts(&svc, k, before, &lb_name, hosts).await;
                }
            }
            Err(error) => tracing::debug!(service = %k, %error, "reading the load balancer failed; looked at again next period"),
        }
    }

    /// Whether one more load balancer may be made again in the `window` up to now (and, when
    /// it may, counts it). The window spans tenures: what earlier holders of the controller's
    /// Lease made again counts ([`crate::leader::Ledger`]), and this one is recorded there
    /// before it is made; neither read nor recorded, none is made.
    async fn repair_budget(&self, window: Duration) -> bool {
        // Per provider: with several, each provider's service controller keeps its own count
        // under the one Lease (`default` with a single provider).
        let key = format!("load-balancer-repairs.{}", self.ctx.provider.name());
        let ledger = self.ctx.ledger.as_ref();
        if let Some(ledger) = ledger
            && !self.state().repairs_loaded
        {
            match ledger.load(&key).await {
                Ok(times) => {
                    let mut state = self.state();
                    state.repaired_at = times.into();
                    state.repairs_loaded = true;
                }
                Err(error) => {
                    tracing::warn!(error = %crate::metrics::chain(&error), "what was made again in the repair period cannot be read; nothing is made again now");
                    return false;
                }
            }
        }
        let max = self.ctx.options.max_load_balancer_repairs;
        let now = Instant::now();
        let spent: Vec<Instant> = {
            let mut state = self.state();
            while state.repaired_at.front().is_some_and(|t| now.duration_since(*t) >= window) {
                state.repaired_at.pop_front();
            }
            if state.repaired_at.len() >= max {
                return false;
            }
            state.repaired_at.push_back(now);
            state.repaired_at.iter().copied().collect()
        };
        match ledger {
            Some(ledger) => match ledger.record(&key, &spent).await {
                Ok(()) => true,
                Err(error) => {
                    tracing::warn!(error = %crate::metrics::chain(&error), "the repair's record was not kept; not made again now");
                    false
                }
            },
            None => true,
        }
    }

    /// A hosts update found the load balancer of Service `k` gone: it is made again at its
    /// key's next Ensure when the repair bound over `--load-balancer-repair-period` has room
    /// (counted as one repair); whether it will be. Another road to a repair spends the same
    /// budget, so that a cloud cleanup is not undone at the pace of Node changes.
    pub(super) async fn found_gone(&self, k: &str) -> bool {
        let period = self.ctx.options.load_balancer_repair_period;
        if !period.is_zero() && !self.repair_budget(period).await {
            tracing::warn!(
                service = %k,
                max = self.ctx.options.max_load_balancer_repairs,
                "the load balancer is gone from the cloud, but --max-load-balancer-repairs were made again in this repair period; it waits"
            );
            self.ctx.metrics.load_balancer_repairs("refused", 1);
            return false;
        }
        let mut state = self.state();
        state.ensured.remove(k);
        state.repairing.insert(k.to_string());
        state.void_records.insert(k.to_string());
        tracing::warn!(service = %k, "the load balancer is gone from the cloud (a hosts update found it missing); making it again");
        true
    }

    /// Makes the load balancer of Service `k` again (a full Ensure through its queue key),
    /// unless something was written to it since `before` was read.
    fn recreate(&self, k: &str, before: Ensured, lb_name: &str) {
        {
            let mut state = self.state();
            if state.ensured.get(k).map(|e| e.at) != Some(before.at) {
                return;
            }
            state.ensured.remove(k);
            state.repairing.insert(k.to_string());
            state.void_records.insert(k.to_string());
        }
        tracing::warn!(service = %k, load_balancer = %lb_name, "the load balancer is gone from the cloud (deleted outside Kubernetes); making it again");
        self.queue.add(Key::Service(k.to_string()));
    }

    /// Gives the load balancer of `svc` its hosts again when `reported` (sorted) are not the
    /// node set it was last given and still should have.
    async fn check_hosts(&self, svc: &Service, k: &str, before: Ensured, lb_name: &str, reported: &[String]) {
        let Ok(selector) = node_selector(svc) else { return };
        let set = self.backends(selector.as_ref());
        // An update is on its way (or an emptied set keeps the last hosts): not drift.
        if set.hosts != before.hosts || set.is_empty() {
            return;
        }
        let given: Vec<&str> = set.provider().proto().iter().map(|n| n.name.as_str()).collect();
        if given.iter().copied().eq(reported.iter().map(String::as_str)) {
            return;
        }
        {
            let mut state = self.state();
            match state.ensured.get_mut(k) {
                // Not what it was given any more: the next reconcile gives it again.
                Some(e) if e.at == before.at => e.hosts = set.hosts.wrapping_add(1),
                _ => return,
            }
        }
        let missing: Vec<&str> =
            given.iter().copied().filter(|g| reported.binary_search_by(|r| r.as_str().cmp(g)).is_err()).collect();
        let extra: Vec<&str> = reported.iter().map(String::as_str).filter(|r| given.binary_search(r).is_err()).collect();
        let list = |names: &[&str]| {
            let shown = names.iter().take(NAMES_IN_EVENT).copied().collect::<Vec<_>>().join(", ");
            if names.len() > NAMES_IN_EVENT { format!("{shown} and {} more", names.len() - NAMES_IN_EVENT) } else { shown }
        };
        let mut what = Vec::new();
        if !missing.is_empty() {
            what.push(format!("without {}", list(&missing)));
        }
        if !extra.is_empty() {
            what.push(format!("with {} too", list(&extra)));
        }
        tracing::warn!(service = %k, load_balancer = %lb_name, missing = ?missing, extra = ?extra, "the load balancer's backends were changed outside Kubernetes; giving it its own again");
        let note = format!(
            "Load balancer {lb_name} has backends changed outside Kubernetes ({}): giving it its {} backends again",
            what.join("; "),
            set.count
        );
        self.ctx.event(NAME, svc, EventType::Warning, reason::LOAD_BALANCER_HOSTS_DRIFTED, note).await;
        self.ctx.metrics.load_balancer_repairs("hosts", 1);
        self.queue.add(Key::Service(service_key(svc)));
    }
}
