//! `namespaceSelector`: which of a cluster's namespaces a namespaced object-template without
//! `metadata.namespace` is evaluated in. A pure function of the namespace list the agent read.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

use super::types::NamespaceSelector;

/// A malformed glob: why it does not parse. Not retryable: fix the pattern.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GlobError {
    /// The pattern ends with a lone `\`. Not retryable.
    #[error("ends with an escape")]
    TrailingEscape,
    /// A `[` class is never closed. Not retryable.
    #[error("has an unclosed [")]
    UnclosedClass,
    /// A class is empty (`[]`), which Go refuses. Not retryable.
    #[error("has an empty []")]
    EmptyClass,
}

/// Why a namespace selector cannot be applied. Not retryable: fix the ConfigurationPolicy
/// (validation refuses both before a policy is stored).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    /// An `include` or `exclude` pattern is malformed. Not retryable.
    #[error("{field} pattern {pattern:?} {problem}")]
    Pattern {
        field: &'static str,
        pattern: String,
        #[source]
        problem: GlobError,
    },
    /// A `matchExpressions` operator is not one Kubernetes defines. Not retryable.
    #[error(
        "matchExpressions operator {operator:?} for key {key:?} is not In, NotIn, Exists or DoesNotExist"
    )]
    Operator { key: String, operator: String },
}

/// What selection needs to know of one namespace on the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NamespaceInfo {
    /// The namespace's name.
    pub name: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// It has a deletion timestamp; such namespaces are skipped, as OCM does by default.
    pub terminating: bool,
}

/// The names of the namespaces `selector` selects, sorted. As in OCM: an empty selector (no
/// `include` and no label selector) selects none; with a label selector and no `include`,
/// every labelled match is included; `exclude` then removes names. Globs are Go's
/// `filepath.Match` patterns (`*`, `?`, `[a-z]`, `[^a]`, `\` escapes).
///
/// Errors with the offending pattern or requirement when one is malformed.
pub fn select_namespaces(
    selector: &NamespaceSelector,
    namespaces: &[NamespaceInfo],
) -> Result<Vec<String>, SelectorError> {
    if selector.is_empty() {
        return Ok(Vec::new());
    }
    for (field, patterns) in [
        ("include", &selector.include),
        ("exclude", &selector.exclude),
    ] {
        for pattern in patterns {
            glob_match(pattern, "").map_err(|problem| SelectorError::Pattern {
                field,
                pattern: pattern.clone(),
                problem,
            })?;
        }
    }
    let mut selected = Vec::new();
    for ns in namespaces.iter().filter(|ns| !ns.terminating) {
        if !labels_match(selector, &ns.labels)? {
            continue;
        }
        let included = selector.include.is_empty()
            || selector
                .include
                .iter()
                .any(|p| glob_match(p, &ns.name).unwrap_or(false));
        let excluded = selector
            .exclude
            .iter()
            .any(|p| glob_match(p, &ns.name).unwrap_or(false));
        if included && !excluded {
            selected.push(ns.name.clone());
        }
    }
    selected.sort();
    Ok(selected)
}

fn labels_match(
    selector: &NamespaceSelector,
    labels: &BTreeMap<String, String>,
) -> Result<bool, SelectorError> {
    if let Some(match_labels) = &selector.match_labels
        && !match_labels.iter().all(|(k, v)| labels.get(k) == Some(v))
    {
        return Ok(false);
    }
    for requirement in selector.match_expressions.iter().flatten() {
        if !requirement_matches(requirement, labels)? {
            return Ok(false);
        }
    }
    Ok(true)
}

fn requirement_matches(
    requirement: &LabelSelectorRequirement,
    labels: &BTreeMap<String, String>,
) -> Result<bool, SelectorError> {
    let value = labels.get(&requirement.key);
    let values = requirement.values.as_deref().unwrap_or_default();
    match requirement.operator.as_str() {
        "In" => Ok(value.is_some_and(|v| values.contains(v))),
        "NotIn" => Ok(value.is_none_or(|v| !values.contains(v))),
        "Exists" => Ok(value.is_some()),
        "DoesNotExist" => Ok(value.is_none()),
        other => Err(SelectorError::Operator {
            key: requirement.key.clone(),
            operator: other.to_string(),
        }),
    }
}

/// Go's `filepath.Match` on a name: `*` any run of characters but `/`, `?` one such
/// character, `[...]` a class (ranges, `^` to negate), `\` escapes. Errors on a malformed
/// class or a trailing `\`.
pub fn glob_match(pattern: &str, name: &str) -> Result<bool, GlobError> {
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    // Check the whole pattern's syntax once, so a bad pattern fails whatever the name.
    let mut i = 0;
    while i < p.len() {
        match p[i] {
            '\\' => {
                if i + 1 >= p.len() {
                    return Err(GlobError::TrailingEscape);
                }
                i += 2;
            }
            '[' => i = class_end(&p, i)?,
            _ => i += 1,
        }
    }
    Ok(match_from(&p, 0, &n, 0))
}

/// Index just past the class opening at `start`.
fn class_end(p: &[char], start: usize) -> Result<usize, GlobError> {
    let mut i = start + 1;
    if i < p.len() && p[i] == '^' {
        i += 1;
    }
    let mut first = true;
    loop {
        if i >= p.len() {
            return Err(GlobError::UnclosedClass);
        }
        if p[i] == ']' && !first {
            return Ok(i + 1);
        }
        if p[i] == ']' {
            // `[]` is malformed in Go.
            return Err(GlobError::EmptyClass);
        }
        first = false;
        if p[i] == '\\' {
            i += 1;
        }
        if i + 2 < p.len() && p[i + 1] == '-' && p[i + 2] != ']' {
            i += 2;
        }
        i += 1;
    }
}

fn match_from(p: &[char], pi: usize, n: &[char], ni: usize) -> bool {
    if pi == p.len() {
        return ni == n.len();
    }
    match p[pi] {
        '*' => (ni..=n.len())
            .take_while(|&k| k == ni || n[k - 1] != '/')
            .any(|k| match_from(p, pi + 1, n, k)),
        '?' => ni < n.len() && n[ni] != '/' && match_from(p, pi + 1, n, ni + 1),
        '[' => {
            let Ok(end) = class_end(p, pi) else {
                return false;
            };
            ni < n.len()
                && n[ni] != '/'
                && class_matches(&p[pi + 1..end - 1], n[ni])
                && match_from(p, end, n, ni + 1)
        }
        '\\' => ni < n.len() && p[pi + 1] == n[ni] && match_from(p, pi + 2, n, ni + 1),
        c => ni < n.len() && c == n[ni] && match_from(p, pi + 1, n, ni + 1),
    }
}

fn class_matches(class: &[char], c: char) -> bool {
    let (negated, class) = match class.first() {
        Some('^') => (true, &class[1..]),
        _ => (false, class),
    };
    let mut i = 0;
    let mut matched = false;
    while i < class.len() {
        let mut lo = class[i];
        if lo == '\\' && i + 1 < class.len() {
            i += 1;
            lo = class[i];
        }
        let mut hi = lo;
        if i + 2 < class.len() && class[i + 1] == '-' {
            hi = class[i + 2];
            i += 2;
        }
        if lo <= c && c <= hi {
            matched = true;
        }
        i += 1;
    }
    matched != negated
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns(name: &str, labels: &[(&str, &str)]) -> NamespaceInfo {
        NamespaceInfo {
            name: name.to_string(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            terminating: false,
        }
    }

    fn cluster() -> Vec<NamespaceInfo> {
        vec![
            ns("default", &[]),
            ns("kube-system", &[]),
            ns("app-web", &[("env", "prod")]),
            ns("app-api", &[("env", "prod")]),
            ns("app-test", &[("env", "test")]),
            NamespaceInfo {
                terminating: true,
                ..ns("app-old", &[])
            },
        ]
    }

    #[test]
    fn globs_behave_like_go_filepath_match() {
        let cases = [
            ("app-*", "app-web", true),
            ("app-*", "app", false),
            ("app-?", "app-a", true),
            ("app-?", "app-ab", false),
            ("*", "default", true),
            ("[a-c]*", "beta", true),
            ("[^a-c]*", "beta", false),
            ("kube-\\*", "kube-*", true),
            ("default", "default", true),
            ("default", "default2", false),
        ];
        for (pattern, name, expected) in cases {
            assert_eq!(
                glob_match(pattern, name),
                Ok(expected),
                "{pattern} on {name}"
            );
        }
        assert!(glob_match("app-[", "app-x").is_err());
        assert!(glob_match("app-\\", "app-x").is_err());
    }

    #[test]
    fn include_and_exclude_select_by_name() {
        let selector = NamespaceSelector {
            include: vec!["app-*".to_string()],
            exclude: vec!["app-test".to_string()],
            ..Default::default()
        };
        // The terminating app-old is skipped; the result is sorted.
        assert_eq!(
            select_namespaces(&selector, &cluster()).unwrap(),
            vec!["app-api", "app-web"]
        );
    }

    #[test]
    fn an_empty_selector_selects_nothing() {
        assert_eq!(
            select_namespaces(&NamespaceSelector::default(), &cluster()).unwrap(),
            Vec::<String>::new()
        );
    }

    #[test]
    fn labels_select_without_include() {
        let selector = NamespaceSelector {
            match_labels: Some([("env".to_string(), "prod".to_string())].into()),
            ..Default::default()
        };
        assert_eq!(
            select_namespaces(&selector, &cluster()).unwrap(),
            vec!["app-api", "app-web"]
        );
        let selector = NamespaceSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "env".to_string(),
                operator: "NotIn".to_string(),
                values: Some(vec!["prod".to_string()]),
            }]),
            exclude: vec!["kube-*".to_string()],
            ..Default::default()
        };
        assert_eq!(
            select_namespaces(&selector, &cluster()).unwrap(),
            vec!["app-test", "default"]
        );
    }

    #[test]
    fn a_malformed_pattern_is_named() {
        let selector = NamespaceSelector {
            include: vec!["app-[".to_string()],
            ..Default::default()
        };
        assert_eq!(
            select_namespaces(&selector, &cluster())
                .unwrap_err()
                .to_string(),
            "include pattern \"app-[\" has an unclosed ["
        );
    }
}
