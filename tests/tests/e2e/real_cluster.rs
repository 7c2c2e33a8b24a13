//! What an operator installs, installed the way they install it, on real kubelets: the
//! images built from `deploy/images/*`, the Helm chart and the kustomize bases applied to the
//! harness's kubelet cluster (`ccm_e2e::kubelet_cluster`), and the Nodes the kubelets
//! register initialised by the installed core, not by a process of the test.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ccm_e2e::images;
use ccm_e2e::kubelet_cluster::{self, CLUSTER_CIDR, KubeletCluster};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};

use crate::support::{eventually, http_get};

const UNINITIALIZED: &str = "node.cloudprovider.kubernetes.io/uninitialized";
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

/// The sim inventory for the cluster's nodes: one instance per Node, named as the Node, with
/// the kubelet's own address (the kubelet's provided-node-ip must be among the cloud's).
fn sim_config(cluster: &KubeletCluster) -> String {
    let mut toml = String::from(
        "region = \"sim-region-1\"\ncache_ttl_seconds = 30\n\n[[route_tables]]\nid = \"rt-main\"\nname = \"main\"\nmax_routes = 50\n\n\
         [load_balancers]\naddress_pool = [\"203.0.113.0/28\"]\nmax_name_length = 32\n",
    );
    for (i, node) in cluster.nodes.iter().enumerate() {
        toml.push_str(&format!(
            "\n[[instances]]\nid = \"i-real-{i}\"\nname = \"{}\"\nzone = \"sim-region-1{}\"\ninstance_type = \"sim.medium\"\n\
             addresses = [{{ type = \"InternalIP\", address = \"{}\" }}]\n",
            node.name,
            ["a", "b"][i % 2],
            node.ip
        ));
    }
    toml
}

/// Helm values for the test: the sim's inventory of the real nodes, routes, and the sim's
/// admin API on each sidecar's node address (to read the cloud's state).
fn helm_values(cluster: &KubeletCluster, dir: &Path) -> PathBuf {
    let indent = |text: &str| text.lines().map(|l| format!("      {l}\n")).collect::<String>();
    let values = format!(
        "sim:\n  enabled: true\n  extraArgs: [--admin-listen=http://0.0.0.0:{ADMIN_PORT}]\n  config:\n    sim.toml: |\n{}\
         clusterCIDR: {CLUSTER_CIDR}\nconfigureCloudRoutes: true\n",
        indent(&sim_config(cluster))
    );
    let path = dir.join("values.yaml");
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

/// Installs with `install`, checks everything a user would look at, and removes it again.
async fn install_and_check(
    cluster: &KubeletCluster,
    what: &str,
    install: std::process::Command,
    uninstall: std::process::Command,
) {
    let client = cluster.client().await.expect("client");
    let begin = Instant::now();
    run(install, &format!("{what}: install"));

    // The core pods (core + provider sidecar over the shared socket) Running and Ready.
    let core = eventually(&format!("{what}: two Ready core pods"), Duration::from_secs(120), async || {
        let pods = ready_pods(&client, "app.kubernetes.io/name=cloud-controller-manager").await;
        (pods.len() == 2).then_some(pods)
    })
    .await;
    for pod in &core {
        let statuses = pod.status.as_ref().and_then(|s| s.container_statuses.clone()).unwrap_or_default();
        let names: BTreeMap<String, bool> = statuses.iter().map(|s| (s.name.clone(), s.ready)).collect();
        assert_eq!(names, BTreeMap::from([("cloud-controller-manager".into(), true), ("provider".into(), true)]), "{what}");
    }

    // Every real Node initialised by the installed core.
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

    // The node plugin on every node.
    eventually(&format!("{what}: node-metadata on every node"), Duration::from_secs(60), async || {
        (ready_pods(&client, "app.kubernetes.io/name=ccm-node-metadata").await.len() == cluster.nodes.len()).then_some(())
    })
    .await;

    // A LoadBalancer Service gets its address.
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let svc: Service = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"type": "LoadBalancer", "selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}
    }))
    .expect("service");
    services.create(&Default::default(), &svc).await.expect("create service");
    let address = eventually(&format!("{what}: the Service's address"), Duration::from_secs(60), async || {
        let svc = services.get("web").await.ok()?;
        svc.status?.load_balancer?.ingress?.first()?.ip.clone()
    })
    .await;
    assert!(address.starts_with("203.0.113."), "{what}: {address}");

    // Routes for the Nodes' podCIDRs, in the leader's cloud.
    let holder = eventually(&format!("{what}: a leader"), Duration::from_secs(30), async || lease_holder(&client).await).await;
    let leader =
        cluster.nodes.iter().find(|n| holder.starts_with(&format!("{}_", n.name))).expect("the leader runs on one of the nodes");
    let leader_ip = leader.ip.to_string();
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
        let state = sim_state(&leader_ip).await?;
        let text = state.to_string();
        cidrs.iter().all(|c| text.contains(c.as_str())).then_some(())
    })
    .await;
    eprintln!("{what}: install to every Node initialised: {:.1} s", all_initialised.as_secs_f64());

    // Uninstall; the Service goes first, so its load balancer is deleted while the core runs.
    services.delete("web", &DeleteParams::default()).await.expect("delete service");
    eventually(&format!("{what}: the Service deleted (finalizer released)"), Duration::from_secs(60), async || {
        services.get_opt("web").await.ok()?.is_none().then_some(())
    })
    .await;
    run(uninstall, &format!("{what}: uninstall"));
    eventually(&format!("{what}: the core pods gone"), Duration::from_secs(90), async || {
        let pods: Api<Pod> = Api::namespaced(client.clone(), "kube-system");
        pods.list(&ListParams::default().labels("app.kubernetes.io/part-of=ccm-rs")).await.ok()?.items.is_empty().then_some(())
    })
    .await;
    // The next install must initialise the Nodes itself: put the taint back, as a fresh
    // cluster's kubelets would have it.
    for node in &cluster.nodes {
        let patch = serde_json::json!({"spec": {"taints": [{"key": UNINITIALIZED, "value": "true", "effect": "NoSchedule"}],
            "providerID": null}});
        let _ = nodes.patch(&node.name, &PatchParams::default(), &Patch::Merge(&patch)).await;
    }
}

fn helm(cluster: &KubeletCluster, helm: &Path, args: &[&str]) -> std::process::Command {
    let mut cmd = std::process::Command::new(helm);
    cmd.arg("--kubeconfig").arg(cluster.control_plane().kubeconfig_path()).args(args);
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_and_the_kustomize_bases_run_on_real_kubelets() {
    let images = tokio::task::spawn_blocking(images::project).await.expect("join").expect("images");
    let archives = images.archives();
    let Some(cluster) =
        tokio::task::spawn_blocking(move || kubelet_cluster::shared(&archives)).await.expect("join").expect("cluster")
    else {
        return;
    };
    eprintln!("kubelet cluster: {} nodes started in {:.1} s", cluster.nodes.len(), cluster.startup.as_secs_f64());
    let client = cluster.client().await.expect("client");
    let nodes: Api<Node> = Api::all(client.clone());
    for node in &cluster.nodes {
        // Control-plane nodes, as the chart's nodeSelector expects (an admin's label: a
        // kubelet may not set node-role labels on itself).
        let patch = serde_json::json!({"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}});
        nodes.patch(&node.name, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("label");
    }
    let work = tempfile::tempdir().expect("tempdir");
    let helm_bin = tokio::task::spawn_blocking(|| ccm_e2e::Assets::tool("helm")).await.expect("join").expect("helm");
    let chart = deploy_dir().join("helm/ccm-rs").display().to_string();
    let values = helm_values(cluster, work.path()).display().to_string();
    install_and_check(
        cluster,
        "helm",
        helm(cluster, &helm_bin, &["install", "ccm-rs", &chart, "--namespace", "kube-system", "--values", &values]),
        helm(cluster, &helm_bin, &["uninstall", "ccm-rs", "--namespace", "kube-system", "--wait"]),
    )
    .await;
}
