//! LoadBalancersService: load balancers listed and read, ensured, their hosts updated (one
//! by one or in bulk) and deleted (fenced: see `provider/fenced.rs`).

use ccm_proto::v1 as pb;
use ccm_protocol::Error;
use ccm_protocol::answer;
use ccm_protocol::limits::MAX_BATCH;
use futures::future::join_all;
use k8s_openapi::api::core::v1::LoadBalancerIngress;

use super::{PerLookup, load_balancers_client};
use crate::leader::Fence;
use crate::provider::Provider;
use crate::provider::check::Pages;
use crate::provider::convert::{self, ListedLoadBalancer, LoadBalancerRequest};
use crate::provider::encoded::{self, Backends, EncodedNodes, WithNodes};

/// A load balancer as GetLoadBalancer found it.
#[derive(Debug, Clone, PartialEq)]
pub struct FoundLoadBalancer {
    /// Its ingress, as the Service's status has it.
    pub ingress: Vec<LoadBalancerIngress>,
    /// Its backends, by Node name and sorted, when the provider reports them.
    pub hosts: Option<Vec<String>>,
}

impl Provider {
    /// The cluster's load balancers, all pages.
    pub async fn list_load_balancers(&self, cluster: &str) -> Result<Vec<ListedLoadBalancer>, Error> {
        const METHOD: &str = "LoadBalancersService/ListLoadBalancers";
        let mut listed = Vec::new();
        let mut pages = Pages::default();
        let mut token = String::new();
        loop {
            let request = pb::ListLoadBalancersRequest { cluster_name: cluster.to_string(), page_size: 0, page_token: token };
            let rpc = async |ch, r| load_balancers_client(ch).list_load_balancers(r).await;
            let page = self.call(METHOD, request, rpc).await?;
            for l in page.load_balancers {
                listed.push(ListedLoadBalancer::checked(l).map_err(|why| self.invalid(METHOD, why))?);
            }
            match pages.next(METHOD, page.next_page_token).map_err(|e| self.counted(METHOD, e))? {
                Some(next) => token = next,
                None => return Ok(listed),
            }
        }
    }

    /// The status of the load balancer of `service` (its name is what is looked up), `None`
    /// when it does not exist.
    pub async fn get_load_balancer(&self, service: LoadBalancerRequest) -> Result<Option<Vec<LoadBalancerIngress>>, Error> {
        Ok(self.read_load_balancer(service).await?.map(|found| found.ingress))
    }

    /// The load balancer of `service` as GetLoadBalancer finds it, with its backends when the
    /// provider reports them; `None` when it does not exist.
    pub async fn read_load_balancer(&self, service: LoadBalancerRequest) -> Result<Option<FoundLoadBalancer>, Error> {
        const METHOD: &str = "LoadBalancersService/GetLoadBalancer";
        let request = pb::GetLoadBalancerRequest { service: Some(service.into_proto()) };
        let rpc = async |ch, r| load_balancers_client(ch).get_load_balancer(r).await;
        let answer = self.call(METHOD, request, rpc).await?;
        if !answer.exists {
            return Ok(None);
        }
        let status = answer.status.unwrap_or_default();
        answer::status(&status).map_err(|why| self.invalid(METHOD, why))?;
        let hosts = answer.hosts.map(convert::sorted_hosts).transpose().map_err(|why| self.invalid(METHOD, why))?;
        Ok(Some(FoundLoadBalancer { ingress: convert::ingress(&status), hosts }))
    }

    /// Ensures the load balancer of `service` over `nodes` (fenced); its status, checked by
    /// [`answer::status`], as the Service's `status.loadBalancer.ingress`.
    pub(in crate::provider) async fn ensure_load_balancer(
        &self,
        fence: Option<&Fence>,
        service: LoadBalancerRequest,
        nodes: &Backends,
    ) -> Result<Vec<LoadBalancerIngress>, Error> {
        const METHOD: &str = "LoadBalancersService/EnsureLoadBalancer";
        let head = pb::EnsureLoadBalancerRequest { service: Some(service.into_proto()), nodes: Vec::new() };
        let request = WithNodes::new(head, nodes.encoded());
        let rpc = async |ch, r| -> Result<tonic::Response<pb::EnsureLoadBalancerResponse>, tonic::Status> {
            encoded::unary(ch, r, "/cloudprovider.v1.LoadBalancersService/EnsureLoadBalancer").await
        };
        let status = self.call_fenced(fence, METHOD, request, rpc).await?.status.unwrap_or_default();
        answer::status(&status).map_err(|why| self.invalid(METHOD, why))?;
        Ok(convert::ingress(&status))
    }

    /// Points the load balancer of `service` at `nodes` (fenced).
    pub(in crate::provider) async fn update_load_balancer_hosts(
        &self,
        fence: Option<&Fence>,
        service: LoadBalancerRequest,
        nodes: &Backends,
    ) -> Result<(), Error> {
        let head = pb::UpdateLoadBalancerHostsRequest { service: Some(service.into_proto()), nodes: Vec::new() };
        let request = WithNodes::new(head, nodes.encoded());
        let rpc = async |ch, r| -> Result<tonic::Response<pb::UpdateLoadBalancerHostsResponse>, tonic::Status> {
            encoded::unary(ch, r, "/cloudprovider.v1.LoadBalancersService/UpdateLoadBalancerHosts").await
        };
        self.call_fenced(fence, "LoadBalancersService/UpdateLoadBalancerHosts", request, rpc).await.map(|_| ())
    }

    /// Points the load balancers of `services` at `nodes` with BatchUpdateLoadBalancerHosts
    /// (fenced), 500 a call, the calls at once (the node set encoded once for all): one result
    /// per Service, in order, and the error of a call that failed as a whole, if any. A
    /// failed call, or an answer of the wrong length, fails every Service of its call.
    pub(in crate::provider) async fn batch_update_load_balancer_hosts(
        &self,
        fence: Option<&Fence>,
        services: &[LoadBalancerRequest],
        nodes: &Backends,
    ) -> (PerLookup<()>, Option<Error>) {
        const METHOD: &str = "LoadBalancersService/BatchUpdateLoadBalancerHosts";
        /// The field number of `nodes` in BatchUpdateLoadBalancerHostsRequest.
        const BATCH_NODES_FIELD: u32 = 1;
        let encoded = EncodedNodes::in_field(BATCH_NODES_FIELD, nodes.proto());
        let calls = services.chunks(MAX_BATCH).map(|chunk| {
            let services = chunk.iter().map(|s| s.proto().clone()).collect();
            let request = WithNodes::new(pb::BatchUpdateLoadBalancerHostsRequest { nodes: Vec::new(), services }, &encoded);
            let rpc = async |ch, r| -> Result<tonic::Response<pb::BatchUpdateLoadBalancerHostsResponse>, tonic::Status> {
                encoded::unary(ch, r, "/cloudprovider.v1.LoadBalancersService/BatchUpdateLoadBalancerHosts").await
            };
            async move { (chunk.len(), self.call_fenced(fence, METHOD, request, rpc).await) }
        });
        let mut out = Vec::with_capacity(services.len());
        let mut failed = None;
        for (len, answer) in join_all(calls).await {
            match answer {
                Ok(a) if a.results.len() == len => {
                    out.extend(a.results.into_iter().map(|r| r.error.map_or(Ok(()), |e| Err(self.item_error(&e)))));
                }
                Ok(a) => {
                    let e = self.invalid(METHOD, format!("{} results for {} load balancers", a.results.len(), len));
                    out.extend((0..len).map(|_| Err(e.clone())));
                    failed.get_or_insert(e);
                }
                Err(e) => {
                    out.extend((0..len).map(|_| Err(e.clone())));
                    failed.get_or_insert(e);
                }
            }
        }
        (out, failed)
    }

    /// Deletes the load balancer of `service` if it exists (fenced).
    pub(in crate::provider) async fn ensure_load_balancer_deleted(
        &self,
        fence: Option<&Fence>,
        service: LoadBalancerRequest,
    ) -> Result<(), Error> {
        let request = pb::EnsureLoadBalancerDeletedRequest { service: Some(service.into_proto()) };
        let rpc = async |ch, r| load_balancers_client(ch).ensure_load_balancer_deleted(r).await;
        self.call_fenced(fence, "LoadBalancersService/EnsureLoadBalancerDeleted", request, rpc).await.map(|_| ())
    }
}
