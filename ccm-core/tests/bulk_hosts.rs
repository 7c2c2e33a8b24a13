//! Load balancer calls over a real unix socket to the sim. BatchUpdateLoadBalancerHosts: more
//! load balancers than one call takes go out as several calls at the same time, and each
//! item's answer lands on its own Service. Node sets larger than HTTP/2's windows, sent by
//! many calls at once from one shared buffer, arrive whole and in order.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ccm_core::metrics::Metrics;
use ccm_core::provider::Provider;
use ccm_core::provider::convert::LoadBalancerRequest;
use ccm_core::provider::encoded::Backends;
use ccm_provider_sdk::proto as pb;
use ccm_provider_sdk::{Listen, ProviderServer};
use ccm_provider_sim::cloud::Cloud;
use ccm_provider_sim::config::Config;
use ccm_provider_sim::provider::SimProvider;

const LATENCY: Duration = Duration::from_millis(500);

fn service(i: usize) -> pb::LoadBalancerService {
    pb::LoadBalancerService {
        namespace: "ns".into(),
        name: format!("web-{i}"),
        load_balancer_name: format!("lb-{i}"),
        ports: vec![pb::ServicePort { port: 80, protocol: pb::Protocol::Tcp as i32, ..Default::default() }],
        ..Default::default()
    }
}

fn node(name: &str) -> pb::LoadBalancerNode {
    pb::LoadBalancerNode { name: name.into(), ..Default::default() }
}

/// The sim served by the provider SDK on a unix socket, and the core's client of it.
struct Served {
    provider: Provider,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), ccm_provider_sdk::server::ServeError>>,
    _dir: tempfile::TempDir,
}

impl Served {
    async fn start(cloud: Arc<Cloud>) -> Self {
        let dir = tempfile::tempdir().expect("dir");
        let sock = dir.path().join("sim.sock");
        let server = ProviderServer::new("sim.example.com", "0.0.1").load_balancers(Arc::new(SimProvider::new(cloud)));
        let listen = Listen::Unix(sock.clone());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            server
                .serve_with_shutdown(&listen, async move {
                    let _ = stopped.await;
                })
                .await
        });
        for _ in 0..100 {
            if sock.exists() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let provider =
            Provider::new(&format!("unix://{}", sock.display()), Duration::from_secs(30), 8, Metrics::new()).expect("provider");
        Self { provider, stop, task, _dir: dir }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_load_balancers_than_a_call_takes_go_out_at_once_each_answer_on_its_own() {
    let mut config = Config::default();
    config.load_balancers.bulk_hosts = true;
    config.load_balancers.address_pool = vec!["10.128.0.0/20".into()];
    config.api.latency_ms = LATENCY.as_millis() as u64;
    let cloud = Arc::new(Cloud::new(&config).expect("cloud"));
    // 1200 load balancers on one node; the Service at 700 has none (NOT_FOUND for it alone).
    let services: Vec<pb::LoadBalancerService> = (0..1200).map(service).collect();
    for s in services.iter().filter(|s| s.name != "web-700") {
        cloud.ensure_load_balancer(s, &[node("a")]).expect("ensure");
    }
    let served = Served::start(cloud.clone()).await;
    let provider = &served.provider;

    let started = Instant::now();
    let requests: Vec<LoadBalancerRequest> = services.iter().cloned().map(LoadBalancerRequest::from_proto).collect();
    let backends = Backends::from_proto(vec![node("a"), node("b")]);
    let (results, failed) = provider.fenced(None).batch_update_load_balancer_hosts(&requests, &backends).await;
    assert!(failed.is_none(), "every call answered: {failed:?}");
    let took = started.elapsed();

    // Three calls (500, 500, 200) of 500 ms each: one after the other would take 1.5 s.
    assert!(took < LATENCY * 2, "the calls went out at once: {took:?}");
    assert_eq!(results.len(), services.len(), "one answer per Service");
    for (i, result) in results.iter().enumerate() {
        if i == 700 {
            assert!(matches!(result, Err(ccm_protocol::Error::NotFound { .. })), "web-700's own answer: {result:?}");
        } else {
            assert!(result.is_ok(), "web-{i}: {result:?}");
        }
    }
    let hosts = cloud.hosts_summary();
    assert_eq!(hosts.len(), 1199);
    assert!(hosts.iter().all(|h| h.hosts == 2), "every load balancer has both nodes");
    served.stop().await;
}

/// A Node as a large cluster's: a provider ID, two addresses, a dozen labels.
fn big_node(i: usize) -> pb::LoadBalancerNode {
    pb::LoadBalancerNode {
        name: format!("ip-10-{}-{}-{}.ec2.internal", i / 65536, (i / 256) % 256, i % 256),
        provider_id: format!("aws:///us-east-1a/i-{i:017x}"),
        addresses: vec![
            pb::NodeAddress {
                r#type: pb::NodeAddressType::InternalIp as i32,
                address: format!("10.{}.{}.{}", i / 65536, (i / 256) % 256, i % 256),
            },
            pb::NodeAddress { r#type: pb::NodeAddressType::Hostname as i32, address: format!("node-{i}") },
        ],
        labels: (0..12).map(|l| (format!("example.com/label-{l}"), format!("value-{}", (i + l) % 7))).collect(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_sets_larger_than_the_transport_windows_arrive_whole_from_many_calls_at_once() {
    let mut config = Config::default();
    config.load_balancers.address_pool = vec!["10.128.0.0/20".into()];
    let cloud = Arc::new(Cloud::new(&config).expect("cloud"));
    let served = Served::start(cloud.clone()).await;
    let provider = served.provider.fenced(None);

    // 12,000 Nodes encode to a few MiB: more than HTTP/2's default windows, so each body is
    // sent in many frames while the others wait.
    let nodes: Vec<pb::LoadBalancerNode> = (0..12_000).map(big_node).collect();
    let backends = Backends::from_proto(nodes.clone());
    let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
    let services: Vec<pb::LoadBalancerService> = (0..12).map(service).collect();
    let ensures = services.iter().map(|s| provider.ensure_load_balancer(LoadBalancerRequest::from_proto(s.clone()), &backends));
    for (s, result) in services.iter().zip(futures::future::join_all(ensures).await) {
        let ingress = result.unwrap_or_else(|e| panic!("{}: {e}", s.name));
        assert!(!ingress.is_empty(), "{}: an address", s.name);
    }
    for s in &services {
        let mut hosts = cloud.load_balancer_hosts(&s.load_balancer_name).expect("the sim reports hosts");
        hosts.sort();
        let mut want = names.clone();
        want.sort();
        assert_eq!(hosts.len(), want.len(), "{}: every node", s.name);
        assert!(hosts == want, "{}: the node set arrived as sent", s.name);
    }

    // Half the nodes, by single and batched updates at once.
    let half = Backends::from_proto(nodes[..6000].to_vec());
    let singles =
        services[..6].iter().map(|s| provider.update_load_balancer_hosts(LoadBalancerRequest::from_proto(s.clone()), &half));
    let batch: Vec<LoadBalancerRequest> = services[6..].iter().cloned().map(LoadBalancerRequest::from_proto).collect();
    let (singles, (batched, failed)) =
        tokio::join!(futures::future::join_all(singles), provider.batch_update_load_balancer_hosts(&batch, &half));
    assert!(singles.iter().all(Result::is_ok), "{singles:?}");
    assert!(failed.is_none() && batched.iter().all(Result::is_ok), "{failed:?}");
    for s in &services {
        let hosts = cloud.load_balancer_hosts(&s.load_balancer_name).expect("hosts");
        assert_eq!(hosts.len(), 6000, "{}: the smaller set", s.name);
    }
    served.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_set_over_the_message_limit_is_refused_with_a_clear_error_and_changes_nothing() {
    let mut config = Config::default();
    config.load_balancers.address_pool = vec!["10.128.0.0/20".into()];
    let cloud = Arc::new(Cloud::new(&config).expect("cloud"));
    let served = Served::start(cloud.clone()).await;
    let provider = served.provider.fenced(None);
    let web = service(0);
    provider
        .ensure_load_balancer(LoadBalancerRequest::from_proto(web.clone()), &Backends::from_proto(vec![big_node(0)]))
        .await
        .expect("a small ensure");

    // Each node carries a 1 MiB label: 70 of them are over the 64 MiB a message may have.
    let huge: Vec<pb::LoadBalancerNode> = (0..70)
        .map(|i| {
            let mut n = big_node(i);
            n.labels.insert("example.com/blob".into(), "x".repeat(1 << 20));
            n
        })
        .collect();
    let started = Instant::now();
    let error = provider
        .update_load_balancer_hosts(LoadBalancerRequest::from_proto(web.clone()), &Backends::from_proto(huge))
        .await
        .expect_err("over the limit");
    assert!(started.elapsed() < Duration::from_secs(10), "refused, not timed out");
    assert!(error.to_string().contains("a message may have"), "says why: {error}");
    assert_eq!(cloud.load_balancer_hosts(&web.load_balancer_name).expect("hosts").len(), 1, "the load balancer is unchanged");
    served.stop().await;
}
