//! The traits a provider implements, one per service. Each takes and returns the protocol's
//! own messages (re-exported as [`crate::proto`]) and fails with [`crate::Error`]; the SDK
//! server validates requests before they reach these methods, answers Identity, paginates
//! nothing behind your back, and maps errors to gRPC status in one place.

use ccm_proto::v1::{
    GetImageCredentialsRequest, GetImageCredentialsResponse, InstanceLookup, InstanceMetadata, InstanceState, InstanceTagsUpdate,
    InstancesCapabilities, LoadBalancerNode, LoadBalancerService, LoadBalancerStatus, LoadBalancerSummary,
    LoadBalancersCapabilities, LookupKey, Route, RouteTable, RouteTarget, RoutesCapabilities, TagsCapabilities,
};
use std::collections::HashMap;

use crate::error::Result;
use crate::page::{Page, PageRequest};

/// One answer of a batch read, naming the lookup it answers. The SDK sends the name with the
/// answer (`lookup` of each result), and the core matches answers to lookups by it: make each
/// [`Answered`] from the lookup it is about ([`Answered::to`]), never by position in a list
/// that may have been sorted, grouped by zone or filled from a map. Answers may come in any
/// order; each lookup given must be answered exactly once.
#[derive(Debug)]
pub struct Answered<T> {
    /// The lookup answered: its provider ID and node name as asked.
    pub lookup: LookupKey,
    /// The answer.
    pub result: Result<T>,
}

impl<T> Answered<T> {
    /// The answer `result` to `lookup`.
    pub fn to(lookup: &InstanceLookup, result: Result<T>) -> Self {
        Self { lookup: Self::key(lookup), result }
    }

    /// The answer `result` for route target `target` (ResolveRouteTables).
    pub fn for_target(target: &RouteTarget, result: Result<T>) -> Self {
        Self { lookup: Self::target_key(target), result }
    }

    /// The name of `lookup`.
    pub fn key(lookup: &InstanceLookup) -> LookupKey {
        LookupKey { provider_id: lookup.provider_id.clone(), node_name: lookup.node_name.clone() }
    }

    /// The name of route target `target`.
    pub fn target_key(target: &RouteTarget) -> LookupKey {
        LookupKey { provider_id: target.provider_id.clone(), node_name: target.node_name.clone() }
    }
}

/// Whether the plugin can serve now (the answer of `Probe`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// Ready.
    Ready,
    /// Not ready, and why.
    NotReady(String),
}

/// Readiness of the whole plugin. The default is always ready.
#[tonic::async_trait]
pub trait Probe: Send + Sync + 'static {
    /// Checks readiness cheaply (no rate-limited cloud call on every probe).
    async fn probe(&self) -> Result<Readiness>;
}

/// InstancesService. Only [`Instances::instance_metadata`] and [`Instances::list_instances`]
/// are required; the rest derive from them unless the cloud has something cheaper.
#[tonic::async_trait]
pub trait Instances: Send + Sync + 'static {
    /// Optional features; advertise `batch_reads` only when
    /// [`Instances::batch_instance_metadata`] is overridden with a real batch call.
    fn capabilities(&self) -> InstancesCapabilities {
        InstancesCapabilities::default()
    }

    /// How long the core may trust metadata, tags of instances and listings before asking
    /// again (the `cache_ttl` hint of every Instances answer). `None`: no hint.
    fn cache_ttl(&self) -> Option<std::time::Duration> {
        None
    }

    /// The instance, or `Ok(None)` when the cloud positively says it is not there. Never
    /// `Ok(None)` for a failure to ask. The lookup has a provider ID or a node name.
    async fn instance_metadata(&self, lookup: &InstanceLookup) -> Result<Option<InstanceMetadata>>;

    /// One page of the cluster's instances; see [`crate::page::paginate`].
    async fn list_instances(&self, page: &PageRequest) -> Result<Page<InstanceMetadata>>;

    /// Whether the instance exists; terminated instances do not.
    async fn instance_exists(&self, lookup: &InstanceLookup) -> Result<bool> {
        Ok(self.instance_metadata(lookup).await?.is_some_and(|m| m.state() != InstanceState::Terminated))
    }

    /// `None` when the instance does not exist, otherwise whether it is stopped.
    async fn instance_shutdown(&self, lookup: &InstanceLookup) -> Result<Option<bool>> {
        Ok(self
            .instance_metadata(lookup)
            .await?
            .filter(|m| m.state() != InstanceState::Terminated)
            .map(|m| m.state() == InstanceState::Stopped))
    }

    /// Many lookups at once, one answer per lookup, each naming its lookup (any order). The
    /// default reads one by one.
    async fn batch_instance_metadata(&self, lookups: &[InstanceLookup]) -> Result<Vec<Answered<Option<InstanceMetadata>>>> {
        let mut out = Vec::with_capacity(lookups.len());
        for lookup in lookups {
            out.push(Answered::to(lookup, self.instance_metadata(lookup).await));
        }
        Ok(out)
    }
}

/// TagsService.
#[tonic::async_trait]
pub trait Tags: Send + Sync + 'static {
    /// How long the core may trust an instance's tags (the `cache_ttl` hint). `None`: no hint.
    fn cache_ttl(&self) -> Option<std::time::Duration> {
        None
    }

    /// The instance's tags, or `Ok(None)` when it does not exist.
    async fn instance_tags(&self, lookup: &InstanceLookup) -> Result<Option<HashMap<String, String>>>;

    /// Many lookups at once, one answer per lookup, each naming its lookup (any order). The
    /// default reads one by one.
    async fn batch_instance_tags(&self, lookups: &[InstanceLookup]) -> Result<Vec<Answered<Option<HashMap<String, String>>>>> {
        let mut out = Vec::with_capacity(lookups.len());
        for lookup in lookups {
            out.push(Answered::to(lookup, self.instance_tags(lookup).await));
        }
        Ok(out)
    }

    /// Optional features: advertise `set_tags` with [`Tags::batch_set_instance_tags`].
    fn capabilities(&self) -> TagsCapabilities {
        TagsCapabilities::default()
    }

    /// BatchSetInstanceTags: for each update, sets its `set` tags and removes its `remove`
    /// keys, touching no other tag; one answer per update naming its instance, `Ok(false)`
    /// when the instance does not exist (nothing written). The SDK has checked that each
    /// instance comes once and no key is both set and removed. The default is UNIMPLEMENTED.
    async fn batch_set_instance_tags(&self, updates: &[InstanceTagsUpdate]) -> Result<Vec<Answered<bool>>> {
        let _ = updates;
        Err(crate::Error::Unimplemented { message: "BatchSetInstanceTags".into() })
    }
}

/// RoutesService. Names, CIDRs, targets and IPv6 support are validated before these run;
/// the table is the provider's to check (unknown: `Error::invalid_argument_because(
/// reason::UNKNOWN_ROUTE_TABLE, ..)`).
#[tonic::async_trait]
pub trait Routes: Send + Sync + 'static {
    /// Optional features.
    fn capabilities(&self) -> RoutesCapabilities {
        RoutesCapabilities::default()
    }

    /// How long the core may trust a ListRoutes answer (the `cache_ttl` hint). `None`: no hint.
    fn cache_ttl(&self) -> Option<std::time::Duration> {
        None
    }

    /// One page of route tables.
    async fn list_route_tables(&self, page: &PageRequest) -> Result<Page<RouteTable>>;

    /// One page of the cluster's routes in a table (`""` is the default table).
    async fn list_routes(&self, cluster_name: &str, table_id: &str, page: &PageRequest) -> Result<Page<Route>>;

    /// Creates the route; OK when it exists identically, ALREADY_EXISTS when it differs.
    async fn create_route(&self, cluster_name: &str, route: Route) -> Result<Route>;

    /// Deletes the route; OK when absent.
    async fn delete_route(&self, cluster_name: &str, table_id: &str, name: &str) -> Result<()>;

    /// The tables each target's routes go to. The default puts everything in the default
    /// table; override it when advertising `multiple_tables`.
    async fn resolve_route_tables(&self, targets: &[RouteTarget]) -> Result<Vec<Answered<Vec<String>>>> {
        let first = self.list_route_tables(&PageRequest::new(1, "")).await?;
        let table = first.items.first().map(|t| t.id.clone()).unwrap_or_default();
        Ok(targets.iter().map(|t| Answered::for_target(t, Ok(vec![table.clone()]))).collect())
    }

    /// ApplyRoutes: deletes, then creates, many routes of one table (`""` is the default
    /// table; every create's `table_id` is `table_id`), one result per item in order. Override
    /// it when advertising `bulk_apply`, with one cloud call (or a few) for the whole list; the
    /// default is a loop over [`Routes::delete_route`] and [`Routes::create_route`].
    async fn apply_routes(
        &self,
        cluster_name: &str,
        table_id: &str,
        deletes: &[String],
        creates: Vec<Route>,
    ) -> Result<AppliedRoutes> {
        let mut applied = AppliedRoutes::default();
        for name in deletes {
            applied.deletes.push(self.delete_route(cluster_name, table_id, name).await);
        }
        for route in creates {
            applied.creates.push(self.create_route(cluster_name, route).await);
        }
        Ok(applied)
    }
}

/// What an ApplyRoutes did: one result per delete and per create, in request order.
#[derive(Debug, Default)]
pub struct AppliedRoutes {
    /// One result per delete.
    pub deletes: Vec<Result<()>>,
    /// One result per create: the route as stored.
    pub creates: Vec<Result<Route>>,
}

/// LoadBalancersService. The name, ports, source ranges and requested IP are validated
/// (against [`LoadBalancers::capabilities`]) before these run.
#[tonic::async_trait]
pub trait LoadBalancers: Send + Sync + 'static {
    /// Naming limits.
    fn capabilities(&self) -> LoadBalancersCapabilities {
        LoadBalancersCapabilities::default()
    }

    /// The load balancer's status, or `Ok(None)` when it does not exist.
    async fn get_load_balancer(&self, service: &LoadBalancerService) -> Result<Option<LoadBalancerStatus>>;

    /// The backends the load balancer has in the cloud now, by Node name, when the provider
    /// can tell; `Ok(None)` when it cannot (the default). Asked after a GetLoadBalancer that
    /// found it, and sent with the answer (`GetLoadBalancerResponse.hosts`): the core gives
    /// the node set again when they drifted from it (a backend removed by hand). A provider
    /// that lists load balancers fills `LoadBalancerSummary.hosts` itself.
    async fn load_balancer_hosts(&self, service: &LoadBalancerService) -> Result<Option<Vec<String>>> {
        let _ = service;
        Ok(None)
    }

    /// Creates or updates the load balancer; idempotent.
    async fn ensure_load_balancer(&self, service: &LoadBalancerService, nodes: &[LoadBalancerNode])
    -> Result<LoadBalancerStatus>;

    /// Replaces the backend nodes; NOT_FOUND when the load balancer does not exist.
    async fn update_load_balancer_hosts(&self, service: &LoadBalancerService, nodes: &[LoadBalancerNode]) -> Result<()>;

    /// Deletes the load balancer; OK when absent.
    async fn ensure_load_balancer_deleted(&self, service: &LoadBalancerService) -> Result<()>;

    /// The cluster's load balancers, one page in a stable order, with the Service each was
    /// ensured for. Advertise it with `LoadBalancersCapabilities { list: true, .. }`; the
    /// default is UNIMPLEMENTED.
    async fn list_load_balancers(&self, cluster_name: &str, page: &PageRequest) -> Result<Page<LoadBalancerSummary>> {
        let _ = (cluster_name, page);
        Err(crate::Error::Unimplemented { message: "ListLoadBalancers".into() })
    }

    /// BatchUpdateLoadBalancerHosts: points every listed load balancer at `nodes`, one result
    /// per Service in order (NOT_FOUND for one that does not exist). Override it when
    /// advertising `bulk_update_hosts`, with one cloud call (or a few) for the whole list; the
    /// default is a loop over [`LoadBalancers::update_load_balancer_hosts`].
    async fn batch_update_load_balancer_hosts(
        &self,
        services: &[LoadBalancerService],
        nodes: &[LoadBalancerNode],
    ) -> Result<Vec<Result<()>>> {
        let mut results = Vec::with_capacity(services.len());
        for service in services {
            results.push(self.update_load_balancer_hosts(service, nodes).await);
        }
        Ok(results)
    }
}

/// NodeMetadataService, served by the kubelet-side plugin (see [`crate::node_plugin`]).
#[tonic::async_trait]
pub trait NodeMetadata: Send + Sync + 'static {
    /// What the local instance metadata service says. Set at least `instance_id` and
    /// `provider_id`; the kubelet-side client rejects an answer without them.
    async fn node_metadata(&self) -> Result<InstanceMetadata>;
}

/// ImageCredentialsService, served by the kubelet-side plugin beside [`NodeMetadata`].
#[tonic::async_trait]
pub trait ImageCredentials: Send + Sync + 'static {
    /// Credentials for pulling `request.image` (validated: a non-empty image reference with
    /// a registry host). No credentials for that registry is an answer with no entries, not
    /// an error. Never log the answer or `request.service_account_token`.
    async fn image_credentials(&self, request: &GetImageCredentialsRequest) -> Result<GetImageCredentialsResponse>;
}
