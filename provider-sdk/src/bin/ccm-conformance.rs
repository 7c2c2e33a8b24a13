//! `ccm-conformance`: checks any cloudprovider.v1 provider over its endpoint.
//!
//! Prints one line per check and ends with `N passed, M failed` (`, K skipped`); exits 1 when
//! a check failed and 2 when the endpoint cannot be reached.

use std::process::ExitCode;
use std::time::Duration;

use ccm_provider_sdk::conformance::{self, Options};
use clap::Parser;

/// Conformance suite for cloudprovider.v1 providers.
#[derive(Debug, Parser)]
#[command(name = "ccm-conformance", version, about)]
struct Args {
    /// The provider's endpoint: unix:///path/provider.sock or http://host:port.
    #[arg(long, value_name = "ENDPOINT")]
    endpoint: String,
    /// Deadline of each call, in seconds.
    #[arg(long, default_value_t = 10)]
    call_timeout_seconds: u64,
    /// How long a write may take to show in reads, in seconds.
    #[arg(long, default_value_t = 10)]
    consistency_timeout_seconds: u64,
    /// Fill a route table to test its quota only when it holds at most this many routes.
    #[arg(long, default_value_t = 64)]
    max_quota_to_fill: u32,
    /// The node name of an existing instance, for providers that cannot list instances
    /// (repeatable): the checks that need instances use these.
    #[arg(long = "instance", value_name = "NODE_NAME")]
    instances: Vec<String>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let mut options = Options::new(args.endpoint);
    options.call_timeout = Duration::from_secs(args.call_timeout_seconds);
    options.consistency_timeout = Duration::from_secs(args.consistency_timeout_seconds);
    options.max_quota_to_fill = args.max_quota_to_fill;
    options.instances = args.instances;
    match conformance::run(&options, |result| println!("{result}")).await {
        Ok(report) => {
            println!("{}", report.summary());
            if report.failed() > 0 { ExitCode::FAILURE } else { ExitCode::SUCCESS }
        }
        Err(e) => {
            eprintln!("ccm-conformance: {e}: {}", std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default());
            ExitCode::from(2)
        }
    }
}
