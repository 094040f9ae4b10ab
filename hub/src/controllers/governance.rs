//! Governance on the hub: which policies each cluster must carry, from PlacementBindings and
//! their Placements' decisions, written into the root Policies' and PolicySets' status.
//!
//! OCM's propagator resolves the same bindings and then copies each root Policy into every
//! selected cluster's namespace (`<cluster>/<namespace>.<name>`). flotilla does not: at 10,000
//! clusters × 100 policies that is a million objects in the hub's store, each written again on
//! every change of its root. The per-cluster set is kept in memory instead ([`PolicyAssignments`])
//! for the gateways' sessions to deliver, and the root Policy's `status.status[]` lists the
//! clusters it reaches (compliance on each is filled in by what the agents report).
//!
//! [`resolve`] decides for the whole fleet with no IO (tested here); [`policy_status`] and
//! [`policy_set_status`] turn the decision into the status each object should have, keeping
//! what the agents reported; the driver feeds them from the store's watches and writes only
//! the statuses that differ, each conditioned on the version it read.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use flotilla_ops::error_chain;
use flotilla_proto::api::policy::{
    CompliancePerClusterStatus, ComplianceState, PlacementBinding, Policy, PolicyPlacement,
    PolicySet, PolicySetStatus, PolicySetStatusPlacement, PolicyStatus, validate_policy,
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

const KINDS: [Kind; 4] = [
    Kind::Policy,
    Kind::PolicySet,
    Kind::PlacementBinding,
    Kind::PlacementDecision,
];

/// The kind a PlacementBinding's subject names, as OCM spells it.
const SUBJECT_POLICY: &str = "Policy";
const SUBJECT_POLICY_SET: &str = "PolicySet";

/// Per cluster, the root policies (`namespace/name`) it must carry.
pub type Assigned = BTreeMap<String, BTreeSet<Key>>;

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

/// The status a root Policy should have given where it is placed: `placement[]` from the
/// bindings, `status[]` one entry per cluster it reaches (sorted by name) with the compliance
/// a cluster already reported kept, and `compliant` aggregated from those entries. Anything
/// else in `current` is kept.
pub fn policy_status(current: Option<&PolicyStatus>, placed: &PolicyPlaced) -> PolicyStatus {
    let mut status = current.cloned().unwrap_or_default();
    let reported: BTreeMap<&str, Option<ComplianceState>> = status
        .status
        .iter()
        .map(|s| (s.clustername.as_str(), s.compliant))
        .collect();
    let entries: Vec<CompliancePerClusterStatus> = placed
        .clusters
        .iter()
        .map(|cluster| CompliancePerClusterStatus {
            compliant: reported.get(cluster.as_str()).copied().flatten(),
            clustername: cluster.clone(),
            clusternamespace: cluster.clone(),
        })
        .collect();
    status.compliant = aggregate(&entries);
    status.status = entries;
    status.placement = placed.placements.clone();
    status
}

/// OCM's root compliance: NonCompliant if any cluster is, else Pending if any is, else
/// Compliant once every cluster has reported Compliant; absent while some have not reported
/// (or none is selected).
pub fn aggregate(entries: &[CompliancePerClusterStatus]) -> Option<ComplianceState> {
    let states: Vec<Option<ComplianceState>> = entries.iter().map(|e| e.compliant).collect();
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

/// The status a PolicySet should have: its placements and message; its compliance is kept
/// (aggregated from its members' once agents report).
pub fn policy_set_status(current: Option<&PolicySetStatus>, placed: &SetPlaced) -> PolicySetStatus {
    let mut status = current.cloned().unwrap_or_default();
    status.placement = placed.placements.clone();
    status.status_message = placed.message.clone();
    status
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
    /// Something changed since the last resolution.
    dirty: bool,
    /// A write failed: resolve again then.
    retry_at: Option<Timestamp>,
}

/// Runs until `stop`: resolves every binding whenever what it reads changes, writes the
/// statuses that differ, and publishes each cluster's set to `assignments`.
pub async fn run(
    store: Arc<dyn Store>,
    config: ControllerConfig,
    assignments: PolicyAssignments,
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
            }
            _ = stopped(&mut stop_wait) => break,
        }
        feed::absorb_waiting(&mut rx, config.batch, &mut readiness, &mut known, |k, e| {
            model.apply(k, e)
        });
        if !readiness.ready() || !model.dirty {
            continue;
        }
        model.dirty = false;
        let decided: BTreeMap<Key, BTreeSet<String>> = model
            .decisions
            .iter()
            .map(|(k, d)| (k.clone(), d.values().flatten().cloned().collect()))
            .collect();
        let resolution = resolve(&Inputs {
            policies: &model.policies,
            invalid: &model.invalid,
            sets: &model.sets,
            bindings: &model.bindings,
            decided: &decided,
        });
        assignments.publish(resolution.assigned.clone());
        let mut writes = Vec::new();
        for (key, placed) in &resolution.policies {
            let Some(policy) = model.policies.get(key) else {
                continue;
            };
            let want = policy_status(policy.status.as_ref(), placed);
            if Some(&want) != policy.status.as_ref()
                && !(want == PolicyStatus::default() && policy.status.is_none())
            {
                writes.push((
                    Kind::Policy,
                    key.clone(),
                    serde_json::to_value(&want).unwrap_or(Value::Null),
                ));
            }
        }
        for (key, placed) in &resolution.sets {
            let Some(set) = model.sets.get(key) else {
                continue;
            };
            let want = policy_set_status(set.status.as_ref(), placed);
            if Some(&want) != set.status.as_ref()
                && !(want == PolicySetStatus::default() && set.status.is_none())
            {
                writes.push((
                    Kind::PolicySet,
                    key.clone(),
                    serde_json::to_value(&want).unwrap_or(Value::Null),
                ));
            }
        }
        let results: Vec<(Kind, Key, Result<Object, StoreError>)> = futures::stream::iter(writes)
            .map(|(kind, key, status)| {
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
                    (kind, key, result)
                }
            })
            .buffer_unordered(config.write_concurrency)
            .collect()
            .await;
        for (kind, key, result) in results {
            match result {
                // As stored now: the next resolution compares with it, not with the older copy.
                Ok(stored) => model.apply(kind, WatchEvent::Modified(stored)),
                // Deleted meanwhile: its watch event says so.
                Err(StoreError::NotFound { .. }) => {}
                Err(e) => {
                    if matches!(e, StoreError::Conflict { .. }) {
                        debug!(%kind, object = %key, "status changed meanwhile; resolving again");
                    } else {
                        warn!(%kind, object = %key, error = %error_chain(&e), "status write failed; retrying shortly");
                    }
                    model.retry_at = Some(Timestamp::now() + jiff::SignedDuration::from_secs(2));
                }
            }
        }
    }
    feeds.shutdown().await;
}

impl Model {
    fn apply(&mut self, kind: Kind, event: WatchEvent) {
        let deleted = matches!(event, WatchEvent::Deleted(_));
        let obj = event.into_object();
        let ns = namespace_of(&obj).unwrap_or_default().to_string();
        let name = name_of(&obj).to_string();
        let key = Key::new(&ns, &name);
        self.dirty = true;
        if deleted {
            self.versions.remove(&(kind, key.clone()));
        } else if let Some(version) = Revision::of(&obj) {
            self.versions.insert((kind, key.clone()), version);
        }
        match kind {
            Kind::Policy => {
                self.invalid.remove(&key);
                if deleted {
                    self.policies.remove(&key);
                    return;
                }
                match serde_json::from_value::<Policy>(obj.clone()) {
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

    #[test]
    fn status_keeps_reported_compliance_and_drops_clusters_no_longer_selected() {
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
        let status = policy_status(Some(&current), &placed);
        assert_eq!(
            status.status,
            [
                entry("c1", Some(ComplianceState::Compliant)),
                entry("c3", None)
            ]
        );
        // c2 (the non-compliant one) is gone and c3 has not reported.
        assert_eq!(status.compliant, None);
        assert_eq!(status.placement, placed.placements);
        // Written only on change: the same inputs give the same status.
        assert_eq!(policy_status(Some(&status), &placed), status);
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
}
