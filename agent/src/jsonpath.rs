//! The part of kubectl's JSONPath that OCM's feedback rules and `ignoreFields` use, over
//! `serde_json` values: `.status.readyReplicas`, `.spec.template.spec.containers[0].image`,
//! `.items[*].name`, `['a.b/c']`, and filters `[?(@.type=="Ready")]` with `==` / `!=` against a
//! string, number or boolean, or `[?(@.field)]` for presence. A leading `$` and the `{...}`
//! braces kubectl prints are accepted. Anything else (recursive descent `..`, slices, unions,
//! functions) is refused with a message naming the path and what is unsupported, never
//! evaluated to a wrong answer.

use serde_json::Value;

/// A parsed path.
#[derive(Clone, Debug, PartialEq)]
pub struct JsonPath {
    source: String,
    steps: Vec<Step>,
}

#[derive(Clone, Debug, PartialEq)]
enum Step {
    Field(String),
    Index(i64),
    Wildcard,
    Filter(Filter),
}

#[derive(Clone, Debug, PartialEq)]
struct Filter {
    /// Field names under `@`.
    field: Vec<String>,
    test: Test,
}

#[derive(Clone, Debug, PartialEq)]
enum Test {
    Present,
    Equal(Value),
    NotEqual(Value),
}

/// Why a path cannot be used. Not retryable: the path in the work must be fixed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("JSONPath {path:?}: {problem}")]
pub struct PathError {
    /// The path as written.
    pub path: String,
    /// What is wrong with it.
    pub problem: String,
}

/// One match: the value and where it sits, as a JSON pointer (RFC 6901).
#[derive(Clone, Debug, PartialEq)]
pub struct Match<'a> {
    pub pointer: String,
    pub value: &'a Value,
}

impl JsonPath {
    /// Parses `path`.
    pub fn parse(path: &str) -> Result<JsonPath, PathError> {
        let fail = |problem: &str| PathError {
            path: path.to_owned(),
            problem: problem.to_owned(),
        };
        let mut rest = path.trim();
        if let Some(inner) = rest.strip_prefix('{').and_then(|r| r.strip_suffix('}')) {
            rest = inner.trim();
        }
        rest = rest.strip_prefix('$').unwrap_or(rest);
        let mut steps = Vec::new();
        let chars: Vec<char> = rest.chars().collect();
        let mut i = 0;
        while i < chars.len() {
            match chars[i] {
                '.' => {
                    i += 1;
                    if chars.get(i) == Some(&'.') {
                        return Err(fail("recursive descent (..) is not supported"));
                    }
                    let start = i;
                    while i < chars.len() && chars[i] != '.' && chars[i] != '[' {
                        i += 1;
                    }
                    let name: String = chars[start..i].iter().collect();
                    match name.as_str() {
                        "" => return Err(fail("empty field name")),
                        "*" => steps.push(Step::Wildcard),
                        _ => steps.push(Step::Field(name)),
                    }
                }
                '[' => {
                    let end = matching_bracket(&chars, i).ok_or_else(|| fail("unclosed ["))?;
                    let inner: String = chars[i + 1..end].iter().collect();
                    steps.push(bracket(inner.trim()).map_err(|p| fail(&p))?);
                    i = end + 1;
                }
                _ if i == 0 => {
                    // kubectl also accepts a first field without its dot.
                    while i < chars.len() && chars[i] != '.' && chars[i] != '[' {
                        i += 1;
                    }
                    steps.push(Step::Field(chars[..i].iter().collect()));
                }
                c => return Err(fail(&format!("unexpected {c:?}"))),
            }
        }
        if steps.is_empty() {
            return Err(fail(
                "the path selects nothing; write e.g. .status.readyReplicas",
            ));
        }
        Ok(JsonPath {
            source: path.to_owned(),
            steps,
        })
    }

    /// The path as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// Every value the path selects in `root`, in document order.
    pub fn find<'a>(&self, root: &'a Value) -> Vec<Match<'a>> {
        self.find_steps(root, self.steps.len())
    }

    /// Every value the path without its last step selects, with the last step: how
    /// `ignoreFields` finds the objects to remove a field from. `None` when the last step is not
    /// a field name.
    pub fn parents<'a>(&self, root: &'a Value) -> Option<(Vec<Match<'a>>, &str)> {
        match self.steps.last()? {
            Step::Field(name) => Some((self.find_steps(root, self.steps.len() - 1), name)),
            _ => None,
        }
    }

    fn find_steps<'a>(&self, root: &'a Value, count: usize) -> Vec<Match<'a>> {
        let mut current = vec![Match {
            pointer: String::new(),
            value: root,
        }];
        for step in &self.steps[..count] {
            let mut next = Vec::new();
            for m in current {
                step.select(m, &mut next);
            }
            current = next;
        }
        current
    }
}

impl Step {
    fn select<'a>(&self, m: Match<'a>, out: &mut Vec<Match<'a>>) {
        let child = |key: &str, value: &'a Value| Match {
            pointer: format!("{}/{}", m.pointer, escape(key)),
            value,
        };
        match (self, m.value) {
            (Step::Field(name), Value::Object(map)) => {
                if let Some(v) = map.get(name) {
                    out.push(child(name, v));
                }
            }
            (Step::Index(i), Value::Array(items)) => {
                let len = items.len() as i64;
                let at = if *i < 0 { len + i } else { *i };
                if (0..len).contains(&at) {
                    out.push(child(&at.to_string(), &items[at as usize]));
                }
            }
            (Step::Wildcard, Value::Array(items)) => {
                for (i, v) in items.iter().enumerate() {
                    out.push(child(&i.to_string(), v));
                }
            }
            (Step::Wildcard, Value::Object(map)) => {
                for (k, v) in map {
                    out.push(child(k, v));
                }
            }
            (Step::Filter(filter), Value::Array(items)) => {
                for (i, v) in items.iter().enumerate() {
                    if filter.matches(v) {
                        out.push(child(&i.to_string(), v));
                    }
                }
            }
            _ => {}
        }
    }
}

impl Filter {
    fn matches(&self, item: &Value) -> bool {
        let mut v = item;
        for f in &self.field {
            match v.get(f) {
                Some(inner) => v = inner,
                None => return false,
            }
        }
        match &self.test {
            Test::Present => true,
            Test::Equal(want) => same(v, want),
            Test::NotEqual(want) => !same(v, want),
        }
    }
}

/// Equality as kubectl's filter compares: numbers by value, whatever their JSON spelling.
fn same(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

fn matching_bracket(chars: &[char], open: usize) -> Option<usize> {
    let mut depth = 0;
    let mut quote: Option<char> = None;
    for (i, &c) in chars.iter().enumerate().skip(open) {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None => match c {
                '\'' | '"' => quote = Some(c),
                '[' | '(' => depth += 1,
                ']' | ')' => {
                    depth -= 1;
                    if depth == 0 && c == ']' {
                        return Some(i);
                    }
                }
                _ => {}
            },
        }
    }
    None
}

fn bracket(inner: &str) -> Result<Step, String> {
    if inner == "*" {
        return Ok(Step::Wildcard);
    }
    if let Some(name) = quoted(inner) {
        return Ok(Step::Field(name));
    }
    if let Ok(i) = inner.parse::<i64>() {
        return Ok(Step::Index(i));
    }
    if let Some(expr) = inner
        .strip_prefix('?')
        .map(str::trim)
        .and_then(|e| e.strip_prefix('('))
        .and_then(|e| e.strip_suffix(')'))
    {
        return filter(expr.trim()).map(Step::Filter);
    }
    if inner.contains(':') {
        return Err(format!("slices ([{inner}]) are not supported"));
    }
    if inner.contains(',') {
        return Err(format!("unions ([{inner}]) are not supported"));
    }
    Err(format!("cannot read [{inner}]"))
}

fn quoted(s: &str) -> Option<String> {
    let s = s.trim();
    for q in ['\'', '"'] {
        if s.len() >= 2 && s.starts_with(q) && s.ends_with(q) {
            return Some(s[1..s.len() - 1].to_owned());
        }
    }
    None
}

fn filter(expr: &str) -> Result<Filter, String> {
    let (lhs, test) = if let Some((l, r)) = expr.split_once("!=") {
        (l, Some((false, r)))
    } else if let Some((l, r)) = expr.split_once("==") {
        (l, Some((true, r)))
    } else {
        (expr, None)
    };
    let lhs = lhs.trim();
    let path = lhs
        .strip_prefix("@.")
        .ok_or_else(|| format!("filter {expr:?} must test a field of @, e.g. @.type==\"Ready\""))?;
    let field: Vec<String> = path.split('.').map(str::to_owned).collect();
    if field.iter().any(String::is_empty) {
        return Err(format!("filter {expr:?} has an empty field name"));
    }
    let test = match test {
        None => Test::Present,
        Some((equal, rhs)) => {
            let rhs = rhs.trim();
            let value = match quoted(rhs) {
                Some(s) => Value::String(s),
                None => serde_json::from_str(rhs).map_err(|_| {
                    format!("filter {expr:?}: {rhs} is not a string, number or boolean")
                })?,
            };
            if equal {
                Test::Equal(value)
            } else {
                Test::NotEqual(value)
            }
        }
    };
    Ok(Filter { field, test })
}

/// Removes the field `path` names from every object it selects in `root`; a path that selects
/// nothing removes nothing. Used by `ignoreFields`.
pub fn remove(root: &mut Value, path: &JsonPath) {
    let Some((parents, name)) = path.parents(root) else {
        return;
    };
    let pointers: Vec<String> = parents.into_iter().map(|m| m.pointer).collect();
    let name = name.to_owned();
    for pointer in pointers {
        if let Some(Value::Object(map)) = root.pointer_mut(&pointer) {
            map.remove(&name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod() -> Value {
        json!({
            "metadata": {"name": "p", "annotations": {"example.com/a.b": "x"}},
            "status": {
                "phase": "Running",
                "replicas": 3,
                "conditions": [
                    {"type": "Initialized", "status": "True"},
                    {"type": "Ready", "status": "False", "reason": "ContainersNotReady"},
                ],
                "containerStatuses": [{"name": "a", "ready": true}, {"name": "b", "ready": false}],
            }
        })
    }

    fn check(path: &str, expected: &[Value]) {
        let parsed = JsonPath::parse(path).unwrap_or_else(|e| panic!("{e}"));
        let doc = pod();
        let got: Vec<Value> = parsed
            .find(&doc)
            .into_iter()
            .map(|m| m.value.clone())
            .collect();
        assert_eq!(got, expected, "{path}");
    }

    #[test]
    fn kubectl_paths_select_what_kubectl_would() {
        check(".status.phase", &[json!("Running")]);
        check("{.status.replicas}", &[json!(3)]);
        check("$.status.replicas", &[json!(3)]);
        check("status.phase", &[json!("Running")]);
        check(
            r#".status.conditions[?(@.type=="Ready")].status"#,
            &[json!("False")],
        );
        check(
            ".status.conditions[?(@.type == 'Ready')].reason",
            &[json!("ContainersNotReady")],
        );
        check(".status.conditions[?(@.reason)].type", &[json!("Ready")]);
        check(
            ".status.conditions[?(@.type!=\"Ready\")].type",
            &[json!("Initialized")],
        );
        check(
            ".status.containerStatuses[*].name",
            &[json!("a"), json!("b")],
        );
        check(".status.containerStatuses[-1].name", &[json!("b")]);
        check(
            ".status.containerStatuses[?(@.ready==true)].name",
            &[json!("a")],
        );
        check(".metadata.annotations['example.com/a.b']", &[json!("x")]);
        check(".status.missing", &[]);
        check(".status.containerStatuses[7]", &[]);
    }

    #[test]
    fn unsupported_syntax_is_refused_by_name() {
        for (path, problem) in [
            ("..status", "recursive descent"),
            (".status.conditions[0:2]", "slices"),
            (".status.conditions[0,1]", "unions"),
            (".status.conditions[", "unclosed"),
            ("", "selects nothing"),
            (".status..phase", "recursive descent"),
            (".a[?(type==1)]", "must test a field of @"),
        ] {
            let e = JsonPath::parse(path).unwrap_err();
            assert!(e.to_string().contains(problem), "{path}: {e}");
        }
    }

    #[test]
    fn remove_drops_the_field_wherever_the_path_selects_it() {
        let mut doc = pod();
        remove(&mut doc, &JsonPath::parse(".status.replicas").unwrap());
        remove(
            &mut doc,
            &JsonPath::parse(".status.containerStatuses[*].ready").unwrap(),
        );
        remove(&mut doc, &JsonPath::parse(".status.nothing.here").unwrap());
        assert!(doc["status"].get("replicas").is_none());
        assert_eq!(
            doc["status"]["containerStatuses"],
            json!([{"name": "a"}, {"name": "b"}])
        );
        assert_eq!(doc["status"]["phase"], "Running");
    }
}
