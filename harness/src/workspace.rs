//! The workspace's own binaries, built on demand for the test or example that runs them.
//!
//! `cargo test` builds test targets and the binaries of the packages it tests that have
//! integration tests, not every package's binaries: `ccm-bench`, for one, is built by
//! `cargo build`, never by `cargo test`. A test that looked for `target/debug/ccm-bench` passed
//! in CI, whose script built the binaries before the tests, and failed on a newcomer's fresh
//! clone (issue 53). So a test that runs a binary of another package asks [`binary`], which
//! builds the workspace's binaries first, once per process, in the same target directory and
//! profile as the running test (cargo has nothing to do when they are up to date, and a stale
//! binary from an earlier build is never run).
//!
//! The build is `cargo build --workspace --bins --examples`: examples pull in the
//! dev-dependencies' features, as `cargo test --workspace` does, so the dependencies resolve
//! to the very artifacts the test build made and only the missing binaries are compiled
//! (`--bins` alone would build the dependency tree again without `tokio/test-util` and the
//! like), and it runs without the variables cargo sets for the test (see
//! [`Place::build`]). Several tests may ask at once: one build runs per process and the others wait for
//! it; several processes wait on cargo's own lock on the target directory.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use anyhow::{Context, bail};

/// What one process's build ended with (`None` until one ran).
static BUILT: Mutex<Option<Result<(), String>>> = Mutex::new(None);

/// The path of the workspace binary `name` (`cloud-controller-manager`, `ccm-provider-sim`,
/// `ccm-bench`, `ccm-conformance`, …), built first: see the module's documentation.
pub fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let place = Place::of_current_exe()?;
    {
        let mut built = BUILT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if built.is_none() {
            *built = Some(place.build().map_err(|e| format!("{e:#}")));
        }
        if let Some(Err(e)) = built.as_ref() {
            bail!("{e}");
        }
    }
    let path = place.profile_dir.join(name);
    if !path.is_file() {
        bail!(
            "{} does not exist after `cargo build --workspace --bins --examples`: no binary of the workspace is named {name}",
            path.display()
        );
    }
    Ok(path)
}

/// Where the running test or example was built: its profile's directory and what cargo needs
/// to build into the same one.
#[derive(Debug, PartialEq)]
struct Place {
    /// `target/<profile>` or `target/<triple>/<profile>`: the binaries go here.
    profile_dir: PathBuf,
    /// The arguments that select that directory: `--profile`, `--target-dir`, `--target`.
    args: Vec<String>,
}

impl Place {
    fn of_current_exe() -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("finding the running test's path")?;
        Self::of(&exe)
    }

    /// Test and example binaries live one level below their profile's directory
    /// (`target/debug/deps/e2e-…`, `target/debug/examples/lb_suite`); the target directory's
    /// root holds `CACHEDIR.TAG`, so a `target/<triple>/<profile>` layout is told from
    /// `target/<profile>`.
    fn of(exe: &Path) -> anyhow::Result<Self> {
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .with_context(|| format!("{} is not inside a cargo target directory", exe.display()))?
            .to_path_buf();
        let profile = profile_dir
            .file_name()
            .and_then(|n| n.to_str())
            .with_context(|| format!("{} has no profile name", profile_dir.display()))?;
        // cargo names the `dev` profile's directory `debug`; every other profile's after it.
        let profile = if profile == "debug" { "dev" } else { profile };
        let parent = profile_dir.parent().context("a profile directory has a parent")?;
        let mut args = vec![format!("--profile={profile}")];
        if parent.join("CACHEDIR.TAG").is_file() || !parent.parent().is_some_and(|p| p.join("CACHEDIR.TAG").is_file()) {
            args.push(format!("--target-dir={}", parent.display()));
        } else {
            let triple = parent.file_name().and_then(|n| n.to_str()).context("a target triple's directory")?;
            let root = parent.parent().context("a target directory")?;
            args.push(format!("--target-dir={}", root.display()));
            args.push(format!("--target={triple}"));
        }
        Ok(Self { profile_dir, args })
    }

    fn build(&self) -> anyhow::Result<()> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        // The cargo that runs this test (cargo sets CARGO for what it runs), else the PATH's.
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(&cargo);
        cmd.args(["build", "--quiet", "--workspace", "--bins", "--examples"]).args(&self.args).current_dir(&root);
        // Cargo runs a test with the variables of its package (CARGO_MANIFEST_DIR,
        // CARGO_PKG_*, …). Passed on, they reach build scripts that watch them (ring's does),
        // which then run again and rebuild everything above them, here and in the next
        // `cargo test`: the build must see the environment the user's cargo saw.
        for (key, _) in std::env::vars_os() {
            if key.to_str().is_some_and(set_by_cargo_for_a_test) {
                cmd.env_remove(&key);
            }
        }
        eprintln!(
            "building the workspace's binaries for the tests that run them (cargo build --workspace --bins --examples {}; minutes the first time)",
            self.args.join(" ")
        );
        let status = cmd.status().with_context(|| format!("running {}", Path::new(&cargo).display()))?;
        if !status.success() {
            bail!("cargo build --workspace --bins --examples {} failed ({status}; its output is above)", self.args.join(" "));
        }
        Ok(())
    }
}

/// Whether `key` is one of the variables cargo sets for the test binaries it runs (never one
/// a user sets to configure cargo, such as CARGO_HOME or CARGO_TARGET_DIR).
fn set_by_cargo_for_a_test(key: &str) -> bool {
    const SET: [&str; 7] = [
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "OUT_DIR",
    ];
    SET.contains(&key) || key.starts_with("CARGO_PKG_") || key.starts_with("CARGO_BIN_EXE_")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_test_in_the_default_target_directory_builds_its_profile_there() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("target");
        std::fs::create_dir_all(target.join("debug/deps")).expect("mkdir");
        std::fs::write(target.join("CACHEDIR.TAG"), "").expect("tag");
        let place = Place::of(&target.join("debug/deps/e2e-0123")).expect("place");
        assert_eq!(place.profile_dir, target.join("debug"));
        assert_eq!(place.args, vec!["--profile=dev".to_string(), format!("--target-dir={}", target.display())]);

        let place = Place::of(&target.join("release/examples/lb_suite")).expect("place");
        assert_eq!(place.args[0], "--profile=release");
    }

    #[test]
    fn a_test_built_for_a_target_triple_builds_for_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("target");
        std::fs::create_dir_all(target.join("x86_64-unknown-linux-musl/debug/deps")).expect("mkdir");
        std::fs::write(target.join("CACHEDIR.TAG"), "").expect("tag");
        let place = Place::of(&target.join("x86_64-unknown-linux-musl/debug/deps/e2e-0123")).expect("place");
        assert_eq!(place.profile_dir, target.join("x86_64-unknown-linux-musl/debug"));
        assert_eq!(
            place.args,
            vec![
                "--profile=dev".to_string(),
                format!("--target-dir={}", target.display()),
                "--target=x86_64-unknown-linux-musl".to_string()
            ]
        );
    }

    #[test]
    fn the_nested_build_drops_what_cargo_set_for_the_test_and_keeps_what_the_user_set() {
        for key in ["CARGO_MANIFEST_DIR", "CARGO_PKG_NAME", "CARGO_PKG_VERSION_MAJOR", "CARGO_BIN_EXE_ccm-bench", "OUT_DIR"] {
            assert!(set_by_cargo_for_a_test(key), "{key}");
        }
        for key in ["CARGO_HOME", "CARGO_TARGET_DIR", "CARGO_INCREMENTAL", "CARGO_BUILD_JOBS", "CARGO", "RUSTFLAGS", "PATH"] {
            assert!(!set_by_cargo_for_a_test(key), "{key}");
        }
    }

    #[test]
    fn a_binary_outside_a_target_directory_is_refused() {
        assert!(Place::of(Path::new("/e2e")).is_err());
    }
}
