//! The ready pod endpoints of Services, for providers whose load balancers forward to pods
//! directly (`LoadBalancersCapabilities.pod_endpoints`) where a Service allocates no node
//! ports (`spec.allocateLoadBalancerNodePorts: false`).
//!
//! The service controller watches EndpointSlices only when the provider advertises that
//! capability (read once, when the provider is first known): other clusters pay nothing for
//! it. Each slice is kept in a compact form (its Service, ports and ready addresses), and a
//! change of a Service's endpoints is handed to the controller as a plain trigger (never one
//! that cuts a failing Service's backoff short: a retry reads the newest endpoints anyway).

use ccm_protocol::lock::Lock;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use kube::runtime::reflector::ObjectRef;

use super::{Key, provider_fingerprint, service_key};

use crate::provider::convert::PortEndpoint;
use futures::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::runtime::watcher::{self, Event};
use tokio_util::sync::CancellationToken;

/// The label that names an EndpointSlice's Service.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// One slice, as much as a load balancer needs.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Slice {
    /// `namespace/name` of its Service.
    service: String,
    /// Its ports: (name, protocol, port).
    ports: Vec<(String, String, u32)>,
    /// Its ready endpoints: (address, node name).
    ready: Vec<(String, String)>,
}

fn compact(slice: &EndpointSlice) -> Option<(String, Slice)> {
    let ns = slice.metadata.namespace.clone().unwrap_or_default();
    let service = slice.metadata.labels.as_ref()?.get(SERVICE_NAME_LABEL)?.clone();
    let key = format!("{ns}/{}", slice.metadata.name.clone().unwrap_or_default());
    let ports = slice
        .ports
        .iter()
        .flatten()
        .filter_map(|p| {
            let port = u32::try_from(p.port?).ok()?;
            Some((p.name.clone().unwrap_or_default(), p.protocol.clone().unwrap_or_else(|| "TCP".into()), port))
        })
        .collect();
    let mut ready: Vec<(String, String)> = slice
        .endpoints
        .iter()
        .flatten()
        // A nil `ready` means ready (the API's own reading); terminating endpoints are not.
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true))
        .flat_map(|e| e.addresses.iter().map(move |a| (a.clone(), e.node_name.clone().unwrap_or_default())))
        .collect();
    ready.sort();
    Some((key, Slice { service: format!("{ns}/{service}"), ports, ready }))
}

/// Every Service's slices, kept from the watch.
#[derive(Debug, Default)]
pub struct EndpointIndex {
    slices: Mutex<HashMap<String, Slice>>,
}

impl EndpointIndex {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slice>> {
        self.slices.locked()
    }

    /// The ready endpoints of `service`'s port (`name`, `protocol`), sorted.
    pub fn port_endpoints(&self, service: &str, name: &str, protocol: &str) -> Vec<PortEndpoint> {
        let slices = self.lock();
        let mut out: BTreeSet<(String, u32, String)> = BTreeSet::new();
        for slice in slices.values().filter(|s| s.service == service) {
            let Some(&(_, _, port)) = slice.ports.iter().find(|(n, p, _)| n == name && p == protocol) else { continue };
            out.extend(slice.ready.iter().map(|(address, node)| (address.clone(), port, node.clone())));
        }
        out.into_iter().map(|(address, port, node_name)| PortEndpoint { address, port, node_name }).collect()
    }

    /// A fingerprint of `service`'s endpoints (a change of it means a new Ensure).
    pub fn fingerprint(&self, service: &str) -> u64 {
        let slices = self.lock();
        let mut mine: Vec<&Slice> = slices.values().filter(|s| s.service == service).collect();
        mine.sort_by(|a, b| (&a.ports, &a.ready).cmp(&(&b.ports, &b.ready)));
        let mut h = std::collections::hash_map::DefaultHasher::new();
        mine.hash(&mut h);
        h.finish()
    }

    /// Applies one slice (added or changed); the Service whose endpoints changed, if any.
    fn apply(&self, slice: &EndpointSlice) -> Vec<String> {
        let Some((key, new)) = compact(slice) else { return Vec::new() };
        let mut slices = self.lock();
        match slices.insert(key, new.clone()) {
            Some(old) if old == new => Vec::new(),
            Some(old) if old.service != new.service => vec![old.service, new.service],
            _ => vec![new.service],
        }
    }

    /// Removes one slice; its Service.
    fn delete(&self, slice: &EndpointSlice) -> Vec<String> {
        let Some((key, _)) = compact(slice) else { return Vec::new() };
        self.lock().remove(&key).map(|s| vec![s.service]).unwrap_or_default()
    }

    /// Replaces every slice with a new listing; the Services whose endpoints changed.
    fn replace(&self, listed: HashMap<String, Slice>) -> Vec<String> {
        let mut slices = self.lock();
        let mut before: BTreeMap<&str, Vec<&Slice>> = BTreeMap::new();
        for s in slices.values() {
            before.entry(s.service.as_str()).or_default().push(s);
        }
        let mut after: BTreeMap<&str, Vec<&Slice>> = BTreeMap::new();
        for s in listed.values() {
            after.entry(s.service.as_str()).or_default().push(s);
        }
        for list in before.values_mut().chain(after.values_mut()) {
            list.sort_by(|a, b| (&a.ports, &a.ready).cmp(&(&b.ports, &b.ready)));
        }
        let changed: Vec<String> = before
            .keys()
            .chain(after.keys())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .filter(|s| before.get(*s) != after.get(*s))
            .map(|s| s.to_string())
            .collect();
        drop(before);
        drop(after);
        *slices = listed;
        changed
    }

    /// Watches `api`'s EndpointSlices until `stop`, calling `changed` with each Service whose
    /// endpoints changed. A failing watch retries with kube-runtime's backoff; a re-list
    /// replaces the whole index (slices deleted meanwhile go with it).
    pub async fn watch(&self, api: Api<EndpointSlice>, config: watcher::Config, changed: impl Fn(&str), stop: CancellationToken) {
        use kube::runtime::WatchStreamExt;
        let mut stream = watcher::watcher(api, config).default_backoff().boxed();
        let mut listing: Option<HashMap<String, Slice>> = None;
        loop {
            let event = tokio::select! {
                e = stream.next() => e,
                _ = stop.cancelled() => return,
            };
            let Some(event) = event else { return };
            let services = match event {
                Ok(Event::Init) => {
                    listing = Some(HashMap::new());
                    Vec::new()
                }
                Ok(Event::InitApply(slice)) => {
                    if let (Some(list), Some((key, s))) = (listing.as_mut(), compact(&slice)) {
                        list.insert(key, s);
                    }
                    Vec::new()
                }
                Ok(Event::InitDone) => self.replace(listing.take().unwrap_or_default()),
                Ok(Event::Apply(slice)) => self.apply(&slice),
                Ok(Event::Delete(slice)) => self.delete(&slice),
                Err(error) => {
                    tracing::warn!(%error, "the EndpointSlice watch failed; retrying with backoff");
                    Vec::new()
                }
            };
            for service in services {
                changed(&service);
            }
        }
    }
}

/// The service controller's side of it.
impl super::ServiceController {
    /// Whether `svc`'s load balancer is given pod endpoints: the provider forwards to pods and
    /// a port of the Service has no node port.
    pub(super) fn sends_endpoints(&self, svc: &Service) -> bool {
        self.pod_endpoints.load(Ordering::Acquire)
            && svc.spec.as_ref().is_some_and(|s| s.ports.iter().flatten().any(|p| p.node_port.unwrap_or(0) == 0))
    }

    /// What was ensured of a Service: what the provider sees of its spec and, when it is
    /// given pod endpoints, of those.
    pub(super) fn ensured_spec(&self, svc: &Service) -> u64 {
        if !self.sends_endpoints(svc) {
            return provider_fingerprint(svc);
        }
        let mut h = std::collections::hash_map::DefaultHasher::new();
        provider_fingerprint(svc).hash(&mut h);
        self.endpoints.fingerprint(&service_key(svc)).hash(&mut h);
        h.finish()
    }

    /// Once the provider is known: when it forwards to pods, watches EndpointSlices and
    /// queues each Service given endpoints whose endpoints changed (a plain trigger: a Service
    /// in backoff waits its turn).
    pub(super) async fn endpoint_feed(self: Arc<Self>, stop: CancellationToken) {
        let mut changes = self.ctx.provider.changes();
        let identity = loop {
            if let Some(identity) = self.ctx.provider.identity() {
                break identity;
            }
            tokio::select! {
                _ = changes.changed() => {}
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stop.cancelled() => return,
            }
        };
        if !identity.pod_endpoints() {
            // Nothing to watch; a task of the controller that ends is its failure, so this
            // one waits for the stop like the others.
            stop.cancelled().await;
            return;
        }
        self.pod_endpoints.store(true, Ordering::Release);
        tracing::info!("the provider forwards to pods: watching EndpointSlices for Services without node ports");
        let api = match &self.ctx.options.service_namespace {
            Some(ns) => Api::namespaced(self.ctx.client.clone(), ns),
            None => Api::all(self.ctx.client.clone()),
        };
        let config = kube::runtime::watcher::Config::default().page_size(500);
        let this = self.clone();
        let changed = move |service: &str| {
            let (ns, name) = service.split_once('/').unwrap_or(("", service));
            if let Some(svc) = this.ctx.services.store().get(&ObjectRef::new(name).within(ns))
                && this.wants_load_balancer(&svc)
                && this.sends_endpoints(&svc)
            {
                this.queue.add(Key::Service(service.to_string()));
            }
        };
        self.endpoints.watch(api, config, changed, stop.clone()).await;
        // The watch ends only at the stop (or when its stream does, which is a failure).
        if !stop.is_cancelled() {
            tracing::error!("the EndpointSlice watch ended");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(name: &str, service: &str, ready: &[(&str, Option<bool>)]) -> EndpointSlice {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns", "labels": {SERVICE_NAME_LABEL: service}},
            "addressType": "IPv4",
            "ports": [{"name": "", "protocol": "TCP", "port": 8080}, {"name": "dns", "protocol": "UDP", "port": 53}],
            "endpoints": ready.iter().map(|(a, r)| {
                let mut e = serde_json::json!({"addresses": [a], "nodeName": "n1"});
                if let Some(r) = r { e["conditions"] = serde_json::json!({"ready": r}); }
                e
            }).collect::<Vec<_>>(),
        }))
        .expect("slice")
    }

    #[test]
    fn ready_endpoints_by_port_and_changes_by_service() {
        let index = EndpointIndex::default();
        assert_eq!(index.apply(&slice("web-a", "web", &[("10.244.1.5", None), ("10.244.2.7", Some(false))])), vec!["ns/web"]);
        assert_eq!(index.apply(&slice("web-b", "web", &[("10.244.2.9", Some(true))])), vec!["ns/web"]);
        let eps = index.port_endpoints("ns/web", "", "TCP");
        let got: Vec<(&str, u32)> = eps.iter().map(|e| (e.address.as_str(), e.port)).collect();
        assert_eq!(got, vec![("10.244.1.5", 8080), ("10.244.2.9", 8080)], "not ready is left out");
        assert_eq!(index.port_endpoints("ns/web", "dns", "UDP").len(), 2);
        assert!(index.port_endpoints("ns/web", "dns", "TCP").is_empty(), "the protocol must match");
        let before = index.fingerprint("ns/web");
        assert!(index.apply(&slice("web-b", "web", &[("10.244.2.9", Some(true))])).is_empty(), "the same again is no change");
        assert_eq!(index.delete(&slice("web-b", "web", &[])), vec!["ns/web"]);
        assert_ne!(index.fingerprint("ns/web"), before);

        // A re-list replaces everything: what vanished meanwhile is a change too.
        let mut listed = HashMap::new();
        let (k, s) = compact(&slice("db-a", "db", &[("10.244.3.3", None)])).expect("compact");
        listed.insert(k, s);
        let changed = index.replace(listed);
        assert_eq!(changed, vec!["ns/db".to_string(), "ns/web".to_string()]);
        assert!(index.port_endpoints("ns/web", "", "TCP").is_empty());
    }
}
