//! InstancesService: instance metadata for lookups, 500 a call, each answer matched to its
//! lookup by the name it carries and checked.

use ccm_proto::v1 as pb;
use futures::future::join_all;

use super::{PerLookup, in_batches, instance, instances_client};
use crate::provider::Provider;
use crate::provider::convert::{Instance, InstanceLookups};

impl Provider {
    /// What the cloud says of each lookup's instance: `Ok(None)` when it does not exist. One
    /// call per 500 lookups when the provider batches reads, else one per lookup. A batch
    /// answer of the wrong length fails its lookups; an answer about another instance than
    /// its lookup (a reordered batch), "exists" without metadata, or metadata that fails
    /// [`answer::instance`] fails its own lookup; none of them ever reads as "gone".
    pub async fn instance_metadata(&self, lookups: &InstanceLookups) -> PerLookup<Option<Instance>> {
        let lookups = lookups.0.as_slice();
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
        answers.into_iter().map(|a| a.map(|m| m.map(Instance::from))).collect()
    }
}
