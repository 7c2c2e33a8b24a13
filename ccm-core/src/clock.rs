//! The wall clock the controllers read (Lease times, Event times, a Node's age).
//!
//! In the process it is the system clock. A deterministic simulation runs the core on a
//! runtime with paused, virtual time ([`tokio::time::pause`]); there the wall clock must move
//! with the virtual monotonic clock, or a Lease would never expire by its `renewTime`. A
//! simulation calls [`follow_virtual_time`] on the thread that runs its runtime (a
//! current-thread runtime runs every task on that thread); other threads are not affected.

use std::cell::Cell;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use tokio::time::Instant;

thread_local! {
    static VIRTUAL: Cell<Option<(Timestamp, Instant)>> = const { Cell::new(None) };
}

/// Now, on the wall clock.
pub fn now() -> Timestamp {
    match VIRTUAL.with(Cell::get) {
        Some((epoch, start)) => {
            let elapsed = SignedDuration::try_from(Instant::now().saturating_duration_since(start)).unwrap_or(SignedDuration::MAX);
            epoch.checked_add(elapsed).unwrap_or(epoch)
        }
        None => Timestamp::now(),
    }
}

/// From now on, on this thread, the wall clock reads `epoch` plus the virtual time elapsed
/// since this call (`None`: the system clock again).
pub fn follow_virtual_time(epoch: Option<Timestamp>) {
    VIRTUAL.with(|v| v.set(epoch.map(|e| (e, Instant::now()))));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_wall_clock_follows_virtual_time_when_asked() {
        let epoch = Timestamp::from_second(1_000_000).expect("epoch");
        follow_virtual_time(Some(epoch));
        tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
        assert_eq!(now(), Timestamp::from_second(1_003_600).expect("later"));
        follow_virtual_time(None);
        assert!(now() > Timestamp::from_second(1_700_000_000).expect("2023"));
    }
}
