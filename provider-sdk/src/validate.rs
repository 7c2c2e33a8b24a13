//! Request checks the SDK makes before a provider's code runs, so every provider rejects the
//! same malformed input with the same INVALID_ARGUMENT.

use std::net::IpAddr;

use ccm_proto::v1::{InstanceLookup, LoadBalancerService, Protocol, Route};
use ipnet::IpNet;

use crate::error::{Error, Result};
use crate::names::NameLimits;

pub use ccm_protocol::labels::{valid_dns_subdomain, valid_label_key, valid_label_value};
pub use ccm_protocol::limits::{MAX_BATCH, MAX_ROUTE_NAME};

/// A lookup needs a provider ID or a node name.
pub fn lookup(lookup: Option<&InstanceLookup>) -> Result<&InstanceLookup> {
    match lookup {
        Some(l) if !l.provider_id.is_empty() || !l.node_name.is_empty() => Ok(l),
        _ => Err(Error::invalid_argument("instance lookup needs provider_id or node_name")),
    }
}

/// A batch holds at most [`MAX_BATCH`] items.
pub fn batch_size(len: usize) -> Result<()> {
    if len > MAX_BATCH {
        return Err(Error::invalid_argument(format!("batch of {len} items; at most {MAX_BATCH} are allowed")));
    }
    Ok(())
}

/// Parses a CIDR that must be a network address (no host bits set).
pub fn cidr(text: &str) -> Result<IpNet> {
    let net: IpNet = text.parse().map_err(|_| Error::invalid_argument(format!("{text:?} is not a CIDR")))?;
    if net.trunc() != net {
        return Err(Error::invalid_argument(format!("{text:?} has host bits set; did you mean {}?", net.trunc())));
    }
    Ok(net)
}

/// A route to create: name, target and destination.
pub fn route(route: Option<&Route>, ipv6: bool) -> Result<&Route> {
    let route = route.ok_or_else(|| Error::invalid_argument("route is missing"))?;
    route_name(&route.name)?;
    let target = route.target.as_ref().filter(|t| !t.node_name.is_empty());
    if target.is_none() {
        return Err(Error::invalid_argument(format!("route {:?} has no target node", route.name)));
    }
    let net = cidr(&route.destination_cidr)?;
    if net.addr().is_ipv6() && !ipv6 {
        return Err(Error::invalid_argument(format!("this provider does not support IPv6 routes ({})", route.destination_cidr)));
    }
    Ok(route)
}

/// A route name: not empty, at most [`MAX_ROUTE_NAME`] characters.
pub fn route_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::invalid_argument("route name is empty"));
    }
    if name.len() > MAX_ROUTE_NAME {
        return Err(Error::invalid_argument(format!("route name is {} characters; at most {MAX_ROUTE_NAME}", name.len())));
    }
    Ok(())
}

/// The naming fields every load balancer call needs.
pub fn load_balancer_ref<'a>(service: Option<&'a LoadBalancerService>, limits: &NameLimits) -> Result<&'a LoadBalancerService> {
    let service = service.ok_or_else(|| Error::invalid_argument("service is missing"))?;
    limits.check(&service.load_balancer_name).map_err(Error::invalid_argument)?;
    Ok(service)
}

/// Everything EnsureLoadBalancer needs: ports, source ranges, requested IP.
pub fn load_balancer_spec<'a>(service: Option<&'a LoadBalancerService>, limits: &NameLimits) -> Result<&'a LoadBalancerService> {
    let service = load_balancer_ref(service, limits)?;
    if service.namespace.is_empty() || service.name.is_empty() {
        return Err(Error::invalid_argument("service namespace and name are required"));
    }
    if service.ports.is_empty() {
        return Err(Error::invalid_argument(format!("service {}/{} has no ports", service.namespace, service.name)));
    }
    for port in &service.ports {
        if port.port == 0 || port.port > 65535 {
            return Err(Error::invalid_argument(format!("port {} is out of range", port.port)));
        }
        if port.node_port > 65535 {
            return Err(Error::invalid_argument(format!("node port {} is out of range", port.node_port)));
        }
        if port.protocol() == Protocol::Unspecified {
            return Err(Error::invalid_argument(format!("port {} has no protocol", port.port)));
        }
    }
    for range in &service.source_ranges {
        range.parse::<IpNet>().map_err(|_| Error::invalid_argument(format!("source range {range:?} is not a CIDR")))?;
    }
    if !service.requested_ip.is_empty() {
        service
            .requested_ip
            .parse::<IpAddr>()
            .map_err(|_| Error::invalid_argument(format!("requested IP {:?} is not an IP address", service.requested_ip)))?;
    }
    Ok(service)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ccm_proto::v1::RouteTarget;

    fn r(name: &str, cidr: &str) -> Route {
        Route {
            name: name.into(),
            target: Some(RouteTarget { node_name: "n1".into(), provider_id: "sim://a/i-1".into() }),
            destination_cidr: cidr.into(),
            ..Default::default()
        }
    }

    #[test]
    fn routes() {
        assert!(route(Some(&r("a", "10.244.1.0/24")), false).is_ok());
        assert!(route(Some(&r("a", "fd00::/64")), true).is_ok());
        for (name, cidr, v6) in
            [("", "10.0.0.0/24", true), ("a", "10.0.0.1/24", true), ("a", "300.0.0.0/8", true), ("a", "fd00::/64", false)]
        {
            let err = route(Some(&r(name, cidr)), v6).expect_err(cidr);
            assert_eq!(err.code(), tonic::Code::InvalidArgument);
        }
    }
}
