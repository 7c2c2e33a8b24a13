//! One mutation per cloud object at a time. The core's work queue runs one reconcile per key,
//! but two keys can name one load balancer (a Service's Ensure and the bulk hosts update of
//! every load balancer), a retry can follow a call whose caller gave up, and a new leader can
//! act while the old one's calls end: the SDK server makes every mutation of a load balancer
//! or route wait for the one before it to end. A waiting call whose caller gives up is
//! dropped with its wait.

use ccm_protocol::lock::Lock;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::OwnedMutexGuard;

/// The locks, by object key; an entry lives while someone holds or awaits it.
#[derive(Default)]
pub(crate) struct ObjectLocks {
    held: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// Mutations of the keys it names may run until it is dropped.
pub(crate) struct Held<'a> {
    locks: &'a ObjectLocks,
    guards: Vec<(String, OwnedMutexGuard<()>)>,
}

impl ObjectLocks {
    /// Waits until no other mutation of any of `keys` runs, and takes them all (in sorted
    /// order, so that two calls over overlapping sets cannot wait for each other).
    pub(crate) async fn lock(&self, keys: impl IntoIterator<Item = String>) -> Held<'_> {
        let mut keys: Vec<String> = keys.into_iter().collect();
        keys.sort();
        keys.dedup();
        let mut guards = Vec::with_capacity(keys.len());
        for key in keys {
            let lock = self.held.locked().entry(key.clone()).or_default().clone();
            guards.push((key, lock.lock_owned().await));
        }
        Held { locks: self, guards }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut held = self.locks.held.locked();
        for (key, guard) in self.guards.drain(..) {
            drop(guard);
            // Nobody else holds or awaits it: only the map's reference is left.
            if held.get(&key).is_some_and(|l| Arc::strong_count(l) == 1) {
                held.remove(&key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[tokio::test]
    async fn mutations_of_one_object_run_one_at_a_time_and_others_at_once() {
        let locks = Arc::new(ObjectLocks::default());
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for i in 0..6 {
            let (locks, running, most) = (locks.clone(), running.clone(), most.clone());
            // Single ones and overlapping sets of lb-a (a bulk hosts call beside an Ensure).
            let keys: Vec<String> = if i % 2 == 0 { vec!["lb-a".into()] } else { vec!["lb-b".into(), "lb-a".into()] };
            tasks.push(tokio::spawn(async move {
                let _held = locks.lock(keys).await;
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
                running.fetch_sub(1, Ordering::SeqCst);
            }));
        }
        for t in tasks {
            t.await.expect("task");
        }
        assert_eq!(most.load(Ordering::SeqCst), 1, "every call touched lb-a: one at a time");
        assert!(locks.held.lock().expect("map").is_empty(), "no lock is kept once nobody holds it");
        // Different objects do not wait for each other.
        let a = locks.lock(["lb-a".to_string()]).await;
        let b = tokio::time::timeout(Duration::from_millis(100), locks.lock(["lb-b".to_string()])).await;
        assert!(b.is_ok(), "lb-b waited for lb-a");
        drop(a);
    }
}
