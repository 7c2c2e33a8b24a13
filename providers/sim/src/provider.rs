//! cloudprovider.v1 over the simulated cloud: each method is one cloud API call through the
//! gate (latency, rate limit, faults), batch reads included.

use std::collections::HashMap;
use std::sync::Arc;

use ccm_provider_sdk::proto as pb;
use ccm_provider_sdk::{Answered, AppliedRoutes, Page, PageRequest, Readiness, Result, paginate};

use crate::cloud::Cloud;
use crate::config::Lie;
use crate::dataplane::Pusher;

/// The sim's implementation of every provider trait.
#[derive(Debug, Clone)]
pub struct SimProvider {
    cloud: Arc<Cloud>,
    dataplane: Option<Arc<Pusher>>,
}

impl SimProvider {
    /// A provider over `cloud`.
    pub fn new(cloud: Arc<Cloud>) -> Self {
        Self { cloud, dataplane: None }
    }

    /// A provider over `cloud` whose load balancer writes are pushed to a data plane.
    pub fn with_dataplane(cloud: Arc<Cloud>, dataplane: Pusher) -> Self {
        Self { cloud, dataplane: Some(Arc::new(dataplane)) }
    }

    /// After a load balancer write: the data plane forwards what the cloud now holds, or the
    /// write fails UNAVAILABLE (the cloud's record stays; the caller's retry pushes again).
    async fn push(&self) -> Result<()> {
        let Some(pusher) = &self.dataplane else { return Ok(()) };
        let cloud = self.cloud.clone();
        pusher
            .push(move || cloud.dataplane_state())
            .await
            .map_err(|e| ccm_provider_sdk::Error::unavailable(format!("programming the load balancer data plane: {e:#}")))
    }
}

#[tonic::async_trait]
impl ccm_provider_sdk::Probe for SimProvider {
    async fn probe(&self) -> Result<Readiness> {
        // Ready unless the whole API is down; a probe is not a rate-limited cloud call.
        match self.cloud.api_down() {
            Some(why) => Ok(Readiness::NotReady(why)),
            None => Ok(Readiness::Ready),
        }
    }
}

#[tonic::async_trait]
impl ccm_provider_sdk::Instances for SimProvider {
    fn cache_ttl(&self) -> Option<std::time::Duration> {
        self.cloud.cache_ttl()
    }

    fn capabilities(&self) -> pb::InstancesCapabilities {
        let (pod_cidrs, pod_cidrs_routed) = self.cloud.pod_cidr_capabilities();
        pb::InstancesCapabilities {
            batch_reads: self.cloud.batch_reads(),
            metadata_tags: self.cloud.metadata_tags(),
            pod_cidrs,
            pod_cidrs_routed,
        }
    }

    async fn instance_metadata(&self, lookup: &pb::InstanceLookup) -> Result<Option<pb::InstanceMetadata>> {
        self.cloud.api_call("InstanceMetadata").await?;
        let lie = self.cloud.lie("InstanceMetadata");
        self.cloud.instance_answer(lookup).map(|m| lie_about(lie, m))
    }

    async fn list_instances(&self, page: &PageRequest) -> Result<Page<pb::InstanceMetadata>> {
        self.cloud.api_call("ListInstances").await?;
        let lie = self.cloud.lie("ListInstances");
        listing(lie, self.cloud.instances(), |i| i.instance_id.as_str(), page)
    }

    async fn instance_exists(&self, lookup: &pb::InstanceLookup) -> Result<bool> {
        self.cloud.api_call("InstanceExists").await?;
        let lie = self.cloud.lie("InstanceExists");
        Ok(lie_about(lie, self.cloud.instance(lookup)?).is_some_and(|m| m.state() != pb::InstanceState::Terminated))
    }

    async fn instance_shutdown(&self, lookup: &pb::InstanceLookup) -> Result<Option<bool>> {
        self.cloud.api_call("InstanceShutdown").await?;
        let lie = self.cloud.lie("InstanceShutdown");
        Ok(lie_about(lie, self.cloud.instance(lookup)?)
            .filter(|m| m.state() != pb::InstanceState::Terminated)
            .map(|m| m.state() == pb::InstanceState::Stopped))
    }

    async fn batch_instance_metadata(
        &self,
        lookups: &[pb::InstanceLookup],
    ) -> Result<Vec<Answered<Option<pb::InstanceMetadata>>>> {
        self.cloud.api_call("BatchInstanceMetadata").await?;
        let lie = self.cloud.lie("BatchInstanceMetadata");
        let answers = lookups.iter().map(|l| Answered::to(l, self.cloud.instance_answer(l).map(|m| lie_about(lie, m)))).collect();
        Ok(shuffled(lie, answers))
    }
}

#[tonic::async_trait]
impl ccm_provider_sdk::Tags for SimProvider {
    fn cache_ttl(&self) -> Option<std::time::Duration> {
        self.cloud.cache_ttl()
    }

    async fn instance_tags(&self, lookup: &pb::InstanceLookup) -> Result<Option<HashMap<String, String>>> {
        self.cloud.api_call("GetInstanceTags").await?;
        self.cloud.instance_tags(lookup)
    }

    async fn batch_instance_tags(
        &self,
        lookups: &[pb::InstanceLookup],
    ) -> Result<Vec<Answered<Option<HashMap<String, String>>>>> {
        self.cloud.api_call("BatchGetInstanceTags").await?;
        let lie = self.cloud.lie("BatchGetInstanceTags");
        Ok(shuffled(lie, lookups.iter().map(|l| Answered::to(l, self.cloud.instance_tags(l))).collect()))
    }

    fn capabilities(&self) -> pb::TagsCapabilities {
        pb::TagsCapabilities { set_tags: self.cloud.sets_tags() }
    }

    /// One cloud call for the whole batch (as EC2's CreateTags and DeleteTags take many
    /// resources).
    async fn batch_set_instance_tags(&self, updates: &[pb::InstanceTagsUpdate]) -> Result<Vec<Answered<bool>>> {
        const METHOD: &str = "BatchSetInstanceTags";
        if !self.cloud.sets_tags() {
            return Err(ccm_provider_sdk::Error::Unimplemented { message: METHOD.into() });
        }
        self.cloud.api_call(METHOD).await?;
        let lie = self.cloud.lie(METHOD);
        let answers = updates
            .iter()
            .map(|u| {
                let lookup = u.instance.clone().unwrap_or_default();
                let result = match self.cloud.item_fault(METHOD, &lookup.node_name) {
                    Some(e) => Err(e),
                    None => self.cloud.update_instance_tags(u),
                };
                Answered::to(&lookup, result)
            })
            .collect();
        Ok(shuffled(lie, answers))
    }
}

#[tonic::async_trait]
impl ccm_provider_sdk::Routes for SimProvider {
    fn capabilities(&self) -> pb::RoutesCapabilities {
        self.cloud.route_capabilities()
    }

    fn cache_ttl(&self) -> Option<std::time::Duration> {
        self.cloud.cache_ttl()
    }

    async fn list_route_tables(&self, page: &PageRequest) -> Result<Page<pb::RouteTable>> {
        self.cloud.api_call("ListRouteTables").await?;
        let lie = self.cloud.lie("ListRouteTables");
        listing(lie, self.cloud.route_tables(), |t| t.id.as_str(), page)
    }

    async fn list_routes(&self, cluster_name: &str, table_id: &str, page: &PageRequest) -> Result<Page<pb::Route>> {
        self.cloud.api_call("ListRoutes").await?;
        let lie = self.cloud.lie("ListRoutes");
        listing(lie, self.cloud.routes(cluster_name, table_id)?, |r| r.name.as_str(), page)
    }

    async fn create_route(&self, cluster_name: &str, route: pb::Route) -> Result<pb::Route> {
        self.cloud.api_call_on("CreateRoute", &route.name).await?;
        self.cloud.create_route(cluster_name, route)
    }

    async fn delete_route(&self, cluster_name: &str, table_id: &str, name: &str) -> Result<()> {
        self.cloud.api_call_on("DeleteRoute", name).await?;
        self.cloud.delete_route(cluster_name, table_id, name)
    }

    async fn resolve_route_tables(&self, targets: &[pb::RouteTarget]) -> Result<Vec<Answered<Vec<String>>>> {
        self.cloud.api_call("ResolveRouteTables").await?;
        let lie = self.cloud.lie("ResolveRouteTables");
        Ok(shuffled(lie, targets.iter().map(|t| Answered::for_target(t, self.cloud.tables_for(t))).collect()))
    }

    /// One cloud call for the whole list, as a route table written as one document.
    async fn apply_routes(
        &self,
        cluster_name: &str,
        table_id: &str,
        deletes: &[String],
        creates: Vec<pb::Route>,
    ) -> Result<AppliedRoutes> {
        const METHOD: &str = "ApplyRoutes";
        self.cloud.api_call(METHOD).await?;
        let deletes = deletes
            .iter()
            .map(|name| match self.cloud.item_fault(METHOD, name) {
                Some(e) => Err(e),
                None => self.cloud.delete_route(cluster_name, table_id, name),
            })
            .collect();
        let creates = creates
            .into_iter()
            .map(|route| match self.cloud.item_fault(METHOD, &route.name) {
                Some(e) => Err(e),
                None => self.cloud.create_route(cluster_name, route),
            })
            .collect();
        Ok(AppliedRoutes { deletes, creates })
    }
}

#[tonic::async_trait]
impl ccm_provider_sdk::LoadBalancers for SimProvider {
    fn capabilities(&self) -> pb::LoadBalancersCapabilities {
        self.cloud.load_balancer_capabilities()
    }

    async fn get_load_balancer(&self, service: &pb::LoadBalancerService) -> Result<Option<pb::LoadBalancerStatus>> {
        self.cloud.api_call_on("GetLoadBalancer", &service.load_balancer_name).await?;
        self.cloud.check_owner(service)?;
        Ok(self.cloud.load_balancer(&service.load_balancer_name))
    }

    /// Read with the load balancer (one describe call on most clouds): no call of its own.
    async fn load_balancer_hosts(&self, service: &pb::LoadBalancerService) -> Result<Option<Vec<String>>> {
        self.cloud.check_owner(service)?;
        Ok(self.cloud.load_balancer_hosts(&service.load_balancer_name))
    }

    async fn ensure_load_balancer(
        &self,
        service: &pb::LoadBalancerService,
        nodes: &[pb::LoadBalancerNode],
    ) -> Result<pb::LoadBalancerStatus> {
        self.cloud.api_call_on("EnsureLoadBalancer", &service.load_balancer_name).await?;
        let mut status = self.cloud.ensure_load_balancer(service, nodes)?;
        self.push().await?;
        if self.cloud.lie("EnsureLoadBalancer") == Some(Lie::InvalidIps) {
            for ingress in &mut status.ingress {
                ingress.ip = NOT_AN_IP.into();
            }
        }
        Ok(status)
    }

    async fn update_load_balancer_hosts(&self, service: &pb::LoadBalancerService, nodes: &[pb::LoadBalancerNode]) -> Result<()> {
        self.cloud.api_call_on("UpdateLoadBalancerHosts", &service.load_balancer_name).await?;
        self.cloud.check_owner(service)?;
        self.cloud.update_load_balancer_hosts(&service.load_balancer_name, nodes)?;
        self.push().await
    }

    async fn ensure_load_balancer_deleted(&self, service: &pb::LoadBalancerService) -> Result<()> {
        self.cloud.api_call_on("EnsureLoadBalancerDeleted", &service.load_balancer_name).await?;
        self.cloud.check_owner(service)?;
        self.cloud.delete_load_balancer(&service.load_balancer_name);
        self.push().await
    }

    async fn list_load_balancers(&self, cluster_name: &str, page: &PageRequest) -> Result<Page<pb::LoadBalancerSummary>> {
        if !self.cloud.lists_load_balancers() {
            return Err(ccm_provider_sdk::Error::Unimplemented { message: "ListLoadBalancers".into() });
        }
        self.cloud.api_call("ListLoadBalancers").await?;
        let lie = self.cloud.lie("ListLoadBalancers");
        let listed = match lie {
            Some(Lie::EveryCluster) => self.cloud.load_balancers_of(None),
            _ => self.cloud.load_balancers(cluster_name),
        };
        listing(lie, listed, |l| l.load_balancer_name.as_str(), page)
    }

    /// One cloud call for every listed load balancer, as a shared backend pool.
    async fn batch_update_load_balancer_hosts(
        &self,
        services: &[pb::LoadBalancerService],
        nodes: &[pb::LoadBalancerNode],
    ) -> Result<Vec<Result<()>>> {
        const METHOD: &str = "BatchUpdateLoadBalancerHosts";
        self.cloud.api_call(METHOD).await?;
        let hosts = self.cloud.hosts_list(nodes);
        let results: Vec<Result<()>> = services
            .iter()
            .map(|s| match self.cloud.item_fault(METHOD, &s.load_balancer_name) {
                Some(e) => Err(e),
                None => self
                    .cloud
                    .check_owner(s)
                    .and_then(|()| self.cloud.set_load_balancer_hosts(&s.load_balancer_name, hosts.clone())),
            })
            .collect();
        if results.iter().any(Result::is_ok) {
            self.push().await?;
        }
        Ok(results)
    }
}

#[tonic::async_trait]
impl ccm_provider_sdk::NodeMetadata for SimProvider {
    async fn node_metadata(&self) -> Result<pb::InstanceMetadata> {
        // The link-local metadata service: not the cloud API, so no rate limit or latency.
        self.cloud.node_metadata()
    }
}

/// What a lying sim answers for an address or ingress IP.
const NOT_AN_IP: &str = "999.0.0.1";

/// One instance answer, as `lie` bends it.
fn lie_about(lie: Option<Lie>, metadata: Option<pb::InstanceMetadata>) -> Option<pb::InstanceMetadata> {
    use pb::NodeAddressType as T;
    let mut m = metadata?;
    match lie {
        Some(Lie::AllGone) => return None,
        Some(Lie::OtherScheme) => {
            m.provider_id = m.provider_id.split_once("://").map_or(m.provider_id.clone(), |(_, rest)| format!("other://{rest}"))
        }
        Some(Lie::InvalidIps) => {
            for a in m.addresses.iter_mut().filter(|a| matches!(a.r#type(), T::InternalIp | T::ExternalIp)) {
                a.address = NOT_AN_IP.into();
            }
        }
        _ => {}
    }
    Some(m)
}

/// A batch answer, reordered or cut short when `lie` says so.
fn shuffled<T>(lie: Option<Lie>, mut answers: Vec<T>) -> Vec<T> {
    match lie {
        Some(Lie::Reorder) => answers.reverse(),
        Some(Lie::ShortBatch) => {
            answers.pop();
        }
        _ => {}
    }
    answers
}

/// One page of a listing, emptied or with its token repeated when `lie` says so.
fn listing<T: Clone>(lie: Option<Lie>, items: Vec<T>, key: impl Fn(&T) -> &str, page: &PageRequest) -> Result<Page<T>> {
    match lie {
        Some(Lie::EmptyListing) => Ok(Page { items: Vec::new(), next_page_token: String::new() }),
        Some(Lie::RepeatedPageToken) => {
            // A well-formed token, of the page before the first: the first page comes back.
            let mut first = paginate(items, key, &PageRequest::new(page.page_size, ""))?;
            first.next_page_token = ccm_provider_sdk::token_for("");
            Ok(first)
        }
        _ => paginate(items, key, page),
    }
}
