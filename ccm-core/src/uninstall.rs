//! `cloud-controller-manager release-finalizers`: what an uninstall runs once the core is gone
//! (the chart's post-delete hook). The service controller's finalizer
//! (`service.kubernetes.io/load-balancer-cleanup`) makes deleting a LoadBalancer Service wait
//! for the cloud's load balancer to go; with no controller left that wait never ends. This
//! removes the finalizer from every Service, and only after every Lease of the core
//! (`--leader-elect-resource-name`, and `<name>-<controller>` ones) has no live holder, so a
//! running core never races it. Cloud load balancers are left as they are: a later install
//! finds them again under the same names.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};

use crate::wellknown::{ANNOTATION_LOAD_BALANCER_NAME, FINALIZER};

/// Errors of the release.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A core still leads.
    #[error("Lease {namespace}/{name} is still held by {holder}: stop every cloud-controller-manager first")]
    StillLeading {
        /// The Lease's namespace.
        namespace: String,
        /// The Lease's name.
        name: String,
        /// Its holder.
        holder: String,
    },
    /// The API server refused or failed a request.
    #[error("{what}: {source}")]
    Kube {
        /// What was being done.
        what: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
}

fn kube(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let what = what.into();
    move |source| Error::Kube { what, source }
}

/// The live holder of one of the core's Leases, if any: (name, holder).
async fn live_holder(client: &kube::Client, namespace: &str, lease_name: &str) -> Result<Option<(String, String)>, Error> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let list = leases.list(&ListParams::default()).await.map_err(kube(format!("listing Leases in {namespace}")))?;
    let now = jiff::Timestamp::now();
    for lease in list.items {
        let name = lease.metadata.name.clone().unwrap_or_default();
        if name != lease_name && !name.starts_with(&format!("{lease_name}-")) {
            continue;
        }
        let Some(spec) = lease.spec else { continue };
        let Some(holder) = spec.holder_identity.filter(|h| !h.is_empty()) else { continue };
        let renewed = spec.renew_time.map(|t| t.0).or(spec.acquire_time.map(|t| t.0));
        let duration = jiff::SignedDuration::from_secs(i64::from(spec.lease_duration_seconds.unwrap_or(15)));
        if renewed.is_some_and(|r| r.checked_add(duration).is_ok_and(|end| end > now)) {
            return Ok(Some((name, holder)));
        }
    }
    Ok(None)
}

/// Waits up to `wait` for the core's Leases to have no live holder, then removes the
/// finalizer from every Service in `namespace` (all when None) that this core handles: no
/// `loadBalancerClass`, `class` (`--load-balancer-class`), or another class whose load
/// balancer the core named on the Service (`ccm-rs.dev/load-balancer-name`: a class one of
/// several providers advertises). A Service of another class carries the same well-known
/// finalizer for another controller, which still needs it.
/// Returns how many Services it released.
pub async fn release_finalizers(
    client: &kube::Client,
    lease_namespace: &str,
    lease_name: &str,
    namespace: Option<&str>,
    class: Option<&str>,
    wait: Duration,
) -> Result<usize, Error> {
    let deadline = tokio::time::Instant::now() + wait;
    while let Some((name, holder)) = live_holder(client, lease_namespace, lease_name).await? {
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::StillLeading { namespace: lease_namespace.into(), name, holder });
        }
        tracing::info!(lease = %name, %holder, "waiting for the cloud-controller-manager to stop");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let api: Api<Service> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let services = api.list(&ListParams::default()).await.map_err(kube("listing Services"))?;
    let mut released = 0;
    for svc in services.items {
        let finalizers = svc.metadata.finalizers.clone().unwrap_or_default();
        if !finalizers.iter().any(|f| f == FINALIZER) {
            continue;
        }
        let its_class = svc.spec.as_ref().and_then(|s| s.load_balancer_class.as_deref());
        // A Service of another class is ours only when our service controller recorded the
        // name of its load balancer on it (the class of one provider among several).
        // (A name that is not one of the Service's own was not recorded by us: a user wrote it.)
        let uid = svc.metadata.uid.as_deref().unwrap_or_default();
        let recorded = svc
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_LOAD_BALANCER_NAME))
            .is_some_and(|name| ccm_protocol::names::is_load_balancer_name_of(name, uid));
        if its_class.is_some() && its_class != class && !recorded {
            continue; // another load balancer controller's
        }
        let (ns, name) = (svc.metadata.namespace.clone().unwrap_or_default(), svc.metadata.name.clone().unwrap_or_default());
        let kept: Vec<String> = finalizers.into_iter().filter(|f| f != FINALIZER).collect();
        // The resourceVersion makes it a compare-and-swap: a concurrent change of the list is
        // never overwritten (the next run picks that Service up).
        let patch = serde_json::json!({ "metadata": { "finalizers": kept, "resourceVersion": svc.metadata.resource_version } });
        let namespaced: Api<Service> = Api::namespaced(client.clone(), &ns);
        match namespaced.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => {
                tracing::info!(service = %format!("{ns}/{name}"), "finalizer removed; the cloud's load balancer is kept");
                released += 1;
            }
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(kube(format!("removing the finalizer of Service {ns}/{name}"))(e)),
        }
    }
    Ok(released)
}
