//! Large works' content over one session, on a virtual clock: the agent's machine against the
//! hub's, with the drivers' chunk work played by the test. The gateway side reads each chunk
//! asked for from a store the test controls, no sooner than its pace allows (as
//! `--chunk-bytes-per-second` does); the agent side keeps the chunks it stored in a cache and
//! stores a work once its machine says the content is held. Each test is a way a transfer was
//! seen, or could be made, to stall.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Duration;

use flotilla_proto::api::content::{CHUNK_BYTES, ContentRef, sha256_hex};
use flotilla_proto::api::{ManifestWork, content_hash};
use flotilla_proto::session::{
    AgentConfig, AgentEvent, AgentSession, CHUNK_RETRY_MAX, DEFAULT_WELCOME_TIMEOUT, DesiredWork,
    HubConfig, HubEvent, HubSession, ProtocolError,
};
use flotilla_proto::wire;
use serde_json::json;
use tokio::time::Instant;

const CLUSTER: &str = "cluster1";
/// 1 MiB/s, the e2e tests' `--chunk-bytes-per-second`: one full chunk every half second.
const PACE: Duration = Duration::from_millis(500);
const LATENCY: Duration = Duration::from_millis(5);

/// Content of `count` chunks whose bytes say `tag`: the chunks and the reference naming them.
fn content(tag: &str, count: usize) -> (ContentRef, Vec<(String, Vec<u8>)>) {
    let chunks: Vec<(String, Vec<u8>)> = (0..count)
        .map(|i| {
            let data = format!("{tag}-{i}").into_bytes();
            (sha256_hex(&data), data)
        })
        .collect();
    let reference = ContentRef {
        sha256: sha256_hex(tag.as_bytes()),
        bytes: (count * CHUNK_BYTES) as u64,
        chunks: chunks.iter().map(|(sha, _)| sha.clone()).collect(),
    };
    (reference, chunks)
}

/// Work `uid` at `generation` whose one manifest is `reference`.
fn large_work(uid: &str, generation: i64, reference: &ContentRef) -> DesiredWork {
    let work: ManifestWork = serde_json::from_value(json!({
        "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
        "metadata": {"name": format!("work-{uid}"), "namespace": CLUSTER, "uid": uid, "generation": generation},
        "spec": {"workload": {"manifests": [reference.manifest().0]}},
    }))
    .unwrap();
    DesiredWork {
        uid: uid.into(),
        namespace: CLUSTER.into(),
        name: format!("work-{uid}"),
        generation,
        content_hash: content_hash(&work.spec),
        manifest_work_json: serde_json::to_vec(&work).unwrap(),
        kind: String::new(),
    }
}

/// The hub's ManifestChunks, as the gateway reads them.
#[derive(Default)]
struct Store {
    chunks: HashMap<String, Vec<u8>>,
    /// Reads of a chunk that fail (the apiserver timed out) before one succeeds.
    failing: HashMap<String, u32>,
    /// Every read, in order.
    reads: Vec<String>,
}

/// A hub session and an agent session, and the parts of both drivers a transfer needs.
struct Sim {
    now: Instant,
    hub: HubSession,
    agent: AgentSession,
    to_hub: VecDeque<(Instant, wire::AgentFrame)>,
    to_agent: VecDeque<(Instant, wire::HubFrame)>,
    /// The hub's works for the cluster, as its desired-state cache holds them.
    desired: BTreeMap<String, DesiredWork>,
    store: Store,
    /// Chunk reads under way on the gateway: when each answers, for which work.
    reads: VecDeque<(Instant, String, String)>,
    /// When the gateway's next chunk read may start.
    next_read_at: Instant,
    /// Chunks the agent stored durably.
    cache: HashSet<String>,
    /// Works the agent stored, as (uid, generation), in order.
    stored: Vec<(String, i64)>,
    agent_events: Vec<AgentEvent>,
    errors: Vec<ProtocolError>,
}

impl Sim {
    /// A session of an agent holding `cache`, with the hub's `desired` works and `store`.
    fn start(desired: Vec<DesiredWork>, store: Store, cache: HashSet<String>) -> Sim {
        let now = Instant::now();
        let config = AgentConfig {
            cluster_name: CLUSTER.into(),
            agent_version: "test".into(),
            kubernetes_version: "v1.36.3".into(),
            claims: Vec::new(),
            welcome_timeout: DEFAULT_WELCOME_TIMEOUT,
        };
        let mut sim = Sim {
            now,
            hub: HubSession::new(now, HubConfig::default(), CLUSTER, "s1"),
            agent: AgentSession::new(now, config, Vec::new()),
            to_hub: VecDeque::new(),
            to_agent: VecDeque::new(),
            desired: desired.into_iter().map(|w| (w.uid.clone(), w)).collect(),
            store,
            reads: VecDeque::new(),
            next_read_at: now,
            cache,
            stored: Vec::new(),
            agent_events: Vec::new(),
            errors: Vec::new(),
        };
        sim.run_for(Duration::from_millis(100));
        assert!(sim.agent.is_established(), "the session did not open");
        sim
    }

    /// Runs both sides until `d` of virtual time has passed.
    fn run_for(&mut self, d: Duration) {
        let deadline = self.now + d;
        loop {
            self.pump();
            let next = [
                self.to_hub.front().map(|(at, _)| *at),
                self.to_agent.front().map(|(at, _)| *at),
                self.reads.front().map(|(at, ..)| *at),
                self.hub.poll_timeout(),
                self.agent.poll_timeout(),
            ]
            .into_iter()
            .flatten()
            .min();
            match next {
                Some(at) if at <= deadline => {
                    self.now = self.now.max(at);
                    self.hub.handle_timeout(self.now);
                    self.agent.handle_timeout(self.now);
                }
                _ => {
                    self.now = deadline;
                    self.pump();
                    return;
                }
            }
        }
    }

    /// Runs until `done` holds, at most `limit` of virtual time; whether it held.
    fn run_until(&mut self, limit: Duration, done: impl Fn(&Sim) -> bool) -> bool {
        let deadline = self.now + limit;
        while self.now < deadline {
            if done(self) {
                return true;
            }
            self.run_for(Duration::from_millis(100));
        }
        done(self)
    }

    /// Everything that happens at `now` without time passing.
    fn pump(&mut self) {
        loop {
            let mut progress = false;
            while let Some(frame) = self.hub.poll_transmit() {
                self.to_agent.push_back((self.now + LATENCY, frame));
                progress = true;
            }
            while let Some(frame) = self.agent.poll_transmit() {
                self.to_hub.push_back((self.now + LATENCY, frame));
                progress = true;
            }
            while self.to_hub.front().is_some_and(|(at, _)| *at <= self.now) {
                let (_, frame) = self.to_hub.pop_front().unwrap();
                if let Err(e) = self.hub.handle_frame(self.now, frame) {
                    self.errors.push(e);
                }
                progress = true;
            }
            while self.to_agent.front().is_some_and(|(at, _)| *at <= self.now) {
                let (_, frame) = self.to_agent.pop_front().unwrap();
                if let Err(e) = self.agent.handle_frame(self.now, frame) {
                    self.errors.push(e);
                }
                progress = true;
            }
            while self.reads.front().is_some_and(|(at, ..)| *at <= self.now) {
                let (_, uid, sha) = self.reads.pop_front().unwrap();
                self.answer_read(&uid, &sha);
                progress = true;
            }
            while let Some(event) = self.hub.poll_event() {
                self.on_hub_event(event);
                progress = true;
            }
            while let Some(event) = self.agent.poll_event() {
                self.on_agent_event(event);
                progress = true;
            }
            if !progress {
                return;
            }
        }
    }

    /// The gateway's driver: sync on welcome, chunk reads paced per session.
    fn on_hub_event(&mut self, event: HubEvent) {
        match event {
            HubEvent::Established { .. } => {
                let desired: Vec<DesiredWork> = self.desired.values().cloned().collect();
                self.hub.begin_sync(desired);
            }
            HubEvent::ChunkRequested { uid, chunk_sha256 } => {
                let at = self.next_read_at.max(self.now);
                self.next_read_at = at + PACE;
                self.reads.push_back((at, uid, chunk_sha256));
            }
            _ => {}
        }
    }

    /// A chunk read finishes: served if the work names it and the store can read it.
    fn answer_read(&mut self, uid: &str, sha: &str) {
        let named = self.desired.get(uid).is_some_and(|w| {
            let work: ManifestWork = serde_json::from_slice(&w.manifest_work_json).unwrap();
            ContentRef::of(&work).is_some_and(|r| r.unwrap().chunks.iter().any(|c| c == sha))
        });
        if !named {
            self.hub.refuse_chunk(
                uid,
                sha,
                format!("no ManifestWork of cluster {CLUSTER} with uid {uid} names chunk {sha}"),
            );
            return;
        }
        self.store.reads.push(sha.to_string());
        if let Some(failing) = self.store.failing.get_mut(sha)
            && *failing > 0
        {
            *failing -= 1;
            self.hub
                .refuse_chunk(uid, sha, "cannot read ManifestChunk: timed out");
            return;
        }
        match self.store.chunks.get(sha) {
            Some(data) => self.hub.send_chunk(uid, sha, data.clone()),
            None => self
                .hub
                .refuse_chunk(uid, sha, "ManifestChunk is not stored"),
        }
    }

    /// The agent's driver: its cache records transfers, stores chunks and works.
    fn on_agent_event(&mut self, event: AgentEvent) {
        match &event {
            AgentEvent::ContentWanted {
                uid,
                content,
                transfer,
                ..
            } => {
                let mut missing: Vec<String> = Vec::new();
                for sha in &content.chunks {
                    if !self.cache.contains(sha) && !missing.contains(sha) {
                        missing.push(sha.clone());
                    }
                }
                self.agent.content_missing(uid, *transfer, missing);
            }
            AgentEvent::ChunkReceived { chunk_sha256, .. } => {
                self.cache.insert(chunk_sha256.clone());
                self.agent.chunk_stored(chunk_sha256);
            }
            AgentEvent::WorkReceived { work } | AgentEvent::ContentHeld { work } => {
                self.stored.push((work.uid.clone(), work.generation));
                self.agent.ack_work(work.uid.clone(), work.generation);
            }
            _ => {}
        }
        self.agent_events.push(event);
    }

    /// Replaces or adds a work on the hub (a live change).
    fn upsert(&mut self, work: DesiredWork) {
        self.desired.insert(work.uid.clone(), work.clone());
        self.hub.upsert_work(work);
    }

    /// Deletes a work on the hub (a live change).
    fn delete(&mut self, uid: &str) {
        if let Some(work) = self.desired.remove(uid) {
            self.hub.delete_work(uid, work.namespace, work.name);
        }
    }

    fn has_stored(&self, uid: &str, generation: i64) -> bool {
        self.stored.contains(&(uid.to_string(), generation))
    }

    /// How many times the gateway read each chunk.
    fn reads_of(&self, sha: &str) -> usize {
        self.store.reads.iter().filter(|s| *s == sha).count()
    }

    fn closed(&self) -> bool {
        self.agent.is_closed() || self.hub.is_closed()
    }
}

fn store_of(chunks: &[(String, Vec<u8>)]) -> Store {
    Store {
        chunks: chunks.iter().cloned().collect(),
        ..Store::default()
    }
}

/// The stall of the large-works e2e test under load: the gateway's read of the first chunk
/// timed out, the hub refused it, and the agent gave up the whole transfer until its next
/// session, which never came: 120 s later it held no chunk. A refusal now costs the refused
/// chunk a short wait; the rest keep flowing, and the content completes in the same session.
#[test]
fn a_chunk_the_hub_cannot_read_for_a_moment_is_asked_for_again_in_the_same_session() {
    let (reference, chunks) = content("four", 8);
    let mut store = store_of(&chunks);
    store.failing.insert(chunks[0].0.clone(), 1);
    let mut sim = Sim::start(
        vec![large_work("four", 1, &reference)],
        store,
        HashSet::new(),
    );

    assert!(
        sim.run_until(Duration::from_secs(60), |s| s.has_stored("four", 1)),
        "the work was not stored within a minute; the agent holds {} of 8 chunks",
        sim.cache.len()
    );
    assert_eq!(sim.cache.len(), 8);
    assert_eq!(
        sim.reads_of(&chunks[0].0),
        2,
        "the refused chunk is asked for again"
    );
    assert_eq!(sim.store.reads.len(), 9, "and nothing else twice");
    assert!(sim.agent_events.iter().any(|e| matches!(e,
        AgentEvent::ChunkRefused { retry_in: Some(_), reason, .. } if reason.contains("timed out"))));
    assert!(!sim.closed() && sim.errors.is_empty(), "{:?}", sim.errors);
}

/// The large-works e2e test's stall itself: the hub had collected work four's first three
/// chunks before the work was created, the gateway refused the first, and the agent gave up the
/// whole transfer until a next session that never came (it held none of the five chunks the hub
/// still had, 120 s later). Now the rest arrive at once, and once the missing chunks are stored
/// again (`flotilla work create -f` run again), the content completes in the same session.
#[test]
fn chunks_refused_as_not_stored_do_not_stop_the_rest_and_arrive_once_stored_again() {
    let (reference, chunks) = content("four", 8);
    let mut store = store_of(&chunks);
    for (sha, _) in &chunks[..3] {
        store.chunks.remove(sha);
    }
    let mut sim = Sim::start(
        vec![large_work("four", 1, &reference)],
        store,
        HashSet::new(),
    );
    assert!(
        sim.run_until(Duration::from_secs(30), |s| s.cache.len() == 5),
        "the agent holds {} of the 5 chunks the hub has",
        sim.cache.len()
    );
    assert!(!sim.has_stored("four", 1));

    sim.store.chunks.extend(chunks[..3].iter().cloned());
    assert!(
        sim.run_until(CHUNK_RETRY_MAX * 2, |s| s.has_stored("four", 1)),
        "the work was not stored after its chunks were stored again"
    );
    assert_eq!(sim.cache.len(), 8);
    assert!(!sim.closed() && sim.errors.is_empty(), "{:?}", sim.errors);
}

#[test]
fn a_chunk_gone_from_the_hub_is_asked_for_again_at_a_bounded_rate_while_the_rest_arrive() {
    let (reference, chunks) = content("gone", 8);
    let mut store = store_of(&chunks);
    store.chunks.remove(&chunks[3].0);
    let mut sim = Sim::start(vec![large_work("w", 1, &reference)], store, HashSet::new());

    sim.run_for(Duration::from_secs(600));
    assert_eq!(sim.cache.len(), 7, "every chunk the hub holds arrived");
    assert!(
        !sim.has_stored("w", 1),
        "a work whose content is not whole is not stored"
    );
    // Asked again after 1, 2, 4, .. s, then once every CHUNK_RETRY_MAX.
    let reads = sim.reads_of(&chunks[3].0);
    let bound = 7 + (600 / CHUNK_RETRY_MAX.as_secs()) as usize;
    assert!(
        reads > 2 && reads <= bound,
        "{reads} reads of the missing chunk in ten minutes"
    );
    assert!(!sim.closed() && sim.errors.is_empty(), "{:?}", sim.errors);
}

#[test]
fn a_chunk_two_works_share_is_fetched_once_and_outlives_the_first_works_deletion() {
    let (reference, chunks) = content("shared", 6);
    let store = store_of(&chunks);
    let mut sim = Sim::start(
        vec![
            large_work("a", 1, &reference),
            large_work("b", 1, &reference),
        ],
        store,
        HashSet::new(),
    );
    // Two chunks in, work a (whose uid the requests name) is deleted on the hub: the gateway
    // now refuses chunks asked for in its name.
    assert!(sim.run_until(Duration::from_secs(30), |s| s.cache.len() >= 2));
    sim.delete("a");
    assert!(
        sim.run_until(Duration::from_secs(60), |s| s.has_stored("b", 1)),
        "work b was not stored; the agent holds {} of 6 chunks",
        sim.cache.len()
    );
    assert!(!sim.has_stored("a", 1));
    for (sha, _) in &chunks {
        assert!(
            sim.reads_of(sha) <= 1,
            "a chunk of both works was read twice"
        );
    }
    assert!(!sim.closed() && sim.errors.is_empty(), "{:?}", sim.errors);
}

#[test]
fn a_work_replaced_mid_transfer_fetches_only_its_new_content() {
    let (old, old_chunks) = content("old", 8);
    let (new, new_chunks) = content("new", 4);
    let mut store = store_of(&old_chunks);
    store.chunks.extend(new_chunks.iter().cloned());
    let mut sim = Sim::start(vec![large_work("w", 1, &old)], store, HashSet::new());
    assert!(sim.run_until(Duration::from_secs(30), |s| s.cache.len() >= 2));
    sim.upsert(large_work("w", 2, &new));

    assert!(
        sim.run_until(Duration::from_secs(60), |s| s.has_stored("w", 2)),
        "generation 2 was not stored"
    );
    assert!(
        !sim.has_stored("w", 1),
        "the replaced content is never stored as the work"
    );
    // The old content's chunks stop at the ones already asked for when the new one came.
    let old_read = old_chunks
        .iter()
        .filter(|(sha, _)| sim.reads_of(sha) > 0)
        .count();
    assert!(
        old_read <= 2 + 2,
        "{old_read} chunks of the replaced content were read"
    );
    assert!(!sim.closed() && sim.errors.is_empty(), "{:?}", sim.errors);
}

#[test]
fn a_work_deleted_mid_transfer_stops_its_requests() {
    let (reference, chunks) = content("deleted", 8);
    let mut sim = Sim::start(
        vec![large_work("w", 1, &reference)],
        store_of(&chunks),
        HashSet::new(),
    );
    assert!(sim.run_until(Duration::from_secs(30), |s| s.cache.len() >= 2));
    sim.delete("w");
    sim.run_for(Duration::from_secs(120));
    let read = chunks
        .iter()
        .filter(|(sha, _)| sim.reads_of(sha) > 0)
        .count();
    assert!(read <= 2 + 2, "{read} chunks of the deleted work were read");
    assert!(!sim.closed() && sim.errors.is_empty(), "{:?}", sim.errors);
}

#[test]
fn a_transfer_cut_by_the_session_resumes_from_what_the_cache_holds() {
    let (reference, chunks) = content("resumed", 8);
    let work = large_work("w", 1, &reference);
    let mut first = Sim::start(vec![work.clone()], store_of(&chunks), HashSet::new());
    assert!(first.run_until(Duration::from_secs(30), |s| s.cache.len() >= 3));
    // The connection breaks: both machines close, requests in flight are lost with them.
    first.agent.close("the connection to the hub failed");
    first.run_for(Duration::from_secs(1));
    let held = first.cache.clone();

    let mut second = Sim::start(vec![work], store_of(&chunks), held.clone());
    assert!(second.run_until(Duration::from_secs(30), |s| s.has_stored("w", 1)));
    let asked: HashSet<String> = second.store.reads.iter().cloned().collect();
    let missing: HashSet<String> = chunks
        .iter()
        .map(|(sha, _)| sha.clone())
        .filter(|sha| !held.contains(sha))
        .collect();
    assert_eq!(
        asked, missing,
        "the next session asks for exactly what is missing"
    );
    assert_eq!(second.store.reads.len(), missing.len());
}
