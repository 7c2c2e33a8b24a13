//! The sidecar line as a security boundary, tried as an attacker would: a user who may edit
//! Services in one namespace reaches nothing outside it (issue 54).

use std::time::Duration;

use ccm_harness::ControlPlane;
use ccm_harness::cluster::{NodeBuilder, TestEnv};
use k8s_openapi::api::core::v1::{Event, Service};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};

use crate::support::{Core, TEST_LABEL, eventually, one_node_cloud};

const NAME_ANNOTATION: &str = "ccm-rs.dev/load-balancer-name";

/// A LoadBalancer Service of `class`, with `annotations`.
fn service(env: &TestEnv, name: &str, class: &str, annotations: serde_json::Value) -> Service {
    serde_json::from_value(serde_json::json!({
        "metadata": { "name": name, "namespace": env.namespace, "annotations": annotations },
        "spec": {
            "type": "LoadBalancer",
            "loadBalancerClass": class,
            "ports": [{ "name": "http", "port": 80, "protocol": "TCP" }],
            "selector": { "app": name },
        },
    }))
    .expect("service")
}

async fn ingress_ip(env: &TestEnv, name: &str) -> Option<String> {
    let svc = env.services().get(name).await.ok()?;
    svc.status?.load_balancer?.ingress?.first()?.ip.clone()
}

fn recorded_name(svc: &Service) -> Option<String> {
    svc.metadata.annotations.as_ref()?.get(NAME_ANNOTATION).cloned()
}

async fn warned(env: &TestEnv, name: &str, reason: &str) -> Event {
    eventually(&format!("a {reason} Warning on {name}"), Duration::from_secs(20), async || {
        let events: Api<Event> = Api::namespaced(env.client.clone(), &env.namespace);
        let list = events.list(&ListParams::default().fields(&format!("involvedObject.name={name}"))).await.ok()?;
        list.items.into_iter().find(|e| e.reason.as_deref() == Some(reason) && e.type_.as_deref() == Some("Warning"))
    })
    .await
}

/// The core serving every namespace, kept to this test's Services by a class of its own.
fn cluster_wide_core(cp: &ControlPlane, env: &TestEnv, endpoint: &str, class: &str) -> Core {
    let class_flag = format!("--load-balancer-class={class}");
    let flags = ["--leader-elect=false", "--controllers=service", "--ignore-unclassed-services", class_flag.as_str()];
    Core::start_cluster_wide(cp, env, endpoint, &flags)
}

/// The victim's Service in one namespace gets its load balancer; a Service in another
/// namespace recording the victim's load balancer name as its own gets a load balancer of
/// its own (and a Warning), never the victim's address, and deleting it leaves the victim's
/// load balancer in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_naming_another_namespaces_load_balancer_gets_neither_its_address_nor_its_deletion() {
    let cp = ccm_harness::shared().expect("control plane");
    let client = cp.client().await.expect("client");
    let victim = TestEnv::new(client.clone(), "victim").await.expect("env");
    let intruder = TestEnv::new(client, "intruder").await.expect("env");
    let sim = one_node_cloud(&victim).await;
    let class = format!("e2e.ccm-rs.dev/{}", victim.prefix);
    let core = cluster_wide_core(cp, &victim, &sim.endpoint, &class);

    victim.services().create(&PostParams::default(), &service(&victim, "web", &class, serde_json::json!({}))).await.expect("svc");
    let victim_ip = eventually("the victim's address", Duration::from_secs(20), async || ingress_ip(&victim, "web").await).await;
    let victim_name = eventually("the victim's recorded name", Duration::from_secs(10), async || {
        recorded_name(&victim.services().get("web").await.ok()?)
    })
    .await;

    // The intruder writes the victim's name on a Service of their own namespace.
    let stolen = serde_json::json!({ NAME_ANNOTATION: victim_name });
    intruder.services().create(&PostParams::default(), &service(&intruder, "web", &class, stolen)).await.expect("svc");
    let intruder_ip =
        eventually("the intruder's own address", Duration::from_secs(20), async || ingress_ip(&intruder, "web").await).await;
    assert_ne!(intruder_ip, victim_ip, "the intruder got the victim's address");
    warned(&intruder, "web", "LoadBalancerNameRefused").await;
    let own = eventually("the intruder's annotation set to its own name", Duration::from_secs(10), async || {
        recorded_name(&intruder.services().get("web").await.ok()?).filter(|n| *n != victim_name)
    })
    .await;
    let lbs = sim.admin.state().await.expect("state").load_balancers;
    let victims = lbs.iter().find(|l| l.name == victim_name).expect("the victim's load balancer");
    assert_eq!(victims.service, format!("{}/web", victim.namespace), "the victim's load balancer names its own Service");
    assert_eq!(victims.ip, victim_ip);
    assert!(lbs.iter().any(|l| l.name == own && l.service == format!("{}/web", intruder.namespace)), "{lbs:?}");

    // Deleting the intruder deletes its own load balancer, not the victim's.
    intruder.services().delete("web", &DeleteParams::default()).await.expect("delete");
    eventually("the intruder's Service gone", Duration::from_secs(20), async || {
        intruder.services().get_opt("web").await.ok()?.is_none().then_some(())
    })
    .await;
    let lbs = sim.admin.state().await.expect("state").load_balancers;
    assert!(!lbs.iter().any(|l| l.name == own), "the intruder's own load balancer is deleted: {lbs:?}");
    let victims = lbs.iter().find(|l| l.name == victim_name).expect("the victim's load balancer is still there");
    assert_eq!(victims.ip, victim_ip);
    assert_eq!(ingress_ip(&victim, "web").await.as_deref(), Some(victim_ip.as_str()));

    victim.services().delete("web", &DeleteParams::default()).await.expect("delete");
    eventually("the victim's Service gone", Duration::from_secs(20), async || {
        victim.services().get_opt("web").await.ok()?.is_none().then_some(())
    })
    .await;
    core.stop().await.expect("stop");
    victim.cleanup().await.expect("cleanup");
    intruder.cleanup().await.expect("cleanup");
}

/// A Service author who rewrites their own Service's recorded name, each time to a name of the
/// Service's own form (any prefix, the hash of its UID), gets no second load balancer: the
/// name is refused with a Warning and written back, the one load balancer stays, and deleting
/// the Service leaves none behind. (Accepted before: each rewrite made a new load balancer
/// and the old ones were never deleted.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewriting_a_services_own_recorded_name_makes_no_second_load_balancer() {
    let cp = ccm_harness::shared().expect("control plane");
    let client = cp.client().await.expect("client");
    let env = TestEnv::new(client, "rename").await.expect("env");
    let sim = one_node_cloud(&env).await;
    let class = format!("e2e.ccm-rs.dev/{}", env.prefix);
    let core = cluster_wide_core(cp, &env, &sim.endpoint, &class);

    env.services().create(&PostParams::default(), &service(&env, "web", &class, serde_json::json!({}))).await.expect("svc");
    let ip = eventually("the address", Duration::from_secs(20), async || ingress_ip(&env, "web").await).await;
    let svc = env.services().get("web").await.expect("svc");
    let own = recorded_name(&svc).expect("the recorded name");
    let uid = svc.metadata.uid.clone().expect("uid");
    // The Service's own form: any prefix, then the hash of its UID.
    let readable = ccm_protocol::names::load_balancer_name("c", "n", "s", &uid, &Default::default());
    let hash = readable.rsplit('-').next().expect("hash").to_string();
    let ours = |lbs: &[ccm_provider_sim::admin::LoadBalancerView]| {
        lbs.iter().filter(|l| l.service == format!("{}/web", env.namespace)).map(|l| l.name.clone()).collect::<Vec<_>>()
    };
    for (i, prefix) in ["mine", "another"].iter().enumerate() {
        let forged = format!("{prefix}-{hash}");
        assert!(ccm_protocol::names::is_load_balancer_name_of(&forged, &uid), "{forged} is of the Service's own form");
        let patch = serde_json::json!({ "metadata": { "annotations": { NAME_ANNOTATION: forged } } });
        env.services().patch("web", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch)).await.expect("patch");
        if i == 0 {
            warned(&env, "web", "LoadBalancerNameRefused").await;
        }
        eventually("the recorded name written back", Duration::from_secs(20), async || {
            (recorded_name(&env.services().get("web").await.ok()?).as_deref() == Some(own.as_str())).then_some(())
        })
        .await;
        // A resync or two (--load-balancer-resync-period is the default's) would have made it.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let lbs = sim.admin.state().await.expect("state").load_balancers;
        assert_eq!(ours(&lbs), vec![own.clone()], "one load balancer, under the Service's own name");
    }
    assert_eq!(ingress_ip(&env, "web").await.as_deref(), Some(ip.as_str()), "the address kept");

    env.services().delete("web", &DeleteParams::default()).await.expect("delete");
    eventually("the Service gone", Duration::from_secs(20), async || {
        env.services().get_opt("web").await.ok()?.is_none().then_some(())
    })
    .await;
    let lbs = sim.admin.state().await.expect("state").load_balancers;
    assert!(ours(&lbs).is_empty(), "no load balancer left behind: {lbs:?}");
    core.stop().await.expect("stop");
    env.cleanup().await.expect("cleanup");
}

/// The same attack against a Go provider behind the adapter (upstream's fake cloud): the core
/// refuses the recorded name the same way, and the Go provider names load balancers from the
/// Service it is given, so the victim's load balancer survives the intruder's deletion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_the_go_adapter_a_recorded_name_steers_nothing_either() {
    use ccm_proto::v1 as pb;
    let cp = ccm_harness::shared().expect("control plane");
    let client = cp.client().await.expect("client");
    let victim = TestEnv::new(client.clone(), "gvictim").await.expect("env");
    let intruder = TestEnv::new(client, "gintruder").await.expect("env");
    let node = victim.node_name("n1");
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(sidecar) = crate::go_adapter::fake_cloud(dir.path(), std::slice::from_ref(&node)).await else {
        victim.cleanup().await.expect("cleanup");
        intruder.cleanup().await.expect("cleanup");
        return;
    };
    NodeBuilder::new(&node)
        .label(TEST_LABEL, &victim.prefix)
        .provider_id(&format!("fake://{node}"))
        .address("InternalIP", "10.0.0.1")
        .create(&victim.client)
        .await
        .expect("node");
    let class = format!("e2e.ccm-rs.dev/{}", victim.prefix);
    let core = cluster_wide_core(cp, &victim, &sidecar.endpoint, &class);

    victim.services().create(&PostParams::default(), &service(&victim, "web", &class, serde_json::json!({}))).await.expect("svc");
    eventually("the victim's address", Duration::from_secs(30), async || ingress_ip(&victim, "web").await).await;
    let victim_svc = victim.services().get("web").await.expect("svc");
    let victim_name = recorded_name(&victim_svc).expect("the victim's recorded name");
    let stolen = serde_json::json!({ NAME_ANNOTATION: victim_name });
    intruder.services().create(&PostParams::default(), &service(&intruder, "web", &class, stolen)).await.expect("svc");
    eventually("the intruder's own address", Duration::from_secs(30), async || ingress_ip(&intruder, "web").await).await;
    warned(&intruder, "web", "LoadBalancerNameRefused").await;
    eventually("the intruder's annotation set to its own name", Duration::from_secs(10), async || {
        recorded_name(&intruder.services().get("web").await.ok()?).filter(|n| *n != victim_name)
    })
    .await;
    intruder.services().delete("web", &DeleteParams::default()).await.expect("delete");
    eventually("the intruder's Service gone", Duration::from_secs(30), async || {
        intruder.services().get_opt("web").await.ok()?.is_none().then_some(())
    })
    .await;

    // The victim's load balancer, asked for as the core asks for it, still exists.
    let channel = ccm_provider_sdk::client::connect_lazy(&sidecar.endpoint).expect("channel");
    let mut lbs = pb::load_balancers_service_client::LoadBalancersServiceClient::new(channel);
    let service = pb::LoadBalancerService {
        cluster_name: "kubernetes".into(),
        namespace: victim.namespace.clone(),
        name: "web".into(),
        uid: victim_svc.metadata.uid.clone().expect("uid"),
        load_balancer_name: victim_name,
        load_balancer_class: class.clone(),
        ..Default::default()
    };
    let got = lbs.get_load_balancer(pb::GetLoadBalancerRequest { service: Some(service) }).await.expect("GetLoadBalancer");
    assert!(got.into_inner().exists, "the victim's load balancer was deleted with the intruder's Service");

    victim.services().delete("web", &DeleteParams::default()).await.expect("delete");
    eventually("the victim's Service gone", Duration::from_secs(30), async || {
        victim.services().get_opt("web").await.ok()?.is_none().then_some(())
    })
    .await;
    core.stop().await.expect("stop");
    victim.cleanup().await.expect("cleanup");
    intruder.cleanup().await.expect("cleanup");
}
