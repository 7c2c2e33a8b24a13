//! moto (an AWS emulator from PyPI) with the AWS provider's fixture, and go-adapter sidecars
//! (`ccm-provider-aws`, `ccm-provider-fake`) as processes: for the AWS end-to-end tests and
//! `ccm-bench --cloud aws`.
//!
//! The fixture (`aws/moto_fixture.py`) prints what it created as one JSON line and then
//! answers queries on its stdin with one JSON line each (moto's state, and the AWS calls
//! others made, counted at moto); see the script.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use crate::control_plane::free_port;

/// moto serving the fixture, with its query channel.
pub struct Moto {
    _child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    fixture: Value,
}

/// One instance of the fixture.
#[derive(Debug, Clone)]
pub struct Instance {
    pub id: String,
    pub private_dns: String,
    pub private_ip: String,
}

impl Moto {
    /// moto with `instances` instances for cluster `cluster`, in subnet 10.0.`subnet`.0/24
    /// (runs sharing an API server need distinct subnets: the instances' private DNS names are
    /// the Nodes' names). `python` is the virtualenv's (`Assets::tool("moto")`).
    pub async fn start(python: &Path, cluster: &str, instances: usize, subnet: u8) -> anyhow::Result<Self> {
        Self::spawn(python, cluster, instances, subnet, &[]).await
    }

    /// moto serving on `bind` (for example a bridge that pods reach), with one instance per
    /// address of `ips`, each with that private IP: instances standing for real nodes.
    pub async fn start_for(python: &Path, cluster: &str, bind: &str, ips: &[String]) -> anyhow::Result<Self> {
        let args = [format!("--bind={bind}"), format!("--ips={}", ips.join(","))];
        Self::spawn(python, cluster, ips.len(), 0, &args).await
    }

    async fn spawn(python: &Path, cluster: &str, instances: usize, subnet: u8, extra: &[String]) -> anyhow::Result<Self> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("aws/moto_fixture.py");
        let mut child = Command::new(python)
            .arg(&script)
            .arg(free_port()?.to_string())
            .arg(cluster)
            .arg(instances.to_string())
            .arg(subnet.to_string())
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", script.display()))?;
        let stdin = child.stdin.take().context("moto's stdin")?;
        let lines = BufReader::new(child.stdout.take().context("moto's stdout")?).lines();
        let mut moto = Self { _child: child, stdin, lines, fixture: Value::Null };
        moto.fixture =
            tokio::time::timeout(Duration::from_secs(120), moto.answer()).await.context("moto's fixture within 120 s")??;
        Ok(moto)
    }

    async fn answer(&mut self) -> anyhow::Result<Value> {
        loop {
            let line = self.lines.next_line().await.context("reading moto")?.context("moto exited")?;
            if let Some(json) = line.strip_prefix("ccm-fixture ") {
                return serde_json::from_str(json).context("moto's answer is not JSON");
            }
        }
    }

    /// The fixture's answer to `command` (`routes`, `elbs`, `nlbs`, `groups`, `calls`,
    /// `stop ID`, `terminate ID`); an error it reports is an error here.
    pub async fn query(&mut self, command: &str) -> anyhow::Result<Value> {
        self.stdin.write_all(format!("{command}\n").as_bytes()).await.context("writing to moto")?;
        let answer = self.answer().await?;
        if let Some(e) = answer.get("error") {
            bail!("moto {command}: {e}");
        }
        Ok(answer)
    }

    /// The AWS calls made to moto by others than the fixture since it started, by
    /// `service:Action`.
    pub async fn calls(&mut self) -> anyhow::Result<std::collections::BTreeMap<String, u64>> {
        let answer = self.query("calls").await?;
        serde_json::from_value(answer).context("moto's call counts")
    }

    /// A string field of the fixture (`endpoint`, `region`, `zone`, `vpc`, `subnet`,
    /// `route_table`, `security_group`).
    pub fn get(&self, key: &str) -> String {
        self.fixture[key].as_str().unwrap_or_default().to_string()
    }

    pub fn instances(&self) -> Vec<Instance> {
        let list = self.fixture["instances"].as_array().cloned().unwrap_or_default();
        let field = |i: &Value, k: &str| i[k].as_str().unwrap_or_default().to_string();
        list.iter()
            .map(|i| Instance { id: field(i, "id"), private_dns: field(i, "private_dns"), private_ip: field(i, "private_ip") })
            .collect()
    }

    /// The AWS provider's cloud config for this fixture: no metadata service (moto's is
    /// partial), every service pointed at moto.
    pub fn cloud_config(&self, cluster: &str) -> String {
        let endpoint = self.get("endpoint");
        let region = self.get("region");
        let mut text = format!(
            "[Global]\nZone = {}\nRegion = {region}\nVPC = {}\nSubnetID = {}\nRouteTableID = {}\nKubernetesClusterID = {cluster}\n",
            self.get("zone"),
            self.get("vpc"),
            self.get("subnet"),
            self.get("route_table"),
        );
        let services = [
            ("EC2", "ec2"),
            ("Elastic Load Balancing", "elasticloadbalancing"),
            ("Elastic Load Balancing v2", "elasticloadbalancing"),
            ("KMS", "kms"),
            ("ec2imds", "ec2"),
        ];
        for (i, (service, signing)) in services.iter().enumerate() {
            text += &format!(
                "\n[ServiceOverride \"{i}\"]\nService = {service}\nRegion = {region}\nURL = {endpoint}\nSigningRegion = {region}\nSigningName = {signing}\n"
            );
        }
        text
    }
}

/// What the AWS SDK in the provider needs to talk to moto.
pub const AWS_ENV: [(&str, &str); 3] =
    [("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_EC2_METADATA_DISABLED", "true")];

/// A go-adapter sidecar as a process, serving on `dir`/provider.sock, its log kept.
pub struct Sidecar {
    child: Child,
    pub endpoint: String,
    log: PathBuf,
}

impl Sidecar {
    /// `ccm-provider-aws` (`binary`) for `moto`'s fixture, its config written into `dir`.
    pub async fn aws(binary: &Path, dir: &Path, moto: &Moto, cluster: &str, kubeconfig: &Path) -> anyhow::Result<Self> {
        let config = dir.join("cloud.conf");
        std::fs::write(&config, moto.cloud_config(cluster)).context("writing the cloud config")?;
        let args = [
            "--cloud-provider=aws".to_string(),
            format!("--cloud-config={}", config.display()),
            format!("--kubeconfig={}", kubeconfig.display()),
            "--batch-reads".to_string(),
        ];
        Self::run(binary, dir, &args, &AWS_ENV).await
    }

    /// `binary` with `args` (and `--listen`, `-v=2`), once its socket accepts (60 s at most).
    pub async fn run(binary: &Path, dir: &Path, args: &[String], env: &[(&str, &str)]) -> anyhow::Result<Self> {
        let socket = dir.join("provider.sock");
        let name = binary.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let log = dir.join(format!("{name}.log"));
        let child = Command::new(binary)
            .args(args)
            .arg(format!("--listen=unix://{}", socket.display()))
            .arg("-v=2")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).context("the sidecar's log")?)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let sidecar = Self { child, endpoint: format!("unix://{}", socket.display()), log };
        let deadline = Instant::now() + Duration::from_secs(60);
        while tokio::net::UnixStream::connect(&socket).await.is_err() {
            if Instant::now() > deadline {
                bail!("{name} did not listen within 60 s:\n{}", sidecar.log_text());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(sidecar)
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}
