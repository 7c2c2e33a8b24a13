//! What an operator installs, installed the way they install it, on real kubelets: the
//! images built from `deploy/images/*`, the Helm chart and the kustomize bases applied to the
//! harness's kubelet cluster (`ccm_harness::kubelet_cluster`), and the Nodes the kubelets
//! register initialised by the installed core, not by a process of the test.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ccm_harness::aws::Moto;
use ccm_harness::images;
use ccm_harness::kubelet_cluster::{self, CLUSTER_CIDR, KubeletCluster};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};

use crate::support::{eventually, http_get, http_request};

const UNINITIALIZED: &str = "node.cloudprovider.kubernetes.io/uninitialized";
/// The kubelet config drop-in the node plugin writes (and the AWS phase writes itself).
const DROP_IN: &str = "/etc/kubernetes/kubelet.conf.d/50-cloud.conf";
/// The sim's admin API, served by each provider sidecar on its node's address (hostNetwork).
const ADMIN_PORT: u16 = 8170;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn run(mut cmd: std::process::Command, what: &str) -> String {
    let out = cmd.stdin(std::process::Stdio::null()).output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What `cmd` printed (stdout then stderr), or why it could not run: for a failure's report.
fn printed(mut cmd: std::process::Command) -> String {
    cmd.output().map_or_else(
        |e| e.to_string(),
        |o| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)),
    )
}

/// Helm values for the test: the sim's inventory of the real nodes, routes, and the sim's
/// admin API on each sidecar's node address (to read the cloud's state).
fn helm_values(cluster: &KubeletCluster, dir: &Path) -> PathBuf {
    let path = dir.join("values.yaml");
    // The load balancer sweep every 5-10 s (1h by default), for the repair to be seen here.
    let values = format!("{}extraArgs: [--load-balancer-resync-period=5s]\n", cluster.sim_chart_values(ADMIN_PORT));
    std::fs::write(&path, values).expect("values");
    path
}

fn initialised(node: &Node) -> bool {
    let spec = node.spec.as_ref();
    let tainted = spec.and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == UNINITIALIZED));
    let labels = node.metadata.labels.clone().unwrap_or_default();
    !tainted
        && spec.and_then(|s| s.provider_id.as_deref()).is_some_and(|p| p.starts_with("sim://"))
        && labels.contains_key("topology.kubernetes.io/zone")
        && labels.get("node.kubernetes.io/instance-type").map(String::as_str) == Some("sim.medium")
}

fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

async fn ready_pods(client: &kube::Client, selector: &str) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "kube-system");
    let list = pods.list(&ListParams::default().labels(selector)).await.map(|l| l.items).unwrap_or_default();
    list.into_iter().filter(|p| p.metadata.deletion_timestamp.is_none() && pod_ready(p)).collect()
}

/// The holder of the core's Lease, as the pod's host name (`<node>_<uuid>` upstream-style
/// identities start with the host name the chart passes: the node's name).
async fn lease_holder(client: &kube::Client) -> Option<String> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-system");
    leases.get_opt("cloud-controller-manager").await.ok().flatten()?.spec?.holder_identity.filter(|h| !h.is_empty())
}

/// The sim's true state as its admin API says, from the sidecar on `node_ip`.
async fn sim_state(node_ip: &str) -> Option<serde_json::Value> {
    let (status, body) = http_get(&format!("http://{node_ip}:{ADMIN_PORT}"), "/state").await?;
    (status == 200).then(|| serde_json::from_str(&body).ok()).flatten()
}

async fn kube_system_pods(client: &kube::Client, selector: &str) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "kube-system");
    pods.list(&ListParams::default().labels(selector)).await.map(|l| l.items).unwrap_or_default()
}

const CORE_PODS: &str = "app.kubernetes.io/name=cloud-controller-manager";

/// What a user looks at after an install: the core pods Ready (core + sidecar over the shared
/// socket), every Node initialised by the installed core, the node plugin on every node, a
/// LoadBalancer Service's address and the routes. Returns the leader's node address and the
/// time from `begin` until every Node was initialised.
async fn check_install(cluster: &KubeletCluster, what: &str, begin: Instant) -> (String, Duration) {
    let client = cluster.client().await.expect("client");
    let deadline = Instant::now() + Duration::from_secs(120);
    let core = loop {
        let pods = ready_pods(&client, CORE_PODS).await;
        if pods.len() == 2 {
            break pods;
        }
        if Instant::now() > deadline {
            panic!("{what}: two Ready core pods not there after 120 s:\n{}", core_pods_report(&client).await);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    for pod in &core {
        let statuses = pod.status.as_ref().and_then(|s| s.container_statuses.clone()).unwrap_or_default();
        let names: BTreeMap<String, bool> = statuses.iter().map(|s| (s.name.clone(), s.ready)).collect();
        assert_eq!(names, BTreeMap::from([("cloud-controller-manager".into(), true), ("provider".into(), true)]), "{what}");
    }
    let nodes: Api<Node> = Api::all(client.clone());
    eventually(&format!("{what}: every Node initialised"), Duration::from_secs(120), async || {
        let list = nodes.list(&Default::default()).await.ok()?.items;
        (list.len() == cluster.nodes.len() && list.iter().all(initialised)).then_some(())
    })
    .await;
    let all_initialised = begin.elapsed();
    for node in nodes.list(&Default::default()).await.expect("nodes").items {
        let addresses = node.status.and_then(|s| s.addresses).unwrap_or_default();
        let real = cluster.nodes.iter().find(|n| Some(&n.name) == node.metadata.name.as_ref()).expect("a node of ours");
        assert!(addresses.iter().any(|a| a.type_ == "InternalIP" && a.address == real.ip.to_string()), "{what}: {addresses:?}");
    }
    eventually(&format!("{what}: node-metadata on every node"), Duration::from_secs(60), async || {
        (ready_pods(&client, "app.kubernetes.io/name=ccm-node-metadata").await.len() == cluster.nodes.len()).then_some(())
    })
    .await;

    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let svc: Service = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"type": "LoadBalancer", "selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}
    }))
    .expect("service");
    services.create(&Default::default(), &svc).await.expect("create service");
    let address = eventually(&format!("{what}: the Service's address"), Duration::from_secs(60), async || {
        services.get("web").await.ok()?.status?.load_balancer?.ingress?.first()?.ip.clone()
    })
    .await;
    assert!(address.starts_with("10.252."), "{what}: {address} is not of the edge's pool");

    let leader_ip = leader_ip(cluster, &client, what).await;
    let cidrs: Vec<String> = nodes
        .list(&Default::default())
        .await
        .expect("nodes")
        .items
        .iter()
        .filter_map(|n| n.spec.as_ref()?.pod_cidr.clone())
        .collect();
    assert_eq!(cidrs.len(), cluster.nodes.len(), "{what}: kube-controller-manager allocated podCIDRs");
    eventually(&format!("{what}: a route per podCIDR"), Duration::from_secs(60), async || {
        let text = sim_state(&leader_ip).await?.to_string();
        cidrs.iter().all(|c| text.contains(c.as_str())).then_some(())
    })
    .await;
    eprintln!("{what}: install to every Node initialised: {:.1} s", all_initialised.as_secs_f64());
    (leader_ip, all_initialised)
}

/// The installed chart, asked with SubjectAccessReviews (issue 54): the provider's account may
/// do exactly its read-only rules; the core's may still do its work and mint the provider's
/// token; neither may touch Pods or another account's tokens. And the running pods: no
/// container but the core's has a token of the Pod's account.
async fn installed_accounts_keep_to_their_rules(cluster: &KubeletCluster) {
    let client = cluster.client().await.expect("client");
    let provider = "cloud-controller-manager-provider";
    let core = "cloud-controller-manager";
    let matrix: [(&str, &str, &str, Option<&str>, bool); 14] = [
        (provider, "list", "nodes", None, true),
        (provider, "watch", "services", None, true),
        (provider, "patch", "nodes", None, false),
        (provider, "delete", "pods", None, false),
        (provider, "get", "secrets", None, false),
        (provider, "create", "serviceaccounts/token", Some("node-controller"), false),
        (provider, "create", "leases", None, false),
        (core, "list", "nodes", None, true),
        (core, "update", "leases", Some("cloud-controller-manager"), true),
        (core, "create", "serviceaccounts/token", Some(provider), true),
        (core, "create", "serviceaccounts/token", Some("node-controller"), true),
        (core, "create", "serviceaccounts/token", Some("default"), false),
        (core, "delete", "pods", None, false),
        ("node-controller", "delete", "nodes", None, true),
    ];
    let mut wrong = Vec::new();
    for (account, verb, resource, name, want) in matrix {
        if crate::deploy::allowed(&client, account, verb, resource, name).await != want {
            wrong.push(format!("{account} {verb} {resource} {name:?}: expected allowed={want}"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    for pod in ready_pods(&client, CORE_PODS).await {
        let spec = pod.spec.expect("spec");
        assert_eq!(spec.automount_service_account_token, Some(false));
        let volumes = spec.volumes.unwrap_or_default();
        for container in spec.containers.iter().filter(|c| c.name != "cloud-controller-manager") {
            for mount in container.volume_mounts.iter().flatten() {
                let volume = volumes.iter().find(|v| v.name == mount.name).expect("volume");
                let token = volume
                    .projected
                    .as_ref()
                    .is_some_and(|p| p.sources.iter().flatten().any(|s| s.service_account_token.is_some()));
                assert!(!token, "{}: mounts {} with a token of the Pod's account", container.name, mount.name);
            }
        }
    }
}

/// What an operator runs `kubectl describe` and `kubectl logs` for: each core pod's
/// containers, their states, and the last lines of their logs.
async fn core_pods_report(client: &kube::Client) -> String {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "kube-system");
    let list = pods.list(&kube::api::ListParams::default().labels(CORE_PODS)).await.map(|l| l.items).unwrap_or_default();
    let mut report = String::new();
    for pod in list {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let statuses = pod.status.as_ref().and_then(|s| s.container_statuses.clone()).unwrap_or_default();
        for status in statuses {
            let state = serde_json::to_string(&status.state).unwrap_or_default();
            let last = serde_json::to_string(&status.last_state).unwrap_or_default();
            report.push_str(&format!(
                "{name}/{}: ready={} restarts={} state={state} last={last}\n",
                status.name, status.ready, status.restart_count
            ));
            for previous in [false, true] {
                let params = kube::api::LogParams {
                    container: Some(status.name.clone()),
                    previous,
                    tail_lines: Some(15),
                    ..Default::default()
                };
                if let Ok(log) = pods.logs(&name, &params).await {
                    report.push_str(&format!(
                        "--- {}logs of {name}/{}:\n{log}\n",
                        if previous { "previous " } else { "" },
                        status.name
                    ));
                }
            }
        }
    }
    report
}

/// The address of the node whose core holds the Lease.
async fn leader_ip(cluster: &KubeletCluster, client: &kube::Client, what: &str) -> String {
    let holder = eventually(&format!("{what}: a leader"), Duration::from_secs(30), async || lease_holder(client).await).await;
    let leader =
        cluster.nodes.iter().find(|n| holder.starts_with(&format!("{}_", n.name))).expect("the leader runs on one of the nodes");
    leader.ip.to_string()
}

/// Removes what an install left and puts the Nodes back as a fresh cluster's kubelets would
/// have them (the taint back, no providerID), so the next install initialises them itself.
async fn reset_nodes(cluster: &KubeletCluster) {
    reset_nodes_with(cluster, |_| String::new()).await;
}

/// Deletes every Node and restarts its kubelet, which registers it again; the kubelet of
/// node `i` gets `drop_in(i)` as its config drop-in (none when empty).
async fn reset_nodes_with(cluster: &KubeletCluster, drop_in: impl Fn(usize) -> String) {
    let client = cluster.client().await.expect("client");
    let nodes: Api<Node> = Api::all(client.clone());
    eventually("the core pods gone", Duration::from_secs(90), async || {
        kube_system_pods(&client, "app.kubernetes.io/part-of=ccm-rs").await.is_empty().then_some(())
    })
    .await;
    for (i, node) in cluster.nodes.iter().enumerate() {
        // The drop-in the node plugin wrote would hand the kubelet a providerID: a fresh
        // node has none.
        let path = node.host(DROP_IN);
        let _ = std::fs::remove_file(&path);
        let text = drop_in(i);
        if !text.is_empty() {
            std::fs::write(&path, text).expect("kubelet drop-in");
        }
        // providerID is immutable once set: the Node is registered again by its kubelet.
        let _ = nodes.delete(&node.name, &DeleteParams::default()).await;
    }
    for i in 0..cluster.nodes.len() {
        tokio::task::block_in_place(|| cluster.restart_kubelet(i)).expect("restart kubelet");
    }
    tokio::task::block_in_place(|| cluster.configure_pod_network(Duration::from_secs(90))).expect("nodes back");
    tokio::task::block_in_place(|| cluster.label_control_plane()).expect("labels");
}

/// `helm install` of the chart with `deploy/examples/<example>` and the test's own `values`
/// over it, as an operator installs an example.
fn install_example(cluster: &KubeletCluster, helm_bin: &Path, chart: &str, example: &str, values: &Path, what: &str) {
    let example = deploy_dir().join("examples").join(example).display().to_string();
    let values = values.display().to_string();
    run(
        helm(cluster, helm_bin, &["install", "ccm-rs", chart, "-n", "kube-system", "--values", &example, "--values", &values]),
        what,
    );
}

fn helm(cluster: &KubeletCluster, helm: &Path, args: &[&str]) -> std::process::Command {
    let mut cmd = std::process::Command::new(helm);
    cmd.arg("--kubeconfig").arg(cluster.control_plane().kubeconfig_path()).args(args);
    cmd
}

/// The provider writes of each sim instance seen (sidecar instances come and go with pods):
/// (node address, instance start, times of its writes in ms).
type Writes = Vec<(String, u64, Vec<u64>)>;

const WRITES: &[&str] = &[
    "RoutesService/CreateRoute",
    "RoutesService/DeleteRoute",
    "LoadBalancersService/EnsureLoadBalancer",
    "LoadBalancersService/UpdateLoadBalancerHosts",
    "LoadBalancersService/EnsureLoadBalancerDeleted",
];

/// Polls every sidecar's call log until `stop`, collecting writes per sim instance.
async fn watch_writes(ips: Vec<String>, mut stop: tokio::sync::oneshot::Receiver<()>) -> Writes {
    let mut seen: BTreeMap<(String, u64), Vec<u64>> = BTreeMap::new();
    loop {
        for ip in &ips {
            let Some((200, body)) = http_get(&format!("http://{ip}:{ADMIN_PORT}"), "/calls/log").await else { continue };
            let Ok(calls) = serde_json::from_str::<Vec<serde_json::Value>>(&body) else { continue };
            let Some(start) = calls.first().and_then(|c| c["at_unix_ms"].as_u64()) else { continue };
            let writes: Vec<u64> = calls
                .iter()
                .filter(|c| c["method"].as_str().is_some_and(|m| WRITES.contains(&m)))
                .filter_map(|c| c["at_unix_ms"].as_u64())
                .collect();
            seen.insert((ip.clone(), start), writes);
        }
        if stop.try_recv().is_ok() {
            return seen.into_iter().map(|((ip, start), w)| (ip, start, w)).collect();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_and_the_kustomize_bases_run_on_real_kubelets() {
    // The machine is checked before the images are built: a machine without musl-tools skips
    // here in one line instead of failing minutes later in the image build.
    let project = || images::project().map(|i| i.archives());
    let Some(cluster) = tokio::task::spawn_blocking(move || kubelet_cluster::shared(project))
        .await
        .expect("join")
        .expect("the kubelet cluster with the project's images")
    else {
        return;
    };
    eprintln!("kubelet cluster: {} nodes started in {:.1} s", cluster.nodes.len(), cluster.startup.as_secs_f64());
    let client = cluster.client().await.expect("client");
    let nodes: Api<Node> = Api::all(client.clone());
    tokio::task::block_in_place(|| cluster.label_control_plane()).expect("labels");
    let work = tempfile::tempdir().expect("tempdir");
    let helm_bin = tokio::task::spawn_blocking(|| ccm_harness::Assets::tool("helm")).await.expect("join").expect("helm");
    let chart = deploy_dir().join("helm/ccm-rs").display().to_string();
    let values = helm_values(cluster, work.path()).display().to_string();
    let ips: Vec<String> = cluster.nodes.iter().map(|n| n.ip.to_string()).collect();
    // To work on one phase alone (not in CI): CCM_E2E_REAL_CLUSTER_PHASE=hybrid or aws.
    match std::env::var("CCM_E2E_REAL_CLUSTER_PHASE").as_deref() {
        Ok("hybrid") => return hybrid_on_real_kubelets(cluster, &helm_bin, &chart, work.path()).await,
        Ok("aws") => return aws_on_real_kubelets(cluster, &helm_bin, &chart, work.path()).await,
        _ => {}
    }

    // === Helm ===
    let begin = Instant::now();
    run(
        helm(cluster, &helm_bin, &["install", "ccm-rs", &chart, "--namespace", "kube-system", "--values", &values]),
        "helm install",
    );
    check_install(cluster, "helm", begin).await;
    installed_accounts_keep_to_their_rules(cluster).await;
    load_balancers_cared_for_on_real_kubelets(cluster).await;

    // The node plugin wrote the kubelet drop-in on every node's host path; a kubelet started
    // with it registers its Node with the plugin's providerID (shown before the core could
    // set it: the core is scaled to zero, and the Node is registered anew).
    for node in &cluster.nodes {
        let path = node.host(DROP_IN);
        let text = eventually("the kubelet drop-in", Duration::from_secs(30), async || std::fs::read_to_string(&path).ok()).await;
        assert!(text.contains("providerID: \"sim://sim-region-1"), "{text}");
    }
    run(cluster.kubectl(&["-n", "kube-system", "scale", "deployment/cloud-controller-manager", "--replicas=0"]), "scale to 0");
    eventually("no core pod", Duration::from_secs(60), async || {
        kube_system_pods(&client, CORE_PODS).await.is_empty().then_some(())
    })
    .await;
    let last = cluster.nodes.len() - 1;
    let name = cluster.nodes[last].name.clone();
    nodes.delete(&name, &DeleteParams::default()).await.expect("delete node");
    tokio::task::block_in_place(|| cluster.restart_kubelet(last)).expect("restart kubelet");
    let node =
        eventually("the Node registered again", Duration::from_secs(60), async || nodes.get_opt(&name).await.ok().flatten())
            .await;
    let spec = node.spec.clone().unwrap_or_default();
    assert_eq!(spec.provider_id.as_deref(), Some(format!("sim://sim-region-1{}/i-real-{last}", ["a", "b"][last % 2]).as_str()));
    assert!(spec.taints.unwrap_or_default().iter().any(|t| t.key == UNINITIALIZED), "still the core's to initialise");
    let patch = serde_json::json!({"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}});
    nodes.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("label");
    tokio::task::block_in_place(|| cluster.configure_pod_network(Duration::from_secs(60))).expect("pod network");
    run(cluster.kubectl(&["-n", "kube-system", "scale", "deployment/cloud-controller-manager", "--replicas=2"]), "scale to 2");
    eventually("the Node initialised again", Duration::from_secs(90), async || {
        nodes.get(&name).await.ok().filter(initialised).map(|_| ())
    })
    .await;
    eventually("two Ready core pods again", Duration::from_secs(90), async || {
        (ready_pods(&client, CORE_PODS).await.len() == 2).then_some(())
    })
    .await;
    eventually("the node plugin back on the re-registered Node", Duration::from_secs(60), async || {
        (ready_pods(&client, "app.kubernetes.io/name=ccm-node-metadata").await.len() == cluster.nodes.len()).then_some(())
    })
    .await;

    // Leader handover: deleting the leader's pod hands the Lease over (it is released on
    // SIGTERM; the other replica, or the replacement, takes it).
    let mut handovers = Vec::new();
    for _ in 0..3 {
        let old = eventually("a leader", Duration::from_secs(30), async || lease_holder(&client).await).await;
        // The leader's pod is the running one on the holder's node: the pod deleted in the
        // round before may still be listed there, terminating, while its replacement leads.
        let pod = kube_system_pods(&client, CORE_PODS)
            .await
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()).is_some_and(|n| old.starts_with(&format!("{n}_"))))
            .expect("the leader's pod");
        let pods: Api<Pod> = Api::namespaced(client.clone(), "kube-system");
        let t0 = Instant::now();
        pods.delete(pod.metadata.name.as_deref().unwrap_or_default(), &DeleteParams::default()).await.expect("delete leader pod");
        // No new leader in 35 s: fail with what the cluster shows (pods, lease, the cores' logs).
        let mut waited = 0;
        while lease_holder(&client).await.is_none_or(|h| h == old) {
            tokio::time::sleep(Duration::from_secs(1)).await;
            waited += 1;
            if waited == 35 {
                let show = |args: &[&str]| {
                    let out = cluster.kubectl(args).output().expect("kubectl");
                    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
                };
                let pods = show(&["-n", "kube-system", "get", "pods", "-o", "wide"]);
                let lease = show(&["-n", "kube-system", "get", "lease", "cloud-controller-manager", "-o", "yaml"]);
                let logs = show(&["-n", "kube-system", "logs", "-l", CORE_PODS, "--all-containers", "--prefix", "--tail=60"]);
                panic!("no new leader 35 s after deleting the leader's pod (old {old})\n{pods}\n{lease}\n{logs}");
            }
        }
        handovers.push(t0.elapsed());
        // The next round starts with the deleted pod gone and two Ready pods.
        eventually("two Ready core pods and no terminating one", Duration::from_secs(90), async || {
            let listed = kube_system_pods(&client, CORE_PODS).await.len();
            (listed == 2 && ready_pods(&client, CORE_PODS).await.len() == 2).then_some(())
        })
        .await;
    }
    handovers.sort();
    eprintln!("leader handover after deleting the leader's pod: median {:.2} s ({handovers:?})", handovers[1].as_secs_f64());
    assert!(handovers[1] < Duration::from_secs(10), "a graceful handover takes well under the 15 s lease: {handovers:?}");

    // A rolling upgrade to a new tag keeps exactly one leader acting: the sidecars' call logs
    // never show two instances writing at once.
    tokio::task::block_in_place(|| {
        cluster.tag_image(&format!("{}:{}", images::CORE, images::TAG), &format!("{}:0.1.1", images::CORE))
    })
    .expect("tag");
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
    let watcher = tokio::spawn(watch_writes(ips.clone(), stop_rx));
    run(
        helm(
            cluster,
            &helm_bin,
            &["upgrade", "ccm-rs", &chart, "-n", "kube-system", "--values", &values, "--set", "image.tag=0.1.1", "--wait"],
        ),
        "helm upgrade",
    );
    eventually("both replicas on the new tag", Duration::from_secs(120), async || {
        let pods = ready_pods(&client, CORE_PODS).await;
        let upgraded = pods.iter().filter(|p| {
            p.spec
                .as_ref()
                .is_some_and(|s| s.containers.iter().any(|c| c.image.as_deref() == Some(&format!("{}:0.1.1", images::CORE))))
        });
        (upgraded.count() == 2).then_some(())
    })
    .await;
    let leader_ip = leader_ip(cluster, &client, "after the upgrade").await;
    eventually("the new leader's load balancer", Duration::from_secs(60), async || {
        sim_state(&leader_ip).await?["load_balancers"].as_array().filter(|l| !l.is_empty()).map(|_| ())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _ = stop_tx.send(());
    let writes = watcher.await.expect("watcher");
    let spans: Vec<(String, u64, u64)> = writes
        .iter()
        .filter(|(_, _, w)| !w.is_empty())
        .map(|(ip, _, w)| (ip.clone(), *w.iter().min().unwrap_or(&0), *w.iter().max().unwrap_or(&0)))
        .collect();
    eprintln!("writing sidecar instances during the upgrade (node, first write, last write): {spans:?}");
    assert!(!spans.is_empty(), "the upgrade's new leader wrote");
    for (i, a) in spans.iter().enumerate() {
        for b in &spans[i + 1..] {
            assert!(a.2 < b.1 || b.2 < a.1, "two instances wrote at once: {a:?} and {b:?}");
        }
    }

    // Draining a control-plane node: the PodDisruptionBudget lets one replica go.
    let drained = cluster.nodes[0].name.clone();
    run(
        cluster.kubectl(&["drain", &drained, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=90s"]),
        "kubectl drain (two control-plane nodes)",
    );
    run(cluster.kubectl(&["uncordon", &drained]), "uncordon");
    // A single control-plane node (the other one loses the role): one replica runs, the second
    // waits (its host port is taken), and with replicas=1, as documented for such clusters,
    // the node still drains.
    let other = cluster.nodes[1].name.clone();
    run(cluster.kubectl(&["label", "node", &other, "node-role.kubernetes.io/control-plane-"]), "unlabel");
    let pods: Api<Pod> = Api::namespaced(client.clone(), "kube-system");
    for pod in kube_system_pods(&client, CORE_PODS).await {
        if pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(other.as_str()) {
            let _ = pods.delete(pod.metadata.name.as_deref().unwrap_or_default(), &DeleteParams::default()).await;
        }
    }
    // With two replicas, the second cannot share the node (its host port is taken): it waits,
    // unscheduled, instead of crash-looping beside the first.
    eventually("the second replica Pending, the first leading", Duration::from_secs(60), async || {
        let all = kube_system_pods(&client, CORE_PODS).await;
        let pending = all.iter().filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending")).count();
        let unscheduled = all.iter().any(|p| {
            p.status.as_ref().and_then(|s| s.conditions.as_ref()).is_some_and(|c| {
                c.iter().any(|c| {
                    c.type_ == "PodScheduled"
                        && c.status == "False"
                        && c.message.as_deref().is_some_and(|m| m.contains("free ports"))
                })
            })
        });
        (pending == 1 && unscheduled && ready_pods(&client, CORE_PODS).await.len() == 1 && lease_holder(&client).await.is_some())
            .then_some(())
    })
    .await;
    run(
        helm(
            cluster,
            &helm_bin,
            &["upgrade", "ccm-rs", &chart, "-n", "kube-system", "--values", &values, "--set", "image.tag=0.1.1,replicas=1"],
        ),
        "helm upgrade (single control-plane node)",
    );
    eventually("one core pod, on the control-plane node", Duration::from_secs(90), async || {
        let pods = ready_pods(&client, CORE_PODS).await;
        (pods.len() == 1 && pods[0].spec.as_ref()?.node_name.as_deref() == Some(drained.as_str())).then_some(())
    })
    .await;
    run(
        cluster.kubectl(&["drain", &drained, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=90s"]),
        "kubectl drain (a single control-plane node)",
    );
    run(cluster.kubectl(&["uncordon", &drained]), "uncordon");
    run(cluster.kubectl(&["label", "node", &other, "node-role.kubernetes.io/control-plane="]), "label");

    out_of_service_on_real_kubelets(cluster, &helm_bin, &chart, &values).await;

    // Uninstall with the Service still there: its finalizer is released by the chart's hook,
    // so deleting it afterwards does not hang.
    run(
        helm(cluster, &helm_bin, &["uninstall", "ccm-rs", "--namespace", "kube-system", "--wait", "--timeout", "3m"]),
        "helm uninstall",
    );
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let finalizers = services.get("web").await.expect("service").metadata.finalizers.unwrap_or_default();
    assert!(finalizers.is_empty(), "no finalizer left on the Service: {finalizers:?}");
    services.delete("web", &DeleteParams::default()).await.expect("delete service");
    eventually("the Service deleted", Duration::from_secs(30), async || {
        services.get_opt("web").await.ok()?.is_none().then_some(())
    })
    .await;
    reset_nodes(cluster).await;

    // === kustomize === (its base carries the sim's placeholder inventory: the test's own
    // inventory goes in through the ConfigMap, as an overlay would)
    // kustomize takes only relative paths to bases: the overlay lives in target/.
    let overlay =
        tempfile::Builder::new().prefix("kustomize-overlay-").tempdir_in(deploy_dir().join("../target")).expect("overlay");
    let kustomize_dir = overlay.path().to_path_buf();
    std::fs::write(kustomize_dir.join("sim.toml"), cluster.sim_inventory()).expect("sim.toml");
    std::fs::write(
        kustomize_dir.join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {core}\n  - {plugin}\n\
             configMapGenerator:\n  - name: ccm-provider-sim\n    namespace: kube-system\n    behavior: replace\n    files: [sim.toml]\n\
             generatorOptions:\n  disableNameSuffixHash: true\n\
             patches:\n  - target: {{kind: Deployment, name: cloud-controller-manager}}\n    patch: |\n\
             \x20     - {{op: add, path: /spec/template/spec/containers/1/args/-, value: --admin-listen=http://0.0.0.0:{ADMIN_PORT}}}\n\
             \x20     - {{op: add, path: /spec/template/spec/containers/1/args/-, value: --allow-insecure-tcp}}\n\
             \x20     - {{op: add, path: /spec/template/spec/containers/0/args/-, value: --cluster-cidr={CLUSTER_CIDR}}}\n",
            core = "../../deploy/kustomize/core",
            plugin = "../../deploy/kustomize/node-metadata",
        ),
    )
    .expect("kustomization");
    let begin = Instant::now();
    run(cluster.kubectl(&["apply", "-k", &kustomize_dir.display().to_string()]), "kubectl apply -k");
    check_install(cluster, "kustomize", begin).await;
    services.delete("web", &DeleteParams::default()).await.expect("delete service");
    eventually("kustomize: the Service deleted (finalizer released by the core)", Duration::from_secs(60), async || {
        services.get_opt("web").await.ok()?.is_none().then_some(())
    })
    .await;
    run(cluster.kubectl(&["delete", "-k", &kustomize_dir.display().to_string(), "--wait=true"]), "kubectl delete -k");

    hybrid_on_real_kubelets(cluster, &helm_bin, &chart, work.path()).await;
    aws_on_real_kubelets(cluster, &helm_bin, &chart, work.path()).await;
}

/// The load balancers of the sim in the leader's pod (its admin API), by Service.
async fn lbs_by_service(leader: &str) -> Option<BTreeMap<String, (String, Vec<String>)>> {
    let state = sim_state(leader).await?;
    let lbs = state["load_balancers"].as_array()?;
    let nodes = |l: &serde_json::Value| -> Vec<String> {
        let mut n: Vec<String> =
            l["nodes"].as_array().into_iter().flatten().filter_map(|n| n.as_str().map(String::from)).collect();
        n.sort();
        n
    };
    Some(
        lbs.iter()
            .map(|l| {
                (
                    l["service"].as_str().unwrap_or_default().to_string(),
                    (l["name"].as_str().unwrap_or_default().to_string(), nodes(l)),
                )
            })
            .collect(),
    )
}

/// Backends chosen per Service (`ccm-rs.dev/load-balancer-node-selector`) and load balancers
/// repaired, on the chart's install: a Service's load balancer follows its selector as Nodes
/// are labelled, the other keeps every Node; one deleted in the cloud is made again, and one
/// whose backends were changed by hand gets them back.
async fn load_balancers_cared_for_on_real_kubelets(cluster: &KubeletCluster) {
    let client = cluster.client().await.expect("client");
    let leader = leader_ip(cluster, &client, "node selector").await;
    let (n0, n1) = (cluster.nodes[0].name.clone(), cluster.nodes[1].name.clone());
    let mut both = vec![n0.clone(), n1.clone()];
    both.sort();
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    run(cluster.kubectl(&["label", "--overwrite", "node", &n0, "pool=edge"]), "label pool=edge");
    let svc: Service = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "edge", "annotations": {"ccm-rs.dev/load-balancer-node-selector": "pool=edge"}},
        "spec": {"type": "LoadBalancer", "selector": {"app": "web"}, "ports": [{"port": 81, "targetPort": 8080}]}
    }))
    .expect("service");
    services.create(&Default::default(), &svc).await.expect("create service");
    let lb_of = async |service: &str, want: &[String]| {
        let lbs = lbs_by_service(&leader).await?;
        let (name, nodes) = lbs.get(service)?;
        (nodes == want).then(|| name.clone())
    };
    let started = Instant::now();
    eventually("edge's load balancer on the pool's node only", Duration::from_secs(60), async || {
        lb_of("default/edge", std::slice::from_ref(&n0)).await
    })
    .await;
    eventually("web's load balancer on every node", Duration::from_secs(10), async || lb_of("default/web", &both).await).await;
    run(cluster.kubectl(&["label", "--overwrite", "node", &n1, "pool=edge"]), "label pool=edge");
    eventually("a node joining the pool", Duration::from_secs(30), async || lb_of("default/edge", &both).await).await;
    run(cluster.kubectl(&["label", "node", &n0, "pool-"]), "unlabel");
    let edge = eventually("a node leaving the pool", Duration::from_secs(30), async || {
        lb_of("default/edge", std::slice::from_ref(&n1)).await
    })
    .await;
    eprintln!("node selector on real kubelets: {:.1} s", started.elapsed().as_secs_f64());

    // Deleted in the cloud: made again at the next sweep (every 5-10 s here).
    let admin = format!("http://{leader}:{ADMIN_PORT}");
    let (status, body) = http_request(&admin, "DELETE", &format!("/load-balancers/{edge}"), None).await.expect("admin");
    assert_eq!(status, 204, "{body}");
    let removed = Instant::now();
    eventually("edge's load balancer made again", Duration::from_secs(60), async || {
        lb_of("default/edge", std::slice::from_ref(&n1)).await
    })
    .await;
    eprintln!("a load balancer deleted in the cloud made again after {:.1} s", removed.elapsed().as_secs_f64());
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(client.clone(), "default");
    eventually("the LoadBalancerRecreated Event", Duration::from_secs(30), async || {
        let list = events.list(&ListParams::default().fields("involvedObject.name=edge")).await.ok()?;
        list.items.iter().any(|e| e.reason.as_deref() == Some("LoadBalancerRecreated")).then_some(())
    })
    .await;
    // Backends changed by hand: given back.
    let web = lb_of("default/web", &both).await.expect("web's load balancer");
    let hosts = serde_json::json!([n0]);
    let (status, body) = http_request(&admin, "PUT", &format!("/load-balancers/{web}/hosts"), Some(&hosts)).await.expect("admin");
    assert_eq!(status, 204, "{body}");
    eventually("web's backends given back", Duration::from_secs(60), async || lb_of("default/web", &both).await).await;

    services.delete("edge", &DeleteParams::default()).await.expect("delete edge");
    eventually("edge deleted with its load balancer", Duration::from_secs(60), async || {
        let gone = services.get_opt("edge").await.ok()?.is_none();
        (gone && !lbs_by_service(&leader).await?.contains_key("default/edge")).then_some(())
    })
    .await;
    run(cluster.kubectl(&["label", "node", &n1, "pool-"]), "unlabel");
}

/// A hybrid cluster on real kubelets, installed as `deploy/examples/hybrid-values.yaml` shows:
/// the core with two provider sidecars in its pod (two sims of two providerID schemes, the
/// second from `extraProviders`). The first node's instance is the cloud's; the others are
/// metal's: the second's kubelet has a metal providerID in its config, the rest are found by
/// the core's name lookups. Every Node is initialised by its own provider, and LoadBalancer
/// Services get the load balancer of their class's provider.
async fn hybrid_on_real_kubelets(cluster: &KubeletCluster, helm_bin: &Path, chart: &str, dir: &Path) {
    let instance = |scheme: &str, i: usize| {
        let node = &cluster.nodes[i];
        format!(
            "\n[[instances]]\nid = \"{scheme}-{i}\"\nname = \"{}\"\nzone = \"{scheme}-zone\"\ninstance_type = \"{scheme}.medium\"\n\
             addresses = [{{ type = \"InternalIP\", address = \"{}\" }}]\n",
            node.name, node.ip
        )
    };
    let sim_toml = |scheme: &str, pool: &str, class: &str, nodes: &mut dyn Iterator<Item = usize>| {
        let mut toml = format!(
            "region = \"{scheme}-region\"\nprovider_id_scheme = \"{scheme}\"\n\n[load_balancers]\naddress_pool = [\"{pool}\"]\n\
             classes = [\"{class}\"]\n"
        );
        nodes.for_each(|i| toml.push_str(&instance(scheme, i)));
        toml
    };
    let count = cluster.nodes.len();
    assert!(count >= 2, "two nodes at least: one per provider");
    let values = dir.join("hybrid-test-values.yaml");
    let test_values = serde_json::json!({
        "sim": { "config": { "sim.toml": sim_toml("cloud", "203.0.113.0/24", "cloud.example.com/lb", &mut (0..1)) } },
        "extraProviders": [{
            "name": "metal",
            "image": { "repository": "ghcr.io/ccm-rs/provider-sim" },
            "args": ["--config=/etc/ccm-provider/sim.toml"],
            "config": { "sim.toml": sim_toml("metal", "198.51.100.0/24", "metal.example.com/lb", &mut (1..count)) },
            "metrics": { "enabled": true },
        }],
    });
    std::fs::write(&values, test_values.to_string()).expect("values");
    reset_nodes_with(cluster, |i| {
        if i == 1 {
            "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nproviderID: \"metal://metal-zone/metal-1\"\n"
                .to_string()
        } else {
            String::new()
        }
    })
    .await;
    let begin = Instant::now();
    install_example(cluster, helm_bin, chart, "hybrid-values.yaml", &values, "helm install (hybrid)");
    let client = cluster.client().await.expect("client");
    let pods = eventually("hybrid: Ready core pods", Duration::from_secs(120), async || {
        let pods = ready_pods(&client, CORE_PODS).await;
        (pods.len() == count.min(2)).then_some(pods)
    })
    .await;
    for pod in &pods {
        let statuses = pod.status.as_ref().and_then(|s| s.container_statuses.clone()).unwrap_or_default();
        let names: BTreeMap<String, bool> = statuses.iter().map(|s| (s.name.clone(), s.ready)).collect();
        let want = [("cloud-controller-manager", true), ("provider", true), ("provider-metal", true)];
        assert_eq!(names, want.map(|(n, r)| (n.to_string(), r)).into(), "hybrid: the core and both sidecars");
    }
    let nodes: Api<Node> = Api::all(client.clone());
    let diagnose = {
        let cluster_nodes = cluster.kubectl(&["get", "nodes", "-o", "wide", "--show-labels"]);
        let core_logs =
            cluster.kubectl(&["-n", "kube-system", "logs", "deploy/cloud-controller-manager", "--all-containers", "--tail=80"]);
        move || {
            for (cmd, what) in [(cluster_nodes, "nodes"), (core_logs, "core logs")] {
                eprintln!("hybrid: {what}:\n{}", printed(cmd));
            }
        }
    };
    let initialised_all = async || {
        let list = nodes.list(&Default::default()).await.ok()?.items;
        // Initialised by either provider: the taint gone, a providerID, the cloud's labels.
        let done = |n: &Node| {
            let spec = n.spec.as_ref();
            let tainted = spec.and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == UNINITIALIZED));
            let typed = n.metadata.labels.as_ref().is_some_and(|l| l.contains_key("node.kubernetes.io/instance-type"));
            !tainted && typed && spec.and_then(|s| s.provider_id.as_deref()).is_some()
        };
        if list.len() != count || !list.iter().all(done) {
            return None;
        }
        let by_name: BTreeMap<String, String> = list
            .iter()
            .map(|n| {
                (
                    n.metadata.name.clone().unwrap_or_default(),
                    n.spec.as_ref().and_then(|s| s.provider_id.clone()).unwrap_or_default(),
                )
            })
            .collect();
        Some(by_name)
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    let ids = loop {
        if let Some(ids) = initialised_all().await {
            break ids;
        }
        if Instant::now() > deadline {
            tokio::task::block_in_place(diagnose);
            panic!("hybrid: not every Node initialised by its provider within 120 s (the nodes and the core's logs are above)");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eprintln!("hybrid: install to every Node initialised: {:.1} s", begin.elapsed().as_secs_f64());
    for (i, node) in cluster.nodes.iter().enumerate() {
        let want = if i == 0 { "cloud://cloud-zone/cloud-0".to_string() } else { format!("metal://metal-zone/metal-{i}") };
        assert_eq!(ids.get(&node.name), Some(&want), "hybrid: {}", node.name);
    }
    let labelled = nodes.get(&cluster.nodes[0].name).await.expect("node").metadata.labels.unwrap_or_default();
    assert_eq!(labelled.get("ccm-rs.dev/provider").map(String::as_str), Some("cloud"), "hybrid: found by name lookup");

    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    for (name, class) in [("web", None), ("metal-web", Some("metal.example.com/lb"))] {
        let svc: Service = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
            "spec": {"type": "LoadBalancer", "loadBalancerClass": class, "selector": {"app": "web"}, "ports": [{"port": 80}]}
        }))
        .expect("service");
        services.create(&Default::default(), &svc).await.expect("create service");
    }
    for (name, pool) in [("web", "203.0.113."), ("metal-web", "198.51.100.")] {
        let address = eventually(&format!("hybrid: {name}'s address"), Duration::from_secs(60), async || {
            services.get(name).await.ok()?.status?.load_balancer?.ingress?.first()?.ip.clone()
        })
        .await;
        assert!(address.starts_with(pool), "hybrid: {name} got {address}, not of its provider's pool {pool}");
    }
    for name in ["web", "metal-web"] {
        services.delete(name, &DeleteParams::default()).await.expect("delete service");
    }
    eventually("hybrid: the Services deleted (finalizers released by the core)", Duration::from_secs(60), async || {
        let left = services
            .list(&Default::default())
            .await
            .ok()?
            .items
            .iter()
            .filter(|s| s.metadata.name.as_deref() != Some("kubernetes"))
            .count();
        (left == 0).then_some(())
    })
    .await;
    run(
        helm(cluster, helm_bin, &["uninstall", "ccm-rs", "-n", "kube-system", "--wait", "--timeout", "3m"]),
        "helm uninstall (hybrid)",
    );
}

/// Non-graceful node shutdown on real kubelets, with the chart's `outOfServiceAfter`: a
/// Deployment's pod runs on a node whose instance is stopped (in the leader's sim) and whose
/// kubelet dies with it. kube-controller-manager marks the Node NotReady, the core adds the
/// out-of-service taint, kube-controller-manager force-deletes the pod and the Deployment's
/// replacement runs on the other node; the instance started and the kubelet back, the taint
/// goes. Prints how long each step took.
async fn out_of_service_on_real_kubelets(cluster: &KubeletCluster, helm_bin: &Path, chart: &str, values: &str) {
    const AFTER: Duration = Duration::from_secs(10);
    let client = cluster.client().await.expect("client");
    run(
        helm(
            cluster,
            helm_bin,
            &[
                "upgrade",
                "ccm-rs",
                chart,
                "-n",
                "kube-system",
                "--values",
                values,
                "--set",
                "image.tag=0.1.1,replicas=1,outOfServiceAfter=10s",
                "--wait",
            ],
        ),
        "helm upgrade (outOfServiceAfter)",
    );
    eventually("the core with --out-of-service-after", Duration::from_secs(120), async || {
        let pods = ready_pods(&client, CORE_PODS).await;
        let args = pods.first()?.spec.as_ref()?.containers.first()?.args.clone()?;
        (pods.len() == 1 && args.iter().any(|a| a == "--out-of-service-after=10s")).then_some(())
    })
    .await;
    let leader_ip = leader_ip(cluster, &client, "out of service").await;
    // The node to stop: not the leader's (its core keeps acting without a kubelet, but a
    // replacement elsewhere would start with a sim of its own).
    let (x, victim_node) = cluster.nodes.iter().enumerate().find(|(_, n)| n.ip.to_string() != leader_ip).expect("another node");
    let victim_node = victim_node.name.clone();
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> = Api::namespaced(client.clone(), "default");
    let deployment = serde_json::from_value(serde_json::json!({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "stateful-ish"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "stateful-ish"}},
          "template": {"metadata": {"labels": {"app": "stateful-ish"}}, "spec": {
            "terminationGracePeriodSeconds": 30,
            "tolerations": [{"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100,
              "preference": {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [victim_node]}]}}]}},
            "containers": [{"name": "pause", "image": kubelet_cluster::PAUSE_IMAGE, "imagePullPolicy": "Never"}]}}}
    }))
    .expect("deployment");
    deployments.create(&Default::default(), &deployment).await.expect("create deployment");
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let on = |node: &str, pod: &Pod| pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node);
    let running = async |node: Option<&str>| -> Option<Pod> {
        let list = pods.list(&ListParams::default().labels("app=stateful-ish")).await.ok()?.items;
        list.into_iter().find(|p| pod_ready(p) && p.metadata.deletion_timestamp.is_none() && node.is_none_or(|n| on(n, p)))
    };
    let first = eventually("the workload running on the node to stop", Duration::from_secs(60), async || {
        running(Some(&victim_node)).await
    })
    .await;
    let first_name = first.metadata.name.clone().unwrap_or_default();

    // The instance is shut down: the cloud says so, and its kubelet is gone with it.
    let sim = ccm_provider_sim::client::AdminClient::new(format!("http://{leader_ip}:{ADMIN_PORT}"));
    let instance = format!("i-real-{x}");
    let t0 = Instant::now();
    sim.instance_action(&instance, "stop").await.expect("stop the instance");
    tokio::task::block_in_place(|| cluster.stop_kubelet(x)).expect("stop kubelet");
    let nodes: Api<Node> = Api::all(client.clone());
    let has_taint =
        |n: &Node, key: &str| n.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == key));
    eventually("the Node NotReady", Duration::from_secs(120), async || {
        let n = nodes.get(&victim_node).await.ok()?;
        let ready = n.status?.conditions?.into_iter().find(|c| c.type_ == "Ready")?;
        (ready.status != "True").then_some(())
    })
    .await;
    let not_ready = t0.elapsed();
    eventually("the out-of-service taint", Duration::from_secs(90), async || {
        nodes.get(&victim_node).await.ok().filter(|n| has_taint(n, "node.kubernetes.io/out-of-service")).map(|_| ())
    })
    .await;
    let tainted = t0.elapsed();
    assert!(
        tainted >= not_ready + AFTER,
        "tainted {tainted:?} after the stop, the Node NotReady after {not_ready:?}: before the delay"
    );
    eventually("the pod force-deleted by kube-controller-manager", Duration::from_secs(120), async || {
        pods.get_opt(&first_name).await.ok()?.is_none().then_some(())
    })
    .await;
    let deleted = t0.elapsed();
    let other = cluster.nodes[1 - x].name.clone();
    eventually("the workload running on the other node", Duration::from_secs(120), async || running(Some(&other)).await).await;
    let rescheduled = t0.elapsed();
    eprintln!(
        "non-graceful shutdown on real kubelets (outOfServiceAfter=10s): instance stopped -> Node NotReady {:.1} s, \
         out-of-service taint {:.1} s, pod force-deleted {:.1} s, pod running on the other node {:.1} s",
        not_ready.as_secs_f64(),
        tainted.as_secs_f64(),
        deleted.as_secs_f64(),
        rescheduled.as_secs_f64()
    );

    // The instance runs again and its kubelet is back: Ready, and the taint removed.
    sim.instance_action(&instance, "start").await.expect("start the instance");
    tokio::task::block_in_place(|| cluster.restart_kubelet(x)).expect("restart kubelet");
    eventually("the out-of-service taint removed once Ready", Duration::from_secs(120), async || {
        let n = nodes.get(&victim_node).await.ok()?;
        let ready = n.status.as_ref()?.conditions.as_ref()?.iter().any(|c| c.type_ == "Ready" && c.status == "True");
        (ready && !has_taint(&n, "node.kubernetes.io/out-of-service")).then_some(())
    })
    .await;
    deployments.delete("stateful-ish", &DeleteParams::default()).await.expect("delete deployment");
    eventually("the node plugin on every node again", Duration::from_secs(90), async || {
        (ready_pods(&client, "app.kubernetes.io/name=ccm-node-metadata").await.len() == cluster.nodes.len()).then_some(())
    })
    .await;
}

/// The AWS provider's image with the chart and `deploy/examples/aws-values.yaml`, as an
/// operator installs it, against moto on the cluster's bridge: one instance per kubelet, with
/// the kubelet's address as its private IP and the kubelet given its providerID by a config
/// drop-in (as AWS nodes not named by their private DNS name are).
async fn aws_on_real_kubelets(cluster: &KubeletCluster, helm_bin: &Path, chart: &str, dir: &Path) {
    let python = match tokio::task::spawn_blocking(|| ccm_harness::Assets::tool("moto")).await.expect("join") {
        Ok(p) => p,
        Err(e) if std::env::var_os(crate::aws::REQUIRE).is_some() => panic!("moto is missing: {e:#}"),
        Err(e) => return eprintln!("skipped the AWS phase: moto needs python3: {e:#}"),
    };
    if let Err(why) = images::check_machine_aws() {
        assert!(std::env::var_os(crate::aws::REQUIRE).is_none(), "{}: {why}", crate::aws::REQUIRE);
        return eprintln!("skipped the AWS phase: {why}");
    }
    let image = tokio::task::spawn_blocking(images::provider_aws).await.expect("join").expect("the AWS provider image");
    tokio::task::block_in_place(|| cluster.import_image(&image)).expect("import the AWS provider image");
    let name = "ccm-real";
    let ips: Vec<String> = cluster.nodes.iter().map(|n| n.ip.to_string()).collect();
    let mut moto = Moto::start_for(&python, name, &cluster.gateway.to_string(), &ips).await.expect("moto on the bridge");
    let instances = moto.instances();
    reset_nodes_with(cluster, |i| {
        let id = &instances[i].id;
        format!("apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nproviderID: \"aws:///us-east-1a/{id}\"\n")
    })
    .await;

    // As an operator coming from AWS's chart installs it: a DaemonSet on the control-plane
    // nodes, an IRSA role on the ServiceAccount, a priority class, and AWS's arguments
    // (`--cloud-config` to the core, which passes it to the sidecar; `--controllers=*,tagging`;
    // a repeated flag, the last winning).
    let values = dir.join("aws-test-values.yaml");
    let test_values = serde_json::json!({
        "clusterName": name,
        "kind": "DaemonSet",
        "priorityClassName": "system-node-critical",
        "serviceAccount": { "annotations": { "eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/ccm-real" } },
        "extraArgs": [
            "--cloud-config=/etc/ccm-provider/cloud.conf",
            "--controllers=*,tagging",
            "--cluster-name=not-this-one",
            format!("--cluster-name={name}"),
        ],
        "provider": {
            "args": ["--cloud-provider=aws", "--batch-reads"],
            "config": { "cloud.conf": moto.cloud_config(name) },
            "env": ccm_harness::aws::AWS_ENV.iter().map(|(k, v)| serde_json::json!({"name": k, "value": v})).collect::<Vec<_>>(),
        },
    });
    std::fs::write(&values, test_values.to_string()).expect("values");
    let begin = Instant::now();
    install_example(cluster, helm_bin, chart, "aws-values.yaml", &values, "helm install (AWS)");
    let client = cluster.client().await.expect("client");
    let pods = eventually("AWS: a Ready core pod on each control-plane node", Duration::from_secs(120), async || {
        let pods = ready_pods(&client, CORE_PODS).await;
        (pods.len() == cluster.nodes.len()).then_some(pods)
    })
    .await;
    for pod in &pods {
        let owner = pod.metadata.owner_references.clone().unwrap_or_default();
        assert!(owner.iter().any(|o| o.kind == "DaemonSet"), "AWS: the core runs as a DaemonSet: {owner:?}");
        let spec = pod.spec.clone().unwrap_or_default();
        assert_eq!(spec.priority_class_name.as_deref(), Some("system-node-critical"));
        assert_eq!(spec.service_account_name.as_deref(), Some("cloud-controller-manager"));
    }
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> = Api::namespaced(client.clone(), "kube-system");
    let account = accounts.get("cloud-controller-manager").await.expect("the core's ServiceAccount");
    let annotations = account.metadata.annotations.unwrap_or_default();
    assert_eq!(
        annotations.get("eks.amazonaws.com/role-arn").map(String::as_str),
        Some("arn:aws:iam::123456789012:role/ccm-real")
    );
    let nodes: Api<Node> = Api::all(client.clone());
    let aws_initialised = |n: &Node| {
        let labels = n.metadata.labels.clone().unwrap_or_default();
        let tainted = n.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == UNINITIALIZED));
        !tainted
            && labels.get("topology.kubernetes.io/zone").map(String::as_str) == Some("us-east-1a")
            && labels.get("node.kubernetes.io/instance-type").map(String::as_str) == Some("m5.large")
    };
    eventually("AWS: every Node initialised from moto", Duration::from_secs(120), async || {
        let list = nodes.list(&Default::default()).await.ok()?.items;
        (list.len() == cluster.nodes.len() && list.iter().all(aws_initialised)).then_some(())
    })
    .await;
    eprintln!("AWS: install to every Node initialised: {:.1} s", begin.elapsed().as_secs_f64());
    // The AWS provider reads Nodes through its informer: as its own ServiceAccount, with the
    // token the core handed over (issue 54), never as the core's. The go-adapter's client says
    // who it is in its User-Agent; the audit log says which account each request used.
    let log = std::fs::read_to_string(cluster.control_plane().audit_log()).expect("audit log");
    let mut provider_users = BTreeSet::new();
    for line in log.lines() {
        let Ok(event) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if event["userAgent"].as_str().is_some_and(|a| a.starts_with("ccm-provider-go-adapter")) {
            provider_users.insert(event["user"]["username"].as_str().unwrap_or_default().to_string());
        }
    }
    assert_eq!(
        provider_users,
        BTreeSet::from(["system:serviceaccount:kube-system:cloud-controller-manager-provider".to_string()]),
        "the AWS sidecar's requests, by account"
    );
    for (node, instance) in cluster.nodes.iter().zip(&instances) {
        let n = nodes.get(&node.name).await.expect("node");
        assert_eq!(n.spec.as_ref().and_then(|s| s.provider_id.clone()), Some(format!("aws:///us-east-1a/{}", instance.id)));
        let addresses = n.status.and_then(|s| s.addresses).unwrap_or_default();
        assert!(addresses.iter().any(|a| a.type_ == "InternalIP" && a.address == node.ip.to_string()), "{addresses:?}");
    }

    // Every podCIDR a route in moto's route table, to its node's instance.
    let want: Vec<(String, String)> =
        cluster.nodes.iter().zip(&instances).map(|(node, instance)| (node.name.clone(), instance.id.clone())).collect();
    let mut routes = serde_json::Value::Null;
    let routed = async |routes: &serde_json::Value| {
        let mut all = true;
        for (node, id) in &want {
            let cidr = nodes.get(node).await.ok().and_then(|n| n.spec?.pod_cidr).unwrap_or_default();
            all &= routes.as_array().is_some_and(|l| {
                l.iter().any(|r| r["destination"].as_str() == Some(cidr.as_str()) && r["instance"].as_str() == Some(id.as_str()))
            });
        }
        all
    };
    for _ in 0..120 {
        routes = moto.query("routes").await.expect("moto routes");
        if routed(&routes).await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(routed(&routes).await, "a route per podCIDR in moto: {routes}");

    // A LoadBalancer Service: a classic ELB with the instances registered.
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let svc: Service = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"type": "LoadBalancer", "selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}
    }))
    .expect("service");
    services.create(&Default::default(), &svc).await.expect("create service");
    let hostname = eventually("AWS: the ELB's hostname in the Service", Duration::from_secs(90), async || {
        services.get("web").await.ok()?.status?.load_balancer?.ingress?.first()?.hostname.clone()
    })
    .await;
    let ids: Vec<String> = instances.iter().map(|i| i.id.clone()).collect();
    let mut registered = async || {
        let elbs = moto.query("elbs").await.expect("moto elbs");
        let elb = elbs.as_array().and_then(|l| l.iter().find(|lb| lb["dns"].as_str() == Some(hostname.as_str())).cloned());
        let elb = elb.unwrap_or_else(|| panic!("no ELB {hostname} in moto: {elbs}"));
        let mut list: Vec<String> = elb["instances"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .filter_map(|v| v.as_str().map(String::from))
            .collect();
        list.sort();
        list
    };
    let mut every = ids.clone();
    every.sort();
    let deadline = Instant::now() + Duration::from_secs(60);
    let before = loop {
        let last = registered().await;
        if last == every {
            break last;
        }
        if Instant::now() >= deadline {
            // What an operator would look at: the Nodes, the cloud's ELBs and both pods' logs.
            let elbs = moto.query("elbs").await.map(|v| v.to_string()).unwrap_or_else(|e| e.to_string());
            let logs =
                cluster.kubectl(&["-n", "kube-system", "logs", "-l", CORE_PODS, "--all-containers", "--prefix", "--tail=300"]);
            let wide = cluster.kubectl(&["get", "nodes", "-o", "wide", "--show-labels"]);
            panic!(
                "AWS: after 60 s the ELB has instances {last:?}, not {every:?}\nELBs: {elbs}\nnodes:\n{}\nlogs:\n{}",
                printed(wide),
                printed(logs)
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };

    // KEP-3458: the cluster autoscaler's taint on a Node does not take its instance out of the
    // ELB (connections drain through kube-proxy's health check until the Node is deleted).
    let tainted = &cluster.nodes[0].name;
    let taint = serde_json::json!({"spec": {"taints": [
        {"key": "ToBeDeletedByClusterAutoscaler", "value": "1764844800", "effect": "NoSchedule"}
    ]}});
    nodes.patch(tainted, &PatchParams::default(), &Patch::Merge(&taint)).await.expect("the autoscaler's taint");
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(registered().await, before, "AWS: the autoscaler's taint took an instance out of the ELB");
    let untaint = serde_json::json!({"spec": {"taints": null}});
    nodes.patch(tainted, &PatchParams::default(), &Patch::Merge(&untaint)).await.expect("taint removed");

    // The AWS provider's own metrics: its AWS API calls by request, as upstream's
    // aws-cloud-controller-manager serves them. The sidecar serves them on a socket only; the
    // core serves them again on its secure port, to a caller allowed them and nobody else.
    let leader = leader_ip(cluster, &client, "AWS").await;
    let url = format!("https://{leader}:10258/metrics/providers/default");
    let scrape = async |token: Option<&str>| -> Option<(u16, String)> {
        let mut cmd = tokio::process::Command::new("curl");
        cmd.args(["-sk", "--max-time", "5", "-w", "\n%{http_code}", &url]);
        if let Some(token) = token {
            cmd.args(["-H", &format!("Authorization: Bearer {token}")]);
        }
        let out = cmd.output().await.ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n')?;
        Some((code.trim().parse().ok()?, body.to_string()))
    };
    assert!(
        http_get(&format!("http://{leader}:10260"), "/metrics").await.is_none_or(|(status, _)| status != 200),
        "AWS: nothing serves the sidecar's metrics on the node's address"
    );
    let (status, body) = scrape(None).await.expect("an answer");
    assert_eq!(status, 403, "AWS: anonymous /metrics/providers/default: {body}");
    let scraper = "aws-metrics-scraper";
    let token = crate::serving::service_account_token(&client, "kube-system", scraper).await;
    crate::serving::grant_urls(&client, scraper, "kube-system", scraper, &["/metrics/providers/*"]).await;
    let metrics = eventually("AWS: the sidecar's cloudprovider_aws_api_* metrics", Duration::from_secs(30), async || {
        let (status, body) = scrape(Some(&token)).await?;
        (status == 200 && body.contains("cloudprovider_aws_api_request_duration_seconds_count{")).then_some(body)
    })
    .await;
    crate::serving::revoke(&client, scraper).await;
    assert!(metrics.contains("cloudprovider_aws_api_request_duration_seconds_count{request=\""), "{metrics}");
    let logs = run(
        cluster.kubectl(&["-n", "kube-system", "logs", "daemonset/cloud-controller-manager", "-c", "cloud-controller-manager"]),
        "core logs",
    );
    assert!(
        logs.contains("--cloud-config") && logs.contains("tagging"),
        "AWS: the core says where --cloud-config and tagging go: {logs}"
    );
    services.delete("web", &DeleteParams::default()).await.expect("delete service");
    eventually("AWS: the Service deleted and its ELB with it", Duration::from_secs(90), async || {
        let gone = services.get_opt("web").await.ok()?.is_none();
        (gone && moto.query("elbs").await.ok()? == serde_json::json!([])).then_some(())
    })
    .await;
    run(
        helm(cluster, helm_bin, &["uninstall", "ccm-rs", "-n", "kube-system", "--wait", "--timeout", "3m"]),
        "helm uninstall (AWS)",
    );
    reset_nodes(cluster).await;
}
