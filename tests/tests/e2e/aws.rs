//! The real AWS provider (k8s.io/cloud-provider-aws, unchanged, behind the go-adapter as
//! `ccm-provider-aws`) driven by our core against moto, an AWS emulator nobody here wrote.
//! Assertions are on moto's state (through the fixture's query channel), not only on
//! Kubernetes.

use std::path::PathBuf;
use std::time::Duration;

use ccm_harness::assets::Assets;
use ccm_harness::aws::{Moto, Sidecar};
use ccm_harness::cluster::{NodeBuilder, TestEnv, set_ready};
use ccm_harness::machine;
use k8s_openapi::api::core::v1::Node;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use serde_json::Value;

use crate::support::{Core, TEST_LABEL, eventually};

/// Set in CI: a missing tool (python3, Go) fails the test instead of skipping it.
pub(crate) const REQUIRE: &str = "CCM_E2E_REQUIRE_AWS";

/// The fixture's instances as (id, private DNS name, private IP).
fn instances(moto: &Moto) -> Vec<(String, String, String)> {
    moto.instances().into_iter().map(|i| (i.id, i.private_dns, i.private_ip)).collect()
}

fn tools() -> Option<(PathBuf, PathBuf)> {
    // What the machine lacks is found before anything is installed or built for it.
    let machine = machine::python_venv().and_then(|()| machine::require("ccm-provider-aws", &[("go", "go.dev/dl")]));
    let found = machine
        .map_err(anyhow::Error::from)
        .and_then(|()| Assets::tool("moto"))
        .and_then(|python| Ok((python, Assets::tool("aws")?)));
    match found {
        Ok(t) => Some(t),
        Err(e) if std::env::var_os(REQUIRE).is_some() => panic!("{REQUIRE} is set and the AWS tools are missing: {e:#}"),
        Err(e) => {
            eprintln!("skipped: the AWS provider tests need python3 (moto) and Go (ccm-provider-aws): {e:#}");
            None
        }
    }
}

/// The instances registered with the first ELB once they are `want` (or after 60 s).
async fn elb_instances_until(moto: &mut Moto, want: &[String]) -> Vec<String> {
    let mut now = Vec::new();
    for _ in 0..120 {
        let elbs = moto.query("elbs").await.expect("moto");
        now = elbs.as_array().and_then(|l| l.first()).map(|lb| strings(lb, "instances")).unwrap_or_default();
        if now == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    now
}

fn strings(v: &Value, key: &str) -> Vec<String> {
    v[key].as_array().cloned().unwrap_or_default().iter().filter_map(|v| v.as_str().map(String::from)).collect()
}

/// The security group in a `groups` answer whose `key` is `value`.
fn group(groups: &Value, key: &str, value: &str) -> Option<Value> {
    groups.as_array()?.iter().find(|g| g[key].as_str() == Some(value)).cloned()
}

fn label(node: &Node, key: &str) -> Option<String> {
    node.metadata.labels.as_ref()?.get(key).cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_aws_provider_on_moto_initialises_nodes_routes_pods_and_balances_services() {
    let Some((python, binary)) = tools() else { return };
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "aws").await.expect("env");
    let cluster = env.prefix.clone();
    let mut moto = Moto::start(&python, &cluster, 4, 1).await.expect("moto");
    let dir = tempfile::tempdir().expect("tempdir");
    let sidecar = Sidecar::aws(&binary, dir.path(), &moto, &cluster, cp.kubeconfig_path()).await.expect("ccm-provider-aws");
    // Three Nodes join at first; the fourth instance's Node is added later.
    let mut instances = instances(&moto);
    let late = instances.pop().expect("a fourth instance");
    for (k, (_, dns, _)) in instances.iter().enumerate() {
        NodeBuilder::new(dns)
            .label(TEST_LABEL, &env.prefix)
            .uninitialized()
            .pod_cidr(&format!("10.244.{}.0/24", k + 1))
            .address("Hostname", dns)
            .create(&env.client)
            .await
            .expect("node");
    }
    let cluster_flag = format!("--cluster-name={cluster}");
    let core = Core::start_on(
        cp.kubeconfig_path(),
        &env,
        &sidecar.endpoint,
        &["--leader-elect=false", &cluster_flag, "--cluster-cidr=10.244.0.0/16", "--provider-call-timeout=30s"],
    );

    // Nodes: initialised from moto.
    for (id, dns, ip) in &instances {
        let node = eventually("a node initialised from moto", Duration::from_secs(90), async || {
            let n = env.nodes().get(dns).await.ok()?;
            let tainted = n.spec.as_ref()?.taints.as_ref().is_some_and(|t| t.iter().any(|t| t.key.ends_with("uninitialized")));
            (!tainted).then_some(n)
        })
        .await;
        assert_eq!(node.spec.as_ref().and_then(|s| s.provider_id.clone()), Some(format!("aws:///us-east-1a/{id}")));
        assert_eq!(label(&node, "topology.kubernetes.io/zone").as_deref(), Some("us-east-1a"));
        assert_eq!(label(&node, "topology.kubernetes.io/region").as_deref(), Some("us-east-1"));
        assert_eq!(label(&node, "node.kubernetes.io/instance-type").as_deref(), Some("m5.large"));
        let addresses = node.status.and_then(|s| s.addresses).unwrap_or_default();
        assert!(addresses.iter().any(|a| a.type_ == "InternalIP" && &a.address == ip), "{addresses:?}");
    }

    // Routes: each podCIDR in moto's route table, to its instance.
    let want: Vec<(String, String)> =
        instances.iter().enumerate().map(|(k, (id, _, _))| (format!("10.244.{}.0/24", k + 1), id.clone())).collect();
    let mut last = Value::Null;
    for _ in 0..120 {
        last = moto.query("routes").await.expect("moto");
        let have: Vec<(String, String)> = last
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|r| {
                (
                    r["destination"].as_str().unwrap_or_default().to_string(),
                    r["instance"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect();
        if want.iter().all(|w| have.contains(w)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for w in &want {
        assert!(
            last.to_string().contains(&w.0) && last.to_string().contains(&w.1),
            "route {w:?} in moto: {last}\n{}",
            sidecar.log_text()
        );
    }

    // A classic ELB for a LoadBalancer Service, with every instance registered.
    let ids: Vec<String> = instances.iter().map(|(id, _, _)| id.clone()).collect();
    let groups_before = moto.query("groups").await.expect("moto");
    ccm_harness::cluster::create_load_balancer_service(&env, "web", &[80]).await.expect("service");
    let hostname = eventually("the ELB's hostname in the Service", Duration::from_secs(90), async || {
        let svc = env.services().get("web").await.ok()?;
        svc.status?.load_balancer?.ingress?.first()?.hostname.clone()
    })
    .await;
    let elbs = moto.query("elbs").await.expect("moto");
    let elb = elbs.as_array().and_then(|l| l.first()).cloned().unwrap_or_else(|| panic!("no ELB in moto: {elbs}"));
    assert_eq!(elb["dns"].as_str(), Some(hostname.as_str()));
    let registered = strings;
    let mut sorted = ids.clone();
    sorted.sort();
    assert_eq!(registered(&elb, "instances"), sorted);
    // The ELB's own security group, admitted to the nodes' group.
    let groups = moto.query("groups").await.expect("moto");
    let elb_group = format!("k8s-elb-{}", elb["name"].as_str().unwrap_or_default());
    let elb_group = group(&groups, "name", &elb_group).unwrap_or_else(|| panic!("no {elb_group} in moto: {groups}"));
    let node_group = group(&groups, "id", &moto.get("security_group")).expect("the nodes' group");
    assert!(node_group["ingress"].to_string().contains(elb_group["id"].as_str().unwrap_or("-")), "{groups}");

    // A Node excluded from load balancers is deregistered.
    let patch =
        serde_json::json!({ "metadata": { "labels": { "node.kubernetes.io/exclude-from-external-load-balancers": "true" } } });
    env.nodes().patch(&instances[0].1, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("exclude");
    let mut remaining = sorted.clone();
    remaining.retain(|id| *id != instances[0].0);
    let now = elb_instances_until(&mut moto, &remaining).await;
    assert_eq!(now, remaining, "the excluded node's instance deregistered");

    // A Node added is registered once initialised.
    NodeBuilder::new(&late.1)
        .label(TEST_LABEL, &env.prefix)
        .uninitialized()
        .pod_cidr("10.244.4.0/24")
        .address("Hostname", &late.1)
        .create(&env.client)
        .await
        .expect("the added node");
    remaining.push(late.0.clone());
    remaining.sort();
    let now = elb_instances_until(&mut moto, &remaining).await;
    assert_eq!(now, remaining, "the added node's instance registered");

    // The NLB annotation gives a network load balancer with the instances as targets.
    let mut nlb = ccm_harness::cluster::load_balancer_service(&env.namespace, "fast", &[443]);
    nlb.metadata.annotations =
        Some([("service.beta.kubernetes.io/aws-load-balancer-type".to_string(), "nlb".to_string())].into());
    env.services().create(&PostParams::default(), &nlb).await.expect("nlb service");
    let nlb_host = eventually("the NLB's hostname", Duration::from_secs(90), async || {
        let svc = env.services().get("fast").await.ok()?;
        svc.status?.load_balancer?.ingress?.first()?.hostname.clone()
    })
    .await;
    let nlbs = moto.query("nlbs").await.expect("moto");
    let found = nlbs.as_array().and_then(|l| l.iter().find(|n| n["dns"].as_str() == Some(nlb_host.as_str())).cloned());
    let found = found.unwrap_or_else(|| panic!("no NLB {nlb_host} in moto: {nlbs}"));
    assert_eq!(found["type"].as_str(), Some("network"));
    assert_eq!(registered(&found, "targets"), remaining);
    // The NLB keeps no group of its own: clients reach the nodes' group on the node port.
    let svc = env.services().get("fast").await.expect("the NLB service");
    let node_port = svc.spec.and_then(|s| s.ports).and_then(|p| p.first().and_then(|p| p.node_port)).expect("a node port");
    let groups = moto.query("groups").await.expect("moto");
    let node_group = group(&groups, "id", &moto.get("security_group")).expect("the nodes' group");
    let rules = node_group["ingress"].as_array().cloned().unwrap_or_default();
    assert!(rules.iter().any(|r| r["from"].as_i64() == Some(i64::from(node_port))), "node port {node_port} open: {groups}");

    // Deleting the Services deletes their load balancers.
    for name in ["web", "fast"] {
        env.services().delete(name, &DeleteParams::default()).await.expect("delete");
    }
    for _ in 0..120 {
        let (elbs, nlbs) = (moto.query("elbs").await.expect("moto"), moto.query("nlbs").await.expect("moto"));
        if elbs.as_array().is_some_and(Vec::is_empty) && nlbs.as_array().is_some_and(Vec::is_empty) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(moto.query("elbs").await.expect("moto"), serde_json::json!([]), "the ELB deleted");
    assert_eq!(moto.query("nlbs").await.expect("moto"), serde_json::json!([]), "the NLB deleted");
    // And their security groups and the rules they added to the nodes' group.
    let mut groups = Value::Null;
    for _ in 0..120 {
        groups = moto.query("groups").await.expect("moto");
        if groups == groups_before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(groups, groups_before, "security groups and rules as before the load balancers");

    // A stopped instance's NotReady Node gets the shutdown taint; a terminated one's is deleted
    // (the other two Nodes are Ready, as their kubelets would say: every Node NotReady at once
    // would be an outage, when nothing is deleted).
    for (_, dns, _) in [&instances[0], &late] {
        set_ready(&env.client, dns, "True").await.expect("ready");
    }
    let (stopped, gone) = (&instances[1], &instances[2]);
    for (_, dns, _) in [stopped, gone] {
        set_ready(&env.client, dns, "False").await.expect("not ready");
    }
    moto.query(&format!("stop {}", stopped.0)).await.expect("moto");
    eventually("the shutdown taint", Duration::from_secs(60), async || {
        let n = env.nodes().get(&stopped.1).await.ok()?;
        n.spec?.taints?.iter().any(|t| t.key == "node.cloudprovider.kubernetes.io/shutdown").then_some(())
    })
    .await;
    moto.query(&format!("terminate {}", gone.0)).await.expect("moto");
    eventually("the terminated instance's node deleted", Duration::from_secs(60), async || {
        env.nodes().get_opt(&gone.1).await.ok()?.is_none().then_some(())
    })
    .await;

    core.stop().await.expect("stop");
    for (_, dns, _) in instances.iter().chain([&late]) {
        let _ = env.nodes().delete(dns, &DeleteParams::default()).await;
    }
    env.cleanup().await.expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_conformance_suite_passes_against_the_aws_provider_on_moto() {
    use ccm_provider_sdk::conformance::Options;
    let Some((python, binary)) = tools() else { return };
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "aws-conf").await.expect("env");
    let cluster = env.prefix.clone();
    let moto = Moto::start(&python, &cluster, 3, 2).await.expect("moto");
    let dir = tempfile::tempdir().expect("tempdir");
    // The provider maps route targets to Nodes with its Node informer: the instances need
    // their Nodes, as in a cluster.
    for (id, dns, _) in instances(&moto) {
        NodeBuilder::new(&dns)
            .label(TEST_LABEL, &env.prefix)
            .provider_id(&format!("aws:///us-east-1a/{id}"))
            .create(&env.client)
            .await
            .expect("node");
    }
    let sidecar = Sidecar::aws(&binary, dir.path(), &moto, &cluster, cp.kubeconfig_path()).await.expect("ccm-provider-aws");
    let mut options = Options::new(sidecar.endpoint.clone());
    options.call_timeout = Duration::from_secs(30);
    options.instances = instances(&moto).into_iter().map(|(_, dns, _)| dns).collect();
    assert_conformant(&options, &sidecar, 45).await;
    for (_, dns, _) in instances(&moto) {
        let _ = env.nodes().delete(&dns, &DeleteParams::default()).await;
    }
    env.cleanup().await.expect("cleanup");
}

/// Runs the conformance suite against `sidecar` and asserts that no check fails, that every
/// skipped check says why and that at least `passes` checks pass.
pub(crate) async fn assert_conformant(options: &ccm_provider_sdk::conformance::Options, sidecar: &Sidecar, passes: usize) {
    use ccm_provider_sdk::conformance::{self, Outcome};
    let report = conformance::run(options, |r| eprintln!("{r}")).await.expect("the suite runs");
    eprintln!("{}", report.summary());
    let failed: Vec<String> = report
        .results
        .iter()
        .filter_map(|r| match &r.outcome {
            Outcome::Fail(why) => Some(format!("{}: {why}", r.name)),
            _ => None,
        })
        .collect();
    assert!(failed.is_empty(), "conformance failures: {failed:#?}\n{}", sidecar.log_text());
    for r in &report.results {
        if let Outcome::Skip(why) = &r.outcome {
            assert!(!why.is_empty(), "{} is skipped without a reason", r.name);
        }
    }
    let passed = report.results.iter().filter(|r| matches!(r.outcome, Outcome::Pass)).count();
    assert!(passed >= passes, "only {passed} checks pass, {passes} expected: {}", report.summary());
}

/// The released AWS image is `FROM scratch`: nothing in it but its binary, so the binary must
/// carry the roots that AWS's certificates chain to (issue 54). The image's binary, built as
/// its Containerfile builds it (`deploy/images/build-binaries.sh`), links Go's copy of
/// Mozilla's roots (`golang.org/x/crypto/x509roots/fallback`, which Go uses when the system
/// has no bundle) and starts in an empty root filesystem. That those roots verify a public
/// chain with no system bundle is the Go test of its package
/// (`providers/aws/cmd/ccm-provider-aws`, which `.ci/run` runs).
#[test]
fn the_aws_images_binary_carries_its_tls_roots() {
    if let Err(why) = machine::require("building ccm-provider-aws", &[("go", "go.dev/dl")]) {
        assert!(std::env::var_os(REQUIRE).is_none(), "{REQUIRE}: {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let root = tempfile::tempdir().expect("an empty root");
    let built = std::process::Command::new(repo.join("deploy/images/build-binaries.sh"))
        .arg(root.path())
        .arg("ccm-provider-aws")
        .output()
        .expect("build-binaries.sh");
    assert!(built.status.success(), "build-binaries.sh: {}", String::from_utf8_lossy(&built.stderr));
    let binary = root.path().join("ccm-provider-aws");
    let modules = std::process::Command::new("go").args(["version", "-m"]).arg(&binary).output().expect("go version -m");
    let modules = String::from_utf8_lossy(&modules.stdout);
    assert!(modules.contains("golang.org/x/crypto/x509roots/fallback"), "the image's binary links no TLS roots:\n{modules}");
    // In a root filesystem holding nothing but the binary, as the image's: it starts.
    // The owner of what this process creates is its user: root may chroot.
    let me = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&binary).expect("the binary"));
    if me != 0 {
        eprintln!("not root: the empty root filesystem (chroot) is not tried");
        return;
    }
    let chroot = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|dir| dir.join("chroot"))
        .find(|path| path.exists())
        .expect("chroot (coreutils)");
    let started = std::process::Command::new(chroot)
        .arg(root.path())
        .args(["/ccm-provider-aws", "--version"])
        .env_clear()
        .output()
        .expect("chroot");
    assert!(started.status.success(), "in an empty root: {}", String::from_utf8_lossy(&started.stderr));
    assert!(String::from_utf8_lossy(&started.stdout).contains("ccm-provider"), "{started:?}");
}
