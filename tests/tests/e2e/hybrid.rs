//! One core, two providers (a hybrid cluster): two sims of different providerID schemes over
//! their own unix sockets, against the real API server. Nodes of both are initialised by
//! their own provider (by providerID scheme, by label, or by a name lookup only one provider
//! answers), a Node both providers claim is refused, routes and lifecycle stay with each
//! provider's Nodes, load balancers go by class, and one provider killed leaves the other
//! working.

use std::time::Duration;

use ccm_harness::cluster::{NodeBuilder, TestEnv, UNINITIALIZED_TAINT, load_balancer_service, set_ready};
use ccm_provider_sim::Config;
use ccm_provider_sim::admin::LoadBalancerView;
use k8s_openapi::api::core::v1::{Event, Node, Service};
use kube::Api;
use kube::api::{ListParams, PostParams};

use crate::support::{Core, Sim, TEST_LABEL, eventually, free_port, http_get, instance};

const PROVIDER_LABEL: &str = "ccm-rs.dev/provider";
const CLOUD_CLASS: &str = "cloud.example.com/lb";
const METAL_CLASS: &str = "metal.example.com/lb";

/// A sim standing for one cloud: its own scheme, plugin name and load balancer class, and
/// the instances `(id, node)`.
fn cloud(scheme: &str, class: &str, pool: &str, instances: &[(&str, &str)]) -> Config {
    let mut config =
        Config { plugin_name: format!("{scheme}.sim.example.com"), provider_id_scheme: scheme.into(), ..Config::default() };
    config.load_balancers.classes = vec![class.into()];
    config.load_balancers.address_pool = vec![pool.into()];
    for (id, node) in instances {
        config.instances.push(instance(id, node, &format!("{scheme}-zone-a")));
    }
    config
}

/// The core with the providers `(name, endpoint)` (the first given as the core's endpoint,
/// the rest as more `--provider-endpoint=NAME=…` flags) and `flags`.
fn start_core(cp: &ccm_harness::ControlPlane, env: &TestEnv, providers: &[(&str, &str)], flags: &[&str]) -> Core {
    let ((first, endpoint), rest) = providers.split_first().expect("a provider");
    let more: Vec<String> = rest.iter().map(|(n, e)| format!("--provider-endpoint={n}={e}")).collect();
    let args: Vec<&str> = more.iter().map(String::as_str).chain(flags.iter().copied()).collect();
    Core::start_on(cp.kubeconfig_path(), env, &format!("{first}={endpoint}"), &args)
}

async fn node(env: &TestEnv, name: &str) -> Option<Node> {
    env.nodes().get_opt(name).await.ok().flatten()
}

fn provider_id(node: &Node) -> Option<&str> {
    node.spec.as_ref()?.provider_id.as_deref()
}

fn tainted(node: &Node) -> bool {
    node.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == UNINITIALIZED_TAINT))
}

/// The providerID of a Node once it is initialised.
async fn initialised(env: &TestEnv, name: &str) -> String {
    eventually(&format!("{name} initialised"), Duration::from_secs(30), async || {
        let n = node(env, name).await?;
        (!tainted(&n)).then(|| provider_id(&n).map(String::from)).flatten()
    })
    .await
}

async fn node_reasons(env: &TestEnv, name: &str) -> Vec<String> {
    let events: Api<Event> = Api::all(env.client.clone());
    let list = events.list(&ListParams::default().fields(&format!("involvedObject.name={name}"))).await.expect("events");
    list.items.into_iter().filter_map(|e| e.reason).collect()
}

async fn lb_of(sim: &Sim, service: &str) -> Option<LoadBalancerView> {
    let state = sim.admin.state().await.ok()?;
    state.load_balancers.into_iter().find(|l| l.service.ends_with(&format!("/{service}")))
}

async fn create_service(env: &TestEnv, name: &str, class: Option<&str>) {
    let mut svc: Service = load_balancer_service(&env.namespace, name, &[80]);
    if let Some(spec) = svc.spec.as_mut() {
        spec.load_balancer_class = class.map(String::from);
    }
    env.services().create(&PostParams::default(), &svc).await.expect("service");
}

/// Route destinations of a sim's tables, by target Node.
async fn routes(sim: &Sim) -> Vec<(String, String)> {
    let tables = sim.admin.route_tables().await.expect("tables");
    let mut routes: Vec<(String, String)> =
        tables.into_iter().flat_map(|t| t.routes).map(|r| (r.node_name, r.destination_cidr)).collect();
    routes.sort();
    routes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hybrid_cluster_routes_every_node_and_load_balancer_to_its_own_provider() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "hybrid").await.expect("env");
    let [a1, a2, a3, b1, b2, pid, both] = ["a1", "a2", "a3", "b1", "b2", "pid", "both"].map(|n| env.node_name(n));
    let mut cloud_sim = Sim::start(cloud(
        "cloud",
        CLOUD_CLASS,
        "203.0.113.0/24",
        &[("i-a1", &a1), ("i-a2", &a2), ("i-a3", &a3), ("i-both", &both)],
    ))
    .await;
    let metal_config =
        cloud("metal", METAL_CLASS, "198.51.100.0/24", &[("m-b1", &b1), ("m-b2", &b2), ("m-pid", &pid), ("m-both", &both)]);
    let mut metal_sim = Sim::start(metal_config.clone()).await;

    // a1: no providerID, no label: only the cloud knows its name. b1: labelled by its
    // kubelet. pid: a kubelet-written providerID of the metal scheme. both: known to both.
    // b2: initialised long ago, NotReady: its instance goes away below.
    let base = |name: &str, cidr: &str| NodeBuilder::new(name).label(TEST_LABEL, &env.prefix).pod_cidr(cidr);
    base(&a1, "10.244.1.0/24").uninitialized().create(&env.client).await.expect("a1");
    base(&b1, "10.244.2.0/24").uninitialized().label(PROVIDER_LABEL, "metal").create(&env.client).await.expect("b1");
    base(&pid, "10.244.3.0/24").uninitialized().provider_id("metal://metal-zone-a/m-pid").create(&env.client).await.expect("pid");
    base(&both, "10.244.4.0/24").uninitialized().create(&env.client).await.expect("both");
    base(&b2, "10.244.5.0/24").provider_id("metal://metal-zone-a/m-b2").create(&env.client).await.expect("b2");
    set_ready(&env.client, &b2, "False").await.expect("not ready");
    // The others Ready: witnesses that the providers' word about instances can be believed.
    for n in [&a1, &b1, &pid] {
        set_ready(&env.client, n, "True").await.expect("ready");
    }

    let port = free_port();
    let port_flag = format!("--secure-port={port}");
    let endpoints = (cloud_sim.endpoint.clone(), metal_sim.endpoint.clone());
    let providers = [("cloud", endpoints.0.as_str()), ("metal", endpoints.1.as_str())];
    let core = start_core(
        cp,
        &env,
        &providers,
        &[
            "--leader-elect=false",
            &port_flag,
            "--insecure-serving",
            "--bind-address=127.0.0.1",
            "--cluster-cidr=10.244.0.0/16",
            "--node-monitor-period=300ms",
            "--node-deletion-window=2s",
        ],
    );
    let health = core.health.clone().expect("health address");

    // Each Node initialised by its own provider.
    assert_eq!(initialised(&env, &a1).await, "cloud://cloud-zone-a/i-a1", "found by the cloud's name lookup");
    assert_eq!(node(&env, &a1).await.and_then(|n| n.metadata.labels?.get(PROVIDER_LABEL).cloned()).as_deref(), Some("cloud"));
    assert_eq!(initialised(&env, &b1).await, "metal://metal-zone-a/m-b1", "by its label");
    assert_eq!(initialised(&env, &pid).await, "metal://metal-zone-a/m-pid", "by its providerID's scheme");
    let zone = |n: &Node| n.metadata.labels.as_ref().and_then(|l| l.get("topology.kubernetes.io/zone").cloned());
    assert_eq!(node(&env, &pid).await.as_ref().and_then(zone).as_deref(), Some("metal-zone-a"), "the metal cloud's answer");

    // Known to both: refused, never guessed.
    eventually("a ProviderConflict Event", Duration::from_secs(20), async || {
        node_reasons(&env, &both).await.iter().any(|r| r == "ProviderConflict").then_some(())
    })
    .await;
    let refused = node(&env, &both).await.expect("both");
    assert!(tainted(&refused) && provider_id(&refused).is_none(), "stays uninitialised: {:?}", refused.spec);
    assert!(refused.metadata.labels.as_ref().is_none_or(|l| !l.contains_key(PROVIDER_LABEL)));

    // Routes: each provider's table holds its own Nodes' routes only.
    eventually("each provider's routes", Duration::from_secs(30), async || {
        let (c, m) = (routes(&cloud_sim).await, routes(&metal_sim).await);
        let want_c = vec![(a1.clone(), "10.244.1.0/24".to_string())];
        let mut want_m = vec![
            (b1.clone(), "10.244.2.0/24".to_string()),
            (pid.clone(), "10.244.3.0/24".to_string()),
            (b2.clone(), "10.244.5.0/24".to_string()),
        ];
        want_m.sort();
        (c == want_c && m == want_m).then_some(())
    })
    .await;

    // Lifecycle: the metal provider's gone instance takes its Node; nothing of the cloud's.
    metal_sim.admin.instance_action("m-b2", "terminate").await.expect("terminate");
    eventually("b2 deleted", Duration::from_secs(30), async || node(&env, &b2).await.is_none().then_some(())).await;
    assert!(node(&env, &a1).await.is_some() && node(&env, &b1).await.is_some());

    // Load balancers by class: unclassed to the default (the first provider), each class
    // to its provider, a class nobody serves left alone; backends are the provider's Nodes.
    create_service(&env, "web", None).await;
    create_service(&env, "metal-web", Some(METAL_CLASS)).await;
    create_service(&env, "cloud-web", Some(CLOUD_CLASS)).await;
    create_service(&env, "foreign", Some("someone-else.example.com/lb")).await;
    let web =
        eventually("web's load balancer in the cloud", Duration::from_secs(30), async || lb_of(&cloud_sim, "web").await).await;
    assert_eq!(web.nodes, vec![a1.clone()], "the cloud's Nodes only");
    assert!(web.ip.starts_with("203.0.113."), "{}", web.ip);
    let metal_web =
        eventually("metal-web's load balancer on metal", Duration::from_secs(30), async || lb_of(&metal_sim, "metal-web").await)
            .await;
    let mut want = vec![b1.clone(), pid.clone()];
    want.sort();
    let mut got = metal_web.nodes.clone();
    got.sort();
    assert_eq!(got, want, "the metal Nodes only");
    eventually("cloud-web's load balancer in the cloud", Duration::from_secs(30), async || lb_of(&cloud_sim, "cloud-web").await)
        .await;
    assert!(lb_of(&metal_sim, "web").await.is_none() && lb_of(&cloud_sim, "metal-web").await.is_none(), "no cross-talk");
    let foreign = env.services().get("foreign").await.expect("foreign");
    assert!(foreign.metadata.finalizers.unwrap_or_default().is_empty(), "a class nobody serves is left alone");
    assert!(lb_of(&cloud_sim, "foreign").await.is_none() && lb_of(&metal_sim, "foreign").await.is_none());

    // One provider killed: the other's work goes on, and /readyz names the one that is down.
    metal_sim.stop().await;
    NodeBuilder::new(&a2)
        .label(TEST_LABEL, &env.prefix)
        .label(PROVIDER_LABEL, "cloud")
        .uninitialized()
        .create(&env.client)
        .await
        .expect("a2");
    assert_eq!(initialised(&env, &a2).await, "cloud://cloud-zone-a/i-a2", "initialised while metal is down");
    create_service(&env, "web2", None).await;
    eventually("web2's load balancer while metal is down", Duration::from_secs(30), async || lb_of(&cloud_sim, "web2").await)
        .await;
    eventually("web's backends follow a2", Duration::from_secs(30), async || {
        let mut nodes = lb_of(&cloud_sim, "web").await?.nodes;
        nodes.sort();
        let mut want = vec![a1.clone(), a2.clone()];
        want.sort();
        (nodes == want).then_some(())
    })
    .await;
    let (status, body) = eventually("/readyz naming metal", Duration::from_secs(20), async || {
        let (status, body) = http_get(&health, "/readyz").await?;
        body.contains("provider metal").then_some((status, body))
    })
    .await;
    assert_eq!(status, 503, "{body}");
    assert!(!body.contains("provider cloud"), "the cloud is fine: {body}");
    // A Node nobody has labelled waits while a provider that might claim it is down: no guess.
    NodeBuilder::new(&a3).label(TEST_LABEL, &env.prefix).uninitialized().create(&env.client).await.expect("a3");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let waiting = node(&env, &a3).await.expect("a3");
    assert!(tainted(&waiting) && provider_id(&waiting).is_none(), "not guessed while metal is down");

    // Metal back (a new process, a new epoch): a3 is resolved, and metal's work resumes.
    metal_sim.launch(metal_config).await;
    assert_eq!(initialised(&env, &a3).await, "cloud://cloud-zone-a/i-a3", "resolved once metal answers");
    let (_, metrics) = http_get(&health, "/metrics").await.expect("metrics");
    for provider in ["cloud", "metal"] {
        assert!(metrics.contains(&format!("provider=\"{provider}\"")), "calls by provider: {provider}");
    }
    let recorded = env.services().get("web").await.expect("web").metadata.annotations.unwrap_or_default();
    assert_eq!(recorded.get("ccm-rs.dev/load-balancer-provider").map(String::as_str), Some("cloud"));
    core.stop().await.expect("stop");

    // The operator changes the flags: unclassed Services to metal now, and only metal asked
    // about unlabelled Nodes. A Service whose load balancer the cloud made stays the cloud's
    // (deleted there, never made twice); a new one goes to metal; the Node both know is
    // metal's now that only metal is asked.
    let core = start_core(
        cp,
        &env,
        &providers,
        &[
            "--leader-elect=false",
            "--cluster-cidr=10.244.0.0/16",
            "--default-load-balancer-provider=metal",
            "--node-provider-lookup-order=metal",
        ],
    );
    create_service(&env, "web3", None).await;
    eventually("web3's load balancer on metal", Duration::from_secs(30), async || lb_of(&metal_sim, "web3").await).await;
    env.services().delete("web", &kube::api::DeleteParams::default()).await.expect("delete web");
    eventually("web deleted with its cloud load balancer", Duration::from_secs(30), async || {
        let gone = env.services().get_opt("web").await.ok()?.is_none();
        (gone && lb_of(&cloud_sim, "web").await.is_none()).then_some(())
    })
    .await;
    assert!(lb_of(&metal_sim, "web").await.is_none(), "never made twice");
    // A user writes the cloud as the provider of a Service of metal's class (to go around
    // class-based admission): the cloud holds no load balancer of it, so the annotation is
    // refused and removed, and metal, the class's provider, makes its load balancer.
    let mut forged: Service = load_balancer_service(&env.namespace, "forged", &[80]);
    if let Some(spec) = forged.spec.as_mut() {
        spec.load_balancer_class = Some(METAL_CLASS.into());
    }
    forged.metadata.annotations = Some([("ccm-rs.dev/load-balancer-provider".to_string(), "cloud".to_string())].into());
    env.services().create(&PostParams::default(), &forged).await.expect("forged");
    eventually("forged's load balancer on metal", Duration::from_secs(30), async || lb_of(&metal_sim, "forged").await).await;
    assert!(lb_of(&cloud_sim, "forged").await.is_none(), "the annotation took the Service to the cloud");
    eventually("a LoadBalancerProviderRefused Warning", Duration::from_secs(10), async || {
        let events: Api<Event> = Api::namespaced(env.client.clone(), &env.namespace);
        let list = events.list(&ListParams::default().fields("involvedObject.name=forged")).await.ok()?;
        list.items
            .into_iter()
            .any(|e| e.reason.as_deref() == Some("LoadBalancerProviderRefused") && e.type_.as_deref() == Some("Warning"))
            .then_some(())
    })
    .await;
    eventually("forged's recorded provider rewritten by the core", Duration::from_secs(10), async || {
        let annotations = env.services().get("forged").await.ok()?.metadata.annotations.unwrap_or_default();
        (annotations.get("ccm-rs.dev/load-balancer-provider").map(String::as_str) == Some("metal")).then_some(())
    })
    .await;
    assert_eq!(initialised(&env, &both).await, "metal://metal-zone-a/m-both", "only metal asked: metal's");
    // A label naming no provider of this core: told, and left alone.
    let nope = env.node_name("nope");
    NodeBuilder::new(&nope)
        .label(TEST_LABEL, &env.prefix)
        .label(PROVIDER_LABEL, "vsphere")
        .uninitialized()
        .create(&env.client)
        .await
        .expect("nope");
    eventually("an UnknownProvider Event", Duration::from_secs(20), async || {
        node_reasons(&env, &nope).await.iter().any(|r| r == "UnknownProvider").then_some(())
    })
    .await;
    assert!(node(&env, &nope).await.is_some_and(|n| tainted(&n)), "left alone");

    core.stop().await.expect("stop");
    cloud_sim.stop().await;
    metal_sim.stop().await;
    env.cleanup().await.expect("cleanup");
}

/// The Go adapter (upstream's fake cloud behind it, `ccm-provider-fake`) as one provider of
/// two: its Nodes found by its name lookups and initialised from its answers, the Services of
/// the class it advertises (`--load-balancer-class`) given its load balancers, and the sim's
/// Nodes and unclassed Services left to the sim, whose load balancers front every Node
/// (`--load-balancer-backends-all-nodes=cloud`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_go_adapter_serves_one_side_of_a_hybrid_cluster() {
    use ccm_harness::assets::Assets;
    use ccm_harness::aws::Sidecar;
    let binary = match Assets::tool("fake-provider") {
        Ok(b) => b,
        Err(e) if std::env::var_os(crate::aws::REQUIRE).is_some() => {
            panic!("{} is set and ccm-provider-fake is missing: {e:#}", crate::aws::REQUIRE)
        }
        Err(e) => return eprintln!("skipped: the fake cloud's sidecar needs Go: {e:#}"),
    };
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "hybrid-go").await.expect("env");
    let [s1, f1] = ["s1", "f1"].map(|n| env.node_name(n));
    let sim = Sim::start(cloud("cloud", CLOUD_CLASS, "203.0.113.0/24", &[("i-s1", &s1)])).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let instances = serde_json::json!([{
        "name": f1, "providerID": format!("fake://{f1}"), "type": "fake.large",
        "addresses": [{ "type": "InternalIP", "address": "10.9.0.1" }],
    }]);
    let config =
        serde_json::json!({ "zone": "fake-zone", "region": "fake-region", "externalIP": "192.0.2.77", "instances": instances });
    let path = dir.path().join("cloud.json");
    std::fs::write(&path, config.to_string()).expect("cloud config");
    let args = [
        "--cloud-provider=fake".to_string(),
        format!("--cloud-config={}", path.display()),
        "--load-balancer-class=fake.example.com/lb".to_string(),
    ];
    let fake = Sidecar::run(&binary, dir.path(), &args, &[]).await.expect("ccm-provider-fake");

    for n in [&s1, &f1] {
        NodeBuilder::new(n).label(TEST_LABEL, &env.prefix).uninitialized().create(&env.client).await.expect("node");
        set_ready(&env.client, n, "True").await.expect("ready");
    }
    let core = start_core(
        cp,
        &env,
        &[("cloud", &sim.endpoint), ("upstream-fake", &fake.endpoint)],
        &["--leader-elect=false", "--controllers=cloud-node,service", "--load-balancer-backends-all-nodes=cloud"],
    );
    assert_eq!(initialised(&env, &s1).await, "cloud://cloud-zone-a/i-s1");
    assert_eq!(initialised(&env, &f1).await, format!("fake://{f1}"), "found and initialised through the adapter");
    let labels = node(&env, &f1).await.and_then(|n| n.metadata.labels).unwrap_or_default();
    assert_eq!(labels.get(PROVIDER_LABEL).map(String::as_str), Some("upstream-fake"));
    assert_eq!(labels.get("node.kubernetes.io/instance-type").map(String::as_str), Some("fake.large"));

    create_service(&env, "fake-web", Some("fake.example.com/lb")).await;
    create_service(&env, "web", None).await;
    let ip = eventually("the fake cloud's load balancer", Duration::from_secs(30), async || {
        let svc = env.services().get("fake-web").await.ok()?;
        svc.status?.load_balancer?.ingress?.first()?.ip.clone()
    })
    .await;
    assert_eq!(ip, "192.0.2.77", "the fake cloud's address");
    // The sim's load balancers front every Node (--load-balancer-backends-all-nodes=cloud):
    // the fake cloud's Node too, by its address.
    let web = eventually("web's load balancer on the sim, over both providers' Nodes", Duration::from_secs(30), async || {
        let lb = lb_of(&sim, "web").await?;
        (lb.nodes.len() == 2).then_some(lb)
    })
    .await;
    let mut want = vec![s1.clone(), f1.clone()];
    want.sort();
    let mut got = web.nodes.clone();
    got.sort();
    assert_eq!(got, want, "every Node a backend");
    assert!(lb_of(&sim, "fake-web").await.is_none(), "no cross-talk");

    core.stop().await.expect("stop");
    drop(fake);
    env.cleanup().await.expect("cleanup");
}

/// `ccm-conformance` with the two endpoints of a hybrid cluster, as an operator runs it: the
/// suite passes against each, and the providers' claims are checked together; two providers
/// of one scheme fail that check (the core would route their Nodes to the first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_runs_per_provider_and_checks_them_together() {
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../providers/sim/examples/conformance.toml");
    let config = |scheme: &str, class: &str| {
        let mut c = Config::load(&example).expect("example config");
        c.provider_id_scheme = scheme.into();
        c.load_balancers.classes = vec![class.into()];
        c
    };
    let run = |endpoints: &[&str]| {
        let mut cmd = std::process::Command::new(crate::support::workspace_binary("ccm-conformance"));
        cmd.arg("--consistency-timeout-seconds=5");
        for e in endpoints {
            cmd.arg(format!("--endpoint={e}"));
        }
        let out = cmd.output().expect("ccm-conformance runs");
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let mut cloud = Sim::start(config("cloud", CLOUD_CLASS)).await;
    let mut metal = Sim::start(config("metal", METAL_CLASS)).await;
    let (a, b) = (cloud.endpoint.clone(), metal.endpoint.clone());
    let (code, out) = tokio::task::spawn_blocking(move || run(&[&a, &b])).await.expect("join");
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(out.matches(" 0 failed").count(), 3, "each provider, then together: {out}");
    assert!(out.contains("PASS together.distinct-schemes") && out.contains("PASS together.distinct-classes"), "{out}");
    metal.stop().await;

    let mut twin = Sim::start(config("cloud", METAL_CLASS)).await;
    let (a, b) = (cloud.endpoint.clone(), twin.endpoint.clone());
    let (code, out) = tokio::task::spawn_blocking(move || run(&[&a, &b])).await.expect("join");
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("FAIL together.distinct-schemes: providerID scheme \"cloud\" is claimed by"), "{out}");
    twin.stop().await;
    cloud.stop().await;
}

/// The deletion bounds hold over all providers together, not only per provider: two
/// providers with two gone instances each, `--max-node-deletions=2`: two Nodes deleted in the
/// first window in all (never four), the other two a window later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_deletion_bounds_hold_over_every_provider_together() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "hybrid-bound").await.expect("env");
    let mut sims = Vec::new();
    let mut gone = Vec::new();
    for scheme in ["cloud", "metal"] {
        // Per provider: two Ready Nodes (witnesses) and two NotReady whose instances go.
        let names: Vec<String> = (0..4).map(|k| env.node_name(&format!("{scheme}-{k}"))).collect();
        let instances: Vec<(String, &str)> =
            names.iter().enumerate().map(|(k, n)| (format!("{scheme}-i{k}"), n.as_str())).collect();
        let pairs: Vec<(&str, &str)> = instances.iter().map(|(i, n)| (i.as_str(), *n)).collect();
        let class = format!("{scheme}.example.com/lb");
        let sim = Sim::start(cloud(scheme, &class, "203.0.113.0/24", &pairs)).await;
        for (k, name) in names.iter().enumerate() {
            NodeBuilder::new(name)
                .label(TEST_LABEL, &env.prefix)
                .label("topology.kubernetes.io/zone", &format!("{scheme}-zone-{k}"))
                .provider_id(&format!("{scheme}://{scheme}-zone-a/{scheme}-i{k}"))
                .create(&env.client)
                .await
                .expect("node");
            set_ready(&env.client, name, if k < 2 { "True" } else { "False" }).await.expect("condition");
        }
        for (k, name) in names.iter().enumerate().skip(2) {
            sim.admin.instance_action(&format!("{scheme}-i{k}"), "terminate").await.expect("terminate");
            gone.push(name.clone());
        }
        sims.push(sim);
    }
    let core = start_core(
        cp,
        &env,
        &[("cloud", &sims[0].endpoint), ("metal", &sims[1].endpoint)],
        &[
            "--leader-elect=false",
            "--controllers=cloud-node-lifecycle",
            "--node-monitor-period=300ms",
            "--max-node-deletions=2",
            "--max-node-deletion-share=1",
            "--node-deletion-window=8s",
        ],
    );
    let remaining = async || {
        let mut left = 0;
        for name in &gone {
            left += usize::from(node(&env, name).await.is_some());
        }
        left
    };
    let started = std::time::Instant::now();
    eventually("two deleted", Duration::from_secs(20), async || (remaining().await <= 2).then_some(())).await;
    // Well within the window: still two left (each provider alone would allow two more).
    tokio::time::sleep(Duration::from_secs(3)).await;
    if started.elapsed() < Duration::from_secs(7) {
        assert_eq!(remaining().await, 2, "at most two deletions in a window over both providers");
    }
    eventually("the other two a window later", Duration::from_secs(30), async || (remaining().await == 0).then_some(())).await;
    assert!(started.elapsed() >= Duration::from_secs(6), "not within the first window: {:?}", started.elapsed());
    core.stop().await.expect("stop");
    for mut sim in sims {
        sim.stop().await;
    }
    env.cleanup().await.expect("cleanup");
}

/// A Node no provider ever knew (no providerID, never initialised) that a label assigns to a
/// provider is not deleted by that provider's lifecycle controller when the provider says it
/// has no such instance: a Warning says why, and it stays. A Node the provider knew (its
/// providerID) whose instance is gone is deleted in the same passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_only_a_label_assigns_is_not_deleted_by_a_provider_that_never_knew_it() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "hybrid-claim").await.expect("env");
    let mut sims = Vec::new();
    for scheme in ["cloud", "metal"] {
        let names: Vec<String> = (0..2).map(|k| env.node_name(&format!("{scheme}-{k}"))).collect();
        let pairs: Vec<(String, &str)> = names.iter().enumerate().map(|(k, n)| (format!("{scheme}-i{k}"), n.as_str())).collect();
        let pairs: Vec<(&str, &str)> = pairs.iter().map(|(i, n)| (i.as_str(), *n)).collect();
        let sim = Sim::start(cloud(scheme, &format!("{scheme}.example.com/lb"), "203.0.113.0/24", &pairs)).await;
        for (k, name) in names.iter().enumerate() {
            NodeBuilder::new(name)
                .label(TEST_LABEL, &env.prefix)
                .provider_id(&format!("{scheme}://{scheme}-zone-a/{scheme}-i{k}"))
                .create(&env.client)
                .await
                .expect("node");
            // Each provider: one Ready witness, and one NotReady Node whose instance goes.
            set_ready(&env.client, name, if k == 0 { "True" } else { "False" }).await.expect("condition");
        }
        sim.admin.instance_action(&format!("{scheme}-i1"), "terminate").await.expect("terminate");
        sims.push(sim);
    }
    // Claimed for metal by its label alone: no providerID, metal has no instance of it.
    let claimed = env.node_name("claimed");
    NodeBuilder::new(&claimed)
        .label(TEST_LABEL, &env.prefix)
        .label(PROVIDER_LABEL, "metal")
        .create(&env.client)
        .await
        .expect("node");
    set_ready(&env.client, &claimed, "False").await.expect("condition");
    let core = start_core(
        cp,
        &env,
        &[("cloud", &sims[0].endpoint), ("metal", &sims[1].endpoint)],
        &[
            "--leader-elect=false",
            "--controllers=cloud-node-lifecycle",
            "--node-monitor-period=300ms",
            "--max-node-deletion-share=1",
        ],
    );
    let known = env.node_name("metal-1");
    eventually("the Node metal knew deleted", Duration::from_secs(20), async || node(&env, &known).await.is_none().then_some(()))
        .await;
    eventually("a NodeDeletionRefused Warning on the claimed Node", Duration::from_secs(20), async || {
        node_reasons(&env, &claimed).await.iter().any(|r| r == "NodeDeletionRefused").then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(node(&env, &claimed).await.is_some(), "a Node its provider never knew is not deleted");
    core.stop().await.expect("stop");
    for mut sim in sims {
        sim.stop().await;
    }
    env.cleanup().await.expect("cleanup");
}
