//! The engine against the in-memory cluster: order, planning, each update strategy, the
//! executor's checks, and which errors are retryable.

use flotilla_proto::api::{Manifest, ManifestWorkExecutor, ManifestWorkSpec, ResourceIdentifier};
use serde_json::Value;

use super::*;
use crate::cache::AppliedResource;
use serde_json::json;

fn manifests(kinds: &[(&str, &str)]) -> Vec<Manifest> {
    kinds
        .iter()
        .enumerate()
        .map(|(i, (api, kind))| {
            Manifest(
                json!({"apiVersion": api, "kind": kind, "metadata": {"name": format!("m{i}")}}),
            )
        })
        .collect()
}

fn spec_of(manifests: Vec<Manifest>) -> ManifestWorkSpec {
    ManifestWorkSpec {
        workload: flotilla_proto::api::ManifestsTemplate { manifests },
        ..ManifestWorkSpec::default()
    }
}

fn check_order(kinds: &[(&str, &str)], expected: &[usize]) {
    assert_eq!(apply_order(&manifests(kinds)), expected, "{kinds:?}");
}

#[test]
fn namespaces_and_crds_go_first_and_the_rest_keep_their_order() {
    check_order(
        &[("v1", "ServiceAccount"), ("apps/v1", "Deployment")],
        &[0, 1],
    );
    check_order(&[("apps/v1", "Deployment"), ("v1", "Namespace")], &[1, 0]);
    check_order(
        &[
            ("example.com/v1", "Widget"),
            ("v1", "ConfigMap"),
            ("apiextensions.k8s.io/v1", "CustomResourceDefinition"),
            ("v1", "Namespace"),
            ("v1", "Secret"),
        ],
        &[2, 3, 0, 1, 4],
    );
    // Only the real Namespace kind counts, not a CRD that happens to be called so.
    check_order(
        &[("v1", "ConfigMap"), ("example.com/v1", "Namespace")],
        &[0, 1],
    );
    check_order(&[], &[]);
}

fn check_plan_failure(manifest: Value, expected: &str) {
    let cluster = MemoryCluster::new();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let planned = runtime.block_on(plan_manifests(
        &cluster,
        &spec_of(vec![Manifest(manifest.clone())]),
    ));
    let failure = planned[0].target.clone().expect_err("should not resolve");
    assert_eq!(failure.message, expected, "{manifest}");
}

#[test]
fn manifests_that_cannot_be_applied_say_why() {
    check_plan_failure(json!("just a string"), "manifest is not an object");
    check_plan_failure(
        json!({"apiVersion": "v1", "metadata": {"name": "x"}}),
        "manifest has no kind",
    );
    check_plan_failure(
        json!({"apiVersion": "v1", "kind": "ConfigMap"}),
        "manifest has no metadata.name",
    );
    check_plan_failure(
        json!({"kind": "ConfigMap", "metadata": {}}),
        "manifest has no apiVersion, no metadata.name",
    );
    check_plan_failure(
        json!({"apiVersion": "widgets.example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}),
        "the spoke cluster serves no kind Widget in widgets.example.com/v1: no such group version",
    );
}

#[tokio::test]
async fn namespaced_objects_default_to_the_default_namespace_and_cluster_objects_have_none() {
    let cluster = MemoryCluster::new();
    let planned = plan_manifests(
        &cluster,
        &spec_of(vec![
            Manifest(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}})),
            Manifest(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "n", "namespace": "x"}})),
        ]),
    )
    .await;
    let ns = planned[0].target.as_ref().unwrap();
    assert_eq!(
        (
            ns.kind.as_str(),
            ns.namespace.as_str(),
            ns.resource.as_str()
        ),
        ("Namespace", "", "namespaces")
    );
    let cm = planned[1].target.as_ref().unwrap();
    assert_eq!(
        (cm.namespace.as_str(), planned[1].meta.ordinal),
        ("default", 0)
    );
}

#[tokio::test]
async fn one_failing_manifest_does_not_stop_the_others() {
    let cluster = MemoryCluster::new();
    cluster
        .reject(
            "bad",
            422,
            "ConfigMap \"bad\" is invalid: data: Invalid value",
        )
        .await;
    let work = [
        Manifest(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "bad"}})),
        Manifest(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "good"}})),
    ];
    let planned = plan_manifests(&cluster, &spec_of(work.to_vec())).await;
    let outcomes = apply_planned(&cluster, &planned, &ApplyContext::default()).await;
    let failure = outcomes[0].applied.clone().unwrap_err();
    assert_eq!(
        failure.message,
        "ConfigMap \"bad\" is invalid: data: Invalid value"
    );
    assert!(!failure.retryable);
    assert_eq!(outcomes[0].available, Availability::Missing);
    assert_eq!(outcomes[1].applied, Ok(()));
    assert_eq!(outcomes[1].available, Availability::Exists);
    assert!(
        cluster
            .get(outcomes[1].resource.as_ref().unwrap())
            .await
            .is_some()
    );
}

#[tokio::test]
async fn a_crd_applied_first_makes_its_kind_resolvable() {
    let cluster = MemoryCluster::new();
    let crd = json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {"group": "example.com", "scope": "Namespaced",
                 "names": {"kind": "Widget", "plural": "widgets"},
                 "versions": [{"name": "v1"}]}
    });
    let widget =
        json!({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}});
    // Written after the widget; applied before it, and the widget resolves in the same pass.
    let work = [Manifest(widget), Manifest(crd)];
    let planned = plan_manifests(&cluster, &spec_of(work.to_vec())).await;
    assert!(
        planned[1].target.is_err(),
        "the kind is unknown before the CRD is applied"
    );
    let outcomes = apply_planned(&cluster, &planned, &ApplyContext::default()).await;
    assert!(outcomes.iter().all(|o| o.applied.is_ok()), "{outcomes:?}");
    assert_eq!(outcomes[1].meta.resource, "widgets");
}

fn cm(data: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": "cfg", "namespace": "default", "labels": {"from": "hub"}},
           "data": {"k": data}})
}

fn cm_id() -> AppliedResource {
    AppliedResource {
        group: String::new(),
        version: "v1".into(),
        kind: "ConfigMap".into(),
        resource: "configmaps".into(),
        namespace: "default".into(),
        name: "cfg".into(),
    }
}

/// Applies one ConfigMap with `strategy` (OCM's `updateStrategy` JSON) and `context`.
async fn apply_with(
    cluster: &MemoryCluster,
    manifest: Value,
    strategy: Value,
    context: &ApplyContext,
) -> ManifestOutcome {
    let spec: ManifestWorkSpec = serde_json::from_value(json!({
        "workload": {"manifests": [manifest]},
        "manifestConfigs": [{
            "resourceIdentifier": {"resource": "configmaps", "namespace": "default", "name": "cfg"},
            "updateStrategy": strategy,
        }],
    }))
    .unwrap();
    let planned = plan_manifests(cluster, &spec).await;
    apply_planned(cluster, &planned, context).await.remove(0)
}

#[tokio::test]
async fn create_only_creates_once_and_never_updates() {
    let cluster = MemoryCluster::new();
    let strategy = json!({"type": "CreateOnly"});
    let first = apply_with(
        &cluster,
        cm("one"),
        strategy.clone(),
        &ApplyContext::default(),
    )
    .await;
    assert_eq!(first.applied, Ok(()));
    let again = apply_with(&cluster, cm("two"), strategy, &ApplyContext::default()).await;
    assert_eq!(again.applied, Ok(()));
    assert_eq!(cluster.get(&cm_id()).await.unwrap()["data"]["k"], "one");
}

#[tokio::test]
async fn update_merges_labels_keeps_status_and_replaces_the_rest() {
    let cluster = MemoryCluster::new();
    let mut theirs = cm("spoke");
    theirs["metadata"]["labels"] = json!({"team": "ops"});
    cluster
        .apply(&cm_id(), &theirs, "someone", true)
        .await
        .unwrap();
    cluster.set_status(&cm_id(), json!({"seen": true})).await;
    let strategy = json!({"type": "Update"});
    let new = ApplyContext {
        new_generation: true,
        ..ApplyContext::default()
    };
    let o = apply_with(&cluster, cm("hub"), strategy, &new).await;
    assert_eq!(o.applied, Ok(()));
    let stored = cluster.get(&cm_id()).await.unwrap();
    assert_eq!(stored["data"]["k"], "hub");
    assert_eq!(
        stored["metadata"]["labels"],
        json!({"team": "ops", "from": "hub"})
    );
    assert_eq!(stored["status"], json!({"seen": true}));
}

#[tokio::test]
async fn read_only_never_writes_and_reports_what_is_there() {
    let cluster = MemoryCluster::new();
    let strategy = json!({"type": "ReadOnly"});
    let missing = apply_with(
        &cluster,
        cm("x"),
        strategy.clone(),
        &ApplyContext::default(),
    )
    .await;
    assert_eq!(
        (missing.applied, missing.available),
        (Ok(()), Availability::Missing)
    );
    assert!(!missing.owned);
    assert!(
        cluster.get(&cm_id()).await.is_none(),
        "ReadOnly never creates"
    );
    cluster
        .apply(&cm_id(), &cm("theirs"), "someone", true)
        .await
        .unwrap();
    let present = apply_with(&cluster, cm("ours"), strategy, &ApplyContext::default()).await;
    assert_eq!(present.available, Availability::Exists);
    assert_eq!(cluster.get(&cm_id()).await.unwrap()["data"]["k"], "theirs");
}

#[tokio::test]
async fn server_side_apply_with_ignore_fields_json_pointers_leaves_a_spoke_change_alone() {
    let cluster = MemoryCluster::new();
    let mut manifest = cm("hub");
    manifest["data"]["a/b"] = json!("hub");
    let strategy = json!({"type": "ServerSideApply", "serverSideApply": {
        "ignoreFields": [{"condition": "OnSpokePresent", "jsonPointers": ["/data/a~1b"]}]}});
    let o = apply_with(
        &cluster,
        manifest.clone(),
        strategy.clone(),
        &ApplyContext::default(),
    )
    .await;
    assert_eq!(o.applied, Ok(()));
    let stored = cluster.get(&cm_id()).await.unwrap();
    assert_eq!(
        stored["data"]["a/b"], "hub",
        "a new object gets every field"
    );
    let mut changed = stored.clone();
    changed["data"]["a/b"] = json!("spoke");
    cluster
        .apply(&cm_id(), &changed, "someone", true)
        .await
        .unwrap();
    // The hub changes only the ignored field: nothing to apply, the spoke's value stays.
    manifest["data"]["a/b"] = json!("hub, changed");
    apply_with(&cluster, manifest, strategy, &ApplyContext::default()).await;
    assert_eq!(cluster.get(&cm_id()).await.unwrap()["data"]["a/b"], "spoke");
    // A pointer that is not one is refused with OCM's reason.
    let bad = json!({"type": "ServerSideApply", "serverSideApply": {
        "ignoreFields": [{"condition": "OnSpokePresent", "jsonPointers": ["data/k"]}]}});
    let o = apply_with(&cluster, cm("hub"), bad, &ApplyContext::default()).await;
    let refused = o.applied.unwrap_err();
    assert_eq!(refused.reason, REASON_IGNORE_FIELD_ERROR);
    assert!(refused.message.contains("RFC 6901"), "{}", refused.message);
}

#[tokio::test]
async fn server_side_apply_with_ignore_fields_leaves_a_spoke_change_alone() {
    let cluster = MemoryCluster::new();
    let strategy = json!({"type": "ServerSideApply", "serverSideApply": {
        "ignoreFields": [{"condition": "OnSpokePresent", "jsonPaths": [".data.k"]}]}});
    let o = apply_with(
        &cluster,
        cm("hub"),
        strategy.clone(),
        &ApplyContext::default(),
    )
    .await;
    assert_eq!(o.applied, Ok(()));
    let stored = cluster.get(&cm_id()).await.unwrap();
    assert_eq!(stored["data"]["k"], "hub", "a new object gets every field");
    assert!(stored["metadata"]["annotations"][CONFIG_SPEC_HASH_ANNOTATION].is_string());
    // The same manifest again: the hash matches, nothing is applied.
    let mut changed = stored.clone();
    changed["data"]["k"] = json!("spoke");
    cluster
        .apply(&cm_id(), &changed, "someone", true)
        .await
        .unwrap();
    apply_with(
        &cluster,
        cm("hub"),
        strategy.clone(),
        &ApplyContext::default(),
    )
    .await;
    assert_eq!(cluster.get(&cm_id()).await.unwrap()["data"]["k"], "spoke");
    // A bad path is refused with OCM's reason.
    let bad = json!({"type": "ServerSideApply", "serverSideApply": {
        "ignoreFields": [{"condition": "OnSpokePresent", "jsonPaths": ["..k"]}]}});
    let o = apply_with(&cluster, cm("hub"), bad, &ApplyContext::default()).await;
    assert_eq!(o.applied.unwrap_err().reason, REASON_IGNORE_FIELD_ERROR);
    // jq expressions are refused, not ignored.
    let jq = json!({"type": "ServerSideApply", "serverSideApply": {
        "ignoreFields": [{"condition": "OnSpokePresent", "jqPathExpressions": [".data.k"]}]}});
    let o = apply_with(&cluster, cm("hub"), jq, &ApplyContext::default()).await;
    let refused = o.applied.unwrap_err();
    assert_eq!(refused.reason, REASON_IGNORE_FIELD_ERROR);
    assert!(
        refused.message.contains("jqPathExpressions"),
        "{}",
        refused.message
    );
    let manager = json!({"type": "ServerSideApply", "serverSideApply": {"fieldManager": "mine"}});
    let o = apply_with(&cluster, cm("hub"), manager, &ApplyContext::default()).await;
    assert!(
        o.applied
            .unwrap_err()
            .message
            .contains("must start with \"work-agent\"")
    );
}

#[tokio::test]
async fn a_complete_manifest_is_no_longer_updated() {
    let cluster = MemoryCluster::new();
    let strategy = json!({"type": "Update"});
    apply_with(
        &cluster,
        cm("v1"),
        strategy.clone(),
        &ApplyContext::default(),
    )
    .await;
    let complete = ApplyContext {
        complete: [cm_id()].into(),
        new_generation: true,
        ..ApplyContext::default()
    };
    let o = apply_with(&cluster, cm("v2"), strategy, &complete).await;
    assert_eq!(o.applied, Ok(()));
    assert_eq!(cluster.get(&cm_id()).await.unwrap()["data"]["k"], "v1");
}

#[tokio::test]
async fn an_executor_without_the_right_stops_that_manifest_only() {
    let cluster = MemoryCluster::new();
    cluster
        .deny("system:serviceaccount:apps:deployer", "create")
        .await;
    let executor: ManifestWorkExecutor = serde_json::from_value(json!({"subject": {
        "type": "ServiceAccount", "serviceAccount": {"namespace": "apps", "name": "deployer"}}}))
    .unwrap();
    let context = ApplyContext {
        executor: Some(executor),
        ..ApplyContext::default()
    };
    let o = apply_with(&cluster, cm("x"), json!({"type": "Update"}), &context).await;
    let failure = o.applied.unwrap_err();
    assert!(
        failure
            .message
            .contains("may not create configmaps default/cfg"),
        "{}",
        failure.message
    );
    assert!(cluster.get(&cm_id()).await.is_none());
}

#[test]
fn config_identifiers_match_exactly_or_by_wildcard() {
    let id = |ns: &str, name: &str| ResourceIdentifier {
        group: None,
        resource: "configmaps".into(),
        name: name.into(),
        namespace: Some(ns.into()),
    };
    assert!(identifies(&id("default", "cfg"), &cm_id()));
    assert!(identifies(&id("*", "c*"), &cm_id()));
    assert!(identifies(&id("def*t", "*g"), &cm_id()));
    assert!(!identifies(&id("default", "other"), &cm_id()));
    assert!(!identifies(&id("kube-*", "cfg"), &cm_id()));
}

#[test]
fn retryability_follows_the_status_code() {
    let rejected = |code| ApplyError::Rejected {
        code,
        reason: String::new(),
        message: String::new(),
    };
    assert!(!rejected(422).is_retryable());
    assert!(!rejected(403).is_retryable());
    assert!(rejected(409).is_retryable());
    assert!(rejected(429).is_retryable());
    assert!(rejected(503).is_retryable());
    assert!(ApplyError::Unreachable("x".into()).is_retryable());
}

#[tokio::test]
async fn an_in_memory_watch_that_falls_behind_is_sent_the_whole_kind_again() {
    use futures::StreamExt as _;

    let cluster = MemoryCluster::new();
    let kind = cluster.resolve("v1", "ConfigMap").await.unwrap();
    let mut watch = cluster.watch(&kind);
    assert!(matches!(watch.next().await, Some(ObjectEvent::Listed)));
    // More changes than the watch keeps while its reader is away (one deleted among them).
    let mut expected = std::collections::BTreeSet::new();
    for i in 0..100 {
        let name = format!("cm-{i:03}");
        let id = AppliedResource {
            name: name.clone(),
            ..cm_id()
        };
        let object = json!({"apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": {"name": name, "namespace": "default"}});
        cluster.create(&id, &object, "test").await.unwrap();
        expected.insert(name);
    }
    let gone = AppliedResource {
        name: "cm-000".into(),
        ..cm_id()
    };
    ApplyTarget::delete(&cluster, &gone).await.unwrap();
    expected.remove("cm-000");
    let mut seen = std::collections::BTreeSet::new();
    loop {
        match watch.next().await.expect("the watch goes on") {
            ObjectEvent::Changed(object) => {
                seen.insert(object["metadata"]["name"].as_str().unwrap().to_string());
            }
            ObjectEvent::Listed => break,
            ObjectEvent::Deleted { .. } => panic!("a list, not the changes it fell behind on"),
        }
    }
    assert_eq!(seen, expected, "every object there now, then Listed");
}
