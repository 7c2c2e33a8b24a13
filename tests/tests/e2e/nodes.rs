//! The node and node lifecycle controllers, end to end: the real API server, the core, and
//! the sim provider over a real unix socket.

use std::collections::BTreeMap;
use std::time::Duration;

use ccm_harness::cluster::{NodeBuilder, TestEnv, UNINITIALIZED_TAINT, set_ready};
use ccm_provider_sim::Config;
use ccm_provider_sim::config::{Address, Fault, FaultCode};
use k8s_openapi::api::core::v1::{Event, Node};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};

use crate::support::{Core, Sim, TEST_LABEL, eventually, free_port, http_get, instance};

const SHUTDOWN_TAINT: &str = "node.cloudprovider.kubernetes.io/shutdown";
const OUT_OF_SERVICE_TAINT: &str = "node.kubernetes.io/out-of-service";
const OUT_OF_SERVICE_ANNOTATION: &str = "ccm-rs.dev/out-of-service-since";

fn out_of_service(node: &Node) -> Option<k8s_openapi::api::core::v1::Taint> {
    node.spec.as_ref()?.taints.as_ref()?.iter().find(|t| t.key == OUT_OF_SERVICE_TAINT).cloned()
}

fn annotated_out_of_service(node: &Node) -> bool {
    node.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(OUT_OF_SERVICE_ANNOTATION))
}

fn taints(node: &Node) -> Vec<String> {
    node.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default().into_iter().map(|t| t.key).collect()
}

fn labels(node: &Node) -> BTreeMap<String, String> {
    node.metadata.labels.clone().unwrap_or_default()
}

async fn initialised(env: &TestEnv, name: &str) -> Option<Node> {
    let node = env.nodes().get_opt(name).await.ok().flatten()?;
    (!taints(&node).iter().any(|t| t == UNINITIALIZED_TAINT)).then_some(node)
}

async fn event_reasons(env: &TestEnv, node: &str) -> Vec<String> {
    let events: Api<Event> = Api::all(env.client.clone());
    let list = events.list(&ListParams::default().fields(&format!("involvedObject.name={node}"))).await.expect("events");
    list.items.into_iter().filter_map(|e| e.reason).collect()
}

async fn calls(sim: &Sim, methods: &[&str]) -> u64 {
    let mut n = 0;
    for m in methods {
        n += sim.admin.call_count(m).await.expect("calls");
    }
    n
}

const ROUTE_WRITES: &[&str] = &["RoutesService/CreateRoute", "RoutesService/DeleteRoute", "RoutesService/ApplyRoutes"];

const METADATA_CALLS: &[&str] = &["InstancesService/BatchInstanceMetadata", "InstancesService/InstanceMetadata"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_is_initialised_from_the_cloud() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "init").await.expect("env");
    let name = env.node_name("a");
    let bad = env.node_name("bad-ip");
    let mut config = Config::default();
    let mut spec = instance("i-a", &name, "sim-region-1a");
    spec.addresses = vec![
        Address { kind: "InternalIP".into(), address: "10.1.0.5".into() },
        Address { kind: "InternalIP".into(), address: "10.1.0.6".into() },
        Address { kind: "ExternalIP".into(), address: "198.51.100.5".into() },
    ];
    spec.tags = BTreeMap::from([
        ("team".to_string(), "payments".to_string()),
        ("bad key!".to_string(), "x".to_string()),
        ("owner".to_string(), "has space".to_string()),
    ]);
    config.instances.push(spec);
    config.instances.push(instance("i-bad", &bad, "sim-region-1a"));
    let sim = Sim::start(config).await;

    NodeBuilder::new(&name)
        .uninitialized()
        .label(TEST_LABEL, &env.prefix)
        .label("node.kubernetes.io/instance-type", "user-chosen")
        .annotation("alpha.kubernetes.io/provided-node-ip", "10.1.0.6")
        .address("Hostname", &name)
        .create(&env.client)
        .await
        .expect("node");
    // A provided node IP the instance does not have: the sync fails and the taint stays.
    NodeBuilder::new(&bad)
        .uninitialized()
        .label(TEST_LABEL, &env.prefix)
        .annotation("alpha.kubernetes.io/provided-node-ip", "10.250.0.1")
        .create(&env.client)
        .await
        .expect("node");

    let core = Core::start(cp, &env, &sim, &["--leader-elect=false"]);
    let node = eventually("initialisation", Duration::from_secs(30), async || initialised(&env, &name).await).await;

    let spec = node.spec.clone().unwrap_or_default();
    assert_eq!(spec.provider_id.as_deref(), Some("sim://sim-region-1a/i-a"));
    let addresses: Vec<(String, String)> =
        node.status.clone().unwrap_or_default().addresses.unwrap_or_default().into_iter().map(|a| (a.type_, a.address)).collect();
    assert_eq!(
        addresses,
        vec![
            ("InternalIP".to_string(), "10.1.0.6".to_string()),
            ("ExternalIP".to_string(), "198.51.100.5".to_string()),
            ("Hostname".to_string(), name.clone()),
        ],
        "the provided node IP is the only InternalIP, the kubelet's hostname kept"
    );
    let l = labels(&node);
    assert_eq!(l.get("topology.kubernetes.io/zone").map(String::as_str), Some("sim-region-1a"));
    assert_eq!(l.get("topology.kubernetes.io/region").map(String::as_str), Some("sim-region-1"));
    assert_eq!(
        l.get("node.kubernetes.io/instance-type").map(String::as_str),
        Some("sim.large"),
        "the instance type is the cloud's: a wrong claim is corrected"
    );
    assert_eq!(l.get("tags.cloudprovider.dev/team").map(String::as_str), Some("payments"));
    assert!(!l.keys().any(|k| k.contains("bad") || k.ends_with("/owner")), "invalid tags are skipped: {l:?}");

    let reasons = eventually("events", Duration::from_secs(10), async || {
        let r = event_reasons(&env, &name).await;
        let want = ["Synced", "InvalidInstanceTags", "NodeMetadataCorrected"];
        want.iter().all(|w| r.iter().any(|x| x == w)).then_some(r)
    })
    .await;
    assert!(reasons.contains(&"Synced".to_string()));

    let failed = eventually("a failure event for the bad provided IP", Duration::from_secs(20), async || {
        let r = event_reasons(&env, &bad).await;
        r.contains(&"NodeInitializationFailed".to_string()).then_some(r)
    })
    .await;
    assert!(!failed.is_empty());
    let still = env.nodes().get(&bad).await.expect("node");
    assert!(
        taints(&still).iter().any(|t| t == UNINITIALIZED_TAINT),
        "the taint stays when the provided IP is not the instance's"
    );
    assert!(still.spec.and_then(|s| s.provider_id).is_none());

    core.stop().await.expect("core stops cleanly");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_providerid_the_kubelet_wrote_in_another_form_is_kept_and_the_node_initialised() {
    // The kubelet set a valid providerID with the zone it believed (`sim://<its zone>/i-k`);
    // the cloud names the instance `sim://sim-region-1b/i-k`. As upstream does, the Node keeps
    // its providerID (immutable anyway) and is initialised from the cloud's answer; and two
    // uninitialised Nodes read in one reordered batch each get their own instance.
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "idform").await.expect("env");
    let (k, x, y) = (env.node_name("k"), env.node_name("x"), env.node_name("y"));
    let mut config = Config::default();
    config.instances.push(instance("i-k", &k, "sim-region-1b"));
    config.instances.push(instance("i-x", &x, "sim-region-1a"));
    config.instances.push(instance("i-y", &y, "sim-region-1b"));
    config.faults.push(Fault {
        method: "BatchInstanceMetadata".into(),
        lie: Some(ccm_provider_sim::config::Lie::Reorder),
        ..Default::default()
    });
    let sim = Sim::start(config).await;
    NodeBuilder::new(&k)
        .uninitialized()
        .label(TEST_LABEL, &env.prefix)
        .provider_id("sim://zone-the-kubelet-said/i-k")
        .pod_cidr("10.244.77.0/24")
        .create(&env.client)
        .await
        .expect("node");
    for n in [&x, &y] {
        NodeBuilder::new(n).uninitialized().label(TEST_LABEL, &env.prefix).create(&env.client).await.expect("node");
    }
    let cluster = format!("--cluster-name={}", env.prefix);
    let flags = ["--leader-elect=false", "--cluster-cidr=10.244.0.0/16", &cluster, "--route-resync-period=1s"];
    let core = Core::start(cp, &env, &sim, &flags);
    let node = eventually("initialisation", Duration::from_secs(30), async || initialised(&env, &k).await).await;
    assert_eq!(node.spec.as_ref().and_then(|s| s.provider_id.as_deref()), Some("sim://zone-the-kubelet-said/i-k"));
    // Its route: the cloud records the instance in its own form, and the route is kept, not
    // taken for another instance's and remade at every resync.
    eventually("the route", Duration::from_secs(30), async || {
        let state = sim.admin.state().await.ok()?;
        let mut routes = state.route_tables.into_iter().flat_map(|t| t.routes);
        routes.any(|r| r.node_name == k && r.destination_cidr == "10.244.77.0/24").then_some(())
    })
    .await;
    let made = calls(&sim, ROUTE_WRITES).await;
    assert!(made >= 1, "the route was made with a call counted here");
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(calls(&sim, ROUTE_WRITES).await, made, "four resyncs later, no route remade");
    assert_eq!(labels(&node).get("topology.kubernetes.io/zone").map(String::as_str), Some("sim-region-1b"), "from the cloud");
    for (n, id, zone) in [(&x, "sim://sim-region-1a/i-x", "sim-region-1a"), (&y, "sim://sim-region-1b/i-y", "sim-region-1b")] {
        let node = eventually("initialisation", Duration::from_secs(30), async || initialised(&env, n).await).await;
        assert_eq!(node.spec.as_ref().and_then(|s| s.provider_id.as_deref()), Some(id), "{n} got its own instance");
        assert_eq!(labels(&node).get("topology.kubernetes.io/zone").map(String::as_str), Some(zone));
    }
    assert!(!event_reasons(&env, &k).await.iter().any(|r| r == "InvalidProviderAnswer"));
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_during_an_initialisation_do_not_cause_a_second_lookup() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "once").await.expect("env");
    let name = env.node_name("a");
    let mut config = Config::default();
    config.instances.push(instance("i-a", &name, "sim-region-1a"));
    config.api.latency_ms = 1500;
    let sim = Sim::start(config).await;
    NodeBuilder::new(&name).uninitialized().label(TEST_LABEL, &env.prefix).create(&env.client).await.expect("node");
    // The node controller alone: the lifecycle controller would look up this NotReady node too.
    let core = Core::start(cp, &env, &sim, &["--leader-elect=false", "--controllers=cloud-node"]);

    // Wait for the lookup to be in flight, then keep updating the Node while it is.
    eventually("the provider to be ready", Duration::from_secs(20), async || {
        (sim.admin.call_count("IdentityService/Probe").await.ok()? > 0).then_some(())
    })
    .await;
    for i in 0..10 {
        let patch = serde_json::json!({ "metadata": { "labels": { "heartbeat": i.to_string() } } });
        env.nodes().patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("patch");
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    eventually("initialisation", Duration::from_secs(30), async || initialised(&env, &name).await).await;
    // Updates after the initialisation, before and after the cache catches up.
    for i in 10..15 {
        let patch = serde_json::json!({ "metadata": { "labels": { "heartbeat": i.to_string() } } });
        env.nodes().patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("patch");
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let log = sim.admin.call_log().await.expect("log");
    assert_eq!(calls(&sim, METADATA_CALLS).await, 1, "exactly one instance lookup for one node: {log:#?}");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn excluded_nodes_and_other_providers_nodes_are_left_alone() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "skip").await.expect("env");
    let (ours, virt, foreign) = (env.node_name("ours"), env.node_name("virtual"), env.node_name("foreign"));
    let mut config = Config::default();
    for (id, n) in [("i-1", &ours), ("i-2", &virt), ("i-3", &foreign)] {
        config.instances.push(instance(id, n, "sim-region-1a"));
    }
    let sim = Sim::start(config).await;
    NodeBuilder::new(&ours).uninitialized().label(TEST_LABEL, &env.prefix).create(&env.client).await.expect("node");
    NodeBuilder::new(&virt)
        .uninitialized()
        .label(TEST_LABEL, &env.prefix)
        .label("type", "virtual-kubelet")
        .create(&env.client)
        .await
        .expect("node");
    NodeBuilder::new(&foreign)
        .uninitialized()
        .label(TEST_LABEL, &env.prefix)
        .provider_id("aws:///us-east-1a/i-0abc")
        .create(&env.client)
        .await
        .expect("node");
    let core = Core::start(
        cp,
        &env,
        &sim,
        &["--leader-elect=false", "--controllers=cloud-node", "--node-exclude-selector=type=virtual-kubelet"],
    );
    eventually("our node's initialisation", Duration::from_secs(30), async || initialised(&env, &ours).await).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    for name in [&virt, &foreign] {
        let node = env.nodes().get(name).await.expect("node");
        assert!(taints(&node).iter().any(|t| t == UNINITIALIZED_TAINT), "{name} was touched");
        assert!(!labels(&node).contains_key("topology.kubernetes.io/zone"), "{name} was touched");
    }
    assert_eq!(calls(&sim, METADATA_CALLS).await, 1, "only our node was looked up");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gone_instances_delete_nodes_stopped_ones_taint_them_and_errors_change_nothing() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "life").await.expect("env");
    let (gone, stopped, flaky) = (env.node_name("gone"), env.node_name("stopped"), env.node_name("flaky"));
    let mut config = Config::default();
    for (id, n) in [("i-gone", &gone), ("i-stopped", &stopped), ("i-flaky", &flaky)] {
        config.instances.push(instance(id, n, "sim-region-1a"));
    }
    // Three Ready Nodes besides, with instances: every Node NotReady at once would be an
    // outage, and without a Ready Node whose instance exists nothing witnesses the provider's
    // answer; either way the lifecycle controller deletes nothing.
    for k in 0..3 {
        let name = env.node_name(&format!("fine-{k}"));
        let id = format!("i-fine-{k}");
        config.instances.push(instance(&id, &name, "sim-region-1a"));
        NodeBuilder::new(&name)
            .label(TEST_LABEL, &env.prefix)
            .provider_id(&format!("sim://sim-region-1a/{id}"))
            .create(&env.client)
            .await
            .expect("node");
        set_ready(&env.client, &name, "True").await.expect("ready");
    }
    let sim = Sim::start(config).await;
    for (id, n) in [("i-gone", &gone), ("i-stopped", &stopped), ("i-flaky", &flaky)] {
        NodeBuilder::new(n)
            .label(TEST_LABEL, &env.prefix)
            .provider_id(&format!("sim://sim-region-1a/{id}"))
            .create(&env.client)
            .await
            .expect("node");
        set_ready(&env.client, n, "False").await.expect("not ready");
    }
    // One deletion may come every 2 s (with 6 Nodes the bound is 1).
    let core = Core::start(cp, &env, &sim, &["--leader-elect=false", "--node-monitor-period=300ms", "--node-deletion-window=2s"]);

    // An unavailable provider: the Node of a terminated instance stays.
    let down = Fault {
        method: "*".into(),
        error_rate: 0.0,
        down: true,
        code: FaultCode::Unavailable,
        subject: None,
        retry_after_ms: None,
        ..Default::default()
    };
    sim.admin.set_faults(&[down]).await.expect("faults");
    sim.admin.instance_action("i-flaky", "terminate").await.expect("terminate");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(env.nodes().get_opt(&flaky).await.expect("get").is_some(), "an error must never delete a node");
    sim.admin.set_faults(&[]).await.expect("clear");
    eventually("the flaky node's deletion once the cloud answers", Duration::from_secs(20), async || {
        env.nodes().get_opt(&flaky).await.ok()?.is_none().then_some(())
    })
    .await;

    sim.admin.instance_action("i-gone", "terminate").await.expect("terminate");
    eventually("deletion", Duration::from_secs(20), async || env.nodes().get_opt(&gone).await.ok()?.is_none().then_some(()))
        .await;
    eventually("a DeletingNode event", Duration::from_secs(10), async || {
        event_reasons(&env, &gone).await.contains(&"DeletingNode".to_string()).then_some(())
    })
    .await;

    sim.admin.instance_action("i-stopped", "stop").await.expect("stop");
    eventually("shutdown taint", Duration::from_secs(20), async || {
        let n = env.nodes().get(&stopped).await.ok()?;
        taints(&n).iter().any(|t| t == SHUTDOWN_TAINT).then_some(())
    })
    .await;
    // Without --out-of-service-after, a shut-down instance never takes its Node out of service.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let n = env.nodes().get(&stopped).await.expect("node");
    assert!(!taints(&n).iter().any(|t| t == OUT_OF_SERVICE_TAINT), "no out-of-service taint with the flag off");
    sim.admin.instance_action("i-stopped", "start").await.expect("start");
    eventually("shutdown taint removed", Duration::from_secs(20), async || {
        let n = env.nodes().get(&stopped).await.ok()?;
        (!taints(&n).iter().any(|t| t == SHUTDOWN_TAINT)).then_some(())
    })
    .await;
    assert!(env.nodes().get_opt(&stopped).await.expect("get").is_some(), "a stopped instance's node is not deleted");

    // Ready Nodes cost no provider calls.
    set_ready(&env.client, &stopped, "True").await.expect("ready");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = calls(&sim, METADATA_CALLS).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(calls(&sim, METADATA_CALLS).await, before, "no lookups while every node is ready");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_down_at_start_is_waited_for() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "down").await.expect("env");
    let name = env.node_name("a");
    let mut sim = Sim::not_started();
    NodeBuilder::new(&name).uninitialized().label(TEST_LABEL, &env.prefix).create(&env.client).await.expect("node");
    let port = free_port();
    let port_flag = format!("--secure-port={port}");
    let core =
        Core::start(cp, &env, &sim, &["--leader-elect=false", &port_flag, "--insecure-serving", "--bind-address=127.0.0.1"]);
    let base = core.health.clone().expect("health address");
    let (status, body) = eventually("/readyz", Duration::from_secs(20), async || http_get(&base, "/readyz").await).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("provider"), "{body}");
    assert_eq!(http_get(&base, "/healthz").await.map(|r| r.0), Some(200));

    let mut config = Config::default();
    config.instances.push(instance("i-a", &name, "sim-region-1a"));
    sim.launch(config).await;
    eventually("ready once the provider is up", Duration::from_secs(30), async || {
        (http_get(&base, "/readyz").await?.0 == 200).then_some(())
    })
    .await;
    eventually("initialisation without a restart", Duration::from_secs(30), async || initialised(&env, &name).await).await;
    let (_, metrics) = http_get(&base, "/metrics").await.expect("metrics");
    assert!(metrics.contains("ccm_provider_calls_total"), "{metrics}");
    assert!(metrics.contains("ccm_reconcile_duration_seconds"), "{metrics}");
    core.stop().await.expect("stop");
    sim.stop().await;
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_are_waited_out_and_retries_back_off_despite_updates() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "throttle").await.expect("env");
    let name = env.node_name("a");
    let mut config = Config::default();
    config.instances.push(instance("i-a", &name, "sim-region-1a"));
    // Every lookup is throttled, answering RESOURCE_EXHAUSTED with RetryInfo of 1 s.
    config.faults.push(Fault {
        method: "BatchInstanceMetadata".into(),
        error_rate: 1.0,
        down: false,
        code: FaultCode::RateLimited,
        subject: None,
        retry_after_ms: None,
        ..Default::default()
    });
    let sim = Sim::start(config).await;
    NodeBuilder::new(&name).uninitialized().label(TEST_LABEL, &env.prefix).create(&env.client).await.expect("node");
    let core = Core::start(cp, &env, &sim, &["--leader-elect=false", "--controllers=cloud-node", "--reconcile-backoff-base=1s"]);

    // Updates keep arriving while the key backs off; none of them changes what it acts on.
    let started = tokio::time::Instant::now();
    let mut i = 0;
    while started.elapsed() < Duration::from_secs(14) {
        let patch = serde_json::json!({ "metadata": { "labels": { "heartbeat": i.to_string() } } });
        env.nodes().patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("patch");
        i += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let times: Vec<u64> = sim
        .admin
        .call_log()
        .await
        .expect("log")
        .into_iter()
        .filter(|c| c.method == "InstancesService/BatchInstanceMetadata")
        .map(|c| c.at_unix_ms)
        .collect();
    let gaps: Vec<u64> = times.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(times.len() >= 4, "retries happen: {times:?}");
    assert!(times.len() <= 12, "no hot loop: {} lookups in 14 s (gaps {gaps:?})", times.len());
    assert!(gaps.iter().all(|g| *g >= 950), "every retry waits at least the RetryInfo delay: {gaps:?}");
    assert!(gaps.iter().any(|g| *g >= 1900), "the backoff grows past the RetryInfo delay: {gaps:?}");

    sim.admin.set_faults(&[]).await.expect("clear");
    eventually("initialisation once the throttling ends", Duration::from_secs(30), async || initialised(&env, &name).await).await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

async fn is_leader(base: &str) -> Option<bool> {
    let (_, text) = http_get(base, "/metrics").await?;
    let line = text.lines().find(|l| l.starts_with("ccm_leader_is_leader "))?;
    Some(line.ends_with(" 1"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_acts_and_a_standby_takes_over() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "lead").await.expect("env");
    let (first, second) = (env.node_name("first"), env.node_name("second"));
    let mut config = Config::default();
    config.instances.push(instance("i-1", &first, "sim-region-1a"));
    config.instances.push(instance("i-2", &second, "sim-region-1a"));
    let sim = Sim::start(config).await;
    let flags = |port: u16| {
        vec![
            format!("--secure-port={port}"),
            "--insecure-serving".to_string(),
            "--bind-address=127.0.0.1".to_string(),
            "--leader-elect=true".to_string(),
            "--leader-elect-lease-duration=4s".to_string(),
            "--leader-elect-renew-deadline=2s".to_string(),
            "--leader-elect-retry-period=1s".to_string(),
        ]
    };
    let (fa, fb) = (flags(free_port()), flags(free_port()));
    let a = Core::start(cp, &env, &sim, &fa.iter().map(String::as_str).collect::<Vec<_>>());
    let b = Core::start(cp, &env, &sim, &fb.iter().map(String::as_str).collect::<Vec<_>>());
    let (ha, hb) = (a.health.clone().expect("a"), b.health.clone().expect("b"));
    let a_leads =
        eventually("one leader", Duration::from_secs(30), async || match (is_leader(&ha).await?, is_leader(&hb).await?) {
            (true, false) => Some(true),
            (false, true) => Some(false),
            _ => None,
        })
        .await;
    NodeBuilder::new(&first).uninitialized().label(TEST_LABEL, &env.prefix).create(&env.client).await.expect("node");
    eventually("the leader initialises", Duration::from_secs(30), async || initialised(&env, &first).await).await;
    // Both stay as they are: exactly one leader.
    assert_eq!(is_leader(&ha).await, Some(a_leads));
    assert_eq!(is_leader(&hb).await, Some(!a_leads));

    let (leader, standby, standby_health) = if a_leads { (a, b, hb) } else { (b, a, ha) };
    let stopped = tokio::time::Instant::now();
    leader.stop().await.expect("the leader stops cleanly");
    eventually("the standby to take over", Duration::from_secs(10), async || is_leader(&standby_health).await?.then_some(()))
        .await;
    let took = stopped.elapsed();
    assert!(took <= Duration::from_secs(6), "takeover within the lease duration, took {took:?}");
    NodeBuilder::new(&second).uninitialized().label(TEST_LABEL, &env.prefix).create(&env.client).await.expect("node");
    eventually("the new leader initialises", Duration::from_secs(30), async || initialised(&env, &second).await).await;
    standby.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn addresses_are_refreshed_with_batched_reads() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "refresh").await.expect("env");
    let names: Vec<String> = (0..3).map(|i| env.node_name(&format!("n{i}"))).collect();
    let mut config = Config::default();
    for (i, n) in names.iter().enumerate() {
        let mut spec = instance(&format!("i-{i}"), n, "sim-region-1a");
        spec.addresses = vec![Address { kind: "InternalIP".into(), address: format!("10.3.0.{i}") }];
        config.instances.push(spec);
    }
    let sim = Sim::start(config).await;
    for n in &names {
        NodeBuilder::new(n).uninitialized().label(TEST_LABEL, &env.prefix).create(&env.client).await.expect("node");
    }
    let core =
        Core::start(cp, &env, &sim, &["--leader-elect=false", "--controllers=cloud-node", "--node-status-update-frequency=1s"]);
    for n in &names {
        eventually("initialisation", Duration::from_secs(30), async || initialised(&env, n).await).await;
    }
    sim.admin
        .set_addresses("i-1", &[Address { kind: "InternalIP".into(), address: "10.3.9.9".into() }])
        .await
        .expect("new address");
    sim.admin.reset_calls().await.expect("reset");
    eventually("the new address on the node", Duration::from_secs(15), async || {
        let node = env.nodes().get(&names[1]).await.ok()?;
        let addresses = node.status?.addresses?;
        addresses.iter().any(|a| a.address == "10.3.9.9").then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let batch = sim.admin.call_count("InstancesService/BatchInstanceMetadata").await.expect("calls");
    let single = sim.admin.call_count("InstancesService/InstanceMetadata").await.expect("calls");
    assert_eq!(single, 0, "refreshes read in batches");
    assert!((1..=8).contains(&batch), "about one batch call per refresh period for all three nodes, got {batch}");
    // The other nodes kept their addresses.
    let other = env.nodes().get(&names[0]).await.expect("node");
    assert_eq!(other.status.and_then(|s| s.addresses).unwrap_or_default()[0].address, "10.3.0.0");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_server_speaks_https_by_default() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "tls").await.expect("env");
    let sim = Sim::start(Config::default()).await;
    let port = free_port();
    let port_flag = format!("--secure-port={port}");
    let core = Core::start(cp, &env, &sim, &["--leader-elect=false", &port_flag, "--bind-address=127.0.0.1"]);
    let url = format!("https://127.0.0.1:{port}/healthz");
    let body = eventually("an HTTPS answer", Duration::from_secs(20), async || {
        let out = tokio::process::Command::new("curl").args(["-sk", "--max-time", "2", &url]).output().await.ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    })
    .await;
    assert_eq!(body, "ok");
    // Plain HTTP is not served on the secure port.
    assert_ne!(http_get(&format!("http://127.0.0.1:{port}"), "/healthz").await.map(|r| r.0), Some(200));
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_service_account_credentials_a_controller_has_only_what_its_account_is_granted() {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use kube::api::{DeleteParams, PostParams};

    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "sa").await.expect("env");
    let name = env.node_name("a");
    let mut config = Config::default();
    config.instances.push(instance("i-a", &name, "sim-region-1a"));
    let sim = Sim::start(config).await;
    NodeBuilder::new(&name).uninitialized().label(TEST_LABEL, &env.prefix).create(&env.client).await.expect("node");
    // The process itself is admin; the node controller writes as kube-system/cloud-node-controller
    // (one account per controller: upstream's node-controller is granted by the API server's
    // bootstrap roles), which has no permissions yet.
    let flags = [
        "--leader-elect=false",
        "--controllers=cloud-node",
        "--use-service-account-credentials",
        "--service-account-names=controller",
    ];
    let core = Core::start(cp, &env, &sim, &flags);
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(initialised(&env, &name).await.is_none(), "the controller's own account may not patch nodes yet");

    let role_name = format!("{}-cloud-node-controller", env.prefix);
    let rule = |groups: &[&str], resources: &[&str], verbs: &[&str]| PolicyRule {
        api_groups: Some(groups.iter().map(|s| s.to_string()).collect()),
        resources: Some(resources.iter().map(|s| s.to_string()).collect()),
        verbs: verbs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    let role = ClusterRole {
        metadata: ObjectMeta { name: Some(role_name.clone()), ..Default::default() },
        rules: Some(vec![
            rule(&[""], &["nodes"], &["get", "list", "watch", "patch", "update"]),
            rule(&[""], &["nodes/status"], &["patch", "update"]),
            rule(&["", "events.k8s.io"], &["events"], &["create", "patch", "update"]),
        ]),
        ..Default::default()
    };
    let binding = ClusterRoleBinding {
        metadata: ObjectMeta { name: Some(role_name.clone()), ..Default::default() },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: role_name.clone(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: "cloud-node-controller".into(),
            namespace: Some("kube-system".into()),
            ..Default::default()
        }]),
    };
    Api::<ClusterRole>::all(env.client.clone()).create(&PostParams::default(), &role).await.expect("role");
    Api::<ClusterRoleBinding>::all(env.client.clone()).create(&PostParams::default(), &binding).await.expect("binding");
    eventually("initialisation once the account is granted", Duration::from_secs(30), async || initialised(&env, &name).await)
        .await;

    core.stop().await.expect("stop");
    let _ = Api::<ClusterRoleBinding>::all(env.client.clone()).delete(&role_name, &DeleteParams::default()).await;
    let _ = Api::<ClusterRole>::all(env.client.clone()).delete(&role_name, &DeleteParams::default()).await;
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_lease_stops_the_process() {
    use k8s_openapi::api::coordination::v1::Lease;

    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "failstop").await.expect("env");
    let sim = Sim::start(Config::default()).await;
    let port = free_port();
    let port_flag = format!("--secure-port={port}");
    let core = Core::start(
        cp,
        &env,
        &sim,
        &[
            &port_flag,
            "--insecure-serving",
            "--bind-address=127.0.0.1",
            "--leader-elect=true",
            "--leader-elect-lease-duration=4s",
            "--leader-elect-renew-deadline=2s",
            "--leader-elect-retry-period=500ms",
        ],
    );
    let base = core.health.clone().expect("health");
    eventually("leadership", Duration::from_secs(30), async || {
        let (_, text) = http_get(&base, "/metrics").await?;
        text.lines().any(|l| l == "ccm_leader_is_leader 1").then_some(())
    })
    .await;
    // Another process takes the lease over (as after a network partition).
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.namespace);
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(k8s_openapi::jiff::Timestamp::now());
    let patch = serde_json::json!({ "spec": { "holderIdentity": "someone-else", "renewTime": now, "acquireTime": now, "leaseDurationSeconds": 3600 } });
    leases.patch(&env.prefix, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("take the lease");
    let result = tokio::time::timeout(Duration::from_secs(20), core.task).await.expect("the process stops").expect("join");
    let error = result.expect_err("losing the lease is an error exit");
    assert!(format!("{error:#}").contains("lost the leader lease"), "{error:#}");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_gone_instances_than_the_bound_are_deleted_at_its_pace_and_an_outage_deletes_none() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "bound").await.expect("env");
    let mut config = Config::default();
    // Three Ready Nodes in zone a; three NotReady ones, one in each of zones b, c and d,
    // whose instances are gone; a fourth in zone e, Ready for now.
    let ready: Vec<String> = (0..3).map(|k| env.node_name(&format!("ok-{k}"))).collect();
    let gone: Vec<String> = (0..4).map(|k| env.node_name(&format!("gone-{k}"))).collect();
    for (k, name) in ready.iter().chain(&gone).enumerate() {
        let zone = if k < 3 { "zone-a".to_string() } else { format!("zone-{}", ["b", "c", "d", "e"][k - 3]) };
        config.instances.push(instance(&format!("i-{k}"), name, &zone));
        NodeBuilder::new(name)
            .label(TEST_LABEL, &env.prefix)
            .label("topology.kubernetes.io/zone", &zone)
            .provider_id(&format!("sim://{zone}/i-{k}"))
            .create(&env.client)
            .await
            .expect("node");
        set_ready(&env.client, name, if k < 3 || k == 6 { "True" } else { "False" }).await.expect("condition");
    }
    let sim = Sim::start(config).await;
    for k in 3..6 {
        sim.admin.instance_action(&format!("i-{k}"), "terminate").await.expect("terminate");
    }
    let window = Duration::from_secs(6);
    let core = Core::start(
        cp,
        &env,
        &sim,
        &[
            "--leader-elect=false",
            "--node-monitor-period=300ms",
            "--max-node-deletions=2",
            "--max-node-deletion-share=1",
            "--node-deletion-window=6s",
        ],
    );

    // Three gone, two may go in a window: the two oldest now, the third once the window has
    // room (a Normal Event says it waits), not before.
    let started = std::time::Instant::now();
    for name in &gone[..2] {
        eventually("deleted within the bound", Duration::from_secs(20), async || {
            env.nodes().get_opt(name).await.ok()?.is_none().then_some(())
        })
        .await;
    }
    let first = started.elapsed();
    assert!(env.nodes().get_opt(&gone[2]).await.expect("get").is_some(), "the third waits for room in the window");
    eventually("a NodeDeletionDeferred event", Duration::from_secs(10), async || {
        event_reasons(&env, &gone[2]).await.contains(&"NodeDeletionDeferred".to_string()).then_some(())
    })
    .await;
    eventually("the third deleted a window later", Duration::from_secs(30), async || {
        env.nodes().get_opt(&gone[2]).await.ok()?.is_none().then_some(())
    })
    .await;
    let third = started.elapsed();
    assert!(third >= window.saturating_sub(first).max(Duration::from_secs(4)), "not within the first window: {third:?}");
    assert!(!event_reasons(&env, &gone[0]).await.contains(&"NodeDeletionRefused".to_string()), "paced, not refused");

    // Every Node NotReady (more than two): an outage, not gone instances. The last gone
    // instance's Node stays, until some Nodes are Ready again.
    sim.admin.instance_action("i-6", "terminate").await.expect("terminate");
    for name in ready.iter().chain([&gone[3]]) {
        set_ready(&env.client, name, "False").await.expect("not ready");
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(env.nodes().get_opt(&gone[3]).await.expect("get").is_some(), "nothing is deleted while every Node is NotReady");
    assert!(event_reasons(&env, &gone[3]).await.contains(&"NodeDeletionRefused".to_string()), "refused, with a Warning");
    set_ready(&env.client, &ready[0], "True").await.expect("ready");
    eventually("deleted once the outage is over", Duration::from_secs(20), async || {
        env.nodes().get_opt(&gone[3]).await.ok()?.is_none().then_some(())
    })
    .await;
    for name in &ready {
        assert!(env.nodes().get_opt(name).await.expect("get").is_some(), "{name}'s instance exists");
    }
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

/// Nodes whose deletion the window defers, pass after pass, each have one Event series (one
/// object per Node and reason, counted up), not a new Event every pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_deferred_pass_after_pass_have_one_event_each() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "deferev").await.expect("env");
    let mut config = Config::default();
    // Ten Ready Nodes and eight NotReady ones whose instances are gone, in one zone (not a
    // disrupted one: 8 of 18).
    let names: Vec<String> = (0..18).map(|k| env.node_name(&format!("n-{k}"))).collect();
    for (k, name) in names.iter().enumerate() {
        config.instances.push(instance(&format!("i-{k}"), name, "zone-a"));
        NodeBuilder::new(name)
            .label(TEST_LABEL, &env.prefix)
            .label("topology.kubernetes.io/zone", "zone-a")
            .provider_id(&format!("sim://zone-a/i-{k}"))
            .create(&env.client)
            .await
            .expect("node");
        set_ready(&env.client, name, if k < 10 { "True" } else { "False" }).await.expect("condition");
    }
    let sim = Sim::start(config).await;
    for k in 10..18 {
        sim.admin.instance_action(&format!("i-{k}"), "terminate").await.expect("terminate");
    }
    let core = Core::start(
        cp,
        &env,
        &sim,
        &[
            "--leader-elect=false",
            "--node-monitor-period=500ms",
            "--max-node-deletions=1",
            "--max-node-deletion-share=1",
            "--node-deletion-window=10m",
        ],
    );
    let gone = &names[10..];
    eventually("one gone Node deleted, the rest deferred", Duration::from_secs(20), async || {
        let mut left = 0;
        for name in gone {
            left += usize::from(env.nodes().get_opt(name).await.ok()?.is_some());
        }
        (left == 7).then_some(())
    })
    .await;
    // About 16 passes.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let events: Api<Event> = Api::all(env.client.clone());
    let mut counted = 0;
    for name in gone {
        if env.nodes().get_opt(name).await.expect("get").is_none() {
            continue;
        }
        let list = events.list(&ListParams::default().fields(&format!("involvedObject.name={name}"))).await.expect("events");
        let deferred: Vec<_> = list.items.iter().filter(|e| e.reason.as_deref() == Some("NodeDeletionDeferred")).collect();
        assert_eq!(deferred.len(), 1, "{name}: one NodeDeletionDeferred Event, not one a pass: {deferred:?}");
        counted += deferred[0].series.as_ref().and_then(|s| s.count).unwrap_or(1);
    }
    assert!(counted >= 14, "the repeats are counted on the series: {counted}");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

/// Every lookup throttled with a RetryInfo of an hour.
fn an_hour_of_throttling() -> Fault {
    Fault {
        method: "BatchInstanceMetadata".into(),
        error_rate: 1.0,
        down: false,
        code: FaultCode::RateLimited,
        subject: None,
        retry_after_ms: Some(3_600_000),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_info_of_hours_is_cut_to_the_maximum() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "hours").await.expect("env");
    let name = env.node_name("a");
    let mut config = Config::default();
    config.instances.push(instance("i-a", &name, "sim-region-1a"));
    config.faults.push(an_hour_of_throttling());
    let sim = Sim::start(config).await;
    NodeBuilder::new(&name).uninitialized().label(TEST_LABEL, &env.prefix).create(&env.client).await.expect("node");
    let flags =
        ["--leader-elect=false", "--controllers=cloud-node", "--provider-max-retry-after=2s", "--reconcile-backoff-max=2s"];
    let core = Core::start(cp, &env, &sim, &flags);
    eventually("a throttled lookup", Duration::from_secs(20), async || (calls(&sim, METADATA_CALLS).await > 0).then_some(()))
        .await;
    sim.admin.set_faults(&[]).await.expect("clear");
    // An hour's delay, honoured, would leave the Node uninitialised for an hour.
    eventually("initialised within the cut delay", Duration::from_secs(15), async || initialised(&env, &name).await).await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_provider_while_it_throttles() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "probe").await.expect("env");
    let name = env.node_name("a");
    let mut config = Config::default();
    config.instances.push(instance("i-a", &name, "sim-region-1a"));
    config.faults.push(an_hour_of_throttling());
    let sim = Sim::start(config).await;
    NodeBuilder::new(&name).uninitialized().label(TEST_LABEL, &env.prefix).create(&env.client).await.expect("node");
    let port = free_port();
    let port_flag = format!("--secure-port={port}");
    let core = Core::start(
        cp,
        &env,
        &sim,
        &["--leader-elect=false", "--controllers=cloud-node", &port_flag, "--insecure-serving", "--bind-address=127.0.0.1"],
    );
    let base = core.health.clone().expect("health address");
    eventually("ready and throttled", Duration::from_secs(20), async || {
        let ready = http_get(&base, "/readyz").await?.0 == 200;
        (ready && calls(&sim, METADATA_CALLS).await > 0).then_some(())
    })
    .await;
    // The cloud goes down and Probe says so: readiness follows at the next probe, although
    // every other call waits out the throttling (5 minutes at most by default).
    let down = Fault { method: "*".into(), down: true, ..Default::default() };
    sim.admin.set_faults(&[an_hour_of_throttling(), down]).await.expect("faults");
    eventually("not ready once Probe fails", Duration::from_secs(25), async || {
        (http_get(&base, "/readyz").await?.0 == 503).then_some(())
    })
    .await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_while_the_watches_fail() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "watchfail").await.expect("env");
    let sim = Sim::start(Config::default()).await;
    let target = cp.server().trim_start_matches("https://").parse().expect("the API server's address");
    let proxy = crate::support::Blackhole::start(target).await;
    let kubeconfig = crate::support::kubeconfig_via(cp.kubeconfig_path(), cp.server(), proxy.addr);
    let port = free_port();
    let port_flag = format!("--secure-port={port}");
    let flags = [
        "--leader-elect=false",
        &port_flag,
        "--insecure-serving",
        "--bind-address=127.0.0.1",
        "--watch-failure-threshold=3s",
        "--kube-api-read-timeout=20s",
    ];
    let core = Core::start_on(&kubeconfig, &env, &sim.endpoint, &flags);
    let base = core.health.clone().expect("health address");
    eventually("ready", Duration::from_secs(30), async || (http_get(&base, "/readyz").await?.0 == 200).then_some(())).await;
    // The API server unreachable: the watches fail, the caches go stale, and readiness says so.
    proxy.refuse();
    let body = eventually("not ready while the watches fail", Duration::from_secs(30), async || {
        let (status, body) = http_get(&base, "/readyz").await?;
        (status == 503).then_some(body)
    })
    .await;
    assert!(body.contains("watch has been failing"), "{body}");
    proxy.restore();
    let mut last = String::new();
    for _ in 0..120 {
        let (status, body) = http_get(&base, "/readyz").await.unwrap_or_default();
        if status == 200 {
            break;
        }
        last = body;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(http_get(&base, "/readyz").await.map(|r| r.0), Some(200), "ready once the watches work again: {last}");

    // Half-open: connections stay up but nothing comes through (a NAT that forgot them).
    // The watches must not hang on them for ever: within the read timeout they fail, and
    // readiness says so.
    proxy.pause();
    let paused = std::time::Instant::now();
    let body = eventually("not ready while the connections are silent", Duration::from_secs(60), async || {
        let (status, body) = http_get(&base, "/readyz").await?;
        (status == 503).then_some(body)
    })
    .await;
    assert!(body.contains("watch has been failing"), "{body}");
    eprintln!("a silent API server noticed after {:.1} s", paused.elapsed().as_secs_f64());
    proxy.restore();
    eventually("ready once the connections carry again", Duration::from_secs(90), async || {
        (http_get(&base, "/readyz").await?.0 == 200).then_some(())
    })
    .await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shut_down_instance_takes_its_node_out_of_service_after_the_delay_never_on_errors() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "oos").await.expect("env");
    let (off, other) = (env.node_name("off"), env.node_name("other"));
    let mut config = Config::default();
    config.instances.push(instance("i-off", &off, "sim-region-1a"));
    config.instances.push(instance("i-other", &other, "sim-region-1a"));
    // Ready Nodes besides (witnesses; every Node NotReady would be an outage).
    for k in 0..3 {
        let name = env.node_name(&format!("fine-{k}"));
        config.instances.push(instance(&format!("i-fine-{k}"), &name, "sim-region-1a"));
        NodeBuilder::new(&name)
            .label(TEST_LABEL, &env.prefix)
            .provider_id(&format!("sim://sim-region-1a/i-fine-{k}"))
            .create(&env.client)
            .await
            .expect("node");
        set_ready(&env.client, &name, "True").await.expect("ready");
    }
    let sim = Sim::start(config).await;
    for (id, n) in [("i-off", &off), ("i-other", &other)] {
        NodeBuilder::new(n)
            .label(TEST_LABEL, &env.prefix)
            .provider_id(&format!("sim://sim-region-1a/{id}"))
            .create(&env.client)
            .await
            .expect("node");
    }
    set_ready(&env.client, &off, "False").await.expect("not ready");
    set_ready(&env.client, &other, "True").await.expect("ready");
    // An operator's own out-of-service taint on a Ready Node: never removed by the core.
    let user_taint = serde_json::json!({ "spec": { "taints": [
        { "key": OUT_OF_SERVICE_TAINT, "value": "maintenance", "effect": "NoExecute" }
    ] } });
    env.nodes().patch(&other, &PatchParams::default(), &Patch::Merge(&user_taint)).await.expect("user taint");
    let delay = Duration::from_secs(3);
    let core = Core::start(
        cp,
        &env,
        &sim,
        &["--leader-elect=false", "--node-monitor-period=300ms", "--out-of-service-after=3s", "--provider-call-timeout=1s"],
    );

    // The instance stops while the provider fails (unavailable, then hanging past the call's
    // deadline): errors are no evidence, however long they last.
    let failing = |down: bool| Fault {
        method: "*".into(),
        down,
        error_rate: 0.0,
        code: FaultCode::Unavailable,
        delay_ms: (!down).then_some(5_000),
        ..Default::default()
    };
    sim.admin.set_faults(&[failing(true)]).await.expect("faults");
    sim.admin.instance_action("i-off", "stop").await.expect("stop");
    tokio::time::sleep(delay + Duration::from_secs(1)).await;
    sim.admin.set_faults(&[failing(false)]).await.expect("hang");
    tokio::time::sleep(delay + Duration::from_secs(1)).await;
    let n = env.nodes().get(&off).await.expect("node");
    assert!(out_of_service(&n).is_none(), "errors and timeouts never take a Node out of service: {:?}", taints(&n));

    // The provider answers: shut down, and after the delay (not before) out of service.
    sim.admin.set_faults(&[]).await.expect("clear");
    let answering = std::time::Instant::now();
    let n = eventually("the out-of-service taint", Duration::from_secs(30), async || {
        let n = env.nodes().get(&off).await.ok()?;
        out_of_service(&n).is_some().then_some(n)
    })
    .await;
    let waited = answering.elapsed();
    assert!(waited >= delay, "tainted {waited:?} after the provider answered, before --out-of-service-after");
    let taint = out_of_service(&n).expect("taint");
    assert_eq!((taint.value.as_deref(), taint.effect.as_str()), (Some("nodeshutdown"), "NoExecute"));
    assert!(annotated_out_of_service(&n), "the core records the taint as its own");
    assert!(taints(&n).iter().any(|t| t == SHUTDOWN_TAINT), "the shutdown taint as well");
    eventually("a NodeOutOfService event", Duration::from_secs(10), async || {
        event_reasons(&env, &off).await.contains(&"NodeOutOfService".to_string()).then_some(())
    })
    .await;

    // Running again but still NotReady: the taint stays; Ready as well: it goes.
    sim.admin.instance_action("i-off", "start").await.expect("start");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let n = env.nodes().get(&off).await.expect("node");
    assert!(out_of_service(&n).is_some(), "kept while the Node is NotReady");
    set_ready(&env.client, &off, "True").await.expect("ready");
    eventually("the out-of-service taint removed", Duration::from_secs(20), async || {
        let n = env.nodes().get(&off).await.ok()?;
        (out_of_service(&n).is_none() && !annotated_out_of_service(&n)).then_some(())
    })
    .await;
    eventually("a NodeBackInService event", Duration::from_secs(10), async || {
        event_reasons(&env, &off).await.contains(&"NodeBackInService".to_string()).then_some(())
    })
    .await;
    let n = env.nodes().get(&other).await.expect("node");
    assert_eq!(out_of_service(&n).and_then(|t| t.value).as_deref(), Some("maintenance"), "an operator's taint stays");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tag_labels_follow_the_instances_tags_and_a_users_label_is_left_alone() {
    let cp = ccm_harness::shared().expect("control plane");
    // Tags read with the metadata (the sim's default, advertised as metadata_tags), and with
    // TagsService from a provider whose metadata carries none.
    for (metadata_tags, read) in [(true, "BatchInstanceMetadata"), (false, "BatchGetInstanceTags")] {
        let env =
            TestEnv::new(cp.client().await.expect("client"), if metadata_tags { "tagm" } else { "tags" }).await.expect("env");
        let name = env.node_name("t");
        let mut config = Config { metadata_tags, ..Config::default() };
        let mut spec = instance("i-t", &name, "sim-region-1a");
        let tags = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>();
        spec.tags = tags(&[("team", "payments"), ("env", "prod"), ("owner", "cloud")]);
        config.instances.push(spec);
        let sim = Sim::start(config).await;
        NodeBuilder::new(&name)
            .uninitialized()
            .label(TEST_LABEL, &env.prefix)
            .label("tags.cloudprovider.dev/owner", "me")
            .create(&env.client)
            .await
            .expect("node");
        let core = Core::start(
            cp,
            &env,
            &sim,
            &["--leader-elect=false", "--controllers=cloud-node", "--node-status-update-frequency=1s"],
        );
        let node = eventually("initialisation", Duration::from_secs(30), async || initialised(&env, &name).await).await;
        let l = labels(&node);
        assert_eq!(l.get("tags.cloudprovider.dev/team").map(String::as_str), Some("payments"));
        assert_eq!(l.get("tags.cloudprovider.dev/env").map(String::as_str), Some("prod"));
        assert_eq!(l.get("tags.cloudprovider.dev/owner").map(String::as_str), Some("me"), "the user's label wins");

        // A tag changed, one added, one removed, and the user's label's tag changed too.
        sim.admin.set_tags("i-t", &tags(&[("team", "search"), ("cost-center", "42"), ("owner", "cloud-2")])).await.expect("tags");
        let changed = std::time::Instant::now();
        let l = eventually("the labels follow the tags", Duration::from_secs(15), async || {
            let l = labels(&env.nodes().get(&name).await.ok()?);
            (l.get("tags.cloudprovider.dev/team").map(String::as_str) == Some("search")
                && l.get("tags.cloudprovider.dev/cost-center").map(String::as_str) == Some("42")
                && !l.contains_key("tags.cloudprovider.dev/env"))
            .then_some(l)
        })
        .await;
        assert!(changed.elapsed() < Duration::from_secs(5), "within a refresh period or two: {:?}", changed.elapsed());
        assert_eq!(l.get("tags.cloudprovider.dev/owner").map(String::as_str), Some("me"), "a user's label is never touched");
        let tag_calls = calls(&sim, &["TagsService/BatchGetInstanceTags", "TagsService/GetInstanceTags"]).await;
        assert_eq!(tag_calls == 0, metadata_tags, "no Tags call when the metadata carries the tags ({tag_calls})");

        // The provider failing to read tags changes nothing.
        let down = Fault { method: read.into(), down: true, code: FaultCode::Unavailable, ..Default::default() };
        sim.admin.set_faults(&[down]).await.expect("faults");
        sim.admin.set_tags("i-t", &tags(&[])).await.expect("tags");
        tokio::time::sleep(Duration::from_secs(3)).await;
        let l = labels(&env.nodes().get(&name).await.expect("node"));
        assert_eq!(l.get("tags.cloudprovider.dev/team").map(String::as_str), Some("search"), "kept while tags cannot be read");
        sim.admin.set_faults(&[]).await.expect("clear");
        eventually("every tag gone, every label ours gone", Duration::from_secs(15), async || {
            let l = labels(&env.nodes().get(&name).await.ok()?);
            (!l.contains_key("tags.cloudprovider.dev/team") && !l.contains_key("tags.cloudprovider.dev/cost-center"))
                .then_some(())
        })
        .await;
        let l = labels(&env.nodes().get(&name).await.expect("node"));
        assert_eq!(l.get("tags.cloudprovider.dev/owner").map(String::as_str), Some("me"));
        core.stop().await.expect("stop");
        env.cleanup().await.expect("cleanup");
    }
}
