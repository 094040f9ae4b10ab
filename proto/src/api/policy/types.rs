//! The serde types of `policy.open-cluster-management.io`: `Policy` and `PlacementBinding` (v1),
//! `PolicySet` (v1beta1) and the template kind `ConfigurationPolicy` (v1).
//!
//! Fields whose values OCM's CRDs restrict (`remediationAction`, `complianceType`, `severity`,
//! `pruneObjectBehavior`, the intervals) are kept as the strings written, so that YAML survives
//! a round trip unchanged and a wrong value is refused by validation with the object and the
//! field named, rather than by serde with neither; the typed accessors read them.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelectorRequirement, ObjectMeta};
use kube::CustomResource;
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

use crate::api::serde_util::{is_default, null_as_default};

/// The API group of every governance kind.
pub const POLICY_GROUP: &str = "policy.open-cluster-management.io";
/// Annotation listing the security standards a Policy belongs to, comma-separated
/// (e.g. `NIST SP 800-53`).
pub const ANNOTATION_STANDARDS: &str = "policy.open-cluster-management.io/standards";
/// Annotation listing the control categories of a Policy (e.g. `CM Configuration Management`).
pub const ANNOTATION_CATEGORIES: &str = "policy.open-cluster-management.io/categories";
/// Annotation listing the controls a Policy checks (e.g. `CM-2 Baseline Configuration`).
pub const ANNOTATION_CONTROLS: &str = "policy.open-cluster-management.io/controls";
/// flotilla's annotation on an object a policy created under `enforce`: the uid of the Policy
/// that created it. It is how `pruneObjectBehavior: DeleteIfCreated` knows, even after the
/// agent restarts, which objects are the policy's; comparisons ignore it.
pub const ANNOTATION_CREATED_BY_POLICY: &str = "policy.flotilla.io/created-by";
/// OCM's annotation on a policy template whose hub templates (`{{hub ... hub}}`) failed to
/// resolve for the cluster it is delivered to: the template travels unrendered with the error
/// here, and the cluster reports it NonCompliant with that error instead of evaluating it.
pub const ANNOTATION_HUB_TEMPLATES_ERROR: &str =
    "policy.open-cluster-management.io/hub-templates-error";

// ---------------------------------------------------------------------------------------------
// Policy
// ---------------------------------------------------------------------------------------------

/// A governance policy: templates to evaluate on every cluster its PlacementBindings select
/// (OCM's `Policy.spec`).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[kube(
    group = "policy.open-cluster-management.io",
    version = "v1",
    kind = "Policy",
    namespaced,
    status = "PolicyStatus",
    shortname = "plc",
    printcolumn = r#"{"name": "Remediation action", "type": "string", "jsonPath": ".spec.remediationAction"}"#,
    printcolumn = r#"{"name": "Compliance state", "type": "string", "jsonPath": ".status.compliant"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#,
    derive = "PartialEq",
    derive = "Default",
    doc = "Policy carries templates (ConfigurationPolicy and others) evaluated on the managed clusters selected through PlacementBindings; its status aggregates their compliance."
)]
pub struct PolicySpec {
    /// A disabled policy is not delivered to any cluster. OCM always writes it.
    #[serde(default)]
    pub disabled: bool,

    /// `inform` or `enforce` (either case). When set it overrides the `remediationAction` of
    /// every template (see [`effective_remediation`]).
    #[serde(
        rename = "remediationAction",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub remediation_action: Option<String>,

    /// The templates to deliver, each a whole object of any kind. OCM always writes the list.
    #[serde(
        rename = "policy-templates",
        default,
        deserialize_with = "null_as_default"
    )]
    pub policy_templates: Vec<PolicyTemplate>,

    /// OCM's `copyPolicyMetadata`: whether the policy's labels and annotations are copied to
    /// the replicated policies; kept as written.
    #[serde(
        rename = "copyPolicyMetadata",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub copy_policy_metadata: Option<bool>,
}

/// One template of a Policy (OCM's `PolicyTemplate`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PolicyTemplate {
    /// The template object itself, e.g. a ConfigurationPolicy, kept verbatim.
    pub object_definition: ObjectDefinition,
    /// OCM's `ignorePending`: a template whose compliance is Pending does not count.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ignore_pending: bool,
}

/// A Kubernetes object kept verbatim: a Policy's template, or an object-template's
/// `objectDefinition`. Any kind; only `kind` and `metadata` are ever read by flotilla.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(transparent)]
pub struct ObjectDefinition(pub serde_json::Value);

impl ObjectDefinition {
    fn str_at(&self, pointer: &str) -> Option<&str> {
        self.0
            .pointer(pointer)
            .and_then(serde_json::Value::as_str)
            .filter(|s| !s.is_empty())
    }

    /// `apiVersion`, e.g. `v1`.
    pub fn api_version(&self) -> Option<&str> {
        self.str_at("/apiVersion")
    }

    /// `kind`, e.g. `ConfigMap`.
    pub fn kind(&self) -> Option<&str> {
        self.str_at("/kind")
    }

    /// `metadata.name`; `None` for a template that matches objects by their fields.
    pub fn name(&self) -> Option<&str> {
        self.str_at("/metadata/name")
    }

    /// `metadata.namespace`; `None` when the namespace selector decides.
    pub fn namespace(&self) -> Option<&str> {
        self.str_at("/metadata/namespace")
    }
}

impl From<serde_json::Value> for ObjectDefinition {
    fn from(value: serde_json::Value) -> Self {
        ObjectDefinition(value)
    }
}

impl JsonSchema for ObjectDefinition {
    fn schema_name() -> Cow<'static, str> {
        "ObjectDefinition".into()
    }

    // Any object, kept as written (OCM's CRD marks it preserve-unknown-fields as well).
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": true,
        })
    }
}

/// An object the apiserver keeps as written, as OCM's CRD keeps a template's metadata in a
/// status (`x-kubernetes-preserve-unknown-fields`), rather than ObjectMeta's whole schema.
fn preserved_object(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

/// Whether violations are only reported (`inform`) or also repaired (`enforce`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RemediationAction {
    /// Report violations; change nothing on the cluster.
    Inform,
    /// Create, update or delete objects until the template is met.
    Enforce,
}

impl RemediationAction {
    /// Reads OCM's spelling in any case (`inform`, `Inform`, `enforce`, `Enforce`).
    pub fn parse(value: &str) -> Option<RemediationAction> {
        if value.eq_ignore_ascii_case("inform") {
            Some(RemediationAction::Inform)
        } else if value.eq_ignore_ascii_case("enforce") {
            Some(RemediationAction::Enforce)
        } else {
            None
        }
    }

    /// `inform` or `enforce`, as OCM writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            RemediationAction::Inform => "inform",
            RemediationAction::Enforce => "enforce",
        }
    }
}

/// The remediation a template runs with: the Policy's when it sets one (OCM's propagator writes
/// the policy's action into every template it replicates), else the template's own, else
/// `inform`. Unknown spellings count as absent here; validation refuses them before this is
/// used.
pub fn effective_remediation(policy: Option<&str>, template: Option<&str>) -> RemediationAction {
    policy
        .and_then(RemediationAction::parse)
        .or_else(|| template.and_then(RemediationAction::parse))
        .unwrap_or(RemediationAction::Inform)
}

/// Compliance of a policy, a template or one cluster, as OCM writes it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, JsonSchema, PartialEq, Eq, Hash)]
pub enum ComplianceState {
    /// Every template is met.
    Compliant,
    /// At least one template is not met.
    NonCompliant,
    /// A template waits for a dependency or its first evaluation.
    Pending,
    /// The policy is being removed from the cluster.
    Terminating,
}

/// The status the hub keeps on a root Policy (OCM's `PolicyStatus`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
pub struct PolicyStatus {
    /// Which bindings and placements deliver the policy.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub placement: Vec<PolicyPlacement>,
    /// Compliance per selected cluster.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub status: Vec<CompliancePerClusterStatus>,
    /// The aggregate: NonCompliant if any cluster is, Pending if any is and none is
    /// NonCompliant, else Compliant; absent before the first report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compliant: Option<ComplianceState>,
    /// Per template, on a cluster's copy of the policy: its compliance and recent history.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub details: Vec<DetailsPerTemplate>,
}

/// One template's compliance on one cluster, with its recent changes (OCM's
/// `DetailsPerTemplate`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DetailsPerTemplate {
    /// The template's name.
    #[serde(default)]
    #[schemars(schema_with = "preserved_object")]
    pub template_meta: ObjectMeta,
    /// The template's compliance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compliant: Option<ComplianceState>,
    /// Most recent first; its length is bounded by whoever writes it.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub history: Vec<ComplianceHistory>,
}

/// One change of a template's compliance (OCM's `ComplianceHistory`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ComplianceHistory {
    /// RFC 3339 time of the change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_timestamp: Option<String>,
    /// `Compliant; ...` or `NonCompliant; ...` followed by the template's message.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// The event that recorded it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub event_name: String,
}

/// One binding that delivers a policy (OCM's `Placement` of a policy status).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PolicyPlacement {
    /// The PlacementBinding's name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub placement_binding: String,
    /// The Placement's name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub placement: String,
    /// The PolicySet through which the policy is bound, if it is.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub policy_set: String,
}

/// One cluster's compliance with a policy (OCM's `CompliancePerClusterStatus`; the lower-case
/// field names are OCM's).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
pub struct CompliancePerClusterStatus {
    /// The cluster's compliance; absent until it reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compliant: Option<ComplianceState>,
    /// The managed cluster.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub clustername: String,
    /// Its namespace on the hub (the cluster's name, as in OCM).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub clusternamespace: String,
}

// ---------------------------------------------------------------------------------------------
// PlacementBinding
// ---------------------------------------------------------------------------------------------

/// Binds Policies or PolicySets to a Placement (OCM's `PlacementBinding`). Unlike most kinds it
/// has no `spec`: `placementRef` and `subjects` sit at the top level, as OCM has them.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PlacementBinding {
    /// `policy.open-cluster-management.io/v1`.
    pub api_version: String,
    /// `PlacementBinding`.
    pub kind: String,
    /// Name and namespace; the bound Placement and subjects live in the same namespace.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// The Placement whose decisions select the clusters.
    pub placement_ref: PlacementSubject,
    /// The Policies and PolicySets delivered to those clusters.
    #[serde(default, deserialize_with = "null_as_default")]
    pub subjects: Vec<Subject>,
}

// Written by hand because kube's derive needs a `spec`: with these two, `kube::Resource` (and
// so `Api<PlacementBinding>` and the store's typed access) comes from kube's blanket impl.
impl k8s_openapi::Resource for PlacementBinding {
    const API_VERSION: &'static str = "policy.open-cluster-management.io/v1";
    const GROUP: &'static str = POLICY_GROUP;
    const KIND: &'static str = "PlacementBinding";
    const VERSION: &'static str = "v1";
    const URL_PATH_SEGMENT: &'static str = "placementbindings";
    type Scope = k8s_openapi::NamespaceResourceScope;
}

impl k8s_openapi::Metadata for PlacementBinding {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// What a binding places with (OCM's `PlacementSubject`): a
/// `cluster.open-cluster-management.io` `Placement` (OCM's older `PlacementRule` is refused by
/// validation).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PlacementSubject {
    /// `cluster.open-cluster-management.io`.
    #[serde(default)]
    pub api_group: String,
    /// `Placement`.
    #[serde(default)]
    pub kind: String,
    /// The Placement's name in the binding's namespace.
    #[serde(default)]
    pub name: String,
}

/// What a binding delivers (OCM's `Subject`): a `Policy` or `PolicySet` of
/// `policy.open-cluster-management.io`.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Subject {
    /// `policy.open-cluster-management.io`.
    #[serde(default)]
    pub api_group: String,
    /// `Policy` or `PolicySet`.
    #[serde(default)]
    pub kind: String,
    /// The subject's name in the binding's namespace.
    #[serde(default)]
    pub name: String,
}

// ---------------------------------------------------------------------------------------------
// PolicySet
// ---------------------------------------------------------------------------------------------

/// A named group of Policies placed together (OCM's `PolicySet.spec`).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[kube(
    group = "policy.open-cluster-management.io",
    version = "v1beta1",
    kind = "PolicySet",
    namespaced,
    status = "PolicySetStatus",
    shortname = "plcset",
    printcolumn = r#"{"name": "Compliance state", "type": "string", "jsonPath": ".status.compliant"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#,
    derive = "PartialEq",
    derive = "Default",
    doc = "PolicySet groups Policies of its namespace so that one PlacementBinding places them all; its status aggregates their compliance."
)]
pub struct PolicySetSpec {
    /// Free text for people.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    /// Names of Policies in the set's namespace. OCM always writes the list.
    #[serde(default, deserialize_with = "null_as_default")]
    pub policies: Vec<String>,
}

/// A PolicySet's aggregate (OCM's `PolicySetStatus`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PolicySetStatus {
    /// The bindings and placements delivering the set.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub placement: Vec<PolicySetStatusPlacement>,
    /// NonCompliant if any member policy is, etc.; absent before any report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compliant: Option<ComplianceState>,
    /// E.g. which member policies are missing or disabled.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub status_message: String,
}

/// One binding delivering a set (OCM's `PolicySetStatusPlacement`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PolicySetStatusPlacement {
    /// The PlacementBinding's name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub placement_binding: String,
    /// The Placement's name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub placement: String,
}

// ---------------------------------------------------------------------------------------------
// ConfigurationPolicy
// ---------------------------------------------------------------------------------------------

/// Objects that must, must not or must only exist on a cluster (OCM's
/// `ConfigurationPolicy.spec`), evaluated by the agent.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[kube(
    group = "policy.open-cluster-management.io",
    version = "v1",
    kind = "ConfigurationPolicy",
    namespaced,
    status = "ConfigurationPolicyStatus",
    derive = "PartialEq",
    derive = "Default",
    doc = "ConfigurationPolicy lists object templates a managed cluster must (or must not) have, evaluated by the agent in inform or enforce mode."
)]
#[serde(rename_all = "camelCase")]
pub struct ConfigurationPolicySpec {
    /// `inform` or `enforce` (either case); the owning Policy's action overrides it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub remediation_action: String,
    /// `low`, `medium`, `high` or `critical` (either case); reported, never acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub severity: Option<String>,
    /// Which namespaces a namespaced template without `metadata.namespace` is evaluated in.
    #[serde(default, skip_serializing_if = "is_default")]
    pub namespace_selector: NamespaceSelector,
    /// The objects to check.
    #[serde(
        rename = "object-templates",
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub object_templates: Vec<ObjectTemplate>,
    /// `None` (OCM's default), `DeleteIfCreated` or `DeleteAll`: what happens to the objects
    /// when the policy is removed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prune_object_behavior: Option<String>,
    /// How often to re-evaluate in each state (see [`Interval`]).
    #[serde(default, skip_serializing_if = "is_default")]
    pub evaluation_interval: EvaluationInterval,
}

/// Namespaces by name globs and labels (OCM's `Target`). An empty selector selects nothing,
/// as in OCM (so a namespaced template without a namespace then has nowhere to go).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct NamespaceSelector {
    /// Name globs (`*`, `?`, `[a-z]`) of namespaces to include; every namespace when empty and
    /// a label selector is set.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub include: Vec<String>,
    /// Name globs of namespaces to leave out, applied after `include`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exclude: Vec<String>,
    /// Labels a namespace must carry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub match_labels: Option<BTreeMap<String, String>>,
    /// Label requirements a namespace must meet, ANDed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub match_expressions: Option<Vec<LabelSelectorRequirement>>,
}

impl NamespaceSelector {
    /// True when the selector can select nothing (no include and no label selector), which OCM
    /// treats as "no namespaces" rather than "all".
    pub fn is_empty(&self) -> bool {
        self.include.is_empty() && self.match_labels.is_none() && self.match_expressions.is_none()
    }
}

/// One object a ConfigurationPolicy checks (OCM's `ObjectTemplate`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ObjectTemplate {
    /// `musthave`, `mustonlyhave` or `mustnothave` (OCM's spellings in any case).
    pub compliance_type: String,
    /// How `metadata.labels` and `metadata.annotations` compare: `musthave` or `mustonlyhave`;
    /// `complianceType` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata_compliance_type: Option<String>,
    /// The object, or the fields an object must have when it has no name.
    pub object_definition: ObjectDefinition,
}

/// How often to re-evaluate a ConfigurationPolicy (OCM's `EvaluationInterval`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
pub struct EvaluationInterval {
    /// While compliant: a duration (`10s`, `1h30m`), `watch` or `never`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub compliant: String,
    /// While non-compliant: a duration, `watch` or `never`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub noncompliant: String,
}

/// One parsed `evaluationInterval` value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interval {
    /// Re-evaluate when a watched object changes (OCM's default, and the meaning of empty).
    Watch,
    /// Evaluate once in this state and then not again until the policy changes.
    Never,
    /// Re-evaluate this long after the previous evaluation.
    Every(Duration),
}

impl Interval {
    /// Parses `""`/`watch`, `never`, or a Go duration (`1h30m`, `10s`, `500ms`, `1.5h`).
    /// `None` for anything else.
    pub fn parse(value: &str) -> Option<Interval> {
        match value {
            "" | "watch" => Some(Interval::Watch),
            "never" => Some(Interval::Never),
            other => parse_go_duration(other).map(Interval::Every),
        }
    }
}

impl EvaluationInterval {
    /// The interval while compliant; `None` if it does not parse.
    pub fn compliant(&self) -> Option<Interval> {
        Interval::parse(&self.compliant)
    }

    /// The interval while non-compliant; `None` if it does not parse.
    pub fn noncompliant(&self) -> Option<Interval> {
        Interval::parse(&self.noncompliant)
    }
}

/// A Go duration: one or more `<number><unit>` with units `h`, `m`, `s`, `ms`, `us`, `ns`.
fn parse_go_duration(value: &str) -> Option<Duration> {
    let mut rest = value;
    let mut total = Duration::ZERO;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, after) = rest.split_at(digits);
        let number: f64 = number.parse().ok()?;
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let seconds = match unit {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += Duration::try_from_secs_f64(number * seconds).ok()?;
        rest = after;
    }
    Some(total)
}

/// What `pruneObjectBehavior` asks for when the policy goes away.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PruneObjectBehavior {
    /// Leave every object (OCM's default).
    #[default]
    None,
    /// Delete the objects this policy created.
    DeleteIfCreated,
    /// Delete every object the policy's musthave/mustonlyhave templates name.
    DeleteAll,
}

impl PruneObjectBehavior {
    /// Reads OCM's exact spelling; `None` (the Rust option) for anything else.
    pub fn parse(value: &str) -> Option<PruneObjectBehavior> {
        match value {
            "None" => Some(PruneObjectBehavior::None),
            "DeleteIfCreated" => Some(PruneObjectBehavior::DeleteIfCreated),
            "DeleteAll" => Some(PruneObjectBehavior::DeleteAll),
            _ => None,
        }
    }
}

/// A ConfigurationPolicy's severity; OCM accepts each in lower or capitalised case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    Low,
    Medium,
    High,
    Critical,
}

impl Severity {
    /// Reads `low`/`Low` ... `critical`/`Critical`.
    pub fn parse(value: &str) -> Option<Severity> {
        [
            ("low", Severity::Low),
            ("medium", Severity::Medium),
            ("high", Severity::High),
            ("critical", Severity::Critical),
        ]
        .into_iter()
        .find(|(name, _)| value.eq_ignore_ascii_case(name))
        .map(|(_, severity)| severity)
    }
}

/// What the agent reports per ConfigurationPolicy (OCM's `ConfigurationPolicyStatus`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ConfigurationPolicyStatus {
    /// NonCompliant if any object-template is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compliant: Option<ComplianceState>,
    /// One entry per object-template, in order.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub compliancy_details: Vec<TemplateStatus>,
    /// Every object the templates named or matched, with its own verdict.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub related_objects: Vec<RelatedObject>,
}

/// One object-template's outcome (OCM's `TemplateStatus`; `Compliant` is capitalised in OCM).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
pub struct TemplateStatus {
    /// The template's compliance.
    #[serde(rename = "Compliant", default, skip_serializing_if = "Option::is_none")]
    pub compliant: Option<ComplianceState>,
    /// The combined message, e.g. `configmaps [cm] found but not as specified in namespace
    /// default`, as the condition of type `violation` or `notification`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<TemplateCondition>,
}

/// A condition of a template status (OCM's own `Condition`, which has no `observedGeneration`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TemplateCondition {
    /// `violation` when non-compliant, `notification` when compliant.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub status: String,
    /// RFC 3339 time of the last change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
    /// OCM's reason text, e.g. ``K8s does not have a `must have` object``.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// The combined message.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// One object a template named or matched, with its verdict (OCM's `RelatedObject`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
pub struct RelatedObject {
    /// Which object.
    pub object: RelatedObjectResource,
    /// `Compliant` or `NonCompliant`.
    pub compliant: String,
    /// OCM's reason, e.g. `Resource found but does not match`.
    pub reason: String,
    /// What the agent knows of the object beyond the verdict: whether this policy created it
    /// (which `pruneObjectBehavior: DeleteIfCreated` needs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub properties: Option<ObjectProperties>,
}

/// OCM's `ObjectProperties` of a related object.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ObjectProperties {
    /// The policy created the object under enforce.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_by_policy: Option<bool>,
    /// The uid the object had when the policy created it: a same-named object created by
    /// someone else later has another and is not the policy's to prune.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uid: String,
}

/// The identity of a related object (OCM's `ObjectResource`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RelatedObjectResource {
    /// `apiVersion` of the object.
    pub api_version: String,
    /// `kind` of the object.
    pub kind: String,
    /// Its name and namespace; `-` as the name when a template matched none.
    pub metadata: RelatedObjectMeta,
}

/// Name and namespace of a related object (OCM's `ObjectMetadata`).
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Eq, Default)]
pub struct RelatedObjectMeta {
    /// Object name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// Object namespace; empty for cluster-scoped objects.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_parse_as_ocm_writes_them() {
        let cases = [
            ("", Some(Interval::Watch)),
            ("watch", Some(Interval::Watch)),
            ("never", Some(Interval::Never)),
            ("10s", Some(Interval::Every(Duration::from_secs(10)))),
            ("1h", Some(Interval::Every(Duration::from_secs(3600)))),
            ("1h30m", Some(Interval::Every(Duration::from_secs(5400)))),
            ("500ms", Some(Interval::Every(Duration::from_millis(500)))),
            ("1.5h", Some(Interval::Every(Duration::from_secs(5400)))),
            ("10", None),
            ("10d", None),
            ("soon", None),
        ];
        for (input, expected) in cases {
            assert_eq!(Interval::parse(input), expected, "{input:?}");
        }
    }

    #[test]
    fn the_policy_remediation_overrides_the_template() {
        let cases = [
            (Some("enforce"), Some("inform"), RemediationAction::Enforce),
            (Some("Inform"), Some("enforce"), RemediationAction::Inform),
            (None, Some("Enforce"), RemediationAction::Enforce),
            (None, None, RemediationAction::Inform),
        ];
        for (policy, template, expected) in cases {
            assert_eq!(
                effective_remediation(policy, template),
                expected,
                "{policy:?} over {template:?}"
            );
        }
    }

    #[test]
    fn the_kinds_have_ocm_names() {
        use kube::{CustomResourceExt, Resource};
        for (crd, kind, plural, version) in [
            (Policy::crd(), "Policy", "policies", "v1"),
            (PolicySet::crd(), "PolicySet", "policysets", "v1beta1"),
            (
                ConfigurationPolicy::crd(),
                "ConfigurationPolicy",
                "configurationpolicies",
                "v1",
            ),
        ] {
            assert_eq!(crd.spec.group, POLICY_GROUP);
            assert_eq!(crd.spec.names.kind, kind);
            assert_eq!(crd.spec.names.plural, plural);
            assert_eq!(crd.spec.versions[0].name, version);
            assert_eq!(crd.spec.scope, "Namespaced");
        }
        // The template fields keep OCM's dashed names in the schema the apiserver checks.
        let policy = serde_json::to_value(Policy::crd()).unwrap();
        let spec =
            &policy["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        assert!(spec["properties"]["policy-templates"].is_object(), "{spec}");
        assert_eq!(PlacementBinding::kind(&()), "PlacementBinding");
        assert_eq!(PlacementBinding::plural(&()), "placementbindings");
        assert_eq!(
            PlacementBinding::api_version(&()),
            "policy.open-cluster-management.io/v1"
        );
    }

    #[test]
    fn enumerated_fields_accept_ocm_spellings_only() {
        assert_eq!(Severity::parse("High"), Some(Severity::High));
        assert_eq!(Severity::parse("critical"), Some(Severity::Critical));
        assert_eq!(Severity::parse("urgent"), None);
        assert_eq!(
            PruneObjectBehavior::parse("DeleteIfCreated"),
            Some(PruneObjectBehavior::DeleteIfCreated)
        );
        assert_eq!(PruneObjectBehavior::parse("deleteall"), None);
        assert_eq!(
            RemediationAction::parse("ENFORCE"),
            Some(RemediationAction::Enforce)
        );
        assert_eq!(RemediationAction::parse("audit"), None);
    }
}
