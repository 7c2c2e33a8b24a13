//! The go-adapter serving upstream's fake cloud (`k8s.io/cloud-provider/fake`, as
//! `ccm-provider-fake`): the conformance suite against the adapter on a cloud that is not AWS.

use std::time::Duration;

use ccm_harness::assets::Assets;
use ccm_provider_sdk::conformance::Options;

use ccm_harness::aws::Sidecar;

use crate::aws::{REQUIRE, assert_conformant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_conformance_suite_passes_against_upstreams_fake_cloud_behind_the_adapter() {
    let names: Vec<String> = (1..=3).map(|k| format!("fake-node-{k}")).collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(sidecar) = fake_cloud(dir.path(), &names).await else { return };
    let mut options = Options::new(sidecar.endpoint.clone());
    options.call_timeout = Duration::from_secs(10);
    options.instances = names;
    // Identity, instances (through the batch read too), routes and load balancers answer.
    assert_conformant(&options, &sidecar, 45).await;
}

/// `ccm-provider-fake` serving upstream's fake cloud with an instance per Node name
/// (`fake://<name>`, InternalIP 10.0.0.<k>), its config in `dir`; `None` (and a skip line)
/// without Go, unless CI requires it.
pub(crate) async fn fake_cloud(dir: &std::path::Path, names: &[String]) -> Option<Sidecar> {
    let binary = match Assets::tool("fake-provider") {
        Ok(b) => b,
        Err(e) if std::env::var_os(REQUIRE).is_some() => panic!("{REQUIRE} is set and ccm-provider-fake is missing: {e:#}"),
        Err(e) => {
            eprintln!("skipped: the fake cloud's sidecar needs Go: {e:#}");
            return None;
        }
    };
    let instances: Vec<serde_json::Value> = names
        .iter()
        .enumerate()
        .map(|(k, name)| {
            serde_json::json!({
                "name": name,
                "providerID": format!("fake://{name}"),
                "type": "fake.large",
                "addresses": [{ "type": "InternalIP", "address": format!("10.0.0.{}", k + 1) }],
            })
        })
        .collect();
    let config =
        serde_json::json!({ "zone": "zone-a", "region": "region-1", "externalIP": "203.0.113.10", "instances": instances });
    let path = dir.join("cloud.json");
    std::fs::write(&path, config.to_string()).expect("cloud config");
    let args = ["--cloud-provider=fake".to_string(), format!("--cloud-config={}", path.display())];
    Some(Sidecar::run(&binary, dir, &args, &[]).await.expect("ccm-provider-fake"))
}
