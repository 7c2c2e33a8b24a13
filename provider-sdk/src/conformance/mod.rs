//! The conformance suite: checks any cloudprovider.v1 endpoint, in any language, over the
//! wire. It reads the plugin's capabilities, skips what is not advertised, creates only
//! objects named after its own run id (in a cluster of its own), cleans them up, and reports
//! one result per check.
//!
//! Use it as a library ([`run`]) or as the `ccm-conformance` binary.

mod checks;

use std::fmt;
use std::time::Duration;

/// How to run the suite.
#[derive(Debug, Clone)]
pub struct Options {
    /// The endpoint: `unix:///path/provider.sock` or `http://host:port`.
    pub endpoint: String,
    /// The deadline of each call.
    pub call_timeout: Duration,
    /// How long to wait for a write to show in reads (eventually consistent clouds).
    pub consistency_timeout: Duration,
    /// Run the quota check when a table holds at most this many routes (it fills the table).
    pub max_quota_to_fill: u32,
    /// Node names of instances that exist, for providers that cannot list instances
    /// (ListInstances UNIMPLEMENTED, as behind the go-adapter): the instance, route and load
    /// balancer checks run against these instead of a listing.
    pub instances: Vec<String>,
}

impl Options {
    /// Defaults for `endpoint`: 10 s per call, 10 s for consistency, quotas up to 64 filled.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            call_timeout: Duration::from_secs(10),
            consistency_timeout: Duration::from_secs(10),
            max_quota_to_fill: 64,
            instances: Vec::new(),
        }
    }
}

/// The outcome of one check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// It held.
    Pass,
    /// It did not, and why.
    Fail(String),
    /// It did not apply, and why.
    Skip(String),
}

/// One check's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckResult {
    /// The check's name, like `instances.exists-unknown`.
    pub name: String,
    /// What happened.
    pub outcome: Outcome,
}

impl fmt::Display for CheckResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.outcome {
            Outcome::Pass => write!(f, "PASS {}", self.name),
            Outcome::Fail(why) => write!(f, "FAIL {}: {why}", self.name),
            Outcome::Skip(why) => write!(f, "SKIP {}: {why}", self.name),
        }
    }
}

/// All results of a run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// In the order run.
    pub results: Vec<CheckResult>,
}

impl Report {
    /// How many passed.
    pub fn passed(&self) -> usize {
        self.results.iter().filter(|r| r.outcome == Outcome::Pass).count()
    }

    /// How many failed.
    pub fn failed(&self) -> usize {
        self.results.iter().filter(|r| matches!(r.outcome, Outcome::Fail(_))).count()
    }

    /// How many were skipped.
    pub fn skipped(&self) -> usize {
        self.results.iter().filter(|r| matches!(r.outcome, Outcome::Skip(_))).count()
    }

    /// The outcome of a check by name.
    pub fn outcome(&self, name: &str) -> Option<&Outcome> {
        self.results.iter().find(|r| r.name == name).map(|r| &r.outcome)
    }

    /// The summary line: `N passed, M failed` and `, K skipped` when some were.
    pub fn summary(&self) -> String {
        let mut line = format!("{} passed, {} failed", self.passed(), self.failed());
        if self.skipped() > 0 {
            line.push_str(&format!(", {} skipped", self.skipped()));
        }
        line
    }
}

/// Errors that stop the suite before any check can run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The endpoint cannot be reached.
    #[error(transparent)]
    Connect(#[from] crate::client::ClientError),
}

/// Runs every check against `options.endpoint`, calling `on_result` as each finishes.
pub async fn run(options: &Options, on_result: impl FnMut(&CheckResult)) -> Result<Report, RunError> {
    let channel = crate::client::connect(&options.endpoint).await?;
    Ok(checks::Suite::new(channel, options.clone(), on_result).run().await)
}

/// What one provider claims: its providerID schemes and load balancer classes.
struct Claims {
    endpoint: String,
    schemes: Vec<String>,
    classes: Vec<String>,
}

fn timed<M>(message: M, timeout: Duration) -> tonic::Request<M> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(timeout);
    request
}

/// The checks of providers meant to serve one cluster together (one core, several
/// `--provider-endpoint`s): no providerID scheme and no load balancer class is claimed by two
/// of them, since the core routes Nodes by scheme and Services by class.
pub async fn run_together(endpoints: &[String], call_timeout: Duration) -> Result<Report, RunError> {
    use crate::proto::identity_service_client::IdentityServiceClient;
    let mut claims: Vec<Claims> = Vec::new();
    for endpoint in endpoints {
        let mut client = IdentityServiceClient::new(crate::client::connect(endpoint).await?);
        let info = client.get_plugin_info(timed(crate::proto::GetPluginInfoRequest {}, call_timeout)).await;
        let caps = client.get_plugin_capabilities(timed(crate::proto::GetPluginCapabilitiesRequest {}, call_timeout)).await;
        let (info, caps) = match (info, caps) {
            (Ok(info), Ok(caps)) => (info.into_inner(), caps.into_inner()),
            (Err(status), _) | (_, Err(status)) => {
                let result = CheckResult {
                    name: "together.identities".into(),
                    outcome: Outcome::Fail(format!("{endpoint}: {}", status.message())),
                };
                return Ok(Report { results: vec![result] });
            }
        };
        let schemes =
            std::iter::once(info.provider_id_scheme).chain(info.additional_provider_id_schemes).filter(|s| !s.is_empty());
        let classes = caps.load_balancers.map(|l| l.classes).unwrap_or_default();
        claims.push(Claims { endpoint: endpoint.clone(), schemes: schemes.collect(), classes });
    }
    let clash = |pick: fn(&Claims) -> &Vec<String>, what: &str| -> Outcome {
        let mut seen: Vec<(&str, &str)> = Vec::new();
        let mut clashes = Vec::new();
        for claim in &claims {
            for value in pick(claim) {
                match seen.iter().find(|(v, _)| *v == value) {
                    Some((_, first)) => clashes.push(format!("{what} {value:?} is claimed by {first} and {}", claim.endpoint)),
                    None => seen.push((value, &claim.endpoint)),
                }
            }
        }
        if clashes.is_empty() { Outcome::Pass } else { Outcome::Fail(clashes.join("; ")) }
    };
    let schemeless = claims.iter().filter(|c| c.schemes.is_empty()).count();
    let results = vec![
        CheckResult { name: "together.distinct-schemes".into(), outcome: clash(|c| &c.schemes, "providerID scheme") },
        CheckResult { name: "together.distinct-classes".into(), outcome: clash(|c| &c.classes, "load balancer class") },
        CheckResult {
            name: "together.at-most-one-schemeless".into(),
            outcome: if schemeless <= 1 {
                Outcome::Pass
            } else {
                Outcome::Fail(format!(
                    "{schemeless} providers name no providerID scheme: the core can tell none of their Nodes apart"
                ))
            },
        },
    ];
    Ok(Report { results })
}
