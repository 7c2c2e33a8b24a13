//! A change of leader costs the cloud nothing: a new process of the core (a restart, a
//! crash, another replica) ensures no load balancer that nothing changed, and ensures each
//! one that changed while no replica led: a Service edited, a node set changed, a load
//! balancer deleted in the cloud. Real API server, the sim over a unix socket, two core
//! instances one after the other, each with its own memory.

use std::collections::BTreeMap;
use std::time::Duration;

use ccm_harness::cluster::{TestEnv, create_load_balancer_service, load_balancer_ip};
use k8s_openapi::api::core::v1::Service;
use kube::api::{Patch, PatchParams};

use crate::services::{backend_node, bulk_hosts_world};
use crate::support::{Core, Sim, eventually};

const FLAGS: [&str; 6] = [
    "--leader-elect=true",
    "--leader-elect-lease-duration=4s",
    "--leader-elect-renew-deadline=2s",
    "--leader-elect-retry-period=1s",
    "--controllers=service",
    "--load-balancer-resync-period=1h",
];

const ENSURE: &str = "LoadBalancersService/EnsureLoadBalancer";
const HOSTS: [&str; 2] = ["LoadBalancersService/UpdateLoadBalancerHosts", "LoadBalancersService/BatchUpdateLoadBalancerHosts"];

/// Each load balancer's name, ports and hosts, by Service name.
async fn lbs(sim: &Sim) -> BTreeMap<String, (String, Vec<u32>, Vec<String>)> {
    let lbs = sim.admin.state().await.expect("state").load_balancers;
    lbs.into_iter()
        .map(|l| {
            let (mut ports, mut nodes) = (l.ports, l.nodes);
            ports.sort();
            nodes.sort();
            (l.service.rsplit('/').next().unwrap_or_default().to_string(), (l.name, ports, nodes))
        })
        .collect()
}

async fn count(sim: &Sim, methods: &[&str]) -> u64 {
    let mut n = 0;
    for m in methods {
        n += sim.admin.call_count(m).await.expect("calls");
    }
    n
}

/// Waits until some instance holds the test's Lease, and a little more for its first pass.
async fn led(env: &TestEnv) {
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> = kube::Api::namespaced(env.client.clone(), &env.namespace);
    eventually("a new leader", Duration::from_secs(30), async || {
        let lease = leases.get_opt(&env.prefix).await.ok().flatten()?;
        let spec = lease.spec?;
        spec.holder_identity.filter(|h| !h.is_empty())?;
        Some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_ensures_only_what_changed_while_no_one_led() {
    let cp = ccm_harness::shared().expect("control plane");
    let (env, nodes, sim) = bulk_hosts_world(cp, "lchange").await;
    backend_node(&env, &nodes[1], "i-2").await;
    let names = ["a", "b", "c", "d"];
    let a = Core::start(cp, &env, &sim, &FLAGS);
    for s in names {
        create_load_balancer_service(&env, s, &[80]).await.expect("service");
    }
    eventually("every Service addressed and its Ensure recorded", Duration::from_secs(30), async || {
        for s in names {
            let svc = env.services().get_opt(s).await.ok().flatten()?;
            load_balancer_ip(&svc)?;
            svc.metadata.annotations?.get("ccm-rs.dev/load-balancer-ensured")?;
        }
        Some(())
    })
    .await;
    // A restart with nothing changed: no Ensure, no hosts update.
    a.stop().await.expect("stops");
    sim.admin.reset_calls().await.expect("reset");
    let b = Core::start(cp, &env, &sim, &FLAGS);
    led(&env).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(count(&sim, &[ENSURE]).await, 0, "a new leader ensured load balancers that nothing changed");
    assert_eq!(count(&sim, &HOSTS).await, 0, "a new leader updated hosts that nothing changed");
    b.stop().await.expect("stops");

    // While no one leads: b's ports change, c's load balancer is deleted in the cloud, a Node
    // joins.
    let before = lbs(&sim).await;
    let patch = serde_json::json!({ "spec": { "ports": [
        { "name": "p80", "port": 80, "targetPort": 80, "protocol": "TCP" },
        { "name": "p8080", "port": 8080, "targetPort": 8080, "protocol": "TCP" },
    ] } });
    env.services().patch("b", &PatchParams::default(), &Patch::Merge(&patch)).await.expect("ports");
    sim.admin.remove_load_balancer(&before["c"].0).await.expect("remove");
    backend_node(&env, &nodes[2], "i-3").await;
    sim.admin.reset_calls().await.expect("reset");
    let c = Core::start(cp, &env, &sim, &FLAGS);
    let all_hosts: Vec<String> = {
        let mut n = nodes.to_vec();
        n.sort();
        n
    };
    eventually("every change followed by the new leader", Duration::from_secs(40), async || {
        let now = lbs(&sim).await;
        (now.get("b")?.1 == vec![80, 8080]
            && now.contains_key("c")
            && names.iter().all(|s| now.get(*s).is_some_and(|l| l.2 == all_hosts)))
        .then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(count(&sim, &[ENSURE]).await, 2, "the edited Service's and the deleted load balancer's Ensures only");
    assert!(count(&sim, &HOSTS).await <= 2, "the node set followed in bulk: {:?}", sim.admin.calls().await.ok());
    let svc: Service = env.services().get("c").await.expect("c");
    assert!(load_balancer_ip(&svc).is_some(), "c addressed again");
    c.stop().await.expect("stops");
    env.cleanup().await.expect("cleanup");
}
