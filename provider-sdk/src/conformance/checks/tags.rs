//! TagsService: tags of known and unknown instances, batches that match single calls, and
//! (when advertised) tags written, updated and removed without touching any other tag.

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

    /// The tags of `lookup`'s instance, read with GetInstanceTags.
    async fn read_tags(&self, lookup: &pb::InstanceLookup) -> Result<std::collections::HashMap<String, String>, Not> {
        let r = self
            .tags
            .clone()
            .get_instance_tags(self.req(pb::GetInstanceTagsRequest { instance: Some(lookup.clone()) }))
            .await
            .ctx("GetInstanceTags")?;
        Ok(r.tags)
    }

    /// BatchSetInstanceTags of one update; its one result.
    async fn set_tags(&self, update: pb::InstanceTagsUpdate) -> Result<pb::SetInstanceTagsResult, Not> {
        let lookup = update.instance.clone().unwrap_or_default();
        let r = self
            .tags
            .clone()
            .batch_set_instance_tags(self.req(pb::BatchSetInstanceTagsRequest { updates: vec![update] }))
            .await
            .ctx("BatchSetInstanceTags")?;
        let mut results = by_lookup("BatchSetInstanceTags", std::slice::from_ref(&lookup), &r.results, |r| r.lookup.as_ref())?;
        results.pop().cloned().ok_or_else(|| fail("BatchSetInstanceTags answered nothing"))
    }

    /// With `set_tags` advertised: a tag of this run is written to a known instance, updated,
    /// and removed, each visible to GetInstanceTags, and no other tag of the instance changes;
    /// an unknown instance is exists=false; a key both set and removed is INVALID_ARGUMENT.
    pub(super) async fn tags_set(&mut self) -> Check {
        if !self.caps.tags.as_ref().is_some_and(|t| t.set_tags) {
            return Err(skip("TagsCapabilities.set_tags is not advertised"));
        }
        let known = self.first_known()?;
        let lookup = by_provider_id(&known);
        let before = self.read_tags(&lookup).await?;
        let key = format!("ccm-conformance-{}", self.run_id);
        for value in ["one", "two"] {
            let update = pb::InstanceTagsUpdate {
                instance: Some(lookup.clone()),
                set: [(key.clone(), value.to_string())].into(),
                remove: Vec::new(),
            };
            let r = self.set_tags(update).await?;
            ensure(r.error.is_none() && r.exists, || format!("setting tag {key}={value}: {r:?}"))?;
            self.eventually(async || {
                let now = self.read_tags(&lookup).await?;
                let mut want = before.clone();
                want.insert(key.clone(), value.to_string());
                ensure(now == want, || format!("after setting {key}={value}: {now:?}, want {want:?}"))
            })
            .await?;
        }
        let remove =
            pb::InstanceTagsUpdate { instance: Some(lookup.clone()), set: Default::default(), remove: vec![key.clone()] };
        let r = self.set_tags(remove.clone()).await?;
        ensure(r.error.is_none() && r.exists, || format!("removing tag {key}: {r:?}"))?;
        self.eventually(async || {
            let now = self.read_tags(&lookup).await?;
            ensure(now == before, || format!("after removing {key}: {now:?}, want {before:?}"))
        })
        .await?;
        let again = self.set_tags(remove).await?;
        ensure(again.error.is_none(), || format!("removing an absent tag failed: {again:?}"))?;
        let unknown = pb::InstanceTagsUpdate {
            instance: Some(self.unknown_by_name()),
            set: [(key.clone(), "x".to_string())].into(),
            remove: Vec::new(),
        };
        let r = self.set_tags(unknown).await?;
        ensure(!r.exists && r.error.is_none(), || format!("an unknown instance: {r:?} (want exists=false)"))?;
        let both =
            pb::InstanceTagsUpdate { instance: Some(lookup), set: [(key.clone(), "x".to_string())].into(), remove: vec![key] };
        let r =
            self.tags.clone().batch_set_instance_tags(self.req(pb::BatchSetInstanceTagsRequest { updates: vec![both] })).await;
        expect_code(r, Code::InvalidArgument, "BatchSetInstanceTags setting and removing one key")
    }
}
