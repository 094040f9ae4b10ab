//! When each ConfigurationPolicy on a cluster is due for evaluation, as a sans-IO machine in
//! the manner of the session's presence tracker: the agent tells it what happened (a policy
//! arrived or changed, a watched object changed, an evaluation finished) with `now`, asks
//! [`EvaluationSchedule::poll_due`] what to evaluate, and arms a timer for
//! [`EvaluationSchedule::poll_timeout`].
//!
//! The rules are `evaluationInterval`'s, as OCM applies them, chosen by the last result:
//! `watch` (or empty) re-evaluates when an object the policy reads changes; a duration
//! re-evaluates that long after the last evaluation, and watched changes are ignored; `never`
//! does not evaluate again until the policy itself changes. A policy that arrives or changes
//! is due at once; a change seen while it is being evaluated makes it due again afterwards, so
//! no change is lost to a race with the evaluation.

use std::collections::{BTreeSet, HashMap, VecDeque};

use tokio::time::Instant;

use super::evaluate::Compliance;
use super::types::{EvaluationInterval, Interval};

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// In the due queue, waiting for the agent to take it.
    Due,
    /// Taken by [`EvaluationSchedule::poll_due`]; `dirty` when something changed since.
    Evaluating { dirty: bool },
    /// Waiting for a watched object to change.
    Watching,
    /// Waiting for its timer at this instant.
    Timer(Instant),
    /// Evaluated under `never`: waits for the policy to change.
    Settled,
}

#[derive(Debug)]
struct Entry {
    interval: EvaluationInterval,
    state: State,
}

/// The evaluation schedule of the ConfigurationPolicies on one cluster, keyed by a name the
/// agent chooses (e.g. `namespace/name`).
#[derive(Debug, Default)]
pub struct EvaluationSchedule {
    policies: HashMap<String, Entry>,
    /// (deadline, policy) of every policy in [`State::Timer`], earliest first.
    timers: BTreeSet<(Instant, String)>,
    /// Policies in [`State::Due`], in the order they fell due; never longer than `policies`.
    due: VecDeque<String>,
}

impl EvaluationSchedule {
    /// An empty schedule.
    pub fn new() -> EvaluationSchedule {
        EvaluationSchedule::default()
    }

    /// Policy `key` arrived or its spec changed: it is due at once, under `interval` from now
    /// on.
    pub fn upsert(&mut self, key: &str, interval: &EvaluationInterval) {
        let state = match self.policies.get(key).map(|e| e.state.clone()) {
            Some(State::Evaluating { .. }) => State::Evaluating { dirty: true },
            Some(State::Due) => State::Due,
            other => {
                if let Some(State::Timer(at)) = other {
                    self.timers.remove(&(at, key.to_string()));
                }
                self.due.push_back(key.to_string());
                State::Due
            }
        };
        self.policies.insert(
            key.to_string(),
            Entry {
                interval: interval.clone(),
                state,
            },
        );
    }

    /// Policy `key` is gone from the cluster: nothing more is scheduled for it.
    pub fn remove(&mut self, key: &str) {
        match self.policies.remove(key).map(|e| e.state) {
            Some(State::Timer(at)) => {
                self.timers.remove(&(at, key.to_string()));
            }
            // Out of the queue too, so that removing and re-adding cannot grow it.
            Some(State::Due) => self.due.retain(|k| k != key),
            _ => {}
        }
    }

    /// An object policy `key` reads changed on the cluster.
    pub fn object_changed(&mut self, key: &str) {
        let Some(entry) = self.policies.get_mut(key) else {
            return;
        };
        match entry.state {
            State::Watching => {
                entry.state = State::Due;
                self.due.push_back(key.to_string());
            }
            State::Evaluating { .. } => entry.state = State::Evaluating { dirty: true },
            // A timed or settled policy does not watch.
            State::Due | State::Timer(_) | State::Settled => {}
        }
    }

    /// The evaluation of `key` taken from [`EvaluationSchedule::poll_due`] finished at `now`
    /// with `compliance`, which picks the interval to wait.
    pub fn evaluated(&mut self, now: Instant, key: &str, compliance: Compliance) {
        let Some(entry) = self.policies.get_mut(key) else {
            return;
        };
        let State::Evaluating { dirty } = entry.state else {
            return;
        };
        if dirty {
            entry.state = State::Due;
            self.due.push_back(key.to_string());
            return;
        }
        let interval = match compliance {
            Compliance::Compliant => entry.interval.compliant(),
            Compliance::NonCompliant => entry.interval.noncompliant(),
        };
        // Validation refuses an interval that does not parse; should one get here, watching
        // is the default OCM falls back to.
        entry.state = match interval.unwrap_or(Interval::Watch) {
            Interval::Watch => State::Watching,
            Interval::Never => State::Settled,
            Interval::Every(wait) => {
                self.timers.insert((now + wait, key.to_string()));
                State::Timer(now + wait)
            }
        };
    }

    /// Timers that fell due by `now` make their policies due.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some((at, key)) = self.timers.first().cloned() {
            if at > now {
                break;
            }
            self.timers.pop_first();
            if let Some(entry) = self.policies.get_mut(&key) {
                entry.state = State::Due;
                self.due.push_back(key);
            }
        }
    }

    /// When [`EvaluationSchedule::handle_timeout`] must next be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.first().map(|(at, _)| *at)
    }

    /// The next policy to evaluate, in the order they fell due; the agent reports its result
    /// with [`EvaluationSchedule::evaluated`].
    pub fn poll_due(&mut self) -> Option<String> {
        while let Some(key) = self.due.pop_front() {
            if let Some(entry) = self.policies.get_mut(&key)
                && entry.state == State::Due
            {
                entry.state = State::Evaluating { dirty: false };
                return Some(key);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    //! The schedule on a virtual clock.

    use std::time::Duration;

    use super::*;

    fn interval(compliant: &str, noncompliant: &str) -> EvaluationInterval {
        EvaluationInterval {
            compliant: compliant.to_string(),
            noncompliant: noncompliant.to_string(),
        }
    }

    fn due(s: &mut EvaluationSchedule) -> Vec<String> {
        std::iter::from_fn(|| s.poll_due()).collect()
    }

    #[test]
    fn a_new_policy_is_due_at_once_and_then_by_its_interval() {
        let t0 = Instant::now();
        let mut s = EvaluationSchedule::new();
        s.upsert("p", &interval("10m", "10s"));
        assert_eq!(due(&mut s), ["p"]);
        s.evaluated(t0, "p", Compliance::NonCompliant);
        assert_eq!(s.poll_timeout(), Some(t0 + Duration::from_secs(10)));
        s.object_changed("p");
        assert!(due(&mut s).is_empty(), "a timed policy does not watch");
        s.handle_timeout(t0 + Duration::from_secs(9));
        assert!(due(&mut s).is_empty(), "not before its interval");
        s.handle_timeout(t0 + Duration::from_secs(10));
        assert_eq!(due(&mut s), ["p"]);
        let t1 = t0 + Duration::from_secs(10);
        s.evaluated(t1, "p", Compliance::Compliant);
        assert_eq!(s.poll_timeout(), Some(t1 + Duration::from_secs(600)));
    }

    #[test]
    fn a_watching_policy_is_due_when_an_object_changes() {
        let t0 = Instant::now();
        let mut s = EvaluationSchedule::new();
        s.upsert("p", &EvaluationInterval::default());
        assert_eq!(due(&mut s), ["p"]);
        s.evaluated(t0, "p", Compliance::Compliant);
        assert_eq!(s.poll_timeout(), None);
        assert!(due(&mut s).is_empty());
        s.object_changed("p");
        s.object_changed("p");
        assert_eq!(due(&mut s), ["p"], "once however many changes");
    }

    #[test]
    fn a_change_during_an_evaluation_is_not_lost() {
        let t0 = Instant::now();
        let mut s = EvaluationSchedule::new();
        s.upsert("p", &interval("never", "never"));
        assert_eq!(due(&mut s), ["p"]);
        s.upsert("p", &interval("never", "never")); // the policy changed while it ran
        s.evaluated(t0, "p", Compliance::Compliant);
        assert_eq!(due(&mut s), ["p"]);
        s.evaluated(t0, "p", Compliance::Compliant);
        assert!(
            due(&mut s).is_empty(),
            "never: settled until the policy changes"
        );
        s.handle_timeout(t0 + Duration::from_secs(3600));
        assert!(due(&mut s).is_empty());
        s.upsert("p", &interval("never", "1m"));
        assert_eq!(due(&mut s), ["p"]);
    }

    #[test]
    fn removed_policies_fall_out_and_timers_keep_their_order() {
        let t0 = Instant::now();
        let mut s = EvaluationSchedule::new();
        for (key, wait) in [("a", "30s"), ("b", "10s"), ("c", "20s")] {
            s.upsert(key, &interval(wait, wait));
        }
        assert_eq!(due(&mut s), ["a", "b", "c"]);
        for key in ["a", "b", "c"] {
            s.evaluated(t0, key, Compliance::Compliant);
        }
        s.remove("c");
        assert_eq!(s.poll_timeout(), Some(t0 + Duration::from_secs(10)));
        s.handle_timeout(t0 + Duration::from_secs(60));
        assert_eq!(due(&mut s), ["b", "a"]);
        assert_eq!(s.poll_timeout(), None);
    }
}
