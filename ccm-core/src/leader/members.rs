//! Replicas that share the per-controller Leases (`--leader-elect-per-controller`).
//!
//! Each replica holds one member Lease, `<--leader-elect-resource-name>-member-<k>` for the
//! lowest free `k` (at most [`MAX_MEMBERS`]), renewed like any leader Lease and labelled so
//! that one list finds them all; its annotation names the controller Leases the replica
//! competes for. Every replica reads the member Leases every retry period and computes the
//! same assignment from them: the union of the controller Leases, sorted, the `i`-th going to
//! the `(i mod n)`-th of the `n` live members that compete for it. A replica takes a Lease it
//! is assigned at once, and one it is not only after it has been free for two retry periods
//! (so the assigned replica gets it first, and a dead one is not waited for). A holder of a
//! Lease assigned to another member hands it over (stops its controllers, then releases it)
//! once that member has been live for a lease duration: a returning replica gets its share
//! back, and one that is starting or flapping does not. Safety stays with the Leases
//! themselves: a controller Lease has one holder, and the member Leases only decide who
//! tries first.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::ListParams;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::lease::{self, Leadership, Observed, Settings};

/// The most replicas that share the work (member Leases `-member-0` … `-member-7`).
pub const MAX_MEMBERS: u32 = 8;
/// The label on member Leases; its value is `--leader-elect-resource-name`.
pub const LABEL_MEMBERS_OF: &str = "ccm-rs.dev/leader-members-of";
/// The annotation on a member Lease: the controller Leases its replica competes for.
pub const ANNOTATION_LEASES: &str = "ccm-rs.dev/leases";
/// The annotation on a member Lease: the controller Leases its replica is ready to serve now
/// (its `/readyz` passes), rewritten with every renewal. A member without it (an older
/// replica) is taken as ready for every Lease it competes for.
pub const ANNOTATION_READY: &str = "ccm-rs.dev/ready-leases";

/// Whether this replica can serve a controller Lease now (its readiness).
pub type ReadyFor = std::sync::Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// Told after every read of the member Leases how many replicas are live (this one counted,
/// with its member Lease or without yet): they share the cloud's call budget.
pub type SharedBy = std::sync::Arc<dyn Fn(usize) + Send + Sync>;

/// A live member, as read from its Lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub slot: u32,
    pub identity: String,
    /// The controller Leases it competes for.
    pub leases: BTreeSet<String>,
    /// Those it is ready to serve now.
    pub ready: BTreeSet<String>,
    /// Since when this process has seen it live (under this identity) and ready as it is.
    pub since: Instant,
}

/// The live members, ordered by slot, and this process's slot among them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    pub me: Option<u32>,
    pub members: Vec<Member>,
}

impl View {
    /// The member assigned `lease`: among the sorted union of every live member's Leases,
    /// the `i`-th goes to the `(i mod n)`-th of the `n` members that compete for it and are
    /// ready to serve it (of all that compete for it when none is ready: someone must try).
    ///
    /// The node lifecycle controller's Lease goes with the cloud node controller's (one unit
    /// of the sharing: to the same member, when it competes for and is ready for both): the lifecycle
    /// controller takes the node refresh's instance answers instead of asking the cloud again,
    /// which works only within one process.
    pub fn assigned(&self, lease: &str) -> Option<&Member> {
        let all: BTreeSet<&str> = self.members.iter().flat_map(|m| m.leases.iter().map(String::as_str)).collect();
        if !all.contains(lease) {
            return None;
        }
        // Shared out by unit: a Lease with its partner, when the partner is competed for.
        let unit = |l: &str| partner_of(l).filter(|p| all.contains(p.as_str())).unwrap_or_else(|| l.to_string());
        let units: BTreeSet<String> = all.iter().map(|l| unit(l)).collect();
        let index = units.iter().position(|u| *u == unit(lease))?;
        let competing: Vec<&Member> = self.members.iter().filter(|m| m.leases.contains(lease)).collect();
        let ready: Vec<&Member> = competing.iter().copied().filter(|m| m.ready.contains(lease)).collect();
        let eligible = if ready.is_empty() { competing } else { ready };
        eligible.get(index % eligible.len().max(1)).copied()
    }

    /// Whether `lease` is this process's to lead.
    pub fn mine(&self, lease: &str) -> bool {
        self.me.is_some_and(|me| self.assigned(lease).is_some_and(|m| m.slot == me))
    }
}

/// The Lease whose holder `lease` goes with: the cloud node controller's, for the node
/// lifecycle controller's (`<base>-cloud-node-lifecycle-controller`).
fn partner_of(lease: &str) -> Option<String> {
    let base = lease.strip_suffix(&format!("-{}", crate::controllers::node_lifecycle::NAME))?;
    Some(format!("{base}-{}", crate::controllers::node::NAME))
}

/// The identity of the member `lease` should go to, when it is not this process and that
/// member has been live, and ready as it is now, for `settle` (one just started, restarting or
/// whose readiness flaps is not given work). A holder that stops being ready for the Lease is
/// no longer assigned it while another member is, and so hands it over to that member.
pub fn hand_over_to(view: &View, lease: &str, settle: Duration) -> Option<String> {
    let me = view.me?;
    let to = view.assigned(lease)?;
    (to.slot != me && to.since.elapsed() >= settle).then(|| to.identity.clone())
}

fn member_name(base: &str, slot: u32) -> String {
    format!("{base}-member-{slot}")
}

fn slot_of(base: &str, name: &str) -> Option<u32> {
    name.strip_prefix(base)?.strip_prefix("-member-")?.parse().ok().filter(|s| *s < MAX_MEMBERS)
}

/// Whether a Lease is held and not expired by the wall clock (a view for preferences only:
/// taking a Lease keeps its own stricter rule).
fn live(lease: &Lease) -> Option<String> {
    let spec = lease.spec.as_ref()?;
    let holder = spec.holder_identity.clone().filter(|h| !h.is_empty())?;
    let seconds = i64::from(spec.lease_duration_seconds.unwrap_or(15).max(1));
    let renewed = spec.renew_time.as_ref()?.0.as_millisecond();
    (renewed + seconds * 1000 >= crate::clock::now().as_millisecond()).then_some(holder)
}

/// This process's membership: a task holds its member Lease and publishes the [`View`].
#[derive(Clone)]
pub struct Members {
    view: watch::Receiver<View>,
}

impl Members {
    /// Starts holding a member Lease for `settings.identity` under `base`, competing for
    /// `leases`, until `stop`; the task returned ends once the member Lease is released.
    pub fn start(
        client: kube::Client,
        base: &str,
        settings: &Settings,
        leases: &[String],
        ready_for: ReadyFor,
        shared_by: SharedBy,
        stop: CancellationToken,
    ) -> (Self, tokio::task::JoinHandle<()>) {
        let (tx, view) = watch::channel(View::default());
        let live = std::sync::Arc::new(lease::LiveAnnotations::default());
        let api: Api<Lease> = Api::namespaced(client, &settings.namespace);
        let task = Task {
            api,
            base: base.to_string(),
            template: Settings {
                labels: BTreeMap::from([(LABEL_MEMBERS_OF.to_string(), base.to_string())]),
                annotations: BTreeMap::from([(ANNOTATION_LEASES.to_string(), leases.join(","))]),
                live_annotations: Some(live.clone()),
                ..settings.clone()
            },
            leases: leases.to_vec(),
            ready_for,
            shared_by,
            live,
            observed: HashMap::new(),
            held: None,
            tx,
        };
        (Self { view }, tokio::spawn(task.run(stop)))
    }

    /// The view as last read.
    pub fn view(&self) -> View {
        self.view.borrow().clone()
    }
}

struct Task {
    api: Api<Lease>,
    base: String,
    template: Settings,
    observed: HashMap<u32, Observed>,
    held: Option<(u32, Leadership)>,
    tx: watch::Sender<View>,
    /// The controller Leases competed for, and which of them this replica can serve now.
    leases: Vec<String>,
    ready_for: ReadyFor,
    shared_by: SharedBy,
    /// The readiness annotation the member Lease is renewed with.
    live: std::sync::Arc<lease::LiveAnnotations>,
}

impl Task {
    async fn run(mut self, stop: CancellationToken) {
        loop {
            if self.held.as_ref().is_some_and(|(_, h)| h.lost.is_cancelled())
                && let Some((slot, _)) = self.held.take()
            {
                tracing::warn!(lease = %member_name(&self.base, slot), "leader election: lost the member Lease; taking one again");
            }
            match tokio::time::timeout(self.template.renew_deadline, self.pass()).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::warn!(%error, "leader election: reading the member Leases failed"),
                Err(_) => tracing::warn!("leader election: no answer reading the member Leases within the renew deadline"),
            }
            tokio::select! {
                _ = tokio::time::sleep(self.template.retry_period) => {}
                _ = stop.cancelled() => break,
            }
        }
        self.tx.send_replace(View::default());
        if let Some((_, held)) = self.held.take() {
            held.release().await;
        }
    }

    /// One read of the member Leases: takes a free slot while holding none, then publishes
    /// who is live.
    async fn pass(&mut self) -> Result<(), kube::Error> {
        let ready: Vec<&str> = self.leases.iter().map(String::as_str).filter(|l| (self.ready_for)(l)).collect();
        let ready = ready.join(",");
        self.live.set(ANNOTATION_READY, ready.clone());
        let selector = format!("{LABEL_MEMBERS_OF}={}", self.base);
        let leases = self.api.list(&ListParams::default().labels(&selector)).await?.items;
        let by_slot: BTreeMap<u32, &Lease> =
            leases.iter().filter_map(|l| Some((slot_of(&self.base, l.metadata.name.as_deref()?)?, l))).collect();
        if self.held.is_none() {
            // A slot never taken or released first (taken at once); else one whose holder
            // stopped renewing (taken once it has been seen expired for a lease duration: a
            // replica that crashed and returns does not wait for its own old slot).
            let unused = |k: &u32| {
                by_slot.get(k).is_none_or(|l| {
                    let holder = l.spec.as_ref().and_then(|s| s.holder_identity.as_deref()).unwrap_or_default();
                    holder.is_empty() || holder == self.template.identity
                })
            };
            let expired = |k: &u32| by_slot.get(k).is_some_and(|l| live(l).is_none());
            let free = (0..MAX_MEMBERS).find(unused).or_else(|| (0..MAX_MEMBERS).find(expired));
            if let Some(slot) = free {
                self.take(slot).await?;
            }
        }
        let me = self.held.as_ref().map(|(slot, _)| *slot);
        let previous = self.tx.borrow().clone();
        let mut members = Vec::new();
        for (&slot, lease) in &by_slot {
            let identity = if me == Some(slot) {
                self.template.identity.clone()
            } else {
                match live(lease) {
                    Some(holder) if holder != self.template.identity => holder,
                    _ => continue,
                }
            };
            let annotation = |key: &str| {
                let value = lease.metadata.annotations.as_ref().and_then(|a| a.get(key));
                value.map(|v| v.split(',').filter(|l| !l.is_empty()).map(String::from).collect::<BTreeSet<String>>())
            };
            let leases = annotation(ANNOTATION_LEASES).unwrap_or_default();
            // This process's own readiness as of now (its Lease shows it at the next renewal).
            let ready = if me == Some(slot) {
                ready.split(',').filter(|l| !l.is_empty()).map(String::from).collect()
            } else {
                annotation(ANNOTATION_READY).unwrap_or_else(|| leases.clone())
            };
            let since = previous
                .members
                .iter()
                .find(|m| m.slot == slot && m.identity == identity && m.ready == ready)
                .map_or_else(Instant::now, |m| m.since);
            members.push(Member { slot, identity, leases, ready, since });
        }
        if let (Some(slot), false) = (me, members.iter().any(|m| Some(m.slot) == me)) {
            // Just taken: the list was read before.
            let leases = self.template.annotations.get(ANNOTATION_LEASES).map(|v| v.split(',').map(String::from).collect());
            members.push(Member {
                slot,
                identity: self.template.identity.clone(),
                leases: leases.unwrap_or_default(),
                ready: ready.split(',').filter(|l| !l.is_empty()).map(String::from).collect(),
                since: Instant::now(),
            });
            members.sort_by_key(|m| m.slot);
        }
        (self.shared_by)(members.len() + usize::from(me.is_none()));
        let view = View { me, members };
        self.tx.send_if_modified(|v| {
            let changed = *v != view;
            *v = view;
            changed
        });
        Ok(())
    }

    async fn take(&mut self, slot: u32) -> Result<(), kube::Error> {
        let mut settings = self.template.clone();
        settings.name = member_name(&self.base, slot);
        let observed = self.observed.entry(slot).or_default();
        let sent = Instant::now();
        if lease::try_acquire_or_renew(&self.api, &settings, observed, Duration::ZERO).await? {
            tracing::info!(lease = %settings.name, identity = %settings.identity, "leader election: a member of the replicas that share the controllers");
            let observed = self.observed.remove(&slot).unwrap_or_default();
            self.held = Some((slot, lease::hold(self.api.clone(), settings, sent, observed)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(slot: u32, leases: &[&str]) -> Member {
        Member {
            slot,
            identity: format!("replica-{slot}"),
            leases: leases.iter().map(|l| l.to_string()).collect(),
            ready: leases.iter().map(|l| l.to_string()).collect(),
            since: Instant::now(),
        }
    }

    const ALL: &[&str] = &[
        "ccm-cloud-node-controller",
        "ccm-cloud-node-lifecycle-controller",
        "ccm-node-route-controller",
        "ccm-service-lb-controller",
    ];

    #[test]
    fn two_members_share_the_leases_and_agree_on_who_leads_what() {
        let members = vec![member(0, ALL), member(3, ALL)];
        let a = View { me: Some(0), members: members.clone() };
        let b = View { me: Some(3), members };
        let mine_a: Vec<&str> = ALL.iter().copied().filter(|l| a.mine(l)).collect();
        let mine_b: Vec<&str> = ALL.iter().copied().filter(|l| b.mine(l)).collect();
        // The node lifecycle controller goes with the cloud node controller (it takes the
        // node refresh's answers, within one process).
        assert_eq!(mine_a, vec!["ccm-cloud-node-controller", "ccm-cloud-node-lifecycle-controller", "ccm-service-lb-controller"]);
        assert_eq!(mine_b, vec!["ccm-node-route-controller"]);
        let three = vec![member(0, ALL), member(1, ALL), member(2, ALL)];
        let owner = |lease: &str| View { me: None, members: three.clone() }.assigned(lease).map(|m| m.slot);
        assert_eq!(owner(ALL[0]), owner(ALL[1]), "together");
        assert_eq!([owner(ALL[0]), owner(ALL[2]), owner(ALL[3])], [Some(0), Some(1), Some(2)], "one unit each");
        // The node controller's member not ready for the lifecycle Lease: it goes elsewhere.
        let mut picky = member(0, ALL);
        picky.ready.remove(ALL[1]);
        let view = View { me: None, members: vec![picky, member(1, ALL)] };
        assert_eq!(view.assigned(ALL[0]).map(|m| m.slot), Some(0));
        assert_eq!(view.assigned(ALL[1]).map(|m| m.slot), Some(1));
        // Alone, a member leads everything; not a member, nothing.
        let alone = View { me: Some(3), members: vec![member(3, ALL)] };
        assert!(ALL.iter().all(|l| alone.mine(l)));
        let outside = View { me: None, members: vec![member(0, ALL)] };
        assert!(ALL.iter().all(|l| !outside.mine(l)));
    }

    #[test]
    fn a_lease_goes_only_to_members_that_compete_for_it() {
        let view = View { me: Some(1), members: vec![member(0, &ALL[..3]), member(1, ALL)] };
        assert_eq!(view.assigned("ccm-service-lb-controller").map(|m| m.slot), Some(1));
        assert!(view.assigned("unknown").is_none());
        for lease in ALL {
            let m = view.assigned(lease).expect("assigned");
            assert!(m.leases.contains(*lease));
        }
    }

    #[test]
    fn a_member_that_is_not_ready_is_given_nothing_and_its_leases_go_to_a_ready_one() {
        let mut b = member(1, ALL);
        b.ready.clear();
        let a_view = View { me: Some(0), members: vec![member(0, ALL), b.clone()] };
        assert!(ALL.iter().all(|l| a_view.mine(l)), "the ready member is assigned every Lease");
        let b_view = View { me: Some(1), members: vec![member(0, ALL), b.clone()] };
        assert!(ALL.iter().all(|l| !b_view.mine(l)), "the member that is not ready is assigned none");
        // b holds a Lease and stops being ready: it hands it to a, once a has been ready for
        // the settle time (a just-ready member waits).
        for lease in ALL {
            assert_eq!(hand_over_to(&b_view, lease, Duration::ZERO).as_deref(), Some("replica-0"));
            assert_eq!(hand_over_to(&b_view, lease, Duration::from_secs(3600)), None);
        }
        // Nobody ready: the Leases are shared as if all were, so that someone tries.
        let mut a = member(0, ALL);
        a.ready.clear();
        let none = View { me: Some(0), members: vec![a, b] };
        assert_eq!(ALL.iter().filter(|l| none.mine(l)).count(), 3);
    }

    #[test]
    fn member_lease_names_round_trip() {
        assert_eq!(slot_of("ccm", &member_name("ccm", 5)), Some(5));
        assert_eq!(slot_of("ccm", "ccm-member-9"), None);
        assert_eq!(slot_of("ccm", "ccm-service-lb-controller"), None);
        assert_eq!(slot_of("ccm", "other-member-1"), None);
    }
}
