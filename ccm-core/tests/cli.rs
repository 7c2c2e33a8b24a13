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

/// Every default the documentation quotes for a flag (``--flag` (value)`, ``--flag` (default
/// value)`, `default `--flag=value``) is the one the binary's `--help` states: docs that
/// disagree with the code are caught here rather than by an operator.
#[test]
fn the_documented_defaults_are_the_binarys() {
    let out = ccm(&["--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    // `--flag …` on a line of its own, then its `[default: …]` lines later.
    let mut defaults = std::collections::BTreeMap::new();
    let mut flag: Option<String> = None;
    for line in help.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("--").or_else(|| line.split_once(", --").map(|(_, r)| r)) {
            let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '-').collect();
            flag = Some(format!("--{name}"));
        } else if let (Some(value), Some(f)) = (line.strip_prefix("[default: ").and_then(|l| l.strip_suffix(']')), &flag) {
            defaults.insert(f.clone(), value.to_string());
        }
    }
    assert!(defaults.len() > 40, "--help's defaults were not found: {defaults:?}");
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let mut checked = Vec::new();
    for doc in ["ccm-core/README.md", "deploy/README.md", "README.md", "ARCHITECTURE.md"] {
        let text = std::fs::read_to_string(format!("{root}/{doc}")).expect("doc").replace('\n', " ");
        for (flag, quoted) in quoted_defaults(&text) {
            let Some(default) = defaults.get(&flag) else { continue };
            assert!(
                same_value(&quoted, default),
                "{doc} says {flag} defaults to {quoted:?}, but `cloud-controller-manager --help` says {default:?}"
            );
            checked.push(format!("{flag}={quoted}"));
        }
    }
    assert!(checked.len() >= 15, "only {} documented defaults found: {checked:?}", checked.len());
}

/// (flag, value) for each ``--flag` (value)`, ``--flag` (default value)` and
/// `default `--flag=value`` in `text`, where the value looks like one (a number, a duration,
/// a boolean or a word without spaces), not a remark.
fn quoted_defaults(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("`--") {
        let tail = &rest[start + 1..];
        let Some(end) = tail.find('`') else { break };
        let code = &tail[..end];
        let after = &tail[end + 1..];
        let before = &rest[..start];
        rest = after;
        if let Some((flag, value)) = code.split_once('=') {
            if before.trim_end().ends_with("default") || after.trim_start().starts_with("by default") {
                out.push((flag.to_string(), value.to_string()));
            }
            continue;
        }
        let Some(paren) = after.strip_prefix(" (") else { continue };
        let Some(close) = paren.find(')') else { continue };
        let inner = paren[..close].trim();
        let value = inner.strip_prefix("default ").unwrap_or(inner);
        if looks_like_a_value(value) {
            out.push((code.to_string(), value.to_string()));
        }
    }
    out
}

fn looks_like_a_value(v: &str) -> bool {
    let compact = v.replace(' ', "");
    v == "true"
        || v == "false"
        || compact.parse::<f64>().is_ok()
        || (compact.chars().next().is_some_and(|c| c.is_ascii_digit())
            && humantime::parse_duration(&compact.replace("min", "m")).is_ok())
}

/// Whether a documented value and a `--help` default are the same (`5 min` is `5m`, `2 s` is
/// `2s`, `0.10` is `0.1`).
fn same_value(documented: &str, default: &str) -> bool {
    let norm = |v: &str| v.replace(' ', "").replace("min", "m");
    let (d, h) = (norm(documented), norm(default));
    if d == h {
        return true;
    }
    if let (Ok(a), Ok(b)) = (d.parse::<f64>(), h.parse::<f64>()) {
        return a == b;
    }
    matches!((humantime::parse_duration(&d), humantime::parse_duration(&h)), (Ok(a), Ok(b)) if a == b)
}
