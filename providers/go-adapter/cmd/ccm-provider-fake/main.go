// Command ccm-provider-fake serves upstream's fake cloud (k8s.io/cloud-provider/fake) behind
// the go-adapter, as the cloud "fake" (package fakecloud). It is the adapter's reference run:
// the conformance suite is run against it in CI, next to the real AWS provider on moto. It
// is built exactly as a real cloud's sidecar is: register the provider, then sidecar.Main.
//
// --cloud-config names a JSON file with the instances the fake cloud holds:
//
//	{"zone": "zone-a", "region": "region-1", "externalIP": "203.0.113.10",
//	 "instances": [{"name": "node-1", "providerID": "fake://node-1", "type": "fake.large",
//	                "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]}]}
package main

import (
	"github.com/ccm-rs/go-adapter/fakecloud"
	"github.com/ccm-rs/go-adapter/sidecar"
)

func main() {
	fakecloud.Register()
	sidecar.Main(fakecloud.ProviderName)
}
