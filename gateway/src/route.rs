//! How the hub's proxy front reaches a cluster's agent: one narrow seam, [`TunnelRoute`].
//!
//! A kubectl request becomes one tunnel stream to the agent of the cluster it names, on that
//! cluster's session connection. Who holds the session decides how the stream is opened: the
//! in-process gateway opens it itself ([`Gateway`]'s implementation, below); in scale-out a
//! gateway that does not hold the cluster forwards the request to the gateway that does (the
//! sharding work implements the trait for that remote owner). The proxy front sees only this
//! trait, so authentication, access rules, limits and audit stay the same in both modes.
//!
//! What a remote implementation (a gateway that does not hold the cluster) has to provide:
//! find the gateway holding `cluster`'s session (the session directory that follows from shard
//! ownership), open one byte stream to it per call (for example a bidirectional call between
//! gateways, authenticated by their certificates, carrying `cluster` and `id`), and have the
//! owner answer it with its own `Gateway::open_tunnel(cluster, id)` spliced onto that stream
//! (`flotilla_transport::relay::relay_bytes`). The result is wrapped with
//! [`TunnelStream::new`]; it must keep per-stream flow control (one slow reader never stalls
//! another tunnel) and half-close (a shutdown ends one direction, data in flight still
//! arrives). The open is bounded like the in-process one; the owner's refusals map onto
//! [`TunnelError`] (`NoSession` with the owner's [`Away`], `Link` otherwise). Nothing else
//! moves: authentication, access rules, limits and the audit stay in the proxy front, and
//! the bytes are the same HTTP/1.1 whichever gateway relays them.
//!
//! Not for: deciding whether a request may go (the proxy front does), or what travels inside
//! the stream (HTTP/1.1 between the proxy front and the agent's tunnel end).

use std::time::SystemTime;

use async_trait::async_trait;
use flotilla_transport::{LinkError, TunnelStream};

use crate::Gateway;

/// Opens tunnel streams to clusters' agents, wherever their sessions are held.
#[async_trait]
pub trait TunnelRoute: Send + Sync + 'static {
    /// Opens tunnel stream `id` (unique per request; it names the stream in both ends' logs and
    /// in the audit) to `cluster`'s agent. Bounded: an agent that does not take the stream
    /// within the route's open timeout is an error, never a hang.
    async fn open(&self, cluster: &str, id: &str) -> Result<TunnelStream, TunnelError>;
}

/// Why a tunnel could not be opened to a cluster.
#[derive(Debug, thiserror::Error)]
pub enum TunnelError {
    /// The cluster has no session where its route leads: its agent is away. Retryable once
    /// the agent reconnects.
    #[error("cluster {cluster} has no session ({away})")]
    NoSession { cluster: String, away: Away },
    /// The session is there but the agent did not take the stream (it is overloaded, or its
    /// connection broke meanwhile). Retryable.
    #[error("cluster {cluster}: {source}")]
    Link {
        cluster: String,
        #[source]
        source: LinkError,
    },
}

/// Since when a cluster without a session has been away, as far as its route knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Away {
    /// Its last session ended then.
    Since(SystemTime),
    /// It has held no session since the route's gateway started then.
    NotSince(SystemTime),
}

impl std::fmt::Display for Away {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (what, at) = match self {
            Away::Since(t) => ("away since", *t),
            Away::NotSince(t) => ("no session since the gateway started at", *t),
        };
        let ago = SystemTime::now()
            .duration_since(at)
            .map(|d| std::time::Duration::from_secs(d.as_secs()))
            .unwrap_or_default();
        write!(
            f,
            "{what} {}, {} ago",
            humantime::format_rfc3339_seconds(at),
            humantime::format_duration(ago)
        )
    }
}

#[async_trait]
impl TunnelRoute for Gateway {
    async fn open(&self, cluster: &str, id: &str) -> Result<TunnelStream, TunnelError> {
        self.open_tunnel(cluster, id).await
    }
}
