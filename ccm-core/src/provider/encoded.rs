//! A load balancer's node set, encoded once.
//!
//! EnsureLoadBalancer and UpdateLoadBalancerHosts carry the whole node set, the same for
//! every Service: at 1000 Nodes with their labels, copying it into each request (and again for
//! each attempt) was most of the service controller's CPU. Here the node set is encoded once
//! into protobuf bytes, and each request is its own small fields followed by those bytes: the
//! same wire format (fields may come in any order; a repeated field's entries are concatenated),
//! decoded by the provider as the generated message. Every call in flight sends those same
//! bytes, not a copy of them ([`unary`]).

use bytes::{BufMut, Bytes};
use ccm_proto::v1 as pb;
use ccm_protocol::limits::MAX_MESSAGE_SIZE;
use prost::Message;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};
use tower::Service;

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

#[cfg(test)]
impl<M: Message> WithNodes<M> {
    /// The message as it goes on the wire (without gRPC's frame header): its head's fields,
    /// then the node set.
    pub fn encode_to_vec(&self) -> Vec<u8> {
        let mut out = self.head.encode_to_vec();
        out.extend_from_slice(&self.nodes);
        out
    }
}

/// The node set that follows a request's own fields on the wire, carried in the request's
/// extensions to [`AppendNodes`].
#[derive(Debug, Clone)]
struct NodesTail(Bytes);

/// A unary call of `path` (`/package.Service/Method`) with a request and its node set, as
/// the generated clients make it, with cloudprovider.v1's message limits.
///
/// tonic encodes a request into a buffer of its own, so each call in flight held a copy of
/// the node set (5.4 MiB at 20,000 Nodes; nine such calls at once were 49 MiB of the core's
/// peak, while a busy provider read them). Here tonic encodes the request's own fields only,
/// and [`AppendNodes`] sends the node set after them from the one shared buffer.
pub async fn unary<M, T>(channel: Channel, request: Request<WithNodes<M>>, path: &'static str) -> Result<Response<T>, Status>
where
    M: Message + Send + Sync + 'static,
    T: Message + Default + Send + Sync + 'static,
{
    let (metadata, mut extensions, WithNodes { head, nodes }) = request.into_parts();
    extensions.insert(NodesTail(nodes));
    let request = Request::from_parts(metadata, extensions, head);
    let mut grpc = tonic::client::Grpc::new(AppendNodes { inner: channel })
        .max_decoding_message_size(MAX_MESSAGE_SIZE)
        .max_encoding_message_size(MAX_MESSAGE_SIZE);
    grpc.ready().await.map_err(|e| Status::unknown(format!("service was not ready: {e}")))?;
    grpc.unary(request, http::uri::PathAndQuery::from_static(path), tonic_prost::ProstCodec::default()).await
}

/// A channel that sends a request's [`NodesTail`] after its encoded message, in the same gRPC
/// frame: the frame's length is the message's and the tail's, and the tail goes out as its
/// own chunk of the body, not copied. Requests without a tail pass as they are.
#[derive(Debug, Clone)]
struct AppendNodes {
    inner: Channel,
}

impl Service<http::Request<tonic::body::Body>> for AppendNodes {
    type Response = http::Response<tonic::body::Body>;
    type Error = tower::BoxError;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut request: http::Request<tonic::body::Body>) -> Self::Future {
        // The channel made ready is the one that sends (tower's contract); a clone stays.
        let ready = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, ready);
        Box::pin(async move {
            if let Some(NodesTail(tail)) = request.extensions_mut().remove::<NodesTail>() {
                request = with_tail(request, tail).await?;
            }
            inner.call(request).await.map_err(Into::into)
        })
    }
}

/// gRPC's frame header: a compression flag, then the message's length (big-endian u32).
const FRAME_HEADER: usize = 5;

/// `request`, whose body is one uncompressed gRPC frame, with `tail` appended to the frame's
/// message.
async fn with_tail(request: http::Request<tonic::body::Body>, tail: Bytes) -> Result<http::Request<tonic::body::Body>, Status> {
    use http_body_util::BodyExt;
    let (parts, body) = request.into_parts();
    let framed = body.collect().await?.to_bytes();
    let Some((header, message)) = framed.split_at_checked(FRAME_HEADER) else {
        return Err(Status::internal(format!("the encoded request is {} bytes, shorter than a frame's header", framed.len())));
    };
    let length = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    if header[0] != 0 || length != message.len() {
        return Err(Status::internal(format!(
            "the encoded request is not one uncompressed frame (flag {}, length {length} for {} bytes)",
            header[0],
            message.len()
        )));
    }
    let total = message.len() + tail.len();
    let Some(total_u32) = u32::try_from(total).ok().filter(|_| total <= MAX_MESSAGE_SIZE) else {
        return Err(Status::out_of_range(format!(
            "the request is {total} bytes with its nodes, over the {MAX_MESSAGE_SIZE} bytes a message may have"
        )));
    };
    let mut first = bytes::BytesMut::with_capacity(FRAME_HEADER + message.len());
    first.put_u8(0);
    first.put_u32(total_u32);
    first.put_slice(message);
    let chunks = [first.freeze(), tail].map(|b| Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(b)));
    let body = http_body_util::StreamBody::new(futures::stream::iter(chunks));
    Ok(http::Request::from_parts(parts, tonic::body::Body::new(body)))
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
