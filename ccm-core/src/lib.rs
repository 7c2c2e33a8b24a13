//! # ccm-core
//!
//! The generic cloud-controller-manager: it knows Kubernetes and the `cloudprovider.v1`
//! protocol, and no cloud.

pub mod clock;
pub mod compat;
pub mod controllers;
pub mod credentials;
pub mod delegation;
pub mod events;
pub mod http;
pub mod informer;
pub mod labels;
pub mod leader;
pub mod logging;
pub mod metrics;
pub mod node_util;
pub mod options;
pub mod provider;
pub mod queue;
pub mod runtime;
pub mod supervisor;
pub mod uninstall;
pub mod upstream_metrics;
pub mod version;
pub mod wellknown;
