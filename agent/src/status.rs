//! ManifestWork status as OCM's work agent shapes it, built from what applying a work did.
//!
//! `status.conditions` has `Applied`, `Available` and `Degraded` with the generation they were
//! computed for; `status.resourceStatus.manifests[]` has one entry per manifest (by ordinal)
//! with its resolved `resourceMeta` and its own `Applied` and `Available` conditions. Building is
//! pure: the caller passes `now`, and [`carry_transition_times`] keeps the previous status's
//! `lastTransitionTime` wherever a condition's status did not change, so that an unchanged
//! status compares equal and is never sent twice.

use flotilla_proto::api::conditions::{
    ConditionStatus, WORK_APPLIED, WORK_AVAILABLE, WORK_DEGRADED, set_condition,
};
use flotilla_proto::api::{
    ManifestCondition, ManifestResourceMeta, ManifestResourceStatus, ManifestWorkStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::apply::{Availability, ManifestOutcome};

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

    let manifests = sorted.iter().map(|o| manifest_condition(o, now)).collect();

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
    ManifestWorkStatus {
        conditions,
        resource_status: ManifestResourceStatus { manifests },
    }
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

fn manifest_condition(outcome: &ManifestOutcome, now: &Time) -> ManifestCondition {
    let mut conditions = Vec::new();
    let mut set = |type_: &str, status: ConditionStatus, reason: &str, message: &str| {
        set_condition(
            &mut conditions,
            type_,
            status,
            reason,
            &bounded(message),
            None,
            now.clone(),
        );
    };
    match &outcome.applied {
        Ok(()) => set(
            WORK_APPLIED,
            ConditionStatus::True,
            "AppliedManifestComplete",
            "Apply manifest complete",
        ),
        Err(failure) => set(
            WORK_APPLIED,
            ConditionStatus::False,
            "AppliedManifestFailed",
            &failure.message,
        ),
    }
    match &outcome.available {
        Availability::Exists => set(
            WORK_AVAILABLE,
            ConditionStatus::True,
            "ResourceAvailable",
            "Resource is available",
        ),
        Availability::Missing => set(
            WORK_AVAILABLE,
            ConditionStatus::False,
            "ResourceNotAvailable",
            "Resource is not available",
        ),
        Availability::Unknown(why) => set(
            WORK_AVAILABLE,
            ConditionStatus::Unknown,
            "ResourceStatusUnknown",
            why,
        ),
    }
    ManifestCondition {
        resource_meta: outcome.meta.clone(),
        status_feedback: Default::default(),
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
mod tests {
    use super::*;
    use crate::apply::ManifestFailure;
    use k8s_openapi::jiff::Timestamp;

    fn at(second: i64) -> Time {
        Time(Timestamp::from_second(second).unwrap())
    }

    /// `"apps/v1 Deployment default/web"` → an outcome for ordinal `ordinal`.
    fn outcome(
        ordinal: i32,
        what: &str,
        applied: Result<(), &str>,
        available: Availability,
    ) -> ManifestOutcome {
        let mut parts = what.split(' ');
        let api = parts.next().unwrap_or("");
        let kind = parts.next().unwrap_or("");
        let object = parts.next().unwrap_or("");
        let (group, version) = api.split_once('/').unwrap_or(("", api));
        let (namespace, name) = object.split_once('/').unwrap_or(("", object));
        ManifestOutcome {
            meta: ManifestResourceMeta {
                ordinal,
                group: group.into(),
                version: version.into(),
                kind: kind.into(),
                resource: format!("{}s", kind.to_lowercase()),
                name: name.into(),
                namespace: namespace.into(),
            },
            resource: None,
            applied: applied.map_err(|m| ManifestFailure {
                message: m.into(),
                retryable: false,
            }),
            available,
        }
    }

    /// One line per condition: `Type Status Reason: message`, work conditions first, then
    /// `#ordinal Type Status Reason: message` per manifest.
    fn summary(status: &ManifestWorkStatus) -> Vec<String> {
        let line = |prefix: String, c: &Condition| {
            format!(
                "{prefix}{} {} {}: {}",
                c.type_, c.status, c.reason, c.message
            )
        };
        let mut lines: Vec<String> = status
            .conditions
            .iter()
            .map(|c| line(String::new(), c))
            .collect();
        for m in &status.resource_status.manifests {
            for c in &m.conditions {
                lines.push(line(format!("#{} ", m.resource_meta.ordinal), c));
            }
        }
        lines
    }

    fn check(outcomes: Vec<ManifestOutcome>, expected: &[&str]) {
        let status = work_status(7, &outcomes, &at(1000));
        assert_eq!(summary(&status), expected);
        for c in &status.conditions {
            assert_eq!(
                c.observed_generation,
                Some(7),
                "work conditions carry the generation"
            );
        }
    }

    #[test]
    fn everything_applied() {
        check(
            vec![
                outcome(
                    0,
                    "v1 ServiceAccount default/my-sa",
                    Ok(()),
                    Availability::Exists,
                ),
                outcome(
                    1,
                    "apps/v1 Deployment default/nginx-deployment",
                    Ok(()),
                    Availability::Exists,
                ),
            ],
            &[
                "Applied True AppliedManifestWorkComplete: Apply manifest work complete",
                "Available True ResourcesAvailable: All resources are available",
                "Degraded False ManifestsApplied: All manifests are applied",
                "#0 Applied True AppliedManifestComplete: Apply manifest complete",
                "#0 Available True ResourceAvailable: Resource is available",
                "#1 Applied True AppliedManifestComplete: Apply manifest complete",
                "#1 Available True ResourceAvailable: Resource is available",
            ],
        );
    }

    #[test]
    fn one_manifest_rejected_by_the_spoke() {
        check(
            vec![
                outcome(
                    1,
                    "apps/v1 Deployment default/web",
                    Err("Deployment.apps \"web\" is invalid: spec.replicas: Invalid value: -1"),
                    Availability::Missing,
                ),
                outcome(0, "v1 ConfigMap default/cfg", Ok(()), Availability::Exists),
            ],
            &[
                "Applied False AppliedManifestWorkFailed: Failed to apply manifest work: 1 of 2 manifests failed",
                "Available False ResourcesNotAvailable: 1 of 2 resources are not available",
                "Degraded True ManifestsFailed: manifest #1 (apps/v1 Deployment default/web): Deployment.apps \"web\" is invalid: spec.replicas: Invalid value: -1",
                "#0 Applied True AppliedManifestComplete: Apply manifest complete",
                "#0 Available True ResourceAvailable: Resource is available",
                "#1 Applied False AppliedManifestFailed: Deployment.apps \"web\" is invalid: spec.replicas: Invalid value: -1",
                "#1 Available False ResourceNotAvailable: Resource is not available",
            ],
        );
    }

    #[test]
    fn a_failed_update_of_an_existing_object_is_still_available() {
        check(
            vec![outcome(
                0,
                "v1 ConfigMap default/cfg",
                Err("conflict"),
                Availability::Exists,
            )],
            &[
                "Applied False AppliedManifestWorkFailed: Failed to apply manifest work: 1 of 1 manifests failed",
                "Available True ResourcesAvailable: All resources are available",
                "Degraded True ManifestsFailed: manifest #0 (v1 ConfigMap default/cfg): conflict",
                "#0 Applied False AppliedManifestFailed: conflict",
                "#0 Available True ResourceAvailable: Resource is available",
            ],
        );
    }

    #[test]
    fn unresolvable_manifests_are_named_by_what_they_say() {
        check(
            vec![
                outcome(
                    0,
                    "v1  default/my-sa",
                    Err("manifest has no kind"),
                    Availability::Unknown("unresolved".into()),
                ),
                outcome(
                    1,
                    "example.com/v1 Widget w",
                    Err("the spoke cluster serves no kind Widget in example.com/v1: gone"),
                    Availability::Unknown("unresolved".into()),
                ),
            ],
            &[
                "Applied False AppliedManifestWorkFailed: Failed to apply manifest work: 2 of 2 manifests failed",
                "Available Unknown ResourcesStatusUnknown: 2 of 2 resources have unknown status",
                "Degraded True ManifestsFailed: manifest #0 (v1 default/my-sa): manifest has no kind; manifest #1 (example.com/v1 Widget w): the spoke cluster serves no kind Widget in example.com/v1: gone",
                "#0 Applied False AppliedManifestFailed: manifest has no kind",
                "#0 Available Unknown ResourceStatusUnknown: unresolved",
                "#1 Applied False AppliedManifestFailed: the spoke cluster serves no kind Widget in example.com/v1: gone",
                "#1 Available Unknown ResourceStatusUnknown: unresolved",
            ],
        );
    }

    #[test]
    fn a_refused_work_says_why() {
        let status = refused_status(
            3,
            "the ManifestWork is 3000000 bytes, more than the agent's limit of 2097152",
            &at(5),
        );
        assert_eq!(
            summary(&status),
            [
                "Applied False AppliedManifestWorkFailed: the ManifestWork is 3000000 bytes, more than the agent's limit of 2097152",
                "Available Unknown ResourcesStatusUnknown: The work was not applied",
                "Degraded True WorkRefused: the ManifestWork is 3000000 bytes, more than the agent's limit of 2097152",
            ]
        );
    }

    #[test]
    fn labels_leave_out_what_is_missing() {
        let label =
            |what: &str| manifest_label(&outcome(2, what, Ok(()), Availability::Exists).meta);
        assert_eq!(
            label("apps/v1 Deployment default/web"),
            "manifest #2 (apps/v1 Deployment default/web)"
        );
        assert_eq!(
            label("v1 Namespace prod"),
            "manifest #2 (v1 Namespace prod)"
        );
        assert_eq!(
            label("v1 ConfigMap default/"),
            "manifest #2 (v1 ConfigMap in default)"
        );
        assert_eq!(label(""), "manifest #2");
    }

    #[test]
    fn an_unchanged_status_compares_equal_once_transition_times_are_carried() {
        let outcomes = vec![outcome(
            0,
            "v1 ConfigMap default/cfg",
            Ok(()),
            Availability::Exists,
        )];
        let first = work_status(1, &outcomes, &at(100));
        let mut again = work_status(1, &outcomes, &at(200));
        assert_ne!(first, again);
        carry_transition_times(&first, &mut again);
        assert_eq!(first, again);

        // A changed condition takes the new time; unchanged ones keep theirs.
        let failed = vec![outcome(
            0,
            "v1 ConfigMap default/cfg",
            Err("boom"),
            Availability::Exists,
        )];
        let mut third = work_status(1, &failed, &at(300));
        carry_transition_times(&first, &mut third);
        let applied = third
            .conditions
            .iter()
            .find(|c| c.type_ == WORK_APPLIED)
            .unwrap();
        assert_eq!(applied.last_transition_time, at(300));
        let available = third
            .conditions
            .iter()
            .find(|c| c.type_ == WORK_AVAILABLE)
            .unwrap();
        assert_eq!(available.last_transition_time, at(100));

        // A new generation is a new status even when nothing else changed.
        let mut next_gen = work_status(2, &outcomes, &at(400));
        carry_transition_times(&first, &mut next_gen);
        assert_ne!(first, next_gen);
    }

    #[test]
    fn long_messages_are_cut_to_what_the_apiserver_accepts() {
        let long = "é".repeat(MAX_CONDITION_MESSAGE);
        let cut = bounded(&long);
        assert!(cut.len() <= MAX_CONDITION_MESSAGE);
        assert!(cut.ends_with(" ..."));
        assert_eq!(bounded("short"), "short");
    }
}
