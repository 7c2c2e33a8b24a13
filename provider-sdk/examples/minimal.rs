//! A minimal provider: a fixed inventory served as InstancesService over a unix socket.
//! Run it with `cargo run -p ccm-provider-sdk --example minimal -- unix:///tmp/minimal.sock`
//! and check it with `ccm-conformance --endpoint unix:///tmp/minimal.sock`.

use std::sync::Arc;

use ccm_provider_sdk::proto::{InstanceLookup, InstanceMetadata, InstanceState, NodeAddress, NodeAddressType};
use ccm_provider_sdk::{Instances, Listen, Page, PageRequest, ProviderServer, Result, paginate};

/// Stands in for a cloud SDK client.
struct MyCloud {
    machines: Vec<(&'static str, &'static str, &'static str)>, // (id, hostname, ip)
}

impl MyCloud {
    fn describe(&self, id: &str, host: &str, ip: &str) -> InstanceMetadata {
        InstanceMetadata {
            provider_id: format!("mycloud://{id}"),
            instance_id: id.to_string(),
            instance_type: "standard-2".into(),
            zone: "zone-1".into(),
            region: "region-1".into(),
            addresses: vec![NodeAddress { r#type: NodeAddressType::InternalIp as i32, address: ip.into() }],
            hostname: host.to_string(),
            node_name: host.to_string(),
            state: InstanceState::Running as i32,
            ..Default::default()
        }
    }
}

#[ccm_provider_sdk::async_trait]
impl Instances for MyCloud {
    async fn instance_metadata(&self, lookup: &InstanceLookup) -> Result<Option<InstanceMetadata>> {
        // Unknown instances are Ok(None), never an error: the core deletes Nodes on "gone".
        let id = lookup.provider_id.strip_prefix("mycloud://");
        Ok(self
            .machines
            .iter()
            .find(|(i, host, _)| Some(*i) == id || (id.is_none() && *host == lookup.node_name))
            .map(|(i, host, ip)| self.describe(i, host, ip)))
    }

    async fn list_instances(&self, page: &PageRequest) -> Result<Page<InstanceMetadata>> {
        let all = self.machines.iter().map(|(i, host, ip)| self.describe(i, host, ip)).collect();
        paginate(all, |m| m.instance_id.as_str(), page)
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let listen: Listen = std::env::args().nth(1).unwrap_or("unix:///tmp/minimal.sock".into()).parse()?;
    let cloud = Arc::new(MyCloud { machines: vec![("vm-1", "node-1", "10.0.0.11"), ("vm-2", "node-2", "10.0.0.12")] });
    ProviderServer::new("minimal.example.com", "0.1.0").instances(cloud).serve(&listen).await?;
    Ok(())
}
