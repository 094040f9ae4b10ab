//! The bodies of the fuzz targets whose code lives in proto, and the input reader every crate's
//! targets share. `fuzz/` at the repository root (cargo-fuzz, nightly) runs each body under
//! libFuzzer; `tests/fuzz_corpus.rs` replays the kept corpus through the same functions on the
//! stable toolchain, so a crash once found stays fixed.
//!
//! Each body takes arbitrary bytes and panics only when something the code promises does not
//! hold: the code under test never panics, and the properties named in each body's doc hold
//! for every input.
//!
//! Not for: anything but fuzzing and its replay; nothing in flotilla calls these.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use prost::Message;
use serde_json::Value;
use tokio::time::Instant;

use crate::PROTOCOL_VERSION;
use crate::api::content::{
    self, CHUNK_BYTES, ContentError, ContentRef, MAX_CONTENT_BYTES, is_sha256_hex, sha256_hex,
};
use crate::api::{Manifest, ManifestWork, ManifestWorkSpec, quantity};
use crate::contract::{self, MAX_UID_BYTES};
use crate::session::{
    AgentConfig, AgentEvent, AgentSession, CHUNK_WINDOW, DEFAULT_WELCOME_TIMEOUT, DesiredWork,
    HeldWork, HubConfig, HubEvent, HubSession, MAX_CSR_BYTES,
};
use crate::wire::{self, agent_frame, hub_frame};

/// Reads a fuzzer's bytes as a sequence of choices. Reading past the end yields zeros and empty
/// runs, so every input, however short, is a complete scenario.
#[derive(Debug, Clone)]
pub struct FuzzInput<'a> {
    data: &'a [u8],
}

impl<'a> FuzzInput<'a> {
    pub fn new(data: &'a [u8]) -> FuzzInput<'a> {
        FuzzInput { data }
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn byte(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.byte(), self.byte(), self.byte(), self.byte()])
    }

    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    /// A run of bytes: a one-byte length (255 means a two-byte length follows), then that many
    /// bytes, fewer at the end of the input.
    pub fn bytes(&mut self) -> &'a [u8] {
        let mut len = usize::from(self.byte());
        if len == 255 {
            len = usize::from(self.u16());
        }
        let (run, rest) = self.data.split_at(len.min(self.data.len()));
        self.data = rest;
        run
    }

    /// [`bytes`](Self::bytes) as text (invalid UTF-8 replaced).
    pub fn string(&mut self) -> String {
        String::from_utf8_lossy(self.bytes()).into_owned()
    }

    /// One of `choices`.
    pub fn pick<T: Copy>(&mut self, choices: &[T]) -> T {
        choices[usize::from(self.byte()) % choices.len()]
    }

    /// Everything not read yet.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
}

/// The cluster of the fuzzed sessions' certificate.
const CLUSTER: &str = "store-1";
/// Work uids the fuzzed drivers use: few, so updates of one work coalesce.
const UIDS: [&str; 4] = ["w0", "w1", "w2", "w3"];

/// Asserts that a decoded frame encodes back to itself: what a peer decodes is exactly what the
/// sender meant, whatever unknown fields or odd encodings the bytes had.
fn round_trips<T: Message + Default + PartialEq + std::fmt::Debug>(frame: &T) {
    let bytes = frame.encode_to_vec();
    assert_eq!(bytes.len(), frame.encoded_len(), "encoded_len is exact");
    let again = T::decode(bytes.as_slice()).expect("an encoded frame decodes");
    assert_eq!(&again, frame, "decode(encode(frame)) == frame");
}

/// `session_frame_grpc`: session frames as the gRPC carrier delivers them (one protobuf message
/// each, decoded by prost), fed to the gateway's [`HubSession`] or the agent's
/// [`AgentSession`] between the calls a driver makes.
///
/// Properties: every frame that decodes encodes back to itself; a machine never panics; a
/// frame it refuses closes the session, and a closed session ignores further frames; nothing
/// follows the `Goodbye` it sends, and a session it closed itself says goodbye; the hub emits
/// `Established` once and only for a hello of its certificate's cluster and version, sends
/// nothing but a refusal before its `Welcome`, keeps at most [`CHUNK_WINDOW`] chunk requests
/// and one renewal outstanding, answers only chunks asked for, and hands on only bounded uids
/// and requests; the agent hands on only chunks it asked for whose bytes hash to their digest,
/// and a certificate only while it asked for one.
/// `start` is when the sessions begin: proto reads no clock, the caller passes it in.
pub fn session_frames(data: &[u8], start: Instant) {
    let mut input = FuzzInput::new(data);
    if input.byte().is_multiple_of(2) {
        hub_session(input, start);
    } else {
        agent_session(input, start);
    }
}

fn hello() -> wire::AgentFrame {
    wire::AgentFrame {
        frame: Some(agent_frame::Frame::Hello(wire::Hello {
            protocol_version: PROTOCOL_VERSION,
            cluster_name: CLUSTER.into(),
            ..wire::Hello::default()
        })),
    }
}

fn desired_work(input: &mut FuzzInput<'_>) -> DesiredWork {
    DesiredWork {
        uid: input.pick(&UIDS).into(),
        namespace: CLUSTER.into(),
        name: "work".into(),
        generation: i64::from(input.byte() % 4),
        content_hash: format!("h{}", input.byte() % 2),
        manifest_work_json: input.bytes().to_vec(),
        kind: String::new(),
    }
}

/// What the fuzzed gateway driver has seen of its session.
#[derive(Default)]
struct HubWatch {
    established: bool,
    closed: Option<bool>,
    welcome_sent: bool,
    goodbye_sent: bool,
    sync_complete_sent: bool,
    /// Chunk digests asked for and not answered on the wire yet.
    chunks_asked: HashSet<String>,
    /// Requests the driver has not answered yet: (uid, digest).
    to_answer: Vec<(String, String)>,
    renewing: bool,
}

impl HubWatch {
    fn events(&mut self, hub: &mut HubSession) {
        while let Some(event) = hub.poll_event() {
            assert!(self.closed.is_none(), "{event:?} after Closed");
            match event {
                HubEvent::Established { hello } => {
                    assert!(!self.established, "Established twice");
                    assert_eq!(hello.cluster_name, CLUSTER, "a hello of another cluster");
                    assert_eq!(hello.protocol_version, PROTOCOL_VERSION);
                    assert!(
                        hello
                            .releasing
                            .iter()
                            .all(|u| !u.is_empty() && u.len() <= MAX_UID_BYTES)
                    );
                    self.established = true;
                }
                HubEvent::ClusterInfoReported { info } => {
                    assert!(self.established);
                    // What the hub stores and its scheduler compares, as they do it.
                    if contract::check_cluster_info(&info).is_ok() {
                        for q in info.capacity.values().chain(info.allocatable.values()) {
                            quantity::parse_quantity(q);
                        }
                    }
                }
                HubEvent::WorkReleased { uid } => {
                    assert!(self.established);
                    assert!(!uid.is_empty() && uid.len() <= MAX_UID_BYTES, "{uid:?}");
                }
                HubEvent::RenewalRequested { csr_pem } => {
                    assert!(self.established);
                    assert!(csr_pem.len() <= MAX_CSR_BYTES, "{} bytes", csr_pem.len());
                    assert!(!self.renewing, "a second renewal while one is outstanding");
                    self.renewing = true;
                }
                HubEvent::ChunkRequested { uid, chunk_sha256 } => {
                    assert!(self.established);
                    assert!(is_sha256_hex(&chunk_sha256), "{chunk_sha256:?}");
                    assert!(
                        self.chunks_asked.insert(chunk_sha256.clone()),
                        "chunk {chunk_sha256} handed on twice"
                    );
                    assert!(
                        self.chunks_asked.len() <= CHUNK_WINDOW,
                        "{} chunk requests outstanding",
                        self.chunks_asked.len()
                    );
                    self.to_answer.push((uid, chunk_sha256));
                }
                HubEvent::Alive { .. }
                | HubEvent::WorkAcked { .. }
                | HubEvent::StatusReported { .. } => assert!(self.established),
                HubEvent::Closed { by_peer, .. } => self.closed = Some(by_peer),
            }
        }
    }

    fn transmit(&mut self, frame: wire::HubFrame) {
        round_trips(&frame);
        assert!(!self.goodbye_sent, "{frame:?} after the Goodbye");
        let Some(frame) = frame.frame else {
            panic!("an empty frame sent");
        };
        match &frame {
            hub_frame::Frame::Goodbye(_) => self.goodbye_sent = true,
            hub_frame::Frame::Drain(_) => {}
            hub_frame::Frame::Welcome(_) => {
                assert!(
                    self.established && !self.welcome_sent,
                    "Welcome out of turn"
                );
                self.welcome_sent = true;
            }
            other => {
                assert!(self.welcome_sent, "{other:?} before the Welcome");
                match other {
                    hub_frame::Frame::SyncComplete(_) => {
                        assert!(!self.sync_complete_sent, "SyncComplete twice");
                        self.sync_complete_sent = true;
                    }
                    hub_frame::Frame::Chunk(wire::Chunk { chunk_sha256, .. })
                    | hub_frame::Frame::ChunkRefused(wire::ChunkRefused { chunk_sha256, .. }) => {
                        assert!(
                            self.chunks_asked.remove(chunk_sha256),
                            "an answer to chunk {chunk_sha256}, which is not asked for"
                        )
                    }
                    _ => {}
                }
            }
        }
    }
}

fn hub_session(mut input: FuzzInput<'_>, start: Instant) {
    let mut now = start;
    let config = HubConfig {
        max_pending_works: 3,
        ..HubConfig::default()
    };
    let mut hub = HubSession::new(now, config, CLUSTER, "s1");
    let mut watch = HubWatch::default();
    if !input.byte().is_multiple_of(4) {
        // Most runs start past the hello, where most of the protocol is.
        hub.handle_frame(now, hello())
            .expect("a hello of the certificate's cluster is accepted");
    }
    while !input.is_empty() {
        match input.byte() % 10 {
            0..=4 => {
                let Ok(frame) = wire::AgentFrame::decode(input.bytes()) else {
                    continue;
                };
                round_trips(&frame);
                let was_closed = hub.is_closed();
                let handled = hub.handle_frame(now, frame);
                if was_closed {
                    assert!(handled.is_ok(), "a closed session ignores frames");
                }
                if let Err(e) = handled {
                    assert!(hub.is_closed(), "{e} did not close the session");
                }
            }
            5 => {
                now += Duration::from_millis(u64::from(input.u16()) * 100);
                hub.handle_timeout(now);
            }
            6 => {
                let count = input.byte() % 5;
                let works: Vec<DesiredWork> =
                    (0..count).map(|_| desired_work(&mut input)).collect();
                hub.begin_sync(works);
            }
            7 => match input.byte() % 3 {
                0 => hub.upsert_work(desired_work(&mut input)),
                1 => hub.delete_work(input.pick(&UIDS), CLUSTER, "work"),
                _ => hub.ack_status(input.pick(&UIDS), input.u64()),
            },
            8 => match input.byte() % 6 {
                0 => {
                    if let Some((uid, sha)) = watch.to_answer.pop() {
                        hub.send_chunk(uid, &sha, input.bytes().to_vec());
                    }
                }
                1 => {
                    if let Some((uid, sha)) = watch.to_answer.pop() {
                        hub.refuse_chunk(uid, &sha, "gone");
                    }
                    // An answer nobody asked for is never sent.
                    let other = sha256_hex(input.bytes());
                    if !watch.chunks_asked.contains(&other) {
                        hub.send_chunk("w0", &other, Vec::new());
                    }
                }
                2 => {
                    hub.issue_certificate("certificate", "bundle");
                    watch.renewing = false;
                }
                3 => {
                    hub.refuse_renewal("refused");
                    watch.renewing = false;
                }
                4 => hub.ack_release(input.pick(&UIDS)),
                _ => {
                    hub.open_tunnel("t1");
                    hub.send_trust_bundle("bundle");
                }
            },
            _ => match input.byte() % 4 {
                0 => hub.drain(Duration::from_millis(u64::from(input.u16())), "draining"),
                1 => hub.redirect(Duration::ZERO, Some("gw-2:443".into()), "not mine"),
                2 => hub.close("closing"),
                _ => hub.refuse(wire::Refusal::ClusterDenied, "denied"),
            },
        }
        watch.events(&mut hub);
        // The transport takes as many frames as it has room for.
        for _ in 0..input.byte() % 8 {
            let Some(frame) = hub.poll_transmit() else {
                break;
            };
            watch.transmit(frame);
            watch.events(&mut hub);
        }
    }
    watch.events(&mut hub);
    while let Some(frame) = hub.poll_transmit() {
        watch.transmit(frame);
    }
    if watch.closed == Some(false) {
        assert!(
            watch.goodbye_sent,
            "a session closed by the hub says goodbye"
        );
    }
}

/// What the fuzzed agent driver has seen of its session.
#[derive(Default)]
struct AgentWatch {
    frames_sent: usize,
    established: bool,
    closed: bool,
    goodbye_sent: bool,
    /// Chunks the driver asked for and not received: digest → bytes that hash to it.
    wanted: HashMap<String, Vec<u8>>,
    /// Chunk requests on the wire without an answer yet.
    requested: HashSet<String>,
    /// The fuzzed hub answered a request the agent had not sent yet: the window is then the
    /// agent's own count, not what is on the wire.
    early_answer: bool,
    renewing: bool,
}

impl AgentWatch {
    fn events(&mut self, agent: &mut AgentSession) {
        while let Some(event) = agent.poll_event() {
            assert!(!self.closed, "{event:?} after Closed");
            match event {
                AgentEvent::Established {
                    heartbeat_interval,
                    heartbeat_timeout,
                    ..
                } => {
                    assert!(!self.established, "Established twice");
                    assert!(
                        !heartbeat_interval.is_zero() && heartbeat_interval < heartbeat_timeout,
                        "heartbeats every {heartbeat_interval:?}, timeout {heartbeat_timeout:?}"
                    );
                    self.established = true;
                }
                AgentEvent::ChunkReceived { chunk_sha256, data } => {
                    assert!(data.len() <= CHUNK_BYTES);
                    assert_eq!(sha256_hex(&data), chunk_sha256, "a chunk with other bytes");
                    assert!(
                        self.wanted.remove(&chunk_sha256).is_some(),
                        "chunk {chunk_sha256} was not asked for"
                    );
                    self.answered(&chunk_sha256);
                }
                AgentEvent::ChunkRefused { chunk_sha256, .. } => {
                    self.wanted.remove(&chunk_sha256);
                    self.answered(&chunk_sha256);
                }
                AgentEvent::CertificateIssued { .. } => {
                    assert!(self.renewing, "a certificate nobody asked for");
                    self.renewing = false;
                }
                AgentEvent::RenewalRefused { .. } => self.renewing = false,
                AgentEvent::Closed { .. } => self.closed = true,
                _ => {}
            }
        }
    }

    fn answered(&mut self, sha: &str) {
        if !self.requested.remove(sha) {
            self.early_answer = true;
        }
    }

    fn transmit(&mut self, frame: wire::AgentFrame) {
        round_trips(&frame);
        assert!(!self.goodbye_sent, "{frame:?} after the Goodbye");
        self.frames_sent += 1;
        match frame.frame {
            Some(agent_frame::Frame::Hello(hello)) => {
                assert_eq!(self.frames_sent, 1, "the hello goes first");
                assert_eq!(hello.cluster_name, CLUSTER);
            }
            Some(agent_frame::Frame::Goodbye(_)) => self.goodbye_sent = true,
            Some(agent_frame::Frame::ChunkRequest(request)) => {
                self.requested.insert(request.chunk_sha256);
                assert!(
                    self.early_answer || self.requested.len() <= CHUNK_WINDOW,
                    "{} chunk requests on the wire",
                    self.requested.len()
                );
            }
            Some(_) => {}
            None => panic!("an empty frame sent"),
        }
    }
}

/// Work `uid` whose one manifest is a reference to content of `chunks`.
fn large_work(uid: &str, chunks: &[String]) -> wire::HubFrame {
    let reference = ContentRef {
        sha256: sha256_hex(chunks.concat().as_bytes()),
        bytes: (chunks.len() * CHUNK_BYTES) as u64,
        chunks: chunks.to_vec(),
    };
    let work = serde_json::json!({
        "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
        "metadata": {"name": uid, "namespace": CLUSTER, "uid": uid, "generation": 1},
        "spec": {"workload": {"manifests": [reference.manifest().0]}},
    });
    wire::HubFrame {
        frame: Some(hub_frame::Frame::WorkUpdate(wire::WorkUpdate {
            uid: uid.into(),
            namespace: CLUSTER.into(),
            name: uid.into(),
            generation: 1,
            content_hash: "h1".into(),
            manifest_work_json: serde_json::to_vec(&work).unwrap_or_default(),
            kind: String::new(),
        })),
    }
}

fn welcome(interval_ms: u32, timeout_ms: u32) -> wire::HubFrame {
    wire::HubFrame {
        frame: Some(hub_frame::Frame::Welcome(wire::Welcome {
            protocol_version: PROTOCOL_VERSION,
            session_id: "s1".into(),
            heartbeat_interval_ms: interval_ms,
            heartbeat_timeout_ms: timeout_ms,
        })),
    }
}

fn agent_session(mut input: FuzzInput<'_>, start: Instant) {
    let mut now = start;
    let config = AgentConfig {
        cluster_name: CLUSTER.into(),
        agent_version: "fuzz".into(),
        kubernetes_version: String::new(),
        claims: Vec::new(),
        welcome_timeout: DEFAULT_WELCOME_TIMEOUT,
    };
    let held: Vec<HeldWork> = UIDS[..usize::from(input.byte() % 3)]
        .iter()
        .map(|uid| HeldWork {
            uid: (*uid).into(),
            generation: 1,
            content_hash: "h0".into(),
        })
        .collect();
    let mut agent = AgentSession::new(now, config, held);
    let mut watch = AgentWatch::default();
    if !input.byte().is_multiple_of(4) {
        agent
            .handle_frame(now, welcome(10_000, 30_000))
            .expect("a valid welcome is accepted");
    }
    while !input.is_empty() {
        match input.byte() % 10 {
            0..=3 => {
                let Ok(frame) = wire::HubFrame::decode(input.bytes()) else {
                    continue;
                };
                round_trips(&frame);
                let was_closed = agent.is_closed();
                let handled = agent.handle_frame(now, frame);
                if was_closed {
                    assert!(handled.is_ok(), "a closed session ignores frames");
                }
                if let Err(e) = handled {
                    assert!(agent.is_closed(), "{e} did not close the session");
                }
            }
            4 => {
                // The hub answers a chunk asked for: with its bytes, or with one more byte or
                // one bit changed.
                let Some(sha) = watch.wanted.keys().min().cloned() else {
                    continue;
                };
                let mut data = watch.wanted[&sha].clone();
                let flip = input.byte();
                if flip % 2 == 1 {
                    let at = usize::from(flip) % (data.len() + 1);
                    match data.get_mut(at) {
                        Some(b) => *b ^= 1,
                        None => data.push(flip),
                    }
                }
                let chunk = hub_frame::Frame::Chunk(wire::Chunk {
                    work_uid: "w0".into(),
                    chunk_sha256: sha,
                    data,
                });
                let was_closed = agent.is_closed();
                let handled = agent.handle_frame(now, wire::HubFrame { frame: Some(chunk) });
                if flip % 2 == 1 && !was_closed {
                    assert!(handled.is_err(), "a chunk with other bytes is refused");
                }
            }
            5 => {
                now += Duration::from_millis(u64::from(input.u16()) * 100);
                agent.handle_timeout(now);
            }
            6 => {
                // A large work naming these chunks arrives, and the driver's cache holds none.
                let uid = input.pick(&UIDS);
                let mut shas = Vec::new();
                for _ in 0..input.byte() % 4 {
                    let data = input.bytes().to_vec();
                    let sha = sha256_hex(&data);
                    if agent.is_established() {
                        watch.wanted.insert(sha.clone(), data);
                    }
                    shas.push(sha);
                }
                if agent.is_established() && !shas.is_empty() {
                    watch.events(&mut agent);
                    let handled = agent.handle_frame(now, large_work(uid, &shas));
                    assert!(handled.is_ok(), "a well-formed large work is taken");
                    if let Some(AgentEvent::ContentWanted { transfer, .. }) = agent.poll_event() {
                        agent.content_missing(uid, transfer, shas);
                    }
                }
            }
            7 => match input.byte() % 4 {
                0 => agent.ack_work(input.pick(&UIDS), i64::from(input.byte())),
                1 => agent.report_status(input.pick(&UIDS), 1, input.u64(), b"{}".to_vec()),
                2 => agent.release_work(input.pick(&UIDS)),
                _ => agent.report_cluster_info(wire::ClusterInfo::default()),
            },
            8 => {
                if agent.renew_certificate(input.string()) {
                    watch.renewing = true;
                }
            }
            _ => agent.close("stopping"),
        }
        watch.events(&mut agent);
        for _ in 0..input.byte() % 8 {
            let Some(frame) = agent.poll_transmit() else {
                break;
            };
            watch.transmit(frame);
        }
    }
    watch.events(&mut agent);
    while let Some(frame) = agent.poll_transmit() {
        watch.transmit(frame);
    }
}

/// `chunks`: a large work's content cut into chunks and joined again, as the agent joins what
/// its cache holds ([`ContentRef::assemble`]), and `ChunkedManifests` references read from
/// arbitrary JSON ([`ContentRef::from_manifest`]).
///
/// Properties: content joins back to exactly the manifests it was made from; a chunk set with
/// a changed or missing chunk is refused naming the first such chunk, and one whose chunks are
/// right but join to other content is refused as a whole; a reference that reads is within the
/// protocol's bounds and reads back from the manifest it writes.
pub fn chunks(data: &[u8]) {
    let mut input = FuzzInput::new(data);
    match input.byte() % 3 {
        0 => reference(input.rest()),
        1 => reassembly(&mut input),
        _ => named_chunks(input.rest()),
    }
}

fn reference(json: &[u8]) {
    let Ok(value) = serde_json::from_slice::<Value>(json) else {
        return;
    };
    let manifest = Manifest(value);
    let Ok(reference) = ContentRef::from_manifest(&manifest) else {
        return;
    };
    assert!(is_sha256_hex(&reference.sha256));
    assert!(reference.bytes >= 1 && reference.bytes <= MAX_CONTENT_BYTES);
    assert_eq!(
        reference.chunks.len() as u64,
        reference.bytes.div_ceil(CHUNK_BYTES as u64)
    );
    assert!(reference.chunks.iter().all(|c| is_sha256_hex(c)));
    let total: u64 = (0..reference.chunks.len())
        .map(|i| reference.chunk_len(i))
        .sum();
    assert_eq!(total, reference.bytes, "the chunks' lengths add up");
    assert_eq!(
        ContentRef::from_manifest(&reference.manifest()).as_ref(),
        Ok(&reference),
        "a reference reads back from the manifest it writes"
    );
    let mut spec = ManifestWorkSpec::default();
    spec.workload.manifests = vec![reference.manifest()];
    let work = ManifestWork::new("large", spec);
    assert_eq!(ContentRef::of(&work), Some(Ok(reference.clone())));
    // What decides which chunks stay on the hub and the agent sees every one it names.
    let named = content::named_chunk_digests(&serde_json::to_value(&work).expect("serializes"));
    assert_eq!(named, reference.chunks);
}

/// Content made from the input, cut at points the input chooses (the protocol's chunks are
/// 512 KiB; the joining does not depend on where the cuts fall), then joined with some chunks
/// changed, missing or swapped.
fn reassembly(input: &mut FuzzInput<'_>) {
    let manifests: Vec<Manifest> = (0..1 + input.byte() % 3)
        .map(|i| {
            Manifest(serde_json::json!({
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": format!("cm-{i}")},
                "data": {"blob": input.string()},
            }))
        })
        .collect();
    let content = serde_json::to_vec(&manifests).expect("manifests serialize");
    let mut pieces: Vec<Vec<u8>> = Vec::new();
    let mut rest = content.as_slice();
    while !rest.is_empty() {
        let cut = (1 + usize::from(input.byte())).min(rest.len());
        let (piece, tail) = rest.split_at(cut);
        pieces.push(piece.to_vec());
        rest = tail;
    }
    let reference = ContentRef {
        sha256: sha256_hex(&content),
        bytes: content.len() as u64,
        chunks: pieces.iter().map(|p| sha256_hex(p)).collect(),
    };
    let joined = reference.assemble(|i, sha| {
        assert_eq!(
            sha, reference.chunks[i],
            "asked for chunk #{i} by its digest"
        );
        Some(pieces[i].clone())
    });
    assert_eq!(joined, Ok(manifests.clone()), "content joins back whole");

    // Tampering the fuzzer chooses: a changed bit, a missing chunk, two chunks swapped.
    let mut tampered = pieces.clone();
    let mut missing = None;
    let mut first_bad = None;
    match input.byte() % 3 {
        0 => {
            let i = usize::from(input.byte()) % tampered.len();
            let at = usize::from(input.byte()) % tampered[i].len();
            tampered[i][at] ^= 1 << (input.byte() % 8);
            first_bad = Some(i);
        }
        1 => missing = Some(usize::from(input.byte()) % tampered.len()),
        _ => {
            let (i, j) = (
                usize::from(input.byte()) % tampered.len(),
                usize::from(input.byte()) % tampered.len(),
            );
            tampered.swap(i, j);
            if tampered[i] != pieces[i] {
                first_bad = Some(i.min(j));
            }
        }
    }
    let got = reference.assemble(|i, _| (Some(i) != missing).then(|| tampered[i].clone()));
    match (missing, first_bad) {
        (Some(index), _) => assert!(
            matches!(&got, Err(ContentError::MissingChunk { index: i, .. }) if *i == index),
            "{got:?}"
        ),
        (None, Some(index)) => assert!(
            matches!(&got, Err(ContentError::ChunkDigest { index: i, .. }) if *i == index),
            "{got:?}"
        ),
        (None, None) => assert_eq!(got, Ok(manifests.clone())),
    }

    // Chunks that each hash right but are not this content's: a reference naming them with
    // the content's digest is refused as a whole.
    if pieces.len() > 1 {
        let mut reordered = pieces.clone();
        reordered.rotate_left(1);
        if reordered != pieces {
            let wrong = ContentRef {
                chunks: reordered.iter().map(|p| sha256_hex(p)).collect(),
                ..reference.clone()
            };
            let got = wrong.assemble(|i, _| Some(reordered[i].clone()));
            assert!(
                matches!(got, Err(ContentError::ContentDigest { .. })),
                "{got:?}"
            );
        }
    }
}

fn named_chunks(json: &[u8]) {
    let Ok(work) = serde_json::from_slice::<Value>(json) else {
        return;
    };
    let named = content::named_chunk_digests(&work);
    // A well-formed reference's chunks are always among those named: collection never takes a
    // chunk a valid work needs.
    if let Ok(typed) = serde_json::from_value::<ManifestWork>(work.clone())
        && let Some(Ok(reference)) = ContentRef::of(&typed)
    {
        for sha in &reference.chunks {
            assert!(named.contains(sha), "chunk {sha} is not named");
        }
    }
    if work.get("kind").is_some() {
        // A ManifestChunk object is accepted only under its own digest.
        if content::check_chunk_object(&work).is_ok() {
            let name = work["metadata"]["name"].as_str().expect("checked");
            let chunk: content::ManifestChunk =
                serde_json::from_value(work.clone()).expect("checked");
            assert_eq!(
                name,
                content::chunk_object_name(&sha256_hex(&chunk.spec.data.0))
            );
        }
    }
}
