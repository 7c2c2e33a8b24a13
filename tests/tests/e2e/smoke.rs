//! The harness itself: a Node travels through a real API server and a kube-rs watcher.

use std::time::Duration;

use ccm_harness::cluster::{NodeBuilder, TestEnv, UNINITIALIZED_TAINT, set_ready};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::DeleteParams;
use kube::runtime::watcher::{self, Event};

async fn next_matching(
    stream: &mut (impl futures::Stream<Item = Result<Event<Node>, watcher::Error>> + Unpin),
    what: &str,
    mut pred: impl FnMut(&Event<Node>) -> bool,
) -> Event<Node> {
    let wait = async {
        while let Some(event) = stream.next().await {
            let event = event.expect("watch event");
            if pred(&event) {
                return event;
            }
        }
        panic!("watch ended before {what}");
    };
    tokio::time::timeout(Duration::from_secs(20), wait).await.unwrap_or_else(|_| panic!("no {what} within 20 s"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_is_created_watched_patched_and_deleted() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "smoke").await.expect("env");
    let name = env.node_name("n1");

    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = watcher::watcher(env.nodes(), config).boxed();
    next_matching(&mut events, "initial list", |e| matches!(e, Event::InitDone)).await;

    NodeBuilder::new(&name)
        .uninitialized()
        .label("topology.kubernetes.io/zone", "z1")
        .pod_cidr("10.244.7.0/24")
        .address("InternalIP", "10.0.0.7")
        .create(&env.client)
        .await
        .expect("create node");

    let seen = next_matching(
        &mut events,
        "the node with its addresses",
        |e| matches!(e, Event::Apply(n) if n.status.as_ref().and_then(|s| s.addresses.as_ref()).is_some_and(|a| !a.is_empty())),
    )
    .await;
    let Event::Apply(node) = seen else { unreachable!() };
    let spec = node.spec.clone().unwrap_or_default();
    assert_eq!(spec.pod_cidrs, Some(vec!["10.244.7.0/24".to_string()]));
    assert!(spec.taints.unwrap_or_default().iter().any(|t| t.key == UNINITIALIZED_TAINT));
    assert_eq!(node.metadata.labels.unwrap_or_default().get("topology.kubernetes.io/zone").map(String::as_str), Some("z1"));

    set_ready(&env.client, &name, "True").await.expect("ready");
    next_matching(&mut events, "Ready=True", |e| {
        matches!(e, Event::Apply(n) if n.status.as_ref().and_then(|s| s.conditions.as_ref()).is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True")))
    })
    .await;
    set_ready(&env.client, &name, "Unknown").await.expect("not ready");
    next_matching(&mut events, "Ready=Unknown", |e| {
        matches!(e, Event::Apply(n) if n.status.as_ref().and_then(|s| s.conditions.as_ref()).is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "Unknown")))
    })
    .await;

    env.nodes().delete(&name, &DeleteParams::default()).await.expect("delete");
    next_matching(
        &mut events,
        "the deletion",
        |e| matches!(e, Event::Delete(n) if n.metadata.name.as_deref() == Some(name.as_str())),
    )
    .await;
    env.cleanup().await.expect("cleanup");
}
