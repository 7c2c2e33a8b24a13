//! `ccm-node-metadata`: asks the node-metadata plugin on this node what the instance metadata
//! service says, for the kubelet (flags, a configuration drop-in) and as the kubelet's image
//! credential provider. Exits 1 with one clear sentence on stderr when the plugin is absent,
//! slow or answers something invalid.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use ccm_node_metadata::{KubeletFlags, Plugin, credential_provider, kubelet_config, write_atomically};
use clap::{Parser, Subcommand, ValueEnum};

/// The kubelet-side client of a provider's node-metadata plugin.
#[derive(Debug, Parser)]
#[command(name = "ccm-node-metadata", version, about)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Args)]
struct Connection {
    /// The plugin's socket, as unix:///var/lib/kubelet/plugins/<provider>/node-metadata.sock.
    #[arg(long, value_name = "ENDPOINT")]
    endpoint: String,
    /// How long to wait for the plugin, connecting and answering together.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Prints kubelet flags: --provider-id, --node-ip and --node-labels (only the labels a
    /// kubelet may set on itself under NodeRestriction: zone, region, instance type).
    KubeletFlags {
        #[command(flatten)]
        connection: Connection,
        /// `args`: the flags on one line; `env`: a line `NAME="flags"` for a systemd
        /// EnvironmentFile.
        #[arg(long, value_enum, default_value_t = Format::Args)]
        format: Format,
        /// The variable name of `--format env`.
        #[arg(long, default_value = "KUBELET_CLOUD_ARGS")]
        env_name: String,
        /// Write to this file (atomically) instead of stdout.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// Writes a KubeletConfiguration drop-in (providerID) for the kubelet's --config-dir.
    KubeletConfig {
        #[command(flatten)]
        connection: Connection,
        /// The drop-in file; the kubelet reads only files ending in .conf.
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
        /// Keep running and rewrite the drop-in whenever the plugin's answer changes, asking
        /// at this period (for a container of the node plugin's DaemonSet, which writes the
        /// drop-in on the host for the kubelet's next start). Errors are then logged and
        /// retried instead of ending the command; SIGTERM ends it.
        #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
        refresh: Option<Duration>,
    },
    /// The kubelet's exec image credential provider: a CredentialProviderRequest on stdin,
    /// a CredentialProviderResponse on stdout.
    CredentialProvider {
        #[command(flatten)]
        connection: Connection,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Format {
    Args,
    Env,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    // CCM_CHECK_ARGS: parse the arguments only (see ccm-core's runtime::CHECK_ARGS_ENV).
    if std::env::var_os("CCM_CHECK_ARGS").is_some_and(|v| !v.is_empty()) {
        println!("ccm-node-metadata: arguments ok");
        return std::process::ExitCode::SUCCESS;
    }
    match run(args.command).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("ccm-node-metadata: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::KubeletFlags { connection, format, env_name, out } => {
            let plugin = Plugin::connect(&connection.endpoint, connection.timeout).await?;
            let args = KubeletFlags::from_metadata(&plugin.node_metadata().await?).args().join(" ");
            let text = match format {
                Format::Args => format!("{args}\n"),
                Format::Env => {
                    let valid = !env_name.is_empty()
                        && !env_name.starts_with(|c: char| c.is_ascii_digit())
                        && env_name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
                    if !valid {
                        bail!("--env-name {env_name:?} is not a variable name");
                    }
                    format!("{env_name}=\"{args}\"\n")
                }
            };
            match out {
                Some(path) => write_atomically(&path, &text),
                None => std::io::stdout().write_all(text.as_bytes()).context("writing to stdout"),
            }
        }
        Command::KubeletConfig { connection, out, refresh } => {
            if out.extension().is_none_or(|e| e != "conf") {
                bail!("--out {}: the kubelet reads only drop-in files ending in .conf", out.display());
            }
            let Some(period) = refresh else { return write_kubelet_config(&connection, &out).await };
            keep_kubelet_config(&connection, &out, period).await
        }
        Command::CredentialProvider { connection } => {
            let mut input = Vec::new();
            std::io::stdin().read_to_end(&mut input).context("reading the request from stdin")?;
            let request = credential_provider::parse_request(&input)?;
            let plugin = Plugin::connect(&connection.endpoint, connection.timeout).await?;
            let answer = plugin
                .image_credentials(credential_provider::to_grpc(&request))
                .await
                .with_context(|| format!("credentials for image {}", request.image))?;
            let response = credential_provider::to_response(&request, answer);
            let mut out = serde_json::to_vec(&response).context("encoding the response")?;
            out.push(b'\n');
            std::io::stdout().write_all(&out).context("writing to stdout")
        }
    }
}

async fn write_kubelet_config(connection: &Connection, out: &std::path::Path) -> anyhow::Result<()> {
    let plugin = Plugin::connect(&connection.endpoint, connection.timeout).await?;
    let metadata = plugin.node_metadata().await?;
    let text = kubelet_config(&metadata, &connection.endpoint);
    // Rewrite only a changed file, so that a kept drop-in's modification time means something.
    if std::fs::read_to_string(out).is_ok_and(|old| old == text) {
        return Ok(());
    }
    write_atomically(out, &text)?;
    eprintln!("ccm-node-metadata: wrote {}", out.display());
    Ok(())
}

/// `kubelet-config --refresh`: writes the drop-in, then again at every period when the answer
/// changed, until SIGTERM or SIGINT. A failure (the plugin not up yet, say) is reported and
/// retried sooner: after 1 s, doubling up to the period.
async fn keep_kubelet_config(connection: &Connection, out: &std::path::Path, period: Duration) -> anyhow::Result<()> {
    let mut term =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).context("installing a SIGTERM handler")?;
    let mut retry = Duration::from_secs(1);
    loop {
        let wait = match write_kubelet_config(connection, out).await {
            Ok(()) => {
                retry = Duration::from_secs(1);
                period
            }
            Err(error) => {
                let wait = retry.min(period);
                eprintln!("ccm-node-metadata: {error:#} (retrying in {})", humantime::format_duration(wait));
                retry = (retry * 2).min(period);
                wait
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = term.recv() => return Ok(()),
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
}
