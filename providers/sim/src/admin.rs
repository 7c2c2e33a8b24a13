//! The sim's admin interface, apart from cloudprovider.v1: JSON over HTTP on its own socket.
//! Tests use it to change the cloud (add, stop, start, terminate instances), inject faults,
//! and read call counters and state; `/metrics` serves Prometheus text.
//!
//! | method | path | body | does |
//! |---|---|---|---|
//! | GET | `/state` | | the true state of instances, routes and load balancers |
//! | GET | `/route-tables` | | the route tables with their routes (the state's, alone) |
//! | GET | `/load-balancers/hosts` | | each load balancer's backend count and when they last changed (the state without backend lists, for polling thousands) |
//! | DELETE | `/load-balancers/{name}` | | removes a load balancer behind the controllers' back (as in the cloud's console) |
//! | PUT | `/load-balancers/{name}/hosts` | a list of Node names | replaces its backends behind the controllers' back |
//! | GET | `/calls` | | counters by method and code |
//! | GET | `/calls/log` | | every call with its timestamp |
//! | DELETE | `/calls` | | resets counters and log |
//! | POST | `/instances` | an instance (as in the config file) | adds it |
//! | POST | `/instances/{id}/{stop,start,terminate}` | | changes its state |
//! | DELETE | `/instances/{id}` | | removes it from the account |
//! | PUT | `/instances/{id}/addresses` | a list of `{"type":..,"address":..}` | replaces its addresses |
//! | PUT | `/instances/{id}/tags` | `{"key":"value",..}` | replaces its tags |
//! | POST | `/routes` | `{"cluster":..,"table_id":..,"name":..,"destination_cidr":..,"node_name":..}` | adds a route out of band (an empty `node_name`: a route to no instance, a gateway's) |
//! | PUT | `/faults` | a list of faults | replaces the faults |
//! | DELETE | `/faults` | | clears them |
//! | PUT | `/rate-limit` | `{"rps":..,"burst":..}` or `null` | sets or removes it |
//! | PUT | `/api` | `{"latency_ms":..,"jitter_ms":..,"consistency_delay_ms":..}` | sets latency and lag |
//! | GET | `/metrics` | | Prometheus text |

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use ccm_provider_sdk::Listen;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};

use crate::calls::{CallCount, CallRecord, Calls};
use crate::cloud::Cloud;
use crate::config::{Address, ApiConfig, Fault, InstanceSpec, RateLimit, State as InstanceState};

/// What the admin handlers share.
pub struct Admin {
    /// The cloud.
    pub cloud: Arc<Cloud>,
    /// Call counters.
    pub calls: Arc<Calls>,
    /// Prometheus registry.
    pub registry: std::sync::Arc<Registry>,
}

/// The answer of `GET /calls`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct CallsView {
    /// Total calls counted.
    pub total: u64,
    /// Counters by method and code.
    pub counts: Vec<CallCountView>,
}

/// One counter.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct CallCountView {
    /// `Service/Method`.
    pub method: String,
    /// gRPC code name.
    pub code: String,
    /// How many.
    pub count: u64,
}

impl From<CallCount> for CallCountView {
    fn from(c: CallCount) -> Self {
        Self { method: c.method, code: c.code, count: c.count }
    }
}

pub(crate) struct AdminError(pub(crate) ccm_provider_sdk::Error);

impl IntoResponse for AdminError {
    fn into_response(self) -> Response {
        let status = match self.0.code() {
            tonic::Code::NotFound => StatusCode::NOT_FOUND,
            tonic::Code::AlreadyExists => StatusCode::CONFLICT,
            tonic::Code::InvalidArgument => StatusCode::BAD_REQUEST,
            tonic::Code::FailedPrecondition => StatusCode::CONFLICT,
            tonic::Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        (status, Json(serde_json::json!({ "error": self.0.to_string() }))).into_response()
    }
}

type Shared = State<Arc<Admin>>;

/// The admin router.
pub fn router(admin: Arc<Admin>) -> axum::Router {
    axum::Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/state", get(state))
        .route("/load-balancers/hosts", get(hosts_summary))
        .route("/load-balancers/{name}", axum::routing::delete(remove_load_balancer))
        .route("/load-balancers/{name}/hosts", put(set_load_balancer_hosts))
        .route("/route-tables", get(route_tables))
        .route("/calls", get(calls).delete(reset_calls))
        .route("/calls/log", get(call_log))
        .route("/instances", post(add_instance))
        .route("/instances/{id}", axum::routing::delete(remove_instance))
        .route("/instances/{id}/addresses", put(set_addresses))
        .route("/instances/{id}/tags", put(set_tags))
        .route("/instances/{id}/{action}", post(instance_action))
        .route("/routes", post(add_route))
        .route("/faults", put(set_faults).delete(clear_faults))
        .route("/rate-limit", put(set_rate_limit))
        .route("/api", put(set_api))
        .route("/metrics", get(metrics))
        .with_state(admin)
}

async fn state(State(a): Shared) -> Json<Snapshot> {
    Json(a.cloud.snapshot())
}

async fn route_tables(State(a): Shared) -> Json<Vec<TableView>> {
    Json(a.cloud.route_table_views())
}

async fn hosts_summary(State(a): Shared) -> Json<Vec<HostsView>> {
    Json(a.cloud.hosts_summary())
}

async fn calls(State(a): Shared) -> Json<CallsView> {
    let counts: Vec<CallCountView> = a.calls.counts().into_iter().map(Into::into).collect();
    Json(CallsView { total: counts.iter().map(|c| c.count).sum(), counts })
}

async fn call_log(State(a): Shared) -> Json<Vec<CallRecord>> {
    Json(a.calls.log())
}

async fn reset_calls(State(a): Shared) -> StatusCode {
    a.calls.reset();
    StatusCode::NO_CONTENT
}

async fn add_instance(State(a): Shared, Json(spec): Json<InstanceSpec>) -> Result<Json<serde_json::Value>, AdminError> {
    let delay = std::time::Duration::from_millis(a.cloud.consistency_delay_ms());
    let m = a.cloud.add_instance(spec, delay).map_err(AdminError)?;
    Ok(Json(
        serde_json::json!({ "provider_id": m.provider_id, "addresses": m.addresses.iter().map(|a| a.address.clone()).collect::<Vec<_>>() }),
    ))
}

async fn instance_action(State(a): Shared, Path((id, action)): Path<(String, String)>) -> Result<StatusCode, AdminError> {
    let state = match action.as_str() {
        "stop" => InstanceState::Stopped,
        "start" => InstanceState::Running,
        "terminate" => InstanceState::Terminated,
        other => return Err(AdminError(ccm_provider_sdk::Error::invalid_argument(format!("unknown action {other:?}")))),
    };
    a.cloud.set_instance_state(&id, state).map_err(AdminError)?;
    Ok(StatusCode::NO_CONTENT)
}

/// A route added behind the controllers' back.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RouteSpec {
    /// The cluster it belongs to.
    pub cluster: String,
    /// Its table; empty for the default.
    #[serde(default)]
    pub table_id: String,
    /// Its name.
    pub name: String,
    /// Its destination.
    pub destination_cidr: String,
    /// The node (instance name) it points at.
    pub node_name: String,
}

async fn add_route(State(a): Shared, Json(spec): Json<RouteSpec>) -> Result<StatusCode, AdminError> {
    let route = ccm_provider_sdk::proto::Route {
        name: spec.name,
        target: Some(ccm_provider_sdk::proto::RouteTarget { node_name: spec.node_name, provider_id: String::new() }),
        destination_cidr: spec.destination_cidr,
        table_id: spec.table_id,
        blackhole: false,
        target_addresses: Vec::new(),
    };
    if route.target.as_ref().is_some_and(|t| t.node_name.is_empty()) {
        a.cloud.add_gateway_route(&spec.cluster, route).map_err(AdminError)?;
    } else {
        a.cloud.create_route(&spec.cluster, route).map_err(AdminError)?;
    }
    Ok(StatusCode::CREATED)
}

async fn set_addresses(
    State(a): Shared,
    Path(id): Path<String>,
    Json(addresses): Json<Vec<Address>>,
) -> Result<StatusCode, AdminError> {
    a.cloud.set_addresses(&id, addresses).map_err(AdminError)?;
    Ok(StatusCode::NO_CONTENT)
}

async fn set_tags(
    State(a): Shared,
    Path(id): Path<String>,
    Json(tags): Json<std::collections::BTreeMap<String, String>>,
) -> Result<StatusCode, AdminError> {
    a.cloud.set_tags(&id, tags).map_err(AdminError)?;
    Ok(StatusCode::NO_CONTENT)
}

async fn remove_load_balancer(State(a): Shared, Path(name): Path<String>) -> Result<StatusCode, AdminError> {
    a.cloud.remove_load_balancer(&name).map_err(AdminError)?;
    Ok(StatusCode::NO_CONTENT)
}

async fn set_load_balancer_hosts(
    State(a): Shared,
    Path(name): Path<String>,
    Json(hosts): Json<Vec<String>>,
) -> Result<StatusCode, AdminError> {
    a.cloud.set_load_balancer_hosts_by_hand(&name, hosts).map_err(AdminError)?;
    Ok(StatusCode::NO_CONTENT)
}

async fn remove_instance(State(a): Shared, Path(id): Path<String>) -> Result<StatusCode, AdminError> {
    a.cloud.remove_instance(&id).map_err(AdminError)?;
    Ok(StatusCode::NO_CONTENT)
}

async fn set_faults(State(a): Shared, Json(faults): Json<Vec<Fault>>) -> StatusCode {
    a.cloud.set_faults(faults);
    StatusCode::NO_CONTENT
}

async fn clear_faults(State(a): Shared) -> StatusCode {
    a.cloud.set_faults(Vec::new());
    StatusCode::NO_CONTENT
}

async fn set_rate_limit(State(a): Shared, Json(limit): Json<Option<RateLimit>>) -> StatusCode {
    a.cloud.set_rate_limit(limit);
    StatusCode::NO_CONTENT
}

async fn set_api(State(a): Shared, Json(api): Json<ApiConfig>) -> StatusCode {
    a.cloud.set_api(api.latency_ms, api.jitter_ms, api.consistency_delay_ms);
    StatusCode::NO_CONTENT
}

async fn metrics(State(a): Shared) -> Response {
    let mut text = String::new();
    match prometheus_client::encoding::text::encode(&mut text, &a.registry) {
        Ok(()) => ([(axum::http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], text)
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// Serves the admin API on `listen` until `shutdown` resolves.
pub async fn serve(
    admin: Arc<Admin>,
    listen: &Listen,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_router(router(admin), listen, shutdown).await
}

/// Serves an HTTP router on a unix socket (mode 0600, removed on stop) or TCP until
/// `shutdown` resolves.
pub(crate) async fn serve_router(
    app: axum::Router,
    listen: &Listen,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    use anyhow::Context;
    match listen {
        Listen::Unix(path) => {
            let listener = ccm_provider_sdk::server::bind_unix(path, 0o600)?;
            let result = axum::serve(listener, app).with_graceful_shutdown(shutdown).await;
            let _ = std::fs::remove_file(path);
            result.with_context(|| format!("http server on {listen} failed"))
        }
        Listen::Tcp(addr) => {
            let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
                .with_context(|| format!("http server on {listen} failed"))
        }
    }
}

// What the admin API answers: snapshots of the cloud.

/// A snapshot of the cloud for the admin API.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Snapshot {
    /// Every instance with its true state.
    pub instances: Vec<InstanceView>,
    /// Every table with its routes.
    pub route_tables: Vec<TableView>,
    /// Every load balancer.
    pub load_balancers: Vec<LoadBalancerView>,
}

/// An instance in a snapshot.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InstanceView {
    /// Id.
    pub id: String,
    /// Name.
    pub name: String,
    /// providerID.
    pub provider_id: String,
    /// True state.
    pub state: InstanceState,
    /// Zone.
    pub zone: String,
    /// Its tags now.
    #[serde(default)]
    pub tags: std::collections::BTreeMap<String, String>,
    /// Its pod CIDRs from the cloud.
    #[serde(default)]
    pub pod_cidrs: Vec<String>,
}

/// A route table in a snapshot.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TableView {
    /// Id.
    pub id: String,
    /// Quota.
    pub max_routes: u32,
    /// Routes that exist.
    pub routes: Vec<RouteView>,
}

/// A route in a snapshot.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RouteView {
    /// Cluster.
    pub cluster: String,
    /// Name.
    pub name: String,
    /// Destination.
    pub destination_cidr: String,
    /// Target node.
    pub node_name: String,
    /// Target providerID.
    pub provider_id: String,
    /// When it was created, in ms since the Unix epoch.
    pub created_at_unix_ms: u64,
    /// The target addresses it records (`Type=address`), when the cloud records them.
    #[serde(default)]
    pub target_addresses: Vec<String>,
}

/// A load balancer's backends in brief (`GET /load-balancers/hosts`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HostsView {
    /// Name.
    pub name: String,
    /// How many backends.
    pub hosts: usize,
    /// When its backends last changed, ms since the epoch.
    pub hosts_changed_at_unix_ms: u64,
}

/// A load balancer in a snapshot.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoadBalancerView {
    /// Name.
    pub name: String,
    /// Service namespace/name.
    pub service: String,
    /// Its address.
    pub ip: String,
    /// Backend node names, sorted.
    pub nodes: Vec<String>,
    /// Ports.
    pub ports: Vec<u32>,
    /// When its backends last changed, ms since the epoch.
    pub hosts_changed_at_unix_ms: u64,
    /// The source ranges it admits (empty: any).
    #[serde(default)]
    pub source_ranges: Vec<String>,
    /// The UID of the Service it was made for.
    #[serde(default)]
    pub service_uid: String,
    /// Each port's `appProtocol` and `targetPort`, as `port:appProtocol:targetPort`.
    #[serde(default)]
    pub port_details: Vec<String>,
    /// The Service's external IPs.
    #[serde(default)]
    pub external_ips: Vec<String>,
    /// The pods each port without a node port was given, as `port:address:podPort`.
    #[serde(default)]
    pub port_endpoints: Vec<String>,
}
