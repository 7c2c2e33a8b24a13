//! LoadBalancersService: get, ensure (idempotent, invalid names, ports and ranges), list, host updates and delete.

use super::*;

impl<F: FnMut(&CheckResult)> Suite<F> {
    pub(super) fn lb_service(&self, suffix: &str) -> pb::LoadBalancerService {
        let limits = self.caps.load_balancers.as_ref().map(NameLimits::from_capabilities).unwrap_or_default();
        let uid = format!("ccm-conformance-{}-{suffix}", self.run_id);
        pb::LoadBalancerService {
            cluster_name: "ccm-conformance".into(),
            namespace: "conformance".into(),
            name: format!("svc-{suffix}"),
            load_balancer_name: load_balancer_name("ccm-conformance", "conformance", &format!("svc-{suffix}"), &uid, &limits),
            uid,
            ports: vec![pb::ServicePort {
                name: "http".into(),
                protocol: pb::Protocol::Tcp as i32,
                port: 80,
                node_port: 30080,
                ..Default::default()
            }],
            session_affinity: pb::SessionAffinity::None as i32,
            ip_families: vec![pb::IpFamily::Ipv4 as i32],
            external_traffic_policy: pb::ExternalTrafficPolicy::Cluster as i32,
            ..Default::default()
        }
    }

    pub(super) fn lb_nodes(&self) -> Vec<pb::LoadBalancerNode> {
        self.known
            .iter()
            .take(3)
            .map(|i| pb::LoadBalancerNode {
                name: i.node_name.clone(),
                provider_id: i.provider_id.clone(),
                addresses: i.addresses.clone(),
                labels: Default::default(),
            })
            .collect()
    }

    pub(super) async fn get_lb(&self, service: pb::LoadBalancerService) -> Result<pb::GetLoadBalancerResponse, Not> {
        self.lbs
            .clone()
            .get_load_balancer(self.req(pb::GetLoadBalancerRequest { service: Some(service) }))
            .await
            .ctx("GetLoadBalancer")
    }

    pub(super) async fn ensure_lb(&mut self, service: pb::LoadBalancerService) -> Result<pb::LoadBalancerStatus, Not> {
        let nodes = self.lb_nodes();
        self.created_lbs.push(service.clone());
        let r = self
            .lbs
            .clone()
            .ensure_load_balancer(self.req(pb::EnsureLoadBalancerRequest { service: Some(service), nodes }))
            .await;
        r.ctx("EnsureLoadBalancer")?.status.ok_or_else(|| fail("EnsureLoadBalancer answered no status"))
    }

    pub(super) async fn lb_get_absent(&mut self) -> Check {
        let r = self.get_lb(self.lb_service("absent")).await?;
        ensure(!r.exists, || "a load balancer never created exists".into())
    }

    pub(super) async fn lb_ensure(&mut self) -> Check {
        let status = self.ensure_lb(self.lb_service("main")).await?;
        ensure(!status.ingress.is_empty(), || "no ingress in the status".into())?;
        for i in &status.ingress {
            ensure(i.ip.is_empty() != i.hostname.is_empty(), || format!("ingress {i:?} needs exactly one of ip and hostname"))?;
            ensure(i.ip.is_empty() || i.ip.parse::<IpAddr>().is_ok(), || format!("ingress ip {:?} is not an IP", i.ip))?;
        }
        Ok(())
    }

    pub(super) async fn lb_ensure_again(&mut self) -> Check {
        let service = self.lb_service("main");
        let first = self.ensure_lb(service.clone()).await?;
        let second = self.ensure_lb(service).await?;
        ensure(first.ingress == second.ingress, || format!("repeated Ensure changed the ingress: {first:?} then {second:?}"))
    }

    pub(super) async fn lb_get_present(&mut self) -> Check {
        let service = self.lb_service("main");
        let ensured = self.ensure_lb(service.clone()).await?;
        self.eventually(async || {
            let r = self.get_lb(service.clone()).await?;
            ensure(r.exists, || "an ensured load balancer does not exist".into())?;
            let status = r.status.unwrap_or_default();
            ensure(status.ingress == ensured.ingress, || format!("Get says {status:?}, Ensure said {ensured:?}"))
        })
        .await
    }

    /// Calls for another Service under the main load balancer's name (a name a user could
    /// write on their Service) neither read, take over nor delete it: each is refused with
    /// FAILED_PRECONDITION (the SDK's `owner::check`), or, from a provider that names load
    /// balancers itself from the Service (the Go adapter), answered for that Service's own
    /// load balancer. Either way the main one still exists afterwards with its address and,
    /// where listing is advertised, is still listed for its own Service.
    pub(super) async fn lb_other_services_name(&mut self) -> Check {
        let owner = self.lb_service("main");
        let ensured = self.ensure_lb(owner.clone()).await?;
        let mut intruder = self.lb_service("intruder");
        intruder.load_balancer_name = owner.load_balancer_name.clone();
        let refused_or_own = |what: &str, r: Result<(), Status>| match r {
            Err(s) if s.code() != Code::FailedPrecondition => Err(fail(format!(
                "{what}: expected FAILED_PRECONDITION, or an answer for that Service's own load balancer; got {} {}",
                code_name(s.code()),
                s.message()
            ))),
            _ => Ok(()),
        };
        let get =
            self.lbs.clone().get_load_balancer(self.req(pb::GetLoadBalancerRequest { service: Some(intruder.clone()) })).await;
        let get = get.map(Response::into_inner).and_then(|r| {
            if r.exists {
                Err(Status::internal("answered that it exists: the owner's load balancer, read by another Service"))
            } else {
                Ok(())
            }
        });
        refused_or_own("GetLoadBalancer for another Service under this one's name (never ensured for it)", get)?;
        let nodes = self.lb_nodes();
        let request = pb::EnsureLoadBalancerRequest { service: Some(intruder.clone()), nodes };
        let ensure_call = self.lbs.clone().ensure_load_balancer(self.req(request)).await;
        if ensure_call.is_ok() {
            self.created_lbs.push(intruder.clone());
        }
        refused_or_own("EnsureLoadBalancer for another Service under this one's name", ensure_call.map(|_| ()))?;
        if self.caps.load_balancers.as_ref().is_some_and(|c| c.list) {
            let listed = all_pages("ListLoadBalancers", 100, async |page_token| {
                let request =
                    pb::ListLoadBalancersRequest { cluster_name: owner.cluster_name.clone(), page_size: 100, page_token };
                let page = self.lbs.clone().list_load_balancers(self.req(request)).await.ctx("ListLoadBalancers")?;
                Ok((page.load_balancers, page.next_page_token))
            })
            .await?;
            let found = listed.iter().find(|l| l.load_balancer_name == owner.load_balancer_name);
            ensure(found.is_none_or(|l| l.uid == owner.uid), || {
                format!("another Service's EnsureLoadBalancer under its name took it over: listed for {found:?}")
            })?;
        }
        let delete = self
            .lbs
            .clone()
            .ensure_load_balancer_deleted(self.req(pb::EnsureLoadBalancerDeletedRequest { service: Some(intruder) }))
            .await
            .map(|_| ());
        refused_or_own("EnsureLoadBalancerDeleted for another Service under this one's name", delete)?;
        let r = self.get_lb(owner).await?;
        ensure(r.exists, || "the load balancer is gone after another Service's EnsureLoadBalancerDeleted under its name".into())?;
        let status = r.status.unwrap_or_default();
        ensure(status.ingress == ensured.ingress, || {
            format!(
                "the load balancer's status changed after another Service's calls under its name: {status:?}, was {ensured:?}"
            )
        })
    }

    /// When listing is advertised: the ensured load balancers are listed, page by page, with
    /// the Service each was ensured for, and only for their own cluster.
    pub(super) async fn lb_list(&mut self) -> Check {
        if !self.caps.load_balancers.as_ref().is_some_and(|c| c.list) {
            return Err(skip("ListLoadBalancers is not advertised"));
        }
        let (main, second) = (self.lb_service("main"), self.lb_service("listed"));
        self.ensure_lb(main.clone()).await?;
        self.ensure_lb(second.clone()).await?;
        let list = async |cluster: &str| {
            all_pages("ListLoadBalancers", 1, async |page_token| {
                let request = pb::ListLoadBalancersRequest { cluster_name: cluster.into(), page_size: 1, page_token };
                let page = self.lbs.clone().list_load_balancers(self.req(request)).await.ctx("ListLoadBalancers")?;
                Ok((page.load_balancers, page.next_page_token))
            })
            .await
        };
        self.eventually(async || {
            let listed = list("ccm-conformance").await?;
            for want in [&main, &second] {
                let found = listed.iter().find(|l| l.load_balancer_name == want.load_balancer_name);
                let found = found.ok_or_else(|| fail(format!("{} is not listed", want.load_balancer_name)))?;
                ensure(
                    (found.namespace.as_str(), found.name.as_str(), found.uid.as_str())
                        == (&want.namespace, &want.name, &want.uid),
                    || {
                        format!(
                            "{} is listed for {}/{} ({}), not the Service it was ensured for",
                            found.load_balancer_name, found.namespace, found.name, found.uid
                        )
                    },
                )?;
            }
            let names: Vec<&str> = listed.iter().map(|l| l.load_balancer_name.as_str()).collect();
            let mut unique = names.clone();
            unique.sort_unstable();
            unique.dedup();
            ensure(unique.len() == names.len(), || format!("pages repeat load balancers: {names:?}"))
        })
        .await?;
        let other = list("ccm-conformance-other-cluster").await?;
        ensure(!other.iter().any(|l| l.load_balancer_name == main.load_balancer_name), || {
            "another cluster's listing shows this cluster's load balancer".into()
        })
    }

    pub(super) async fn lb_update_hosts(&mut self) -> Check {
        let service = self.lb_service("main");
        let nodes: Vec<pb::LoadBalancerNode> = self.lb_nodes().into_iter().take(1).collect();
        self.lbs
            .clone()
            .update_load_balancer_hosts(self.req(pb::UpdateLoadBalancerHostsRequest { service: Some(service), nodes }))
            .await
            .ctx("UpdateLoadBalancerHosts")
            .map(|_| ())
    }

    /// Where GetLoadBalancer (or the listing) reports a load balancer's backends, they are the
    /// Nodes it was last given, by name.
    pub(super) async fn lb_hosts_reported(&mut self) -> Check {
        let service = self.lb_service("main");
        let nodes: Vec<pb::LoadBalancerNode> = self.lb_nodes().into_iter().take(1).collect();
        if nodes.is_empty() {
            return Err(skip("no instance is listed"));
        }
        self.lbs
            .clone()
            .update_load_balancer_hosts(
                self.req(pb::UpdateLoadBalancerHostsRequest { service: Some(service.clone()), nodes: nodes.clone() }),
            )
            .await
            .ctx("UpdateLoadBalancerHosts")?;
        let want: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
        let mut reported = false;
        self.eventually(async || {
            let r = self.get_lb(service.clone()).await?;
            let Some(hosts) = r.hosts else { return Ok(()) };
            reported = true;
            ccm_protocol::answer::hosts(&hosts).map_err(fail)?;
            let mut got = hosts.node_names.clone();
            got.sort();
            ensure(got == want, || format!("GetLoadBalancer reports backends {got:?}; it was given {want:?}"))
        })
        .await?;
        if self.caps.load_balancers.as_ref().is_some_and(|c| c.list) {
            let listed = all_pages("ListLoadBalancers", 100, async |page_token| {
                let request = pb::ListLoadBalancersRequest { cluster_name: "ccm-conformance".into(), page_size: 100, page_token };
                let page = self.lbs.clone().list_load_balancers(self.req(request)).await.ctx("ListLoadBalancers")?;
                Ok((page.load_balancers, page.next_page_token))
            })
            .await?;
            if let Some(hosts) =
                listed.iter().find(|l| l.load_balancer_name == service.load_balancer_name).and_then(|l| l.hosts.as_ref())
            {
                reported = true;
                let mut got = hosts.node_names.clone();
                got.sort();
                ensure(got == want, || format!("ListLoadBalancers reports backends {got:?}; it was given {want:?}"))?;
            }
        }
        if reported { Ok(()) } else { Err(skip("the provider reports no backends (GetLoadBalancerResponse.hosts unset)")) }
    }

    pub(super) async fn lb_update_hosts_absent(&mut self) -> Check {
        let r = self
            .lbs
            .clone()
            .update_load_balancer_hosts(
                self.req(pb::UpdateLoadBalancerHostsRequest { service: Some(self.lb_service("absent")), nodes: self.lb_nodes() }),
            )
            .await;
        expect_code(r, Code::NotFound, "UpdateLoadBalancerHosts of an absent load balancer")
    }

    pub(super) async fn ensure_invalid(&mut self, service: pb::LoadBalancerService, what: &str) -> Check {
        let r = self
            .lbs
            .clone()
            .ensure_load_balancer(
                self.req(pb::EnsureLoadBalancerRequest { service: Some(service.clone()), nodes: self.lb_nodes() }),
            )
            .await;
        if r.is_ok() {
            self.created_lbs.push(service);
        }
        expect_code(r, Code::InvalidArgument, what)
    }

    pub(super) async fn lb_empty_name(&mut self) -> Check {
        let mut service = self.lb_service("empty-name");
        service.load_balancer_name.clear();
        self.ensure_invalid(service, "EnsureLoadBalancer without a name").await
    }

    pub(super) async fn lb_name_too_long(&mut self) -> Check {
        let max = self.caps.load_balancers.as_ref().map_or(0, |l| l.max_name_length);
        if max == 0 {
            return Err(skip("no name length limit advertised"));
        }
        let mut service = self.lb_service("long");
        service.load_balancer_name = format!("ccm-conformance-{}", "x".repeat(max as usize));
        self.ensure_invalid(service, "EnsureLoadBalancer with a name over the advertised limit").await
    }

    pub(super) async fn lb_no_ports(&mut self) -> Check {
        let mut service = self.lb_service("no-ports");
        service.ports.clear();
        self.ensure_invalid(service, "EnsureLoadBalancer without ports").await
    }

    pub(super) async fn lb_bad_source_range(&mut self) -> Check {
        let mut service = self.lb_service("bad-range");
        service.source_ranges = vec!["10.0.0.0/99".into()];
        self.ensure_invalid(service, "EnsureLoadBalancer with a malformed source range").await
    }

    pub(super) async fn lb_sdk_name(&mut self) -> Check {
        let limits = self.caps.load_balancers.as_ref().map(NameLimits::from_capabilities).unwrap_or_default();
        let mut service = self.lb_service("long-name");
        service.namespace = "a-namespace-with-a-rather-long-name".into();
        service.name = "and-a-service-whose-name-is-longer-still".into();
        service.load_balancer_name =
            load_balancer_name("ccm-conformance-cluster", &service.namespace, &service.name, &service.uid, &limits);
        self.ensure_lb(service.clone()).await?;
        self.lbs
            .clone()
            .ensure_load_balancer_deleted(self.req(pb::EnsureLoadBalancerDeletedRequest { service: Some(service) }))
            .await
            .ctx("EnsureLoadBalancerDeleted")
            .map(|_| ())
    }

    pub(super) async fn delete_lb(&self, service: pb::LoadBalancerService) -> Check {
        self.lbs
            .clone()
            .ensure_load_balancer_deleted(self.req(pb::EnsureLoadBalancerDeletedRequest { service: Some(service) }))
            .await
            .ctx("EnsureLoadBalancerDeleted")
            .map(|_| ())
    }

    pub(super) async fn lb_delete(&mut self) -> Check {
        let service = self.lb_service("main");
        self.delete_lb(service.clone()).await?;
        self.eventually(async || {
            let r = self.get_lb(service.clone()).await?;
            ensure(!r.exists, || "the load balancer still exists after EnsureLoadBalancerDeleted".into())
        })
        .await
    }

    pub(super) async fn lb_delete_again(&mut self) -> Check {
        self.delete_lb(self.lb_service("main")).await
    }

    pub(super) async fn lb_delete_absent(&mut self) -> Check {
        self.delete_lb(self.lb_service("never-created")).await
    }
}

impl<F: FnMut(&CheckResult)> Suite<F> {
    /// BatchUpdateLoadBalancerHosts of an ensured load balancer and an absent one: OK and
    /// NOT_FOUND, each in its own item, in order.
    pub(super) async fn lb_bulk_update_hosts(&mut self) -> Check {
        if !self.caps.load_balancers.as_ref().is_some_and(|l| l.bulk_update_hosts) {
            return Err(skip("bulk_update_hosts is not advertised"));
        }
        let request = pb::BatchUpdateLoadBalancerHostsRequest {
            nodes: self.lb_nodes(),
            services: vec![self.lb_service("absent"), self.lb_service("main")],
        };
        let r = self.lbs.clone().batch_update_load_balancer_hosts(self.req(request)).await;
        let results = r.ctx("BatchUpdateLoadBalancerHosts")?.results;
        ensure(results.len() == 2, || format!("{} results for 2 load balancers", results.len()))?;
        ensure(results[0].error.as_ref().is_some_and(|e| e.code == Code::NotFound as i32), || {
            format!("an absent load balancer is NOT_FOUND in its own item, got {:?}", results[0])
        })?;
        ensure(results[1].error.is_none(), || format!("the ensured load balancer's item failed: {:?}", results[1]))
    }
}
