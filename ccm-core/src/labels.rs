//! Label selectors as the operator writes them in flags (`--node-selector`-like filters), and the
//! label domains the core never sets from provider data.

use std::collections::{BTreeMap, BTreeSet};

use ccm_protocol::labels::{valid_label_key, valid_label_value};

/// Whether a label key is in a domain the core never sets from provider data
/// (`kubernetes.io`, `k8s.io` and their subdomains).
pub fn reserved_label_domain(key: &str) -> bool {
    let Some((prefix, _)) = key.split_once('/') else { return false };
    ["kubernetes.io", "k8s.io"].iter().any(|d| prefix == *d || prefix.ends_with(&format!(".{d}")))
}

/// Parses a label selector as Kubernetes writes one (`labels.Parse`): requirements joined by
/// commas, each `k=v`, `k==v`, `k!=v`, `k in (v1,v2)`, `k notin (v1,v2)`, `k`, `!k`, `k>N` or
/// `k<N`; keys and values checked as label keys and values.
pub fn parse_selector(text: &str) -> Result<Vec<(String, Op)>, String> {
    let mut terms = Vec::new();
    for term in split_terms(text)?.into_iter().map(str::trim).filter(|t| !t.is_empty()) {
        let parsed = parse_term(term)?;
        if !valid_label_key(&parsed.0) {
            return Err(format!("{term:?}: {:?} is not a label key", parsed.0));
        }
        let values: Vec<&String> = match &parsed.1 {
            Op::Equals(v) | Op::NotEquals(v) => vec![v],
            Op::In(vs) | Op::NotIn(vs) => vs.iter().collect(),
            _ => Vec::new(),
        };
        if let Some(v) = values.into_iter().find(|v| !valid_label_value(v)) {
            return Err(format!("{term:?}: {v:?} is not a label value"));
        }
        terms.push(parsed);
    }
    if terms.is_empty() {
        return Err(format!("empty label selector {text:?}"));
    }
    Ok(terms)
}

/// The selector's requirements: split at the commas outside parentheses.
fn split_terms(text: &str) -> Result<Vec<&str>, String> {
    let (mut terms, mut depth, mut start) = (Vec::new(), 0usize, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.checked_sub(1).ok_or_else(|| format!("{text:?}: a ')' without its '('"))?,
            ',' if depth == 0 => {
                terms.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("{text:?}: a '(' without its ')'"));
    }
    terms.push(&text[start..]);
    Ok(terms)
}

/// One requirement.
fn parse_term(term: &str) -> Result<(String, Op), String> {
    if let Some(k) = term.strip_prefix('!') {
        return Ok((k.trim().to_string(), Op::Absent));
    }
    if let Some(open) = term.find('(') {
        let (head, list) = term.split_at(open);
        let list = list.strip_prefix('(').and_then(|l| l.trim_end().strip_suffix(')'));
        let list = list.ok_or_else(|| format!("{term:?}: a set is written (v1,v2)"))?;
        if list.trim().is_empty() {
            return Err(format!("{term:?}: a set needs at least one value"));
        }
        let values: BTreeSet<String> = list.split(',').map(|v| v.trim().to_string()).collect();
        let mut words = head.split_whitespace();
        let (key, op, rest) = (words.next(), words.next(), words.next());
        return match (key, op, rest) {
            (Some(k), Some("in"), None) => Ok((k.to_string(), Op::In(values))),
            (Some(k), Some("notin"), None) => Ok((k.to_string(), Op::NotIn(values))),
            _ => Err(format!("{term:?}: a set requirement is `key in (..)` or `key notin (..)`")),
        };
    }
    let number = |k: &str, n: &str, op: fn(i64) -> Op| {
        let n = n.trim().parse::<i64>().map_err(|_| format!("{term:?}: {:?} is not an integer", n.trim()))?;
        Ok((k.trim().to_string(), op(n)))
    };
    if let Some((k, v)) = term.split_once("!=") {
        Ok((k.trim().to_string(), Op::NotEquals(v.trim().to_string())))
    } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
        Ok((k.trim().to_string(), Op::Equals(v.trim().to_string())))
    } else if let Some((k, n)) = term.split_once('>') {
        number(k, n, Op::Gt)
    } else if let Some((k, n)) = term.split_once('<') {
        number(k, n, Op::Lt)
    } else {
        Ok((term.to_string(), Op::Present))
    }
}

/// One selector requirement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `k=v`.
    Equals(String),
    /// `k!=v` (also true without the label).
    NotEquals(String),
    /// `k in (v1,v2)`.
    In(BTreeSet<String>),
    /// `k notin (v1,v2)` (also true without the label).
    NotIn(BTreeSet<String>),
    /// `k`.
    Present,
    /// `!k`.
    Absent,
    /// `k>N`: the label is an integer greater than N.
    Gt(i64),
    /// `k<N`: the label is an integer less than N.
    Lt(i64),
}

/// Whether labels match every term.
pub fn selector_matches(terms: &[(String, Op)], labels: &BTreeMap<String, String>) -> bool {
    terms.iter().all(|(k, op)| {
        let value = labels.get(k);
        let number = || value.and_then(|v| v.parse::<i64>().ok());
        match op {
            Op::Equals(v) => value == Some(v),
            Op::NotEquals(v) => value != Some(v),
            Op::In(vs) => value.is_some_and(|v| vs.contains(v)),
            Op::NotIn(vs) => value.is_none_or(|v| !vs.contains(v)),
            Op::Present => value.is_some(),
            Op::Absent => value.is_none(),
            Op::Gt(n) => number().is_some_and(|v| v > *n),
            Op::Lt(n) => number().is_some_and(|v| v < *n),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn set_based_selectors_read_as_kubernetes_reads_them() {
        let labels = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let terms = parse_selector("pool in (ingress, edge),zone notin (z3),!gpu,cores>3,env=").expect("parse");
        assert_eq!(terms.len(), 5);
        assert!(selector_matches(&terms, &labels(&[("pool", "edge"), ("zone", "z1"), ("cores", "4"), ("env", "")])));
        assert!(selector_matches(&terms, &labels(&[("pool", "ingress"), ("cores", "8"), ("env", "")])), "notin: absent is fine");
        assert!(!selector_matches(&terms, &labels(&[("pool", "web"), ("cores", "8"), ("env", "")])));
        assert!(!selector_matches(&terms, &labels(&[("pool", "edge"), ("zone", "z3"), ("cores", "8"), ("env", "")])));
        assert!(!selector_matches(&terms, &labels(&[("pool", "edge"), ("cores", "three"), ("env", "")])));
        assert!(selector_matches(&parse_selector("cores<2").expect("lt"), &labels(&[("cores", "1")])));
        for bad in [
            "pool in (a",
            "pool in a)",
            "pool within (a)",
            "pool in (a b)",
            "cores>x",
            "k=not a value",
            "k in (-x)",
            "k in ()",
            "!k=v",
        ] {
            assert!(parse_selector(bad).is_err(), "{bad:?} is refused");
        }
    }
}
