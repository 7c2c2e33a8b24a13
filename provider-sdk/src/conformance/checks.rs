//! The checks. Each returns `Ok(())`, `Err(Not::Fail(..))` or `Err(Not::Skip(..))`.

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

fn valid_address(a: &pb::NodeAddress) -> Result<(), String> {
    use pb::NodeAddressType as T;
    match a.r#type() {
        T::Unspecified => Err(format!("address {:?} has no type", a.address)),
        T::InternalIp | T::ExternalIp if a.address.parse::<IpAddr>().is_err() => {
            Err(format!("address {:?} of an IP type is not an IP", a.address))
        }
        _ if a.address.is_empty() => Err("empty address".into()),
        _ => Ok(()),
    }
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

        let tags = self.advertises(ServiceType::Tags);
        let why = "TagsService is not advertised";
        gated!(tags, why, "tags.known", self.tags_known());
        gated!(tags, why, "tags.unknown", self.tags_unknown());
        gated!(tags, why, "tags.empty-lookup", self.tags_empty_lookup());
        gated!(tags, why, "tags.batch-matches-single", self.tags_batch());

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
        gated!(routes, why, "routes.quota", self.route_quota());

        let lbs = self.advertises(ServiceType::LoadBalancers);
        let why = "LoadBalancersService is not advertised";
        gated!(lbs, why, "load-balancers.get-absent", self.lb_get_absent());
        gated!(lbs, why, "load-balancers.ensure", self.lb_ensure());
        gated!(lbs, why, "load-balancers.ensure-idempotent", self.lb_ensure_again());
        gated!(lbs, why, "load-balancers.get-present", self.lb_get_present());
        gated!(lbs, why, "load-balancers.update-hosts", self.lb_update_hosts());
        gated!(lbs, why, "load-balancers.list", self.lb_list());
        gated!(lbs, why, "load-balancers.update-hosts-absent", self.lb_update_hosts_absent());
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

    // === identity ===

    async fn plugin_info(&mut self) -> Check {
        let info = self.identity.clone().get_plugin_info(self.req(pb::GetPluginInfoRequest {})).await.ctx("GetPluginInfo")?;
        ensure(valid_plugin_name(&info.name), || format!("plugin name {:?} breaks the naming rule", info.name))?;
        let semver = info.vendor_version.split(['-', '+']).next().unwrap_or_default();
        let parts: Vec<&str> = semver.split('.').collect();
        ensure(parts.len() == 3 && parts.iter().all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit())), || {
            format!("vendor_version {:?} is not semantic versioning", info.vendor_version)
        })
    }

    async fn plugin_info_stable(&mut self) -> Check {
        let a = self.identity.clone().get_plugin_info(self.req(pb::GetPluginInfoRequest {})).await.ctx("GetPluginInfo")?;
        let b = self.identity.clone().get_plugin_info(self.req(pb::GetPluginInfoRequest {})).await.ctx("GetPluginInfo")?;
        ensure(a == b, || format!("two answers differ: {a:?} then {b:?}"))
    }

    async fn capabilities(&mut self) -> Check {
        let caps = self
            .identity
            .clone()
            .get_plugin_capabilities(self.req(pb::GetPluginCapabilitiesRequest {}))
            .await
            .ctx("GetPluginCapabilities")?;
        self.caps = caps.clone();
        let mut seen = HashSet::new();
        for s in &caps.services {
            match ServiceType::try_from(*s) {
                Ok(ServiceType::Unspecified) | Err(_) => return Err(fail(format!("service value {s} is not a known service"))),
                Ok(_) => ensure(seen.insert(*s), || format!("service {s} advertised twice"))?,
            }
        }
        ensure(caps.routes.is_none() || self.advertises(ServiceType::Routes), || {
            "routes features advertised without RoutesService".into()
        })?;
        ensure(caps.load_balancers.is_none() || self.advertises(ServiceType::LoadBalancers), || {
            "load balancer features advertised without LoadBalancersService".into()
        })
    }

    async fn capabilities_stable(&mut self) -> Check {
        for _ in 0..3 {
            let again = self
                .identity
                .clone()
                .get_plugin_capabilities(self.req(pb::GetPluginCapabilitiesRequest {}))
                .await
                .ctx("GetPluginCapabilities")?;
            ensure(again == self.caps, || format!("capabilities changed: {:?} then {again:?}", self.caps))?;
        }
        Ok(())
    }

    async fn probe(&mut self) -> Check {
        let p = self.identity.clone().probe(self.req(pb::ProbeRequest {})).await.ctx("Probe")?;
        ensure(p.ready, || format!("Probe says not ready: {}", p.message))
    }

    async fn advertised_served(&mut self) -> Check {
        let unimplemented = |r: Result<(), Status>, what: &str| match r {
            Err(s) if s.code() == Code::Unimplemented => Err(fail(format!("{what} is advertised but answers UNIMPLEMENTED"))),
            _ => Ok(()),
        };
        let probe_id = pb::InstanceLookup { node_name: format!("ccm-conformance-absent-{}", self.run_id), ..Default::default() };
        if self.advertises(ServiceType::Instances) {
            let r = self
                .instances
                .clone()
                .instance_exists(self.req(pb::InstanceExistsRequest { instance: Some(probe_id.clone()) }))
                .await;
            unimplemented(r.map(|_| ()), "InstancesService")?;
        }
        if self.advertises(ServiceType::Tags) {
            let r = self
                .tags
                .clone()
                .get_instance_tags(self.req(pb::GetInstanceTagsRequest { instance: Some(probe_id.clone()) }))
                .await;
            unimplemented(r.map(|_| ()), "TagsService")?;
        }
        if self.advertises(ServiceType::Routes) {
            let r = self.routes.clone().list_route_tables(self.req(pb::ListRouteTablesRequest::default())).await;
            unimplemented(r.map(|_| ()), "RoutesService")?;
        }
        if self.advertises(ServiceType::LoadBalancers) {
            let r = self
                .lbs
                .clone()
                .get_load_balancer(self.req(pb::GetLoadBalancerRequest { service: Some(self.lb_service("absent")) }))
                .await;
            unimplemented(r.map(|_| ()), "LoadBalancersService")?;
        }
        if self.advertises(ServiceType::NodeMetadata) {
            let r = self.node_metadata.clone().get_node_metadata(self.req(pb::GetNodeMetadataRequest {})).await;
            unimplemented(r.map(|_| ()), "NodeMetadataService")?;
        }
        if self.advertises(ServiceType::ImageCredentials) {
            let request = pb::GetImageCredentialsRequest { image: IMAGE.into(), ..Default::default() };
            let r = self.image_credentials.clone().get_image_credentials(self.req(request)).await;
            unimplemented(r.map(|_| ()), "ImageCredentialsService")?;
        }
        Ok(())
    }

    async fn health_serving(&mut self) -> Check {
        let request = self.req(tonic_health::pb::HealthCheckRequest { service: String::new() });
        match self.health.clone().check(request).await {
            Ok(r) => {
                ensure(r.get_ref().status() == ServingStatus::Serving, || format!("health status {:?}", r.get_ref().status()))
            }
            Err(s) if s.code() == Code::Unimplemented => Err(skip("grpc.health.v1 is not served (optional)")),
            Err(s) => Err(fail(format!("Health/Check: {} {}", code_name(s.code()), s.message()))),
        }
    }

    // === instances ===

    async fn list_all_instances(&self, page_size: u32) -> Result<Vec<pb::InstanceMetadata>, Not> {
        all_pages("ListInstances", page_size, async |page_token| {
            let page = self.instances.clone().list_instances(self.req(pb::ListInstancesRequest { page_size, page_token })).await;
            page.ctx("ListInstances").map(|p| (p.instances, p.next_page_token))
        })
        .await
    }

    async fn list_instances(&mut self) -> Check {
        let first = self.instances.clone().list_instances(self.req(pb::ListInstancesRequest::default())).await;
        if matches!(&first, Err(s) if s.code() == Code::Unimplemented) {
            self.can_list = false;
            return self.named_instances().await;
        }
        let all = self.list_all_instances(0).await?;
        let info = self.identity.clone().get_plugin_info(self.req(pb::GetPluginInfoRequest {})).await.ctx("GetPluginInfo")?;
        for i in &all {
            let scheme = &info.provider_id_scheme;
            ensure(scheme.is_empty() || i.provider_id.starts_with(&format!("{scheme}://")), || {
                format!("providerID {} lacks the advertised scheme {scheme}://", i.provider_id)
            })?;
            ensure(!i.provider_id.is_empty() && !i.instance_id.is_empty(), || format!("listed instance without ids: {i:?}"))?;
            ensure(i.state() != pb::InstanceState::Terminated, || format!("terminated instance {} is listed", i.provider_id))?;
            for a in &i.addresses {
                valid_address(a).map_err(|e| fail(format!("instance {}: {e}", i.provider_id)))?;
            }
        }
        self.known = all;
        Ok(())
    }

    /// For a provider that cannot list: the instances named in the options, each read with
    /// InstanceMetadata, become the known instances.
    async fn named_instances(&mut self) -> Check {
        let why = "ListInstances is UNIMPLEMENTED (the provider cannot list instances)";
        if self.opts.instances.is_empty() {
            return Err(skip(format!(
                "{why}; name existing instances with --instance NODE_NAME to run the checks that need them"
            )));
        }
        let mut known = Vec::new();
        for name in self.opts.instances.clone() {
            let lookup = pb::InstanceLookup { node_name: name.clone(), ..Default::default() };
            let answer = self
                .instances
                .clone()
                .instance_metadata(self.req(pb::InstanceMetadataRequest { instance: Some(lookup) }))
                .await
                .ctx("InstanceMetadata")?;
            let meta =
                answer.metadata.filter(|_| answer.exists).ok_or_else(|| fail(format!("--instance {name}: no such instance")))?;
            ensure(!meta.provider_id.is_empty(), || format!("--instance {name}: no providerID in the answer"))?;
            known.push(pb::InstanceMetadata { node_name: name, ..meta });
        }
        self.known = known;
        Err(skip(format!("{why}; the checks use the {} instances given with --instance", self.known.len())))
    }

    async fn list_instances_pagination(&mut self) -> Check {
        if !self.can_list {
            return Err(skip("ListInstances is UNIMPLEMENTED"));
        }
        if self.known.len() < 2 {
            return Err(skip("fewer than two instances listed"));
        }
        let want: BTreeSet<String> = self.known.iter().map(|i| i.provider_id.clone()).collect();
        ensure(want.len() == self.known.len(), || "the default listing repeats an instance".into())?;
        for size in [1, 2, 3, 7] {
            let got = self.list_all_instances(size).await?;
            let ids: Vec<String> = got.iter().map(|i| i.provider_id.clone()).collect();
            let set: BTreeSet<String> = ids.iter().cloned().collect();
            ensure(set.len() == ids.len(), || format!("page size {size}: an instance is repeated across pages"))?;
            ensure(set == want, || format!("page size {size}: listed {} instances, expected {}", set.len(), want.len()))?;
        }
        Ok(())
    }

    async fn list_instances_bad_token(&mut self) -> Check {
        if !self.can_list {
            return Err(skip("ListInstances is UNIMPLEMENTED"));
        }
        let r = self
            .instances
            .clone()
            .list_instances(self.req(pb::ListInstancesRequest { page_size: 1, page_token: "ccm-conformance-not-a-token".into() }))
            .await;
        expect_code(r, Code::InvalidArgument, "ListInstances with a foreign page token")
    }

    async fn deadline_honoured(&mut self) -> Check {
        let deadline = Duration::from_millis(50);
        let start = Instant::now();
        // The client stops waiting too, so this bounds a provider that ignores the deadline.
        let r = if self.can_list {
            let mut request = Request::new(pb::ListInstancesRequest { page_size: 0, page_token: String::new() });
            request.set_timeout(deadline);
            tokio::time::timeout(Duration::from_secs(5), self.instances.clone().list_instances(request))
                .await
                .map(|r| r.map(|_| ()))
        } else {
            let lookup = self.first_known().map_err(|_| skip("ListInstances is UNIMPLEMENTED and no --instance is named"))?;
            let lookup =
                pb::InstanceLookup { node_name: lookup.node_name, provider_id: lookup.provider_id, ..Default::default() };
            let mut request = Request::new(pb::InstanceMetadataRequest { instance: Some(lookup) });
            request.set_timeout(deadline);
            tokio::time::timeout(Duration::from_secs(5), self.instances.clone().instance_metadata(request))
                .await
                .map(|r| r.map(|_| ()))
        };
        let took = start.elapsed();
        match r {
            Err(_) => Err(fail("a call with a 50 ms deadline was not answered within 5 s")),
            Ok(Ok(_)) => {
                ensure(took <= deadline + Duration::from_millis(500), || format!("answered OK after {took:?}, past its deadline"))
            }
            Ok(Err(s)) if matches!(s.code(), Code::DeadlineExceeded | Code::Cancelled) => {
                ensure(took <= deadline + Duration::from_secs(1), || format!("deadline answered only after {took:?}"))
            }
            Ok(Err(s)) => Err(fail(format!("expected OK or DEADLINE_EXCEEDED, got {} {}", code_name(s.code()), s.message()))),
        }
    }

    fn first_known(&self) -> Result<pb::InstanceMetadata, Not> {
        self.known
            .iter()
            .find(|i| i.state() == pb::InstanceState::Running)
            .or_else(|| self.known.first())
            .cloned()
            .ok_or_else(|| skip("no instance is listed"))
    }

    fn unknown_by_id(&self) -> Result<pb::InstanceLookup, Not> {
        // A well-formed providerID of this provider that names no instance.
        let known = self.first_known()?;
        Ok(pb::InstanceLookup { provider_id: format!("{}-ccm-conformance-absent", known.provider_id), ..Default::default() })
    }

    fn unknown_by_name(&self) -> pb::InstanceLookup {
        pb::InstanceLookup { node_name: format!("ccm-conformance-absent-{}", self.run_id), ..Default::default() }
    }

    async fn exists_known(&mut self) -> Check {
        let known = self.first_known()?;
        let r = self
            .instances
            .clone()
            .instance_exists(self.req(pb::InstanceExistsRequest { instance: Some(by_provider_id(&known)) }))
            .await;
        ensure(r.ctx("InstanceExists")?.exists, || format!("listed instance {} does not exist", known.provider_id))
    }

    async fn exists_unknown_provider_id(&mut self) -> Check {
        let lookup = self.unknown_by_id()?;
        let r =
            self.instances.clone().instance_exists(self.req(pb::InstanceExistsRequest { instance: Some(lookup.clone()) })).await;
        ensure(!r.ctx("InstanceExists of an unknown providerID (must be OK with exists=false)")?.exists, || {
            format!("{} exists", lookup.provider_id)
        })
    }

    async fn exists_unknown_node_name(&mut self) -> Check {
        let lookup = self.unknown_by_name();
        let r =
            self.instances.clone().instance_exists(self.req(pb::InstanceExistsRequest { instance: Some(lookup.clone()) })).await;
        ensure(!r.ctx("InstanceExists of an unknown node name (must be OK with exists=false)")?.exists, || {
            format!("{} exists", lookup.node_name)
        })
    }

    async fn exists_empty_lookup(&mut self) -> Check {
        let r = self
            .instances
            .clone()
            .instance_exists(self.req(pb::InstanceExistsRequest { instance: Some(Default::default()) }))
            .await;
        expect_code(r, Code::InvalidArgument, "InstanceExists with an empty lookup")
    }

    async fn shutdown_known(&mut self) -> Check {
        let known = self.first_known()?;
        let r = self
            .instances
            .clone()
            .instance_shutdown(self.req(pb::InstanceShutdownRequest { instance: Some(by_provider_id(&known)) }))
            .await
            .ctx("InstanceShutdown")?;
        ensure(r.exists, || format!("listed instance {} does not exist", known.provider_id))?;
        let stopped = known.state() == pb::InstanceState::Stopped;
        ensure(r.shutdown == stopped, || format!("shutdown={} but the listing says state {:?}", r.shutdown, known.state()))
    }

    async fn shutdown_unknown(&mut self) -> Check {
        let lookup = self.unknown_by_id()?;
        let r = self
            .instances
            .clone()
            .instance_shutdown(self.req(pb::InstanceShutdownRequest { instance: Some(lookup) }))
            .await
            .ctx("InstanceShutdown of an unknown instance")?;
        ensure(!r.exists, || "an unknown instance exists".into())
    }

    async fn metadata_known(&mut self) -> Check {
        let known = self.first_known()?;
        for _ in 0..2 {
            let r = self
                .instances
                .clone()
                .instance_metadata(self.req(pb::InstanceMetadataRequest { instance: Some(by_provider_id(&known)) }))
                .await
                .ctx("InstanceMetadata")?;
            ensure(r.exists, || format!("listed instance {} does not exist", known.provider_id))?;
            let m = r.metadata.ok_or_else(|| fail("exists=true without metadata"))?;
            ensure(m.provider_id == known.provider_id, || {
                format!("providerID {} for lookup {}", m.provider_id, known.provider_id)
            })?;
            ensure(m.instance_type == known.instance_type && m.zone == known.zone, || {
                format!("metadata {m:?} disagrees with the listing {known:?}")
            })?;
            for a in &m.addresses {
                valid_address(a).map_err(fail)?;
            }
        }
        Ok(())
    }

    async fn metadata_by_node_name(&mut self) -> Check {
        let known = self
            .known
            .iter()
            .find(|i| !i.node_name.is_empty())
            .cloned()
            .ok_or_else(|| skip("no listed instance has a node name"))?;
        let lookup = pb::InstanceLookup { node_name: known.node_name.clone(), ..Default::default() };
        let r = self
            .instances
            .clone()
            .instance_metadata(self.req(pb::InstanceMetadataRequest { instance: Some(lookup) }))
            .await
            .ctx("InstanceMetadata by node name")?;
        let m = r.metadata.filter(|_| r.exists).ok_or_else(|| fail(format!("node {} not found by name", known.node_name)))?;
        ensure(m.provider_id == known.provider_id, || {
            format!("node {} resolved to {}, listed as {}", known.node_name, m.provider_id, known.provider_id)
        })
    }

    async fn metadata_unknown(&mut self) -> Check {
        let lookup = self.unknown_by_id()?;
        let r = self
            .instances
            .clone()
            .instance_metadata(self.req(pb::InstanceMetadataRequest { instance: Some(lookup) }))
            .await
            .ctx("InstanceMetadata of an unknown instance (must be OK with exists=false)")?;
        ensure(!r.exists && r.metadata.is_none(), || format!("an unknown instance has metadata: {r:?}"))
    }

    async fn metadata_empty_lookup(&mut self) -> Check {
        let r = self.instances.clone().instance_metadata(self.req(pb::InstanceMetadataRequest { instance: None })).await;
        expect_code(r, Code::InvalidArgument, "InstanceMetadata without a lookup")
    }

    async fn cache_hint(&mut self) -> Check {
        let known = self.first_known()?;
        let r = self
            .instances
            .clone()
            .instance_metadata(self.req(pb::InstanceMetadataRequest { instance: Some(by_provider_id(&known)) }))
            .await
            .ctx("InstanceMetadata")?;
        match r.cache_ttl {
            None => Ok(()),
            Some(ttl) => ensure(ttl.seconds >= 0 && ttl.nanos >= 0 && ttl.seconds <= 86_400, || {
                format!("cache_ttl {ttl:?} is negative or longer than a day")
            }),
        }
    }

    async fn batch_mixed(&mut self) -> Check {
        let known = self.first_known()?;
        let lookups = vec![by_provider_id(&known), self.unknown_by_id()?, pb::InstanceLookup::default()];
        let r = self
            .instances
            .clone()
            .batch_instance_metadata(self.req(pb::BatchInstanceMetadataRequest { instances: lookups }))
            .await
            .ctx("BatchInstanceMetadata")?;
        ensure(r.results.len() == 3, || format!("{} results for 3 lookups", r.results.len()))?;
        let (a, b, c) = (&r.results[0], &r.results[1], &r.results[2]);
        ensure(a.exists && a.error.is_none() && a.metadata.as_ref().is_some_and(|m| m.provider_id == known.provider_id), || {
            format!("known instance answered {a:?}")
        })?;
        ensure(!b.exists && b.error.is_none(), || format!("unknown instance answered {b:?} (want exists=false, no error)"))?;
        ensure(c.error.as_ref().is_some_and(|e| e.code == Code::InvalidArgument as i32), || {
            format!("empty lookup answered {c:?} (want an INVALID_ARGUMENT item error)")
        })
    }

    async fn batch_matches_single(&mut self) -> Check {
        if self.known.is_empty() {
            return Err(skip("no instance is listed"));
        }
        let sample: Vec<pb::InstanceMetadata> = self.known.iter().take(10).cloned().collect();
        let lookups: Vec<pb::InstanceLookup> = sample.iter().map(by_provider_id).collect();
        let r = self
            .instances
            .clone()
            .batch_instance_metadata(self.req(pb::BatchInstanceMetadataRequest { instances: lookups.clone() }))
            .await
            .ctx("BatchInstanceMetadata")?;
        ensure(r.results.len() == lookups.len(), || format!("{} results for {} lookups", r.results.len(), lookups.len()))?;
        for (lookup, batch) in lookups.into_iter().zip(r.results) {
            let single = self
                .instances
                .clone()
                .instance_metadata(self.req(pb::InstanceMetadataRequest { instance: Some(lookup.clone()) }))
                .await
                .ctx("InstanceMetadata")?;
            ensure(batch.error.is_none() && batch.exists == single.exists && batch.metadata == single.metadata, || {
                format!("{}: batch {batch:?} differs from single {single:?}", lookup.provider_id)
            })?;
        }
        Ok(())
    }

    async fn batch_too_large(&mut self) -> Check {
        let lookups = vec![self.unknown_by_name(); MAX_BATCH + 1];
        let r = self
            .instances
            .clone()
            .batch_instance_metadata(self.req(pb::BatchInstanceMetadataRequest { instances: lookups }))
            .await;
        expect_code(r, Code::InvalidArgument, "BatchInstanceMetadata of 501 lookups")
    }

    // === tags ===

    async fn tags_known(&mut self) -> Check {
        let known = self.first_known()?;
        let r = self
            .tags
            .clone()
            .get_instance_tags(self.req(pb::GetInstanceTagsRequest { instance: Some(by_provider_id(&known)) }))
            .await
            .ctx("GetInstanceTags")?;
        ensure(r.exists, || format!("listed instance {} has no tags answer", known.provider_id))?;
        ensure(r.tags.keys().all(|k| !k.is_empty()), || "a tag has an empty key".into())
    }

    async fn tags_unknown(&mut self) -> Check {
        let r = self
            .tags
            .clone()
            .get_instance_tags(self.req(pb::GetInstanceTagsRequest { instance: Some(self.unknown_by_name()) }))
            .await
            .ctx("GetInstanceTags of an unknown instance (must be OK with exists=false)")?;
        ensure(!r.exists, || "an unknown instance has tags".into())
    }

    async fn tags_empty_lookup(&mut self) -> Check {
        let r = self.tags.clone().get_instance_tags(self.req(pb::GetInstanceTagsRequest { instance: None })).await;
        expect_code(r, Code::InvalidArgument, "GetInstanceTags without a lookup")
    }

    async fn tags_batch(&mut self) -> Check {
        if self.known.is_empty() {
            return Err(skip("no instance is listed"));
        }
        let lookups: Vec<pb::InstanceLookup> = self.known.iter().take(10).map(by_provider_id).collect();
        let r = self
            .tags
            .clone()
            .batch_get_instance_tags(self.req(pb::BatchGetInstanceTagsRequest { instances: lookups.clone() }))
            .await
            .ctx("BatchGetInstanceTags")?;
        ensure(r.results.len() == lookups.len(), || format!("{} results for {} lookups", r.results.len(), lookups.len()))?;
        for (lookup, batch) in lookups.into_iter().zip(r.results) {
            let single = self
                .tags
                .clone()
                .get_instance_tags(self.req(pb::GetInstanceTagsRequest { instance: Some(lookup.clone()) }))
                .await
                .ctx("GetInstanceTags")?;
            ensure(batch.error.is_none() && batch.exists == single.exists && batch.tags == single.tags, || {
                format!("{}: batch {batch:?} differs from single {single:?}", lookup.provider_id)
            })?;
        }
        Ok(())
    }

    // === routes ===

    fn cluster(&self) -> String {
        format!("ccm-conformance-{}", self.run_id)
    }

    fn cidr(&self, i: u32) -> String {
        let n = (self.cidr_base + i) % 512;
        format!("198.{}.{}.0/24", 18 + n / 256, n % 256)
    }

    fn route(&self, suffix: &str, cidr: String) -> Result<pb::Route, Not> {
        let target = self.first_known().map_err(|_| skip("routes need a listed instance to point at"))?;
        Ok(pb::Route {
            name: format!("ccm-conformance-{}-{suffix}", self.run_id),
            target: Some(pb::RouteTarget { node_name: target.node_name.clone(), provider_id: target.provider_id }),
            destination_cidr: cidr,
            table_id: String::new(),
            blackhole: false,
            target_addresses: Vec::new(),
        })
    }

    async fn list_all_tables(&self, page_size: u32) -> Result<Vec<pb::RouteTable>, Not> {
        all_pages("ListRouteTables", page_size, async |page_token| {
            let page =
                self.routes.clone().list_route_tables(self.req(pb::ListRouteTablesRequest { page_size, page_token })).await;
            page.ctx("ListRouteTables").map(|p| (p.tables, p.next_page_token))
        })
        .await
    }

    async fn list_all_routes(&self, cluster: &str, table_id: &str, page_size: u32) -> Result<Vec<pb::Route>, Not> {
        all_pages("ListRoutes", page_size, async |page_token| {
            let request = pb::ListRoutesRequest {
                cluster_name: cluster.to_string(),
                table_id: table_id.to_string(),
                page_size,
                page_token,
            };
            let page = self.routes.clone().list_routes(self.req(request)).await;
            page.ctx("ListRoutes").map(|p| (p.routes, p.next_page_token))
        })
        .await
    }

    async fn list_tables(&mut self) -> Check {
        let tables = self.list_all_tables(0).await?;
        ensure(!tables.is_empty(), || "no route table listed".into())?;
        let ids: HashSet<&str> = tables.iter().map(|t| t.id.as_str()).collect();
        ensure(ids.len() == tables.len() && !ids.contains(""), || format!("table ids are empty or repeated: {tables:?}"))?;
        let multiple = self.caps.routes.as_ref().is_some_and(|r| r.multiple_tables);
        ensure(multiple || tables.len() == 1, || format!("{} tables listed without advertising multiple_tables", tables.len()))
    }

    async fn list_tables_pagination(&mut self) -> Check {
        let all: Vec<String> = self.list_all_tables(0).await?.into_iter().map(|t| t.id).collect();
        let paged: Vec<String> = self.list_all_tables(1).await?.into_iter().map(|t| t.id).collect();
        let set: BTreeSet<&String> = paged.iter().collect();
        ensure(set.len() == paged.len(), || "a table is repeated across pages".into())?;
        ensure(set == all.iter().collect(), || format!("paged tables {paged:?} differ from {all:?}"))
    }

    async fn list_routes_unknown_table(&mut self) -> Check {
        let r = self
            .routes
            .clone()
            .list_routes(self.req(pb::ListRoutesRequest {
                cluster_name: self.cluster(),
                table_id: format!("ccm-conformance-no-such-table-{}", self.run_id),
                ..Default::default()
            }))
            .await;
        expect_code(r, Code::InvalidArgument, "ListRoutes of an unknown table")
    }

    async fn list_routes_bad_token(&mut self) -> Check {
        let r = self
            .routes
            .clone()
            .list_routes(self.req(pb::ListRoutesRequest {
                cluster_name: self.cluster(),
                page_size: 1,
                page_token: "ccm-conformance-not-a-token".into(),
                ..Default::default()
            }))
            .await;
        expect_code(r, Code::InvalidArgument, "ListRoutes with a foreign page token")
    }

    async fn create(&mut self, route: pb::Route) -> Result<pb::Route, Not> {
        let r = self
            .routes
            .clone()
            .create_route(self.req(pb::CreateRouteRequest { cluster_name: self.cluster(), route: Some(route.clone()) }))
            .await;
        let created = r.ctx("CreateRoute")?.route.ok_or_else(|| fail("CreateRoute answered no route"))?;
        self.created_routes.push((created.table_id.clone(), created.name.clone(), created.destination_cidr.clone()));
        Ok(created)
    }

    /// Route names are the provider's own (`provider_names`): CreateRoute's is a hint.
    fn provider_names(&self) -> bool {
        self.caps.routes.as_ref().is_some_and(|r| r.provider_names)
    }

    /// The name the provider gave the route created to `cidr`.
    fn created_name(&self, cidr: &str) -> Option<(String, String)> {
        self.created_routes.iter().rev().find(|(_, _, d)| d == cidr).map(|(t, n, _)| (t.clone(), n.clone()))
    }

    async fn create_route(&mut self) -> Check {
        let route = self.route("main", self.cidr(0))?;
        let created = self.create(route.clone()).await?;
        let same_name = created.name == route.name || self.provider_names();
        let want = route.target.clone().unwrap_or_default();
        let got = created.target.clone().unwrap_or_default();
        let same_target = got.node_name == want.node_name && (got.provider_id.is_empty() || got.provider_id == want.provider_id);
        ensure(same_name && same_target && created.destination_cidr == route.destination_cidr, || {
            format!("created {created:?}, asked for {route:?}")
        })?;
        let cluster = self.cluster();
        self.eventually(async || {
            let listed = self.list_all_routes(&cluster, "", 0).await?;
            ensure(listed.iter().any(|r| r.name == created.name && r.destination_cidr == route.destination_cidr), || {
                format!("route {} is not listed after creation", created.name)
            })
        })
        .await
    }

    async fn create_route_again(&mut self) -> Check {
        let route = self.route("main", self.cidr(0))?;
        self.create(route.clone()).await.map_err(|e| match e {
            Not::Fail(why) => fail(format!("repeating CreateRoute: {why}")),
            other => other,
        })?;
        let listed = self.list_all_routes(&self.cluster(), "", 0).await?;
        let n = listed.iter().filter(|r| r.destination_cidr == route.destination_cidr).count();
        ensure(n <= 1, || format!("route {} listed {n} times after a repeated create", route.name))
    }

    async fn create_route_conflict(&mut self) -> Check {
        if self.provider_names() {
            return Err(skip("route names are the provider's (provider_names): a name hint cannot conflict"));
        }
        let route = self.route("main", self.cidr(1))?;
        let r = self
            .routes
            .clone()
            .create_route(self.req(pb::CreateRouteRequest { cluster_name: self.cluster(), route: Some(route) }))
            .await;
        expect_code(r, Code::AlreadyExists, "CreateRoute of an existing name with another destination")
    }

    async fn create_route_empty_name(&mut self) -> Check {
        let mut route = self.route("x", self.cidr(2))?;
        route.name.clear();
        let r = self
            .routes
            .clone()
            .create_route(self.req(pb::CreateRouteRequest { cluster_name: self.cluster(), route: Some(route) }))
            .await;
        expect_code(r, Code::InvalidArgument, "CreateRoute without a name")
    }

    async fn create_route_bad_cidr(&mut self) -> Check {
        for cidr in ["198.18.300.0/24", "not-a-cidr", "198.18.1.0/33", "198.18.1.7/24"] {
            let route = self.route("bad-cidr", cidr.to_string())?;
            let r = self
                .routes
                .clone()
                .create_route(self.req(pb::CreateRouteRequest { cluster_name: self.cluster(), route: Some(route) }))
                .await;
            expect_code(r, Code::InvalidArgument, &format!("CreateRoute to {cidr:?}"))?;
        }
        Ok(())
    }

    async fn create_route_unknown_table(&mut self) -> Check {
        let mut route = self.route("no-table", self.cidr(3))?;
        route.table_id = format!("ccm-conformance-no-such-table-{}", self.run_id);
        let r = self
            .routes
            .clone()
            .create_route(self.req(pb::CreateRouteRequest { cluster_name: self.cluster(), route: Some(route) }))
            .await;
        expect_code(r, Code::InvalidArgument, "CreateRoute in an unknown table")
    }

    async fn create_route_ipv6(&mut self) -> Check {
        let n = self.cidr_base;
        let route = self.route("v6", format!("fd00:ccc:{n:x}::/64"))?;
        if self.caps.routes.as_ref().is_some_and(|r| r.ipv6) {
            self.create(route).await.map(|_| ())
        } else {
            let r = self
                .routes
                .clone()
                .create_route(self.req(pb::CreateRouteRequest { cluster_name: self.cluster(), route: Some(route) }))
                .await;
            expect_code(r, Code::InvalidArgument, "CreateRoute of IPv6 without advertising ipv6")
        }
    }

    async fn list_routes_pagination(&mut self) -> Check {
        let mut paged = BTreeSet::new();
        for i in 0..5 {
            let route = self.route(&format!("page-{i}"), self.cidr(10 + i))?;
            paged.insert(route.destination_cidr.clone());
            self.create(route).await?;
        }
        let cluster = self.cluster();
        let want: BTreeSet<String> = self
            .eventually(async || {
                let all = self.list_all_routes(&cluster, "", 0).await?;
                let found = all.iter().filter(|r| paged.contains(&r.destination_cidr)).count();
                let names: BTreeSet<String> = all.into_iter().map(|r| r.name).collect();
                ensure(found == 5, || format!("expected 5 paged routes, listed {names:?}")).map(|()| names)
            })
            .await?;
        for size in [1, 2, 3] {
            let got: Vec<String> = self.list_all_routes(&cluster, "", size).await?.into_iter().map(|r| r.name).collect();
            let set: BTreeSet<String> = got.iter().cloned().collect();
            ensure(set.len() == got.len(), || format!("page size {size}: a route is repeated across pages"))?;
            ensure(set == want, || format!("page size {size}: listed {set:?}, expected {want:?}"))?;
        }
        Ok(())
    }

    async fn routes_cluster_isolation(&mut self) -> Check {
        let other = format!("ccm-conformance-other-{}", self.run_id);
        let listed = self.list_all_routes(&other, "", 0).await?;
        let ours = listed.iter().filter(|r| r.name.starts_with(&format!("ccm-conformance-{}-", self.run_id))).count();
        ensure(ours == 0, || format!("another cluster's listing shows {ours} of this cluster's routes"))
    }

    async fn delete(&self, table_id: &str, name: &str) -> Result<(), Not> {
        self.routes
            .clone()
            .delete_route(self.req(pb::DeleteRouteRequest {
                cluster_name: self.cluster(),
                table_id: table_id.to_string(),
                name: name.to_string(),
            }))
            .await
            .ctx("DeleteRoute")
            .map(|_| ())
    }

    async fn delete_route(&mut self) -> Check {
        let route = self.route("main", self.cidr(0))?;
        let (table, name) = self.created_name(&route.destination_cidr).ok_or_else(|| skip("routes.create failed"))?;
        self.delete(&table, &name).await?;
        let cluster = self.cluster();
        self.eventually(async || {
            let listed = self.list_all_routes(&cluster, "", 0).await?;
            ensure(!listed.iter().any(|r| r.name == name), || format!("route {name} still listed after DeleteRoute"))
        })
        .await
    }

    async fn delete_route_again(&mut self) -> Check {
        let route = self.route("main", self.cidr(0))?;
        let name = self.created_name(&route.destination_cidr).map_or(route.name, |(_, n)| n);
        self.delete("", &name).await
    }

    async fn delete_route_absent(&mut self) -> Check {
        self.delete("", &format!("ccm-conformance-{}-never-created", self.run_id)).await
    }

    async fn resolve_tables(&mut self) -> Check {
        if !self.caps.routes.as_ref().is_some_and(|r| r.multiple_tables) {
            return Err(skip("multiple_tables is not advertised"));
        }
        let target = self.route("resolve", self.cidr(30))?.target.unwrap_or_default();
        let tables: HashSet<String> = self.list_all_tables(0).await?.into_iter().map(|t| t.id).collect();
        let r = self
            .routes
            .clone()
            .resolve_route_tables(self.req(pb::ResolveRouteTablesRequest { targets: vec![target] }))
            .await
            .ctx("ResolveRouteTables")?;
        ensure(r.assignments.len() == 1, || format!("{} assignments for 1 target", r.assignments.len()))?;
        let a = &r.assignments[0];
        ensure(a.error.is_none() && !a.table_ids.is_empty(), || format!("no table for a listed instance: {a:?}"))?;
        ensure(a.table_ids.iter().all(|t| tables.contains(t)), || format!("assigned tables {:?} are not all listed", a.table_ids))
    }

    async fn route_quota(&mut self) -> Check {
        let tables = self.list_all_tables(0).await?;
        let table = tables.first().cloned().ok_or_else(|| fail("no route table listed"))?;
        let max =
            if table.max_routes > 0 { table.max_routes } else { self.caps.routes.as_ref().map_or(0, |r| r.max_routes_per_table) };
        if max == 0 {
            return Err(skip("no route quota advertised"));
        }
        if max > self.opts.max_quota_to_fill {
            return Err(skip(format!("quota of {max} routes is more than this run fills ({})", self.opts.max_quota_to_fill)));
        }
        let mut created = Vec::new();
        let mut outcome = Err(fail(format!("{} routes created in a table that holds {max}", max + 1)));
        for i in 0..=max {
            let mut route = self.route(&format!("quota-{i}"), self.cidr(100 + i))?;
            route.table_id = table.id.clone();
            let r = self
                .routes
                .clone()
                .create_route(self.req(pb::CreateRouteRequest { cluster_name: self.cluster(), route: Some(route.clone()) }))
                .await;
            match r {
                Ok(_) => created.push(route.name),
                Err(s) if s.code() == Code::ResourceExhausted => {
                    let err = crate::Error::from_status(&s);
                    outcome = ensure(matches!(err, crate::Error::QuotaExceeded { .. }), || {
                        format!("a full table answered {err:?}: a quota must not carry RetryInfo or the RATE_LIMITED reason")
                    });
                    break;
                }
                Err(s) => {
                    outcome = Err(fail(format!("route {i} of {max}: {} {}", code_name(s.code()), s.message())));
                    break;
                }
            }
        }
        for name in created {
            self.delete(&table.id, &name).await?;
        }
        outcome
    }

    // === load balancers ===

    fn lb_service(&self, suffix: &str) -> pb::LoadBalancerService {
        let limits = self.caps.load_balancers.as_ref().map(NameLimits::from_capabilities).unwrap_or_default();
        let uid = format!("ccm-conformance-{}-{suffix}", self.run_id);
        pb::LoadBalancerService {
            cluster_name: "ccm-conformance".into(),
            namespace: "conformance".into(),
            name: format!("svc-{suffix}"),
            load_balancer_name: load_balancer_name("ccm-conformance", "conformance", &format!("svc-{suffix}"), &uid, &limits),
            uid,
            ports: vec![pb::ServicePort {
                name: "http".into(),
                protocol: pb::Protocol::Tcp as i32,
                port: 80,
                node_port: 30080,
                ..Default::default()
            }],
            session_affinity: pb::SessionAffinity::None as i32,
            ip_families: vec![pb::IpFamily::Ipv4 as i32],
            external_traffic_policy: pb::ExternalTrafficPolicy::Cluster as i32,
            ..Default::default()
        }
    }

    fn lb_nodes(&self) -> Vec<pb::LoadBalancerNode> {
        self.known
            .iter()
            .take(3)
            .map(|i| pb::LoadBalancerNode {
                name: i.node_name.clone(),
                provider_id: i.provider_id.clone(),
                addresses: i.addresses.clone(),
                labels: Default::default(),
            })
            .collect()
    }

    async fn get_lb(&self, service: pb::LoadBalancerService) -> Result<pb::GetLoadBalancerResponse, Not> {
        self.lbs
            .clone()
            .get_load_balancer(self.req(pb::GetLoadBalancerRequest { service: Some(service) }))
            .await
            .ctx("GetLoadBalancer")
    }

    async fn ensure_lb(&mut self, service: pb::LoadBalancerService) -> Result<pb::LoadBalancerStatus, Not> {
        let nodes = self.lb_nodes();
        self.created_lbs.push(service.clone());
        let r = self
            .lbs
            .clone()
            .ensure_load_balancer(self.req(pb::EnsureLoadBalancerRequest { service: Some(service), nodes }))
            .await;
        r.ctx("EnsureLoadBalancer")?.status.ok_or_else(|| fail("EnsureLoadBalancer answered no status"))
    }

    async fn lb_get_absent(&mut self) -> Check {
        let r = self.get_lb(self.lb_service("absent")).await?;
        ensure(!r.exists, || "a load balancer never created exists".into())
    }

    async fn lb_ensure(&mut self) -> Check {
        let status = self.ensure_lb(self.lb_service("main")).await?;
        ensure(!status.ingress.is_empty(), || "no ingress in the status".into())?;
        for i in &status.ingress {
            ensure(i.ip.is_empty() != i.hostname.is_empty(), || format!("ingress {i:?} needs exactly one of ip and hostname"))?;
            ensure(i.ip.is_empty() || i.ip.parse::<IpAddr>().is_ok(), || format!("ingress ip {:?} is not an IP", i.ip))?;
        }
        Ok(())
    }

    async fn lb_ensure_again(&mut self) -> Check {
        let service = self.lb_service("main");
        let first = self.ensure_lb(service.clone()).await?;
        let second = self.ensure_lb(service).await?;
        ensure(first.ingress == second.ingress, || format!("repeated Ensure changed the ingress: {first:?} then {second:?}"))
    }

    async fn lb_get_present(&mut self) -> Check {
        let service = self.lb_service("main");
        let ensured = self.ensure_lb(service.clone()).await?;
        self.eventually(async || {
            let r = self.get_lb(service.clone()).await?;
            ensure(r.exists, || "an ensured load balancer does not exist".into())?;
            let status = r.status.unwrap_or_default();
            ensure(status.ingress == ensured.ingress, || format!("Get says {status:?}, Ensure said {ensured:?}"))
        })
        .await
    }

    /// When listing is advertised: the ensured load balancers are listed, page by page, with
    /// the Service each was ensured for, and only for their own cluster.
    async fn lb_list(&mut self) -> Check {
        if !self.caps.load_balancers.as_ref().is_some_and(|c| c.list) {
            return Err(skip("ListLoadBalancers is not advertised"));
        }
        let (main, second) = (self.lb_service("main"), self.lb_service("listed"));
        self.ensure_lb(main.clone()).await?;
        self.ensure_lb(second.clone()).await?;
        let list = async |cluster: &str| {
            all_pages("ListLoadBalancers", 1, async |page_token| {
                let request = pb::ListLoadBalancersRequest { cluster_name: cluster.into(), page_size: 1, page_token };
                let page = self.lbs.clone().list_load_balancers(self.req(request)).await.ctx("ListLoadBalancers")?;
                Ok((page.load_balancers, page.next_page_token))
            })
            .await
        };
        self.eventually(async || {
            let listed = list("ccm-conformance").await?;
            for want in [&main, &second] {
                let found = listed.iter().find(|l| l.load_balancer_name == want.load_balancer_name);
                let found = found.ok_or_else(|| fail(format!("{} is not listed", want.load_balancer_name)))?;
                ensure(
                    (found.namespace.as_str(), found.name.as_str(), found.uid.as_str())
                        == (&want.namespace, &want.name, &want.uid),
                    || {
                        format!(
                            "{} is listed for {}/{} ({}), not the Service it was ensured for",
                            found.load_balancer_name, found.namespace, found.name, found.uid
                        )
                    },
                )?;
            }
            let names: Vec<&str> = listed.iter().map(|l| l.load_balancer_name.as_str()).collect();
            let mut unique = names.clone();
            unique.sort_unstable();
            unique.dedup();
            ensure(unique.len() == names.len(), || format!("pages repeat load balancers: {names:?}"))
        })
        .await?;
        let other = list("ccm-conformance-other-cluster").await?;
        ensure(!other.iter().any(|l| l.load_balancer_name == main.load_balancer_name), || {
            "another cluster's listing shows this cluster's load balancer".into()
        })
    }

    async fn lb_update_hosts(&mut self) -> Check {
        let service = self.lb_service("main");
        let nodes: Vec<pb::LoadBalancerNode> = self.lb_nodes().into_iter().take(1).collect();
        self.lbs
            .clone()
            .update_load_balancer_hosts(self.req(pb::UpdateLoadBalancerHostsRequest { service: Some(service), nodes }))
            .await
            .ctx("UpdateLoadBalancerHosts")
            .map(|_| ())
    }

    async fn lb_update_hosts_absent(&mut self) -> Check {
        let r = self
            .lbs
            .clone()
            .update_load_balancer_hosts(
                self.req(pb::UpdateLoadBalancerHostsRequest { service: Some(self.lb_service("absent")), nodes: self.lb_nodes() }),
            )
            .await;
        expect_code(r, Code::NotFound, "UpdateLoadBalancerHosts of an absent load balancer")
    }

    async fn ensure_invalid(&mut self, service: pb::LoadBalancerService, what: &str) -> Check {
        let r = self
            .lbs
            .clone()
            .ensure_load_balancer(
                self.req(pb::EnsureLoadBalancerRequest { service: Some(service.clone()), nodes: self.lb_nodes() }),
            )
            .await;
        if r.is_ok() {
            self.created_lbs.push(service);
        }
        expect_code(r, Code::InvalidArgument, what)
    }

    async fn lb_empty_name(&mut self) -> Check {
        let mut service = self.lb_service("empty-name");
        service.load_balancer_name.clear();
        self.ensure_invalid(service, "EnsureLoadBalancer without a name").await
    }

    async fn lb_name_too_long(&mut self) -> Check {
        let max = self.caps.load_balancers.as_ref().map_or(0, |l| l.max_name_length);
        if max == 0 {
            return Err(skip("no name length limit advertised"));
        }
        let mut service = self.lb_service("long");
        service.load_balancer_name = format!("ccm-conformance-{}", "x".repeat(max as usize));
        self.ensure_invalid(service, "EnsureLoadBalancer with a name over the advertised limit").await
    }

    async fn lb_no_ports(&mut self) -> Check {
        let mut service = self.lb_service("no-ports");
        service.ports.clear();
        self.ensure_invalid(service, "EnsureLoadBalancer without ports").await
    }

    async fn lb_bad_source_range(&mut self) -> Check {
        let mut service = self.lb_service("bad-range");
        service.source_ranges = vec!["10.0.0.0/99".into()];
        self.ensure_invalid(service, "EnsureLoadBalancer with a malformed source range").await
    }

    async fn lb_sdk_name(&mut self) -> Check {
        let limits = self.caps.load_balancers.as_ref().map(NameLimits::from_capabilities).unwrap_or_default();
        let mut service = self.lb_service("long-name");
        service.namespace = "a-namespace-with-a-rather-long-name".into();
        service.name = "and-a-service-whose-name-is-longer-still".into();
        service.load_balancer_name =
            load_balancer_name("ccm-conformance-cluster", &service.namespace, &service.name, &service.uid, &limits);
        self.ensure_lb(service.clone()).await?;
        self.lbs
            .clone()
            .ensure_load_balancer_deleted(self.req(pb::EnsureLoadBalancerDeletedRequest { service: Some(service) }))
            .await
            .ctx("EnsureLoadBalancerDeleted")
            .map(|_| ())
    }

    async fn delete_lb(&self, service: pb::LoadBalancerService) -> Check {
        self.lbs
            .clone()
            .ensure_load_balancer_deleted(self.req(pb::EnsureLoadBalancerDeletedRequest { service: Some(service) }))
            .await
            .ctx("EnsureLoadBalancerDeleted")
            .map(|_| ())
    }

    async fn lb_delete(&mut self) -> Check {
        let service = self.lb_service("main");
        self.delete_lb(service.clone()).await?;
        self.eventually(async || {
            let r = self.get_lb(service.clone()).await?;
            ensure(!r.exists, || "the load balancer still exists after EnsureLoadBalancerDeleted".into())
        })
        .await
    }

    async fn lb_delete_again(&mut self) -> Check {
        self.delete_lb(self.lb_service("main")).await
    }

    async fn lb_delete_absent(&mut self) -> Check {
        self.delete_lb(self.lb_service("never-created")).await
    }

    // === node metadata ===

    async fn node_metadata_get(&mut self) -> Check {
        let r =
            self.node_metadata.clone().get_node_metadata(self.req(pb::GetNodeMetadataRequest {})).await.ctx("GetNodeMetadata")?;
        let m = r.metadata.ok_or_else(|| fail("GetNodeMetadata answered no metadata"))?;
        ccm_protocol::answer::node_metadata(&m).map_err(|e| fail(e.to_string()))?;
        for a in &m.addresses {
            valid_address(a).map_err(fail)?;
        }
        Ok(())
    }

    async fn image_credentials_answer(&mut self) -> Check {
        let request = pb::GetImageCredentialsRequest { image: IMAGE.into(), ..Default::default() };
        let r = self.image_credentials.clone().get_image_credentials(self.req(request)).await.ctx("GetImageCredentials")?;
        // The answer is checked without ever printing it: it may hold secrets.
        crate::registry::check_answer(&r).map_err(|e| fail(e.to_string()))
    }

    async fn image_credentials_invalid(&mut self) -> Check {
        let request = pb::GetImageCredentialsRequest { image: "https://not an image".into(), ..Default::default() };
        let r = self.image_credentials.clone().get_image_credentials(self.req(request)).await;
        expect_code(
            r.map(|r| Response::new(r.into_inner().auth.len())),
            Code::InvalidArgument,
            "GetImageCredentials of a malformed image",
        )
    }

    async fn node_metadata_matches(&mut self) -> Check {
        if !self.advertises(ServiceType::Instances) {
            return Err(skip("InstancesService is not advertised"));
        }
        let r =
            self.node_metadata.clone().get_node_metadata(self.req(pb::GetNodeMetadataRequest {})).await.ctx("GetNodeMetadata")?;
        let local = r.metadata.unwrap_or_default();
        let lookup = pb::InstanceLookup { provider_id: local.provider_id.clone(), ..Default::default() };
        let cloud = self
            .instances
            .clone()
            .instance_metadata(self.req(pb::InstanceMetadataRequest { instance: Some(lookup) }))
            .await
            .ctx("InstanceMetadata")?;
        let m = cloud
            .metadata
            .filter(|_| cloud.exists)
            .ok_or_else(|| fail(format!("the local instance {} does not exist", local.provider_id)))?;
        ensure(m.instance_id == local.instance_id && m.zone == local.zone && m.instance_type == local.instance_type, || {
            format!("metadata service says {local:?}, the cloud says {m:?}")
        })
    }

    // === cleanup ===

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
