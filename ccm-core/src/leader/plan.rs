//! Which Lease guards which controllers: one Lease for all (the default), one per controller
//! (`--leader-elect-per-controller`, so different replicas can lead different controllers),
//! or, during a migration from kube-controller-manager (`--enable-leader-migration`), the
//! main Lease for the controllers that do not move and the migration Lease
//! (`LeaderMigrationConfiguration.leaderName`) for those that do, as upstream's controller
//! managers share it.

use std::collections::BTreeSet;
use std::path::Path;

use serde::Deserialize;

use crate::options::{Options, canonical_controller};

/// This component's name in a LeaderMigrationConfiguration.
pub const COMPONENT: &str = "cloud-controller-manager";
/// The API group of LeaderMigrationConfiguration.
pub const MIGRATION_GROUP: &str = "controllermanager.config.k8s.io";
const MIGRATION_VERSIONS: &[&str] = &["v1", "v1beta1", "v1alpha1"];

/// Why the controllers cannot be grouped under Leases.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The `--leader-migration-config` file cannot be read.
    #[error("--leader-migration-config: reading {path}")]
    Read {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not a valid LeaderMigrationConfiguration.
    #[error("--leader-migration-config {path}: {why}")]
    Invalid { path: std::path::PathBuf, why: String },
    /// Flags that cannot be combined.
    #[error("--leader-elect-per-controller and --enable-leader-migration cannot be combined")]
    PerControllerAndMigration,
}

/// A LeaderMigrationConfiguration (`controllermanager.config.k8s.io`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigrationConfig {
    /// `controllermanager.config.k8s.io/v1` (or v1beta1, v1alpha1).
    pub api_version: String,
    /// `LeaderMigrationConfiguration`.
    pub kind: String,
    /// The name of the migration Lease.
    pub leader_name: String,
    /// `leases` (the only lock this implementation takes; `endpoints` is refused).
    pub resource_lock: String,
    /// The controllers that move, and which component runs each.
    #[serde(default)]
    pub controller_leaders: Vec<ControllerLeader>,
}

/// One migrating controller.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ControllerLeader {
    /// The controller's name, in either component's spelling (`route`, `route-controller`,
    /// `node-route-controller` …).
    pub name: String,
    /// The component that runs it: `cloud-controller-manager`, `kube-controller-manager` or
    /// `*` (whichever holds the migration Lease).
    pub component: String,
}

impl MigrationConfig {
    /// Upstream's default for this release: the route, service and cloud node lifecycle
    /// controllers move, run by whichever component holds `cloud-provider-extraction-migration`.
    pub fn default_config() -> Self {
        let leader = |name: &str| ControllerLeader { name: name.into(), component: "*".into() };
        Self {
            api_version: format!("{MIGRATION_GROUP}/v1"),
            kind: "LeaderMigrationConfiguration".into(),
            leader_name: "cloud-provider-extraction-migration".into(),
            resource_lock: "leases".into(),
            controller_leaders: vec![
                leader("route-controller"),
                leader("service-controller"),
                leader("cloud-node-lifecycle-controller"),
            ],
        }
    }

    /// Reads and checks a configuration file (YAML or JSON).
    pub fn load(path: &Path) -> Result<Self, PlanError> {
        let text = std::fs::read_to_string(path).map_err(|source| PlanError::Read { path: path.to_path_buf(), source })?;
        let invalid = |why: String| PlanError::Invalid { path: path.to_path_buf(), why };
        let config: Self = serde_saphyr::from_str(&text).map_err(|e| invalid(format!("not YAML or JSON of this kind: {e}")))?;
        config.check().map_err(invalid)?;
        Ok(config)
    }

    /// What is wrong with the configuration, if anything.
    fn check(&self) -> Result<(), String> {
        let version = self.api_version.strip_prefix(&format!("{MIGRATION_GROUP}/"));
        if !version.is_some_and(|v| MIGRATION_VERSIONS.contains(&v)) || self.kind != "LeaderMigrationConfiguration" {
            return Err(format!(
                "expected apiVersion {MIGRATION_GROUP}/v1 and kind LeaderMigrationConfiguration, got {} {}",
                self.api_version, self.kind
            ));
        }
        if self.leader_name.is_empty() {
            return Err("leaderName must be set".into());
        }
        if self.resource_lock != "leases" {
            return Err(format!("resourceLock {:?}: only \"leases\" is supported", self.resource_lock));
        }
        if let Some(i) = self.controller_leaders.iter().position(|l| l.name.is_empty() || l.component.is_empty()) {
            return Err(format!("controllerLeaders[{i}] needs a name and a component"));
        }
        Ok(())
    }

    /// Whether this component runs `controller` under the migration Lease (`Some(true)`),
    /// leaves it to the other component (`Some(false)`), or it does not migrate (`None`).
    pub fn migrates(&self, controller: &str) -> Option<bool> {
        self.controller_leaders
            .iter()
            .find(|l| canonical_controller(&l.name) == Some(controller))
            .map(|l| l.component == COMPONENT || l.component == "*")
    }
}

/// Controllers that run while one Lease is held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseGroup {
    /// The Lease's name (in `--leader-elect-resource-namespace`).
    pub lease: String,
    /// Canonical controller names.
    pub controllers: BTreeSet<&'static str>,
    /// Acquire only after the group at this index holds its Lease (the migration Lease waits
    /// for the main one, as upstream's controller managers do).
    pub after: Option<usize>,
}

/// How the enabled controllers are grouped under Leases. Empty without leader election.
pub fn plan(options: &Options, enabled: &BTreeSet<&'static str>) -> Result<Vec<LeaseGroup>, PlanError> {
    if !options.leader_elect {
        return Ok(Vec::new());
    }
    let main = &options.leader_elect_resource_name;
    if options.enable_leader_migration {
        if options.leader_elect_per_controller {
            return Err(PlanError::PerControllerAndMigration);
        }
        let config = match &options.leader_migration_config {
            Some(path) => MigrationConfig::load(path)?,
            None => MigrationConfig::default_config(),
        };
        let mut stay = BTreeSet::new();
        let mut moved = BTreeSet::new();
        for &c in enabled {
            match config.migrates(c) {
                None => {
                    stay.insert(c);
                }
                Some(true) => {
                    moved.insert(c);
                }
                Some(false) => {
                    tracing::info!(controller = c, "leader migration: run by the other controller manager; not started")
                }
            }
        }
        return Ok(vec![
            LeaseGroup { lease: main.clone(), controllers: stay, after: None },
            LeaseGroup { lease: config.leader_name, controllers: moved, after: Some(0) },
        ]);
    }
    if options.leader_elect_per_controller {
        return Ok(enabled
            .iter()
            .map(|c| LeaseGroup { lease: format!("{main}-{c}"), controllers: BTreeSet::from([*c]), after: None })
            .collect());
    }
    Ok(vec![LeaseGroup { lease: main.clone(), controllers: enabled.clone(), after: None }])
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn options(args: &[&str]) -> Options {
        let mut all = vec!["cloud-controller-manager", "--provider-endpoint=unix:///p.sock"];
        all.extend_from_slice(args);
        Options::try_parse_from(all).expect("flags")
    }

    /// What `*` runs without --allocate-node-cidrs.
    fn all() -> BTreeSet<&'static str> {
        options(&[]).enabled_controllers().expect("controllers")
    }

    #[test]
    fn one_lease_by_default_and_none_without_election() {
        let groups = plan(&options(&[]), &all()).expect("plan");
        assert_eq!(groups.len(), 1);
        assert_eq!((groups[0].lease.as_str(), groups[0].controllers.len()), ("cloud-controller-manager", 4));
        assert!(plan(&options(&["--leader-elect=false"]), &all()).expect("plan").is_empty());
    }

    #[test]
    fn a_lease_per_controller() {
        let groups = plan(&options(&["--leader-elect-per-controller"]), &all()).expect("plan");
        let leases: Vec<&str> = groups.iter().map(|g| g.lease.as_str()).collect();
        assert_eq!(
            leases,
            vec![
                "cloud-controller-manager-cloud-node-controller",
                "cloud-controller-manager-cloud-node-lifecycle-controller",
                "cloud-controller-manager-node-route-controller",
                "cloud-controller-manager-service-lb-controller",
            ]
        );
        assert!(groups.iter().all(|g| g.controllers.len() == 1 && g.after.is_none()));
    }

    #[test]
    fn migration_splits_controllers_between_the_main_and_the_migration_lease() {
        let groups = plan(&options(&["--enable-leader-migration"]), &all()).expect("plan");
        assert_eq!(groups[0].lease, "cloud-controller-manager");
        assert_eq!(groups[0].controllers, BTreeSet::from(["cloud-node-controller"]));
        assert_eq!(groups[1].lease, "cloud-provider-extraction-migration");
        assert_eq!(
            groups[1].controllers,
            BTreeSet::from(["cloud-node-lifecycle-controller", "node-route-controller", "service-lb-controller"])
        );
        assert_eq!(groups[1].after, Some(0), "the migration lease waits for the main one");

        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("migration.yaml");
        std::fs::write(
            &path,
            "apiVersion: controllermanager.config.k8s.io/v1\nkind: LeaderMigrationConfiguration\n\
             leaderName: kcm-to-ccm\nresourceLock: leases\ncontrollerLeaders:\n\
             - name: route\n  component: kube-controller-manager\n\
             - name: service-controller\n  component: cloud-controller-manager\n",
        )
        .expect("write");
        let flag = format!("--leader-migration-config={}", path.display());
        let groups = plan(&options(&["--enable-leader-migration", &flag]), &all()).expect("plan");
        assert_eq!(groups[1].lease, "kcm-to-ccm");
        assert_eq!(groups[1].controllers, BTreeSet::from(["service-lb-controller"]));
        assert!(!groups[0].controllers.contains("node-route-controller"), "left to kube-controller-manager");
        assert!(groups[0].controllers.contains("cloud-node-lifecycle-controller"), "not migrating: main lease");

        std::fs::write(&path, "apiVersion: v1\nkind: ConfigMap\nleaderName: x\nresourceLock: leases\n").expect("write");
        let e = plan(&options(&["--enable-leader-migration", &flag]), &all()).expect_err("wrong kind");
        assert!(format!("{e:#}").contains("LeaderMigrationConfiguration"), "{e:#}");
        let both = plan(&options(&["--enable-leader-migration", "--leader-elect-per-controller"]), &all());
        assert!(both.is_err());
    }
}
