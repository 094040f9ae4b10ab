//! The session protocol as sans-IO state machines, in the manner of `quinn-proto`.
//!
//! One session per agent, dialled out by the agent. [`AgentSession`] and [`HubSession`] are the
//! two ends; they share nothing but frames ([`crate::wire::AgentFrame`] and
//! [`crate::wire::HubFrame`]). Neither opens a socket or reads a clock: a driver loop per
//! session, in the gateway and in the agent, does
//!
//! 1. feed input: `handle_frame(now, frame)` for each frame read, `handle_timeout(now)` when
//!    the timer fires, and the driver's own calls (`begin_sync`, `upsert_work`, `ack_work`,
//!    `report_status`, `drain`, `close`, ..);
//! 2. write `poll_transmit()` frames to the stream while it accepts them;
//! 3. act on `poll_event()` events;
//! 4. arm its timer at `poll_timeout()`; once `is_closed()` and nothing is left to transmit,
//!    end the stream.
//!
//! The protocol, in order: the agent's `Hello` carries what it holds durably; the hub checks
//! the version and that the hello's cluster is the certificate's, answers `Welcome`, and after
//! [`HubSession::begin_sync`] sends only what differs, then `SyncComplete`. Live changes follow,
//! coalesced per work in a bounded queue, so a slow agent costs a bounded amount of memory and
//! never stalls others; when the bound is hit the session closes and the agent's resume
//! repairs everything, which is safe because delivery is level-triggered. The agent acks what
//! it made durable and reports status; the hub acks stored status. The agent heartbeats, the
//! hub echoes, and either side closes after hearing nothing for the heartbeat timeout. A
//! draining gateway sends `Drain` with a retry-after, which [`Backoff`] honours.
//!
//! Between sessions, [`Reconnect`] (`reconnect`) decides where and when the agent dials next:
//! the backoff, the drain's redirect to the shard's owner and its bound, and the gateway of the
//! last session dialled first, as one state machine.
//!
//! Certificates rotate over the live session: told the certificate's validity, the agent's
//! session emits `RenewalDue` at [`renew_at`] (and schedules retries after a refusal itself),
//! the agent sends `RenewCertificate` with a request for a key it made, the hub answers
//! `CertificateIssued` (or `RenewalRefused`), and the agent uses the new certificate from its
//! next connection on, so the cluster never loses its session for a rotation. After a CA
//! rotation the hub sends `TrustBundle` to agents whose hello shows an older bundle.
//!
//! A hub refuses a session at admission with a `Goodbye` that carries a [`wire::Refusal`]
//! (not registered, denied, not accepted, key not registered), so the agent can say what to
//! do. Cluster health is [`Presence`]: a cluster whose last session ended more than the grace
//! period ago is marked Unknown.
//!
//! [`wire::Refusal`]: crate::wire::Refusal

mod agent;
mod backoff;
mod error;
mod fetch;
mod hub;
mod presence;
mod queue;
pub mod reconnect;
mod renewal;

use std::time::Duration;

pub use agent::{
    AgentConfig, AgentEvent, AgentSession, DEFAULT_WELCOME_TIMEOUT, RENEWAL_MIN_INTERVAL,
    RENEWAL_RETRY_MAX, RENEWAL_RETRY_MIN,
};
pub use backoff::{
    Backoff, BackoffConfig, DEFAULT_BACKOFF_INITIAL, DEFAULT_BACKOFF_MAX, DEFAULT_MAX_RETRY_AFTER,
    DEFAULT_STABLE_AFTER, DEFAULT_STARTUP_JITTER, Jitter, MIN_HUB_DELAY, NoJitter,
};
pub use error::{CloseReason, ProtocolError};
pub use fetch::{CHUNK_RETRY_INITIAL, CHUNK_RETRY_MAX};
pub use hub::{
    DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_HELLO_TIMEOUT,
    DEFAULT_MAX_PENDING_WORKS, HubConfig, HubEvent, HubSession, MAX_CSR_BYTES,
};
pub use presence::{Presence, PresenceEvent};
pub use reconnect::{HOME_DIAL_ATTEMPTS, MAX_REDIRECTS, Next, Reconnect, SessionEnd, Target};
pub use renewal::{RENEW_AT_FRACTION, renew_at};

/// The desired state of one ManifestWork for the cluster, as the gateway hands it to
/// [`HubSession::begin_sync`] and [`HubSession::upsert_work`]. It is exactly the `WorkUpdate`
/// frame that carries it, so nothing is copied on the way out.
pub type DesiredWork = crate::wire::WorkUpdate;

/// What a [`DesiredWork`] carries, by its `kind`: a ManifestWork (the agent applies it) or one
/// of the cluster's governance Policies (the agent evaluates and enforces it). Both ride the
/// same delivery, keyed by uid; only the agent's use of them differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivered {
    Work,
    Policy,
}

impl Delivered {
    /// The `kind` of a [`DesiredWork`] carrying a Policy.
    pub const POLICY: &'static str = "Policy";

    /// What a frame of `kind` carries; `None` for a kind this agent does not know (a newer
    /// hub's), which the agent refuses by name rather than applies.
    pub fn of(kind: &str) -> Option<Delivered> {
        match kind {
            "" | "ManifestWork" => Some(Delivered::Work),
            Delivered::POLICY => Some(Delivered::Policy),
            _ => None,
        }
    }

    /// The `kind` field for a frame carrying this.
    pub fn kind(self) -> &'static str {
        match self {
            Delivered::Work => "",
            Delivered::Policy => Delivered::POLICY,
        }
    }
}

/// What the agent holds durably, one entry per work, for [`AgentSession::new`].
pub type HeldWork = crate::wire::HeldWork;

/// Most chunk requests an agent keeps outstanding on its session (see `ChunkRequest` in
/// session.proto). Two keep the link busy (one chunk in flight while the next is read from the
/// store) while bounding a large work's bytes ahead of a heartbeat to two chunks, 1 MiB.
pub const CHUNK_WINDOW: usize = 2;

/// Milliseconds for a `u32` wire field, saturating: 49 days is beyond any interval we send.
fn duration_ms(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}
