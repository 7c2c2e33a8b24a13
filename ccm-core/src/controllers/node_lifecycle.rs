//! The node lifecycle controller (`cloud-node-lifecycle-controller`): every
//! `--node-monitor-period`, asks the provider about the instances of NotReady Nodes: an
//! explicit "does not exist" deletes the Node, a shut-down instance gets the shutdown taint, a
//! running one loses it. An error, a timeout or a rate limit changes nothing. A Ready Node is
//! never deleted and loses the shutdown taint without the provider being asked (as upstream:
//! a recovered Node must not stay unschedulable through a cloud outage); with every Node Ready
//! this controller makes no provider call at all.

use std::sync::Arc;

use ccm_proto::v1 as pb;
use k8s_openapi::api::core::v1::{Node, Taint};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};

use super::node::metadata_for;
use super::{Context, sleep_or_stop};
use crate::node_util::{self, TAINT_SHUTDOWN, TAINT_UNINITIALIZED};

/// The controller's name.
pub const NAME: &str = "cloud-node-lifecycle-controller";

/// What one pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pass {
    /// Nodes asked about.
    pub checked: usize,
    /// Nodes deleted.
    pub deleted: Vec<String>,
    /// Nodes tainted as shut down.
    pub tainted: Vec<String>,
    /// Nodes whose shutdown taint was removed.
    pub untainted: Vec<String>,
    /// Nodes whose lookup failed (left alone).
    pub errors: usize,
}

/// The lifecycle controller.
pub struct NodeLifecycleController {
    ctx: Context,
}

impl NodeLifecycleController {
    /// A controller over `ctx`.
    pub fn new(ctx: Context) -> Self {
        Self { ctx }
    }

    /// Runs a pass every `--node-monitor-period` until `stop`.
    pub async fn run(self, mut stop: tokio::sync::watch::Receiver<bool>) {
        self.ctx.nodes.wait_synced().await;
        while sleep_or_stop(self.ctx.options.node_monitor_period, &mut stop).await {
            let started = tokio::time::Instant::now();
            let pass = self.pass().await;
            self.ctx.metrics.reconcile(NAME, started.elapsed(), pass.errors > 0);
        }
    }

    /// One pass over the cache.
    pub async fn pass(&self) -> Pass {
        let mut pass = Pass::default();
        if self.ctx.provider.identity().is_none() {
            return pass;
        }
        let managed: Vec<Arc<Node>> = self
            .ctx
            .managed_nodes()
            // A Node still being initialised is the node controller's.
            .filter(|n| !node_util::has_taint(n, TAINT_UNINITIALIZED))
            .collect();
        let (ready, candidates): (Vec<Arc<Node>>, Vec<Arc<Node>>) = managed.into_iter().partition(|n| node_util::is_ready(n));
        for node in ready.iter().filter(|n| node_util::has_taint(n, TAINT_SHUTDOWN)) {
            let name = node_util::name(node).to_string();
            match self.set_shutdown_taint(node, false).await {
                Ok(()) => pass.untainted.push(name),
                Err(error) => {
                    tracing::warn!(node = %name, %error, "removing the shutdown taint from a Ready node failed");
                    pass.errors += 1;
                }
            }
        }
        if candidates.is_empty() {
            return pass;
        }
        pass.checked = candidates.len();
        let lookups = candidates.iter().map(|n| node_util::lookup(n)).collect();
        let results = metadata_for(&self.ctx, lookups).await;
        for (node, result) in candidates.iter().zip(results) {
            let name = node_util::name(node).to_string();
            match result {
                Err(error) => {
                    // Never read as "gone".
                    tracing::warn!(node = %name, %error, "instance check failed; node left as is");
                    pass.errors += 1;
                }
                Ok(meta) => {
                    let exists = meta.as_ref().is_some_and(|m| m.state() != pb::InstanceState::Terminated);
                    let shutdown = meta.as_ref().is_some_and(|m| m.state() == pb::InstanceState::Stopped);
                    if !exists {
                        match self.delete(node).await {
                            Ok(()) => pass.deleted.push(name),
                            Err(error) => {
                                tracing::warn!(node = %name, %error, "deleting the node failed");
                                pass.errors += 1;
                            }
                        }
                    } else if shutdown && !node_util::has_taint(node, TAINT_SHUTDOWN) {
                        match self.set_shutdown_taint(node, true).await {
                            Ok(()) => pass.tainted.push(name),
                            Err(error) => {
                                tracing::warn!(node = %name, %error, "tainting the node failed");
                                pass.errors += 1;
                            }
                        }
                    } else if !shutdown && node_util::has_taint(node, TAINT_SHUTDOWN) {
                        match self.set_shutdown_taint(node, false).await {
                            Ok(()) => pass.untainted.push(name),
                            Err(error) => {
                                tracing::warn!(node = %name, %error, "removing the shutdown taint failed");
                                pass.errors += 1;
                            }
                        }
                    }
                }
            }
        }
        pass
    }

    async fn delete(&self, node: &Node) -> Result<(), kube::Error> {
        let name = node_util::name(node);
        tracing::info!(node = %name, "deleting node: its instance no longer exists");
        self.ctx
            .event(
                NAME,
                node,
                false,
                "DeletingNode",
                format!("Deleting node {name} because it does not exist in the cloud provider"),
            )
            .await;
        self.ctx.kube_write_permit().await;
        let api: Api<Node> = Api::all(self.ctx.client.clone());
        // Only the Node we looked at: a re-registered Node of the same name has another UID.
        let params = DeleteParams {
            preconditions: Some(Preconditions { uid: node.metadata.uid.clone(), resource_version: None }),
            ..Default::default()
        };
        match api.delete(name, &params).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn set_shutdown_taint(&self, node: &Node, on: bool) -> Result<(), kube::Error> {
        let mut taints = node_util::taints_without(node, TAINT_SHUTDOWN);
        if on {
            taints.push(Taint { key: TAINT_SHUTDOWN.into(), effect: "NoSchedule".into(), value: None, time_added: None });
        }
        let patch = serde_json::json!({
            "metadata": { "resourceVersion": node.metadata.resource_version },
            "spec": { "taints": taints },
        });
        self.ctx.kube_write_permit().await;
        let api: Api<Node> = Api::all(self.ctx.client.clone());
        api.patch(node_util::name(node), &PatchParams::default(), &Patch::Merge(&patch)).await.map(|_| ())
    }
}
