#!/usr/bin/env bash
# Regenerates gen/ from ../../proto with buf and the Go protobuf and gRPC plugins (installed
# into a temporary GOBIN from the Go module proxy). The output is committed: building the
# adapter needs neither buf nor the plugins. harness/peer imports this package too.
set -euo pipefail
cd "$(dirname "$0")"
export GOTOOLCHAIN=local
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
GOBIN=$bin go install "google.golang.org/protobuf/cmd/protoc-gen-go@$(awk '$1 == "google.golang.org/protobuf" { print $2 }' go.mod)"
GOBIN=$bin go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
rm -rf gen
PATH="$bin:$PATH" buf generate
