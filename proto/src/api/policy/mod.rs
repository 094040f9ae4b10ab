//! Governance: OCM's `policy.open-cluster-management.io` kinds and the pure evaluator of their
//! `ConfigurationPolicy` templates.
//!
//! * [`Policy`] (v1), [`PlacementBinding`] (v1), [`PolicySet`] (v1beta1): what the hub stores
//!   and binds to Placements, with OCM's field names, so policy-collection YAML parses as
//!   written.
//! * [`ConfigurationPolicy`] (v1): the template kind a Policy carries in
//!   `spec.policy-templates[].objectDefinition` and an agent evaluates on its cluster.
//! * [`ClusterCompliance`] (`governance.flotilla.io/v1alpha1`, flotilla's own): one record per
//!   cluster of what its agent reported on each root Policy, written by the gateways and
//!   aggregated by the hub into the roots' status (instead of OCM's replicated policies).
//! * [`validate_policy`], [`validate_configuration_policy`], [`validate_placement_binding`],
//!   [`validate_policy_set`]: refusals that name the object and the field, and the bounds
//!   ([`MAX_POLICY_TEMPLATES`], [`MAX_OBJECT_TEMPLATES`], [`MAX_POLICY_BYTES`]).
//! * [`evaluate`]: one object-template against what a read of the cluster returned, giving the
//!   compliance, OCM's messages and related objects, and the writes `enforce` must make
//!   (without making them). [`select_namespaces`] applies a `namespaceSelector` to the
//!   cluster's namespaces; [`prune_actions`] says what `pruneObjectBehavior` deletes;
//!   [`EvaluationSchedule`] says when each policy is due by its `evaluationInterval`.
//!
//! * [`template`]: OCM's hub (`{{hub ... hub}}`) and managed-cluster (`{{ ... }}`) templates,
//!   checked at validation and rendered with the data a caller passes in.
//!
//! Nothing here reads a cluster or a clock: the agent reads what [`reads`] asks for, passes the
//! answers in and performs the [`EnforceAction`]s it gets back.

mod compare;
mod compliance;
mod evaluate;
mod namespaces;
mod prune;
mod schedule;
pub mod template;
mod types;
mod validate;

pub use compare::{ComplianceType, fields_match, merge_into};
pub use compliance::{
    COMPLIANCE_GROUP, ClusterCompliance, ClusterComplianceSpec, ClusterComplianceStatus,
    MAX_CLUSTER_POLICIES, MAX_TEMPLATE_HISTORY, PolicyCompliance, RecordError,
    empty_cluster_compliance,
};
pub use evaluate::{
    Compliance, EnforceAction, ObjectRead, ObjectVerdict, Observed, ResourceKind,
    TemplateEvaluation, TemplateProblem, evaluate, plural_of, reads,
};
pub use namespaces::{GlobError, NamespaceInfo, SelectorError, glob_match, select_namespaces};
pub use prune::{prune_actions, prune_reads};
pub use schedule::EvaluationSchedule;
pub use types::{
    ANNOTATION_CATEGORIES, ANNOTATION_CONTROLS, ANNOTATION_CREATED_BY_POLICY,
    ANNOTATION_HUB_TEMPLATES_ERROR, ANNOTATION_STANDARDS, ComplianceHistory,
    CompliancePerClusterStatus, ComplianceState, ConfigurationPolicy, ConfigurationPolicySpec,
    ConfigurationPolicyStatus, DetailsPerTemplate, EvaluationInterval, Interval, NamespaceSelector,
    ObjectDefinition, ObjectProperties, ObjectTemplate, POLICY_GROUP, PlacementBinding,
    PlacementSubject, Policy, PolicyPlacement, PolicySet, PolicySetSpec, PolicySetStatus,
    PolicySetStatusPlacement, PolicySpec, PolicyStatus, PolicyTemplate, PruneObjectBehavior,
    RelatedObject, RelatedObjectMeta, RelatedObjectResource, RemediationAction, Severity, Subject,
    TemplateCondition, TemplateStatus, effective_remediation,
};
pub use validate::{
    MAX_OBJECT_TEMPLATES, MAX_POLICY_BYTES, MAX_POLICY_QUALIFIED_NAME, MAX_POLICY_TEMPLATES,
    MAX_SET_POLICIES, MAX_SUBJECTS, PolicyError, validate_configuration_policy,
    validate_placement_binding, validate_policy, validate_policy_set,
};
