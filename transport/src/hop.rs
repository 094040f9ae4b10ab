//! The relay hop: a tunnel stream to a cluster whose session another gateway holds.
//!
//! In scale-out mode the hub's proxy front is not where the cluster's session is. It calls
//! `Relay.Tunnel` on the gateway that holds the cluster's shard ([`HopClient`]), naming the
//! cluster and the tunnel id in the call's metadata; that gateway opens its own tunnel stream
//! to the agent ([`HopTarget`]) and splices the call onto it with
//! [`relay_bytes`](crate::relay::relay_bytes) ([`RelayService`]). Both ends of the hop see a
//! [`TunnelStream`]; the bytes are the same HTTP/1.1 the proxy front would have written to
//! the agent directly.
//!
//! The hop is a gRPC call on an HTTP/2 connection over mutual TLS, one connection per owning
//! gateway carrying every tunnel to it, so each tunnel keeps its own flow control (HTTP/2
//! stream windows, with a connection window that covers them all: see
//! [`GrpcSettings::for_relay_hop`](crate::grpc::GrpcSettings::for_relay_hop)) and half-close
//! (a data frame `end`, as on the agent's gRPC tunnels). Only a certificate the hub CA issued
//! for a gateway (`O=flotilla:gateways`) may open it: an agent or a kubectl user reaching the
//! gateways' listener is refused before anything is opened.
//!
//! The same service answers `Relay.Presence` ([`HopClient::presence`]): what the gateway
//! knows of the sessions of a batch of clusters ([`OwnerPresence`], from
//! [`HopTarget::presence`]), for the hub's status page in scale-out mode, which asks each
//! shard owner once per page. The same callers only, at most [`MAX_PRESENCE_CLUSTERS`] a call.
//!
//! Not for: deciding whether a request may go (the proxy front's access rules), or which
//! gateway holds a cluster (the shard directory, in the gateway crate).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use flotilla_proto::contract::{
    GATEWAY_GROUP, RELAY_CLUSTER_METADATA, RELAY_TUNNEL_ID_METADATA, is_dns1123_label,
};
use flotilla_proto::wire::relay_client::RelayClient;
use flotilla_proto::wire::relay_server::{Relay, RelayServer};
use flotilla_proto::wire::{
    ClusterPresence, PresenceAnswer, PresenceQuery, PresenceState, TunnelFrame,
};
use futures::{Stream, StreamExt as _};
use tokio::sync::{Mutex, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Code, Request, Response, Status, Streaming};
use tracing::{Instrument as _, debug, debug_span};

use crate::grpc::{frames_io, io_error};
use crate::identity::Peer;
use crate::link::{Carrier, LINK_BUFFER, LinkError, TunnelStream};
use crate::tls::ConnInfo;

/// Longest tunnel id the hop accepts (the proxy front's ids are far shorter).
pub const MAX_TUNNEL_ID_BYTES: usize = 128;

/// Most clusters one `Relay.Presence` call may ask about: a page of the hub's status page.
pub const MAX_PRESENCE_CLUSTERS: usize = 500;

/// Response metadata of a `NoSession` refusal: `ended` (a session ended at `flotilla-away-at`)
/// or `never` (none since the gateway started then).
const AWAY_METADATA: &str = "flotilla-away";
/// Response metadata of a `NoSession` refusal: seconds since the Unix epoch.
const AWAY_AT_METADATA: &str = "flotilla-away-at";

/// Since when a cluster without a session has been away, as the gateway of its shard says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AwaySince {
    /// Whether a session of the cluster ended at `at` (else: none since the gateway started
    /// at `at`).
    pub ended: bool,
    pub at: SystemTime,
}

/// What the gateway asked over `Relay.Presence` knows of a cluster's session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnerPresence {
    /// A session of the cluster is live on it, on `carrier`, since `since` (wall time).
    Connected { carrier: Carrier, since: SystemTime },
    /// It holds the cluster's shard; the cluster's last session there ended at `at`.
    Departed { at: SystemTime },
    /// It holds the cluster's shard and has had no session of it since it started or took the
    /// shard over: nobody can say more.
    Unknown,
    /// It does not hold the cluster's shard now (the caller's directory is stale): its word
    /// on the cluster means nothing.
    NotHeld,
}

impl OwnerPresence {
    fn to_wire(self, cluster: &str) -> ClusterPresence {
        let millis = |t: SystemTime| {
            t.duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
                .unwrap_or(0)
        };
        let (state, carrier, at_unix_ms) = match self {
            OwnerPresence::Connected { carrier, since } => {
                (PresenceState::Connected, carrier.to_string(), millis(since))
            }
            OwnerPresence::Departed { at } => (PresenceState::Departed, String::new(), millis(at)),
            OwnerPresence::Unknown => (PresenceState::Unknown, String::new(), 0),
            OwnerPresence::NotHeld => (PresenceState::NotHeld, String::new(), 0),
        };
        ClusterPresence {
            cluster: cluster.to_string(),
            state: state as i32,
            carrier,
            at_unix_ms,
        }
    }

    /// The wire's answer as the caller reads it; one it cannot read (a carrier or state
    /// from a newer gateway) says nothing: `Unknown`.
    fn from_wire(answer: &ClusterPresence) -> OwnerPresence {
        let at = SystemTime::UNIX_EPOCH
            + Duration::from_millis(u64::try_from(answer.at_unix_ms).unwrap_or(0));
        match PresenceState::try_from(answer.state) {
            Ok(PresenceState::Connected) => match answer.carrier.as_str() {
                "grpc" => OwnerPresence::Connected {
                    carrier: Carrier::Grpc,
                    since: at,
                },
                "quic" => OwnerPresence::Connected {
                    carrier: Carrier::Quic,
                    since: at,
                },
                _ => OwnerPresence::Unknown,
            },
            Ok(PresenceState::Departed) => OwnerPresence::Departed { at },
            Ok(PresenceState::NotHeld) => OwnerPresence::NotHeld,
            Ok(PresenceState::Unknown) | Err(_) => OwnerPresence::Unknown,
        }
    }
}

/// Why the gateway answering a hop did not open the tunnel.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HopRefusal {
    /// It holds the cluster's shard but no session of the cluster. Retryable once the agent
    /// reconnects.
    #[error("no session of cluster {cluster} on this gateway")]
    NoSession { cluster: String, away: AwaySince },
    /// It does not hold the cluster's shard (any more): the caller's directory is stale, a
    /// handover is under way. Retryable once the directory has caught up.
    #[error("{0}")]
    NotHeld(String),
    /// It holds the session but the agent did not take the stream. Retryable.
    #[error("{0}")]
    Link(String),
}

/// Why a hop to the gateway holding a cluster's session failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HopError {
    /// The gateway answered: it would not open the tunnel (retryable, see [`HopRefusal`]).
    #[error("gateway at {address}: {refusal}")]
    Refused {
        address: String,
        refusal: HopRefusal,
    },
    /// The gateway refused this side's certificate or request: not a gateway certificate
    /// (`O=flotilla:gateways`, from `flotilla-hub gateway-cert`), or a malformed target. Not
    /// retryable until the certificate or the caller changes.
    #[error("gateway at {address} refused the relay hop: {detail}")]
    Forbidden { address: String, detail: String },
    /// The gateway could not be reached, or the call broke or timed out. Retryable.
    #[error("gateway at {address}: {source}")]
    Link {
        address: String,
        #[source]
        source: LinkError,
    },
}

/// The gateway side: what the hop's far end opens the tunnel with (the gateway's own
/// sessions).
#[tonic::async_trait]
pub trait HopTarget: Send + Sync + 'static {
    /// Opens tunnel `id` to `cluster`'s agent over the session this gateway holds, bounded.
    async fn open(&self, cluster: &str, id: &str) -> Result<TunnelStream, HopRefusal>;

    /// What this gateway knows of each cluster's session, one answer per cluster in the order
    /// given; [`OwnerPresence::NotHeld`] for clusters of shards it does not hold now. Called
    /// with at most [`MAX_PRESENCE_CLUSTERS`] valid cluster names; answers from memory.
    fn presence(&self, clusters: &[String]) -> Vec<OwnerPresence>;
}

/// `Relay.Tunnel` on a gateway: checks the caller is a gateway, opens the tunnel with its
/// [`HopTarget`], and relays the call's bytes to and from it until both ends finish, either
/// breaks, or nothing has moved for `idle`.
#[derive(Clone)]
pub struct RelayService {
    target: Arc<dyn HopTarget>,
    idle: Duration,
}

impl RelayService {
    /// `idle` bounds a relay nobody ends: the hub side ends it as soon as its user goes, so
    /// it only has to outlast the quietest legitimate stream (a watch with no events).
    pub fn new(target: Arc<dyn HopTarget>, idle: Duration) -> RelayService {
        RelayService { target, idle }
    }

    /// The tonic service, on the gateways' listener beside `Fleet`.
    pub fn into_server(self) -> RelayServer<RelayService> {
        RelayServer::new(self)
    }
}

type OutStream = Pin<Box<dyn Stream<Item = Result<TunnelFrame, Status>> + Send>>;

/// The metadata value `key` of a request, as text.
fn metadata<'a>(request: &'a Request<Streaming<TunnelFrame>>, key: &str) -> Option<&'a str> {
    request.metadata().get(key).and_then(|v| v.to_str().ok())
}

/// The name of the gateway making `request`, or the refusal of any other caller: only
/// gateway certificates of the hub CA may use the relay service.
fn gateway_caller<T>(request: &Request<T>, call: &str) -> Result<String, Status> {
    match request.extensions().get::<ConnInfo>().map(|i| &i.peer) {
        Some(Peer::Gateway { name }) => Ok(name.clone()),
        Some(other) => {
            let who = match other {
                Peer::Cluster(name) => format!("the agent of cluster {name}"),
                Peer::Operator { user, .. } => format!("operator {user}"),
                Peer::User { user, .. } => format!("kubectl user {user}"),
                _ => "a client without a certificate".to_string(),
            };
            debug!(caller = %who, call, "relay call refused: not a gateway");
            Err(Status::permission_denied(format!(
                "{who} may not {call}: only gateway certificates (O={GATEWAY_GROUP}) may"
            )))
        }
        None => Err(Status::internal("connection without TLS information")),
    }
}

/// Whether a tunnel id is one the hop carries: printable ASCII, bounded.
fn valid_tunnel_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_TUNNEL_ID_BYTES && id.bytes().all(|b| b.is_ascii_graphic())
}

#[tonic::async_trait]
impl Relay for RelayService {
    type TunnelStream = OutStream;

    async fn tunnel(
        &self,
        request: Request<Streaming<TunnelFrame>>,
    ) -> Result<Response<OutStream>, Status> {
        let caller = gateway_caller(&request, "open the relay hop")?;
        let cluster = metadata(&request, RELAY_CLUSTER_METADATA)
            .filter(|c| is_dns1123_label(c))
            .ok_or_else(|| {
                Status::invalid_argument(format!(
                    "a relay hop names its cluster (a DNS-1123 label) in {RELAY_CLUSTER_METADATA}"
                ))
            })?
            .to_string();
        let id = metadata(&request, RELAY_TUNNEL_ID_METADATA)
            .filter(|id| valid_tunnel_id(id))
            .ok_or_else(|| {
                Status::invalid_argument(format!(
                    "a relay hop names its tunnel (1 to {MAX_TUNNEL_ID_BYTES} printable ASCII characters) in {RELAY_TUNNEL_ID_METADATA}"
                ))
            })?
            .to_string();
        let agent = self
            .target
            .open(&cluster, &id)
            .await
            .map_err(refusal_status)?;
        let (tx, rx) = mpsc::channel::<TunnelFrame>(LINK_BUFFER);
        let inbound = request.into_inner().map(|r| r.map_err(io_error));
        let call = TunnelStream::new(id.clone(), frames_io(inbound, tx));
        let span = debug_span!("relay hop", %cluster, tunnel = %id, from = %caller);
        let idle = self.idle;
        tokio::spawn(
            async move {
                let (up, down) = crate::relay::relay_bytes(call, agent, idle).await;
                debug!(up, down, "relay hop ended");
            }
            .instrument(span),
        );
        Ok(Response::new(Box::pin(ReceiverStream::new(rx).map(Ok))))
    }

    async fn presence(
        &self,
        request: Request<PresenceQuery>,
    ) -> Result<Response<PresenceAnswer>, Status> {
        gateway_caller(&request, "ask about sessions")?;
        let clusters = request.into_inner().clusters;
        if clusters.len() > MAX_PRESENCE_CLUSTERS {
            return Err(Status::invalid_argument(format!(
                "{} clusters asked about in one call: at most {MAX_PRESENCE_CLUSTERS}; split the batch",
                clusters.len()
            )));
        }
        if let Some(bad) = clusters.iter().find(|c| !is_dns1123_label(c)) {
            let shown: String = bad.chars().take(64).collect();
            return Err(Status::invalid_argument(format!(
                "cluster {shown:?} is not a cluster name (a DNS-1123 label)"
            )));
        }
        let answers = self.target.presence(&clusters);
        Ok(Response::new(PresenceAnswer {
            clusters: clusters
                .iter()
                .zip(answers)
                .map(|(cluster, presence)| presence.to_wire(cluster))
                .collect(),
        }))
    }
}

/// A refusal as the hop's status: the code says which, metadata carries the away time.
fn refusal_status(refusal: HopRefusal) -> Status {
    match &refusal {
        HopRefusal::NoSession { away, .. } => {
            let mut metadata = MetadataMap::new();
            metadata.insert(
                AWAY_METADATA,
                MetadataValue::from_static(if away.ended { "ended" } else { "never" }),
            );
            let secs = away
                .at
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs();
            metadata.insert(
                AWAY_AT_METADATA,
                MetadataValue::try_from(secs.to_string()).expect("digits are valid metadata"),
            );
            Status::with_metadata(Code::NotFound, refusal.to_string(), metadata)
        }
        HopRefusal::NotHeld(message) => Status::failed_precondition(message.clone()),
        HopRefusal::Link(message) => Status::unavailable(message.clone()),
    }
}

/// The caller's reading of a hop's failed status.
fn hop_error(address: &str, cluster: &str, status: Status) -> HopError {
    let address = address.to_string();
    let refused = |refusal| HopError::Refused {
        address: address.clone(),
        refusal,
    };
    match status.code() {
        Code::NotFound => {
            let text = |key| status.metadata().get(key).and_then(|v| v.to_str().ok());
            let at = text(AWAY_AT_METADATA)
                .and_then(|s| s.parse::<u64>().ok())
                .map(|secs| SystemTime::UNIX_EPOCH + Duration::from_secs(secs));
            match at {
                Some(at) => refused(HopRefusal::NoSession {
                    cluster: cluster.to_string(),
                    away: AwaySince {
                        ended: text(AWAY_METADATA) == Some("ended"),
                        at,
                    },
                }),
                // Not the relay's own answer (a gateway without the service, say).
                None => HopError::Forbidden {
                    address,
                    detail: format!("{} ({:?})", status.message(), status.code()),
                },
            }
        }
        Code::FailedPrecondition => refused(HopRefusal::NotHeld(status.message().to_string())),
        Code::Unavailable => refused(HopRefusal::Link(status.message().to_string())),
        Code::PermissionDenied
        | Code::Unauthenticated
        | Code::InvalidArgument
        | Code::Unimplemented => HopError::Forbidden {
            address,
            detail: status.message().to_string(),
        },
        _ => HopError::Link {
            address,
            source: LinkError::Transport(format!("{} ({:?})", status.message(), status.code())),
        },
    }
}

/// Connections the hub keeps to gateways at once; past it, the idle ones are let go. Far
/// above any real number of gateways: it only bounds a directory that churns.
const MAX_HOP_CONNECTIONS: usize = 256;

/// The calling side of the hop: one HTTP/2 connection per gateway address (made on first
/// use, kept, reconnected by tonic when it breaks), a `Relay.Tunnel` call per tunnel and a
/// `Relay.Presence` call per batch. Clones share the connections.
#[derive(Clone)]
pub struct HopClient {
    /// The caller's gateway certificate, trusting the hub CA's bundle.
    tls: Arc<rustls::ClientConfig>,
    /// The name every gateway's certificate is checked against; `None`: the host of the
    /// address dialled. Gateways advertise addresses (pod IPs) their certificates rarely name,
    /// so deployments set one name, as agents do with `--server-name`.
    server_name: Option<String>,
    /// Connections by gateway address. Held only to look up or insert, never while dialling.
    channels: Arc<Mutex<HashMap<String, tonic::transport::Channel>>>,
}

impl HopClient {
    /// A client presenting the gateway certificate in `tls` (built with
    /// [`client_config`](crate::tls::client_config) from the hub CA's bundle).
    pub fn new(tls: Arc<rustls::ClientConfig>) -> HopClient {
        HopClient {
            tls,
            server_name: None,
            channels: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// Checks every gateway's certificate against `name` instead of its address's host.
    pub fn with_server_name(mut self, name: Option<String>) -> HopClient {
        self.server_name = name;
        self
    }

    /// Opens tunnel `id` to `cluster`'s agent through the gateway at `address` (host:port,
    /// as it advertises itself), within `within`: dial (if not connected yet), the call, and
    /// the far gateway's own bounded open.
    pub async fn open(
        &self,
        address: &str,
        cluster: &str,
        id: &str,
        within: Duration,
    ) -> Result<TunnelStream, HopError> {
        let link = |source| HopError::Link {
            address: address.to_string(),
            source,
        };
        let opening = async {
            let channel = self.channel(address).await.map_err(link)?;
            let (tx, rx) = mpsc::channel(LINK_BUFFER);
            let mut request = Request::new(ReceiverStream::new(rx));
            let target = |value: &str| {
                MetadataValue::try_from(value).map_err(|_| HopError::Forbidden {
                    address: address.to_string(),
                    detail: format!("{value:?} cannot travel as metadata"),
                })
            };
            request
                .metadata_mut()
                .insert(RELAY_CLUSTER_METADATA, target(cluster)?);
            request
                .metadata_mut()
                .insert(RELAY_TUNNEL_ID_METADATA, target(id)?);
            let inbound = RelayClient::new(channel)
                .tunnel(request)
                .await
                .map_err(|status| hop_error(address, cluster, status))?
                .into_inner();
            Ok(TunnelStream::new(
                id,
                frames_io(inbound.map(|r| r.map_err(io_error)), tx),
            ))
        };
        match tokio::time::timeout(within, opening).await {
            Ok(opened) => opened,
            Err(_) => Err(link(LinkError::TimedOut(format!(
                "tunnel {id} to cluster {cluster} not opened through the gateway within {within:?}"
            )))),
        }
    }

    /// What the gateway at `address` knows of the sessions of `clusters` (at most
    /// [`MAX_PRESENCE_CLUSTERS`]), within `within` (dial included): an answer for each cluster
    /// it answered about, by name.
    pub async fn presence(
        &self,
        address: &str,
        clusters: &[&str],
        within: Duration,
    ) -> Result<HashMap<String, OwnerPresence>, HopError> {
        let link = |source| HopError::Link {
            address: address.to_string(),
            source,
        };
        let asking = async {
            let channel = self.channel(address).await.map_err(link)?;
            let query = PresenceQuery {
                clusters: clusters.iter().map(|c| c.to_string()).collect(),
            };
            RelayClient::new(channel)
                .presence(Request::new(query))
                .await
                .map_err(|status| hop_error(address, "", status))
        };
        let answer = match tokio::time::timeout(within, asking).await {
            Ok(answer) => answer?.into_inner(),
            Err(_) => {
                return Err(link(LinkError::TimedOut(format!(
                    "no answer about {} clusters' sessions within {within:?}",
                    clusters.len()
                ))));
            }
        };
        // Only answers about clusters asked about count.
        Ok(answer
            .clusters
            .iter()
            .filter(|a| clusters.contains(&a.cluster.as_str()))
            .map(|a| (a.cluster.clone(), OwnerPresence::from_wire(a)))
            .collect())
    }

    /// The connection to `address`, dialled now if there is none.
    async fn channel(&self, address: &str) -> Result<tonic::transport::Channel, LinkError> {
        if let Some(channel) = self.channels.lock().await.get(address) {
            return Ok(channel.clone());
        }
        let host = match &self.server_name {
            Some(name) => name.as_str(),
            None => address
                .rsplit_once(':')
                .map(|(host, _)| host.trim_start_matches('[').trim_end_matches(']'))
                .unwrap_or(address),
        };
        let server_name = rustls_pki_types::ServerName::try_from(host.to_string())
            .map_err(|e| LinkError::Unreachable(format!("gateway address {address}: {e}")))?;
        let hop = crate::grpc::GrpcSettings::default().for_relay_hop();
        let channel = crate::grpc::connect_tuned(
            address,
            server_name,
            self.tls.clone(),
            None,
            None,
            |endpoint| {
                endpoint
                    .initial_stream_window_size(hop.stream_window)
                    .initial_connection_window_size(hop.connection_window)
                    // No session runs on this connection: PINGs find a dead peer gateway.
                    .http2_keep_alive_interval(hop.keepalive_interval)
                    .keep_alive_timeout(hop.keepalive_timeout)
            },
        )
        .await?;
        let mut channels = self.channels.lock().await;
        if channels.len() >= MAX_HOP_CONNECTIONS {
            channels.clear();
        }
        Ok(channels
            .entry(address.to_string())
            .or_insert(channel)
            .clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_cross_the_hop_as_they_were_made() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let check = |refusal: HopRefusal| {
            let back = hop_error("10.0.0.2:9443", "store-7", refusal_status(refusal.clone()));
            assert_eq!(
                back,
                HopError::Refused {
                    address: "10.0.0.2:9443".into(),
                    refusal
                }
            );
        };
        for ended in [true, false] {
            check(HopRefusal::NoSession {
                cluster: "store-7".into(),
                away: AwaySince { ended, at },
            });
        }
        check(HopRefusal::NotHeld(
            "gateway gw-2 does not hold shard 3".into(),
        ));
        check(HopRefusal::Link("the agent did not open tunnel t-1".into()));
        assert!(matches!(
            hop_error("a:1", "store-7", Status::permission_denied("no")),
            HopError::Forbidden { .. }
        ));
    }

    #[test]
    fn presence_crosses_the_wire_as_it_was_given() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_123);
        for presence in [
            OwnerPresence::Connected {
                carrier: Carrier::Grpc,
                since: at,
            },
            OwnerPresence::Connected {
                carrier: Carrier::Quic,
                since: at,
            },
            OwnerPresence::Departed { at },
            OwnerPresence::Unknown,
            OwnerPresence::NotHeld,
        ] {
            let wire = presence.to_wire("store-7");
            assert_eq!(wire.cluster, "store-7");
            assert_eq!(OwnerPresence::from_wire(&wire), presence);
        }
        // A carrier this side does not know says nothing rather than something wrong.
        let mut newer = OwnerPresence::Connected {
            carrier: Carrier::Grpc,
            since: at,
        }
        .to_wire("store-7");
        newer.carrier = "carrier-pigeon".into();
        assert_eq!(OwnerPresence::from_wire(&newer), OwnerPresence::Unknown);
    }

    #[test]
    fn tunnel_ids_are_bounded_printable_ascii() {
        assert!(valid_tunnel_id("t-0001"));
        assert!(!valid_tunnel_id(""));
        assert!(!valid_tunnel_id("with space"));
        assert!(!valid_tunnel_id(&"x".repeat(MAX_TUNNEL_ID_BYTES + 1)));
    }
}
