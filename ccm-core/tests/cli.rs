//! The binary answers `--version` and `--help` with no cluster and no provider, and rejects
//! bad flags with a clear message.

use std::process::Command;

fn ccm(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_cloud-controller-manager"))
        .args(args)
        .env_remove("KUBECONFIG")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .expect("run the binary")
}

#[test]
fn version_and_help_need_no_cluster() {
    let out = ccm(&["--version"]);
    assert!(out.status.success());
    // The version and the commit it was built from.
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    // As upstream's (`Kubernetes v1.37.2`, which scripts cut at the second word), then ours.
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("Kubernetes v1.37.2 (ccm-rs {} (commit {head}))", env!("CARGO_PKG_VERSION"))
    );
    let out = ccm(&["--version=raw"]);
    assert!(out.status.success());
    let raw = String::from_utf8_lossy(&out.stdout);
    assert!(raw.starts_with(r#"version.Info{Major:"1", Minor:"37", "#), "{raw}");
    assert!(raw.contains(&format!(r#"GitCommit:"{head}""#)), "{raw}");
    let out = ccm(&["--version=sure"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--version=sure"));
    let out = ccm(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in
        ["--provider-endpoint", "--cluster-name", "--controllers", "--leader-elect", "--secure-port", "--node-monitor-period"]
    {
        assert!(help.contains(flag), "--help lacks {flag}");
    }
}

#[test]
fn bad_flags_are_clear_errors() {
    let out = ccm(&["--node-monitor-period", "soon"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a duration"));
    let out = ccm(&["--controllers", "nodes", "--kubeconfig", "/nonexistent"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown controller \"nodes\""));
    // Absurd durations and timings that cannot work: refused with a sentence, no panic.
    for (args, says) in [
        (&["--node-monitor-period", "100000000years"][..], "longer than a year"),
        (&["--provider-mutation-timeout", "500000000000s"][..], "longer than a year"),
        (
            &["--leader-elect-retry-period", "10s", "--kubeconfig", "/nonexistent"][..],
            "--leader-elect-retry-period must be shorter",
        ),
        (&["--kube-api-read-timeout", "5s", "--kubeconfig", "/nonexistent"][..], "at least 20s"),
    ] {
        let out = ccm(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(says), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    // Outside a cluster without --kubeconfig: says so, does not hang.
    let out = ccm(&[]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not running in a cluster"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
