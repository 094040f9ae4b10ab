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
