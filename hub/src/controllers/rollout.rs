//! Which clusters a rollout strategy lets a new revision reach now, with no IO: OCM's rollout
//! semantics (`All`, `Progressive` with `maxConcurrency`, `ProgressivePerGroup`, mandatory
//! decision groups first, `minSuccessTime` soak, `progressDeadline`, `maxFailures`), over the
//! clusters a placement selected and each one's rollout status. Time comes in as `now`.
//!
//! A rollout stops adding clusters once more than `maxFailures` have failed or timed out
//! ([`RolloutResult::max_failure_breach`]); the clusters already on their way carry on.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use flotilla_proto::api::conditions::{
    WORK_APPLIED, WORK_AVAILABLE, WORK_DEGRADED, WORK_PROGRESSING, find_condition,
};
use flotilla_proto::api::{MandatoryDecisionGroup, RolloutStrategy, RolloutType};
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

/// Where one cluster's rollout stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// The revision has not reached the cluster (no work, an older work, or one not applied yet).
    ToApply,
    /// Applied, not yet available.
    Progressing,
    /// Available (and past the soak time when one is set).
    Succeeded,
    /// Degraded: the spoke refused or broke it.
    Failed,
    /// Progressing or failed for longer than `progressDeadline`.
    TimeOut,
    /// Not to be rolled out.
    Skip,
}

/// A decision group: by index, and by name when it has one.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct GroupKey {
    pub index: i32,
    pub name: String,
}

/// One cluster's rollout status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterRollout {
    pub cluster: String,
    pub status: Status,
    /// When the status last changed: the start of the soak time or of the deadline.
    pub since: Option<Timestamp>,
    /// When this cluster's status changes by time alone (soak over, deadline passed).
    pub recheck_at: Option<Timestamp>,
}

impl ClusterRollout {
    pub fn new(cluster: &str, status: Status, since: Option<Timestamp>) -> ClusterRollout {
        ClusterRollout {
            cluster: cluster.to_string(),
            status,
            since,
            recheck_at: None,
        }
    }
}

/// What a strategy says to do now.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RolloutResult {
    /// Clusters in the rollout window: `ToApply` ones get the revision now, the others are on
    /// their way (progressing, failed within the deadline, soaking).
    pub to_rollout: Vec<ClusterRollout>,
    /// Clusters past the deadline.
    pub timed_out: Vec<ClusterRollout>,
    /// Clusters no longer selected whose work goes.
    pub removed: Vec<ClusterRollout>,
    /// More clusters failed than `maxFailures` allows: no new cluster is added.
    pub max_failure_breach: bool,
    /// The earliest time something changes by time alone.
    pub recheck_at: Option<Timestamp>,
}

/// A strategy, parsed and checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Strategy {
    pub type_: RolloutType,
    pub min_success_time: Duration,
    /// `None`: no deadline.
    pub progress_deadline: Option<Duration>,
    pub max_failures: IntOrString,
    pub max_concurrency: Option<IntOrString>,
    pub mandatory: Vec<MandatoryDecisionGroup>,
}

/// Parses a rollout strategy; the error says which field is wrong and why.
pub fn parse(strategy: Option<&RolloutStrategy>) -> Result<Strategy, String> {
    let s = strategy.cloned().unwrap_or_default();
    let type_ = s.type_.unwrap_or_default();
    let zero = IntOrString::Int(0);
    let (min_success, deadline, max_failures, concurrency, mandatory) = match type_ {
        RolloutType::All => {
            let a = s.all.unwrap_or_default();
            (
                a.min_success_time,
                a.progress_deadline,
                a.max_failures,
                None,
                Vec::new(),
            )
        }
        RolloutType::Progressive => {
            let p = s.progressive.unwrap_or_default();
            (
                p.min_success_time,
                p.progress_deadline,
                p.max_failures,
                p.max_concurrency,
                p.mandatory_decision_groups,
            )
        }
        RolloutType::ProgressivePerGroup => {
            let p = s.progressive_per_group.unwrap_or_default();
            (
                p.min_success_time,
                p.progress_deadline,
                p.max_failures,
                None,
                p.mandatory_decision_groups,
            )
        }
    };
    let min_success_time = match min_success.as_deref() {
        None | Some("") => Duration::ZERO,
        Some(d) => go_duration(d).map_err(|e| format!("minSuccessTime {d:?}: {e}"))?,
    };
    // progressDeadline, or (read into it) the deprecated timeout it replaced.
    let progress_deadline = match deadline.as_deref() {
        None | Some("") | Some("None") => None,
        Some(d) => Some(go_duration(d).map_err(|e| format!("progressDeadline {d:?}: {e}"))?),
    };
    let max_failures = max_failures.unwrap_or(zero);
    check_threshold(&max_failures).map_err(|e| format!("maxFailures: {e}"))?;
    if let Some(c) = &concurrency {
        check_threshold(c).map_err(|e| format!("maxConcurrency: {e}"))?;
    }
    Ok(Strategy {
        type_,
        min_success_time,
        progress_deadline,
        max_failures,
        max_concurrency: concurrency,
        mandatory,
    })
}

/// A Go duration such as `5m`, `1h30m`, `90s`, `500ms`, or `0` (Go's one unitless duration,
/// and the default OCM's schema gives `minSuccessTime`).
fn go_duration(s: &str) -> Result<Duration, String> {
    let mut total = Duration::ZERO;
    let mut rest = s.trim();
    if rest.is_empty() {
        return Err("empty duration".to_string());
    }
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if digits == 0 {
            return Err("expected a number followed by h, m, s or ms".to_string());
        }
        let n: u64 = rest[..digits]
            .parse()
            .map_err(|_| "number too large".to_string())?;
        rest = &rest[digits..];
        let (unit, len) = if rest.starts_with("ms") {
            (Duration::from_millis(1), 2)
        } else if rest.starts_with('h') {
            (Duration::from_secs(3600), 1)
        } else if rest.starts_with('m') {
            (Duration::from_secs(60), 1)
        } else if rest.starts_with('s') {
            (Duration::from_secs(1), 1)
        } else {
            return Err("expected a unit: h, m, s or ms (e.g. 5m, 1h30m)".to_string());
        };
        total += unit * u32::try_from(n).map_err(|_| "number too large".to_string())?;
        rest = &rest[len..];
    }
    Ok(total)
}

fn check_threshold(v: &IntOrString) -> Result<(), String> {
    match v {
        IntOrString::Int(_) => Ok(()),
        IntOrString::String(s) => match s.strip_suffix('%').map(str::parse::<f64>) {
            Some(Ok(_)) => Ok(()),
            _ => Err(format!(
                "{s:?} is neither a count nor a percentage such as \"10%\""
            )),
        },
    }
}

/// A count or percentage of `total`, rounded up; `default` when it comes out at or below zero
/// or above the total (OCM's `calculateRolloutSize`).
pub fn threshold(v: &IntOrString, total: usize, default: usize) -> usize {
    let n: i64 = match v {
        IntOrString::Int(n) => i64::from(*n),
        IntOrString::String(s) => s
            .strip_suffix('%')
            .and_then(|p| p.parse::<f64>().ok())
            .map_or(default as i64, |p| (p / 100.0 * total as f64).ceil() as i64),
    };
    if n <= 0 || n as usize > total {
        default
    } else {
        n as usize
    }
}

/// The clusters of a placement's decisions, by decision group (in group order).
pub type ClusterGroups = BTreeMap<GroupKey, BTreeSet<String>>;

/// What `strategy` rolls out now, given each cluster's status (`existing`: clusters the
/// revision has reached or tried to; the others count as not started).
pub fn rollout(
    strategy: &Strategy,
    groups: &ClusterGroups,
    existing: &[ClusterRollout],
    now: Timestamp,
) -> RolloutResult {
    let selected: BTreeSet<&str> = groups.values().flatten().map(String::as_str).collect();
    let (current, removed): (Vec<ClusterRollout>, Vec<ClusterRollout>) = existing
        .iter()
        .cloned()
        .partition(|c| selected.contains(c.cluster.as_str()));
    let total = selected.len();
    let mut result = match strategy.type_ {
        RolloutType::All => per_cluster(
            groups,
            total,
            total,
            strategy,
            Duration::ZERO,
            &current,
            now,
        ),
        RolloutType::Progressive => {
            let max_failures = threshold(&strategy.max_failures, total, 0);
            if let Some(r) = mandatory_first(groups, strategy, &current, now) {
                return RolloutResult { removed, ..r };
            }
            let rest = pick(groups, &strategy.mandatory, false);
            let rest_total: usize = rest.values().map(BTreeSet::len).sum();
            let size = strategy
                .max_concurrency
                .as_ref()
                .map_or(rest_total, |c| threshold(c, rest_total, rest_total));
            per_cluster(
                &rest,
                size,
                max_failures,
                strategy,
                strategy.min_success_time,
                &current,
                now,
            )
        }
        RolloutType::ProgressivePerGroup => {
            if let Some(r) = mandatory_first(groups, strategy, &current, now) {
                return RolloutResult { removed, ..r };
            }
            let rest = pick(groups, &strategy.mandatory, false);
            per_group(&rest, &strategy.max_failures, strategy, &current, now)
        }
    };
    result.removed = removed;
    result
}

/// The mandatory decision groups' rollout, group by group with no failure tolerated, while
/// they still have clusters to reach or timed out; `None` once they are done (or there are none).
fn mandatory_first(
    groups: &ClusterGroups,
    strategy: &Strategy,
    current: &[ClusterRollout],
    now: Timestamp,
) -> Option<RolloutResult> {
    let mandatory = pick(groups, &strategy.mandatory, true);
    if mandatory.is_empty() {
        return None;
    }
    let r = per_group(&mandatory, &IntOrString::Int(0), strategy, current, now);
    (!r.to_rollout.is_empty() || !r.timed_out.is_empty()).then_some(r)
}

/// The groups named by `mandatory` (by name first, else by index), or all the others.
fn pick(
    groups: &ClusterGroups,
    mandatory: &[MandatoryDecisionGroup],
    wanted: bool,
) -> ClusterGroups {
    groups
        .iter()
        .filter(|(k, _)| {
            let named = mandatory.iter().any(|m| {
                if m.group_name.is_empty() {
                    m.group_index == Some(k.index)
                } else {
                    m.group_name == k.name
                }
            });
            named == wanted
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Where a cluster that has started stands now: in the window (soaking, progressing or failed
/// within the deadline), done, or timed out.
fn settle(
    c: &ClusterRollout,
    min_success: Duration,
    deadline: Option<Duration>,
    now: Timestamp,
    window: &mut Vec<ClusterRollout>,
    timed_out: &mut Vec<ClusterRollout>,
) -> Status {
    let after = |d: Duration| {
        let start = c.since.unwrap_or(now);
        start
            .saturating_add(SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX))
            .unwrap_or(start)
    };
    match c.status {
        Status::ToApply => {
            window.push(c.clone());
            Status::ToApply
        }
        Status::Succeeded => {
            let soaked = after(min_success);
            if now < soaked {
                window.push(ClusterRollout {
                    recheck_at: Some(soaked),
                    ..c.clone()
                });
            }
            Status::Succeeded
        }
        Status::TimeOut | Status::Skip => c.status,
        Status::Progressing | Status::Failed => match deadline.map(after) {
            Some(t) if now >= t => {
                timed_out.push(ClusterRollout {
                    status: Status::TimeOut,
                    ..c.clone()
                });
                Status::TimeOut
            }
            t => {
                window.push(ClusterRollout {
                    recheck_at: t,
                    ..c.clone()
                });
                c.status
            }
        },
    }
}

/// Cluster by cluster in name order, at most `size` in the window, stopping new clusters once
/// more than `max_failures` failed or timed out.
fn per_cluster(
    groups: &ClusterGroups,
    size: usize,
    max_failures: usize,
    strategy: &Strategy,
    min_success: Duration,
    existing: &[ClusterRollout],
    now: Timestamp,
) -> RolloutResult {
    let mut existing: Vec<&ClusterRollout> = existing.iter().collect();
    existing.sort_by(|a, b| a.cluster.cmp(&b.cluster));
    let mut r = RolloutResult::default();
    let mut started = BTreeSet::new();
    let mut failures = 0;
    for c in existing {
        started.insert(c.cluster.as_str());
        let status = if !r.max_failure_breach || c.status != Status::ToApply {
            settle(
                c,
                min_success,
                strategy.progress_deadline,
                now,
                &mut r.to_rollout,
                &mut r.timed_out,
            )
        } else {
            c.status
        };
        if matches!(status, Status::Failed | Status::TimeOut) {
            failures += 1;
            r.max_failure_breach = failures > max_failures;
        }
        if r.to_rollout.len() >= size {
            return finish(r);
        }
    }
    if r.max_failure_breach {
        return finish(r);
    }
    let all: BTreeSet<&str> = groups.values().flatten().map(String::as_str).collect();
    for c in all {
        if started.contains(c) {
            continue;
        }
        r.to_rollout
            .push(ClusterRollout::new(c, Status::ToApply, None));
        if r.to_rollout.len() >= size {
            break;
        }
    }
    finish(r)
}

/// Group by group in index order: a group's clusters all at once; the next group only when the
/// window holds nothing but failures, and not after more than `max_failures` (per group) failed.
fn per_group(
    groups: &ClusterGroups,
    max_failures: &IntOrString,
    strategy: &Strategy,
    existing: &[ClusterRollout],
    now: Timestamp,
) -> RolloutResult {
    let mut r = RolloutResult::default();
    let mut started: BTreeMap<&str, Status> = BTreeMap::new();
    for c in existing.iter().filter(|c| c.status != Status::ToApply) {
        let status = settle(
            c,
            strategy.min_success_time,
            strategy.progress_deadline,
            now,
            &mut r.to_rollout,
            &mut r.timed_out,
        );
        started.insert(c.cluster.as_str(), status);
    }
    let mut total_failures = 0;
    for clusters in groups.values() {
        let allowed = threshold(max_failures, clusters.len(), 0);
        let mut failures = 0;
        for c in clusters {
            if let Some(status) = started.get(c.as_str()) {
                if matches!(status, Status::Failed | Status::TimeOut) {
                    failures += 1;
                    r.max_failure_breach = failures > allowed;
                }
                continue;
            }
            r.to_rollout
                .push(ClusterRollout::new(c, Status::ToApply, None));
        }
        total_failures += failures;
        if r.to_rollout.len() > total_failures || r.max_failure_breach {
            return finish(r);
        }
    }
    finish(r)
}

fn finish(mut r: RolloutResult) -> RolloutResult {
    r.recheck_at = r.to_rollout.iter().filter_map(|c| c.recheck_at).min();
    r
}

/// A ManifestWork's rollout status from its conditions, as OCM's ManifestWorkReplicaSet reads
/// them, for a work whose spec is the current revision. One addition: a work whose apply the
/// spoke refused (`Applied=False` with `Degraded=True`, both for this generation) is `Failed`,
/// where OCM would wait for it forever as not yet applied; that is how a failing cluster stops
/// a rollout with `maxFailures`.
pub fn work_status(cluster: &str, generation: i64, conditions: &[Condition]) -> ClusterRollout {
    let at = |c: &Condition| c.observed_generation == Some(generation);
    let applied = find_condition(conditions, WORK_APPLIED);
    let progressing = find_condition(conditions, WORK_PROGRESSING);
    let available = find_condition(conditions, WORK_AVAILABLE);
    let degraded = find_condition(conditions, WORK_DEGRADED);
    let is = |c: Option<&Condition>, s: &str| c.is_some_and(|c| c.status == s);
    let since = |c: Option<&Condition>| c.map(|c| c.last_transition_time.0);
    let status = |s: Status, c: Option<&Condition>| ClusterRollout::new(cluster, s, since(c));

    if applied.is_some_and(at)
        && is(applied, "False")
        && degraded.is_some_and(at)
        && is(degraded, "True")
    {
        return status(Status::Failed, degraded);
    }
    let applied_now = applied.is_some_and(|c| at(c) && c.status == "True");
    let progressing_now = progressing.is_some_and(at);
    let available_now = available.is_some_and(at);
    if !applied_now || (!progressing_now && !available_now) || degraded.is_some_and(|c| !at(c)) {
        return ClusterRollout::new(cluster, Status::ToApply, None);
    }
    if !progressing_now {
        return if is(degraded, "True") {
            status(Status::Failed, degraded)
        } else if is(available, "True") {
            status(Status::Succeeded, available)
        } else {
            status(Status::Progressing, available)
        };
    }
    match progressing.map(|c| c.status.as_str()) {
        Some("True") if is(degraded, "True") => status(Status::Failed, degraded),
        Some("False") => status(Status::Succeeded, progressing),
        _ => status(Status::Progressing, progressing),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + secs).unwrap()
    }

    fn strategy(s: serde_json::Value) -> Strategy {
        parse(Some(&serde_json::from_value(s).unwrap())).unwrap()
    }

    /// Clusters c00..c(n-1) in one unnamed group, or split by `groups` sizes.
    fn groups(sizes: &[(&str, usize)]) -> ClusterGroups {
        let mut g = ClusterGroups::new();
        let mut next = 0;
        for (i, (name, size)) in sizes.iter().enumerate() {
            g.insert(
                GroupKey {
                    index: i as i32,
                    name: name.to_string(),
                },
                (next..next + size).map(|c| format!("c{c:02}")).collect(),
            );
            next += size;
        }
        g
    }

    fn st(cluster: &str, status: Status, since: i64) -> ClusterRollout {
        ClusterRollout::new(cluster, status, Some(at(since)))
    }

    fn to_apply(r: &RolloutResult) -> Vec<String> {
        r.to_rollout
            .iter()
            .filter(|c| c.status == Status::ToApply)
            .map(|c| c.cluster.clone())
            .collect()
    }

    #[test]
    fn all_reaches_every_cluster_at_once() {
        let r = rollout(
            &strategy(json!({"type": "All"})),
            &groups(&[("", 4)]),
            &[],
            at(0),
        );
        assert_eq!(to_apply(&r), ["c00", "c01", "c02", "c03"]);
    }

    #[test]
    fn progressive_keeps_a_window_of_max_concurrency() {
        let s = strategy(json!({"type": "Progressive", "progressive": {"maxConcurrency": "25%"}}));
        let g = groups(&[("", 20)]);
        assert_eq!(
            to_apply(&rollout(&s, &g, &[], at(0))),
            ["c00", "c01", "c02", "c03", "c04"]
        );
        // Two done, three on their way: two more may start.
        let existing = [
            st("c00", Status::Succeeded, 0),
            st("c01", Status::Succeeded, 0),
            st("c02", Status::Progressing, 0),
            st("c03", Status::Progressing, 0),
            st("c04", Status::Progressing, 0),
        ];
        let r = rollout(&s, &g, &existing, at(10));
        assert_eq!(to_apply(&r), ["c05", "c06"]);
        assert_eq!(r.to_rollout.len(), 5);
        assert!(!r.max_failure_breach);
    }

    #[test]
    fn a_failure_beyond_max_failures_stops_new_clusters() {
        let s = strategy(
            json!({"type": "Progressive", "progressive": {"maxConcurrency": 3, "maxFailures": 0}}),
        );
        let g = groups(&[("", 10)]);
        let existing = [
            st("c00", Status::Succeeded, 0),
            st("c01", Status::Failed, 5),
            st("c02", Status::Progressing, 0),
        ];
        let r = rollout(&s, &g, &existing, at(10));
        assert!(r.max_failure_breach);
        assert!(to_apply(&r).is_empty(), "no new cluster after the failure");
        // One failure tolerated: the rollout goes on.
        let s = strategy(
            json!({"type": "Progressive", "progressive": {"maxConcurrency": 3, "maxFailures": 1}}),
        );
        let r = rollout(&s, &g, &existing, at(10));
        assert!(!r.max_failure_breach);
        assert_eq!(to_apply(&r), ["c03"]);
    }

    #[test]
    fn deadlines_time_out_and_soak_times_hold_the_window() {
        let s = strategy(json!({"type": "Progressive", "progressive": {
            "maxConcurrency": 2, "progressDeadline": "10m", "minSuccessTime": "1m", "maxFailures": 0}}));
        let g = groups(&[("", 5)]);
        // c00 succeeded 30 s ago (still soaking), c01 progressing for 5 minutes.
        let existing = [
            st("c00", Status::Succeeded, 570),
            st("c01", Status::Progressing, 300),
        ];
        let r = rollout(&s, &g, &existing, at(600));
        assert!(to_apply(&r).is_empty());
        assert_eq!(r.recheck_at, Some(at(630)), "the soak ends first");
        // Ten minutes on, c01 has timed out: a failure.
        let r = rollout(&s, &g, &existing, at(901));
        assert_eq!(r.timed_out.len(), 1);
        assert!(r.max_failure_breach);
    }

    #[test]
    fn mandatory_groups_go_first_and_per_group_goes_group_by_group() {
        let g = groups(&[("canary", 2), ("", 3), ("", 3)]);
        let s = strategy(json!({"type": "Progressive", "progressive": {
            "mandatoryDecisionGroups": [{"groupName": "canary"}], "maxConcurrency": 4}}));
        assert_eq!(to_apply(&rollout(&s, &g, &[], at(0))), ["c00", "c01"]);
        let canary_done = [
            st("c00", Status::Succeeded, 0),
            st("c01", Status::Succeeded, 0),
        ];
        assert_eq!(
            to_apply(&rollout(&s, &g, &canary_done, at(0))),
            ["c02", "c03", "c04", "c05"]
        );
        let s = strategy(json!({"type": "ProgressivePerGroup"}));
        assert_eq!(to_apply(&rollout(&s, &g, &[], at(0))), ["c00", "c01"]);
        assert_eq!(
            to_apply(&rollout(&s, &g, &canary_done, at(0))),
            ["c02", "c03", "c04"]
        );
    }

    #[test]
    fn clusters_no_longer_selected_are_removed() {
        let r = rollout(
            &strategy(json!({"type": "All"})),
            &groups(&[("", 2)]),
            &[
                st("c00", Status::Succeeded, 0),
                st("gone", Status::Succeeded, 0),
            ],
            at(0),
        );
        assert_eq!(r.removed.len(), 1);
        assert_eq!(r.removed[0].cluster, "gone");
    }

    #[test]
    fn bad_strategies_say_which_field() {
        for (s, message) in [
            (
                json!({"type": "Progressive", "progressive": {"maxConcurrency": "ten"}}),
                "maxConcurrency",
            ),
            (
                json!({"type": "All", "all": {"progressDeadline": "10 minutes"}}),
                "progressDeadline",
            ),
            (
                json!({"type": "Progressive", "progressive": {"minSuccessTime": "x"}}),
                "minSuccessTime",
            ),
        ] {
            let err = parse(Some(&serde_json::from_value(s).unwrap())).unwrap_err();
            assert!(err.contains(message), "{err}");
        }
        assert_eq!(go_duration("1h30m").unwrap(), Duration::from_secs(5400));
        // OCM's schema defaults minSuccessTime to "0": the apiserver writes it into every
        // strategy a kube-backend hub reads.
        assert_eq!(go_duration("0").unwrap(), Duration::ZERO);
        assert!(go_duration("10").is_err(), "only 0 goes without a unit");
        assert_eq!(threshold(&IntOrString::String("10%".into()), 1000, 0), 100);
        assert_eq!(threshold(&IntOrString::Int(0), 1000, 0), 0);
    }

    fn cond(t: &str, status: &str, generation: i64) -> Condition {
        Condition {
            type_: t.into(),
            status: status.into(),
            reason: String::new(),
            message: String::new(),
            observed_generation: Some(generation),
            last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at(0)),
        }
    }

    #[test]
    fn work_status_reads_the_agents_conditions() {
        use Status::*;
        // Conditions as (type, status, observed generation), and the status they mean for a
        // work at generation 2.
        type Conds<'a> = &'a [(&'a str, &'a str, i64)];
        let cases: [(Conds, Status); 6] = [
            (&[], ToApply),
            (
                &[(WORK_APPLIED, "True", 1), (WORK_AVAILABLE, "True", 1)],
                ToApply,
            ),
            (
                &[(WORK_APPLIED, "True", 2), (WORK_AVAILABLE, "True", 2)],
                Succeeded,
            ),
            (
                &[(WORK_APPLIED, "True", 2), (WORK_AVAILABLE, "False", 2)],
                Progressing,
            ),
            (
                &[(WORK_APPLIED, "False", 2), (WORK_DEGRADED, "True", 2)],
                Failed,
            ),
            (
                &[
                    (WORK_APPLIED, "True", 2),
                    (WORK_PROGRESSING, "False", 2),
                    (WORK_DEGRADED, "False", 2),
                ],
                Succeeded,
            ),
        ];
        for (conds, expected) in cases {
            let conds: Vec<Condition> = conds.iter().map(|(t, s, g)| cond(t, s, *g)).collect();
            assert_eq!(work_status("c", 2, &conds).status, expected, "{conds:?}");
        }
    }
}
