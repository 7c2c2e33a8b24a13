//! Instance tags as Node labels (`<--node-tag-label-prefix>/<tag>`), and which of them the node
//! controller owns.
//!
//! A label made from a tag is recorded in the Node's `ccm-rs.dev/tag-labels` annotation when
//! the controller adds it (at initialisation, or when a tag appears later). Only recorded
//! labels follow the tags: changed with the tag's value, removed with the tag. A label of the
//! same key the controller did not add (a user's, or one from before the record existed) is
//! never changed or removed, and not recorded.

use std::collections::{BTreeMap, BTreeSet};

use ccm_protocol::labels::{valid_label_key, valid_label_value};
use k8s_openapi::api::core::v1::Node;

use crate::wellknown::ANNOTATION_TAG_LABELS;

/// The labels `tags` become under `prefix`, and the tags that cannot be labels (an invalid key
/// or value).
pub fn labels_of(prefix: &str, tags: BTreeMap<String, String>) -> (BTreeMap<String, String>, Vec<String>) {
    let mut labels = BTreeMap::new();
    let mut skipped = Vec::new();
    for (tag, value) in tags {
        let key = format!("{prefix}/{tag}");
        if valid_label_key(&key) && valid_label_value(&value) {
            labels.insert(key, value);
        } else {
            skipped.push(tag);
        }
    }
    (labels, skipped)
}

/// The labels of `node` the controller made from tags, as recorded on it.
pub fn owned(node: &Node) -> BTreeSet<String> {
    let record = node.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_TAG_LABELS));
    record.into_iter().flat_map(|r| r.split(',')).map(str::trim).filter(|k| !k.is_empty()).map(str::to_string).collect()
}

/// The annotation value recording `owned`.
pub fn record(owned: &BTreeSet<String>) -> String {
    owned.iter().map(String::as_str).collect::<Vec<_>>().join(",")
}

/// What bringing a Node's tag labels to the instance's tags changes.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct LabelSync {
    /// Labels to set (`Some`) or remove (`None`).
    pub labels: BTreeMap<String, Option<String>>,
    /// The labels owned afterwards.
    pub owned: BTreeSet<String>,
}

/// The changes that bring `node`'s tag labels to `desired` (the tags' labels): owned labels
/// follow their tag, a new tag's label is added where the Node has no label of that key;
/// `None` when nothing changes.
pub fn sync(node: &Node, desired: &BTreeMap<String, String>) -> Option<LabelSync> {
    static NO_LABELS: BTreeMap<String, String> = BTreeMap::new();
    let current = node.metadata.labels.as_ref().unwrap_or(&NO_LABELS);
    let before = owned(node);
    let mut change = LabelSync::default();
    for (key, value) in desired {
        let ours = before.contains(key);
        match current.get(key) {
            // A user's label: never touched.
            Some(_) if !ours => continue,
            Some(v) if v == value => {}
            _ => {
                change.labels.insert(key.clone(), Some(value.clone()));
            }
        }
        change.owned.insert(key.clone());
    }
    for key in before.iter().filter(|k| !desired.contains_key(*k)) {
        if current.contains_key(key) {
            change.labels.insert(key.clone(), None);
        }
    }
    (!change.labels.is_empty() || change.owned != before).then_some(change)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn node(labels: &[(&str, &str)], owned: Option<&str>) -> Node {
        let labels = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let annotations = owned.map(|o| [(ANNOTATION_TAG_LABELS.to_string(), o.to_string())].into());
        Node { metadata: ObjectMeta { labels: Some(labels), annotations, ..Default::default() }, ..Default::default() }
    }

    fn desired(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn owned_labels_follow_their_tags_and_a_users_label_is_never_touched() {
        let n = node(&[("t/team", "a"), ("t/env", "prod"), ("t/owner", "me")], Some("t/team,t/env"));
        let change = sync(&n, &desired(&[("t/team", "b"), ("t/cost", "42"), ("t/owner", "cloud")])).expect("changes");
        assert_eq!(
            change.labels,
            BTreeMap::from([
                ("t/team".to_string(), Some("b".to_string())),
                ("t/cost".to_string(), Some("42".to_string())),
                ("t/env".to_string(), None),
            ]),
            "changed, added, removed; the user's t/owner left alone"
        );
        assert_eq!(change.owned, ["t/cost".to_string(), "t/team".to_string()].into());
        assert_eq!(record(&change.owned), "t/cost,t/team");
    }

    #[test]
    fn nothing_changes_when_the_labels_are_the_tags() {
        let n = node(&[("t/team", "a"), ("t/owner", "me")], Some("t/team"));
        assert_eq!(sync(&n, &desired(&[("t/team", "a"), ("t/owner", "other")])), None);
        // A label the user removed is ours to add again while the tag is there.
        let n = node(&[], Some("t/team"));
        assert_eq!(sync(&n, &desired(&[("t/team", "a")])).expect("re-added").labels.len(), 1);
        // A label ours no longer on the Node, its tag gone: only the record changes.
        let change = sync(&n, &desired(&[])).expect("record");
        assert!(change.labels.is_empty() && change.owned.is_empty());
    }

    #[test]
    fn tags_that_cannot_be_labels_are_skipped() {
        let tags = BTreeMap::from([("team".to_string(), "a".to_string()), ("bad key!".to_string(), "x".to_string())]);
        let (labels, skipped) = labels_of("t", tags);
        assert_eq!(labels, desired(&[("t/team", "a")]));
        assert_eq!(skipped, vec!["bad key!".to_string()]);
    }
}
