//! High availability: one Lease per controller, and leader migration from
//! kube-controller-manager.

use std::collections::BTreeMap;
use std::time::Duration;

use ccm_harness::cluster::{NodeBuilder, TestEnv, UNINITIALIZED_TAINT, create_load_balancer_service, load_balancer_ip};
use ccm_provider_sim::Config;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::PostParams;

use crate::support::{Core, Sim, TEST_LABEL, eventually, instance, one_node_cloud};

const LEASE_FLAGS: [&str; 4] = [
    "--leader-elect=true",
    "--leader-elect-lease-duration=4s",
    "--leader-elect-renew-deadline=2s",
    "--leader-elect-retry-period=1s",
];

async fn initialised(env: &TestEnv, name: &str) -> Option<Node> {
    let node = env.nodes().get_opt(name).await.ok().flatten()?;
    let tainted =
        node.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == UNINITIALIZED_TAINT));
    (!tainted).then_some(node)
}

async fn has_address(env: &TestEnv, name: &str) -> Option<String> {
    let svc = env.services().get_opt(name).await.ok().flatten()?;
    load_balancer_ip(&svc).map(str::to_string)
}

async fn holders(env: &TestEnv, names: &[String]) -> Option<BTreeMap<String, String>> {
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.namespace);
    let mut out = BTreeMap::new();
    for name in names {
        let holder = leases.get_opt(name).await.ok().flatten()?.spec?.holder_identity.filter(|h| !h.is_empty())?;
        out.insert(name.clone(), holder);
    }
    Some(out)
}

/// The holders of `names`, once every one is held, as long as two replicas share them.
async fn shared(env: &TestEnv, names: &[String]) -> Option<BTreeMap<String, String>> {
    let now = holders(env, names).await?;
    let ids: std::collections::BTreeSet<&String> = now.values().collect();
    (ids.len() == 2).then_some(now)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_lease_per_controller_two_replicas_share_the_controllers_and_fail_over() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "perctl").await.expect("env");
    let (first, second, third) = (env.node_name("first"), env.node_name("second"), env.node_name("third"));
    let mut config = Config::default();
    config.instances.push(instance("i-1", &first, "sim-region-1a"));
    config.instances.push(instance("i-2", &second, "sim-region-1a"));
    config.instances.push(instance("i-3", &third, "sim-region-1a"));
    let sim = Sim::start(config).await;
    let mut flags = LEASE_FLAGS.to_vec();
    flags.extend(["--leader-elect-per-controller", "--controllers=cloud-node,service,cloud-node-lifecycle"]);
    let started = tokio::time::Instant::now();
    let a = Core::start(cp, &env, &sim, &flags);
    let b = Core::start(cp, &env, &sim, &flags);
    let names: Vec<String> = ["cloud-node-controller", "service-lb-controller", "cloud-node-lifecycle-controller"]
        .iter()
        .map(|c| format!("{}-{c}", env.prefix))
        .collect();
    // Whichever replica starts first takes what it finds free; once the other has been a
    // member for a lease duration, it is handed its share.
    let held = eventually("the controllers' leases shared by both replicas", Duration::from_secs(30), async || {
        shared(&env, &names).await
    })
    .await;
    eprintln!("shared after {:?}: {held:#?}", started.elapsed());
    let members: Api<Lease> = Api::namespaced(env.client.clone(), &env.namespace);
    let member_leases = members
        .list(&kube::api::ListParams::default().labels(&format!("ccm-rs.dev/leader-members-of={}", env.prefix)))
        .await
        .expect("members");
    assert_eq!(member_leases.items.len(), 2, "one member Lease per replica");

    NodeBuilder::new(&first).uninitialized().label(TEST_LABEL, &env.prefix).create(&env.client).await.expect("node");
    create_load_balancer_service(&env, "web", &[80]).await.expect("service");
    eventually("the node controller's leader initialises", Duration::from_secs(30), async || initialised(&env, &first).await)
        .await;
    eventually("the service controller's leader ensures", Duration::from_secs(30), async || has_address(&env, "web").await).await;
    // Each Lease has exactly one holder, and it stays: no handing back and forth over two
    // lease durations.
    for _ in 0..40 {
        assert_eq!(holders(&env, &names).await.as_ref(), Some(&held), "leaders are stable");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Stop one replica: the other leads every controller within the lease duration (its
    // Leases are released on the way out).
    let stopped = tokio::time::Instant::now();
    a.stop().await.expect("stops cleanly");
    let after = eventually("the remaining replica leads every controller", Duration::from_secs(15), async || {
        let now = holders(&env, &names).await?;
        let ids: std::collections::BTreeSet<&String> = now.values().collect();
        (ids.len() == 1).then_some(now)
    })
    .await;
    let took = stopped.elapsed();
    eprintln!("failover to the remaining replica took {took:?} (lease duration 4s): {after:?}");
    assert!(took <= Duration::from_secs(6), "failover within the lease duration, took {took:?}");
    NodeBuilder::new(&second).uninitialized().label(TEST_LABEL, &env.prefix).create(&env.client).await.expect("node");
    eventually("the node controller still works after failover", Duration::from_secs(30), async || {
        initialised(&env, &second).await
    })
    .await;

    // A replica that returns gets its share back, handed over by the one that led it all.
    let returned = tokio::time::Instant::now();
    let c = Core::start(cp, &env, &sim, &flags);
    let rebalanced = eventually("the returning replica leads some controllers again", Duration::from_secs(30), async || {
        shared(&env, &names).await
    })
    .await;
    let took = returned.elapsed();
    eprintln!("rebalanced {took:?} after a replica returned: {rebalanced:?}");
    assert!(took >= Duration::from_secs(4), "a returning replica is given work only after a lease duration, took {took:?}");
    NodeBuilder::new(&third).uninitialized().label(TEST_LABEL, &env.prefix).create(&env.client).await.expect("node");
    eventually("the node controller works after the handover", Duration::from_secs(30), async || initialised(&env, &third).await)
        .await;
    let svc = env.services().get("web").await.expect("service");
    let ip = load_balancer_ip(&svc).map(str::to_string);
    c.stop().await.expect("stop");
    b.stop().await.expect("stop");
    let state = sim.admin.state().await.expect("state");
    assert_eq!(state.load_balancers.len(), 1, "one load balancer through every handover: {:?}", state.load_balancers);
    assert!(ip.is_some());
    env.cleanup().await.expect("cleanup");
}

/// A replica that cannot serve (its provider unreachable, its /readyz failing) is given no
/// controller Lease: the ready replica keeps them all, and new work is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_lease_per_controller_a_replica_that_is_not_ready_is_given_nothing() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "perctlready").await.expect("env");
    let first = env.node_name("first");
    let mut config = Config::default();
    config.instances.push(instance("i-1", &first, "sim-region-1a"));
    let sim = Sim::start(config).await;
    let mut flags = LEASE_FLAGS.to_vec();
    flags.extend(["--leader-elect-per-controller", "--controllers=cloud-node,service,cloud-node-lifecycle"]);
    let a = Core::start(cp, &env, &sim, &flags);
    let names: Vec<String> = ["cloud-node-controller", "service-lb-controller", "cloud-node-lifecycle-controller"]
        .iter()
        .map(|c| format!("{}-{c}", env.prefix))
        .collect();
    let alone = eventually("the first replica leads every controller", Duration::from_secs(30), async || {
        let now = holders(&env, &names).await?;
        let ids: std::collections::BTreeSet<&String> = now.values().collect();
        (ids.len() == 1).then_some(now)
    })
    .await;
    // The second replica's provider socket does not exist: it never becomes ready.
    let nowhere = format!("unix://{}/nowhere.sock", std::env::temp_dir().display());
    let b = Core::start_on(cp.kubeconfig_path(), &env, &nowhere, &flags);
    // Four lease durations and more: a ready replica would have been handed its share.
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(holders(&env, &names).await.as_ref(), Some(&alone), "a replica that is not ready took a controller Lease");
    create_load_balancer_service(&env, "web", &[80]).await.expect("service");
    NodeBuilder::new(&first).uninitialized().label(TEST_LABEL, &env.prefix).create(&env.client).await.expect("node");
    eventually("the service controller's leader ensures", Duration::from_secs(30), async || has_address(&env, "web").await).await;
    eventually("the node controller's leader initialises", Duration::from_secs(30), async || initialised(&env, &first).await)
        .await;
    b.stop().await.expect("stop");
    a.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

async fn lease_identity_of(env: &TestEnv, name: &str) -> Option<String> {
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.namespace);
    leases.get_opt(name).await.ok().flatten()?.spec?.holder_identity
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrated_controllers_wait_for_the_migration_lease() {
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};

    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "migrate").await.expect("env");
    let name = env.node_name("a");
    let mut config = Config::default();
    config.instances.push(instance("i-a", &name, "sim-region-1a"));
    let sim = Sim::start(config).await;

    // kube-controller-manager, started with the same migration configuration, holds the
    // migration Lease and runs the service controller.
    let migration_lease = format!("{}-migration", env.prefix);
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("leader-migration.yaml");
    std::fs::write(
        &path,
        format!(
            "apiVersion: controllermanager.config.k8s.io/v1\nkind: LeaderMigrationConfiguration\n\
             leaderName: {migration_lease}\nresourceLock: leases\ncontrollerLeaders:\n\
             - name: service\n  component: \"*\"\n\
             - name: route\n  component: kube-controller-manager\n"
        ),
    )
    .expect("config");
    // It renews every second with the 4 s lease duration the test cores use.
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.namespace);
    let now = || MicroTime(k8s_openapi::jiff::Timestamp::now());
    let kcm = Lease {
        metadata: ObjectMeta { name: Some(migration_lease.clone()), ..Default::default() },
        spec: Some(LeaseSpec {
            holder_identity: Some("kcm-host_5f2a".into()),
            lease_duration_seconds: Some(4),
            acquire_time: Some(now()),
            renew_time: Some(now()),
            ..Default::default()
        }),
    };
    leases.create(&PostParams::default(), &kcm).await.expect("kube-controller-manager's lease");
    let (stop_kcm, mut kcm_stopped) = tokio::sync::watch::channel(false);
    let renewing = {
        let (leases, name) = (leases.clone(), migration_lease.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = kcm_stopped.wait_for(|s| *s) => break,
                }
                let patch = serde_json::json!({ "spec": { "renewTime": now() } });
                let _ = leases.patch(&name, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch)).await;
            }
            // Released on shutdown, as client-go's leader election does.
            let patch = serde_json::json!({ "spec": { "holderIdentity": "", "leaseDurationSeconds": 1 } });
            let _ = leases.patch(&name, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch)).await;
        })
    };

    let config_flag = format!("--leader-migration-config={}", path.display());
    let mut flags = LEASE_FLAGS.to_vec();
    flags.extend(["--enable-leader-migration", &config_flag, "--controllers=cloud-node,service"]);
    let core = Core::start(cp, &env, &sim, &flags);
    NodeBuilder::new(&name).uninitialized().label(TEST_LABEL, &env.prefix).create(&env.client).await.expect("node");
    create_load_balancer_service(&env, "web", &[80]).await.expect("service");
    eventually("a controller that does not migrate runs under the main lease", Duration::from_secs(30), async || {
        initialised(&env, &name).await
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(has_address(&env, "web").await.is_none(), "the service controller waits while kube-controller-manager leads it");
    assert_eq!(sim.admin.call_count("LoadBalancersService/EnsureLoadBalancer").await.expect("calls"), 0);

    // kube-controller-manager is rolled out without the controller and lets the Lease go.
    let _ = stop_kcm.send(true);
    renewing.await.expect("released");
    let started = tokio::time::Instant::now();
    eventually("the service controller runs once this process holds the migration lease", Duration::from_secs(30), async || {
        has_address(&env, "web").await
    })
    .await;
    eprintln!("migration lease taken over and the Service ensured {:?} after kube-controller-manager let go", started.elapsed());
    let holder = lease_identity_of(&env, &migration_lease).await.unwrap_or_default();
    assert!(!holder.is_empty() && holder != "kcm-host_5f2a", "held by this process: {holder:?}");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_the_api_server_stops_before_its_lease_can_expire() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "fence").await.expect("env");
    let sim = Sim::start(Config::default()).await;
    // The leader reaches the API server through a proxy that can go silent (a partition, or
    // a half-open connection: nothing is closed, nothing answers).
    let target = cp.server().trim_start_matches("https://").parse().expect("the API server's address");
    let proxy = crate::support::Blackhole::start(target).await;
    let kubeconfig = crate::support::kubeconfig_via(cp.kubeconfig_path(), cp.server(), proxy.addr);
    let flags = [
        "--leader-elect=true",
        "--leader-elect-lease-duration=8s",
        "--leader-elect-renew-deadline=4s",
        "--leader-elect-retry-period=1s",
    ];
    let core = Core::start_on(&kubeconfig, &env, &sim.endpoint, &flags);
    eventually("the lead", Duration::from_secs(30), async || holders(&env, std::slice::from_ref(&env.prefix)).await).await;
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.namespace);
    let renewed = || async { leases.get(&env.prefix).await.ok()?.spec?.renew_time.map(|t| t.0.as_millisecond()) };
    let before = renewed().await.expect("a renewal");

    proxy.pause();
    let cut = tokio::time::Instant::now();
    // It gives up the lead at its renew deadline (4 s after its last renewal), before the
    // Lease may expire (8 s) and another replica take over; it does not hang on its requests.
    let result = tokio::time::timeout(Duration::from_secs(8), core.task).await.expect("stops before the lease can expire");
    let stopped = cut.elapsed();
    let error = result.expect("join").expect_err("losing the lead is an error exit");
    assert!(format!("{error:#}").contains("lost the leader lease"), "{error:#}");
    let last = renewed().await.expect("the Lease");
    let expires_in =
        Duration::from_millis(u64::try_from(last + 8000 - k8s_openapi::jiff::Timestamp::now().as_millisecond()).unwrap_or(0));
    eprintln!(
        "cut off: stopped after {stopped:?}; the Lease (renewed {} ms after the first look) expires in {expires_in:?}",
        last - before
    );
    assert!(expires_in > Duration::ZERO, "stopped before its Lease expired on the server");
    env.cleanup().await.expect("cleanup");
}

fn now_ms() -> i64 {
    k8s_openapi::jiff::Timestamp::now().as_millisecond()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_stopped_past_its_lease_writes_nothing_when_it_resumes() {
    use ccm_provider_sim::config::{Fault, FaultCode};
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "frozen").await.expect("env");
    // Each process has a cloud of its own, so that the provider calls of the stopped one are
    // told apart; the first one's refuses every EnsureLoadBalancer, so it retries all along.
    let mut refusing = Config::default();
    refusing.faults.push(Fault {
        method: "EnsureLoadBalancer".into(),
        error_rate: 1.0,
        code: FaultCode::Unavailable,
        ..Default::default()
    });
    let (sim_a, sim_b) = (Sim::start(refusing).await, Sim::start(Config::default()).await);
    create_load_balancer_service(&env, "web", &[80]).await.expect("service");
    let start = |user: &str, sim: &Sim| {
        let kubeconfig = cp.kubeconfig_for(user, Some("system:masters")).expect("kubeconfig");
        let log = std::fs::File::create(std::env::temp_dir().join(format!("{}-{user}.log", env.prefix))).expect("log");
        tokio::process::Command::new(crate::support::workspace_binary("cloud-controller-manager"))
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--provider-endpoint={}", sim.endpoint))
            .args(LEASE_FLAGS)
            .arg(format!("--leader-elect-resource-name={}", env.prefix))
            .arg(format!("--leader-elect-resource-namespace={}", env.namespace))
            .arg(format!("--service-namespace={}", env.namespace))
            .args(["--controllers=service", "--secure-port=0", "--reconcile-backoff-base=200ms", "--reconcile-backoff-max=500ms"])
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("cloud-controller-manager starts")
    };
    let (user_a, user_b) = (format!("{}-a", env.prefix), format!("{}-b", env.prefix));
    let mut a = start(&user_a, &sim_a);
    // The load balancer mutations a sim received since `since` (reads are no writes: a
    // resumed process may read before it notices the loss, as any standby reads).
    let mutations = async |sim: &Sim, since: i64| -> Vec<String> {
        const MUTATIONS: [&str; 4] =
            ["EnsureLoadBalancer", "UpdateLoadBalancerHosts", "BatchUpdateLoadBalancerHosts", "EnsureLoadBalancerDeleted"];
        let log = sim.admin.call_log().await.expect("call log");
        // When the sim began the call (it logs calls as they end).
        log.iter()
            .filter(|c| (c.at_unix_ms as i64) - (c.micros / 1000) as i64 >= since)
            .filter(|c| c.method.strip_prefix("LoadBalancersService/").is_some_and(|m| MUTATIONS.contains(&m)))
            .map(|c| format!("{} at {}", c.method, c.at_unix_ms))
            .collect()
    };
    let ensures = async |sim: &Sim, since: i64| mutations(sim, since).await.len();
    eventually("the first process leading and retrying", Duration::from_secs(30), async || {
        (ensures(&sim_a, 0).await >= 2).then_some(())
    })
    .await;
    let mut b = start(&user_b, &sim_b);

    // Stopped (SIGSTOP, as a frozen VM or a paused container) past its lease: the second
    // process takes over and ensures the load balancer.
    let pid = a.id().expect("pid").to_string();
    assert!(std::process::Command::new("kill").args(["-STOP", &pid]).status().expect("kill").success());
    eventually("the second process's load balancer", Duration::from_secs(30), async || has_address(&env, "web").await).await;
    tokio::time::sleep(Duration::from_secs(1)).await;

    // Resumed: it finds its lead gone and exits, writing nothing to the API server or the cloud.
    let resumed = now_ms();
    assert!(std::process::Command::new("kill").args(["-CONT", &pid]).status().expect("kill").success());
    let status = tokio::time::timeout(Duration::from_secs(10), a.wait()).await.expect("it exits").expect("wait");
    assert!(!status.success(), "losing the lead is an error exit: {status}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = mutations(&sim_a, resumed).await;
    let log = sim_a.admin.call_log().await.expect("call log");
    let calls: Vec<String> =
        log.iter().filter(|c| c.at_unix_ms as i64 >= resumed).map(|c| format!("{} at {}", c.method, c.at_unix_ms)).collect();
    assert!(
        after.is_empty(),
        "load balancer mutations by the resumed process (resumed at {resumed}): {after:?}; every call since: {calls:?}"
    );
    let audit = std::fs::read_to_string(cp.audit_log()).expect("audit log");
    let writes: Vec<String> = audit
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["user"]["username"] == user_a.as_str() && e["stage"] == "ResponseComplete")
        .filter(|e| matches!(e["verb"].as_str(), Some("create" | "update" | "patch" | "delete")))
        .filter(|e| {
            let at = e["requestReceivedTimestamp"].as_str().and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok());
            at.is_some_and(|t| t.as_millisecond() >= resumed)
        })
        .map(|e| format!("{} {}", e["verb"], e["requestURI"]))
        .collect();
    assert!(writes.is_empty(), "writes by the resumed process: {writes:#?}");
    let _ = b.kill().await;
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_that_panics_makes_the_process_exit_non_zero() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "panic").await.expect("env");
    let sim = Sim::start(Config::default()).await;
    let name = env.node_name("a");
    NodeBuilder::new(&name).uninitialized().label(TEST_LABEL, &env.prefix).create(&env.client).await.expect("node");
    let log = std::env::temp_dir().join(format!("{}-panic.log", env.prefix));
    let mut core = tokio::process::Command::new(crate::support::workspace_binary("cloud-controller-manager"))
        .arg(format!("--kubeconfig={}", cp.kubeconfig_path().display()))
        .arg(format!("--provider-endpoint={}", sim.endpoint))
        .arg(format!("--node-exclude-selector={TEST_LABEL}!={}", env.prefix))
        .args(["--leader-elect=false", "--controllers=cloud-node", "--secure-port=0"])
        .env("CCM_TEST_PANIC_IN_RECONCILE", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .kill_on_drop(true)
        .spawn()
        .expect("cloud-controller-manager starts");
    let status = tokio::time::timeout(Duration::from_secs(30), core.wait()).await.expect("it exits").expect("wait");
    assert!(!status.success(), "a panicking controller is a failing process: {status}");
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(text.contains("cloud-node-controller panicked"), "{text}");
    env.cleanup().await.expect("cleanup");
}

/// `--node-deletion-window` holds across a change of leader: the replica that takes over
/// counts what the last one deleted in the window (on the Lease), and deletes no more.
/// A leader stopped (a SIGTERM, a rolling update) while the provider works on an Ensure lets
/// the Ensure end and then releases its Lease: the next replica leads once the mutation is
/// over, not a whole mutation deadline later (the call dropped unanswered counts until then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_stopped_mid_ensure_hands_over_once_the_ensure_ends() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "midens").await.expect("env");
    let node = env.node_name("n1");
    let sim = one_node_cloud(&env).await;
    ccm_harness::cluster::set_ready(&env.client, &node, "True").await.expect("condition");
    let mut flags = LEASE_FLAGS.to_vec();
    // A mutation deadline far longer than the Ensure, and than the test's bound.
    flags.extend(["--controllers=service", "--provider-mutation-timeout=3m"]);
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.namespace);
    let holder = async || leases.get_opt(&env.prefix).await.ok().flatten()?.spec?.holder_identity.filter(|h| !h.is_empty());
    let a = Core::start(cp, &env, &sim, &flags);
    let first = eventually("a leads", Duration::from_secs(20), holder).await;
    let delay = Duration::from_secs(15);
    let slow = ccm_provider_sim::config::Fault {
        method: "EnsureLoadBalancer".into(),
        delay_ms: Some(delay.as_millis() as u64),
        ..Default::default()
    };
    sim.admin.set_faults(&[slow]).await.expect("faults");
    create_load_balancer_service(&env, "web", &[80]).await.expect("service");
    // The Ensure is with the provider: the leader is told to stop.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let stopped = tokio::time::Instant::now();
    let b = Core::start(cp, &env, &sim, &flags);
    a.stop_within(Duration::from_secs(60)).await.expect("a stops");
    eprintln!("a stopped {:?} after it was told to", stopped.elapsed());
    let next =
        eventually("another replica leads", Duration::from_secs(40), async || holder().await.filter(|h| *h != first)).await;
    let took = stopped.elapsed();
    eprintln!("{next} leads {took:?} after {first} was told to stop");
    assert!(took < Duration::from_secs(45), "the Lease went over {took:?} after the stop (the Ensure took {delay:?})");
    sim.admin.set_faults(&[]).await.expect("faults");
    eventually("the Service has its address", Duration::from_secs(30), async || has_address(&env, "web").await).await;
    // The new leader may have an Ensure of its own with the provider (sent while the fault
    // lasted): it stops once that ends.
    b.stop_within(Duration::from_secs(30)).await.expect("stops");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_deletion_window_holds_across_a_change_of_leader() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "delwin").await.expect("env");
    let mut config = Config::default();
    // Four Ready Nodes, three NotReady ones whose instances are gone.
    let names: Vec<String> = (0..7).map(|k| env.node_name(&format!("n-{k}"))).collect();
    for (k, name) in names.iter().enumerate() {
        config.instances.push(instance(&format!("i-{k}"), name, "zone-a"));
        NodeBuilder::new(name)
            .label(TEST_LABEL, &env.prefix)
            .label("topology.kubernetes.io/zone", "zone-a")
            .provider_id(&format!("sim://zone-a/i-{k}"))
            .create(&env.client)
            .await
            .expect("node");
        ccm_harness::cluster::set_ready(&env.client, name, if k < 4 { "True" } else { "False" }).await.expect("condition");
    }
    let sim = Sim::start(config).await;
    for k in 4..7 {
        sim.admin.instance_action(&format!("i-{k}"), "terminate").await.expect("terminate");
    }
    let mut flags = LEASE_FLAGS.to_vec();
    flags.extend([
        "--controllers=cloud-node-lifecycle",
        "--node-monitor-period=500ms",
        "--max-node-deletions=1",
        "--max-node-deletion-share=1",
        "--node-deletion-window=10m",
    ]);
    let left = async || {
        let mut n = 0;
        for name in &names[4..] {
            n += usize::from(env.nodes().get_opt(name).await.ok()?.is_some());
        }
        Some(n)
    };
    let a = Core::start(cp, &env, &sim, &flags);
    eventually("one gone Node deleted", Duration::from_secs(30), async || (left().await? == 2).then_some(())).await;
    a.stop().await.expect("stops");
    // Another replica leads now (a new process, its own memory): the window is still full.
    let b = Core::start(cp, &env, &sim, &flags);
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.namespace);
    eventually("the new replica leads", Duration::from_secs(20), async || {
        let lease = leases.get_opt(&env.prefix).await.ok().flatten()?;
        lease.spec?.holder_identity.filter(|h| !h.is_empty())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(left().await, Some(2), "no second deletion within the window after the change of leader");
    let lease = leases.get(&env.prefix).await.expect("lease");
    let spent = lease.metadata.annotations.unwrap_or_default();
    assert!(spent.keys().any(|k| k.starts_with("ccm-rs.dev/spent.node-deletions")), "the window is on the Lease: {spent:?}");
    b.stop().await.expect("stops");
    env.cleanup().await.expect("cleanup");
}
