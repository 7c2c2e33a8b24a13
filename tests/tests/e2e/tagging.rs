//! The tagging controller (`--instance-tags`, `--instance-tags-from-labels`), end to end: real
//! API server, the core, the sim over a unix socket. The cluster's tags and allow-listed labels
//! reach every instance in one BatchSetInstanceTags per 500 Nodes; only the keys the controller
//! wrote (recorded on the Node) are ever updated or removed; someone else's value is left alone.

use std::collections::BTreeMap;
use std::time::Duration;

use ccm_harness::cluster::{NodeBuilder, TestEnv};
use ccm_provider_sim::Config;
use k8s_openapi::api::core::v1::Event;
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};

use crate::support::{Core, Sim, TEST_LABEL, eventually, instance};

const RECORD: &str = "ccm-rs.dev/instance-tags";

async fn node(env: &TestEnv, name: &str, id: &str, labels: &[(&str, &str)]) {
    let mut b = NodeBuilder::new(name)
        .label(TEST_LABEL, &env.prefix)
        .provider_id(&format!("sim://sim-region-1a/{id}"))
        .address("InternalIP", "10.0.0.9");
    for (k, v) in labels {
        b = b.label(k, v);
    }
    b.create(&env.client).await.expect("node");
}

/// Every instance's tags, by instance id.
async fn tags(sim: &Sim) -> BTreeMap<String, BTreeMap<String, String>> {
    sim.admin.state().await.expect("state").instances.into_iter().map(|i| (i.id, i.tags)).collect()
}

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

async fn record(env: &TestEnv, name: &str) -> Option<String> {
    let n = env.nodes().get(name).await.ok()?;
    n.metadata.annotations?.get(RECORD).cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clusters_tags_reach_every_instance_and_only_its_own_keys_change() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "tagging").await.expect("env");
    let (a, b) = (env.node_name("a"), env.node_name("b"));
    let mut config = Config::default();
    config.instances.push(instance("i-a", &a, "sim-region-1a"));
    let mut theirs = instance("i-b", &b, "sim-region-1a");
    // Someone else's tags: `env` with another value, `owner` with the same value.
    theirs.tags = map(&[("env", "staging"), ("owner", "platform"), ("keep", "me")]);
    config.instances.push(theirs);
    let sim = Sim::start(config).await;
    node(&env, &a, "i-a", &[("team", "payments")]).await;
    node(&env, &b, "i-b", &[]).await;
    let first = [
        "--leader-elect=false",
        "--controllers=tagging",
        "--instance-tags=env=prod,owner=platform",
        "--instance-tags=cost-center=42",
        "--instance-tags-from-labels=team",
    ];
    let core = Core::start(cp, &env, &sim, &first);
    let want = BTreeMap::from([
        ("i-a".to_string(), map(&[("env", "prod"), ("owner", "platform"), ("cost-center", "42"), ("team", "payments")])),
        ("i-b".to_string(), map(&[("env", "staging"), ("owner", "platform"), ("keep", "me"), ("cost-center", "42")])),
    ]);
    eventually("the cluster's tags on both instances", Duration::from_secs(20), async || {
        (tags(&sim).await == want).then_some(())
    })
    .await;
    assert_eq!(record(&env, &a).await.as_deref(), Some("cost-center,env,owner,team"));
    assert_eq!(record(&env, &b).await.as_deref(), Some("cost-center"), "b's env and owner are not ours");
    let conflict = eventually("b's conflict reported", Duration::from_secs(10), async || {
        let events: Api<Event> = Api::all(env.client.clone());
        let list = events.list(&ListParams::default().fields(&format!("involvedObject.name={b}"))).await.ok()?;
        list.items.into_iter().find(|e| e.reason.as_deref() == Some("InstanceTagConflict")).and_then(|e| e.message)
    })
    .await;
    assert!(conflict.contains("\"env\"") && conflict.contains("staging"), "{conflict}");
    let sets = sim.admin.call_count("TagsService/BatchSetInstanceTags").await.expect("calls");
    assert_eq!(sets, 1, "both instances in one call");

    // An allow-listed label changes: its tag follows.
    let patch = serde_json::json!({ "metadata": { "labels": { "team": "risk" } } });
    env.nodes().patch(&a, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("label");
    eventually("the label's new value on the instance", Duration::from_secs(10), async || {
        (tags(&sim).await["i-a"].get("team").map(String::as_str) == Some("risk")).then_some(())
    })
    .await;
    core.stop().await.expect("stop");

    // The flags change: cost-center dropped (removed where we wrote it), env changed (updated
    // where ours, still left alone where not); tags nobody asked for stay.
    let second = ["--leader-elect=false", "--controllers=tagging", "--instance-tags=env=prod2,owner=platform"];
    let core = Core::start(cp, &env, &sim, &second);
    let want = BTreeMap::from([
        ("i-a".to_string(), map(&[("env", "prod2"), ("owner", "platform")])),
        ("i-b".to_string(), map(&[("env", "staging"), ("owner", "platform"), ("keep", "me")])),
    ]);
    eventually("the dropped key removed, the changed one updated", Duration::from_secs(20), async || {
        (tags(&sim).await == want).then_some(())
    })
    .await;
    // `team` was ours too, and its label is no longer allow-listed: removed as well.
    eventually("the records follow", Duration::from_secs(10), async || {
        let (ra, rb) = (record(&env, &a).await, record(&env, &b).await);
        (ra.as_deref() == Some("env,owner") && rb.is_none()).then_some(())
    })
    .await;
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}
