//! The service controller, end to end: real API server, the core, the sim over a unix socket.

use std::time::Duration;

use ccm_harness::cluster::{NodeBuilder, TestEnv, create_load_balancer_service, load_balancer_ip, set_ready};
use ccm_provider_sim::Config;
use ccm_provider_sim::admin::LoadBalancerView;
use ccm_provider_sim::config::{Fault, FaultCode};
use k8s_openapi::api::core::v1::{Event, Namespace, Service};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};

use crate::support::{Core, Sim, TEST_LABEL, eventually, instance};

const FINALIZER: &str = "service.kubernetes.io/load-balancer-cleanup";

/// Each test's core handles only its namespace's Services (the API server is shared).
fn service_flags(env: &TestEnv) -> Vec<String> {
    vec!["--leader-elect=false".into(), "--controllers=service".into(), format!("--service-namespace={}", env.namespace)]
}

fn start(cp: &ccm_harness::ControlPlane, env: &TestEnv, sim: &Sim, flags: &[String]) -> Core {
    Core::start(cp, env, sim, &flags.iter().map(String::as_str).collect::<Vec<_>>())
}

async fn lbs(sim: &Sim) -> Vec<LoadBalancerView> {
    sim.admin.state().await.expect("state").load_balancers
}

async fn lb_of(sim: &Sim, service: &str) -> Option<LoadBalancerView> {
    lbs(sim).await.into_iter().find(|l| l.service.ends_with(&format!("/{service}")))
}

async fn ingress_ip(env: &TestEnv, name: &str) -> Option<String> {
    let svc = env.services().get(name).await.ok()?;
    svc.status?.load_balancer?.ingress?.first()?.ip.clone()
}

/// Waits until the Service has Events with every one of `want` (they are recorded in the
/// background), and returns all its reasons.
async fn reasons(env: &TestEnv, name: &str, want: &[&str]) -> Vec<String> {
    eventually("events", Duration::from_secs(10), async || {
        let events: Api<Event> = Api::namespaced(env.client.clone(), &env.namespace);
        let list = events.list(&ListParams::default().fields(&format!("involvedObject.name={name}"))).await.ok()?;
        let reasons: Vec<String> = list.items.into_iter().filter_map(|e| e.reason).collect();
        want.iter().all(|w| reasons.iter().any(|r| r == w)).then_some(reasons)
    })
    .await
}

/// A Node of instance `id` that is a load balancer backend.
pub(crate) async fn backend_node(env: &TestEnv, name: &str, id: &str) {
    NodeBuilder::new(name)
        .label(TEST_LABEL, &env.prefix)
        .provider_id(&format!("sim://sim-region-1a/{id}"))
        .address("InternalIP", "10.0.0.9")
        .create(&env.client)
        .await
        .expect("node");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_gets_a_load_balancer_that_follows_it_and_goes_with_it() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "lb").await.expect("env");
    let node = env.node_name("n1");
    let mut config = Config::default();
    config.instances.push(instance("i-1", &node, "sim-region-1a"));
    let sim = Sim::start(config).await;
    backend_node(&env, &node, "i-1").await;
    let core = start(cp, &env, &sim, &service_flags(&env));
    create_load_balancer_service(&env, "web", &[80]).await.expect("service");

    let ip = eventually("an ingress IP", Duration::from_secs(20), async || ingress_ip(&env, "web").await).await;
    assert!(ip.starts_with("203.0.113."), "an address from the sim's pool: {ip}");
    let svc = env.services().get("web").await.expect("svc");
    assert!(svc.metadata.finalizers.unwrap_or_default().contains(&FINALIZER.to_string()));
    let lb = lb_of(&sim, "web").await.expect("load balancer");
    assert_eq!(lb.ip, ip);
    assert_eq!(lb.ports, vec![80]);
    assert_eq!(lb.nodes, vec![node.clone()]);
    assert!(lb.name.len() <= 32, "{}", lb.name);
    let ingress = svc.status.and_then(|s| s.load_balancer).and_then(|l| l.ingress).unwrap_or_default();
    assert_eq!(ingress[0].ip_mode.as_deref(), Some("VIP"));

    // A port change re-ensures.
    let patch = serde_json::json!({ "spec": { "ports": [
        { "name": "p80", "port": 80, "protocol": "TCP" },
        { "name": "p8080", "port": 8080, "protocol": "TCP" },
    ] } });
    env.services().patch("web", &PatchParams::default(), &Patch::Merge(&patch)).await.expect("ports");
    eventually("the new port on the load balancer", Duration::from_secs(20), async || {
        (lb_of(&sim, "web").await?.ports == vec![80, 8080]).then_some(())
    })
    .await;
    reasons(&env, "web", &["EnsuringLoadBalancer", "EnsuredLoadBalancer"]).await;

    // Deleting the Service deletes the load balancer, then the finalizer lets the Service go.
    env.services().delete("web", &DeleteParams::default()).await.expect("delete");
    eventually("the service gone", Duration::from_secs(20), async || {
        env.services().get_opt("web").await.ok()?.is_none().then_some(())
    })
    .await;
    assert!(lbs(&sim).await.is_empty(), "nothing leaked");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_deleted_while_the_provider_is_down_keeps_its_finalizer_until_cleaned_up() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "lbdown").await.expect("env");
    let sim = Sim::start(Config::default()).await;
    let core = start(cp, &env, &sim, &service_flags(&env));
    create_load_balancer_service(&env, "web", &[80]).await.expect("service");
    eventually("an ingress IP", Duration::from_secs(20), async || ingress_ip(&env, "web").await).await;

    let down = Fault {
        method: "*".into(),
        error_rate: 0.0,
        down: true,
        code: FaultCode::Unavailable,
        subject: None,
        retry_after_ms: None,
        ..Default::default()
    };
    sim.admin.set_faults(&[down]).await.expect("down");
    env.services().delete("web", &DeleteParams::default()).await.expect("delete");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let svc = env.services().get("web").await.expect("still there");
    assert!(svc.metadata.deletion_timestamp.is_some());
    assert_eq!(lbs(&sim).await.len(), 1);

    sim.admin.set_faults(&[]).await.expect("up");
    eventually("the service gone", Duration::from_secs(30), async || {
        env.services().get_opt("web").await.ok()?.is_none().then_some(())
    })
    .await;
    assert!(lbs(&sim).await.is_empty(), "nothing leaked");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_type_change_deletes_the_load_balancer_and_foreign_classes_are_untouched() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "lbtype").await.expect("env");
    let sim = Sim::start(Config::default()).await;
    let core = start(cp, &env, &sim, &service_flags(&env));
    create_load_balancer_service(&env, "web", &[80]).await.expect("service");
    let mut foreign: Service = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "theirs" },
        "spec": { "type": "LoadBalancer", "loadBalancerClass": "example.com/other", "ports": [{ "port": 80 }] }
    }))
    .expect("service");
    foreign.metadata.namespace = Some(env.namespace.clone());
    env.services().create(&PostParams::default(), &foreign).await.expect("foreign");
    eventually("an ingress IP", Duration::from_secs(20), async || ingress_ip(&env, "web").await).await;

    let patch = serde_json::json!({ "spec": { "type": "ClusterIP" } });
    env.services().patch("web", &PatchParams::default(), &Patch::Merge(&patch)).await.expect("type change");
    eventually("the load balancer deleted", Duration::from_secs(20), async || lb_of(&sim, "web").await.is_none().then_some(()))
        .await;
    eventually("finalizer removed and status cleared", Duration::from_secs(20), async || {
        let svc = env.services().get("web").await.ok()?;
        let clean = !svc.metadata.finalizers.unwrap_or_default().contains(&FINALIZER.to_string())
            && svc.status.and_then(|s| s.load_balancer).and_then(|l| l.ingress).unwrap_or_default().is_empty();
        clean.then_some(())
    })
    .await;
    reasons(&env, "web", &["DeletingLoadBalancer", "DeletedLoadBalancer"]).await;

    let theirs = env.services().get("theirs").await.expect("foreign");
    assert!(theirs.metadata.finalizers.unwrap_or_default().is_empty(), "a foreign class gets no finalizer");
    assert!(lb_of(&sim, "theirs").await.is_none(), "nor a load balancer");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_set_changes_reach_every_load_balancer_within_a_second() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "lbnodes").await.expect("env");
    let (n1, n2, n3) = (env.node_name("n1"), env.node_name("n2"), env.node_name("n3"));
    let mut config = Config::default();
    for (id, n) in [("i-1", &n1), ("i-2", &n2), ("i-3", &n3)] {
        config.instances.push(instance(id, n, "sim-region-1a"));
    }
    let sim = Sim::start(config).await;
    backend_node(&env, &n1, "i-1").await;
    backend_node(&env, &n2, "i-2").await;
    set_ready(&env.client, &n1, "True").await.expect("ready");
    let core = start(cp, &env, &sim, &service_flags(&env));
    for s in ["a", "b", "c"] {
        create_load_balancer_service(&env, s, &[80]).await.expect("service");
    }
    let all = |want: Vec<String>| {
        let sim = &sim;
        async move {
            let lbs = lbs(sim).await;
            (lbs.len() == 3 && lbs.iter().all(|l| l.nodes == want)).then_some(())
        }
    };
    let two = vec![n1.clone(), n2.clone()];
    eventually("three load balancers on two nodes", Duration::from_secs(20), async || all(two.clone()).await).await;

    let started = tokio::time::Instant::now();
    backend_node(&env, &n3, "i-3").await;
    let three = vec![n1.clone(), n2.clone(), n3.clone()];
    eventually("the new node everywhere", Duration::from_secs(5), async || all(three.clone()).await).await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(1), "a new node reached every load balancer after {took:?}");

    let patch =
        serde_json::json!({ "metadata": { "labels": { "node.kubernetes.io/exclude-from-external-load-balancers": "true" } } });
    env.nodes().patch(&n2, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("exclude");
    let without = vec![n1.clone(), n3.clone()];
    eventually("the excluded node gone everywhere", Duration::from_secs(5), async || all(without.clone()).await).await;

    // Readiness alone changes nothing.
    set_ready(&env.client, &n1, "False").await.expect("not ready");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(all(without.clone()).await.is_some(), "a NotReady node stays a backend");

    // The cluster autoscaler's taint (KEP-3458): a Node being scaled down stays a backend
    // while kube-proxy's health check drains it, also when the hosts change for another
    // reason (here n2 coming back), until it is deleted or excluded.
    let taint = serde_json::json!({ "spec": { "taints": [
        { "key": "ToBeDeletedByClusterAutoscaler", "value": "1764844800", "effect": "NoSchedule" }
    ] } });
    env.nodes().patch(&n3, &PatchParams::default(), &Patch::Merge(&taint)).await.expect("taint");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(all(without.clone()).await.is_some(), "the autoscaler's taint took a node out: {:?}", lbs(&sim).await);
    let include =
        serde_json::json!({ "metadata": { "labels": { "node.kubernetes.io/exclude-from-external-load-balancers": null } } });
    env.nodes().patch(&n2, &PatchParams::default(), &Patch::Merge(&include)).await.expect("include");
    eventually("n2 back beside the tainted n3", Duration::from_secs(5), async || all(three.clone()).await).await;
    env.nodes().patch(&n2, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("exclude again");
    eventually("n2 out again, n3 still in", Duration::from_secs(5), async || all(without.clone()).await).await;

    // Every Node excluded (a bad label, a listing that came back empty): the load balancers
    // keep their last hosts (n3, or both when the two patches were coalesced) rather than
    // being emptied, and say so.
    for n in [&n1, &n3] {
        env.nodes().patch(n, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("exclude");
    }
    reasons(&env, "a", &["UnAvailableLoadBalancer"]).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let kept = lbs(&sim).await;
    assert!(
        kept.len() == 3 && kept.iter().all(|l| l.nodes.contains(&n3) && l.nodes.iter().all(|n| without.contains(n))),
        "a load balancer was emptied: {kept:?}"
    );
    let back =
        serde_json::json!({ "metadata": { "labels": { "node.kubernetes.io/exclude-from-external-load-balancers": null } } });
    env.nodes().patch(&n3, &PatchParams::default(), &Patch::Merge(&back)).await.expect("include");
    eventually("one node back as the only host", Duration::from_secs(5), async || all(vec![n3.clone()]).await).await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_service_backs_off_alone_and_its_retry_reads_the_newest_spec() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "lbfail").await.expect("env");
    let mut config = Config::default();
    config.faults.push(Fault {
        method: "EnsureLoadBalancer".into(),
        error_rate: 0.0,
        down: true,
        code: FaultCode::Unavailable,
        subject: Some("-bad-".into()),
        retry_after_ms: None,
        ..Default::default()
    });
    let sim = Sim::start(config).await;
    let mut flags = service_flags(&env);
    flags.push("--reconcile-backoff-base=1s".into());
    // The fault picks the bad Service's load balancer by its readable name.
    flags.push("--load-balancer-naming=readable".into());
    let core = start(cp, &env, &sim, &flags);
    create_load_balancer_service(&env, "good", &[80]).await.expect("service");
    create_load_balancer_service(&env, "bad", &[80]).await.expect("service");
    eventually("the good one", Duration::from_secs(20), async || ingress_ip(&env, "good").await).await;

    // The good Service keeps changing and the bad one gets unrelated updates.
    let started = tokio::time::Instant::now();
    let mut i = 0;
    while started.elapsed() < Duration::from_secs(9) {
        let ports = serde_json::json!({ "spec": { "ports": [{ "name": "p", "port": 8000 + i, "protocol": "TCP" }] } });
        env.services().patch("good", &PatchParams::default(), &Patch::Merge(&ports)).await.expect("good");
        let label = serde_json::json!({ "metadata": { "labels": { "touched": i.to_string() } } });
        env.services().patch("bad", &PatchParams::default(), &Patch::Merge(&label)).await.expect("bad");
        i += 1;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let failures: Vec<u64> = sim
        .admin
        .call_log()
        .await
        .expect("log")
        .into_iter()
        .filter(|c| c.method == "LoadBalancersService/EnsureLoadBalancer" && c.code == "UNAVAILABLE")
        .map(|c| c.at_unix_ms)
        .collect();
    // Each attempt is up to three quick tries; attempts are separated by the backoff.
    let gaps: Vec<u64> = failures.windows(2).map(|w| w[1] - w[0]).filter(|g| *g > 500).collect();
    assert!(failures.len() <= 15, "no hot loop: {} failed ensures in 9 s", failures.len());
    assert!(gaps.len() >= 2, "retries happened: {failures:?}");
    assert!(gaps.windows(2).all(|w| w[1] + 150 >= w[0]), "retries space out: {gaps:?}");
    assert!(gaps.last().is_some_and(|g| *g >= 1800), "the backoff grows: {gaps:?}");
    assert!(lb_of(&sim, "good").await.is_some_and(|l| l.ports[0] >= 8000), "the good Service kept being served");

    // Changed during its backoff: once the provider recovers, the new ports are what is ensured.
    let ports = serde_json::json!({ "spec": { "ports": [{ "name": "web", "port": 81, "protocol": "TCP" }] } });
    env.services().patch("bad", &PatchParams::default(), &Patch::Merge(&ports)).await.expect("ports");
    sim.admin.set_faults(&[]).await.expect("clear");
    eventually("the bad one with its newest ports", Duration::from_secs(30), async || {
        (lb_of(&sim, "bad").await?.ports == vec![81]).then_some(())
    })
    .await;
    reasons(&env, "bad", &["SyncLoadBalancerFailed"]).await;
    // Its repeated failures are counted on one Event, not one Event each.
    let events: Api<Event> = Api::namespaced(env.client.clone(), &env.namespace);
    let list = events.list(&ListParams::default().fields("involvedObject.name=bad")).await.expect("events");
    let failed: Vec<i32> = list
        .items
        .iter()
        .filter(|e| e.reason.as_deref() == Some("SyncLoadBalancerFailed"))
        .map(|e| e.series.as_ref().map_or(1, |s| s.count.unwrap_or(1)))
        .collect();
    assert!(failed.len() < gaps.len() + 1, "{} attempts failed, {} Events: {failed:?}", gaps.len() + 1, failed.len());
    assert!(failed.iter().any(|c| *c >= 2), "a repeated failure is counted: {failed:?}");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_names_fit_the_limit_and_stay_unique() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "lbname").await.expect("env");
    let ns_name = format!("{}-{}", env.prefix, "n".repeat(63 - env.prefix.len() - 1));
    let ns =
        Namespace { metadata: kube::api::ObjectMeta { name: Some(ns_name.clone()), ..Default::default() }, ..Default::default() };
    Api::<Namespace>::all(env.client.clone()).create(&PostParams::default(), &ns).await.expect("namespace");
    let long_env = TestEnv { client: env.client.clone(), namespace: ns_name.clone(), prefix: env.prefix.clone() };
    let sim = Sim::start(Config::default()).await;
    let mut flags = service_flags(&long_env);
    flags.push("--load-balancer-naming=readable".into());
    let core = start(cp, &env, &sim, &flags);
    let a = format!("{}-a", "s".repeat(58));
    let b = format!("{}-b", "s".repeat(58));
    create_load_balancer_service(&long_env, &a, &[80]).await.expect("a");
    create_load_balancer_service(&long_env, &b, &[80]).await.expect("b");
    let names = eventually("two load balancers", Duration::from_secs(20), async || {
        let l = lbs(&sim).await;
        (l.len() == 2).then(|| l.into_iter().map(|l| l.name).collect::<Vec<_>>())
    })
    .await;
    assert_ne!(names[0], names[1]);
    assert!(
        names.iter().all(|n| n.len() <= 32 && n.starts_with("kuberne") && n.contains("-lbname-")),
        "readable and within 32: {names:?}"
    );
    core.stop().await.expect("stop");
    let _ = Api::<Namespace>::all(env.client.clone()).delete(&ns_name, &DeleteParams::default()).await;
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_services_all_get_addresses() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "lb200").await.expect("env");
    let sim = Sim::start(Config::default()).await;
    let mut flags = service_flags(&env);
    flags.extend([
        "--kube-api-qps=100".to_string(),
        "--kube-api-burst=200".to_string(),
        "--concurrent-service-syncs=8".to_string(),
    ]);
    let core = start(cp, &env, &sim, &flags);
    let started = tokio::time::Instant::now();
    futures::future::join_all((0..200).map(|i| {
        let env = env.clone();
        async move { create_load_balancer_service(&env, &format!("s{i:03}"), &[80]).await.expect("service") }
    }))
    .await;
    eventually("200 addresses", Duration::from_secs(120), async || {
        let list = env.services().list(&ListParams::default()).await.ok()?;
        let with = list
            .items
            .iter()
            .filter(|s| {
                s.status
                    .as_ref()
                    .and_then(|s| s.load_balancer.as_ref())
                    .and_then(|l| l.ingress.as_ref())
                    .is_some_and(|i| !i.is_empty())
            })
            .count();
        (with == 200).then_some(())
    })
    .await;
    eprintln!("200 services had addresses after {:?}", started.elapsed());
    let ips: std::collections::BTreeSet<String> = lbs(&sim).await.into_iter().map(|l| l.ip).collect();
    let all = lbs(&sim).await;
    let foreign: Vec<&String> = all.iter().map(|l| &l.service).filter(|s| !s.starts_with(&env.namespace)).collect();
    assert!(foreign.is_empty(), "only this namespace: {foreign:?}");
    assert_eq!(ips.len(), 200, "every load balancer has its own address");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_naming_change_keeps_load_balancers_unless_renaming_is_allowed() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "naming").await.expect("env");
    let node = env.node_name("n");
    let mut config = Config::default();
    config.instances.push(instance("i-n", &node, "sim-region-1a"));
    let sim = Sim::start(config).await;
    backend_node(&env, &node, "i-n").await;
    let names = async || -> Vec<String> {
        let mut n: Vec<String> = lbs(&sim).await.into_iter().map(|l| l.name).collect();
        n.sort();
        n
    };
    let recorded = async |svc: &str| -> Option<String> {
        env.services().get(svc).await.ok()?.metadata.annotations?.get("ccm-rs.dev/load-balancer-name").cloned()
    };

    // The default: upstream's naming, recorded on the Service.
    let core = start(cp, &env, &sim, &service_flags(&env));
    let a = create_load_balancer_service(&env, "a", &[80]).await.expect("a");
    let upstream_name: String = format!("a{}", a.metadata.uid.clone().expect("uid").replace('-', "")).chars().take(32).collect();
    let ip = eventually("a's address", Duration::from_secs(20), async || ingress_ip(&env, "a").await).await;
    assert_eq!(names().await, vec![upstream_name.clone()]);
    assert_eq!(recorded("a").await, Some(upstream_name.clone()));
    core.stop().await.expect("stop");

    // Readable naming: a keeps its load balancer and says so; a new Service gets a readable name.
    let mut readable = service_flags(&env);
    readable.push("--load-balancer-naming=readable".into());
    let core = start(cp, &env, &sim, &readable);
    create_load_balancer_service(&env, "b", &[80]).await.expect("b");
    eventually("b's address", Duration::from_secs(20), async || ingress_ip(&env, "b").await).await;
    reasons(&env, "a", &["LoadBalancerNameKept"]).await;
    let now = names().await;
    assert_eq!(now.len(), 2, "{now:?}");
    assert!(now.contains(&upstream_name), "a kept its load balancer: {now:?}");
    let readable_b = recorded("b").await.expect("b's name recorded");
    assert!(readable_b.starts_with("kubernetes-"), "{readable_b}");
    assert_eq!(ingress_ip(&env, "a").await, Some(ip));
    core.stop().await.expect("stop");

    // A load balancer whose name was never recorded (an older core's) is found under the
    // other naming, not made anew.
    let patch = serde_json::json!({ "metadata": { "annotations": { "ccm-rs.dev/load-balancer-name": null } } });
    env.services().patch("b", &PatchParams::default(), &Patch::Merge(&patch)).await.expect("unrecord");
    let core = start(cp, &env, &sim, &service_flags(&env));
    eventually("b's name recorded again", Duration::from_secs(20), async || {
        (recorded("b").await.as_deref() == Some(readable_b.as_str())).then_some(())
    })
    .await;
    assert_eq!(names().await.len(), 2, "no new load balancer for b");
    core.stop().await.expect("stop");

    // Renaming allowed: a is made anew under the readable naming and its old one deleted.
    readable.push("--allow-load-balancer-renaming".into());
    let core = start(cp, &env, &sim, &readable);
    reasons(&env, "a", &["RenamedLoadBalancer"]).await;
    let now = names().await;
    assert_eq!(now.len(), 2, "{now:?}");
    assert!(!now.contains(&upstream_name), "the old load balancer is deleted: {now:?}");
    assert!(recorded("a").await.is_some_and(|n| n.starts_with("kubernetes-")));
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

/// Waits until every one of the Services `names` has an ingress address.
async fn all_addressed(env: &TestEnv, names: &[&str]) {
    eventually("the Services addressed", Duration::from_secs(20), async || {
        for s in names {
            let svc = env.services().get_opt(s).await.ok().flatten()?;
            load_balancer_ip(&svc)?;
        }
        Some(())
    })
    .await;
}

/// A sim that updates hosts in bulk, with three instances for Nodes n1, n2 and n3, of which
/// only n1 is a backend Node yet.
pub(crate) async fn bulk_hosts_world(cp: &ccm_harness::ControlPlane, label: &str) -> (TestEnv, [String; 3], Sim) {
    let env = TestEnv::new(cp.client().await.expect("client"), label).await.expect("env");
    let nodes = [env.node_name("n1"), env.node_name("n2"), env.node_name("n3")];
    let mut config = Config::default();
    config.load_balancers.bulk_hosts = true;
    for (i, n) in nodes.iter().enumerate() {
        config.instances.push(instance(&format!("i-{}", i + 1), n, "sim-region-1a"));
    }
    let sim = Sim::start(config).await;
    backend_node(&env, &nodes[0], "i-1").await;
    (env, nodes, sim)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_provider_gets_one_call_for_every_load_balancer_and_a_failed_item_is_retried_alone() {
    let cp = ccm_harness::shared().expect("control plane");
    let (env, [n1, n2, n3], sim) = bulk_hosts_world(cp, "lbbulk").await;
    let core = start(cp, &env, &sim, &service_flags(&env));
    let names = ["web-a", "web-b", "web-c", "flaky"];
    for s in names {
        create_load_balancer_service(&env, s, &[80]).await.expect("service");
    }
    let all = |want: Vec<String>| {
        let sim = &sim;
        async move {
            let lbs = lbs(sim).await;
            (lbs.len() == 4 && lbs.iter().all(|l| l.nodes == want)).then_some(())
        }
    };
    eventually("four load balancers on one node", Duration::from_secs(20), async || all(vec![n1.clone()]).await).await;
    // Each Service's own writes (finalizer, ingress) done and their watch events through, so
    // that no Service's own sync (which updates its hosts alone) meets the node changes below.
    all_addressed(&env, &names).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    // One load balancer's item of every bulk call fails (INTERNAL, not transient): it alone
    // takes the single call.
    let flaky = lb_of(&sim, "flaky").await.expect("flaky's load balancer").name;
    let fault = Fault {
        method: "BatchUpdateLoadBalancerHosts".into(),
        down: true,
        code: FaultCode::Internal,
        subject: Some(flaky),
        ..Default::default()
    };
    sim.admin.set_faults(&[fault]).await.expect("fault");
    let batch = async || sim.admin.call_count("LoadBalancersService/BatchUpdateLoadBalancerHosts").await.expect("calls");
    let single = async || sim.admin.call_count("LoadBalancersService/UpdateLoadBalancerHosts").await.expect("calls");
    let (batch_before, single_before) = (batch().await, single().await);

    backend_node(&env, &n2, "i-2").await;
    backend_node(&env, &n3, "i-3").await;
    let three = vec![n1.clone(), n2.clone(), n3.clone()];
    eventually("every load balancer on three nodes", Duration::from_secs(10), async || all(three.clone()).await).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (batches, singles) = (batch().await - batch_before, single().await - single_before);
    // Two Nodes created 50 ms apart are one node change or two: one bulk call each, and a
    // single call for the failed item of each.
    assert!((1..=2).contains(&batches), "{batches} BatchUpdateLoadBalancerHosts calls for four load balancers");
    assert!((1..=batches).contains(&singles), "{singles} UpdateLoadBalancerHosts calls: only the failed item's");
    reasons(&env, "flaky", &["UpdateLoadBalancerFailed", "UpdatedLoadBalancer"]).await;
    reasons(&env, "web-a", &["UpdatedLoadBalancer"]).await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_change_reaches_made_load_balancers_in_bulk_ahead_of_a_backlog_of_services() {
    // Twelve Services wait to be made (two workers, 2 s a load balancer: some 12 s of work)
    // when a Node joins. The two load balancers made already follow it in one bulk call at
    // once: not after the backlog, and not each by its own call when its Service (touched
    // meanwhile, so queued behind the backlog) comes up. Seen at 20,000 Nodes: 757 single
    // calls while 5000 load balancers were made, and minutes of node-change latency.
    let cp = ccm_harness::shared().expect("control plane");
    let (env, [n1, n2, _], sim) = bulk_hosts_world(cp, "lbfirst").await;
    let mut flags = service_flags(&env);
    flags.push("--concurrent-service-syncs=2".into());
    let core = start(cp, &env, &sim, &flags);
    let made = ["web-a", "web-b"];
    for s in made {
        create_load_balancer_service(&env, s, &[80]).await.expect("service");
    }
    all_addressed(&env, &made).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let fault = Fault { method: "EnsureLoadBalancer".into(), delay_ms: Some(2000), ..Default::default() };
    sim.admin.set_faults(&[fault]).await.expect("fault");
    for i in 0..12 {
        create_load_balancer_service(&env, &format!("slow-{i}"), &[80]).await.expect("service");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for s in made {
        let patch = serde_json::json!({ "metadata": { "labels": { "touched": "yes" } } });
        env.services().patch(s, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("touch");
    }
    let single = async || sim.admin.call_count("LoadBalancersService/UpdateLoadBalancerHosts").await.expect("calls");
    let batch = async || sim.admin.call_count("LoadBalancersService/BatchUpdateLoadBalancerHosts").await.expect("calls");
    let batches_before = batch().await;
    let joined = std::time::Instant::now();
    backend_node(&env, &n2, "i-2").await;
    let both = vec![n1.clone(), n2.clone()];
    eventually("the two load balancers made on both nodes", Duration::from_secs(30), async || {
        for s in made {
            if lb_of(&sim, s).await?.nodes != both {
                return None;
            }
        }
        Some(())
    })
    .await;
    let took = joined.elapsed();
    let (singles, batches) = (single().await, batch().await - batches_before);
    assert_eq!(singles, 0, "the made load balancers followed the node by single calls, not the bulk pass");
    assert!(batches >= 1, "no BatchUpdateLoadBalancerHosts");
    assert!(took < Duration::from_secs(6), "the node change waited {took:?} behind the backlog");
    let slow = lbs(&sim).await.len();
    assert!(slow < 14, "the backlog was done before the node change arrived ({slow} load balancers): no test");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_balancers_given_pods_follow_a_node_change_in_bulk_too() {
    // A provider that updates hosts in bulk and forwards to pods: load balancers without node
    // ports (given their Services' ready pods) follow a node change in the bulk call with the
    // others, not each by its own call, and keep their pods.
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "epsbulk").await.expect("env");
    let (n1, n2) = (env.node_name("n1"), env.node_name("n2"));
    let mut config = Config::default();
    config.load_balancers.bulk_hosts = true;
    config.load_balancers.pod_endpoints = true;
    config.instances.push(instance("i-1", &n1, "sim-region-1a"));
    config.instances.push(instance("i-2", &n2, "sim-region-1a"));
    let sim = Sim::start(config).await;
    backend_node(&env, &n1, "i-1").await;
    let core = start(cp, &env, &sim, &service_flags(&env));
    let slices: Api<EndpointSlice> = Api::namespaced(env.client.clone(), &env.namespace);
    let names = ["web-a", "web-b"];
    for (i, name) in names.iter().enumerate() {
        let pod = format!("10.244.1.{}", i + 5);
        slices.create(&PostParams::default(), &endpoint_slice(&format!("{name}-1"), name, &[(&pod, true)])).await.expect("slice");
        let svc: Service = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {"type": "LoadBalancer", "allocateLoadBalancerNodePorts": false, "selector": {"app": name},
                     "ports": [{"port": 80, "targetPort": 8080, "protocol": "TCP"}]}
        }))
        .expect("service");
        env.services().create(&PostParams::default(), &svc).await.expect("service");
    }
    let pods = |name: &str| vec![format!("80:10.244.1.{}:8080", if name == "web-a" { 5 } else { 6 })];
    let on = async |nodes: &[String]| {
        for name in names {
            let lb = lb_of(&sim, name).await?;
            if lb.nodes != nodes || lb.port_endpoints != pods(name) {
                return None;
            }
        }
        Some(())
    };
    eventually("both load balancers with their pods on one node", Duration::from_secs(20), async || {
        on(std::slice::from_ref(&n1)).await
    })
    .await;
    all_addressed(&env, &names).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let single = async || sim.admin.call_count("LoadBalancersService/UpdateLoadBalancerHosts").await.expect("calls");
    let batch = async || sim.admin.call_count("LoadBalancersService/BatchUpdateLoadBalancerHosts").await.expect("calls");
    let ensure = async || sim.admin.call_count("LoadBalancersService/EnsureLoadBalancer").await.expect("calls");
    let (singles, batches, ensures) = (single().await, batch().await, ensure().await);

    backend_node(&env, &n2, "i-2").await;
    let both = [n1.clone(), n2.clone()];
    eventually("both load balancers with their pods on both nodes", Duration::from_secs(10), async || on(&both).await).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(single().await - singles, 0, "load balancers given pods followed the node by single calls");
    assert_eq!(ensure().await - ensures, 0, "a node change made a full Ensure");
    assert!(batch().await - batches >= 1, "no BatchUpdateLoadBalancerHosts");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_balancer_slower_to_make_than_the_call_timeout_is_made_by_one_call() {
    // The cloud takes 3 s to make a load balancer; reads time out after 1 s. The Ensure has
    // the mutation deadline (--provider-mutation-timeout), so it is made by one call, not
    // abandoned and tried again while the first may still run.
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "slowlb").await.expect("env");
    let node = env.node_name("n1");
    let mut config = Config::default();
    config.instances.push(instance("i-1", &node, "sim-region-1a"));
    config.faults.push(Fault { method: "EnsureLoadBalancer".into(), delay_ms: Some(3000), ..Default::default() });
    let sim = Sim::start(config).await;
    backend_node(&env, &node, "i-1").await;
    let mut flags = service_flags(&env);
    flags.push("--provider-call-timeout=1s".into());
    let core = start(cp, &env, &sim, &flags);
    create_load_balancer_service(&env, "web", &[80]).await.expect("service");
    eventually("an ingress IP", Duration::from_secs(30), async || ingress_ip(&env, "web").await).await;
    let ensures = sim.admin.calls().await.expect("calls").counts;
    let ensures: Vec<_> = ensures.iter().filter(|c| c.method == "LoadBalancersService/EnsureLoadBalancer").collect();
    assert_eq!(ensures.len(), 1, "only OK answers: {ensures:?}");
    assert_eq!((ensures[0].code.as_str(), ensures[0].count), ("OK", 1), "one Ensure: {ensures:?}");
    assert_eq!(lbs(&sim).await.len(), 1);
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_balancer_failing_transiently_does_not_hold_back_the_others_node_changes() {
    // One of three load balancers answers UNAVAILABLE for its item of every hosts update,
    // bulk or single, for a while. The other two follow the next node change at once: the
    // failed item backs off alone, not the bulk pass every node change goes through.
    let cp = ccm_harness::shared().expect("control plane");
    let (env, [n1, n2, n3], sim) = bulk_hosts_world(cp, "lbhol").await;
    let mut flags = service_flags(&env);
    // Backoffs long enough for a held-back bulk pass to show, short enough that the failed
    // load balancer's own retry comes within the test once the fault is gone.
    flags.push("--reconcile-backoff-max=20s".into());
    let core = start(cp, &env, &sim, &flags);
    for s in ["web-a", "web-b", "sick"] {
        create_load_balancer_service(&env, s, &[80]).await.expect("service");
    }
    eventually("three load balancers", Duration::from_secs(20), async || (lbs(&sim).await.len() == 3).then_some(())).await;
    let sick = lb_of(&sim, "sick").await.expect("sick's load balancer").name;
    let faults: Vec<Fault> = ["BatchUpdateLoadBalancerHosts", "UpdateLoadBalancerHosts"]
        .into_iter()
        .map(|method| Fault {
            method: method.into(),
            down: true,
            code: FaultCode::Unavailable,
            subject: Some(sick.clone()),
            ..Default::default()
        })
        .collect();
    sim.admin.set_faults(&faults).await.expect("faults");
    // A node change while the fault lasts, and several seconds of its retries.
    backend_node(&env, &n2, "i-2").await;
    let healthy = |want: Vec<String>| {
        let (sim, sick) = (&sim, &sick);
        async move {
            let lbs = lbs(sim).await;
            lbs.iter().filter(|l| l.name != *sick).all(|l| l.nodes == want).then_some(())
        }
    };
    eventually("the healthy two on two nodes", Duration::from_secs(10), async || healthy(vec![n1.clone(), n2.clone()]).await)
        .await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    // The next node change reaches the healthy two within a second or two.
    let added = std::time::Instant::now();
    backend_node(&env, &n3, "i-3").await;
    let three = vec![n1.clone(), n2.clone(), n3.clone()];
    eventually("the healthy two on three nodes", Duration::from_secs(30), async || healthy(three.clone()).await).await;
    let took = added.elapsed();
    assert!(took < Duration::from_secs(3), "the healthy load balancers followed the node change after {took:?}");
    // Once the fault clears, the sick one converges too.
    sim.admin.set_faults(&[]).await.expect("clear");
    eventually("the sick one on three nodes", Duration::from_secs(60), async || {
        (lb_of(&sim, "sick").await?.nodes == three).then_some(())
    })
    .await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

/// An EndpointSlice of `service` with `ready` (address, ready) endpoints on port 8080.
fn endpoint_slice(name: &str, service: &str, ready: &[(&str, bool)]) -> k8s_openapi::api::discovery::v1::EndpointSlice {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "", "protocol": "TCP", "port": 8080}],
        "endpoints": ready.iter().map(|(a, r)| serde_json::json!({
            "addresses": [a], "nodeName": "n1", "conditions": {"ready": r}
        })).collect::<Vec<_>>(),
    }))
    .expect("slice")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_balancer_without_node_ports_gets_the_ready_pods_and_follows_them() {
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "eps").await.expect("env");
    let node = env.node_name("n1");
    let mut config = Config::default();
    config.load_balancers.pod_endpoints = true;
    config.instances.push(instance("i-1", &node, "sim-region-1a"));
    let sim = Sim::start(config).await;
    backend_node(&env, &node, "i-1").await;
    let slices: Api<EndpointSlice> = Api::namespaced(env.client.clone(), &env.namespace);
    // Its pods exist before the core starts: the first listing brings them.
    slices
        .create(&PostParams::default(), &endpoint_slice("web-a", "web", &[("10.244.1.5", true), ("10.244.1.6", false)]))
        .await
        .expect("slice");
    let svc: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web"},
        "spec": {"type": "LoadBalancer", "allocateLoadBalancerNodePorts": false, "selector": {"app": "web"},
                 "ports": [{"port": 80, "targetPort": 8080, "protocol": "TCP"}]}
    }))
    .expect("service");
    env.services().create(&PostParams::default(), &svc).await.expect("service");
    let core = start(cp, &env, &sim, &service_flags(&env));

    let endpoints = async |want: &[&str]| {
        let want: Vec<String> = want.iter().map(|e| format!("80:{e}:8080")).collect();
        eventually(&format!("the load balancer's pods {want:?}"), Duration::from_secs(20), async || {
            (lb_of(&sim, "web").await?.port_endpoints == want).then_some(())
        })
        .await
    };
    endpoints(&["10.244.1.5"]).await;
    // A pod more (another slice), one ready now: a new Ensure with every ready pod.
    slices.create(&PostParams::default(), &endpoint_slice("web-b", "web", &[("10.244.2.7", true)])).await.expect("slice");
    slices
        .replace("web-a", &PostParams::default(), &{
            let mut s = slices.get("web-a").await.expect("get");
            s.endpoints = endpoint_slice("web-a", "web", &[("10.244.1.5", true), ("10.244.1.6", true)]).endpoints;
            s
        })
        .await
        .expect("ready");
    endpoints(&["10.244.1.5", "10.244.1.6", "10.244.2.7"]).await;
    // A slice deleted: its pods leave.
    slices.delete("web-a", &DeleteParams::default()).await.expect("delete slice");
    endpoints(&["10.244.2.7"]).await;
    // Another Service's slices are not this one's.
    slices.create(&PostParams::default(), &endpoint_slice("db-a", "db", &[("10.244.3.3", true)])).await.expect("slice");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(lb_of(&sim, "web").await.expect("lb").port_endpoints, vec!["80:10.244.2.7:8080".to_string()]);
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

/// A provider that declares its call rate (GetPluginCapabilities' `call_rate`) is paced to it:
/// a burst of Services, more than its cloud allows at once, gets its load balancers without a
/// call refused. The same sim not declaring its limit, as a provider that does not, is
/// refused calls (which the core waits out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_are_paced_to_the_rate_the_provider_declares() {
    use ccm_provider_sim::config::RateLimit;
    const SERVICES: usize = 12;
    let cp = ccm_harness::shared().expect("control plane");
    for declared in [true, false] {
        let env =
            TestEnv::new(cp.client().await.expect("client"), if declared { "paced" } else { "unpaced" }).await.expect("env");
        let node = env.node_name("n1");
        let mut config = Config::default();
        config.instances.push(instance("i-1", &node, "sim-region-1a"));
        config.api.rate_limit = Some(RateLimit { rps: 4.0, burst: 1 });
        config.api.undeclared_rate_limit = !declared;
        let sim = Sim::start(config).await;
        backend_node(&env, &node, "i-1").await;
        let core = start(cp, &env, &sim, &service_flags(&env));
        for i in 0..SERVICES {
            create_load_balancer_service(&env, &format!("web-{i}"), &[80]).await.expect("service");
        }
        eventually("every Service addressed", Duration::from_secs(60), async || {
            for i in 0..SERVICES {
                ingress_ip(&env, &format!("web-{i}")).await?;
            }
            Some(())
        })
        .await;
        let calls = sim.admin.call_log().await.expect("log");
        let cloud: Vec<_> = calls.iter().filter(|c| !c.method.starts_with("IdentityService/")).collect();
        let refused = cloud.iter().filter(|c| c.code == "RESOURCE_EXHAUSTED").count();
        if declared {
            // At most one, should a call's arrival jitter beat the core's 2% margin on a busy machine.
            assert!(refused <= 1, "calls paced to the declared rate are not refused: {cloud:?}");
            // Paced, not merely lucky: the calls went out at the cloud's rate (4/s, burst 1).
            let (first, last) = (cloud.first().expect("calls").at_unix_ms, cloud.last().expect("calls").at_unix_ms);
            let floor = (cloud.len() as u64 - 1) * 1000 / 4;
            assert!(last - first + 100 >= floor, "{} calls in {} ms, floor {floor} ms", cloud.len(), last - first);
        } else {
            assert!(refused >= 3, "without a declared rate the core finds the limit by being refused: {cloud:?}");
        }
        core.stop().await.expect("stop");
        env.cleanup().await.expect("cleanup");
    }
}
