//! The CustomResourceDefinitions of the OCM kinds, generated from the Rust types, for the kube
//! store backend (`kubectl apply --server-side -k deploy/crds`).

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

use super::{
    AddOnPlacementScore, ClusterClaim, ManagedCluster, ManagedClusterSet, ManagedClusterSetBinding,
    ManifestChunk, ManifestWork, ManifestWorkReplicaSet, Placement, PlacementDecision,
};

/// The CRDs of the nine hub kinds (eight of OCM's and flotilla's ManifestChunk) (see [`crate::api::Kind`]) and of the spoke's ClusterClaim,
/// in that order: one served and stored version each, with status subresources, printer columns
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
        ClusterClaim::crd(),
    ]
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
