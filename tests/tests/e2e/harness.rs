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

/// Runs `cmd` to its end, killed after `limit`; its exit status and its stderr.
fn run_within(mut cmd: std::process::Command, limit: std::time::Duration) -> (std::process::ExitStatus, String) {
    use std::io::Read;
    let mut child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut stderr = child.stderr.take().expect("stderr");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let begin = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if begin.elapsed() > limit {
            let _ = child.kill();
            panic!("{cmd:?} still ran after {limit:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    (status, reader.join().expect("stderr reader"))
}

/// Two tests (or a test and `.ci/run`) reaching for the same tool on a fresh machine once built
/// it into the same partial file, and the second's `mv` failed. Four runs at once into an empty
/// cache: all succeed, all print the same path, exactly one builds, nothing partial is left.
#[test]
fn concurrent_setup_runs_build_a_tool_once_and_all_reuse_it() {
    if let Err(why) = ccm_harness::machine::require("setup.sh", &[("go", "go.dev/dl"), ("flock", "util-linux")]) {
        return eprintln!("skipped: {why}");
    }
    let cache = tempfile::tempdir().expect("tempdir");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../harness/envtest/setup.sh");
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let mut cmd = std::process::Command::new("bash");
            cmd.arg(&script).arg("pause").env("CCM_ENVTEST_CACHE", cache.path()).stdin(std::process::Stdio::null());
            std::thread::spawn(move || cmd.output().expect("running setup.sh"))
        })
        .collect();
    let outputs: Vec<std::process::Output> = runs.into_iter().map(|r| r.join().expect("join")).collect();
    for out in &outputs {
        assert!(out.status.success(), "setup.sh pause failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let paths: std::collections::BTreeSet<String> =
        outputs.iter().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).collect();
    assert_eq!(paths.len(), 1, "every run prints the same tool: {paths:?}");
    let path = std::path::PathBuf::from(paths.first().expect("one path"));
    assert!(path.starts_with(cache.path()) && path.is_file(), "{path:?}");
    let builds = outputs.iter().filter(|o| String::from_utf8_lossy(&o.stderr).contains("setup.sh: building pause")).count();
    assert_eq!(builds, 1, "one build for four runs");
    let dir = path.parent().expect("its directory");
    let left: Vec<_> = std::fs::read_dir(dir)
        .expect("read_dir")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("partial"))
        .collect();
    assert!(left.is_empty(), "partial files left behind: {left:?}");
    // The tool is whole: the pause program starts and exits on SIGTERM.
    let mut pause = std::process::Command::new(&path).spawn().expect("the built pause program starts");
    std::thread::sleep(std::time::Duration::from_millis(200));
    let _ = std::process::Command::new("kill").arg("-TERM").arg(pause.id().to_string()).status();
    assert!(pause.wait().expect("wait").success(), "pause exits 0 on SIGTERM");
}

/// A fresh machine without musl-tools once ran 16 minutes of tests, then failed in the image
/// build instead of skipping the real-kubelet test. Here that test runs as a process of its own
/// on a `PATH` without `musl-gcc` (links to every other program on this one): it skips in one
/// line, quickly, and builds no image.
#[test]
fn the_real_kubelet_test_checks_the_machine_before_it_builds_images() {
    let farm = tempfile::tempdir().expect("tempdir");
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().filter_map(Result::ok) {
            let name = entry.file_name();
            let link = farm.path().join(&name);
            if name != "musl-gcc" && !link.exists() {
                let _ = std::os::unix::fs::symlink(entry.path(), link);
            }
        }
    }
    let mut cmd = std::process::Command::new(std::env::current_exe().expect("this test binary"));
    cmd.args(["real_cluster::the_chart_and_the_kustomize_bases_run_on_real_kubelets", "--exact", "--nocapture"])
        .env("PATH", farm.path())
        .env_remove(ccm_harness::kubelet_cluster::REQUIRE);
    let begin = std::time::Instant::now();
    let (status, stderr) = run_within(cmd, std::time::Duration::from_secs(300));
    assert!(status.success(), "the real-kubelet test failed instead of skipping:\n{stderr}");
    let skipped: Vec<&str> = stderr.lines().filter(|l| l.starts_with("skipped: ")).collect();
    assert_eq!(skipped.len(), 1, "one skipped line:\n{stderr}");
    assert!(!stderr.contains("build.py") && !stderr.contains("build-binaries"), "no image build was started:\n{stderr}");
    if ccm_harness::kubelet_cluster::check_machine().is_ok() {
        assert!(skipped[0].contains("musl-gcc"), "the reason names what is missing: {}", skipped[0]);
    }
    eprintln!("the real-kubelet test skipped in {:.1} s: {}", begin.elapsed().as_secs_f64(), skipped[0]);
}

/// Every process below `pid`, children first found first.
fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        let tasks = std::fs::read_dir(format!("/proc/{p}/task")).map(|d| d.flatten().collect::<Vec<_>>()).unwrap_or_default();
        for task in tasks {
            let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for c in children.split_whitespace().filter_map(|c| c.parse::<u32>().ok()) {
                out.push(c);
                todo.push(c);
            }
        }
    }
    out
}

/// Whether `pid` still runs (a zombie does not).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, rest)| !rest.trim_start().starts_with('Z')))
        .unwrap_or(false)
}

/// A user stops `ccm-bench` half-way, with Ctrl-C in a terminal (SIGINT to the whole foreground
/// process group: the API server and etcd get it too) or with SIGTERM to the benchmark alone:
/// it says so, and leaves no core, API server, etcd or control plane directory behind.
#[test]
fn an_interrupted_benchmark_leaves_nothing_running() {
    use std::os::unix::process::CommandExt;
    let bench = crate::support::workspace_binary("ccm-bench");
    // On a fresh machine the control plane's binaries are built first (minutes), not inside
    // the benchmark's start below, whose wait is bounded.
    ccm_harness::Assets::find().expect("the control plane's binaries");
    for (signal, whole_group) in [("INT", true), ("TERM", false)] {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("bench.log");
        let file = std::fs::File::create(&log).expect("log");
        let mut child = std::process::Command::new(&bench)
            .args(["--nodes", "100", "--services", "2", "--churn", "1", "--steady", "30s", "--unhealthy", "0s"])
            .args(["--cores", "rust", "--core-log", "warn", "--json"])
            .arg(dir.path().join("b.json"))
            .current_dir(dir.path())
            .process_group(0)
            .stdin(std::process::Stdio::null())
            .stdout(file.try_clone().expect("log"))
            .stderr(file)
            .spawn()
            .expect("ccm-bench");
        let pid = child.id();
        // Until the core runs beside the API server and etcd: the join has started.
        let begin = std::time::Instant::now();
        let started = loop {
            let ours = descendants(pid);
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains("== rust:") && ours.len() >= 3 {
                break ours;
            }
            if let Some(status) = child.try_wait().expect("wait") {
                panic!("ccm-bench ended before the signal ({status}):\n{text}");
            }
            assert!(begin.elapsed() < std::time::Duration::from_secs(300), "the core never started:\n{text}");
            std::thread::sleep(std::time::Duration::from_millis(200));
        };
        std::thread::sleep(std::time::Duration::from_secs(2));
        let mut ours = descendants(pid);
        ours.extend(started);
        // The control plane's directory, from the API server's `--cert-dir=<dir>/certs`.
        let cmdline = |p: &u32| std::fs::read_to_string(format!("/proc/{p}/cmdline")).unwrap_or_default().replace('\0', " ");
        let plane_dir = ours
            .iter()
            .map(cmdline)
            .find_map(|c| c.split_whitespace().find_map(|w| w.strip_prefix("--cert-dir=").map(str::to_string)))
            .and_then(|certs| std::path::Path::new(&certs).parent().map(std::path::Path::to_path_buf))
            .expect("the API server among the run's processes");
        let target = if whole_group { format!("-{pid}") } else { pid.to_string() };
        let sent = std::process::Command::new("kill").args([&format!("-{signal}"), "--", &target]).status().expect("kill");
        assert!(sent.success(), "kill -{signal} {target}");
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait") {
                break status;
            }
            assert!(begin.elapsed() < std::time::Duration::from_secs(360), "ccm-bench still ran after SIG{signal}");
            std::thread::sleep(std::time::Duration::from_millis(100));
        };
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(!status.success(), "an interrupted run fails: {status}");
        // A terminal's SIGINT may reach the benchmark's children before the benchmark itself.
        assert!(text.contains("interrupted") || text.contains("terminated") || whole_group, "it says why it stopped:\n{text}");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
        let mut left: Vec<u32> = ours.iter().copied().filter(|p| running(*p)).collect();
        while !left.is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(200));
            left.retain(|p| running(*p));
        }
        let names: Vec<String> = left.iter().map(cmdline).collect();
        assert!(names.is_empty(), "SIG{signal}: processes of the run left behind: {names:#?}");
        while plane_dir.exists() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        assert!(!plane_dir.exists(), "SIG{signal}: {} is left behind", plane_dir.display());
    }
}
