//! Tables the CLI prints, in kubectl's manner: upper-case headers, columns padded by three
//! spaces, `<none>` for missing values, ages like `5m`.

use flotilla_proto::api::{DECISION_GROUP_INDEX_LABEL, DECISION_GROUP_NAME_LABEL, PLACEMENT_LABEL};
use jiff::Timestamp;
use serde_json::Value;

/// `flotilla get clusters`: the columns of `kubectl get managedclusters` for OCM's CRD.
pub fn clusters(items: &[Value], now: Timestamp) -> String {
    let mut rows = vec![vec![
        "NAME".to_string(),
        "HUB ACCEPTED".into(),
        "JOINED".into(),
        "AVAILABLE".into(),
        "KUBERNETES".into(),
        "AGE".into(),
    ]];
    for mc in items {
        let condition = |t: &str| condition_status(mc, t);
        rows.push(vec![
            mc["metadata"]["name"]
                .as_str()
                .unwrap_or("<none>")
                .to_string(),
            mc["spec"]["hubAcceptsClient"]
                .as_bool()
                .unwrap_or(false)
                .to_string(),
            condition("ManagedClusterJoined"),
            condition("ManagedClusterConditionAvailable"),
            mc["status"]["version"]["kubernetes"]
                .as_str()
                .unwrap_or("")
                .to_string(),
            age(mc["metadata"]["creationTimestamp"].as_str(), now),
        ]);
    }
    render(&rows)
}

/// `flotilla get works`: each ManifestWork's state per OCM's work-level conditions.
pub fn works(items: &[Value], now: Timestamp) -> String {
    let mut rows = vec![vec![
        "CLUSTER".to_string(),
        "NAME".into(),
        "MANIFESTS".into(),
        "APPLIED".into(),
        "AVAILABLE".into(),
        "DEGRADED".into(),
        "AGE".into(),
    ]];
    for mw in items {
        let condition = |t: &str| condition_status(mw, t);
        rows.push(vec![
            mw["metadata"]["namespace"]
                .as_str()
                .unwrap_or("<none>")
                .to_string(),
            mw["metadata"]["name"]
                .as_str()
                .unwrap_or("<none>")
                .to_string(),
            mw["spec"]["workload"]["manifests"]
                .as_array()
                .map_or(0, Vec::len)
                .to_string(),
            condition("Applied"),
            condition("Available"),
            condition("Degraded"),
            age(mw["metadata"]["creationTimestamp"].as_str(), now),
        ]);
    }
    render(&rows)
}

/// `flotilla get placements`: each Placement's state (OCM's `PlacementSatisfied` condition),
/// how many clusters it selected and which (from its PlacementDecisions).
pub fn placements(items: &[Value], decisions: &[Value], now: Timestamp) -> String {
    let mut rows = vec![vec![
        "NAMESPACE".to_string(),
        "NAME".into(),
        "SUCCEEDED".into(),
        "REASON".into(),
        "SELECTED".into(),
        "CLUSTERS".into(),
        "AGE".into(),
    ]];
    for p in items {
        let ns = p["metadata"]["namespace"].as_str().unwrap_or("<none>");
        let name = p["metadata"]["name"].as_str().unwrap_or("<none>");
        let satisfied = p["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == "PlacementSatisfied"));
        let clusters: Vec<&str> = decisions
            .iter()
            .filter(|d| {
                d["metadata"]["namespace"].as_str() == Some(ns)
                    && d["metadata"]["labels"][PLACEMENT_LABEL].as_str() == Some(name)
            })
            .flat_map(|d| d["status"]["decisions"].as_array().into_iter().flatten())
            .filter_map(|c| c["clusterName"].as_str())
            .collect();
        rows.push(vec![
            ns.to_string(),
            name.to_string(),
            satisfied
                .and_then(|c| c["status"].as_str())
                .unwrap_or("")
                .to_string(),
            satisfied
                .and_then(|c| c["reason"].as_str())
                .unwrap_or("")
                .to_string(),
            p["status"]["numberOfSelectedClusters"]
                .as_i64()
                .unwrap_or(0)
                .to_string(),
            some_names(&clusters),
            age(p["metadata"]["creationTimestamp"].as_str(), now),
        ]);
    }
    render(&rows)
}

/// `flotilla get placementdecisions`: each object's placement, decision group and clusters.
pub fn placement_decisions(items: &[Value], now: Timestamp) -> String {
    let mut rows = vec![vec![
        "NAMESPACE".to_string(),
        "NAME".into(),
        "PLACEMENT".into(),
        "GROUP".into(),
        "DECISIONS".into(),
        "CLUSTERS".into(),
        "AGE".into(),
    ]];
    for d in items {
        let labels = &d["metadata"]["labels"];
        let clusters: Vec<&str> = d["status"]["decisions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["clusterName"].as_str())
            .collect();
        let group = match (
            labels[DECISION_GROUP_INDEX_LABEL].as_str(),
            labels[DECISION_GROUP_NAME_LABEL]
                .as_str()
                .filter(|n| !n.is_empty()),
        ) {
            (Some(i), Some(n)) => format!("{i} ({n})"),
            (Some(i), None) => i.to_string(),
            _ => "<none>".to_string(),
        };
        rows.push(vec![
            d["metadata"]["namespace"]
                .as_str()
                .unwrap_or("<none>")
                .to_string(),
            d["metadata"]["name"]
                .as_str()
                .unwrap_or("<none>")
                .to_string(),
            labels[PLACEMENT_LABEL]
                .as_str()
                .unwrap_or("<none>")
                .to_string(),
            group,
            clusters.len().to_string(),
            some_names(&clusters),
            age(d["metadata"]["creationTimestamp"].as_str(), now),
        ]);
    }
    render(&rows)
}

/// `flotilla get manifestworkreplicasets`: what each rollout reached and where it stands
/// (`PlacementRolledOut`'s reason: Complete, Progressing, MaxFailuresExceeded).
pub fn replica_sets(items: &[Value], now: Timestamp) -> String {
    let mut rows = vec![vec![
        "NAMESPACE".to_string(),
        "NAME".into(),
        "PLACEMENTS".into(),
        "SELECTED".into(),
        "APPLIED".into(),
        "AVAILABLE".into(),
        "FAILED".into(),
        "ROLLOUT".into(),
        "AGE".into(),
    ]];
    for r in items {
        let summary = &r["status"]["summary"];
        let count = |f: &str| summary[f].as_i64().unwrap_or(0).to_string();
        let placements: Vec<&str> = r["spec"]["placementRefs"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["name"].as_str())
            .collect();
        let rollout = r["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == "PlacementRolledOut"))
            .and_then(|c| c["reason"].as_str())
            .unwrap_or("");
        let deleting = r["metadata"]["deletionTimestamp"].is_string();
        rows.push(vec![
            r["metadata"]["namespace"]
                .as_str()
                .unwrap_or("<none>")
                .to_string(),
            r["metadata"]["name"]
                .as_str()
                .unwrap_or("<none>")
                .to_string(),
            placements.join(","),
            summary["desiredTotal"]
                .as_i64()
                .or_else(|| summary["total"].as_i64())
                .unwrap_or(0)
                .to_string(),
            count("applied"),
            count("available"),
            count("degraded"),
            if deleting {
                "Deleting".to_string()
            } else {
                rollout.to_string()
            },
            age(r["metadata"]["creationTimestamp"].as_str(), now),
        ]);
    }
    render(&rows)
}

/// `flotilla get policies`: each root Policy's remediation, its aggregate compliance, and
/// how many of the clusters it reaches are non-compliant (`non-compliant/total`, the audit
/// question "how many clusters lack X" in one column).
pub fn policies(items: &[Value], now: Timestamp) -> String {
    let mut rows = vec![vec![
        "NAMESPACE".to_string(),
        "NAME".into(),
        "REMEDIATION".into(),
        "COMPLIANCE".into(),
        "CLUSTERS".into(),
        "AGE".into(),
    ]];
    for p in items {
        let clusters = p["status"]["status"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let non_compliant = clusters
            .iter()
            .filter(|c| c["compliant"] == "NonCompliant")
            .count();
        rows.push(vec![
            text_or_none(&p["metadata"]["namespace"]),
            text_or_none(&p["metadata"]["name"]),
            if p["spec"]["disabled"] == true {
                "disabled".to_string()
            } else {
                text_or_none(&p["spec"]["remediationAction"])
            },
            text_or_none(&p["status"]["compliant"]),
            format!("{non_compliant}/{}", clusters.len()),
            age(p["metadata"]["creationTimestamp"].as_str(), now),
        ]);
    }
    render(&rows)
}

/// `flotilla get configmaps`: `kubectl get configmaps`' columns (DATA counts the keys of
/// `data` and `binaryData`), with the namespace first, as `-A` shows it.
pub fn config_maps(items: &[Value], now: Timestamp) -> String {
    let mut rows = vec![vec![
        "NAMESPACE".to_string(),
        "NAME".into(),
        "DATA".into(),
        "AGE".into(),
    ]];
    for c in items {
        let keys = |field: &str| c[field].as_object().map_or(0, |m| m.len());
        rows.push(vec![
            text_or_none(&c["metadata"]["namespace"]),
            text_or_none(&c["metadata"]["name"]),
            (keys("data") + keys("binaryData")).to_string(),
            age(c["metadata"]["creationTimestamp"].as_str(), now),
        ]);
    }
    render(&rows)
}

/// Most clusters whose compliance records `flotilla describe policy` reads to show what they
/// violate: one request each, so a policy on 10,000 clusters costs 20 reads, not 10,000.
pub const MAX_EXPLAINED_CLUSTERS: usize = 20;

/// The clusters whose records explain a root Policy's compliance: the non-compliant ones, then
/// the pending ones, each by name, at most [`MAX_EXPLAINED_CLUSTERS`].
pub fn clusters_to_explain(p: &Value) -> Vec<String> {
    let clusters = p["status"]["status"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut names = Vec::new();
    for state in ["NonCompliant", "Pending"] {
        names.extend(
            clusters
                .iter()
                .filter(|c| c["compliant"] == state)
                .filter_map(|c| c["clustername"].as_str().map(str::to_owned)),
        );
    }
    names.truncate(MAX_EXPLAINED_CLUSTERS);
    names
}

/// `flotilla describe policy`: what the policy carries, what places it, each cluster's
/// compliance as far as the hub knows it, and what the clusters in `records` (their
/// ClusterCompliance objects, as [`clusters_to_explain`] picks them) report each template that
/// is not met violates: the latest message of its history.
pub fn describe_policy(p: &Value, records: &[Value], now: Timestamp) -> String {
    let mut out = String::new();
    let annotation = |key: &str| text_or_none(&p["metadata"]["annotations"][key]);
    let fields = [
        ("Name", text_or_none(&p["metadata"]["name"])),
        ("Namespace", text_or_none(&p["metadata"]["namespace"])),
        ("Remediation", text_or_none(&p["spec"]["remediationAction"])),
        ("Disabled", (p["spec"]["disabled"] == true).to_string()),
        ("Compliance", text_or_none(&p["status"]["compliant"])),
        (
            "Standards",
            annotation(flotilla_proto::api::policy::ANNOTATION_STANDARDS),
        ),
        (
            "Categories",
            annotation(flotilla_proto::api::policy::ANNOTATION_CATEGORIES),
        ),
        (
            "Controls",
            annotation(flotilla_proto::api::policy::ANNOTATION_CONTROLS),
        ),
        ("Age", age(p["metadata"]["creationTimestamp"].as_str(), now)),
    ];
    for (name, value) in fields {
        out.push_str(&format!("{:<12}{value}\n", format!("{name}:")));
    }
    out.push_str("Templates:\n");
    for template in p["spec"]["policy-templates"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let definition = &template["objectDefinition"];
        let spec = &definition["spec"];
        let mut about = Vec::new();
        for (label, value) in [
            ("severity", &spec["severity"]),
            ("remediation", &spec["remediationAction"]),
        ] {
            if let Some(v) = value.as_str() {
                about.push(format!("{label} {v}"));
            }
        }
        out.push_str(&format!(
            "  {} {}{}\n",
            text_or_none(&definition["kind"]),
            text_or_none(&definition["metadata"]["name"]),
            if about.is_empty() {
                String::new()
            } else {
                format!(" ({})", about.join(", "))
            }
        ));
        for object in spec["object-templates"].as_array().into_iter().flatten() {
            let o = &object["objectDefinition"];
            out.push_str(&format!(
                "    {} {} {} {}\n",
                text_or_none(&object["complianceType"]),
                text_or_none(&o["apiVersion"]),
                text_or_none(&o["kind"]),
                o["metadata"]["name"]
                    .as_str()
                    .unwrap_or("(matched by its fields)")
            ));
        }
    }
    out.push_str("Placement:\n");
    let placements = p["status"]["placement"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if placements.is_empty() {
        out.push_str("  <none>\n");
    } else {
        let mut rows = vec![vec![
            "BINDING".to_string(),
            "PLACEMENT".into(),
            "POLICYSET".into(),
        ]];
        for placement in &placements {
            rows.push(vec![
                text_or_none(&placement["placementBinding"]),
                text_or_none(&placement["placement"]),
                text_or_none(&placement["policySet"]),
            ]);
        }
        out.push_str(&indent(&render(&rows)));
    }
    let clusters = p["status"]["status"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let non_compliant = clusters
        .iter()
        .filter(|c| c["compliant"] == "NonCompliant")
        .count();
    out.push_str(&format!(
        "Clusters:   {} selected, {non_compliant} non-compliant\n",
        clusters.len()
    ));
    if !clusters.is_empty() {
        let mut rows = vec![vec!["CLUSTER".to_string(), "COMPLIANCE".into()]];
        for cluster in &clusters {
            rows.push(vec![
                text_or_none(&cluster["clustername"]),
                cluster["compliant"]
                    .as_str()
                    .unwrap_or("<not reported>")
                    .to_string(),
            ]);
        }
        out.push_str(&indent(&render(&rows)));
    }
    let explained = clusters_to_explain(p);
    if explained.is_empty() {
        return out;
    }
    out.push_str(
        "Violations:
",
    );
    let uid = p["metadata"]["uid"].as_str().unwrap_or_default();
    let mut rows = vec![vec![
        "CLUSTER".to_string(),
        "TEMPLATE".into(),
        "COMPLIANCE".into(),
        "MESSAGE".into(),
    ]];
    for record in records {
        let cluster = text_or_none(&record["metadata"]["name"]);
        let Some(entry) = record["status"]["policies"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| !uid.is_empty() && e["uid"] == uid)
        else {
            continue;
        };
        for template in entry["details"].as_array().into_iter().flatten() {
            if template["compliant"] == "Compliant" {
                continue;
            }
            rows.push(vec![
                cluster.clone(),
                text_or_none(&template["templateMeta"]["name"]),
                template["compliant"]
                    .as_str()
                    .unwrap_or("<not reported>")
                    .to_string(),
                text_or_none(&template["history"][0]["message"]),
            ]);
        }
    }
    if rows.len() == 1 {
        out.push_str("  <no template messages reported>\n");
    } else {
        out.push_str(&indent(&render(&rows)));
    }
    let failing = clusters
        .iter()
        .filter(|c| c["compliant"] == "NonCompliant" || c["compliant"] == "Pending")
        .count();
    if failing > explained.len() {
        out.push_str(&format!(
            "  ({} more non-compliant or pending clusters not shown)\n",
            failing - explained.len()
        ));
    }
    out
}

/// A string field, or `<none>`.
fn text_or_none(value: &Value) -> String {
    value
        .as_str()
        .filter(|s| !s.is_empty())
        .unwrap_or("<none>")
        .to_string()
}

/// Every line two spaces in.
fn indent(text: &str) -> String {
    text.lines().map(|l| format!("  {l}\n")).collect()
}

/// Up to three names, then how many more.
fn some_names(names: &[&str]) -> String {
    const SHOWN: usize = 3;
    if names.is_empty() {
        return "<none>".to_string();
    }
    let mut s = names
        .iter()
        .take(SHOWN)
        .copied()
        .collect::<Vec<_>>()
        .join(",");
    if names.len() > SHOWN {
        s.push_str(&format!(" +{} more", names.len() - SHOWN));
    }
    s
}

/// `flotilla token list`: bootstrap tokens by id (the secrets are never shown after creation).
pub fn tokens(items: &[Value], now: Timestamp) -> String {
    let mut rows = vec![vec![
        "ID".to_string(),
        "STATE".into(),
        "USES".into(),
        "EXPIRES".into(),
        "AUTO-ACCEPT".into(),
        "LABELS".into(),
    ]];
    for t in items {
        let uses = match t["maxUses"].as_u64() {
            Some(max) => format!("{}/{max}", t["uses"].as_u64().unwrap_or(0)),
            None => format!("{}/unlimited", t["uses"].as_u64().unwrap_or(0)),
        };
        let expires = match t["expires"]
            .as_str()
            .and_then(|e| e.parse::<Timestamp>().ok())
        {
            Some(e) if e > now => format!("in {}", age(Some(&now.to_string()), e)),
            Some(e) => format!("{} ago", age(Some(&e.to_string()), now)),
            None => "<unknown>".into(),
        };
        let labels = t["labels"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .filter(|l| !l.is_empty())
            .unwrap_or_else(|| "<none>".into());
        rows.push(vec![
            t["id"].as_str().unwrap_or("<none>").to_string(),
            t["state"].as_str().unwrap_or("").to_string(),
            uses,
            expires,
            t["autoAccept"].as_bool().unwrap_or(false).to_string(),
            labels,
        ]);
    }
    render(&rows)
}

fn condition_status(obj: &Value, t: &str) -> String {
    obj["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == t))
        .and_then(|c| c["status"].as_str())
        .unwrap_or("")
        .to_string()
}

fn age(created: Option<&str>, now: Timestamp) -> String {
    let Some(created) = created.and_then(|c| c.parse::<Timestamp>().ok()) else {
        return "<unknown>".into();
    };
    let secs = now.duration_since(created).as_secs().max(0);
    match secs {
        0..120 => format!("{secs}s"),
        120..7200 => format!("{}m", secs / 60),
        7200..172_800 => format!("{}h", secs / 3600),
        _ => format!("{}d", secs / 86_400),
    }
}

fn render(rows: &[Vec<String>]) -> String {
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(line.join("   ").trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy_with_status() -> Value {
        json!({
            "metadata": {"name": "policy-namespace", "namespace": "default",
                         "creationTimestamp": "2026-01-01T00:50:00Z",
                         "annotations": {"policy.open-cluster-management.io/standards": "NIST SP 800-53"}},
            "spec": {"remediationAction": "inform", "disabled": false, "policy-templates": [
                {"objectDefinition": {"apiVersion": "policy.open-cluster-management.io/v1",
                 "kind": "ConfigurationPolicy", "metadata": {"name": "policy-namespace-prod"},
                 "spec": {"severity": "low", "object-templates": [{"complianceType": "musthave",
                     "objectDefinition": {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "prod"}}}]}}}]},
            "status": {"compliant": "NonCompliant",
                       "placement": [{"placementBinding": "binding-policy-namespace", "placement": "placement-policy-namespace"}],
                       "status": [{"clustername": "c1", "clusternamespace": "c1", "compliant": "NonCompliant"},
                                  {"clustername": "c2", "clusternamespace": "c2"}]},
        })
    }

    #[test]
    fn policies_table_counts_non_compliant_clusters() {
        let now: Timestamp = "2026-01-01T01:00:00Z".parse().unwrap();
        let unplaced = json!({"metadata": {"name": "off", "namespace": "default"},
                              "spec": {"disabled": true}});
        let table = policies(&[policy_with_status(), unplaced], now);
        let lines: Vec<Vec<&str>> = table
            .lines()
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(
            lines,
            [
                vec![
                    "NAMESPACE",
                    "NAME",
                    "REMEDIATION",
                    "COMPLIANCE",
                    "CLUSTERS",
                    "AGE"
                ],
                vec![
                    "default",
                    "policy-namespace",
                    "inform",
                    "NonCompliant",
                    "1/2",
                    "10m"
                ],
                vec!["default", "off", "disabled", "<none>", "0/0", "<unknown>"],
            ]
        );
    }

    #[test]
    fn describe_policy_shows_templates_placement_and_clusters() {
        let now: Timestamp = "2026-01-01T01:00:00Z".parse().unwrap();
        let text = describe_policy(&policy_with_status(), &[], now);
        for part in [
            "Name:       policy-namespace\n",
            "Standards:  NIST SP 800-53\n",
            "  ConfigurationPolicy policy-namespace-prod (severity low)\n",
            "    musthave v1 Namespace prod\n",
            "binding-policy-namespace",
            "Clusters:   2 selected, 1 non-compliant\n",
        ] {
            assert!(text.contains(part), "{part:?} missing from:\n{text}");
        }
        let cluster_rows: Vec<Vec<&str>> = text
            .lines()
            .skip_while(|l| !l.starts_with("Clusters:"))
            .skip(2)
            .take_while(|l| *l != "Violations:")
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(
            cluster_rows,
            [vec!["c1", "NonCompliant"], vec!["c2", "<not", "reported>"]]
        );
    }

    #[test]
    fn describe_policy_shows_what_each_failing_cluster_violates() {
        let now: Timestamp = "2026-01-01T01:00:00Z".parse().unwrap();
        let mut p = policy_with_status();
        p["metadata"]["uid"] = "uid-1".into();
        assert_eq!(clusters_to_explain(&p), ["c1"]);
        let detail = |template: &str, compliant: &str, message: &str| {
            json!({"templateMeta": {"name": template}, "compliant": compliant,
                   "history": [{"lastTimestamp": "2026-01-01T00:59:00Z", "message": message},
                               {"lastTimestamp": "2026-01-01T00:58:00Z", "message": "older"}]})
        };
        let record = json!({
            "metadata": {"name": "c1", "namespace": "c1"},
            "status": {"policies": [
                {"namespace": "default", "name": "policy-namespace", "uid": "uid-old",
                 "compliant": "NonCompliant",
                 "details": [detail("gone", "NonCompliant", "a deleted policy's report")]},
                {"namespace": "default", "name": "policy-namespace", "uid": "uid-1",
                 "compliant": "NonCompliant",
                 "details": [
                     detail("policy-namespace-prod", "NonCompliant",
                            "NonCompliant; violation - namespaces [prod] not found"),
                     detail("policy-namespace-met", "Compliant", "Compliant; fine"),
                 ]},
            ]},
        });
        let text = describe_policy(&p, &[record], now);
        let violations: Vec<&str> = text
            .lines()
            .skip_while(|l| *l != "Violations:")
            .skip(1)
            .collect();
        assert_eq!(violations.len(), 2, "{text}");
        assert_eq!(
            violations[0].split_whitespace().collect::<Vec<_>>(),
            ["CLUSTER", "TEMPLATE", "COMPLIANCE", "MESSAGE"]
        );
        assert!(
            violations[1].starts_with("  c1")
                && violations[1].contains("policy-namespace-prod")
                && violations[1].ends_with("NonCompliant; violation - namespaces [prod] not found"),
            "{text}"
        );
        // A compliant policy has nothing to explain.
        let mut fine = p.clone();
        fine["status"]["status"][0]["compliant"] = "Compliant".into();
        assert!(clusters_to_explain(&fine).is_empty());
        assert!(!describe_policy(&fine, &[], now).contains("Violations:"));
    }

    #[test]
    fn describe_policy_reads_a_bounded_number_of_records() {
        let mut p = policy_with_status();
        let entries: Vec<Value> = (0..50)
            .map(|i| {
                json!({"clustername": format!("c{i:02}"),
                       "compliant": if i % 2 == 0 { "Pending" } else { "NonCompliant" }})
            })
            .collect();
        p["status"]["status"] = Value::Array(entries);
        let picked = clusters_to_explain(&p);
        assert_eq!(picked.len(), MAX_EXPLAINED_CLUSTERS);
        assert_eq!(picked[0], "c01", "non-compliant first");
        assert!(picked.iter().all(|c| {
            let n: usize = c[1..].parse().unwrap();
            n % 2 == 1
        }));
        let now: Timestamp = "2026-01-01T01:00:00Z".parse().unwrap();
        let text = describe_policy(&p, &[], now);
        assert!(
            text.contains("  (30 more non-compliant or pending clusters not shown)\n"),
            "{text}"
        );
    }

    #[test]
    fn config_maps_table_counts_keys_like_kubectl() {
        let now: Timestamp = "2026-01-01T01:00:00Z".parse().unwrap();
        let items = [json!({
            "metadata": {"name": "settings", "namespace": "policies",
                         "creationTimestamp": "2026-01-01T00:55:00Z"},
            "data": {"tier": "gold", "replicas": "3"}, "binaryData": {"logo": "AAEC"}})];
        assert_eq!(
            config_maps(&items, now),
            "NAMESPACE   NAME       DATA   AGE\npolicies    settings   3      5m\n"
        );
    }

    #[test]
    fn clusters_table_reads_like_kubectl() {
        let now: Timestamp = "2026-01-01T01:00:00Z".parse().unwrap();
        let items = vec![
            json!({"metadata": {"name": "store-0001", "creationTimestamp": "2026-01-01T00:55:00Z"},
                   "spec": {"hubAcceptsClient": true},
                   "status": {"version": {"kubernetes": "v1.36.3"}, "conditions": [
                       {"type": "ManagedClusterJoined", "status": "True"},
                       {"type": "ManagedClusterConditionAvailable", "status": "Unknown"}]}}),
            json!({"metadata": {"name": "s2"}, "spec": {}}),
        ];
        let table = clusters(&items, now);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(
            lines[0],
            "NAME         HUB ACCEPTED   JOINED   AVAILABLE   KUBERNETES   AGE"
        );
        assert_eq!(
            lines[1],
            "store-0001   true           True     Unknown     v1.36.3      5m"
        );
        assert_eq!(
            lines[2],
            "s2           false                                            <unknown>"
        );
    }

    #[test]
    fn placement_tables_show_what_an_operator_acts_on() {
        let now: Timestamp = "2026-01-01T01:00:00Z".parse().unwrap();
        let placement = json!({"metadata": {"namespace": "default", "name": "placement1", "creationTimestamp": "2026-01-01T00:59:00Z"},
            "status": {"numberOfSelectedClusters": 4, "conditions": [
                {"type": "PlacementSatisfied", "status": "True", "reason": "AllDecisionsScheduled"}]}});
        let decision = json!({"metadata": {"namespace": "default", "name": "placement1-decision-1",
                "labels": {PLACEMENT_LABEL: "placement1", DECISION_GROUP_INDEX_LABEL: "0", DECISION_GROUP_NAME_LABEL: ""}},
            "status": {"decisions": [{"clusterName": "c1"}, {"clusterName": "c2"}, {"clusterName": "c3"}, {"clusterName": "c4"}]}});
        let table = placements(&[placement], std::slice::from_ref(&decision), now);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(
            lines[0],
            "NAMESPACE   NAME         SUCCEEDED   REASON                  SELECTED   CLUSTERS           AGE"
        );
        assert_eq!(
            lines[1],
            "default     placement1   True        AllDecisionsScheduled   4          c1,c2,c3 +1 more   60s"
        );
        let table = placement_decisions(&[decision], now);
        assert!(
            table
                .lines()
                .nth(1)
                .unwrap()
                .starts_with("default     placement1-decision-1   placement1   0       4"),
            "{table}"
        );
        let mwrs = json!({"metadata": {"namespace": "default", "name": "web"},
            "spec": {"placementRefs": [{"name": "placement1"}]},
            "status": {"summary": {"total": 2, "desiredTotal": 4, "applied": 2, "available": 1, "degraded": 1},
                "conditions": [{"type": "PlacementRolledOut", "status": "False", "reason": "MaxFailuresExceeded"}]}});
        let table = replica_sets(&[mwrs], now);
        assert_eq!(
            table.lines().nth(1).unwrap(),
            "default     web    placement1   4          2         1           1        MaxFailuresExceeded   <unknown>"
        );
    }
}
