//! `status.conditions` of OCM's kinds: the condition types OCM uses, and the metav1 rules for
//! updating them.
//!
//! The rules are `k8s.io/apimachinery/pkg/api/meta.SetStatusCondition`'s: one condition per
//! type; `lastTransitionTime` moves only when `status` changes; reason, message and
//! observedGeneration are overwritten in place. Callers pass `now` in: nothing here reads a clock.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

// ManagedCluster (cluster.open-cluster-management.io/v1)

/// ManagedCluster: the hub admin accepted the cluster (`spec.hubAcceptsClient: true`).
pub const HUB_ACCEPTED_MANAGED_CLUSTER: &str = "HubAcceptedManagedCluster";
/// ManagedCluster: the hub admin denied the cluster (`spec.hubAcceptsClient: false` after a join request).
pub const HUB_DENIED_MANAGED_CLUSTER: &str = "HubDeniedManagedCluster";
/// ManagedCluster: the agent has joined (holds a hub-issued identity). The `JOINED` column.
pub const MANAGED_CLUSTER_JOINED: &str = "ManagedClusterJoined";
/// ManagedCluster: the agent is alive and its cluster healthy; `Unknown` once the session has been
/// gone past the grace period. The `AVAILABLE` column.
pub const MANAGED_CLUSTER_CONDITION_AVAILABLE: &str = "ManagedClusterConditionAvailable";

// ManifestWork (work.open-cluster-management.io/v1), on the work and on each manifest

/// ManifestWork / manifest: everything in the spec has been applied at the observed generation.
pub const WORK_APPLIED: &str = "Applied";
/// ManifestWork / manifest: the applied resources exist on the managed cluster.
pub const WORK_AVAILABLE: &str = "Available";
/// ManifestWork / manifest: the resources do not match the desired state for a while.
pub const WORK_DEGRADED: &str = "Degraded";
/// ManifestWork / manifest: the agent is applying the spec.
pub const WORK_PROGRESSING: &str = "Progressing";
/// ManifestWork / manifest: the resource finished (per its condition rules) and is no longer
/// updated; on the work, every manifest with a `Complete` rule is complete.
pub const WORK_COMPLETE: &str = "Complete";
/// ManifestWork: the agent is removing the work's resources after the work was deleted.
pub const WORK_DELETING: &str = "Deleting";
/// Manifest: the values asked for by the feedback rules were read (or why not).
pub const STATUS_FEEDBACK_SYNCED: &str = "StatusFeedbackSynced";

// Placement (cluster.open-cluster-management.io/v1beta1)

/// Placement: enough clusters were selected. The `SUCCEEDED` column.
pub const PLACEMENT_SATISFIED: &str = "PlacementSatisfied";
/// Placement: the spec cannot be evaluated (for example an unknown prioritizer).
pub const PLACEMENT_MISCONFIGURED: &str = "PlacementMisconfigured";

// ManagedClusterSet / ManagedClusterSetBinding (v1beta2)

/// ManagedClusterSet: no cluster belongs to the set. The `EMPTY` column.
pub const CLUSTER_SET_EMPTY: &str = "ClusterSetEmpty";
/// ManagedClusterSetBinding: the bound set exists.
pub const CLUSTER_SET_BOUND: &str = "Bound";

// ManifestWorkReplicaSet (work.open-cluster-management.io/v1alpha1)

/// ManifestWorkReplicaSet: the placements exist and selected clusters. The `FOUND` column.
pub const PLACEMENT_VERIFIED: &str = "PlacementVerified";
/// ManifestWorkReplicaSet: the rollout strategy has finished.
pub const PLACEMENT_ROLLED_OUT: &str = "PlacementRolledOut";
/// ManifestWorkReplicaSet: a ManifestWork exists for each selected cluster. OCM spells it with a
/// lower-case `w`. The `APPLIED` column.
pub const MANIFESTWORK_APPLIED: &str = "ManifestworkApplied";

/// The `status` of a condition, as metav1 spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConditionStatus {
    True,
    False,
    Unknown,
}

impl ConditionStatus {
    /// `"True"`, `"False"` or `"Unknown"`.
    pub fn as_str(self) -> &'static str {
        match self {
            ConditionStatus::True => "True",
            ConditionStatus::False => "False",
            ConditionStatus::Unknown => "Unknown",
        }
    }

    /// Parses metav1's spelling; anything else is `None`.
    pub fn parse(status: &str) -> Option<ConditionStatus> {
        match status {
            "True" => Some(ConditionStatus::True),
            "False" => Some(ConditionStatus::False),
            "Unknown" => Some(ConditionStatus::Unknown),
            _ => None,
        }
    }
}

impl From<bool> for ConditionStatus {
    fn from(value: bool) -> Self {
        if value {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        }
    }
}

impl std::fmt::Display for ConditionStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The condition of type `type_`, if present.
pub fn find_condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether the condition of type `type_` is present with status `True`.
pub fn is_condition_true(conditions: &[Condition], type_: &str) -> bool {
    find_condition(conditions, type_).is_some_and(|c| c.status == ConditionStatus::True.as_str())
}

/// Sets the condition of type `type_` with metav1 semantics and says whether anything changed.
///
/// A new condition gets `lastTransitionTime = now`. An existing one keeps its
/// `lastTransitionTime` unless `status` changes, so a heartbeat that re-asserts `Available=True`
/// changes nothing and need not be written back to the store (the return value is `false`).
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: ConditionStatus,
    reason: &str,
    message: &str,
    observed_generation: Option<i64>,
    now: Time,
) -> bool {
    let status = status.as_str();
    let Some(existing) = conditions.iter_mut().find(|c| c.type_ == type_) else {
        conditions.push(Condition {
            type_: type_.to_owned(),
            status: status.to_owned(),
            reason: reason.to_owned(),
            message: message.to_owned(),
            observed_generation,
            last_transition_time: now,
        });
        return true;
    };
    let mut changed = false;
    if existing.status != status {
        existing.status = status.to_owned();
        existing.last_transition_time = now;
        changed = true;
    }
    if existing.reason != reason {
        existing.reason = reason.to_owned();
        changed = true;
    }
    if existing.message != message {
        existing.message = message.to_owned();
        changed = true;
    }
    if existing.observed_generation != observed_generation {
        existing.observed_generation = observed_generation;
        changed = true;
    }
    changed
}

/// Removes the condition of type `type_`; says whether there was one.
pub fn remove_condition(conditions: &mut Vec<Condition>, type_: &str) -> bool {
    let before = conditions.len();
    conditions.retain(|c| c.type_ != type_);
    conditions.len() != before
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(rfc3339: &str) -> Time {
        Time(rfc3339.parse().expect("timestamp"))
    }

    #[test]
    fn a_new_condition_starts_its_transition_clock_now() {
        let mut conds = Vec::new();
        let changed = set_condition(
            &mut conds,
            WORK_APPLIED,
            ConditionStatus::True,
            "AppliedManifestWorkComplete",
            "Apply manifest work complete",
            Some(3),
            at("2024-01-01T00:00:00Z"),
        );
        assert!(changed);
        let c = find_condition(&conds, WORK_APPLIED).expect("set");
        assert_eq!(c.status, "True");
        assert_eq!(c.observed_generation, Some(3));
        assert_eq!(c.last_transition_time, at("2024-01-01T00:00:00Z"));
        assert!(is_condition_true(&conds, WORK_APPLIED));
        assert!(!is_condition_true(&conds, WORK_AVAILABLE));
    }

    #[test]
    fn status_string_round_trips() {
        for s in [
            ConditionStatus::True,
            ConditionStatus::False,
            ConditionStatus::Unknown,
        ] {
            assert_eq!(ConditionStatus::parse(s.as_str()), Some(s));
        }
        assert_eq!(ConditionStatus::parse("true"), None);
        assert_eq!(ConditionStatus::from(false), ConditionStatus::False);
    }

    #[test]
    fn remove_drops_only_that_type() {
        let mut conds = Vec::new();
        let now = at("2024-01-01T00:00:00Z");
        set_condition(
            &mut conds,
            WORK_APPLIED,
            ConditionStatus::True,
            "A",
            "",
            None,
            now.clone(),
        );
        set_condition(
            &mut conds,
            WORK_AVAILABLE,
            ConditionStatus::True,
            "B",
            "",
            None,
            now,
        );
        assert!(remove_condition(&mut conds, WORK_APPLIED));
        assert!(!remove_condition(&mut conds, WORK_APPLIED));
        assert_eq!(conds.len(), 1);
    }
}
