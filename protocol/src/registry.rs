//! Image references and registry match patterns, as the kubelet reads them: helpers for
//! ImageCredentialsService providers and the checks the SDK makes on their answers.

use ccm_proto::v1::{CacheKeyType, GetImageCredentialsResponse};

use crate::error::{Error, Result};

/// The longest image reference accepted.
pub const MAX_IMAGE_LEN: usize = 4096;
/// The registry of images named without one (`nginx:1.27`).
pub const DEFAULT_REGISTRY: &str = "docker.io";

/// An image reference split into registry host (with port) and repository path, without
/// tag or digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef<'a> {
    /// `registry.sim.dev` or `localhost:5000`; [`DEFAULT_REGISTRY`] when the image names none.
    pub host: &'a str,
    /// `team/app`.
    pub path: &'a str,
}

/// Parses an image reference (`[host[:port]/]path[:tag][@digest]`). The first component is a
/// host when it contains a '.' or ':' or is `localhost`, as in the kubelet and Docker.
pub fn parse_image(image: &str) -> Result<ImageRef<'_>> {
    let bad = |why: &str| Err(Error::invalid_argument(format!("image {image:?}: {why}")));
    if image.is_empty() {
        return bad("empty");
    }
    if image.len() > MAX_IMAGE_LEN {
        return bad("longer than 4096 bytes");
    }
    if image.chars().any(|c| c.is_whitespace() || c.is_control()) || image.contains("://") {
        return bad("not an image reference (no scheme, no spaces)");
    }
    let without_digest = image.split_once('@').map_or(image, |(name, _)| name);
    let (host, rest) = match without_digest.split_once('/') {
        Some((first, rest)) if first.contains('.') || first.contains(':') || first == "localhost" => (first, rest),
        _ => (DEFAULT_REGISTRY, without_digest),
    };
    // A tag is a ':' after the last '/'.
    let path = match rest.rsplit_once(':') {
        Some((p, tag)) if !tag.contains('/') => p,
        _ => rest,
    };
    if host.is_empty() || path.is_empty() || path.split('/').any(str::is_empty) {
        return bad("needs a repository path");
    }
    Ok(ImageRef { host, path })
}

/// The registry host of an image (see [`parse_image`]).
pub fn image_host(image: &str) -> Result<&str> {
    parse_image(image).map(|r| r.host)
}

/// Whether a registry pattern (`*.registry.sim.dev`, `registry.sim.dev:5000/team`) covers an
/// image: the same number of host labels, each matching ('*' matches within one label), the
/// same port, and the pattern's path a prefix of the image's.
pub fn pattern_matches(pattern: &str, image: &str) -> bool {
    let Ok(image) = parse_image(image) else { return false };
    let (p_hostport, p_path) = pattern.split_once('/').unwrap_or((pattern, ""));
    let (p_host, p_port) = p_hostport.split_once(':').unwrap_or((p_hostport, ""));
    let (i_host, i_port) = image.host.split_once(':').unwrap_or((image.host, ""));
    let p_labels: Vec<&str> = p_host.split('.').collect();
    let i_labels: Vec<&str> = i_host.split('.').collect();
    p_port == i_port
        && p_labels.len() == i_labels.len()
        && p_labels.iter().zip(&i_labels).all(|(p, i)| glob(p, i))
        && (p_path.is_empty() || image.path == p_path || image.path.starts_with(&format!("{}/", p_path.trim_end_matches('/'))))
}

/// `*` matches any run of characters (within one host label).
fn glob(pattern: &str, text: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == text,
        Some((head, tail)) => {
            let Some(rest) = text.strip_prefix(head) else { return false };
            (0..=rest.len()).filter(|i| rest.is_char_boundary(*i)).any(|i| glob(tail, &rest[i..]))
        }
    }
}

/// Whether a registry pattern is well formed: a host of non-empty labels (letters, digits,
/// '-', '*'), an optional numeric port, an optional path; no scheme.
pub fn valid_pattern(pattern: &str) -> bool {
    let (hostport, _) = pattern.split_once('/').unwrap_or((pattern, ""));
    let (host, port) = hostport.split_once(':').unwrap_or((hostport, ""));
    !pattern.contains("://")
        && !pattern.chars().any(|c| c.is_whitespace() || c.is_control())
        && !host.is_empty()
        && host.split('.').all(|l| !l.is_empty() && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '*'))
        && (port.is_empty() || port.parse::<u16>().is_ok())
}

/// Checks an ImageCredentials answer to a request for `image`: [`check_answer`], and every
/// pattern covers `image` and names a domain (a wildcard never stands for the last two labels
/// of a host: `*.*` or `*.io` would hand the credentials to registries nobody asked about,
/// for as long as the kubelet caches them). The error names the bad pattern, never a secret.
pub fn check_answer_for(answer: &GetImageCredentialsResponse, image: &str) -> Result<()> {
    check_answer(answer)?;
    for pattern in answer.auth.keys() {
        let (hostport, _) = pattern.split_once('/').unwrap_or((pattern, ""));
        let host = hostport.split_once(':').map_or(hostport, |(h, _)| h);
        let labels: Vec<&str> = host.split('.').collect();
        if host.contains('*') && (labels.len() < 3 || labels[labels.len() - 2..].iter().any(|l| l.contains('*'))) {
            return Err(Error::internal(format!(
                "invalid image credentials: registry pattern {pattern:?} names no domain (a wildcard in its last two labels)"
            )));
        }
        if !pattern_matches(pattern, image) {
            return Err(Error::internal(format!(
                "invalid image credentials: registry pattern {pattern:?} does not cover the image asked about"
            )));
        }
    }
    Ok(())
}

/// Checks an ImageCredentials answer: valid patterns, and a cache key type when there are
/// credentials. The error names the bad pattern, never a secret.
pub fn check_answer(answer: &GetImageCredentialsResponse) -> Result<()> {
    if let Some(bad) = answer.auth.keys().find(|p| !valid_pattern(p)) {
        return Err(Error::internal(format!("invalid image credentials: registry pattern {bad:?} is malformed")));
    }
    let kind = CacheKeyType::try_from(answer.cache_key_type).unwrap_or(CacheKeyType::Unspecified);
    if !answer.auth.is_empty() && kind == CacheKeyType::Unspecified {
        return Err(Error::internal("invalid image credentials: credentials without a cache_key_type"));
    }
    if answer.cache_duration.is_some_and(|d| d.seconds < 0 || d.nanos < 0) {
        return Err(Error::internal("invalid image credentials: negative cache_duration"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ccm_proto::v1::RegistryCredential;

    #[test]
    fn parses_images_like_the_kubelet() {
        let r = |i| parse_image(i).map(|r| (r.host, r.path)).ok();
        assert_eq!(r("registry.sim.dev/team/app:1.2"), Some(("registry.sim.dev", "team/app")));
        assert_eq!(r("localhost:5000/app@sha256:abc"), Some(("localhost:5000", "app")));
        assert_eq!(r("nginx:1.27"), Some(("docker.io", "nginx")));
        assert_eq!(r("library/nginx"), Some(("docker.io", "library/nginx")));
        assert_eq!(r(""), None);
        assert_eq!(r("https://registry.sim.dev/app"), None);
        assert_eq!(r("registry.sim.dev/"), None);
        assert_eq!(r("a b"), None);
    }

    #[test]
    fn credentials_only_for_the_image_asked_about() {
        let answer = |pattern: &str| GetImageCredentialsResponse {
            auth: [(pattern.to_string(), RegistryCredential { username: "u".into(), password: "SECRET".into() })].into(),
            cache_key_type: CacheKeyType::Global as i32,
            ..Default::default()
        };
        let image = "eu.registry.sim.dev/team/app:1";
        for good in ["*.registry.sim.dev", "eu.registry.sim.dev", "eu.registry.sim.dev/team"] {
            assert!(check_answer_for(&answer(good), image).is_ok(), "{good}");
        }
        for (bad, why) in [
            ("*.*.*.*", "names no domain"),
            ("*.*", "names no domain"),
            ("*.dev", "names no domain"),
            ("eu.registry.*.dev", "names no domain"),
            ("other.registry.sim.dev", "does not cover"),
            ("eu.registry.sim.dev/other", "does not cover"),
        ] {
            let error = check_answer_for(&answer(bad), image).expect_err(bad).to_string();
            assert!(error.contains(why) && !error.contains("SECRET"), "{bad}: {error}");
        }
        assert!(check_answer_for(&answer("*.*"), "a.io/app").is_err(), "*.* covers a.io but names no domain");
        assert!(check_answer_for(&answer("localhost:5000"), "localhost:5000/app").is_ok());
    }

    #[test]
    fn patterns_match_hosts_ports_and_paths() {
        assert!(pattern_matches("*.registry.sim.dev", "eu.registry.sim.dev/team/app:1"));
        assert!(!pattern_matches("*.registry.sim.dev", "registry.sim.dev/team/app:1"));
        assert!(!pattern_matches("*.registry.sim.dev", "a.b.registry.sim.dev/app"));
        assert!(pattern_matches("registry.sim.dev", "registry.sim.dev/app"));
        assert!(!pattern_matches("registry.sim.dev", "registry.sim.dev:5000/app"));
        assert!(pattern_matches("registry.sim.dev:5000", "registry.sim.dev:5000/app"));
        assert!(pattern_matches("registry.sim.dev/team", "registry.sim.dev/team/app"));
        assert!(!pattern_matches("registry.sim.dev/team", "registry.sim.dev/teamx/app"));
        assert!(pattern_matches("reg-*.sim.dev", "reg-eu.sim.dev/app"));
    }

    #[test]
    fn answers_are_checked() {
        let cred = RegistryCredential { username: "u".into(), password: "s3cr3t".into() };
        let mut a = GetImageCredentialsResponse::default();
        assert!(check_answer(&a).is_ok(), "no credentials is an answer");
        a.auth.insert("registry.sim.dev".into(), cred.clone());
        assert!(check_answer(&a).is_err(), "credentials need a cache key type");
        a.cache_key_type = CacheKeyType::Registry as i32;
        assert!(check_answer(&a).is_ok());
        a.auth.insert("https://registry.sim.dev".into(), cred);
        let e = check_answer(&a).expect_err("scheme");
        assert!(!e.to_string().contains("s3cr3t"), "no secret in {e}");
    }
}
