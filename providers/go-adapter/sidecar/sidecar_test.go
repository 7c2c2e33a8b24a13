package sidecar

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	pb "github.com/ccm-rs/go-adapter/gen/cloudprovider/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/client-go/rest"
	cloudprovider "k8s.io/cloud-provider"
	"k8s.io/cloud-provider/fake"
	"k8s.io/component-base/metrics"
	"k8s.io/component-base/metrics/legacyregistry"
)

func init() {
	cloudprovider.RegisterCloudProvider("sidecar-test", func(config io.Reader) (cloudprovider.Interface, error) {
		if config != nil {
			b, _ := io.ReadAll(config)
			if strings.Contains(string(b), "broken") {
				return nil, errors.New("config says broken")
			}
		}
		return &fake.Cloud{EnableInstancesV2: true, Provider: "sidecar-test"}, nil
	})
}

func TestFlagsAndErrorsAreClear(t *testing.T) {
	var out bytes.Buffer
	if err := Run(context.Background(), "sidecar-test", []string{"--version"}, &out); err != nil || !strings.Contains(out.String(), "sidecar-test") {
		t.Errorf("--version: %v %q", err, out.String())
	}
	var usage usageError
	if err := Run(context.Background(), "", []string{"--cloud-provider=nope"}, io.Discard); !errors.As(err, &usage) || !strings.Contains(err.Error(), "not built into") {
		t.Errorf("an unknown provider: %v", err)
	}
	if err := Run(context.Background(), "sidecar-test", []string{"stray"}, io.Discard); !errors.As(err, &usage) {
		t.Errorf("a stray argument: %v", err)
	}
	for _, rate := range []string{"-1", "NaN", "+Inf"} {
		if err := Run(context.Background(), "sidecar-test", []string{"--call-rate", rate}, io.Discard); !errors.As(err, &usage) || !strings.Contains(err.Error(), "--call-rate") {
			t.Errorf("--call-rate %s: %v", rate, err)
		}
	}
	config := filepath.Join(t.TempDir(), "cloud.conf")
	if err := writeFile(config, "broken"); err != nil {
		t.Fatal(err)
	}
	err := Run(context.Background(), "sidecar-test", []string{"--cloud-config", config, "--listen", "unix://" + filepath.Join(t.TempDir(), "p.sock")}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "config says broken") || !strings.Contains(err.Error(), config) {
		t.Errorf("a provider refusing its config: %v", err)
	}
	err = Run(context.Background(), "sidecar-test", []string{"--listen", "unix:///tmp/no-suffix"}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), ".sock") {
		t.Errorf("a socket path without .sock: %v", err)
	}
}

func TestSocketModesForOthersOrWithoutOwnerReadWriteAreUsageErrors(t *testing.T) {
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	for _, mode := range []string{"0666", "0606", "0777", "1660", "2660", "0400", "0060", "660x", "rw", "", "-0600", "0o660"} {
		sock := filepath.Join(t.TempDir(), "p.sock")
		err := Run(context.Background(), "sidecar-test", []string{"--listen", "unix://" + sock, "--socket-mode", mode}, io.Discard)
		var usage usageError
		if !errors.As(err, &usage) || !strings.Contains(err.Error(), "--socket-mode") {
			t.Errorf("--socket-mode %q: %v", mode, err)
		}
		if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("--socket-mode %q made a socket: %v", mode, err)
		}
	}
	for _, mode := range []string{"0600", "600", "0660", "0640", "0770"} {
		if _, err := parseSocketMode(mode); err != nil {
			t.Errorf("--socket-mode %s refused: %v", mode, err)
		}
	}
}

func TestItServesTheRegisteredProviderUntilCancelled(t *testing.T) {
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	sock := filepath.Join(t.TempDir(), "provider.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, "sidecar-test", []string{"--listen", "unix://" + sock, "--socket-mode", "0660", "--plugin-name", "test.example.com", "--call-rate", "2.5", "--call-burst", "5"}, io.Discard)
	}()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	var info *pb.GetPluginInfoResponse
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		c, cancelCall := context.WithTimeout(context.Background(), time.Second)
		info, err = pb.NewIdentityServiceClient(conn).GetPluginInfo(c, &pb.GetPluginInfoRequest{})
		cancelCall()
		if err == nil {
			break
		}
	}
	if err != nil || info.GetName() != "test.example.com" || info.GetProviderIdScheme() != "sidecar-test" {
		t.Fatalf("info %v, %v", info, err)
	}
	if st, err := os.Lstat(sock); err != nil || st.Mode().Perm() != 0o660 {
		t.Errorf("--socket-mode 0660 gave the socket %v (%v)", st.Mode(), err)
	}
	c, cancelCall := context.WithTimeout(context.Background(), time.Second)
	caps, err := pb.NewIdentityServiceClient(conn).GetPluginCapabilities(c, &pb.GetPluginCapabilitiesRequest{})
	cancelCall()
	if err != nil || caps.GetCallRate().GetPerSecond() != 2.5 || caps.GetCallRate().GetBurst() != 5 {
		t.Errorf("the declared call rate: %v, %v", caps.GetCallRate(), err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("a signal ends it cleanly: %v", err)
	}
}

func TestTheProvidersClientCannotWrite(t *testing.T) {
	server := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) }))
	defer server.Close()
	client := &http.Client{Transport: readOnly{next: http.DefaultTransport}}
	if resp, err := client.Get(server.URL + "/api/v1/nodes"); err != nil {
		t.Errorf("a read: %v", err)
	} else {
		resp.Body.Close()
	}
	for _, method := range []string{http.MethodPost, http.MethodPatch, http.MethodPut, http.MethodDelete} {
		req, _ := http.NewRequest(method, server.URL+"/api/v1/nodes/x", nil)
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			t.Errorf("%s went through", method)
		} else if !strings.Contains(err.Error(), "read-only") {
			t.Errorf("%s: %v", method, err)
		}
	}
}

// The metric the metrics tests look for: as the AWS provider registers
// cloudprovider_aws_api_request_duration_seconds.
var testCalls = func() *metrics.Counter {
	c := metrics.NewCounter(&metrics.CounterOpts{Name: "cloudprovider_sidecar_test_api_calls_total", Help: "test", StabilityLevel: metrics.ALPHA})
	legacyregistry.MustRegister(c)
	c.Inc()
	return c
}()

// getMetrics is /metrics of client at base.
func getMetrics(t *testing.T, client *http.Client, base string) string {
	t.Helper()
	resp, err := client.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics: %d\n%s", resp.StatusCode, body)
	}
	return string(body)
}

// unixClient is an HTTP client that reaches every URL through the socket at path.
func unixClient(path string) *http.Client {
	return &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", path)
	}}}
}

func TestTheProvidersOwnMetricsAreServedOnLoopback(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	at, err := parseMetricsListen("http://127.0.0.1:0", false)
	if err != nil {
		t.Fatal(err)
	}
	addr, stop, err := serveMetrics(ctx, at, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	if body := getMetrics(t, http.DefaultClient, "http://"+addr); !strings.Contains(body, "cloudprovider_sidecar_test_api_calls_total 1") {
		t.Errorf("/metrics:\n%s", body)
	}
}

func TestTheProvidersOwnMetricsAreServedOnAUnixSocket(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "metrics.sock")
	at, err := parseMetricsListen("unix://"+path, false)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, stop, err := serveMetrics(ctx, at, 0o660)
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	if info, err := os.Lstat(path); err != nil || info.Mode()&os.ModeSocket == 0 || info.Mode().Perm() != 0o660 {
		t.Fatalf("the metrics socket: %v %v", info, err)
	}
	if body := getMetrics(t, unixClient(path), "http://metrics"); !strings.Contains(body, "cloudprovider_sidecar_test_api_calls_total 1") {
		t.Errorf("/metrics:\n%s", body)
	}
	// A second sidecar on the same path is refused and leaves the first one serving.
	if _, stop2, err := serveMetrics(ctx, at, 0o600); err == nil {
		stop2()
		t.Error("a second metrics server replaced the live socket")
	} else if !strings.Contains(err.Error(), "another process serves unix://"+path) || !strings.Contains(err.Error(), "--metrics-listen") {
		t.Errorf("the refusal: %v", err)
	}
	getMetrics(t, unixClient(path), "http://metrics")
	stop()
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("stopping removes the socket: %v", err)
	}
}

func TestMetricsOverHTTPOnlyOnLoopbackUnlessAllowed(t *testing.T) {
	for _, ok := range []string{"http://127.0.0.1:10260", "http://127.3.2.1:10260", "http://[::1]:10260", "http://localhost:10260", "127.0.0.1:10260", "unix:///run/ccm/metrics.sock"} {
		if _, err := parseMetricsListen(ok, false); err != nil {
			t.Errorf("--metrics-listen=%s: %v", ok, err)
		}
	}
	for _, reachable := range []string{"http://0.0.0.0:10260", "http://:10260", "http://10.1.2.3:10260", "http://[::]:10260", "http://[2001:db8::1]:10260", "http://node.example.com:10260", "10.1.2.3:10260"} {
		var usage usageError
		err := Run(context.Background(), "sidecar-test", []string{"--metrics-listen", reachable, "--listen", "unix://" + filepath.Join(t.TempDir(), "p.sock")}, io.Discard)
		if !errors.As(err, &usage) || !strings.Contains(err.Error(), "--metrics-listen") || !strings.Contains(err.Error(), "--allow-insecure-metrics") {
			t.Errorf("--metrics-listen=%s without --allow-insecure-metrics: %v", reachable, err)
		}
		if at, err := parseMetricsListen(reachable, true); err != nil || at.tcpAddr != strings.TrimPrefix(reachable, "http://") {
			t.Errorf("--metrics-listen=%s --allow-insecure-metrics: %+v %v", reachable, at, err)
		}
	}
	for _, bad := range []string{"10260", "unix:///x", "unix://", "http://host:1/metrics", "https://127.0.0.1:1", "tcp://127.0.0.1:1"} {
		if _, err := parseMetricsListen(bad, true); err == nil {
			t.Errorf("--metrics-listen=%s was accepted", bad)
		}
	}
}

func TestTheMetricsSocketIsRemovedOnExit(t *testing.T) {
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	dir := t.TempDir()
	sock, metricsSock := filepath.Join(dir, "provider.sock"), filepath.Join(dir, "metrics.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, "sidecar-test", []string{"--listen", "unix://" + sock, "--metrics-listen", "unix://" + metricsSock, "--socket-mode", "0660"}, io.Discard)
	}()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		_, errMetrics := os.Lstat(metricsSock)
		_, errProvider := os.Lstat(sock)
		if errMetrics == nil && errProvider == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the sockets did not appear: %v, %v", errMetrics, errProvider)
		}
	}
	if info, err := os.Lstat(metricsSock); err != nil || info.Mode().Perm() != 0o660 {
		t.Errorf("the metrics socket: %v %v", info, err)
	}
	getMetrics(t, unixClient(metricsSock), "http://metrics")
	cancel()
	if err := <-done; err != nil {
		t.Errorf("a signal ends it cleanly: %v", err)
	}
	if entries, err := os.ReadDir(dir); err != nil || len(entries) != 0 {
		t.Errorf("the sockets are removed on exit: %v %v", entries, err)
	}
}

// handover points the in-cluster configuration at a temporary directory, with a short wait,
// and a loader that reads it as rest.InClusterConfig reads the standard one; it returns the
// directory and the number of loads.
func handover(t *testing.T, wait time.Duration) (string, *int) {
	t.Helper()
	dir := t.TempDir()
	oldDir, oldWait, oldPoll, oldLoad := serviceAccountDir, serviceAccountWait, serviceAccountPoll, inClusterConfig
	t.Cleanup(func() {
		serviceAccountDir, serviceAccountWait, serviceAccountPoll, inClusterConfig = oldDir, oldWait, oldPoll, oldLoad
	})
	t.Setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
	t.Setenv("KUBERNETES_SERVICE_PORT", "443")
	loads := new(int)
	serviceAccountDir, serviceAccountWait, serviceAccountPoll = dir, wait, 10*time.Millisecond
	inClusterConfig = func() (*rest.Config, error) {
		*loads++
		tokenFile := filepath.Join(dir, "token")
		token, err := os.ReadFile(tokenFile)
		if err != nil {
			return nil, err
		}
		return &rest.Config{
			Host:            "https://" + net.JoinHostPort(os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT")),
			TLSClientConfig: rest.TLSClientConfig{CAFile: filepath.Join(dir, "ca.crt")},
			BearerToken:     string(token),
			BearerTokenFile: tokenFile,
		}, nil
	}
	return dir, loads
}

// writeAtomically writes path as the core does: in full, then renamed into place.
func writeAtomically(t *testing.T, path, text string) {
	if err := writeFile(path+".tmp", text); err != nil {
		t.Error(err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		t.Error(err)
	}
}

func TestItWaitsForTheTokenTheCoreHandsOver(t *testing.T) {
	dir, loads := handover(t, 10*time.Second)
	const delay = 300 * time.Millisecond
	go func() {
		time.Sleep(delay)
		writeAtomically(t, filepath.Join(dir, "namespace"), "kube-system")
		writeAtomically(t, filepath.Join(dir, "token"), "the-providers-token")
		// The CA last: the token alone is not enough (rest.InClusterConfig would trust the
		// system's roots instead).
		time.Sleep(100 * time.Millisecond)
		writeAtomically(t, filepath.Join(dir, "ca.crt"), "-----BEGIN CERTIFICATE-----")
	}()
	start := time.Now()
	config, err := clusterConfig(context.Background(), "")
	if err != nil {
		t.Fatal(err)
	}
	if waited := time.Since(start); waited < delay+100*time.Millisecond {
		t.Errorf("loaded after %v, before the core had written the token and the CA", waited)
	}
	if *loads != 1 || config.BearerToken != "the-providers-token" || config.BearerTokenFile != filepath.Join(dir, "token") || config.Host != "https://10.96.0.1:443" {
		t.Errorf("%d loads, config %+v", *loads, config)
	}
}

func TestATokenNeverHandedOverIsAnErrorSayingWhatIsMissing(t *testing.T) {
	dir, loads := handover(t, 300*time.Millisecond)
	_, err := clusterConfig(context.Background(), "")
	if err == nil {
		t.Fatal("no token, yet a configuration")
	}
	for _, want := range []string{filepath.Join(dir, "token"), "the core hands", "ServiceAccount"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error %q does not say %q", err, want)
		}
	}
	if *loads != 0 {
		t.Errorf("loaded %d times without a token", *loads)
	}
	// Through Run, as a failure (exit 1), not a usage error.
	var usage usageError
	err = Run(context.Background(), "sidecar-test", []string{"--listen", "unix://" + filepath.Join(t.TempDir(), "p.sock")}, io.Discard)
	if err == nil || errors.As(err, &usage) || !strings.Contains(err.Error(), "token") {
		t.Errorf("Run without the token: %v", err)
	}
}

func TestAHandedOverTokenIsUsedAtOnceAndAStopEndsTheWait(t *testing.T) {
	dir, loads := handover(t, time.Minute)
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, cancel)
	start := time.Now()
	if _, err := clusterConfig(ctx, ""); !errors.Is(err, context.Canceled) || time.Since(start) > 5*time.Second {
		t.Errorf("a stop during the wait: %v after %v", err, time.Since(start))
	}
	writeAtomically(t, filepath.Join(dir, "token"), "t")
	writeAtomically(t, filepath.Join(dir, "ca.crt"), "c")
	if config, err := clusterConfig(context.Background(), ""); err != nil || config == nil || *loads != 1 {
		t.Errorf("with the files there: %v %v (%d loads)", config, err, *loads)
	}
}

func TestOutsideAClusterThereIsNoClient(t *testing.T) {
	_, loads := handover(t, time.Minute)
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	if config, err := clusterConfig(context.Background(), ""); config != nil || err != nil || *loads != 0 {
		t.Errorf("without KUBERNETES_SERVICE_HOST: %v %v (%d loads)", config, err, *loads)
	}
}

func writeFile(path, text string) error { return os.WriteFile(path, []byte(text), 0o600) }
