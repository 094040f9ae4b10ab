//! A small, deterministic YAML writer for JSON values (the CRD files in deploy/crds).
//!
//! Only what the CRDs need: block mappings with sorted keys, block sequences, literal block
//! scalars for multi-line text, plain scalars where they cannot be misread, double quotes
//! elsewhere. The output is ASCII. It is written here instead of by a YAML library so that proto
//! keeps its dependency list short and the bytes of a generated file never change with a
//! library upgrade.

use serde_json::{Map, Value};

/// Renders `value` as a YAML document (no leading `---`), ending in a newline.
pub(crate) fn to_yaml(value: &Value) -> String {
    let mut out = String::new();
    match value {
        Value::Object(map) if !map.is_empty() => write_map(map, 0, false, &mut out),
        Value::Array(items) if !items.is_empty() => write_seq(items, 0, &mut out),
        scalar => {
            out.push_str(&scalar_inline(scalar, 0));
            out.push('\n');
        }
    }
    out
}

fn pad(indent: usize, out: &mut String) {
    out.extend(std::iter::repeat_n(' ', indent));
}

fn sorted(map: &Map<String, Value>) -> Vec<(&String, &Value)> {
    let mut entries: Vec<_> = map.iter().collect();
    entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    entries
}

/// Writes `key: value` lines at `indent`. With `first_inline` the first key continues the
/// current line (after a sequence's `- `).
fn write_map(map: &Map<String, Value>, indent: usize, first_inline: bool, out: &mut String) {
    for (i, (key, value)) in sorted(map).into_iter().enumerate() {
        if i > 0 || !first_inline {
            pad(indent, out);
        }
        out.push_str(&string_scalar(key, None));
        out.push(':');
        match value {
            Value::Object(inner) if !inner.is_empty() => {
                out.push('\n');
                write_map(inner, indent + 2, false, out);
            }
            // Sequences under a key sit at the key's indentation, as kubectl and controller-gen
            // write them.
            Value::Array(items) if !items.is_empty() => {
                out.push('\n');
                write_seq(items, indent, out);
            }
            scalar => {
                out.push(' ');
                out.push_str(&scalar_inline(scalar, indent + 2));
                out.push('\n');
            }
        }
    }
}

fn write_seq(items: &[Value], indent: usize, out: &mut String) {
    for item in items {
        pad(indent, out);
        match item {
            Value::Object(inner) if !inner.is_empty() => {
                out.push_str("- ");
                write_map(inner, indent + 2, true, out);
            }
            Value::Array(inner) if !inner.is_empty() => {
                out.push_str("-\n");
                write_seq(inner, indent + 2, out);
            }
            scalar => {
                out.push_str("- ");
                out.push_str(&scalar_inline(scalar, indent + 2));
                out.push('\n');
            }
        }
    }
}

/// A scalar (or empty collection) on the current line; multi-line strings continue as a literal
/// block indented by `block_indent`.
fn scalar_inline(value: &Value, block_indent: usize) -> String {
    match value {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => string_scalar(s, Some(block_indent)),
        Value::Array(_) => "[]".to_owned(),
        Value::Object(_) => "{}".to_owned(),
    }
}

/// Plain when unambiguous, a literal block when multi-line (and `block_indent` allows it),
/// double-quoted otherwise.
fn string_scalar(s: &str, block_indent: Option<usize>) -> String {
    if is_plain_safe(s) {
        return s.to_owned();
    }
    if let Some(indent) = block_indent
        && is_block_safe(s)
    {
        let (body, chomp) = match s.strip_suffix('\n') {
            Some(body) => (body, ""),
            None => (s, "-"),
        };
        let mut out = format!("|{chomp}");
        for line in body.split('\n') {
            out.push('\n');
            if !line.is_empty() {
                out.extend(std::iter::repeat_n(' ', indent));
                out.push_str(line);
            }
        }
        return out;
    }
    double_quoted(s)
}

/// Words YAML 1.1 or 1.2 would read as something other than a string.
const RESERVED: &[&str] = &[
    "y", "n", "yes", "no", "on", "off", "true", "false", "null", "~", ".inf", ".nan",
];

fn is_plain_safe(s: &str) -> bool {
    let Some(first) = s.chars().next() else {
        return false;
    };
    // Starting with a letter (or a path-like `.`/`/`) rules out numbers, dates and indicators.
    (first.is_ascii_alphabetic() || first == '.' || first == '/')
        && !s.ends_with(' ')
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || " ._/-()=+,".contains(c))
        && !RESERVED.iter().any(|r| s.eq_ignore_ascii_case(r))
}

fn is_block_safe(s: &str) -> bool {
    let body = s.strip_suffix('\n').unwrap_or(s);
    s.contains('\n')
        && !body.ends_with('\n')
        && s.chars().all(|c| c == '\n' || (' '..='~').contains(&c))
        && body
            .split('\n')
            .next()
            .is_some_and(|first| !first.is_empty() && !first.starts_with(' '))
        && body.split('\n').all(|line| !line.ends_with(' '))
}

fn double_quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            ' '..='~' => out.push(c),
            c if (c as u32) <= 0xFFFF => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push_str(&format!("\\U{:08x}", c as u32)),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn renders_block_style_with_sorted_keys() {
        let v = json!({
            "b": [ {"z": 1, "x": "two"}, "plain", ["nested"] ],
            "a": {},
            "c": [],
            "d": "two\nlines",
            "e": "True",
            "f": ".status.conditions[?(@.type==\"Ready\")].status",
            "g": "trailing\n",
        });
        let expected = "\
a: {}
b:
- x: two
  z: 1
- plain
-
  - nested
c: []
d: |-
  two
  lines
e: \"True\"
f: \".status.conditions[?(@.type==\\\"Ready\\\")].status\"
g: |
  trailing
";
        assert_eq!(to_yaml(&v), expected);
    }

    #[test]
    fn ambiguous_strings_are_quoted() {
        for s in [
            "", "yes", "No", "1", "1Gi", "0x1F", "-x", "a: b", "#c", " lead", "trail ", "é", "~",
            ".NaN",
        ] {
            assert!(!is_plain_safe(s), "{s:?} must not be plain");
        }
        for s in [
            "Foreground",
            "x-kubernetes-preserve-unknown-fields",
            ".spec.hubAcceptsClient",
            "v1beta2",
        ] {
            assert!(is_plain_safe(s), "{s:?} should be plain");
        }
        assert_eq!(double_quoted("é\u{1F600}"), "\"\\u00e9\\U0001f600\"");
    }
}
