//! The sim's configuration file (TOML): initial inventory, API behaviour and faults.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// The whole configuration. Every field has a default, so an empty file is a working cloud
/// with no instances, one route table and a load balancer address pool.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// The plugin name served by Identity.
    pub plugin_name: String,
    /// The scheme of the instances' providerIDs (`sim` for `sim://zone/i-1`): two sims of
    /// different schemes stand for two clouds in one cluster.
    pub provider_id_scheme: String,
    /// The region every instance is in.
    pub region: String,
    /// How the cloud's API behaves.
    pub api: ApiConfig,
    /// Faults injected from the start.
    pub faults: Vec<Fault>,
    /// The instances that exist at start.
    pub instances: Vec<InstanceSpec>,
    /// The route tables; one table means the provider does not advertise multiple tables.
    pub route_tables: Vec<RouteTableSpec>,
    /// Whether IPv6 routes are supported.
    pub ipv6_routes: bool,
    /// Whether routes record their target's addresses (advertised as
    /// `RoutesCapabilities.target_addresses`), as clouds whose routes point at an address do.
    pub route_target_addresses: bool,
    /// Whether ApplyRoutes is advertised (`RoutesCapabilities.bulk_apply`): a table's creates
    /// and deletes in one cloud call, as clouds that write a route table as one list do.
    pub bulk_routes: bool,
    /// Load balancer behaviour.
    pub load_balancers: LoadBalancerConfig,
    /// The instance whose metadata NodeMetadataService serves; unset means the sim does not
    /// serve NodeMetadataService.
    pub node_metadata_instance: Option<String>,
    /// Whether BatchInstanceMetadata is advertised as one cloud call.
    pub batch_reads: bool,
    /// Whether instance metadata carries the instance's tags (`InstancesCapabilities.metadata_tags`),
    /// as a cloud whose instance read returns the tags does: the core then makes no Tags call.
    pub metadata_tags: bool,
    /// The cache hint on instance, tag and route answers, in seconds; 0 sends none.
    pub cache_ttl_seconds: u64,
    /// Registry credentials the metadata service hands to running instances (as a cloud
    /// hands short-lived registry tokens to an instance's role).
    pub registry_credentials: Vec<RegistryCredentialSpec>,
    /// Serve cloudprovider.v1 over plaintext TCP on addresses other hosts can reach (the
    /// `--allow-insecure-tcp` flag): refused otherwise.
    pub allow_insecure_tcp: bool,
    /// The mode of the unix sockets served (`--socket-mode`, default 0600).
    #[serde(skip)]
    pub socket_mode: u32,
    /// Serve the metrics over plain HTTP on an address other hosts can reach
    /// (`--allow-insecure-metrics`): refused otherwise.
    #[serde(skip)]
    pub allow_insecure_metrics: bool,
    /// The data plane (`[dataplane]`): when set, the load balancers carry traffic through
    /// the agent at its endpoint (see [`crate::dataplane`]); unset, they are records only.
    pub dataplane: Option<crate::dataplane::DataplaneConfig>,
    /// Pod CIDRs from the cloud (`[pod_cidrs]`): when set, instance metadata carries each
    /// instance's pod CIDRs (`InstancesCapabilities.pod_cidrs`), as GCP's alias ranges and
    /// AWS's prefix delegation give them.
    pub pod_cidrs: Option<PodCidrConfig>,
    /// Whether BatchSetInstanceTags is advertised (`TagsCapabilities.set_tags`).
    pub set_tags: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            plugin_name: "sim.cloudprovider.dev".into(),
            provider_id_scheme: crate::cloud::DEFAULT_SCHEME.into(),
            region: "sim-region-1".into(),
            api: ApiConfig::default(),
            faults: Vec::new(),
            instances: Vec::new(),
            route_tables: vec![RouteTableSpec { id: "rt-main".into(), name: "main".into(), max_routes: 200, zones: Vec::new() }],
            ipv6_routes: true,
            route_target_addresses: false,
            bulk_routes: false,
            load_balancers: LoadBalancerConfig::default(),
            node_metadata_instance: None,
            batch_reads: true,
            metadata_tags: true,
            cache_ttl_seconds: 0,
            registry_credentials: Vec::new(),
            allow_insecure_tcp: false,
            socket_mode: 0o600,
            allow_insecure_metrics: false,
            dataplane: None,
            pod_cidrs: None,
            set_tags: true,
        }
    }
}

/// Pod CIDRs the cloud gives its instances.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PodCidrConfig {
    /// The ranges instances' pod CIDRs come from, at most one per IP family: each instance
    /// without `pod_cidrs` of its own gets the next free one of each, in the order added.
    pub pools: Vec<String>,
    /// The prefix length of an IPv4 pod CIDR.
    pub mask_v4: u8,
    /// The prefix length of an IPv6 pod CIDR.
    pub mask_v6: u8,
    /// Whether the cloud routes them itself (`InstancesCapabilities.pod_cidrs_routed`).
    pub routed: bool,
}

impl Default for PodCidrConfig {
    fn default() -> Self {
        Self { pools: vec!["10.200.0.0/16".into()], mask_v4: 24, mask_v6: 80, routed: true }
    }
}

impl Config {
    /// Reads a TOML file.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        use anyhow::Context;
        let text = std::fs::read_to_string(path).with_context(|| format!("reading sim config {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing sim config {}", path.display()))
    }
}

/// Latency, rate limit and consistency of the cloud's API.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ApiConfig {
    /// Fixed latency of every call, in milliseconds.
    pub latency_ms: u64,
    /// Extra latency, uniformly random between 0 and this, in milliseconds.
    pub jitter_ms: u64,
    /// Account-wide rate limit; unset means unlimited.
    pub rate_limit: Option<RateLimit>,
    /// Leaves the rate limit out of the plugin's capabilities (`call_rate`), so that the core
    /// learns it from refusals only, as with a provider that does not declare it. By default
    /// the rate limit the sim starts with is declared (one set later through the admin API
    /// is not: the core finds it out from RetryInfo, as it would a cloud busier than it said).
    pub undeclared_rate_limit: bool,
    /// How long a write takes to show in reads, in milliseconds (eventual consistency).
    pub consistency_delay_ms: u64,
}

/// A token-bucket rate limit over all cloud calls.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    /// Calls per second.
    pub rps: f64,
    /// Calls that may burst above the rate.
    pub burst: u32,
}

/// An injected fault.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    /// The method, as in `CreateRoute`, or `*` for every cloud call.
    pub method: String,
    /// The share of calls that fail, 0.0 to 1.0 (ignored when `down`).
    #[serde(default)]
    pub error_rate: f64,
    /// Every call fails.
    #[serde(default)]
    pub down: bool,
    /// The error answered.
    #[serde(default)]
    pub code: FaultCode,
    /// Only calls about objects whose name contains this (a load balancer, a route).
    #[serde(default)]
    pub subject: Option<String>,
    /// The RetryInfo delay the error carries, in milliseconds: for `rate_limited` (1 s when
    /// unset) and `unavailable` (none when unset), to drive a core with a hint of a chosen
    /// length.
    #[serde(default)]
    pub retry_after_ms: Option<u64>,
    /// Every matching call first waits this long, in milliseconds (a hang, when longer than
    /// the caller's deadline), then answers as it otherwise would.
    #[serde(default)]
    pub delay_ms: Option<u64>,
    /// Matching calls succeed with a wrong answer of this kind (see [`Lie`]).
    #[serde(default)]
    pub lie: Option<Lie>,
}

/// A wrong answer the sim gives on purpose, to test what a caller does with one.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Lie {
    /// Instance reads say every instance is gone.
    AllGone,
    /// Batch answers (instance metadata, tags, route tables) come in reverse order.
    Reorder,
    /// Batch answers lack their last item (the SDK refuses to send that: the call fails).
    ShortBatch,
    /// Instance metadata carries providerIDs of another scheme (`other://`).
    OtherScheme,
    /// Instance addresses and load balancer ingress IPs are not IPs.
    InvalidIps,
    /// Listings (instances, routes, load balancers) are empty.
    EmptyListing,
    /// Listings answer their first page again and again, with the same next-page token.
    RepeatedPageToken,
    /// The load balancer listing ignores the cluster asked for: every cluster's are listed.
    EveryCluster,
}

/// The error an injected fault answers.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FaultCode {
    /// UNAVAILABLE.
    #[default]
    Unavailable,
    /// INTERNAL.
    Internal,
    /// RESOURCE_EXHAUSTED with RetryInfo (throttling).
    RateLimited,
    /// DEADLINE_EXCEEDED.
    DeadlineExceeded,
}

/// One instance.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct InstanceSpec {
    /// The cloud's id, like `i-0001`.
    pub id: String,
    /// The name the instance is known by in the cluster (its host name).
    pub name: String,
    /// The zone.
    #[serde(default = "default_zone")]
    pub zone: String,
    /// The instance type.
    #[serde(default = "default_type")]
    pub instance_type: String,
    /// running, stopped, terminated or pending.
    #[serde(default)]
    pub state: State,
    /// Addresses; empty means an InternalIP is assigned from 10.0.0.0/16.
    #[serde(default)]
    pub addresses: Vec<Address>,
    /// Tags.
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    /// Its pod CIDRs from the cloud (with `[pod_cidrs]`); empty: the next of each pool.
    #[serde(default)]
    pub pod_cidrs: Vec<String>,
    /// Labels the cloud offers for the instance's Node beside zone, region and type
    /// (`additional_labels`; the core drops those in the `kubernetes.io` and `k8s.io` domains).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The instance has no addresses at all (none is assigned), as one whose network is not
    /// attached yet.
    #[serde(default)]
    pub no_addresses: bool,
    /// How metadata reads answer about this instance, to drive a core through a provider's
    /// odd but possible answers.
    #[serde(default)]
    pub answer: Answer,
}

impl Default for InstanceSpec {
    fn default() -> Self {
        Self {
            id: String::new(),
            name: String::new(),
            zone: default_zone(),
            instance_type: default_type(),
            state: State::default(),
            addresses: Vec::new(),
            tags: BTreeMap::new(),
            labels: BTreeMap::new(),
            no_addresses: false,
            pod_cidrs: Vec::new(),
            answer: Answer::default(),
        }
    }
}

/// How metadata reads answer about an instance.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Answer {
    /// Truthfully.
    #[default]
    Normal,
    /// With the metadata but an empty providerID.
    EmptyProviderId,
    /// With neither metadata nor an error (as a Go provider whose InstanceMetadata returns
    /// nil, nil): through the protocol, "no such instance".
    NoMetadata,
}

fn default_zone() -> String {
    "sim-region-1a".into()
}

fn default_type() -> String {
    "sim.standard".into()
}

/// An instance's state.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Being created.
    Pending,
    /// Running.
    #[default]
    Running,
    /// Stopped.
    Stopped,
    /// Terminated.
    Terminated,
}

/// An address.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Address {
    /// InternalIP, ExternalIP, Hostname, InternalDNS or ExternalDNS.
    #[serde(rename = "type")]
    pub kind: String,
    /// The address.
    pub address: String,
}

/// One route table.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RouteTableSpec {
    /// Its id.
    pub id: String,
    /// Its name.
    #[serde(default)]
    pub name: String,
    /// Its quota; 0 means unlimited.
    #[serde(default)]
    pub max_routes: u32,
    /// The zones whose nodes' routes go into this table; empty means every zone.
    #[serde(default)]
    pub zones: Vec<String>,
}

/// Load balancer behaviour.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LoadBalancerConfig {
    /// The CIDRs load balancer addresses come from.
    pub address_pool: Vec<String>,
    /// The longest name accepted.
    pub max_name_length: u32,
    /// The characters a name may contain; empty means lowercase letters, digits and '-'.
    pub allowed_name_characters: String,
    /// Whether BatchUpdateLoadBalancerHosts is advertised
    /// (`LoadBalancersCapabilities.bulk_update_hosts`): many load balancers' hosts in one cloud
    /// call, as clouds whose load balancers share a backend pool do.
    pub bulk_hosts: bool,
    /// Whether `LoadBalancersCapabilities.pod_endpoints` is advertised without a data plane
    /// (with one it always is): the core then sends the pods of ports without a node port,
    /// which the admin state shows.
    pub pod_endpoints: bool,
    /// The `loadBalancerClass` values advertised (`LoadBalancersCapabilities.classes`).
    pub classes: Vec<String>,
    /// Whether ListLoadBalancers is advertised (`LoadBalancersCapabilities.list`); without it
    /// the sim is a provider that cannot list, as every Go provider the adapter serves.
    pub list: bool,
    /// Whether the listing and GetLoadBalancer report each load balancer's backends
    /// (`hosts`), so that the core notices a backend removed by hand.
    pub report_hosts: bool,
}

impl Default for LoadBalancerConfig {
    fn default() -> Self {
        Self {
            address_pool: vec!["203.0.113.0/24".into()],
            max_name_length: 32,
            allowed_name_characters: String::new(),
            bulk_hosts: false,
            pod_endpoints: false,
            classes: Vec::new(),
            list: true,
            report_hosts: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_is_a_working_default() {
        let c: Config = toml::from_str("").expect("parse");
        assert_eq!(c, Config::default());
    }

    #[test]
    fn the_example_parses_and_registry_passwords_stay_out_of_logs() {
        let text = include_str!("../examples/conformance.toml");
        let config: Config = toml::from_str(text).expect("example parses");
        let cred = config.registry_credentials.first().expect("one credential");
        assert_eq!(
            (cred.registry.as_str(), cred.cache_key_type, cred.cache_seconds),
            ("*.registry.sim.dev", CacheKey::Registry, 3600)
        );
        let shown = format!("{config:?}");
        assert!(!shown.contains("sim-registry-token") && shown.contains("<redacted>"), "{shown}");
    }

    #[test]
    fn full_file_parses_and_typos_are_rejected() {
        let text = r#"
            region = "eu-1"
            [api]
            latency_ms = 5
            jitter_ms = 2
            rate_limit = { rps = 20.0, burst = 40 }
            consistency_delay_ms = 100
            [[faults]]
            method = "CreateRoute"
            error_rate = 0.5
            code = "internal"
            [[instances]]
            id = "i-1"
            name = "node-1"
            state = "stopped"
            addresses = [{ type = "InternalIP", address = "10.0.0.5" }]
            tags = { team = "a" }
            [[route_tables]]
            id = "rt-a"
            max_routes = 3
            zones = ["eu-1a"]
        "#;
        let c: Config = toml::from_str(text).expect("parse");
        assert_eq!(c.api.rate_limit, Some(RateLimit { rps: 20.0, burst: 40 }));
        assert_eq!(c.instances[0].state, State::Stopped);
        assert_eq!(c.faults[0].code, FaultCode::Internal);
        assert!(toml::from_str::<Config>("[api]\nlatency = 5").is_err());
    }
}

/// Credentials for one registry pattern. Debug output hides the password.
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RegistryCredentialSpec {
    /// The registry match pattern, like `*.registry.sim.dev` or `registry.sim.dev/team`.
    pub registry: String,
    /// The user name.
    pub username: String,
    /// The password or token.
    pub password: String,
    /// What the credentials apply to in the kubelet's cache.
    #[serde(default)]
    pub cache_key_type: CacheKey,
    /// How long they may be cached, in seconds.
    #[serde(default = "default_cache_seconds")]
    pub cache_seconds: u64,
}

impl std::fmt::Debug for RegistryCredentialSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryCredentialSpec")
            .field("registry", &self.registry)
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .field("cache_key_type", &self.cache_key_type)
            .field("cache_seconds", &self.cache_seconds)
            .finish()
    }
}

fn default_cache_seconds() -> u64 {
    3600
}

/// The cache key type of registry credentials.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum CacheKey {
    /// The image only.
    Image,
    /// Every image of the registry.
    #[default]
    Registry,
    /// Every image.
    Global,
}
