// Command ccm-provider-aws is the AWS provider of k8s.io/cloud-provider-aws as a
// cloudprovider.v1 sidecar of ccm-rs: the provider's own code, unchanged, behind the
// go-adapter. Flags: --cloud-provider (aws), --cloud-config, --kubeconfig, --listen, -v.
package main

import (
	"github.com/ccm-rs/go-adapter/sidecar"
	// Registers the "aws" provider with k8s.io/cloud-provider.
	_ "k8s.io/cloud-provider-aws/pkg/providers/v1"
)

func main() { sidecar.Main("aws") }
