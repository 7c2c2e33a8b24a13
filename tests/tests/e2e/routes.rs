//! The route controller, end to end: real API server, the core, the sim over a unix socket.

use std::collections::BTreeSet;
use std::time::Duration;

use ccm_harness::cluster::{NodeBuilder, TestEnv};
use ccm_provider_sim::Config;
use ccm_provider_sim::admin::RouteSpec;
use ccm_provider_sim::config::{Fault, FaultCode, RouteTableSpec};
use k8s_openapi::api::core::v1::{Event, Node};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};

use crate::support::{Core, Sim, TEST_LABEL, eventually, free_port, http_get, instance};

/// (table, destination, node) of this cluster's routes in the sim.
async fn routes(sim: &Sim, cluster: &str) -> BTreeSet<(String, String, String)> {
    let state = sim.admin.state().await.expect("state");
    state
        .route_tables
        .into_iter()
        .flat_map(|t| t.routes.into_iter().map(move |r| (t.id.clone(), r)))
        .filter(|(_, r)| r.cluster == cluster)
        .map(|(t, r)| (t, r.destination_cidr, r.node_name))
        .collect()
}

fn set(items: &[(&str, &str, &str)]) -> BTreeSet<(String, String, String)> {
    items.iter().map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string())).collect()
}

async fn condition(env: &TestEnv, node: &str) -> Option<(String, String)> {
    let n: Node = env.nodes().get(node).await.ok()?;
    let c = n.status?.conditions?.into_iter().find(|c| c.type_ == "NetworkUnavailable")?;
    Some((c.status, c.reason.unwrap_or_default()))
}

async fn metric(base: &str, name: &str) -> Option<f64> {
    let (_, text) = http_get(base, "/metrics").await?;
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

fn route_flags(env: &TestEnv, extra: &[&str]) -> Vec<String> {
    let mut flags = vec![
        "--leader-elect=false".to_string(),
        "--controllers=route".to_string(),
        "--cluster-cidr=10.244.0.0/16".to_string(),
        format!("--cluster-name={}", env.prefix),
    ];
    flags.extend(extra.iter().map(|s| s.to_string()));
    flags
}

fn start(cp: &ccm_harness::ControlPlane, env: &TestEnv, sim: &Sim, flags: &[String]) -> Core {
    Core::start(cp, env, sim, &flags.iter().map(String::as_str).collect::<Vec<_>>())
}

async fn node(env: &TestEnv, name: &str, cidrs: &[&str]) {
    let mut b = NodeBuilder::new(name).label(TEST_LABEL, &env.prefix);
    for c in cidrs {
        b = b.pod_cidr(c);
    }
    b.create(&env.client).await.expect("node");
}

/// A sim with instances `i-a`, `i-b`, `i-c` for the env's Nodes a, b and c, and their names.
async fn three_instances(env: &TestEnv) -> (Sim, String, String, String) {
    let (a, b, c) = (env.node_name("a"), env.node_name("b"), env.node_name("c"));
    let mut config = Config::default();
    for (id, n) in [("i-a", &a), ("i-b", &b), ("i-c", &c)] {
        config.instances.push(instance(id, n, "sim-region-1a"));
    }
    (Sim::start(config).await, a, b, c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_follow_nodes_and_the_condition_follows_routes() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "routes").await.expect("env");
    let (sim, a, b, c) = three_instances(&env).await;
    node(&env, &a, &["10.244.1.0/24"]).await;
    node(&env, &b, &["10.244.2.0/24"]).await;
    node(&env, &c, &[]).await;
    let core = start(cp, &env, &sim, &route_flags(&env, &[]));
    let want = set(&[("rt-main", "10.244.1.0/24", &a), ("rt-main", "10.244.2.0/24", &b)]);
    eventually("routes for a and b", Duration::from_secs(20), async || (routes(&sim, &env.prefix).await == want).then_some(()))
        .await;
    eventually("NetworkUnavailable=False", Duration::from_secs(10), async || {
        (condition(&env, &a).await? == ("False".to_string(), "RouteCreated".to_string())).then_some(())
    })
    .await;

    // A podCIDR assigned later gets its route.
    let patch = serde_json::json!({ "spec": { "podCIDR": "10.244.3.0/24", "podCIDRs": ["10.244.3.0/24"] } });
    env.nodes().patch(&c, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("podCIDR");
    eventually("route for c", Duration::from_secs(10), async || {
        routes(&sim, &env.prefix).await.contains(&("rt-main".into(), "10.244.3.0/24".into(), c.clone())).then_some(())
    })
    .await;

    // A deleted Node's route goes; a re-created Node with another podCIDR replaces its route.
    env.nodes().delete(&b, &DeleteParams::default()).await.expect("delete b");
    env.nodes().delete(&a, &DeleteParams::default()).await.expect("delete a");
    eventually("a gone", Duration::from_secs(10), async || env.nodes().get_opt(&a).await.ok()?.is_none().then_some(())).await;
    node(&env, &a, &["10.244.9.0/24"]).await;
    let want = set(&[("rt-main", "10.244.9.0/24", &a), ("rt-main", "10.244.3.0/24", &c)]);
    eventually("routes after the changes", Duration::from_secs(20), async || {
        (routes(&sim, &env.prefix).await == want).then_some(())
    })
    .await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

/// Another writer sets NetworkUnavailable wrongly on a Node whose route exists: the condition
/// is put back at once, not at the next resync (12 h away here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_network_unavailable_another_writer_changed_is_put_back() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "rtcond").await.expect("env");
    let (sim, a, _, _) = three_instances(&env).await;
    node(&env, &a, &["10.244.1.0/24"]).await;
    let core = start(cp, &env, &sim, &route_flags(&env, &["--route-resync-period=12h"]));
    let routed = ("False".to_string(), "RouteCreated".to_string());
    eventually("NetworkUnavailable=False", Duration::from_secs(20), async || {
        (condition(&env, &a).await? == routed).then_some(())
    })
    .await;
    for round in 0..2 {
        let patch = serde_json::json!({ "status": { "conditions": [{
            "type": "NetworkUnavailable", "status": "True", "reason": "SomeoneElse", "message": format!("round {round}"),
        }]}});
        env.nodes().patch_status(&a, &PatchParams::default(), &Patch::Strategic(&patch)).await.expect("condition");
        eventually("NetworkUnavailable put back", Duration::from_secs(10), async || {
            (condition(&env, &a).await? == routed).then_some(())
        })
        .await;
    }
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_corrects_drift_and_leaves_foreign_routes_alone() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "drift").await.expect("env");
    let (a, ghost) = (env.node_name("a"), env.node_name("ghost"));
    let mut config = Config::default();
    config.instances.push(instance("i-a", &a, "sim-region-1a"));
    config.instances.push(instance("i-ghost", &ghost, "sim-region-1a"));
    let sim = Sim::start(config).await;
    node(&env, &a, &["10.244.1.0/24"]).await;
    let port = free_port();
    let flags = route_flags(
        &env,
        &[&format!("--secure-port={port}"), "--insecure-serving", "--bind-address=127.0.0.1", "--route-resync-period=4s"],
    );
    let core = start(cp, &env, &sim, &flags);
    let base = core.health.clone().expect("health");
    eventually("a's route", Duration::from_secs(20), async || (routes(&sim, &env.prefix).await.len() == 1).then_some(())).await;

    let add = |cluster: &str, name: &str, cidr: &str, node: &str| RouteSpec {
        cluster: cluster.into(),
        table_id: String::new(),
        name: name.into(),
        destination_cidr: cidr.into(),
        node_name: node.into(),
    };
    // Out of band: a stale route in the cluster CIDR, a route to an instance about to be
    // terminated (a blackhole), a route outside the cluster CIDR, and another cluster's route.
    sim.admin.add_route(&add(&env.prefix, "stale", "10.244.77.0/24", &a)).await.expect("stale");
    sim.admin.add_route(&add(&env.prefix, "ghost", "10.244.78.0/24", &ghost)).await.expect("ghost");
    sim.admin.instance_action("i-ghost", "terminate").await.expect("terminate");
    sim.admin.add_route(&add(&env.prefix, "outside", "10.99.0.0/24", &a)).await.expect("outside");
    sim.admin.add_route(&add("another-cluster", "theirs", "10.244.200.0/24", &a)).await.expect("theirs");
    // And a route in the cluster CIDR that names no target (a gateway's): no Node to judge it
    // by, so no evidence that it is stale; it stays.
    sim.admin.add_route(&add(&env.prefix, "gateway", "10.244.90.0/24", "")).await.expect("gateway");

    let want = set(&[("rt-main", "10.244.1.0/24", &a), ("rt-main", "10.99.0.0/24", &a), ("rt-main", "10.244.90.0/24", "")]);
    eventually("the resync's corrections", Duration::from_secs(20), async || {
        (routes(&sim, &env.prefix).await == want).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(9)).await;
    assert_eq!(routes(&sim, &env.prefix).await, want, "two resyncs later, the route without a target is still there");
    assert_eq!(routes(&sim, "another-cluster").await.len(), 1, "another cluster's route is left alone");
    let corrections = metric(&base, "ccm_route_corrections_total").await.expect("metric");
    assert!(corrections >= 2.0, "the stale and blackhole routes count as corrections: {corrections}");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_costs_a_handful_of_reconciles_and_steady_state_lists_nothing() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "burst").await.expect("env");
    let names: Vec<String> = (0..100).map(|i| env.node_name(&format!("n{i:03}"))).collect();
    let mut config = Config::default();
    config.route_tables[0].max_routes = 0;
    for (i, n) in names.iter().enumerate() {
        config.instances.push(instance(&format!("i-{i}"), n, "sim-region-1a"));
    }
    let sim = Sim::start(config).await;
    let port = free_port();
    let flags = route_flags(&env, &[&format!("--secure-port={port}"), "--insecure-serving", "--bind-address=127.0.0.1"]);
    let core = start(cp, &env, &sim, &flags);
    let base = core.health.clone().expect("health");
    eventually("the controller's first pass", Duration::from_secs(20), async || {
        (metric(&base, "ccm_route_syncs_total").await? >= 1.0).then_some(())
    })
    .await;
    let before = metric(&base, "ccm_route_syncs_total").await.expect("metric");
    futures::future::join_all(names.iter().enumerate().map(|(i, n)| {
        let env = env.clone();
        async move {
            let cidr = format!("10.244.{i}.0/24");
            node(&env, n, &[&cidr]).await;
        }
    }))
    .await;
    eventually("100 routes", Duration::from_secs(30), async || (routes(&sim, &env.prefix).await.len() == 100).then_some(()))
        .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let syncs = metric(&base, "ccm_route_syncs_total").await.expect("metric") - before;
    assert!(syncs <= 10.0, "100 nodes in a burst took {syncs} full reconciles");

    // Steady state for 30 s with heartbeat-like updates (Ready condition and a label on every
    // Node every 5 s): no listing and no route call at all.
    let lists = sim.admin.call_count("RoutesService/ListRoutes").await.expect("calls");
    let writes = sim.admin.call_count("RoutesService/CreateRoute").await.expect("calls");
    for round in 0..6 {
        futures::future::join_all(names.iter().map(|n| {
            let env = env.clone();
            async move {
                ccm_harness::cluster::set_ready(&env.client, n, "True").await.expect("ready");
                let patch = serde_json::json!({ "metadata": { "labels": { "heartbeat": round.to_string() } } });
                env.nodes().patch(n, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("patch");
            }
        }))
        .await;
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    assert_eq!(sim.admin.call_count("RoutesService/ListRoutes").await.expect("calls"), lists, "no ListRoutes at steady state");
    assert_eq!(
        sim.admin.call_count("RoutesService/CreateRoute").await.expect("calls"),
        writes,
        "no route writes at steady state"
    );
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

/// Nodes that join without podCIDRs (before IPAM gives them one) want no route: a join of
/// many costs no reconcile over every Node, and neither does their deletion; a podCIDR given
/// later gets its route at once, and a Node with routes that goes takes them with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_without_pod_cidrs_cost_no_reconcile() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "nocidr").await.expect("env");
    let a = env.node_name("a");
    let names: Vec<String> = (0..30).map(|i| env.node_name(&format!("j{i:02}"))).collect();
    let mut config = Config::default();
    config.instances.push(instance("i-a", &a, "sim-region-1a"));
    for (i, n) in names.iter().enumerate() {
        config.instances.push(instance(&format!("i-j{i}"), n, "sim-region-1a"));
    }
    let sim = Sim::start(config).await;
    node(&env, &a, &["10.244.1.0/24"]).await;
    let port = free_port();
    let flags = route_flags(&env, &[&format!("--secure-port={port}"), "--insecure-serving", "--bind-address=127.0.0.1"]);
    let core = start(cp, &env, &sim, &flags);
    let base = core.health.clone().expect("health");
    eventually("a's route", Duration::from_secs(20), async || (routes(&sim, &env.prefix).await.len() == 1).then_some(())).await;
    tokio::time::sleep(Duration::from_secs(1)).await;

    // They join over 3 s: a reconcile each `--route-min-interval` (500 ms) if they counted.
    // (Other tests' Nodes that go, with podCIDRs, may count: they are evidence for routes.)
    let syncs = async || metric(&base, "ccm_route_syncs_total").await.expect("metric");
    let before = syncs().await;
    for n in &names {
        node(&env, n, &[]).await;
        ccm_harness::cluster::set_ready(&env.client, n, "True").await.expect("ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    env.nodes().delete(&names[29], &DeleteParams::default()).await.expect("delete");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let took = syncs().await - before;
    assert!(took <= 2.0, "30 Nodes joining without podCIDRs (and one leaving) took {took} reconciles");

    // One of them gets a podCIDR: its route, at once; a goes, and its route with it.
    let patch = serde_json::json!({ "spec": { "podCIDR": "10.244.2.0/24", "podCIDRs": ["10.244.2.0/24"] } });
    env.nodes().patch(&names[0], &PatchParams::default(), &Patch::Merge(&patch)).await.expect("podCIDR");
    env.nodes().delete(&a, &DeleteParams::default()).await.expect("delete a");
    let want = set(&[("rt-main", "10.244.2.0/24", &names[0])]);
    eventually("the new Node's route, and a's gone (a gone for 10 s first)", Duration::from_secs(25), async || {
        (routes(&sim, &env.prefix).await == want).then_some(())
    })
    .await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_table_creates_what_fits_and_does_not_loop() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "quota").await.expect("env");
    let names: Vec<String> = (0..5).map(|i| env.node_name(&format!("n{i}"))).collect();
    let mut config = Config::default();
    config.route_tables[0].max_routes = 3;
    for (i, n) in names.iter().enumerate() {
        config.instances.push(instance(&format!("i-{i}"), n, "sim-region-1a"));
    }
    let sim = Sim::start(config).await;
    for (i, n) in names.iter().enumerate() {
        node(&env, n, &[&format!("10.244.{i}.0/24")]).await;
    }
    let core = start(cp, &env, &sim, &route_flags(&env, &[]));
    eventually("three routes", Duration::from_secs(20), async || (routes(&sim, &env.prefix).await.len() == 3).then_some(()))
        .await;
    // Deterministic: the first three nodes by name.
    let routed: BTreeSet<String> = routes(&sim, &env.prefix).await.into_iter().map(|r| r.2).collect();
    assert_eq!(routed, names.iter().take(3).cloned().collect());
    for n in names.iter().skip(3) {
        eventually("NetworkUnavailable=True", Duration::from_secs(10), async || {
            (condition(&env, n).await? == ("True".to_string(), "NoRouteCreated".to_string())).then_some(())
        })
        .await;
        // Events are recorded in the background.
        eventually("a FailedToCreateRoute event", Duration::from_secs(10), async || {
            let events: Api<Event> = Api::all(env.client.clone());
            let list = events.list(&ListParams::default().fields(&format!("involvedObject.name={n}"))).await.ok()?;
            list.items.iter().any(|e| e.reason.as_deref() == Some("FailedToCreateRoute")).then_some(())
        })
        .await;
    }
    let creates = sim.admin.call_count("RoutesService/CreateRoute").await.expect("calls");
    // Node updates keep coming; nothing loops.
    for n in &names {
        let patch = serde_json::json!({ "metadata": { "labels": { "touched": "yes" } } });
        env.nodes().patch(n, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("patch");
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        sim.admin.call_count("RoutesService/CreateRoute").await.expect("calls"),
        creates,
        "no create loop against a full table"
    );
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tables_and_dual_stack() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "tables").await.expect("env");
    let (a, b) = (env.node_name("a"), env.node_name("b"));
    let mut config = Config {
        route_tables: vec![
            RouteTableSpec { id: "rt-a".into(), name: "a".into(), max_routes: 50, zones: vec!["sim-region-1a".into()] },
            RouteTableSpec { id: "rt-b".into(), name: "b".into(), max_routes: 50, zones: vec!["sim-region-1b".into()] },
        ],
        ..Config::default()
    };
    // A third zone no table covers.
    let c = env.node_name("c");
    config.instances.push(instance("i-a", &a, "sim-region-1a"));
    config.instances.push(instance("i-b", &b, "sim-region-1b"));
    config.instances.push(instance("i-c", &c, "sim-region-1c"));
    let sim = Sim::start(config).await;
    node(&env, &a, &["10.244.1.0/24", "fd00:10:244:1::/64"]).await;
    node(&env, &b, &["10.244.2.0/24", "fd00:10:244:2::/64"]).await;
    NodeBuilder::new(&c)
        .label(TEST_LABEL, &env.prefix)
        .provider_id("sim://sim-region-1c/i-c")
        .pod_cidr("10.244.3.0/24")
        .create(&env.client)
        .await
        .expect("node");
    let flags = vec![
        "--leader-elect=false".to_string(),
        "--controllers=route".to_string(),
        "--cluster-cidr=10.244.0.0/16,fd00:10:244::/56".to_string(),
        format!("--cluster-name={}", env.prefix),
    ];
    let core = start(cp, &env, &sim, &flags);
    let want = set(&[
        ("rt-a", "10.244.1.0/24", &a),
        ("rt-a", "fd00:10:244:1::/64", &a),
        ("rt-b", "10.244.2.0/24", &b),
        ("rt-b", "fd00:10:244:2::/64", &b),
    ]);
    eventually("routes in each node's table, both families", Duration::from_secs(20), async || {
        (routes(&sim, &env.prefix).await == want).then_some(())
    })
    .await;
    // The Node no table covers is not silently left out: its network is unavailable, and an
    // Event says why.
    eventually("NetworkUnavailable=True on the Node no table covers", Duration::from_secs(10), async || {
        (condition(&env, &c).await? == ("True".to_string(), "NoRouteCreated".to_string())).then_some(())
    })
    .await;
    eventually("a FailedToCreateRoute event naming the missing table", Duration::from_secs(10), async || {
        let events: Api<Event> = Api::all(env.client.clone());
        let list = events.list(&ListParams::default().fields(&format!("involvedObject.name={c}"))).await.ok()?;
        list.items
            .iter()
            .any(|e| {
                e.reason.as_deref() == Some("FailedToCreateRoute")
                    && e.message.as_deref().is_some_and(|m| m.contains("no route table"))
            })
            .then_some(())
    })
    .await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_provider_is_backed_off_then_converges() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "rfail").await.expect("env");
    let a = env.node_name("a");
    let mut config = Config::default();
    config.instances.push(instance("i-a", &a, "sim-region-1a"));
    config.faults.push(Fault {
        method: "CreateRoute".into(),
        error_rate: 0.0,
        down: true,
        code: FaultCode::Unavailable,
        subject: None,
        retry_after_ms: None,
        ..Default::default()
    });
    let sim = Sim::start(config).await;
    node(&env, &a, &["10.244.1.0/24"]).await;
    let core = start(cp, &env, &sim, &route_flags(&env, &["--reconcile-backoff-base=500ms"]));
    tokio::time::sleep(Duration::from_secs(6)).await;
    let attempts = sim.admin.call_count("RoutesService/CreateRoute").await.expect("calls");
    // 3 tries per reconcile at most; backoff 0.5, 1, 2, 4 s: a handful of reconciles in 6 s.
    assert!((3..=15).contains(&attempts), "{attempts} CreateRoute attempts in 6 s");
    assert_eq!(condition(&env, &a).await.map(|c| c.0), Some("True".to_string()));
    // Throttled instead of down: still converges once it clears.
    sim.admin
        .set_faults(&[Fault {
            method: "CreateRoute".into(),
            error_rate: 1.0,
            down: false,
            code: FaultCode::RateLimited,
            subject: None,
            retry_after_ms: None,
            ..Default::default()
        }])
        .await
        .expect("throttle");
    tokio::time::sleep(Duration::from_secs(2)).await;
    sim.admin.set_faults(&[]).await.expect("clear");
    eventually("the route once the provider recovers", Duration::from_secs(30), async || {
        (routes(&sim, &env.prefix).await.len() == 1).then_some(())
    })
    .await;
    eventually("NetworkUnavailable=False", Duration::from_secs(10), async || {
        (condition(&env, &a).await?.0 == "False").then_some(())
    })
    .await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_are_deleted_only_when_their_node_is_gone_or_its_pod_cidr_changed() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "evidence").await.expect("env");
    let (sim, a, b, c) = three_instances(&env).await;
    node(&env, &a, &["10.244.1.0/24"]).await;
    node(&env, &b, &["10.244.2.0/24"]).await;
    node(&env, &c, &["10.244.3.0/24"]).await;
    let core = start(cp, &env, &sim, &route_flags(&env, &["--route-resync-period=2s"]));
    let all = set(&[("rt-main", "10.244.1.0/24", &a), ("rt-main", "10.244.2.0/24", &b), ("rt-main", "10.244.3.0/24", &c)]);
    eventually("three routes", Duration::from_secs(20), async || (routes(&sim, &env.prefix).await == all).then_some(())).await;

    // Excluded from the controllers (another label), and being deleted (a finalizer holds
    // it): neither is evidence that the route is stale. Resyncs come and go.
    let patch = serde_json::json!({ "metadata": { "labels": { TEST_LABEL: "someone-else" } } });
    env.nodes().patch(&b, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("exclude b");
    let hold = serde_json::json!({ "metadata": { "finalizers": ["example.com/hold"] } });
    env.nodes().patch(&c, &PatchParams::default(), &Patch::Merge(&hold)).await.expect("finalizer");
    env.nodes().delete(&c, &DeleteParams::default()).await.expect("delete c");
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(routes(&sim, &env.prefix).await, all, "no route deleted for an excluded or terminating Node");

    // Evidence: c gone from the API, a's podCIDR changed (a Node re-created with another).
    let release = serde_json::json!({ "metadata": { "finalizers": null } });
    env.nodes().patch(&c, &PatchParams::default(), &Patch::Merge(&release)).await.expect("release c");
    env.nodes().delete(&a, &DeleteParams::default()).await.expect("delete a");
    eventually("a gone", Duration::from_secs(10), async || env.nodes().get_opt(&a).await.ok()?.is_none().then_some(())).await;
    node(&env, &a, &["10.244.11.0/24"]).await;
    let want = set(&[("rt-main", "10.244.11.0/24", &a), ("rt-main", "10.244.2.0/24", &b)]);
    eventually("stale routes deleted, the new one created", Duration::from_secs(20), async || {
        (routes(&sim, &env.prefix).await == want).then_some(())
    })
    .await;
    core.stop().await.expect("stop");
    let patch = serde_json::json!({ "metadata": { "labels": { TEST_LABEL: env.prefix } } });
    let _ = env.nodes().patch(&b, &PatchParams::default(), &Patch::Merge(&patch)).await;
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_ipam_gives_podcidrs_from_both_families_and_routes_follow() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "ipam").await.expect("env");
    let names: Vec<String> = ["b", "a", "c", "d", "e"].iter().map(|n| env.node_name(n)).collect();
    let mut config = Config::default();
    for (i, n) in names.iter().enumerate() {
        config.instances.push(instance(&format!("i-{i}"), n, "sim-region-1a"));
    }
    let sim = Sim::start(config).await;
    // b's CIDRs were set by someone else: they are never given again.
    node(&env, &names[0], &["10.252.0.0/24", "fd00:252::/64"]).await;
    // Four node CIDRs of each family in all.
    let flags = route_flags(&env, &[]);
    let mut flags: Vec<String> =
        flags.into_iter().filter(|f| !f.starts_with("--cluster-cidr") && !f.starts_with("--controllers")).collect();
    flags.extend([
        "--controllers=route,nodeipam".to_string(),
        "--allocate-node-cidrs".to_string(),
        "--cluster-cidr=10.252.0.0/22,fd00:252::/62".to_string(),
        "--node-cidr-mask-size-ipv4=24".to_string(),
        "--node-cidr-mask-size-ipv6=64".to_string(),
    ]);
    let core = start(cp, &env, &sim, &flags);
    for n in &names[1..4] {
        node(&env, n, &[]).await;
    }
    let cidrs_of = async |name: &str| -> Vec<String> {
        env.nodes().get(name).await.ok().and_then(|n| n.spec?.pod_cidrs).unwrap_or_default()
    };
    let mut given = BTreeSet::new();
    for n in &names[1..4] {
        let cidrs = eventually("podCIDRs given", Duration::from_secs(20), async || {
            let c = cidrs_of(n).await;
            (c.len() == 2).then_some(c)
        })
        .await;
        assert!(cidrs[0].starts_with("10.252.") && cidrs[0].ends_with("/24"), "{cidrs:?}");
        assert!(cidrs[1].starts_with("fd00:252:") && cidrs[1].ends_with("/64"), "{cidrs:?}");
        given.extend(cidrs);
    }
    assert_eq!(given.len(), 6, "each node CIDR given once: {given:?}");
    assert!(!given.contains("10.252.0.0/24") && !given.contains("fd00:252::/64"), "b's are never given again");
    // Routes follow the given CIDRs, both families.
    eventually("a route for every given CIDR", Duration::from_secs(30), async || {
        let have: BTreeSet<String> = routes(&sim, &env.prefix).await.into_iter().map(|(_, cidr, _)| cidr).collect();
        given.iter().all(|c| have.contains(c)).then_some(())
    })
    .await;

    // The range is full: the fifth Node gets none, and says so.
    node(&env, &names[4], &[]).await;
    eventually("CIDRNotAvailable", Duration::from_secs(20), async || {
        let events: Api<Event> = Api::all(env.client.clone());
        let list = events.list(&ListParams::default().fields(&format!("involvedObject.name={}", names[4]))).await.ok()?;
        list.items.iter().any(|e| e.reason.as_deref() == Some("CIDRNotAvailable")).then_some(())
    })
    .await;
    assert!(cidrs_of(&names[4]).await.is_empty());
    // a goes: its CIDRs are free again, and the waiting Node gets exactly them.
    let freed = cidrs_of(&names[1]).await;
    env.nodes().delete(&names[1], &DeleteParams::default()).await.expect("delete a");
    eventually("the freed CIDRs given to the waiting Node", Duration::from_secs(20), async || {
        (cidrs_of(&names[4]).await == freed).then_some(())
    })
    .await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstreams_route_reconciliation_period_lists_routes_every_period() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "routeperiod").await.expect("env");
    let a = env.node_name("a");
    let mut config = Config::default();
    config.instances.push(instance("i-a", &a, "sim-region-1a"));
    let sim = Sim::start(config).await;
    node(&env, &a, &["10.244.7.0/24"]).await;
    let core = start(cp, &env, &sim, &route_flags(&env, &["--route-reconciliation-period=1s"]));
    eventually("the route", Duration::from_secs(20), async || (!routes(&sim, &env.prefix).await.is_empty()).then_some(())).await;
    // No Node changes from here: every listing is the period's.
    // Over 8 s: a fresh machine runs these tests beside Go builds that take both cores, and a
    // 4 s window once saw 2 listings. Fewer than 4 is no period; more than 10 a hot loop.
    let before = sim.admin.call_count("RoutesService/ListRoutes").await.expect("calls");
    tokio::time::sleep(Duration::from_secs(8)).await;
    let listed = sim.admin.call_count("RoutesService/ListRoutes").await.expect("calls") - before;
    assert!((4..=10).contains(&listed), "one listing a second as upstream's period asks: {listed} in 8 s");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_provider_gets_a_table_of_routes_in_one_call_and_a_failed_item_is_retried() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "rbulk").await.expect("env");
    let names: Vec<String> = (0..40).map(|i| env.node_name(&format!("n{i:02}"))).collect();
    let mut config = Config { bulk_routes: true, ..Default::default() };
    config.route_tables[0].max_routes = 0;
    for (i, n) in names.iter().enumerate() {
        config.instances.push(instance(&format!("i-{i}"), n, "sim-region-1a"));
    }
    // The first attempt of one route fails in its own item (transient): the rest are made
    // in the same call, and it comes with the retry.
    config.faults.push(Fault {
        method: "ApplyRoutes".into(),
        down: true,
        subject: Some(names[7].clone()),
        code: FaultCode::Unavailable,
        ..Default::default()
    });
    let sim = Sim::start(config).await;
    for (i, n) in names.iter().enumerate() {
        node(&env, n, &[&format!("10.244.{i}.0/24")]).await;
    }
    let core = start(cp, &env, &sim, &route_flags(&env, &[]));
    eventually("39 routes", Duration::from_secs(20), async || (routes(&sim, &env.prefix).await.len() == 39).then_some(())).await;
    let cidr7 = "10.244.7.0/24";
    assert!(!routes(&sim, &env.prefix).await.iter().any(|(_, d, _)| d == cidr7), "the route whose item failed was not made");
    sim.admin.set_faults(&[]).await.expect("clear");
    eventually("40 routes", Duration::from_secs(20), async || (routes(&sim, &env.prefix).await.len() == 40).then_some(())).await;
    let bulk = sim.admin.call_count("RoutesService/ApplyRoutes").await.expect("calls");
    let single = sim.admin.call_count("RoutesService/CreateRoute").await.expect("calls");
    assert_eq!(single, 0, "no single CreateRoute with a bulk provider");
    assert!(bulk <= 6, "{bulk} ApplyRoutes calls for 40 routes (one, then retries of the failed one)");

    // Deleting Nodes deletes their routes in one call too.
    for n in &names[..10] {
        env.nodes().delete(n, &DeleteParams::default()).await.expect("delete");
    }
    eventually("30 routes", Duration::from_secs(20), async || (routes(&sim, &env.prefix).await.len() == 30).then_some(())).await;
    assert_eq!(sim.admin.call_count("RoutesService/DeleteRoute").await.expect("calls"), 0, "no single DeleteRoute");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}
