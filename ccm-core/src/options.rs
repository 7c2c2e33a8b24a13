//! Command-line flags, named as in the upstream cloud-controller-manager where a user would
//! look for them. No provider-specific flag: a provider's settings belong to its sidecar.
//!
//! Boolean flags take `--flag`, `--flag=true` and `--flag=false`, as upstream's (pflag) do;
//! `--flag false` (a separate word) is refused, since pflag would read it as `--flag` and a
//! stray argument.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// The canonical name of a controller from any of its spellings: the canonical name, the
/// alias upstream accepts in `--controllers`, or the name kube-controller-manager used
/// (`route-controller`, `service-controller`) in leader migration configurations.
pub fn canonical_controller(name: &str) -> Option<&'static str> {
    crate::controllers::registry::find(name).map(|c| c.name)
}

/// The controllers' ServiceAccounts (`--service-account-names`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ServiceAccountNames {
    /// Upstream's: `node-controller`, `route-controller`, `service-controller`.
    Upstream,
    /// One per controller, by its name.
    Controller,
}

/// How load balancers are named (`--load-balancer-naming`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LoadBalancerNaming {
    /// `a` and the Service UID without dashes, 32 characters (upstream's).
    Upstream,
    /// `<cluster>-<namespace>-<name>-<hash of the UID>`.
    Readable,
}

/// Flags that each parse but not together, or name what does not exist: the message says
/// which flag and why, for the operator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidFlags(pub String);

impl From<String> for InvalidFlags {
    fn from(why: String) -> Self {
        Self(why)
    }
}

impl From<&str> for InvalidFlags {
    fn from(why: &str) -> Self {
        Self(why.to_string())
    }
}

/// Parses `key=value` pairs separated by commas (`--instance-tags`): keys non-empty, each
/// once; values may be empty.
pub fn parse_tags(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut tags = BTreeMap::new();
    for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').ok_or_else(|| format!("{pair:?} is not key=value"))?;
        let k = k.trim();
        if k.is_empty() {
            return Err(format!("{pair:?} has an empty key"));
        }
        if tags.insert(k.to_string(), v.trim().to_string()).is_some() {
            return Err(format!("tag {k:?} is given twice"));
        }
    }
    Ok(tags)
}

/// Parses a duration such as `300ms`, `10s`, `5m`, `1h30m` or `1h 30m`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| format!("{text:?} is not a duration (like 10s, 5m, 1h30m): {e}"))?;
    // Longer is no useful setting, and a deadline of centuries overflows the clock.
    if d > MAX_DURATION {
        return Err(format!("{text:?} is longer than a year"));
    }
    Ok(d)
}

/// The longest duration a flag takes.
const MAX_DURATION: Duration = Duration::from_secs(366 * 24 * 3600);

/// The generic cloud-controller-manager.
#[derive(Debug, Clone, Parser)]
// A flag given twice takes its last value, as upstream's (pflag) do: an operator's extra
// arguments may repeat what a chart or manifest sets.
#[command(name = "cloud-controller-manager", about, long_about = None, disable_version_flag = true, args_override_self = true)]
pub struct Options {
    /// Without a command: run the controllers.
    #[command(subcommand)]
    pub command: Option<Command>,

    /// `--version`: print the version as upstream's does (`Kubernetes v1.37.2`, the
    /// Kubernetes release this core is built against, then ours and the commit) and exit;
    /// `--version=raw`: every field, as upstream's; `--version=vX.Y.Z`: report that version.
    #[arg(long, value_name = "true|raw|vX.Y.Z", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub version: Option<String>,

    /// Path to a kubeconfig; in-cluster configuration when unset.
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,

    /// The provider sidecar's endpoint: unix:///path/provider.sock, http://host:port, or
    /// https://host:port with mutual TLS (the --provider-tls-* files). Repeat it as
    /// `NAME=ENDPOINT` for several providers in one cluster (a cloud and bare metal, two
    /// clouds): each Node goes to the provider of its providerID's scheme (before it has one:
    /// of its `ccm-rs.dev/provider=NAME` label, else the one provider whose name lookup finds
    /// it), each LoadBalancer Service to the provider of its loadBalancerClass. NAME is a DNS
    /// label, used in logs, metrics, /readyz and that Node label.
    #[arg(long, value_name = "[NAME=]ENDPOINT", default_value = "unix:///var/run/ccm/provider.sock")]
    pub provider_endpoint: Vec<String>,

    /// With several providers: the one whose load balancers serve Services without a
    /// loadBalancerClass (and those of --load-balancer-class); the first --provider-endpoint
    /// by default.
    #[arg(long, value_name = "NAME")]
    pub default_load_balancer_provider: Option<String>,

    /// Leave LoadBalancer Services without a loadBalancerClass to others: only Services of a
    /// class a provider advertises (or of --load-balancer-class) get a load balancer.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub ignore_unclassed_services: bool,

    /// Providers (comma-separated names, or `*` for all) whose load balancers get every Node as
    /// a backend, not only their own Nodes: a cloud load balancer in front of bare-metal Nodes
    /// reached by IP.
    #[arg(long, value_delimiter = ',', value_name = "NAME")]
    pub load_balancer_backends_all_nodes: Vec<String>,

    /// With several providers: the one that programs the routes of every Node's podCIDR, when
    /// the pod network spans them all. Unset, each provider programs its own Nodes' routes.
    #[arg(long, value_name = "NAME")]
    pub routes_provider: Option<String>,

    /// With several providers: the providers (comma-separated) asked, in this order, whether they know the
    /// instance of a Node that has neither providerID nor `ccm-rs.dev/provider` label (all of
    /// them, in --provider-endpoint order, by default). Exactly one that knows it takes the
    /// Node; two are an error (a Warning Event `ProviderConflict`; the Node stays uninitialised).
    #[arg(long, value_delimiter = ',', value_name = "NAME")]
    pub node_provider_lookup_order: Vec<String>,

    /// Mutual TLS to a provider over TCP: the core's client certificate (PEM). With
    /// --provider-tls-key-file and --provider-tls-ca-file; the endpoint is then https://.
    #[arg(long, value_name = "FILE", requires_all = ["provider_tls_key_file", "provider_tls_ca_file"])]
    pub provider_tls_cert_file: Option<PathBuf>,

    /// The private key of --provider-tls-cert-file (PEM).
    #[arg(long, value_name = "FILE", requires = "provider_tls_cert_file")]
    pub provider_tls_key_file: Option<PathBuf>,

    /// The CA that signed the provider's certificate (PEM).
    #[arg(long, value_name = "FILE", requires = "provider_tls_cert_file")]
    pub provider_tls_ca_file: Option<PathBuf>,

    /// The name the provider's certificate must be for; the endpoint's host by default.
    #[arg(long, value_name = "NAME", requires = "provider_tls_cert_file")]
    pub provider_tls_server_name: Option<String>,

    /// Accept a plaintext `tcp://` or `http://` provider endpoint on another host. Refused by
    /// default: every call (Nodes, load balancers, and the power to change them) would cross
    /// the network in the clear. A unix socket or loopback TCP needs no flag.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub provider_allow_insecure_tcp: bool,

    /// The user id a provider on a unix socket runs as (`[NAME=]UID`, one per provider): the
    /// core checks the peer's credentials (SO_PEERCRED) on every connection and refuses
    /// another process that took the socket's place. Unchecked when unset.
    #[arg(long, value_name = "[NAME=]UID")]
    pub provider_peer_uid: Vec<String>,

    /// A provider's metrics endpoint (`[NAME=]unix:///path/metrics.sock`, one per provider):
    /// served again at `/metrics/providers/NAME` on the secure port, behind the checks of
    /// `/metrics`, so that the provider's metrics need not listen on the network.
    #[arg(long, value_name = "[NAME=]unix:///PATH")]
    pub provider_metrics: Vec<String>,

    /// Hands a provider a Kubernetes token of its own ServiceAccount (`NAMESPACE/NAME=DIR`):
    /// requested with TokenRequest (ten minutes, renewed every three) and written with `ca.crt` and `namespace` into DIR, a
    /// volume the provider mounts read-only at /var/run/secrets/kubernetes.io/serviceaccount.
    /// The provider then holds no credential of the core's.
    #[arg(long, value_name = "NAMESPACE/NAME=DIR")]
    pub provider_token: Vec<String>,

    /// Deadline of each provider call that reads.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub provider_call_timeout: Duration,

    /// Deadline of each provider call that changes the cloud (load balancers ensured, updated
    /// or deleted, routes created or deleted): longer than a slow cloud's create, because a
    /// mutation whose caller gave up may still be running in the provider. A mutation that
    /// times out is never retried inside the call; its work queue retries it after a backoff,
    /// and the provider (the SDK, the Go adapter) runs one mutation per object at a time.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_duration)]
    pub provider_mutation_timeout: Duration,

    /// Most provider calls in flight at once.
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub provider_max_concurrency: usize,

    /// The longest RetryInfo delay a provider's answer may impose; longer ones are cut to it
    /// (a delay of hours, by a bug or a hostile answer, would otherwise park every reconcile).
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_duration)]
    pub provider_max_retry_after: Duration,

    /// The longest the controllers' Kubernetes client waits for the API server to send
    /// anything on a connection (a write's answer, the next byte of a watch) before it gives
    /// the connection up: a half-open connection (a NAT or load balancer that forgot it) then
    /// fails writes and watches instead of hanging them for ever. Watches are renewed every
    /// this long less 15 s, so a quiet one is never taken for a dead one. At least 20s.
    #[arg(long, value_name = "DURATION", default_value = "75s", value_parser = parse_duration)]
    pub kube_api_read_timeout: Duration,

    /// `/readyz` fails while the Node or Service watch has been failing this long (the
    /// caches it serves from are going stale; a watch silent past `--kube-api-read-timeout`
    /// fails).
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    pub watch_failure_threshold: Duration,

    /// The cluster's name, passed to the provider to tag what it creates.
    #[arg(long, default_value = "kubernetes")]
    pub cluster_name: String,

    /// Controllers to run: `*` for all, `name` to enable, `-name` to disable
    /// (cloud-node-controller, cloud-node-lifecycle-controller, node-route-controller,
    /// service-lb-controller, node-ipam-controller with --allocate-node-cidrs, or their short
    /// names cloud-node, cloud-node-lifecycle, route, service, nodeipam), and
    /// tagging-controller (`tagging`, as AWS's chart names it) with --instance-tags or
    /// --instance-tags-from-labels.
    #[arg(long, value_delimiter = ',', default_value = "*")]
    pub controllers: Vec<String>,

    /// Nodes the node controllers initialise concurrently (batched into one provider call
    /// when the provider supports batch reads).
    #[arg(long, default_value_t = 4)]
    pub concurrent_node_syncs: usize,

    /// How often Node addresses are refreshed from the provider (batched reads).
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_duration)]
    pub node_status_update_frequency: Duration,

    /// How often the lifecycle controller checks NotReady Nodes' instances.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    pub node_monitor_period: Duration,

    /// Most Nodes the lifecycle controller deletes (or takes out of service) in any
    /// `--node-deletion-window`. More Nodes whose instance is gone wait, oldest first, for
    /// room in the window (a Normal Event `NodeDeletionDeferred` each and
    /// `ccm_node_deletions{outcome="deferred"}`), so a mass termination is cleaned up at this
    /// pace. 0 never deletes a Node.
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub max_node_deletions: usize,

    /// The same bound as a share of the Nodes (rounded up, at least one Node): 0.1 lets at
    /// most a tenth of the cluster be deleted in one window.
    #[arg(long, value_name = "SHARE", default_value_t = 0.1)]
    pub max_node_deletion_share: f64,

    /// The window over which `--max-node-deletions` is counted: a rate, not a bound per pass.
    #[arg(long, value_name = "DURATION", default_value = "1m", value_parser = parse_duration)]
    pub node_deletion_window: Duration,

    /// A zone (`topology.kubernetes.io/zone`) whose NotReady Nodes are at least this share of
    /// its Nodes (and more than two) is partially disrupted: the lifecycle controller deletes
    /// no Node of it, nor any Node while every Node is NotReady, more than two (an outage of the
    /// API server or the network, not of the instances), as kube-controller-manager's disruption modes
    /// (this is its `--unhealthy-zone-threshold`).
    #[arg(long, value_name = "SHARE", default_value_t = 0.55)]
    pub unhealthy_zone_threshold: f64,

    /// Off unless set. A NotReady Node whose instance the provider has reported shut down in
    /// every answer for this long (two answers at least) gets the taint
    /// `node.kubernetes.io/out-of-service=nodeshutdown:NoExecute`, so that
    /// kube-controller-manager force-deletes its pods and detaches their volumes (non-graceful
    /// node shutdown) without a person applying it. Under the same bounds as Node deletion
    /// (`--max-node-deletions`, `--max-node-deletion-share`, disrupted zones, a provider that
    /// calls Ready Nodes' instances shut down is not believed); the taint is removed, only when
    /// this controller added it, once the instance runs and the Node is Ready again.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub out_of_service_after: Option<Duration>,

    /// Label selector of Nodes the node controllers leave alone (for example virtual-kubelet
    /// nodes: `type=virtual-kubelet`). Repeatable: a Node matching any of them is left alone.
    #[arg(long, value_name = "SELECTOR")]
    pub node_exclude_selector: Vec<String>,

    /// Prefix under which instance tags become Node labels (`<prefix>/<tag>`); empty disables.
    #[arg(long, default_value = "tags.cloudprovider.dev")]
    pub node_tag_label_prefix: String,

    /// Tags the tagging controller writes to every Node's instance, as `key=value` pairs
    /// separated by commas (repeatable): the cluster's billing and ownership tags. Only keys
    /// it wrote itself (recorded on the Node, `ccm-rs.dev/instance-tags`) are ever updated or
    /// removed; a key dropped from the flag is removed from the instances; a tag of the same
    /// key the instance already has with another value is left alone (a Warning Event).
    /// Needs a provider that writes tags (`TagsCapabilities.set_tags`).
    #[arg(long, value_name = "KEY=VALUE,...", value_parser = parse_tags)]
    pub instance_tags: Vec<BTreeMap<String, String>>,

    /// Node labels the tagging controller copies to the Node's instance as tags of the same
    /// key and value (comma-separated label keys, repeatable), on the same terms as
    /// --instance-tags; on a Node that has one, it wins over --instance-tags of its key.
    #[arg(long, value_name = "LABEL,...", value_delimiter = ',')]
    pub instance_tags_from_labels: Vec<String>,

    /// Services the service controller reconciles at once. Enough to keep a cloud's rate
    /// limit busy when each sync is slow (a large cluster's node set in every
    /// EnsureLoadBalancer, two API writes around it); a provider that declares its call rate
    /// is never sent calls faster than that however many run.
    #[arg(long, default_value_t = 8)]
    pub concurrent_service_syncs: usize,

    /// Handle LoadBalancer Services of this `spec.loadBalancerClass` (besides those without
    /// one). Services of any other class are never touched.
    #[arg(long, value_name = "CLASS")]
    pub load_balancer_class: Option<String>,

    /// How a Service's load balancer is named. `upstream` (the default): `a` and the Service
    /// UID without dashes, 32 characters, as upstream's cloud-controller-manager and most
    /// clouds name it, so a cluster moving from it keeps its load balancers. `readable`:
    /// `<cluster>-<namespace>-<name>-<hash>` within the provider's limits. The name a load
    /// balancer was made under is recorded on its Service and kept when this flag changes
    /// (see --allow-load-balancer-renaming).
    #[arg(long, value_enum, value_name = "NAMING", default_value_t = LoadBalancerNaming::Upstream)]
    pub load_balancer_naming: LoadBalancerNaming,

    /// Let a change of --load-balancer-naming rename existing load balancers: each is made
    /// anew under the new name (a new address on most clouds) and the old one deleted.
    /// Without it, a load balancer keeps the name it was made under.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub allow_load_balancer_renaming: bool,

    /// How often the service controller lists the provider's load balancers to find those
    /// whose Service is gone (deleted without its finalizer, or while no core ran): at start,
    /// then at a random time between this period and twice it. One ListLoadBalancers page per
    /// 100 load balancers; `0s` sweeps only at start. Needs a provider that advertises
    /// listing.
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = parse_duration)]
    pub load_balancer_resync_period: Duration,

    /// Most orphaned load balancers one sweep deletes. A sweep that finds more deletes none
    /// of them (a log line and `ccm_load_balancer_orphans{outcome="refused"}` say so): that
    /// many Services gone at once is more likely a wrong answer than a fact.
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub max_load_balancer_deletions: usize,

    /// How often load balancers are checked for changes behind the core's back when the
    /// provider cannot list them: one GetLoadBalancer per load balancer this process made,
    /// spread evenly over the period (200 Services at 24h: 8.3 calls an hour). A load balancer
    /// found gone is made again, one whose reported backends drifted is given its own again.
    /// A provider that lists load balancers is checked at every sweep instead
    /// (--load-balancer-resync-period), at no extra call, unless that is `0s`. `0s` turns the
    /// reads off.
    #[arg(long, value_name = "DURATION", default_value = "24h", value_parser = parse_duration)]
    pub load_balancer_repair_period: Duration,

    /// Most load balancers made again (found gone from the cloud) in one sweep, or in one
    /// --load-balancer-repair-period without listing; the rest wait for the next. A listing
    /// that misses every load balancer this process made (more than one) makes none again:
    /// that is far likelier a wrong answer than a fact.
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub max_load_balancer_repairs: usize,

    /// Only handle Services in this namespace (all namespaces when unset), for example to run
    /// a second cloud-controller-manager for one team's load balancers.
    #[arg(long, value_name = "NAMESPACE")]
    pub service_namespace: Option<String>,

    /// Program pod-network routes for Nodes' podCIDRs (when the provider serves Routes).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = true)]
    pub configure_cloud_routes: bool,

    /// The cluster's pod CIDRs (one, or an IPv4 and an IPv6 one for dual-stack); routes
    /// outside them are never touched. Required for routes.
    #[arg(long, value_delimiter = ',', value_name = "CIDR")]
    pub cluster_cidr: Vec<String>,

    /// The prefix length of the podCIDR the node IPAM controller gives each Node from an IPv4
    /// --cluster-cidr (--allocate-node-cidrs); 24 by default. --node-cidr-mask-size-ipv4 wins.
    #[arg(long, value_name = "BITS")]
    pub node_cidr_mask_size: Option<u8>,

    /// The same for IPv4 (24 by default).
    #[arg(long, value_name = "BITS")]
    pub node_cidr_mask_size_ipv4: Option<u8>,

    /// The same for IPv6 (64 by default).
    #[arg(long, value_name = "BITS")]
    pub node_cidr_mask_size_ipv6: Option<u8>,

    /// The shortest interval between two full route reconciles. Node changes trigger
    /// reconciles (there is no timer); changes within this interval share one. In a large
    /// cluster the interval can be longer: 4 times the last reconcile's own computation, so that
    /// reconciles take at most a quarter of a CPU.
    #[arg(long, value_name = "DURATION", default_value = "500ms", value_parser = parse_duration)]
    pub route_min_interval: Duration,

    /// Upstream's flag, with upstream's meaning: the routes are listed and reconciled every
    /// period, on top of the reconciles Node changes trigger (one ListRoutes per table each
    /// time: upstream's 10 s is 360 an hour). Unset (the default), the only listing is the
    /// safety resync of --route-resync-period.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub route_reconciliation_period: Option<Duration>,

    /// How long after the first Node change of a burst the route reconcile starts, so that
    /// the rest of the burst shares it.
    #[arg(long, value_name = "DURATION", default_value = "100ms", value_parser = parse_duration)]
    pub route_coalesce_delay: Duration,

    /// The safety resync that re-lists the cloud's routes: at a random time between this
    /// period and twice it (12h to 24h by default). Between resyncs no route is listed.
    #[arg(long, value_name = "DURATION", default_value = "12h", value_parser = parse_duration)]
    pub route_resync_period: Duration,

    /// Route creations and deletions in flight at once.
    #[arg(long, default_value_t = 8)]
    pub concurrent_route_syncs: usize,

    /// Most stale routes one route reconcile deletes; the rest go at the next reconcile, one
    /// `--route-min-interval` later. (A route is stale only when its Node is gone
    /// from the API or its podCIDR changed.)
    #[arg(long, value_name = "N", default_value_t = 50)]
    pub max_route_deletions: usize,

    /// Delay after a reconcile's first failure; doubles per failure.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    pub reconcile_backoff_base: Duration,

    /// Longest delay between retries of a failing reconcile.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_duration)]
    pub reconcile_backoff_max: Duration,

    /// Writes per second to the Kubernetes API, per controller (each has a budget of its own,
    /// as each of upstream's controllers has a client of its own); Events have as much again.
    #[arg(long, default_value_t = 20.0)]
    pub kube_api_qps: f32,

    /// Burst of writes to the Kubernetes API, per controller.
    #[arg(long, default_value_t = 30)]
    pub kube_api_burst: u32,

    /// Run controllers only while holding the leader lease.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = true)]
    pub leader_elect: bool,

    /// How long a lease is held without renewal.
    #[arg(long, value_name = "DURATION", default_value = "15s", value_parser = parse_duration)]
    pub leader_elect_lease_duration: Duration,

    /// How long the leader keeps trying to renew before it gives up (and the process stops).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub leader_elect_renew_deadline: Duration,

    /// How often to try to acquire or renew the lease.
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = parse_duration)]
    pub leader_elect_retry_period: Duration,

    /// The Lease's name.
    #[arg(long, default_value = "cloud-controller-manager")]
    pub leader_elect_resource_name: String,

    /// The Lease's namespace.
    #[arg(long, default_value = "kube-system")]
    pub leader_elect_resource_namespace: String,

    /// One Lease per controller (`<--leader-elect-resource-name>-<controller>`) instead of one
    /// for all, so that different replicas can lead different controllers and share the work.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub leader_elect_per_controller: bool,

    /// Take part in leader migration from kube-controller-manager: controllers that move run
    /// only while this process holds the migration Lease, which kube-controller-manager
    /// (started with the same flag and configuration) competes for too.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub enable_leader_migration: bool,

    /// A LeaderMigrationConfiguration file (controllermanager.config.k8s.io/v1); without it,
    /// upstream's default: route, service and cloud-node-lifecycle move under the Lease
    /// `cloud-provider-extraction-migration`.
    #[arg(long, value_name = "FILE")]
    pub leader_migration_config: Option<std::path::PathBuf>,

    /// Port of the HTTPS server for /healthz, /livez, /readyz and /metrics; 0 disables it.
    #[arg(long, default_value_t = 10258)]
    pub secure_port: u16,

    /// Address the server binds.
    #[arg(long, default_value = "0.0.0.0")]
    pub bind_address: IpAddr,

    /// The serving certificate (PEM, may hold the chain) of --secure-port; reloaded when the
    /// file changes. Without it a self-signed certificate is made at start.
    #[arg(long, value_name = "FILE", requires = "tls_private_key_file")]
    pub tls_cert_file: Option<PathBuf>,

    /// The private key (PEM) of --tls-cert-file.
    #[arg(long, value_name = "FILE", requires = "tls_cert_file")]
    pub tls_private_key_file: Option<PathBuf>,

    /// A kubeconfig with the right to create TokenReviews: bearer tokens sent to
    /// --secure-port are checked with it. Without it, in a cluster, the pod's own
    /// credentials are used (as upstream); elsewhere nobody can be checked, and only the
    /// always-allowed paths and `system:masters` pass (anonymous /metrics is 403).
    #[arg(long, value_name = "PATH")]
    pub authentication_kubeconfig: Option<PathBuf>,

    /// A kubeconfig with the right to create SubjectAccessReviews: each request's user must
    /// be allowed the path (for /metrics: `get` on the non-resource URL). Defaults as
    /// --authentication-kubeconfig.
    #[arg(long, value_name = "PATH")]
    pub authorization_kubeconfig: Option<PathBuf>,

    /// Paths served without authentication or authorisation (a trailing `*` matches a prefix).
    #[arg(long, value_delimiter = ',', default_value = "/healthz,/readyz,/livez")]
    pub authorization_always_allow_paths: Vec<String>,

    /// Serve plain HTTP on --secure-port instead of HTTPS (local runs and tests only).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub insecure_serving: bool,

    /// Run each controller with its own service account's credentials.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub use_service_account_credentials: bool,

    /// The ServiceAccounts of --use-service-account-credentials. `upstream` (the default):
    /// upstream's, so existing RBAC and audit rules apply: `node-controller` (node and node
    /// lifecycle controllers), `route-controller`, `service-controller`. `controller`: one per
    /// controller, by its name (`cloud-node-controller`, `cloud-node-lifecycle-controller`,
    /// `route-controller`, `service-lb-controller`).
    #[arg(long, value_enum, value_name = "NAMES", default_value_t = ServiceAccountNames::Upstream)]
    pub service_account_names: ServiceAccountNames,

    /// Feature gates, `Name=true,Other=false`: upstream's gates are accepted (those whose
    /// behaviour this core always has, or that concern only the API server libraries, with a
    /// log line), one asking for what this core lacks is refused, an unknown one is an error.
    #[arg(long, value_delimiter = ',')]
    pub feature_gates: Vec<String>,

    /// Upstream's flags with no counterpart above.
    #[command(flatten)]
    pub upstream: crate::compat::UpstreamFlags,

    /// Log format: `text`, or `json`: one JSON object a line with klog's keys (`ts`, `caller`,
    /// `msg`, `v`, `err`, objects as `{"name","namespace"}`), as upstream's
    /// `--logging-format=json`, which is accepted too.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,

    /// Log filter, as RUST_LOG (for example `info,ccm_core=debug`).
    #[arg(long, default_value = "info")]
    pub log_level: String,
}

/// What `cloud-controller-manager` does other than running the controllers.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum Command {
    /// For uninstalling: once no cloud-controller-manager holds its Lease any more, remove the
    /// load balancer finalizer from every Service (in --service-namespace, or all), so that
    /// Services can still be deleted. Cloud load balancers are left in place.
    ReleaseFinalizers {
        /// How long to wait for the leader to stop.
        #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
        wait: Duration,
    },
}

impl Options {
    /// Whether node IPAM takes podCIDRs from the cloud (`--cidr-allocator-type=CloudAllocator`).
    pub fn cloud_allocator(&self) -> bool {
        self.upstream.cidr_allocator_type.as_deref() == Some("CloudAllocator")
    }

    /// Whether the node IPAM controller gives Nodes their podCIDRs (`--allocate-node-cidrs`).
    pub fn allocate_node_cidrs(&self) -> bool {
        self.upstream.allocate_node_cidrs == Some(true)
    }

    /// The tags of `--instance-tags`, every occurrence together; a key given twice with two
    /// values is an error.
    pub fn instance_tags(&self) -> Result<BTreeMap<String, String>, String> {
        let mut all = BTreeMap::new();
        for tags in &self.instance_tags {
            for (k, v) in tags {
                if all.insert(k.clone(), v.clone()).is_some_and(|before| before != *v) {
                    return Err(format!("--instance-tags: tag {k:?} is given two values"));
                }
            }
        }
        Ok(all)
    }

    /// Whether the tagging controller has anything to write.
    pub fn tags_instances(&self) -> bool {
        !self.instance_tags.iter().all(BTreeMap::is_empty) || !self.instance_tags_from_labels.is_empty()
    }

    /// What the upstream flags given mean here, one log line each.
    pub fn upstream_notes(&self) -> Vec<String> {
        let mut notes = crate::compat::review_gates(&self.feature_gates).unwrap_or_default();
        notes.extend(self.upstream.review().unwrap_or_default());
        for entry in &self.controllers {
            if let Some(what) = crate::controllers::registry::provider_controller(entry.trim().trim_start_matches('-')) {
                notes.push(format!("--controllers: {}: {what}", entry.trim()));
            }
            let tagging =
                crate::controllers::registry::find(entry.trim()).is_some_and(|c| c.name == crate::controllers::tagging::NAME);
            if tagging && !self.tags_instances() {
                notes.push(format!(
                    "--controllers: {}: the tagging controller writes --instance-tags and --instance-tags-from-labels to \
                     the instances; with neither given it does not run (AWS's cloud-config tags are not read: give them \
                     as --instance-tags)",
                    entry.trim()
                ));
            }
        }
        if let Ok(crate::version::Request::Report(v)) = crate::version::request(self.version.as_deref()) {
            notes.push(format!("--version={v}: accepted; this core reports its version only in --version"));
        }
        notes
    }

    /// The log filter: --log-level, or klog's --v mapped onto it when --log-level is left at
    /// its default.
    pub fn log_filter(&self) -> String {
        match self.upstream.v {
            Some(v) if self.log_level == "info" => crate::compat::level_for(v).to_string(),
            _ => self.log_level.clone(),
        }
    }

    /// The log format: --log-format, or upstream's --logging-format.
    pub fn log_format(&self) -> &str {
        match &self.upstream.logging_format {
            Some(f) if self.log_format == "text" => f,
            _ => &self.log_format,
        }
    }

    /// The controllers to run, by full name, from `--controllers`.
    pub fn enabled_controllers(&self) -> Result<BTreeSet<&'static str>, InvalidFlags> {
        let resolve = |name: &str| {
            canonical_controller(name).ok_or_else(|| {
                let known: Vec<&str> = crate::controllers::registry::names().collect();
                format!("unknown controller {name:?} in --controllers (known: {})", known.join(", "))
            })
        };
        let mut enabled = BTreeSet::new();
        let mut disabled = BTreeSet::new();
        let mut star = false;
        for entry in self.controllers.iter().map(|c| c.trim()).filter(|c| !c.is_empty()) {
            if crate::controllers::registry::provider_controller(entry.trim_start_matches('-')).is_some() {
                continue; // a cloud's own controller: see upstream_notes
            }
            if entry == "*" {
                star = true;
            } else if let Some(name) = entry.strip_prefix('-') {
                disabled.insert(resolve(name)?);
            } else {
                enabled.insert(resolve(entry)?);
            }
        }
        if star {
            enabled.extend(crate::controllers::registry::names());
        }
        // Node IPAM runs only when asked for with --allocate-node-cidrs, as upstream's.
        enabled.retain(|name| crate::controllers::registry::named(name).is_some_and(|c| (c.starts)(self)));
        Ok(enabled.difference(&disabled).copied().collect())
    }

    /// The providers of `--provider-endpoint`: (name, endpoint) in order; the plain form is
    /// one provider named `default`.
    pub fn provider_endpoints(&self) -> Result<Vec<(String, String)>, InvalidFlags> {
        let mut endpoints: Vec<(String, String)> = Vec::new();
        let named = |e: &str| {
            let (name, endpoint) = e.split_once('=')?;
            (!name.contains(':') && !name.contains('/')).then(|| (name.to_string(), endpoint.to_string()))
        };
        for entry in &self.provider_endpoint {
            let (name, endpoint) = match named(entry) {
                Some(pair) => pair,
                None if self.provider_endpoint.len() == 1 => (crate::provider::DEFAULT_NAME.to_string(), entry.clone()),
                None => {
                    return Err(format!("--provider-endpoint {entry:?}: with several providers, each is NAME=ENDPOINT").into());
                }
            };
            if !ccm_protocol::labels::valid_label_value(&name) || name.is_empty() || name.contains('.') || name.contains('_') {
                return Err(format!(
                    "--provider-endpoint {entry:?}: the name {name:?} is not a DNS label (1 to 63 lowercase letters, digits and '-', \
                     starting and ending with a letter or digit)"
                )
                .into());
            }
            if name.chars().any(|c| c.is_ascii_uppercase()) {
                return Err(format!("--provider-endpoint {entry:?}: the name {name:?} must be lowercase").into());
            }
            if endpoints.iter().any(|(n, _)| *n == name) {
                return Err(format!("--provider-endpoint: the name {name:?} is given twice").into());
            }
            if endpoint.is_empty() {
                return Err(format!("--provider-endpoint {entry:?}: no endpoint after the name").into());
            }
            if let Err(error) = ccm_protocol::client::endpoint(&endpoint) {
                return Err(format!("--provider-endpoint {entry:?}: {error}").into());
            }
            if let Some((other, _)) = endpoints.iter().find(|(_, e)| *e == endpoint) {
                return Err(format!("--provider-endpoint: {other} and {name} are the same endpoint {endpoint}").into());
            }
            endpoints.push((name, endpoint));
        }
        let known = |flag: &str, name: &str| -> Result<(), InvalidFlags> {
            if endpoints.iter().any(|(n, _)| n == name) {
                Ok(())
            } else {
                let names: Vec<&str> = endpoints.iter().map(|(n, _)| n.as_str()).collect();
                Err(format!("{flag} {name:?} names no --provider-endpoint (they are: {})", names.join(", ")).into())
            }
        };
        if let Some(name) = &self.default_load_balancer_provider {
            known("--default-load-balancer-provider", name)?;
        }
        if let Some(name) = &self.routes_provider {
            known("--routes-provider", name)?;
        }
        let mut asked = Vec::new();
        for name in self.node_provider_lookup_order.iter().filter(|n| !n.is_empty()) {
            known("--node-provider-lookup-order", name)?;
            if asked.contains(&name) {
                return Err(format!("--node-provider-lookup-order names {name:?} twice").into());
            }
            asked.push(name);
        }
        if self.ignore_unclassed_services && self.default_load_balancer_provider.is_some() {
            return Err(
                "--ignore-unclassed-services and --default-load-balancer-provider: unclassed Services go to no provider, or to that one"
                    .into(),
            );
        }
        for name in self.load_balancer_backends_all_nodes.iter().filter(|n| *n != "*" && !n.is_empty()) {
            known("--load-balancer-backends-all-nodes", name)?;
        }
        Ok(endpoints)
    }

    /// The routing rules of several providers, from the flags.
    pub fn provider_rules(&self) -> crate::provider::set::Rules {
        crate::provider::set::Rules {
            default_load_balancer_provider: self.default_load_balancer_provider.clone(),
            ignore_unclassed: self.ignore_unclassed_services,
            class_flag: self.load_balancer_class.clone(),
            all_backends: self.load_balancer_backends_all_nodes.clone(),
            routes_provider: self.routes_provider.clone(),
            lookup_order: self.node_provider_lookup_order.iter().filter(|n| !n.is_empty()).cloned().collect(),
        }
    }

    /// Checks flag combinations that clap cannot.
    pub fn validate(&self) -> Result<(), InvalidFlags> {
        self.enabled_controllers()?;
        self.provider_endpoints()?;
        crate::provider::access::access(self)?;
        crate::compat::review_gates(&self.feature_gates)?;
        self.upstream.review()?;
        if self.leader_elect && self.leader_elect_renew_deadline >= self.leader_elect_lease_duration {
            return Err("--leader-elect-renew-deadline must be shorter than --leader-elect-lease-duration".into());
        }
        if self.leader_elect && self.leader_elect_retry_period >= self.leader_elect_renew_deadline {
            return Err("--leader-elect-retry-period must be shorter than --leader-elect-renew-deadline (a renewal must be tried before the lead is given up)".into());
        }
        if self.kube_api_read_timeout < Duration::from_secs(20) {
            return Err("--kube-api-read-timeout must be at least 20s".into());
        }
        if self.concurrent_node_syncs == 0 || self.provider_max_concurrency == 0 {
            return Err("--concurrent-node-syncs and --provider-max-concurrency must be at least 1".into());
        }
        for cidr in &self.cluster_cidr {
            cidr.parse::<ipnet::IpNet>().map_err(|_| format!("--cluster-cidr {cidr:?} is not a CIDR"))?;
        }
        if self.cluster_cidr.len() > 2 {
            return Err("--cluster-cidr takes at most two CIDRs (IPv4 and IPv6)".into());
        }
        for (flag, share) in [
            ("--max-node-deletion-share", self.max_node_deletion_share),
            ("--unhealthy-zone-threshold", self.unhealthy_zone_threshold),
        ] {
            if !(share > 0.0 && share <= 1.0) {
                return Err(format!("{flag} must be a share above 0 and at most 1, got {share}").into());
            }
        }
        if self.reconcile_backoff_base > self.reconcile_backoff_max {
            return Err("--reconcile-backoff-base must not exceed --reconcile-backoff-max".into());
        }
        // Checked here too (the controllers check them again when they start), so that a
        // check of the arguments alone (`CCM_CHECK_ARGS=1`) refuses what the process would.
        self.instance_tags()?;
        for selector in &self.node_exclude_selector {
            crate::labels::parse_selector(selector).map_err(|why| format!("--node-exclude-selector {selector:?}: {why}"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Options {
        Options::try_parse_from(std::iter::once("cloud-controller-manager").chain(args.iter().copied())).expect("parse")
    }

    #[test]
    fn upstream_defaults() {
        let o = parse(&[]);
        assert_eq!(o.secure_port, 10258);
        assert_eq!(o.node_status_update_frequency, Duration::from_secs(300));
        assert_eq!(o.node_monitor_period, Duration::from_secs(5));
        assert_eq!((o.kube_api_qps, o.kube_api_burst), (20.0, 30));
        assert_eq!(o.leader_elect_resource_name, "cloud-controller-manager");
        assert_eq!(o.leader_elect_resource_namespace, "kube-system");
        assert!(o.leader_elect);
        assert_eq!(o.enabled_controllers().expect("controllers").len(), 4);
    }

    #[test]
    fn provider_endpoints_are_one_plain_or_several_named() {
        let one = parse(&["--provider-endpoint=unix:///run/p.sock"]);
        assert_eq!(one.provider_endpoints().expect("ok"), vec![("default".into(), "unix:///run/p.sock".into())]);
        let two = parse(&[
            "--provider-endpoint=hcloud=unix:///run/hcloud.sock",
            "--provider-endpoint",
            "robot=http://127.0.0.1:9000",
            "--routes-provider=hcloud",
            "--node-provider-lookup-order=robot,hcloud",
        ]);
        let endpoints = two.provider_endpoints().expect("ok");
        assert_eq!(
            endpoints,
            vec![("hcloud".into(), "unix:///run/hcloud.sock".into()), ("robot".into(), "http://127.0.0.1:9000".into())]
        );
        assert!(two.validate().is_ok());
        let refused = |args: &[&str], says: &str| {
            let error = parse(args).validate().expect_err("refused").to_string();
            assert!(error.contains(says), "{args:?}: {error}");
        };
        refused(&["--provider-endpoint=a=unix:///a", "--provider-endpoint=unix:///b"], "each is NAME=ENDPOINT");
        refused(&["--provider-endpoint=a=unix:///a", "--provider-endpoint=a=unix:///b"], "given twice");
        refused(&["--provider-endpoint=A=unix:///a"], "lowercase");
        refused(&["--provider-endpoint=a.b=unix:///a"], "DNS label");
        refused(&["--provider-endpoint=a="], "no endpoint");
        refused(&["--provider-endpoint=a=notaurl"], "notaurl");
        refused(&["--provider-endpoint=a=b=unix:///b"], "b=unix");
        refused(&["--provider-endpoint=a=unix:///a", "--provider-endpoint=b=unix:///a"], "the same endpoint");
        refused(&["--provider-endpoint=ftp://x"], "ftp://x");
        refused(&["--provider-endpoint=a=unix:///a", "--routes-provider=b"], "--routes-provider \"b\" names no");
        refused(&["--provider-endpoint=a=unix:///a", "--default-load-balancer-provider=b"], "names no --provider-endpoint");
        refused(&["--provider-endpoint=a=unix:///a", "--node-provider-lookup-order=a,c"], "\"c\"");
        refused(&["--provider-endpoint=a=unix:///a", "--node-provider-lookup-order=a,a"], "names \"a\" twice");
        refused(
            &["--provider-endpoint=a=unix:///a", "--ignore-unclassed-services", "--default-load-balancer-provider=a"],
            "--ignore-unclassed-services and --default-load-balancer-provider",
        );
        let off = ["--provider-endpoint=a=unix:///a", "--ignore-unclassed-services=false", "--default-load-balancer-provider=a"];
        assert!(parse(&off).validate().is_ok(), "false is the default: no conflict");
        refused(&["--provider-endpoint=a=unix:///a", "--load-balancer-backends-all-nodes=z"], "\"z\"");
        assert!(parse(&["--provider-endpoint=a=unix:///a", "--load-balancer-backends-all-nodes=*"]).validate().is_ok());
    }

    #[test]
    fn controller_selection() {
        let o = parse(&["--controllers=*,-route,-service-lb-controller"]);
        let enabled: Vec<&str> = o.enabled_controllers().expect("ok").into_iter().collect();
        assert_eq!(enabled, vec!["cloud-node-controller", "cloud-node-lifecycle-controller"]);
        let o = parse(&["--controllers", "cloud-node"]);
        assert_eq!(o.enabled_controllers().expect("ok").into_iter().collect::<Vec<_>>(), vec!["cloud-node-controller"]);
        assert!(parse(&["--controllers=nodes"]).enabled_controllers().is_err());
        // AWS's chart: `tagging` is the core's tagging controller, which runs only with tags
        // to write (and says so when it has none).
        let o = parse(&["--controllers=*,tagging"]);
        assert_eq!(o.enabled_controllers().expect("ok").len(), 4);
        assert!(o.upstream_notes().iter().any(|n| n.starts_with("--controllers: tagging: the tagging controller")));
        let o = parse(&["--controllers=*,tagging", "--instance-tags=team=core,cost=42", "--instance-tags=env="]);
        assert!(o.enabled_controllers().expect("ok").contains("tagging-controller"));
        let tags = o.instance_tags().expect("tags");
        assert_eq!(tags.get("env").map(String::as_str), Some(""));
        assert_eq!(tags.len(), 3);
        assert!(parse(&["--instance-tags=a=1", "--instance-tags=a=2"]).instance_tags().is_err(), "two values of one tag");
        assert!(
            parse(&["--instance-tags=a=1", "--instance-tags=a=2"]).validate().is_err(),
            "refused by the check of the arguments"
        );
        assert!(parse(&["--node-exclude-selector=pool in (a"]).validate().is_err());
        assert!(parse(&["--node-exclude-selector=pool in (a,b)"]).validate().is_ok());
        assert!(Options::try_parse_from(["ccm", "--instance-tags=novalue"]).is_err());
        assert!(Options::try_parse_from(["ccm", "--instance-tags==x"]).is_err());
        let o = parse(&["--instance-tags-from-labels=team,example.com/owner"]);
        assert_eq!(o.instance_tags_from_labels, vec!["team".to_string(), "example.com/owner".into()]);
        assert!(o.enabled_controllers().expect("ok").contains("tagging-controller"), "`*` runs it with tags to write");
    }

    #[test]
    fn a_repeated_flag_takes_its_last_value_as_pflag() {
        let o = parse(&["--cluster-name=a", "--leader-elect=false", "--cluster-name=b", "--leader-elect"]);
        assert_eq!(o.cluster_name, "b");
        assert!(o.leader_elect);
        let o = parse(&["--log-format=json", "--log-format=text", "--node-monitor-period=1s", "--node-monitor-period=7s"]);
        assert_eq!((o.log_format.as_str(), o.node_monitor_period), ("text", Duration::from_secs(7)));
        // Lists add up, as pflag's string slices do.
        let o = parse(&["--controllers=cloud-node", "--controllers=route"]);
        assert_eq!(o.enabled_controllers().expect("ok").len(), 2);
        let o = parse(&["--feature-gates=WatchList=true", "--feature-gates=AllBeta=false"]);
        assert_eq!(o.feature_gates.len(), 2);
        // Upstream's flags too.
        let o = parse(&["--cloud-provider=aws", "--cloud-provider=external", "--v=2", "--v=4"]);
        assert_eq!((o.upstream.cloud_provider.as_deref(), o.upstream.v), (Some("external"), Some(4)));
    }

    #[test]
    fn boolean_flags_take_upstream_spellings() {
        let o = parse(&[]);
        assert!(o.leader_elect && o.configure_cloud_routes);
        assert!(!o.use_service_account_credentials && !o.insecure_serving && !o.leader_elect_per_controller);
        for on in [&["--use-service-account-credentials"][..], &["--use-service-account-credentials=true"]] {
            assert!(parse(on).use_service_account_credentials, "{on:?}");
        }
        assert!(!parse(&["--use-service-account-credentials=false"]).use_service_account_credentials);
        assert!(parse(&["--leader-elect"]).leader_elect);
        assert!(!parse(&["--leader-elect=false"]).leader_elect);
        assert!(!parse(&["--configure-cloud-routes=false"]).configure_cloud_routes);
        assert!(parse(&["--enable-leader-migration=true", "--leader-elect-per-controller=true"]).enable_leader_migration);
        assert!(parse(&["--insecure-serving=true"]).insecure_serving);
        assert!(Options::try_parse_from(["x", "--leader-elect", "false"]).is_err());
        assert!(Options::try_parse_from(["x", "--insecure-serving=maybe"]).is_err());
    }

    #[test]
    fn durations_and_validation() {
        let o = parse(&["--node-monitor-period=1m30s", "--leader-elect=false"]);
        assert_eq!(o.node_monitor_period, Duration::from_secs(90));
        assert!(!o.leader_elect);
        assert!(Options::try_parse_from(["x", "--node-monitor-period=soon"]).is_err());
        assert!(parse(&["--leader-elect-renew-deadline=20s"]).validate().is_err());
        assert!(parse(&["--feature-gates=Foo=true"]).validate().is_err());
        assert!(parse(&[]).validate().is_ok());
    }
}
