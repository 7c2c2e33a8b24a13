//! What separates the core from its providers, run as an operator deploys it (issue 54): a
//! provider's metrics only through the core's checked port, its socket served by its own user
//! or refused, and a Kubernetes token of the provider's own ServiceAccount handed over by the
//! core (none of the core's).

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use ccm_harness::cluster::TestEnv;
use ccm_harness::pki::Ca;
use ccm_provider_sim::Config;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::PostParams;

use crate::serving::{get, grant_urls, revoke, secure_port_flags, service_account_token, write_pair};
use crate::support::{Core, Sim, eventually, free_port, http_get};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_providers_metrics_are_served_behind_the_cores_checks_and_its_socket_only_by_its_own_user() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "isolate").await.expect("env");
    let sim = Sim::start(Config::default()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new().expect("ca");
    write_pair(dir.path(), &ca);
    let ca_file = dir.path().join("ca.crt");
    // The user serving the sim's socket: this process's (the owner of what it creates).
    let uid = std::fs::metadata(sim.metrics_socket()).expect("the sim's metrics socket").uid();
    let port = free_port();
    let mut flags = secure_port_flags(dir.path(), port);
    flags.extend([
        format!("--authentication-kubeconfig={}", cp.kubeconfig_path().display()),
        format!("--provider-metrics=unix://{}", sim.metrics_socket().display()),
        format!("--provider-peer-uid={uid}"),
    ]);
    let core = Core::start(cp, &env, &sim, &flags.iter().map(String::as_str).collect::<Vec<_>>());
    eventually("the core ready with its provider", Duration::from_secs(30), async || {
        get(port, "/readyz", &ca_file, None).await.filter(|(code, _)| *code == 200)
    })
    .await;

    // Anonymous, and a token without the right: refused, nothing of the provider's leaks.
    let (code, body) = get(port, "/metrics/providers/default", &ca_file, None).await.expect("answer");
    assert_eq!(code, 403, "{body}");
    assert!(!body.contains("cloudprovider_server"), "{body}");
    let account = format!("{}-scraper", env.prefix);
    let token = service_account_token(&env.client, &env.namespace, &account).await;
    let (code, body) = get(port, "/metrics/providers/default", &ca_file, Some(&token)).await.expect("answer");
    assert_eq!(code, 403, "{body}");
    // The right to the core's /metrics alone is not the right to the provider's.
    grant_urls(&env.client, &account, &env.namespace, &account, &["/metrics"]).await;
    eventually("/metrics granted", Duration::from_secs(20), async || {
        get(port, "/metrics", &ca_file, Some(&token)).await.filter(|(code, _)| *code == 200)
    })
    .await;
    let (code, _) = get(port, "/metrics/providers/default", &ca_file, Some(&token)).await.expect("answer");
    assert_eq!(code, 403, "/metrics/providers/default needs its own grant");
    revoke(&env.client, &account).await;
    grant_urls(&env.client, &account, &env.namespace, &account, &["/metrics", "/metrics/providers/*"]).await;
    let body = eventually("the provider's metrics once granted", Duration::from_secs(20), async || {
        get(port, "/metrics/providers/default", &ca_file, Some(&token)).await.filter(|(code, _)| *code == 200).map(|(_, b)| b)
    })
    .await;
    assert!(body.contains("cloudprovider_server_calls_total"), "the sim's own metrics: {}", &body[..body.len().min(300)]);
    let (code, body) = get(port, "/metrics/providers/other", &ca_file, Some(&token)).await.expect("answer");
    assert_eq!(code, 404, "{body}");
    core.stop().await.expect("stop");

    // A core told that another user serves the provider: it refuses this socket, never ready,
    // and says why.
    let port = free_port();
    let flags = [
        "--leader-elect=false".to_string(),
        format!("--secure-port={port}"),
        "--insecure-serving".to_string(),
        "--bind-address=127.0.0.1".to_string(),
        format!("--provider-peer-uid={}", uid + 1),
    ];
    let impostor = Core::start(cp, &env, &sim, &flags.iter().map(String::as_str).collect::<Vec<_>>());
    let health = format!("http://127.0.0.1:{port}");
    let readyz = async || http_get(&health, "/readyz").await;
    let body = eventually("the refusal, with its reason, in /readyz", Duration::from_secs(30), async || {
        readyz().await.filter(|(_, body)| body.contains("--provider-peer-uid")).map(|(_, body)| body)
    })
    .await;
    assert!(body.contains(&format!("runs as user {uid}, not {}", uid + 1)), "{body}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(readyz().await.map(|a| a.0), Some(503), "never ready on a socket of another user");
    impostor.stop().await.expect("stop");

    revoke(&env.client, &account).await;
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_core_hands_the_provider_a_token_of_the_providers_own_account() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "handover").await.expect("env");
    let sim = Sim::start(Config::default()).await;
    let account = format!("{}-provider", env.prefix);
    let accounts: Api<ServiceAccount> = Api::namespaced(env.client.clone(), &env.namespace);
    let sa = ServiceAccount { metadata: ObjectMeta { name: Some(account.clone()), ..Default::default() }, ..Default::default() };
    accounts.create(&PostParams::default(), &sa).await.expect("service account");
    let dir = tempfile::tempdir().expect("tempdir");
    let flags =
        ["--leader-elect=false".to_string(), format!("--provider-token={}/{account}={}", env.namespace, dir.path().display())];
    let core = Core::start(cp, &env, &sim, &flags.iter().map(String::as_str).collect::<Vec<_>>());
    let token = eventually("the token written", Duration::from_secs(30), async || {
        std::fs::read_to_string(dir.path().join("token")).ok().filter(|t| !t.is_empty())
    })
    .await;
    // The files an in-cluster client reads, readable by the volume's group, not by others.
    assert_eq!(std::fs::read_to_string(dir.path().join("namespace")).expect("namespace"), env.namespace);
    let ca = std::fs::read_to_string(dir.path().join("ca.crt")).expect("ca.crt");
    let kubeconfig = kube::config::Kubeconfig::read_from(cp.kubeconfig_path()).expect("kubeconfig");
    let cluster = kubeconfig.clusters.first().and_then(|c| c.cluster.clone()).expect("cluster");
    let want = match (cluster.certificate_authority_data, cluster.certificate_authority) {
        (Some(data), _) => {
            String::from_utf8(base64::Engine::decode(&base64::engine::general_purpose::STANDARD, data).expect("base64"))
                .expect("pem")
        }
        (None, Some(path)) => std::fs::read_to_string(path).expect("ca file"),
        (None, None) => panic!("the test kubeconfig names no CA"),
    };
    let squash = |s: &str| s.split_whitespace().collect::<String>();
    assert_eq!(squash(&ca), squash(&want), "ca.crt is the API server's CA");
    for file in ["token", "ca.crt", "namespace"] {
        let mode = std::fs::metadata(dir.path().join(file)).expect("file").mode() & 0o777;
        assert_eq!(mode, 0o640, "{file}");
    }
    // The API server knows it as the provider's own account, not the core's.
    let review = TokenReview { spec: TokenReviewSpec { token, ..Default::default() }, ..Default::default() };
    let reviewed = Api::<TokenReview>::all(env.client.clone()).create(&PostParams::default(), &review).await.expect("review");
    let status = reviewed.status.expect("status");
    assert_eq!(status.authenticated, Some(true), "{status:?}");
    let user = status.user.and_then(|u| u.username).unwrap_or_default();
    assert_eq!(user, format!("system:serviceaccount:{}:{account}", env.namespace));
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}
