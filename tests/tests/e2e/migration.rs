//! Moving between upstream's cloud-controller-manager and ours keeps every load balancer:
//! upstream's (the peer in `harness/peer/`: `k8s.io/cloud-provider`'s controllers, unchanged,
//! against the same sim) makes a Service's load balancer, our core takes it over (the same
//! load balancer, the same address, hosts never empty), then upstream's takes it back. Each
//! runs on a control plane of the test's own: upstream's controllers handle every Service and
//! Node of a cluster.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ccm_harness::ControlPlane;
use ccm_harness::cluster::{TestEnv, create_load_balancer_service, set_ready};
use ccm_provider_sim::Config;
use ccm_provider_sim::admin::LoadBalancerView;

use crate::support::{Core, Sim, eventually, instance};

/// Upstream's cloud-controller-manager with only its service controller, on `sim`.
struct Upstream(std::process::Child);

impl Upstream {
    fn start(cp: &ControlPlane, sim: &Sim, dir: &std::path::Path) -> Self {
        let peer = ccm_harness::Assets::tool("peer").expect("upstream's peer (harness/envtest/setup.sh peer)");
        let config = dir.join("cloud.yaml");
        std::fs::write(&config, format!("endpoint: {}\n", sim.endpoint)).expect("cloud config");
        let log = std::fs::File::create(dir.join("upstream.log")).expect("log");
        let child = std::process::Command::new(peer)
            .args([
                "--cloud-provider=ccm-rs-grpc".to_string(),
                format!("--cloud-config={}", config.display()),
                format!("--kubeconfig={}", cp.kubeconfig_path().display()),
                "--controllers=service-lb-controller".into(),
                "--leader-elect=false".into(),
                "--secure-port=0".into(),
                "--v=1".into(),
            ])
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("starting upstream's cloud-controller-manager");
        Self(child)
    }

    fn stop(mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        let _ = self.0.kill();
    }
}

async fn lbs(sim: &Sim) -> Vec<LoadBalancerView> {
    sim.admin.state().await.expect("sim state").load_balancers
}

async fn ingress(env: &TestEnv, name: &str) -> Option<String> {
    let svc = env.services().get(name).await.ok()?;
    svc.status?.load_balancer?.ingress?.first()?.ip.clone()
}

async fn backend(env: &TestEnv, name: &str, id: &str) {
    crate::services::backend_node(env, name, id).await;
    set_ready(&env.client, name, "True").await.expect("ready");
}

/// Watches the sim's load balancers every 50 ms: the fewest hosts any of them had, and every
/// name seen.
fn watch_hosts(sim: &Sim) -> (Arc<AtomicUsize>, Arc<std::sync::Mutex<BTreeSet<String>>>, tokio::task::JoinHandle<()>) {
    let fewest = Arc::new(AtomicUsize::new(usize::MAX));
    let names = Arc::new(std::sync::Mutex::new(BTreeSet::new()));
    let admin = sim.admin.clone();
    let (f, n) = (fewest.clone(), names.clone());
    let task = tokio::spawn(async move {
        loop {
            if let Ok(state) = admin.state().await {
                for lb in state.load_balancers {
                    f.fetch_min(lb.nodes.len(), Ordering::Relaxed);
                    n.lock().expect("names").insert(lb.name);
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    (fewest, names, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_balancers_survive_a_move_from_upstream_and_back() {
    let cp = tokio::task::spawn_blocking(ControlPlane::start).await.expect("join").expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "migrate").await.expect("env");
    let dir = tempfile::tempdir().expect("tempdir");
    let nodes: Vec<String> = (1..=4).map(|i| env.node_name(&format!("n{i}"))).collect();
    let mut config = Config::default();
    for (i, n) in nodes.iter().enumerate() {
        config.instances.push(instance(&format!("i-{i}"), n, "sim-region-1a"));
    }
    let sim = Sim::start(config).await;
    backend(&env, &nodes[0], "i-0").await;
    backend(&env, &nodes[1], "i-1").await;

    // Upstream's makes the load balancer.
    let upstream = Upstream::start(&cp, &sim, dir.path());
    let svc = create_load_balancer_service(&env, "web", &[80]).await.expect("service");
    let uid = svc.metadata.uid.clone().expect("uid");
    let ip = eventually("upstream's load balancer", Duration::from_secs(60), async || ingress(&env, "web").await).await;
    let made = lbs(&sim).await;
    assert_eq!(made.len(), 1);
    let name = made[0].name.clone();
    assert_eq!(name, format!("a{}", uid.replace('-', "")).chars().take(32).collect::<String>(), "upstream's naming");
    upstream.stop();

    // Ours takes it over: the same load balancer and address, its hosts never empty, and a
    // Node added afterwards reaches it.
    let (fewest, seen, watcher) = watch_hosts(&sim);
    let core = Core::start_as(cp.kubeconfig_path(), &env, &sim, &["--leader-elect=false", "--controllers=service"]);
    backend(&env, &nodes[2], "i-2").await;
    eventually("the new Node a host of the same load balancer", Duration::from_secs(30), async || {
        let l = lbs(&sim).await;
        (l.len() == 1 && l[0].name == name && l[0].nodes.contains(&nodes[2])).then_some(())
    })
    .await;
    assert_eq!(ingress(&env, "web").await.as_deref(), Some(ip.as_str()), "the address did not change");
    let recorded = env.services().get("web").await.expect("service").metadata.annotations.unwrap_or_default();
    assert_eq!(recorded.get("ccm-rs.dev/load-balancer-name"), Some(&name), "the name is recorded on the Service");
    core.stop().await.expect("core stops");

    // And back to upstream's.
    let upstream = Upstream::start(&cp, &sim, dir.path());
    backend(&env, &nodes[3], "i-3").await;
    eventually("upstream's updates the same load balancer", Duration::from_secs(60), async || {
        let l = lbs(&sim).await;
        (l.len() == 1 && l[0].name == name && l[0].nodes.contains(&nodes[3])).then_some(())
    })
    .await;
    assert_eq!(ingress(&env, "web").await.as_deref(), Some(ip.as_str()), "the address did not change");
    upstream.stop();
    watcher.abort();
    assert!(fewest.load(Ordering::Relaxed) >= 2, "the load balancer's hosts never dropped below the two it had");
    assert_eq!(*seen.lock().expect("names"), BTreeSet::from([name]), "no other load balancer was ever made");
}
