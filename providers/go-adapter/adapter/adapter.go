// Package adapter serves any k8s.io/cloud-provider cloudprovider.Interface as a
// cloudprovider.v1 provider: Identity, Instances (from InstancesV2, or Instances and Zones),
// Routes and LoadBalancers, as the implementation offers them. See ../README.md for what is
// translated and how.
package adapter

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"sync"
	"syscall"
	"time"

	pb "github.com/ccm-rs/go-adapter/gen/cloudprovider/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	cloudprovider "k8s.io/cloud-provider"
	"k8s.io/klog/v2"
)

// Options says how to serve.
type Options struct {
	// Listen is `unix:///path/provider.sock` (created with SocketMode; a stale socket
	// replaced, a live one or any other file refused) or `tcp://host:port`.
	Listen string
	// SocketMode is the mode of a unix socket Listen; default 0600 (the owner only). 0660
	// lets the core reach it through a group (different users sharing the Pod's fsGroup);
	// anything for others, or beyond 0770, is refused (CheckSocketMode).
	SocketMode os.FileMode
	// Name is the plugin name (GetPluginInfo); default `<provider>.go-adapter.ccm-rs.dev`.
	Name string
	// Version is the plugin version; default "0.0.0".
	Version string
	// ProviderIDScheme is the scheme of the providerIDs the cloud issues; default the
	// provider's name (upstream builds providerIDs as `<ProviderName()>://…`).
	ProviderIDScheme string
	// BatchReads advertises BatchInstanceMetadata as cheap: set it for providers that
	// coalesce their cloud reads (the AWS provider batches DescribeInstances).
	BatchReads bool
	// BatchConcurrency bounds the per-instance calls of one batch read; default 16.
	BatchConcurrency int
	// RoutesIPv6 advertises routes to IPv6 destinations (only for providers that create them).
	RoutesIPv6 bool
	// Bulk advertises ApplyRoutes and BatchUpdateLoadBalancerHosts. The interface has no bulk
	// call, so each item is still its own cloud call (BatchConcurrency at a time); the core
	// sends one RPC per 500 items instead of one each.
	Bulk bool
	// TLSCertFile, TLSKeyFile and TLSClientCAFile (PEM) serve a TCP Listen with mutual TLS:
	// this certificate, and a client certificate of that CA required (the core's
	// --provider-tls-* files). Not for unix sockets, whose file mode guards them.
	TLSCertFile, TLSKeyFile, TLSClientCAFile string
	// AllowInsecureTCP serves a tcp:// Listen without TLS on an address other hosts can
	// reach; refused otherwise (every call would cross the network in the clear).
	AllowInsecureTCP bool
	// CallRate, when above zero, is declared as GetPluginCapabilities' call_rate: the calls
	// per second the core may send (every service but Identity), CallBurst at once. Give the
	// cloud's API budget for this provider divided by the cloud calls one call makes; the
	// core paces to it instead of learning the limit from refusals.
	CallRate  float64
	CallBurst uint32
	// LoadBalancerClasses are the Service loadBalancerClass values advertised
	// (LoadBalancersCapabilities.classes): a core serving several providers sends Services of
	// these classes here.
	LoadBalancerClasses []string
}

// tlsOption is the server option for opts' mutual TLS, or nil without it.
func tlsOption(opts Options) (grpc.ServerOption, error) {
	if opts.TLSCertFile == "" && opts.TLSKeyFile == "" && opts.TLSClientCAFile == "" {
		return nil, nil
	}
	if opts.TLSCertFile == "" || opts.TLSKeyFile == "" || opts.TLSClientCAFile == "" {
		return nil, errors.New("mutual TLS needs a certificate, its key and the client CA")
	}
	if strings.HasPrefix(opts.Listen, "unix://") {
		return nil, fmt.Errorf("%s: TLS is for TCP endpoints; a unix socket's file mode guards it", opts.Listen)
	}
	cert, err := tls.LoadX509KeyPair(opts.TLSCertFile, opts.TLSKeyFile)
	if err != nil {
		return nil, fmt.Errorf("loading %s and %s: %w", opts.TLSCertFile, opts.TLSKeyFile, err)
	}
	ca, err := os.ReadFile(opts.TLSClientCAFile)
	if err != nil {
		return nil, fmt.Errorf("reading the client CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return nil, fmt.Errorf("%s holds no PEM certificate", opts.TLSClientCAFile)
	}
	config := &tls.Config{
		Certificates: []tls.Certificate{cert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    pool,
		MinVersion:   tls.VersionTLS12,
	}
	return grpc.Creds(credentials.NewTLS(config)), nil
}

func (o Options) withDefaults(cloud cloudprovider.Interface) Options {
	if o.Name == "" {
		o.Name = strings.ToLower(cloud.ProviderName()) + ".go-adapter.ccm-rs.dev"
	}
	if o.Version == "" {
		o.Version = "0.0.0"
	}
	if o.ProviderIDScheme == "" {
		o.ProviderIDScheme = cloud.ProviderName()
	}
	if o.BatchConcurrency <= 0 {
		o.BatchConcurrency = 16
	}
	return o
}

// MaxMessageSize is the largest message either side of cloudprovider.v1 sends or accepts,
// as in the core: 64 MiB where gRPC's default is 4 MiB (an EnsureLoadBalancer for 5000 Nodes
// with their labels is about 7 MB).
const MaxMessageSize = 64 << 20

// NewServer registers, on a new gRPC server, every service the cloud offers.
func NewServer(cloud cloudprovider.Interface, opts Options, extra ...grpc.ServerOption) *grpc.Server {
	opts = opts.withDefaults(cloud)
	base := []grpc.ServerOption{grpc.MaxRecvMsgSize(MaxMessageSize), grpc.MaxSendMsgSize(MaxMessageSize), grpc.ChainUnaryInterceptor(recoverPanics)}
	server := grpc.NewServer(append(base, extra...)...)
	id := &identity{opts: opts}
	v2, hasV2 := cloud.InstancesV2()
	v1, hasV1 := cloud.Instances()
	zones, hasZones := cloud.Zones()
	switch {
	case hasV2 && v2 != nil:
		pb.RegisterInstancesServiceServer(server, &instances{cloud: cloud, v2: v2, batchSize: opts.BatchConcurrency})
		id.services = append(id.services, pb.ServiceType_SERVICE_TYPE_INSTANCES)
	case hasV1 && v1 != nil:
		s := &instances{cloud: cloud, v1: v1, batchSize: opts.BatchConcurrency}
		if hasZones {
			s.zones = zones
		}
		pb.RegisterInstancesServiceServer(server, s)
		id.services = append(id.services, pb.ServiceType_SERVICE_TYPE_INSTANCES)
	}
	if r, ok := cloud.Routes(); ok && r != nil {
		pb.RegisterRoutesServiceServer(server, &routes{routes: r, name: cloud.ProviderName(), ipv6: opts.RoutesIPv6, concurrency: opts.BatchConcurrency, locks: newObjectLocks()})
		id.services = append(id.services, pb.ServiceType_SERVICE_TYPE_ROUTES)
	}
	if lb, ok := cloud.LoadBalancer(); ok && lb != nil {
		pb.RegisterLoadBalancersServiceServer(server, &loadBalancers{lb: lb, concurrency: opts.BatchConcurrency, locks: newObjectLocks()})
		id.services = append(id.services, pb.ServiceType_SERVICE_TYPE_LOAD_BALANCERS)
	}
	if !cloud.HasClusterID() {
		klog.Warning("the provider has no cluster ID: it cannot tell this cluster's cloud resources from another's")
	}
	pb.RegisterIdentityServiceServer(server, id)
	return server
}

// DefaultSocketMode is the mode of a unix socket when none is given: its owner's only.
const DefaultSocketMode os.FileMode = 0o600

// CheckSocketMode refuses a unix socket mode that grants anything to others or beyond
// 0770 (set-id and sticky bits), or that does not let its owner read and write: a socket is
// for its owner and, at most, one group (the core's, through a shared fsGroup).
func CheckSocketMode(mode os.FileMode) error {
	if mode&^0o770 != 0 {
		return fmt.Errorf("%#o grants more than owner and group (at most 0770)", uint32(mode))
	}
	if mode&0o600 != 0o600 {
		return fmt.Errorf("%#o does not let the owner read and write (at least 0600)", uint32(mode))
	}
	return nil
}

// Listen opens the endpoint: a unix socket (see ListenUnix; the path must end in .sock) of
// socketMode (DefaultSocketMode when 0), or TCP.
func Listen(endpoint string, socketMode os.FileMode) (net.Listener, error) {
	switch {
	case strings.HasPrefix(endpoint, "unix://"):
		path := strings.TrimPrefix(endpoint, "unix://")
		if !strings.HasSuffix(path, ".sock") {
			return nil, fmt.Errorf("--listen %q: a unix socket path must end in .sock", endpoint)
		}
		l, err := ListenUnix(path, socketMode)
		if err != nil {
			return nil, fmt.Errorf("--listen %q: %w", endpoint, err)
		}
		return l, nil
	case strings.HasPrefix(endpoint, "tcp://"):
		l, err := net.Listen("tcp", strings.TrimPrefix(endpoint, "tcp://"))
		if err != nil {
			return nil, fmt.Errorf("listening on %s: %w", endpoint, err)
		}
		return l, nil
	default:
		return nil, fmt.Errorf("--listen %q: use unix:///path/provider.sock or tcp://host:port", endpoint)
	}
}

// ListenUnix listens on a unix socket at path of mode (DefaultSocketMode when 0; refused
// unless CheckSocketMode accepts it). A socket file already there is
// replaced only when it is stale (connecting to it is refused); a socket another process
// still serves, one whose state cannot be told, and anything that is not a socket are left
// alone and refused: a second sidecar started by mistake (or a process that wants the core's
// calls) must not take the place of the one serving. Closing the listener removes the socket
// (unless something else has taken its path since).
func ListenUnix(path string, mode os.FileMode) (net.Listener, error) {
	if mode == 0 {
		mode = DefaultSocketMode
	}
	if err := CheckSocketMode(mode); err != nil {
		return nil, fmt.Errorf("socket mode %w", err)
	}
	if err := removeStale(path); err != nil {
		return nil, err
	}
	return listenPrivately(path, mode)
}

// removeStale removes the socket at path if no process serves it; nothing at path is fine.
func removeStale(path string) error {
	info, err := os.Lstat(path)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return nil
	case err != nil:
		return fmt.Errorf("inspecting %s: %w", path, err)
	case info.Mode()&os.ModeSocket == 0:
		return fmt.Errorf("%s exists and is not a socket; refusing to remove it", path)
	}
	conn, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		_ = conn.Close()
		return fmt.Errorf("another process serves unix://%s; refusing to replace it", path)
	}
	// Only a refusal says nobody listens. A full backlog (EAGAIN) means a busy server; a
	// permission error, a socket this user cannot judge.
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("cannot tell whether another process serves unix://%s (%w); refusing to replace it", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("removing the stale socket %s: %w", path, err)
	}
	return nil
}

// listenPrivately listens on a unix socket at path that is never reachable there with a
// wider mode than mode: it is bound in a private directory (0700) beside path, given mode
// there, then linked into place (a link, unlike a rename, fails when another process has put a
// socket at path since removeStale looked). Closing the listener removes the socket.
func listenPrivately(path string, mode os.FileMode) (net.Listener, error) {
	staging, err := os.MkdirTemp(filepath.Dir(path), ".bind-")
	if err != nil {
		return nil, fmt.Errorf("a private directory beside %s: %w", path, err)
	}
	defer func() { _ = os.RemoveAll(staging) }()
	staged := filepath.Join(staging, "s")
	l, err := net.Listen("unix", staged)
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", path, err)
	}
	ul, ok := l.(*net.UnixListener)
	if !ok {
		_ = l.Close()
		return nil, fmt.Errorf("listening on %s: not a unix listener", path)
	}
	ul.SetUnlinkOnClose(false)
	if err := os.Chmod(staged, mode); err != nil {
		_ = l.Close()
		return nil, fmt.Errorf("setting the mode %#o of %s: %w", uint32(mode), path, err)
	}
	if err := os.Link(staged, path); err != nil {
		if errors.Is(err, os.ErrExist) {
			_ = l.Close()
			return nil, fmt.Errorf("another process put a file at %s while this one was binding; refusing to replace it", path)
		}
		// A file system without hard links: renamed instead.
		if err := os.Rename(staged, path); err != nil {
			_ = l.Close()
			return nil, fmt.Errorf("moving the socket to %s: %w", path, err)
		}
	}
	bound, err := os.Lstat(path)
	if err != nil {
		_ = l.Close()
		return nil, fmt.Errorf("the socket at %s: %w", path, err)
	}
	return &unlinking{Listener: l, path: path, bound: bound}, nil
}

// unlinking removes its socket file when closed, if the file at its path is still the
// socket it bound (another process's socket there is left alone).
type unlinking struct {
	net.Listener
	path  string
	bound os.FileInfo
	once  sync.Once
	err   error
}

func (u *unlinking) Close() error {
	u.once.Do(func() {
		u.err = u.Listener.Close()
		now, err := os.Lstat(u.path)
		if err != nil || !os.SameFile(now, u.bound) {
			return
		}
		if err := os.Remove(u.path); err != nil && !errors.Is(err, os.ErrNotExist) && u.err == nil {
			u.err = err
		}
	})
	return u.err
}

// Serve serves the cloud on opts.Listen until ctx ends, then stops gracefully and removes
// its unix socket.
func Serve(ctx context.Context, cloud cloudprovider.Interface, opts Options) error {
	creds, err := tlsOption(opts)
	if err != nil {
		return err
	}
	var extra []grpc.ServerOption
	if creds != nil {
		extra = append(extra, creds)
	}
	if creds == nil && !opts.AllowInsecureTCP && !plaintextAllowed(opts.Listen) {
		return fmt.Errorf("--listen %s: plaintext TCP that other hosts can reach would carry every call in the clear; serve mutual TLS (--tls-cert-file, …), a unix socket or loopback, or allow it explicitly (--allow-insecure-tcp)", opts.Listen)
	}
	l, err := Listen(opts.Listen, opts.SocketMode)
	if err != nil {
		return err
	}
	server := NewServer(cloud, opts, extra...)
	done := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
			server.GracefulStop()
		case <-done:
		}
	}()
	klog.InfoS("serving cloudprovider.v1", "provider", cloud.ProviderName(), "listen", opts.Listen)
	// Serve closes the listener when it returns, which removes a unix socket.
	err = server.Serve(l)
	close(done)
	if errors.Is(err, grpc.ErrServerStopped) {
		return nil
	}
	return err
}

// recoverPanics answers INTERNAL for a call whose provider code panicked, with the panic in
// the log, instead of the whole sidecar dying with every other call in flight: providers'
// code was written for a process upstream restarts, and one bad answer (a nil dereference on
// an unexpected cloud reply) must cost one call, not the sidecar. Provider calls run on
// goroutines of their own (bounded, mutation, each), which recover there too.
func recoverPanics(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
	defer func() {
		if r := recover(); r != nil {
			resp, err = nil, panicked(info.FullMethod, r)
		}
	}()
	return handler(ctx, req)
}

// panicked logs a recovered panic and is the INTERNAL error answered for it.
func panicked(where string, r any) error {
	klog.ErrorS(nil, "the provider panicked; answering INTERNAL", "where", where, "panic", r, "stack", string(debug.Stack()))
	return newStatus(codes.Internal, "PROVIDER_PANIC", fmt.Sprintf("the provider panicked: %v", r), 0)
}

// plaintextAllowed says whether endpoint may be served without TLS: a unix socket, or TCP on a
// loopback address (a sidecar reached from its own pod, a test).
func plaintextAllowed(endpoint string) bool {
	rest, ok := strings.CutPrefix(endpoint, "tcp://")
	if !ok {
		return true
	}
	host, _, err := net.SplitHostPort(rest)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
