//! The fleet as gauges for `/metrics`: ManagedClusters by their `Available` condition,
//! ManifestWorks by their `Applied`, `Available` and `Degraded` conditions, Placements that
//! select no cluster, and ManifestWorkReplicaSet rollouts by phase. Each kind is read through
//! the store's one list-then-watch loop ([`flotilla_store::reflect`]) into a tally of which
//! series each object counts in; a change moves one object between series, so a scrape costs
//! nothing and the store sees one watch per kind.
//!
//! Labels are condition names, statuses and phases only, never an object's name: the series
//! are a handful whatever the size of the fleet.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use flotilla_proto::api::Kind;
use flotilla_store::reflect::{Reflector, reflect_all};
use flotilla_store::{Object, Store, WatchEvent};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::{Mutex, watch};

/// A set of label pairs, all from fixed vocabularies.
type Labels = Vec<(&'static str, &'static str)>;

/// How one kind is counted: the series (label sets) each object counts in.
type Classify = fn(&Object) -> Vec<Labels>;

/// The hub's fleet gauges. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct FleetMetrics {
    clusters: Family<Labels, Gauge>,
    works: Family<Labels, Gauge>,
    placements_without_decisions: Family<Labels, Gauge>,
    rollouts: Family<Labels, Gauge>,
}

/// Condition statuses as Kubernetes writes them; anything else (or no condition) is Unknown.
const STATUSES: [&str; 3] = ["True", "False", "Unknown"];
/// The ManifestWork conditions counted.
const WORK_CONDITIONS: [&str; 3] = ["Applied", "Available", "Degraded"];
/// `PlacementRolledOut` reasons the replica set controller writes; `Pending` before it has.
const ROLLOUT_PHASES: [&str; 4] = ["Pending", "Progressing", "Complete", "MaxFailuresExceeded"];

impl FleetMetrics {
    pub fn new() -> FleetMetrics {
        let metrics = FleetMetrics::default();
        // Every series from the start, at 0: an alert on "False > 0" needs the series to exist.
        for status in STATUSES {
            let _ = metrics
                .clusters
                .get_or_create_owned(&vec![("available", status)]);
            for condition in WORK_CONDITIONS {
                let _ = metrics
                    .works
                    .get_or_create_owned(&vec![("condition", condition), ("status", status)]);
            }
        }
        let _ = metrics
            .placements_without_decisions
            .get_or_create_owned(&Vec::new());
        for phase in ROLLOUT_PHASES {
            let _ = metrics
                .rollouts
                .get_or_create_owned(&vec![("phase", phase)]);
        }
        metrics
    }

    /// Registers every gauge under `flotilla_hub_`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("hub");
        r.register(
            "managedclusters",
            "ManagedClusters by the status of their Available condition (Unknown: the session \
             has been gone past the grace period, or the cluster never connected)",
            self.clusters.clone(),
        );
        r.register(
            "manifestworks",
            "ManifestWorks by condition (Applied, Available, Degraded) and its status; a work \
             without the condition counts as Unknown",
            self.works.clone(),
        );
        r.register(
            "placements_without_decisions",
            "Placements whose decisions list no cluster (status.numberOfSelectedClusters is 0)",
            self.placements_without_decisions.clone(),
        );
        r.register(
            "rollouts",
            "ManifestWorkReplicaSets by rollout phase (the reason of PlacementRolledOut; \
             Pending before the controller has written it)",
            self.rollouts.clone(),
        );
    }

    /// Keeps the gauges current from `store` until `stop`. `listed` turns true once every kind
    /// has been listed. `also` are other caches of the hub fed by the same loops (one list and
    /// one watch per kind for all of them; kinds the gauges do not read get a loop of their own).
    pub async fn run(
        self,
        store: Arc<dyn Store>,
        listed: watch::Sender<bool>,
        also: Vec<(Kind, Arc<dyn Reflector>)>,
        stop: watch::Receiver<bool>,
    ) {
        let tallies: [(Kind, Arc<Tally>); 4] = [
            (
                Kind::ManagedCluster,
                Arc::new(Tally::new(self.clusters.clone(), cluster_series)),
            ),
            (
                Kind::ManifestWork,
                Arc::new(Tally::new(self.works.clone(), work_series)),
            ),
            (
                Kind::Placement,
                Arc::new(Tally::new(
                    self.placements_without_decisions.clone(),
                    placement_series,
                )),
            ),
            (
                Kind::ManifestWorkReplicaSet,
                Arc::new(Tally::new(self.rollouts.clone(), rollout_series)),
            ),
        ];
        let all_listed = async {
            for (_, tally) in &tallies {
                let mut rx = tally.listed.subscribe();
                let _ = rx.wait_for(|l| *l).await;
            }
            listed.send_replace(true);
            std::future::pending::<()>().await;
        };
        let readers = tallies
            .iter()
            .map(|(kind, tally)| (*kind, tally.clone() as Arc<dyn Reflector>))
            .chain(also)
            .collect();
        tokio::select! {
            _ = reflect_all(store.as_ref(), readers, stop) => {}
            _ = all_listed => {}
        }
    }
}

fn condition_status(object: &Object, condition: &str) -> &'static str {
    let status = object["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == condition))
        .and_then(|c| c["status"].as_str());
    match status {
        Some("True") => "True",
        Some("False") => "False",
        _ => "Unknown",
    }
}

fn cluster_series(object: &Object) -> Vec<Labels> {
    vec![vec![(
        "available",
        condition_status(object, "ManagedClusterConditionAvailable"),
    )]]
}

fn work_series(object: &Object) -> Vec<Labels> {
    WORK_CONDITIONS
        .iter()
        .map(|c| vec![("condition", *c), ("status", condition_status(object, c))])
        .collect()
}

fn placement_series(object: &Object) -> Vec<Labels> {
    let selected = object["status"]["numberOfSelectedClusters"]
        .as_i64()
        .unwrap_or(0);
    if selected == 0 {
        vec![Vec::new()]
    } else {
        Vec::new()
    }
}

fn rollout_series(object: &Object) -> Vec<Labels> {
    let reason = object["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "PlacementRolledOut"))
        .and_then(|c| c["reason"].as_str());
    let phase = ROLLOUT_PHASES
        .iter()
        .find(|p| Some(**p) == reason)
        .copied()
        .unwrap_or("Pending");
    vec![vec![("phase", phase)]]
}

/// One kind's objects, each with the series it counts in.
struct Tally {
    gauges: Family<Labels, Gauge>,
    classify: Classify,
    /// namespace/name → the series the object counts in now.
    objects: Mutex<HashMap<String, Vec<Labels>>>,
    listed: watch::Sender<bool>,
}

impl Tally {
    fn new(gauges: Family<Labels, Gauge>, classify: Classify) -> Tally {
        Tally {
            gauges,
            classify,
            objects: Mutex::new(HashMap::new()),
            listed: watch::Sender::new(false),
        }
    }

    fn key(object: &Object) -> String {
        format!(
            "{}/{}",
            flotilla_store::namespace_of(object).unwrap_or(""),
            flotilla_store::name_of(object)
        )
    }

    fn count(&self, series: &[Labels], by: i64) {
        for labels in series {
            self.gauges.get_or_create(labels).inc_by(by);
        }
    }
}

#[async_trait]
impl Reflector for Tally {
    async fn replace(&self, items: Vec<Object>) {
        let mut objects = self.objects.lock().await;
        for series in objects.values() {
            self.count(series, -1);
        }
        objects.clear();
        for object in items {
            let series = (self.classify)(&object);
            self.count(&series, 1);
            objects.insert(Self::key(&object), series);
        }
        self.listed.send_replace(true);
    }

    async fn apply(&self, event: WatchEvent) {
        let mut objects = self.objects.lock().await;
        let key = Self::key(event.object());
        if let Some(old) = objects.remove(&key) {
            self.count(&old, -1);
        }
        if let WatchEvent::Added(object) | WatchEvent::Modified(object) = event {
            let series = (self.classify)(&object);
            self.count(&series, 1);
            objects.insert(key, series);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cluster(name: &str, available: &str) -> Object {
        json!({"metadata": {"name": name}, "status": {"conditions": [
            {"type": "ManagedClusterConditionAvailable", "status": available}
        ]}})
    }

    fn gauge(family: &Family<Labels, Gauge>, labels: Labels) -> i64 {
        family.get_or_create(&labels).get()
    }

    #[tokio::test]
    async fn a_cluster_moves_between_series_as_its_condition_changes() {
        let metrics = FleetMetrics::new();
        let tally = Tally::new(metrics.clusters.clone(), cluster_series);
        tally
            .replace(vec![
                cluster("a", "True"),
                cluster("b", "True"),
                json!({"metadata": {"name": "c"}}),
            ])
            .await;
        assert_eq!(gauge(&metrics.clusters, vec![("available", "True")]), 2);
        assert_eq!(gauge(&metrics.clusters, vec![("available", "Unknown")]), 1);
        tally
            .apply(WatchEvent::Modified(cluster("a", "Unknown")))
            .await;
        tally.apply(WatchEvent::Deleted(cluster("b", "True"))).await;
        assert_eq!(gauge(&metrics.clusters, vec![("available", "True")]), 0);
        assert_eq!(gauge(&metrics.clusters, vec![("available", "Unknown")]), 2);
        // A relist replaces everything counted before.
        tally.replace(vec![cluster("a", "False")]).await;
        assert_eq!(gauge(&metrics.clusters, vec![("available", "Unknown")]), 0);
        assert_eq!(gauge(&metrics.clusters, vec![("available", "False")]), 1);
    }

    #[test]
    fn works_placements_and_rollouts_are_classified_by_their_status() {
        let work = json!({"status": {"conditions": [
            {"type": "Applied", "status": "True"}, {"type": "Degraded", "status": "False"}
        ]}});
        assert_eq!(
            work_series(&work),
            vec![
                vec![("condition", "Applied"), ("status", "True")],
                vec![("condition", "Available"), ("status", "Unknown")],
                vec![("condition", "Degraded"), ("status", "False")],
            ]
        );
        assert_eq!(
            placement_series(&json!({"status": {"numberOfSelectedClusters": 0}})).len(),
            1
        );
        assert_eq!(placement_series(&json!({})).len(), 1);
        assert!(placement_series(&json!({"status": {"numberOfSelectedClusters": 3}})).is_empty());
        let rollout = |reason: &str| {
            rollout_series(&json!({"status": {"conditions": [
                {"type": "PlacementRolledOut", "status": "False", "reason": reason}
            ]}}))
        };
        assert_eq!(
            rollout("MaxFailuresExceeded"),
            vec![vec![("phase", "MaxFailuresExceeded")]]
        );
        assert_eq!(rollout("Complete"), vec![vec![("phase", "Complete")]]);
        assert_eq!(rollout_series(&json!({})), vec![vec![("phase", "Pending")]]);
    }
}
