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
    /// The provider's endpoint: unix:///path/provider.sock or http://host:port. Repeat it for
    /// the providers of one hybrid cluster: the suite runs against each, then the checks of
    /// providers together (no providerID scheme or load balancer class claimed twice).
    #[arg(long, value_name = "ENDPOINT", required = true)]
    endpoint: Vec<String>,
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
    let call_timeout = Duration::from_secs(args.call_timeout_seconds);
    let several = args.endpoint.len() > 1;
    let mut failed = false;
    for endpoint in &args.endpoint {
        if several {
            println!("== {endpoint}");
        }
        let mut options = Options::new(endpoint.clone());
        options.call_timeout = call_timeout;
        options.consistency_timeout = Duration::from_secs(args.consistency_timeout_seconds);
        options.max_quota_to_fill = args.max_quota_to_fill;
        options.instances = args.instances.clone();
        match conformance::run(&options, |result| println!("{result}")).await {
            Ok(report) => {
                println!("{}", report.summary());
                failed |= report.failed() > 0;
            }
            Err(e) => return unreachable(endpoint, &e),
        }
    }
    if several {
        println!("== together");
        match conformance::run_together(&args.endpoint, call_timeout).await {
            Ok(report) => {
                report.results.iter().for_each(|r| println!("{r}"));
                println!("{}", report.summary());
                failed |= report.failed() > 0;
            }
            Err(e) => return unreachable("the providers", &e),
        }
    }
    if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS }
}

fn unreachable(what: &str, e: &conformance::RunError) -> ExitCode {
    let source = std::error::Error::source(e).map(|s| s.to_string()).unwrap_or_default();
    eprintln!("ccm-conformance: {what}: {e}: {source}");
    ExitCode::from(2)
}
