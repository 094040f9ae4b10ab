//! ManagedClusterSets as OCM's hub keeps them:
//!
//! * the `default` set (`ExclusiveClusterSetLabel`) and the `global` set (a `LabelSelector` of
//!   `{}`: every cluster) exist, and come back if deleted;
//! * a cluster without the `cluster.open-cluster-management.io/clusterset` label gets
//!   `default`, so a fresh hub can place on every cluster once `default` is bound;
//! * a taint without `timeAdded` gets the time it was first seen (OCM's admission webhook does
//!   this), so `tolerationSeconds` counts from then;
//! * each set's `ClusterSetEmpty` and each binding's `Bound` condition say what is true.
//!
//! Each write happens once per change and carries the version it read: a concurrent writer
//! wins, and the next watch event brings the controller round again.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use flotilla_ops::error_chain;
use flotilla_proto::api::conditions::{
    CLUSTER_SET_BOUND, CLUSTER_SET_EMPTY, ConditionStatus, find_condition, set_condition,
};
use flotilla_proto::api::{
    CLUSTER_SET_LABEL, Kind, ManagedCluster, ManagedClusterSet, ManagedClusterSetBinding,
};
use flotilla_store::{Revision, Store, StoreError, WatchEvent, name_of, namespace_of};
use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use super::feed::{self, Known, Readiness};
use super::scheduling::core::{Cluster, SetRule};
use super::{ControllerConfig, stopped};

const KINDS: [Kind; 3] = [
    Kind::ManagedCluster,
    Kind::ManagedClusterSet,
    Kind::ManagedClusterSetBinding,
];

/// The set every cluster without a set label joins.
pub const DEFAULT_SET: &str = "default";
/// The set that holds every cluster.
pub const GLOBAL_SET: &str = "global";
/// The condition of a set whose `spec.managedNamespaces` flotilla does not act on.
pub const CLUSTER_SET_MANAGED_NAMESPACES: &str = "ManagedNamespaces";
const MANAGED_NAMESPACES_NOT_IMPLEMENTED: &str = "flotilla does not implement spec.managedNamespaces yet: no namespace is made on this set's clusters; remove the field";

#[derive(Default)]
struct Model {
    clusters: HashMap<String, Cluster>,
    /// Per set: its rule, whether it asks for managed namespaces, its conditions.
    sets: BTreeMap<String, (SetRule, bool, Vec<Condition>)>,
    bindings: BTreeMap<(String, String), (String, Vec<Condition>)>,
    /// Writes sent and not yet seen coming back, so one change is written once.
    pending: HashSet<(Kind, Option<String>, String)>,
    /// Clusters changed since the last plan: only they can need a label or a taint stamp.
    /// (A status-only change, such as each cluster turning Available as its agent connects,
    /// costs one lookup, not a pass over the fleet.)
    changed_clusters: HashSet<String>,
    /// Whether a set's membership may have changed since the last plan: a set changed, or a
    /// cluster came, went or changed its labels.
    membership_changed: bool,
}

/// One write this controller makes.
#[derive(Debug)]
enum Write {
    CreateSet(Value),
    /// Label the cluster `default` and/or stamp its taints.
    FixCluster(String),
    SetStatus(Kind, Option<String>, String, Value),
}

pub async fn run(store: Arc<dyn Store>, config: ControllerConfig, stop: watch::Receiver<bool>) {
    let (tx, mut rx) = mpsc::channel(config.queue_capacity);
    let mut feeds = JoinSet::new();
    feed::spawn(store.clone(), &KINDS, None, tx, stop.clone(), &mut feeds);
    let mut model = Model::default();
    let mut known = Known::default();
    let mut readiness = Readiness::new(&KINDS);
    let mut stop_wait = stop.clone();
    loop {
        let update = tokio::select! {
            u = rx.recv() => match u { Some(u) => u, None => break },
            _ = stopped(&mut stop_wait) => break,
        };
        let mut batch = vec![update];
        while batch.len() < config.batch {
            match rx.try_recv() {
                Ok(u) => batch.push(u),
                Err(_) => break,
            }
        }
        for u in batch {
            readiness.note(&u);
            for (kind, event) in known.changes(u) {
                model.apply(kind, event);
            }
        }
        if !readiness.ready() {
            continue;
        }
        let writes = model.plan(&config, Timestamp::now());
        if writes.is_empty() {
            continue;
        }
        let store = store.clone();
        let failed: Vec<(Kind, Option<String>, String)> = futures::stream::iter(writes)
            .map(|w| write(store.clone(), w))
            .buffer_unordered(config.write_concurrency)
            .filter_map(|failed| async move { failed })
            .collect()
            .await;
        // Planned again with the next change.
        for key in failed {
            model.replan(key);
        }
    }
    feeds.shutdown().await;
}

impl Model {
    /// A write that failed: its object is planned again with the next change.
    fn replan(&mut self, key: (Kind, Option<String>, String)) {
        match key.0 {
            Kind::ManagedCluster => {
                self.changed_clusters.insert(key.2.clone());
            }
            Kind::ManagedClusterSet => self.membership_changed = true,
            _ => {}
        }
        self.pending.remove(&key);
    }

    fn apply(&mut self, kind: Kind, event: WatchEvent) {
        let deleted = matches!(event, WatchEvent::Deleted(_));
        let obj = event.into_object();
        let name = name_of(&obj).to_string();
        let ns = namespace_of(&obj).map(str::to_string);
        self.pending.remove(&(kind, ns.clone(), name.clone()));
        match kind {
            Kind::ManagedCluster if deleted => {
                self.clusters.remove(&name);
                self.membership_changed = true;
            }
            Kind::ManagedCluster => {
                if let Ok(mc) = serde_json::from_value::<ManagedCluster>(obj) {
                    let cluster = Cluster::from_managed_cluster(&mc);
                    let before = self.clusters.insert(name.clone(), cluster);
                    let labels = &self.clusters[&name].labels;
                    if before.is_none_or(|b| &b.labels != labels) {
                        self.membership_changed = true;
                    }
                    self.changed_clusters.insert(name);
                }
            }
            Kind::ManagedClusterSet if deleted => {
                self.sets.remove(&name);
                self.membership_changed = true;
            }
            Kind::ManagedClusterSet => {
                self.membership_changed = true;
                if let Ok(set) = serde_json::from_value::<ManagedClusterSet>(obj) {
                    let (rule, _) = SetRule::from_spec(&name, &set.spec);
                    let namespaces = !set.spec.managed_namespaces.is_empty();
                    let conditions = set.status.unwrap_or_default().conditions;
                    self.sets.insert(name, (rule, namespaces, conditions));
                }
            }
            Kind::ManagedClusterSetBinding => {
                let key = (ns.unwrap_or_default(), name);
                if deleted {
                    self.bindings.remove(&key);
                } else if let Ok(b) = serde_json::from_value::<ManagedClusterSetBinding>(obj) {
                    let conditions = b.status.unwrap_or_default().conditions;
                    self.bindings.insert(key, (b.spec.cluster_set, conditions));
                }
            }
            _ => {}
        }
    }

    fn plan(&mut self, config: &ControllerConfig, now: Timestamp) -> Vec<Write> {
        let mut writes = Vec::new();
        if config.default_cluster_sets {
            for (name, spec) in [
                (
                    DEFAULT_SET,
                    json!({ "clusterSelector": { "selectorType": "ExclusiveClusterSetLabel" } }),
                ),
                (
                    GLOBAL_SET,
                    json!({ "clusterSelector": { "selectorType": "LabelSelector", "labelSelector": {} } }),
                ),
            ] {
                let key = (Kind::ManagedClusterSet, None, name.to_string());
                if !self.sets.contains_key(name) && self.pending.insert(key) {
                    writes.push(Write::CreateSet(json!({
                        "apiVersion": Kind::ManagedClusterSet.api_version(),
                        "kind": "ManagedClusterSet",
                        "metadata": { "name": name },
                        "spec": spec,
                    })));
                }
            }
        }
        for name in std::mem::take(&mut self.changed_clusters) {
            let Some(c) = self.clusters.get(&name) else {
                continue;
            };
            let unlabelled =
                config.default_cluster_sets && !c.labels.contains_key(CLUSTER_SET_LABEL);
            let unstamped = c.taints.iter().any(|t| t.time_added.is_none());
            if (unlabelled || unstamped)
                && !c.deleting
                && self
                    .pending
                    .insert((Kind::ManagedCluster, None, name.clone()))
            {
                writes.push(Write::FixCluster(name));
            }
        }
        let recount = std::mem::take(&mut self.membership_changed);
        for (name, (rule, namespaces, conditions)) in self.sets.iter().filter(|_| recount) {
            let members = self.clusters.values().filter(|c| rule.contains(c)).count();
            let mut next = conditions.clone();
            let (status, reason, message) = if members == 0 {
                (
                    ConditionStatus::True,
                    "NoClusterMatched",
                    "No ManagedCluster selected".to_string(),
                )
            } else {
                (
                    ConditionStatus::False,
                    "ClustersSelected",
                    format!("{members} ManagedClusters selected"),
                )
            };
            let mut changed = set_condition(
                &mut next,
                CLUSTER_SET_EMPTY,
                status,
                reason,
                &message,
                None,
                Time(now),
            );
            // Not implemented, so said where a kube-backend user applying the set with
            // kubectl looks (the operator API refuses the field before storing it).
            if *namespaces {
                changed |= set_condition(
                    &mut next,
                    CLUSTER_SET_MANAGED_NAMESPACES,
                    ConditionStatus::False,
                    "NotImplemented",
                    MANAGED_NAMESPACES_NOT_IMPLEMENTED,
                    None,
                    Time(now),
                );
            } else {
                let before = next.len();
                next.retain(|c| c.type_ != CLUSTER_SET_MANAGED_NAMESPACES);
                changed |= next.len() != before;
            }
            if changed
                && self
                    .pending
                    .insert((Kind::ManagedClusterSet, None, name.clone()))
            {
                writes.push(Write::SetStatus(
                    Kind::ManagedClusterSet,
                    None,
                    name.clone(),
                    json!({ "conditions": next }),
                ));
            }
        }
        for ((ns, name), (set, conditions)) in &self.bindings {
            let exists = self.sets.contains_key(set);
            let (status, reason, message) = if exists {
                (
                    ConditionStatus::True,
                    "ClusterSetBound",
                    format!("ManagedClusterSet {set} is bound to namespace {ns}"),
                )
            } else {
                (
                    ConditionStatus::False,
                    "ClusterSetNotFound",
                    format!("ManagedClusterSet {set} does not exist"),
                )
            };
            let current = find_condition(conditions, CLUSTER_SET_BOUND);
            if current.is_some_and(|c| c.status == status.as_str() && c.reason == reason) {
                continue;
            }
            let mut next = conditions.clone();
            set_condition(
                &mut next,
                CLUSTER_SET_BOUND,
                status,
                reason,
                &message,
                None,
                Time(now),
            );
            if self.pending.insert((
                Kind::ManagedClusterSetBinding,
                Some(ns.clone()),
                name.clone(),
            )) {
                writes.push(Write::SetStatus(
                    Kind::ManagedClusterSetBinding,
                    Some(ns.clone()),
                    name.clone(),
                    json!({ "conditions": next }),
                ));
            }
        }
        writes
    }
}

/// Carries out one write; returns its object's key if it failed.
async fn write(store: Arc<dyn Store>, w: Write) -> Option<(Kind, Option<String>, String)> {
    let key = match &w {
        Write::CreateSet(set) => (Kind::ManagedClusterSet, None, name_of(set).to_string()),
        Write::FixCluster(name) => (Kind::ManagedCluster, None, name.clone()),
        Write::SetStatus(kind, ns, name, _) => (*kind, ns.clone(), name.clone()),
    };
    let result = match &w {
        Write::CreateSet(set) => match store.create(set.clone()).await {
            Ok(_) => {
                info!(set = %name_of(set), "ManagedClusterSet created");
                Ok(())
            }
            Err(StoreError::AlreadyExists { .. }) => Ok(()),
            Err(e) => Err(e),
        },
        Write::FixCluster(name) => fix_cluster(store.as_ref(), name).await,
        Write::SetStatus(kind, ns, name, status) => store
            .update_status(*kind, ns.as_deref(), name, status.clone(), None)
            .await
            .map(|_| ()),
    };
    match result {
        Ok(()) | Err(StoreError::NotFound { .. }) => None,
        // Someone else wrote first; their event brings this controller round again.
        Err(StoreError::Conflict { .. }) => {
            debug!(write = ?w, "conflict; the next event retries");
            Some(key)
        }
        Err(e) => {
            warn!(write = ?w, error = %error_chain(&e), "cluster set bookkeeping failed; the next change retries");
            Some(key)
        }
    }
}

/// Labels a cluster with the default set if it has no set, and stamps its taints' `timeAdded`,
/// on a fresh read with its version as precondition.
async fn fix_cluster(store: &dyn Store, name: &str) -> Result<(), StoreError> {
    let Some(mut mc) = store.get(Kind::ManagedCluster, None, name).await? else {
        return Ok(());
    };
    let expected = Revision::of(&mc);
    let mut changed = false;
    let labels = mc["metadata"]
        .as_object_mut()
        .map(|m| m.entry("labels").or_insert_with(|| json!({})));
    if let Some(labels) = labels.and_then(Value::as_object_mut)
        && !labels.contains_key(CLUSTER_SET_LABEL)
    {
        labels.insert(CLUSTER_SET_LABEL.to_string(), DEFAULT_SET.into());
        changed = true;
    }
    let now = serde_json::to_value(Time(Timestamp::now())).unwrap_or_default();
    // `pointer_mut`, not indexing: indexing a missing field would write a `null` into it.
    if let Some(taints) = mc.pointer_mut("/spec/taints").and_then(Value::as_array_mut) {
        for t in taints
            .iter_mut()
            .filter(|t| t.get("timeAdded").is_none_or(Value::is_null))
        {
            t["timeAdded"] = now.clone();
            changed = true;
        }
    }
    if !changed {
        return Ok(());
    }
    if let Some(rv) = expected {
        mc["metadata"]["resourceVersion"] = rv.as_str().into();
    }
    store.update_spec(mc).await?;
    debug!(cluster = name, "cluster set label or taint times written");
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The model's planning: what a change makes it write, and what it does not look at.

    use super::*;

    fn cluster(name: &str, labels: Value, available: &str) -> WatchEvent {
        WatchEvent::Modified(json!({
            "apiVersion": Kind::ManagedCluster.api_version(),
            "kind": "ManagedCluster",
            "metadata": { "name": name, "labels": labels, "resourceVersion": "1" },
            "spec": { "hubAcceptsClient": true },
            "status": { "conditions": [{
                "type": "ManagedClusterConditionAvailable", "status": available,
                "reason": "r", "message": "m", "lastTransitionTime": "2026-11-23T00:00:00Z",
            }] },
        }))
    }

    fn set(name: &str) -> WatchEvent {
        WatchEvent::Modified(json!({
            "apiVersion": Kind::ManagedClusterSet.api_version(),
            "kind": "ManagedClusterSet",
            "metadata": { "name": name, "resourceVersion": "1" },
            "spec": { "clusterSelector": { "selectorType": "ExclusiveClusterSetLabel" } },
        }))
    }

    fn set_statuses(writes: &[Write]) -> Vec<(String, String)> {
        writes
            .iter()
            .filter_map(|w| match w {
                Write::SetStatus(Kind::ManagedClusterSet, None, name, status) => Some((
                    name.clone(),
                    status["conditions"][0]["message"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                )),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_set_asking_for_managed_namespaces_says_they_are_not_implemented_until_it_stops() {
        let config = ControllerConfig::default();
        let asking = |namespaces: Value| {
            WatchEvent::Modified(json!({
                "apiVersion": Kind::ManagedClusterSet.api_version(),
                "kind": "ManagedClusterSet",
                "metadata": { "name": "stores", "resourceVersion": "1" },
                "spec": {
                    "clusterSelector": { "selectorType": "ExclusiveClusterSetLabel" },
                    "managedNamespaces": namespaces,
                },
            }))
        };
        let condition = |writes: &[Write]| {
            writes.iter().find_map(|w| match w {
                Write::SetStatus(Kind::ManagedClusterSet, None, name, status)
                    if name == "stores" =>
                {
                    Some(status["conditions"].as_array().cloned().unwrap_or_default())
                }
                _ => None,
            })
        };
        let mut model = Model::default();
        model.apply(Kind::ManagedClusterSet, asking(json!([{"name": "shop"}])));
        let written = condition(&model.plan(&config, Timestamp::now())).expect("a status write");
        let refusal = written
            .iter()
            .find(|c| c["type"] == CLUSTER_SET_MANAGED_NAMESPACES)
            .expect("the ManagedNamespaces condition");
        assert_eq!(
            (&refusal["status"], &refusal["reason"]),
            (&json!("False"), &json!("NotImplemented"))
        );
        assert!(
            refusal["message"]
                .as_str()
                .unwrap()
                .contains("spec.managedNamespaces"),
            "{refusal}"
        );

        // The write seen back, then the field removed: the condition goes.
        let mut stored = asking(json!([{"name": "shop"}]));
        if let WatchEvent::Modified(o) = &mut stored {
            o["status"] = json!({ "conditions": written });
            o["spec"]["managedNamespaces"] = json!([]);
            o["metadata"]["resourceVersion"] = json!("2");
        }
        model.pending.clear();
        model.apply(Kind::ManagedClusterSet, stored);
        let after = condition(&model.plan(&config, Timestamp::now())).expect("a status write");
        assert!(
            after
                .iter()
                .all(|c| c["type"] != CLUSTER_SET_MANAGED_NAMESPACES),
            "{after:?}"
        );
    }

    #[test]
    fn a_status_change_is_planned_alone_and_a_label_change_recounts_the_sets() {
        let config = ControllerConfig::default();
        let now = Timestamp::now();
        let mut model = Model::default();
        model.apply(Kind::ManagedClusterSet, set(DEFAULT_SET));
        model.apply(Kind::ManagedClusterSet, set("east"));
        let labelled = |set: &str| json!({ CLUSTER_SET_LABEL: set });
        for i in 0..3 {
            model.apply(
                Kind::ManagedCluster,
                cluster(&format!("c{i}"), labelled(DEFAULT_SET), "Unknown"),
            );
        }
        model.apply(Kind::ManagedCluster, cluster("bare", json!({}), "Unknown"));
        let first = model.plan(&config, now);
        assert!(
            first
                .iter()
                .any(|w| matches!(w, Write::FixCluster(n) if n == "bare")),
            "the unlabelled cluster joins default: {first:?}"
        );
        let mut counted = set_statuses(&first);
        counted.sort();
        assert_eq!(
            counted,
            [
                (
                    DEFAULT_SET.to_string(),
                    "3 ManagedClusters selected".to_string()
                ),
                ("east".to_string(), "No ManagedCluster selected".to_string()),
            ]
        );

        // Clusters turning Available change no membership: nothing to write, no set recounted.
        // (The sets' status writes came back; `global`'s creation is still on its way.)
        model
            .pending
            .retain(|(kind, _, name)| *kind != Kind::ManagedClusterSet || name == GLOBAL_SET);
        for i in 0..3 {
            model.apply(
                Kind::ManagedCluster,
                cluster(&format!("c{i}"), labelled(DEFAULT_SET), "True"),
            );
        }
        assert!(model.plan(&config, now).is_empty());

        // A cluster moving to another set recounts both.
        model.apply(
            Kind::ManagedCluster,
            cluster("c0", labelled("east"), "True"),
        );
        let mut counted = set_statuses(&model.plan(&config, now));
        counted.sort();
        assert_eq!(
            counted,
            [
                (
                    DEFAULT_SET.to_string(),
                    "2 ManagedClusters selected".to_string()
                ),
                ("east".to_string(), "1 ManagedClusters selected".to_string()),
            ]
        );
    }

    #[test]
    fn a_failed_write_is_planned_again_with_the_next_change() {
        let config = ControllerConfig::default();
        let now = Timestamp::now();
        let mut model = Model::default();
        model.apply(Kind::ManagedClusterSet, set(DEFAULT_SET));
        model.apply(Kind::ManagedCluster, cluster("bare", json!({}), "Unknown"));
        let first = model.plan(&config, now);
        assert!(
            first
                .iter()
                .any(|w| matches!(w, Write::FixCluster(n) if n == "bare"))
        );
        // Sent and not back yet: not written twice.
        model.apply(
            Kind::ManagedCluster,
            cluster("other", json!({ CLUSTER_SET_LABEL: DEFAULT_SET }), "True"),
        );
        model
            .pending
            .insert((Kind::ManagedCluster, None, "bare".into()));
        assert!(
            !model
                .plan(&config, now)
                .iter()
                .any(|w| matches!(w, Write::FixCluster(n) if n == "bare"))
        );
        // The write failed: the next plan makes it again, though "bare" itself did not change.
        model.replan((Kind::ManagedCluster, None, "bare".into()));
        assert!(
            model
                .plan(&config, now)
                .iter()
                .any(|w| matches!(w, Write::FixCluster(n) if n == "bare"))
        );
    }
}
