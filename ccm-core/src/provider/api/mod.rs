//! The typed provider client the controllers use: one method per thing they ask of the cloud.
//! Each owns its batching (500 lookups a call), paging (bounded, a repeated token an error),
//! the deadline, retries and metrics of [`Provider::call`], fencing for calls that change the
//! cloud, and the checks of [`super::check`]: an answer that fails them is an error, never
//! acted on. One file per service, as `proto/` has them.

use ccm_proto::v1 as pb;
use ccm_proto::v1::instances_service_client::InstancesServiceClient;
use ccm_proto::v1::load_balancers_service_client::LoadBalancersServiceClient;
use ccm_proto::v1::routes_service_client::RoutesServiceClient;
use ccm_proto::v1::tags_service_client::TagsServiceClient;
use ccm_protocol::Error;
use ccm_protocol::answer;
use ccm_protocol::limits::{MAX_BATCH, MAX_MESSAGE_SIZE};
use tonic::transport::Channel;

use super::Provider;
use super::check::{self, invalid};

/// The generated clients, with cloudprovider.v1's message limits (64 MiB each way: a
/// load balancer's 5000 Nodes with their labels do not fit gRPC's default 4 MiB).
macro_rules! client {
    ($name:ident, $client:ident) => {
        fn $name(channel: Channel) -> $client<Channel> {
            $client::new(channel).max_decoding_message_size(MAX_MESSAGE_SIZE).max_encoding_message_size(MAX_MESSAGE_SIZE)
        }
    };
}
client!(instances_client, InstancesServiceClient);
client!(tags_client, TagsServiceClient);
client!(routes_client, RoutesServiceClient);
client!(load_balancers_client, LoadBalancersServiceClient);

/// One answer per lookup, in the lookups' order.
pub type PerLookup<T> = Vec<Result<T, Error>>;

pub(crate) mod instances;
mod load_balancers;
mod routes;
mod tags;

pub use tags::TagChange;

impl Provider {
    /// The error one item of a batch answer carries, its RetryInfo delay cut to the longest
    /// honoured (`--provider-max-retry-after`), as a whole call's is: a delay of hours on one
    /// item would otherwise park its key (a Node, the route table, the bulk hosts pass) for
    /// that long.
    pub(super) fn item_error(&self, e: &pb::ItemError) -> Error {
        Error::from_item_error(e).with_retry_after_at_most(self.max_retry_after)
    }

    /// The error of an invalid answer to `method`, counted and logged.
    fn invalid(&self, method: &str, why: impl std::fmt::Display) -> Error {
        self.counted(method, invalid(method, why))
    }

    fn counted(&self, method: &str, error: Error) -> Error {
        if check::is_invalid(&error) {
            self.metrics.invalid_answer(self.name(), method);
            tracing::warn!(provider = %self.name(), method, %error, "invalid provider answer");
        }
        error
    }

    fn count_invalid<T>(&self, method: &str, answers: &PerLookup<T>) {
        for error in answers.iter().filter_map(|a| a.as_ref().err()) {
            self.counted(method, error.clone());
        }
    }
}

/// One lookup's instance answer: metadata when it exists, checked. Which lookup it answers is
/// settled before (the batch answer names it, or the call was about this lookup alone), so the
/// metadata may name the instance in the provider's canonical form (`sim://sim-region-1a/i-10`
/// for a kubelet's `sim://zone-it-said/i-10`, `aws:///us-east-1a/i-…` for `aws:///i-…`): the
/// Node keeps its own providerID, as upstream's does.
fn instance(
    method: &str,
    lookup: &pb::InstanceLookup,
    exists: bool,
    metadata: Option<pb::InstanceMetadata>,
    identity: Option<&super::Identity>,
) -> Result<Option<pb::InstanceMetadata>, Error> {
    if !exists {
        return Ok(None);
    }
    let Some(m) = metadata else {
        return Err(invalid(method, format!("instance of node {:?} exists but came without metadata", lookup.node_name)));
    };
    // The scheme the answer is checked against: the one of the provider's schemes it names,
    // else the main one (which it then fails).
    let named = ccm_protocol::names::provider_id_scheme(&m.provider_id);
    let scheme = identity.map(|i| named.filter(|s| i.has_scheme(s)).unwrap_or(i.provider_id_scheme.as_str())).unwrap_or_default();
    answer::instance(&m, scheme).map_err(|why| invalid(method, format!("node {:?}: {why}", lookup.node_name)))?;
    Ok(Some(m))
}

/// Runs a batch RPC over `lookups` in chunks of [`MAX_BATCH`]: one result per lookup, in the
/// lookups' order, each answer matched to its lookup by the lookup it names (`named`), never
/// by position; a failed call, or an answer of the wrong length, fails each lookup of its
/// chunk; a lookup that no answer names fails alone ([`matched`]).
async fn in_batches<R, T, Fut>(
    method: &str,
    lookups: &[pb::InstanceLookup],
    call: impl Fn(Vec<pb::InstanceLookup>) -> Fut,
    named: impl Fn(&R) -> Option<&pb::LookupKey>,
    item: impl Fn(R) -> Result<T, Error>,
) -> PerLookup<T>
where
    Fut: Future<Output = Result<Vec<R>, Error>>,
{
    let mut out = Vec::with_capacity(lookups.len());
    for chunk in lookups.chunks(MAX_BATCH) {
        match call(chunk.to_vec()).await {
            Ok(results) if results.len() == chunk.len() => {
                let keys = chunk.iter().map(|l| (l.provider_id.as_str(), l.node_name.as_str()));
                let named = |r: &R| named(r).map(|k| (k.provider_id.clone(), k.node_name.clone()));
                out.extend(matched(method, keys, results, named).into_iter().map(|r| r.and_then(&item)));
            }
            Ok(results) => {
                let e = invalid(method, format!("{} answers for {} lookups", results.len(), chunk.len()));
                out.extend(chunk.iter().map(|_| Err(e.clone())));
            }
            Err(e) => out.extend(chunk.iter().map(|_| Err(e.clone()))),
        }
    }
    out
}

/// The answers of one batch call put in the order of the lookups they name (`keys`: each
/// lookup's providerID and node name as sent; `named`: the same of an answer). A lookup that
/// no answer names, or whose answer is taken by an earlier lookup of the same name, gets an
/// invalid-answer error of its own; answers naming no lookup, or one not asked, are dropped
/// and counted in those errors. Nothing is matched by position: a "does not exist" answer
/// carries nothing else that says whose it is.
fn matched<'k, R>(
    method: &str,
    keys: impl Iterator<Item = (&'k str, &'k str)>,
    answers: Vec<R>,
    named: impl Fn(&R) -> Option<(String, String)>,
) -> Vec<Result<R, Error>> {
    let keys: Vec<(&str, &str)> = keys.collect();
    let mut slots: Vec<Option<R>> = keys.iter().map(|_| None).collect();
    let mut index: std::collections::HashMap<(String, String), Vec<usize>> = std::collections::HashMap::new();
    for (i, (id, node)) in keys.iter().enumerate().rev() {
        index.entry((id.to_string(), node.to_string())).or_default().push(i);
    }
    let mut stray = 0;
    for answer in answers {
        let slot = named(&answer).and_then(|key| index.get_mut(&key)?.pop());
        match slot {
            Some(i) => slots[i] = Some(answer),
            None => stray += 1,
        }
    }
    slots
        .into_iter()
        .zip(keys)
        .map(|(slot, (provider_id, node))| {
            slot.ok_or_else(|| {
                let why = format!(
                    "no answer names the lookup of node {node:?} (providerID {provider_id:?}); {stray} answer(s) named no lookup asked"
                );
                invalid(method, why)
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::convert::LoadBalancerRequest;
    use crate::provider::encoded::Backends;

    fn lookup(name: &str, id: &str) -> pb::InstanceLookup {
        pb::InstanceLookup { node_name: name.into(), provider_id: id.into(), ..Default::default() }
    }

    fn meta(id: &str) -> pb::InstanceMetadata {
        pb::InstanceMetadata { provider_id: id.into(), ..Default::default() }
    }

    #[test]
    fn an_instance_answer_is_checked_and_may_name_the_instance_in_the_providers_form() {
        let m = "M";
        let sim = identity("sim", &["sim-dedicated"]);
        assert_eq!(instance(m, &lookup("a", "sim://z/a"), false, None, Some(&sim)).expect("ok"), None);
        let stray = instance(m, &lookup("a", "sim://z/a"), false, Some(meta("sim://z/a")), Some(&sim)).expect("ok");
        assert_eq!(stray, None, "absent wins over stray metadata");
        assert!(instance(m, &lookup("a", "sim://z/a"), true, Some(meta("sim://z/a")), Some(&sim)).expect("ok").is_some());
        // A lookup by name takes the instance the provider found.
        assert!(instance(m, &lookup("a", ""), true, Some(meta("sim://z/a")), Some(&sim)).expect("ok").is_some());
        // The kubelet said another zone; the cloud answers in its canonical form.
        let canonical = instance(m, &lookup("a", "sim://kubelet-zone/a"), true, Some(meta("sim://z/a")), Some(&sim)).expect("ok");
        assert_eq!(canonical.map(|c| c.provider_id), Some("sim://z/a".to_string()));
        let bare = instance(m, &lookup("a", "sim://z/a"), true, None, Some(&sim)).expect_err("an error");
        assert!(bare.to_string().contains("without metadata"), "{bare}");
        let other = instance(m, &lookup("a", ""), true, Some(meta("other://z/a")), Some(&sim)).expect_err("an error");
        assert!(other.to_string().contains("scheme"), "{other}");
        // A provider of two schemes: an answer in either is its own.
        assert!(instance(m, &lookup("a", ""), true, Some(meta("sim-dedicated://z/a")), Some(&sim)).expect("ok").is_some());
    }

    fn identity(scheme: &str, more: &[&str]) -> crate::provider::Identity {
        crate::provider::Identity {
            name: "p".into(),
            vendor_version: "1".into(),
            provider_id_scheme: scheme.into(),
            additional_schemes: more.iter().map(|s| s.to_string()).collect(),
            epoch: String::new(),
            capabilities: Default::default(),
        }
    }

    fn result(name: &str, id: &str, exists: bool) -> pb::InstanceMetadataResult {
        pb::InstanceMetadataResult {
            exists,
            metadata: exists.then(|| meta(&format!("sim://z/{name}"))),
            lookup: Some(pb::LookupKey { node_name: name.into(), provider_id: id.into() }),
            error: None,
        }
    }

    fn named(r: &pb::InstanceMetadataResult) -> Option<&pb::LookupKey> {
        r.lookup.as_ref()
    }

    /// (exists) per lookup, or the error's text.
    async fn answers(lookups: &[pb::InstanceLookup], results: Vec<pb::InstanceMetadataResult>) -> Vec<Result<bool, String>> {
        let call = |_: Vec<pb::InstanceLookup>| {
            let results = results.clone();
            async move { Ok::<_, Error>(results) }
        };
        let out = in_batches("M", lookups, call, named, |r| Ok(r.exists)).await;
        out.into_iter().map(|r| r.map_err(|e| e.to_string())).collect()
    }

    #[tokio::test]
    async fn batch_answers_are_matched_by_the_lookup_they_name_not_by_position() {
        let lookups = vec![lookup("a", "sim://z/a"), lookup("b", ""), lookup("c", "sim://z/c")];
        // Reversed: "b does not exist" sits where a's answer would be.
        let reversed = vec![result("c", "sim://z/c", true), result("b", "", false), result("a", "sim://z/a", true)];
        assert_eq!(answers(&lookups, reversed).await, vec![Ok(true), Ok(false), Ok(true)]);

        // An answer that names no lookup, or one not asked, is nobody's answer: its lookup fails
        // alone as an invalid answer (never "gone"), the others stand.
        let mut unnamed = result("a", "sim://z/a", false);
        unnamed.lookup = None;
        let stray = result("x", "sim://z/x", false);
        let got = answers(&lookups, vec![unnamed, result("b", "", false), result("c", "sim://z/c", true)]).await;
        assert!(got[0].as_ref().is_err_and(|e| e.contains("no answer names the lookup of node \"a\"")), "{got:?}");
        assert_eq!(got[1..], [Ok(false), Ok(true)]);
        let got = answers(&lookups, vec![result("b", "", false), stray, result("c", "sim://z/c", true)]).await;
        assert!(got[0].is_err() && got[1] == Ok(false) && got[2] == Ok(true), "{got:?}");
        // The same lookup answered twice: one answer taken, the other lookup left without one.
        let got = answers(
            &lookups,
            vec![result("a", "sim://z/a", true), result("a", "sim://z/a", false), result("c", "sim://z/c", true)],
        )
        .await;
        assert!(got[0] == Ok(true) && got[1].is_err() && got[2] == Ok(true), "{got:?}");
    }

    #[tokio::test]
    async fn a_short_batch_fails_every_lookup_of_its_chunk() {
        let lookups: Vec<_> = (0..3).map(|i| lookup(&format!("n{i}"), "")).collect();
        let short = vec![result("n1", "", true), result("n2", "", true)];
        let got = answers(&lookups, short).await;
        assert!(got.iter().all(|a| a.as_ref().is_err_and(|e| e.contains("2 answers for 3 lookups"))), "{got:?}");
        let whole = vec![result("n0", "", true), result("n1", "", true), result("n2", "", true)];
        assert!(answers(&lookups, whole).await.iter().all(Result::is_ok));
    }

    #[tokio::test]
    async fn an_items_retry_info_of_hours_is_cut_to_the_longest_honoured() {
        use ccm_provider_sim::config::{Fault, FaultCode};
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("provider.sock");
        let mut config = ccm_provider_sim::Config::default();
        config.load_balancers.bulk_hosts = true;
        config.faults.push(Fault {
            method: "BatchUpdateLoadBalancerHosts".into(),
            down: true,
            code: FaultCode::RateLimited,
            subject: Some("lb-b".into()),
            retry_after_ms: Some(36_000_000),
            ..Default::default()
        });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let endpoints = ccm_provider_sim::Endpoints::provider(ccm_provider_sdk::Listen::Unix(socket.clone()));
        let sim = tokio::spawn(ccm_provider_sim::run(config, endpoints, async move {
            let _ = stopped.await;
        }));
        let endpoint = format!("unix://{}", socket.display());
        let provider = Provider::new(&endpoint, std::time::Duration::from_secs(5), 4, crate::metrics::Metrics::new())
            .expect("client")
            .with_max_retry_after(std::time::Duration::from_secs(20));
        for _ in 0..100 {
            if provider.refresh().await.is_ok() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let services: Vec<LoadBalancerRequest> = ["lb-a", "lb-b"]
            .iter()
            .map(|name| pb::LoadBalancerService {
                cluster_name: "c".into(),
                namespace: "default".into(),
                name: name.to_string(),
                uid: format!("uid-{name}"),
                load_balancer_name: name.to_string(),
                ports: vec![pb::ServicePort {
                    port: 80,
                    node_port: 30080,
                    protocol: pb::Protocol::Tcp as i32,
                    ..Default::default()
                }],
                ..Default::default()
            })
            .map(LoadBalancerRequest::from_proto)
            .collect();
        for service in &services {
            provider.ensure_load_balancer(None, service.clone(), &Backends::default()).await.expect("ensure");
        }
        let (answers, failed) = provider.batch_update_load_balancer_hosts(None, &services, &Backends::default()).await;
        assert!(failed.is_none(), "the call itself answered: {failed:?}");
        assert!(answers[0].is_ok(), "{:?}", answers[0]);
        let throttled = answers[1].as_ref().expect_err("lb-b is throttled");
        assert_eq!(throttled.retry_after(), Some(std::time::Duration::from_secs(20)), "{throttled}");
        let _ = stop.send(());
        let _ = sim.await;
    }
}
