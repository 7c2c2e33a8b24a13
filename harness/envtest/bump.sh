#!/usr/bin/env bash
# Pins the test control plane to another Kubernetes release: rewrites go.mod with
# k8s.io/kubernetes at VERSION and a replace line for every staging module of that release
# (read from the release's own go.mod), then lets `go mod tidy` pick the etcd it requires.
# Usage: harness/envtest/bump.sh v1.37.2
set -euo pipefail
version=${1:?usage: bump.sh vX.Y.Z}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export GOTOOLCHAIN=local
modfile=$(cd "$here" && go mod download -json "k8s.io/kubernetes@$version" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
[ -f "$modfile" ] || { echo "bump.sh: cannot read the go.mod of k8s.io/kubernetes@$version" >&2; exit 1; }
staging=$(awk '$2 == "=>" && $3 ~ /^\.\/staging\// { print $1 }' "$modfile")
goversion=$(awk '$1 == "go" { print $2; exit }' "$modfile")
{
  echo "// Wrapper module that builds the test control plane (kube-apiserver, etcd, kubectl, kubelet-check)"
  echo "// and the upstream e2e suite (e2e.test, ginkgo, agnhost) from the Go module proxy. The"
  echo "// Kubernetes release is pinned here and nowhere else:"
  echo "// bump it with ./bump.sh vX.Y.Z, which rewrites the staging replace lines to match."
  echo "module github.com/ccm-rs/envtest"
  echo
  echo "go $goversion"
  echo
  echo "require k8s.io/kubernetes $version"
  echo
  echo "replace ("
  for m in $staging; do echo "	$m => $m v0${version#v1}"; done
  echo ")"
  echo
  echo "// The e2e suite's runner, at the version the release requires (setup.sh e2e builds it)."
  echo "tool github.com/onsi/ginkgo/v2/ginkgo"
} > "$here/go.mod"
rm -f "$here/go.sum"
(cd "$here" && go mod tidy)
echo "pinned k8s.io/kubernetes $version; run setup.sh to build it"
