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
    static SEEDED: std::cell::RefCell<Option<rand::rngs::StdRng>> = const { std::cell::RefCell::new(None) };
}

/// A random fraction in [0, 1), for jitter: from the system's generator, or, on a thread a
/// simulation seeded ([`seed_jitter`]), from the seed, so that one seed replays one run.
pub fn jitter() -> f64 {
    SEEDED.with(|s| match s.borrow_mut().as_mut() {
        Some(rng) => rand::Rng::random::<f64>(rng),
        None => rand::random::<f64>(),
    })
}

/// Seeds [`jitter`] on this thread (`None`: the system's generator again).
pub fn seed_jitter(seed: Option<u64>) {
    SEEDED.with(|s| *s.borrow_mut() = seed.map(<rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64));
}

/// Now, on the wall clock.
pub fn now() -> Timestamp {
    match VIRTUAL.with(Cell::get) {
        Some((epoch, start)) => {
            let elapsed =
                SignedDuration::try_from(Instant::now().saturating_duration_since(start)).unwrap_or(SignedDuration::MAX);
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
