//! The QUIC carrier: a session is the first bidirectional stream of a QUIC connection (the
//! agent opens it), carrying the same frames as the gRPC carrier, length-prefixed
//! ([`FrameCodec`]), with the same size bound; a tunnel is a further bidirectional stream the
//! gateway opens itself, whose first frame names it. TLS is the same mTLS as over TCP (the
//! same verifier, the same certificates) with flotilla's own ALPN.
//!
//! Sized for tens of thousands of mostly idle sessions on one UDP socket: small flow-control
//! windows and buffers per connection, keep-alives below common NAT binding timeouts, an idle
//! timeout, and connection migration on (an agent whose address or port changes keeps its
//! session).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use flotilla_proto::wire::{AgentFrame, HubFrame};
use futures::{SinkExt as _, StreamExt as _};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Connection, Endpoint, Runtime as _, VarInt};
use rustls_pki_types::CertificateDer;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tokio_util::codec::{FramedRead, FramedWrite};
use tracing::{debug, warn};

use crate::Dialed;
use crate::codec::FrameCodec;
use crate::gate::{ConnectionGate, Entry};
use crate::identity::{Peer, public_key_sha256};
use crate::link::{Carrier, LINK_BUFFER, Link, LinkError, Pump, TunnelStream};
use crate::quic_turn_away::{FirstPackets, Pacer, TurnAway, Watched};
use crate::tls::ConnInfo;
use crate::{Incoming, TunnelOpener};

/// The ALPN protocol of flotilla's sessions over QUIC.
pub const ALPN: &[u8] = b"flotilla/1";

/// QUIC application error code of a connection closed because its session ended.
const CLOSE_SESSION_ENDED: u32 = 0;
/// QUIC application error code of a connection the gateway refused (no control stream).
const CLOSE_REFUSED: u32 = 1;

/// Settings of the QUIC carrier, both ends.
#[derive(Clone, Debug)]
pub struct QuicSettings {
    /// Largest session frame either side may send; a larger one closes that session only.
    pub max_frame_bytes: usize,
    /// Keep-alive interval: below the 30 s UDP binding timeout of common NATs, so an idle
    /// session keeps its path open.
    pub keepalive_interval: Duration,
    /// A connection silent this long is gone (both ends close it: QUIC takes the shorter of
    /// the two ends' values, or the only one given). `None` gives none and leaves it to the
    /// peer: the agents' side, so that the hub's, derived from its heartbeat timeout, holds.
    pub idle_timeout: Option<Duration>,
    /// Flow-control window of one stream, receive side: sized for tunnels, as the gRPC
    /// carrier's ([`GrpcSettings::stream_window`](crate::grpc::GrpcSettings::stream_window)).
    pub stream_window: u32,
    /// Flow-control window of the whole connection, receive side; above the tunnels a cluster
    /// may hold at once times `stream_window`, as on the gRPC carrier.
    pub connection_window: u32,
    /// Bytes in flight a connection may send before the peer acknowledges.
    pub send_window: u64,
    /// Streams the peer may open at once (the session, and tunnels the gateway opens).
    pub max_streams: u32,
    /// How long the TLS handshake and the first stream may take.
    pub handshake_timeout: Duration,
    /// The congestion controller of each connection's sending side.
    pub congestion: QuicCongestion,
}

/// The congestion controllers quinn offers (`--quic-congestion` of the gateway and the agent).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QuicCongestion {
    /// CUBIC (RFC 9438): backs off on every loss, so random loss on a long path holds it far
    /// below the path's rate.
    Cubic,
    /// NewReno (RFC 9002's reference): as CUBIC, slower to grow back.
    NewReno,
    /// BBR: paces at the bottleneck rate and round trip it measures, and does not take a
    /// random loss as congestion.
    #[default]
    Bbr,
}

impl Default for QuicSettings {
    fn default() -> Self {
        QuicSettings {
            max_frame_bytes: 4 * 1024 * 1024,
            keepalive_interval: Duration::from_secs(15),
            idle_timeout: Some(Duration::from_secs(60)),
            stream_window: 1024 * 1024,
            connection_window: 16 * 1024 * 1024,
            send_window: 1024 * 1024,
            max_streams: 128,
            handshake_timeout: Duration::from_secs(10),
            congestion: QuicCongestion::default(),
        }
    }
}

impl QuicSettings {
    fn transport(&self) -> Arc<quinn::TransportConfig> {
        let mut t = quinn::TransportConfig::default();
        t.max_concurrent_bidi_streams(VarInt::from_u32(self.max_streams))
            .max_concurrent_uni_streams(VarInt::from_u32(0))
            .stream_receive_window(VarInt::from_u32(self.stream_window))
            .receive_window(VarInt::from_u32(self.connection_window))
            .send_window(self.send_window)
            .keep_alive_interval(Some(self.keepalive_interval))
            .max_idle_timeout(self.idle_timeout.map(|idle| {
                VarInt::from_u64(idle.as_millis() as u64)
                    .unwrap_or(VarInt::from_u32(60_000))
                    .into()
            }))
            // No datagrams: sessions are streams.
            .datagram_receive_buffer_size(None)
            .datagram_send_buffer_size(0)
            .crypto_buffer_size(8 * 1024);
        match self.congestion {
            QuicCongestion::Cubic => {
                t.congestion_controller_factory(Arc::new(quinn::congestion::CubicConfig::default()))
            }
            QuicCongestion::NewReno => t.congestion_controller_factory(Arc::new(
                quinn::congestion::NewRenoConfig::default(),
            )),
            QuicCongestion::Bbr => {
                t.congestion_controller_factory(Arc::new(quinn::congestion::BbrConfig::default()))
            }
        };
        Arc::new(t)
    }
}

impl QuicCongestion {
    /// Every controller, in the order `--help` lists them.
    pub const ALL: [QuicCongestion; 3] = [
        QuicCongestion::Bbr,
        QuicCongestion::Cubic,
        QuicCongestion::NewReno,
    ];

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            QuicCongestion::Cubic => "cubic",
            QuicCongestion::NewReno => "new-reno",
            QuicCongestion::Bbr => "bbr",
        }
    }
}

impl std::str::FromStr for QuicCongestion {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        QuicCongestion::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown QUIC congestion controller {s:?}: one of {}",
                    QuicCongestion::ALL.map(QuicCongestion::name).join(", ")
                )
            })
    }
}

/// Why a QUIC endpoint cannot be set up; not retryable without a change.
#[derive(Debug, thiserror::Error)]
pub enum QuicSetupError {
    /// The TLS configuration cannot do QUIC (it needs TLS 1.3).
    #[error("TLS configuration unusable for QUIC: {0}")]
    Tls(String),
    /// The UDP socket cannot be used.
    #[error("UDP socket: {0}")]
    Socket(#[from] std::io::Error),
}

/// The server TLS configuration for QUIC: `tls` (the agents' listener configuration) with
/// flotilla's ALPN instead of HTTP/2's.
fn server_crypto(tls: &Arc<rustls::ServerConfig>) -> Result<Arc<QuicServerConfig>, QuicSetupError> {
    let mut tls = (**tls).clone();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    tls.max_early_data_size = 0;
    Ok(Arc::new(
        QuicServerConfig::try_from(tls).map_err(|e| QuicSetupError::Tls(e.to_string()))?,
    ))
}

fn server_config(
    tls: &Arc<rustls::ServerConfig>,
    settings: &QuicSettings,
) -> Result<quinn::ServerConfig, QuicSetupError> {
    Ok(server_config_of(server_crypto(tls)?, settings))
}

fn server_config_of(crypto: Arc<QuicServerConfig>, settings: &QuicSettings) -> quinn::ServerConfig {
    let mut config = quinn::ServerConfig::with_crypto(crypto);
    config
        .transport_config(settings.transport())
        .migration(true);
    config
}

/// The keys a gateway's QUIC endpoint derives its stateless-reset tokens (RFC 9000, 10.3) and
/// its connection IDs' check hash from, derived in turn from a secret that outlives the
/// process: the TLS key a gateway process serves with, or the hub's CA key. A gateway
/// restarted in place, reached by an agent's next packet on a connection it no longer has,
/// recognises the connection ID as one it issued and answers with a reset the agent can
/// verify, and the agent dials again at once. With keys of its own each start, the packet was
/// dropped as bearing a foreign ID (or the reset did not verify), and the agent waited for its
/// heartbeat timeout: a SIGKILLed process sends no close. The keys can only end connections,
/// never read or write on them.
pub struct ResetKey {
    reset: ring::hmac::Key,
    /// The key of [`KeyedCids`]' check tag.
    cid: [u8; 32],
}

/// The connection IDs a gateway issues: [`CID_NONCE`] random bytes and a [`CID_TAG`]-byte
/// HMAC-SHA256 tag of them under the key derived for it, so a restarted process recognises the
/// IDs its predecessor issued (and resets their connections) and drops any other unknown one.
///
/// quinn's own keyed generator has 3 random bytes (16.7 million IDs): a restarted gateway
/// issuing IDs to 10,000 new connections gave some of them IDs the agents of lost connections
/// were still sending to; those packets went to a new connection that could not read them, no
/// reset came, and about two dozen agents per 10,000 waited for their heartbeat timeout.
/// Eight random bytes make that a chance in 10^10 per storm.
struct KeyedCids {
    key: ring::hmac::Key,
}

/// Random bytes at the start of each connection ID.
const CID_NONCE: usize = 8;
/// Bytes of the check tag after them.
const CID_TAG: usize = 4;

impl KeyedCids {
    fn tag(&self, nonce: &[u8]) -> [u8; CID_TAG] {
        let mut tag = [0u8; CID_TAG];
        tag.copy_from_slice(&ring::hmac::sign(&self.key, nonce).as_ref()[..CID_TAG]);
        tag
    }
}

impl quinn_proto::ConnectionIdGenerator for KeyedCids {
    fn generate_cid(&mut self) -> quinn_proto::ConnectionId {
        use ring::rand::SecureRandom as _;
        let mut id = [0u8; CID_NONCE + CID_TAG];
        ring::rand::SystemRandom::new()
            .fill(&mut id[..CID_NONCE])
            .expect("the system's random source works");
        let tag = self.tag(&id[..CID_NONCE]);
        id[CID_NONCE..].copy_from_slice(&tag);
        quinn_proto::ConnectionId::new(&id)
    }

    fn validate(&self, cid: &quinn_proto::ConnectionId) -> Result<(), quinn_proto::InvalidCid> {
        if cid.len() != CID_NONCE + CID_TAG {
            return Err(quinn_proto::InvalidCid);
        }
        let (nonce, tag) = cid.split_at(CID_NONCE);
        match self.tag(nonce)[..] == tag[..] {
            true => Ok(()),
            false => Err(quinn_proto::InvalidCid),
        }
    }

    fn cid_len(&self) -> usize {
        CID_NONCE + CID_TAG
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        None
    }
}

impl ResetKey {
    /// The keys derived from `secret` (HMAC-SHA256 under their own labels: nothing else
    /// derived from the same secret can be computed from them).
    pub fn derived_from(secret: &[u8]) -> ResetKey {
        let secret = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
        let reset = ring::hmac::sign(&secret, b"flotilla QUIC stateless reset key v1");
        let cid = ring::hmac::sign(&secret, b"flotilla QUIC connection ID key v2");
        let mut cid_key = [0u8; 32];
        cid_key.copy_from_slice(cid.as_ref());
        ResetKey {
            reset: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, reset.as_ref()),
            cid: cid_key,
        }
    }

    /// The endpoint configuration using these keys. Every packet on a lost connection is
    /// answered with a reset ([`MIN_RESET_INTERVAL`]): quinn spaces resets by a time it takes
    /// once per wake of its endpoint, so any spacing at all allowed one reset per batch of
    /// received datagrams, and under a restarted gateway's herd the rest went unanswered and
    /// their agents retransmitted with growing delays (a QUIC storm's last agents heard of the
    /// restart 30 s late). What bounds resets instead: only a packet whose connection ID this
    /// key issued gets one (quinn drops the others), one per packet, and a reset is always
    /// smaller than the packet it answers, so two endpoints cannot loop or amplify.
    fn endpoint_config(self) -> quinn::EndpointConfig {
        let cid = self.cid;
        let mut config = quinn::EndpointConfig::new(Arc::new(self.reset));
        config
            .cid_generator(move || {
                Box::new(KeyedCids {
                    key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &cid),
                })
            })
            .min_reset_interval(MIN_RESET_INTERVAL);
        config
    }

    /// A key of this process alone (tests, and listeners nothing restarts in place).
    pub fn random() -> ResetKey {
        use ring::rand::SecureRandom as _;
        let mut secret = [0u8; 32];
        ring::rand::SystemRandom::new()
            .fill(&mut secret)
            .expect("the system's random source works");
        ResetKey::derived_from(&secret)
    }
}

impl std::fmt::Debug for ResetKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResetKey(<redacted>)")
    }
}

/// The gateway's QUIC listener on `socket`.
pub struct QuicListener {
    endpoint: Endpoint,
    settings: QuicSettings,
    /// Asked once per `Incoming`, before its handshake; `None` admits all.
    gate: Option<Arc<dyn ConnectionGate>>,
    /// Answers a connection over the rate, or finding no handshake slot, before its
    /// handshake, with its retry-after.
    turn_away: Arc<TurnAway>,
}

impl QuicListener {
    /// Listens on `socket` (bound already, usually to the TCP listener's address and port),
    /// resetting connections it does not have with tokens from `reset_key`.
    pub fn bind(
        socket: std::net::UdpSocket,
        tls: &Arc<rustls::ServerConfig>,
        settings: QuicSettings,
        reset_key: ResetKey,
    ) -> Result<QuicListener, QuicSetupError> {
        widen_listener_buffers(&socket);
        let socket = quinn::TokioRuntime.wrap_udp_socket(socket)?;
        let first = Arc::new(FirstPackets::default());
        let crypto = server_crypto(tls)?;
        let endpoint = Endpoint::new_with_abstract_socket(
            reset_key.endpoint_config(),
            Some(server_config_of(crypto.clone(), &settings)),
            Arc::new(Watched::new(socket.clone(), first.clone())),
            Arc::new(quinn::TokioRuntime),
        )?;
        Ok(QuicListener {
            endpoint,
            settings,
            gate: None,
            turn_away: Arc::new(TurnAway::new(socket, first, crypto)),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }

    /// Asks `gate` about each new connection before its handshake (see [`crate::gate`]).
    pub fn gated(mut self, gate: Arc<dyn ConnectionGate>) -> QuicListener {
        self.gate = Some(gate);
        self
    }

    /// Handshakes from now on use `tls` (after a CA rotation); live connections keep theirs.
    pub fn update_tls(&self, tls: &Arc<rustls::ServerConfig>) -> Result<(), QuicSetupError> {
        self.endpoint
            .set_server_config(Some(server_config(tls, &self.settings)?));
        Ok(())
    }

    /// A handle for updating the TLS configuration while [`serve`](Self::serve) runs.
    pub fn tls_updater(&self) -> QuicTlsUpdater {
        QuicTlsUpdater {
            endpoint: self.endpoint.clone(),
            settings: self.settings.clone(),
        }
    }

    /// Accepts connections until `drain` turns true, each handshake bounded (`max_handshakes`
    /// at once) and each connection in its own task owned here; every connection whose first
    /// stream opens becomes an [`Incoming`] on `sessions`. A connection arriving while every
    /// handshake slot is taken waits for one, in order, [`SLOT_WAIT`] at most and
    /// [`WAITING_PER_SLOT`] per slot at most; beyond either it is turned away before any
    /// crypto, told to come back when the handshakes ahead of it should be done ([`Pacer`]).
    /// On drain it stops accepting and waits for its connections, which end as their sessions
    /// do; the caller bounds the wait (dropping this future aborts every connection).
    pub async fn serve(
        self,
        sessions: mpsc::Sender<Incoming>,
        max_handshakes: usize,
        mut drain: watch::Receiver<bool>,
    ) {
        let max_handshakes = max_handshakes.max(1);
        let permits = Arc::new(Semaphore::new(max_handshakes));
        let max_waiting = max_handshakes * WAITING_PER_SLOT;
        let waiting = Arc::new(Semaphore::new(max_waiting));
        // Until measured, every slot is guessed to finish a handshake a second.
        let pacer = Arc::new(Pacer::new(
            max_handshakes as f64,
            tokio::time::Instant::now(),
        ));
        let ahead = {
            let (permits, waiting) = (permits.clone(), waiting.clone());
            move || {
                (max_handshakes - permits.available_permits())
                    + (max_waiting - waiting.available_permits())
            }
        };
        let mut connections = JoinSet::new();
        let mut accepting = self.gate.as_ref().and_then(|g| g.accepting());
        loop {
            // A gateway about to serve leaves new connections in quinn's queue meanwhile.
            tokio::select! {
                _ = crate::gate::until_accepting(&mut accepting) => {}
                _ = drain.wait_for(|d| *d) => break,
            }
            tokio::select! {
                incoming = self.endpoint.accept() => {
                    let Some(incoming) = incoming else { break };
                    let Some(incoming) = self.turn_away.again(incoming) else { continue };
                    // Asked before any crypto, once per attempt, whatever happens to it next.
                    let (incoming, over_rate) = match self.gate.as_ref().map(|g| g.arrived(Carrier::Quic)) {
                        // Told when to come back in the first answer, before any handshake
                        // (`quic_turn_away`); one whose first packet was forgotten is told in
                        // a drain after its handshake.
                        Some(Entry::OverRate { retry_after }) => match self.turn_away.turn_away(incoming, retry_after) {
                            None => continue,
                            Some(incoming) => (incoming, Some(retry_after)),
                        },
                        Some(Entry::Admitted) | None => (incoming, None),
                        Some(Entry::NotReady) => {
                            debug!(peer = %incoming.remote_address(), "QUIC connection refused before its handshake: not serving yet");
                            incoming.refuse();
                            continue;
                        }
                    };
                    let (sessions, settings) = (sessions.clone(), self.settings.clone());
                    if let Ok(permit) = permits.clone().try_acquire_owned() {
                        let slot = HandshakeSlot { _permit: permit, pacer: pacer.clone(), waiting: waiting.clone(), max_waiting };
                        connections.spawn(accept(incoming, sessions, settings, slot, over_rate));
                        continue;
                    }
                    let Ok(place) = waiting.clone().try_acquire_owned() else {
                        debug!(peer = %incoming.remote_address(), "QUIC connection turned away before its handshake: too many in progress and waiting");
                        busy(&self.turn_away, &pacer, incoming, ahead());
                        continue;
                    };
                    let (permits, pacer, turn_away, ahead, waiting) = (permits.clone(), pacer.clone(), self.turn_away.clone(), ahead.clone(), waiting.clone());
                    connections.spawn(async move {
                        // Waiting costs the first datagram, which quinn keeps anyway; a refusal
                        // would cost the agent a wait and the gateway another attempt.
                        let slot = tokio::time::timeout(SLOT_WAIT, permits.acquire_owned()).await;
                        drop(place);
                        match slot {
                            Ok(Ok(permit)) => {
                                let slot = HandshakeSlot { _permit: permit, pacer, waiting, max_waiting };
                                accept(incoming, sessions, settings, slot, over_rate).await
                            }
                            _ => {
                                debug!(peer = %incoming.remote_address(), "QUIC connection turned away before its handshake: no slot within {SLOT_WAIT:?}");
                                busy(&turn_away, &pacer, incoming, ahead());
                            }
                        }
                    });
                }
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
                _ = drain.wait_for(|d| *d) => break,
            }
        }
        // No new connections from here on; live ones end with their sessions.
        self.endpoint.set_server_config(None);
        while connections.join_next().await.is_some() {}
        self.endpoint
            .close(VarInt::from_u32(CLOSE_SESSION_ENDED), b"gateway stopped");
    }
}

/// Replaces the QUIC listener's TLS configuration (see [`QuicListener::update_tls`]).
#[derive(Clone)]
pub struct QuicTlsUpdater {
    endpoint: Endpoint,
    settings: QuicSettings,
}

impl QuicTlsUpdater {
    pub fn update(&self, tls: &Arc<rustls::ServerConfig>) -> Result<(), QuicSetupError> {
        self.endpoint
            .set_server_config(Some(server_config(tls, &self.settings)?));
        Ok(())
    }
}

/// One of the handshakes in progress; given back, it tells the pacer a handshake finished,
/// and whether others were waiting for a slot then.
struct HandshakeSlot {
    _permit: tokio::sync::OwnedSemaphorePermit,
    pacer: Arc<Pacer>,
    waiting: Arc<Semaphore>,
    max_waiting: usize,
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        let queued = self.waiting.available_permits() < self.max_waiting;
        self.pacer.finished(tokio::time::Instant::now(), queued);
    }
}

/// Turns away a connection that found no handshake slot, told to come back when the `ahead`
/// handshakes in progress and waiting should be done; refused without a reason when its first
/// packet is no longer remembered (its agent backs off as after any failed dial).
fn busy(turn_away: &TurnAway, pacer: &Pacer, incoming: quinn::Incoming, ahead: usize) {
    let retry_after = pacer.come_back(tokio::time::Instant::now(), ahead);
    if let Some(incoming) = turn_away.turn_away(incoming, retry_after) {
        incoming.refuse();
    }
}

/// One connection: handshake, identity, the control stream, then its writes until the
/// session is over.
async fn accept(
    incoming: quinn::Incoming,
    sessions: mpsc::Sender<Incoming>,
    settings: QuicSettings,
    permit: HandshakeSlot,
    over_rate: Option<Duration>,
) {
    let remote = incoming.remote_address();
    let handshake = async {
        let conn = incoming.accept()?.await?;
        Ok::<_, quinn::ConnectionError>(conn)
    };
    let conn = match tokio::time::timeout(settings.handshake_timeout, handshake).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => {
            warn!(listener = "agents (QUIC)", peer = %remote, error = %e, "QUIC handshake refused: {}", crate::tls::handshake_hint(&e.to_string()));
            return;
        }
        Err(_) => {
            warn!(listener = "agents (QUIC)", peer = %remote, "QUIC handshake timed out after {:?}", settings.handshake_timeout);
            return;
        }
    };
    let peer = match conn_info(&conn) {
        Ok(info) => ConnInfo { over_rate, ..info },
        Err(e) => {
            warn!(listener = "agents (QUIC)", peer = %remote, error = %e, "QUIC connection refused");
            conn.close(VarInt::from_u32(CLOSE_REFUSED), e.as_bytes());
            return;
        }
    };
    let control = tokio::time::timeout(settings.handshake_timeout, conn.accept_bi()).await;
    // The handshake slot is free once the session stream is open (or given up on).
    drop(permit);
    let (send, recv) = match control {
        Ok(Ok(streams)) => streams,
        Ok(Err(e)) => {
            debug!(peer = %remote, error = %e, "QUIC connection ended before its session stream");
            return;
        }
        Err(_) => {
            conn.close(VarInt::from_u32(CLOSE_REFUSED), b"no session stream");
            return;
        }
    };
    let (link, pump) = link::<AgentFrame, HubFrame>(send, recv, settings.max_frame_bytes);
    let incoming = Incoming {
        peer,
        link,
        tunnels: TunnelOpener::Quic(QuicTunnels { conn: conn.clone() }),
    };
    if sessions.send(incoming).await.is_err() {
        conn.close(VarInt::from_u32(CLOSE_REFUSED), b"gateway shutting down");
        return;
    }
    // An agent that stopped reading has ended the session itself: nothing more to wait for.
    let _ = pump.await;
    conn.close(VarInt::from_u32(CLOSE_SESSION_ENDED), b"session ended");
}

/// The peer's identity, read from the certificate rustls verified in the handshake.
fn conn_info(conn: &Connection) -> Result<ConnInfo, String> {
    let remote = conn.remote_address();
    let cert = conn
        .peer_identity()
        .and_then(|id| id.downcast::<Vec<CertificateDer<'static>>>().ok())
        .and_then(|certs| certs.first().cloned());
    let Some(cert) = cert else {
        return Ok(ConnInfo {
            peer: Peer::Anonymous,
            remote,
            client_key_sha256: None,
            over_rate: None,
        });
    };
    let peer = Peer::from_der(&cert).map_err(|e| e.to_string())?;
    let key = public_key_sha256(&cert).map_err(|e| e.to_string())?;
    Ok(ConnInfo {
        peer,
        remote,
        client_key_sha256: Some(key),
        over_rate: None,
    })
}

/// How a QUIC link's pump ended.
#[derive(Debug, PartialEq, Eq)]
enum PumpEnd {
    /// This end dropped its sender: everything queued was written and the stream finished.
    Finished,
    /// A write failed: the peer stopped reading (it is ending the session, and may still have
    /// a goodbye on the way) or the connection is gone.
    WriteFailed,
}

type LinkPump = Pin<Box<dyn Future<Output = PumpEnd> + Send>>;

/// Receive and send buffer asked of the kernel for a QUIC UDP socket. One gateway socket
/// carries every agent's packets: at the kernel's default (about 208 KiB) a burst of handshakes
/// overflows it, and each dropped packet comes back as a retransmission, until handshakes stop
/// finishing at all (50,000 agents at 1,000/s: 9 million datagrams dropped, 42 sessions up).
/// The kernel caps a plain request at `net.core.rmem_max` / `wmem_max` (see
/// [`widen_listener_buffers`]).
const UDP_BUFFER_BYTES: usize = 16 << 20;

/// Asks for [`UDP_BUFFER_BYTES`] each way on an agent's `socket`; a refusal is logged and the
/// kernel's default kept. One agent's connection needs far less; a capped request is fine.
fn widen_buffers(socket: &std::net::UdpSocket) {
    let sock = socket2::SockRef::from(socket);
    if let Err(e) = sock.set_recv_buffer_size(UDP_BUFFER_BYTES) {
        warn!(error = %e, "cannot widen the QUIC socket's receive buffer; bursts may be dropped");
    }
    if let Err(e) = sock.set_send_buffer_size(UDP_BUFFER_BYTES) {
        warn!(error = %e, "cannot widen the QUIC socket's send buffer");
    }
    debug!(
        receive = ?sock.recv_buffer_size().ok(),
        send = ?sock.send_buffer_size().ok(),
        "QUIC socket buffers"
    );
}

/// What the kernel gave the listener's socket, in its own accounting (Linux reports twice the
/// bytes asked: the other half is its bookkeeping).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SocketBuffers {
    /// Receive buffer, bytes.
    pub receive: usize,
    /// Send buffer, bytes.
    pub send: usize,
}

/// Asks for [`UDP_BUFFER_BYTES`] each way on the listener's `socket`. The kernel caps a plain
/// request at `net.core.rmem_max` / `wmem_max`, 4 MiB or less by default, and a storm of
/// reconnects overflows that: 10,000 agents coming back after a kill lost 1,800 to 3,500
/// Initials in its first seconds here, and each loss cost its agent a retransmission one, two,
/// then four seconds later (the storm's last agents came back 8 s after the rest). Where the
/// plain request comes back short, the privileged form (`SO_RCVBUFFORCE`, a process with
/// `CAP_NET_ADMIN`) passes the cap; where that is refused, the operator is told which sysctl
/// to raise.
pub fn widen_listener_buffers(socket: &std::net::UdpSocket) -> SocketBuffers {
    let sock = socket2::SockRef::from(socket);
    let _ = sock.set_recv_buffer_size(UDP_BUFFER_BYTES);
    let _ = sock.set_send_buffer_size(UDP_BUFFER_BYTES);
    let mut got = buffers_of(&sock);
    if got.receive < UDP_BUFFER_BYTES || got.send < UDP_BUFFER_BYTES {
        force_buffers(socket);
        got = buffers_of(&sock);
    }
    if got.receive < UDP_BUFFER_BYTES {
        warn!(
            receive_kib = got.receive / 1024,
            asked_kib = UDP_BUFFER_BYTES / 1024,
            "the QUIC socket's receive buffer is capped by the kernel: a burst of reconnects \
             will be dropped and retransmitted a second or more later; raise the cap with \
             `sysctl -w net.core.rmem_max={UDP_BUFFER_BYTES}` (or run with CAP_NET_ADMIN)"
        );
    }
    if got.send < UDP_BUFFER_BYTES {
        warn!(
            send_kib = got.send / 1024,
            asked_kib = UDP_BUFFER_BYTES / 1024,
            "the QUIC socket's send buffer is capped by the kernel; raise the cap with \
             `sysctl -w net.core.wmem_max={UDP_BUFFER_BYTES}` (or run with CAP_NET_ADMIN)"
        );
    }
    debug!(
        receive = got.receive,
        send = got.send,
        "QUIC listener socket buffers"
    );
    got
}

fn buffers_of(sock: &socket2::SockRef<'_>) -> SocketBuffers {
    SocketBuffers {
        receive: sock.recv_buffer_size().unwrap_or(0),
        send: sock.send_buffer_size().unwrap_or(0),
    }
}

/// The privileged request past `net.core.rmem_max` / `wmem_max`; refused (`EPERM`) without
/// `CAP_NET_ADMIN`, which the caller reports.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn force_buffers(socket: &std::net::UdpSocket) {
    use nix::sys::socket::{setsockopt, sockopt};
    if let Err(e) = setsockopt(socket, sockopt::RcvBufForce, &UDP_BUFFER_BYTES) {
        debug!(error = %e, "SO_RCVBUFFORCE refused");
    }
    if let Err(e) = setsockopt(socket, sockopt::SndBufForce, &UDP_BUFFER_BYTES) {
        debug!(error = %e, "SO_SNDBUFFORCE refused");
    }
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn force_buffers(_socket: &std::net::UdpSocket) {}

/// The least time between two stateless resets the gateway sends: none (see
/// [`ResetKey::endpoint_config`]).
const MIN_RESET_INTERVAL: Duration = Duration::ZERO;

/// Connections that may wait for a handshake slot, per slot, when every slot is taken.
const WAITING_PER_SLOT: usize = 4;
/// How long a connection waits for a handshake slot before it is refused: well inside an
/// agent's dial deadline, so a refused agent still has time to back off and try again.
const SLOT_WAIT: Duration = Duration::from_secs(2);

/// How long a dialling end waits for the hub to close a connection whose session stream the
/// hub stopped: the hub's goodbye may still be in flight, and closing first would discard it.
const GOODBYE_WAIT: Duration = Duration::from_secs(5);

/// A session's frames over one QUIC stream: inbound decoded as they arrive; outbound through a
/// bounded channel that the returned pump writes to the stream, finishing it once the sender
/// is dropped and everything is written.
fn link<In, Out>(
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    max_frame_bytes: usize,
) -> (Link<In, Out>, LinkPump)
where
    In: prost::Message + Default + Send + 'static,
    Out: prost::Message + Send + 'static,
{
    let inbound = FramedRead::new(recv, FrameCodec::<In>::new(max_frame_bytes)).boxed();
    let (tx, mut rx) = mpsc::channel::<Out>(LINK_BUFFER);
    let pump = async move {
        let mut sink = FramedWrite::new(send, FrameCodec::<Out>::new(max_frame_bytes));
        while let Some(frame) = rx.recv().await {
            // Feed what is queued, flush once: a burst costs one write.
            if sink.feed(frame).await.is_err() {
                return PumpEnd::WriteFailed;
            }
            while let Ok(frame) = rx.try_recv() {
                if sink.feed(frame).await.is_err() {
                    return PumpEnd::WriteFailed;
                }
            }
            if sink.flush().await.is_err() {
                return PumpEnd::WriteFailed;
            }
        }
        let mut send = sink.into_inner();
        let _ = send.finish();
        // Until the peer has what was sent (the goodbye), bounded: closing the connection
        // before would discard it.
        let _ = tokio::time::timeout(Duration::from_secs(2), send.stopped()).await;
        PumpEnd::Finished
    };
    (
        Link {
            inbound,
            outbound: tx,
            carrier: Carrier::Quic,
        },
        Box::pin(pump),
    )
}

/// Opens tunnels to one agent over QUIC: the gateway opens the stream itself.
#[derive(Clone)]
pub struct QuicTunnels {
    conn: Connection,
}

impl QuicTunnels {
    /// Opens tunnel `id`: a new stream whose first frame is the id.
    pub async fn open(&self, id: &str) -> Result<TunnelStream, LinkError> {
        let (mut send, recv) = self
            .conn
            .open_bi()
            .await
            .map_err(|e| LinkError::Transport(e.to_string()))?;
        let header = tunnel_header(id);
        send.write_all(&header)
            .await
            .map_err(|e| LinkError::Transport(e.to_string()))?;
        Ok(TunnelStream::new(id, tokio::io::join(recv, Vectored(send))))
    }
}

/// A tunnel's sending half taking vectored writes: each slice goes to quinn in turn (which
/// copies it into its stream buffer), so a writer that holds several buffers (hyper's head
/// and body) hands them over as they are instead of first copying them into one.
struct Vectored(quinn::SendStream);

impl tokio::io::AsyncWrite for Vectored {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0)
            .poll_write(cx, buf)
            .map_err(Into::into)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        use std::task::Poll;
        let mut written = 0;
        for buf in bufs.iter().filter(|b| !b.is_empty()) {
            match Pin::new(&mut self.0).poll_write(cx, buf) {
                Poll::Ready(Ok(n)) => {
                    written += n;
                    if n < buf.len() {
                        break;
                    }
                }
                // What was taken already is reported; the error comes again on the next write.
                Poll::Ready(Err(e)) if written == 0 => return Poll::Ready(Err(e.into())),
                Poll::Pending if written == 0 => return Poll::Pending,
                Poll::Ready(Err(_)) | Poll::Pending => break,
            }
        }
        Poll::Ready(Ok(written))
    }
    fn is_write_vectored(&self) -> bool {
        true
    }
    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        tokio::io::AsyncWrite::poll_flush(Pin::new(&mut self.0), cx)
    }
    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        tokio::io::AsyncWrite::poll_shutdown(Pin::new(&mut self.0), cx)
    }
}

/// A tunnel stream's first bytes: the id's length (u16, big-endian) and the id.
fn tunnel_header(id: &str) -> Bytes {
    let mut header = Vec::with_capacity(2 + id.len());
    header.extend_from_slice(&(id.len() as u16).to_be_bytes());
    header.extend_from_slice(id.as_bytes());
    header.into()
}

/// The agent's QUIC endpoint: one UDP socket for however many connections (the load test
/// runs thousands of agents on one). Rebinding it moves every connection to the new socket
/// without a new handshake (connection migration).
#[derive(Clone, Debug)]
pub struct QuicClient {
    endpoint: Endpoint,
    settings: QuicSettings,
}

impl QuicClient {
    /// An endpoint on `bind` (port 0: any).
    pub fn bind(bind: SocketAddr, settings: QuicSettings) -> Result<QuicClient, QuicSetupError> {
        let socket = std::net::UdpSocket::bind(bind)?;
        widen_buffers(&socket);
        let endpoint = Endpoint::new(
            quinn::EndpointConfig::default(),
            None,
            socket,
            Arc::new(quinn::TokioRuntime),
        )?;
        Ok(QuicClient { endpoint, settings })
    }

    /// The local address of the socket in use.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }

    /// Moves every connection of this endpoint to a new UDP socket on `bind`, as when a
    /// device's address or NAT mapping changes; sessions go on without a reconnect.
    pub fn rebind(&self, bind: SocketAddr) -> std::io::Result<SocketAddr> {
        let socket = std::net::UdpSocket::bind(bind)?;
        widen_buffers(&socket);
        let addr = socket.local_addr()?;
        self.endpoint.rebind(socket)?;
        Ok(addr)
    }

    /// Connects to the hub at `addr` (TLS name `server_name`) with the agent's `tls`
    /// configuration and opens the session stream with `first` (the hello) on it.
    pub async fn open_session(
        &self,
        addr: SocketAddr,
        server_name: &str,
        tls: &Arc<rustls::ClientConfig>,
        first: AgentFrame,
    ) -> Result<Dialed, LinkError> {
        let mut tls = (**tls).clone();
        tls.alpn_protocols = vec![ALPN.to_vec()];
        tls.enable_early_data = false;
        let crypto =
            QuicClientConfig::try_from(tls).map_err(|e| LinkError::Transport(e.to_string()))?;
        let mut config = quinn::ClientConfig::new(Arc::new(crypto));
        config.transport_config(self.settings.transport());
        let conn = self
            .endpoint
            .connect_with(config, addr, server_name)
            .map_err(|e| LinkError::Transport(e.to_string()))?
            .await
            .map_err(connection_error)?;
        let (send, recv) = conn.open_bi().await.map_err(connection_error)?;
        let (link, pump) = link::<HubFrame, AgentFrame>(send, recv, self.settings.max_frame_bytes);
        link.outbound
            .try_send(first)
            .map_err(|_| LinkError::Transport("the session's first frame did not fit".into()))?;
        let closer = conn.clone();
        let mut pump: Pump = Box::pin(async move {
            if pump.await == PumpEnd::WriteFailed {
                // The hub stopped reading this session (a frame it refused, a drain): it
                // closes the connection once its goodbye is acknowledged, so the goodbye is
                // read before the connection goes. Bounded, for a hub that never closes.
                let _ = tokio::time::timeout(GOODBYE_WAIT, closer.closed()).await;
            }
            // Closing an already closed connection would replace the hub's reason (the TLS
            // alert that refused this agent) with "closed locally" before the dial reads it.
            if closer.close_reason().is_none() {
                closer.close(VarInt::from_u32(CLOSE_SESSION_ENDED), b"session ended");
            }
        });
        let link = first_answer(link, &mut pump, &conn).await?;
        Ok(Dialed {
            link,
            pump: Some(pump),
            tunnels: crate::AgentTunnels::Quic(AgentTunnels { conn }),
        })
    }
}

/// Waits for the hub's answer to the first frame, sending it meanwhile. In TLS 1.3 the client's
/// handshake completes before the server has checked the client's certificate; a hub that
/// refuses it closes the connection with the TLS alert, and waiting here makes that alert this
/// dial's error (`unknown CA`, `certificate expired`) instead of a stream reset later. The hub
/// answers a hello at once (welcome or goodbye), so this costs one round trip the session
/// would wait for anyway.
async fn first_answer(
    link: Link<HubFrame, AgentFrame>,
    pump: &mut Pump,
    conn: &Connection,
) -> Result<Link<HubFrame, AgentFrame>, LinkError> {
    let Link {
        mut inbound,
        outbound,
        carrier,
    } = link;
    let answer = tokio::select! {
        answer = inbound.next() => answer,
        () = &mut *pump => None,
    };
    match answer {
        Some(Ok(frame)) => Ok(Link {
            inbound: futures::stream::once(std::future::ready(Ok(frame)))
                .chain(inbound)
                .boxed(),
            outbound,
            carrier,
        }),
        other => {
            // The connection's own reason (the TLS alert) says more than the stream's.
            if let Some(reason) = conn.close_reason() {
                return Err(connection_error(reason));
            }
            Err(match other {
                Some(Err(e)) => e,
                _ => LinkError::Transport(
                    "the hub ended the session before answering its first frame".into(),
                ),
            })
        }
    }
}

/// A QUIC connection failure; a failed TLS handshake keeps its alert and who sent it.
fn connection_error(e: quinn::ConnectionError) -> LinkError {
    // A gateway over its rate refuses in its first answer, saying when to come back
    // (`quic_turn_away`).
    if let quinn::ConnectionError::ConnectionClosed(close) = &e
        && close.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED
        && let Some(retry_after) = crate::turn_away::parse(&close.reason)
    {
        return LinkError::TurnedAway {
            retry_after,
            detail: crate::turn_away::TurnedAway { retry_after }.to_string(),
        };
    }
    let (code, by_peer) = match &e {
        quinn::ConnectionError::ConnectionClosed(close) => (Some(close.error_code), true),
        quinn::ConnectionError::TransportError(t) => (Some(t.code), false),
        quinn::ConnectionError::TimedOut => {
            return LinkError::TimedOut(format!("no QUIC answer: {e}"));
        }
        _ => (None, false),
    };
    // Crypto errors are 0x100 plus the TLS alert (RFC 9001, 4.8).
    match code.map(u64::from) {
        Some(code @ 0x100..=0x1ff) => LinkError::Tls {
            alert: (code - 0x100) as u8,
            by_peer,
            detail: e.to_string(),
        },
        _ => LinkError::Transport(e.to_string()),
    }
}

/// The agent's side of tunnels over QUIC: streams the gateway opens on the connection.
#[derive(Clone)]
pub struct AgentTunnels {
    conn: Connection,
}

impl AgentTunnels {
    /// The next stream the gateway opens; `None` once the connection is gone. Cancel-safe,
    /// so it can wait in a `select!` beside other work: its header is read by
    /// [`AcceptedTunnel::read_id`], which may wait a retransmission.
    pub async fn accept(&self) -> Option<AcceptedTunnel> {
        let (send, recv) = self.conn.accept_bi().await.ok()?;
        Some(AcceptedTunnel { send, recv })
    }
}

/// How long an accepted tunnel stream's header may take to arrive (a lost packet is resent
/// within a few round trips).
pub const TUNNEL_HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// A stream the gateway opened, its header (the tunnel's id) not read yet.
///
/// The header is read apart from the accept because it can arrive after the stream opens: a
/// stream opens with the first of its frames to arrive, and when the one holding the header
/// was lost, the next holds the request. Reading it inside the accept made the accept wait
/// for the retransmission, and a `select!` that dropped the accept then dropped the stream
/// too, ending the kubectl request on it with nothing answered.
pub struct AcceptedTunnel {
    send: quinn::SendStream,
    recv: quinn::RecvStream,
}

impl AcceptedTunnel {
    /// The tunnel, once its header has arrived; `None` if the stream ends first, the header
    /// is not an id, or it does not come within [`TUNNEL_HEADER_TIMEOUT`].
    pub async fn read_id(mut self) -> Option<TunnelStream> {
        let read = async {
            let mut len = [0u8; 2];
            self.recv.read_exact(&mut len).await.ok()?;
            let mut id = vec![0u8; u16::from_be_bytes(len) as usize];
            self.recv.read_exact(&mut id).await.ok()?;
            String::from_utf8(id).ok()
        };
        let id = tokio::time::timeout(TUNNEL_HEADER_TIMEOUT, read)
            .await
            .ok()??;
        Some(TunnelStream::new(
            id,
            tokio::io::join(self.recv, Vectored(self.send)),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A restarted gateway must compute the same reset tokens and connection-ID checks as the
    /// process before it: from the same secret, the same keys; from another, others.
    #[test]
    fn reset_keys_follow_their_secret_and_nothing_else() {
        let tag = |k: &ResetKey| {
            ring::hmac::sign(&k.reset, b"a connection id")
                .as_ref()
                .to_vec()
        };
        let (a, again, other) = (
            ResetKey::derived_from(b"serving key"),
            ResetKey::derived_from(b"serving key"),
            ResetKey::derived_from(b"another key"),
        );
        assert_eq!(tag(&a), tag(&again));
        assert_eq!(a.cid, again.cid);
        assert_ne!(tag(&a), tag(&other));
        assert_ne!(a.cid, other.cid);
        // The two keys are not the same bytes either.
        assert_ne!(&tag(&a)[..], &a.cid[..]);
        assert_ne!(tag(&ResetKey::random()), tag(&ResetKey::random()));
    }

    fn keyed_cids(key: &[u8; 32]) -> KeyedCids {
        KeyedCids {
            key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key),
        }
    }

    /// The IDs a restarted gateway issues to its new connections must not be IDs its
    /// predecessor's connections still use: an agent's packet on a lost connection would reach
    /// a new one, which cannot read it, and no reset would come. Issued IDs are checked by any
    /// process of the same key, and by no other.
    #[test]
    fn connection_ids_do_not_repeat_and_are_recognised_by_their_key_alone() {
        use quinn_proto::ConnectionIdGenerator as _;
        let key = ResetKey::derived_from(b"serving key");
        let mut before = keyed_cids(&key.cid);
        let mut after = keyed_cids(&ResetKey::derived_from(b"serving key").cid);
        let other = keyed_cids(&ResetKey::derived_from(b"another key").cid);
        let mut seen = std::collections::HashSet::new();
        // Two processes' worth of a storm's IDs: with quinn's three random bytes, 200,000 IDs
        // repeat about a thousand times.
        for _ in 0..100_000 {
            for id in [before.generate_cid(), after.generate_cid()] {
                assert_eq!(id.len(), before.cid_len());
                assert!(seen.insert(id), "an ID issued twice: {id}");
                assert!(before.validate(&id).is_ok() && after.validate(&id).is_ok());
                assert!(
                    other.validate(&id).is_err(),
                    "another key's process took {id}"
                );
            }
        }
        // A short or altered ID is not one of ours.
        let id = before.generate_cid();
        assert!(
            before
                .validate(&quinn_proto::ConnectionId::new(&id[..8]))
                .is_err()
        );
        let mut altered = id.to_vec();
        altered[0] ^= 1;
        assert!(
            before
                .validate(&quinn_proto::ConnectionId::new(&altered))
                .is_err()
        );
    }

    /// A restarted gateway's herd: packets of many lost connections arrive in one batch (one
    /// wake of quinn's endpoint, one `now`), and every one of them gets its reset. Spaced
    /// resets answered one per batch and left the rest to retransmit.
    #[test]
    // quinn-proto's endpoint takes std's clock, passed in: nothing here reads or waits on it.
    #[allow(clippy::disallowed_types)]
    fn every_packet_of_a_lost_connection_in_a_batch_gets_its_reset() {
        use quinn_proto::ConnectionIdGenerator as _;
        let key = ResetKey::derived_from(b"serving key");
        let cid_key = key.cid;
        let mut issued = keyed_cids(&cid_key);
        let mut endpoint =
            quinn_proto::Endpoint::new(Arc::new(key.endpoint_config()), None, false, Some([7; 32]));
        let now = std::time::Instant::now();
        let remote: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        let mut resets = 0;
        for _ in 0..100 {
            // A short-header packet on a connection ID the key issued: the first byte (fixed
            // bit set), the ID, then what would be the packet number and a protected payload.
            let mut packet = vec![0x40];
            packet.extend_from_slice(&issued.generate_cid());
            packet.extend_from_slice(&[0x5a; 40]);
            let mut response = Vec::new();
            if let Some(quinn_proto::DatagramEvent::Response(_)) = endpoint.handle(
                now,
                remote,
                None,
                None,
                bytes::BytesMut::from(&packet[..]),
                &mut response,
            ) {
                resets += 1;
            }
        }
        assert_eq!(
            resets, 100,
            "every packet of the batch is answered with a reset"
        );
        // A connection ID this key never issued gets nothing.
        let mut foreign = keyed_cids(&ResetKey::derived_from(b"another key").cid);
        let mut packet = vec![0x40];
        packet.extend_from_slice(&foreign.generate_cid());
        packet.extend_from_slice(&[0x5a; 40]);
        let answer = endpoint.handle(
            now,
            remote,
            None,
            None,
            bytes::BytesMut::from(&packet[..]),
            &mut Vec::new(),
        );
        assert!(answer.is_none(), "a foreign connection ID is not answered");
    }

    /// The listener's socket must hold a storm's burst whatever the kernel's default cap: a
    /// process that may pass the cap (root here, `CAP_NET_ADMIN`) gets every byte it asked
    /// for; one that may not keeps what the cap allows (and is told the sysctl to raise).
    #[test]
    fn the_listener_socket_gets_its_buffers_past_the_kernels_cap_where_it_may() {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("a UDP socket");
        let got = widen_listener_buffers(&socket);
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let may_pass_cap = status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
            .is_some_and(|caps| caps & (1 << 12) != 0);
        let cap = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
            .ok()
            .and_then(|c| c.trim().parse::<usize>().ok());
        if may_pass_cap || cap.is_some_and(|c| c >= UDP_BUFFER_BYTES) {
            assert!(
                got.receive >= UDP_BUFFER_BYTES && got.send >= UDP_BUFFER_BYTES,
                "asked {UDP_BUFFER_BYTES} bytes each way (kernel cap {cap:?}), got {got:?}"
            );
        } else {
            // The plain request still takes everything the cap allows.
            let cap = cap.unwrap_or(0);
            assert!(
                got.receive >= cap,
                "the cap allows {cap} bytes, got {got:?}"
            );
        }
    }
}
