//! Running a parsed template: values through pipelines, the reading functions asked of the
//! caller's [`TemplateData`], and the helpers.

use std::fmt::Write as _;

use serde_json::{Map, Value};

use super::parse::{Command, Node, Pipeline, Term};
use super::{CLUSTER_CLAIM_API_VERSION, Dialect, Lookup, MAX_RENDERED_BYTES, TemplateData};
use crate::api::base64;

/// Why an action stopped.
pub(super) enum Stop {
    NeedsRead(Lookup),
    Failed(String),
}

impl From<String> for Stop {
    fn from(reason: String) -> Stop {
        Stop::Failed(reason)
    }
}

pub(super) struct Run<'a> {
    pub(super) dialect: &'a Dialect,
    pub(super) data: &'a dyn TemplateData,
}

impl Run<'_> {
    /// Renders `nodes` as text into `out`; an error comes with the failing action's source.
    pub(super) fn nodes(&self, nodes: &[Node], out: &mut String) -> Result<(), (String, Stop)> {
        for node in nodes {
            match node {
                Node::Text(text) => out.push_str(text),
                Node::Action(action) => {
                    let value = self
                        .pipeline(&action.pipeline)
                        .map_err(|e| (action.source.clone(), e))?;
                    out.push_str(&text_of(&value));
                }
                Node::If {
                    condition,
                    then,
                    otherwise,
                } => {
                    let value = self
                        .pipeline(&condition.pipeline)
                        .map_err(|e| (condition.source.clone(), e))?;
                    self.nodes(if truthy(&value) { then } else { otherwise }, out)?;
                }
            }
            if out.len() > MAX_RENDERED_BYTES {
                return Err((
                    String::new(),
                    Stop::Failed(format!("renders to more than {MAX_RENDERED_BYTES} bytes")),
                ));
            }
        }
        Ok(())
    }

    pub(super) fn pipeline(&self, pipeline: &Pipeline) -> Result<Value, Stop> {
        let mut piped = None;
        for command in &pipeline.0 {
            piped = Some(match command {
                Command::Call { function, args } => {
                    let mut values = Vec::with_capacity(args.len() + 1);
                    for arg in args {
                        values.push(self.term(arg)?);
                    }
                    values.extend(piped.take());
                    self.call(function, values)?
                }
                Command::Term(term) => {
                    if piped.is_some() {
                        return Err(Stop::Failed(
                            "a value is piped into something that is not a function".to_string(),
                        ));
                    }
                    self.term(term)?
                }
            });
        }
        Ok(piped.unwrap_or(Value::Null))
    }

    fn term(&self, term: &Term) -> Result<Value, Stop> {
        match term {
            Term::Literal(value) => Ok(value.clone()),
            Term::Dot(fields) => Ok(fields_of(self.data.dot(), fields)?),
            Term::Group(inner, fields) => {
                let value = self.pipeline(inner)?;
                Ok(fields_of(&value, fields)?)
            }
        }
    }

    fn call(&self, function: &str, args: Vec<Value>) -> Result<Value, Stop> {
        match function {
            "lookup" if *self.dialect == Dialect::Managed => {
                let [api_version, kind, namespace, name] = strings::<4>(function, &args)?;
                Ok(match self.read(api_version, kind, namespace, name)? {
                    Value::Null => Value::Object(Map::new()),
                    found => found,
                })
            }
            "fromConfigMap" if self.dialect.readers().contains(&function) => {
                let [namespace, name, key] = strings::<3>(function, &args)?;
                let namespace = match self.dialect {
                    Dialect::Hub { policy_namespace } if namespace.is_empty() => {
                        policy_namespace.as_str()
                    }
                    Dialect::Hub { policy_namespace } if namespace != policy_namespace => {
                        return Err(Stop::Failed(format!(
                            "fromConfigMap: hub templates read only the policy's namespace {policy_namespace:?}, not {namespace:?}"
                        )));
                    }
                    Dialect::Managed if namespace.is_empty() => {
                        return Err(Stop::Failed(
                            "fromConfigMap: a namespace is required".to_string(),
                        ));
                    }
                    _ => namespace,
                };
                let config_map = self.read("v1", "ConfigMap", namespace, name)?;
                if config_map.is_null() {
                    return Err(Stop::Failed(format!(
                        "fromConfigMap: configmaps {name:?} not found in namespace {namespace}"
                    )));
                }
                match config_map.pointer("/data").and_then(|d| d.get(key)) {
                    Some(Value::String(value)) => Ok(Value::String(value.clone())),
                    _ => Err(Stop::Failed(format!(
                        "fromConfigMap: ConfigMap {namespace}/{name} has no key {key:?}"
                    ))),
                }
            }
            "fromClusterClaim" if self.dialect.readers().contains(&function) => {
                let [name] = strings::<1>(function, &args)?;
                let claim = self.read(CLUSTER_CLAIM_API_VERSION, "ClusterClaim", "", name)?;
                match claim.pointer("/spec/value") {
                    Some(Value::String(value)) => Ok(Value::String(value.clone())),
                    _ => Err(Stop::Failed(format!(
                        "fromClusterClaim: clusterclaims {name:?} not found"
                    ))),
                }
            }
            helper => Ok(call_helper(helper, args, self.dialect)?),
        }
    }

    fn read(
        &self,
        api_version: &str,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> Result<Value, Stop> {
        let lookup = Lookup {
            api_version: api_version.to_string(),
            kind: kind.to_string(),
            namespace: namespace.to_string(),
            name: name.to_string(),
        };
        if name.is_empty() {
            return Err(Stop::Failed(format!("{kind}: a name is required")));
        }
        match self.data.read(&lookup) {
            None => Err(Stop::NeedsRead(lookup)),
            Some(Ok(value)) => Ok(value),
            Some(Err(reason)) => Err(Stop::Failed(reason)),
        }
    }
}

fn strings<'v, const N: usize>(function: &str, args: &'v [Value]) -> Result<[&'v str; N], String> {
    if args.len() != N {
        return Err(format!(
            "{function} takes {N} arguments, not {}",
            args.len()
        ));
    }
    let mut out = [""; N];
    for (slot, arg) in out.iter_mut().zip(args) {
        *slot = arg
            .as_str()
            .ok_or_else(|| format!("{function} takes strings, not {}", type_of(arg)))?;
    }
    Ok(out)
}

fn fields_of(value: &Value, fields: &[String]) -> Result<Value, String> {
    let mut at = value;
    for field in fields {
        at = match at {
            Value::Object(map) => match map.get(field) {
                Some(found) => found,
                None => return Ok(Value::Null),
            },
            Value::Null => return Ok(Value::Null),
            other => {
                return Err(format!("can't read field {field} of a {}", type_of(other)));
            }
        };
    }
    Ok(at.clone())
}

fn type_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "nil",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "list",
        Value::Object(_) => "map",
    }
}

/// Go's truth: false, 0, nil and empty strings, maps and lists are false.
fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(items) => !items.is_empty(),
        Value::Object(map) => !map.is_empty(),
    }
}

/// A value as text: strings as they are, nil as nothing, maps and lists as JSON.
pub(super) fn text_of(value: &Value) -> String {
    match value {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        _ => a == b,
    }
}

fn call_helper(function: &str, args: Vec<Value>, dialect: &Dialect) -> Result<Value, String> {
    let arity = |n: usize| {
        if args.len() == n {
            Ok(())
        } else {
            Err(format!(
                "{function} takes {n} arguments, not {}",
                args.len()
            ))
        }
    };
    let at_least = |n: usize| {
        if args.len() >= n {
            Ok(())
        } else {
            Err(format!(
                "{function} takes at least {n} arguments, not {}",
                args.len()
            ))
        }
    };
    let string = |value: &Value| -> Result<String, String> {
        match value {
            Value::String(s) => Ok(s.clone()),
            Value::Null => Ok(String::new()),
            other => Err(format!(
                "{function} takes a string, not a {}",
                type_of(other)
            )),
        }
    };
    match function {
        "default" => {
            arity(2)?;
            Ok(if truthy(&args[1]) {
                args[1].clone()
            } else {
                args[0].clone()
            })
        }
        "index" => {
            at_least(2)?;
            let mut at = args[0].clone();
            for key in &args[1..] {
                at = match (&at, key) {
                    (Value::Object(map), Value::String(k)) => {
                        map.get(k).cloned().unwrap_or(Value::Null)
                    }
                    (Value::Null, _) => Value::Null,
                    (Value::Array(items), Value::Number(n)) => {
                        let i = n
                            .as_u64()
                            .ok_or_else(|| format!("index {n} is not a position"))?;
                        items
                            .get(usize::try_from(i).unwrap_or(usize::MAX))
                            .cloned()
                            .ok_or_else(|| {
                                format!("index {i} out of range of {} items", items.len())
                            })?
                    }
                    (collection, key) => {
                        return Err(format!(
                            "can't index a {} with a {}",
                            type_of(collection),
                            type_of(key)
                        ));
                    }
                };
            }
            Ok(at)
        }
        "toInt" => {
            arity(1)?;
            match &args[0] {
                Value::Null => Ok(Value::from(0)),
                Value::Number(n) => Ok(n
                    .as_i64()
                    .map(Value::from)
                    .or_else(|| n.as_f64().map(|f| Value::from(f.trunc() as i64)))
                    .unwrap_or(Value::Number(n.clone()))),
                Value::String(s) => s
                    .trim()
                    .parse::<i64>()
                    .map(Value::from)
                    .map_err(|_| format!("toInt: {s:?} is not an integer")),
                other => Err(format!("toInt: can't convert a {}", type_of(other))),
            }
        }
        "toBool" => {
            arity(1)?;
            match &args[0] {
                Value::Bool(b) => Ok(Value::Bool(*b)),
                Value::Null => Ok(Value::Bool(false)),
                Value::Number(n) => Ok(Value::Bool(n.as_f64().is_some_and(|f| f != 0.0))),
                Value::String(s) => match s.trim() {
                    "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(Value::Bool(true)),
                    "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(Value::Bool(false)),
                    _ => Err(format!("toBool: {s:?} is not a boolean")),
                },
                other => Err(format!("toBool: can't convert a {}", type_of(other))),
            }
        }
        "quote" => {
            arity(1)?;
            Ok(Value::String(Value::String(text_of(&args[0])).to_string()))
        }
        "base64enc" => {
            arity(1)?;
            Ok(Value::String(base64::encode(string(&args[0])?.as_bytes())))
        }
        "base64dec" => {
            arity(1)?;
            let decoded = base64::decode(&string(&args[0])?)
                .ok_or_else(|| "base64dec: not valid base64".to_string())?;
            String::from_utf8(decoded)
                .map(Value::String)
                .map_err(|_| "base64dec: the decoded bytes are not UTF-8 text".to_string())
        }
        "printf" => {
            at_least(1)?;
            printf(&string(&args[0])?, &args[1..]).map(Value::String)
        }
        "eq" => {
            at_least(2)?;
            Ok(Value::Bool(args[1..].iter().any(|b| equal(&args[0], b))))
        }
        "ne" => {
            arity(2)?;
            Ok(Value::Bool(!equal(&args[0], &args[1])))
        }
        "not" => {
            arity(1)?;
            Ok(Value::Bool(!truthy(&args[0])))
        }
        "and" => {
            at_least(1)?;
            let last = args.len() - 1;
            Ok(args
                .iter()
                .find(|v| !truthy(v))
                .unwrap_or(&args[last])
                .clone())
        }
        "or" => {
            at_least(1)?;
            let last = args.len() - 1;
            Ok(args
                .iter()
                .find(|v| truthy(v))
                .unwrap_or(&args[last])
                .clone())
        }
        "len" => {
            arity(1)?;
            let len = match &args[0] {
                Value::String(s) => s.len(),
                Value::Array(items) => items.len(),
                Value::Object(map) => map.len(),
                Value::Null => 0,
                other => return Err(format!("len of a {}", type_of(other))),
            };
            Ok(Value::from(len))
        }
        "lower" => {
            arity(1)?;
            Ok(Value::String(string(&args[0])?.to_lowercase()))
        }
        "upper" => {
            arity(1)?;
            Ok(Value::String(string(&args[0])?.to_uppercase()))
        }
        "trim" => {
            arity(1)?;
            Ok(Value::String(string(&args[0])?.trim().to_string()))
        }
        other => Err(format!(
            "function {other:?} is not provided by flotilla's {} templates",
            dialect.name()
        )),
    }
}

/// Go's `printf` for the verbs `%s %d %v %q %t %%`.
fn printf(format: &str, args: &[Value]) -> Result<String, String> {
    let mut out = String::new();
    let mut args = args.iter();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let verb = chars
            .next()
            .ok_or_else(|| "printf: the format ends with %".to_string())?;
        if verb == '%' {
            out.push('%');
            continue;
        }
        let arg = args
            .next()
            .ok_or_else(|| format!("printf: %{verb} has no argument"))?;
        match verb {
            's' | 'v' => out.push_str(&text_of(arg)),
            'q' => out.push_str(&Value::String(text_of(arg)).to_string()),
            'd' => match arg.as_i64() {
                Some(i) => {
                    let _ = write!(out, "{i}");
                }
                None => return Err(format!("printf: %d of a {}", type_of(arg))),
            },
            't' => match arg {
                Value::Bool(b) => {
                    let _ = write!(out, "{b}");
                }
                other => return Err(format!("printf: %t of a {}", type_of(other))),
            },
            other => return Err(format!("printf: the verb %{other} is not supported")),
        }
    }
    if args.next().is_some() {
        return Err("printf: more arguments than verbs".to_string());
    }
    Ok(out)
}
