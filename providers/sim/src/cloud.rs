//! The simulated cloud: inventory, route tables, load balancers and address pool, behind an
//! API gate that adds latency, rate limits and injected faults, with eventual consistency
//! between writes and reads.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ccm_provider_sdk::error::reason;
use ccm_provider_sdk::proto as pb;
use ccm_provider_sdk::ratelimit::TokenBucket;
use ccm_provider_sdk::{Error, Result};
use ipnet::IpNet;
use tokio::time::Instant;

use crate::admin::{HostsView, InstanceView, LoadBalancerView, RouteView, Snapshot, TableView};
use crate::config::{Address, Answer, ApiConfig, Config, Fault, FaultCode, InstanceSpec, Lie, RateLimit, RouteTableSpec, State};

/// The providerID scheme of the sim unless its configuration names another.
pub const DEFAULT_SCHEME: &str = "sim";

/// A value whose changes show in reads only after the consistency delay.
#[derive(Debug, Clone)]
struct Lagged<T> {
    current: T,
    previous: Option<(T, Instant)>,
}

impl<T: Clone> Lagged<T> {
    fn new(value: T, before: T, delay: Duration) -> Self {
        let mut l = Self { current: before, previous: None };
        l.set(value, delay);
        l
    }

    fn seen(&self) -> T {
        match &self.previous {
            Some((prev, until)) if Instant::now() < *until => prev.clone(),
            _ => self.current.clone(),
        }
    }

    fn set(&mut self, value: T, delay: Duration) {
        self.previous = (!delay.is_zero()).then(|| (self.seen(), Instant::now() + delay));
        self.current = value;
    }

    fn settled(&self) -> bool {
        self.previous.as_ref().is_none_or(|(_, until)| Instant::now() >= *until)
    }
}

#[derive(Debug, Clone)]
struct Instance {
    spec: InstanceSpec,
    /// None: not there (before creation shows, or removed).
    state: Lagged<Option<State>>,
}

impl Instance {
    fn provider_id(&self, scheme: &str) -> String {
        format!("{scheme}://{}/{}", self.spec.zone, self.spec.id)
    }

    fn metadata(&self, scheme: &str, region: &str, state: State, with_tags: bool) -> pb::InstanceMetadata {
        let addresses = self
            .spec
            .addresses
            .iter()
            .map(|a| pb::NodeAddress { r#type: address_type(&a.kind) as i32, address: a.address.clone() })
            .collect();
        pb::InstanceMetadata {
            provider_id: self.provider_id(scheme),
            instance_id: self.spec.id.clone(),
            instance_type: self.spec.instance_type.clone(),
            zone: self.spec.zone.clone(),
            region: region.to_string(),
            addresses,
            hostname: self.spec.name.clone(),
            additional_labels: self.spec.labels.clone().into_iter().collect(),
            state: instance_state(state) as i32,
            node_name: self.spec.name.clone(),
            tags: if with_tags {
                self.spec.tags.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
            } else {
                Default::default()
            },
            pod_cidrs: self.spec.pod_cidrs.clone(),
        }
    }
}

/// The `n`th pod CIDR of each pool: an instance's pod CIDRs.
fn pod_cidrs_of(config: &crate::config::PodCidrConfig, n: u32) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for pool in &config.pools {
        let pool: IpNet = pool.parse().map_err(|_| Error::invalid_argument(format!("pod CIDR pool {pool:?} is not a CIDR")))?;
        let mask = if pool.addr().is_ipv4() { config.mask_v4 } else { config.mask_v6 };
        let cidr = pool
            .subnets(mask)
            .ok()
            .and_then(|mut s| s.nth(n as usize))
            .ok_or_else(|| Error::QuotaExceeded { message: format!("pod CIDR pool {pool} has no /{mask} left") })?;
        out.push(cidr.to_string());
    }
    Ok(out)
}

pub(crate) fn address_type(kind: &str) -> pb::NodeAddressType {
    match kind {
        "Hostname" => pb::NodeAddressType::Hostname,
        "InternalIP" => pb::NodeAddressType::InternalIp,
        "ExternalIP" => pb::NodeAddressType::ExternalIp,
        "InternalDNS" => pb::NodeAddressType::InternalDns,
        "ExternalDNS" => pb::NodeAddressType::ExternalDns,
        _ => pb::NodeAddressType::Unspecified,
    }
}

/// The Kubernetes name of an address type; empty for an unspecified one.
pub(crate) fn address_type_name(t: pb::NodeAddressType) -> &'static str {
    match t {
        pb::NodeAddressType::Hostname => "Hostname",
        pb::NodeAddressType::InternalIp => "InternalIP",
        pb::NodeAddressType::ExternalIp => "ExternalIP",
        pb::NodeAddressType::InternalDns => "InternalDNS",
        pb::NodeAddressType::ExternalDns => "ExternalDNS",
        pb::NodeAddressType::Unspecified => "",
    }
}

fn instance_state(s: State) -> pb::InstanceState {
    match s {
        State::Pending => pb::InstanceState::Pending,
        State::Running => pb::InstanceState::Running,
        State::Stopped => pb::InstanceState::Stopped,
        State::Terminated => pb::InstanceState::Terminated,
    }
}

#[derive(Debug, Clone)]
struct RouteRecord {
    route: pb::Route,
    exists: Lagged<bool>,
    /// When it was (last) created, in ms since the Unix epoch: benchmarks measure from it.
    created_at_unix_ms: u64,
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

#[derive(Debug, Clone)]
struct Table {
    spec: RouteTableSpec,
    /// Keyed by (cluster, route name).
    routes: BTreeMap<(String, String), RouteRecord>,
}

#[derive(Debug, Clone)]
struct LoadBalancer {
    service: pb::LoadBalancerService,
    /// Shared with every load balancer of the same backends (at 5000 load balancers of 5000
    /// Nodes, a list each would be 25 million names).
    nodes: Arc<Vec<String>>,
    ip: IpAddr,
    exists: Lagged<bool>,
    /// When its backends last changed (Ensure or UpdateLoadBalancerHosts), ms since the epoch.
    hosts_changed_at_unix_ms: u64,
}

#[derive(Debug)]
struct World {
    instances: BTreeMap<String, Instance>,
    tables: Vec<Table>,
    load_balancers: BTreeMap<String, LoadBalancer>,
    /// The backend list last set, shared by the load balancers given the same.
    last_hosts: Arc<Vec<String>>,
    /// Each backend Node's address, when the data plane needs it (kept from the nodes
    /// given to load balancer writes).
    node_ips: Option<HashMap<String, IpAddr>>,
    pool: Vec<IpNet>,
    next_internal: u32,
    /// The index of the next pod CIDR of each `[pod_cidrs]` pool.
    next_pod_cidr: u32,
}

impl World {
    /// The sorted backend names of `nodes` (`names`, from [`sorted_names`]), the list last set
    /// when it is the same: at 20,000 Nodes a copy per call was most of the sim's work.
    fn hosts(&mut self, names: &[&str], nodes: &[pb::LoadBalancerNode]) -> Arc<Vec<String>> {
        if let Some(ips) = &mut self.node_ips {
            for node in nodes {
                let v4 = |t: pb::NodeAddressType| {
                    node.addresses
                        .iter()
                        .filter(move |a| a.r#type() == t)
                        .find_map(|a| a.address.parse::<std::net::Ipv4Addr>().ok())
                };
                if let Some(ip) = v4(pb::NodeAddressType::InternalIp).or_else(|| v4(pb::NodeAddressType::ExternalIp)) {
                    ips.insert(node.name.clone(), IpAddr::V4(ip));
                }
            }
        }
        if !self.last_hosts.iter().map(String::as_str).eq(names.iter().copied()) {
            self.last_hosts = Arc::new(names.iter().map(|n| (*n).to_owned()).collect());
        }
        self.last_hosts.clone()
    }
}

/// The names of `nodes`, sorted: computed before the world is locked.
fn sorted_names(nodes: &[pb::LoadBalancerNode]) -> Vec<&str> {
    let mut names: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
    names.sort_unstable();
    names
}

/// Whether two backend lists are the same (most often the very same list, shared).
fn same_hosts(a: &Arc<Vec<String>>, b: &Arc<Vec<String>>) -> bool {
    Arc::ptr_eq(a, b) || a == b
}

#[derive(Debug)]
struct Gate {
    api: ApiConfig,
    limiter: Option<TokenBucket>,
    faults: Vec<Fault>,
}

/// The simulated cloud.
#[derive(Debug)]
pub struct Cloud {
    region: String,
    /// The providerIDs' scheme.
    scheme: String,
    /// The load balancer classes advertised.
    classes: Vec<String>,
    ipv6_routes: bool,
    route_target_addresses: bool,
    bulk_routes: bool,
    bulk_hosts: bool,
    /// Whether load balancers are listed (`[load_balancers] list`).
    list_load_balancers: bool,
    /// Whether reads report load balancers' backends (`[load_balancers] report_hosts`).
    report_hosts: bool,
    /// Pod CIDRs from the cloud (`[pod_cidrs]`).
    pod_cidrs: Option<crate::config::PodCidrConfig>,
    /// Whether BatchSetInstanceTags is advertised.
    set_tags: bool,
    batch_reads: bool,
    metadata_tags: bool,
    cache_ttl: Option<Duration>,
    max_name_length: u32,
    allowed_name_characters: String,
    /// The ipMode of every ingress point (`[dataplane] ip_mode`; VIP without a data plane).
    ip_mode: pb::IpMode,
    /// Whether pod endpoints are advertised (a data plane forwards to pods where a Service
    /// has no node port).
    dataplane: bool,
    node_metadata_instance: Mutex<Option<String>>,
    registry_credentials: Vec<crate::config::RegistryCredentialSpec>,
    world: Mutex<World>,
    gate: Mutex<Gate>,
}

impl Cloud {
    /// A cloud with the configuration's inventory.
    pub fn new(config: &Config) -> anyhow::Result<Self> {
        let pool = config
            .load_balancers
            .address_pool
            .iter()
            .map(|c| c.parse::<IpNet>().map_err(|e| anyhow::anyhow!("address pool entry {c:?}: {e}")))
            .collect::<anyhow::Result<Vec<_>>>()?;
        if config.route_tables.is_empty() {
            anyhow::bail!("at least one route table is required");
        }
        let limiter = config.api.rate_limit.map(|r| TokenBucket::new(r.rps, r.burst));
        if !ccm_provider_sdk::names::valid_scheme(&config.provider_id_scheme) {
            anyhow::bail!("provider_id_scheme {:?} is not a URL scheme", config.provider_id_scheme);
        }
        let cloud = Self {
            region: config.region.clone(),
            scheme: config.provider_id_scheme.clone(),
            classes: config.load_balancers.classes.clone(),
            ipv6_routes: config.ipv6_routes,
            route_target_addresses: config.route_target_addresses,
            bulk_routes: config.bulk_routes,
            bulk_hosts: config.load_balancers.bulk_hosts,
            list_load_balancers: config.load_balancers.list,
            report_hosts: config.load_balancers.report_hosts,
            pod_cidrs: config.pod_cidrs.clone(),
            set_tags: config.set_tags,
            batch_reads: config.batch_reads,
            metadata_tags: config.metadata_tags,
            cache_ttl: (config.cache_ttl_seconds > 0).then(|| Duration::from_secs(config.cache_ttl_seconds)),
            max_name_length: config.load_balancers.max_name_length,
            allowed_name_characters: config.load_balancers.allowed_name_characters.clone(),
            dataplane: config.dataplane.is_some() || config.load_balancers.pod_endpoints,
            ip_mode: match config.dataplane.as_ref().map(|d| d.ip_mode) {
                Some(crate::dataplane::IpMode::Proxy) => pb::IpMode::Proxy,
                _ => pb::IpMode::Vip,
            },
            node_metadata_instance: Mutex::new(config.node_metadata_instance.clone()),
            registry_credentials: config.registry_credentials.clone(),
            world: Mutex::new(World {
                instances: BTreeMap::new(),
                tables: config.route_tables.iter().map(|spec| Table { spec: spec.clone(), routes: BTreeMap::new() }).collect(),
                load_balancers: BTreeMap::new(),
                pool,
                next_internal: 1,
                next_pod_cidr: 0,
                last_hosts: Default::default(),
                node_ips: config.dataplane.as_ref().map(|_| HashMap::new()),
            }),
            gate: Mutex::new(Gate { api: config.api.clone(), limiter, faults: config.faults.clone() }),
        };
        for spec in &config.instances {
            cloud.add_instance(spec.clone(), Duration::ZERO).map_err(|e| anyhow::anyhow!("instance {}: {e}", spec.id))?;
        }
        Ok(cloud)
    }

    fn world(&self) -> std::sync::MutexGuard<'_, World> {
        self.world.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn gate_lock(&self) -> std::sync::MutexGuard<'_, Gate> {
        self.gate.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn delay(&self) -> Duration {
        Duration::from_millis(self.consistency_delay_ms())
    }

    /// The configured consistency delay in milliseconds.
    pub fn consistency_delay_ms(&self) -> u64 {
        self.gate_lock().api.consistency_delay_ms
    }

    // === the API gate ===

    /// Passes one cloud API call through the gate: a method that is down fails at once, the
    /// rate limit answers RESOURCE_EXHAUSTED with the delay, then the call takes its latency
    /// and may fail at the configured error rate.
    pub async fn api_call(&self, method: &str) -> Result<()> {
        self.api_call_on(method, "").await
    }

    /// [`Cloud::api_call`] for a call about one object (a load balancer's name, a route's
    /// name): faults with a `subject` apply only when it is part of this one.
    pub async fn api_call_on(&self, method: &str, subject: &str) -> Result<()> {
        let (latency, fault) = {
            let gate = self.gate_lock();
            let applies = |f: &&Fault| {
                (f.method == "*" || f.method == method)
                    && f.subject.as_deref().is_none_or(|s| !subject.is_empty() && subject.contains(s))
            };
            if let Some(f) = gate.faults.iter().filter(applies).find(|f| f.down) {
                return Err(fault_error(f, method));
            }
            if let Some(limiter) = &gate.limiter {
                limiter.check()?;
            }
            let jitter = if gate.api.jitter_ms > 0 { rand::random_range(0..=gate.api.jitter_ms) } else { 0 };
            let fault = gate.faults.iter().filter(applies).find(|f| f.error_rate > 0.0 && rand::random::<f64>() < f.error_rate);
            let hang: u64 = gate.faults.iter().filter(applies).filter_map(|f| f.delay_ms).max().unwrap_or(0);
            (Duration::from_millis(gate.api.latency_ms + jitter + hang), fault.cloned())
        };
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        match fault {
            Some(fault) => Err(fault_error(&fault, method)),
            None => Ok(()),
        }
    }

    /// The error of one item of a bulk call to `method` (a route's or a load balancer's name
    /// as `subject`): a fault naming a subject fails just the items it names, as a cloud's
    /// bulk API fails single entries. The call itself passed [`Cloud::api_call`].
    pub fn item_fault(&self, method: &str, subject: &str) -> Option<Error> {
        let gate = self.gate_lock();
        gate.faults
            .iter()
            .filter(|f| f.method == "*" || f.method == method)
            .filter(|f| f.subject.as_deref().is_some_and(|s| subject.contains(s)))
            .find(|f| f.down || (f.error_rate > 0.0 && rand::random::<f64>() < f.error_rate))
            .map(|f| fault_error(f, method))
    }

    /// The wrong answer an injected fault asks `method` to give, if any.
    pub fn lie(&self, method: &str) -> Option<Lie> {
        self.gate_lock().faults.iter().filter(|f| f.method == "*" || f.method == method).find_map(|f| f.lie)
    }

    /// Why the whole API is down (a `*` fault with `down`), if it is.
    pub fn api_down(&self) -> Option<String> {
        let gate = self.gate_lock();
        gate.faults.iter().any(|f| f.method == "*" && f.down).then(|| "the cloud API is down".to_string())
    }

    /// Replaces the injected faults.
    pub fn set_faults(&self, faults: Vec<Fault>) {
        self.gate_lock().faults = faults;
    }

    /// Sets or removes the rate limit (a new limit starts with a full bucket).
    pub fn set_rate_limit(&self, limit: Option<RateLimit>) {
        let mut gate = self.gate_lock();
        gate.api.rate_limit = limit;
        gate.limiter = limit.map(|r| TokenBucket::new(r.rps, r.burst));
    }

    /// Sets latency, jitter and the consistency delay.
    pub fn set_api(&self, latency_ms: u64, jitter_ms: u64, consistency_delay_ms: u64) {
        let mut gate = self.gate_lock();
        gate.api.latency_ms = latency_ms;
        gate.api.jitter_ms = jitter_ms;
        gate.api.consistency_delay_ms = consistency_delay_ms;
    }

    // === instances ===

    /// Adds an instance (it shows in reads after the consistency delay).
    pub fn add_instance(&self, mut spec: InstanceSpec, delay: Duration) -> Result<pb::InstanceMetadata> {
        if spec.id.is_empty() || spec.name.is_empty() {
            return Err(Error::invalid_argument("an instance needs an id and a name"));
        }
        let mut world = self.world();
        if world.instances.get(&spec.id).is_some_and(|i| i.state.current.is_some()) {
            return Err(Error::already_exists(format!("instance {} exists", spec.id)));
        }
        if spec.addresses.is_empty() && !spec.no_addresses {
            let n = world.next_internal;
            world.next_internal += 1;
            let ip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 0, 0, 0)) + n);
            spec.addresses.push(Address { kind: "InternalIP".into(), address: ip.to_string() });
        }
        if spec.pod_cidrs.is_empty()
            && let Some(config) = &self.pod_cidrs
        {
            let n = world.next_pod_cidr;
            world.next_pod_cidr += 1;
            spec.pod_cidrs = pod_cidrs_of(config, n)?;
        }
        let state = spec.state;
        let instance = Instance { spec, state: Lagged::new(Some(state), None, delay) };
        let metadata = instance.metadata(&self.scheme, &self.region, state, self.metadata_tags);
        world.instances.insert(instance.spec.id.clone(), instance);
        Ok(metadata)
    }

    /// Changes an instance that exists; NOT_FOUND when it does not.
    fn change_instance<T>(&self, id: &str, change: impl FnOnce(&mut Instance) -> Result<T>) -> Result<T> {
        let mut world = self.world();
        let instance = world
            .instances
            .get_mut(id)
            .filter(|i| i.state.current.is_some())
            .ok_or_else(|| Error::not_found(format!("instance {id}")))?;
        change(instance)
    }

    /// Changes an instance's state (stop, start, terminate); NOT_FOUND when unknown.
    pub fn set_instance_state(&self, id: &str, state: State) -> Result<()> {
        let delay = self.delay();
        self.change_instance(id, |instance| {
            if instance.state.current == Some(State::Terminated) && state != State::Terminated {
                return Err(Error::failed_precondition(reason::FAILED_PRECONDITION, format!("instance {id} is terminated")));
            }
            instance.spec.state = state;
            instance.state.set(Some(state), delay);
            Ok(())
        })
    }

    /// Replaces an instance's tags.
    pub fn set_tags(&self, id: &str, tags: std::collections::BTreeMap<String, String>) -> Result<()> {
        self.change_instance(id, |instance| {
            instance.spec.tags = tags;
            Ok(())
        })
    }

    /// Replaces an instance's addresses (as when an interface is added or an IP re-assigned).
    pub fn set_addresses(&self, id: &str, addresses: Vec<Address>) -> Result<()> {
        self.change_instance(id, |instance| {
            instance.spec.addresses = addresses;
            Ok(())
        })
    }

    /// Removes an instance from the account altogether (as after a terminated instance ages out).
    pub fn remove_instance(&self, id: &str) -> Result<()> {
        let delay = self.delay();
        let mut world = self.world();
        let instance = world.instances.get_mut(id).ok_or_else(|| Error::not_found(format!("instance {id}")))?;
        instance.state.set(None, delay);
        Ok(())
    }

    fn find<'a>(&self, world: &'a World, lookup: &pb::InstanceLookup) -> Result<Option<(&'a Instance, State)>> {
        let found = if !lookup.provider_id.is_empty() {
            let rest = self.strip_scheme(&lookup.provider_id).ok_or_else(|| {
                Error::invalid_argument(format!(
                    "providerID {:?} is not a providerID of this cloud ({}://zone/id)",
                    lookup.provider_id, self.scheme
                ))
            })?;
            let id = rest.rsplit('/').next().unwrap_or(rest);
            world.instances.get(id)
        } else {
            world.instances.values().find(|i| i.spec.name == lookup.node_name)
        };
        Ok(found.and_then(|i| i.state.seen().map(|s| (i, s))))
    }

    /// What reads say of one instance, terminated ones included.
    pub fn instance(&self, lookup: &pb::InstanceLookup) -> Result<Option<pb::InstanceMetadata>> {
        let world = self.world();
        Ok(self.find(&world, lookup)?.map(|(i, s)| i.metadata(&self.scheme, &self.region, s, self.metadata_tags)))
    }

    /// What a metadata read answers about one instance: [`Cloud::instance`], shaped by the
    /// instance's configured [`crate::config::Answer`].
    pub fn instance_answer(&self, lookup: &pb::InstanceLookup) -> Result<Option<pb::InstanceMetadata>> {
        let world = self.world();
        let Some((instance, state)) = self.find(&world, lookup)? else { return Ok(None) };
        let mut metadata = instance.metadata(&self.scheme, &self.region, state, self.metadata_tags);
        match instance.spec.answer {
            Answer::Normal => {}
            Answer::EmptyProviderId => metadata.provider_id.clear(),
            Answer::NoMetadata => return Ok(None),
        }
        Ok(Some(metadata))
    }

    /// An instance's tags as reads show them.
    pub fn instance_tags(&self, lookup: &pb::InstanceLookup) -> Result<Option<HashMap<String, String>>> {
        let world = self.world();
        Ok(self
            .find(&world, lookup)?
            .filter(|(_, s)| *s != State::Terminated)
            .map(|(i, _)| i.spec.tags.iter().map(|(k, v)| (k.clone(), v.clone())).collect()))
    }

    /// Writes tags of one instance: `set` added or updated, `remove` removed, no other tag
    /// touched. `Ok(false)` when the instance does not exist (or is terminated). A key or
    /// value the cloud refuses (empty key, over 128 / 256 characters, as EC2's limits) is
    /// INVALID_ARGUMENT and nothing is written.
    pub fn update_instance_tags(&self, update: &pb::InstanceTagsUpdate) -> Result<bool> {
        let lookup = update.instance.clone().unwrap_or_default();
        if let Some((k, v)) = update.set.iter().find(|(k, v)| k.is_empty() || k.chars().count() > 128 || v.chars().count() > 256)
        {
            return Err(Error::invalid_argument(format!(
                "tag {k:?}={v:?} is refused: keys of 1 to 128 characters, values of up to 256"
            )));
        }
        let id = {
            let world = self.world();
            match self.find(&world, &lookup)? {
                Some((i, state)) if state != State::Terminated => i.spec.id.clone(),
                _ => return Ok(false),
            }
        };
        self.change_instance(&id, |instance| {
            for k in &update.remove {
                instance.spec.tags.remove(k);
            }
            for (k, v) in &update.set {
                instance.spec.tags.insert(k.clone(), v.clone());
            }
            Ok(true)
        })
    }

    /// Every instance reads show, terminated ones excluded.
    pub fn instances(&self) -> Vec<pb::InstanceMetadata> {
        let world = self.world();
        world
            .instances
            .values()
            .filter_map(|i| {
                i.state
                    .seen()
                    .filter(|s| *s != State::Terminated)
                    .map(|s| i.metadata(&self.scheme, &self.region, s, self.metadata_tags))
            })
            .collect()
    }

    /// The instance NodeMetadataService describes.
    pub fn node_metadata(&self) -> Result<pb::InstanceMetadata> {
        let id = self.node_metadata_instance.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let id = id.ok_or_else(|| Error::unavailable("the metadata service has no instance configured"))?;
        self.instance_metadata_service(&id)
    }

    /// What the link-local metadata service of instance `id` says about it: its current
    /// truth (no lag: it runs on the instance), and nothing once the instance is gone.
    pub fn instance_metadata_service(&self, id: &str) -> Result<pb::InstanceMetadata> {
        let world = self.world();
        let instance = world.instances.get(id).filter(|i| i.state.current.is_some_and(|s| s != State::Terminated));
        let instance = instance.ok_or_else(|| Error::unavailable(format!("instance {id} is not there to answer")))?;
        Ok(instance.metadata(&self.scheme, &self.region, instance.spec.state, self.metadata_tags))
    }

    /// The id of the instance named `name` (its host name), as the metadata service on it
    /// would know it.
    pub fn instance_id_by_name(&self, name: &str) -> Result<String> {
        let world = self.world();
        world
            .instances
            .values()
            .find(|i| i.spec.name == name && i.state.current.is_some_and(|s| s != State::Terminated))
            .map(|i| i.spec.id.clone())
            .ok_or_else(|| Error::unavailable(format!("no instance named {name} is there to answer")))
    }

    /// The registry credentials the metadata service of instance `id` hands out for `image`:
    /// those whose pattern covers it, while the instance runs.
    pub fn registry_credentials(&self, id: &str, image: &str) -> Result<Vec<crate::config::RegistryCredentialSpec>> {
        ccm_provider_sdk::registry::parse_image(image)?;
        let metadata = self.instance_metadata_service(id)?;
        if metadata.state() != pb::InstanceState::Running {
            return Err(Error::unavailable(format!("instance {id} is not running")));
        }
        Ok(self
            .registry_credentials
            .iter()
            .filter(|c| ccm_provider_sdk::registry::pattern_matches(&c.registry, image))
            .cloned()
            .collect())
    }

    /// Whether BatchInstanceMetadata is advertised.
    pub fn batch_reads(&self) -> bool {
        self.batch_reads
    }

    /// The pod CIDR capabilities: (advertised, routed by the cloud).
    pub fn pod_cidr_capabilities(&self) -> (bool, bool) {
        self.pod_cidrs.as_ref().map_or((false, false), |c| (true, c.routed))
    }

    /// Whether BatchSetInstanceTags is advertised.
    pub fn sets_tags(&self) -> bool {
        self.set_tags
    }

    /// Whether instance metadata carries the tags (advertised as `metadata_tags`).
    pub fn metadata_tags(&self) -> bool {
        self.metadata_tags
    }

    /// The cache hint of read answers.
    pub fn cache_ttl(&self) -> Option<Duration> {
        self.cache_ttl
    }

    /// Whether a NodeMetadataService is configured.
    pub fn serves_node_metadata(&self) -> bool {
        self.node_metadata_instance.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    // === routes ===

    /// Route capabilities.
    pub fn route_capabilities(&self) -> pb::RoutesCapabilities {
        let world = self.world();
        let max = world.tables.iter().map(|t| t.spec.max_routes).filter(|m| *m > 0).min().unwrap_or(0);
        pb::RoutesCapabilities {
            multiple_tables: world.tables.len() > 1,
            max_routes_per_table: max,
            ipv6: self.ipv6_routes,
            target_addresses: self.route_target_addresses,
            provider_names: false,
            bulk_apply: self.bulk_routes,
        }
    }

    /// Every route table.
    pub fn route_tables(&self) -> Vec<pb::RouteTable> {
        self.world()
            .tables
            .iter()
            .map(|t| pb::RouteTable { id: t.spec.id.clone(), name: t.spec.name.clone(), max_routes: t.spec.max_routes })
            .collect()
    }

    fn table_index(world: &World, table_id: &str) -> Result<usize> {
        if table_id.is_empty() {
            return Ok(0);
        }
        world.tables.iter().position(|t| t.spec.id == table_id).ok_or_else(|| {
            Error::invalid_argument_because(reason::UNKNOWN_ROUTE_TABLE, format!("route table {table_id:?} does not exist"))
        })
    }

    /// The cluster's routes in a table as reads show them, blackholed when their instance is gone.
    pub fn routes(&self, cluster: &str, table_id: &str) -> Result<Vec<pb::Route>> {
        let world = self.world();
        let table = &world.tables[Self::table_index(&world, table_id)?];
        Ok(table
            .routes
            .iter()
            .filter(|((c, _), r)| (cluster.is_empty() || c == cluster) && r.exists.seen())
            .map(|(_, r)| {
                let mut route = r.route.clone();
                // A route to no instance (a gateway's) is no blackhole.
                if let Some(target) = route.target.clone() {
                    let lookup =
                        pb::InstanceLookup { provider_id: target.provider_id, node_name: target.node_name, ..Default::default() };
                    let alive = matches!(self.find(&world, &lookup), Ok(Some((_, s))) if s != State::Terminated);
                    route.blackhole = !alive;
                }
                route
            })
            .collect())
    }

    /// Creates a route: idempotent, quota-checked, one route per destination in a table.
    pub fn create_route(&self, cluster: &str, mut route: pb::Route) -> Result<pb::Route> {
        let delay = self.delay();
        let mut world = self.world();
        let index = Self::table_index(&world, &route.table_id)?;
        let mut target = route.target.clone().unwrap_or_default();
        // The target must be a live instance, by the cloud's true state.
        let instance = if target.provider_id.is_empty() {
            world.instances.values().find(|i| i.spec.name == target.node_name)
        } else {
            // By instance id, as reads resolve it: a kubelet may have written the providerID
            // with another zone (`sim://its-zone/i-1`); the route records the canonical one.
            let id = self.strip_scheme(&target.provider_id).and_then(|r| r.rsplit('/').next()).unwrap_or_default();
            world.instances.get(id)
        };
        let Some(instance) = instance.filter(|i| matches!(i.state.current, Some(s) if s != State::Terminated)) else {
            return Err(Error::failed_precondition(
                "INSTANCE_NOT_FOUND",
                format!("route target {} ({}) is not a live instance", target.node_name, target.provider_id),
            ));
        };
        target.provider_id = instance.provider_id(&self.scheme);
        route.target = Some(target);
        route.blackhole = false;
        if !self.route_target_addresses {
            route.target_addresses.clear();
        }
        let table = &mut world.tables[index];
        route.table_id = table.spec.id.clone();
        let key = (cluster.to_string(), route.name.clone());
        if let Some(existing) = table.routes.get(&key).filter(|r| r.exists.current) {
            let same = existing.route.destination_cidr == route.destination_cidr
                && existing.route.target.as_ref().map(|t| &t.provider_id) == route.target.as_ref().map(|t| &t.provider_id);
            return if same {
                Ok(existing.route.clone())
            } else {
                Err(Error::already_exists(format!("route {} exists with another destination or target", route.name)))
            };
        }
        if let Some(((_, other), _)) =
            table.routes.iter().find(|(_, r)| r.exists.current && r.route.destination_cidr == route.destination_cidr)
        {
            return Err(Error::already_exists(format!("destination {} is already routed by {other}", route.destination_cidr)));
        }
        let live = table.routes.values().filter(|r| r.exists.current).count();
        if table.spec.max_routes > 0 && live >= table.spec.max_routes as usize {
            return Err(Error::QuotaExceeded {
                message: format!("route table {} holds at most {} routes", table.spec.id, table.spec.max_routes),
            });
        }
        table.routes.retain(|_, r| r.exists.current || !r.exists.settled());
        match table.routes.get_mut(&key) {
            Some(record) => {
                record.route = route.clone();
                record.exists.set(true, delay);
                record.created_at_unix_ms = unix_ms();
            }
            None => {
                let record =
                    RouteRecord { route: route.clone(), exists: Lagged::new(true, false, delay), created_at_unix_ms: unix_ms() };
                table.routes.insert(key, record);
            }
        }
        Ok(route)
    }

    /// Adds, out of band, a route that targets no instance (a gateway's, a VPN's, as a
    /// network team adds them): it lists with no target.
    pub fn add_gateway_route(&self, cluster: &str, mut route: pb::Route) -> Result<()> {
        let mut world = self.world();
        let index = Self::table_index(&world, &route.table_id)?;
        let table = &mut world.tables[index];
        if table.routes.values().any(|r| r.exists.current && r.route.destination_cidr == route.destination_cidr) {
            return Err(Error::already_exists(format!("destination {} is already routed", route.destination_cidr)));
        }
        route.target = None;
        route.blackhole = false;
        route.table_id = table.spec.id.clone();
        let record =
            RouteRecord { route: route.clone(), exists: Lagged::new(true, true, Duration::ZERO), created_at_unix_ms: unix_ms() };
        table.routes.insert((cluster.to_string(), route.name), record);
        Ok(())
    }

    /// Deletes a route; absent is fine.
    pub fn delete_route(&self, cluster: &str, table_id: &str, name: &str) -> Result<()> {
        let delay = self.delay();
        let mut world = self.world();
        let index = Self::table_index(&world, table_id)?;
        if let Some(record) = world.tables[index].routes.get_mut(&(cluster.to_string(), name.to_string()))
            && record.exists.current
        {
            record.exists.set(false, delay);
        }
        Ok(())
    }

    /// The tables a target's routes go to: those listing its zone, or listing no zones.
    pub fn tables_for(&self, target: &pb::RouteTarget) -> Result<Vec<String>> {
        let world = self.world();
        let lookup = pb::InstanceLookup {
            provider_id: target.provider_id.clone(),
            node_name: target.node_name.clone(),
            ..Default::default()
        };
        let (instance, _) = self
            .find(&world, &lookup)?
            .ok_or_else(|| Error::not_found(format!("instance of {} ({}) not found", target.node_name, target.provider_id)))?;
        Ok(world
            .tables
            .iter()
            .filter(|t| t.spec.zones.is_empty() || t.spec.zones.contains(&instance.spec.zone))
            .map(|t| t.spec.id.clone())
            .collect())
    }

    // === load balancers ===

    /// Load balancer capabilities.
    pub fn load_balancer_capabilities(&self) -> pb::LoadBalancersCapabilities {
        pb::LoadBalancersCapabilities {
            max_name_length: self.max_name_length,
            allowed_name_characters: self.allowed_name_characters.clone(),
            list: self.list_load_balancers,
            bulk_update_hosts: self.bulk_hosts,
            pod_endpoints: self.dataplane,
            classes: self.classes.clone(),
        }
    }

    /// The providerIDs' scheme.
    pub fn scheme(&self) -> &str {
        &self.scheme
    }

    /// What follows `<scheme>://` in a providerID of this cloud.
    fn strip_scheme<'a>(&self, provider_id: &'a str) -> Option<&'a str> {
        provider_id.strip_prefix(self.scheme.as_str())?.strip_prefix("://")
    }

    fn status(&self, lb: &LoadBalancer) -> pb::LoadBalancerStatus {
        let ports = lb
            .service
            .ports
            .iter()
            .map(|p| pb::PortStatus { port: p.port, protocol: p.protocol, error: String::new() })
            .collect();
        pb::LoadBalancerStatus {
            ingress: vec![pb::LoadBalancerIngress {
                ip: lb.ip.to_string(),
                hostname: String::new(),
                ip_mode: self.ip_mode as i32,
                ports,
            }],
        }
    }

    /// The cluster's load balancers as reads show them, with the Service each was made for.
    pub fn load_balancers(&self, cluster: &str) -> Vec<pb::LoadBalancerSummary> {
        self.load_balancers_of(Some(cluster))
    }

    /// The load balancers of `cluster`, or of every cluster.
    pub fn load_balancers_of(&self, cluster: Option<&str>) -> Vec<pb::LoadBalancerSummary> {
        let world = self.world();
        world
            .load_balancers
            .values()
            .filter(|lb| lb.exists.seen() && cluster.is_none_or(|c| lb.service.cluster_name == c))
            .map(|lb| pb::LoadBalancerSummary {
                load_balancer_name: lb.service.load_balancer_name.clone(),
                namespace: lb.service.namespace.clone(),
                name: lb.service.name.clone(),
                uid: lb.service.uid.clone(),
                status: Some(self.status(lb)),
                cluster_name: lb.service.cluster_name.clone(),
                hosts: self.report_hosts.then(|| pb::LoadBalancerHosts { node_names: lb.nodes.to_vec() }),
            })
            .collect()
    }

    /// A load balancer's status as reads show it.
    pub fn load_balancer(&self, name: &str) -> Option<pb::LoadBalancerStatus> {
        let world = self.world();
        world.load_balancers.get(name).filter(|lb| lb.exists.seen()).map(|lb| self.status(lb))
    }

    /// Whether ListLoadBalancers is advertised.
    pub fn lists_load_balancers(&self) -> bool {
        self.list_load_balancers
    }

    /// A load balancer's backends as reads show them, when the sim reports them.
    pub fn load_balancer_hosts(&self, name: &str) -> Option<Vec<String>> {
        if !self.report_hosts {
            return None;
        }
        let world = self.world();
        world.load_balancers.get(name).filter(|lb| lb.exists.seen()).map(|lb| lb.nodes.to_vec())
    }

    /// Removes a load balancer behind the controllers' back (as in the cloud's console);
    /// NOT_FOUND when there is none of that name.
    pub fn remove_load_balancer(&self, name: &str) -> Result<()> {
        let exists = self.world().load_balancers.get(name).is_some_and(|lb| lb.exists.current);
        if !exists {
            return Err(Error::not_found(format!("load balancer {name} does not exist")));
        }
        self.delete_load_balancer(name);
        Ok(())
    }

    /// Sets a load balancer's backends behind the controllers' back (as by hand in the cloud's
    /// console); NOT_FOUND when it does not exist.
    pub fn set_load_balancer_hosts_by_hand(&self, name: &str, mut hosts: Vec<String>) -> Result<()> {
        hosts.sort();
        self.set_load_balancer_hosts(name, Arc::new(hosts))
    }

    fn allocate(world: &World, requested: &str, replacing: &str) -> Result<IpAddr> {
        let taken: Vec<IpAddr> = world
            .load_balancers
            .iter()
            .filter(|(n, lb)| lb.exists.current && n.as_str() != replacing)
            .map(|(_, lb)| lb.ip)
            .collect();
        if !requested.is_empty() {
            let ip: IpAddr = requested.parse().map_err(|_| Error::invalid_argument(format!("{requested:?} is not an IP")))?;
            if !world.pool.iter().any(|n| n.contains(&ip)) {
                return Err(Error::failed_precondition("IP_NOT_IN_POOL", format!("{ip} is not one of this cloud's addresses")));
            }
            if taken.contains(&ip) {
                return Err(Error::failed_precondition("IP_IN_USE", format!("{ip} is in use by another load balancer")));
            }
            return Ok(ip);
        }
        world
            .pool
            .iter()
            .flat_map(|n| n.hosts())
            .find(|ip| !taken.contains(ip))
            .ok_or_else(|| Error::QuotaExceeded { message: "no load balancer address is left in the pool".into() })
    }

    /// Creates or updates a load balancer. Its address stays unless the requested IP changes.
    pub fn ensure_load_balancer(
        &self,
        service: &pb::LoadBalancerService,
        nodes: &[pb::LoadBalancerNode],
    ) -> Result<pb::LoadBalancerStatus> {
        let delay = self.delay();
        let names = sorted_names(nodes);
        let mut world = self.world();
        Self::owned_by(&world, service)?;
        let node_names = world.hosts(&names, nodes);
        let name = &service.load_balancer_name;
        let current_ip = world.load_balancers.get(name).filter(|lb| lb.exists.current).map(|lb| lb.ip);
        let ip = match current_ip {
            Some(ip) if service.requested_ip.is_empty() || service.requested_ip == ip.to_string() => ip,
            _ => Self::allocate(&world, &service.requested_ip, name)?,
        };
        let lb = world.load_balancers.entry(name.clone()).or_insert_with(|| LoadBalancer {
            service: service.clone(),
            nodes: Default::default(),
            ip,
            exists: Lagged::new(false, false, Duration::ZERO),
            hosts_changed_at_unix_ms: 0,
        });
        lb.service = service.clone();
        if !same_hosts(&lb.nodes, &node_names) {
            lb.hosts_changed_at_unix_ms = unix_ms();
        }
        lb.nodes = node_names;
        lb.ip = ip;
        if !lb.exists.current {
            lb.exists.set(true, delay);
        }
        Ok(self.status(lb))
    }

    /// Refuses a call for `service` about a load balancer made for another Service
    /// (FAILED_PRECONDITION, `OWNED_BY_ANOTHER_SERVICE`): a load balancer belongs to the
    /// Service it was made for. The SDK server runs one mutation of a name at a time, so a
    /// check before a mutation holds for it.
    pub fn check_owner(&self, service: &pb::LoadBalancerService) -> Result<()> {
        Self::owned_by(&self.world(), service)
    }

    fn owned_by(world: &World, service: &pb::LoadBalancerService) -> Result<()> {
        let name = &service.load_balancer_name;
        match world.load_balancers.get(name).filter(|lb| lb.exists.current) {
            Some(lb) => ccm_provider_sdk::owner::check(name, &lb.service.uid, service),
            None => Ok(()),
        }
    }

    /// Replaces a load balancer's backends; NOT_FOUND when it does not exist.
    pub fn update_load_balancer_hosts(&self, name: &str, nodes: &[pb::LoadBalancerNode]) -> Result<()> {
        let names = sorted_names(nodes);
        let hosts = self.world().hosts(&names, nodes);
        self.set_load_balancer_hosts(name, hosts)
    }

    /// The backend list of `nodes`, to give many load balancers with
    /// [`Cloud::set_load_balancer_hosts`] (a bulk update's).
    pub fn hosts_list(&self, nodes: &[pb::LoadBalancerNode]) -> Arc<Vec<String>> {
        let names = sorted_names(nodes);
        self.world().hosts(&names, nodes)
    }

    /// Replaces a load balancer's backends with `hosts`; NOT_FOUND when it does not exist.
    pub fn set_load_balancer_hosts(&self, name: &str, hosts: Arc<Vec<String>>) -> Result<()> {
        let mut world = self.world();
        let lb = world
            .load_balancers
            .get_mut(name)
            .filter(|lb| lb.exists.current)
            .ok_or_else(|| Error::not_found(format!("load balancer {name} does not exist")))?;
        if !same_hosts(&lb.nodes, &hosts) {
            lb.hosts_changed_at_unix_ms = unix_ms();
        }
        lb.nodes = hosts;
        Ok(())
    }

    /// Every load balancer's name, how many backends it has and when they last changed:
    /// the snapshot without the backend lists, for polling at thousands of load balancers.
    pub fn hosts_summary(&self) -> Vec<HostsView> {
        let world = self.world();
        world
            .load_balancers
            .values()
            .filter(|lb| lb.exists.current)
            .map(|lb| HostsView {
                name: lb.service.load_balancer_name.clone(),
                hosts: lb.nodes.len(),
                hosts_changed_at_unix_ms: lb.hosts_changed_at_unix_ms,
            })
            .collect()
    }

    /// Deletes a load balancer and frees its address; absent is fine.
    pub fn delete_load_balancer(&self, name: &str) {
        let delay = self.delay();
        let mut world = self.world();
        if let Some(lb) = world.load_balancers.get_mut(name)
            && lb.exists.current
        {
            lb.exists.set(false, delay);
        }
        world.load_balancers.retain(|_, lb| lb.exists.current || !lb.exists.settled());
    }

    /// What the data plane forwards: every load balancer that exists, with its backends'
    /// addresses (a backend whose address is unknown is left out).
    pub fn dataplane_state(&self) -> crate::dataplane::DesiredState {
        use crate::dataplane::{KUBE_PROXY_HEALTH_PORT, Listener, LoadBalancerSpec, Protocol};
        let world = self.world();
        let empty = HashMap::new();
        let ips = world.node_ips.as_ref().unwrap_or(&empty);
        let load_balancers = world
            .load_balancers
            .values()
            .filter(|lb| lb.exists.current)
            .map(|lb| {
                let s = &lb.service;
                let local = s.external_traffic_policy() == pb::ExternalTrafficPolicy::Local && s.health_check_node_port != 0;
                LoadBalancerSpec {
                    name: s.load_balancer_name.clone(),
                    address: lb.ip,
                    listeners: s
                        .ports
                        .iter()
                        .filter_map(|p| {
                            let protocol = match p.protocol() {
                                pb::Protocol::Tcp => Protocol::Tcp,
                                pb::Protocol::Udp => Protocol::Udp,
                                pb::Protocol::Sctp => Protocol::Sctp,
                                _ => return None,
                            };
                            Some(Listener {
                                protocol,
                                port: u16::try_from(p.port).ok()?,
                                node_port: u16::try_from(p.node_port).unwrap_or(0),
                                targets: p
                                    .endpoints
                                    .iter()
                                    .filter_map(|e| Some((e.address.parse().ok()?, u16::try_from(e.port).ok()?)))
                                    .collect(),
                            })
                        })
                        .collect(),
                    backends: lb.nodes.iter().filter_map(|n| ips.get(n).copied()).collect(),
                    source_ranges: s.source_ranges.clone(),
                    health_check_port: if local {
                        u16::try_from(s.health_check_node_port).unwrap_or(KUBE_PROXY_HEALTH_PORT)
                    } else {
                        KUBE_PROXY_HEALTH_PORT
                    },
                    client_ip_affinity: s.session_affinity() == pb::SessionAffinity::ClientIp,
                }
            })
            .collect();
        crate::dataplane::DesiredState { load_balancers }
    }

    // === admin ===

    /// Every route table with its routes (`GET /route-tables`: the state without the load
    /// balancers' backend lists).
    pub fn route_table_views(&self) -> Vec<TableView> {
        Self::tables_of(&self.world())
    }

    fn tables_of(world: &World) -> Vec<TableView> {
        world
            .tables
            .iter()
            .map(|t| TableView {
                id: t.spec.id.clone(),
                max_routes: t.spec.max_routes,
                routes: t
                    .routes
                    .iter()
                    .filter(|(_, r)| r.exists.current)
                    .map(|((cluster, name), r)| {
                        let target = r.route.target.clone().unwrap_or_default();
                        RouteView {
                            cluster: cluster.clone(),
                            name: name.clone(),
                            destination_cidr: r.route.destination_cidr.clone(),
                            node_name: target.node_name,
                            provider_id: target.provider_id,
                            created_at_unix_ms: r.created_at_unix_ms,
                            target_addresses: r
                                .route
                                .target_addresses
                                .iter()
                                .map(|a| format!("{}={}", address_type_name(a.r#type()), a.address))
                                .collect(),
                        }
                    })
                    .collect(),
            })
            .collect()
    }

    /// The true state of everything.
    pub fn snapshot(&self) -> Snapshot {
        let world = self.world();
        Snapshot {
            instances: world
                .instances
                .values()
                .filter_map(|i| {
                    i.state.current.map(|state| InstanceView {
                        id: i.spec.id.clone(),
                        name: i.spec.name.clone(),
                        provider_id: i.provider_id(&self.scheme),
                        state,
                        zone: i.spec.zone.clone(),
                        tags: i.spec.tags.clone(),
                        pod_cidrs: i.spec.pod_cidrs.clone(),
                    })
                })
                .collect(),
            route_tables: Self::tables_of(&world),
            load_balancers: world
                .load_balancers
                .values()
                .filter(|lb| lb.exists.current)
                .map(|lb| LoadBalancerView {
                    name: lb.service.load_balancer_name.clone(),
                    service: format!("{}/{}", lb.service.namespace, lb.service.name),
                    ip: lb.ip.to_string(),
                    nodes: lb.nodes.to_vec(),
                    ports: lb.service.ports.iter().map(|p| p.port).collect(),
                    hosts_changed_at_unix_ms: lb.hosts_changed_at_unix_ms,
                    source_ranges: lb.service.source_ranges.clone(),
                    service_uid: lb.service.uid.clone(),
                    port_details: lb
                        .service
                        .ports
                        .iter()
                        .map(|p| format!("{}:{}:{}", p.port, p.app_protocol, p.target_port))
                        .collect(),
                    external_ips: lb.service.external_ips.clone(),
                    port_endpoints: lb
                        .service
                        .ports
                        .iter()
                        .flat_map(|p| p.endpoints.iter().map(move |e| format!("{}:{}:{}", p.port, e.address, e.port)))
                        .collect(),
                })
                .collect(),
        }
    }
}

fn fault_error(fault: &Fault, method: &str) -> Error {
    let hint = fault.retry_after_ms.map(Duration::from_millis);
    match fault.code {
        FaultCode::Unavailable => Error::Unavailable { message: format!("{method}: injected fault"), retry_after: hint },
        FaultCode::Internal => Error::internal(format!("{method}: injected fault")),
        FaultCode::RateLimited => Error::RateLimited { retry_after: hint.unwrap_or(Duration::from_secs(1)) },
        FaultCode::DeadlineExceeded => Error::DeadlineExceeded { message: format!("{method}: injected fault") },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LoadBalancerConfig;

    fn cloud(max_routes: u32, pool: &str) -> Cloud {
        let mut config = Config::default();
        config.route_tables[0].max_routes = max_routes;
        config.load_balancers = LoadBalancerConfig { address_pool: vec![pool.into()], ..Default::default() };
        for i in 1..=3 {
            config.instances.push(InstanceSpec {
                id: format!("i-{i}"),
                name: format!("node-{i}"),
                zone: "z".into(),
                instance_type: "t".into(),
                state: State::Running,
                addresses: Vec::new(),
                tags: Default::default(),
                ..Default::default()
            });
        }
        Cloud::new(&config).expect("cloud")
    }

    fn route(name: &str, node: &str, cidr: &str) -> pb::Route {
        pb::Route {
            name: name.into(),
            target: Some(pb::RouteTarget { node_name: node.into(), provider_id: String::new() }),
            destination_cidr: cidr.into(),
            ..Default::default()
        }
    }

    #[test]
    fn route_quota_is_a_quota_not_a_rate_limit() {
        let c = cloud(2, "203.0.113.0/30");
        c.create_route("k", route("a", "node-1", "10.244.1.0/24")).expect("a");
        c.create_route("k", route("b", "node-2", "10.244.2.0/24")).expect("b");
        let err = c.create_route("k", route("c", "node-3", "10.244.3.0/24")).expect_err("full");
        assert!(matches!(err, Error::QuotaExceeded { .. }), "{err:?}");
        // Deleting frees room.
        c.delete_route("k", "", "a").expect("delete");
        c.create_route("k", route("c", "node-3", "10.244.3.0/24")).expect("c fits now");
    }

    #[test]
    fn routes_to_gone_instances_are_blackholes_and_targets_must_live() {
        let c = cloud(0, "203.0.113.0/30");
        c.create_route("k", route("a", "node-1", "10.244.1.0/24")).expect("a");
        c.set_instance_state("i-1", State::Terminated).expect("terminate");
        let routes = c.routes("k", "").expect("list");
        assert!(routes[0].blackhole);
        let err = c.create_route("k", route("b", "node-1", "10.244.9.0/24")).expect_err("dead target");
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
        // Other clusters' listings never show it.
        assert!(c.routes("other", "").expect("list").is_empty());
    }

    #[test]
    fn one_route_per_destination() {
        let c = cloud(0, "203.0.113.0/30");
        c.create_route("k", route("a", "node-1", "10.244.1.0/24")).expect("a");
        let err = c.create_route("other", route("x", "node-2", "10.244.1.0/24")).expect_err("same destination");
        assert_eq!(err.code(), tonic::Code::AlreadyExists);
    }

    fn service(name: &str, requested_ip: &str) -> pb::LoadBalancerService {
        pb::LoadBalancerService {
            namespace: "ns".into(),
            name: name.into(),
            load_balancer_name: format!("lb-{name}"),
            requested_ip: requested_ip.into(),
            ports: vec![pb::ServicePort { port: 80, protocol: pb::Protocol::Tcp as i32, ..Default::default() }],
            ..Default::default()
        }
    }

    #[test]
    fn load_balancer_addresses_come_from_the_pool() {
        // A /30 has two usable hosts.
        let c = cloud(0, "203.0.113.0/30");
        let a = c.ensure_load_balancer(&service("a", ""), &[]).expect("a");
        assert_eq!(a.ingress[0].ip, "203.0.113.1");
        c.ensure_load_balancer(&service("b", "203.0.113.2"), &[]).expect("requested");
        let err = c.ensure_load_balancer(&service("c", ""), &[]).expect_err("pool empty");
        assert!(matches!(err, Error::QuotaExceeded { .. }));
        let err = c.ensure_load_balancer(&service("d", "198.51.100.1"), &[]).expect_err("not ours");
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
        // Ensure again keeps the address; delete frees it.
        assert_eq!(c.ensure_load_balancer(&service("a", ""), &[]).expect("again").ingress[0].ip, "203.0.113.1");
        c.delete_load_balancer("lb-a");
        assert_eq!(c.ensure_load_balancer(&service("c", ""), &[]).expect("c").ingress[0].ip, "203.0.113.1");
        let err = c.update_load_balancer_hosts("lb-a", &[]).expect_err("gone");
        assert_eq!(err.code(), tonic::Code::NotFound);
    }

    fn lb_node(name: &str) -> pb::LoadBalancerNode {
        pb::LoadBalancerNode { name: name.into(), ..Default::default() }
    }

    #[test]
    fn load_balancers_of_the_same_backends_share_one_list_and_the_summary_shows_changes() {
        let c = cloud(0, "203.0.113.0/29");
        let nodes = [lb_node("node-2"), lb_node("node-1")];
        c.ensure_load_balancer(&service("a", ""), &nodes).expect("a");
        c.ensure_load_balancer(&service("b", ""), &nodes).expect("b");
        {
            let world = c.world();
            let (a, b) = (&world.load_balancers["lb-a"], &world.load_balancers["lb-b"]);
            assert!(Arc::ptr_eq(&a.nodes, &b.nodes), "one list for both");
            assert_eq!(*a.nodes, vec!["node-1".to_string(), "node-2".to_string()]);
        }
        let before: BTreeMap<String, (usize, u64)> =
            c.hosts_summary().into_iter().map(|h| (h.name, (h.hosts, h.hosts_changed_at_unix_ms))).collect();
        assert_eq!(before.len(), 2);
        assert!(before.values().all(|(n, at)| *n == 2 && *at > 0), "{before:?}");
        std::thread::sleep(Duration::from_millis(5));
        // A bulk update gives one list to both; the same backends again change nothing.
        let hosts = c.hosts_list(&[lb_node("node-3")]);
        c.set_load_balancer_hosts("lb-a", hosts.clone()).expect("a");
        c.set_load_balancer_hosts("lb-b", c.hosts_list(&[lb_node("node-1"), lb_node("node-2")])).expect("b");
        let after: BTreeMap<String, (usize, u64)> =
            c.hosts_summary().into_iter().map(|h| (h.name, (h.hosts, h.hosts_changed_at_unix_ms))).collect();
        assert_eq!(after["lb-a"].0, 1);
        assert!(after["lb-a"].1 > before["lb-a"].1, "a's hosts changed");
        assert_eq!(after["lb-b"], before["lb-b"], "b's did not");
        // The state shows the same lists.
        let views = c.snapshot().load_balancers;
        assert_eq!(views.iter().find(|l| l.name == "lb-a").map(|l| l.nodes.clone()), Some(vec!["node-3".to_string()]));
        assert_eq!(c.route_table_views().len(), c.snapshot().route_tables.len());
    }
}
