//! `ManagedClusterSet` and `ManagedClusterSetBinding` (cluster.open-cluster-management.io/v1beta2).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::schema::{DNS_LABEL, condition_list, label_selector, optional_fields};
use super::serde_util::null_as_default;

/// Which managed clusters belong to a set: OCM's `ManagedClusterSet.spec`.
///
/// `ManagedClusterSet` is cluster-scoped. Placements select clusters only from sets bound to their
/// namespace by a ManagedClusterSetBinding.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[kube(
    group = "cluster.open-cluster-management.io",
    version = "v1beta2",
    kind = "ManagedClusterSet",
    status = "ManagedClusterSetStatus",
    shortname = "mclset",
    shortname = "mclsets",
    derive = "PartialEq",
    derive = "Default",
    doc = "ManagedClusterSet defines a group of ManagedClusters that workloads can be placed on. Membership is by the cluster.open-cluster-management.io/clusterset label (ExclusiveClusterSetLabel) or by a label selector (LabelSelector).",
    printcolumn = r#"{"name": "Empty", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"ClusterSetEmpty\")].status"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("default" = {"clusterSelector": {"selectorType": "ExclusiveClusterSetLabel"}}))]
pub struct ManagedClusterSetSpec {
    /// How member clusters are chosen. Absent means `ExclusiveClusterSetLabel`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = {"selectorType": "ExclusiveClusterSetLabel"}))]
    pub cluster_selector: Option<ManagedClusterSelector>,
    /// Namespaces OCM's agents create on every member cluster. flotilla does not implement
    /// them yet: [`crate::api::validate_cluster_set`] refuses a set that lists any, rather than
    /// store a request nothing would carry out.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub managed_namespaces: Vec<ManagedNamespaceConfig>,
}

/// A namespace a ManagedClusterSet asks for on its member clusters (OCM's
/// `ManagedNamespaceConfig`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ManagedNamespaceConfig {
    /// The namespace's name.
    #[schemars(pattern(DNS_LABEL), length(max = 63))]
    pub name: String,
}

/// How a ManagedClusterSet picks its members (OCM's `ManagedClusterSelector`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
// OCM's schema requires selectorType and defaults it, so the apiserver always stores it.
#[schemars(extend("required" = ["selectorType"]))]
pub struct ManagedClusterSelector {
    /// `ExclusiveClusterSetLabel` (the default) or `LabelSelector`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "ExclusiveClusterSetLabel"))]
    pub selector_type: Option<SelectorType>,
    /// The selector used when `selectorType` is `LabelSelector`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "label_selector")]
    pub label_selector: Option<LabelSelector>,
}

/// The membership rule of a ManagedClusterSet.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, JsonSchema, PartialEq, Eq, Hash, Default)]
pub enum SelectorType {
    /// Members carry the label `cluster.open-cluster-management.io/clusterset: <set name>`; a
    /// cluster is in at most one such set.
    #[default]
    ExclusiveClusterSetLabel,
    /// Members match `labelSelector`; sets may overlap.
    LabelSelector,
}

/// Observed state of a ManagedClusterSet.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ManagedClusterSetStatus {
    /// Condition `ClusterSetEmpty`.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(schema_with = "condition_list")]
    pub conditions: Vec<Condition>,
}

/// Which set a namespace may place on: OCM's `ManagedClusterSetBinding.spec`.
///
/// `ManagedClusterSetBinding` is namespaced and, by OCM convention, named after the set it binds.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[kube(
    group = "cluster.open-cluster-management.io",
    version = "v1beta2",
    kind = "ManagedClusterSetBinding",
    namespaced,
    status = "ManagedClusterSetBindingStatus",
    shortname = "mclsetbinding",
    shortname = "mclsetbindings",
    derive = "PartialEq",
    derive = "Default",
    doc = "ManagedClusterSetBinding projects a ManagedClusterSet into a namespace: Placements in that namespace may select clusters of the bound set."
)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = optional_fields)]
pub struct ManagedClusterSetBindingSpec {
    /// Name of the bound ManagedClusterSet; must equal the binding's own name.
    #[schemars(length(min = 1))]
    pub cluster_set: String,
}

/// Observed state of a ManagedClusterSetBinding.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ManagedClusterSetBindingStatus {
    /// Condition `Bound`.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(schema_with = "condition_list")]
    pub conditions: Vec<Condition>,
}
