package adapter

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	pb "github.com/ccm-rs/go-adapter/gen/cloudprovider/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// authority is a test CA that signs server and client certificates.
type authority struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newAuthority(t *testing.T, name string) *authority {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	template := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, template, template, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &authority{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue writes a certificate of usage for 127.0.0.1 and its key into dir, returning the paths.
func (a *authority) issue(t *testing.T, dir, name string, usage x509.ExtKeyUsage) (string, string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	template := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1")},
	}
	der, err := x509.CreateCertificate(rand.Reader, template, a.cert, &key.PublicKey, a.key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certPath, keyPath := filepath.Join(dir, name+".crt"), filepath.Join(dir, name+".key")
	write := func(path, kind string, der []byte) {
		if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(certPath, "CERTIFICATE", der)
	write(keyPath, "PRIVATE KEY", keyDER)
	return certPath, keyPath
}

func freeAddress(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = l.Close() }()
	return l.Addr().String()
}

func TestMutualTLSOverTCPAdmitsOnlyTheCAsClients(t *testing.T) {
	dir := t.TempDir()
	ca := newAuthority(t, "ccm-ca")
	caPath := filepath.Join(dir, "ca.crt")
	if err := os.WriteFile(caPath, ca.pem, 0o600); err != nil {
		t.Fatal(err)
	}
	serverCert, serverKey := ca.issue(t, dir, "provider", x509.ExtKeyUsageServerAuth)
	clientCert, clientKey := ca.issue(t, dir, "core", x509.ExtKeyUsageClientAuth)
	rogueCert, rogueKey := newAuthority(t, "rogue").issue(t, dir, "rogue", x509.ExtKeyUsageClientAuth)

	address := freeAddress(t)
	opts := Options{Listen: "tcp://" + address, TLSCertFile: serverCert, TLSKeyFile: serverKey, TLSClientCAFile: caPath}
	serveCtx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(serveCtx, fakeCloud(), opts) }()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})

	pool := x509.NewCertPool()
	pool.AddCert(ca.cert)
	info := func(creds credentials.TransportCredentials) (*pb.GetPluginInfoResponse, error) {
		conn, err := grpc.NewClient(address, grpc.WithTransportCredentials(creds))
		if err != nil {
			return nil, err
		}
		defer func() { _ = conn.Close() }()
		c, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		return pb.NewIdentityServiceClient(conn).GetPluginInfo(c, &pb.GetPluginInfoRequest{}, grpc.WaitForReady(false))
	}
	withCert := func(cert, key string) credentials.TransportCredentials {
		pair, err := tls.LoadX509KeyPair(cert, key)
		if err != nil {
			t.Fatal(err)
		}
		return credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{pair}, RootCAs: pool, MinVersion: tls.VersionTLS12})
	}
	var answer *pb.GetPluginInfoResponse
	var err error
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if answer, err = info(withCert(clientCert, clientKey)); err == nil {
			break
		}
	}
	if err != nil || answer.GetName() != "fake.go-adapter.ccm-rs.dev" {
		t.Fatalf("a client of the CA: %v %v", answer, err)
	}
	if _, err := info(credentials.NewTLS(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12})); err == nil {
		t.Error("a client without a certificate was served")
	}
	if _, err := info(withCert(rogueCert, rogueKey)); err == nil {
		t.Error("a client of another CA was served")
	}
	if _, err := info(insecure.NewCredentials()); err == nil {
		t.Error("a plaintext client was served")
	}
}

func TestTLSOnAUnixSocketIsRefused(t *testing.T) {
	opts := Options{Listen: "unix://" + filepath.Join(t.TempDir(), "p.sock"), TLSCertFile: "a", TLSKeyFile: "b", TLSClientCAFile: "c"}
	err := Serve(context.Background(), fakeCloud(), opts)
	if err == nil || !strings.Contains(err.Error(), "TLS is for TCP") {
		t.Fatalf("want a refusal, got %v", err)
	}
}

func TestPlaintextTCPOnlyOnLoopbackUnlessAllowed(t *testing.T) {
	for endpoint, want := range map[string]bool{
		"unix:///run/p.sock":  true,
		"tcp://127.0.0.1:0":   true,
		"tcp://[::1]:0":       true,
		"tcp://localhost:0":   true,
		"tcp://0.0.0.0:9000":  false,
		"tcp://10.0.0.5:9000": false,
		"tcp://:9000":         false,
	} {
		if got := plaintextAllowed(endpoint); got != want {
			t.Errorf("%s: plaintext allowed %v, want %v", endpoint, got, want)
		}
	}
	err := Serve(context.Background(), fakeCloud(), Options{Listen: "tcp://0.0.0.0:0"})
	if err == nil || !strings.Contains(err.Error(), "--allow-insecure-tcp") {
		t.Errorf("plaintext on every address was served: %v", err)
	}
}
