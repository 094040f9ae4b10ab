//! Governance on the hub: which policies each cluster must carry, from PlacementBindings and
//! their Placements' decisions, written into the root Policies' and PolicySets' status.
//!
//! OCM's propagator resolves the same bindings and then copies each root Policy into every
//! selected cluster's namespace (`<cluster>/<namespace>.<name>`). flotilla does not: at 10,000
//! clusters × 100 policies that is a million objects in the hub's store, each written again on
//! every change of its root. The per-cluster set is kept in memory instead ([`PolicyAssignments`])
//! for the gateways' sessions to deliver, and the root Policy's `status.status[]` lists the
//! clusters it reaches.
//!
//! What each cluster's agent reports is kept in one `ClusterCompliance` record per cluster (in
//! its namespace, named as it), written by the gateway of its shard. This controller creates a
//! cluster's record when the cluster carries its first policy and deletes it once the cluster
//! carries none and the record holds no report (so a report in flight is never lost), or once
//! the ManagedCluster is gone; and it aggregates the records into the roots' status.
//!
//! [`resolve`] decides for the whole fleet with no IO (tested here); [`policy_status`] and
//! [`policy_set_status`] turn the decision and the records into the status each object should
//! have; [`records_to_write`] says which records to create and delete; the driver feeds them
//! from the store's watches and writes only what differs, each status write conditioned on
//! the version it read.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use flotilla_ops::error_chain;
use flotilla_proto::api::policy::{
    ClusterCompliance, CompliancePerClusterStatus, ComplianceState, PlacementBinding, Policy,
    PolicyPlacement, PolicySet, PolicySetStatus, PolicySetStatusPlacement, PolicyStatus,
    empty_cluster_compliance, validate_policy,
};
use flotilla_proto::api::{Kind, PLACEMENT_LABEL, PlacementDecision};
use flotilla_store::{Object, Revision, Store, StoreError, WatchEvent, name_of, namespace_of};
use futures::StreamExt;
use jiff::Timestamp;
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tracing::{debug, warn};

use super::feed::{self, Known, Readiness};
use super::scheduling::fleet::Key;
use super::{ControllerConfig, delay_until, stopped};

const KINDS: [Kind; 6] = [
    Kind::Policy,
    Kind::PolicySet,
    Kind::PlacementBinding,
    Kind::PlacementDecision,
    Kind::ClusterCompliance,
    Kind::ManagedCluster,
];

/// The kind a PlacementBinding's subject names, as OCM spells it.
const SUBJECT_POLICY: &str = "Policy";
const SUBJECT_POLICY_SET: &str = "PolicySet";

/// Per cluster, the root policies (`namespace/name`) it must carry.
pub type Assigned = BTreeMap<String, BTreeSet<Key>>;

/// Per cluster that has a compliance record, what its agent reported: the compliance of each
/// root Policy by the root's uid (absent compliance: reported on, not yet evaluated).
pub type Reported = BTreeMap<String, BTreeMap<String, Option<ComplianceState>>>;

/// The per-cluster policy sets the controller keeps current, for whoever delivers them (the
/// gateways' sessions). Cloning shares it; readers never wait for the controller.
#[derive(Clone, Debug)]
pub struct PolicyAssignments {
    current: watch::Sender<Arc<Assigned>>,
}

impl Default for PolicyAssignments {
    fn default() -> Self {
        PolicyAssignments {
            current: watch::Sender::new(Arc::new(Assigned::new())),
        }
    }
}

impl PolicyAssignments {
    /// The root policies `cluster` must carry now, sorted; empty for a cluster no binding
    /// selects.
    pub fn for_cluster(&self, cluster: &str) -> Vec<Key> {
        self.current
            .borrow()
            .get(cluster)
            .map(|set| set.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Every cluster's set as one snapshot.
    pub fn snapshot(&self) -> Arc<Assigned> {
        self.current.borrow().clone()
    }

    /// A receiver told of every change, for a delivery loop to wait on.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Assigned>> {
        self.current.subscribe()
    }

    /// Publishes `assigned` if it differs from what readers have.
    fn publish(&self, assigned: Assigned) {
        self.current.send_if_modified(|current| {
            if **current == assigned {
                false
            } else {
                *current = Arc::new(assigned);
                true
            }
        });
    }
}

/// One enabled root Policy's compliance as the controller last aggregated it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RootCompliance {
    pub key: Key,
    /// The root's aggregate (`status.compliant`).
    pub compliant: Option<ComplianceState>,
    /// Each cluster the policy reaches, by name, with what that cluster reported. Shared:
    /// at 10,000 clusters a root's list is rebuilt only when its verdicts move, and each
    /// snapshot published shares the lists of the roots that did not.
    pub clusters: Arc<Vec<(String, Option<ComplianceState>)>>,
}

/// The fleet's compliance as the controller last aggregated it: every enabled root Policy,
/// sorted by namespace and name (a disabled one has no compliance to show, as in OCM).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ComplianceSnapshot {
    pub policies: Vec<RootCompliance>,
}

/// The compliance snapshot the controller keeps current, for the hub's metrics and status
/// page. Cloning shares it; readers never wait for the controller.
#[derive(Clone, Debug)]
pub struct ComplianceView {
    current: watch::Sender<Arc<ComplianceSnapshot>>,
}

impl Default for ComplianceView {
    fn default() -> Self {
        ComplianceView {
            current: watch::Sender::new(Arc::new(ComplianceSnapshot::default())),
        }
    }
}

impl ComplianceView {
    /// The latest snapshot.
    pub fn snapshot(&self) -> Arc<ComplianceSnapshot> {
        self.current.borrow().clone()
    }

    /// Publishes `snapshot` if it differs from what readers have.
    pub fn publish(&self, snapshot: ComplianceSnapshot) {
        self.current.send_if_modified(|current| {
            if **current == snapshot {
                false
            } else {
                *current = Arc::new(snapshot);
                true
            }
        });
    }
}

/// What resolution reads, as the store holds it.
pub struct Inputs<'a> {
    pub policies: &'a BTreeMap<Key, Policy>,
    /// Policies the hub will not deliver because they fail validation (applied around the
    /// operator API, e.g. with `kubectl` on the kube backend, whose CRD cannot check
    /// templates): placed and listed, never delivered.
    pub invalid: &'a BTreeSet<Key>,
    pub sets: &'a BTreeMap<Key, PolicySet>,
    pub bindings: &'a BTreeMap<Key, PlacementBinding>,
    /// Each Placement's decided clusters.
    pub decided: &'a BTreeMap<Key, BTreeSet<String>>,
}

/// Where one root policy is placed and which clusters it reaches.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyPlaced {
    /// Each binding (and set) that places it, sorted, without repeats.
    pub placements: Vec<PolicyPlacement>,
    /// The clusters it must reach: empty while it is disabled or invalid.
    pub clusters: BTreeSet<String>,
}

/// Where one PolicySet is placed, and what of it cannot be delivered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SetPlaced {
    pub placements: Vec<PolicySetStatusPlacement>,
    /// OCM's `statusMessage`: the member policies that do not exist or are disabled.
    pub message: String,
}

/// The whole fleet's governance placement.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resolution {
    /// Every stored Policy, placed or not (an unplaced one has empty lists).
    pub policies: BTreeMap<Key, PolicyPlaced>,
    /// Every stored PolicySet.
    pub sets: BTreeMap<Key, SetPlaced>,
    /// Per cluster, the policies it must carry.
    pub assigned: Assigned,
}

/// Resolves every binding: a Policy subject places that policy, a PolicySet subject places the
/// set and each of its policies (with the set's name in the policy's placement); a disabled or
/// invalid policy is placed but reaches no cluster. Subjects, sets' members and Placements
/// that do not exist place nothing (they may be applied later, in any order); bindings and
/// subjects live in one namespace, as in OCM.
pub fn resolve(inputs: &Inputs<'_>) -> Resolution {
    let mut out = Resolution {
        policies: inputs
            .policies
            .keys()
            .map(|k| (k.clone(), PolicyPlaced::default()))
            .collect(),
        sets: inputs
            .sets
            .keys()
            .map(|k| (k.clone(), SetPlaced::default()))
            .collect(),
        assigned: Assigned::new(),
    };
    let no_clusters = BTreeSet::new();
    for (binding_key, binding) in inputs.bindings {
        let ns = &binding_key.namespace;
        let placement = &binding.placement_ref.name;
        let clusters = inputs
            .decided
            .get(&Key::new(ns, placement))
            .unwrap_or(&no_clusters);
        let mut place = |policy: &str, set: &str| {
            let key = Key::new(ns, policy);
            let (Some(placed), Some(p)) = (out.policies.get_mut(&key), inputs.policies.get(&key))
            else {
                return;
            };
            placed.placements.push(PolicyPlacement {
                placement_binding: binding_key.name.clone(),
                placement: placement.clone(),
                policy_set: set.to_string(),
            });
            if !p.spec.disabled && !inputs.invalid.contains(&key) {
                placed.clusters.extend(clusters.iter().cloned());
            }
        };
        for subject in &binding.subjects {
            match subject.kind.as_str() {
                SUBJECT_POLICY => place(&subject.name, ""),
                SUBJECT_POLICY_SET => {
                    let set_key = Key::new(ns, &subject.name);
                    let Some(set) = inputs.sets.get(&set_key) else {
                        continue;
                    };
                    if let Some(placed) = out.sets.get_mut(&set_key) {
                        placed.placements.push(PolicySetStatusPlacement {
                            placement_binding: binding_key.name.clone(),
                            placement: placement.clone(),
                        });
                    }
                    for member in &set.spec.policies {
                        place(member, &subject.name);
                    }
                }
                // Refused at apply (and by the CRD's enum on the kube backend).
                _ => {}
            }
        }
    }
    for placed in out.policies.values_mut() {
        placed.placements.sort_by(|a, b| {
            (&a.placement_binding, &a.placement, &a.policy_set).cmp(&(
                &b.placement_binding,
                &b.placement,
                &b.policy_set,
            ))
        });
        placed.placements.dedup();
    }
    for (set_key, placed) in &mut out.sets {
        placed.placements.sort_by(|a, b| {
            (&a.placement_binding, &a.placement).cmp(&(&b.placement_binding, &b.placement))
        });
        placed.placements.dedup();
        if let Some(set) = inputs.sets.get(set_key) {
            placed.message = set_message(set_key, set, inputs);
        }
    }
    for (key, placed) in &out.policies {
        for cluster in &placed.clusters {
            out.assigned
                .entry(cluster.clone())
                .or_default()
                .insert(key.clone());
        }
    }
    out
}

/// OCM's PolicySet `statusMessage`: which members are missing or disabled; empty when all
/// are there and enabled.
fn set_message(set_key: &Key, set: &PolicySet, inputs: &Inputs<'_>) -> String {
    let mut deleted = Vec::new();
    let mut disabled = Vec::new();
    for member in &set.spec.policies {
        match inputs.policies.get(&Key::new(&set_key.namespace, member)) {
            None => deleted.push(member.as_str()),
            Some(p) if p.spec.disabled => disabled.push(member.as_str()),
            Some(_) => {}
        }
    }
    let mut parts = Vec::new();
    if !disabled.is_empty() {
        parts.push(format!("Disabled policies: {}", disabled.join(", ")));
    }
    if !deleted.is_empty() {
        parts.push(format!("Deleted policies: {}", deleted.join(", ")));
    }
    parts.join("; ")
}

/// The status a root Policy (whose `metadata.uid` is `uid`) should have given where it is
/// placed and what the clusters reported: `placement[]` from the bindings, `status[]` one entry
/// per cluster it reaches (sorted by name) with the compliance that cluster's record holds for
/// this uid, and `compliant` aggregated from those entries. A cluster the policy no longer
/// reaches is not listed and does not count, whatever its record still says; a report on a
/// policy deleted and created again under the same name (another uid) counts for nothing.
/// Anything else in `current` is kept.
pub fn policy_status(
    current: Option<&PolicyStatus>,
    placed: &PolicyPlaced,
    uid: &str,
    reported: &Reported,
) -> PolicyStatus {
    let mut status = current.cloned().unwrap_or_default();
    // Both sorted by cluster name: one pass over each rather than a lookup per cluster.
    let mut records = reported.iter().peekable();
    let entries: Vec<CompliancePerClusterStatus> = placed
        .clusters
        .iter()
        .map(|cluster| {
            while records
                .next_if(|(name, _)| name.as_str() < cluster.as_str())
                .is_some()
            {}
            let compliant = match records.peek() {
                Some((name, entries)) if *name == cluster => verdict(entries, uid),
                _ => None,
            };
            CompliancePerClusterStatus {
                compliant,
                clustername: cluster.clone(),
                clusternamespace: cluster.clone(),
            }
        })
        .collect();
    status.compliant = aggregate(&entries);
    status.status = entries;
    status.placement = placed.placements.clone();
    status
}

/// What `cluster` reported for the root with `uid`. `Terminating` (the agent is removing the
/// policy) is no verdict on a root, whose schema does not allow it: it counts as not reported.
fn reported_compliance(reported: &Reported, cluster: &str, uid: &str) -> Option<ComplianceState> {
    verdict(reported.get(cluster)?, uid)
}

/// What one cluster's record says of the root with `uid`; see [`reported_compliance`].
fn verdict(
    entries: &BTreeMap<String, Option<ComplianceState>>,
    uid: &str,
) -> Option<ComplianceState> {
    if uid.is_empty() {
        return None;
    }
    entries
        .get(uid)
        .copied()
        .flatten()
        .filter(|state| *state != ComplianceState::Terminating)
}

/// `current` (a status [`policy_status`] made: one entry per cluster, sorted by name) with the
/// verdicts of the `touched` clusters taken again from `reported`, and its aggregate; `None`
/// when none of them moved. What a round that only aggregates costs per root: the clusters
/// whose records changed, not every cluster the root reaches.
pub fn patch_status(
    current: &PolicyStatus,
    uid: &str,
    touched: &BTreeSet<String>,
    reported: &Reported,
) -> Option<PolicyStatus> {
    let now = |cluster: &str| reported_compliance(reported, cluster, uid);
    let moved: Vec<(usize, Option<ComplianceState>)> = if touched.len() < current.status.len() {
        touched
            .iter()
            .filter_map(|cluster| {
                let i = current
                    .status
                    .binary_search_by(|e| e.clustername.as_str().cmp(cluster))
                    .ok()?;
                Some((i, now(cluster)))
            })
            .filter(|(i, state)| current.status[*i].compliant != *state)
            .collect()
    } else {
        current
            .status
            .iter()
            .enumerate()
            .filter(|(_, e)| touched.contains(&e.clustername))
            .map(|(i, e)| (i, now(&e.clustername)))
            .filter(|(i, state)| current.status[*i].compliant != *state)
            .collect()
    };
    if moved.is_empty() {
        return None;
    }
    let mut status = current.clone();
    for (i, state) in moved {
        status.status[i].compliant = state;
    }
    status.compliant = aggregate(&status.status);
    Some(status)
}

/// OCM's root compliance: NonCompliant if any cluster is, else Pending if any is, else
/// Compliant once every cluster has reported Compliant; absent while some have not reported
/// (or none is selected).
pub fn aggregate(entries: &[CompliancePerClusterStatus]) -> Option<ComplianceState> {
    let states: Vec<Option<ComplianceState>> = entries.iter().map(|e| e.compliant).collect();
    aggregate_states(&states)
}

/// NonCompliant if any is, else Pending if any is, else Compliant when every one is; absent
/// while some has no verdict (or there are none).
fn aggregate_states(states: &[Option<ComplianceState>]) -> Option<ComplianceState> {
    if states.contains(&Some(ComplianceState::NonCompliant)) {
        Some(ComplianceState::NonCompliant)
    } else if states.contains(&Some(ComplianceState::Pending)) {
        Some(ComplianceState::Pending)
    } else if !states.is_empty()
        && states
            .iter()
            .all(|s| *s == Some(ComplianceState::Compliant))
    {
        Some(ComplianceState::Compliant)
    } else {
        None
    }
}

/// The status a PolicySet should have: its placements and message, and OCM's aggregate of its
/// members' compliance (`members`: the `status.compliant` each existing, enabled member
/// policy is to have; missing and disabled members are named in the message and do not
/// count): NonCompliant if any member is, else Pending if any is, else Compliant once every
/// member is; absent while some member has no verdict, or there is none.
pub fn policy_set_status(
    current: Option<&PolicySetStatus>,
    placed: &SetPlaced,
    members: &[Option<ComplianceState>],
) -> PolicySetStatus {
    let mut status = current.cloned().unwrap_or_default();
    status.placement = placed.placements.clone();
    status.status_message = placed.message.clone();
    status.compliant = aggregate_states(members);
    status
}

/// The compliance records to create and to delete, by cluster name (= namespace = record
/// name). A cluster that exists and carries at least one policy gets one; a record is deleted
/// when its cluster is gone, or when the cluster carries no policy and the record holds no
/// report (an entry still there is the gateway's to remove when the agent releases the policy:
/// deleting before that could lose a report written in between).
pub fn records_to_write(
    assigned: &Assigned,
    clusters: &BTreeSet<String>,
    reported: &Reported,
) -> (Vec<String>, Vec<String>) {
    let create = assigned
        .iter()
        .filter(|(cluster, policies)| {
            !policies.is_empty() && clusters.contains(*cluster) && !reported.contains_key(*cluster)
        })
        .map(|(cluster, _)| cluster.clone())
        .collect();
    let delete = reported
        .iter()
        .filter(|(cluster, entries)| {
            !clusters.contains(*cluster)
                || (entries.is_empty() && assigned.get(*cluster).is_none_or(BTreeSet::is_empty))
        })
        .map(|(cluster, _)| cluster.clone())
        .collect();
    (create, delete)
}

// ---- the driver ----

#[derive(Default)]
struct Model {
    policies: BTreeMap<Key, Policy>,
    /// The resourceVersion of each stored Policy and PolicySet, which its status write is
    /// conditioned on: a compliance report written meanwhile makes it a conflict, not a loss.
    versions: BTreeMap<(Kind, Key), Revision>,
    /// Policies that fail validation (written around the operator API): placed, not delivered.
    invalid: BTreeSet<Key>,
    sets: BTreeMap<Key, PolicySet>,
    bindings: BTreeMap<Key, PlacementBinding>,
    /// Placement → decision object → clusters.
    decisions: BTreeMap<Key, BTreeMap<String, Vec<String>>>,
    /// The stored ManagedClusters' names: only a cluster that exists has a compliance record.
    clusters: BTreeSet<String>,
    /// Each cluster's compliance record, as reported.
    reported: Reported,
    /// Something changed since the last resolution.
    dirty: bool,
    /// What changed is more than compliance: a policy's spec, a binding, a decision, a
    /// cluster. Resolved at once, since delivery waits on it.
    inputs_changed: bool,
    /// A change of compliance alone (a record, or a root's status as written) waits until then
    /// to be aggregated: see [`MIN_AGGREGATE_INTERVAL`].
    paced_until: Option<Timestamp>,
    /// A write failed: resolve again then.
    retry_at: Option<Timestamp>,
    /// The last resolution, kept for the rounds that only aggregate (nothing it reads moved).
    resolution: Resolution,
    /// Clusters whose reports changed since the last round: all a round that only
    /// aggregates looks at in each root.
    touched: BTreeSet<String>,
    /// Roots whose status someone else wrote since the last round: computed afresh.
    recheck: BTreeSet<Key>,
    /// The resourceVersion of each root status this controller wrote whose watch event has not
    /// come back yet: that event (a root of 10,000 entries is a megabyte of JSON) is not parsed
    /// back, and one of the same spec before it is older than the write and is dropped.
    written: BTreeMap<Key, Revision>,
    /// Each enabled root's compliance as last published.
    roots: BTreeMap<Key, RootCompliance>,
}

/// One round's outcome: the statuses to write (a root's also as a [`PolicyStatus`]), and the
/// fleet's compliance to publish.
struct Plan {
    writes: Vec<(Kind, Key, Value, Option<PolicyStatus>)>,
    snapshot: ComplianceSnapshot,
}

/// A status write's answer: the object as stored, and the root's status as written (`None`:
/// a PolicySet, taken in from the answer).
type Written = (Object, Option<PolicyStatus>);

/// The least time between two rounds that only aggregate compliance. Each round rewrites the
/// status of every root whose clusters' verdicts moved, and a root carries an entry per
/// cluster it reaches: at 1,000 clusters × 100 policies, with reports arriving all the time, a
/// round per batch of reports would rewrite megabytes a few times a second, taking the
/// store's writes and the gateways' CPU from the reports themselves.
pub const MIN_AGGREGATE_INTERVAL: Duration = Duration::from_secs(1);
/// Such rounds are also spaced by this many times the last round's own duration, so that
/// aggregating takes at most a fifth of the controller's time however large the fleet.
pub const AGGREGATE_PACE: u32 = 4;

/// Runs until `stop`: resolves every binding whenever what it reads changes, writes the
/// statuses that differ, publishes each cluster's set to `assignments` and the fleet's
/// compliance to `compliance`.
pub async fn run(
    store: Arc<dyn Store>,
    config: ControllerConfig,
    assignments: PolicyAssignments,
    compliance: ComplianceView,
    stop: watch::Receiver<bool>,
) {
    let (tx, mut rx) = mpsc::channel(config.queue_capacity);
    let mut feeds = JoinSet::new();
    feed::spawn(store.clone(), &KINDS, None, tx, stop.clone(), &mut feeds);
    let mut model = Model::default();
    let mut known = Known::default();
    let mut readiness = Readiness::new(&KINDS);
    let mut stop_wait = stop.clone();
    loop {
        tokio::select! {
            u = rx.recv() => match u {
                Some(u) => feed::absorb(u, &mut readiness, &mut known, |k, e| model.apply(k, e)),
                None => break,
            },
            _ = delay_until(model.retry_at) => {
                model.retry_at = None;
                model.dirty = true;
                model.inputs_changed = true;
            }
            _ = delay_until(model.paced_until), if model.dirty => {
                model.paced_until = None;
            }
            _ = stopped(&mut stop_wait) => break,
        }
        feed::absorb_waiting(&mut rx, config.batch, &mut readiness, &mut known, |k, e| {
            model.apply(k, e)
        });
        if !readiness.ready() || !model.dirty {
            continue;
        }
        if !model.inputs_changed
            && model
                .paced_until
                .is_some_and(|until| Timestamp::now() < until)
        {
            continue;
        }
        let round = tokio::time::Instant::now();
        let full = model.inputs_changed;
        model.dirty = false;
        model.inputs_changed = false;
        let planned = tokio::task::spawn_blocking({
            let assignments = assignments.clone();
            move || {
                let plan = model.plan(full, &assignments);
                (model, plan)
            }
        })
        .await;
        let planned_in = round.elapsed();
        let Plan { writes, snapshot } = match planned {
            Ok((planned, plan)) => {
                model = planned;
                plan
            }
            Err(e) => {
                warn!(error = %e, "a governance round failed; the controller stops and is started again");
                break;
            }
        };
        compliance.publish(snapshot);
        let status_writes = writes.len();
        let results: Vec<(Kind, Key, Result<Written, StoreError>)> = futures::stream::iter(writes)
            .map(|(kind, key, status, want)| {
                let store = store.clone();
                let expected = model.versions.get(&(kind, key.clone())).cloned();
                async move {
                    let result = store
                        .update_status(
                            kind,
                            Some(&key.namespace),
                            &key.name,
                            status,
                            expected.as_ref(),
                        )
                        .await;
                    (kind, key, result.map(|stored| (stored, want)))
                }
            })
            .buffer_unordered(config.write_concurrency)
            .collect()
            .await;
        let (create, delete) =
            records_to_write(&model.resolution.assigned, &model.clusters, &model.reported);
        let record_results: Vec<(String, Result<Option<Object>, StoreError>)> =
            futures::stream::iter(
                create
                    .into_iter()
                    .map(|c| (c, true))
                    .chain(delete.into_iter().map(|c| (c, false))),
            )
            .map(|(cluster, create)| {
                let store = store.clone();
                async move {
                    let result = if create {
                        let mut record = serde_json::to_value(empty_cluster_compliance(&cluster))
                            .unwrap_or(Value::Null);
                        super::shard_labels::stamp(&mut record, config.shards);
                        store.create(record).await.map(Some)
                    } else {
                        store
                            .delete(Kind::ClusterCompliance, Some(&cluster), &cluster)
                            .await
                            .map(|()| None)
                    };
                    (cluster, result)
                }
            })
            .buffer_unordered(config.write_concurrency)
            .collect()
            .await;
        for (cluster, result) in record_results {
            match result {
                Ok(Some(created)) => {
                    debug!(%cluster, "compliance record created");
                    model.apply(Kind::ClusterCompliance, WatchEvent::Modified(created));
                }
                Ok(None) => {
                    debug!(%cluster, "compliance record deleted");
                    model.reported.remove(&cluster);
                }
                // Made or removed meanwhile (e.g. by an earlier round whose event is on its
                // way): the watch brings it.
                Err(StoreError::AlreadyExists { .. } | StoreError::NotFound { .. }) => {}
                Err(e) => {
                    warn!(%cluster, error = %error_chain(&e), "writing the cluster's compliance record failed; retrying shortly");
                    model.retry_at = Some(Timestamp::now() + jiff::SignedDuration::from_secs(2));
                }
            }
        }
        let mut conflicted = Vec::new();
        for (kind, key, result) in results {
            match result {
                // As stored now: the next round compares with it, not with the older copy. A
                // root's status is taken from what was written rather than parsed back.
                Ok((stored, Some(want))) => model.wrote_root(&key, &stored, want),
                Ok((stored, None)) => model.apply(kind, WatchEvent::Modified(stored)),
                // Deleted meanwhile: its watch event says so.
                Err(StoreError::NotFound { .. }) => {}
                Err(e) => {
                    if matches!(e, StoreError::Conflict { .. }) {
                        debug!(%kind, object = %key, "status changed meanwhile; reading it again");
                        conflicted.push((kind, key));
                    } else {
                        warn!(%kind, object = %key, error = %error_chain(&e), "status write failed; retrying shortly");
                    }
                    model.retry_at = Some(Timestamp::now() + jiff::SignedDuration::from_secs(2));
                }
            }
        }
        // Refused because the version it was conditioned on is not the stored one: the next
        // write is conditioned on the object as read now, not on the watch bringing a newer
        // event (the change that made the conflict may be one whose event has already passed).
        for (kind, key) in conflicted {
            match store.get(kind, Some(&key.namespace), &key.name).await {
                Ok(Some(current)) => {
                    model.written.remove(&key);
                    model.apply(kind, WatchEvent::Modified(current));
                }
                Ok(None) => {}
                Err(e) => {
                    warn!(%kind, object = %key, error = %error_chain(&e), "reading an object whose status write was refused failed; retrying shortly");
                }
            }
        }
        let took = round.elapsed();
        if tracing::enabled!(tracing::Level::DEBUG) {
            let verdicts: usize = model
                .reported
                .values()
                .map(|entries| entries.values().filter(|v| v.is_some()).count())
                .sum();
            debug!(
                full,
                statuses_written = status_writes,
                planned_ms = planned_in.as_millis() as u64,
                took_ms = took.as_millis() as u64,
                records = model.reported.len(),
                verdicts,
                "governance round"
            );
        }
        let pause = MIN_AGGREGATE_INTERVAL.max(took * AGGREGATE_PACE);
        model.paced_until = jiff::SignedDuration::try_from(pause)
            .ok()
            .and_then(|pause| Timestamp::now().checked_add(pause).ok());
    }
    feeds.shutdown().await;
}

impl Model {
    /// What one round does, with no IO: resolves again when `full` (publishing each
    /// cluster's set), and returns the statuses to write and the compliance to publish. Run on
    /// the blocking pool: at 10,000 clusters × 100 policies a full round is a million
    /// (policy, cluster) pairs, which must not hold a worker the sessions and the operator API
    /// are served from.
    fn plan(&mut self, full: bool, assignments: &PolicyAssignments) -> Plan {
        if full {
            let decided: BTreeMap<Key, BTreeSet<String>> = self
                .decisions
                .iter()
                .map(|(k, d)| (k.clone(), d.values().flatten().cloned().collect()))
                .collect();
            self.resolution = resolve(&Inputs {
                policies: &self.policies,
                invalid: &self.invalid,
                sets: &self.sets,
                bindings: &self.bindings,
                decided: &decided,
            });
            assignments.publish(self.resolution.assigned.clone());
            self.roots
                .retain(|key, _| self.policies.get(key).is_some_and(|p| !p.spec.disabled));
        }
        let touched = std::mem::take(&mut self.touched);
        let recheck = std::mem::take(&mut self.recheck);
        let mut writes: Vec<(Kind, Key, Value, Option<PolicyStatus>)> = Vec::new();
        let mut wanted_compliance: BTreeMap<&Key, Option<ComplianceState>> = BTreeMap::new();
        for (key, placed) in &self.resolution.policies {
            let Some(policy) = self.policies.get(key) else {
                continue;
            };
            let uid = policy.metadata.uid.as_deref().unwrap_or_default();
            let want = match &policy.status {
                Some(current) if !full && !recheck.contains(key) => {
                    patch_status(current, uid, &touched, &self.reported)
                }
                current => Some(policy_status(current.as_ref(), placed, uid, &self.reported)),
            };
            let Some(want) = want else {
                wanted_compliance.insert(key, policy.status.as_ref().and_then(|s| s.compliant));
                continue;
            };
            wanted_compliance.insert(key, want.compliant);
            if !policy.spec.disabled {
                let clusters: Vec<(String, Option<ComplianceState>)> = want
                    .status
                    .iter()
                    .map(|c| (c.clustername.clone(), c.compliant))
                    .collect();
                let unchanged = self
                    .roots
                    .get(key)
                    .is_some_and(|r| r.compliant == want.compliant && *r.clusters == clusters);
                if !unchanged {
                    self.roots.insert(
                        key.clone(),
                        RootCompliance {
                            key: key.clone(),
                            compliant: want.compliant,
                            clusters: Arc::new(clusters),
                        },
                    );
                }
            }
            if Some(&want) != policy.status.as_ref()
                && !(want == PolicyStatus::default() && policy.status.is_none())
            {
                writes.push((
                    Kind::Policy,
                    key.clone(),
                    serde_json::to_value(&want).unwrap_or(Value::Null),
                    Some(want),
                ));
            }
        }
        for (key, placed) in &self.resolution.sets {
            let Some(set) = self.sets.get(key) else {
                continue;
            };
            let members: Vec<Option<ComplianceState>> = set
                .spec
                .policies
                .iter()
                .map(|member| Key::new(&key.namespace, member))
                .filter(|member| self.policies.get(member).is_some_and(|p| !p.spec.disabled))
                .map(|member| wanted_compliance.get(&member).copied().flatten())
                .collect();
            let want = policy_set_status(set.status.as_ref(), placed, &members);
            if Some(&want) != set.status.as_ref()
                && !(want == PolicySetStatus::default() && set.status.is_none())
            {
                writes.push((
                    Kind::PolicySet,
                    key.clone(),
                    serde_json::to_value(&want).unwrap_or(Value::Null),
                    None,
                ));
            }
        }
        let snapshot = ComplianceSnapshot {
            policies: self.roots.values().cloned().collect(),
        };
        Plan { writes, snapshot }
    }

    fn apply(&mut self, kind: Kind, event: WatchEvent) {
        let deleted = matches!(event, WatchEvent::Deleted(_));
        let obj = event.into_object();
        let ns = namespace_of(&obj).unwrap_or_default().to_string();
        let name = name_of(&obj).to_string();
        // A cluster's heartbeat or a record's fence alone changes nothing resolved here.
        match kind {
            Kind::ManagedCluster => {
                let changed = if deleted {
                    self.clusters.remove(&name)
                } else {
                    self.clusters.insert(name)
                };
                self.dirty |= changed;
                self.inputs_changed |= changed;
                return;
            }
            Kind::ClusterCompliance => {
                if self.apply_record(deleted, &ns, &name, obj) {
                    self.dirty = true;
                    self.touched.insert(name);
                }
                return;
            }
            _ => {}
        }
        let key = Key::new(&ns, &name);
        // A root's status written (by this controller, as it aggregates) leaves its generation
        // alone: only compliance moved, and the round that takes it in may wait its turn.
        let generation = |o: &Object| o["metadata"]["generation"].as_i64();
        if kind == Kind::Policy {
            if deleted {
                self.written.remove(&key);
            } else if let Some(written) = self.written.get(&key) {
                if Revision::of(&obj).as_ref() == Some(written) {
                    // This controller's own status write, already taken in by `wrote_root`.
                    self.written.remove(&key);
                    return;
                }
                // Another version of the same spec while that write's event is still on its
                // way: one the write followed (the kind's watch is ordered, and a write of
                // another's change after it would have been refused as a conflict), which
                // reached this queue after the write's answer did (another kind's event
                // started the round that wrote). Taken in, it would put back an older status
                // and the version the next write is conditioned on, and every write would
                // then be refused while the root's last event, this controller's own, is
                // skipped: its compliance would stay as it was.
                let same_spec = self.policies.get(&key).is_some_and(|old| {
                    old.metadata.uid.as_deref() == obj["metadata"]["uid"].as_str()
                        && old.metadata.generation == generation(&obj)
                });
                if same_spec {
                    return;
                }
            }
        }
        self.dirty = true;
        let status_only = !deleted
            && match kind {
                Kind::Policy => self.policies.get(&key).is_some_and(|old| {
                    old.metadata.uid.as_deref() == obj["metadata"]["uid"].as_str()
                        && old.metadata.generation == generation(&obj)
                }),
                Kind::PolicySet => self.sets.get(&key).is_some_and(|old| {
                    old.metadata.uid.as_deref() == obj["metadata"]["uid"].as_str()
                        && old.metadata.generation == generation(&obj)
                }),
                _ => false,
            };
        self.inputs_changed |= !status_only;
        if status_only && kind == Kind::Policy {
            self.recheck.insert(key.clone());
        }
        if matches!(kind, Kind::Policy | Kind::PolicySet) {
            if deleted {
                self.versions.remove(&(kind, key.clone()));
            } else if let Some(version) = Revision::of(&obj) {
                self.versions.insert((kind, key.clone()), version);
            }
        }
        match kind {
            Kind::Policy => {
                let was_invalid = self.invalid.remove(&key);
                if deleted {
                    self.policies.remove(&key);
                    return;
                }
                match serde_json::from_value::<Policy>(obj.clone()) {
                    Ok(policy) if status_only => {
                        // Validated when its spec was last taken in; it still holds.
                        if was_invalid {
                            self.invalid.insert(key.clone());
                        }
                        self.policies.insert(key, policy);
                    }
                    Ok(policy) => {
                        if let Err(errors) = validate_policy(&policy, Some(&obj)) {
                            let problems: Vec<String> =
                                errors.iter().map(ToString::to_string).collect();
                            warn!(policy = %key, problems = %problems.join("; "), "policy is invalid; placed but not delivered");
                            self.invalid.insert(key.clone());
                        }
                        self.policies.insert(key, policy);
                    }
                    Err(e) => {
                        warn!(policy = %key, error = %e, "stored Policy does not parse; left alone");
                        self.policies.remove(&key);
                    }
                }
            }
            Kind::PolicySet => {
                if deleted {
                    self.sets.remove(&key);
                } else if let Ok(set) = serde_json::from_value::<PolicySet>(obj) {
                    self.sets.insert(key, set);
                } else {
                    warn!(policy_set = %key, "stored PolicySet does not parse; left alone");
                }
            }
            Kind::PlacementBinding => {
                if deleted {
                    self.bindings.remove(&key);
                } else if let Ok(binding) = serde_json::from_value::<PlacementBinding>(obj) {
                    self.bindings.insert(key, binding);
                } else {
                    warn!(binding = %key, "stored PlacementBinding does not parse; left alone");
                }
            }
            Kind::PlacementDecision => {
                let Some(placement) = obj["metadata"]["labels"][PLACEMENT_LABEL]
                    .as_str()
                    .map(str::to_string)
                else {
                    return;
                };
                let placement = Key::new(&ns, &placement);
                if deleted {
                    if let Some(d) = self.decisions.get_mut(&placement) {
                        d.remove(&name);
                    }
                } else if let Ok(d) = serde_json::from_value::<PlacementDecision>(obj) {
                    let clusters = d
                        .status
                        .unwrap_or_default()
                        .decisions
                        .into_iter()
                        .map(|c| c.cluster_name)
                        .collect();
                    self.decisions
                        .entry(placement)
                        .or_default()
                        .insert(name, clusters);
                }
            }
            _ => {}
        }
    }

    /// Takes in the status this controller wrote to the root `key`, as the store answered.
    fn wrote_root(&mut self, key: &Key, stored: &Object, status: PolicyStatus) {
        let Some(revision) = Revision::of(stored) else {
            return;
        };
        let Some(policy) = self.policies.get_mut(key) else {
            return;
        };
        if policy.metadata.uid.as_deref() != stored["metadata"]["uid"].as_str() {
            return;
        }
        policy.status = Some(status);
        self.versions
            .insert((Kind::Policy, key.clone()), revision.clone());
        self.written.insert(key.clone(), revision);
    }

    /// Takes in a cluster's record; true when what it reports (or its existence) changed.
    fn apply_record(&mut self, deleted: bool, ns: &str, name: &str, obj: Object) -> bool {
        // One per cluster, named as its namespace: another name is no cluster's record.
        if ns != name {
            if !deleted {
                warn!(
                    namespace = ns,
                    name,
                    "a ClusterCompliance not named as its namespace is no cluster's record; ignored"
                );
            }
            return false;
        }
        if deleted {
            return self.reported.remove(name).is_some();
        }
        let record = match serde_json::from_value::<ClusterCompliance>(obj) {
            Ok(record) => record,
            Err(e) => {
                warn!(cluster = name, error = %e, "stored ClusterCompliance does not parse; its reports are not counted");
                return self.reported.remove(name).is_some();
            }
        };
        let entries: BTreeMap<String, Option<ComplianceState>> = record
            .status
            .unwrap_or_default()
            .policies
            .into_iter()
            .map(|p| (p.uid, p.compliant))
            .collect();
        self.reported.insert(name.to_owned(), entries.clone()) != Some(entries)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use flotilla_proto::api::policy::{PlacementSubject, PolicySetSpec, PolicySpec, Subject};
    use flotilla_store::SledStore;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use serde_json::json;

    use super::*;

    const NS: &str = "policies";

    fn meta(name: &str) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NS.into()),
            ..Default::default()
        }
    }

    fn policy(name: &str, disabled: bool) -> Policy {
        Policy {
            metadata: meta(name),
            spec: PolicySpec {
                disabled,
                ..Default::default()
            },
            status: None,
        }
    }

    fn set(name: &str, members: &[&str]) -> PolicySet {
        PolicySet {
            metadata: meta(name),
            spec: PolicySetSpec {
                description: String::new(),
                policies: members.iter().map(|m| m.to_string()).collect(),
            },
            status: None,
        }
    }

    fn binding(name: &str, placement: &str, subjects: &[(&str, &str)]) -> PlacementBinding {
        PlacementBinding {
            api_version: "policy.open-cluster-management.io/v1".into(),
            kind: "PlacementBinding".into(),
            metadata: meta(name),
            placement_ref: PlacementSubject {
                api_group: "cluster.open-cluster-management.io".into(),
                kind: "Placement".into(),
                name: placement.into(),
            },
            subjects: subjects
                .iter()
                .map(|(kind, name)| Subject {
                    api_group: "policy.open-cluster-management.io".into(),
                    kind: kind.to_string(),
                    name: name.to_string(),
                })
                .collect(),
        }
    }

    fn keyed<T: Clone>(items: &[(&str, T)]) -> BTreeMap<Key, T> {
        items
            .iter()
            .map(|(name, item)| (Key::new(NS, name), item.clone()))
            .collect()
    }

    fn decided(items: &[(&str, &[&str])]) -> BTreeMap<Key, BTreeSet<String>> {
        items
            .iter()
            .map(|(placement, clusters)| {
                (
                    Key::new(NS, placement),
                    clusters.iter().map(|c| c.to_string()).collect(),
                )
            })
            .collect()
    }

    struct Fleet {
        policies: BTreeMap<Key, Policy>,
        invalid: BTreeSet<Key>,
        sets: BTreeMap<Key, PolicySet>,
        bindings: BTreeMap<Key, PlacementBinding>,
        decided: BTreeMap<Key, BTreeSet<String>>,
    }

    impl Fleet {
        fn resolve(&self) -> Resolution {
            resolve(&Inputs {
                policies: &self.policies,
                invalid: &self.invalid,
                sets: &self.sets,
                bindings: &self.bindings,
                decided: &self.decided,
            })
        }
    }

    fn names(keys: &BTreeSet<Key>) -> Vec<&str> {
        keys.iter().map(|k| k.name.as_str()).collect()
    }

    fn clusters(r: &Resolution, policy: &str) -> Vec<String> {
        r.policies[&Key::new(NS, policy)]
            .clusters
            .iter()
            .cloned()
            .collect()
    }

    #[test]
    fn policies_and_sets_reach_the_clusters_their_placements_decided() {
        let fleet = Fleet {
            policies: keyed(&[
                ("namespace", policy("namespace", false)),
                ("rbac", policy("rbac", false)),
                ("limits", policy("limits", false)),
            ]),
            invalid: BTreeSet::new(),
            sets: keyed(&[("baseline", set("baseline", &["namespace", "rbac"]))]),
            bindings: keyed(&[
                (
                    "direct",
                    binding(
                        "direct",
                        "dev",
                        &[("Policy", "namespace"), ("Policy", "limits")],
                    ),
                ),
                (
                    "via-set",
                    binding("via-set", "prod", &[("PolicySet", "baseline")]),
                ),
            ]),
            decided: decided(&[("dev", &["c1", "c2"]), ("prod", &["c2", "c3"])]),
        };
        let r = fleet.resolve();
        // The namespace policy through both bindings; rbac only through the set.
        assert_eq!(clusters(&r, "namespace"), ["c1", "c2", "c3"]);
        assert_eq!(clusters(&r, "rbac"), ["c2", "c3"]);
        assert_eq!(clusters(&r, "limits"), ["c1", "c2"]);
        assert_eq!(names(&r.assigned["c1"]), ["limits", "namespace"]);
        assert_eq!(names(&r.assigned["c2"]), ["limits", "namespace", "rbac"]);
        assert_eq!(names(&r.assigned["c3"]), ["namespace", "rbac"]);
        let placements = &r.policies[&Key::new(NS, "namespace")].placements;
        assert_eq!(
            placements,
            &[
                PolicyPlacement {
                    placement_binding: "direct".into(),
                    placement: "dev".into(),
                    policy_set: String::new(),
                },
                PolicyPlacement {
                    placement_binding: "via-set".into(),
                    placement: "prod".into(),
                    policy_set: "baseline".into(),
                },
            ]
        );
        assert_eq!(
            r.sets[&Key::new(NS, "baseline")].placements,
            [PolicySetStatusPlacement {
                placement_binding: "via-set".into(),
                placement: "prod".into(),
            }]
        );
        assert_eq!(r.sets[&Key::new(NS, "baseline")].message, "");
    }

    #[test]
    fn disabled_and_invalid_policies_are_placed_but_reach_no_cluster() {
        let fleet = Fleet {
            policies: keyed(&[
                ("off", policy("off", true)),
                ("broken", policy("broken", false)),
                ("on", policy("on", false)),
            ]),
            invalid: [Key::new(NS, "broken")].into(),
            sets: keyed(&[("all", set("all", &["off", "broken", "on", "gone"]))]),
            bindings: keyed(&[("b", binding("b", "dev", &[("PolicySet", "all")]))]),
            decided: decided(&[("dev", &["c1"])]),
        };
        let r = fleet.resolve();
        assert!(clusters(&r, "off").is_empty());
        assert!(clusters(&r, "broken").is_empty());
        assert_eq!(clusters(&r, "on"), ["c1"]);
        assert_eq!(r.policies[&Key::new(NS, "off")].placements.len(), 1);
        assert_eq!(names(&r.assigned["c1"]), ["on"]);
        assert_eq!(
            r.sets[&Key::new(NS, "all")].message,
            "Disabled policies: off; Deleted policies: gone"
        );
    }

    #[test]
    fn missing_placements_subjects_and_other_namespaces_place_nothing() {
        let mut other = policy("namespace", false);
        other.metadata.namespace = Some("elsewhere".into());
        let mut policies = keyed(&[("namespace", policy("namespace", false))]);
        policies.insert(Key::new("elsewhere", "namespace"), other);
        let fleet = Fleet {
            policies,
            invalid: BTreeSet::new(),
            sets: BTreeMap::new(),
            bindings: keyed(&[
                (
                    "undecided",
                    binding("undecided", "nowhere", &[("Policy", "namespace")]),
                ),
                (
                    "ghost",
                    binding(
                        "ghost",
                        "dev",
                        &[("Policy", "ghost"), ("PolicySet", "none")],
                    ),
                ),
            ]),
            decided: decided(&[("dev", &["c1"])]),
        };
        let r = fleet.resolve();
        // Placed (the binding exists), but its Placement decided nothing.
        assert_eq!(r.policies[&Key::new(NS, "namespace")].placements.len(), 1);
        assert!(clusters(&r, "namespace").is_empty());
        // A policy of the same name in another namespace is not the binding's.
        assert_eq!(
            r.policies[&Key::new("elsewhere", "namespace")],
            PolicyPlaced::default()
        );
        assert!(r.assigned.is_empty());
        assert!(!r.policies.contains_key(&Key::new(NS, "ghost")));
    }

    /// A cluster's record in a test: (root uid, compliance) per entry.
    type Record<'a> = (&'a str, &'a [(&'a str, Option<ComplianceState>)]);

    fn reported(records: &[Record<'_>]) -> Reported {
        records
            .iter()
            .map(|(cluster, entries)| {
                (
                    cluster.to_string(),
                    entries
                        .iter()
                        .map(|(uid, c)| (uid.to_string(), *c))
                        .collect(),
                )
            })
            .collect()
    }

    #[test]
    fn status_takes_compliance_from_the_records_and_drops_clusters_no_longer_selected() {
        let entry =
            |cluster: &str, compliant: Option<ComplianceState>| CompliancePerClusterStatus {
                compliant,
                clustername: cluster.into(),
                clusternamespace: cluster.into(),
            };
        let current = PolicyStatus {
            status: vec![
                entry("c1", Some(ComplianceState::Compliant)),
                entry("c2", Some(ComplianceState::NonCompliant)),
            ],
            compliant: Some(ComplianceState::NonCompliant),
            ..Default::default()
        };
        let placed = PolicyPlaced {
            placements: vec![PolicyPlacement {
                placement_binding: "b".into(),
                placement: "p".into(),
                policy_set: String::new(),
            }],
            clusters: ["c1".to_string(), "c3".to_string()].into(),
        };
        // c1's record has this policy Compliant (and another, deleted policy of the same name
        // NonCompliant under its old uid); c2's record still holds its NonCompliant report, but
        // the placement dropped c2; c3 has reported nothing on it yet.
        let records = reported(&[
            (
                "c1",
                &[
                    ("uid-1", Some(ComplianceState::Compliant)),
                    ("uid-old", Some(ComplianceState::NonCompliant)),
                ],
            ),
            ("c2", &[("uid-1", Some(ComplianceState::NonCompliant))]),
            ("c3", &[("uid-other", Some(ComplianceState::NonCompliant))]),
        ]);
        let status = policy_status(Some(&current), &placed, "uid-1", &records);
        assert_eq!(
            status.status,
            [
                entry("c1", Some(ComplianceState::Compliant)),
                entry("c3", None)
            ]
        );
        // c2 (the non-compliant one) no longer counts and c3 has not reported.
        assert_eq!(status.compliant, None);
        assert_eq!(status.placement, placed.placements);
        // Written only on change: the same inputs give the same status.
        assert_eq!(
            policy_status(Some(&status), &placed, "uid-1", &records),
            status
        );
        // c3 reports NonCompliant, then everything Compliant; Terminating is no verdict.
        let mut records = records;
        records
            .get_mut("c3")
            .unwrap()
            .insert("uid-1".into(), Some(ComplianceState::NonCompliant));
        let status = policy_status(Some(&status), &placed, "uid-1", &records);
        assert_eq!(
            status.status[1],
            entry("c3", Some(ComplianceState::NonCompliant))
        );
        assert_eq!(status.compliant, Some(ComplianceState::NonCompliant));
        records
            .get_mut("c3")
            .unwrap()
            .insert("uid-1".into(), Some(ComplianceState::Compliant));
        let status = policy_status(Some(&status), &placed, "uid-1", &records);
        assert_eq!(status.compliant, Some(ComplianceState::Compliant));
        records
            .get_mut("c3")
            .unwrap()
            .insert("uid-1".into(), Some(ComplianceState::Terminating));
        let status = policy_status(Some(&status), &placed, "uid-1", &records);
        assert_eq!(status.status[1], entry("c3", None));
        assert_eq!(status.compliant, None);
        // A policy without a uid (never stored) matches no report.
        assert_eq!(
            policy_status(None, &placed, "", &records).status[0],
            entry("c1", None)
        );
    }

    #[test]
    fn a_round_that_only_aggregates_patches_the_clusters_whose_reports_moved() {
        use ComplianceState::*;
        let placed = PolicyPlaced {
            placements: vec![],
            clusters: ["c1", "c2", "c3"].map(String::from).into(),
        };
        let mut records = reported(&[
            ("c1", &[("uid-1", Some(Compliant))]),
            ("c2", &[("uid-1", Some(Compliant))]),
            ("c3", &[("uid-1", None)]),
        ]);
        let status = policy_status(None, &placed, "uid-1", &records);
        assert_eq!(status.compliant, None);
        let touched = |names: &[&str]| names.iter().map(|n| n.to_string()).collect();

        // Nothing moved for the clusters touched (c4 is not the root's): nothing to write.
        assert_eq!(
            patch_status(&status, "uid-1", &touched(&["c1", "c4"]), &records),
            None
        );
        // c3 reports: the patch is what a full computation gives, aggregate included, for
        // few clusters touched and for every one.
        records
            .get_mut("c3")
            .unwrap()
            .insert("uid-1".into(), Some(NonCompliant));
        let full = policy_status(Some(&status), &placed, "uid-1", &records);
        assert_eq!(full.compliant, Some(NonCompliant));
        for names in [&["c3"][..], &["c1", "c2", "c3", "c4"]] {
            assert_eq!(
                patch_status(&status, "uid-1", &touched(names), &records).as_ref(),
                Some(&full),
                "touched {names:?}"
            );
        }
        // A cluster whose record went counts as not reported.
        records.remove("c1");
        let patched = patch_status(&full, "uid-1", &touched(&["c1"]), &records).unwrap();
        assert_eq!(
            patched,
            policy_status(Some(&full), &placed, "uid-1", &records)
        );
        assert_eq!(patched.status[0].compliant, None);
    }

    #[test]
    fn a_set_aggregates_its_members_as_ocm() {
        use ComplianceState::*;
        let placed = SetPlaced::default();
        let of = |members: &[Option<ComplianceState>]| {
            policy_set_status(None, &placed, members).compliant
        };
        assert_eq!(of(&[]), None);
        assert_eq!(of(&[Some(Compliant), None]), None);
        assert_eq!(of(&[Some(Compliant), Some(Compliant)]), Some(Compliant));
        assert_eq!(of(&[Some(Compliant), Some(Pending), None]), Some(Pending));
        assert_eq!(
            of(&[None, Some(NonCompliant), Some(Pending)]),
            Some(NonCompliant)
        );
        // What was there is replaced: the members decide.
        let current = PolicySetStatus {
            compliant: Some(NonCompliant),
            ..Default::default()
        };
        assert_eq!(
            policy_set_status(Some(&current), &placed, &[Some(Compliant)]).compliant,
            Some(Compliant)
        );
    }

    #[test]
    fn records_follow_the_clusters_that_carry_policies() {
        let assigned: Assigned = [
            ("c1".to_string(), [Key::new(NS, "p")].into()),
            ("c2".to_string(), [Key::new(NS, "p")].into()),
            ("unregistered".to_string(), [Key::new(NS, "p")].into()),
        ]
        .into();
        let clusters: BTreeSet<String> = ["c1", "c2", "c3", "c4"].map(String::from).into();
        // c2 has its record already; c3 carries nothing now and its record is empty; c4
        // carries nothing but its record still holds a report (the gateway removes it when
        // the agent releases the policy); gone's cluster was deleted with a report left.
        let records = reported(&[
            ("c2", &[("uid-1", Some(ComplianceState::Compliant))]),
            ("c3", &[]),
            ("c4", &[("uid-1", Some(ComplianceState::NonCompliant))]),
            ("gone", &[("uid-1", None)]),
        ]);
        let (create, delete) = records_to_write(&assigned, &clusters, &records);
        assert_eq!(create, ["c1"], "not for a cluster that is not registered");
        assert_eq!(delete, ["c3", "gone"]);
        // Nothing to do once the records are as they should be.
        let settled = reported(&[
            ("c1", &[]),
            ("c2", &[("uid-1", Some(ComplianceState::Compliant))]),
            ("c4", &[]),
        ]);
        let (create, delete) = records_to_write(&assigned, &clusters, &settled);
        assert!(create.is_empty());
        assert_eq!(
            delete,
            ["c4"],
            "its last report released, c4 carries nothing"
        );
    }

    /// The controller writes a root's status in two rounds in a row, the second started by
    /// another kind's event before the first write's own event came back; that event, older
    /// than the second write, then arrives. Taken in, it would put back the first status and
    /// the version the next write is conditioned on, and with the root's last event (the
    /// second write's) skipped as this controller's own, every later write would be refused:
    /// the root's compliance would never move again.
    #[test]
    fn an_event_older_than_the_controllers_own_write_is_not_taken_in() {
        let key = Key::new(NS, "namespace");
        let stored = |revision: &str, status: Option<PolicyStatus>| {
            let mut p = policy("namespace", false);
            p.metadata.uid = Some("uid-1".into());
            p.metadata.generation = Some(1);
            p.metadata.resource_version = Some(revision.into());
            p.status = status;
            serde_json::to_value(p).unwrap()
        };
        let placed = |clusters: &[&str]| PolicyPlaced {
            placements: Vec::new(),
            clusters: clusters.iter().map(|c| c.to_string()).collect(),
        };
        let first = policy_status(None, &placed(&[]), "uid-1", &Reported::new());
        let second = policy_status(Some(&first), &placed(&["c1"]), "uid-1", &Reported::new());
        let version = |model: &Model| model.versions.get(&(Kind::Policy, key.clone())).cloned();
        let status = |model: &Model| model.policies[&key].status.clone();

        let mut model = Model::default();
        model.apply(Kind::Policy, WatchEvent::Added(stored("1", None)));
        model.wrote_root(&key, &stored("2", Some(first.clone())), first.clone());
        model.wrote_root(&key, &stored("3", Some(second.clone())), second.clone());
        model.dirty = false;

        model.apply(
            Kind::Policy,
            WatchEvent::Modified(stored("2", Some(first.clone()))),
        );
        assert_eq!(
            version(&model),
            Some(Revision::new("3")),
            "the next write is conditioned on the stored version"
        );
        assert_eq!(
            status(&model),
            Some(second.clone()),
            "the status written last is kept"
        );
        assert!(!model.dirty, "nothing to do again");

        // Its own write's event: already taken in. A change after it is anyone's, taken in.
        model.apply(
            Kind::Policy,
            WatchEvent::Modified(stored("3", Some(second.clone()))),
        );
        assert_eq!(version(&model), Some(Revision::new("3")));
        assert!(!model.dirty);
        let mut forged = second.clone();
        forged.compliant = Some(ComplianceState::Compliant);
        model.apply(
            Kind::Policy,
            WatchEvent::Modified(stored("4", Some(forged.clone()))),
        );
        assert_eq!(version(&model), Some(Revision::new("4")));
        assert_eq!(status(&model), Some(forged));
        assert!(
            model.dirty && model.recheck.contains(&key),
            "computed afresh next round"
        );
    }

    #[test]
    fn root_compliance_aggregates_as_ocm() {
        use ComplianceState::*;
        let of = |states: &[Option<ComplianceState>]| {
            aggregate(
                &states
                    .iter()
                    .map(|s| CompliancePerClusterStatus {
                        compliant: *s,
                        ..Default::default()
                    })
                    .collect::<Vec<_>>(),
            )
        };
        assert_eq!(of(&[]), None);
        assert_eq!(of(&[Some(Compliant), Some(Compliant)]), Some(Compliant));
        assert_eq!(of(&[Some(Compliant), None]), None);
        assert_eq!(of(&[Some(Compliant), Some(Pending), None]), Some(Pending));
        assert_eq!(of(&[Some(Pending), Some(NonCompliant)]), Some(NonCompliant));
    }

    async fn until<F: std::future::Future<Output = bool>>(
        what: &str,
        mut check: impl FnMut() -> F,
    ) {
        flotilla_testenv::wait_for(what, Duration::from_secs(20), || {
            let holds = check();
            async { anyhow::Ok(holds.await.then_some(())) }
        })
        .await
        .unwrap_or_else(|e| panic!("never: {e}"));
    }

    fn decision(placement: &str, clusters: &[&str]) -> Value {
        json!({
            "apiVersion": Kind::PlacementDecision.api_version(), "kind": "PlacementDecision",
            "metadata": {"name": format!("{placement}-decision-1"), "namespace": NS,
                         "labels": {PLACEMENT_LABEL: placement}},
            "status": {"decisions": clusters.iter().map(|c| json!({"clusterName": c, "reason": ""})).collect::<Vec<_>>()},
        })
    }

    async fn stored_status(store: &dyn Store, name: &str) -> Value {
        store
            .get(Kind::Policy, Some(NS), name)
            .await
            .unwrap()
            .map(|p| p["status"].clone())
            .unwrap_or(Value::Null)
    }

    fn listed(status: &Value) -> Vec<String> {
        status["status"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s["clustername"].as_str().map(str::to_string))
            .collect()
    }

    /// The controller on a real store: the root Policy's status follows the decisions, the
    /// per-cluster sets are published, and an unchanged status is not written again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_controller_writes_placement_and_follows_decisions() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        store
            .create(serde_json::to_value(policy("namespace", false)).unwrap())
            .await
            .unwrap();
        store
            .create(serde_json::to_value(binding("b", "dev", &[("Policy", "namespace")])).unwrap())
            .await
            .unwrap();
        // The scheduler writes decisions with their status; here, as it would.
        store.create(decision("dev", &[])).await.unwrap();
        store
            .update_status(
                Kind::PlacementDecision,
                Some(NS),
                "dev-decision-1",
                decision("dev", &["c1", "c2"])["status"].clone(),
                None,
            )
            .await
            .unwrap();
        let assignments = PolicyAssignments::default();
        let (stop_tx, stop) = watch::channel(false);
        let controller = tokio::spawn(run(
            store.clone(),
            ControllerConfig::default(),
            assignments.clone(),
            ComplianceView::default(),
            stop,
        ));
        until("the policy lists both decided clusters", || async {
            listed(&stored_status(store.as_ref(), "namespace").await) == ["c1", "c2"]
        })
        .await;
        let status = stored_status(store.as_ref(), "namespace").await;
        assert_eq!(
            status["placement"],
            json!([{"placementBinding": "b", "placement": "dev"}])
        );
        assert_eq!(status["status"][0]["clusternamespace"], "c1");
        assert!(status["status"][0].get("compliant").is_none(), "{status}");
        assert_eq!(assignments.for_cluster("c2"), [Key::new(NS, "namespace")]);
        assert!(assignments.for_cluster("c3").is_empty());
        let before = store
            .get(Kind::Policy, Some(NS), "namespace")
            .await
            .unwrap()
            .unwrap();
        // The placement drops c1: it leaves the status and its set.
        store
            .update_status(
                Kind::PlacementDecision,
                Some(NS),
                "dev-decision-1",
                decision("dev", &["c2"])["status"].clone(),
                None,
            )
            .await
            .unwrap();
        until("c1 leaves the policy's status", || async {
            listed(&stored_status(store.as_ref(), "namespace").await) == ["c2"]
        })
        .await;
        until("c1 carries no policy", || async {
            assignments.for_cluster("c1").is_empty()
        })
        .await;
        let after = store
            .get(Kind::Policy, Some(NS), "namespace")
            .await
            .unwrap()
            .unwrap();
        // Another policy placed after that write: the Policy watch brings the controller its
        // own write first, so once this one's status is written the controller has resolved
        // again after its own write, and must not have written the same status again.
        store
            .create(serde_json::to_value(policy("marker", false)).unwrap())
            .await
            .unwrap();
        store
            .create(
                serde_json::to_value(binding("marker", "dev", &[("Policy", "marker")])).unwrap(),
            )
            .await
            .unwrap();
        until("the marker policy is placed", || async {
            listed(&stored_status(store.as_ref(), "marker").await) == ["c2"]
        })
        .await;
        assert_ne!(
            flotilla_store::resource_version(&before),
            flotilla_store::resource_version(&after)
        );
        let _ = stop_tx.send(true);
        tokio::time::timeout(Duration::from_secs(10), controller)
            .await
            .expect("the controller stops when told")
            .unwrap();
        let last = store
            .get(Kind::Policy, Some(NS), "namespace")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            flotilla_store::resource_version(&after),
            flotilla_store::resource_version(&last),
            "the controller's own write comes back through its watch and is not written again"
        );
    }

    fn managed_cluster(name: &str) -> Value {
        json!({
            "apiVersion": Kind::ManagedCluster.api_version(), "kind": "ManagedCluster",
            "metadata": {"name": name}, "spec": {"hubAcceptsClient": true},
        })
    }

    async fn record(store: &dyn Store, cluster: &str) -> Option<Value> {
        store
            .get(Kind::ClusterCompliance, Some(cluster), cluster)
            .await
            .unwrap()
    }

    /// Writes `cluster`'s record as a gateway would: one entry per (policy, compliance).
    async fn report(store: &dyn Store, cluster: &str, entries: &[(&Value, &str)]) {
        let policies: Vec<Value> = entries
            .iter()
            .map(|(policy, compliant)| {
                json!({
                    "namespace": policy["metadata"]["namespace"],
                    "name": policy["metadata"]["name"],
                    "uid": policy["metadata"]["uid"],
                    "generation": policy["metadata"]["generation"],
                    "compliant": compliant,
                })
            })
            .collect();
        store
            .update_status(
                Kind::ClusterCompliance,
                Some(cluster),
                cluster,
                json!({ "policies": policies }),
                None,
            )
            .await
            .unwrap();
    }

    fn per_cluster(status: &Value) -> Vec<(String, Option<String>)> {
        status["status"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| {
                (
                    s["clustername"].as_str().unwrap_or_default().to_owned(),
                    s["compliant"].as_str().map(str::to_owned),
                )
            })
            .collect()
    }

    /// The controller on a real store: each cluster carrying a policy gets a labelled record;
    /// what the records report becomes the root's per-cluster and aggregate compliance, and the
    /// set's; a cluster the placement drops no longer counts; a record goes once its cluster
    /// carries nothing and it holds no report, or once its cluster is gone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_controller_keeps_records_and_aggregates_what_they_report() {
        use flotilla_proto::contract::{SHARD_LABEL, shard_label_value, shard_of};
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        for cluster in ["c1", "c2", "c3"] {
            store.create(managed_cluster(cluster)).await.unwrap();
        }
        let namespace_policy = store
            .create(serde_json::to_value(policy("namespace", false)).unwrap())
            .await
            .unwrap();
        store
            .create(serde_json::to_value(set("baseline", &["namespace"])).unwrap())
            .await
            .unwrap();
        store
            .create(
                serde_json::to_value(binding("b", "dev", &[("PolicySet", "baseline")])).unwrap(),
            )
            .await
            .unwrap();
        store.create(decision("dev", &[])).await.unwrap();
        store
            .update_status(
                Kind::PlacementDecision,
                Some(NS),
                "dev-decision-1",
                decision("dev", &["c1", "c2"])["status"].clone(),
                None,
            )
            .await
            .unwrap();
        let config = ControllerConfig::default();
        let shards = config.shards;
        let (stop_tx, stop) = watch::channel(false);
        let compliance = ComplianceView::default();
        let controller = tokio::spawn(run(
            store.clone(),
            config,
            PolicyAssignments::default(),
            compliance.clone(),
            stop,
        ));
        until("c1 and c2 have their records", || async {
            record(store.as_ref(), "c1").await.is_some()
                && record(store.as_ref(), "c2").await.is_some()
        })
        .await;
        let c1 = record(store.as_ref(), "c1").await.unwrap();
        assert_eq!(
            flotilla_store::label(&c1, SHARD_LABEL),
            Some(shard_label_value(shard_of("c1", shards)).as_str()),
            "the gateways select records by their shard"
        );
        assert!(
            record(store.as_ref(), "c3").await.is_none(),
            "c3 carries no policy"
        );

        report(store.as_ref(), "c1", &[(&namespace_policy, "NonCompliant")]).await;
        until("c1's report reaches the root", || async {
            let status = stored_status(store.as_ref(), "namespace").await;
            per_cluster(&status)
                == [
                    ("c1".to_owned(), Some("NonCompliant".to_owned())),
                    ("c2".to_owned(), None),
                ]
                && status["compliant"] == "NonCompliant"
        })
        .await;
        let set_compliance = || async {
            store
                .get(Kind::PolicySet, Some(NS), "baseline")
                .await
                .unwrap()
                .unwrap()["status"]["compliant"]
                .clone()
        };
        until("the set is NonCompliant", || async {
            set_compliance().await == "NonCompliant"
        })
        .await;
        // What the metrics and the status page read: published before the status is written.
        assert_eq!(
            compliance.snapshot().policies,
            [RootCompliance {
                key: Key::new(NS, "namespace"),
                compliant: Some(ComplianceState::NonCompliant),
                clusters: vec![
                    ("c1".into(), Some(ComplianceState::NonCompliant)),
                    ("c2".into(), None)
                ]
                .into(),
            }]
        );

        report(store.as_ref(), "c1", &[(&namespace_policy, "Compliant")]).await;
        report(store.as_ref(), "c2", &[(&namespace_policy, "Compliant")]).await;
        until(
            "every cluster Compliant, so the root and the set",
            || async {
                stored_status(store.as_ref(), "namespace").await["compliant"] == "Compliant"
                    && set_compliance().await == "Compliant"
            },
        )
        .await;

        // A status written by someone else is put back as the reports say.
        let mut forged = stored_status(store.as_ref(), "namespace").await;
        forged["compliant"] = json!("NonCompliant");
        forged["status"][0]["compliant"] = json!("NonCompliant");
        store
            .update_status(Kind::Policy, Some(NS), "namespace", forged, None)
            .await
            .unwrap();
        until("the forged status is put back", || async {
            let status = stored_status(store.as_ref(), "namespace").await;
            status["compliant"] == "Compliant"
                && per_cluster(&status)
                    .iter()
                    .all(|(_, c)| c.as_deref() == Some("Compliant"))
        })
        .await;

        // c2 reports NonCompliant, then the placement drops it: it no longer counts, and its
        // record stays while it holds the report.
        report(store.as_ref(), "c2", &[(&namespace_policy, "NonCompliant")]).await;
        until("c2 makes the root NonCompliant", || async {
            stored_status(store.as_ref(), "namespace").await["compliant"] == "NonCompliant"
        })
        .await;
        store
            .update_status(
                Kind::PlacementDecision,
                Some(NS),
                "dev-decision-1",
                decision("dev", &["c1"])["status"].clone(),
                None,
            )
            .await
            .unwrap();
        until("c2 leaves the root and no longer counts", || async {
            let status = stored_status(store.as_ref(), "namespace").await;
            per_cluster(&status) == [("c1".to_owned(), Some("Compliant".to_owned()))]
                && status["compliant"] == "Compliant"
        })
        .await;
        assert!(
            record(store.as_ref(), "c2").await.is_some(),
            "a record holding a report is not deleted"
        );
        // The agent releases the policy and the gateway removes its entry: the record goes.
        report(store.as_ref(), "c2", &[]).await;
        until("c2's empty record is deleted", || async {
            record(store.as_ref(), "c2").await.is_none()
        })
        .await;

        // c1's cluster is deleted: its record goes, report and all.
        store
            .delete(Kind::ManagedCluster, None, "c1")
            .await
            .unwrap();
        until("c1's record goes with its cluster", || async {
            record(store.as_ref(), "c1").await.is_none()
        })
        .await;

        let _ = stop_tx.send(true);
        tokio::time::timeout(Duration::from_secs(10), controller)
            .await
            .expect("the controller stops when told")
            .unwrap();
    }
}
