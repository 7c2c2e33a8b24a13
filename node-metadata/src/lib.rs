//! # ccm-node-metadata
//!
//! The kubelet-side client of a provider's node plugin (NodeMetadataService and
//! ImageCredentialsService on a unix socket on the node). It runs before the kubelet starts,
//! to give it what the instance metadata service says ([`KubeletFlags`],
//! [`kubelet_config`]), and as the kubelet's exec image credential provider
//! ([`credential_provider`]).

pub mod credential_provider;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, bail};
use ccm_proto::v1::image_credentials_service_client::ImageCredentialsServiceClient;
use ccm_proto::v1::node_metadata_service_client::NodeMetadataServiceClient;
use ccm_proto::v1::{self as pb, NodeAddressType};
use tonic::Code;
use tonic::transport::Channel;

/// The zone label.
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
/// The region label.
pub const LABEL_REGION: &str = "topology.kubernetes.io/region";
/// The instance type label.
pub const LABEL_INSTANCE_TYPE: &str = "node.kubernetes.io/instance-type";

/// A connection to the node plugin at one endpoint, every call bounded by one timeout.
#[derive(Debug, Clone)]
pub struct Plugin {
    endpoint: String,
    timeout: Duration,
    channel: Channel,
}

impl Plugin {
    /// Connects to the plugin at `endpoint` (`unix:///path.sock`; `http://host:port` for
    /// tests), giving up after `timeout`.
    pub async fn connect(endpoint: &str, timeout: Duration) -> anyhow::Result<Self> {
        if let Some(path) = endpoint.strip_prefix("unix://")
            && !Path::new(path).exists()
        {
            bail!("no node-metadata plugin at {endpoint}: {path} does not exist (is the plugin running on this node?)");
        }
        let target = ccm_protocol::client::endpoint(endpoint)
            .with_context(|| format!("--endpoint {endpoint:?}"))?
            .connect_timeout(timeout);
        let channel = match tokio::time::timeout(timeout, target.connect()).await {
            Err(_) => bail!("the node-metadata plugin at {endpoint} did not accept a connection within {}", show(timeout)),
            Ok(Err(e)) => {
                // The transport error repeats its cause at every level: say the root once.
                let mut root: &dyn std::error::Error = &e;
                while let Some(next) = root.source() {
                    root = next;
                }
                bail!("cannot connect to the node-metadata plugin at {endpoint}: {root}");
            }
            Ok(Ok(channel)) => channel,
        };
        Ok(Self { endpoint: endpoint.to_string(), timeout, channel })
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(self.timeout);
        request
    }

    /// Runs one call under the timeout and turns its failure into a sentence naming the
    /// plugin and the service.
    async fn call<T>(
        &self,
        service: &str,
        call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> anyhow::Result<T> {
        let endpoint = &self.endpoint;
        match tokio::time::timeout(self.timeout, call).await {
            Err(_) => bail!("the node-metadata plugin at {endpoint} did not answer within {}", show(self.timeout)),
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => match status.code() {
                Code::Unimplemented => bail!("the plugin at {endpoint} does not serve {service}"),
                Code::DeadlineExceeded | Code::Cancelled => {
                    bail!("the node-metadata plugin at {endpoint} did not answer within {}", show(self.timeout))
                }
                code => bail!("the plugin at {endpoint} failed: {code:?}: {}", status.message()),
            },
        }
    }

    /// What the instance metadata service says about this node, checked.
    pub async fn node_metadata(&self) -> anyhow::Result<pb::InstanceMetadata> {
        let mut client = NodeMetadataServiceClient::new(self.channel.clone());
        let request = self.request(pb::GetNodeMetadataRequest {});
        let answer = self.call("NodeMetadataService", client.get_node_metadata(request)).await?;
        let metadata = answer.metadata.with_context(|| format!("the plugin at {} answered no metadata", self.endpoint))?;
        ccm_protocol::answer::node_metadata(&metadata)
            .map_err(|e| anyhow::anyhow!("the plugin at {} answered {}", self.endpoint, strip_code(&e)))?;
        Ok(metadata)
    }

    /// Credentials for pulling `request.image`, checked. Never logged.
    pub async fn image_credentials(
        &self,
        request: pb::GetImageCredentialsRequest,
    ) -> anyhow::Result<pb::GetImageCredentialsResponse> {
        let mut client = ImageCredentialsServiceClient::new(self.channel.clone());
        let image = request.image.clone();
        let answer = self.call("ImageCredentialsService", client.get_image_credentials(self.request(request))).await?;
        ccm_protocol::registry::check_answer_for(&answer, &image)
            .map_err(|e| anyhow::anyhow!("the plugin at {} answered {}", self.endpoint, strip_code(&e)))?;
        Ok(answer)
    }
}

/// An SDK error's message without its "internal error: " prefix.
fn strip_code(e: &ccm_protocol::Error) -> String {
    let text = e.to_string();
    text.strip_prefix("internal error: ").map(str::to_string).unwrap_or(text)
}

fn show(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// The kubelet flags the metadata gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeletFlags {
    /// `--provider-id`.
    pub provider_id: String,
    /// `--node-ip`: the first InternalIP of each family (IPv4 first), when there is one.
    pub node_ip: Option<String>,
    /// `--node-labels`: only the labels a kubelet may set on its own Node under the
    /// NodeRestriction admission plugin, and of those only what the cloud owns: zone,
    /// region and instance type.
    pub node_labels: BTreeMap<String, String>,
}

impl KubeletFlags {
    /// The flags for `m` (checked metadata).
    pub fn from_metadata(m: &pb::InstanceMetadata) -> Self {
        let internal: Vec<IpAddr> = m
            .addresses
            .iter()
            .filter(|a| a.r#type() == NodeAddressType::InternalIp)
            .filter_map(|a| a.address.parse().ok())
            .collect();
        let v4 = internal.iter().find(|ip| ip.is_ipv4());
        let v6 = internal.iter().find(|ip| ip.is_ipv6());
        let node_ip = match (v4, v6) {
            (Some(a), Some(b)) => Some(format!("{a},{b}")),
            (Some(a), None) | (None, Some(a)) => Some(a.to_string()),
            (None, None) => None,
        };
        let node_labels = [(LABEL_ZONE, &m.zone), (LABEL_REGION, &m.region), (LABEL_INSTANCE_TYPE, &m.instance_type)]
            .into_iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        Self { provider_id: m.provider_id.clone(), node_ip, node_labels }
    }

    /// The flags as separate arguments, in a stable order.
    pub fn args(&self) -> Vec<String> {
        let mut args = vec![format!("--provider-id={}", self.provider_id)];
        if let Some(ip) = &self.node_ip {
            args.push(format!("--node-ip={ip}"));
        }
        if !self.node_labels.is_empty() {
            let labels: Vec<String> = self.node_labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            args.push(format!("--node-labels={}", labels.join(",")));
        }
        args
    }
}

/// A KubeletConfiguration drop-in (for the kubelet's `--config-dir`) with what the kubelet's
/// configuration file can carry of the metadata: the providerID. Node IP and labels have no
/// configuration field; they stay flags.
pub fn kubelet_config(m: &pb::InstanceMetadata, endpoint: &str) -> String {
    // A JSON string is a valid YAML double-quoted scalar: no escaping rules of our own.
    let quote = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    // In the comment, anything but printable ASCII is escaped (JSON leaves U+2028 and U+2029
    // as they are, and they end a YAML comment): the answer was checked already
    // (`answer::node_metadata`), this keeps the file safe whatever is passed here.
    let printable = |s: &str| -> String {
        s.chars().map(|c| if c.is_ascii_graphic() || c == ' ' { c.to_string() } else { c.escape_unicode().to_string() }).collect()
    };
    format!(
        "# Written by ccm-node-metadata from the node-metadata plugin at {endpoint}.\n\
         # Instance {instance}; rewritten at every run, do not edit.\n\
         apiVersion: kubelet.config.k8s.io/v1beta1\n\
         kind: KubeletConfiguration\n\
         providerID: {provider_id}\n",
        instance = quote(&printable(&m.instance_id)),
        provider_id = quote(&m.provider_id),
    )
}

/// Writes `content` to `path` atomically (a temporary file in the same directory, then a
/// rename), mode 0644, creating the directory.
pub fn write_atomically(path: &Path, content: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let name = path.file_name().with_context(|| format!("{} is not a file path", path.display()))?;
    let tmp = dir.join(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(content.as_bytes())?;
        f.set_permissions(std::fs::Permissions::from_mode(0o644))?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        anyhow::Error::new(e).context(format!("writing {}", path.display()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata() -> pb::InstanceMetadata {
        let addr = |t: NodeAddressType, a: &str| pb::NodeAddress { r#type: t as i32, address: a.into() };
        pb::InstanceMetadata {
            instance_id: "i-1".into(),
            provider_id: "sim://zone-a/i-1".into(),
            zone: "zone-a".into(),
            region: "region-1".into(),
            instance_type: "sim.large".into(),
            addresses: vec![
                addr(NodeAddressType::ExternalIp, "198.51.100.1"),
                addr(NodeAddressType::InternalIp, "fd00::5"),
                addr(NodeAddressType::InternalIp, "10.0.0.5"),
                addr(NodeAddressType::InternalIp, "10.0.0.6"),
            ],
            ..Default::default()
        }
    }

    #[test]
    fn flags_carry_provider_id_node_ips_and_only_the_self_settable_labels() {
        let mut m = metadata();
        m.additional_labels.insert("example.com/rack".into(), "r1".into());
        let flags = KubeletFlags::from_metadata(&m);
        assert_eq!(
            flags.args(),
            vec![
                "--provider-id=sim://zone-a/i-1",
                "--node-ip=10.0.0.5,fd00::5",
                "--node-labels=node.kubernetes.io/instance-type=sim.large,topology.kubernetes.io/region=region-1,topology.kubernetes.io/zone=zone-a",
            ]
        );
        m.addresses.retain(|a| a.r#type() != NodeAddressType::InternalIp);
        m.zone.clear();
        let flags = KubeletFlags::from_metadata(&m);
        assert_eq!(flags.node_ip, None, "an external address is not the kubelet's node IP");
        assert!(!flags.node_labels.contains_key(LABEL_ZONE));
    }

    #[test]
    fn the_drop_in_quotes_the_provider_id() {
        let mut m = metadata();
        m.provider_id = "sim://zone-a/i-1: #x".into();
        let text = kubelet_config(&m, "unix:///p.sock");
        assert!(text.contains("providerID: \"sim://zone-a/i-1: #x\"\n"), "{text}");
        assert!(text.contains("kind: KubeletConfiguration\n"));
    }

    #[test]
    fn no_line_break_in_an_instance_id_adds_a_field_to_the_drop_in() {
        for c in ['\n', '\r', '\u{85}', '\u{2028}', '\u{2029}'] {
            let mut m = metadata();
            m.instance_id = format!("i-1{c}authorization: {{mode: AlwaysAllow}}");
            let text = kubelet_config(&m, "unix:///p.sock");
            // Every line break of any YAML version: what is not a comment is ours alone.
            let lines: Vec<&str> = text.split(['\n', '\r', '\u{85}', '\u{2028}', '\u{2029}']).filter(|l| !l.is_empty()).collect();
            let fields: Vec<&str> = lines.iter().copied().filter(|l| !l.starts_with('#')).collect();
            assert_eq!(fields.len(), 3, "{c:?}: {text}");
            let parsed: std::collections::BTreeMap<String, serde_json::Value> =
                serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{c:?}: {e}: {text}"));
            let keys: Vec<&str> = parsed.keys().map(String::as_str).collect();
            assert_eq!(keys, ["apiVersion", "kind", "providerID"], "{c:?}: {text}");
        }
    }

    #[test]
    fn atomic_writes_replace_the_file() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("sub/10-cloud.conf");
        write_atomically(&path, "a").expect("first");
        write_atomically(&path, "b").expect("second");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "b");
        assert_eq!(std::fs::read_dir(path.parent().expect("dir")).expect("ls").count(), 1, "no temporary file left");
    }
}
