//! TagsService: instance tags for lookups, 500 a call.

use std::collections::BTreeMap;

use ccm_proto::v1 as pb;

use super::{PerLookup, in_batches, tags_client};
use crate::provider::Provider;
use crate::provider::convert::InstanceLookups;

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
}
