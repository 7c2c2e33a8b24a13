#!/usr/bin/env bash
# release.sh: builds the release images (multi-architecture, with SBOMs and provenance labels),
# pushes them to a registry, signs them with cosign, attaches each platform's SBOM as a signed
# CycloneDX attestation, and verifies all of it, from the registry and from an OCI layout on
# disk. deploy/RELEASING.md is the maintainer's checklist around it.
#
#   release.sh --version X.Y.Z [--images core,provider-sim,provider-aws]
#              [--platforms linux/amd64,linux/arm64] [--out DIR]
#              [--registry HOST[:PORT]/PATH] [--key COSIGN_KEY]
#
# --registry: where the images go (ghcr.io/ccm-rs for a release; credentials as cosign and
#   crane read them, e.g. `crane auth login`). Without it, a registry of this machine's is
#   started on loopback (crane registry serve) and stopped at the end: the check run CI makes.
# --key: cosign's private key (a file, or a KMS URI such as awskms://…), its password in
#   COSIGN_PASSWORD. Without it, a throwaway key pair is made in DIR (the check run). The
#   public key DIR/cosign.pub is what users verify with (SECURITY.md).
# Signatures are not uploaded to a transparency log (--tlog-upload=false): verifying takes
# the public key and --insecure-ignore-tlog. A maintainer who wants Rekor entries signs again
# with `cosign sign` online (deploy/RELEASING.md).
#
# Writes into DIR (default target/release-images): IMAGE-VERSION.tar (the OCI archive: an
# image index of every platform), IMAGE-VERSION.ARCH.cdx.json (the SBOMs), IMAGE-VERSION.digest
# (the index digest pushed and signed), IMAGE-VERSION.signed/ (an OCI layout of the index and
# its signature: `cosign save`) and IMAGE-VERSION.ARCH.signed/ (each platform's image with its
# signature and SBOM attestation), all verified offline with --local-image, SHA256SUMS and
# cosign.pub. --version must be the workspace's version (Cargo.toml) and the chart's
# appVersion: the binaries report the first, the chart installs the second.
set -euo pipefail
cd "$(dirname "$0")/../.."

version="" images="core,provider-sim,provider-aws" platforms="linux/amd64,linux/arm64"
out=target/release-images registry="" key=""
while [ $# -gt 0 ]; do
  case "$1" in
    --version) version=$2; shift 2 ;;
    --images) images=$2; shift 2 ;;
    --platforms) platforms=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --registry) registry=$2; shift 2 ;;
    --key) key=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "release.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$version" ] || { echo "release.sh: --version is required" >&2; exit 2; }
# The version is the one the binaries report (the workspace's) and the chart installs.
crate_version=$(awk -F'"' '/^\[workspace.package\]/ { p = 1 } p && /^version *=/ { print $2; exit }' Cargo.toml)
app_version=$(awk '$1 == "appVersion:" { gsub(/"/, "", $2); print $2 }' deploy/helm/ccm-rs/Chart.yaml)
if [ "$version" != "$crate_version" ] || [ "$version" != "$app_version" ]; then
  echo "release.sh: --version $version, but Cargo.toml says $crate_version and Chart.yaml's appVersion $app_version: set all three in one commit first (deploy/RELEASING.md)" >&2
  exit 2
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)

say() { echo "release.sh: $*" >&2; }
tools=$(bash harness/envtest/setup.sh release-tools)
cosign="$tools/cosign" crane="$tools/crane"
export CCM_RELEASE_TOOLS=$tools

# The registry: the given one, or one on loopback for this run.
registry_pid=""
layouts=()
cleanup() {
  [ -z "$registry_pid" ] || kill "$registry_pid" 2>/dev/null || true
  [ ${#layouts[@]} -eq 0 ] || rm -rf "${layouts[@]}"
}
trap cleanup EXIT
if [ -z "$registry" ]; then
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$crane" registry serve --address "127.0.0.1:$port" >"$out/registry.log" 2>&1 &
  registry_pid=$!
  for _ in $(seq 1 100); do
    curl -fsS "http://127.0.0.1:$port/v2/" >/dev/null 2>&1 && break
    kill -0 "$registry_pid" 2>/dev/null || { cat "$out/registry.log" >&2; exit 1; }
    sleep 0.1
  done
  registry="127.0.0.1:$port/ccm-rs"
  say "a registry of this machine's for this run: $registry"
fi

# The signing key: the given one, or a throwaway pair for a check run.
if [ -z "$key" ]; then
  rm -f "$out/cosign.key" "$out/cosign.pub"
  (cd "$out" && COSIGN_PASSWORD="" "$cosign" generate-key-pair >/dev/null 2>&1)
  key="$out/cosign.key"
  export COSIGN_PASSWORD=""
  say "signing with a throwaway key pair ($out/cosign.pub)"
else
  "$cosign" public-key --key "$key" >"$out/cosign.pub"
fi
pub="$out/cosign.pub"
commit=$(git rev-parse HEAD 2>/dev/null || echo "")

: >"$out/SHA256SUMS.partial"
IFS=, read -r -a image_list <<<"$images"
for image in "${image_list[@]}"; do
  case "$image" in
    core) name=cloud-controller-manager ;;
    provider-sim|provider-aws) name=$image ;;
    *) echo "release.sh: unknown image $image (core, provider-sim, provider-aws)" >&2; exit 2 ;;
  esac
  archive="$out/$image-$version.tar"
  say "building $image $version for $platforms"
  python3 deploy/images/build.py "deploy/images/$image.Containerfile" \
    --build-arg BASE_IMAGE=scratch --build-arg VERSION="$version" --build-arg GIT_COMMIT="$commit" \
    --platform "$platforms" --sbom --tag "ghcr.io/ccm-rs/$name:$version" --out "$archive"

  # Push the index (every platform) from the archive's layout: the layout names one index,
  # which crane pushes as it is (with --index it would wrap it in another).
  layout=$(mktemp -d "$out/.layout.XXXXXX")
  layouts+=("$layout")
  tar -xf "$archive" -C "$layout"
  ref="$registry/$name:$version"
  "$crane" push "$layout" "$ref" 2>/dev/null
  digest=$("$crane" digest "$ref")
  expected=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["manifests"][0]["digest"])' "$layout/index.json")
  [ "$digest" = "$expected" ] || { echo "release.sh: $ref is $digest in the registry, $expected built" >&2; exit 1; }
  echo "$digest" >"$out/$image-$version.digest"
  say "pushed $ref@$digest"

  # Sign the index and every platform's image, then verify as a user would: from the registry,
  # and offline from OCI layouts saved with the signatures (the index's; each platform's with
  # its SBOM attestation, which cosign verifies only from a single image's layout).
  "$cosign" sign --yes --key "$key" --tlog-upload=false --recursive "$ref@$digest" >&2
  "$cosign" verify --key "$pub" --insecure-ignore-tlog "$ref@$digest" >/dev/null
  rm -rf "$out/$image-$version.signed"
  "$cosign" save --dir "$out/$image-$version.signed" "$ref@$digest"
  "$cosign" verify --key "$pub" --insecure-ignore-tlog --local-image "$out/$image-$version.signed" >/dev/null
  for sbom in "$out/$image-$version".*.cdx.json; do
    arch=${sbom%.cdx.json}; arch=${arch##*.}
    platform="$ref@$("$crane" digest --platform "linux/$arch" "$ref")"
    "$cosign" attest --yes --key "$key" --tlog-upload=false --type cyclonedx --predicate "$sbom" "$platform" >&2
    "$cosign" verify --key "$pub" --insecure-ignore-tlog "$platform" >/dev/null
    "$cosign" verify-attestation --key "$pub" --insecure-ignore-tlog --type cyclonedx "$platform" >/dev/null
    saved="$out/$image-$version.$arch.signed"
    rm -rf "$saved"
    "$cosign" save --dir "$saved" "$platform"
    "$cosign" verify --key "$pub" --insecure-ignore-tlog --local-image "$saved" >/dev/null
    "$cosign" verify-attestation --key "$pub" --insecure-ignore-tlog --type cyclonedx --local-image "$saved" >/dev/null
  done
  say "signed and verified $ref@$digest (registry, and offline: $out/$image-$version{,.*}.signed)"
  (cd "$out" && sha256sum "$image-$version.tar" "$image-$version".*.cdx.json) >>"$out/SHA256SUMS.partial"
done
mv -f "$out/SHA256SUMS.partial" "$out/SHA256SUMS"
say "done: $out"
