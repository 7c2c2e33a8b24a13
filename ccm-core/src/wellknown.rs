//! The well-known names the core reads and writes on Kubernetes objects, in one place, as
//! upstream keeps them in its `api` packages: taints, labels, annotations, a finalizer and a
//! condition. Each says who sets it and what the core does with it.

/// Set by a kubelet started with `--cloud-provider=external`; removed once initialised.
pub const TAINT_UNINITIALIZED: &str = "node.cloudprovider.kubernetes.io/uninitialized";
/// Put on Nodes whose instance is shut down.
pub const TAINT_SHUTDOWN: &str = "node.cloudprovider.kubernetes.io/shutdown";
/// Non-graceful node shutdown: kube-controller-manager force-deletes the pods of a NotReady
/// Node with this taint and detaches their volumes. Added by the lifecycle controller (value
/// [`OUT_OF_SERVICE_VALUE`], effect NoExecute) with `--out-of-service-after`.
pub const TAINT_OUT_OF_SERVICE: &str = "node.kubernetes.io/out-of-service";
/// The value of the out-of-service taint the lifecycle controller adds.
pub const OUT_OF_SERVICE_VALUE: &str = "nodeshutdown";
/// On a Node the lifecycle controller put the out-of-service taint on: when it did (RFC 3339).
/// Only a taint recorded so is ever removed by it; an operator's own is left alone.
pub const ANNOTATION_OUT_OF_SERVICE: &str = "ccm-rs.dev/out-of-service-since";
/// On a Node: the labels the node controller owns because it made them from instance tags
/// (comma-separated keys). Only these follow the tags' later changes; a label of the same
/// key that a user set is never touched.
pub const ANNOTATION_TAG_LABELS: &str = "ccm-rs.dev/tag-labels";
/// The IP(s) the kubelet was told to use (`--node-ip`), which the cloud's addresses must hold.
pub const ANNOTATION_PROVIDED_NODE_IP: &str = "alpha.kubernetes.io/provided-node-ip";
/// On a Node, with several providers (`--provider-endpoint=NAME=…` given more than once): the
/// name of the provider whose Node it is, until its providerID (whose scheme then decides) is
/// set. A kubelet sets it with `--node-labels=ccm-rs.dev/provider=NAME`; the node controller
/// sets it on a Node that has neither, once exactly one provider's name lookup finds its
/// instance.
pub const LABEL_PROVIDER: &str = "ccm-rs.dev/provider";
/// Zone label.
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
/// Region label.
pub const LABEL_REGION: &str = "topology.kubernetes.io/region";
/// Instance type label.
pub const LABEL_INSTANCE_TYPE: &str = "node.kubernetes.io/instance-type";
/// The beta labels older kubelets and images still set, each with its GA counterpart: a Node
/// with only the beta one gets the GA one from it (upstream's label reconciliation).
pub const BETA_LABELS: [(&str, &str); 3] = [
    ("failure-domain.beta.kubernetes.io/zone", LABEL_ZONE),
    ("failure-domain.beta.kubernetes.io/region", LABEL_REGION),
    ("beta.kubernetes.io/instance-type", LABEL_INSTANCE_TYPE),
];

/// The finalizer that keeps a Service until its load balancer is gone.
pub const FINALIZER: &str = "service.kubernetes.io/load-balancer-cleanup";
/// Nodes with this label are not load balancer backends.
pub const LABEL_EXCLUDE: &str = "node.kubernetes.io/exclude-from-external-load-balancers";
/// The annotation upstream reads source ranges from when the spec has none.
pub const ANNOTATION_SOURCE_RANGES: &str = "service.beta.kubernetes.io/load-balancer-source-ranges";
/// The annotation recording the name a Service's load balancer was made under: kept when
/// `--load-balancer-naming` changes, so that a load balancer is never made anew by surprise.
pub const ANNOTATION_LOAD_BALANCER_NAME: &str = "ccm-rs.dev/load-balancer-name";
/// On a LoadBalancer Service: what its load balancer was last ensured as (a key over the spec,
/// name, provider and provider epoch, and the node set given), written by the core after an
/// Ensure, so that a new leader does not ensure it again when nothing changed.
pub const ANNOTATION_LOAD_BALANCER_ENSURED: &str = "ccm-rs.dev/load-balancer-ensured";
/// On a LoadBalancer Service, with several providers: the provider whose load balancer it has
/// (written with the finalizer, before the load balancer is made). The Service stays that
/// provider's whatever later flags say of unclassed Services, so that its load balancer is
/// updated and, with the Service, deleted where it is, never made twice.
pub const ANNOTATION_LOAD_BALANCER_PROVIDER: &str = "ccm-rs.dev/load-balancer-provider";
/// A Service's choice of load balancer backends: a Kubernetes label selector over Node labels
/// (`pool=ingress`, `zone in (a,b)`, `!spot`). The core gives the load balancer only the
/// backends it matches; a malformed one is a Warning Event and no change.
pub const ANNOTATION_NODE_SELECTOR: &str = "ccm-rs.dev/load-balancer-node-selector";
/// The podCIDRs a Node was given from its instance's (`--cidr-allocator-type=CloudAllocator`),
/// comma-separated: the route controller makes no route for them when the cloud routes them.
pub const ANNOTATION_POD_CIDRS_FROM_CLOUD: &str = "ccm-rs.dev/pod-cidrs-from-cloud";
/// The keys of the Node's instance tags the tagging controller wrote (comma-separated): the
/// only tags it ever updates or removes.
pub const ANNOTATION_INSTANCE_TAGS: &str = "ccm-rs.dev/instance-tags";
/// The Node condition the route controller keeps.
pub const CONDITION_NETWORK_UNAVAILABLE: &str = "NetworkUnavailable";
