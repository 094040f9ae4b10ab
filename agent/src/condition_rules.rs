//! Condition rules: manifest conditions derived from a resource on the spoke, as OCM's agent
//! derives them.
//!
//! * `WellKnownConditions` (OCM's earlier spelling `WellKnownCompletions` too): `Complete` for
//!   Jobs (a `Complete` or `Failed` condition is `True`) and Pods (phase `Succeeded` or
//!   `Failed`), with OCM's messages.
//! * `CEL`: every expression must be true (logical AND) with `object` bound to the resource.
//!
//! The condition's reason tells how it was reached: `ConditionRuleEvaluated`,
//! `ConditionRuleExpressionError` (status `False`), `ConditionRuleInvalid` (status `Unknown`).
//! The message comes from `messageExpression`, else `message`, else "Manifest is (not) <type>".
//! A `Complete` condition that is `True` stops further updates of that manifest.

use flotilla_proto::api::ConditionRule;
use flotilla_proto::api::conditions::{ConditionStatus, WORK_COMPLETE};
use serde_json::Value;

use crate::cel::{CelError, Expression};
use crate::feedback::ObjectKind;

/// Reason of a condition a rule evaluated without error.
pub const RULE_EVALUATED: &str = "ConditionRuleEvaluated";
/// Reason of a condition whose rule cannot be evaluated (unknown type, no well-known rule).
pub const RULE_INVALID: &str = "ConditionRuleInvalid";
/// Reason of a condition whose expression failed.
pub const RULE_EXPRESSION_ERROR: &str = "ConditionRuleExpressionError";
/// Every rule reason starts so; conditions with it were set by rules.
pub const RULE_REASON_PREFIX: &str = "ConditionRule";

/// A condition a rule set on a manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleCondition {
    pub type_: String,
    pub status: ConditionStatus,
    pub reason: &'static str,
    pub message: String,
}

/// OCM's built-in completion rules: (group, version, kind) → (expression, message expression).
const WELL_KNOWN: &[(&str, &str, &str, WellKnown)] = &[
    ("batch", "v1", "Job", WellKnown::Job),
    ("", "v1", "Pod", WellKnown::Pod),
];

#[derive(Clone, Copy, Debug)]
enum WellKnown {
    Job,
    Pod,
}

impl WellKnown {
    /// Whether the object is complete, and OCM's message for it.
    fn evaluate(self, object: &Value) -> (bool, String) {
        match self {
            WellKnown::Job => {
                let done = object["status"]["conditions"].as_array().is_some_and(|cs| {
                    cs.iter().any(|c| {
                        matches!(c["type"].as_str(), Some("Complete" | "Failed"))
                            && c["status"] == "True"
                    })
                });
                let message = if done {
                    "Job is finished"
                } else {
                    "Job is not finished"
                };
                (done, message.to_owned())
            }
            WellKnown::Pod => {
                let phase = object["status"]["phase"].as_str().unwrap_or("");
                (
                    matches!(phase, "Succeeded" | "Failed"),
                    format!("Pod is in phase {phase}"),
                )
            }
        }
    }
}

/// Evaluates `rules` against `object`; one condition per rule.
pub fn evaluate(
    object: &Value,
    kind: ObjectKind<'_>,
    rules: &[ConditionRule],
) -> Vec<RuleCondition> {
    rules
        .iter()
        .map(|rule| evaluate_one(object, kind, rule))
        .collect()
}

fn evaluate_one(object: &Value, kind: ObjectKind<'_>, rule: &ConditionRule) -> RuleCondition {
    let condition = |type_: &str, status, reason, message: String| RuleCondition {
        type_: type_.to_owned(),
        status,
        reason,
        message,
    };
    match rule.type_.as_str() {
        "WellKnownConditions" | "WellKnownCompletions" => {
            let type_ = if rule.condition.is_empty() {
                WORK_COMPLETE
            } else {
                rule.condition.as_str()
            };
            let known = WELL_KNOWN
                .iter()
                .find(|(g, v, k, _)| *g == kind.group && *v == kind.version && *k == kind.kind);
            let Some((.., well_known)) = known else {
                return condition(
                    type_,
                    ConditionStatus::Unknown,
                    RULE_INVALID,
                    format!(
                        "there is no well-known {type_} rule for {} {}; use a CEL rule",
                        api_version(kind),
                        kind.kind
                    ),
                );
            };
            let (result, default_message) = well_known.evaluate(object);
            let message = message(object, rule, result).unwrap_or(default_message);
            condition(type_, result.into(), RULE_EVALUATED, message)
        }
        "CEL" => {
            if rule.condition.is_empty() {
                return condition(
                    "",
                    ConditionStatus::Unknown,
                    RULE_INVALID,
                    "a CEL rule needs a condition type".to_owned(),
                );
            }
            if rule.cel_expressions.is_empty() {
                return condition(
                    &rule.condition,
                    ConditionStatus::Unknown,
                    RULE_INVALID,
                    "a CEL rule needs at least one expression in celExpressions".to_owned(),
                );
            }
            match all_true(object, &rule.cel_expressions) {
                Ok(result) => {
                    let message = message(object, rule, result).unwrap_or_else(|| {
                        if result {
                            format!("Manifest is {}", rule.condition)
                        } else {
                            format!("Manifest is not {}", rule.condition)
                        }
                    });
                    condition(&rule.condition, result.into(), RULE_EVALUATED, message)
                }
                Err(e) => condition(
                    &rule.condition,
                    ConditionStatus::False,
                    RULE_EXPRESSION_ERROR,
                    e.to_string(),
                ),
            }
        }
        other => condition(
            if rule.condition.is_empty() {
                WORK_COMPLETE
            } else {
                &rule.condition
            },
            ConditionStatus::Unknown,
            RULE_INVALID,
            format!("unknown condition rule type {other:?}; use WellKnownConditions or CEL"),
        ),
    }
}

/// Logical AND, stopping at the first false.
fn all_true(object: &Value, expressions: &[String]) -> Result<bool, CelError> {
    for source in expressions {
        if !Expression::compile(source)?.eval_bool(object)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The rule's own message: its message expression when that gives a non-empty string, else
/// its message; `None` to use the default. A failing message expression says why instead.
fn message(object: &Value, rule: &ConditionRule, result: bool) -> Option<String> {
    if !rule.message_expression.is_empty() {
        match Expression::compile(&rule.message_expression)
            .and_then(|e| e.eval_message(object, result))
        {
            Ok(m) if !m.is_empty() => return Some(m),
            Ok(_) => {}
            Err(e) => return Some(e.to_string()),
        }
    }
    (!rule.message.is_empty()).then(|| rule.message.clone())
}

fn api_version(kind: ObjectKind<'_>) -> String {
    if kind.group.is_empty() {
        kind.version.to_owned()
    } else {
        format!("{}/{}", kind.group, kind.version)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const JOB: ObjectKind<'static> = ObjectKind {
        group: "batch",
        version: "v1",
        kind: "Job",
    };

    fn rule(type_: &str, condition: &str, expressions: &[&str]) -> ConditionRule {
        ConditionRule {
            condition: condition.into(),
            type_: type_.into(),
            cel_expressions: expressions.iter().map(|s| (*s).to_owned()).collect(),
            ..ConditionRule::default()
        }
    }

    fn check(object: Value, kind: ObjectKind<'_>, r: ConditionRule, expected: &str) {
        let c = &evaluate(&object, kind, &[r])[0];
        assert_eq!(
            format!("{} {} {}: {}", c.type_, c.status, c.reason, c.message),
            expected
        );
    }

    fn job(conditions: Value) -> Value {
        json!({"status": {"conditions": conditions}})
    }

    #[test]
    fn well_known_completion_of_jobs_and_pods() {
        let wk = || rule("WellKnownConditions", "", &[]);
        check(
            job(json!([{"type": "Complete", "status": "True"}])),
            JOB,
            wk(),
            "Complete True ConditionRuleEvaluated: Job is finished",
        );
        check(
            job(json!([{"type": "Failed", "status": "True"}])),
            JOB,
            rule("WellKnownCompletions", "", &[]),
            "Complete True ConditionRuleEvaluated: Job is finished",
        );
        check(
            json!({"status": {}}),
            JOB,
            wk(),
            "Complete False ConditionRuleEvaluated: Job is not finished",
        );
        let pod = ObjectKind {
            group: "",
            version: "v1",
            kind: "Pod",
        };
        check(
            json!({"status": {"phase": "Succeeded"}}),
            pod,
            wk(),
            "Complete True ConditionRuleEvaluated: Pod is in phase Succeeded",
        );
        let deployment = ObjectKind {
            group: "apps",
            version: "v1",
            kind: "Deployment",
        };
        check(
            json!({}),
            deployment,
            wk(),
            "Complete Unknown ConditionRuleInvalid: there is no well-known Complete rule for apps/v1 Deployment; use a CEL rule",
        );
    }

    #[test]
    fn cel_rules_and_their_messages() {
        let object = json!({"status": {"readyReplicas": 3, "replicas": 3}});
        check(
            object.clone(),
            JOB,
            rule(
                "CEL",
                "AllReady",
                &[
                    "object.status.readyReplicas == object.status.replicas",
                    "object.status.replicas > 0",
                ],
            ),
            "AllReady True ConditionRuleEvaluated: Manifest is AllReady",
        );
        check(
            object.clone(),
            JOB,
            rule("CEL", "Big", &["object.status.replicas > 5"]),
            "Big False ConditionRuleEvaluated: Manifest is not Big",
        );
        let mut with_message = rule("CEL", "Ready", &["object.status.readyReplicas >= 1"]);
        with_message.message_expression =
            r#"result ? "ready: " + string(object.status.readyReplicas) : "not ready""#.into();
        check(
            object.clone(),
            JOB,
            with_message,
            "Ready True ConditionRuleEvaluated: ready: 3",
        );
        let mut plain = rule("CEL", "Ready", &["true"]);
        plain.message = "all good".into();
        check(
            object.clone(),
            JOB,
            plain,
            "Ready True ConditionRuleEvaluated: all good",
        );
    }

    #[test]
    fn broken_rules_say_why() {
        let object = json!({"status": {}});
        check(
            object.clone(),
            JOB,
            rule("CEL", "Ready", &["object.status.readyReplicas > 0"]),
            "Ready False ConditionRuleExpressionError: CEL expression \"object.status.readyReplicas > 0\" failed: No such key: readyReplicas",
        );
        check(
            object.clone(),
            JOB,
            rule("CEL", "", &["true"]),
            " Unknown ConditionRuleInvalid: a CEL rule needs a condition type",
        );
        check(
            object.clone(),
            JOB,
            rule("CEL", "Ready", &[]),
            "Ready Unknown ConditionRuleInvalid: a CEL rule needs at least one expression in celExpressions",
        );
        check(
            object,
            JOB,
            rule("Magic", "Ready", &[]),
            "Ready Unknown ConditionRuleInvalid: unknown condition rule type \"Magic\"; use WellKnownConditions or CEL",
        );
    }
}
