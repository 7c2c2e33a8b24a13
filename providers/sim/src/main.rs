//! `ccm-provider-sim`: the simulated cloud provider sidecar, and its kubelet-side plugin
//! (`ccm-provider-sim node-metadata`).

use std::path::PathBuf;

use anyhow::Context;
use ccm_provider_sdk::{Listen, node_plugin};
use clap::{Parser, Subcommand};

/// A simulated cloud behind cloudprovider.v1, for tests, benchmarks and trying things out.
#[derive(Debug, Parser)]
#[command(
    name = "ccm-provider-sim",
    version,
    about,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    args_override_self = true
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// Where to serve cloudprovider.v1: unix:///path/provider.sock or http://host:port.
    #[arg(long, value_name = "ENDPOINT", required = true)]
    listen: Option<String>,
    /// A TOML file with the initial inventory, API behaviour and faults (also
    /// `--cloud-config`, the name upstream's charts pass a provider's file under).
    #[arg(long, value_name = "FILE", alias = "cloud-config")]
    config: Option<PathBuf>,
    /// Where to serve the admin API (JSON over HTTP): unix:///path/admin.sock or http://host:port.
    #[arg(long, value_name = "ENDPOINT")]
    admin_listen: Option<String>,
    /// Where to serve the instance metadata service that node plugins read (JSON over HTTP),
    /// like a cloud's link-local 169.254.169.254: http://127.0.0.1:port or unix:///path.sock.
    #[arg(long, value_name = "ENDPOINT")]
    metadata_listen: Option<String>,
    /// Where to serve the provider's Prometheus metrics (`cloudprovider_server_*`) at
    /// /metrics, plain HTTP: http://host:port or unix:///path.sock. Off when unset.
    #[arg(long, value_name = "ENDPOINT")]
    metrics_listen: Option<String>,
    /// Serve cloudprovider.v1 (on a TCP --listen) with mutual TLS: this certificate (PEM),
    /// with --tls-key-file and --tls-client-ca-file; clients need a certificate of that CA.
    #[arg(long, value_name = "FILE", requires_all = ["tls_key_file", "tls_client_ca_file"])]
    tls_cert_file: Option<PathBuf>,
    /// Serve a TCP --listen, or the admin API, without TLS on an address other hosts can
    /// reach (refused otherwise: only loopback is served in the clear).
    #[arg(long)]
    allow_insecure_tcp: bool,
    /// The mode of the unix sockets served, octal: 0600 (only this user), or 0660 for a core
    /// running as another user of the directory's group (the pod's fsGroup). Others never.
    #[arg(long, value_name = "MODE", default_value = "0600", value_parser = socket_mode)]
    socket_mode: u32,
    /// Serve --metrics-listen over plain HTTP on an address other hosts can reach (refused
    /// otherwise: a unix socket, which the core serves again behind its authentication, or
    /// loopback).
    #[arg(long)]
    allow_insecure_metrics: bool,
    /// The private key of --tls-cert-file (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert_file")]
    tls_key_file: Option<PathBuf>,
    /// The CA whose client certificates are accepted (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert_file")]
    tls_client_ca_file: Option<PathBuf>,
    /// Serve NodeMetadataService describing this instance id (overrides the config file).
    #[arg(long, value_name = "ID")]
    metadata_instance: Option<String>,
    /// Log filter, as RUST_LOG.
    #[arg(long, default_value = "info", env = "RUST_LOG", global = true)]
    log: String,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The kubelet-side plugin of one instance: NodeMetadataService and
    /// ImageCredentialsService on a unix socket, answered from the sim's metadata service.
    NodeMetadata(NodeMetadataArgs),
    /// The load balancers' data plane agent (see the sim's `[dataplane]`): forwards each
    /// load balancer's traffic to its backends with nftables, in the network namespace it
    /// runs in. Needs CAP_NET_ADMIN, nft, ip and conntrack.
    Dataplane(ccm_provider_sim::dataplane::AgentArgs),
    /// A tiny HTTP backend for trying load balancers: answers every request with the host
    /// it runs on (`$POD_NAME` or the host name) and the client's address.
    Echo(ccm_provider_sim::dataplane::EchoArgs),
}

#[derive(Debug, clap::Args)]
struct NodeMetadataArgs {
    /// Where to serve: a unix socket ending in .sock.
    #[arg(long, value_name = "ENDPOINT", default_value_t = node_plugin::default_listen(PLUGIN_NAME).to_string())]
    listen: String,
    /// The instance this node is.
    #[arg(long, value_name = "ID", required_unless_present = "node_name")]
    instance_id: Option<String>,
    /// The host name of the instance this node is (in a DaemonSet: the Node's name, from
    /// the downward API).
    #[arg(long, value_name = "NAME", env = "NODE_NAME")]
    node_name: Option<String>,
    /// The sim's instance metadata service (its --metadata-listen).
    #[arg(long, value_name = "ENDPOINT", default_value = "http://127.0.0.1:8169")]
    metadata_endpoint: String,
}

const PLUGIN_NAME: &str = "sim.cloudprovider.dev";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // CCM_CHECK_ARGS: parse and check the arguments only (see ccm-core's runtime::CHECK_ARGS_ENV).
    let check_only = std::env::var_os("CCM_CHECK_ARGS").is_some_and(|v| !v.is_empty());
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::new(&args.log)).with_writer(std::io::stderr).init();
    if let Some(Command::Dataplane(a)) = args.command {
        let options = a.options();
        if check_only {
            println!("ccm-provider-sim dataplane: arguments ok");
            return Ok(());
        }
        return ccm_provider_sim::dataplane::run_agent(options, ccm_provider_sdk::server::shutdown_signal()).await;
    }
    if let Some(Command::Echo(a)) = args.command {
        if check_only {
            println!("ccm-provider-sim echo: arguments ok");
            return Ok(());
        }
        return ccm_provider_sim::dataplane::echo(a.listen, ccm_provider_sdk::server::shutdown_signal()).await;
    }
    if let Some(Command::NodeMetadata(a)) = args.command {
        let listen: Listen = a.listen.parse().context("--listen")?;
        if !matches!(listen, Listen::Unix(_)) {
            anyhow::bail!("--listen: the node plugin serves on a unix socket (unix:///path.sock)");
        }
        let plugin = match (a.instance_id, a.node_name) {
            (Some(id), _) => ccm_provider_sim::plugin::NodePlugin::new(a.metadata_endpoint, id),
            (None, Some(name)) => ccm_provider_sim::plugin::NodePlugin::named(a.metadata_endpoint, name),
            (None, None) => anyhow::bail!("--instance-id or --node-name is required"),
        };
        if check_only {
            println!("ccm-provider-sim node-metadata: arguments ok");
            return Ok(());
        }
        return ccm_provider_sim::plugin::run(PLUGIN_NAME, plugin, listen, ccm_provider_sdk::server::shutdown_signal()).await;
    }
    let parse = |flag: &str, value: Option<&str>| value.map(str::parse::<Listen>).transpose().with_context(|| flag.to_string());
    let endpoints = ccm_provider_sim::Endpoints {
        provider: parse("--listen", args.listen.as_deref())?.context("--listen is required")?,
        admin: parse("--admin-listen", args.admin_listen.as_deref())?,
        metadata: parse("--metadata-listen", args.metadata_listen.as_deref())?,
        metrics: parse("--metrics-listen", args.metrics_listen.as_deref())?,
    };
    if let Some(Listen::Tcp(addr)) = &endpoints.metrics
        && !addr.ip().is_loopback()
        && !args.allow_insecure_metrics
    {
        return Err(ccm_provider_sdk::server::ServeError::InsecureMetrics(addr.to_string()).into());
    }
    // The admin API changes the cloud and has no authentication: on a socket, on loopback, or
    // (tests on a bridge) explicitly.
    if let Some(Listen::Tcp(addr)) = &endpoints.admin
        && !addr.ip().is_loopback()
        && !args.allow_insecure_tcp
    {
        anyhow::bail!(
            "--admin-listen {addr}: the admin API changes the cloud and checks no caller; serve it on a unix socket or \
             loopback, or allow it on this address explicitly (--allow-insecure-tcp)"
        );
    }
    if check_only {
        // The config file is the pod's (a mounted ConfigMap): checked where it is mounted.
        println!("ccm-provider-sim: arguments ok");
        return Ok(());
    }
    let mut config = match &args.config {
        Some(path) => ccm_provider_sim::Config::load(path)?,
        None => ccm_provider_sim::Config::default(),
    };
    if args.metadata_instance.is_some() {
        config.node_metadata_instance = args.metadata_instance.clone();
    }
    config.allow_insecure_tcp |= args.allow_insecure_tcp;
    config.socket_mode = args.socket_mode;
    config.allow_insecure_metrics = args.allow_insecure_metrics;
    let tls = args.tls_cert_file.map(|cert| ccm_provider_sdk::tls::TlsFiles {
        cert,
        key: args.tls_key_file.unwrap_or_default(),
        ca: args.tls_client_ca_file.unwrap_or_default(),
    });
    ccm_provider_sim::serve(config, endpoints, tls, ccm_provider_sdk::server::shutdown_signal()).await
}

/// A `--socket-mode`: octal, owner read and write, nothing for others.
fn socket_mode(value: &str) -> Result<u32, String> {
    let mode = u32::from_str_radix(value.trim_start_matches("0o"), 8).map_err(|_| format!("{value:?} is not an octal mode"))?;
    if mode & 0o600 != 0o600 || mode & !0o770 != 0 {
        return Err(format!("{value}: expected owner read and write and nothing for others (0600, 0660)"));
    }
    Ok(mode)
}
