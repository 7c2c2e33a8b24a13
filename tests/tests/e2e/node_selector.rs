//! Backends chosen per Service (`ccm-rs.dev/load-balancer-node-selector`), end to end: real API
//! server, the core, the sim over a unix socket. Each load balancer gets the Nodes its
//! Service's selector matches; a node change updates only the load balancers whose own set
//! changed; a malformed selector is a Warning Event and no change.

use std::time::Duration;

use ccm_harness::cluster::{NodeBuilder, TestEnv, load_balancer_ip, load_balancer_service};
use ccm_provider_sim::Config;
use k8s_openapi::api::core::v1::{Event, Service};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams};

use crate::support::{Core, Sim, TEST_LABEL, eventually, instance};

const SELECTOR: &str = "ccm-rs.dev/load-balancer-node-selector";

/// A backend Node of instance `id` with `labels`.
async fn node(env: &TestEnv, name: &str, id: &str, labels: &[(&str, &str)]) {
    let mut b = NodeBuilder::new(name)
        .label(TEST_LABEL, &env.prefix)
        .provider_id(&format!("sim://sim-region-1a/{id}"))
        .address("InternalIP", "10.0.0.9");
    for (k, v) in labels {
        b = b.label(k, v);
    }
    b.create(&env.client).await.expect("node");
}

/// A LoadBalancer Service with `selector` as its node selector (none when `None`).
async fn service(env: &TestEnv, name: &str, selector: Option<&str>) {
    let mut svc: Service = load_balancer_service(&env.namespace, name, &[80]);
    if let Some(s) = selector {
        svc.metadata.annotations = Some([(SELECTOR.to_string(), s.to_string())].into());
    }
    env.services().create(&PostParams::default(), &svc).await.expect("service");
}

/// The backends of every load balancer, by Service name.
async fn hosts(sim: &Sim) -> std::collections::BTreeMap<String, Vec<String>> {
    let lbs = sim.admin.state().await.expect("state").load_balancers;
    lbs.into_iter().map(|l| (l.service.rsplit('/').next().unwrap_or_default().to_string(), l.nodes)).collect()
}

/// The Warning Events of Service `name` with `reason`.
async fn warnings(env: &TestEnv, name: &str, reason: &str) -> Vec<String> {
    let events: Api<Event> = Api::namespaced(env.client.clone(), &env.namespace);
    let list = events.list(&ListParams::default().fields(&format!("involvedObject.name={name}"))).await.expect("events");
    list.items.into_iter().filter(|e| e.reason.as_deref() == Some(reason)).filter_map(|e| e.message).collect()
}

/// How many Events of `reason` Service `name` has (counting repeats).
async fn count_events(env: &TestEnv, name: &str, reason: &str) -> i32 {
    let events: Api<Event> = Api::namespaced(env.client.clone(), &env.namespace);
    let list = events.list(&ListParams::default().fields(&format!("involvedObject.name={name}"))).await.expect("events");
    list.items.iter().filter(|e| e.reason.as_deref() == Some(reason)).map(|e| e.count.unwrap_or(1)).sum()
}

struct World {
    env: TestEnv,
    sim: Sim,
    core: Core,
    /// n1, n2: pool=ingress; n3: pool=web; n4: no pool; n5: not created yet (pool=web).
    nodes: [String; 5],
}

async fn world(label: &str, bulk: bool) -> World {
    world_with(label, bulk, &[]).await
}

async fn world_with(label: &str, bulk: bool, extra: &[&str]) -> World {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), label).await.expect("env");
    let nodes = ["n1", "n2", "n3", "n4", "n5"].map(|n| env.node_name(n));
    let mut config = Config::default();
    config.load_balancers.bulk_hosts = bulk;
    for (i, n) in nodes.iter().enumerate() {
        config.instances.push(instance(&format!("i-{}", i + 1), n, "sim-region-1a"));
    }
    let sim = Sim::start(config).await;
    node(&env, &nodes[0], "i-1", &[("pool", "ingress")]).await;
    node(&env, &nodes[1], "i-2", &[("pool", "ingress")]).await;
    node(&env, &nodes[2], "i-3", &[("pool", "web")]).await;
    node(&env, &nodes[3], "i-4", &[]).await;
    let mut flags = vec![
        "--leader-elect=false".to_string(),
        "--controllers=service".into(),
        format!("--service-namespace={}", env.namespace),
    ];
    flags.extend(extra.iter().map(|f| f.to_string()));
    let core = Core::start(cp, &env, &sim, &flags.iter().map(String::as_str).collect::<Vec<_>>());
    World { env, sim, core, nodes }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_load_balancer_gets_the_nodes_its_selector_chooses_and_only_changed_sets_are_updated() {
    let World { env, sim, core, nodes: [n1, n2, n3, n4, n5] } = world("lbselect", false).await;
    service(&env, "all", None).await;
    service(&env, "ingress", Some("pool=ingress")).await;
    service(&env, "notweb", Some("pool notin (web)")).await;
    service(&env, "bad", Some("pool in (web")).await;
    let want = |all: Vec<&String>| {
        [
            ("all".to_string(), all.into_iter().cloned().collect::<Vec<_>>()),
            ("ingress".to_string(), vec![n1.clone(), n2.clone()]),
            ("notweb".to_string(), vec![n1.clone(), n2.clone(), n4.clone()]),
        ]
        .into_iter()
        .collect::<std::collections::BTreeMap<_, _>>()
    };
    let first = want(vec![&n1, &n2, &n3, &n4]);
    eventually("three load balancers on their selected nodes", Duration::from_secs(20), async || {
        (hosts(&sim).await == first).then_some(())
    })
    .await;
    // The malformed selector: a Warning that says what is wrong, and no load balancer.
    let said = eventually("the bad selector reported", Duration::from_secs(10), async || {
        let w = warnings(&env, "bad", "SyncLoadBalancerFailed").await;
        (!w.is_empty()).then_some(w)
    })
    .await;
    assert!(said[0].contains(SELECTOR) && said[0].contains("pool in (web"), "{said:?}");
    eventually("every Service addressed but the bad one", Duration::from_secs(20), async || {
        for s in ["all", "ingress", "notweb"] {
            load_balancer_ip(&env.services().get_opt(s).await.ok().flatten()?)?;
        }
        Some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;

    // A node of the web pool: only the load balancers whose set it joins are updated.
    let updates = async || sim.admin.call_count("LoadBalancersService/UpdateLoadBalancerHosts").await.expect("calls");
    let ensures = async || sim.admin.call_count("LoadBalancersService/EnsureLoadBalancer").await.expect("calls");
    let (updates_before, ensures_before) = (updates().await, ensures().await);
    node(&env, &n5, "i-5", &[("pool", "web")]).await;
    let second = want(vec![&n1, &n2, &n3, &n4, &n5]);
    eventually("the web node on the load balancer of every node only", Duration::from_secs(5), async || {
        (hosts(&sim).await == second).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(updates().await - updates_before, 1, "one UpdateLoadBalancerHosts: the only load balancer whose set changed");
    assert_eq!(ensures().await - ensures_before, 0, "no Ensure for a node change");
    assert_eq!(count_events(&env, "ingress", "UpdatedLoadBalancer").await, 0, "the ingress pool's load balancer was touched");

    // A label change moves a node between sets: n4 joins the ingress pool.
    let patch = serde_json::json!({ "metadata": { "labels": { "pool": "ingress" } } });
    env.nodes().patch(&n4, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("label");
    eventually("n4 in the ingress pool's load balancer", Duration::from_secs(5), async || {
        let h = hosts(&sim).await;
        (h.get("ingress") == Some(&vec![n1.clone(), n2.clone(), n4.clone()])).then_some(())
    })
    .await;

    // The selector fixed: the Service gets its load balancer; a selector changed is a hosts
    // update, not a new Ensure.
    let fix = serde_json::json!({ "metadata": { "annotations": { SELECTOR: "pool=web" } } });
    env.services().patch("bad", &PatchParams::default(), &Patch::Merge(&fix)).await.expect("fix");
    eventually("the fixed Service on the web pool", Duration::from_secs(10), async || {
        (hosts(&sim).await.get("bad") == Some(&vec![n3.clone(), n5.clone()])).then_some(())
    })
    .await;
    let ensures_before = ensures().await;
    let widen = serde_json::json!({ "metadata": { "annotations": { SELECTOR: "pool in (web, ingress)" } } });
    env.services().patch("bad", &PatchParams::default(), &Patch::Merge(&widen)).await.expect("widen");
    eventually("the widened selector's nodes", Duration::from_secs(10), async || {
        let want = vec![n1.clone(), n2.clone(), n3.clone(), n4.clone(), n5.clone()];
        (hosts(&sim).await.get("bad") == Some(&want)).then_some(())
    })
    .await;
    assert_eq!(ensures().await - ensures_before, 0, "a selector change is no Ensure");

    // A selector that matches nothing any more: the load balancer keeps its hosts, and says so.
    let none = serde_json::json!({ "metadata": { "annotations": { SELECTOR: "pool=gone" } } });
    env.services().patch("ingress", &PatchParams::default(), &Patch::Merge(&none)).await.expect("none");
    eventually("the empty selection reported", Duration::from_secs(10), async || {
        let w = warnings(&env, "ingress", "UnAvailableLoadBalancer").await;
        w.iter().any(|m| m.contains("pool=gone")).then_some(())
    })
    .await;
    assert_eq!(hosts(&sim).await.get("ingress"), Some(&vec![n1.clone(), n2.clone(), n4.clone()]), "emptied");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_provider_gets_one_call_per_changed_node_set() {
    let World { env, sim, core, nodes: [n1, n2, n3, n4, n5] } = world("lbselbulk", true).await;
    for (s, selector) in [("all-a", None), ("all-b", None), ("web-a", Some("pool=web")), ("web-b", Some("pool=web"))] {
        service(&env, s, selector).await;
    }
    service(&env, "ingress", Some("pool=ingress")).await;
    eventually("five load balancers", Duration::from_secs(20), async || {
        let h = hosts(&sim).await;
        let done = h.len() == 5 && h.get("web-a") == Some(&vec![n3.clone()]) && h.get("all-b").is_some_and(|n| n.len() == 4);
        done.then_some(())
    })
    .await;
    eventually("every Service addressed", Duration::from_secs(20), async || {
        for s in ["all-a", "all-b", "web-a", "web-b", "ingress"] {
            load_balancer_ip(&env.services().get_opt(s).await.ok().flatten()?)?;
        }
        Some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let batch = async || sim.admin.call_count("LoadBalancersService/BatchUpdateLoadBalancerHosts").await.expect("calls");
    let single = async || sim.admin.call_count("LoadBalancersService/UpdateLoadBalancerHosts").await.expect("calls");
    let (batch_before, single_before) = (batch().await, single().await);
    node(&env, &n5, "i-5", &[("pool", "web")]).await;
    eventually("the web node on the web and every-node load balancers", Duration::from_secs(5), async || {
        let h = hosts(&sim).await;
        let web = vec![n3.clone(), n5.clone()];
        let all = vec![n1.clone(), n2.clone(), n3.clone(), n4.clone(), n5.clone()];
        let done = h.get("web-a") == Some(&web)
            && h.get("web-b") == Some(&web)
            && h.get("all-a") == Some(&all)
            && h.get("all-b") == Some(&all);
        done.then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(batch().await - batch_before, 2, "one bulk call for each of the two sets that changed");
    assert_eq!(single().await - single_before, 0);
    assert_eq!(hosts(&sim).await.get("ingress"), Some(&vec![n1.clone(), n2.clone()]));
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

/// A selector that matches no Node any more does not freeze its load balancer: a spec change
/// (source ranges) is applied with the hosts it kept, and the load balancer deleted in the
/// cloud in that state is made again, on those hosts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_selector_matching_nothing_keeps_its_hosts_and_still_follows_its_spec_and_repairs() {
    let World { env, sim, core, nodes: [n1, n2, n3, n4, _] } =
        world_with("lbselempty", false, &["--load-balancer-resync-period=10s"]).await;
    service(&env, "ingress", Some("pool=ingress")).await;
    let kept = vec![n1.clone(), n2.clone()];
    eventually("the ingress load balancer on its pool", Duration::from_secs(20), async || {
        (hosts(&sim).await.get("ingress") == Some(&kept)).then_some(())
    })
    .await;
    eventually("the ingress Service addressed", Duration::from_secs(20), async || {
        let svc = env.services().get_opt("ingress").await.ok().flatten()?;
        load_balancer_ip(&svc).map(str::to_string)
    })
    .await;
    // Every Node leaves the pool.
    for n in [&n1, &n2, &n3, &n4] {
        let patch = serde_json::json!({ "metadata": { "labels": { "pool": "batch" } } });
        env.nodes().patch(n, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("relabel");
    }
    eventually("the empty selection reported", Duration::from_secs(10), async || {
        let w = warnings(&env, "ingress", "UnAvailableLoadBalancer").await;
        w.iter().any(|m| m.contains("pool=ingress")).then_some(())
    })
    .await;
    // What it kept: the last non-empty selection (the Nodes leave the pool one by one, so
    // that may be a part of the pool that a host update caught between two relabels).
    let kept = hosts(&sim).await.get("ingress").cloned().unwrap_or_default();
    assert!(!kept.is_empty() && kept.iter().all(|n| *n == n1 || *n == n2), "the load balancer keeps pool hosts: {kept:?}");
    // The user restricts access: the load balancer must follow, keeping its hosts.
    let ranges = serde_json::json!({ "spec": { "loadBalancerSourceRanges": ["203.0.113.0/24"] } });
    env.services().patch("ingress", &PatchParams::default(), &Patch::Merge(&ranges)).await.expect("ranges");
    let lb = eventually("the source ranges on the load balancer", Duration::from_secs(15), async || {
        let lbs = sim.admin.state().await.ok()?.load_balancers;
        lbs.into_iter().find(|l| l.service.ends_with("/ingress") && l.source_ranges == ["203.0.113.0/24"])
    })
    .await;
    assert_eq!(lb.nodes, kept, "the load balancer keeps the hosts it had");
    // Deleted behind the core's back: made again, on the hosts it kept.
    sim.admin.remove_load_balancer(&lb.name).await.expect("remove");
    let again = eventually("the load balancer made again", Duration::from_secs(40), async || {
        let lbs = sim.admin.state().await.ok()?.load_balancers;
        lbs.into_iter().find(|l| l.name == lb.name)
    })
    .await;
    assert_eq!(again.nodes, kept, "made again on the hosts it kept");
    assert_eq!(again.source_ranges, ["203.0.113.0/24"]);
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}
