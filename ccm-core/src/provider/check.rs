//! The checks every provider answer passes before the core acts on it. An answer that fails
//! one is an error naming the method and what is wrong; nothing of it reaches the API server.

use std::collections::HashSet;
use std::fmt::Display;
use std::net::IpAddr;

use ccm_proto::v1 as pb;
use ccm_provider_sdk::Error;
use ccm_provider_sdk::validate::{valid_dns_subdomain, valid_label_value};
use ipnet::IpNet;

/// The most pages one listing may take (10,000 pages of the default size is millions of items).
pub const MAX_PAGES: usize = 10_000;

/// The reason of an invalid provider answer, in its error and in the Warning Event about it.
pub const REASON: &str = "InvalidProviderAnswer";

/// The error of an invalid answer to `method`.
pub fn invalid(method: &str, why: impl Display) -> Error {
    Error::internal(format!("{REASON}: the provider's answer to {method} is invalid: {why}"))
}

/// Whether `error` is about an invalid provider answer (see [`invalid`]).
pub fn is_invalid(error: &Error) -> bool {
    error.to_string().contains(REASON)
}

/// Whether `provider_id` is of `scheme` (`scheme://…`); any non-empty one when `scheme` is empty.
fn of_scheme(provider_id: &str, scheme: &str) -> bool {
    if scheme.is_empty() {
        return !provider_id.is_empty();
    }
    provider_id.strip_prefix(scheme).and_then(|rest| rest.strip_prefix("://")).is_some_and(|rest| !rest.is_empty())
}

/// One address: an IP for the IP types, a DNS name for the others, a known type.
pub fn address(a: &pb::NodeAddress) -> Result<(), String> {
    use pb::NodeAddressType as T;
    match a.r#type() {
        T::Unspecified => Err(format!("address {:?} has no type", a.address)),
        T::InternalIp | T::ExternalIp if a.address.parse::<IpAddr>().is_err() => {
            Err(format!("{:?} is not an IP address", a.address))
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
pub fn metadata(m: &pb::InstanceMetadata, scheme: &str) -> Result<(), String> {
    if !m.provider_id.is_empty() && !of_scheme(&m.provider_id, scheme) {
        return Err(format!("providerID {:?} is not of the provider's scheme {scheme:?}", m.provider_id));
    }
    for a in &m.addresses {
        address(a).map_err(|why| format!("instance {}: {why}", m.provider_id))?;
    }
    for (what, value) in [("zone", &m.zone), ("region", &m.region), ("instance type", &m.instance_type)] {
        if !valid_label_value(value) {
            return Err(format!("instance {}: {what} {value:?} cannot be a label value", m.provider_id));
        }
    }
    Ok(())
}

/// A route the provider listed or made: a CIDR destination and a named target.
pub fn route(r: &pb::Route) -> Result<(), String> {
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
pub fn status(s: &pb::LoadBalancerStatus) -> Result<(), String> {
    for i in &s.ingress {
        match (i.ip.is_empty(), i.hostname.is_empty()) {
            (true, true) => return Err("an ingress with neither an IP nor a hostname".into()),
            (false, false) => return Err(format!("an ingress with both IP {:?} and hostname {:?}", i.ip, i.hostname)),
            (false, true) if i.ip.parse::<IpAddr>().is_err() => return Err(format!("ingress IP {:?} is not an IP", i.ip)),
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

/// The page tokens of one listing: a bounded number of pages, and no token twice (a provider
/// answering the same token again would loop for ever).
#[derive(Debug, Default)]
pub struct Pages {
    seen: HashSet<String>,
}

impl Pages {
    /// Takes the next page's token; `Ok(None)` at the end of the listing.
    pub fn next(&mut self, method: &str, token: String) -> Result<Option<String>, Error> {
        if token.is_empty() {
            return Ok(None);
        }
        if self.seen.len() + 1 >= MAX_PAGES {
            return Err(invalid(method, format!("the listing goes on past {MAX_PAGES} pages")));
        }
        if !self.seen.insert(token.clone()) {
            return Err(invalid(method, format!("page token {token:?} came back a second time")));
        }
        Ok(Some(token))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(id: &str, ip: &str) -> pb::InstanceMetadata {
        pb::InstanceMetadata {
            provider_id: id.into(),
            addresses: vec![pb::NodeAddress { r#type: pb::NodeAddressType::InternalIp as i32, address: ip.into() }],
            zone: "zone-a".into(),
            ..Default::default()
        }
    }

    #[test]
    fn metadata_needs_the_advertised_scheme_and_real_addresses() {
        assert!(metadata(&meta("sim://zone-a/i-1", "10.0.0.1"), "sim").is_ok());
        assert!(metadata(&meta("sim://zone-a/i-1", "10.0.0.1"), "").is_ok());
        let other = metadata(&meta("other://zone-a/i-1", "10.0.0.1"), "sim").expect_err("an error");
        assert!(other.contains("not of the provider's scheme"), "{other}");
        assert!(metadata(&meta("", "10.0.0.1"), "sim").is_ok(), "no providerID is the node controller's to judge");
        assert!(metadata(&meta("sim://", "10.0.0.1"), "sim").is_err());
        assert!(metadata(&meta("sim://zone-a/i-1", "999.0.0.1"), "sim").expect_err("an error").contains("not an IP"));
        let mut bad_zone = meta("sim://zone-a/i-1", "10.0.0.1");
        bad_zone.zone = "zone a".into();
        assert!(metadata(&bad_zone, "sim").expect_err("an error").contains("label value"));
    }

    #[test]
    fn ingress_is_one_ip_or_one_name() {
        let ingress = |ip: &str, hostname: &str| pb::LoadBalancerStatus {
            ingress: vec![pb::LoadBalancerIngress { ip: ip.into(), hostname: hostname.into(), ..Default::default() }],
        };
        assert!(status(&ingress("203.0.113.7", "")).is_ok());
        assert!(status(&ingress("", "lb-1.example.com")).is_ok());
        assert!(status(&pb::LoadBalancerStatus::default()).is_ok());
        assert!(status(&ingress("999.0.0.1", "")).is_err());
        assert!(status(&ingress("", "")).is_err());
        assert!(status(&ingress("203.0.113.7", "lb.example.com")).is_err());
        assert!(status(&ingress("", "203.0.113.7")).is_err());
        assert!(status(&ingress("", "not a name")).is_err());
    }

    #[test]
    fn a_repeated_page_token_ends_the_listing_with_an_error() {
        let mut pages = Pages::default();
        assert_eq!(pages.next("M", "a".into()).expect("ok"), Some("a".into()));
        assert_eq!(pages.next("M", "b".into()).expect("ok"), Some("b".into()));
        let again = pages.next("M", "a".into()).expect_err("an error");
        assert!(is_invalid(&again), "{again}");
        assert_eq!(Pages::default().next("M", String::new()).expect("ok"), None);
    }

    #[test]
    fn routes_need_a_cidr() {
        let r = |cidr: &str| pb::Route { name: "r".into(), destination_cidr: cidr.into(), ..Default::default() };
        assert!(route(&r("10.244.0.0/24")).is_ok());
        assert!(route(&r("10.244.0.0")).is_err());
    }
}
