//! Every call the sim answers, counted by method and code and logged with a timestamp, so
//! tests and benchmarks measure calls made and when, not log lines.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ccm_provider_sdk::CallObserver;
use ccm_provider_sdk::metrics::code_name;
use serde::Serialize;
use tonic::Code;

/// How many calls the log keeps; older ones drop off (the counters keep counting).
pub const LOG_CAPACITY: usize = 200_000;

/// One logged call.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct CallRecord {
    /// When it finished, in milliseconds since the Unix epoch.
    pub at_unix_ms: u64,
    /// `Service/Method`.
    pub method: String,
    /// The gRPC code's name.
    pub code: String,
    /// How long it took, in microseconds.
    pub micros: u64,
}

/// Counters by (method, code), and the log.
type Tally = (BTreeMap<(String, String), u64>, VecDeque<CallRecord>);

/// Counters and log of calls.
#[derive(Debug, Default)]
pub struct Calls {
    inner: Mutex<Tally>,
}

/// Counters as the admin API shows them.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct CallCount {
    /// `Service/Method`.
    pub method: String,
    /// The gRPC code's name.
    pub code: String,
    /// How many.
    pub count: u64,
}

impl Calls {
    /// The counters, sorted by method and code.
    pub fn counts(&self) -> Vec<CallCount> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner
            .0
            .iter()
            .map(|((method, code), count)| CallCount { method: method.clone(), code: code.clone(), count: *count })
            .collect()
    }

    /// The logged calls, oldest first.
    pub fn log(&self) -> Vec<CallRecord> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).1.iter().cloned().collect()
    }

    /// Forgets everything counted so far.
    pub fn reset(&self) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.0.clear();
        inner.1.clear();
    }
}

impl CallObserver for Calls {
    fn observe(&self, method: &'static str, code: Code, elapsed: Duration) {
        let at_unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        *inner.0.entry((method.to_string(), code_name(code).to_string())).or_default() += 1;
        if inner.1.len() == LOG_CAPACITY {
            inner.1.pop_front();
        }
        inner.1.push_back(CallRecord {
            at_unix_ms,
            method: method.to_string(),
            code: code_name(code).to_string(),
            micros: elapsed.as_micros() as u64,
        });
    }
}
