//! A TTL cache for expensive list calls, with single flight: callers that miss together make
//! one fetch, not one each.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

/// Caches values for `ttl`. The lock is held across a fetch, so concurrent misses for any
/// key wait for the one fetch in flight and then read its result. Meant for a few keys (one
/// listing per table, say), not per-object caching.
#[derive(Debug)]
pub struct TtlCache<K, V> {
    ttl: Duration,
    entries: Mutex<HashMap<K, (Instant, V)>>,
}

impl<K: Eq + Hash + Clone, V: Clone> TtlCache<K, V> {
    /// An empty cache whose entries live for `ttl`.
    pub fn new(ttl: Duration) -> Self {
        Self { ttl, entries: Mutex::new(HashMap::new()) }
    }

    /// The cached value, if it is younger than the TTL.
    pub async fn get(&self, key: &K) -> Option<V> {
        let entries = self.entries.lock().await;
        entries.get(key).filter(|(at, _)| at.elapsed() < self.ttl).map(|(_, v)| v.clone())
    }

    /// The cached value, or the result of `fetch`, which is stored when it succeeds.
    /// Errors are not cached.
    pub async fn get_or_try_fetch<E, F, Fut>(&self, key: K, fetch: F) -> Result<V, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<V, E>>,
    {
        let mut entries = self.entries.lock().await;
        if let Some((at, v)) = entries.get(&key)
            && at.elapsed() < self.ttl
        {
            return Ok(v.clone());
        }
        let value = fetch().await?;
        entries.insert(key, (Instant::now(), value.clone()));
        Ok(value)
    }

    /// Forgets one key, after a write that changes what a listing would return.
    pub async fn invalidate(&self, key: &K) {
        self.entries.lock().await.remove(key);
    }

    /// Forgets everything.
    pub async fn clear(&self) {
        self.entries.lock().await.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn fetches_once_per_ttl_and_coalesces_concurrent_misses() {
        let cache = Arc::new(TtlCache::new(Duration::from_secs(30)));
        let calls = Arc::new(AtomicUsize::new(0));
        let fetch = |calls: Arc<AtomicUsize>| async move {
            calls.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(10)).await;
            Ok::<_, ()>(vec![1, 2, 3])
        };
        let (a, b) = tokio::join!(
            cache.get_or_try_fetch("routes", || fetch(calls.clone())),
            cache.get_or_try_fetch("routes", || fetch(calls.clone()))
        );
        assert_eq!(a, Ok(vec![1, 2, 3]));
        assert_eq!(b, Ok(vec![1, 2, 3]));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        tokio::time::advance(Duration::from_secs(31)).await;
        assert_eq!(cache.get(&"routes").await, None);
        cache.get_or_try_fetch("routes", || fetch(calls.clone())).await.expect("fetch");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        cache.invalidate(&"routes").await;
        assert_eq!(cache.get(&"routes").await, None);
    }

    #[tokio::test]
    async fn errors_are_not_cached() {
        let cache: TtlCache<&str, u32> = TtlCache::new(Duration::from_secs(30));
        assert_eq!(cache.get_or_try_fetch("k", || async { Err::<u32, _>("down") }).await, Err("down"));
        assert_eq!(cache.get_or_try_fetch("k", || async { Ok::<_, &str>(7) }).await, Ok(7));
    }
}
