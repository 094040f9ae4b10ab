//! The session tier's knobs and their defaults: `process` sets them from the
//! `flotilla-gateway` flags, the hub from its own for its in-process gateway.

use std::time::Duration;

use flotilla_transport::grpc::GrpcSettings;
use flotilla_transport::quic::{QuicCongestion, QuicSettings};

use crate::fault::FaultPoint;
use crate::fencing::DEFAULT_GATEWAY_NAME;

/// Knobs of the session tier; every queue and size has a bound.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// This gateway's name, unique in the fleet (`--name` of `flotilla-gateway`; the hub's
    /// in-process gateway is [`DEFAULT_GATEWAY_NAME`]): the gateway its fenced writes name.
    pub name: String,
    pub heartbeat_interval: Duration,
    pub heartbeat_timeout: Duration,
    /// A connection that has not said Hello by then is closed.
    pub hello_timeout: Duration,
    /// Time without a session before a cluster turns Unknown.
    pub grace_period: Duration,
    /// Largest frame accepted from an agent; a larger one closes that session only.
    pub max_frame_bytes: usize,
    /// Distinct works that may wait in one session's outbound queue before it is reset.
    pub session_queue_bound: usize,
    /// Budget of the gateway's status writes to the store (work statuses and cleanup
    /// finalizers together), per second (see [`crate::writes`]).
    pub status_writes_per_second: u32,
    /// Writes the budget lets through at once after a quiet spell.
    pub status_write_burst: u32,
    /// Writes in flight at once, per writer (statuses, finalizers); never two of one work.
    pub status_write_concurrency: usize,
    /// On shutdown each session is drained with a retry-after spread over this window.
    pub drain_window: Duration,
    /// On shutdown, how long drained sessions may take to end before the rest are closed.
    pub drain_timeout: Duration,
    /// New connections per second let through to a session, both carriers together; the
    /// excess is drained at once with a retry-after (see [`crate::rate`]).
    pub session_rate: u32,
    /// New connections let through at once after a quiet spell (the bucket's depth).
    pub session_burst: u32,
    /// QUIC handshakes in progress at once; the excess waits for a slot (briefly, in bounded
    /// numbers) and is refused beyond that, before any crypto.
    pub max_quic_handshakes: usize,
    /// How long the gateway waits for an agent to open a tunnel it asked for.
    pub tunnel_open_timeout: Duration,
    /// A tunnel relayed for another gateway or the hub (the relay hop) that moves no byte
    /// either way for this long is closed. Only a backstop: the caller ends the relay as soon
    /// as its user goes, so this must outlast the quietest legitimate stream (a watch with no
    /// events, which the apiserver ends after at most an hour).
    pub relay_idle_timeout: Duration,
    /// Bytes per second of large works' chunks one session is sent at most: a 10 MiB work
    /// fanned out to a thousand clusters must not take the gateway's whole uplink at once.
    pub chunk_bytes_per_second: u64,
    /// The QUIC carrier's congestion controller for what the gateway sends.
    pub quic_congestion: QuicCongestion,
    /// Where a test may hold fenced writes before their store calls (see [`crate::fault`]):
    /// holds nothing unless a test armed it, and cannot be armed in a release build.
    pub fault: FaultPoint,
}

/// Default for [`GatewayConfig::chunk_bytes_per_second`]: 16 MiB/s per session.
pub const DEFAULT_CHUNK_BYTES_PER_SECOND: u64 = 16 * 1024 * 1024;

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            name: DEFAULT_GATEWAY_NAME.to_owned(),
            heartbeat_interval: Duration::from_secs(10),
            heartbeat_timeout: Duration::from_secs(30),
            hello_timeout: Duration::from_secs(10),
            grace_period: Duration::from_secs(40),
            max_frame_bytes: 4 * 1024 * 1024,
            session_queue_bound: 4096,
            status_writes_per_second: crate::writes::DEFAULT_WRITES_PER_SECOND,
            status_write_burst: crate::writes::DEFAULT_WRITE_BURST,
            status_write_concurrency: crate::writes::DEFAULT_WRITE_CONCURRENCY,
            drain_window: Duration::from_secs(5),
            drain_timeout: Duration::from_secs(20),
            session_rate: crate::rate::DEFAULT_SESSION_RATE,
            session_burst: crate::rate::DEFAULT_SESSION_BURST,
            max_quic_handshakes: crate::process::DEFAULT_MAX_QUIC_HANDSHAKES as usize,
            tunnel_open_timeout: Duration::from_secs(10),
            relay_idle_timeout: Duration::from_secs(2 * 3600),
            chunk_bytes_per_second: DEFAULT_CHUNK_BYTES_PER_SECOND,
            quic_congestion: QuicCongestion::default(),
            fault: FaultPoint::default(),
        }
    }
}

impl GatewayConfig {
    /// The gRPC carrier's settings for these knobs.
    pub fn grpc(&self) -> GrpcSettings {
        GrpcSettings {
            max_frame_bytes: self.max_frame_bytes,
            // HTTP/2 pings find dead TCP connections even when the protocol is idle, and never
            // close one sooner than the protocol's own silence bound: a ping unanswered for a
            // fixed 20 s closed live sessions of agents stalled for less than the heartbeat
            // timeout.
            keepalive_interval: self.heartbeat_interval * 3,
            keepalive_timeout: self.heartbeat_timeout,
            ..GrpcSettings::default()
        }
    }

    /// The QUIC carrier's settings for these knobs.
    pub fn quic(&self) -> QuicSettings {
        QuicSettings {
            max_frame_bytes: self.max_frame_bytes,
            // Never shorter than the protocol's own silence bound.
            idle_timeout: QuicSettings::default()
                .idle_timeout
                .map(|floor| (self.heartbeat_timeout * 2).max(floor)),
            congestion: self.quic_congestion,
            ..QuicSettings::default()
        }
    }
}

/// `--quic-congestion`'s parser (the transport crate has no clap).
pub fn quic_congestion(s: &str) -> Result<QuicCongestion, String> {
    s.parse()
}
