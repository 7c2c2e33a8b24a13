//! What the benchmark programs share: a control plane, a sim provider over a unix socket, and
//! the core in this process.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::time::Duration;

use ccm_harness::ControlPlane;
use ccm_provider_sim::{AdminClient, Config};
use clap::Parser;

/// A control plane, a sim and (once started) a core.
pub struct World {
    pub cp: ControlPlane,
    pub client: kube::Client,
    pub admin: AdminClient,
    pub endpoint: String,
    _dir: tempfile::TempDir,
    stops: Vec<tokio::sync::oneshot::Sender<()>>,
}

impl World {
    /// Starts the control plane and the sim with `config`.
    pub async fn start(config: Config) -> anyhow::Result<Self> {
        let cp = tokio::task::spawn_blocking(ControlPlane::start).await??;
        let client = cp.client().await?;
        let dir = tempfile::tempdir()?;
        let sock = dir.path().join("provider.sock");
        let admin_sock = dir.path().join("admin.sock");
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let endpoints = ccm_provider_sim::Endpoints {
            provider: ccm_provider_sdk::Listen::Unix(sock.clone()),
            admin: Some(ccm_provider_sdk::Listen::Unix(admin_sock.clone())),
            metadata: None,
            metrics: None,
        };
        tokio::spawn(ccm_provider_sim::run(config, endpoints, async move {
            let _ = rx.await;
        }));
        while tokio::net::UnixStream::connect(&admin_sock).await.is_err() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(Self {
            cp,
            client,
            admin: AdminClient::new(format!("unix://{}", admin_sock.display())),
            endpoint: format!("unix://{}", sock.display()),
            _dir: dir,
            stops: vec![stop],
        })
    }

    /// Starts the core with `flags`, plus the kubeconfig, the endpoint and these defaults
    /// unless `flags` sets them: no leader election, no health server, a Kubernetes API budget
    /// of 200 writes/s (so the provider, not the API client, is what the benchmarks measure).
    pub fn start_core(&mut self, flags: &[&str]) -> anyhow::Result<()> {
        let kubeconfig = self.cp.kubeconfig_path().display().to_string();
        let mut args = vec!["cloud-controller-manager", "--kubeconfig", &kubeconfig, "--provider-endpoint", &self.endpoint];
        args.extend_from_slice(flags);
        for default in ["--leader-elect=false", "--secure-port=0", "--kube-api-qps=200", "--kube-api-burst=400"] {
            let flag = default.split('=').next().unwrap_or(default);
            if !flags.iter().any(|f| f.starts_with(flag)) {
                args.push(default);
            }
        }
        let options = ccm_core::options::Options::try_parse_from(args)?;
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(ccm_core::runtime::run_until(options, async move {
            let _ = rx.await;
        }));
        self.stops.push(stop);
        Ok(())
    }

    /// Provider calls by method since the last reset.
    pub async fn calls(&self) -> anyhow::Result<BTreeMap<String, u64>> {
        let mut out = BTreeMap::new();
        for c in self.admin.calls().await?.counts {
            *out.entry(c.method).or_default() += c.count;
        }
        Ok(out)
    }

    /// Stops the core and the sim.
    pub fn stop(self) {
        for s in self.stops {
            let _ = s.send(());
        }
    }
}

/// A running instance named like the Node that will stand for it.
pub fn instance(id: String, name: String, zone: &str) -> ccm_provider_sim::config::InstanceSpec {
    ccm_provider_sim::config::InstanceSpec {
        id,
        name,
        zone: zone.into(),
        instance_type: "sim.large".into(),
        state: Default::default(),
        addresses: Vec::new(),
        tags: Default::default(),
        ..Default::default()
    }
}

/// Calls that reach the cloud API (Identity is answered by the sidecar).
pub fn cloud_calls(c: &BTreeMap<String, u64>) -> u64 {
    c.iter().filter(|(m, _)| !m.starts_with("IdentityService/")).map(|(_, n)| n).sum()
}

/// Prints calls by method.
pub fn print_calls(c: &BTreeMap<String, u64>) {
    for (m, n) in c {
        println!("  {m:50} {n}");
    }
}

/// The p-th percentile (0..=100) of sorted values.
pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// The n-th command-line argument as a number, or a default.
pub fn arg(n: usize, default: u64) -> u64 {
    std::env::args().nth(n).and_then(|a| a.parse().ok()).unwrap_or(default)
}
