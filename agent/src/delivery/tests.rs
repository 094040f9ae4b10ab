//! The driver's delivery half against the hub's real protocol machine, frames passed in
//! memory: what is acked is durable, statuses flow and are acked, a resume re-sends nothing.

use std::sync::Arc;

use super::*;
use crate::apply::MemoryCluster;
use crate::cache::{CacheDb, WorkCache};
use crate::reconcile::{Reconciler, ReconcilerConfig};
use crate::spoke::Unobserved;
use flotilla_proto::api::content_hash;
use flotilla_proto::session::NoJitter;
use flotilla_proto::session::{AgentConfig as SessionConfig, AgentEvent, DEFAULT_WELCOME_TIMEOUT};
use flotilla_proto::session::{HubConfig, HubEvent, HubSession};
use serde_json::json;
use tokio::sync::Notify;
use tokio::sync::watch;
use tokio::time::Instant;

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
                policies: crate::policies::PolicyHandle::default(),
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
            // What the driver does with each event: its cache work queued, and run in batches.
            let spoke = &self.agent.spoke;
            let mut queue = CacheQueue::default();
            while let Some(event) = self.machine.poll_event() {
                moved = true;
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
                    AgentEvent::StatusAcked { uid, seq } => Some(CacheOp::AckStatus { uid, seq }),
                    AgentEvent::ReleaseAcked { uid } => Some(CacheOp::AckRelease { uid }),
                    AgentEvent::Established { .. } => {
                        report_outbox(&mut self.machine, spoke, &mut self.reported);
                        None
                    }
                    _ => None,
                };
                if let Some(op) = op {
                    queue.push(op);
                }
            }
            while queue.is_busy() {
                for done in queue.next(spoke).await {
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
        kind: String::new(),
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
        queue.next(&agent.spoke).await.as_slice(),
        [CacheDone::Stored { .. }]
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
async fn a_burst_from_the_hub_is_stored_together_and_in_order() {
    let db = CacheDb::temporary().unwrap();
    let cache: Arc<dyn WorkCache> = Arc::new(db.cluster("store-7"));
    let agent = Agent::start(Arc::clone(&cache));
    let seq = cache
        .push_status("s", 1, &json!({"conditions": []}))
        .unwrap();
    // Three works, the first again at generation 2, a delete, then two acks: what a session
    // queues when the hub sends a burst while the cache is busy.
    let mut queue = CacheQueue::default();
    for (uid, generation) in [("a", 1), ("b", 1), ("c", 1), ("a", 2)] {
        queue.push(CacheOp::Store(desired(uid, generation, &[uid])));
    }
    queue.push(CacheOp::Delete {
        uid: "b".into(),
        namespace: "store-7".into(),
        name: "w".into(),
    });
    for uid in ["s", "unknown"] {
        queue.push(CacheOp::AckStatus {
            uid: uid.into(),
            seq,
        });
    }
    let stored = |done: &[CacheDone]| -> Vec<(String, i64)> {
        done.iter()
            .map(|d| match d {
                CacheDone::Stored {
                    uid, generation, ..
                } => (uid.clone(), *generation),
                other => panic!("expected a store, got {other:?}"),
            })
            .collect()
    };
    // The distinct works together, each acked and durable; a's second generation after them.
    let first = queue.next(&agent.spoke).await;
    assert_eq!(
        stored(&first),
        [("a".into(), 1), ("b".into(), 1), ("c".into(), 1)]
    );
    assert_eq!(cache.works().unwrap().len(), 3);
    let second = queue.next(&agent.spoke).await;
    assert_eq!(stored(&second), [("a".into(), 2)]);
    assert_eq!(cache.work("a").unwrap().unwrap().generation, 2);
    // The delete on its own, after the stores it follows.
    assert!(matches!(
        queue.next(&agent.spoke).await.as_slice(),
        [CacheDone::Deleted]
    ));
    assert!(cache.work("b").unwrap().is_none_or(|w| w.deleting));
    // Both acks at once, each answered: the known status acked, the unknown one not.
    let acks = queue.next(&agent.spoke).await;
    assert!(
        matches!(
            acks.as_slice(),
            [
                CacheDone::StatusAcked { uid: s, acked: true },
                CacheDone::StatusAcked { uid: u, acked: false },
            ] if s == "s" && u == "unknown"
        ),
        "{acks:?}"
    );
    assert!(!queue.is_busy());
    assert!(
        cache
            .pending_statuses()
            .unwrap()
            .iter()
            .all(|p| p.uid != "s"),
        "the acked status left the outbox"
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
