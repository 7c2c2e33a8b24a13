//! The project's images, built from `deploy/images/*.Containerfile` by `deploy/images/build.py`
//! (static musl binaries, no container engine, no registry) as OCI archives for the kubelet
//! cluster's containerd. Built once per test process; cargo makes a rebuild cheap.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::{Context, bail};

use crate::machine::{self, Unavailable};

/// Checks what building the images needs from the machine (`build.py`, and
/// `build-binaries.sh`'s static musl build), before any build starts.
pub fn check_machine() -> Result<(), Unavailable> {
    machine::require(
        "building the images",
        &[
            ("python3", "Debian: python3"),
            ("cargo", "rustup"),
            ("rustup", "it adds the Rust target x86_64-unknown-linux-musl"),
            ("musl-gcc", "Debian: musl-tools; .ci/run installs it"),
        ],
    )
}

/// Checks, beside [`check_machine`], what the AWS provider's image needs (Go).
pub fn check_machine_aws() -> Result<(), Unavailable> {
    check_machine()?;
    machine::require("building the AWS provider's image", &[("go", "go.dev/dl")])
}

/// The tag the chart and the kustomize bases name (the chart's appVersion).
pub const TAG: &str = "0.1.0";
/// The core image.
pub const CORE: &str = "ghcr.io/ccm-rs/cloud-controller-manager";
/// The simulated cloud's provider image.
pub const PROVIDER_SIM: &str = "ghcr.io/ccm-rs/provider-sim";
/// The AWS provider image (k8s.io/cloud-provider-aws behind the go-adapter).
pub const PROVIDER_AWS: &str = "ghcr.io/ccm-rs/provider-aws";

/// The image archives.
#[derive(Debug, Clone)]
pub struct Images {
    /// `ghcr.io/ccm-rs/cloud-controller-manager:0.1.0`.
    pub core: PathBuf,
    /// `ghcr.io/ccm-rs/provider-sim:0.1.0`.
    pub provider_sim: PathBuf,
}

impl Images {
    /// Both archives, as paths.
    pub fn archives(&self) -> Vec<PathBuf> {
        vec![self.core.clone(), self.provider_sim.clone()]
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Builds one Containerfile into `out` as `name:tag`.
pub fn build(containerfile: &str, name: &str, tag: &str, out: &Path) -> anyhow::Result<()> {
    let repo = repo();
    let commit = Command::new("git").args(["rev-parse", "HEAD"]).current_dir(&repo).output().ok();
    let commit = commit.filter(|o| o.status.success()).map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let mut cmd = Command::new("python3");
    cmd.arg(repo.join("deploy/images/build.py"))
        .arg(repo.join("deploy/images").join(containerfile))
        .args(["--build-arg", "BASE_IMAGE=scratch", "--build-arg", &format!("VERSION={tag}")])
        .args(commit.map(|c| format!("--build-arg=GIT_COMMIT={c}")))
        .arg("--tag")
        .arg(format!("{name}:{tag}"))
        .arg("--out")
        .arg(out)
        .current_dir(&repo)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit());
    let status = cmd.status().with_context(|| format!("running build.py for {containerfile}"))?;
    if !status.success() {
        bail!("building {containerfile} failed (its output is above)");
    }
    Ok(())
}

static BUILT: OnceLock<Result<Images, String>> = OnceLock::new();

/// Builds (once per process) the core and the sim provider images, tagged [`TAG`].
pub fn project() -> anyhow::Result<Images> {
    BUILT
        .get_or_init(|| {
            let dir = repo().join("target/ccm-images");
            let images = Images { core: dir.join("core.tar"), provider_sim: dir.join("provider-sim.tar") };
            build("core.Containerfile", CORE, TAG, &images.core)
                .and_then(|()| build("provider-sim.Containerfile", PROVIDER_SIM, TAG, &images.provider_sim))
                .map(|()| images)
                .map_err(|e| format!("{e:#}"))
        })
        .clone()
        .map_err(|e| anyhow::anyhow!("{e}"))
}

static BUILT_AWS: OnceLock<Result<PathBuf, String>> = OnceLock::new();

/// Builds (once per process) the AWS provider image, tagged [`TAG`]; its archive's path.
pub fn provider_aws() -> anyhow::Result<PathBuf> {
    BUILT_AWS
        .get_or_init(|| {
            let out = repo().join("target/ccm-images/provider-aws.tar");
            build("provider-aws.Containerfile", PROVIDER_AWS, TAG, &out).map(|()| out).map_err(|e| format!("{e:#}"))
        })
        .clone()
        .map_err(|e| anyhow::anyhow!("{e}"))
}
