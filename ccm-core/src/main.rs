//! `cloud-controller-manager`: the generic core. See `--help`.

use std::process::ExitCode;

use ccm_core::options::Options;
use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    let options = Options::parse();
    let filter = tracing_subscriber::EnvFilter::new(&options.log_level);
    if options.log_format == "json" {
        tracing_subscriber::fmt().json().with_env_filter(filter).with_writer(std::io::stderr).init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    }
    match ccm_core::runtime::run(options).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("{error:#}");
            eprintln!("cloud-controller-manager: {error:#}");
            ExitCode::FAILURE
        }
    }
}
