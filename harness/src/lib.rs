//! # ccm-harness: a real control plane, a real kubelet cluster and the tools around them
//!
//! Starts a real etcd and kube-apiserver on loopback ([`ControlPlane`]), built from Go modules
//! by `envtest/setup.sh` or taken from envtest's variables ([`Assets`]), and emulates a
//! cluster without kubelets ([`cluster`]).
//!
//! One control plane is shared by all tests of a test binary ([`shared`]): measured here, a
//! start costs seconds, so one per test would dominate the run; tests isolate themselves with
//! a namespace and a Node-name prefix each ([`cluster::TestEnv`]).

pub mod assets;
pub mod aws;
pub mod cluster;
pub mod cluster_dns;
pub mod control_plane;
pub mod e2e_images;
pub mod images;
pub mod kubelet_cluster;
pub mod lb_suite;
pub mod machine;
pub mod pki;
pub mod workspace;

use std::sync::OnceLock;

pub use assets::Assets;
pub use control_plane::ControlPlane;

static SHARED: OnceLock<Result<ControlPlane, String>> = OnceLock::new();

/// The control plane shared by every test in this process, started on first use. It is never
/// dropped: its watchdog stops it and removes its directory when the process exits.
pub fn shared() -> anyhow::Result<&'static ControlPlane> {
    SHARED.get_or_init(|| ControlPlane::start().map_err(|e| format!("{e:#}"))).as_ref().map_err(|e| anyhow::anyhow!("{e}"))
}
