//! Load balancer names that fit a cloud's limits and stay readable.
//!
//! A name is `<cluster>-<namespace>-<name>-<hash>`, where `<hash>` is 8 hex digits of the
//! SHA-256 of the Service UID. The hash is always there, not only when the name is shortened:
//! `-` is legal inside namespaces and names, so without it `a-b`/`c` and `a`/`b-c` would
//! collide, and a Service re-created under the same name would reuse a load balancer that is
//! still being deleted. When the name is too long, the longest of the three readable parts
//! is trimmed first, one character at a time, so every part keeps as much as it can.

use ccm_proto::v1::LoadBalancersCapabilities;
use sha2::{Digest, Sha256};

/// Characters allowed when the provider advertises none.
pub const DEFAULT_ALLOWED: &str = "abcdefghijklmnopqrstuvwxyz0123456789-";
/// Length used when the provider advertises no limit (a DNS label).
pub const DEFAULT_MAX_LENGTH: usize = 63;
/// The shortest limit honoured: below it, names could no longer be unique and readable.
pub const MIN_MAX_LENGTH: usize = 16;
const HASH_LEN: usize = 8;

/// Whether `scheme` is a URL scheme (RFC 3986: a letter, then letters, digits, `+`, `-` or
/// `.`), as a providerID scheme must be.
pub fn valid_scheme(scheme: &str) -> bool {
    let mut chars = scheme.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// The scheme of a providerID (`aws` of `aws:///us-east-1a/i-1`), if it has one.
pub fn provider_id_scheme(provider_id: &str) -> Option<&str> {
    provider_id.split_once("://").map(|(scheme, _)| scheme).filter(|s| valid_scheme(s))
}

/// The naming rules of a provider's load balancers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameLimits {
    max_length: usize,
    allowed: Vec<char>,
}

impl Default for NameLimits {
    fn default() -> Self {
        Self { max_length: DEFAULT_MAX_LENGTH, allowed: DEFAULT_ALLOWED.chars().collect() }
    }
}

impl NameLimits {
    /// Rules with a maximum length and a set of allowed characters (empty means the default
    /// set). Lowercase letters, digits and `-` are always allowed: the hash and separators
    /// need them. The length is clamped to at least [`MIN_MAX_LENGTH`].
    pub fn new(max_length: usize, allowed: &str) -> Self {
        let mut chars: Vec<char> = allowed.chars().chain(DEFAULT_ALLOWED.chars()).collect();
        chars.sort_unstable();
        chars.dedup();
        let max_length = if max_length == 0 { DEFAULT_MAX_LENGTH } else { max_length.max(MIN_MAX_LENGTH) };
        Self { max_length, allowed: chars }
    }

    /// The rules a provider advertises.
    pub fn from_capabilities(caps: &LoadBalancersCapabilities) -> Self {
        Self::new(caps.max_name_length as usize, &caps.allowed_name_characters)
    }

    /// The longest name allowed.
    pub fn max_length(&self) -> usize {
        self.max_length
    }

    /// Checks a name against these rules, saying what is wrong.
    pub fn check(&self, name: &str) -> Result<(), String> {
        if name.is_empty() {
            return Err("load balancer name is empty".into());
        }
        let len = name.chars().count();
        if len > self.max_length {
            return Err(format!("load balancer name {name:?} is {len} characters, more than {}", self.max_length));
        }
        if let Some(c) = name.chars().find(|c| !self.allowed.contains(c)) {
            return Err(format!("load balancer name {name:?} contains {c:?}, which the provider does not allow"));
        }
        Ok(())
    }

    fn clean(&self, part: &str) -> String {
        let mut out = String::with_capacity(part.len());
        for c in part.chars() {
            let c = if self.allowed.contains(&c) { c } else { c.to_ascii_lowercase() };
            let c = if self.allowed.contains(&c) { c } else { '-' };
            if !(c == '-' && (out.is_empty() || out.ends_with('-'))) {
                out.push(c);
            }
        }
        out.trim_end_matches('-').to_string()
    }
}

/// The load balancer name of a Service: deterministic, within `limits`, starting with a
/// letter and never ending with `-`.
pub fn load_balancer_name(cluster: &str, namespace: &str, name: &str, uid: &str, limits: &NameLimits) -> String {
    let digest = Sha256::digest(uid.as_bytes());
    let hash: String = digest.iter().take(HASH_LEN / 2).map(|b| format!("{b:02x}")).collect();
    let mut parts: Vec<Vec<char>> = [cluster, namespace, name]
        .iter()
        .map(|p| limits.clean(p).chars().collect())
        .filter(|p: &Vec<char>| !p.is_empty())
        .collect();
    let starts_with_letter = parts.first().and_then(|p| p.first()).is_some_and(|c| c.is_ascii_alphabetic());
    let prefix = if starts_with_letter { "" } else { "lb-" };
    // Budget for the readable parts: total minus prefix, hash and one '-' per part.
    let budget = limits.max_length.saturating_sub(prefix.len() + HASH_LEN + parts.len());
    while parts.iter().map(Vec::len).sum::<usize>() > budget {
        let Some(longest) = parts.iter_mut().max_by_key(|p| p.len()) else { break };
        longest.pop();
    }
    let mut out = String::from(prefix);
    for part in parts.iter().map(|p| p.iter().collect::<String>()) {
        let part = part.trim_matches('-');
        if !part.is_empty() {
            out.push_str(part);
            out.push('-');
        }
    }
    out.push_str(&hash);
    out
}

/// The length of upstream's load balancer names (`cloudprovider.DefaultLoadBalancerName`).
pub const UPSTREAM_LENGTH: usize = 32;

/// The name upstream's cloud-controller-manager gives a Service's load balancer, and most
/// clouds' providers use: `a` and the UID without its dashes, cut to 32 characters (or the
/// provider's shorter limit). A cluster that moves from upstream keeps its load balancers
/// under this naming.
pub fn upstream_load_balancer_name(uid: &str, limits: &NameLimits) -> String {
    let name: String = std::iter::once('a').chain(uid.chars().filter(|c| *c != '-')).collect();
    name.chars().take(UPSTREAM_LENGTH.min(limits.max_length)).collect()
}

/// Whether `name` is one this project derives for the Service whose UID is `uid`, under
/// either naming and whatever the cluster's name or the provider's limits were when it was
/// made: upstream's (`a` and the UID without dashes, cut to no fewer than [`MIN_MAX_LENGTH`]
/// characters) or a readable one (ending in `-` and the UID's hash).
///
/// ## Warning
/// A name recorded on a Service is user-writable (an annotation). The protocol keys every
/// call by the name, so a recorded name that fails this check would steer calls onto
/// another Service's load balancer, across namespaces: such a name must never be used
/// (issue 54).
pub fn is_load_balancer_name_of(name: &str, uid: &str) -> bool {
    if uid.is_empty() || name.is_empty() {
        return false;
    }
    let upstream: String = std::iter::once('a').chain(uid.chars().filter(|c| *c != '-')).collect();
    let cut = name.len() >= MIN_MAX_LENGTH.min(upstream.len()) && name.len() <= UPSTREAM_LENGTH;
    if cut && upstream.starts_with(name) {
        return true;
    }
    let digest = Sha256::digest(uid.as_bytes());
    let hash: String = digest.iter().take(HASH_LEN / 2).map(|b| format!("{b:02x}")).collect();
    name.strip_suffix(hash.as_str()).is_some_and(|rest| rest.ends_with('-'))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    #[test]
    fn upstream_names_are_a_and_the_uid_without_dashes() {
        let limits = NameLimits::default();
        // As cloudprovider.DefaultLoadBalancerName names it.
        assert_eq!(
            upstream_load_balancer_name("0b5c2f55-1c2d-4a9e-8f7e-3d2b1a0c9e8f", &limits),
            "a0b5c2f551c2d4a9e8f7e3d2b1a0c9e8"
        );
        assert_eq!(upstream_load_balancer_name("0b5c2f55-1c2d", &limits), "a0b5c2f551c2d");
        assert_eq!(upstream_load_balancer_name("0b5c2f55-1c2d-4a9e-8f7e-3d2b1a0c9e8f", &NameLimits::new(20, "")).len(), 20);
    }

    use super::*;

    #[test]
    fn readable_when_it_fits() {
        let name = load_balancer_name("prod", "shop", "frontend", "0b5c2f55-1c2d-4a9e-8f7e-3d2b1a0c9e8f", &NameLimits::default());
        assert!(name.starts_with("prod-shop-frontend-"), "{name}");
        assert_eq!(name.len(), "prod-shop-frontend-".len() + 8);
    }

    #[test]
    fn shortened_names_keep_every_part() {
        let limits = NameLimits::new(32, "");
        let name = load_balancer_name("production-eu-west", "payments-backend", "checkout-service-public", "uid-1", &limits);
        assert!(name.len() <= 32, "{name}");
        assert!(name.starts_with("product"), "{name}");
        assert!(name.contains("-payme"), "{name}");
        assert!(name.contains("-check"), "{name}");
    }

    #[test]
    fn dash_ambiguity_does_not_collide() {
        let l = NameLimits::default();
        assert_ne!(load_balancer_name("c", "a-b", "x", "uid-1", &l), load_balancer_name("c", "a", "b-x", "uid-2", &l));
    }

    #[test]
    fn uppercase_is_lowered_only_when_not_allowed() {
        let upper = NameLimits::new(63, "ABCDEFGHIJKLMNOPQRSTUVWXYZ");
        assert!(load_balancer_name("Prod", "ns", "Web", "u", &upper).starts_with("Prod-ns-Web-"));
        assert!(load_balancer_name("Prod", "ns", "Web", "u", &NameLimits::default()).starts_with("prod-ns-web-"));
    }

    fn part() -> impl Strategy<Value = String> {
        "[a-zA-Z0-9._-]{0,70}"
    }

    proptest! {
        #[test]
        fn always_valid_and_deterministic(cluster in part(), ns in part(), name in part(), uid in "[a-f0-9-]{1,40}", max in 0usize..100) {
            let limits = NameLimits::new(max, "");
            let a = load_balancer_name(&cluster, &ns, &name, &uid, &limits);
            prop_assert_eq!(&a, &load_balancer_name(&cluster, &ns, &name, &uid, &limits));
            prop_assert!(limits.check(&a).is_ok(), "{:?}", limits.check(&a));
            prop_assert!(a.chars().next().is_some_and(|c| c.is_ascii_alphabetic()), "{}", a);
            prop_assert!(!a.ends_with('-'));
            prop_assert!(!a.contains("--"), "{}", a);
        }

        #[test]
        fn different_uids_give_different_names(ns in part(), name in part(), u1 in "[a-f0-9]{8,36}", u2 in "[a-f0-9]{8,36}") {
            prop_assume!(u1 != u2);
            let l = NameLimits::new(20, "");
            prop_assert_ne!(load_balancer_name("k", &ns, &name, &u1, &l), load_balancer_name("k", &ns, &name, &u2, &l));
        }
    }

    #[test]
    fn a_name_is_the_services_own_only_when_derived_from_its_uid() {
        let uid = "0b5c2f55-1c2d-4a9e-8f7e-3d2b1a0c9e8f";
        let other = "7d1e0a42-9b3c-4f5d-8e6f-1a2b3c4d5e6f";
        for limits in [NameLimits::default(), NameLimits::new(16, ""), NameLimits::new(32, "")] {
            for cluster in ["kubernetes", "prod", ""] {
                let readable = load_balancer_name(cluster, "shop", "frontend", uid, &limits);
                assert!(is_load_balancer_name_of(&readable, uid), "{readable}");
                assert!(!is_load_balancer_name_of(&readable, other), "{readable} is not the other Service's");
            }
            let upstream = upstream_load_balancer_name(uid, &limits);
            assert!(is_load_balancer_name_of(&upstream, uid), "{upstream}");
            assert!(!is_load_balancer_name_of(&upstream, other), "{upstream}");
        }
        // Another Service's names, or names nobody derives, are refused.
        let victim = load_balancer_name("kubernetes", "payments", "checkout", other, &NameLimits::default());
        assert!(!is_load_balancer_name_of(&victim, uid));
        assert!(!is_load_balancer_name_of(&upstream_load_balancer_name(other, &NameLimits::default()), uid));
        for name in ["", "a", "a0b5c2f5", "my-load-balancer", "payments-checkout"] {
            assert!(!is_load_balancer_name_of(name, uid), "{name:?}");
        }
        assert!(!is_load_balancer_name_of("anything", ""), "a Service without a UID has no name of its own");
        // The hash alone, without the separator a derived name always has, is refused.
        let hash = load_balancer_name("", "", "", uid, &NameLimits::default());
        assert!(hash.starts_with("lb-"), "{hash}");
        assert!(!is_load_balancer_name_of(hash.trim_start_matches("lb-"), uid));
    }

    proptest! {
        #[test]
        fn derived_names_are_their_services_own(
            cluster in "[a-z0-9-]{0,20}", ns in "[a-z0-9-]{1,30}", name in "[a-z0-9-]{1,30}",
            uid in "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", max in 16usize..80,
        ) {
            let limits = NameLimits::new(max, "");
            prop_assert!(is_load_balancer_name_of(&load_balancer_name(&cluster, &ns, &name, &uid, &limits), &uid));
            prop_assert!(is_load_balancer_name_of(&upstream_load_balancer_name(&uid, &limits), &uid));
        }
    }
}
