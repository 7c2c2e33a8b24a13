// Command ccm-provider-aws is the AWS provider of k8s.io/cloud-provider-aws as a
// cloudprovider.v1 sidecar of ccm-rs: the provider's own code, unchanged, behind the
// go-adapter. Flags: --cloud-provider (aws), --cloud-config, --kubeconfig, --listen,
// --socket-mode, --metrics-listen, -v (the go-adapter sidecar's: ../../../go-adapter/README.md).
package main

import (
	"github.com/ccm-rs/go-adapter/sidecar"
	// Go's embedded copy of Mozilla's roots, used when the system has none: the release
	// image is built FROM scratch, without a CA bundle, and the AWS SDK must still verify
	// AWS's certificates. A CA bundle the system does have (SSL_CERT_FILE, SSL_CERT_DIR, the
	// usual paths) is used instead.
	_ "golang.org/x/crypto/x509roots/fallback"
	// Registers the "aws" provider with k8s.io/cloud-provider.
	_ "k8s.io/cloud-provider-aws/pkg/providers/v1"
)

func main() { sidecar.Main("aws") }
