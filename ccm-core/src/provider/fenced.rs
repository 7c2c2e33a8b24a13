//! The provider as the controllers change the cloud through it: every call that changes the
//! cloud carries the lead the controller acts under ([`Provider::call_fenced`]), taken from the
//! handle rather than from each call site, so that a new write cannot forget it.

use ccm_protocol::Error;
use k8s_openapi::api::core::v1::LoadBalancerIngress;

use super::convert::{LoadBalancerRequest, Route};
use super::encoded::Backends;
use super::{PerLookup, Provider};
use crate::leader::Fence;

/// The calls that change the cloud, fenced by one lead (none without leader election).
#[derive(Clone)]
pub struct FencedProvider {
    provider: Provider,
    fence: Option<Fence>,
}

impl Provider {
    /// This provider's calls that change the cloud, made under `fence` (`None`: without
    /// leader election, or a tool's own calls).
    pub fn fenced(&self, fence: Option<Fence>) -> FencedProvider {
        FencedProvider { provider: self.clone(), fence }
    }
}

impl FencedProvider {
    /// BatchSetInstanceTags: per lookup, whether its instance exists (and was written).
    pub async fn batch_set_instance_tags(
        &self,
        lookups: &super::convert::InstanceLookups,
        changes: &[super::api::TagChange],
    ) -> PerLookup<bool> {
        self.provider.batch_set_instance_tags(self.fence.as_ref(), lookups, changes).await
    }

    /// CreateRoute; the route as the provider made it.
    pub async fn create_route(&self, cluster: &str, route: Route) -> Result<Route, Error> {
        self.provider.create_route(self.fence.as_ref(), cluster, route).await
    }

    /// DeleteRoute.
    pub async fn delete_route(&self, cluster: &str, table: &str, name: &str) -> Result<(), Error> {
        self.provider.delete_route(self.fence.as_ref(), cluster, table, name).await
    }

    /// ApplyRoutes: one result per delete and per create, in order.
    pub async fn apply_routes(
        &self,
        cluster: &str,
        table: &str,
        deletes: Vec<String>,
        creates: Vec<Route>,
    ) -> (PerLookup<()>, PerLookup<Route>) {
        self.provider.apply_routes(self.fence.as_ref(), cluster, table, deletes, creates).await
    }

    /// EnsureLoadBalancer; the status as the Service's ingress.
    pub async fn ensure_load_balancer(
        &self,
        service: LoadBalancerRequest,
        nodes: &Backends,
    ) -> Result<Vec<LoadBalancerIngress>, Error> {
        self.provider.ensure_load_balancer(self.fence.as_ref(), service, nodes).await
    }

    /// UpdateLoadBalancerHosts.
    pub async fn update_load_balancer_hosts(&self, service: LoadBalancerRequest, nodes: &Backends) -> Result<(), Error> {
        self.provider.update_load_balancer_hosts(self.fence.as_ref(), service, nodes).await
    }

    /// BatchUpdateLoadBalancerHosts: one result per Service, in order, and the error of a call
    /// that failed as a whole, if any.
    pub async fn batch_update_load_balancer_hosts(
        &self,
        services: &[LoadBalancerRequest],
        nodes: &Backends,
    ) -> (PerLookup<()>, Option<Error>) {
        self.provider.batch_update_load_balancer_hosts(self.fence.as_ref(), services, nodes).await
    }

    /// EnsureLoadBalancerDeleted.
    pub async fn ensure_load_balancer_deleted(&self, service: LoadBalancerRequest) -> Result<(), Error> {
        self.provider.ensure_load_balancer_deleted(self.fence.as_ref(), service).await
    }
}
