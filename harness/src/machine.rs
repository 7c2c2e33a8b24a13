//! What the machine has: checked before anything is built for it.
//!
//! A test that needs a tool this machine lacks says so in one line and skips, or fails where
//! CI requires it (`CCM_E2E_REQUIRE_*`); it must find out *before* it spends minutes building
//! for it. A fresh machine once spent 16 minutes of `cargo test` and then failed in the image
//! build (`musl-gcc not found`) instead of skipping the real-kubelet test, because the images
//! were built before the kubelet cluster checked the machine.

use std::process::{Command, Stdio};

/// The machine cannot do something a test or a tool needs: the sentence says why.
#[derive(Debug, Clone)]
pub struct Unavailable(pub String);

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unavailable {}

/// Whether `tool` is a command on this process's `PATH`.
pub fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| {
            let file = dir.join(tool);
            file.is_file()
                && std::fs::metadata(&file).is_ok_and(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0)
        })
    })
}

/// `Err` naming every one of `tools` that is not on `PATH`, for `what`, each with its `hint`
/// (where the tool comes from): a user installs them all at once, not one per run.
pub fn require(what: &str, tools: &[(&str, &str)]) -> Result<(), Unavailable> {
    let missing: Vec<String> =
        tools.iter().filter(|(tool, _)| !on_path(tool)).map(|(tool, hint)| format!("{tool} ({hint})")).collect();
    match missing.as_slice() {
        [] => Ok(()),
        [one] => Err(Unavailable(format!("{what} needs {one} on PATH"))),
        many => Err(Unavailable(format!("{what} needs on PATH: {}", many.join(", ")))),
    }
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").ok().is_some_and(|s| {
        s.lines().find(|l| l.starts_with("Uid:")).and_then(|l| l.split_whitespace().nth(1)).is_some_and(|uid| uid == "0")
    })
}

/// Whether `python3` has the `venv` and `ensurepip` modules (a virtualenv with pip).
pub fn python_venv() -> Result<(), Unavailable> {
    require("a Python virtualenv", &[("python3", "Debian: python3")])?;
    let ok = Command::new("python3")
        .args(["-c", "import venv, ensurepip"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        Ok(())
    } else {
        Err(Unavailable("a Python virtualenv needs python3's venv and ensurepip modules (Debian: python3-venv)".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_tool_is_named_with_where_it_comes_from() {
        assert!(on_path("sh"));
        assert!(!on_path("no-such-tool-ccm-rs"));
        let e = require("the thing", &[("sh", "-"), ("no-such-tool-ccm-rs", "Debian: nothing")]).expect_err("missing");
        assert_eq!(e.to_string(), "the thing needs no-such-tool-ccm-rs (Debian: nothing) on PATH");
        let both = [("no-such-tool-ccm-rs", "Debian: nothing"), ("sh", "-"), ("nor-this-one", "Debian: neither")];
        let e = require("the thing", &both).expect_err("missing");
        assert_eq!(
            e.to_string(),
            "the thing needs on PATH: no-such-tool-ccm-rs (Debian: nothing), nor-this-one (Debian: neither)"
        );
    }
}
