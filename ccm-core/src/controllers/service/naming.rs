//! Load balancer names: the name a load balancer was made under is recorded on its Service
//! (`ANNOTATION_LOAD_BALANCER_NAME`) before it is made, and kept when `--load-balancer-naming`
//! changes; one made before names were recorded (by upstream, or under the other naming) is
//! found and adopted; `--allow-load-balancer-renaming` makes it anew under the configured
//! name and deletes the old one.
//!
//! The annotation is user-writable, and the protocol keys every call by the name. A name on
//! it is used only when the core itself derives it for this Service now (either naming, this
//! UID, this cluster name, the provider's limits), when this process made or found the load
//! balancer under it, or, for a name of the Service's own form that no longer derives (the
//! cluster name or the provider's limits changed since), when the provider shows a load
//! balancer of this Service under it. Any other is a Warning, ignored and overwritten with the
//! Service's own name: no Service can ensure, take the address of or delete another's load
//! balancer by naming it (issue 54), nor have load balancer after load balancer made by
//! writing name after name (issue 55).

use ccm_protocol::Error;
use ccm_protocol::names::{NameLimits, is_load_balancer_name_of, load_balancer_name, upstream_load_balancer_name};
use k8s_openapi::api::core::v1::Service;

use super::{NAME, ServiceController, SyncError, has_ingress, service_key, source_ranges};
use crate::events::{EventType, reason};
use crate::options::LoadBalancerNaming;
use crate::provider::convert::LoadBalancerRequest;
use crate::provider::set::RecordedProvider;
use crate::wellknown::{ANNOTATION_LOAD_BALANCER_NAME, ANNOTATION_LOAD_BALANCER_PROVIDER};

/// What the annotation says, whoever wrote it.
pub(super) fn annotated_name(svc: &Service) -> Option<&str> {
    svc.metadata.annotations.as_ref()?.get(ANNOTATION_LOAD_BALANCER_NAME).map(String::as_str).filter(|n| !n.is_empty())
}

impl ServiceController {
    /// The name recorded on `svc`, when it is known to be the Service's own without asking
    /// the provider: one the core derives for it now, or the one this process made or found
    /// its load balancer under.
    pub(super) fn recorded_name(&self, svc: &Service) -> Option<String> {
        let name = annotated_name(svc)?;
        let uid = svc.metadata.uid.as_deref()?;
        // The name this process knows first: deriving the readable one hashes the UID.
        let known = self.state().names.get(uid).is_some_and(|known| known == name);
        let own = known
            || [LoadBalancerNaming::Upstream, LoadBalancerNaming::Readable].iter().any(|n| self.name_under(svc, *n) == name);
        own.then(|| name.to_string())
    }

    /// The name recorded on `svc`, when it is the Service's own ([`Self::recorded_name`]), or
    /// of the Service's own form and the provider holds a load balancer of this Service under
    /// it (made before the cluster name or the provider's limits changed): then remembered.
    /// `None` for any other, which is never used.
    async fn verified_recorded_name(&self, svc: &Service) -> Result<Option<String>, Error> {
        if let Some(name) = self.recorded_name(svc) {
            return Ok(Some(name));
        }
        let (Some(name), Some(uid)) = (annotated_name(svc), svc.metadata.uid.as_deref()) else { return Ok(None) };
        // Only a name of the Service's own form is worth a call (the provider refuses one
        // whose load balancer is another Service's in any case).
        if !is_load_balancer_name_of(name, uid) {
            return Ok(None);
        }
        let request = self.request(svc, name.to_string(), source_ranges(svc).unwrap_or_default());
        match self.ctx.provider.get_load_balancer(request).await {
            Ok(Some(_)) => {
                self.state().names.insert(uid.to_string(), name.to_string());
                Ok(Some(name.to_string()))
            }
            Ok(None) => Ok(None),
            Err(error) if error.reason() == ccm_protocol::reason::OWNED_BY_ANOTHER_SERVICE => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// Deletes `svc`'s load balancer under every name it may have: the one it was made under
    /// (either naming's when that was never recorded) and the configured naming's (a rename
    /// half done). Each name is the Service's own (a recorded name that is not is ignored), so
    /// none can be another Service's load balancer.
    pub(super) async fn delete_every_name(&self, svc: &Service) -> Result<(), Error> {
        let recorded = self.verified_recorded_name(svc).await?;
        self.refuse_foreign_name(svc, recorded.as_deref()).await;
        let mut names = vec![self.lb_name(svc)];
        match recorded {
            Some(recorded) => names.push(recorded),
            // Never recorded (made by upstream, or by an older core): either naming's.
            None => names.extend([LoadBalancerNaming::Upstream, LoadBalancerNaming::Readable].map(|n| self.name_under(svc, n))),
        }
        names.push(self.name_under(svc, self.ctx.options.load_balancer_naming));
        names.sort();
        names.dedup();
        // Source ranges matter nothing to a delete: a malformed one is left out.
        let request = self.request(svc, String::new(), source_ranges(svc).unwrap_or_default());
        for name in names {
            self.ctx.cloud().ensure_load_balancer_deleted(request.named(&name)).await?;
        }
        if let Some(uid) = svc.metadata.uid.as_deref() {
            self.state().names.remove(uid);
        }
        Ok(())
    }

    /// Says once per Service and name, with a Warning, that the name on its
    /// `ccm-rs.dev/load-balancer-name` is not one of its own (not `recorded`) and is ignored.
    pub(super) async fn refuse_foreign_name(&self, svc: &Service, recorded: Option<&str>) {
        let Some(foreign) = annotated_name(svc).filter(|name| Some(*name) != recorded) else { return };
        let first = {
            let mut state = self.state();
            if state.refused_names.len() >= super::REFUSED_NAMES_KEPT {
                state.refused_names.clear();
            }
            state.refused_names.insert((service_key(svc), foreign.to_string()))
        };
        if !first {
            return;
        }
        let own = self.name_under(svc, self.ctx.options.load_balancer_naming);
        tracing::warn!(service = %service_key(svc), refused = %foreign, load_balancer = %own, "the recorded load balancer name is not this service's own; ignored");
        let note = format!(
            "{ANNOTATION_LOAD_BALANCER_NAME} names {foreign}, which is not a load balancer name of this Service (not one the core \
             derives for it, and no load balancer of it there): ignored, and replaced with the Service's own ({own}); a Service \
             reaches only its own load balancer"
        );
        self.ctx.event(NAME, svc, EventType::Warning, reason::LOAD_BALANCER_NAME_REFUSED, note).await;
    }

    /// With several providers, a provider recorded on the Service
    /// (`ccm-rs.dev/load-balancer-provider`) that its class does not name acts only once it
    /// has shown that it holds a load balancer of this Service (GetLoadBalancer under each of
    /// the Service's own names). Without one, the annotation is refused with a Warning and
    /// removed, and the provider of the class takes the Service: `false`, nothing to do here.
    pub(super) async fn recorded_provider_holds(&self, svc: &Service) -> Result<bool, SyncError> {
        // Unchecked, the Service is the recorded provider's: only its controller checks.
        let RecordedProvider::Unchecked(index) = self.ctx.providers.recorded_provider(svc) else { return Ok(true) };
        if !self.ours(svc) {
            return Ok(true);
        }
        let mut names = vec![self.lb_name(svc)];
        names.extend([LoadBalancerNaming::Upstream, LoadBalancerNaming::Readable].map(|n| self.name_under(svc, n)));
        names.sort();
        names.dedup();
        let ranges = source_ranges(svc).unwrap_or_default();
        let mut holds = false;
        for name in names {
            match self.ctx.provider.get_load_balancer(self.request(svc, name, ranges.clone())).await {
                Ok(found) => holds |= found.is_some(),
                // Under that name is another Service's load balancer: not this one's.
                Err(error) if error.reason() == ccm_protocol::reason::OWNED_BY_ANOTHER_SERVICE => {}
                Err(error) => return Err(SyncError::Provider(error)),
            }
            if holds {
                break;
            }
        }
        self.ctx.providers.settle_recorded_provider(svc, index, holds);
        if holds {
            return Ok(true);
        }
        let provider = self.ctx.provider.name();
        tracing::warn!(service = %service_key(svc), %provider, "the recorded provider holds no load balancer of this service; the annotation is refused");
        let note = format!(
            "{ANNOTATION_LOAD_BALANCER_PROVIDER} names provider {provider}, which holds no load balancer of this Service: \
             refused and removed; the Service's load balancer class decides its provider"
        );
        self.ctx.event(NAME, svc, EventType::Warning, reason::LOAD_BALANCER_PROVIDER_REFUSED, note).await;
        let patch = serde_json::json!({ "metadata": { "annotations": { ANNOTATION_LOAD_BALANCER_PROVIDER: null } } });
        self.ctx.patch_service(svc, &patch).await.map_err(SyncError::Kube)?;
        Ok(false)
    }

    /// The provider's limits on names.
    fn limits(&self) -> NameLimits {
        self.ctx.provider.identity().map(|i| i.name_limits()).unwrap_or_default()
    }

    /// The name of `svc`'s load balancer under `naming`.
    pub(super) fn name_under(&self, svc: &Service, naming: LoadBalancerNaming) -> String {
        let uid = svc.metadata.uid.as_deref().unwrap_or_default();
        match naming {
            LoadBalancerNaming::Upstream => upstream_load_balancer_name(uid, &self.limits()),
            LoadBalancerNaming::Readable => load_balancer_name(
                &self.ctx.options.cluster_name,
                svc.metadata.namespace.as_deref().unwrap_or_default(),
                svc.metadata.name.as_deref().unwrap_or_default(),
                uid,
                &self.limits(),
            ),
        }
    }

    /// The name `svc`'s load balancer has: the one it was made under (as this controller
    /// last ensured it, or as recorded on the Service), unless renaming is allowed; else the
    /// configured naming's.
    pub(super) fn lb_name(&self, svc: &Service) -> String {
        if !self.ctx.options.allow_load_balancer_renaming {
            let uid = svc.metadata.uid.as_deref().unwrap_or_default();
            if let Some(name) = self.state().names.get(uid) {
                return name.clone();
            }
            if let Some(name) = self.recorded_name(svc) {
                return name;
            }
        }
        self.name_under(svc, self.ctx.options.load_balancer_naming)
    }

    /// The name to ensure `svc`'s load balancer under, and the old name to delete after (a
    /// rename the operator allowed). A load balancer made before its name was recorded (by
    /// upstream's cloud-controller-manager, or by this core under the other naming) is looked
    /// up under the other naming first, and kept under it when it exists there.
    pub(super) async fn naming(&self, svc: &Service, ranges: &[String]) -> Result<(String, Option<String>), Error> {
        let verified = self.verified_recorded_name(svc).await?;
        self.refuse_foreign_name(svc, verified.as_deref()).await;
        let naming = self.ctx.options.load_balancer_naming;
        let configured = self.name_under(svc, naming);
        // The name this process made the load balancer under wins over an annotation that
        // was changed since (written back by the next record).
        let known = svc.metadata.uid.as_deref().and_then(|uid| self.state().names.get(uid).cloned());
        let recorded = match known {
            Some(known) if !self.ctx.options.allow_load_balancer_renaming => Some(known),
            _ => verified,
        };
        if let Some(recorded) = recorded {
            if recorded == configured {
                return Ok((configured, None));
            }
            if self.ctx.options.allow_load_balancer_renaming {
                return Ok((configured, Some(recorded)));
            }
            let first = self.state().kept_names.insert(service_key(svc));
            if first {
                let note = format!(
                    "The load balancer keeps its name {recorded}; --load-balancer-naming would name it {configured} \
                     (--allow-load-balancer-renaming makes it anew under that name, usually with a new address)"
                );
                self.ctx.event(NAME, svc, EventType::Normal, reason::LOAD_BALANCER_NAME_KEPT, note).await;
            }
            return Ok((recorded, None));
        }
        if !has_ingress(svc) {
            return Ok((configured, None));
        }
        let other = match naming {
            LoadBalancerNaming::Upstream => LoadBalancerNaming::Readable,
            LoadBalancerNaming::Readable => LoadBalancerNaming::Upstream,
        };
        let other = self.name_under(svc, other);
        let request = self.request(svc, other.clone(), ranges.to_vec());
        if self.ctx.provider.get_load_balancer(request).await?.is_some() {
            tracing::info!(service = %service_key(svc), load_balancer = %other, "adopted a load balancer made under the other naming");
            return Ok((other, None));
        }
        Ok((configured, None))
    }

    /// After a load balancer was made under its new name (--allow-load-balancer-renaming):
    /// the old one is deleted, then the new name recorded.
    pub(super) async fn finish_rename(
        &self,
        svc: &Service,
        old_request: LoadBalancerRequest,
        new: &str,
    ) -> Result<(), SyncError> {
        let old = old_request.load_balancer_name().to_string();
        self.ctx.cloud().ensure_load_balancer_deleted(old_request).await.map_err(SyncError::Provider)?;
        let patch = serde_json::json!({ "metadata": { "annotations": { ANNOTATION_LOAD_BALANCER_NAME: new } } });
        self.ctx.patch_service(svc, &patch).await.map_err(SyncError::Kube)?;
        tracing::info!(service = %service_key(svc), %old, %new, "load balancer renamed");
        let note =
            format!("Renamed load balancer {old} to {new} (--allow-load-balancer-renaming): made anew, the old one deleted");
        self.ctx.event(NAME, svc, EventType::Normal, reason::RENAMED_LOAD_BALANCER, note).await;
        Ok(())
    }
}
