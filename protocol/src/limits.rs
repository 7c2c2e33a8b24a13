//! The limits of cloudprovider.v1 that both sides enforce.

/// The most items a batch call takes.
pub const MAX_BATCH: usize = 500;
/// The longest route name.
pub const MAX_ROUTE_NAME: usize = 253;

/// The largest message either side of cloudprovider.v1 sends or accepts: 64 MiB, where gRPC's
/// default is 4 MiB. An EnsureLoadBalancer for 5000 Nodes with their labels is about 7 MB.
pub const MAX_MESSAGE_SIZE: usize = 64 << 20;

/// The most `additional_labels`, and the most `tags`, one instance's metadata may carry: more
/// than any cloud allows an instance (AWS 50 tags and its `aws:` ones, GCE 64 labels, Azure
/// 50 tags), so that an answer cannot grow every Node without bound.
pub const MAX_INSTANCE_LABELS: usize = 128;
