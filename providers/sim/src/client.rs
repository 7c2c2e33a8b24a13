//! A small client of the admin API, for tests and benchmarks.

use anyhow::{Context, bail};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;

use crate::admin::CallsView;
use crate::admin::{HostsView, Snapshot, TableView};
use crate::calls::CallRecord;
use crate::config::{ApiConfig, Fault, InstanceSpec, RateLimit};

/// Talks to a sim's admin API at `unix:///path.sock` or `http://host:port`.
#[derive(Debug, Clone)]
pub struct AdminClient {
    address: String,
}

impl AdminClient {
    /// A client of the admin API at `address`.
    pub fn new(address: impl Into<String>) -> Self {
        Self { address: address.into() }
    }

    async fn request(&self, method: &str, path: &str, body: Option<serde_json::Value>) -> anyhow::Result<Bytes> {
        let (status, bytes) = http_call(&self.address, method, path, body).await?;
        if !status.is_success() {
            bail!("{method} {path}: {status}: {}", String::from_utf8_lossy(&bytes));
        }
        Ok(bytes)
    }

    async fn json<T: DeserializeOwned>(&self, method: &str, path: &str, body: Option<serde_json::Value>) -> anyhow::Result<T> {
        let bytes = self.request(method, path, body).await?;
        serde_json::from_slice(&bytes).with_context(|| format!("decoding the answer of {method} {path}"))
    }

    /// The true state of the cloud.
    pub async fn state(&self) -> anyhow::Result<Snapshot> {
        self.json("GET", "/state", None).await
    }

    /// Every route table with its routes (the state without the load balancers).
    pub async fn route_tables(&self) -> anyhow::Result<Vec<TableView>> {
        self.json("GET", "/route-tables", None).await
    }

    /// Every load balancer's backend count and when its backends last changed (the state
    /// without the backend lists).
    pub async fn hosts_summary(&self) -> anyhow::Result<Vec<HostsView>> {
        self.json("GET", "/load-balancers/hosts", None).await
    }

    /// The call counters.
    pub async fn calls(&self) -> anyhow::Result<CallsView> {
        self.json("GET", "/calls", None).await
    }

    /// How many calls of `method` (like `RoutesService/ListRoutes`) were answered, any code.
    pub async fn call_count(&self, method: &str) -> anyhow::Result<u64> {
        Ok(self.calls().await?.counts.iter().filter(|c| c.method == method).map(|c| c.count).sum())
    }

    /// Resets counters and log.
    pub async fn reset_calls(&self) -> anyhow::Result<()> {
        self.request("DELETE", "/calls", None).await.map(|_| ())
    }

    /// Adds an instance; returns its providerID.
    pub async fn add_instance(&self, spec: &InstanceSpec) -> anyhow::Result<String> {
        let v: serde_json::Value = self.json("POST", "/instances", Some(serde_json::to_value(spec)?)).await?;
        Ok(v["provider_id"].as_str().unwrap_or_default().to_string())
    }

    /// `stop`, `start` or `terminate` an instance.
    pub async fn instance_action(&self, id: &str, action: &str) -> anyhow::Result<()> {
        self.request("POST", &format!("/instances/{id}/{action}"), None).await.map(|_| ())
    }

    /// Replaces an instance's addresses.
    pub async fn set_addresses(&self, id: &str, addresses: &[crate::config::Address]) -> anyhow::Result<()> {
        self.request("PUT", &format!("/instances/{id}/addresses"), Some(serde_json::to_value(addresses)?)).await.map(|_| ())
    }

    /// Replaces an instance's tags.
    pub async fn set_tags(&self, id: &str, tags: &std::collections::BTreeMap<String, String>) -> anyhow::Result<()> {
        self.request("PUT", &format!("/instances/{id}/tags"), Some(serde_json::to_value(tags)?)).await.map(|_| ())
    }

    /// Removes an instance from the account.
    pub async fn remove_instance(&self, id: &str) -> anyhow::Result<()> {
        self.request("DELETE", &format!("/instances/{id}"), None).await.map(|_| ())
    }

    /// Removes a load balancer behind the controllers' back.
    pub async fn remove_load_balancer(&self, name: &str) -> anyhow::Result<()> {
        self.request("DELETE", &format!("/load-balancers/{name}"), None).await.map(|_| ())
    }

    /// Replaces a load balancer's backends behind the controllers' back.
    pub async fn set_load_balancer_hosts(&self, name: &str, nodes: &[String]) -> anyhow::Result<()> {
        self.request("PUT", &format!("/load-balancers/{name}/hosts"), Some(serde_json::to_value(nodes)?)).await.map(|_| ())
    }

    /// Adds a route out of band.
    pub async fn add_route(&self, route: &crate::admin::RouteSpec) -> anyhow::Result<()> {
        self.request("POST", "/routes", Some(serde_json::to_value(route)?)).await.map(|_| ())
    }

    /// Replaces the injected faults.
    pub async fn set_faults(&self, faults: &[Fault]) -> anyhow::Result<()> {
        self.request("PUT", "/faults", Some(serde_json::to_value(faults)?)).await.map(|_| ())
    }

    /// Sets or removes the rate limit.
    pub async fn set_rate_limit(&self, limit: Option<RateLimit>) -> anyhow::Result<()> {
        self.request("PUT", "/rate-limit", Some(serde_json::to_value(limit)?)).await.map(|_| ())
    }

    /// Sets latency, jitter and consistency delay.
    pub async fn set_api(&self, api: &ApiConfig) -> anyhow::Result<()> {
        self.request("PUT", "/api", Some(serde_json::to_value(api)?)).await.map(|_| ())
    }

    /// The Prometheus text of `/metrics`.
    pub async fn metrics(&self) -> anyhow::Result<String> {
        Ok(String::from_utf8_lossy(&self.request("GET", "/metrics", None).await?).into_owned())
    }

    /// Every logged call, oldest first.
    pub async fn call_log(&self) -> anyhow::Result<Vec<CallRecord>> {
        self.json("GET", "/calls/log", None).await
    }
}

/// One HTTP/1 request with a JSON body to `unix:///path.sock` or `http://host:port`; the
/// status and body of the answer.
pub(crate) async fn http_call(
    address: &str,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> anyhow::Result<(hyper::StatusCode, Bytes)> {
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "sim")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))?;
    let response = if let Some(socket) = address.strip_prefix("unix://") {
        let stream = tokio::net::UnixStream::connect(socket).await.with_context(|| format!("connecting to {address}"))?;
        send(stream, request).await?
    } else {
        let hostport = address.trim_start_matches("http://").trim_start_matches("tcp://");
        let stream = tokio::net::TcpStream::connect(hostport).await.with_context(|| format!("connecting to {address}"))?;
        send(stream, request).await?
    };
    let status = response.status();
    let bytes = response.into_body().collect().await.with_context(|| format!("reading the answer of {address}"))?.to_bytes();
    Ok((status, bytes))
}

async fn send<S>(stream: S, request: hyper::Request<Full<Bytes>>) -> anyhow::Result<hyper::Response<hyper::body::Incoming>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.context("http handshake")?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    sender.send_request(request).await.context("http request")
}
