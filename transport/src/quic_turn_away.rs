//! Turning a QUIC connection away before its handshake, with a retry-after: what the TCP
//! listener does with [`crate::turn_away`], done in QUIC's own terms.
//!
//! A QUIC server may close a connection attempt in its very first answer: an Initial packet
//! carrying a CONNECTION_CLOSE frame (RFC 9000, 10.2.3). Initial packets are protected with
//! keys both ends derive from the client's first destination connection ID (RFC 9001, 5.2), so
//! that answer costs one symmetric encryption: no certificate, no key exchange, no signature.
//! quinn sends such a close itself ([`quinn::Incoming::refuse`]) but with an empty reason, so
//! nothing could tell the agent when to come back. The gateway writes its own instead: the
//! same frame with error CONNECTION_REFUSED and the TCP notice's words as the reason phrase
//! ([`crate::turn_away::notice`]), which the agent's side reads as the same
//! [`LinkError::TurnedAway`](crate::LinkError::TurnedAway).
//!
//! Addressing that packet needs the connection ID the client chose for itself, which quinn
//! does not hand out with an [`quinn::Incoming`]. [`Watched`] wraps the listener's UDP socket
//! and remembers it from each client Initial packet it receives ([`FirstPackets`], bounded);
//! a connection whose first packet is no longer remembered gets its handshake and a drain, as
//! before this existed.
//!
//! Like the TCP notice, the reason is not authenticated (anyone who sees the client's first
//! packet can derive the Initial keys): a forged one delays an agent by at most
//! [`crate::turn_away::MAX_RETRY_AFTER`].

use std::collections::{HashMap, VecDeque, hash_map};
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, ConnectionId, UdpPoller};

/// Client Initial packets remembered at once (their client's connection ID, by the client's
/// address and first destination ID): enough for the connections quinn holds before they are
/// accepted, about 100 bytes each.
pub const MAX_REMEMBERED: usize = 8_192;

/// The longest connection ID QUIC v1 allows (RFC 9000, 17.2).
const MAX_CID_LEN: usize = 20;
/// QUIC transport error CONNECTION_REFUSED (RFC 9000, 20.1).
const CONNECTION_REFUSED: u8 = 0x02;
/// CONNECTION_CLOSE frame carrying a transport error (RFC 9000, 19.19).
const CONNECTION_CLOSE: u8 = 0x1c;

/// Held for a few map operations, never across an await: the endpoint's receive path and the
/// accept loop each take it once per client Initial packet or connection.
#[allow(clippy::disallowed_types)]
type SyncMutex<T> = std::sync::Mutex<T>;

/// What one client Initial packet said of its connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FirstPacket {
    version: u32,
    /// The connection ID the client chose for itself: the destination of any answer.
    client_cid: ConnectionId,
    /// The retry-after this attempt was turned away with, if it was.
    told: Option<Duration>,
}

/// The client connection IDs of recent client Initial packets, by the client's address and
/// the packet's destination ID; the oldest forgotten past [`MAX_REMEMBERED`].
#[derive(Debug, Default)]
pub struct FirstPackets {
    seen: SyncMutex<Seen>,
}

#[derive(Debug, Default)]
struct Seen {
    by_attempt: HashMap<(SocketAddr, ConnectionId), FirstPacket>,
    order: VecDeque<(SocketAddr, ConnectionId)>,
}

impl FirstPackets {
    /// Remembers the IDs of `datagram` from `from` if it starts with a client Initial packet.
    fn saw(&self, from: SocketAddr, datagram: &[u8]) {
        let Some((version, dst, src)) = initial_ids(datagram) else {
            return;
        };
        let key = (from, dst);
        let mut seen = self.lock();
        // The same attempt's first packet sent again keeps its place and what it was told.
        if let hash_map::Entry::Vacant(vacant) = seen.by_attempt.entry(key) {
            vacant.insert(FirstPacket {
                version,
                client_cid: src,
                told: None,
            });
            seen.order.push_back(key);
            if seen.order.len() > MAX_REMEMBERED
                && let Some(oldest) = seen.order.pop_front()
            {
                seen.by_attempt.remove(&oldest);
            }
        }
    }

    /// The first packet of the attempt from `from` to `dst`, if still remembered.
    fn of(&self, from: SocketAddr, dst: ConnectionId) -> Option<FirstPacket> {
        self.lock().by_attempt.get(&(from, dst)).copied()
    }

    /// Remembers that the attempt from `from` to `dst` was turned away with `retry_after`.
    fn told(&self, from: SocketAddr, dst: ConnectionId, retry_after: Duration) {
        if let Some(first) = self.lock().by_attempt.get_mut(&(from, dst)) {
            first.told = Some(retry_after);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().by_attempt.len()
    }
}

/// The version and the destination and source connection IDs of a client Initial packet at
/// the start of `datagram`; `None` for anything else (short headers, other long packets,
/// version negotiation, IDs longer than QUIC v1 allows, a truncated header).
fn initial_ids(datagram: &[u8]) -> Option<(u32, ConnectionId, ConnectionId)> {
    let (&first, rest) = datagram.split_first()?;
    // Long header, packet type Initial (RFC 9000, 17.2.2).
    if first & 0x80 == 0 || (first >> 4) & 0x03 != 0 {
        return None;
    }
    let version = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?);
    if version == 0 {
        return None;
    }
    let (dst, rest) = cid(rest.get(4..)?)?;
    let (src, _) = cid(rest)?;
    Some((version, dst, src))
}

/// A length-prefixed connection ID and what follows it.
fn cid(bytes: &[u8]) -> Option<(ConnectionId, &[u8])> {
    let (&len, rest) = bytes.split_first()?;
    let len = usize::from(len);
    if len > MAX_CID_LEN {
        return None;
    }
    let id = rest.get(..len)?;
    Some((ConnectionId::new(id), &rest[len..]))
}

/// The listener's UDP socket, remembering the IDs of each client Initial packet it receives
/// in [`FirstPackets`]; everything else is the socket's own.
pub struct Watched {
    inner: Arc<dyn AsyncUdpSocket>,
    first: Arc<FirstPackets>,
}

impl Watched {
    pub fn new(inner: Arc<dyn AsyncUdpSocket>, first: Arc<FirstPackets>) -> Watched {
        Watched { inner, first }
    }
}

impl fmt::Debug for Watched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watched")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl AsyncUdpSocket for Watched {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        self.inner.try_send(transmit)
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [io::IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let received = ready!(self.inner.poll_recv(cx, bufs, meta))?;
        for (buf, meta) in bufs.iter().zip(meta.iter()).take(received) {
            // Datagrams received together (GRO) are `stride` bytes apart.
            let stride = meta.stride.max(1);
            for datagram in buf[..meta.len].chunks(stride) {
                self.first.saw(meta.addr, datagram);
            }
        }
        Poll::Ready(Ok(received))
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

/// Turns QUIC connections away before their handshake: the listener's socket, what it
/// remembered, and the server's Initial keys.
pub struct TurnAway {
    socket: Arc<dyn AsyncUdpSocket>,
    first: Arc<FirstPackets>,
    crypto: Arc<dyn quinn::crypto::ServerConfig>,
}

impl fmt::Debug for TurnAway {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TurnAway").finish_non_exhaustive()
    }
}

impl TurnAway {
    pub fn new(
        socket: Arc<dyn AsyncUdpSocket>,
        first: Arc<FirstPackets>,
        crypto: Arc<dyn quinn::crypto::ServerConfig>,
    ) -> TurnAway {
        TurnAway {
            socket,
            first,
            crypto,
        }
    }

    /// Answers `incoming` with a close telling its agent to come back after `retry_after`, and
    /// lets quinn forget it. Gives `incoming` back when that cannot be done (its first packet
    /// forgotten, a version without Initial keys): the caller serves it another way. A send
    /// the socket cannot take now is dropped like a lost packet (the agent resends its first
    /// packet and is turned away again).
    pub fn turn_away(
        &self,
        incoming: quinn::Incoming,
        retry_after: Duration,
    ) -> Option<quinn::Incoming> {
        let (from, dst) = (incoming.remote_address(), incoming.orig_dst_cid());
        let Some(first) = self.first.of(from, dst) else {
            return Some(incoming);
        };
        self.first.told(from, dst, retry_after);
        self.close(incoming, first, retry_after)
    }

    /// Turns `incoming` away again if its attempt already was (its first packet, sent again,
    /// reached quinn after the answer to it): the same answer, without asking the gate a second
    /// time for one attempt. Gives `incoming` back otherwise.
    pub fn again(&self, incoming: quinn::Incoming) -> Option<quinn::Incoming> {
        let first = self
            .first
            .of(incoming.remote_address(), incoming.orig_dst_cid());
        match first {
            Some(
                first @ FirstPacket {
                    told: Some(retry_after),
                    ..
                },
            ) => self.close(incoming, first, retry_after),
            _ => Some(incoming),
        }
    }

    fn close(
        &self,
        incoming: quinn::Incoming,
        first: FirstPacket,
        retry_after: Duration,
    ) -> Option<quinn::Incoming> {
        let dst = incoming.orig_dst_cid();
        let Ok(keys) = self.crypto.initial_keys(first.version, &dst) else {
            return Some(incoming);
        };
        let reason = crate::turn_away::notice(retry_after);
        // The client's first destination ID, chosen at random by it, serves as this answer's
        // source ID: nothing will be sent to it.
        let packet = close_packet(&keys, first.version, &first.client_cid, &dst, &reason);
        let _ = self.socket.try_send(&Transmit {
            destination: incoming.remote_address(),
            ecn: None,
            contents: &packet,
            segment_size: None,
            src_ip: incoming.local_ip(),
        });
        incoming.ignore();
        None
    }
}

/// When a connection that found every handshake slot taken is to come back: once half the
/// handshakes ahead of it should be done, at the rate handshakes have been finishing, each one
/// told a slot one interval after the last one told (a GCRA like the new-session rate's, with
/// the rate measured instead of configured). Half, not all: one that comes back early finds a
/// place to wait in or is turned away again for the price of two small packets, while one that
/// comes back late leaves the handshake slots idle. Without it such a connection was refused
/// without a reason and its agent fell into a blind backoff, which grew with every refusal
/// while the herd lasted.
#[derive(Debug)]
pub struct Pacer {
    state: SyncMutex<PacerState>,
}

#[derive(Debug)]
struct PacerState {
    /// Handshakes finished (their slot given back) since `since`.
    finished: u32,
    since: tokio::time::Instant,
    /// Whether connections were waiting for a slot each time one finished since `since`: the
    /// rate measured then is what the slots can do, not what arrived.
    saturated: bool,
    /// Handshakes per second the slots can do: the last rate measured while saturated, raised
    /// (never lowered) by a higher one measured otherwise; the first guess until then.
    rate: f64,
    /// The slot the next connection turned away is given, if later than its turn.
    next_slot: tokio::time::Instant,
}

/// The rate assumed when handshakes seem to finish slower than this (none finishing at all:
/// the agents still come back, a few at a time).
const PACE_FLOOR: f64 = 10.0;
/// The longest a connection that found no slot is told to wait.
pub const PACE_MAX: Duration = Duration::from_secs(60);

impl Pacer {
    /// A pacer guessing `first_guess` handshakes per second until it has measured a second.
    pub fn new(first_guess: f64, now: tokio::time::Instant) -> Pacer {
        Pacer {
            state: SyncMutex::new(PacerState {
                finished: 0,
                since: now,
                saturated: true,
                rate: first_guess,
                next_slot: now,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PacerState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A handshake gave its slot back at `now` (done, failed or timed out), with connections
    /// `queued` for a slot or not.
    pub fn finished(&self, now: tokio::time::Instant, queued: bool) {
        let mut state = self.lock();
        state.finished += 1;
        state.saturated &= queued;
        let elapsed = now.saturating_duration_since(state.since);
        if elapsed >= Duration::from_secs(1) {
            let measured = f64::from(state.finished) / elapsed.as_secs_f64();
            state.rate = if state.saturated {
                measured
            } else {
                state.rate.max(measured)
            };
            state.finished = 0;
            state.since = now;
            state.saturated = true;
        }
    }

    /// When a connection turned away at `now`, with `ahead` handshakes in progress or waiting,
    /// is to come back.
    pub fn come_back(&self, now: tokio::time::Instant, ahead: usize) -> Duration {
        let mut state = self.lock();
        let rate = state.rate.max(PACE_FLOOR);
        let turn = now + Duration::from_secs_f64(ahead as f64 / 2.0 / rate).min(PACE_MAX);
        let slot = state.next_slot.max(turn);
        if slot - now >= PACE_MAX {
            return PACE_MAX;
        }
        state.next_slot = slot + Duration::from_secs_f64(1.0 / rate);
        slot - now
    }
}

/// A server Initial packet (packet number 0) carrying one CONNECTION_CLOSE frame with
/// CONNECTION_REFUSED and `reason`, from `local_cid` to `client_cid`, protected with `keys`.
fn close_packet(
    keys: &quinn::crypto::Keys,
    version: u32,
    client_cid: &ConnectionId,
    local_cid: &ConnectionId,
    reason: &[u8],
) -> Vec<u8> {
    let mut frame = vec![CONNECTION_CLOSE, CONNECTION_REFUSED, 0x00];
    put_varint(&mut frame, reason.len() as u64);
    frame.extend_from_slice(reason);
    let tag = keys.packet.local.tag_len();
    // One byte of packet number.
    let mut packet = vec![0xc0];
    packet.extend_from_slice(&version.to_be_bytes());
    for id in [client_cid, local_cid] {
        packet.push(id.len() as u8);
        packet.extend_from_slice(id);
    }
    // No token.
    packet.push(0);
    // Length: the packet number, the frame and the tag, in a two-byte varint (the reason is a
    // short line, far below its 16,383).
    let length = 1 + frame.len() + tag;
    packet.extend_from_slice(&(0x4000 | length as u16).to_be_bytes());
    let number_at = packet.len();
    packet.push(0);
    let header_len = packet.len();
    packet.extend_from_slice(&frame);
    packet.resize(packet.len() + tag, 0);
    keys.packet.local.encrypt(0, &mut packet, header_len);
    keys.header.local.encrypt(number_at, &mut packet);
    packet
}

/// `value` as a QUIC variable-length integer (RFC 9000, 16); at most 2^30 - 1 here.
fn put_varint(out: &mut Vec<u8>, value: u64) {
    match value {
        0..=63 => out.push(value as u8),
        64..=16_383 => out.extend_from_slice(&(0x4000 | value as u16).to_be_bytes()),
        _ => out.extend_from_slice(&(0x8000_0000 | value as u32).to_be_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client Initial header as quinn writes one: long header, type Initial, version 1.
    fn client_initial(dst: &[u8], src: &[u8]) -> Vec<u8> {
        let mut p = vec![0xc3, 0, 0, 0, 1, dst.len() as u8];
        p.extend_from_slice(dst);
        p.push(src.len() as u8);
        p.extend_from_slice(src);
        p.extend_from_slice(&[0, 0x44, 0xd0]);
        p.resize(1200, 0);
        p
    }

    #[test]
    fn a_client_initial_is_read_and_anything_else_is_not() {
        let dst = [1, 2, 3, 4, 5, 6, 7, 8];
        let src = [9, 10, 11, 12];
        assert_eq!(
            initial_ids(&client_initial(&dst, &src)),
            Some((1, ConnectionId::new(&dst), ConnectionId::new(&src)))
        );
        // A short header (an established connection's packet).
        assert_eq!(initial_ids(&[0x40, 1, 2, 3]), None);
        // A Handshake packet (type 2).
        let mut handshake = client_initial(&dst, &src);
        handshake[0] = 0xe3;
        assert_eq!(initial_ids(&handshake), None);
        // Version negotiation.
        let mut negotiation = client_initial(&dst, &src);
        negotiation[1..5].copy_from_slice(&[0, 0, 0, 0]);
        assert_eq!(initial_ids(&negotiation), None);
        // An ID longer than QUIC v1 allows, and a header cut short.
        assert_eq!(initial_ids(&client_initial(&[7; 21], &src)), None);
        assert_eq!(initial_ids(&client_initial(&dst, &src)[..12]), None);
        assert_eq!(initial_ids(&[]), None);
    }

    #[test]
    fn what_is_remembered_is_bounded_and_the_oldest_goes_first() {
        let first = FirstPackets::default();
        let addr = |i: usize| SocketAddr::from(([127, 0, 0, 1], 1000 + (i % 60_000) as u16));
        let dst = |i: usize| (i as u64).to_be_bytes();
        for i in 0..MAX_REMEMBERED + 10 {
            first.saw(addr(i), &client_initial(&dst(i), &[0xaa, i as u8]));
        }
        assert_eq!(first.len(), MAX_REMEMBERED);
        assert_eq!(first.of(addr(0), ConnectionId::new(&dst(0))), None);
        assert_eq!(first.of(addr(9), ConnectionId::new(&dst(9))), None);
        let kept = first
            .of(addr(10), ConnectionId::new(&dst(10)))
            .expect("the eleventh is kept");
        assert_eq!(kept.client_cid, ConnectionId::new(&[0xaa, 10]));
        // The same attempt seen again (a resent first packet) takes no second place, and
        // keeps what it was told.
        let last = MAX_REMEMBERED + 9;
        let told = Duration::from_millis(700);
        first.told(addr(last), ConnectionId::new(&dst(last)), told);
        first.saw(addr(last), &client_initial(&dst(last), &[0xaa, last as u8]));
        assert_eq!(first.len(), MAX_REMEMBERED);
        assert!(first.of(addr(10), ConnectionId::new(&dst(10))).is_some());
        assert_eq!(
            first
                .of(addr(last), ConnectionId::new(&dst(last)))
                .and_then(|f| f.told),
            Some(told)
        );
    }

    #[test]
    fn the_turned_away_come_back_after_the_queue_at_the_measured_rate() {
        let t0 = tokio::time::Instant::now();
        let ms = Duration::from_millis;
        let pacer = Pacer::new(100.0, t0);
        // At the first guess, 100/s: half of 100 ahead take 0.5 s, and each next one 10 ms more.
        assert_eq!(pacer.come_back(t0, 100), ms(500));
        assert_eq!(pacer.come_back(t0, 100), ms(510));
        assert_eq!(pacer.come_back(t0, 100), ms(520));
        // 400 handshakes finish within the next second with others waiting: 400/s from then on.
        for i in 0..400 {
            pacer.finished(t0 + ms(1000 * i / 399), true);
        }
        let t1 = t0 + ms(1000);
        // Slots already given are kept; the next is one interval (2.5 ms) after the last.
        assert_eq!(pacer.come_back(t1, 0), Duration::ZERO);
        assert_eq!(pacer.come_back(t1, 800), ms(1000));
        assert_eq!(pacer.come_back(t1, 800).as_micros(), 1_002_500);
        // A quiet second after it (nobody waiting, few finishing) says nothing of what the
        // slots can do: the rate stays.
        for i in 0..3 {
            pacer.finished(t1 + ms(500 * i), false);
        }
        assert_eq!(pacer.come_back(t1 + ms(1000), 800), ms(1000));
        // A saturated second that finishes 200: 200/s.
        for i in 0..200 {
            pacer.finished(t1 + ms(1000 + 1000 * i / 199), true);
        }
        let t2 = t1 + ms(2000);
        assert_eq!(pacer.come_back(t2, 800), ms(2000));
        // Nothing finishing: the floor, and never more than the cap.
        let stalled = Pacer::new(0.0, t0);
        assert_eq!(stalled.come_back(t0, 10), ms(500));
        assert_eq!(stalled.come_back(t0, 10_000), PACE_MAX);
    }

    #[test]
    fn varints_take_the_shortest_form() {
        let encode = |v| {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            out
        };
        assert_eq!(encode(37), vec![0x25]);
        assert_eq!(encode(15_293), vec![0x7b, 0xbd]);
        assert_eq!(encode(494_878_333), vec![0x9d, 0x7f, 0x3e, 0x7d]);
    }
}
