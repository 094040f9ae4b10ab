//! Why a session ended, and the peer misbehaviour that can end it.

use std::fmt;
use std::time::Duration;

/// A frame from the peer broke the protocol. The session that saw it has already closed itself
/// (queued a `Goodbye` naming the problem and emitted a `Closed` event); the error is returned
/// from `handle_frame` so the driver can log it and decide how hard to back off.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// The peer speaks another session protocol version. Not retryable until one side is
    /// upgraded: reconnecting yields the same answer.
    #[error(
        "peer speaks session protocol version {got}, this side speaks {ours}: upgrade the older side"
    )]
    ProtocolVersion {
        /// The version the peer announced.
        got: u32,
        /// The version this build speaks ([`crate::PROTOCOL_VERSION`]).
        ours: u32,
    },
    /// The hello names a cluster other than the one in the client certificate. Not retryable:
    /// the agent's configuration or certificate must be fixed.
    #[error("certificate identity {cert} does not match hello cluster {hello}")]
    IdentityMismatch {
        /// The cluster name from the client certificate.
        cert: String,
        /// The cluster name the hello claimed.
        hello: String,
    },
    /// A frame that is valid on the wire but not allowed in the session's current state (for
    /// example work before the hello, or a second hello). Retryable: a fresh session starts
    /// from a clean state, but a repeat points to a bug in one of the peers.
    #[error("unexpected {frame} frame while {state}")]
    UnexpectedFrame {
        /// The frame's kind, e.g. `"WorkUpdate"`.
        frame: &'static str,
        /// What the session was doing, e.g. `"waiting for hello"`.
        state: &'static str,
    },
    /// A frame whose content is unusable (for example a welcome with a zero heartbeat
    /// interval). Retryable, but a repeat points to a bug or a misconfigured peer.
    #[error("invalid {frame} frame: {detail}")]
    InvalidFrame {
        /// The frame's kind, e.g. `"Welcome"`.
        frame: &'static str,
        /// What is wrong with it.
        detail: String,
    },
}

impl ProtocolError {
    /// Whether a new session, after the usual backoff, can be expected to fare better.
    pub fn is_retryable(&self) -> bool {
        match self {
            ProtocolError::ProtocolVersion { .. } | ProtocolError::IdentityMismatch { .. } => false,
            ProtocolError::UnexpectedFrame { .. } | ProtocolError::InvalidFrame { .. } => true,
        }
    }
}

/// Why a session closed. Its `Display` is a sentence for operators, and is also what the
/// closing side puts in its `Goodbye` frame, so the peer's logs say the same thing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CloseReason {
    /// Nothing at all was heard from the peer for this long.
    HeartbeatTimeout {
        /// The configured heartbeat timeout that elapsed.
        silent_for: Duration,
    },
    /// The agent connected but sent no hello within this long (hub side), or the hub sent no
    /// welcome within this long (agent side).
    HandshakeTimeout {
        /// The configured handshake timeout that elapsed.
        waited: Duration,
    },
    /// The peer speaks another protocol version.
    ProtocolVersion {
        /// The version the peer announced.
        got: u32,
    },
    /// The hello named a cluster other than the client certificate's.
    IdentityMismatch {
        /// The cluster name from the client certificate.
        cert: String,
        /// The cluster name the hello claimed.
        hello: String,
    },
    /// The peer sent a frame not allowed in the session's state.
    UnexpectedFrame {
        /// The frame's kind.
        frame: &'static str,
        /// What the session was doing.
        state: &'static str,
    },
    /// The peer sent a frame whose content is unusable.
    InvalidFrame {
        /// The frame's kind.
        frame: &'static str,
        /// What is wrong with it.
        detail: String,
    },
    /// The hub had more distinct works waiting for this agent than its bound allows: the agent
    /// is not keeping up. Closing is safe because delivery is level-triggered: the agent
    /// reconnects and the resume sends exactly what it still lacks.
    QueueOverflow {
        /// The bound on distinct pending works that was reached.
        limit: usize,
    },
    /// The hub drained the session (gateway shutdown or rebalancing).
    Drained {
        /// How long the agent should wait before reconnecting.
        retry_after: Duration,
        /// Why the hub drained, as it said.
        reason: String,
    },
    /// The hub refused the session at admission (agent side: as the hub's goodbye said; hub
    /// side: as this hub decided).
    Refused {
        /// What is wrong, for the agent to act on.
        refusal: crate::wire::Refusal,
        /// The hub's words, with what to do.
        reason: String,
    },
    /// The peer said goodbye with this reason.
    PeerGoodbye(String),
    /// The local driver closed the session with this reason.
    Local(String),
}

impl CloseReason {
    /// The goodbye an end sends when it closes for this reason itself (never for one its peer
    /// gave). Both machines send it so: a refusal carries the hub's own sentence and its kind,
    /// for the agent to word for its operator; any other reason, its text.
    pub(crate) fn goodbye(&self) -> crate::wire::Goodbye {
        let (reason, refusal) = match self {
            CloseReason::Refused { refusal, reason } => (reason.clone(), *refusal),
            other => (other.to_string(), crate::wire::Refusal::Unspecified),
        };
        crate::wire::Goodbye {
            reason,
            refusal: refusal.into(),
        }
    }
}

impl From<ProtocolError> for CloseReason {
    fn from(e: ProtocolError) -> Self {
        match e {
            ProtocolError::ProtocolVersion { got, .. } => CloseReason::ProtocolVersion { got },
            ProtocolError::IdentityMismatch { cert, hello } => {
                CloseReason::IdentityMismatch { cert, hello }
            }
            ProtocolError::UnexpectedFrame { frame, state } => {
                CloseReason::UnexpectedFrame { frame, state }
            }
            ProtocolError::InvalidFrame { frame, detail } => {
                CloseReason::InvalidFrame { frame, detail }
            }
        }
    }
}

impl fmt::Display for CloseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CloseReason::HeartbeatTimeout { silent_for } => write!(
                f,
                "heartbeat timeout after {}: nothing heard from the peer for that long",
                human(*silent_for)
            ),
            CloseReason::HandshakeTimeout { waited } => write!(
                f,
                "handshake timeout: no hello/welcome within {}",
                human(*waited)
            ),
            CloseReason::ProtocolVersion { got } => ProtocolError::ProtocolVersion {
                got: *got,
                ours: crate::PROTOCOL_VERSION,
            }
            .fmt(f),
            CloseReason::IdentityMismatch { cert, hello } => {
                write!(
                    f,
                    "certificate identity {cert} does not match hello cluster {hello}"
                )
            }
            CloseReason::UnexpectedFrame { frame, state } => {
                write!(f, "protocol error: unexpected {frame} frame while {state}")
            }
            CloseReason::InvalidFrame { frame, detail } => {
                write!(f, "protocol error: invalid {frame} frame: {detail}")
            }
            CloseReason::QueueOverflow { limit } => write!(
                f,
                "agent is not keeping up: more than {limit} works waiting to be sent; \
                 closing so it reconnects and resyncs"
            ),
            CloseReason::Drained {
                retry_after,
                reason,
            } => write!(
                f,
                "drained by the hub ({reason}); reconnect after {}",
                human(*retry_after)
            ),
            CloseReason::Refused { reason, .. } => write!(f, "refused by the hub: {reason}"),
            CloseReason::PeerGoodbye(reason) => write!(f, "peer closed the session: {reason}"),
            CloseReason::Local(reason) => write!(f, "closed locally: {reason}"),
        }
    }
}

/// Whole seconds as `30s`, anything else as Duration's own debug form (`1.5s`, `250ms`).
fn human(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{d:?}")
    }
}
