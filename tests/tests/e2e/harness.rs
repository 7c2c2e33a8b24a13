//! What the harness promises later tests: restricted identities, kubectl, Services.

use ccm_harness::cluster::{TestEnv, create_load_balancer_service};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restricted_identity_has_only_what_it_is_granted() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "rbac").await.expect("env");
    let user = format!("{}-reader", env.prefix);
    let restricted = cp.client_as(&user, None).await.expect("restricted client");
    let nodes: Api<Node> = Api::all(restricted.clone());

    let denied = nodes.list(&ListParams::default()).await.expect_err("no permission yet");
    assert!(matches!(&denied, kube::Error::Api(s) if s.code == 403), "{denied:?}");

    let role = ClusterRole {
        metadata: ObjectMeta { name: Some(user.clone()), ..Default::default() },
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["nodes".into()]),
            verbs: vec!["list".into()],
            ..Default::default()
        }]),
        ..Default::default()
    };
    let binding = ClusterRoleBinding {
        metadata: ObjectMeta { name: Some(user.clone()), ..Default::default() },
        role_ref: RoleRef { api_group: Some("rbac.authorization.k8s.io".into()), kind: "ClusterRole".into(), name: user.clone() },
        subjects: Some(vec![Subject {
            kind: "User".into(),
            name: user.clone(),
            api_group: Some("rbac.authorization.k8s.io".into()),
            ..Default::default()
        }]),
    };
    Api::<ClusterRole>::all(env.client.clone()).create(&PostParams::default(), &role).await.expect("role");
    Api::<ClusterRoleBinding>::all(env.client.clone()).create(&PostParams::default(), &binding).await.expect("binding");

    // RBAC changes reach the authorizer through its own informer: allow a moment.
    let mut allowed = false;
    for _ in 0..50 {
        if nodes.list(&ListParams::default()).await.is_ok() {
            allowed = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(allowed, "list nodes stays forbidden after the binding");
    // Listing is all it got.
    let err = nodes.delete("anything", &DeleteParams::default()).await.expect_err("delete is not granted");
    assert!(matches!(&err, kube::Error::Api(s) if s.code == 403), "{err:?}");

    let _ = Api::<ClusterRoleBinding>::all(env.client.clone()).delete(&user, &DeleteParams::default()).await;
    let _ = Api::<ClusterRole>::all(env.client.clone()).delete(&user, &DeleteParams::default()).await;
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_get_cluster_ips_and_kubectl_sees_them() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "svc").await.expect("env");
    let svc = create_load_balancer_service(&env, "web", &[80, 443]).await.expect("service");
    let spec = svc.spec.expect("spec");
    assert_eq!(spec.type_.as_deref(), Some("LoadBalancer"));
    assert!(spec.cluster_ip.is_some_and(|ip| ip.starts_with("10.96.")), "a ClusterIP from the service range");
    assert!(spec.ports.unwrap_or_default().iter().all(|p| p.node_port.is_some()), "node ports are allocated");

    let out = cp.kubectl(&["get", "services", "-n", &env.namespace, "-o", "name"]).output().expect("kubectl");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "service/web");
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owned_control_plane_stops_everything_when_dropped() {
    let cp = tokio::task::spawn_blocking(ccm_harness::ControlPlane::start).await.expect("join").expect("start");
    eprintln!("control plane start-up: {:?}", cp.startup);
    let client = cp.client().await.expect("client");
    let version = client.apiserver_version().await.expect("version");
    assert!(version.git_version.starts_with("v1.") && version.major == "1", "the release is stamped into the build: {version:?}");
    let (pids, dir) = (cp.pids(), cp.dir().to_path_buf());
    drop(client);
    drop(cp);
    for pid in pids {
        let alive = std::process::Command::new("kill")
            .args(["-0", &pid.to_string()])
            .stderr(std::process::Stdio::null())
            .status()
            .expect("kill -0")
            .success();
        assert!(!alive, "process {pid} outlived its control plane");
    }
    assert!(!dir.exists(), "{} outlived its control plane", dir.display());
}

/// What of kubelet cluster `id` (bridge subnet `subnet`, like `10.250.7.`) is on the host:
/// processes, links, routes and cgroups naming it; and the mount count and the host's
/// iptables rules, which no cluster may change.
fn host_footprint(id: &str, subnet: &str) -> (Vec<String>, usize, String) {
    let sh = |script: &str| {
        let out = std::process::Command::new("sh").args(["-c", script]).output().expect("sh");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let mut found: Vec<String> =
        sh("ps -eo pid,args").lines().filter(|l| l.contains(&format!("ccm-e2e-cluster-{id}/"))).map(str::to_string).collect();
    found.extend(sh("ip -o link").lines().filter(|l| l.contains(&format!("ccm{id}"))).map(str::to_string));
    found.extend(sh("ip route").lines().filter(|l| l.contains(subnet)).map(str::to_string));
    found.extend(sh(&format!("ls -d /sys/fs/cgroup/*/ccm-e2e-{id}-* 2>/dev/null")).lines().map(str::to_string));
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo").lines().count();
    (found, mounts, sh("iptables-save 2>/dev/null | grep -v '^#'"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_cluster_registers_tainted_nodes_and_leaves_nothing_behind() {
    if let Err(why) = ccm_harness::kubelet_cluster::check_machine() {
        assert!(std::env::var_os(ccm_harness::kubelet_cluster::REQUIRE).is_none(), "{why}");
        eprintln!("skipped: {why}");
        return;
    }
    let (_, mounts_before, iptables_before) = host_footprint("-", "-");
    let mut cluster = tokio::task::spawn_blocking(|| ccm_harness::kubelet_cluster::KubeletCluster::start(2, "tear", &[]))
        .await
        .expect("join")
        .expect("kubelet cluster");
    eprintln!("kubelet cluster of 2 nodes Ready in {:.1} s", cluster.startup.as_secs_f64());
    let client = cluster.client().await.expect("client");
    let nodes = Api::<Node>::all(client).list(&ListParams::default()).await.expect("nodes").items;
    assert_eq!(nodes.len(), 2);
    for node in &nodes {
        let taints = node.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default();
        assert!(taints.iter().any(|t| t.key == ccm_harness::cluster::UNINITIALIZED_TAINT), "{taints:?}");
        let addresses = node.status.as_ref().and_then(|s| s.addresses.clone()).unwrap_or_default();
        let ip = &cluster.nodes.iter().find(|n| Some(&n.name) == node.metadata.name.as_ref()).expect("ours").ip;
        assert!(addresses.iter().any(|a| a.type_ == "InternalIP" && a.address == ip.to_string()), "{addresses:?}");
        assert!(node.spec.as_ref().and_then(|s| s.pod_cidr.as_ref()).is_some(), "kube-controller-manager allocates podCIDRs");
    }
    let id = cluster.id();
    let [a, b, c, _] = cluster.gateway.octets();
    let subnet = format!("{a}.{b}.{c}.");
    let (during, ..) = host_footprint(&id, &subnet);
    assert!(during.iter().any(|l| l.contains("kubelet")), "the cluster's kubelets run: {during:#?}");
    assert!(during.iter().any(|l| l.contains("/sys/fs/cgroup/")), "in cgroups of their own: {during:#?}");
    tokio::task::spawn_blocking(move || cluster.stop()).await.expect("join");
    let (after, mounts_after, iptables_after) = host_footprint(&id, &subnet);
    assert!(after.is_empty(), "no process, link, route or cgroup of the cluster is left: {after:#?}");
    assert_eq!(mounts_after, mounts_before, "no mount is left on the host");
    assert_eq!(iptables_after, iptables_before, "the host's iptables rules are untouched");
}
