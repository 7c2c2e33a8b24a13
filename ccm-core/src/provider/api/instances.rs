//! InstancesService: instance metadata for lookups, 500 a call, each answer matched to its
//! lookup by the name it carries and checked.

use std::collections::HashMap;
use std::time::Duration;

use ccm_proto::v1 as pb;
use ccm_protocol::lock::Lock;
use futures::future::join_all;
use k8s_openapi::api::core::v1::Node;
use tokio::time::Instant;

use super::{PerLookup, in_batches, instance, instances_client};
use crate::node_util;
use crate::provider::Provider;
use crate::provider::convert::{Instance, InstanceLookups, InstanceState};

/// How long an answer is kept: longer than any controller's question interval.
const KEEP: Duration = Duration::from_secs(900);

/// The last answer about each instance, by (Node name, providerID): when it came, and the
/// state (`None`: the instance does not exist). Errors are not answers.
#[derive(Debug, Default)]
pub struct RecentStates {
    by_lookup: HashMap<(String, String), (Instant, Option<InstanceState>)>,
    pruned: Option<Instant>,
}

impl RecentStates {
    fn record(&mut self, lookups: &[pb::InstanceLookup], answers: &PerLookup<Option<Instance>>, at: Instant) {
        for (lookup, answer) in lookups.iter().zip(answers) {
            if let Ok(answer) = answer {
                let key = (lookup.node_name.clone(), lookup.provider_id.clone());
                self.by_lookup.insert(key, (at, answer.as_ref().map(|m| m.state)));
            }
        }
        if self.pruned.is_none_or(|p| p.elapsed() >= KEEP) {
            self.by_lookup.retain(|_, (t, _)| t.elapsed() < KEEP);
            self.pruned = Some(Instant::now());
        }
    }
}

impl Provider {
    /// What the cloud says of each lookup's instance: `Ok(None)` when it does not exist. One
    /// call per 500 lookups when the provider batches reads, else one per lookup. A batch
    /// answer of the wrong length fails its lookups; an answer about another instance than
    /// its lookup (a reordered batch), "exists" without metadata, or metadata that fails
    /// [`answer::instance`] fails its own lookup; none of them ever reads as "gone".
    pub async fn instance_metadata(&self, lookups: &InstanceLookups) -> PerLookup<Option<Instance>> {
        let lookups = lookups.0.as_slice();
        // An answer counts from when it was asked for: the cloud may have changed since.
        let sent = Instant::now();
        let identity = self.identity();
        let (method, answers) = if self.identity().is_some_and(|i| i.batch_reads()) {
            const METHOD: &str = "InstancesService/BatchInstanceMetadata";
            let call = |instances: Vec<pb::InstanceLookup>| async move {
                let request = pb::BatchInstanceMetadataRequest { instances };
                let rpc = async |ch, r| instances_client(ch).batch_instance_metadata(r).await;
                self.call(METHOD, request, rpc).await.map(|a| a.results)
            };
            let answers = in_batches(
                METHOD,
                lookups,
                call,
                |r: &pb::InstanceMetadataResult| r.lookup.as_ref(),
                |r: pb::InstanceMetadataResult| match r.error {
                    Some(e) => Err(self.item_error(&e)),
                    None => Ok((r.exists, r.metadata)),
                },
            )
            .await;
            (METHOD, answers)
        } else {
            const METHOD: &str = "InstancesService/InstanceMetadata";
            let answers = join_all(lookups.iter().map(|lookup| async move {
                let request = pb::InstanceMetadataRequest { instance: Some(lookup.clone()) };
                let rpc = async |ch, r| instances_client(ch).instance_metadata(r).await;
                self.call(METHOD, request, rpc).await.map(|a| (a.exists, a.metadata))
            }))
            .await;
            (METHOD, answers)
        };
        let answers: PerLookup<_> = lookups
            .iter()
            .zip(answers)
            .map(|(lookup, answer)| answer.and_then(|(exists, m)| instance(method, lookup, exists, m, identity.as_deref())))
            .collect();
        self.count_invalid(method, &answers);
        let answers: PerLookup<Option<Instance>> = answers.into_iter().map(|a| a.map(|m| m.map(Instance::from))).collect();
        self.recent.locked().record(lookups, &answers, sent);
        answers
    }

    /// The last answer any read of this process had about `node`'s instance: when it was
    /// sent, and the instance's state (`None`: it does not exist).
    pub fn recent_state(&self, node: &Node) -> Option<(Instant, Option<InstanceState>)> {
        let key = (node_util::name(node).to_string(), node_util::provider_id(node).unwrap_or_default().to_string());
        self.recent.locked().by_lookup.get(&key).copied()
    }
}
