//! Tables the CLI prints, in kubectl's manner: upper-case headers, columns padded by three
//! spaces, `<none>` for missing values, ages like `5m`.

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
}
