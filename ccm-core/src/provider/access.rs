//! What the core knows of each provider beyond its endpoint, from the flags: the user id its
//! unix socket must be served by (`--provider-peer-uid`, checked with SO_PEERCRED on every
//! connection, [`checked_unix_channel`]), its metrics socket (`--provider-metrics`, served
//! again under the core's own authentication) and the ServiceAccount token the core hands it
//! (`--provider-token`, [`crate::credentials::hand_over`]).

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::options::{InvalidFlags, Options};

/// A token the core requests for a provider's own ServiceAccount and writes for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handover {
    /// The ServiceAccount's namespace.
    pub namespace: String,
    /// The ServiceAccount.
    pub account: String,
    /// The directory (a volume only that provider and the core mount) the files go to.
    pub dir: PathBuf,
}

/// The flags about providers' access, checked against `--provider-endpoint`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Access {
    /// Provider name → the user id its unix socket must be served by.
    pub peer_uids: BTreeMap<String, u32>,
    /// Provider name → the path of its metrics socket.
    pub metrics: BTreeMap<String, PathBuf>,
    /// The tokens handed over.
    pub tokens: Vec<Handover>,
}

/// `[NAME=]VALUE` entries of `flag`, each for a provider of `endpoints` (the plain form for
/// the single provider), at most one per provider.
fn per_provider<'a>(
    flag: &str,
    entries: &'a [String],
    endpoints: &'a [(String, String)],
) -> Result<Vec<(&'a str, &'a str, &'a str)>, InvalidFlags> {
    let mut seen = Vec::new();
    let mut out = Vec::new();
    for entry in entries {
        let (name, value) = match entry.split_once('=') {
            Some((name, value)) if endpoints.iter().any(|(n, _)| n == name) => (name, value),
            _ if endpoints.len() == 1 => (endpoints[0].0.as_str(), entry.as_str()),
            _ => {
                let names: Vec<&str> = endpoints.iter().map(|(n, _)| n.as_str()).collect();
                return Err(
                    format!("{flag} {entry:?}: expected NAME=VALUE, NAME one of the providers ({})", names.join(", ")).into()
                );
            }
        };
        if seen.contains(&name) {
            return Err(format!("{flag}: the provider {name:?} is given twice").into());
        }
        seen.push(name);
        let endpoint = endpoints.iter().find(|(n, _)| n == name).map_or("", |(_, e)| e.as_str());
        out.push((name, value, endpoint));
    }
    Ok(out)
}

/// The path of a `unix:///…` address, or `None`.
pub fn unix_path(address: &str) -> Option<PathBuf> {
    address.strip_prefix("unix://").filter(|p| p.starts_with('/') && p.len() > 1).map(PathBuf::from)
}

/// Parses and checks `--provider-peer-uid`, `--provider-metrics` and `--provider-token`.
pub fn access(options: &Options) -> Result<Access, InvalidFlags> {
    let endpoints = options.provider_endpoints()?;
    let mut access = Access::default();
    for (name, value, endpoint) in per_provider("--provider-peer-uid", &options.provider_peer_uid, &endpoints)? {
        let uid: u32 = value.parse().map_err(|_| format!("--provider-peer-uid {name}={value}: not a user id"))?;
        if unix_path(endpoint).is_none() {
            return Err(format!(
                "--provider-peer-uid {name}={uid}: the provider's endpoint {endpoint} is not a unix socket (peer credentials \
                 exist only there; mutual TLS checks a TCP provider)"
            )
            .into());
        }
        access.peer_uids.insert(name.to_string(), uid);
    }
    for (name, value, endpoint) in per_provider("--provider-metrics", &options.provider_metrics, &endpoints)? {
        let path =
            unix_path(value).ok_or_else(|| format!("--provider-metrics {name}={value}: expected unix:///path/metrics.sock"))?;
        if unix_path(endpoint).as_ref() == Some(&path) {
            return Err(format!("--provider-metrics {name}={value}: that is the provider's gRPC socket").into());
        }
        access.metrics.insert(name.to_string(), path);
    }
    for entry in &options.provider_token {
        let invalid = |why: &str| -> InvalidFlags { format!("--provider-token {entry:?}: {why}").into() };
        let (account, dir) = entry.split_once('=').ok_or_else(|| invalid("expected NAMESPACE/NAME=DIR"))?;
        let (namespace, account) = account.split_once('/').ok_or_else(|| invalid("expected NAMESPACE/NAME=DIR"))?;
        for part in [namespace, account] {
            if !ccm_protocol::labels::valid_label_value(part) || part.is_empty() || part.contains('_') {
                return Err(invalid(&format!("{part:?} is not a Kubernetes name")));
            }
        }
        // The controllers' accounts may delete Nodes and write Services: never a provider's.
        let mut controllers = crate::controllers::registry::CONTROLLERS.iter().flat_map(|c| [c.upstream_account, c.own_account]);
        if controllers.any(|a| a == account) {
            return Err(invalid(&format!("{account} is a controller's account; a provider needs an account of its own")));
        }
        let dir = PathBuf::from(dir);
        if !dir.is_absolute() || dir.components().any(|c| c == std::path::Component::ParentDir) {
            return Err(invalid("DIR must be an absolute path without '..'"));
        }
        if dir.starts_with("/var/run/secrets") || dir.starts_with("/run/secrets") {
            return Err(invalid("DIR is where this container's own credentials are mounted"));
        }
        if access.tokens.iter().any(|t| t.dir == dir) {
            return Err(invalid("another --provider-token writes to that directory"));
        }
        access.tokens.push(Handover { namespace: namespace.into(), account: account.into(), dir });
    }
    Ok(access)
}

/// Why a unix socket's peer was refused.
fn refused(path: &std::path::Path, uid: u32, expected: u32) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::PermissionDenied,
        format!(
            "the process serving {} runs as user {uid}, not {expected} (--provider-peer-uid): another process took the \
             provider's socket; refused",
            path.display()
        ),
    )
}

/// A lazily connected channel to the unix socket `address` that, on every connection,
/// checks that the process serving it runs as `uid` (SO_PEERCRED) and refuses it otherwise.
pub fn checked_unix_channel(address: &str, uid: u32) -> Result<tonic::transport::Channel, ccm_protocol::client::ClientError> {
    let path = unix_path(address).ok_or_else(|| ccm_protocol::client::ClientError::Address(address.to_string()))?;
    let endpoint = ccm_protocol::client::endpoint(address)?;
    let connector = tower::service_fn(move |_: tonic::transport::Uri| {
        let path = path.clone();
        async move { connect_checked(&path, uid).await.map(hyper_util::rt::TokioIo::new) }
    });
    Ok(endpoint.connect_with_connector_lazy(connector))
}

/// The most bytes of a provider's metrics passed on (a provider's own series and its calls':
/// tens of KiB; more is a fault, not a scrape).
pub const MAX_METRICS_BYTES: usize = 8 << 20;
/// How long a provider has to answer a scrape.
pub const SCRAPE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Why a provider's metrics could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// The socket could not be reached (or is served by another user).
    #[error("connecting to {path}")]
    Connect {
        /// The socket.
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The HTTP exchange failed.
    #[error("reading /metrics from {path}")]
    Http {
        /// The socket.
        path: PathBuf,
        #[source]
        source: hyper::Error,
    },
    /// No answer in time.
    #[error("{path} did not answer within {SCRAPE_TIMEOUT:?}")]
    Timeout {
        /// The socket.
        path: PathBuf,
    },
    /// The answer was not 200, or too long.
    #[error("{path} answered {why}")]
    Answer {
        /// The socket.
        path: PathBuf,
        /// What was wrong.
        why: String,
    },
}

/// `GET /metrics` on the provider's metrics socket at `path` (served by `uid` when given):
/// the content type and the body, at most [`MAX_METRICS_BYTES`], within [`SCRAPE_TIMEOUT`].
pub async fn scrape(path: &std::path::Path, uid: Option<u32>) -> Result<(String, Vec<u8>), ScrapeError> {
    match tokio::time::timeout(SCRAPE_TIMEOUT, scrape_now(path, uid)).await {
        Ok(answer) => answer,
        Err(_) => Err(ScrapeError::Timeout { path: path.to_path_buf() }),
    }
}

async fn scrape_now(path: &std::path::Path, uid: Option<u32>) -> Result<(String, Vec<u8>), ScrapeError> {
    use http_body_util::BodyExt;
    let connect = |source| ScrapeError::Connect { path: path.to_path_buf(), source };
    let http = |source| ScrapeError::Http { path: path.to_path_buf(), source };
    let answer = |why: String| ScrapeError::Answer { path: path.to_path_buf(), why };
    let stream = match uid {
        Some(uid) => connect_checked(path, uid).await.map_err(connect)?,
        None => tokio::net::UnixStream::connect(path).await.map_err(connect)?,
    };
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.map_err(http)?;
    let driving = tokio::spawn(connection);
    let request = hyper::Request::get("/metrics")
        .header(hyper::header::HOST, "localhost")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .map_err(|e| answer(format!("an unusable request: {e}")))?;
    let response = sender.send_request(request).await.map_err(http)?;
    if response.status() != hyper::StatusCode::OK {
        driving.abort();
        return Err(answer(format!("HTTP {}", response.status())));
    }
    let content_type = response
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("text/plain; version=0.0.4")
        .to_string();
    let limited = http_body_util::Limited::new(response.into_body(), MAX_METRICS_BYTES);
    let body = limited.collect().await.map_err(|e| answer(format!("a body that could not be read whole: {e}")))?;
    driving.abort();
    Ok((content_type, body.to_bytes().to_vec()))
}

/// Connects to the unix socket at `path` if the process serving it runs as `uid`.
pub(crate) async fn connect_checked(path: &std::path::Path, uid: u32) -> std::io::Result<tokio::net::UnixStream> {
    let stream = tokio::net::UnixStream::connect(path).await?;
    let peer = stream.peer_cred()?.uid();
    if peer != uid {
        tracing::error!(socket = %path.display(), peer_uid = peer, expected_uid = uid, "provider socket served by another user; refused");
        return Err(refused(path, peer, uid));
    }
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn parse(args: &[&str]) -> Options {
        Options::try_parse_from(std::iter::once("cloud-controller-manager").chain(args.iter().copied())).expect("parse")
    }

    #[test]
    fn one_provider_takes_the_plain_form_several_need_names() {
        let one = parse(&[
            "--provider-endpoint=unix:///run/p/provider.sock",
            "--provider-peer-uid=65533",
            "--provider-metrics=unix:///run/p/metrics.sock",
            "--provider-token=kube-system/ccm-rs-provider=/run/token",
        ]);
        let parsed = checked(&one);
        assert_eq!(parsed.peer_uids.get("default"), Some(&65533));
        assert_eq!(parsed.metrics.get("default"), Some(&PathBuf::from("/run/p/metrics.sock")));
        assert_eq!(
            parsed.tokens,
            vec![Handover { namespace: "kube-system".into(), account: "ccm-rs-provider".into(), dir: "/run/token".into() }]
        );
        let two = parse(&[
            "--provider-endpoint=a=unix:///run/a/provider.sock",
            "--provider-endpoint=b=unix:///run/b/provider.sock",
            "--provider-peer-uid=b=65534",
        ]);
        assert_eq!(checked(&two).peer_uids.get("b"), Some(&65534));
        let unnamed = parse(&[
            "--provider-endpoint=a=unix:///run/a/provider.sock",
            "--provider-endpoint=b=unix:///run/b/provider.sock",
            "--provider-peer-uid=65534",
        ]);
        assert!(access(&unnamed).expect_err("ambiguous").0.contains("NAME=VALUE"));
    }

    fn checked(options: &Options) -> Access {
        access(options).expect("valid")
    }

    #[test]
    fn bad_values_are_refused_with_the_flag() {
        for (args, says) in [
            (vec!["--provider-peer-uid=root"], "not a user id"),
            (vec!["--provider-peer-uid=1", "--provider-peer-uid=2"], "twice"),
            (vec!["--provider-endpoint=http://127.0.0.1:9000", "--provider-peer-uid=1"], "not a unix socket"),
            (vec!["--provider-metrics=http://0.0.0.0:10260"], "unix:///path"),
            (vec!["--provider-metrics=unix:///var/run/ccm/provider.sock"], "gRPC socket"),
            (vec!["--provider-token=ccm-rs-provider=/run/t"], "NAMESPACE/NAME=DIR"),
            (vec!["--provider-token=kube-system/Bad_Name=/run/t"], "not a Kubernetes name"),
            (vec!["--provider-token=kube-system/p=run/t"], "absolute"),
            (vec!["--provider-token=kube-system/p=/run/t/../u"], "without '..'"),
            (vec!["--provider-token=kube-system/node-controller=/run/t"], "a controller's account"),
            (vec!["--provider-token=kube-system/p=/var/run/secrets/kubernetes.io/serviceaccount"], "own credentials"),
            (vec!["--provider-token=kube-system/p=/run/t", "--provider-token=kube-system/q=/run/t"], "that directory"),
        ] {
            let error = access(&parse(&args)).expect_err(&format!("{args:?}")).0;
            assert!(error.contains(says), "{args:?}: {error}");
        }
    }

    #[tokio::test]
    async fn a_socket_served_by_another_user_is_refused() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("provider.sock");
        let listener = tokio::net::UnixListener::bind(&path).expect("bind");
        let accepting = tokio::spawn(async move { while listener.accept().await.is_ok() {} });
        // This process serves the socket: its user is the owner of what it creates.
        let me = std::fs::metadata(&path).expect("socket").uid();
        assert!(connect_checked(&path, me).await.is_ok(), "the expected user is accepted");
        let error = connect_checked(&path, me.wrapping_add(1)).await.expect_err("another user is refused");
        assert_eq!(error.kind(), std::io::ErrorKind::PermissionDenied);
        assert!(error.to_string().contains("--provider-peer-uid"), "{error}");
        // Through the gRPC channel the core uses: the call fails, nothing is sent.
        let address = format!("unix://{}", path.display());
        let channel = checked_unix_channel(&address, me.wrapping_add(1)).expect("channel");
        let status = ccm_proto::v1::identity_service_client::IdentityServiceClient::new(channel)
            .get_plugin_info(ccm_proto::v1::GetPluginInfoRequest::default())
            .await
            .expect_err("refused");
        assert!(format!("{status:?}").contains("--provider-peer-uid"), "{status:?}");
        accepting.abort();
    }
}
