//! `--use-service-account-credentials`: each controller talks to the API server as its own
//! ServiceAccount in `kube-system` ([`service_account`]: upstream's accounts by default,
//! `--service-account-names`; created when missing and allowed), so
//! audit logs tell controllers apart and each can be granted only what it does. Tokens come
//! from the TokenRequest API, live an hour, and are renewed every 20 minutes into a file the
//! client re-reads.

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::PostParams;
use tokio_util::sync::CancellationToken;

/// The namespace of the controllers' ServiceAccounts, as upstream.
pub const NAMESPACE: &str = "kube-system";
const TOKEN_SECONDS: i64 = 3600;
const RENEW_EVERY: Duration = Duration::from_secs(20 * 60);

/// The ServiceAccount a controller acts as. `upstream` (the default): the accounts upstream's
/// cloud-controller-manager uses, so existing RBAC and audit rules apply: `node-controller`
/// (the node, node lifecycle and node IPAM controllers, as upstream's nodeipam controller is
/// built with `node-controller`'s client), `route-controller`, `service-controller`.
/// `controller`: the controller's own name (`route-controller` for the route controller).
pub fn service_account(controller: &str, names: crate::options::ServiceAccountNames) -> &str {
    use crate::options::ServiceAccountNames;
    match (crate::controllers::registry::named(controller), names) {
        (Some(c), ServiceAccountNames::Upstream) => c.upstream_account,
        (Some(c), ServiceAccountNames::Controller) => c.own_account,
        (None, _) => controller,
    }
}

/// Makes per-controller clients from the process's own credentials.
/// Why per-controller credentials could not be made or renewed.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    /// The process's own client could not be built.
    #[error("building the Kubernetes client")]
    Client(#[source] kube::Error),
    /// The directory for token files could not be created.
    #[error("creating the token directory")]
    TokenDir(#[source] std::io::Error),
    /// An API call about the ServiceAccount failed (`what` says which).
    #[error("{what} {NAMESPACE}/{account}")]
    Api {
        what: &'static str,
        account: String,
        #[source]
        source: kube::Error,
    },
    /// The TokenRequest was answered without a token.
    #[error("the token request for {NAMESPACE}/{0} returned no token")]
    NoToken(String),
    /// The token file could not be written.
    #[error("writing the token file {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

pub struct Credentials {
    config: kube::Config,
    root: kube::Client,
    dir: tempfile::TempDir,
    names: crate::options::ServiceAccountNames,
    metrics: crate::metrics::Metrics,
    supervisor: crate::supervisor::Supervisor,
}

impl Credentials {
    /// Per-controller credentials derived from `config` (whose identity must be allowed to
    /// create ServiceAccounts and tokens in kube-system).
    /// Each token is renewed under `supervisor` (a renewal task that panics fails the process
    /// rather than letting the token expire).
    pub fn new(
        config: kube::Config,
        names: crate::options::ServiceAccountNames,
        metrics: crate::metrics::Metrics,
        supervisor: crate::supervisor::Supervisor,
    ) -> Result<Self, CredentialsError> {
        let root = kube::Client::try_from(config.clone()).map_err(CredentialsError::Client)?;
        let dir = tempfile::Builder::new().prefix("ccm-tokens-").tempdir().map_err(CredentialsError::TokenDir)?;
        Ok(Self { config, root, dir, names, metrics, supervisor })
    }

    async fn token(root: &kube::Client, name: &str) -> Result<String, CredentialsError> {
        let api: Api<ServiceAccount> = Api::namespaced(root.clone(), NAMESPACE);
        let failed = |what| move |source| CredentialsError::Api { what, account: name.to_string(), source };
        if api.get_opt(name).await.map_err(failed("reading service account"))?.is_none() {
            let sa =
                ServiceAccount { metadata: ObjectMeta { name: Some(name.into()), ..Default::default() }, ..Default::default() };
            match api.create(&PostParams::default(), &sa).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => return Err(failed("creating service account")(e)),
            }
        }
        let request = TokenRequest {
            spec: Some(TokenRequestSpec { expiration_seconds: Some(TOKEN_SECONDS), ..Default::default() }),
            ..Default::default()
        };
        let answer =
            api.create_token_request(name, &PostParams::default(), &request).await.map_err(failed("requesting a token for"))?;
        answer.status.and_then(|s| s.token).filter(|t| !t.is_empty()).ok_or_else(|| CredentialsError::NoToken(name.to_string()))
    }

    fn write(path: &PathBuf, token: &str) -> Result<(), CredentialsError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let tmp = path.with_extension("new");
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| f.write_all(token.as_bytes()))
            .and_then(|()| std::fs::rename(&tmp, path));
        written.map_err(|source| CredentialsError::Write { path: path.clone(), source })
    }

    /// A client acting as the ServiceAccount of `controller` ([`service_account`]), renewing
    /// its token until `stop`.
    pub async fn client_for(&self, controller: &str, stop: CancellationToken) -> Result<kube::Client, CredentialsError> {
        let account = service_account(controller, self.names);
        let path = self.dir.path().join(format!("{account}.token"));
        Self::write(&path, &Self::token(&self.root, account).await?)?;
        let root = self.root.clone();
        let (name, file) = (account.to_string(), path.clone());
        let renewing = stop.clone();
        self.supervisor.spawn(&format!("the token renewal of {account}"), &renewing, async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(RENEW_EVERY) => {}
                    _ = stop.cancelled() => return,
                }
                match Self::token(&root, &name).await.and_then(|t| Self::write(&file, &t)) {
                    Ok(()) => tracing::debug!(controller = %name, "service account token renewed"),
                    Err(error) => {
                        let error = crate::metrics::chain(&error);
                        tracing::warn!(controller = %name, %error, "renewing the token failed; the current one stays")
                    }
                }
            }
        });
        let mut config = self.config.clone();
        config.auth_info = kube::config::AuthInfo { token_file: Some(path.display().to_string()), ..Default::default() };
        tracing::info!(controller, service_account = %format!("{NAMESPACE}/{account}"), "using the controller's own credentials");
        self.metrics.kube_client(config).map_err(CredentialsError::Client)
    }
}
