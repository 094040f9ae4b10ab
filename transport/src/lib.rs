//! How flotilla's processes reach each other, behind one seam. A session rides a carrier (a
//! bidirectional gRPC call on HTTP/2 over TLS, [`grpc`], or a stream on a QUIC connection,
//! [`quic`]); whichever it is, the session driver sees a [`Link`]: frames in, a bounded
//! channel of frames out. Tunnels are further byte streams on the same connection
//! ([`TunnelStream`]), opened by the gateway ([`TunnelOpener`]) and taken by the agent
//! ([`AgentTunnels`]).
//!
//! Also here, because hub, gateways and agents share them: TLS with the ring provider only
//! ([`tls`]), the peer's identity read from its client certificate ([`identity`]), TCP
//! dialing through HTTP CONNECT proxies ([`dial`]), raw byte relays for upgraded
//! tunnels ([`relay`]), the relay hop that carries a tunnel to the gateway holding its
//! cluster's session ([`hop`]), the hook the agents' listeners ask about each new
//! connection before its handshake ([`gate`]), the session tickets that let a reconnecting agent
//! skip the certificate work of a full handshake ([`tickets`]), and TLS material written to disk
//! atomically and durably ([`files`]). `fuzzing` (hidden) holds the frame codec's fuzz target.
//!
//! Not for: anything the session protocol decides (proto's sans-IO machines do), or what a
//! process does with a session once it has one (gateway and agent drivers).
#![forbid(unsafe_code)]

pub mod codec;
pub mod dial;
pub mod files;
#[doc(hidden)]
pub mod fuzzing;
pub mod gate;
pub mod grpc;
pub mod hop;
pub mod identity;
mod link;
pub mod listen;
pub mod quic;
pub mod quic_turn_away;
pub mod relay;
pub mod tickets;
pub mod tls;
pub mod turn_away;

use std::time::Duration;

use flotilla_proto::wire::{AgentFrame, HubFrame};

pub use link::{Carrier, FrameStream, LINK_BUFFER, Link, LinkError, Pump, TunnelIo, TunnelStream};
pub use tls::ConnInfo;

/// A session a carrier accepted, for the gateway to drive: who the peer is (from its
/// certificate), its frames, and how to open tunnels to it.
pub struct Incoming {
    pub peer: ConnInfo,
    pub link: Link<AgentFrame, HubFrame>,
    pub tunnels: TunnelOpener,
}

impl std::fmt::Debug for Incoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Incoming")
            .field("peer", &self.peer)
            .field("carrier", &self.link.carrier)
            .finish_non_exhaustive()
    }
}

/// Opens tunnel streams to one agent.
#[derive(Clone)]
pub enum TunnelOpener {
    /// The agent opens a `Fleet.Tunnel` call when the session asks (`OpenTunnel`).
    Grpc(grpc::GrpcTunnels),
    /// The gateway opens a QUIC stream itself.
    Quic(quic::QuicTunnels),
}

impl TunnelOpener {
    /// Whether the session must send `OpenTunnel { id }` for [`open`](Self::open) to complete.
    pub fn needs_open_tunnel_frame(&self) -> bool {
        matches!(self, TunnelOpener::Grpc(_))
    }

    /// Opens tunnel `id` to the agent, waiting at most `within` for it.
    pub async fn open(&self, id: &str, within: Duration) -> Result<TunnelStream, LinkError> {
        match self {
            TunnelOpener::Grpc(t) => t.expect(id, within).await,
            TunnelOpener::Quic(t) => {
                tokio::time::timeout(within, t.open(id))
                    .await
                    .map_err(|_| {
                        LinkError::Transport(format!("tunnel {id}: no stream within {within:?}"))
                    })?
            }
        }
    }
}

/// What the agent gets from a dial: the session's link, the pump some carriers need driven
/// beside it, and the tunnels of the same connection.
pub struct Dialed {
    pub link: Link<HubFrame, AgentFrame>,
    pub pump: Option<Pump>,
    pub tunnels: AgentTunnels,
}

/// The agent's side of tunnels.
#[derive(Clone)]
pub enum AgentTunnels {
    Grpc(grpc::AgentTunnels),
    Quic(quic::AgentTunnels),
}

impl AgentTunnels {
    /// The hub's session asked for tunnel `id` (`OpenTunnel`): over gRPC the agent opens it
    /// now (a plain HTTP/2 stream if `bytes`, else a `Tunnel` call); over QUIC the gateway
    /// opens its streams itself and this yields `None`.
    pub async fn open_requested(
        &self,
        id: &str,
        bytes: bool,
    ) -> Option<Result<TunnelStream, LinkError>> {
        match self {
            AgentTunnels::Grpc(t) if bytes => Some(t.open_bytes(id).await),
            AgentTunnels::Grpc(t) => Some(t.open(id).await),
            AgentTunnels::Quic(_) => None,
        }
    }

    /// The next tunnel the gateway opened on its own (QUIC); over gRPC this never yields.
    /// Cancel-safe; the tunnel's id is read by [`quic::AcceptedTunnel::read_id`].
    pub async fn accept(&self) -> Option<quic::AcceptedTunnel> {
        match self {
            AgentTunnels::Grpc(_) => std::future::pending().await,
            AgentTunnels::Quic(t) => t.accept().await,
        }
    }
}
