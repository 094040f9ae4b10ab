//! How the hub's proxy front reaches a cluster's agent: one narrow seam, [`TunnelRoute`].
//!
//! A kubectl request becomes one tunnel stream to the agent of the cluster it names, on that
//! cluster's session connection. Who holds the session decides how the stream is opened: the
//! in-process gateway opens it itself ([`Gateway`]'s implementation, below, single-node mode);
//! in scale-out [`ShardRoute`] finds the gateway holding the cluster's shard in the shard
//! directory (which follows from the leases) and opens the stream through it over the relay
//! hop (`flotilla_transport::hop`): one `Relay.Tunnel` call on a mutually authenticated
//! HTTP/2 connection to that gateway, which answers it with its own
//! [`Gateway::open_tunnel`] spliced onto the call ([`Gateway`]'s `HopTarget`, below). The
//! proxy front sees only the trait, so authentication, access rules, limits and audit stay
//! the same in both modes, once per request, whichever gateway relays; the bytes are the same
//! HTTP/1.1 either way.
//!
//! Each tunnel keeps its own flow control and half-close across the hop (an HTTP/2 stream of
//! its own, `end` frames as on the agent's gRPC tunnels). The open is bounded on both sides;
//! a directory entry gone stale (the owner just lost the shard: it answers that it does not
//! hold it) or a shard nobody holds is [`TunnelError::Unrouted`], retryable, never a hang.
//!
//! Not for: deciding whether a request may go (the proxy front does), or what travels inside
//! the stream (HTTP/1.1 between the proxy front and the agent's tunnel end).

use async_trait::async_trait;
use flotilla_transport::hop::{
    AwaySince, HopClient, HopError, HopRefusal, HopTarget, OwnerPresence,
};
use flotilla_transport::{LinkError, TunnelStream};
use tokio::time::Instant;

use crate::Gateway;
use crate::registry::SessionPresence;
use crate::shards::Route;
use crate::tunnel::{Away, TunnelError};

/// Opens tunnel streams to clusters' agents, wherever their sessions are held.
#[async_trait]
pub trait TunnelRoute: Send + Sync + 'static {
    /// Opens tunnel stream `id` (unique per request; it names the stream in both ends' logs and
    /// in the audit) to `cluster`'s agent. Bounded: an agent that does not take the stream
    /// within the route's open timeout is an error, never a hang.
    async fn open(&self, cluster: &str, id: &str) -> Result<TunnelStream, TunnelError>;
}

#[async_trait]
impl TunnelRoute for Gateway {
    async fn open(&self, cluster: &str, id: &str) -> Result<TunnelStream, TunnelError> {
        self.open_tunnel(cluster, id).await
    }
}

/// How much longer than the owning gateway's own tunnel open the hop may take: the dial to
/// that gateway when there is no connection yet.
const HOP_DIAL_ALLOWANCE: std::time::Duration = std::time::Duration::from_secs(5);

/// The scale-out route: to the gateway holding the cluster's shard, as this gateway's shard
/// directory says, over the relay hop; to this gateway's own sessions for the shards it holds.
pub struct ShardRoute {
    gateway: Gateway,
    hop: HopClient,
}

impl ShardRoute {
    /// Routes by `gateway`'s shard view, reaching other gateways with `hop` (which presents a
    /// gateway certificate of the hub CA).
    pub fn new(gateway: Gateway, hop: HopClient) -> ShardRoute {
        ShardRoute { gateway, hop }
    }
}

#[async_trait]
impl TunnelRoute for ShardRoute {
    async fn open(&self, cluster: &str, id: &str) -> Result<TunnelStream, TunnelError> {
        let route = self
            .gateway
            .shard_views()
            .borrow()
            .route(cluster, Instant::now());
        match route {
            Route::Here { .. } => self.gateway.open_tunnel(cluster, id).await,
            Route::Elsewhere {
                shard,
                owner,
                address,
            } => {
                let within = self.gateway.tunnel_open_timeout() + HOP_DIAL_ALLOWANCE;
                tracing::debug!(%cluster, tunnel = %id, shard, %owner, %address, "tunnel relayed to the shard's owner");
                self.hop
                    .open(&address, cluster, id, within)
                    .await
                    .map_err(|e| hop_failure(cluster, &owner, e))
            }
            Route::Unowned { shard } => Err(TunnelError::Unrouted {
                cluster: cluster.to_string(),
                detail: format!("no gateway holds its shard {shard} now"),
            }),
        }
    }
}

/// A failed hop as the proxy front's error: the owner's own refusals as if it were local.
fn hop_failure(cluster: &str, owner: &str, error: HopError) -> TunnelError {
    let cluster = cluster.to_string();
    match error {
        HopError::Refused {
            refusal: HopRefusal::NoSession { away, .. },
            ..
        } => TunnelError::NoSession {
            cluster,
            away: if away.ended {
                Away::Since(away.at)
            } else {
                Away::NotSince(away.at)
            },
        },
        HopError::Refused {
            refusal: HopRefusal::NotHeld(detail),
            ..
        } => TunnelError::Unrouted {
            cluster,
            detail: format!("gateway {owner}, its owner in the directory, answered: {detail}"),
        },
        HopError::Refused {
            refusal: HopRefusal::Link(detail),
            ..
        } => TunnelError::Link {
            cluster,
            source: LinkError::Transport(format!("through gateway {owner}: {detail}")),
        },
        // An owner that cannot be reached has died or is leaving: its shard is about to move.
        HopError::Link { address, source } => TunnelError::Unrouted {
            cluster,
            detail: format!(
                "gateway {owner}, its owner in the directory, cannot be reached at {address} ({source})"
            ),
        },
        other @ HopError::Forbidden { .. } => TunnelError::Hop {
            cluster,
            source: other,
        },
    }
}

/// The far end of the relay hop: a tunnel to one of this gateway's sessions, for a gateway or
/// the hub that routed here. Only for a shard this gateway holds now.
#[async_trait]
impl HopTarget for Gateway {
    async fn open(&self, cluster: &str, id: &str) -> Result<TunnelStream, HopRefusal> {
        let route = self.shard_views().borrow().route(cluster, Instant::now());
        if let Route::Elsewhere { shard, .. } | Route::Unowned { shard } = route {
            return Err(HopRefusal::NotHeld(format!(
                "this gateway does not hold shard {shard} of cluster {cluster} now"
            )));
        }
        self.open_tunnel(cluster, id).await.map_err(|e| match e {
            TunnelError::NoSession { cluster, away } => HopRefusal::NoSession {
                cluster,
                away: match away {
                    Away::Since(at) => AwaySince { ended: true, at },
                    Away::NotSince(at) => AwaySince { ended: false, at },
                },
            },
            other => HopRefusal::Link(other.to_string()),
        })
    }

    /// Answers from this gateway's sessions for the shards it holds now, by the same view the
    /// tunnel open checks. A departure it recorded before it lost a shard and took it back
    /// may predate a session the cluster had elsewhere meanwhile: the page then shows an
    /// earlier last-seen, never a session that is not there.
    fn presence(&self, clusters: &[String]) -> Vec<OwnerPresence> {
        let views = self.shard_views();
        let view = views.borrow();
        let now = Instant::now();
        clusters
            .iter()
            .map(|cluster| match view.route(cluster, now) {
                Route::Here { .. } => match self.session_presence(cluster) {
                    Some(SessionPresence::Connected { carrier, since }) => {
                        OwnerPresence::Connected { carrier, since }
                    }
                    Some(SessionPresence::Departed { at }) => OwnerPresence::Departed { at },
                    None => OwnerPresence::Unknown,
                },
                Route::Elsewhere { .. } | Route::Unowned { .. } => OwnerPresence::NotHeld,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use super::*;
    use crate::GatewayConfig;
    use crate::shards::{DirectoryEntry, ShardDirectory, ShardView};
    use flotilla_proto::contract::shard_of;

    const CLUSTER: &str = "store-7";

    fn gateway(dir: &std::path::Path) -> Gateway {
        let store = flotilla_store::SledStore::open(dir.join("store")).unwrap();
        Gateway::new(Arc::new(store), GatewayConfig::default())
    }

    fn hop_client() -> HopClient {
        let tls = rustls::ClientConfig::builder_with_provider(flotilla_transport::tls::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        HopClient::new(Arc::new(tls))
    }

    /// A view holding no shard, with `owner` (if any) holding `CLUSTER`'s at `address`.
    fn view_without_the_shard(address: Option<&str>) -> ShardView {
        let entries = address
            .map(|a| {
                (
                    shard_of(CLUSTER, 64),
                    DirectoryEntry {
                        owner: "gw-2".into(),
                        address: Some(a.into()),
                        epoch: 4,
                    },
                )
            })
            .into_iter()
            .collect();
        ShardView::leased(64, BTreeMap::new(), ShardDirectory::new(64, entries))
    }

    #[tokio::test]
    async fn a_stale_or_missing_owner_is_a_retryable_refusal_naming_the_cluster() {
        let dir = tempfile::tempdir().unwrap();
        let gateway = gateway(dir.path());
        gateway.set_shard_view(view_without_the_shard(None));

        // Nobody holds the shard: the route says so at once, naming the cluster.
        let route = ShardRoute::new(gateway.clone(), hop_client());
        let err = route.open(CLUSTER, "t-1").await.unwrap_err();
        assert!(matches!(err, TunnelError::Unrouted { .. }), "{err:?}");
        assert!(err.to_string().contains(CLUSTER), "{err}");

        // A gateway asked over the hop for a shard it does not hold (the caller's directory
        // is stale) refuses without opening anything...
        let refusal = HopTarget::open(&gateway, CLUSTER, "t-2").await.unwrap_err();
        assert!(matches!(refusal, HopRefusal::NotHeld(_)), "{refusal:?}");
        // ...and the caller tells its user the shard is moving, retryable, naming the cluster.
        let err = hop_failure(
            CLUSTER,
            "gw-2",
            HopError::Refused {
                address: "127.0.0.1:1".into(),
                refusal,
            },
        );
        assert!(matches!(err, TunnelError::Unrouted { .. }), "{err:?}");
        assert!(err.to_string().contains(CLUSTER), "{err}");
    }

    #[tokio::test]
    async fn presence_is_answered_only_for_shards_held_now() {
        let dir = tempfile::tempdir().unwrap();
        let gateway = gateway(dir.path());
        let asked = [CLUSTER.to_string(), "store-8".to_string()];

        // Holding every shard but with no session yet: it can say nothing more than that.
        gateway.set_shard_view(ShardView::all(64));
        assert_eq!(
            HopTarget::presence(&gateway, &asked),
            vec![OwnerPresence::Unknown, OwnerPresence::Unknown]
        );

        // Holding none (its shard went to gw-2, or to nobody): "not mine", never a
        // "disconnected" the page would show as the truth.
        for owner in [Some("127.0.0.1:1"), None] {
            gateway.set_shard_view(view_without_the_shard(owner));
            assert_eq!(
                HopTarget::presence(&gateway, &asked),
                vec![OwnerPresence::NotHeld, OwnerPresence::NotHeld],
                "owner {owner:?}"
            );
        }
    }

    #[tokio::test]
    async fn an_owner_that_cannot_be_reached_is_an_error_within_the_bound() {
        let dir = tempfile::tempdir().unwrap();
        let gateway = gateway(dir.path());
        // The directory names an owner at an address where nothing listens (it just died).
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        gateway.set_shard_view(view_without_the_shard(Some(&closed.to_string())));
        let route = ShardRoute::new(gateway, hop_client());
        let err = route.open(CLUSTER, "t-1").await.unwrap_err();
        assert!(matches!(err, TunnelError::Unrouted { .. }), "{err:?}");
        assert!(err.to_string().contains(CLUSTER), "{err}");
    }
}
