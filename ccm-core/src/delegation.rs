//! Authentication and authorisation of the health and metrics server by delegation to the
//! API server, as upstream's `--authentication-kubeconfig` / `--authorization-kubeconfig`: a
//! bearer token is checked with a TokenReview, the user's right to the path with a
//! SubjectAccessReview on the non-resource URL (`get /metrics`). Paths in
//! `--authorization-always-allow-paths` (the probes) pass without either. A request without a
//! token is `system:anonymous` and is authorised as such (usually: forbidden).
//!
//! As upstream, without an API server to ask (no kubeconfig for it, and not in a cluster)
//! nothing is open: without an authenticator every request is anonymous, and without an
//! authoriser only the always-allowed paths and members of `system:masters` pass.
//!
//! Answers are cached for [`CACHE_TTL`] per token, path and verb, as upstream caches them,
//! so a scraper costs the API server two reviews per ten seconds at most. The cache holds at
//! most [`CACHE_ENTRIES`] answers (least recently used forgotten), and reviews of requests not
//! in it are budgeted ([`REVIEWS_PER_SECOND`], beyond it `429 Too Many Requests`): a flood of
//! random tokens on the metrics port neither grows the process nor floods the API server.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, UserInfo};
use k8s_openapi::api::authorization::v1::{NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use kube::Api;
use kube::api::PostParams;
use sha2::{Digest, Sha256};
use tokio::time::Instant;

/// How long a review's answer is reused.
pub const CACHE_TTL: Duration = Duration::from_secs(10);
/// The most answers kept.
pub const CACHE_ENTRIES: usize = 4096;
/// Reviews (a TokenReview and a SubjectAccessReview each) of uncached requests per second,
/// with a burst of twice as many.
pub const REVIEWS_PER_SECOND: f64 = 20.0;

/// Errors of the delegated checks.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server did not answer a review.
    #[error("{review} failed: {source}")]
    Review {
        /// TokenReview or SubjectAccessReview.
        review: &'static str,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
}

#[derive(Debug, Clone)]
enum Decision {
    /// Not asked: too many uncached requests this second.
    TooMany,
    Unauthenticated,
    Allowed,
    Forbidden(String),
}

/// The group upstream allows everything when no authoriser is configured.
pub const ALWAYS_ALLOWED_GROUP: &str = "system:masters";

/// The delegated checks, with their clients and cache.
pub struct Delegation {
    /// TokenReviews; without it every request is anonymous.
    authentication: Option<kube::Client>,
    /// SubjectAccessReviews; without it only [`ALWAYS_ALLOWED_GROUP`] passes.
    authorization: Option<kube::Client>,
    always_allow: Vec<String>,
    cache: Mutex<lru::LruCache<[u8; 32], (Instant, Decision)>>,
    reviews: ccm_protocol::ratelimit::TokenBucket,
}

impl Delegation {
    /// Checks with TokenReviews through `authentication` and SubjectAccessReviews through
    /// `authorization` (either may be missing: see the module's documentation);
    /// `always_allow` paths (exact, or a prefix ending in `*`) pass unchecked.
    pub fn new(authentication: Option<kube::Client>, authorization: Option<kube::Client>, always_allow: Vec<String>) -> Self {
        let entries = std::num::NonZeroUsize::new(CACHE_ENTRIES).unwrap_or(std::num::NonZeroUsize::MIN);
        Self {
            authentication,
            authorization,
            always_allow,
            cache: Mutex::new(lru::LruCache::new(entries)),
            reviews: ccm_protocol::ratelimit::TokenBucket::new(REVIEWS_PER_SECOND, (2.0 * REVIEWS_PER_SECOND) as u32),
        }
    }

    fn always_allowed(&self, path: &str) -> bool {
        self.always_allow.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => path.starts_with(prefix),
            None => p == path,
        })
    }

    async fn decide(&self, token: Option<&str>, path: &str, verb: &str) -> Result<Decision, Error> {
        let mut hasher = Sha256::new();
        hasher.update(token.unwrap_or_default().as_bytes());
        hasher.update([0]);
        hasher.update(path.as_bytes());
        hasher.update([0]);
        hasher.update(verb.as_bytes());
        let key: [u8; 32] = hasher.finalize().into();
        if let Ok(mut cache) = self.cache.lock()
            && let Some((at, decision)) = cache.get(&key)
            && at.elapsed() < CACHE_TTL
        {
            return Ok(decision.clone());
        }
        if self.reviews.try_acquire().is_err() {
            return Ok(Decision::TooMany);
        }
        let decision = self.review(token, path, verb).await?;
        if let Ok(mut cache) = self.cache.lock() {
            cache.put(key, (Instant::now(), decision.clone()));
        }
        Ok(decision)
    }

    async fn review(&self, token: Option<&str>, path: &str, verb: &str) -> Result<Decision, Error> {
        let anonymous = || UserInfo {
            username: Some("system:anonymous".into()),
            groups: Some(vec!["system:unauthenticated".into()]),
            ..Default::default()
        };
        let user = match (token, &self.authentication) {
            (None, _) | (_, None) => anonymous(),
            (Some(token), Some(authentication)) => {
                let review = TokenReview {
                    spec: TokenReviewSpec { token: token.to_string(), ..Default::default() },
                    ..Default::default()
                };
                let answer = Api::<TokenReview>::all(authentication.clone())
                    .create(&PostParams::default(), &review)
                    .await
                    .map_err(|source| Error::Review { review: "TokenReview", source })?;
                match answer.status {
                    Some(status) if status.authenticated == Some(true) => status.user.unwrap_or_default(),
                    _ => return Ok(Decision::Unauthenticated),
                }
            }
        };
        let name = user.username.clone().unwrap_or_default();
        let Some(authorization) = &self.authorization else {
            let master = user.groups.as_ref().is_some_and(|g| g.iter().any(|g| g == ALWAYS_ALLOWED_GROUP));
            return Ok(if master {
                Decision::Allowed
            } else {
                Decision::Forbidden(format!(
                    "forbidden: User \"{name}\" cannot {verb} path \"{path}\" (no authorizer: no --authorization-kubeconfig \
                     and not in a cluster; only the always-allowed paths and {ALWAYS_ALLOWED_GROUP})"
                ))
            });
        };
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username,
                groups: user.groups,
                uid: user.uid,
                extra: user.extra,
                non_resource_attributes: Some(NonResourceAttributes { path: Some(path.into()), verb: Some(verb.into()) }),
                ..Default::default()
            },
            ..Default::default()
        };
        let answer = Api::<SubjectAccessReview>::all(authorization.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(|source| Error::Review { review: "SubjectAccessReview", source })?;
        Ok(match answer.status {
            Some(status) if status.allowed => Decision::Allowed,
            _ => Decision::Forbidden(format!("forbidden: User \"{name}\" cannot {verb} path \"{path}\"")),
        })
    }
}

/// The middleware: 401 for a token the API server does not accept, 403 for a user without
/// the right, 500 when the API server cannot be asked; otherwise the request goes on.
pub async fn check(State(delegation): State<Arc<Delegation>>, request: Request, next: Next) -> Response {
    let path = request.uri().path().to_string();
    if delegation.always_allowed(&path) {
        return next.run(request).await;
    }
    let token = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty());
    let verb = request.method().as_str().to_ascii_lowercase();
    match delegation.decide(token.as_deref(), &path, &verb).await {
        Ok(Decision::Allowed) => next.run(request).await,
        Ok(Decision::Unauthenticated) => (StatusCode::UNAUTHORIZED, "Unauthorized\n").into_response(),
        Ok(Decision::TooMany) => {
            (StatusCode::TOO_MANY_REQUESTS, [(axum::http::header::RETRY_AFTER, "1")], "Too many requests to check\n")
                .into_response()
        }
        Ok(Decision::Forbidden(message)) => (StatusCode::FORBIDDEN, format!("{message}\n")).into_response(),
        Err(error) => {
            tracing::warn!(%error, %path, "delegated authentication or authorisation failed");
            (StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error: the API server could not check the request\n")
                .into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn always_allowed_paths_match_exactly_or_by_prefix() {
        let config = kube::Config::new("http://127.0.0.1:1".parse().expect("url"));
        let client = kube::Client::try_from(config).expect("client");
        let d = Delegation::new(Some(client.clone()), Some(client), vec!["/healthz".into(), "/readyz".into(), "/debug/*".into()]);
        assert!(d.always_allowed("/healthz") && d.always_allowed("/debug/pprof"));
        assert!(!d.always_allowed("/metrics") && !d.always_allowed("/healthz/x"));
    }

    #[tokio::test]
    async fn a_flood_of_random_tokens_is_bounded_in_reviews_and_memory() {
        // An API server that does not answer (nothing listens): every review fails fast.
        let config = kube::Config::new("http://127.0.0.1:1".parse().expect("url"));
        let client = kube::Client::try_from(config).expect("client");
        let d = Delegation::new(Some(client.clone()), Some(client), Vec::new());
        let (mut asked, mut refused) = (0, 0);
        for i in 0..10_000 {
            match d.decide(Some(&format!("random-{i}")), "/metrics", "get").await {
                Ok(Decision::TooMany) => refused += 1,
                _ => asked += 1,
            }
        }
        assert!(asked <= 2 * REVIEWS_PER_SECOND as usize + 5, "{asked} reviews asked for 10,000 random tokens at once");
        assert!(refused >= 9_900, "{refused}");
        assert!(d.cache.lock().expect("cache").len() <= CACHE_ENTRIES);
    }

    #[tokio::test]
    async fn without_an_api_server_to_ask_nothing_but_the_always_allowed_paths_passes() {
        // No authenticator, no authoriser (not in a cluster, no kubeconfig for them): no
        // review is ever sent, and /metrics is forbidden to anonymous and to any token.
        let d = Delegation::new(None, None, vec!["/healthz".into()]);
        assert!(d.always_allowed("/healthz"));
        for token in [None, Some("a-token")] {
            match d.decide(token, "/metrics", "get").await {
                Ok(Decision::Forbidden(why)) => assert!(why.contains("no authorizer"), "{why}"),
                other => panic!("{token:?}: {other:?}"),
            }
        }
    }
}
