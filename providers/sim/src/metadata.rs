//! The sim's instance metadata service: what a cloud serves on a link-local address to each
//! instance about itself (169.254.169.254 on most clouds). Not the cloud API: no quota, no
//! latency, no faults, no call counting. Instances are told apart by the path, where a real
//! service tells them apart by the caller's address.
//!
//! | method | path | body | answer |
//! |---|---|---|---|
//! | GET | `/v1/instances/{id}` | | a [`MetadataDocument`]; 503 when the instance is not there |
//! | GET | `/v1/names/{name}` | | the same, of the instance with that host name |
//! | POST | `/v1/instances/{id}/registry-credentials` | `{"image": ..}` | a [`CredentialsDocument`] |

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::routing::{get, post};
use ccm_provider_sdk::proto as pb;
use serde::{Deserialize, Serialize};

use crate::admin::AdminError;
use crate::cloud::Cloud;
use crate::config::{Address, RegistryCredentialSpec};

/// What the metadata service says about an instance.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct MetadataDocument {
    /// The instance's id.
    pub instance_id: String,
    /// Its providerID.
    pub provider_id: String,
    /// Its type.
    pub instance_type: String,
    /// Its zone.
    pub zone: String,
    /// Its region.
    pub region: String,
    /// Its host name.
    pub hostname: String,
    /// Its addresses.
    pub addresses: Vec<Address>,
}

impl From<&pb::InstanceMetadata> for MetadataDocument {
    fn from(m: &pb::InstanceMetadata) -> Self {
        Self {
            instance_id: m.instance_id.clone(),
            provider_id: m.provider_id.clone(),
            instance_type: m.instance_type.clone(),
            zone: m.zone.clone(),
            region: m.region.clone(),
            hostname: m.hostname.clone(),
            addresses: m
                .addresses
                .iter()
                .map(|a| Address { kind: crate::cloud::address_type_name(a.r#type()).to_string(), address: a.address.clone() })
                .collect(),
        }
    }
}

impl From<MetadataDocument> for pb::InstanceMetadata {
    fn from(d: MetadataDocument) -> Self {
        Self {
            addresses: d
                .addresses
                .into_iter()
                .map(|a| pb::NodeAddress { r#type: crate::cloud::address_type(&a.kind) as i32, address: a.address })
                .collect(),
            provider_id: d.provider_id,
            instance_id: d.instance_id,
            instance_type: d.instance_type,
            zone: d.zone,
            region: d.region,
            node_name: d.hostname.clone(),
            pod_cidrs: Vec::new(),
            hostname: d.hostname,
            additional_labels: Default::default(),
            state: pb::InstanceState::Running as i32,
            tags: Default::default(),
        }
    }
}

/// The body of a registry credentials request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct CredentialsRequest {
    /// The image to pull.
    pub image: String,
}

/// The registry credentials for an image.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CredentialsDocument {
    /// Every configured credential whose pattern covers the image.
    pub credentials: Vec<RegistryCredentialSpec>,
}

/// The metadata service router.
pub fn router(cloud: Arc<Cloud>) -> axum::Router {
    axum::Router::new()
        .route("/v1/instances/{id}", get(instance))
        .route("/v1/names/{name}", get(named))
        .route("/v1/instances/{id}/registry-credentials", post(credentials))
        .with_state(cloud)
}

async fn instance(State(cloud): State<Arc<Cloud>>, Path(id): Path<String>) -> Result<Json<MetadataDocument>, AdminError> {
    let m = cloud.instance_metadata_service(&id).map_err(AdminError)?;
    Ok(Json(MetadataDocument::from(&m)))
}

async fn named(State(cloud): State<Arc<Cloud>>, Path(name): Path<String>) -> Result<Json<MetadataDocument>, AdminError> {
    let id = cloud.instance_id_by_name(&name).map_err(AdminError)?;
    instance(State(cloud), Path(id)).await
}

async fn credentials(
    State(cloud): State<Arc<Cloud>>,
    Path(id): Path<String>,
    Json(request): Json<CredentialsRequest>,
) -> Result<Json<CredentialsDocument>, AdminError> {
    let credentials = cloud.registry_credentials(&id, &request.image).map_err(AdminError)?;
    Ok(Json(CredentialsDocument { credentials }))
}
