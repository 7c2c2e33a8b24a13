//! InstancesService: listing and paging, exists, shutdown and metadata by providerID and node name, batches, deadlines and cache hints.

use super::*;

impl<F: FnMut(&CheckResult)> Suite<F> {
    pub(super) async fn list_all_instances(&self, page_size: u32) -> Result<Vec<pb::InstanceMetadata>, Not> {
        all_pages("ListInstances", page_size, async |page_token| {
            let page = self.instances.clone().list_instances(self.req(pb::ListInstancesRequest { page_size, page_token })).await;
            page.ctx("ListInstances").map(|p| (p.instances, p.next_page_token))
        })
        .await
    }

    pub(super) async fn list_instances(&mut self) -> Check {
        let first = self.instances.clone().list_instances(self.req(pb::ListInstancesRequest::default())).await;
        if matches!(&first, Err(s) if s.code() == Code::Unimplemented) {
            self.can_list = false;
            return self.named_instances().await;
        }
        let all = self.list_all_instances(0).await?;
        let info = self.identity.clone().get_plugin_info(self.req(pb::GetPluginInfoRequest {})).await.ctx("GetPluginInfo")?;
        let scheme = &info.provider_id_scheme;
        let schemes: Vec<&String> = std::iter::once(scheme).chain(&info.additional_provider_id_schemes).collect();
        for i in &all {
            ensure(scheme.is_empty() || schemes.iter().any(|s| i.provider_id.starts_with(&format!("{s}://"))), || {
                format!("providerID {} lacks the advertised schemes ({scheme}://…)", i.provider_id)
            })?;
            ensure(!i.provider_id.is_empty() && !i.instance_id.is_empty(), || format!("listed instance without ids: {i:?}"))?;
            ensure(i.state() != pb::InstanceState::Terminated, || format!("terminated instance {} is listed", i.provider_id))?;
            for a in &i.addresses {
                valid_address(a).map_err(|e| fail(format!("instance {}: {e}", i.provider_id)))?;
            }
        }
        self.known = all;
        Ok(())
    }

    /// For a provider that cannot list: the instances named in the options, each read with
    /// InstanceMetadata, become the known instances.
    pub(super) async fn named_instances(&mut self) -> Check {
        let why = "ListInstances is UNIMPLEMENTED (the provider cannot list instances)";
        if self.opts.instances.is_empty() {
            return Err(skip(format!(
                "{why}; name existing instances with --instance NODE_NAME to run the checks that need them"
            )));
        }
        let mut known = Vec::new();
        for name in self.opts.instances.clone() {
            let lookup = pb::InstanceLookup { node_name: name.clone(), ..Default::default() };
            let answer = self
                .instances
                .clone()
                .instance_metadata(self.req(pb::InstanceMetadataRequest { instance: Some(lookup) }))
                .await
                .ctx("InstanceMetadata")?;
            let meta =
                answer.metadata.filter(|_| answer.exists).ok_or_else(|| fail(format!("--instance {name}: no such instance")))?;
            ensure(!meta.provider_id.is_empty(), || format!("--instance {name}: no providerID in the answer"))?;
            known.push(pb::InstanceMetadata { node_name: name, ..meta });
        }
        self.known = known;
        Err(skip(format!("{why}; the checks use the {} instances given with --instance", self.known.len())))
    }

    pub(super) async fn list_instances_pagination(&mut self) -> Check {
        if !self.can_list {
            return Err(skip("ListInstances is UNIMPLEMENTED"));
        }
        if self.known.len() < 2 {
            return Err(skip("fewer than two instances listed"));
        }
        let want: BTreeSet<String> = self.known.iter().map(|i| i.provider_id.clone()).collect();
        ensure(want.len() == self.known.len(), || "the default listing repeats an instance".into())?;
        for size in [1, 2, 3, 7] {
            let got = self.list_all_instances(size).await?;
            let ids: Vec<String> = got.iter().map(|i| i.provider_id.clone()).collect();
            let set: BTreeSet<String> = ids.iter().cloned().collect();
            ensure(set.len() == ids.len(), || format!("page size {size}: an instance is repeated across pages"))?;
            ensure(set == want, || format!("page size {size}: listed {} instances, expected {}", set.len(), want.len()))?;
        }
        Ok(())
    }

    pub(super) async fn list_instances_bad_token(&mut self) -> Check {
        if !self.can_list {
            return Err(skip("ListInstances is UNIMPLEMENTED"));
        }
        let r = self
            .instances
            .clone()
            .list_instances(self.req(pb::ListInstancesRequest { page_size: 1, page_token: "ccm-conformance-not-a-token".into() }))
            .await;
        expect_code(r, Code::InvalidArgument, "ListInstances with a foreign page token")
    }

    pub(super) async fn deadline_honoured(&mut self) -> Check {
        let deadline = Duration::from_millis(50);
        let start = Instant::now();
        // The client stops waiting too, so this bounds a provider that ignores the deadline.
        let r = if self.can_list {
            let mut request = Request::new(pb::ListInstancesRequest { page_size: 0, page_token: String::new() });
            request.set_timeout(deadline);
            tokio::time::timeout(Duration::from_secs(5), self.instances.clone().list_instances(request))
                .await
                .map(|r| r.map(|_| ()))
        } else {
            let lookup = self.first_known().map_err(|_| skip("ListInstances is UNIMPLEMENTED and no --instance is named"))?;
            let lookup =
                pb::InstanceLookup { node_name: lookup.node_name, provider_id: lookup.provider_id, ..Default::default() };
            let mut request = Request::new(pb::InstanceMetadataRequest { instance: Some(lookup) });
            request.set_timeout(deadline);
            tokio::time::timeout(Duration::from_secs(5), self.instances.clone().instance_metadata(request))
                .await
                .map(|r| r.map(|_| ()))
        };
        let took = start.elapsed();
        match r {
            Err(_) => Err(fail("a call with a 50 ms deadline was not answered within 5 s")),
            Ok(Ok(_)) => {
                ensure(took <= deadline + Duration::from_millis(500), || format!("answered OK after {took:?}, past its deadline"))
            }
            Ok(Err(s)) if matches!(s.code(), Code::DeadlineExceeded | Code::Cancelled) => {
                ensure(took <= deadline + Duration::from_secs(1), || format!("deadline answered only after {took:?}"))
            }
            Ok(Err(s)) => Err(fail(format!("expected OK or DEADLINE_EXCEEDED, got {} {}", code_name(s.code()), s.message()))),
        }
    }

    pub(super) fn first_known(&self) -> Result<pb::InstanceMetadata, Not> {
        self.known
            .iter()
            .find(|i| i.state() == pb::InstanceState::Running)
            .or_else(|| self.known.first())
            .cloned()
            .ok_or_else(|| skip("no instance is listed"))
    }

    pub(super) fn unknown_by_id(&self) -> Result<pb::InstanceLookup, Not> {
        // A well-formed providerID of this provider that names no instance.
        let known = self.first_known()?;
        Ok(pb::InstanceLookup { provider_id: format!("{}-ccm-conformance-absent", known.provider_id), ..Default::default() })
    }

    pub(super) fn unknown_by_name(&self) -> pb::InstanceLookup {
        pb::InstanceLookup { node_name: format!("ccm-conformance-absent-{}", self.run_id), ..Default::default() }
    }

    pub(super) async fn exists_known(&mut self) -> Check {
        let known = self.first_known()?;
        let r = self
            .instances
            .clone()
            .instance_exists(self.req(pb::InstanceExistsRequest { instance: Some(by_provider_id(&known)) }))
            .await;
        ensure(r.ctx("InstanceExists")?.exists, || format!("listed instance {} does not exist", known.provider_id))
    }

    pub(super) async fn exists_unknown_provider_id(&mut self) -> Check {
        let lookup = self.unknown_by_id()?;
        let r =
            self.instances.clone().instance_exists(self.req(pb::InstanceExistsRequest { instance: Some(lookup.clone()) })).await;
        ensure(!r.ctx("InstanceExists of an unknown providerID (must be OK with exists=false)")?.exists, || {
            format!("{} exists", lookup.provider_id)
        })
    }

    pub(super) async fn exists_unknown_node_name(&mut self) -> Check {
        let lookup = self.unknown_by_name();
        let r =
            self.instances.clone().instance_exists(self.req(pb::InstanceExistsRequest { instance: Some(lookup.clone()) })).await;
        ensure(!r.ctx("InstanceExists of an unknown node name (must be OK with exists=false)")?.exists, || {
            format!("{} exists", lookup.node_name)
        })
    }

    pub(super) async fn exists_empty_lookup(&mut self) -> Check {
        let r = self
            .instances
            .clone()
            .instance_exists(self.req(pb::InstanceExistsRequest { instance: Some(Default::default()) }))
            .await;
        expect_code(r, Code::InvalidArgument, "InstanceExists with an empty lookup")
    }

    pub(super) async fn shutdown_known(&mut self) -> Check {
        let known = self.first_known()?;
        let r = self
            .instances
            .clone()
            .instance_shutdown(self.req(pb::InstanceShutdownRequest { instance: Some(by_provider_id(&known)) }))
            .await
            .ctx("InstanceShutdown")?;
        ensure(r.exists, || format!("listed instance {} does not exist", known.provider_id))?;
        let stopped = known.state() == pb::InstanceState::Stopped;
        ensure(r.shutdown == stopped, || format!("shutdown={} but the listing says state {:?}", r.shutdown, known.state()))
    }

    pub(super) async fn shutdown_unknown(&mut self) -> Check {
        let lookup = self.unknown_by_id()?;
        let r = self
            .instances
            .clone()
            .instance_shutdown(self.req(pb::InstanceShutdownRequest { instance: Some(lookup) }))
            .await
            .ctx("InstanceShutdown of an unknown instance")?;
        ensure(!r.exists, || "an unknown instance exists".into())
    }

    /// With `pod_cidrs` advertised, each listed instance's pod CIDRs are networks, at most
    /// one per IP family, the same in its metadata as in the listing; `pod_cidrs_routed` says
    /// nothing without `pod_cidrs`.
    pub(super) async fn pod_cidrs(&mut self) -> Check {
        let caps = self.caps.instances.unwrap_or_default();
        ensure(caps.pod_cidrs || !caps.pod_cidrs_routed, || "pod_cidrs_routed is advertised without pod_cidrs".into())?;
        if !caps.pod_cidrs {
            return Err(skip("InstancesCapabilities.pod_cidrs is not advertised"));
        }
        for known in self.known.iter().take(10) {
            ccm_protocol::answer::pod_cidrs(&known.pod_cidrs).map_err(|why| fail(format!("{}: {why}", known.provider_id)))?;
            let r = self
                .instances
                .clone()
                .instance_metadata(self.req(pb::InstanceMetadataRequest { instance: Some(by_provider_id(known)) }))
                .await
                .ctx("InstanceMetadata")?;
            let m = r.metadata.unwrap_or_default();
            ensure(m.pod_cidrs == known.pod_cidrs, || {
                format!("{}: metadata's pod CIDRs {:?}, the listing's {:?}", known.provider_id, m.pod_cidrs, known.pod_cidrs)
            })?;
        }
        Ok(())
    }

    pub(super) async fn metadata_known(&mut self) -> Check {
        let known = self.first_known()?;
        for _ in 0..2 {
            let r = self
                .instances
                .clone()
                .instance_metadata(self.req(pb::InstanceMetadataRequest { instance: Some(by_provider_id(&known)) }))
                .await
                .ctx("InstanceMetadata")?;
            ensure(r.exists, || format!("listed instance {} does not exist", known.provider_id))?;
            let m = r.metadata.ok_or_else(|| fail("exists=true without metadata"))?;
            ensure(m.provider_id == known.provider_id, || {
                format!("providerID {} for lookup {}", m.provider_id, known.provider_id)
            })?;
            ensure(m.instance_type == known.instance_type && m.zone == known.zone, || {
                format!("metadata {m:?} disagrees with the listing {known:?}")
            })?;
            for a in &m.addresses {
                valid_address(a).map_err(fail)?;
            }
        }
        Ok(())
    }

    pub(super) async fn metadata_by_node_name(&mut self) -> Check {
        let known = self
            .known
            .iter()
            .find(|i| !i.node_name.is_empty())
            .cloned()
            .ok_or_else(|| skip("no listed instance has a node name"))?;
        let lookup = pb::InstanceLookup { node_name: known.node_name.clone(), ..Default::default() };
        let r = self
            .instances
            .clone()
            .instance_metadata(self.req(pb::InstanceMetadataRequest { instance: Some(lookup) }))
            .await
            .ctx("InstanceMetadata by node name")?;
        let m = r.metadata.filter(|_| r.exists).ok_or_else(|| fail(format!("node {} not found by name", known.node_name)))?;
        ensure(m.provider_id == known.provider_id, || {
            format!("node {} resolved to {}, listed as {}", known.node_name, m.provider_id, known.provider_id)
        })
    }

    pub(super) async fn metadata_unknown(&mut self) -> Check {
        let lookup = self.unknown_by_id()?;
        let r = self
            .instances
            .clone()
            .instance_metadata(self.req(pb::InstanceMetadataRequest { instance: Some(lookup) }))
            .await
            .ctx("InstanceMetadata of an unknown instance (must be OK with exists=false)")?;
        ensure(!r.exists && r.metadata.is_none(), || format!("an unknown instance has metadata: {r:?}"))
    }

    pub(super) async fn metadata_empty_lookup(&mut self) -> Check {
        let r = self.instances.clone().instance_metadata(self.req(pb::InstanceMetadataRequest { instance: None })).await;
        expect_code(r, Code::InvalidArgument, "InstanceMetadata without a lookup")
    }

    pub(super) async fn cache_hint(&mut self) -> Check {
        let known = self.first_known()?;
        let r = self
            .instances
            .clone()
            .instance_metadata(self.req(pb::InstanceMetadataRequest { instance: Some(by_provider_id(&known)) }))
            .await
            .ctx("InstanceMetadata")?;
        match r.cache_ttl {
            None => Ok(()),
            Some(ttl) => ensure(ttl.seconds >= 0 && ttl.nanos >= 0 && ttl.seconds <= 86_400, || {
                format!("cache_ttl {ttl:?} is negative or longer than a day")
            }),
        }
    }

    pub(super) async fn batch_mixed(&mut self) -> Check {
        let known = self.first_known()?;
        let lookups = vec![by_provider_id(&known), self.unknown_by_id()?, pb::InstanceLookup::default()];
        let r = self
            .instances
            .clone()
            .batch_instance_metadata(self.req(pb::BatchInstanceMetadataRequest { instances: lookups.clone() }))
            .await
            .ctx("BatchInstanceMetadata")?;
        let results = by_lookup("BatchInstanceMetadata", &lookups, &r.results, |r| r.lookup.as_ref())?;
        let (a, b, c) = (results[0], results[1], results[2]);
        ensure(a.exists && a.error.is_none() && a.metadata.as_ref().is_some_and(|m| m.provider_id == known.provider_id), || {
            format!("known instance answered {a:?}")
        })?;
        ensure(!b.exists && b.error.is_none(), || format!("unknown instance answered {b:?} (want exists=false, no error)"))?;
        ensure(c.error.as_ref().is_some_and(|e| e.code == Code::InvalidArgument as i32), || {
            format!("empty lookup answered {c:?} (want an INVALID_ARGUMENT item error)")
        })
    }

    pub(super) async fn batch_matches_single(&mut self) -> Check {
        if self.known.is_empty() {
            return Err(skip("no instance is listed"));
        }
        let sample: Vec<pb::InstanceMetadata> = self.known.iter().take(10).cloned().collect();
        let lookups: Vec<pb::InstanceLookup> = sample.iter().map(by_provider_id).collect();
        let r = self
            .instances
            .clone()
            .batch_instance_metadata(self.req(pb::BatchInstanceMetadataRequest { instances: lookups.clone() }))
            .await
            .ctx("BatchInstanceMetadata")?;
        let results = by_lookup("BatchInstanceMetadata", &lookups, &r.results, |r| r.lookup.as_ref())?;
        for (lookup, batch) in lookups.iter().zip(results) {
            let single = self
                .instances
                .clone()
                .instance_metadata(self.req(pb::InstanceMetadataRequest { instance: Some(lookup.clone()) }))
                .await
                .ctx("InstanceMetadata")?;
            ensure(batch.error.is_none() && batch.exists == single.exists && batch.metadata == single.metadata, || {
                format!("{}: batch {batch:?} differs from single {single:?}", lookup.provider_id)
            })?;
        }
        Ok(())
    }

    pub(super) async fn batch_too_large(&mut self) -> Check {
        let lookups = vec![self.unknown_by_name(); MAX_BATCH + 1];
        let r = self
            .instances
            .clone()
            .batch_instance_metadata(self.req(pb::BatchInstanceMetadataRequest { instances: lookups }))
            .await;
        expect_code(r, Code::InvalidArgument, "BatchInstanceMetadata of 501 lookups")
    }
}
