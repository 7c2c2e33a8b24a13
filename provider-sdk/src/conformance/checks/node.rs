//! NodeMetadataService and ImageCredentialsService: the node plugin's answers, and that they agree with InstancesService.

use super::*;

impl<F: FnMut(&CheckResult)> Suite<F> {
    pub(super) async fn node_metadata_get(&mut self) -> Check {
        let r =
            self.node_metadata.clone().get_node_metadata(self.req(pb::GetNodeMetadataRequest {})).await.ctx("GetNodeMetadata")?;
        let m = r.metadata.ok_or_else(|| fail("GetNodeMetadata answered no metadata"))?;
        ccm_protocol::answer::node_metadata(&m).map_err(|e| fail(e.to_string()))?;
        for a in &m.addresses {
            valid_address(a).map_err(fail)?;
        }
        Ok(())
    }

    pub(super) async fn image_credentials_answer(&mut self) -> Check {
        let request = pb::GetImageCredentialsRequest { image: IMAGE.into(), ..Default::default() };
        let r = self.image_credentials.clone().get_image_credentials(self.req(request)).await.ctx("GetImageCredentials")?;
        // The answer is checked without ever printing it: it may hold secrets.
        crate::registry::check_answer_for(&r, IMAGE).map_err(|e| fail(e.to_string()))
    }

    pub(super) async fn image_credentials_invalid(&mut self) -> Check {
        let request = pb::GetImageCredentialsRequest { image: "https://not an image".into(), ..Default::default() };
        let r = self.image_credentials.clone().get_image_credentials(self.req(request)).await;
        expect_code(
            r.map(|r| Response::new(r.into_inner().auth.len())),
            Code::InvalidArgument,
            "GetImageCredentials of a malformed image",
        )
    }

    pub(super) async fn node_metadata_matches(&mut self) -> Check {
        if !self.advertises(ServiceType::Instances) {
            return Err(skip("InstancesService is not advertised"));
        }
        let r =
            self.node_metadata.clone().get_node_metadata(self.req(pb::GetNodeMetadataRequest {})).await.ctx("GetNodeMetadata")?;
        let local = r.metadata.unwrap_or_default();
        let lookup = pb::InstanceLookup { provider_id: local.provider_id.clone(), ..Default::default() };
        let cloud = self
            .instances
            .clone()
            .instance_metadata(self.req(pb::InstanceMetadataRequest { instance: Some(lookup) }))
            .await
            .ctx("InstanceMetadata")?;
        let m = cloud
            .metadata
            .filter(|_| cloud.exists)
            .ok_or_else(|| fail(format!("the local instance {} does not exist", local.provider_id)))?;
        ensure(m.instance_id == local.instance_id && m.zone == local.zone && m.instance_type == local.instance_type, || {
            format!("metadata service says {local:?}, the cloud says {m:?}")
        })
    }
}
