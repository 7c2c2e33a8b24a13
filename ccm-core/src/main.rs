//! `cloud-controller-manager`: the generic core. See `ccm-core/README.md`.

#[tokio::main]
async fn main() -> std::process::ExitCode {
    ccm_core::runtime::main_with_args(std::env::args_os()).await
}
