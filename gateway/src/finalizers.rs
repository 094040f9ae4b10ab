//! The cleanup finalizer on ManifestWorks ([`WORK_CLEANUP_FINALIZER`], OCM's name): put on by
//! the hub on the works it creates (its API, its ManifestWorkReplicaSets), or added here once
//! the agent has acknowledged a work created around the hub (`kubectl` on the kube store);
//! removed once the agent reports it released (`WorkReleased`: everything it applied is gone
//! from the spoke, or orphaned as its deleteOption says). In between, a deleted work stays on
//! the hub, its `Deleting` condition showing how the removal goes. A deleted work that no
//! agent ever reported on, while its cluster has no session, is let go at once (the desired
//! state's `let_go_if_unheard`); one without the finalizer is deleted at once.
//!
//! A hold writes the work as the gateway's watch cache last saw it, conditioned on that
//! version, so it costs one request, not a read and a write; a copy out of date makes it a
//! conflict, and the next try reads the work first. A release always reads first (the work
//! is being deleted, and the cache keeps only desired works).
//!
//! Writes go through the gateway's [`WriteQueue`], coalesced by work (a release replaces a
//! pending add), within the gateway's write budget shared with status writes, each fenced
//! right before it by the shard this gateway acts for: a gateway that lost the cluster's shard
//! writes nothing, and the agent reports its release again to the shard's new owner. The store
//! enforces the same fence: each write is compared against the work's fencing record (a newer
//! owner's write refuses it) without raising it. A release is acknowledged to the session that
//! reported it only once the finalizer is gone (or the work is).

use std::collections::HashSet;
use std::sync::{Arc, Weak};

use flotilla_ops::error_chain;
use flotilla_proto::api::Kind;
use flotilla_proto::contract::WORK_CLEANUP_FINALIZER;
use flotilla_store::{Store, StoreError};
use serde_json::{Value, json};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::desired::DesiredState;
use crate::fencing::{Fencing, WorkBases};
use crate::locks::{SyncMutex, lock};
use crate::mailbox::Mailbox;
use crate::shards::{Held, ShardViews};
use crate::writes::{Coalesce, Outcome, StoreWrite, WriteBudget, WriteQueue};

/// What to do about one work's finalizer.
#[derive(Clone, Debug)]
enum Change {
    /// The agent acknowledged the work: hold its deletion until the agent releases it.
    Hold { name: String },
    /// The agent released the work: let it go, then acknowledge on `reporter` (if any: a
    /// release found at sync time, for a work the agent no longer knows, has no one to tell).
    Release { reporter: Weak<Mailbox> },
}

#[derive(Clone, Debug)]
struct Pending {
    cluster: String,
    uid: String,
    change: Change,
}

impl Coalesce for Pending {
    fn cluster(&self) -> &str {
        &self.cluster
    }

    /// A release replaces whatever waits; a hold is ignored while a release waits.
    fn absorb(&mut self, newer: Pending) {
        if matches!(newer.change, Change::Release { .. })
            || matches!(self.change, Change::Hold { .. })
        {
            *self = newer;
        }
    }
}

/// The task that adds and removes cleanup finalizers; see the module docs.
pub struct CleanupFinalizers {
    /// One pending change per work uid, and the writes in flight.
    queue: WriteQueue<Pending>,
    /// How each write goes to the store under its fence.
    fencing: Fencing,
    /// Whose turn it is to write each work, and what the last write returned: a hold's result
    /// is the work's first status write's basis.
    bases: Arc<WorkBases>,
}

impl CleanupFinalizers {
    /// A writer drawing from the gateway's `budget`, at most `concurrency` writes at once,
    /// each under the fence its queue checked (`fencing`), recording what it wrote in `bases`.
    pub fn new(
        budget: Arc<WriteBudget>,
        concurrency: usize,
        shards: ShardViews,
        fencing: Fencing,
        bases: Arc<WorkBases>,
    ) -> Arc<CleanupFinalizers> {
        Arc::new(CleanupFinalizers {
            queue: WriteQueue::new(
                "cleanup finalizer",
                budget,
                concurrency,
                shards,
                fencing.clone(),
            ),
            fencing,
            bases,
        })
    }

    /// The agent of `cluster` acknowledged work `uid` (`name`), which has no cleanup finalizer
    /// yet: add it. Ignored while a release of the work is pending.
    pub fn hold(&self, cluster: &str, name: &str, uid: &str) {
        self.queue.submit(
            &queue_key(cluster, uid),
            Pending {
                cluster: cluster.to_owned(),
                uid: uid.to_owned(),
                change: Change::Hold {
                    name: name.to_owned(),
                },
            },
        );
    }

    /// The agent of `cluster` released work `uid`: remove its cleanup finalizer and then
    /// acknowledge on `reporter`'s session (`None`: tell no one).
    pub fn release(&self, cluster: &str, uid: &str, reporter: Option<&Arc<Mailbox>>) {
        let reporter = reporter.map_or_else(Weak::new, Arc::downgrade);
        self.queue.submit(
            &queue_key(cluster, uid),
            Pending {
                cluster: cluster.to_owned(),
                uid: uid.to_owned(),
                change: Change::Release { reporter },
            },
        );
    }

    /// A writer for tests, with a generous budget, acting for every shard.
    #[cfg(test)]
    pub fn for_tests() -> Arc<CleanupFinalizers> {
        CleanupFinalizers::new(
            Arc::new(WriteBudget::new(1000.0, 1000)),
            4,
            watch::channel(Arc::new(crate::shards::ShardView::all(64))).1,
            Fencing::default(),
            WorkBases::new(),
        )
    }

    /// Changes waiting to be written.
    pub fn pending_len(&self) -> usize {
        self.queue.pending_len()
    }

    /// Writes pending changes until `stop` fires.
    pub async fn run(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        desired: Arc<DesiredState>,
        stop: watch::Receiver<bool>,
    ) {
        let writer = ToStore {
            store: store.as_ref(),
            desired: &desired,
            fencing: &self.fencing,
            bases: &self.bases,
            stale: SyncMutex::default(),
        };
        self.queue.run(writer, stop).await;
    }
}

/// A work's key in the queue: its cluster and its uid. A session may report the release of any
/// uid (it is checked against the cluster's own works only when written), so by uid alone a
/// release another cluster's agent names would fold into the owning cluster's pending hold or
/// release and replace it.
fn queue_key(cluster: &str, uid: &str) -> String {
    format!("{cluster}/{uid}")
}

/// Most works remembered as needing a fresh read before their next hold.
const MAX_STALE: usize = 4096;

/// Records that `uid`'s next hold reads the work first, within [`MAX_STALE`]: when full, the
/// others are forgotten, and their next holds try the cached copy once more (a conflict again
/// at worst).
fn remember_stale(stale: &mut HashSet<String>, uid: &str) {
    if stale.len() >= MAX_STALE {
        stale.clear();
    }
    stale.insert(uid.to_owned());
}

/// Writes finalizer changes to the store.
struct ToStore<'a> {
    store: &'a dyn Store,
    desired: &'a DesiredState,
    fencing: &'a Fencing,
    bases: &'a WorkBases,
    /// Works whose hold was refused as a conflict on the watch cache's copy: their next hold
    /// reads the work first. At most [`MAX_STALE`]: a uid whose retry never came (its shard
    /// went elsewhere) would otherwise stay for the writer's life.
    stale: SyncMutex<HashSet<String>>,
}

impl StoreWrite<Pending> for ToStore<'_> {
    async fn write(&self, _uid: &str, p: &Pending, held: Held) -> Outcome {
        let fenced = Fenced {
            store: self.store,
            fencing: self.fencing,
            held,
        };
        // After any other write of the work (its status); what this one writes is the basis of
        // the next (the work's first status follows its finalizer).
        let mut turn = self.bases.turn(&p.uid, &p.cluster).await;
        let written = match &p.change {
            Change::Hold { name } => {
                // The watch cache's copy, unless it is behind this gateway's own last write of
                // the work, or a hold on it was refused as a conflict: then a fresh read.
                let stale = lock(&self.stale).contains(&p.uid);
                let seen = match turn.basis.as_ref() {
                    _ if stale => None,
                    Some(basis)
                        if self.desired.basis(&p.uid).map(|b| b.revision)
                            != Some(basis.revision.clone()) =>
                    {
                        None
                    }
                    _ => self.desired.work_as_seen(&p.cluster, &p.uid).await,
                };
                let held = hold(&fenced, seen, &p.cluster, name, &p.uid).await;
                if matches!(held, Err(StoreError::Conflict { .. })) {
                    remember_stale(&mut lock(&self.stale), &p.uid);
                } else {
                    lock(&self.stale).remove(&p.uid);
                }
                match &held {
                    Ok(Some(work)) => turn.record(work),
                    _ => turn.forget(),
                }
                held.map(|_| ())
            }
            Change::Release { reporter } => {
                let done = release(&fenced, self.desired, &p.cluster, &p.uid).await;
                turn.forget();
                if done.is_ok()
                    && let Some(mailbox) = reporter.upgrade()
                {
                    mailbox.release_ack(&p.uid);
                }
                done
            }
        };
        match written {
            Ok(()) => Outcome::Done,
            // Retried at once on a fresh read.
            Err(StoreError::Conflict { .. }) => Outcome::Conflict,
            // Another gateway took the shard and wrote the work since this one checked its
            // fence (logged and counted): a release is not acknowledged, so the agent reports
            // it to the shard's owner.
            Err(StoreError::Fenced { .. }) => Outcome::Refused,
            Err(e) => {
                warn!(cluster = %p.cluster, work_uid = %p.uid, error = %error_chain(&e), "writing the work's cleanup finalizer failed; will retry");
                Outcome::Failed
            }
        }
    }
}

/// The store and the fence one write is made under.
struct Fenced<'a> {
    store: &'a dyn Store,
    fencing: &'a Fencing,
    held: Held,
}

impl Fenced<'_> {
    async fn write(&self, work: Value, cluster: &str) -> Result<Value, StoreError> {
        self.fencing
            .write_spec(self.store, work, cluster, self.held)
            .await
    }
}

/// Adds the finalizer to the work, as `seen` by the watch cache or else read fresh, with its
/// resourceVersion as the precondition (a copy that is out of date makes the write a
/// conflict, never a lost change), and returns the work as written. Nothing to do when the
/// work is gone, is another work of the same name (a new uid), is being deleted already (no
/// finalizer may be added then), or has the finalizer.
async fn hold(
    fenced: &Fenced<'_>,
    seen: Option<Value>,
    cluster: &str,
    name: &str,
    uid: &str,
) -> Result<Option<Value>, StoreError> {
    let store = fenced.store;
    let mut work = match seen {
        Some(work) => work,
        None => match store.get(Kind::ManifestWork, Some(cluster), name).await? {
            Some(work) => work,
            None => return Ok(None),
        },
    };
    if work["metadata"]["uid"].as_str() != Some(uid)
        || !work["metadata"]["deletionTimestamp"].is_null()
    {
        return Ok(None);
    }
    let mut finalizers = finalizers(&work);
    if finalizers.iter().any(|f| f == WORK_CLEANUP_FINALIZER) {
        return Ok(Some(work));
    }
    finalizers.push(WORK_CLEANUP_FINALIZER.to_owned());
    set_finalizers(&mut work, finalizers);
    match fenced.write(work, cluster).await {
        Ok(written) => {
            debug!(cluster, work = %name, "cleanup finalizer added");
            Ok(Some(written))
        }
        Err(StoreError::NotFound { .. }) => Ok(None),
        // Deleted between the read and the write: it is on its way out without us.
        Err(StoreError::Invalid { reason, .. }) => {
            debug!(cluster, work = %name, %reason, "cleanup finalizer not added");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Removes the finalizer from the deleted work `uid` of `cluster`, read fresh. Nothing to do
/// when the work is gone or has no such finalizer. A work that is not being deleted keeps its
/// finalizer: its agent released something the hub still wants, which only a stale session
/// can say, and the finalizer must then still hold the work's next deletion.
async fn release(
    fenced: &Fenced<'_>,
    desired: &DesiredState,
    cluster: &str,
    uid: &str,
) -> Result<(), StoreError> {
    let store = fenced.store;
    // Only this cluster's works: the name comes from the cluster's own namespace.
    let Some(name) = desired.owned_by(cluster, uid).await else {
        return Ok(());
    };
    let Some(mut work) = store.get(Kind::ManifestWork, Some(cluster), &name).await? else {
        return Ok(());
    };
    if work["metadata"]["uid"].as_str() != Some(uid) {
        return Ok(());
    }
    let before = finalizers(&work);
    if !before.iter().any(|f| f == WORK_CLEANUP_FINALIZER) {
        return Ok(());
    }
    if work["metadata"]["deletionTimestamp"].is_null() {
        warn!(cluster, work = %name, "the agent released a work that is not deleted; its finalizer stays");
        return Ok(());
    }
    let after = before
        .into_iter()
        .filter(|f| f != WORK_CLEANUP_FINALIZER)
        .collect();
    set_finalizers(&mut work, after);
    match fenced.write(work, cluster).await {
        Ok(_) | Err(StoreError::NotFound { .. }) => {
            info!(cluster, work = %name, "work released by its agent; cleanup finalizer removed");
            Ok(())
        }
        Err(e) => Err(e),
    }
}

fn finalizers(work: &Value) -> Vec<String> {
    work["metadata"]["finalizers"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|f| f.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// Sets the finalizers on a work as read; its resourceVersion stays, the write's
/// precondition, so a change made since the read is never overwritten.
fn set_finalizers(work: &mut Value, finalizers: Vec<String>) {
    work["metadata"]["finalizers"] = json!(finalizers);
}

#[cfg(test)]
mod tests {
    //! The finalizer's life on the sled store: held after the ack, released after the agent's
    //! release, the release acknowledged only once the work is gone.

    use super::*;
    use crate::registry::Registry;
    use crate::shards::ShardView;
    use crate::test_support::eventually;
    use flotilla_store::SledStore;
    use std::time::Duration;

    /// Store-1's work "web" on a sled store, the desired-state cache following it, and
    /// finalizers not started yet.
    struct Fixture {
        _dir: tempfile::TempDir,
        store: Arc<dyn Store>,
        uid: String,
        desired: Arc<DesiredState>,
        stop_tx: watch::Sender<bool>,
        stop: watch::Receiver<bool>,
        finalizers: Arc<CleanupFinalizers>,
    }

    impl Fixture {
        async fn new() -> Fixture {
            let dir = tempfile::tempdir().unwrap();
            let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
            let created = store
                .create(json!({
                    "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
                    "metadata": {"name": "web", "namespace": "store-1"},
                    "spec": {"workload": {"manifests": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}]}},
                }))
                .await
                .unwrap();
            let uid = created["metadata"]["uid"].as_str().unwrap().to_owned();
            let desired = DesiredState::new();
            let (stop_tx, stop) = watch::channel(false);
            let finalizers = CleanupFinalizers::for_tests();
            tokio::spawn(desired.clone().run(
                store.clone(),
                Arc::new(Registry::default()),
                finalizers.clone(),
                ShardView::all_views(),
                stop.clone(),
            ));
            Fixture {
                _dir: dir,
                store,
                uid,
                desired,
                stop_tx,
                stop,
                finalizers,
            }
        }

        /// Starts the finalizer writer on the fixture's store.
        fn start_writer(&self) {
            tokio::spawn(self.finalizers.clone().run(
                self.store.clone(),
                self.desired.clone(),
                self.stop.clone(),
            ));
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_held_work_is_deleted_only_once_its_agent_releases_it() {
        let fixture = Fixture::new().await;
        fixture.start_writer();
        let Fixture {
            _dir,
            store,
            uid,
            desired,
            stop_tx,
            finalizers,
            ..
        } = fixture;
        let stored = || async {
            store
                .get(Kind::ManifestWork, Some("store-1"), "web")
                .await
                .unwrap()
        };

        // The agent acked it: the finalizer goes on, once.
        assert_eq!(
            desired.lacks_cleanup_finalizer("store-1", &uid).await,
            Some("web".into())
        );
        finalizers.hold("store-1", "web", &uid);
        eventually("the finalizer added", || async {
            desired
                .lacks_cleanup_finalizer("store-1", &uid)
                .await
                .is_none()
        })
        .await;
        assert_eq!(
            super::finalizers(&stored().await.unwrap()),
            [WORK_CLEANUP_FINALIZER]
        );

        // The agent applied it and reported so.
        store
            .update_status(
                Kind::ManifestWork,
                Some("store-1"),
                "web",
                json!({"conditions": [{"type": "Applied", "status": "True", "reason": "AppliedManifestWorkComplete",
                                        "message": "applied", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}),
                None,
            )
            .await
            .unwrap();

        // Deleted: it stays, marked.
        store
            .delete(Kind::ManifestWork, Some("store-1"), "web")
            .await
            .unwrap();
        assert!(stored().await.unwrap()["metadata"]["deletionTimestamp"].is_string());
        eventually("the deletion reaches the cache", || async {
            desired.terminating("store-1").await == [uid.clone()]
        })
        .await;

        // Another cluster's session cannot release it.
        let stranger = Arc::new(Mailbox::default());
        finalizers.release("store-2", &uid, Some(&stranger));
        tokio::time::timeout(Duration::from_secs(10), stranger.ready())
            .await
            .expect("an ack: nothing of store-2's to release");
        assert!(stored().await.is_some(), "store-1's work is untouched");

        // Its agent releases it: the work goes, then the agent hears so.
        let reporter = Arc::new(Mailbox::default());
        finalizers.release("store-1", &uid, Some(&reporter));
        tokio::time::timeout(Duration::from_secs(10), reporter.ready())
            .await
            .expect("the release acknowledged");
        assert_eq!(reporter.take().release_acks, [uid]);
        assert!(stored().await.is_none(), "gone once released");
        let _ = stop_tx.send(true);
    }

    #[test]
    fn the_works_to_read_first_are_bounded() {
        let mut stale = HashSet::new();
        for i in 0..MAX_STALE {
            remember_stale(&mut stale, &format!("uid-{i}"));
        }
        assert_eq!(stale.len(), MAX_STALE);
        remember_stale(&mut stale, "one-more");
        assert_eq!(stale.len(), 1, "forgotten when full, the newest kept");
        assert!(stale.contains("one-more"));
    }

    /// A work the hub created with its cleanup finalizer and deleted before any agent reported
    /// on it, while its cluster has no session, goes at once: nobody is asked to release it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_deleted_work_no_agent_reported_on_goes_at_once() {
        let fixture = Fixture::new().await;
        fixture.start_writer();
        let store = &fixture.store;
        store
            .create(json!({
                "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
                "metadata": {"name": "api", "namespace": "store-1", "finalizers": [WORK_CLEANUP_FINALIZER]},
                "spec": {"workload": {"manifests": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "y"}}]}},
            }))
            .await
            .unwrap();
        store
            .delete(Kind::ManifestWork, Some("store-1"), "api")
            .await
            .unwrap();
        eventually("the unheard work gone", || async {
            store
                .get(Kind::ManifestWork, Some("store-1"), "api")
                .await
                .unwrap()
                .is_none()
        })
        .await;
        let _ = fixture.stop_tx.send(true);
    }

    /// An acknowledged work takes its finalizer in one request: the work as the watch cache
    /// saw it, written on that version, with no read first. A work changed on the hub as its
    /// agent acknowledges it still gets its finalizer, and keeps the change (a copy out of date
    /// is a conflict, and the next try reads the work).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hold_writes_the_work_as_cached_without_reading_it() {
        let Fixture {
            _dir,
            store,
            uid,
            desired,
            stop_tx,
            stop,
            finalizers,
        } = Fixture::new().await;
        let metrics = crate::metrics::GatewayMetrics::new();
        tokio::spawn(finalizers.clone().run(
            metrics.metered(store.clone()),
            desired.clone(),
            stop.clone(),
        ));
        let stored = || async {
            store
                .get(Kind::ManifestWork, Some("store-1"), "web")
                .await
                .unwrap()
                .unwrap()
        };
        assert_eq!(
            desired.lacks_cleanup_finalizer("store-1", &uid).await,
            Some("web".into())
        );
        finalizers.hold("store-1", "web", &uid);
        eventually("the finalizer added", || async {
            super::finalizers(&stored().await) == [WORK_CLEANUP_FINALIZER]
        })
        .await;
        assert_eq!(
            (
                metrics.store_requests_of("get"),
                metrics.store_requests_of("update")
            ),
            (0, 1),
            "(reads, writes) of the hold"
        );

        // A second work, changed on the hub right as its agent acknowledges it.
        let created = store
            .create(json!({
                "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
                "metadata": {"name": "api", "namespace": "store-1"},
                "spec": {"workload": {"manifests": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "y"}}]}},
            }))
            .await
            .unwrap();
        let api_uid = created["metadata"]["uid"].as_str().unwrap().to_owned();
        eventually("the second work cached", || async {
            desired.has_work("store-1", &api_uid)
        })
        .await;
        let mut changed = created.clone();
        changed["metadata"]["labels"] = json!({"tier": "edge"});
        store.update_spec(changed).await.unwrap();
        finalizers.hold("store-1", "api", &api_uid);
        let api = || async {
            store
                .get(Kind::ManifestWork, Some("store-1"), "api")
                .await
                .unwrap()
                .unwrap()
        };
        eventually("the second work's finalizer added", || async {
            super::finalizers(&api().await) == [WORK_CLEANUP_FINALIZER]
        })
        .await;
        assert_eq!(api().await["metadata"]["labels"], json!({"tier": "edge"}));
        let _ = stop_tx.send(true);
    }

    /// A release that another cluster's agent reports for a work's uid, arriving while the
    /// owner's hold of that work waits to be written, leaves the hold alone: the work gets its
    /// finalizer, and the stranger its ack (there was nothing of its own to release).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_clusters_release_does_not_displace_a_pending_hold() {
        let Fixture {
            _dir,
            store,
            uid,
            desired,
            stop_tx,
            stop,
            finalizers,
        } = Fixture::new().await;
        // Both wait in the queue before its writer starts.
        finalizers.hold("store-1", "web", &uid);
        let stranger = Arc::new(Mailbox::default());
        finalizers.release("store-2", &uid, Some(&stranger));
        tokio::spawn(
            finalizers
                .clone()
                .run(store.clone(), desired.clone(), stop.clone()),
        );

        tokio::time::timeout(Duration::from_secs(10), stranger.ready())
            .await
            .expect("the stranger's release answered");
        eventually("store-1's work holds its cleanup finalizer", || async {
            let stored = store
                .get(Kind::ManifestWork, Some("store-1"), "web")
                .await
                .unwrap()
                .unwrap();
            super::finalizers(&stored) == [WORK_CLEANUP_FINALIZER]
        })
        .await;
        let _ = stop_tx.send(true);
    }
}
