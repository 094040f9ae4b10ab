//! Judging the clusters marked Unknown against their agents' sessions.
//!
//! A gateway marks a cluster of its shards Unknown after `--grace-period` without a session
//! of it. Marking one whose agent holds a session (on that gateway or on another that took the
//! shard over) tells operators a live cluster is gone: a violation. The harness keeps every
//! Available=Unknown transition from a watch of the ManagedClusters (stamped with the
//! condition's `lastTransitionTime`, the gateway's clock on this machine) and each agent's
//! latest session changes from its observer. A mark is a violation when the agent's session
//! had been up for at least [`SETTLED`] before the mark and was still up at it: the margin
//! leaves out a session that came up while the mark was already on its way to the store.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// How long a session must have been up before a mark for the mark to count against it.
pub const SETTLED_MS: u64 = 5_000;

/// A cluster turned Unknown, when the condition says.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnknownMark {
    pub cluster: String,
    pub at_unix_ms: u64,
}

/// A mark on a cluster whose agent held a session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WrongMark {
    pub cluster: String,
    pub at_unix_ms: u64,
    /// When the agent's session that was up at the mark began.
    pub session_since_unix_ms: u64,
}

/// Whether the session log (oldest first; `true` a session began, `false` it ended) shows a
/// session up at `at`, and since when.
fn session_at(log: &[(u64, bool)], at: u64) -> Option<u64> {
    let (since, up) = log.iter().rev().find(|(t, _)| *t <= at)?;
    up.then_some(*since)
}

/// How much sooner than a whole grace period after the agent's last session a mark may be
/// stamped and still count as due: the condition's time has whole seconds, and a gateway
/// learns of a close a moment after it.
pub const DUE_SLACK_MS: u64 = 2_000;

/// How many of `marks` were made less than `grace_ms` after their agent's last session
/// (a session up, or ending, within that time before the mark): marks no outage of the agent
/// made due, made while it was handed between gateways. Counted, not judged: a shard's new
/// owner cannot see when the old owner's session of an agent ended, so a partition between
/// them can make such a mark honestly.
pub fn not_due(
    marks: &[UnknownMark],
    sessions: &HashMap<String, Vec<(u64, bool)>>,
    grace_ms: u64,
) -> usize {
    marks
        .iter()
        .filter(|m| {
            let Some(log) = sessions.get(&m.cluster) else {
                return false;
            };
            let from = m
                .at_unix_ms
                .saturating_sub(grace_ms.saturating_sub(DUE_SLACK_MS));
            session_at(log, from).is_some()
                || log.iter().any(|(t, _)| *t > from && *t <= m.at_unix_ms)
        })
        .count()
}

/// The marks of `marks` made while the cluster's agent held a settled session, by `sessions`
/// (cluster → its agent's session log).
pub fn judge(
    marks: &[UnknownMark],
    sessions: &HashMap<String, Vec<(u64, bool)>>,
) -> Vec<WrongMark> {
    marks
        .iter()
        .filter_map(|m| {
            let since = session_at(sessions.get(&m.cluster)?, m.at_unix_ms)?;
            (m.at_unix_ms.saturating_sub(since) >= SETTLED_MS).then(|| WrongMark {
                cluster: m.cluster.clone(),
                at_unix_ms: m.at_unix_ms,
                session_since_unix_ms: since,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(cluster: &str, at: u64) -> UnknownMark {
        UnknownMark {
            cluster: cluster.into(),
            at_unix_ms: at,
        }
    }

    #[test]
    fn a_mark_is_due_only_a_whole_grace_period_after_the_agents_last_session() {
        let sessions = HashMap::from([
            // Up at 1 s, down at 20 s, up again at 100 s.
            (
                "a".to_string(),
                vec![(1_000, true), (20_000, false), (100_000, true)],
            ),
            ("b".to_string(), vec![]),
        ]);
        let grace = 40_000;
        let count = |marks: &[UnknownMark]| not_due(marks, &sessions, grace);
        // 40 s after the close, or within the slack of it: due.
        assert_eq!(count(&[mark("a", 60_000), mark("a", 58_500)]), 0);
        // 30 s after the close, during a session, and 39 s after a session's start: not due.
        assert_eq!(
            count(&[mark("a", 50_000), mark("a", 10_000), mark("a", 139_000)]),
            3
        );
        // Agents that never connected, and clusters of no agent of the run: due.
        assert_eq!(count(&[mark("b", 10_000), mark("c", 10_000)]), 0);
    }

    #[test]
    fn a_mark_counts_against_a_session_up_and_settled_at_its_time_only() {
        let sessions = HashMap::from([
            // Up at 1 s, down at 20 s, up again at 60 s.
            (
                "a".to_string(),
                vec![(1_000, true), (20_000, false), (60_000, true)],
            ),
            ("b".to_string(), vec![]),
        ]);
        let wrong = judge(
            &[
                mark("a", 10_000), // held since 1 s: wrong
                mark("a", 50_000), // no session: right
                mark("a", 62_000), // session 2 s old: the mark was on its way already
                mark("a", 70_000), // held since 60 s: wrong
                mark("b", 10_000), // never connected
                mark("c", 10_000), // not an agent of the run
                mark("a", 500),    // before any session
            ],
            &sessions,
        );
        assert_eq!(
            wrong,
            [
                WrongMark {
                    cluster: "a".into(),
                    at_unix_ms: 10_000,
                    session_since_unix_ms: 1_000
                },
                WrongMark {
                    cluster: "a".into(),
                    at_unix_ms: 70_000,
                    session_since_unix_ms: 60_000
                },
            ]
        );
    }
}
