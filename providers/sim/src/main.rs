//! `ccm-provider-sim`: the simulated cloud provider sidecar.

use std::path::PathBuf;

use anyhow::Context;
use ccm_provider_sdk::Listen;
use clap::Parser;

/// A simulated cloud behind cloudprovider.v1, for tests, benchmarks and trying things out.
#[derive(Debug, Parser)]
#[command(name = "ccm-provider-sim", version, about)]
struct Args {
    /// Where to serve cloudprovider.v1: unix:///path/provider.sock or http://host:port.
    #[arg(long, value_name = "ENDPOINT")]
    listen: String,
    /// A TOML file with the initial inventory, API behaviour and faults.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Where to serve the admin API (JSON over HTTP): unix:///path/admin.sock or http://host:port.
    #[arg(long, value_name = "ENDPOINT")]
    admin_listen: Option<String>,
    /// Serve NodeMetadataService describing this instance id (overrides the config file).
    #[arg(long, value_name = "ID")]
    metadata_instance: Option<String>,
    /// Log filter, as RUST_LOG.
    #[arg(long, default_value = "info", env = "RUST_LOG")]
    log: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::new(&args.log)).with_writer(std::io::stderr).init();
    let mut config = match &args.config {
        Some(path) => ccm_provider_sim::Config::load(path)?,
        None => ccm_provider_sim::Config::default(),
    };
    if args.metadata_instance.is_some() {
        config.node_metadata_instance = args.metadata_instance.clone();
    }
    let listen: Listen = args.listen.parse().context("--listen")?;
    let admin: Option<Listen> = args.admin_listen.as_deref().map(str::parse).transpose().context("--admin-listen")?;
    ccm_provider_sim::run(config, listen, admin, ccm_provider_sdk::server::shutdown_signal()).await
}
