//! Upstream's flags: every flag of `k8s.io/cloud-provider`'s cloud-controller-manager (1.37)
//! that this core has no flag of its own for, so that an existing deployment's arguments
//! start it. Each is honoured (mapped onto this core's behaviour), accepted with a log line
//! saying what it means here, or refused with one sentence naming what to do instead; none
//! is silently ignored. Upstream's flags that are this core's own (`--controllers`,
//! `--kube-api-qps`, `--leader-elect*`, `--secure-port`…) are in [`crate::options`].

use std::path::PathBuf;

/// Upstream's flags this core takes for compatibility.
#[derive(Debug, Clone, Default, clap::Args)]
#[command(next_help_heading = "Upstream's flags (accepted for compatibility; see the operator guide)")]
pub struct UpstreamFlags {
    /// Upstream: the cloud provider's name. Here the provider is the sidecar at
    /// --provider-endpoint; `external` or the cloud's name is accepted and logged beside the
    /// plugin that answers.
    #[arg(long, value_name = "NAME")]
    pub cloud_provider: Option<String>,
    /// Upstream: the cloud's configuration file. It is the provider sidecar's: accepted and
    /// logged here; the chart passes it to the sidecar (mounted there at the same path).
    #[arg(long, value_name = "FILE")]
    pub cloud_config: Option<PathBuf>,
    /// klog verbosity: 0–3 log at info, 4 at debug, 5 and above at trace (unless
    /// --log-level is given).
    #[arg(short = 'v', long = "v", value_name = "LEVEL")]
    pub v: Option<u8>,
    /// klog per-file verbosity: accepted; use --log-level with module directives instead.
    #[arg(long, value_name = "PATTERN=N,...")]
    pub vmodule: Option<String>,
    /// `text` or `json`, as --log-format.
    #[arg(long, value_name = "FORMAT", value_parser = ["text", "json"])]
    pub logging_format: Option<String>,
    /// klog's flush frequency: accepted (logs are written at once).
    #[arg(long, value_name = "DURATION")]
    pub log_flush_frequency: Option<String>,
    /// Upstream's JSON and text log buffering options: accepted (logs are written at once).
    #[arg(long, value_name = "QUANTITY")]
    pub log_json_info_buffer_size: Option<String>,
    #[arg(long, value_name = "QUANTITY", hide = true)]
    pub log_text_info_buffer_size: Option<String>,
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set, hide = true)]
    pub log_json_split_stream: Option<bool>,
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set, hide = true)]
    pub log_text_split_stream: Option<bool>,
    /// The API server's address, overriding the kubeconfig's.
    #[arg(long, value_name = "URL")]
    pub master: Option<String>,
    /// Give Nodes without podCIDRs one from each --cluster-cidr (the node IPAM controller, a
    /// range allocator; --node-cidr-mask-size-ipv4/-ipv6 set their size), or with
    /// --cidr-allocator-type=CloudAllocator their instances' own from the cloud.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub allocate_node_cidrs: Option<bool>,
    /// The CIDR allocator of --allocate-node-cidrs: `RangeAllocator` (over --cluster-cidr, the
    /// default) or `CloudAllocator` (each Node's podCIDRs from its instance's metadata, when the
    /// provider gives them: GCP's alias ranges, AWS's prefix delegation). Without
    /// --allocate-node-cidrs=true it has no effect.
    #[arg(long, value_name = "TYPE")]
    pub cidr_allocator_type: Option<String>,
    /// Only `leases` (upstream's only lock since 1.24).
    #[arg(long, value_name = "LOCK")]
    pub leader_elect_resource_lock: Option<String>,
    /// Accepted: watches here never resync on a timer (the route and load balancer resyncs
    /// have flags of their own).
    #[arg(long, value_name = "DURATION")]
    pub min_resync_period: Option<String>,
    /// Accepted: address updates are batched reads (one call per 500 Nodes), not per-Node workers.
    #[arg(long, value_name = "N")]
    pub concurrent_node_status_updates: Option<u32>,
    /// Accepted: the lifecycle check is one batched pass per --node-monitor-period.
    #[arg(long, value_name = "N")]
    pub concurrent_node_lifecycle_syncs: Option<u32>,
    /// Accepted: controllers start together.
    #[arg(long, value_name = "DURATION")]
    pub controller_start_interval: Option<String>,
    /// Accepted: a kube-controller-manager flag with no meaning in a cloud-controller-manager.
    #[arg(long, value_name = "PLUGIN")]
    pub external_cloud_volume_plugin: Option<String>,
    /// Accepted: requests are JSON.
    #[arg(long, value_name = "TYPE")]
    pub kube_api_content_type: Option<String>,
    /// Go's pprof endpoints: there are none here; refused when true.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub profiling: Option<bool>,
    /// Refused when true (no pprof).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub contention_profiling: Option<bool>,
    /// Upstream's admission webhooks: none here; refused when any is named.
    #[arg(long, value_delimiter = ',', value_name = "NAMES")]
    pub webhooks: Vec<String>,
    /// Accepted: no webhook server is started (the port stays free).
    #[arg(long, value_name = "PORT")]
    pub webhook_secure_port: Option<u16>,
    #[arg(long, value_name = "IP", hide = true)]
    pub webhook_bind_address: Option<String>,
    #[arg(long, value_name = "DIR", hide = true)]
    pub webhook_cert_dir: Option<String>,
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set, hide = true)]
    pub webhook_disable_http2_serving: Option<bool>,
    #[arg(long, value_name = "FILE", hide = true)]
    pub webhook_tls_cert_file: Option<String>,
    #[arg(long, value_name = "FILE", hide = true)]
    pub webhook_tls_private_key_file: Option<String>,
    #[arg(long, value_name = "SUITES", hide = true)]
    pub webhook_tls_cipher_suites: Option<String>,
    #[arg(long, value_name = "CURVES", hide = true)]
    pub webhook_tls_curve_preferences: Option<String>,
    #[arg(long, value_name = "VERSION", hide = true)]
    pub webhook_tls_min_version: Option<String>,
    #[arg(long, value_name = "CERT,KEY", hide = true)]
    pub webhook_tls_sni_cert_key: Vec<String>,
    /// Accepted: the self-signed serving certificate is kept in memory.
    #[arg(long, value_name = "DIR")]
    pub cert_dir: Option<String>,
    /// Accepted (the server's HTTP/2 settings are its own).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub disable_http2_serving: Option<bool>,
    #[arg(long, value_name = "N", hide = true)]
    pub http2_max_streams_per_connection: Option<u32>,
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set, hide = true)]
    pub permit_address_sharing: Option<bool>,
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set, hide = true)]
    pub permit_port_sharing: Option<bool>,
    /// Accepted: rustls offers TLS 1.2 and 1.3 with modern AEAD suites only.
    #[arg(long, value_delimiter = ',', value_name = "SUITES")]
    pub tls_cipher_suites: Vec<String>,
    #[arg(long, value_name = "CURVES", hide = true)]
    pub tls_curve_preferences: Option<String>,
    /// `VersionTLS10`–`VersionTLS12` accepted (TLS 1.2 is the floor here); `VersionTLS13` refused.
    #[arg(long, value_name = "VERSION")]
    pub tls_min_version: Option<String>,
    /// SNI certificates: refused (one serving certificate, --tls-cert-file).
    #[arg(long, value_name = "CERT,KEY")]
    pub tls_sni_cert_key: Vec<String>,
    /// Accepted: the authentication configuration is not looked up in the cluster.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub authentication_skip_lookup: Option<bool>,
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set, hide = true)]
    pub authentication_tolerate_lookup_failure: Option<bool>,
    #[arg(long, value_name = "DURATION", hide = true)]
    pub authentication_token_webhook_cache_ttl: Option<String>,
    #[arg(long, value_name = "DURATION", hide = true)]
    pub authorization_webhook_cache_authorized_ttl: Option<String>,
    #[arg(long, value_name = "DURATION", hide = true)]
    pub authorization_webhook_cache_unauthorized_ttl: Option<String>,
    /// Client certificates on --secure-port: refused (bearer tokens, checked by TokenReview).
    #[arg(long, value_name = "FILE")]
    pub client_ca_file: Option<String>,
    /// The front proxy's client CA: refused (no request-header authentication).
    #[arg(long, value_name = "FILE")]
    pub requestheader_client_ca_file: Option<String>,
    #[arg(long, value_delimiter = ',', value_name = "NAMES", hide = true)]
    pub requestheader_allowed_names: Vec<String>,
    #[arg(long, value_delimiter = ',', value_name = "PREFIXES", hide = true)]
    pub requestheader_extra_headers_prefix: Vec<String>,
    #[arg(long, value_delimiter = ',', value_name = "HEADERS", hide = true)]
    pub requestheader_group_headers: Vec<String>,
    #[arg(long, value_delimiter = ',', value_name = "HEADERS", hide = true)]
    pub requestheader_uid_headers: Vec<String>,
    #[arg(long, value_delimiter = ',', value_name = "HEADERS", hide = true)]
    pub requestheader_username_headers: Vec<String>,
    /// Removed upstream, still passed by some charts (hcloud's): accepted; this core needs no
    /// cluster tag on instances.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub allow_untagged_cloud: Option<bool>,
}

/// Upstream's feature gates (1.37) and what each means here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gate {
    /// Behaviour this core always has, whatever the value.
    Always(&'static str),
    /// Behaviour this core does not have: refused when enabled.
    Never(&'static str),
    /// A gate of the API server libraries upstream links: no effect on what this core does.
    Unused,
}

const GATES: &[(&str, Gate)] = &[
    (
        "CloudControllerManagerWatchBasedRoutesReconciliation",
        Gate::Always("routes are reconciled on Node changes, never on a timer"),
    ),
    ("ControllerManagerReleaseLeaderElectionLockOnExit", Gate::Always("the Lease is released when the process stops")),
    ("ContextualLogging", Gate::Always("logs carry their controller and object")),
    ("WatchList", Gate::Unused),
    ("WatchListCompression", Gate::Unused),
    ("CloudControllerManagerWebhook", Gate::Never("this core serves no admission webhooks")),
    ("CoordinatedLeaderElection", Gate::Never("leader election here is by Lease, not coordinated")),
    ("APIResponseCompression", Gate::Unused),
    ("APIServerIdentity", Gate::Unused),
    ("APIServerWebhookAuthenticationToken", Gate::Unused),
    ("APIServingWithRoutine", Gate::Unused),
    ("AllAlpha", Gate::Unused),
    ("AllBeta", Gate::Unused),
    ("AllowParsingUserUIDFromCertAuth", Gate::Unused),
    ("AllowUnsafeMalformedObjectDeletion", Gate::Unused),
    ("CBORServingAndStorage", Gate::Unused),
    ("ComponentFlagz", Gate::Unused),
    ("ComponentStatusz", Gate::Unused),
    ("ConcurrentWatchObjectDecode", Gate::Unused),
    ("ConsistentListFromCacheSkipTimeoutFallback", Gate::Unused),
    ("ConstrainedImpersonation", Gate::Unused),
    ("DeclarativeValidationBeta", Gate::Unused),
    ("DetectCacheInconsistency", Gate::Unused),
    ("EtcdRangeStream", Gate::Unused),
    ("ExcludeAdmissionWebhookVirtualResources", Gate::Unused),
    ("ListFromCacheSnapshot", Gate::Unused),
    ("LoggingAlphaOptions", Gate::Unused),
    ("LoggingBetaOptions", Gate::Unused),
    ("ManifestBasedAdmissionControlConfig", Gate::Unused),
    ("NativeHistograms", Gate::Unused),
    ("OpenAPIEnums", Gate::Unused),
    ("RemoteRequestHeaderUID", Gate::Unused),
    ("ShardedListAndWatch", Gate::Unused),
    ("SizeBasedListCostEstimate", Gate::Unused),
    ("StorageVersionAPI", Gate::Unused),
    ("StorageVersionHash", Gate::Unused),
    ("StructuredAuthenticationConfigurationEgressSelector", Gate::Unused),
    ("StructuredAuthenticationConfigurationJWKSMetrics", Gate::Unused),
    ("TokenRequestServiceAccountUIDValidation", Gate::Unused),
    ("UnauthenticatedHTTP2DOSMitigation", Gate::Unused),
    ("UnknownVersionInteroperabilityProxy", Gate::Unused),
    ("WebhookRoundTripLoadBalancing", Gate::Unused),
];

/// Reads `--feature-gates` entries (`Name=true`): log lines for the accepted ones, or the
/// refusal of the first that is unknown, malformed or asks for what this core does not do.
pub fn review_gates(entries: &[String]) -> Result<Vec<String>, String> {
    let mut notes = Vec::new();
    for entry in entries.iter().map(|e| e.trim()).filter(|e| !e.is_empty()) {
        let (name, value) =
            entry.split_once('=').ok_or_else(|| format!("--feature-gates {entry:?}: expected Name=true or Name=false"))?;
        let on = match value.trim().to_ascii_lowercase().as_str() {
            "true" => true,
            "false" => false,
            _ => return Err(format!("--feature-gates {entry:?}: the value must be true or false")),
        };
        let gate = GATES.iter().find(|(n, _)| *n == name.trim()).map(|(_, g)| *g).ok_or_else(|| {
            format!("unknown feature gate {name:?}: upstream's cloud-controller-manager (1.37) knows no such gate")
        })?;
        match gate {
            Gate::Always(what) => notes.push(format!("--feature-gates {entry}: always so here: {what}")),
            Gate::Never(why) if on => return Err(format!("--feature-gates {entry}: {why}; remove the gate")),
            Gate::Never(_) | Gate::Unused => notes.push(format!("--feature-gates {entry}: accepted; no effect on this core")),
        }
    }
    Ok(notes)
}

impl UpstreamFlags {
    /// Log lines for the flags given, or the refusal of the first that cannot be honoured.
    pub fn review(&self) -> Result<Vec<String>, String> {
        let mut notes = Vec::new();
        let mut note = |flag: &str, what: &str| notes.push(format!("{flag}: {what}"));
        match self.cidr_allocator_type.as_deref() {
            None | Some("RangeAllocator") | Some("CloudAllocator") => {}
            Some(other) => {
                return Err(format!(
                    "--cidr-allocator-type={other}: the node IPAM controller here is a RangeAllocator (over --cluster-cidr) \
                     or a CloudAllocator (podCIDRs from the provider's instance metadata); use one of them or remove the flag"
                ));
            }
        }
        if self.cidr_allocator_type.as_deref() == Some("CloudAllocator") && self.allocate_node_cidrs != Some(true) {
            note("--cidr-allocator-type=CloudAllocator", "has no effect without --allocate-node-cidrs=true");
        }
        if let Some(lock) = self.leader_elect_resource_lock.as_deref().filter(|l| *l != "leases") {
            return Err(format!("--leader-elect-resource-lock={lock}: leader election is by Lease only; use leases"));
        }
        for (flag, on) in [("--profiling", self.profiling), ("--contention-profiling", self.contention_profiling)] {
            if on == Some(true) {
                return Err(format!(
                    "{flag}=true: there are no pprof endpoints here; measure with ccm-bench and /metrics, and set {flag}=false"
                ));
            }
        }
        if let Some(w) = self.webhooks.iter().find(|w| !w.trim().is_empty()) {
            return Err(format!("--webhooks={w}: this core serves no admission webhooks; remove the flag"));
        }
        if self.tls_min_version.as_deref() == Some("VersionTLS13") {
            return Err("--tls-min-version=VersionTLS13: the server offers TLS 1.2 and 1.3; put a TLS 1.3-only proxy \
                        in front of --secure-port or remove the flag"
                .into());
        }
        if !self.tls_sni_cert_key.is_empty() {
            return Err("--tls-sni-cert-key: one serving certificate only; use --tls-cert-file and --tls-private-key-file".into());
        }
        if !self.webhook_tls_sni_cert_key.is_empty() {
            return Err("--webhook-tls-sni-cert-key: this core serves no webhooks; remove the flag".into());
        }
        for (flag, given) in
            [("--client-ca-file", &self.client_ca_file), ("--requestheader-client-ca-file", &self.requestheader_client_ca_file)]
        {
            if given.is_some() {
                return Err(format!(
                    "{flag}: --secure-port takes bearer tokens (checked with a TokenReview), not client certificates; \
                     scrape with a ServiceAccount token and remove the flag"
                ));
            }
        }
        if let Some(file) = &self.cloud_config {
            note(
                "--cloud-config",
                &format!(
                    "{} is the provider's configuration: the provider sidecar reads it (the chart passes it there), \
                     this core does not",
                    file.display()
                ),
            );
        }
        if let Some(p) = &self.cloud_provider {
            note("--cloud-provider", &format!("{p:?} noted; the provider is the sidecar at --provider-endpoint"));
        }
        if let Some(v) = self.v {
            note("--v", &format!("klog level {v} logs at {}", level_for(v)));
        }
        let accepted: [(&str, bool, &str); 21] = [
            ("--vmodule", self.vmodule.is_some(), "accepted; per-module levels are --log-level directives here"),
            ("--log-flush-frequency", self.log_flush_frequency.is_some(), "accepted; logs are written at once"),
            (
                "--log-*-buffer-size/--log-*-split-stream",
                self.log_json_info_buffer_size.is_some()
                    || self.log_text_info_buffer_size.is_some()
                    || self.log_json_split_stream.is_some()
                    || self.log_text_split_stream.is_some(),
                "accepted; logs go unbuffered to stderr",
            ),
            ("--master", self.master.is_some(), "the API server's address, instead of the kubeconfig's"),
            (
                "--allocate-node-cidrs",
                self.allocate_node_cidrs == Some(true),
                "the node IPAM controller gives Nodes their podCIDRs",
            ),
            ("--min-resync-period", self.min_resync_period.is_some(), "accepted; watches here never resync on a timer"),
            (
                "--concurrent-node-status-updates",
                self.concurrent_node_status_updates.is_some(),
                "accepted; address updates are batched (500 Nodes a call)",
            ),
            (
                "--concurrent-node-lifecycle-syncs",
                self.concurrent_node_lifecycle_syncs.is_some(),
                "accepted; the lifecycle check is one batched pass",
            ),
            ("--controller-start-interval", self.controller_start_interval.is_some(), "accepted; controllers start together"),
            (
                "--external-cloud-volume-plugin",
                self.external_cloud_volume_plugin.is_some(),
                "accepted; a kube-controller-manager flag with no meaning here",
            ),
            ("--kube-api-content-type", self.kube_api_content_type.is_some(), "accepted; requests are JSON"),
            ("--profiling=false", self.profiling == Some(false), "as here: no pprof"),
            (
                "--webhook-*",
                self.webhook_secure_port.is_some()
                    || self.webhook_bind_address.is_some()
                    || self.webhook_cert_dir.is_some()
                    || self.webhook_disable_http2_serving.is_some()
                    || self.webhook_tls_cert_file.is_some()
                    || self.webhook_tls_private_key_file.is_some()
                    || self.webhook_tls_cipher_suites.is_some()
                    || self.webhook_tls_curve_preferences.is_some()
                    || self.webhook_tls_min_version.is_some(),
                "accepted; no webhook server is started",
            ),
            ("--cert-dir", self.cert_dir.is_some(), "accepted; the self-signed certificate is kept in memory"),
            (
                "--disable-http2-serving/--http2-max-streams-per-connection/--permit-*-sharing",
                self.disable_http2_serving.is_some()
                    || self.http2_max_streams_per_connection.is_some()
                    || self.permit_address_sharing.is_some()
                    || self.permit_port_sharing.is_some(),
                "accepted; the server's socket and HTTP/2 settings are its own",
            ),
            (
                "--tls-cipher-suites/--tls-curve-preferences",
                !self.tls_cipher_suites.is_empty() || self.tls_curve_preferences.is_some(),
                "accepted; rustls offers modern AEAD suites and curves only",
            ),
            ("--tls-min-version", self.tls_min_version.is_some(), "accepted; TLS 1.2 is the floor here"),
            (
                "--authentication-skip-lookup/--authentication-tolerate-lookup-failure",
                self.authentication_skip_lookup.is_some() || self.authentication_tolerate_lookup_failure.is_some(),
                "accepted; the authentication configuration is never looked up in the cluster",
            ),
            (
                "--authentication-token-webhook-cache-ttl/--authorization-webhook-cache-*",
                self.authentication_token_webhook_cache_ttl.is_some()
                    || self.authorization_webhook_cache_authorized_ttl.is_some()
                    || self.authorization_webhook_cache_unauthorized_ttl.is_some(),
                "accepted; reviews are cached by this server's own rules",
            ),
            (
                "--requestheader-*",
                !self.requestheader_allowed_names.is_empty()
                    || !self.requestheader_extra_headers_prefix.is_empty()
                    || !self.requestheader_group_headers.is_empty()
                    || !self.requestheader_uid_headers.is_empty()
                    || !self.requestheader_username_headers.is_empty(),
                "accepted; without a request-header CA they do nothing",
            ),
            ("--allow-untagged-cloud", self.allow_untagged_cloud.is_some(), "accepted; no cluster tag is needed on instances"),
        ];
        for (flag, given, what) in accepted {
            if given {
                note(flag, what);
            }
        }
        Ok(notes)
    }
}

/// The log level of a klog verbosity.
pub fn level_for(v: u8) -> &'static str {
    match v {
        0..=3 => "info",
        4 => "debug",
        _ => "trace",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gates_are_upstreams_and_what_we_lack_is_refused() {
        assert!(review_gates(&["CloudControllerManagerWatchBasedRoutesReconciliation=true".into()]).is_ok());
        assert!(review_gates(&["CloudControllerManagerWebhook=false".into()]).is_ok());
        assert!(review_gates(&["CloudControllerManagerWebhook=true".into()]).is_err());
        assert!(review_gates(&["NoSuchGate=true".into()]).is_err());
        assert!(review_gates(&["WatchList".into()]).is_err());
        assert!(review_gates(&["WatchList=maybe".into()]).is_err());
        assert_eq!(review_gates(&["WatchList=false".into(), "AllBeta=true".into()]).map(|n| n.len()), Ok(2));
    }

    #[test]
    fn klog_levels_map_onto_ours() {
        assert_eq!(level_for(2), "info");
        assert_eq!(level_for(4), "debug");
        assert_eq!(level_for(10), "trace");
    }
}
