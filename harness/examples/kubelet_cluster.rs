//! Starts the harness's real kubelet cluster with the project's images imported and keeps it
//! running until stdin closes or Ctrl-C, printing how to reach it:
//! `cargo run -p ccm-harness --example kubelet_cluster -- [NODES]`.

use std::io::Read;

fn main() -> anyhow::Result<()> {
    let nodes: usize = std::env::args().nth(1).map(|n| n.parse()).transpose()?.unwrap_or(2);
    ccm_harness::kubelet_cluster::check_machine().and_then(|()| ccm_harness::images::check_machine())?;
    let images = ccm_harness::images::project()?;
    let cluster = ccm_harness::kubelet_cluster::KubeletCluster::start(nodes, "kc", &images.archives())?;
    let cp = cluster.control_plane();
    println!("kubelet cluster of {nodes} nodes Ready in {:.1} s", cluster.startup.as_secs_f64());
    println!("export KUBECONFIG={}", cp.kubeconfig_path().display());
    for node in &cluster.nodes {
        println!("node {} at {}: kubelet log {}", node.name, node.ip, node.kubelet_log().display());
    }
    println!("(close stdin or press Ctrl-C to tear it down)");
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    drop(cluster);
    Ok(())
}
