//! End-to-end tests against a real kube-apiserver and etcd. One test binary (each binary
//! links kube, tonic and the rest: minutes on 2 cores) with a module per area; one control
//! plane shared by all its tests, each isolated by namespace and Node-name prefix.

mod aws;
mod ci_script;
mod cloud_cidrs;
mod deploy;
mod faults;
mod go_adapter;
mod harness;
mod hybrid;
mod isolation;
mod lb_repair;
mod lb_suite;
mod leader;
mod leader_change;
mod migration;
mod mtls;
mod node_metadata;
mod node_selector;
mod nodes;
mod real_cluster;
mod release;
mod routes;
mod services;
mod serving;
mod smoke;
mod support;
mod tagging;
mod trust;
mod upstream;
