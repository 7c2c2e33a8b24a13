//! RoutesService: tables and routes listed (all pages), tables resolved for Nodes, routes
//! created and deleted one by one or with ApplyRoutes (fenced: see `provider/fenced.rs`).

use ccm_proto::v1 as pb;
use ccm_protocol::Error;
use ccm_protocol::answer;
use ccm_protocol::limits::MAX_BATCH;

use super::{PerLookup, matched, routes_client};
use crate::leader::Fence;
use crate::provider::Provider;
use crate::provider::check::Pages;
use crate::provider::convert::{Route, RouteTable, RouteTarget};

impl Provider {
    /// Every route table, all pages.
    pub async fn list_route_tables(&self) -> Result<Vec<RouteTable>, Error> {
        const METHOD: &str = "RoutesService/ListRouteTables";
        let mut tables = Vec::new();
        let mut pages = Pages::default();
        let mut token = String::new();
        loop {
            let request = pb::ListRouteTablesRequest { page_size: 0, page_token: token };
            let rpc = async |ch, r| routes_client(ch).list_route_tables(r).await;
            let page = self.call(METHOD, request, rpc).await?;
            if let Some(t) = page.tables.iter().find(|t| t.id.is_empty()) {
                return Err(self.invalid(METHOD, format!("a route table without an id (named {:?})", t.name)));
            }
            tables.extend(page.tables.into_iter().map(RouteTable::from));
            match pages.next(METHOD, page.next_page_token).map_err(|e| self.counted(METHOD, e))? {
                Some(next) => token = next,
                None => return Ok(tables),
            }
        }
    }

    /// The cluster's routes in one table, all pages, each checked by [`answer::route`].
    pub async fn list_routes(&self, cluster: &str, table: &str) -> Result<Vec<Route>, Error> {
        const METHOD: &str = "RoutesService/ListRoutes";
        let mut routes = Vec::new();
        let mut pages = Pages::default();
        let mut token = String::new();
        loop {
            let request = pb::ListRoutesRequest {
                cluster_name: cluster.to_string(),
                table_id: table.to_string(),
                page_size: 0,
                page_token: token,
            };
            let rpc = async |ch, r| routes_client(ch).list_routes(r).await;
            let page = self.call(METHOD, request, rpc).await?;
            for route in &page.routes {
                answer::route(route).map_err(|why| self.invalid(METHOD, why))?;
            }
            routes.extend(page.routes.into_iter().map(Route::from));
            match pages.next(METHOD, page.next_page_token).map_err(|e| self.counted(METHOD, e))? {
                Some(next) => token = next,
                None => return Ok(routes),
            }
        }
    }

    /// The tables each target's routes belong in, 500 targets a call: one answer per target,
    /// in order, matched by the target each assignment names. An answer of the wrong length is
    /// an error for the whole call; a target no assignment names fails alone.
    pub async fn resolve_route_tables(&self, targets: &[RouteTarget]) -> Result<PerLookup<Vec<String>>, Error> {
        const METHOD: &str = "RoutesService/ResolveRouteTables";
        let mut out = Vec::with_capacity(targets.len());
        for chunk in targets.chunks(MAX_BATCH) {
            let request = pb::ResolveRouteTablesRequest { targets: chunk.iter().map(pb::RouteTarget::from).collect() };
            let rpc = async |ch, r| routes_client(ch).resolve_route_tables(r).await;
            let answer = self.call(METHOD, request, rpc).await?;
            if answer.assignments.len() != chunk.len() {
                let why = format!("{} assignments for {} targets", answer.assignments.len(), chunk.len());
                return Err(self.invalid(METHOD, why));
            }
            let keys = chunk.iter().map(|t| (t.provider_id.as_str(), t.node_name.as_str()));
            let named = |a: &pb::RouteTableAssignment| a.target.as_ref().map(|t| (t.provider_id.clone(), t.node_name.clone()));
            for matched in matched(METHOD, keys, answer.assignments, named) {
                out.push(matched.and_then(|a| match a.error {
                    Some(e) => Err(self.item_error(&e)),
                    None => Ok(a.table_ids),
                }));
            }
        }
        Ok(out)
    }

    /// Creates `route` (fenced); the route as the provider made it.
    pub(in crate::provider) async fn create_route(
        &self,
        fence: Option<&Fence>,
        cluster: &str,
        route: Route,
    ) -> Result<Route, Error> {
        const METHOD: &str = "RoutesService/CreateRoute";
        let route = pb::Route::from(&route);
        let request = pb::CreateRouteRequest { cluster_name: cluster.to_string(), route: Some(route.clone()) };
        let rpc = async |ch, r| routes_client(ch).create_route(r).await;
        let made = self.call_fenced(fence, METHOD, request, rpc).await?.route;
        self.made_route(METHOD, &route, made)
    }

    /// Deletes the route `name` of `table` (fenced).
    pub(in crate::provider) async fn delete_route(
        &self,
        fence: Option<&Fence>,
        cluster: &str,
        table: &str,
        name: &str,
    ) -> Result<(), Error> {
        let request =
            pb::DeleteRouteRequest { cluster_name: cluster.to_string(), table_id: table.to_string(), name: name.to_string() };
        let rpc = async |ch, r| routes_client(ch).delete_route(r).await;
        self.call_fenced(fence, "RoutesService/DeleteRoute", request, rpc).await.map(|_| ())
    }

    /// Deletes the routes `deletes` and creates `creates` in `table` with ApplyRoutes (fenced),
    /// 500 items a call, every delete before any create: one result per delete and per
    /// create, in order. A failed call, or an answer of the wrong length, fails every item of
    /// its call; a created route is checked as CreateRoute's answer is.
    pub(in crate::provider) async fn apply_routes(
        &self,
        fence: Option<&Fence>,
        cluster: &str,
        table: &str,
        deletes: Vec<String>,
        creates: Vec<Route>,
    ) -> (PerLookup<()>, PerLookup<Route>) {
        const METHOD: &str = "RoutesService/ApplyRoutes";
        let creates: Vec<pb::Route> = creates.iter().map(pb::Route::from).collect();
        let (mut deleted, mut created) = (Vec::with_capacity(deletes.len()), Vec::with_capacity(creates.len()));
        let (mut deletes, mut creates) = (deletes.into_iter().peekable(), creates.into_iter().peekable());
        while deletes.peek().is_some() || creates.peek().is_some() {
            let deletes: Vec<String> = deletes.by_ref().take(MAX_BATCH).collect();
            let creates: Vec<pb::Route> = creates.by_ref().take(MAX_BATCH - deletes.len()).collect();
            let request = pb::ApplyRoutesRequest {
                cluster_name: cluster.to_string(),
                table_id: table.to_string(),
                deletes: deletes.clone(),
                creates: creates.clone(),
            };
            let rpc = async |ch, r| routes_client(ch).apply_routes(r).await;
            let answer = self.call_fenced(fence, METHOD, request, rpc).await.and_then(|a| {
                if a.deletes.len() != deletes.len() || a.creates.len() != creates.len() {
                    let why = format!(
                        "{} and {} results for {} deletes and {} creates",
                        a.deletes.len(),
                        a.creates.len(),
                        deletes.len(),
                        creates.len()
                    );
                    return Err(self.invalid(METHOD, why));
                }
                Ok(a)
            });
            match answer {
                Ok(a) => {
                    deleted.extend(a.deletes.into_iter().map(|d| d.error.map_or(Ok(()), |e| Err(self.item_error(&e)))));
                    created.extend(a.creates.into_iter().zip(creates).map(|(r, wanted)| match (r.error, r.route) {
                        (Some(e), _) => Err(self.item_error(&e)),
                        (None, made) => self.made_route(METHOD, &wanted, made),
                    }));
                }
                Err(e) => {
                    deleted.extend(deletes.iter().map(|_| Err(e.clone())));
                    created.extend(creates.iter().map(|_| Err(e.clone())));
                }
            }
        }
        (deleted, created)
    }

    /// A created route as the provider answered it (`made`; none means as asked), checked.
    fn made_route(&self, method: &str, wanted: &pb::Route, made: Option<pb::Route>) -> Result<Route, Error> {
        let made = made.unwrap_or_else(|| wanted.clone());
        answer::route(&made).map_err(|why| self.invalid(method, why))?;
        if made.destination_cidr != wanted.destination_cidr {
            let why = format!("asked for a route to {}, it made one to {}", wanted.destination_cidr, made.destination_cidr);
            return Err(self.invalid(method, why));
        }
        Ok(Route::from(made))
    }
}
