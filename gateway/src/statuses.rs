//! Writing the status agents report into the store: one pending entry per work (the newest
//! seq wins), written through the gateway's [`WriteQueue`] (bounded concurrency, the gateway's
//! write budget, fenced by shard ownership, retried), and the agent's status acknowledged only
//! once it is stored, on the session that reported it.
//!
//! Each write carries the fence the queue checked and the agent's report sequence, so the store
//! refuses it when another gateway wrote the work under a newer epoch since (not acknowledged:
//! the agent reports it to the shard's new owner) or a newer report of the agent is stored
//! (acknowledged: something newer is there). It waits for the turn of its work (never two
//! writes of one work at once, its cleanup finalizer's included) and is compared against and
//! conditioned on the object the previous write returned ([`WorkBases`]), or the work as the
//! gateway's watch cache last saw it, so a status costs the store one request while nobody
//! else wrote the work since.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use flotilla_ops::error_chain;
use flotilla_proto::api::{Kind, ManifestWorkStatus};
use flotilla_store::{Stale, Store, StoreError};
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::desired::DesiredState;
use crate::fencing::{Fencing, Target, WorkBases};
use crate::locks::{SyncMutex, lock};
use crate::mailbox::Mailbox;
use crate::shards::{Held, ShardViews};
use crate::writes::{Coalesce, Outcome, StoreWrite, WriteBudget, WriteQueue};

/// How often the record of stored seqs forgets works that no longer exist, so it holds the
/// live works (and those deleted within this period), not every work ever seen.
const PRUNE_EVERY: Duration = Duration::from_secs(60);

/// A status waiting to be written.
#[derive(Clone, Debug)]
pub struct PendingStatus {
    pub cluster: String,
    pub name: String,
    pub uid: String,
    pub seq: u64,
    pub status: serde_json::Value,
    /// The mailbox of the session that reported it, where its ack goes. Not the cluster's
    /// registered session: an agent reports its outbox as soon as it is welcomed, before its
    /// new session is registered, and it reports a status once per session, so an ack sent
    /// to whichever session the registry held then would be lost for that session's life.
    pub reporter: Weak<Mailbox>,
}

impl Coalesce for PendingStatus {
    fn cluster(&self) -> &str {
        &self.cluster
    }

    fn absorb(&mut self, newer: PendingStatus) {
        if newer.seq > self.seq {
            *self = newer;
        } else if newer.seq == self.seq {
            // The same status again, from the agent's newer session: its ack goes there.
            self.reporter = newer.reporter;
        }
    }

    /// While the session that reported it is still on this gateway, its agent will not report
    /// it to anyone else (it reports its outbox once per session): a shard lost and taken back
    /// under a newer epoch meanwhile (an apiserver outage outlasting the leases) must not lose
    /// it. Once that session is gone, the agent reports it again on its next one.
    fn waits_for_shard(&self) -> bool {
        self.reporter.strong_count() > 0
    }
}

#[derive(Clone, Debug, PartialEq)]
struct Written {
    cluster: String,
    seq: u64,
}

pub struct StatusWriter {
    /// Newest pending status per work uid, and the writes in flight.
    queue: WriteQueue<PendingStatus>,
    /// Highest seq stored per work uid (with the work's cluster), to drop stale reports (a
    /// reconnecting agent resends its outbox). Pruned of deleted works every [`PRUNE_EVERY`].
    written: SyncMutex<HashMap<String, Written>>,
    prune_every: Duration,
    /// The shards this gateway acts for: a status of any other shard's cluster is not written
    /// nor acknowledged, so the agent keeps it and reports it to the shard's owner.
    shards: ShardViews,
    /// How each write goes to the store under its fence.
    fencing: Fencing,
    /// What the last write of each work returned: the next one's basis.
    bases: Arc<WorkBases>,
}

/// Why a reported status was refused; none is retryable with the same frame.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("status of ManifestWork {cluster}/{name} is not a ManifestWork status: {reason}")]
    Malformed {
        cluster: String,
        name: String,
        reason: String,
    },
}

impl StatusWriter {
    /// A writer drawing from the gateway's `budget`, at most `concurrency` writes at once,
    /// each under the fence its queue checked (`fencing`), on the last basis of its work
    /// (`bases`, shared with the gateway's other writers of works).
    pub fn new(
        budget: Arc<WriteBudget>,
        concurrency: usize,
        shards: ShardViews,
        fencing: Fencing,
        bases: Arc<WorkBases>,
    ) -> Arc<StatusWriter> {
        Arc::new(StatusWriter {
            queue: WriteQueue::new(
                "work status",
                budget,
                concurrency,
                shards.clone(),
                fencing.clone(),
            ),
            written: SyncMutex::new(HashMap::new()),
            prune_every: PRUNE_EVERY,
            shards,
            fencing,
            bases,
        })
    }

    /// Statuses waiting to be written.
    pub fn pending_len(&self) -> usize {
        self.queue.pending_len()
    }

    /// Queues a status for writing, to be acknowledged on `reporter`'s session. Validates the
    /// shape first, so nothing malformed reaches the store. A status already stored (an
    /// agent's resend after a reconnect) is acknowledged at once, costing no write.
    pub async fn submit(
        &self,
        reporter: &Arc<Mailbox>,
        cluster: &str,
        name: &str,
        uid: &str,
        seq: u64,
        status_json: &[u8],
    ) -> Result<(), StatusError> {
        let malformed = |reason: String| StatusError::Malformed {
            cluster: cluster.into(),
            name: name.into(),
            reason,
        };
        let mut parsed: ManifestWorkStatus =
            serde_json::from_slice(status_json).map_err(|e| malformed(e.to_string()))?;
        // The fencing record is the store's to write, from the gateway's fence: never an agent's.
        parsed.fence = None;
        let status = serde_json::to_value(parsed).map_err(|e| malformed(e.to_string()))?;
        let pending = PendingStatus {
            cluster: cluster.into(),
            name: name.into(),
            uid: uid.into(),
            seq,
            status,
            reporter: Arc::downgrade(reporter),
        };
        let stored = lock(&self.written).get(uid).is_some_and(|w| w.seq >= seq);
        if stored
            && self
                .shards
                .borrow()
                .holds_cluster(cluster, tokio::time::Instant::now())
        {
            ack(&pending);
            return Ok(());
        }
        self.queue.submit(uid, pending);
        Ok(())
    }

    /// Writes pending statuses until `stop` fires.
    pub async fn run(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        desired: Arc<DesiredState>,
        stop: watch::Receiver<bool>,
    ) {
        let writes = self.queue.run(
            ToStore {
                store: store.as_ref(),
                written: &self.written,
                fencing: &self.fencing,
                bases: &self.bases,
                desired: &desired,
            },
            stop.clone(),
        );
        let pruning = async {
            let mut stop = stop.clone();
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(self.prune_every.max(Duration::from_millis(10))) => {}
                    _ = stop.changed() => return,
                }
                self.prune(&desired);
            }
        };
        tokio::join!(writes, pruning);
    }
}

/// Writes statuses to the store and records the seqs stored.
struct ToStore<'a> {
    store: &'a dyn Store,
    written: &'a SyncMutex<HashMap<String, Written>>,
    fencing: &'a Fencing,
    bases: &'a WorkBases,
    /// The watch cache of works: a basis for a work this gateway has not written yet.
    desired: &'a DesiredState,
}

impl StoreWrite<PendingStatus> for ToStore<'_> {
    async fn write(&self, _uid: &str, p: &PendingStatus, held: Held) -> Outcome {
        if lock(self.written)
            .get(&p.uid)
            .is_some_and(|w| w.seq >= p.seq)
        {
            // Already stored (a resend after reconnect): just acknowledge again.
            ack(p);
            return Outcome::Done;
        }
        let target = Target {
            kind: Kind::ManifestWork,
            namespace: Some(&p.cluster),
            name: &p.name,
            cluster: &p.cluster,
        };
        // After any other write of the work (its finalizer), on what that one returned, or on
        // the work as the watch cache last saw it.
        let mut turn = self.bases.turn(&p.uid, &p.cluster).await;
        if turn.basis.is_none() {
            turn.basis = self.desired.basis(&p.uid);
        }
        match self
            .fencing
            .write_status(
                self.store,
                target,
                p.status.clone(),
                held,
                Some(p.seq),
                turn.basis.as_ref(),
            )
            .await
        {
            Ok(stored) => {
                turn.record(&stored);
                let written = Written {
                    cluster: p.cluster.clone(),
                    seq: p.seq,
                };
                lock(self.written).insert(p.uid.clone(), written);
                debug!(cluster = %p.cluster, work = %p.name, seq = p.seq, "work status stored");
                ack(p);
                Outcome::Done
            }
            Err(StoreError::NotFound { .. }) => {
                // The work was deleted meanwhile: its status has nowhere to go. Acknowledge
                // so the agent stops resending it.
                turn.forget();
                ack(p);
                Outcome::Done
            }
            // A newer report of the agent is stored (through another gateway, or this one
            // before a restart): this one is done with.
            Err(StoreError::Fenced {
                reason: Stale::Report,
                ..
            }) => {
                ack(p);
                Outcome::Refused
            }
            // Another gateway took the shard and wrote since this one checked its fence: not
            // acknowledged, so the agent reports it to the shard's owner.
            Err(StoreError::Fenced { .. }) => {
                turn.forget();
                Outcome::Refused
            }
            Err(e @ StoreError::Conflict { .. }) => {
                debug!(cluster = %p.cluster, work = %p.name, error = %error_chain(&e), "work status kept losing races; trying again");
                turn.forget();
                Outcome::Conflict
            }
            Err(e) => {
                warn!(cluster = %p.cluster, work = %p.name, error = %error_chain(&e), "storing work status failed; will retry");
                turn.forget();
                Outcome::Failed
            }
        }
    }
}

impl StatusWriter {
    /// Forgets the stored seqs and the bases of works the desired state no longer has, and of
    /// clusters whose shard it no longer holds (handed over: nothing will be written for them
    /// here, and waiting for their shard's load would wait for ever).
    fn prune(&self, desired: &DesiredState) {
        let entries: Vec<(String, Written)> = {
            let written = lock(&self.written);
            written
                .iter()
                .map(|(uid, w)| (uid.clone(), w.clone()))
                .collect()
        };
        let mut gone = Vec::new();
        for (uid, w) in entries {
            if !desired.has_work(&w.cluster, &uid) {
                gone.push(uid);
            }
        }
        for (uid, cluster) in self.bases.works() {
            if !desired.has_work(&cluster, &uid) {
                self.bases.forget(&uid);
            }
        }
        if !gone.is_empty() {
            let mut written = lock(&self.written);
            for uid in &gone {
                written.remove(uid);
            }
            debug!(
                forgotten = gone.len(),
                "status record pruned of deleted works"
            );
        }
    }

    /// Works whose stored seq is remembered (for tests).
    #[cfg(test)]
    fn remembered(&self) -> Vec<String> {
        let mut uids: Vec<String> = lock(&self.written).keys().cloned().collect();
        uids.sort();
        uids
    }
}

/// Acknowledges `p` on the session that reported it, if that session is still alive; if not,
/// the agent reports the status again on its next session and gets the ack there.
fn ack(p: &PendingStatus) {
    if let Some(mailbox) = p.reporter.upgrade() {
        mailbox.status_ack(&p.uid, p.seq);
    }
}

#[cfg(test)]
mod tests {
    //! The record of stored seqs stays bounded by the live works.

    use super::*;
    use crate::registry::Registry;
    use crate::test_support::eventually;
    use flotilla_store::SledStore;
    use serde_json::json;

    fn work(name: &str) -> serde_json::Value {
        work_of("store-1", name)
    }

    fn work_of(cluster: &str, name: &str) -> serde_json::Value {
        json!({
            "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
            "metadata": {"name": name, "namespace": cluster},
            "spec": {"workload": {"manifests": []}},
        })
    }

    /// A status of a cluster whose shard this gateway does not hold is neither stored nor
    /// acknowledged (its agent keeps it for the shard's owner); one of a held shard is both.
    /// It waits while the session that reported it is here (the shard may come back), and is
    /// dropped once that session is gone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_status_of_a_shard_not_held_is_neither_stored_nor_acked() {
        use crate::shards::{Fence, ShardDirectory, ShardView};
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        let all = ShardView::all(64);
        let held = "store-1";
        let other = (2..)
            .map(|i| format!("store-{i}"))
            .find(|c| all.shard_of(c) != all.shard_of(held))
            .unwrap();
        let mut uids = Vec::new();
        for cluster in [held, other.as_str()] {
            let created = store.create(work_of(cluster, "web")).await.unwrap();
            uids.push(created["metadata"]["uid"].as_str().unwrap().to_string());
        }
        let fences = std::collections::BTreeMap::from([(
            all.shard_of(held),
            Fence {
                epoch: 1,
                valid_until: tokio::time::Instant::now() + Duration::from_secs(3600),
            },
        )]);
        let views = watch::channel(Arc::new(ShardView::leased(
            64,
            fences,
            ShardDirectory::default(),
        )))
        .1;
        let desired = DesiredState::new();
        let (stop_tx, stop) = watch::channel(false);
        let writer = StatusWriter::new(
            Arc::new(WriteBudget::new(1000.0, 1000)),
            4,
            views,
            Fencing::default(),
            WorkBases::new(),
        );
        let status = json!({"conditions": []}).to_string();
        let (ours, theirs) = (Arc::new(Mailbox::default()), Arc::new(Mailbox::default()));
        // The other shard's first: the queue takes them in order.
        writer
            .submit(&theirs, &other, "web", &uids[1], 1, status.as_bytes())
            .await
            .unwrap();
        writer
            .submit(&ours, held, "web", &uids[0], 1, status.as_bytes())
            .await
            .unwrap();
        tokio::spawn(writer.clone().run(store.clone(), desired, stop));
        tokio::time::timeout(Duration::from_secs(10), ours.ready())
            .await
            .expect("the held shard's status acknowledged");
        assert_eq!(ours.take().status_acks, vec![(uids[0].clone(), 1)]);
        assert!(theirs.take().status_acks.is_empty(), "not acked");
        assert_eq!(writer.pending_len(), 1, "kept while its session is here");
        drop(theirs);
        flotilla_testenv::wait_for(
            "the status dropped once its session is gone",
            Duration::from_secs(10),
            || async { Ok((writer.pending_len() == 0).then_some(())) },
        )
        .await
        .unwrap();
        let stored = |cluster: String| {
            let store = store.clone();
            async move {
                store
                    .get(Kind::ManifestWork, Some(&cluster), "web")
                    .await
                    .unwrap()
                    .unwrap()["status"]
                    .clone()
            }
        };
        assert!(!stored(held.to_string()).await.is_null(), "stored");
        assert!(stored(other.clone()).await.is_null(), "not stored");
        let _ = stop_tx.send(true);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deleted_works_are_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        let uid = |o: &serde_json::Value| o["metadata"]["uid"].as_str().unwrap().to_string();
        let kept = uid(&store.create(work("kept")).await.unwrap());
        let gone = uid(&store.create(work("gone")).await.unwrap());
        let registry = Arc::new(Registry::default());
        let desired = DesiredState::new();
        let (stop_tx, stop) = watch::channel(false);
        tokio::spawn(desired.clone().run(
            store.clone(),
            registry.clone(),
            crate::finalizers::CleanupFinalizers::for_tests(),
            crate::shards::ShardView::all_views(),
            stop.clone(),
        ));
        desired.wait_ready().await;
        let writer = Arc::new(StatusWriter {
            prune_every: Duration::ZERO,
            ..Arc::into_inner(StatusWriter::new(
                Arc::new(WriteBudget::new(1000.0, 1000)),
                4,
                tokio::sync::watch::channel(Arc::new(crate::shards::ShardView::all(64))).1,
                Fencing::default(),
                WorkBases::new(),
            ))
            .unwrap()
        });
        tokio::spawn(writer.clone().run(store.clone(), desired.clone(), stop));
        let status = json!({"conditions": []}).to_string();
        let reporter = Arc::new(Mailbox::default());
        for (name, uid) in [("kept", &kept), ("gone", &gone)] {
            writer
                .submit(&reporter, "store-1", name, uid, 1, status.as_bytes())
                .await
                .unwrap();
        }
        let both = {
            let mut both = vec![kept.clone(), gone.clone()];
            both.sort();
            both
        };
        eventually("both statuses stored", || async {
            writer.remembered() == both
        })
        .await;

        store
            .delete(Kind::ManifestWork, Some("store-1"), "gone")
            .await
            .unwrap();
        eventually("the deletion reaches the desired state", || async {
            desired.owned_by("store-1", &gone).await.is_none()
        })
        .await;
        // The next status written goes through a pruning pass.
        writer
            .submit(&reporter, "store-1", "kept", &kept, 2, status.as_bytes())
            .await
            .unwrap();
        eventually("the deleted work is forgotten", || async {
            writer.remembered() == [kept.clone()]
        })
        .await;
        let _ = stop_tx.send(true);
    }

    /// An agent reports its outbox once per session, as soon as it is welcomed (before its
    /// session is registered here). The ack goes to the session that reported the status; the
    /// same status reported again from a newer session moves its ack there.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_status_is_acked_on_the_session_that_reported_it() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        let created = store.create(work("web")).await.unwrap();
        let uid = created["metadata"]["uid"].as_str().unwrap().to_string();
        let registry = Arc::new(Registry::default());
        let desired = DesiredState::new();
        let (stop_tx, stop) = watch::channel(false);
        tokio::spawn(desired.clone().run(
            store.clone(),
            registry,
            crate::finalizers::CleanupFinalizers::for_tests(),
            crate::shards::ShardView::all_views(),
            stop.clone(),
        ));
        desired.wait_ready().await;
        let writer = StatusWriter::new(
            Arc::new(WriteBudget::new(1000.0, 1000)),
            4,
            tokio::sync::watch::channel(Arc::new(crate::shards::ShardView::all(64))).1,
            Fencing::default(),
            WorkBases::new(),
        );
        let status = json!({"conditions": []}).to_string();
        // The first session reports, goes away unacked; the next one reports the same status;
        // no session is registered anywhere.
        let (first, second) = (Arc::new(Mailbox::default()), Arc::new(Mailbox::default()));
        for session in [&first, &second] {
            writer
                .submit(session, "store-1", "web", &uid, 3, status.as_bytes())
                .await
                .unwrap();
        }
        tokio::spawn(
            writer
                .clone()
                .run(store.clone(), desired.clone(), stop.clone()),
        );
        tokio::time::timeout(Duration::from_secs(10), second.ready())
            .await
            .expect("the second session got an ack");
        assert_eq!(second.take().status_acks, vec![(uid.clone(), 3)]);
        assert!(first.take().status_acks.is_empty());
        // A later report of a stored seq (the agent's third session) is acked again, there.
        let third = Arc::new(Mailbox::default());
        writer
            .submit(&third, "store-1", "web", &uid, 3, status.as_bytes())
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(10), third.ready())
            .await
            .expect("the third session got an ack");
        assert_eq!(third.take().status_acks, vec![(uid, 3)]);
        let _ = stop_tx.send(true);
    }
}
