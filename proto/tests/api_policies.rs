//! Policies written in the shape of OCM's policy-collection (tests/data/policies) parse into
//! flotilla's governance types, serialize back unchanged, pass validation, and evaluate on a
//! cluster as OCM would report them.

use std::collections::BTreeMap;

use flotilla_proto::api::Placement;
use flotilla_proto::api::policy::{
    Compliance, ConfigurationPolicy, EnforceAction, NamespaceInfo, Observed, PlacementBinding,
    Policy, PolicySet, RemediationAction, ResourceKind, effective_remediation, evaluate, reads,
    select_namespaces, validate_configuration_policy, validate_placement_binding, validate_policy,
    validate_policy_set,
};
use serde::Deserialize;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

/// Read when the test runs (cargo sets it), so a test binary built elsewhere reads this
/// checkout.
fn data_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("run by cargo test, which sets it"),
    )
    .join("tests/data/policies")
}

/// Every YAML document of one file, as JSON.
fn documents(file: &str) -> Vec<Value> {
    let path = data_dir().join(file);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    yaml_serde::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{file}: not YAML: {e}")))
        .collect()
}

/// JSON -> `T` -> JSON must give back exactly what was written.
fn round_trip<T: Serialize + DeserializeOwned>(file: &str, original: &Value) -> T {
    let typed: T = serde_json::from_value(original.clone())
        .unwrap_or_else(|e| panic!("{file}: {} does not parse: {e}", original["kind"]));
    let back = serde_json::to_value(&typed).expect("serialize");
    assert_eq!(
        &back, original,
        "{file}: {} changed by a round trip",
        original["kind"]
    );
    typed
}

fn one<T: DeserializeOwned>(file: &str, kind: &str) -> T {
    let doc = documents(file)
        .into_iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("{file} has no {kind}"));
    serde_json::from_value(doc).expect("typed")
}

#[test]
fn collection_examples_parse_round_trip_and_validate() {
    let files: Vec<String> = std::fs::read_dir(data_dir())
        .expect("tests/data/policies")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".yaml"))
        .collect();
    assert!(files.len() >= 3, "the examples are there: {files:?}");
    let mut kinds = BTreeMap::<String, usize>::new();
    for file in &files {
        for doc in documents(file) {
            let kind = doc["kind"].as_str().expect("kind").to_string();
            match kind.as_str() {
                "Policy" => {
                    let policy: Policy = round_trip(file, &doc);
                    assert_eq!(validate_policy(&policy, Some(&doc)), Ok(()), "{file}");
                    for template in &policy.spec.policy_templates {
                        let config: ConfigurationPolicy =
                            round_trip(file, &template.object_definition.0);
                        assert_eq!(
                            validate_configuration_policy(
                                &config,
                                Some(&template.object_definition.0)
                            ),
                            Ok(()),
                            "{file}"
                        );
                    }
                }
                "PlacementBinding" => {
                    let binding: PlacementBinding = round_trip(file, &doc);
                    assert_eq!(
                        validate_placement_binding(&binding, Some(&doc)),
                        Ok(()),
                        "{file}"
                    );
                }
                "PolicySet" => {
                    let set: PolicySet = round_trip(file, &doc);
                    assert_eq!(validate_policy_set(&set, Some(&doc)), Ok(()), "{file}");
                }
                "Placement" => {
                    let _: Placement = round_trip(file, &doc);
                }
                other => panic!("{file}: unexpected kind {other}"),
            }
            *kinds.entry(kind).or_default() += 1;
        }
    }
    assert_eq!(kinds["Policy"], 3);
    assert_eq!(kinds["PlacementBinding"], 3);
    assert_eq!(kinds["PolicySet"], 1);
}

fn template_of(policy: &Policy) -> ConfigurationPolicy {
    serde_json::from_value(policy.spec.policy_templates[0].object_definition.0.clone())
        .expect("a ConfigurationPolicy")
}

#[test]
fn the_limit_range_example_is_answered_per_namespace() {
    let policy: Policy = one("policy-limitrange.yaml", "Policy");
    let config = template_of(&policy);
    let cluster_namespaces: Vec<NamespaceInfo> = ["default", "app-web", "app-api", "app-test"]
        .iter()
        .map(|name| NamespaceInfo {
            name: name.to_string(),
            ..Default::default()
        })
        .collect();
    let selected = select_namespaces(&config.spec.namespace_selector, &cluster_namespaces)
        .expect("valid selector");
    let template = &config.spec.object_templates[0];
    let kind = ResourceKind {
        plural: "limitranges".to_string(),
        namespaced: true,
    };
    // The cluster has the LimitRange in app-web only, with the memory written another way.
    let answers: BTreeMap<_, _> = reads(template, &kind, &selected)
        .expect("reads")
        .into_iter()
        .map(|read| {
            let found = (read.namespace.as_deref() == Some("app-web")).then(|| {
                json!({"apiVersion": "v1", "kind": "LimitRange",
                       "metadata": {"name": "container-mem-limit-range", "namespace": "app-web",
                                    "uid": "5", "resourceVersion": "77"},
                       "spec": {"limits": [{"type": "Container",
                                            "default": {"memory": "0.5Gi"},
                                            "defaultRequest": {"memory": "256Mi"}}]}})
            });
            (read, Observed::Object(found))
        })
        .collect();
    let remediation = effective_remediation(
        policy.spec.remediation_action.as_deref(),
        Some(&config.spec.remediation_action),
    );
    let eval = evaluate(template, remediation, &kind, &selected, &answers);
    assert_eq!(eval.compliance, Compliance::NonCompliant);
    assert_eq!(
        eval.message,
        "limitranges [container-mem-limit-range] not found in namespace app-api"
    );
    assert!(eval.actions.is_empty(), "the example informs only");
}

#[test]
fn the_rbac_example_enforces_through_the_policy() {
    let policy: Policy = one("policy-rbac-anonymous.yaml", "Policy");
    let config = template_of(&policy);
    // The template says inform; the Policy's enforce wins.
    assert_eq!(config.spec.remediation_action, "inform");
    let remediation = effective_remediation(
        policy.spec.remediation_action.as_deref(),
        Some(&config.spec.remediation_action),
    );
    assert_eq!(remediation, RemediationAction::Enforce);
    let kind = ResourceKind {
        plural: "clusterrolebindings".to_string(),
        namespaced: false,
    };
    let cluster = vec![
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": "oops"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:anonymous"},
                            {"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:authenticated"}]}),
    ];
    let mut deleted = Vec::new();
    for template in &config.spec.object_templates {
        let answers: BTreeMap<_, _> = reads(template, &kind, &[])
            .expect("reads")
            .into_iter()
            .map(|read| {
                let observed = match &read.name {
                    Some(name) => Observed::Object(
                        cluster
                            .iter()
                            .find(|o| o["metadata"]["name"] == *name)
                            .cloned(),
                    ),
                    None => Observed::List(cluster.clone()),
                };
                (read, observed)
            })
            .collect();
        let eval = evaluate(template, remediation, &kind, &[], &answers);
        for action in eval.actions {
            match action {
                EnforceAction::Delete { name, .. } => deleted.push(name),
                other => panic!("mustnothave only deletes, got {other:?}"),
            }
        }
    }
    assert_eq!(
        deleted,
        vec!["oops"],
        "found by its fields though named otherwise"
    );
}
