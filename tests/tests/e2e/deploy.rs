//! `deploy/`: every manifest and the rendered chart pass the real API server's server-side
//! dry run; the shipped RBAC is sufficient (the node, lifecycle, route and service scenarios
//! run with the core as its ServiceAccounts and no request is forbidden, per the audit log)
//! and no broader than needed (forbidden verbs stay forbidden).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ccm_harness::ControlPlane;
use ccm_harness::cluster::{
    NodeBuilder, TestEnv, UNINITIALIZED_TAINT, create_load_balancer_service, load_balancer_ip, set_ready,
};
use ccm_provider_sim::Config;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::Api;
use kube::api::{DeleteParams, PostParams};

use crate::support::{Core, Sim, TEST_LABEL, eventually, instance, workspace_binary};

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Runs a command with `input` on stdin; its stdout, or a panic with its stderr.
fn run(mut cmd: std::process::Command, input: Option<&[u8]>, what: &str) -> String {
    use std::io::Write;
    let mut child = cmd
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(input.unwrap_or_default()).expect("write stdin");
    drop(stdin);
    let out = child.wait_with_output().expect("wait");
    assert!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Server-side dry run of `yaml`: every object validated and admitted, nothing stored. The
/// objects as the server would store them.
fn dry_run(cp: &ControlPlane, yaml: &str, what: &str) -> Vec<serde_json::Value> {
    let mut cmd = cp.kubectl(&["apply", "--server-side", "--dry-run=server", "--field-manager=ccm-e2e", "-o", "json", "-f", "-"]);
    cmd.current_dir(deploy_dir());
    let out = run(cmd, Some(yaml.as_bytes()), what);
    let value: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{what}: {e}: {out}"));
    let items = match value["kind"].as_str() {
        Some("List") => value["items"].as_array().cloned().unwrap_or_default(),
        _ => vec![value],
    };
    assert!(!items.is_empty(), "{what}: nothing applied");
    items
}

/// The rules of every Role and ClusterRole, by kind and name, each rule's lists sorted.
fn rules(objects: &[serde_json::Value]) -> BTreeMap<String, BTreeSet<String>> {
    let sorted = |v: &serde_json::Value| {
        let mut list: Vec<String> = v.as_array().into_iter().flatten().filter_map(|x| x.as_str().map(str::to_string)).collect();
        list.sort();
        list.join(",")
    };
    objects
        .iter()
        .filter(|o| matches!(o["kind"].as_str(), Some("Role" | "ClusterRole")))
        .map(|o| {
            let key =
                format!("{}/{}", o["kind"].as_str().unwrap_or_default(), o["metadata"]["name"].as_str().unwrap_or_default());
            let set = o["rules"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| {
                    format!(
                        "{}|{}|{}|{}",
                        sorted(&r["apiGroups"]),
                        sorted(&r["resources"]),
                        sorted(&r["resourceNames"]),
                        sorted(&r["verbs"])
                    )
                })
                .collect();
            (key, set)
        })
        .collect()
}

/// The core's Deployment of `objects` keeps its containers apart (issue 54): no token
/// automounted; the core's projected into its container alone; each provider a user of its
/// own, no token but the one the core hands over (an emptyDir), and a socket directory that
/// no other provider mounts.
fn isolated(objects: &[serde_json::Value], what: &str) {
    for pod in objects.iter().filter(|o| o["kind"] == "Deployment" || o["kind"] == "DaemonSet") {
        let spec = &pod["spec"]["template"]["spec"];
        let containers = spec["containers"].as_array().cloned().unwrap_or_default();
        if !containers.iter().any(|c| c["name"] == "cloud-controller-manager") {
            continue;
        }
        assert_eq!(spec["automountServiceAccountToken"], false, "{what}: a token for every container");
        let volumes = spec["volumes"].as_array().cloned().unwrap_or_default();
        let volume = |name: &serde_json::Value| volumes.iter().find(|v| v["name"] == *name).cloned().unwrap_or_default();
        let projects_token = |v: &serde_json::Value| {
            v["projected"]["sources"].as_array().is_some_and(|s| s.iter().any(|s| !s["serviceAccountToken"].is_null()))
        };
        let core_user = spec["securityContext"]["runAsUser"].as_i64();
        let mut users = vec![core_user];
        let mut sockets = BTreeMap::new();
        for container in &containers {
            let name = container["name"].as_str().unwrap_or_default();
            let mounts = container["volumeMounts"].as_array().cloned().unwrap_or_default();
            if name == "cloud-controller-manager" {
                assert!(mounts.iter().any(|m| projects_token(&volume(&m["name"]))), "{what}: the core's token");
                continue;
            }
            let user = container["securityContext"]["runAsUser"].as_i64();
            assert!(user.is_some() && !users.contains(&user), "{what}: {name} runs as {user:?}, not a user of its own");
            users.push(user);
            for mount in &mounts {
                let v = volume(&mount["name"]);
                assert!(!projects_token(&v), "{what}: {name} mounts a token of the pod's account");
                if mount["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount" {
                    assert!(
                        !v["emptyDir"].is_null() && mount["readOnly"] == true,
                        "{what}: {name}'s token is the core's handover"
                    );
                }
                if mount["mountPath"] == "/var/run/ccm" {
                    let owner = sockets.insert(mount["name"].to_string(), name.to_string());
                    assert!(owner.is_none(), "{what}: {name} and {owner:?} share a socket directory");
                }
            }
        }
        assert!(!sockets.is_empty(), "{what}: no provider socket directory");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_manifest_and_the_rendered_chart_pass_a_server_side_dry_run() {
    let cp = ccm_harness::shared().expect("control plane");
    let mut counts = BTreeMap::new();
    let mut kustomize_rules = BTreeMap::new();
    for dir in ["rbac", "core", "node-metadata"] {
        let path = deploy_dir().join("kustomize").join(dir);
        let yaml = run(cp.kubectl(&["kustomize", &path.display().to_string()]), None, &format!("kustomize {dir}"));
        let objects = dry_run(cp, &yaml, &format!("kustomize/{dir}"));
        isolated(&objects, &format!("kustomize/{dir}"));
        kustomize_rules.extend(rules(&objects));
        counts.insert(format!("kustomize/{dir}"), objects.len());
    }
    let mut helm_rules = BTreeMap::new();
    let helm = tokio::task::spawn_blocking(|| ccm_harness::Assets::tool("helm")).await.expect("join").expect("helm");
    let chart = deploy_dir().join("helm/ccm-rs");
    let hybrid = deploy_dir().join("examples/hybrid-values.yaml").display().to_string();
    let variants: [(&str, &[&str]); 5] = [
        ("defaults", &["--set", "sim.enabled=true"]),
        ("a hybrid cluster: two provider sidecars", &["--values", &hybrid]),
        ("lease per controller", &["--set", "sim.enabled=true,leaderElection.perController=true"]),
        (
            "without service account credentials",
            &["--set", "sim.enabled=true,useServiceAccountCredentials=false", "--set", "nodeMetadata.enabled=false"],
        ),
        (
            "leader migration with a config",
            &[
                "--set",
                "sim.enabled=true,leaderMigration.enabled=true",
                "--set-string",
                "leaderMigration.config=apiVersion: controllermanager.config.k8s.io/v1\nkind: LeaderMigrationConfiguration\nleaderName: cloud-provider-extraction-migration\nresourceLock: leases\n",
            ],
        ),
    ];
    for (name, set) in variants {
        let mut cmd = std::process::Command::new(&helm);
        cmd.args(["template", "ccm-rs", &chart.display().to_string(), "--namespace", "kube-system", "--kube-version", "1.37.2"]);
        cmd.args(set);
        let yaml = run(cmd, None, &format!("helm template ({name})"));
        let objects = dry_run(cp, &yaml, &format!("helm ({name})"));
        isolated(&objects, &format!("helm ({name})"));
        if name == "defaults" {
            // Helm's uninstall hook (its own account, which only releases finalizers) has no
            // kustomize counterpart.
            let installed: Vec<serde_json::Value> =
                objects.iter().filter(|o| o["metadata"]["annotations"]["helm.sh/hook"].is_null()).cloned().collect();
            helm_rules = rules(&installed);
        }
        counts.insert(format!("helm ({name})"), objects.len());
    }
    // The chart and the kustomize manifests grant exactly the same.
    assert_eq!(helm_rules, kustomize_rules, "the chart's RBAC and the kustomize RBAC differ");
    assert_eq!(kustomize_rules.len(), 6, "{kustomize_rules:#?}");
    eprintln!("objects accepted by the server-side dry run: {counts:#?}");
    assert!(counts["kustomize/core"] >= 19, "{counts:?}");
    assert!(counts["helm (defaults)"] >= 20, "{counts:?}");

    // The chart refuses what cannot work, with a sentence saying what to do.
    let refused = |args: &[&str]| {
        let mut cmd = std::process::Command::new(&helm);
        cmd.args(["template", "ccm-rs", &chart.display().to_string(), "--kube-version", "1.37.2"]).args(args);
        let out = cmd.output().expect("helm");
        assert!(!out.status.success(), "{args:?} is refused");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(refused(&["--namespace", "default", "--set", "sim.enabled=true"]).contains("kube-system"));
    // No provider chosen: never the simulated cloud by accident.
    let why = refused(&["--namespace", "kube-system"]);
    assert!(why.contains("no provider chosen") && why.contains("sim.enabled=true"), "{why}");
    let why = refused(&["--namespace", "kube-system", "--set", "provider.image.repository=example.com/mycloud"]);
    assert!(why.contains("provider.name is required"), "{why}");
    // A provider as the core's user, or two providers as one: refused.
    let why = refused(&["--namespace", "kube-system", "--set", "sim.enabled=true,provider.runAsUser=65532"]);
    assert!(why.contains("a user of its own"), "{why}");
    let why = refused(&["--namespace", "kube-system", "--values", &hybrid, "--set", "extraProviders[0].runAsUser=65533"]);
    assert!(why.contains("a user of its own"), "{why}");
    // A provider given the core's account (or a controller's), run as root, or reading Secrets
    // or the kubelet's API: refused (the core would hand it that account's token).
    for account in ["cloud-controller-manager", "node-controller"] {
        let why = refused(&[
            "--namespace",
            "kube-system",
            "--set",
            &format!("sim.enabled=true,provider.serviceAccount.name={account}"),
        ]);
        assert!(why.contains("an account of its own"), "{account}: {why}");
    }
    let why = refused(&["--namespace", "kube-system", "--set", "sim.enabled=true,provider.runAsUser=null"]);
    assert!(why.contains("non-root user of its own"), "{why}");
    for resource in ["secrets", "nodes/proxy", "*"] {
        let rule = format!("provider.rbac.rules[0].resources[0]={resource},provider.rbac.rules[0].verbs[0]=get");
        let why = refused(&["--namespace", "kube-system", "--set", "sim.enabled=true", "--set", &rule]);
        assert!(why.contains("rbac/rules/0/resources/0"), "{resource}: {why}");
    }
    // Monitors that would send Prometheus' token to a certificate nobody verifies: refused.
    let why = refused(&["--namespace", "kube-system", "--set", "sim.enabled=true,metrics.serviceMonitor.enabled=true"]);
    assert!(why.contains("insecureSkipVerify"), "{why}");
    // values.schema.json catches a misspelt value.
    let why = refused(&["--namespace", "kube-system", "--set", "sim.enabled=true,replica=3"]);
    assert!(why.contains("replica"), "{why}");
    // A real provider with its credentials from a Secret, and the monitors: rendered and admitted.
    let mut cmd = std::process::Command::new(&helm);
    cmd.args(["template", "ccm-rs", &chart.display().to_string(), "--namespace", "kube-system", "--kube-version", "1.37.2"])
        .args(["--set", "provider.name=mycloud.example.com,provider.image.repository=example.com/mycloud-provider"])
        .args(["--set", "provider.args={--cloud-config=/etc/ccm-provider-secret/cloud.conf}"])
        .args(["--set", "provider.existingSecret=mycloud,provider.envFrom[0].secretRef.name=mycloud-env"])
        .args(["--set", "imagePullSecrets[0].name=registry,podLabels.team=infra,nameOverride=ccm"])
        .args(["--set", "nodeMetadata.image.repository=example.com/mycloud-provider,nodeMetadata.args={node-plugin}"]);
    let yaml = run(cmd, None, "helm template (a real provider)");
    assert!(yaml.contains("secretName: mycloud") && yaml.contains("name: mycloud-env") && yaml.contains("name: registry"));
    assert!(!yaml.contains("provider-sim"), "no trace of the sim unless asked for");
    let objects = dry_run(cp, &yaml, "helm (a real provider)");
    assert!(
        objects.iter().any(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "ccm"),
        "nameOverride names the Deployment"
    );

    // An operator's values, monitors included (validated by prometheus-operator's CRDs).
    install_monitoring_crds(cp);
    let mut cmd = std::process::Command::new(&helm);
    cmd.args(["template", "ccm-rs", &chart.display().to_string(), "--namespace", "kube-system", "--kube-version", "1.37.2"]);
    cmd.args(OPERATOR_VALUES);
    let yaml = run(cmd, None, "helm template (an operator's values)");
    let objects = dry_run(cp, &yaml, "helm (an operator's values)");
    let of_kind = |kind: &'static str| objects.iter().filter(move |o| o["kind"] == kind);
    assert_eq!(of_kind("Deployment").count(), 0, "DaemonSet mode has no Deployment");
    assert_eq!(of_kind("PodDisruptionBudget").count(), 0, "nor a PodDisruptionBudget");
    let core = of_kind("DaemonSet").find(|o| o["metadata"]["name"] == "cloud-controller-manager").expect("the core's DaemonSet");
    let pod = &core["spec"]["template"]["spec"];
    assert_eq!(pod["priorityClassName"], "system-node-critical");
    assert!(pod["securityContext"]["runAsUser"].is_null() && pod["securityContext"]["runAsNonRoot"] == true, "{pod}");
    let tolerations = pod["tolerations"].to_string();
    for key in ["CriticalAddonsOnly", "dedicated", "node.cloudprovider.kubernetes.io/uninitialized"] {
        assert!(tolerations.contains(key), "{key} not tolerated: {tolerations}");
    }
    assert_eq!(pod["topologySpreadConstraints"][0]["topologyKey"], "topology.kubernetes.io/zone");
    assert_eq!(pod["dnsConfig"]["options"][0]["name"], "ndots");
    let container =
        |name: &str| pod["containers"].as_array().into_iter().flatten().find(|c| c["name"] == name).cloned().expect("container");
    let core_args = container("cloud-controller-manager")["args"].to_string();
    assert!(core_args.contains("--logging-format=text") && core_args.ends_with("\"--cluster-name=prod-2\"]"), "{core_args}");
    let provider = container("provider");
    let provider_args = provider["args"].to_string();
    assert!(provider_args.contains("--cloud-config=/etc/cloud/cloud.conf"), "the sidecar gets --cloud-config: {provider_args}");
    assert!(provider_args.contains("--metrics-listen=unix:///var/run/ccm/metrics.sock"), "{provider_args}");
    assert!(provider["volumeMounts"].to_string().contains("/etc/cloud"), "the sidecar mounts the core's volume: {provider}");
    // The uninstall Job runs where the core runs, as the core does.
    let job = of_kind("Job").find(|o| o["metadata"]["name"] == "ccm-rs-uninstall").expect("the uninstall Job");
    let job_pod = &job["spec"]["template"]["spec"];
    assert_eq!(job_pod["priorityClassName"], "system-node-critical");
    assert!(job_pod["securityContext"]["runAsUser"].is_null(), "{job_pod}");
    assert!(job_pod["tolerations"].to_string().contains("dedicated"), "{job_pod}");
    assert!(job_pod["containers"][0]["args"].to_string().contains("--logging-format=text"), "{job_pod}");

    // AWS's example values with the operator's own --cloud-config: the sidecar's last one, so
    // it wins over the example's (Go's flag package takes the last).
    let mut cmd = std::process::Command::new(&helm);
    cmd.args(["template", "ccm-rs", &chart.display().to_string(), "--namespace", "kube-system", "--kube-version", "1.37.2"])
        .arg("-f")
        .arg(deploy_dir().join("examples/aws-values.yaml"))
        .args(["--set", "extraArgs={--cloud-config=/etc/aws/cloud.conf}"]);
    let yaml = run(cmd, None, "helm template (AWS values, the operator's --cloud-config)");
    let sidecar_args: Vec<String> = containers(&dry_run(cp, &yaml, "helm (AWS values)"))
        .into_iter()
        .find(|(what, _, _)| what.ends_with("/provider"))
        .map(|(_, _, args)| args)
        .expect("the sidecar");
    let last = sidecar_args.iter().rev().find(|a| a.starts_with("--cloud-config=")).expect("a --cloud-config");
    assert_eq!(last, "--cloud-config=/etc/aws/cloud.conf", "{sidecar_args:?}");
    let account = of_kind("ServiceAccount").find(|o| o["metadata"]["name"] == "cloud-controller-manager").expect("account");
    assert_eq!(account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"], "arn:aws:iam::123456789012:role/ccm");
    for kind in ["ServiceMonitor", "PodMonitor"] {
        let monitor = of_kind(kind).next().unwrap_or_else(|| panic!("no {kind}")).to_string();
        assert!(monitor.contains("\"authorization\"") && monitor.contains("prometheus-metrics-token"), "{monitor}");
        assert!(monitor.contains("\"ca\"") && monitor.contains("ccm-serving"), "the serving CA is verified: {monitor}");
        assert!(!monitor.contains("bearerTokenFile") && !monitor.contains("insecureSkipVerify"), "{monitor}");
        // The sidecar's metrics through the core, behind the same token and certificate.
        assert!(monitor.contains("/metrics/providers/default"), "the sidecar's metrics are scraped: {monitor}");
        assert!(!monitor.contains("\"http\""), "nothing scraped in the clear: {monitor}");
    }

    // RBAC and accounts made elsewhere: the chart makes none.
    let mut cmd = std::process::Command::new(&helm);
    cmd.args(["template", "ccm-rs", &chart.display().to_string(), "--namespace", "kube-system", "--kube-version", "1.37.2"]);
    cmd.args(["--set", "sim.enabled=true,rbac.create=false,serviceAccount.create=false,serviceAccount.name=platform-ccm"]);
    let yaml = run(cmd, None, "helm template (RBAC elsewhere)");
    let objects = dry_run(cp, &yaml, "helm (RBAC elsewhere)");
    let made: Vec<String> = objects
        .iter()
        .filter(|o| o["metadata"]["annotations"]["helm.sh/hook"].is_null())
        .filter(|o| {
            matches!(o["kind"].as_str(), Some("ServiceAccount" | "Role" | "ClusterRole" | "RoleBinding" | "ClusterRoleBinding"))
        })
        .map(|o| format!("{}/{}", o["kind"], o["metadata"]["name"]))
        .collect();
    assert!(made.is_empty(), "made with rbac.create=false and serviceAccount.create=false: {made:?}");
    let deployment = objects.iter().find(|o| o["kind"] == "Deployment").expect("deployment");
    assert_eq!(deployment["spec"]["template"]["spec"]["serviceAccountName"], "platform-ccm");
}

/// What an operator moving from AWS's or hcloud's chart sets: the DaemonSet shape, an IRSA
/// annotation, a priority class, OpenShift-friendly security contexts, tolerations, spread
/// and DNS settings, both monitors with a given serving certificate, and extra arguments that
/// repeat the chart's (the last wins) and pass `--cloud-config` (on to the sidecar, with the
/// core's volume mounted there too).
const OPERATOR_VALUES: &[&str] = &[
    "--set",
    "sim.enabled=true,kind=DaemonSet,priorityClassName=system-node-critical,logFormat=text",
    "--set",
    "serviceAccount.annotations.eks\\.amazonaws\\.com/role-arn=arn:aws:iam::123456789012:role/ccm",
    "--set",
    "podSecurityContext.runAsUser=null,podSecurityContext.runAsGroup=null,podSecurityContext.fsGroup=null",
    "--set",
    "additionalTolerations[0].key=dedicated,additionalTolerations[0].operator=Equal,additionalTolerations[0].value=infra,additionalTolerations[0].effect=NoSchedule",
    "--set",
    "topologySpreadConstraints[0].maxSkew=1,topologySpreadConstraints[0].topologyKey=topology.kubernetes.io/zone,topologySpreadConstraints[0].whenUnsatisfiable=ScheduleAnyway",
    "--set-string",
    "dnsConfig.options[0].name=ndots,dnsConfig.options[0].value=2",
    "--set",
    "metrics.serviceMonitor.enabled=true,metrics.podMonitor.enabled=true,tls.secretName=ccm-serving",
    "--set",
    "extraArgs={--cloud-config=/etc/cloud/cloud.conf,--cluster-name=prod,--controllers=*\\,tagging,--logging-format=json,--cluster-name=prod-2}",
    "--set",
    "extraVolumes[0].name=cloud,extraVolumes[0].configMap.name=cloud-config,extraVolumeMounts[0].name=cloud,extraVolumeMounts[0].mountPath=/etc/cloud,extraVolumeMounts[0].readOnly=true",
];

/// The prometheus-operator CRDs (ServiceMonitor, PodMonitor) of a pinned release, from its Go
/// module (the module cache is shared and safe for concurrent use), installed in the test
/// control plane so that the chart's monitors are validated against their schema.
fn install_monitoring_crds(cp: &ControlPlane) {
    let out = std::process::Command::new("go")
        .args(["mod", "download", "-json", "github.com/prometheus-operator/prometheus-operator@v0.86.1"])
        .env("GOTOOLCHAIN", "local")
        .env("GOFLAGS", "-mod=mod")
        .current_dir(std::env::temp_dir())
        .output()
        .expect("go mod download (Go is needed for the control plane already)");
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).expect("go mod download -json");
    let dir = PathBuf::from(info["Dir"].as_str().unwrap_or_else(|| panic!("prometheus-operator's module: {info}")));
    for kind in ["servicemonitors", "podmonitors"] {
        let file = dir.join(format!("example/prometheus-operator-crd/monitoring.coreos.com_{kind}.yaml"));
        run(cp.kubectl(&["apply", "--server-side", "-f", &file.display().to_string()]), None, &format!("the {kind} CRD"));
        run(
            cp.kubectl(&["wait", "--for=condition=Established", "--timeout=60s", &format!("crd/{kind}.monitoring.coreos.com")]),
            None,
            &format!("the {kind} CRD established"),
        );
    }
}

async fn token(client: &kube::Client, account: &str) -> String {
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), "kube-system");
    let request = TokenRequest {
        spec: Some(TokenRequestSpec { expiration_seconds: Some(3600), ..Default::default() }),
        ..Default::default()
    };
    let answer = api.create_token_request(account, &PostParams::default(), &request).await.expect("token request");
    answer.status.and_then(|s| s.token).expect("a token")
}

pub(crate) async fn allowed(client: &kube::Client, account: &str, verb: &str, resource: &str, name: Option<&str>) -> bool {
    let (resource, subresource) = resource.split_once('/').map_or((resource, None), |(r, s)| (r, Some(s.to_string())));
    let group = if resource == "leases" { "coordination.k8s.io" } else { "" };
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(format!("system:serviceaccount:kube-system:{account}")),
            groups: Some(vec!["system:serviceaccounts".into(), "system:serviceaccounts:kube-system".into()]),
            resource_attributes: Some(ResourceAttributes {
                verb: Some(verb.into()),
                group: Some(group.into()),
                resource: Some(resource.into()),
                subresource,
                name: name.map(str::to_string),
                namespace: Some("kube-system".into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let api: Api<SubjectAccessReview> = Api::all(client.clone());
    api.create(&PostParams::default(), &review).await.expect("review").status.is_some_and(|s| s.allowed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_roles_are_enough_for_every_controller_and_no_broader() {
    // A control plane of its own: its audit log then holds only this test's requests.
    let cp = tokio::task::spawn_blocking(ControlPlane::start).await.expect("join").expect("control plane");
    let admin = cp.client().await.expect("client");
    let rbac = deploy_dir().join("kustomize/rbac");
    run(
        cp.kubectl(&["apply", "--server-side", "--field-manager=ccm-e2e", "-k", &rbac.display().to_string()]),
        None,
        "apply rbac",
    );

    let env = TestEnv::new(admin.clone(), "rbac").await.expect("env");
    let (fresh, doomed) = (env.node_name("fresh"), env.node_name("doomed"));
    let mut config = Config::default();
    config.instances.push(instance("i-fresh", &fresh, "sim-region-1a"));
    config.instances.push(instance("i-doomed", &doomed, "sim-region-1a"));
    let sim = Sim::start(config).await;
    let kubeconfig = cp
        .kubeconfig_with_token("cloud-controller-manager", &token(&admin, "cloud-controller-manager").await)
        .expect("kubeconfig");
    // The default Lease name: the RBAC grants the core its own Leases only.
    let core = Core::start_as(
        &kubeconfig,
        &env,
        &sim,
        &[
            "--leader-elect=true",
            "--leader-elect-resource-namespace=kube-system",
            "--leader-elect-resource-name=cloud-controller-manager",
            "--use-service-account-credentials",
            "--cluster-cidr=10.250.0.0/16",
            "--node-monitor-period=300ms",
            // Every controller: node IPAM too (it acts as node-controller, as upstream's).
            "--allocate-node-cidrs",
        ],
    );

    // The node controller and the route controller.
    NodeBuilder::new(&fresh)
        .uninitialized()
        .label(TEST_LABEL, &env.prefix)
        .pod_cidr("10.250.1.0/24")
        .create(&admin)
        .await
        .expect("node");
    eventually("the node initialised", Duration::from_secs(30), async || {
        let node = env.nodes().get(&fresh).await.ok()?;
        let taints = node.spec.as_ref()?.taints.clone().unwrap_or_default();
        (!taints.iter().any(|t| t.key == UNINITIALIZED_TAINT)).then_some(())
    })
    .await;
    eventually("the route and the NetworkUnavailable condition", Duration::from_secs(30), async || {
        let state = sim.admin.state().await.ok()?;
        let routed = state.route_tables.iter().flat_map(|t| &t.routes).any(|r| r.destination_cidr == "10.250.1.0/24");
        let node = env.nodes().get(&fresh).await.ok()?;
        let conditions = node.status?.conditions.unwrap_or_default();
        let cleared = conditions.iter().any(|c| c.type_ == "NetworkUnavailable" && c.status == "False");
        (routed && cleared).then_some(())
    })
    .await;

    // The node IPAM controller: a Node without a podCIDR gets one from the cluster CIDR.
    let bare = env.node_name("bare");
    NodeBuilder::new(&bare).label(TEST_LABEL, &env.prefix).create(&admin).await.expect("node");
    set_ready(&admin, &bare, "True").await.expect("ready"); // no instance: left alone while Ready
    eventually("a podCIDR for the Node without one", Duration::from_secs(30), async || {
        let cidr = env.nodes().get(&bare).await.ok()?.spec?.pod_cidr?;
        cidr.starts_with("10.250.").then_some(())
    })
    .await;

    // The node lifecycle controller: a NotReady Node whose instance is gone is deleted (with
    // a Ready Node whose instance exists to witness the provider's answer: `fresh`).
    set_ready(&admin, &fresh, "True").await.expect("ready");
    NodeBuilder::new(&doomed)
        .label(TEST_LABEL, &env.prefix)
        .provider_id("sim://sim-region-1a/i-doomed")
        .create(&admin)
        .await
        .expect("node");
    set_ready(&admin, &doomed, "False").await.expect("not ready");
    sim.admin.instance_action("i-doomed", "terminate").await.expect("terminate");
    eventually("the node of a gone instance deleted", Duration::from_secs(30), async || {
        env.nodes().get_opt(&doomed).await.ok()?.is_none().then_some(())
    })
    .await;

    // The service controller: ensure (finalizer, status), then delete (finalizer removed).
    let svc_env = env.clone();
    let web = "web".to_string();
    create_load_balancer_service(&svc_env, &web, &[80]).await.expect("service");
    eventually("the load balancer's address", Duration::from_secs(30), async || {
        load_balancer_ip(&svc_env.services().get(&web).await.ok()?).map(str::to_string)
    })
    .await;
    svc_env.services().delete(&web, &DeleteParams::default()).await.expect("delete");
    eventually("the Service gone once its load balancer is", Duration::from_secs(30), async || {
        svc_env.services().get_opt(&web).await.ok()?.is_none().then_some(())
    })
    .await;
    // Events are recorded in the background: give them a moment.
    tokio::time::sleep(Duration::from_secs(2)).await;
    core.stop().await.expect("core stops");

    // The audit log: every account acted, and none was refused anything.
    let log = std::fs::read_to_string(cp.audit_log()).expect("audit log");
    let mut users = BTreeSet::new();
    let mut forbidden = Vec::new();
    for line in log.lines() {
        let Ok(event) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let user = event["user"]["username"].as_str().unwrap_or_default();
        let Some(account) = user.strip_prefix("system:serviceaccount:kube-system:") else { continue };
        users.insert(account.to_string());
        if event["responseStatus"]["code"].as_i64() == Some(403) {
            forbidden.push(format!("{account}: {} {}", event["verb"], event["requestURI"]));
        }
    }
    assert!(forbidden.is_empty(), "forbidden requests: {forbidden:#?}");
    // Upstream's accounts: node-controller (node and node lifecycle controllers),
    // route-controller, service-controller.
    for account in ["cloud-controller-manager", "node-controller", "route-controller", "service-controller"] {
        assert!(users.contains(account), "{account} made requests as itself: {users:?}");
    }

    // No broader than needed: what a controller does not do stays forbidden.
    let checks: [(&str, &str, &str, Option<&str>, bool); 19] = [
        ("route-controller", "patch", "nodes/status", None, true),
        ("route-controller", "delete", "nodes", None, false),
        ("route-controller", "patch", "nodes", None, false),
        ("service-controller", "patch", "services/status", None, true),
        ("service-controller", "get", "services", None, true),
        ("service-controller", "patch", "nodes", None, false),
        ("service-controller", "delete", "services", None, false),
        ("node-controller", "patch", "nodes", None, true),
        ("node-controller", "delete", "nodes", None, true),
        ("node-controller", "update", "services", None, false),
        ("node-controller", "patch", "services", None, false),
        ("cloud-controller-manager", "patch", "nodes", None, false),
        ("cloud-controller-manager", "create", "serviceaccounts/token", Some("default"), false),
        ("cloud-controller-manager", "get", "secrets", None, false),
        // Its own Leases, not another component's.
        ("cloud-controller-manager", "update", "leases", Some("cloud-controller-manager"), true),
        ("cloud-controller-manager", "update", "leases", Some("kube-controller-manager"), false),
        ("cloud-controller-manager", "create", "leases", None, true),
        // Replicas sharing the controllers: their member Leases, found by a list.
        ("cloud-controller-manager", "update", "leases", Some("cloud-controller-manager-member-0"), true),
        ("cloud-controller-manager", "list", "leases", None, true),
    ];
    let mut wrong = Vec::new();
    for (account, verb, resource, name, want) in checks {
        if allowed(&admin, account, verb, resource, name).await != want {
            wrong.push(format!("{account} {verb} {resource}: expected allowed={want}"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert!(allowed(&admin, "cloud-controller-manager", "create", "serviceaccounts/token", Some("route-controller")).await);

    // The provider's own account (whose token the core hands it): its read-only rules, and
    // nothing of what the core's accounts may do.
    let provider = "cloud-controller-manager-provider";
    let matrix: [(&str, &str, Option<&str>, bool); 12] = [
        ("get", "nodes", None, true),
        ("list", "nodes", None, true),
        ("watch", "services", None, true),
        ("patch", "nodes", None, false),
        ("delete", "nodes", None, false),
        ("delete", "pods", None, false),
        ("update", "services/status", None, false),
        ("get", "secrets", None, false),
        ("create", "serviceaccounts/token", Some("node-controller"), false),
        ("create", "serviceaccounts/token", Some(provider), false),
        ("create", "leases", None, false),
        ("update", "leases", Some("cloud-controller-manager"), false),
    ];
    let mut wrong = Vec::new();
    for (verb, resource, name, want) in matrix {
        if allowed(&admin, provider, verb, resource, name).await != want {
            wrong.push(format!("{provider} {verb} {resource} {name:?}: expected allowed={want}"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert!(allowed(&admin, "cloud-controller-manager", "create", "serviceaccounts/token", Some(provider)).await);

    // RBAC lets the core create any Lease in kube-system; the admission policy shipped beside
    // it refuses one of another component (a pre-created Lease would hold that component
    // back), and lets the core's own through.
    let core_client = {
        let kubeconfig = kube::config::Kubeconfig::read_from(&kubeconfig).expect("kubeconfig");
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await.expect("config");
        kube::Client::try_from(config).expect("client")
    };
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(core_client, "kube-system");
    let lease = |name: &str| k8s_openapi::api::coordination::v1::Lease {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta { name: Some(name.into()), ..Default::default() },
        ..Default::default()
    };
    let refusal = eventually("the Lease policy in force", Duration::from_secs(20), async || {
        match leases.create(&PostParams::default(), &lease("kube-scheduler")).await {
            Err(kube::Error::Api(status)) if status.code == 422 || status.code == 403 => Some(status.message),
            Ok(_) => panic!("the core's account created kube-system/kube-scheduler"),
            Err(_) => None,
        }
    })
    .await;
    assert!(refusal.contains("only its own Leases"), "{refusal}");
    let own = "cloud-controller-manager-member-7";
    leases.create(&PostParams::default(), &lease(own)).await.expect("the core creates its own Lease");
    let _ = leases.delete(own, &DeleteParams::default()).await;
    env.cleanup().await.expect("cleanup");
}

/// Every container of every workload in `objects`: (object/container, image, command + args
/// with `$(VAR)` references expanded as the kubelet would, from the container's env or the
/// Service variables of a Service in `objects`).
fn containers(objects: &[serde_json::Value]) -> Vec<(String, String, Vec<String>)> {
    let services: Vec<String> = objects
        .iter()
        .filter(|o| o["kind"] == "Service")
        .filter_map(|o| o["metadata"]["name"].as_str())
        .map(|n| n.to_uppercase().replace('-', "_"))
        .collect();
    let mut out = Vec::new();
    for object in objects.iter().filter(|o| matches!(o["kind"].as_str(), Some("Deployment" | "DaemonSet" | "Job"))) {
        let spec = &object["spec"]["template"]["spec"];
        let all =
            spec["initContainers"].as_array().into_iter().flatten().chain(spec["containers"].as_array().into_iter().flatten());
        for container in all {
            let what =
                format!("{}/{}", object["metadata"]["name"].as_str().unwrap_or("?"), container["name"].as_str().unwrap_or("?"));
            let env: BTreeMap<String, String> = container["env"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|e| {
                    // What the kubelet would give a field reference: an address for the pod's IP.
                    let value = match (e["value"].as_str(), e["valueFrom"]["fieldRef"]["fieldPath"].as_str()) {
                        (Some(v), _) => v,
                        (None, Some("status.podIP")) => "10.0.0.7",
                        (None, _) => "from-field",
                    };
                    Some((e["name"].as_str()?.to_string(), value.to_string()))
                })
                .collect();
            let expand = |arg: &str| {
                let mut text = arg.to_string();
                while let Some(start) = text.find("$(") {
                    let end =
                        text[start..].find(')').map(|e| start + e).unwrap_or_else(|| panic!("{what}: unclosed $( in {arg}"));
                    let var = &text[start + 2..end];
                    let value = if let Some(v) = env.get(var) {
                        v.clone()
                    } else if services.iter().any(|s| var == format!("{s}_SERVICE_HOST")) {
                        "10.96.0.42".to_string()
                    } else if services.iter().any(|s| var == format!("{s}_SERVICE_PORT")) {
                        "8169".to_string()
                    } else {
                        panic!("{what}: {arg} refers to ${var}, which the kubelet would not set");
                    };
                    text.replace_range(start..=end, &value);
                }
                text
            };
            let words: Vec<String> = container["command"]
                .as_array()
                .into_iter()
                .flatten()
                .chain(container["args"].as_array().into_iter().flatten())
                .filter_map(|a| a.as_str())
                .map(expand)
                .collect();
            out.push((what, container["image"].as_str().unwrap_or_default().to_string(), words));
        }
    }
    out
}

/// The binary a container runs: its command's, or its image's entrypoint.
fn entrypoint(image: &str, words: &[String]) -> (String, usize) {
    if let Some(first) = words.first().filter(|w| w.starts_with('/')) {
        return (first.rsplit('/').next().unwrap_or_default().to_string(), 1);
    }
    let binary = if image.contains("/cloud-controller-manager:") {
        "cloud-controller-manager"
    } else if image.contains("/provider-sim:") {
        "ccm-provider-sim"
    } else {
        panic!("no binary known for image {image}");
    };
    (binary.to_string(), 0)
}

/// Runs every container's command line of `yaml` through the real binary with
/// `CCM_CHECK_ARGS` (parse and check, start nothing). Returns how many were checked.
fn check_arguments(yaml: &str, what: &str) -> usize {
    let objects: Vec<serde_json::Value> = yaml.split("\n---").filter_map(yaml_object).collect();
    let list = containers(&objects);
    assert!(!list.is_empty(), "{what}: no containers");
    for (container, image, words) in &list {
        let (binary, skip) = entrypoint(image, words);
        let out = std::process::Command::new(workspace_binary(&binary))
            .args(&words[skip..])
            .env("CCM_CHECK_ARGS", "1")
            .env("NODE_NAME", "node-a1")
            .output()
            .expect("run");
        assert!(
            out.status.success(),
            "{what}: {container} ({binary} {}) is refused: {}",
            words[skip..].join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains("arguments ok"), "{what}: {container}");
    }
    list.len()
}

/// One YAML document (as helm and kustomize print them) as JSON; None for an empty one.
fn yaml_object(doc: &str) -> Option<serde_json::Value> {
    let content = doc.lines().any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#') && l.trim() != "---");
    if !content {
        return None;
    }
    let value: serde_json::Value = serde_saphyr::from_str(doc).unwrap_or_else(|e| panic!("not YAML: {e}\n{doc}"));
    assert!(value.is_object(), "not an object: {doc}");
    Some(value)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rendered_command_line_is_accepted_by_the_real_binaries() {
    let helm = tokio::task::spawn_blocking(|| ccm_harness::Assets::tool("helm")).await.expect("join").expect("helm");
    let assets = tokio::task::spawn_blocking(ccm_harness::Assets::find).await.expect("join").expect("assets");
    let chart = deploy_dir().join("helm/ccm-rs");
    let hybrid = deploy_dir().join("examples/hybrid-values.yaml").display().to_string();
    // Each provider's node plugin on its own Nodes.
    let plugins = tempfile::NamedTempFile::new().expect("values");
    std::fs::write(
        plugins.path(),
        "nodeMetadata: {enabled: true}\nextraProviders:\n  - name: metal\n    image: {repository: ghcr.io/ccm-rs/provider-sim}\n    \
         args: [--config=/etc/ccm-provider/sim.toml]\n    nodeMetadata:\n      pluginName: metal.sim.example.com\n      \
         image: {repository: ghcr.io/ccm-rs/provider-sim}\n      args: [node-metadata, --metadata-endpoint=http://169.254.169.254]\n",
    )
    .expect("values");
    let plugins = plugins.path().display().to_string();
    let variants: [(&str, &[&str]); 10] = [
        ("the sim", &["--set", "sim.enabled=true"]),
        ("lease per controller", &["--set", "sim.enabled=true,leaderElection.perController=true"]),
        ("without service account credentials", &["--set", "sim.enabled=true,useServiceAccountCredentials=false"]),
        ("a given serving certificate", &["--set", "sim.enabled=true,tls.secretName=ccm-tls"]),
        ("non-graceful node shutdown", &["--set", "sim.enabled=true,outOfServiceAfter=2m30s"]),
        (
            "routes and migration",
            &["--set", "sim.enabled=true,configureCloudRoutes=true,clusterCIDR=10.244.0.0/16,leaderMigration.enabled=true"],
        ),
        (
            "every controller, node IPAM too",
            &["--set", "sim.enabled=true,configureCloudRoutes=true,clusterCIDR=10.244.0.0/16,allocateNodeCIDRs=true"],
        ),
        ("an operator's values", OPERATOR_VALUES),
        ("a hybrid cluster: two provider sidecars", &["--values", &hybrid, "--set", "routesProvider=metal"]),
        ("a hybrid cluster: each provider's node plugin", &["--values", &hybrid, "--values", &plugins]),
    ];
    let mut checked = 0;
    for (name, set) in variants {
        let mut cmd = std::process::Command::new(&helm);
        cmd.args(["template", "ccm-rs", &chart.display().to_string(), "--namespace", "kube-system", "--kube-version", "1.37.2"]);
        cmd.args(set);
        checked += check_arguments(&run(cmd, None, &format!("helm template ({name})")), &format!("helm ({name})"));
    }
    // Each node plugin runs on its own provider's Nodes only.
    let mut cmd = std::process::Command::new(&helm);
    cmd.args(["template", "ccm-rs", &chart.display().to_string(), "--namespace", "kube-system", "--kube-version", "1.37.2"]);
    cmd.args(["--values", &hybrid, "--values", &plugins]);
    let objects: Vec<serde_json::Value> =
        run(cmd, None, "helm template (node plugins)").split("\n---").filter_map(yaml_object).collect();
    let selectors: BTreeMap<String, String> = objects
        .iter()
        .filter(|o| {
            o["kind"] == "DaemonSet" && o["metadata"]["name"].as_str().is_some_and(|n| n.starts_with("ccm-node-metadata"))
        })
        .map(|o| {
            let name = o["metadata"]["name"].as_str().unwrap_or_default().to_string();
            let provider = o["spec"]["template"]["spec"]["nodeSelector"]["ccm-rs.dev/provider"].as_str().unwrap_or_default();
            (name, provider.to_string())
        })
        .collect();
    let want = [("ccm-node-metadata", "cloud"), ("ccm-node-metadata-metal", "metal")];
    assert_eq!(selectors, want.map(|(a, b)| (a.to_string(), b.to_string())).into(), "each node plugin on its provider's Nodes");
    // The two kustomize bases are installed together (the DaemonSet reads the core's Service).
    let mut both = String::new();
    for dir in ["core", "node-metadata"] {
        let path = deploy_dir().join("kustomize").join(dir);
        let mut cmd = std::process::Command::new(&assets.kubectl);
        cmd.args(["kustomize", &path.display().to_string()]);
        both += &run(cmd, None, &format!("kustomize {dir}"));
        both += "\n---\n";
    }
    checked += check_arguments(&both, "kustomize core + node-metadata");
    eprintln!("{checked} container command lines accepted");
    assert!(checked >= 20, "{checked}");

    // And a flag mistake is caught in seconds: the binary refuses it.
    let out = std::process::Command::new(workspace_binary("cloud-controller-manager"))
        .args(["--use-service-account-credentials", "true"])
        .env("CCM_CHECK_ARGS", "1")
        .output()
        .expect("run");
    assert!(!out.status.success(), "a boolean flag's value as a separate word is refused, as upstream's pflag does");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_finalizers_waits_for_the_leader_then_frees_every_service() {
    use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};

    // Built (when missing or stale) before the Lease below is made, whose 15 s a build could outlast.
    let core_binary = workspace_binary("cloud-controller-manager");
    let cp = ccm_harness::shared().expect("control plane");
    let env = TestEnv::new(cp.client().await.expect("client"), "uninstall").await.expect("env");
    let svc = create_load_balancer_service(&env, "web", &[80]).await.expect("service");
    let services = env.services();
    let patch =
        serde_json::json!({"metadata": {"finalizers": ["service.kubernetes.io/load-balancer-cleanup", "example.com/keep"]}});
    services.patch("web", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch)).await.expect("finalizers");
    // A Service of another load balancer class, whose controller put the same well-known
    // finalizer on it: not ours to release.
    let mut other = ccm_harness::cluster::load_balancer_service(&env.namespace, "theirs", &[80]);
    other.spec.as_mut().expect("spec").load_balancer_class = Some("example.com/other-lb".into());
    other.metadata.finalizers = Some(vec!["service.kubernetes.io/load-balancer-cleanup".into()]);
    services.create(&PostParams::default(), &other).await.expect("a Service of another class");
    // A classed Service whose load balancer the core made (one provider's class among several):
    // the core recorded its load balancer's name on it, so it is the core's to release.
    // (The name is one the core derives from the Service's UID: upstream's `a` and the UID.)
    let classed_service = |name: &str| {
        let mut classed = ccm_harness::cluster::load_balancer_service(&env.namespace, name, &[80]);
        classed.spec.as_mut().expect("spec").load_balancer_class = Some("metal.example.com/lb".into());
        classed.metadata.finalizers = Some(vec!["service.kubernetes.io/load-balancer-cleanup".into()]);
        classed
    };
    let made = services.create(&PostParams::default(), &classed_service("metal-web")).await.expect("a classed Service");
    let uid = made.metadata.uid.expect("uid").replace('-', "");
    let own: String = format!("a{uid}").chars().take(32).collect();
    let patch = serde_json::json!({"metadata": {"annotations": {"ccm-rs.dev/load-balancer-name": own}}});
    services.patch("metal-web", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch)).await.expect("recorded");
    // The same, with a name a user wrote (not derived from its UID): not the core's record, so
    // not the core's to release.
    let mut forged = classed_service("metal-forged");
    forged.metadata.annotations = Some([("ccm-rs.dev/load-balancer-name".to_string(), own.clone())].into());
    services.create(&PostParams::default(), &forged).await.expect("a classed Service with another's name");
    // A live leader, in a namespace of the test's own (as the chart's kube-system Lease).
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.namespace);
    let lease = Lease {
        metadata: ObjectMeta { name: Some("cloud-controller-manager".into()), ..Default::default() },
        spec: Some(LeaseSpec {
            holder_identity: Some("node-a_1_abc".into()),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(jiff::Timestamp::now())),
            ..Default::default()
        }),
    };
    leases.create(&PostParams::default(), &lease).await.expect("lease");
    let release = |wait: &str| {
        let mut cmd = std::process::Command::new(&core_binary);
        cmd.arg(format!("--kubeconfig={}", cp.kubeconfig_path().display()))
            .arg(format!("--leader-elect-resource-namespace={}", env.namespace))
            .arg(format!("--service-namespace={}", env.namespace))
            .args(["release-finalizers", &format!("--wait={wait}")]);
        cmd.output().expect("run")
    };
    let out = release("2s");
    assert!(!out.status.success(), "a live leader: nothing is released");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("still held by node-a_1_abc"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let kept = services.get("web").await.expect("service").metadata.finalizers.unwrap_or_default();
    assert!(kept.contains(&"service.kubernetes.io/load-balancer-cleanup".to_string()));

    // Released (as the core does on SIGTERM): the finalizer goes, the other one stays.
    let patch = serde_json::json!({"spec": {"holderIdentity": null}});
    leases
        .patch("cloud-controller-manager", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch))
        .await
        .expect("release");
    let out = release("2s");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("from 2 Service(s)"), "{}", String::from_utf8_lossy(&out.stdout));
    let classed = services.get("metal-web").await.expect("service").metadata.finalizers.unwrap_or_default();
    assert!(classed.is_empty(), "a classed Service the core made a load balancer for is released: {classed:?}");
    let kept = services.get("web").await.expect("service").metadata.finalizers.unwrap_or_default();
    assert_eq!(kept, vec!["example.com/keep".to_string()]);
    assert_eq!(svc.metadata.name.as_deref(), Some("web"));
    let theirs = services.get("theirs").await.expect("service").metadata.finalizers.unwrap_or_default();
    assert_eq!(theirs, vec!["service.kubernetes.io/load-balancer-cleanup".to_string()], "another class's Service is left alone");
    let forged = services.get("metal-forged").await.expect("service").metadata.finalizers.unwrap_or_default();
    assert_eq!(forged, vec!["service.kubernetes.io/load-balancer-cleanup".to_string()], "a forged record releases nothing");
    for name in ["theirs", "metal-forged"] {
        let patch = serde_json::json!({"metadata": {"finalizers": null}});
        services.patch(name, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch)).await.expect("clear");
    }
    let patch = serde_json::json!({"metadata": {"finalizers": null}});
    services.patch("web", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch)).await.expect("clear");
    env.cleanup().await.expect("cleanup");
}
