//! What a controller spent under a bound that spans tenures (the Node deletions of
//! `--node-deletion-window`, the load balancers made again under `--max-load-balancer-repairs`
//! per 24 h), kept on its own Lease: the next holder, in this process or another replica,
//! reads what the last one spent instead of starting the window afresh.
//!
//! Each key is an annotation `ccm-rs.dev/spent.<key>` of the controller's Lease, the wall-clock
//! times (Unix milliseconds) of the actions in the window. An action is recorded before it is
//! taken, and taken only once a renewal of the Lease carried the record (at most a retry period
//! later): a holder that dies right after acting has already told the next one.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use tokio::time::Instant;

use super::lease::LiveAnnotations;

/// The annotation prefix of the spent keys.
pub const ANNOTATION_SPENT: &str = "ccm-rs.dev/spent.";

/// The most times one key keeps (a bound higher than this is kept in memory beyond it).
const MAX_TIMES: usize = 1000;

/// How far ahead of the reader's clock a recorded time is taken as written: a holder records
/// an action as landing up to half a minute after it decided it (the lifecycle controller's
/// provisional times); a time further ahead is a skewed clock's, and read as now.
const MAX_AHEAD: Duration = Duration::from_secs(60);

/// Why a record could not be kept.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The Lease could not be read.
    #[error("reading the Lease {lease}")]
    Read {
        lease: String,
        #[source]
        source: kube::Error,
    },
    /// No renewal carried the record in time (the lead is in doubt).
    #[error("no renewal of the Lease {lease} carried the record within {within:?}")]
    NotWritten { lease: String, within: Duration },
}

/// The spent keys of one held Lease.
#[derive(Clone)]
pub struct Ledger {
    api: Api<Lease>,
    lease: String,
    live: Arc<LiveAnnotations>,
    /// How long a record may wait for a renewal.
    within: Duration,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger").field("lease", &self.lease).finish_non_exhaustive()
    }
}

impl Ledger {
    pub(super) fn new(api: Api<Lease>, lease: String, live: Arc<LiveAnnotations>, within: Duration) -> Self {
        Self { api, lease, live, within }
    }

    /// The times `key`'s actions were taken under this Lease by any holder, as instants of
    /// this process's clock (see [`from_wall`] for those ahead of the wall clock), oldest first.
    pub async fn load(&self, key: &str) -> Result<Vec<Instant>, LedgerError> {
        let lease =
            self.api.get_opt(&self.lease).await.map_err(|source| LedgerError::Read { lease: self.lease.clone(), source })?;
        let value = lease
            .and_then(|l| l.metadata.annotations)
            .and_then(|mut a| a.remove(&format!("{ANNOTATION_SPENT}{key}")))
            .unwrap_or_default();
        let wall_now = crate::clock::now().as_millisecond();
        let now = Instant::now();
        let mut times: Vec<Instant> = parse(&value).into_iter().map(|ms| from_wall(ms, now, wall_now)).collect();
        times.sort();
        if !times.is_empty() {
            tracing::info!(lease = %self.lease, key, spent = times.len(), "what earlier holders of the Lease spent is counted");
        }
        Ok(times)
    }

    /// Records `times` (this process's instants, oldest first: every action of `key` still in
    /// its window) and returns once a renewal of the Lease carried them.
    pub async fn record(&self, key: &str, times: &[Instant]) -> Result<(), LedgerError> {
        let wall_now = crate::clock::now().as_millisecond();
        let now = Instant::now();
        let kept = &times[times.len().saturating_sub(MAX_TIMES)..];
        let value: Vec<String> = kept.iter().map(|t| to_wall(*t, now, wall_now).to_string()).collect();
        let change = self.live.set(&format!("{ANNOTATION_SPENT}{key}"), value.join(","));
        tokio::time::timeout(self.within, self.live.until_written(change))
            .await
            .map_err(|_| LedgerError::NotWritten { lease: self.lease.clone(), within: self.within })
    }
}

/// The Unix milliseconds of `t`, an instant of this process's clock (`now` is `wall_now`).
fn to_wall(t: Instant, now: Instant, wall_now: i64) -> i64 {
    let ahead = i64::try_from(t.saturating_duration_since(now).as_millis()).unwrap_or(i64::MAX);
    let ago = i64::try_from(now.saturating_duration_since(t).as_millis()).unwrap_or(i64::MAX);
    wall_now.saturating_add(ahead).saturating_sub(ago)
}

/// The instant of this process's clock of the Unix milliseconds `ms`: a time ahead of the
/// wall clock by up to [`MAX_AHEAD`] is taken as written (a provisional time); further ahead
/// is a skewed writer's clock, read as now.
fn from_wall(ms: i64, now: Instant, wall_now: i64) -> Instant {
    match u64::try_from(wall_now.saturating_sub(ms)) {
        Ok(ago) => now.checked_sub(Duration::from_millis(ago)).unwrap_or(now),
        Err(_) => {
            let ahead = Duration::from_millis(u64::try_from(ms.saturating_sub(wall_now)).unwrap_or(u64::MAX));
            if ahead <= MAX_AHEAD { now + ahead } else { now }
        }
    }
}

/// The Unix milliseconds of an annotation's value (what does not parse is left out).
fn parse(value: &str) -> Vec<i64> {
    value.split(',').filter_map(|t| t.trim().parse().ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_parse_leaving_out_what_is_not_a_time() {
        assert_eq!(parse("1,2, 3,x,,4"), vec![1, 2, 3, 4]);
        assert!(parse("").is_empty());
    }

    #[test]
    fn times_past_and_provisional_survive_the_wall_clock_and_skew_reads_as_now() {
        let now = Instant::now() + Duration::from_secs(3600);
        let wall = 1_800_000_000_000;
        for t in [now - Duration::from_secs(40), now, now + Duration::from_secs(30)] {
            assert_eq!(from_wall(to_wall(t, now, wall), now, wall), t);
        }
        assert_eq!(to_wall(now + Duration::from_secs(30), now, wall), wall + 30_000);
        assert_eq!(from_wall(wall + 3_600_000, now, wall), now, "an hour ahead is a skewed clock");
    }

    #[tokio::test]
    async fn a_record_returns_once_a_write_carried_it() {
        let live = Arc::new(LiveAnnotations::default());
        let change = live.set("a", "1".into());
        let waiting = tokio::spawn({
            let live = live.clone();
            async move { live.until_written(change).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        live.wrote_for_test(change);
        waiting.await.expect("returns");
    }
}
