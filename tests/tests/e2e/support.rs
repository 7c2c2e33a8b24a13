//! Running the sim provider and the core inside the test process, over real sockets: the sim
//! on a unix socket, the core against the shared API server.

use std::path::PathBuf;
use std::time::Duration;

use ccm_harness::ControlPlane;
use ccm_harness::cluster::{NodeBuilder, TestEnv};
use ccm_provider_sim::config::InstanceSpec;
use ccm_provider_sim::{AdminClient, Config};
use clap::Parser;
use tokio::sync::oneshot;

/// The label every Node of a test carries, so each test's core handles only its own Nodes.
pub const TEST_LABEL: &str = "e2e.ccm-rs.dev/test";

/// A running sim.
pub struct Sim {
    dir: tempfile::TempDir,
    pub endpoint: String,
    pub admin: AdminClient,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Sim {
    /// Starts a sim with `config` on a fresh unix socket.
    pub async fn start(config: Config) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut sim = Self {
            endpoint: format!("unix://{}", dir.path().join("provider.sock").display()),
            admin: AdminClient::new(format!("unix://{}", dir.path().join("admin.sock").display())),
            dir,
            stop: None,
            task: None,
        };
        sim.launch(config).await;
        sim
    }

    /// The socket of the sim's instance metadata service.
    pub fn metadata_socket(&self) -> PathBuf {
        self.dir.path().join("metadata.sock")
    }

    /// The socket of the sim's Prometheus metrics (`--metrics-listen=unix://…`).
    pub fn metrics_socket(&self) -> PathBuf {
        self.dir.path().join("metrics.sock")
    }

    /// A sim endpoint with nothing listening yet (the provider is "down").
    pub fn not_started() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        Self {
            endpoint: format!("unix://{}", dir.path().join("provider.sock").display()),
            admin: AdminClient::new(format!("unix://{}", dir.path().join("admin.sock").display())),
            dir,
            stop: None,
            task: None,
        }
    }

    /// Starts (or restarts) the sim on this endpoint.
    pub async fn launch(&mut self, config: Config) {
        let sock: PathBuf = self.dir.path().join("provider.sock");
        let admin = self.dir.path().join("admin.sock");
        let (tx, rx) = oneshot::channel::<()>();
        let endpoints = ccm_provider_sim::Endpoints {
            provider: ccm_provider_sdk::Listen::Unix(sock.clone()),
            admin: Some(ccm_provider_sdk::Listen::Unix(admin.clone())),
            metadata: Some(ccm_provider_sdk::Listen::Unix(self.metadata_socket())),
            metrics: Some(ccm_provider_sdk::Listen::Unix(self.metrics_socket())),
        };
        let task = tokio::spawn(ccm_provider_sim::run(config, endpoints, async move {
            let _ = rx.await;
        }));
        for _ in 0..200 {
            if tokio::net::UnixStream::connect(&sock).await.is_ok() && tokio::net::UnixStream::connect(&admin).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.stop = Some(tx);
        self.task = Some(task);
    }

    /// Stops the sim.
    pub async fn stop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }
}

/// An instance named like its Node.
pub fn instance(id: &str, node: &str, zone: &str) -> InstanceSpec {
    InstanceSpec {
        id: id.into(),
        name: node.into(),
        zone: zone.into(),
        instance_type: "sim.large".into(),
        state: Default::default(),
        addresses: Vec::new(),
        tags: Default::default(),
        ..Default::default()
    }
}

/// A running core.
pub struct Core {
    stop: Option<oneshot::Sender<()>>,
    pub task: tokio::task::JoinHandle<anyhow::Result<()>>,
    pub health: Option<String>,
}

impl Core {
    /// Starts the core for `env`'s Nodes against `sim`, with extra flags.
    pub fn start(cp: &ControlPlane, env: &TestEnv, sim: &Sim, extra: &[&str]) -> Self {
        Self::start_as(cp.kubeconfig_path(), env, sim, extra)
    }

    /// Starts the core with the identity of `kubeconfig`.
    pub fn start_as(kubeconfig: &std::path::Path, env: &TestEnv, sim: &Sim, extra: &[&str]) -> Self {
        Self::start_on(kubeconfig, env, &sim.endpoint, extra)
    }

    /// Starts the core with the identity of `kubeconfig` against any provider endpoint.
    pub fn start_on(kubeconfig: &std::path::Path, env: &TestEnv, endpoint: &str, extra: &[&str]) -> Self {
        Self::launch(kubeconfig, env, endpoint, extra, true)
    }

    /// Starts the core for the Services of every namespace (no `--service-namespace`): `extra`
    /// must keep it to the test's own (a `--load-balancer-class` of the test's, with
    /// `--ignore-unclassed-services`), since the API server is shared by every test.
    pub fn start_cluster_wide(cp: &ControlPlane, env: &TestEnv, endpoint: &str, extra: &[&str]) -> Self {
        assert!(
            extra.iter().any(|a| a.starts_with("--load-balancer-class=")) && extra.contains(&"--ignore-unclassed-services"),
            "a cluster-wide core in a shared API server keeps to its test's own load balancer class"
        );
        Self::launch(cp.kubeconfig_path(), env, endpoint, extra, false)
    }

    fn launch(kubeconfig: &std::path::Path, env: &TestEnv, endpoint: &str, extra: &[&str], namespaced: bool) -> Self {
        // The in-process core's log, when asked for: CCM_E2E_LOG=ccm_core=debug.
        if let Ok(filter) = std::env::var("CCM_E2E_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_test_writer()
                .try_init();
        }
        let kubeconfig = kubeconfig.display().to_string();
        let exclude = format!("--node-exclude-selector={TEST_LABEL}!={}", env.prefix);
        let mut args = vec!["cloud-controller-manager", "--kubeconfig", &kubeconfig, "--provider-endpoint", endpoint, &exclude];
        args.extend_from_slice(extra);
        // Test defaults, unless the test sets them. Each core handles only its test's
        // Services and Leases: the API server is shared by every test.
        let service_ns = format!("--service-namespace={}", env.namespace);
        let lease = format!("--leader-elect-resource-name={}", env.prefix);
        let lease_ns = format!("--leader-elect-resource-namespace={}", env.namespace);
        let mut defaults =
            vec!["--secure-port=0", "--reconcile-backoff-base=200ms", "--reconcile-backoff-max=5s", &lease, &lease_ns];
        if namespaced {
            defaults.push(&service_ns);
        }
        for default in defaults {
            let flag = default.split('=').next().unwrap_or(default);
            if !extra.iter().any(|a| a.split('=').next() == Some(flag)) {
                args.push(default);
            }
        }
        let health = args
            .iter()
            .find_map(|a| a.strip_prefix("--secure-port="))
            .filter(|p| *p != "0")
            .map(|p| format!("http://127.0.0.1:{p}"));
        let options = ccm_core::options::Options::try_parse_from(args).expect("core flags");
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(ccm_core::runtime::run_until(options, async move {
            let _ = rx.await;
        }));
        Self { stop: Some(tx), task, health }
    }

    /// Stops the core and waits for it.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.stop_within(Duration::from_secs(10)).await
    }

    /// Stops it as a SIGTERM does, allowing it `within` to end.
    pub async fn stop_within(mut self, within: Duration) -> anyhow::Result<()> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        tokio::time::timeout(within, self.task).await.expect("core stops in time").expect("join")
    }
}

/// A free TCP port on loopback.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// Polls `check` every 100 ms until it returns Some, or panics after `timeout`.
pub async fn eventually<T>(what: &str, timeout: Duration, mut check: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A minimal HTTP GET on loopback; returns (status, body).
pub async fn http_get(base: &str, path: &str) -> Option<(u16, String)> {
    http_request(base, "GET", path, None).await
}

/// A minimal HTTP request (a JSON body, if any); returns (status, body).
pub async fn http_request(base: &str, method: &str, path: &str, json: Option<&serde_json::Value>) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let hostport = base.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(hostport).await.ok()?;
    let body = json.map(|j| j.to_string()).unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(format!("{head}{body}").as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    stream.read_to_end(&mut buf).await.ok()?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Some((status, body))
}

/// A TCP proxy on loopback that can go silent (forward nothing, close nothing: a partition,
/// a half-open connection) or refuse (close every connection and every new one).
pub struct Blackhole {
    pub addr: std::net::SocketAddr,
    mode: tokio::sync::watch::Sender<Mode>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Forward,
    Silent,
    Refuse,
}

impl Blackhole {
    /// Forwards to `target` until told otherwise.
    pub async fn start(target: std::net::SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (mode, _) = tokio::sync::watch::channel(Mode::Forward);
        let gate = mode.clone();
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                if *gate.borrow() == Mode::Refuse {
                    continue; // dropped: closed at once
                }
                let gate = gate.subscribe();
                tokio::spawn(async move {
                    let Ok(outbound) = tokio::net::TcpStream::connect(target).await else { return };
                    let (ri, wi) = inbound.into_split();
                    let (ro, wo) = outbound.into_split();
                    tokio::join!(Self::pipe(ri, wo, gate.clone()), Self::pipe(ro, wi, gate));
                });
            }
        });
        Self { addr, mode }
    }

    async fn pipe(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        mut gate: tokio::sync::watch::Receiver<Mode>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = tokio::select! {
                r = from.read(&mut buf) => match r { Ok(n) if n > 0 => n, _ => return },
                _ = gate.wait_for(|m| *m == Mode::Refuse) => return,
            };
            match gate.wait_for(|m| *m != Mode::Silent).await.map(|m| *m) {
                Ok(Mode::Forward) => {}
                _ => return,
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }

    /// Goes silent: every byte in either direction is held from now on.
    pub fn pause(&self) {
        // send_replace: stored even while no connection (no receiver) is open.
        self.mode.send_replace(Mode::Silent);
    }

    /// Closes every connection, and every new one at once.
    pub fn refuse(&self) {
        // send_replace: stored even while no connection (no receiver) is open.
        self.mode.send_replace(Mode::Refuse);
    }

    /// Forwards again.
    pub fn restore(&self) {
        // send_replace: stored even while no connection (no receiver) is open.
        self.mode.send_replace(Mode::Forward);
    }
}

/// `kubeconfig` with its server replaced by `https://<addr>` (written beside it).
pub fn kubeconfig_via(kubeconfig: &std::path::Path, server: &str, addr: std::net::SocketAddr) -> std::path::PathBuf {
    let text = std::fs::read_to_string(kubeconfig).expect("kubeconfig");
    assert!(text.contains(server), "the kubeconfig names {server}");
    let path = kubeconfig.with_file_name(format!("via-{}.kubeconfig", addr.port()));
    std::fs::write(&path, text.replace(server, &format!("https://{addr}"))).expect("write kubeconfig");
    path
}

/// The workspace binary `name`, built first when it is missing or out of date (cargo test
/// builds only the binaries of the packages it tests: see `ccm_harness::workspace`).
pub fn workspace_binary(name: &str) -> std::path::PathBuf {
    ccm_harness::workspace::binary(name).unwrap_or_else(|e| panic!("the workspace binary {name}: {e:#}"))
}

/// A sim with one instance, `i-1`, and `env`'s Node of it (`env.node_name("n1")`).
pub async fn one_node_cloud(env: &TestEnv) -> Sim {
    let node = env.node_name("n1");
    let mut config = Config::default();
    config.instances.push(instance("i-1", &node, "sim-region-1a"));
    let sim = Sim::start(config).await;
    NodeBuilder::new(&node)
        .label(TEST_LABEL, &env.prefix)
        .provider_id("sim://sim-region-1a/i-1")
        .address("InternalIP", "10.0.0.9")
        .create(&env.client)
        .await
        .expect("node");
    sim
}
