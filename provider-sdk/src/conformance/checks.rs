//! The suite's runner: the clients, the order of the checks and what gates each, the helpers
//! every check uses, and the cleanup. The checks themselves are one module per service, as
//! the protocol has them ([`identity`], [`instances`], [`tags`], [`routes`],
//! [`load_balancers`], [`node`]). Each returns `Ok(())`, `Err(Not::Fail(..))` or
//! `Err(Not::Skip(..))`.

mod identity;
mod instances;
mod load_balancers;
mod node;
mod routes;
mod tags;

use std::collections::{BTreeSet, HashSet};
use std::fmt::Debug;
use std::net::IpAddr;
use std::time::Duration;

use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use super::{CheckResult, Options, Outcome, Report};
use crate::metrics::code_name;
use crate::names::{NameLimits, load_balancer_name};
use crate::proto::identity_service_client::IdentityServiceClient;
use crate::proto::image_credentials_service_client::ImageCredentialsServiceClient;
use crate::proto::instances_service_client::InstancesServiceClient;
use crate::proto::load_balancers_service_client::LoadBalancersServiceClient;
use crate::proto::node_metadata_service_client::NodeMetadataServiceClient;
use crate::proto::routes_service_client::RoutesServiceClient;
use crate::proto::tags_service_client::TagsServiceClient;
use crate::proto::{self as pb, ServiceType};
use crate::server::valid_plugin_name;
use crate::validate::MAX_BATCH;
/// The core's own check of an address: a provider passes the suite only with addresses the
/// core accepts.
use ccm_protocol::answer::address as valid_address;

pub(super) enum Not {
    Fail(String),
    Skip(String),
}

type Check = Result<(), Not>;

fn fail(msg: impl Into<String>) -> Not {
    Not::Fail(msg.into())
}

fn skip(msg: impl Into<String>) -> Not {
    Not::Skip(msg.into())
}

fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Check {
    if cond { Ok(()) } else { Err(fail(msg())) }
}

trait Ctx<T> {
    fn ctx(self, what: &str) -> Result<T, Not>;
}

impl<T> Ctx<T> for Result<Response<T>, Status> {
    fn ctx(self, what: &str) -> Result<T, Not> {
        self.map(Response::into_inner).map_err(|s| fail(format!("{what}: {} {}", code_name(s.code()), s.message())))
    }
}

fn expect_code<T: Debug>(result: Result<Response<T>, Status>, want: Code, what: &str) -> Check {
    match result {
        Ok(r) => Err(fail(format!("{what}: expected {}, got OK {:?}", code_name(want), r.into_inner()))),
        Err(s) if s.code() == want => Ok(()),
        Err(s) => Err(fail(format!("{what}: expected {}, got {} {}", code_name(want), code_name(s.code()), s.message()))),
    }
}

fn by_provider_id(lookup: &pb::InstanceMetadata) -> pb::InstanceLookup {
    pb::InstanceLookup { provider_id: lookup.provider_id.clone(), ..Default::default() }
}

/// Batch results in the order of `lookups`, by the lookup each names (`lookup` of each
/// result): the core matches answers by name, never by position, so a result that names no
/// lookup, or leaves one unanswered, fails the check.
fn by_lookup<'r, R: Debug>(
    what: &str,
    lookups: &[pb::InstanceLookup],
    results: &'r [R],
    named: impl Fn(&R) -> Option<&pb::LookupKey>,
) -> Result<Vec<&'r R>, Not> {
    ensure(results.len() == lookups.len(), || format!("{what}: {} results for {} lookups", results.len(), lookups.len()))?;
    let mut taken = vec![false; results.len()];
    let mut out = Vec::with_capacity(lookups.len());
    for l in lookups {
        let found = results
            .iter()
            .enumerate()
            .find(|(i, r)| !taken[*i] && named(r).is_some_and(|k| k.provider_id == l.provider_id && k.node_name == l.node_name));
        let Some((i, r)) = found else {
            return Err(fail(format!(
                "{what}: no result names the lookup (node {:?}, providerID {:?}); results must echo their lookup in `lookup`: {results:?}",
                l.node_name, l.provider_id
            )));
        };
        taken[i] = true;
        out.push(r);
    }
    Ok(out)
}

/// Follows page tokens to the end, checking each page's size against `page_size`.
async fn all_pages<T>(
    what: &str,
    page_size: u32,
    mut fetch: impl AsyncFnMut(String) -> Result<(Vec<T>, String), Not>,
) -> Result<Vec<T>, Not> {
    let mut out = Vec::new();
    let mut token = String::new();
    for _ in 0..100_000 {
        let (items, next) = fetch(token).await?;
        if page_size > 0 && items.len() > page_size as usize {
            return Err(fail(format!("{what}: a page of {} items for page_size {page_size}", items.len())));
        }
        out.extend(items);
        if next.is_empty() {
            return Ok(out);
        }
        token = next;
    }
    Err(fail(format!("{what} never ended")))
}

/// An image reference of no real registry.
const IMAGE: &str = "registry.conformance.invalid/ccm/app:1.0";

pub(super) struct Suite<F> {
    opts: Options,
    identity: IdentityServiceClient<Channel>,
    instances: InstancesServiceClient<Channel>,
    tags: TagsServiceClient<Channel>,
    routes: RoutesServiceClient<Channel>,
    lbs: LoadBalancersServiceClient<Channel>,
    node_metadata: NodeMetadataServiceClient<Channel>,
    image_credentials: ImageCredentialsServiceClient<Channel>,
    health: HealthClient<Channel>,
    caps: pb::GetPluginCapabilitiesResponse,
    known: Vec<pb::InstanceMetadata>,
    /// ListInstances is implemented (else the instances come from `Options::instances`).
    can_list: bool,
    run_id: String,
    cidr_base: u32,
    /// Routes this run created: (table, name as answered, destination).
    created_routes: Vec<(String, String, String)>,
    created_lbs: Vec<pb::LoadBalancerService>,
    report: Report,
    on_result: F,
}

impl<F: FnMut(&CheckResult)> Suite<F> {
    pub(super) fn new(channel: Channel, opts: Options, on_result: F) -> Self {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let run_id = format!("{:08x}", nanos ^ std::process::id().rotate_left(16));
        Self {
            opts,
            identity: IdentityServiceClient::new(channel.clone()),
            instances: InstancesServiceClient::new(channel.clone()),
            tags: TagsServiceClient::new(channel.clone()),
            routes: RoutesServiceClient::new(channel.clone()),
            lbs: LoadBalancersServiceClient::new(channel.clone()),
            node_metadata: NodeMetadataServiceClient::new(channel.clone()),
            image_credentials: ImageCredentialsServiceClient::new(channel.clone()),
            health: HealthClient::new(channel),
            caps: Default::default(),
            known: Vec::new(),
            can_list: true,
            run_id,
            cidr_base: nanos % 400,
            created_routes: Vec::new(),
            created_lbs: Vec::new(),
            report: Report::default(),
            on_result,
        }
    }

    fn req<T>(&self, message: T) -> Request<T> {
        let mut r = Request::new(message);
        r.set_timeout(self.opts.call_timeout);
        r
    }

    fn record(&mut self, name: &str, result: Check) {
        let outcome = match result {
            Ok(()) => Outcome::Pass,
            Err(Not::Fail(why)) => Outcome::Fail(why),
            Err(Not::Skip(why)) => Outcome::Skip(why),
        };
        let result = CheckResult { name: name.to_string(), outcome };
        (self.on_result)(&result);
        self.report.results.push(result);
    }

    fn advertises(&self, service: ServiceType) -> bool {
        self.caps.services.contains(&(service as i32))
    }

    pub(super) async fn run(mut self) -> Report {
        macro_rules! check {
            ($name:expr, $call:expr) => {{
                let result = $call.await;
                self.record($name, result);
            }};
        }
        check!("identity.plugin-info", self.plugin_info());
        check!("identity.plugin-info-stable", self.plugin_info_stable());
        check!("identity.capabilities", self.capabilities());
        check!("identity.capabilities-stable", self.capabilities_stable());
        check!("identity.probe", self.probe());
        check!("identity.advertised-services-served", self.advertised_served());
        check!("health.serving", self.health_serving());

        let instances = self.advertises(ServiceType::Instances);
        let why = "InstancesService is not advertised";
        macro_rules! gated {
            ($on:expr, $why:expr, $name:expr, $call:expr) => {{
                if $on {
                    check!($name, $call);
                } else {
                    self.record($name, Err(skip($why)));
                }
            }};
        }
        gated!(instances, why, "instances.list", self.list_instances());
        gated!(instances, why, "instances.list-pagination", self.list_instances_pagination());
        gated!(instances, why, "instances.list-invalid-page-token", self.list_instances_bad_token());
        gated!(instances, why, "instances.deadline-honoured", self.deadline_honoured());
        gated!(instances, why, "instances.exists-known", self.exists_known());
        gated!(instances, why, "instances.exists-unknown-provider-id", self.exists_unknown_provider_id());
        gated!(instances, why, "instances.exists-unknown-node-name", self.exists_unknown_node_name());
        gated!(instances, why, "instances.exists-empty-lookup", self.exists_empty_lookup());
        gated!(instances, why, "instances.shutdown-known", self.shutdown_known());
        gated!(instances, why, "instances.shutdown-unknown", self.shutdown_unknown());
        gated!(instances, why, "instances.metadata-known", self.metadata_known());
        gated!(instances, why, "instances.metadata-by-node-name", self.metadata_by_node_name());
        gated!(instances, why, "instances.metadata-unknown", self.metadata_unknown());
        gated!(instances, why, "instances.metadata-empty-lookup", self.metadata_empty_lookup());
        gated!(instances, why, "instances.cache-hint", self.cache_hint());
        gated!(instances, why, "instances.batch-mixed", self.batch_mixed());
        gated!(instances, why, "instances.batch-matches-single", self.batch_matches_single());
        gated!(instances, why, "instances.batch-too-large", self.batch_too_large());
        gated!(instances, why, "instances.pod-cidrs", self.pod_cidrs());

        let tags = self.advertises(ServiceType::Tags);
        let why = "TagsService is not advertised";
        gated!(tags, why, "tags.known", self.tags_known());
        gated!(tags, why, "tags.unknown", self.tags_unknown());
        gated!(tags, why, "tags.empty-lookup", self.tags_empty_lookup());
        gated!(tags, why, "tags.batch-matches-single", self.tags_batch());
        gated!(tags, why, "tags.in-metadata", self.tags_in_metadata());
        gated!(tags, why, "tags.set-update-remove", self.tags_set());

        let routes = self.advertises(ServiceType::Routes);
        let why = "RoutesService is not advertised";
        gated!(routes, why, "routes.list-tables", self.list_tables());
        gated!(routes, why, "routes.list-tables-pagination", self.list_tables_pagination());
        gated!(routes, why, "routes.list-unknown-table", self.list_routes_unknown_table());
        gated!(routes, why, "routes.list-invalid-page-token", self.list_routes_bad_token());
        gated!(routes, why, "routes.create", self.create_route());
        gated!(routes, why, "routes.create-idempotent", self.create_route_again());
        gated!(routes, why, "routes.create-conflict", self.create_route_conflict());
        gated!(routes, why, "routes.create-empty-name", self.create_route_empty_name());
        gated!(routes, why, "routes.create-malformed-cidr", self.create_route_bad_cidr());
        gated!(routes, why, "routes.create-unknown-table", self.create_route_unknown_table());
        gated!(routes, why, "routes.create-ipv6", self.create_route_ipv6());
        gated!(routes, why, "routes.list-pagination", self.list_routes_pagination());
        gated!(routes, why, "routes.cluster-isolation", self.routes_cluster_isolation());
        gated!(routes, why, "routes.delete", self.delete_route());
        gated!(routes, why, "routes.delete-idempotent", self.delete_route_again());
        gated!(routes, why, "routes.delete-absent", self.delete_route_absent());
        gated!(routes, why, "routes.resolve-tables", self.resolve_tables());
        gated!(routes, why, "routes.bulk-apply", self.bulk_apply());
        gated!(routes, why, "routes.bulk-apply-too-large", self.bulk_apply_too_large());
        gated!(routes, why, "routes.quota", self.route_quota());

        let lbs = self.advertises(ServiceType::LoadBalancers);
        let why = "LoadBalancersService is not advertised";
        gated!(lbs, why, "load-balancers.get-absent", self.lb_get_absent());
        gated!(lbs, why, "load-balancers.ensure", self.lb_ensure());
        gated!(lbs, why, "load-balancers.ensure-idempotent", self.lb_ensure_again());
        gated!(lbs, why, "load-balancers.get-present", self.lb_get_present());
        gated!(lbs, why, "load-balancers.other-services-name", self.lb_other_services_name());
        gated!(lbs, why, "load-balancers.update-hosts", self.lb_update_hosts());
        gated!(lbs, why, "load-balancers.hosts-reported", self.lb_hosts_reported());
        gated!(lbs, why, "load-balancers.list", self.lb_list());
        gated!(lbs, why, "load-balancers.update-hosts-absent", self.lb_update_hosts_absent());
        gated!(lbs, why, "load-balancers.bulk-update-hosts", self.lb_bulk_update_hosts());
        gated!(lbs, why, "load-balancers.ensure-empty-name", self.lb_empty_name());
        gated!(lbs, why, "load-balancers.ensure-name-too-long", self.lb_name_too_long());
        gated!(lbs, why, "load-balancers.ensure-no-ports", self.lb_no_ports());
        gated!(lbs, why, "load-balancers.ensure-bad-source-range", self.lb_bad_source_range());
        gated!(lbs, why, "load-balancers.sdk-name-accepted", self.lb_sdk_name());
        gated!(lbs, why, "load-balancers.delete", self.lb_delete());
        gated!(lbs, why, "load-balancers.delete-idempotent", self.lb_delete_again());
        gated!(lbs, why, "load-balancers.delete-absent", self.lb_delete_absent());

        let nm = self.advertises(ServiceType::NodeMetadata);
        let why = "NodeMetadataService is not advertised";
        gated!(nm, why, "node-metadata.get", self.node_metadata_get());
        gated!(nm, why, "node-metadata.matches-instances", self.node_metadata_matches());

        let ic = self.advertises(ServiceType::ImageCredentials);
        let why = "ImageCredentialsService is not advertised";
        gated!(ic, why, "image-credentials.answer", self.image_credentials_answer());
        gated!(ic, why, "image-credentials.invalid-image", self.image_credentials_invalid());

        self.cleanup().await;
        self.report
    }

    /// Retries `probe` until it holds or the consistency timeout passes.
    async fn eventually<T>(&self, mut probe: impl AsyncFnMut() -> Result<T, Not>) -> Result<T, Not> {
        let deadline = Instant::now() + self.opts.consistency_timeout;
        loop {
            match probe().await {
                Ok(v) => return Ok(v),
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// Deletes what this run created, whatever the checks left behind.
    async fn cleanup(&mut self) {
        for (table, name, _) in std::mem::take(&mut self.created_routes) {
            if let Err(Not::Fail(why)) = self.delete(&table, &name).await {
                tracing::warn!(route = %name, %why, "cleanup failed");
            }
        }
        for service in std::mem::take(&mut self.created_lbs) {
            if let Err(Not::Fail(why)) = self.delete_lb(service.clone()).await {
                tracing::warn!(load_balancer = %service.load_balancer_name, %why, "cleanup failed");
            }
        }
    }
}
