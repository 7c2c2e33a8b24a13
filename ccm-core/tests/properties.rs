//! Properties of the parsers and state machines that read what users and providers write:
//! whatever the input, they answer (never panic), and what they accept means what it says.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use ccm_core::controllers::node_addresses::parse_provided_node_ip;
use ccm_core::labels::{Op, parse_selector, selector_matches};
use ccm_core::queue::{QueueConfig, WorkQueue};
use proptest::prelude::*;

fn label_key() -> impl Strategy<Value = String> {
    "([a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?(\\.[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?){0,2}/)?[a-zA-Z0-9]([a-zA-Z0-9._-]{0,20}[a-zA-Z0-9])?"
}

fn label_value() -> impl Strategy<Value = String> {
    "([a-zA-Z0-9]([a-zA-Z0-9._-]{0,20}[a-zA-Z0-9])?)?"
}

proptest! {
    #[test]
    fn provided_node_ip_never_panics(text in ".{0,80}") {
        let _ = parse_provided_node_ip(&text);
    }

    #[test]
    fn one_ip_or_a_dual_stack_pair_is_read_back(a in any::<IpAddr>(), b in any::<IpAddr>()) {
        prop_assert_eq!(parse_provided_node_ip(&a.to_string()), Ok(vec![a]));
        let pair = parse_provided_node_ip(&format!("{a}, {b}"));
        let dual = a.is_ipv4() != b.is_ipv4() && !a.is_unspecified() && !b.is_unspecified();
        prop_assert_eq!(pair.is_ok(), dual, "{} and {}: {:?}", a, b, pair);
        if dual {
            prop_assert_eq!(pair.unwrap_or_default(), vec![a, b]);
        }
    }

    #[test]
    fn selectors_never_panic(text in ".{0,80}") {
        let _ = parse_selector(&text);
    }

    #[test]
    fn a_selector_matches_what_it_says(
        terms in proptest::collection::vec((label_key(), label_value(), 0u8..4), 1..5),
        labels in proptest::collection::btree_map(label_key(), label_value(), 0..6),
    ) {
        let text: Vec<String> = terms
            .iter()
            .map(|(k, v, op)| match op {
                0 => format!("{k}={v}"),
                1 => format!("{k}!={v}"),
                2 => k.clone(),
                _ => format!("!{k}"),
            })
            .collect();
        let parsed = parse_selector(&text.join(","));
        prop_assert!(parsed.is_ok(), "{:?}: {:?}", text, parsed);
        let parsed = parsed.unwrap_or_default();
        let want = terms.iter().all(|(k, v, op)| match op {
            0 => labels.get(k) == Some(v),
            1 => labels.get(k) != Some(v),
            2 => labels.contains_key(k),
            _ => !labels.contains_key(k),
        });
        prop_assert_eq!(selector_matches(&parsed, &labels), want);
        prop_assert_eq!(parsed.len(), terms.len());
        prop_assert!(parsed.iter().all(|(_, op)| !matches!(op, Op::Equals(v) | Op::NotEquals(v) if v.contains(','))));
    }

    #[test]
    fn backoff_grows_and_is_bounded(base_ms in 1u64..5_000, max_ms in 1u64..600_000, counts in proptest::collection::vec(0u32..200, 1..20)) {
        let (base, max) = (Duration::from_millis(base_ms), Duration::from_millis(max_ms.max(base_ms)));
        let queue: WorkQueue<String> = WorkQueue::new(QueueConfig { base_delay: base, max_delay: max, ..Default::default() });
        let mut sorted = counts.clone();
        sorted.sort_unstable();
        let delays: Vec<Duration> = sorted.iter().map(|c| queue.backoff(*c)).collect();
        prop_assert!(delays.windows(2).all(|w| w[0] <= w[1]), "non-decreasing: {:?}", delays);
        prop_assert!(delays.iter().all(|d| *d <= max), "bounded by the maximum");
        prop_assert!(delays.iter().zip(&sorted).all(|(d, c)| *c == 0 || *d >= base.min(max)), "at least the base after a failure");
    }
}

#[test]
fn label_maps_of_the_strategies_are_valid_keys() {
    // The strategies above produce what the API server accepts as label keys.
    let labels = BTreeMap::from([("example.com/team".to_string(), "a".to_string())]);
    let parsed = parse_selector("example.com/team=a").expect("a selector");
    assert!(selector_matches(&parsed, &labels));
}
