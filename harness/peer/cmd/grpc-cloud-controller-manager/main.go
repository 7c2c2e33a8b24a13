// Command grpc-cloud-controller-manager is upstream's cloud-controller-manager
// (k8s.io/cloud-provider's app and controllers, unchanged) with the cloud provider
// "ccm-rs-grpc", which forwards every cloud call to a cloudprovider.v1 endpoint. Run it with
// --cloud-provider=ccm-rs-grpc --cloud-config=<file with `endpoint: unix:///…/provider.sock`>.
package main

import (
	"os"

	_ "github.com/ccm-rs/peer/grpcprovider"
	"k8s.io/apimachinery/pkg/util/wait"
	cloudprovider "k8s.io/cloud-provider"
	"k8s.io/cloud-provider/app"
	"k8s.io/cloud-provider/app/config"
	"k8s.io/cloud-provider/names"
	"k8s.io/cloud-provider/options"
	"k8s.io/component-base/cli"
	cliflag "k8s.io/component-base/cli/flag"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/klog/v2"
)

func main() {
	ccmOptions, err := options.NewCloudControllerManagerOptions()
	if err != nil {
		klog.Fatalf("unable to initialize command options: %v", err)
	}
	command := app.NewCloudControllerManagerCommand(ccmOptions, cloudInitializer, app.DefaultInitFuncConstructors,
		names.CCMControllerAliases(), cliflag.NamedFlagSets{}, wait.NeverStop)
	os.Exit(cli.Run(command))
}

func cloudInitializer(c *config.CompletedConfig) cloudprovider.Interface {
	cloudConfig := c.ComponentConfig.KubeCloudShared.CloudProvider
	cloud, err := cloudprovider.InitCloudProvider(cloudConfig.Name, cloudConfig.CloudConfigFile)
	if err != nil {
		klog.Fatalf("cloud provider could not be initialized: %v", err)
	}
	if cloud == nil {
		klog.Fatalf("cloud provider %q is not known (use --cloud-provider=ccm-rs-grpc)", cloudConfig.Name)
	}
	return cloud
}
