//! Benchmark: failover between two real `cloud-controller-manager` processes. Each round
//! starts two replicas on a fresh Lease, waits until one leads, then stops the leader either
//! gracefully (SIGTERM: it releases the Lease) or by crashing it (SIGKILL: the Lease must
//! expire), and measures the time until the other replica leads (its
//! `ccm_leader_is_leader` metric).
//!
//! `cargo run -p ccm-bench --example bench_failover -- [ROUNDS] [LEASE_SECONDS]`
//! (defaults 3 rounds, the production lease of 15 s with a 10 s renew deadline and 2 s retry).

#[path = "bench/mod.rs"]
mod bench;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bench::{World, arg, percentile};
use ccm_provider_sim::Config;

/// The core's binary, built first when missing or out of date.
fn core_binary() -> anyhow::Result<PathBuf> {
    ccm_harness::workspace::binary("cloud-controller-manager")
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

async fn leads(port: u16) -> Option<bool> {
    let text = tokio::process::Command::new("curl")
        .args(["-s", "--max-time", "1", &format!("http://127.0.0.1:{port}/metrics")])
        .output()
        .await
        .ok()?;
    let text = String::from_utf8_lossy(&text.stdout).into_owned();
    let line = text.lines().find(|l| l.starts_with("ccm_leader_is_leader "))?;
    Some(line.ends_with(" 1"))
}

struct Replica {
    child: tokio::process::Child,
    port: u16,
}

fn start(world: &World, bin: &PathBuf, lease: &str, lease_secs: u64) -> anyhow::Result<Replica> {
    let port = free_port()?;
    let renew = (lease_secs * 2 / 3).max(1);
    let child = tokio::process::Command::new(bin)
        .arg(format!("--kubeconfig={}", world.cp.kubeconfig_path().display()))
        .arg(format!("--provider-endpoint={}", world.endpoint))
        .arg(format!("--secure-port={port}"))
        .args(["--insecure-serving", "--bind-address=127.0.0.1", "--leader-elect=true"])
        .arg(format!("--log-level={}", std::env::var("BENCH_LOG").unwrap_or_else(|_| "warn".into())))
        .arg(format!("--leader-elect-resource-name={lease}"))
        .arg(format!("--leader-elect-lease-duration={lease_secs}s"))
        .arg(format!("--leader-elect-renew-deadline={renew}s"))
        // Shorter than the renew deadline, as the core requires.
        .arg(format!("--leader-elect-retry-period={}ms", (renew * 1000 / 2).min(2000)))
        .stdout(Stdio::null())
        .stderr(match std::env::var("BENCH_LOG_DIR") {
            Ok(dir) => Stdio::from(std::fs::File::create(format!("{dir}/{lease}-{port}.log"))?),
            Err(_) => Stdio::null(),
        })
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    Ok(Replica { child, port })
}

async fn round(world: &World, bin: &PathBuf, lease: &str, lease_secs: u64, signal: &str) -> anyhow::Result<Duration> {
    let mut a = start(world, bin, lease, lease_secs)?;
    let mut b = start(world, bin, lease, lease_secs)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let a_leads = loop {
        match (leads(a.port).await, leads(b.port).await) {
            (Some(true), Some(false)) => break true,
            (Some(false), Some(true)) => break false,
            _ if Instant::now() > deadline => bail!("no single leader after 60 s"),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    // Steady state first: the standby is watching the Lease, not racing for it.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (leader, standby) = if a_leads { (&mut a, &mut b) } else { (&mut b, &mut a) };
    let pid = leader.child.id().context("leader pid")?.to_string();
    let started = Instant::now();
    tokio::process::Command::new("kill").args([signal, &pid]).status().await?;
    let took = loop {
        if leads(standby.port).await == Some(true) {
            break started.elapsed();
        }
        if started.elapsed() > Duration::from_secs(lease_secs * 4 + 30) {
            bail!("the standby did not take over");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let _ = leader.child.wait().await;
    let pid = standby.child.id().context("standby pid")?.to_string();
    tokio::process::Command::new("kill").args(["-TERM", &pid]).status().await?;
    let _ = tokio::time::timeout(Duration::from_secs(10), standby.child.wait()).await;
    Ok(took)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let rounds = arg(1, 3);
    let lease_secs = arg(2, 15);
    let bin = core_binary()?;
    let world = World::start(Config::default()).await?;
    println!("failover between two cloud-controller-manager processes, lease {lease_secs}s, {rounds} rounds each");
    for (name, signal) in [("graceful stop (SIGTERM, lease released)", "-TERM"), ("crash (SIGKILL, lease expires)", "-KILL")] {
        let mut ms = Vec::new();
        for r in 0..rounds {
            let lease = format!("failover-{}-{r}", &signal[1..].to_lowercase());
            let took = round(&world, &bin, &lease, lease_secs, signal).await?;
            ms.push(took.as_millis() as u64);
        }
        ms.sort_unstable();
        println!("  {name:42} median {} ms, min {} ms, max {} ms ({ms:?})", percentile(&ms, 50.0), ms[0], ms[ms.len() - 1]);
    }
    world.stop();
    Ok(())
}
