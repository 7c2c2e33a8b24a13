//! Finding the control plane binaries: envtest's variables first, else the binaries that
//! `envtest/setup.sh` builds from Go modules and caches outside the repository.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// The binaries a control plane needs.
#[derive(Debug, Clone)]
pub struct Assets {
    /// kube-apiserver.
    pub kube_apiserver: PathBuf,
    /// etcd.
    pub etcd: PathBuf,
    /// kubectl.
    pub kubectl: PathBuf,
}

impl Assets {
    /// Finds the binaries: `TEST_ASSET_KUBE_APISERVER`, `TEST_ASSET_ETCD` and
    /// `TEST_ASSET_KUBECTL` when all are set, else `KUBEBUILDER_ASSETS`, else the directory
    /// `harness/envtest/setup.sh` prints (building the binaries on first use).
    pub fn find() -> anyhow::Result<Self> {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        if let (Some(kube_apiserver), Some(etcd), Some(kubectl)) =
            (var("TEST_ASSET_KUBE_APISERVER"), var("TEST_ASSET_ETCD"), var("TEST_ASSET_KUBECTL"))
        {
            return Self { kube_apiserver, etcd, kubectl }.checked();
        }
        if let Some(dir) = var("KUBEBUILDER_ASSETS") {
            return Self::in_dir(&dir).checked();
        }
        let dir = Self::setup("control-plane")?;
        Self::in_dir(&dir).checked()
    }

    /// A test tool `envtest/setup.sh <tool>` builds on first use and caches beside the
    /// control plane: `kubelet-check` (the kubelet's drop-in and credential provider code),
    /// `helm`, or `peer` (upstream's cloud-controller-manager on cloudprovider.v1). Its path.
    pub fn tool(tool: &str) -> anyhow::Result<PathBuf> {
        let path = Self::setup(tool)?;
        if !path.is_file() {
            bail!("{tool}: {} does not exist", path.display());
        }
        Ok(path)
    }

    /// The directory `envtest/setup.sh <mode>` prints, building on first use: `cluster` for
    /// kubelet, kube-scheduler, kube-controller-manager, kube-proxy and pause, `e2e` for
    /// upstream's e2e.test, ginkgo and agnhost ([`crate::e2e_images`]).
    pub fn tool_dir(mode: &str) -> anyhow::Result<PathBuf> {
        let dir = Self::setup(mode)?;
        if !dir.is_dir() {
            bail!("{mode}: {} is not a directory", dir.display());
        }
        Ok(dir)
    }

    /// Runs `envtest/setup.sh <mode>` and returns the path it prints. setup.sh reports its
    /// progress on stderr (minutes when it builds): it is let through.
    fn setup(mode: &str) -> anyhow::Result<PathBuf> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("envtest/setup.sh");
        let out = Command::new("bash")
            .arg(&script)
            .arg(mode)
            .stderr(std::process::Stdio::inherit())
            .output()
            .with_context(|| format!("running {} {mode}", script.display()))?;
        if !out.status.success() {
            bail!("{} {mode} failed (its output is above)", script.display());
        }
        Ok(PathBuf::from(String::from_utf8(out.stdout).context("setup.sh printed a non-UTF-8 path")?.trim()))
    }

    fn in_dir(dir: &Path) -> Self {
        Self { kube_apiserver: dir.join("kube-apiserver"), etcd: dir.join("etcd"), kubectl: dir.join("kubectl") }
    }

    fn checked(self) -> anyhow::Result<Self> {
        for path in [&self.kube_apiserver, &self.etcd, &self.kubectl] {
            if !path.is_file() {
                bail!("control plane binary {} does not exist", path.display());
            }
        }
        Ok(self)
    }
}
