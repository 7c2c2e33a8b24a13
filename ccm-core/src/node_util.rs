//! Reading a Node: its name, taints, conditions, providerID and addresses (the names they use
//! are in [`crate::wellknown`]; conversion to protocol messages is `provider::convert`, the
//! rules for the addresses and labels a Node should have `controllers::node_addresses`).

use k8s_openapi::api::core::v1::{Node, NodeAddress, Taint};

/// Whether the Node carries a taint with this key.
pub fn has_taint(node: &Node, key: &str) -> bool {
    node.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == key))
}

/// The Node's taints without `key`.
pub fn taints_without(node: &Node, key: &str) -> Vec<Taint> {
    node.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default().into_iter().filter(|t| t.key != key).collect()
}

/// The status of the Ready condition; `None` when there is none.
pub fn ready_status(node: &Node) -> Option<&str> {
    node.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == "Ready").map(|c| c.status.as_str())
}

/// Ready=True. Unknown, False or no condition count as not ready (upstream semantics).
pub fn is_ready(node: &Node) -> bool {
    ready_status(node) == Some("True")
}

/// The Node's providerID, when set.
pub fn provider_id(node: &Node) -> Option<&str> {
    node.spec.as_ref()?.provider_id.as_deref().filter(|p| !p.is_empty())
}

/// Whether two providerIDs name the same instance: equal, or of the same scheme with the same
/// last path segment (the instance id: `aws:///i-0a1` and `aws:///us-east-1a/i-0a1`, a
/// kubelet's `sim://its-zone/i-1` and the cloud's `sim://sim-region-1a/i-1`). A provider may
/// answer in its canonical form while the Node keeps the form its kubelet wrote; taking them
/// for different instances would delete and remake the Node's routes for ever.
pub fn same_instance(a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    let split = |p: &str| {
        p.split_once("://").map(|(scheme, rest)| (scheme.to_string(), rest.rsplit('/').next().unwrap_or("").to_string()))
    };
    match (split(a), split(b)) {
        (Some((sa, ia)), Some((sb, ib))) => sa == sb && !ia.is_empty() && ia == ib,
        _ => false,
    }
}

/// A merge patch of Node `name` (of its `status` with `status`), reading back only the
/// resourceVersion written: the Node in the API server's answer is not deserialised (on the
/// hot path of a join, most of a write's CPU).
pub async fn patch(client: &kube::Client, name: &str, status: bool, patch: &serde_json::Value) -> Result<String, kube::Error> {
    #[derive(serde::Deserialize)]
    struct Written {
        metadata: WrittenMeta,
    }
    #[derive(serde::Deserialize)]
    struct WrittenMeta {
        #[serde(rename = "resourceVersion", default)]
        resource_version: String,
    }
    let nodes = kube::core::Request::new("/api/v1/nodes");
    let params = kube::api::PatchParams::default();
    let patch = kube::api::Patch::Merge(patch);
    let request =
        if status { nodes.patch_subresource("status", name, &params, &patch) } else { nodes.patch(name, &params, &patch) };
    let request = request.map_err(kube::Error::BuildRequest)?;
    let written: Written = client.request(request).await?;
    Ok(written.metadata.resource_version)
}

/// The Node's name.
pub fn name(node: &Node) -> &str {
    node.metadata.name.as_deref().unwrap_or_default()
}

/// The Node's status addresses.
pub fn addresses(node: &Node) -> Vec<NodeAddress> {
    node.status.as_ref().and_then(|s| s.addresses.clone()).unwrap_or_default()
}

/// A Node's podCIDRs: `spec.podCIDRs`, or the older single `spec.podCIDR`.
pub fn pod_cidrs(node: &Node) -> Vec<String> {
    let spec = node.spec.as_ref();
    match spec.and_then(|s| s.pod_cidrs.clone()).filter(|c| !c.is_empty()) {
        Some(cidrs) => cidrs,
        None => spec.and_then(|s| s.pod_cidr.clone()).into_iter().collect(),
    }
}

/// Whether the Node has a podCIDR (as [`pod_cidrs`] reads them, without copying them).
pub fn has_pod_cidrs(node: &Node) -> bool {
    node.spec.as_ref().is_some_and(|s| s.pod_cidrs.as_ref().is_some_and(|c| !c.is_empty()) || s.pod_cidr.is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn providerids_of_one_instance_in_two_forms_are_the_same_instance() {
        assert!(same_instance("aws:///us-east-1a/i-0a1", "aws:///i-0a1"));
        assert!(same_instance("sim://its-zone/i-1", "sim://sim-region-1a/i-1"));
        assert!(same_instance("sim://z/i-1", "sim://z/i-1"));
        assert!(!same_instance("sim://z/i-1", "sim://z/i-2"));
        assert!(!same_instance("sim://z/i-1", "other://z/i-1"));
        assert!(!same_instance("sim://z/", "sim://y/"));
        assert!(!same_instance("i-1", "sim://z/i-1"));
    }
}
