//! # ccm-protocol
//!
//! The rules of `cloudprovider.v1` that both sides keep, in one place: the core, the provider
//! SDK and the kubelet-side client all use this crate, and it uses none of them. `ccm-proto`
//! holds the wire types; this crate holds what the `.proto` files say in prose:
//!
//! - [`error`]: the error model (one [`Error`], its gRPC code, its stable `ErrorInfo`
//!   [`reason`]s and `RetryInfo`), and how batch items carry errors;
//! - [`limits`]: batch size, route name length, message size;
//! - [`labels`] and [`names`]: Kubernetes' label rules and load balancer naming;
//! - [`answer`] and [`registry`]: the checks a provider's answers pass before anyone acts on
//!   them, and image references and registry patterns;
//! - [`lock`]: the one way either side takes a mutex;
//! - [`ratelimit`]: the token bucket that answers "retry after" (a provider's throttle, the
//!   core's queue);
//! - [`client`] and [`tls`]: endpoint addresses (`unix://`, `tcp://`, `https://`) and the
//!   mutual TLS files of either side.
//!
//! Nothing here serves or runs anything; the server is the SDK's, the controllers the core's.

pub mod answer;
pub mod client;
pub mod error;
pub mod labels;
pub mod limits;
pub mod lock;
pub mod names;
pub mod ratelimit;
pub mod registry;
pub mod tls;

pub use error::{Error, Result, reason};
