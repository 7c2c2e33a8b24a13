#!/usr/bin/env python3
"""Builds an image of deploy/images/*.Containerfile as an OCI archive, without a container
engine or a registry: what `ctr -n k8s.io images import` (containerd) and `podman load` read.

It follows the Containerfile's own instructions, limited to the shape these Containerfiles
have: a build stage whose `RUN deploy/images/build-binaries.sh /out BIN...` it runs on this
machine (the stage's other RUN lines install what build-binaries.sh needs; here the machine
provides it, and they are reported as skipped), and a final stage `FROM scratch` (pass
`--build-arg BASE_IMAGE=scratch`: no base image can be pulled here) with COPY --from=<stage>,
LABEL, ENV, USER, WORKDIR, ENTRYPOINT and CMD. Anything else is an error, not a guess.

    build.py CONTAINERFILE --tag NAME:TAG --out IMAGE.tar [--build-arg K=V ...]
    build.py --file SRC:DEST [--file ...] [--symlink LINK:TARGET ...] [--dir DEST ...]
             --entrypoint DEST [--cmd ARG ...] --tag NAME:TAG --out IMAGE.tar

`--platform linux/amd64,linux/arm64` builds the image once per platform (TARGETARCH set for
each: build-binaries.sh cross-compiles with the musl targets) and writes one archive whose
index.json names a multi-architecture image index; one platform (the default: this machine's)
gives a plain image. `--sbom` also writes, beside the archive, a CycloneDX SBOM per platform
(`IMAGE.<arch>.cdx.json`: the components of every binary in the image, from cargo-cyclonedx
for the Rust ones and cyclonedx-gomod for the Go ones; harness/envtest/setup.sh
release-tools builds them). The provenance labels come from the repository unless given:
GIT_COMMIT (its HEAD) and CREATED (HEAD's commit time, also the image config's `created`),
so the same commit gives the same digests.

The second form packs given files (the test cluster's pause image; the upstream e2e suite's
agnhost with the tools its tests run, harness/src/e2e_images.rs), symbolic links and empty
directories. The archive is reproducible: fixed timestamps and ownership, sorted entries.
"""

import argparse
import datetime
import fcntl
import gzip
import hashlib
import io
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_BINARIES = "deploy/images/build-binaries.sh"
EPOCH = 0


class BuildError(Exception):
    pass


def go_arch():
    machine = platform.machine()
    return {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(machine, machine)


def parse_platforms(value):
    """`linux/amd64,linux/arm64` -> ["amd64", "arm64"]."""
    archs = []
    for item in value.split(","):
        os_name, sep, arch = item.strip().partition("/")
        arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(arch, arch)
        if os_name != "linux" or not sep or arch not in ("amd64", "arm64"):
            raise BuildError(f"--platform {item!r}: expected linux/amd64 or linux/arm64")
        if arch not in archs:
            archs.append(arch)
    return archs


def git(*args):
    """A git command's output in the repository, or "" outside a git checkout."""
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def provenance_args(given):
    """GIT_COMMIT and CREATED from the repository's HEAD where not given (for the
    org.opencontainers.image.revision and .created labels)."""
    given = dict(given)
    if not given.get("GIT_COMMIT"):
        given["GIT_COMMIT"] = git("rev-parse", "HEAD")
    if not given.get("CREATED"):
        epoch = git("log", "-1", "--format=%ct")
        given["CREATED"] = rfc3339(int(epoch)) if epoch else rfc3339(EPOCH)
    return given


def rfc3339(seconds):
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def instructions(path):
    """The Containerfile's instructions as (keyword, rest) pairs, continuations joined."""
    out, pending = [], ""
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.rstrip("\n")
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            line = pending + line
            pending = ""
            keyword, _, rest = line.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
    if pending:
        raise BuildError(f"{path}: the last instruction ends with a line continuation")
    return out


def substitute(text, args):
    def value(m):
        name = m.group(1) or m.group(2)
        if name not in args:
            raise BuildError(f"${{{name}}} is not a declared ARG")
        return args[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


def parse_arg(rest, args, given):
    name, eq, default = rest.partition("=")
    default = shlex.split(default)[0] if eq and default.strip() else ""
    args[name] = given.get(name, args.get(name, default))


def parse_pairs(rest):
    """LABEL/ENV `k=v k2="v 2"` pairs."""
    pairs = {}
    for word in shlex.split(rest):
        key, eq, val = word.partition("=")
        if not eq:
            raise BuildError(f"expected key=value, got {word!r}")
        pairs[key] = val
    return pairs


def exec_form(rest):
    try:
        value = json.loads(rest)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BuildError(f"only the exec form ([\"...\"]) is supported, got {rest!r}")
    return value


def run_build_binaries(command, out_dir, args):
    words = shlex.split(command)
    if len(words) < 3 or words[0] != BUILD_BINARIES:
        raise BuildError(f"RUN {command!r}: the build stage must run {BUILD_BINARIES} OUT BIN...")
    # Run from inside `cargo test` (the deploy tests), cargo's per-crate variables would make
    # build scripts see a different environment than a direct run, and rebuild everything.
    per_crate = ("CARGO_PKG_", "CARGO_MANIFEST_", "CARGO_BIN_", "CARGO_CRATE_", "CARGO_PRIMARY_", "CARGO_TARGET_TMPDIR", "CARGO_RUSTC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(per_crate) and k not in ("CARGO", "OUT_DIR")}
    env["TARGETARCH"] = args.get("TARGETARCH") or go_arch()
    if args.get("GIT_COMMIT"):
        env["GIT_COMMIT"] = args["GIT_COMMIT"]
    stage_out = words[1]
    local = os.path.join(out_dir, stage_out.strip("/"))
    print(f"build.py: {BUILD_BINARIES} {' '.join(words[2:])} (static, {env['TARGETARCH']})", file=sys.stderr)
    subprocess.run(["bash", os.path.join(ROOT, BUILD_BINARIES), local] + words[2:], cwd=ROOT, env=env, check=True)
    return stage_out, local, words[2:]


def from_containerfile(path, given, work):
    """Files (dest -> local path) and the image config from a Containerfile."""
    args = {}
    binaries = {}  # binary name -> local path, of every build stage
    stages = {}  # name -> {container path prefix: local dir}
    stage = None
    final = None
    for keyword, rest in instructions(path):
        if keyword == "ARG":
            parse_arg(rest, args, given)
            continue
        if keyword == "FROM":
            words = rest.split()
            image = substitute(words[0], args)
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stage = {"name": name, "image": image, "mounts": {}, "files": {}, "config": {}, "env": {}}
            if name:
                stages[name] = stage
            final = stage
            continue
        if stage is None:
            raise BuildError(f"{keyword} before the first FROM")
        if stage["name"]:  # a build stage
            if keyword == "RUN" and BUILD_BINARIES in rest:
                prefix, local, names = run_build_binaries(substitute(rest, args), work, args)
                stage["mounts"][prefix] = local
                binaries.update({name: os.path.join(local, name) for name in names})
            elif keyword in ("RUN", "WORKDIR", "COPY"):
                print(f"build.py: skipped in stage {stage['name']}: {keyword} {rest} (this machine provides it)", file=sys.stderr)
            elif keyword not in ("LABEL", "ENV"):
                raise BuildError(f"{keyword} is not supported in a build stage")
            continue
        config = stage["config"]
        if keyword == "COPY":
            words = shlex.split(rest)
            source_stage = next((w.split("=", 1)[1] for w in words if w.startswith("--from=")), None)
            paths = [w for w in words if not w.startswith("--")]
            if source_stage not in stages or len(paths) != 2:
                raise BuildError(f"COPY {rest!r}: only COPY --from=<build stage> SRC DEST is supported")
            src, dest = paths
            mounts = stages[source_stage]["mounts"]
            prefix = next((p for p in mounts if src == p or src.startswith(p.rstrip("/") + "/")), None)
            if prefix is None:
                raise BuildError(f"COPY {rest!r}: {src} is not built by stage {source_stage}")
            local = os.path.join(mounts[prefix], os.path.relpath(src, prefix))
            if os.path.isdir(local):
                for entry in sorted(os.listdir(local)):
                    stage["files"][os.path.join(dest, entry)] = os.path.join(local, entry)
            else:
                stage["files"][dest] = local
        elif keyword == "LABEL":
            config.setdefault("Labels", {}).update({k: substitute(v, args) for k, v in parse_pairs(rest).items()})
        elif keyword == "ENV":
            stage["env"].update({k: substitute(v, args) for k, v in parse_pairs(rest).items()})
        elif keyword == "USER":
            config["User"] = substitute(rest, args)
        elif keyword == "WORKDIR":
            config["WorkingDir"] = substitute(rest, args)
        elif keyword == "ENTRYPOINT":
            config["Entrypoint"] = exec_form(rest)
        elif keyword == "CMD":
            config["Cmd"] = exec_form(rest)
        else:
            raise BuildError(f"{keyword} is not supported in the final stage")
    if final is None:
        raise BuildError(f"{path}: no FROM")
    if final["image"] != "scratch":
        raise BuildError(
            f"FROM {final['image']}: build.py pulls no base image; pass --build-arg BASE_IMAGE=scratch "
            "(the binaries are static)"
        )
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
    env.update(final["env"])
    final["config"]["Env"] = [f"{k}={v}" for k, v in env.items()]
    shipped = {name: local for name, local in binaries.items() if local in final["files"].values()}
    return final["files"], final["config"], shipped


def layer(files, symlinks=None, dirs=()):
    """A gzip'd tar of files (dest -> local path), symbolic links (link -> target) and empty
    directories, with parent directories; (blob, diff_id)."""
    entries = {}
    items = [(d, None) for d in dirs]
    items += [(link, ("symlink", target)) for link, target in (symlinks or {}).items()]
    items += list(files.items())
    for dest, source in items:
        parts = dest.strip("/").split("/")
        for i in range(1, len(parts)):
            entries.setdefault("/".join(parts[:i]), None)
        entries["/".join(parts)] = source
    entries.setdefault("tmp", None)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(entries):
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = EPOCH, 0, 0, "", ""
            source = entries[name]
            if source is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o1777 if name == "tmp" else 0o755
                tar.addfile(info)
                continue
            if isinstance(source, tuple):
                info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, source[1]
                tar.addfile(info)
                continue
            with open(source, "rb") as f:
                data = f.read()
            info.size, info.mode = len(data), 0o755 if os.access(source, os.X_OK) else 0o644
            tar.addfile(info, io.BytesIO(data))
    plain = raw.getvalue()
    blob = gzip.compress(plain, mtime=EPOCH)
    return blob, "sha256:" + hashlib.sha256(plain).hexdigest()


def add_blob(blobs, data, media_type):
    """Adds data to the layout's blobs; its descriptor."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def image_manifest(blobs, files, config, arch, created="1970-01-01T00:00:00Z", symlinks=None, dirs=()):
    """One platform's image (its layer, config and manifest added to blobs); the manifest's
    descriptor, with its platform."""
    blob, diff_id = layer(files, symlinks, dirs)
    image_config = {
        "architecture": arch,
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "deploy/images/build.py", "created": created}],
        "created": created,
    }

    def add(data, media_type):
        return add_blob(blobs, data, media_type)

    config_desc = add(json.dumps(image_config, sort_keys=True).encode(), "application/vnd.oci.image.config.v1+json")
    layer_desc = add(blob, "application/vnd.oci.image.layer.v1.tar+gzip")
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config_desc,
        "layers": [layer_desc],
        "annotations": dict(config.get("Labels", {})),
    }
    desc = add(json.dumps(manifest, sort_keys=True).encode(), "application/vnd.oci.image.manifest.v1+json")
    desc["platform"] = {"architecture": arch, "os": "linux"}
    print(f"build.py: linux/{arch} image {desc['digest']} ({len(blob) / 1048576:.1f} MiB compressed)", file=sys.stderr)
    return desc


def write_archive(out, tag, images, blobs, annotations=None):
    """An OCI layout archive of one image (images: [manifest descriptor]) or of a
    multi-architecture index of several; returns the descriptor index.json names."""
    name, _, ref = tag.rpartition(":")
    if not name or "/" in ref:
        raise BuildError(f"--tag {tag}: expected NAME:TAG")
    if len(images) == 1:
        top = dict(images[0])
    else:
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": images,
            "annotations": dict(annotations or {}),
        }
        top = add_blob(blobs, json.dumps(index, sort_keys=True).encode(), "application/vnd.oci.image.index.v1+json")
    top["annotations"] = {"io.containerd.image.name": tag, "org.opencontainers.image.ref.name": ref}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [top]}
    members = {"oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(), "index.json": json.dumps(index).encode()}
    for digest, data in blobs.items():
        members["blobs/sha256/" + digest.split(":", 1)[1]] = data
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    # A partial file of this process's own, renamed into place when whole: two builds of the
    # same image at once (a test beside the quick start) each write their own, and a reader
    # never sees half an archive.
    partial = f"{out}.{os.getpid()}.partial"
    try:
        write_tar(partial, members)
        os.replace(partial, out)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    archs = ", ".join(i["platform"]["architecture"] for i in images)
    print(f"build.py: {tag} ({archs}) {top['digest']} -> {out}", file=sys.stderr)
    return top


def write_tar(path, members):
    """The OCI layout's files, in order, with fixed timestamps."""
    with tarfile.open(path, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirname in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(dirname)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, EPOCH
            tar.addfile(info)
        for member in sorted(members):
            info = tarfile.TarInfo(member)
            info.size, info.mode, info.mtime = len(members[member]), 0o644, EPOCH
            tar.addfile(info, io.BytesIO(members[member]))


RUST_TARGETS = {"amd64": "x86_64-unknown-linux-musl", "arm64": "aarch64-unknown-linux-musl"}


def release_tools():
    """The directory of cargo-cyclonedx and cyclonedx-gomod (built on first use, under a lock,
    by harness/envtest/setup.sh release-tools)."""
    tools = os.environ.get("CCM_RELEASE_TOOLS")
    if not tools:
        setup = os.path.join(ROOT, "harness/envtest/setup.sh")
        tools = subprocess.run(["bash", setup, "release-tools"], cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True).stdout.strip()
    return tools


_WORKSPACE_BINARIES = None


def workspace_binaries():
    """The workspace's binaries: name -> the Cargo.toml of their package (read once)."""
    global _WORKSPACE_BINARIES
    if _WORKSPACE_BINARIES is None:
        metadata = subprocess.run(
            ["cargo", "metadata", "--no-deps", "--format-version=1", "--locked"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        _WORKSPACE_BINARIES = {
            t["name"]: p["manifest_path"] for p in json.loads(metadata)["packages"] for t in p["targets"] if "bin" in t["kind"]
        }
    return _WORKSPACE_BINARIES


def is_go_binary(path):
    """Whether PATH is a Go program (its build information names a main module)."""
    result = subprocess.run(["go", "version", "-m", path], capture_output=True, text=True, env=dict(os.environ, GOTOOLCHAIN="local"))
    return result.returncode == 0 and "\tmod\t" in result.stdout


def binary_sbom(tools, name, path, arch, work):
    """The CycloneDX BOM (a dict) of one binary: cyclonedx-gomod reads a Go binary's build
    information; cargo-cyclonedx describes a Rust binary from the lock file for its target."""
    out = os.path.join(work, f"{name}.{arch}.cdx.json")
    if is_go_binary(path):
        subprocess.run([os.path.join(tools, "cyclonedx-gomod"), "bin", "-json", "-output", out, path], check=True, stdout=sys.stderr)
    else:
        manifest = workspace_binaries().get(name)
        if manifest is None:
            raise BuildError(f"--sbom: {name} is neither a Go program nor a binary of this workspace")
        target = RUST_TARGETS[arch]
        # cargo-cyclonedx writes beside the package's Cargo.toml: one writer at a time, and
        # the file moved out at once (two builds of one workspace may run together).
        os.makedirs(os.path.join(ROOT, "target"), exist_ok=True)
        with open(os.path.join(ROOT, "target", ".sbom.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            subprocess.run(
                [os.path.join(tools, "cargo-cyclonedx"), "cyclonedx", "--manifest-path", manifest, "--format", "json",
                 "--describe", "binaries", "--target", target, "--target-in-filename", "--spec-version", "1.5", "--no-build-deps", "-qq"],
                cwd=ROOT, check=True, stdout=sys.stderr,
            )
            written = os.path.join(os.path.dirname(manifest), f"{name}_bin_{target}.cdx.json")
            if not os.path.exists(written):
                found = [f for f in os.listdir(os.path.dirname(manifest)) if f.endswith(".cdx.json")]
                raise BuildError(f"--sbom: cargo-cyclonedx did not write {written} (found {found})")
            os.replace(written, out)
            for f in os.listdir(os.path.dirname(manifest)):
                if f.endswith(".cdx.json"):
                    os.remove(os.path.join(os.path.dirname(manifest), f))
    with open(out, encoding="utf-8") as f:
        text = f.read()
    # Local packages are named by their path on this machine (`path+file:///…/ccm-core`): by
    # their path in the repository instead, so the SBOM is the same wherever it is built.
    for root in {ROOT, os.path.realpath(ROOT)}:
        text = text.replace(root, "/ccm-rs")
    return json.loads(text)


def image_sbom(tag, arch, manifest_digest, created, boms):
    """One CycloneDX BOM for an image: the image as its subject, each binary's own component
    and all their components, de-duplicated, with their dependency graphs merged."""
    name, _, ref = tag.rpartition(":")
    components, seen, deps = [], set(), {}

    def add(component):
        nested = component.get("components", [])
        flat = {k: v for k, v in component.items() if k != "components"}
        key = flat.get("bom-ref") or flat.get("purl") or f"{flat.get('name')}@{flat.get('version')}"
        if key not in seen:
            seen.add(key)
            components.append(flat)
        for child in nested:
            add(child)

    binaries = []
    for bom in boms:
        top = bom.get("metadata", {}).get("component")
        if top:
            add(top)
            binaries.append(top.get("bom-ref") or top.get("purl"))
        for component in bom.get("components", []):
            add(component)
        for dep in bom.get("dependencies", []):
            deps.setdefault(dep["ref"], set()).update(dep.get("dependsOn", []))
    image_ref = f"pkg:oci/{name.rsplit('/', 1)[-1]}@{manifest_digest.replace(':', '%3A')}?arch={arch}&repository_url={name}"
    deps[image_ref] = set(b for b in binaries if b)
    known = {c.get("bom-ref") for c in components} | {image_ref}
    return {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "serialNumber": "urn:uuid:" + str(uuid.uuid5(uuid.NAMESPACE_URL, image_ref)),
        "version": 1,
        "metadata": {
            "timestamp": created,
            "tools": [{"name": "deploy/images/build.py"}, {"name": "cargo-cyclonedx"}, {"name": "cyclonedx-gomod"}],
            "component": {
                "type": "container",
                "bom-ref": image_ref,
                "name": name,
                "version": ref,
                "purl": image_ref,
                "hashes": [{"alg": "SHA-256", "content": manifest_digest.split(":", 1)[1]}],
            },
        },
        "components": components,
        "dependencies": [
            {"ref": ref_, "dependsOn": sorted(d for d in deps[ref_] if d in known)} for ref_ in sorted(deps) if ref_ in known
        ],
    }


def sbom_path(out, arch):
    base = out[: -len(".tar")] if out.endswith(".tar") else out
    return f"{base}.{arch}.cdx.json"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("containerfile", nargs="?")
    parser.add_argument("--tag", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--build-arg", action="append", default=[], metavar="K=V")
    parser.add_argument("--file", action="append", default=[], metavar="SRC:DEST")
    parser.add_argument("--symlink", action="append", default=[], metavar="LINK:TARGET")
    parser.add_argument("--dir", action="append", default=[], metavar="DEST")
    parser.add_argument("--entrypoint")
    parser.add_argument("--cmd", action="append", default=[], metavar="ARG", help="the image's CMD, one --cmd per word")
    parser.add_argument("--env", action="append", default=[], metavar="K=V", help="set in the image's environment (PATH included)")
    parser.add_argument("--platform", help="linux/amd64, linux/arm64 or both, comma-separated (default: this machine's)")
    parser.add_argument("--sbom", action="store_true", help="also write a CycloneDX SBOM per platform beside --out")
    opts = parser.parse_args()
    try:
        if opts.containerfile:
            given = {}
            for pair in opts.build_arg:
                key, eq, value = pair.partition("=")
                if not eq:
                    raise BuildError(f"--build-arg {pair}: expected K=V")
                given[key] = value
            given = provenance_args(given)
            archs = parse_platforms(opts.platform) if opts.platform else [go_arch()]
            blobs, images, sboms = {}, [], {}
            tools = release_tools() if opts.sbom else None
            with tempfile.TemporaryDirectory(prefix="ccm-image-") as work:
                for arch in archs:
                    arch_work = os.path.join(work, arch)
                    files, config, binaries = from_containerfile(opts.containerfile, dict(given, TARGETARCH=arch), arch_work)
                    desc = image_manifest(blobs, files, config, arch, given["CREATED"])
                    images.append(desc)
                    if opts.sbom:
                        boms = [binary_sbom(tools, n, p, arch, arch_work) for n, p in sorted(binaries.items())]
                        sboms[arch] = image_sbom(opts.tag, arch, desc["digest"], given["CREATED"], boms)
                # The index carries the images' labels as its annotations (a registry shows them).
                write_archive(opts.out, opts.tag, images, blobs, json.loads(blobs[images[0]["digest"]])["annotations"])
            for arch, bom in sboms.items():
                path = sbom_path(opts.out, arch)
                with open(path + ".partial", "w", encoding="utf-8") as f:
                    json.dump(bom, f, indent=1, sort_keys=True)
                os.replace(path + ".partial", path)
                print(f"build.py: SBOM of linux/{arch} ({len(bom['components'])} components) -> {path}", file=sys.stderr)
        else:
            if not opts.file or not opts.entrypoint:
                raise BuildError("give a CONTAINERFILE, or --file SRC:DEST and --entrypoint")
            files = dict(reversed(f.split(":", 1)) for f in opts.file)
            symlinks = {}
            for pair in opts.symlink:
                link, sep, target = pair.partition(":")
                if not sep or not link or not target:
                    raise BuildError(f"--symlink {pair}: expected LINK:TARGET")
                symlinks[link] = target
            clash = sorted(set(d.strip("/") for d in files) & set(link.strip("/") for link in symlinks))
            if clash:
                raise BuildError(f"both a --file and a --symlink: {', '.join(clash)}")
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
            for pair in opts.env:
                key, eq, value = pair.partition("=")
                if not eq:
                    raise BuildError(f"--env {pair}: expected K=V")
                env[key] = value
            config = {"Entrypoint": [opts.entrypoint], "Env": [f"{k}={v}" for k, v in env.items()]}
            if opts.cmd:
                config["Cmd"] = opts.cmd
            blobs = {}
            write_archive(opts.out, opts.tag, [image_manifest(blobs, files, config, go_arch(), symlinks=symlinks, dirs=opts.dir)], blobs)
    except (BuildError, OSError, subprocess.CalledProcessError) as e:
        print(f"build.py: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
