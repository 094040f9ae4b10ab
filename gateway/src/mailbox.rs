//! What the rest of the gateway tells one session's driver: desired-state changes, status acks,
//! close requests. Writers never wait on a session: the mailbox coalesces by work (latest wins),
//! so a slow agent costs one entry per work, and fan-out to the other sessions never stalls.

use std::collections::{HashMap, HashSet};

use flotilla_proto::session::DesiredWork;

use crate::locks::{SyncMutex, lock};
use tokio::sync::Notify;

/// A change to one work, as the driver will hand it to the protocol machine.
#[derive(Clone, Debug, PartialEq)]
pub enum WorkChange {
    Upsert(DesiredWork),
    Delete {
        uid: String,
        namespace: String,
        name: String,
    },
}

#[derive(Default)]
struct Pending {
    /// Latest change per work uid, in no particular order: the machine's own queue orders
    /// delivery, this only coalesces until the driver looks.
    works: HashMap<String, WorkChange>,
    /// Highest stored status seq per work uid, to acknowledge to the agent.
    status_acks: HashMap<String, u64>,
    /// Works whose release is recorded (their cleanup finalizer gone), to acknowledge.
    release_acks: HashSet<String>,
    close: Option<Closing>,
    /// A new CA bundle to send the agent (after a CA rotation); the latest wins.
    trust_bundle: Option<String>,
    /// Tunnel ids the agent is to open (`OpenTunnel`, gRPC carrier), in order.
    open_tunnels: Vec<String>,
}

/// Why the rest of the gateway ends a session.
#[derive(Clone, Debug, PartialEq)]
pub enum Closing {
    /// For a reason the agent need not act on (replaced by a newer session, shutting down).
    Close(String),
    /// The cluster is no longer admitted: the agent is told what is wrong.
    Refuse(flotilla_proto::wire::Refusal, String),
    /// This gateway no longer acts for the cluster's shard: come back after `retry_after`, at
    /// `redirect` (the owner) when known.
    Drain {
        retry_after: std::time::Duration,
        redirect: Option<String>,
        reason: String,
    },
}

/// The drained contents of a mailbox.
#[derive(Debug, Default)]
pub struct Delivery {
    pub works: Vec<WorkChange>,
    pub status_acks: Vec<(String, u64)>,
    pub release_acks: Vec<String>,
    pub close: Option<Closing>,
    pub trust_bundle: Option<String>,
    pub open_tunnels: Vec<String>,
}

/// A blocking lock (see [`crate::locks`]).
#[derive(Default)]
pub struct Mailbox {
    pending: SyncMutex<Pending>,
    notify: Notify,
}

impl Mailbox {
    pub fn work(&self, change: WorkChange) {
        let uid = match &change {
            WorkChange::Upsert(w) => w.uid.clone(),
            WorkChange::Delete { uid, .. } => uid.clone(),
        };
        lock(&self.pending).works.insert(uid, change);
        self.notify.notify_one();
    }

    pub fn status_ack(&self, uid: &str, seq: u64) {
        let mut pending = lock(&self.pending);
        let entry = pending.status_acks.entry(uid.to_string()).or_insert(seq);
        *entry = (*entry).max(seq);
        drop(pending);
        self.notify.notify_one();
    }

    /// Acknowledges the agent's release of work `uid` (`ReleaseAck`).
    pub fn release_ack(&self, uid: &str) {
        lock(&self.pending).release_acks.insert(uid.to_string());
        self.notify.notify_one();
    }

    pub fn close(&self, reason: impl Into<String>) {
        lock(&self.pending).close = Some(Closing::Close(reason.into()));
        self.notify.notify_one();
    }

    /// Ends the session because its cluster is no longer admitted.
    pub fn refuse(&self, refusal: flotilla_proto::wire::Refusal, reason: impl Into<String>) {
        lock(&self.pending).close = Some(Closing::Refuse(refusal, reason.into()));
        self.notify.notify_one();
    }

    /// Ends the session because this gateway no longer acts for its shard (see [`Closing::Drain`]).
    pub fn drain(
        &self,
        retry_after: std::time::Duration,
        redirect: Option<String>,
        reason: impl Into<String>,
    ) {
        lock(&self.pending).close = Some(Closing::Drain {
            retry_after,
            redirect,
            reason: reason.into(),
        });
        self.notify.notify_one();
    }

    pub fn trust_bundle(&self, ca_bundle_pem: String) {
        lock(&self.pending).trust_bundle = Some(ca_bundle_pem);
        self.notify.notify_one();
    }

    /// Asks the agent to open tunnel `id` (`OpenTunnel`).
    pub fn open_tunnel(&self, id: impl Into<String>) {
        lock(&self.pending).open_tunnels.push(id.into());
        self.notify.notify_one();
    }

    /// Waits until something is pending (returns at once if something already is).
    pub async fn ready(&self) {
        self.notify.notified().await;
    }

    pub fn take(&self) -> Delivery {
        let mut pending = lock(&self.pending);
        Delivery {
            works: pending.works.drain().map(|(_, c)| c).collect(),
            status_acks: pending.status_acks.drain().collect(),
            release_acks: pending.release_acks.drain().collect(),
            close: pending.close.take(),
            trust_bundle: pending.trust_bundle.take(),
            open_tunnels: std::mem::take(&mut pending.open_tunnels),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn update(uid: &str, generation: i64) -> WorkChange {
        WorkChange::Upsert(DesiredWork {
            uid: uid.into(),
            generation,
            ..Default::default()
        })
    }

    #[tokio::test]
    async fn coalesces_per_work_and_keeps_the_highest_ack() {
        let mb = Mailbox::default();
        for g in 1..=10 {
            mb.work(update("a", g));
        }
        mb.work(update("b", 1));
        mb.work(WorkChange::Delete {
            uid: "b".into(),
            namespace: "c".into(),
            name: "w".into(),
        });
        mb.status_ack("a", 7);
        mb.status_ack("a", 5);
        mb.ready().await; // a permit is stored: returns at once
        let mut got = mb.take();
        got.works.sort_by_key(|c| format!("{c:?}"));
        assert_eq!(got.works.len(), 2);
        assert!(got.works.contains(&update("a", 10)));
        assert!(
            got.works
                .iter()
                .any(|c| matches!(c, WorkChange::Delete { uid, .. } if uid == "b"))
        );
        assert_eq!(got.status_acks, vec![("a".to_string(), 7)]);
        assert!(mb.take().works.is_empty());
    }
}
