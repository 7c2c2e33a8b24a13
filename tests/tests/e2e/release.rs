//! The release, made as a maintainer makes it (`deploy/images/release.sh`, deploy/RELEASING.md)
//! in its check form: a registry on loopback and a throwaway key. The core image must come out
//! as a two-architecture index whose arm64 binary is an arm64 program (started under
//! qemu-aarch64 where the machine has it), with provenance labels, an SBOM per platform that
//! names what the binaries are built from, signatures that verify with the release's key and
//! not with another, offline from the saved layout too, and the same bytes when rebuilt.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use ccm_harness::machine;
use serde_json::Value;

/// Set in CI: a missing tool fails the test instead of skipping it.
const REQUIRE: &str = "CCM_E2E_REQUIRE_RELEASE";

/// The release's version: the workspace's (release.sh refuses another).
const VERSION: &str = env!("CARGO_PKG_VERSION");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// What the release needs of the machine, checked before anything is built.
fn machine_ready() -> bool {
    let cross = if std::env::consts::ARCH == "x86_64" {
        ("aarch64-linux-gnu-gcc", "Debian: gcc-aarch64-linux-gnu")
    } else {
        ("x86_64-linux-gnu-gcc", "Debian: gcc-x86-64-linux-gnu")
    };
    let tools = [
        ("go", "go.dev/dl"),
        ("python3", "Debian: python3"),
        ("curl", "Debian: curl"),
        ("musl-gcc", "Debian: musl-tools"),
        ("rustup", "rustup.rs"),
        cross,
    ];
    match machine::require("the release (deploy/images/release.sh)", &tools) {
        Ok(()) => true,
        Err(e) if std::env::var_os(REQUIRE).is_some() => panic!("{REQUIRE} is set and {e}"),
        Err(e) => {
            eprintln!("skipped: {e}");
            false
        }
    }
}

fn run(cmd: &mut Command, what: &str) -> std::process::Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The members of an OCI archive by name.
fn members(archive: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let out = run(Command::new("tar").arg("-tf").arg(archive), "tar -t");
    let mut files = std::collections::BTreeMap::new();
    for name in String::from_utf8_lossy(&out.stdout).lines().filter(|n| !n.ends_with('/')) {
        let data = run(Command::new("tar").arg("-xOf").arg(archive).arg(name), "tar -xO").stdout;
        files.insert(name.to_string(), data);
    }
    files
}

fn blob<'a>(files: &'a std::collections::BTreeMap<String, Vec<u8>>, digest: &str) -> &'a [u8] {
    let name = format!("blobs/sha256/{}", digest.trim_start_matches("sha256:"));
    files.get(&name).unwrap_or_else(|| panic!("{name} is not in the archive"))
}

fn json(data: &[u8]) -> Value {
    serde_json::from_slice(data).expect("JSON")
}

/// The file at `path` in a gzip'd layer.
fn file_in_layer(layer: &[u8], path: &str, dir: &Path) -> PathBuf {
    let gz = dir.join("layer.tar.gz");
    std::fs::write(&gz, layer).expect("write layer");
    let out = dir.join(path.trim_start_matches('/').replace('/', "_"));
    let data = run(Command::new("tar").arg("-xzOf").arg(&gz).arg(path.trim_start_matches('/')), "tar -xzO").stdout;
    std::fs::write(&out, data).expect("write binary");
    std::fs::set_permissions(&out, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    out
}

/// An ELF file's machine (62 x86-64, 183 AArch64).
fn elf_machine(path: &Path) -> u16 {
    let mut head = [0u8; 20];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut head)).expect("read ELF header");
    assert_eq!(&head[..4], b"\x7fELF", "{} is not an ELF file", path.display());
    u16::from_le_bytes([head[18], head[19]])
}

fn component_names(sbom: &Value) -> Vec<String> {
    sbom["components"].as_array().expect("components").iter().filter_map(|c| c["name"].as_str().map(String::from)).collect()
}

#[test]
fn the_release_images_are_multi_arch_signed_and_carry_their_sboms() {
    if !machine_ready() {
        return;
    }
    let repo = repo();
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("release");
    // A version other than the one the binaries report and the chart installs is refused
    // before anything is built.
    let refused = Command::new("bash")
        .arg(repo.join("deploy/images/release.sh"))
        .args(["--version", "9.9.9", "--images", "core", "--out"])
        .arg(&out)
        .output()
        .expect("release.sh");
    assert_eq!(refused.status.code(), Some(2), "{}", String::from_utf8_lossy(&refused.stderr));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("Cargo.toml says"));
    // The commit the release is made of (read before: a commit during the build is not it).
    let head = String::from_utf8(run(Command::new("git").arg("-C").arg(&repo).args(["rev-parse", "HEAD"]), "git").stdout)
        .expect("utf-8")
        .trim()
        .to_string();
    let t = std::time::Instant::now();
    run(
        Command::new("bash")
            .arg(repo.join("deploy/images/release.sh"))
            .args(["--version", VERSION, "--images", "core", "--out"])
            .arg(&out),
        "release.sh",
    );
    eprintln!("release.sh (core, amd64 and arm64) took {:.0?}", t.elapsed());

    // The archive: an index of both platforms, each image labelled with where it comes from.
    let archive = out.join(format!("core-{VERSION}.tar"));
    let files = members(&archive);
    let top = json(&files["index.json"]);
    let top = &top["manifests"][0];
    assert_eq!(top["mediaType"], "application/vnd.oci.image.index.v1+json", "a multi-arch index: {top}");
    assert_eq!(top["annotations"]["io.containerd.image.name"], format!("ghcr.io/ccm-rs/cloud-controller-manager:{VERSION}"));
    let index_digest = top["digest"].as_str().expect("digest").to_string();
    assert_eq!(
        std::fs::read_to_string(out.join(format!("core-{VERSION}.digest"))).expect("digest file").trim(),
        index_digest,
        "the digest pushed and signed is the archive's"
    );
    let index = json(blob(&files, &index_digest));
    let mut platforms = Vec::new();
    for manifest in index["manifests"].as_array().expect("manifests") {
        let arch = manifest["platform"]["architecture"].as_str().expect("architecture").to_string();
        let digest = manifest["digest"].as_str().expect("digest").to_string();
        let image = json(blob(&files, &digest));
        let config = json(blob(&files, image["config"]["digest"].as_str().expect("config")));
        assert_eq!(config["architecture"], arch.as_str());
        let labels = &config["config"]["Labels"];
        assert_eq!(labels["org.opencontainers.image.revision"], head.as_str(), "{labels}");
        assert_eq!(labels["org.opencontainers.image.version"], VERSION);
        assert_eq!(labels["org.opencontainers.image.source"], "https://github.com/ccm-rs/ccm-rs");
        assert_eq!(labels["org.opencontainers.image.licenses"], "Apache-2.0");
        let created = labels["org.opencontainers.image.created"].as_str().expect("created");
        assert!(created.starts_with("20") && created.ends_with('Z'), "created is the commit's time: {created}");
        assert_eq!(image["annotations"], *labels, "the manifest carries the labels as annotations");

        // The binary is one of its platform's.
        let layer = blob(&files, image["layers"][0]["digest"].as_str().expect("layer"));
        let scratch = dir.path().join(&arch);
        std::fs::create_dir_all(&scratch).expect("mkdir");
        let binary = file_in_layer(layer, "/usr/local/bin/cloud-controller-manager", &scratch);
        let want = if arch == "arm64" { 183 } else { 62 };
        assert_eq!(elf_machine(&binary), want, "{arch} image's binary");
        // No path of the machine that built it: a rebuild elsewhere gives the same bytes.
        let bytes = std::fs::read(&binary).expect("binary");
        let cargo_home = std::env::var("CARGO_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").expect("HOME")).join(".cargo"));
        for path in [repo.canonicalize().expect("repo"), cargo_home] {
            let path = path.to_string_lossy().into_owned();
            assert!(!bytes.windows(path.len()).any(|w| w == path.as_bytes()), "{arch} binary names {path}");
        }
        let runner = match (arch.as_str(), std::env::consts::ARCH) {
            ("amd64", "x86_64") | ("arm64", "aarch64") => Some(None),
            ("arm64", _) if machine::on_path("qemu-aarch64") => Some(Some("qemu-aarch64")),
            _ => None,
        };
        if let Some(runner) = runner {
            let mut cmd = match runner {
                Some(qemu) => {
                    let mut c = Command::new(qemu);
                    c.arg(&binary);
                    c
                }
                None => Command::new(&binary),
            };
            let version = String::from_utf8(run(cmd.arg("--version"), "the image's binary --version").stdout).expect("utf-8");
            assert!(version.starts_with("Kubernetes v1.") && version.contains(&head[..12]), "{arch}: {version}");
            eprintln!("{arch} binary{}: {}", runner.map(|q| format!(" under {q}")).unwrap_or_default(), version.trim());
        } else {
            eprintln!("the {arch} binary was not started (no qemu-aarch64 here)");
        }

        // Its SBOM: the image by digest, and the crates and modules the binaries are built from.
        let sbom = json(&std::fs::read(out.join(format!("core-{VERSION}.{arch}.cdx.json"))).expect("SBOM"));
        assert_eq!(sbom["bomFormat"], "CycloneDX");
        assert_eq!(sbom["metadata"]["component"]["type"], "container");
        assert_eq!(sbom["metadata"]["component"]["hashes"][0]["content"], digest.trim_start_matches("sha256:"));
        let names = component_names(&sbom);
        for crate_name in ["cloud-controller-manager", "ccm-node-metadata", "tokio", "tonic", "kube-client", "rustls"] {
            assert!(names.iter().any(|n| n == crate_name), "{arch} SBOM lists {crate_name}: {names:?}");
        }
        assert!(!names.iter().any(|n| n == "ccm-provider-sim"), "only what the image holds: {names:?}");
        let text = serde_json::to_string(&sbom).expect("json");
        assert!(!text.contains(&*repo.canonicalize().expect("repo").to_string_lossy()), "no path of this machine");
        platforms.push(arch);
    }
    platforms.sort();
    assert_eq!(platforms, ["amd64", "arm64"]);

    // Signatures: verified by release.sh with its key; another key must not verify them.
    let tools = PathBuf::from(
        String::from_utf8(
            run(Command::new("bash").arg(repo.join("harness/envtest/setup.sh")).arg("release-tools"), "setup.sh").stdout,
        )
        .expect("utf-8")
        .trim(),
    );
    let cosign = tools.join("cosign");
    let signed = out.join(format!("core-{VERSION}.signed"));
    let verify = |key: &Path| {
        Command::new(&cosign)
            .args(["verify", "--insecure-ignore-tlog", "--key"])
            .arg(key)
            .arg("--local-image")
            .arg(&signed)
            .output()
            .expect("cosign")
    };
    let good = verify(&out.join("cosign.pub"));
    assert!(good.status.success(), "the release's key verifies: {}", String::from_utf8_lossy(&good.stderr));
    let other = dir.path().join("other");
    std::fs::create_dir_all(&other).expect("mkdir");
    run(Command::new(&cosign).arg("generate-key-pair").current_dir(&other).env("COSIGN_PASSWORD", ""), "generate-key-pair");
    let bad = verify(&other.join("cosign.pub"));
    assert!(!bad.status.success(), "another key must not verify the release");
    // Each platform's SBOM attestation, offline from its saved layout.
    let attested = |key: &Path| {
        Command::new(&cosign)
            .args(["verify-attestation", "--insecure-ignore-tlog", "--type", "cyclonedx", "--key"])
            .arg(key)
            .arg("--local-image")
            .arg(out.join(format!("core-{VERSION}.arm64.signed")))
            .output()
            .expect("cosign")
    };
    let good = attested(&out.join("cosign.pub"));
    assert!(good.status.success(), "the arm64 SBOM attestation verifies: {}", String::from_utf8_lossy(&good.stderr));
    assert!(!attested(&other.join("cosign.pub")).status.success(), "not with another key");

    // The checksums hold, and a rebuild gives the same bytes.
    run(Command::new("sha256sum").arg("-c").arg("SHA256SUMS").current_dir(&out), "sha256sum -c");
    let again = dir.path().join("again.tar");
    run(
        Command::new("python3")
            .arg(repo.join("deploy/images/build.py"))
            .arg(repo.join("deploy/images/core.Containerfile"))
            .args(["--build-arg", "BASE_IMAGE=scratch", "--build-arg"])
            .arg(format!("VERSION={VERSION}"))
            .args(["--platform", "linux/amd64,linux/arm64", "--sbom", "--tag"])
            .arg(format!("ghcr.io/ccm-rs/cloud-controller-manager:{VERSION}"))
            .arg("--out")
            .arg(&again)
            .env("CCM_RELEASE_TOOLS", &tools),
        "build.py again",
    );
    assert_eq!(std::fs::read(&again).expect("again"), std::fs::read(&archive).expect("archive"), "the image is reproducible");
    for arch in ["amd64", "arm64"] {
        assert_eq!(
            std::fs::read(dir.path().join(format!("again.{arch}.cdx.json"))).expect("SBOM again"),
            std::fs::read(out.join(format!("core-{VERSION}.{arch}.cdx.json"))).expect("SBOM"),
            "the {arch} SBOM is reproducible"
        );
    }
}
