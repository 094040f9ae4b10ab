//! Cluster health from sessions, as a sans-IO machine: which clusters hold a session, and when
//! one that lost its last session has been gone for the grace period and must be marked
//! Unknown (with OCM's unreachable taint). The gateway's health task feeds it sessions opening
//! and closing with `now`, calls [`Presence::handle_timeout`] when
//! [`Presence::poll_timeout`] says, and writes what [`Presence::poll_event`] yields to the
//! store. A reconnect within the grace period cancels the pending mark; nothing is written
//! per heartbeat.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

/// What the health writer must record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PresenceEvent {
    /// The cluster's last session ended `grace` ago and none came back: mark it Unknown.
    Unreachable {
        /// The cluster.
        cluster: String,
        /// When its last session ended.
        since: Instant,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// A session is up; `session` is its id (a newer session of the cluster replaces it).
    Connected { session: String },
    /// The last session ended at `since`; Unknown at `since + grace` unless one comes back.
    Gone { since: Instant },
    /// Marked Unknown; stays so until a session opens.
    Unreachable,
}

/// Which clusters hold a session here, and the grace timers of those that lost theirs.
#[derive(Debug)]
pub struct Presence {
    grace: Duration,
    clusters: HashMap<String, State>,
    /// (deadline, cluster) of every cluster in [`State::Gone`], earliest first.
    expiring: BTreeSet<(Instant, String)>,
    events: VecDeque<PresenceEvent>,
}

impl Presence {
    /// A machine that marks clusters Unknown `grace` after their last session ended.
    pub fn new(grace: Duration) -> Presence {
        Presence {
            grace,
            clusters: HashMap::new(),
            expiring: BTreeSet::new(),
            events: VecDeque::new(),
        }
    }

    /// Session `session` of `cluster` is established. It replaces any older session of the
    /// cluster and cancels a pending Unknown.
    pub fn connected(&mut self, cluster: &str, session: &str) {
        if let Some(State::Gone { since }) = self.clusters.get(cluster) {
            self.expiring
                .remove(&(*since + self.grace, cluster.to_string()));
        }
        self.clusters.insert(
            cluster.to_string(),
            State::Connected {
                session: session.to_string(),
            },
        );
    }

    /// Session `session` of `cluster` ended at `now`. Ignored if a newer session of the
    /// cluster is already up.
    pub fn disconnected(&mut self, now: Instant, cluster: &str, session: &str) {
        match self.clusters.get(cluster) {
            Some(State::Connected { session: current }) if current == session => {}
            _ => return,
        }
        self.clusters
            .insert(cluster.to_string(), State::Gone { since: now });
        self.expiring
            .insert((now + self.grace, cluster.to_string()));
    }

    /// `cluster` is recorded Available but has no session here: this gateway has just taken
    /// over its shard, and starts from what the store says. Its grace period starts at `now`
    /// unless a session is up or a grace period already runs; an agent that reconnects within
    /// it is never marked.
    pub fn absent(&mut self, now: Instant, cluster: &str) {
        if matches!(
            self.clusters.get(cluster),
            Some(State::Connected { .. } | State::Gone { .. })
        ) {
            return;
        }
        self.clusters
            .insert(cluster.to_string(), State::Gone { since: now });
        self.expiring
            .insert((now + self.grace, cluster.to_string()));
    }

    /// Forgets a cluster (deleted from the hub, or no longer this gateway's to judge): no mark
    /// will be made for it.
    pub fn forget(&mut self, cluster: &str) {
        if let Some(State::Gone { since }) = self.clusters.remove(cluster) {
            self.expiring
                .remove(&(since + self.grace, cluster.to_string()));
        }
    }

    /// Cancels the pending marks (grace periods running) of the clusters `gone_from` picks:
    /// their shard was lost, so whatever this gateway saw of them no longer counts. Should
    /// the shard come back, its clusters' grace periods start again from that takeover
    /// ([`absent`](Self::absent)). Clusters with a session here keep it.
    pub fn cancel_pending(&mut self, gone_from: impl Fn(&str) -> bool) {
        let cancelled: Vec<(Instant, String)> = self
            .expiring
            .iter()
            .filter(|(_, cluster)| gone_from(cluster))
            .cloned()
            .collect();
        for (deadline, cluster) in cancelled {
            self.expiring.remove(&(deadline, cluster.clone()));
            self.clusters.remove(&cluster);
        }
    }

    /// Whether `cluster` has a session here now.
    pub fn is_connected(&self, cluster: &str) -> bool {
        matches!(self.clusters.get(cluster), Some(State::Connected { .. }))
    }

    /// Number of clusters with a session here.
    pub fn connected_count(&self) -> usize {
        self.clusters
            .values()
            .filter(|s| matches!(s, State::Connected { .. }))
            .count()
    }

    /// Marks every cluster whose grace period has run out by `now`. Calling it early does
    /// nothing.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some((deadline, cluster)) = self.expiring.first().cloned() {
            if deadline > now {
                break;
            }
            self.expiring.pop_first();
            if let Some(State::Gone { since }) = self.clusters.get(&cluster).cloned() {
                self.clusters.insert(cluster.clone(), State::Unreachable);
                self.events
                    .push_back(PresenceEvent::Unreachable { cluster, since });
            }
        }
    }

    /// When to call [`handle_timeout`](Self::handle_timeout) next; `None` while no cluster
    /// is in its grace period.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.expiring.first().map(|(deadline, _)| *deadline)
    }

    /// The next mark to write, in the order they fell due.
    pub fn poll_event(&mut self) -> Option<PresenceEvent> {
        self.events.pop_front()
    }
}

#[cfg(test)]
mod tests {
    //! The grace period on a virtual clock.

    use super::*;

    const GRACE: Duration = Duration::from_secs(40);

    fn marks(p: &mut Presence) -> Vec<String> {
        std::iter::from_fn(|| p.poll_event())
            .map(|PresenceEvent::Unreachable { cluster, .. }| cluster)
            .collect()
    }

    #[test]
    fn a_cluster_gone_for_the_grace_period_is_marked_once() {
        let t0 = Instant::now();
        let mut p = Presence::new(GRACE);
        p.connected("store-1", "s1");
        p.disconnected(t0, "store-1", "s1");
        assert_eq!(p.poll_timeout(), Some(t0 + GRACE));
        p.handle_timeout(t0 + GRACE - Duration::from_millis(1));
        assert!(marks(&mut p).is_empty(), "not before the grace period");
        p.handle_timeout(t0 + GRACE);
        assert_eq!(marks(&mut p), ["store-1"]);
        p.handle_timeout(t0 + GRACE * 3);
        assert!(marks(&mut p).is_empty(), "once");
        assert_eq!(p.poll_timeout(), None);
    }

    #[test]
    fn a_taken_over_cluster_is_marked_only_if_its_agent_never_comes() {
        let t0 = Instant::now();
        let mut p = Presence::new(GRACE);
        p.connected("here", "s1");
        for c in ["here", "back", "never"] {
            p.absent(t0, c);
        }
        p.connected("back", "s2");
        p.absent(t0 + GRACE / 2, "never"); // a second takeover does not restart the clock
        p.handle_timeout(t0 + GRACE);
        assert_eq!(marks(&mut p), ["never"]);
    }

    #[test]
    fn a_shard_lost_and_taken_again_starts_its_clusters_grace_again() {
        let t0 = Instant::now();
        let mut p = Presence::new(GRACE);
        p.connected("here", "s1");
        p.absent(t0, "away");
        p.absent(t0, "elsewhere");
        // The shard of "away" and "here" is lost at t0 + 10 s and taken again at t0 + 30 s.
        p.cancel_pending(|c| c == "away" || c == "here");
        p.handle_timeout(t0 + GRACE);
        assert_eq!(
            marks(&mut p),
            ["elsewhere"],
            "the lost shard's mark is cancelled"
        );
        assert!(p.is_connected("here"), "a session here stays");
        p.absent(t0 + Duration::from_secs(30), "away");
        p.handle_timeout(t0 + Duration::from_secs(30) + GRACE - Duration::from_millis(1));
        assert!(
            marks(&mut p).is_empty(),
            "a full grace period from the second takeover"
        );
        p.handle_timeout(t0 + Duration::from_secs(30) + GRACE);
        assert_eq!(marks(&mut p), ["away"]);
    }

    #[test]
    fn a_reconnect_within_the_grace_period_cancels_the_mark() {
        let t0 = Instant::now();
        let mut p = Presence::new(GRACE);
        p.connected("store-1", "s1");
        p.disconnected(t0, "store-1", "s1");
        p.connected("store-1", "s2");
        p.handle_timeout(t0 + GRACE * 2);
        assert!(marks(&mut p).is_empty());
        assert!(p.is_connected("store-1"));
    }

    #[test]
    fn the_end_of_a_replaced_session_changes_nothing() {
        let t0 = Instant::now();
        let mut p = Presence::new(GRACE);
        p.connected("store-1", "s1");
        // The agent reconnected before its old connection was noticed dead.
        p.connected("store-1", "s2");
        p.disconnected(t0, "store-1", "s1");
        p.handle_timeout(t0 + GRACE * 2);
        assert!(marks(&mut p).is_empty());
        assert_eq!(p.connected_count(), 1);
    }

    #[test]
    fn marks_fall_due_in_order_and_forgotten_clusters_are_not_marked() {
        let t0 = Instant::now();
        let mut p = Presence::new(GRACE);
        for (i, c) in ["a", "b", "c"].iter().enumerate() {
            p.connected(c, "s");
            p.disconnected(t0 + Duration::from_secs(i as u64), c, "s");
        }
        p.forget("b");
        p.handle_timeout(t0 + GRACE + Duration::from_secs(10));
        assert_eq!(marks(&mut p), ["a", "c"]);
    }

    #[test]
    fn a_cluster_marked_unknown_comes_back_with_a_session() {
        let t0 = Instant::now();
        let mut p = Presence::new(GRACE);
        p.connected("store-1", "s1");
        p.disconnected(t0, "store-1", "s1");
        p.handle_timeout(t0 + GRACE);
        assert_eq!(marks(&mut p), ["store-1"]);
        p.connected("store-1", "s2");
        assert!(p.is_connected("store-1"));
        p.disconnected(t0 + GRACE * 2, "store-1", "s2");
        p.handle_timeout(t0 + GRACE * 3);
        assert_eq!(
            marks(&mut p),
            ["store-1"],
            "a second outage is marked again"
        );
    }
}
