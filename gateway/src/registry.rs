//! The live session of each cluster on this gateway, reachable through its mailbox.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use crate::locks::{read, write};
use crate::mailbox::{Mailbox, WorkChange};

#[derive(Clone)]
pub struct SessionHandle {
    /// The cluster named in the session's certificate.
    pub cluster: String,
    pub session_id: String,
    /// Public key hash of the session's certificate: admission closes the session if the
    /// cluster's registered keys no longer include it.
    pub client_key_sha256: String,
    pub mailbox: Arc<Mailbox>,
    /// Opens tunnel streams to this session's agent, on its connection.
    pub tunnels: flotilla_transport::TunnelOpener,
    /// The carrier the session rides, and when it was established: wall time, because the
    /// hub's status page shows both to people.
    pub carrier: flotilla_transport::Carrier,
    pub established: SystemTime,
}

/// What this gateway knows of a cluster's session, as people read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionPresence {
    /// A session is live here, on `carrier`, since `since`.
    Connected {
        carrier: flotilla_transport::Carrier,
        since: SystemTime,
    },
    /// The cluster's last session here ended at `at`, and none has come back.
    Departed { at: SystemTime },
}

/// One session per cluster: a newer session of the same cluster replaces the older one (the
/// agent restarted, or its old TCP connection is a zombie the agent gave up on).
/// Blocking locks (see [`crate::locks`]).
#[derive(Default)]
pub struct Registry {
    sessions: RwLock<HashMap<String, SessionHandle>>,
    /// When each cluster's last session on this gateway ended, for as long as it has none: a
    /// kubectl request to it is told since when the cluster has been away. Wall time, because
    /// it is shown to people. One entry per cluster that ever held a session here and has not
    /// come back, at most [`MAX_DEPARTURES`].
    departed: RwLock<HashMap<String, SystemTime>>,
}

/// Departures remembered at most; beyond it a departure is not recorded (the proxy front
/// then says the cluster has had no session since this gateway started).
pub const MAX_DEPARTURES: usize = 1_000_000;

impl Registry {
    /// Registers a session and returns the one it replaces, if any.
    pub fn register(&self, cluster: &str, handle: SessionHandle) -> Option<SessionHandle> {
        let mut sessions = write(&self.sessions);
        write(&self.departed).remove(cluster);
        sessions.insert(cluster.to_string(), handle)
    }

    /// Removes the cluster's entry if it is still this session.
    pub fn unregister(&self, cluster: &str, session_id: &str) {
        let mut sessions = write(&self.sessions);
        if sessions
            .get(cluster)
            .is_some_and(|h| h.session_id == session_id)
        {
            sessions.remove(cluster);
            // Both locks, sessions first, as in `register`: a cluster is never both present
            // and departed.
            let mut departed = write(&self.departed);
            if departed.len() < MAX_DEPARTURES {
                departed.insert(cluster.to_string(), SystemTime::now());
            }
        }
    }

    /// When `cluster`'s last session here ended, if it has none now and had one since this
    /// gateway started.
    pub fn departed(&self, cluster: &str) -> Option<SystemTime> {
        read(&self.departed).get(cluster).copied()
    }

    /// Whether `cluster` has a session here, or when its last one ended; `None` when it has had
    /// none since this gateway started.
    pub fn presence(&self, cluster: &str) -> Option<SessionPresence> {
        let connected = read(&self.sessions)
            .get(cluster)
            .map(|h| SessionPresence::Connected {
                carrier: h.carrier,
                since: h.established,
            });
        connected.or_else(|| {
            self.departed(cluster)
                .map(|at| SessionPresence::Departed { at })
        })
    }

    pub fn get(&self, cluster: &str) -> Option<SessionHandle> {
        read(&self.sessions).get(cluster).cloned()
    }

    /// Hands a desired-state change to the cluster's session, if it has one here. Clusters
    /// without a session get it at their next hello (resume), from the watch cache.
    pub fn deliver(&self, cluster: &str, change: WorkChange) {
        if let Some(h) = self.get(cluster) {
            h.mailbox.work(change);
        }
    }

    pub fn is_empty(&self) -> bool {
        read(&self.sessions).is_empty()
    }

    pub fn len(&self) -> usize {
        read(&self.sessions).len()
    }

    /// Every live session, for shutdown.
    pub fn all(&self) -> Vec<SessionHandle> {
        read(&self.sessions).values().cloned().collect()
    }
}
