//! Open Cluster Management's resource kinds, verbatim: the hub accepts the YAML from OCM's docs.
//!
//! Each kind has OCM's group, version, kind and field names, so `kubectl apply` of OCM YAML works
//! against the kube backend's CRDs ([`crds`]) and the sled backend's CLI alike. Fields OCM leaves
//! out when empty are left out here too, so OCM YAML survives a parse and re-serialize unchanged.
//!
//! * [`ManagedCluster`], [`ClusterClaim`]: clusters and what they claim about themselves.
//! * [`ManagedClusterSet`], [`ManagedClusterSetBinding`]: groups of clusters, bound to namespaces.
//! * [`Placement`], [`PlacementDecision`], [`AddOnPlacementScore`]: cluster selection.
//! * [`ManifestWork`], [`ManifestWorkReplicaSet`]: what to apply where.
//! * [`policy`] holds governance (`Policy`, `PlacementBinding`, `PolicySet`, `ConfigurationPolicy`)
//!   and the pure evaluator of ConfigurationPolicy templates.
//! * [`ConfigMap`] (Kubernetes' own, `v1`): data the hub's templates read ([`config_map`]).
//! * [`conditions`]: condition types and metav1 update rules; [`content_hash`] for resume;
//!   [`validate_manifest_work`] before storing a work.

pub mod base64;
mod cluster;
mod clusterset;
pub mod conditions;
pub mod config_map;
pub mod content;
mod crd;
mod hash;
mod kind;
mod placement;
pub mod policy;
pub mod quantity;
mod schema;
mod serde_util;
mod validate;
mod work;
mod yaml;

use serde::Serialize;
use serde::de::DeserializeOwned;

pub use cluster::{
    CLUSTER_SET_LABEL, ClientConfig, ClusterClaim, ClusterClaimSpec,
    ClusterSetManagedNamespaceConfig, ManagedCluster, ManagedClusterClaim, ManagedClusterSpec,
    ManagedClusterStatus, ManagedClusterVersion, TAINT_UNAVAILABLE, TAINT_UNREACHABLE, Taint,
    TaintEffect,
};
pub use clusterset::{
    ManagedClusterSelector, ManagedClusterSet, ManagedClusterSetBinding,
    ManagedClusterSetBindingSpec, ManagedClusterSetBindingStatus, ManagedClusterSetSpec,
    ManagedClusterSetStatus, ManagedNamespaceConfig, SelectorType,
};
pub use config_map::{ConfigMap, check_config_map};
pub use content::{ManifestChunk, ManifestChunkSpec};
pub use crd::{crd_file_name, crd_yaml, crds};
pub use hash::{canonical_json, content_hash, value_hash};
pub use kind::Kind;
pub use placement::{
    AddOnPlacementScore, AddOnPlacementScoreFields, AddOnPlacementScoreItem,
    AddOnPlacementScoreStatus, AddOnScore, ClusterCelSelector, ClusterClaimSelector,
    ClusterDecision, ClusterPredicate, ClusterSelector, DECISION_GROUP_INDEX_LABEL,
    DECISION_GROUP_NAME_LABEL, DecisionGroup, DecisionGroupStatus, DecisionStrategy,
    GroupClusterSelector, GroupStrategy, PLACEMENT_LABEL, Placement, PlacementDecision,
    PlacementDecisionFields, PlacementDecisionStatus, PlacementSpec, PlacementStatus,
    PrioritizerConfig, PrioritizerPolicy, PrioritizerPolicyMode, ScoreCoordinate,
    ScoreCoordinateType, SortBy, SpreadConstraintsTerm, SpreadPolicy, Toleration,
    TolerationOperator,
};
pub use validate::{
    MAX_WORKLOAD_BYTES, ManifestError, UnsupportedField, validate_cluster_set,
    validate_manifest_work, validate_placement,
};
pub use work::{
    CascadeDeletionPolicy, ConditionRule, DeleteOption, FeedbackRule, FeedbackScrapeType,
    FeedbackType, FeedbackValue, FieldValue, IgnoreField, JsonPath, LocalPlacementReference,
    MANIFEST_WORK_CLEANUP_FINALIZER, MandatoryDecisionGroup, Manifest, ManifestCondition,
    ManifestConfigOption, ManifestResourceMeta, ManifestResourceStatus, ManifestWork,
    ManifestWorkExecutor, ManifestWorkExecutorSubject, ManifestWorkReplicaSet,
    ManifestWorkReplicaSetSpec, ManifestWorkReplicaSetStatus, ManifestWorkReplicaSetSummary,
    ManifestWorkSpec, ManifestWorkStatus, ManifestsTemplate, PlacementSummary, PropagationPolicy,
    ResourceIdentifier, RolloutAll, RolloutProgressive, RolloutProgressivePerGroup,
    RolloutStrategy, RolloutType, SelectivelyOrphan, ServerSideApplyConfig, ServiceAccountSubject,
    StatusFeedbackResult, UpdateStrategy, UpdateStrategyType,
};

/// How a refusal names an object: `namespace/name`, or `name` when it has no namespace, with
/// `<unnamed>` for a name that is missing or empty (which the stores refuse too).
pub fn object_name(namespace: Option<&str>, name: Option<&str>) -> String {
    let name = name.filter(|n| !n.is_empty()).unwrap_or("<unnamed>");
    match namespace {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_string(),
    }
}

/// A kind the hub stores, typed. Store backends keep objects as JSON keyed by [`Kind`]; this
/// trait lets typed code (controllers, the gateway) go between the two:
/// `serde_json::to_value(&work)` and `serde_json::from_value::<ManifestWork>(json)`, with
/// `ManifestWork::KIND` naming the bucket.
pub trait Stored: kube::Resource<DynamicType = ()> + Serialize + DeserializeOwned + Clone {
    /// The stored kind this type is.
    const KIND: Kind;
}

impl Stored for ManagedCluster {
    const KIND: Kind = Kind::ManagedCluster;
}
impl Stored for ManagedClusterSet {
    const KIND: Kind = Kind::ManagedClusterSet;
}
impl Stored for ManagedClusterSetBinding {
    const KIND: Kind = Kind::ManagedClusterSetBinding;
}
impl Stored for ManifestWork {
    const KIND: Kind = Kind::ManifestWork;
}
impl Stored for ManifestWorkReplicaSet {
    const KIND: Kind = Kind::ManifestWorkReplicaSet;
}
impl Stored for Placement {
    const KIND: Kind = Kind::Placement;
}
impl Stored for PlacementDecision {
    const KIND: Kind = Kind::PlacementDecision;
}
impl Stored for AddOnPlacementScore {
    const KIND: Kind = Kind::AddOnPlacementScore;
}
impl Stored for ManifestChunk {
    const KIND: Kind = Kind::ManifestChunk;
}
impl Stored for policy::Policy {
    const KIND: Kind = Kind::Policy;
}
impl Stored for policy::PlacementBinding {
    const KIND: Kind = Kind::PlacementBinding;
}
impl Stored for policy::PolicySet {
    const KIND: Kind = Kind::PolicySet;
}
impl Stored for policy::ClusterCompliance {
    const KIND: Kind = Kind::ClusterCompliance;
}
impl Stored for ConfigMap {
    const KIND: Kind = Kind::ConfigMap;
}
