//! A large cluster fits the wire: the load balancer calls for 5000 Nodes, each with the
//! labels a real Node carries (22, as on a managed node group), go from the core's provider client to a provider built on the
//! SDK (the sim) over a real unix socket, although they are larger than gRPC's default 4 MiB.

use std::time::Duration;

use ccm_core::metrics::Metrics;
use ccm_core::provider::Provider;
use ccm_core::provider::convert::LoadBalancerRequest;
use ccm_core::provider::encoded::Backends;
use ccm_proto::v1 as pb;
use ccm_provider_sdk::Listen;
use ccm_provider_sdk::names::{NameLimits, load_balancer_name};
use prost::Message;

const NODES: usize = 5000;

fn node(i: usize) -> pb::LoadBalancerNode {
    let name = format!("ip-10-{}-{}-{}.eu-west-1.compute.internal", i / 65536, (i / 256) % 256, i % 256);
    let mut labels: std::collections::HashMap<String, String> = [
        ("kubernetes.io/arch", "amd64"),
        ("kubernetes.io/os", "linux"),
        ("node.kubernetes.io/instance-type", "m6i.2xlarge"),
        ("topology.kubernetes.io/region", "eu-west-1"),
        ("topology.kubernetes.io/zone", "eu-west-1b"),
        ("eks.amazonaws.com/capacityType", "ON_DEMAND"),
        ("eks.amazonaws.com/nodegroup", "general-purpose-workers"),
        ("eks.amazonaws.com/nodegroup-image", "ami-0123456789abcdef0"),
        ("karpenter.sh/capacity-type", "on-demand"),
        ("team.example.com/owner", "platform-engineering"),
        ("failure-domain.beta.kubernetes.io/zone", "eu-west-1b"),
        ("failure-domain.beta.kubernetes.io/region", "eu-west-1"),
        ("beta.kubernetes.io/arch", "amd64"),
        ("beta.kubernetes.io/os", "linux"),
        ("beta.kubernetes.io/instance-type", "m6i.2xlarge"),
        ("topology.ebs.csi.aws.com/zone", "eu-west-1b"),
        ("topology.k8s.aws/zone-id", "euw1-az3"),
        ("eks.amazonaws.com/sourceLaunchTemplateId", "lt-0a1b2c3d4e5f67890"),
        ("eks.amazonaws.com/sourceLaunchTemplateVersion", "12"),
        ("k8s.io/cloud-provider-aws", "b3f2c1d0e9a8b7c6d5e4f3a2b1c0d9e8"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    labels.insert("kubernetes.io/hostname".into(), name.clone());
    pb::LoadBalancerNode {
        provider_id: format!("sim://sim-region-1a/i-{i:08x}"),
        addresses: vec![
            pb::NodeAddress {
                r#type: pb::NodeAddressType::InternalIp as i32,
                address: format!("10.{}.{}.{}", i / 65536, (i / 256) % 256, i % 256),
            },
            pb::NodeAddress { r#type: pb::NodeAddressType::Hostname as i32, address: name.clone() },
            pb::NodeAddress { r#type: pb::NodeAddressType::InternalDns as i32, address: name.clone() },
        ],
        name,
        labels,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_balancer_calls_for_5000_nodes_fit_the_wire() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("provider.sock");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let endpoints = ccm_provider_sim::Endpoints::provider(Listen::Unix(socket.clone()));
    let sim = tokio::spawn(ccm_provider_sim::run(ccm_provider_sim::Config::default(), endpoints, async move {
        let _ = stopped.await;
    }));
    let provider =
        Provider::new(&format!("unix://{}", socket.display()), Duration::from_secs(30), 4, Metrics::new()).expect("client");
    let mut identity = None;
    for _ in 0..100 {
        if let Ok(i) = provider.refresh().await {
            identity = Some(i);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let caps = identity.expect("the sim answers").capabilities.load_balancers.unwrap_or_default();
    let limits = NameLimits::from_capabilities(&caps);
    let service = pb::LoadBalancerService {
        cluster_name: "big".into(),
        namespace: "default".into(),
        name: "web".into(),
        uid: "3f1c9e0a-0000-4000-8000-000000000001".into(),
        load_balancer_name: load_balancer_name("big", "default", "web", "3f1c9e0a-0000-4000-8000-000000000001", &limits),
        ports: vec![pb::ServicePort { port: 80, node_port: 30080, protocol: pb::Protocol::Tcp as i32, ..Default::default() }],
        ..Default::default()
    };
    let nodes: Vec<pb::LoadBalancerNode> = (0..NODES).map(node).collect();
    let request = pb::EnsureLoadBalancerRequest { service: Some(service.clone()), nodes: nodes.clone() };
    let size = request.encoded_len();
    assert!(size > 4 << 20, "the test means something only above gRPC's default limit: {size} bytes");

    let service = LoadBalancerRequest::from_proto(service);
    let ingress = provider
        .fenced(None)
        .ensure_load_balancer(service.clone(), &Backends::from_proto(nodes.clone()))
        .await
        .expect("ensure for 5000 nodes");
    assert!(!ingress.is_empty(), "the load balancer has an address");
    let mut fewer = nodes;
    fewer.truncate(NODES - 1);
    provider
        .fenced(None)
        .update_load_balancer_hosts(service, &Backends::from_proto(fewer))
        .await
        .expect("update hosts for 4999 nodes");
    println!("EnsureLoadBalancer for {NODES} Nodes: {:.1} MiB on the wire", size as f64 / (1 << 20) as f64);
    let _ = stop.send(());
    let _ = sim.await;
}
