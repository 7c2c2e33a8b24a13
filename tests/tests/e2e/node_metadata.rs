//! Nodes that register with what the node plugin says: the kubelet's flags come from
//! `ccm-node-metadata` (its library) reading the sim's plugin over a real unix socket; the
//! Node is created with the kubelet's own identity under the Node authorizer and
//! NodeRestriction; the core verifies it with one batch read and corrects a wrong claim.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use ccm_harness::cluster::{NodeBuilder, TestEnv, UNINITIALIZED_TAINT};
use ccm_node_metadata::{KubeletFlags, Plugin};
use ccm_provider_sdk::Listen;
use ccm_provider_sim::Config;
use ccm_provider_sim::config::Address;
use k8s_openapi::api::core::v1::{Event, Node};
use kube::Api;
use kube::api::ListParams;
use tokio::sync::oneshot;

use crate::support::{Core, Sim, TEST_LABEL, eventually, instance};

/// The sim's node plugin for one instance, on its own socket.
struct NodePlugin {
    endpoint: String,
    _stop: oneshot::Sender<()>,
}

impl NodePlugin {
    async fn start(sim: &Sim, instance_id: &str) -> Self {
        let socket: PathBuf = sim.metadata_socket().with_file_name(format!("plugin-{instance_id}.sock"));
        let plugin =
            ccm_provider_sim::plugin::NodePlugin::new(format!("unix://{}", sim.metadata_socket().display()), instance_id);
        let (tx, rx) = oneshot::channel::<()>();
        tokio::spawn(ccm_provider_sim::plugin::run("sim.cloudprovider.dev", plugin, Listen::Unix(socket.clone()), async move {
            let _ = rx.await;
        }));
        for _ in 0..500 {
            if tokio::net::UnixStream::connect(&socket).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Self { endpoint: format!("unix://{}", socket.display()), _stop: tx }
    }

    /// What `ccm-node-metadata kubelet-flags` prints.
    async fn kubelet_flags(&self) -> Vec<String> {
        let plugin = Plugin::connect(&self.endpoint, Duration::from_secs(5)).await.expect("connect to the plugin");
        KubeletFlags::from_metadata(&plugin.node_metadata().await.expect("metadata")).args()
    }
}

/// Registers `name` as a kubelet started with `--cloud-provider=external` and `flags` would:
/// its own identity, the flags' providerID and labels, the provided node IP annotation, the
/// uninitialized taint, its hostname.
async fn register_as_kubelet(env: &TestEnv, kubelet: &kube::Client, name: &str, flags: &[String]) -> anyhow::Result<Node> {
    let mut node = NodeBuilder::new(name)
        .uninitialized()
        .label(TEST_LABEL, &env.prefix)
        .label("kubernetes.io/hostname", name)
        .label("kubernetes.io/os", "linux")
        .label("kubernetes.io/arch", "amd64")
        .address("Hostname", name);
    for flag in flags {
        let (key, value) = flag.split_once('=').expect("--flag=value");
        match key {
            "--provider-id" => node = node.provider_id(value),
            "--node-ip" => node = node.annotation("alpha.kubernetes.io/provided-node-ip", value),
            "--node-labels" => {
                for pair in value.split(',') {
                    let (k, v) = pair.split_once('=').expect("k=v");
                    node = node.label(k, v);
                }
            }
            other => panic!("unexpected kubelet flag {other}"),
        }
    }
    node.create(kubelet).await
}

async fn initialised(env: &TestEnv, name: &str) -> Option<Node> {
    let node = env.nodes().get_opt(name).await.ok().flatten()?;
    let tainted =
        node.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == UNINITIALIZED_TAINT));
    (!tainted).then_some(node)
}

fn labels(node: &Node) -> BTreeMap<String, String> {
    node.metadata.labels.clone().unwrap_or_default()
}

async fn calls(sim: &Sim, method: &str) -> u64 {
    sim.admin.call_count(&format!("InstancesService/{method}")).await.expect("calls")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_registered_with_plugin_metadata_are_verified_with_one_batch_read() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "nodemeta").await.expect("env");
    let honest = env.node_name("honest");
    let liar = env.node_name("liar");
    let mut config = Config::default();
    let mut spec = instance("i-honest", &honest, "sim-region-1b");
    spec.addresses = vec![
        Address { kind: "InternalIP".into(), address: "10.3.0.5".into() },
        Address { kind: "ExternalIP".into(), address: "198.51.100.35".into() },
    ];
    config.instances.push(spec);
    config.instances.push(instance("i-liar", &liar, "sim-region-1a"));
    let sim = Sim::start(config).await;
    let honest_plugin = NodePlugin::start(&sim, "i-honest").await;
    let liar_plugin = NodePlugin::start(&sim, "i-liar").await;

    let flags = honest_plugin.kubelet_flags().await;
    assert_eq!(
        flags,
        vec![
            "--provider-id=sim://sim-region-1b/i-honest".to_string(),
            "--node-ip=10.3.0.5".to_string(),
            "--node-labels=node.kubernetes.io/instance-type=sim.large,topology.kubernetes.io/region=sim-region-1,topology.kubernetes.io/zone=sim-region-1b".to_string(),
        ]
    );

    let kubelet = cp.client_as(&format!("system:node:{honest}"), Some("system:nodes")).await.expect("kubelet client");
    // NodeRestriction is really on: a label a kubelet may not set on itself is refused, so
    // the registration below proves our labels are ones a kubelet may set.
    let refused = NodeBuilder::new(&honest)
        .label(TEST_LABEL, &env.prefix)
        .label("node-restriction.kubernetes.io/pool", "a")
        .create(&kubelet)
        .await
        .expect_err("NodeRestriction refuses a restricted label");
    assert!(format!("{refused:#}").contains("forbidden"), "{refused:#}");

    let core = Core::start(cp, &env, &sim, &["--leader-elect=false"]);
    sim.admin.reset_calls().await.expect("reset");
    register_as_kubelet(&env, &kubelet, &honest, &flags).await.expect("the kubelet registers its Node");
    let node = eventually("the kubelet-registered node is initialised", Duration::from_secs(30), async || {
        initialised(&env, &honest).await
    })
    .await;
    let l = labels(&node);
    assert_eq!(l.get("topology.kubernetes.io/zone").map(String::as_str), Some("sim-region-1b"));
    assert_eq!(l.get("node.kubernetes.io/instance-type").map(String::as_str), Some("sim.large"));
    assert_eq!(node.spec.as_ref().and_then(|s| s.provider_id.as_deref()), Some("sim://sim-region-1b/i-honest"));
    let addresses: Vec<String> =
        node.status.clone().unwrap_or_default().addresses.unwrap_or_default().into_iter().map(|a| a.address).collect();
    assert_eq!(addresses.first().map(String::as_str), Some("10.3.0.5"), "the kubelet's node IP first: {addresses:?}");
    assert_eq!(calls(&sim, "InstanceMetadata").await, 0, "no per-node metadata call");
    assert_eq!(calls(&sim, "BatchInstanceMetadata").await, 1, "one batch read covered the node");

    // A kubelet whose flags claim the wrong zone (a stale drop-in, a hand-edited flag).
    let liar_kubelet = cp.client_as(&format!("system:node:{liar}"), Some("system:nodes")).await.expect("kubelet client");
    let lying: Vec<String> = liar_plugin
        .kubelet_flags()
        .await
        .into_iter()
        .map(|f| f.replace("topology.kubernetes.io/zone=sim-region-1a", "topology.kubernetes.io/zone=sim-region-1c"))
        .collect();
    assert!(lying.iter().any(|f| f.contains("zone=sim-region-1c")));
    register_as_kubelet(&env, &liar_kubelet, &liar, &lying).await.expect("the kubelet registers its Node");
    let node =
        eventually("the lying node is initialised", Duration::from_secs(30), async || initialised(&env, &liar).await).await;
    assert_eq!(
        labels(&node).get("topology.kubernetes.io/zone").map(String::as_str),
        Some("sim-region-1a"),
        "corrected from the cloud"
    );
    let events: Api<Event> = Api::all(env.client.clone());
    let selector = format!("involvedObject.name={liar}");
    let event = eventually("a NodeMetadataCorrected event", Duration::from_secs(10), async || {
        let list = events.list(&ListParams::default().fields(&selector)).await.ok()?;
        list.items.into_iter().find(|e| e.reason.as_deref() == Some("NodeMetadataCorrected"))
    })
    .await;
    let message = event.message.unwrap_or_default();
    assert!(message.contains("sim-region-1c") && message.contains("sim-region-1a"), "{message}");
    assert_eq!(event.type_.as_deref(), Some("Warning"));
    assert_eq!(calls(&sim, "InstanceMetadata").await, 0, "still no per-node metadata call");
    assert_eq!(calls(&sim, "BatchInstanceMetadata").await, 2, "one batch read per registration");

    core.stop().await.expect("core stops cleanly");
}
