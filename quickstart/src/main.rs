//! `ccm-quickstart`: one command to watch the cloud-controller-manager work. It starts a local
//! kube-apiserver and etcd (the test harness's, built from Go modules on first use), the
//! simulated cloud with a small inventory, and the core; creates a few Nodes as kubelets would
//! register them and a LoadBalancer Service; prints what the core did; and keeps everything
//! running, with the kubeconfig printed, until interrupted. Then it cleans up.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, bail};
use ccm_harness::ControlPlane;
use ccm_harness::cluster::{NodeBuilder, UNINITIALIZED_TAINT, load_balancer_ip, load_balancer_service, set_ready};
use ccm_provider_sdk::Listen;
use ccm_provider_sim::config::{Address, InstanceSpec};
use ccm_provider_sim::{AdminClient, Config, Endpoints};
use clap::Parser;
use k8s_openapi::api::core::v1::{Node, Service};
use kube::Api;
use kube::api::PostParams;
use tokio::sync::oneshot;

/// Starts a local control plane, the simulated cloud and the core; creates Nodes and a
/// LoadBalancer Service; prints what happened; runs until interrupted.
#[derive(Debug, Parser)]
#[command(name = "ccm-quickstart", version, about)]
struct Args {
    /// How many Nodes (and instances) to create, across three zones.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..=50))]
    nodes: u8,
    /// Print the report and stop instead of running until interrupted.
    #[arg(long)]
    once: bool,
    /// Log filter of the core and the sim (as RUST_LOG).
    #[arg(long, default_value = "warn")]
    log: String,
    /// Real kubelets instead of Node objects: the harness's kubelet cluster on this host
    /// (root; containerd, runc, CNI plugins), the project's images built and imported, and the
    /// Helm chart installed with the simulated cloud. `--nodes` is then at most 4.
    #[arg(long)]
    real_nodes: bool,
}

const CLUSTER_CIDR: &str = "10.244.0.0/16";
const ZONES: [&str; 3] = ["sim-region-1a", "sim-region-1b", "sim-region-1c"];

fn step(n: u8, text: &str) {
    eprintln!("[{n}/5] {text}");
}

/// `ccm-quickstart dataplane ...`: the sim's data plane agent, which `--real-nodes` runs in
/// the cluster's edge by starting this binary again (the same as `ccm-provider-sim dataplane`).
#[derive(Debug, Parser)]
#[command(name = "ccm-quickstart dataplane")]
struct AgentCli {
    #[command(flatten)]
    agent: ccm_provider_sim::dataplane::AgentArgs,
    /// Log filter (as RUST_LOG).
    #[arg(long, default_value = "info")]
    log: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    if std::env::args().nth(1).as_deref() == Some("dataplane") {
        let cli = AgentCli::parse_from(std::env::args().skip(1));
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(&cli.log))
            .with_writer(std::io::stderr)
            .init();
        return ccm_provider_sim::dataplane::run_agent(cli.agent.options(), ccm_provider_sdk::server::shutdown_signal()).await;
    }
    let args = Args::parse();
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::new(&args.log)).with_writer(std::io::stderr).init();
    if args.real_nodes {
        return real_nodes(&args).await;
    }

    step(
        1,
        "control plane: finding or building kube-apiserver and etcd (the first run builds them from Go modules: about 11 minutes on 2 cores; progress below)",
    );
    let cp = tokio::task::spawn_blocking(ControlPlane::start).await.context("starting the control plane")??;
    eprintln!("      kube-apiserver ready at {}", cp.server());
    let client = cp.client().await?;

    step(2, "simulated cloud: one instance per Node across three zones, a route table, a load balancer address pool");
    let work = tempfile::Builder::new().prefix("ccm-quickstart-").tempdir().context("creating a work directory")?;
    let mut config = Config { region: "sim-region-1".into(), ..Config::default() };
    for i in 1..=args.nodes {
        config.instances.push(InstanceSpec {
            id: format!("i-{i:04}"),
            name: format!("node-{i}"),
            zone: ZONES[usize::from(i - 1) % ZONES.len()].into(),
            instance_type: if i % 2 == 0 { "sim.large".into() } else { "sim.xlarge".into() },
            state: Default::default(),
            addresses: vec![Address { kind: "InternalIP".into(), address: format!("10.0.0.{}", u16::from(i) + 10) }],
            tags: BTreeMap::from([("team".to_string(), "quickstart".to_string())]),
            ..Default::default()
        });
    }
    let provider = work.path().join("provider.sock");
    let admin_sock = work.path().join("admin.sock");
    let (stop_sim, sim_stopped) = oneshot::channel::<()>();
    let endpoints = Endpoints {
        provider: Listen::Unix(provider.clone()),
        admin: Some(Listen::Unix(admin_sock.clone())),
        metadata: None,
        metrics: None,
    };
    let sim = tokio::spawn(ccm_provider_sim::run(config, endpoints, async move {
        let _ = sim_stopped.await;
    }));
    wait_for_socket(&admin_sock).await?;
    let admin = AdminClient::new(format!("unix://{}", admin_sock.display()));
    eprintln!("      provider socket unix://{}", provider.display());

    step(3, "core: cloud-controller-manager with the node, node lifecycle, route and service controllers");
    let port = free_port()?;
    let core_args = [
        "cloud-controller-manager".to_string(),
        format!("--kubeconfig={}", cp.kubeconfig_path().display()),
        format!("--provider-endpoint=unix://{}", provider.display()),
        "--cluster-name=quickstart".into(),
        format!("--cluster-cidr={CLUSTER_CIDR}"),
        "--leader-elect=false".into(),
        "--insecure-serving".into(),
        "--bind-address=127.0.0.1".into(),
        format!("--secure-port={port}"),
    ];
    let options = <ccm_core::options::Options as clap::Parser>::try_parse_from(&core_args).context("core flags")?;
    let (stop_core, core_stopped) = oneshot::channel::<()>();
    let core = tokio::spawn(ccm_core::runtime::run_until(options, async move {
        let _ = core_stopped.await;
    }));
    eprintln!("      health and metrics at http://127.0.0.1:{port}/readyz and /metrics");

    step(4, "creating Nodes (as kubelets with --cloud-provider=external register them) and a LoadBalancer Service");
    for i in 1..=args.nodes {
        let name = format!("node-{i}");
        NodeBuilder::new(&name)
            .uninitialized()
            .label("kubernetes.io/hostname", &name)
            .pod_cidr(&format!("10.244.{i}.0/24"))
            .address("Hostname", &name)
            .create(&client)
            .await?;
        set_ready(&client, &name, "True").await?;
    }
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    services
        .create(&PostParams::default(), &load_balancer_service("default", "web", &[80]))
        .await
        .context("creating Service default/web")?;

    step(5, "waiting for the core (at most 60 s)");
    let report = wait_and_report(&client, usize::from(args.nodes), Duration::from_secs(60), async || {
        Some((admin.state().await.ok()?, String::new()))
    })
    .await;
    match &report {
        Ok(text) => println!("{text}"),
        Err(e) => eprintln!("the core did not finish in time: {e:#}"),
    }
    println!("kubeconfig: {}", cp.kubeconfig_path().display());
    let kubectl = cp.kubectl(&[]).get_program().to_string_lossy().into_owned();
    println!(
        "  try: {kubectl} --kubeconfig {} get nodes -L topology.kubernetes.io/zone,node.kubernetes.io/instance-type",
        cp.kubeconfig_path().display()
    );
    println!("  sim: curl --unix-socket {} http://sim/state", admin_sock.display());

    if !args.once && report.is_ok() {
        wait_for_interrupt().await?;
    }
    eprintln!("stopping");
    let _ = stop_core.send(());
    match tokio::time::timeout(Duration::from_secs(10), core).await {
        Ok(Ok(Err(e))) => eprintln!("the core stopped with an error: {e:#}"),
        Err(_) => eprintln!("the core did not stop in time"),
        _ => {}
    }
    let _ = stop_sim.send(());
    let _ = tokio::time::timeout(Duration::from_secs(10), sim).await;
    drop(cp);
    report.map(|_| ())
}

/// Waits until every Node is initialised, the Service has an address and every Node has its
/// route in the cloud that `cloud` reads (its state, and a line to add to the report); then
/// describes them.
async fn wait_and_report(
    client: &kube::Client,
    nodes: usize,
    timeout: Duration,
    mut cloud: impl AsyncFnMut() -> Option<(ccm_provider_sim::admin::Snapshot, String)>,
) -> anyhow::Result<String> {
    let node_api: Api<Node> = Api::all(client.clone());
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let listed = node_api.list(&Default::default()).await?.items;
        let initialised = listed
            .iter()
            .filter(|n| {
                !n.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == UNINITIALIZED_TAINT))
            })
            .count();
        let ip = load_balancer_ip(&services.get("web").await?).map(str::to_string);
        let state = cloud().await;
        let routes: Vec<String> = state
            .iter()
            .flat_map(|(s, _)| s.route_tables.iter())
            .flat_map(|t| t.routes.iter().map(move |r| format!("{} -> {} (table {})", r.destination_cidr, r.node_name, t.id)))
            .collect();
        if let (true, Some(ip), Some((state, note))) = (initialised == nodes && routes.len() == nodes, ip.as_deref(), &state) {
            return Ok(describe(&listed, ip, &routes, state) + note);
        }
        if tokio::time::Instant::now() >= deadline {
            bail!(
                "after {timeout:?}: {initialised} of {nodes} Nodes initialised, Service address {}, {} of {nodes} routes",
                ip.as_deref().unwrap_or("none"),
                routes.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn describe(nodes: &[Node], ip: &str, routes: &[String], state: &ccm_provider_sim::admin::Snapshot) -> String {
    let mut out = String::from("\nNodes, initialised by the cloud-node-controller:\n");
    let mut nodes: Vec<&Node> = nodes.iter().collect();
    nodes.sort_by_key(|n| n.metadata.name.clone());
    for n in nodes {
        let labels = n.metadata.labels.clone().unwrap_or_default();
        let label = |k: &str| labels.get(k).cloned().unwrap_or_else(|| "-".into());
        let addresses: Vec<String> = n
            .status
            .as_ref()
            .and_then(|s| s.addresses.as_ref())
            .map(|a| a.iter().map(|a| format!("{}={}", a.type_, a.address)).collect())
            .unwrap_or_default();
        out.push_str(&format!(
            "  {:<8} providerID={:<26} zone={} type={} team={} {}\n",
            n.metadata.name.as_deref().unwrap_or_default(),
            n.spec.as_ref().and_then(|s| s.provider_id.as_deref()).unwrap_or("-"),
            label("topology.kubernetes.io/zone"),
            label("node.kubernetes.io/instance-type"),
            label("tags.cloudprovider.dev/team"),
            addresses.join(" "),
        ));
    }
    out.push_str(&format!("\nService default/web (type LoadBalancer), by the service-lb-controller:\n  address {ip}\n"));
    for lb in &state.load_balancers {
        out.push_str(&format!("  load balancer {} -> nodes {}\n", lb.name, lb.nodes.join(", ")));
    }
    out.push_str("\nRoutes, by the node-route-controller:\n");
    for r in routes {
        out.push_str(&format!("  {r}\n"));
    }
    out
}

async fn wait_for_socket(path: &std::path::Path) -> anyhow::Result<()> {
    for _ in 0..500 {
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    bail!("the simulated cloud did not start: nothing listens on {}", path.display())
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?.local_addr()?.port())
}

/// The sim's admin API on each provider sidecar's node (hostNetwork), for the report.
const ADMIN_PORT: u16 = 8170;

/// Service default/web: a load balancer on port 80 for the pods of Deployment default/web,
/// `externalTrafficPolicy: Local` (only Nodes with a pod pass the load balancer's health
/// check, and the pods see the client's own address).
fn web_service() -> anyhow::Result<Service> {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"type": "LoadBalancer", "selector": {"app": "web"}, "externalTrafficPolicy": "Local",
                 "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}
    }))
    .context("the web Service")
}

/// Deployment default/web: two pods of the sim's image answering HTTP on 8080 with their
/// name and the client's address (`ccm-provider-sim echo`).
fn web_deployment() -> anyhow::Result<k8s_openapi::api::apps::v1::Deployment> {
    let image = format!("{}:{}", ccm_harness::images::PROVIDER_SIM, ccm_harness::images::TAG);
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{
                     "name": "echo", "image": image, "imagePullPolicy": "Never",
                     "args": ["echo", "--listen", "0.0.0.0:8080"],
                     "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                     "ports": [{"containerPort": 8080}],
                     "readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 2}
                 }]}}}
    }))
    .context("the web Deployment")
}

/// `curl`s the load balancer from this host until a pod answers; the command and the answer.
async fn curl_until_answered(ip: &str, timeout: Duration) -> anyhow::Result<(String, String)> {
    let url = format!("http://{ip}/");
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let out =
            tokio::process::Command::new("curl").args(["-s", "--max-time", "2", &url]).output().await.context("running curl")?;
        let answer = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if out.status.success() && !answer.is_empty() {
            return Ok((format!("curl {url}"), answer));
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("curl {url} got no answer within {timeout:?} ({})", out.status);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `--real-nodes`: kubelets, the images, the chart.
async fn real_nodes(args: &Args) -> anyhow::Result<()> {
    use ccm_harness::kubelet_cluster::{self, KubeletCluster};
    let nodes = usize::from(args.nodes.min(4));
    kubelet_cluster::check_machine()
        .and_then(|()| ccm_harness::images::check_machine())
        .map_err(|e| anyhow::anyhow!("--real-nodes: {e}"))?;
    step(
        1,
        "images: deploy/images/*.Containerfile as OCI archives, static musl binaries (the first build takes about 10 minutes)",
    );
    let images = tokio::task::spawn_blocking(ccm_harness::images::project).await??;
    step(
        2,
        "kubelet cluster: a control plane with kube-controller-manager and kube-scheduler, kubelets with containerd, bridge CNI and kube-proxy",
    );
    let cluster = tokio::task::spawn_blocking(move || KubeletCluster::start(nodes, "node", &images.archives()))
        .await
        .context("starting the cluster")??;
    eprintln!("      {nodes} kubelets Ready in {:.1} s, their Nodes tainted uninitialized", cluster.startup.as_secs_f64());
    cluster.label_control_plane()?;
    // The cloud's load balancers carry traffic: the sim pushes them to its data plane agent,
    // this binary again, in the cluster's edge (between this host and the nodes).
    let me = std::env::current_exe().context("finding this binary")?;
    let dataplane = cluster.start_dataplane(&me, &["dataplane"])?;
    eprintln!("      the load balancers' data plane at {dataplane}, addresses from {}", cluster.edge.pool);
    step(3, "helm install: the chart with the simulated cloud (sim.enabled=true) and its inventory of these nodes");
    let work = tempfile::Builder::new().prefix("ccm-quickstart-").tempdir().context("creating a work directory")?;
    let values = work.path().join("values.yaml");
    std::fs::write(&values, cluster.sim_chart_values(ADMIN_PORT)).context("writing the chart values")?;
    let helm = tokio::task::spawn_blocking(|| ccm_harness::Assets::tool("helm")).await??;
    let chart = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/helm/ccm-rs");
    let out = std::process::Command::new(&helm)
        .arg("--kubeconfig")
        .arg(cluster.control_plane().kubeconfig_path())
        .args(["install", "ccm-rs"])
        .arg(&chart)
        .args(["--namespace", "kube-system", "--values"])
        .arg(&values)
        .output()
        .context("running helm")?;
    if !out.status.success() {
        bail!("helm install failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let client = cluster.client().await?;
    step(4, "creating a Deployment (two pods answering HTTP) behind a LoadBalancer Service");
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    services.create(&PostParams::default(), &web_service()?).await.context("creating Service default/web")?;
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> = Api::namespaced(client.clone(), "default");
    deployments.create(&PostParams::default(), &web_deployment()?).await.context("creating Deployment default/web")?;
    step(5, "waiting for the installed core (at most 120 s)");
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(client.clone(), "kube-system");
    let report = wait_and_report(&client, nodes, Duration::from_secs(120), async || {
        // The leader's cloud: each sidecar is a simulated cloud of its own.
        let holder = leases.get_opt("cloud-controller-manager").await.ok()??.spec?.holder_identity?;
        let leader = cluster.nodes.iter().find(|n| holder.starts_with(&format!("{}_", n.name)))?;
        let state = AdminClient::new(format!("http://{}:{ADMIN_PORT}", leader.ip)).state().await.ok()?;
        Some((state, format!("\nThe core leading: {holder} (Lease kube-system/cloud-controller-manager)\n")))
    })
    .await;
    match &report {
        Ok(text) => println!("{text}"),
        Err(e) => eprintln!("the core did not finish in time: {e:#}"),
    }
    let answered = match (&report, load_balancer_ip(&services.get("web").await?)) {
        (Ok(_), Some(ip)) => Some(curl_until_answered(ip, Duration::from_secs(90)).await),
        _ => None,
    };
    match &answered {
        Some(Ok((command, answer))) => println!("The load balancer carries traffic:\n  $ {command}\n  {answer}"),
        Some(Err(e)) => eprintln!("the load balancer did not answer: {e:#}"),
        None => {}
    }
    let report = match answered {
        Some(Err(e)) => Err(e),
        _ => report,
    };
    let cp = cluster.control_plane();
    let kubectl = cp.kubectl(&[]).get_program().to_string_lossy().into_owned();
    println!("kubeconfig: {}", cp.kubeconfig_path().display());
    println!("  try: {kubectl} --kubeconfig {} get pods -A -o wide", cp.kubeconfig_path().display());
    for node in &cluster.nodes {
        println!("  {}: kubelet log {}", node.name, node.kubelet_log().display());
    }
    if !args.once && report.is_ok() {
        wait_for_interrupt().await?;
    }
    eprintln!("stopping: tearing the cluster down");
    tokio::task::spawn_blocking(move || drop(cluster)).await?;
    report.map(|_| ())
}

/// Says how to stop, then waits for SIGINT or SIGTERM. The handlers are installed before the
/// line that invites Ctrl-C: a SIGINT between the two would otherwise kill the process with
/// everything it started still running.
async fn wait_for_interrupt() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut terminate = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    eprintln!("running; press Ctrl-C to stop and clean up");
    tokio::select! {
        _ = interrupt.recv() => {}
        _ = terminate.recv() => {}
    }
    Ok(())
}
