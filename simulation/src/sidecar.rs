//! Each replica's provider sidecar, in process: the sim provider behind the SDK's server,
//! served over in-memory connections to the replica's `Provider` client. The sidecars of all
//! replicas share one cloud, as the pods of a Deployment share one cloud account.
//!
//! Every call that changes the cloud passes [`Watched`] on its way in, which checks what only
//! the cloud sees: at most one mutation of an object in flight (across replicas, retries and
//! restarts), no mutation by a replica that does not hold the Lease, and no route or load
//! balancer removed while its Node or Service is alive.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ccm_proto::v1 as pb;
use ccm_provider_sdk::{Answered, AppliedRoutes, Page, PageRequest, ProviderServer, Readiness, Result};
use ccm_provider_sim::cloud::Cloud;
use ccm_provider_sim::provider::SimProvider;
use tokio::io::DuplexStream;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// How long before a route deletion reaches the cloud its Node may have been given the
/// route's destination without the deletion being wrong: the route controller read the Node
/// without it just before (the core's provider call timeout, and some).
const JUST_GIVEN: std::time::Duration = std::time::Duration::from_secs(15);
use tonic::transport::{Channel, Endpoint};

use crate::api::{Key, Model};

/// Mutations in flight, by object, across every sidecar: who called which method since when.
pub type InFlight = Arc<Mutex<BTreeMap<String, Vec<(u64, String)>>>>;

/// What every sidecar shares: the mutations in flight, and whether mutations outlive their
/// calls.
#[derive(Clone, Default)]
pub struct Shared {
    pub in_flight: InFlight,
    pub detached: Arc<AtomicBool>,
    /// The call rate every sidecar declares (`call_rate`), if the seed has one.
    pub declared: Option<(f64, u32)>,
    /// When each call that reaches a cloud (every service but identity) ended, across every
    /// sidecar, in virtual time since the run began, per provider (its providerID scheme).
    pub calls: Calls,
    /// Whether the sidecars advertise no epoch (the provider's state lives in the cloud, as
    /// the shared cloud's does): then a new leader may take what the Services record as
    /// ensured, and a sidecar restart is no news.
    pub no_epoch: bool,
}

/// The times of the calls that reached each provider's cloud.
pub type Calls = Arc<Mutex<BTreeMap<String, Vec<std::time::Duration>>>>;

/// Records every call a sidecar answers that reaches its cloud.
struct Counted(Calls, String);

impl ccm_provider_sdk::CallObserver for Counted {
    fn observe(&self, method: &'static str, _code: tonic::Code, _elapsed: std::time::Duration) {
        if !method.starts_with("IdentityService/") {
            self.0.lock().unwrap_or_else(|p| p.into_inner()).entry(self.1.clone()).or_default().push(crate::elapsed());
        }
    }
}

/// The controller whose Lease a mutation method needs.
fn controller_of(method: &str) -> &'static str {
    if method.contains("Route") {
        ccm_core::controllers::route::NAME
    } else if method.contains("Tags") {
        ccm_core::controllers::tagging::NAME
    } else {
        ccm_core::controllers::service::NAME
    }
}

/// The provider wrapped with the cloud-side checks.
pub struct Watched {
    inner: SimProvider,
    cloud: Arc<Cloud>,
    model: Arc<Model>,
    /// The leader election identity of the replica this sidecar serves.
    identity: String,
    in_flight: InFlight,
    /// Cancelled when the sidecar's process dies: its calls in flight die with it.
    dead: CancellationToken,
    /// While set, a mutation outlives its call: it runs on when the caller gives up (as a
    /// provider that ignores cancellation does, the Go adapter's old `WithoutCancel`), until
    /// it ends or the sidecar dies; it stays in flight all that time.
    detached: Arc<AtomicBool>,
}

/// One mutation of some objects, in flight until dropped.
struct Mutation {
    id: u64,
    objects: Vec<String>,
    in_flight: InFlight,
}

impl Drop for Mutation {
    fn drop(&mut self) {
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        for o in &self.objects {
            if let Some(calls) = in_flight.get_mut(o) {
                if let Some(i) = calls.iter().position(|(id, _)| *id == self.id) {
                    calls.remove(i);
                }
                if calls.is_empty() {
                    in_flight.remove(o);
                }
            }
        }
    }
}

impl Watched {
    fn begin(&self, method: &str, mut objects: Vec<String>) -> Mutation {
        // One call that deletes and creates a route of one name (a blackhole replaced) is one
        // mutation of it.
        objects.sort();
        objects.dedup();
        let step = format!("t={:.1}s {} {method} {objects:?}", crate::elapsed().as_secs_f64(), self.identity);
        self.model.trace(&step);
        self.model.mutated(step);
        if !self.model.leads_for(&self.identity, controller_of(method)) {
            self.model
                .violation(format!("{} called {method} on {objects:?} without holding its controller's Lease", self.identity));
        }
        let id = self.model.mutations();
        let what = format!("{} {method} at t={:.1}s", self.identity, crate::elapsed().as_secs_f64());
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        for o in &objects {
            let calls = in_flight.entry(o.clone()).or_default();
            if let Some((_, other)) = calls.first() {
                self.model.violation(format!("{what} on {o} while another mutation of it was in flight ({other})"));
            }
            calls.push((id, what.clone()));
        }
        Mutation { id, objects, in_flight: self.in_flight.clone() }
    }

    /// Runs the mutation `call` (in flight as `mutation`) unless the sidecar dies first; while
    /// mutations are detached, it runs on its own, on after its caller gives up.
    async fn mutate<T, F>(&self, mutation: Mutation, call: impl FnOnce(SimProvider) -> F) -> Result<T>
    where
        F: Future<Output = Result<T>> + Send + 'static,
        T: Send + 'static,
    {
        let (call, dead) = (call(self.inner.clone()), self.dead.clone());
        let run = async move {
            let _in_flight = mutation;
            tokio::select! {
                result = call => result,
                _ = dead.cancelled() => Err(ccm_provider_sdk::Error::unavailable("the sidecar died")),
            }
        };
        if !self.detached.load(Ordering::Relaxed) {
            return run.await;
        }
        tokio::spawn(run).await.unwrap_or_else(|e| Err(ccm_provider_sdk::Error::internal(format!("the mutation's task: {e}"))))
    }

    fn load_balancer(service: &pb::LoadBalancerService) -> String {
        format!("lb/{}", service.load_balancer_name)
    }

    /// A load balancer may be deleted only when its Service is gone, being deleted, or no
    /// longer of type LoadBalancer (or another one, by UID).
    fn check_lb_deletion(&self, service: &pb::LoadBalancerService) {
        let Some(svc) = self.model.get(&Key::service(&service.namespace, &service.name)) else { return };
        let alive = svc.pointer("/metadata/deletionTimestamp").is_none_or(serde_json::Value::is_null)
            && svc.pointer("/spec/type").and_then(serde_json::Value::as_str) == Some("LoadBalancer")
            && (service.uid.is_empty() || svc.pointer("/metadata/uid").and_then(serde_json::Value::as_str) == Some(&service.uid));
        if alive {
            self.model.violation(format!(
                "{} deleted load balancer {} of the live Service {}/{}",
                self.identity, service.load_balancer_name, service.namespace, service.name
            ));
        }
    }

    /// A load balancer is called for only by the Service it was made for: a call naming
    /// another Service's load balancer (a name a user recorded on their own Service) is the
    /// core steered across Services, whatever the provider then refuses.
    fn check_lb_owner(&self, method: &str, service: &pb::LoadBalancerService) {
        let owner = self
            .inner_cloud()
            .load_balancers_of(None)
            .into_iter()
            .find(|l| l.load_balancer_name == service.load_balancer_name && !l.uid.is_empty());
        if let Some(owner) = owner.filter(|o| o.uid != service.uid) {
            self.model.violation(format!(
                "{} called {method} for {}/{} on load balancer {} of another Service ({}/{})",
                self.identity, service.namespace, service.name, service.load_balancer_name, owner.namespace, owner.name
            ));
        }
    }

    /// A route may be deleted only when its Node is gone, being deleted, or no longer has its
    /// destination as a podCIDR, or when the route is a blackhole.
    fn check_route_deletion(&self, cluster: &str, table_id: &str, name: &str) {
        let Ok(routes) = self.inner_cloud().routes(cluster, table_id) else { return };
        let Some(route) = routes.into_iter().find(|r| r.name == name) else { return };
        let node_name = route.target.as_ref().map(|t| t.node_name.clone()).unwrap_or_default();
        let Some(node) = self.model.get(&Key::node(&node_name)) else { return };
        let deleting = node.pointer("/metadata/deletionTimestamp").is_some_and(|v| !v.is_null());
        let cidrs: Vec<&str> = node
            .pointer("/spec/podCIDRs")
            .and_then(serde_json::Value::as_array)
            .map(|a| a.iter().filter_map(serde_json::Value::as_str).collect())
            .unwrap_or_default();
        // A Node that got the route's destination only just now (made again under its name,
        // given the same CIDR again) was read without one just before the deletion went out:
        // a race no reader can close, and the route is made again at the next pass.
        let just_given = self.model.cidr_given_ago(&node_name).is_some_and(|ago| ago < JUST_GIVEN);
        // A blackhole (its instance is gone) is replaced, as upstream does.
        if !deleting && !route.blackhole && !just_given && cidrs.contains(&route.destination_cidr.as_str()) {
            self.model.violation(format!(
                "{} deleted route {name} ({}) of the live Node {node_name}",
                self.identity, route.destination_cidr
            ));
        }
    }

    fn inner_cloud(&self) -> &Cloud {
        &self.cloud
    }
}

#[ccm_provider_sdk::async_trait]
impl ccm_provider_sdk::Probe for Watched {
    async fn probe(&self) -> Result<Readiness> {
        // A probe crosses a socket and the provider's own checks: it takes time, as elsewhere,
        // and what a client does between its identity calls shows.
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        ccm_provider_sdk::Probe::probe(&self.inner).await
    }
}

#[ccm_provider_sdk::async_trait]
impl ccm_provider_sdk::Instances for Watched {
    fn capabilities(&self) -> pb::InstancesCapabilities {
        ccm_provider_sdk::Instances::capabilities(&self.inner)
    }

    fn cache_ttl(&self) -> Option<std::time::Duration> {
        ccm_provider_sdk::Instances::cache_ttl(&self.inner)
    }

    async fn instance_metadata(&self, lookup: &pb::InstanceLookup) -> Result<Option<pb::InstanceMetadata>> {
        self.inner.instance_metadata(lookup).await
    }

    async fn list_instances(&self, page: &PageRequest) -> Result<Page<pb::InstanceMetadata>> {
        self.inner.list_instances(page).await
    }

    async fn instance_exists(&self, lookup: &pb::InstanceLookup) -> Result<bool> {
        self.inner.instance_exists(lookup).await
    }

    async fn instance_shutdown(&self, lookup: &pb::InstanceLookup) -> Result<Option<bool>> {
        self.inner.instance_shutdown(lookup).await
    }

    async fn batch_instance_metadata(
        &self,
        lookups: &[pb::InstanceLookup],
    ) -> Result<Vec<Answered<Option<pb::InstanceMetadata>>>> {
        self.inner.batch_instance_metadata(lookups).await
    }
}

#[ccm_provider_sdk::async_trait]
impl ccm_provider_sdk::Tags for Watched {
    fn cache_ttl(&self) -> Option<std::time::Duration> {
        ccm_provider_sdk::Tags::cache_ttl(&self.inner)
    }

    async fn instance_tags(&self, lookup: &pb::InstanceLookup) -> Result<Option<HashMap<String, String>>> {
        self.inner.instance_tags(lookup).await
    }

    async fn batch_instance_tags(
        &self,
        lookups: &[pb::InstanceLookup],
    ) -> Result<Vec<Answered<Option<HashMap<String, String>>>>> {
        self.inner.batch_instance_tags(lookups).await
    }

    fn capabilities(&self) -> pb::TagsCapabilities {
        ccm_provider_sdk::Tags::capabilities(&self.inner)
    }

    async fn batch_set_instance_tags(&self, updates: &[pb::InstanceTagsUpdate]) -> Result<Vec<Answered<bool>>> {
        let objects = updates
            .iter()
            .map(|u| format!("tags/{}", u.instance.as_ref().map(|l| l.node_name.as_str()).unwrap_or_default()))
            .collect();
        let m = self.begin("BatchSetInstanceTags", objects);
        let updates = updates.to_vec();
        self.mutate(m, |p| async move { p.batch_set_instance_tags(&updates).await }).await
    }
}

#[ccm_provider_sdk::async_trait]
impl ccm_provider_sdk::Routes for Watched {
    fn capabilities(&self) -> pb::RoutesCapabilities {
        ccm_provider_sdk::Routes::capabilities(&self.inner)
    }

    fn cache_ttl(&self) -> Option<std::time::Duration> {
        ccm_provider_sdk::Routes::cache_ttl(&self.inner)
    }

    async fn list_route_tables(&self, page: &PageRequest) -> Result<Page<pb::RouteTable>> {
        self.inner.list_route_tables(page).await
    }

    async fn list_routes(&self, cluster_name: &str, table_id: &str, page: &PageRequest) -> Result<Page<pb::Route>> {
        self.inner.list_routes(cluster_name, table_id, page).await
    }

    async fn create_route(&self, cluster_name: &str, route: pb::Route) -> Result<pb::Route> {
        let m = self.begin("CreateRoute", vec![format!("route/{}", route.name)]);
        let cluster = cluster_name.to_string();
        self.mutate(m, |p| async move { p.create_route(&cluster, route).await }).await
    }

    async fn delete_route(&self, cluster_name: &str, table_id: &str, name: &str) -> Result<()> {
        let m = self.begin("DeleteRoute", vec![format!("route/{name}")]);
        self.check_route_deletion(cluster_name, table_id, name);
        let (cluster, table, name) = (cluster_name.to_string(), table_id.to_string(), name.to_string());
        self.mutate(m, |p| async move { p.delete_route(&cluster, &table, &name).await }).await
    }

    async fn resolve_route_tables(&self, targets: &[pb::RouteTarget]) -> Result<Vec<Answered<Vec<String>>>> {
        self.inner.resolve_route_tables(targets).await
    }

    async fn apply_routes(
        &self,
        cluster_name: &str,
        table_id: &str,
        deletes: &[String],
        creates: Vec<pb::Route>,
    ) -> Result<AppliedRoutes> {
        let objects =
            deletes.iter().cloned().chain(creates.iter().map(|r| r.name.clone())).map(|n| format!("route/{n}")).collect();
        let m = self.begin("ApplyRoutes", objects);
        // A route deleted and created again (same Node, same destination) in one call is
        // replaced, not removed: the cloud applies the call as one.
        let replaced = |name: &String| {
            let Ok(routes) = self.inner_cloud().routes(cluster_name, table_id) else { return false };
            routes.iter().find(|r| &r.name == name).is_some_and(|old| {
                creates.iter().any(|new| {
                    new.destination_cidr == old.destination_cidr
                        && new.target.as_ref().map(|t| &t.node_name) == old.target.as_ref().map(|t| &t.node_name)
                })
            })
        };
        for name in deletes.iter().filter(|n| !replaced(n)) {
            self.check_route_deletion(cluster_name, table_id, name);
        }
        let (cluster, table, deletes) = (cluster_name.to_string(), table_id.to_string(), deletes.to_vec());
        self.mutate(m, |p| async move { p.apply_routes(&cluster, &table, &deletes, creates).await }).await
    }
}

#[ccm_provider_sdk::async_trait]
impl ccm_provider_sdk::LoadBalancers for Watched {
    fn capabilities(&self) -> pb::LoadBalancersCapabilities {
        ccm_provider_sdk::LoadBalancers::capabilities(&self.inner)
    }

    async fn get_load_balancer(&self, service: &pb::LoadBalancerService) -> Result<Option<pb::LoadBalancerStatus>> {
        self.check_lb_owner("GetLoadBalancer", service);
        self.inner.get_load_balancer(service).await
    }

    async fn load_balancer_hosts(&self, service: &pb::LoadBalancerService) -> Result<Option<Vec<String>>> {
        self.inner.load_balancer_hosts(service).await
    }

    async fn ensure_load_balancer(
        &self,
        service: &pb::LoadBalancerService,
        nodes: &[pb::LoadBalancerNode],
    ) -> Result<pb::LoadBalancerStatus> {
        let m = self.begin("EnsureLoadBalancer", vec![Self::load_balancer(service)]);
        self.check_lb_owner("EnsureLoadBalancer", service);
        let (service, nodes) = (service.clone(), nodes.to_vec());
        self.mutate(m, |p| async move { p.ensure_load_balancer(&service, &nodes).await }).await
    }

    async fn update_load_balancer_hosts(&self, service: &pb::LoadBalancerService, nodes: &[pb::LoadBalancerNode]) -> Result<()> {
        let m = self.begin("UpdateLoadBalancerHosts", vec![Self::load_balancer(service)]);
        self.check_lb_owner("UpdateLoadBalancerHosts", service);
        let (service, nodes) = (service.clone(), nodes.to_vec());
        self.mutate(m, |p| async move { p.update_load_balancer_hosts(&service, &nodes).await }).await
    }

    async fn ensure_load_balancer_deleted(&self, service: &pb::LoadBalancerService) -> Result<()> {
        let m = self.begin("EnsureLoadBalancerDeleted", vec![Self::load_balancer(service)]);
        self.check_lb_deletion(service);
        self.check_lb_owner("EnsureLoadBalancerDeleted", service);
        let service = service.clone();
        self.mutate(m, |p| async move { p.ensure_load_balancer_deleted(&service).await }).await
    }

    async fn list_load_balancers(&self, cluster_name: &str, page: &PageRequest) -> Result<Page<pb::LoadBalancerSummary>> {
        self.inner.list_load_balancers(cluster_name, page).await
    }

    async fn batch_update_load_balancer_hosts(
        &self,
        services: &[pb::LoadBalancerService],
        nodes: &[pb::LoadBalancerNode],
    ) -> Result<Vec<Result<()>>> {
        let m = self.begin("BatchUpdateLoadBalancerHosts", services.iter().map(Self::load_balancer).collect());
        for service in services {
            self.check_lb_owner("BatchUpdateLoadBalancerHosts", service);
        }
        let (services, nodes) = (services.to_vec(), nodes.to_vec());
        self.mutate(m, |p| async move { p.batch_update_load_balancer_hosts(&services, &nodes).await }).await
    }
}

/// A replica's sidecar: serves until stopped; a restart serves again with a new epoch.
pub struct Sidecar {
    connections: Arc<Mutex<mpsc::UnboundedSender<std::io::Result<DuplexStream>>>>,
    stop: Mutex<CancellationToken>,
}

impl Sidecar {
    /// Starts the sidecar of the replica `identity`, as `epoch`.
    pub fn start(cloud: &Arc<Cloud>, model: &Arc<Model>, identity: &str, epoch: &str, shared: &Shared) -> Self {
        let (tx, stop) = Self::serve(cloud, model, identity, epoch, shared);
        Self { connections: Arc::new(Mutex::new(tx)), stop: Mutex::new(stop) }
    }

    fn serve(
        cloud: &Arc<Cloud>,
        model: &Arc<Model>,
        identity: &str,
        epoch: &str,
        shared: &Shared,
    ) -> (mpsc::UnboundedSender<std::io::Result<DuplexStream>>, CancellationToken) {
        let watched = Arc::new(Watched {
            inner: SimProvider::new(cloud.clone()),
            cloud: cloud.clone(),
            model: model.clone(),
            identity: identity.to_string(),
            in_flight: shared.in_flight.clone(),
            dead: CancellationToken::new(),
            detached: shared.detached.clone(),
        });
        let dead = watched.dead.clone();
        let scheme = cloud.scheme().to_string();
        let mut server = ProviderServer::new(format!("{scheme}.cloudprovider.dev"), ccm_provider_sim::VERSION)
            .provider_id_scheme(&scheme)
            .epoch(if shared.no_epoch { "" } else { epoch })
            .instances(watched.clone())
            .tags(watched.clone())
            .routes(watched.clone())
            .load_balancers(watched.clone())
            .probe(watched)
            .observe(Arc::new(Counted(shared.calls.clone(), scheme.clone())));
        if let Some((per_second, burst)) = shared.declared {
            server = server.call_rate(per_second, burst);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let stop = dead;
        let stopped = stop.clone();
        tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::UnboundedReceiverStream::new(rx);
            if let Err(error) = server.serve_incoming(incoming, stopped.cancelled_owned()).await {
                tracing::warn!(%error, "the sidecar stopped");
            }
        });
        (tx, stop)
    }

    /// The sidecar restarts (its process is replaced): its calls in flight die, open
    /// connections end, and it comes back as `epoch`.
    pub fn restart(&self, cloud: &Arc<Cloud>, model: &Arc<Model>, identity: &str, epoch: &str, shared: &Shared) {
        let (tx, stop) = Self::serve(cloud, model, identity, epoch, shared);
        std::mem::replace(&mut *self.stop.lock().unwrap_or_else(|p| p.into_inner()), stop).cancel();
        *self.connections.lock().unwrap_or_else(|p| p.into_inner()) = tx;
    }

    /// Kills it: its calls in flight die, and it serves no more.
    pub fn stop(&self) {
        self.stop.lock().unwrap_or_else(|p| p.into_inner()).cancel();
    }

    /// A channel to it, as the core's `--provider-endpoint` would give.
    pub fn channel(&self) -> Channel {
        let connections = self.connections.clone();
        let connector = tower::service_fn(move |_: http::Uri| {
            let connections = connections.clone();
            async move {
                let (ours, theirs) = tokio::io::duplex(256 * 1024);
                let sent = connections.lock().unwrap_or_else(|p| p.into_inner()).send(Ok(theirs));
                match sent {
                    Ok(()) => Ok(hyper_util::rt::TokioIo::new(ours)),
                    Err(_) => Err(std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "the sidecar is not running")),
                }
            }
        });
        Endpoint::from_static("http://sidecar.sim").connect_with_connector_lazy(connector)
    }
}
