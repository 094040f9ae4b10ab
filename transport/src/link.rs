//! The seam between a session driver and the carrier under it. Whatever carries a session (a
//! bidirectional gRPC call on HTTP/2, or a QUIC stream), the driver sees a [`Link`]: a stream
//! of frames in, a bounded channel of frames out (the back-pressure point: a driver reserves a
//! slot before it takes the next frame from its protocol machine, so frames wait, coalescing,
//! in the machine and not in a buffer), and which carrier it is.
//!
//! Extra streams for tunnels ride the same connection: the gateway opens one with a
//! [`TunnelOpener`], the agent takes them from [`IncomingTunnels`]. Each is a [`TunnelStream`]
//! of bytes with its own flow control.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::stream::BoxStream;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;

/// Frames buffered between a driver and its carrier in each direction. Small on purpose: the
/// protocol machine coalesces what waits, a buffer would not.
pub const LINK_BUFFER: usize = 8;

/// Which carrier a session rides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Carrier {
    /// A bidirectional gRPC call on an HTTP/2 connection over TLS (TCP).
    Grpc,
    /// A bidirectional stream on a QUIC connection (UDP).
    Quic,
}

impl fmt::Display for Carrier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Carrier::Grpc => "grpc",
            Carrier::Quic => "quic",
        })
    }
}

/// Why a link (or a tunnel stream) stopped carrying frames.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// The peer sent a frame larger than the bound. Not retryable with the same frame: the
    /// session closes, others are unaffected.
    #[error(
        "frame of {size} bytes exceeds the bound of {max} bytes; the session is closed, other sessions are unaffected"
    )]
    TooLarge { size: usize, max: usize },
    /// A frame did not decode. Retryable (a fresh session), but a repeat points to a bug.
    #[error("malformed frame: {0}")]
    Malformed(String),
    /// The TLS handshake failed with `alert` (the TLS alert number: 42 bad certificate, 45
    /// certificate expired, 48 unknown CA, 51 decrypt error, ...), sent by the peer
    /// (`by_peer`: it refused our certificate) or by this side (we refused the peer's). Not
    /// retryable until a certificate changes.
    #[error("{detail}")]
    Tls {
        alert: u8,
        by_peer: bool,
        detail: String,
    },
    /// The gateway is over its new-session rate and turned the connection away before TLS
    /// ([`crate::turn_away`]): come back after `retry_after`, as after a drain.
    #[error("{detail}")]
    TurnedAway {
        retry_after: std::time::Duration,
        detail: String,
    },
    /// Nothing answers at the address: connection refused, no route, no such host. Retryable.
    #[error("{0}")]
    Unreachable(String),
    /// The peer did not answer in time. Retryable.
    #[error("{0}")]
    TimedOut(String),
    /// The HTTP forward proxy on the way refused or could not be reached. Retryable once the
    /// proxy lets the agent through.
    #[error("{detail}")]
    Proxy { refused: bool, detail: String },
    /// The connection or stream failed or was reset. Retryable.
    #[error("{0}")]
    Transport(String),
}

impl LinkError {
    /// Classifies a failed dial from its cause chain: a proxy's answer, a TLS alert either
    /// way, or the socket error, so the agent can tell its operator which one it was.
    pub fn from_dial(error: &(dyn std::error::Error + 'static)) -> LinkError {
        let detail = chain(error);
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
        while let Some(e) = cause {
            if let Some(proxy) = e.downcast_ref::<crate::dial::ProxyError>() {
                return LinkError::Proxy {
                    refused: matches!(proxy, crate::dial::ProxyError::Refused { .. }),
                    detail,
                };
            }
            if let Some(turned) = e.downcast_ref::<crate::turn_away::TurnedAway>() {
                return LinkError::TurnedAway {
                    retry_after: turned.retry_after,
                    detail,
                };
            }
            if let Some(tls) = e.downcast_ref::<rustls::Error>() {
                return match tls {
                    rustls::Error::AlertReceived(alert) => LinkError::Tls {
                        alert: u8::from(*alert),
                        by_peer: true,
                        detail,
                    },
                    other => LinkError::Tls {
                        alert: u8::from(local_alert(other)),
                        by_peer: false,
                        detail,
                    },
                };
            }
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                // An io::Error may carry a rustls or proxy error inside.
                if let Some(inner) = io.get_ref() {
                    let found = LinkError::from_dial(inner);
                    if !matches!(found, LinkError::Transport(_)) {
                        return found;
                    }
                }
                use std::io::ErrorKind as K;
                match io.kind() {
                    K::ConnectionRefused
                    | K::HostUnreachable
                    | K::NetworkUnreachable
                    | K::AddrNotAvailable => return LinkError::Unreachable(detail),
                    K::TimedOut => return LinkError::TimedOut(detail),
                    _ => {}
                }
            }
            cause = e.source();
        }
        if detail.contains("failed to lookup address")
            || detail.contains("Name or service not known")
        {
            return LinkError::Unreachable(detail);
        }
        LinkError::Transport(detail)
    }
}

/// The alert this side sends for a certificate it refuses (as rustls does).
fn local_alert(e: &rustls::Error) -> rustls::AlertDescription {
    use rustls::{AlertDescription as A, CertificateError as C};
    match e {
        rustls::Error::InvalidCertificate(C::UnknownIssuer) => A::UnknownCA,
        rustls::Error::InvalidCertificate(C::Expired | C::ExpiredContext { .. }) => {
            A::CertificateExpired
        }
        rustls::Error::InvalidCertificate(C::BadSignature) => A::DecryptError,
        rustls::Error::InvalidCertificate(_) => A::BadCertificate,
        _ => A::HandshakeFailure,
    }
}

/// An error and its causes, as one line.
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        let more = e.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = e.source();
    }
    text
}

/// Frames arriving from the peer; the stream ends when the peer finishes its side.
pub type FrameStream<T> = BoxStream<'static, Result<T, LinkError>>;

/// One session's frames, whatever the carrier.
pub struct Link<In, Out> {
    /// Frames from the peer, in order.
    pub inbound: FrameStream<In>,
    /// Frames to the peer. Reserve a slot first (`reserve().await`, cancel-safe), then take the
    /// frame from the protocol machine. Dropping the sender ends the stream after what it
    /// holds has been sent.
    pub outbound: mpsc::Sender<Out>,
    /// What carries it.
    pub carrier: Carrier,
}

impl<In, Out> fmt::Debug for Link<In, Out> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Link")
            .field("carrier", &self.carrier)
            .finish_non_exhaustive()
    }
}

/// An extra stream of bytes beside a session's frames (one kubectl request, for example):
/// each direction with its own flow control, so a slow reader of one stream never stalls
/// another, or the session. Implements `AsyncRead` and `AsyncWrite`; shutting down the write
/// side half-closes it.
pub struct TunnelStream {
    /// The tunnel's id, as the gateway named it when it opened the stream.
    pub id: String,
    io: Pin<Box<dyn TunnelIo>>,
}

/// The carrier-specific byte stream under a [`TunnelStream`].
pub trait TunnelIo: AsyncRead + AsyncWrite + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + 'static> TunnelIo for T {}

impl TunnelStream {
    pub fn new(id: impl Into<String>, io: impl TunnelIo) -> TunnelStream {
        TunnelStream {
            id: id.into(),
            io: Box::pin(io),
        }
    }
}

impl fmt::Debug for TunnelStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TunnelStream")
            .field("id", &self.id)
            .finish()
    }
}

impl AsyncRead for TunnelStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.io.as_mut().poll_read(cx, buf)
    }
}

impl AsyncWrite for TunnelStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.io.as_mut().poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.io.as_mut().poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.io.as_mut().poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.io.as_mut().poll_shutdown(cx)
    }
}

/// The writing half of a carrier that needs driving (QUIC): poll it beside the link until it
/// completes, which it does once the link's `outbound` sender is dropped and everything queued
/// has been written (the goodbye included). Bounded: it gives up on a peer that stops
/// acknowledging.
pub type Pump = Pin<Box<dyn Future<Output = ()> + Send>>;
