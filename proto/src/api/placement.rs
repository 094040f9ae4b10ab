//! `Placement` and `PlacementDecision` (cluster.open-cluster-management.io/v1beta1), and
//! `AddOnPlacementScore` (cluster.open-cluster-management.io/v1alpha1), the scores a placement's
//! `AddOn` prioritizer reads.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    Condition, LabelSelector, LabelSelectorRequirement, Time,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::cluster::TaintEffect;
use super::schema::{QUALIFIED_NAME, claim_requirements, condition_map, label_selector};
use super::serde_util::null_as_default;

/// Label on a PlacementDecision naming the Placement it belongs to.
pub const PLACEMENT_LABEL: &str = "cluster.open-cluster-management.io/placement";
/// Label on a PlacementDecision naming its decision group.
pub const DECISION_GROUP_NAME_LABEL: &str =
    "cluster.open-cluster-management.io/decision-group-name";
/// Label on a PlacementDecision carrying its decision group index.
pub const DECISION_GROUP_INDEX_LABEL: &str =
    "cluster.open-cluster-management.io/decision-group-index";

/// A rule to select managed clusters: OCM's `Placement.spec`.
///
/// `Placement` is namespaced; it selects from the ManagedClusterSets bound to its namespace, and
/// the hub writes the result into PlacementDecisions labelled with the placement's name. The
/// fields are ANDed; an empty spec selects every cluster of the bound sets.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[kube(
    group = "cluster.open-cluster-management.io",
    version = "v1beta1",
    kind = "Placement",
    namespaced,
    status = "PlacementStatus",
    derive = "PartialEq",
    derive = "Default",
    doc = "Placement defines a rule to select a set of ManagedClusters from the ManagedClusterSets bound to the placement namespace. The selected clusters are written to PlacementDecisions labelled cluster.open-cluster-management.io/placement=<placement name>.",
    printcolumn = r#"{"name": "Succeeded", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"PlacementSatisfied\")].status"}"#,
    printcolumn = r#"{"name": "Reason", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"PlacementSatisfied\")].reason"}"#,
    printcolumn = r#"{"name": "SelectedClusters", "type": "integer", "jsonPath": ".status.numberOfSelectedClusters"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct PlacementSpec {
    /// ManagedClusterSets to select from; empty means every set bound to the namespace, otherwise
    /// the intersection with the bound sets.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cluster_sets: Vec<String>,

    /// How many clusters to select; all that match when absent. Fewer matches than this set
    /// `PlacementSatisfied=False`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub number_of_clusters: Option<i32>,

    /// Selectors a cluster must match; the predicates are ORed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub predicates: Vec<ClusterPredicate>,

    /// How to rank candidates when more match than `numberOfClusters`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prioritizer_policy: Option<PrioritizerPolicy>,

    /// How to spread the decisions over topologies (label or claim values).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spread_policy: Option<SpreadPolicy>,

    /// Taints this placement tolerates.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,

    /// How to split the decisions into groups (used by progressive rollouts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_strategy: Option<DecisionStrategy>,

    /// How decisions are ordered in the PlacementDecisions: `ClusterName` (OCM's default) or
    /// `Score`. flotilla orders by cluster name; [`crate::api::validate_placement`] refuses
    /// `Score`, which it does not implement yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "ClusterName"))]
    pub sort_by: Option<SortBy>,

    /// How often score changes may reschedule the placement, e.g. `1m` (OCM's default).
    /// flotilla's scheduler does not rate-limit rescheduling on score changes;
    /// [`crate::api::validate_placement`] refuses any value but OCM's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(r"^[0-9]+[hms]$"), extend("default" = "1m"))]
    pub score_rate_limit: Option<String>,
}

/// How a placement orders its decisions (OCM's `SortBy`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, JsonSchema, PartialEq, Eq, Hash, Default)]
pub enum SortBy {
    /// By cluster name.
    #[default]
    ClusterName,
    /// By score, highest first.
    Score,
}

/// One way to match clusters (OCM's `ClusterPredicate`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ClusterPredicate {
    /// Clusters that do not match are not selected, and are dropped if they stop matching.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub required_cluster_selector: Option<ClusterSelector>,
}

/// Label, claim and CEL selectors, ANDed (OCM's `ClusterSelector`). Empty matches everything.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ClusterSelector {
    /// Selects by the ManagedCluster's labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "label_selector")]
    pub label_selector: Option<LabelSelector>,
    /// Selects by `status.clusterClaims`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_selector: Option<ClusterClaimSelector>,
    /// Selects by CEL expressions over the ManagedCluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cel_selector: Option<ClusterCelSelector>,
}

/// Label and claim selectors of a decision group, ANDed (OCM's `GroupClusterSelector`): like
/// [`ClusterSelector`] without CEL.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct GroupClusterSelector {
    /// Selects by the ManagedCluster's labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "label_selector")]
    pub label_selector: Option<LabelSelector>,
    /// Selects by `status.clusterClaims`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_selector: Option<ClusterClaimSelector>,
}

impl From<GroupClusterSelector> for ClusterSelector {
    fn from(group: GroupClusterSelector) -> Self {
        ClusterSelector {
            label_selector: group.label_selector,
            claim_selector: group.claim_selector,
            cel_selector: None,
        }
    }
}

/// A query over cluster claims (OCM's `ClusterClaimSelector`): label-selector requirements whose
/// keys are claim names.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ClusterClaimSelector {
    /// Requirements on claims, ANDed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "claim_requirements")]
    pub match_expressions: Vec<LabelSelectorRequirement>,
}

/// CEL expressions over a ManagedCluster (OCM's `ClusterCelSelector`), ANDed.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ClusterCelSelector {
    /// Each must evaluate to true.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cel_expressions: Vec<String>,
}

/// How prioritizers combine (OCM's `PrioritizerPolicy`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PrioritizerPolicy {
    /// `Additive` (the default: unlisted built-in prioritizers keep their default weights) or
    /// `Exact` (only the listed ones count).
    // OCM's schema has no enum here, only the default; our parse refuses other values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "prioritizer_mode")]
    pub mode: Option<PrioritizerPolicyMode>,
    /// The prioritizers and their weights.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub configurations: Vec<PrioritizerConfig>,
}

fn prioritizer_mode(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({ "type": "string", "default": "Additive" })
}

/// How unlisted prioritizers count: `Additive` or `Exact`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, JsonSchema, PartialEq, Eq, Hash, Default)]
pub enum PrioritizerPolicyMode {
    #[default]
    Additive,
    Exact,
}

/// One prioritizer and its weight (OCM's `PrioritizerConfig`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PrioritizerConfig {
    /// Where the score comes from.
    pub score_coordinate: ScoreCoordinate,
    /// Weight in [-10, 10]; OCM defaults it to 1. Final score = sum(weight * score).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = -10, max = 10), extend("default" = 1))]
    pub weight: Option<i32>,
}

/// The source of a score (OCM's `ScoreCoordinate`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ScoreCoordinate {
    /// `BuiltIn` or `AddOn`.
    #[serde(rename = "type")]
    #[schemars(extend("default" = "BuiltIn"))]
    pub type_: ScoreCoordinateType,
    /// Name of a built-in prioritizer: `Balance`, `Steady`, `ResourceAllocatableCPU`,
    /// `ResourceAllocatableMemory`, `Spread`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub built_in: String,
    /// The AddOnPlacementScore to read when `type` is `AddOn`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_on: Option<AddOnScore>,
}

/// Where a score comes from: `BuiltIn` or `AddOn`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, JsonSchema, PartialEq, Eq, Hash, Default)]
pub enum ScoreCoordinateType {
    #[default]
    BuiltIn,
    AddOn,
}

/// A score published in AddOnPlacementScores (OCM's `AddOnScore`): the score `scoreName` of the
/// AddOnPlacementScore named `resourceName` in each cluster's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct AddOnScore {
    /// Name of the AddOnPlacementScore object.
    pub resource_name: String,
    /// Name of the score inside it.
    pub score_name: String,
}

/// How to spread decisions (OCM's `SpreadPolicy`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SpreadPolicy {
    /// Constraints in priority order, at most 8.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub spread_constraints: Vec<SpreadConstraintsTerm>,
}

/// One spread constraint (OCM's `SpreadConstraintsTerm`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SpreadConstraintsTerm {
    /// A label key or a claim name.
    #[schemars(
        pattern(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$"),
        length(max = 316)
    )]
    pub topology_key: String,
    /// `Label` or `Claim`.
    #[schemars(extend("enum" = ["Label", "Claim"]))]
    pub topology_key_type: String,
    /// Largest allowed difference between topologies; OCM defaults it to 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1), extend("default" = 1))]
    pub max_skew: Option<i32>,
    /// `ScheduleAnyway` (OCM's default) or `DoNotSchedule`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(extend("enum" = ["DoNotSchedule", "ScheduleAnyway"], "default" = "ScheduleAnyway"))]
    pub when_unsatisfiable: String,
}

/// A taint this placement tolerates (OCM's `Toleration`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Toleration {
    /// Taint key to match; empty (with `Exists`) matches every taint.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(pattern(QUALIFIED_NAME), length(max = 316))]
    pub key: String,
    /// `Equal` (OCM's default) or `Exists`.
    // OCM's schema has no enum here, only the default; our parse refuses other values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "toleration_operator")]
    pub operator: Option<TolerationOperator>,
    /// Taint value to match with `Equal`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 1024))]
    pub value: String,
    /// Taint effect to match; absent matches every effect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<TaintEffect>,
    /// How long after the taint's `timeAdded` it is tolerated; forever when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub toleration_seconds: Option<i64>,
}

fn toleration_operator(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({ "type": "string", "default": "Equal" })
}

/// How a toleration matches a taint's value: `Equal` or `Exists`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, JsonSchema, PartialEq, Eq, Hash, Default)]
pub enum TolerationOperator {
    #[default]
    Equal,
    Exists,
}

/// How decisions are grouped (OCM's `DecisionStrategy`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DecisionStrategy {
    /// The grouping rules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_strategy: Option<GroupStrategy>,
}

/// The grouping rules of a decision strategy (OCM's `GroupStrategy`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct GroupStrategy {
    /// Named groups, filled first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decision_groups: Vec<DecisionGroup>,
    /// Largest group, as a count or a percentage of the selected clusters; OCM defaults to `100%`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "clusters_per_decision_group")]
    pub clusters_per_decision_group: Option<IntOrString>,
}

fn clusters_per_decision_group(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "anyOf": [{ "type": "integer" }, { "type": "string" }],
        "x-kubernetes-int-or-string": true,
        "default": "100%",
        "pattern": "^((100|[1-9][0-9]{0,1})%|[1-9][0-9]*)$",
    })
}

/// A named decision group (OCM's `DecisionGroup`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DecisionGroup {
    /// Value of the `decision-group-name` label on the group's PlacementDecisions.
    #[schemars(pattern(r"^[a-zA-Z0-9][-A-Za-z0-9_.]{0,61}[a-zA-Z0-9]$"))]
    pub group_name: String,
    /// Which of the selected clusters go into this group.
    pub group_cluster_selector: GroupClusterSelector,
}

/// What the hub decided for a Placement: OCM's `Placement.status`.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PlacementStatus {
    /// How many clusters are selected.
    // Always written, like OCM's Go type.
    #[serde(default)]
    pub number_of_selected_clusters: i32,
    /// The decision groups and their PlacementDecisions.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub decision_groups: Vec<DecisionGroupStatus>,
    /// Conditions `PlacementSatisfied` and `PlacementMisconfigured`.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(schema_with = "condition_map")]
    pub conditions: Vec<Condition>,
    /// When AddOnPlacementScores last changed the decisions (OCM's rate-limited rescheduling).
    /// flotilla's hub does not write it (it refuses `scoreRateLimit` other than the default and
    /// keeps no rate limit); it is carried as stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_score_update_time: Option<Time>,
}

/// One decision group of a placement (OCM's `DecisionGroupStatus`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DecisionGroupStatus {
    /// Index of the group; 0 when there is no decision strategy.
    #[serde(default)]
    pub decision_group_index: i32,
    /// Name from the decision strategy, empty for unnamed groups.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub decision_group_name: String,
    /// Names of the group's PlacementDecisions.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub decisions: Vec<String>,
    /// Number of clusters in the group.
    #[serde(default)]
    pub cluster_count: i32,
}

/// The (absent) spec of a PlacementDecision: OCM's PlacementDecision has no `spec`, only
/// `status`.
// kube's derive needs a struct; `no_spec` flattens this empty one away.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[kube(
    group = "cluster.open-cluster-management.io",
    version = "v1beta1",
    kind = "PlacementDecision",
    namespaced,
    no_spec,
    status = "PlacementDecisionStatus",
    derive = "PartialEq",
    derive = "Default",
    doc = "PlacementDecision holds (part of) the clusters a Placement selected. It carries the label cluster.open-cluster-management.io/placement=<placement name>; a placement with more than 100 decisions has several PlacementDecisions."
)]
pub struct PlacementDecisionFields {}

/// The clusters selected: OCM's `PlacementDecision.status`.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("required" = ["decisions"]))]
pub struct PlacementDecisionStatus {
    /// At most 100 decisions per object.
    #[serde(default, deserialize_with = "null_as_default")]
    #[schemars(length(max = 100))]
    pub decisions: Vec<ClusterDecision>,
}

/// One selected cluster (OCM's `ClusterDecision`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("required" = ["clusterName", "reason"]))]
pub struct ClusterDecision {
    /// Name of the ManagedCluster.
    pub cluster_name: String,
    /// Why it was selected; often empty.
    // Always written, like OCM's Go type, which requires it.
    #[serde(default)]
    pub reason: String,
    /// The cluster's score when the placement sorts by score. flotilla sorts by cluster name
    /// (it refuses `sortBy: Score`), so it writes none and carries what is stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score: Option<i64>,
}

/// The (absent) spec of an AddOnPlacementScore: like PlacementDecision, OCM's kind has only
/// `status`.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[kube(
    group = "cluster.open-cluster-management.io",
    version = "v1alpha1",
    kind = "AddOnPlacementScore",
    namespaced,
    no_spec,
    status = "AddOnPlacementScoreStatus",
    derive = "PartialEq",
    derive = "Default",
    doc = "AddOnPlacementScore is a bundle of scores of one managed cluster, kept in the cluster's namespace, that placements read through AddOn prioritizers."
)]
pub struct AddOnPlacementScoreFields {}

/// Scores of one managed cluster: OCM's `AddOnPlacementScore.status`.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct AddOnPlacementScoreStatus {
    /// Conditions set by the score's owner.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(schema_with = "condition_map")]
    pub conditions: Vec<Condition>,
    /// The scores, each in [-100, 100], one per name.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub scores: Vec<AddOnPlacementScoreItem>,
    /// After this time placements ignore the scores; never when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub valid_until: Option<Time>,
}

/// One named score (OCM's `AddOnPlacementScoreItem`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct AddOnPlacementScoreItem {
    /// Score name, e.g. `cpuAvailable`.
    pub name: String,
    /// Score value in [-100, 100].
    #[schemars(range(min = -100, max = 100))]
    pub value: i32,
}
