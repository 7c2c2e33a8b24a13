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

The second form packs given files (the test cluster's pause image; the upstream e2e suite's
agnhost with the tools its tests run, harness/src/e2e_images.rs), symbolic links and empty
directories. The archive is reproducible: fixed timestamps and ownership, sorted entries.
"""

import argparse
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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_BINARIES = "deploy/images/build-binaries.sh"
EPOCH = 0


class BuildError(Exception):
    pass


def go_arch():
    machine = platform.machine()
    return {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(machine, machine)


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
    return stage_out, local


def from_containerfile(path, given, work):
    """Files (dest -> local path) and the image config from a Containerfile."""
    args = {}
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
                prefix, local = run_build_binaries(substitute(rest, args), work, args)
                stage["mounts"][prefix] = local
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
    return final["files"], final["config"]


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


def write_archive(out, tag, files, config, symlinks=None, dirs=()):
    blob, diff_id = layer(files, symlinks, dirs)
    arch = go_arch()
    image_config = {
        "architecture": arch,
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "deploy/images/build.py", "created": "1970-01-01T00:00:00Z"}],
        "created": "1970-01-01T00:00:00Z",
    }
    blobs = {}

    def add(data, media_type):
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    config_desc = add(json.dumps(image_config, sort_keys=True).encode(), "application/vnd.oci.image.config.v1+json")
    layer_desc = add(blob, "application/vnd.oci.image.layer.v1.tar+gzip")
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config_desc,
        "layers": [layer_desc],
        "annotations": dict(config.get("Labels", {})),
    }
    manifest_desc = add(json.dumps(manifest, sort_keys=True).encode(), "application/vnd.oci.image.manifest.v1+json")
    name, _, ref = tag.rpartition(":")
    if not name or "/" in ref:
        raise BuildError(f"--tag {tag}: expected NAME:TAG")
    manifest_desc["platform"] = {"architecture": arch, "os": "linux"}
    manifest_desc["annotations"] = {"io.containerd.image.name": tag, "org.opencontainers.image.ref.name": ref}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [manifest_desc]}
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
    print(f"build.py: {tag} ({arch}, {len(blob) / 1048576:.1f} MiB compressed) -> {out}", file=sys.stderr)


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
    opts = parser.parse_args()
    try:
        if opts.containerfile:
            given = {}
            for pair in opts.build_arg:
                key, eq, value = pair.partition("=")
                if not eq:
                    raise BuildError(f"--build-arg {pair}: expected K=V")
                given[key] = value
            with tempfile.TemporaryDirectory(prefix="ccm-image-") as work:
                files, config = from_containerfile(opts.containerfile, given, work)
                write_archive(opts.out, opts.tag, files, config)
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
            write_archive(opts.out, opts.tag, files, config, symlinks, opts.dir)
    except (BuildError, OSError, subprocess.CalledProcessError) as e:
        print(f"build.py: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
