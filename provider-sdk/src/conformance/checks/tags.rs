//! TagsService: tags of known and unknown instances, and batches that match single calls.

use super::*;

impl<F: FnMut(&CheckResult)> Suite<F> {
    pub(super) async fn tags_known(&mut self) -> Check {
        let known = self.first_known()?;
        let r = self
            .tags
            .clone()
            .get_instance_tags(self.req(pb::GetInstanceTagsRequest { instance: Some(by_provider_id(&known)) }))
            .await
            .ctx("GetInstanceTags")?;
        ensure(r.exists, || format!("listed instance {} has no tags answer", known.provider_id))?;
        ensure(r.tags.keys().all(|k| !k.is_empty()), || "a tag has an empty key".into())
    }

    pub(super) async fn tags_unknown(&mut self) -> Check {
        let r = self
            .tags
            .clone()
            .get_instance_tags(self.req(pb::GetInstanceTagsRequest { instance: Some(self.unknown_by_name()) }))
            .await
            .ctx("GetInstanceTags of an unknown instance (must be OK with exists=false)")?;
        ensure(!r.exists, || "an unknown instance has tags".into())
    }

    pub(super) async fn tags_empty_lookup(&mut self) -> Check {
        let r = self.tags.clone().get_instance_tags(self.req(pb::GetInstanceTagsRequest { instance: None })).await;
        expect_code(r, Code::InvalidArgument, "GetInstanceTags without a lookup")
    }

    /// With `metadata_tags` advertised, the metadata of an instance carries the tags
    /// TagsService answers for it (the core then reads no tags of its own).
    pub(super) async fn tags_in_metadata(&mut self) -> Check {
        let advertised = self.caps.instances.as_ref().is_some_and(|i| i.metadata_tags);
        if !advertised || !self.advertises(ServiceType::Instances) {
            return Err(skip("InstancesCapabilities.metadata_tags is not advertised"));
        }
        if self.known.is_empty() {
            return Err(skip("no instance is listed"));
        }
        let lookups: Vec<pb::InstanceLookup> = self.known.iter().take(10).map(by_provider_id).collect();
        let metadata = self
            .instances
            .clone()
            .batch_instance_metadata(self.req(pb::BatchInstanceMetadataRequest { instances: lookups.clone() }))
            .await
            .ctx("BatchInstanceMetadata")?;
        let results = by_lookup("BatchInstanceMetadata", &lookups, &metadata.results, |r| r.lookup.as_ref())?;
        for (lookup, answer) in lookups.iter().zip(results) {
            let tags = self
                .tags
                .clone()
                .get_instance_tags(self.req(pb::GetInstanceTagsRequest { instance: Some(lookup.clone()) }))
                .await
                .ctx("GetInstanceTags")?;
            let in_metadata = answer.metadata.as_ref().map(|m| m.tags.clone()).unwrap_or_default();
            ensure(in_metadata == tags.tags, || {
                format!("{}: the metadata's tags {in_metadata:?} are not TagsService's {:?}", lookup.provider_id, tags.tags)
            })?;
        }
        Ok(())
    }

    pub(super) async fn tags_batch(&mut self) -> Check {
        if self.known.is_empty() {
            return Err(skip("no instance is listed"));
        }
        let lookups: Vec<pb::InstanceLookup> = self.known.iter().take(10).map(by_provider_id).collect();
        let r = self
            .tags
            .clone()
            .batch_get_instance_tags(self.req(pb::BatchGetInstanceTagsRequest { instances: lookups.clone() }))
            .await
            .ctx("BatchGetInstanceTags")?;
        let results = by_lookup("BatchGetInstanceTags", &lookups, &r.results, |r| r.lookup.as_ref())?;
        for (lookup, batch) in lookups.iter().zip(results) {
            let single = self
                .tags
                .clone()
                .get_instance_tags(self.req(pb::GetInstanceTagsRequest { instance: Some(lookup.clone()) }))
                .await
                .ctx("GetInstanceTags")?;
            ensure(batch.error.is_none() && batch.exists == single.exists && batch.tags == single.tags, || {
                format!("{}: batch {batch:?} differs from single {single:?}", lookup.provider_id)
            })?;
        }
        Ok(())
    }
}
