//! The protocol over TCP with mutual TLS, for a provider outside the core's pod: the core
//! (its own flags, against the real API server) initialises a Node through a sim that serves
//! https with a client CA; a client without a certificate, with one of another CA, or over
//! plain http gets nothing.

use std::time::Duration;

use ccm_core::metrics::Metrics;
use ccm_core::provider::Provider;
use ccm_harness::cluster::{NodeBuilder, TestEnv, UNINITIALIZED_TAINT};
use ccm_harness::pki::Ca;
use ccm_provider_sdk::Listen;
use ccm_provider_sdk::tls::TlsFiles;
use ccm_provider_sim::Config;

use crate::support::{Core, TEST_LABEL, eventually, free_port, instance};

fn write(dir: &std::path::Path, name: &str, cert: &str, key: &str, ca: &str) -> TlsFiles {
    let sub = dir.join(name);
    std::fs::create_dir_all(&sub).expect("dir");
    for (file, text) in [("tls.crt", cert), ("tls.key", key), ("ca.crt", ca)] {
        std::fs::write(sub.join(file), text).expect("write");
    }
    TlsFiles::in_dir(&sub)
}

async fn reaches(endpoint: &str, tls: Option<&TlsFiles>) -> Result<String, String> {
    let provider = Provider::connect(endpoint, tls.map(|t| (t, None)), false, Duration::from_secs(3), 1, Metrics::new())
        .map_err(|e| format!("{e:#}"))?;
    provider.refresh().await.map(|i| i.name).map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_over_tcp_is_reached_with_mutual_tls_only() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "mtls").await.expect("env");
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new().expect("ca");
    let serving = ca.serving(&[]).expect("serving cert");
    let client = ca.client("cloud-controller-manager", None).expect("client cert");
    let server_files = write(dir.path(), "provider", &serving.cert, &serving.key, ca.cert_pem());
    let core_files = write(dir.path(), "core", &client.cert, &client.key, ca.cert_pem());
    let rogue = Ca::new().expect("rogue ca");
    let rogue_client = rogue.client("cloud-controller-manager", None).expect("rogue cert");
    let rogue_files = write(dir.path(), "rogue", &rogue_client.cert, &rogue_client.key, ca.cert_pem());

    let name = env.node_name("a");
    let mut config = Config::default();
    config.instances.push(instance("i-a", &name, "sim-region-1a"));
    let port = free_port();
    let listen = Listen::Tcp(format!("127.0.0.1:{port}").parse().expect("addr"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let sim = tokio::spawn(ccm_provider_sim::serve(
        config,
        ccm_provider_sim::Endpoints::provider(listen),
        Some(server_files.clone()),
        async move {
            let _ = stopped.await;
        },
    ));
    let endpoint = format!("https://127.0.0.1:{port}");
    let plugin = eventually("the provider answers over mutual TLS", Duration::from_secs(10), async || {
        reaches(&endpoint, Some(&core_files)).await.ok()
    })
    .await;
    assert_eq!(plugin, "sim.cloudprovider.dev");

    // No client certificate, another CA's, or no TLS at all: refused.
    let no_cert = reaches(&endpoint, None).await;
    assert!(no_cert.is_err(), "a client without a certificate got {no_cert:?}");
    let rogue = reaches(&endpoint, Some(&rogue_files)).await;
    assert!(rogue.is_err(), "a certificate of another CA got {rogue:?}");
    let plain = reaches(&format!("http://127.0.0.1:{port}"), None).await;
    assert!(plain.is_err(), "plain http got {plain:?}");
    // A provider certificate for another name: the core refuses it.
    let wrong_name = Provider::connect(
        &endpoint,
        Some((&core_files, Some("provider.example"))),
        false,
        Duration::from_secs(3),
        1,
        Metrics::new(),
    )
    .expect("client");
    assert!(wrong_name.refresh().await.is_err(), "a certificate for another name was accepted");

    // The core, as a user runs it: its flags, a Node initialised through the TLS provider.
    NodeBuilder::new(&name).uninitialized().label(TEST_LABEL, &env.prefix).create(&env.client).await.expect("node");
    let (cert, key, ca_file) =
        (core_files.cert.display().to_string(), core_files.key.display().to_string(), core_files.ca.display().to_string());
    let flags = [
        "--leader-elect=false".to_string(),
        "--controllers=cloud-node".to_string(),
        format!("--provider-tls-cert-file={cert}"),
        format!("--provider-tls-key-file={key}"),
        format!("--provider-tls-ca-file={ca_file}"),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let core = Core::start_on(cp.kubeconfig_path(), &env, &endpoint, &flags);
    eventually("the node initialised over mutual TLS", Duration::from_secs(30), async || {
        let node = env.nodes().get(&name).await.ok()?;
        let spec = node.spec?;
        (!spec.taints.unwrap_or_default().iter().any(|t| t.key == UNINITIALIZED_TAINT)).then_some(spec.provider_id?)
    })
    .await;
    core.stop().await.expect("core stops");
    let _ = stop.send(());
    let _ = sim.await;
    env.cleanup().await.expect("cleanup");
}
