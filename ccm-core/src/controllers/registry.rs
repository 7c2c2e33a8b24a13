//! Every controller of the core, in one table: its names, the ServiceAccounts it acts as, its
//! work queue's name in upstream's metrics, the component its Events carry, and how it starts. `--controllers`, leader
//! migration, `--use-service-account-credentials`, the metrics and the runtime all read this
//! table; adding a controller is its module and one row here.

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use super::{ConfigError, Context, ipam, node, node_lifecycle, owners, route, service, tagging};

/// Starts a controller on its context: the future runs it until the token is cancelled.
/// Flags that do not fit together fail it before anything runs.
pub type Start = fn(Context, CancellationToken) -> Result<BoxFuture<'static, ()>, ConfigError>;

/// One controller.
#[derive(Clone, Copy)]
pub struct Controller {
    /// Its name: in `--controllers`, Events, logs, metrics and leader migration.
    pub name: &'static str,
    /// The shorter name upstream's `--controllers` also accepts (`service`, `route` …).
    pub alias: &'static str,
    /// The name kube-controller-manager gave it, when another (`route-controller`), as leader
    /// migration configurations spell it.
    pub legacy: Option<&'static str>,
    /// The ServiceAccount it acts as with `--service-account-names=upstream` (upstream's).
    pub upstream_account: &'static str,
    /// The ServiceAccount it acts as with `--service-account-names=controller`.
    pub own_account: &'static str,
    /// Its work queue's name in the `workqueue_*` metrics: the name upstream's controller
    /// gives its queue (`k8s.io/cloud-provider` v0.37), so that dashboards and alerts select
    /// ours; the lifecycle controller, which upstream runs without a queue, keeps its own.
    pub queue: &'static str,
    /// The component its Events are reported as (`reportingController`, which
    /// `kubectl get events --field-selector source=…` matches): upstream's controller's.
    pub component: &'static str,
    /// Whether `*` in `--controllers` runs it without a flag of its own to say so
    /// (node IPAM runs only with `--allocate-node-cidrs`, as upstream's).
    pub starts: fn(&crate::options::Options) -> bool,
    /// How it starts.
    pub start: Start,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller").field("name", &self.name).finish_non_exhaustive()
    }
}

/// The controllers, in the order they start.
pub const CONTROLLERS: &[Controller] = &[
    Controller {
        name: node::NAME,
        alias: "cloud-node",
        legacy: None,
        upstream_account: "node-controller",
        own_account: node::NAME,
        queue: "Nodes",
        component: "cloud-node-controller",
        starts: always,
        start: |ctx, stop| {
            let resolver = ctx.providers.several().then(|| owners::OwnerResolver::new(ctx.clone()).run(stop.clone()));
            let mut runs = per_provider(&ctx, |ctx| Ok(Box::pin(node::NodeController::new(ctx).run(stop.clone()))))?;
            runs.extend(resolver.map(|r| Box::pin(r) as BoxFuture<'static, ()>));
            Ok(together(runs, stop))
        },
    },
    Controller {
        name: node_lifecycle::NAME,
        alias: "cloud-node-lifecycle",
        legacy: None,
        upstream_account: "node-controller",
        own_account: node_lifecycle::NAME,
        queue: node_lifecycle::NAME,
        component: "cloud-node-lifecycle-controller",
        starts: always,
        start: |ctx, stop| {
            let runs =
                per_provider(&ctx, |ctx| Ok(Box::pin(node_lifecycle::NodeLifecycleController::new(ctx).run(stop.clone()))))?;
            Ok(together(runs, stop))
        },
    },
    Controller {
        name: service::NAME,
        alias: "service",
        legacy: Some("service-controller"),
        upstream_account: "service-controller",
        own_account: service::NAME,
        queue: "service",
        component: "service-controller",
        starts: always,
        start: |ctx, stop| {
            let runs = per_provider(&ctx, |ctx| Ok(Box::pin(service::ServiceController::new(ctx).run(stop.clone()))))?;
            Ok(together(runs, stop))
        },
    },
    Controller {
        name: route::NAME,
        alias: "route",
        legacy: Some("route-controller"),
        upstream_account: "route-controller",
        own_account: "route-controller",
        queue: "Routes",
        component: "route_controller",
        starts: always,
        start: |ctx, stop| {
            // One provider may program every Node's routes (`--routes-provider`); else each
            // provider its own Nodes'.
            let runs = match ctx.providers.routes_provider() {
                Some(i) => vec![Box::pin(route::RouteController::new(ctx.for_provider(i).over_all_nodes())?.run(stop.clone()))
                    as BoxFuture<'static, ()>],
                None => per_provider(&ctx, |ctx| Ok(Box::pin(route::RouteController::new(ctx)?.run(stop.clone()))))?,
            };
            Ok(together(runs, stop))
        },
    },
    Controller {
        name: ipam::NAME,
        alias: "nodeipam",
        legacy: None,
        // Upstream's nodeipam controller is built with node-controller's client.
        upstream_account: "node-controller",
        own_account: ipam::NAME,
        // kube-controller-manager's range allocator (k8s.io/kubernetes pkg/controller/nodeipam).
        queue: "cidrallocator_node",
        component: "cidrAllocator",
        starts: crate::options::Options::allocate_node_cidrs,
        start: |ctx, stop| {
            // From the cloud, each provider gives its own Nodes theirs; a range is one for all.
            if ctx.options.cloud_allocator() {
                let runs = per_provider(&ctx, |ctx| Ok(Box::pin(ipam::IpamController::new(ctx)?.run(stop.clone()))))?;
                return Ok(together(runs, stop));
            }
            Ok(Box::pin(ipam::IpamController::new(ctx)?.run(stop)))
        },
    },
    Controller {
        name: tagging::NAME,
        // AWS's chart names it so (`--controllers=*,tagging`).
        alias: "tagging",
        legacy: None,
        // It writes only Nodes' annotations (its record): node-controller's rights.
        upstream_account: "node-controller",
        own_account: tagging::NAME,
        // k8s.io/cloud-provider-aws's tagging controller's queue.
        queue: "Tagging",
        component: "tagging-controller",
        // Opt-in: `*` runs it only with tags to write.
        starts: crate::options::Options::tags_instances,
        start: |ctx, stop| {
            let runs = per_provider(&ctx, |ctx| Ok(Box::pin(tagging::TaggingController::new(ctx)?.run(stop.clone()))))?;
            Ok(together(runs, stop))
        },
    },
];

/// Controllers of clouds' own cloud-controller-managers that their charts name in
/// `--controllers`, which this core does not have: accepted there, with a log line saying
/// where such a controller runs. (AWS's `tagging` is the core's tagging controller.)
pub const PROVIDER_CONTROLLERS: &[(&str, &str)] = &[];

/// What a provider's own controller named in `--controllers` is, if `name` is one.
pub fn provider_controller(name: &str) -> Option<&'static str> {
    PROVIDER_CONTROLLERS.iter().find(|(n, _)| *n == name).map(|(_, what)| *what)
}

/// One run of a controller per provider, each on its provider's context: its own queue,
/// workers and calls, so that one provider's trouble never holds another's work.
fn per_provider(
    ctx: &Context,
    start: impl Fn(Context) -> Result<BoxFuture<'static, ()>, ConfigError>,
) -> Result<Vec<BoxFuture<'static, ()>>, ConfigError> {
    (0..ctx.providers.all().len()).map(|i| start(ctx.for_provider(i))).collect()
}

/// The runs of one controller as one: it ends when one of them ends (a run that ends before
/// the stop is the controller's failure; a panic goes on as the controller's), and, once
/// stopped, when all of them have finished what they had in hand.
fn together(runs: Vec<BoxFuture<'static, ()>>, stop: CancellationToken) -> BoxFuture<'static, ()> {
    Box::pin(async move {
        if runs.is_empty() {
            return stop.cancelled().await;
        }
        let (_, _, rest) = futures::future::select_all(runs).await;
        if stop.is_cancelled() {
            futures::future::join_all(rest).await;
        }
    })
}

fn always(_: &crate::options::Options) -> bool {
    true
}

/// The controller of any of its spellings: its name, its alias, or its legacy name.
pub fn find(name: &str) -> Option<&'static Controller> {
    CONTROLLERS.iter().find(|c| c.name == name || c.alias == name || c.legacy == Some(name))
}

/// The controller named `name` (its name proper).
pub fn named(name: &str) -> Option<&'static Controller> {
    CONTROLLERS.iter().find(|c| c.name == name)
}

/// Every controller's name.
pub fn names() -> impl Iterator<Item = &'static str> {
    CONTROLLERS.iter().map(|c| c.name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_is_one_controllers_and_names_are_unique() {
        let mut spellings = std::collections::HashSet::new();
        for c in CONTROLLERS {
            for s in [Some(c.name), Some(c.alias), c.legacy].into_iter().flatten() {
                assert!(spellings.insert(s), "{s} names two controllers");
                assert_eq!(find(s).map(|f| f.name), Some(c.name));
            }
        }
        assert_eq!(find("route-controller").map(|c| c.name), Some(route::NAME));
        assert!(find("cloud-node-controller-x").is_none());
    }
}
