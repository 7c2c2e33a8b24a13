//! # ccm-provider-sdk
//!
//! What a cloud provider author needs to serve `cloudprovider.v1` to the generic
//! cloud-controller-manager core: one trait per service ([`provider`]), a server on a unix
//! socket or TCP ([`ProviderServer`]) that checks requests before a provider's code runs
//! ([`validate`]), helpers every provider needs ([`page`], [`cache`]), Prometheus call
//! metrics ([`metrics`]) and a conformance suite that checks any provider over its endpoint
//! ([`conformance`]). The error model, limits, naming rules, answer checks, rate limiter and
//! connector are `ccm-protocol`'s, shared with the core, and re-exported here ([`Error`],
//! [`names`], [`ratelimit`], [`client`], [`tls`], [`registry`]).
//!
//! See `README.md` in this crate for a provider author's guide.

pub mod cache;
pub mod conformance;
mod locks;
pub mod metrics;
pub mod node_plugin;
pub mod owner;
pub mod page;
pub mod provider;
pub mod server;
pub mod validate;

pub use ccm_proto::v1 as proto;
pub use ccm_protocol::{Error, Result, reason};
/// What both sides of the protocol share, from `ccm-protocol`, under the names provider
/// code has always used.
pub use ccm_protocol::{client, error, names, ratelimit, registry, tls};
pub use page::{Page, PageRequest, paginate, token_for};
pub use provider::{
    Answered, AppliedRoutes, ImageCredentials, Instances, LoadBalancers, NodeMetadata, Probe, Readiness, Routes, Tags,
};
pub use server::{CallObserver, Listen, ProviderServer};
/// The attribute for implementing the provider traits: `#[ccm_provider_sdk::async_trait]`.
pub use tonic::async_trait;
