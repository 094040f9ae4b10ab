//! Content hashes of ManifestWork specs, as the session protocol's resume uses them: the agent's
//! hello says which hash it holds for each work, the gateway sends only the works that differ.

use std::fmt::Write as _;

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::work::ManifestWorkSpec;

/// Hex SHA-256 of the spec's canonical JSON (see [`canonical_json`]).
///
/// Two specs that differ only in the order of object keys (in the manifests too) hash the same;
/// any other difference changes the hash. Both ends of a session compute it from the typed spec,
/// so fields the types do not know about never enter it.
pub fn content_hash(spec: &ManifestWorkSpec) -> String {
    // A spec is plain data (string keys, no non-finite floats), so this cannot fail.
    let value = serde_json::to_value(spec).expect("ManifestWorkSpec serializes to JSON");
    hex::encode(Sha256::digest(canonical_json(&value).as_bytes()))
}

/// Hex SHA-256 of any JSON value's canonical form: the content hash of what a session delivers
/// that is not a ManifestWork (a governance Policy's spec), by the same rule.
pub fn value_hash(value: &Value) -> String {
    hex::encode(Sha256::digest(canonical_json(value).as_bytes()))
}

/// Compact JSON with every object's keys sorted by their UTF-8 bytes.
///
/// Sorted here rather than relying on `serde_json::Map` iterating in order: that holds only while
/// no crate in the build turns on serde_json's `preserve_order` feature, and a hash that changes
/// with the dependency graph would make every agent resync.
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(key, out);
                out.push(':');
                write_canonical(item, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        Value::String(s) => write_string(s, out),
        Value::Number(n) => {
            let _ = write!(out, "{n}");
        }
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Null => out.push_str("null"),
    }
}

fn write_string(s: &str, out: &mut String) {
    // serde_json's string escaping is deterministic; reuse it.
    out.push_str(&serde_json::to_string(s).expect("a string serializes"));
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_are_sorted_at_every_level() {
        let v = json!({"b": 1, "a": {"z": [ {"y": 1, "x": 2} ], "c": "q\"uote"}});
        assert_eq!(
            canonical_json(&v),
            r#"{"a":{"c":"q\"uote","z":[{"x":2,"y":1}]},"b":1}"#
        );
    }

    #[test]
    fn scalars_render_as_json() {
        assert_eq!(
            canonical_json(&json!([null, true, false, 1.5, -3, "é"])),
            r#"[null,true,false,1.5,-3,"é"]"#
        );
    }
}
