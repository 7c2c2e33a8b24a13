//! Runs Kubernetes' own `[sig-network] LoadBalancers` tests against the core on a real
//! kubelet cluster, with the sim's load balancers carrying traffic, and prints test →
//! outcome (see `ccm_harness::lb_suite`):
//!
//! `cargo run -p ccm-harness --example lb_suite -- [--procs N] [--focus REGEX] [--skip REGEX] [--out DIR]`
//!
//! Needs root and what `.ci/run` installs; the first run builds e2e.test, ginkgo and agnhost
//! (minutes). Exits non-zero when a test failed.

use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    // Built first when missing or out of date, in this example's target directory and profile.
    let sim = ccm_harness::workspace::binary("ccm-provider-sim")?;
    let mut options = ccm_harness::lb_suite::Options::new(sim, PathBuf::from("target/lb-suite"));
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| anyhow::anyhow!("{flag} needs a value"));
        match flag.as_str() {
            "--procs" => options.procs = value()?.parse()?,
            "--focus" => options.focus = value()?,
            "--skip" => options.skip = Some(value()?),
            "--out" => options.out_dir = PathBuf::from(value()?),
            other => anyhow::bail!("unknown flag {other} (--procs N, --focus REGEX, --skip REGEX, --out DIR)"),
        }
    }
    let report = ccm_harness::lb_suite::run(&options)?;
    if let Some(figures) = &report.dataplane {
        println!("{figures}\n");
    }
    print!("{}", report.table());
    for o in report.outcomes.iter().filter(|o| o.state != "passed" && o.state != "skipped") {
        println!("\n{} {}:\n  {}", o.state.to_uppercase(), o.name, o.message.replace('\n', "\n  "));
    }
    let failed = report.outcomes.len() - report.count("passed") - report.count("skipped");
    anyhow::ensure!(failed == 0, "{failed} test(s) did not pass");
    Ok(())
}
