//! The bodies of the fuzz targets whose code lives in the agent (see
//! `flotilla_proto::fuzzing` for how the targets are run and replayed): CEL condition rules
//! and JSONPath feedback expressions, both from the hub's works, evaluated against objects
//! from the spoke.
//!
//! Not for: anything but fuzzing and its replay; nothing in flotilla calls these.

use flotilla_proto::api::conditions::ConditionStatus;
use flotilla_proto::api::{ConditionRule, FeedbackRule, FeedbackType, JsonPath as RulePath};
use serde_json::{Value, json};

use crate::cel::{CelError, Expression, MAX_EXPRESSION_BYTES};
use crate::condition_rules::{self, RULE_EVALUATED, RULE_EXPRESSION_ERROR, RULE_INVALID};
use crate::feedback::{self, MAX_JSON_RAW_BYTES, ObjectKind};
use crate::jsonpath::{self, JsonPath};

/// The input's NUL-separated fields: `count - 1` texts, then the rest as an object (JSON; a
/// Job with conditions when the rest is not JSON).
fn fields(data: &[u8], count: usize) -> (Vec<String>, Value) {
    let mut parts = data.splitn(count, |&b| b == 0);
    let texts = (1..count)
        .map(|_| String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned())
        .collect();
    let object = parts
        .next()
        .and_then(|rest| serde_json::from_slice(rest).ok())
        .unwrap_or_else(|| {
            json!({
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": "job", "labels": {"app": "a"}},
                "status": {"succeeded": 1, "active": 0, "conditions": [
                    {"type": "Complete", "status": "True"},
                    {"type": "Failed", "status": "False", "reason": "x"}
                ]}
            })
        });
    (texts, object)
}

/// `cel_rule`: a CEL condition rule (expression, message expression) as a work carries it,
/// compiled and evaluated against an object from the spoke, alone and through the agent's
/// condition rules.
///
/// Properties: nothing panics; an expression over the bound is refused before it is parsed;
/// every error names its expression; the rule gives one condition, `ConditionRuleEvaluated`
/// with the expression's own result when it evaluates, `False` with
/// `ConditionRuleExpressionError` when it fails, and a message in every case.
pub fn cel_rule(data: &[u8]) {
    let (texts, object) = fields(data, 3);
    let (expression, message_expression) = (&texts[0], &texts[1]);
    let names_it = |e: &CelError| {
        let shown = format!("{expression:?}");
        assert!(e.to_string().contains(&shown), "{e} does not name {shown}");
    };
    let result = match Expression::compile(expression) {
        Ok(compiled) => {
            assert!(expression.len() <= MAX_EXPRESSION_BYTES);
            let result = compiled.eval_bool(&object);
            if let Err(e) = &result {
                assert!(!matches!(e, CelError::Compile { .. }), "{e}");
                names_it(e);
            }
            for outcome in [true, false] {
                if let Err(e) = compiled.eval_message(&object, outcome) {
                    names_it(&e);
                }
            }
            result
        }
        Err(e) => {
            assert!(matches!(e, CelError::Compile { .. }), "{e}");
            names_it(&e);
            Err(e)
        }
    };

    let rule = ConditionRule {
        condition: "Ready".into(),
        type_: "CEL".into(),
        cel_expressions: vec![expression.clone()],
        message: String::new(),
        message_expression: message_expression.clone(),
    };
    let kind = ObjectKind {
        group: "batch",
        version: "v1",
        kind: "Job",
    };
    let conditions = condition_rules::evaluate(&object, kind, &[rule]);
    let [condition] = conditions.as_slice() else {
        panic!("one rule gave {} conditions", conditions.len());
    };
    assert_eq!(condition.type_, "Ready");
    assert!(!condition.message.is_empty(), "{condition:?}");
    match result {
        Ok(value) => {
            assert_eq!(condition.reason, RULE_EVALUATED, "{condition:?}");
            assert_eq!(
                condition.status,
                ConditionStatus::from(value),
                "{condition:?}"
            );
        }
        Err(e) => {
            assert_eq!(condition.reason, RULE_EXPRESSION_ERROR, "{condition:?}");
            assert_eq!(condition.status, ConditionStatus::False);
            assert_eq!(condition.message, e.to_string());
        }
    }
    assert_ne!(condition.reason, RULE_INVALID);
}

/// `jsonpath`: a JSONPath as a feedback rule or `ignoreFields` carries it, parsed and applied
/// to an object from the spoke: found, reported as feedback, and removed.
///
/// Properties: nothing panics; a refusal names the path; every match's pointer leads to the
/// matched value in the object; after removing what a path ending in a field name selects, it selects nothing, and
/// removing touches nothing else it did not select; feedback reports a value (within the
/// `JsonRaw` bound) exactly when the path matches something that is not null, and a problem
/// naming the rule otherwise.
pub fn jsonpath(data: &[u8]) {
    let (texts, object) = fields(data, 2);
    let source = &texts[0];
    let path = match JsonPath::parse(source) {
        Ok(path) => path,
        Err(e) => {
            assert!(
                e.to_string().contains(&format!("{source:?}")),
                "{e} does not name the path"
            );
            return;
        }
    };
    assert_eq!(path.as_str(), source);
    let found = path.find(&object);
    for m in &found {
        assert_eq!(
            object.pointer(&m.pointer),
            Some(m.value),
            "{source}: pointer {} leads elsewhere",
            m.pointer
        );
    }

    let mut removed = object.clone();
    jsonpath::remove(&mut removed, &path);
    if let Some((parents, name)) = path.parents(&object) {
        let name = name.to_owned();
        assert!(
            path.find(&removed).is_empty(),
            "{source} still selects something after its field was removed"
        );
        // Put back exactly what was removed: the object is whole again.
        let mut restored = removed.clone();
        for parent in &parents {
            if let Some(value) = parent.value.get(&name)
                && let Some(Value::Object(map)) = restored.pointer_mut(&parent.pointer)
            {
                map.insert(name.clone(), value.clone());
            }
        }
        assert_eq!(restored, object, "{source} removed more than it selected");
    } else {
        assert_eq!(
            removed, object,
            "{source} does not end in a field, yet removed one"
        );
    }

    let rule = FeedbackRule {
        type_: FeedbackType::JsonPaths,
        json_paths: vec![RulePath {
            name: "value".into(),
            version: String::new(),
            path: source.clone(),
        }],
    };
    let kind = ObjectKind {
        group: "apps",
        version: "v1",
        kind: "Deployment",
    };
    let read = feedback::read(&object, kind, &[rule]);
    let value = match found.as_slice() {
        [] => None,
        [one] => Some(one.value.clone()),
        many => Some(Value::Array(many.iter().map(|m| m.value.clone()).collect())),
    };
    match value {
        None | Some(Value::Null) => assert_eq!(read, feedback::Feedback::default()),
        Some(value) => {
            let raw = value.to_string();
            let too_large = !matches!(value, Value::Bool(_) | Value::String(_))
                && value.as_i64().is_none()
                && raw.len() > MAX_JSON_RAW_BYTES;
            if too_large {
                assert!(read.values.is_empty(), "{read:?}");
                assert!(read.problems.iter().all(|p| p.starts_with("value: ")));
            } else {
                assert_eq!(read.values.len(), 1, "{read:?}");
                assert!(read.problems.is_empty(), "{read:?}");
            }
        }
    }
}
