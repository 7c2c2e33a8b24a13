//! `ccm-provider-sim node-metadata`: the sim's kubelet-side plugin. It serves
//! NodeMetadataService and ImageCredentialsService on a unix socket on the node and answers
//! both from the sim's instance metadata service ([`crate::metadata`]), read over HTTP the
//! way a real plugin reads 169.254.169.254.

use std::time::Duration;

use ccm_provider_sdk::proto as pb;
use ccm_provider_sdk::{Error, Listen, ProviderServer, Readiness, Result};
use serde::de::DeserializeOwned;

use crate::client::http_call;
use crate::config::CacheKey;
use crate::metadata::{CredentialsDocument, CredentialsRequest, MetadataDocument};

/// How long one read of the metadata service may take.
const METADATA_TIMEOUT: Duration = Duration::from_secs(2);

/// The plugin of one instance.
#[derive(Debug, Clone)]
pub struct NodePlugin {
    endpoint: String,
    who: Who,
}

/// How the plugin knows which instance it runs on.
#[derive(Debug, Clone)]
enum Who {
    Id(String),
    /// The host name (the Node's name): what a DaemonSet knows from the downward API.
    Name(String),
}

impl NodePlugin {
    /// The plugin of instance `instance_id`, reading the metadata service at `endpoint`
    /// (`http://host:port` or `unix:///path.sock`).
    pub fn new(endpoint: impl Into<String>, instance_id: impl Into<String>) -> Self {
        Self { endpoint: endpoint.into(), who: Who::Id(instance_id.into()) }
    }

    /// The plugin of the instance with host name `name`.
    pub fn named(endpoint: impl Into<String>, name: impl Into<String>) -> Self {
        Self { endpoint: endpoint.into(), who: Who::Name(name.into()) }
    }

    /// The metadata service path of this instance's document.
    fn document_path(&self) -> String {
        match &self.who {
            Who::Id(id) => format!("/v1/instances/{id}"),
            Who::Name(name) => format!("/v1/names/{name}"),
        }
    }

    async fn instance_id(&self) -> Result<String> {
        match &self.who {
            Who::Id(id) => Ok(id.clone()),
            Who::Name(_) => Ok(self.read::<MetadataDocument>("GET", &self.document_path(), None).await?.instance_id),
        }
    }

    async fn read<T: DeserializeOwned>(&self, method: &str, path: &str, body: Option<serde_json::Value>) -> Result<T> {
        let call = http_call(&self.endpoint, method, path, body);
        let (status, bytes) = match tokio::time::timeout(METADATA_TIMEOUT, call).await {
            Err(_) => {
                return Err(Error::unavailable(format!("the metadata service at {} did not answer in time", self.endpoint)));
            }
            Ok(Err(e)) => {
                return Err(Error::unavailable(format!("the metadata service at {} is unreachable: {e:#}", self.endpoint)));
            }
            Ok(Ok(answer)) => answer,
        };
        let text = || String::from_utf8_lossy(&bytes).chars().take(200).collect::<String>();
        if status == hyper::StatusCode::SERVICE_UNAVAILABLE {
            return Err(Error::unavailable(format!("the metadata service says: {}", text())));
        }
        if !status.is_success() {
            return Err(Error::internal(format!("the metadata service answered {status}: {}", text())));
        }
        serde_json::from_slice(&bytes).map_err(|e| Error::internal(format!("the metadata service's answer is not valid: {e}")))
    }
}

#[ccm_provider_sdk::async_trait]
impl ccm_provider_sdk::NodeMetadata for NodePlugin {
    async fn node_metadata(&self) -> Result<pb::InstanceMetadata> {
        let doc: MetadataDocument = self.read("GET", &self.document_path(), None).await?;
        Ok(doc.into())
    }
}

#[ccm_provider_sdk::async_trait]
impl ccm_provider_sdk::ImageCredentials for NodePlugin {
    async fn image_credentials(&self, request: &pb::GetImageCredentialsRequest) -> Result<pb::GetImageCredentialsResponse> {
        let body = serde_json::to_value(CredentialsRequest { image: request.image.clone() })
            .map_err(|e| Error::internal(format!("encoding the request: {e}")))?;
        let path = format!("/v1/instances/{}/registry-credentials", self.instance_id().await?);
        let doc: CredentialsDocument = self.read("POST", &path, Some(body)).await?;
        Ok(to_response(doc))
    }
}

/// Several matching credentials share the narrowest cache key type and the shortest
/// duration, so none is cached beyond what its own answer allows.
fn to_response(doc: CredentialsDocument) -> pb::GetImageCredentialsResponse {
    let mut answer = pb::GetImageCredentialsResponse::default();
    let Some(seconds) = doc.credentials.iter().map(|c| c.cache_seconds).min() else { return answer };
    let narrowest = |k: CacheKey| match k {
        CacheKey::Image => 0,
        CacheKey::Registry => 1,
        CacheKey::Global => 2,
    };
    let key = doc.credentials.iter().map(|c| c.cache_key_type).min_by_key(|k| narrowest(*k)).unwrap_or_default();
    answer.cache_key_type = match key {
        CacheKey::Image => pb::CacheKeyType::Image,
        CacheKey::Registry => pb::CacheKeyType::Registry,
        CacheKey::Global => pb::CacheKeyType::Global,
    } as i32;
    answer.cache_duration = Some(prost_types::Duration { seconds: i64::try_from(seconds).unwrap_or(i64::MAX), nanos: 0 });
    for c in doc.credentials {
        answer.auth.insert(c.registry, pb::RegistryCredential { username: c.username, password: c.password });
    }
    answer
}

#[ccm_provider_sdk::async_trait]
impl ccm_provider_sdk::Probe for NodePlugin {
    async fn probe(&self) -> Result<Readiness> {
        // The metadata service is local and free: ready when it answers for this instance.
        let read: Result<MetadataDocument> = self.read("GET", &self.document_path(), None).await;
        Ok(match read {
            Ok(_) => Readiness::Ready,
            Err(e) => Readiness::NotReady(e.to_string()),
        })
    }
}

/// Serves the plugin on `listen` until `shutdown` resolves.
pub async fn run(
    plugin_name: &str,
    plugin: NodePlugin,
    listen: Listen,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let plugin = std::sync::Arc::new(plugin);
    ProviderServer::new(plugin_name, crate::VERSION)
        .manifest("cloud", "sim")
        .manifest("role", "node-metadata")
        .provider_id_scheme(crate::cloud::DEFAULT_SCHEME)
        .node_metadata(plugin.clone())
        .image_credentials(plugin.clone())
        .probe(plugin)
        .serve_with_shutdown(&listen, shutdown)
        .await
        .map_err(Into::into)
}
