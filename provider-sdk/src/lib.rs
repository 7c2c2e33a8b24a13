//! # ccm-provider-sdk
//!
//! What a cloud provider author needs to serve `cloudprovider.v1` to the generic
//! cloud-controller-manager core: one trait per service ([`provider`]), one error type mapped
//! to gRPC status in one place ([`Error`]), a server on a unix socket or TCP
//! ([`ProviderServer`]), helpers every provider needs ([`names`], [`page`], [`cache`],
//! [`ratelimit`]), a client connector ([`client`]), Prometheus call metrics ([`metrics`]) and
//! a conformance suite that checks any provider over its endpoint ([`conformance`]).
//!
//! See `README.md` in this crate for a provider author's guide.

pub mod cache;
pub mod client;
pub mod conformance;
pub mod error;
pub mod metrics;
pub mod names;
pub mod node_plugin;
pub mod page;
pub mod provider;
pub mod ratelimit;
pub mod registry;
pub mod server;
pub mod tls;
pub mod validate;

pub use ccm_proto::v1 as proto;
pub use error::{Error, Result, reason};
pub use page::{Page, PageRequest, paginate, token_for};
pub use provider::{ImageCredentials, Instances, LoadBalancers, NodeMetadata, Probe, Readiness, Routes, Tags};
pub use server::{CallObserver, Listen, ProviderServer};
/// The attribute for implementing the provider traits: `#[ccm_provider_sdk::async_trait]`.
pub use tonic::async_trait;
