//! RoutesService: tables and their paging, create and delete (idempotent, conflicting, malformed, IPv6), cluster isolation, table resolution and quotas.

use super::*;

impl<F: FnMut(&CheckResult)> Suite<F> {
    pub(super) fn cluster(&self) -> String {
        format!("ccm-conformance-{}", self.run_id)
    }

    pub(super) fn cidr(&self, i: u32) -> String {
        let n = (self.cidr_base + i) % 512;
        format!("198.{}.{}.0/24", 18 + n / 256, n % 256)
    }

    pub(super) fn route(&self, suffix: &str, cidr: String) -> Result<pb::Route, Not> {
        let target = self.first_known().map_err(|_| skip("routes need a listed instance to point at"))?;
        Ok(pb::Route {
            name: format!("ccm-conformance-{}-{suffix}", self.run_id),
            target: Some(pb::RouteTarget { node_name: target.node_name.clone(), provider_id: target.provider_id }),
            destination_cidr: cidr,
            table_id: String::new(),
            blackhole: false,
            target_addresses: Vec::new(),
        })
    }

    pub(super) async fn list_all_tables(&self, page_size: u32) -> Result<Vec<pb::RouteTable>, Not> {
        all_pages("ListRouteTables", page_size, async |page_token| {
            let page =
                self.routes.clone().list_route_tables(self.req(pb::ListRouteTablesRequest { page_size, page_token })).await;
            page.ctx("ListRouteTables").map(|p| (p.tables, p.next_page_token))
        })
        .await
    }

    pub(super) async fn list_all_routes(&self, cluster: &str, table_id: &str, page_size: u32) -> Result<Vec<pb::Route>, Not> {
        all_pages("ListRoutes", page_size, async |page_token| {
            let request = pb::ListRoutesRequest {
                cluster_name: cluster.to_string(),
                table_id: table_id.to_string(),
                page_size,
                page_token,
            };
            let page = self.routes.clone().list_routes(self.req(request)).await;
            page.ctx("ListRoutes").map(|p| (p.routes, p.next_page_token))
        })
        .await
    }

    pub(super) async fn list_tables(&mut self) -> Check {
        let tables = self.list_all_tables(0).await?;
        ensure(!tables.is_empty(), || "no route table listed".into())?;
        let ids: HashSet<&str> = tables.iter().map(|t| t.id.as_str()).collect();
        ensure(ids.len() == tables.len() && !ids.contains(""), || format!("table ids are empty or repeated: {tables:?}"))?;
        let multiple = self.caps.routes.as_ref().is_some_and(|r| r.multiple_tables);
        ensure(multiple || tables.len() == 1, || format!("{} tables listed without advertising multiple_tables", tables.len()))
    }

    pub(super) async fn list_tables_pagination(&mut self) -> Check {
        let all: Vec<String> = self.list_all_tables(0).await?.into_iter().map(|t| t.id).collect();
        let paged: Vec<String> = self.list_all_tables(1).await?.into_iter().map(|t| t.id).collect();
        let set: BTreeSet<&String> = paged.iter().collect();
        ensure(set.len() == paged.len(), || "a table is repeated across pages".into())?;
        ensure(set == all.iter().collect(), || format!("paged tables {paged:?} differ from {all:?}"))
    }

    pub(super) async fn list_routes_unknown_table(&mut self) -> Check {
        let r = self
            .routes
            .clone()
            .list_routes(self.req(pb::ListRoutesRequest {
                cluster_name: self.cluster(),
                table_id: format!("ccm-conformance-no-such-table-{}", self.run_id),
                ..Default::default()
            }))
            .await;
        expect_code(r, Code::InvalidArgument, "ListRoutes of an unknown table")
    }

    pub(super) async fn list_routes_bad_token(&mut self) -> Check {
        let r = self
            .routes
            .clone()
            .list_routes(self.req(pb::ListRoutesRequest {
                cluster_name: self.cluster(),
                page_size: 1,
                page_token: "ccm-conformance-not-a-token".into(),
                ..Default::default()
            }))
            .await;
        expect_code(r, Code::InvalidArgument, "ListRoutes with a foreign page token")
    }

    pub(super) async fn create(&mut self, route: pb::Route) -> Result<pb::Route, Not> {
        let r = self
            .routes
            .clone()
            .create_route(self.req(pb::CreateRouteRequest { cluster_name: self.cluster(), route: Some(route.clone()) }))
            .await;
        let created = r.ctx("CreateRoute")?.route.ok_or_else(|| fail("CreateRoute answered no route"))?;
        self.created_routes.push((created.table_id.clone(), created.name.clone(), created.destination_cidr.clone()));
        Ok(created)
    }

    /// Route names are the provider's own (`provider_names`): CreateRoute's is a hint.
    pub(super) fn provider_names(&self) -> bool {
        self.caps.routes.as_ref().is_some_and(|r| r.provider_names)
    }

    /// The name the provider gave the route created to `cidr`.
    pub(super) fn created_name(&self, cidr: &str) -> Option<(String, String)> {
        self.created_routes.iter().rev().find(|(_, _, d)| d == cidr).map(|(t, n, _)| (t.clone(), n.clone()))
    }

    pub(super) async fn create_route(&mut self) -> Check {
        let route = self.route("main", self.cidr(0))?;
        let created = self.create(route.clone()).await?;
        let same_name = created.name == route.name || self.provider_names();
        let want = route.target.clone().unwrap_or_default();
        let got = created.target.clone().unwrap_or_default();
        let same_target = got.node_name == want.node_name && (got.provider_id.is_empty() || got.provider_id == want.provider_id);
        ensure(same_name && same_target && created.destination_cidr == route.destination_cidr, || {
            format!("created {created:?}, asked for {route:?}")
        })?;
        let cluster = self.cluster();
        self.eventually(async || {
            let listed = self.list_all_routes(&cluster, "", 0).await?;
            ensure(listed.iter().any(|r| r.name == created.name && r.destination_cidr == route.destination_cidr), || {
                format!("route {} is not listed after creation", created.name)
            })
        })
        .await
    }

    pub(super) async fn create_route_again(&mut self) -> Check {
        let route = self.route("main", self.cidr(0))?;
        self.create(route.clone()).await.map_err(|e| match e {
            Not::Fail(why) => fail(format!("repeating CreateRoute: {why}")),
            other => other,
        })?;
        let listed = self.list_all_routes(&self.cluster(), "", 0).await?;
        let n = listed.iter().filter(|r| r.destination_cidr == route.destination_cidr).count();
        ensure(n <= 1, || format!("route {} listed {n} times after a repeated create", route.name))
    }

    pub(super) async fn create_route_conflict(&mut self) -> Check {
        if self.provider_names() {
            return Err(skip("route names are the provider's (provider_names): a name hint cannot conflict"));
        }
        let route = self.route("main", self.cidr(1))?;
        let r = self
            .routes
            .clone()
            .create_route(self.req(pb::CreateRouteRequest { cluster_name: self.cluster(), route: Some(route) }))
            .await;
        expect_code(r, Code::AlreadyExists, "CreateRoute of an existing name with another destination")
    }

    pub(super) async fn create_route_empty_name(&mut self) -> Check {
        let mut route = self.route("x", self.cidr(2))?;
        route.name.clear();
        let r = self
            .routes
            .clone()
            .create_route(self.req(pb::CreateRouteRequest { cluster_name: self.cluster(), route: Some(route) }))
            .await;
        expect_code(r, Code::InvalidArgument, "CreateRoute without a name")
    }

    pub(super) async fn create_route_bad_cidr(&mut self) -> Check {
        for cidr in ["198.18.300.0/24", "not-a-cidr", "198.18.1.0/33", "198.18.1.7/24"] {
            let route = self.route("bad-cidr", cidr.to_string())?;
            let r = self
                .routes
                .clone()
                .create_route(self.req(pb::CreateRouteRequest { cluster_name: self.cluster(), route: Some(route) }))
                .await;
            expect_code(r, Code::InvalidArgument, &format!("CreateRoute to {cidr:?}"))?;
        }
        Ok(())
    }

    pub(super) async fn create_route_unknown_table(&mut self) -> Check {
        let mut route = self.route("no-table", self.cidr(3))?;
        route.table_id = format!("ccm-conformance-no-such-table-{}", self.run_id);
        let r = self
            .routes
            .clone()
            .create_route(self.req(pb::CreateRouteRequest { cluster_name: self.cluster(), route: Some(route) }))
            .await;
        expect_code(r, Code::InvalidArgument, "CreateRoute in an unknown table")
    }

    pub(super) async fn create_route_ipv6(&mut self) -> Check {
        let n = self.cidr_base;
        let route = self.route("v6", format!("fd00:ccc:{n:x}::/64"))?;
        if self.caps.routes.as_ref().is_some_and(|r| r.ipv6) {
            self.create(route).await.map(|_| ())
        } else {
            let r = self
                .routes
                .clone()
                .create_route(self.req(pb::CreateRouteRequest { cluster_name: self.cluster(), route: Some(route) }))
                .await;
            expect_code(r, Code::InvalidArgument, "CreateRoute of IPv6 without advertising ipv6")
        }
    }

    pub(super) async fn list_routes_pagination(&mut self) -> Check {
        let mut paged = BTreeSet::new();
        for i in 0..5 {
            let route = self.route(&format!("page-{i}"), self.cidr(10 + i))?;
            paged.insert(route.destination_cidr.clone());
            self.create(route).await?;
        }
        let cluster = self.cluster();
        let want: BTreeSet<String> = self
            .eventually(async || {
                let all = self.list_all_routes(&cluster, "", 0).await?;
                let found = all.iter().filter(|r| paged.contains(&r.destination_cidr)).count();
                let names: BTreeSet<String> = all.into_iter().map(|r| r.name).collect();
                ensure(found == 5, || format!("expected 5 paged routes, listed {names:?}")).map(|()| names)
            })
            .await?;
        for size in [1, 2, 3] {
            let got: Vec<String> = self.list_all_routes(&cluster, "", size).await?.into_iter().map(|r| r.name).collect();
            let set: BTreeSet<String> = got.iter().cloned().collect();
            ensure(set.len() == got.len(), || format!("page size {size}: a route is repeated across pages"))?;
            ensure(set == want, || format!("page size {size}: listed {set:?}, expected {want:?}"))?;
        }
        Ok(())
    }

    pub(super) async fn routes_cluster_isolation(&mut self) -> Check {
        let other = format!("ccm-conformance-other-{}", self.run_id);
        let listed = self.list_all_routes(&other, "", 0).await?;
        let ours = listed.iter().filter(|r| r.name.starts_with(&format!("ccm-conformance-{}-", self.run_id))).count();
        ensure(ours == 0, || format!("another cluster's listing shows {ours} of this cluster's routes"))
    }

    pub(super) async fn delete(&self, table_id: &str, name: &str) -> Result<(), Not> {
        self.routes
            .clone()
            .delete_route(self.req(pb::DeleteRouteRequest {
                cluster_name: self.cluster(),
                table_id: table_id.to_string(),
                name: name.to_string(),
            }))
            .await
            .ctx("DeleteRoute")
            .map(|_| ())
    }

    pub(super) async fn delete_route(&mut self) -> Check {
        let route = self.route("main", self.cidr(0))?;
        let (table, name) = self.created_name(&route.destination_cidr).ok_or_else(|| skip("routes.create failed"))?;
        self.delete(&table, &name).await?;
        let cluster = self.cluster();
        self.eventually(async || {
            let listed = self.list_all_routes(&cluster, "", 0).await?;
            ensure(!listed.iter().any(|r| r.name == name), || format!("route {name} still listed after DeleteRoute"))
        })
        .await
    }

    pub(super) async fn delete_route_again(&mut self) -> Check {
        let route = self.route("main", self.cidr(0))?;
        let name = self.created_name(&route.destination_cidr).map_or(route.name, |(_, n)| n);
        self.delete("", &name).await
    }

    pub(super) async fn delete_route_absent(&mut self) -> Check {
        self.delete("", &format!("ccm-conformance-{}-never-created", self.run_id)).await
    }

    pub(super) async fn resolve_tables(&mut self) -> Check {
        if !self.caps.routes.as_ref().is_some_and(|r| r.multiple_tables) {
            return Err(skip("multiple_tables is not advertised"));
        }
        let target = self.route("resolve", self.cidr(30))?.target.unwrap_or_default();
        let tables: HashSet<String> = self.list_all_tables(0).await?.into_iter().map(|t| t.id).collect();
        let r = self
            .routes
            .clone()
            .resolve_route_tables(self.req(pb::ResolveRouteTablesRequest { targets: vec![target] }))
            .await
            .ctx("ResolveRouteTables")?;
        ensure(r.assignments.len() == 1, || format!("{} assignments for 1 target", r.assignments.len()))?;
        let a = &r.assignments[0];
        ensure(a.error.is_none() && !a.table_ids.is_empty(), || format!("no table for a listed instance: {a:?}"))?;
        ensure(a.table_ids.iter().all(|t| tables.contains(t)), || format!("assigned tables {:?} are not all listed", a.table_ids))
    }

    pub(super) async fn route_quota(&mut self) -> Check {
        let tables = self.list_all_tables(0).await?;
        let table = tables.first().cloned().ok_or_else(|| fail("no route table listed"))?;
        let max =
            if table.max_routes > 0 { table.max_routes } else { self.caps.routes.as_ref().map_or(0, |r| r.max_routes_per_table) };
        if max == 0 {
            return Err(skip("no route quota advertised"));
        }
        if max > self.opts.max_quota_to_fill {
            return Err(skip(format!("quota of {max} routes is more than this run fills ({})", self.opts.max_quota_to_fill)));
        }
        let mut created = Vec::new();
        let mut outcome = Err(fail(format!("{} routes created in a table that holds {max}", max + 1)));
        for i in 0..=max {
            let mut route = self.route(&format!("quota-{i}"), self.cidr(100 + i))?;
            route.table_id = table.id.clone();
            let r = self
                .routes
                .clone()
                .create_route(self.req(pb::CreateRouteRequest { cluster_name: self.cluster(), route: Some(route.clone()) }))
                .await;
            match r {
                Ok(_) => created.push(route.name),
                Err(s) if s.code() == Code::ResourceExhausted => {
                    let err = crate::Error::from_status(&s);
                    outcome = ensure(matches!(err, crate::Error::QuotaExceeded { .. }), || {
                        format!("a full table answered {err:?}: a quota must not carry RetryInfo or the RATE_LIMITED reason")
                    });
                    break;
                }
                Err(s) => {
                    outcome = Err(fail(format!("route {i} of {max}: {} {}", code_name(s.code()), s.message())));
                    break;
                }
            }
        }
        for name in created {
            self.delete(&table.id, &name).await?;
        }
        outcome
    }
}

impl<F: FnMut(&CheckResult)> Suite<F> {
    fn bulk_routes(&self) -> Result<(), Not> {
        match self.caps.routes.as_ref().is_some_and(|r| r.bulk_apply) {
            true => Ok(()),
            false => Err(skip("bulk_apply is not advertised")),
        }
    }

    async fn apply(&self, deletes: Vec<String>, creates: Vec<pb::Route>) -> Result<pb::ApplyRoutesResponse, Not> {
        let request = pb::ApplyRoutesRequest { cluster_name: self.cluster(), table_id: String::new(), deletes, creates };
        self.routes.clone().apply_routes(self.req(request)).await.ctx("ApplyRoutes")
    }

    /// ApplyRoutes: three creates and a malformed one answer per item in order, the three are
    /// listed; deleting them with an absent name is OK per item, and they are gone.
    pub(super) async fn bulk_apply(&mut self) -> Check {
        self.bulk_routes()?;
        let cidrs: Vec<String> = (40..43).map(|i| self.cidr(i)).collect();
        let mut creates = Vec::new();
        for (i, cidr) in cidrs.iter().enumerate() {
            creates.push(self.route(&format!("bulk-{i}"), cidr.clone())?);
        }
        let mut malformed = self.route("bulk-bad", self.cidr(43))?;
        malformed.destination_cidr = "198.18.0.1/24".into();
        creates.insert(1, malformed);
        let applied = self.apply(Vec::new(), creates).await?;
        ensure(applied.creates.len() == 4 && applied.deletes.is_empty(), || {
            format!("{} create and {} delete results for 4 creates", applied.creates.len(), applied.deletes.len())
        })?;
        let bad = &applied.creates[1];
        ensure(bad.error.as_ref().is_some_and(|e| e.code == Code::InvalidArgument as i32), || {
            format!("a malformed CIDR in a bulk call is INVALID_ARGUMENT in its own item, got {bad:?}")
        })?;
        let mut made = Vec::new();
        for (result, cidr) in [&applied.creates[0], &applied.creates[2], &applied.creates[3]].into_iter().zip(&cidrs) {
            let route = result.route.as_ref().filter(|_| result.error.is_none());
            let route = route.ok_or_else(|| fail(format!("the create of {cidr} failed: {:?}", result.error)))?;
            ensure(&route.destination_cidr == cidr, || format!("results out of order: {cidr} answered with {route:?}"))?;
            self.created_routes.push((route.table_id.clone(), route.name.clone(), cidr.clone()));
            made.push(route.name.clone());
        }
        let cluster = self.cluster();
        self.eventually(async || {
            let listed = self.list_all_routes(&cluster, "", 0).await?;
            let n = cidrs.iter().filter(|c| listed.iter().any(|r| &r.destination_cidr == *c)).count();
            ensure(n == 3, || format!("{n} of the 3 routes ApplyRoutes created are listed"))
        })
        .await?;
        let mut deletes = made.clone();
        deletes.push(format!("ccm-conformance-{}-bulk-never-created", self.run_id));
        let applied = self.apply(deletes, Vec::new()).await?;
        ensure(applied.deletes.len() == 4 && applied.deletes.iter().all(|d| d.error.is_none()), || {
            format!("deleting 3 routes and an absent one: {:?}", applied.deletes)
        })?;
        self.eventually(async || {
            let listed = self.list_all_routes(&cluster, "", 0).await?;
            let left = listed.iter().filter(|r| cidrs.contains(&r.destination_cidr)).count();
            ensure(left == 0, || format!("{left} routes still listed after their bulk delete"))
        })
        .await
    }

    /// ApplyRoutes of more than 500 items is INVALID_ARGUMENT.
    pub(super) async fn bulk_apply_too_large(&mut self) -> Check {
        self.bulk_routes()?;
        let deletes = (0..=500).map(|i| format!("ccm-conformance-{}-absent-{i}", self.run_id)).collect();
        let request =
            pb::ApplyRoutesRequest { cluster_name: self.cluster(), table_id: String::new(), deletes, creates: Vec::new() };
        let r = self.routes.clone().apply_routes(self.req(request)).await;
        expect_code(r, Code::InvalidArgument, "ApplyRoutes of 501 items")
    }
}
