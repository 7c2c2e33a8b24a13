#!/usr/bin/env bash
# build-binaries.sh OUT BIN...: builds the named binaries of this workspace as static (musl)
# release executables and copies them into OUT (the Go sidecars, such as ccm-provider-aws,
# as static Go executables from their modules under providers/). The build stage of every Containerfile here
# runs it, and so does build.py, which makes the same images without a container engine.
#
# The target follows TARGETARCH (set by `docker buildx build --platform ...`), else the
# machine: amd64/x86_64 -> x86_64-unknown-linux-musl, arm64/aarch64 -> aarch64-unknown-linux-musl.
# GIT_COMMIT, when set, is what `--version` reports (else the repository's HEAD, if any).
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: build-binaries.sh OUT BIN..." >&2; exit 2; }
out=$1; shift
arch=${TARGETARCH:-$(uname -m)}
case "$arch" in
  amd64|x86_64) target=x86_64-unknown-linux-musl ;;
  arm64|aarch64) target=aarch64-unknown-linux-musl ;;
  *) echo "build-binaries.sh: no musl target for architecture $arch" >&2; exit 1 ;;
esac
cd "$(dirname "$0")/../.."
if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
  rustup target add "$target" >&2
fi
# ring (TLS) compiles C for the target. On the target's own architecture that is musl's
# compiler wrapper (Debian: musl-tools); for the other one, a cross compiler that also links
# (Debian: gcc-aarch64-linux-gnu or gcc-x86-64-linux-gnu; Rust's musl targets bring their own
# C library, so a glibc cross toolchain serves).
host=$(uname -m)
case "$target" in
  x86_64-*) cross=x86_64-linux-gnu-gcc; native=x86_64 ;;
  aarch64-*) cross=aarch64-linux-gnu-gcc; native=aarch64 ;;
esac
if [ "$host" = "$native" ] || [ "$host" = "${native/x86_64/amd64}" ] || [ "$host" = "${native/aarch64/arm64}" ]; then
  command -v musl-gcc >/dev/null || { echo "build-binaries.sh: musl-gcc not found (apt-get install musl-tools)" >&2; exit 1; }
else
  command -v "$cross" >/dev/null || {
    echo "build-binaries.sh: building for $target on $host needs the cross compiler $cross (Debian: apt-get install gcc-${cross%-gcc})" >&2; exit 1; }
  t=${target//-/_}
  export "CC_$t=$cross" "CARGO_TARGET_${t^^}_LINKER=$cross"
fi
mkdir -p "$out"
# Go sidecars (the go-adapter's): static, without cgo, from their modules under providers/.
rust=()
for b in "$@"; do
  case "$b" in
    ccm-provider-aws)
      command -v go >/dev/null || { echo "build-binaries.sh: Go is required for $b" >&2; exit 1; }
      version=${VERSION:-0.0.0-dev}
      case "$arch" in amd64|x86_64) goarch=amd64 ;; *) goarch=arm64 ;; esac
      (cd providers/aws && GOTOOLCHAIN=local CGO_ENABLED=0 GOARCH=$goarch \
        GOFLAGS=-mod=readonly go build -trimpath -ldflags="-s -w -X github.com/ccm-rs/go-adapter/sidecar.Version=$version" \
        -o "$out/$b" ./cmd/$b) >&2 ;;
    *) rust+=("$b") ;;
  esac
done
[ ${#rust[@]} -gt 0 ] || exit 0
bins=()
for b in "${rust[@]}"; do bins+=(--bin "$b"); done
export CCM_GIT_COMMIT=${GIT_COMMIT:-${CCM_GIT_COMMIT:-}}
# No path of this machine in the binaries (panic locations, log callers, generated code's
# paths): the repository is /ccm-rs and cargo's home /cargo wherever the build runs, so a
# rebuild elsewhere gives the same bytes. Target-specific, so build scripts are not rebuilt;
# it replaces .cargo/config.toml's [build] rustflags, which are repeated here.
t=${target//-/_}
cargo_home=${CARGO_HOME:-$HOME/.cargo}
export "CARGO_TARGET_${t^^}_RUSTFLAGS=--cfg tokio_unstable --remap-path-prefix=$(pwd)=/ccm-rs --remap-path-prefix=$cargo_home=/cargo"
# The core's allocator (CCM_ALLOCATOR): jemalloc (the default: measured, bench/README), musl's
# own (system) or mimalloc. jemalloc on arm64 is built for pages up to 64 KiB (some arm64
# kernels use them; a 4 KiB build would not start there).
allocator=${CCM_ALLOCATOR:-jemalloc}
features=()
case "$allocator" in
  system) ;;
  mimalloc|jemalloc) features=(--features "ccm-core/$allocator") ;;
  *) echo "build-binaries.sh: CCM_ALLOCATOR=$allocator: expected jemalloc, system or mimalloc" >&2; exit 2 ;;
esac
case " ${rust[*]} " in *" cloud-controller-manager "*) ;; *) features=() ;; esac
if [ "$allocator" = jemalloc ] && [ ${#features[@]} -gt 0 ]; then
  command -v make >/dev/null || { echo "build-binaries.sh: jemalloc's build needs make (Debian: apt-get install make), or CCM_ALLOCATOR=system" >&2; exit 1; }
fi
case "$target" in aarch64-*) export JEMALLOC_SYS_WITH_LG_PAGE=16 ;; esac
# jemalloc keeps its default decay (freed pages back to the kernel after 10 s). Measured at
# 20,000 Nodes (bench/README): 1 s lowered the peak by 3% (230 against 237 MiB) but made the
# load balancers 11% slower (each EnsureLoadBalancer's 2 MB node set faulted in afresh);
# _RJEM_MALLOC_CONF=dirty_decay_ms:1000 sets it at run time where memory matters more.
cargo build --release --locked --target "$target" "${features[@]}" "${bins[@]}" >&2
for b in "${rust[@]}"; do install -m 0755 "target/$target/release/$b" "$out/$b"; done
