//go:build tools

// Package tools pins the release tools (deploy/images/release.sh): cosign signs and verifies
// the images, crane serves a local registry and copies image layouts into it, and
// cyclonedx-gomod writes the Go sidecars' SBOMs from their binaries' build information.
package tools

import (
	_ "github.com/CycloneDX/cyclonedx-gomod/cmd/cyclonedx-gomod"
	_ "github.com/google/go-containerregistry/cmd/crane"
	_ "github.com/sigstore/cosign/v2/cmd/cosign"
)
