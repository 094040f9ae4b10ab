//! Kubernetes' ConfigMap as the hub stores it: the data hub templates read with
//! `{{hub fromConfigMap "" "NAME" "KEY" hub}}` from their policy's namespace.
//!
//! A core kind (`apiVersion: v1`), with no CRD: the kube backend's apiserver serves it natively
//! and validates it itself; the sled backend and the operator API check the same rules here,
//! so a ConfigMap one backend refuses the other refuses too ([`check_config_map`]): `data`
//! values are strings, `binaryData` values base64, keys are Kubernetes' ConfigMap keys and not
//! repeated between the two, at most [`MAX_CONFIG_MAP_DATA_BYTES`] of values, `immutable` a
//! boolean, and no field a ConfigMap does not have. Once `immutable` is true, the data and the
//! flag stay as they are ([`check_config_map_update`]).

use serde_json::Value;

pub use k8s_openapi::api::core::v1::ConfigMap;

/// Most bytes a ConfigMap's values may take (`data` values plus decoded `binaryData`), as
/// Kubernetes allows: 1 MiB.
pub const MAX_CONFIG_MAP_DATA_BYTES: usize = 1024 * 1024;

/// Longest ConfigMap key, as Kubernetes allows (a DNS-1123 subdomain's length).
pub const MAX_CONFIG_MAP_KEY_BYTES: usize = 253;

/// The top-level fields a ConfigMap has.
const FIELDS: [&str; 6] = [
    "apiVersion",
    "kind",
    "metadata",
    "data",
    "binaryData",
    "immutable",
];

/// What is wrong with a ConfigMap (given as JSON), one problem per entry, each naming the
/// field (`data.tier is a number; ConfigMap data values are strings`); empty when it is valid.
/// The object's kind, name and namespace are the store's to check; a caller puts the object's
/// name in front (`ConfigMap policies/settings: ...`).
pub fn check_config_map(object: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    let Some(map) = object.as_object() else {
        return vec!["is not a JSON map".to_string()];
    };
    for field in map.keys() {
        if !FIELDS.contains(&field.as_str()) {
            problems.push(format!(
                "{field} is not a field of a ConfigMap (it has data, binaryData and immutable)"
            ));
        }
    }
    let mut bytes = 0usize;
    let mut keys = std::collections::BTreeSet::new();
    for (field, binary) in [("data", false), ("binaryData", true)] {
        let entries = match map.get(field) {
            None | Some(Value::Null) => continue,
            Some(Value::Object(entries)) => entries,
            Some(other) => {
                problems.push(format!(
                    "{field} is {}, not a map of keys to {}",
                    json_type(other),
                    if binary { "base64 strings" } else { "strings" }
                ));
                continue;
            }
        };
        for (key, value) in entries {
            if let Some(problem) = key_problem(key) {
                problems.push(format!("{field} key {key:?} {problem}"));
            }
            if !keys.insert(key.as_str()) {
                problems.push(format!(
                    "{field} key {key:?} is also a key of data; a key is in data or in binaryData, not both"
                ));
            }
            match (value, binary) {
                (Value::String(text), false) => bytes += text.len(),
                (Value::String(text), true) => match super::base64::decode(text) {
                    Some(decoded) => bytes += decoded.len(),
                    None => problems.push(format!(
                        "{field}.{key} is not valid base64 (binaryData holds bytes as standard \
                         base64 with padding)"
                    )),
                },
                (other, false) => problems.push(format!(
                    "{field}.{key} is {}; ConfigMap data values are strings (quote it)",
                    json_type(other)
                )),
                (other, true) => problems.push(format!(
                    "{field}.{key} is {}; binaryData values are base64 strings",
                    json_type(other)
                )),
            }
        }
    }
    if bytes > MAX_CONFIG_MAP_DATA_BYTES {
        problems.push(format!(
            "data and binaryData hold {bytes} bytes, more than the {MAX_CONFIG_MAP_DATA_BYTES} \
             bytes a ConfigMap may hold"
        ));
    }
    match map.get("immutable") {
        None | Some(Value::Null) | Some(Value::Bool(_)) => {}
        Some(other) => problems.push(format!(
            "immutable is {}, not true or false",
            json_type(other)
        )),
    }
    problems
}

/// What is wrong with replacing the ConfigMap `stored` with `new`: once `immutable` is true,
/// neither the data nor the flag may change (Kubernetes' rule). `None` when the update is fine.
pub fn check_config_map_update(stored: &Value, new: &Value) -> Option<String> {
    if stored.get("immutable") != Some(&Value::Bool(true)) {
        return None;
    }
    if new.get("immutable") != Some(&Value::Bool(true)) {
        return Some("immutable cannot be unset once it is true; delete and create the ConfigMap to change it".into());
    }
    let field = |object: &Value, name: &str| object.get(name).filter(|v| !v.is_null()).cloned();
    for name in ["data", "binaryData"] {
        if field(stored, name) != field(new, name) {
            return Some(format!(
                "{name} cannot change: the ConfigMap is immutable; delete and create it to change it"
            ));
        }
    }
    None
}

/// Kubernetes' rule for a ConfigMap key (`IsConfigMapKey`): why `key` is not one.
fn key_problem(key: &str) -> Option<String> {
    if key.is_empty() {
        return Some("is empty".into());
    }
    if key.len() > MAX_CONFIG_MAP_KEY_BYTES {
        return Some(format!(
            "is longer than {MAX_CONFIG_MAP_KEY_BYTES} characters"
        ));
    }
    if !key
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Some("may hold only letters, digits, '-', '_' and '.'".into());
    }
    if key == "." || key == ".." || key.starts_with("..") {
        return Some("may not be '.' or '..' or start with '..'".into());
    }
    None
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a map",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn config_map(extra: Value) -> Value {
        let mut object = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "settings", "namespace": "policies"}});
        if let (Some(object), Some(extra)) = (object.as_object_mut(), extra.as_object()) {
            object.extend(extra.clone());
        }
        object
    }

    /// The problems in any order (JSON maps may keep their keys' order or sort them).
    fn check(extra: Value, expected: &[&str]) {
        let mut problems = check_config_map(&config_map(extra.clone()));
        problems.sort();
        let mut expected = expected.to_vec();
        expected.sort();
        assert_eq!(problems, expected, "{extra}");
    }

    #[test]
    fn what_kubernetes_refuses_is_refused_by_field() {
        check(json!({}), &[]);
        check(
            json!({"data": {"tier": "gold", "a.b_c-1": ""}, "binaryData": {"logo": "AAEC"},
                   "immutable": false}),
            &[],
        );
        check(
            json!({"data": {"tier": 3, "on": true}}),
            &[
                "data.on is a boolean; ConfigMap data values are strings (quote it)",
                "data.tier is a number; ConfigMap data values are strings (quote it)",
            ],
        );
        check(
            json!({"binaryData": {"logo": "not base64!"}}),
            &[
                "binaryData.logo is not valid base64 (binaryData holds bytes as standard base64 with padding)",
            ],
        );
        check(
            json!({"data": {"k": "v"}, "binaryData": {"k": "AAEC"}}),
            &[
                "binaryData key \"k\" is also a key of data; a key is in data or in binaryData, not both",
            ],
        );
        check(
            json!({"data": {"a/b": "v", "..x": "v"}}),
            &[
                "data key \"..x\" may not be '.' or '..' or start with '..'",
                "data key \"a/b\" may hold only letters, digits, '-', '_' and '.'",
            ],
        );
        check(
            json!({"data": ["a"], "spec": {}, "immutable": "yes"}),
            &[
                "spec is not a field of a ConfigMap (it has data, binaryData and immutable)",
                "data is a list, not a map of keys to strings",
                "immutable is a string, not true or false",
            ],
        );
        check(
            json!({"data": {"big": "x".repeat(MAX_CONFIG_MAP_DATA_BYTES)}, "binaryData": {"b": "AA=="}}),
            &[
                "data and binaryData hold 1048577 bytes, more than the 1048576 bytes a ConfigMap may hold",
            ],
        );
    }

    #[test]
    fn an_immutable_config_map_keeps_its_data() {
        let stored = config_map(json!({"data": {"k": "v"}, "immutable": true}));
        let relabelled = {
            let mut c = stored.clone();
            c["metadata"]["labels"] = json!({"a": "b"});
            c
        };
        assert_eq!(check_config_map_update(&stored, &relabelled), None);
        let edited = config_map(json!({"data": {"k": "w"}, "immutable": true}));
        assert_eq!(
            check_config_map_update(&stored, &edited).as_deref(),
            Some(
                "data cannot change: the ConfigMap is immutable; delete and create it to change it"
            )
        );
        let unset = config_map(json!({"data": {"k": "v"}}));
        assert!(check_config_map_update(&stored, &unset).is_some());
        let mutable = config_map(json!({"data": {"k": "v"}}));
        assert_eq!(check_config_map_update(&mutable, &edited), None);
    }
}
