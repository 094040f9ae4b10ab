//! The gateway's side of one session.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use super::error::{CloseReason, ProtocolError};
use super::queue::CoalescingQueue;
use super::{CHUNK_WINDOW, DesiredWork, duration_ms};
use crate::PROTOCOL_VERSION;
use crate::api::content::is_sha256_hex;
use crate::contract::MAX_UID_BYTES;
use crate::wire::{self, agent_frame, hub_frame};

/// Default for [`HubConfig::heartbeat_interval`].
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(10);
/// Default for [`HubConfig::heartbeat_timeout`]: three missed heartbeats.
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(30);
/// Default for [`HubConfig::hello_timeout`].
pub const DEFAULT_HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Default for [`HubConfig::max_pending_works`].
pub const DEFAULT_MAX_PENDING_WORKS: usize = 4096;
/// Largest certificate signing request a session accepts (a PEM CSR for an ECDSA or RSA-4096
/// key is 0.5–2 KiB); a larger one is refused without closing the session.
pub const MAX_CSR_BYTES: usize = 16 * 1024;

/// Settings shared by all sessions of a gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HubConfig {
    /// How often the agent sends a heartbeat; told to the agent in `Welcome`.
    pub heartbeat_interval: Duration,
    /// Silence longer than this ends the session on both ends; told to the agent in `Welcome`.
    /// Must be larger than `heartbeat_interval` (a few intervals, to ride out a lost frame).
    pub heartbeat_timeout: Duration,
    /// How long a connected agent may take to send its hello. Short, because a connection that
    /// has not said hello holds a handshake slot that other agents are waiting for.
    pub hello_timeout: Duration,
    /// The most distinct works that may wait to be sent to this agent. Coalescing keeps at most
    /// one entry per work, so this is only reached when many of a cluster's works change while
    /// its agent is not reading; the session then closes with
    /// [`CloseReason::QueueOverflow`]. The initial sync is never refused, so set this above the
    /// number of works any one cluster has.
    pub max_pending_works: usize,
}

impl Default for HubConfig {
    fn default() -> Self {
        Self {
            heartbeat_interval: DEFAULT_HEARTBEAT_INTERVAL,
            heartbeat_timeout: DEFAULT_HEARTBEAT_TIMEOUT,
            hello_timeout: DEFAULT_HELLO_TIMEOUT,
            max_pending_works: DEFAULT_MAX_PENDING_WORKS,
        }
    }
}

/// What the gateway's driver must act on, from [`HubSession::poll_event`].
#[derive(Debug, Clone, PartialEq)]
pub enum HubEvent {
    /// The agent's hello was accepted and `Welcome` is queued. The driver now looks up the
    /// cluster's desired state and calls [`HubSession::begin_sync`]. `hello.held` is what the
    /// agent holds durably; `hello.claims` and `hello.kubernetes_version` belong in the
    /// ManagedCluster's status.
    Established {
        /// The agent's hello, as received.
        hello: wire::Hello,
    },
    /// A heartbeat arrived: keep the cluster Available. At most one per heartbeat interval;
    /// with a live agent the gap between two is under two intervals.
    Alive {
        /// When the heartbeat was handled.
        at: Instant,
    },
    /// The agent has made this generation of the work durable.
    WorkAcked {
        /// The work's uid.
        uid: String,
        /// The generation the agent stored.
        generation: i64,
        /// Whether this is the generation this session last sent for the uid (or the agent
        /// already held at hello). `false` for an ack overtaken by a newer update, or for a uid
        /// this session never sent: the driver should not record those as applied.
        current: bool,
    },
    /// The agent reported status for a work. The driver stores it (dropping it if `seq` is not
    /// newer than what it has) and then calls [`HubSession::ack_status`]. The driver must check
    /// that the uid belongs to this session's cluster: a session writes only its own objects.
    StatusReported {
        /// The work's uid.
        uid: String,
        /// The generation the status was computed for (observedGeneration).
        generation: i64,
        /// The agent's sequence number for this work's status; newer is larger.
        seq: u64,
        /// ManifestWork status (conditions, resourceStatus) as JSON.
        status_json: Vec<u8>,
    },
    /// The agent reported what it knows about its spoke now (claims, Kubernetes version,
    /// capacity and allocatable resources), whole. The driver hands it to whoever writes the
    /// ManagedCluster's status, which writes only what changed. Only the cluster of this
    /// session's certificate is meant: the frame names none.
    ClusterInfoReported {
        /// The report, as received.
        info: wire::ClusterInfo,
    },
    /// The agent removed from the spoke everything this deleted work applied (or orphaned it)
    /// and forgot the work. The driver checks that the uid is one of this cluster's works,
    /// removes the work's cleanup finalizer, and then calls [`HubSession::ack_release`] (also
    /// when there is nothing to remove: the work is gone, or never had the finalizer).
    WorkReleased {
        /// The work's uid, at most [`MAX_UID_BYTES`].
        uid: String,
    },
    /// The agent asks for a certificate for a new key (rotation). The driver checks that the
    /// cluster is still accepted, signs the request for the session's own identity (never a
    /// name from the request), and answers with [`HubSession::issue_certificate`] or
    /// [`HubSession::refuse_renewal`]. At most one is outstanding per session: repeats before
    /// the answer are dropped.
    RenewalRequested {
        /// PEM PKCS#10 request, at most [`MAX_CSR_BYTES`].
        csr_pem: String,
    },
    /// The agent asks for one chunk of a large work's content. The driver checks that the work
    /// is this cluster's and that its reference names the chunk, reads the chunk from the
    /// cluster's namespace, and answers with [`HubSession::send_chunk`] or
    /// [`HubSession::refuse_chunk`]. At most [`CHUNK_WINDOW`] are outstanding per session.
    ChunkRequested {
        /// The work whose content reference names the chunk.
        uid: String,
        /// Hex SHA-256 of the chunk (checked to be one).
        chunk_sha256: String,
    },
    /// The session is over. The driver sends what [`HubSession::poll_transmit`] still yields
    /// (a `Goodbye`, after a drain the `Drain` first), then ends the stream. Events queued
    /// before this one (acks, statuses) are still valid and worth storing.
    Closed {
        /// Why.
        reason: CloseReason,
        /// Whether the agent ended it (said goodbye).
        by_peer: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    AwaitingHello { deadline: Instant },
    Established,
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sync {
    /// Established, but the driver has not given the desired state yet: work frames wait.
    NotStarted,
    /// The sync's frames are in the queue, followed by the `SyncComplete` marker.
    Sending {
        /// Work frames transmitted since the sync began, reported in `SyncComplete.sent`.
        sent: u32,
    },
    Done,
}

/// What the agent has, as far as this session knows.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Delivered {
    generation: i64,
    content_hash: String,
}

/// A key in the work queue. The sync marker sits in the same FIFO so that `SyncComplete` goes
/// out exactly after every frame the sync queued (and any live change that coalesced into one
/// of them), and before any live change that came later.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Slot {
    Work(String),
    SyncComplete,
}

#[derive(Debug, Clone, PartialEq)]
enum Outgoing {
    Update(wire::WorkUpdate),
    Delete(wire::WorkDelete),
    SyncComplete,
}

/// The gateway's side of one session: a sans-IO state machine.
///
/// The driver feeds it frames ([`handle_frame`](Self::handle_frame)) and timer expiries
/// ([`handle_timeout`](Self::handle_timeout)), and after each call drains
/// [`poll_transmit`](Self::poll_transmit) (calling it only when the transport can take a frame:
/// the work queue is where backpressure is meant to land, and where it coalesces) and
/// [`poll_event`](Self::poll_event), then re-arms its timer at
/// [`poll_timeout`](Self::poll_timeout).
#[derive(Debug)]
pub struct HubSession {
    config: HubConfig,
    /// The cluster name from the client certificate: the only identity the session trusts.
    identity: String,
    session_id: String,
    phase: Phase,
    /// When any frame was last heard; silence past `heartbeat_timeout` from here closes.
    last_heard: Instant,
    /// When the last `Alive` was emitted, to keep that event to one per interval however often
    /// the agent's heartbeats arrive.
    last_alive: Option<Instant>,
    /// uid → what the agent holds or will hold once the frames already handed to the transport
    /// arrive: seeded from the hello, updated as work frames leave. It lets live changes that
    /// the agent already has be skipped, deletes of works it never got be dropped, and acks be
    /// judged current.
    delivered: HashMap<String, Delivered>,
    sync: Sync,
    /// Frames that jump the work queue: welcome, heartbeat echoes (they prove liveness and must
    /// not wait behind a backlog), tunnel requests and the final drain/goodbye.
    control: VecDeque<wire::HubFrame>,
    /// uid → highest status seq to acknowledge; coalesced because only the latest matters.
    status_acks: CoalescingQueue<String, u64>,
    /// uids whose release the driver recorded, to acknowledge; one entry per work.
    release_acks: CoalescingQueue<String, ()>,
    /// Work updates and deletes coalesced by uid, plus the sync marker.
    works: CoalescingQueue<Slot, Outgoing>,
    events: VecDeque<HubEvent>,
    /// A renewal was handed to the driver and not answered yet.
    renewing: bool,
    /// Chunks asked for whose answer has not been transmitted yet: the agent keeps at most
    /// [`CHUNK_WINDOW`] outstanding, so this (and the chunk bytes a session holds) is bounded.
    chunk_requests: HashSet<String>,
    /// Answers to chunk requests, sent after work frames: a large work's bytes go out only as
    /// fast as the agent asks for them, never ahead of liveness, acks or other works.
    chunks: VecDeque<wire::HubFrame>,
}

impl HubSession {
    /// A session for a connection that just authenticated as `identity` (the cluster name in
    /// its client certificate). `session_id` is the driver's unique id for it, sent in
    /// `Welcome` for logs on both ends. The session waits for the hello until
    /// `now + config.hello_timeout`.
    pub fn new(
        now: Instant,
        config: HubConfig,
        identity: impl Into<String>,
        session_id: impl Into<String>,
    ) -> Self {
        Self {
            config,
            identity: identity.into(),
            session_id: session_id.into(),
            phase: Phase::AwaitingHello {
                deadline: now + config.hello_timeout,
            },
            last_heard: now,
            last_alive: None,
            delivered: HashMap::new(),
            sync: Sync::NotStarted,
            control: VecDeque::new(),
            status_acks: CoalescingQueue::default(),
            release_acks: CoalescingQueue::default(),
            works: CoalescingQueue::default(),
            events: VecDeque::new(),
            renewing: false,
            chunk_requests: HashSet::new(),
            chunks: VecDeque::new(),
        }
    }

    /// The cluster name from the client certificate.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// The id sent in `Welcome`.
    pub fn session_id(&self) -> &str {
        &self.session_id
    }

    /// Whether the hello has been accepted and the session is not closed.
    pub fn is_established(&self) -> bool {
        self.phase == Phase::Established
    }

    /// Whether the initial sync has been fully handed to the transport (`SyncComplete` sent).
    pub fn is_synced(&self) -> bool {
        self.sync == Sync::Done
    }

    /// Whether the session is over. Frames may still wait in
    /// [`poll_transmit`](Self::poll_transmit) (the goodbye); send them, then end the stream.
    pub fn is_closed(&self) -> bool {
        self.phase == Phase::Closed
    }

    /// Distinct works waiting to be sent (for metrics: a growing number is a slow agent).
    pub fn pending_works(&self) -> usize {
        self.works.len() - usize::from(self.works.contains(&Slot::SyncComplete))
    }

    /// Handles one frame from the agent. Any frame counts as a sign of life.
    ///
    /// An `Err` means the frame broke the protocol and the session has closed itself: a
    /// `Goodbye` naming the problem is queued and [`HubEvent::Closed`] emitted; the error is
    /// for the driver's log and backoff. Frames after close are ignored.
    pub fn handle_frame(
        &mut self,
        now: Instant,
        frame: wire::AgentFrame,
    ) -> Result<(), ProtocolError> {
        if self.is_closed() {
            return Ok(());
        }
        self.last_heard = now;
        // A frame kind from a newer agent decodes as no frame: liveness only.
        let Some(frame) = frame.frame else {
            return Ok(());
        };
        match (self.phase, frame) {
            (Phase::AwaitingHello { .. }, agent_frame::Frame::Hello(hello)) => self.on_hello(hello),
            (_, agent_frame::Frame::Goodbye(goodbye)) => {
                self.close_with(CloseReason::PeerGoodbye(goodbye.reason), true);
                Ok(())
            }
            (Phase::AwaitingHello { .. }, other) => self.fail(ProtocolError::UnexpectedFrame {
                frame: agent_frame_name(&other),
                state: "waiting for hello",
            }),
            (Phase::Established, agent_frame::Frame::Hello(_)) => {
                self.fail(ProtocolError::UnexpectedFrame {
                    frame: "Hello",
                    state: "established",
                })
            }
            (Phase::Established, agent_frame::Frame::Heartbeat(hb)) => {
                self.queue_heartbeat_echo(hb.seq);
                if self
                    .last_alive
                    .is_none_or(|t| now >= t + self.config.heartbeat_interval)
                {
                    self.last_alive = Some(now);
                    self.events.push_back(HubEvent::Alive { at: now });
                }
                Ok(())
            }
            (Phase::Established, agent_frame::Frame::WorkAck(ack)) => {
                let current = self
                    .delivered
                    .get(&ack.uid)
                    .is_some_and(|d| d.generation == ack.generation);
                self.events.push_back(HubEvent::WorkAcked {
                    uid: ack.uid,
                    generation: ack.generation,
                    current,
                });
                Ok(())
            }
            (Phase::Established, agent_frame::Frame::WorkStatus(status)) => {
                self.events.push_back(HubEvent::StatusReported {
                    uid: status.uid,
                    generation: status.generation,
                    seq: status.seq,
                    status_json: status.status_json,
                });
                Ok(())
            }
            (Phase::Established, agent_frame::Frame::WorkReleased(released)) => {
                if let Err(detail) = check_uid(&released.uid) {
                    return self.fail(ProtocolError::InvalidFrame {
                        frame: "WorkReleased",
                        detail,
                    });
                }
                // The agent holds nothing of it any more: a later delete need not be sent.
                self.delivered.remove(&released.uid);
                self.events
                    .push_back(HubEvent::WorkReleased { uid: released.uid });
                Ok(())
            }
            (Phase::Established, agent_frame::Frame::ClusterInfo(info)) => {
                self.events
                    .push_back(HubEvent::ClusterInfoReported { info });
                Ok(())
            }
            (Phase::Established, agent_frame::Frame::RenewCertificate(renew)) => {
                if self.renewing {
                    // The first request is being answered; the agent sends one at a time, so
                    // a repeat is a retry of the same thing.
                    return Ok(());
                }
                if renew.csr_pem.len() > MAX_CSR_BYTES {
                    self.refuse_renewal(format!(
                        "certificate signing request of {} bytes exceeds the bound of \
                         {MAX_CSR_BYTES} bytes",
                        renew.csr_pem.len()
                    ));
                    return Ok(());
                }
                self.renewing = true;
                self.events.push_back(HubEvent::RenewalRequested {
                    csr_pem: renew.csr_pem,
                });
                Ok(())
            }
            (Phase::Established, agent_frame::Frame::ChunkRequest(request)) => {
                self.on_chunk_request(request)
            }
            (Phase::Closed, _) => Ok(()),
        }
    }

    /// Handles the timer armed from [`poll_timeout`](Self::poll_timeout): closes the session
    /// if the hello or the agent's heartbeats are overdue. Calling it early does nothing.
    pub fn handle_timeout(&mut self, now: Instant) {
        match self.phase {
            Phase::AwaitingHello { deadline } if now >= deadline => {
                self.close_with(
                    CloseReason::HandshakeTimeout {
                        waited: self.config.hello_timeout,
                    },
                    false,
                );
            }
            Phase::Established if now >= self.last_heard + self.config.heartbeat_timeout => {
                self.close_with(
                    CloseReason::HeartbeatTimeout {
                        silent_for: self.config.heartbeat_timeout,
                    },
                    false,
                );
            }
            _ => {}
        }
    }

    /// When to call [`handle_timeout`](Self::handle_timeout) next; `None` once closed.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.phase {
            Phase::AwaitingHello { deadline } => Some(deadline),
            Phase::Established => Some(self.last_heard + self.config.heartbeat_timeout),
            Phase::Closed => None,
        }
    }

    /// The next frame to send. Control frames (welcome, heartbeat echoes, tunnel requests)
    /// go first, then status acks, then work in the order each work was first queued. Work
    /// waits until [`begin_sync`](Self::begin_sync) has been called.
    pub fn poll_transmit(&mut self) -> Option<wire::HubFrame> {
        if let Some(frame) = self.control.pop_front() {
            return Some(frame);
        }
        if self.phase != Phase::Established {
            return None;
        }
        if let Some((uid, seq)) = self.status_acks.pop() {
            return Some(hub(hub_frame::Frame::StatusAck(wire::StatusAck {
                uid,
                seq,
            })));
        }
        if let Some((uid, ())) = self.release_acks.pop() {
            return Some(hub(hub_frame::Frame::ReleaseAck(wire::ReleaseAck { uid })));
        }
        if self.sync == Sync::NotStarted {
            return None;
        }
        let Some((_, outgoing)) = self.works.pop() else {
            let frame = self.chunks.pop_front()?;
            if let Some(
                hub_frame::Frame::Chunk(wire::Chunk { chunk_sha256, .. })
                | hub_frame::Frame::ChunkRefused(wire::ChunkRefused { chunk_sha256, .. }),
            ) = &frame.frame
            {
                self.chunk_requests.remove(chunk_sha256);
            }
            return Some(frame);
        };
        let frame = match outgoing {
            Outgoing::Update(update) => {
                self.delivered.insert(
                    update.uid.clone(),
                    Delivered {
                        generation: update.generation,
                        content_hash: update.content_hash.clone(),
                    },
                );
                hub_frame::Frame::WorkUpdate(update)
            }
            Outgoing::Delete(delete) => {
                self.delivered.remove(&delete.uid);
                hub_frame::Frame::WorkDelete(delete)
            }
            Outgoing::SyncComplete => {
                let sent = match self.sync {
                    Sync::Sending { sent } => sent,
                    Sync::NotStarted | Sync::Done => 0,
                };
                self.sync = Sync::Done;
                return Some(hub(hub_frame::Frame::SyncComplete(wire::SyncComplete {
                    sent,
                })));
            }
        };
        if let Sync::Sending { sent } = &mut self.sync {
            *sent = sent.saturating_add(1);
        }
        Some(hub(frame))
    }

    /// The next event for the driver, in the order they happened.
    pub fn poll_event(&mut self) -> Option<HubEvent> {
        self.events.pop_front()
    }

    /// Gives the session the cluster's whole desired state, once, after
    /// [`HubEvent::Established`]. Queues a `WorkUpdate` for every work the agent does not hold
    /// at that generation and content hash, a `WorkDelete` for every work it holds that is no
    /// longer desired, then `SyncComplete`; an agent that is up to date receives only
    /// `SyncComplete { sent: 0 }`.
    ///
    /// The snapshot may be taken after the `Established` event while live changes are already
    /// being passed to [`upsert_work`](Self::upsert_work) and
    /// [`delete_work`](Self::delete_work): a change queued before this call is taken to be
    /// newer than the snapshot (a pending delete stays; of two updates the higher generation
    /// wins). Ignored before the hello, after close, and when a sync has already begun.
    pub fn begin_sync(&mut self, desired: impl IntoIterator<Item = DesiredWork>) {
        if self.phase != Phase::Established || self.sync != Sync::NotStarted {
            return;
        }
        let mut wanted = HashSet::new();
        for work in desired {
            wanted.insert(work.uid.clone());
            self.queue_update(work, true);
        }
        let gone: Vec<String> = self
            .delivered
            .keys()
            .filter(|uid| !wanted.contains(*uid))
            .filter(|uid| !self.works.contains(&Slot::Work((*uid).clone())))
            .cloned()
            .collect();
        for uid in gone {
            // The hello carries only uids; the agent keys its cache by uid, so namespace and
            // name are left empty rather than guessed.
            self.works.put(
                Slot::Work(uid.clone()),
                Outgoing::Delete(wire::WorkDelete {
                    uid,
                    namespace: String::new(),
                    name: String::new(),
                }),
            );
        }
        self.sync = Sync::Sending { sent: 0 };
        self.works.put(Slot::SyncComplete, Outgoing::SyncComplete);
    }

    /// Queues the new desired state of one work (a live change). Skipped if the agent already
    /// has exactly this generation and content; coalesces with a pending frame for the same
    /// uid (a lower generation than the pending update is stale and dropped; an update
    /// replaces a pending delete). If the queue is full the session closes with
    /// [`CloseReason::QueueOverflow`]. Ignored before [`HubEvent::Established`] (the sync
    /// snapshot covers it) and after close.
    pub fn upsert_work(&mut self, work: DesiredWork) {
        if self.phase == Phase::Established {
            self.queue_update(work, false);
        }
    }

    /// Queues the removal of one work (a live change). A pending update for it is dropped; if
    /// the agent never received the work, nothing is sent. Same queue bound and lifecycle rules
    /// as [`upsert_work`](Self::upsert_work).
    pub fn delete_work(
        &mut self,
        uid: impl Into<String>,
        namespace: impl Into<String>,
        name: impl Into<String>,
    ) {
        if self.phase != Phase::Established {
            return;
        }
        let uid = uid.into();
        let key = Slot::Work(uid.clone());
        if !self.delivered.contains_key(&uid) {
            // The agent never got it (or its delete is already sent): drop any pending update.
            self.works.remove(&key);
            return;
        }
        if !self.works.contains(&key) && !self.has_room() {
            return self.overflow();
        }
        let delete = wire::WorkDelete {
            uid,
            namespace: namespace.into(),
            name: name.into(),
        };
        self.works.put(key, Outgoing::Delete(delete));
    }

    /// Acknowledges the agent's status for `uid` up to `seq` once the driver has stored it, so
    /// the agent can drop it from its outbox. Coalesced per uid (the highest seq wins).
    pub fn ack_status(&mut self, uid: impl Into<String>, seq: u64) {
        if self.phase != Phase::Established {
            return;
        }
        let uid = uid.into();
        let seq = self.status_acks.get(&uid).map_or(seq, |&s| s.max(seq));
        self.status_acks.put(uid, seq);
    }

    /// Acknowledges the agent's `WorkReleased` for `uid` once the driver has recorded it (the
    /// work's cleanup finalizer is gone, or the work is), so the agent can drop it from its
    /// outbox. Ignored unless established: the agent reports it again on its next session.
    pub fn ack_release(&mut self, uid: impl Into<String>) {
        if self.phase == Phase::Established {
            self.release_acks.put(uid.into(), ());
        }
    }

    /// Answers the outstanding [`HubEvent::ChunkRequested`] for `chunk_sha256` with its bytes
    /// (read from the store and checked against the digest by the driver). Ignored when no
    /// such request is outstanding (answered already, or the session closed).
    pub fn send_chunk(&mut self, uid: impl Into<String>, chunk_sha256: &str, data: Vec<u8>) {
        if !self.chunk_requests.contains(chunk_sha256) || self.is_closed() {
            return;
        }
        self.chunks
            .push_back(hub(hub_frame::Frame::Chunk(wire::Chunk {
                work_uid: uid.into(),
                chunk_sha256: chunk_sha256.to_string(),
                data,
            })));
    }

    /// Answers the outstanding [`HubEvent::ChunkRequested`] for `chunk_sha256` with why it
    /// cannot be served; the session continues. Ignored like [`send_chunk`](Self::send_chunk).
    pub fn refuse_chunk(
        &mut self,
        uid: impl Into<String>,
        chunk_sha256: &str,
        reason: impl Into<String>,
    ) {
        if !self.chunk_requests.contains(chunk_sha256) || self.is_closed() {
            return;
        }
        self.chunks
            .push_back(hub(hub_frame::Frame::ChunkRefused(wire::ChunkRefused {
                work_uid: uid.into(),
                chunk_sha256: chunk_sha256.to_string(),
                reason: reason.into(),
            })));
    }

    /// Asks the agent to open tunnel stream `id` (a kubectl request routed to this cluster).
    /// Ignored unless established.
    pub fn open_tunnel(&mut self, id: impl Into<String>) {
        if self.phase == Phase::Established {
            self.control
                .push_back(hub(hub_frame::Frame::OpenTunnel(wire::OpenTunnel {
                    id: id.into(),
                    // Every gateway of this version serves tunnels as plain HTTP/2 streams.
                    bytes: true,
                })));
        }
    }

    /// Answers the outstanding [`HubEvent::RenewalRequested`] with the signed certificate and
    /// the CA bundle to trust. Ignored unless established.
    pub fn issue_certificate(
        &mut self,
        certificate_pem: impl Into<String>,
        ca_bundle_pem: impl Into<String>,
    ) {
        if self.phase != Phase::Established {
            return;
        }
        self.renewing = false;
        self.control
            .push_back(hub(hub_frame::Frame::CertificateIssued(
                wire::CertificateIssued {
                    certificate_pem: certificate_pem.into(),
                    ca_bundle_pem: ca_bundle_pem.into(),
                },
            )));
    }

    /// Answers the outstanding [`HubEvent::RenewalRequested`] with a refusal naming the reason;
    /// the session continues. Ignored unless established.
    pub fn refuse_renewal(&mut self, reason: impl Into<String>) {
        if self.phase != Phase::Established {
            return;
        }
        self.renewing = false;
        self.control.push_back(hub(hub_frame::Frame::RenewalRefused(
            wire::RenewalRefused {
                reason: reason.into(),
            },
        )));
    }

    /// Tells the agent to trust these CA certificates for the hub from now on (after a CA
    /// rotation, or when its hello showed an older bundle). Ignored unless established.
    pub fn send_trust_bundle(&mut self, ca_bundle_pem: impl Into<String>) {
        if self.phase != Phase::Established {
            return;
        }
        self.control
            .push_back(hub(hub_frame::Frame::TrustBundle(wire::TrustBundle {
                ca_bundle_pem: ca_bundle_pem.into(),
            })));
    }

    /// Ends the session on purpose, telling the agent to come back after `retry_after` (which
    /// the gateway spreads across its agents). Queues `Drain` then `Goodbye`, drops pending
    /// work (the agent resumes it elsewhere) and emits [`HubEvent::Closed`] with
    /// [`CloseReason::Drained`]. Usable before the hello too, to refuse an agent during
    /// admission.
    pub fn drain(&mut self, retry_after: Duration, reason: impl Into<String>) {
        self.drain_to(retry_after, None, reason);
    }

    /// [`drain`](Self::drain), naming where the agent should go next: the advertised address
    /// of the gateway that owns its shard (this one does not). `None` is a plain drain (the
    /// owner is not known yet, as during a handover).
    pub fn redirect(
        &mut self,
        retry_after: Duration,
        address: Option<String>,
        reason: impl Into<String>,
    ) {
        self.drain_to(retry_after, address, reason);
    }

    fn drain_to(
        &mut self,
        retry_after: Duration,
        redirect: Option<String>,
        reason: impl Into<String>,
    ) {
        if self.is_closed() {
            return;
        }
        let reason = reason.into();
        self.close_with(
            CloseReason::Drained {
                retry_after,
                reason: reason.clone(),
            },
            false,
        );
        self.control
            .push_front(hub(hub_frame::Frame::Drain(wire::Drain {
                retry_after_ms: duration_ms(retry_after),
                reason,
                redirect: redirect.unwrap_or_default(),
            })));
    }

    /// Ends the session for a local reason (the cluster was denied or deleted, the gateway lost
    /// the shard): queues a `Goodbye` with it and emits [`HubEvent::Closed`].
    pub fn close(&mut self, reason: impl Into<String>) {
        self.close_with(CloseReason::Local(reason.into()), false);
    }

    /// Refuses the session at admission (before or after the hello): queues a `Goodbye` that
    /// carries `refusal`, so the agent can tell its operator what to do, and `reason` in words,
    /// and emits [`HubEvent::Closed`]. Also for a cluster revoked while its session runs.
    pub fn refuse(&mut self, refusal: wire::Refusal, reason: impl Into<String>) {
        self.close_with(
            CloseReason::Refused {
                refusal,
                reason: reason.into(),
            },
            false,
        );
    }

    fn on_chunk_request(&mut self, request: wire::ChunkRequest) -> Result<(), ProtocolError> {
        if !is_sha256_hex(&request.chunk_sha256) {
            return self.fail(ProtocolError::InvalidFrame {
                frame: "ChunkRequest",
                detail: "chunk_sha256 is not 64 lower-case hex digits".into(),
            });
        }
        if self.chunk_requests.contains(&request.chunk_sha256) {
            // Already being answered: one answer serves both.
            return Ok(());
        }
        if self.chunk_requests.len() >= CHUNK_WINDOW {
            return self.fail(ProtocolError::InvalidFrame {
                frame: "ChunkRequest",
                detail: format!("more than {CHUNK_WINDOW} chunk requests outstanding"),
            });
        }
        self.chunk_requests.insert(request.chunk_sha256.clone());
        self.events.push_back(HubEvent::ChunkRequested {
            uid: request.work_uid,
            chunk_sha256: request.chunk_sha256,
        });
        Ok(())
    }

    fn on_hello(&mut self, hello: wire::Hello) -> Result<(), ProtocolError> {
        if hello.protocol_version != PROTOCOL_VERSION {
            return self.fail(ProtocolError::ProtocolVersion {
                got: hello.protocol_version,
                ours: PROTOCOL_VERSION,
            });
        }
        if hello.cluster_name != self.identity {
            return self.fail(ProtocolError::IdentityMismatch {
                cert: self.identity.clone(),
                hello: hello.cluster_name,
            });
        }
        if let Some(detail) = hello.releasing.iter().find_map(|uid| check_uid(uid).err()) {
            return self.fail(ProtocolError::InvalidFrame {
                frame: "Hello",
                detail: format!("releasing: {detail}"),
            });
        }
        self.delivered = hello
            .held
            .iter()
            .map(|h| {
                let held = Delivered {
                    generation: h.generation,
                    content_hash: h.content_hash.clone(),
                };
                (h.uid.clone(), held)
            })
            .collect();
        self.phase = Phase::Established;
        self.control
            .push_back(hub(hub_frame::Frame::Welcome(wire::Welcome {
                protocol_version: PROTOCOL_VERSION,
                session_id: self.session_id.clone(),
                heartbeat_interval_ms: duration_ms(self.config.heartbeat_interval),
                heartbeat_timeout_ms: duration_ms(self.config.heartbeat_timeout),
            })));
        self.events.push_back(HubEvent::Established { hello });
        Ok(())
    }

    /// `from_snapshot`: the work comes from `begin_sync`, so a change already pending for its
    /// uid is newer and a pending delete must survive.
    fn queue_update(&mut self, work: DesiredWork, from_snapshot: bool) {
        let key = Slot::Work(work.uid.clone());
        let agent_has_it = self.delivered.get(&work.uid).is_some_and(|d| {
            d.generation == work.generation && d.content_hash == work.content_hash
        });
        match self.works.get(&key) {
            Some(Outgoing::Update(pending)) if work.generation < pending.generation => {}
            Some(Outgoing::Delete(_)) if from_snapshot => {}
            Some(_) if agent_has_it => {
                self.works.remove(&key);
            }
            Some(_) => self.works.put(key, Outgoing::Update(work)),
            None if agent_has_it => {}
            None if !from_snapshot && !self.has_room() => self.overflow(),
            None => self.works.put(key, Outgoing::Update(work)),
        }
    }

    fn has_room(&self) -> bool {
        self.pending_works() < self.config.max_pending_works
    }

    fn overflow(&mut self) {
        self.close_with(
            CloseReason::QueueOverflow {
                limit: self.config.max_pending_works,
            },
            false,
        );
    }

    fn queue_heartbeat_echo(&mut self, seq: u64) {
        // One echo waiting is enough: a newer seq proves as much as the older one.
        for frame in &mut self.control {
            if let Some(hub_frame::Frame::Heartbeat(hb)) = &mut frame.frame {
                hb.seq = seq;
                return;
            }
        }
        self.control
            .push_back(hub(hub_frame::Frame::Heartbeat(wire::Heartbeat { seq })));
    }

    fn fail(&mut self, error: ProtocolError) -> Result<(), ProtocolError> {
        self.close_with(error.clone().into(), false);
        Err(error)
    }

    fn close_with(&mut self, reason: CloseReason, by_peer: bool) {
        if self.is_closed() {
            return;
        }
        self.phase = Phase::Closed;
        // Pending work is dropped, not flushed: the next session resumes from what the agent
        // holds, so nothing is lost and a closing session sends no more than it must.
        self.control.clear();
        self.status_acks.clear();
        self.release_acks.clear();
        self.works.clear();
        self.chunks.clear();
        self.chunk_requests.clear();
        if !by_peer {
            self.control
                .push_back(hub(hub_frame::Frame::Goodbye(reason.goodbye())));
        }
        self.events.push_back(HubEvent::Closed { reason, by_peer });
    }
}

fn hub(frame: hub_frame::Frame) -> wire::HubFrame {
    wire::HubFrame { frame: Some(frame) }
}

fn agent_frame_name(frame: &agent_frame::Frame) -> &'static str {
    match frame {
        agent_frame::Frame::Hello(_) => "Hello",
        agent_frame::Frame::Heartbeat(_) => "Heartbeat",
        agent_frame::Frame::WorkAck(_) => "WorkAck",
        agent_frame::Frame::WorkStatus(_) => "WorkStatus",
        agent_frame::Frame::Goodbye(_) => "Goodbye",
        agent_frame::Frame::RenewCertificate(_) => "RenewCertificate",
        agent_frame::Frame::ClusterInfo(_) => "ClusterInfo",
        agent_frame::Frame::ChunkRequest(_) => "ChunkRequest",
        agent_frame::Frame::WorkReleased(_) => "WorkReleased",
    }
}

/// A work uid as a frame may carry it: present and bounded.
fn check_uid(uid: &str) -> Result<(), String> {
    if uid.is_empty() {
        return Err("a work uid is empty".into());
    }
    if uid.len() > MAX_UID_BYTES {
        return Err(format!(
            "a work uid of {} bytes exceeds the bound of {MAX_UID_BYTES} bytes",
            uid.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::content::sha256_hex;

    fn established() -> (Instant, HubSession) {
        let now = Instant::now();
        let mut session = HubSession::new(now, HubConfig::default(), "c1", "s1");
        let hello = agent_frame::Frame::Hello(wire::Hello {
            protocol_version: PROTOCOL_VERSION,
            cluster_name: "c1".into(),
            ..wire::Hello::default()
        });
        session
            .handle_frame(now, wire::AgentFrame { frame: Some(hello) })
            .unwrap();
        session.begin_sync(Vec::new());
        while session.poll_transmit().is_some() {}
        while session.poll_event().is_some() {}
        (now, session)
    }

    fn request(sha: &str) -> wire::AgentFrame {
        wire::AgentFrame {
            frame: Some(agent_frame::Frame::ChunkRequest(wire::ChunkRequest {
                work_uid: "w".into(),
                chunk_sha256: sha.into(),
            })),
        }
    }

    #[test]
    fn chunks_are_served_as_asked_and_no_more_than_the_window_is_outstanding() {
        let (now, mut session) = established();
        let shas: Vec<String> = (0..3u8).map(|i| sha256_hex(&[i])).collect();
        session.handle_frame(now, request(&shas[0])).unwrap();
        session.handle_frame(now, request(&shas[1])).unwrap();
        assert!(matches!(
            session.poll_event(),
            Some(HubEvent::ChunkRequested { .. })
        ));
        // A third before either is answered breaks the window: the session closes.
        let err = session.handle_frame(now, request(&shas[2])).unwrap_err();
        assert!(err.to_string().contains("outstanding"), "{err}");
        assert!(session.is_closed());
    }

    #[test]
    fn an_answer_frees_its_slot_once_sent_and_heartbeats_go_first() {
        let (now, mut session) = established();
        let shas: Vec<String> = (0..3u8).map(|i| sha256_hex(&[i])).collect();
        session.handle_frame(now, request(&shas[0])).unwrap();
        session.handle_frame(now, request(&shas[1])).unwrap();
        session.send_chunk("w", &shas[0], vec![0]);
        let heartbeat = agent_frame::Frame::Heartbeat(wire::Heartbeat { seq: 7 });
        session
            .handle_frame(
                now,
                wire::AgentFrame {
                    frame: Some(heartbeat),
                },
            )
            .unwrap();
        assert!(matches!(
            session.poll_transmit().and_then(|f| f.frame),
            Some(hub_frame::Frame::Heartbeat(_))
        ));
        assert!(matches!(
            session.poll_transmit().and_then(|f| f.frame),
            Some(hub_frame::Frame::Chunk(_))
        ));
        session.handle_frame(now, request(&shas[2])).unwrap();
        assert!(!session.is_closed());
        // An answer for a chunk nobody asked for is not sent.
        session.send_chunk("w", &sha256_hex(b"other"), vec![1]);
        assert!(session.poll_transmit().is_none());
    }

    /// Frames both ways until both are quiet; the events each side emitted meanwhile.
    fn pump(
        now: Instant,
        agent: &mut crate::session::AgentSession,
        hub: &mut HubSession,
    ) -> (Vec<crate::session::AgentEvent>, Vec<HubEvent>) {
        let (mut agent_events, mut hub_events) = (Vec::new(), Vec::new());
        loop {
            let mut moved = false;
            while let Some(frame) = agent.poll_transmit() {
                hub.handle_frame(now, frame).unwrap();
                moved = true;
            }
            while let Some(frame) = hub.poll_transmit() {
                agent.handle_frame(now, frame).unwrap();
                moved = true;
            }
            hub_events.extend(std::iter::from_fn(|| hub.poll_event()));
            agent_events.extend(std::iter::from_fn(|| agent.poll_event()));
            if !moved {
                return (agent_events, hub_events);
            }
        }
    }

    #[test]
    fn a_release_reaches_the_hub_its_ack_comes_back_and_no_delete_follows() {
        use crate::session::{AgentConfig, AgentEvent, AgentSession};
        let now = Instant::now();
        let held = vec![wire::HeldWork {
            uid: "applied".into(),
            generation: 1,
            content_hash: "h".into(),
        }];
        let config = AgentConfig {
            cluster_name: "c1".into(),
            agent_version: "test".into(),
            kubernetes_version: String::new(),
            claims: Vec::new(),
            welcome_timeout: Duration::from_secs(15),
        };
        let mut agent =
            AgentSession::new(now, config, held).with_releasing(vec!["removing".into()]);
        let mut hub = HubSession::new(now, HubConfig::default(), "c1", "s1");
        let (_, events) = pump(now, &mut agent, &mut hub);
        let Some(HubEvent::Established { hello }) = events.first() else {
            panic!("{events:?}");
        };
        assert_eq!(
            hello.releasing,
            ["removing"],
            "the hub hears what is being removed"
        );
        let desired = DesiredWork {
            uid: "applied".into(),
            generation: 1,
            content_hash: "h".into(),
            ..DesiredWork::default()
        };
        hub.begin_sync(vec![desired]);
        pump(now, &mut agent, &mut hub);

        agent.release_work("applied");
        let (_, events) = pump(now, &mut agent, &mut hub);
        assert_eq!(
            events,
            [HubEvent::WorkReleased {
                uid: "applied".into()
            }]
        );
        // The agent holds nothing of it now: a deletion arriving late sends nothing.
        hub.delete_work("applied", "c1", "w");
        assert!(hub.poll_transmit().is_none());
        hub.ack_release("applied");
        let (events, _) = pump(now, &mut agent, &mut hub);
        assert_eq!(
            events,
            [AgentEvent::ReleaseAcked {
                uid: "applied".into()
            }]
        );
    }

    #[test]
    fn a_release_without_a_bounded_uid_closes_the_session() {
        for uid in [String::new(), "x".repeat(MAX_UID_BYTES + 1)] {
            let (now, mut session) = established();
            let frame = wire::AgentFrame {
                frame: Some(agent_frame::Frame::WorkReleased(wire::WorkReleased { uid })),
            };
            let err = session.handle_frame(now, frame).unwrap_err();
            assert!(err.to_string().contains("WorkReleased"), "{err}");
            assert!(session.is_closed());
        }
    }

    #[test]
    fn a_request_that_is_not_a_digest_is_refused() {
        let (now, mut session) = established();
        assert!(session.handle_frame(now, request("../etc")).is_err());
    }
}
