//! TagsService.

use std::sync::Arc;

use ccm_proto::v1 as pb;
use tonic::{Request, Response, Status};

use crate::provider::Tags;
use crate::validate;
use ccm_proto::v1::tags_service_server::TagsService;

use super::Observers;
use super::items::{batch, in_order};

// === impl TagsAdapter ===

pub(super) struct TagsAdapter {
    pub(super) inner: Arc<dyn Tags>,
    pub(super) ttl: Option<prost_types::Duration>,
    pub(super) obs: Observers,
}

#[tonic::async_trait]
impl TagsService for TagsAdapter {
    async fn get_instance_tags(
        &self,
        req: Request<pb::GetInstanceTagsRequest>,
    ) -> std::result::Result<Response<pb::GetInstanceTagsResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("TagsService/GetInstanceTags", async {
                let lookup = validate::lookup(req.instance.as_ref())?;
                let tags = self.inner.instance_tags(lookup).await?;
                Ok(pb::GetInstanceTagsResponse { exists: tags.is_some(), tags: tags.unwrap_or_default(), cache_ttl: self.ttl })
            })
            .await
    }

    async fn batch_get_instance_tags(
        &self,
        req: Request<pb::BatchGetInstanceTagsRequest>,
    ) -> std::result::Result<Response<pb::BatchGetInstanceTagsResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("TagsService/BatchGetInstanceTags", async {
                let answers = batch(&req.instances, async |valid| self.inner.batch_instance_tags(&valid).await).await?;
                let results = answers
                    .into_iter()
                    .map(|answer| {
                        let lookup = Some(answer.lookup);
                        match answer.result {
                            Ok(tags) => pb::InstanceTagsResult {
                                exists: tags.is_some(),
                                tags: tags.unwrap_or_default(),
                                error: None,
                                lookup,
                            },
                            Err(e) => pb::InstanceTagsResult {
                                exists: false,
                                tags: Default::default(),
                                error: Some(e.to_item_error()),
                                lookup,
                            },
                        }
                    })
                    .collect();
                Ok(pb::BatchGetInstanceTagsResponse { results, cache_ttl: self.ttl })
            })
            .await
    }

    async fn batch_set_instance_tags(
        &self,
        req: Request<pb::BatchSetInstanceTagsRequest>,
    ) -> std::result::Result<Response<pb::BatchSetInstanceTagsResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("TagsService/BatchSetInstanceTags", async {
                validate::batch_size(req.updates.len())?;
                let mut keys = Vec::with_capacity(req.updates.len());
                for u in &req.updates {
                    let key = crate::provider::Answered::<()>::key(validate::lookup(u.instance.as_ref())?);
                    if keys.contains(&key) {
                        return Err(crate::Error::invalid_argument(format!(
                            "instance {:?} / {:?} is updated twice in one call",
                            key.provider_id, key.node_name
                        )));
                    }
                    if let Some(k) = u.remove.iter().find(|k| u.set.contains_key(*k)) {
                        return Err(crate::Error::invalid_argument(format!("tag {k:?} is both set and removed")));
                    }
                    if let Some(k) = u.set.keys().chain(&u.remove).find(|k| k.is_empty()) {
                        return Err(crate::Error::invalid_argument(format!("an empty tag key ({k:?})")));
                    }
                    keys.push(key);
                }
                let answers = in_order(&keys, self.inner.batch_set_instance_tags(&req.updates).await?)?;
                let results = answers
                    .into_iter()
                    .map(|a| match a.result {
                        Ok(exists) => pb::SetInstanceTagsResult { exists, error: None, lookup: Some(a.lookup) },
                        Err(e) => {
                            pb::SetInstanceTagsResult { exists: false, error: Some(e.to_item_error()), lookup: Some(a.lookup) }
                        }
                    })
                    .collect();
                Ok(pb::BatchSetInstanceTagsResponse { results })
            })
            .await
    }
}
