//! Why a tunnel stream to a cluster's agent could not be opened ([`TunnelError`]), and since
//! when an agent without a session has been away ([`Away`]): the answer of the gateway holding
//! the session (`serve`) and of the route to it (`route`) alike, so both import it from here.

use std::time::SystemTime;

use flotilla_transport::LinkError;
use flotilla_transport::hop::HopError;

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
    /// No gateway holds the cluster's shard now, or the one the directory named answered that
    /// it no longer does or cannot be reached: the shard is changing hands. Retryable within
    /// a lease period.
    #[error(
        "cluster {cluster}: {detail}; its shard is changing hands between gateways, retry shortly"
    )]
    Unrouted { cluster: String, detail: String },
    /// The gateway holding the cluster's session refused the relay hop itself (this side's
    /// certificate is not a gateway certificate of the hub CA). Not retryable until the
    /// certificates change.
    #[error("cluster {cluster}: {source}")]
    Hop {
        cluster: String,
        #[source]
        source: HopError,
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
