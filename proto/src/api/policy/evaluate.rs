//! One ConfigurationPolicy object-template evaluated against what a read of the cluster
//! returned, without reading or writing anything.
//!
//! The agent drives it in three steps: [`reads`] says which objects to fetch (one GET per
//! named object and namespace, one LIST per namespace for a template without a name); the
//! agent fetches them and calls [`evaluate`] with the answers; it then performs the
//! [`EnforceAction`]s returned (none under `inform`) and reports the verdicts. After the
//! writes the agent's watches trigger the next evaluation, which finds the objects as
//! specified and reports Compliant: the verdict of one evaluation is always about what was
//! observed, never about writes not yet made.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::compare::{ComplianceType, compare_object};
use super::types::{
    ComplianceState, ObjectTemplate, RelatedObject, RelatedObjectMeta, RelatedObjectResource,
    RemediationAction, TemplateCondition, TemplateStatus,
};

/// OCM's reasons, as they appear in `relatedObjects[].reason`.
const REASON_FOUND_AS_EXPECTED: &str = "Resource found as expected";
const REASON_FOUND_NO_MATCH: &str = "Resource found but does not match";
const REASON_NOT_FOUND_SHOULD_EXIST: &str = "Resource not found but should exist";
const REASON_FOUND_SHOULD_NOT_EXIST: &str = "Resource found but should not exist";
const REASON_NOT_FOUND_AS_EXPECTED: &str = "Resource not found as expected";

/// What the agent knows of a kind from the cluster's discovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceKind {
    /// The plural resource name, e.g. `configmaps`, which OCM's messages use.
    pub plural: String,
    /// Whether objects of the kind live in namespaces.
    pub namespaced: bool,
}

/// Kubernetes' default plural of a kind (`ConfigMap` → `configmaps`, `NetworkPolicy` →
/// `networkpolicies`, `Ingress` → `ingresses`), for when discovery is not at hand.
pub fn plural_of(kind: &str) -> String {
    let lower = kind.to_ascii_lowercase();
    if let Some(stem) = lower.strip_suffix('y')
        && !stem.ends_with(['a', 'e', 'i', 'o', 'u'])
    {
        return format!("{stem}ies");
    }
    if lower.ends_with('s')
        || lower.ends_with('x')
        || lower.ends_with("ch")
        || lower.ends_with("sh")
    {
        return format!("{lower}es");
    }
    format!("{lower}s")
}

/// One read the agent must make: a GET when `name` is set, else a LIST of the kind in
/// `namespace` (or cluster-wide when `namespace` is `None`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectRead {
    /// `apiVersion` of the template.
    pub api_version: String,
    /// `kind` of the template.
    pub kind: String,
    /// The namespace to read in; `None` for cluster-scoped kinds.
    pub namespace: Option<String>,
    /// The object's name; `None` to list.
    pub name: Option<String>,
}

/// What a read returned.
#[derive(Debug, Clone, PartialEq)]
pub enum Observed {
    /// A GET: the object, or `None` when it does not exist (404).
    Object(Option<Value>),
    /// A LIST: every object of the kind in the namespace.
    List(Vec<Value>),
}

/// Why a template could not be evaluated. The agent reports it as the template's
/// NonCompliant message; none of them stops the other templates. Not retryable by waiting,
/// except [`TemplateProblem::NotObserved`], which a later read fixes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateProblem {
    /// `complianceType` or `metadataComplianceType` is not one of OCM's values.
    #[error("complianceType {0:?} is not musthave, mustonlyhave or mustnothave")]
    UnknownComplianceType(String),
    /// The objectDefinition has no `kind` or `apiVersion`.
    #[error("objectDefinition has no {0}")]
    Incomplete(&'static str),
    /// A namespaced template names no namespace and the selector selected none.
    #[error(
        "namespaced object {name} of kind {kind} has no namespace: set metadata.namespace or a namespaceSelector that selects at least one namespace"
    )]
    NoNamespace { kind: String, name: String },
    /// The agent did not pass the answer to one of the [`reads`]. Retryable.
    #[error("{kind} {name} was not read from the cluster")]
    NotObserved { kind: String, name: String },
}

/// Compliance of one object-template (or one object).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Compliance {
    Compliant,
    NonCompliant,
}

impl Compliance {
    /// `Compliant` or `NonCompliant`, as OCM writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Compliance::Compliant => "Compliant",
            Compliance::NonCompliant => "NonCompliant",
        }
    }
}

/// A write `enforce` must make to bring the cluster into line. Never produced under
/// `inform`.
#[derive(Debug, Clone, PartialEq)]
pub enum EnforceAction {
    /// Create this object (the template's objectDefinition, with its namespace set).
    Create { object: Value },
    /// Update the object to this value: the existing object with the template merged in,
    /// `resourceVersion` kept so that a concurrent change makes the update conflict instead
    /// of being overwritten. `status` and `managedFields` are left out.
    Update { object: Value },
    /// Delete this object.
    Delete {
        api_version: String,
        kind: String,
        namespace: Option<String>,
        name: String,
    },
}

/// The verdict on one object a template named or matched.
#[derive(Debug, Clone, PartialEq)]
pub struct ObjectVerdict {
    /// The object and its verdict, in OCM's `relatedObjects` shape.
    pub related: RelatedObject,
    /// Whether this object meets the template.
    pub compliance: Compliance,
    /// For a violation, what is wrong, naming the object and the fields, e.g.
    /// `configmaps [cm] found but not as specified in namespace default: data.extra`.
    pub message: String,
    /// Dotted paths of the fields that differ (empty unless the object exists and does not
    /// match).
    pub fields: Vec<String>,
}

/// The outcome of one object-template.
#[derive(Debug, Clone, PartialEq)]
pub struct TemplateEvaluation {
    /// NonCompliant if any object is.
    pub compliance: Compliance,
    /// OCM's `compliancyDetails` reason, e.g. ``K8s does not have a `must have` object``.
    pub reason: String,
    /// OCM's combined message, e.g. `namespaces [prod] not found`.
    pub message: String,
    /// One verdict per object named or matched (one with name `-` when an unnamed template
    /// matched nothing), sorted by namespace and name.
    pub objects: Vec<ObjectVerdict>,
    /// What enforce must write; empty under inform.
    pub actions: Vec<EnforceAction>,
}

impl From<Compliance> for ComplianceState {
    fn from(compliance: Compliance) -> ComplianceState {
        match compliance {
            Compliance::Compliant => ComplianceState::Compliant,
            Compliance::NonCompliant => ComplianceState::NonCompliant,
        }
    }
}

impl TemplateEvaluation {
    /// The template's entry in OCM's `status.compliancyDetails`: one condition, `violation`
    /// when non-compliant and `notification` when compliant, with the reason and message.
    /// The caller stamps `lastTransitionTime` (proto reads no clock).
    pub fn template_status(&self) -> TemplateStatus {
        let type_ = match self.compliance {
            Compliance::Compliant => "notification",
            Compliance::NonCompliant => "violation",
        };
        TemplateStatus {
            compliant: Some(self.compliance.into()),
            conditions: vec![TemplateCondition {
                type_: type_.to_string(),
                status: "True".to_string(),
                last_transition_time: None,
                reason: self.reason.clone(),
                message: self.message.clone(),
            }],
        }
    }

    /// The objects in OCM's `status.relatedObjects` shape.
    pub fn related_objects(&self) -> Vec<RelatedObject> {
        self.objects.iter().map(|o| o.related.clone()).collect()
    }
}

struct Parsed<'a> {
    ctype: ComplianceType,
    metadata_ctype: ComplianceType,
    api_version: &'a str,
    kind: &'a str,
    name: Option<&'a str>,
}

fn parse(template: &ObjectTemplate) -> Result<Parsed<'_>, TemplateProblem> {
    let ctype = ComplianceType::parse(&template.compliance_type)
        .ok_or_else(|| TemplateProblem::UnknownComplianceType(template.compliance_type.clone()))?;
    let metadata_ctype = match &template.metadata_compliance_type {
        Some(value) => ComplianceType::parse(value)
            .filter(|ct| *ct != ComplianceType::MustNotHave)
            .ok_or_else(|| TemplateProblem::UnknownComplianceType(value.clone()))?,
        None => ctype,
    };
    let definition = &template.object_definition;
    Ok(Parsed {
        ctype,
        metadata_ctype,
        api_version: definition
            .api_version()
            .ok_or(TemplateProblem::Incomplete("apiVersion"))?,
        kind: definition
            .kind()
            .ok_or(TemplateProblem::Incomplete("kind"))?,
        name: definition.name(),
    })
}

/// The reads [`evaluate`] needs for `template`: in its own `metadata.namespace` if it names
/// one, else in each of `namespaces` (the namespace selector's result) for a namespaced kind,
/// else cluster-wide.
pub fn reads(
    template: &ObjectTemplate,
    kind: &ResourceKind,
    namespaces: &[String],
) -> Result<Vec<ObjectRead>, TemplateProblem> {
    let parsed = parse(template)?;
    let targets: Vec<Option<String>> = if !kind.namespaced {
        vec![None]
    } else if let Some(ns) = template.object_definition.namespace() {
        vec![Some(ns.to_string())]
    } else if namespaces.is_empty() {
        return Err(TemplateProblem::NoNamespace {
            kind: parsed.kind.to_string(),
            name: parsed.name.unwrap_or("<unnamed>").to_string(),
        });
    } else {
        let unique: BTreeSet<&String> = namespaces.iter().collect();
        unique.into_iter().map(|ns| Some(ns.clone())).collect()
    };
    Ok(targets
        .into_iter()
        .map(|namespace| ObjectRead {
            api_version: parsed.api_version.to_string(),
            kind: parsed.kind.to_string(),
            namespace,
            name: parsed.name.map(str::to_string),
        })
        .collect())
}

/// Evaluates `template` under `remediation` (the effective one: see
/// [`super::effective_remediation`]) against `observed`, the answers to [`reads`] for the
/// same `kind` and `namespaces`. A template that cannot be evaluated yields a NonCompliant
/// result whose message says why.
pub fn evaluate(
    template: &ObjectTemplate,
    remediation: RemediationAction,
    kind: &ResourceKind,
    namespaces: &[String],
    observed: &BTreeMap<ObjectRead, Observed>,
) -> TemplateEvaluation {
    match try_evaluate(template, remediation, kind, namespaces, observed) {
        Ok(evaluation) => evaluation,
        Err(problem) => TemplateEvaluation {
            compliance: Compliance::NonCompliant,
            reason: "K8s error".to_string(),
            message: problem.to_string(),
            objects: Vec::new(),
            actions: Vec::new(),
        },
    }
}

fn try_evaluate(
    template: &ObjectTemplate,
    remediation: RemediationAction,
    kind: &ResourceKind,
    namespaces: &[String],
    observed: &BTreeMap<ObjectRead, Observed>,
) -> Result<TemplateEvaluation, TemplateProblem> {
    let parsed = parse(template)?;
    let enforce = remediation == RemediationAction::Enforce;
    let mut verdicts: Vec<Verdict> = Vec::new();
    let mut actions = Vec::new();
    for read in reads(template, kind, namespaces)? {
        let not_observed = || TemplateProblem::NotObserved {
            kind: read.kind.clone(),
            name: read.name.clone().unwrap_or_else(|| "<list>".to_string()),
        };
        let answer = observed.get(&read).ok_or_else(not_observed)?;
        match (&parsed.name, answer) {
            (Some(name), Observed::Object(found)) => {
                let verdict = named(&parsed, template, &read, name, found.as_ref());
                if enforce {
                    actions.extend(verdict.action.clone());
                }
                verdicts.push(verdict);
            }
            (None, Observed::List(items)) => {
                for verdict in unnamed(&parsed, template, &read, items) {
                    if enforce {
                        actions.extend(verdict.action.clone());
                    }
                    verdicts.push(verdict);
                }
            }
            _ => return Err(not_observed()),
        }
    }
    verdicts.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    let compliance = if verdicts.iter().all(|v| v.compliant) {
        Compliance::Compliant
    } else {
        Compliance::NonCompliant
    };
    let (reason, message) = combined_message(&kind.plural, &verdicts);
    let objects = verdicts
        .into_iter()
        .map(|v| v.into_object(&parsed, &kind.plural))
        .collect();
    Ok(TemplateEvaluation {
        compliance,
        reason,
        message,
        objects,
        actions,
    })
}

/// One object's verdict while the template's message is being put together.
#[derive(Debug, Clone)]
struct Verdict {
    namespace: String,
    /// `-` for an unnamed template that matched nothing.
    name: String,
    compliant: bool,
    reason: &'static str,
    fields: Vec<String>,
    /// Said instead of the fields, e.g. a type mismatch or why enforce cannot act.
    note: Option<String>,
    action: Option<EnforceAction>,
}

impl Verdict {
    fn into_object(self, parsed: &Parsed<'_>, plural: &str) -> ObjectVerdict {
        let compliance = if self.compliant {
            Compliance::Compliant
        } else {
            Compliance::NonCompliant
        };
        let subject = if self.name == "-" {
            plural.to_string()
        } else {
            format!("{plural} [{}]", self.name)
        };
        let location = if self.namespace.is_empty() {
            String::new()
        } else {
            format!(" in namespace {}", self.namespace)
        };
        let mut message = format!("{subject} {}{location}", phrase(self.reason));
        if let Some(note) = &self.note {
            message.push_str(&format!(": {note}"));
        } else if !self.fields.is_empty() {
            message.push_str(&format!(": {}", self.fields.join(", ")));
        }
        ObjectVerdict {
            related: RelatedObject {
                object: RelatedObjectResource {
                    api_version: parsed.api_version.to_string(),
                    kind: parsed.kind.to_string(),
                    metadata: RelatedObjectMeta {
                        name: self.name,
                        namespace: self.namespace,
                    },
                },
                compliant: compliance.as_str().to_string(),
                reason: self.reason.to_string(),
                properties: None,
            },
            compliance,
            message,
            fields: self.fields,
        }
    }
}

/// OCM's phrase for a reason: `not found`, `found but not as specified`, ...
fn phrase(reason: &str) -> &'static str {
    match reason {
        REASON_FOUND_AS_EXPECTED => "found as specified",
        REASON_FOUND_NO_MATCH => "found but not as specified",
        REASON_NOT_FOUND_SHOULD_EXIST => "not found",
        REASON_FOUND_SHOULD_NOT_EXIST => "found",
        _ => "missing as expected",
    }
}

/// OCM's `compliancyDetails` reason for a related-object reason.
fn details_reason(reason: &str) -> &'static str {
    match reason {
        REASON_FOUND_AS_EXPECTED => "K8s `must have` object already exists",
        REASON_FOUND_NO_MATCH | REASON_NOT_FOUND_SHOULD_EXIST => {
            "K8s does not have a `must have` object"
        }
        REASON_FOUND_SHOULD_NOT_EXIST => "K8s has a `must not have` object",
        _ => "K8s `must not have` object already missing",
    }
}

fn named(
    parsed: &Parsed<'_>,
    template: &ObjectTemplate,
    read: &ObjectRead,
    name: &str,
    found: Option<&Value>,
) -> Verdict {
    let namespace = read.namespace.clone().unwrap_or_default();
    let mut verdict = Verdict {
        namespace: namespace.clone(),
        name: name.to_string(),
        compliant: true,
        reason: REASON_FOUND_AS_EXPECTED,
        fields: Vec::new(),
        note: None,
        action: None,
    };
    match (parsed.ctype, found) {
        (ComplianceType::MustNotHave, None) => verdict.reason = REASON_NOT_FOUND_AS_EXPECTED,
        (ComplianceType::MustNotHave, Some(_)) => {
            verdict.compliant = false;
            verdict.reason = REASON_FOUND_SHOULD_NOT_EXIST;
            verdict.action = Some(EnforceAction::Delete {
                api_version: read.api_version.clone(),
                kind: read.kind.clone(),
                namespace: read.namespace.clone(),
                name: name.to_string(),
            });
        }
        (_, None) => {
            verdict.compliant = false;
            verdict.reason = REASON_NOT_FOUND_SHOULD_EXIST;
            let mut object = template.object_definition.0.clone();
            if let (Some(ns), Some(meta)) = (
                &read.namespace,
                object
                    .pointer_mut("/metadata")
                    .and_then(Value::as_object_mut),
            ) {
                meta.insert("namespace".to_string(), Value::String(ns.clone()));
            }
            verdict.action = Some(EnforceAction::Create { object });
        }
        (ctype, Some(existing)) => {
            let comparison = compare_object(
                &template.object_definition.0,
                existing,
                ctype,
                parsed.metadata_ctype,
                false,
            );
            if !comparison.matches {
                verdict.compliant = false;
                verdict.reason = REASON_FOUND_NO_MATCH;
                verdict.fields = comparison.fields;
                if let Some(error) = comparison.type_error {
                    verdict.note = Some(error);
                } else if comparison.status_only {
                    verdict.note = Some(format!(
                        "{} (status is reported by the cluster and cannot be enforced)",
                        verdict.fields.join(", ")
                    ));
                } else {
                    verdict.action = Some(EnforceAction::Update {
                        object: comparison.merged,
                    });
                }
            }
        }
    }
    verdict
}

/// A template without a name matches objects by its fields (with zero values equal to
/// missing fields, as OCM does for listed objects).
fn unnamed(
    parsed: &Parsed<'_>,
    template: &ObjectTemplate,
    read: &ObjectRead,
    items: &[Value],
) -> Vec<Verdict> {
    let namespace = read.namespace.clone().unwrap_or_default();
    // mustnothave finds the objects that have the template's fields.
    let match_type = match parsed.ctype {
        ComplianceType::MustNotHave => ComplianceType::MustHave,
        other => other,
    };
    let mut matching: Vec<&str> = items
        .iter()
        .filter(|item| {
            compare_object(
                &template.object_definition.0,
                item,
                match_type,
                parsed.metadata_ctype,
                true,
            )
            .matches
        })
        .filter_map(|item| item.pointer("/metadata/name").and_then(Value::as_str))
        .collect();
    matching.sort_unstable();
    let verdict = |name: &str, compliant: bool, reason: &'static str| Verdict {
        namespace: namespace.clone(),
        name: name.to_string(),
        compliant,
        reason,
        fields: Vec::new(),
        note: None,
        action: None,
    };
    match (parsed.ctype, matching.is_empty()) {
        (ComplianceType::MustNotHave, true) => vec![verdict("-", true, REASON_NOT_FOUND_AS_EXPECTED)],
        (ComplianceType::MustNotHave, false) => matching
            .into_iter()
            .map(|name| Verdict {
                action: Some(EnforceAction::Delete {
                    api_version: read.api_version.clone(),
                    kind: read.kind.clone(),
                    namespace: read.namespace.clone(),
                    name: name.to_string(),
                }),
                ..verdict(name, false, REASON_FOUND_SHOULD_NOT_EXIST)
            })
            .collect(),
        (_, true) => vec![Verdict {
            note: Some(
                "no object has the template's fields, and enforce cannot create one without metadata.name".to_string(),
            ),
            ..verdict("-", false, REASON_NOT_FOUND_SHOULD_EXIST)
        }],
        (_, false) => matching
            .into_iter()
            .map(|name| verdict(name, true, REASON_FOUND_AS_EXPECTED))
            .collect(),
    }
}

/// OCM's combined `compliancyDetails` reason and message: when any object is non-compliant
/// only the non-compliant ones are described; per reason (in OCM's order), the names found
/// in the same namespaces are grouped, e.g. `configmaps [a, b] not found in namespaces: x,
/// y`, and the groups are joined with `; `.
fn combined_message(plural: &str, verdicts: &[Verdict]) -> (String, String) {
    let any_violation = verdicts.iter().any(|v| !v.compliant);
    let shown: Vec<&Verdict> = verdicts
        .iter()
        .filter(|v| v.compliant != any_violation)
        .collect();
    let order = [
        REASON_FOUND_AS_EXPECTED,
        REASON_NOT_FOUND_SHOULD_EXIST,
        REASON_FOUND_NO_MATCH,
        REASON_NOT_FOUND_AS_EXPECTED,
        REASON_FOUND_SHOULD_NOT_EXIST,
    ];
    let mut reasons = Vec::new();
    let mut parts = Vec::new();
    for reason in order {
        let of_reason: Vec<&&Verdict> = shown.iter().filter(|v| v.reason == reason).collect();
        if of_reason.is_empty() {
            continue;
        }
        reasons.push(details_reason(reason));
        // Names per namespace, then namespaces per list of names.
        let mut names_by_namespace: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for v in &of_reason {
            let names = names_by_namespace.entry(v.namespace.as_str()).or_default();
            if v.name != "-" {
                names.push(v.name.as_str());
            }
        }
        let mut namespaces_by_names: BTreeMap<String, Vec<&str>> = BTreeMap::new();
        for (namespace, mut names) in names_by_namespace {
            names.sort_unstable();
            let names = if names.is_empty() {
                String::new()
            } else {
                format!(" [{}]", names.join(", "))
            };
            namespaces_by_names
                .entry(names)
                .or_default()
                .push(namespace);
        }
        for (names, namespaces) in namespaces_by_names {
            let namespaces: Vec<&str> = namespaces.into_iter().filter(|n| !n.is_empty()).collect();
            let location = match namespaces.len() {
                0 => String::new(),
                1 => format!(" in namespace {}", namespaces[0]),
                _ => format!(" in namespaces: {}", namespaces.join(", ")),
            };
            parts.push(format!("{plural}{names} {}{location}", phrase(reason)));
        }
    }
    reasons.dedup();
    (reasons.join("; "), parts.join("; "))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::api::policy::{
        ConfigurationPolicy, NamespaceInfo, NamespaceSelector, Policy, effective_remediation,
        select_namespaces,
    };

    fn template(compliance_type: &str, definition: Value) -> ObjectTemplate {
        ObjectTemplate {
            compliance_type: compliance_type.to_string(),
            metadata_compliance_type: None,
            object_definition: definition.into(),
        }
    }

    fn namespaced(plural: &str) -> ResourceKind {
        ResourceKind {
            plural: plural.to_string(),
            namespaced: true,
        }
    }

    fn cluster_scoped(plural: &str) -> ResourceKind {
        ResourceKind {
            plural: plural.to_string(),
            namespaced: false,
        }
    }

    /// A cluster as the reads see it: the objects that exist, by (namespace, name).
    struct Cluster(Vec<Value>);

    impl Cluster {
        fn answer(&self, reads: &[ObjectRead]) -> BTreeMap<ObjectRead, Observed> {
            let key = |o: &Value| {
                (
                    o.pointer("/kind")
                        .and_then(Value::as_str)
                        .map(str::to_string),
                    o.pointer("/metadata/namespace")
                        .and_then(Value::as_str)
                        .map(str::to_string),
                    o.pointer("/metadata/name")
                        .and_then(Value::as_str)
                        .map(str::to_string),
                )
            };
            reads
                .iter()
                .map(|read| {
                    let of_kind = self.0.iter().filter(|o| {
                        let (kind, namespace, _) = key(o);
                        kind.as_deref() == Some(read.kind.as_str()) && namespace == read.namespace
                    });
                    let observed = match &read.name {
                        Some(name) => Observed::Object(
                            of_kind
                                .into_iter()
                                .find(|o| key(o).2.as_ref() == Some(name))
                                .cloned(),
                        ),
                        None => Observed::List(of_kind.cloned().collect()),
                    };
                    (read.clone(), observed)
                })
                .collect()
        }
    }

    fn run(
        t: &ObjectTemplate,
        remediation: RemediationAction,
        kind: &ResourceKind,
        namespaces: &[String],
        cluster: &Cluster,
    ) -> TemplateEvaluation {
        let reads = reads(t, kind, namespaces).unwrap_or_default();
        evaluate(t, remediation, kind, namespaces, &cluster.answer(&reads))
    }

    fn configmap(data: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "cm", "namespace": "default", "uid": "1",
                            "resourceVersion": "9", "creationTimestamp": "2026-01-01T00:00:00Z"},
               "data": data})
    }

    const INFORM: RemediationAction = RemediationAction::Inform;
    const ENFORCE: RemediationAction = RemediationAction::Enforce;

    #[test]
    fn a_configmap_with_an_extra_key_is_compliant_under_musthave_only() {
        let definition = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "cm", "namespace": "default"}, "data": {"a": "1"}});
        let cluster = Cluster(vec![configmap(json!({"a": "1", "extra": "x"}))]);
        let kind = namespaced("configmaps");

        let musthave = run(
            &template("musthave", definition.clone()),
            ENFORCE,
            &kind,
            &[],
            &cluster,
        );
        assert_eq!(musthave.compliance, Compliance::Compliant);
        assert_eq!(
            musthave.message,
            "configmaps [cm] found as specified in namespace default"
        );
        assert_eq!(musthave.reason, "K8s `must have` object already exists");
        assert!(musthave.actions.is_empty());

        let only = run(
            &template("mustonlyhave", definition.clone()),
            INFORM,
            &kind,
            &[],
            &cluster,
        );
        assert_eq!(only.compliance, Compliance::NonCompliant);
        assert_eq!(
            only.message,
            "configmaps [cm] found but not as specified in namespace default"
        );
        assert_eq!(only.reason, "K8s does not have a `must have` object");
        assert_eq!(
            only.objects[0].message,
            "configmaps [cm] found but not as specified in namespace default: data.extra"
        );
        assert_eq!(only.objects[0].fields, vec!["data.extra"]);
        assert_eq!(
            only.objects[0].related,
            RelatedObject {
                object: RelatedObjectResource {
                    api_version: "v1".to_string(),
                    kind: "ConfigMap".to_string(),
                    metadata: RelatedObjectMeta {
                        name: "cm".to_string(),
                        namespace: "default".to_string()
                    },
                },
                compliant: "NonCompliant".to_string(),
                reason: "Resource found but does not match".to_string(),
                properties: None,
            }
        );
        assert!(only.actions.is_empty(), "inform writes nothing");
        assert_eq!(
            serde_json::to_value(only.template_status()).unwrap(),
            json!({"Compliant": "NonCompliant", "conditions": [{"type": "violation",
                "status": "True", "reason": "K8s does not have a `must have` object",
                "message": "configmaps [cm] found but not as specified in namespace default"}]})
        );

        let enforced = run(
            &template("mustonlyhave", definition),
            ENFORCE,
            &kind,
            &[],
            &cluster,
        );
        let [EnforceAction::Update { object }] = enforced.actions.as_slice() else {
            panic!("expected one update, got {:?}", enforced.actions);
        };
        assert_eq!(object["data"], json!({"a": "1"}));
        assert_eq!(
            object["metadata"]["resourceVersion"], "9",
            "updates are conditional"
        );
    }

    #[test]
    fn a_missing_list_item_names_the_field() {
        let definition = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "reader", "namespace": "default"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
                      {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]});
        let existing = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "reader", "namespace": "default"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "get"]}]});
        let eval = run(
            &template("musthave", definition),
            ENFORCE,
            &namespaced("roles"),
            &[],
            &Cluster(vec![existing]),
        );
        assert_eq!(eval.compliance, Compliance::NonCompliant);
        assert_eq!(
            eval.objects[0].message,
            "roles [reader] found but not as specified in namespace default: rules"
        );
        let [EnforceAction::Update { object }] = eval.actions.as_slice() else {
            panic!("expected one update, got {:?}", eval.actions);
        };
        assert_eq!(object["rules"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn a_namespace_that_must_exist() {
        let t = template(
            "musthave",
            json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "prod"}}),
        );
        let kind = cluster_scoped("namespaces");
        let empty = Cluster(vec![json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "default"}})]);

        let inform = run(&t, INFORM, &kind, &[], &empty);
        assert_eq!(inform.compliance, Compliance::NonCompliant);
        assert_eq!(inform.message, "namespaces [prod] not found");
        assert_eq!(
            inform.objects[0].related.reason,
            "Resource not found but should exist"
        );
        assert!(inform.actions.is_empty());

        let enforce = run(&t, ENFORCE, &kind, &[], &empty);
        assert_eq!(
            enforce.actions,
            vec![EnforceAction::Create {
                object: json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "prod"}})
            }]
        );

        let present = Cluster(vec![json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "prod", "uid": "x"}, "spec": {"finalizers": ["kubernetes"]},
            "status": {"phase": "Active"}})]);
        let after = run(&t, ENFORCE, &kind, &[], &present);
        assert_eq!(after.compliance, Compliance::Compliant);
        assert_eq!(after.message, "namespaces [prod] found as specified");
        assert!(after.actions.is_empty());
    }

    #[test]
    fn a_forbidden_cluster_role_binding_is_deleted_under_enforce() {
        let binding = |name: &str, role: &str| {
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                   "metadata": {"name": name},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                   "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:anonymous"}]})
        };
        let cluster = Cluster(vec![
            binding("anon-admin", "cluster-admin"),
            binding("anon-view", "view"),
        ]);
        let kind = cluster_scoped("clusterrolebindings");

        // By name.
        let named = template(
            "mustnothave",
            json!({"apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding", "metadata": {"name": "anon-admin"}}),
        );
        let eval = run(&named, INFORM, &kind, &[], &cluster);
        assert_eq!(eval.compliance, Compliance::NonCompliant);
        assert_eq!(eval.message, "clusterrolebindings [anon-admin] found");
        assert_eq!(eval.reason, "K8s has a `must not have` object");
        assert!(eval.actions.is_empty());
        let eval = run(&named, ENFORCE, &kind, &[], &cluster);
        assert_eq!(
            eval.actions,
            vec![EnforceAction::Delete {
                api_version: "rbac.authorization.k8s.io/v1".to_string(),
                kind: "ClusterRoleBinding".to_string(),
                namespace: None,
                name: "anon-admin".to_string(),
            }]
        );

        // By fields: any binding of cluster-admin to anonymous users, whatever its name.
        let by_fields = template(
            "mustnothave",
            json!({"apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "roleRef": {"kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "Group", "name": "system:anonymous"}]}),
        );
        let eval = run(&by_fields, ENFORCE, &kind, &[], &cluster);
        assert_eq!(eval.message, "clusterrolebindings [anon-admin] found");
        assert_eq!(
            eval.actions.len(),
            1,
            "only the cluster-admin binding matches"
        );

        let clean = Cluster(vec![binding("anon-view", "view")]);
        let eval = run(&by_fields, ENFORCE, &kind, &[], &clean);
        assert_eq!(eval.compliance, Compliance::Compliant);
        assert_eq!(eval.message, "clusterrolebindings missing as expected");
        assert_eq!(eval.objects[0].related.object.metadata.name, "-");
    }

    #[test]
    fn a_limit_range_in_every_selected_namespace() {
        let names = ["default", "app-web", "app-api", "app-test"];
        let namespaces: Vec<NamespaceInfo> = names
            .iter()
            .map(|n| NamespaceInfo {
                name: n.to_string(),
                ..Default::default()
            })
            .collect();
        let selector = NamespaceSelector {
            include: vec!["app-*".to_string()],
            exclude: vec!["app-test".to_string()],
            ..Default::default()
        };
        let selected = select_namespaces(&selector, &namespaces).unwrap();
        assert_eq!(selected, vec!["app-api", "app-web"]);

        let t = template(
            "musthave",
            json!({"apiVersion": "v1", "kind": "LimitRange",
            "metadata": {"name": "mem-limit-range"},
            "spec": {"limits": [{"type": "Container", "default": {"memory": "512Mi"}}]}}),
        );
        let kind = namespaced("limitranges");
        let reads = reads(&t, &kind, &selected).unwrap();
        assert_eq!(
            reads
                .iter()
                .map(|r| r.namespace.clone().unwrap())
                .collect::<Vec<_>>(),
            vec!["app-api", "app-web"]
        );

        let limit_range = |ns: &str, memory: &str| {
            json!({"apiVersion": "v1", "kind": "LimitRange",
                   "metadata": {"name": "mem-limit-range", "namespace": ns},
                   "spec": {"limits": [{"type": "Container", "default": {"memory": memory},
                                        "defaultRequest": {"memory": "256Mi"}}]}})
        };
        let none = run(&t, INFORM, &kind, &selected, &Cluster(vec![]));
        assert_eq!(
            none.message,
            "limitranges [mem-limit-range] not found in namespaces: app-api, app-web"
        );
        let one = run(
            &t,
            INFORM,
            &kind,
            &selected,
            &Cluster(vec![limit_range("app-web", "0.5Gi")]),
        );
        assert_eq!(one.compliance, Compliance::NonCompliant);
        assert_eq!(
            one.message,
            "limitranges [mem-limit-range] not found in namespace app-api"
        );
        assert_eq!(
            one.objects.iter().map(|o| o.compliance).collect::<Vec<_>>(),
            vec![Compliance::NonCompliant, Compliance::Compliant]
        );
        let both = run(
            &t,
            ENFORCE,
            &kind,
            &selected,
            &Cluster(vec![
                limit_range("app-web", "512Mi"),
                limit_range("app-api", "512Mi"),
            ]),
        );
        assert_eq!(both.compliance, Compliance::Compliant);
        assert_eq!(
            both.message,
            "limitranges [mem-limit-range] found as specified in namespaces: app-api, app-web"
        );

        let enforce = run(&t, ENFORCE, &kind, &selected, &Cluster(vec![]));
        let created: Vec<&str> = enforce
            .actions
            .iter()
            .map(|a| match a {
                EnforceAction::Create { object } => {
                    object["metadata"]["namespace"].as_str().unwrap()
                }
                other => panic!("expected creates, got {other:?}"),
            })
            .collect();
        assert_eq!(created, vec!["app-api", "app-web"]);
    }

    #[test]
    fn a_policy_enforce_overrides_a_template_inform() {
        let policy: Policy = serde_json::from_value(json!({
            "apiVersion": "policy.open-cluster-management.io/v1", "kind": "Policy",
            "metadata": {"name": "require-ns", "namespace": "default"},
            "spec": {"disabled": false, "remediationAction": "enforce", "policy-templates": [
                {"objectDefinition": {"apiVersion": "policy.open-cluster-management.io/v1",
                    "kind": "ConfigurationPolicy", "metadata": {"name": "require-ns"},
                    "spec": {"remediationAction": "inform", "object-templates": [
                        {"complianceType": "musthave", "objectDefinition":
                            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "prod"}}}]}}}]}
        }))
        .unwrap();
        let config: ConfigurationPolicy =
            serde_json::from_value(policy.spec.policy_templates[0].object_definition.0.clone())
                .unwrap();
        let remediation = effective_remediation(
            policy.spec.remediation_action.as_deref(),
            Some(&config.spec.remediation_action),
        );
        assert_eq!(remediation, ENFORCE);
        let eval = run(
            &config.spec.object_templates[0],
            remediation,
            &cluster_scoped("namespaces"),
            &[],
            &Cluster(vec![]),
        );
        assert_eq!(
            eval.actions.len(),
            1,
            "the namespace is created: {:?}",
            eval.actions
        );
    }

    #[test]
    fn an_unnamed_musthave_matches_by_fields() {
        let t = template(
            "musthave",
            json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"namespace": "default"}, "data": {"tier": "gold"}}),
        );
        let kind = namespaced("configmaps");
        let cm = |name: &str, tier: &str| {
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": name, "namespace": "default"}, "data": {"tier": tier}})
        };
        let eval = run(
            &t,
            ENFORCE,
            &kind,
            &[],
            &Cluster(vec![cm("b", "gold"), cm("a", "gold"), cm("c", "tin")]),
        );
        assert_eq!(eval.compliance, Compliance::Compliant);
        assert_eq!(
            eval.message,
            "configmaps [a, b] found as specified in namespace default"
        );

        let eval = run(&t, ENFORCE, &kind, &[], &Cluster(vec![cm("c", "tin")]));
        assert_eq!(eval.compliance, Compliance::NonCompliant);
        assert_eq!(eval.message, "configmaps not found in namespace default");
        assert!(eval.actions.is_empty(), "nothing to create without a name");
        assert_eq!(
            eval.objects[0].message,
            "configmaps not found in namespace default: no object has the template's fields, and enforce cannot create one without metadata.name"
        );
    }

    #[test]
    fn a_template_that_cannot_be_evaluated_says_why() {
        let no_namespace = template(
            "musthave",
            json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "cm"}}),
        );
        let eval = evaluate(
            &no_namespace,
            INFORM,
            &namespaced("configmaps"),
            &[],
            &BTreeMap::new(),
        );
        assert_eq!(eval.compliance, Compliance::NonCompliant);
        assert_eq!(
            eval.message,
            "namespaced object cm of kind ConfigMap has no namespace: set metadata.namespace or a namespaceSelector that selects at least one namespace"
        );

        let unread = template(
            "musthave",
            json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "cm", "namespace": "default"}}),
        );
        let eval = evaluate(
            &unread,
            INFORM,
            &namespaced("configmaps"),
            &[],
            &BTreeMap::new(),
        );
        assert_eq!(eval.message, "ConfigMap cm was not read from the cluster");

        let unknown = template(
            "shouldhave",
            json!({"apiVersion": "v1", "kind": "ConfigMap"}),
        );
        let eval = evaluate(
            &unknown,
            INFORM,
            &namespaced("configmaps"),
            &[],
            &BTreeMap::new(),
        );
        assert_eq!(
            eval.message,
            "complianceType \"shouldhave\" is not musthave, mustonlyhave or mustnothave"
        );
    }

    #[test]
    fn a_status_mismatch_is_not_enforced() {
        let t = template(
            "musthave",
            json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "prod"}, "status": {"phase": "Active"}}),
        );
        let cluster = Cluster(vec![json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "prod"}, "status": {"phase": "Terminating"}})]);
        let eval = run(&t, ENFORCE, &cluster_scoped("namespaces"), &[], &cluster);
        assert_eq!(eval.compliance, Compliance::NonCompliant);
        assert!(eval.actions.is_empty());
        assert_eq!(
            eval.objects[0].message,
            "namespaces [prod] found but not as specified: status.phase (status is reported by the cluster and cannot be enforced)"
        );
    }

    #[test]
    fn plurals_follow_kubernetes_defaults() {
        for (kind, plural) in [
            ("ConfigMap", "configmaps"),
            ("NetworkPolicy", "networkpolicies"),
            ("Ingress", "ingresses"),
            ("Gateway", "gateways"),
            ("LimitRange", "limitranges"),
        ] {
            assert_eq!(plural_of(kind), plural);
        }
    }
}
