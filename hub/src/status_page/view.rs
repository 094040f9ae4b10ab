//! The status page's model of the fleet: one compact row per ManagedCluster, ManifestWork,
//! Placement, PlacementDecision and ManifestWorkReplicaSet, kept current by the store's one
//! list-then-watch loop per kind, and the queries the page asks of it (filter, sort, one page).
//!
//! A request never reads the store: it filters rows already in memory and returns at most one
//! page of them, so a page at 10,000 clusters costs a scan of small rows, not a list of the
//! fleet's objects. The rows keep only what the page shows; a spoke's messages are kept
//! verbatim (bounded in number per work) because they are what an operator acts on.

use std::collections::{BTreeMap, HashMap};

use flotilla_proto::api::policy::ComplianceState;
use flotilla_proto::api::{Kind, PLACEMENT_LABEL};
use flotilla_store::{Object, WatchEvent};
use jiff::Timestamp;
use serde::Serialize;
use serde_json::Value;

use crate::controllers::governance::ComplianceSnapshot;

/// The condition that says whether a cluster is failing.
pub const AVAILABLE: &str = "ManagedClusterConditionAvailable";
const JOINED: &str = "ManagedClusterJoined";
/// Problems kept per work: enough to see what went wrong, bounded whatever a spoke reports.
pub const MAX_PROBLEMS_PER_WORK: usize = 20;
/// Longest message kept as it is (a condition's message may be 32 KiB): a page of 500 rows
/// stays a few megabytes at worst. Longer ones keep their start and say how much is cut.
pub const MAX_MESSAGE_BYTES: usize = 4096;

/// `message` verbatim up to [`MAX_MESSAGE_BYTES`], else its start and what was left out.
pub fn bounded(message: &str) -> String {
    if message.len() <= MAX_MESSAGE_BYTES {
        return message.to_string();
    }
    let mut end = MAX_MESSAGE_BYTES;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}… ({} more bytes; `flotilla get` with -o yaml shows all of it)",
        &message[..end],
        message.len() - end
    )
}

/// A condition's status as Kubernetes writes it; a missing condition reads as `Unknown`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Status {
    True,
    False,
    Unknown,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::True => "True",
            Status::False => "False",
            Status::Unknown => "Unknown",
        }
    }
}

fn condition<'a>(object: &'a Value, type_: &str) -> Option<&'a Value> {
    object["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

fn status_of(condition: Option<&Value>) -> Status {
    match condition.and_then(|c| c["status"].as_str()) {
        Some("True") => Status::True,
        Some("False") => Status::False,
        _ => Status::Unknown,
    }
}

fn text(value: &Value) -> String {
    value.as_str().unwrap_or_default().to_string()
}

fn timestamp(value: &Value) -> Option<Timestamp> {
    value.as_str()?.parse().ok()
}

/// A ManagedCluster as the page shows it.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterRow {
    pub name: String,
    pub accepted: bool,
    pub joined: Status,
    pub available: Status,
    /// When `available` last changed (the condition's lastTransitionTime); for a cluster that
    /// never reported, when it was registered. Failing clusters are failing "since" this.
    pub since: Option<Timestamp>,
    /// Whether `since` is the registration time because the condition was never written.
    pub never_reported: bool,
    pub reason: String,
    pub message: String,
    pub version: String,
    pub labels: BTreeMap<String, String>,
    pub claims: Vec<(String, String)>,
    pub taints: Vec<String>,
}

impl ClusterRow {
    pub fn from_object(object: &Value) -> ClusterRow {
        let available = condition(object, AVAILABLE);
        let (since, never_reported) =
            match available.and_then(|c| timestamp(&c["lastTransitionTime"])) {
                Some(t) => (Some(t), false),
                None => (
                    timestamp(&object["metadata"]["creationTimestamp"]),
                    available.is_none(),
                ),
            };
        ClusterRow {
            name: text(&object["metadata"]["name"]),
            accepted: object["spec"]["hubAcceptsClient"]
                .as_bool()
                .unwrap_or(false),
            joined: status_of(condition(object, JOINED)),
            available: status_of(available),
            since,
            never_reported,
            reason: available.map(|c| text(&c["reason"])).unwrap_or_default(),
            message: available
                .map(|c| bounded(&text(&c["message"])))
                .unwrap_or_default(),
            version: text(&object["status"]["version"]["kubernetes"]),
            labels: object["metadata"]["labels"]
                .as_object()
                .map(|m| m.iter().map(|(k, v)| (k.clone(), text(v))).collect())
                .unwrap_or_default(),
            claims: object["status"]["clusterClaims"]
                .as_array()
                .map(|cs| {
                    cs.iter()
                        .map(|c| (text(&c["name"]), text(&c["value"])))
                        .collect()
                })
                .unwrap_or_default(),
            taints: object["spec"]["taints"]
                .as_array()
                .map(|ts| {
                    ts.iter()
                        .map(|t| format!("{}:{}", text(&t["key"]), text(&t["effect"])))
                        .collect()
                })
                .unwrap_or_default(),
        }
    }

    /// Failing, as seed 001's operator asks: `Available` is not True (False or Unknown).
    pub fn failing(&self) -> bool {
        self.available != Status::True
    }
}

/// A ManifestWork as the page shows it: its three work-level conditions and every problem the
/// spoke reported, in the spoke's words.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkRow {
    pub cluster: String,
    pub name: String,
    pub manifests: usize,
    pub applied: Status,
    pub available: Status,
    pub degraded: Status,
    /// What is wrong, verbatim: "Applied=False (AppliedManifestWorkFailed): message", and for
    /// each manifest whose condition is bad, "#2 apps/v1 Deployment web/nginx: Applied=False
    /// (Reason): message". At most [`MAX_PROBLEMS_PER_WORK`].
    pub problems: Vec<String>,
}

/// Whether a condition's status is the bad one for its type: Degraded is bad when True, the
/// others when not True.
fn bad(type_: &str, status: Status) -> bool {
    if type_ == "Degraded" {
        status == Status::True
    } else {
        status != Status::True
    }
}

fn problem(prefix: &str, c: &Value) -> String {
    let mut line = format!(
        "{prefix}{}={}",
        c["type"].as_str().unwrap_or("?"),
        c["status"].as_str().unwrap_or("Unknown")
    );
    if let Some(reason) = c["reason"].as_str().filter(|r| !r.is_empty()) {
        line.push_str(&format!(" ({reason})"));
    }
    if let Some(message) = c["message"].as_str().filter(|m| !m.is_empty()) {
        line.push_str(": ");
        line.push_str(&bounded(message));
    }
    line
}

impl WorkRow {
    pub fn from_object(object: &Value) -> WorkRow {
        let mut problems = Vec::new();
        for c in object["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let type_ = c["type"].as_str().unwrap_or_default();
            if ["Applied", "Available", "Degraded"].contains(&type_)
                && bad(type_, status_of(Some(c)))
                && (c["message"].as_str().is_some_and(|m| !m.is_empty()) || type_ == "Degraded")
            {
                problems.push(problem("", c));
            }
        }
        for m in object["status"]["resourceStatus"]["manifests"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let meta = &m["resourceMeta"];
            let group = meta["group"].as_str().filter(|g| !g.is_empty());
            let version = meta["version"].as_str().unwrap_or_default();
            let gv = match group {
                Some(g) => format!("{g}/{version}"),
                None => version.to_string(),
            };
            let object_name = match meta["namespace"].as_str().filter(|n| !n.is_empty()) {
                Some(ns) => format!("{ns}/{}", meta["name"].as_str().unwrap_or_default()),
                None => text(&meta["name"]),
            };
            let prefix = format!(
                "#{} {gv} {} {object_name}: ",
                m["resourceMeta"]["ordinal"].as_i64().unwrap_or(0),
                meta["kind"].as_str().unwrap_or_default(),
            );
            for c in m["conditions"].as_array().into_iter().flatten() {
                let type_ = c["type"].as_str().unwrap_or_default();
                if bad(type_, status_of(Some(c)))
                    && ["Applied", "Available", "Degraded"].contains(&type_)
                {
                    problems.push(problem(&prefix, c));
                }
            }
        }
        problems.truncate(MAX_PROBLEMS_PER_WORK);
        WorkRow {
            cluster: text(&object["metadata"]["namespace"]),
            name: text(&object["metadata"]["name"]),
            manifests: object["spec"]["workload"]["manifests"]
                .as_array()
                .map_or(0, Vec::len),
            applied: status_of(condition(object, "Applied")),
            available: status_of(condition(object, "Available")),
            degraded: status_of(condition(object, "Degraded")),
            problems,
        }
    }

    /// Not applied, not available, or degraded.
    pub fn failing(&self) -> bool {
        self.applied != Status::True
            || self.available == Status::False
            || self.degraded == Status::True
    }
}

/// A Placement and what its decisions hold.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PlacementRow {
    pub namespace: String,
    pub name: String,
    pub selected: i64,
    /// Clusters in its PlacementDecisions (zero is seed 001's alert).
    pub decisions: usize,
    pub satisfied: Status,
    pub reason: String,
    pub message: String,
}

/// A ManifestWorkReplicaSet's rollout.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RolloutRow {
    pub namespace: String,
    pub name: String,
    pub placements: Vec<String>,
    pub total: i64,
    pub applied: i64,
    pub available: i64,
    pub degraded: i64,
    pub progressing: i64,
    /// `PlacementRolledOut`'s reason (Progressing, Complete, MaxFailuresExceeded), `Pending`
    /// before the controller wrote it.
    pub phase: String,
    pub message: String,
}

impl RolloutRow {
    pub fn from_object(object: &Value) -> RolloutRow {
        let summary = &object["status"]["summary"];
        let count = |f: &str| summary[f].as_i64().unwrap_or(0);
        let rolled_out = condition(object, "PlacementRolledOut");
        RolloutRow {
            namespace: text(&object["metadata"]["namespace"]),
            name: text(&object["metadata"]["name"]),
            placements: object["spec"]["placementRefs"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| text(&p["name"]))
                .collect(),
            total: summary["desiredTotal"]
                .as_i64()
                .filter(|t| *t > 0)
                .unwrap_or_else(|| count("total")),
            applied: count("applied"),
            available: count("available"),
            degraded: count("degraded"),
            progressing: count("progressing"),
            phase: rolled_out
                .and_then(|c| c["reason"].as_str())
                .unwrap_or("Pending")
                .to_string(),
            message: rolled_out.map(|c| text(&c["message"])).unwrap_or_default(),
        }
    }

    pub fn failing(&self) -> bool {
        self.phase == "MaxFailuresExceeded" || self.degraded > 0
    }
}

/// namespace/name of an object.
type Key = (String, String);

fn key(object: &Object) -> Key {
    (
        flotilla_store::namespace_of(object)
            .unwrap_or("")
            .to_string(),
        flotilla_store::name_of(object).to_string(),
    )
}

/// A Placement's own fields, before its decisions are counted in.
#[derive(Clone, Debug)]
struct PlacementOwn {
    selected: i64,
    satisfied: Status,
    reason: String,
    message: String,
}

/// Everything the page shows, one row per object.
#[derive(Default)]
pub struct Model {
    clusters: BTreeMap<String, ClusterRow>,
    /// By (cluster namespace, name): a cluster's works are one range.
    works: BTreeMap<Key, WorkRow>,
    placements: BTreeMap<Key, PlacementOwn>,
    /// PlacementDecision → (its placement's key, clusters it lists).
    decisions: HashMap<Key, (Key, usize)>,
    rollouts: BTreeMap<Key, RolloutRow>,
}

impl Model {
    /// Replaces every object of `kind` with `items` (a list).
    pub fn replace(&mut self, kind: Kind, items: Vec<Object>) {
        match kind {
            Kind::ManagedCluster => self.clusters.clear(),
            Kind::ManifestWork => self.works.clear(),
            Kind::Placement => self.placements.clear(),
            Kind::PlacementDecision => self.decisions.clear(),
            Kind::ManifestWorkReplicaSet => self.rollouts.clear(),
            _ => return,
        }
        for item in items {
            self.upsert(kind, &item);
        }
    }

    /// Applies one change of `kind`.
    pub fn apply(&mut self, kind: Kind, event: WatchEvent) {
        match event {
            WatchEvent::Added(o) | WatchEvent::Modified(o) => self.upsert(kind, &o),
            WatchEvent::Deleted(o) => self.remove(kind, &o),
        }
    }

    fn upsert(&mut self, kind: Kind, object: &Object) {
        let k = key(object);
        match kind {
            Kind::ManagedCluster => {
                self.clusters.insert(k.1, ClusterRow::from_object(object));
            }
            Kind::ManifestWork => {
                self.works.insert(k, WorkRow::from_object(object));
            }
            Kind::Placement => {
                let satisfied = condition(object, "PlacementSatisfied");
                self.placements.insert(
                    k,
                    PlacementOwn {
                        selected: object["status"]["numberOfSelectedClusters"]
                            .as_i64()
                            .unwrap_or(0),
                        satisfied: status_of(satisfied),
                        reason: satisfied.map(|c| text(&c["reason"])).unwrap_or_default(),
                        message: satisfied.map(|c| text(&c["message"])).unwrap_or_default(),
                    },
                );
            }
            Kind::PlacementDecision => {
                let placement = (
                    k.0.clone(),
                    text(&object["metadata"]["labels"][PLACEMENT_LABEL]),
                );
                let clusters = object["status"]["decisions"].as_array().map_or(0, Vec::len);
                self.decisions.insert(k, (placement, clusters));
            }
            Kind::ManifestWorkReplicaSet => {
                self.rollouts.insert(k, RolloutRow::from_object(object));
            }
            _ => {}
        }
    }

    fn remove(&mut self, kind: Kind, object: &Object) {
        let k = key(object);
        match kind {
            Kind::ManagedCluster => {
                self.clusters.remove(&k.1);
            }
            Kind::ManifestWork => {
                self.works.remove(&k);
            }
            Kind::Placement => {
                self.placements.remove(&k);
            }
            Kind::PlacementDecision => {
                self.decisions.remove(&k);
            }
            Kind::ManifestWorkReplicaSet => {
                self.rollouts.remove(&k);
            }
            _ => {}
        }
    }

    /// The fleet in numbers: the page's headline.
    pub fn summary(&self) -> Summary {
        let failing = self.clusters.values().filter(|c| c.failing()).count();
        let placements = self.placement_rows();
        Summary {
            clusters: self.clusters.len(),
            failing_clusters: failing,
            works: self.works.len(),
            failing_works: self.works.values().filter(|w| w.failing()).count(),
            placements: placements.len(),
            placements_without_decisions: placements.iter().filter(|p| p.decisions == 0).count(),
            rollouts: self.rollouts.len(),
            failing_rollouts: self.rollouts.values().filter(|r| r.failing()).count(),
        }
    }

    /// One page of the clusters `query` selects: failing ones first, longest failing first,
    /// then by name; each with its works' tally.
    pub fn clusters(&self, query: &ClusterQuery, page: PageRequest) -> Page<ClusterItem> {
        let mut matches: Vec<&ClusterRow> = self
            .clusters
            .values()
            .filter(|c| match query.state {
                ClusterState::All => true,
                ClusterState::Failing => c.failing(),
                ClusterState::Available => !c.failing(),
            })
            .filter(|c| query.name.as_deref().is_none_or(|n| c.name.contains(n)))
            .filter(|c| query.selector.matches(&c.labels))
            .collect();
        // Failing first, then the longest failing (oldest `since`) first: the answer to
        // "which clusters are failing right now, and since when?" is the top of the list.
        matches.sort_by(|a, b| {
            b.failing()
                .cmp(&a.failing())
                .then_with(|| {
                    if a.failing() {
                        a.since.cmp(&b.since)
                    } else {
                        std::cmp::Ordering::Equal
                    }
                })
                .then_with(|| a.name.cmp(&b.name))
        });
        Page::of(matches, page, |c| ClusterItem {
            works: self.work_tally(&c.name),
            cluster: c.clone(),
        })
    }

    fn work_tally(&self, cluster: &str) -> WorkTally {
        let range = (cluster.to_string(), String::new())..;
        let mut tally = WorkTally::default();
        for ((ns, _), w) in self.works.range(range) {
            if ns != cluster {
                break;
            }
            tally.total += 1;
            if w.applied == Status::True {
                tally.applied += 1;
            }
            if w.degraded == Status::True {
                tally.degraded += 1;
            }
            if w.failing() {
                tally.failing += 1;
            }
        }
        tally
    }

    /// One page of the works `query` selects, failing ones first, by cluster and name.
    pub fn works(&self, query: &WorkQuery, page: PageRequest) -> Page<WorkRow> {
        let rows: Box<dyn Iterator<Item = &WorkRow>> = match &query.cluster {
            Some(cluster) => Box::new(
                self.works
                    .range((cluster.clone(), String::new())..)
                    .take_while(move |((ns, _), _)| ns == cluster)
                    .map(|(_, w)| w),
            ),
            None => Box::new(self.works.values()),
        };
        let mut matches: Vec<&WorkRow> = rows
            .filter(|w| !query.failing || w.failing())
            .filter(|w| {
                query
                    .name
                    .as_deref()
                    .is_none_or(|n| w.name.contains(n) || w.cluster.contains(n))
            })
            .collect();
        // Stable: within failing and healthy, the map's cluster/name order stays.
        matches.sort_by_key(|w| !w.failing());
        Page::of(matches, page, WorkRow::clone)
    }

    fn placement_rows(&self) -> Vec<PlacementRow> {
        let mut decided: HashMap<&Key, usize> = HashMap::new();
        for (placement, clusters) in self.decisions.values() {
            *decided.entry(placement).or_default() += clusters;
        }
        self.placements
            .iter()
            .map(|(k, p)| PlacementRow {
                namespace: k.0.clone(),
                name: k.1.clone(),
                selected: p.selected,
                decisions: decided.get(k).copied().unwrap_or(0),
                satisfied: p.satisfied,
                reason: p.reason.clone(),
                message: p.message.clone(),
            })
            .collect()
    }

    /// One page of placements, those deciding no cluster first.
    pub fn placements(&self, query: &ListQuery, page: PageRequest) -> Page<PlacementRow> {
        let mut rows: Vec<PlacementRow> = self
            .placement_rows()
            .into_iter()
            .filter(|p| !query.failing || p.decisions == 0)
            .filter(|p| query.matches(&p.namespace, &p.name))
            .collect();
        rows.sort_by_key(|p| p.decisions != 0);
        Page::of(rows.iter().collect(), page, PlacementRow::clone)
    }

    /// One page of rollouts, stopped or degraded ones first.
    pub fn rollouts(&self, query: &ListQuery, page: PageRequest) -> Page<RolloutRow> {
        let mut rows: Vec<&RolloutRow> = self
            .rollouts
            .values()
            .filter(|r| !query.failing || r.failing())
            .filter(|r| query.matches(&r.namespace, &r.name))
            .collect();
        rows.sort_by_key(|r| !r.failing());
        Page::of(rows, page, RolloutRow::clone)
    }
}

/// Counts for the page's headline.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Summary {
    pub clusters: usize,
    pub failing_clusters: usize,
    pub works: usize,
    pub failing_works: usize,
    pub placements: usize,
    pub placements_without_decisions: usize,
    pub rollouts: usize,
    pub failing_rollouts: usize,
}

/// A cluster row with its works counted.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterItem {
    #[serde(flatten)]
    pub cluster: ClusterRow,
    pub works: WorkTally,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct WorkTally {
    pub total: usize,
    pub applied: usize,
    pub degraded: usize,
    pub failing: usize,
}

/// Which clusters a query selects by state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ClusterState {
    #[default]
    All,
    Failing,
    Available,
}

/// Filters of the clusters list.
#[derive(Clone, Debug, Default)]
pub struct ClusterQuery {
    pub state: ClusterState,
    /// Part of the name.
    pub name: Option<String>,
    pub selector: LabelSelector,
}

/// Filters of the works list.
#[derive(Clone, Debug, Default)]
pub struct WorkQuery {
    /// Only this cluster's works.
    pub cluster: Option<String>,
    pub failing: bool,
    /// Part of the work's or its cluster's name.
    pub name: Option<String>,
}

/// Filters of the placements and rollouts lists.
#[derive(Clone, Debug, Default)]
pub struct ListQuery {
    pub failing: bool,
    /// Part of "namespace/name".
    pub name: Option<String>,
}

impl ListQuery {
    fn matches(&self, namespace: &str, name: &str) -> bool {
        self.name
            .as_deref()
            .is_none_or(|n| format!("{namespace}/{name}").contains(n))
    }
}

/// kubectl's `-l` equality selectors: `k=v`, `k==v`, `k!=v`, `k` (exists), `!k`, comma-separated,
/// all must hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LabelSelector(Vec<Requirement>);

#[derive(Clone, Debug, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    Absent(String),
}

impl LabelSelector {
    pub fn parse(text: &str) -> Result<LabelSelector, String> {
        let mut requirements = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let requirement = if let Some((k, v)) = part.split_once("!=") {
                Requirement::NotEquals(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
                Requirement::Equals(k.trim().into(), v.trim().into())
            } else if let Some(k) = part.strip_prefix('!') {
                Requirement::Absent(k.trim().into())
            } else {
                Requirement::Exists(part.into())
            };
            let key = match &requirement {
                Requirement::Equals(k, _)
                | Requirement::NotEquals(k, _)
                | Requirement::Exists(k)
                | Requirement::Absent(k) => k,
            };
            if key.is_empty() || key.contains(char::is_whitespace) {
                return Err(format!(
                    "label selector {text:?}: {part:?} has no label key (write key=value, key!=value, key or !key)"
                ));
            }
            requirements.push(requirement);
        }
        Ok(LabelSelector(requirements))
    }

    /// Whether it selects everything.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.0.iter().all(|r| match r {
            Requirement::Equals(k, v) => labels.get(k) == Some(v),
            Requirement::NotEquals(k, v) => labels.get(k) != Some(v),
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::Absent(k) => !labels.contains_key(k),
        })
    }
}

/// Violated policies named per cluster row; the count says how many there are in all.
pub const MAX_NAMED_POLICIES: usize = 5;

/// A root Policy's compliance over the clusters a selector picks.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PolicyComplianceRow {
    pub namespace: String,
    pub name: String,
    /// The root's aggregate over every cluster it reaches (its `status.compliant`), whatever
    /// the selector; absent before any report.
    pub compliant: Option<ComplianceState>,
    /// The selected clusters it reaches.
    pub clusters: usize,
    /// Of those, the ones reporting NonCompliant.
    pub non_compliant: usize,
    /// Of those, the ones Pending or not reported yet.
    pub pending: usize,
}

/// One selected cluster's compliance over the policies it carries.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterComplianceRow {
    pub cluster: String,
    /// Root Policies it carries.
    pub policies: usize,
    /// Of those, the ones it reports NonCompliant.
    pub violated: usize,
    /// Of those, Pending or not reported yet.
    pub pending: usize,
    /// The first [`MAX_NAMED_POLICIES`] violated, `namespace/name`.
    pub violating: Vec<String>,
}

/// Compliance per policy and per cluster, failing first, one page of each.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ComplianceView {
    pub policies: Page<PolicyComplianceRow>,
    pub clusters: Page<ClusterComplianceRow>,
}

impl Model {
    /// The governance controller's `snapshot` seen through `selector` on the clusters' labels
    /// (a cluster the page has no row of has none): per policy, how many of the selected
    /// clusters it reaches violate it, most first (a policy reaching none of them is left out
    /// when the selector says anything); per selected cluster carrying a policy, how many it
    /// violates, most first. One page of each, by `page`.
    pub fn compliance(
        &self,
        snapshot: &ComplianceSnapshot,
        selector: &LabelSelector,
        page: PageRequest,
    ) -> ComplianceView {
        let no_labels = BTreeMap::new();
        let selected = |cluster: &str| {
            selector.matches(
                self.clusters
                    .get(cluster)
                    .map_or(&no_labels, |row| &row.labels),
            )
        };
        let mut policies = Vec::new();
        let mut clusters: BTreeMap<&str, ClusterComplianceRow> = BTreeMap::new();
        for root in &snapshot.policies {
            let mut row = PolicyComplianceRow {
                namespace: root.key.namespace.clone(),
                name: root.key.name.clone(),
                compliant: root.compliant,
                clusters: 0,
                non_compliant: 0,
                pending: 0,
            };
            for (cluster, compliant) in root.clusters.iter() {
                if !selected(cluster) {
                    continue;
                }
                row.clusters += 1;
                let entry =
                    clusters
                        .entry(cluster.as_str())
                        .or_insert_with(|| ClusterComplianceRow {
                            cluster: cluster.clone(),
                            policies: 0,
                            violated: 0,
                            pending: 0,
                            violating: Vec::new(),
                        });
                entry.policies += 1;
                match compliant {
                    Some(ComplianceState::NonCompliant) => {
                        row.non_compliant += 1;
                        entry.violated += 1;
                        if entry.violating.len() < MAX_NAMED_POLICIES {
                            entry.violating.push(root.key.to_string());
                        }
                    }
                    Some(ComplianceState::Compliant) => {}
                    _ => {
                        row.pending += 1;
                        entry.pending += 1;
                    }
                }
            }
            if row.clusters > 0 || selector.is_empty() {
                policies.push(row);
            }
        }
        // Failing first: most violations, then most without a verdict; then by name.
        policies.sort_by(|a, b| {
            (b.non_compliant, b.pending)
                .cmp(&(a.non_compliant, a.pending))
                .then_with(|| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)))
        });
        let mut clusters: Vec<ClusterComplianceRow> = clusters.into_values().collect();
        clusters.sort_by(|a, b| {
            (b.violated, b.pending)
                .cmp(&(a.violated, a.pending))
                .then_with(|| a.cluster.cmp(&b.cluster))
        });
        ComplianceView {
            policies: Page::of(policies.iter().collect(), page, PolicyComplianceRow::clone),
            clusters: Page::of(clusters.iter().collect(), page, ClusterComplianceRow::clone),
        }
    }
}

/// Rows per page unless the request says otherwise.
pub const DEFAULT_PAGE_SIZE: usize = 50;
/// Most rows one page may hold: no request ships the whole fleet.
pub const MAX_PAGE_SIZE: usize = 500;

/// Which page a request wants (1-based) and how long pages are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageRequest {
    pub page: usize,
    pub limit: usize,
}

impl Default for PageRequest {
    fn default() -> Self {
        PageRequest {
            page: 1,
            limit: DEFAULT_PAGE_SIZE,
        }
    }
}

/// One page of a list, with what it takes to ask for the others.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Page<T> {
    /// Rows matching the filters, on every page together.
    pub total: usize,
    pub page: usize,
    pub pages: usize,
    pub limit: usize,
    pub items: Vec<T>,
}

impl<T> Page<T> {
    fn of<R>(rows: Vec<&R>, request: PageRequest, row: impl Fn(&R) -> T) -> Page<T> {
        let limit = request.limit.clamp(1, MAX_PAGE_SIZE);
        let pages = rows.len().div_ceil(limit).max(1);
        let page = request.page.clamp(1, pages);
        Page {
            total: rows.len(),
            page,
            pages,
            limit,
            items: rows
                .into_iter()
                .skip((page - 1) * limit)
                .take(limit)
                .map(row)
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::sync::Arc;

    fn cluster(name: &str, available: Option<(&str, &str)>, labels: Value) -> Value {
        let conditions = match available {
            Some((status, since)) => json!([{
                "type": AVAILABLE, "status": status, "lastTransitionTime": since,
                "reason": "R", "message": format!("{name} is {status}"),
            }]),
            None => json!([]),
        };
        json!({
            "metadata": {"name": name, "labels": labels, "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"hubAcceptsClient": true},
            "status": {"conditions": conditions},
        })
    }

    fn fleet() -> Model {
        let mut model = Model::default();
        model.replace(
            Kind::ManagedCluster,
            vec![
                cluster(
                    "a",
                    Some(("True", "2026-11-01T00:00:00Z")),
                    json!({"env": "prod"}),
                ),
                cluster(
                    "b",
                    Some(("False", "2026-11-20T10:00:00Z")),
                    json!({"env": "prod"}),
                ),
                cluster(
                    "c",
                    Some(("Unknown", "2026-11-19T10:00:00Z")),
                    json!({"env": "dev"}),
                ),
                cluster("d", None, json!({})),
            ],
        );
        model
    }

    fn names(page: &Page<ClusterItem>) -> Vec<&str> {
        page.items.iter().map(|c| c.cluster.name.as_str()).collect()
    }

    #[test]
    fn failing_clusters_come_first_longest_failing_first() {
        let model = fleet();
        let all = model.clusters(&ClusterQuery::default(), PageRequest::default());
        // d never reported: failing since its registration, the oldest.
        assert_eq!(names(&all), ["d", "c", "b", "a"]);
        assert!(all.items[0].cluster.never_reported);
        let failing = model.clusters(
            &ClusterQuery {
                state: ClusterState::Failing,
                ..Default::default()
            },
            PageRequest::default(),
        );
        assert_eq!(names(&failing), ["d", "c", "b"]);
        assert_eq!(
            failing.items[1].cluster.since,
            Some("2026-11-19T10:00:00Z".parse().unwrap())
        );
        assert_eq!(model.summary().failing_clusters, 3);
    }

    #[test]
    fn filters_by_name_and_labels_and_pages_are_bounded() {
        let model = fleet();
        let check = |selector: &str, name: Option<&str>, expected: &[&str]| {
            let query = ClusterQuery {
                state: ClusterState::All,
                name: name.map(str::to_string),
                selector: LabelSelector::parse(selector).unwrap(),
            };
            let page = model.clusters(&query, PageRequest::default());
            assert_eq!(
                names(&page),
                expected,
                "selector {selector:?} name {name:?}"
            );
        };
        check("env=prod", None, &["b", "a"]);
        check("env!=prod", None, &["d", "c"]);
        check("env", None, &["c", "b", "a"]);
        check("!env", None, &["d"]);
        check("env==dev", Some("c"), &["c"]);
        check("", Some("zz"), &[]);
        assert!(
            LabelSelector::parse("=x")
                .unwrap_err()
                .contains("no label key")
        );

        let second = model.clusters(&ClusterQuery::default(), PageRequest { page: 2, limit: 3 });
        assert_eq!((second.total, second.pages, second.page), (4, 2, 2));
        assert_eq!(names(&second), ["a"]);
        // A page beyond the last is the last; a huge limit is capped.
        let beyond = model.clusters(
            &ClusterQuery::default(),
            PageRequest {
                page: 99,
                limit: usize::MAX,
            },
        );
        assert_eq!((beyond.page, beyond.limit), (1, MAX_PAGE_SIZE));
    }

    #[test]
    fn a_works_problems_are_the_spokes_words_and_count_for_its_cluster() {
        let mut model = fleet();
        let work = json!({
            "metadata": {"namespace": "b", "name": "web"},
            "spec": {"workload": {"manifests": [{}, {}]}},
            "status": {
                "conditions": [
                    {"type": "Applied", "status": "False", "reason": "AppliedManifestWorkFailed",
                     "message": "Failed to apply manifest work"},
                    {"type": "Degraded", "status": "True", "reason": "Degraded"},
                ],
                "resourceStatus": {"manifests": [{
                    "resourceMeta": {"ordinal": 1, "group": "apps", "version": "v1",
                                     "kind": "Deployment", "namespace": "web", "name": "nginx"},
                    "conditions": [{"type": "Applied", "status": "False", "reason": "AppliedManifestFailed",
                                    "message": "deployments.apps \"nginx\" is forbidden: <b>quota</b>"}],
                }]},
            },
        });
        model.apply(Kind::ManifestWork, WatchEvent::Added(work.clone()));
        model.apply(
            Kind::ManifestWork,
            WatchEvent::Added(json!({"metadata": {"namespace": "b", "name": "ok"},
                "status": {"conditions": [{"type": "Applied", "status": "True"}]}})),
        );
        let page = model.works(
            &WorkQuery {
                failing: true,
                ..Default::default()
            },
            PageRequest::default(),
        );
        assert_eq!(page.total, 1);
        assert_eq!(
            page.items[0].problems,
            [
                "Applied=False (AppliedManifestWorkFailed): Failed to apply manifest work",
                "Degraded=True (Degraded)",
                "#1 apps/v1 Deployment web/nginx: Applied=False (AppliedManifestFailed): \
                 deployments.apps \"nginx\" is forbidden: <b>quota</b>",
            ]
        );
        let b = model.clusters(
            &ClusterQuery {
                name: Some("b".into()),
                ..Default::default()
            },
            PageRequest::default(),
        );
        assert_eq!(
            b.items[0].works,
            WorkTally {
                total: 2,
                applied: 1,
                degraded: 1,
                failing: 1
            }
        );
        model.apply(Kind::ManifestWork, WatchEvent::Deleted(work));
        assert_eq!(model.summary().failing_works, 0);
    }

    #[test]
    fn a_huge_message_keeps_its_start_and_says_what_was_cut() {
        assert_eq!(bounded("short"), "short");
        let long = format!("{}é{}", "x".repeat(MAX_MESSAGE_BYTES - 1), "y".repeat(100));
        let kept = bounded(&long);
        // Cut on a character boundary, before the two-byte é.
        assert!(kept.starts_with(&"x".repeat(MAX_MESSAGE_BYTES - 1)));
        assert!(kept.ends_with("… (102 more bytes; `flotilla get` with -o yaml shows all of it)"));
        let work = json!({"metadata": {"namespace": "a", "name": "w"}, "status": {"conditions": [
            {"type": "Applied", "status": "False", "message": long}]}});
        let row = WorkRow::from_object(&work);
        assert!(row.problems[0].len() < MAX_MESSAGE_BYTES + 200);
    }

    #[test]
    fn placements_count_their_decisions_and_those_without_come_first() {
        let mut model = Model::default();
        let placement = |name: &str| json!({"metadata": {"namespace": "ops", "name": name}});
        model.replace(Kind::Placement, vec![placement("all"), placement("none")]);
        let decision = |name: &str, placement: &str, clusters: usize| {
            json!({"metadata": {"namespace": "ops", "name": name,
                    "labels": {PLACEMENT_LABEL: placement}},
                   "status": {"decisions": vec![json!({"clusterName": "x"}); clusters]}})
        };
        model.replace(
            Kind::PlacementDecision,
            vec![decision("all-1", "all", 100), decision("all-2", "all", 3)],
        );
        let page = model.placements(&ListQuery::default(), PageRequest::default());
        let rows: Vec<(&str, usize)> = page
            .items
            .iter()
            .map(|p| (p.name.as_str(), p.decisions))
            .collect();
        assert_eq!(rows, [("none", 0), ("all", 103)]);
        assert_eq!(model.summary().placements_without_decisions, 1);
    }

    #[test]
    fn stopped_rollouts_come_first_with_their_counts() {
        let mut model = Model::default();
        let set = |name: &str, reason: Option<&str>, degraded: i64| {
            let conditions: Vec<Value> = reason
                .map(|r| {
                    json!({"type": "PlacementRolledOut", "status": "False", "reason": r,
                                "message": format!("{name}: {r}")})
                })
                .into_iter()
                .collect();
            json!({"metadata": {"namespace": "ops", "name": name},
                   "spec": {"placementRefs": [{"name": "all"}]},
                   "status": {"conditions": conditions, "summary": {
                       "total": 10, "desiredTotal": 12, "applied": 9, "available": 8,
                       "degraded": degraded, "progressing": 1}}})
        };
        model.replace(
            Kind::ManifestWorkReplicaSet,
            vec![
                set("a-done", Some("Complete"), 0),
                set("b-new", None, 0),
                set("c-stopped", Some("MaxFailuresExceeded"), 2),
            ],
        );
        let page = model.rollouts(&ListQuery::default(), PageRequest::default());
        let rows: Vec<(&str, &str)> = page
            .items
            .iter()
            .map(|r| (r.name.as_str(), r.phase.as_str()))
            .collect();
        assert_eq!(
            rows,
            [
                ("c-stopped", "MaxFailuresExceeded"),
                ("a-done", "Complete"),
                ("b-new", "Pending")
            ]
        );
        let stopped = &page.items[0];
        assert_eq!(
            (
                stopped.total,
                stopped.applied,
                stopped.available,
                stopped.degraded
            ),
            (12, 9, 8, 2)
        );
        assert_eq!(stopped.placements, ["all"]);
        let failing = model.rollouts(
            &ListQuery {
                failing: true,
                name: None,
            },
            PageRequest::default(),
        );
        assert_eq!(failing.total, 1);
        assert_eq!(model.summary().failing_rollouts, 1);
    }

    #[test]
    fn compliance_is_counted_over_the_selected_clusters_failing_first() {
        use crate::controllers::governance::RootCompliance;
        use crate::controllers::scheduling::fleet::Key;
        use ComplianceState::*;
        let mut model = Model::default();
        model.replace(
            Kind::ManagedCluster,
            vec![
                cluster("a", None, json!({"env": "prod"})),
                cluster("b", None, json!({"env": "prod"})),
                cluster("c", None, json!({"env": "dev"})),
            ],
        );
        let root = |name: &str, clusters: &[(&str, Option<ComplianceState>)]| RootCompliance {
            key: Key::new("policies", name),
            compliant: None,
            clusters: Arc::new(clusters.iter().map(|(c, s)| (c.to_string(), *s)).collect()),
        };
        let snapshot = ComplianceSnapshot {
            policies: vec![
                root(
                    "p1",
                    &[
                        ("a", Some(NonCompliant)),
                        ("b", Some(Compliant)),
                        ("c", Some(NonCompliant)),
                    ],
                ),
                root("p2", &[("a", Some(NonCompliant)), ("b", None)]),
                root("p3", &[("c", Some(Compliant))]),
            ],
        };
        let policies = |view: &ComplianceView| -> Vec<(String, usize, usize, usize)> {
            view.policies
                .items
                .iter()
                .map(|p| (p.name.clone(), p.non_compliant, p.pending, p.clusters))
                .collect()
        };
        let clusters = |view: &ComplianceView| -> Vec<(String, usize, usize, usize)> {
            view.clusters
                .items
                .iter()
                .map(|c| (c.cluster.clone(), c.violated, c.pending, c.policies))
                .collect()
        };
        let owned = |rows: &[(&str, usize, usize, usize)]| -> Vec<(String, usize, usize, usize)> {
            rows.iter()
                .map(|(n, a, b, c)| (n.to_string(), *a, *b, *c))
                .collect()
        };
        let all = model.compliance(&snapshot, &LabelSelector::default(), PageRequest::default());
        assert_eq!(
            policies(&all),
            owned(&[("p1", 2, 0, 3), ("p2", 1, 1, 2), ("p3", 0, 0, 1)])
        );
        assert_eq!(
            clusters(&all),
            owned(&[("a", 2, 0, 2), ("c", 1, 0, 2), ("b", 0, 1, 2)])
        );
        assert_eq!(
            all.clusters.items[0].violating,
            ["policies/p1", "policies/p2"]
        );

        // Only the prod clusters count; p3 reaches none of them and is left out.
        let prod = LabelSelector::parse("env=prod").unwrap();
        let view = model.compliance(&snapshot, &prod, PageRequest::default());
        assert_eq!(policies(&view), owned(&[("p2", 1, 1, 2), ("p1", 1, 0, 2)]));
        assert_eq!(clusters(&view), owned(&[("a", 2, 0, 2), ("b", 0, 1, 2)]));

        // Bounded: one page of each.
        let first = model.compliance(
            &snapshot,
            &LabelSelector::default(),
            PageRequest { page: 1, limit: 1 },
        );
        assert_eq!((first.policies.total, first.policies.items.len()), (3, 1));
        assert_eq!((first.clusters.total, first.clusters.items.len()), (3, 1));
        assert_eq!(first.clusters.items[0].cluster, "a");
    }
}
