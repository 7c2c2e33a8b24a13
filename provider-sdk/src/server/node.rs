//! The node plugin's services: NodeMetadataService and ImageCredentialsService.

use std::sync::Arc;

use ccm_proto::v1 as pb;
use tonic::{Request, Response, Status};

use crate::provider::{ImageCredentials, NodeMetadata};
use ccm_proto::v1::image_credentials_service_server::ImageCredentialsService;
use ccm_proto::v1::node_metadata_service_server::NodeMetadataService;

use super::Observers;

// === impl NodeMetadataAdapter ===

pub(super) struct NodeMetadataAdapter {
    pub(super) inner: Arc<dyn NodeMetadata>,
    pub(super) obs: Observers,
}

#[tonic::async_trait]
impl NodeMetadataService for NodeMetadataAdapter {
    async fn get_node_metadata(
        &self,
        _: Request<pb::GetNodeMetadataRequest>,
    ) -> std::result::Result<Response<pb::GetNodeMetadataResponse>, Status> {
        self.obs
            .call("NodeMetadataService/GetNodeMetadata", async {
                let metadata = self.inner.node_metadata().await?;
                ccm_protocol::answer::node_metadata(&metadata)?;
                Ok(pb::GetNodeMetadataResponse { metadata: Some(metadata) })
            })
            .await
    }
}

// === impl ImageCredentialsAdapter ===

pub(super) struct ImageCredentialsAdapter {
    pub(super) inner: Arc<dyn ImageCredentials>,
    pub(super) obs: Observers,
}

#[tonic::async_trait]
impl ImageCredentialsService for ImageCredentialsAdapter {
    async fn get_image_credentials(
        &self,
        req: Request<pb::GetImageCredentialsRequest>,
    ) -> std::result::Result<Response<pb::GetImageCredentialsResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("ImageCredentialsService/GetImageCredentials", async {
                crate::registry::image_host(&req.image)?;
                let answer = self.inner.image_credentials(&req).await?;
                crate::registry::check_answer_for(&answer, &req.image)?;
                Ok(answer)
            })
            .await
    }
}
