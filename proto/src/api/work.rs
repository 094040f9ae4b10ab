//! `ManifestWork` (work.open-cluster-management.io/v1) and `ManifestWorkReplicaSet`
//! (work.open-cluster-management.io/v1alpha1).

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::CustomResource;
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

use super::schema::{DNS_SUBDOMAIN, condition_map, optional_fields};
use super::serde_util::{is_default, null_as_default};
use crate::contract::fence::WriteFence;

/// Finalizer on a ManifestWork until its resources are gone from the managed cluster.
pub const MANIFEST_WORK_CLEANUP_FINALIZER: &str =
    "cluster.open-cluster-management.io/manifest-work-cleanup";

/// The resources to deliver to one managed cluster: OCM's `ManifestWork.spec`.
///
/// `ManifestWork` is namespaced, and its namespace is the target cluster's name: a work in
/// namespace `store-7` goes to the managed cluster `store-7`.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[kube(
    group = "work.open-cluster-management.io",
    version = "v1",
    kind = "ManifestWork",
    namespaced,
    status = "ManifestWorkStatus",
    shortname = "mw",
    derive = "PartialEq",
    derive = "Default",
    doc = "ManifestWork represents a manifests workload that the hub wants to deploy on a managed cluster: a set of Kubernetes resources. It must be created in the cluster namespace on the hub (the namespace named after the managed cluster)."
)]
#[serde(rename_all = "camelCase")]
pub struct ManifestWorkSpec {
    /// The resources to apply.
    #[serde(default, skip_serializing_if = "is_default")]
    pub workload: ManifestsTemplate,

    /// What happens to the applied resources when the work is deleted; `Foreground` (delete them)
    /// when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delete_option: Option<DeleteOption>,

    /// Per-resource options: status feedback, update strategy, condition rules.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub manifest_configs: Vec<ManifestConfigOption>,

    /// The identity the agent applies the resources as; the agent's own when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor: Option<ManifestWorkExecutor>,
}

/// The manifests of a work (OCM's `ManifestsTemplate`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ManifestsTemplate {
    /// Kubernetes objects, applied in order. Their position is the `ordinal` in the status.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub manifests: Vec<Manifest>,
}

/// One Kubernetes object of a ManifestWork, kept verbatim (OCM's `Manifest`, a
/// `runtime.RawExtension`): flotilla never interprets or reorders its content.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(transparent)]
pub struct Manifest(pub serde_json::Value);

impl Manifest {
    fn str_at(&self, pointer: &str) -> Option<&str> {
        self.0.pointer(pointer).and_then(serde_json::Value::as_str)
    }

    /// `apiVersion`, e.g. `apps/v1`.
    pub fn api_version(&self) -> Option<&str> {
        self.str_at("/apiVersion")
    }

    /// `kind`, e.g. `Deployment`.
    pub fn kind(&self) -> Option<&str> {
        self.str_at("/kind")
    }

    /// `metadata.name`.
    pub fn name(&self) -> Option<&str> {
        self.str_at("/metadata/name")
    }

    /// `metadata.namespace`; `None` for cluster-scoped objects or objects that rely on a default.
    pub fn namespace(&self) -> Option<&str> {
        self.str_at("/metadata/namespace")
    }
}

impl From<serde_json::Value> for Manifest {
    fn from(value: serde_json::Value) -> Self {
        Manifest(value)
    }
}

impl JsonSchema for Manifest {
    fn schema_name() -> Cow<'static, str> {
        "Manifest".into()
    }

    // The apiserver must keep the object as written (preserve-unknown-fields) and treat it as a
    // whole Kubernetes object (embedded-resource: apiVersion, kind and metadata are checked and
    // metadata is pruned like any object's), exactly like OCM's CRD.
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "A Kubernetes resource to be deployed on the managed cluster.",
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": true,
            "x-kubernetes-embedded-resource": true,
        })
    }
}

/// What to do with the applied resources when the work goes away (OCM's `DeleteOption`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DeleteOption {
    /// `Foreground`, `Orphan` or `SelectivelyOrphan`.
    #[serde(default)]
    pub propagation_policy: PropagationPolicy,
    /// The resources to orphan under `SelectivelyOrphan`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selectively_orphans: Option<SelectivelyOrphan>,
    /// Delete the work this long after it completed (per its condition rules).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds_after_finished: Option<i64>,
}

/// What deleting a ManifestWork does to its resources.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, JsonSchema, PartialEq, Eq, Hash, Default)]
pub enum PropagationPolicy {
    /// Delete every applied resource (OCM's default).
    #[default]
    Foreground,
    /// Leave every applied resource on the cluster.
    Orphan,
    /// Leave the resources named in `selectivelyOrphans`, delete the rest.
    SelectivelyOrphan,
}

/// Resources to orphan (OCM's `SelectivelyOrphan`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SelectivelyOrphan {
    /// Each rule names one resource of this work.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub orphaning_rules: Vec<ResourceIdentifier>,
}

/// One resource by group, resource, namespace and name (OCM's `ResourceIdentifier`, also its
/// `OrphaningRule`).
// `group` and `namespace` are optional in OCM yet written as `""` by many examples; they are
// `Option` here so that both spellings survive a round trip. `group()` and `namespace()` read
// them with `""` for absent.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Hash, Default)]
#[serde(rename_all = "camelCase")]
pub struct ResourceIdentifier {
    /// API group; empty is the core group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Resource (plural, lower-case), e.g. `deployments`.
    pub resource: String,
    /// Object name.
    pub name: String,
    /// Object namespace; empty for cluster-scoped objects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

impl ResourceIdentifier {
    /// The API group, `""` for the core group.
    pub fn group(&self) -> &str {
        self.group.as_deref().unwrap_or("")
    }

    /// The namespace, `""` for cluster-scoped objects.
    pub fn namespace(&self) -> &str {
        self.namespace.as_deref().unwrap_or("")
    }
}

/// Options for one resource of the work (OCM's `ManifestConfigOption`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ManifestConfigOption {
    /// The resource these options apply to.
    pub resource_identifier: ResourceIdentifier,
    /// Status fields to report back in `statusFeedback`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub feedback_rules: Vec<FeedbackRule>,
    /// How to update the resource; `Update` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_strategy: Option<UpdateStrategy>,
    /// How to derive conditions (e.g. `Complete`) from the resource, one rule per condition.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["condition"]))]
    pub condition_rules: Vec<ConditionRule>,
    /// How the agent learns of status changes for feedback: `Poll` (OCM's default: at every
    /// resync) or `Watch` (on every change). flotilla's agent does both for every manifest whose
    /// status it reads: it watches the resource and marks the work dirty on a change (reported
    /// at most once per feedback interval), and re-reads it at its jittered resync; so both
    /// values get what they ask for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "Poll"))]
    pub feedback_scrape_type: Option<FeedbackScrapeType>,
}

/// How the agent learns of a resource's status changes (OCM's `FeedBackScrapeType`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, JsonSchema, PartialEq, Eq, Hash, Default)]
pub enum FeedbackScrapeType {
    /// Read the status periodically.
    #[default]
    Poll,
    /// Watch the resource.
    Watch,
}

/// A status feedback rule (OCM's `FeedbackRule`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct FeedbackRule {
    /// `WellKnownStatus` or `JSONPaths`.
    #[serde(rename = "type")]
    pub type_: FeedbackType,
    /// The paths to report when `type` is `JSONPaths`, one per name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub json_paths: Vec<JsonPath>,
}

/// Which status fields a feedback rule reports.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, JsonSchema, PartialEq, Eq, Hash, Default)]
pub enum FeedbackType {
    /// Fields the agent knows for common kinds (e.g. a Deployment's replicas).
    #[default]
    WellKnownStatus,
    /// The fields named by `jsonPaths`.
    #[serde(rename = "JSONPaths")]
    JsonPaths,
}

/// One status field to report (OCM's `JsonPath`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct JsonPath {
    /// Name under which the value is reported.
    pub name: String,
    /// Version of the resource to read; the preferred one when empty.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub version: String,
    /// kubectl-style JSON path under `.status`, e.g. `.status.readyReplicas`.
    pub path: String,
}

/// How to update a resource (OCM's `UpdateStrategy`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("required" = ["type"]))]
pub struct UpdateStrategy {
    /// `Update`, `CreateOnly`, `ServerSideApply` or `ReadOnly`.
    #[serde(rename = "type", default)]
    #[schemars(extend("default" = "Update"))]
    pub type_: UpdateStrategyType,
    /// Options for `ServerSideApply`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_side_apply: Option<ServerSideApplyConfig>,
}

/// How the agent writes a resource to the managed cluster.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, JsonSchema, PartialEq, Eq, Hash, Default)]
pub enum UpdateStrategyType {
    /// Replace the resource with an update call (OCM's default).
    #[default]
    Update,
    /// Create the resource if missing, never update it.
    CreateOnly,
    /// Server-side apply, with the agent as field manager.
    ServerSideApply,
    /// Only check that the resource exists (and report feedback).
    ReadOnly,
}

/// Server-side apply options (OCM's `ServerSideApplyConfig`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ServerSideApplyConfig {
    /// Take over conflicting fields. Absent means `false`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub force: Option<bool>,
    /// Field manager; OCM's default is `work-agent` and it must start with it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(pattern("^work-agent"), extend("default" = "work-agent"))]
    pub field_manager: String,
    /// Fields left alone on the spoke, one entry per condition.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["condition"]))]
    pub ignore_fields: Vec<IgnoreField>,
}

/// Fields the agent leaves alone (OCM's `IgnoreField`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("required" = ["condition"]))]
pub struct IgnoreField {
    /// `OnSpokePresent` (OCM's default) or `OnSpokeChange`.
    #[serde(default = "on_spoke_present")]
    #[schemars(extend(
        "enum" = ["OnSpokePresent", "OnSpokeChange"],
        "default" = "OnSpokePresent"
    ))]
    pub condition: String,
    /// JSON paths of the ignored fields.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub json_paths: Vec<String>,
    /// RFC 6901 JSON pointers of the ignored fields (`/spec/replicas`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub json_pointers: Vec<String>,
    /// jq path expressions of the ignored fields. flotilla does not evaluate jq;
    /// [`crate::api::validate_manifest_work`] refuses entries that use them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub jq_path_expressions: Vec<String>,
}

fn on_spoke_present() -> String {
    "OnSpokePresent".to_owned()
}

/// A rule that sets a condition on a manifest (OCM's `ConditionRule`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
#[schemars(extend(
    "required" = ["condition", "type"],
    "x-kubernetes-validations" = [{
        "rule": "self.type != 'CEL' || self.condition != \"\"",
        "message": "a CEL condition rule names its condition",
    }]
))]
pub struct ConditionRule {
    /// Condition type to set; `Complete` for `WellKnownConditions` when empty. A `Complete`
    /// condition that turns true stops further updates of the manifest.
    // Required by OCM's schema; read as empty when absent (the sled backend's older objects).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub condition: String,
    /// `WellKnownConditions` or `CEL`. (OCM's earlier spelling `WellKnownCompletions` is
    /// accepted by the sled backend; OCM's schema, and so the kube backend's, refuses it.)
    #[serde(rename = "type")]
    #[schemars(extend("enum" = ["WellKnownConditions", "CEL"]))]
    pub type_: String,
    /// CEL expressions, ANDed, when `type` is `CEL`.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub cel_expressions: Vec<String>,
    /// Message of the condition.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// CEL expression producing the message.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message_expression: String,
}

/// The identity the agent applies as (OCM's `ManifestWorkExecutor`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = optional_fields)]
pub struct ManifestWorkExecutor {
    /// The subject to act as.
    pub subject: ManifestWorkExecutorSubject,
}

/// The subject of an executor (OCM's `ManifestWorkExecutorSubject`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ManifestWorkExecutorSubject {
    /// `ServiceAccount`.
    #[serde(rename = "type")]
    #[schemars(extend("enum" = ["ServiceAccount"]))]
    pub type_: String,
    /// The service account, when `type` is `ServiceAccount`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account: Option<ServiceAccountSubject>,
}

/// A service account on the managed cluster (OCM's `ManifestWorkSubjectServiceAccount`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ServiceAccountSubject {
    /// Namespace of the service account.
    #[schemars(pattern(DNS_SUBDOMAIN), length(min = 1, max = 253))]
    pub namespace: String,
    /// Name of the service account.
    #[schemars(pattern(DNS_SUBDOMAIN), length(min = 1, max = 253))]
    pub name: String,
}

/// What the agent reports about a work: OCM's `ManifestWork.status`.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ManifestWorkStatus {
    /// Conditions `Applied`, `Available`, `Degraded` and `Progressing` of the work as a whole.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(schema_with = "condition_map")]
    pub conditions: Vec<Condition>,
    /// Per-resource status.
    #[serde(default, skip_serializing_if = "is_default")]
    pub resource_status: ManifestResourceStatus,
    /// flotilla's addition to OCM's status: the fencing record of the last gateway write of
    /// this status (shard, lease epoch, gateway, the agent's report sequence). The store
    /// refuses a gateway's write under an older epoch of the same shard, or of an older report;
    /// other writers keep the record as stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<WriteFence>,
}

/// Per-resource status of a work (OCM's `ManifestResourceStatus`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ManifestResourceStatus {
    /// One entry per manifest, identified by `resourceMeta.ordinal`.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub manifests: Vec<ManifestCondition>,
}

/// The status of one manifest (OCM's `ManifestCondition`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("required" = ["conditions", "resourceMeta"]))]
pub struct ManifestCondition {
    /// Which manifest, and what it resolved to.
    pub resource_meta: ManifestResourceMeta,
    /// Values of the fields asked for by the feedback rules.
    #[serde(default, skip_serializing_if = "is_default")]
    pub status_feedback: StatusFeedbackResult,
    /// `Applied`, `Available`, `Degraded`, `Progressing` for this resource.
    #[serde(default, deserialize_with = "null_as_default")]
    #[schemars(schema_with = "condition_map")]
    pub conditions: Vec<Condition>,
}

/// A manifest's position and identity (OCM's `ManifestResourceMeta`).
// OCM's Go type writes every field, even empty ones, so this does too.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Hash, Default)]
#[serde(rename_all = "camelCase")]
pub struct ManifestResourceMeta {
    /// Index of the manifest in `spec.workload.manifests`, from 0.
    pub ordinal: i32,
    /// API group; empty for the core group.
    #[serde(default)]
    pub group: String,
    /// API version.
    #[serde(default)]
    pub version: String,
    /// Kind.
    #[serde(default)]
    pub kind: String,
    /// Resource (plural, lower-case).
    #[serde(default)]
    pub resource: String,
    /// Name.
    #[serde(default)]
    pub name: String,
    /// Namespace; empty for cluster-scoped objects.
    #[serde(default)]
    pub namespace: String,
}

/// Reported values (OCM's `StatusFeedbackResult`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct StatusFeedbackResult {
    /// One value per reported field.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub values: Vec<FeedbackValue>,
}

/// One reported field (OCM's `FeedbackValue`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct FeedbackValue {
    /// The name from the feedback rule.
    pub name: String,
    /// The value.
    pub field_value: FieldValue,
}

/// A reported value, tagged by type (OCM's `FieldValue`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct FieldValue {
    /// `Integer`, `String`, `Boolean` or `JsonRaw`: which of the other fields is set.
    #[serde(rename = "type")]
    #[schemars(extend("enum" = ["Integer", "String", "Boolean", "JsonRaw"]))]
    pub type_: String,
    /// Set when `type` is `Integer`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub integer: Option<i64>,
    /// Set when `type` is `String`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub string: Option<String>,
    /// Set when `type` is `Boolean`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boolean: Option<bool>,
    /// Set when `type` is `JsonRaw`: a JSON document of at most 1024 bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub json_raw: Option<String>,
}

/// One ManifestWork template rolled out to the clusters of some placements: OCM's
/// `ManifestWorkReplicaSet.spec`.
///
/// `ManifestWorkReplicaSet` is namespaced; its placements live in the same namespace, and it
/// creates one ManifestWork in each selected cluster's namespace.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[kube(
    group = "work.open-cluster-management.io",
    version = "v1alpha1",
    kind = "ManifestWorkReplicaSet",
    namespaced,
    status = "ManifestWorkReplicaSetStatus",
    shortname = "mwrs",
    derive = "PartialEq",
    derive = "Default",
    doc = "ManifestWorkReplicaSet applies a ManifestWork to the clusters selected by Placements (0..n ManagedClusters, in their namespaces), following each placement's rollout strategy, and removes those ManifestWorks when deleted.",
    printcolumn = r#"{"name": "Placement", "type": "string", "description": "Reason", "jsonPath": ".status.conditions[?(@.type==\"PlacementVerified\")].reason"}"#,
    printcolumn = r#"{"name": "Found", "type": "string", "description": "Configured", "jsonPath": ".status.conditions[?(@.type==\"PlacementVerified\")].status"}"#,
    printcolumn = r#"{"name": "ManifestWorks", "type": "string", "description": "Reason", "jsonPath": ".status.conditions[?(@.type==\"ManifestworkApplied\")].reason"}"#,
    printcolumn = r#"{"name": "Applied", "type": "string", "description": "Applied", "jsonPath": ".status.conditions[?(@.type==\"ManifestworkApplied\")].status"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("required" = ["cascadeDeletionPolicy", "placementRefs"]))]
pub struct ManifestWorkReplicaSetSpec {
    /// The spec of every ManifestWork created.
    // Optional in OCM's schema; a template without manifests is refused by validation.
    #[serde(default)]
    pub manifest_work_template: ManifestWorkSpec,
    /// Placements in this namespace whose clusters get the work, with a rollout strategy each.
    #[schemars(length(min = 1))]
    pub placement_refs: Vec<LocalPlacementReference>,
    /// `Background` (OCM's default: delete the replica set at once) or `Foreground` (wait until
    /// its ManifestWorks are gone).
    // Required by OCM's schema, which defaults it: the apiserver always stores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "cascade_deletion_policy")]
    pub cascade_deletion_policy: Option<CascadeDeletionPolicy>,
}

fn cascade_deletion_policy(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "string",
        "enum": ["Background", "Foreground"],
        "default": "Background",
    })
}

/// Whether deleting a ManifestWorkReplicaSet waits for its ManifestWorks to go.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, JsonSchema, PartialEq, Eq, Hash, Default)]
pub enum CascadeDeletionPolicy {
    #[default]
    Background,
    Foreground,
}

/// A Placement in the replica set's namespace (OCM's `LocalPlacementReference`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct LocalPlacementReference {
    /// Placement name.
    #[schemars(length(min = 1))]
    pub name: String,
    /// How to roll out to its clusters; `All` at once when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = {"all": {"progressDeadline": "None"}, "type": "All"}))]
    pub rollout_strategy: Option<RolloutStrategy>,
}

/// How a workload reaches the selected clusters (OCM's `RolloutStrategy`, from
/// cluster.open-cluster-management.io/v1alpha1).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RolloutStrategy {
    /// `All`, `Progressive` or `ProgressivePerGroup`; `All` when absent.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "All"))]
    pub type_: Option<RolloutType>,
    /// Options for `All`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub all: Option<RolloutAll>,
    /// Options for `Progressive`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progressive: Option<RolloutProgressive>,
    /// Options for `ProgressivePerGroup`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progressive_per_group: Option<RolloutProgressivePerGroup>,
}

/// How a rollout proceeds over the selected clusters.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, JsonSchema, PartialEq, Eq, Hash, Default)]
pub enum RolloutType {
    /// Every selected cluster at once.
    #[default]
    All,
    /// Cluster by cluster, `maxConcurrency` at a time.
    Progressive,
    /// Decision group by decision group.
    ProgressivePerGroup,
}

/// Options of the `All` rollout (OCM's `RolloutAll`, i.e. its `RolloutConfig`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RolloutAll {
    /// Soak time after success before the rollout proceeds, e.g. `5m`; `0` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "0"))]
    pub min_success_time: Option<String>,
    /// How long a cluster may take to succeed, e.g. `10m`, or `None` (forever, OCM's default).
    /// OCM's earlier name for it, `timeout`, is read too.
    #[serde(default, alias = "timeout", skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(r"^(([0-9])+[h|m|s])|None$"), extend("default" = "None"))]
    pub progress_deadline: Option<String>,
    /// Failures tolerated before the rollout stops, a count or a percentage; 0 when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "max_failures")]
    pub max_failures: Option<IntOrString>,
}

/// A count or a percentage of clusters, as OCM's rollout fields take them.
const COUNT_OR_PERCENT: &str = "^((100|[0-9]{1,2})%|[0-9]+)$";

fn max_failures(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "anyOf": [{ "type": "integer" }, { "type": "string" }],
        "x-kubernetes-int-or-string": true,
        "pattern": COUNT_OR_PERCENT,
        "default": 0,
    })
}

fn max_concurrency(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "anyOf": [{ "type": "integer" }, { "type": "string" }],
        "x-kubernetes-int-or-string": true,
        "pattern": COUNT_OR_PERCENT,
    })
}

/// Options of the `Progressive` rollout (OCM's `RolloutProgressive`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RolloutProgressive {
    /// Soak time after success before the rollout proceeds, e.g. `5m`; `0` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "0"))]
    pub min_success_time: Option<String>,
    /// How long a cluster may take to succeed, e.g. `10m`, or `None` (forever, OCM's default).
    /// OCM's earlier name for it, `timeout`, is read too.
    #[serde(default, alias = "timeout", skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(r"^(([0-9])+[h|m|s])|None$"), extend("default" = "None"))]
    pub progress_deadline: Option<String>,
    /// Failures tolerated before the rollout stops, a count or a percentage; 0 when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "max_failures")]
    pub max_failures: Option<IntOrString>,
    /// Groups that go first and must succeed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mandatory_decision_groups: Vec<MandatoryDecisionGroup>,
    /// Clusters updated at once, a count or a percentage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "max_concurrency")]
    pub max_concurrency: Option<IntOrString>,
}

/// Options of the `ProgressivePerGroup` rollout (OCM's `RolloutProgressivePerGroup`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RolloutProgressivePerGroup {
    /// Soak time after success before the rollout proceeds, e.g. `5m`; `0` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "0"))]
    pub min_success_time: Option<String>,
    /// How long a cluster may take to succeed, e.g. `10m`, or `None` (forever, OCM's default).
    /// OCM's earlier name for it, `timeout`, is read too.
    #[serde(default, alias = "timeout", skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(r"^(([0-9])+[h|m|s])|None$"), extend("default" = "None"))]
    pub progress_deadline: Option<String>,
    /// Failures tolerated before the rollout stops, a count or a percentage; 0 when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "max_failures")]
    pub max_failures: Option<IntOrString>,
    /// Groups that go first and must succeed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mandatory_decision_groups: Vec<MandatoryDecisionGroup>,
}

/// A decision group by name or index (OCM's `MandatoryDecisionGroup`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct MandatoryDecisionGroup {
    /// Group name (the `decision-group-name` label); tried before the index.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub group_name: String,
    /// Group index (the `decision-group-index` label).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_index: Option<i32>,
}

/// Progress of a replica set: OCM's `ManifestWorkReplicaSet.status`.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ManifestWorkReplicaSetStatus {
    /// Conditions `PlacementVerified`, `PlacementRolledOut` and `ManifestworkApplied`.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(schema_with = "condition_map")]
    pub conditions: Vec<Condition>,
    /// Totals over every placement.
    // Always written, like OCM's Go type.
    #[serde(default)]
    pub summary: ManifestWorkReplicaSetSummary,
    /// Totals per placement.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub placement_summary: Vec<PlacementSummary>,
}

/// Totals for one placement (OCM's `PlacementSummary`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PlacementSummary {
    /// Placement name.
    #[serde(default)]
    pub name: String,
    /// Human-readable progress over decision groups, e.g. `3 (20 / 30 clusters applied)`.
    #[serde(default)]
    pub available_decision_groups: String,
    /// The placement's totals.
    #[serde(default)]
    pub summary: ManifestWorkReplicaSetSummary,
}

/// Counts of ManifestWorks by condition (OCM's `ManifestWorkReplicaSetSummary`).
// OCM's Go type writes every field, even zeros, so this does too.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ManifestWorkReplicaSetSummary {
    /// ManifestWorks managed by the replica set.
    #[serde(default)]
    pub total: i32,
    /// Of which `Progressing=True`.
    #[serde(default)]
    pub progressing: i32,
    /// Of which `Available=True`.
    #[serde(default)]
    pub available: i32,
    /// Of which `Degraded=True`.
    #[serde(default)]
    pub degraded: i32,
    /// Of which `Applied=True`.
    #[serde(default)]
    pub applied: i32,
    /// ManifestWorks the replica set will create in all.
    #[serde(default)]
    pub desired_total: i32,
    /// Clusters with the latest revision applied.
    #[serde(default)]
    pub updated: i32,
}
