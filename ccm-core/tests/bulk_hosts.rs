//! BatchUpdateLoadBalancerHosts over a real unix socket to the sim: more load balancers than
//! one call takes go out as several calls at the same time, and each item's answer lands on
//! its own Service.

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
    let dir = tempfile::tempdir().expect("dir");
    let sock = dir.path().join("sim.sock");
    let server = ProviderServer::new("sim.example.com", "0.0.1").load_balancers(Arc::new(SimProvider::new(cloud.clone())));
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
        Provider::new(&format!("unix://{}", sock.display()), Duration::from_secs(10), 8, Metrics::new()).expect("provider");

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
    let _ = stop.send(());
    let _ = task.await;
}
