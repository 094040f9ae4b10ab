//! The scheduling decision, with no IO: which clusters a Placement selects, how they are split
//! into decision groups and PlacementDecision objects, and what the Placement's status says.
//! OCM v1beta1 semantics throughout (its scheduler's filters, prioritizers and grouping); time
//! comes in as `now`.
//!
//! The decision is three steps, each usable on its own so that the [`super::fleet`] model can
//! redo only the step a change touches:
//!
//! 1. [`compile`]: the placement's spec, checked once (selectors, tolerations, prioritizers,
//!    group strategy); a spec that cannot be evaluated is [`Misconfigured`].
//! 2. [`filter`]: one cluster against a compiled placement (predicates, taints and tolerations,
//!    with the time a toleration runs out).
//! 3. [`select`]: rank the clusters that passed when more passed than `numberOfClusters`
//!    (prioritizers: Steady, Balance, ResourceAllocatableCPU/Memory, AddOn scores), then
//!    [`group`] and [`decision_objects`].
//!
//! [`schedule`] runs all three over a whole world; tests use it, and the model must agree with it.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};

use flotilla_proto::api::quantity::parse_quantity;
use flotilla_proto::api::{
    AddOnPlacementScoreStatus, ClusterDecision, ClusterSelector, DecisionGroupStatus,
    ManagedCluster, ManagedClusterSetSpec, Placement, PrioritizerPolicyMode, ScoreCoordinateType,
    SelectorType, Taint, TaintEffect, Toleration, TolerationOperator,
};
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::selector::Selector;

/// Most cluster decisions in one PlacementDecision (OCM's `maxNumOfClusterDecisions`).
pub const MAX_DECISIONS_PER_OBJECT: usize = 100;

/// The highest score a prioritizer gives (OCM's `MaxClusterScore`).
const MAX_SCORE: i64 = 100;

/// A managed cluster as the scheduler sees it: what predicates, taints and prioritizers read.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Cluster {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// `status.clusterClaims` by name.
    pub claims: BTreeMap<String, String>,
    pub taints: Vec<Taint>,
    /// Allocatable and capacity CPU (cores), when both are reported.
    pub cpu: Option<Resource>,
    /// Allocatable and capacity memory (bytes), when both are reported.
    pub memory: Option<Resource>,
    /// Being deleted: never selected.
    pub deleting: bool,
}

/// A resource's allocatable amount and capacity, in base units.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Resource {
    pub allocatable: f64,
    pub capacity: f64,
}

impl Cluster {
    /// What the scheduler reads of a stored ManagedCluster.
    pub fn from_managed_cluster(mc: &ManagedCluster) -> Cluster {
        let status = mc.status.clone().unwrap_or_default();
        let resource = |name: &str| {
            let a = status
                .allocatable
                .get(name)
                .and_then(|q| parse_quantity(&q.0))?;
            let c = status
                .capacity
                .get(name)
                .and_then(|q| parse_quantity(&q.0))?;
            Some(Resource {
                allocatable: a.as_f64(),
                capacity: c.as_f64(),
            })
        };
        Cluster {
            name: mc.metadata.name.clone().unwrap_or_default(),
            labels: mc.metadata.labels.clone().unwrap_or_default(),
            claims: status
                .cluster_claims
                .iter()
                .map(|c| (c.name.clone(), c.value.clone()))
                .collect(),
            taints: mc.spec.taints.clone(),
            cpu: resource("cpu"),
            memory: resource("memory"),
            deleting: mc.metadata.deletion_timestamp.is_some(),
        }
    }
}

/// Which clusters a ManagedClusterSet holds, compiled.
#[derive(Clone, Debug, PartialEq)]
pub enum SetRule {
    /// `ExclusiveClusterSetLabel`: clusters labelled `cluster.open-cluster-management.io/clusterset: <set>`.
    Label(String),
    /// `LabelSelector`: clusters matching it (`{}` matches all: OCM's `global` set).
    Selector(Selector),
}

impl SetRule {
    /// The rule of set `name`. A selector that does not compile selects nothing (and the error
    /// is returned for the log).
    pub fn from_spec(name: &str, spec: &ManagedClusterSetSpec) -> (SetRule, Option<String>) {
        let selector = spec.cluster_selector.clone().unwrap_or_default();
        match selector.selector_type.unwrap_or_default() {
            SelectorType::ExclusiveClusterSetLabel => (SetRule::Label(name.to_string()), None),
            SelectorType::LabelSelector => match &selector.label_selector {
                None => (SetRule::Selector(Selector::nothing()), None),
                Some(ls) => match Selector::from_labels(ls) {
                    Ok(s) => (SetRule::Selector(s), None),
                    Err(e) => (SetRule::Selector(Selector::nothing()), Some(e)),
                },
            },
        }
    }

    pub fn contains(&self, cluster: &Cluster) -> bool {
        match self {
            SetRule::Label(set) => {
                cluster
                    .labels
                    .get(flotilla_proto::api::CLUSTER_SET_LABEL)
                    .map(String::as_str)
                    == Some(set.as_str())
            }
            SetRule::Selector(s) => s.matches_map(&cluster.labels),
        }
    }
}

/// Why a placement cannot be evaluated: the `PlacementMisconfigured` condition's message is
/// `<plugin>:<message>`, as OCM writes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Misconfigured {
    pub plugin: &'static str,
    pub message: String,
}

impl std::fmt::Display for Misconfigured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.plugin, self.message)
    }
}

/// A prioritizer a placement uses.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Prioritizer {
    /// Favours clusters that few other placements selected.
    Balance,
    /// Favours the clusters already selected, so decisions stay put.
    Steady,
    /// Favours clusters with more allocatable CPU.
    AllocatableCpu,
    /// Favours clusters with more allocatable memory.
    AllocatableMemory,
    /// Reads score `score` of the AddOnPlacementScore `resource` in each cluster's namespace.
    AddOn { resource: String, score: String },
}

/// A cluster predicate: label and claim selectors, ANDed.
#[derive(Clone, Debug, PartialEq)]
pub struct Predicate {
    pub labels: Selector,
    pub claims: Selector,
}

impl Predicate {
    fn compile(selector: &ClusterSelector) -> Result<Predicate, Misconfigured> {
        let bad = |message: String| Misconfigured {
            plugin: "Predicate",
            message,
        };
        if selector
            .cel_selector
            .as_ref()
            .is_some_and(|c| !c.cel_expressions.is_empty())
        {
            return Err(bad(
                "celSelector is not supported by this hub; select with labelSelector and claimSelector"
                    .to_string(),
            ));
        }
        Ok(Predicate {
            labels: match &selector.label_selector {
                Some(ls) => Selector::from_labels(ls).map_err(bad)?,
                None => Selector::everything(),
            },
            claims: match &selector.claim_selector {
                Some(cs) => Selector::from_claims(cs).map_err(bad)?,
                None => Selector::everything(),
            },
        })
    }

    fn matches(&self, cluster: &Cluster) -> bool {
        self.labels.matches_map(&cluster.labels) && self.claims.matches_map(&cluster.claims)
    }
}

/// A placement's spec, checked and compiled.
#[derive(Clone, Debug, PartialEq)]
pub struct Compiled {
    /// `spec.clusterSets`: empty means every set bound to the namespace.
    pub cluster_sets: Vec<String>,
    /// ORed; empty selects every cluster of the eligible sets.
    pub predicates: Vec<Predicate>,
    pub tolerations: Vec<Toleration>,
    pub number_of_clusters: Option<usize>,
    /// Prioritizers with a non-zero weight, in a stable order.
    pub prioritizers: Vec<(Prioritizer, i64)>,
    /// `spec.decisionStrategy.groupStrategy`.
    pub groups: Vec<(String, Predicate)>,
    pub clusters_per_group: Option<IntOrString>,
}

impl Compiled {
    /// Whether ranking matters: more candidates than the placement takes.
    pub fn truncates(&self, candidates: usize) -> bool {
        self.number_of_clusters.is_some_and(|n| n < candidates)
    }

    /// The AddOnPlacementScore resource names this placement reads.
    pub fn addon_resources(&self) -> impl Iterator<Item = &str> {
        self.prioritizers.iter().filter_map(|(p, _)| match p {
            Prioritizer::AddOn { resource, .. } => Some(resource.as_str()),
            _ => None,
        })
    }
}

/// Checks a placement's spec: the errors OCM reports as `PlacementMisconfigured`.
pub fn compile(placement: &Placement) -> Result<Compiled, Misconfigured> {
    // OCM's fields flotilla does not implement: said in the condition, not silently ignored.
    if let Err(unsupported) = flotilla_proto::api::validate_placement(placement) {
        return Err(Misconfigured {
            plugin: "",
            message: unsupported
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
        });
    }
    let spec = &placement.spec;
    let predicates = spec
        .predicates
        .iter()
        .map(|p| Predicate::compile(&p.required_cluster_selector.clone().unwrap_or_default()))
        .collect::<Result<Vec<_>, _>>()?;
    for t in &spec.tolerations {
        let operator = t.operator.unwrap_or_default();
        if t.key.is_empty() && operator != TolerationOperator::Exists {
            return Err(Misconfigured {
                plugin: "TaintToleration",
                message: "If the key is empty, operator must be Exists.".to_string(),
            });
        }
        if operator == TolerationOperator::Exists && !t.value.is_empty() {
            return Err(Misconfigured {
                plugin: "TaintToleration",
                message: "If the operator is Exists, the value should be empty.".to_string(),
            });
        }
    }
    let number_of_clusters = match spec.number_of_clusters {
        Some(n) if n < 0 => {
            return Err(Misconfigured {
                plugin: "",
                message: format!("numberOfClusters {n} must not be negative"),
            });
        }
        n => n.map(|n| n as usize),
    };
    // Weights: OCM's defaults (Balance and Steady at 1) unless the mode is Exact, then the
    // configured ones on top; weight 0 turns a prioritizer off.
    let policy = spec.prioritizer_policy.clone().unwrap_or_default();
    let mut weights: BTreeMap<Prioritizer, i64> = BTreeMap::new();
    if policy.mode.unwrap_or_default() == PrioritizerPolicyMode::Additive {
        weights.insert(Prioritizer::Balance, 1);
        weights.insert(Prioritizer::Steady, 1);
    }
    for c in &policy.configurations {
        let coordinate = &c.score_coordinate;
        let prioritizer = match coordinate.type_ {
            ScoreCoordinateType::BuiltIn => match coordinate.built_in.as_str() {
                "Balance" => Prioritizer::Balance,
                "Steady" => Prioritizer::Steady,
                "ResourceAllocatableCPU" => Prioritizer::AllocatableCpu,
                "ResourceAllocatableMemory" => Prioritizer::AllocatableMemory,
                other => {
                    return Err(Misconfigured {
                        plugin: "",
                        message: format!("incorrect builtin prioritizer: {other}"),
                    });
                }
            },
            ScoreCoordinateType::AddOn => match &coordinate.add_on {
                Some(a) if !a.resource_name.is_empty() && !a.score_name.is_empty() => {
                    Prioritizer::AddOn {
                        resource: a.resource_name.clone(),
                        score: a.score_name.clone(),
                    }
                }
                _ => {
                    return Err(Misconfigured {
                        plugin: "",
                        message: "addOn should not be empty".to_string(),
                    });
                }
            },
        };
        let weight = i64::from(c.weight.unwrap_or(1));
        if !(-10..=10).contains(&weight) {
            return Err(Misconfigured {
                plugin: "",
                message: format!("prioritizer weight {weight} is outside [-10, 10]"),
            });
        }
        weights.insert(prioritizer, weight);
    }
    let strategy = spec
        .decision_strategy
        .clone()
        .and_then(|d| d.group_strategy)
        .unwrap_or_default();
    let groups = strategy
        .decision_groups
        .iter()
        .map(|g| {
            Ok((
                g.group_name.clone(),
                Predicate::compile(&g.group_cluster_selector.clone().into())?,
            ))
        })
        .collect::<Result<Vec<_>, Misconfigured>>()?;
    if let Some(IntOrString::String(s)) = &strategy.clusters_per_decision_group
        && percentage(s).is_none()
    {
        return Err(Misconfigured {
            plugin: "",
            message: format!("{s:?} invalid type: string is not a percentage"),
        });
    }
    Ok(Compiled {
        cluster_sets: spec.cluster_sets.clone(),
        predicates,
        tolerations: spec.tolerations.clone(),
        number_of_clusters,
        prioritizers: weights.into_iter().filter(|(_, w)| *w != 0).collect(),
        groups,
        clusters_per_group: strategy.clusters_per_decision_group,
    })
}

fn percentage(s: &str) -> Option<f64> {
    s.strip_suffix('%')?.parse::<f64>().ok()
}

/// Whether a cluster that passed the predicates may be selected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allowed {
    Always,
    /// Only if the placement already selects it (an untolerated `NoSelectIfNew` taint).
    IfSelected,
    Never,
}

/// One cluster against a compiled placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub allowed: Allowed,
    /// When a toleration this verdict relies on runs out: decide again then.
    pub recheck_at: Option<Timestamp>,
}

impl Verdict {
    const NEVER: Verdict = Verdict {
        allowed: Allowed::Never,
        recheck_at: None,
    };
}

/// Filters one cluster: not being deleted, matching a predicate (any), and every taint either
/// harmless (`PreferNoSelect`), tolerated (until `timeAdded + tolerationSeconds`), or an
/// untolerated `NoSelectIfNew` (then only if already selected).
pub fn filter(placement: &Compiled, cluster: &Cluster, now: Timestamp) -> Verdict {
    if !placement.predicates.is_empty() && !placement.predicates.iter().any(|p| p.matches(cluster))
    {
        return Verdict::NEVER;
    }
    admit(placement, cluster, now)
}

/// [`filter`] for a cluster already known to pass the placement's predicates (the model finds
/// those from its label and claim indexes): whether it is being deleted, and its taints
/// against the placement's tolerations.
pub fn admit(placement: &Compiled, cluster: &Cluster, now: Timestamp) -> Verdict {
    if cluster.deleting {
        return Verdict::NEVER;
    }
    let mut verdict = Verdict {
        allowed: Allowed::Always,
        recheck_at: None,
    };
    for taint in &cluster.taints {
        if taint.effect == TaintEffect::PreferNoSelect {
            continue;
        }
        match tolerated(taint, &placement.tolerations, now) {
            Some(until) => {
                if let Some(until) = until {
                    verdict.recheck_at = Some(verdict.recheck_at.map_or(until, |r| r.min(until)));
                }
            }
            None if taint.effect == TaintEffect::NoSelectIfNew => {
                verdict.allowed = Allowed::IfSelected;
            }
            None => return Verdict::NEVER,
        }
    }
    verdict
}

/// `Some(until)` if a toleration matches the taint now (`until` when it runs out), `None` if
/// none does.
fn tolerated(
    taint: &Taint,
    tolerations: &[Toleration],
    now: Timestamp,
) -> Option<Option<Timestamp>> {
    let mut best: Option<Option<Timestamp>> = None;
    for t in tolerations {
        if t.effect.is_some_and(|e| e != taint.effect) {
            continue;
        }
        if !t.key.is_empty() && t.key != taint.key {
            continue;
        }
        let matched = match t.operator.unwrap_or_default() {
            TolerationOperator::Equal => t.value == taint.value,
            TolerationOperator::Exists => true,
        };
        if !matched {
            continue;
        }
        let until = match t.toleration_seconds {
            None => None,
            Some(secs) => {
                // A taint without timeAdded has been there "forever" (OCM reads Go's zero time).
                let added = taint
                    .time_added
                    .as_ref()
                    .map_or(Timestamp::UNIX_EPOCH, |t| t.0);
                let until = added.saturating_add(SignedDuration::from_secs(secs)).ok()?;
                if now >= until {
                    continue;
                }
                Some(until)
            }
        };
        // The most lenient toleration wins: forever beats a deadline, a later deadline an earlier.
        best = Some(match (best, until) {
            (Some(None), _) | (_, None) => None,
            (Some(Some(a)), Some(b)) => Some(a.max(b)),
            (None, b) => b,
        });
    }
    best
}

/// An AddOnPlacementScore's score for one cluster: its value, or nothing when absent or expired.
pub fn addon_score(
    status: Option<&AddOnPlacementScoreStatus>,
    score: &str,
    now: Timestamp,
) -> (i64, Option<Timestamp>) {
    let Some(status) = status else {
        return (0, None);
    };
    let valid_until = status.valid_until.as_ref().map(|t| t.0);
    if valid_until.is_some_and(|v| now > v) {
        return (0, None);
    }
    let value = status
        .scores
        .iter()
        .find(|s| s.name == score)
        .map_or(0, |s| i64::from(s.value));
    (value, valid_until)
}

/// What ranking reads besides the clusters themselves.
pub struct RankingInputs<'a> {
    /// Whether the placement currently selects the cluster (Steady, `NoSelectIfNew`).
    pub selected: &'a dyn Fn(&str) -> bool,
    /// How many other placements' decisions name the cluster (Balance), and the most any
    /// cluster has.
    pub others: &'a dyn Fn(&str) -> u32,
    pub others_max: u32,
    /// The AddOnPlacementScore `(cluster namespace, resource name)`.
    pub score: &'a dyn Fn(&str, &str) -> Option<&'a AddOnPlacementScoreStatus>,
    pub now: Timestamp,
}

/// The clusters a placement selects, ranked, and when to decide again.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Selection {
    /// Selected cluster names, in rank order (name order when nothing was ranked).
    pub clusters: Vec<String>,
    /// How many of the requested clusters could not be selected.
    pub unscheduled: usize,
    /// Candidates that passed the filters.
    pub feasible: usize,
    /// A score expires (AddOn `validUntil`): rank again then.
    pub recheck_at: Option<Timestamp>,
}

/// Selects from the clusters that passed [`filter`] (with their verdicts): `IfSelected` ones only
/// if already selected; when more remain than `numberOfClusters`, ranked by the weighted sum of
/// the prioritizers' scores (ties by name) and cut.
pub fn select(
    placement: &Compiled,
    candidates: &[(&Cluster, Verdict)],
    inputs: &RankingInputs<'_>,
) -> Selection {
    let feasible: Vec<&Cluster> = candidates
        .iter()
        .filter(|(c, v)| match v.allowed {
            Allowed::Always => true,
            Allowed::IfSelected => (inputs.selected)(&c.name),
            Allowed::Never => false,
        })
        .map(|(c, _)| *c)
        .collect();
    let wanted = placement.number_of_clusters.unwrap_or(feasible.len());
    let mut selection = Selection {
        feasible: feasible.len(),
        unscheduled: wanted.saturating_sub(feasible.len()),
        ..Selection::default()
    };
    if !placement.truncates(feasible.len()) {
        let mut names: Vec<String> = feasible.iter().map(|c| c.name.clone()).collect();
        names.sort_unstable();
        selection.clusters = names;
        return selection;
    }
    let mut totals: Vec<(i64, &Cluster)> = feasible.iter().map(|c| (0, *c)).collect();
    for (prioritizer, weight) in &placement.prioritizers {
        let scores = scores(prioritizer, &feasible, inputs, &mut selection.recheck_at);
        for ((total, _), score) in totals.iter_mut().zip(scores) {
            *total += weight * score;
        }
    }
    totals.sort_by(|(a, ca), (b, cb)| match b.cmp(a) {
        Ordering::Equal => ca.name.cmp(&cb.name),
        o => o,
    });
    selection.clusters = totals
        .into_iter()
        .take(wanted)
        .map(|(_, c)| c.name.clone())
        .collect();
    selection
}

/// One prioritizer's scores for `clusters`, in order, each in [-100, 100] (OCM's formulas,
/// including Go's truncation towards zero).
fn scores(
    prioritizer: &Prioritizer,
    clusters: &[&Cluster],
    inputs: &RankingInputs<'_>,
    recheck_at: &mut Option<Timestamp>,
) -> Vec<i64> {
    match prioritizer {
        Prioritizer::Steady => clusters
            .iter()
            .map(|c| {
                if (inputs.selected)(&c.name) {
                    MAX_SCORE
                } else {
                    0
                }
            })
            .collect(),
        Prioritizer::Balance => clusters
            .iter()
            .map(|c| match (inputs.others)(&c.name) {
                0 => MAX_SCORE,
                count => {
                    let usage = f64::from(count) / f64::from(inputs.others_max.max(1));
                    2 * ((MAX_SCORE as f64) * (0.5 - usage)) as i64
                }
            })
            .collect(),
        Prioritizer::AllocatableCpu | Prioritizer::AllocatableMemory => {
            let resource = |c: &Cluster| match prioritizer {
                Prioritizer::AllocatableCpu => c.cpu,
                _ => c.memory,
            };
            let values: Vec<f64> = clusters
                .iter()
                .filter_map(|c| resource(c))
                .map(|r| r.allocatable)
                .collect();
            let min = values.iter().copied().fold(f64::INFINITY, f64::min);
            let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            clusters
                .iter()
                .map(|c| match resource(c) {
                    None => 0,
                    Some(_) if max == min => MAX_SCORE,
                    Some(r) => {
                        let ratio = (r.allocatable - min) / (max - min);
                        ((ratio - 0.5) * 2.0 * MAX_SCORE as f64) as i64
                    }
                })
                .collect()
        }
        Prioritizer::AddOn { resource, score } => clusters
            .iter()
            .map(|c| {
                let (value, valid_until) =
                    addon_score((inputs.score)(&c.name, resource), score, inputs.now);
                if let Some(v) = valid_until {
                    *recheck_at = Some(recheck_at.map_or(v, |r| r.min(v)));
                }
                value.clamp(-MAX_SCORE, MAX_SCORE)
            })
            .collect(),
    }
}

/// A decision group: its name (empty for clusters no named group took) and clusters by name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Group {
    pub name: String,
    pub clusters: Vec<String>,
}

/// Splits the selected clusters into decision groups as OCM does: each named group takes the
/// selected clusters matching its selector (first group first), the rest form unnamed groups;
/// every group is cut into pieces of `clustersPerDecisionGroup` (a count or a percentage of the
/// selected clusters; all when absent). There is always at least one (maybe empty) group.
pub fn group(placement: &Compiled, selected: &[&Cluster]) -> Vec<Group> {
    let total = selected.len();
    let length = match &placement.clusters_per_group {
        Some(IntOrString::Int(n)) => *n as i64,
        Some(IntOrString::String(s)) => percentage(s)
            .map(|p| (p / 100.0 * total as f64).ceil() as i64)
            .unwrap_or(total as i64),
        None => total as i64,
    };
    let length = if length <= 0 || length as usize > total {
        total.max(1)
    } else {
        length as usize
    };
    let mut remaining: BTreeSet<&str> = selected.iter().map(|c| c.name.as_str()).collect();
    let mut groups = Vec::new();
    let divide = |name: &str, mut clusters: Vec<String>, groups: &mut Vec<Group>| {
        clusters.sort_unstable();
        for chunk in clusters.chunks(length) {
            groups.push(Group {
                name: name.to_string(),
                clusters: chunk.to_vec(),
            });
        }
    };
    for (name, predicate) in &placement.groups {
        let matched: Vec<String> = selected
            .iter()
            .filter(|c| remaining.contains(c.name.as_str()) && predicate.matches(c))
            .map(|c| c.name.clone())
            .collect();
        for m in &matched {
            remaining.remove(m.as_str());
        }
        divide(name, matched, &mut groups);
    }
    let rest: Vec<String> = remaining.into_iter().map(str::to_string).collect();
    divide("", rest, &mut groups);
    if groups.is_empty() {
        groups.push(Group::default());
    }
    groups
}

/// One PlacementDecision as it should be stored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DecisionObject {
    /// `<placement>-decision-<n>`, n from 1.
    pub name: String,
    pub group_index: usize,
    pub group_name: String,
    pub decisions: Vec<ClusterDecision>,
}

/// The PlacementDecisions of a placement's groups: each group cut into objects of at most
/// [`MAX_DECISIONS_PER_OBJECT`] clusters (an empty group still gets one, empty, object).
pub fn decision_objects(placement_name: &str, groups: &[Group]) -> Vec<DecisionObject> {
    let mut objects = Vec::new();
    for (index, g) in groups.iter().enumerate() {
        let mut chunks: Vec<&[String]> = g.clusters.chunks(MAX_DECISIONS_PER_OBJECT).collect();
        if chunks.is_empty() {
            chunks.push(&[]);
        }
        for chunk in chunks {
            objects.push(DecisionObject {
                name: format!("{placement_name}-decision-{}", objects.len() + 1),
                group_index: index,
                group_name: g.name.clone(),
                decisions: chunk
                    .iter()
                    .map(|c| ClusterDecision {
                        cluster_name: c.clone(),
                        reason: String::new(),
                        score: None,
                    })
                    .collect(),
            });
        }
    }
    objects
}

/// `status.decisionGroups` for the objects of [`decision_objects`].
pub fn decision_group_status(objects: &[DecisionObject]) -> Vec<DecisionGroupStatus> {
    let mut out: Vec<DecisionGroupStatus> = Vec::new();
    for o in objects {
        match out.last_mut() {
            Some(g) if g.decision_group_index == o.group_index as i32 => {
                g.decisions.push(o.name.clone());
                g.cluster_count += o.decisions.len() as i32;
            }
            _ => out.push(DecisionGroupStatus {
                decision_group_index: o.group_index as i32,
                decision_group_name: o.group_name.clone(),
                decisions: vec![o.name.clone()],
                cluster_count: o.decisions.len() as i32,
            }),
        }
    }
    out
}

/// A condition as the core decides it; the driver stamps times.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConditionOut {
    pub type_: &'static str,
    pub status: bool,
    pub reason: &'static str,
    pub message: String,
}

/// What the Placement's conditions are built from.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    /// Valid ManagedClusterSetBindings in the namespace (their set exists).
    pub bindings: usize,
    /// Sets the placement may select from (bound, and named in `spec.clusterSets` if any).
    pub eligible_sets: Vec<String>,
    /// Clusters in those sets.
    pub available: usize,
    pub misconfigured: Option<Misconfigured>,
    pub selection: Selection,
}

/// `PlacementSatisfied` and `PlacementMisconfigured`, with OCM's reasons and messages.
pub fn conditions(report: &Report, cluster_sets_in_spec: &[String]) -> [ConditionOut; 2] {
    use flotilla_proto::api::conditions::{PLACEMENT_MISCONFIGURED, PLACEMENT_SATISFIED};
    let sel = &report.selection;
    let (status, reason, message) = if report.bindings == 0 {
        (
            false,
            "NoManagedClusterSetBindings",
            "No valid ManagedClusterSetBindings found in placement namespace".to_string(),
        )
    } else if report.eligible_sets.is_empty() {
        (
            false,
            "NoIntersection",
            format!(
                "None of ManagedClusterSets [{}] is bound to placement namespace",
                cluster_sets_in_spec.join(",")
            ),
        )
    } else if report.available == 0 {
        (
            false,
            "AllManagedClusterSetsEmpty",
            format!(
                "All ManagedClusterSets [{}] have no member ManagedCluster",
                report.eligible_sets.join(",")
            ),
        )
    } else if sel.clusters.is_empty() {
        (
            false,
            "NoManagedClusterMatched",
            "No ManagedCluster matches any of the cluster predicate".to_string(),
        )
    } else if sel.unscheduled == 0 {
        (
            true,
            "AllDecisionsScheduled",
            "All cluster decisions scheduled".to_string(),
        )
    } else {
        (
            false,
            "NotAllDecisionsScheduled",
            format!("{} cluster decisions unscheduled", sel.unscheduled),
        )
    };
    let misconfigured = match &report.misconfigured {
        Some(m) => ConditionOut {
            type_: PLACEMENT_MISCONFIGURED,
            status: true,
            reason: "Misconfigured",
            message: m.to_string(),
        },
        None => ConditionOut {
            type_: PLACEMENT_MISCONFIGURED,
            status: false,
            reason: "Succeedconfigured",
            message: "Placement configurations check pass".to_string(),
        },
    };
    [
        ConditionOut {
            type_: PLACEMENT_SATISFIED,
            status,
            reason,
            message,
        },
        misconfigured,
    ]
}

/// The sets a placement may select from: those bound to its namespace (by a binding whose set
/// exists), narrowed to `spec.clusterSets` when given. Sorted.
pub fn eligible_sets(bound: &BTreeSet<String>, spec_sets: &[String]) -> Vec<String> {
    bound
        .iter()
        .filter(|s| spec_sets.is_empty() || spec_sets.contains(s))
        .cloned()
        .collect()
}

/// Everything one placement's decision depends on, for [`schedule`].
pub struct World<'a> {
    pub clusters: &'a [Cluster],
    /// Every ManagedClusterSet's rule, by name.
    pub sets: &'a BTreeMap<String, SetRule>,
    /// Sets bound to the placement's namespace whose set exists.
    pub bound: &'a BTreeSet<String>,
    /// The placement's current decisions.
    pub selected: &'a BTreeSet<String>,
    /// Other placements' decisions per cluster.
    pub others: &'a BTreeMap<String, u32>,
    /// AddOnPlacementScores by (cluster namespace, name).
    pub scores: &'a BTreeMap<(String, String), AddOnPlacementScoreStatus>,
    pub now: Timestamp,
}

/// A placement's whole decision.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub objects: Vec<DecisionObject>,
    pub report: Report,
    /// When the decision may change with nothing else changing (a toleration or score runs out).
    pub recheck_at: Option<Timestamp>,
}

/// Decides for one placement from scratch: [`compile`], [`filter`] every cluster of the eligible
/// sets, [`select`], [`group`], [`decision_objects`].
pub fn schedule(placement: &Placement, world: &World<'_>) -> Outcome {
    let name = placement.metadata.name.clone().unwrap_or_default();
    let bindings = world.bound.len();
    let spec_sets = &placement.spec.cluster_sets;
    let eligible = eligible_sets(world.bound, spec_sets);
    let members: Vec<&Cluster> = world
        .clusters
        .iter()
        .filter(|c| {
            eligible
                .iter()
                .any(|s| world.sets.get(s).is_some_and(|rule| rule.contains(c)))
        })
        .collect();
    let mut report = Report {
        bindings,
        eligible_sets: eligible,
        available: members.len(),
        ..Report::default()
    };
    let compiled = match compile(placement) {
        Ok(c) => c,
        Err(m) => {
            report.misconfigured = Some(m);
            return Outcome {
                objects: decision_objects(&name, &[Group::default()]),
                report,
                recheck_at: None,
            };
        }
    };
    let candidates: Vec<(&Cluster, Verdict)> = members
        .iter()
        .map(|c| (*c, filter(&compiled, c, world.now)))
        .filter(|(_, v)| v.allowed != Allowed::Never)
        .collect();
    let others_max = world.others.values().copied().max().unwrap_or(0);
    let inputs = RankingInputs {
        selected: &|c| world.selected.contains(c),
        others: &|c| world.others.get(c).copied().unwrap_or(0),
        others_max,
        score: &|ns, resource| world.scores.get(&(ns.to_string(), resource.to_string())),
        now: world.now,
    };
    let selection = select(&compiled, &candidates, &inputs);
    let by_name: BTreeMap<&str, &Cluster> = members.iter().map(|c| (c.name.as_str(), *c)).collect();
    let chosen: Vec<&Cluster> = selection
        .clusters
        .iter()
        .filter_map(|n| by_name.get(n.as_str()).copied())
        .collect();
    let groups = group(&compiled, &chosen);
    let toleration_recheck = candidates
        .iter()
        .filter(|(c, _)| selection.clusters.contains(&c.name))
        .filter_map(|(_, v)| v.recheck_at)
        .min();
    let recheck_at = [toleration_recheck, selection.recheck_at]
        .into_iter()
        .flatten()
        .min();
    report.selection = selection;
    Outcome {
        objects: decision_objects(&name, &groups),
        report,
        recheck_at,
    }
}

#[cfg(test)]
mod tests {
    //! One `check` per concern, many small cases, each stated as the scenario it is.

    use super::*;
    use flotilla_proto::api::{AddOnPlacementScoreItem, ManagedClusterSelector};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use serde_json::json;

    pub(crate) fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + secs).unwrap()
    }

    /// A cluster, built the way a scenario describes it.
    #[derive(Clone)]
    pub(crate) struct C(pub Cluster);

    pub(crate) fn cluster(name: &str) -> C {
        C(Cluster {
            name: name.into(),
            ..Cluster::default()
        })
    }

    impl C {
        pub fn label(mut self, k: &str, v: &str) -> C {
            self.0.labels.insert(k.into(), v.into());
            self
        }
        pub fn claim(mut self, k: &str, v: &str) -> C {
            self.0.claims.insert(k.into(), v.into());
            self
        }
        pub fn taint(mut self, key: &str, effect: TaintEffect, added: i64) -> C {
            self.0.taints.push(Taint {
                key: key.into(),
                value: String::new(),
                effect,
                time_added: Some(Time(at(added))),
            });
            self
        }
        pub fn cpu(mut self, allocatable: f64) -> C {
            self.0.cpu = Some(Resource {
                allocatable,
                capacity: allocatable,
            });
            self
        }
    }

    pub(crate) fn placement(spec: serde_json::Value) -> Placement {
        serde_json::from_value(json!({
            "apiVersion": "cluster.open-cluster-management.io/v1beta1",
            "kind": "Placement",
            "metadata": { "name": "p", "namespace": "ns", "uid": "u1" },
            "spec": spec,
        }))
        .unwrap()
    }

    /// The world of a case: every cluster in the `global` set, bound to the namespace.
    struct Case {
        clusters: Vec<C>,
        selected: Vec<&'static str>,
        others: Vec<(&'static str, u32)>,
        scores: Vec<(&'static str, &'static str, i32, Option<i64>)>,
        bound: Vec<&'static str>,
        now: i64,
    }

    impl Default for Case {
        fn default() -> Self {
            Case {
                clusters: Vec::new(),
                selected: Vec::new(),
                others: Vec::new(),
                scores: Vec::new(),
                bound: vec!["global"],
                now: 0,
            }
        }
    }

    fn run(spec: serde_json::Value, case: &Case) -> Outcome {
        let clusters: Vec<Cluster> = case.clusters.iter().map(|c| c.0.clone()).collect();
        let mut sets = BTreeMap::new();
        sets.insert(
            "global".to_string(),
            SetRule::Selector(Selector::everything()),
        );
        sets.insert(
            "edge".to_string(),
            SetRule::from_spec(
                "edge",
                &ManagedClusterSetSpec {
                    cluster_selector: Some(ManagedClusterSelector::default()),
                    ..ManagedClusterSetSpec::default()
                },
            )
            .0,
        );
        let bound: BTreeSet<String> = case.bound.iter().map(|s| s.to_string()).collect();
        let selected: BTreeSet<String> = case.selected.iter().map(|s| s.to_string()).collect();
        let others: BTreeMap<String, u32> = case
            .others
            .iter()
            .map(|(c, n)| (c.to_string(), *n))
            .collect();
        let scores = case
            .scores
            .iter()
            .map(|(cluster, name, value, valid)| {
                (
                    (cluster.to_string(), "usage".to_string()),
                    AddOnPlacementScoreStatus {
                        conditions: vec![],
                        scores: vec![AddOnPlacementScoreItem {
                            name: name.to_string(),
                            value: *value,
                        }],
                        valid_until: valid.map(|v| Time(at(v))),
                    },
                )
            })
            .collect();
        schedule(
            &placement(spec),
            &World {
                clusters: &clusters,
                sets: &sets,
                bound: &bound,
                selected: &selected,
                others: &others,
                scores: &scores,
                now: at(case.now),
            },
        )
    }

    fn chosen(o: &Outcome) -> Vec<String> {
        o.objects
            .iter()
            .flat_map(|d| d.decisions.iter().map(|c| c.cluster_name.clone()))
            .collect()
    }

    /// The clusters `spec` selects in `case`, in decision order.
    fn check(spec: serde_json::Value, case: Case, expected: &[&str]) {
        let outcome = run(spec.clone(), &case);
        assert_eq!(chosen(&outcome), expected, "spec {spec}");
    }

    fn three() -> Vec<C> {
        vec![
            cluster("cluster3")
                .label("region", "us")
                .claim("platform.open-cluster-management.io", "AWS"),
            cluster("cluster1")
                .label("region", "eu")
                .claim("platform.open-cluster-management.io", "GCP"),
            cluster("cluster2")
                .label("region", "eu")
                .label("tier", "gold"),
        ]
    }

    #[test]
    fn predicates_select_by_labels_and_claims() {
        let case = || Case {
            clusters: three(),
            ..Case::default()
        };
        check(json!({}), case(), &["cluster1", "cluster2", "cluster3"]);
        check(
            json!({"predicates": [{"requiredClusterSelector": {"labelSelector": {"matchLabels": {"region": "eu"}}}}]}),
            case(),
            &["cluster1", "cluster2"],
        );
        check(
            json!({"predicates": [{"requiredClusterSelector": {"claimSelector": {"matchExpressions": [
                {"key": "platform.open-cluster-management.io", "operator": "In", "values": ["AWS"]}]}}}]}),
            case(),
            &["cluster3"],
        );
        // Label and claim selectors of one predicate are ANDed, predicates ORed.
        check(
            json!({"predicates": [
                {"requiredClusterSelector": {"labelSelector": {"matchLabels": {"region": "eu"}},
                    "claimSelector": {"matchExpressions": [{"key": "platform.open-cluster-management.io", "operator": "Exists"}]}}},
                {"requiredClusterSelector": {"labelSelector": {"matchLabels": {"tier": "gold"}}}}]}),
            case(),
            &["cluster1", "cluster2"],
        );
        check(
            json!({"predicates": [{"requiredClusterSelector": {"labelSelector": {"matchLabels": {"region": "apac"}}}}]}),
            case(),
            &[],
        );
    }

    #[test]
    fn number_of_clusters_keeps_what_is_selected() {
        // Steady: patched from 2 to 1, the placement keeps one of the two it had.
        check(
            json!({"numberOfClusters": 1}),
            Case {
                clusters: three(),
                selected: vec!["cluster2", "cluster3"],
                ..Case::default()
            },
            &["cluster2"],
        );
        // Nothing selected yet: ties go by name.
        check(
            json!({"numberOfClusters": 2}),
            Case {
                clusters: three(),
                ..Case::default()
            },
            &["cluster1", "cluster2"],
        );
        // Balance: the cluster other placements use most loses.
        check(
            json!({"numberOfClusters": 2}),
            Case {
                clusters: three(),
                others: vec![("cluster1", 4), ("cluster2", 1)],
                ..Case::default()
            },
            &["cluster2", "cluster3"],
        );
    }

    #[test]
    fn prioritizers_rank_by_resources_and_addon_scores() {
        let clusters = || {
            vec![
                cluster("a").cpu(4.0),
                cluster("b").cpu(16.0),
                cluster("c").cpu(8.0),
            ]
        };
        let exact = |config: serde_json::Value| json!({"numberOfClusters": 1, "prioritizerPolicy": {"mode": "Exact", "configurations": [config]}});
        check(
            exact(
                json!({"scoreCoordinate": {"type": "BuiltIn", "builtIn": "ResourceAllocatableCPU"}, "weight": 1}),
            ),
            Case {
                clusters: clusters(),
                ..Case::default()
            },
            &["b"],
        );
        // A negative weight prefers the smallest.
        check(
            exact(
                json!({"scoreCoordinate": {"type": "BuiltIn", "builtIn": "ResourceAllocatableCPU"}, "weight": -1}),
            ),
            Case {
                clusters: clusters(),
                ..Case::default()
            },
            &["a"],
        );
        let addon = exact(
            json!({"scoreCoordinate": {"type": "AddOn", "addOn": {"resourceName": "usage", "scoreName": "cpuAvailable"}}, "weight": 1}),
        );
        check(
            addon.clone(),
            Case {
                clusters: clusters(),
                scores: vec![
                    ("a", "cpuAvailable", 12, None),
                    ("c", "cpuAvailable", 66, Some(100)),
                ],
                ..Case::default()
            },
            &["c"],
        );
        // c's score expired: ignored (0), so a's 12 wins.
        check(
            addon,
            Case {
                clusters: clusters(),
                scores: vec![
                    ("a", "cpuAvailable", 12, None),
                    ("c", "cpuAvailable", 66, Some(100)),
                ],
                now: 200,
                ..Case::default()
            },
            &["a"],
        );
    }

    #[test]
    fn a_score_that_expires_sets_when_to_decide_again() {
        let spec = json!({"numberOfClusters": 1, "prioritizerPolicy": {"mode": "Exact", "configurations": [
            {"scoreCoordinate": {"type": "AddOn", "addOn": {"resourceName": "usage", "scoreName": "cpuAvailable"}}}]}});
        let o = run(
            spec,
            &Case {
                clusters: vec![cluster("a"), cluster("b")],
                scores: vec![("b", "cpuAvailable", 50, Some(100))],
                ..Case::default()
            },
        );
        assert_eq!(chosen(&o), ["b"]);
        assert_eq!(o.recheck_at, Some(at(100)));
    }

    #[test]
    fn taints_repel_unless_tolerated_for_as_long_as_tolerated() {
        let unreachable = "cluster.open-cluster-management.io/unreachable";
        let tainted = || {
            vec![
                cluster("cluster1").taint(unreachable, TaintEffect::NoSelect, 0),
                cluster("cluster2"),
            ]
        };
        check(
            json!({}),
            Case {
                clusters: tainted(),
                ..Case::default()
            },
            &["cluster2"],
        );
        let tolerating = json!({"numberOfClusters": 1, "tolerations": [
            {"key": unreachable, "operator": "Exists", "tolerationSeconds": 300}]});
        // Within the toleration the placement keeps cluster1, and knows when to look again.
        let o = run(
            tolerating.clone(),
            &Case {
                clusters: tainted(),
                selected: vec!["cluster1"],
                now: 299,
                ..Case::default()
            },
        );
        assert_eq!(chosen(&o), ["cluster1"]);
        assert_eq!(o.recheck_at, Some(at(300)));
        // Past it, the work moves to cluster2.
        check(
            tolerating,
            Case {
                clusters: tainted(),
                selected: vec!["cluster1"],
                now: 300,
                ..Case::default()
            },
            &["cluster2"],
        );
        // A toleration without seconds tolerates for ever; one for another key not at all.
        check(
            json!({"tolerations": [{"key": unreachable, "operator": "Exists"}]}),
            Case {
                clusters: tainted(),
                now: 10_000,
                ..Case::default()
            },
            &["cluster1", "cluster2"],
        );
        check(
            json!({"tolerations": [{"key": "maintenance", "operator": "Exists"}]}),
            Case {
                clusters: tainted(),
                ..Case::default()
            },
            &["cluster2"],
        );
        // Equal matches the value; an empty key with Exists tolerates every taint.
        check(
            json!({"tolerations": [{"operator": "Exists"}]}),
            Case {
                clusters: tainted(),
                ..Case::default()
            },
            &["cluster1", "cluster2"],
        );
    }

    #[test]
    fn taint_effects_as_ocm_defines_them() {
        let clusters = || {
            vec![
                cluster("new").taint("drain", TaintEffect::NoSelectIfNew, 0),
                cluster("kept").taint("drain", TaintEffect::NoSelectIfNew, 0),
                cluster("preferred-not").taint("cost", TaintEffect::PreferNoSelect, 0),
            ]
        };
        check(
            json!({}),
            Case {
                clusters: clusters(),
                selected: vec!["kept"],
                ..Case::default()
            },
            &["kept", "preferred-not"],
        );
    }

    #[test]
    fn misconfigured_specs_select_nothing_and_say_why() {
        for (spec, message) in [
            (
                json!({"predicates": [{"requiredClusterSelector": {"labelSelector": {"matchExpressions": [{"key": "a", "operator": "Equals", "values": ["b"]}]}}}]}),
                "Predicate:requirement on \"a\": operator \"Equals\"",
            ),
            (
                json!({"tolerations": [{"operator": "Equal", "value": "x"}]}),
                "TaintToleration:If the key is empty",
            ),
            (
                json!({"prioritizerPolicy": {"configurations": [{"scoreCoordinate": {"type": "BuiltIn", "builtIn": "Fastest"}}]}}),
                ":incorrect builtin prioritizer: Fastest",
            ),
            (
                json!({"predicates": [{"requiredClusterSelector": {"celSelector": {"celExpressions": ["true"]}}}]}),
                "celSelector is not supported",
            ),
            (
                json!({"sortBy": "Score"}),
                "spec.sortBy: Score orders decisions by score; use ClusterName (the default); flotilla does not implement it yet",
            ),
            (
                json!({"scoreRateLimit": "5m"}),
                "spec.scoreRateLimit: \"5m\" rate-limits rescheduling on score changes",
            ),
        ] {
            let o = run(
                spec.clone(),
                &Case {
                    clusters: three(),
                    ..Case::default()
                },
            );
            assert!(chosen(&o).is_empty(), "{spec}");
            let [satisfied, misconfigured] = conditions(&o.report, &[]);
            assert!(
                misconfigured.status && misconfigured.reason == "Misconfigured",
                "{spec}"
            );
            assert!(
                misconfigured.message.contains(message),
                "{}",
                misconfigured.message
            );
            assert!(!satisfied.status);
        }
    }

    #[test]
    fn satisfied_says_what_is_missing() {
        let reason = |spec: serde_json::Value, case: Case| {
            let o = run(spec, &case);
            let [s, _] = conditions(&o.report, &o.report.eligible_sets);
            (s.status, s.reason, s.message)
        };
        assert_eq!(
            reason(
                json!({}),
                Case {
                    clusters: three(),
                    bound: vec![],
                    ..Case::default()
                }
            )
            .1,
            "NoManagedClusterSetBindings"
        );
        assert_eq!(
            reason(
                json!({"clusterSets": ["prod"]}),
                Case {
                    clusters: three(),
                    ..Case::default()
                }
            )
            .1,
            "NoIntersection"
        );
        assert_eq!(
            reason(
                json!({}),
                Case {
                    clusters: three(),
                    bound: vec!["edge"],
                    ..Case::default()
                }
            )
            .1,
            "AllManagedClusterSetsEmpty"
        );
        assert_eq!(
            reason(
                json!({"numberOfClusters": 5}),
                Case {
                    clusters: three(),
                    ..Case::default()
                }
            ),
            (
                false,
                "NotAllDecisionsScheduled",
                "2 cluster decisions unscheduled".to_string()
            )
        );
        assert_eq!(
            reason(
                json!({"numberOfClusters": 3}),
                Case {
                    clusters: three(),
                    ..Case::default()
                }
            )
            .1,
            "AllDecisionsScheduled"
        );
    }

    #[test]
    fn decisions_split_into_objects_of_one_hundred() {
        let clusters: Vec<C> = (0..250)
            .map(|i| cluster(&format!("store-{i:04}")))
            .collect();
        let o = run(
            json!({}),
            &Case {
                clusters,
                ..Case::default()
            },
        );
        let sizes: Vec<(String, usize)> = o
            .objects
            .iter()
            .map(|d| (d.name.clone(), d.decisions.len()))
            .collect();
        assert_eq!(
            sizes,
            [
                ("p-decision-1".to_string(), 100),
                ("p-decision-2".to_string(), 100),
                ("p-decision-3".to_string(), 50)
            ]
        );
        let groups = decision_group_status(&o.objects);
        assert_eq!(groups.len(), 1);
        assert_eq!(groups[0].cluster_count, 250);
        assert_eq!(
            groups[0].decisions,
            ["p-decision-1", "p-decision-2", "p-decision-3"]
        );
        // No cluster selected: still one, empty, decision object.
        let o = run(json!({}), &Case::default());
        assert_eq!(o.objects.len(), 1);
        assert!(o.objects[0].decisions.is_empty());
    }

    #[test]
    fn decision_groups_follow_the_group_strategy() {
        let clusters: Vec<C> = (0..6)
            .map(|i| {
                cluster(&format!("c{i}")).label("canary", if i < 2 { "true" } else { "false" })
            })
            .collect();
        let o = run(
            json!({"decisionStrategy": {"groupStrategy": {
                "clustersPerDecisionGroup": "50%",
                "decisionGroups": [{"groupName": "canary", "groupClusterSelector": {"labelSelector": {"matchLabels": {"canary": "true"}}}}]}}}),
            &Case {
                clusters,
                ..Case::default()
            },
        );
        let groups: Vec<(usize, String, Vec<String>)> = o
            .objects
            .iter()
            .map(|d| {
                (
                    d.group_index,
                    d.group_name.clone(),
                    d.decisions.iter().map(|c| c.cluster_name.clone()).collect(),
                )
            })
            .collect();
        assert_eq!(
            groups,
            [
                (
                    0,
                    "canary".to_string(),
                    vec!["c0".to_string(), "c1".to_string()]
                ),
                (
                    1,
                    String::new(),
                    vec!["c2".into(), "c3".into(), "c4".into()]
                ),
                (2, String::new(), vec!["c5".into()]),
            ]
        );
    }

    #[test]
    fn exclusive_sets_hold_clusters_labelled_with_their_name() {
        let rule = SetRule::from_spec("default", &ManagedClusterSetSpec::default()).0;
        assert!(
            rule.contains(
                &cluster("a")
                    .label(flotilla_proto::api::CLUSTER_SET_LABEL, "default")
                    .0
            )
        );
        assert!(
            !rule.contains(
                &cluster("b")
                    .label(flotilla_proto::api::CLUSTER_SET_LABEL, "prod")
                    .0
            )
        );
        assert!(!rule.contains(&cluster("c").0));
    }
}
