//! Kubernetes' own load balancer tests against the core: `[sig-network] LoadBalancers` (13
//! tests) and `LoadBalancers ExternalTrafficPolicy: Local` (4) of the pinned release's
//! `test/e2e/network/loadbalancer.go`, run by upstream's `e2e.test` under `ginkgo` against
//! the chart installed on a real kubelet cluster, with the sim as the cloud and its data plane
//! carrying the load balancers' traffic.
//!
//! [`run`] starts a three-node [`KubeletCluster`] (`lb-0` is the control plane the core runs
//! on, `lb-1` and `lb-2` are workers), starts the sim's data plane agent in the cluster's
//! edge, installs the chart (one replica: one sim is one cloud), waits until every Node is
//! initialised, installs the cluster DNS ([`crate::cluster_dns`]: some tests reach Services
//! by name), runs the focused suite with ginkgo's JUnit and JSON reports, and returns each
//! test's outcome. The client side of the tests (the `e2e.test` process) runs on the host,
//! outside the nodes' network, as a user on the internet would.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::kubelet_cluster::KubeletCluster;
use crate::{Assets, e2e_images, images};

/// What ginkgo focuses on: both Describe blocks of `loadbalancer.go`.
pub const FOCUS: &str = r"\[sig-network\] LoadBalancers";
/// The sim's admin API port on each provider sidecar (hostNetwork: the node's address).
pub const ADMIN_PORT: u16 = 8170;

/// How to run the suite.
#[derive(Debug, Clone)]
pub struct Options {
    /// The `ccm-provider-sim` binary whose `dataplane` subcommand runs the agent.
    pub sim_binary: PathBuf,
    /// ginkgo's `--focus`.
    pub focus: String,
    /// ginkgo's `--skip`, if any.
    pub skip: Option<String>,
    /// Parallel ginkgo processes.
    pub procs: usize,
    /// Where the reports and logs go (kept).
    pub out_dir: PathBuf,
    /// ginkgo's `--timeout` for the whole suite.
    pub timeout: Duration,
}

impl Options {
    /// The whole suite, two ginkgo processes, reports under `out_dir`.
    pub fn new(sim_binary: PathBuf, out_dir: PathBuf) -> Self {
        Self { sim_binary, focus: FOCUS.into(), skip: None, procs: 2, out_dir, timeout: Duration::from_secs(60 * 60) }
    }
}

/// One test's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The test's full name (its Describe texts and its It text).
    pub name: String,
    /// `passed`, `failed`, `skipped`, `panicked`, `timedout`, `interrupted`, `aborted`.
    pub state: String,
    /// How long it ran.
    pub duration: Duration,
    /// The failure's message and location (failed tests), or the skip's reason.
    pub message: String,
}

/// The suite's result.
#[derive(Debug, Clone)]
pub struct Report {
    /// Each test that ginkgo selected (skipped ones included), in the report's order.
    pub outcomes: Vec<Outcome>,
    /// ginkgo's wall time.
    pub suite_time: Duration,
    /// How long the cluster, the data plane and the chart took before the suite.
    pub setup_time: Duration,
    /// The JUnit report.
    pub junit: PathBuf,
}

impl Report {
    /// The tests in `state`.
    pub fn count(&self, state: &str) -> usize {
        self.outcomes.iter().filter(|o| o.state == state).count()
    }

    /// A table: test → outcome, one line each, and a summary line.
    pub fn table(&self) -> String {
        let width = self.outcomes.iter().map(|o| o.name.len()).max().unwrap_or(4).min(150);
        let mut out = format!("{:<width$}  {:<8}  {:>7}\n", "test", "outcome", "seconds");
        for o in &self.outcomes {
            out.push_str(&format!("{:<width$}  {:<8}  {:>7.1}\n", o.name, o.state, o.duration.as_secs_f64()));
        }
        out.push_str(&format!(
            "{} passed, {} failed, {} skipped in {:.0} s (set-up {:.0} s); JUnit report: {}\n",
            self.count("passed"),
            self.outcomes.len() - self.count("passed") - self.count("skipped"),
            self.count("skipped"),
            self.suite_time.as_secs_f64(),
            self.setup_time.as_secs_f64(),
            self.junit.display()
        ));
        out
    }
}

/// Checks everything the run needs from the machine, before anything is built.
pub fn check_machine() -> Result<(), crate::machine::Unavailable> {
    crate::kubelet_cluster::check_machine()?;
    images::check_machine()?;
    e2e_images::check_machine()?;
    crate::cluster_dns::check_machine()?;
    crate::machine::require(
        "the data plane agent",
        &[("nft", "Debian: nftables; .ci/run installs it"), ("conntrack", "Debian: conntrack; .ci/run installs it")],
    )
}

fn run_cmd(cmd: &mut Command, what: &str) -> anyhow::Result<String> {
    let out = cmd.stdin(Stdio::null()).output().with_context(|| format!("{what}: starting {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Installs the chart with the sim for `cluster` (data plane on, one replica) and waits until
/// every Node is initialised and the core is Ready.
pub fn install_chart(cluster: &KubeletCluster, dir: &Path) -> anyhow::Result<()> {
    let helm = Assets::tool("helm")?;
    let chart = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/helm/ccm-rs");
    let values = dir.join("values.yaml");
    std::fs::write(&values, format!("{}replicas: 1\n", cluster.sim_chart_values(ADMIN_PORT)))
        .with_context(|| format!("writing {}", values.display()))?;
    run_cmd(
        Command::new(&helm)
            .arg("--kubeconfig")
            .arg(cluster.control_plane().kubeconfig_path())
            .args(["install", "ccm-rs"])
            .arg(&chart)
            .args(["--namespace", "kube-system", "--values"])
            .arg(&values),
        "helm install",
    )?;
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let nodes = run_cmd(&mut cluster.kubectl(&["get", "nodes", "-o", "json"]), "kubectl get nodes")?;
        let nodes: serde_json::Value = serde_json::from_str(&nodes).context("decoding the Nodes")?;
        let items = nodes["items"].as_array().cloned().unwrap_or_default();
        let initialised = items.len() == cluster.nodes.len()
            && items.iter().all(|n| {
                n["spec"]["providerID"].as_str().is_some_and(|p| p.starts_with("sim://"))
                    && !n["spec"]["taints"]
                        .as_array()
                        .is_some_and(|t| t.iter().any(|t| t["key"] == "node.cloudprovider.kubernetes.io/uninitialized"))
            });
        if initialised {
            return Ok(());
        }
        if Instant::now() > deadline {
            let pods = run_cmd(&mut cluster.kubectl(&["-n", "kube-system", "get", "pods", "-o", "wide"]), "kubectl get pods")
                .unwrap_or_default();
            bail!("the Nodes were not initialised within 180 s by the installed core:\n{pods}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Runs the suite (see the module documentation).
pub fn run(options: &Options) -> anyhow::Result<Report> {
    check_machine().map_err(|e| anyhow::anyhow!("{e}"))?;
    std::fs::create_dir_all(&options.out_dir).with_context(|| format!("creating {}", options.out_dir.display()))?;
    let begin = Instant::now();
    let tools = e2e_images::upstream_e2e()?;
    let mut archives = images::project()?.archives();
    archives.extend(e2e_images::upstream_test_images()?);
    let cluster = KubeletCluster::start(3, "lb", &archives)?;
    cluster.start_dataplane(&options.sim_binary, &["dataplane"])?;
    run_cmd(
        &mut cluster.kubectl(&["label", "--overwrite", "node", &cluster.nodes[0].name, "node-role.kubernetes.io/control-plane="]),
        "labelling the control-plane node",
    )?;
    install_chart(&cluster, &options.out_dir)?;
    // Some tests reach Services by name from their pods.
    crate::cluster_dns::install(&cluster)?;
    let setup_time = begin.elapsed();

    let junit = options.out_dir.join("junit.xml");
    let json = options.out_dir.join("report.json");
    let _ = std::fs::remove_file(&junit);
    let _ = std::fs::remove_file(&json);
    let mut ginkgo = Command::new(&tools.ginkgo);
    ginkgo
        .arg(format!("--procs={}", options.procs.max(1)))
        .arg(format!("--timeout={}s", options.timeout.as_secs()))
        .arg(format!("--focus={}", options.focus))
        .args(options.skip.iter().map(|s| format!("--skip={s}")))
        .arg("--junit-report=junit.xml")
        .arg("--json-report=report.json")
        .arg(format!("--output-dir={}", options.out_dir.display()))
        .args(["--silence-skips", "--no-color"])
        .arg(&tools.e2e_test)
        .arg("--")
        .arg(format!("--kubeconfig={}", cluster.control_plane().kubeconfig_path().display()))
        // A provider the framework knows and that does nothing of its own (no cloud API
        // calls for clean-up): upstream's `aws` provider is the null provider too, which is
        // what cloud-provider-kind passes.
        .arg("--provider=skeleton")
        .arg(format!("--report-dir={}", options.out_dir.display()))
        .args(["--disable-log-dump", "--allowed-not-ready-nodes=0", "--minStartupPods=0"]);
    let log = options.out_dir.join("ginkgo.log");
    let file = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    ginkgo.stdin(Stdio::null()).stdout(file.try_clone()?).stderr(file);
    let started = Instant::now();
    let status = ginkgo.status().context("running ginkgo")?;
    let suite_time = started.elapsed();
    let outcomes = match std::fs::read_to_string(&json) {
        Ok(text) => outcomes(&text)?,
        Err(e) => bail!(
            "ginkgo ({status}) wrote no report at {}: {e}; its log:\n{}",
            json.display(),
            crate::control_plane::tail(&log, 40)
        ),
    };
    Ok(Report { outcomes, suite_time, setup_time, junit })
}

/// The outcomes in ginkgo's JSON report (`--json-report`): every `It`, not the suite's
/// set-up and clean-up nodes.
pub fn outcomes(json: &str) -> anyhow::Result<Vec<Outcome>> {
    let suites: serde_json::Value = serde_json::from_str(json).context("decoding ginkgo's JSON report")?;
    let mut out = Vec::new();
    for suite in suites.as_array().into_iter().flatten() {
        for spec in suite["SpecReports"].as_array().into_iter().flatten() {
            if spec["LeafNodeType"] != "It" {
                continue;
            }
            let mut parts: Vec<String> = spec["ContainerHierarchyTexts"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t.as_str().map(str::to_string))
                .collect();
            parts.extend(spec["LeafNodeText"].as_str().map(str::to_string));
            let failure = &spec["Failure"];
            let message = match failure["Message"].as_str() {
                Some(m) => format!(
                    "{} ({}:{})",
                    m.trim(),
                    failure["Location"]["FileName"].as_str().unwrap_or(""),
                    failure["Location"]["LineNumber"]
                ),
                None => String::new(),
            };
            out.push(Outcome {
                name: parts.join(" "),
                state: spec["State"].as_str().unwrap_or("unknown").to_string(),
                duration: Duration::from_nanos(spec["RunTime"].as_u64().unwrap_or(0)),
                message,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_json_report_gives_each_its_outcome() {
        let json = r#"[{"SuiteDescription": "Kubernetes e2e suite", "SpecReports": [
          {"LeafNodeType": "SynchronizedBeforeSuite", "State": "passed", "RunTime": 5},
          {"LeafNodeType": "It", "ContainerHierarchyTexts": ["[sig-network] LoadBalancers"],
           "LeafNodeText": "should handle load balancer cleanup finalizer for service", "State": "passed", "RunTime": 2500000000},
          {"LeafNodeType": "It", "ContainerHierarchyTexts": ["[sig-network] LoadBalancers ExternalTrafficPolicy: Local"],
           "LeafNodeText": "should work from pods", "State": "failed", "RunTime": 1000000000,
           "Failure": {"Message": "Source IP not preserved", "Location": {"FileName": "loadbalancer.go", "LineNumber": 1290}}}
        ]}]"#;
        let o = outcomes(json).expect("parses");
        assert_eq!(o.len(), 2);
        assert_eq!(o[0].name, "[sig-network] LoadBalancers should handle load balancer cleanup finalizer for service");
        assert_eq!((o[0].state.as_str(), o[0].duration), ("passed", Duration::from_millis(2500)));
        assert_eq!(o[1].state, "failed");
        assert_eq!(o[1].message, "Source IP not preserved (loadbalancer.go:1290)");
        let report = Report {
            outcomes: o,
            suite_time: Duration::from_secs(60),
            setup_time: Duration::from_secs(30),
            junit: "j.xml".into(),
        };
        let table = report.table();
        assert!(table.contains("1 passed, 1 failed, 0 skipped"), "{table}");
    }
}
