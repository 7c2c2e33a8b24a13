//! `ccm-node-metadata` (the real binary) against the sim's node plugin over real unix
//! sockets, and against plugins that are absent, slow or answer nonsense.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use ccm_proto::v1 as pb;
use ccm_proto::v1::node_metadata_service_server::{NodeMetadataService, NodeMetadataServiceServer};

use common::{Node, run, text};

/// Runs and expects failure with a message containing `want`.
async fn fails(args: &[&str], want: &str) -> String {
    let out = run(args, None).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "exit 1 for {args:?}; stderr: {stderr}");
    assert!(stderr.contains(want), "stderr of {args:?} should mention {want:?}: {stderr}");
    eprintln!("{stderr}");
    assert!(out.stdout.is_empty(), "nothing on stdout when failing");
    stderr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_flags_and_drop_in_come_from_the_instance_metadata() {
    let node = Node::start().await;
    let endpoint = node.endpoint();
    let out = run(&["kubelet-flags", "--endpoint", &endpoint], None).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "--provider-id=sim://sim-region-1b/i-node --node-ip=10.2.0.7,fd00:2::7 \
         --node-labels=node.kubernetes.io/instance-type=sim.xlarge,topology.kubernetes.io/region=sim-region-1,topology.kubernetes.io/zone=sim-region-1b\n"
    );

    let env_file = node.path("etc/kubelet-cloud.env");
    let env_file_arg = env_file.display().to_string();
    let out = run(&["kubelet-flags", "--endpoint", &endpoint, "--format", "env", "--out", &env_file_arg], None).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let env = std::fs::read_to_string(&env_file).expect("env file");
    assert!(env.starts_with("KUBELET_CLOUD_ARGS=\"--provider-id=sim://sim-region-1b/i-node "), "{env}");

    let drop_in = node.path("kubelet.conf.d/10-cloud.conf");
    let drop_in_arg = drop_in.display().to_string();
    let out = run(&["kubelet-config", "--endpoint", &endpoint, "--out", &drop_in_arg], None).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let content = std::fs::read_to_string(&drop_in).expect("drop-in");
    let body: Vec<&str> = content.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(
        body,
        vec![
            "apiVersion: kubelet.config.k8s.io/v1beta1",
            "kind: KubeletConfiguration",
            "providerID: \"sim://sim-region-1b/i-node\""
        ]
    );
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&drop_in).expect("meta").permissions().mode() & 0o777, 0o644);

    let wrong = node.path("kubelet.conf.d/10-cloud.yaml").display().to_string();
    fails(&["kubelet-config", "--endpoint", &endpoint, "--out", &wrong], "ending in .conf").await;
    let plugin_socket = node.path("plugin/node-metadata.sock");
    let mode = std::fs::metadata(&plugin_socket).expect("socket").permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the plugin's socket is for root only");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_credential_provider_answers_the_kubelet_from_the_plugin() {
    let node = Node::start().await;
    let endpoint = node.endpoint();
    let request = r#"{"apiVersion":"credentialprovider.kubelet.k8s.io/v1","kind":"CredentialProviderRequest","image":"eu.registry.sim.dev/team/app:1.2"}"#;
    let out = run(&["credential-provider", "--endpoint", &endpoint], Some(request.as_bytes())).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let response: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json on stdout");
    assert_eq!(
        response,
        serde_json::json!({
            "apiVersion": "credentialprovider.kubelet.k8s.io/v1",
            "kind": "CredentialProviderResponse",
            "cacheKeyType": "Registry",
            "cacheDuration": "30m0s",
            "auth": { "*.registry.sim.dev": { "username": "instance-role", "password": "pw-SECRET-1" } }
        })
    );
    assert!(!text(&out.stderr).contains("pw-SECRET"), "no secret on stderr");

    // An image of another registry: an answer without credentials, cached briefly.
    let other = request.replace("eu.registry.sim.dev", "quay.io");
    let out = run(&["credential-provider", "--endpoint", &endpoint], Some(other.as_bytes())).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let response: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(response["auth"], serde_json::json!({}));
    assert_eq!(response["cacheDuration"], "1m0s");

    // A request the kubelet would never send.
    let out = run(&["credential-provider", "--endpoint", &endpoint], Some(b"{\"image\":\"x\"}")).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("apiVersion"), "{}", text(&out.stderr));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absent_plugin_or_metadata_service_gives_a_clear_error() {
    let mut node = Node::start().await;
    let missing = format!("unix://{}", node.path("nowhere/node-metadata.sock").display());
    fails(&["kubelet-flags", "--endpoint", &missing], "does not exist (is the plugin running on this node?)").await;

    // A socket file nobody listens on (a plugin that died).
    let stale = node.path("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).expect("bind"));
    let stale = format!("unix://{}", stale.display());
    fails(&["kubelet-flags", "--endpoint", &stale], "cannot connect to the node-metadata plugin").await;

    fails(&["kubelet-flags", "--endpoint", "/no/scheme.sock"], "--endpoint").await;

    // The plugin runs but the metadata service behind it is down.
    node.stop_cloud();
    let endpoint = node.endpoint();
    let stderr = fails(&["kubelet-flags", "--endpoint", &endpoint, "--timeout", "5s"], "Unavailable").await;
    assert!(stderr.contains("metadata service"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_plugin_times_out() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("slow.sock");
    let listener = tokio::net::UnixListener::bind(&path).expect("bind");
    // Accepts connections and never says a word.
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    let endpoint = format!("unix://{}", path.display());
    let started = Instant::now();
    let stderr = fails(&["kubelet-flags", "--endpoint", &endpoint, "--timeout", "700ms"], "within 700ms").await;
    assert!(started.elapsed() < Duration::from_secs(10), "the timeout is honoured: {:?}", started.elapsed());
    assert!(stderr.contains(&endpoint), "{stderr}");
}

/// A plugin (not built on the SDK) that answers whatever it is given.
struct Answers(Option<pb::InstanceMetadata>);

#[tonic::async_trait]
impl NodeMetadataService for Answers {
    async fn get_node_metadata(
        &self,
        _: tonic::Request<pb::GetNodeMetadataRequest>,
    ) -> Result<tonic::Response<pb::GetNodeMetadataResponse>, tonic::Status> {
        Ok(tonic::Response::new(pb::GetNodeMetadataResponse { metadata: self.0.clone() }))
    }
}

async fn serve_answers(dir: &Path, name: &str, answer: Option<pb::InstanceMetadata>) -> String {
    let path = dir.join(name);
    let listener = tokio::net::UnixListener::bind(&path).expect("bind");
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(NodeMetadataServiceServer::new(Answers(answer)))
            .serve_with_incoming(incoming),
    );
    format!("unix://{}", path.display())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_answers_are_refused() {
    let dir = tempfile::tempdir().expect("dir");
    let good = pb::InstanceMetadata {
        instance_id: "i-1".into(),
        provider_id: "sim://zone/i-1".into(),
        zone: "zone".into(),
        ..Default::default()
    };
    let no_scheme =
        serve_answers(dir.path(), "a.sock", Some(pb::InstanceMetadata { provider_id: "i-1".into(), ..good.clone() })).await;
    fails(&["kubelet-flags", "--endpoint", &no_scheme], "invalid node metadata: provider_id \"i-1\" is not <scheme>://<id>")
        .await;
    let bad_zone =
        serve_answers(dir.path(), "b.sock", Some(pb::InstanceMetadata { zone: "zone a".into(), ..good.clone() })).await;
    fails(
        &["kubelet-config", "--endpoint", &bad_zone, "--out", "/tmp/never-written.conf"],
        "zone \"zone a\" is not a valid label value",
    )
    .await;
    assert!(!Path::new("/tmp/never-written.conf").exists(), "nothing is written from an invalid answer");
    let empty = serve_answers(dir.path(), "c.sock", None).await;
    fails(&["kubelet-flags", "--endpoint", &empty], "answered no metadata").await;
    let fine = serve_answers(dir.path(), "d.sock", Some(good)).await;
    let request = r#"{"apiVersion":"credentialprovider.kubelet.k8s.io/v1","kind":"CredentialProviderRequest","image":"registry.sim.dev/app"}"#;
    let out = run(&["credential-provider", "--endpoint", &fine], Some(request.as_bytes())).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("does not serve ImageCredentialsService"), "{}", text(&out.stderr));

    // Not gRPC at all.
    let path = dir.path().join("http.sock");
    let listener = tokio::net::UnixListener::bind(&path).expect("bind");
    tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        while let Ok((mut stream, _)) = listener.accept().await {
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello").await;
        }
    });
    let http = format!("unix://{}", path.display());
    let out = run(&["kubelet-flags", "--endpoint", &http, "--timeout", "3s"], None).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains(&http), "the error names the plugin: {}", text(&out.stderr));
    eprintln!("{}", text(&out.stderr));
}
