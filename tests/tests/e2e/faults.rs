//! The fault suite: a provider that lies, hangs, throttles for hours, restarts empty or comes
//! back as another provider, against the real API server with every controller running. Each
//! case checks what a user would see: no Node, route or load balancer deleted or duplicated,
//! a Warning Event that says what was wrong, and convergence once the provider is right again.
//! Each case prints one line of the fault table (fault, outcome, objects lost, time to
//! converge) that the closing notes quote.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use ccm_harness::ControlPlane;
use ccm_harness::cluster::{NodeBuilder, TestEnv, UNINITIALIZED_TAINT, create_load_balancer_service, set_ready};
use ccm_provider_sim::Config;
use ccm_provider_sim::config::{Fault, FaultCode, Lie};
use k8s_openapi::api::core::v1::{Event, Node, Service};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};

use crate::support::{Core, Sim, TEST_LABEL, eventually, instance};

/// What the user can see of the cluster's cloud state.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    /// Node names in the API.
    nodes: BTreeSet<String>,
    /// (destination, node) of the cluster's routes in the cloud, with how many of each.
    routes: BTreeMap<(String, String), usize>,
    /// Load balancer name → its hosts.
    lbs: BTreeMap<String, BTreeSet<String>>,
    /// The Service's ingress IP.
    ingress: Option<String>,
}

struct World {
    kubeconfig: std::path::PathBuf,
    env: TestEnv,
    sim: Sim,
    config: Config,
    service: String,
    next: usize,
}

impl World {
    async fn new(label: &str) -> Self {
        Self::on(ccm_harness::shared().expect("control plane"), label).await
    }

    /// The world on a control plane of the test's own.
    async fn on(cp: &ControlPlane, label: &str) -> Self {
        let env = TestEnv::new(cp.client().await.expect("client"), label).await.expect("env");
        let mut config = Config::default();
        for n in ["a", "b", "c"] {
            config.instances.push(instance(&format!("i-{n}"), &env.node_name(n), "sim-region-1a"));
        }
        let sim = Sim::start(config.clone()).await;
        let kubeconfig = cp.kubeconfig_path().to_path_buf();
        let world = Self { kubeconfig, env, sim, config, service: "web".into(), next: 0 };
        for (i, n) in ["a", "b", "c"].iter().enumerate() {
            world.node(&world.env.node_name(n), &format!("10.244.{}.0/24", i + 1)).await;
        }
        // c is NotReady: the lifecycle controller asks about its instance every pass.
        set_ready(&world.env.client, &world.env.node_name("c"), "False").await.expect("c NotReady");
        create_load_balancer_service(&world.env, &world.service, &[80]).await.expect("service");
        world
    }

    async fn node(&self, name: &str, cidr: &str) {
        NodeBuilder::new(name)
            .uninitialized()
            .label(TEST_LABEL, &self.env.prefix)
            .pod_cidr(cidr)
            .address("Hostname", name)
            .create(&self.env.client)
            .await
            .expect("node");
        set_ready(&self.env.client, name, "True").await.expect("Ready");
    }

    fn core(&self, extra: &[&str]) -> Core {
        let cluster = format!("--cluster-name={}", self.env.prefix);
        let mut flags = vec![
            "--leader-elect=false",
            "--cluster-cidr=10.244.0.0/16",
            &cluster,
            "--node-monitor-period=1s",
            "--route-min-interval=200ms",
            "--load-balancer-resync-period=2s",
            "--node-status-update-frequency=2s",
            "--provider-call-timeout=1s",
            "--provider-max-retry-after=2s",
            // Only the check of the provider's answer stands between a lie and a deletion.
            "--max-node-deletion-share=1",
        ];
        // The test's own values win.
        let name = |f: &str| f.split('=').next().unwrap_or(f).to_string();
        flags.retain(|f| !extra.iter().any(|e| name(e) == name(f)));
        flags.extend_from_slice(extra);
        Core::start_as(&self.kubeconfig, &self.env, &self.sim, &flags)
    }

    /// A new Node (and its instance) while a fault is on: it must be initialised and routed
    /// once the fault is gone.
    async fn newcomer(&mut self) -> String {
        self.next += 1;
        let name = self.env.node_name(&format!("p{}", self.next));
        let spec = instance(&format!("i-p{}", self.next), &name, "sim-region-1a");
        self.sim.admin.add_instance(&spec).await.expect("instance");
        self.config.instances.push(spec);
        self.node(&name, &format!("10.244.{}.0/24", 100 + self.next)).await;
        name
    }

    async fn seen(&self) -> Seen {
        let nodes = self.env.nodes().list(&ListParams::default().labels(&format!("{TEST_LABEL}={}", self.env.prefix))).await;
        let nodes = nodes.expect("nodes").items.into_iter().filter_map(|n| n.metadata.name).collect();
        let state = self.sim.admin.state().await.expect("sim state");
        let mut routes = BTreeMap::new();
        for r in state.route_tables.iter().flat_map(|t| &t.routes).filter(|r| r.cluster == self.env.prefix) {
            *routes.entry((r.destination_cidr.clone(), r.node_name.clone())).or_default() += 1;
        }
        let lbs = state.load_balancers.into_iter().map(|l| (l.name, l.nodes.into_iter().collect())).collect();
        let svc: Option<Service> = self.env.services().get_opt(&self.service).await.expect("service");
        let ingress = svc.and_then(|s| s.status?.load_balancer?.ingress?.first()?.ip.clone());
        Seen { nodes, routes, lbs, ingress }
    }

    /// Whether every Node is initialised with a providerID of the sim, has its route, and the
    /// load balancer serves every Ready Node.
    async fn converged(&self) -> Option<Seen> {
        let seen = self.seen().await;
        for name in &seen.nodes {
            let node: Node = self.env.nodes().get(name).await.ok()?;
            let spec = node.spec.as_ref()?;
            if spec.taints.iter().flatten().any(|t| t.key == UNINITIALIZED_TAINT) {
                return None;
            }
            if !spec.provider_id.as_deref().is_some_and(|p| p.starts_with("sim://")) {
                return None;
            }
            if !seen.routes.keys().any(|(_, n)| n == name) {
                return None;
            }
        }
        let hosts = seen.lbs.values().next()?;
        let ready: BTreeSet<String> = seen.nodes.iter().filter(|n| !n.ends_with("-c")).cloned().collect();
        (seen.ingress.is_some() && ready.is_subset(hosts)).then_some(seen)
    }

    /// (reason, message) of the Events on `object` (a Node, the Service or the core's Lease).
    async fn events(&self, object: &str) -> Vec<(String, String)> {
        let events: Api<Event> = Api::all(self.env.client.clone());
        let list = events.list(&ListParams::default().fields(&format!("involvedObject.name={object}"))).await;
        let items = list.map(|l| l.items).unwrap_or_default();
        items.into_iter().map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default())).collect()
    }

    async fn reasons(&self, object: &str) -> Vec<String> {
        self.events(object).await.into_iter().map(|(reason, _)| reason).collect()
    }

    /// The Events on any of this test's objects.
    async fn all_events(&self) -> BTreeSet<(String, String)> {
        let mut objects: Vec<String> = self.seen().await.nodes.into_iter().collect();
        objects.push(self.service.clone());
        objects.push(self.env.prefix.clone()); // the Lease
        let mut out = BTreeSet::new();
        for o in objects {
            out.extend(self.events(&o).await);
        }
        out
    }
}

/// Nothing the user had is gone: every Node, route and load balancer host of `before` is still
/// there, no route is doubled, and the ingress IP is the same.
fn nothing_lost(before: &Seen, now: &Seen, case: &str) {
    let lost_nodes: Vec<_> = before.nodes.difference(&now.nodes).collect();
    assert!(lost_nodes.is_empty(), "{case}: Nodes deleted: {lost_nodes:?}");
    let lost_routes: Vec<_> = before.routes.keys().filter(|k| !now.routes.contains_key(*k)).collect();
    assert!(lost_routes.is_empty(), "{case}: routes deleted: {lost_routes:?}");
    assert!(now.routes.values().all(|n| *n == 1), "{case}: a route doubled: {:?}", now.routes);
    for (lb, hosts) in &before.lbs {
        let now_hosts = now.lbs.get(lb).unwrap_or_else(|| panic!("{case}: load balancer {lb} deleted"));
        assert!(hosts.is_subset(now_hosts), "{case}: load balancer hosts lost: {hosts:?} → {now_hosts:?}");
    }
    assert_eq!(before.ingress, now.ingress, "{case}: the Service's ingress changed");
}

struct Case {
    name: &'static str,
    faults: Vec<Fault>,
    /// A Warning Event reason the user must see.
    event: Option<&'static str>,
}

fn lie(method: &str, lie: Lie) -> Fault {
    Fault { method: method.into(), lie: Some(lie), ..Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_answers_hangs_and_hours_of_throttling_delete_nothing_and_heal() {
    let mut world = World::new("faults").await;
    let core = world.core(&["--route-resync-period=1s"]);
    let before = eventually("everything converged", Duration::from_secs(60), async || world.converged().await).await;
    assert_eq!(before.routes.len(), 3);

    let hours = Fault {
        method: "*".into(),
        error_rate: 1.0,
        code: FaultCode::RateLimited,
        retry_after_ms: Some(3 * 3600 * 1000),
        ..Default::default()
    };
    let cases = vec![
        Case { name: "every instance gone", faults: vec![lie("*", Lie::AllGone)], event: Some("NodeDeletionRefused") },
        // Each answer names its lookup: a provider that reorders its answers is matched by
        // name (the SDK sends them in request order, the core matches on the name), so the
        // Nodes keep their own instances and there is nothing to warn about.
        Case { name: "batch answers reordered", faults: vec![lie("*", Lie::Reorder)], event: None },
        Case { name: "a short batch", faults: vec![lie("*", Lie::ShortBatch)], event: None },
        Case {
            name: "providerIDs of another scheme",
            faults: vec![lie("*", Lie::OtherScheme)],
            event: Some("InvalidProviderAnswer"),
        },
        Case {
            name: "invalid IPs (addresses, ingress)",
            faults: vec![lie("*", Lie::InvalidIps)],
            event: Some("InvalidProviderAnswer"),
        },
        Case {
            name: "empty route and load balancer listings",
            faults: vec![lie("ListRoutes", Lie::EmptyListing), lie("ListLoadBalancers", Lie::EmptyListing)],
            event: Some("RoutesDrifted"),
        },
        Case {
            name: "a repeated page token",
            faults: vec![lie("*", Lie::RepeatedPageToken)],
            event: Some("InvalidProviderAnswer"),
        },
        Case { name: "a RetryInfo of 3 hours", faults: vec![hours], event: None },
        Case {
            name: "a hang past the call timeout",
            faults: vec![Fault { method: "*".into(), delay_ms: Some(3000), ..Default::default() }],
            event: None,
        },
    ];
    let mut table = Vec::new();
    for (i, case) in cases.into_iter().enumerate() {
        let before = world.seen().await;
        let events_before = world.all_events().await;
        world.sim.admin.set_faults(&case.faults).await.expect("faults");
        let newcomer = world.newcomer().await;
        if i == 4 {
            // An Ensure during the lie: its invalid ingress must not reach the Service.
            let patch = serde_json::json!({ "spec": { "ports": [
                { "name": "p80", "port": 80, "protocol": "TCP" },
                { "name": "p8080", "port": 8080, "protocol": "TCP" },
            ] } });
            world.env.services().patch(&world.service, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("patch");
        }
        // Several lifecycle passes, route resyncs and load balancer sweeps under the fault.
        tokio::time::sleep(Duration::from_secs(4)).await;
        let during = world.seen().await;
        nothing_lost(&before, &during, case.name);
        let node: Node = world.env.nodes().get(&newcomer).await.expect("newcomer");
        let id = node.spec.and_then(|s| s.provider_id).unwrap_or_default();
        assert!(id.is_empty() || id.starts_with("sim://"), "{}: a Node got providerID {id:?}", case.name);
        if let Some(reason) = case.event {
            // A new Event of that reason (a note not seen before this case).
            eventually(&format!("{}: a {reason} Event", case.name), Duration::from_secs(10), async || {
                let now = world.all_events().await;
                now.difference(&events_before).any(|(r, _)| r == reason).then_some(())
            })
            .await;
        }
        if i == 4 {
            // The invalid ingress is reported on the Service as what it is.
            eventually("an InvalidProviderAnswer Event on the Service", Duration::from_secs(10), async || {
                world.reasons(&world.service).await.iter().any(|r| r == "InvalidProviderAnswer").then_some(())
            })
            .await;
            let failed = world.events(&world.service).await;
            assert!(
                !failed.iter().any(|(r, m)| r == "SyncLoadBalancerFailed" && m.contains("ingress")),
                "an invalid answer reported as a failed sync: {failed:?}"
            );
        }
        world.sim.admin.set_faults(&[]).await.expect("clear");
        let cleared = Instant::now();
        let after = eventually(&format!("{}: convergence", case.name), Duration::from_secs(60), async || {
            world.converged().await.filter(|s| s.nodes.contains(&newcomer))
        })
        .await;
        nothing_lost(&before, &after, case.name);
        table.push(format!("| {} | 0 | {:.1} s |", case.name, cleared.elapsed().as_secs_f64()));
    }
    let svc = world.env.services().get(&world.service).await.expect("service");
    let ports: Vec<i32> = svc.spec.and_then(|s| s.ports).unwrap_or_default().iter().map(|p| p.port).collect();
    assert_eq!(ports, vec![80, 8080]);
    println!("fault | objects lost | converged after the fault cleared\n{}", table.join("\n"));
    core.stop().await.expect("core stops");
    world.env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_restarted_empty_or_as_another_provider_deletes_nothing() {
    let mut world = World::new("restart").await;
    // Resyncs far apart: what brings the cloud back after a restart is the new epoch.
    let core = world.core(&["--route-resync-period=1h", "--load-balancer-resync-period=1h"]);
    let before = eventually("everything converged", Duration::from_secs(60), async || world.converged().await).await;

    // Restarted with nothing: the sim's routes and load balancers are gone (a new epoch).
    world.sim.stop().await;
    world.sim.launch(world.config.clone()).await;
    let restarted = Instant::now();
    assert!(world.sim.admin.state().await.expect("state").load_balancers.is_empty(), "the restart lost the cloud's state");
    let after = eventually("routes and load balancer made again", Duration::from_secs(30), async || {
        world.converged().await.filter(|s| s.routes.len() == before.routes.len())
    })
    .await;
    let epoch_converge = restarted.elapsed();
    nothing_lost(&before, &after, "restart with an empty cloud");
    assert!(epoch_converge < Duration::from_secs(20), "made again after {epoch_converge:?}, not at the next resync");

    // Restarted as another provider: deletions pause. A Node deleted meanwhile keeps its
    // route until a full resync under the new identity confirms it.
    let mut other = world.config.clone();
    other.plugin_name = "other.cloudprovider.dev".into();
    world.sim.stop().await;
    world.sim.launch(other).await;
    let lease = world.env.prefix.clone();
    eventually("a RouteDeletionsPaused Event", Duration::from_secs(30), async || {
        world.reasons(&lease).await.contains(&"RouteDeletionsPaused".to_string()).then_some(())
    })
    .await;
    eventually("routes made again under the new identity", Duration::from_secs(30), async || {
        world.converged().await.filter(|s| s.routes.len() == before.routes.len())
    })
    .await;
    let gone = world.env.node_name("b");
    world.env.nodes().delete(&gone, &DeleteParams::default()).await.expect("delete b");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let during = world.seen().await;
    assert!(
        during.routes.keys().any(|(_, n)| *n == gone),
        "the route of a deleted Node was deleted while the provider's identity was in doubt"
    );
    let nodes_left: BTreeSet<String> = before.nodes.iter().filter(|n| **n != gone).cloned().collect();
    assert_eq!(during.nodes, nodes_left, "no Node deleted by the core");
    assert!(during.lbs.len() == 1, "the load balancer stays: {:?}", during.lbs);
    println!(
        "| provider restarted with an empty cloud (new epoch) | 0 | {:.1} s |\n| provider restarted as another provider | 0 | route deletions paused |",
        epoch_converge.as_secs_f64()
    );
    core.stop().await.expect("core stops");
    world.env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_restarted_mid_reconcile_loses_and_doubles_nothing() {
    // A control plane of its own: the shared one serves every other test.
    let cp = tokio::task::spawn_blocking(ControlPlane::start).await.expect("join").expect("control plane");
    let mut world = World::on(&cp, "apirestart").await;
    let core = world.core(&["--route-resync-period=2s"]);
    let before = eventually("everything converged", Duration::from_secs(60), async || world.converged().await).await;

    // Mid-reconcile: Nodes arrive, and the API server and etcd die while they are handled
    // (the cloud answers in 1.5 s, so its answers come back to a dead API server).
    let slow = ccm_provider_sim::config::ApiConfig { latency_ms: 1500, ..Default::default() };
    world.sim.admin.set_api(&slow).await.expect("slow cloud");
    let mut newcomers = Vec::new();
    for _ in 0..4 {
        newcomers.push(world.newcomer().await);
    }
    let mut cp = cp;
    let cp_back = tokio::task::spawn_blocking(move || cp.restart(Duration::from_secs(5)).map(|()| cp));
    let cp = cp_back.await.expect("join").expect("the control plane comes back");
    let back = Instant::now();
    world.sim.admin.set_api(&Default::default()).await.expect("fast cloud");
    let after = eventually("convergence after the restart", Duration::from_secs(90), async || {
        world.converged().await.filter(|s| newcomers.iter().all(|n| s.nodes.contains(n)))
    })
    .await;
    let took = back.elapsed();
    nothing_lost(&before, &after, "API server and etcd restarted");
    assert_eq!(after.lbs.len(), 1, "one load balancer, not two: {:?}", after.lbs);
    assert_eq!(after.routes.len(), before.routes.len() + newcomers.len(), "one route per Node: {:?}", after.routes);
    println!("| API server and etcd killed mid-reconcile, back after 5 s | 0 | {:.1} s |", took.as_secs_f64());
    core.stop().await.expect("core stops");
    drop(cp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edits_made_while_the_watches_were_away_arrive_with_the_relist() {
    // A control plane of its own, restarted while the core cannot reach it: the core's watches
    // come back with a resourceVersion the new API server's watch cache no longer holds
    // (410 Expired) and re-list. What changed meanwhile reaches the controllers only through
    // that listing.
    let cp = tokio::task::spawn_blocking(ControlPlane::start).await.expect("join").expect("control plane");
    let mut world = World::on(&cp, "relist").await;
    let target = cp.server().trim_start_matches("https://").parse().expect("the API server's address");
    let proxy = crate::support::Blackhole::start(target).await;
    world.kubeconfig = crate::support::kubeconfig_via(cp.kubeconfig_path(), cp.server(), proxy.addr);
    // Resyncs out of the way: only the watch can bring the edits.
    let core = world.core(&["--route-resync-period=12h", "--load-balancer-resync-period=12h"]);
    eventually("everything converged", Duration::from_secs(60), async || world.converged().await).await;
    // A Node with no podCIDR yet: initialised, no route.
    let late = world.env.node_name("late");
    let spec = instance("i-late", &late, "sim-region-1a");
    world.sim.admin.add_instance(&spec).await.expect("instance");
    NodeBuilder::new(&late).uninitialized().label(TEST_LABEL, &world.env.prefix).create(&world.env.client).await.expect("node");
    set_ready(&world.env.client, &late, "True").await.expect("Ready");
    eventually("the late Node initialised", Duration::from_secs(30), async || {
        let node = world.env.nodes().get(&late).await.ok()?;
        node.spec?.provider_id.map(|_| ())
    })
    .await;

    proxy.pause();
    let mut cp = cp;
    let cp = tokio::task::spawn_blocking(move || cp.restart(Duration::from_secs(1)).map(|()| cp))
        .await
        .expect("join")
        .expect("the control plane comes back");
    let client = cp.client().await.expect("client");
    let nodes: Api<Node> = Api::all(client.clone());
    let patch = serde_json::json!({"spec": {"podCIDR": "10.244.50.0/24", "podCIDRs": ["10.244.50.0/24"]}});
    nodes.patch(&late, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("podCIDR");
    let services: Api<Service> = Api::namespaced(client, &world.env.namespace);
    let mut svc = services.get(&world.service).await.expect("service");
    let mut ports = svc.spec.as_ref().and_then(|s| s.ports.clone()).unwrap_or_default();
    let mut port = ports[0].clone();
    port.name = Some("second".into());
    ports[0].name = Some("first".into());
    port.port = 8081;
    port.node_port = None;
    ports.push(port);
    svc.spec.as_mut().expect("spec").ports = Some(ports);
    svc.metadata.managed_fields = None;
    services.replace(&world.service, &Default::default(), &svc).await.expect("a second port");
    proxy.restore();

    let restored = Instant::now();
    eventually("the second port on the load balancer", Duration::from_secs(30), async || {
        let state = world.sim.admin.state().await.ok()?;
        state.load_balancers.iter().any(|l| l.ports.contains(&8081)).then_some(())
    })
    .await;
    eventually("the late Node's route", Duration::from_secs(30), async || {
        let state = world.sim.admin.state().await.ok()?;
        let routes = state.route_tables.iter().flat_map(|t| &t.routes);
        routes.into_iter().any(|r| r.node_name == late && r.destination_cidr == "10.244.50.0/24").then_some(())
    })
    .await;
    println!(
        "| edits made while the API server restarted and the watches were away (re-list) | 0 | {:.1} s |",
        restored.elapsed().as_secs_f64()
    );
    core.stop().await.expect("core stops");
    drop(cp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_made_again_while_the_watches_were_away_gets_a_pod_cidr_and_its_old_one_is_free() {
    // Node IPAM with room for one more Node: a, b and c hold 10.244.1-3.0/24 of a /22.
    let cp = tokio::task::spawn_blocking(ControlPlane::start).await.expect("join").expect("control plane");
    let mut world = World::on(&cp, "ipamgap").await;
    let target = cp.server().trim_start_matches("https://").parse().expect("the API server's address");
    let proxy = crate::support::Blackhole::start(target).await;
    world.kubeconfig = crate::support::kubeconfig_via(cp.kubeconfig_path(), cp.server(), proxy.addr);
    let core = world.core(&["--allocate-node-cidrs=true", "--cluster-cidr=10.244.0.0/22", "--node-cidr-mask-size=24"]);
    let x = world.env.node_name("x");
    world.sim.admin.add_instance(&instance("i-x", &x, "sim-region-1a")).await.expect("instance");
    let make_x = async |client: &kube::Client| {
        NodeBuilder::new(&x).uninitialized().label(TEST_LABEL, &world.env.prefix).create(client).await.expect("node x");
    };
    make_x(&world.env.client).await;
    let cidr_of = async |client: &kube::Client| {
        let nodes: Api<Node> = Api::all(client.clone());
        nodes.get(&x).await.ok()?.spec?.pod_cidr
    };
    let first = eventually("x given the free /24", Duration::from_secs(30), async || cidr_of(&world.env.client).await).await;
    assert_eq!(first, "10.244.0.0/24");

    // The core cut off; the API server restarted (its watch cache forgets the history); x
    // deleted and made again, with no podCIDR, under its name: the core only sees it in the
    // re-list, as the same name changed.
    proxy.pause();
    let mut cp = cp;
    let cp = tokio::task::spawn_blocking(move || cp.restart(Duration::from_secs(1)).map(|()| cp))
        .await
        .expect("join")
        .expect("the control plane comes back");
    let client = cp.client().await.expect("client");
    let nodes: Api<Node> = Api::all(client.clone());
    nodes.delete(&x, &DeleteParams::default()).await.expect("delete x");
    eventually("x gone", Duration::from_secs(30), async || nodes.get_opt(&x).await.ok().filter(Option::is_none)).await;
    make_x(&client).await;
    proxy.restore();
    let again = eventually("the new x given a podCIDR", Duration::from_secs(90), async || cidr_of(&client).await).await;
    assert_eq!(again, "10.244.0.0/24", "the old x's CIDR is free again, and the only one left");
    core.stop().await.expect("core stops");
    drop(cp);
}
