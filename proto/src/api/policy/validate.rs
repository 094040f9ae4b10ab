//! Checks on the governance kinds before they are stored, so that a bad policy is refused at
//! apply with the object, the field and the fix, instead of failing later on every cluster.

use serde_json::Value;

use super::compare::ComplianceType;
use super::namespaces::glob_match;
use super::template::{self, Dialect};
use super::types::{
    ConfigurationPolicy, ConfigurationPolicySpec, Interval, POLICY_GROUP, PlacementBinding, Policy,
    PolicySet, PruneObjectBehavior, RemediationAction, Severity,
};
use crate::api::object_name;

/// Most templates one Policy may carry. OCM sets no limit; policy-collection's largest carry
/// a handful, and every template is evaluated on every selected cluster, so a hundred is far
/// beyond real use while keeping one policy's evaluation cost bounded.
pub const MAX_POLICY_TEMPLATES: usize = 100;
/// Most object-templates one ConfigurationPolicy may carry (each is at least one read per
/// selected namespace on every cluster).
pub const MAX_OBJECT_TEMPLATES: usize = 100;
/// Largest Policy spec, in bytes of compact JSON. The stores hold objects up to 1.5 MiB; a
/// root policy's status grows with its clusters (about 80 bytes each), so 512 KiB of spec
/// leaves room for the status of ten thousand clusters in the same object.
pub const MAX_POLICY_BYTES: usize = 512 * 1024;
/// Longest namespace plus name of a Policy: `<namespace>.<name>` names its copy for each
/// cluster and must fit a 63-character label value (OCM's webhook refuses the same).
pub const MAX_POLICY_QUALIFIED_NAME: usize = 62;
/// Most subjects one PlacementBinding may bind.
pub const MAX_SUBJECTS: usize = 100;
/// Most policies one PolicySet may group.
pub const MAX_SET_POLICIES: usize = 100;

/// One problem with a governance object. None is retryable: fix the object and apply it
/// again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// A field is missing or holds a value OCM does not define. Not retryable.
    #[error("{kind} {object}: {field} {problem}")]
    Field {
        kind: &'static str,
        object: String,
        field: String,
        problem: String,
    },
    /// A list is longer than its bound. Not retryable: split the object.
    #[error(
        "{kind} {object}: {field} has {count} entries, more than the {limit} allowed; split it into several {kind} objects"
    )]
    TooMany {
        kind: &'static str,
        object: String,
        field: String,
        count: usize,
        limit: usize,
    },
    /// The spec exceeds [`MAX_POLICY_BYTES`]. Not retryable: split the policy.
    #[error(
        "{kind} {object}: spec takes {bytes} bytes, more than the {limit} allowed; split it over several Policies"
    )]
    TooLarge {
        kind: &'static str,
        object: String,
        bytes: usize,
        limit: usize,
    },
    /// A field of OCM's API that flotilla does not implement. Not retryable: remove it.
    #[error("{kind} {object}: {field} is not supported by flotilla; remove it")]
    Unsupported {
        kind: &'static str,
        object: String,
        field: String,
    },
}

struct Report<'a> {
    kind: &'static str,
    object: &'a str,
    errors: Vec<PolicyError>,
}

impl Report<'_> {
    fn field(&mut self, field: impl Into<String>, problem: impl Into<String>) {
        self.errors.push(PolicyError::Field {
            kind: self.kind,
            object: self.object.to_string(),
            field: field.into(),
            problem: problem.into(),
        });
    }

    fn bound(&mut self, field: impl Into<String>, count: usize, limit: usize) {
        if count > limit {
            self.errors.push(PolicyError::TooMany {
                kind: self.kind,
                object: self.object.to_string(),
                field: field.into(),
                count,
                limit,
            });
        }
    }

    fn unsupported(&mut self, value: Option<&Value>, field: impl Into<String>) {
        if value.is_some() {
            self.errors.push(PolicyError::Unsupported {
                kind: self.kind,
                object: self.object.to_string(),
                field: field.into(),
            });
        }
    }

    fn finish(self) -> Result<(), Vec<PolicyError>> {
        if self.errors.is_empty() {
            Ok(())
        } else {
            Err(self.errors)
        }
    }
}

/// OCM fields of a Policy's spec that flotilla refuses rather than ignores.
const UNSUPPORTED_POLICY_FIELDS: &[&str] = &["dependencies", "hubTemplateOptions"];
/// ... of each policy template.
const UNSUPPORTED_POLICY_TEMPLATE_FIELDS: &[&str] = &["extraDependencies"];
/// ... of a ConfigurationPolicy's spec.
const UNSUPPORTED_CONFIG_FIELDS: &[&str] = &["object-templates-raw", "customMessage"];
/// ... of an object-template.
const UNSUPPORTED_OBJECT_TEMPLATE_FIELDS: &[&str] =
    &["recordDiff", "recreateOption", "objectSelector"];
/// ... of a namespaceSelector.
const UNSUPPORTED_SELECTOR_FIELDS: &[&str] = &["terminatingInclusion"];
/// ... of a PlacementBinding.
const UNSUPPORTED_BINDING_FIELDS: &[&str] = &["bindingOverrides", "subFilter"];
/// ... of a PolicySet's spec.
const UNSUPPORTED_SET_FIELDS: &[&str] = &["exclusions"];

/// Checks a Policy and every ConfigurationPolicy it carries; returns all the problems found.
///
/// `raw` is the object as applied, when the caller has it: the typed [`Policy`] drops fields
/// flotilla does not model, and `raw` lets those of OCM's that flotilla does not implement
/// (`dependencies`, `object-templates-raw`, ...) be refused by name instead of silently
/// ignored.
pub fn validate_policy(policy: &Policy, raw: Option<&Value>) -> Result<(), Vec<PolicyError>> {
    let object = object_name(
        policy.metadata.namespace.as_deref(),
        policy.metadata.name.as_deref(),
    );
    let mut report = Report {
        kind: "Policy",
        object: &object,
        errors: Vec::new(),
    };
    let spec = &policy.spec;
    let raw_spec = raw.and_then(|r| r.get("spec"));
    // OCM copies a policy into each cluster's namespace as `<namespace>.<name>`, which must
    // fit a label value (63 characters).
    if let (Some(namespace), Some(name)) = (&policy.metadata.namespace, &policy.metadata.name)
        && namespace.len() + name.len() > MAX_POLICY_QUALIFIED_NAME
    {
        report.field(
            "metadata.name",
            format!(
                "and namespace together take {} characters, more than the {MAX_POLICY_QUALIFIED_NAME} allowed (the policy is copied to clusters as <namespace>.<name>); shorten the name",
                namespace.len() + name.len()
            ),
        );
    }
    for field in UNSUPPORTED_POLICY_FIELDS {
        report.unsupported(raw_spec.and_then(|s| s.get(field)), format!("spec.{field}"));
    }
    if let Some(action) = &spec.remediation_action
        && RemediationAction::parse(action).is_none()
    {
        report.field(
            "spec.remediationAction",
            format!("is {action:?}; use inform or enforce"),
        );
    }
    report.bound(
        "spec.policy-templates",
        spec.policy_templates.len(),
        MAX_POLICY_TEMPLATES,
    );
    let bytes = serde_json::to_string(spec).map_or(0, |s| s.len());
    if bytes > MAX_POLICY_BYTES {
        report.errors.push(PolicyError::TooLarge {
            kind: "Policy",
            object: object.clone(),
            bytes,
            limit: MAX_POLICY_BYTES,
        });
    }
    let hub_dialect = Dialect::Hub {
        policy_namespace: policy.metadata.namespace.clone().unwrap_or_default(),
    };
    let mut names = std::collections::BTreeSet::new();
    for (index, template) in spec.policy_templates.iter().enumerate() {
        let path = format!("spec.policy-templates[{index}]");
        let raw_template = raw_spec.and_then(|s| s.pointer(&format!("/policy-templates/{index}")));
        for field in UNSUPPORTED_POLICY_TEMPLATE_FIELDS {
            report.unsupported(
                raw_template.and_then(|t| t.get(field)),
                format!("{path}.{field}"),
            );
        }
        let definition = &template.object_definition;
        let path = format!("{path}.objectDefinition");
        if !definition.0.is_object() {
            report.field(&path, "is not an object");
            continue;
        }
        for (field, problem) in template::check(&definition.0, &hub_dialect) {
            report.field(
                format!("{path}.{field}"),
                format!("holds a hub template that {problem}"),
            );
        }
        if definition.api_version().is_none() {
            report.field(&path, "has no apiVersion");
        }
        let Some(kind) = definition.kind() else {
            report.field(&path, "has no kind");
            continue;
        };
        match definition.name() {
            None => report.field(&path, "has no metadata.name"),
            Some(name) if !names.insert((kind.to_string(), name.to_string())) => report.field(
                &path,
                format!("repeats the {kind} name {name:?}; each template needs its own name"),
            ),
            Some(_) => {}
        }
        if kind == "ConfigurationPolicy"
            && definition
                .api_version()
                .is_some_and(|v| v.starts_with(POLICY_GROUP))
        {
            match serde_json::from_value::<ConfigurationPolicy>(definition.0.clone()) {
                Ok(config) => check_configuration_policy(
                    &mut report,
                    &path,
                    &config.spec,
                    definition.0.get("spec"),
                    spec.remediation_action.is_some(),
                ),
                Err(e) => report.field(&path, format!("is not a valid ConfigurationPolicy: {e}")),
            }
        }
    }
    report.finish()
}

/// Checks a ConfigurationPolicy on its own (as the agent receives it, or applied directly).
pub fn validate_configuration_policy(
    policy: &ConfigurationPolicy,
    raw: Option<&Value>,
) -> Result<(), Vec<PolicyError>> {
    let object = object_name(
        policy.metadata.namespace.as_deref(),
        policy.metadata.name.as_deref(),
    );
    let mut report = Report {
        kind: "ConfigurationPolicy",
        object: &object,
        errors: Vec::new(),
    };
    check_configuration_policy(
        &mut report,
        "",
        &policy.spec,
        raw.and_then(|r| r.get("spec")),
        false,
    );
    report.finish()
}

/// `prefix` is the path of the ConfigurationPolicy inside the object being validated (empty
/// for a ConfigurationPolicy itself); `overridden` says the owning Policy sets the
/// remediation, so the template may leave it out.
fn check_configuration_policy(
    report: &mut Report<'_>,
    prefix: &str,
    spec: &ConfigurationPolicySpec,
    raw_spec: Option<&Value>,
    overridden: bool,
) {
    let at = |field: &str| {
        if prefix.is_empty() {
            format!("spec.{field}")
        } else {
            format!("{prefix}.spec.{field}")
        }
    };
    for field in UNSUPPORTED_CONFIG_FIELDS {
        report.unsupported(raw_spec.and_then(|s| s.get(field)), at(field));
    }
    for field in UNSUPPORTED_SELECTOR_FIELDS {
        report.unsupported(
            raw_spec.and_then(|s| s.pointer(&format!("/namespaceSelector/{field}"))),
            at(&format!("namespaceSelector.{field}")),
        );
    }
    if spec.remediation_action.is_empty() {
        if !overridden {
            report.field(
                at("remediationAction"),
                "is missing; set inform or enforce here or in the Policy's spec.remediationAction",
            );
        }
    } else if RemediationAction::parse(&spec.remediation_action).is_none() {
        report.field(
            at("remediationAction"),
            format!("is {:?}; use inform or enforce", spec.remediation_action),
        );
    }
    if let Some(severity) = &spec.severity
        && Severity::parse(severity).is_none()
    {
        report.field(
            at("severity"),
            format!("is {severity:?}; use low, medium, high or critical"),
        );
    }
    if let Some(prune) = &spec.prune_object_behavior
        && PruneObjectBehavior::parse(prune).is_none()
    {
        report.field(
            at("pruneObjectBehavior"),
            format!("is {prune:?}; use None, DeleteIfCreated or DeleteAll"),
        );
    }
    for (field, value) in [
        ("compliant", &spec.evaluation_interval.compliant),
        ("noncompliant", &spec.evaluation_interval.noncompliant),
    ] {
        if Interval::parse(value).is_none() {
            report.field(
                at(&format!("evaluationInterval.{field}")),
                format!("is {value:?}; use a duration such as 10s or 1h30m, watch, or never"),
            );
        }
    }
    let selector = &spec.namespace_selector;
    for (field, patterns) in [
        ("include", &selector.include),
        ("exclude", &selector.exclude),
    ] {
        for (index, pattern) in patterns.iter().enumerate() {
            let path = at(&format!("namespaceSelector.{field}[{index}]"));
            if pattern.is_empty() {
                report.field(path, "is empty; write a namespace name or glob");
            } else if let Err(e) = glob_match(pattern, "") {
                report.field(path, format!("{pattern:?} {e}"));
            }
        }
    }
    for (index, requirement) in selector.match_expressions.iter().flatten().enumerate() {
        if !["In", "NotIn", "Exists", "DoesNotExist"].contains(&requirement.operator.as_str()) {
            report.field(
                at(&format!(
                    "namespaceSelector.matchExpressions[{index}].operator"
                )),
                format!(
                    "is {:?}; use In, NotIn, Exists or DoesNotExist",
                    requirement.operator
                ),
            );
        }
    }
    report.bound(
        at("object-templates"),
        spec.object_templates.len(),
        MAX_OBJECT_TEMPLATES,
    );
    if spec.object_templates.is_empty() {
        report.field(
            at("object-templates"),
            "is empty; add at least one object template",
        );
    }
    for (index, template) in spec.object_templates.iter().enumerate() {
        let path = at(&format!("object-templates[{index}]"));
        let raw_template = raw_spec.and_then(|s| s.pointer(&format!("/object-templates/{index}")));
        for field in UNSUPPORTED_OBJECT_TEMPLATE_FIELDS {
            report.unsupported(
                raw_template.and_then(|t| t.get(field)),
                format!("{path}.{field}"),
            );
        }
        if ComplianceType::parse(&template.compliance_type).is_none() {
            report.field(
                format!("{path}.complianceType"),
                format!(
                    "is {:?}; use musthave, mustonlyhave or mustnothave",
                    template.compliance_type
                ),
            );
        }
        if let Some(value) = &template.metadata_compliance_type
            && !matches!(
                ComplianceType::parse(value),
                Some(ComplianceType::MustHave | ComplianceType::MustOnlyHave)
            )
        {
            report.field(
                format!("{path}.metadataComplianceType"),
                format!("is {value:?}; use musthave or mustonlyhave"),
            );
        }
        let definition = &template.object_definition;
        let definition_path = format!("{path}.objectDefinition");
        if !definition.0.is_object() {
            report.field(definition_path, "is not an object");
            continue;
        }
        if definition.api_version().is_none() {
            report.field(&definition_path, "has no apiVersion");
        }
        if definition.kind().is_none() {
            report.field(&definition_path, "has no kind");
        }
        for (field, problem) in template::check(&definition.0, &Dialect::Managed) {
            report.field(
                format!("{definition_path}.{field}"),
                format!("holds a template that {problem}"),
            );
        }
    }
}

/// Checks a PlacementBinding: a Placement to bind, and Policies or PolicySets to bind to it.
pub fn validate_placement_binding(
    binding: &PlacementBinding,
    raw: Option<&Value>,
) -> Result<(), Vec<PolicyError>> {
    let object = object_name(
        binding.metadata.namespace.as_deref(),
        binding.metadata.name.as_deref(),
    );
    let mut report = Report {
        kind: "PlacementBinding",
        object: &object,
        errors: Vec::new(),
    };
    for field in UNSUPPORTED_BINDING_FIELDS {
        report.unsupported(raw.and_then(|r| r.get(field)), *field);
    }
    let placement = &binding.placement_ref;
    if placement.kind == "PlacementRule" {
        report.field(
            "placementRef.kind",
            "is PlacementRule, which OCM deprecated and flotilla does not support; bind a Placement (apiGroup cluster.open-cluster-management.io)",
        );
    } else if placement.kind != "Placement" {
        report.field(
            "placementRef.kind",
            format!("is {:?}; use Placement", placement.kind),
        );
    }
    if placement.api_group != "cluster.open-cluster-management.io" {
        report.field(
            "placementRef.apiGroup",
            format!(
                "is {:?}; use cluster.open-cluster-management.io",
                placement.api_group
            ),
        );
    }
    if placement.name.is_empty() {
        report.field(
            "placementRef.name",
            "is empty; name a Placement in this namespace",
        );
    }
    if binding.subjects.is_empty() {
        report.field(
            "subjects",
            "is empty; bind at least one Policy or PolicySet",
        );
    }
    report.bound("subjects", binding.subjects.len(), MAX_SUBJECTS);
    for (index, subject) in binding.subjects.iter().enumerate() {
        if subject.api_group != POLICY_GROUP {
            report.field(
                format!("subjects[{index}].apiGroup"),
                format!("is {:?}; use {POLICY_GROUP}", subject.api_group),
            );
        }
        if subject.kind != "Policy" && subject.kind != "PolicySet" {
            report.field(
                format!("subjects[{index}].kind"),
                format!("is {:?}; use Policy or PolicySet", subject.kind),
            );
        }
        if subject.name.is_empty() {
            report.field(format!("subjects[{index}].name"), "is empty");
        }
    }
    report.finish()
}

/// Checks a PolicySet: named policies, within the bound.
pub fn validate_policy_set(set: &PolicySet, raw: Option<&Value>) -> Result<(), Vec<PolicyError>> {
    let object = object_name(
        set.metadata.namespace.as_deref(),
        set.metadata.name.as_deref(),
    );
    let mut report = Report {
        kind: "PolicySet",
        object: &object,
        errors: Vec::new(),
    };
    for field in UNSUPPORTED_SET_FIELDS {
        report.unsupported(
            raw.and_then(|r| r.get("spec")).and_then(|s| s.get(field)),
            format!("spec.{field}"),
        );
    }
    report.bound("spec.policies", set.spec.policies.len(), MAX_SET_POLICIES);
    for (index, name) in set.spec.policies.iter().enumerate() {
        if name.is_empty() {
            report.field(format!("spec.policies[{index}]"), "is empty; name a Policy");
        }
    }
    report.finish()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn policy(raw: Value) -> (Policy, Value) {
        (serde_json::from_value(raw.clone()).unwrap(), raw)
    }

    fn errors_of_policy(raw: Value) -> Vec<String> {
        let (p, raw) = policy(raw);
        match validate_policy(&p, Some(&raw)) {
            Ok(()) => Vec::new(),
            Err(errors) => errors.iter().map(ToString::to_string).collect(),
        }
    }

    fn with_config(config_spec: Value) -> Value {
        json!({"apiVersion": "policy.open-cluster-management.io/v1", "kind": "Policy",
               "metadata": {"name": "p", "namespace": "default"},
               "spec": {"disabled": false, "policy-templates": [{"objectDefinition":
                   {"apiVersion": "policy.open-cluster-management.io/v1",
                    "kind": "ConfigurationPolicy", "metadata": {"name": "c"},
                    "spec": config_spec}}]}})
    }

    fn object_template(compliance_type: &str) -> Value {
        json!({"complianceType": compliance_type,
               "objectDefinition": {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "prod"}}})
    }

    #[test]
    fn a_valid_policy_passes() {
        let errors = errors_of_policy(with_config(json!({"remediationAction": "Inform",
            "severity": "low", "pruneObjectBehavior": "DeleteIfCreated",
            "evaluationInterval": {"compliant": "10m", "noncompliant": "10s"},
            "namespaceSelector": {"include": ["app-*"], "exclude": ["app-test"]},
            "object-templates": [object_template("MustHave")]})));
        assert_eq!(errors, Vec::<String>::new());
    }

    #[test]
    fn a_template_without_a_kind_is_refused_by_field() {
        let errors = errors_of_policy(json!({"apiVersion": "policy.open-cluster-management.io/v1",
            "kind": "Policy", "metadata": {"name": "require-ns", "namespace": "default"},
            "spec": {"disabled": false, "policy-templates": [{"objectDefinition":
                {"apiVersion": "policy.open-cluster-management.io/v1", "metadata": {"name": "c"}}}]}}));
        assert_eq!(
            errors,
            vec![
                "Policy default/require-ns: spec.policy-templates[0].objectDefinition has no kind"
            ]
        );
    }

    #[test]
    fn bad_configuration_policy_fields_are_named() {
        let errors = errors_of_policy(with_config(json!({"remediationAction": "audit",
            "severity": "urgent", "pruneObjectBehavior": "deleteall",
            "evaluationInterval": {"compliant": "10 minutes"},
            "namespaceSelector": {"include": ["app-["],
                "matchExpressions": [{"key": "env", "operator": "Equals", "values": ["a"]}]},
            "object-templates": [object_template("shouldhave"),
                {"complianceType": "musthave", "metadataComplianceType": "mustnothave",
                 "objectDefinition": {"apiVersion": "v1", "metadata": {"name": "x"}}}]})));
        let at = "Policy default/p: spec.policy-templates[0].objectDefinition.spec";
        assert_eq!(
            errors,
            vec![
                format!("{at}.remediationAction is \"audit\"; use inform or enforce"),
                format!("{at}.severity is \"urgent\"; use low, medium, high or critical"),
                format!(
                    "{at}.pruneObjectBehavior is \"deleteall\"; use None, DeleteIfCreated or DeleteAll"
                ),
                format!(
                    "{at}.evaluationInterval.compliant is \"10 minutes\"; use a duration such as 10s or 1h30m, watch, or never"
                ),
                format!("{at}.namespaceSelector.include[0] \"app-[\" has an unclosed ["),
                format!(
                    "{at}.namespaceSelector.matchExpressions[0].operator is \"Equals\"; use In, NotIn, Exists or DoesNotExist"
                ),
                format!(
                    "{at}.object-templates[0].complianceType is \"shouldhave\"; use musthave, mustonlyhave or mustnothave"
                ),
                format!(
                    "{at}.object-templates[1].metadataComplianceType is \"mustnothave\"; use musthave or mustonlyhave"
                ),
                format!("{at}.object-templates[1].objectDefinition has no kind"),
            ]
        );
    }

    #[test]
    fn the_remediation_may_come_from_the_policy_only() {
        let mut raw = with_config(json!({"object-templates": [object_template("musthave")]}));
        assert_eq!(
            errors_of_policy(raw.clone()),
            vec![
                "Policy default/p: spec.policy-templates[0].objectDefinition.spec.remediationAction is missing; set inform or enforce here or in the Policy's spec.remediationAction"
            ]
        );
        raw["spec"]["remediationAction"] = json!("enforce");
        assert_eq!(errors_of_policy(raw.clone()), Vec::<String>::new());
        raw["spec"]["remediationAction"] = json!("fix");
        assert_eq!(
            errors_of_policy(raw),
            vec!["Policy default/p: spec.remediationAction is \"fix\"; use inform or enforce"]
        );
    }

    #[test]
    fn oversize_policies_are_refused_with_the_limit() {
        let templates: Vec<Value> = (0..=MAX_POLICY_TEMPLATES)
            .map(|i| {
                json!({"objectDefinition": {"apiVersion": "v1", "kind": "ConfigMap",
                                                 "metadata": {"name": format!("t{i}")}}})
            })
            .collect();
        let errors = errors_of_policy(json!({"apiVersion": "policy.open-cluster-management.io/v1",
            "kind": "Policy", "metadata": {"name": "big", "namespace": "default"},
            "spec": {"disabled": false, "policy-templates": templates}}));
        assert_eq!(
            errors,
            vec![
                "Policy default/big: spec.policy-templates has 101 entries, more than the 100 allowed; split it into several Policy objects"
            ]
        );

        let blob = "x".repeat(MAX_POLICY_BYTES);
        let errors = errors_of_policy(json!({"apiVersion": "policy.open-cluster-management.io/v1",
            "kind": "Policy", "metadata": {"name": "big", "namespace": "default"},
            "spec": {"disabled": false, "policy-templates": [{"objectDefinition":
                {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"blob": blob}}}]}}));
        assert_eq!(
            errors,
            vec![
                "Policy default/big: spec takes 524430 bytes, more than the 524288 allowed; split it over several Policies"
            ]
        );

        let many: Vec<Value> = (0..=MAX_OBJECT_TEMPLATES)
            .map(|_| object_template("musthave"))
            .collect();
        let errors = errors_of_policy(with_config(
            json!({"remediationAction": "inform", "object-templates": many}),
        ));
        assert_eq!(
            errors,
            vec![
                "Policy default/p: spec.policy-templates[0].objectDefinition.spec.object-templates has 101 entries, more than the 100 allowed; split it into several Policy objects"
            ]
        );
    }

    #[test]
    fn unsupported_ocm_fields_are_refused_by_name() {
        let mut raw = with_config(json!({"remediationAction": "inform",
            "object-templates-raw": "{{ range ... }}",
            "object-templates": [{"complianceType": "musthave", "recordDiff": "Log",
                "objectDefinition": {"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": "c", "namespace": "default"},
                    "data": {"cluster": "{{hub .ManagedClusterName hub}}"}}}]}));
        raw["spec"]["dependencies"] = json!([]);
        let at = "Policy default/p: spec";
        assert_eq!(
            errors_of_policy(raw),
            vec![
                format!("{at}.dependencies is not supported by flotilla; remove it"),
                format!(
                    "{at}.policy-templates[0].objectDefinition.spec.object-templates-raw is not supported by flotilla; remove it"
                ),
                format!(
                    "{at}.policy-templates[0].objectDefinition.spec.object-templates[0].recordDiff is not supported by flotilla; remove it"
                ),
            ]
        );
    }

    #[test]
    fn templates_are_checked_by_field_and_the_good_ones_pass() {
        let configured = |data: Value| {
            with_config(json!({"remediationAction": "enforce",
                "object-templates": [{"complianceType": "musthave",
                    "objectDefinition": {"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": "c", "namespace": "default"}, "data": data}}]}))
        };
        assert_eq!(
            errors_of_policy(configured(json!({
                "cluster": "{{hub .ManagedClusterName hub}}",
                "env": "{{hub index .ManagedClusterLabels \"env\" hub}}",
                "version": "{{hub fromClusterClaim \"kubeversion.open-cluster-management.io\" hub}}",
                "copied": "{{ (lookup \"v1\" \"ConfigMap\" \"app\" \"source\").data.color | default \"none\" }}",
                "claim": "{{ fromClusterClaim \"id.k8s.io\" | upper }}",
                // The hub's own ConfigMaps, of the policy's namespace ("" names it).
                "tier": "{{hub fromConfigMap \"\" \"settings\" \"tier\" hub}}",
                "same": "{{hub fromConfigMap \"default\" \"settings\" \"tier\" hub}}"}))),
            Vec::<String>::new()
        );
        let at = "Policy default/p: spec.policy-templates[0].objectDefinition";
        let inner = format!("{at}.spec.object-templates[0].objectDefinition");
        assert_eq!(
            errors_of_policy(configured(json!({
                "a": "{{ fromSecret \"ns\" \"s\" \"k\" }}",
                "b": "{{hub fromConfigMap \"kube-system\" \"c\" \"k\" hub}}",
                "c": "{{ if true }}"}))),
            vec![
                format!(
                    "{inner}.data.b holds a hub template that reads the ConfigMap namespace \"kube-system\"; hub templates read only the policy's namespace \"default\" (write \"\" for it)"
                ),
                format!(
                    "{inner}.data.a holds a template that uses the function \"fromSecret\", which flotilla's managed-cluster templates do not provide (they provide lookup, fromConfigMap, fromClusterClaim and {})",
                    super::super::template::HELPERS.join(", ")
                ),
                format!(
                    "{inner}.data.c holds a template that does not parse: {{{{if}}}} without {{{{end}}}}"
                ),
            ]
        );
    }

    #[test]
    fn a_policy_name_too_long_to_copy_is_refused() {
        let name = "n".repeat(55);
        let errors = errors_of_policy(json!({"apiVersion": "policy.open-cluster-management.io/v1",
            "kind": "Policy", "metadata": {"name": name, "namespace": "governance"},
            "spec": {"disabled": false, "policy-templates": []}}));
        assert_eq!(
            errors,
            vec![format!(
                "Policy governance/{name}: metadata.name and namespace together take 65 characters, more than the 62 allowed (the policy is copied to clusters as <namespace>.<name>); shorten the name"
            )]
        );
    }

    #[test]
    fn bindings_and_sets_are_checked() {
        let raw = json!({"apiVersion": "policy.open-cluster-management.io/v1", "kind": "PlacementBinding",
            "metadata": {"name": "b", "namespace": "default"},
            "placementRef": {"apiGroup": "apps.open-cluster-management.io", "kind": "PlacementRule", "name": "r"},
            "subjects": [{"apiGroup": "policy.open-cluster-management.io", "kind": "ConfigurationPolicy", "name": "c"}],
            "subFilter": "restricted"});
        let binding: PlacementBinding = serde_json::from_value(raw.clone()).unwrap();
        let errors: Vec<String> = validate_placement_binding(&binding, Some(&raw))
            .unwrap_err()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            errors,
            vec![
                "PlacementBinding default/b: subFilter is not supported by flotilla; remove it",
                "PlacementBinding default/b: placementRef.kind is PlacementRule, which OCM deprecated and flotilla does not support; bind a Placement (apiGroup cluster.open-cluster-management.io)",
                "PlacementBinding default/b: placementRef.apiGroup is \"apps.open-cluster-management.io\"; use cluster.open-cluster-management.io",
                "PlacementBinding default/b: subjects[0].kind is \"ConfigurationPolicy\"; use Policy or PolicySet",
            ]
        );

        let raw = json!({"apiVersion": "policy.open-cluster-management.io/v1beta1", "kind": "PolicySet",
            "metadata": {"name": "s", "namespace": "default"},
            "spec": {"description": "d", "policies": ["a", ""]}});
        let set: PolicySet = serde_json::from_value(raw.clone()).unwrap();
        assert_eq!(
            validate_policy_set(&set, Some(&raw)).unwrap_err()[0].to_string(),
            "PolicySet default/s: spec.policies[1] is empty; name a Policy"
        );
    }
}
