package main

import (
	"crypto/x509"
	"encoding/pem"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// rootsChildEnv marks the child process of TestTheEmbeddedRootsVerifyWithoutASystemBundle.
const rootsChildEnv = "CCM_PROVIDER_AWS_TEST_EMPTY_SYSTEM_ROOTS"

// The release image is FROM scratch, with no CA bundle: the AWS SDK's TLS can verify AWS's
// certificates only through the roots main.go embeds. The system pool is loaded once per
// process, so the check runs in a child process of this test binary started with
// SSL_CERT_FILE and SSL_CERT_DIR naming nothing (an empty directory): its system pool is
// then empty, as in the image.
func TestTheEmbeddedRootsVerifyWithoutASystemBundle(t *testing.T) {
	if os.Getenv(rootsChildEnv) == "1" {
		verifyAPublicChainWithTheSystemPool(t)
		return
	}
	empty := t.TempDir()
	child := exec.Command(os.Args[0], "-test.run=^TestTheEmbeddedRootsVerifyWithoutASystemBundle$", "-test.v", "-test.count=1")
	child.Env = append(os.Environ(),
		rootsChildEnv+"=1",
		"SSL_CERT_FILE="+filepath.Join(empty, "no-bundle.pem"),
		"SSL_CERT_DIR="+empty,
	)
	out, err := child.CombinedOutput()
	if err != nil {
		t.Fatalf("without a system CA bundle: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "--- PASS: TestTheEmbeddedRootsVerifyWithoutASystemBundle") {
		t.Fatalf("the child process did not run the check:\n%s", out)
	}
}

// verifyAPublicChainWithTheSystemPool verifies testdata's public chain (www.google.com, GTS CA
// 1C3, to GTS Root R1 of Mozilla's store) against x509.SystemCertPool at a time inside the
// leaf's validity.
func verifyAPublicChainWithTheSystemPool(t *testing.T) {
	leaf := readCertificate(t, "testdata/www.google.com.pem")
	intermediates := x509.NewCertPool()
	intermediates.AddCert(readCertificate(t, "testdata/gts-ca-1c3.pem"))
	roots, err := x509.SystemCertPool()
	if err != nil {
		t.Fatalf("the system pool (SSL_CERT_FILE=%s, SSL_CERT_DIR=%s): %v", os.Getenv("SSL_CERT_FILE"), os.Getenv("SSL_CERT_DIR"), err)
	}
	_, err = leaf.Verify(x509.VerifyOptions{
		Roots:         roots,
		Intermediates: intermediates,
		DNSName:       "www.google.com",
		CurrentTime:   time.Unix(1677615892, 0),
	})
	if err != nil {
		t.Fatalf(`with no system CA bundle, a public chain to GTS Root R1 (Mozilla's store) does not verify: %v. main.go must import _ "golang.org/x/crypto/x509roots/fallback", Go's embedded Mozilla roots, or the FROM scratch image cannot verify AWS's certificates (if the import is there, the bundle no longer holds GTS Root R1: pick another chain)`, err)
	}
}

func readCertificate(t *testing.T, path string) *x509.Certificate {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(data)
	if block == nil || block.Type != "CERTIFICATE" {
		t.Fatalf("%s holds no PEM certificate", path)
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return cert
}
