//! Label selectors as the operator writes them in flags (`--node-selector`-like filters), and the
//! label domains the core never sets from provider data.

use std::collections::BTreeMap;

use ccm_protocol::labels::valid_label_key;

/// Whether a label key is in a domain the core never sets from provider data
/// (`kubernetes.io`, `k8s.io` and their subdomains).
pub fn reserved_label_domain(key: &str) -> bool {
    let Some((prefix, _)) = key.split_once('/') else { return false };
    ["kubernetes.io", "k8s.io"].iter().any(|d| prefix == *d || prefix.ends_with(&format!(".{d}")))
}

/// Parses a label selector of `k=v`, `k==v`, `k!=v`, `k` and `!k` terms joined by commas.
pub fn parse_selector(text: &str) -> Result<Vec<(String, Op)>, String> {
    let mut terms = Vec::new();
    for term in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let parsed = if let Some((k, v)) = term.split_once("!=") {
            (k.trim().to_string(), Op::NotEquals(v.trim().to_string()))
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            (k.trim().to_string(), Op::Equals(v.trim().to_string()))
        } else if let Some(k) = term.strip_prefix('!') {
            (k.trim().to_string(), Op::Absent)
        } else {
            (term.to_string(), Op::Present)
        };
        if !valid_label_key(&parsed.0) {
            return Err(format!("{term:?}: {:?} is not a label key", parsed.0));
        }
        terms.push(parsed);
    }
    if terms.is_empty() {
        return Err(format!("empty label selector {text:?}"));
    }
    Ok(terms)
}

/// One selector requirement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `k=v`.
    Equals(String),
    /// `k!=v`.
    NotEquals(String),
    /// `k`.
    Present,
    /// `!k`.
    Absent,
}

/// Whether labels match every term.
pub fn selector_matches(terms: &[(String, Op)], labels: &BTreeMap<String, String>) -> bool {
    terms.iter().all(|(k, op)| match op {
        Op::Equals(v) => labels.get(k) == Some(v),
        Op::NotEquals(v) => labels.get(k) != Some(v),
        Op::Present => labels.contains_key(k),
        Op::Absent => !labels.contains_key(k),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ccm_protocol::labels::valid_label_value;

    #[test]
    fn label_rules() {
        assert!(valid_label_key("tags.cloudprovider.dev/team"));
        assert!(valid_label_key("team"));
        assert!(!valid_label_key("tags.cloudprovider.dev/has space"));
        assert!(!valid_label_key("Tags.Example/x"));
        assert!(!valid_label_key(&format!("p/{}", "x".repeat(64))));
        assert!(valid_label_value("") && valid_label_value("a.b-c_d"));
        assert!(!valid_label_value("-a") && !valid_label_value("a b"));
        assert!(reserved_label_domain("node.kubernetes.io/x") && reserved_label_domain("k8s.io/x"));
        assert!(!reserved_label_domain("example.com/x") && !reserved_label_domain("plain"));
    }

    #[test]
    fn selectors() {
        let terms = parse_selector("type=virtual-kubelet,!gpu").expect("parse");
        let mut labels = BTreeMap::from([("type".to_string(), "virtual-kubelet".to_string())]);
        assert!(selector_matches(&terms, &labels));
        labels.insert("gpu".into(), "1".into());
        assert!(!selector_matches(&terms, &labels));
        assert!(parse_selector("").is_err());
        assert!(parse_selector("bad key=1").is_err());
    }
}
