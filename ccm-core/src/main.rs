//! `cloud-controller-manager`: the generic core. See `ccm-core/README.md`.

// The allocator of the static builds (features `mimalloc`, `jemalloc`); else the C library's.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
#[cfg(all(feature = "jemalloc", not(feature = "mimalloc")))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    ccm_core::runtime::main_with_args(std::env::args_os()).await
}
