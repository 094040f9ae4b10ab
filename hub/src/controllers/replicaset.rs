//! ManifestWorkReplicaSet: one ManifestWork template fanned out to the clusters its placements
//! selected, in each cluster's namespace, as fast as each placement's rollout strategy allows;
//! its status summarised; its works removed when it goes. OCM's semantics: works are named
//! after the replica set and labelled `work.open-cluster-management.io/manifestworkreplicaset:
//! <namespace>.<name>` and `work.open-cluster-management.io/placementname: <placement>`; a work
//! follows its placement's decisions (a cluster dropped by the placement loses the work); the
//! finalizer `work.open-cluster-management.io/manifest-work-cleanup` keeps the replica set until
//! its works are deleted (`Background`: deleted, `Foreground`: gone).
//!
//! [`plan`] decides for one replica set with no IO (tested here); the driver feeds it from the
//! store's watches, writes what it says, and comes back when a soak time or deadline ends.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use flotilla_ops::error_chain;
use flotilla_proto::api::conditions::{
    ConditionStatus, MANIFESTWORK_APPLIED, PLACEMENT_ROLLED_OUT, PLACEMENT_VERIFIED, WORK_APPLIED,
    WORK_AVAILABLE, WORK_DEGRADED, WORK_PROGRESSING, find_condition, is_condition_true,
    set_condition,
};
use flotilla_proto::api::{
    CascadeDeletionPolicy, DECISION_GROUP_INDEX_LABEL, DECISION_GROUP_NAME_LABEL, Kind,
    ManifestWork, ManifestWorkReplicaSet, ManifestWorkReplicaSetStatus,
    ManifestWorkReplicaSetSummary, ManifestWorkSpec, PLACEMENT_LABEL, Placement, PlacementDecision,
    PlacementSummary,
};
use flotilla_proto::contract::DECOMMISSION_ANNOTATION;
use flotilla_store::{Object, Revision, Store, StoreError, WatchEvent, name_of, namespace_of};
use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use super::feed::{self, Known, Readiness};
use super::rollout::{self, ClusterGroups, GroupKey, Status};
use super::scheduling::fleet::Key;
use super::{ControllerConfig, delay_until, stopped};

/// Label on a ManifestWork naming its replica set as `<namespace>.<name>`.
pub const REPLICA_SET_LABEL: &str = "work.open-cluster-management.io/manifestworkreplicaset";
/// Label on a ManifestWork naming the placement that put it there.
pub const PLACEMENT_NAME_LABEL: &str = "work.open-cluster-management.io/placementname";
/// Finalizer on a ManifestWorkReplicaSet until its ManifestWorks are deleted.
pub const REPLICA_SET_FINALIZER: &str = "work.open-cluster-management.io/manifest-work-cleanup";
/// `PlacementRolledOut` reason when failures stopped the rollout (OCM has no word for it).
pub const REASON_MAX_FAILURES: &str = "MaxFailuresExceeded";
/// Failed clusters named at most in a condition message.
const FAILED_NAMED: usize = 10;

const KINDS: [Kind; 4] = [
    Kind::ManifestWorkReplicaSet,
    Kind::Placement,
    Kind::PlacementDecision,
    Kind::ManifestWork,
];

/// A ManifestWork of a replica set, as the controller needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkView {
    pub name: String,
    pub placement: String,
    pub spec: ManifestWorkSpec,
    pub generation: i64,
    pub conditions: Vec<Condition>,
    pub deleting: bool,
    /// A decommission of the cluster wrote its policy into the work's deleteOption
    /// (`flotilla.io/decommission`): the template's deleteOption must not overwrite it, or the
    /// agent could delete what the operator chose to orphan.
    pub decommissioning: bool,
}

impl WorkView {
    fn from_work(work: &ManifestWork) -> WorkView {
        WorkView {
            name: work.metadata.name.clone().unwrap_or_default(),
            placement: work
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(PLACEMENT_NAME_LABEL))
                .cloned()
                .unwrap_or_default(),
            spec: work.spec.clone(),
            generation: work.metadata.generation.unwrap_or(1),
            conditions: work.status.clone().unwrap_or_default().conditions,
            deleting: work.metadata.deletion_timestamp.is_some(),
            decommissioning: work
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(DECOMMISSION_ANNOTATION)),
        }
    }

    /// Whether the work is the template's, apart from a deleteOption a decommission set.
    fn is_of(&self, template: &ManifestWorkSpec) -> bool {
        if self.decommissioning {
            let mut spec = self.spec.clone();
            spec.delete_option = template.delete_option.clone();
            spec == *template
        } else {
            self.spec == *template
        }
    }
}

/// What the store holds that one replica set's plan reads.
pub struct Inputs<'a> {
    pub set: &'a ManifestWorkReplicaSet,
    /// Placements of the replica set's namespace by name.
    pub placements: &'a BTreeMap<String, Placement>,
    /// Each placement's selected clusters by decision group.
    pub groups: &'a BTreeMap<String, ClusterGroups>,
    /// The replica set's works by cluster.
    pub works: &'a BTreeMap<String, WorkView>,
    pub now: Timestamp,
}

/// One write a plan asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    AddFinalizer,
    RemoveFinalizer,
    /// Create or update the work in `cluster`'s namespace for `placement`.
    ApplyWork {
        cluster: String,
        placement: String,
        /// The controller's view holds a work of that name there: update it without trying a
        /// create first (which the store would refuse as existing).
        exists: bool,
    },
    DeleteWork {
        cluster: String,
        name: String,
    },
    Status(ManifestWorkReplicaSetStatus),
}

/// What to do for one replica set now, and when to look again.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    pub actions: Vec<Action>,
    pub recheck_at: Option<Timestamp>,
}

/// Decides for one replica set.
pub fn plan(inputs: &Inputs<'_>) -> Plan {
    let set = inputs.set;
    let mut plan = Plan::default();
    let finalizers = set.metadata.finalizers.clone().unwrap_or_default();
    let has_finalizer = finalizers.iter().any(|f| f == REPLICA_SET_FINALIZER);
    if set.metadata.deletion_timestamp.is_some() {
        for (cluster, w) in inputs.works {
            if !w.deleting {
                plan.actions.push(Action::DeleteWork {
                    cluster: cluster.clone(),
                    name: w.name.clone(),
                });
            }
        }
        let foreground =
            set.spec.cascade_deletion_policy == Some(CascadeDeletionPolicy::Foreground);
        if has_finalizer && (!foreground || inputs.works.is_empty()) {
            plan.actions.push(Action::RemoveFinalizer);
        }
        return plan;
    }
    if !has_finalizer {
        plan.actions.push(Action::AddFinalizer);
    }
    let now = inputs.now;
    let mut status = set.status.clone().unwrap_or_default();
    let template = &set.spec.manifest_work_template;
    let refs: BTreeSet<&str> = set
        .spec
        .placement_refs
        .iter()
        .map(|r| r.name.as_str())
        .collect();
    // Works of placements no longer referenced go.
    for (cluster, w) in inputs.works {
        if !refs.contains(w.placement.as_str()) && !w.deleting {
            plan.actions.push(Action::DeleteWork {
                cluster: cluster.clone(),
                name: w.name.clone(),
            });
        }
    }
    let mut summaries = Vec::new();
    let mut selected_total = 0usize;
    let mut existing_total = 0usize;
    let mut succeeded_total = 0usize;
    let mut stopped: Vec<(String, Vec<String>)> = Vec::new();
    let mut verified: Option<(&str, String)> = None;
    for r in &set.spec.placement_refs {
        let Some(placement) = inputs.placements.get(&r.name) else {
            set_verified(
                &mut status,
                "PlacementDecisionNotFound",
                format!("Placement {} not found", r.name),
                now,
            );
            plan.actions.push(Action::Status(status));
            return plan;
        };
        let strategy = match rollout::parse(r.rollout_strategy.as_ref()) {
            Ok(s) => s,
            Err(e) => {
                verified = Some((
                    "NotAsExpected",
                    format!("placement {}: rolloutStrategy {e}", r.name),
                ));
                continue;
            }
        };
        let empty = ClusterGroups::new();
        let groups = inputs.groups.get(&r.name).unwrap_or(&empty);
        let mut existing = BTreeSet::new();
        let mut statuses = Vec::new();
        let mut succeeded = 0;
        for (cluster, w) in inputs.works.iter().filter(|(_, w)| w.placement == r.name) {
            // A work of an older revision has not been reached by this one yet.
            if !w.is_of(template) || w.deleting {
                continue;
            }
            existing.insert(cluster.clone());
            let s = rollout::work_status(cluster, w.generation, &w.conditions);
            if s.status == Status::Succeeded {
                succeeded += 1;
            }
            statuses.push(s);
        }
        let result = rollout::rollout(&strategy, groups, &statuses, now);
        plan.recheck_at = [plan.recheck_at, result.recheck_at]
            .into_iter()
            .flatten()
            .min();
        for c in result
            .to_rollout
            .iter()
            .filter(|c| c.status == Status::ToApply)
        {
            // A cluster another placement of this set already serves keeps that work.
            if inputs
                .works
                .get(&c.cluster)
                .is_some_and(|w| w.placement != r.name && refs.contains(w.placement.as_str()))
            {
                continue;
            }
            // A work already the template's waits for its agent: writing it again changes
            // nothing (OCM's applier compares before it writes, too).
            let work = inputs.works.get(&c.cluster);
            let current =
                work.is_some_and(|w| w.placement == r.name && w.is_of(template) && !w.deleting);
            if !current {
                plan.actions.push(Action::ApplyWork {
                    cluster: c.cluster.clone(),
                    placement: r.name.clone(),
                    exists: work.is_some(),
                });
            }
            existing.insert(c.cluster.clone());
        }
        for c in &result.removed {
            if let Some(w) = inputs.works.get(&c.cluster).filter(|w| !w.deleting) {
                plan.actions.push(Action::DeleteWork {
                    cluster: c.cluster.clone(),
                    name: w.name.clone(),
                });
                existing.remove(&c.cluster);
            }
        }
        if result.max_failure_breach {
            let failed: Vec<String> = statuses
                .iter()
                .chain(&result.timed_out)
                .filter(|c| matches!(c.status, Status::Failed | Status::TimeOut))
                .map(|c| c.cluster.clone())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            stopped.push((r.name.clone(), failed));
        }
        let selected = placement
            .status
            .as_ref()
            .map_or(0, |s| s.number_of_selected_clusters.max(0) as usize);
        let group_count = placement
            .status
            .as_ref()
            .map_or(0, |s| s.decision_groups.len());
        summaries.push(PlacementSummary {
            name: r.name.clone(),
            available_decision_groups: format!(
                "{group_count} ({} / {selected} clusters applied)",
                existing.len()
            ),
            summary: ManifestWorkReplicaSetSummary {
                total: existing.len() as i32,
                ..Default::default()
            },
        });
        selected_total += selected;
        existing_total += existing.len();
        succeeded_total += succeeded;
    }
    status.placement_summary = summaries;
    status.summary = summary(
        inputs.works,
        existing_total,
        selected_total,
        succeeded_total,
    );
    match verified {
        Some((reason, message)) => set_verified(&mut status, reason, message, now),
        None if existing_total == 0 => {
            set_verified(&mut status, "PlacementDecisionEmpty", String::new(), now)
        }
        None => set_verified(&mut status, "AsExpected", String::new(), now),
    }
    let (rolled, reason, message) = if !stopped.is_empty() {
        let message = stopped
            .iter()
            .map(|(p, failed)| {
                let named: Vec<&str> = failed.iter().take(FAILED_NAMED).map(String::as_str).collect();
                let more = failed.len().saturating_sub(FAILED_NAMED);
                format!(
                    "rollout to placement {p} stopped: {} cluster(s) failed, more than maxFailures allows: {}{}",
                    failed.len(),
                    named.join(", "),
                    if more > 0 { format!(" and {more} more") } else { String::new() }
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        (false, REASON_MAX_FAILURES, message)
    } else if selected_total == succeeded_total {
        (true, "Complete", String::new())
    } else {
        (
            false,
            "Progressing",
            format!("{succeeded_total} of {selected_total} clusters succeeded"),
        )
    };
    set_condition(
        &mut status.conditions,
        PLACEMENT_ROLLED_OUT,
        ConditionStatus::from(rolled),
        reason,
        &message,
        None,
        Time(now),
    );
    let s = &status.summary;
    let (applied_status, applied_reason) = if s.total == 0 {
        let empty = find_condition(&status.conditions, PLACEMENT_VERIFIED)
            .is_some_and(|c| c.reason == "PlacementDecisionEmpty");
        (
            false,
            if empty {
                "PlacementDecisionEmpty"
            } else {
                "NotAsExpected"
            },
        )
    } else if s.available == s.total && s.progressing == 0 && s.degraded == 0 {
        (true, "AsExpected")
    } else if s.progressing > 0 && s.degraded == 0 {
        (false, "Processing")
    } else {
        (false, "NotAsExpected")
    };
    set_condition(
        &mut status.conditions,
        MANIFESTWORK_APPLIED,
        ConditionStatus::from(applied_status),
        applied_reason,
        "",
        None,
        Time(now),
    );
    if set.status.as_ref() != Some(&status) {
        plan.actions.push(Action::Status(status));
    }
    plan
}

fn set_verified(
    status: &mut ManifestWorkReplicaSetStatus,
    reason: &str,
    message: String,
    now: Timestamp,
) {
    set_condition(
        &mut status.conditions,
        PLACEMENT_VERIFIED,
        ConditionStatus::from(reason == "AsExpected"),
        reason,
        &message,
        None,
        Time(now),
    );
}

/// Counts over the replica set's works (any revision, not being deleted), as OCM's summary.
fn summary(
    works: &BTreeMap<String, WorkView>,
    total: usize,
    selected: usize,
    succeeded: usize,
) -> ManifestWorkReplicaSetSummary {
    let mut s = ManifestWorkReplicaSetSummary {
        total: total as i32,
        desired_total: selected as i32,
        updated: succeeded as i32,
        ..Default::default()
    };
    for w in works.values().filter(|w| !w.deleting) {
        let count = |t: &str| i32::from(is_condition_true(&w.conditions, t));
        s.applied += count(WORK_APPLIED);
        s.available += count(WORK_AVAILABLE);
        s.degraded += count(WORK_DEGRADED);
        s.progressing += count(WORK_PROGRESSING);
    }
    s
}

// ---- the driver ----

#[derive(Default)]
struct Model {
    sets: BTreeMap<Key, ManifestWorkReplicaSet>,
    placements: BTreeMap<String, BTreeMap<String, Placement>>,
    /// Placement → decision object → (group, clusters).
    decisions: BTreeMap<Key, BTreeMap<String, (GroupKey, Vec<String>)>>,
    works: BTreeMap<Key, BTreeMap<String, WorkView>>,
    dirty: BTreeSet<Key>,
    rechecks: BTreeMap<Timestamp, BTreeSet<Key>>,
}

fn is_replica_set_work(o: &Object) -> bool {
    o.pointer(&format!(
        "/metadata/labels/{}",
        REPLICA_SET_LABEL.replace('/', "~1")
    ))
    .is_some()
}

pub async fn run(store: Arc<dyn Store>, config: ControllerConfig, stop: watch::Receiver<bool>) {
    let (tx, mut rx) = mpsc::channel(config.queue_capacity);
    let mut feeds = JoinSet::new();
    feed::spawn(
        store.clone(),
        &KINDS,
        Some((Kind::ManifestWork, is_replica_set_work as feed::Keep)),
        tx,
        stop.clone(),
        &mut feeds,
    );
    let mut model = Model::default();
    let mut known = Known::default();
    let mut readiness = Readiness::new(&KINDS);
    let mut stop_wait = stop.clone();
    loop {
        let next = model.rechecks.keys().next().copied();
        tokio::select! {
            u = rx.recv() => match u {
                Some(u) => feed::absorb(u, &mut readiness, &mut known, |k, e| model.apply(k, e)),
                None => break,
            },
            _ = delay_until(next) => {
                let now = Timestamp::now();
                while let Some((&at, _)) = model.rechecks.iter().next() {
                    if at > now {
                        break;
                    }
                    let keys = model.rechecks.remove(&at).unwrap_or_default();
                    model.dirty.extend(keys);
                }
            }
            _ = stopped(&mut stop_wait) => break,
        }
        feed::absorb_waiting(&mut rx, config.batch, &mut readiness, &mut known, |k, e| {
            model.apply(k, e)
        });
        if !readiness.ready() {
            continue;
        }
        let now = Timestamp::now();
        let mut jobs = Vec::new();
        for key in std::mem::take(&mut model.dirty) {
            let Some(set) = model.sets.get(&key) else {
                continue;
            };
            let no_placements = BTreeMap::new();
            let no_works = BTreeMap::new();
            let groups: BTreeMap<String, ClusterGroups> = set
                .spec
                .placement_refs
                .iter()
                .map(|r| {
                    (
                        r.name.clone(),
                        model.groups(&Key::new(&key.namespace, &r.name)),
                    )
                })
                .collect();
            let p = plan(&Inputs {
                set,
                placements: model
                    .placements
                    .get(&key.namespace)
                    .unwrap_or(&no_placements),
                groups: &groups,
                works: model.works.get(&key).unwrap_or(&no_works),
                now,
            });
            if let Some(at) = p.recheck_at {
                model.rechecks.entry(at).or_default().insert(key.clone());
            }
            if !p.actions.is_empty() {
                jobs.push((key, set.clone(), p.actions));
            }
        }
        let results: Vec<(Key, Executed)> = futures::stream::iter(jobs)
            .map(|(key, set, actions)| {
                let store = store.clone();
                let shards = config.shards;
                async move {
                    let written = execute(store.as_ref(), &key, set, actions, shards).await;
                    (key, written)
                }
            })
            .buffer_unordered(config.write_concurrency)
            .collect()
            .await;
        for (key, written) in results {
            // The works written are as stored now, before the watch shows them.
            model.wrote_works(&key, written.works);
            match written.set {
                // The status written is the replica set as stored now.
                Some(set) => {
                    model.sets.insert(key, set);
                }
                None => {
                    // Something failed: look again shortly (the error is logged).
                    let at = now + jiff::SignedDuration::from_secs(2);
                    model.rechecks.entry(at).or_default().insert(key);
                }
            }
        }
    }
    feeds.shutdown().await;
}

impl Model {
    /// Takes the works this controller wrote into its view, so that a plan made before the
    /// watch shows them does not apply them again. The watch's event for each write comes
    /// later and replaces the view with the same work.
    fn wrote_works(&mut self, key: &Key, written: Vec<(String, Object)>) {
        for (cluster, obj) in written {
            if let Ok(w) = serde_json::from_value::<ManifestWork>(obj) {
                self.works
                    .entry(key.clone())
                    .or_default()
                    .insert(cluster, WorkView::from_work(&w));
            }
        }
    }

    fn groups(&self, placement: &Key) -> ClusterGroups {
        let mut groups = ClusterGroups::new();
        for (group, clusters) in self
            .decisions
            .get(placement)
            .into_iter()
            .flat_map(BTreeMap::values)
        {
            groups
                .entry(group.clone())
                .or_default()
                .extend(clusters.iter().cloned());
        }
        groups
    }

    /// Replica sets in `namespace` that reference `placement`.
    fn dirty_for_placement(&mut self, namespace: &str, placement: &str) {
        let keys: Vec<Key> = self
            .sets
            .iter()
            .filter(|(k, s)| {
                k.namespace == namespace
                    && s.spec.placement_refs.iter().any(|r| r.name == placement)
            })
            .map(|(k, _)| k.clone())
            .collect();
        self.dirty.extend(keys);
    }

    fn apply(&mut self, kind: Kind, event: WatchEvent) {
        let deleted = matches!(event, WatchEvent::Deleted(_));
        let obj = event.into_object();
        let ns = namespace_of(&obj).unwrap_or_default().to_string();
        let name = name_of(&obj).to_string();
        match kind {
            Kind::ManifestWorkReplicaSet => {
                let key = Key::new(&ns, &name);
                if deleted {
                    self.sets.remove(&key);
                } else if let Ok(set) = serde_json::from_value::<ManifestWorkReplicaSet>(obj) {
                    self.sets.insert(key.clone(), set);
                    self.dirty.insert(key);
                } else {
                    warn!(replica_set = %key, "stored ManifestWorkReplicaSet does not parse; left alone");
                }
            }
            Kind::Placement => {
                let placements = self.placements.entry(ns.clone()).or_default();
                if deleted {
                    placements.remove(&name);
                } else if let Ok(p) = serde_json::from_value::<Placement>(obj) {
                    placements.insert(name.clone(), p);
                }
                self.dirty_for_placement(&ns, &name);
            }
            Kind::PlacementDecision => {
                let labels = obj["metadata"]["labels"].clone();
                let Some(placement) = labels[PLACEMENT_LABEL].as_str().map(str::to_string) else {
                    return;
                };
                let key = Key::new(&ns, &placement);
                if deleted {
                    if let Some(d) = self.decisions.get_mut(&key) {
                        d.remove(&name);
                    }
                } else if let Ok(d) = serde_json::from_value::<PlacementDecision>(obj) {
                    let group = GroupKey {
                        index: labels[DECISION_GROUP_INDEX_LABEL]
                            .as_str()
                            .and_then(|i| i.parse().ok())
                            .unwrap_or(0),
                        name: labels[DECISION_GROUP_NAME_LABEL]
                            .as_str()
                            .unwrap_or_default()
                            .to_string(),
                    };
                    let clusters = d
                        .status
                        .unwrap_or_default()
                        .decisions
                        .into_iter()
                        .map(|c| c.cluster_name)
                        .collect();
                    self.decisions
                        .entry(key)
                        .or_default()
                        .insert(name, (group, clusters));
                }
                self.dirty_for_placement(&ns, &placement);
            }
            Kind::ManifestWork => {
                let Some(owner) = obj
                    .pointer(&format!(
                        "/metadata/labels/{}",
                        REPLICA_SET_LABEL.replace('/', "~1")
                    ))
                    .and_then(Value::as_str)
                    .and_then(|v| v.split_once('.'))
                    .map(|(n, s)| Key::new(n, s))
                else {
                    // A work that lost its label: forget it wherever it was.
                    for works in self.works.values_mut() {
                        if works.get(&ns).is_some_and(|w| w.name == name) {
                            works.remove(&ns);
                        }
                    }
                    return;
                };
                let works = self.works.entry(owner.clone()).or_default();
                if deleted {
                    works.remove(&ns);
                } else if let Ok(w) = serde_json::from_value::<ManifestWork>(obj) {
                    works.insert(ns, WorkView::from_work(&w));
                }
                self.dirty.insert(owner);
            }
            _ => {}
        }
    }
}

/// What carrying out one replica set's actions left in the store.
struct Executed {
    /// The replica set as stored after them, or `None` if one failed.
    set: Option<ManifestWorkReplicaSet>,
    /// The works brought to the template, by cluster, as stored.
    works: Vec<(String, Object)>,
}

/// Carries out one replica set's actions.
async fn execute(
    store: &dyn Store,
    key: &Key,
    mut set: ManifestWorkReplicaSet,
    actions: Vec<Action>,
    shards: u32,
) -> Executed {
    let mut ok = true;
    let mut works = Vec::new();
    for action in actions {
        let result = match &action {
            Action::AddFinalizer | Action::RemoveFinalizer => {
                let add = action == Action::AddFinalizer;
                match set_finalizer(store, key, add).await {
                    Ok(Some(updated)) => {
                        set = updated;
                        Ok(())
                    }
                    Ok(None) => return Executed { set: None, works },
                    Err(e) => Err(e),
                }
            }
            Action::ApplyWork {
                cluster,
                placement,
                exists,
            } => match apply_work(store, key, &set, cluster, placement, *exists, shards).await {
                Ok(stored) => {
                    works.extend(stored.map(|w| (cluster.clone(), w)));
                    Ok(())
                }
                Err(e) => Err(e),
            },
            Action::DeleteWork { cluster, name } => {
                match store.delete(Kind::ManifestWork, Some(cluster), name).await {
                    Ok(()) | Err(StoreError::NotFound { .. }) => Ok(()),
                    Err(e) => Err(e),
                }
            }
            Action::Status(status) => {
                match store
                    .update_status(
                        Kind::ManifestWorkReplicaSet,
                        Some(&key.namespace),
                        &key.name,
                        serde_json::to_value(status).unwrap_or(Value::Null),
                        None,
                    )
                    .await
                {
                    Ok(obj) => {
                        if let Ok(s) = serde_json::from_value(obj) {
                            set = s;
                        }
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
        };
        if let Err(e) = result {
            if !matches!(e, StoreError::NotFound { .. }) {
                warn!(replica_set = %key, ?action, error = %error_chain(&e), "write failed; retrying shortly");
            }
            ok = false;
        }
    }
    Executed {
        set: ok.then_some(set),
        works,
    }
}

/// Adds or removes the replica set's finalizer on a fresh read, with its version as
/// precondition. `Ok(None)`: the replica set is gone.
async fn set_finalizer(
    store: &dyn Store,
    key: &Key,
    add: bool,
) -> Result<Option<ManifestWorkReplicaSet>, StoreError> {
    let Some(mut obj) = store
        .get(
            Kind::ManifestWorkReplicaSet,
            Some(&key.namespace),
            &key.name,
        )
        .await?
    else {
        return Ok(None);
    };
    let rv = Revision::of(&obj);
    let mut finalizers: Vec<String> = obj["metadata"]["finalizers"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|f| f.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    finalizers.retain(|f| f != REPLICA_SET_FINALIZER);
    if add {
        finalizers.push(REPLICA_SET_FINALIZER.to_string());
    }
    obj["metadata"]["finalizers"] = json!(finalizers);
    if let Some(rv) = rv {
        obj["metadata"]["resourceVersion"] = rv.as_str().into();
    }
    match store.update_spec(obj).await {
        Ok(updated) => {
            if !add {
                info!(replica_set = %key, "ManifestWorks deleted; finalizer removed");
            }
            Ok(serde_json::from_value(updated).ok())
        }
        // Deleted once the last finalizer went.
        Err(StoreError::NotFound { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Creates the replica set's work in `cluster`, or brings an existing one of this replica set
/// to the template. A work of that name that this replica set does not own is left alone.
/// Answers the work as stored once it is the template's (`None` when left alone), for the
/// controller's own view: the watch shows the write later, and a plan made before it would
/// otherwise apply the same work again (a create refused as existing, a read and a write).
async fn apply_work(
    store: &dyn Store,
    key: &Key,
    set: &ManifestWorkReplicaSet,
    cluster: &str,
    placement: &str,
    exists: bool,
    shards: u32,
) -> Result<Option<Object>, StoreError> {
    let owner = format!("{}.{}", key.namespace, key.name);
    let labels: BTreeMap<&str, &str> = [
        (REPLICA_SET_LABEL, owner.as_str()),
        (PLACEMENT_NAME_LABEL, placement),
    ]
    .into();
    let spec = serde_json::to_value(&set.spec.manifest_work_template).unwrap_or(Value::Null);
    let mut work = json!({
        "apiVersion": Kind::ManifestWork.api_version(),
        "kind": Kind::ManifestWork.name(),
        "metadata": { "name": key.name, "namespace": cluster, "labels": labels },
        "spec": spec,
    });
    // Labelled from the start: the gateway holding the cluster sees it without waiting for
    // the shard labeller.
    super::shard_labels::stamp(&mut work, shards);
    if !exists {
        // Held for its agent's cleanup from the start (no write when the agent acknowledges).
        let mut work = work.clone();
        super::with_cleanup_finalizer(&mut work);
        match store.create(work).await {
            Ok(created) => {
                debug!(replica_set = %key, cluster, "ManifestWork created");
                return Ok(Some(created));
            }
            Err(StoreError::AlreadyExists { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    let Some(mut existing) = store
        .get(Kind::ManifestWork, Some(cluster), &key.name)
        .await?
    else {
        // Deleted since the view saw it: looked at again shortly, when the view knows.
        return match exists {
            true => Err(StoreError::NotFound {
                kind: Kind::ManifestWork,
                namespace: Some(cluster.to_string()),
                name: key.name.clone(),
            }),
            false => Ok(None),
        };
    };
    if existing
        .pointer(&format!(
            "/metadata/labels/{}",
            REPLICA_SET_LABEL.replace('/', "~1")
        ))
        .and_then(Value::as_str)
        != Some(owner.as_str())
    {
        warn!(
            replica_set = %key,
            work = %format!("{cluster}/{}", key.name),
            "a ManifestWork of this name exists and belongs to no ManifestWorkReplicaSet of this name; left alone"
        );
        return Ok(None);
    }
    let labelled = existing["metadata"]["labels"][PLACEMENT_NAME_LABEL] == placement;
    let current = serde_json::from_value::<ManifestWork>(existing.clone())
        .is_ok_and(|w| WorkView::from_work(&w).is_of(&set.spec.manifest_work_template));
    if current && labelled {
        // Already the template: the plan was made before the watch showed it.
        return Ok(Some(existing));
    }
    let kept_delete_option = existing["metadata"]["annotations"]
        .get(DECOMMISSION_ANNOTATION)
        .is_some()
        .then(|| existing["spec"]["deleteOption"].take());
    existing["spec"] = spec;
    if let Some(option) = kept_delete_option {
        existing["spec"]["deleteOption"] = option;
    }
    existing["metadata"]["labels"][PLACEMENT_NAME_LABEL] = placement.into();
    let updated = store.update_spec(existing).await?;
    debug!(replica_set = %key, cluster, "ManifestWork updated to the template");
    Ok(Some(updated))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_proto::api::conditions::ConditionStatus;
    use serde_json::json;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + secs).unwrap()
    }

    fn set(strategy: serde_json::Value, finalized: bool) -> ManifestWorkReplicaSet {
        serde_json::from_value(json!({
            "apiVersion": "work.open-cluster-management.io/v1alpha1", "kind": "ManifestWorkReplicaSet",
            "metadata": { "name": "web", "namespace": "default",
                          "finalizers": if finalized { json!([REPLICA_SET_FINALIZER]) } else { json!([]) } },
            "spec": {
                "manifestWorkTemplate": { "workload": { "manifests": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "default"}}]}},
                "placementRefs": [{ "name": "p", "rolloutStrategy": strategy }],
            },
        }))
        .unwrap()
    }

    fn placement(selected: i32) -> Placement {
        serde_json::from_value(json!({
            "apiVersion": "cluster.open-cluster-management.io/v1beta1", "kind": "Placement",
            "metadata": { "name": "p", "namespace": "default" },
            "spec": {}, "status": { "numberOfSelectedClusters": selected, "decisionGroups": [{"decisionGroupIndex": 0, "clusterCount": selected}] },
        }))
        .unwrap()
    }

    fn work(set: &ManifestWorkReplicaSet, conditions: &[(&str, &str)]) -> WorkView {
        WorkView {
            name: "web".into(),
            placement: "p".into(),
            spec: set.spec.manifest_work_template.clone(),
            generation: 1,
            conditions: conditions
                .iter()
                .map(|(t, s)| Condition {
                    type_: t.to_string(),
                    status: s.to_string(),
                    reason: String::new(),
                    message: "spoke said no".into(),
                    observed_generation: Some(1),
                    last_transition_time: Time(at(0)),
                })
                .collect(),
            deleting: false,
            decommissioning: false,
        }
    }

    /// Works of `set` on c00.. that are Applied and Available.
    fn available_works(set: &ManifestWorkReplicaSet, n: usize) -> BTreeMap<String, WorkView> {
        (0..n)
            .map(|i| {
                (
                    format!("c{i:02}"),
                    work(set, &[("Applied", "True"), ("Available", "True")]),
                )
            })
            .collect()
    }

    fn plan_for(
        set: &ManifestWorkReplicaSet,
        clusters: usize,
        works: &BTreeMap<String, WorkView>,
        placement_exists: bool,
    ) -> Plan {
        let placements: BTreeMap<String, Placement> = if placement_exists {
            [("p".to_string(), placement(clusters as i32))].into()
        } else {
            BTreeMap::new()
        };
        let mut g = ClusterGroups::new();
        g.insert(
            GroupKey::default(),
            (0..clusters).map(|i| format!("c{i:02}")).collect(),
        );
        let groups: BTreeMap<String, ClusterGroups> = [("p".to_string(), g)].into();
        plan(&Inputs {
            set,
            placements: &placements,
            groups: &groups,
            works,
            now: at(100),
        })
    }

    fn applied(p: &Plan) -> Vec<String> {
        p.actions
            .iter()
            .filter_map(|a| match a {
                Action::ApplyWork { cluster, .. } => Some(cluster.clone()),
                _ => None,
            })
            .collect()
    }

    fn status(p: &Plan) -> ManifestWorkReplicaSetStatus {
        p.actions
            .iter()
            .find_map(|a| match a {
                Action::Status(s) => Some(s.clone()),
                _ => None,
            })
            .expect("a status")
    }

    #[test]
    fn a_new_replica_set_gets_its_finalizer_and_a_work_per_decided_cluster() {
        let s = set(json!({"type": "All"}), false);
        let p = plan_for(&s, 3, &BTreeMap::new(), true);
        assert_eq!(p.actions[0], Action::AddFinalizer);
        assert_eq!(applied(&p), ["c00", "c01", "c02"]);
        let st = status(&p);
        assert_eq!(st.summary.total, 3);
        assert_eq!(
            st.placement_summary[0].available_decision_groups,
            "1 (3 / 3 clusters applied)"
        );
    }

    #[test]
    fn a_work_already_the_templates_is_not_written_again_while_its_agent_applies_it() {
        let s = set(json!({"type": "All"}), true);
        // c00's agent has not said Applied yet; c01's work is of an older template.
        let mut works: BTreeMap<String, WorkView> = [("c00".to_string(), work(&s, &[]))].into();
        let mut older = work(&s, &[]);
        older.spec.delete_option =
            Some(serde_json::from_value(json!({"propagationPolicy": "Orphan"})).unwrap());
        works.insert("c01".into(), older);
        let p = plan_for(&s, 3, &works, true);
        assert_eq!(applied(&p), ["c01", "c02"]);
        let exists: Vec<bool> = p
            .actions
            .iter()
            .filter_map(|a| match a {
                Action::ApplyWork { exists, .. } => Some(*exists),
                _ => None,
            })
            .collect();
        assert_eq!(
            exists,
            [true, false],
            "c01's is updated without a create first"
        );
        assert_eq!(
            status(&p).placement_summary[0].available_decision_groups,
            "1 (3 / 3 clusters applied)",
            "c00 still counts as rolled out to"
        );
    }

    #[test]
    fn a_delete_option_written_by_a_decommission_is_not_rolled_back() {
        let s = set(json!({"type": "All"}), true);
        let mut works = available_works(&s, 2);
        for w in works.values_mut() {
            w.spec.delete_option =
                Some(serde_json::from_value(json!({"propagationPolicy": "Orphan"})).unwrap());
        }
        // c00 is being decommissioned; c01's deleteOption was changed by hand.
        works.get_mut("c00").unwrap().decommissioning = true;
        let p = plan_for(&s, 2, &works, true);
        assert_eq!(applied(&p), ["c01"], "only the hand-made change is undone");
    }

    #[test]
    fn a_failing_cluster_stops_a_progressive_rollout_and_is_named() {
        let s = set(
            json!({"type": "Progressive", "progressive": {"maxConcurrency": 2, "maxFailures": 0}}),
            true,
        );
        let works: BTreeMap<String, WorkView> = [
            (
                "c00".to_string(),
                work(&s, &[("Applied", "True"), ("Available", "True")]),
            ),
            (
                "c01".to_string(),
                work(&s, &[("Applied", "False"), ("Degraded", "True")]),
            ),
        ]
        .into();
        let p = plan_for(&s, 6, &works, true);
        assert!(applied(&p).is_empty(), "stopped: {p:?}");
        let rolled = find_condition(&status(&p).conditions, PLACEMENT_ROLLED_OUT)
            .cloned()
            .unwrap();
        assert_eq!(rolled.status, ConditionStatus::False.as_str());
        assert_eq!(rolled.reason, REASON_MAX_FAILURES);
        assert!(rolled.message.contains("c01"), "{}", rolled.message);
        assert_eq!(status(&p).summary.degraded, 1);
    }

    #[test]
    fn a_complete_rollout_says_so() {
        let s = set(json!({"type": "All"}), true);
        let works = available_works(&s, 2);
        let p = plan_for(&s, 2, &works, true);
        let st = status(&p);
        assert!(is_condition_true(&st.conditions, PLACEMENT_ROLLED_OUT));
        assert!(is_condition_true(&st.conditions, MANIFESTWORK_APPLIED));
        assert!(is_condition_true(&st.conditions, PLACEMENT_VERIFIED));
    }

    #[test]
    fn a_missing_placement_is_reported() {
        let s = set(json!({"type": "All"}), true);
        let p = plan_for(&s, 2, &BTreeMap::new(), false);
        let verified = find_condition(&status(&p).conditions, PLACEMENT_VERIFIED)
            .cloned()
            .unwrap();
        assert_eq!(
            (verified.status.as_str(), verified.reason.as_str()),
            ("False", "PlacementDecisionNotFound")
        );
        assert!(applied(&p).is_empty());
    }

    #[test]
    fn deletion_removes_the_works_then_the_finalizer() {
        let mut s = set(json!({"type": "All"}), true);
        s.metadata.deletion_timestamp = Some(Time(at(50)));
        let works: BTreeMap<String, WorkView> = [("c00".to_string(), work(&s, &[]))].into();
        let p = plan_for(&s, 1, &works, true);
        assert_eq!(
            p.actions,
            [
                Action::DeleteWork {
                    cluster: "c00".into(),
                    name: "web".into()
                },
                Action::RemoveFinalizer,
            ]
        );
        // Foreground: the finalizer stays until the works are gone.
        s.spec.cascade_deletion_policy = Some(CascadeDeletionPolicy::Foreground);
        let p = plan_for(&s, 1, &works, true);
        assert_eq!(
            p.actions,
            [Action::DeleteWork {
                cluster: "c00".into(),
                name: "web".into()
            }]
        );
        let p = plan_for(&s, 1, &BTreeMap::new(), true);
        assert_eq!(p.actions, [Action::RemoveFinalizer]);
    }

    #[test]
    fn a_cluster_the_placement_dropped_loses_its_work() {
        let s = set(json!({"type": "All"}), true);
        let works = available_works(&s, 2);
        let p = plan_for(&s, 1, &works, true);
        assert!(p.actions.contains(&Action::DeleteWork {
            cluster: "c01".into(),
            name: "web".into()
        }));
    }

    /// The store as a controller sees it when its watch of ManifestWorks has fallen behind its
    /// own writes: no work ever arrives, and each create is told, in order, as `<cluster>`.
    struct WorksUnseen {
        inner: flotilla_store::SledStore,
        creates: mpsc::Sender<String>,
    }

    #[async_trait::async_trait]
    impl Store for WorksUnseen {
        async fn get(
            &self,
            kind: Kind,
            namespace: Option<&str>,
            name: &str,
        ) -> Result<Option<Object>, StoreError> {
            self.inner.get(kind, namespace, name).await
        }
        async fn list(
            &self,
            kind: Kind,
            namespace: Option<&str>,
        ) -> Result<flotilla_store::ObjectList, StoreError> {
            let mut list = self.inner.list(kind, namespace).await?;
            if kind == Kind::ManifestWork {
                list.items.clear();
            }
            Ok(list)
        }
        async fn watch(
            &self,
            kind: Kind,
            namespace: Option<&str>,
            from: Option<Revision>,
        ) -> Result<flotilla_store::WatchStream, StoreError> {
            if kind == Kind::ManifestWork {
                return Ok(futures::stream::pending().boxed());
            }
            self.inner.watch(kind, namespace, from).await
        }
        async fn list_selected(
            &self,
            kind: Kind,
            selection: &flotilla_store::Selection,
        ) -> Result<flotilla_store::ObjectList, StoreError> {
            let mut list = self.inner.list_selected(kind, selection).await?;
            if kind == Kind::ManifestWork {
                list.items.clear();
            }
            Ok(list)
        }
        async fn watch_selected(
            &self,
            kind: Kind,
            selection: &flotilla_store::Selection,
            from: Option<Revision>,
        ) -> Result<flotilla_store::WatchStream, StoreError> {
            if kind == Kind::ManifestWork {
                return Ok(futures::stream::pending().boxed());
            }
            self.inner.watch_selected(kind, selection, from).await
        }
        async fn create(&self, object: Object) -> Result<Object, StoreError> {
            if object["kind"] == Kind::ManifestWork.name() {
                let cluster = namespace_of(&object).unwrap_or_default().to_string();
                let _ = self.creates.send(cluster).await;
            }
            self.inner.create(object).await
        }
        async fn update_spec(&self, object: Object) -> Result<Object, StoreError> {
            self.inner.update_spec(object).await
        }
        async fn update_status(
            &self,
            kind: Kind,
            namespace: Option<&str>,
            name: &str,
            status: Value,
            expected: Option<&Revision>,
        ) -> Result<Object, StoreError> {
            self.inner
                .update_status(kind, namespace, name, status, expected)
                .await
        }
        async fn update_status_fenced(
            &self,
            kind: Kind,
            namespace: Option<&str>,
            name: &str,
            status: Value,
            fence: &flotilla_store::WriteFence,
            basis: Option<&flotilla_store::Basis>,
        ) -> Result<Object, StoreError> {
            self.inner
                .update_status_fenced(kind, namespace, name, status, fence, basis)
                .await
        }
        async fn update_spec_fenced(
            &self,
            object: Object,
            fence: &flotilla_store::WriteFence,
        ) -> Result<Object, StoreError> {
            self.inner.update_spec_fenced(object, fence).await
        }
        async fn delete(
            &self,
            kind: Kind,
            namespace: Option<&str>,
            name: &str,
        ) -> Result<(), StoreError> {
            self.inner.delete(kind, namespace, name).await
        }
        async fn ensure_namespace(&self, name: &str) -> Result<(), StoreError> {
            self.inner.ensure_namespace(name).await
        }
    }

    async fn decide(store: &dyn Store, clusters: &[&str]) {
        let decisions: Vec<Value> = clusters
            .iter()
            .map(|c| json!({ "clusterName": c, "reason": "" }))
            .collect();
        store
            .update_status(
                Kind::PlacementDecision,
                Some("default"),
                "p-decision-1",
                json!({ "decisions": decisions }),
                None,
            )
            .await
            .unwrap();
    }

    async fn next_create(creates: &mut mpsc::Receiver<String>) -> String {
        tokio::time::timeout(std::time::Duration::from_secs(60), creates.recv())
            .await
            .expect("a ManifestWork created within a minute")
            .expect("the store is still there")
    }

    /// A write the watch has not shown yet is not made again: with the works' watch behind,
    /// a cluster added to the placement gets its work, and the clusters that have theirs are
    /// not sent a second create (refused as existing), a read and a rewrite each.
    #[tokio::test]
    async fn works_written_and_not_yet_watched_are_not_applied_again() {
        let dir = tempfile::tempdir().unwrap();
        let (tx, mut creates) = mpsc::channel(64);
        let store = Arc::new(WorksUnseen {
            inner: flotilla_store::SledStore::open(dir.path()).unwrap(),
            creates: tx,
        });
        store
            .create(json!({
                "apiVersion": Kind::Placement.api_version(), "kind": "Placement",
                "metadata": { "name": "p", "namespace": "default" }, "spec": {},
            }))
            .await
            .unwrap();
        store
            .update_status(
                Kind::Placement,
                Some("default"),
                "p",
                json!({ "numberOfSelectedClusters": 4,
                        "decisionGroups": [{ "decisionGroupIndex": 0, "clusterCount": 4 }] }),
                None,
            )
            .await
            .unwrap();
        store
            .create(json!({
                "apiVersion": Kind::PlacementDecision.api_version(), "kind": "PlacementDecision",
                "metadata": { "name": "p-decision-1", "namespace": "default",
                              "labels": { PLACEMENT_LABEL: "p", DECISION_GROUP_INDEX_LABEL: "0" } },
            }))
            .await
            .unwrap();
        decide(store.as_ref(), &["c00", "c01", "c02"]).await;
        let mut web = serde_json::to_value(set(json!({ "type": "All" }), false)).unwrap();
        web["metadata"]["finalizers"] = json!([]);
        store.create(web).await.unwrap();
        let (stop_tx, stop) = watch::channel(false);
        let controller = tokio::spawn(run(store.clone(), ControllerConfig::default(), stop));

        let mut first = Vec::new();
        for _ in 0..3 {
            first.push(next_create(&mut creates).await);
        }
        first.sort();
        assert_eq!(first, ["c00", "c01", "c02"]);
        decide(store.as_ref(), &["c00", "c01", "c02", "c03"]).await;
        assert_eq!(
            next_create(&mut creates).await,
            "c03",
            "the next create is the new cluster's, not one the controller already made"
        );
        let works = store.inner.list(Kind::ManifestWork, None).await.unwrap();
        assert_eq!(works.items.len(), 4, "one work per cluster");
        for w in &works.items {
            assert_eq!(
                w["metadata"]["finalizers"],
                json!([flotilla_proto::contract::WORK_CLEANUP_FINALIZER]),
                "created held for its agent's cleanup: {w}"
            );
        }

        stop_tx.send(true).unwrap();
        controller.await.unwrap();
    }
}
