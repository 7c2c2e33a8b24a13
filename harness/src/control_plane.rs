//! A real etcd and kube-apiserver on loopback, started from the binaries [`Assets`] finds.
//!
//! Everything lives in one temporary directory (data, certificates, logs, kubeconfig) that
//! goes away with the processes. [`ControlPlane`] stops both processes when dropped, also on
//! a panic; and a watchdog process stops them and removes the directory when the test process
//! itself dies without dropping it (as a `static` shared control plane never is).

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::assets::Assets;
use crate::pki::{Ca, Pem, service_account_key};

/// The service CIDR the API server allocates ClusterIPs from.
pub const SERVICE_CLUSTER_IP_RANGE: &str = "10.96.0.0/16";

/// How a control plane is started: [`ControlPlane::start`] uses the defaults (loopback, no
/// kubelets); the kubelet cluster binds the API server to its bridge and turns on what pods
/// need.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The address the API server binds and advertises. Loopback (the default) runs with no
    /// `kubernetes` Service endpoints; another address gets the usual endpoint reconciler.
    pub bind: std::net::IpAddr,
    /// ServiceAccount admission (pods get their token volumes), off by default: the tests
    /// without kubelets create no pods.
    pub service_accounts: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Self { bind: std::net::Ipv4Addr::LOCALHOST.into(), service_accounts: false }
    }
}

/// How to start one process again: its program, arguments and log.
#[derive(Debug, Clone)]
struct Spawn {
    program: PathBuf,
    args: Vec<std::ffi::OsString>,
    log: PathBuf,
}

impl Spawn {
    fn new(program: &Path, command: &Command, log: PathBuf) -> Self {
        Self { program: program.to_path_buf(), args: command.get_args().map(ToOwned::to_owned).collect(), log }
    }

    fn start(&self) -> anyhow::Result<Child> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        Command::new(&self.program)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", self.program.display()))
    }
}

/// A running etcd and kube-apiserver.
pub struct ControlPlane {
    dir: tempfile::TempDir,
    etcd: Child,
    apiserver: Child,
    spawns: [Spawn; 2],
    watchdog: Option<Child>,
    ca: Ca,
    server: String,
    kubeconfig: PathBuf,
    kubectl: PathBuf,
    /// How long start-up took, for the record.
    pub startup: Duration,
}

pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0").context("finding a free port")?.local_addr()?.port())
}

/// The log's error and fatal lines (klog's `E`/`F` prefixes, or etcd's `"level":"error"`),
/// else its last lines: what a reader needs to see why a process died.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    let errors: Vec<&str> = all
        .iter()
        .copied()
        .filter(|l| {
            l.starts_with('E') || l.starts_with('F') || l.contains("\"level\":\"error\"") || l.contains("\"level\":\"fatal\"")
        })
        .collect();
    let chosen = if errors.is_empty() { &all } else { &errors };
    chosen[chosen.len().saturating_sub(lines)..].join("\n")
}

fn kubeconfig_yaml(server: &str, ca: &str, client: &Pem, user: &str) -> String {
    use base64::Engine as _;
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: e2e\n  cluster:\n    server: {server}\n    certificate-authority-data: {}\n\
         users:\n- name: {user}\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\n\
         contexts:\n- name: e2e\n  context:\n    cluster: e2e\n    user: {user}\ncurrent-context: e2e\n",
        b64(ca.as_bytes()),
        b64(client.cert.as_bytes()),
        b64(client.key.as_bytes()),
    )
}

/// Audit policy: what the kube-system ServiceAccounts (the core and its controllers) do, at
/// Metadata level; nothing else. Tests read it to prove no request was forbidden.
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n\
- level: Metadata\n  userGroups: [\"system:serviceaccounts:kube-system\"]\n- level: None\n";

fn token_kubeconfig_yaml(server: &str, ca: &str, token: &str, user: &str) -> String {
    use base64::Engine as _;
    let ca = base64::engine::general_purpose::STANDARD.encode(ca.as_bytes());
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: e2e\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\n\
         users:\n- name: {user}\n  user:\n    token: {token}\n\
         contexts:\n- name: e2e\n  context:\n    cluster: e2e\n    user: {user}\ncurrent-context: e2e\n"
    )
}

impl ControlPlane {
    /// Starts etcd and kube-apiserver on free loopback ports and waits until `/readyz` is ok.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(&Settings::default())
    }

    /// Starts etcd and kube-apiserver as `settings` say and waits until `/readyz` is ok.
    pub fn start_with(settings: &Settings) -> anyhow::Result<Self> {
        let assets = Assets::find()?;
        let mut last = None;
        // A free port can be taken between finding and binding it: retry with new ports.
        for _ in 0..3 {
            match Self::try_start(&assets, settings) {
                Ok(cp) => return Ok(cp),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("control plane did not start")))
    }

    fn try_start(assets: &Assets, settings: &Settings) -> anyhow::Result<Self> {
        let begin = Instant::now();
        let dir = tempfile::Builder::new().prefix("ccm-e2e-").tempdir().context("creating the control plane directory")?;
        let path = |name: &str| dir.path().join(name);
        let write = |name: &str, text: &str| std::fs::write(path(name), text).with_context(|| format!("writing {name}"));

        let ca = Ca::new()?;
        // The first address of the service range is the `kubernetes` Service's ClusterIP, which
        // pods (kube-rs and client-go in-cluster configurations) dial by address.
        let serving = ca.serving(&[settings.bind, std::net::Ipv4Addr::new(10, 96, 0, 1).into()])?;
        let admin = ca.client("ccm-e2e-admin", Some("system:masters"))?;
        write("ca.crt", ca.cert_pem())?;
        write("apiserver.crt", &serving.cert)?;
        write("apiserver.key", &serving.key)?;
        let (sa_key, sa_pub) = service_account_key()?;
        write("sa.key", &sa_key)?;
        write("sa.pub", &sa_pub)?;
        write("audit-policy.yaml", AUDIT_POLICY)?;

        let (etcd_port, peer_port, api_port) = (free_port()?, free_port()?, free_port()?);
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let mut etcd_command = Command::new(&assets.etcd);
        etcd_command
            .args(["--name", "e2e", "--data-dir"])
            .arg(path("etcd"))
            .args(["--listen-client-urls", &etcd_url, "--advertise-client-urls", &etcd_url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("e2e={peer_url}")])
            .args(["--unsafe-no-fsync", "--log-level", "warn", "--quota-backend-bytes", "4294967296"]);
        let etcd_spawn = Spawn::new(&assets.etcd, &etcd_command, path("etcd.log"));
        let etcd = etcd_spawn.start()?;

        let mut api_command = Command::new(&assets.kube_apiserver);
        api_command
            .args(["--etcd-servers", &etcd_url])
            .arg(format!("--cert-dir={}", path("certs").display()))
            .arg(format!("--secure-port={api_port}"))
            .arg(format!("--bind-address={}", settings.bind))
            .arg(format!("--advertise-address={}", settings.bind))
            // On loopback (no kubelets) there are no real "kubernetes" Service endpoints.
            .args(settings.bind.is_loopback().then_some("--endpoint-reconciler-type=none"))
            .arg(format!("--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}"))
            // As a production cluster: kubelets (system:node:<name>) are limited to their own
            // Node by the Node authorizer and NodeRestriction admission.
            .arg("--authorization-mode=Node,RBAC")
            .arg("--enable-admission-plugins=NodeRestriction")
            .arg("--service-account-issuer=https://kubernetes.default.svc.cluster.local")
            .arg(format!("--service-account-key-file={}", path("sa.pub").display()))
            .arg(format!("--service-account-signing-key-file={}", path("sa.key").display()))
            .arg(format!("--client-ca-file={}", path("ca.crt").display()))
            .arg(format!("--tls-cert-file={}", path("apiserver.crt").display()))
            .arg(format!("--tls-private-key-file={}", path("apiserver.key").display()))
            .args((!settings.service_accounts).then_some("--disable-admission-plugins=ServiceAccount"))
            // kubectl logs/exec reach kubelets by the address the tests gave them.
            .arg("--kubelet-preferred-address-types=InternalIP,Hostname")
            .arg(format!("--audit-policy-file={}", path("audit-policy.yaml").display()))
            .arg(format!("--audit-log-path={}", path("audit.log").display()))
            .arg("--audit-log-format=json")
            .arg("--allow-privileged=true")
            .arg("--v=0");
        let api_spawn = Spawn::new(&assets.kube_apiserver, &api_command, path("kube-apiserver.log"));
        let apiserver = api_spawn.start()?;

        let server = format!("https://{}", std::net::SocketAddr::new(settings.bind, api_port));
        let kubeconfig = path("admin.kubeconfig");
        write("admin.kubeconfig", &kubeconfig_yaml(&server, ca.cert_pem(), &admin, "ccm-e2e-admin"))?;

        let watchdog = Self::watchdog(&[etcd.id(), apiserver.id()], dir.path()).ok();
        let mut cp = Self {
            dir,
            etcd,
            apiserver,
            spawns: [etcd_spawn, api_spawn],
            watchdog,
            ca,
            server,
            kubeconfig,
            kubectl: assets.kubectl.clone(),
            startup: Duration::ZERO,
        };
        cp.wait_ready(Duration::from_secs(90))?;
        cp.startup = begin.elapsed();
        Ok(cp)
    }

    /// A shell that outlives this process only to stop its control plane: it polls this
    /// process and, once it is gone, kills etcd and kube-apiserver and removes the directory.
    fn watchdog(pids: &[u32], dir: &Path) -> anyhow::Result<Child> {
        let pids = pids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
        let script = format!(
            "while kill -0 {me} 2>/dev/null; do sleep 1; done; kill -TERM {pids} 2>/dev/null; sleep 2; kill -KILL {pids} 2>/dev/null; rm -rf '{dir}'",
            me = std::process::id(),
            dir = dir.display()
        );
        // A process group of its own: a terminal's Ctrl-C, which reaches the whole foreground
        // group, must not stop the watchdog with the process it watches.
        Command::new("sh")
            .args(["-c", &script])
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting the control plane watchdog")
    }

    fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.etcd.try_wait()? {
                bail!("etcd exited with {status}:\n{}", tail(&self.dir.path().join("etcd.log"), 20));
            }
            if let Some(status) = self.apiserver.try_wait()? {
                bail!("kube-apiserver exited with {status}:\n{}", tail(&self.dir.path().join("kube-apiserver.log"), 30));
            }
            let out = self.kubectl(&["get", "--raw", "/readyz"]).output()?;
            if out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok" {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "kube-apiserver not ready after {timeout:?}: {}\n{}",
                    String::from_utf8_lossy(&out.stderr),
                    tail(&self.dir.path().join("kube-apiserver.log"), 30)
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// A `kubectl` command using the admin kubeconfig.
    pub fn kubectl(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.kubectl);
        cmd.arg("--kubeconfig").arg(&self.kubeconfig).args(args);
        cmd
    }

    /// The API server's URL.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The admin kubeconfig (user `ccm-e2e-admin` in `system:masters`).
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// The directory holding data, certificates and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// An admin client. Make one per test: a client belongs to the tokio runtime it was made in.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        Self::client_from(&self.kubeconfig).await
    }

    /// Writes a kubeconfig for `user` (in `group`, if any) and returns its path. The user has
    /// no permissions until a test binds a Role or ClusterRole to it: the way to prove least
    /// privilege.
    pub fn kubeconfig_for(&self, user: &str, group: Option<&str>) -> anyhow::Result<PathBuf> {
        let pem = self.ca.client(user, group)?;
        let file: String = user.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
        let path = self.dir.path().join(format!("{file}.kubeconfig"));
        std::fs::write(&path, kubeconfig_yaml(&self.server, self.ca.cert_pem(), &pem, user))?;
        Ok(path)
    }

    /// Writes a kubeconfig authenticating with a bearer `token` (a ServiceAccount's, from the
    /// TokenRequest API) and returns its path.
    pub fn kubeconfig_with_token(&self, name: &str, token: &str) -> anyhow::Result<PathBuf> {
        let path = self.dir.path().join(format!("{name}.token.kubeconfig"));
        std::fs::write(&path, token_kubeconfig_yaml(&self.server, self.ca.cert_pem(), token, name))?;
        Ok(path)
    }

    /// The API server's audit log (JSON lines): requests of kube-system ServiceAccounts.
    pub fn audit_log(&self) -> PathBuf {
        self.dir.path().join("audit.log")
    }

    /// A client acting as `user` (in `group`, if any), with no permissions of its own.
    pub async fn client_as(&self, user: &str, group: Option<&str>) -> anyhow::Result<kube::Client> {
        Self::client_from(&self.kubeconfig_for(user, group)?).await
    }

    async fn client_from(path: &Path) -> anyhow::Result<kube::Client> {
        let kubeconfig = Kubeconfig::read_from(path).with_context(|| format!("reading {}", path.display()))?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
        Ok(kube::Client::try_from(config)?)
    }

    /// The process ids of etcd and kube-apiserver.
    pub fn pids(&self) -> [u32; 2] {
        [self.etcd.id(), self.apiserver.id()]
    }

    /// Kills kube-apiserver and etcd at once (as a crash or a node loss would), keeps them
    /// down for `down`, then starts both again on the same ports and data, and waits until the
    /// API server is ready. The watchdog follows the new processes.
    pub fn restart(&mut self, down: Duration) -> anyhow::Result<()> {
        for child in [&mut self.apiserver, &mut self.etcd] {
            let _ = child.kill();
            let _ = child.wait();
        }
        std::thread::sleep(down);
        self.etcd = self.spawns[0].start()?;
        self.apiserver = self.spawns[1].start()?;
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
        self.watchdog = Self::watchdog(&[self.etcd.id(), self.apiserver.id()], self.dir.path()).ok();
        self.wait_ready(Duration::from_secs(90))
    }

    /// Stops both processes now (also done on drop).
    pub fn stop(&mut self) {
        for child in [&mut self.apiserver, &mut self.etcd] {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop();
    }
}
