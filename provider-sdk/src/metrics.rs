//! Prometheus metrics of the calls a provider server answers.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tonic::Code;

use crate::server::CallObserver;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    method: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabels {
    method: String,
}

/// `cloudprovider_server_calls_total{method,code}` and
/// `cloudprovider_server_call_duration_seconds{method}`; register with [`CallMetrics::register`]
/// and hand to [`crate::ProviderServer::observe`].
#[derive(Debug, Clone)]
pub struct CallMetrics {
    calls: Family<CallLabels, Counter>,
    duration: Family<MethodLabels, Histogram>,
}

impl Default for CallMetrics {
    fn default() -> Self {
        Self {
            calls: Family::default(),
            duration: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.0005, 2.0, 16))),
        }
    }
}

impl CallMetrics {
    /// New metrics, registered in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register("cloudprovider_server_calls", "Calls answered, by method and gRPC code", m.calls.clone());
        registry.register("cloudprovider_server_call_duration_seconds", "Time to answer a call, by method", m.duration.clone());
        m
    }
}

pub use ccm_protocol::error::code_name;

impl CallObserver for CallMetrics {
    fn observe(&self, method: &'static str, code: Code, elapsed: Duration) {
        self.calls.get_or_create(&CallLabels { method: method.to_string(), code: code_name(code).to_string() }).inc();
        self.duration.get_or_create(&MethodLabels { method: method.to_string() }).observe(elapsed.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_calls_by_method_and_code() {
        let mut registry = Registry::default();
        let m = CallMetrics::register(&mut registry);
        m.observe("InstancesService/InstanceExists", Code::Ok, Duration::from_millis(2));
        m.observe("InstancesService/InstanceExists", Code::ResourceExhausted, Duration::from_millis(1));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        assert!(
            text.contains(
                r#"cloudprovider_server_calls_total{method="InstancesService/InstanceExists",code="RESOURCE_EXHAUSTED"} 1"#
            ),
            "{text}"
        );
        assert!(text.contains("cloudprovider_server_call_duration_seconds_count"), "{text}");
    }
}
