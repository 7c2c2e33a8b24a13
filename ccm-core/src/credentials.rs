//! `--use-service-account-credentials`: each controller talks to the API server as its own
//! ServiceAccount in `kube-system` ([`service_account`]: upstream's accounts by default,
//! `--service-account-names`; created when missing and allowed), so
//! audit logs tell controllers apart and each can be granted only what it does. Tokens come
//! from the TokenRequest API, live ten minutes (the shortest the API server issues: a token
//! taken from a stopped process is of use that long at most), and are renewed every three
//! minutes into a file the client re-reads. They cannot be bound to this Pod: the API server
//! binds a token only to a Pod running as that same account.
//!
//! `--provider-token` ([`hand_over`]): the same for a provider's own ServiceAccount, written
//! with `ca.crt` and `namespace` into a volume only that provider mounts, so that the
//! provider reads the cluster as itself and never holds the core's credentials.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::PostParams;
use tokio_util::sync::CancellationToken;

/// The namespace of the controllers' ServiceAccounts, as upstream.
pub const NAMESPACE: &str = "kube-system";
/// The shortest lifetime the API server issues.
const TOKEN_SECONDS: i64 = 600;
/// Well inside it: two renewals can fail before a token expires, and clients re-read the file
/// every minute.
const RENEW_EVERY: Duration = Duration::from_secs(3 * 60);

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
    #[error("{what} {account}")]
    Api {
        what: &'static str,
        account: String,
        #[source]
        source: kube::Error,
    },
    /// The TokenRequest was answered without a token.
    #[error("the token request for {0} returned no token")]
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
        let failed = |what| move |source| CredentialsError::Api { what, account: format!("{NAMESPACE}/{name}"), source };
        if api.get_opt(name).await.map_err(failed("reading service account"))?.is_none() {
            let sa =
                ServiceAccount { metadata: ObjectMeta { name: Some(name.into()), ..Default::default() }, ..Default::default() };
            match api.create(&PostParams::default(), &sa).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => return Err(failed("creating service account")(e)),
            }
        }
        request_token(root, NAMESPACE, name).await
    }

    fn write(path: &Path, token: &str) -> Result<(), CredentialsError> {
        write_file(path, token.as_bytes(), 0o600)
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

/// A token of `namespace/name` for the API server (no audience: the API server's own), for
/// [`TOKEN_SECONDS`].
async fn request_token(root: &kube::Client, namespace: &str, name: &str) -> Result<String, CredentialsError> {
    let api: Api<ServiceAccount> = Api::namespaced(root.clone(), namespace);
    let account = format!("{namespace}/{name}");
    let request = TokenRequest {
        spec: Some(TokenRequestSpec { expiration_seconds: Some(TOKEN_SECONDS), ..Default::default() }),
        ..Default::default()
    };
    let answer = api
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .map_err(|source| CredentialsError::Api { what: "requesting a token for", account: account.clone(), source })?;
    answer.status.and_then(|s| s.token).filter(|t| !t.is_empty()).ok_or(CredentialsError::NoToken(account))
}

/// Writes `bytes` to `path` with `mode`, whole or not at all (a reader never sees half).
fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), CredentialsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("new");
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .and_then(|mut f| f.write_all(bytes))
        .and_then(|()| std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(mode)))
        .and_then(|()| std::fs::rename(&tmp, path));
    written.map_err(|source| CredentialsError::Write { path: path.to_path_buf(), source })
}

/// The API server's CA bundle of `config` as PEM, for a provider's in-cluster client.
fn ca_pem(config: &kube::Config) -> String {
    use base64::Engine;
    let mut pem = String::new();
    for der in config.root_cert.iter().flatten() {
        let text = base64::engine::general_purpose::STANDARD.encode(der);
        pem.push_str("-----BEGIN CERTIFICATE-----\n");
        for line in text.as_bytes().chunks(64) {
            pem.push_str(&String::from_utf8_lossy(line));
            pem.push('\n');
        }
        pem.push_str("-----END CERTIFICATE-----\n");
    }
    pem
}

/// Writes what a provider's in-cluster client reads into `handover.dir`: `token` (of its
/// own ServiceAccount), `ca.crt` and `namespace`, readable by the volume's group (the pod's
/// fsGroup; the provider runs as a user of its own).
async fn hand_over_once(
    root: &kube::Client,
    ca: &str,
    handover: &crate::provider::access::Handover,
) -> Result<(), CredentialsError> {
    let token = request_token(root, &handover.namespace, &handover.account).await?;
    write_file(&handover.dir.join("ca.crt"), ca.as_bytes(), 0o640)?;
    write_file(&handover.dir.join("namespace"), handover.namespace.as_bytes(), 0o640)?;
    write_file(&handover.dir.join("token"), token.as_bytes(), 0o640)
}

/// How soon a provider's token is tried again after a failure (the API server restarting,
/// the ServiceAccount not there yet, RBAC missing: each is logged).
const HANDOVER_RETRY: Duration = Duration::from_secs(5);
/// The longest wait between those tries.
const HANDOVER_RETRY_MAX: Duration = Duration::from_secs(80);

/// `--provider-token`: writes each provider's token as soon as it can (the first failure is
/// logged as an error and retried after 5 s, doubling to 80 s: the provider waits for its token), then renews
/// it every three minutes under `supervisor` until `stop` (a failed renewal keeps the current
/// token, ten minutes long, and is retried sooner).
pub fn hand_over(
    config: &kube::Config,
    handovers: Vec<crate::provider::access::Handover>,
    metrics: &crate::metrics::Metrics,
    supervisor: &crate::supervisor::Supervisor,
    stop: CancellationToken,
) -> Result<(), CredentialsError> {
    if handovers.is_empty() {
        return Ok(());
    }
    let root = metrics.kube_client(config.clone()).map_err(CredentialsError::Client)?;
    let ca = ca_pem(config);
    for handover in handovers {
        let account = format!("{}/{}", handover.namespace, handover.account);
        let (root, ca, stop) = (root.clone(), ca.clone(), stop.clone());
        supervisor.spawn(&format!("the provider token handover of {account}"), &stop.clone(), async move {
            let (mut handed, mut retry) = (false, HANDOVER_RETRY);
            loop {
                let wait = match hand_over_once(&root, &ca, &handover).await {
                    Ok(()) => {
                        if !handed {
                            tracing::info!(service_account = %account, dir = %handover.dir.display(), "handed the provider a token of its own ServiceAccount");
                        }
                        (handed, retry) = (true, HANDOVER_RETRY);
                        RENEW_EVERY
                    }
                    Err(error) => {
                        let error = crate::metrics::chain(&error);
                        if handed {
                            tracing::warn!(service_account = %account, %error, "renewing the provider's token failed; the current one stays");
                        } else {
                            tracing::error!(service_account = %account, %error, "cannot hand the provider its token; it cannot read the cluster until then");
                        }
                        let wait = retry;
                        retry = (retry * 2).min(HANDOVER_RETRY_MAX);
                        wait
                    }
                };
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = stop.cancelled() => return,
                }
            }
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_replaced_whole_with_their_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("token");
        write_file(&path, b"first", 0o640).expect("write");
        write_file(&path, b"second", 0o640).expect("rewrite");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "second");
        assert_eq!(std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777, 0o640);
        assert!(!dir.path().join("token.new").exists());
    }

    #[test]
    fn the_ca_bundle_is_pem() {
        let mut config = kube::Config::new("https://k:6443".parse().expect("uri"));
        config.root_cert = Some(vec![vec![1u8; 100]]);
        let pem = ca_pem(&config);
        assert!(pem.starts_with("-----BEGIN CERTIFICATE-----\n") && pem.ends_with("-----END CERTIFICATE-----\n"), "{pem}");
        assert!(pem.lines().all(|l| l.len() <= 64), "{pem}");
    }
}
