//! The health and metrics server as operators scrape it: a given certificate, reloaded when
//! it is rotated, and /metrics authenticated and authorised by delegation to the API server
//! (TokenReview, SubjectAccessReview), the probes always allowed.

use std::path::Path;
use std::time::Duration;

use ccm_harness::cluster::TestEnv;
use ccm_harness::pki::Ca;
use ccm_provider_sim::Config;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::{DeleteParams, PostParams};

use crate::support::{Core, Sim, eventually, free_port};

/// `curl` against the server, trusting only `ca`: (HTTP status, body), or None when the TLS
/// handshake or the connection fails (a certificate `ca` did not sign, for one).
pub(crate) async fn get(port: u16, path: &str, ca: &Path, token: Option<&str>) -> Option<(u16, String)> {
    let url = format!("https://127.0.0.1:{port}{path}");
    let mut cmd = tokio::process::Command::new("curl");
    cmd.args(["-s", "--max-time", "3", "-w", "\n%{http_code}", "--cacert"]).arg(ca).arg(&url);
    if let Some(token) = token {
        cmd.args(["-H", &format!("Authorization: Bearer {token}")]);
    }
    let out = cmd.output().await.ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n')?;
    Some((code.trim().parse().ok()?, body.to_string()))
}

pub(crate) fn write_pair(dir: &Path, ca: &Ca) {
    let pem = ca.serving(&[]).expect("serving certificate");
    // As a Secret volume is updated: both files replaced.
    std::fs::write(dir.join("tls.key.new"), &pem.key).expect("key");
    std::fs::write(dir.join("tls.crt.new"), &pem.cert).expect("cert");
    std::fs::rename(dir.join("tls.key.new"), dir.join("tls.key")).expect("rename");
    std::fs::rename(dir.join("tls.crt.new"), dir.join("tls.crt")).expect("rename");
    std::fs::write(dir.join("ca.crt"), ca.cert_pem()).expect("ca");
}

pub(crate) async fn service_account_token(client: &kube::Client, namespace: &str, name: &str) -> String {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let account = ServiceAccount { metadata: ObjectMeta { name: Some(name.into()), ..Default::default() }, ..Default::default() };
    accounts.create(&PostParams::default(), &account).await.expect("service account");
    let request = TokenRequest {
        spec: Some(TokenRequestSpec { expiration_seconds: Some(3600), ..Default::default() }),
        ..Default::default()
    };
    let answer = accounts.create_token_request(name, &PostParams::default(), &request).await.expect("token");
    answer.status.and_then(|s| s.token).expect("a token")
}

/// The core's flags for the secure port on loopback `port`, serving the pair [`write_pair`]
/// wrote in `dir`, without leader election.
pub(crate) fn secure_port_flags(dir: &Path, port: u16) -> Vec<String> {
    vec![
        "--leader-elect=false".to_string(),
        format!("--secure-port={port}"),
        "--bind-address=127.0.0.1".to_string(),
        format!("--tls-cert-file={}", dir.join("tls.crt").display()),
        format!("--tls-private-key-file={}", dir.join("tls.key").display()),
    ]
}

/// A ClusterRole (and its binding to `account` in `namespace`) allowing `get` on `urls`.
pub(crate) async fn grant_urls(client: &kube::Client, name: &str, namespace: &str, account: &str, urls: &[&str]) {
    let role = ClusterRole {
        metadata: ObjectMeta { name: Some(name.into()), ..Default::default() },
        rules: Some(vec![PolicyRule {
            non_resource_urls: Some(urls.iter().map(|u| u.to_string()).collect()),
            verbs: vec!["get".into()],
            ..Default::default()
        }]),
        ..Default::default()
    };
    let binding = ClusterRoleBinding {
        metadata: ObjectMeta { name: Some(name.into()), ..Default::default() },
        role_ref: RoleRef { api_group: Some("rbac.authorization.k8s.io".into()), kind: "ClusterRole".into(), name: name.into() },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: account.into(),
            namespace: Some(namespace.into()),
            ..Default::default()
        }]),
    };
    Api::<ClusterRole>::all(client.clone()).create(&PostParams::default(), &role).await.expect("role");
    Api::<ClusterRoleBinding>::all(client.clone()).create(&PostParams::default(), &binding).await.expect("binding");
}

pub(crate) async fn revoke(client: &kube::Client, name: &str) {
    let _ = Api::<ClusterRoleBinding>::all(client.clone()).delete(name, &DeleteParams::default()).await;
    let _ = Api::<ClusterRole>::all(client.clone()).delete(name, &DeleteParams::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_served_with_the_given_certificate_reloaded_on_rotation_and_authorised_by_delegation() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "serve").await.expect("env");
    let sim = Sim::start(Config::default()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (first_ca, second_ca) = (Ca::new().expect("ca"), Ca::new().expect("ca"));
    write_pair(dir.path(), &first_ca);
    std::fs::copy(dir.path().join("ca.crt"), dir.path().join("first-ca.crt")).expect("copy");
    let first = dir.path().join("first-ca.crt");

    let port = free_port();
    let mut flags = secure_port_flags(dir.path(), port);
    // The admin may create TokenReviews and SubjectAccessReviews.
    flags.push(format!("--authentication-kubeconfig={}", cp.kubeconfig_path().display()));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let core = Core::start(cp, &env, &sim, &flags);

    // The probes need nothing; the certificate is the given one.
    let (code, body) = eventually("/healthz over the given certificate", Duration::from_secs(20), async || {
        get(port, "/healthz", &first, None).await
    })
    .await;
    assert_eq!((code, body.as_str()), (200, "ok"));
    // /metrics: anonymous is forbidden, a token the API server does not know is unauthorised.
    let (code, body) = get(port, "/metrics", &first, None).await.expect("answer");
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("system:anonymous"), "{body}");
    assert_eq!(get(port, "/metrics", &first, Some("not-a-token")).await.map(|a| a.0), Some(401));

    // A ServiceAccount: forbidden until granted `get` on the non-resource URL /metrics.
    let account = format!("{}-scraper", env.prefix);
    let token = service_account_token(&env.client, &env.namespace, &account).await;
    let (code, body) = get(port, "/metrics", &first, Some(&token)).await.expect("answer");
    assert_eq!(code, 403, "{body}");
    assert!(body.contains(&format!("system:serviceaccount:{}:{account}", env.namespace)), "{body}");
    grant_urls(&env.client, &account, &env.namespace, &account, &["/metrics"]).await;
    // Decisions are cached for 10 s, as upstream's.
    let body = eventually("/metrics once granted", Duration::from_secs(20), async || {
        let (code, body) = get(port, "/metrics", &first, Some(&token)).await?;
        (code == 200).then_some(body)
    })
    .await;
    assert!(body.contains("ccm_"), "the core's metrics: {}", &body[..body.len().min(200)]);

    // Rotation: a certificate of another CA replaces the files; the server takes it up.
    write_pair(dir.path(), &second_ca);
    let second = dir.path().join("ca.crt");
    let took = std::time::Instant::now();
    eventually("the rotated certificate", Duration::from_secs(15), async || get(port, "/healthz", &second, None).await).await;
    eprintln!("rotated certificate served after {:.1} s", took.elapsed().as_secs_f64());
    assert!(get(port, "/healthz", &first, None).await.is_none(), "the old certificate is no longer served");

    // A half-written file keeps the last good certificate.
    std::fs::write(dir.path().join("tls.crt"), "-----BEGIN CERTIFICATE-----\ngarbage\n").expect("write");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(get(port, "/healthz", &second, None).await.is_some(), "a broken file does not take the server down");

    core.stop().await.expect("stop");
    revoke(&env.client, &account).await;
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstreams_metric_names_are_served_beside_ours() {
    use ccm_harness::cluster::{NodeBuilder, create_load_balancer_service};
    use ccm_provider_sim::Config;

    use crate::support::{Core, Sim, TEST_LABEL, eventually, free_port, http_get, instance};

    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "upmetrics").await.expect("env");
    let name = env.node_name("a");
    let mut config = Config::default();
    config.instances.push(instance("i-a", &name, "sim-region-1a"));
    let sim = Sim::start(config).await;
    NodeBuilder::new(&name)
        .uninitialized()
        .label(TEST_LABEL, &env.prefix)
        .pod_cidr("10.251.1.0/24")
        .create(&env.client)
        .await
        .expect("node");
    let port = free_port();
    let cluster = format!("--cluster-name={}", env.prefix);
    let flags = [
        format!("--secure-port={port}"),
        "--insecure-serving".into(),
        "--bind-address=127.0.0.1".into(),
        "--cluster-cidr=10.251.0.0/16".into(),
        cluster,
    ];
    let core = Core::start(cp, &env, &sim, &flags.iter().map(String::as_str).collect::<Vec<_>>());
    create_load_balancer_service(&env, "web", &[80]).await.expect("service");
    let base = format!("http://127.0.0.1:{port}");
    // As an upstream dashboard queries them (series that must exist once the cluster did work).
    let wanted = [
        "workqueue_depth{name=\"service\"}",
        "workqueue_adds_total{name=\"service\"}",
        "workqueue_work_duration_seconds_count{name=\"service\"}",
        "workqueue_queue_duration_seconds_count{name=\"service\"}",
        "workqueue_unfinished_work_seconds{name=\"service\"}",
        "workqueue_longest_running_processor_seconds{name=\"service\"}",
        // Upstream's queue names (k8s.io/cloud-provider: "Nodes", "Routes", "service").
        "workqueue_adds_total{name=\"Nodes\"}",
        "workqueue_adds_total{name=\"Routes\"}",
        "leader_election_master_status{name=",
        "running_managed_controllers{name=\"service-lb-controller\",manager=\"cloud-controller-manager\"} 1",
        "service_controller_loadbalancer_sync_total",
        "route_controller_route_sync_total",
        "node_controller_cloud_provider_taint_removal_delay_seconds_count 1",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "rest_client_requests_total{code=\"200\",host=",
        "rest_client_request_duration_seconds_count{host=",
        "rest_client_rate_limiter_duration_seconds_count{host=",
    ];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let text = loop {
        let text = http_get(&base, "/metrics").await.map(|(_, t)| t).unwrap_or_default();
        let missing: Vec<&&str> = wanted.iter().filter(|w| !text.contains(**w)).collect();
        if missing.is_empty() {
            break text;
        }
        assert!(tokio::time::Instant::now() < deadline, "upstream's series missing after 30 s: {missing:?}\n{text}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(text.contains("ccm_provider_calls_total"), "ours are still there");
    // An upstream dashboard's queries find their series.
    let dashboard = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/data/controller-manager-dashboard.promql"))
        .expect("dashboard queries");
    let queries: Vec<&str> = dashboard.lines().filter(|l| !l.trim().is_empty() && !l.starts_with('#')).collect();
    assert!(queries.len() >= 9);
    let text = eventually("every dashboard query answered", Duration::from_secs(30), async || {
        let (_, text) = http_get(&base, "/metrics").await?;
        queries.iter().all(|q| answers(&text, q)).then_some(text)
    })
    .await;
    for q in &queries {
        assert!(answers(&text, q), "no series for {q}");
    }
    // Events carry upstream's components: `kubectl get events --field-selector
    // source=cloud-node-controller` (or service-controller) finds them.
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::all(env.client.clone());
    for (source, object) in [("cloud-node-controller", name.as_str()), ("service-controller", "web")] {
        let selector = format!("source={source},involvedObject.name={object}");
        eventually(&format!("an Event from {source}"), Duration::from_secs(30), async || {
            let list = events.list(&kube::api::ListParams::default().fields(&selector)).await.ok()?;
            list.items.into_iter().find(|e| e.reporting_component.as_deref() == Some(source))
        })
        .await;
    }
    core.stop().await.expect("core stops");
    env.cleanup().await.expect("cleanup");
}

/// Whether a scrape has a series for every metric a PromQL query selects, with the query's
/// label matchers (`l="v"`, and `l=~"N.."` status classes).
fn answers(scrape: &str, query: &str) -> bool {
    let mut rest = query;
    let mut selectors = Vec::new();
    while let Some(start) = rest.find(|c: char| c.is_ascii_lowercase()) {
        let tail = &rest[start..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        let name = &tail[..end];
        let after = &tail[end..];
        let (matchers, next) = match after.strip_prefix('{') {
            Some(inner) => {
                let close = inner.find('}').unwrap_or(inner.len());
                (inner[..close].to_string(), &inner[close..])
            }
            None => (String::new(), after),
        };
        // Metric names are what has a selector or a range after it, or stands alone.
        if name.contains('_') && (after.starts_with('{') || after.starts_with('[') || query.trim() == name) {
            selectors.push((name.to_string(), matchers));
        }
        rest = next;
    }
    !selectors.is_empty()
        && selectors.iter().all(|(name, matchers)| {
            scrape.lines().filter(|l| !l.starts_with('#')).any(|line| {
                let series = line.split(' ').next().unwrap_or_default();
                let (metric, labels) = series.split_once('{').unwrap_or((series, ""));
                metric == name
                    && matchers.split(',').map(str::trim).filter(|m| !m.is_empty()).all(|m| {
                        if let Some((label, value)) = m.split_once("=~") {
                            let class = value.trim_matches('"').trim_end_matches('.');
                            labels.contains(&format!("{label}=\"{class}"))
                        } else if let Some((label, value)) = m.split_once('=') {
                            labels.contains(&format!("{label}={value}"))
                        } else {
                            false
                        }
                    })
            })
        })
}

/// Started with `--kubeconfig` (as static-pod manifests start it), the secure port and no
/// delegation kubeconfig, outside a cluster: nothing can check a caller, so only the probes
/// answer; /metrics is forbidden with or without a token, never open (issue 54).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_kubeconfig_and_nothing_to_check_callers_with_metrics_are_closed_and_probes_open() {
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "closed").await.expect("env");
    let sim = Sim::start(Config::default()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new().expect("ca");
    write_pair(dir.path(), &ca);
    let port = free_port();
    let flags = secure_port_flags(dir.path(), port);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    // Core::start passes --kubeconfig; the test process is not in a cluster.
    assert!(std::env::var_os("KUBERNETES_SERVICE_HOST").is_none(), "run outside a cluster");
    let core = Core::start(cp, &env, &sim, &flags);
    let ca_file = dir.path().join("ca.crt");
    let (code, body) =
        eventually("/healthz", Duration::from_secs(20), async || get(port, "/healthz", &ca_file, None).await).await;
    assert_eq!((code, body.as_str()), (200, "ok"));
    let (code, body) = get(port, "/metrics", &ca_file, None).await.expect("answer");
    assert_eq!(code, 403, "anonymous /metrics: {body}");
    assert!(!body.contains("ccm_"), "no metric leaked: {body}");
    let token = service_account_token(&env.client, &env.namespace, &format!("{}-scraper", env.prefix)).await;
    let (code, body) = get(port, "/metrics", &ca_file, Some(&token)).await.expect("answer");
    assert_eq!(code, 403, "a token nobody can check: {body}");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}
