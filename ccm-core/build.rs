//! Stamps the git commit into `--version`: `CCM_GIT_COMMIT` when the build sets it (image
//! builds, which see no `.git`), else the repository's HEAD, else "unknown"; and the build
//! date: `SOURCE_DATE_EPOCH` when set (reproducible builds), else the commit's date.

use std::process::Command;

fn git(top: &std::path::Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).current_dir(top).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string()).filter(|c| !c.is_empty())
}

fn main() {
    println!("cargo:rerun-if-env-changed=CCM_GIT_COMMIT");
    println!("cargo:rerun-if-env-changed=SOURCE_DATE_EPOCH");
    let top = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for path in [".git/HEAD", ".git/refs/heads", ".git/packed-refs"] {
        if top.join(path).exists() {
            println!("cargo:rerun-if-changed={}", top.join(path).display());
        }
    }
    let commit = std::env::var("CCM_GIT_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(|| git(&top, &["rev-parse", "--short=12", "HEAD"]));
    let commit = commit.map(|c| c.chars().take(12).collect::<String>()).unwrap_or_else(|| "unknown".into());
    let epoch = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .filter(|e| !e.trim().is_empty())
        .or_else(|| git(&top, &["log", "-1", "--format=%ct"]))
        .unwrap_or_default();
    println!("cargo:rustc-env=CCM_VERSION={} (commit {commit})", env!("CARGO_PKG_VERSION"));
    println!("cargo:rustc-env=CCM_GIT_COMMIT={commit}");
    println!("cargo:rustc-env=CCM_BUILD_EPOCH={}", epoch.trim());
}
