//! Which objects of a kind a list or watch reads: all of them, or those whose one label has one
//! of a set of values (`key in (a,b,c)`), the only selection the gateways' shard caches need.
//!
//! A selected watch follows the apiserver's rules: an object that comes to match is `Added`,
//! one that stops matching is `Deleted` (carrying the labels it last matched with), and objects that
//! neither matched before nor match now are never mentioned.

use std::collections::BTreeSet;
use std::fmt;

use serde_json::Value;

use crate::Object;

/// The objects a list or watch reads.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum Selection {
    /// Every object of the kind.
    #[default]
    Everything,
    /// Objects whose label `key` has one of `values`; none when `values` is empty.
    LabelIn {
        key: String,
        values: BTreeSet<String>,
    },
}

impl Selection {
    /// Objects whose label `key` has one of `values`.
    pub fn label_in(
        key: impl Into<String>,
        values: impl IntoIterator<Item = impl Into<String>>,
    ) -> Selection {
        Selection::LabelIn {
            key: key.into(),
            values: values.into_iter().map(Into::into).collect(),
        }
    }

    /// Whether `object` (its `metadata.labels`) is selected.
    pub fn matches(&self, object: &Object) -> bool {
        match self {
            Selection::Everything => true,
            Selection::LabelIn { key, values } => {
                label(object, key).is_some_and(|v| values.contains(v))
            }
        }
    }

    /// The apiserver's `labelSelector` for this selection; `None` for everything. An empty set
    /// of values becomes `key,!key` (has the label and has it not), which matches nothing:
    /// `key in ()` is not valid selector syntax.
    pub fn label_selector(&self) -> Option<String> {
        match self {
            Selection::Everything => None,
            Selection::LabelIn { key, values } if values.is_empty() => {
                Some(format!("{key},!{key}"))
            }
            Selection::LabelIn { key, values } => Some(format!(
                "{key} in ({})",
                values.iter().cloned().collect::<Vec<_>>().join(",")
            )),
        }
    }
}

impl fmt::Display for Selection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Selection::Everything => f.write_str("everything"),
            Selection::LabelIn { key, values } => write!(
                f,
                "{key} in ({})",
                values.iter().cloned().collect::<Vec<_>>().join(",")
            ),
        }
    }
}

/// `metadata.labels[key]`, if set.
pub fn label<'a>(object: &'a Object, key: &str) -> Option<&'a str> {
    object
        .get("metadata")?
        .get("labels")?
        .get(key)
        .and_then(Value::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn labelled(value: Option<&str>) -> Object {
        match value {
            Some(v) => json!({"metadata": {"name": "a", "labels": {"flotilla.io/shard": v}}}),
            None => json!({"metadata": {"name": "a"}}),
        }
    }

    #[test]
    fn matches_and_selectors() {
        let some = Selection::label_in("flotilla.io/shard", ["01", "03"]);
        assert!(some.matches(&labelled(Some("03"))));
        assert!(!some.matches(&labelled(Some("02"))));
        assert!(!some.matches(&labelled(None)), "unlabelled is not selected");
        assert!(Selection::Everything.matches(&labelled(None)));
        assert_eq!(
            some.label_selector().as_deref(),
            Some("flotilla.io/shard in (01,03)")
        );
        let none = Selection::label_in("flotilla.io/shard", Vec::<String>::new());
        assert!(!none.matches(&labelled(Some("01"))));
        assert_eq!(
            none.label_selector().as_deref(),
            Some("flotilla.io/shard,!flotilla.io/shard")
        );
        assert_eq!(Selection::Everything.label_selector(), None);
    }
}
