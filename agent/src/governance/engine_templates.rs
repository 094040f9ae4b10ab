//! Templates another policy engine on the spoke evaluates: Gatekeeper's constraints and
//! ConstraintTemplates, Kyverno's ClusterPolicies and Policies. As OCM's template sync does,
//! the object is applied as given (server-side apply as [`POLICY_FIELD_MANAGER`], under inform
//! and enforce alike: the engine, not flotilla, decides what to block), and its compliance is
//! read from what the engine reports, by one rule per kind:
//!
//! * a Gatekeeper constraint (`constraints.gatekeeper.sh`) is Compliant when its audit found
//!   nothing: `status.totalViolations` is 0; NonCompliant while Gatekeeper has not audited it
//!   (no `totalViolations` yet) or when it found violations (the first few named);
//! * a ConstraintTemplate (`templates.gatekeeper.sh`) is Compliant once Gatekeeper made its
//!   constraint kind: `status.created` is true;
//! * a Kyverno policy (`kyverno.io`) is Compliant when no PolicyReport or ClusterPolicyReport
//!   (`wgpolicyk8s.io/v1alpha2`) has a `fail` or `error` result of that policy (reports hold
//!   results of many policies, so the per-report `summary` cannot be used).
//!
//! The template's object and the reports are watched, so a new audit or report re-evaluates at
//! once. The applied object carries the created-by mark, and is deleted when the policy goes
//! away (OCM's template objects are owned by their policy).

use std::fmt::Write as _;

use flotilla_proto::api::policy::{ANNOTATION_CREATED_BY_POLICY, Compliance};
use serde_json::Value;

use super::MAX_LISTED_OBJECTS;
use super::evaluation::{POLICY_FIELD_MANAGER, ReadScope, TemplateOutcome, mark_created, resource};
use crate::apply::{ApplyError, ApplyTarget, ResourceKind};
use crate::cache::AppliedResource;

/// How many violations or failing results a message names; the rest are counted.
const NAMED_FINDINGS: usize = 5;

/// Which engine evaluates a template, by its API group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Engine {
    GatekeeperConstraint,
    GatekeeperTemplate,
    Kyverno,
}

impl Engine {
    /// The engine of a template with this `apiVersion`, if flotilla reads its compliance.
    pub fn of(api_version: &str) -> Option<Engine> {
        match api_version.split_once('/')?.0 {
            "constraints.gatekeeper.sh" => Some(Engine::GatekeeperConstraint),
            "templates.gatekeeper.sh" => Some(Engine::GatekeeperTemplate),
            "kyverno.io" => Some(Engine::Kyverno),
            _ => None,
        }
    }
}

/// A template applied as given and judged by its engine.
#[derive(Clone, Debug)]
pub(crate) struct EngineTemplate {
    pub policy_uid: String,
    pub engine: Engine,
    /// The object as the Policy carries it.
    pub object: Value,
}

impl EngineTemplate {
    fn describe(&self) -> String {
        format!(
            "{} {}",
            self.object["kind"].as_str().unwrap_or_default(),
            self.object["metadata"]["name"].as_str().unwrap_or_default()
        )
    }
}

fn refused(message: String) -> TemplateOutcome {
    TemplateOutcome {
        compliance: Compliance::NonCompliant,
        message,
        scopes: Vec::new(),
        related: Vec::new(),
        unresolved: false,
    }
}

/// Applies the template's object and reads its compliance by its engine's rule.
pub(crate) async fn evaluate_engine_template(
    target: &dyn ApplyTarget,
    template: &EngineTemplate,
) -> TemplateOutcome {
    let what = template.describe();
    let (kind, at) = match locate(target, template).await {
        Ok(located) => located,
        Err(message) => return refused(message),
    };
    let mut object = template.object.clone();
    mark_created(&mut object, &template.policy_uid);
    let stored = match target.apply(&at, &object, POLICY_FIELD_MANAGER, true).await {
        Ok(stored) => stored,
        Err(e) => return refused(format!("cannot apply {what}: {e}")),
    };
    let mut scopes = vec![ReadScope {
        kind,
        namespace: (!at.namespace.is_empty()).then(|| at.namespace.clone()),
        name: Some(at.name.clone()),
    }];
    let (compliance, message) = match template.engine {
        Engine::GatekeeperConstraint => constraint_compliance(&what, &stored),
        Engine::GatekeeperTemplate => {
            if stored.pointer("/status/created") == Some(&Value::Bool(true)) {
                (
                    Compliance::Compliant,
                    format!("{what} is created by Gatekeeper"),
                )
            } else {
                (
                    Compliance::NonCompliant,
                    format!("{what} is not created by Gatekeeper yet (status.created)"),
                )
            }
        }
        Engine::Kyverno => match kyverno_compliance(target, &at, &mut scopes).await {
            Ok(judged) => judged,
            Err(message) => (Compliance::NonCompliant, message),
        },
    };
    TemplateOutcome {
        compliance,
        message,
        scopes,
        related: Vec::new(),
        unresolved: false,
    }
}

/// Deletes the template's object if this policy applied it (it carries the policy's mark);
/// the problem, if any, for the caller to log.
pub(crate) async fn remove_engine_template(
    target: &dyn ApplyTarget,
    template: &EngineTemplate,
) -> Option<String> {
    let what = template.describe();
    let (_, at) = match locate(target, template).await {
        Ok(located) => located,
        // Never served, so never applied.
        Err(_) => return None,
    };
    let ours = match target.get(&at).await {
        Ok(found) => found.is_some_and(|o| {
            o.pointer("/metadata/annotations")
                .and_then(|a| a.get(ANNOTATION_CREATED_BY_POLICY))
                .and_then(Value::as_str)
                == Some(template.policy_uid.as_str())
        }),
        Err(e) => return Some(format!("cannot read {what}: {e}")),
    };
    if !ours {
        return None;
    }
    target
        .delete(&at)
        .await
        .err()
        .map(|e| format!("cannot delete {what}: {e}"))
}

async fn locate(
    target: &dyn ApplyTarget,
    template: &EngineTemplate,
) -> Result<(ResourceKind, AppliedResource), String> {
    let object = &template.object;
    let what = template.describe();
    let (Some(api_version), Some(kind), Some(name)) = (
        object["apiVersion"].as_str(),
        object["kind"].as_str(),
        object["metadata"]["name"].as_str(),
    ) else {
        return Err(format!(
            "template {what} needs apiVersion, kind and metadata.name"
        ));
    };
    let resolved = target
        .resolve(api_version, kind)
        .await
        .map_err(|e| match e {
            ApplyError::UnknownKind { .. } => {
                format!("{e} (is the engine that evaluates {what} installed on the cluster?)")
            }
            e => e.to_string(),
        })?;
    let namespace = object["metadata"]["namespace"].as_str();
    if resolved.namespaced && namespace.is_none() {
        return Err(format!("{what} is namespaced: set its metadata.namespace"));
    }
    let namespace = namespace.filter(|_| resolved.namespaced);
    let at = resource(&resolved, namespace, name);
    Ok((resolved, at))
}

fn constraint_compliance(what: &str, stored: &Value) -> (Compliance, String) {
    let Some(total) = stored
        .pointer("/status/totalViolations")
        .and_then(Value::as_u64)
    else {
        return (
            Compliance::NonCompliant,
            format!("{what} has not been audited by Gatekeeper yet (status.totalViolations)"),
        );
    };
    if total == 0 {
        return (Compliance::Compliant, format!("{what} has no violations"));
    }
    let mut message = format!("{what} has {total} violations");
    let violations = stored
        .pointer("/status/violations")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    for (i, v) in violations.iter().take(NAMED_FINDINGS).enumerate() {
        let namespace = v["namespace"].as_str().unwrap_or_default();
        let at = if namespace.is_empty() {
            String::new()
        } else {
            format!(" in namespace {namespace}")
        };
        let _ = write!(
            message,
            "{} {} [{}]{at}: {}",
            if i == 0 { ":" } else { ";" },
            v["kind"].as_str().unwrap_or_default(),
            v["name"].as_str().unwrap_or_default(),
            v["message"].as_str().unwrap_or_default()
        );
    }
    (Compliance::NonCompliant, message)
}

/// The policy's failing results over every PolicyReport and ClusterPolicyReport.
async fn kyverno_compliance(
    target: &dyn ApplyTarget,
    policy: &AppliedResource,
    scopes: &mut Vec<ReadScope>,
) -> Result<(Compliance, String), String> {
    // Kyverno names a namespaced Policy's results `namespace/name`.
    let names = if policy.namespace.is_empty() {
        vec![policy.name.clone()]
    } else {
        vec![
            format!("{}/{}", policy.namespace, policy.name),
            policy.name.clone(),
        ]
    };
    let what = format!("{} {}", policy.kind, policy.name);
    let mut failing = Vec::new();
    let mut served = 0;
    for report_kind in ["PolicyReport", "ClusterPolicyReport"] {
        let kind = match target.resolve("wgpolicyk8s.io/v1alpha2", report_kind).await {
            Ok(kind) => kind,
            Err(ApplyError::UnknownKind { .. }) => continue,
            Err(e) => return Err(format!("cannot read {what}'s reports: {e}")),
        };
        served += 1;
        scopes.push(ReadScope {
            kind: kind.clone(),
            namespace: None,
            name: None,
        });
        let reports = target
            .list(&kind, None, MAX_LISTED_OBJECTS)
            .await
            .map_err(|e| format!("cannot read {what}'s reports: {e}"))?;
        for report in &reports {
            let results = report["results"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default();
            for result in results {
                let of_policy = result["policy"]
                    .as_str()
                    .is_some_and(|p| names.iter().any(|n| n == p));
                let outcome = result["result"].as_str().unwrap_or_default();
                if of_policy && matches!(outcome, "fail" | "error") {
                    failing.push(finding(report, result));
                }
            }
        }
    }
    if served == 0 {
        return Err(format!(
            "the cluster serves no PolicyReports (wgpolicyk8s.io/v1alpha2), so {what}'s results cannot be read"
        ));
    }
    if failing.is_empty() {
        return Ok((
            Compliance::Compliant,
            format!("{what} has no failing results in the policy reports"),
        ));
    }
    let mut message = format!("{what} has {} failing results", failing.len());
    for (i, f) in failing.iter().take(NAMED_FINDINGS).enumerate() {
        let _ = write!(message, "{} {f}", if i == 0 { ":" } else { ";" });
    }
    Ok((Compliance::NonCompliant, message))
}

/// One failing result, naming the resource it is about and the rule's message.
fn finding(report: &Value, result: &Value) -> String {
    // Per-resource reports name their resource in `scope`; older ones in each result.
    let subject = result["resources"]
        .as_array()
        .and_then(|r| r.first())
        .unwrap_or(&report["scope"]);
    let namespace = subject["namespace"].as_str().unwrap_or_default();
    let at = if namespace.is_empty() {
        String::new()
    } else {
        format!(" in namespace {namespace}")
    };
    format!(
        "{} [{}]{at}: rule {}: {}",
        subject["kind"].as_str().unwrap_or_default(),
        subject["name"].as_str().unwrap_or_default(),
        result["rule"].as_str().unwrap_or_default(),
        result["message"].as_str().unwrap_or_default()
    )
}
