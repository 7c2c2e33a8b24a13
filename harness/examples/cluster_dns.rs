//! Checks the cluster DNS on a real kubelet cluster of its own: starts one (two nodes, prefix
//! `dns`, the agnhost image imported), removes the `uninitialized` taint (no
//! cloud-controller-manager runs here), installs CoreDNS ([`ccm_harness::cluster_dns::install`]),
//! then from an agnhost pod resolves `kubernetes.default.svc.cluster.local`, a Service of the
//! pod's namespace by its short name (the kubelet's search path) and connects to it by name, as
//! the upstream LoadBalancers tests do; tears the cluster down at the end:
//! `cargo run -p ccm-harness --example cluster_dns`.

use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};
use ccm_harness::kubelet_cluster::KubeletCluster;
use ccm_harness::{cluster_dns, e2e_images};

fn run(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.stdin(Stdio::null()).output().with_context(|| format!("starting {cmd:?}"))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        bail!("{cmd:?} failed ({}): {}", out.status, text.trim());
    }
    Ok(text)
}

fn main() -> anyhow::Result<()> {
    ccm_harness::kubelet_cluster::check_machine()
        .and_then(|()| e2e_images::check_machine())
        .and_then(|()| cluster_dns::check_machine())?;
    let images = e2e_images::upstream_test_images()?;
    let dns_image = cluster_dns::image()?;
    let cluster = KubeletCluster::start(2, "dns", &images)?;
    println!("kubelet cluster {} Ready in {:.1} s", cluster.id(), cluster.startup.as_secs_f64());
    let result = check(&cluster, &dns_image);
    drop(cluster);
    result
}

fn check(cluster: &KubeletCluster, dns_image: &std::path::Path) -> anyhow::Result<()> {
    let k = |args: &[&str]| run(&mut cluster.kubectl(args));
    k(&["taint", "nodes", "--all", "node.cloudprovider.kubernetes.io/uninitialized-"])?;
    let begin = Instant::now();
    cluster_dns::install(cluster)?;
    println!("cluster DNS ({}, {}) Ready in {:.1} s", cluster_dns::IMAGE, dns_image.display(), begin.elapsed().as_secs_f64());
    print!("{}", k(&["-n", "kube-system", "get", "pods,svc,endpointslices", "-l", "k8s-app=kube-dns", "-o", "wide"])?);

    // A pod serving HTTP on 8080 behind Service dns-check:80, in namespace default.
    k(&[
        "run",
        "dnsutil",
        "--image",
        e2e_images::AGNHOST,
        "--image-pull-policy=Never",
        "--labels=app=dnsutil",
        "--restart=Never",
        "--",
        "netexec",
        "--http-port=8080",
    ])?;
    k(&["create", "service", "clusterip", "dns-check", "--tcp=80:8080"])?;
    k(&["set", "selector", "service/dns-check", "app=dnsutil"])?;
    k(&["wait", "--for=condition=Ready", "pod/dnsutil", "--timeout=120s"])?;
    let kubernetes_ip = k(&["get", "svc", "kubernetes", "-o", "jsonpath={.spec.clusterIP}"])?;
    let check_ip = k(&["get", "svc", "dns-check", "-o", "jsonpath={.spec.clusterIP}"])?;

    let exec = |script: &str| k(&["exec", "dnsutil", "--", "/bin/sh", "-c", script]);
    println!("--- resolv.conf\n{}", exec("cat /etc/resolv.conf")?.trim());
    // Busybox's nslookup asks for every name of the search path at once and fails if any is
    // NXDOMAIN: what counts is the answer for the full name.
    for (name, fqdn, want) in [
        ("kubernetes.default.svc.cluster.local", "kubernetes.default.svc.cluster.local", &kubernetes_ip),
        ("dns-check.default.svc.cluster.local", "dns-check.default.svc.cluster.local", &check_ip),
        ("dns-check", "dns-check.default.svc.cluster.local", &check_ip),
    ] {
        let out = exec(&format!("nslookup {name} || true"))?;
        println!("--- nslookup {name}\n{}", out.trim());
        if !out.contains(&format!("Name:\t{fqdn}\nAddress: {want}\n")) {
            bail!("nslookup {name} did not answer {fqdn} = {want}");
        }
    }
    // Over TCP: an A query for kubernetes.default.svc.cluster.local (length-prefixed) whose
    // answer must carry the Service's address.
    let query = r"\000\066\022\064\001\000\000\001\000\000\000\000\000\000\012kubernetes\007default\003svc\007cluster\005local\000\000\001\000\001";
    let hex = exec(&format!(
        "printf '{query}' | nc -w 2 {} 53 | od -An -tx1 | tr -d ' \\n'",
        ccm_harness::kubelet_cluster::CLUSTER_DNS
    ))?;
    let want: String = kubernetes_ip.split('.').map(|o| o.parse::<u8>().map(|o| format!("{o:02x}"))).collect::<Result<_, _>>()?;
    println!(
        "--- the same over TCP: {} bytes, {}",
        hex.trim().len() / 2,
        if hex.contains(&want) { "answered" } else { "no answer" }
    );
    if !hex.contains(&want) {
        bail!("the TCP query was not answered with {kubernetes_ip}: {hex}");
    }
    // By short name through the resolver's search path (glibc, OpenBSD netcat), as the
    // LoadBalancers tests' `nc -v -t -w 2 <service> <port>` does.
    let out = exec("echo hostName | nc -v -t -w 2 dns-check 80")?;
    println!("--- nc -v -t -w 2 dns-check 80\n{}", out.trim());
    let out = exec("nslookup no-such-service.default.svc.cluster.local || true")?;
    println!("--- nslookup no-such-service.default.svc.cluster.local\n{}", out.trim());
    if !out.contains("NXDOMAIN") {
        bail!("a name that does not exist did not get NXDOMAIN");
    }
    print!("--- CoreDNS's log\n{}", k(&["-n", "kube-system", "logs", "-l", "k8s-app=kube-dns", "--tail=20"])?);
    println!("cluster DNS check passed");
    Ok(())
}
