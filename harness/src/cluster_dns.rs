//! The kubelet cluster's DNS: CoreDNS as `kube-dns` at [`CLUSTER_DNS`], the address every
//! kubelet of [`crate::kubelet_cluster`] writes into its pods' `resolv.conf`, installed on demand
//! ([`install`]). Kubernetes' own e2e tests reach Services by name from pods; nothing else in the
//! harness needs a DNS, and the charts under test must not.
//!
//! The server is CoreDNS built from its Go module by `envtest/setup.sh coredns` with only the
//! plugins a cluster DNS needs (`harness/coredns/main.go`: kubernetes, errors, log, health,
//! ready, cache, loop, loadbalance), static, packed by `deploy/images/build.py` as
//! [`IMAGE`] ([`image`]) and imported into every node's containerd: no registry. Its
//! Corefile ([`COREFILE`]) has no `forward`: there is no upstream DNS, so names outside the
//! cluster's zones get SERVFAIL (and `loop`'s start-up probe logs one `no next plugin found`
//! error, which is expected).
//!
//! It runs as upstream's image does, as user 65532 with every capability dropped; the pod's
//! `net.ipv4.ip_unprivileged_port_start=53` (a safe sysctl, namespaced per pod) lets it bind
//! port 53.

use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, bail};

use crate::assets::Assets;
use crate::control_plane::SERVICE_CLUSTER_IP_RANGE;
use crate::kubelet_cluster::CLUSTER_DNS;
use crate::kubelet_cluster::KubeletCluster;
use crate::machine::{self, Unavailable};

/// The CoreDNS release `harness/coredns/go.mod` pins (the one kubeadm of the pinned Kubernetes
/// release deploys); [`image`] checks that they agree.
pub const VERSION: &str = "v1.14.6";
/// The image the Deployment runs: upstream's name and tag, built here.
pub const IMAGE: &str = "registry.k8s.io/coredns/coredns:v1.14.6";
/// The cluster domain every kubelet of the cluster is configured with (`clusterDomain`).
pub const CLUSTER_DOMAIN: &str = "cluster.local";
/// The namespace of everything [`install`] creates.
pub const NAMESPACE: &str = "kube-system";
/// How long [`install`] waits for the Deployment to become Ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(180);

/// The Corefile: the kubernetes plugin for the cluster domain and the reverse zones, no
/// upstream. `health` serves :8080/health, `ready` :8181/ready (once the kubernetes plugin has
/// synced its informers).
pub const COREFILE: &str = "\
.:53 {
    errors
    health
    ready
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 30
    loop
    loadbalance
}
";

/// Checks what building the image needs from the machine (Go for CoreDNS, python3 for
/// `build.py`), before any build starts.
pub fn check_machine() -> Result<(), Unavailable> {
    machine::require("building the cluster DNS image", &[("go", "go.dev/dl"), ("python3", "Debian: python3")])
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();

/// Builds (once per process) the OCI archive of [`IMAGE`] into `target/ccm-images/`: the static
/// CoreDNS of `envtest/setup.sh coredns` (minutes on a cold Go cache, then cached) as the
/// entrypoint `/coredns`. `build.py` writes the archive under a name of its own and renames it
/// into place, so two processes building at once do not meet. Its path.
pub fn image() -> anyhow::Result<PathBuf> {
    BUILT.get_or_init(|| build().map_err(|e| format!("{e:#}"))).clone().map_err(|e| anyhow::anyhow!("{e}"))
}

fn build() -> anyhow::Result<PathBuf> {
    check_machine()?;
    let go_mod = repo().join("harness/coredns/go.mod");
    let text = std::fs::read_to_string(&go_mod).with_context(|| format!("reading {}", go_mod.display()))?;
    match pinned_version(&text) {
        Some(v) if v == VERSION => {}
        Some(v) => bail!("{} pins CoreDNS {v}, cluster_dns::VERSION is {VERSION}: update both together", go_mod.display()),
        None => bail!("{} does not require github.com/coredns/coredns", go_mod.display()),
    }
    let coredns = Assets::tool("coredns")?;
    let out = repo().join("target/ccm-images").join(format!("coredns-{VERSION}.tar"));
    let status = Command::new("python3")
        .arg(repo().join("deploy/images/build.py"))
        .arg("--file")
        .arg(format!("{}:/coredns", coredns.display()))
        .args(["--entrypoint", "/coredns", "--tag", IMAGE, "--out"])
        .arg(&out)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .status()
        .with_context(|| format!("running build.py for {IMAGE}"))?;
    if !status.success() {
        bail!("building {IMAGE} failed (its output is above)");
    }
    Ok(out)
}

/// The version of `github.com/coredns/coredns` a go.mod requires.
fn pinned_version(go_mod: &str) -> Option<&str> {
    go_mod.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        let mut first = words.next()?;
        if first == "require" {
            first = words.next()?;
        }
        (first == "github.com/coredns/coredns").then(|| words.next()).flatten()
    })
}

/// Whether `ip` lies in the IPv4 network `cidr` (`10.96.0.0/16`).
fn cidr_contains(cidr: &str, ip: Ipv4Addr) -> anyhow::Result<bool> {
    let (net, len) = cidr.split_once('/').with_context(|| format!("{cidr}: expected ADDRESS/LENGTH"))?;
    let net: Ipv4Addr = net.parse().with_context(|| format!("{cidr}: not an IPv4 network"))?;
    let len: u32 = len.parse().with_context(|| format!("{cidr}: bad prefix length"))?;
    if len > 32 {
        bail!("{cidr}: prefix length over 32");
    }
    let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
    Ok(u32::from(net) & mask == u32::from(ip) & mask)
}

/// The objects [`install`] applies, in [`NAMESPACE`], running `image`: ServiceAccount, ClusterRole
/// and ClusterRoleBinding `system:coredns` (list and watch what the kubernetes plugin reads),
/// ConfigMap `coredns` ([`COREFILE`]), Deployment `coredns` (one replica, `imagePullPolicy:
/// Never`, ready on :8181/ready) and Service `kube-dns` at [`CLUSTER_DNS`] (53/UDP, 53/TCP),
/// labelled `k8s-app: kube-dns` as upstream's are.
pub fn manifests(image: &str) -> String {
    let corefile: String = COREFILE.lines().map(|l| format!("    {l}\n")).collect();
    format!(
        r#"apiVersion: v1
kind: ServiceAccount
metadata:
  name: coredns
  namespace: {NAMESPACE}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: system:coredns
  labels:
    kubernetes.io/bootstrapping: rbac-defaults
rules:
- apiGroups: [""]
  resources: [endpoints, services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: system:coredns
  labels:
    kubernetes.io/bootstrapping: rbac-defaults
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: system:coredns
subjects:
- kind: ServiceAccount
  name: coredns
  namespace: {NAMESPACE}
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: coredns
  namespace: {NAMESPACE}
data:
  Corefile: |
{corefile}---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: coredns
  namespace: {NAMESPACE}
  labels:
    k8s-app: kube-dns
spec:
  replicas: 1
  selector:
    matchLabels:
      k8s-app: kube-dns
  template:
    metadata:
      labels:
        k8s-app: kube-dns
    spec:
      serviceAccountName: coredns
      priorityClassName: system-cluster-critical
      dnsPolicy: Default
      tolerations:
      - key: CriticalAddonsOnly
        operator: Exists
      - key: node-role.kubernetes.io/control-plane
        effect: NoSchedule
      - key: node.cloudprovider.kubernetes.io/uninitialized
        operator: Exists
        effect: NoSchedule
      securityContext:
        runAsNonRoot: true
        runAsUser: 65532
        runAsGroup: 65532
        sysctls:
        - name: net.ipv4.ip_unprivileged_port_start
          value: "53"
      containers:
      - name: coredns
        image: {image}
        imagePullPolicy: Never
        args: ["-conf", "/etc/coredns/Corefile"]
        ports:
        - {{name: dns, containerPort: 53, protocol: UDP}}
        - {{name: dns-tcp, containerPort: 53, protocol: TCP}}
        readinessProbe:
          httpGet: {{path: /ready, port: 8181}}
          periodSeconds: 2
        livenessProbe:
          httpGet: {{path: /health, port: 8080}}
          initialDelaySeconds: 10
          periodSeconds: 10
          failureThreshold: 5
        resources:
          requests: {{cpu: 10m, memory: 32Mi}}
          limits: {{memory: 170Mi}}
        securityContext:
          allowPrivilegeEscalation: false
          readOnlyRootFilesystem: true
          capabilities:
            drop: [ALL]
        volumeMounts:
        - name: config
          mountPath: /etc/coredns
          readOnly: true
      volumes:
      - name: config
        configMap:
          name: coredns
---
apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: {NAMESPACE}
  labels:
    k8s-app: kube-dns
    kubernetes.io/name: CoreDNS
spec:
  selector:
    k8s-app: kube-dns
  clusterIP: {CLUSTER_DNS}
  ports:
  - {{name: dns, port: 53, targetPort: 53, protocol: UDP}}
  - {{name: dns-tcp, port: 53, targetPort: 53, protocol: TCP}}
"#
    )
}

/// Installs the cluster DNS into `cluster`: builds [`image`] (once per process), imports it into
/// every node, applies [`manifests`] and waits until the Deployment is Ready (at most
/// [`READY_TIMEOUT`]). Applying again is harmless, so a second call (another test of the same
/// process) only re-imports and re-checks. Fails at once if [`CLUSTER_DNS`] is outside the API
/// server's service range.
pub fn install(cluster: &KubeletCluster) -> anyhow::Result<()> {
    let dns: Ipv4Addr = CLUSTER_DNS.parse().with_context(|| format!("CLUSTER_DNS {CLUSTER_DNS}"))?;
    if !cidr_contains(SERVICE_CLUSTER_IP_RANGE, dns)? {
        bail!("the cluster DNS {CLUSTER_DNS} is outside the service range {SERVICE_CLUSTER_IP_RANGE}");
    }
    let archive = image()?;
    cluster.import_image(&archive).context("importing the cluster DNS image")?;
    apply(cluster.kubectl(&["apply", "-f", "-"]), &manifests(IMAGE)).context("applying the cluster DNS")?;
    let timeout = format!("--timeout={}s", READY_TIMEOUT.as_secs());
    let out = cluster
        .kubectl(&["-n", NAMESPACE, "rollout", "status", "deployment/coredns", &timeout])
        .stdin(Stdio::null())
        .output()
        .context("running kubectl rollout status deployment/coredns")?;
    if !out.status.success() {
        bail!(
            "the cluster DNS did not become Ready in {}s: {}\n{}",
            READY_TIMEOUT.as_secs(),
            String::from_utf8_lossy(&out.stderr).trim(),
            diagnose(cluster)
        );
    }
    Ok(())
}

/// Runs `kubectl apply -f -` with `yaml` on its stdin.
fn apply(mut kubectl: Command, yaml: &str) -> anyhow::Result<()> {
    let mut child =
        kubectl.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().context("starting kubectl apply")?;
    child.stdin.take().context("kubectl's stdin")?.write_all(yaml.as_bytes()).context("writing to kubectl apply")?;
    let out = child.wait_with_output().context("waiting for kubectl apply")?;
    if !out.status.success() {
        bail!("kubectl apply failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// The DNS pods, their events and their log, for an error message.
fn diagnose(cluster: &KubeletCluster) -> String {
    let run = |args: &[&str]| {
        cluster.kubectl(args).stdin(Stdio::null()).output().map_or_else(
            |e| format!("kubectl {}: {e}", args.join(" ")),
            |o| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)),
        )
    };
    let selector = "--selector=k8s-app=kube-dns";
    [
        run(&["-n", NAMESPACE, "get", "pods", selector, "-o", "wide"]),
        run(&["-n", NAMESPACE, "get", "events", "--field-selector=involvedObject.kind=Pod", "--sort-by=.lastTimestamp"]),
        run(&["-n", NAMESPACE, "logs", selector, "--tail=30", "--all-containers"]),
    ]
    .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_is_the_one_go_mod_pins() {
        let go_mod = include_str!("../coredns/go.mod");
        assert_eq!(pinned_version(go_mod), Some(VERSION));
        assert_eq!(IMAGE.rsplit_once(':').map(|(_, tag)| tag), Some(VERSION));
        assert_eq!(pinned_version("require (\n\tgithub.com/coredns/coredns v1.2.3\n)\n"), Some("v1.2.3"));
        assert_eq!(pinned_version("module x\n\ngo 1.25.0\n"), None);
    }

    #[test]
    fn the_cluster_dns_is_in_the_service_range() {
        let dns: Ipv4Addr = CLUSTER_DNS.parse().expect("an IPv4 address");
        assert!(cidr_contains(SERVICE_CLUSTER_IP_RANGE, dns).expect("parses"));
        assert!(!cidr_contains("10.96.0.0/16", Ipv4Addr::new(10, 97, 0, 10)).expect("parses"));
        assert!(cidr_contains("0.0.0.0/0", Ipv4Addr::new(192, 0, 2, 1)).expect("parses"));
        assert!(cidr_contains("10.96.0.10/40", dns).is_err());
    }

    #[test]
    fn the_manifests_name_the_image_the_address_and_the_corefile() {
        let yaml = manifests(IMAGE);
        assert!(yaml.contains(&format!("image: {IMAGE}\n")), "{yaml}");
        assert!(yaml.contains(&format!("clusterIP: {CLUSTER_DNS}\n")), "{yaml}");
        assert!(yaml.contains(&format!("    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{\n")), "{yaml}");
        assert!(!COREFILE.contains("forward"));
        assert_eq!(yaml.matches("\n---\n").count(), 5, "six objects");
        // The Corefile block scalar ends before the next document.
        assert!(yaml.contains("    }\n---\napiVersion: apps/v1\n"), "{yaml}");
    }
}
