//! The typed provider client the controllers use: one method per thing they ask of the cloud.
//! Each owns its batching (500 lookups a call), paging (bounded, a repeated token an error),
//! the deadline, retries and metrics of [`Provider::call`], fencing for calls that change the
//! cloud, and the checks of [`super::check`]: an answer that fails them is an error, never
//! acted on.

use std::collections::BTreeMap;

use ccm_proto::v1 as pb;
use ccm_proto::v1::instances_service_client::InstancesServiceClient;
use ccm_proto::v1::load_balancers_service_client::LoadBalancersServiceClient;
use ccm_proto::v1::routes_service_client::RoutesServiceClient;
use ccm_proto::v1::tags_service_client::TagsServiceClient;
use ccm_protocol::Error;
use ccm_protocol::answer;
use ccm_protocol::limits::{MAX_BATCH, MAX_MESSAGE_SIZE};
use futures::future::join_all;
use tonic::transport::Channel;

use super::Provider;
use super::check::{self, Pages, invalid};
use super::convert::{self, LoadBalancerRequest};
use super::encoded::{self, Backends, EncodedNodes, WithNodes};
use crate::leader::Fence;
use k8s_openapi::api::core::v1::LoadBalancerIngress;

/// The generated clients, with cloudprovider.v1's message limits (64 MiB each way: a
/// load balancer's 5000 Nodes with their labels do not fit gRPC's default 4 MiB).
macro_rules! client {
    ($name:ident, $client:ident) => {
        fn $name(channel: Channel) -> $client<Channel> {
            $client::new(channel).max_decoding_message_size(MAX_MESSAGE_SIZE).max_encoding_message_size(MAX_MESSAGE_SIZE)
        }
    };
}
client!(instances_client, InstancesServiceClient);
client!(tags_client, TagsServiceClient);
client!(routes_client, RoutesServiceClient);
client!(load_balancers_client, LoadBalancersServiceClient);

/// One answer per lookup, in the lookups' order.
pub type PerLookup<T> = Vec<Result<T, Error>>;

impl Provider {
    /// What the cloud says of each lookup's instance: `Ok(None)` when it does not exist. One
    /// call per 500 lookups when the provider batches reads, else one per lookup. A batch
    /// answer of the wrong length fails its lookups; an answer about another instance than
    /// its lookup (a reordered batch), "exists" without metadata, or metadata that fails
    /// [`answer::instance`] fails its own lookup; none of them ever reads as "gone".
    pub async fn instance_metadata(&self, lookups: &[pb::InstanceLookup]) -> PerLookup<Option<pb::InstanceMetadata>> {
        let scheme = self.identity().map(|i| i.provider_id_scheme.clone()).unwrap_or_default();
        let (method, answers) = if self.identity().is_some_and(|i| i.batch_reads()) {
            const METHOD: &str = "InstancesService/BatchInstanceMetadata";
            let call = |instances: Vec<pb::InstanceLookup>| async move {
                let request = pb::BatchInstanceMetadataRequest { instances };
                let rpc = async |ch, r| instances_client(ch).batch_instance_metadata(r).await;
                self.call(METHOD, request, rpc).await.map(|a| a.results)
            };
            let answers = in_batches(
                METHOD,
                lookups,
                call,
                |r: &pb::InstanceMetadataResult| r.lookup.as_ref(),
                |r: pb::InstanceMetadataResult| match r.error {
                    Some(e) => Err(self.item_error(&e)),
                    None => Ok((r.exists, r.metadata)),
                },
            )
            .await;
            (METHOD, answers)
        } else {
            const METHOD: &str = "InstancesService/InstanceMetadata";
            let answers = join_all(lookups.iter().map(|lookup| async move {
                let request = pb::InstanceMetadataRequest { instance: Some(lookup.clone()) };
                let rpc = async |ch, r| instances_client(ch).instance_metadata(r).await;
                self.call(METHOD, request, rpc).await.map(|a| (a.exists, a.metadata))
            }))
            .await;
            (METHOD, answers)
        };
        let answers: PerLookup<_> = lookups
            .iter()
            .zip(answers)
            .map(|(lookup, answer)| answer.and_then(|(exists, m)| instance(method, lookup, exists, m, &scheme)))
            .collect();
        self.count_invalid(method, &answers);
        answers
    }

    /// Each lookup's instance tags, 500 lookups a call.
    pub async fn instance_tags(&self, lookups: &[pb::InstanceLookup]) -> PerLookup<BTreeMap<String, String>> {
        const METHOD: &str = "TagsService/BatchGetInstanceTags";
        let call = |instances: Vec<pb::InstanceLookup>| async move {
            let request = pb::BatchGetInstanceTagsRequest { instances };
            let rpc = async |ch, r| tags_client(ch).batch_get_instance_tags(r).await;
            self.call(METHOD, request, rpc).await.map(|a| a.results)
        };
        let answers = in_batches(
            METHOD,
            lookups,
            call,
            |r: &pb::InstanceTagsResult| r.lookup.as_ref(),
            |r: pb::InstanceTagsResult| match r.error {
                Some(e) => Err(self.item_error(&e)),
                None => Ok(r.tags.into_iter().collect()),
            },
        )
        .await;
        self.count_invalid(METHOD, &answers);
        answers
    }

    /// Every route table, all pages.
    pub async fn list_route_tables(&self) -> Result<Vec<pb::RouteTable>, Error> {
        const METHOD: &str = "RoutesService/ListRouteTables";
        let mut tables = Vec::new();
        let mut pages = Pages::default();
        let mut token = String::new();
        loop {
            let request = pb::ListRouteTablesRequest { page_size: 0, page_token: token };
            let rpc = async |ch, r| routes_client(ch).list_route_tables(r).await;
            let page = self.call(METHOD, request, rpc).await?;
            if let Some(t) = page.tables.iter().find(|t| t.id.is_empty()) {
                return Err(self.invalid(METHOD, format!("a route table without an id (named {:?})", t.name)));
            }
            tables.extend(page.tables);
            match pages.next(METHOD, page.next_page_token).map_err(|e| self.counted(METHOD, e))? {
                Some(next) => token = next,
                None => return Ok(tables),
            }
        }
    }

    /// The cluster's routes in one table, all pages, each checked by [`answer::route`].
    pub async fn list_routes(&self, cluster: &str, table: &str) -> Result<Vec<pb::Route>, Error> {
        const METHOD: &str = "RoutesService/ListRoutes";
        let mut routes = Vec::new();
        let mut pages = Pages::default();
        let mut token = String::new();
        loop {
            let request = pb::ListRoutesRequest {
                cluster_name: cluster.to_string(),
                table_id: table.to_string(),
                page_size: 0,
                page_token: token,
            };
            let rpc = async |ch, r| routes_client(ch).list_routes(r).await;
            let page = self.call(METHOD, request, rpc).await?;
            for route in &page.routes {
                answer::route(route).map_err(|why| self.invalid(METHOD, why))?;
            }
            routes.extend(page.routes);
            match pages.next(METHOD, page.next_page_token).map_err(|e| self.counted(METHOD, e))? {
                Some(next) => token = next,
                None => return Ok(routes),
            }
        }
    }

    /// The tables each target's routes belong in, 500 targets a call: one answer per target,
    /// in order, matched by the target each assignment names. An answer of the wrong length is
    /// an error for the whole call; a target no assignment names fails alone.
    pub async fn resolve_route_tables(&self, targets: &[pb::RouteTarget]) -> Result<PerLookup<Vec<String>>, Error> {
        const METHOD: &str = "RoutesService/ResolveRouteTables";
        let mut out = Vec::with_capacity(targets.len());
        for chunk in targets.chunks(MAX_BATCH) {
            let request = pb::ResolveRouteTablesRequest { targets: chunk.to_vec() };
            let rpc = async |ch, r| routes_client(ch).resolve_route_tables(r).await;
            let answer = self.call(METHOD, request, rpc).await?;
            if answer.assignments.len() != chunk.len() {
                let why = format!("{} assignments for {} targets", answer.assignments.len(), chunk.len());
                return Err(self.invalid(METHOD, why));
            }
            let keys = chunk.iter().map(|t| (t.provider_id.as_str(), t.node_name.as_str()));
            let named = |a: &pb::RouteTableAssignment| a.target.as_ref().map(|t| (t.provider_id.clone(), t.node_name.clone()));
            for matched in matched(METHOD, keys, answer.assignments, named) {
                out.push(matched.and_then(|a| match a.error {
                    Some(e) => Err(self.item_error(&e)),
                    None => Ok(a.table_ids),
                }));
            }
        }
        Ok(out)
    }

    /// Creates `route` (fenced); the route as the provider made it.
    pub(super) async fn create_route(&self, fence: Option<&Fence>, cluster: &str, route: pb::Route) -> Result<pb::Route, Error> {
        const METHOD: &str = "RoutesService/CreateRoute";
        let request = pb::CreateRouteRequest { cluster_name: cluster.to_string(), route: Some(route.clone()) };
        let rpc = async |ch, r| routes_client(ch).create_route(r).await;
        let made = self.call_fenced(fence, METHOD, request, rpc).await?.route;
        self.made_route(METHOD, &route, made)
    }

    /// Deletes the route `name` of `table` (fenced).
    pub(super) async fn delete_route(&self, fence: Option<&Fence>, cluster: &str, table: &str, name: &str) -> Result<(), Error> {
        let request =
            pb::DeleteRouteRequest { cluster_name: cluster.to_string(), table_id: table.to_string(), name: name.to_string() };
        let rpc = async |ch, r| routes_client(ch).delete_route(r).await;
        self.call_fenced(fence, "RoutesService/DeleteRoute", request, rpc).await.map(|_| ())
    }

    /// Deletes the routes `deletes` and creates `creates` in `table` with ApplyRoutes (fenced),
    /// 500 items a call, every delete before any create: one result per delete and per
    /// create, in order. A failed call, or an answer of the wrong length, fails every item of
    /// its call; a created route is checked as CreateRoute's answer is.
    pub(super) async fn apply_routes(
        &self,
        fence: Option<&Fence>,
        cluster: &str,
        table: &str,
        deletes: Vec<String>,
        creates: Vec<pb::Route>,
    ) -> (PerLookup<()>, PerLookup<pb::Route>) {
        const METHOD: &str = "RoutesService/ApplyRoutes";
        let (mut deleted, mut created) = (Vec::with_capacity(deletes.len()), Vec::with_capacity(creates.len()));
        let (mut deletes, mut creates) = (deletes.into_iter().peekable(), creates.into_iter().peekable());
        while deletes.peek().is_some() || creates.peek().is_some() {
            let deletes: Vec<String> = deletes.by_ref().take(MAX_BATCH).collect();
            let creates: Vec<pb::Route> = creates.by_ref().take(MAX_BATCH - deletes.len()).collect();
            let request = pb::ApplyRoutesRequest {
                cluster_name: cluster.to_string(),
                table_id: table.to_string(),
                deletes: deletes.clone(),
                creates: creates.clone(),
            };
            let rpc = async |ch, r| routes_client(ch).apply_routes(r).await;
            let answer = self.call_fenced(fence, METHOD, request, rpc).await.and_then(|a| {
                if a.deletes.len() != deletes.len() || a.creates.len() != creates.len() {
                    let why = format!(
                        "{} and {} results for {} deletes and {} creates",
                        a.deletes.len(),
                        a.creates.len(),
                        deletes.len(),
                        creates.len()
                    );
                    return Err(self.invalid(METHOD, why));
                }
                Ok(a)
            });
            match answer {
                Ok(a) => {
                    deleted.extend(a.deletes.into_iter().map(|d| d.error.map_or(Ok(()), |e| Err(self.item_error(&e)))));
                    created.extend(a.creates.into_iter().zip(creates).map(|(r, wanted)| match (r.error, r.route) {
                        (Some(e), _) => Err(self.item_error(&e)),
                        (None, made) => self.made_route(METHOD, &wanted, made),
                    }));
                }
                Err(e) => {
                    deleted.extend(deletes.iter().map(|_| Err(e.clone())));
                    created.extend(creates.iter().map(|_| Err(e.clone())));
                }
            }
        }
        (deleted, created)
    }

    /// A created route as the provider answered it (`made`; none means as asked), checked.
    fn made_route(&self, method: &str, wanted: &pb::Route, made: Option<pb::Route>) -> Result<pb::Route, Error> {
        let made = made.unwrap_or_else(|| wanted.clone());
        answer::route(&made).map_err(|why| self.invalid(method, why))?;
        if made.destination_cidr != wanted.destination_cidr {
            let why = format!("asked for a route to {}, it made one to {}", wanted.destination_cidr, made.destination_cidr);
            return Err(self.invalid(method, why));
        }
        Ok(made)
    }

    /// The cluster's load balancers, all pages.
    pub async fn list_load_balancers(&self, cluster: &str) -> Result<Vec<pb::LoadBalancerSummary>, Error> {
        const METHOD: &str = "LoadBalancersService/ListLoadBalancers";
        let mut listed = Vec::new();
        let mut pages = Pages::default();
        let mut token = String::new();
        loop {
            let request = pb::ListLoadBalancersRequest { cluster_name: cluster.to_string(), page_size: 0, page_token: token };
            let rpc = async |ch, r| load_balancers_client(ch).list_load_balancers(r).await;
            let page = self.call(METHOD, request, rpc).await?;
            listed.extend(page.load_balancers);
            match pages.next(METHOD, page.next_page_token).map_err(|e| self.counted(METHOD, e))? {
                Some(next) => token = next,
                None => return Ok(listed),
            }
        }
    }

    /// The status of the load balancer of `service` (its name is what is looked up), `None`
    /// when it does not exist.
    pub async fn get_load_balancer(&self, service: LoadBalancerRequest) -> Result<Option<Vec<LoadBalancerIngress>>, Error> {
        const METHOD: &str = "LoadBalancersService/GetLoadBalancer";
        let request = pb::GetLoadBalancerRequest { service: Some(service.into_proto()) };
        let rpc = async |ch, r| load_balancers_client(ch).get_load_balancer(r).await;
        let answer = self.call(METHOD, request, rpc).await?;
        if !answer.exists {
            return Ok(None);
        }
        let status = answer.status.unwrap_or_default();
        answer::status(&status).map_err(|why| self.invalid(METHOD, why))?;
        Ok(Some(convert::ingress(&status)))
    }

    /// Ensures the load balancer of `service` over `nodes` (fenced); its status, checked by
    /// [`answer::status`], as the Service's `status.loadBalancer.ingress`.
    pub(super) async fn ensure_load_balancer(
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
    pub(super) async fn update_load_balancer_hosts(
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
    pub(super) async fn batch_update_load_balancer_hosts(
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
    pub(super) async fn ensure_load_balancer_deleted(
        &self,
        fence: Option<&Fence>,
        service: LoadBalancerRequest,
    ) -> Result<(), Error> {
        let request = pb::EnsureLoadBalancerDeletedRequest { service: Some(service.into_proto()) };
        let rpc = async |ch, r| load_balancers_client(ch).ensure_load_balancer_deleted(r).await;
        self.call_fenced(fence, "LoadBalancersService/EnsureLoadBalancerDeleted", request, rpc).await.map(|_| ())
    }

    /// The error one item of a batch answer carries, its RetryInfo delay cut to the longest
    /// honoured (`--provider-max-retry-after`), as a whole call's is: a delay of hours on one
    /// item would otherwise park its key (a Node, the route table, the bulk hosts pass) for
    /// that long.
    fn item_error(&self, e: &pb::ItemError) -> Error {
        Error::from_item_error(e).with_retry_after_at_most(self.max_retry_after)
    }

    /// The error of an invalid answer to `method`, counted and logged.
    fn invalid(&self, method: &str, why: impl std::fmt::Display) -> Error {
        self.counted(method, invalid(method, why))
    }

    fn counted(&self, method: &str, error: Error) -> Error {
        if check::is_invalid(&error) {
            self.metrics.invalid_answer(method);
            tracing::warn!(method, %error, "invalid provider answer");
        }
        error
    }

    fn count_invalid<T>(&self, method: &str, answers: &PerLookup<T>) {
        for error in answers.iter().filter_map(|a| a.as_ref().err()) {
            self.counted(method, error.clone());
        }
    }
}

/// One lookup's instance answer: metadata when it exists, checked. Which lookup it answers is
/// settled before (the batch answer names it, or the call was about this lookup alone), so the
/// metadata may name the instance in the provider's canonical form (`sim://sim-region-1a/i-10`
/// for a kubelet's `sim://zone-it-said/i-10`, `aws:///us-east-1a/i-…` for `aws:///i-…`): the
/// Node keeps its own providerID, as upstream's does.
fn instance(
    method: &str,
    lookup: &pb::InstanceLookup,
    exists: bool,
    metadata: Option<pb::InstanceMetadata>,
    scheme: &str,
) -> Result<Option<pb::InstanceMetadata>, Error> {
    if !exists {
        return Ok(None);
    }
    let Some(m) = metadata else {
        return Err(invalid(method, format!("instance of node {:?} exists but came without metadata", lookup.node_name)));
    };
    answer::instance(&m, scheme).map_err(|why| invalid(method, format!("node {:?}: {why}", lookup.node_name)))?;
    Ok(Some(m))
}

/// Runs a batch RPC over `lookups` in chunks of [`MAX_BATCH`]: one result per lookup, in the
/// lookups' order, each answer matched to its lookup by the lookup it names (`named`), never
/// by position; a failed call, or an answer of the wrong length, fails each lookup of its
/// chunk; a lookup that no answer names fails alone ([`matched`]).
async fn in_batches<R, T, Fut>(
    method: &str,
    lookups: &[pb::InstanceLookup],
    call: impl Fn(Vec<pb::InstanceLookup>) -> Fut,
    named: impl Fn(&R) -> Option<&pb::LookupKey>,
    item: impl Fn(R) -> Result<T, Error>,
) -> PerLookup<T>
where
    Fut: Future<Output = Result<Vec<R>, Error>>,
{
    let mut out = Vec::with_capacity(lookups.len());
    for chunk in lookups.chunks(MAX_BATCH) {
        match call(chunk.to_vec()).await {
            Ok(results) if results.len() == chunk.len() => {
                let keys = chunk.iter().map(|l| (l.provider_id.as_str(), l.node_name.as_str()));
                let named = |r: &R| named(r).map(|k| (k.provider_id.clone(), k.node_name.clone()));
                out.extend(matched(method, keys, results, named).into_iter().map(|r| r.and_then(&item)));
            }
            Ok(results) => {
                let e = invalid(method, format!("{} answers for {} lookups", results.len(), chunk.len()));
                out.extend(chunk.iter().map(|_| Err(e.clone())));
            }
            Err(e) => out.extend(chunk.iter().map(|_| Err(e.clone()))),
        }
    }
    out
}

/// The answers of one batch call put in the order of the lookups they name (`keys`: each
/// lookup's providerID and node name as sent; `named`: the same of an answer). A lookup that
/// no answer names, or whose answer is taken by an earlier lookup of the same name, gets an
/// invalid-answer error of its own; answers naming no lookup, or one not asked, are dropped
/// and counted in those errors. Nothing is matched by position: a "does not exist" answer
/// carries nothing else that says whose it is.
fn matched<'k, R>(
    method: &str,
    keys: impl Iterator<Item = (&'k str, &'k str)>,
    answers: Vec<R>,
    named: impl Fn(&R) -> Option<(String, String)>,
) -> Vec<Result<R, Error>> {
    let keys: Vec<(&str, &str)> = keys.collect();
    let mut slots: Vec<Option<R>> = keys.iter().map(|_| None).collect();
    let mut index: std::collections::HashMap<(String, String), Vec<usize>> = std::collections::HashMap::new();
    for (i, (id, node)) in keys.iter().enumerate().rev() {
        index.entry((id.to_string(), node.to_string())).or_default().push(i);
    }
    let mut stray = 0;
    for answer in answers {
        let slot = named(&answer).and_then(|key| index.get_mut(&key)?.pop());
        match slot {
            Some(i) => slots[i] = Some(answer),
            None => stray += 1,
        }
    }
    slots
        .into_iter()
        .zip(keys)
        .map(|(slot, (provider_id, node))| {
            slot.ok_or_else(|| {
                let why = format!(
                    "no answer names the lookup of node {node:?} (providerID {provider_id:?}); {stray} answer(s) named no lookup asked"
                );
                invalid(method, why)
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(name: &str, id: &str) -> pb::InstanceLookup {
        pb::InstanceLookup { node_name: name.into(), provider_id: id.into(), ..Default::default() }
    }

    fn meta(id: &str) -> pb::InstanceMetadata {
        pb::InstanceMetadata { provider_id: id.into(), ..Default::default() }
    }

    #[test]
    fn an_instance_answer_is_checked_and_may_name_the_instance_in_the_providers_form() {
        let m = "M";
        assert_eq!(instance(m, &lookup("a", "sim://z/a"), false, None, "sim").expect("ok"), None);
        let stray = instance(m, &lookup("a", "sim://z/a"), false, Some(meta("sim://z/a")), "sim").expect("ok");
        assert_eq!(stray, None, "absent wins over stray metadata");
        assert!(instance(m, &lookup("a", "sim://z/a"), true, Some(meta("sim://z/a")), "sim").expect("ok").is_some());
        // A lookup by name takes the instance the provider found.
        assert!(instance(m, &lookup("a", ""), true, Some(meta("sim://z/a")), "sim").expect("ok").is_some());
        // The kubelet said another zone; the cloud answers in its canonical form.
        let canonical = instance(m, &lookup("a", "sim://kubelet-zone/a"), true, Some(meta("sim://z/a")), "sim").expect("ok");
        assert_eq!(canonical.map(|c| c.provider_id), Some("sim://z/a".to_string()));
        let bare = instance(m, &lookup("a", "sim://z/a"), true, None, "sim").expect_err("an error");
        assert!(bare.to_string().contains("without metadata"), "{bare}");
        let other = instance(m, &lookup("a", ""), true, Some(meta("other://z/a")), "sim").expect_err("an error");
        assert!(other.to_string().contains("scheme"), "{other}");
    }

    fn result(name: &str, id: &str, exists: bool) -> pb::InstanceMetadataResult {
        pb::InstanceMetadataResult {
            exists,
            metadata: exists.then(|| meta(&format!("sim://z/{name}"))),
            lookup: Some(pb::LookupKey { node_name: name.into(), provider_id: id.into() }),
            error: None,
        }
    }

    fn named(r: &pb::InstanceMetadataResult) -> Option<&pb::LookupKey> {
        r.lookup.as_ref()
    }

    /// (exists) per lookup, or the error's text.
    async fn answers(lookups: &[pb::InstanceLookup], results: Vec<pb::InstanceMetadataResult>) -> Vec<Result<bool, String>> {
        let call = |_: Vec<pb::InstanceLookup>| {
            let results = results.clone();
            async move { Ok::<_, Error>(results) }
        };
        let out = in_batches("M", lookups, call, named, |r| Ok(r.exists)).await;
        out.into_iter().map(|r| r.map_err(|e| e.to_string())).collect()
    }

    #[tokio::test]
    async fn batch_answers_are_matched_by_the_lookup_they_name_not_by_position() {
        let lookups = vec![lookup("a", "sim://z/a"), lookup("b", ""), lookup("c", "sim://z/c")];
        // Reversed: "b does not exist" sits where a's answer would be.
        let reversed = vec![result("c", "sim://z/c", true), result("b", "", false), result("a", "sim://z/a", true)];
        assert_eq!(answers(&lookups, reversed).await, vec![Ok(true), Ok(false), Ok(true)]);

        // An answer that names no lookup, or one not asked, is nobody's answer: its lookup fails
        // alone as an invalid answer (never "gone"), the others stand.
        let mut unnamed = result("a", "sim://z/a", false);
        unnamed.lookup = None;
        let stray = result("x", "sim://z/x", false);
        let got = answers(&lookups, vec![unnamed, result("b", "", false), result("c", "sim://z/c", true)]).await;
        assert!(got[0].as_ref().is_err_and(|e| e.contains("no answer names the lookup of node \"a\"")), "{got:?}");
        assert_eq!(got[1..], [Ok(false), Ok(true)]);
        let got = answers(&lookups, vec![result("b", "", false), stray, result("c", "sim://z/c", true)]).await;
        assert!(got[0].is_err() && got[1] == Ok(false) && got[2] == Ok(true), "{got:?}");
        // The same lookup answered twice: one answer taken, the other lookup left without one.
        let got = answers(
            &lookups,
            vec![result("a", "sim://z/a", true), result("a", "sim://z/a", false), result("c", "sim://z/c", true)],
        )
        .await;
        assert!(got[0] == Ok(true) && got[1].is_err() && got[2] == Ok(true), "{got:?}");
    }

    #[tokio::test]
    async fn a_short_batch_fails_every_lookup_of_its_chunk() {
        let lookups: Vec<_> = (0..3).map(|i| lookup(&format!("n{i}"), "")).collect();
        let short = vec![result("n1", "", true), result("n2", "", true)];
        let got = answers(&lookups, short).await;
        assert!(got.iter().all(|a| a.as_ref().is_err_and(|e| e.contains("2 answers for 3 lookups"))), "{got:?}");
        let whole = vec![result("n0", "", true), result("n1", "", true), result("n2", "", true)];
        assert!(answers(&lookups, whole).await.iter().all(Result::is_ok));
    }

    #[tokio::test]
    async fn an_items_retry_info_of_hours_is_cut_to_the_longest_honoured() {
        use ccm_provider_sim::config::{Fault, FaultCode};
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("provider.sock");
        let mut config = ccm_provider_sim::Config::default();
        config.load_balancers.bulk_hosts = true;
        config.faults.push(Fault {
            method: "BatchUpdateLoadBalancerHosts".into(),
            down: true,
            code: FaultCode::RateLimited,
            subject: Some("lb-b".into()),
            retry_after_ms: Some(36_000_000),
            ..Default::default()
        });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let endpoints = ccm_provider_sim::Endpoints::provider(ccm_provider_sdk::Listen::Unix(socket.clone()));
        let sim = tokio::spawn(ccm_provider_sim::run(config, endpoints, async move {
            let _ = stopped.await;
        }));
        let endpoint = format!("unix://{}", socket.display());
        let provider = Provider::new(&endpoint, std::time::Duration::from_secs(5), 4, crate::metrics::Metrics::new())
            .expect("client")
            .with_max_retry_after(std::time::Duration::from_secs(20));
        for _ in 0..100 {
            if provider.refresh().await.is_ok() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let services: Vec<LoadBalancerRequest> = ["lb-a", "lb-b"]
            .iter()
            .map(|name| pb::LoadBalancerService {
                cluster_name: "c".into(),
                namespace: "default".into(),
                name: name.to_string(),
                uid: format!("uid-{name}"),
                load_balancer_name: name.to_string(),
                ports: vec![pb::ServicePort {
                    port: 80,
                    node_port: 30080,
                    protocol: pb::Protocol::Tcp as i32,
                    ..Default::default()
                }],
                ..Default::default()
            })
            .map(LoadBalancerRequest::from_proto)
            .collect();
        for service in &services {
            provider.ensure_load_balancer(None, service.clone(), &Backends::default()).await.expect("ensure");
        }
        let (answers, failed) = provider.batch_update_load_balancer_hosts(None, &services, &Backends::default()).await;
        assert!(failed.is_none(), "the call itself answered: {failed:?}");
        assert!(answers[0].is_ok(), "{:?}", answers[0]);
        let throttled = answers[1].as_ref().expect_err("lb-b is throttled");
        assert_eq!(throttled.retry_after(), Some(std::time::Duration::from_secs(20)), "{throttled}");
        let _ = stop.send(());
        let _ = sim.await;
    }
}
