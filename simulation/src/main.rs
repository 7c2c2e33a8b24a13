//! `ccm-simulate`: runs seeds of the deterministic simulation and reports what broke.
//!
//! `ccm-simulate --seeds 100000` runs seeds 0..100000 on every core; `CCM_SIM_SEED=N
//! ccm-simulate` (or `--seed N`) replays one seed and prints its schedule and every
//! violation, with the core's logs when `RUST_LOG` is set.

use clap::Parser;

#[derive(Parser)]
#[command(name = "ccm-simulate", about = "Runs seeds of the deterministic simulation of the core")]
struct Args {
    /// How many seeds to run (from --from).
    #[arg(long, default_value_t = 500)]
    seeds: u64,
    /// The first seed.
    #[arg(long, default_value_t = 0)]
    from: u64,
    /// Replay this one seed, printing its schedule (also CCM_SIM_SEED).
    #[arg(long, env = "CCM_SIM_SEED")]
    seed: Option<u64>,
    /// With --seed: replay it this many times; fails when a replay broke an invariant or took
    /// other steps (its trace digest differs).
    #[arg(long, default_value_t = 1)]
    repeat: u32,
    /// Run one scripted scenario (a test grown from a defect) instead of seeds.
    #[arg(long, value_enum)]
    scenario: Option<ccm_simulation::Scenario>,
    /// Threads (default: every core).
    #[arg(long)]
    jobs: Option<usize>,
}

/// Log lines carry the run's virtual time, as its schedule does.
struct VirtualTime;

impl tracing_subscriber::fmt::time::FormatTime for VirtualTime {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        write!(w, "t={:.3}s", ccm_simulation::elapsed().as_secs_f64())
    }
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_timer(VirtualTime)
            .with_writer(std::io::stderr)
            .init();
    }
    if let Some(seed) = args.seed
        && args.repeat > 1
    {
        let reports: Vec<_> = (0..args.repeat).map(|_| ccm_simulation::run_seed(seed)).collect();
        let broke = reports.iter().filter(|r| !r.violations.is_empty()).count();
        let digests: std::collections::BTreeSet<u64> = reports.iter().map(|r| r.digest).collect();
        println!(
            "seed {seed}: {broke} of {} replays broke an invariant; {} distinct trace digest(s)",
            args.repeat,
            digests.len()
        );
        return if broke == 0 && digests.len() == 1 { std::process::ExitCode::SUCCESS } else { std::process::ExitCode::FAILURE };
    }
    let one = match (args.scenario, args.seed) {
        (Some(scenario), _) => Some((format!("{scenario:?}"), ccm_simulation::run_scenario(scenario))),
        (None, Some(seed)) => Some((format!("seed {seed}"), ccm_simulation::run_seed(seed))),
        (None, None) => None,
    };
    if let Some((what, report)) = one {
        println!("{what}: schedule");
        for step in &report.schedule {
            println!("  {step}");
        }
        println!("faults: {:?}", report.faults);
        println!("API requests: {}  trace digest: {:016x}", report.requests, report.digest);
        println!(
            "heap: peak {:.1} MiB, growth over the steady state {} KiB",
            report.peak_heap as f64 / f64::from(1 << 20),
            report.steady_growth >> 10
        );
        match report.converged_after {
            Some(d) => println!("converged {}s after the faults ended", d.as_secs()),
            None => println!("did not converge"),
        }
        if report.violations.is_empty() {
            println!("no invariant broken");
            return std::process::ExitCode::SUCCESS;
        }
        for v in &report.violations {
            println!("VIOLATION {v}");
        }
        return std::process::ExitCode::FAILURE;
    }
    let jobs = args.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let summary = ccm_simulation::run_seeds(args.from..args.from.saturating_add(args.seeds), jobs);
    print!("{}", summary.render());
    if summary.failed.is_empty() { std::process::ExitCode::SUCCESS } else { std::process::ExitCode::FAILURE }
}
