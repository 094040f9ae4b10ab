//! How an object on the cluster is compared with an object-template, by OCM's rules.
//!
//! The template is first *merged into* the existing object: for `musthave`, maps merge key by
//! key and lists keep the existing items, each template item either matching an existing one
//! (its fields a subset of it, or the same `name`) or being added; for `mustonlyhave`, every
//! map and list the template names replaces the existing one outright. The object complies
//! when that merged value is *equivalent* to what exists: maps with the same fields, lists with
//! the same items in any order, quantities by value (`1Gi` = `1024Mi`), scalars by their
//! printed form. The merged value is then exactly what `enforce` writes back.
//!
//! Only the fields the template names are compared. Of `metadata`, only `labels` and
//! `annotations` count (`metadataComplianceType` chooses their rule), so what the API server
//! adds or defaults (`resourceVersion`, `uid`, `creationTimestamp`, `generation`,
//! `managedFields`, a `status` the template does not name) never makes an object non-compliant.

use serde_json::{Map, Value};

use super::types::ANNOTATION_CREATED_BY_POLICY;
use crate::api::canonical_json;
use crate::api::quantity::parse_quantity;

/// How an object-template judges the objects it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ComplianceType {
    /// The object must exist with at least the template's fields.
    MustHave,
    /// The object must exist with exactly the template's fields, at every level it names.
    MustOnlyHave,
    /// No object matching the template (by name, or by its fields when it has none) may exist.
    MustNotHave,
}

impl ComplianceType {
    /// Reads OCM's spellings in any case (`musthave`, `MustHave`, `mustonlyhave`, ...).
    pub fn parse(value: &str) -> Option<ComplianceType> {
        [
            ("musthave", ComplianceType::MustHave),
            ("mustonlyhave", ComplianceType::MustOnlyHave),
            ("mustnothave", ComplianceType::MustNotHave),
        ]
        .into_iter()
        .find(|(name, _)| value.eq_ignore_ascii_case(name))
        .map(|(_, ct)| ct)
    }

    /// `musthave`, `mustonlyhave` or `mustnothave`.
    pub fn as_str(self) -> &'static str {
        match self {
            ComplianceType::MustHave => "musthave",
            ComplianceType::MustOnlyHave => "mustonlyhave",
            ComplianceType::MustNotHave => "mustnothave",
        }
    }
}

/// Annotations that tools write on every object and that never count. flotilla's own mark of
/// the objects a policy created ([`ANNOTATION_CREATED_BY_POLICY`]) is one: a `mustonlyhave`
/// template must not find its own bookkeeping a violation.
const IGNORED_ANNOTATIONS: &[&str] = &[
    "kubectl.kubernetes.io/last-applied-configuration",
    ANNOTATION_CREATED_BY_POLICY,
];

/// The result of comparing one existing object with a template.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ObjectComparison {
    /// The template's fields are met.
    pub matches: bool,
    /// The existing object with the template merged in: what `enforce` writes. Only the
    /// template's fields differ from the existing object; `status` and `managedFields` are
    /// left out.
    pub merged: Value,
    /// Dotted paths of the fields that differ, e.g. `data.extra` or `metadata.labels.team`;
    /// at most [`MAX_REPORTED_FIELDS`].
    pub fields: Vec<String>,
    /// Only `status` differs, which `enforce` cannot write.
    pub status_only: bool,
    /// The template and the object disagree on a field's type (a map against a list, ...).
    pub type_error: Option<String>,
}

/// How many differing fields a violation names; the first ones are enough to act on.
pub(crate) const MAX_REPORTED_FIELDS: usize = 8;

/// Compares `existing` with the template `desired` under `ctype` (for every field but
/// metadata) and `metadata_ctype` (for labels and annotations).
pub(crate) fn compare_object(
    desired: &Value,
    existing: &Value,
    ctype: ComplianceType,
    metadata_ctype: ComplianceType,
    zero_equals_nil: bool,
) -> ObjectComparison {
    let mut merged = existing.clone();
    let mut fields = Vec::new();
    let mut status_differs = false;
    let mut spec_differs = false;
    let empty = Map::new();
    let desired_map = desired.as_object().unwrap_or(&empty);
    let existing_map = existing.as_object().unwrap_or(&empty);
    for (key, desired_value) in desired_map {
        if key == "apiVersion" || key == "kind" {
            continue;
        }
        if key == "metadata" {
            let (equal, labels_annotations) =
                compare_metadata(desired_value, existing_map.get("metadata"), metadata_ctype);
            if !equal {
                spec_differs = true;
                for (field, desired_part, existing_part) in &labels_annotations.differences {
                    collect_paths(
                        &format!("metadata.{field}"),
                        desired_part,
                        existing_part,
                        &mut fields,
                    );
                }
            }
            if let Some(meta) = merged
                .pointer_mut("/metadata")
                .and_then(Value::as_object_mut)
            {
                for (field, value) in labels_annotations.merged {
                    meta.insert(field.to_string(), value);
                }
            }
            continue;
        }
        let decoded_secret;
        let existing_value =
            if key == "stringData" && existing_map.get("kind") == Some(&"Secret".into()) {
                // The API server turns stringData into base64 data and keeps no stringData, so
                // the template's stringData compares with the decoded data.
                match decoded_secret_data(existing_map) {
                    Ok(decoded) => {
                        decoded_secret = decoded;
                        Some(&decoded_secret)
                    }
                    Err(key) => {
                        return ObjectComparison {
                            matches: false,
                            merged: existing.clone(),
                            fields: vec![format!("data.{key}")],
                            status_only: false,
                            type_error: Some(format!("data.{key} of the Secret is not base64")),
                        };
                    }
                }
            } else {
                existing_map.get(key)
            };
        let merged_value = match (desired_value, existing_value) {
            (Value::Array(d), Some(Value::Array(e))) => {
                Value::Array(merge_arrays(d, e, ctype, zero_equals_nil))
            }
            (Value::Object(d), Some(Value::Object(e))) => merge_maps(d, e, ctype),
            (Value::Array(_) | Value::Object(_), None | Some(Value::Null)) => desired_value.clone(),
            (Value::Array(_) | Value::Object(_), Some(_)) => {
                return ObjectComparison {
                    matches: false,
                    merged: existing.clone(),
                    fields: vec![key.clone()],
                    status_only: false,
                    type_error: Some(format!(
                        "field {key} of the template and of the object are of different types"
                    )),
                };
            }
            _ => desired_value.clone(),
        };
        let existing_or_null = existing_value.unwrap_or(&Value::Null);
        if !equivalent(&merged_value, existing_or_null, zero_equals_nil) {
            collect_paths(key, &merged_value, existing_or_null, &mut fields);
            if key == "status" {
                status_differs = true;
            } else {
                spec_differs = true;
            }
        }
        if key != "status"
            && let Some(map) = merged.as_object_mut()
        {
            map.insert(key.clone(), merged_value);
        }
    }
    if let Some(map) = merged.as_object_mut() {
        map.remove("status");
        if let Some(meta) = map.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.remove("managedFields");
        }
    }
    fields.truncate(MAX_REPORTED_FIELDS);
    ObjectComparison {
        matches: !status_differs && !spec_differs,
        merged,
        fields,
        status_only: status_differs && !spec_differs,
        type_error: None,
    }
}

/// A Secret's `data` decoded to strings, as `stringData` would have written it; the key that
/// is not base64 on failure.
fn decoded_secret_data(secret: &Map<String, Value>) -> Result<Value, String> {
    let mut decoded = Map::new();
    for (key, value) in secret
        .get("data")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
    {
        let bytes: k8s_openapi::ByteString =
            serde_json::from_value(value.clone()).map_err(|_| key.clone())?;
        decoded.insert(
            key.clone(),
            Value::String(String::from_utf8_lossy(&bytes.0).into_owned()),
        );
    }
    Ok(Value::Object(decoded))
}

struct MetadataComparison {
    /// `labels`/`annotations` as they should be after enforcement.
    merged: Vec<(&'static str, Value)>,
    /// (field, merged, existing) of each part that differs.
    differences: Vec<(&'static str, Value, Value)>,
}

/// Compares the labels and annotations the template names; nothing else of metadata counts.
fn compare_metadata(
    desired: &Value,
    existing: Option<&Value>,
    ctype: ComplianceType,
) -> (bool, MetadataComparison) {
    let mut out = MetadataComparison {
        merged: Vec::new(),
        differences: Vec::new(),
    };
    for field in ["labels", "annotations"] {
        let Some(desired_part) = desired.get(field) else {
            continue;
        };
        let existing_part = existing
            .and_then(|m| m.get(field))
            .cloned()
            .unwrap_or(Value::Null);
        let existing_part = without_ignored_annotations(field, existing_part);
        let desired_part = without_ignored_annotations(field, desired_part.clone());
        let merged = match (&desired_part, &existing_part) {
            (Value::Object(d), Value::Object(e)) => merge_maps(d, e, ctype),
            _ => desired_part.clone(),
        };
        if !equivalent(&merged, &existing_part, false) {
            out.differences
                .push((field, merged.clone(), existing_part.clone()));
        }
        out.merged
            .push((field, keep_created_mark(field, merged, existing)));
    }
    (out.differences.is_empty(), out)
}

/// The annotations enforce writes keep the mark of the policy that created the object, which
/// `mustonlyhave` would otherwise replace away, and with it what `DeleteIfCreated` prunes.
fn keep_created_mark(field: &str, merged: Value, existing: Option<&Value>) -> Value {
    let mark = existing
        .and_then(|m| m.get("annotations"))
        .and_then(|a| a.get(ANNOTATION_CREATED_BY_POLICY));
    match (field, merged, mark) {
        ("annotations", Value::Object(mut map), Some(mark)) => {
            map.insert(ANNOTATION_CREATED_BY_POLICY.to_string(), mark.clone());
            Value::Object(map)
        }
        ("annotations", Value::Null, Some(mark)) => {
            let mut map = Map::new();
            map.insert(ANNOTATION_CREATED_BY_POLICY.to_string(), mark.clone());
            Value::Object(map)
        }
        (_, merged, _) => merged,
    }
}

fn without_ignored_annotations(field: &str, value: Value) -> Value {
    match value {
        Value::Object(mut map) if field == "annotations" => {
            for key in IGNORED_ANNOTATIONS {
                map.remove(*key);
            }
            Value::Object(map)
        }
        other => other,
    }
}

/// Merges the template value `desired` into `existing` the way `ctype` compares: the result is
/// equivalent to `existing` exactly when `existing` meets the template.
pub fn merge_into(desired: &Value, existing: &Value, ctype: ComplianceType) -> Value {
    match (desired, existing) {
        (Value::Object(d), Value::Object(e)) => merge_maps(d, e, ctype),
        (Value::Array(d), Value::Array(e)) => Value::Array(merge_arrays(d, e, ctype, false)),
        _ => desired.clone(),
    }
}

/// Whether `existing` meets the template value `desired` under `ctype` (musthave or
/// mustonlyhave): [`merge_into`] then equivalence.
pub fn fields_match(desired: &Value, existing: &Value, ctype: ComplianceType) -> bool {
    equivalent(&merge_into(desired, existing, ctype), existing, false)
}

fn merge_maps(
    desired: &Map<String, Value>,
    existing: &Map<String, Value>,
    ctype: ComplianceType,
) -> Value {
    if ctype == ComplianceType::MustOnlyHave {
        return Value::Object(desired.clone());
    }
    Value::Object(merge_map_into(desired.clone(), existing, ctype))
}

/// `musthave`'s deep merge: every field of `existing` the template does not name is kept.
fn merge_map_into(
    mut desired: Map<String, Value>,
    existing: &Map<String, Value>,
    ctype: ComplianceType,
) -> Map<String, Value> {
    for (key, existing_value) in existing {
        let merged = match desired.remove(key) {
            Some(desired_value) => merge_value(desired_value, existing_value, ctype),
            None => existing_value.clone(),
        };
        desired.insert(key.clone(), merged);
    }
    desired
}

fn merge_value(desired: Value, existing: &Value, ctype: ComplianceType) -> Value {
    match desired {
        Value::Object(d) => match existing {
            Value::Object(e) => Value::Object(merge_map_into(d, e, ctype)),
            _ => Value::Object(d),
        },
        Value::Array(d) => match existing {
            Value::Array(e) if !e.is_empty() => Value::Array(merge_arrays(&d, e, ctype, false)),
            _ => Value::Array(d),
        },
        Value::Null => match existing {
            // A field the template leaves null is one it does not care about.
            Value::Object(_) => existing.clone(),
            _ => Value::Null,
        },
        scalar => scalar,
    }
}

/// Merges a template list into an existing list. Each existing item is kept once per
/// occurrence; a template item that matches one (its fields a subset, or the same `name`)
/// takes its place merged with it; template items that match nothing are appended. Under
/// `mustonlyhave` the template's list is the result.
fn merge_arrays(
    desired: &[Value],
    existing: &[Value],
    ctype: ComplianceType,
    zero_equals_nil: bool,
) -> Vec<Value> {
    if ctype == ComplianceType::MustOnlyHave {
        return desired.to_vec();
    }
    let mut result: Vec<Value> = desired.to_vec();
    let mut written = vec![false; desired.len()];
    // Distinct existing items, in order, with how often each occurs.
    let mut distinct: Vec<(String, &Value, usize)> = Vec::new();
    for item in existing {
        let key = sorted_print(item);
        match distinct.iter_mut().find(|(k, _, _)| *k == key) {
            Some(entry) => entry.2 += 1,
            None => distinct.push((key, item, 1)),
        }
    }
    for (_, existing_item, occurrences) in distinct {
        let mut count = 0;
        for (index, desired_item) in desired.iter().enumerate() {
            if written[index] {
                continue;
            }
            let (merged, same_name) = match (existing_item, desired_item) {
                (Value::Object(e), Value::Object(d)) => {
                    let same_name = matches!(
                        (e.get("name"), d.get("name")),
                        (Some(Value::String(a)), Some(Value::String(b))) if !a.is_empty() && a == b
                    );
                    (merge_maps(d, e, ctype), same_name)
                }
                _ => (desired_item.clone(), false),
            };
            if same_name || equivalent(&merged, existing_item, zero_equals_nil) {
                count += 1;
                result[index] = merged;
                written[index] = true;
            }
            if count == occurrences {
                break;
            }
        }
        for _ in count..occurrences {
            result.push(existing_item.clone());
        }
    }
    result
}

/// OCM's equivalence of a merged value with the existing one: maps field by field (the merged
/// map may not have fewer fields), lists as multisets, quantities by value, scalars by their
/// printed form. With `zero_equals_nil`, a field missing on one side equals its zero value on
/// the other (as OCM allows inside list items and for templates without a name).
pub(crate) fn equivalent(merged: &Value, existing: &Value, zero_equals_nil: bool) -> bool {
    match merged {
        Value::Object(m) => match existing {
            Value::Object(e) => maps_equivalent(m, e, zero_equals_nil),
            _ => false,
        },
        Value::Array(m) => match existing {
            Value::Null => m.is_empty(),
            Value::Array(e) => lists_equivalent(e, m),
            _ => false,
        },
        _ => {
            if zero_equals_nil {
                if existing.is_null() && !merged.is_null() {
                    return print(&zero_of(merged)) == print(merged);
                }
                if merged.is_null() && !existing.is_null() {
                    return print(&zero_of(existing)) == print(existing);
                }
            }
            print(merged) == print(existing)
        }
    }
}

fn maps_equivalent(
    merged: &Map<String, Value>,
    existing: &Map<String, Value>,
    zero_equals_nil: bool,
) -> bool {
    if merged.len() < existing.len() {
        return false;
    }
    merged.iter().all(|(key, m)| {
        let e = existing.get(key);
        match m {
            Value::Object(mm) => match e {
                Some(Value::Object(em)) => maps_equivalent(mm, em, zero_equals_nil),
                _ => zero_equals_nil && mm.is_empty(),
            },
            Value::Array(ml) => match e {
                Some(Value::Array(el)) => ml.len() == el.len() && lists_equivalent(el, ml),
                _ => ml.is_empty(),
            },
            Value::String(ms) => match parse_quantity(ms) {
                Some(mq) => e
                    .and_then(Value::as_str)
                    .and_then(parse_quantity)
                    .is_some_and(|eq| eq == mq),
                None => e.is_some_and(|e| print(e) == *ms),
            },
            _ => {
                // A field the API server omits because it is zero (`omitempty`) equals zero.
                let e = match e {
                    None | Some(Value::Null) if !m.is_null() => zero_of(m),
                    None => Value::Null,
                    Some(e) => e.clone(),
                };
                print(&e) == print(m)
            }
        }
    })
}

/// Lists as multisets: sorted by their printed form and compared item by item, map items by
/// field (with zero values equal to missing fields, as OCM).
fn lists_equivalent(existing: &[Value], merged: &[Value]) -> bool {
    if existing.len() != merged.len() {
        return false;
    }
    let mut e: Vec<&Value> = existing.iter().collect();
    let mut m: Vec<&Value> = merged.iter().collect();
    e.sort_by_cached_key(|v| sorted_print(v));
    m.sort_by_cached_key(|v| sorted_print(v));
    e.iter().zip(m.iter()).all(|(e, m)| match e {
        Value::Object(eo) => match m {
            Value::Object(mo) => maps_equivalent(mo, eo, true),
            _ => false,
        },
        _ => print(e) == print(m),
    })
}

/// A scalar as OCM prints it for comparison: strings as themselves, whole numbers without a
/// fraction, `true`/`false`, `<nil>`; containers canonically.
fn print(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Null => "<nil>".to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => i.to_string(),
            (_, Some(u), _) => u.to_string(),
            (_, _, Some(f)) if f.fract() == 0.0 && f.abs() < 1e15 => format!("{}", f as i64),
            (_, _, Some(f)) => f.to_string(),
            _ => n.to_string(),
        },
        other => canonical_json(other),
    }
}

/// Containers printed with their lists sorted, so that order does not matter.
fn sorted_print(value: &Value) -> String {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(String, String)> = map
                .iter()
                .map(|(k, v)| (k.clone(), sorted_print(v)))
                .collect();
            entries.sort();
            let inner: Vec<String> = entries
                .into_iter()
                .map(|(k, v)| format!("{k}:{v}"))
                .collect();
            format!("map[{}]", inner.join(" "))
        }
        Value::Array(items) => {
            let mut inner: Vec<String> = items.iter().map(sorted_print).collect();
            inner.sort();
            format!("[{}]", inner.join(" "))
        }
        scalar => print(scalar),
    }
}

fn zero_of(value: &Value) -> Value {
    match value {
        Value::Bool(_) => Value::Bool(false),
        Value::Number(_) => Value::from(0),
        Value::String(_) => Value::String(String::new()),
        Value::Array(_) => Value::Array(Vec::new()),
        Value::Object(_) => Value::Object(Map::new()),
        Value::Null => Value::Null,
    }
}

/// Dotted paths (under `prefix`) where `merged` and `existing` differ, descending into maps;
/// a list is named as a whole.
fn collect_paths(prefix: &str, merged: &Value, existing: &Value, out: &mut Vec<String>) {
    if out.len() >= MAX_REPORTED_FIELDS {
        return;
    }
    match (merged, existing) {
        (Value::Object(m), Value::Object(e)) => {
            let before = out.len();
            for (key, mv) in m {
                let ev = e.get(key).unwrap_or(&Value::Null);
                if !equivalent(mv, ev, false) {
                    collect_paths(&format!("{prefix}.{key}"), mv, ev, out);
                }
            }
            for key in e.keys().filter(|k| !m.contains_key(*k)) {
                if out.len() < MAX_REPORTED_FIELDS {
                    out.push(format!("{prefix}.{key}"));
                }
            }
            if out.len() == before {
                out.push(prefix.to_string());
            }
        }
        _ => out.push(prefix.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const MUSTHAVE: ComplianceType = ComplianceType::MustHave;
    const ONLY: ComplianceType = ComplianceType::MustOnlyHave;

    /// One comparison case: the template's fields, the object's, and whether they match under
    /// musthave and under mustonlyhave.
    fn check(name: &str, desired: Value, existing: Value, musthave: bool, mustonlyhave: bool) {
        let d = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}})
            .as_object()
            .unwrap()
            .clone()
            .into_iter()
            .chain(desired.as_object().unwrap().clone())
            .collect::<Map<_, _>>();
        let e = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "cm", "namespace": "default", "uid": "u-1",
                         "resourceVersion": "42", "creationTimestamp": "2026-01-01T00:00:00Z",
                         "generation": 3, "managedFields": [{"manager": "kubectl"}]}})
        .as_object()
        .unwrap()
        .clone()
        .into_iter()
        .chain(existing.as_object().unwrap().clone())
        .collect::<Map<_, _>>();
        let (d, e) = (Value::Object(d), Value::Object(e));
        let got = compare_object(&d, &e, MUSTHAVE, MUSTHAVE, false).matches;
        assert_eq!(got, musthave, "{name}: musthave");
        let got = compare_object(&d, &e, ONLY, ONLY, false).matches;
        assert_eq!(got, mustonlyhave, "{name}: mustonlyhave");
    }

    #[test]
    fn comparison_rules_match_ocm() {
        check(
            "same data",
            json!({"data": {"a": "1"}}),
            json!({"data": {"a": "1"}}),
            true,
            true,
        );
        check(
            "an extra key in the object",
            json!({"data": {"a": "1"}}),
            json!({"data": {"a": "1", "extra": "x"}}),
            true,
            false,
        );
        check(
            "a different value",
            json!({"data": {"a": "1"}}),
            json!({"data": {"a": "2"}}),
            false,
            false,
        );
        check(
            "a key missing from the object",
            json!({"data": {"a": "1", "b": "2"}}),
            json!({"data": {"a": "1"}}),
            false,
            false,
        );
        check(
            "a list item missing",
            json!({"spec": {"hard": ["a", "b"]}}),
            json!({"spec": {"hard": ["a"]}}),
            false,
            false,
        );
        check(
            "a list with an extra item",
            json!({"spec": {"hard": ["a"]}}),
            json!({"spec": {"hard": ["b", "a"]}}),
            true,
            false,
        );
        check(
            "a list in another order",
            json!({"spec": {"hard": ["b", "a"]}}),
            json!({"spec": {"hard": ["a", "b"]}}),
            true,
            true,
        );
        check(
            "list items matched by subset of their fields",
            json!({"spec": {"limits": [{"type": "Container", "default": {"memory": "512Mi"}}]}}),
            json!({"spec": {"limits": [{"type": "Container", "default": {"memory": "512Mi", "cpu": "1"},
                                        "defaultRequest": {"memory": "256Mi"}}]}}),
            true,
            false,
        );
        check(
            "a named list item with a different field",
            json!({"spec": {"containers": [{"name": "app", "image": "nginx:2"}]}}),
            json!({"spec": {"containers": [{"name": "app", "image": "nginx:1"}]}}),
            false,
            false,
        );
        check(
            "quantities compare by value",
            json!({"spec": {"hard": {"memory": "1Gi"}}}),
            json!({"spec": {"hard": {"memory": "1024Mi"}}}),
            true,
            true,
        );
        check(
            "a false the API server omitted",
            json!({"spec": {"paused": false}}),
            json!({"spec": {}}),
            true,
            true,
        );
        check(
            "server-added status and metadata never count",
            json!({"metadata": {"name": "cm"}, "data": {"a": "1"}}),
            json!({"status": {"phase": "Active"}, "data": {"a": "1"}}),
            true,
            true,
        );
        check(
            "a label the template requires is missing",
            json!({"metadata": {"name": "cm", "labels": {"team": "a"}}}),
            json!({}),
            false,
            false,
        );
        check(
            "an extra label",
            json!({"metadata": {"name": "cm", "labels": {"team": "a"}}}),
            json!({"metadata": {"name": "cm", "labels": {"team": "a", "extra": "x"}}}),
            true,
            false,
        );
        check(
            "a whole number written with a fraction",
            json!({"spec": {"replicas": 3}}),
            json!({"spec": {"replicas": 3.0}}),
            true,
            true,
        );
    }

    #[test]
    fn metadata_compliance_type_applies_to_labels_only() {
        let desired =
            json!({"metadata": {"name": "cm", "labels": {"team": "a"}}, "data": {"a": "1"}});
        let existing = json!({"metadata": {"name": "cm", "labels": {"team": "a", "extra": "x"}},
                              "data": {"a": "1", "b": "2"}});
        // Data by musthave, labels by mustonlyhave: the extra label counts, the extra key not.
        let c = compare_object(&desired, &existing, MUSTHAVE, ONLY, false);
        assert!(!c.matches);
        assert_eq!(c.fields, vec!["metadata.labels.extra"]);
        // Data by mustonlyhave, labels by musthave: the other way round.
        let c = compare_object(&desired, &existing, ONLY, MUSTHAVE, false);
        assert!(!c.matches);
        assert_eq!(c.fields, vec!["data.b"]);
    }

    #[test]
    fn the_merged_object_is_what_enforce_writes() {
        let desired =
            json!({"metadata": {"name": "cm", "labels": {"team": "a"}}, "data": {"a": "1"}});
        let existing = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "cm", "namespace": "default", "resourceVersion": "7",
                         "managedFields": [{"manager": "x"}], "labels": {"other": "y"}},
            "data": {"a": "2", "keep": "k"}});
        let c = compare_object(&desired, &existing, MUSTHAVE, MUSTHAVE, false);
        assert!(!c.matches);
        assert_eq!(
            c.merged,
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "cm", "namespace": "default", "resourceVersion": "7",
                             "labels": {"other": "y", "team": "a"}},
                "data": {"a": "1", "keep": "k"}})
        );
        assert_eq!(c.fields, vec!["data.a", "metadata.labels.team"]);
        let c = compare_object(&desired, &existing, ONLY, ONLY, false);
        assert_eq!(c.merged["data"], json!({"a": "1"}));
        assert_eq!(c.merged["metadata"]["labels"], json!({"team": "a"}));
    }

    #[test]
    fn a_named_list_item_is_replaced_not_duplicated() {
        let desired = json!([{"name": "app", "image": "nginx:2"}]);
        let existing =
            json!([{"name": "app", "image": "nginx:1", "ports": [80]}, {"name": "side"}]);
        assert_eq!(
            merge_into(&desired, &existing, MUSTHAVE),
            json!([{"name": "app", "image": "nginx:2", "ports": [80]}, {"name": "side"}])
        );
        assert!(!fields_match(&desired, &existing, MUSTHAVE));
    }

    #[test]
    fn a_status_mismatch_is_reported_but_not_written() {
        let desired = json!({"status": {"phase": "Active"}});
        let existing = json!({"metadata": {"name": "ns"}, "status": {"phase": "Terminating"}});
        let c = compare_object(&desired, &existing, MUSTHAVE, MUSTHAVE, false);
        assert!(!c.matches);
        assert!(c.status_only);
        assert_eq!(c.fields, vec!["status.phase"]);
        assert!(c.merged.get("status").is_none());
    }

    #[test]
    fn secret_string_data_compares_with_the_decoded_data() {
        let desired = json!({"kind": "Secret", "stringData": {"password": "hunter2"}});
        // "hunter2" and "other" in base64.
        let existing = |b64: &str| {
            json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"},
                   "data": {"password": b64}, "type": "Opaque"})
        };
        let c = compare_object(
            &desired,
            &existing("aHVudGVyMg=="),
            MUSTHAVE,
            MUSTHAVE,
            false,
        );
        assert!(c.matches, "{c:?}");
        let c = compare_object(&desired, &existing("b3RoZXI="), MUSTHAVE, MUSTHAVE, false);
        assert!(!c.matches);
        assert_eq!(c.fields, vec!["stringData.password"]);
        assert_eq!(c.merged["stringData"], json!({"password": "hunter2"}));
        let c = compare_object(&desired, &existing("%%%"), MUSTHAVE, MUSTHAVE, false);
        assert_eq!(
            c.type_error.as_deref(),
            Some("data.password of the Secret is not base64")
        );
    }

    #[test]
    fn the_created_by_policy_mark_is_neither_a_violation_nor_removed_by_enforce() {
        let desired = json!({"metadata": {"name": "cm", "annotations": {"team": "a"}}});
        let existing = json!({"metadata": {"name": "cm", "annotations": {
            "team": "a", ANNOTATION_CREATED_BY_POLICY: "policy-uid"}}});
        let c = compare_object(&desired, &existing, ONLY, ONLY, false);
        assert!(c.matches, "{c:?}");
        let drifted = json!({"metadata": {"name": "cm", "annotations": {
            "team": "b", "extra": "x", ANNOTATION_CREATED_BY_POLICY: "policy-uid"}}});
        let c = compare_object(&desired, &drifted, ONLY, ONLY, false);
        assert!(!c.matches);
        assert_eq!(
            c.fields,
            vec!["metadata.annotations.team", "metadata.annotations.extra"]
        );
        assert_eq!(
            c.merged["metadata"]["annotations"],
            json!({"team": "a", ANNOTATION_CREATED_BY_POLICY: "policy-uid"}),
            "enforce keeps the mark"
        );
    }

    #[test]
    fn a_type_mismatch_is_named() {
        let desired = json!({"data": {"a": "1"}});
        let existing = json!({"data": ["a"]});
        let c = compare_object(&desired, &existing, MUSTHAVE, MUSTHAVE, false);
        assert!(!c.matches);
        assert_eq!(
            c.type_error.as_deref(),
            Some("field data of the template and of the object are of different types")
        );
    }
}
