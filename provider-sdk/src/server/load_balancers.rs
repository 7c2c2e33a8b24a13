//! LoadBalancersService: Services validated, one mutation per load balancer in flight.

use std::sync::Arc;

use ccm_proto::v1 as pb;
use tonic::{Request, Response, Status};

use crate::locks::ObjectLocks;
use crate::names::NameLimits;
use crate::page::PageRequest;
use crate::provider::LoadBalancers;
use crate::validate;
use ccm_proto::v1::load_balancers_service_server::LoadBalancersService;

use super::Observers;
use super::items::{checked, distinct, merge};

// === impl LoadBalancersAdapter ===

pub(super) struct LoadBalancersAdapter {
    pub(super) inner: Arc<dyn LoadBalancers>,
    /// One mutation per load balancer at a time.
    pub(super) locks: ObjectLocks,
    pub(super) limits: NameLimits,
    pub(super) obs: Observers,
}

#[tonic::async_trait]
impl LoadBalancersService for LoadBalancersAdapter {
    async fn get_load_balancer(
        &self,
        req: Request<pb::GetLoadBalancerRequest>,
    ) -> std::result::Result<Response<pb::GetLoadBalancerResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("LoadBalancersService/GetLoadBalancer", async {
                let service = validate::load_balancer_ref(req.service.as_ref(), &self.limits)?;
                let status = self.inner.get_load_balancer(service).await?;
                let hosts = match status {
                    Some(_) => {
                        self.inner.load_balancer_hosts(service).await?.map(|node_names| pb::LoadBalancerHosts { node_names })
                    }
                    None => None,
                };
                Ok(pb::GetLoadBalancerResponse { exists: status.is_some(), status, hosts })
            })
            .await
    }

    async fn ensure_load_balancer(
        &self,
        req: Request<pb::EnsureLoadBalancerRequest>,
    ) -> std::result::Result<Response<pb::EnsureLoadBalancerResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("LoadBalancersService/EnsureLoadBalancer", async {
                let service = validate::load_balancer_spec(req.service.as_ref(), &self.limits)?;
                let _held = self.locks.lock([service.load_balancer_name.clone()]).await;
                let status = self.inner.ensure_load_balancer(service, &req.nodes).await?;
                Ok(pb::EnsureLoadBalancerResponse { status: Some(status) })
            })
            .await
    }

    async fn update_load_balancer_hosts(
        &self,
        req: Request<pb::UpdateLoadBalancerHostsRequest>,
    ) -> std::result::Result<Response<pb::UpdateLoadBalancerHostsResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("LoadBalancersService/UpdateLoadBalancerHosts", async {
                let service = validate::load_balancer_ref(req.service.as_ref(), &self.limits)?;
                let _held = self.locks.lock([service.load_balancer_name.clone()]).await;
                self.inner.update_load_balancer_hosts(service, &req.nodes).await?;
                Ok(pb::UpdateLoadBalancerHostsResponse {})
            })
            .await
    }

    async fn ensure_load_balancer_deleted(
        &self,
        req: Request<pb::EnsureLoadBalancerDeletedRequest>,
    ) -> std::result::Result<Response<pb::EnsureLoadBalancerDeletedResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("LoadBalancersService/EnsureLoadBalancerDeleted", async {
                let service = validate::load_balancer_ref(req.service.as_ref(), &self.limits)?;
                let _held = self.locks.lock([service.load_balancer_name.clone()]).await;
                self.inner.ensure_load_balancer_deleted(service).await?;
                Ok(pb::EnsureLoadBalancerDeletedResponse {})
            })
            .await
    }

    async fn list_load_balancers(
        &self,
        req: Request<pb::ListLoadBalancersRequest>,
    ) -> std::result::Result<Response<pb::ListLoadBalancersResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("LoadBalancersService/ListLoadBalancers", async {
                let page = PageRequest::new(req.page_size, req.page_token);
                page.after()?;
                let page = self.inner.list_load_balancers(&req.cluster_name, &page).await?;
                Ok(pb::ListLoadBalancersResponse { load_balancers: page.items, next_page_token: page.next_page_token })
            })
            .await
    }

    async fn batch_update_load_balancer_hosts(
        &self,
        req: Request<pb::BatchUpdateLoadBalancerHostsRequest>,
    ) -> std::result::Result<Response<pb::BatchUpdateLoadBalancerHostsResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("LoadBalancersService/BatchUpdateLoadBalancerHosts", async {
                validate::batch_size(req.services.len())?;
                distinct("load balancer", req.services.iter().map(|s| s.load_balancer_name.as_str()))?;
                let (checks, valid) = checked(&req.services, |s| validate::load_balancer_ref(Some(s), &self.limits).cloned());
                let _held = self.locks.lock(valid.iter().map(|s| s.load_balancer_name.clone()).collect::<Vec<_>>()).await;
                let answers = self.inner.batch_update_load_balancer_hosts(&valid, &req.nodes).await?;
                let results = merge("load balancers", checks, answers)?
                    .into_iter()
                    .map(|r| pb::HostsUpdateResult { error: r.err().map(|e| e.to_item_error()) })
                    .collect();
                Ok(pb::BatchUpdateLoadBalancerHostsResponse { results })
            })
            .await
    }
}
