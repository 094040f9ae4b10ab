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

#[derive(Default)]
struct Model {
    clusters: HashMap<String, Cluster>,
    sets: BTreeMap<String, (SetRule, Vec<Condition>)>,
    bindings: BTreeMap<(String, String), (String, Vec<Condition>)>,
    /// Writes sent and not yet seen coming back, so one change is written once.
    pending: HashSet<(Kind, Option<String>, String)>,
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
            model.pending.remove(&key);
        }
    }
    feeds.shutdown().await;
}

impl Model {
    fn apply(&mut self, kind: Kind, event: WatchEvent) {
        let deleted = matches!(event, WatchEvent::Deleted(_));
        let obj = event.into_object();
        let name = name_of(&obj).to_string();
        let ns = namespace_of(&obj).map(str::to_string);
        self.pending.remove(&(kind, ns.clone(), name.clone()));
        match kind {
            Kind::ManagedCluster if deleted => {
                self.clusters.remove(&name);
            }
            Kind::ManagedCluster => {
                if let Ok(mc) = serde_json::from_value::<ManagedCluster>(obj) {
                    self.clusters
                        .insert(name, Cluster::from_managed_cluster(&mc));
                }
            }
            Kind::ManagedClusterSet if deleted => {
                self.sets.remove(&name);
            }
            Kind::ManagedClusterSet => {
                if let Ok(set) = serde_json::from_value::<ManagedClusterSet>(obj) {
                    let (rule, _) = SetRule::from_spec(&name, &set.spec);
                    let conditions = set.status.unwrap_or_default().conditions;
                    self.sets.insert(name, (rule, conditions));
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
        for (name, c) in &self.clusters {
            let unlabelled =
                config.default_cluster_sets && !c.labels.contains_key(CLUSTER_SET_LABEL);
            let unstamped = c.taints.iter().any(|t| t.time_added.is_none());
            if (unlabelled || unstamped)
                && !c.deleting
                && self
                    .pending
                    .insert((Kind::ManagedCluster, None, name.clone()))
            {
                writes.push(Write::FixCluster(name.clone()));
            }
        }
        for (name, (rule, conditions)) in &self.sets {
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
            if set_condition(
                &mut next,
                CLUSTER_SET_EMPTY,
                status,
                reason,
                &message,
                None,
                Time(now),
            ) && self
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
            warn!(write = ?w, error = %e, "cluster set bookkeeping failed; the next change retries");
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
