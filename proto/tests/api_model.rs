//! Behaviour of the api helpers that other crates rely on: condition updates, the content hash
//! used by resume, and ManifestWork validation messages.

use flotilla_proto::api::conditions::{self, ConditionStatus, find_condition, set_condition};
use flotilla_proto::api::{
    self, Manifest, ManifestError, ManifestWork, ManifestWorkSpec, content_hash,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use serde_json::json;

fn at(rfc3339: &str) -> Time {
    Time(rfc3339.parse().expect("timestamp"))
}

// --- conditions -------------------------------------------------------------------------------

#[test]
fn condition_type_strings_are_ocms() {
    assert_eq!(
        conditions::HUB_ACCEPTED_MANAGED_CLUSTER,
        "HubAcceptedManagedCluster"
    );
    assert_eq!(conditions::MANAGED_CLUSTER_JOINED, "ManagedClusterJoined");
    assert_eq!(
        conditions::MANAGED_CLUSTER_CONDITION_AVAILABLE,
        "ManagedClusterConditionAvailable"
    );
    assert_eq!(
        [
            conditions::WORK_APPLIED,
            conditions::WORK_AVAILABLE,
            conditions::WORK_DEGRADED,
            conditions::WORK_PROGRESSING
        ],
        ["Applied", "Available", "Degraded", "Progressing"]
    );
}

/// One step of a condition's history: what is set, whether that is a change, and which
/// lastTransitionTime results.
struct Step {
    now: &'static str,
    status: ConditionStatus,
    reason: &'static str,
    generation: i64,
    changed: bool,
    transition: &'static str,
}

fn check_history(steps: &[Step]) {
    let mut conds: Vec<Condition> = Vec::new();
    for (i, s) in steps.iter().enumerate() {
        let changed = set_condition(
            &mut conds,
            conditions::MANAGED_CLUSTER_CONDITION_AVAILABLE,
            s.status,
            s.reason,
            "",
            Some(s.generation),
            at(s.now),
        );
        assert_eq!(changed, s.changed, "step {i}: changed");
        assert_eq!(conds.len(), 1, "step {i}: one condition per type");
        let c = find_condition(&conds, conditions::MANAGED_CLUSTER_CONDITION_AVAILABLE)
            .expect("present");
        assert_eq!(c.status, s.status.as_str(), "step {i}: status");
        assert_eq!(c.reason, s.reason, "step {i}: reason");
        assert_eq!(
            c.observed_generation,
            Some(s.generation),
            "step {i}: observedGeneration"
        );
        assert_eq!(
            c.last_transition_time,
            at(s.transition),
            "step {i}: lastTransitionTime"
        );
    }
}

#[test]
fn last_transition_time_moves_only_when_status_changes() {
    use ConditionStatus::*;
    let step = |now, status, reason, generation, changed, transition| Step {
        now,
        status,
        reason,
        generation,
        changed,
        transition,
    };
    check_history(&[
        step(
            "2024-01-01T00:00:00Z",
            True,
            "LeaseRenewed",
            1,
            true,
            "2024-01-01T00:00:00Z",
        ),
        // Heartbeat re-asserting the same thing: nothing to write.
        step(
            "2024-01-01T00:01:00Z",
            True,
            "LeaseRenewed",
            1,
            false,
            "2024-01-01T00:00:00Z",
        ),
        // New reason and generation, same status: updated in place, transition time kept.
        step(
            "2024-01-01T00:02:00Z",
            True,
            "SessionResumed",
            2,
            true,
            "2024-01-01T00:00:00Z",
        ),
        // Status flips: transition time moves.
        step(
            "2024-01-01T00:03:00Z",
            Unknown,
            "LeaseUpdateStopped",
            2,
            true,
            "2024-01-01T00:03:00Z",
        ),
        step(
            "2024-01-01T00:04:00Z",
            Unknown,
            "LeaseUpdateStopped",
            2,
            false,
            "2024-01-01T00:03:00Z",
        ),
        step(
            "2024-01-01T00:05:00Z",
            True,
            "LeaseRenewed",
            2,
            true,
            "2024-01-01T00:05:00Z",
        ),
    ]);
}

#[test]
fn conditions_of_other_types_are_left_alone() {
    let mut conds = Vec::new();
    let t0 = at("2024-01-01T00:00:00Z");
    set_condition(
        &mut conds,
        conditions::WORK_APPLIED,
        ConditionStatus::True,
        "A",
        "m",
        None,
        t0.clone(),
    );
    set_condition(
        &mut conds,
        conditions::WORK_AVAILABLE,
        ConditionStatus::False,
        "B",
        "m",
        None,
        t0,
    );
    set_condition(
        &mut conds,
        conditions::WORK_AVAILABLE,
        ConditionStatus::True,
        "B",
        "m",
        None,
        at("2024-01-02T00:00:00Z"),
    );
    let applied = find_condition(&conds, conditions::WORK_APPLIED).expect("applied");
    assert_eq!(applied.last_transition_time, at("2024-01-01T00:00:00Z"));
    assert_eq!(conds.len(), 2);
    assert!(find_condition(&conds, conditions::WORK_DEGRADED).is_none());
}

// --- content hash -----------------------------------------------------------------------------

fn spec(manifests: Vec<serde_json::Value>) -> ManifestWorkSpec {
    ManifestWorkSpec {
        workload: api::ManifestsTemplate {
            manifests: manifests.into_iter().map(Manifest).collect(),
        },
        ..Default::default()
    }
}

#[test]
fn content_hash_ignores_key_order() {
    // The same objects with keys in another order, as two YAML files or two agents may write them.
    let a: ManifestWorkSpec = serde_json::from_str(
        r#"{"workload":{"manifests":[{"apiVersion":"v1","kind":"ConfigMap",
            "metadata":{"name":"cm","namespace":"default","labels":{"a":"1","b":"2"}},"data":{"x":"1","y":"2"}}]},
            "deleteOption":{"propagationPolicy":"Orphan"}}"#,
    )
    .expect("a");
    let b: ManifestWorkSpec = serde_json::from_str(
        r#"{"deleteOption":{"propagationPolicy":"Orphan"},
            "workload":{"manifests":[{"data":{"y":"2","x":"1"},"kind":"ConfigMap",
            "metadata":{"labels":{"b":"2","a":"1"},"namespace":"default","name":"cm"},"apiVersion":"v1"}]}}"#,
    )
    .expect("b");
    assert_eq!(content_hash(&a), content_hash(&b));
    let hash = content_hash(&a);
    assert_eq!(hash.len(), 64);
    assert!(
        hash.bytes()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()),
        "{hash}"
    );
}

#[test]
fn content_hash_changes_with_any_content() {
    let base = spec(vec![
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"x": "1"}}),
    ]);
    let variants = [
        spec(vec![
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"x": "2"}}),
        ]),
        spec(vec![
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm2"}, "data": {"x": "1"}}),
        ]),
        spec(vec![
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"x": "1"}}),
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns"}}),
        ]),
        ManifestWorkSpec {
            delete_option: Some(api::DeleteOption {
                propagation_policy: api::PropagationPolicy::Orphan,
                ..Default::default()
            }),
            ..base.clone()
        },
        spec(vec![]),
    ];
    let base_hash = content_hash(&base);
    for (i, v) in variants.iter().enumerate() {
        assert_ne!(
            content_hash(v),
            base_hash,
            "variant {i} hashes like the base"
        );
    }
    // Manifest order is content: the agent applies in order and reports by ordinal.
    let one = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "a"}});
    let two = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "b"}});
    assert_ne!(
        content_hash(&spec(vec![one.clone(), two.clone()])),
        content_hash(&spec(vec![two, one]))
    );
}

#[test]
fn content_hash_is_stable_across_builds() {
    // Pinned: agents and gateways of different builds must agree, or every resume resyncs.
    let s = spec(vec![
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "a"}}),
    ]);
    assert_eq!(
        api::canonical_json(&serde_json::to_value(&s).expect("json")),
        r#"{"workload":{"manifests":[{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"a"}}]}}"#
    );
    assert_eq!(content_hash(&s), {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(
            br#"{"workload":{"manifests":[{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"a"}}]}}"#,
        ))
    });
}

// --- validation -------------------------------------------------------------------------------

fn work(namespace: Option<&str>, manifests: Vec<serde_json::Value>) -> ManifestWork {
    let mut w = ManifestWork::new("baseline", spec(manifests));
    w.metadata.namespace = namespace.map(str::to_owned);
    w
}

/// Validates a work and compares the messages a person would see.
fn check_messages(w: &ManifestWork, expected: &[&str]) {
    let got: Vec<String> = match api::validate_manifest_work(w) {
        Ok(()) => Vec::new(),
        Err(errors) => errors.iter().map(ToString::to_string).collect(),
    };
    assert_eq!(got, expected);
}

#[test]
fn manifest_configs_executor_and_ttl_are_checked_as_ocm_does() {
    let mut w = work(
        Some("store-7"),
        vec![json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}})],
    );
    w.spec = serde_json::from_value(json!({
        "workload": {"manifests": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}}]},
        "manifestConfigs": [
            {"resourceIdentifier": {"resource": "namespaces", "name": "shop"},
             "updateStrategy": {"type": "ServerSideApply", "serverSideApply": {"fieldManager": "mine",
                "ignoreFields": [{"condition": "Always", "jsonPaths": []}]}}},
            {"resourceIdentifier": {"resource": "namespaces", "name": "shop"},
             "conditionRules": [{"type": "CEL", "celExpressions": ["true"]}, {"type": "Magic", "condition": "X"},
                                {"type": "WellKnownConditions"}]},
        ],
        "executor": {"subject": {"type": "User"}},
        "deleteOption": {"propagationPolicy": "Foreground", "ttlSecondsAfterFinished": -1},
    }))
    .unwrap();
    check_messages(
        &w,
        &[
            "ManifestWork store-7/baseline: spec.manifestConfigs[0]: updateStrategy.serverSideApply.fieldManager \"mine\" must start with \"work-agent\"",
            "ManifestWork store-7/baseline: spec.manifestConfigs[0]: ignoreFields condition \"Always\" must be OnSpokePresent or OnSpokeChange",
            "ManifestWork store-7/baseline: spec.manifestConfigs[0]: ignoreFields entries need at least one jsonPath or jsonPointer",
            "ManifestWork store-7/baseline: spec.manifestConfigs[1]: condition is required for CEL rules",
            "ManifestWork store-7/baseline: spec.manifestConfigs[1]: conditionRules type \"Magic\" must be WellKnownConditions or CEL",
            "ManifestWork store-7/baseline: spec.executor: subject type \"User\" is not supported; use ServiceAccount",
            "ManifestWork store-7/baseline: spec.deleteOption.ttlSecondsAfterFinished: -1 is negative; use 0 or more seconds",
        ],
    );
}

#[test]
fn ocm_fields_flotilla_does_not_implement_are_refused_naming_the_object_and_field() {
    let mut w = work(
        Some("store-7"),
        vec![json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}})],
    );
    w.spec = serde_json::from_value(json!({
        "workload": {"manifests": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}}]},
        "manifestConfigs": [
            {"resourceIdentifier": {"resource": "namespaces", "name": "shop"},
             "feedbackScrapeType": "Watch",
             "updateStrategy": {"type": "ServerSideApply", "serverSideApply": {"ignoreFields": [
                {"condition": "OnSpokeChange", "jqPathExpressions": [".metadata.labels"]},
                {"condition": "OnSpokePresent", "jsonPointers": ["/metadata/labels", "metadata"]}]}}},
        ],
    }))
    .unwrap();
    check_messages(
        &w,
        &[
            "ManifestWork store-7/baseline: spec.manifestConfigs[0]: ignoreFields[\"OnSpokeChange\"].jqPathExpressions: flotilla does not implement jq expressions yet; use jsonPaths or jsonPointers",
            "ManifestWork store-7/baseline: spec.manifestConfigs[0]: ignoreFields jsonPointer \"metadata\" must start with \"/\" (RFC 6901)",
        ],
    );

    let placement: api::Placement = serde_json::from_value(json!({
        "apiVersion": "cluster.open-cluster-management.io/v1beta1", "kind": "Placement",
        "metadata": {"name": "stores", "namespace": "fleet"},
        "spec": {"sortBy": "Score", "scoreRateLimit": "10s"},
    }))
    .unwrap();
    let refused: Vec<String> = api::validate_placement(&placement)
        .unwrap_err()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        refused,
        [
            "Placement fleet/stores: spec.sortBy: Score orders decisions by score; use ClusterName (the default); flotilla does not implement it yet",
            "Placement fleet/stores: spec.scoreRateLimit: \"10s\" rate-limits rescheduling on score changes; leave it out or use \"1m\"; flotilla does not implement it yet",
        ]
    );
    // OCM's defaults, as the apiserver fills them in, pass.
    let defaulted: api::Placement = serde_json::from_value(json!({
        "apiVersion": "cluster.open-cluster-management.io/v1beta1", "kind": "Placement",
        "metadata": {"name": "stores", "namespace": "fleet"},
        "spec": {"sortBy": "ClusterName", "scoreRateLimit": "1m"},
    }))
    .unwrap();
    assert_eq!(api::validate_placement(&defaulted), Ok(()));

    let set: api::ManagedClusterSet = serde_json::from_value(json!({
        "apiVersion": "cluster.open-cluster-management.io/v1beta2", "kind": "ManagedClusterSet",
        "metadata": {"name": "stores"},
        "spec": {"managedNamespaces": [{"name": "shop"}]},
    }))
    .unwrap();
    assert_eq!(
        api::validate_cluster_set(&set).unwrap_err().to_string(),
        "ManagedClusterSet stores: spec.managedNamespaces: [\"shop\"] asks for namespaces on every member cluster; leave it out; flotilla does not implement it yet"
    );
    assert_eq!(
        api::validate_cluster_set(&api::ManagedClusterSet::new("plain", Default::default())),
        Ok(())
    );
}

#[test]
fn valid_work_passes() {
    let w = work(
        Some("store-7"),
        vec![
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}}),
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "pos", "namespace": "shop"}}),
        ],
    );
    check_messages(&w, &[]);
}

#[test]
fn validation_names_the_work_and_the_manifest() {
    let ok = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}});
    let w = work(
        Some("store-7"),
        vec![
            ok.clone(),
            json!({"kind": "ConfigMap", "metadata": {"name": "c"}}),
            json!({"apiVersion": "v1", "metadata": {"name": "c"}}),
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"generateName": "c-"}}),
            json!("not an object"),
            json!({"apiVersion": "", "kind": "ConfigMap", "metadata": {"name": 7}}),
        ],
    );
    check_messages(
        &w,
        &[
            "ManifestWork store-7/baseline: manifest #1 has no apiVersion",
            "ManifestWork store-7/baseline: manifest #2 has no kind",
            "ManifestWork store-7/baseline: manifest #3 has no metadata.name",
            "ManifestWork store-7/baseline: manifest #4 is not an object",
            "ManifestWork store-7/baseline: manifest #5 has no apiVersion",
            "ManifestWork store-7/baseline: manifest #5 has no metadata.name",
        ],
    );
    let errors = api::validate_manifest_work(&w).expect_err("invalid");
    assert_eq!(
        errors[2],
        ManifestError::MissingName {
            work: "store-7/baseline".into(),
            ordinal: 3
        }
    );
}

#[test]
fn a_work_without_a_name_is_refused_as_unnamed() {
    let mut w = work(Some("store-7"), vec![json!({"kind": "ConfigMap"})]);
    w.metadata.name = None;
    check_messages(
        &w,
        &[
            "ManifestWork store-7/<unnamed>: manifest #0 has no apiVersion",
            "ManifestWork store-7/<unnamed>: manifest #0 has no metadata.name",
        ],
    );
    w.metadata.name = Some(String::new());
    w.metadata.namespace = None;
    check_messages(
        &w,
        &[
            "ManifestWork <unnamed>: manifest #0 has no apiVersion",
            "ManifestWork <unnamed>: manifest #0 has no metadata.name",
        ],
    );
}

#[test]
fn empty_and_oversized_works_are_refused() {
    check_messages(
        &work(Some("store-7"), vec![]),
        &[
            "ManifestWork store-7/baseline: spec.workload.manifests is empty; add at least one manifest",
        ],
    );
    let big = "x".repeat(api::MAX_WORKLOAD_BYTES);
    let w = work(
        None,
        vec![
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"x": big}}),
        ],
    );
    let errors = api::validate_manifest_work(&w).expect_err("too large");
    assert!(
        matches!(errors.as_slice(), [ManifestError::TooLarge { limit, .. }] if *limit == api::MAX_WORKLOAD_BYTES)
    );
    assert!(
        errors[0]
            .to_string()
            .starts_with("ManifestWork baseline: manifests take "),
        "{}",
        errors[0]
    );
}

#[test]
fn a_join_request_never_shows_its_token_secret_in_debug_output() {
    let request = flotilla_proto::wire::JoinRequest {
        cluster_name: "store-1".into(),
        token: "abc123.s3cr3tvalue".into(),
        csr_pem: "-----BEGIN CERTIFICATE REQUEST-----".into(),
        labels: vec!["region=eu".into()],
    };
    let shown = format!("{request:?}");
    assert!(!shown.contains("s3cr3tvalue"), "{shown}");
    assert!(shown.contains("abc123.<redacted>"), "{shown}");
    assert!(
        shown.contains("store-1") && shown.contains("region=eu"),
        "{shown}"
    );
}

#[test]
fn a_join_request_whose_token_has_no_dot_shows_none_of_it() {
    // A secret pasted alone, or a token that lost its dot: all of it may be the secret.
    let request = flotilla_proto::wire::JoinRequest {
        cluster_name: "store-1".into(),
        token: "s3cr3tvaluewithoutadot".into(),
        ..Default::default()
    };
    let shown = format!("{request:?}");
    assert!(!shown.contains("s3cr3t"), "{shown}");
    assert!(shown.contains("token: <malformed>"), "{shown}");
}
