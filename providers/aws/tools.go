//go:build tools

// Package tools records upstream's aws-cloud-controller-manager as a dependency of this module,
// so that go.mod and go.sum hold everything it needs: the harness builds it from this module
// with -mod=readonly (setup.sh aws-upstream) to put upstream's cloud calls beside ours.
package tools

import (
	_ "k8s.io/cloud-provider-aws/cmd/aws-cloud-controller-manager"
)
