//! `ManagedCluster` (cluster.open-cluster-management.io/v1) and the spoke-side `ClusterClaim`
//! (cluster.open-cluster-management.io/v1alpha1).

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};

use super::schema::{DNS_LABEL, QUALIFIED_NAME, condition_map};
use super::serde_util::{is_default, null_as_default};
use crate::contract::fence::WriteFence;

/// Label on a ManagedCluster naming the ManagedClusterSet it belongs to
/// (`selectorType: ExclusiveClusterSetLabel`).
pub const CLUSTER_SET_LABEL: &str = "cluster.open-cluster-management.io/clusterset";

/// Taint the hub adds while the cluster's `ManagedClusterConditionAvailable` is `Unknown` or
/// missing (the agent's session is gone past its grace period). Effect `NoSelect`, empty value.
pub const TAINT_UNREACHABLE: &str = "cluster.open-cluster-management.io/unreachable";
/// Taint the hub adds while the cluster's `ManagedClusterConditionAvailable` is `False`.
pub const TAINT_UNAVAILABLE: &str = "cluster.open-cluster-management.io/unavailable";

/// What the hub wants from the agent of one managed cluster: OCM's `ManagedCluster.spec`.
///
/// The `ManagedCluster` kind itself is cluster-scoped and named after the cluster; the hub keeps
/// the cluster's other objects (ManifestWorks, AddOnPlacementScores) in the namespace of the same
/// name.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[kube(
    group = "cluster.open-cluster-management.io",
    version = "v1",
    kind = "ManagedCluster",
    status = "ManagedClusterStatus",
    shortname = "mcl",
    shortname = "mcls",
    derive = "PartialEq",
    derive = "Default",
    doc = "ManagedCluster represents the desired state and current status of a managed cluster. ManagedCluster is a cluster-scoped resource named after the cluster; joining is a double opt-in: the agent registers, and the hub admin sets spec.hubAcceptsClient.",
    printcolumn = r#"{"name": "Hub Accepted", "type": "boolean", "jsonPath": ".spec.hubAcceptsClient"}"#,
    printcolumn = r#"{"name": "Managed Cluster URLs", "type": "string", "jsonPath": ".spec.managedClusterClientConfigs[*].url"}"#,
    printcolumn = r#"{"name": "Joined", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"ManagedClusterJoined\")].status"}"#,
    printcolumn = r#"{"name": "Available", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"ManagedClusterConditionAvailable\")].status"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ManagedClusterSpec {
    /// The apiserver addresses of the managed cluster. Empty when the hub has no route to it
    /// (flotilla reaches spokes through the agent's tunnel, so this is informational).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub managed_cluster_client_configs: Vec<ClientConfig>,

    /// Whether the hub accepts the agent's join; only a hub admin may set it.
    // Always written: OCM's Go type has no `omitempty` here.
    #[serde(default)]
    pub hub_accepts_client: bool,

    /// How often the agent must prove it is alive; OCM's default is 60 seconds (the CRD's
    /// default). flotilla's hub judges liveness by the agent's session instead (its grace
    /// period), so the value is carried for OCM's clients.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = 60))]
    pub lease_duration_seconds: Option<i32>,

    /// Taints repel placements that do not tolerate them.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub taints: Vec<Taint>,
}

/// One apiserver address of a managed cluster (OCM's `ClientConfig`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ClientConfig {
    /// URL of the managed cluster's apiserver.
    pub url: String,
    /// CA bundle to verify that apiserver (base64 in YAML). System roots when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "base64_bytes")]
    pub ca_bundle: Option<ByteString>,
}

/// Go's `[]byte` in JSON: a base64 string.
fn base64_bytes(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({ "type": "string", "format": "byte" })
}

/// A taint on a managed cluster: placements that do not tolerate it are affected by `effect`.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Taint {
    /// Taint key, e.g. `cluster.open-cluster-management.io/unreachable`.
    #[schemars(pattern(QUALIFIED_NAME), length(max = 316))]
    pub key: String,
    /// Taint value; empty for the hub's own taints.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 1024))]
    pub value: String,
    /// What the taint does to placements that do not tolerate it.
    pub effect: TaintEffect,
    /// When the taint was added; `tolerationSeconds` counts from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_added: Option<Time>,
}

/// The effect of a taint on placements that do not tolerate it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, JsonSchema, PartialEq, Eq, Hash, Default)]
pub enum TaintEffect {
    /// The placement may not select the cluster, and drops it if already selected.
    #[default]
    NoSelect,
    /// The placement avoids the cluster when it can.
    PreferNoSelect,
    /// The placement may keep the cluster if already selected, but not newly select it.
    NoSelectIfNew,
}

/// What the hub observes about a managed cluster: OCM's `ManagedCluster.status`.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ManagedClusterStatus {
    /// Conditions of type `HubAcceptedManagedCluster`, `ManagedClusterJoined` and
    /// `ManagedClusterConditionAvailable`.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(schema_with = "condition_map")]
    pub conditions: Vec<Condition>,
    /// Total resources of the cluster's nodes, by resource name (`cpu`, `memory`, ...).
    #[serde(
        default,
        deserialize_with = "resource_list",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    #[schemars(schema_with = "resource_list_schema")]
    pub capacity: BTreeMap<String, Quantity>,
    /// Allocatable resources of the cluster's nodes, by resource name.
    #[serde(
        default,
        deserialize_with = "resource_list",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    #[schemars(schema_with = "resource_list_schema")]
    pub allocatable: BTreeMap<String, Quantity>,
    /// The managed cluster's Kubernetes version.
    #[serde(default, skip_serializing_if = "is_default")]
    pub version: ManagedClusterVersion,
    /// ClusterClaims the agent collected on the spoke, projected here read-only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cluster_claims: Vec<ManagedClusterClaim>,
    /// Namespaces the cluster's ManagedClusterSets ask for on it (OCM's
    /// `ClusterSetManagedNamespaceConfig`), with their conditions. Written by OCM's registration
    /// agent; flotilla refuses sets that ask for managed namespaces (see
    /// [`crate::api::validate_cluster_set`]), so its hub never writes entries here and carries
    /// what another writer put.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["clusterSet", "name"]
    ))]
    pub managed_namespaces: Vec<ClusterSetManagedNamespaceConfig>,
    /// flotilla's addition to OCM's status: the fencing record of the last gateway write of
    /// this cluster's health (shard, lease epoch, gateway). The store refuses a gateway's write
    /// under an older epoch of the same shard; other writers keep the record as stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<WriteFence>,
}

/// A namespace a ManagedClusterSet manages on its member clusters, as reported in
/// `ManagedCluster.status.managedNamespaces` (OCM's `ClusterSetManagedNamespaceConfig`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ClusterSetManagedNamespaceConfig {
    /// The namespace's name on the managed cluster.
    #[schemars(pattern(DNS_LABEL), length(max = 63))]
    pub name: String,
    /// The ManagedClusterSet that asks for the namespace.
    pub cluster_set: String,
    /// The namespace's conditions on the managed cluster.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(schema_with = "condition_map")]
    pub conditions: Vec<Condition>,
}

/// Reads a resource list whose quantities may be written as YAML numbers (`cpu: 24`), as the
/// apiserver accepts them (int-or-string), not only as strings; `null` reads as empty.
fn resource_list<'de, D: Deserializer<'de>>(de: D) -> Result<BTreeMap<String, Quantity>, D::Error> {
    let raw: Option<BTreeMap<String, serde_json::Value>> = Option::deserialize(de)?;
    raw.unwrap_or_default()
        .into_iter()
        .map(|(name, value)| match value {
            serde_json::Value::String(s) => Ok((name, Quantity(s))),
            serde_json::Value::Number(n) => Ok((name, Quantity(n.to_string()))),
            other => Err(D::Error::custom(format!(
                "quantity of {name} must be a string or a number, not {other}"
            ))),
        })
        .collect()
}

/// The schema OCM's CRD gives a `ResourceList`: quantities as int-or-string with Kubernetes'
/// quantity pattern.
fn resource_list_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "additionalProperties": {
            "anyOf": [{ "type": "integer" }, { "type": "string" }],
            "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
            "x-kubernetes-int-or-string": true,
        },
    })
}

/// The managed cluster's versions (OCM's `ManagedClusterVersion`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ManagedClusterVersion {
    /// Kubernetes version of the managed cluster, e.g. `v1.30.2`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub kubernetes: String,
}

/// A ClusterClaim as reported in `ManagedCluster.status.clusterClaims`.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ManagedClusterClaim {
    /// The ClusterClaim's name, e.g. `id.k8s.io`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The ClusterClaim's value.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(min = 1, max = 1024))]
    pub value: String,
}

/// A fact a managed cluster claims about itself: OCM's `ClusterClaim.spec`.
///
/// `ClusterClaim` is cluster-scoped and lives on the spoke, not the hub: the agent collects the
/// claims and reports them in `ManagedCluster.status.clusterClaims`.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[kube(
    group = "cluster.open-cluster-management.io",
    version = "v1alpha1",
    kind = "ClusterClaim",
    derive = "PartialEq",
    derive = "Default",
    doc = "ClusterClaim represents cluster information that a managed cluster claims. ClusterClaims created on a managed cluster are collected and saved into the status of the corresponding ManagedCluster on the hub."
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterClaimSpec {
    /// The claimed value.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(min = 1, max = 1024))]
    pub value: String,
}
