//! What `ccm-node-metadata` writes for the kubelet, read by the kubelet's own code of the
//! release the harness pins (`harness/envtest/cmd/kubelet-check`): the drop-in through the
//! kubelet's --config-dir loader, and the credential provider executed by the kubelet's exec
//! plugin runner from a CredentialProviderConfig.

mod common;

use std::path::{Path, PathBuf};

use common::{BIN, Node, run, text};

/// Builds (first time) and finds kubelet-check with the harness's script.
fn kubelet_check() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../harness/envtest/setup.sh");
    let out = std::process::Command::new("bash").arg(&script).arg("kubelet-check").output().expect("run setup.sh");
    assert!(out.status.success(), "setup.sh kubelet-check: {}", text(&out.stderr));
    PathBuf::from(text(&out.stdout).trim())
}

async fn kubelet(args: &[&str]) -> (bool, String, String) {
    let bin = tokio::task::spawn_blocking(kubelet_check).await.expect("join");
    let out = tokio::process::Command::new(bin).args(args).output().await.expect("run kubelet-check");
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubelet_loads_the_drop_in() {
    let node = Node::start().await;
    let dir = node.path("kubelet.conf.d");
    std::fs::create_dir_all(&dir).expect("dir");
    // Another drop-in the operator has; ours merges with it.
    std::fs::write(
        dir.join("00-base.conf"),
        "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nmaxPods: 50\n",
    )
    .expect("base");
    let out = dir.join("50-cloud.conf").display().to_string();
    let wrote = run(&["kubelet-config", "--endpoint", &node.endpoint(), "--out", &out], None).await;
    assert!(wrote.status.success(), "{}", text(&wrote.stderr));

    let (ok, stdout, stderr) = kubelet(&["config-dir", &dir.display().to_string()]).await;
    assert!(ok, "the kubelet refuses the drop-in: {stderr}");
    assert_eq!(stdout.trim(), "sim://sim-region-1b/i-node", "the kubelet reads our providerID");

    // The check is not blind: a misspelt field is refused.
    std::fs::write(
        dir.join("60-typo.conf"),
        "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nproviderId: x\n",
    )
    .expect("typo");
    let (ok, _, stderr) = kubelet(&["config-dir", &dir.display().to_string()]).await;
    assert!(!ok && stderr.contains("providerId"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubelet_gets_registry_credentials_through_the_credential_provider() {
    let mut node = Node::start().await;

    // A request from a JSON file to a response on stdout, as the kubelet exchanges them.
    let request_file = node.path("request.json");
    std::fs::write(
        &request_file,
        r#"{"apiVersion":"credentialprovider.kubelet.k8s.io/v1","kind":"CredentialProviderRequest","image":"eu.registry.sim.dev/team/app:1.2"}"#,
    )
    .expect("request");
    let request = std::fs::read(&request_file).expect("read");
    let out = run(&["credential-provider", "--endpoint", &node.endpoint()], Some(&request)).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let response: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(response["kind"], "CredentialProviderResponse");

    // The kubelet's exec plugin runner executes the binary, as configured in a
    // CredentialProviderConfig, and finds the credentials for the image.
    let bin_dir = node.path("credential-providers");
    std::fs::create_dir_all(&bin_dir).expect("bin dir");
    std::os::unix::fs::symlink(BIN, bin_dir.join("ccm-node-metadata")).expect("link");
    let config = node.path("credential-provider-config.yaml");
    std::fs::write(
        &config,
        format!(
            "apiVersion: kubelet.config.k8s.io/v1\n\
             kind: CredentialProviderConfig\n\
             providers:\n\
             - name: ccm-node-metadata\n\
             \x20 apiVersion: credentialprovider.kubelet.k8s.io/v1\n\
             \x20 matchImages: [\"*.registry.sim.dev\", \"*.other.sim.dev\"]\n\
             \x20 defaultCacheDuration: 10m\n\
             \x20 args: [credential-provider, --endpoint, \"{}\", --timeout, 5s]\n",
            node.endpoint()
        ),
    )
    .expect("config");
    let args = ["credentials", &config.display().to_string(), &bin_dir.display().to_string(), "eu.registry.sim.dev/team/app:1.2"];
    let (ok, stdout, stderr) = kubelet(&args).await;
    assert!(ok && !stderr.contains("Failed"), "the kubelet's credential provider failed: {stderr}");
    let found: serde_json::Value = serde_json::from_str(&stdout).expect("json");
    assert_eq!(found, serde_json::json!([{ "username": "instance-role", "password": "pw-SECRET-1" }]));

    // An image the kubelet asks about but the cloud has nothing for: no credentials, no error.
    let other = ["credentials", &config.display().to_string(), &bin_dir.display().to_string(), "eu.other.sim.dev/app"];
    let (ok, stdout, stderr) = kubelet(&other).await;
    assert!(ok && !stderr.contains("Failed"), "the kubelet accepts an answer without credentials: {stderr}");
    assert_eq!(stdout.trim(), "[]");

    // With the plugin gone, the kubelet's log says why in our words, and no secret leaks.
    node.stop_plugin().await;
    let (_, stdout, stderr) = kubelet(&args).await;
    assert_eq!(stdout.trim(), "[]");
    assert!(stderr.contains("is the plugin running on this node?"), "{stderr}");
    assert!(!stderr.contains("pw-SECRET"));
}
