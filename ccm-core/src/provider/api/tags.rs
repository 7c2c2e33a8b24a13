//! TagsService: instance tags for lookups, 500 a call.

use std::collections::BTreeMap;

use ccm_proto::v1 as pb;

use super::{PerLookup, in_batches, tags_client};
use crate::leader::Fence;
use crate::provider::Provider;
use crate::provider::convert::InstanceLookups;

/// The tags to write to one instance: `set` added or updated, `remove` removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TagChange {
    /// Tags to add or update.
    pub set: BTreeMap<String, String>,
    /// Tag keys to remove.
    pub remove: Vec<String>,
}

impl Provider {
    /// Each lookup's instance tags, 500 lookups a call.
    pub async fn instance_tags(&self, lookups: &InstanceLookups) -> PerLookup<BTreeMap<String, String>> {
        let lookups = lookups.0.as_slice();
        const METHOD: &str = "TagsService/BatchGetInstanceTags";
        let call = |instances: Vec<pb::InstanceLookup>| async move {
            let request = pb::BatchGetInstanceTagsRequest { instances };
            let rpc = async |ch, r| tags_client(ch).batch_get_instance_tags(r).await;
            self.call(METHOD, request, rpc).await.map(|a| a.results)
        };
        let answers = in_batches(
            METHOD,
            lookups,
            call,
            |r: &pb::InstanceTagsResult| r.lookup.as_ref(),
            |r: pb::InstanceTagsResult| match r.error {
                Some(e) => Err(self.item_error(&e)),
                None => Ok(r.tags.into_iter().collect()),
            },
        )
        .await;
        self.count_invalid(METHOD, &answers);
        answers
    }

    /// Writes each lookup's tag change (fenced), 500 a call: per lookup `Ok(false)` when the
    /// instance does not exist (nothing written).
    pub(in crate::provider) async fn batch_set_instance_tags(
        &self,
        fence: Option<&Fence>,
        lookups: &InstanceLookups,
        changes: &[TagChange],
    ) -> PerLookup<bool> {
        const METHOD: &str = "TagsService/BatchSetInstanceTags";
        let lookups = lookups.0.as_slice();
        let by_key: std::collections::HashMap<(&str, &str), &TagChange> =
            lookups.iter().zip(changes).map(|(l, c)| ((l.provider_id.as_str(), l.node_name.as_str()), c)).collect();
        let call = |instances: Vec<pb::InstanceLookup>| {
            let by_key = &by_key;
            async move {
                let updates = instances
                    .into_iter()
                    .map(|l| {
                        let change =
                            by_key.get(&(l.provider_id.as_str(), l.node_name.as_str())).copied().cloned().unwrap_or_default();
                        pb::InstanceTagsUpdate { instance: Some(l), set: change.set.into_iter().collect(), remove: change.remove }
                    })
                    .collect();
                let request = pb::BatchSetInstanceTagsRequest { updates };
                let rpc = async |ch, r| tags_client(ch).batch_set_instance_tags(r).await;
                self.call_fenced(fence, METHOD, request, rpc).await.map(|a| a.results)
            }
        };
        let answers = in_batches(
            METHOD,
            lookups,
            call,
            |r: &pb::SetInstanceTagsResult| r.lookup.as_ref(),
            |r: pb::SetInstanceTagsResult| match r.error {
                Some(e) => Err(self.item_error(&e)),
                None => Ok(r.exists),
            },
        )
        .await;
        self.count_invalid(METHOD, &answers);
        answers
    }
}
