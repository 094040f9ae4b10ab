//! The CustomResourceDefinitions of the OCM kinds, generated from the Rust types, for the kube
//! store backend (`kubectl apply --server-side -k deploy/crds`).

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

use super::policy::{PlacementBinding, Policy, PolicySet};
use super::{
    AddOnPlacementScore, ClusterClaim, ManagedCluster, ManagedClusterSet, ManagedClusterSetBinding,
    ManifestChunk, ManifestWork, ManifestWorkReplicaSet, Placement, PlacementDecision,
};

/// The CRDs of the twelve hub kinds (eleven of OCM's and flotilla's ManifestChunk) (see
/// [`crate::api::Kind`]) and of the spoke's ClusterClaim, in that order: one served and stored version each, with status subresources, printer columns
/// and short names as OCM's own CRDs have them.
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
        Policy::crd(),
        placement_binding_crd(),
        PolicySet::crd(),
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
    serde_json::from_value(crd).expect("PlacementBinding's CRD is a CustomResourceDefinition")
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
