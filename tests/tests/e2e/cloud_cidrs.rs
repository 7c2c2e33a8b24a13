//! Pod CIDRs from the cloud (`--cidr-allocator-type=CloudAllocator`), end to end: real API
//! server, the core, the sim over a unix socket giving its instances pod CIDRs from pools (as
//! GCP's alias ranges and AWS's prefix delegation do). Dual-stack, never overwriting a Node's
//! own, and no route for CIDRs the cloud routes itself.

use std::time::Duration;

use ccm_harness::cluster::{NodeBuilder, TestEnv};
use ccm_provider_sim::Config;
use ccm_provider_sim::config::PodCidrConfig;
use k8s_openapi::api::core::v1::{Event, Node};
use kube::Api;
use kube::api::ListParams;

use crate::support::{Core, Sim, TEST_LABEL, eventually, instance};

const RECORD: &str = "ccm-rs.dev/pod-cidrs-from-cloud";

/// An initialised Node of instance `id` (providerID set), with `cidrs` of its own.
async fn node(env: &TestEnv, name: &str, id: &str, cidrs: &[&str]) {
    let mut b = NodeBuilder::new(name)
        .label(TEST_LABEL, &env.prefix)
        .provider_id(&format!("sim://sim-region-1a/{id}"))
        .address("InternalIP", "10.0.0.9");
    for c in cidrs {
        b = b.pod_cidr(c);
    }
    b.create(&env.client).await.expect("node");
}

fn pod_cidrs(n: &Node) -> Vec<String> {
    n.spec.as_ref().and_then(|s| s.pod_cidrs.clone()).unwrap_or_default()
}

fn network_unavailable(n: &Node) -> Option<(String, String)> {
    let c = n.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == "NetworkUnavailable")?;
    Some((c.status.clone(), c.reason.clone().unwrap_or_default()))
}

/// (destination, node) of every route in the sim.
async fn routes(sim: &Sim) -> Vec<(String, String)> {
    let state = sim.admin.state().await.expect("state");
    state.route_tables.into_iter().flat_map(|t| t.routes).map(|r| (r.destination_cidr, r.node_name)).collect()
}

/// Nodes a (from the cloud), b (podCIDRs of its own, not the cloud's), the sim giving pod
/// CIDRs (`routed`: routed by the cloud itself), and the core with node IPAM from the cloud
/// and routes over the pools.
async fn world(label: &str, routed: bool) -> (TestEnv, Sim, Core, String, String) {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), label).await.expect("env");
    let (a, b) = (env.node_name("a"), env.node_name("b"));
    let pod_cidrs = PodCidrConfig { pools: vec!["10.200.0.0/16".into(), "fd00:200::/56".into()], routed, ..Default::default() };
    let mut config = Config { pod_cidrs: Some(pod_cidrs), ..Default::default() };
    config.instances.push(instance("i-a", &a, "sim-region-1a"));
    config.instances.push(instance("i-b", &b, "sim-region-1a"));
    let sim = Sim::start(config).await;
    node(&env, &a, "i-a", &[]).await;
    node(&env, &b, "i-b", &["10.99.0.0/24"]).await;
    let cluster = format!("--cluster-name={}", env.prefix);
    let flags = [
        "--leader-elect=false",
        "--controllers=nodeipam,route",
        "--allocate-node-cidrs=true",
        "--cidr-allocator-type=CloudAllocator",
        "--cluster-cidr=10.0.0.0/8,fd00::/8",
        cluster.as_str(),
    ];
    let core = Core::start(cp, &env, &sim, &flags);
    (env, sim, core, a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_gets_its_instances_pod_cidrs_dual_stack_and_no_route_when_the_cloud_routes_them() {
    let (env, sim, core, a, b) = world("cloudcidr", true).await;
    let given = eventually("a's pod CIDRs from the cloud", Duration::from_secs(20), async || {
        let n = env.nodes().get(&a).await.ok()?;
        (!pod_cidrs(&n).is_empty()).then_some(n)
    })
    .await;
    // The sim gives the first /24 and /80 of its pools to its first instance.
    assert_eq!(pod_cidrs(&given), vec!["10.200.0.0/24".to_string(), "fd00:200::/80".into()]);
    assert_eq!(given.spec.as_ref().and_then(|s| s.pod_cidr.clone()).as_deref(), Some("10.200.0.0/24"));
    let record = given.metadata.annotations.as_ref().and_then(|a| a.get(RECORD)).cloned();
    assert_eq!(record.as_deref(), Some("10.200.0.0/24,fd00:200::/80"));
    eventually("NetworkUnavailable cleared: the cloud routes them", Duration::from_secs(10), async || {
        let n = env.nodes().get(&a).await.ok()?;
        (network_unavailable(&n) == Some(("False".into(), "RouteCreated".into()))).then_some(())
    })
    .await;

    // b keeps the podCIDRs it had, and says why.
    let said = eventually("b's Warning", Duration::from_secs(10), async || {
        let events: Api<Event> = Api::all(env.client.clone());
        let list = events.list(&ListParams::default().fields(&format!("involvedObject.name={b}"))).await.ok()?;
        list.items.into_iter().find(|e| e.reason.as_deref() == Some("CIDRAssignmentFailed")).and_then(|e| e.message)
    })
    .await;
    assert!(said.contains("10.99.0.0/24") && said.contains("10.200.1.0/24"), "{said}");
    let b_now = env.nodes().get(&b).await.expect("b");
    assert_eq!(pod_cidrs(&b_now), vec!["10.99.0.0/24".to_string()], "a Node's own podCIDRs were changed");

    // Routes: b's own CIDR gets one; a's, routed by the cloud, none.
    eventually("b's route", Duration::from_secs(15), async || {
        routes(&sim).await.iter().any(|(d, n)| d == "10.99.0.0/24" && *n == b).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!routes(&sim).await.iter().any(|(_, n)| *n == a), "a route for CIDRs the cloud routes: {:?}", routes(&sim).await);
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_cidrs_the_cloud_does_not_route_get_routes() {
    let (env, sim, core, a, _b) = world("cloudcidrrt", false).await;
    eventually("routes for a's cloud CIDRs", Duration::from_secs(20), async || {
        let r = routes(&sim).await;
        let want = ["10.200.0.0/24", "fd00:200::/80"];
        want.iter().all(|w| r.iter().any(|(d, n)| d == w && *n == a)).then_some(())
    })
    .await;
    eventually("NetworkUnavailable cleared by the route controller", Duration::from_secs(10), async || {
        let n = env.nodes().get(&a).await.ok()?;
        (network_unavailable(&n) == Some(("False".into(), "RouteCreated".into()))).then_some(())
    })
    .await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}
