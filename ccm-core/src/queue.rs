//! A work queue of keys (never objects) with per-key exponential backoff that triggers cannot
//! bypass, de-duplication, and an overall rate limit.
//!
//! ## The backoff rule
//!
//! A key whose last reconcile failed is *in backoff* until its retry is due. While it is:
//!
//! - a trigger without news ([`WorkQueue::add`] from a resync, or an update of fields the
//!   controller does not act on) is ignored: the retry is already scheduled;
//! - a trigger carrying a fingerprint of the fields the controller acts on
//!   ([`WorkQueue::add_changed`]) makes the key ready at once only when that fingerprint
//!   differs from the one recorded at the failure: the user changed something that may fix
//!   it. The failure count is kept, so a key that fails again keeps backing off.
//!
//! This is the opposite of kube-runtime's scheduler and client-go's resync, where any event
//! for the object (a heartbeat, a status write of the controller's own) schedules it at once,
//! pre-empting a pending backoff, and a failing key is retried on every resync.
//!
//! The delay after the n-th consecutive failure is `base * 2^(n-1)`, capped at `max`, and
//! never shorter than a `RetryInfo` delay the provider asked for.

use ccm_protocol::lock::Lock;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Duration;

use ccm_protocol::ratelimit::TokenBucket;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Queue settings.
#[derive(Debug, Clone, Copy)]
pub struct QueueConfig {
    /// Delay after the first failure.
    pub base_delay: Duration,
    /// Longest delay.
    pub max_delay: Duration,
    /// Overall dequeues per second across all keys.
    pub qps: f64,
    /// Dequeues allowed in a burst.
    pub burst: u32,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self { base_delay: Duration::from_secs(5), max_delay: Duration::from_secs(300), qps: 10.0, burst: 100 }
    }
}

/// How a reconcile ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Done; forget any failures.
    Success,
    /// Failed; retry after the backoff (or `retry_after`, if longer). `fingerprint` is of the
    /// fields the controller acts on, as they were when it failed.
    Retry {
        /// Fingerprint of the acted-on fields.
        fingerprint: Option<u64>,
        /// A delay the provider asked for.
        retry_after: Option<Duration>,
    },
    /// Succeeded, and wants another look after this delay (periodic work).
    RequeueAfter(Duration),
    /// Throttled: the provider asked for `retry_after`. Retried then, without counting as a
    /// failure (the backoff does not grow while the controller as a whole makes progress at
    /// the rate the cloud allows); an earlier failure count is kept.
    Throttled {
        /// Fingerprint of the acted-on fields.
        fingerprint: Option<u64>,
        /// The delay the provider asked for.
        retry_after: Duration,
    },
}

impl Outcome {
    /// How a provider error ends a key's turn: throttled (RESOURCE_EXHAUSTED with RetryInfo)
    /// waits the delay it asks for and is no failure; anything else backs off.
    pub fn of_provider_error(fingerprint: Option<u64>, error: &ccm_protocol::Error) -> Self {
        match error {
            ccm_protocol::Error::RateLimited { retry_after } => Self::Throttled { fingerprint, retry_after: *retry_after },
            _ => Self::Retry { fingerprint, retry_after: error.retry_after() },
        }
    }
}

#[derive(Debug)]
struct Failure {
    count: u32,
    fingerprint: Option<u64>,
}

#[derive(Debug)]
struct State<K> {
    ready: VecDeque<K>,
    queued: HashSet<K>,
    processing: HashSet<K>,
    /// Added while processing: re-added when done (with the newest fingerprint, if any).
    dirty: HashMap<K, Option<u64>>,
    /// Delayed keys by due time.
    waiting: BTreeMap<(Instant, u64), K>,
    due: HashMap<K, (Instant, u64)>,
    failures: HashMap<K, Failure>,
    seq: u64,
    shutdown: bool,
    /// When each ready key became ready, and when each key in process was taken.
    ready_since: HashMap<K, Instant>,
    started: HashMap<K, Instant>,
    /// How long the keys taken since the last [`WorkQueue::take_waits`] had waited.
    waits: Vec<Duration>,
    /// Keys that became ready (not ready already) since the last [`WorkQueue::take_adds`]:
    /// upstream's `workqueue_adds_total`.
    adds: u64,
    /// Keys added with [`WorkQueue::add_first`] while in process: ahead of the others when
    /// they are ready again.
    first: HashSet<K>,
}

/// Counters a queue keeps, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Keys ready or being processed.
    pub depth: usize,
    /// Keys waiting for a delay (backoff or requeue).
    pub waiting: usize,
    /// Keys currently failing.
    pub failing: usize,
    /// The time the keys in process have been in process, summed.
    pub unfinished: Duration,
    /// The longest any key in process has been.
    pub longest: Duration,
}

/// The work queue.
#[derive(Debug)]
pub struct WorkQueue<K> {
    config: QueueConfig,
    limiter: TokenBucket,
    state: Mutex<State<K>>,
    notify: Notify,
}

impl<K: Clone + Eq + Hash> WorkQueue<K> {
    /// An empty queue.
    pub fn new(config: QueueConfig) -> Self {
        Self {
            config,
            limiter: TokenBucket::new(config.qps, config.burst),
            state: Mutex::new(State {
                ready: VecDeque::new(),
                queued: HashSet::new(),
                processing: HashSet::new(),
                dirty: HashMap::new(),
                waiting: BTreeMap::new(),
                due: HashMap::new(),
                failures: HashMap::new(),
                seq: 0,
                shutdown: false,
                ready_since: HashMap::new(),
                started: HashMap::new(),
                waits: Vec::new(),
                adds: 0,
                first: HashSet::new(),
            }),
            notify: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<K>> {
        self.state.locked()
    }

    /// The delay after `count` consecutive failures.
    pub fn backoff(&self, count: u32) -> Duration {
        let factor = 2u32.saturating_pow(count.saturating_sub(1).min(30));
        self.config.base_delay.saturating_mul(factor).min(self.config.max_delay)
    }

    /// A trigger without news (resync, unrelated update): ignored while the key is in backoff.
    pub fn add(&self, key: K) {
        self.trigger(key, None);
    }

    /// A trigger with a fingerprint of the fields the controller acts on: makes a key in
    /// backoff ready only if the fingerprint differs from the one at its failure.
    pub fn add_changed(&self, key: K, fingerprint: u64) {
        self.trigger(key, Some(fingerprint));
    }

    fn trigger(&self, key: K, fingerprint: Option<u64>) {
        let mut s = self.lock();
        if s.shutdown {
            return;
        }
        if s.processing.contains(&key) {
            let entry = s.dirty.entry(key).or_insert(None);
            if fingerprint.is_some() {
                *entry = fingerprint;
            }
            return;
        }
        if let Some(failure) = s.failures.get(&key)
            && s.due.contains_key(&key)
        {
            let news = matches!((fingerprint, failure.fingerprint), (Some(now), Some(then)) if now != then)
                || (fingerprint.is_some() && failure.fingerprint.is_none());
            if !news {
                return;
            }
            if let Some(at) = s.due.remove(&key) {
                s.waiting.remove(&at);
            }
        }
        Self::make_ready(&mut s, key);
        drop(s);
        self.notify.notify_one();
    }

    fn make_ready(s: &mut State<K>, key: K) {
        if let Some(at) = s.due.remove(&key) {
            s.waiting.remove(&at);
        }
        let first = s.first.remove(&key);
        if s.queued.insert(key.clone()) {
            s.adds += 1;
            s.ready_since.insert(key.clone(), Instant::now());
            if first {
                s.ready.push_front(key);
            } else {
                s.ready.push_back(key);
            }
        }
    }

    /// Moves `key`, just popped from the ready keys, into process.
    fn take(s: &mut State<K>, key: &K) {
        s.queued.remove(key);
        s.processing.insert(key.clone());
        let now = Instant::now();
        // Bounded: a queue whose waits nobody reads keeps only the latest few thousand.
        if let Some(since) = s.ready_since.remove(key) {
            if s.waits.len() >= 4096 {
                s.waits.clear();
            }
            s.waits.push(now.saturating_duration_since(since));
        }
        s.started.insert(key.clone(), now);
    }

    /// A trigger for work that every other key's work depends on or makes redundant (one bulk
    /// pass over every load balancer's hosts): it goes ahead of every ready key, instead of
    /// behind a backlog of them; while in process, it runs again first once done. Like
    /// [`WorkQueue::add`], it does not cut a backoff short.
    pub fn add_first(&self, key: K) {
        let mut s = self.lock();
        if s.shutdown || (s.failures.contains_key(&key) && s.due.contains_key(&key)) {
            return;
        }
        if s.processing.contains(&key) {
            s.dirty.entry(key.clone()).or_insert(None);
            s.first.insert(key);
            return;
        }
        if s.queued.contains(&key) {
            if let Some(at) = s.ready.iter().position(|k| k == &key) {
                s.ready.remove(at);
                s.ready.push_front(key);
            }
        } else {
            s.first.insert(key.clone());
            Self::make_ready(&mut s, key);
        }
        drop(s);
        self.notify.notify_one();
    }

    /// Adds a key after `delay`, unless it is ready or due sooner already. Like a trigger
    /// without news, it does not cut a backoff short. A key that comes due while it is being
    /// processed is processed again once it is done.
    pub fn add_after(&self, key: K, delay: Duration) {
        let mut s = self.lock();
        if s.shutdown || s.queued.contains(&key) {
            return;
        }
        if s.failures.contains_key(&key) && s.due.contains_key(&key) {
            return;
        }
        Self::schedule(&mut s, key, Instant::now() + delay, false);
        drop(s);
        self.notify.notify_one();
    }

    fn schedule(s: &mut State<K>, key: K, at: Instant, replace_later: bool) {
        if let Some(&(current, seq)) = s.due.get(&key) {
            if current <= at && !replace_later {
                return;
            }
            s.waiting.remove(&(current, seq));
        }
        s.seq += 1;
        let slot = (at, s.seq);
        s.waiting.insert(slot, key.clone());
        s.due.insert(key, slot);
    }

    /// The next key to process; waits for one. `None` after [`WorkQueue::shutdown`].
    pub async fn next(&self) -> Option<K> {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let wake_at = {
                let mut s = self.lock();
                if s.shutdown {
                    return None;
                }
                let now = Instant::now();
                while let Some((&(at, seq), _)) = s.waiting.first_key_value() {
                    if at > now {
                        break;
                    }
                    if let Some(key) = s.waiting.remove(&(at, seq)) {
                        s.due.remove(&key);
                        if s.processing.contains(&key) {
                            // Due while in process: again once done, not lost.
                            s.dirty.entry(key).or_insert(None);
                        } else if s.queued.insert(key.clone()) {
                            s.adds += 1;
                            s.ready_since.insert(key.clone(), now);
                            s.ready.push_back(key);
                        }
                    }
                }
                if !s.ready.is_empty() {
                    match self.limiter.try_acquire() {
                        Ok(()) => {
                            let key = s.ready.pop_front();
                            if let Some(key) = &key {
                                Self::take(&mut s, key);
                            }
                            return key;
                        }
                        Err(wait) => Some(now + wait),
                    }
                } else {
                    s.waiting.first_key_value().map(|((at, _), _)| *at)
                }
            };
            match wake_at {
                Some(at) => {
                    tokio::select! {
                        _ = &mut notified => {}
                        _ = tokio::time::sleep_until(at) => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    /// Up to `max` keys at once: waits for the first, then takes whatever else is ready.
    /// One overall rate-limit token is spent per batch, since a batch costs one provider call.
    pub async fn next_batch(&self, max: usize) -> Vec<K> {
        let Some(first) = self.next().await else { return Vec::new() };
        let mut out = vec![first];
        let mut s = self.lock();
        while out.len() < max {
            let Some(key) = s.ready.pop_front() else { break };
            Self::take(&mut s, &key);
            out.push(key);
        }
        out
    }

    /// Reports how processing `key` ended.
    pub fn done(&self, key: &K, outcome: Outcome) {
        let mut s = self.lock();
        s.processing.remove(key);
        s.started.remove(key);
        let dirty = s.dirty.remove(key);
        match outcome {
            Outcome::Success | Outcome::RequeueAfter(_) => {
                s.failures.remove(key);
                if dirty.is_some() {
                    Self::make_ready(&mut s, key.clone());
                } else if let Outcome::RequeueAfter(delay) = outcome {
                    Self::schedule(&mut s, key.clone(), Instant::now() + delay, false);
                }
            }
            Outcome::Retry { fingerprint, retry_after } => {
                let count = s.failures.get(key).map_or(0, |f| f.count) + 1;
                let delay = self.backoff(count).max(retry_after.unwrap_or_default());
                Self::wait(&mut s, key, Failure { count, fingerprint }, dirty, delay);
            }
            Outcome::Throttled { fingerprint, retry_after } => {
                let count = s.failures.get(key).map_or(0, |f| f.count);
                Self::wait(&mut s, key, Failure { count, fingerprint }, dirty, retry_after);
            }
        }
        drop(s);
        self.notify.notify_one();
    }

    /// Schedules a key that failed or was throttled `delay` from now, keeping `failure` while
    /// it waits so that a resync or an update without news does not cut the wait short; at
    /// once when something the controller acts on changed meanwhile (`dirty`).
    fn wait(s: &mut State<K>, key: &K, failure: Failure, dirty: Option<Option<u64>>, delay: Duration) {
        let fingerprint = failure.fingerprint;
        s.failures.insert(key.clone(), failure);
        match dirty {
            Some(Some(now)) if Some(now) != fingerprint => Self::make_ready(s, key.clone()),
            _ => Self::schedule(s, key.clone(), Instant::now() + delay, true),
        }
    }

    /// Forgets a key entirely (its object is gone).
    pub fn forget(&self, key: &K) {
        let mut s = self.lock();
        s.failures.remove(key);
        if let Some(at) = s.due.remove(key) {
            s.waiting.remove(&at);
        }
        if s.queued.remove(key) {
            s.ready.retain(|k| k != key);
        }
        s.ready_since.remove(key);
        s.first.remove(key);
    }

    /// How long each key taken since the last call had waited in the queue.
    pub fn take_waits(&self) -> Vec<Duration> {
        std::mem::take(&mut self.lock().waits)
    }

    /// How many keys became ready since the last call (a key ready already is not counted
    /// again, as upstream's work queue counts its adds).
    pub fn take_adds(&self) -> u64 {
        std::mem::take(&mut self.lock().adds)
    }

    /// How many consecutive failures a key has.
    pub fn failures(&self, key: &K) -> u32 {
        self.lock().failures.get(key).map_or(0, |f| f.count)
    }

    /// Current counters.
    pub fn stats(&self) -> QueueStats {
        let s = self.lock();
        let now = Instant::now();
        let running = s.started.values().map(|t| now.saturating_duration_since(*t));
        let (unfinished, longest) = running.fold((Duration::ZERO, Duration::ZERO), |(sum, max), d| (sum + d, max.max(d)));
        QueueStats {
            depth: s.ready.len() + s.processing.len(),
            waiting: s.waiting.len(),
            failing: s.failures.len(),
            unfinished,
            longest,
        }
    }

    /// Stops the queue: `next` returns `None` from now on.
    pub fn shutdown(&self) {
        self.lock().shutdown = true;
        self.notify.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue() -> WorkQueue<&'static str> {
        WorkQueue::new(QueueConfig {
            base_delay: Duration::from_secs(5),
            max_delay: Duration::from_secs(300),
            qps: 1000.0,
            burst: 1000,
        })
    }

    async fn next_within(q: &WorkQueue<&'static str>, d: Duration) -> Option<&'static str> {
        tokio::time::timeout(d, q.next()).await.ok().flatten()
    }

    #[tokio::test(start_paused = true)]
    async fn deduplicates_keys() {
        let q = queue();
        q.add("a");
        q.add("a");
        q.add("b");
        assert_eq!(q.next().await, Some("a"));
        assert_eq!(q.next().await, Some("b"));
        assert_eq!(next_within(&q, Duration::from_secs(1)).await, None);
    }

    #[tokio::test(start_paused = true)]
    async fn adds_are_counted_as_upstreams_work_queue_counts_them() {
        let q = queue();
        q.add("a");
        q.add("a"); // ready already: not another add
        q.add_after("b", Duration::from_secs(1));
        assert_eq!(q.take_adds(), 1);
        assert_eq!(q.next().await, Some("a"));
        assert_eq!(q.next().await, Some("b"), "a delayed key comes due");
        assert_eq!(q.take_adds(), 1, "and is counted then");
        assert_eq!(q.take_adds(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_added_first_goes_ahead_of_a_backlog_and_again_after_it_ran() {
        let q = queue();
        for k in ["a", "b", "c"] {
            q.add(k);
        }
        q.add_first("hosts");
        assert_eq!(q.next().await, Some("hosts"));
        q.add_first("hosts"); // in process: again once done, ahead of the rest
        q.add("d");
        q.done(&"hosts", Outcome::Success);
        assert_eq!(q.next().await, Some("hosts"));
        q.done(&"hosts", Outcome::Success);
        // Queued already, behind others: moved ahead, not queued twice.
        q.add("hosts");
        q.add_first("hosts");
        assert_eq!(q.next().await, Some("hosts"));
        q.done(&"hosts", Outcome::Success);
        for want in ["a", "b", "c", "d"] {
            assert_eq!(q.next().await, Some(want));
        }
        assert_eq!(next_within(&q, Duration::from_secs(1)).await, None);
        // In backoff: no news, no jump.
        q.add_first("hosts");
        assert_eq!(q.next().await, Some("hosts"));
        q.done(&"hosts", Outcome::Retry { fingerprint: None, retry_after: None });
        q.add("e");
        q.add_first("hosts");
        assert_eq!(q.next().await, Some("e"));
        assert_eq!(next_within(&q, Duration::from_secs(1)).await, None, "hosts waits out its backoff");
    }

    #[tokio::test(start_paused = true)]
    async fn an_add_while_processing_runs_again_after() {
        let q = queue();
        q.add("a");
        assert_eq!(q.next().await, Some("a"));
        q.add("a");
        assert_eq!(next_within(&q, Duration::from_millis(10)).await, None, "not twice at once");
        q.done(&"a", Outcome::Success);
        assert_eq!(q.next().await, Some("a"));
    }

    #[tokio::test(start_paused = true)]
    async fn failures_back_off_exponentially_and_resyncs_do_not_bypass() {
        let q = queue();
        q.add("a");
        let mut last = Instant::now();
        let mut gaps = Vec::new();
        for _ in 0..5 {
            assert_eq!(q.next().await, Some("a"));
            gaps.push(Instant::now() - last);
            last = Instant::now();
            q.done(&"a", Outcome::Retry { fingerprint: Some(1), retry_after: None });
            // Resyncs and same-fingerprint updates keep arriving during the backoff.
            for _ in 0..3 {
                q.add("a");
                q.add_changed("a", 1);
            }
        }
        let secs: Vec<u64> = gaps.iter().skip(1).map(|d| d.as_secs()).collect();
        assert_eq!(secs, vec![5, 10, 20, 40]);
        assert_eq!(q.failures(&"a"), 5);
    }

    #[tokio::test(start_paused = true)]
    async fn a_relevant_change_retries_at_once() {
        let q = queue();
        q.add("a");
        assert_eq!(q.next().await, Some("a"));
        q.done(&"a", Outcome::Retry { fingerprint: Some(1), retry_after: None });
        q.add_changed("a", 2);
        assert_eq!(next_within(&q, Duration::from_millis(10)).await, Some("a"));
    }

    #[tokio::test(start_paused = true)]
    async fn throttling_waits_as_asked_without_growing_the_backoff() {
        let q = queue();
        q.add("a");
        assert_eq!(q.next().await, Some("a"));
        q.done(&"a", Outcome::Retry { fingerprint: Some(1), retry_after: None });
        assert_eq!(q.next().await, Some("a"));
        for _ in 0..5 {
            let start = Instant::now();
            q.done(&"a", Outcome::Throttled { fingerprint: Some(1), retry_after: Duration::from_secs(2) });
            // A resync without news does not cut the wait short.
            q.add_changed("a", 1);
            assert_eq!(next_within(&q, Duration::from_millis(1900)).await, None);
            assert_eq!(q.next().await, Some("a"));
            assert_eq!((Instant::now() - start).as_secs(), 2, "the provider's delay, not a growing backoff");
        }
        assert_eq!(q.failures(&"a"), 1, "throttling is not counted as failing");
        let start = Instant::now();
        q.done(&"a", Outcome::Retry { fingerprint: Some(1), retry_after: None });
        assert_eq!(q.next().await, Some("a"));
        assert_eq!((Instant::now() - start).as_secs(), 10, "the second real failure's backoff");
    }

    #[tokio::test(start_paused = true)]
    async fn retry_info_lengthens_the_backoff_and_success_resets_it() {
        let q = queue();
        q.add("a");
        assert_eq!(q.next().await, Some("a"));
        let start = Instant::now();
        q.done(&"a", Outcome::Retry { fingerprint: None, retry_after: Some(Duration::from_secs(42)) });
        assert_eq!(q.next().await, Some("a"));
        assert_eq!((Instant::now() - start).as_secs(), 42);
        q.done(&"a", Outcome::Success);
        assert_eq!(q.failures(&"a"), 0);
        assert_eq!(q.backoff(1), Duration::from_secs(5));
        assert_eq!(q.backoff(20), Duration::from_secs(300));
    }

    #[tokio::test(start_paused = true)]
    async fn requeue_after_and_forget() {
        let q = queue();
        q.add("a");
        assert_eq!(q.next().await, Some("a"));
        q.done(&"a", Outcome::RequeueAfter(Duration::from_secs(60)));
        assert_eq!(next_within(&q, Duration::from_secs(59)).await, None);
        assert_eq!(next_within(&q, Duration::from_secs(2)).await, Some("a"));
        q.done(&"a", Outcome::RequeueAfter(Duration::from_secs(60)));
        q.forget(&"a");
        assert_eq!(next_within(&q, Duration::from_secs(120)).await, None);
    }

    #[tokio::test(start_paused = true)]
    async fn the_overall_rate_limit_spaces_dequeues() {
        let q: WorkQueue<u32> = WorkQueue::new(QueueConfig { qps: 10.0, burst: 2, ..Default::default() });
        for i in 0..5 {
            q.add(i);
        }
        let start = Instant::now();
        for _ in 0..5 {
            let k = q.next().await.expect("key");
            q.done(&k, Outcome::Success);
        }
        // Two at once, then one every 100 ms.
        assert_eq!((Instant::now() - start).as_millis(), 300);
    }

    #[tokio::test(start_paused = true)]
    async fn the_time_waiting_and_in_process_is_measured() {
        let q = WorkQueue::new(QueueConfig::default());
        q.add("a");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(q.next().await, Some("a"));
        let waits = q.take_waits();
        assert_eq!(waits.len(), 1);
        assert!(waits[0] >= Duration::from_millis(300), "{waits:?}");
        assert!(q.take_waits().is_empty(), "taken once");
        tokio::time::sleep(Duration::from_secs(2)).await;
        let stats = q.stats();
        assert!(stats.longest >= Duration::from_secs(2) && stats.unfinished >= stats.longest, "{stats:?}");
        q.done(&"a", Outcome::Success);
        assert_eq!(q.stats().longest, Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn batches_take_what_is_ready() {
        let q = queue();
        for k in ["a", "b", "c"] {
            q.add(k);
        }
        assert_eq!(q.next_batch(2).await, vec!["a", "b"]);
        assert_eq!(q.next_batch(10).await, vec!["c"]);
        q.add("a");
        assert_eq!(next_within(&q, Duration::from_millis(10)).await, None, "a is still in process");
    }

    #[tokio::test(start_paused = true)]
    async fn a_delayed_add_neither_cuts_a_backoff_short_nor_is_lost_while_in_process() {
        let q = queue();
        q.add("a");
        assert_eq!(q.next().await, Some("a"));
        q.done(&"a", Outcome::Retry { fingerprint: None, retry_after: None });
        q.add_after("a", Duration::from_millis(100));
        assert_eq!(next_within(&q, Duration::from_secs(4)).await, None, "the 5 s backoff holds");
        assert_eq!(q.next().await, Some("a"));
        // Due while in process: processed again after, not dropped.
        q.add_after("a", Duration::from_millis(100));
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(next_within(&q, Duration::from_millis(10)).await, None, "not twice at once");
        q.done(&"a", Outcome::Success);
        assert_eq!(next_within(&q, Duration::from_millis(10)).await, Some("a"));
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_ends_next() {
        let q = queue();
        q.shutdown();
        assert_eq!(q.next().await, None);
    }
}
