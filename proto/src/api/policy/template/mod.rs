//! OCM's policy templates: a subset of Go's `text/template`, written in the strings of a
//! policy's objects and resolved before the object is judged.
//!
//! Two dialects, as in OCM:
//!
//! * **hub** templates, `{{hub ... hub}}`, resolved by the hub for each cluster before the
//!   policy reaches it; `.ManagedClusterName` and `.ManagedClusterLabels` (a map) are the
//!   cluster's, `fromConfigMap` reads the hub's ConfigMaps (only in the policy's own namespace;
//!   an empty namespace means it) and `fromClusterClaim` the claims the cluster reported;
//! * **managed-cluster** templates, `{{ ... }}`, resolved by the agent at every evaluation:
//!   `lookup APIVERSION KIND NAMESPACE NAME` (the object as a map, an empty map when it does
//!   not exist), `fromConfigMap NAMESPACE NAME KEY` and `fromClusterClaim NAME` read the
//!   cluster itself.
//!
//! Both have the helpers in [`HELPERS`]. The language: actions with field chains (`.A.B`,
//! `(pipeline).A`), string (`"..."`, `` `...` ``), number, `true`/`false`/`nil` literals,
//! function calls with arguments, pipelines (`x | f a`: `x` is `f`'s last argument),
//! parentheses, `{{if}}`/`{{else if}}`/`{{else}}`/`{{end}}`, `{{/* comments */}}` and the
//! `{{-`/`-}}` trim markers. Not supported, and refused by [`check`] by name: variables,
//! `range`, `with`, `define`/`template`/`block`.
//!
//! A string that is exactly one action renders to that action's value with its own type, so
//! `replicas: '{{ fromConfigMap "ns" "c" "n" | toInt }}'` becomes a number (OCM's rule for
//! `toInt` and `toBool`, taken here for every non-string value: a map from `lookup` stays a
//! map); anything else is text, with `nil` as the empty string and maps and lists as JSON.
//!
//! No IO: a function that reads the cluster asks [`TemplateData::read`], which answers from
//! what the caller already read; when it has not read that object yet, [`render`] returns
//! [`RenderError::NeedsRead`], and the caller reads it and renders again (at most
//! [`MAX_LOOKUPS`] reads per object).

mod parse;
mod run;

use std::fmt::Write as _;

use serde_json::{Map, Value};

use parse::{Node, check_nodes, nodes_call, parse};
use run::{Run, Stop, text_of};

/// Longest string holding a template, in bytes: far beyond any real template, and it bounds
/// parsing.
pub const MAX_TEMPLATE_BYTES: usize = 64 * 1024;
/// Most bytes one object may grow to once its templates are rendered (the size the stores
/// allow a policy spec, [`MAX_POLICY_BYTES`](super::MAX_POLICY_BYTES)).
pub const MAX_RENDERED_BYTES: usize = 512 * 1024;
/// Deepest nesting of parentheses and `if`s in one template.
pub const MAX_TEMPLATE_DEPTH: usize = 16;
/// Most objects the templates of one object-template may read (`lookup`, `fromConfigMap`,
/// `fromClusterClaim`) in one evaluation: each is a request to the apiserver.
pub const MAX_LOOKUPS: usize = 32;

/// The API version and kind `fromClusterClaim` reads.
pub const CLUSTER_CLAIM_API_VERSION: &str = "cluster.open-cluster-management.io/v1alpha1";

/// The helpers both dialects provide, with sprig's and Go's meaning:
///
/// * `default DEFAULT VALUE`: VALUE unless it is empty (nil, false, 0, "" or an empty map or
///   list), else DEFAULT;
/// * `index COLLECTION KEY...`: a map's value by key (nil when absent), a list's item;
/// * `toInt VALUE`, `toBool VALUE`: a number or string as an integer (strings must parse), as
///   a boolean (`true`, `false`, `1`, `0`, `t`, `f` in any case);
/// * `quote VALUE`: the value as a double-quoted string;
/// * `base64enc STRING`, `base64dec STRING`: standard base64 with padding;
/// * `printf FORMAT ARGS...`: with the verbs `%s`, `%d`, `%v`, `%q`, `%t` and `%%`;
/// * `eq A B...` (A equals any of the others), `ne A B`, `not V`, `and A B...`, `or A B...`
///   (Go's: the first empty / non-empty value, or the last);
/// * `len VALUE`: of a string, map or list;
/// * `lower`, `upper`, `trim`: of a string.
pub const HELPERS: &[&str] = &[
    "default",
    "index",
    "toInt",
    "toBool",
    "quote",
    "base64enc",
    "base64dec",
    "printf",
    "eq",
    "ne",
    "not",
    "and",
    "or",
    "len",
    "lower",
    "upper",
    "trim",
];

/// Which templates a pass resolves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// `{{hub ... hub}}`, on the hub for one cluster; `policy_namespace` is the only namespace
    /// `fromConfigMap` may read. `{{ }}` is left as written for the cluster.
    Hub { policy_namespace: String },
    /// `{{ ... }}`, on the managed cluster.
    Managed,
}

impl Dialect {
    fn open(&self) -> &'static str {
        match self {
            Dialect::Hub { .. } => "{{hub",
            Dialect::Managed => "{{",
        }
    }

    fn close(&self) -> &'static str {
        match self {
            Dialect::Hub { .. } => "hub}}",
            Dialect::Managed => "}}",
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Dialect::Hub { .. } => "hub",
            Dialect::Managed => "managed-cluster",
        }
    }

    /// The functions that read, besides [`HELPERS`].
    fn readers(&self) -> &'static [&'static str] {
        match self {
            Dialect::Hub { .. } => &["fromConfigMap", "fromClusterClaim"],
            Dialect::Managed => &["lookup", "fromConfigMap", "fromClusterClaim"],
        }
    }

    /// The fields of `.` templates may name.
    fn fields(&self) -> &'static [&'static str] {
        match self {
            Dialect::Hub { .. } => &["ManagedClusterName", "ManagedClusterLabels"],
            Dialect::Managed => &[],
        }
    }
}

/// One object a template reads, as `lookup` names it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lookup {
    pub api_version: String,
    pub kind: String,
    /// Empty for a cluster-scoped object.
    pub namespace: String,
    pub name: String,
}

/// What a template can read: `.` and the objects the caller has read.
pub trait TemplateData {
    /// The template's `.`: on the hub a map of `ManagedClusterName` and
    /// `ManagedClusterLabels`; on the managed cluster an empty map.
    fn dot(&self) -> &Value;
    /// The object `lookup` names: `None` when it has not been read yet (render fails with
    /// [`RenderError::NeedsRead`]), `Some(Ok(Value::Null))` when it does not exist,
    /// `Some(Err(reason))` when it cannot be read (an unknown kind, a refusal).
    fn read(&self, lookup: &Lookup) -> Option<Result<Value, String>>;
}

/// Why an object's templates did not render.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    /// A template reads an object the data has no answer for yet: read it, render again.
    #[error("needs {lookup:?} read")]
    NeedsRead { lookup: Lookup },
    /// A template failed: bad syntax, a missing key, a type error. Not retryable until the
    /// template or what it reads changes.
    #[error("failed to resolve the template {template} at {path}: {reason}")]
    Failed {
        /// The field holding the template, e.g. `data.tier`.
        path: String,
        /// The action that failed, as written (or the whole string for a syntax error).
        template: String,
        reason: String,
    },
    /// The rendered object exceeds [`MAX_RENDERED_BYTES`].
    #[error("the rendered object takes more than {MAX_RENDERED_BYTES} bytes")]
    TooLarge,
}

/// Whether `value` holds a template of `dialect` anywhere (in a string or a map key).
pub fn has_templates(value: &Value, dialect: &Dialect) -> bool {
    match value {
        Value::String(s) => holds_template(s, dialect),
        Value::Array(items) => items.iter().any(|v| has_templates(v, dialect)),
        Value::Object(map) => map
            .iter()
            .any(|(k, v)| holds_template(k, dialect) || has_templates(v, dialect)),
        _ => false,
    }
}

fn holds_template(text: &str, dialect: &Dialect) -> bool {
    match dialect {
        Dialect::Hub { .. } => text.contains(dialect.open()),
        // `{{hub` opens the hub's templates, not the cluster's.
        Dialect::Managed => text
            .match_indices(dialect.open())
            .any(|(at, _)| !text[at..].starts_with("{{hub")),
    }
}

/// Checks every template of `dialect` in `value` without rendering: syntax, bounds, functions
/// and fields the dialect does not provide, and (on the hub) a `fromConfigMap` of another
/// namespace written as a literal. Each problem is `(path, problem)`, the path relative to
/// `value` (`data.tier`), the problem a clause that follows "a template that" (`uses the
/// function "x", which ...`, `does not parse: ...`).
pub fn check(value: &Value, dialect: &Dialect) -> Vec<(String, String)> {
    let mut problems = Vec::new();
    walk_strings(value, &mut String::new(), &mut |path, text| {
        if !holds_template(text, dialect) {
            return;
        }
        match parse(text, dialect) {
            Err(problem) => problems.push((path.to_string(), format!("does not parse: {problem}"))),
            Ok(nodes) => {
                if let Err(problem) = check_nodes(&nodes, dialect) {
                    problems.push((path.to_string(), problem));
                }
            }
        }
    });
    problems
}

/// The paths (as [`check`] gives them) of the strings whose templates of `dialect` call
/// `function`; templates that do not parse are [`check`]'s to report.
pub fn uses(value: &Value, dialect: &Dialect, function: &str) -> Vec<String> {
    let mut found = Vec::new();
    walk_strings(value, &mut String::new(), &mut |path, text| {
        if holds_template(text, dialect)
            && parse(text, dialect).is_ok_and(|nodes| nodes_call(&nodes, function))
        {
            found.push(path.to_string());
        }
    });
    found
}

/// Renders every template of `dialect` in `value`, keys and strings alike.
pub fn render(
    value: &Value,
    dialect: &Dialect,
    data: &dyn TemplateData,
) -> Result<Value, RenderError> {
    let mut budget = MAX_RENDERED_BYTES;
    render_value(value, dialect, data, &mut String::new(), &mut budget)
}

fn render_value(
    value: &Value,
    dialect: &Dialect,
    data: &dyn TemplateData,
    path: &mut String,
    budget: &mut usize,
) -> Result<Value, RenderError> {
    let rendered = match value {
        Value::String(text) => {
            let rendered = render_string(text, dialect, data, path)?;
            let len = match &rendered {
                Value::String(s) => s.len(),
                other => other.to_string().len(),
            };
            *budget = budget.checked_sub(len).ok_or(RenderError::TooLarge)?;
            rendered
        }
        Value::Array(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (index, item) in items.iter().enumerate() {
                let len = path.len();
                let _ = write!(path, "[{index}]");
                out.push(render_value(item, dialect, data, path, budget)?);
                path.truncate(len);
            }
            Value::Array(out)
        }
        Value::Object(map) => {
            let mut out = Map::new();
            for (key, item) in map {
                // The hub's error quotes the template it could not render: a message, kept as
                // it is.
                if key == super::ANNOTATION_HUB_TEMPLATES_ERROR {
                    out.insert(key.clone(), item.clone());
                    continue;
                }
                let len = path.len();
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(key);
                let key = match render_string(key, dialect, data, path)? {
                    Value::String(s) => s,
                    other => text_of(&other),
                };
                let item = render_value(item, dialect, data, path, budget)?;
                path.truncate(len);
                out.insert(key, item);
            }
            Value::Object(out)
        }
        other => other.clone(),
    };
    Ok(rendered)
}

fn render_string(
    text: &str,
    dialect: &Dialect,
    data: &dyn TemplateData,
    path: &str,
) -> Result<Value, RenderError> {
    if !holds_template(text, dialect) {
        return Ok(Value::String(text.to_string()));
    }
    let failed = |template: &str, reason: String| RenderError::Failed {
        path: path.to_string(),
        template: template.to_string(),
        reason,
    };
    let nodes = parse(text, dialect).map_err(|reason| failed(text, reason))?;
    let run = Run { dialect, data };
    if let [Node::Action(action)] = nodes.as_slice() {
        let value = run.pipeline(&action.pipeline).map_err(|e| match e {
            Stop::NeedsRead(lookup) => RenderError::NeedsRead { lookup },
            Stop::Failed(reason) => failed(&action.source, reason),
        })?;
        return Ok(match value {
            Value::Null => Value::String(String::new()),
            other => other,
        });
    }
    let mut out = String::new();
    run.nodes(&nodes, &mut out).map_err(|(source, e)| match e {
        Stop::NeedsRead(lookup) => RenderError::NeedsRead { lookup },
        Stop::Failed(reason) => failed(&source, reason),
    })?;
    Ok(Value::String(out))
}

/// A root Policy (the whole object) as one cluster receives it: the hub templates of each of
/// its `policy-templates[].objectDefinition` rendered with `data`. A template that fails is
/// left as written, with the error in its [`ANNOTATION_HUB_TEMPLATES_ERROR`] annotation, for
/// the cluster to report NonCompliant; the other templates are rendered all the same. Returns
/// whether anything changed.
///
/// [`ANNOTATION_HUB_TEMPLATES_ERROR`]: super::ANNOTATION_HUB_TEMPLATES_ERROR
pub fn render_hub_templates(policy: &mut Value, data: &dyn TemplateData) -> bool {
    let dialect = Dialect::Hub {
        policy_namespace: policy
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
    };
    let Some(templates) = policy
        .pointer_mut("/spec/policy-templates")
        .and_then(Value::as_array_mut)
    else {
        return false;
    };
    let mut changed = false;
    for (index, template) in templates.iter_mut().enumerate() {
        let Some(definition) = template.get_mut("objectDefinition") else {
            continue;
        };
        if !has_templates(definition, &dialect) {
            continue;
        }
        changed = true;
        match render(definition, &dialect, data) {
            Ok(rendered) => *definition = rendered,
            Err(error) => {
                let error = match error {
                    RenderError::NeedsRead { lookup } => format!(
                        "failed to resolve the hub templates: {} {} cannot be read on the hub",
                        lookup.kind, lookup.name
                    ),
                    RenderError::Failed {
                        path,
                        template,
                        reason,
                    } => format!(
                        "failed to resolve the template {template} at spec.policy-templates[{index}].objectDefinition.{path}: {reason}"
                    ),
                    RenderError::TooLarge => format!(
                        "failed to resolve the hub templates of spec.policy-templates[{index}]: the rendered object takes more than {MAX_RENDERED_BYTES} bytes"
                    ),
                };
                annotate(definition, super::ANNOTATION_HUB_TEMPLATES_ERROR, error);
            }
        }
    }
    changed
}

fn annotate(object: &mut Value, key: &str, value: String) {
    let Some(object) = object.as_object_mut() else {
        return;
    };
    let metadata = object
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    let Some(metadata) = metadata.as_object_mut() else {
        return;
    };
    let annotations = metadata
        .entry("annotations")
        .or_insert_with(|| Value::Object(Map::new()));
    if let Some(annotations) = annotations.as_object_mut() {
        annotations.insert(key.to_string(), Value::String(value));
    }
}

fn walk_strings(value: &Value, path: &mut String, visit: &mut dyn FnMut(&str, &str)) {
    match value {
        Value::String(s) => visit(path, s),
        Value::Array(items) => {
            for (index, item) in items.iter().enumerate() {
                let len = path.len();
                let _ = write!(path, "[{index}]");
                walk_strings(item, path, visit);
                path.truncate(len);
            }
        }
        Value::Object(map) => {
            for (key, item) in map {
                // The hub's error quotes the template it could not render: a message, not one.
                if key == super::ANNOTATION_HUB_TEMPLATES_ERROR {
                    continue;
                }
                let len = path.len();
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(key);
                visit(path, key);
                walk_strings(item, path, visit);
                path.truncate(len);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde_json::json;

    use super::*;

    /// Template data from a map of objects; what is not in it has not been read yet.
    struct Objects {
        dot: Value,
        objects: BTreeMap<Lookup, Result<Value, String>>,
    }

    impl Objects {
        fn hub() -> Objects {
            Objects {
                dot: json!({"ManagedClusterName": "east-1",
                    "ManagedClusterLabels": {"env": "prod", "region": "eu"}}),
                objects: BTreeMap::new(),
            }
        }

        fn managed() -> Objects {
            Objects {
                dot: json!({}),
                objects: BTreeMap::new(),
            }
        }

        fn with(mut self, api_version: &str, kind: &str, ns: &str, name: &str, v: Value) -> Self {
            self.objects
                .insert(lookup(api_version, kind, ns, name), Ok(v));
            self
        }
    }

    impl TemplateData for Objects {
        fn dot(&self) -> &Value {
            &self.dot
        }

        fn read(&self, lookup: &Lookup) -> Option<Result<Value, String>> {
            self.objects.get(lookup).cloned()
        }
    }

    fn lookup(api_version: &str, kind: &str, namespace: &str, name: &str) -> Lookup {
        Lookup {
            api_version: api_version.into(),
            kind: kind.into(),
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    fn hub() -> Dialect {
        Dialect::Hub {
            policy_namespace: "policies".into(),
        }
    }

    fn settings() -> Objects {
        Objects::hub().with(
            "v1",
            "ConfigMap",
            "policies",
            "settings",
            json!({"data": {"tier": "gold", "replicas": "3"}}),
        )
    }

    /// Renders one string; the value, or the error's text.
    fn rendered(text: &str, dialect: &Dialect, data: &Objects) -> Result<Value, String> {
        render(&json!({"v": text}), dialect, data)
            .map(|v| v["v"].clone())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn hub_templates_read_the_cluster_and_the_policy_namespace() {
        let object = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "cluster-info", "namespace": "default",
                "labels": {"env": "{{hub index .ManagedClusterLabels \"env\" hub}}"}},
            "data": {
                "cluster": "{{hub .ManagedClusterName hub}}",
                "tier": "{{hub fromConfigMap \"\" \"settings\" \"tier\" hub}}",
                "region": "region-{{hub .ManagedClusterLabels.region hub}}",
                "spoke": "{{ fromClusterClaim \"id.k8s.io\" }}"}});
        let out = render(&object, &hub(), &settings()).unwrap();
        assert_eq!(out["metadata"]["labels"]["env"], "prod");
        assert_eq!(out["data"]["cluster"], "east-1");
        assert_eq!(out["data"]["tier"], "gold");
        assert_eq!(out["data"]["region"], "region-eu");
        assert_eq!(
            out["data"]["spoke"], "{{ fromClusterClaim \"id.k8s.io\" }}",
            "the managed cluster's template is left for the cluster"
        );
        assert!(!has_templates(&out, &hub()));
        assert!(has_templates(&out, &Dialect::Managed));
        assert!(!has_templates(
            &object["data"]["cluster"],
            &Dialect::Managed
        ));
    }

    #[test]
    fn a_whole_action_keeps_its_type_and_text_around_it_makes_a_string() {
        let data = settings();
        let check = |text: &str, expected: Value| {
            assert_eq!(rendered(text, &hub(), &data), Ok(expected), "{text}");
        };
        check(
            "{{hub fromConfigMap \"\" \"settings\" \"replicas\" | toInt hub}}",
            json!(3),
        );
        check(
            "n={{hub fromConfigMap \"\" \"settings\" \"replicas\" | toInt hub}}",
            json!("n=3"),
        );
        check("{{hub \"true\" | toBool hub}}", json!(true));
        check(
            "{{hub .ManagedClusterLabels hub}}",
            json!({"env": "prod", "region": "eu"}),
        );
        check("{{hub .ManagedClusterLabels.missing hub}}", json!(""));
        check("[{{hub .ManagedClusterLabels.missing hub}}]", json!("[]"));
    }

    #[test]
    fn reads_are_asked_for_until_the_data_has_them() {
        let object = json!({"data": {"a_copied": "{{ (lookup \"v1\" \"ConfigMap\" \"app\" \"source\").data.color }}",
            "b_claim": "{{ fromClusterClaim \"platform.open-cluster-management.io\" }}"}});
        let source = lookup("v1", "ConfigMap", "app", "source");
        let mut data = Objects::managed();
        assert_eq!(
            render(&object, &Dialect::Managed, &data),
            Err(RenderError::NeedsRead {
                lookup: source.clone()
            })
        );
        data.objects
            .insert(source, Ok(json!({"data": {"color": "blue"}})));
        let claim = lookup(
            CLUSTER_CLAIM_API_VERSION,
            "ClusterClaim",
            "",
            "platform.open-cluster-management.io",
        );
        assert_eq!(
            render(&object, &Dialect::Managed, &data),
            Err(RenderError::NeedsRead {
                lookup: claim.clone()
            })
        );
        data.objects
            .insert(claim, Ok(json!({"spec": {"value": "Other"}})));
        assert_eq!(
            render(&object, &Dialect::Managed, &data),
            Ok(json!({"data": {"a_copied": "blue", "b_claim": "Other"}}))
        );
    }

    #[test]
    fn an_absent_object_is_an_empty_map_to_lookup() {
        let data = Objects::managed().with("v1", "ConfigMap", "app", "gone", Value::Null);
        assert_eq!(
            rendered(
                "{{ (lookup \"v1\" \"ConfigMap\" \"app\" \"gone\").data.color | default \"none\" }}",
                &Dialect::Managed,
                &data
            ),
            Ok(json!("none"))
        );
        assert_eq!(
            rendered(
                "{{ lookup \"v1\" \"ConfigMap\" \"app\" \"gone\" }}",
                &Dialect::Managed,
                &data
            ),
            Ok(json!({}))
        );
    }

    #[test]
    fn failures_name_the_field_the_template_and_the_reason() {
        let data = settings()
            .with("v1", "ConfigMap", "policies", "gone", Value::Null)
            .with(
                CLUSTER_CLAIM_API_VERSION,
                "ClusterClaim",
                "",
                "absent",
                Value::Null,
            );
        let object =
            json!({"data": {"tier": "{{hub fromConfigMap \"\" \"settings\" \"color\" hub}}"}});
        assert_eq!(
            render(&object, &hub(), &data).unwrap_err().to_string(),
            "failed to resolve the template {{hub fromConfigMap \"\" \"settings\" \"color\" hub}} at data.tier: fromConfigMap: ConfigMap policies/settings has no key \"color\""
        );
        let check = |text: &str, dialect: &Dialect, reason: &str| match render(
            &json!({"v": text}),
            dialect,
            &data,
        ) {
            Err(RenderError::Failed { reason: got, .. }) => assert_eq!(got, reason, "{text}"),
            other => panic!("{text}: {other:?}"),
        };
        check(
            "{{hub fromConfigMap \"\" \"gone\" \"k\" hub}}",
            &hub(),
            "fromConfigMap: configmaps \"gone\" not found in namespace policies",
        );
        check(
            "{{hub fromConfigMap \"kube-system\" \"settings\" \"tier\" hub}}",
            &hub(),
            "fromConfigMap: hub templates read only the policy's namespace \"policies\", not \"kube-system\"",
        );
        check(
            "{{hub fromConfigMap \"\" \"settings\" \"tier\" | toInt hub}}",
            &hub(),
            "toInt: \"gold\" is not an integer",
        );
        check(
            "{{hub fromClusterClaim \"absent\" hub}}",
            &hub(),
            "fromClusterClaim: clusterclaims \"absent\" not found",
        );
        check(
            "{{hub .ManagedClusterName.first hub}}",
            &hub(),
            "can't read field first of a string",
        );
        check(
            "{{ lookup \"v1\" \"ConfigMap\" }}",
            &Dialect::Managed,
            "lookup takes 4 arguments, not 2",
        );
        check(
            "{{ if true }}x",
            &Dialect::Managed,
            "{{if}} without {{end}}",
        );
        let unreadable = Objects::managed();
        let mut unreadable = unreadable;
        unreadable.objects.insert(
            lookup("example.com/v1", "Widget", "", "w"),
            Err("the spoke serves no kind Widget".into()),
        );
        assert_eq!(
            rendered(
                "{{ lookup \"example.com/v1\" \"Widget\" \"\" \"w\" }}",
                &Dialect::Managed,
                &unreadable
            ),
            Err("failed to resolve the template {{ lookup \"example.com/v1\" \"Widget\" \"\" \"w\" }} at v: the spoke serves no kind Widget".into())
        );
    }

    #[test]
    fn a_policy_is_rendered_per_template_and_a_failing_one_carries_its_error() {
        let template = |name: &str, data: Value| {
            json!({"objectDefinition": {"apiVersion": "policy.open-cluster-management.io/v1",
                "kind": "ConfigurationPolicy", "metadata": {"name": name},
                "spec": {"object-templates": [{"complianceType": "musthave",
                    "objectDefinition": {"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": "c", "namespace": "default"}, "data": data}}]}}})
        };
        let mut policy = json!({"metadata": {"name": "p", "namespace": "policies"},
        "spec": {"policy-templates": [
            template("good", json!({"cluster": "{{hub .ManagedClusterName hub}}"})),
            template("bad", json!({"tier": "{{hub fromConfigMap \"\" \"settings\" \"color\" hub}}"})),
            template("plain", json!({"a": "b"})),
        ]}});
        let plain = policy["spec"]["policy-templates"][2].clone();
        assert!(render_hub_templates(&mut policy, &settings()));
        let templates = &policy["spec"]["policy-templates"];
        assert_eq!(
            templates[0]
                .pointer("/objectDefinition/spec/object-templates/0/objectDefinition/data/cluster"),
            Some(&json!("east-1"))
        );
        assert_eq!(
            templates[1].pointer("/objectDefinition/metadata/annotations/policy.open-cluster-management.io~1hub-templates-error"),
            Some(&json!("failed to resolve the template {{hub fromConfigMap \"\" \"settings\" \"color\" hub}} at spec.policy-templates[1].objectDefinition.spec.object-templates[0].objectDefinition.data.tier: fromConfigMap: ConfigMap policies/settings has no key \"color\""))
        );
        assert_eq!(
            templates[1]
                .pointer("/objectDefinition/spec/object-templates/0/objectDefinition/data/tier"),
            Some(&json!(
                "{{hub fromConfigMap \"\" \"settings\" \"color\" hub}}"
            )),
            "left as written"
        );
        assert_eq!(templates[2], plain);
        // The error quotes the template, but is a message: checking or rendering the delivered
        // policy again (as a resumed session does) leaves it as it is.
        let delivered = templates[1]["objectDefinition"].clone();
        assert_eq!(check(&delivered, &hub()), Vec::new());
        let mut again = policy.clone();
        render_hub_templates(&mut again, &settings());
        assert_eq!(again, policy);
        let mut untemplated = json!({"metadata": {"namespace": "policies"},
            "spec": {"policy-templates": [plain]}});
        assert!(!render_hub_templates(&mut untemplated, &settings()));
    }

    #[test]
    fn helpers() {
        let data = Objects::managed();
        let check = |text: &str, expected: Value| {
            assert_eq!(
                rendered(text, &Dialect::Managed, &data),
                Ok(expected),
                "{text}"
            );
        };
        check("{{ \"\" | default \"x\" }}", json!("x"));
        check("{{ \"y\" | default \"x\" }}", json!("y"));
        check("{{ toInt \"0\" | printf \"%d\" | quote }}", json!("\"0\""));
        check("{{ \"42\" | toInt }}", json!(42));
        check("{{ 2.7 | toInt }}", json!(2));
        check("{{ \"F\" | toBool }}", json!(false));
        check("{{ \"a \\\"b\\\"\" | quote }}", json!("\"a \\\"b\\\"\""));
        check("{{ \"flotilla\" | base64enc }}", json!("ZmxvdGlsbGE="));
        check("{{ \"ZmxvdGlsbGE=\" | base64dec }}", json!("flotilla"));
        check("{{ \"ab\" | base64enc | base64dec }}", json!("ab"));
        check(
            "{{ printf \"%s-%d %q %t %%\" \"a\" 7 \"b\" true }}",
            json!("a-7 \"b\" true %"),
        );
        check("{{ eq 3 3.0 }}", json!(true));
        check("{{ eq \"a\" \"b\" \"a\" }}", json!(true));
        check("{{ ne \"a\" \"b\" }}", json!(true));
        check("{{ not 0 }}", json!(true));
        check("{{ and 1 \"\" 2 }}", json!(""));
        check("{{ or \"\" 0 \"z\" }}", json!("z"));
        check("{{ len \"four\" }}", json!(4));
        check("{{ \" Mixed \" | trim | lower }}", json!("mixed"));
        check("é {{ \"ü\" | upper }} ñ", json!("é Ü ñ"));
        check("{{ upper `raw` }}", json!("RAW"));
        check(
            "{{if eq 1 2}}one{{else if eq 2 2}}two{{else}}other{{end}}",
            json!("two"),
        );
        check("{{if false}}no{{end}}!", json!("!"));
        check("a  {{- /* a comment */ -}}  b", json!("ab"));
        check("x {{- \"y\" }} z", json!("xy z"));
    }

    #[test]
    fn check_refuses_what_the_dialects_do_not_provide() {
        let errors = |value: Value, dialect: &Dialect| check(&value, dialect);
        assert_eq!(
            errors(
                json!({"data": {"a": "{{ fromSecret \"ns\" \"s\" \"k\" }}"}}),
                &Dialect::Managed
            ),
            vec![(
                "data.a".to_string(),
                format!(
                    "uses the function \"fromSecret\", which flotilla's managed-cluster templates do not provide (they provide lookup, fromConfigMap, fromClusterClaim and {})",
                    HELPERS.join(", ")
                )
            )]
        );
        assert_eq!(
            errors(
                json!({"a": ["{{hub lookup \"v1\" \"ConfigMap\" \"p\" \"c\" hub}}"]}),
                &hub()
            )[0]
            .1,
            format!(
                "uses the function \"lookup\", which flotilla's hub templates do not provide (they provide fromConfigMap, fromClusterClaim and {})",
                HELPERS.join(", ")
            )
        );
        let check_one = |text: &str, dialect: &Dialect, problem: &str| {
            assert_eq!(
                errors(json!({"v": text}), dialect),
                vec![("v".to_string(), problem.to_string())],
                "{text}"
            );
        };
        check_one(
            "{{hub .ClusterName hub}}",
            &hub(),
            "names .ClusterName; hub templates have only .ManagedClusterName and .ManagedClusterLabels",
        );
        check_one(
            "{{ .ManagedClusterName }}",
            &Dialect::Managed,
            "names .ManagedClusterName; managed-cluster templates have no fields",
        );
        check_one(
            "{{hub fromConfigMap \"other\" \"c\" \"k\" hub}}",
            &hub(),
            "reads the ConfigMap namespace \"other\"; hub templates read only the policy's namespace \"policies\" (write \"\" for it)",
        );
        check_one(
            "{{ $x := 1 }}",
            &Dialect::Managed,
            "does not parse: variables ($) are not supported",
        );
        check_one(
            "{{ range .items }}{{ end }}",
            &Dialect::Managed,
            "does not parse: {{range}} is not supported",
        );
        check_one(
            "{{ \"a\" ",
            &Dialect::Managed,
            "does not parse: unclosed action: no }} after {{",
        );
        check_one(
            "{{ end }}",
            &Dialect::Managed,
            "does not parse: {{end}} outside an {{if}}",
        );
        check_one(
            "{{ (upper \"a\" }}",
            &Dialect::Managed,
            "does not parse: unclosed '('",
        );
        check_one(
            &format!("{{{{ {}1{} }}}}", "(".repeat(20), ")".repeat(20)),
            &Dialect::Managed,
            "does not parse: the template nests deeper than 16 levels",
        );
        check_one(
            &format!("{{{{ \"{}\" }}}}", "x".repeat(MAX_TEMPLATE_BYTES)),
            &Dialect::Managed,
            &format!(
                "does not parse: the template takes {} bytes, more than the {MAX_TEMPLATE_BYTES} allowed",
                MAX_TEMPLATE_BYTES + 8
            ),
        );
        assert!(
            errors(json!({"v": "{{hub .ManagedClusterName hub}} {{ lookup \"v1\" \"Pod\" \"a\" \"b\" }}"}), &Dialect::Managed).is_empty(),
            "the hub's template is not the cluster's to check"
        );
        assert!(
            errors(
                json!({"v": "{{ lookup \"v1\" \"Pod\" \"a\" \"b\" }}"}),
                &hub()
            )
            .is_empty()
        );
    }

    #[test]
    fn uses_finds_a_function_wherever_it_is_called() {
        let value = json!({"a": "{{hub fromConfigMap \"\" \"c\" \"k\" hub}}",
            "b": ["{{hub if eq (fromConfigMap \"\" \"c\" \"k\") \"x\" hub}}y{{hub end hub}}"],
            "c": "{{hub .ManagedClusterName hub}}",
            "d": "{{ fromConfigMap \"ns\" \"c\" \"k\" }}"});
        assert_eq!(uses(&value, &hub(), "fromConfigMap"), ["a", "b[0]"]);
    }

    #[test]
    fn the_rendered_object_is_bounded() {
        let big = "x".repeat(MAX_TEMPLATE_BYTES - 100);
        let data =
            Objects::managed().with("v1", "ConfigMap", "a", "big", json!({"data": {"k": big}}));
        let many: Vec<Value> = (0..10)
            .map(|_| json!("{{ fromConfigMap \"a\" \"big\" \"k\" }}"))
            .collect();
        assert_eq!(
            render(&Value::Array(many), &Dialect::Managed, &data),
            Err(RenderError::TooLarge)
        );
    }
}
