//! The gate every new connection on the agents' listener passes before any TLS work: the
//! carriers ask it once per connection attempt (a TCP connection accepted, a QUIC `Incoming`
//! received) and tag what it says on the connection ([`ConnInfo::over_rate`]). What to decide
//! and what to count is the gateway's business ([`ConnectionGate`] is implemented there);
//! the carriers only ask early and carry the answer.
//!
//! A connection over the rate is not dropped: dropping it would send its agent into a blind
//! backoff, and the herd would come back as a herd. It still gets its handshake (the refusal
//! needs a TLS session to travel in), and the session on it is drained at once with the
//! retry-after the gate chose, before any admission or sync work.
//!
//! A gateway that cannot serve any session yet (it has not read who owns what, or has loaded
//! none of the shards it holds) says [`Entry::NotReady`]: the connection is closed at once,
//! before any TLS work. Its agent backs off as after any failed dial; a handshake spent on a
//! refusal would cost both ends the CPU a cold start under a herd cannot spare.
//!
//! [`ConnInfo::over_rate`]: crate::tls::ConnInfo::over_rate

use std::time::Duration;

use crate::link::Carrier;

/// What the gate says of one new connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// Within the rate: the connection goes on to its handshake and its session as usual.
    Admitted,
    /// Over the rate: the connection gets its handshake, and a session opened on it is
    /// drained at once, its agent told to come back after `retry_after`.
    OverRate { retry_after: Duration },
    /// Nothing could be served on it yet: the connection is closed before its handshake.
    NotReady,
}

/// Decides, before any TLS work, whether a new connection may open a session now.
/// Called on the accept path: it must not block or wait.
pub trait ConnectionGate: Send + Sync + std::fmt::Debug {
    /// A connection arrived on `carrier`.
    fn arrived(&self, carrier: Carrier) -> Entry;
}
