// Command pause is the sandbox (pause) container of the harness's real kubelet cluster: it
// holds a pod's namespaces, reaps orphaned children and exits on SIGINT or SIGTERM. Built
// static and packed into an OCI image, since no image can be pulled here.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
