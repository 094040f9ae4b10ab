//! The CustomResourceDefinitions of the OCM kinds, generated from the Rust types, for the kube
//! store backend (`kubectl apply --server-side -k deploy/crds`).

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

use super::policy::{ClusterCompliance, PlacementBinding, Policy, PolicySet};
use super::{
    AddOnPlacementScore, ClusterClaim, ManagedCluster, ManagedClusterSet, ManagedClusterSetBinding,
    ManifestChunk, ManifestWork, ManifestWorkReplicaSet, Placement, PlacementDecision,
};

/// The CRDs of the thirteen custom hub kinds (eleven of OCM's, flotilla's ManifestChunk and
/// ClusterCompliance; every [`crate::api::Kind`] but Kubernetes' own ConfigMap, which the
/// apiserver serves natively) and of the spoke's ClusterClaim, in that order: one served and
/// stored version each, with status subresources, printer columns and short names as OCM's
/// own CRDs have them.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![
        ManagedCluster::crd(),
        ManagedClusterSet::crd(),
        ManagedClusterSetBinding::crd(),
        ManifestWork::crd(),
        ManifestWorkReplicaSet::crd(),
        Placement::crd(),
        PlacementDecision::crd(),
        AddOnPlacementScore::crd(),
        ManifestChunk::crd(),
        constrained(Policy::crd(), policy_constraints()),
        placement_binding_crd(),
        constrained(PolicySet::crd(), policy_set_constraints()),
        constrained(ClusterCompliance::crd(), cluster_compliance_constraints()),
        ClusterClaim::crd(),
    ]
}

/// PlacementBinding's CRD, built as kube's derive builds the others: the derive needs a `spec`,
/// and OCM's PlacementBinding keeps `placementRef` and `subjects` at the top level. Its schema
/// goes through the same transforms as the derived ones; OCM gives it a status subresource
/// with an empty status, and so does this.
fn placement_binding_crd() -> CustomResourceDefinition {
    use kube::core::schema::{OptionalEnum, OptionalIntOrString, StructuralSchemaRewriter};
    use schemars::generate::SchemaSettings;
    use schemars::transform::AddNullable;
    use serde_json::json;

    let generate = SchemaSettings::openapi3()
        .with(|s| {
            s.inline_subschemas = true;
            s.meta_schema = None;
        })
        .with_transform(AddNullable::default())
        .with_transform(StructuralSchemaRewriter)
        .with_transform(OptionalEnum)
        .with_transform(OptionalIntOrString)
        .into_generator();
    let mut schema = serde_json::to_value(generate.into_root_schema_for::<PlacementBinding>())
        .expect("a schema serializes");
    let properties = schema["properties"]
        .as_object_mut()
        .expect("PlacementBinding's schema has properties");
    // As in every derived CRD: the apiserver validates metadata itself.
    properties.insert("metadata".into(), json!({ "type": "object" }));
    properties.insert(
        "status".into(),
        json!({
            "description": "PlacementBindingStatus: empty, as OCM's.",
            "type": "object",
        }),
    );
    schema["required"] = json!(["placementRef", "subjects"]);
    let crd = json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": { "name": format!("placementbindings.{}", super::policy::POLICY_GROUP) },
        "spec": {
            "group": super::policy::POLICY_GROUP,
            "names": {
                "kind": "PlacementBinding",
                "plural": "placementbindings",
                "shortNames": ["pb"],
                "singular": "placementbinding",
            },
            "scope": "Namespaced",
            "versions": [{
                "name": "v1",
                "schema": { "openAPIV3Schema": schema },
                "served": true,
                "storage": true,
                "subresources": { "status": {} },
            }],
        },
    });
    let crd =
        serde_json::from_value(crd).expect("PlacementBinding's CRD is a CustomResourceDefinition");
    constrained(crd, placement_binding_constraints())
}

/// What the apiserver can refuse of a governance object by its schema, as OCM's CRDs do, and
/// what flotilla refuses beyond OCM and a schema can say (PlacementRule refs, the bounds):
/// facts merged into the schema node at each path (`[]` for array items). The rest of the
/// slice-1 validators (template contents, globs, intervals, duplicate template names) needs
/// code: the operator API runs it, and the hub's policy controller skips a Policy that fails
/// it, naming the problem in its log.
type Constraints = Vec<(&'static [&'static str], serde_json::Value)>;

/// OCM's compliance states of a root Policy or PolicySet; `Terminating` is a template's only.
const ROOT_COMPLIANCE: [&str; 3] = ["Compliant", "Pending", "NonCompliant"];

fn policy_constraints() -> Constraints {
    use serde_json::json;
    vec![
        (&[], json!({ "required": ["metadata", "spec"] })),
        (
            &["spec"],
            json!({ "required": ["disabled", "policy-templates"] }),
        ),
        (&["status", "compliant"], json!({ "enum": ROOT_COMPLIANCE })),
        (
            &["status", "status", "[]", "compliant"],
            json!({ "enum": ROOT_COMPLIANCE }),
        ),
        (
            &["status", "details", "[]", "compliant"],
            json!({ "enum": ROOT_COMPLIANCE }),
        ),
        (
            &["status", "details", "[]", "history", "[]", "lastTimestamp"],
            json!({ "format": "date-time" }),
        ),
        (
            &["spec", "remediationAction"],
            json!({ "enum": ["Inform", "inform", "Enforce", "enforce"] }),
        ),
        (
            &["spec", "policy-templates"],
            json!({ "maxItems": super::policy::MAX_POLICY_TEMPLATES }),
        ),
    ]
}

fn policy_set_constraints() -> Constraints {
    use serde_json::json;
    vec![
        (&["spec"], json!({ "required": ["policies"] })),
        (&["status", "compliant"], json!({ "enum": ROOT_COMPLIANCE })),
        (
            &["spec", "policies"],
            json!({ "maxItems": super::policy::MAX_SET_POLICIES }),
        ),
        (&["spec", "policies", "[]"], json!({ "minLength": 1 })),
    ]
}

/// The record's bounds, so that the apiserver refuses a record no writer should make; the
/// identity of each entry is required (the hub matches entries to roots by uid).
fn cluster_compliance_constraints() -> Constraints {
    use serde_json::json;
    vec![
        (
            &["status", "policies"],
            json!({ "maxItems": super::policy::MAX_CLUSTER_POLICIES }),
        ),
        (
            &["status", "policies", "[]"],
            json!({
                "required": ["namespace", "name", "uid"],
                "properties": {
                    "namespace": { "minLength": 1 },
                    "name": { "minLength": 1 },
                    "uid": { "minLength": 1 },
                },
            }),
        ),
        (
            &["status", "policies", "[]", "details"],
            json!({ "maxItems": super::policy::MAX_POLICY_TEMPLATES }),
        ),
        (
            &["status", "policies", "[]", "details", "[]", "history"],
            json!({ "maxItems": super::policy::MAX_TEMPLATE_HISTORY }),
        ),
        (
            &[
                "status",
                "policies",
                "[]",
                "details",
                "[]",
                "history",
                "[]",
                "lastTimestamp",
            ],
            json!({ "format": "date-time" }),
        ),
    ]
}

fn placement_binding_constraints() -> Constraints {
    use serde_json::json;
    let reference = |group: &str, kinds: &[&str]| {
        json!({
            "required": ["apiGroup", "kind", "name"],
            "properties": {
                "apiGroup": { "enum": [group], "minLength": 1 },
                "kind": { "enum": kinds, "minLength": 1 },
                "name": { "minLength": 1 },
            },
        })
    };
    vec![
        (
            &["placementRef"],
            reference("cluster.open-cluster-management.io", &["Placement"]),
        ),
        (
            &["subjects"],
            json!({ "minItems": 1, "maxItems": super::policy::MAX_SUBJECTS }),
        ),
        (
            &["subjects", "[]"],
            reference(super::policy::POLICY_GROUP, &["Policy", "PolicySet"]),
        ),
    ]
}

/// Merges each constraint into the CRD's schema; a required field loses the `default` serde's
/// `#[serde(default)]` gave it, so that leaving it out is refused rather than filled with "".
fn constrained(
    mut crd: CustomResourceDefinition,
    constraints: Constraints,
) -> CustomResourceDefinition {
    let version = &mut crd.spec.versions[0];
    let schema = version
        .schema
        .as_mut()
        .and_then(|s| s.open_api_v3_schema.as_mut())
        .expect("a generated CRD has a schema");
    let mut value = serde_json::to_value(&*schema).expect("a schema serializes");
    for (path, facts) in constraints {
        let mut node = &mut value;
        for step in path {
            let next = if *step == "[]" {
                node.get_mut("items")
            } else {
                node.get_mut("properties").and_then(|p| p.get_mut(*step))
            };
            node = next
                .unwrap_or_else(|| panic!("{}: no {path:?} in the schema", crd.spec.names.kind));
        }
        merge(node, facts);
        if let Some(required) = node.get("required").cloned() {
            for field in required.as_array().into_iter().flatten() {
                if let Some(field) = field.as_str()
                    && let Some(property) = node
                        .get_mut("properties")
                        .and_then(|p| p.get_mut(field))
                        .and_then(serde_json::Value::as_object_mut)
                {
                    property.remove("default");
                }
            }
        }
        if node.get("minItems").is_some()
            && let Some(node) = node.as_object_mut()
        {
            node.remove("default");
        }
    }
    *schema = serde_json::from_value(value).expect("a constrained schema is still a schema");
    crd
}

/// `facts` into `node`, objects merged key by key, anything else replaced.
fn merge(node: &mut serde_json::Value, facts: serde_json::Value) {
    match (node, facts) {
        (serde_json::Value::Object(node), serde_json::Value::Object(facts)) => {
            for (key, value) in facts {
                merge(node.entry(key).or_insert(serde_json::Value::Null), value);
            }
        }
        (node, facts) => *node = facts,
    }
}

/// The file name OCM's convention gives a CRD: `<group>_<plural>.yaml`.
pub fn crd_file_name(crd: &CustomResourceDefinition) -> String {
    format!("{}_{}.yaml", crd.spec.group, crd.spec.names.plural)
}

/// Renders a CRD as YAML, deterministically: keys sorted, the same bytes on every run and
/// platform, so the files in deploy/crds can be compared with what the types generate.
pub fn crd_yaml(crd: &CustomResourceDefinition) -> String {
    let value = serde_json::to_value(crd).expect("a CustomResourceDefinition serializes to JSON");
    let mut out = String::from(
        "# Generated from flotilla-proto's api types; do not edit by hand.\n\
         # Regenerate: FLOTILLA_UPDATE_CRDS=1 cargo test -p flotilla-proto --test api_crds\n",
    );
    out.push_str(&super::yaml::to_yaml(&value));
    out
}
