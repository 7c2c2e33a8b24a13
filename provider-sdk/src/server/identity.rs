//! IdentityService: the plugin's name, version and capabilities, derived from the services
//! given, and its probe.

use std::sync::Arc;

use ccm_proto::v1 as pb;
use tonic::{Request, Response, Status};

use crate::provider::{Probe, Readiness};
use ccm_proto::v1::identity_service_server::IdentityService;

use super::Observers;

// === impl IdentityAdapter ===

pub(super) struct IdentityAdapter {
    pub(super) info: pb::GetPluginInfoResponse,
    pub(super) caps: pb::GetPluginCapabilitiesResponse,
    pub(super) probe: Option<Arc<dyn Probe>>,
    pub(super) obs: Observers,
}

#[tonic::async_trait]
impl IdentityService for IdentityAdapter {
    async fn get_plugin_info(
        &self,
        _: Request<pb::GetPluginInfoRequest>,
    ) -> std::result::Result<Response<pb::GetPluginInfoResponse>, Status> {
        self.obs.call("IdentityService/GetPluginInfo", async { Ok(self.info.clone()) }).await
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<pb::GetPluginCapabilitiesRequest>,
    ) -> std::result::Result<Response<pb::GetPluginCapabilitiesResponse>, Status> {
        self.obs.call("IdentityService/GetPluginCapabilities", async { Ok(self.caps.clone()) }).await
    }

    async fn probe(&self, _: Request<pb::ProbeRequest>) -> std::result::Result<Response<pb::ProbeResponse>, Status> {
        self.obs
            .call("IdentityService/Probe", async {
                let readiness = match &self.probe {
                    Some(p) => p.probe().await?,
                    None => Readiness::Ready,
                };
                Ok(match readiness {
                    Readiness::Ready => pb::ProbeResponse { ready: true, ..Default::default() },
                    Readiness::NotReady(message) => pb::ProbeResponse { ready: false, message, ..Default::default() },
                })
            })
            .await
    }
}
