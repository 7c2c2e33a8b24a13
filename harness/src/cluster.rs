//! Emulating a cluster without kubelets: Nodes with taints, addresses, podCIDRs and labels,
//! their conditions set through the status subresource, and Services.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::Context;
use k8s_openapi::api::core::v1::{
    Namespace, Node, NodeAddress, NodeCondition, NodeSpec, NodeStatus, Service, ServicePort, ServiceSpec, Taint,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};

/// The taint the node controller removes once a Node is initialised.
pub const UNINITIALIZED_TAINT: &str = "node.cloudprovider.kubernetes.io/uninitialized";

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// One test's slice of a shared control plane: a namespace of its own, and a prefix that
/// makes its cluster-scoped names (Nodes) unique.
#[derive(Clone)]
pub struct TestEnv {
    /// An admin client.
    pub client: kube::Client,
    /// The test's namespace (created).
    pub namespace: String,
    /// Prefix for cluster-scoped names.
    pub prefix: String,
}

impl TestEnv {
    /// Creates the namespace `<label>-<n>` and the matching prefix.
    pub async fn new(client: kube::Client, label: &str) -> anyhow::Result<Self> {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let prefix = format!("{label}-{}-{n}", std::process::id() % 100_000);
        let ns = Namespace { metadata: ObjectMeta { name: Some(prefix.clone()), ..Default::default() }, ..Default::default() };
        Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await.context("creating the test namespace")?;
        Ok(Self { client, namespace: prefix.clone(), prefix })
    }

    /// A unique Node name for this test.
    pub fn node_name(&self, suffix: &str) -> String {
        format!("{}-{suffix}", self.prefix)
    }

    /// Nodes.
    pub fn nodes(&self) -> Api<Node> {
        Api::all(self.client.clone())
    }

    /// Services in the test's namespace.
    pub fn services(&self) -> Api<Service> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Deletes the Nodes this test made and its namespace.
    pub async fn cleanup(&self) -> anyhow::Result<()> {
        let nodes = self.nodes().list(&Default::default()).await?;
        for node in nodes.items.iter().filter_map(|n| n.metadata.name.as_deref()).filter(|n| n.starts_with(&self.prefix)) {
            let _ = self.nodes().delete(node, &DeleteParams::default()).await;
        }
        let _ = Api::<Namespace>::all(self.client.clone()).delete(&self.namespace, &DeleteParams::default()).await;
        Ok(())
    }
}

/// A Node to create, as a kubelet would register it.
#[derive(Debug, Clone, Default)]
pub struct NodeBuilder {
    name: String,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
    taints: Vec<Taint>,
    pod_cidrs: Vec<String>,
    provider_id: Option<String>,
    addresses: Vec<NodeAddress>,
}

impl NodeBuilder {
    /// A Node named `name` with no taints, labels or addresses.
    pub fn new(name: impl Into<String>) -> Self {
        Self { name: name.into(), ..Default::default() }
    }

    /// Adds the `uninitialized` taint, as a kubelet started with `--cloud-provider=external` does.
    pub fn uninitialized(mut self) -> Self {
        self.taints.push(Taint {
            key: UNINITIALIZED_TAINT.into(),
            value: Some("true".into()),
            effect: "NoSchedule".into(),
            ..Default::default()
        });
        self
    }

    /// Adds a taint.
    pub fn taint(mut self, key: &str, value: &str, effect: &str) -> Self {
        self.taints.push(Taint { key: key.into(), value: Some(value.into()), effect: effect.into(), ..Default::default() });
        self
    }

    /// Adds a label.
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Adds an annotation.
    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        self.annotations.insert(key.into(), value.into());
        self
    }

    /// Adds a podCIDR (the first becomes `spec.podCIDR`).
    pub fn pod_cidr(mut self, cidr: &str) -> Self {
        self.pod_cidrs.push(cidr.into());
        self
    }

    /// Sets `spec.providerID`.
    pub fn provider_id(mut self, id: &str) -> Self {
        self.provider_id = Some(id.into());
        self
    }

    /// Adds a status address (`InternalIP`, `ExternalIP`, `Hostname`, ...).
    pub fn address(mut self, kind: &str, address: &str) -> Self {
        self.addresses.push(NodeAddress { type_: kind.into(), address: address.into() });
        self
    }

    /// Creates the Node, then writes its addresses through the status subresource.
    pub async fn create(self, client: &kube::Client) -> anyhow::Result<Node> {
        let api: Api<Node> = Api::all(client.clone());
        let node = Node {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                labels: Some(self.labels),
                annotations: Some(self.annotations),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                pod_cidr: self.pod_cidrs.first().cloned(),
                pod_cidrs: (!self.pod_cidrs.is_empty()).then_some(self.pod_cidrs),
                provider_id: self.provider_id,
                taints: (!self.taints.is_empty()).then_some(self.taints),
                ..Default::default()
            }),
            status: None,
        };
        let created = api.create(&PostParams::default(), &node).await.with_context(|| format!("creating node {}", self.name))?;
        if self.addresses.is_empty() {
            return Ok(created);
        }
        let status = serde_json::json!({ "status": { "addresses": self.addresses } });
        api.patch_status(&self.name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .with_context(|| format!("setting addresses of node {}", self.name))
    }
}

/// Sets a Node's Ready condition (`"True"`, `"False"` or `"Unknown"`) through the status
/// subresource, as a kubelet or the node lifecycle controller would.
pub async fn set_ready(client: &kube::Client, node: &str, status: &str) -> anyhow::Result<Node> {
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let condition = NodeCondition {
        type_: "Ready".into(),
        status: status.into(),
        reason: Some(if status == "True" { "KubeletReady" } else { "KubeletNotReady" }.into()),
        last_heartbeat_time: Some(now.clone()),
        last_transition_time: Some(now),
        message: None,
    };
    let api: Api<Node> = Api::all(client.clone());
    let mut current = api.get_status(node).await.with_context(|| format!("reading node {node}"))?;
    let status_obj = current.status.get_or_insert_with(NodeStatus::default);
    let conditions = status_obj.conditions.get_or_insert_with(Vec::new);
    conditions.retain(|c| c.type_ != "Ready");
    conditions.push(condition);
    let patch = serde_json::json!({ "status": { "conditions": conditions } });
    api.patch_status(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("setting Ready={status} on {node}"))
}

/// A Service of type LoadBalancer named `name` in `namespace` with TCP `ports`.
pub fn load_balancer_service(namespace: &str, name: &str, ports: &[i32]) -> Service {
    Service {
        metadata: ObjectMeta { name: Some(name.into()), namespace: Some(namespace.into()), ..Default::default() },
        spec: Some(ServiceSpec {
            type_: Some("LoadBalancer".into()),
            selector: Some(BTreeMap::from([("app".to_string(), name.to_string())])),
            ports: Some(
                ports
                    .iter()
                    .map(|p| ServicePort {
                        name: Some(format!("p{p}")),
                        port: *p,
                        protocol: Some("TCP".into()),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        }),
        status: None,
    }
}

/// The first ingress IP of a Service's load balancer status.
pub fn load_balancer_ip(service: &Service) -> Option<&str> {
    service.status.as_ref()?.load_balancer.as_ref()?.ingress.as_ref()?.first()?.ip.as_deref()
}

/// Creates a Service of type LoadBalancer with TCP `ports`.
pub async fn create_load_balancer_service(env: &TestEnv, name: &str, ports: &[i32]) -> anyhow::Result<Service> {
    let service = load_balancer_service(&env.namespace, name, ports);
    env.services().create(&PostParams::default(), &service).await.with_context(|| format!("creating service {name}"))
}
