//! Kubernetes' own e2e suite and the images its `[sig-network] LoadBalancers` tests run
//! (`test/e2e/network/loadbalancer.go` of the release pinned in `envtest/go.mod`), for the
//! kubelet cluster, which has no registry to pull them from.
//!
//! `envtest/setup.sh e2e` builds `e2e.test`, `ginkgo` and `agnhost` from Go modules
//! ([`upstream_e2e`]). The one image those tests run is agnhost ([`AGNHOST`]: their backends,
//! exec pods and the pause Deployment, whose container is `agnhost pause`; the sandbox image is
//! the cluster's own). Upstream's agnhost is Alpine plus curl, netcat-openbsd, bind-tools and
//! more; [`upstream_test_images`] builds one under the same name from `agnhost` and this
//! machine's tools: a static busybox for the small commands, and Debian's dash (`/bin/sh`),
//! curl, GNU wget and OpenBSD netcat with the shared libraries `ldd` names and the dynamic
//! loader. Debian's busybox has neither `nc -u -v` nor a `wget -T` that works, and its shell
//! runs its own applets before any command on PATH: it cannot be `/bin/sh`. What the tests
//! exec in its containers, each through `/bin/sh -c` or `/bin/sh -x -c`:
//! - `echo hostName | nc -v -t -w 2 HOST PORT` and `... nc -v -u -w 2 HOST PORT` (the jig's
//!   reachability checks, by Service name, ClusterIP and node port);
//! - `wget -T 5 -qO- "IP"` (the load balancer source ranges test);
//! - `curl -g -q -s -o /dev/null -w %{http_code} http://IP:PORT/healthz` (health check node
//!   ports, from NetworkingTestConfig's test container);
//! - `curl -q -s --connect-timeout 30 IP:PORT/clientip` (ExternalTrafficPolicy Local from pods).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::{Context, bail};

use crate::assets::Assets;
use crate::machine::{self, Unavailable};

/// The agnhost image the pinned release's tests run (`test/utils/image/manifest.go`);
/// [`upstream_test_images`] checks that `e2e.test --list-images` still names it.
pub const AGNHOST: &str = "registry.k8s.io/e2e-test-images/agnhost:2.66.1";

/// Where the image's tools come from: the command on this machine's PATH, its package, and its
/// path in the image. Busybox's applets of the same names are left out.
const TOOLS: &[(&str, &str, &str)] = &[
    ("dash", "Debian: dash", "/bin/sh"),
    ("curl", "Debian: curl", "/usr/bin/curl"),
    ("wget", "Debian: wget", "/usr/bin/wget"),
    ("nc.openbsd", "Debian: netcat-openbsd; .ci/run installs it", "/usr/bin/nc"),
];

/// Busybox: the small commands (`ls`, `ps`, `ip`, `nslookup`, ...), each a symbolic link to it.
const BUSYBOX: (&str, &str) = ("busybox", "Debian: busybox-static; .ci/run installs it");

/// Upstream's PATH (Alpine's).
const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Checks what building the e2e suite and its image needs from the machine, before any build
/// starts.
pub fn check_machine() -> Result<(), Unavailable> {
    let mut tools = vec![("go", "go.dev/dl"), ("python3", "Debian: python3"), ("ldd", "Debian: libc-bin"), BUSYBOX];
    tools.extend(TOOLS.iter().map(|&(tool, hint, _)| (tool, hint)));
    machine::require("building the upstream e2e suite and its agnhost image", &tools)
}

/// The upstream e2e suite's binaries, of the release pinned in `envtest/go.mod`.
#[derive(Debug, Clone)]
pub struct UpstreamE2e {
    /// `e2e.test`: `go test -c k8s.io/kubernetes/test/e2e`.
    pub e2e_test: PathBuf,
    /// `ginkgo` (v2), the version `envtest/go.mod` resolves.
    pub ginkgo: PathBuf,
    /// `agnhost` (static), what [`AGNHOST`] runs.
    pub agnhost: PathBuf,
}

/// `e2e.test`, `ginkgo` and `agnhost`, built by `envtest/setup.sh e2e` on first use (minutes
/// on a cold Go cache) and cached beside the control plane.
pub fn upstream_e2e() -> anyhow::Result<UpstreamE2e> {
    let dir = Assets::tool_dir("e2e")?;
    let e2e = UpstreamE2e { e2e_test: dir.join("e2e.test"), ginkgo: dir.join("ginkgo"), agnhost: dir.join("agnhost") };
    for path in [&e2e.e2e_test, &e2e.ginkgo, &e2e.agnhost] {
        if !path.is_file() {
            bail!("setup.sh e2e: {} does not exist", path.display());
        }
    }
    Ok(e2e)
}

static BUILT: OnceLock<Result<Vec<PathBuf>, String>> = OnceLock::new();

/// Builds (once per process) the archives of every image the LoadBalancers tests run, into
/// `target/ccm-images/`, for [`crate::kubelet_cluster`]'s containerd: today [`AGNHOST`] alone.
/// `build.py` writes each archive under a name of its own and renames it into place, so two
/// processes building at once do not meet.
pub fn upstream_test_images() -> anyhow::Result<Vec<PathBuf>> {
    BUILT.get_or_init(|| build_all().map_err(|e| format!("{e:#}"))).clone().map_err(|e| anyhow::anyhow!("{e}"))
}

fn build_all() -> anyhow::Result<Vec<PathBuf>> {
    check_machine()?;
    let e2e = upstream_e2e()?;
    check_named(&e2e.e2e_test, AGNHOST)?;
    let out = repo().join("target/ccm-images").join(archive_name(AGNHOST));
    build_agnhost(&e2e.agnhost, &out)?;
    Ok(vec![out])
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `registry.k8s.io/e2e-test-images/agnhost:2.66.1` -> `agnhost-2.66.1.tar`.
fn archive_name(image: &str) -> String {
    let last = image.rsplit('/').next().unwrap_or(image);
    format!("{}.tar", last.replace(':', "-"))
}

/// Fails unless `e2e.test --list-images` names `image`: a release bump that moved the tag must
/// move [`AGNHOST`] too, or the tests would ask for an image no node has.
fn check_named(e2e_test: &Path, image: &str) -> anyhow::Result<()> {
    let out = Command::new(e2e_test)
        .arg("--list-images")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .with_context(|| format!("running {} --list-images", e2e_test.display()))?;
    if !out.status.success() {
        bail!("{} --list-images failed with {}", e2e_test.display(), out.status);
    }
    if !String::from_utf8_lossy(&out.stdout).lines().any(|l| l.trim() == image) {
        bail!("{} --list-images does not name {image}: update e2e_images::AGNHOST", e2e_test.display());
    }
    Ok(())
}

/// The agnhost image: `/agnhost` (entrypoint, `pause` by default, as upstream's Dockerfile
/// has it), busybox and its applets, [`TOOLS`] with their libraries, the few files of `/etc`
/// upstream's image has that matter here, and a `/etc/wgetrc` that makes GNU wget try once.
fn build_agnhost(agnhost: &Path, out: &Path) -> anyhow::Result<()> {
    let busybox = which(BUSYBOX.0).with_context(|| format!("{} is not on PATH ({})", BUSYBOX.0, BUSYBOX.1))?;
    let mut files: BTreeMap<String, PathBuf> = BTreeMap::new();
    files.insert("/agnhost".into(), agnhost.to_path_buf());
    files.insert("/bin/busybox".into(), busybox.clone());
    files.extend(libraries(&busybox)?);
    for &(tool, hint, dest) in TOOLS {
        let path = which(tool).with_context(|| format!("{tool} is not on PATH ({hint})"))?;
        files.extend(libraries(&path)?);
        files.insert(dest.into(), path);
    }
    let etc = tempfile::tempdir().context("creating a directory for the image's /etc")?;
    for (name, text) in [
        (
            "passwd",
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/sbin/nologin\nuser-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh\n",
        ),
        (
            "group",
            "root:x:0:root\nnogroup:x:65534:\nuser-defined-in-image:x:1000:\ngroup-defined-in-image:x:50000:user-defined-in-image\n",
        ),
        ("nsswitch.conf", "hosts: files dns\n"),
        // One try, as upstream's image's busybox wget makes: GNU wget's default of 20 tries
        // (with back-off) made each "blocked" check of the source ranges test take about
        // 245 s instead of its `-T 5`, some 13 minutes of the suite.
        ("wgetrc", "tries = 1\n"),
    ] {
        let path = etc.path().join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        files.insert(format!("/etc/{name}"), path);
    }
    let applets = Command::new(&busybox)
        .arg("--list-full")
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {} --list-full", busybox.display()))?;
    if !applets.status.success() {
        bail!("{} --list-full failed with {}", busybox.display(), applets.status);
    }
    let mut symlinks = applet_links(&String::from_utf8_lossy(&applets.stdout), &files);
    // Upstream's image has it (the entrypoint tests override the entrypoint with it).
    symlinks.insert("/agnhost-2".into(), "agnhost".into());

    let mut cmd = Command::new("python3");
    cmd.arg(repo().join("deploy/images/build.py"));
    for (dest, src) in &files {
        cmd.arg("--file").arg(format!("{}:{dest}", src.display()));
    }
    for (link, target) in &symlinks {
        cmd.arg("--symlink").arg(format!("{link}:{target}"));
    }
    cmd.args(["--dir", "/uploads", "--entrypoint", "/agnhost", "--cmd", "pause", "--env"])
        .arg(format!("PATH={PATH}"))
        .args(["--tag", AGNHOST, "--out"])
        .arg(out)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit());
    let status = cmd.status().with_context(|| format!("running build.py for {AGNHOST}"))?;
    if !status.success() {
        bail!("building {AGNHOST} failed (its output is above)");
    }
    Ok(())
}

/// Busybox's applets (`busybox --list-full`: `bin/sh`, `usr/bin/wget`, ...) as symbolic links to
/// `/bin/busybox`, but none where `files` has a file or for a command `files` has in a `bin`
/// directory.
fn applet_links(list_full: &str, files: &BTreeMap<String, PathBuf>) -> BTreeMap<String, String> {
    let provided = |name: &str| {
        files.keys().any(|dest| matches!(dest.rsplit_once('/'), Some((dir, file)) if file == name && dir.ends_with("bin")))
    };
    list_full
        .lines()
        .map(str::trim)
        .filter(|line| line.contains('/'))
        .filter_map(|line| {
            let link = format!("/{line}");
            let name = line.rsplit('/').next()?;
            (!files.contains_key(&link) && !provided(name)).then(|| (link, "/bin/busybox".to_string()))
        })
        .collect()
}

/// The shared libraries and the dynamic loader `binary` needs, by `ldd`: image path ->
/// this machine's file (the same path). None for a static binary.
fn libraries(binary: &Path) -> anyhow::Result<BTreeMap<String, PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running ldd {}", binary.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        if String::from_utf8_lossy(&out.stderr).contains("not a dynamic executable") {
            return Ok(BTreeMap::new());
        }
        bail!("ldd {} failed with {}: {}", binary.display(), out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    parse_ldd(&text).with_context(|| format!("ldd {}", binary.display()))
}

/// The paths of `ldd`'s output: `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)` and
/// `/lib64/ld-linux-x86-64.so.2 (0x...)`; the vDSO has none.
fn parse_ldd(text: &str) -> anyhow::Result<BTreeMap<String, PathBuf>> {
    let mut libs = BTreeMap::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let path = match line.split_once("=>") {
            Some((name, target)) => {
                let target = target.trim();
                if target.starts_with("not found") {
                    bail!("{} is not found", name.trim());
                }
                target.split_whitespace().next().filter(|p| p.starts_with('/'))
            }
            None => line.split_whitespace().next().filter(|p| p.starts_with('/')),
        };
        if let Some(path) = path {
            libs.insert(path.to_string(), PathBuf::from(path));
        }
    }
    Ok(libs)
}

/// The file `tool` names on this process's PATH.
fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(tool)).find(|file| file.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_gives_the_libraries_and_the_loader() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                    \tlibbsd.so.0 => /lib/x86_64-linux-gnu/libbsd.so.0 (0x00007f40)\n\
                    \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f41)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f42)\n";
        let libs = parse_ldd(text).expect("parses");
        assert_eq!(
            libs.keys().map(String::as_str).collect::<Vec<_>>(),
            ["/lib/x86_64-linux-gnu/libbsd.so.0", "/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"]
        );
        let e = parse_ldd("\tlibgone.so.1 => not found\n").expect_err("a missing library");
        assert!(e.to_string().contains("libgone.so.1"), "{e}");
    }

    #[test]
    fn applets_leave_out_what_a_real_tool_provides() {
        let files: BTreeMap<String, PathBuf> = [
            ("/usr/bin/nc".to_string(), PathBuf::from("/bin/nc.openbsd")),
            ("/bin/busybox".into(), "/bin/busybox".into()),
            ("/etc/passwd".into(), "/tmp/passwd".into()),
        ]
        .into_iter()
        .collect();
        let links = applet_links("bin/sh\nbin/nc\nsbin/ip\nlinuxrc\nbin/busybox\nusr/bin/passwd\n", &files);
        assert_eq!(links.keys().map(String::as_str).collect::<Vec<_>>(), ["/bin/sh", "/sbin/ip", "/usr/bin/passwd"]);
        assert!(links.values().all(|t| t == "/bin/busybox"));
    }

    #[test]
    fn the_archive_is_named_after_the_image() {
        assert_eq!(archive_name(AGNHOST), "agnhost-2.66.1.tar");
    }

    #[test]
    #[ignore = "builds e2e.test, ginkgo and agnhost on first use: minutes on a cold Go cache"]
    fn the_agnhost_archive_is_an_oci_layout_naming_the_image() {
        if let Err(e) = check_machine() {
            eprintln!("skipped: {e}");
            return;
        }
        let archives = upstream_test_images().expect("builds");
        assert_eq!(archives.len(), 1);
        let index = Command::new("tar").arg("-xOf").arg(&archives[0]).arg("index.json").output().expect("runs tar");
        assert!(index.status.success(), "{}", String::from_utf8_lossy(&index.stderr));
        let index: serde_json::Value = serde_json::from_slice(&index.stdout).expect("index.json is JSON");
        assert_eq!(index["manifests"][0]["annotations"]["io.containerd.image.name"], AGNHOST);
    }
}
