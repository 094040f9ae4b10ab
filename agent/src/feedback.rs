//! Status feedback: the values a work's `feedbackRules` ask for, read from a resource on the
//! spoke, in OCM's value types (`Integer`, `String`, `Boolean`, and `JsonRaw` for anything
//! else, at most 1024 bytes).
//!
//! `WellKnownStatus` reads the fields OCM's agent reads for Deployments, DaemonSets, Jobs and
//! Pods, under the same names; `JSONPaths` reads kubectl-style paths ([`crate::jsonpath`]).
//! Pure: the caller passes the object in.

use flotilla_proto::api::{FeedbackRule, FeedbackType, FeedbackValue, FieldValue};
use serde_json::Value;

use crate::jsonpath::JsonPath;

/// Longest `JsonRaw` value, in bytes: OCM's CRD allows no more.
pub const MAX_JSON_RAW_BYTES: usize = 1024;

/// A feedback value's name and the path it is read from.
type NamedPath = (&'static str, &'static str);

/// The well-known fields of a kind: (group, version, kind) → (name, path), in OCM's order.
const WELL_KNOWN: &[(&str, &str, &str, &[NamedPath])] = &[
    (
        "apps",
        "v1",
        "Deployment",
        &[
            ("ReadyReplicas", ".status.readyReplicas"),
            ("Replicas", ".status.replicas"),
            ("AvailableReplicas", ".status.availableReplicas"),
        ],
    ),
    (
        "apps",
        "v1",
        "DaemonSet",
        &[
            ("NumberReady", ".status.numberReady"),
            ("DesiredNumberScheduled", ".status.desiredNumberScheduled"),
            ("NumberAvailable", ".status.numberAvailable"),
        ],
    ),
    (
        "batch",
        "v1",
        "Job",
        &[
            (
                "JobComplete",
                r#".status.conditions[?(@.type=="Complete")].status"#,
            ),
            ("JobSucceeded", ".status.succeeded"),
        ],
    ),
    (
        "",
        "v1",
        "Pod",
        &[
            (
                "PodReady",
                r#".status.conditions[?(@.type=="Ready")].status"#,
            ),
            ("PodPhase", ".status.phase"),
        ],
    ),
];

/// The kind of the object feedback is read from.
#[derive(Clone, Copy, Debug)]
pub struct ObjectKind<'a> {
    pub group: &'a str,
    pub version: &'a str,
    pub kind: &'a str,
}

/// What the rules read from one object: the values found, and the problems (a path that does
/// not parse, a kind without well-known fields, a value too large). A problem costs only its
/// own value; the others are still reported.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Feedback {
    pub values: Vec<FeedbackValue>,
    pub problems: Vec<String>,
}

/// Reads the values `rules` ask for from `object`.
pub fn read(object: &Value, kind: ObjectKind<'_>, rules: &[FeedbackRule]) -> Feedback {
    let mut out = Feedback::default();
    for rule in rules {
        match rule.type_ {
            FeedbackType::WellKnownStatus => {
                let known = WELL_KNOWN
                    .iter()
                    .find(|(g, v, k, _)| *g == kind.group && *v == kind.version && *k == kind.kind);
                let Some((.., paths)) = known else {
                    let gv = if kind.group.is_empty() {
                        kind.version.to_owned()
                    } else {
                        format!("{}/{}", kind.group, kind.version)
                    };
                    out.problems.push(format!(
                        "there are no well-known status fields for {gv} {}; use JSONPaths",
                        kind.kind
                    ));
                    continue;
                };
                for (name, path) in *paths {
                    read_path(object, name, path, &mut out);
                }
            }
            FeedbackType::JsonPaths => {
                for path in &rule.json_paths {
                    if !path.version.is_empty() && path.version != kind.version {
                        out.problems.push(format!(
                            "{}: version {} is not the applied resource's version {}",
                            path.name, path.version, kind.version
                        ));
                        continue;
                    }
                    read_path(object, &path.name, &path.path, &mut out);
                }
            }
        }
    }
    out
}

fn read_path(object: &Value, name: &str, path: &str, out: &mut Feedback) {
    let parsed = match JsonPath::parse(path) {
        Ok(p) => p,
        Err(e) => {
            out.problems.push(format!("{name}: {e}"));
            return;
        }
    };
    let found = parsed.find(object);
    let value = match found.as_slice() {
        [] => return,
        [one] => one.value.clone(),
        many => Value::Array(many.iter().map(|m| m.value.clone()).collect()),
    };
    match field_value(&value) {
        Ok(Some(field_value)) => out.values.push(FeedbackValue {
            name: name.to_owned(),
            field_value,
        }),
        Ok(None) => {}
        Err(problem) => out.problems.push(format!("{name}: {problem}")),
    }
}

/// A JSON value in OCM's types; `None` for null (nothing to report).
fn field_value(value: &Value) -> Result<Option<FieldValue>, String> {
    let typed = |type_: &str| FieldValue {
        type_: type_.to_owned(),
        ..FieldValue::default()
    };
    Ok(Some(match value {
        Value::Null => return Ok(None),
        Value::Bool(b) => FieldValue {
            boolean: Some(*b),
            ..typed("Boolean")
        },
        Value::String(s) => FieldValue {
            string: Some(s.clone()),
            ..typed("String")
        },
        Value::Number(n) if n.as_i64().is_some() => FieldValue {
            integer: n.as_i64(),
            ..typed("Integer")
        },
        other => {
            let raw = other.to_string();
            if raw.len() > MAX_JSON_RAW_BYTES {
                return Err(format!(
                    "the value is {} bytes of JSON, more than the {MAX_JSON_RAW_BYTES} a JsonRaw value may hold; point the path at a smaller field",
                    raw.len()
                ));
            }
            FieldValue {
                json_raw: Some(raw),
                ..typed("JsonRaw")
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_proto::api::JsonPath as RulePath;
    use serde_json::json;

    const DEPLOYMENT: ObjectKind<'static> = ObjectKind {
        group: "apps",
        version: "v1",
        kind: "Deployment",
    };

    fn summary(f: &Feedback) -> Vec<String> {
        f.values
            .iter()
            .map(|v| {
                let fv = &v.field_value;
                let shown = match fv.type_.as_str() {
                    "Integer" => fv.integer.unwrap().to_string(),
                    "String" => fv.string.clone().unwrap(),
                    "Boolean" => fv.boolean.unwrap().to_string(),
                    _ => fv.json_raw.clone().unwrap(),
                };
                format!("{}={}:{}", v.name, fv.type_, shown)
            })
            .collect()
    }

    fn well_known() -> FeedbackRule {
        FeedbackRule {
            type_: FeedbackType::WellKnownStatus,
            json_paths: Vec::new(),
        }
    }

    fn paths(paths: &[(&str, &str)]) -> FeedbackRule {
        FeedbackRule {
            type_: FeedbackType::JsonPaths,
            json_paths: paths
                .iter()
                .map(|(name, path)| RulePath {
                    name: (*name).into(),
                    version: String::new(),
                    path: (*path).into(),
                })
                .collect(),
        }
    }

    #[test]
    fn well_known_deployment_fields_under_ocms_names() {
        let d = json!({"status": {"replicas": 3, "readyReplicas": 2, "availableReplicas": 2}});
        let f = read(&d, DEPLOYMENT, &[well_known()]);
        assert_eq!(
            summary(&f),
            [
                "ReadyReplicas=Integer:2",
                "Replicas=Integer:3",
                "AvailableReplicas=Integer:2"
            ]
        );
        assert!(f.problems.is_empty());
        // A field the controller has not written yet is simply absent.
        let fresh = read(
            &json!({"status": {"replicas": 1}}),
            DEPLOYMENT,
            &[well_known()],
        );
        assert_eq!(summary(&fresh), ["Replicas=Integer:1"]);
    }

    #[test]
    fn well_known_job_pod_and_daemonset_fields() {
        let job = json!({"status": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}});
        let kind = ObjectKind {
            group: "batch",
            version: "v1",
            kind: "Job",
        };
        assert_eq!(
            summary(&read(&job, kind, &[well_known()])),
            ["JobComplete=String:True", "JobSucceeded=Integer:1"]
        );
        let pod = json!({"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}});
        let kind = ObjectKind {
            group: "",
            version: "v1",
            kind: "Pod",
        };
        assert_eq!(
            summary(&read(&pod, kind, &[well_known()])),
            ["PodReady=String:True", "PodPhase=String:Running"]
        );
        let ds = json!({"status": {"numberReady": 2, "desiredNumberScheduled": 3, "numberAvailable": 2}});
        let kind = ObjectKind {
            group: "apps",
            version: "v1",
            kind: "DaemonSet",
        };
        assert_eq!(
            summary(&read(&ds, kind, &[well_known()])),
            [
                "NumberReady=Integer:2",
                "DesiredNumberScheduled=Integer:3",
                "NumberAvailable=Integer:2"
            ]
        );
    }

    #[test]
    fn json_paths_report_ocms_value_types() {
        let d = json!({"status": {
            "readyReplicas": 2, "paused": false, "ratio": 0.5,
            "conditions": [{"type": "Available", "status": "True"}, {"type": "Progressing", "status": "True"}],
        }});
        let f = read(
            &d,
            DEPLOYMENT,
            &[paths(&[
                ("ready", ".status.readyReplicas"),
                ("paused", ".status.paused"),
                ("ratio", ".status.ratio"),
                (
                    "available",
                    r#".status.conditions[?(@.type=="Available")].status"#,
                ),
                ("types", ".status.conditions[*].type"),
                ("missing", ".status.nothing"),
            ])],
        );
        assert_eq!(
            summary(&f),
            [
                "ready=Integer:2",
                "paused=Boolean:false",
                "ratio=JsonRaw:0.5",
                "available=String:True",
                r#"types=JsonRaw:["Available","Progressing"]"#,
            ]
        );
        assert!(f.problems.is_empty());
    }

    #[test]
    fn problems_name_the_value_and_cost_only_it() {
        let big: Vec<String> = (0..200).map(|i| format!("item-{i}")).collect();
        let d = json!({"status": {"readyReplicas": 1, "items": big}});
        let mut versioned = paths(&[("v2", ".status.readyReplicas")]);
        versioned.json_paths[0].version = "v2".into();
        let f = read(
            &d,
            DEPLOYMENT,
            &[
                paths(&[
                    ("ready", ".status.readyReplicas"),
                    ("bad", "..x"),
                    ("items", ".status.items"),
                ]),
                versioned,
            ],
        );
        assert_eq!(summary(&f), ["ready=Integer:1"]);
        assert_eq!(f.problems.len(), 3, "{:?}", f.problems);
        assert!(
            f.problems[0].starts_with("bad: JSONPath"),
            "{}",
            f.problems[0]
        );
        assert!(
            f.problems[1].contains("more than the 1024"),
            "{}",
            f.problems[1]
        );
        assert!(f.problems[2].contains("version v2"), "{}", f.problems[2]);
        let unknown = read(
            &d,
            ObjectKind {
                group: "",
                version: "v1",
                kind: "ConfigMap",
            },
            &[well_known()],
        );
        assert_eq!(
            unknown.problems,
            ["there are no well-known status fields for v1 ConfigMap; use JSONPaths"]
        );
    }
}
