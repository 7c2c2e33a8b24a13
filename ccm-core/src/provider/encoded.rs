//! A load balancer's node set, encoded once.
//!
//! EnsureLoadBalancer and UpdateLoadBalancerHosts carry the whole node set, the same for
//! every Service: at 1000 Nodes with their labels, copying it into each request (and again for
//! each attempt) was most of the service controller's CPU. Here the node set is encoded once
//! into protobuf bytes, and each request is its own small fields followed by those bytes: the
//! same wire format (fields may come in any order; a repeated field's entries are concatenated),
//! decoded by the provider as the generated message.

use bytes::{Buf, BufMut, Bytes};
use ccm_proto::v1 as pb;
use ccm_protocol::limits::MAX_MESSAGE_SIZE;
use prost::Message;
use prost::encoding::{DecodeContext, WireType};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// The field number of `nodes` in EnsureLoadBalancerRequest and UpdateLoadBalancerHostsRequest.
const NODES_FIELD: u32 = 2;

/// A node set as the `nodes` field of EnsureLoadBalancer and UpdateLoadBalancerHosts
/// requests; cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct EncodedNodes {
    bytes: Bytes,
}

impl EncodedNodes {
    /// Encodes `nodes` once.
    pub fn new(nodes: &[pb::LoadBalancerNode]) -> Self {
        Self::in_field(NODES_FIELD, nodes)
    }

    /// Encodes `nodes` once as field `field` of a request (BatchUpdateLoadBalancerHosts has
    /// them in field 1).
    pub fn in_field(field: u32, nodes: &[pb::LoadBalancerNode]) -> Self {
        let len: usize = nodes.iter().map(|n| prost::encoding::message::encoded_len(field, n)).sum();
        let mut buf = Vec::with_capacity(len);
        for node in nodes {
            prost::encoding::message::encode(field, node, &mut buf);
        }
        Self { bytes: buf.into() }
    }
}

/// A load balancer's backends, converted from the Nodes once and encoded once for every
/// EnsureLoadBalancer and UpdateLoadBalancerHosts that sends them.
#[derive(Debug, Default)]
pub struct Backends {
    nodes: Vec<pb::LoadBalancerNode>,
    encoded: std::sync::OnceLock<EncodedNodes>,
}

impl Backends {
    /// `nodes` as backends, in the order given.
    pub fn new<'a>(nodes: impl IntoIterator<Item = &'a k8s_openapi::api::core::v1::Node>) -> Self {
        Self { nodes: nodes.into_iter().map(super::convert::load_balancer_node).collect(), encoded: Default::default() }
    }

    /// Backends made by hand (a test's, a tool's).
    pub fn from_proto(nodes: Vec<pb::LoadBalancerNode>) -> Self {
        Self { nodes, encoded: Default::default() }
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// As the protocol sends them.
    pub(crate) fn proto(&self) -> &[pb::LoadBalancerNode] {
        &self.nodes
    }

    /// Encoded as a request's `nodes`.
    pub(crate) fn encoded(&self) -> &EncodedNodes {
        self.encoded.get_or_init(|| EncodedNodes::new(&self.nodes))
    }
}

/// A request message followed by an encoded node set.
#[derive(Debug, Clone, Default)]
pub struct WithNodes<M> {
    head: M,
    nodes: Bytes,
}

impl<M> WithNodes<M> {
    /// `head` (its own `nodes` left empty) with `nodes`.
    pub fn new(head: M, nodes: &EncodedNodes) -> Self {
        Self { head, nodes: nodes.bytes.clone() }
    }
}

impl<M: Message> Message for WithNodes<M> {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        self.head.encode_raw(buf);
        buf.put_slice(&self.nodes);
    }

    /// Decoding reads every field into the head (nodes included): the client never decodes
    /// its own requests, but a decoded one is the generated message's.
    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        self.head.merge_field(tag, wire_type, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        self.head.encoded_len() + self.nodes.len()
    }

    fn clear(&mut self) {
        self.head.clear();
        self.nodes = Bytes::new();
    }
}

/// A unary call of `path` (`/package.Service/Method`) with any request message, as the
/// generated clients make it, with cloudprovider.v1's message limits.
pub async fn unary<M, T>(channel: Channel, request: Request<M>, path: &'static str) -> Result<Response<T>, Status>
where
    M: Message + Send + 'static,
    T: Message + Default + Send + 'static,
{
    let mut grpc =
        tonic::client::Grpc::new(channel).max_decoding_message_size(MAX_MESSAGE_SIZE).max_encoding_message_size(MAX_MESSAGE_SIZE);
    grpc.ready().await.map_err(|e| Status::unknown(format!("service was not ready: {e}")))?;
    grpc.unary(request, http::uri::PathAndQuery::from_static(path), tonic_prost::ProstCodec::default()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(i: usize) -> pb::LoadBalancerNode {
        pb::LoadBalancerNode {
            name: format!("node-{i}"),
            provider_id: format!("sim://zone/i-{i}"),
            addresses: vec![pb::NodeAddress { r#type: pb::NodeAddressType::InternalIp as i32, address: format!("10.0.0.{i}") }],
            labels: [("team".to_string(), format!("t{i}")), ("zone".to_string(), "a".to_string())].into(),
        }
    }

    #[test]
    fn a_request_with_encoded_nodes_decodes_as_the_generated_message() {
        let nodes: Vec<_> = (0..3).map(node).collect();
        let service = pb::LoadBalancerService { load_balancer_name: "lb".into(), name: "web".into(), ..Default::default() };
        let encoded = EncodedNodes::new(&nodes);
        let update =
            WithNodes::new(pb::UpdateLoadBalancerHostsRequest { service: Some(service.clone()), nodes: vec![] }, &encoded);
        let decoded = pb::UpdateLoadBalancerHostsRequest::decode(update.encode_to_vec().as_slice()).expect("decodes");
        assert_eq!(decoded, pb::UpdateLoadBalancerHostsRequest { service: Some(service.clone()), nodes: nodes.clone() });
        let ensure = WithNodes::new(pb::EnsureLoadBalancerRequest { service: Some(service.clone()), nodes: vec![] }, &encoded);
        assert_eq!(ensure.encoded_len(), ensure.encode_to_vec().len());
        let decoded = pb::EnsureLoadBalancerRequest::decode(ensure.encode_to_vec().as_slice()).expect("decodes");
        assert_eq!(decoded.nodes, nodes, "the same nodes, in order");
        let batch = WithNodes::new(
            pb::BatchUpdateLoadBalancerHostsRequest { nodes: vec![], services: vec![service.clone(), service.clone()] },
            &EncodedNodes::in_field(1, &nodes),
        );
        let decoded = pb::BatchUpdateLoadBalancerHostsRequest::decode(batch.encode_to_vec().as_slice()).expect("decodes");
        assert_eq!(decoded, pb::BatchUpdateLoadBalancerHostsRequest { nodes: nodes.clone(), services: vec![service.clone(); 2] });
        let empty = WithNodes::new(pb::EnsureLoadBalancerRequest::default(), &EncodedNodes::new(&[]));
        assert!(pb::EnsureLoadBalancerRequest::decode(empty.encode_to_vec().as_slice()).expect("decodes").nodes.is_empty());
    }
}
