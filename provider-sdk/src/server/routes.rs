//! RoutesService: routes validated, one mutation per route in flight.

use std::sync::Arc;

use ccm_proto::v1 as pb;
use tonic::{Request, Response, Status};

use crate::error::Error;
use crate::locks::ObjectLocks;
use crate::page::PageRequest;
use crate::provider::{Answered, Routes};
use crate::validate;
use ccm_proto::v1::routes_service_server::RoutesService;

use super::Observers;
use super::items::{checked, distinct, in_order, merge, route_key};

// === impl RoutesAdapter ===

pub(super) struct RoutesAdapter {
    pub(super) inner: Arc<dyn Routes>,
    /// One mutation per route at a time.
    pub(super) locks: ObjectLocks,
    pub(super) ipv6: bool,
    pub(super) ttl: Option<prost_types::Duration>,
    pub(super) obs: Observers,
}

#[tonic::async_trait]
impl RoutesService for RoutesAdapter {
    async fn list_route_tables(
        &self,
        req: Request<pb::ListRouteTablesRequest>,
    ) -> std::result::Result<Response<pb::ListRouteTablesResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("RoutesService/ListRouteTables", async {
                let page = PageRequest::new(req.page_size, req.page_token);
                page.after()?;
                let page = self.inner.list_route_tables(&page).await?;
                Ok(pb::ListRouteTablesResponse { tables: page.items, next_page_token: page.next_page_token })
            })
            .await
    }

    async fn list_routes(
        &self,
        req: Request<pb::ListRoutesRequest>,
    ) -> std::result::Result<Response<pb::ListRoutesResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("RoutesService/ListRoutes", async {
                let page = PageRequest::new(req.page_size, req.page_token);
                page.after()?;
                let page = self.inner.list_routes(&req.cluster_name, &req.table_id, &page).await?;
                Ok(pb::ListRoutesResponse { routes: page.items, next_page_token: page.next_page_token, cache_ttl: self.ttl })
            })
            .await
    }

    async fn create_route(
        &self,
        req: Request<pb::CreateRouteRequest>,
    ) -> std::result::Result<Response<pb::CreateRouteResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("RoutesService/CreateRoute", async {
                let route = validate::route(req.route.as_ref(), self.ipv6)?.clone();
                let _held = self.locks.lock([route_key(&route.table_id, &route.name)]).await;
                Ok(pb::CreateRouteResponse { route: Some(self.inner.create_route(&req.cluster_name, route).await?) })
            })
            .await
    }

    async fn delete_route(
        &self,
        req: Request<pb::DeleteRouteRequest>,
    ) -> std::result::Result<Response<pb::DeleteRouteResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("RoutesService/DeleteRoute", async {
                validate::route_name(&req.name)?;
                let _held = self.locks.lock([route_key(&req.table_id, &req.name)]).await;
                self.inner.delete_route(&req.cluster_name, &req.table_id, &req.name).await?;
                Ok(pb::DeleteRouteResponse {})
            })
            .await
    }

    async fn resolve_route_tables(
        &self,
        req: Request<pb::ResolveRouteTablesRequest>,
    ) -> std::result::Result<Response<pb::ResolveRouteTablesResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("RoutesService/ResolveRouteTables", async {
                validate::batch_size(req.targets.len())?;
                let answers = self.inner.resolve_route_tables(&req.targets).await?;
                let keys: Vec<pb::LookupKey> = req.targets.iter().map(Answered::<()>::target_key).collect();
                let assignments = in_order(&keys, answers)?
                    .into_iter()
                    .map(|a| {
                        let target = Some(pb::RouteTarget { node_name: a.lookup.node_name, provider_id: a.lookup.provider_id });
                        match a.result {
                            Ok(table_ids) => pb::RouteTableAssignment { table_ids, error: None, target },
                            Err(e) => pb::RouteTableAssignment { table_ids: Vec::new(), error: Some(e.to_item_error()), target },
                        }
                    })
                    .collect();
                Ok(pb::ResolveRouteTablesResponse { assignments })
            })
            .await
    }

    async fn apply_routes(
        &self,
        req: Request<pb::ApplyRoutesRequest>,
    ) -> std::result::Result<Response<pb::ApplyRoutesResponse>, Status> {
        let req = req.into_inner();
        self.obs
            .call("RoutesService/ApplyRoutes", async {
                validate::batch_size(req.deletes.len() + req.creates.len())?;
                distinct("route to delete", req.deletes.iter().map(String::as_str))?;
                distinct("route to create", req.creates.iter().map(|r| r.name.as_str()))?;
                if let Some(r) = req.creates.iter().find(|r| !r.table_id.is_empty() && r.table_id != req.table_id) {
                    let why = format!("route {:?} names table {:?} in a call for table {:?}", r.name, r.table_id, req.table_id);
                    return Err(Error::invalid_argument(why));
                }
                let (delete_checks, deletes) = checked(&req.deletes, |n| validate::route_name(n).map(|()| n.clone()));
                let (create_checks, creates) = checked(&req.creates, |r| {
                    let mut route = validate::route(Some(r), self.ipv6)?.clone();
                    route.table_id.clone_from(&req.table_id);
                    Ok(route)
                });
                let names = deletes.iter().chain(creates.iter().map(|r| &r.name));
                let _held = self.locks.lock(names.map(|n| route_key(&req.table_id, n)).collect::<Vec<_>>()).await;
                let applied = self.inner.apply_routes(&req.cluster_name, &req.table_id, &deletes, creates).await?;
                let deletes = merge("deletes", delete_checks, applied.deletes)?;
                let creates = merge("creates", create_checks, applied.creates)?;
                Ok(pb::ApplyRoutesResponse {
                    deletes: deletes
                        .into_iter()
                        .map(|r| pb::RouteDeleteResult { error: r.err().map(|e| e.to_item_error()) })
                        .collect(),
                    creates: creates
                        .into_iter()
                        .map(|r| match r {
                            Ok(route) => pb::RouteResult { route: Some(route), error: None },
                            Err(e) => pb::RouteResult { route: None, error: Some(e.to_item_error()) },
                        })
                        .collect(),
                })
            })
            .await
    }
}
