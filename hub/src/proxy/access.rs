//! Who may reach which clusters through the proxy front: access rules, read from a YAML file
//! (`--proxy-access-rules`) when the hub starts.
//!
//! ```yaml
//! rules:
//!   - name: ops-everywhere        # named in refusals and in the audit
//!     groups: [ops]                # any of these groups, or
//!     users: [alice]               # any of these users
//!     clusters:
//!       names: [store-0042]        # these clusters, and/or
//!       selector:                  # clusters whose ManagedCluster labels match
//!         matchLabels: {env: prod}
//!     access: full                 # or readOnly
//! ```
//!
//! Nothing is allowed unless a rule allows it; rules add up, and full access wins over
//! read-only. Read-only lets through what cannot change a cluster: `get`, `list` and `watch`
//! (`GET` and `HEAD` requests), and the self-reviews `kubectl auth can-i` and `kubectl auth
//! whoami` create; never an upgrade (exec, attach, port-forward). The spoke's RBAC still
//! decides everything a rule lets through.

use std::collections::BTreeMap;
use std::path::Path;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde::Deserialize;

/// The access rules file.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessRules {
    #[serde(default)]
    pub rules: Vec<AccessRule>,
}

/// One rule: these users and groups reach these clusters with this access.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessRule {
    pub name: String,
    #[serde(default)]
    pub users: Vec<String>,
    #[serde(default)]
    pub groups: Vec<String>,
    pub clusters: ClusterMatch,
    pub access: Access,
}

/// Which clusters a rule covers: by name, by ManagedCluster labels, or both (either matches).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterMatch {
    #[serde(default)]
    pub names: Vec<String>,
    #[serde(default)]
    pub selector: Option<LabelSelector>,
}

/// What a rule lets through.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "camelCase")]
pub enum Access {
    /// Reads only (see the module doc).
    ReadOnly,
    /// Anything the spoke's RBAC allows the user.
    Full,
}

/// Why the rules file cannot be used. Not retryable: fix the file and restart the hub.
#[derive(Debug, thiserror::Error)]
pub enum AccessRulesError {
    #[error("cannot read the access rules {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("access rules {path}: {detail}")]
    Invalid { path: String, detail: String },
}

/// The outcome for one request's user and cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Allowed with this access, by the named rule.
    Allowed { access: Access, rule: String },
    /// No rule covers the user for the cluster.
    Denied,
}

impl AccessRules {
    /// Reads and checks the rules file.
    pub fn load(path: &Path) -> Result<AccessRules, AccessRulesError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| AccessRulesError::Read {
            path: shown.clone(),
            source,
        })?;
        AccessRules::parse(&text).map_err(|detail| AccessRulesError::Invalid {
            path: shown,
            detail,
        })
    }

    /// Parses rules from YAML, with an error naming the rule and the problem.
    pub fn parse(text: &str) -> Result<AccessRules, String> {
        let rules: AccessRules = yaml_serde::from_str(text).map_err(|e| e.to_string())?;
        for (i, rule) in rules.rules.iter().enumerate() {
            let which = format!("rule #{} ({:?})", i + 1, rule.name);
            if rule.users.is_empty() && rule.groups.is_empty() {
                return Err(format!("{which} names no users and no groups"));
            }
            if rule.clusters.names.is_empty() && rule.clusters.selector.is_none() {
                return Err(format!(
                    "{which} names no clusters: give clusters.names or clusters.selector"
                ));
            }
            if let Some(selector) = &rule.clusters.selector {
                for req in selector.match_expressions.iter().flatten() {
                    if !matches!(
                        req.operator.as_str(),
                        "In" | "NotIn" | "Exists" | "DoesNotExist"
                    ) {
                        return Err(format!(
                            "{which}: selector operator {:?} is not one of In, NotIn, Exists, DoesNotExist",
                            req.operator
                        ));
                    }
                }
            }
        }
        Ok(rules)
    }

    /// Whether any rule could need the cluster's labels for this user (then the caller reads
    /// them; otherwise it need not).
    pub fn needs_labels(&self, user: &str, groups: &[String]) -> bool {
        self.rules.iter().any(|r| {
            r.clusters
                .selector
                .as_ref()
                .is_some_and(|s| !selects_everything(s))
                && r.covers(user, groups)
        })
    }

    /// The widest access any rule gives `user` (in `groups`) to `cluster` with `labels`.
    pub fn decide(
        &self,
        user: &str,
        groups: &[String],
        cluster: &str,
        labels: &BTreeMap<String, String>,
    ) -> Decision {
        self.rules
            .iter()
            .filter(|r| r.covers(user, groups) && r.clusters.matches(cluster, labels))
            .max_by_key(|r| r.access)
            .map_or(Decision::Denied, |r| Decision::Allowed {
                access: r.access,
                rule: r.name.clone(),
            })
    }
}

impl AccessRule {
    fn covers(&self, user: &str, groups: &[String]) -> bool {
        self.users.iter().any(|u| u == user) || self.groups.iter().any(|g| groups.contains(g))
    }
}

impl ClusterMatch {
    fn matches(&self, cluster: &str, labels: &BTreeMap<String, String>) -> bool {
        self.names.iter().any(|n| n == cluster)
            || self.selector.as_ref().is_some_and(|s| selects(s, labels))
    }
}

/// An empty selector (`selector: {}`): every cluster, whatever its labels.
fn selects_everything(selector: &LabelSelector) -> bool {
    selector.match_labels.as_ref().is_none_or(|m| m.is_empty())
        && selector
            .match_expressions
            .as_ref()
            .is_none_or(|e| e.is_empty())
}

/// Kubernetes label-selector semantics: every matchLabels pair and every requirement holds.
/// An empty selector selects every cluster.
pub fn selects(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let pairs = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let requirements = selector.match_expressions.iter().flatten().all(|req| {
        let value = labels.get(&req.key);
        let values = req.values.as_deref().unwrap_or_default();
        match req.operator.as_str() {
            "In" => value.is_some_and(|v| values.contains(v)),
            "NotIn" => value.is_none_or(|v| !values.contains(v)),
            "Exists" => value.is_some(),
            "DoesNotExist" => value.is_none(),
            _ => false,
        }
    });
    pairs && requirements
}

/// Whether a request only reads: a `GET` or `HEAD` (Kubernetes' `get`, `list` and `watch`),
/// or a `POST` of one of the self-reviews that answer "what may I do" (`kubectl auth can-i`,
/// `auth whoami`). Decided on the method itself, not on the audit's verb, which names other
/// methods by their own name (a method `get` is not a `GET`). Upgrades never are: exec, attach
/// and port-forward act on the cluster.
pub fn is_read_only(method: &http::Method, path: &str, upgrade: bool) -> bool {
    if upgrade {
        return false;
    }
    match *method {
        http::Method::GET | http::Method::HEAD => true,
        http::Method::POST => {
            let resource = path.trim_end_matches('/').rsplit('/').next().unwrap_or("");
            matches!(
                resource,
                "selfsubjectaccessreviews" | "selfsubjectrulesreviews" | "selfsubjectreviews"
            )
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: &str = r#"
rules:
  - name: ops-prod
    groups: [ops]
    clusters:
      selector:
        matchLabels: {env: prod}
        matchExpressions:
          - {key: region, operator: NotIn, values: [eu]}
    access: full
  - name: alice-reads-store-1
    users: [alice]
    clusters: {names: [store-1]}
    access: readOnly
  - name: alice-owns-store-2
    users: [alice]
    clusters: {names: [store-2]}
    access: full
"#;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn check(user: &str, groups: &[&str], cluster: &str, l: &[(&str, &str)], want: Option<Access>) {
        let rules = AccessRules::parse(RULES).unwrap();
        let groups: Vec<String> = groups.iter().map(|g| g.to_string()).collect();
        let got = match rules.decide(user, &groups, cluster, &labels(l)) {
            Decision::Allowed { access, .. } => Some(access),
            Decision::Denied => None,
        };
        assert_eq!(got, want, "{user} {groups:?} -> {cluster} {l:?}");
    }

    #[test]
    fn rules_match_users_groups_names_and_labels() {
        check(
            "bob",
            &["ops"],
            "store-9",
            &[("env", "prod")],
            Some(Access::Full),
        );
        check(
            "bob",
            &["ops"],
            "store-9",
            &[("env", "prod"), ("region", "eu")],
            None,
        );
        check("bob", &["ops"], "store-9", &[("env", "dev")], None);
        check("bob", &["dev"], "store-9", &[("env", "prod")], None);
        check("alice", &[], "store-1", &[], Some(Access::ReadOnly));
        check("alice", &[], "store-2", &[], Some(Access::Full));
        check("alice", &[], "store-3", &[], None);
        // Rules add up: a group's full access beats a user's read-only one.
        check(
            "alice",
            &["ops"],
            "store-1",
            &[("env", "prod")],
            Some(Access::Full),
        );
    }

    #[test]
    fn labels_are_read_only_when_a_selector_needs_them() {
        let rules = AccessRules::parse(RULES).unwrap();
        assert!(rules.needs_labels("bob", &["ops".into()]));
        assert!(!rules.needs_labels("alice", &[]));
        let everything = AccessRules::parse(
            "rules:\n- {name: all, groups: [ops], clusters: {selector: {}}, access: full}",
        )
        .unwrap();
        assert!(!everything.needs_labels("bob", &["ops".into()]));
        assert_eq!(
            everything.decide("bob", &["ops".into()], "any", &BTreeMap::new()),
            Decision::Allowed {
                access: Access::Full,
                rule: "all".into()
            }
        );
    }

    #[test]
    fn bad_rules_are_named() {
        for (text, want) in [
            (
                "rules:\n- {name: r, clusters: {names: [a]}, access: full}",
                "rule #1 (\"r\") names no users",
            ),
            (
                "rules:\n- {name: r, users: [a], clusters: {}, access: full}",
                "names no clusters",
            ),
            (
                "rules:\n- {name: r, users: [a], clusters: {names: [a]}, access: admin}",
                "unknown variant",
            ),
            (
                "rules:\n- {name: r, users: [a], clusters: {selector: {matchExpressions: [{key: k, operator: Gt}]}}, access: full}",
                "operator \"Gt\"",
            ),
        ] {
            let err = AccessRules::parse(text).unwrap_err();
            assert!(err.contains(want), "{text}: {err}");
        }
    }

    #[test]
    fn read_only_lets_reads_and_self_reviews_through() {
        use http::Method;
        assert!(is_read_only(&Method::GET, "/api/v1/namespaces", false));
        assert!(is_read_only(&Method::HEAD, "/api/v1/pods", false));
        assert!(is_read_only(
            &Method::POST,
            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
            false
        ));
        assert!(!is_read_only(
            &Method::POST,
            "/api/v1/namespaces/default/configmaps",
            false
        ));
        assert!(!is_read_only(
            &Method::PATCH,
            "/api/v1/namespaces/default/configmaps/x",
            false
        ));
        assert!(!is_read_only(
            &Method::GET,
            "/api/v1/namespaces/default/pods/p/exec",
            true
        ));
    }

    /// Methods are case-sensitive: one spelled like a read verb is not a read.
    #[test]
    fn a_method_named_like_a_read_verb_is_not_a_read() {
        for name in ["get", "list", "watch", "create", "Get"] {
            let method = http::Method::from_bytes(name.as_bytes()).unwrap();
            assert!(
                !is_read_only(
                    &method,
                    "/apis/authorization.k8s.io/v1/selfsubjectreviews",
                    false
                ),
                "{name}"
            );
            assert!(!is_read_only(
                &method,
                "/api/v1/namespaces/default/configmaps",
                false
            ));
        }
    }
}
