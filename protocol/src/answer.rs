//! The checks a provider's answers pass before anyone acts on them: the core before it writes
//! a Node, a route or a Service status, the kubelet-side client before it writes kubelet flags.
//! Each says what is wrong; the caller makes that its error.

use std::net::IpAddr;

use ccm_proto::v1::{self, InstanceMetadata, NodeAddressType};
use ipnet::IpNet;

use crate::error::{Error, Result};
use crate::labels::{valid_dns_subdomain, valid_label_value};

/// Whether `provider_id` is of `scheme` (`scheme://…`); any non-empty one when `scheme` is empty.
fn of_scheme(provider_id: &str, scheme: &str) -> bool {
    if scheme.is_empty() {
        return !provider_id.is_empty();
    }
    provider_id.strip_prefix(scheme).and_then(|rest| rest.strip_prefix("://")).is_some_and(|rest| !rest.is_empty())
}

/// Why `text` is not an address another host can reach (not an IP at all; unspecified,
/// loopback, link-local, multicast or broadcast), if it is not one. Written to a Node or a Service's
/// ingress, `0.0.0.0` or `127.0.0.1` would send traffic nowhere, or to whoever reads it.
fn unreachable_ip(text: &str) -> Option<String> {
    let Ok(ip) = text.parse::<IpAddr>() else { return Some(format!("{text:?} is not an IP address")) };
    let broadcast = matches!(ip, IpAddr::V4(v4) if v4.is_broadcast());
    // Link-local: 169.254.169.254 is the metadata service of most clouds; fe80::/10 reaches
    // only the link. Neither is a Node's or a load balancer's address.
    let link_local = match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    };
    (ip.is_unspecified() || ip.is_loopback() || ip.is_multicast() || broadcast || link_local).then(|| {
        format!("{text:?} is not an address another host can reach (unspecified, loopback, link-local, multicast or broadcast)")
    })
}

/// One address: an IP another host can reach for the IP types, a DNS name for the others, a
/// known type.
pub fn address(a: &v1::NodeAddress) -> Result<(), String> {
    use v1::NodeAddressType as T;
    match a.r#type() {
        T::Unspecified => Err(format!("address {:?} has no type", a.address)),
        T::InternalIp | T::ExternalIp if unreachable_ip(&a.address).is_some() => {
            Err(unreachable_ip(&a.address).unwrap_or_default())
        }
        T::Hostname | T::InternalDns | T::ExternalDns if !valid_dns_subdomain(&a.address.to_ascii_lowercase()) => {
            Err(format!("{:?} is not a DNS name", a.address))
        }
        _ => Ok(()),
    }
}

/// An instance's metadata: a providerID, when it gives one, of the advertised scheme (none is
/// the node controller's to judge: fine for a Node that has its own, a failed
/// initialisation for one that has not, as upstream), valid addresses, and zone, region and
/// instance type that can be label values.
pub fn instance(m: &v1::InstanceMetadata, scheme: &str) -> Result<(), String> {
    if !m.provider_id.is_empty() && !of_scheme(&m.provider_id, scheme) {
        return Err(format!("providerID {:?} is not of the provider's scheme {scheme:?}", m.provider_id));
    }
    for a in &m.addresses {
        address(a).map_err(|why| format!("instance {}: {why}", m.provider_id))?;
    }
    for (what, map) in [("additional labels", &m.additional_labels), ("tags", &m.tags)] {
        if map.len() > crate::limits::MAX_INSTANCE_LABELS {
            return Err(format!(
                "instance {}: {} {what}, more than the {} any cloud gives an instance",
                m.provider_id,
                map.len(),
                crate::limits::MAX_INSTANCE_LABELS
            ));
        }
    }
    for (what, value) in [("zone", &m.zone), ("region", &m.region), ("instance type", &m.instance_type)] {
        if !valid_label_value(value) {
            return Err(format!("instance {}: {what} {value:?} cannot be a label value", m.provider_id));
        }
    }
    pod_cidrs(&m.pod_cidrs).map_err(|why| format!("instance {}: {why}", m.provider_id))
}

/// An instance's pod CIDRs from the cloud: network addresses (no host bits set), at most one
/// per IP family.
pub fn pod_cidrs(cidrs: &[String]) -> Result<(), String> {
    let mut families = (false, false);
    for text in cidrs {
        let net: IpNet = text.parse().map_err(|_| format!("pod CIDR {text:?} is not a CIDR"))?;
        if net.trunc() != net {
            return Err(format!("pod CIDR {text:?} has host bits set"));
        }
        let seen = if net.addr().is_ipv4() { &mut families.0 } else { &mut families.1 };
        if std::mem::replace(seen, true) {
            return Err(format!("two pod CIDRs of one IP family ({})", cidrs.join(", ")));
        }
    }
    Ok(())
}

/// A route the provider listed or made: a CIDR destination and a named target.
pub fn route(r: &v1::Route) -> Result<(), String> {
    if r.destination_cidr.parse::<IpNet>().is_err() {
        return Err(format!("route {:?} has destination {:?}, which is not a CIDR", r.name, r.destination_cidr));
    }
    if r.target.as_ref().is_some_and(|t| t.node_name.is_empty()) {
        return Err(format!("route {:?} has a target without a node name", r.name));
    }
    Ok(())
}

/// A load balancer's status: each ingress an IP or a DNS name (not both, not neither), ports
/// in range.
pub fn status(s: &v1::LoadBalancerStatus) -> Result<(), String> {
    for i in &s.ingress {
        match (i.ip.is_empty(), i.hostname.is_empty()) {
            (true, true) => return Err("an ingress with neither an IP nor a hostname".into()),
            (false, false) => return Err(format!("an ingress with both IP {:?} and hostname {:?}", i.ip, i.hostname)),
            (false, true) if let Some(why) = unreachable_ip(&i.ip) => return Err(format!("ingress IP: {why}")),
            (true, false) if i.hostname.parse::<IpAddr>().is_ok() || !valid_dns_subdomain(&i.hostname) => {
                return Err(format!("ingress hostname {:?} is not a DNS name", i.hostname));
            }
            _ => {}
        }
        if let Some(p) = i.ports.iter().find(|p| !(1..=65535).contains(&p.port)) {
            return Err(format!("ingress port {} is out of range", p.port));
        }
    }
    Ok(())
}

/// A load balancer's reported backends: Node names (DNS subdomains), each once.
pub fn hosts(h: &v1::LoadBalancerHosts) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    for name in &h.node_names {
        if !valid_dns_subdomain(name) {
            return Err(format!("backend {name:?} is not a Node name"));
        }
        if !seen.insert(name.as_str()) {
            return Err(format!("backend {name:?} is reported twice"));
        }
    }
    Ok(())
}

/// Whether `c` is a control character (C0, DEL, C1 with NEL) or a Unicode line or paragraph
/// separator: text from the cloud that ends a line in a file or a YAML comment.
pub fn breaks_text(c: char) -> bool {
    c.is_control() || matches!(c, '\u{2028}' | '\u{2029}')
}

/// Checks a NodeMetadata answer: an instance id and a providerID of the form
/// `<scheme>://<rest>`, zone, region and instance type usable as label values, addresses
/// that are IP addresses (or names, for Hostname and DNS types), no whitespace anywhere a
/// kubelet flag carries it.
pub fn node_metadata(m: &InstanceMetadata) -> Result<()> {
    let bad = |what: String| Err(Error::internal(format!("invalid node metadata: {what}")));
    if m.instance_id.is_empty() {
        return bad("no instance_id".into());
    }
    // What the node plugin writes goes into files the kubelet reads as root (a YAML drop-in,
    // a flag): a line break of any kind (`\r`, NEL and U+2028/U+2029 end a YAML comment too)
    // or a control character in any field could add a field of its own.
    let strings = [
        ("instance_id", &m.instance_id),
        ("provider_id", &m.provider_id),
        ("instance_type", &m.instance_type),
        ("zone", &m.zone),
        ("region", &m.region),
        ("hostname", &m.hostname),
        ("node_name", &m.node_name),
    ];
    let maps = m.additional_labels.iter().chain(&m.tags).flat_map(|(k, v)| [("a label or tag", k), ("a label or tag", v)]);
    let listed = m.addresses.iter().map(|a| ("an address", &a.address)).chain(m.pod_cidrs.iter().map(|c| ("a pod CIDR", c)));
    for (field, value) in strings.into_iter().chain(maps).chain(listed) {
        if let Some(c) = value.chars().find(|c| breaks_text(*c)) {
            return bad(format!("{field} {value:?} contains the control or line-break character {:?}", c));
        }
    }
    for (what, count) in [("additional labels", m.additional_labels.len()), ("tags", m.tags.len())] {
        if count > crate::limits::MAX_INSTANCE_LABELS {
            return bad(format!(
                "{count} {what}, more than the {} any cloud gives an instance",
                crate::limits::MAX_INSTANCE_LABELS
            ));
        }
    }
    match m.provider_id.split_once("://") {
        Some((scheme, rest)) if !scheme.is_empty() && !rest.is_empty() => {}
        _ => return bad(format!("provider_id {:?} is not <scheme>://<id>", m.provider_id)),
    }
    if m.provider_id.chars().any(|c| c.is_whitespace() || c == ',' || c.is_control()) {
        return bad(format!("provider_id {:?} contains whitespace or a comma", m.provider_id));
    }
    for (field, value) in [("zone", &m.zone), ("region", &m.region), ("instance_type", &m.instance_type)] {
        if !valid_label_value(value) {
            return bad(format!("{field} {value:?} is not a valid label value"));
        }
    }
    for a in &m.addresses {
        let kind = NodeAddressType::try_from(a.r#type).unwrap_or(NodeAddressType::Unspecified);
        match kind {
            NodeAddressType::InternalIp | NodeAddressType::ExternalIp => {
                if let Some(why) = unreachable_ip(&a.address) {
                    return bad(format!("address of type {}: {why}", kind.as_str_name()));
                }
            }
            NodeAddressType::Hostname | NodeAddressType::InternalDns | NodeAddressType::ExternalDns => {
                if a.address.is_empty() || a.address.chars().any(|c| c.is_whitespace() || c.is_control()) {
                    return bad(format!("address {:?} of type {} is not a name", a.address, kind.as_str_name()));
                }
            }
            NodeAddressType::Unspecified => return bad(format!("address {:?} has no type", a.address)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ccm_proto::v1::NodeAddress;

    fn meta(id: &str, ip: &str) -> v1::InstanceMetadata {
        v1::InstanceMetadata {
            provider_id: id.into(),
            addresses: vec![v1::NodeAddress { r#type: v1::NodeAddressType::InternalIp as i32, address: ip.into() }],
            zone: "zone-a".into(),
            ..Default::default()
        }
    }

    #[test]
    fn node_metadata_with_a_line_break_or_control_character_anywhere_is_refused() {
        let good = || v1::InstanceMetadata { instance_id: "i-1".into(), ..meta("sim://zone-a/i-1", "10.0.0.1") };
        assert!(node_metadata(&good()).is_ok());
        for c in ['\n', '\r', '\u{85}', '\u{2028}', '\u{2029}', '\u{0}', '\u{1b}', '\u{7f}'] {
            let mut m = good();
            m.instance_id = format!("i-1{c}authorization: {{mode: AlwaysAllow}}");
            assert!(node_metadata(&m).is_err(), "instance_id with {c:?}");
            let mut m = good();
            m.hostname = format!("node{c}x");
            assert!(node_metadata(&m).is_err(), "hostname with {c:?}");
            let mut m = good();
            m.tags.insert("team".into(), format!("a{c}b"));
            assert!(node_metadata(&m).is_err(), "a tag with {c:?}");
            let mut m = good();
            m.additional_labels.insert(format!("k{c}"), "v".into());
            assert!(node_metadata(&m).is_err(), "a label key with {c:?}");
            let mut m = good();
            m.pod_cidrs.push(format!("10.0.0.0/24{c}"));
            assert!(node_metadata(&m).is_err(), "a pod CIDR with {c:?}");
        }
    }

    #[test]
    fn metadata_needs_the_advertised_scheme_and_real_addresses() {
        assert!(instance(&meta("sim://zone-a/i-1", "10.0.0.1"), "sim").is_ok());
        assert!(instance(&meta("sim://zone-a/i-1", "10.0.0.1"), "").is_ok());
        let other = instance(&meta("other://zone-a/i-1", "10.0.0.1"), "sim").expect_err("an error");
        assert!(other.contains("not of the provider's scheme"), "{other}");
        assert!(instance(&meta("", "10.0.0.1"), "sim").is_ok(), "no providerID is the node controller's to judge");
        assert!(instance(&meta("sim://", "10.0.0.1"), "sim").is_err());
        assert!(instance(&meta("sim://zone-a/i-1", "999.0.0.1"), "sim").expect_err("an error").contains("not an IP"));
        for nowhere in ["0.0.0.0", "127.0.0.1", "::", "::1", "224.0.0.1", "255.255.255.255", "169.254.169.254", "fe80::1"] {
            let why = instance(&meta("sim://zone-a/i-1", nowhere), "sim").expect_err(nowhere);
            assert!(why.contains("another host can reach"), "{nowhere}: {why}");
        }
        assert!(instance(&meta("sim://zone-a/i-1", "fd00::5"), "sim").is_ok());
        let mut many = meta("sim://zone-a/i-1", "10.0.0.1");
        many.tags = (0..crate::limits::MAX_INSTANCE_LABELS).map(|i| (format!("k{i}"), "v".into())).collect();
        assert!(instance(&many, "sim").is_ok(), "as many tags as a cloud gives");
        many.tags.insert("one-more".into(), "v".into());
        assert!(instance(&many, "sim").expect_err("too many").contains("more than the"));
        many.tags.clear();
        many.additional_labels = (0..=crate::limits::MAX_INSTANCE_LABELS).map(|i| (format!("k{i}"), "v".into())).collect();
        assert!(instance(&many, "sim").is_err(), "too many labels");
        let mut bad_zone = meta("sim://zone-a/i-1", "10.0.0.1");
        bad_zone.zone = "zone a".into();
        assert!(instance(&bad_zone, "sim").expect_err("an error").contains("label value"));
    }

    #[test]
    fn ingress_is_one_ip_or_one_name() {
        let ingress = |ip: &str, hostname: &str| v1::LoadBalancerStatus {
            ingress: vec![v1::LoadBalancerIngress { ip: ip.into(), hostname: hostname.into(), ..Default::default() }],
        };
        assert!(status(&ingress("203.0.113.7", "")).is_ok());
        assert!(status(&ingress("", "lb-1.example.com")).is_ok());
        assert!(status(&v1::LoadBalancerStatus::default()).is_ok());
        assert!(status(&ingress("999.0.0.1", "")).is_err());
        assert!(status(&ingress("0.0.0.0", "")).expect_err("unspecified").contains("another host can reach"));
        assert!(status(&ingress("127.0.0.1", "")).is_err());
        assert!(status(&ingress("", "")).is_err());
        assert!(status(&ingress("203.0.113.7", "lb.example.com")).is_err());
        assert!(status(&ingress("", "203.0.113.7")).is_err());
        assert!(status(&ingress("", "not a name")).is_err());
    }

    #[test]
    fn routes_need_a_cidr() {
        let r = |cidr: &str| v1::Route { name: "r".into(), destination_cidr: cidr.into(), ..Default::default() };
        assert!(route(&r("10.244.0.0/24")).is_ok());
        assert!(route(&r("10.244.0.0")).is_err());
    }

    fn good() -> InstanceMetadata {
        InstanceMetadata {
            instance_id: "i-1".into(),
            provider_id: "sim://zone-a/i-1".into(),
            zone: "zone-a".into(),
            region: "region".into(),
            instance_type: "m.large".into(),
            addresses: vec![NodeAddress { r#type: NodeAddressType::InternalIp as i32, address: "10.0.0.1".into() }],
            ..Default::default()
        }
    }

    #[test]
    fn node_metadata_checks() {
        assert!(node_metadata(&good()).is_ok());
        type Change = fn(&mut InstanceMetadata);
        let cases: [(&str, Change); 8] = [
            ("instance_id", |m| m.instance_id.clear()),
            ("provider_id", |m| m.provider_id = "i-1".into()),
            ("provider_id", |m| m.provider_id = "sim://a b".into()),
            ("zone", |m| m.zone = "zone a".into()),
            ("instance_type", |m| m.instance_type = "-x".into()),
            ("not an IP", |m| m.addresses[0].address = "ten".into()),
            ("another host can reach", |m| m.addresses[0].address = "127.0.0.1".into()),
            ("no type", |m| m.addresses[0].r#type = 0),
        ];
        for (want, change) in cases {
            let mut m = good();
            change(&mut m);
            let err = node_metadata(&m).expect_err(want);
            assert!(err.to_string().contains(want), "{err} should mention {want}");
        }
    }
}
