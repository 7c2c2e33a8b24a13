//! The providers of one core (`--provider-endpoint` given once, or more than once with names)
//! and which of them a Node and a LoadBalancer Service belong to.
//!
//! A Node belongs to the provider whose providerID schemes include its providerID's; before
//! it has one, to the provider its `ccm-rs.dev/provider` label names; else it is unresolved
//! until the node controller's name lookups find exactly one provider that knows its
//! instance (and label it). A LoadBalancer Service belongs to the provider that advertises
//! its `spec.loadBalancerClass`, or, without a class, to the `--default-load-balancer-provider`
//! (none with `--ignore-unclassed-services`). With one provider, every Node whose providerID
//! it does not disown and every Service without a foreign class is its own, as before.
//!
//! With several providers, the provider that made a Service's load balancer is recorded on it
//! (`ccm-rs.dev/load-balancer-provider`) and keeps it when the flags change. That annotation is
//! user-writable, so where it disagrees with the class it is believed only on evidence: the
//! provider it names must hold a load balancer of this Service (checked once with
//! GetLoadBalancer, whose answer the provider gives only to the Service it was made for). A
//! value nobody can back is refused ([`Providers::settle_recorded_provider`]): the Service goes
//! where its class sends it, so no annotation takes a Service around the operator's
//! class-based admission (issue 54).

use k8s_openapi::api::core::v1::{Node, Service};

use std::sync::Arc;

use ccm_protocol::lock::Lock;

use super::Provider;

/// Announcements of found Nodes a node controller may fall behind on before it misses some
/// (it then resyncs).
const ANNOUNCE_CAPACITY: usize = 64;
use crate::node_util;
use crate::wellknown::{ANNOTATION_LOAD_BALANCER_PROVIDER, LABEL_PROVIDER};

/// Whom a Node belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// The provider at this index of [`Providers::all`].
    Provider(usize),
    /// Not known yet: no providerID and no label (the node controller's lookups decide), or a
    /// providerID whose scheme only a provider not yet connected could claim.
    Unresolved,
    /// No provider of this core: another scheme, or a label naming no configured provider.
    Nobody,
}

/// The providers, in `--provider-endpoint` order, and the routing rules of the flags.
pub struct Providers {
    members: Vec<Provider>,
    /// The provider of Services without a class, if any.
    unclassed: Option<usize>,
    /// The class `--load-balancer-class` names, served by the provider of unclassed Services
    /// (or the first) besides the classes providers advertise.
    class_flag: Option<String>,
    /// Providers whose load balancers get every Node as a backend, not only their own.
    all_backends: Vec<bool>,
    /// The provider that programs every Node's routes (`--routes-provider`), if one does.
    routes: Option<usize>,
    /// The providers asked, in order, for a Node without providerID or label.
    lookup_order: Vec<usize>,
    /// What the name lookups found: Node name → (its UID, the provider that alone knows it),
    /// until the Node has a providerID (or is gone).
    found: std::sync::Mutex<std::collections::HashMap<String, (String, usize)>>,
    /// Tells the node controllers of Nodes the lookups gave to their provider.
    announce: tokio::sync::broadcast::Sender<(usize, Arc<[String]>)>,
    /// What was found of recorded providers that disagree with the class: Service UID →
    /// (the provider recorded, whether it holds the Service's load balancer).
    recorded: std::sync::Mutex<std::collections::HashMap<String, (usize, bool)>>,
}

/// How many verdicts on recorded providers are kept (a re-check costs one GetLoadBalancer).
const RECORDED_VERDICTS_KEPT: usize = 10_000;

/// Where a Service's recorded provider stands against its class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordedProvider {
    /// Nothing to check: no annotation, one provider, the class's own provider, or a verdict.
    Settled,
    /// The annotation names this provider (index), which the class does not: it must show a
    /// load balancer of the Service before it acts.
    Unchecked(usize),
}

impl Providers {
    /// One provider: every Node it does not disown, Services without a class (unless
    /// `--ignore-unclassed-services`), of a class it advertises or of `--load-balancer-class`.
    pub fn single(provider: Provider, rules: Rules) -> Self {
        Self {
            members: vec![provider],
            unclassed: (!rules.ignore_unclassed).then_some(0),
            class_flag: rules.class_flag,
            all_backends: vec![!rules.all_backends.is_empty()],
            routes: None,
            lookup_order: vec![0],
            found: Default::default(),
            announce: tokio::sync::broadcast::channel(ANNOUNCE_CAPACITY).0,
            recorded: Default::default(),
        }
    }

    /// Several providers with the rules of the flags (names already checked).
    pub fn new(members: Vec<Provider>, rules: Rules) -> Self {
        let index = |name: &str| members.iter().position(|p| p.name() == name);
        let unclassed =
            if rules.ignore_unclassed { None } else { rules.default_load_balancer_provider.as_deref().map_or(Some(0), index) };
        let all_backends = members.iter().map(|p| rules.all_backends.iter().any(|n| n == "*" || n == p.name())).collect();
        let routes = rules.routes_provider.as_deref().and_then(index);
        let lookup_order = if rules.lookup_order.is_empty() {
            (0..members.len()).collect()
        } else {
            rules.lookup_order.iter().filter_map(|n| index(n)).collect()
        };
        Self {
            members,
            unclassed,
            class_flag: rules.class_flag,
            all_backends,
            routes,
            lookup_order,
            found: Default::default(),
            announce: tokio::sync::broadcast::channel(ANNOUNCE_CAPACITY).0,
            recorded: Default::default(),
        }
    }

    /// Records that the name lookups found each of `nodes` known to provider `index` alone,
    /// and tells its node controller.
    pub fn found(&self, index: usize, nodes: &[&Node]) {
        if nodes.is_empty() {
            return;
        }
        {
            let mut found = self.found.locked();
            for n in nodes {
                let uid = n.metadata.uid.clone().unwrap_or_default();
                found.insert(node_util::name(n).to_string(), (uid, index));
            }
        }
        let names: Arc<[String]> = nodes.iter().map(|n| node_util::name(n).to_string()).collect();
        // No receiver (the node controller stopped, or not running): the Node waits for its
        // next change or resync, which see it as the provider's now.
        let _ = self.announce.send((index, names));
    }

    /// Forgets what the lookups found of the Node `name` (it has a providerID now, or is gone).
    pub fn forget(&self, name: &str) {
        self.found.locked().remove(name);
    }

    /// The Nodes the lookups give to providers from now on, as (provider index, names).
    pub fn announcements(&self) -> tokio::sync::broadcast::Receiver<(usize, Arc<[String]>)> {
        self.announce.subscribe()
    }

    /// Every provider, in `--provider-endpoint` order.
    pub fn all(&self) -> &[Provider] {
        &self.members
    }

    /// Whether this core has several providers.
    pub fn several(&self) -> bool {
        self.members.len() > 1
    }

    /// The providers asked about a Node without providerID or label, in order.
    pub fn lookup_order(&self) -> impl Iterator<Item = &Provider> {
        self.lookup_order.iter().filter_map(|i| self.members.get(*i))
    }

    /// The provider that programs every Node's routes, when one does (`--routes-provider`).
    pub fn routes_provider(&self) -> Option<usize> {
        self.routes
    }

    /// Whether the load balancers of provider `i` get every Node as a backend.
    pub fn all_backends(&self, i: usize) -> bool {
        self.all_backends.get(i).copied().unwrap_or(false)
    }

    /// The provider of `node`.
    pub fn owner(&self, node: &Node) -> Owner {
        if !self.several() {
            let disowned = match (node_util::provider_id(node), self.members.first().and_then(Provider::identity)) {
                (Some(id), Some(identity)) => !identity.owns(id),
                _ => false,
            };
            return if disowned { Owner::Nobody } else { Owner::Provider(0) };
        }
        if let Some(id) = node_util::provider_id(node) {
            let scheme = ccm_protocol::names::provider_id_scheme(id);
            let (mut unknown, mut schemeless) = (false, Vec::new());
            for (i, p) in self.members.iter().enumerate() {
                match p.identity() {
                    Some(identity) if scheme.is_some_and(|s| identity.has_scheme(s)) => return Owner::Provider(i),
                    Some(identity) if identity.schemes().next().is_none() => schemeless.push(i),
                    Some(_) => {}
                    None => unknown = true,
                }
            }
            return match (unknown, schemeless.as_slice()) {
                (true, _) => Owner::Unresolved,
                // One provider that names no scheme takes the providerIDs no other claims.
                (false, [only]) => Owner::Provider(*only),
                _ => Owner::Nobody,
            };
        }
        match node.metadata.labels.as_ref().and_then(|l| l.get(LABEL_PROVIDER)) {
            Some(name) => self.members.iter().position(|p| p.name() == name).map_or(Owner::Nobody, Owner::Provider),
            None => {
                let found = self.found.locked();
                match found.get(node_util::name(node)) {
                    Some((uid, i)) if node.metadata.uid.as_deref().unwrap_or_default() == uid => Owner::Provider(*i),
                    _ => Owner::Unresolved,
                }
            }
        }
    }

    /// The provider of a LoadBalancer Service: with several providers, the one whose load
    /// balancer it has (`ccm-rs.dev/load-balancer-provider`, kept whatever the flags say now;
    /// none when that provider is no longer configured) where the class agrees or that
    /// provider was found to hold it, or, not checked yet, that provider, which checks it
    /// before it acts ([`Self::recorded_provider`]); else by its class, none when no provider
    /// serves its class (it is left alone, as upstream leaves a class no controller serves).
    pub fn service_owner(&self, svc: &Service) -> Option<usize> {
        let by_class = self.owner_by_class(svc);
        let Some(recorded) = self.recorded_index(svc) else { return by_class };
        // A provider no longer configured: left alone, as a class no provider serves.
        let recorded = recorded?;
        if by_class == Some(recorded) {
            return by_class;
        }
        let uid = svc.metadata.uid.as_deref().unwrap_or_default();
        match self.recorded.locked().get(uid) {
            Some((i, holds)) if *i == recorded => {
                if *holds {
                    Some(recorded)
                } else {
                    by_class
                }
            }
            _ => Some(recorded),
        }
    }

    /// The provider the Service's annotation names, with several providers: `None` without
    /// one, `Some(None)` when it names no configured provider.
    fn recorded_index(&self, svc: &Service) -> Option<Option<usize>> {
        if !self.several() {
            return None;
        }
        let recorded = svc.metadata.annotations.as_ref()?.get(ANNOTATION_LOAD_BALANCER_PROVIDER)?;
        Some(self.members.iter().position(|p| p.name() == recorded))
    }

    /// Whether the Service's recorded provider must still show that it holds a load balancer
    /// of the Service: it disagrees with the class and no verdict is known.
    pub fn recorded_provider(&self, svc: &Service) -> RecordedProvider {
        let Some(Some(recorded)) = self.recorded_index(svc) else { return RecordedProvider::Settled };
        if self.owner_by_class(svc) == Some(recorded) {
            return RecordedProvider::Settled;
        }
        let uid = svc.metadata.uid.as_deref().unwrap_or_default();
        match self.recorded.locked().get(uid) {
            Some((i, _)) if *i == recorded => RecordedProvider::Settled,
            _ => RecordedProvider::Unchecked(recorded),
        }
    }

    /// Records what the recorded provider (`index`) showed of the Service's load balancer:
    /// `holds` keeps the Service with it; otherwise the annotation is refused and the Service
    /// goes where its class sends it.
    pub fn settle_recorded_provider(&self, svc: &Service, index: usize, holds: bool) {
        let Some(uid) = svc.metadata.uid.clone() else { return };
        let mut recorded = self.recorded.locked();
        if recorded.len() >= RECORDED_VERDICTS_KEPT {
            recorded.clear();
        }
        recorded.insert(uid, (index, holds));
    }

    /// The provider of the Service's class (or of unclassed Services), if any serves it.
    fn owner_by_class(&self, svc: &Service) -> Option<usize> {
        match svc.spec.as_ref().and_then(|s| s.load_balancer_class.as_deref()) {
            None => self.unclassed,
            Some(class) => self
                .members
                .iter()
                .position(|p| p.identity().is_some_and(|i| i.load_balancer_classes().iter().any(|c| c == class)))
                .or_else(|| (self.class_flag.as_deref() == Some(class)).then(|| self.unclassed.unwrap_or(0))),
        }
    }

    /// Configuration errors the providers' identities reveal: a providerID scheme or a load
    /// balancer class claimed by two providers (the first in `--provider-endpoint` order
    /// wins; the other is told here, in `/readyz` and the log).
    pub fn conflicts(&self) -> Vec<String> {
        let mut seen_schemes: Vec<(String, &str)> = Vec::new();
        let mut seen_classes: Vec<(String, &str)> = Vec::new();
        let mut conflicts = Vec::new();
        for p in &self.members {
            let Some(identity) = p.identity() else { continue };
            for scheme in identity.schemes() {
                match seen_schemes.iter().find(|(s, _)| s == scheme) {
                    Some((_, first)) => conflicts.push(format!(
                        "providerID scheme {scheme:?} is claimed by providers {first} and {}: Nodes of it go to {first}",
                        p.name()
                    )),
                    None => seen_schemes.push((scheme.to_string(), p.name())),
                }
            }
            for class in identity.load_balancer_classes() {
                match seen_classes.iter().find(|(c, _)| c == class) {
                    Some((_, first)) => conflicts.push(format!(
                        "loadBalancerClass {class:?} is advertised by providers {first} and {}: its Services go to {first}",
                        p.name()
                    )),
                    None => seen_classes.push((class.clone(), p.name())),
                }
            }
        }
        conflicts
    }
}

/// The routing flags of several providers.
#[derive(Debug, Clone, Default)]
pub struct Rules {
    /// `--default-load-balancer-provider`.
    pub default_load_balancer_provider: Option<String>,
    /// `--ignore-unclassed-services`.
    pub ignore_unclassed: bool,
    /// `--load-balancer-class`.
    pub class_flag: Option<String>,
    /// `--load-balancer-backends-all-nodes` (provider names, `*` for all).
    pub all_backends: Vec<String>,
    /// `--routes-provider`.
    pub routes_provider: Option<String>,
    /// `--node-provider-lookup-order`.
    pub lookup_order: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use ccm_proto::v1 as pb;
    use std::time::Duration;

    fn provider(name: &str, schemes: &[&str], classes: &[&str]) -> Provider {
        let channel = ccm_protocol::client::connect_lazy("unix:///nonexistent/provider.sock").expect("endpoint");
        let p = Provider::over(channel, "unix:///nonexistent", Duration::from_secs(1), 1, Metrics::new()).named(name);
        if !schemes.is_empty() || !classes.is_empty() {
            let identity = super::super::Identity {
                name: format!("{name}.example.com"),
                vendor_version: "1.0.0".into(),
                provider_id_scheme: schemes.first().copied().unwrap_or_default().into(),
                additional_schemes: schemes.iter().skip(1).map(|s| s.to_string()).collect(),
                epoch: String::new(),
                capabilities: pb::GetPluginCapabilitiesResponse {
                    load_balancers: Some(pb::LoadBalancersCapabilities {
                        classes: classes.iter().map(|c| c.to_string()).collect(),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            };
            p.set_state(true, String::new(), Some(Some(identity)));
        }
        p
    }

    fn node(provider_id: Option<&str>, label: Option<&str>) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some("n".into());
        n.metadata.labels = label.map(|l| [(LABEL_PROVIDER.to_string(), l.to_string())].into());
        n.spec = Some(k8s_openapi::api::core::v1::NodeSpec { provider_id: provider_id.map(String::from), ..Default::default() });
        n
    }

    fn service(class: Option<&str>) -> Service {
        Service {
            spec: Some(k8s_openapi::api::core::v1::ServiceSpec {
                load_balancer_class: class.map(String::from),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_node_belongs_to_its_schemes_provider_else_its_label_else_nobody_yet() {
        let set = Providers::new(
            vec![provider("cloud", &["hcloud"], &[]), provider("metal", &["robot", "metal"], &[])],
            Rules::default(),
        );
        assert_eq!(set.owner(&node(Some("hcloud://1"), None)), Owner::Provider(0));
        assert_eq!(set.owner(&node(Some("robot://7"), None)), Owner::Provider(1), "its first scheme");
        assert_eq!(set.owner(&node(Some("metal://7"), None)), Owner::Provider(1), "an additional scheme");
        // The providerID decides over a label that says otherwise.
        assert_eq!(set.owner(&node(Some("hcloud://1"), Some("metal"))), Owner::Provider(0));
        assert_eq!(set.owner(&node(Some("aws:///us-east-1a/i-1"), None)), Owner::Nobody, "a scheme nobody claims");
        assert_eq!(set.owner(&node(None, Some("metal"))), Owner::Provider(1));
        assert_eq!(set.owner(&node(None, Some("vsphere"))), Owner::Nobody, "a label naming no provider");
        assert_eq!(set.owner(&node(None, None)), Owner::Unresolved, "the lookups decide");
    }

    #[tokio::test]
    async fn a_provider_not_yet_connected_leaves_foreign_schemes_unresolved_but_not_its_peers_own() {
        let set = Providers::new(vec![provider("cloud", &["hcloud"], &[]), provider("metal", &[], &[])], Rules::default());
        assert_eq!(set.owner(&node(Some("hcloud://1"), None)), Owner::Provider(0), "known: the other's trouble is not its");
        assert_eq!(set.owner(&node(Some("robot://7"), None)), Owner::Unresolved, "metal may claim it once connected");
    }

    #[tokio::test]
    async fn one_provider_owns_what_it_does_not_disown() {
        let set = Providers::single(provider("default", &["sim"], &[]), Rules::default());
        assert_eq!(set.owner(&node(Some("sim://z/1"), None)), Owner::Provider(0));
        assert_eq!(set.owner(&node(None, None)), Owner::Provider(0));
        assert_eq!(set.owner(&node(None, Some("other"))), Owner::Provider(0), "the label means nothing to one provider");
        assert_eq!(set.owner(&node(Some("other://1"), None)), Owner::Nobody);
        let unknown = Providers::single(provider("default", &[], &[]), Rules::default());
        assert_eq!(unknown.owner(&node(Some("other://1"), None)), Owner::Provider(0), "no scheme said: all its own");
    }

    #[tokio::test]
    async fn a_service_goes_to_the_provider_of_its_class() {
        let members =
            || vec![provider("cloud", &["hcloud"], &["hcloud.example.com/lb"]), provider("metal", &["robot"], &["metallb"])];
        let set = Providers::new(members(), Rules { class_flag: Some("legacy".into()), ..Default::default() });
        assert_eq!(set.service_owner(&service(None)), Some(0), "unclassed: the first provider by default");
        assert_eq!(set.service_owner(&service(Some("metallb"))), Some(1));
        assert_eq!(set.service_owner(&service(Some("hcloud.example.com/lb"))), Some(0));
        assert_eq!(set.service_owner(&service(Some("legacy"))), Some(0), "--load-balancer-class: the unclassed provider");
        assert_eq!(set.service_owner(&service(Some("someone-else"))), None, "left alone, as upstream");
        let set = Providers::new(members(), Rules { default_load_balancer_provider: Some("metal".into()), ..Default::default() });
        assert_eq!(set.service_owner(&service(None)), Some(1));
        let set = Providers::new(members(), Rules { ignore_unclassed: true, ..Default::default() });
        assert_eq!(set.service_owner(&service(None)), None, "--ignore-unclassed-services");
        assert_eq!(set.service_owner(&service(Some("metallb"))), Some(1));
        // A Service whose load balancer a provider made stays that provider's, whatever the
        // flags say now (its load balancer is updated and deleted where it is).
        let mut made = service(None);
        made.metadata.annotations = Some([(ANNOTATION_LOAD_BALANCER_PROVIDER.to_string(), "cloud".to_string())].into());
        assert_eq!(set.service_owner(&made), Some(0), "kept after --ignore-unclassed-services");
        let moved =
            Providers::new(members(), Rules { default_load_balancer_provider: Some("metal".into()), ..Default::default() });
        assert_eq!(moved.service_owner(&made), Some(0), "kept after the default provider changed");
        made.metadata.annotations = Some([(ANNOTATION_LOAD_BALANCER_PROVIDER.to_string(), "gone".to_string())].into());
        assert_eq!(moved.service_owner(&made), None, "a provider no longer configured: left alone");
        let one = || provider("default", &["sim"], &["sim.example.com/lb"]);
        let single = Providers::single(one(), Rules::default());
        assert_eq!(single.service_owner(&service(None)), Some(0));
        assert_eq!(single.service_owner(&service(Some("sim.example.com/lb"))), Some(0), "a class it advertises");
        assert_eq!(single.service_owner(&service(Some("other"))), None);
        let gke = Providers::single(one(), Rules { ignore_unclassed: true, ..Default::default() });
        assert_eq!(gke.service_owner(&service(None)), None, "--ignore-unclassed-services with one provider too");
    }

    #[tokio::test]
    async fn a_recorded_provider_the_class_does_not_name_must_show_the_load_balancer() {
        let members =
            || vec![provider("cloud", &["hcloud"], &["hcloud.example.com/lb"]), provider("metal", &["robot"], &["metallb"])];
        let set = Providers::new(members(), Rules::default());
        let annotated = |class: Option<&str>, recorded: &str, uid: &str| {
            let mut svc = service(class);
            svc.metadata.uid = Some(uid.into());
            svc.metadata.annotations = Some([(ANNOTATION_LOAD_BALANCER_PROVIDER.to_string(), recorded.to_string())].into());
            svc
        };
        // Agreeing with the class: nothing to check.
        let agrees = annotated(Some("metallb"), "metal", "u-1");
        assert_eq!(set.recorded_provider(&agrees), RecordedProvider::Settled);
        assert_eq!(set.service_owner(&agrees), Some(1));
        // A user writes the other provider on a Service of the cloud's class: the provider it
        // names checks first, and the Service is that provider's only while unchecked.
        let written = annotated(Some("hcloud.example.com/lb"), "metal", "u-2");
        assert_eq!(set.recorded_provider(&written), RecordedProvider::Unchecked(1));
        assert_eq!(set.service_owner(&written), Some(1), "the recorded provider checks before it acts");
        set.settle_recorded_provider(&written, 1, false);
        assert_eq!(set.recorded_provider(&written), RecordedProvider::Settled);
        assert_eq!(set.service_owner(&written), Some(0), "refused: the class decides");
        // The same value on another Service (another UID) is checked for that one.
        let other = annotated(Some("hcloud.example.com/lb"), "metal", "u-3");
        assert_eq!(set.recorded_provider(&other), RecordedProvider::Unchecked(1));
        // A provider that does hold the Service's load balancer (made before the flags
        // changed) keeps it.
        set.settle_recorded_provider(&other, 1, true);
        assert_eq!(set.service_owner(&other), Some(1));
        // The annotation changed to another provider after a verdict: checked again.
        let changed = annotated(Some("metallb"), "cloud", "u-3");
        assert_eq!(set.recorded_provider(&changed), RecordedProvider::Unchecked(0));
        // One provider: the annotation means nothing.
        let single = Providers::single(provider("default", &["sim"], &[]), Rules::default());
        assert_eq!(single.recorded_provider(&annotated(None, "other", "u-4")), RecordedProvider::Settled);
        assert_eq!(single.service_owner(&annotated(None, "other", "u-4")), Some(0));
    }

    #[tokio::test]
    async fn a_scheme_or_class_claimed_twice_is_reported_and_the_first_provider_keeps_it() {
        let set = Providers::new(vec![provider("a", &["sim"], &["lb"]), provider("b", &["sim", "b"], &["lb"])], Rules::default());
        let conflicts = set.conflicts();
        assert_eq!(conflicts.len(), 2, "{conflicts:?}");
        assert!(conflicts[0].contains("\"sim\"") && conflicts[1].contains("\"lb\""), "{conflicts:?}");
        assert_eq!(set.owner(&node(Some("sim://1"), None)), Owner::Provider(0));
        assert_eq!(set.service_owner(&service(Some("lb"))), Some(0));
    }

    #[tokio::test]
    async fn lookups_ask_the_configured_providers_in_order() {
        let members = vec![provider("a", &["a"], &[]), provider("b", &["b"], &[]), provider("c", &["c"], &[])];
        let set = Providers::new(members, Rules { lookup_order: vec!["c".into(), "a".into()], ..Default::default() });
        let asked: Vec<&str> = set.lookup_order().map(Provider::name).collect();
        assert_eq!(asked, vec!["c", "a"]);
    }
}
