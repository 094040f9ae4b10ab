//! Delivery between the hub's frames and the durable cache, off the session driver's loop:
//! works from the hub go into the cache one operation at a time, in the order the frames asked
//! for them, and are acked only once durable; deletes become tombstones for the reconciler;
//! the hub's status and release acks are recorded; statuses and releases come out of the
//! cache's outboxes for the hub until it acks them.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use flotilla_proto::api::ManifestWork;
use flotilla_proto::api::content::ContentRef;
use flotilla_proto::session::AgentSession;
use flotilla_proto::wire;
use futures::future::BoxFuture;
use tracing::{debug, info, warn};

use crate::cache::{CachedWork, MAX_MANIFEST_WORK_BYTES, durably};
use crate::spoke::Spoke;

/// Work on the durable cache, in order.
#[derive(Debug)]
pub(crate) enum CacheOp {
    Store(wire::WorkUpdate),
    /// Records the transfer of a large work's content and finds which chunks it needs.
    Fetch {
        uid: String,
        /// `namespace/name`, for logs.
        name: String,
        content: ContentRef,
        /// Which transfer of the work it is (the session's machine tells the latest).
        transfer: u64,
    },
    /// Gives up the transfers of works the hub did not send in this session's sync.
    EndFetches {
        keep: Vec<String>,
    },
    Delete {
        uid: String,
        namespace: String,
        name: String,
    },
    AckStatus {
        uid: String,
        seq: u64,
    },
    AckRelease {
        uid: String,
    },
}

/// What a cache operation did.
#[derive(Debug)]
pub(crate) enum CacheDone {
    /// The work is durable at this generation (ack it); `changed` when the reconciler must look.
    Stored {
        uid: String,
        generation: i64,
        stored: Option<CachedWork>,
    },
    /// Not stored (the error is logged): not acked, so the hub sends it again.
    NotStored,
    /// A large work's transfer is recorded: which chunks it still needs.
    Fetch {
        uid: String,
        name: String,
        content: ContentRef,
        transfer: u64,
        missing: Result<Vec<String>, String>,
    },
    /// Transfers given up (or not: the error is logged).
    FetchesEnded,
    Deleted,
    /// The hub's release ack is recorded (or logged as not).
    ReleaseAcked,
    StatusAcked {
        uid: String,
        acked: bool,
    },
}

impl CacheDone {
    /// The ack the machine sends for it, if any; tells the observer.
    pub(crate) fn ack(&self, spoke: &Spoke) -> Option<(String, i64)> {
        match self {
            CacheDone::Stored {
                uid,
                generation,
                stored,
            } => {
                if let Some(work) = stored {
                    spoke.observer.work_stored(work);
                }
                Some((uid.clone(), *generation))
            }
            _ => None,
        }
    }
}

/// Cache operations run one at a time, in the order the hub's frames asked for them, off the
/// driver's loop.
#[derive(Default)]
pub(crate) struct CacheQueue {
    waiting: VecDeque<CacheOp>,
    running: Option<BoxFuture<'static, CacheDone>>,
}

impl CacheQueue {
    pub(crate) fn push(&mut self, op: CacheOp) {
        self.waiting.push_back(op);
    }

    pub(crate) fn is_busy(&self) -> bool {
        self.running.is_some() || !self.waiting.is_empty()
    }

    /// The next operation's result (starting it if none runs).
    pub(crate) async fn next(&mut self, spoke: &Spoke) -> CacheDone {
        if self.running.is_none() {
            let op = self.waiting.pop_front().expect("called only when busy");
            self.running = Some(Box::pin(run_cache_op(spoke.clone(), op)));
        }
        let done = self.running.as_mut().expect("set above").await;
        self.running = None;
        done
    }

    /// At the session's end: lets an operation already under way finish (its write is not torn
    /// off half-way), then records the status acks still queued, all `within`. The hub has
    /// stored those statuses; an ack forgotten here would make the agent send them again next
    /// session. Works and deletes still queued are left: they were not acked, so the hub sends
    /// them again.
    pub(crate) async fn finish(&mut self, spoke: &Spoke, within: Duration) {
        let running = self.running.take();
        let acks: Vec<CacheOp> = self
            .waiting
            .drain(..)
            .filter(|op| matches!(op, CacheOp::AckStatus { .. } | CacheOp::AckRelease { .. }))
            .collect();
        let _ = tokio::time::timeout(within, async {
            if let Some(running) = running {
                running.await;
            }
            for ack in acks {
                run_cache_op(spoke.clone(), ack).await;
            }
        })
        .await;
    }
}

/// Runs one cache operation.
pub(crate) async fn run_cache_op(spoke: Spoke, op: CacheOp) -> CacheDone {
    match op {
        CacheOp::Store(work) => store_work(&spoke, work).await,
        CacheOp::Fetch {
            uid,
            name,
            content,
            transfer,
        } => {
            let (key, chunks) = (uid.clone(), content.chunks.clone());
            let missing = durably(&spoke.cache, move |c| c.begin_fetch(&key, &chunks)).await;
            CacheDone::Fetch {
                uid,
                name,
                content,
                transfer,
                missing: missing.map_err(|e| e.to_string()),
            }
        }
        CacheOp::EndFetches { keep } => {
            match durably(&spoke.cache, move |c| c.end_fetches(&keep)).await {
                Ok(0) => {}
                Ok(released) => {
                    info!(
                        chunks = released,
                        "released the chunks of transfers the hub no longer asks for"
                    )
                }
                Err(e) => {
                    warn!(error = %e, "cannot give up stale transfers; trying after the next sync")
                }
            }
            CacheDone::FetchesEnded
        }
        CacheOp::Delete {
            uid,
            namespace,
            name,
        } => {
            delete_work(&spoke, uid, &namespace, &name).await;
            CacheDone::Deleted
        }
        CacheOp::AckRelease { uid } => {
            let key = uid.clone();
            if let Err(e) = durably(&spoke.cache, move |c| c.ack_release(&key)).await {
                // Sent again next session; the hub answers it again.
                warn!(uid = %uid, error = %e, "cannot record the hub's release ack");
            }
            CacheDone::ReleaseAcked
        }
        CacheOp::AckStatus { uid, seq } => {
            let key = uid.clone();
            match durably(&spoke.cache, move |c| c.ack_status(&key, seq)).await {
                Ok(acked) => CacheDone::StatusAcked { uid, acked },
                // The status stays pending and is re-sent next session; the hub drops it by seq.
                Err(e) => {
                    warn!(uid = %uid, seq, error = %e, "cannot record the hub's status ack");
                    CacheDone::StatusAcked { uid, acked: false }
                }
            }
        }
    }
}

/// Stores a work from the hub durably and hands it to the reconciler; the caller acks it. An
/// acked generation must survive a crash.
async fn store_work(spoke: &Spoke, work: wire::WorkUpdate) -> CacheDone {
    let wire::WorkUpdate {
        uid,
        namespace,
        name,
        generation,
        content_hash,
        manifest_work_json,
    } = work;
    if uid.is_empty() {
        warn!(work = %format!("{namespace}/{name}"), "the hub sent a work without a uid; ignored");
        return CacheDone::NotStored;
    }
    let size = manifest_work_json.len();
    let refused = if size > MAX_MANIFEST_WORK_BYTES {
        Some(format!(
            "the ManifestWork is {size} bytes, more than the agent's limit of {MAX_MANIFEST_WORK_BYTES} bytes; \
             split its manifests over several ManifestWorks"
        ))
    } else {
        serde_json::from_slice::<ManifestWork>(&manifest_work_json)
            .err()
            .map(|e| format!("the hub sent a ManifestWork the agent cannot read: {e}"))
    };
    // Neither a refused nor a held-already body is kept in memory past this point.
    let content = refused.is_none().then_some(manifest_work_json);
    let cached = CachedWork {
        uid: uid.clone(),
        namespace,
        name,
        generation,
        content_hash,
        refused,
        deleting: false,
    };
    let key = uid.clone();
    match durably(&spoke.cache, move |c| c.work(&key)).await {
        Ok(Some(held)) if held == cached => {
            // A resume after a lost ack: already durable, nothing to apply.
            return CacheDone::Stored {
                uid,
                generation,
                stored: None,
            };
        }
        Ok(_) => {}
        Err(e) => warn!(uid = %uid, error = %e, "cannot read the cached work; storing it again"),
    }
    if let Some(reason) = &cached.refused {
        warn!(work = %cached.display_name(), uid = %uid, %reason, "work refused");
    }
    let work_name = cached.display_name();
    let stored = cached.clone();
    match durably(&spoke.cache, move |c| {
        c.put_work(&cached, content.as_deref())
    })
    .await
    {
        Ok(()) => {
            debug!(work = %work_name, uid = %uid, generation, "work stored");
            spoke.reconciler.work_changed(&uid).await;
            CacheDone::Stored {
                uid,
                generation,
                stored: Some(stored),
            }
        }
        // Not acked: the next session's hello does not hold it, so the hub sends it again.
        Err(e) => {
            warn!(work = %work_name, uid = %uid, error = %e, "cannot store a work from the hub");
            CacheDone::NotStored
        }
    }
}

/// Marks a work deleted by the hub as a tombstone and hands it to the reconciler, which
/// removes or orphans its resources and then forgets it.
async fn delete_work(spoke: &Spoke, uid: String, namespace: &str, name: &str) {
    // A delete found during the hello sync carries only the uid: the name is in the cache.
    let work = if name.is_empty() {
        let key = uid.clone();
        match durably(&spoke.cache, move |c| c.work(&key)).await {
            Ok(Some(cached)) => cached.display_name(),
            _ => format!("uid {uid}"),
        }
    } else {
        format!("{namespace}/{name}")
    };
    let key = uid.clone();
    match durably(&spoke.cache, move |c| c.mark_deleting(&key)).await {
        Ok(true) => {
            info!(uid = %uid, %work, "work deleted on the hub");
            spoke.reconciler.work_changed(&uid).await;
        }
        Ok(false) => {
            // Nothing of it is here (never stored, or already released). Its content may have
            // been on the way: what came of it goes. And it is released, so the hub does not
            // keep the work waiting for this agent.
            debug!(uid = %uid, "the hub deleted a work this agent does not hold; released");
            let key = uid.clone();
            if let Err(e) = durably(&spoke.cache, move |c| c.end_fetch(&key)).await {
                warn!(uid = %uid, error = %e, "cannot give up the transfer of a deleted work; given up after the next sync");
            }
            let key = uid.clone();
            match durably(&spoke.cache, move |c| c.release(&key)).await {
                Ok(()) => spoke.outbox_changed.notify_one(),
                Err(e) => warn!(uid = %uid, error = %e, "cannot record a work release"),
            }
        }
        // Still held: the hub repeats the delete on the next session, where the hello lists it.
        Err(e) => warn!(uid = %uid, error = %e, "cannot record a work deletion"),
    }
}

/// Reports every outbox status not yet reported in this session. The outbox is read from the
/// cache (a read transaction, served from its page cache; no write, no fsync).
pub(crate) fn report_outbox(
    machine: &mut AgentSession,
    spoke: &Spoke,
    reported: &mut HashMap<String, u64>,
) {
    let pending = match spoke.cache.pending_statuses() {
        Ok(p) => p,
        Err(e) => {
            warn!(error = %e, "cannot read the status outbox");
            return;
        }
    };
    for status in pending {
        if reported
            .get(&status.uid)
            .is_some_and(|seq| *seq >= status.seq)
        {
            continue;
        }
        debug!(uid = %status.uid, seq = status.seq, "reporting status");
        reported.insert(status.uid.clone(), status.seq);
        spoke.observer.status_reported(&status.uid, status.seq);
        machine.report_status(
            status.uid,
            status.generation,
            status.seq,
            status.status_json,
        );
    }
}

/// Reports every release in the outbox not yet reported in this session.
pub(crate) fn report_releases(
    machine: &mut AgentSession,
    spoke: &Spoke,
    released: &mut HashSet<String>,
) {
    let pending = match spoke.cache.pending_releases() {
        Ok(p) => p,
        Err(e) => {
            warn!(error = %e, "cannot read the release outbox");
            return;
        }
    };
    for uid in pending {
        if released.insert(uid.clone()) {
            debug!(uid = %uid, "reporting a released work");
            machine.release_work(uid);
        }
    }
}

#[cfg(test)]
mod tests {
    //! The driver's delivery half against the hub's real protocol machine, frames passed in
    //! memory: what is acked is durable, statuses flow and are acked, a resume re-sends nothing.

    use std::sync::Arc;

    use super::*;
    use crate::apply::MemoryCluster;
    use crate::cache::{CacheDb, WorkCache};
    use crate::reconcile::{Reconciler, ReconcilerConfig};
    use crate::spoke::Unobserved;
    use flotilla_proto::api::content_hash;
    use flotilla_proto::session::Jitter;
    use flotilla_proto::session::{
        AgentConfig as SessionConfig, AgentEvent, DEFAULT_WELCOME_TIMEOUT,
    };
    use flotilla_proto::session::{HubConfig, HubEvent, HubSession};
    use serde_json::json;
    use tokio::sync::Notify;
    use tokio::sync::watch;
    use tokio::time::Instant;

    struct NoJitter;
    impl Jitter for NoJitter {
        fn uniform(&mut self, _max: Duration) -> Duration {
            Duration::ZERO
        }
    }

    /// One agent (cache, simulated cluster, reconciler task) and helpers to run sessions.
    struct Agent {
        spoke: Spoke,
        cluster: Arc<MemoryCluster>,
        _stop: tokio::sync::oneshot::Sender<()>,
    }

    impl Agent {
        fn start(cache: Arc<dyn WorkCache>) -> Agent {
            let cluster = Arc::new(MemoryCluster::new());
            let outbox_changed = Arc::new(Notify::new());
            let (reconciler, handle) = Reconciler::new(
                Arc::clone(&cache),
                cluster.clone(),
                // No retries or resyncs within a test: each status here comes from a step.
                ReconcilerConfig {
                    retry_initial: Duration::from_secs(3600),
                    resync_interval: Duration::from_secs(3600),
                    ..ReconcilerConfig::default()
                },
                Arc::clone(&outbox_changed),
                Box::new(NoJitter),
            );
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            tokio::spawn(reconciler.run(async {
                let _ = stopped.await;
            }));
            let (_, kubernetes_version) = watch::channel("v1.36.3".to_string());
            let (_, cluster_info) = watch::channel(wire::ClusterInfo::default());
            Agent {
                spoke: Spoke {
                    cache,
                    reconciler: handle,
                    outbox_changed,
                    kubernetes_version,
                    cluster_info,
                    observer: Arc::new(Unobserved),
                    tunnels: crate::tunnel::TunnelHandle::unconnected(),
                    metrics: crate::metrics::AgentMetrics::default(),
                },
                cluster,
                _stop: stop,
            }
        }
    }

    /// One session between the agent's machine and the hub's, connected in memory.
    struct Session<'a> {
        agent: &'a Agent,
        machine: AgentSession,
        hub: HubSession,
        reported: HashMap<String, u64>,
        released: HashSet<String>,
        /// Events the hub side saw, in order.
        hub_events: Vec<HubEvent>,
        /// Works the agent received.
        received: Vec<String>,
    }

    impl<'a> Session<'a> {
        fn open(agent: &'a Agent) -> Session<'a> {
            let now = Instant::now();
            let held = agent.spoke.cache.held().unwrap();
            let machine = AgentSession::new(
                now,
                SessionConfig {
                    cluster_name: "store-7".into(),
                    agent_version: "test".into(),
                    kubernetes_version: "v1.36.3".into(),
                    claims: Vec::new(),
                    welcome_timeout: DEFAULT_WELCOME_TIMEOUT,
                },
                held,
            );
            Session {
                agent,
                machine,
                hub: HubSession::new(now, HubConfig::default(), "store-7", "s1"),
                reported: HashMap::new(),
                released: HashSet::new(),
                hub_events: Vec::new(),
                received: Vec::new(),
            }
        }

        /// Moves frames both ways and handles events until both sides are quiet.
        async fn pump(&mut self) {
            loop {
                let mut moved = false;
                while let Some(frame) = self.machine.poll_transmit() {
                    self.hub.handle_frame(Instant::now(), frame).unwrap();
                    moved = true;
                }
                while let Some(event) = self.hub.poll_event() {
                    if let HubEvent::WorkAcked {
                        uid, generation, ..
                    } = &event
                    {
                        // The point of the ordering: whatever the hub sees acked is durable.
                        let held = self
                            .agent
                            .spoke
                            .cache
                            .work(uid)
                            .unwrap()
                            .expect("acked but not cached");
                        assert_eq!(held.generation, *generation);
                    }
                    self.hub_events.push(event);
                    moved = true;
                }
                while let Some(frame) = self.hub.poll_transmit() {
                    self.machine.handle_frame(Instant::now(), frame).unwrap();
                    moved = true;
                }
                while let Some(event) = self.machine.poll_event() {
                    moved = true;
                    let spoke = &self.agent.spoke;
                    // What the driver does with each event, its cache work awaited in place.
                    let op = match event {
                        AgentEvent::WorkReceived { work } => {
                            self.received.push(work.uid.clone());
                            Some(CacheOp::Store(work))
                        }
                        AgentEvent::WorkDeleted {
                            uid,
                            namespace,
                            name,
                        } => Some(CacheOp::Delete {
                            uid,
                            namespace,
                            name,
                        }),
                        AgentEvent::StatusAcked { uid, seq } => {
                            Some(CacheOp::AckStatus { uid, seq })
                        }
                        AgentEvent::ReleaseAcked { uid } => Some(CacheOp::AckRelease { uid }),
                        AgentEvent::Established { .. } => {
                            report_outbox(&mut self.machine, spoke, &mut self.reported);
                            None
                        }
                        _ => None,
                    };
                    if let Some(op) = op {
                        let done = run_cache_op(spoke.clone(), op).await;
                        if let Some((uid, generation)) = done.ack(spoke) {
                            self.machine.ack_work(uid, generation);
                        }
                        if let CacheDone::StatusAcked { uid, acked: true } = done {
                            self.reported.remove(&uid);
                        }
                    }
                }
                if !moved {
                    return;
                }
            }
        }

        /// Sends the release outbox, as the driver does, and returns the releases the hub got.
        async fn releases(&mut self) -> Vec<String> {
            report_releases(&mut self.machine, &self.agent.spoke, &mut self.released);
            self.pump().await;
            let got = self
                .hub_events
                .iter()
                .filter_map(|e| match e {
                    HubEvent::WorkReleased { uid } => Some(uid.clone()),
                    _ => None,
                })
                .collect();
            self.hub_events
                .retain(|e| !matches!(e, HubEvent::WorkReleased { .. }));
            got
        }

        /// Waits for the reconciler's next status and sends the outbox, as the driver does.
        async fn next_status(&mut self) {
            tokio::time::timeout(
                Duration::from_secs(10),
                self.agent.spoke.outbox_changed.notified(),
            )
            .await
            .expect("no status from the reconciler");
            report_outbox(&mut self.machine, &self.agent.spoke, &mut self.reported);
            self.pump().await;
        }

        fn hello_held(&self) -> Vec<wire::HeldWork> {
            self.hub_events
                .iter()
                .find_map(|e| match e {
                    HubEvent::Established { hello } => Some(hello.held.clone()),
                    _ => None,
                })
                .expect("established")
        }

        /// Statuses the hub received as (uid, seq); the hub acks each.
        fn statuses(&mut self) -> Vec<(String, u64)> {
            let got: Vec<(String, u64)> = self
                .hub_events
                .iter()
                .filter_map(|e| match e {
                    HubEvent::StatusReported { uid, seq, .. } => Some((uid.clone(), *seq)),
                    _ => None,
                })
                .collect();
            self.hub_events
                .retain(|e| !matches!(e, HubEvent::StatusReported { .. }));
            for (uid, seq) in &got {
                self.hub.ack_status(uid.clone(), *seq);
            }
            got
        }
    }

    fn desired(uid: &str, generation: i64, configmaps: &[&str]) -> wire::WorkUpdate {
        let manifests: Vec<_> = configmaps
            .iter()
            .map(|n| json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": n, "namespace": "default"}}))
            .collect();
        let mw: ManifestWork = serde_json::from_value(json!({
            "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
            "metadata": {"name": "w", "namespace": "store-7", "uid": uid, "generation": generation},
            "spec": {"workload": {"manifests": manifests}},
        }))
        .unwrap();
        wire::WorkUpdate {
            uid: uid.into(),
            namespace: "store-7".into(),
            name: "w".into(),
            generation,
            content_hash: content_hash(&mw.spec),
            manifest_work_json: serde_json::to_vec(&mw).unwrap(),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn works_are_stored_before_the_ack_and_statuses_flow_until_acked() {
        let db = CacheDb::temporary().unwrap();
        let cache: Arc<dyn WorkCache> = Arc::new(db.cluster("store-7"));
        let agent = Agent::start(Arc::clone(&cache));

        let mut s = Session::open(&agent);
        s.pump().await;
        assert!(s.hello_held().is_empty());
        s.hub.begin_sync([desired("a", 1, &["x"])]);
        s.pump().await;
        assert!(
            s.hub_events
                .iter()
                .any(|e| matches!(e, HubEvent::WorkAcked { uid, generation: 1, .. } if uid == "a"))
        );
        s.next_status().await;
        let statuses = s.statuses();
        let first = statuses.first().map_or(0, |(_, seq)| *seq);
        assert_eq!(statuses, [("a".to_string(), first)]);
        s.pump().await;
        assert!(
            cache.pending_statuses().unwrap().is_empty(),
            "the hub's ack empties the outbox"
        );
        assert_eq!(agent.cluster.objects().await.len(), 1);

        // A live update: stored, acked, applied, reported with the next seq.
        s.hub.upsert_work(desired("a", 2, &["x", "y"]));
        s.pump().await;
        s.next_status().await;
        assert_eq!(s.statuses(), [("a".to_string(), first + 1)]);
        s.pump().await;
        assert_eq!(agent.cluster.objects().await.len(), 2);

        // The hub goes away; a drift repair during the outage leaves a status in the outbox.
        drop(s);
        agent.cluster.set_down(true).await;
        agent.spoke.reconciler.resync_all().await;
        tokio::time::timeout(
            Duration::from_secs(10),
            agent.spoke.outbox_changed.notified(),
        )
        .await
        .expect("a status while the hub is away");
        assert_eq!(cache.pending_statuses().unwrap().len(), 1);
        agent.cluster.set_down(false).await;

        // Resume: the hello holds generation 2, the hub sends nothing, the outbox is delivered.
        let mut s = Session::open(&agent);
        s.pump().await;
        let held = s.hello_held();
        assert_eq!((held.len(), held[0].generation), (1, 2));
        s.hub.begin_sync([desired("a", 2, &["x", "y"])]);
        s.pump().await;
        assert!(s.received.is_empty());
        assert!(
            !s.hub_events
                .iter()
                .any(|e| matches!(e, HubEvent::WorkAcked { .. })),
            "nothing re-sent"
        );
        assert_eq!(
            s.statuses(),
            [("a".to_string(), first + 2)],
            "the outage's status, once"
        );
        s.pump().await;
        assert!(cache.pending_statuses().unwrap().is_empty());

        // Deleted on the hub: a tombstone, then the resources and the work are gone.
        s.hub.delete_work("a", "store-7", "w");
        s.pump().await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while cache.work("a").unwrap().is_some() {
            assert!(
                Instant::now() < deadline,
                "the tombstone was not cleaned up"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(agent.cluster.objects().await.is_empty());
        assert!(s.statuses().is_empty(), "no status for a deleted work");
        // The hub hears the work is released, and its ack empties the release outbox.
        assert_eq!(s.releases().await, ["a"]);
        s.hub.ack_release("a");
        s.pump().await;
        assert!(cache.pending_releases().unwrap().is_empty());
        assert!(s.releases().await.is_empty(), "reported once");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn status_acks_still_queued_when_the_session_ends_are_recorded() {
        let db = CacheDb::temporary().unwrap();
        let cache: Arc<dyn WorkCache> = Arc::new(db.cluster("store-7"));
        let agent = Agent::start(Arc::clone(&cache));
        let seqs: Vec<u64> = ["a", "b"]
            .iter()
            .map(|uid| {
                cache
                    .push_status(uid, 1, &json!({"conditions": []}))
                    .unwrap()
            })
            .collect();
        // The hub acked both statuses, and sent a work, just before the connection went: the
        // driver's queue holds a store and two acks when the session ends.
        let mut queue = CacheQueue::default();
        queue.push(CacheOp::Store(desired("w", 1, &["x"])));
        queue.push(CacheOp::AckStatus {
            uid: "a".into(),
            seq: seqs[0],
        });
        queue.push(CacheOp::AckStatus {
            uid: "b".into(),
            seq: seqs[1],
        });
        assert!(matches!(
            queue.next(&agent.spoke).await,
            CacheDone::Stored { .. }
        ));
        queue.finish(&agent.spoke, Duration::from_secs(2)).await;
        // (The stored work's own first status may be pending by now: the reconciler applied it.)
        let pending: Vec<String> = cache
            .pending_statuses()
            .unwrap()
            .into_iter()
            .map(|p| p.uid)
            .filter(|uid| uid != "w")
            .collect();
        assert!(
            pending.is_empty(),
            "acked statuses are not sent again next session: {pending:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_oversized_work_is_acked_but_refused_with_a_status_naming_the_limit() {
        let db = CacheDb::temporary().unwrap();
        let cache: Arc<dyn WorkCache> = Arc::new(db.cluster("store-7"));
        let agent = Agent::start(Arc::clone(&cache));
        let mut s = Session::open(&agent);
        s.pump().await;
        let mut big = desired("big", 1, &["x"]);
        big.manifest_work_json = vec![b' '; MAX_MANIFEST_WORK_BYTES + 1];
        s.hub.begin_sync([big]);
        s.pump().await;
        assert!(
            cache.manifest_work("big").unwrap().is_none(),
            "the content is not kept"
        );
        assert!(cache.work("big").unwrap().unwrap().refused.is_some());
        s.next_status().await;
        let status = cache.last_status("big").unwrap().unwrap().status;
        let degraded = status["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Degraded")
            .unwrap();
        assert_eq!(degraded["status"], "True");
        let message = degraded["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("{} bytes", MAX_MANIFEST_WORK_BYTES + 1)),
            "{message}"
        );
        assert!(
            message.contains(&format!("limit of {MAX_MANIFEST_WORK_BYTES} bytes")),
            "{message}"
        );
        assert!(agent.cluster.objects().await.is_empty());
    }
}
