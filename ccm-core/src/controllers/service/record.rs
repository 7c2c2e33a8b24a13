//! What was ensured, recorded on the Service (`ccm-rs.dev/load-balancer-ensured`) so that a
//! new process (a restart, a crash, a move to another replica with its own sidecar) does not
//! ensure again a load balancer that is as its Service asks.
//!
//! - The record is written after an EnsureLoadBalancer succeeded and its status was written,
//!   and removed before the next full Ensure starts: a process that dies in the middle of an
//!   Ensure leaves no record, so the next one ensures. It is removed with the finalizer when
//!   the load balancer is deleted.
//! - It holds a key over everything the Ensure was made of: the Service's UID, the spec the
//!   provider is sent (ports, source ranges, annotations, endpoints where the provider
//!   forwards to pods), the load balancer's name, the provider's name and its epoch (a
//!   provider whose state lives in memory has a new one on each start: its records do not
//!   hold past it). Any of them changed, the record does not match, and the load balancer is
//!   ensured.
//! - And the fingerprint and size of the node set it was given: the hosts of a load balancer
//!   whose node set changed since are updated (one bulk call per 500 where the provider
//!   updates hosts in bulk), not ensured. Hosts updates do not rewrite the record (that would
//!   be a write per load balancer per node change).
//! - A load balancer deleted in the cloud while no replica led is found by the listing the
//!   service controller makes at start (or by the repair reads without listing): see
//!   [`super::repair`].
//!
//! A Service author can write the annotation on their own Service only: a forged record
//! matches nothing (the key covers the UID), or at worst spares an Ensure of their own load
//! balancer until its next change or repair.

use std::hash::{Hash, Hasher};

use k8s_openapi::api::core::v1::Service;

use std::collections::HashMap;

use super::{Ensured, ServiceController, SyncError};
use crate::provider::convert::ListedLoadBalancer;
use crate::wellknown::ANNOTATION_LOAD_BALANCER_ENSURED;

/// The record's format version.
const VERSION: &str = "v1";

/// A record as written: the key of what was ensured, and the node set it was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Record {
    key: u64,
    hosts: u64,
    count: usize,
}

impl Record {
    /// The annotation's value.
    fn encode(&self) -> String {
        format!("{VERSION}.{:016x}.{:016x}.{}", self.key, self.hosts, self.count)
    }

    /// A value the core wrote; anything else is `None` (and an Ensure).
    fn decode(value: &str) -> Option<Self> {
        let mut parts = value.split('.');
        if parts.next()? != VERSION {
            return None;
        }
        let key = u64::from_str_radix(parts.next()?, 16).ok()?;
        let hosts = u64::from_str_radix(parts.next()?, 16).ok()?;
        let count = parts.next()?.parse().ok()?;
        parts.next().is_none().then_some(Self { key, hosts, count })
    }
}

/// The key of an Ensure of `spec` for the Service of `uid` under `lb_name`, by `provider` at
/// `epoch`.
fn key(uid: &str, spec: u64, lb_name: &str, provider: &str, epoch: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (uid, spec, lb_name, provider, epoch).hash(&mut h);
    h.finish()
}

/// The record on `svc`, as written.
fn recorded(svc: &Service) -> Option<&str> {
    svc.metadata.annotations.as_ref()?.get(ANNOTATION_LOAD_BALANCER_ENSURED).map(String::as_str)
}

impl ServiceController {
    /// The key of ensuring `svc` as it is now under `lb_name`; `None` until the provider is
    /// known.
    fn record_key(&self, svc: &Service, lb_name: &str) -> Option<u64> {
        let identity = self.ctx.provider.identity()?;
        let uid = svc.metadata.uid.as_deref()?;
        Some(key(uid, self.ensured_spec(svc), lb_name, self.ctx.provider.name(), &identity.epoch))
    }

    /// What `svc`'s record says its load balancer is, when the record is of ensuring `svc` as
    /// it is now under `lb_name`.
    pub(super) fn ensured_by_record(&self, svc: &Service, lb_name: &str) -> Option<Ensured> {
        let record = Record::decode(recorded(svc)?)?;
        // Where the provider lists load balancers, the first sweep (at start) tells whether
        // the cloud has the current hosts already.
        let unconfirmed = !self.state().swept && self.ctx.provider.identity().is_some_and(|i| i.lists_load_balancers());
        (Some(record.key) == self.record_key(svc, lb_name)).then(|| Ensured {
            spec: self.ensured_spec(svc),
            hosts: record.hosts,
            count: record.count,
            at: 0,
            unconfirmed,
        })
    }

    /// Before a sweep or a round of repair reads: the records of Services this process has
    /// not ensured yet count as what it made, so that a load balancer deleted in the cloud
    /// while no replica led is found missing and made again.
    pub(super) fn adopt_records(&self) {
        for svc in self.ctx.services.sorted() {
            if !self.wants_load_balancer(&svc) || !super::has_finalizer(&svc) {
                continue;
            }
            let k = super::service_key(&svc);
            let (Some(uid), Some(name)) = (svc.metadata.uid.clone(), self.recorded_name(&svc)) else { continue };
            // A rename waiting is its own reconcile's.
            if self.ctx.options.allow_load_balancer_renaming
                && name != self.name_under(&svc, self.ctx.options.load_balancer_naming)
            {
                continue;
            }
            if self.state().ensured.contains_key(&k) || self.state().void_records.contains(&k) {
                continue;
            }
            let Some(e) = self.ensured_by_record(&svc, &name) else { continue };
            let mut state = self.state();
            if !state.ensured.contains_key(&k) {
                state.names.insert(uid, name);
                state.record(k, e);
            }
        }
    }

    /// After the first sweep's listing (`None`: it failed): each load balancer taken from its
    /// record whose hosts wait is either found with the current hosts in the cloud (nothing
    /// to do) or given them by the bulk pass.
    pub(super) fn confirm_recorded_hosts(&self, listed: Option<&[ListedLoadBalancer]>) {
        let by_name: HashMap<&str, &ListedLoadBalancer> =
            listed.unwrap_or_default().iter().map(|l| (l.load_balancer_name.as_str(), l)).collect();
        let mut update = false;
        for svc in self.ctx.services.sorted() {
            let k = super::service_key(&svc);
            let uid = svc.metadata.uid.as_deref().unwrap_or_default();
            let (entry, name) = {
                let state = self.state();
                (state.ensured.get(&k).copied(), state.names.get(uid).cloned())
            };
            let Some(e) = entry.filter(|e| e.unconfirmed) else { continue };
            let Ok(selector) = super::hosts::node_selector(&svc) else { continue };
            let set = self.backends(selector.as_ref());
            let reported = name.as_deref().and_then(|n| by_name.get(n)).and_then(|l| l.hosts.as_ref());
            let given: Vec<&str> = set.provider().proto().iter().map(|n| n.name.as_str()).collect();
            let has_them = reported.is_some_and(|r| !set.is_empty() && given.iter().copied().eq(r.iter().map(String::as_str)));
            let mut state = self.state();
            if let Some(now) = state.ensured.get_mut(&k).filter(|now| now.at == e.at) {
                now.unconfirmed = false;
                if has_them {
                    now.hosts = set.hosts;
                    now.count = set.count;
                } else {
                    update |= now.hosts != set.hosts;
                }
            }
        }
        self.state().swept = true;
        if update {
            self.queue.add(super::Key::Hosts);
        }
    }

    /// Before a full Ensure: the record goes, so that one that does not end leaves none.
    /// Whether there was one to remove.
    pub(super) async fn forget_record(&self, svc: &Service) -> Result<bool, SyncError> {
        if recorded(svc).is_none() {
            return Ok(false);
        }
        let patch = serde_json::json!({ "metadata": { "annotations": { ANNOTATION_LOAD_BALANCER_ENSURED: null } } });
        self.ctx.patch_service(svc, &patch).await.map_err(SyncError::Kube)?;
        Ok(true)
    }

    /// After an Ensure whose status was written: `ensured` recorded on `svc` (`forgotten`:
    /// its record was removed before the Ensure, whatever `svc` still shows).
    pub(super) async fn write_record(
        &self,
        svc: &Service,
        lb_name: &str,
        ensured: Ensured,
        forgotten: bool,
    ) -> Result<(), SyncError> {
        let Some(key) = self.record_key(svc, lb_name) else { return Ok(()) };
        let value = Record { key, hosts: ensured.hosts, count: ensured.count }.encode();
        if !forgotten && recorded(svc) == Some(value.as_str()) {
            return Ok(());
        }
        let patch = serde_json::json!({ "metadata": { "annotations": { ANNOTATION_LOAD_BALANCER_ENSURED: value } } });
        self.ctx.patch_service(svc, &patch).await.map_err(SyncError::Kube)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_and_nothing_else_reads_as_one() {
        let record = Record { key: 0xdead_beef, hosts: u64::MAX, count: 1000 };
        assert_eq!(Record::decode(&record.encode()), Some(record));
        for bad in ["", "v1", "v2.00000000deadbeef.ffffffffffffffff.1000", "v1.x.y.1", "v1.1.2.3.4", "v1.1.2.-1"] {
            assert_eq!(Record::decode(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_key_changes_with_each_part() {
        let base = key("uid", 1, "lb", "default", "");
        for other in [
            key("uid2", 1, "lb", "default", ""),
            key("uid", 2, "lb", "default", ""),
            key("uid", 1, "lb2", "default", ""),
            key("uid", 1, "lb", "metal", ""),
            key("uid", 1, "lb", "default", "epoch-2"),
        ] {
            assert_ne!(base, other);
        }
        assert_eq!(base, key("uid", 1, "lb", "default", ""), "the same in every process of one build");
    }
}
