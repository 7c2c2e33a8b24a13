// Package sidecar is the main of a cloudprovider.v1 sidecar built from an existing Go
// provider: import the cloud's provider package (its init registers it with
// k8s.io/cloud-provider), then call Main. Flags are upstream's where they exist
// (--cloud-provider, --cloud-config, --kubeconfig, -v) plus --listen, --socket-mode and
// --metrics-listen (the provider's own Prometheus metrics: whatever it registers with
// component-base's legacyregistry, as the AWS provider's cloudprovider_aws_api_* series; on a
// unix socket the core serves on, or on loopback).
package sidecar

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ccm-rs/go-adapter/adapter"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	cloudprovider "k8s.io/cloud-provider"
	"k8s.io/component-base/metrics/legacyregistry"
	"k8s.io/controller-manager/pkg/clientbuilder"
	"k8s.io/klog/v2"
)

// Version is the sidecar's version, set at build time (-ldflags -X).
var Version = "0.0.0-dev"

// Main runs the sidecar with the process's arguments and exits: 0 after a signal, 1 on an
// error (one sentence on stderr), 2 on bad flags.
func Main(defaultProvider string) {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	err := Run(ctx, defaultProvider, os.Args[1:], os.Stdout)
	var usage usageError
	switch {
	case err == nil:
		os.Exit(0)
	case errors.As(err, &usage):
		fmt.Fprintf(os.Stderr, "%s: %v\n", os.Args[0], err)
		os.Exit(2)
	default:
		fmt.Fprintf(os.Stderr, "%s: %v\n", os.Args[0], err)
		os.Exit(1)
	}
}

type usageError struct{ error }

// Run parses args, builds the cloud, initialises it with a read-only Kubernetes client (and
// a Node informer for providers that use one) when a kubeconfig or an in-cluster
// configuration is there, and serves it until ctx ends.
func Run(ctx context.Context, defaultProvider string, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("ccm-provider", flag.ContinueOnError)
	fs.SetOutput(stdout)
	name := fs.String("cloud-provider", defaultProvider, "the registered cloud provider to serve")
	config := fs.String("cloud-config", "", "the provider's cloud configuration file")
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig for providers that read the cluster (in-cluster configuration when unset and available)")
	listen := fs.String("listen", "unix:///var/run/ccm/provider.sock", "unix:///path/provider.sock or tcp://host:port")
	socketMode := fs.String("socket-mode", "0600", "the mode of the unix sockets this sidecar creates, in octal: 0600 (its user only) or 0660 (its group too, as a core running as another user that shares the Pod's fsGroup); nothing for others, at most 0770, at least 0600")
	pluginName := fs.String("plugin-name", "", "the plugin name to report (default <provider>.go-adapter.ccm-rs.dev)")
	batchReads := fs.Bool("batch-reads", false, "advertise BatchInstanceMetadata as cheap (the provider coalesces its cloud reads)")
	batchConcurrency := fs.Int("batch-concurrency", 16, "per-instance calls in flight for one batch read")
	routesIPv6 := fs.Bool("routes-ipv6", false, "advertise routes to IPv6 destinations (only if the provider creates them)")
	bulk := fs.Bool("bulk", true, "advertise ApplyRoutes and BatchUpdateLoadBalancerHosts (each item is still its own cloud call, --batch-concurrency at a time)")
	tlsCert := fs.String("tls-cert-file", "", "serve a tcp:// --listen with mutual TLS: this certificate (PEM), with --tls-key-file and --tls-client-ca-file")
	tlsKey := fs.String("tls-key-file", "", "the private key of --tls-cert-file (PEM)")
	tlsClientCA := fs.String("tls-client-ca-file", "", "the CA whose client certificates are accepted (PEM)")
	insecureTCP := fs.Bool("allow-insecure-tcp", false, "serve a tcp:// --listen without TLS on an address other hosts can reach (refused otherwise: only loopback is served in the clear)")
	metricsListen := fs.String("metrics-listen", "", "serve the provider's Prometheus metrics (component-base's legacyregistry, e.g. the AWS provider's cloudprovider_aws_api_*) at /metrics on unix:///path/metrics.sock (of --socket-mode; the core serves them on under its own authentication) or on http://host:port of a loopback address; off when empty")
	insecureMetrics := fs.Bool("allow-insecure-metrics", false, "serve --metrics-listen over plain HTTP on an address other hosts can reach (refused otherwise: only a unix socket or loopback)")
	callRate := fs.Float64("call-rate", 0, "declare to the core how many calls a second it may send (its cloud's API budget for this provider divided by the cloud calls one call makes); the core paces to it; 0 declares none")
	callBurst := fs.Uint("call-burst", 1, "the calls the core may send at once after a quiet spell, with --call-rate")
	var classes stringList
	fs.Var(&classes, "load-balancer-class", "a Service loadBalancerClass this provider's load balancers serve (repeatable): a core with several providers sends Services of it here")
	version := fs.Bool("version", false, "print the version and exit")
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	klogFlags.VisitAll(func(f *flag.Flag) { fs.Var(f.Value, f.Name, f.Usage) })
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return usageError{err}
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Errorf("unexpected argument %q", fs.Arg(0))}
	}
	if *version {
		_, err := fmt.Fprintf(stdout, "ccm-provider (go-adapter) %s, cloud provider %s\n", Version, *name)
		return err
	}
	if *name == "" {
		return usageError{errors.New("--cloud-provider is required")}
	}
	if math.IsNaN(*callRate) || math.IsInf(*callRate, 0) || *callRate < 0 {
		return usageError{fmt.Errorf("--call-rate %v: expected a number of calls per second, 0 or more", *callRate)}
	}
	if *callBurst > math.MaxUint32 {
		return usageError{fmt.Errorf("--call-burst %d: too large", *callBurst)}
	}
	mode, err := parseSocketMode(*socketMode)
	if err != nil {
		return usageError{err}
	}
	metricsAt, err := parseMetricsListen(*metricsListen, *insecureMetrics)
	if err != nil {
		return usageError{err}
	}
	if !cloudprovider.IsCloudProvider(*name) {
		return usageError{fmt.Errorf("--cloud-provider %q is not built into this sidecar", *name)}
	}
	cloud, err := cloudprovider.InitCloudProvider(*name, *config)
	if err != nil {
		return fmt.Errorf("initialising cloud provider %q with --cloud-config %q: %w", *name, *config, err)
	}
	if cloud == nil {
		return fmt.Errorf("cloud provider %q returned no implementation (is --cloud-config set?)", *name)
	}
	restConfig, err := clusterConfig(ctx, *kubeconfig)
	if err != nil {
		return err
	}
	if restConfig != nil {
		if err := initialise(ctx, cloud, restConfig); err != nil {
			return err
		}
	} else {
		klog.Warning("no --kubeconfig and no in-cluster configuration: the provider is not initialised; providers that read the cluster (AWS routes and load balancers) will fail")
	}
	if metricsAt != (metricsEndpoint{}) {
		_, stopMetrics, err := serveMetrics(ctx, metricsAt, mode)
		if err != nil {
			return err
		}
		defer stopMetrics()
	}
	return adapter.Serve(ctx, cloud, adapter.Options{
		Listen:              *listen,
		SocketMode:          mode,
		Name:                *pluginName,
		Version:             Version,
		BatchReads:          *batchReads,
		BatchConcurrency:    *batchConcurrency,
		RoutesIPv6:          *routesIPv6,
		Bulk:                *bulk,
		LoadBalancerClasses: classes,
		CallRate:            *callRate,
		CallBurst:           uint32(*callBurst),
		TLSCertFile:         *tlsCert,
		TLSKeyFile:          *tlsKey,
		TLSClientCAFile:     *tlsClientCA,
		AllowInsecureTCP:    *insecureTCP,
	})
}

// Where the in-cluster configuration's files are, and how long to wait for them; variables
// for the tests.
//
// The chart turns token automount off for the Pod: no token of the core's ServiceAccount
// reaches the provider. The core instead mints (TokenRequest) a token of the provider's own
// ServiceAccount and writes token, ca.crt and namespace into an emptyDir that the provider's
// container mounts read-only at the standard path, so rest.InClusterConfig reads them
// unchanged and client-go re-reads the token file as the core renews it. The core writes
// them shortly after it starts, which may be after this sidecar starts.
var (
	serviceAccountDir  = "/var/run/secrets/kubernetes.io/serviceaccount"
	serviceAccountWait = 2 * time.Minute
	serviceAccountPoll = 500 * time.Millisecond
	inClusterConfig    = rest.InClusterConfig
)

// clusterConfig is the kubeconfig's configuration, the in-cluster one (once the core has
// handed over the token), or nil for none.
func clusterConfig(ctx context.Context, kubeconfig string) (*rest.Config, error) {
	if kubeconfig != "" {
		c, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("--kubeconfig %s: %w", kubeconfig, err)
		}
		return c, nil
	}
	if os.Getenv("KUBERNETES_SERVICE_HOST") == "" {
		return nil, nil
	}
	if err := waitForServiceAccount(ctx); err != nil {
		return nil, err
	}
	c, err := inClusterConfig()
	if err != nil {
		return nil, fmt.Errorf("in-cluster configuration: %w", err)
	}
	return c, nil
}

// waitForServiceAccount returns once the token and the CA are in serviceAccountDir, polling
// every serviceAccountPoll for serviceAccountWait. Both: without ca.crt, rest.InClusterConfig
// only logs and trusts the system's roots instead, and every call would then fail on the
// API server's certificate.
func waitForServiceAccount(ctx context.Context) error {
	files := []string{filepath.Join(serviceAccountDir, "token"), filepath.Join(serviceAccountDir, "ca.crt")}
	missing := firstMissing(files)
	if missing == "" {
		return nil
	}
	klog.InfoS("waiting for the Kubernetes token the core hands over (of the provider's own ServiceAccount)", "missing", missing, "timeout", serviceAccountWait)
	deadline := time.NewTimer(serviceAccountWait)
	defer deadline.Stop()
	poll := time.NewTicker(serviceAccountPoll)
	defer poll.Stop()
	for {
		select {
		case <-ctx.Done():
			return fmt.Errorf("stopped while waiting for %s: %w", missing, ctx.Err())
		case <-poll.C:
		case <-deadline.C:
			if missing = firstMissing(files); missing == "" {
				return nil
			}
			return fmt.Errorf("in-cluster configuration: %s is still missing after %v: the core hands the provider a token of its own ServiceAccount (the chart's provider ServiceAccount) there; is the core running, and may it create tokens for that ServiceAccount?", missing, serviceAccountWait)
		}
		if missing = firstMissing(files); missing == "" {
			return nil
		}
	}
}

// firstMissing is the first of files that is absent or empty, or "" when all are there.
func firstMissing(files []string) string {
	for _, f := range files {
		if info, err := os.Stat(f); err != nil || info.Size() == 0 {
			return f
		}
	}
	return ""
}

// readOnly refuses every request but reads: the provider may list and watch the cluster,
// never change it (the core does every write).
type readOnly struct{ next http.RoundTripper }

func (r readOnly) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Method != http.MethodGet && req.Method != http.MethodHead {
		return nil, fmt.Errorf("the sidecar's Kubernetes client is read-only: %s %s refused", req.Method, req.URL.Path)
	}
	return r.next.RoundTrip(req)
}

// initialise hands the provider a read-only client (Initialize) and, if it asks for them,
// shared informers (SetInformers), started and synced before serving.
func initialise(ctx context.Context, cloud cloudprovider.Interface, config *rest.Config) error {
	config = rest.CopyConfig(config)
	config.UserAgent = "ccm-provider-go-adapter"
	config.Wrap(func(rt http.RoundTripper) http.RoundTripper { return readOnly{next: rt} })
	client, err := kubernetes.NewForConfig(config)
	if err != nil {
		return fmt.Errorf("building the Kubernetes client: %w", err)
	}
	cloud.Initialize(clientbuilder.SimpleControllerClientBuilder{ClientConfig: config}, ctx.Done())
	user, ok := cloud.(cloudprovider.InformerUser)
	if !ok {
		return nil
	}
	factory := informers.NewSharedInformerFactory(client, 0)
	user.SetInformers(factory)
	factory.Start(ctx.Done())
	syncCtx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	for informer, synced := range factory.WaitForCacheSync(syncCtx.Done()) {
		if !synced {
			return fmt.Errorf("the %v informer the provider asked for did not sync within 2 minutes (RBAC: get, list and watch)", informer)
		}
	}
	return nil
}

// parseSocketMode is --socket-mode's octal mode, if adapter.CheckSocketMode accepts it.
func parseSocketMode(s string) (os.FileMode, error) {
	n, err := strconv.ParseUint(s, 8, 32)
	if err != nil {
		return 0, fmt.Errorf("--socket-mode %q: expected an octal mode such as 0600 or 0660", s)
	}
	mode := os.FileMode(n)
	if err := adapter.CheckSocketMode(mode); err != nil {
		return 0, fmt.Errorf("--socket-mode %s: %w", s, err)
	}
	return mode, nil
}

// metricsEndpoint is where --metrics-listen serves: a unix socket or a TCP address.
type metricsEndpoint struct {
	unixPath string
	tcpAddr  string
}

// parseMetricsListen reads --metrics-listen: unix:///path/metrics.sock, or http://host:port
// (host:port alone as well) on a loopback address unless allowInsecure; the zero endpoint
// when it is empty (off). Plain HTTP elsewhere would hand the provider's metrics (and a
// listener to probe) to every host that reaches the address; with hostNetwork, the node's.
func parseMetricsListen(listen string, allowInsecure bool) (metricsEndpoint, error) {
	if listen == "" {
		return metricsEndpoint{}, nil
	}
	if path, ok := strings.CutPrefix(listen, "unix://"); ok {
		if !strings.HasSuffix(path, ".sock") {
			return metricsEndpoint{}, fmt.Errorf("--metrics-listen %q: a unix socket path must end in .sock", listen)
		}
		return metricsEndpoint{unixPath: path}, nil
	}
	addr := strings.TrimPrefix(listen, "http://")
	host, _, err := net.SplitHostPort(addr)
	if err != nil || strings.Contains(addr, "/") {
		return metricsEndpoint{}, fmt.Errorf("--metrics-listen %q: expected unix:///path/metrics.sock or http://host:port", listen)
	}
	if !allowInsecure && !isLoopback(host) {
		return metricsEndpoint{}, fmt.Errorf("--metrics-listen %q: plain HTTP on an address other hosts can reach serves the provider's metrics to all of them; use unix:///path/metrics.sock (the core serves it under its own authentication) or a loopback address, or allow it explicitly (--allow-insecure-metrics)", listen)
	}
	return metricsEndpoint{tcpAddr: addr}, nil
}

// isLoopback says whether host is localhost or a loopback address (127.0.0.0/8, ::1).
func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// serveMetrics serves the provider's metrics (legacyregistry, where k8s.io/cloud-provider
// implementations register theirs) at /metrics on at, in plain HTTP, until ctx ends or the
// returned function is called (which returns once the server is down and a unix socket is
// removed). A unix socket gets socketMode and is refused, as --listen's, when another process
// serves its path. It returns the address it listens on.
func serveMetrics(ctx context.Context, at metricsEndpoint, socketMode os.FileMode) (string, func(), error) {
	var listener net.Listener
	var err error
	if at.unixPath != "" {
		listener, err = adapter.ListenUnix(at.unixPath, socketMode)
	} else {
		listener, err = net.Listen("tcp", at.tcpAddr)
	}
	if err != nil {
		return "", nil, fmt.Errorf("--metrics-listen: %w", err)
	}
	// (A unix listener's own address is the staging path it was bound at.)
	addr, url := listener.Addr().String(), "http://"+listener.Addr().String()+"/metrics"
	if at.unixPath != "" {
		addr, url = at.unixPath, "unix://"+at.unixPath+" (/metrics)"
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", legacyregistry.Handler())
	server := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	served := make(chan struct{})
	go func() {
		defer close(served)
		// Serve closes the listener when it returns (which removes a unix socket).
		if err := server.Serve(listener); err != nil && !errors.Is(err, http.ErrServerClosed) {
			klog.ErrorS(err, "serving metrics failed", "address", url)
		}
	}()
	klog.InfoS("serving the provider's metrics", "address", url)
	stop := func() {
		shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = server.Shutdown(shutdownCtx)
		<-served
	}
	go func() {
		select {
		case <-ctx.Done():
			stop()
		case <-served:
		}
	}()
	return addr, stop, nil
}

// stringList is a repeatable string flag.
type stringList []string

func (l *stringList) String() string { return strings.Join(*l, ",") }

func (l *stringList) Set(v string) error {
	if v == "" {
		return errors.New("empty value")
	}
	*l = append(*l, v)
	return nil
}
