//! ManifestWork status as OCM's work agent shapes it, built from what applying a work did.
//!
//! `status.conditions` has `Applied`, `Progressing`, `Available` and `Degraded` with the
//! generation they were computed for, and one condition per type the manifests' condition rules
//! set (`Complete` among them); `status.resourceStatus.manifests[]` has one entry per manifest
//! (by ordinal) with its resolved `resourceMeta`, its own `Applied` and `Available` conditions,
//! its `statusFeedback` values with `StatusFeedbackSynced`, and its rule conditions. Building is
//! pure: the caller passes `now`, and [`carry_transition_times`] keeps the previous status's
//! `lastTransitionTime` wherever a condition's status did not change, so that an unchanged
//! status compares equal and is never sent twice.

use flotilla_proto::api::conditions::{
    ConditionStatus, STATUS_FEEDBACK_SYNCED, WORK_APPLIED, WORK_AVAILABLE, WORK_COMPLETE,
    WORK_DEGRADED, WORK_DELETING, WORK_PROGRESSING, set_condition,
};
use flotilla_proto::api::{
    ManifestCondition, ManifestResourceMeta, ManifestResourceStatus, ManifestWorkStatus,
    StatusFeedbackResult,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::apply::{Availability, ManifestOutcome};
use crate::condition_rules::{self, RULE_REASON_PREFIX};
use crate::feedback::{self, ObjectKind};

/// Longest condition message, in bytes: metav1 validation refuses longer ones (32 KiB).
pub const MAX_CONDITION_MESSAGE: usize = 32 * 1024;

/// The status of a work whose manifests were applied with these outcomes, for `generation`.
pub fn work_status(
    generation: i64,
    outcomes: &[ManifestOutcome],
    now: &Time,
) -> ManifestWorkStatus {
    let mut sorted: Vec<&ManifestOutcome> = outcomes.iter().collect();
    sorted.sort_by_key(|o| o.meta.ordinal);
    let total = sorted.len();

    let manifests: Vec<ManifestCondition> = sorted
        .iter()
        .map(|o| manifest_condition(o, generation, now))
        .collect();

    let failures: Vec<String> = sorted
        .iter()
        .filter_map(|o| {
            let failure = o.applied.as_ref().err()?;
            Some(format!("{}: {}", manifest_label(&o.meta), failure.message))
        })
        .collect();
    let missing = sorted
        .iter()
        .filter(|o| o.available == Availability::Missing)
        .count();
    let unknown = sorted
        .iter()
        .filter(|o| matches!(o.available, Availability::Unknown(_)))
        .count();

    let mut conditions = Vec::new();
    let generation = Some(generation);
    let mut set = |type_: &str, status: ConditionStatus, reason: &str, message: &str| {
        set_condition(
            &mut conditions,
            type_,
            status,
            reason,
            &bounded(message),
            generation,
            now.clone(),
        );
    };
    if failures.is_empty() {
        set(
            WORK_APPLIED,
            ConditionStatus::True,
            "AppliedManifestWorkComplete",
            "Apply manifest work complete",
        );
    } else {
        let message = format!(
            "Failed to apply manifest work: {} of {total} manifests failed",
            failures.len()
        );
        set(
            WORK_APPLIED,
            ConditionStatus::False,
            "AppliedManifestWorkFailed",
            &message,
        );
    }
    // Progressing: still applying or waiting for resources to exist; done (Completed) or
    // stopped by a failure (Failed) otherwise. OCM's reasons.
    if !failures.is_empty() {
        set(
            WORK_PROGRESSING,
            ConditionStatus::False,
            "Failed",
            &format!("{} of {total} manifests failed to apply", failures.len()),
        );
    } else if missing + unknown > 0 {
        set(
            WORK_PROGRESSING,
            ConditionStatus::True,
            "Applying",
            &format!(
                "{} of {total} resources are not available yet",
                missing + unknown
            ),
        );
    } else {
        set(
            WORK_PROGRESSING,
            ConditionStatus::False,
            "Completed",
            "All resources are applied and available",
        );
    }
    if missing > 0 {
        let message = format!("{missing} of {total} resources are not available");
        set(
            WORK_AVAILABLE,
            ConditionStatus::False,
            "ResourcesNotAvailable",
            &message,
        );
    } else if unknown > 0 {
        let message = format!("{unknown} of {total} resources have unknown status");
        set(
            WORK_AVAILABLE,
            ConditionStatus::Unknown,
            "ResourcesStatusUnknown",
            &message,
        );
    } else {
        set(
            WORK_AVAILABLE,
            ConditionStatus::True,
            "ResourcesAvailable",
            "All resources are available",
        );
    }
    if failures.is_empty() {
        set(
            WORK_DEGRADED,
            ConditionStatus::False,
            "ManifestsApplied",
            "All manifests are applied",
        );
    } else {
        set(
            WORK_DEGRADED,
            ConditionStatus::True,
            "ManifestsFailed",
            &failures.join("; "),
        );
    }
    for (type_, status, reason, message) in aggregate_rule_conditions(&manifests) {
        set(&type_, status, reason, &message);
    }
    ManifestWorkStatus {
        conditions,
        resource_status: ManifestResourceStatus { manifests },
        fence: None,
    }
}

/// Work conditions from the manifests' rule conditions, one per condition type: `True` when
/// every manifest with a rule for it is `True`, `False` when any is `False`, else `Unknown`.
/// `Complete` is OCM's: the work is complete when every completable manifest is.
fn aggregate_rule_conditions(
    manifests: &[ManifestCondition],
) -> Vec<(String, ConditionStatus, &'static str, String)> {
    let mut types: Vec<String> = Vec::new();
    for m in manifests {
        for c in &m.conditions {
            if c.reason.starts_with(RULE_REASON_PREFIX) && !types.contains(&c.type_) {
                types.push(c.type_.clone());
            }
        }
    }
    types
        .into_iter()
        .map(|type_| {
            let statuses: Vec<&str> = manifests
                .iter()
                .filter_map(|m| {
                    m.conditions
                        .iter()
                        .find(|c| c.type_ == type_ && c.reason.starts_with(RULE_REASON_PREFIX))
                })
                .map(|c| c.status.as_str())
                .collect();
            let n = statuses.len();
            let yes = statuses.iter().filter(|s| **s == "True").count();
            let status = if yes == n {
                ConditionStatus::True
            } else if statuses.contains(&"False") {
                ConditionStatus::False
            } else {
                ConditionStatus::Unknown
            };
            let complete = type_ == WORK_COMPLETE;
            let reason = match (complete, status) {
                (true, ConditionStatus::True) => "ManifestsComplete",
                (true, _) => "ManifestsNotComplete",
                (false, _) => "ConditionRulesAggregated",
            };
            let message = if complete {
                format!("{yes} of {n} completable manifests are complete")
            } else {
                format!("{yes} of {n} manifests with a {type_} rule are {type_}")
            };
            (type_, status, reason, message)
        })
        .collect()
}

/// The status of a deleted work whose resources are still being removed: the last status, with
/// `Deleting=True` (OCM's reason and message) saying how many remain.
pub fn deleting_status(
    previous: Option<ManifestWorkStatus>,
    generation: i64,
    remaining: usize,
    now: &Time,
) -> ManifestWorkStatus {
    let mut status = previous.unwrap_or_default();
    set_condition(
        &mut status.conditions,
        WORK_DELETING,
        ConditionStatus::True,
        "WorkDeleting",
        &format!("ManifestWork is being deleted; {remaining} resources are not removed yet"),
        Some(generation),
        now.clone(),
    );
    status
}

/// The status of a work the agent would not hold (too large, not a ManifestWork): nothing was
/// applied for this generation, and `reason` says why.
pub fn refused_status(generation: i64, reason: &str, now: &Time) -> ManifestWorkStatus {
    let mut conditions = Vec::new();
    let reason = bounded(reason);
    let generation = Some(generation);
    let mut set = |type_: &str, status: ConditionStatus, why: &str, message: &str| {
        set_condition(
            &mut conditions,
            type_,
            status,
            why,
            message,
            generation,
            now.clone(),
        );
    };
    set(
        WORK_APPLIED,
        ConditionStatus::False,
        "AppliedManifestWorkFailed",
        &reason,
    );
    set(
        WORK_AVAILABLE,
        ConditionStatus::Unknown,
        "ResourcesStatusUnknown",
        "The work was not applied",
    );
    set(WORK_DEGRADED, ConditionStatus::True, "WorkRefused", &reason);
    ManifestWorkStatus {
        conditions,
        resource_status: ManifestResourceStatus::default(),
        fence: None,
    }
}

/// Copies `lastTransitionTime` from `previous` into `next` for every condition whose status is
/// unchanged (work conditions by type; manifest conditions by resourceMeta and type), as
/// metav1's SetStatusCondition does.
pub fn carry_transition_times(previous: &ManifestWorkStatus, next: &mut ManifestWorkStatus) {
    carry(&previous.conditions, &mut next.conditions);
    for manifest in &mut next.resource_status.manifests {
        if let Some(prev) = previous
            .resource_status
            .manifests
            .iter()
            .find(|p| p.resource_meta == manifest.resource_meta)
        {
            carry(&prev.conditions, &mut manifest.conditions);
        }
    }
}

fn carry(previous: &[Condition], next: &mut [Condition]) {
    for condition in next {
        if let Some(prev) = previous
            .iter()
            .find(|p| p.type_ == condition.type_ && p.status == condition.status)
        {
            condition.last_transition_time = prev.last_transition_time.clone();
        }
    }
}

/// How a person names a manifest: `manifest #2 (apps/v1 Deployment default/web)`, leaving out
/// what the manifest does not say.
pub fn manifest_label(meta: &ManifestResourceMeta) -> String {
    let api_version = match (meta.group.as_str(), meta.version.as_str()) {
        ("", v) => v.to_owned(),
        (g, v) => format!("{g}/{v}"),
    };
    let object = match (meta.namespace.as_str(), meta.name.as_str()) {
        ("", n) => n.to_owned(),
        (ns, "") => format!("in {ns}"),
        (ns, n) => format!("{ns}/{n}"),
    };
    let parts: Vec<&str> = [api_version.as_str(), meta.kind.as_str(), object.as_str()]
        .into_iter()
        .filter(|p| !p.is_empty())
        .collect();
    if parts.is_empty() {
        format!("manifest #{}", meta.ordinal)
    } else {
        format!("manifest #{} ({})", meta.ordinal, parts.join(" "))
    }
}

fn manifest_condition(outcome: &ManifestOutcome, generation: i64, now: &Time) -> ManifestCondition {
    let mut conditions = Vec::new();
    let mut set = |type_: &str,
                   status: ConditionStatus,
                   reason: &str,
                   message: &str,
                   observed: Option<i64>| {
        set_condition(
            &mut conditions,
            type_,
            status,
            reason,
            &bounded(message),
            observed,
            now.clone(),
        );
    };
    match &outcome.applied {
        Ok(()) => set(
            WORK_APPLIED,
            ConditionStatus::True,
            "AppliedManifestComplete",
            "Apply manifest complete",
            None,
        ),
        Err(failure) => set(
            WORK_APPLIED,
            ConditionStatus::False,
            failure.reason,
            &failure.message,
            None,
        ),
    }
    match &outcome.available {
        Availability::Exists => set(
            WORK_AVAILABLE,
            ConditionStatus::True,
            "ResourceAvailable",
            "Resource is available",
            None,
        ),
        Availability::Missing => set(
            WORK_AVAILABLE,
            ConditionStatus::False,
            "ResourceNotAvailable",
            "Resource is not available",
            None,
        ),
        Availability::Unknown(why) => set(
            WORK_AVAILABLE,
            ConditionStatus::Unknown,
            "ResourceStatusUnknown",
            why,
            None,
        ),
    }
    let mut status_feedback = StatusFeedbackResult::default();
    // Feedback and rules read the object; a missing object has neither (as in OCM).
    if let (Some(object), Availability::Exists) = (&outcome.object, &outcome.available) {
        let meta = &outcome.meta;
        let kind = ObjectKind {
            group: &meta.group,
            version: &meta.version,
            kind: &meta.kind,
        };
        if !outcome.rules.feedback.is_empty() {
            let read = feedback::read(object, kind, &outcome.rules.feedback);
            if read.problems.is_empty() {
                set(
                    STATUS_FEEDBACK_SYNCED,
                    ConditionStatus::True,
                    "StatusFeedbackSynced",
                    "",
                    None,
                );
            } else {
                set(
                    STATUS_FEEDBACK_SYNCED,
                    ConditionStatus::False,
                    "StatusFeedbackSyncFailed",
                    &format!("Sync status feedback failed: {}", read.problems.join("; ")),
                    None,
                );
            }
            status_feedback.values = read.values;
        }
        for c in condition_rules::evaluate(object, kind, &outcome.rules.conditions) {
            // OCM stamps rule conditions with the work generation they were computed for.
            set(&c.type_, c.status, c.reason, &c.message, Some(generation));
        }
    }
    ManifestCondition {
        resource_meta: outcome.meta.clone(),
        status_feedback,
        conditions,
    }
}

/// `message`, cut to [`MAX_CONDITION_MESSAGE`] at a character boundary.
fn bounded(message: &str) -> String {
    if message.len() <= MAX_CONDITION_MESSAGE {
        return message.to_owned();
    }
    const ELLIPSIS: &str = " ...";
    let mut end = MAX_CONDITION_MESSAGE - ELLIPSIS.len();
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{ELLIPSIS}", &message[..end])
}

#[cfg(test)]
mod tests;
