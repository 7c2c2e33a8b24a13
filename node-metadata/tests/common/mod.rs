//! Shared by the integration tests: the sim with its metadata service and the node plugin of
//! one instance over real unix sockets, and running the real binary.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use ccm_provider_sdk::Listen;
use ccm_provider_sim::config::{Address, CacheKey, InstanceSpec, RegistryCredentialSpec};
use ccm_provider_sim::{Config, Endpoints};
use tokio::sync::oneshot;

pub const BIN: &str = env!("CARGO_BIN_EXE_ccm-node-metadata");

/// The sim (with its metadata service) and the node plugin of instance `i-node`.
pub struct Node {
    pub dir: tempfile::TempDir,
    stops: Vec<Option<oneshot::Sender<()>>>,
}

impl Node {
    pub async fn start() -> Self {
        let dir = tempfile::tempdir().expect("dir");
        let mut config = Config::default();
        config.instances.push(InstanceSpec {
            id: "i-node".into(),
            name: "node-1".into(),
            zone: "sim-region-1b".into(),
            instance_type: "sim.xlarge".into(),
            state: Default::default(),
            addresses: vec![
                Address { kind: "ExternalIP".into(), address: "198.51.100.7".into() },
                Address { kind: "InternalIP".into(), address: "10.2.0.7".into() },
                Address { kind: "InternalIP".into(), address: "fd00:2::7".into() },
            ],
            tags: Default::default(),
            ..Default::default()
        });
        config.registry_credentials.push(RegistryCredentialSpec {
            registry: "*.registry.sim.dev".into(),
            username: "instance-role".into(),
            password: "pw-SECRET-1".into(),
            cache_key_type: CacheKey::Registry,
            cache_seconds: 1800,
        });
        let mut node = Self { dir, stops: Vec::new() };
        let (tx, rx) = oneshot::channel::<()>();
        let endpoints = Endpoints {
            provider: Listen::Unix(node.path("provider.sock")),
            admin: None,
            metadata: Some(Listen::Unix(node.path("metadata.sock"))),
            metrics: None,
        };
        tokio::spawn(ccm_provider_sim::run(config, endpoints, async move {
            let _ = rx.await;
        }));
        node.stops.push(Some(tx));
        let (tx, rx) = oneshot::channel::<()>();
        let plugin =
            ccm_provider_sim::plugin::NodePlugin::new(format!("unix://{}", node.path("metadata.sock").display()), "i-node");
        let listen = Listen::Unix(node.path("plugin/node-metadata.sock"));
        tokio::spawn(ccm_provider_sim::plugin::run("sim.cloudprovider.dev", plugin, listen, async move {
            let _ = rx.await;
        }));
        node.stops.push(Some(tx));
        wait_for(&node.path("metadata.sock")).await;
        wait_for(&node.path("plugin/node-metadata.sock")).await;
        node
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.path("plugin/node-metadata.sock").display())
    }

    /// Stops the sim (and with it the metadata service), leaving the plugin running.
    pub fn stop_cloud(&mut self) {
        if let Some(tx) = self.stops.get_mut(0).and_then(Option::take) {
            let _ = tx.send(());
        }
    }

    /// Stops the plugin, leaving its directory (and the files beside it) in place.
    pub async fn stop_plugin(&mut self) {
        if let Some(tx) = self.stops.get_mut(1).and_then(Option::take) {
            let _ = tx.send(());
        }
        for _ in 0..500 {
            if !self.path("plugin/node-metadata.sock").exists() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

pub async fn wait_for(path: &Path) {
    for _ in 0..500 {
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("nothing listens on {}", path.display());
}

pub async fn run(args: &[&str], stdin: Option<&[u8]>) -> Output {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new(BIN)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    let mut input = child.stdin.take().expect("stdin");
    input.write_all(stdin.unwrap_or_default()).await.expect("write stdin");
    drop(input);
    tokio::time::timeout(Duration::from_secs(30), child.wait_with_output()).await.expect("finishes").expect("output")
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}
