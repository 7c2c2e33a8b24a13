//! Load balancers repaired when changed behind the core's back, end to end: real API server,
//! the core, the sim over a unix socket. One deleted in the cloud is made again (with the
//! Event `LoadBalancerRecreated`), one whose backends were changed by hand is given its own
//! again; a listing that misses everything makes nothing again; without listing, reads spread
//! over the repair period find the same, at most `--max-load-balancer-repairs` a period.

use std::time::Duration;

use ccm_harness::cluster::{TestEnv, create_load_balancer_service, load_balancer_ip};
use ccm_provider_sim::Config;
use ccm_provider_sim::config::{Fault, Lie};
use k8s_openapi::api::core::v1::Event;
use kube::Api;
use kube::api::ListParams;

use crate::services::backend_node;
use crate::support::{Core, Sim, eventually, free_port, http_get, instance};

/// The load balancer name and backends of every load balancer, by Service name.
async fn lbs(sim: &Sim) -> std::collections::BTreeMap<String, (String, Vec<String>)> {
    let lbs = sim.admin.state().await.expect("state").load_balancers;
    lbs.into_iter().map(|l| (l.service.rsplit('/').next().unwrap_or_default().to_string(), (l.name, l.nodes))).collect()
}

/// The messages of Service `name`'s Events of `reason`.
async fn events(env: &TestEnv, name: &str, reason: &str) -> Vec<String> {
    let api: Api<Event> = Api::namespaced(env.client.clone(), &env.namespace);
    let list = api.list(&ListParams::default().fields(&format!("involvedObject.name={name}"))).await.expect("events");
    list.items.into_iter().filter(|e| e.reason.as_deref() == Some(reason)).filter_map(|e| e.message).collect()
}

/// The value of a counter series of the core's metrics (0 when absent).
async fn counter(base: &str, series: &str) -> f64 {
    let (_, text) = http_get(base, "/metrics").await.expect("metrics");
    text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok()).unwrap_or(0.0)
}

/// Two backend Nodes, the sim (`list`: whether it lists load balancers) and the core with
/// `flags`, and Services `names` with their load balancers made.
async fn world(label: &str, list: bool, names: &[&str], flags: &[&str]) -> (TestEnv, Sim, Core, [String; 2], String) {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), label).await.expect("env");
    let nodes = [env.node_name("n1"), env.node_name("n2")];
    let mut config = Config::default();
    config.load_balancers.list = list;
    for (i, n) in nodes.iter().enumerate() {
        config.instances.push(instance(&format!("i-{}", i + 1), n, "sim-region-1a"));
    }
    let sim = Sim::start(config).await;
    backend_node(&env, &nodes[0], "i-1").await;
    backend_node(&env, &nodes[1], "i-2").await;
    let port = free_port();
    let secure = format!("--secure-port={port}");
    let mut args =
        vec!["--leader-elect=false", "--controllers=service", secure.as_str(), "--insecure-serving", "--bind-address=127.0.0.1"];
    args.extend_from_slice(flags);
    let core = Core::start(cp, &env, &sim, &args);
    for s in names {
        create_load_balancer_service(&env, s, &[80]).await.expect("service");
    }
    eventually("every Service addressed", Duration::from_secs(30), async || {
        for s in names {
            load_balancer_ip(&env.services().get_opt(s).await.ok().flatten()?)?;
        }
        Some(())
    })
    .await;
    (env, sim, core, nodes, format!("http://127.0.0.1:{port}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_provider_gets_a_deleted_load_balancer_made_again_and_drifted_hosts_back() {
    let (env, sim, core, [n1, n2], metrics) =
        world("lbrepair", true, &["a", "b", "c"], &["--load-balancer-resync-period=2s"]).await;
    let both = vec![n1.clone(), n2.clone()];
    let ensures = async || sim.admin.call_count("LoadBalancersService/EnsureLoadBalancer").await.expect("calls");
    let ensures_before = ensures().await;
    let before = lbs(&sim).await;
    let name_a = before["a"].0.clone();

    // Deleted in the console: made again at the next sweep, and said so.
    sim.admin.remove_load_balancer(&before["a"].0).await.expect("remove");
    eventually("a's load balancer made again", Duration::from_secs(15), async || {
        lbs(&sim).await.get("a").is_some_and(|(_, nodes)| *nodes == both).then_some(())
    })
    .await;
    let said = eventually("the Event", Duration::from_secs(10), async || {
        let e = events(&env, "a", "LoadBalancerRecreated").await;
        (!e.is_empty()).then_some(e)
    })
    .await;
    assert!(said[0].contains(&name_a) && said[0].contains("made it again"), "{said:?}");
    assert_eq!(ensures().await - ensures_before, 1, "one Ensure: the missing load balancer's only");
    assert_eq!(counter(&metrics, "ccm_load_balancer_repairs_total{outcome=\"recreated\"}").await, 1.0);

    // A backend removed by hand: given back.
    sim.admin.set_load_balancer_hosts(&before["b"].0, std::slice::from_ref(&n1)).await.expect("hosts");
    eventually("b's hosts given back", Duration::from_secs(15), async || (lbs(&sim).await["b"].1 == both).then_some(())).await;
    let drift = eventually("the drift Event", Duration::from_secs(10), async || {
        let e = events(&env, "b", "LoadBalancerHostsDrifted").await;
        (!e.is_empty()).then_some(e)
    })
    .await;
    assert!(drift[0].contains(&format!("without {n2}")), "{drift:?}");
    assert!(events(&env, "b", "LoadBalancerRecreated").await.is_empty());

    // A listing that misses everything is a wrong answer: nothing is made again, even the load
    // balancer that really is gone, until the listing is right again.
    let lie = Fault { method: "ListLoadBalancers".into(), lie: Some(Lie::EmptyListing), ..Default::default() };
    sim.admin.set_faults(&[lie]).await.expect("lie");
    let listed = async || sim.admin.call_count("LoadBalancersService/ListLoadBalancers").await.expect("calls");
    let listed_before = listed().await;
    sim.admin.remove_load_balancer(&before["c"].0).await.expect("remove c");
    eventually("two sweeps under the lie", Duration::from_secs(15), async || (listed().await >= listed_before + 2).then_some(()))
        .await;
    assert!(!lbs(&sim).await.contains_key("c"), "made again on a listing that missed everything");
    assert!(counter(&metrics, "ccm_load_balancer_repairs_total{outcome=\"refused\"}").await >= 3.0);
    assert_eq!(lbs(&sim).await.len(), 2, "the empty listing deleted nothing either");
    sim.admin.set_faults(&[]).await.expect("truth");
    eventually("c made again once the listing is right", Duration::from_secs(15), async || {
        lbs(&sim).await.contains_key("c").then_some(())
    })
    .await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_listing_reads_spread_over_the_period_repair_within_the_bound() {
    let flags = ["--load-balancer-repair-period=3s", "--max-load-balancer-repairs=1"];
    let (env, sim, core, [n1, n2], metrics) = world("lbrepairget", false, &["a", "b", "c"], &flags).await;
    let both = vec![n1.clone(), n2.clone()];
    let gets = async || sim.admin.call_count("LoadBalancersService/GetLoadBalancer").await.expect("calls");
    // The reads start once there is a load balancer to read (within a period).
    let first = gets().await;
    let gets_before = eventually("the reads started", Duration::from_secs(10), async || {
        let now = gets().await;
        (now > first).then_some(now)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let per_period = (gets().await - gets_before) as f64 / 2.0;
    assert!((2.0..=4.0).contains(&per_period), "{per_period} GetLoadBalancer calls a period for three load balancers");
    assert_eq!(sim.admin.call_count("LoadBalancersService/ListLoadBalancers").await.expect("calls"), 0, "listing not advertised");

    // Two deleted at once: one made again in this period, the other in the next.
    let before = lbs(&sim).await;
    sim.admin.remove_load_balancer(&before["a"].0).await.expect("remove a");
    sim.admin.remove_load_balancer(&before["b"].0).await.expect("remove b");
    let started = tokio::time::Instant::now();
    let first = eventually("one made again", Duration::from_secs(10), async || {
        let now = lbs(&sim).await;
        let back: Vec<&str> = ["a", "b"].into_iter().filter(|s| now.contains_key(*s)).collect();
        (!back.is_empty()).then(|| (back.len(), started.elapsed()))
    })
    .await;
    assert_eq!(first.0, 1, "both made again within one period despite --max-load-balancer-repairs=1");
    eventually("both made again", Duration::from_secs(15), async || {
        let now = lbs(&sim).await;
        (now.get("a").is_some_and(|l| l.1 == both) && now.get("b").is_some_and(|l| l.1 == both)).then_some(())
    })
    .await;
    assert!(started.elapsed() >= Duration::from_secs(2), "the second came before the window moved: {:?}", started.elapsed());
    assert!(counter(&metrics, "ccm_load_balancer_repairs_total{outcome=\"refused\"}").await >= 1.0);
    for s in ["a", "b"] {
        eventually("the Event", Duration::from_secs(10), async || {
            (!events(&env, s, "LoadBalancerRecreated").await.is_empty()).then_some(())
        })
        .await;
    }

    // Drift found by a read.
    sim.admin.set_load_balancer_hosts(&before["c"].0, std::slice::from_ref(&n2)).await.expect("hosts");
    eventually("c's hosts given back", Duration::from_secs(10), async || (lbs(&sim).await["c"].1 == both).then_some(())).await;
    // Events are recorded in the background, after the hosts are given back.
    eventually("the LoadBalancerHostsDrifted Event", Duration::from_secs(10), async || {
        (!events(&env, "c", "LoadBalancerHostsDrifted").await.is_empty()).then_some(())
    })
    .await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_provider_swept_only_at_start_is_read_over_the_repair_period() {
    let flags = ["--load-balancer-resync-period=0s", "--load-balancer-repair-period=2s"];
    let (env, sim, core, [n1, n2], _) = world("lbrepairnosweep", true, &["a"], &flags).await;
    let both = vec![n1.clone(), n2.clone()];
    let before = lbs(&sim).await;
    sim.admin.remove_load_balancer(&before["a"].0).await.expect("remove");
    eventually("a's load balancer made again", Duration::from_secs(15), async || {
        lbs(&sim).await.get("a").is_some_and(|(_, nodes)| *nodes == both).then_some(())
    })
    .await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}
