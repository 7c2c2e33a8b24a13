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
    /// Rounds of the data plane's measurement after the suite (0: none).
    pub measure_rounds: usize,
}

impl Options {
    /// The whole suite, four ginkgo processes (the tests mostly wait: grace periods,
    /// rollouts), reports under `out_dir`.
    pub fn new(sim_binary: PathBuf, out_dir: PathBuf) -> Self {
        Self {
            sim_binary,
            focus: FOCUS.into(),
            skip: None,
            procs: 2,
            out_dir,
            timeout: Duration::from_secs(60 * 60),
            measure_rounds: 5,
        }
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
    /// The data plane's figures, measured after the suite on the same cluster (when asked).
    pub dataplane: Option<DataplaneFigures>,
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
        .args(["--disable-log-dump", "--allowed-not-ready-nodes=0", "--minStartupPods=0"])
        // Every node is schedulable. Said, not left to detection: with parallel processes
        // only the first detects it, and the others skip the tests that ask for it.
        .arg(format!("--num-nodes={}", cluster.nodes.len()));
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
    let dataplane = match options.measure_rounds {
        0 => None,
        rounds => Some(measure_dataplane(&cluster, rounds).context("measuring the data plane")?),
    };
    Ok(Report { outcomes, suite_time, setup_time, junit, dataplane })
}

/// The outcomes in ginkgo's JSON report (`--json-report`): every `It`, not the suite's
/// set-up and clean-up nodes.
pub fn outcomes(json: &str) -> anyhow::Result<Vec<Outcome>> {
    let suites: serde_json::Value = serde_json::from_str(json).context("decoding ginkgo's JSON report")?;
    let mut out = Vec::new();
    for suite in suites.as_array().into_iter().flatten() {
        for spec in suite["SpecReports"].as_array().into_iter().flatten() {
            // Not an `It`, or left out by the focus (skipped without ever running): not a test
            // of the suite run. A test that skipped itself ran (one attempt) and says why.
            if spec["LeafNodeType"] != "It" || (spec["State"] == "skipped" && spec["NumAttempts"].as_u64().unwrap_or(0) == 0) {
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
           "LeafNodeText": "should handle load balancer cleanup finalizer for service", "State": "passed", "RunTime": 2500000000, "NumAttempts": 1},
          {"LeafNodeType": "It", "ContainerHierarchyTexts": ["[sig-storage] Volumes"], "LeafNodeText": "not focused",
           "State": "skipped", "RunTime": 0, "NumAttempts": 0},
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
            dataplane: None,
        };
        let table = report.table();
        assert!(table.contains("1 passed, 1 failed, 0 skipped"), "{table}");
    }
}

/// What [`measure_dataplane`] found.
#[derive(Debug, Clone)]
pub struct DataplaneFigures {
    /// HTTP connections a second through one load balancer (connect, request, answer, close).
    pub lb_connections_per_second: f64,
    /// The same straight to a node's node port: the floor without the load balancer's hop.
    pub node_port_connections_per_second: f64,
    /// From a Node's exclusion label to the data plane forwarding without it, each time.
    pub hosts_update_to_forwarding: Vec<Duration>,
    /// The same for the Node's return.
    pub hosts_return_to_forwarding: Vec<Duration>,
    /// Requests answered on one kept-alive connection after its Node left the load balancer
    /// (it drains: open connections finish on the backend they have).
    pub drained_requests: usize,
}

impl std::fmt::Display for DataplaneFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |d: &[Duration]| d.iter().map(|d| format!("{:.0}", d.as_secs_f64() * 1000.0)).collect::<Vec<_>>().join(", ");
        writeln!(
            f,
            "data plane: {:.0} connections/s through one load balancer, {:.0}/s straight to a node port (ratio {:.2})",
            self.lb_connections_per_second,
            self.node_port_connections_per_second,
            self.lb_connections_per_second / self.node_port_connections_per_second.max(1.0)
        )?;
        writeln!(f, "a Node excluded → the data plane forwards without it: {} ms", ms(&self.hosts_update_to_forwarding))?;
        writeln!(f, "the Node back → the data plane forwards to it: {} ms", ms(&self.hosts_return_to_forwarding))?;
        write!(
            f,
            "an open connection through a Node that left: {} requests answered after it left (drained)",
            self.drained_requests
        )
    }
}

/// HTTP/1.0 requests to `addr` from `workers` threads for `period`, each a connection of its
/// own; answered requests a second.
fn connection_rate(addr: std::net::SocketAddr, workers: usize, period: Duration) -> f64 {
    use std::io::{Read, Write};
    let deadline = Instant::now() + period;
    let threads: Vec<_> = (0..workers)
        .map(|_| {
            std::thread::spawn(move || {
                let mut ok = 0u64;
                while Instant::now() < deadline {
                    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else { continue };
                    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
                    let mut answer = Vec::new();
                    if stream.write_all(b"GET /hostname HTTP/1.0\r\n\r\n").is_ok()
                        && stream.read_to_end(&mut answer).is_ok()
                        && answer.starts_with(b"HTTP/1.")
                    {
                        ok += 1;
                    }
                }
                ok
            })
        })
        .collect();
    let total: u64 = threads.into_iter().map(|t| t.join().unwrap_or(0)).sum();
    total as f64 / period.as_secs_f64()
}

/// Measures the sim's data plane on `cluster` (the chart installed with it): connections a
/// second through one load balancer beside straight to a node port, and the time from a
/// Node's exclusion (and return) to the agent forwarding without (with) it. Leaves nothing
/// behind (its Deployment, Service and label are removed).
pub fn measure_dataplane(cluster: &KubeletCluster, rounds: usize) -> anyhow::Result<DataplaneFigures> {
    let agent = format!("http://{}:{}", cluster.edge.vpc_ip, crate::kubelet_cluster::DATAPLANE_PORT);
    let yaml = format!(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: dp-bench, namespace: default}}\nspec:\n  replicas: 2\n  \
         selector: {{matchLabels: {{app: dp-bench}}}}\n  template:\n    metadata: {{labels: {{app: dp-bench}}}}\n    spec:\n      \
         containers: [{{name: netexec, image: '{}', args: [netexec, --http-port=8080], readinessProbe: {{httpGet: {{path: /healthz, port: 8080}}, periodSeconds: 1}}}}]\n\
         ---\napiVersion: v1\nkind: Service\nmetadata: {{name: dp-bench, namespace: default}}\nspec:\n  type: LoadBalancer\n  selector: {{app: dp-bench}}\n  \
         ports: [{{port: 80, targetPort: 8080, protocol: TCP}}]\n",
        e2e_images::AGNHOST
    );
    let mut apply = cluster.kubectl(&["apply", "-f", "-"]);
    apply.stdin(Stdio::piped()).stdout(Stdio::null()).stderr(Stdio::piped());
    let mut child = apply.spawn().context("kubectl apply")?;
    {
        use std::io::Write;
        child.stdin.take().context("kubectl's stdin")?.write_all(yaml.as_bytes()).context("writing the manifests")?;
    }
    let out = child.wait_with_output().context("kubectl apply")?;
    if !out.status.success() {
        bail!("kubectl apply failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let result = measure_with(cluster, &agent, rounds);
    let _ = cluster.kubectl(&["delete", "--wait=false", "deployment/dp-bench", "service/dp-bench"]).output();
    for node in &cluster.nodes {
        let _ = cluster.kubectl(&["label", "node", &node.name, &format!("{EXCLUDE}-")]).output();
    }
    result
}

fn measure_with(cluster: &KubeletCluster, agent: &str, rounds: usize) -> anyhow::Result<DataplaneFigures> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let (ip, node_port) = loop {
        let svc = run_cmd(&mut cluster.kubectl(&["get", "service", "dp-bench", "-o", "json"]), "kubectl get service")?;
        let svc: serde_json::Value = serde_json::from_str(&svc).context("decoding the Service")?;
        let ip = svc["status"]["loadBalancer"]["ingress"][0]["ip"].as_str().map(str::to_string);
        let node_port = svc["spec"]["ports"][0]["nodePort"].as_u64();
        if let (Some(ip), Some(port)) = (ip, node_port) {
            let addr: std::net::SocketAddr = format!("{ip}:80").parse().context("the load balancer's address")?;
            if connection_rate(addr, 1, Duration::from_millis(200)) > 0.0 {
                break (addr, port);
            }
        }
        if Instant::now() > deadline {
            bail!("the load balancer of Service dp-bench did not answer within 120 s");
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    let node = cluster.nodes.first().context("no node")?;
    let direct: std::net::SocketAddr = format!("{}:{node_port}", node.ip).parse().context("the node port's address")?;
    let period = Duration::from_secs(5);
    let node_port_rate = connection_rate(direct, 4, period);
    let lb_rate = connection_rate(ip, 4, period);

    // A Node leaves the load balancers (the exclusion label) and comes back: from the label
    // write to the agent's rules without (with) its address.
    let last = cluster.nodes.last().context("no node")?;
    let has_forwarding = |backend: &str, want: bool| -> anyhow::Result<bool> {
        let (status, body) = http_get(agent, "/state")?;
        if status != 200 {
            bail!("GET {agent}/state answered {status}");
        }
        let view: serde_json::Value = serde_json::from_str(&body).context("decoding the agent's state")?;
        // What the written rules forward to, not what was asked for.
        let forwarding = &view["forwarding"][ip.ip().to_string()];
        let present = forwarding.as_array().is_some_and(|b| b.iter().any(|b| b == backend));
        Ok(present == want)
    };
    let mut away = Vec::new();
    let mut back = Vec::new();
    for _ in 0..rounds {
        for (label, want, out) in [(format!("{EXCLUDE}=true"), false, &mut away), (format!("{EXCLUDE}-"), true, &mut back)] {
            let start = Instant::now();
            run_cmd(&mut cluster.kubectl(&["label", "--overwrite", "node", &last.name, &label]), "labelling the Node")?;
            loop {
                if has_forwarding(&last.ip.to_string(), want)? {
                    out.push(start.elapsed());
                    break;
                }
                if start.elapsed() > Duration::from_secs(30) {
                    bail!("the data plane did not follow the Node's label within 30 s");
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    let drained_requests = drain(cluster, ip, &has_forwarding)?;
    Ok(DataplaneFigures {
        lb_connections_per_second: lb_rate,
        node_port_connections_per_second: node_port_rate,
        hosts_update_to_forwarding: away,
        hosts_return_to_forwarding: back,
        drained_requests,
    })
}

const EXCLUDE: &str = "node.kubernetes.io/exclude-from-external-load-balancers";

/// Draining: with every Node but the first excluded, a kept-alive connection is opened (so it
/// goes through the first); then the others come back and the first is excluded. The
/// connection must go on answering (conntrack keeps its backend), while the data plane no
/// longer forwards new ones to that Node. How many requests it answered after.
fn drain(
    cluster: &KubeletCluster,
    ip: std::net::SocketAddr,
    has_forwarding: &dyn Fn(&str, bool) -> anyhow::Result<bool>,
) -> anyhow::Result<usize> {
    use std::io::Write;
    let label = |node: &str, on: bool| {
        let arg = if on { format!("{EXCLUDE}=true") } else { format!("{EXCLUDE}-") };
        run_cmd(&mut cluster.kubectl(&["label", "--overwrite", "node", node, &arg]), "labelling a Node").map(|_| ())
    };
    let wait = |node: &crate::kubelet_cluster::KubeletNode, want: bool| -> anyhow::Result<()> {
        let start = Instant::now();
        while !has_forwarding(&node.ip.to_string(), want)? {
            if start.elapsed() > Duration::from_secs(30) {
                bail!("the data plane did not follow {}'s label within 30 s", node.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    };
    let (first, others) = cluster.nodes.split_first().context("no node")?;
    for n in others {
        label(&n.name, true)?;
        wait(n, false)?;
    }
    let mut conn =
        std::net::TcpStream::connect_timeout(&ip, Duration::from_secs(2)).context("connecting to the load balancer")?;
    conn.set_read_timeout(Some(Duration::from_secs(3)))?;
    let ask = |conn: &mut std::net::TcpStream| -> anyhow::Result<String> {
        conn.write_all(b"GET /hostname HTTP/1.1\r\nHost: lb\r\n\r\n").context("writing a request")?;
        read_http_response(conn)
    };
    ask(&mut conn).context("the first request on the kept-alive connection")?;
    for n in others {
        label(&n.name, false)?;
        wait(n, true)?;
    }
    label(&first.name, true)?;
    wait(first, false)?;
    let mut answered = 0;
    for _ in 0..5 {
        ask(&mut conn).context("a request on the kept-alive connection after its Node left the load balancer")?;
        answered += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    label(&first.name, false)?;
    wait(first, true)?;
    Ok(answered)
}

/// Reads one HTTP/1.1 response with a Content-Length; its body.
fn read_http_response(conn: &mut std::net::TcpStream) -> anyhow::Result<String> {
    use std::io::Read;
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        let n = conn.read(&mut byte).context("reading the answer's head")?;
        if n == 0 {
            bail!("the connection was closed");
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).to_string();
    let length: usize = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_string()))
        .and_then(|v| v.parse().ok())
        .context("an answer without Content-Length")?;
    let mut body = vec![0u8; length];
    conn.read_exact(&mut body).context("reading the answer's body")?;
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// A plain HTTP GET of `path` at `base` (`http://host:port`): status and body.
fn http_get(base: &str, path: &str) -> anyhow::Result<(u16, String)> {
    use std::io::{Read, Write};
    let host = base.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(host).with_context(|| format!("connecting to {base}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").as_bytes())?;
    let mut text = String::new();
    stream.read_to_string(&mut text).with_context(|| format!("reading {base}{path}"))?;
    let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((status, body))
}
