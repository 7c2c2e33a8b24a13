//! A token-bucket limiter that answers "rate limited, retry after" instead of waiting.
//!
//! Written here rather than taken from `governor` because it runs on tokio's clock, so tests
//! with paused time are deterministic, and because it hands back the exact delay that goes
//! into `google.rpc.RetryInfo`.

use crate::lock::Lock;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{Error, Result};

/// A token bucket: `rate` tokens a second, at most `burst` saved up.
#[derive(Debug)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    state: Mutex<(f64, Instant)>,
    /// The callers of [`TokenBucket::acquire`] in line (tokio's mutex is fair): only the first
    /// sleeps on the clock.
    line: tokio::sync::Mutex<()>,
}

impl TokenBucket {
    /// A full bucket. A `rate` of zero or less never refills (only `burst` calls succeed).
    pub fn new(rate: f64, burst: u32) -> Self {
        let burst = f64::from(burst.max(1));
        Self { rate: rate.max(0.0), burst, state: Mutex::new((burst, Instant::now())), line: tokio::sync::Mutex::new(()) }
    }

    /// Waits for a token, callers served in the order they came. Hundreds of callers waiting
    /// at once cost one timer, not one wake-up each per token (each finding it taken).
    pub async fn acquire(&self) {
        let _turn = self.line.lock().await;
        while let Err(wait) = self.try_acquire() {
            tokio::time::sleep(wait).await;
        }
    }

    /// Takes one token, or says how long until one is there.
    pub fn try_acquire(&self) -> std::result::Result<(), Duration> {
        let mut state = self.state.locked();
        let now = Instant::now();
        let (tokens, last) = *state;
        let tokens = (tokens + now.duration_since(last).as_secs_f64() * self.rate).min(self.burst);
        if tokens >= 1.0 {
            *state = (tokens - 1.0, now);
            Ok(())
        } else {
            *state = (tokens, now);
            if self.rate <= 0.0 {
                return Err(Duration::from_secs(3600));
            }
            // Round up to whole milliseconds so a caller that waits exactly this long succeeds.
            let wait = ((1.0 - tokens) / self.rate * 1000.0).ceil();
            Err(Duration::from_millis(wait as u64))
        }
    }

    /// Takes one token or fails with [`Error::RateLimited`] carrying the delay.
    pub fn check(&self) -> Result<()> {
        self.try_acquire().map_err(|retry_after| Error::RateLimited { retry_after })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn burst_then_refill_at_rate() {
        let bucket = TokenBucket::new(10.0, 3);
        for _ in 0..3 {
            assert!(bucket.try_acquire().is_ok());
        }
        let wait = bucket.try_acquire().expect_err("bucket is empty");
        assert_eq!(wait, Duration::from_millis(100));
        tokio::time::advance(wait).await;
        assert!(bucket.try_acquire().is_ok());
        assert!(bucket.try_acquire().is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_are_served_in_order_at_the_rate() {
        let bucket = std::sync::Arc::new(TokenBucket::new(10.0, 1));
        let start = Instant::now();
        let order = std::sync::Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..5 {
            let (bucket, order) = (bucket.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                bucket.acquire().await;
                order.lock().expect("lock").push((i, start.elapsed()));
            }));
            tokio::task::yield_now().await;
        }
        for t in tasks {
            t.await.expect("join");
        }
        let order = order.lock().expect("lock").clone();
        assert_eq!(order.iter().map(|(i, _)| *i).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4], "first come, first served");
        assert_eq!(order[4].1, Duration::from_millis(400), "one token per 100 ms after the burst");
    }

    #[tokio::test(start_paused = true)]
    async fn check_answers_rate_limited_with_delay() {
        let bucket = TokenBucket::new(2.0, 1);
        assert!(bucket.check().is_ok());
        match bucket.check() {
            Err(Error::RateLimited { retry_after }) => assert_eq!(retry_after, Duration::from_millis(500)),
            other => panic!("expected rate limited, got {other:?}"),
        }
    }
}
