//! The status page's HTML, rendered on the server from one page of rows. Every value that
//! comes from the store goes through [`escape`] (text and attributes alike) or [`query_value`]
//! (links): names, labels, claims and spoke messages are user input.

use std::fmt::Write as _;

use jiff::Timestamp;

use flotilla_proto::api::policy::ComplianceState;

use super::view::{
    ClusterComplianceRow, ComplianceView, Page, PlacementRow, PolicyComplianceRow, RolloutRow,
    Status, Summary, WorkRow,
};
use super::{ClusterEntry, Params};

/// The page's stylesheet, embedded: the page loads nothing from elsewhere.
pub const STYLESHEET: &str = include_str!("assets/style.css");
/// The frame every page is rendered into.
const LAYOUT: &str = include_str!("assets/layout.html");
/// Rows of the overview's secondary tables (placements deciding no cluster).
pub const OVERVIEW_ROWS: usize = 10;

/// Text made safe for HTML text and quoted attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A value percent-encoded for a URL's query (everything but unreserved characters).
pub fn query_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// A query string from name/value pairs, empty values left out.
fn query(pairs: &[(&str, Option<&str>)]) -> String {
    let parts: Vec<String> = pairs
        .iter()
        .filter_map(|(k, v)| {
            v.filter(|v| !v.is_empty())
                .map(|v| format!("{k}={}", query_value(v)))
        })
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("?{}", parts.join("&"))
    }
}

const NAV: [(&str, &str); 6] = [
    ("/ui/", "Overview"),
    ("/ui/clusters", "Clusters"),
    ("/ui/works", "Works"),
    ("/ui/placements", "Placements"),
    ("/ui/rollouts", "Rollouts"),
    ("/ui/compliance", "Compliance"),
];

fn layout(current: &str, title: &str, body: &str, now: Timestamp) -> String {
    let nav: String = NAV
        .iter()
        .map(|(href, name)| {
            let class = if *href == current {
                " class=\"current\""
            } else {
                ""
            };
            format!("<a href=\"{href}\"{class}>{name}</a>")
        })
        .collect();
    // The body goes in last, so that a "{{" in a value can never be taken for a placeholder.
    LAYOUT
        .replace("{{title}}", &escape(title))
        .replace("{{nav}}", &nav)
        .replace("{{now}}", &clock(now))
        .replace("{{body}}", body)
}

/// A time as people read it on this page: `2026-11-23 06:40:12 UTC`.
fn clock(t: Timestamp) -> String {
    t.strftime("%Y-%m-%d %H:%M:%S UTC").to_string()
}

/// How long ago `t` was, to the two largest units: `3d 4h`, `12m 5s`, `40s`.
pub fn ago(t: Timestamp, now: Timestamp) -> String {
    let secs = now.as_second().saturating_sub(t.as_second()).max(0);
    let units = [(86_400, "d"), (3_600, "h"), (60, "m"), (1, "s")];
    let mut parts = Vec::new();
    let mut rest = secs;
    for (size, unit) in units {
        if rest >= size || (parts.is_empty() && size == 1) {
            parts.push(format!("{}{unit}", rest / size));
            rest %= size;
        }
        if parts.len() == 2 {
            break;
        }
    }
    parts.join(" ")
}

fn status(s: Status) -> String {
    format!("<span class=\"status {0}\">{0}</span>", s.as_str())
}

/// A cell with a time and how long ago it was.
fn time_cell(t: Option<Timestamp>, now: Timestamp, note: &str) -> String {
    match t {
        Some(t) => format!(
            "<td><time datetime=\"{}\">{}</time><div class=\"sub\">{}{} ago</div></td>",
            t,
            clock(t),
            note,
            ago(t, now)
        ),
        None => "<td>—</td>".to_string(),
    }
}

/// "Showing 51–100 of 1234" and links to the neighbouring pages, keeping the filters.
fn pager<T>(path: &str, params: &Params, page: &Page<T>) -> String {
    let first = if page.total == 0 {
        0
    } else {
        (page.page - 1) * page.limit + 1
    };
    let last = ((page.page - 1) * page.limit + page.items.len()).min(page.total);
    let mut out = format!(
        "<p class=\"pager\"><span class=\"count\">Showing {first}–{last} of {}</span>",
        page.total
    );
    let link = |n: usize, text: &str| {
        let n = n.to_string();
        let limit = page.limit.to_string();
        let q = query(&[
            ("state", params.state.as_deref()),
            ("q", params.q.as_deref()),
            ("selector", params.selector.as_deref()),
            ("cluster", params.cluster.as_deref()),
            ("limit", Some(limit.as_str())),
            ("page", Some(n.as_str())),
        ]);
        format!("<a href=\"{path}{}\">{text}</a>", escape(&q))
    };
    if page.page > 1 {
        out.push_str(&link(page.page - 1, "← previous"));
    }
    if page.page < page.pages {
        out.push_str(&link(page.page + 1, "next →"));
    }
    out.push_str(&format!(
        " <span>page {} of {}</span></p>",
        page.page, page.pages
    ));
    out
}

fn select(name: &str, current: Option<&str>, options: &[&str]) -> String {
    let mut out = format!("<select name=\"{name}\">");
    for o in options {
        let selected = if current.unwrap_or("all") == *o {
            " selected"
        } else {
            ""
        };
        let _ = write!(out, "<option value=\"{o}\"{selected}>{o}</option>");
    }
    out.push_str("</select>");
    out
}

fn text_input(label: &str, name: &str, value: Option<&str>, hint: &str) -> String {
    format!(
        "<label>{label}<input name=\"{name}\" value=\"{}\" placeholder=\"{hint}\"></label>",
        escape(value.unwrap_or(""))
    )
}

fn labels(pairs: impl IntoIterator<Item = (String, String)>) -> String {
    pairs
        .into_iter()
        .map(|(k, v)| format!("<span class=\"label\">{}={}</span>", escape(&k), escape(&v)))
        .collect()
}

/// The failing clusters' table, as on the first screen and the clusters list.
fn cluster_table(id: &str, clusters: &[ClusterEntry], now: Timestamp, full: bool) -> String {
    let mut out = format!(
        "<div class=\"scroll\"><table id=\"{id}\"><thead><tr><th>Cluster</th><th>Available</th><th>Since</th><th>Reason / message</th><th>Last seen</th><th>Transport</th><th>Works</th>"
    );
    if full {
        out.push_str("<th>Version</th><th>Labels</th><th>Claims</th><th>Accepted</th>");
    }
    out.push_str("</tr></thead><tbody>");
    for entry in clusters {
        let c = &entry.item.cluster;
        let name = escape(&c.name);
        let works = &entry.item.works;
        let since_note = if c.never_reported {
            "never reported; registered "
        } else {
            ""
        };
        let last_seen = if entry.connected {
            let since = entry
                .session_since
                .map(|t| format!(" since {}", clock(t)))
                .unwrap_or_default();
            format!("<td>now<div class=\"sub\">session live{since}</div></td>")
        } else {
            time_cell(entry.last_seen, now, "")
        };
        let _ = write!(
            out,
            "<tr data-cluster=\"{name}\" data-available=\"{avail}\"><td><a href=\"/ui/works{works_link}\">{name}</a></td><td>{status}</td>{since}<td class=\"msg\">{reason}<div class=\"sub\">{message}</div></td>{last_seen}<td>{transport}</td><td class=\"num nowrap\">{applied}/{total} applied{degraded}</td>",
            avail = c.available.as_str(),
            works_link = escape(&query(&[("cluster", Some(&c.name))])),
            status = status(c.available),
            since = time_cell(c.since, now, since_note),
            reason = escape(&c.reason),
            message = escape(&c.message),
            transport = entry
                .transport
                .as_deref()
                .map(escape)
                .unwrap_or_else(|| "—".into()),
            applied = works.applied,
            total = works.total,
            degraded = match (works.failing, works.degraded) {
                (0, _) => String::new(),
                (failing, 0) => format!(
                    "<div class=\"sub\"><span class=\"status bad\">{failing} failing</span></div>"
                ),
                (failing, degraded) => format!(
                    "<div class=\"sub\"><span class=\"status bad\">{failing} failing, \
                     {degraded} degraded</span></div>"
                ),
            },
        );
        if full {
            let _ = write!(
                out,
                "<td>{}</td><td>{}</td><td>{}</td><td>{}</td>",
                escape(&c.version),
                labels(c.labels.clone()),
                labels(c.claims.clone()),
                c.accepted
            );
        }
        out.push_str("</tr>");
    }
    out.push_str("</tbody></table></div>");
    out
}

/// A compliance state as a badge: NonCompliant bad, Compliant good, anything else (Pending,
/// not reported) a warning.
fn compliance_badge(state: Option<ComplianceState>) -> String {
    let (class, text) = match state {
        Some(ComplianceState::NonCompliant) => ("bad", "NonCompliant"),
        Some(ComplianceState::Compliant) => ("True", "Compliant"),
        Some(ComplianceState::Pending) => ("Unknown", "Pending"),
        Some(ComplianceState::Terminating) => ("Unknown", "Terminating"),
        None => ("Unknown", "not reported"),
    };
    format!("<span class=\"status {class}\">{text}</span>")
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// Per policy: on how many of the selected clusters it is violated, most first.
fn policy_compliance_table(rows: &[PolicyComplianceRow]) -> String {
    let mut out = String::from(
        "<table id=\"policies\"><thead><tr><th>Policy</th><th>Compliance</th><th>Non-compliant on</th><th>Pending or not reported</th></tr></thead><tbody>",
    );
    for p in rows {
        let violated = if p.non_compliant == 0 {
            format!("0 of {}", plural(p.clusters, "cluster", "clusters"))
        } else {
            format!(
                "<span class=\"status bad\">{}</span> of {}",
                p.non_compliant,
                plural(p.clusters, "cluster", "clusters")
            )
        };
        let _ = write!(
            out,
            "<tr data-policy=\"{ns}/{name}\"><td>{ns}/{name}</td><td>{}</td><td class=\"num nowrap\">{violated}</td><td class=\"num\">{}</td></tr>",
            compliance_badge(p.compliant),
            p.pending,
            ns = escape(&p.namespace),
            name = escape(&p.name),
        );
    }
    out.push_str("</tbody></table>");
    out
}

/// Per cluster: how many of the policies it carries it violates, most first.
fn cluster_compliance_table(rows: &[ClusterComplianceRow]) -> String {
    let mut out = String::from(
        "<table id=\"compliance-clusters\"><thead><tr><th>Cluster</th><th>Violates</th><th>Pending or not reported</th><th>Violated policies</th></tr></thead><tbody>",
    );
    for c in rows {
        let violated = if c.violated == 0 {
            format!("0 of {}", plural(c.policies, "policy", "policies"))
        } else {
            format!(
                "<span class=\"status bad\">{}</span> of {}",
                c.violated,
                plural(c.policies, "policy", "policies")
            )
        };
        let mut named: Vec<String> = c.violating.iter().map(|p| escape(p)).collect();
        if c.violated > c.violating.len() {
            named.push(format!("+{} more", c.violated - c.violating.len()));
        }
        let _ = write!(
            out,
            "<tr data-compliance-cluster=\"{name}\"><td><a href=\"/ui/clusters{link}\">{name}</a></td><td class=\"num nowrap\">{violated}</td><td class=\"num\">{}</td><td class=\"msg\">{}</td></tr>",
            c.pending,
            named.join(", "),
            name = escape(&c.cluster),
            link = escape(&query(&[("q", Some(&c.cluster))])),
        );
    }
    out.push_str("</tbody></table>");
    out
}

/// The labels filter of the compliance tables, sent to `path`.
fn compliance_filter(path: &str, params: &Params) -> String {
    format!(
        "<form class=\"filters\" method=\"get\" action=\"{path}\">{}<button type=\"submit\">Filter</button></form>",
        text_input(
            "Cluster labels (kubectl -l)",
            "selector",
            params.selector.as_deref(),
            "env=prod,region!=eu",
        ),
    )
}

/// The compliance tables: policies failing most first, then clusters violating most first.
fn compliance_sections(params: &Params, view: &ComplianceView, more: bool) -> String {
    let mut body = String::new();
    let failing_policies = view
        .policies
        .items
        .iter()
        .filter(|p| p.non_compliant > 0)
        .count();
    let _ = write!(
        body,
        "<h2 id=\"compliance\">Policies: {}{}, most violated first</h2>",
        plural(view.policies.total, "policy", "policies"),
        if params.selector.is_some() {
            format!(
                " on clusters matching {}",
                escape(params.selector.as_deref().unwrap_or_default())
            )
        } else {
            String::new()
        }
    );
    body.push_str(&compliance_filter(
        if more { "/ui/" } else { "/ui/compliance" },
        params,
    ));
    if view.policies.total == 0 {
        body.push_str("<p class=\"empty\">No policy reaches a selected cluster.</p>");
    } else {
        if failing_policies == 0 {
            body.push_str("<p class=\"empty\">No policy is violated on a selected cluster.</p>");
        }
        body.push_str(&policy_compliance_table(&view.policies.items));
    }
    let _ = write!(
        body,
        "<h2 id=\"violating\">Clusters by policies violated: {}</h2>",
        plural(view.clusters.total, "cluster carries", "clusters carry")
    );
    if view.clusters.total > 0 {
        body.push_str(&cluster_compliance_table(&view.clusters.items));
    }
    if more
        && (view.policies.total > view.policies.items.len()
            || view.clusters.total > view.clusters.items.len())
    {
        let _ = write!(
            body,
            "<p class=\"pager\"><a href=\"/ui/compliance{}\">all of them →</a></p>",
            escape(&query(&[("selector", params.selector.as_deref())]))
        );
    }
    body
}

/// Every policy's and every cluster's compliance, one page of each.
pub fn compliance(params: &Params, view: &ComplianceView, now: Timestamp) -> String {
    let mut body = String::from("<h1>Compliance</h1>");
    body.push_str(&compliance_sections(params, view, false));
    // The two lists share the page number: the longer one decides how many pages there are.
    let longer = if view.policies.pages >= view.clusters.pages {
        pager("/ui/compliance", params, &view.policies)
    } else {
        pager("/ui/compliance", params, &view.clusters)
    };
    body.push_str(&longer);
    layout("/ui/compliance", "Compliance", &body, now)
}

/// The first screen: the fleet in numbers, then the failing clusters, longest failing first,
/// then which policies are violated where (filtered by the clusters' labels).
pub fn overview(
    summary: &Summary,
    failing: &Page<ClusterEntry>,
    placements: &Page<PlacementRow>,
    params: &Params,
    compliance: &ComplianceView,
    now: Timestamp,
) -> String {
    let tile = |n: usize, what: &str, href: &str, bad_when_nonzero: bool| {
        let class = match (bad_when_nonzero, n) {
            (true, 0) => "tile ok",
            (true, _) => "tile bad",
            _ => "tile",
        };
        format!(
            "<a class=\"{class}\" href=\"{href}\"><div class=\"n\">{n}</div><div class=\"what\">{what}</div></a>"
        )
    };
    let mut body = String::from("<h1>Fleet status</h1><div class=\"tiles\">");
    body.push_str(&tile(summary.clusters, "clusters", "/ui/clusters", false));
    body.push_str(&tile(
        summary.failing_clusters,
        "clusters failing (Available not True)",
        "/ui/clusters?state=failing",
        true,
    ));
    body.push_str(&tile(
        summary.failing_works,
        &format!(
            "of {} works not applied, unavailable or degraded",
            summary.works
        ),
        "/ui/works?state=failing",
        true,
    ));
    body.push_str(&tile(
        summary.placements_without_decisions,
        &format!("of {} placements deciding no cluster", summary.placements),
        "/ui/placements?state=failing",
        true,
    ));
    body.push_str(&tile(
        summary.failing_rollouts,
        &format!("of {} rollouts stopped or degraded", summary.rollouts),
        "/ui/rollouts?state=failing",
        true,
    ));
    body.push_str("</div>");
    let _ = write!(
        body,
        "<h2 id=\"failing-now\">Failing right now: {} cluster{}, longest failing first</h2>",
        failing.total,
        if failing.total == 1 { "" } else { "s" }
    );
    if failing.total == 0 {
        body.push_str(
            "<p class=\"empty\">No cluster is failing: every ManagedCluster is Available.</p>",
        );
    } else {
        body.push_str(&cluster_table("failing", &failing.items, now, false));
        let params = Params::default();
        body.push_str(&pager("/ui/", &params, failing));
    }
    body.push_str(&compliance_sections(params, compliance, true));
    if placements.total > 0 {
        let _ = write!(
            body,
            "<h2>Placements deciding no cluster: {}</h2>",
            placements.total
        );
        body.push_str(&placement_table(&placements.items));
        if placements.total > placements.items.len() {
            body.push_str(
                "<p class=\"pager\"><a href=\"/ui/placements?state=failing\">all of them →</a></p>",
            );
        }
    }
    layout("/ui/", "Fleet status", &body, now)
}

/// Every cluster the filters select, one page.
pub fn clusters(params: &Params, page: &Page<ClusterEntry>, now: Timestamp) -> String {
    let mut body = String::from(
        "<h1>Clusters</h1><form class=\"filters\" method=\"get\" action=\"/ui/clusters\">",
    );
    body.push_str(&format!(
        "<label>State{}</label>",
        select(
            "state",
            params.state.as_deref(),
            &["all", "failing", "available"]
        )
    ));
    body.push_str(&text_input(
        "Name contains",
        "q",
        params.q.as_deref(),
        "store-00",
    ));
    body.push_str(&text_input(
        "Labels (kubectl -l)",
        "selector",
        params.selector.as_deref(),
        "env=prod,region!=eu",
    ));
    body.push_str("<button type=\"submit\">Filter</button></form>");
    if page.total == 0 {
        body.push_str("<p class=\"empty\">No cluster matches.</p>");
    } else {
        body.push_str(&cluster_table("clusters", &page.items, now, true));
    }
    body.push_str(&pager("/ui/clusters", params, page));
    layout("/ui/clusters", "Clusters", &body, now)
}

/// ManifestWorks, failing ones first, with the spoke's messages verbatim.
pub fn works(params: &Params, page: &Page<WorkRow>, now: Timestamp) -> String {
    let mut body =
        String::from("<h1>Works</h1><form class=\"filters\" method=\"get\" action=\"/ui/works\">");
    body.push_str(&format!(
        "<label>State{}</label>",
        select("state", params.state.as_deref(), &["all", "failing"])
    ));
    body.push_str(&text_input(
        "Cluster",
        "cluster",
        params.cluster.as_deref(),
        "store-0042",
    ));
    body.push_str(&text_input(
        "Name contains",
        "q",
        params.q.as_deref(),
        "baseline",
    ));
    body.push_str("<button type=\"submit\">Filter</button></form>");
    if page.total == 0 {
        body.push_str("<p class=\"empty\">No work matches.</p>");
    } else {
        body.push_str("<table id=\"works\"><thead><tr><th>Cluster</th><th>Work</th><th>Manifests</th><th>Applied</th><th>Available</th><th>Degraded</th><th>What the spoke reports</th></tr></thead><tbody>");
        for w in &page.items {
            let problems: String = w
                .problems
                .iter()
                .map(|p| format!("<li>{}</li>", escape(p)))
                .collect();
            let _ = write!(
                body,
                "<tr data-work=\"{cluster}/{name}\"><td>{cluster}</td><td>{name}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"msg\"><ul class=\"problems\">{problems}</ul></td></tr>",
                w.manifests,
                status(w.applied),
                status(w.available),
                status(w.degraded),
                cluster = escape(&w.cluster),
                name = escape(&w.name),
            );
        }
        body.push_str("</tbody></table>");
    }
    body.push_str(&pager("/ui/works", params, page));
    layout("/ui/works", "Works", &body, now)
}

fn placement_table(rows: &[PlacementRow]) -> String {
    let mut out = String::from(
        "<table id=\"placements\"><thead><tr><th>Placement</th><th>Decided clusters</th><th>Selected</th><th>Satisfied</th><th>Reason / message</th></tr></thead><tbody>",
    );
    for p in rows {
        let decided = if p.decisions == 0 {
            "<span class=\"status bad\">0</span>".to_string()
        } else {
            p.decisions.to_string()
        };
        let _ = write!(
            out,
            "<tr data-placement=\"{ns}/{name}\"><td>{ns}/{name}</td><td class=\"num\">{decided}</td><td class=\"num\">{}</td><td>{}</td><td class=\"msg\">{}<div class=\"sub\">{}</div></td></tr>",
            p.selected,
            status(p.satisfied),
            escape(&p.reason),
            escape(&p.message),
            ns = escape(&p.namespace),
            name = escape(&p.name),
        );
    }
    out.push_str("</tbody></table>");
    out
}

fn list_filters(path: &str, params: &Params) -> String {
    format!(
        "<form class=\"filters\" method=\"get\" action=\"{path}\"><label>State{}</label>{}<button type=\"submit\">Filter</button></form>",
        select("state", params.state.as_deref(), &["all", "failing"]),
        text_input("Name contains", "q", params.q.as_deref(), "namespace/name"),
    )
}

/// Placements, those deciding no cluster first.
pub fn placements(params: &Params, page: &Page<PlacementRow>, now: Timestamp) -> String {
    let mut body = String::from("<h1>Placements</h1>");
    body.push_str(&list_filters("/ui/placements", params));
    if page.total == 0 {
        body.push_str("<p class=\"empty\">No placement matches.</p>");
    } else {
        body.push_str(&placement_table(&page.items));
    }
    body.push_str(&pager("/ui/placements", params, page));
    layout("/ui/placements", "Placements", &body, now)
}

/// ManifestWorkReplicaSet rollouts, stopped or degraded ones first.
pub fn rollouts(params: &Params, page: &Page<RolloutRow>, now: Timestamp) -> String {
    let mut body = String::from("<h1>Rollouts</h1>");
    body.push_str(&list_filters("/ui/rollouts", params));
    if page.total == 0 {
        body.push_str("<p class=\"empty\">No rollout matches.</p>");
    } else {
        body.push_str("<table id=\"rollouts\"><thead><tr><th>ManifestWorkReplicaSet</th><th>Placements</th><th>Phase</th><th>Clusters</th><th>Applied</th><th>Available</th><th>Degraded</th><th>Message</th></tr></thead><tbody>");
        for r in &page.items {
            let phase_class = if r.failing() { "bad" } else { "" };
            let _ = write!(
                body,
                "<tr data-rollout=\"{ns}/{name}\"><td>{ns}/{name}</td><td>{}</td><td><span class=\"status {phase_class}\">{}</span></td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"msg\">{}</td></tr>",
                escape(&r.placements.join(", ")),
                escape(&r.phase),
                r.total,
                r.applied,
                r.available,
                r.degraded,
                escape(&r.message),
                ns = escape(&r.namespace),
                name = escape(&r.name),
            );
        }
        body.push_str("</tbody></table>");
    }
    body.push_str(&pager("/ui/rollouts", params, page));
    layout("/ui/rollouts", "Rollouts", &body, now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controllers::governance::{ComplianceSnapshot, RootCompliance};
    use crate::controllers::scheduling::fleet::Key;
    use crate::status_page::view::{
        ClusterQuery, ClusterState, LabelSelector, Model, PageRequest, WorkQuery,
    };
    use flotilla_proto::api::Kind;
    use serde_json::json;

    const HOSTILE: &str = "<img src=x onerror=alert(1)>\"'&</td><script>alert(2)</script>{{body}}";

    fn hostile_fleet() -> Model {
        let mut model = Model::default();
        model.replace(
            Kind::ManagedCluster,
            vec![json!({
                "metadata": {"name": "store-1", "labels": {"owner": HOSTILE}},
                "status": {
                    "conditions": [{"type": "ManagedClusterConditionAvailable", "status": "False",
                        "lastTransitionTime": "2026-11-23T06:00:00Z", "reason": HOSTILE, "message": HOSTILE}],
                    "clusterClaims": [{"name": "note", "value": HOSTILE}],
                    "version": {"kubernetes": HOSTILE},
                },
            })],
        );
        model.replace(
            Kind::ManifestWork,
            vec![json!({
                "metadata": {"namespace": "store-1", "name": "web"},
                "status": {"conditions": [{"type": "Applied", "status": "False", "message": HOSTILE}]},
            })],
        );
        model
    }

    /// Whether `html` holds any tag `HOSTILE` would have added if it were not escaped.
    fn assert_inert(html: &str) {
        assert!(!html.contains("<img"), "an <img> got through:\n{html}");
        assert!(!html.contains("<script"), "a <script> got through:\n{html}");
        assert_eq!(
            html.matches("<main>").count(),
            1,
            "a value expanded the layout:\n{html}"
        );
        assert!(html.contains("&lt;img src=x onerror=alert(1)&gt;&quot;&#39;&amp;&lt;/td&gt;"));
    }

    #[test]
    fn every_value_from_the_store_is_escaped() {
        let model = hostile_fleet();
        let now: Timestamp = "2026-11-23T07:00:00Z".parse().unwrap();
        let failing = model.clusters(
            &ClusterQuery {
                state: ClusterState::Failing,
                ..Default::default()
            },
            PageRequest::default(),
        );
        let (counts, items) = crate::status_page::split(failing);
        let entries: Vec<ClusterEntry> = items
            .into_iter()
            .map(|item| ClusterEntry::new(item, None))
            .collect();
        let entries = counts.with_items(entries);
        let params = Params {
            q: Some(HOSTILE.into()),
            selector: Some(HOSTILE.into()),
            ..Default::default()
        };
        let placements = model.placements(&Default::default(), PageRequest::default());
        // A policy and a cluster named by whoever wrote them, violated.
        let snapshot = ComplianceSnapshot {
            policies: vec![RootCompliance {
                key: Key::new(HOSTILE, HOSTILE),
                compliant: Some(ComplianceState::NonCompliant),
                clusters: vec![
                    ("store-1".into(), Some(ComplianceState::NonCompliant)),
                    (HOSTILE.into(), Some(ComplianceState::NonCompliant)),
                ]
                .into(),
            }],
        };
        let violations =
            model.compliance(&snapshot, &LabelSelector::default(), PageRequest::default());
        let first = overview(
            &model.summary(),
            &entries,
            &placements,
            &params,
            &violations,
            now,
        );
        assert_inert(&first);
        assert!(
            first.contains("data-compliance-cluster=\"store-1\""),
            "{first}"
        );
        assert_inert(&compliance(&params, &violations, now));
        let page = clusters(&params, &entries, now);
        assert_inert(&page);
        // The failing cluster is listed with since when, and for how long.
        assert!(page.contains("data-cluster=\"store-1\""));
        assert!(page.contains("2026-11-23 06:00:00 UTC"));
        assert!(page.contains("1h ago"));
        let works = model.works(&WorkQuery::default(), PageRequest::default());
        assert_inert(&super::works(&params, &works, now));
    }

    #[test]
    fn links_keep_the_filters_encoded() {
        assert_eq!(query_value("env=prod,a b&c"), "env%3Dprod%2Ca%20b%26c");
        assert_eq!(
            query(&[
                ("state", Some("failing")),
                ("q", None),
                ("selector", Some("x=y"))
            ]),
            "?state=failing&selector=x%3Dy"
        );
    }

    #[test]
    fn durations_read_like_kubectl_ages() {
        let now: Timestamp = "2026-11-23T07:00:00Z".parse().unwrap();
        let check = |t: &str, expected: &str| assert_eq!(ago(t.parse().unwrap(), now), expected);
        check("2026-11-23T07:00:00Z", "0s");
        check("2026-11-23T06:59:20Z", "40s");
        check("2026-11-23T06:47:55Z", "12m 5s");
        check("2026-11-20T03:00:00Z", "3d 4h");
        check("2026-11-24T07:00:00Z", "0s");
    }
}
