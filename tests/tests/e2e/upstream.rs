//! Behaviour users rely on because upstream's cloud-controller-manager has it: each test here
//! drives one case end to end (real API server, the core, the sim over a unix socket) and
//! failed before the core followed upstream.

use std::collections::BTreeMap;
use std::time::Duration;

use ccm_harness::cluster::{NodeBuilder, TestEnv, UNINITIALIZED_TAINT, set_ready};
use ccm_provider_sim::Config;
use ccm_provider_sim::config::{Address, Answer, Fault, FaultCode};
use k8s_openapi::api::core::v1::{Event, Node, NodeAddress};
use kube::Api;
use kube::api::ListParams;

use crate::support::{Core, Sim, TEST_LABEL, eventually, instance};

const SHUTDOWN_TAINT: &str = "node.cloudprovider.kubernetes.io/shutdown";

fn has_taint(node: &Node, key: &str) -> bool {
    node.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == key))
}

fn labels(node: &Node) -> BTreeMap<String, String> {
    node.metadata.labels.clone().unwrap_or_default()
}

fn addresses(node: &Node) -> Vec<String> {
    node.status
        .as_ref()
        .and_then(|s| s.addresses.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|a: NodeAddress| format!("{}={}", a.type_, a.address))
        .collect()
}

fn address(kind: &str, ip: &str) -> Address {
    Address { kind: kind.into(), address: ip.into() }
}

async fn initialised(env: &TestEnv, name: &str) -> Option<Node> {
    let node = env.nodes().get_opt(name).await.ok().flatten()?;
    (!has_taint(&node, UNINITIALIZED_TAINT)).then_some(node)
}

async fn event_reasons(env: &TestEnv, object: &str) -> Vec<String> {
    let events: Api<Event> = Api::all(env.client.clone());
    let list = events.list(&ListParams::default().fields(&format!("involvedObject.name={object}"))).await.expect("events");
    list.items.into_iter().filter_map(|e| e.reason).collect()
}

fn down() -> Fault {
    Fault { method: "*".into(), down: true, code: FaultCode::Unavailable, ..Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ready_node_loses_the_shutdown_taint_whatever_the_cloud_says() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "up-shut").await.expect("env");
    let (recovered, outage) = (env.node_name("recovered"), env.node_name("outage"));
    let mut config = Config::default();
    for (id, n) in [("i-rec", &recovered), ("i-out", &outage)] {
        let mut spec = instance(id, n, "sim-region-1a");
        spec.state = ccm_provider_sim::config::State::Stopped;
        config.instances.push(spec);
    }
    let sim = Sim::start(config).await;
    // Ready, tainted, and the cloud still says "stopped" (its view lags, or the instance
    // was restarted behind its back): the taint goes.
    NodeBuilder::new(&recovered)
        .label(TEST_LABEL, &env.prefix)
        .provider_id("sim://sim-region-1a/i-rec")
        .taint(SHUTDOWN_TAINT, "", "NoSchedule")
        .create(&env.client)
        .await
        .expect("node");
    set_ready(&env.client, &recovered, "True").await.expect("ready");
    NodeBuilder::new(&outage)
        .label(TEST_LABEL, &env.prefix)
        .provider_id("sim://sim-region-1a/i-out")
        .create(&env.client)
        .await
        .expect("node");
    set_ready(&env.client, &outage, "False").await.expect("not ready");
    let core = Core::start(
        cp,
        &env,
        &sim,
        &["--leader-elect=false", "--controllers=cloud-node-lifecycle", "--node-monitor-period=300ms"],
    );

    eventually("the Ready node's shutdown taint removed", Duration::from_secs(10), async || {
        (!has_taint(&env.nodes().get(&recovered).await.ok()?, SHUTDOWN_TAINT)).then_some(())
    })
    .await;
    eventually("the stopped NotReady node tainted", Duration::from_secs(10), async || {
        has_taint(&env.nodes().get(&outage).await.ok()?, SHUTDOWN_TAINT).then_some(())
    })
    .await;

    // The node comes back while the cloud API is down: the taint still goes at once.
    sim.admin.set_faults(&[down()]).await.expect("faults");
    set_ready(&env.client, &outage, "True").await.expect("ready");
    eventually("the shutdown taint removed during a cloud outage", Duration::from_secs(10), async || {
        (!has_taint(&env.nodes().get(&outage).await.ok()?, SHUTDOWN_TAINT)).then_some(())
    })
    .await;
    sim.admin.set_faults(&[]).await.expect("clear");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provided_node_ip_is_the_only_address_of_its_type() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "up-nodeip").await.expect("env");
    let (single, both, dual) = (env.node_name("single"), env.node_name("both"), env.node_name("dual"));
    let mut config = Config::default();
    let mut spec = instance("i-single", &single, "sim-region-1a");
    spec.addresses =
        vec![address("InternalIP", "10.0.0.1"), address("InternalIP", "10.0.0.2"), address("ExternalIP", "198.51.100.7")];
    config.instances.push(spec);
    // A node IP that is both an InternalIP and an ExternalIP (a public-IP-only instance).
    let mut spec = instance("i-both", &both, "sim-region-1a");
    spec.addresses =
        vec![address("InternalIP", "10.0.1.1"), address("InternalIP", "198.51.100.8"), address("ExternalIP", "198.51.100.8")];
    config.instances.push(spec);
    let mut spec = instance("i-dual", &dual, "sim-region-1a");
    spec.addresses = vec![
        address("InternalIP", "10.0.2.1"),
        address("InternalIP", "10.0.2.2"),
        address("InternalIP", "fd00::1"),
        address("InternalIP", "fd00::2"),
        address("ExternalIP", "198.51.100.9"),
    ];
    config.instances.push(spec);
    let sim = Sim::start(config).await;
    for (n, ip) in [(&single, "10.0.0.2"), (&both, "198.51.100.8"), (&dual, "10.0.2.2,fd00::2")] {
        NodeBuilder::new(n)
            .label(TEST_LABEL, &env.prefix)
            .uninitialized()
            .annotation("alpha.kubernetes.io/provided-node-ip", ip)
            .address("Hostname", n)
            .create(&env.client)
            .await
            .expect("node");
    }
    let core = Core::start(cp, &env, &sim, &["--leader-elect=false", "--controllers=cloud-node"]);
    let got = eventually("initialised", Duration::from_secs(20), async || initialised(&env, &single).await).await;
    assert_eq!(
        addresses(&got),
        vec!["InternalIP=10.0.0.2".to_string(), "ExternalIP=198.51.100.7".into(), format!("Hostname={single}")],
        "the excluded InternalIP 10.0.0.1 is not advertised"
    );
    let got = eventually("initialised", Duration::from_secs(20), async || initialised(&env, &both).await).await;
    assert_eq!(
        addresses(&got),
        vec!["InternalIP=198.51.100.8".to_string(), "ExternalIP=198.51.100.8".into(), format!("Hostname={both}")]
    );
    let got = eventually("initialised", Duration::from_secs(20), async || initialised(&env, &dual).await).await;
    assert_eq!(
        addresses(&got),
        vec![
            "InternalIP=10.0.2.2".to_string(),
            "InternalIP=fd00::2".into(),
            "ExternalIP=198.51.100.9".into(),
            format!("Hostname={dual}")
        ]
    );
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reordered_addresses_are_no_change_and_a_new_primary_is_one() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "up-order").await.expect("env");
    let name = env.node_name("a");
    let mut config = Config::default();
    let mut spec = instance("i-a", &name, "sim-region-1a");
    spec.addresses = vec![address("InternalIP", "10.0.3.1"), address("ExternalIP", "198.51.100.3")];
    config.instances.push(spec);
    let sim = Sim::start(config).await;
    NodeBuilder::new(&name).label(TEST_LABEL, &env.prefix).uninitialized().create(&env.client).await.expect("node");
    let core = Core::start(
        cp,
        &env,
        &sim,
        &["--leader-elect=false", "--controllers=cloud-node", "--node-status-update-frequency=300ms"],
    );
    let node = eventually("initialised", Duration::from_secs(20), async || initialised(&env, &name).await).await;
    assert_eq!(addresses(&node), vec!["InternalIP=10.0.3.1".to_string(), "ExternalIP=198.51.100.3".into()]);
    // Let the first refresh pass settle, then reorder the cloud's answer.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let before = env.nodes().get(&name).await.expect("node").metadata.resource_version;
    sim.admin
        .set_addresses("i-a", &[address("ExternalIP", "198.51.100.3"), address("InternalIP", "10.0.3.1")])
        .await
        .expect("reorder");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = env.nodes().get(&name).await.expect("node");
    assert_eq!(after.metadata.resource_version, before, "the same addresses in another order are not rewritten");
    // A new primary InternalIP is a change.
    sim.admin
        .set_addresses(
            "i-a",
            &[address("InternalIP", "10.0.3.2"), address("InternalIP", "10.0.3.1"), address("ExternalIP", "198.51.100.3")],
        )
        .await
        .expect("new primary");
    eventually("the new primary written", Duration::from_secs(10), async || {
        let n = env.nodes().get(&name).await.ok()?;
        (addresses(&n).first().map(String::as_str) == Some("InternalIP=10.0.3.2")).then_some(())
    })
    .await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beta_topology_labels_give_the_missing_ga_ones() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "up-beta").await.expect("env");
    let (old, mixed, joining) = (env.node_name("old"), env.node_name("mixed"), env.node_name("joining"));
    let mut config = Config::default();
    config.instances.push(instance("i-old", &old, "sim-region-1a"));
    config.instances.push(instance("i-mixed", &mixed, "sim-region-1a"));
    config.instances.push(instance("i-join", &joining, "sim-region-1b"));
    let sim = Sim::start(config).await;
    // An initialised Node of an old kubelet: beta labels only.
    NodeBuilder::new(&old)
        .label(TEST_LABEL, &env.prefix)
        .provider_id("sim://sim-region-1a/i-old")
        .label("failure-domain.beta.kubernetes.io/zone", "legacy-zone")
        .label("failure-domain.beta.kubernetes.io/region", "legacy-region")
        .label("beta.kubernetes.io/instance-type", "legacy.type")
        .create(&env.client)
        .await
        .expect("node");
    // Both zone labels, disagreeing: the GA one is left alone.
    NodeBuilder::new(&mixed)
        .label(TEST_LABEL, &env.prefix)
        .provider_id("sim://sim-region-1a/i-mixed")
        .label("failure-domain.beta.kubernetes.io/zone", "beta-zone")
        .label("topology.kubernetes.io/zone", "ga-zone")
        .create(&env.client)
        .await
        .expect("node");
    // Joining: the cloud's values win over the beta ones.
    NodeBuilder::new(&joining)
        .label(TEST_LABEL, &env.prefix)
        .uninitialized()
        .label("failure-domain.beta.kubernetes.io/zone", "stale-zone")
        .create(&env.client)
        .await
        .expect("node");
    sim.admin.reset_calls().await.expect("reset");
    let core = Core::start(cp, &env, &sim, &["--leader-elect=false", "--controllers=cloud-node"]);
    let got = eventually("GA labels on the old node", Duration::from_secs(10), async || {
        let n = env.nodes().get(&old).await.ok()?;
        labels(&n).contains_key("topology.kubernetes.io/zone").then_some(n)
    })
    .await;
    let l = labels(&got);
    assert_eq!(l.get("topology.kubernetes.io/zone").map(String::as_str), Some("legacy-zone"));
    assert_eq!(l.get("topology.kubernetes.io/region").map(String::as_str), Some("legacy-region"));
    assert_eq!(l.get("node.kubernetes.io/instance-type").map(String::as_str), Some("legacy.type"));
    assert_eq!(l.get("failure-domain.beta.kubernetes.io/zone").map(String::as_str), Some("legacy-zone"), "beta kept");
    let got = eventually("joining node initialised", Duration::from_secs(20), async || initialised(&env, &joining).await).await;
    assert_eq!(labels(&got).get("topology.kubernetes.io/zone").map(String::as_str), Some("sim-region-1b"));
    let got = env.nodes().get(&mixed).await.expect("node");
    assert_eq!(labels(&got).get("topology.kubernetes.io/zone").map(String::as_str), Some("ga-zone"));
    assert!(!labels(&got).contains_key("topology.kubernetes.io/region"));
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_instance_answers_are_handled_as_upstream_or_refused_clearly() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "up-odd").await.expect("env");
    let labelled = env.node_name("labelled");
    let bare = env.node_name("bare");
    let anonymous = env.node_name("anonymous");
    let claimed = env.node_name("claimed");
    let silent = env.node_name("silent");
    let mut config = Config::default();
    let mut spec = instance("i-labelled", &labelled, "sim-region-1a");
    spec.labels = BTreeMap::from([
        ("example.com/pool".to_string(), "gold".to_string()),
        ("node.kubernetes.io/role".to_string(), "db".to_string()),
        ("k8s.io/owner".to_string(), "x".to_string()),
        ("team.kubernetes.io/a".to_string(), "b".to_string()),
    ]);
    config.instances.push(spec);
    let mut spec = instance("i-bare", &bare, "sim-region-1a");
    spec.no_addresses = true;
    config.instances.push(spec);
    for (id, n) in [("i-anon", &anonymous), ("i-claimed", &claimed)] {
        let mut spec = instance(id, n, "sim-region-1a");
        spec.answer = Answer::EmptyProviderId;
        config.instances.push(spec);
    }
    let mut spec = instance("i-silent", &silent, "sim-region-1a");
    spec.answer = Answer::NoMetadata;
    config.instances.push(spec);
    let sim = Sim::start(config).await;
    for n in [&labelled, &anonymous, &silent] {
        NodeBuilder::new(n).label(TEST_LABEL, &env.prefix).uninitialized().create(&env.client).await.expect("node");
    }
    NodeBuilder::new(&bare)
        .label(TEST_LABEL, &env.prefix)
        .uninitialized()
        .address("InternalIP", "192.168.7.7")
        .address("Hostname", &bare)
        .create(&env.client)
        .await
        .expect("node");
    NodeBuilder::new(&claimed)
        .label(TEST_LABEL, &env.prefix)
        .uninitialized()
        .provider_id("sim://sim-region-1a/i-claimed")
        .create(&env.client)
        .await
        .expect("node");
    let core = Core::start(cp, &env, &sim, &["--leader-elect=false", "--controllers=cloud-node,cloud-node-lifecycle"]);

    // Additional labels: those in the kubernetes.io and k8s.io domains are dropped.
    let got = eventually("labelled initialised", Duration::from_secs(20), async || initialised(&env, &labelled).await).await;
    let l = labels(&got);
    assert_eq!(l.get("example.com/pool").map(String::as_str), Some("gold"));
    for reserved in ["node.kubernetes.io/role", "k8s.io/owner", "team.kubernetes.io/a"] {
        assert!(!l.contains_key(reserved), "{reserved} must not be copied from the provider");
    }
    // No addresses in the cloud: initialised, keeping what the kubelet reported.
    let got = eventually("bare initialised", Duration::from_secs(20), async || initialised(&env, &bare).await).await;
    assert_eq!(addresses(&got), vec!["InternalIP=192.168.7.7".to_string(), format!("Hostname={bare}")]);
    // An empty providerID for a Node that has none: refused with a Warning, taint kept.
    eventually("a NodeInitializationFailed event", Duration::from_secs(10), async || {
        event_reasons(&env, &anonymous).await.contains(&"NodeInitializationFailed".to_string()).then_some(())
    })
    .await;
    // The same answer for a Node that has its providerID already: nothing missing.
    let got = eventually("claimed initialised", Duration::from_secs(20), async || initialised(&env, &claimed).await).await;
    assert_eq!(got.spec.and_then(|s| s.provider_id).as_deref(), Some("sim://sim-region-1a/i-claimed"));
    // No metadata and no error: the Node waits, tainted, and is never deleted for it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for n in [&anonymous, &silent] {
        let node = env.nodes().get_opt(n).await.expect("get").unwrap_or_else(|| panic!("{n} must not be deleted"));
        assert!(has_taint(&node, UNINITIALIZED_TAINT), "{n} stays uninitialised");
    }
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

fn service_flags(env: &TestEnv) -> Vec<String> {
    vec!["--leader-elect=false".into(), "--controllers=service".into(), format!("--service-namespace={}", env.namespace)]
}

fn start_services(cp: &ccm_harness::ControlPlane, env: &TestEnv, sim: &Sim, extra: &[&str]) -> Core {
    let mut flags = service_flags(env);
    flags.extend(extra.iter().map(|s| s.to_string()));
    Core::start(cp, env, sim, &flags.iter().map(String::as_str).collect::<Vec<_>>())
}

async fn lb_of(sim: &Sim, service: &str) -> Option<ccm_provider_sim::admin::LoadBalancerView> {
    let state = sim.admin.state().await.ok()?;
    state.load_balancers.into_iter().find(|l| l.service.ends_with(&format!("/{service}")))
}

async fn ingress_ip(env: &TestEnv, name: &str) -> Option<String> {
    let svc = env.services().get(name).await.ok()?;
    svc.status?.load_balancer?.ingress?.first()?.ip.clone()
}

async fn backend(env: &TestEnv, name: &str, id: &str, exclude: Option<&str>) {
    let mut b = NodeBuilder::new(name)
        .label(TEST_LABEL, &env.prefix)
        .provider_id(&format!("sim://sim-region-1a/{id}"))
        .address("InternalIP", "10.0.0.9");
    if let Some(v) = exclude {
        b = b.label("node.kubernetes.io/exclude-from-external-load-balancers", v);
    }
    b.create(&env.client).await.expect("node");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exclusion_label_is_read_as_a_boolean() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "up-excl").await.expect("env");
    let mut config = Config::default();
    let nodes: Vec<(String, Option<&str>)> = vec![
        (env.node_name("plain"), None),
        (env.node_name("false"), Some("false")),
        (env.node_name("zero"), Some("0")),
        (env.node_name("true"), Some("true")),
        (env.node_name("empty"), Some("")),
        (env.node_name("junk"), Some("maybe")),
    ];
    for (i, (n, _)) in nodes.iter().enumerate() {
        config.instances.push(instance(&format!("i-{i}"), n, "sim-region-1a"));
    }
    let sim = Sim::start(config).await;
    for (i, (n, v)) in nodes.iter().enumerate() {
        backend(&env, n, &format!("i-{i}"), *v).await;
    }
    let core = start_services(cp, &env, &sim, &[]);
    ccm_harness::cluster::create_load_balancer_service(&env, "web", &[80]).await.expect("service");
    let lb = eventually("a load balancer", Duration::from_secs(20), async || lb_of(&sim, "web").await).await;
    let mut want = vec![nodes[0].0.clone(), nodes[1].0.clone(), nodes[2].0.clone()];
    want.sort();
    assert_eq!(lb.nodes, want, "\"false\" and \"0\" keep a node; \"true\", empty and junk exclude it");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_ranges_are_trimmed_and_merged() {
    use kube::api::PostParams;
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "up-ranges").await.expect("env");
    let node = env.node_name("n");
    let mut config = Config::default();
    config.instances.push(instance("i-n", &node, "sim-region-1a"));
    let sim = Sim::start(config).await;
    backend(&env, &node, "i-n", None).await;
    let core = start_services(cp, &env, &sim, &[]);

    let mut spaced = ccm_harness::cluster::load_balancer_service(&env.namespace, "spaced", &[80]);
    if let Some(spec) = spaced.spec.as_mut() {
        spec.load_balancer_source_ranges = Some(vec![" 10.0.0.0/8".into(), "10.0.0.0/8 ".into(), "192.168.0.0/16".into()]);
    }
    env.services().create(&PostParams::default(), &spaced).await.expect("the API server accepts it");
    let mut annotated = ccm_harness::cluster::load_balancer_service(&env.namespace, "annotated", &[80]);
    annotated.metadata.annotations = Some(
        [("service.beta.kubernetes.io/load-balancer-source-ranges".to_string(), " 172.16.0.0/12, 172.16.0.0/12".to_string())]
            .into(),
    );
    env.services().create(&PostParams::default(), &annotated).await.expect("service");
    eventually("an address for the spaced ranges", Duration::from_secs(20), async || ingress_ip(&env, "spaced").await).await;
    eventually("an address for the annotated ranges", Duration::from_secs(20), async || ingress_ip(&env, "annotated").await)
        .await;
    assert_eq!(lb_of(&sim, "spaced").await.expect("lb").source_ranges, vec!["10.0.0.0/8".to_string(), "192.168.0.0/16".into()]);
    assert_eq!(lb_of(&sim, "annotated").await.expect("lb").source_ranges, vec!["172.16.0.0/12".to_string()]);

    // A range that is no CIDR never gets this far: the API server refuses it (in the spec and
    // in the annotation), so the core's own check (a Warning Event, no provider call) is a
    // second line for objects stored before that validation, covered by unit tests.
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_failure_waits_its_backoff() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "up-first").await.expect("env");
    let node = env.node_name("n");
    let mut config = Config::default();
    config.instances.push(instance("i-n", &node, "sim-region-1a"));
    // INTERNAL is not retried inside a call: each attempt is one call.
    config.faults.push(Fault {
        method: "EnsureLoadBalancer".into(),
        down: true,
        code: FaultCode::Internal,
        ..Default::default()
    });
    let sim = Sim::start(config).await;
    backend(&env, &node, "i-n", None).await;
    let core = start_services(cp, &env, &sim, &["--reconcile-backoff-base=3s"]);
    ccm_harness::cluster::create_load_balancer_service(&env, "failing", &[80]).await.expect("service");
    eventually("the finalizer", Duration::from_secs(10), async || {
        let svc = env.services().get("failing").await.ok()?;
        svc.metadata.finalizers.filter(|f| !f.is_empty()).map(|_| ())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let attempts = sim.admin.call_count("LoadBalancersService/EnsureLoadBalancer").await.expect("calls");
    assert_eq!(attempts, 1, "the controller's own finalizer write must not retry the Service before its backoff");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

fn route_flags(env: &TestEnv) -> Vec<String> {
    vec![
        "--leader-elect=false".to_string(),
        "--controllers=route".to_string(),
        "--cluster-cidr=10.244.0.0/16".to_string(),
        format!("--cluster-name={}", env.prefix),
    ]
}

async fn routed_node(env: &TestEnv, name: &str, cidr: Option<&str>, ip: &str) {
    let mut b = NodeBuilder::new(name).label(TEST_LABEL, &env.prefix).address("InternalIP", ip);
    if let Some(c) = cidr {
        b = b.pod_cidr(c);
    }
    b.create(&env.client).await.expect("node");
}

async fn network_condition(env: &TestEnv, node: &str) -> Option<(String, String)> {
    let n: Node = env.nodes().get(node).await.ok()?;
    let c = n.status?.conditions?.into_iter().find(|c| c.type_ == "NetworkUnavailable")?;
    Some((c.status, c.reason.unwrap_or_default()))
}

async fn cloud_routes(sim: &Sim, cluster: &str) -> Vec<ccm_provider_sim::admin::RouteView> {
    let state = sim.admin.state().await.expect("state");
    state.route_tables.into_iter().flat_map(|t| t.routes).filter(|r| r.cluster == cluster).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_made_under_another_name_are_adopted_not_recreated() {
    use ccm_provider_sim::admin::RouteSpec;
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "up-adopt").await.expect("env");
    let (a, b, c) = (env.node_name("a"), env.node_name("b"), env.node_name("c"));
    let mut config = Config::default();
    for (id, n) in [("i-a", &a), ("i-b", &b), ("i-c", &c)] {
        config.instances.push(instance(id, n, "sim-region-1a"));
    }
    let sim = Sim::start(config).await;
    // What upstream's cloud-controller-manager left behind: a route named after the Node's
    // UID for a, and one for c, whose podCIDR has since been released.
    for (name, cidr, node) in [("kubernetes-0b1c2d3e", "10.244.1.0/24", &a), ("kubernetes-4f5a6b7c", "10.244.5.0/24", &c)] {
        let spec = RouteSpec {
            cluster: env.prefix.clone(),
            table_id: String::new(),
            name: name.into(),
            destination_cidr: cidr.into(),
            node_name: node.clone(),
        };
        sim.admin.add_route(&spec).await.expect("route");
    }
    let made_at =
        cloud_routes(&sim, &env.prefix).await.into_iter().find(|r| r.node_name == a).expect("a's route").created_at_unix_ms;
    routed_node(&env, &a, Some("10.244.1.0/24"), "10.0.0.1").await;
    routed_node(&env, &b, Some("10.244.2.0/24"), "10.0.0.2").await;
    routed_node(&env, &c, None, "10.0.0.3").await;
    sim.admin.reset_calls().await.expect("reset");
    let core = Core::start(cp, &env, &sim, &route_flags(&env).iter().map(String::as_str).collect::<Vec<_>>());

    for n in [&a, &b] {
        eventually("NetworkUnavailable=False", Duration::from_secs(20), async || {
            (network_condition(&env, n).await? == ("False".to_string(), "RouteCreated".to_string())).then_some(())
        })
        .await;
    }
    // A Node without a podCIDR that a cloud route still points at: its network is unavailable.
    eventually("NetworkUnavailable=True for c", Duration::from_secs(10), async || {
        (network_condition(&env, &c).await? == ("True".to_string(), "NoRouteCreated".to_string())).then_some(())
    })
    .await;
    eventually("c's stale route deleted", Duration::from_secs(10), async || {
        (!cloud_routes(&sim, &env.prefix).await.iter().any(|r| r.node_name == c)).then_some(())
    })
    .await;
    let routes = cloud_routes(&sim, &env.prefix).await;
    let kept = routes.iter().find(|r| r.node_name == a).expect("a's route");
    assert_eq!((kept.name.as_str(), kept.created_at_unix_ms), ("kubernetes-0b1c2d3e", made_at), "adopted, never recreated");
    assert_eq!(sim.admin.call_count("RoutesService/CreateRoute").await.expect("calls"), 1, "only b's route is created");
    assert_eq!(sim.admin.call_count("RoutesService/DeleteRoute").await.expect("calls"), 1, "only c's stale route is deleted");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_that_record_addresses_follow_the_nodes_addresses() {
    use kube::api::{Patch, PatchParams};
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "up-raddr").await.expect("env");
    let a = env.node_name("a");
    let mut config = Config { route_target_addresses: true, ..Default::default() };
    config.instances.push(instance("i-a", &a, "sim-region-1a"));
    let sim = Sim::start(config).await;
    routed_node(&env, &a, Some("10.244.1.0/24"), "10.0.0.1").await;
    let core = Core::start(cp, &env, &sim, &route_flags(&env).iter().map(String::as_str).collect::<Vec<_>>());
    let route = eventually("a route recording the address", Duration::from_secs(20), async || {
        cloud_routes(&sim, &env.prefix).await.into_iter().find(|r| r.node_name == a)
    })
    .await;
    assert_eq!(route.target_addresses, vec!["InternalIP=10.0.0.1".to_string()]);
    let patch = serde_json::json!({ "status": { "addresses": [{ "type": "InternalIP", "address": "10.0.0.7" }] } });
    env.nodes().patch_status(&a, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("new address");
    eventually("the route replaced with the new address", Duration::from_secs(20), async || {
        let routes = cloud_routes(&sim, &env.prefix).await;
        (routes.len() == 1 && routes[0].target_addresses == vec!["InternalIP=10.0.0.7".to_string()]).then_some(())
    })
    .await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

async fn without_finalizer(env: &TestEnv, name: &str) {
    use kube::api::{Patch, PatchParams};
    let patch = serde_json::json!({ "metadata": { "finalizers": null } });
    env.services().patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("finalizer removed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_deleted_without_its_finalizer_loses_its_load_balancer() {
    use kube::api::DeleteParams;
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "up-leak").await.expect("env");
    let node = env.node_name("n");
    let mut config = Config::default();
    config.instances.push(instance("i-n", &node, "sim-region-1a"));
    let sim = Sim::start(config).await;
    backend(&env, &node, "i-n", None).await;
    // A write budget of two, then one per 5 s: once the finalizer and the status are written,
    // the controller cannot put the finalizer back before the tool's delete lands.
    let core = start_services(cp, &env, &sim, &["--load-balancer-resync-period=0s", "--kube-api-qps=0.2", "--kube-api-burst=2"]);
    ccm_harness::cluster::create_load_balancer_service(&env, "web", &[80]).await.expect("service");
    eventually("an address", Duration::from_secs(20), async || ingress_ip(&env, "web").await).await;
    // A tool strips the finalizer and deletes the Service straight away.
    without_finalizer(&env, "web").await;
    env.services().delete("web", &DeleteParams::default()).await.expect("delete");
    eventually("the load balancer deleted", Duration::from_secs(10), async || lb_of(&sim, "web").await.is_none().then_some(()))
        .await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

/// A load balancer ensured straight through the provider, as another cluster or tool would.
async fn foreign_load_balancer(sim: &Sim, cluster: &str, lb_name: &str, uid: &str) {
    foreign_load_balancer_in(sim, cluster, "elsewhere", lb_name, uid).await;
}

async fn foreign_load_balancer_in(sim: &Sim, cluster: &str, namespace: &str, lb_name: &str, uid: &str) {
    use ccm_provider_sdk::proto::load_balancers_service_client::LoadBalancersServiceClient;
    use ccm_provider_sdk::proto::{EnsureLoadBalancerRequest, LoadBalancerService, ServicePort};
    let channel = ccm_provider_sdk::client::connect_lazy(&sim.endpoint).expect("channel");
    let service = LoadBalancerService {
        cluster_name: cluster.into(),
        namespace: namespace.into(),
        name: "svc".into(),
        uid: uid.into(),
        load_balancer_name: lb_name.into(),
        ports: vec![ServicePort { name: "p".into(), protocol: 1, port: 443, node_port: 30443, ..Default::default() }],
        ..Default::default()
    };
    LoadBalancersServiceClient::new(channel)
        .ensure_load_balancer(EnsureLoadBalancerRequest { service: Some(service), nodes: Vec::new() })
        .await
        .expect("foreign load balancer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_orphaned_load_balancers_are_swept_within_bounds() {
    use kube::api::DeleteParams;
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "up-sweep").await.expect("env");
    let node = env.node_name("n");
    let mut config = Config::default();
    config.instances.push(instance("i-n", &node, "sim-region-1a"));
    let sim = Sim::start(config).await;
    backend(&env, &node, "i-n", None).await;
    let core = start_services(cp, &env, &sim, &[]);
    for name in ["gone-a", "gone-b", "kept"] {
        ccm_harness::cluster::create_load_balancer_service(&env, name, &[80]).await.expect("service");
    }
    for name in ["gone-a", "gone-b", "kept"] {
        eventually("an address", Duration::from_secs(20), async || ingress_ip(&env, name).await).await;
    }
    core.stop().await.expect("stop");
    // While no core runs: two Services deleted past their finalizer.
    for name in ["gone-a", "gone-b"] {
        without_finalizer(&env, name).await;
        env.services().delete(name, &DeleteParams::default()).await.expect("delete");
    }
    // Load balancers the sweep must never touch: another cluster's, and one of this cluster
    // not named by our scheme.
    foreign_load_balancer(&sim, "another-cluster", "another-cluster-svc-12345678", "0000-gone-1").await;
    foreign_load_balancer(&sim, "kubernetes", "made-by-hand", "0000-gone-2").await;
    let total = sim.admin.state().await.expect("state").load_balancers.len();
    assert_eq!(total, 5);

    // Two orphans, at most one deletion allowed per sweep: none is deleted.
    sim.admin.reset_calls().await.expect("reset");
    let bounded = start_services(cp, &env, &sim, &["--load-balancer-resync-period=500ms", "--max-load-balancer-deletions=1"]);
    eventually("two sweeps", Duration::from_secs(10), async || {
        (sim.admin.call_count("LoadBalancersService/ListLoadBalancers").await.ok()? >= 2).then_some(())
    })
    .await;
    assert_eq!(sim.admin.state().await.expect("state").load_balancers.len(), 5, "over the bound: nothing deleted");
    assert_eq!(sim.admin.call_count("LoadBalancersService/EnsureLoadBalancerDeleted").await.expect("calls"), 0);
    bounded.stop().await.expect("stop");

    // Within the bound: the sweep at start deletes exactly the two orphans.
    let core = start_services(cp, &env, &sim, &[]);
    eventually("the orphans deleted", Duration::from_secs(10), async || {
        let state = sim.admin.state().await.ok()?;
        let names: Vec<String> = state.load_balancers.iter().map(|l| l.service.clone()).collect();
        (state.load_balancers.len() == 3).then_some(names)
    })
    .await;
    assert!(lb_of(&sim, "kept").await.is_some(), "the live Service keeps its load balancer");
    assert!(lb_of(&sim, "gone-a").await.is_none() && lb_of(&sim, "gone-b").await.is_none());
    let names: Vec<String> = sim.admin.state().await.expect("state").load_balancers.into_iter().map(|l| l.name).collect();
    assert!(names.iter().any(|n| n == "made-by-hand") && names.iter().any(|n| n.starts_with("another-cluster")), "{names:?}");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_that_strays_into_another_cluster_deletes_none_of_its_load_balancers() {
    // A provider whose listing ignores the cluster asked for (accounts shared by clusters):
    // another cluster's load balancer, named the upstream way (`a` + its Service UID, which
    // names no cluster) for a Service this cluster never had, is not an orphan of ours.
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "up-stray").await.expect("env");
    let mut config = Config::default();
    config.faults.push(Fault {
        method: "ListLoadBalancers".into(),
        lie: Some(ccm_provider_sim::config::Lie::EveryCluster),
        ..Default::default()
    });
    let sim = Sim::start(config).await;
    let uid = "0000aaaa-1111-2222-3333-444455556666";
    let upstream_name: String = format!("a{}", uid.replace('-', "")).chars().take(32).collect();
    foreign_load_balancer_in(&sim, "another-cluster", &env.namespace, &upstream_name, uid).await;
    sim.admin.reset_calls().await.expect("reset");
    let core = start_services(cp, &env, &sim, &["--load-balancer-resync-period=500ms"]);
    eventually("three sweeps", Duration::from_secs(15), async || {
        (sim.admin.call_count("LoadBalancersService/ListLoadBalancers").await.ok()? >= 3).then_some(())
    })
    .await;
    let names: Vec<String> = sim.admin.state().await.expect("state").load_balancers.into_iter().map(|l| l.name).collect();
    assert_eq!(names, vec![upstream_name], "another cluster's load balancer is kept");
    assert_eq!(sim.admin.call_count("LoadBalancersService/EnsureLoadBalancerDeleted").await.expect("calls"), 0);
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttling_hint_holds_back_every_call_for_its_length() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "up-hint").await.expect("env");
    let (a, b) = (env.node_name("a"), env.node_name("b"));
    let mut config = Config::default();
    config.instances.push(instance("i-a", &a, "sim-region-1a"));
    config.instances.push(instance("i-b", &b, "sim-region-1a"));
    // Throttled, asking for 3 s: far longer than the 200 ms backoff the tests run with.
    config.faults.push(Fault {
        method: "BatchInstanceMetadata".into(),
        down: true,
        code: FaultCode::RateLimited,
        retry_after_ms: Some(3000),
        ..Default::default()
    });
    let sim = Sim::start(config).await;
    let core = Core::start(cp, &env, &sim, &["--leader-elect=false", "--controllers=cloud-node"]);
    NodeBuilder::new(&a).label(TEST_LABEL, &env.prefix).uninitialized().create(&env.client).await.expect("node");
    let refused_at = eventually("the throttled call", Duration::from_secs(10), async || {
        let log = sim.admin.call_log().await.ok()?;
        log.into_iter()
            .find(|c| c.method.ends_with("/BatchInstanceMetadata") && c.code == "RESOURCE_EXHAUSTED")
            .map(|c| c.at_unix_ms)
    })
    .await;
    sim.admin.set_faults(&[]).await.expect("clear");
    // Another Node arrives meanwhile: its lookup waits out the same hint.
    tokio::time::sleep(Duration::from_millis(300)).await;
    NodeBuilder::new(&b).label(TEST_LABEL, &env.prefix).uninitialized().create(&env.client).await.expect("node");
    for n in [&a, &b] {
        eventually("initialised after the hint", Duration::from_secs(15), async || initialised(&env, n).await).await;
    }
    let log = sim.admin.call_log().await.expect("log");
    let after: Vec<u64> = log
        .iter()
        .filter(|c| c.method.starts_with("InstancesService/") && c.at_unix_ms > refused_at)
        .map(|c| c.at_unix_ms)
        .collect();
    assert!(!after.is_empty());
    let first = after.iter().min().copied().unwrap_or_default();
    assert!(first >= refused_at + 2900, "the next instance call came {} ms after a 3000 ms hint", first - refused_at);
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn app_protocol_target_port_and_external_ips_reach_the_provider() {
    use kube::api::{Patch, PatchParams};
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "up-fields").await.expect("env");
    let node = env.node_name("n");
    let mut config = Config::default();
    config.instances.push(instance("i-n", &node, "sim-region-1a"));
    let sim = Sim::start(config).await;
    backend(&env, &node, "i-n", None).await;
    let core = start_services(cp, &env, &sim, &[]);
    ccm_harness::cluster::create_load_balancer_service(&env, "web", &[80]).await.expect("service");
    eventually("an address", Duration::from_secs(20), async || ingress_ip(&env, "web").await).await;
    let ensures = async || sim.admin.call_count("LoadBalancersService/EnsureLoadBalancer").await.expect("calls");
    let before = ensures().await;
    // A JSON merge patch replaces the port list: the whole port again, with the new fields.
    let patch = serde_json::json!({ "spec": {
        "ports": [{ "name": "p80", "port": 80, "protocol": "TCP", "appProtocol": "http", "targetPort": "web" }],
        "externalIPs": ["198.51.100.44"],
    }});
    env.services().patch("web", &PatchParams::default(), &Patch::Merge(&patch)).await.expect("patch");
    let lb = eventually("the provider sees the new fields", Duration::from_secs(10), async || {
        lb_of(&sim, "web").await.filter(|lb| lb.port_details == vec!["80:http:web".to_string()])
    })
    .await;
    assert_eq!(lb.external_ips, vec!["198.51.100.44".to_string()]);
    assert!(ensures().await > before, "a change of appProtocol, targetPort or externalIPs is a new Ensure");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}
