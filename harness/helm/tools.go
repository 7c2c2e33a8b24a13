//go:build tools

// Package tools pins helm so that `go build helm.sh/helm/v3/cmd/helm` builds this version.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
