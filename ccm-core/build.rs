//! Stamps the git commit into `--version`: `CCM_GIT_COMMIT` when the build sets it (image
//! builds, which see no `.git`), else the repository's HEAD, else "unknown".

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=CCM_GIT_COMMIT");
    let top = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for path in [".git/HEAD", ".git/refs/heads", ".git/packed-refs"] {
        if top.join(path).exists() {
            println!("cargo:rerun-if-changed={}", top.join(path).display());
        }
    }
    let commit = std::env::var("CCM_GIT_COMMIT").ok().filter(|c| !c.trim().is_empty()).or_else(|| {
        let out = Command::new("git").args(["rev-parse", "--short=12", "HEAD"]).current_dir(&top).output().ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string()).filter(|c| !c.is_empty())
    });
    let commit = commit.map(|c| c.chars().take(12).collect::<String>()).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=CCM_VERSION={} (commit {commit})", env!("CARGO_PKG_VERSION"));
}
