//! What the harness promises later tests: restricted identities, kubectl, Services.

use ccm_e2e::cluster::{TestEnv, create_load_balancer_service};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restricted_identity_has_only_what_it_is_granted() {
    let cp = ccm_e2e::shared().expect("control plane");
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
    let cp = ccm_e2e::shared().expect("control plane");
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
    let cp = tokio::task::spawn_blocking(ccm_e2e::ControlPlane::start).await.expect("join").expect("start");
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
