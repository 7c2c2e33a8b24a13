//! The sim over real unix sockets: the conformance suite passes against it and fails against
//! deliberately broken providers; the admin API changes what cloudprovider.v1 answers; the
//! binary stops cleanly on SIGTERM.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ccm_provider_sdk::conformance::{self, Options, Outcome, Report};
use ccm_provider_sdk::proto as pb;
use ccm_provider_sdk::proto::instances_service_client::InstancesServiceClient;
use ccm_provider_sdk::{Error, Listen, Page, PageRequest, ProviderServer, Result};
use ccm_provider_sim::config::{Fault, InstanceSpec, RateLimit};
use ccm_provider_sim::{AdminClient, Config};
use tokio::sync::oneshot;

fn example_config() -> Config {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/conformance.toml");
    Config::load(&path).expect("example config")
}

struct Running {
    _dir: tempfile::TempDir,
    endpoint: String,
    admin: AdminClient,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Running {
    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), &mut self.task).await;
    }
}

async fn wait_for_socket(path: &Path) {
    for _ in 0..200 {
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("nothing listens on {}", path.display());
}

async fn start_sim(config: Config) -> Running {
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("provider.sock");
    let admin = dir.path().join("admin.sock");
    let (tx, rx) = oneshot::channel::<()>();
    let endpoints = ccm_provider_sim::Endpoints {
        provider: Listen::Unix(sock.clone()),
        admin: Some(Listen::Unix(admin.clone())),
        metadata: None,
        metrics: None,
    };
    let task = tokio::spawn(ccm_provider_sim::run(config, endpoints, async move {
        let _ = rx.await;
    }));
    wait_for_socket(&sock).await;
    wait_for_socket(&admin).await;
    Running {
        endpoint: format!("unix://{}", sock.display()),
        admin: AdminClient::new(format!("unix://{}", admin.display())),
        _dir: dir,
        stop: Some(tx),
        task,
    }
}

async fn run_suite(endpoint: &str) -> Report {
    let mut options = Options::new(endpoint);
    options.consistency_timeout = Duration::from_secs(5);
    conformance::run(&options, |r| eprintln!("{r}")).await.expect("suite runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_passes_against_the_sim() {
    let mut config = example_config();
    config.node_metadata_instance = Some("i-0001".into());
    config.pod_cidrs = Some(Default::default());
    let tags_before: Vec<_> = config.instances.iter().map(|i| (i.id.clone(), i.tags.clone())).collect();
    let sim = start_sim(config).await;
    let report = run_suite(&sim.endpoint).await;
    assert_eq!(report.failed(), 0, "{}", report.summary());
    assert!(report.passed() >= 40, "only {} checks passed", report.passed());
    for check in ["tags.set-update-remove", "load-balancers.hosts-reported", "instances.pod-cidrs"] {
        assert!(matches!(report.outcome(check), Some(Outcome::Pass)), "{check}: {:?}", report.outcome(check));
    }
    // The suite cleans up after itself.
    let state = sim.admin.state().await.expect("state");
    let tags_after: Vec<_> = state.instances.iter().map(|i| (i.id.clone(), i.tags.clone())).collect();
    assert_eq!(tags_after, tags_before, "the instances' tags as they were");
    assert!(state.load_balancers.is_empty(), "{:?}", state.load_balancers);
    assert!(state.route_tables.iter().all(|t| t.routes.is_empty()), "{:?}", state.route_tables);
    sim.stop().await;
}

// === deliberately broken providers ===

#[derive(Clone, Copy, PartialEq, Eq)]
enum Breakage {
    NotFoundForUnknown,
    RepeatsAcrossPages,
    RouteCreateNotIdempotent,
    DeleteAbsentFails,
    /// Advertises ListLoadBalancers and lists nothing.
    ListsNothing,
}

struct Broken {
    inner: ccm_provider_sim::provider::SimProvider,
    breakage: Breakage,
}

#[tonic::async_trait]
impl ccm_provider_sdk::Instances for Broken {
    async fn instance_metadata(&self, lookup: &pb::InstanceLookup) -> Result<Option<pb::InstanceMetadata>> {
        let found = ccm_provider_sdk::Instances::instance_metadata(&self.inner, lookup).await?;
        match found {
            None if self.breakage == Breakage::NotFoundForUnknown => Err(Error::not_found("no such instance")),
            other => Ok(other),
        }
    }

    async fn list_instances(&self, page: &PageRequest) -> Result<Page<pb::InstanceMetadata>> {
        let mut answer = ccm_provider_sdk::Instances::list_instances(&self.inner, page).await?;
        if self.breakage == Breakage::RepeatsAcrossPages && !page.page_token.is_empty() {
            // An offset bug: every later page starts with the previous page's last item again.
            let previous = page.after()?.unwrap_or_default();
            let all = ccm_provider_sdk::Instances::list_instances(&self.inner, &PageRequest::new(1000, "")).await?;
            if let Some(again) = all.items.into_iter().find(|i| i.instance_id == previous) {
                answer.items.insert(0, again);
            }
        }
        Ok(answer)
    }
}

#[tonic::async_trait]
impl ccm_provider_sdk::Routes for Broken {
    fn capabilities(&self) -> pb::RoutesCapabilities {
        ccm_provider_sdk::Routes::capabilities(&self.inner)
    }

    async fn list_route_tables(&self, page: &PageRequest) -> Result<Page<pb::RouteTable>> {
        self.inner.list_route_tables(page).await
    }

    async fn list_routes(&self, cluster: &str, table: &str, page: &PageRequest) -> Result<Page<pb::Route>> {
        self.inner.list_routes(cluster, table, page).await
    }

    async fn create_route(&self, cluster: &str, route: pb::Route) -> Result<pb::Route> {
        if self.breakage == Breakage::RouteCreateNotIdempotent {
            let existing = self.inner.list_routes(cluster, &route.table_id, &PageRequest::new(1000, "")).await?;
            if existing.items.iter().any(|r| r.name == route.name) {
                return Err(Error::already_exists("route exists"));
            }
        }
        self.inner.create_route(cluster, route).await
    }

    async fn delete_route(&self, cluster: &str, table: &str, name: &str) -> Result<()> {
        self.inner.delete_route(cluster, table, name).await
    }

    async fn resolve_route_tables(&self, targets: &[pb::RouteTarget]) -> Result<Vec<ccm_provider_sdk::Answered<Vec<String>>>> {
        self.inner.resolve_route_tables(targets).await
    }
}

#[tonic::async_trait]
impl ccm_provider_sdk::LoadBalancers for Broken {
    fn capabilities(&self) -> pb::LoadBalancersCapabilities {
        ccm_provider_sdk::LoadBalancers::capabilities(&self.inner)
    }

    async fn get_load_balancer(&self, s: &pb::LoadBalancerService) -> Result<Option<pb::LoadBalancerStatus>> {
        self.inner.get_load_balancer(s).await
    }

    async fn ensure_load_balancer(
        &self,
        s: &pb::LoadBalancerService,
        n: &[pb::LoadBalancerNode],
    ) -> Result<pb::LoadBalancerStatus> {
        self.inner.ensure_load_balancer(s, n).await
    }

    async fn update_load_balancer_hosts(&self, s: &pb::LoadBalancerService, n: &[pb::LoadBalancerNode]) -> Result<()> {
        self.inner.update_load_balancer_hosts(s, n).await
    }

    async fn ensure_load_balancer_deleted(&self, s: &pb::LoadBalancerService) -> Result<()> {
        if self.breakage == Breakage::DeleteAbsentFails && self.inner.get_load_balancer(s).await?.is_none() {
            return Err(Error::not_found("no such load balancer"));
        }
        self.inner.ensure_load_balancer_deleted(s).await
    }

    async fn list_load_balancers(&self, cluster: &str, page: &PageRequest) -> Result<Page<pb::LoadBalancerSummary>> {
        if self.breakage == Breakage::ListsNothing {
            return Ok(Page { items: Vec::new(), next_page_token: String::new() });
        }
        self.inner.list_load_balancers(cluster, page).await
    }
}

async fn report_for(breakage: Breakage) -> Report {
    let mut config = example_config();
    // The broken behaviours read the cloud right after writing; keep reads consistent.
    config.api.consistency_delay_ms = 0;
    let cloud = Arc::new(ccm_provider_sim::cloud::Cloud::new(&config).expect("cloud"));
    let broken = Arc::new(Broken { inner: ccm_provider_sim::provider::SimProvider::new(cloud), breakage });
    let dir = tempfile::tempdir().expect("tempdir");
    let sock: PathBuf = dir.path().join("broken.sock");
    let (tx, rx) = oneshot::channel::<()>();
    let server = ProviderServer::new("broken.example.com", "0.0.1")
        .instances(broken.clone())
        .routes(broken.clone())
        .load_balancers(broken);
    let listen = Listen::Unix(sock.clone());
    let task = tokio::spawn(async move {
        server
            .serve_with_shutdown(&listen, async move {
                let _ = rx.await;
            })
            .await
    });
    wait_for_socket(&sock).await;
    let report = run_suite(&format!("unix://{}", sock.display())).await;
    let _ = tx.send(());
    let _ = task.await;
    report
}

fn assert_fails(report: &Report, checks: &[&str]) {
    for name in checks {
        assert!(matches!(report.outcome(name), Some(Outcome::Fail(_))), "{name} should fail, got {:?}", report.outcome(name));
    }
    assert_eq!(report.failed(), checks.len(), "only {checks:?} should fail: {:#?}", report.results);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_catches_not_found_for_unknown_instances() {
    let report = report_for(Breakage::NotFoundForUnknown).await;
    assert_fails(
        &report,
        &[
            "instances.exists-unknown-provider-id",
            "instances.exists-unknown-node-name",
            "instances.shutdown-unknown",
            "instances.metadata-unknown",
            "instances.batch-mixed",
        ],
    );
    // Services the broken provider does not advertise are skipped, not failed.
    assert!(matches!(report.outcome("tags.known"), Some(Outcome::Skip(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_catches_items_repeated_across_pages() {
    let report = report_for(Breakage::RepeatsAcrossPages).await;
    assert_fails(&report, &["instances.list-pagination"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_catches_a_create_that_is_not_idempotent() {
    let report = report_for(Breakage::RouteCreateNotIdempotent).await;
    assert_fails(&report, &["routes.create-idempotent"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_catches_a_delete_of_an_absent_object_that_fails() {
    let report = report_for(Breakage::DeleteAbsentFails).await;
    assert_fails(&report, &["load-balancers.delete-absent", "load-balancers.delete-idempotent"]);
}

// === the admin API drives what the cloud answers ===

async fn exists(
    client: &mut InstancesServiceClient<tonic::transport::Channel>,
    provider_id: &str,
) -> std::result::Result<bool, tonic::Status> {
    let lookup = pb::InstanceLookup { provider_id: provider_id.into(), ..Default::default() };
    client.instance_exists(pb::InstanceExistsRequest { instance: Some(lookup) }).await.map(|r| r.into_inner().exists)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_faults_lifecycle_and_lag() {
    let mut config = Config::default();
    config.api.consistency_delay_ms = 300;
    let sim = start_sim(config).await;
    let channel = ccm_provider_sdk::client::connect(&sim.endpoint).await.expect("connect");
    let mut instances = InstancesServiceClient::new(channel);

    // A new instance shows in reads only after the consistency delay.
    let spec = InstanceSpec {
        id: "i-new".into(),
        name: "node-new".into(),
        zone: "sim-region-1a".into(),
        instance_type: "sim.small".into(),
        state: Default::default(),
        addresses: Vec::new(),
        tags: Default::default(),
        ..Default::default()
    };
    let provider_id = sim.admin.add_instance(&spec).await.expect("add");
    assert_eq!(provider_id, "sim://sim-region-1a/i-new");
    assert!(!exists(&mut instances, &provider_id).await.expect("call"));
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(exists(&mut instances, &provider_id).await.expect("call"));

    // Stopped instances are shut down; terminated ones stop existing (after the lag).
    sim.admin.instance_action("i-new", "stop").await.expect("stop");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let lookup = pb::InstanceLookup { provider_id: provider_id.clone(), ..Default::default() };
    let shutdown =
        instances.instance_shutdown(pb::InstanceShutdownRequest { instance: Some(lookup) }).await.expect("call").into_inner();
    assert!(shutdown.exists && shutdown.shutdown);
    sim.admin.instance_action("i-new", "terminate").await.expect("terminate");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!exists(&mut instances, &provider_id).await.expect("call"));

    // A method that is down answers UNAVAILABLE, which is not "gone".
    sim.admin.set_faults(&[Fault { method: "InstanceExists".into(), down: true, ..Default::default() }]).await.expect("faults");
    let err = exists(&mut instances, &provider_id).await.expect_err("down");
    assert_eq!(err.code(), tonic::Code::Unavailable);
    sim.admin.set_faults(&[]).await.expect("clear");

    // Over the rate limit: RESOURCE_EXHAUSTED with RetryInfo, honoured by waiting.
    sim.admin.set_rate_limit(Some(RateLimit { rps: 5.0, burst: 2 })).await.expect("limit");
    let mut limited = None;
    for _ in 0..5 {
        if let Err(status) = exists(&mut instances, &provider_id).await {
            limited = Some(status);
            break;
        }
    }
    let status = limited.expect("the limit answers");
    let err = Error::from_status(&status);
    let Error::RateLimited { retry_after } = err else { panic!("expected rate limited, got {err:?}") };
    assert!(retry_after > Duration::ZERO && retry_after <= Duration::from_millis(200), "{retry_after:?}");
    tokio::time::sleep(retry_after).await;
    assert!(exists(&mut instances, &provider_id).await.is_ok());

    // Every call was counted by method and code.
    let calls = sim.admin.calls().await.expect("calls");
    let count = |code: &str| {
        calls
            .counts
            .iter()
            .filter(|c| c.method == "InstancesService/InstanceExists" && c.code == code)
            .map(|c| c.count)
            .sum::<u64>()
    };
    assert_eq!(count("UNAVAILABLE"), 1);
    assert_eq!(count("RESOURCE_EXHAUSTED"), 1);
    assert!(count("OK") >= 5);
    assert!(sim.admin.metrics().await.expect("metrics").contains("cloudprovider_server_calls_total"));
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_stops_on_sigterm_and_removes_its_sockets() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("p.sock");
    let admin = dir.path().join("a.sock");
    std::fs::write(dir.path().join("sim.toml"), "[api]\nlatency_ms = 1\n").expect("config");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_ccm-provider-sim"))
        .arg("--listen")
        .arg(format!("unix://{}", sock.display()))
        .arg("--admin-listen")
        .arg(format!("unix://{}", admin.display()))
        .arg("--config")
        .arg(dir.path().join("sim.toml"))
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    wait_for_socket(&sock).await;
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&sock).expect("meta").permissions()) & 0o777;
    assert_eq!(mode, 0o600);
    let pid = child.id().expect("pid").to_string();
    let killed = tokio::process::Command::new("kill").arg("-TERM").arg(&pid).status().await.expect("kill");
    assert!(killed.success());
    let status = tokio::time::timeout(Duration::from_secs(5), child.wait()).await.expect("exits in time").expect("wait");
    assert!(status.success(), "{status:?}");
    assert!(!sock.exists() && !admin.exists(), "sockets are removed on exit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_config_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "[api]\nlatncy_ms = 1\n").expect("write");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_ccm-provider-sim"))
        .arg("--listen")
        .arg(format!("unix://{}", dir.path().join("p.sock").display()))
        .arg("--config")
        .arg(&path)
        .output()
        .await
        .expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("bad.toml") && stderr.contains("latncy_ms"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_plugin_subcommand_serves_the_instance_it_runs_on() {
    use ccm_provider_sdk::proto::identity_service_client::IdentityServiceClient;
    use ccm_provider_sdk::proto::node_metadata_service_client::NodeMetadataServiceClient;
    let dir = tempfile::tempdir().expect("tempdir");
    let metadata = dir.path().join("metadata.sock");
    let plugin = dir.path().join("plugins/sim.cloudprovider.dev/node-metadata.sock");
    let mut config = example_config();
    config.registry_credentials.push(ccm_provider_sim::config::RegistryCredentialSpec {
        registry: "registry.sim.dev".into(),
        username: "u".into(),
        password: "pw".into(),
        cache_key_type: Default::default(),
        cache_seconds: 60,
    });
    let (tx, rx) = oneshot::channel::<()>();
    let endpoints = ccm_provider_sim::Endpoints {
        provider: Listen::Unix(dir.path().join("provider.sock")),
        admin: Some(Listen::Unix(dir.path().join("admin.sock"))),
        metadata: Some(Listen::Unix(metadata.clone())),
        metrics: None,
    };
    let sim = tokio::spawn(ccm_provider_sim::run(config, endpoints, async move {
        let _ = rx.await;
    }));
    wait_for_socket(&metadata).await;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_ccm-provider-sim"))
        .args(["node-metadata", "--instance-id", "i-0002"])
        .arg(format!("--listen=unix://{}", plugin.display()))
        .arg(format!("--metadata-endpoint=unix://{}", metadata.display()))
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    wait_for_socket(&plugin).await;
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&plugin).expect("meta").permissions()) & 0o777;
    assert_eq!(mode, 0o600, "only root (the kubelet's user) may connect");

    let endpoint = format!("unix://{}", plugin.display());
    let channel = ccm_provider_sdk::client::connect(&endpoint).await.expect("connect");
    let caps = IdentityServiceClient::new(channel.clone())
        .get_plugin_capabilities(pb::GetPluginCapabilitiesRequest {})
        .await
        .expect("capabilities")
        .into_inner();
    let mut services: Vec<pb::ServiceType> = caps.services().collect();
    services.sort_by_key(|s| *s as i32);
    assert_eq!(
        services,
        vec![pb::ServiceType::NodeMetadata, pb::ServiceType::ImageCredentials],
        "the node plugin serves only these"
    );
    let m = NodeMetadataServiceClient::new(channel)
        .get_node_metadata(pb::GetNodeMetadataRequest {})
        .await
        .expect("metadata")
        .into_inner()
        .metadata
        .expect("some");
    let admin = AdminClient::new(format!("unix://{}", dir.path().join("admin.sock").display()));
    let truth = admin.state().await.expect("state");
    let me = truth.instances.iter().find(|i| i.id == "i-0002").expect("i-0002");
    assert_eq!(
        (m.instance_id.as_str(), m.provider_id.as_str(), m.zone.as_str()),
        ("i-0002", me.provider_id.as_str(), me.zone.as_str())
    );
    assert_eq!(admin.calls().await.expect("calls").total, 0, "the metadata service is not the cloud API");
    // A DaemonSet knows its Node's name, not the instance id: the plugin finds itself by name.
    let by_name = ccm_provider_sim::plugin::NodePlugin::named(format!("unix://{}", metadata.display()), me.name.clone());
    let found = ccm_provider_sdk::NodeMetadata::node_metadata(&by_name).await.expect("by name");
    assert_eq!(found.instance_id, "i-0002");
    let nobody = ccm_provider_sim::plugin::NodePlugin::named(format!("unix://{}", metadata.display()), "no-such-node");
    assert!(ccm_provider_sdk::NodeMetadata::node_metadata(&nobody).await.is_err());

    let report = run_suite(&endpoint).await;
    assert_eq!(report.failed(), 0, "{}", report.summary());
    for check in ["node-metadata.get", "image-credentials.answer", "image-credentials.invalid-image"] {
        assert!(
            report.results.iter().any(|r| r.name == check && r.outcome == Outcome::Pass),
            "{check} passed: {}",
            report.summary()
        );
    }

    let pid = child.id().expect("pid").to_string();
    let killed = tokio::process::Command::new("kill").arg("-TERM").arg(&pid).status().await.expect("kill");
    assert!(killed.success());
    let status = tokio::time::timeout(Duration::from_secs(5), child.wait()).await.expect("exits").expect("wait");
    assert!(status.success(), "{status:?}");
    assert!(!plugin.exists(), "the socket is removed on exit");
    let _ = tx.send(());
    let _ = sim.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_catches_a_load_balancer_listing_that_misses_load_balancers() {
    let report = report_for(Breakage::ListsNothing).await;
    assert_fails(&report, &["load-balancers.list"]);
}
