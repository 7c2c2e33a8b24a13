//! Kubernetes' name and label rules, as the API server enforces them: what a provider's zone,
//! region, instance type, tags and addresses must satisfy before the core writes them.

/// A label name or value part: at most 63 characters, alphanumeric at both ends, `-`, `_`
/// and `.` inside.
pub fn valid_name_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// Whether `s` is a DNS subdomain (RFC 1123): dot-separated lowercase labels.
pub fn valid_dns_subdomain(s: &str) -> bool {
    s.len() <= 253
        && s.split('.').all(|l| {
            let b = l.as_bytes();
            !b.is_empty()
                && b.len() <= 63
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        })
}

/// Whether `key` is a valid label key (`[prefix/]name`).
pub fn valid_label_key(key: &str) -> bool {
    match key.split_once('/') {
        Some((prefix, name)) => valid_dns_subdomain(prefix) && valid_name_part(name),
        None => valid_name_part(key),
    }
}

/// Whether `value` is a valid label value.
pub fn valid_label_value(value: &str) -> bool {
    value.is_empty() || valid_name_part(value)
}
