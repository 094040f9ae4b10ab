//! The agent's side of its one session.

use std::collections::VecDeque;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use super::error::{CloseReason, ProtocolError};
use super::fetch::{ContentFetch, Received};
use super::queue::CoalescingQueue;
use crate::PROTOCOL_VERSION;
use crate::api::content::{CHUNK_BYTES, ContentRef, is_sha256_hex, sha256_hex};
use crate::wire::{self, agent_frame, hub_frame};

/// Default for [`AgentConfig::welcome_timeout`].
pub const DEFAULT_WELCOME_TIMEOUT: Duration = Duration::from_secs(15);

/// Who the agent is, as it tells the hub in its hello.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentConfig {
    /// The cluster this agent serves; the hub refuses the session unless it equals the name in
    /// the agent's client certificate.
    pub cluster_name: String,
    /// This agent's build version, shown on the hub.
    pub agent_version: String,
    /// The spoke apiserver's gitVersion (ManagedCluster status.version).
    pub kubernetes_version: String,
    /// The spoke's cluster claims, reported on every hello.
    pub claims: Vec<wire::ClusterClaim>,
    /// How long to wait for the hub's welcome before giving up on this connection. Until the
    /// welcome the agent does not know the hub's heartbeat timeout, so this bounds the wait for
    /// a gateway that accepted the stream but never answers.
    pub welcome_timeout: Duration,
}

/// What the agent's driver must act on, from [`AgentSession::poll_event`].
#[derive(Debug, Clone, PartialEq)]
pub enum AgentEvent {
    /// The hub accepted the hello. Desired state follows, then [`AgentEvent::Synced`]. A
    /// driver resets its reconnect backoff's stable-period clock here
    /// ([`Backoff::connected`](super::Backoff::connected)) and re-sends its unacknowledged
    /// status outbox with [`AgentSession::report_status`].
    Established {
        /// The hub's id for this session, for logs.
        session_id: String,
        /// How often this side sends heartbeats.
        heartbeat_interval: Duration,
        /// Silence longer than this ends the session on both ends.
        heartbeat_timeout: Duration,
    },
    /// New desired state for one work. The driver stores it durably, then calls
    /// [`AgentSession::ack_work`], then applies it.
    WorkReceived {
        /// The work, as the hub sent it.
        work: wire::WorkUpdate,
    },
    /// New desired state for a large work, whose manifests are content in chunks: the driver
    /// records the transfer in its cache (so the chunks it stores are kept) and answers with
    /// the chunks the cache does not hold, [`AgentSession::content_missing`]. The work itself
    /// follows as [`AgentEvent::ContentHeld`] once every chunk is durable.
    ContentWanted {
        /// The work's uid.
        uid: String,
        /// Its namespace, for logs.
        namespace: String,
        /// Its name, for logs.
        name: String,
        /// The content its manifests are.
        content: ContentRef,
        /// Which transfer of the work this is: pass it back with the answer.
        transfer: u64,
    },
    /// Every chunk of a large work's content is durable: store the work, then ack it, as for
    /// [`AgentEvent::WorkReceived`].
    ContentHeld {
        /// The work, as the hub sent it.
        work: wire::WorkUpdate,
    },
    /// A chunk the session asked for arrived, and its bytes hash to its digest (a chunk that
    /// does not closes the session). The driver stores it durably and says so,
    /// [`AgentSession::chunk_stored`] (or [`AgentSession::chunk_not_stored`]).
    ChunkReceived {
        /// Hex SHA-256 of the chunk.
        chunk_sha256: String,
        /// Its bytes, at most [`CHUNK_BYTES`].
        data: Vec<u8>,
    },
    /// The hub cannot serve a chunk asked for in `uid`'s name. The session asks for it again
    /// after `retry_in` if a transfer still misses it; the other chunks keep coming meanwhile.
    ChunkRefused {
        /// The work named in the request.
        uid: String,
        /// The chunk.
        chunk_sha256: String,
        /// Why, in the hub's words.
        reason: String,
        /// When the chunk is asked for again; `None` when no transfer misses it any more (its
        /// work was replaced or deleted).
        retry_in: Option<Duration>,
    },
    /// The work is gone from the hub: remove it (honouring its deleteOption). Keyed by uid;
    /// `namespace` and `name` are empty when the hub learned of the work only from the hello.
    WorkDeleted {
        /// The work's uid.
        uid: String,
        /// Its namespace, if the hub knew it.
        namespace: String,
        /// Its name, if the hub knew it.
        name: String,
    },
    /// Everything that differed at hello time has arrived: the local cache now matches the
    /// hub's desired state (as of the hello), so works absent from it can be treated as gone.
    Synced {
        /// How many updates and deletes the sync sent.
        sent: u32,
    },
    /// The hub stored this work's status up to `seq`: drop it from the outbox.
    StatusAcked {
        /// The work's uid.
        uid: String,
        /// The highest status seq stored.
        seq: u64,
    },
    /// The hub recorded the release of this work (see [`AgentSession::release_work`]): drop it
    /// from the release outbox.
    ReleaseAcked {
        /// The work's uid.
        uid: String,
    },
    /// Time to renew the client certificate (see [`AgentSession::set_certificate_validity`]):
    /// the driver makes a new key and a signing request for it, off its loop, and passes the
    /// request to [`AgentSession::renew_certificate`] (or reports
    /// [`AgentSession::renewal_failed`]). Emitted once per due time, only while established.
    RenewalDue,
    /// The hub signed the certificate asked for with [`AgentSession::renew_certificate`]. The
    /// driver stores it (with the key it made for the request) durably and uses it from the
    /// next connection on, then tells the session the new validity
    /// ([`AgentSession::set_certificate_validity`]), or [`AgentSession::renewal_failed`] if it
    /// could not store it. The current session carries on with the current certificate.
    CertificateIssued {
        /// PEM client certificate for the key of the request.
        certificate_pem: String,
        /// PEM CA certificates to trust for the hub from now on.
        ca_bundle_pem: String,
    },
    /// The hub refused the renewal; the current certificate stays. The session schedules the
    /// next attempt itself (a quarter of the remaining lifetime, between
    /// [`RENEWAL_RETRY_MIN`] and [`RENEWAL_RETRY_MAX`]); the driver logs the reason.
    RenewalRefused {
        /// Why, in the hub's words.
        reason: String,
    },
    /// The hub's CA bundle changed (a CA rotation): trust these CAs for the hub from now on,
    /// stored durably, for the next connection.
    TrustBundleUpdated {
        /// PEM CA certificates.
        ca_bundle_pem: String,
    },
    /// The hub asks for tunnel stream `id` to be opened (a kubectl request).
    TunnelRequested {
        /// The tunnel id to name when opening the tunnel stream.
        id: String,
        /// Open it as a plain HTTP/2 stream (`TunnelBytes`) rather than a `Tunnel` call.
        bytes: bool,
    },
    /// The hub is draining this session: reconnect after `retry_after` (use it as the
    /// `retry_after` of [`Backoff::next_delay`](super::Backoff::next_delay)). Followed by
    /// [`AgentEvent::Closed`].
    Drained {
        /// How long to wait before reconnecting, as the hub asked.
        retry_after: Duration,
        /// Why the hub drained.
        reason: String,
        /// The address of the gateway that owns this cluster's shard, when the one reached
        /// does not: dial it next instead of the configured address.
        redirect: Option<String>,
    },
    /// The session is over. The driver sends what [`AgentSession::poll_transmit`] still yields
    /// (a `Goodbye` if this side closed), ends the stream and reconnects after its backoff.
    Closed {
        /// Why.
        reason: CloseReason,
        /// Whether the hub ended it (goodbye or drain).
        by_peer: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    AwaitingWelcome {
        deadline: Instant,
    },
    Established {
        interval: Duration,
        timeout: Duration,
        next_heartbeat: Instant,
    },
    Closed,
}

/// Agent frames coalesce per work and kind: only the newest ack and the newest status matter.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Ack(String),
    Status(String),
    /// What the agent knows about its spoke: only the latest report matters.
    ClusterInfo,
    /// A request for the chunk with this digest.
    Chunk(String),
    /// A work released from the spoke.
    Release(String),
}

/// The agent's side of its session: a sans-IO state machine.
///
/// Created when the stream opens, with the hello already queued. The driver loop is the same
/// as for [`HubSession`](super::HubSession): feed frames and timer expiries in, drain
/// [`poll_transmit`](Self::poll_transmit) and [`poll_event`](Self::poll_event), re-arm the
/// timer at [`poll_timeout`](Self::poll_timeout).
#[derive(Debug)]
pub struct AgentSession {
    welcome_timeout: Duration,
    phase: Phase,
    /// When any frame was last heard from the hub; silence past the hub's heartbeat timeout
    /// from here closes the session.
    last_heard: Instant,
    /// Sequence number of the last heartbeat sent; the hub echoes it back.
    heartbeat_seq: u64,
    /// Hello, heartbeats and goodbye: sent before acks and status so that liveness never
    /// waits behind a status backlog.
    control: VecDeque<wire::AgentFrame>,
    /// Work acks and statuses, coalesced per work (the latest generation / seq wins).
    data: CoalescingQueue<Key, agent_frame::Frame>,
    events: VecDeque<AgentEvent>,
    /// Where certificate renewal stands; see [`Renewal`].
    renewal: Renewal,
    /// Large works' content: transfers under way and the chunk requests they make.
    content: ContentFetch,
}

/// Shortest time between two renewals: however short-lived a certificate, never back to back.
pub const RENEWAL_MIN_INTERVAL: Duration = Duration::from_secs(1);
/// Shortest wait before asking again after a refused or failed renewal.
pub const RENEWAL_RETRY_MIN: Duration = Duration::from_secs(1);
/// Longest wait before asking again after a refused or failed renewal.
pub const RENEWAL_RETRY_MAX: Duration = Duration::from_secs(30);

/// Certificate renewal, in monotonic time: the driver gives the certificate's validity in wall
/// time once ([`AgentSession::set_certificate_validity`]), the session turns it into instants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Renewal {
    /// No validity given (a development certificate without one never renews).
    Unscheduled,
    /// [`AgentEvent::RenewalDue`] at `due`; the certificate expires at `expires`.
    Scheduled { due: Instant, expires: Instant },
    /// `RenewalDue` was emitted; the driver is making the request.
    Preparing { expires: Instant },
    /// `RenewCertificate` was sent and neither `CertificateIssued` nor `RenewalRefused` has
    /// answered it: at most one request is outstanding per session. `expires` is unknown for
    /// a request made without a schedule (a driver renewing on demand).
    Requested { expires: Option<Instant> },
    /// A certificate arrived; the driver is storing it and will give its validity.
    Storing { expires: Option<Instant> },
}

impl Renewal {
    fn expires(&self) -> Option<Instant> {
        match *self {
            Renewal::Unscheduled => None,
            Renewal::Scheduled { expires, .. } | Renewal::Preparing { expires } => Some(expires),
            Renewal::Requested { expires } | Renewal::Storing { expires } => expires,
        }
    }
}

/// How long to wait before asking again: a quarter of what is left of the certificate's life,
/// so a short-lived certificate still gets several tries before it expires, bounded.
fn renewal_retry(now: Instant, expires: Option<Instant>) -> Duration {
    let left = expires.map_or(RENEWAL_RETRY_MAX, |e| e.saturating_duration_since(now));
    (left / 4).clamp(RENEWAL_RETRY_MIN, RENEWAL_RETRY_MAX)
}

impl AgentSession {
    /// A session on a freshly opened stream. Queues the hello with [`PROTOCOL_VERSION`], the
    /// config's identity and facts, and `held`: every work in the durable cache with the
    /// generation and content hash it holds, so the hub sends only what differs.
    pub fn new(now: Instant, config: AgentConfig, held: Vec<wire::HeldWork>) -> Self {
        let hello = wire::Hello {
            protocol_version: PROTOCOL_VERSION,
            cluster_name: config.cluster_name,
            agent_version: config.agent_version,
            held,
            claims: config.claims,
            kubernetes_version: config.kubernetes_version,
            ca_bundle_sha256: String::new(),
            releasing: Vec::new(),
        };
        Self {
            welcome_timeout: config.welcome_timeout,
            phase: Phase::AwaitingWelcome {
                deadline: now + config.welcome_timeout,
            },
            last_heard: now,
            heartbeat_seq: 0,
            control: VecDeque::from([agent(agent_frame::Frame::Hello(hello))]),
            data: CoalescingQueue::default(),
            events: VecDeque::new(),
            renewal: Renewal::Unscheduled,
            content: ContentFetch::default(),
        }
    }

    /// Tells the session the validity of the certificate the agent holds (at start, and after
    /// storing a renewed one): it emits [`AgentEvent::RenewalDue`] at [`renew_at`] of it, never
    /// sooner than [`RENEWAL_MIN_INTERVAL`] from `now`. `wall_now` is the wall clock at `now`;
    /// only the differences of wall times are used, so the session itself reads no clock.
    ///
    /// [`renew_at`]: super::renew_at
    pub fn set_certificate_validity(
        &mut self,
        now: Instant,
        wall_now: SystemTime,
        not_before: SystemTime,
        not_after: SystemTime,
    ) {
        let until = |at: SystemTime| at.duration_since(wall_now).unwrap_or(Duration::ZERO);
        let due = now + until(super::renew_at(not_before, not_after));
        let due = due.max(now + RENEWAL_MIN_INTERVAL);
        self.renewal = Renewal::Scheduled {
            due,
            expires: now + until(not_after),
        };
    }

    /// The driver could not make a renewal request, or could not store the certificate the hub
    /// issued: try again after the usual retry delay.
    pub fn renewal_failed(&mut self, now: Instant) {
        let expires = self.renewal.expires();
        if let Some(expires) = expires {
            self.renewal = Renewal::Scheduled {
                due: now + renewal_retry(now, Some(expires)),
                expires,
            };
        }
    }

    /// Adds the hex SHA-256 of the CA bundle the agent trusts to the queued hello, so that the
    /// hub sends its bundle only when it differs. Call it right after [`new`](Self::new), before
    /// the first [`poll_transmit`](Self::poll_transmit); later it does nothing.
    pub fn with_ca_bundle_sha256(mut self, sha256: impl Into<String>) -> Self {
        if let Some(agent_frame::Frame::Hello(hello)) = self
            .control
            .front_mut()
            .and_then(|frame| frame.frame.as_mut())
        {
            hello.ca_bundle_sha256 = sha256.into();
        }
        self
    }

    /// Adds the works being removed from the spoke (tombstones, and releases the hub has not
    /// acknowledged) to the queued hello, so that the hub keeps their cleanup finalizers
    /// instead of taking them for works this agent never had. Call it right after
    /// [`new`](Self::new), before the first [`poll_transmit`](Self::poll_transmit); later it
    /// does nothing.
    pub fn with_releasing(mut self, uids: Vec<String>) -> Self {
        if let Some(agent_frame::Frame::Hello(hello)) = self
            .control
            .front_mut()
            .and_then(|frame| frame.frame.as_mut())
        {
            hello.releasing = uids;
        }
        self
    }

    /// Asks the hub for a certificate for a new key, over this session (certificate rotation).
    /// `csr_pem` is a PKCS#10 request for a key made on the spoke. Returns `false` (and sends
    /// nothing) unless the session is established and no other request is outstanding; the
    /// answer arrives as [`AgentEvent::CertificateIssued`] or [`AgentEvent::RenewalRefused`].
    pub fn renew_certificate(&mut self, csr_pem: impl Into<String>) -> bool {
        if !self.is_established() || self.is_renewing() {
            return false;
        }
        self.renewal = Renewal::Requested {
            expires: self.renewal.expires(),
        };
        self.control
            .push_back(agent(agent_frame::Frame::RenewCertificate(
                wire::RenewCertificate {
                    csr_pem: csr_pem.into(),
                },
            )));
        true
    }

    /// Whether a renewal request is waiting for the hub's answer.
    pub fn is_renewing(&self) -> bool {
        matches!(self.renewal, Renewal::Requested { .. })
    }

    /// Whether the welcome has arrived and the session is not closed.
    pub fn is_established(&self) -> bool {
        matches!(self.phase, Phase::Established { .. })
    }

    /// Whether the session is over. Frames may still wait in
    /// [`poll_transmit`](Self::poll_transmit) (the goodbye); send them, then end the stream.
    pub fn is_closed(&self) -> bool {
        self.phase == Phase::Closed
    }

    /// Handles one frame from the hub. Any frame counts as a sign of life.
    ///
    /// An `Err` means the frame broke the protocol and the session has closed itself (goodbye
    /// queued, [`AgentEvent::Closed`] emitted); the error says whether retrying can help.
    /// Frames after close are ignored.
    pub fn handle_frame(
        &mut self,
        now: Instant,
        frame: wire::HubFrame,
    ) -> Result<(), ProtocolError> {
        if self.is_closed() {
            return Ok(());
        }
        self.last_heard = now;
        // A frame kind from a newer hub decodes as no frame: liveness only.
        let Some(frame) = frame.frame else {
            return Ok(());
        };
        let established = self.is_established();
        match frame {
            hub_frame::Frame::Welcome(welcome) if !established => self.on_welcome(now, welcome),
            hub_frame::Frame::Drain(drain) => {
                let retry_after = Duration::from_millis(drain.retry_after_ms.into());
                self.events.push_back(AgentEvent::Drained {
                    retry_after,
                    reason: drain.reason.clone(),
                    redirect: Some(drain.redirect).filter(|a| !a.is_empty()),
                });
                let reason = CloseReason::Drained {
                    retry_after,
                    reason: drain.reason,
                };
                self.close_with(reason, true);
                Ok(())
            }
            hub_frame::Frame::Goodbye(goodbye) => {
                let reason = match goodbye.refusal() {
                    wire::Refusal::Unspecified => CloseReason::PeerGoodbye(goodbye.reason),
                    refusal => CloseReason::Refused {
                        refusal,
                        reason: goodbye.reason,
                    },
                };
                self.close_with(reason, true);
                Ok(())
            }
            other if !established => self.fail(ProtocolError::UnexpectedFrame {
                frame: hub_frame_name(&other),
                state: "waiting for welcome",
            }),
            hub_frame::Frame::Welcome(_) => self.fail(ProtocolError::UnexpectedFrame {
                frame: "Welcome",
                state: "established",
            }),
            hub_frame::Frame::Heartbeat(_) => Ok(()),
            hub_frame::Frame::WorkUpdate(work) => {
                let (namespace, name) = (work.namespace.clone(), work.name.clone());
                let event = match self.content.work_received(work) {
                    Received::Store(work) => AgentEvent::WorkReceived { work },
                    Received::Record {
                        uid,
                        content,
                        transfer,
                    } => AgentEvent::ContentWanted {
                        uid,
                        namespace,
                        name,
                        content,
                        transfer,
                    },
                };
                self.events.push_back(event);
                Ok(())
            }
            hub_frame::Frame::WorkDelete(delete) => {
                self.content.work_deleted(&delete.uid);
                self.events.push_back(AgentEvent::WorkDeleted {
                    uid: delete.uid,
                    namespace: delete.namespace,
                    name: delete.name,
                });
                Ok(())
            }
            hub_frame::Frame::SyncComplete(sync) => {
                self.events
                    .push_back(AgentEvent::Synced { sent: sync.sent });
                Ok(())
            }
            hub_frame::Frame::ReleaseAck(ack) => {
                self.events
                    .push_back(AgentEvent::ReleaseAcked { uid: ack.uid });
                Ok(())
            }
            hub_frame::Frame::StatusAck(ack) => {
                self.events.push_back(AgentEvent::StatusAcked {
                    uid: ack.uid,
                    seq: ack.seq,
                });
                Ok(())
            }
            hub_frame::Frame::OpenTunnel(open) => {
                self.events.push_back(AgentEvent::TunnelRequested {
                    id: open.id,
                    bytes: open.bytes,
                });
                Ok(())
            }
            hub_frame::Frame::CertificateIssued(_) if !self.is_renewing() => {
                self.fail(ProtocolError::UnexpectedFrame {
                    frame: "CertificateIssued",
                    state: "no renewal requested",
                })
            }
            hub_frame::Frame::CertificateIssued(issued) => {
                self.renewal = Renewal::Storing {
                    expires: self.renewal.expires(),
                };
                if issued.certificate_pem.is_empty() {
                    return self.fail(ProtocolError::InvalidFrame {
                        frame: "CertificateIssued",
                        detail: "no certificate".to_string(),
                    });
                }
                self.events.push_back(AgentEvent::CertificateIssued {
                    certificate_pem: issued.certificate_pem,
                    ca_bundle_pem: issued.ca_bundle_pem,
                });
                Ok(())
            }
            hub_frame::Frame::RenewalRefused(refused) => {
                if self.is_renewing() {
                    let expires = self.renewal.expires();
                    self.renewal = match expires {
                        Some(expires) => Renewal::Scheduled {
                            due: now + renewal_retry(now, Some(expires)),
                            expires,
                        },
                        None => Renewal::Unscheduled,
                    };
                }
                self.events.push_back(AgentEvent::RenewalRefused {
                    reason: refused.reason,
                });
                Ok(())
            }
            hub_frame::Frame::TrustBundle(bundle) => {
                self.events.push_back(AgentEvent::TrustBundleUpdated {
                    ca_bundle_pem: bundle.ca_bundle_pem,
                });
                Ok(())
            }
            hub_frame::Frame::Chunk(chunk) => self.on_chunk(chunk),
            hub_frame::Frame::ChunkRefused(refused) => {
                if self.content.is_in_flight(&refused.chunk_sha256) {
                    let retry_in = self.content.refused(now, &refused.chunk_sha256);
                    self.events.push_back(AgentEvent::ChunkRefused {
                        uid: refused.work_uid,
                        chunk_sha256: refused.chunk_sha256,
                        reason: refused.reason,
                        retry_in,
                    });
                    self.request_chunks();
                }
                Ok(())
            }
        }
    }

    /// Answers [`AgentEvent::ContentWanted`]: transfer `transfer` of `uid` is recorded and the
    /// cache lacks `missing`. Those chunks are asked for, at most
    /// [`CHUNK_WINDOW`](super::CHUNK_WINDOW) requests at a time, each once however many works
    /// miss it; each arrives as [`AgentEvent::ChunkReceived`]. With nothing missing the work
    /// is ready at once ([`AgentEvent::ContentHeld`]). Returns whether the transfer is the
    /// work's latest: the answer for one replaced or deleted since is not used. Ignored after
    /// close (the next session's sync sends the work again).
    pub fn content_missing(&mut self, uid: &str, transfer: u64, missing: Vec<String>) -> bool {
        if self.is_closed() {
            return false;
        }
        let latest = self.content.is_latest(uid, transfer);
        if let Some(work) = self.content.recorded(uid, transfer, missing) {
            self.events.push_back(AgentEvent::ContentHeld { work });
        }
        self.request_chunks();
        latest
    }

    /// The driver could not record transfer `transfer` of `uid`: it is given up for this
    /// session. The work is not acked, so the next session's sync sends it again.
    pub fn content_not_recorded(&mut self, uid: &str, transfer: u64) {
        self.content.not_recorded(uid, transfer);
    }

    /// A chunk from [`AgentEvent::ChunkReceived`] is durable: works whose content it completes
    /// follow as [`AgentEvent::ContentHeld`].
    pub fn chunk_stored(&mut self, chunk_sha256: &str) {
        if self.is_closed() {
            return;
        }
        for work in self.content.stored(chunk_sha256) {
            self.events.push_back(AgentEvent::ContentHeld { work });
        }
    }

    /// A chunk from [`AgentEvent::ChunkReceived`] could not be stored: if a transfer still
    /// misses it, it is asked for again after a delay, returned.
    pub fn chunk_not_stored(&mut self, now: Instant, chunk_sha256: &str) -> Option<Duration> {
        if self.is_closed() {
            return None;
        }
        self.content.not_stored(now, chunk_sha256)
    }

    /// Chunks the transfers under way miss, asked for or not.
    pub fn chunks_missing(&self) -> usize {
        self.content.missing()
    }

    /// The works the hub sent in this session, by uid: after [`AgentEvent::Synced`], a transfer
    /// the cache recorded for any other work (cut off before a restart, its work deleted on
    /// the hub meanwhile) can be given up.
    pub fn works_received(&self) -> Vec<String> {
        self.content.received()
    }

    fn request_chunks(&mut self) {
        while let Some((uid, sha)) = self.content.next_request() {
            self.data.put(
                Key::Chunk(sha.clone()),
                agent_frame::Frame::ChunkRequest(wire::ChunkRequest {
                    work_uid: uid,
                    chunk_sha256: sha,
                }),
            );
        }
    }

    fn on_chunk(&mut self, chunk: wire::Chunk) -> Result<(), ProtocolError> {
        if !self.content.is_in_flight(&chunk.chunk_sha256) {
            return self.fail(ProtocolError::UnexpectedFrame {
                frame: "Chunk",
                state: "no such chunk requested",
            });
        }
        if chunk.data.len() > CHUNK_BYTES {
            return self.fail(ProtocolError::InvalidFrame {
                frame: "Chunk",
                detail: format!(
                    "{} bytes, more than a chunk's {CHUNK_BYTES}",
                    chunk.data.len()
                ),
            });
        }
        let got = sha256_hex(&chunk.data);
        if got != chunk.chunk_sha256 || !is_sha256_hex(&got) {
            return self.fail(ProtocolError::InvalidFrame {
                frame: "Chunk",
                detail: format!("the bytes of chunk {} hash to {got}", chunk.chunk_sha256),
            });
        }
        self.content.arrived(&chunk.chunk_sha256);
        self.events.push_back(AgentEvent::ChunkReceived {
            chunk_sha256: chunk.chunk_sha256,
            data: chunk.data,
        });
        self.request_chunks();
        Ok(())
    }

    /// Handles the timer armed from [`poll_timeout`](Self::poll_timeout): sends a heartbeat
    /// when one is due, closes if the welcome or the hub is overdue. Calling it early does
    /// nothing.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.is_established() {
            self.content.handle_timeout(now);
            self.request_chunks();
        }
        if let Renewal::Scheduled { due, expires } = self.renewal
            && now >= due
            && self.is_established()
        {
            self.renewal = Renewal::Preparing { expires };
            self.events.push_back(AgentEvent::RenewalDue);
        }
        match self.phase {
            Phase::AwaitingWelcome { deadline } if now >= deadline => {
                let waited = self.welcome_timeout;
                self.close_with(CloseReason::HandshakeTimeout { waited }, false);
            }
            Phase::Established { timeout, .. } if now >= self.last_heard + timeout => {
                self.close_with(
                    CloseReason::HeartbeatTimeout {
                        silent_for: timeout,
                    },
                    false,
                );
            }
            Phase::Established {
                interval,
                timeout,
                next_heartbeat,
            } if now >= next_heartbeat => {
                self.heartbeat_seq += 1;
                self.queue_heartbeat();
                // Stay on the interval grid, but a driver that woke late sends one heartbeat,
                // not a burst to catch up.
                let mut next = next_heartbeat + interval;
                if next <= now {
                    next = now + interval;
                }
                self.phase = Phase::Established {
                    interval,
                    timeout,
                    next_heartbeat: next,
                };
            }
            _ => {}
        }
    }

    /// When to call [`handle_timeout`](Self::handle_timeout) next (the earlier of the next
    /// heartbeat and the hub's deadline); `None` once closed.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.phase {
            Phase::AwaitingWelcome { deadline } => Some(deadline),
            Phase::Established {
                timeout,
                next_heartbeat,
                ..
            } => {
                let next = next_heartbeat.min(self.last_heard + timeout);
                let next = match self.content.poll_timeout() {
                    Some(retry) => next.min(retry),
                    None => next,
                };
                Some(match self.renewal {
                    Renewal::Scheduled { due, .. } => next.min(due),
                    _ => next,
                })
            }
            Phase::Closed => None,
        }
    }

    /// The next frame to send: hello, heartbeats and goodbye first, then acks and statuses in
    /// the order each work was first queued.
    pub fn poll_transmit(&mut self) -> Option<wire::AgentFrame> {
        if let Some(frame) = self.control.pop_front() {
            return Some(frame);
        }
        self.data.pop().map(|(_, frame)| agent(frame))
    }

    /// The next event for the driver, in the order they happened.
    pub fn poll_event(&mut self) -> Option<AgentEvent> {
        self.events.pop_front()
    }

    /// Tells the hub that `generation` of work `uid` is durable in the local cache. Call it
    /// only after the write is durable: the hub treats an acked generation as held. Coalesced
    /// per work (the highest generation wins). Ignored after close.
    pub fn ack_work(&mut self, uid: impl Into<String>, generation: i64) {
        if self.is_closed() {
            return;
        }
        let uid = uid.into();
        let key = Key::Ack(uid.clone());
        if let Some(agent_frame::Frame::WorkAck(pending)) = self.data.get(&key)
            && pending.generation > generation
        {
            return;
        }
        self.data.put(
            key,
            agent_frame::Frame::WorkAck(wire::WorkAck { uid, generation }),
        );
    }

    /// Reports the status of work `uid` computed for `generation`. `seq` increases with every
    /// status produced for the work, so the hub can drop stale ones and acknowledge up to it;
    /// keep the status in a durable outbox until [`AgentEvent::StatusAcked`] and re-report it
    /// on the next session. Coalesced per work (the highest seq wins). Ignored after close.
    pub fn report_status(
        &mut self,
        uid: impl Into<String>,
        generation: i64,
        seq: u64,
        status_json: Vec<u8>,
    ) {
        if self.is_closed() {
            return;
        }
        let uid = uid.into();
        let key = Key::Status(uid.clone());
        if let Some(agent_frame::Frame::WorkStatus(pending)) = self.data.get(&key)
            && pending.seq > seq
        {
            return;
        }
        let status = wire::WorkStatus {
            uid,
            generation,
            seq,
            status_json,
        };
        self.data.put(key, agent_frame::Frame::WorkStatus(status));
    }

    /// Tells the hub that everything work `uid` applied is gone from the spoke (or orphaned as
    /// its deleteOption says) and the work is forgotten, so the hub may let the deleted work
    /// go. Keep the release in a durable outbox until [`AgentEvent::ReleaseAcked`] and report
    /// it again on the next session. Coalesced per work. Ignored after close.
    pub fn release_work(&mut self, uid: impl Into<String>) {
        if self.is_closed() {
            return;
        }
        let uid = uid.into();
        self.data.put(
            Key::Release(uid.clone()),
            agent_frame::Frame::WorkReleased(wire::WorkReleased { uid }),
        );
    }

    /// Reports what the agent knows about its spoke now (claims, version, capacity), whole: call
    /// it once the session is established and again whenever that changes. Coalesced (only
    /// the latest report is sent); the hub writes it into the ManagedCluster's status when it
    /// differs from what is stored. Ignored after close.
    pub fn report_cluster_info(&mut self, info: wire::ClusterInfo) {
        if self.is_closed() {
            return;
        }
        self.data
            .put(Key::ClusterInfo, agent_frame::Frame::ClusterInfo(info));
    }

    /// Ends the session for a local reason (the agent is shutting down): queues a `Goodbye`
    /// with it and emits [`AgentEvent::Closed`].
    pub fn close(&mut self, reason: impl Into<String>) {
        self.close_with(CloseReason::Local(reason.into()), false);
    }

    fn on_welcome(&mut self, now: Instant, welcome: wire::Welcome) -> Result<(), ProtocolError> {
        if welcome.protocol_version != PROTOCOL_VERSION {
            return self.fail(ProtocolError::ProtocolVersion {
                got: welcome.protocol_version,
                ours: PROTOCOL_VERSION,
            });
        }
        if welcome.heartbeat_interval_ms == 0
            || welcome.heartbeat_timeout_ms <= welcome.heartbeat_interval_ms
        {
            return self.fail(ProtocolError::InvalidFrame {
                frame: "Welcome",
                detail: format!(
                    "heartbeat interval {}ms and timeout {}ms: the interval must be positive and \
                     shorter than the timeout",
                    welcome.heartbeat_interval_ms, welcome.heartbeat_timeout_ms
                ),
            });
        }
        let interval = Duration::from_millis(welcome.heartbeat_interval_ms.into());
        let timeout = Duration::from_millis(welcome.heartbeat_timeout_ms.into());
        self.phase = Phase::Established {
            interval,
            timeout,
            next_heartbeat: now + interval,
        };
        self.events.push_back(AgentEvent::Established {
            session_id: welcome.session_id,
            heartbeat_interval: interval,
            heartbeat_timeout: timeout,
        });
        Ok(())
    }

    fn queue_heartbeat(&mut self) {
        let seq = self.heartbeat_seq;
        // One heartbeat waiting is enough: if the transport is that slow, more would not help.
        for frame in &mut self.control {
            if let Some(agent_frame::Frame::Heartbeat(hb)) = &mut frame.frame {
                hb.seq = seq;
                return;
            }
        }
        self.control
            .push_back(agent(agent_frame::Frame::Heartbeat(wire::Heartbeat {
                seq,
            })));
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
        // Unsent acks and statuses are safe to drop: the cache and the outbox are durable, and
        // the next session's hello and status re-report carry them.
        self.control.clear();
        self.data.clear();
        // Chunks already received are the driver's; the rest are asked for again, by what the
        // driver finds missing, on the next session.
        self.content = ContentFetch::default();
        if !by_peer {
            self.control
                .push_back(agent(agent_frame::Frame::Goodbye(reason.goodbye())));
        }
        self.events
            .push_back(AgentEvent::Closed { reason, by_peer });
    }
}

fn agent(frame: agent_frame::Frame) -> wire::AgentFrame {
    wire::AgentFrame { frame: Some(frame) }
}

fn hub_frame_name(frame: &hub_frame::Frame) -> &'static str {
    match frame {
        hub_frame::Frame::Welcome(_) => "Welcome",
        hub_frame::Frame::Heartbeat(_) => "Heartbeat",
        hub_frame::Frame::WorkUpdate(_) => "WorkUpdate",
        hub_frame::Frame::WorkDelete(_) => "WorkDelete",
        hub_frame::Frame::SyncComplete(_) => "SyncComplete",
        hub_frame::Frame::Drain(_) => "Drain",
        hub_frame::Frame::OpenTunnel(_) => "OpenTunnel",
        hub_frame::Frame::StatusAck(_) => "StatusAck",
        hub_frame::Frame::Goodbye(_) => "Goodbye",
        hub_frame::Frame::CertificateIssued(_) => "CertificateIssued",
        hub_frame::Frame::TrustBundle(_) => "TrustBundle",
        hub_frame::Frame::RenewalRefused(_) => "RenewalRefused",
        hub_frame::Frame::Chunk(_) => "Chunk",
        hub_frame::Frame::ChunkRefused(_) => "ChunkRefused",
        hub_frame::Frame::ReleaseAck(_) => "ReleaseAck",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::CHUNK_WINDOW;

    fn established() -> (Instant, AgentSession) {
        let now = Instant::now();
        let config = AgentConfig {
            cluster_name: "c1".into(),
            agent_version: "test".into(),
            kubernetes_version: String::new(),
            claims: Vec::new(),
            welcome_timeout: DEFAULT_WELCOME_TIMEOUT,
        };
        let mut session = AgentSession::new(now, config, Vec::new());
        let welcome = hub_frame::Frame::Welcome(wire::Welcome {
            protocol_version: PROTOCOL_VERSION,
            session_id: "s1".into(),
            heartbeat_interval_ms: 10_000,
            heartbeat_timeout_ms: 30_000,
        });
        session
            .handle_frame(
                now,
                wire::HubFrame {
                    frame: Some(welcome),
                },
            )
            .unwrap();
        while session.poll_transmit().is_some() {}
        while session.poll_event().is_some() {}
        (now, session)
    }

    fn requests(session: &mut AgentSession) -> Vec<String> {
        std::iter::from_fn(|| session.poll_transmit())
            .filter_map(|f| match f.frame {
                Some(agent_frame::Frame::ChunkRequest(r)) => Some(r.chunk_sha256),
                _ => None,
            })
            .collect()
    }

    fn chunk(data: &[u8]) -> (String, wire::HubFrame) {
        let sha = sha256_hex(data);
        let frame = hub_frame::Frame::Chunk(wire::Chunk {
            work_uid: "w".into(),
            chunk_sha256: sha.clone(),
            data: data.to_vec(),
        });
        (sha, wire::HubFrame { frame: Some(frame) })
    }

    /// The hub sends large work `uid` whose content is `shas`; the session asks the driver to
    /// record it, and the driver answers that `missing` are not in its cache.
    fn fetch(
        session: &mut AgentSession,
        now: Instant,
        uid: &str,
        shas: &[String],
        missing: &[String],
    ) {
        let reference = ContentRef {
            sha256: sha256_hex(shas.concat().as_bytes()),
            bytes: (shas.len() * CHUNK_BYTES) as u64,
            chunks: shas.to_vec(),
        };
        let work = serde_json::json!({
            "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
            "metadata": {"name": uid, "namespace": "c1", "uid": uid, "generation": 1},
            "spec": {"workload": {"manifests": [reference.manifest().0]}},
        });
        let update = hub_frame::Frame::WorkUpdate(wire::WorkUpdate {
            uid: uid.into(),
            namespace: "c1".into(),
            name: uid.into(),
            generation: 1,
            content_hash: "h".into(),
            manifest_work_json: serde_json::to_vec(&work).unwrap(),
            kind: String::new(),
        });
        session
            .handle_frame(
                now,
                wire::HubFrame {
                    frame: Some(update),
                },
            )
            .unwrap();
        let Some(AgentEvent::ContentWanted {
            uid: wanted,
            content,
            transfer,
            ..
        }) = session.poll_event()
        else {
            panic!("a large work asks for its content first");
        };
        assert_eq!((wanted.as_str(), &content), (uid, &reference));
        assert!(session.content_missing(uid, transfer, missing.to_vec()));
    }

    #[test]
    fn only_missing_chunks_are_asked_for_two_at_a_time() {
        let (now, mut session) = established();
        let chunks: Vec<(String, wire::HubFrame)> = (0..5u8).map(|i| chunk(&[i; 16])).collect();
        let shas: Vec<String> = chunks.iter().map(|(s, _)| s.clone()).collect();
        // The first two were stored before a disconnect: the driver names only the rest.
        let missing = shas[2..].to_vec();
        fetch(&mut session, now, "w", &shas, &missing);
        assert_eq!(requests(&mut session), missing[..CHUNK_WINDOW].to_vec());
        assert_eq!(session.chunks_missing(), 3);
        // Each chunk received frees a slot for the next; each stored is no longer missing.
        session.handle_frame(now, chunks[2].1.clone()).unwrap();
        assert!(matches!(
            session.poll_event(),
            Some(AgentEvent::ChunkReceived { chunk_sha256, .. }) if chunk_sha256 == missing[0]
        ));
        assert_eq!(requests(&mut session), vec![missing[2].clone()]);
        session.chunk_stored(&missing[0]);
        session.handle_frame(now, chunks[3].1.clone()).unwrap();
        session.handle_frame(now, chunks[4].1.clone()).unwrap();
        assert!(requests(&mut session).is_empty());
        session.chunk_stored(&missing[1]);
        assert_eq!(session.chunks_missing(), 1);
        while session.poll_event().is_some() {}
        // The last one durable: the work is whole, and stored.
        session.chunk_stored(&missing[2]);
        assert_eq!(session.chunks_missing(), 0);
        assert!(matches!(
            session.poll_event(),
            Some(AgentEvent::ContentHeld { work }) if work.uid == "w"
        ));
    }

    #[test]
    fn a_chunk_wanted_by_two_works_is_asked_for_once() {
        let (now, mut session) = established();
        let (sha, _) = chunk(b"shared");
        let one = std::slice::from_ref(&sha);
        fetch(&mut session, now, "a", one, one);
        fetch(&mut session, now, "b", one, one);
        assert_eq!(requests(&mut session), vec![sha]);
    }

    #[test]
    fn a_chunk_whose_bytes_do_not_match_its_digest_closes_the_session() {
        let (now, mut session) = established();
        let (sha, _) = chunk(b"right");
        let one = std::slice::from_ref(&sha);
        fetch(&mut session, now, "w", one, one);
        let forged = hub_frame::Frame::Chunk(wire::Chunk {
            work_uid: "w".into(),
            chunk_sha256: sha,
            data: b"wrong".to_vec(),
        });
        let err = session
            .handle_frame(
                now,
                wire::HubFrame {
                    frame: Some(forged),
                },
            )
            .unwrap_err();
        assert!(err.to_string().contains("hash to"), "{err}");
        assert!(session.is_closed());
    }

    #[test]
    fn an_unrequested_chunk_is_a_protocol_error() {
        let (now, mut session) = established();
        let (_, frame) = chunk(b"unasked");
        assert!(session.handle_frame(now, frame).is_err());
    }
}
