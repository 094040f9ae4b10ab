//! The gate every new connection on the agents' listener passes before any TLS work: the
//! carriers ask it once per connection attempt (a TCP connection accepted, a QUIC `Incoming`
//! received) and act on what it says (a QUIC connection carries it, [`ConnInfo::over_rate`]). What to decide
//! and what to count is the gateway's business ([`ConnectionGate`] is implemented there);
//! the carriers only ask early and carry the answer.
//!
//! A connection over the rate is not dropped: dropping it would send its agent into a blind
//! backoff, and the herd would come back as a herd. It is told when to come back, with the
//! retry-after the gate chose, before any TLS work. Over TCP the gateway writes one line in
//! the clear and closes ([`crate::turn_away`]); over QUIC it answers the agent's first packet
//! with a close carrying the same line ([`crate::quic_turn_away`]), or, when that packet is no
//! longer remembered, lets the handshake happen and drains the session at once, before any
//! admission or sync work.
//!
//! A gateway that cannot serve any session yet and cannot say when it will (it has not read who
//! owns what) says [`Entry::NotReady`]: the connection is closed at once, before any TLS work.
//! Its agent backs off as after any failed dial; a handshake spent on a refusal would cost both
//! ends the CPU a cold start under a herd cannot spare.
//!
//! A gateway that knows it will serve in a moment (it is loading the shards it holds) says so
//! through [`ConnectionGate::accepting`]: while that is `false` the carriers stop accepting, and
//! new connections wait where they cost the gateway nothing, in the kernel's accept backlog
//! (TCP) or quinn's queue of incoming connections (QUIC). Closing them instead would send each
//! agent into a backoff that keeps growing while the load runs, so the herd would come back
//! long after the gateway could serve it, and an agent that failed often enough at its home
//! gateway would give that up and be redirected back to it. The agents' dial timeouts bound the
//! wait from their side.
//!
//! [`ConnInfo::over_rate`]: crate::tls::ConnInfo::over_rate

use std::time::Duration;

use tokio::sync::watch;

use crate::link::Carrier;

/// What the gate says of one new connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// Within the rate: the connection goes on to its handshake and its session as usual.
    Admitted,
    /// Over the rate: its agent is told to come back after `retry_after`, before TLS on both
    /// carriers (see the module doc).
    OverRate { retry_after: Duration },
    /// Nothing could be served on it yet: the connection is closed before its handshake.
    NotReady,
}

/// Decides, before any TLS work, whether a new connection may open a session now.
/// Called on the accept path: it must not block or wait.
pub trait ConnectionGate: Send + Sync + std::fmt::Debug {
    /// A connection arrived on `carrier`.
    fn arrived(&self, carrier: Carrier) -> Entry;

    /// `false` while the carriers should not accept at all (new connections wait unaccepted
    /// until it turns `true`); `None`, the default, for a gate that always accepts.
    fn accepting(&self) -> Option<watch::Receiver<bool>> {
        None
    }
}

/// Waits until `accepting` (from [`ConnectionGate::accepting`]) says the carrier may accept;
/// at once when there is no such flag, or when its sender is gone (nothing will hold the
/// connections back any more).
pub(crate) async fn until_accepting(accepting: &mut Option<watch::Receiver<bool>>) {
    if let Some(flag) = accepting
        && flag.wait_for(|a| *a).await.is_err()
    {
        *accepting = None;
    }
}
