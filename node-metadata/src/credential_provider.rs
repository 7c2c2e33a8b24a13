//! The kubelet's exec credential provider protocol (`credentialprovider.kubelet.k8s.io`): a
//! CredentialProviderRequest on stdin, a CredentialProviderResponse on stdout, answered from
//! the plugin's ImageCredentialsService. Nothing here logs a secret: errors name the image and
//! the plugin, never a token or a password.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, bail};
use ccm_proto::v1::{self as pb, CacheKeyType};
use serde::{Deserialize, Serialize};

/// The API group of the protocol.
pub const GROUP: &str = "credentialprovider.kubelet.k8s.io";
/// The versions answered; each has the same shape, and the answer uses the request's.
pub const VERSIONS: &[&str] = &["v1", "v1beta1", "v1alpha1"];
/// How long "no credentials" is cached when the provider gives no hint: short, so
/// credentials that appear later are picked up soon, long enough to spare the plugin a call
/// per pull.
pub const NO_CREDENTIALS_CACHE: Duration = Duration::from_secs(60);

/// A CredentialProviderRequest.
#[derive(Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Request {
    /// `credentialprovider.kubelet.k8s.io/v1`.
    pub api_version: String,
    /// `CredentialProviderRequest`.
    pub kind: String,
    /// The image being pulled.
    pub image: String,
    /// A service account token, when the kubelet is configured to send one. Secret.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub service_account_token: String,
    /// The service account's annotations the kubelet passes, when configured.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub service_account_annotations: BTreeMap<String, String>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("api_version", &self.api_version)
            .field("image", &self.image)
            .field("service_account_token", &if self.service_account_token.is_empty() { "" } else { "<redacted>" })
            .finish_non_exhaustive()
    }
}

/// A CredentialProviderResponse.
#[derive(Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Response {
    /// The request's apiVersion.
    pub api_version: String,
    /// `CredentialProviderResponse`.
    pub kind: String,
    /// `Image`, `Registry` or `Global`.
    pub cache_key_type: String,
    /// A Go duration (`1h0m0s`); absent means the kubelet's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_duration: Option<String>,
    /// Credentials by registry match pattern.
    #[serde(default)]
    pub auth: BTreeMap<String, AuthConfig>,
}

impl std::fmt::Debug for Response {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Response")
            .field("cache_key_type", &self.cache_key_type)
            .field("cache_duration", &self.cache_duration)
            .field("registries", &self.auth.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// One registry's credentials. Secret.
#[derive(Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct AuthConfig {
    /// The user name.
    pub username: String,
    /// The password or token.
    pub password: String,
}

/// Parses and checks a request: a known apiVersion of the group, the right kind, an image.
pub fn parse_request(bytes: &[u8]) -> anyhow::Result<Request> {
    let request: Request =
        serde_json::from_slice(bytes).context("stdin is not a CredentialProviderRequest (expected JSON from the kubelet)")?;
    let version = request.api_version.strip_prefix(&format!("{GROUP}/"));
    if !version.is_some_and(|v| VERSIONS.contains(&v)) {
        bail!("unsupported apiVersion {:?}: expected {GROUP}/ followed by one of {}", request.api_version, VERSIONS.join(", "));
    }
    if request.kind != "CredentialProviderRequest" {
        bail!("unexpected kind {:?}: expected CredentialProviderRequest", request.kind);
    }
    ccm_protocol::registry::parse_image(&request.image).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(request)
}

/// The ImageCredentials request for a kubelet request.
pub fn to_grpc(request: &Request) -> pb::GetImageCredentialsRequest {
    pb::GetImageCredentialsRequest {
        image: request.image.clone(),
        service_account_token: request.service_account_token.clone(),
        service_account_annotations: request.service_account_annotations.clone().into_iter().collect(),
    }
}

/// The kubelet response for the plugin's (checked) answer. With no credentials and no cache
/// hint, "nothing for this registry" is cached for [`NO_CREDENTIALS_CACHE`].
pub fn to_response(request: &Request, answer: pb::GetImageCredentialsResponse) -> Response {
    let kind = CacheKeyType::try_from(answer.cache_key_type).unwrap_or(CacheKeyType::Unspecified);
    let cache_key_type = match kind {
        CacheKeyType::Image => "Image",
        CacheKeyType::Global => "Global",
        CacheKeyType::Registry | CacheKeyType::Unspecified => "Registry",
    };
    let duration = match answer.cache_duration {
        Some(d) => Some(Duration::new(u64::try_from(d.seconds).unwrap_or(0), u32::try_from(d.nanos).unwrap_or(0))),
        None if answer.auth.is_empty() => Some(NO_CREDENTIALS_CACHE),
        None => None,
    };
    Response {
        api_version: request.api_version.clone(),
        kind: "CredentialProviderResponse".into(),
        cache_key_type: cache_key_type.into(),
        cache_duration: duration.map(go_duration),
        auth: answer
            .auth
            .into_iter()
            .map(|(pattern, c)| (pattern, AuthConfig { username: c.username, password: c.password }))
            .collect(),
    }
}

/// A duration as Go prints it (`1h0m0s`, `5m30s`, `45s`), which the kubelet parses; whole
/// seconds (credentials are not cached for fractions of one).
pub fn go_duration(d: Duration) -> String {
    let s = d.as_secs();
    let (h, m, s) = (s / 3600, (s % 3600) / 60, s % 60);
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, _) => format!("{m}m{s}s"),
        _ => format!("{h}h{m}m{s}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REQUEST: &str = r#"{"apiVersion":"credentialprovider.kubelet.k8s.io/v1","kind":"CredentialProviderRequest","image":"eu.registry.sim.dev/team/app:1.2","serviceAccountToken":"tok-SECRET"}"#;

    #[test]
    fn requests_are_checked() {
        let r = parse_request(REQUEST.as_bytes()).expect("valid");
        assert_eq!(r.image, "eu.registry.sim.dev/team/app:1.2");
        assert!(!format!("{r:?}").contains("tok-SECRET"), "debug output hides the token");
        let bad = |text: &str, want: &str| {
            let e = format!("{:#}", parse_request(text.as_bytes()).expect_err(text));
            assert!(e.contains(want), "{e} should mention {want}");
            assert!(!e.contains("tok-SECRET"));
        };
        bad("not json", "CredentialProviderRequest");
        bad(&REQUEST.replace("/v1\"", "/v9\""), "unsupported apiVersion");
        bad(&REQUEST.replace("kind\":\"CredentialProviderRequest", "kind\":\"Pod"), "unexpected kind");
        bad(&REQUEST.replace("eu.registry.sim.dev/team/app:1.2", ""), "image");
    }

    #[test]
    fn responses_carry_cache_hints_and_the_request_version() {
        let mut request = parse_request(REQUEST.as_bytes()).expect("valid");
        request.api_version = format!("{GROUP}/v1beta1");
        let mut answer = pb::GetImageCredentialsResponse {
            cache_key_type: CacheKeyType::Image as i32,
            cache_duration: Some(prost_types::Duration { seconds: 3930, nanos: 0 }),
            ..Default::default()
        };
        answer
            .auth
            .insert("*.registry.sim.dev".into(), pb::RegistryCredential { username: "u".into(), password: "pw-SECRET".into() });
        let r = to_response(&request, answer);
        assert_eq!(r.api_version, "credentialprovider.kubelet.k8s.io/v1beta1");
        assert_eq!((r.cache_key_type.as_str(), r.cache_duration.as_deref()), ("Image", Some("1h5m30s")));
        assert!(!format!("{r:?}").contains("pw-SECRET"), "debug output hides passwords");

        let empty = to_response(&request, pb::GetImageCredentialsResponse::default());
        assert_eq!((empty.cache_key_type.as_str(), empty.cache_duration.as_deref()), ("Registry", Some("1m0s")));
        assert!(empty.auth.is_empty());
        assert_eq!(go_duration(Duration::from_secs(45)), "45s");
    }
}
