//! Kubernetes' own load balancer tests (`[sig-network] LoadBalancers` and `LoadBalancers
//! ExternalTrafficPolicy: Local` of the pinned release's `test/e2e/network/loadbalancer.go`),
//! run by upstream's `e2e.test` under ginkgo against the chart on a three-node kubelet cluster
//! whose cloud is the sim with its data plane on (`ccm_harness::lb_suite`). The same run as
//! `cargo run -p ccm-harness --example lb_suite`.

use std::path::Path;

use ccm_harness::kubelet_cluster;
use ccm_harness::lb_suite::{self, Options};

use crate::support::workspace_binary;

/// How many tests `loadbalancer.go` has at the pinned release: 13 + 4.
const SUITE_SIZE: usize = 17;

#[test]
#[ignore = "run alone, after the workspace's tests (.ci/run does): its three kubelets and four ginkgo processes would starve the other end-to-end tests on 2 cores; `cargo test -p ccm-e2e --test e2e -- --ignored lb_suite`"]
fn kubernetes_own_load_balancer_tests_pass_against_the_core() {
    if let Err(why) = lb_suite::check_machine() {
        if std::env::var_os(kubelet_cluster::REQUIRE).is_some() {
            panic!("{} is set: {why}", kubelet_cluster::REQUIRE);
        }
        eprintln!("skipped: {why}");
        return;
    }
    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/lb-suite");
    let options = Options::new(workspace_binary("ccm-provider-sim"), out);
    let report = lb_suite::run(&options).expect("the suite ran");
    eprintln!("{}", report.table());
    if let Some(figures) = &report.dataplane {
        eprintln!("{figures}");
    }
    let not_passed: Vec<String> = report
        .outcomes
        .iter()
        .filter(|o| o.state != "passed")
        .map(|o| format!("{} {}: {}", o.state, o.name, o.message))
        .collect();
    assert_eq!(report.outcomes.len(), SUITE_SIZE, "the focus selects loadbalancer.go's tests:\n{}", report.table());
    assert!(not_passed.is_empty(), "{} of {SUITE_SIZE} did not pass:\n{}", not_passed.len(), not_passed.join("\n"));
    // The data plane's own checks ran after the suite: Nodes leaving and coming back were
    // followed, and a connection through a Node that left kept being answered.
    let figures = report.dataplane.expect("the data plane was measured");
    assert_eq!(figures.drained_requests, 5, "{figures}");
    assert!(figures.lb_connections_per_second > 0.0, "{figures}");
}
