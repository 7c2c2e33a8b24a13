//! One way to take a `std::sync::Mutex`: a lock whose holder panicked is taken anyway.
//!
//! Every mutex on either side guards plain bookkeeping (what was ensured, what is held, what
//! was written) that a panic cannot leave half-changed in a way later readers trip over, and
//! the process supervisor ends the process on the panic itself. Refusing the lock forever
//! after (`lock().unwrap()`) would only turn one failure into a cascade of them.

use std::sync::{Mutex, MutexGuard};

/// [`Mutex::lock`], recovering the guard from a poisoned lock.
pub trait Lock<T: ?Sized> {
    /// The guard, whether or not an earlier holder panicked.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> Lock<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_still_taken() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let held = m.clone();
        let _ = std::thread::spawn(move || {
            let _guard = held.locked();
            panic!("the holder panics");
        })
        .join();
        assert!(m.is_poisoned());
        *m.locked() += 1;
        assert_eq!(*m.locked(), 2);
    }
}
