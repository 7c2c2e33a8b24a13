//! A real kubelet cluster on this host, for what an operator installs (images, chart,
//! kustomize): a control plane (etcd, kube-apiserver, kube-controller-manager with
//! `--cloud-provider=external`, kube-scheduler) and several nodes, each a kubelet with its own
//! containerd, kube-proxy, bridge CNI, root directory, network namespace, mount namespace and
//! cgroup tree. No image registry: images are OCI archives imported into every node's
//! containerd (see `deploy/images/build.py`).
//!
//! Layout, for node `i` of a cluster with id `<id>`:
//! - a host bridge `ccm<id>` with the gateway `10.250.<k>.1/24`, which is also the address the
//!   API server binds (pods reach it through the `kubernetes` Service);
//! - a *holder* process (`unshare --net --mount`) that owns the node's network and mount
//!   namespaces; containerd, the kubelet and kube-proxy enter both (`nsenter`). Its `eth0`
//!   (a veth on the bridge) is `10.250.<k>.(10+i)`. Inside its mount namespace the node's own
//!   directories are bind-mounted over `/var/lib/kubelet`, `/etc/kubernetes`, `/var/log/pods`,
//!   `/var/log/containers`, `/var/lib/cni`, `/etc/cni/net.d` and `/run/containerd`, so that
//!   hostPath volumes and the paths kubelets hard-code are per node, and every mount the node
//!   makes vanishes with the namespace;
//! - a cgroup `/ccm-e2e-<id>-n<i>` in every (v1) hierarchy: the node's processes run in its
//!   `system` child, the kubelet's pods under it (`cgroupRoot`).
//!
//! Teardown (on drop, or by a watchdog when the test process dies) kills every process in the
//! nodes' cgroups and the control plane, removes the cgroups, the bridge and the directory:
//! no process, mount, link, route, namespace, cgroup or iptables rule stays behind (kube-proxy
//! and the CNI plugins only ever touched the nodes' own network namespaces).
//!
//! It needs root, `unshare`/`nsenter`, iproute2, iptables, containerd and runc and the CNI
//! plugins (`.ci/run` installs them); [`KubeletCluster::start`] says in one sentence what is
//! missing, as [`Unavailable`].

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::assets::Assets;
use crate::control_plane::{ControlPlane, Settings, free_port, tail};
use crate::{images, machine};

/// Set in CI: a machine that cannot run the kubelet cluster (or build the images) fails the
/// tests that need it instead of skipping them.
pub const REQUIRE: &str = "CCM_E2E_REQUIRE_KUBELET_CLUSTER";

/// The pod network of the cluster; kube-controller-manager gives each Node a /24 of it.
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The sandbox image every node's containerd uses (built here, never pulled).
pub const PAUSE_IMAGE: &str = "ccm-e2e.local/pause:1";
/// The ClusterIP of the cluster DNS the kubelets point pods at (no DNS server runs: the
/// charts under test must not need one, as on a cluster whose Nodes are not initialised yet).
pub const CLUSTER_DNS: &str = "10.96.0.10";
const CNI_BIN: &str = "/usr/lib/cni";
/// Host paths every kubelet or containerd hard-codes, bind-mounted per node.
const NODE_PATHS: &[(&str, &str)] = &[
    ("/var/lib/kubelet", "kubelet"),
    ("/etc/kubernetes", "etc-kubernetes"),
    ("/var/log/pods", "log/pods"),
    ("/var/log/containers", "log/containers"),
    ("/var/lib/cni", "cni"),
    ("/etc/cni/net.d", "net.d"),
    ("/run/containerd", "run-containerd"),
    ("/run/netns", "netns"),
];

pub use crate::machine::Unavailable;

/// One node: its name, address and processes.
pub struct KubeletNode {
    /// The Node's name (the kubelet's `--hostname-override`).
    pub name: String,
    /// Its InternalIP (`--node-ip`), on the cluster bridge.
    pub ip: Ipv4Addr,
    dir: PathBuf,
    holder: Child,
    containerd: Child,
    kubelet: std::sync::Mutex<Option<Child>>,
    proxy: Child,
    kubelet_args: Vec<String>,
    cgroups: Vec<PathBuf>,
    ns_pid: u32,
}

impl KubeletNode {
    /// The node's own directory: `host(path)` maps a host path the node sees (such as
    /// `/etc/kubernetes/kubelet.conf.d`) to where it really is.
    pub fn host(&self, path: &str) -> PathBuf {
        for (target, source) in NODE_PATHS {
            if let Some(rest) = path.strip_prefix(target) {
                return self.dir.join(source).join(rest.trim_start_matches('/'));
            }
        }
        PathBuf::from(path)
    }

    /// The containerd socket of this node.
    pub fn containerd_socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }

    /// The kubelet's log file.
    pub fn kubelet_log(&self) -> PathBuf {
        self.dir.join("kubelet.log")
    }
}

/// The cloud's edge, a network namespace of its own between the clients and the nodes, as a
/// cloud's load balancers sit between the internet and its machines: `vpc0` on the cluster
/// bridge at `10.250.<k>.2`, and a link to the host (`10.251.<k>.2`, the host being
/// `10.251.<k>.1`), over which the host reaches the load balancer addresses
/// (`10.252.<k>.0/24`). A client on the host therefore comes from outside the nodes' network,
/// as the internet's do. The nodes route answers to the host's side, and the load balancer
/// addresses, through the edge; the edge routes every node's podCIDR to the node. The sim's
/// data plane agent runs here ([`KubeletCluster::start_dataplane`]).
#[derive(Debug, Clone)]
pub struct Edge {
    /// The edge's address on the cluster bridge.
    pub vpc_ip: Ipv4Addr,
    /// The host's address on its link to the edge (the clients' source address).
    pub client_ip: Ipv4Addr,
    /// The edge's address on that link.
    pub outside_ip: Ipv4Addr,
    /// The host–edge link's network.
    pub outside_net: String,
    /// The load balancers' address pool.
    pub pool: String,
    /// The pid that owns the edge's network namespace.
    pub ns_pid: u32,
}

/// The port the data plane agent serves on, at the edge's `vpc_ip`.
pub const DATAPLANE_PORT: u16 = 9300;

/// A running kubelet cluster. See the module documentation.
pub struct KubeletCluster {
    control_plane: ControlPlane,
    /// The nodes, in order.
    pub nodes: Vec<KubeletNode>,
    daemons: Vec<Child>,
    dir: PathBuf,
    teardown: PathBuf,
    watchdog: Option<Child>,
    kubelet_bin: PathBuf,
    /// The bridge's address (the API server's).
    pub gateway: Ipv4Addr,
    /// The cloud's edge: where load balancers forward from. See [`Edge`].
    pub edge: Edge,
    edge_holder: Option<Child>,
    dataplane: std::sync::Mutex<Option<Child>>,
    /// How long the start took.
    pub startup: Duration,
    torn_down: bool,
}

fn run(cmd: &mut Command, what: &str) -> anyhow::Result<String> {
    let out = cmd.stdin(Stdio::null()).output().with_context(|| format!("{what}: starting {cmd:?}"))?;
    if !out.status.success() {
        bail!("{what} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn sh(script: &str, what: &str) -> anyhow::Result<String> {
    run(Command::new("sh").args(["-c", script]), what)
}

/// The mounted cgroup v1 hierarchies (`/sys/fs/cgroup/<name>`), or the v2 root.
fn cgroup_hierarchies() -> anyhow::Result<Vec<PathBuf>> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").context("reading /proc/self/mounts")?;
    let mut out: Vec<PathBuf> = mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2 && (f[2] == "cgroup" || f[2] == "cgroup2")).then(|| PathBuf::from(f[1]))
        })
        .collect();
    out.sort();
    out.dedup();
    if out.is_empty() {
        bail!("no cgroup file system is mounted");
    }
    Ok(out)
}

/// Checks what the cluster needs from the machine.
pub fn check_machine() -> Result<(), Unavailable> {
    if !machine::is_root() {
        return Err(Unavailable("the kubelet cluster needs root (network and mount namespaces, cgroups)".into()));
    }
    let hint = ".ci/run installs it";
    let tools = ["unshare", "nsenter", "ip", "iptables", "containerd", "containerd-shim-runc-v2", "runc", "ctr", "python3"];
    machine::require("the kubelet cluster", &tools.map(|t| (t, hint)))?;
    for plugin in ["bridge", "host-local", "portmap", "loopback"] {
        if !Path::new(CNI_BIN).join(plugin).is_file() {
            return Err(Unavailable(format!(
                "the kubelet cluster needs the CNI plugin {CNI_BIN}/{plugin} (containernetworking-plugins)"
            )));
        }
    }
    Ok(())
}

/// A /24 under 10.250.0.0/16 that no interface of this host uses.
fn free_subnet() -> anyhow::Result<u8> {
    let addrs = run(Command::new("ip").args(["-4", "-o", "addr"]), "listing addresses")?;
    let routes = run(Command::new("ip").args(["-4", "route"]), "listing routes")?;
    let start = (std::process::id() % 200) as u8;
    (0..200u8)
        .map(|i| 20 + (start.wrapping_add(i) % 200))
        .find(|k| {
            [format!("10.250.{k}."), format!("10.251.{k}."), format!("10.252.{k}.")]
                .iter()
                .all(|prefix| !addrs.contains(prefix) && !routes.contains(prefix))
        })
        .context("no free 10.250.x.0/24 subnet for the cluster bridge")
}

/// Makes the edge's network namespace and links (see [`Edge`]); the holder process owns it.
fn start_edge(dir: &Path, bridge: &str, k: u8) -> anyhow::Result<(Edge, Child)> {
    let ready = dir.join("edge.ready");
    let log = std::fs::File::create(dir.join("edge-holder.log")).context("creating edge-holder.log")?;
    let mut holder = Command::new("unshare")
        .args(["--net", "--", "sh", "-c"])
        .arg(format!("touch '{}' && exec sleep infinity", ready.display()))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting the edge's namespace holder")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ready.exists() {
        if Instant::now() > deadline {
            let _ = holder.kill();
            bail!("the edge's namespace was not ready: {}", tail(&dir.join("edge-holder.log"), 10));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let edge = Edge {
        vpc_ip: Ipv4Addr::new(10, 250, k, 2),
        client_ip: Ipv4Addr::new(10, 251, k, 1),
        outside_ip: Ipv4Addr::new(10, 251, k, 2),
        outside_net: format!("10.251.{k}.0/30"),
        pool: format!("10.252.{k}.0/24"),
        ns_pid: holder.id(),
    };
    let pid = edge.ns_pid;
    let made = sh(
        &format!(
            "ip link add {bridge}e type veth peer name vpc0 netns {pid} && ip link set {bridge}e master {bridge} up && \
             ip link add {bridge}x type veth peer name outside0 netns {pid} && ip addr add {client}/30 dev {bridge}x && ip link set {bridge}x up && \
             nsenter --target {pid} --net sh -c 'ip link set lo up && ip addr add {vpc}/24 dev vpc0 && ip link set vpc0 up && \
               ip addr add {outside}/30 dev outside0 && ip link set outside0 up && \
               sysctl -qw net.ipv4.ip_forward=1 && sysctl -qw net.ipv4.conf.all.send_redirects=0 && sysctl -qw net.ipv4.conf.vpc0.send_redirects=0' && \
             ip route add {pool} via {outside} dev {bridge}x",
            client = edge.client_ip,
            vpc = edge.vpc_ip,
            outside = edge.outside_ip,
            pool = edge.pool,
        ),
        "making the edge's links",
    );
    if let Err(e) = made {
        let _ = holder.kill();
        let _ = holder.wait();
        return Err(e);
    }
    Ok((edge, holder))
}

/// Builds (or reuses) the pause image archive from the static pause program.
fn pause_image(cache: &Path, pause_bin: &Path) -> anyhow::Result<PathBuf> {
    let out = cache.join("pause.tar");
    let build_py = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/images/build.py");
    run(
        Command::new("python3")
            .arg(&build_py)
            .arg("--file")
            .arg(format!("{}:/pause", pause_bin.display()))
            .args(["--entrypoint", "/pause", "--tag", PAUSE_IMAGE, "--out"])
            .arg(&out),
        "building the pause image",
    )?;
    Ok(out)
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn log_file(path: &Path) -> anyhow::Result<(Stdio, Stdio)> {
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    Ok((file.try_clone()?.into(), file.into()))
}

/// Shell commands that move the running shell into the node's `system` cgroup of every
/// hierarchy (what it starts then runs there too).
fn join_cgroups(cgroups: &[PathBuf]) -> String {
    cgroups.iter().map(|c| format!("echo $$ > {}/system/cgroup.procs; ", c.display())).collect()
}

/// A command that joins the node's `system` cgroup in every hierarchy, then enters the
/// holder's network and mount namespaces and runs `program args`.
fn in_node(cgroups: &[PathBuf], holder: u32, program: &Path, args: &[String]) -> Command {
    let join = join_cgroups(cgroups);
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(format!("{join}exec nsenter --target \"$0\" --net --mount -- \"$@\""))
        .arg(holder.to_string())
        .arg(program)
        .args(args);
    cmd
}

fn kubeconfig_path(cp: &ControlPlane, user: &str, group: Option<&str>) -> anyhow::Result<PathBuf> {
    cp.kubeconfig_for(user, group).with_context(|| format!("a kubeconfig for {user}"))
}

/// containerd's configuration for one node (version 2 format, containerd 1.6 and 1.7).
fn containerd_config(node: &Path) -> String {
    let d = node.display();
    format!(
        r#"version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "{d}/containerd.sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # root here lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj below the parent's.
  restrict_oom_score_adj = true
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{d}/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "/etc/cni/net.d"
"#
    )
}

fn kubelet_config(cgroup_root: &str, containerd: &Path, ca: &Path) -> String {
    format!(
        "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n\
         failCgroupV1: false\ncgroupDriver: cgroupfs\ncgroupRoot: /{cgroup_root}\nfailSwapOn: false\n\
         containerRuntimeEndpoint: unix://{containerd}\n\
         authentication:\n  anonymous: {{enabled: true}}\n  webhook: {{enabled: false}}\n  x509: {{clientCAFile: {ca}}}\n\
         authorization: {{mode: AlwaysAllow}}\n\
         clusterDNS: [{CLUSTER_DNS}]\nclusterDomain: cluster.local\nresolvConf: /etc/resolv.conf\n\
         readOnlyPort: 0\nhealthzBindAddress: 127.0.0.1\n\
         # Images cannot be pulled again: never collect them, never evict for disk.\n\
         imageGCHighThresholdPercent: 100\nimageGCLowThresholdPercent: 99\n\
         evictionHard: {{memory.available: 1Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}}\n\
         serializeImagePulls: false\nprotectKernelDefaults: false\nshutdownGracePeriod: 0s\n\
         nodeStatusUpdateFrequency: 4s\nsyncFrequency: 10s\nfileCheckFrequency: 5s\n",
        containerd = containerd.display(),
        ca = ca.display(),
    )
}

fn kube_proxy_config(name: &str, kubeconfig: &Path) -> String {
    format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
         clientConnection: {{kubeconfig: {}}}\nhostnameOverride: {name}\nclusterCIDR: {CLUSTER_CIDR}\nmode: iptables\n\
         # Leave the host-wide conntrack table size alone.\n\
         conntrack: {{maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}\n\
         # Its health server answers the load balancers' checks (KEP-3836): on every address.\n\
         metricsBindAddress: 127.0.0.1:10249\nhealthzBindAddress: 0.0.0.0:10256\n",
        kubeconfig.display()
    )
}

/// The bridge CNI configuration for a node's podCIDR (what a network DaemonSet such as
/// kindnet writes once kube-controller-manager has allocated the CIDR). No masquerade of its
/// own: the bridge plugin's would hide a pod's address from pods on other nodes (it spares
/// only the node's own /24); [`KubeletCluster::route_pod_networks`] masquerades what leaves
/// the cluster's pod network, as kindnet does.
fn cni_config(pod_cidr: &str) -> String {
    format!(
        r#"{{"cniVersion": "1.0.0", "name": "ccm-e2e", "plugins": [
  {{"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
    "ipam": {{"type": "host-local", "ranges": [[{{"subnet": "{pod_cidr}"}}]], "routes": [{{"dst": "0.0.0.0/0"}}]}}}},
  {{"type": "portmap", "capabilities": {{"portMappings": true}}}}
]}}
"#
    )
}

impl KubeletCluster {
    /// Starts a control plane and `nodes` kubelet nodes named `<prefix>-<i>`, imports
    /// `images` (OCI archives) into every node, and waits until every Node is registered
    /// and Ready (pod network configured). The Nodes keep the `uninitialized` taint: that is
    /// the cloud-controller-manager's to remove.
    pub fn start(nodes: usize, prefix: &str, images: &[PathBuf]) -> anyhow::Result<Self> {
        check_machine()?;
        let begin = Instant::now();
        let bins = Assets::tool_dir("cluster")?;
        let subnet = free_subnet()?;
        let gateway = Ipv4Addr::new(10, 250, subnet, 1);
        let id = format!("{}{subnet}", std::process::id() % 1000);
        let dir = PathBuf::from(format!("/var/tmp/ccm-e2e-cluster-{id}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let bridge = format!("ccm{id}");
        let hierarchies = cgroup_hierarchies()?;
        let cgroup_name = |i: usize| format!("ccm-e2e-{id}-n{i}");

        // The teardown script comes first, so that whatever fails below is undone.
        let teardown = dir.join("teardown.sh");
        let roots: Vec<String> =
            (0..nodes).flat_map(|i| hierarchies.iter().map(move |h| h.join(cgroup_name(i)).display().to_string())).collect();
        write(
            &teardown,
            &format!(
                "#!/bin/sh\n# Tears down kubelet cluster {id}: processes, cgroups, bridge, files.\n\
                 pids=\"$(cat '{dir}/pids' 2>/dev/null)\"\n\
                 [ -n \"$pids\" ] && kill -TERM $pids 2>/dev/null\n\
                 for _ in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do\n  left=0\n  for root in {roots}; do\n    \
                 [ -d \"$root\" ] || continue\n    \
                 for p in $(find \"$root\" -name cgroup.procs -exec cat {{}} + 2>/dev/null); do kill -KILL \"$p\" 2>/dev/null; left=1; done\n  done\n  \
                 [ $left = 0 ] && break\n  sleep 0.25\ndone\n\
                 [ -n \"$pids\" ] && kill -KILL $pids 2>/dev/null\n\
                 for root in {roots}; do [ -d \"$root\" ] && find \"$root\" -depth -type d -exec rmdir {{}} + 2>/dev/null; done\n\
                 for i in {indices}; do ip link del '{bridge}h'$i 2>/dev/null; done\n\
                 ip link del '{bridge}e' 2>/dev/null\n\
                 ip link del '{bridge}x' 2>/dev/null\n\
                 ip link del '{bridge}' 2>/dev/null\n\
                 rm -rf '{dir}'\n\
                 exit 0\n",
                dir = dir.display(),
                roots = roots.join(" "),
                indices = (0..nodes).map(|i| i.to_string()).collect::<Vec<_>>().join(" "),
            ),
        )?;
        let watchdog = Command::new("sh")
            .args([
                "-c",
                &format!("while kill -0 {} 2>/dev/null; do sleep 1; done; sh '{}'", std::process::id(), teardown.display()),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting the cluster watchdog")?;
        let undo = |e: anyhow::Error| {
            let _ = Command::new("sh").arg(&teardown).status();
            e
        };

        // The bridge first: the API server binds its address.
        // The nodes' mount points on the host. They stay (empty) afterwards: removing one
        // while another cluster's nodes have it mounted would detach their mounts.
        for (target, _) in NODE_PATHS {
            std::fs::create_dir_all(target).with_context(|| format!("creating {target}")).map_err(undo)?;
        }
        sh(
            &format!("ip link add {bridge} type bridge && ip addr add {gateway}/24 dev {bridge} && ip link set {bridge} up"),
            "creating the cluster bridge",
        )
        .map_err(undo)?;
        let (edge, edge_holder) = start_edge(&dir, &bridge, subnet).map_err(undo)?;
        let control_plane = match ControlPlane::start_with(&Settings { bind: IpAddr::V4(gateway), service_accounts: true }) {
            Ok(cp) => cp,
            Err(e) => {
                let mut holder = edge_holder;
                let _ = holder.kill();
                let _ = holder.wait();
                return Err(undo(e));
            }
        };
        let mut cluster = Self {
            control_plane,
            nodes: Vec::new(),
            daemons: Vec::new(),
            dir: dir.clone(),
            teardown: teardown.clone(),
            watchdog: Some(watchdog),
            kubelet_bin: bins.join("kubelet"),
            gateway,
            edge,
            edge_holder: Some(edge_holder),
            dataplane: std::sync::Mutex::new(None),
            startup: Duration::ZERO,
            torn_down: false,
        };
        let pause = pause_image(&dir, &bins.join("pause"))?;
        cluster.start_controllers(&bins)?;
        for i in 0..nodes {
            let name = format!("{prefix}-{i}");
            let node = cluster.start_node(i, &name, &bins, &bridge, &hierarchies, &cgroup_name(i), &pause, images)?;
            cluster.nodes.push(node);
        }
        cluster.record_pids()?;
        cluster.configure_pod_network(Duration::from_secs(90))?;
        cluster.startup = begin.elapsed();
        Ok(cluster)
    }

    fn record_pids(&self) -> anyhow::Result<()> {
        let mut pids: Vec<u32> = self.daemons.iter().map(Child::id).collect();
        pids.extend(self.control_plane.pids());
        pids.extend(self.edge_holder.as_ref().map(Child::id));
        pids.extend(self.dataplane.lock().ok().and_then(|d| d.as_ref().map(Child::id)));
        for n in &self.nodes {
            pids.extend([n.holder.id(), n.containerd.id(), n.proxy.id()]);
            pids.extend(n.kubelet.lock().ok().and_then(|k| k.as_ref().map(Child::id)));
        }
        let text: Vec<String> = pids.iter().map(u32::to_string).collect();
        write(&self.dir.join("pids"), &text.join(" "))
    }

    fn spawn_logged(&self, mut cmd: Command, log: &str) -> anyhow::Result<Child> {
        let (out, err) = log_file(&self.dir.join(log))?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(err).spawn().with_context(|| format!("starting {log}"))
    }

    fn start_controllers(&mut self, bins: &Path) -> anyhow::Result<()> {
        let cp = &self.control_plane;
        let admin = cp.kubeconfig_path().to_path_buf();
        let cp_dir = cp.dir().to_path_buf();
        let mut kcm = Command::new(bins.join("kube-controller-manager"));
        kcm.arg(format!("--kubeconfig={}", admin.display()))
            .arg(format!("--authentication-kubeconfig={}", admin.display()))
            .arg(format!("--authorization-kubeconfig={}", admin.display()))
            .args(["--cloud-provider=external", "--allocate-node-cidrs=true", "--node-cidr-mask-size=24"])
            .arg(format!("--cluster-cidr={CLUSTER_CIDR}"))
            .arg(format!("--service-cluster-ip-range={}", crate::control_plane::SERVICE_CLUSTER_IP_RANGE))
            .arg(format!("--root-ca-file={}", cp_dir.join("ca.crt").display()))
            .arg(format!("--service-account-private-key-file={}", cp_dir.join("sa.key").display()))
            .args(["--configure-cloud-routes=false", "--leader-elect=false", "--bind-address=127.0.0.1"])
            .arg(format!("--secure-port={}", free_port()?))
            .arg("--v=1");
        let kcm = self.spawn_logged(kcm, "kube-controller-manager.log")?;
        self.daemons.push(kcm);
        let mut scheduler = Command::new(bins.join("kube-scheduler"));
        scheduler
            .arg(format!("--kubeconfig={}", admin.display()))
            .arg(format!("--authentication-kubeconfig={}", admin.display()))
            .arg(format!("--authorization-kubeconfig={}", admin.display()))
            .args(["--leader-elect=false", "--bind-address=127.0.0.1"])
            .arg(format!("--secure-port={}", free_port()?))
            .arg("--v=1");
        let scheduler = self.spawn_logged(scheduler, "kube-scheduler.log")?;
        self.daemons.push(scheduler);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn start_node(
        &self,
        i: usize,
        name: &str,
        bins: &Path,
        bridge: &str,
        hierarchies: &[PathBuf],
        cgroup_root: &str,
        pause: &Path,
        images: &[PathBuf],
    ) -> anyhow::Result<KubeletNode> {
        let dir = self.dir.join(format!("n{i}"));
        for (_, source) in NODE_PATHS {
            std::fs::create_dir_all(dir.join(source)).with_context(|| format!("creating {source} of {name}"))?;
        }
        std::fs::create_dir_all(dir.join("etc-kubernetes/kubelet.conf.d"))?;
        let ip = Ipv4Addr::new(10, 250, self.gateway.octets()[2], 10 + i as u8);

        // The node's cgroups, in every hierarchy (cpuset needs its cpus and mems set).
        let cgroups: Vec<PathBuf> = hierarchies.iter().map(|h| h.join(cgroup_root)).collect();
        for (cg, h) in cgroups.iter().zip(hierarchies) {
            for sub in ["", "system"] {
                let path = cg.join(sub);
                std::fs::create_dir_all(&path).with_context(|| format!("creating cgroup {}", path.display()))?;
                for file in ["cpuset.cpus", "cpuset.mems"] {
                    if let Ok(value) = std::fs::read_to_string(h.join(file)) {
                        std::fs::write(path.join(file), value.trim()).with_context(|| format!("{}/{file}", path.display()))?;
                    }
                }
            }
        }

        // The holder: network and mount namespaces, with the node's directories mounted.
        let binds: String = NODE_PATHS
            .iter()
            .map(|(target, source)| format!("mount --bind '{}' '{target}' && ", dir.join(source).display()))
            .collect();
        let join = join_cgroups(&cgroups);
        let ready = dir.join("holder.ready");
        let mut holder = Command::new("sh");
        holder.arg("-c").arg(format!(
            "{join}exec unshare --net --mount --propagation private -- sh -c \"{binds}touch '{}' && exec sleep infinity\"",
            ready.display()
        ));
        let holder = self.spawn_logged(holder, &format!("n{i}/holder.log"))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ready.exists() {
            if Instant::now() > deadline {
                bail!("node {name}: its namespaces were not ready: {}", tail(&dir.join("holder.log"), 10));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // sh exec'd unshare, which exec'd (no fork without --pid) the inner shell, which
        // exec'd sleep: the holder's pid owns the namespaces.
        let ns_pid = holder.id();
        let host_if = format!("{bridge}h{i}");
        sh(
            &format!(
                "ip link add {host_if} type veth peer name eth0 netns {ns_pid} && ip link set {host_if} master {bridge} up && \
                 nsenter --target {ns_pid} --net sh -c 'ip link set lo up && ip addr add {ip}/24 dev eth0 && ip link set eth0 up && \
                 ip route add default via {gw} && ip route add {outside} via {edge} && ip route add {pool} via {edge} && \
                 sysctl -qw net.ipv4.ip_forward=1'",
                gw = self.gateway,
                edge = self.edge.vpc_ip,
                outside = self.edge.outside_net,
                pool = self.edge.pool,
            ),
            &format!("node {name}: network"),
        )?;

        let cp = &self.control_plane;
        write(&dir.join("containerd.toml"), &containerd_config(&dir))?;
        let containerd = self.spawn_logged(
            in_node(&cgroups, ns_pid, Path::new("containerd"), &[format!("--config={}", dir.join("containerd.toml").display())]),
            &format!("n{i}/containerd.log"),
        )?;
        let socket = dir.join("containerd.sock");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !socket.exists() {
            if Instant::now() > deadline {
                bail!("node {name}: containerd did not start: {}", tail(&dir.join("containerd.log"), 20));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        for image in std::iter::once(pause).chain(images.iter().map(PathBuf::as_path)) {
            run(
                Command::new("ctr").arg("--address").arg(&socket).args(["-n", "k8s.io", "images", "import"]).arg(image),
                &format!("node {name}: importing {}", image.display()),
            )?;
        }

        let kubeconfig = kubeconfig_path(cp, &format!("system:node:{name}"), Some("system:nodes"))?;
        write(&dir.join("kubelet.yaml"), &kubelet_config(cgroup_root, &socket, &cp.dir().join("ca.crt")))?;
        let kubelet_args = vec![
            format!("--config={}", dir.join("kubelet.yaml").display()),
            "--config-dir=/etc/kubernetes/kubelet.conf.d".to_string(),
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--hostname-override={name}"),
            format!("--node-ip={ip}"),
            "--cloud-provider=external".to_string(),
            "--v=1".to_string(),
        ];
        let kubelet =
            self.spawn_logged(in_node(&cgroups, ns_pid, &self.kubelet_bin, &kubelet_args), &format!("n{i}/kubelet.log"))?;
        let proxy_kubeconfig = kubeconfig_path(cp, "system:kube-proxy", None)?;
        write(&dir.join("kube-proxy.yaml"), &kube_proxy_config(name, &proxy_kubeconfig))?;
        let proxy = self.spawn_logged(
            in_node(&cgroups, ns_pid, &bins.join("kube-proxy"), &[format!("--config={}", dir.join("kube-proxy.yaml").display())]),
            &format!("n{i}/kube-proxy.log"),
        )?;
        Ok(KubeletNode {
            name: name.to_string(),
            ip,
            dir,
            holder,
            containerd,
            kubelet: std::sync::Mutex::new(Some(kubelet)),
            proxy,
            kubelet_args,
            cgroups,
            ns_pid,
        })
    }

    /// Waits for every Node to register and get its podCIDR, writes its CNI configuration
    /// (again when the podCIDR changed: a Node deleted and registered anew), and waits until
    /// every Node is Ready.
    pub fn configure_pod_network(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let out = self.kubectl(&["get", "nodes", "-o", "json"]).output().context("kubectl get nodes")?;
            let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            let items = list["items"].as_array().cloned().unwrap_or_default();
            let mut ready = 0;
            for node in &self.nodes {
                let Some(item) = items.iter().find(|n| n["metadata"]["name"] == node.name.as_str()) else { continue };
                if let Some(cidr) = item["spec"]["podCIDR"].as_str() {
                    let path = node.host("/etc/cni/net.d/10-ccm-e2e.conflist");
                    let text = cni_config(cidr);
                    match std::fs::read_to_string(&path) {
                        Ok(old) if old == text => {}
                        Ok(_) => {
                            // A new podCIDR (the Node registered anew): the bridge plugin
                            // refuses a bridge that still has the old gateway address.
                            let _ = sh(
                                &format!("nsenter --target {} --net ip link del cni0", node.ns_pid),
                                "removing the old pod bridge",
                            );
                            write(&path, &text)?;
                        }
                        Err(_) => write(&path, &text)?,
                    }
                }
                let is_ready = item["status"]["conditions"]
                    .as_array()
                    .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"));
                ready += usize::from(is_ready);
            }
            if ready == self.nodes.len() {
                return self.route_pod_networks(&items);
            }
            if Instant::now() > deadline {
                let logs: Vec<String> =
                    self.nodes.iter().map(|n| format!("{}:\n{}", n.name, tail(&n.kubelet_log(), 15))).collect();
                bail!("{ready} of {} Nodes Ready after {timeout:?}:\n{}", self.nodes.len(), logs.join("\n"));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Routes every node's podCIDR to it from the other nodes and from the edge, as a network
    /// DaemonSet (kindnet) and a cloud's routes would: pods on different nodes reach each
    /// other, and the edge reaches every pod; and masquerades what pods send out of the pod
    /// network.
    fn route_pod_networks(&self, items: &[serde_json::Value]) -> anyhow::Result<()> {
        let cidrs: Vec<(Ipv4Addr, String)> = self
            .nodes
            .iter()
            .filter_map(|n| {
                let item = items.iter().find(|i| i["metadata"]["name"] == n.name.as_str())?;
                Some((n.ip, item["spec"]["podCIDR"].as_str()?.to_string()))
            })
            .collect();
        let namespaces = self.nodes.iter().map(|n| (n.ns_pid, Some(n.ip))).chain([(self.edge.ns_pid, None)]);
        for (pid, own) in namespaces {
            let routes: String = cidrs
                .iter()
                .filter(|(ip, _)| Some(*ip) != own)
                .map(|(ip, cidr)| format!("ip route replace {cidr} via {ip} && "))
                .collect();
            // Pods keep their address towards pods anywhere in the cluster; what leaves the
            // pod network (the API server, the edge) is masqueraded to the node's address.
            let masquerade = if own.is_some() {
                format!(
                    "iptables -t nat -C POSTROUTING -s {CLUSTER_CIDR} ! -d {CLUSTER_CIDR} -j MASQUERADE 2>/dev/null || \
                     iptables -t nat -A POSTROUTING -s {CLUSTER_CIDR} ! -d {CLUSTER_CIDR} -j MASQUERADE"
                )
            } else {
                "true".to_string()
            };
            sh(&format!("nsenter --target {pid} --net sh -c '{routes}{masquerade}'"), "routing the pod networks")?;
        }
        Ok(())
    }

    /// Starts the sim's data plane agent (`ccm-provider-sim dataplane`, see the sim's
    /// `dataplane` module) in the edge, serving at [`DATAPLANE_PORT`] on the edge's bridge
    /// address, and waits until it answers; its endpoint for the sim's `[dataplane]`.
    /// `agent` is the program and the arguments that run the agent (`["dataplane"]` after the
    /// sim's binary, or any binary that runs it the same way).
    pub fn start_dataplane(&self, agent: &Path, agent_args: &[&str]) -> anyhow::Result<String> {
        let endpoint = format!("http://{}:{DATAPLANE_PORT}", self.edge.vpc_ip);
        let mut slot = self.dataplane.lock().map_err(|_| anyhow::anyhow!("data plane lock poisoned"))?;
        if slot.is_some() {
            return Ok(endpoint);
        }
        let mut cmd = Command::new("nsenter");
        cmd.arg("--target")
            .arg(self.edge.ns_pid.to_string())
            .args(["--net", "--"])
            .arg(agent)
            .args(agent_args)
            .args(["--listen", &format!("{}:{DATAPLANE_PORT}", self.edge.vpc_ip)])
            .args(["--masquerade", &format!("10.250.{}.0/24", self.gateway.octets()[2])])
            .args(["--masquerade", CLUSTER_CIDR])
            .args(["--log", "info"]);
        let child = self.spawn_logged(cmd, "dataplane.log")?;
        *slot = Some(child);
        drop(slot);
        self.record_pids()?;
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let probe = Command::new("curl")
                .args(["-sf", "--max-time", "1", &format!("{endpoint}/healthz")])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            if probe.is_ok_and(|s| s.success()) {
                return Ok(endpoint);
            }
            if Instant::now() > deadline {
                bail!("the data plane agent did not answer at {endpoint}: {}", tail(&self.dir.join("dataplane.log"), 15));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The `[dataplane]` table of a sim config for the agent at `endpoint`.
    pub fn dataplane_toml(endpoint: &str) -> String {
        format!("\n[dataplane]\nendpoint = \"{endpoint}\"\nip_mode = \"VIP\"\n")
    }

    /// A sim inventory (TOML) for this cluster: one instance `i-real-<i>` per node, named as
    /// the Node, in zones `sim-region-1a`/`-1b` alternately, of type `sim.medium`, with the
    /// kubelet's own address (the kubelet's provided-node-ip must be among the cloud's); a
    /// route table and a load balancer address pool (the edge's, `10.252.<k>.0/24`); and,
    /// once [`start_dataplane`](Self::start_dataplane) ran, the `[dataplane]` that makes the
    /// load balancers carry traffic.
    pub fn sim_inventory(&self) -> String {
        let mut toml = format!(
            "region = \"sim-region-1\"\ncache_ttl_seconds = 30\n\n[[route_tables]]\nid = \"rt-main\"\nname = \"main\"\nmax_routes = 50\n\n\
             [load_balancers]\naddress_pool = [\"{}\"]\nmax_name_length = 32\n",
            self.edge.pool
        );
        if self.dataplane.lock().is_ok_and(|d| d.is_some()) {
            toml.push_str(&Self::dataplane_toml(&format!("http://{}:{DATAPLANE_PORT}", self.edge.vpc_ip)));
        }
        for (i, node) in self.nodes.iter().enumerate() {
            toml.push_str(&format!(
                "\n[[instances]]\nid = \"i-real-{i}\"\nname = \"{}\"\nzone = \"sim-region-1{}\"\ninstance_type = \"sim.medium\"\n\
                 addresses = [{{ type = \"InternalIP\", address = \"{}\" }}]\n",
                node.name,
                ["a", "b"][i % 2],
                node.ip
            ));
        }
        toml
    }

    /// Helm values that install the chart with the simulated cloud for this cluster: its
    /// [`sim_inventory`](Self::sim_inventory), routes for [`CLUSTER_CIDR`], and the sim's
    /// admin API on each sidecar's node address at `admin_port` (to look inside the cloud).
    pub fn sim_chart_values(&self, admin_port: u16) -> String {
        let inventory: String = self.sim_inventory().lines().map(|l| format!("      {l}\n")).collect();
        format!(
            "sim:\n  enabled: true\n  extraArgs: [--admin-listen=http://0.0.0.0:{admin_port}, --allow-insecure-tcp]\n  config:\n    sim.toml: |\n{inventory}\
             clusterCIDR: {CLUSTER_CIDR}\nconfigureCloudRoutes: true\n"
        )
    }

    /// Labels every Node a control-plane node, as the chart's nodeSelector expects (an
    /// admin's label: a kubelet may not set node-role labels on itself).
    pub fn label_control_plane(&self) -> anyhow::Result<()> {
        for node in &self.nodes {
            run(
                &mut self.kubectl(&["label", "--overwrite", "node", &node.name, "node-role.kubernetes.io/control-plane="]),
                &format!("labelling {}", node.name),
            )?;
        }
        Ok(())
    }

    /// The control plane (API server address, kubeconfigs, CA).
    pub fn control_plane(&self) -> &ControlPlane {
        &self.control_plane
    }

    /// A `kubectl` command with the admin kubeconfig.
    pub fn kubectl(&self, args: &[&str]) -> Command {
        self.control_plane.kubectl(args)
    }

    /// An admin client.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        self.control_plane.client().await
    }

    /// Imports an OCI archive into every node's containerd.
    pub fn import_image(&self, image: &Path) -> anyhow::Result<()> {
        for node in &self.nodes {
            run(
                Command::new("ctr")
                    .arg("--address")
                    .arg(node.containerd_socket())
                    .args(["-n", "k8s.io", "images", "import"])
                    .arg(image),
                &format!("node {}: importing {}", node.name, image.display()),
            )?;
        }
        Ok(())
    }

    /// Stops node `i`'s kubelet (its containers keep running, as on a node whose kubelet
    /// died): the Node goes NotReady once kube-controller-manager's grace period is over.
    /// [`KubeletCluster::restart_kubelet`] starts it again.
    pub fn stop_kubelet(&self, i: usize) -> anyhow::Result<()> {
        let node = self.nodes.get(i).context("no such node")?;
        let mut slot = node.kubelet.lock().map_err(|_| anyhow::anyhow!("kubelet lock poisoned"))?;
        if let Some(mut old) = slot.take() {
            let _ = Command::new("kill").args(["-TERM", &old.id().to_string()]).status();
            old.wait().context("waiting for the kubelet to stop")?;
        }
        drop(slot);
        self.record_pids()
    }

    /// Restarts node `i`'s kubelet (as `systemctl restart kubelet` would), so that it reads
    /// its configuration and drop-ins again.
    pub fn restart_kubelet(&self, i: usize) -> anyhow::Result<()> {
        let node = self.nodes.get(i).context("no such node")?;
        let mut slot = node.kubelet.lock().map_err(|_| anyhow::anyhow!("kubelet lock poisoned"))?;
        if let Some(mut old) = slot.take() {
            let _ = Command::new("kill").args(["-TERM", &old.id().to_string()]).status();
            let _ = old.wait();
        }
        let log = std::fs::OpenOptions::new().append(true).create(true).open(node.kubelet_log())?;
        let kubelet = in_node(&node.cgroups, node.ns_pid, &self.kubelet_bin, &node.kubelet_args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("restarting the kubelet")?;
        *slot = Some(kubelet);
        drop(slot);
        self.record_pids()
    }

    /// Gives an imported image another name on every node (`ctr images tag`), as a registry
    /// would serve a new tag of the same build.
    pub fn tag_image(&self, from: &str, to: &str) -> anyhow::Result<()> {
        for node in &self.nodes {
            run(
                Command::new("ctr")
                    .arg("--address")
                    .arg(node.containerd_socket())
                    .args(["-n", "k8s.io", "images", "tag", "--force", from, to]),
                &format!("node {}: tagging {from} as {to}", node.name),
            )?;
        }
        Ok(())
    }

    /// The cluster's id: in its directory (`/var/tmp/ccm-e2e-cluster-<id>`), its bridge
    /// (`ccm<id>`) and its cgroups (`ccm-e2e-<id>-n<i>`).
    pub fn id(&self) -> String {
        self.dir.file_name().and_then(|n| n.to_str()).unwrap_or_default().trim_start_matches("ccm-e2e-cluster-").to_string()
    }

    /// Stops everything and removes what the cluster made (also done on drop).
    pub fn stop(&mut self) {
        if self.torn_down {
            return;
        }
        self.torn_down = true;
        let _ = self.record_pids();
        let _ = Command::new("sh").arg(&self.teardown).status();
        for child in self.daemons.iter_mut() {
            let _ = child.wait();
        }
        for node in self.nodes.iter_mut() {
            for child in [&mut node.holder, &mut node.containerd, &mut node.proxy] {
                let _ = child.wait();
            }
            if let Ok(mut kubelet) = node.kubelet.lock()
                && let Some(child) = kubelet.as_mut()
            {
                let _ = child.wait();
            }
        }
        for child in [self.edge_holder.as_mut(), self.dataplane.get_mut().ok().and_then(Option::as_mut)].into_iter().flatten() {
            let _ = child.wait();
        }
        self.control_plane.stop();
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
    }
}

impl Drop for KubeletCluster {
    fn drop(&mut self) {
        self.stop();
    }
}

static SHARED: OnceLock<Result<KubeletCluster, String>> = OnceLock::new();

/// The kubelet cluster shared by the tests of this process (two nodes, `kc-0` and `kc-1`),
/// started on first use with the image archives `images` builds imported; later callers'
/// images are imported into it. The machine is checked first, for the cluster and for the
/// image build ([`images::check_machine`]), before anything is built: `Ok(None)` when it
/// cannot (the reason printed in one `skipped:` line), unless
/// `CCM_E2E_REQUIRE_KUBELET_CLUSTER` is set (CI), where that is an error.
pub fn shared(images: impl FnOnce() -> anyhow::Result<Vec<PathBuf>>) -> anyhow::Result<Option<&'static KubeletCluster>> {
    if let Err(why) = check_machine().and_then(|()| images::check_machine()) {
        if std::env::var_os(REQUIRE).is_some() {
            bail!("{REQUIRE} is set: {why}");
        }
        eprintln!("skipped: {why}");
        return Ok(None);
    }
    let images = images()?;
    let mut first = false;
    let cluster = SHARED
        .get_or_init(|| {
            first = true;
            KubeletCluster::start(2, "kc", &images).map_err(|e| format!("{e:#}"))
        })
        .as_ref()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    if !first {
        for image in &images {
            cluster.import_image(image)?;
        }
    }
    Ok(Some(cluster))
}
