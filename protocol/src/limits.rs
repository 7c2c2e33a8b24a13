//! The limits of cloudprovider.v1 that both sides enforce.

/// The most items a batch call takes.
pub const MAX_BATCH: usize = 500;
/// The longest route name.
pub const MAX_ROUTE_NAME: usize = 253;

/// The largest message either side of cloudprovider.v1 sends or accepts: 64 MiB, where gRPC's
/// default is 4 MiB. An EnsureLoadBalancer for 5000 Nodes with their labels is about 7 MB.
pub const MAX_MESSAGE_SIZE: usize = 64 << 20;
