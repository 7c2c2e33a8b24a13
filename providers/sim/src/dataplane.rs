//! The sim's data plane: load balancers that carry traffic (opt-in, `[dataplane]` in the
//! sim's config).
//!
//! A cloud has a control plane (its API: here the sim) and a data plane (the machines that
//! forward packets). The sim keeps both apart in the same way: after every load balancer
//! write that changed the cloud, the sim pushes the whole desired state (every load
//! balancer's address, listeners, backend addresses, source ranges and health check) to the
//! data plane agent, `ccm-provider-sim dataplane`, which runs on the cloud's side of the
//! cluster network (the harness starts it in a network namespace of its own, attached to the
//! nodes' network and, through a second link, to the "outside" the clients come from).
//! The write answers only once the agent has applied the state, so a load balancer the core
//! reports ready carries traffic; an agent that cannot be reached fails the write with
//! UNAVAILABLE, and the core retries it.
//!
//! The agent forwards with the kernel (nftables), as a cloud's passthrough (layer-4) load
//! balancer does:
//! - each load balancer's address is put on an interface of the agent's namespace (`lo` by
//!   default, as /32s: the namespace answers for it, whatever routes it there), and packets to a
//!   listener (protocol and port) are DNATed to a healthy backend's node port (random per
//!   connection, or by a hash of the client address for `ClientIP` session affinity), so the
//!   client's address reaches the node (what `externalTrafficPolicy: Local` needs);
//! - `loadBalancerSourceRanges` drop every other source before the DNAT;
//! - connections already open keep their backend when it is removed (conntrack keeps the
//!   translation): a removed backend finishes its open TCP connections, as clouds drain. UDP
//!   has no end to wait for: the agent deletes the removed backend's UDP flows, so that the
//!   client's next datagram goes to a backend that is still there;
//! - a deleted load balancer, or a listener it no longer has, loses its flows at once;
//! - clients inside the nodes' network are masqueraded (hairpin), so their answers come back
//!   through the load balancer;
//! - backends are health-checked over HTTP: `healthCheckNodePort` `/healthz` for
//!   `externalTrafficPolicy: Local` (kube-proxy answers 200 only where the Service has a
//!   ready endpoint), kube-proxy's `:10256/healthz` otherwise (KEP-3836). A backend leaves
//!   after two failed checks and comes back after one good one; when none is healthy, all
//!   are used (fail open, as AWS's and Google's load balancers do).
//!
//! Why the kernel and not a userspace proxy: a proxy ends the client's connection and opens
//! its own, so the backend sees the proxy's address (the `Local` policy's source-IP test
//! fails) and every byte crosses user space twice; with DNAT the packets keep their source,
//! draining comes with conntrack, and a rule change is one atomic `nft -f` transaction.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

use crate::client::http_call;

/// The port of kube-proxy's health server, checked for `externalTrafficPolicy: Cluster`.
pub const KUBE_PROXY_HEALTH_PORT: u16 = 10256;

/// `[dataplane]` in the sim's config.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DataplaneConfig {
    /// The agent (`ccm-provider-sim dataplane --listen`): `http://host:port`.
    pub endpoint: String,
    /// The ipMode the sim reports on its ingress points: `VIP` (kube-proxy sends in-cluster
    /// traffic to the Service directly) or `Proxy` (in-cluster traffic goes through the load
    /// balancer too).
    pub ip_mode: IpMode,
    /// How long a push to the agent may take, in milliseconds.
    pub timeout_ms: u64,
}

impl Default for DataplaneConfig {
    fn default() -> Self {
        Self { endpoint: String::new(), ip_mode: IpMode::Vip, timeout_ms: 10_000 }
    }
}

/// status.loadBalancer.ingress[].ipMode.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
pub enum IpMode {
    /// `VIP`.
    #[default]
    #[serde(rename = "VIP")]
    Vip,
    /// `Proxy`.
    Proxy,
}

/// A transport protocol of a listener.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
    /// SCTP.
    Sctp,
}

impl Protocol {
    fn nft(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
            Self::Sctp => "sctp",
        }
    }
}

/// One listener: traffic to `port` goes to each backend's `node_port`, or, for a Service
/// port without a node port, straight to its pods (`targets`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct Listener {
    /// The protocol.
    pub protocol: Protocol,
    /// The load balancer's port.
    pub port: u16,
    /// The backends' port; 0 when the Service port has none.
    pub node_port: u16,
    /// The pods (address and port) when `node_port` is 0.
    #[serde(default)]
    pub targets: Vec<(IpAddr, u16)>,
}

impl Listener {
    /// Where this listener forwards, given the load balancer's serving backends.
    fn destinations(&self, backends: &[IpAddr]) -> Vec<(IpAddr, u16)> {
        if self.node_port != 0 {
            return backends.iter().map(|b| (*b, self.node_port)).collect();
        }
        let mut targets: Vec<(IpAddr, u16)> = self.targets.iter().copied().filter(|(ip, _)| ip.is_ipv4()).collect();
        targets.sort();
        targets.dedup();
        targets
    }
}

/// One load balancer as the data plane needs it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LoadBalancerSpec {
    /// The load balancer's name.
    pub name: String,
    /// Its address.
    pub address: IpAddr,
    /// Its listeners.
    pub listeners: Vec<Listener>,
    /// The backends' addresses (the Nodes' InternalIPs).
    pub backends: Vec<IpAddr>,
    /// Allowed client CIDRs; empty allows every client.
    pub source_ranges: Vec<String>,
    /// The health check's port (HTTP `GET /healthz`).
    pub health_check_port: u16,
    /// `ClientIP` session affinity: a client keeps its backend.
    pub client_ip_affinity: bool,
}

/// Everything the data plane forwards.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct DesiredState {
    /// Every load balancer, by name.
    pub load_balancers: Vec<LoadBalancerSpec>,
}

/// The agent's answer to `GET /state`: the desired state and what each check found.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AgentView {
    /// The state last pushed.
    pub desired: DesiredState,
    /// Each checked backend (`address:port`) and whether it is healthy.
    pub health: BTreeMap<String, bool>,
    /// How many times the rules were written.
    pub applies: u64,
    /// What the rules written forward now: each load balancer address with the backend
    /// addresses it sends to.
    #[serde(default)]
    pub forwarding: BTreeMap<String, BTreeSet<String>>,
}

/// The sim's side: pushes the desired state to the agent, one push at a time, each carrying
/// the state as it is when the push starts (so the last push carries the latest state).
#[derive(Debug)]
pub struct Pusher {
    endpoint: String,
    timeout: Duration,
    lock: tokio::sync::Mutex<()>,
}

impl Pusher {
    /// A pusher to `config.endpoint`.
    pub fn new(config: &DataplaneConfig) -> anyhow::Result<Self> {
        if !config.endpoint.starts_with("http://") {
            bail!("[dataplane] endpoint must be http://host:port, not {:?}", config.endpoint);
        }
        Ok(Self {
            endpoint: config.endpoint.clone(),
            timeout: Duration::from_millis(config.timeout_ms.max(1)),
            lock: tokio::sync::Mutex::new(()),
        })
    }

    /// Pushes what `state` reads (called after taking the push lock).
    pub async fn push(&self, state: impl FnOnce() -> DesiredState) -> anyhow::Result<()> {
        let _one_at_a_time = self.lock.lock().await;
        let body = serde_json::to_value(state()).context("encoding the data plane state")?;
        let (status, answer) = tokio::time::timeout(self.timeout, http_call(&self.endpoint, "PUT", "/state", Some(body)))
            .await
            .with_context(|| format!("the data plane at {} did not answer within {:?}", self.endpoint, self.timeout))??;
        if !status.is_success() {
            bail!("the data plane at {} refused the state: {status}: {}", self.endpoint, String::from_utf8_lossy(&answer));
        }
        Ok(())
    }
}

/// The agent's command line (`ccm-provider-sim dataplane`).
#[derive(Debug, Clone, clap::Args)]
pub struct AgentArgs {
    /// Where the sim pushes its load balancers (`PUT /state`): host:port.
    #[arg(long, value_name = "ADDRESS")]
    pub listen: SocketAddr,
    /// The interface the load balancers' addresses go on, as /32s (a dummy interface is made
    /// when one of this name is missing).
    #[arg(long, value_name = "NAME", default_value = "lo")]
    pub interface: String,
    /// A client CIDR inside the nodes' network, masqueraded so that answers come back
    /// through the load balancer (repeat for several).
    #[arg(long, value_name = "CIDR")]
    pub masquerade: Vec<ipnet::Ipv4Net>,
    /// The nftables table the agent owns.
    #[arg(long, value_name = "NAME", default_value = "ccm_sim_lb")]
    pub table: String,
    /// How often backends are health-checked, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 1000)]
    pub check_interval_ms: u64,
}

impl AgentArgs {
    /// The options these arguments give.
    pub fn options(&self) -> AgentOptions {
        AgentOptions {
            listen: self.listen,
            interface: self.interface.clone(),
            masquerade: self.masquerade.iter().map(ToString::to_string).collect(),
            table: self.table.clone(),
            check_interval: Duration::from_millis(self.check_interval_ms.max(100)),
            check_timeout: Duration::from_millis(self.check_interval_ms.clamp(100, 1000)),
        }
    }
}

/// `ccm-provider-sim echo`'s command line.
#[derive(Debug, Clone, clap::Args)]
pub struct EchoArgs {
    /// Where to answer HTTP: host:port.
    #[arg(long, value_name = "ADDRESS", default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,
}

/// A backend to try load balancers with: every HTTP request is answered with the host it
/// runs on (`$POD_NAME`, else `$HOSTNAME`) and the client's address, as `<host> <client>`.
pub async fn echo(listen: SocketAddr, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
    let host = std::env::var("POD_NAME").or_else(|_| std::env::var("HOSTNAME")).unwrap_or_else(|_| "unknown".into());
    let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("binding {listen}"))?;
    let app = axum::Router::new().fallback(move |axum::extract::ConnectInfo(client): axum::extract::ConnectInfo<SocketAddr>| {
        let host = host.clone();
        async move { format!("{host} {client}\n") }
    });
    tracing::info!(%listen, "echoing");
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
        .with_graceful_shutdown(shutdown)
        .await
        .context("serving echo")
}

/// How the agent runs.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// Where to serve `PUT /state` and `GET /state`.
    pub listen: SocketAddr,
    /// The interface the load balancers' addresses go on (a dummy one is made when it is
    /// missing and the kernel has the dummy driver).
    pub interface: String,
    /// Client CIDRs inside the nodes' network, masqueraded so that answers come back through
    /// the load balancer.
    pub masquerade: Vec<String>,
    /// The nftables table the agent owns (`ip` family).
    pub table: String,
    /// How often backends are checked.
    pub check_interval: Duration,
    /// How long one check may take.
    pub check_timeout: Duration,
}

/// A backend's health: consecutive failures, and whether it was ever checked good.
#[derive(Debug, Clone, Copy, Default)]
struct Health {
    failures: u32,
    checked: bool,
}

impl Health {
    const UNHEALTHY_AFTER: u32 = 2;

    fn healthy(&self) -> bool {
        self.failures < Self::UNHEALTHY_AFTER
    }
}

#[derive(Debug, Default)]
struct AgentState {
    desired: DesiredState,
    health: HashMap<(IpAddr, u16), Health>,
    /// The rules last written, to skip writing the same again.
    written: Option<String>,
    /// (load balancer address, protocol, port, backend) of every forwarding written.
    forwarding: BTreeSet<(IpAddr, Protocol, u16, IpAddr)>,
    applies: u64,
}

type Shared = Arc<Mutex<AgentState>>;

fn lock(state: &Shared) -> std::sync::MutexGuard<'_, AgentState> {
    state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Runs the agent until `shutdown` resolves, then removes its rules and addresses.
pub async fn run_agent(options: AgentOptions, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
    let options = Arc::new(options);
    ensure_interface(&options.interface).await?;
    let state: Shared = Arc::default();
    // Start from nothing: rules or addresses of an agent before this one are not ours to keep.
    apply(&options, &state).await?;
    let listener = tokio::net::TcpListener::bind(options.listen).await.with_context(|| format!("binding {}", options.listen))?;
    tracing::info!(listen = %options.listen, interface = %options.interface, "serving the load balancer data plane");

    let checker = {
        let (options, state) = (options.clone(), state.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(options.check_interval).await;
                check_all(&options, &state).await;
                if let Err(error) = apply(&options, &state).await {
                    tracing::warn!(error = %format!("{error:#}"), "applying the data plane rules after health checks");
                }
            }
        })
    };
    let app = {
        use axum::routing::get;
        let (put_options, put_state, get_state) = (options.clone(), state.clone(), state.clone());
        axum::Router::new().route("/healthz", get(|| async { "ok" })).route(
            "/state",
            get(move || {
                let state = get_state.clone();
                async move { axum::Json(view(&state)) }
            })
            .put(move |axum::Json(desired): axum::Json<DesiredState>| {
                let (options, state) = (put_options.clone(), put_state.clone());
                async move { put(&options, &state, desired).await }
            }),
        )
    };
    let served = axum::serve(listener, app).with_graceful_shutdown(shutdown).await;
    checker.abort();
    lock(&state).desired = DesiredState::default();
    let cleaned = apply(&options, &state).await;
    served.context("serving the data plane")?;
    cleaned
}

fn view(state: &Shared) -> AgentView {
    let s = lock(state);
    AgentView {
        desired: s.desired.clone(),
        health: s.health.iter().map(|((ip, port), h)| (SocketAddr::new(*ip, *port).to_string(), h.healthy())).collect(),
        applies: s.applies,
        forwarding: s.forwarding.iter().fold(BTreeMap::new(), |mut m, (address, _, _, backend)| {
            m.entry(address.to_string()).or_insert_with(BTreeSet::new).insert(backend.to_string());
            m
        }),
    }
}

async fn put(options: &AgentOptions, state: &Shared, desired: DesiredState) -> (axum::http::StatusCode, String) {
    if let Err(error) = validate(&desired) {
        return (axum::http::StatusCode::BAD_REQUEST, format!("{error:#}"));
    }
    // Backends not checked before are checked once now, so that a new load balancer starts
    // with the backends that answer.
    let new: Vec<(IpAddr, u16)> = {
        let mut s = lock(state);
        let wanted = checks(&desired);
        s.health.retain(|k, _| wanted.contains(k));
        let new = wanted.into_iter().filter(|k| !s.health.contains_key(k)).collect();
        s.desired = desired;
        new
    };
    let results = check_each(&new, options.check_timeout).await;
    {
        let mut s = lock(state);
        for (key, ok) in new.into_iter().zip(results) {
            let h = s.health.entry(key).or_default();
            record(h, ok);
        }
    }
    match apply(options, state).await {
        Ok(()) => (axum::http::StatusCode::OK, "applied".into()),
        Err(error) => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, format!("{error:#}")),
    }
}

fn record(h: &mut Health, ok: bool) {
    if ok {
        *h = Health { failures: 0, checked: true };
    } else {
        // An unchecked backend that fails its first check is unhealthy at once.
        h.failures = if h.checked { h.failures + 1 } else { Health::UNHEALTHY_AFTER };
    }
}

/// Checks every (backend, port) at once; the answers in the same order.
async fn check_each(keys: &[(IpAddr, u16)], timeout: Duration) -> Vec<bool> {
    let mut set = tokio::task::JoinSet::new();
    for (i, &(ip, port)) in keys.iter().enumerate() {
        set.spawn(async move { (i, check(ip, port, timeout).await) });
    }
    let mut results = vec![false; keys.len()];
    while let Some(joined) = set.join_next().await {
        if let Ok((i, ok)) = joined {
            results[i] = ok;
        }
    }
    results
}

fn validate(desired: &DesiredState) -> anyhow::Result<()> {
    let mut addresses = BTreeSet::new();
    for lb in &desired.load_balancers {
        if !lb.address.is_ipv4() {
            bail!("load balancer {}: only IPv4 addresses are forwarded, not {}", lb.name, lb.address);
        }
        if !addresses.insert(lb.address) {
            bail!("load balancer {}: address {} is used twice", lb.name, lb.address);
        }
        for range in &lb.source_ranges {
            let net: ipnet::IpNet =
                range.parse().with_context(|| format!("load balancer {}: source range {range:?}", lb.name))?;
            if !matches!(net, ipnet::IpNet::V4(_)) {
                // An IPv6 range cannot match an IPv4 client: it allows nobody here.
                continue;
            }
        }
    }
    Ok(())
}

/// The (backend, port) pairs to check.
fn checks(desired: &DesiredState) -> BTreeSet<(IpAddr, u16)> {
    desired.load_balancers.iter().flat_map(|lb| lb.backends.iter().map(move |b| (*b, lb.health_check_port))).collect()
}

async fn check(ip: IpAddr, port: u16, timeout: Duration) -> bool {
    let address = format!("http://{}", SocketAddr::new(ip, port));
    matches!(
        tokio::time::timeout(timeout, http_call(&address, "GET", "/healthz", None)).await,
        Ok(Ok((status, _))) if status.is_success()
    )
}

async fn check_all(options: &AgentOptions, state: &Shared) {
    let keys: Vec<(IpAddr, u16)> = checks(&lock(state).desired).into_iter().collect();
    let results = check_each(&keys, options.check_timeout).await;
    let mut s = lock(state);
    for (key, ok) in keys.into_iter().zip(results) {
        // A push may have removed it meanwhile.
        if let Some(h) = s.health.get_mut(&key) {
            let was = h.healthy();
            record(h, ok);
            if was != h.healthy() {
                tracing::info!(backend = %SocketAddr::new(key.0, key.1), healthy = h.healthy(), "backend health changed");
            }
        }
    }
}

/// The backends a load balancer forwards to now: the healthy ones, or all when none is.
fn serving(lb: &LoadBalancerSpec, health: &HashMap<(IpAddr, u16), Health>) -> Vec<IpAddr> {
    let mut backends: Vec<IpAddr> = lb.backends.iter().copied().filter(|b| b.is_ipv4()).collect();
    backends.sort();
    backends.dedup();
    let healthy: Vec<IpAddr> =
        backends.iter().copied().filter(|b| health.get(&(*b, lb.health_check_port)).is_none_or(Health::healthy)).collect();
    if healthy.is_empty() { backends } else { healthy }
}

/// The nftables ruleset for `desired` (one transaction: the table is replaced whole).
pub fn ruleset(
    table: &str,
    desired: &DesiredState,
    health_of: &dyn Fn(&LoadBalancerSpec) -> Vec<IpAddr>,
    masquerade: &[String],
) -> String {
    let mut filter = String::new();
    let mut nat = String::new();
    for lb in &desired.load_balancers {
        let a = lb.address;
        if !lb.source_ranges.is_empty() {
            let v4: Vec<&str> = lb
                .source_ranges
                .iter()
                .map(String::as_str)
                .filter(|r| matches!(r.parse::<ipnet::IpNet>(), Ok(ipnet::IpNet::V4(_))))
                .collect();
            if v4.is_empty() {
                filter.push_str(&format!("    ip daddr {a} drop\n"));
            } else {
                filter.push_str(&format!("    ip daddr {a} ip saddr != {{ {} }} drop\n", v4.join(", ")));
            }
        }
        let backends = health_of(lb);
        for l in &lb.listeners {
            let destinations = l.destinations(&backends);
            if destinations.is_empty() {
                continue;
            }
            let map: Vec<String> =
                destinations.iter().enumerate().map(|(i, (ip, port))| format!("{i} : {ip} . {port}")).collect();
            let pick = if lb.client_ip_affinity {
                format!("jhash ip saddr mod {} seed 0x5eed", destinations.len())
            } else {
                format!("numgen random mod {}", destinations.len())
            };
            nat.push_str(&format!(
                "    ip daddr {a} {} dport {} dnat ip to {pick} map {{ {} }}\n",
                l.protocol.nft(),
                l.port,
                map.join(", ")
            ));
        }
    }
    let masq = if masquerade.is_empty() {
        String::new()
    } else {
        format!("    ct status dnat ip saddr {{ {} }} masquerade\n", masquerade.join(", "))
    };
    format!(
        "table ip {table}\ndelete table ip {table}\ntable ip {table} {{\n  chain source_ranges {{\n    type filter hook prerouting priority -150; policy accept;\n{filter}  }}\n  \
         chain forward {{\n    type nat hook prerouting priority dstnat; policy accept;\n{nat}  }}\n  \
         chain hairpin {{\n    type nat hook postrouting priority srcnat; policy accept;\n{masq}  }}\n}}\n"
    )
}

/// Writes the rules and addresses for the current state (nothing when unchanged), and
/// deletes the flows that must not survive the change.
async fn apply(options: &AgentOptions, state: &Shared) -> anyhow::Result<()> {
    let (rules, forwarding, addresses, previous) = {
        let s = lock(state);
        let health = &s.health;
        let serve = |lb: &LoadBalancerSpec| serving(lb, health);
        let rules = ruleset(&options.table, &s.desired, &serve, &options.masquerade);
        if s.written.as_deref() == Some(rules.as_str()) {
            return Ok(());
        }
        let mut forwarding = BTreeSet::new();
        for lb in &s.desired.load_balancers {
            let backends = serve(lb);
            for l in &lb.listeners {
                for (ip, _) in l.destinations(&backends) {
                    forwarding.insert((lb.address, l.protocol, l.port, ip));
                }
            }
        }
        let addresses: BTreeSet<IpAddr> = s.desired.load_balancers.iter().map(|lb| lb.address).collect();
        (rules, forwarding, addresses, s.forwarding.clone())
    };
    run_with_input("nft", &["-f", "-"], &rules).await.context("writing the nftables rules")?;
    set_addresses(&options.interface, &addresses).await?;
    // Flows that must end: every flow of a listener or load balancer that is gone, and the
    // UDP flows of a removed backend. TCP flows of a removed backend drain.
    let listeners: BTreeSet<(IpAddr, Protocol, u16)> = forwarding.iter().map(|(a, p, port, _)| (*a, *p, *port)).collect();
    for gone in previous.difference(&forwarding) {
        let (address, protocol, port, backend) = *gone;
        let listener_gone = !listeners.contains(&(address, protocol, port));
        if listener_gone || protocol == Protocol::Udp {
            let mut args = vec!["-D".to_string(), "-p".into(), protocol.nft().into()];
            args.extend(["--orig-dst".into(), address.to_string(), "--dport".into(), port.to_string()]);
            if !listener_gone {
                args.extend(["--reply-src".into(), backend.to_string()]);
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            // conntrack exits 1 when there was nothing to delete.
            let _ = run_with_input("conntrack", &args, "").await;
        }
    }
    let mut s = lock(state);
    s.written = Some(rules);
    s.forwarding = forwarding;
    s.applies += 1;
    Ok(())
}

async fn run_with_input(program: &str, args: &[&str], input: &str) -> anyhow::Result<String> {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {program}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(input.as_bytes()).await.with_context(|| format!("writing to {program}"))?;
    }
    let out = child.wait_with_output().await.with_context(|| format!("waiting for {program}"))?;
    if !out.status.success() {
        bail!("{program} {} failed ({}): {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

async fn ensure_interface(name: &str) -> anyhow::Result<()> {
    if run_with_input("ip", &["link", "show", "dev", name], "").await.is_err() {
        run_with_input("ip", &["link", "add", name, "type", "dummy"], "")
            .await
            .with_context(|| format!("making interface {name}"))?;
    }
    run_with_input("ip", &["link", "set", name, "up"], "").await.with_context(|| format!("bringing {name} up"))?;
    Ok(())
}

/// Makes `interface` carry exactly `addresses` as /32s of the agent's label
/// (`<interface>:lb`): the interface's other addresses are not the agent's to touch.
async fn set_addresses(interface: &str, addresses: &BTreeSet<IpAddr>) -> anyhow::Result<()> {
    let label = format!("{interface}:lb");
    let listed = run_with_input("ip", &["-4", "-o", "addr", "show", "dev", interface, "label", &label], "").await?;
    let present: BTreeSet<IpAddr> = listed
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            words.find(|w| *w == "inet")?;
            words.next()?.split('/').next()?.parse().ok()
        })
        .collect();
    for gone in present.difference(addresses) {
        let cidr = format!("{gone}/32");
        run_with_input("ip", &["addr", "del", &cidr, "dev", interface], "").await?;
    }
    for new in addresses.difference(&present) {
        let cidr = format!("{new}/32");
        run_with_input("ip", &["addr", "add", &cidr, "dev", interface, "label", &label], "").await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lb(name: &str, address: &str, backends: &[&str]) -> LoadBalancerSpec {
        LoadBalancerSpec {
            name: name.into(),
            address: address.parse().expect("ip"),
            listeners: vec![
                Listener { protocol: Protocol::Tcp, port: 80, node_port: 30080, targets: Vec::new() },
                Listener { protocol: Protocol::Udp, port: 53, node_port: 30053, targets: Vec::new() },
            ],
            backends: backends.iter().map(|b| b.parse().expect("ip")).collect(),
            source_ranges: Vec::new(),
            health_check_port: KUBE_PROXY_HEALTH_PORT,
            client_ip_affinity: false,
        }
    }

    #[test]
    fn rules_forward_each_listener_to_every_serving_backend() {
        let mut a = lb("a", "10.252.1.1", &["10.250.1.11", "10.250.1.10"]);
        a.client_ip_affinity = true;
        let mut b = lb("b", "10.252.1.2", &["10.250.1.10"]);
        b.source_ranges = vec!["10.0.0.0/8".into(), "fd00::/8".into()];
        let desired = DesiredState { load_balancers: vec![a.clone(), b] };
        let none = HashMap::new();
        let rules = ruleset("t", &desired, &|lb| serving(lb, &none), &["10.250.1.0/24".into()]);
        assert!(
            rules.contains(
                "ip daddr 10.252.1.1 tcp dport 80 dnat ip to jhash ip saddr mod 2 seed 0x5eed map { 0 : 10.250.1.10 . 30080, 1 : 10.250.1.11 . 30080 }"
            ),
            "{rules}"
        );
        assert!(
            rules.contains("ip daddr 10.252.1.2 udp dport 53 dnat ip to numgen random mod 1 map { 0 : 10.250.1.10 . 30053 }"),
            "{rules}"
        );
        assert!(rules.contains("ip daddr 10.252.1.2 ip saddr != { 10.0.0.0/8 } drop"), "{rules}");
        assert!(!rules.contains("ip daddr 10.252.1.1 ip saddr"), "no ranges, no filter: {rules}");
        assert!(rules.contains("ct status dnat ip saddr { 10.250.1.0/24 } masquerade"), "{rules}");
        assert!(rules.starts_with("table ip t\ndelete table ip t\n"), "replaced whole: {rules}");

        // A port without a node port goes to its pods.
        let mut d = lb("d", "10.252.1.4", &["10.250.1.10"]);
        d.listeners = vec![Listener {
            protocol: Protocol::Tcp,
            port: 80,
            node_port: 0,
            targets: vec![("10.244.2.7".parse().expect("ip"), 8080), ("10.244.1.3".parse().expect("ip"), 8080)],
        }];
        let rules = ruleset("t", &DesiredState { load_balancers: vec![d] }, &|lb| serving(lb, &none), &[]);
        assert!(
            rules.contains("ip daddr 10.252.1.4 tcp dport 80 dnat ip to numgen random mod 2 map { 0 : 10.244.1.3 . 8080, 1 : 10.244.2.7 . 8080 }"),
            "{rules}"
        );

        // Only an IPv6 range: nobody IPv4 is allowed.
        let mut c = lb("c", "10.252.1.3", &["10.250.1.10"]);
        c.source_ranges = vec!["::/0".into()];
        let rules = ruleset("t", &DesiredState { load_balancers: vec![c] }, &|lb| serving(lb, &none), &[]);
        assert!(rules.contains("ip daddr 10.252.1.3 drop"), "{rules}");
    }

    #[test]
    fn unhealthy_backends_leave_and_all_serve_when_none_is_healthy() {
        let a = lb("a", "10.252.1.1", &["10.250.1.10", "10.250.1.11"]);
        let mut health = HashMap::new();
        let ten: IpAddr = "10.250.1.10".parse().expect("ip");
        let eleven: IpAddr = "10.250.1.11".parse().expect("ip");
        let mut h = Health::default();
        record(&mut h, true);
        record(&mut h, false);
        assert!(h.healthy(), "one failure after a good check is not enough");
        record(&mut h, false);
        assert!(!h.healthy());
        health.insert((ten, KUBE_PROXY_HEALTH_PORT), h);
        assert_eq!(serving(&a, &health), vec![eleven]);
        let mut first = Health::default();
        record(&mut first, false);
        assert!(!first.healthy(), "a backend failing its first check starts unhealthy");
        health.insert((eleven, KUBE_PROXY_HEALTH_PORT), first);
        assert_eq!(serving(&a, &health), vec![ten, eleven], "fail open");
    }

    #[test]
    fn bad_states_are_refused() {
        let dup = DesiredState { load_balancers: vec![lb("a", "10.252.1.1", &[]), lb("b", "10.252.1.1", &[])] };
        assert!(validate(&dup).is_err());
        let mut bad = lb("a", "10.252.1.1", &[]);
        bad.source_ranges = vec!["not-a-cidr".into()];
        assert!(validate(&DesiredState { load_balancers: vec![bad] }).is_err());
        assert!(validate(&DesiredState { load_balancers: vec![lb("v6", "fd00::1", &[])] }).is_err());
    }
}
