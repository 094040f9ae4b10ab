//! Kubernetes label selectors (`matchLabels`, `matchExpressions` with `In`, `NotIn`, `Exists`,
//! `DoesNotExist`), compiled once per placement and matched against a cluster's labels or its
//! claims. The semantics are apimachinery's: requirements are ANDed, an empty selector matches
//! everything, and `NotIn` / `DoesNotExist` match a cluster without the key.
//!
//! A selector matches one map ([`Selector::matches_map`]) or, through a [`LabelIndex`] of every
//! cluster's labels (or claims), a whole set of clusters at once ([`Selector::matching`]): the
//! clusters holding each key and value are looked up, not each cluster's map visited.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::fleet::{Bits, ClusterId};

use flotilla_proto::api::ClusterClaimSelector;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};

/// A compiled selector.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Selector {
    requirements: Vec<Requirement>,
    /// `labels.Nothing()`: the selector of a set whose label selector is absent.
    nothing: bool,
}

#[derive(Clone, Debug, PartialEq)]
struct Requirement {
    key: String,
    op: Op,
}

#[derive(Clone, Debug, PartialEq)]
enum Op {
    In(BTreeSet<String>),
    NotIn(BTreeSet<String>),
    Exists,
    DoesNotExist,
}

impl Selector {
    /// Matches every object.
    pub fn everything() -> Selector {
        Selector::default()
    }

    /// Matches no object (apimachinery's conversion of a nil selector).
    pub fn nothing() -> Selector {
        Selector {
            requirements: Vec::new(),
            nothing: true,
        }
    }

    /// Compiles a label selector; the error names the bad requirement.
    pub fn from_labels(selector: &LabelSelector) -> Result<Selector, String> {
        let mut requirements: Vec<Requirement> = selector
            .match_labels
            .iter()
            .flatten()
            .map(|(k, v)| Requirement {
                key: k.clone(),
                op: Op::In([v.clone()].into()),
            })
            .collect();
        for r in selector.match_expressions.iter().flatten() {
            requirements.push(requirement(r)?);
        }
        Ok(Selector {
            requirements,
            nothing: false,
        })
    }

    /// Compiles a claim selector: requirements whose keys are claim names.
    pub fn from_claims(selector: &ClusterClaimSelector) -> Result<Selector, String> {
        Ok(Selector {
            requirements: selector
                .match_expressions
                .iter()
                .map(requirement)
                .collect::<Result<_, _>>()?,
            nothing: false,
        })
    }

    /// Whether an object whose values are looked up by `get` matches.
    pub fn matches<'a>(&self, get: impl Fn(&str) -> Option<&'a str>) -> bool {
        !self.nothing
            && self
                .requirements
                .iter()
                .all(|r| match (&r.op, get(&r.key)) {
                    (Op::In(values), Some(v)) => values.contains(v),
                    (Op::In(_), None) => false,
                    (Op::NotIn(values), Some(v)) => !values.contains(v),
                    (Op::NotIn(_), None) => true,
                    (Op::Exists, found) => found.is_some(),
                    (Op::DoesNotExist, found) => found.is_none(),
                })
    }

    /// Whether a map of labels (or claims) matches.
    pub fn matches_map(&self, map: &BTreeMap<String, String>) -> bool {
        self.matches(|k| map.get(k).map(String::as_str))
    }

    /// The keys this selector reads, for knowing which changes can affect it.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.requirements.iter().map(|r| r.key.as_str())
    }

    /// The clusters of `within` whose maps, as `index` holds them, match: for every cluster
    /// of `within`, the same answer as [`Selector::matches_map`] on its map.
    pub fn matching(&self, within: &Bits, index: &LabelIndex) -> Bits {
        if self.nothing {
            return Bits::default();
        }
        let mut out = within.clone();
        for r in &self.requirements {
            match &r.op {
                Op::In(values) => out.intersect(&index.holding(&r.key, Some(values))),
                Op::NotIn(values) => out.subtract(&index.holding(&r.key, Some(values))),
                Op::Exists => out.intersect(&index.holding(&r.key, None)),
                Op::DoesNotExist => out.subtract(&index.holding(&r.key, None)),
            }
        }
        out
    }
}

/// Every cluster's labels (or claims), inverted: for each key, for each of its values, the
/// clusters that hold it. Memory follows the labels held (an entry per cluster and label),
/// not the fleet's size times the distinct values.
#[derive(Debug, Default)]
pub struct LabelIndex {
    keys: HashMap<String, HashMap<String, HashSet<ClusterId>>>,
}

impl LabelIndex {
    /// Cluster `id` now holds `map`, where it held `before`.
    pub fn update(
        &mut self,
        id: ClusterId,
        before: Option<&BTreeMap<String, String>>,
        map: Option<&BTreeMap<String, String>>,
    ) {
        if before == map {
            return;
        }
        for (k, v) in before.into_iter().flatten() {
            if map.and_then(|m| m.get(k)) == Some(v) {
                continue;
            }
            let Some(values) = self.keys.get_mut(k) else {
                continue;
            };
            if let Some(ids) = values.get_mut(v) {
                ids.remove(&id);
                if ids.is_empty() {
                    values.remove(v);
                }
            }
            if values.is_empty() {
                self.keys.remove(k);
            }
        }
        for (k, v) in map.into_iter().flatten() {
            if before.and_then(|m| m.get(k)) == Some(v) {
                continue;
            }
            self.keys
                .entry(k.clone())
                .or_default()
                .entry(v.clone())
                .or_default()
                .insert(id);
        }
    }

    /// Bytes held, roughly: each key and value with an allocation's overhead, a hash slot per
    /// cluster holding it.
    pub fn approximate_bytes(&self) -> usize {
        self.keys
            .iter()
            .map(|(k, values)| {
                k.len()
                    + 48
                    + values
                        .iter()
                        .map(|(v, ids)| v.len() + 48 + ids.capacity() * 16)
                        .sum::<usize>()
            })
            .sum()
    }

    /// The clusters holding `key` with one of `values`, or with any value when `None`.
    fn holding(&self, key: &str, values: Option<&BTreeSet<String>>) -> Bits {
        let mut out = Bits::default();
        let Some(by_value) = self.keys.get(key) else {
            return out;
        };
        let sets: Vec<&HashSet<ClusterId>> = match values {
            Some(values) => values.iter().filter_map(|v| by_value.get(v)).collect(),
            None => by_value.values().collect(),
        };
        for id in sets.into_iter().flatten() {
            out.set(*id, true);
        }
        out
    }
}

fn requirement(r: &LabelSelectorRequirement) -> Result<Requirement, String> {
    let values: BTreeSet<String> = r.values.iter().flatten().cloned().collect();
    if r.key.is_empty() {
        return Err("a selector requirement has an empty key".to_string());
    }
    let op = match r.operator.as_str() {
        "In" | "NotIn" if values.is_empty() => {
            return Err(format!(
                "requirement on {:?}: operator {} needs at least one value",
                r.key, r.operator
            ));
        }
        "In" => Op::In(values),
        "NotIn" => Op::NotIn(values),
        "Exists" | "DoesNotExist" if !values.is_empty() => {
            return Err(format!(
                "requirement on {:?}: operator {} takes no values",
                r.key, r.operator
            ));
        }
        "Exists" => Op::Exists,
        "DoesNotExist" => Op::DoesNotExist,
        other => {
            return Err(format!(
                "requirement on {:?}: operator {other:?} is not one of In, NotIn, Exists, DoesNotExist",
                r.key
            ));
        }
    };
    Ok(Requirement {
        key: r.key.clone(),
        op,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn expr(key: &str, op: &str, values: &[&str]) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: (!values.is_empty()).then(|| values.iter().map(|v| v.to_string()).collect()),
        }
    }

    fn check(selector: LabelSelector, object: &[(&str, &str)], expected: bool) {
        let compiled = Selector::from_labels(&selector).unwrap();
        assert_eq!(
            compiled.matches_map(&labels(object)),
            expected,
            "{selector:?} on {object:?}"
        );
        // The same answer through the index, for a cluster among others that hold every
        // other combination of the keys.
        let mut index = LabelIndex::default();
        let mut within = Bits::default();
        let others = [
            labels(&[]),
            labels(&[("region", "eu"), ("tier", "gold"), ("gpu", "a100")]),
            labels(&[("region", "us")]),
        ];
        for (id, map) in others.iter().chain([&labels(object)]).enumerate() {
            index.update(id, None, Some(map));
            within.set(id, true);
        }
        let matched = compiled.matching(&within, &index);
        assert_eq!(
            matched.get(others.len()),
            expected,
            "{selector:?} on {object:?}, indexed"
        );
        for (id, map) in others.iter().enumerate() {
            assert_eq!(
                matched.get(id),
                compiled.matches_map(map),
                "{selector:?} on {map:?}, indexed"
            );
        }
        // A cluster whose labels change leaves the index as it was.
        index.update(
            others.len(),
            Some(&labels(object)),
            Some(&labels(&[("other", "x")])),
        );
        let again = compiled.matching(&within, &index);
        let bare = compiled.matches_map(&labels(&[("other", "x")]));
        assert_eq!(
            again.get(others.len()),
            bare,
            "{selector:?} after a change, indexed"
        );
    }

    #[test]
    fn matches_like_apimachinery() {
        let by_labels = |pairs: &[(&str, &str)]| LabelSelector {
            match_labels: Some(labels(pairs)),
            match_expressions: None,
        };
        let by_exprs = |exprs: Vec<LabelSelectorRequirement>| LabelSelector {
            match_labels: None,
            match_expressions: Some(exprs),
        };
        check(LabelSelector::default(), &[], true);
        check(by_labels(&[("region", "eu")]), &[("region", "eu")], true);
        check(by_labels(&[("region", "eu")]), &[("region", "us")], false);
        check(by_labels(&[("region", "eu")]), &[], false);
        check(
            by_labels(&[("region", "eu"), ("tier", "gold")]),
            &[("region", "eu")],
            false,
        );
        check(
            by_exprs(vec![expr("region", "In", &["eu", "us"])]),
            &[("region", "us")],
            true,
        );
        check(by_exprs(vec![expr("region", "NotIn", &["eu"])]), &[], true);
        check(
            by_exprs(vec![expr("region", "NotIn", &["eu"])]),
            &[("region", "eu")],
            false,
        );
        check(
            by_exprs(vec![expr("gpu", "Exists", &[])]),
            &[("gpu", "")],
            true,
        );
        check(
            by_exprs(vec![expr("gpu", "DoesNotExist", &[])]),
            &[("gpu", "a100")],
            false,
        );
        assert!(!Selector::nothing().matches_map(&labels(&[])));
    }

    #[test]
    fn bad_requirements_are_named() {
        for (r, message) in [
            (
                expr("region", "In", &[]),
                "operator In needs at least one value",
            ),
            (
                expr("gpu", "Exists", &["x"]),
                "operator Exists takes no values",
            ),
            (
                expr("region", "Equals", &["eu"]),
                "\"Equals\" is not one of",
            ),
            (expr("", "Exists", &[]), "empty key"),
        ] {
            let err = Selector::from_labels(&LabelSelector {
                match_labels: None,
                match_expressions: Some(vec![r]),
            })
            .unwrap_err();
            assert!(err.contains(message), "{err}");
        }
    }
}
