// Command coredns is CoreDNS with only the plugins the test kubelet cluster's DNS needs: the
// kubernetes plugin answering for cluster.local and the reverse zones, and errors, log, health,
// ready, cache, loop and loadbalance around it. No forward plugin (the cluster has no upstream
// DNS) and none of the cloud DNS backends, which would pull in their SDKs.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	// The plugins, each registering itself with CoreDNS.
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/ready"
)

// directives are the plugins compiled in, in the order upstream's plugin.cfg runs them (each sees
// the requests of those before it): the same relative order as upstream's full list.
var directives = []string{
	"ready",
	"health",
	"errors",
	"log",
	"loadbalance",
	"cache",
	"kubernetes",
	"loop",
}

func main() {
	dnsserver.Directives = directives
	coremain.Run()
}
