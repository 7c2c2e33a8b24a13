//! IdentityService and the gRPC health service: plugin info, capabilities, probe, and that every advertised service answers.

use super::*;

impl<F: FnMut(&CheckResult)> Suite<F> {
    pub(super) async fn plugin_info(&mut self) -> Check {
        let info = self.identity.clone().get_plugin_info(self.req(pb::GetPluginInfoRequest {})).await.ctx("GetPluginInfo")?;
        ensure(valid_plugin_name(&info.name), || format!("plugin name {:?} breaks the naming rule", info.name))?;
        ensure(info.provider_id_scheme.is_empty() || crate::names::valid_scheme(&info.provider_id_scheme), || {
            format!("provider_id_scheme {:?} is not a URL scheme", info.provider_id_scheme)
        })?;
        ensure(info.additional_provider_id_schemes.is_empty() || !info.provider_id_scheme.is_empty(), || {
            "additional_provider_id_schemes without a provider_id_scheme".into()
        })?;
        let mut schemes = HashSet::from([info.provider_id_scheme.as_str()]);
        for scheme in &info.additional_provider_id_schemes {
            ensure(crate::names::valid_scheme(scheme), || {
                format!("additional providerID scheme {scheme:?} is not a URL scheme")
            })?;
            ensure(schemes.insert(scheme.as_str()), || format!("providerID scheme {scheme:?} is named twice"))?;
        }
        let semver = info.vendor_version.split(['-', '+']).next().unwrap_or_default();
        let parts: Vec<&str> = semver.split('.').collect();
        ensure(parts.len() == 3 && parts.iter().all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit())), || {
            format!("vendor_version {:?} is not semantic versioning", info.vendor_version)
        })
    }

    pub(super) async fn plugin_info_stable(&mut self) -> Check {
        let a = self.identity.clone().get_plugin_info(self.req(pb::GetPluginInfoRequest {})).await.ctx("GetPluginInfo")?;
        let b = self.identity.clone().get_plugin_info(self.req(pb::GetPluginInfoRequest {})).await.ctx("GetPluginInfo")?;
        ensure(a == b, || format!("two answers differ: {a:?} then {b:?}"))
    }

    pub(super) async fn capabilities(&mut self) -> Check {
        let caps = self
            .identity
            .clone()
            .get_plugin_capabilities(self.req(pb::GetPluginCapabilitiesRequest {}))
            .await
            .ctx("GetPluginCapabilities")?;
        self.caps = caps.clone();
        let mut seen = HashSet::new();
        for s in &caps.services {
            match ServiceType::try_from(*s) {
                Ok(ServiceType::Unspecified) | Err(_) => return Err(fail(format!("service value {s} is not a known service"))),
                Ok(_) => ensure(seen.insert(*s), || format!("service {s} advertised twice"))?,
            }
        }
        ensure(caps.routes.is_none() || self.advertises(ServiceType::Routes), || {
            "routes features advertised without RoutesService".into()
        })?;
        ensure(caps.load_balancers.is_none() || self.advertises(ServiceType::LoadBalancers), || {
            "load balancer features advertised without LoadBalancersService".into()
        })?;
        let mut classes = HashSet::new();
        for class in caps.load_balancers.iter().flat_map(|l| &l.classes) {
            // What the API server accepts in spec.loadBalancerClass: a label-style key.
            ensure(ccm_protocol::labels::valid_label_key(class), || {
                format!("load balancer class {class:?} is not a label-style key (what spec.loadBalancerClass accepts)")
            })?;
            ensure(classes.insert(class), || format!("load balancer class {class:?} is advertised twice"))?;
        }
        if let Some(rate) = &caps.call_rate {
            ensure(rate.per_second.is_finite() && rate.per_second > 0.0, || {
                format!(
                    "call_rate.per_second {} is not a rate (finite, above zero): the core would not pace to it",
                    rate.per_second
                )
            })?;
        }
        Ok(())
    }

    pub(super) async fn capabilities_stable(&mut self) -> Check {
        for _ in 0..3 {
            let again = self
                .identity
                .clone()
                .get_plugin_capabilities(self.req(pb::GetPluginCapabilitiesRequest {}))
                .await
                .ctx("GetPluginCapabilities")?;
            ensure(again == self.caps, || format!("capabilities changed: {:?} then {again:?}", self.caps))?;
        }
        Ok(())
    }

    pub(super) async fn probe(&mut self) -> Check {
        let p = self.identity.clone().probe(self.req(pb::ProbeRequest {})).await.ctx("Probe")?;
        ensure(p.ready, || format!("Probe says not ready: {}", p.message))
    }

    pub(super) async fn advertised_served(&mut self) -> Check {
        let unimplemented = |r: Result<(), Status>, what: &str| match r {
            Err(s) if s.code() == Code::Unimplemented => Err(fail(format!("{what} is advertised but answers UNIMPLEMENTED"))),
            _ => Ok(()),
        };
        let probe_id = pb::InstanceLookup { node_name: format!("ccm-conformance-absent-{}", self.run_id), ..Default::default() };
        if self.advertises(ServiceType::Instances) {
            let r = self
                .instances
                .clone()
                .instance_exists(self.req(pb::InstanceExistsRequest { instance: Some(probe_id.clone()) }))
                .await;
            unimplemented(r.map(|_| ()), "InstancesService")?;
        }
        if self.advertises(ServiceType::Tags) {
            let r = self
                .tags
                .clone()
                .get_instance_tags(self.req(pb::GetInstanceTagsRequest { instance: Some(probe_id.clone()) }))
                .await;
            unimplemented(r.map(|_| ()), "TagsService")?;
        }
        if self.advertises(ServiceType::Routes) {
            let r = self.routes.clone().list_route_tables(self.req(pb::ListRouteTablesRequest::default())).await;
            unimplemented(r.map(|_| ()), "RoutesService")?;
        }
        if self.advertises(ServiceType::LoadBalancers) {
            let r = self
                .lbs
                .clone()
                .get_load_balancer(self.req(pb::GetLoadBalancerRequest { service: Some(self.lb_service("absent")) }))
                .await;
            unimplemented(r.map(|_| ()), "LoadBalancersService")?;
        }
        if self.advertises(ServiceType::NodeMetadata) {
            let r = self.node_metadata.clone().get_node_metadata(self.req(pb::GetNodeMetadataRequest {})).await;
            unimplemented(r.map(|_| ()), "NodeMetadataService")?;
        }
        if self.advertises(ServiceType::ImageCredentials) {
            let request = pb::GetImageCredentialsRequest { image: IMAGE.into(), ..Default::default() };
            let r = self.image_credentials.clone().get_image_credentials(self.req(request)).await;
            unimplemented(r.map(|_| ()), "ImageCredentialsService")?;
        }
        Ok(())
    }

    pub(super) async fn health_serving(&mut self) -> Check {
        let request = self.req(tonic_health::pb::HealthCheckRequest { service: String::new() });
        match self.health.clone().check(request).await {
            Ok(r) => {
                ensure(r.get_ref().status() == ServingStatus::Serving, || format!("health status {:?}", r.get_ref().status()))
            }
            Err(s) if s.code() == Code::Unimplemented => Err(skip("grpc.health.v1 is not served (optional)")),
            Err(s) => Err(fail(format!("Health/Check: {} {}", code_name(s.code()), s.message()))),
        }
    }
}
