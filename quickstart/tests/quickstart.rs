//! The README's run command: `ccm-quickstart` reports what the core did, keeps running until
//! interrupted, then removes everything it started.

use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quick_start_reports_keeps_running_and_cleans_up_on_interrupt() {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_ccm-quickstart"))
        .args(["--nodes", "3"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    let mut stderr = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let mut seen = Vec::new();
    let running = tokio::time::timeout(Duration::from_secs(300), async {
        while let Some(line) = stderr.next_line().await.expect("read") {
            let done = line.contains("press Ctrl-C");
            seen.push(line);
            if done {
                return true;
            }
        }
        false
    })
    .await
    .expect("the quick start reports within 5 minutes");
    assert!(running, "it keeps running after the report: {seen:#?}");
    for step in ["[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"] {
        assert!(seen.iter().any(|l| l.starts_with(step)), "progress {step} shown: {seen:#?}");
    }

    let pid = child.id().expect("pid").to_string();
    let status = tokio::process::Command::new("kill").args(["-INT", &pid]).status().await.expect("kill");
    assert!(status.success());
    let exit = tokio::time::timeout(Duration::from_secs(30), child.wait()).await.expect("stops in time").expect("wait");
    let mut stdout = String::new();
    child.stdout.take().expect("stdout").read_to_string(&mut stdout).await.expect("stdout");
    assert!(exit.success(), "{exit:?}\n{stdout}");

    for want in [
        "providerID=sim://sim-region-1a/i-0001",
        "zone=sim-region-1b",
        "type=sim.large",
        "team=quickstart",
        "Service default/web (type LoadBalancer)",
        "10.244.1.0/24 -> node-1",
        "10.244.3.0/24 -> node-3",
    ] {
        assert!(stdout.contains(want), "the report shows {want:?}:\n{stdout}");
    }
    let address = stdout.lines().find_map(|l| l.trim().strip_prefix("address ")).expect("a Service address");
    assert!(address.parse::<std::net::IpAddr>().is_ok(), "{address}");
    let kubeconfig = stdout.lines().find_map(|l| l.strip_prefix("kubeconfig: ")).expect("the kubeconfig path");
    let dir = std::path::Path::new(kubeconfig).parent().expect("dir");
    assert!(!dir.exists(), "the control plane's directory {} is removed on exit", dir.display());
}

/// `--real-nodes`: real kubelets, the images, the chart, and a load balancer that answers the
/// printed `curl` (the sim's data plane).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_nodes_quick_start_prints_a_curl_of_the_load_balancer_that_answers() {
    let machine = ccm_harness::kubelet_cluster::check_machine().and_then(|()| ccm_harness::images::check_machine());
    if let Err(why) = machine {
        if std::env::var_os(ccm_harness::kubelet_cluster::REQUIRE).is_some() {
            panic!("{} is set: {why}", ccm_harness::kubelet_cluster::REQUIRE);
        }
        eprintln!("skipped: {why}");
        return;
    }
    let out = tokio::time::timeout(
        Duration::from_secs(900),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_ccm-quickstart"))
            .args(["--real-nodes", "--once", "--nodes", "2"])
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the quick start finishes within 15 minutes")
    .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    let mut lines = stdout.lines().skip_while(|l| !l.starts_with("The load balancer carries traffic"));
    assert!(lines.next().is_some(), "{stdout}");
    let command = lines.next().and_then(|l| l.trim().strip_prefix("$ ")).expect("the curl line");
    let answer = lines.next().unwrap_or_default().trim();
    assert!(command.starts_with("curl http://10.252."), "{command}");
    assert!(answer.starts_with("web-"), "a pod of Deployment web answered: {answer:?}");
    // The pod saw this host's address on the edge's link (10.251.<k>.1): the load balancer
    // kept the client's source.
    assert!(answer.split_whitespace().nth(1).is_some_and(|c| c.starts_with("10.251.")), "{answer}");
}
