#!/usr/bin/env bash
# Finds or builds the test control plane binaries (kube-apiserver, etcd, kubectl) and prints
# the directory that holds them, in the KUBEBUILDER_ASSETS layout.
# `setup.sh kubelet-check` instead prints the path of kubelet-check (cmd/kubelet-check: the
# kubelet's own config and credential provider code of the same release), building it into
# the same cache when missing; `setup.sh helm` prints the path of the helm binary pinned in
# ../helm/go.mod (the deploy tests render the chart with it), built into
# ${CCM_ENVTEST_CACHE:-$HOME/.cache/ccm-rs}/helm-<version>/; `setup.sh peer` prints the path of
# grpc-cloud-controller-manager (../peer: upstream's cloud-controller-manager forwarding to a
# cloudprovider.v1 endpoint), built into .../peer-<hash of its sources>/. `setup.sh cluster`
# builds what the real kubelet cluster adds (kubelet, kube-scheduler, kube-controller-manager,
# kube-proxy and the static pause program) into the control plane's directory and prints it;
# `setup.sh pause` builds only the pause program and prints its path. `setup.sh e2e` builds
# what running Kubernetes' own e2e suite takes into the same directory and prints it: e2e.test
# (`go test -c k8s.io/kubernetes/test/e2e`), ginkgo (the `tool` line in go.mod) and agnhost
# (k8s.io/kubernetes/test/images/agnhost, static, stamped with its image's VERSION).
# `setup.sh aws` prints the path of ccm-provider-aws (../../providers/aws: the AWS provider of
# k8s.io/cloud-provider-aws behind the go-adapter), built into .../aws-<hash of its sources>/;
# `setup.sh aws-upstream` prints the path of upstream's aws-cloud-controller-manager of the same
# release (for ccm-bench's side-by-side run), `setup.sh fake-provider` that of
# ccm-provider-fake (upstream's fake cloud behind the adapter, for the conformance test);
# `setup.sh moto` prints the python of a virtualenv with moto[server] and boto3 (versions
# below), made in .../moto-<version>/ from PyPI. `setup.sh coredns` prints the path of coredns
# (../coredns: CoreDNS with only the plugins a cluster DNS needs, for the kubelet cluster's
# kube-dns), built static into .../coredns-<hash of its sources>/. `setup.sh cargo-deny` prints
# the path of cargo-deny (the release checks: licenses, bans, sources), built from crates.io
# into .../cargo-deny-<version>/. `setup.sh release-tools` prints a directory with the release
# tools (deploy/images/release.sh): cosign, crane and cyclonedx-gomod from ../release/go.mod and
# cargo-cyclonedx from crates.io.
#
# - If KUBEBUILDER_ASSETS is set, or all of TEST_ASSET_KUBE_APISERVER / TEST_ASSET_ETCD /
#   TEST_ASSET_KUBECTL are, those binaries are used and nothing is built.
# - Otherwise the binaries are built from the Go modules pinned in go.mod next to this script
#   and cached in ${CCM_ENVTEST_CACHE:-$HOME/.cache/ccm-rs}/k8s-<version>/; a later run reuses
#   them, and a new pinned version builds into a new directory.
#
# Progress goes to stderr; stdout is only the directory.
#
# Safe to run concurrently (two tests reaching for helm at once, or a test beside .ci/run): each
# cache directory is built under an exclusive lock (`flock` on DIR.lock beside it), the builder
# writes a partial file of its own and moves it into place with one rename (the virtualenv is
# made in place and marked complete last), and a second caller waits for the lock, then finds
# the tool built and reuses it. A build that dies leaves no finished-looking tool behind.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

mode=${1:-control-plane}
case "$mode" in control-plane|kubelet-check|cluster|pause|e2e|helm|peer|aws|aws-upstream|fake-provider|moto|coredns|cargo-deny|release-tools) ;; *) echo "usage: setup.sh [kubelet-check|cluster|pause|e2e|helm|peer|aws|aws-upstream|fake-provider|moto|coredns|cargo-deny|release-tools]" >&2; exit 2 ;; esac
cache="${CCM_ENVTEST_CACHE:-$HOME/.cache/ccm-rs}"

# Partial files of this process, removed however it exits.
partials=()
cleanup() { [ ${#partials[@]} -eq 0 ] || rm -rf "${partials[@]}"; }
trap cleanup EXIT

# lock DIR: holds an exclusive lock on DIR.lock until this script exits (file descriptor 9),
# waiting (and saying so) while another setup.sh holds it. Callers check again for what they
# build once they hold it: the other run may have built it meanwhile.
lock() {
  local dir=$1
  command -v flock >/dev/null || { echo "setup.sh: flock (util-linux) is required to build into $dir" >&2; exit 1; }
  mkdir -p "$(dirname "$dir")"
  exec 9>"$dir.lock"
  if ! flock -n 9; then
    echo "setup.sh: waiting for another setup.sh building into $dir" >&2
    flock 9
  fi
}

if [ "$mode" = moto ]; then
  moto_version=5.2.5 boto3_version=1.44.5
  venv="$cache/moto-$moto_version"
  if [ ! -f "$venv/.complete" ]; then
    command -v python3 >/dev/null || { echo "setup.sh: python3 is required for moto" >&2; exit 1; }
    python3 -c 'import venv, ensurepip' 2>/dev/null ||
      { echo "setup.sh: python3's venv and ensurepip modules are required for moto (Debian: python3-venv)" >&2; exit 1; }
    lock "$venv"
    if [ ! -f "$venv/.complete" ]; then
      # A virtualenv is not relocatable (its scripts name their own path): it is made in place,
      # under the lock, and `.complete`, written last, is what makes it usable.
      echo "setup.sh: installing moto[server]==$moto_version and boto3==$boto3_version into $venv" >&2
      rm -rf "$venv"
      python3 -m venv "$venv"
      "$venv/bin/pip" install -q "moto[server]==$moto_version" "boto3==$boto3_version" >&2
      touch "$venv/.complete"
    fi
  fi
  echo "$venv/bin/python"
  exit 0
fi

# cargo_tool CRATE VERSION: builds a cargo subcommand from crates.io (with its own lock file)
# into .../CRATE-VERSION/bin/ unless it is there, and prints its path.
cargo_tool() {
  local crate=$1 version=$2 dir tmp start
  dir="$cache/$crate-$version"
  if [ ! -x "$dir/bin/$crate" ]; then
    command -v cargo >/dev/null || { echo "setup.sh: cargo is required to build $crate" >&2; exit 1; }
    lock "$dir"
    if [ ! -x "$dir/bin/$crate" ]; then
      tmp="$dir.partial.$$"
      partials+=("$tmp")
      echo "setup.sh: building $crate $version into $dir (minutes the first time)" >&2
      start=$(date +%s)
      CARGO_TARGET_DIR="$tmp/target" cargo install --quiet --locked --root "$tmp" --version "$version" "$crate" >&2
      mkdir -p "$dir/bin"
      mv -f "$tmp/bin/$crate" "$dir/bin/$crate"
      echo "setup.sh: built $crate in $(( $(date +%s) - start ))s" >&2
    fi
  fi
  echo "$dir/bin/$crate"
}

# cargo-deny: the release checks' license, ban and source checks.
if [ "$mode" = cargo-deny ]; then cargo_tool cargo-deny 0.20.2; exit 0; fi

# go_build OUT_DIR BINARY MODULE_DIR PACKAGE [LDFLAGS [test]]: builds PACKAGE of the Go module
# in MODULE_DIR into OUT_DIR/BINARY unless it is there, and prints its path. With `test`, the
# binary is PACKAGE's test binary (`go test -c`).
go_build() {
  local out=$1 binary=$2 module=$3 package=$4 ldflags=${5:--s -w} verb=(build) start tmp
  [ "${6:-}" != test ] || verb=(test -c)
  if [ ! -x "$out/$binary" ]; then
    command -v go >/dev/null || { echo "setup.sh: Go is required to build $binary" >&2; exit 1; }
    lock "$out"
    if [ ! -x "$out/$binary" ]; then
      mkdir -p "$out"
      # A name no other process uses, removed on exit unless it was moved into place.
      tmp="$out/.$binary.partial.$$"
      partials+=("$tmp")
      echo "setup.sh: building $binary into $out (minutes on a cold Go cache)" >&2
      start=$(date +%s)
      (cd "$module" && GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=readonly go "${verb[@]}" -trimpath -ldflags="$ldflags" \
        -o "$tmp" "$package")
      mv -f "$tmp" "$out/$binary"
      echo "setup.sh: built $binary in $(( $(date +%s) - start ))s" >&2
    fi
  fi
  echo "$out/$binary"
}

# version_ldflags VERSION: the linker flags that stamp a Kubernetes release into a binary, as
# the release build does (otherwise it reports v0.0.0-master to clients).
version_ldflags() {
  local version=$1 minor pkg ldflags="-s -w"
  minor=$(echo "$version" | cut -d. -f2)
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags="$ldflags -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
  done
  echo "$ldflags"
}

# go_sources DIR [SUBDIR...]: the Go sources (tests left out), go.mod and go.sum under DIR's
# SUBDIRs (all of DIR without any), for a build key.
go_sources() {
  local dir=$1; shift
  (cd "$dir" && find "${@:-.}" \( -name '*.go' ! -name '*_test.go' \) -o -name go.mod -o -name go.sum | LC_ALL=C sort | xargs cat)
  (cd "$dir" && cat go.mod go.sum)
}

adapter_dir=$(cd "$here/../../providers/go-adapter" && pwd)
aws_dir=$(cd "$here/../../providers/aws" && pwd)
case "$mode" in
  aws)  # ccm-provider-aws: the AWS provider behind the adapter (the adapter's own commands left out).
    sum=$( (go_sources "$aws_dir"; go_sources "$adapter_dir" adapter sidecar gen) | sha256sum | cut -c1-16)
    go_build "$cache/aws-$sum" ccm-provider-aws "$aws_dir" ./cmd/ccm-provider-aws; exit 0 ;;
  aws-upstream)  # upstream's aws-cloud-controller-manager, of the release ccm-provider-aws serves.
    sum=$( (cd "$aws_dir" && cat go.mod go.sum) | sha256sum | cut -c1-16)
    go_build "$cache/aws-upstream-$sum" aws-cloud-controller-manager "$aws_dir" \
      k8s.io/cloud-provider-aws/cmd/aws-cloud-controller-manager; exit 0 ;;
  fake-provider)  # ccm-provider-fake: upstream's fake cloud behind the adapter.
    sum=$(go_sources "$adapter_dir" | sha256sum | cut -c1-16)
    go_build "$cache/fake-provider-$sum" ccm-provider-fake "$adapter_dir" ./cmd/ccm-provider-fake; exit 0 ;;
  peer)  # grpc-cloud-controller-manager: upstream's cloud-controller-manager on cloudprovider.v1.
    peer_dir=$(cd "$here/../peer" && pwd)
    # The peer's sources and the generated protocol package it takes from the go-adapter module.
    sum=$( (cd "$peer_dir" && find . -name '*.go' -o -name go.mod -o -name go.sum | LC_ALL=C sort | xargs cat;
            cd "$adapter_dir" && find gen -name '*.go' | LC_ALL=C sort | xargs cat) | sha256sum | cut -c1-16)
    k8s=$(awk '$1 == "k8s.io/cloud-provider" { print $2 }' "$peer_dir/go.mod" | head -n 1)
    go_build "$cache/peer-$sum" grpc-cloud-controller-manager "$peer_dir" ./cmd/grpc-cloud-controller-manager \
      "$(version_ldflags "v1${k8s#v0}")"; exit 0 ;;
  coredns)  # coredns: the kubelet cluster's DNS server (../coredns: the plugins it compiles in).
    coredns_dir=$(cd "$here/../coredns" && pwd)
    sum=$(go_sources "$coredns_dir" | sha256sum | cut -c1-16)
    go_build "$cache/coredns-$sum" coredns "$coredns_dir" . ; exit 0 ;;
  helm)  # helm, pinned in ../helm/go.mod (the deploy tests render the chart with it).
    helm_dir="$here/../helm"
    helm_version=$(awk '$1 == "helm.sh/helm/v3" { print $2 } $1 == "require" && $2 == "helm.sh/helm/v3" { print $3 }' "$helm_dir/go.mod" | head -n 1)
    [ -n "$helm_version" ] || { echo "setup.sh: no helm.sh/helm/v3 version in $helm_dir/go.mod" >&2; exit 1; }
    go_build "$cache/helm-$helm_version" helm "$helm_dir" helm.sh/helm/v3/cmd/helm \
      "-s -w -X helm.sh/helm/v3/internal/version.version=$helm_version"; exit 0 ;;
  release-tools)  # cosign, crane, cyclonedx-gomod (../release/go.mod) and cargo-cyclonedx.
    release_dir=$(cd "$here/../release" && pwd)
    sum=$( (cd "$release_dir" && cat go.mod go.sum tools.go) | sha256sum | cut -c1-16)
    dir="$cache/release-tools-$sum"
    cosign_version=$(awk '$1 == "github.com/sigstore/cosign/v2" { print $2 }' "$release_dir/go.mod" | head -n 1)
    go_build "$dir" cosign "$release_dir" github.com/sigstore/cosign/v2/cmd/cosign \
      "-s -w -X sigs.k8s.io/release-utils/version.gitVersion=$cosign_version" >/dev/null
    go_build "$dir" crane "$release_dir" github.com/google/go-containerregistry/cmd/crane >/dev/null
    go_build "$dir" cyclonedx-gomod "$release_dir" github.com/CycloneDX/cyclonedx-gomod/cmd/cyclonedx-gomod >/dev/null
    ln -sfn "$(cargo_tool cargo-cyclonedx 0.5.9)" "$dir/cargo-cyclonedx"
    echo "$dir"; exit 0 ;;
esac

version=$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ { print $2 } $1 == "require" && $2 == "k8s.io/kubernetes" { print $3 }' "$here/go.mod" | head -n 1)
[ -n "$version" ] || { echo "setup.sh: no k8s.io/kubernetes version in $here/go.mod" >&2; exit 1; }
out="$cache/k8s-$version"

# Builds each named binary of the release that $out lacks (./cmd/<name> of this module).
build() {
  local b
  for b in "$@"; do go_build "$out" "$b" "$here" "./cmd/$b" "$(version_ldflags "$version")" >/dev/null; done
}
if [ "$mode" = kubelet-check ]; then
  build kubelet-check
  echo "$out/kubelet-check"
  exit 0
fi
if [ "$mode" = pause ]; then  # the static pause program alone (seconds to build: the concurrency test uses it)
  build pause
  echo "$out/pause"
  exit 0
fi
if [ "$mode" = cluster ]; then
  build kubelet kube-scheduler kube-controller-manager kube-proxy pause
  echo "$out"
  exit 0
fi
if [ "$mode" = e2e ]; then
  go_build "$out" e2e.test "$here" k8s.io/kubernetes/test/e2e "$(version_ldflags "$version")" test >/dev/null
  go_build "$out" ginkgo "$here" github.com/onsi/ginkgo/v2/ginkgo >/dev/null
  if [ ! -x "$out/agnhost" ]; then
    # agnhost reports the version of its image (test/images/agnhost/VERSION of the release).
    k8s_dir=$(cd "$here" && GOTOOLCHAIN=local go mod download -json "k8s.io/kubernetes@$version" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
    agnhost_version=$(cat "$k8s_dir/test/images/agnhost/VERSION" 2>/dev/null) ||
      { echo "setup.sh: no test/images/agnhost/VERSION in k8s.io/kubernetes@$version" >&2; exit 1; }
    go_build "$out" agnhost "$here" k8s.io/kubernetes/test/images/agnhost "-s -w -X main.Version=$agnhost_version" >/dev/null
  fi
  echo "$out"
  exit 0
fi

if [ -n "${KUBEBUILDER_ASSETS:-}" ]; then
  for b in kube-apiserver etcd kubectl; do
    [ -x "$KUBEBUILDER_ASSETS/$b" ] || { echo "setup.sh: KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS has no executable $b" >&2; exit 1; }
  done
  echo "$KUBEBUILDER_ASSETS"
  exit 0
fi
if [ -n "${TEST_ASSET_KUBE_APISERVER:-}" ] && [ -n "${TEST_ASSET_ETCD:-}" ] && [ -n "${TEST_ASSET_KUBECTL:-}" ]; then
  dir=$(mktemp -d "${TMPDIR:-/tmp}/ccm-envtest-assets.XXXXXX")
  ln -s "$TEST_ASSET_KUBE_APISERVER" "$dir/kube-apiserver"
  ln -s "$TEST_ASSET_ETCD" "$dir/etcd"
  ln -s "$TEST_ASSET_KUBECTL" "$dir/kubectl"
  echo "$dir"
  exit 0
fi

build kube-apiserver etcd kubectl
echo "$out"
