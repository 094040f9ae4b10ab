//! CEL, as condition rules use it, behind one small interface: compile an expression, evaluate
//! it against a Kubernetes object bound to `object` (and, for message expressions, the rule's
//! `result`). The implementation is the `cel` crate (cel-rust); nothing else in the agent
//! names it, so it can be replaced here alone.
//!
//! Besides the standard library (`has()`, `exists`, `filter`, `all`, `in`, ...), expressions may
//! call `hasConditions(object.status)`, as OCM's agent provides: true when the map has a
//! non-empty `conditions` list.
//!
//! JSON numbers become CEL `int` when they are whole (so `object.status.replicas == 3` holds),
//! `double` otherwise.

use std::collections::HashMap;
use std::sync::Arc;

use cel::objects::{Key, Map, Value as CelValue};
use cel::{Context, Program};
use serde_json::Value;

/// Longest expression accepted, in bytes: a bound on parse time and memory for input that
/// comes from the hub.
pub const MAX_EXPRESSION_BYTES: usize = 4096;

/// Why an expression could not be used. Not retryable: the expression must be fixed (a
/// runtime error such as a missing field may clear when the object changes, and is evaluated
/// again then).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CelError {
    /// The expression does not parse, or is too long.
    #[error("CEL expression {expression:?} does not compile: {detail}")]
    Compile { expression: String, detail: String },
    /// It failed while evaluating (no such key, wrong types).
    #[error("CEL expression {expression:?} failed: {detail}")]
    Eval { expression: String, detail: String },
    /// It evaluated to something other than the type asked for.
    #[error("CEL expression {expression:?} gave {got}, not a {wanted}")]
    Type {
        expression: String,
        got: String,
        wanted: &'static str,
    },
}

/// A compiled expression.
pub struct Expression {
    source: String,
    program: Program,
}

impl std::fmt::Debug for Expression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Expression").field(&self.source).finish()
    }
}

impl Expression {
    /// Compiles `source`.
    pub fn compile(source: &str) -> Result<Expression, CelError> {
        let fail = |detail: String| CelError::Compile {
            expression: source.to_owned(),
            detail,
        };
        if source.len() > MAX_EXPRESSION_BYTES {
            return Err(fail(format!(
                "it is {} bytes, more than the {MAX_EXPRESSION_BYTES} allowed",
                source.len()
            )));
        }
        // The parser reports positions on the expression's own lines; one line reads best in
        // a condition message.
        let program = Program::compile(source)
            .map_err(|e| fail(e.to_string().lines().next().unwrap_or("").trim().to_owned()))?;
        Ok(Expression {
            source: source.to_owned(),
            program,
        })
    }

    /// Evaluates to a bool with `object` bound.
    pub fn eval_bool(&self, object: &Value) -> Result<bool, CelError> {
        match self.eval(object, None)? {
            CelValue::Bool(b) => Ok(b),
            other => Err(self.wrong_type(&other, "bool")),
        }
    }

    /// Evaluates to a string with `object` and `result` bound (a message expression).
    pub fn eval_message(&self, object: &Value, result: bool) -> Result<String, CelError> {
        match self.eval(object, Some(result))? {
            CelValue::String(s) => Ok(s.to_string()),
            other => Err(self.wrong_type(&other, "string")),
        }
    }

    fn eval(&self, object: &Value, result: Option<bool>) -> Result<CelValue, CelError> {
        let mut context = Context::default();
        context.add_variable_from_value("object", to_cel(object));
        if let Some(result) = result {
            context.add_variable_from_value("result", result);
        }
        context
            .add_function("hasConditions", has_conditions)
            .map_err(|e| CelError::Eval {
                expression: self.source.clone(),
                detail: e.to_string(),
            })?;
        self.program.execute(&context).map_err(|e| CelError::Eval {
            expression: self.source.clone(),
            detail: execution_detail(&e),
        })
    }

    fn wrong_type(&self, got: &CelValue, wanted: &'static str) -> CelError {
        CelError::Type {
            expression: self.source.clone(),
            got: format!("{:?}", got.type_of()),
            wanted,
        }
    }
}

fn has_conditions(status: CelValue) -> bool {
    let CelValue::Map(map) = status else {
        return false;
    };
    matches!(
        map.map.get(&Key::String(Arc::new("conditions".to_owned()))),
        Some(CelValue::List(items)) if !items.is_empty()
    )
}

/// A JSON value as CEL sees it.
fn to_cel(value: &Value) -> CelValue {
    match value {
        Value::Null => CelValue::Null,
        Value::Bool(b) => CelValue::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => CelValue::Int(i),
            None => match n.as_u64() {
                Some(u) => CelValue::UInt(u),
                None => CelValue::Float(n.as_f64().unwrap_or(f64::NAN)),
            },
        },
        Value::String(s) => CelValue::String(Arc::new(s.clone())),
        Value::Array(items) => CelValue::List(Arc::new(items.iter().map(to_cel).collect())),
        Value::Object(map) => {
            let entries: HashMap<Key, CelValue> = map
                .iter()
                .map(|(k, v)| (Key::String(Arc::new(k.clone())), to_cel(v)))
                .collect();
            CelValue::Map(Map {
                map: Arc::new(entries),
            })
        }
    }
}

/// What went wrong in an evaluation, the same words every time for the same expression and
/// object: the interpreter's own message prints maps in hash order, which differs from one
/// evaluation to the next, so a condition carrying it would change at every resync (and be
/// written to the hub each time). The values it names are rendered with maps' keys sorted.
fn execution_detail(e: &cel::ExecutionError) -> String {
    use cel::ExecutionError as E;
    match e {
        E::UnsupportedTargetType { target } => {
            format!("Invalid argument type: {}", render(target))
        }
        E::NotSupportedAsMethod { method, target } => {
            format!(
                "Method '{method}' not supported on type '{}'",
                render(target)
            )
        }
        E::UnsupportedKeyType(v) => format!("Unable to use value '{}' as a key", render(v)),
        E::ValuesNotComparable(a, b) => {
            format!("{} can not be compared to {}", render(a), render(b))
        }
        E::UnsupportedBinaryOperator(op, a, b) => {
            format!(
                "Unsupported binary operator '{op}': {}, {}",
                render(a),
                render(b)
            )
        }
        E::UnsupportedIndex(a, b) => {
            format!("Cannot use value {} to index {}", render(a), render(b))
        }
        E::DivisionByZero(v) => format!("Division by zero of {}", render(v)),
        E::RemainderByZero(v) => format!("Remainder by zero of {}", render(v)),
        E::Overflow(op, a, b) => format!(
            "Overflow from binary operator '{op}': {}, {}",
            render(a),
            render(b)
        ),
        E::IndexOutOfBounds(v) => format!("Index out of bounds: {}", render(v)),
        E::DuplicateKey(v) => format!("Failed with repeated key: {}", render(v)),
        // The rest carry no value, or are variants the interpreter no longer makes.
        other => other.to_string(),
    }
}

/// A CEL value as the interpreter's messages print it, but with a map's entries in key order.
fn render(value: &CelValue) -> String {
    match value {
        CelValue::Map(map) => {
            let mut entries: Vec<String> = map
                .map
                .iter()
                .map(|(k, v)| format!("{k:?}: {}", render(v)))
                .collect();
            entries.sort();
            format!("Map({{{}}})", entries.join(", "))
        }
        CelValue::List(items) => format!(
            "List([{}])",
            items.iter().map(render).collect::<Vec<_>>().join(", ")
        ),
        other => format!("{other:?}"),
    }
}

#[cfg(test)]
mod tests {

    /// Found by the cel_rule fuzzer: dividing a condition (a map) made a message that printed
    /// the map in hash order, so two evaluations of one rule on one object disagreed.
    #[test]
    fn an_evaluation_error_reads_the_same_every_time() {
        let object = serde_json::json!({"status": {"conditions": [
            {"type": "Complete", "status": "True", "reason": "r", "message": "m", "a": 1, "b": 2}
        ]}});
        let expression = Expression::compile(
            "object.status.conditions.filter(c, c/.type == 'Failed').size() == 0",
        )
        .unwrap();
        let first = expression.eval_bool(&object).unwrap_err().to_string();
        for _ in 0..20 {
            assert_eq!(
                expression.eval_bool(&object).unwrap_err().to_string(),
                first
            );
        }
        assert!(
            first.contains("String(\"a\"): Int(1), String(\"b\"): Int(2)"),
            "{first}"
        );
    }
    use super::*;
    use serde_json::json;

    fn job(complete: &str) -> Value {
        json!({"kind": "Job", "status": {"succeeded": 1, "conditions": [
            {"type": "Complete", "status": complete}
        ]}})
    }

    fn check(expression: &str, object: &Value, expected: Result<bool, &str>) {
        let got = Expression::compile(expression).and_then(|e| e.eval_bool(object));
        match (got, expected) {
            (Ok(got), Ok(want)) => assert_eq!(got, want, "{expression}"),
            (Err(e), Err(fragment)) => {
                assert!(e.to_string().contains(fragment), "{expression}: {e}")
            }
            (got, want) => panic!("{expression}: got {got:?}, wanted {want:?}"),
        }
    }

    #[test]
    fn expressions_see_the_object_as_kubernetes_writes_it() {
        let done = job("True");
        check("object.status.succeeded == 1", &done, Ok(true));
        check("object.status.succeeded >= 2", &done, Ok(false));
        check(
            "object.status.conditions.exists(c, c.type == 'Complete' && c.status == 'True')",
            &done,
            Ok(true),
        );
        check(
            "hasConditions(object.status) ? object.status.conditions.filter(c, c.type == 'Complete' || c.type == 'Failed').exists(c, c.status == 'True') : false",
            &job("False"),
            Ok(false),
        );
        check(
            "hasConditions(object.status)",
            &json!({"status": {}}),
            Ok(false),
        );
        check("has(object.status.active)", &done, Ok(false));
        check("object.kind in ['Job', 'CronJob']", &done, Ok(true));
    }

    #[test]
    fn bad_expressions_say_what_is_wrong() {
        check("object.status.(", &job("True"), Err("does not compile"));
        check("object.status.succeeded", &job("True"), Err("not a bool"));
        check("object.status.nothing == 1", &job("True"), Err("failed"));
        let long = format!("{} == 1", "a".repeat(MAX_EXPRESSION_BYTES));
        check(&long, &job("True"), Err("more than the 4096 allowed"));
    }

    #[test]
    fn message_expressions_see_the_result() {
        let e =
            Expression::compile(r#"result ? "Job is finished" : "Job is not finished""#).unwrap();
        assert_eq!(
            e.eval_message(&job("True"), true).unwrap(),
            "Job is finished"
        );
        assert_eq!(
            e.eval_message(&job("True"), false).unwrap(),
            "Job is not finished"
        );
        let e = Expression::compile("1 + 1").unwrap();
        assert!(e.eval_message(&job("True"), true).is_err());
    }
}
