//! InstancesService: every lookup validated, batches answered per lookup in request order.

use std::sync::Arc;

use ccm_proto::v1::{self as pb, InstanceState};
use tonic::{Request, Response, Status};

use crate::page::PageRequest;
use crate::provider::Instances;
use crate::validate;
use ccm_proto::v1::instances_service_server::InstancesService;

use super::Observers;
use super::items::batch;

// === impl InstancesAdapter ===

pub(super) struct InstancesAdapter {
    pub(super) inner: Arc<dyn Instances>,
    pub(super) ttl: Option<prost_types::Duration>,
    pub(super) obs: Observers,
}

/// Terminated instances do not exist, whatever the provider's metadata says.
pub(super) fn existing(m: Option<pb::InstanceMetadata>) -> Option<pb::InstanceMetadata> {
    m.filter(|m| m.state() != InstanceState::Terminated)
}

#[tonic::async_trait]
impl InstancesService for InstancesAdapter {
    async fn instance_exists(
        &self,
        req: Request<pb::InstanceExistsRequest>,
    ) -> std::result::Result<Response<pb::InstanceExistsResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("InstancesService/InstanceExists", async {
                let lookup = validate::lookup(req.instance.as_ref())?;
                Ok(pb::InstanceExistsResponse { exists: self.inner.instance_exists(lookup).await? })
            })
            .await
    }

    async fn instance_shutdown(
        &self,
        req: Request<pb::InstanceShutdownRequest>,
    ) -> std::result::Result<Response<pb::InstanceShutdownResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("InstancesService/InstanceShutdown", async {
                let lookup = validate::lookup(req.instance.as_ref())?;
                Ok(match self.inner.instance_shutdown(lookup).await? {
                    Some(shutdown) => pb::InstanceShutdownResponse { exists: true, shutdown },
                    None => pb::InstanceShutdownResponse { exists: false, shutdown: false },
                })
            })
            .await
    }

    async fn instance_metadata(
        &self,
        req: Request<pb::InstanceMetadataRequest>,
    ) -> std::result::Result<Response<pb::InstanceMetadataResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("InstancesService/InstanceMetadata", async {
                let lookup = validate::lookup(req.instance.as_ref())?;
                let metadata = existing(self.inner.instance_metadata(lookup).await?);
                Ok(pb::InstanceMetadataResponse { exists: metadata.is_some(), metadata, cache_ttl: self.ttl })
            })
            .await
    }

    async fn batch_instance_metadata(
        &self,
        req: Request<pb::BatchInstanceMetadataRequest>,
    ) -> std::result::Result<Response<pb::BatchInstanceMetadataResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("InstancesService/BatchInstanceMetadata", async {
                let answers = batch(&req.instances, async |valid| self.inner.batch_instance_metadata(&valid).await).await?;
                let results = answers
                    .into_iter()
                    .map(|answer| {
                        let lookup = Some(answer.lookup);
                        match answer.result {
                            Ok(m) => {
                                let metadata = existing(m);
                                pb::InstanceMetadataResult { exists: metadata.is_some(), metadata, error: None, lookup }
                            }
                            Err(e) => pb::InstanceMetadataResult {
                                exists: false,
                                metadata: None,
                                error: Some(e.to_item_error()),
                                lookup,
                            },
                        }
                    })
                    .collect();
                Ok(pb::BatchInstanceMetadataResponse { results, cache_ttl: self.ttl })
            })
            .await
    }

    async fn list_instances(
        &self,
        req: Request<pb::ListInstancesRequest>,
    ) -> std::result::Result<Response<pb::ListInstancesResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("InstancesService/ListInstances", async {
                let page = PageRequest::new(req.page_size, req.page_token);
                page.after()?;
                let page = self.inner.list_instances(&page).await?;
                Ok(pb::ListInstancesResponse {
                    instances: page.items,
                    next_page_token: page.next_page_token,
                    cache_ttl: self.ttl,
                })
            })
            .await
    }
}
