//! The agent's end of tunnels: each tunnel stream the hub opens carries one kubectl request as
//! HTTP/1.1; the agent checks the hub user's identity in it, forwards it to the spoke's
//! apiserver ([`SpokeApi`]) with its own credentials and the impersonation headers, so the
//! spoke's RBAC decides, and streams the response back as it comes (watches, `logs -f`). A
//! `101 Switching Protocols` turns the stream into a raw byte relay both ways (exec, attach,
//! port-forward over WebSocket or SPDY).
//!
//! One [`TunnelServer`] task per agent owns every tunnel, each in its own task of its
//! `JoinSet`, at most `max_tunnels` at once (the excess is answered 429 while a few slots for
//! answering remain, and dropped beyond). The session driver only tells it, without waiting,
//! about each session's tunnels ([`TunnelHandle`]): a tunnel never runs in the driver's loop,
//! so a slow or stalled tunnel costs the session nothing. Each tunnel has its own flow control
//! on the carrier, so one slow reader stalls only its own stream.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use flotilla_proto::tunnel;
use flotilla_transport::{AgentTunnels, TunnelStream};
use futures::FutureExt as _;
use futures::future::BoxFuture;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt as _, Full};
use hyper_util::rt::TokioIo;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tracing::{Instrument as _, debug, info_span, warn};

use crate::spoke_api::{BoxError, SpokeApi, TunnelBody};

/// Default of the agent's `--max-tunnels`.
pub const DEFAULT_MAX_TUNNELS: usize = 64;
/// Default of `--tunnel-idle-timeout`: an upgraded stream (exec, attach, port-forward) with no
/// byte either way for this long is closed.
pub const DEFAULT_TUNNEL_IDLE_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// Largest request head (request line and headers) a tunnel accepts.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
/// How long the hub may take to send a tunnel's request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// Tunnels the server still answers with a 429 beyond `max_tunnels`; further ones are
/// dropped (the gateway's wait for them times out).
const REFUSAL_SLOTS: usize = 16;
/// Session events waiting for the tunnel server; the driver never waits on it.
const COMMAND_BUFFER: usize = 256;

/// Knobs of the tunnel end.
#[derive(Clone, Debug)]
pub struct TunnelConfig {
    /// This agent's cluster, for messages.
    pub cluster: String,
    /// Tunnels served at once.
    pub max_tunnels: usize,
    /// An upgraded stream idle this long is closed.
    pub idle_timeout: Duration,
}

/// What the session driver tells the tunnel server.
enum Command {
    /// A new session's connection: over QUIC the gateway opens tunnel streams on it itself.
    Session(AgentTunnels),
    /// The hub asked for tunnel `id` (`OpenTunnel`, gRPC): the agent opens it on `tunnels`,
    /// as a plain HTTP/2 stream if `bytes`.
    Requested {
        tunnels: AgentTunnels,
        id: String,
        bytes: bool,
    },
}

/// The session driver's handle on the tunnel server. Never waits: a server that is behind
/// loses the request (its tunnel times out at the gateway) rather than slowing the session.
#[derive(Clone)]
pub struct TunnelHandle {
    commands: mpsc::Sender<Command>,
}

impl TunnelHandle {
    /// A session opened with these tunnels.
    pub fn session(&self, tunnels: &AgentTunnels) {
        if let AgentTunnels::Quic(_) = tunnels {
            self.send(Command::Session(tunnels.clone()));
        }
    }

    /// The hub asked for tunnel `id` on this session (as a plain HTTP/2 stream if `bytes`).
    pub fn requested(&self, tunnels: &AgentTunnels, id: String, bytes: bool) {
        self.send(Command::Requested {
            tunnels: tunnels.clone(),
            id,
            bytes,
        });
    }

    /// A handle whose server is gone (tests of the session alone).
    #[cfg(test)]
    pub(crate) fn unconnected() -> TunnelHandle {
        TunnelHandle {
            commands: mpsc::channel(1).0,
        }
    }

    fn send(&self, command: Command) {
        if let Err(e) = self.commands.try_send(command) {
            warn!(error = %e, "tunnel request dropped: the agent's tunnel server is behind or stopped");
        }
    }
}

/// Serves the agent's tunnels until told to stop.
pub struct TunnelServer {
    config: TunnelConfig,
    spoke: Arc<dyn SpokeApi>,
    commands: mpsc::Receiver<Command>,
}

/// How a tunnel stream is answered.
#[derive(Clone, Copy)]
enum Answer {
    Serve,
    Refuse,
}

impl TunnelServer {
    /// A server forwarding to `spoke`, and the handle its session driver uses.
    pub fn new(config: TunnelConfig, spoke: Arc<dyn SpokeApi>) -> (TunnelServer, TunnelHandle) {
        let (tx, commands) = mpsc::channel(COMMAND_BUFFER);
        (
            TunnelServer {
                config,
                spoke,
                commands,
            },
            TunnelHandle { commands: tx },
        )
    }

    /// Runs until `stop` turns true (or every handle is gone); tunnels still open then are
    /// closed.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut serving: JoinSet<()> = JoinSet::new();
        let mut refusing: JoinSet<()> = JoinSet::new();
        // The QUIC connection of the current session, whose streams the gateway opens.
        let mut quic: Option<AgentTunnels> = None;
        loop {
            let answer = if serving.len() < self.config.max_tunnels {
                Some(Answer::Serve)
            } else if refusing.len() < REFUSAL_SLOTS {
                Some(Answer::Refuse)
            } else {
                None
            };
            tokio::select! {
                command = self.commands.recv() => match command {
                    Some(Command::Session(tunnels)) => quic = Some(tunnels),
                    Some(Command::Requested { tunnels, id, bytes }) => {
                        let Some(answer) = answer else {
                            warn!(tunnel = %id, max = self.config.max_tunnels, "tunnel dropped: every slot is busy");
                            continue;
                        };
                        let opening = async move {
                            match tunnels.open_requested(&id, bytes).await {
                                Some(Ok(stream)) => Some(stream),
                                Some(Err(e)) => {
                                    warn!(tunnel = %id, error = %e, "cannot open the tunnel the hub asked for");
                                    None
                                }
                                None => None,
                            }
                        };
                        self.spawn(&mut serving, &mut refusing, answer, opening.boxed());
                    }
                    None => break,
                },
                stream = accept(quic.as_ref()), if quic.is_some() => match stream {
                    Some(accepted) => match answer {
                        // Its header is read in the tunnel's task: it may wait a retransmission.
                        Some(answer) => {
                            self.spawn(&mut serving, &mut refusing, answer, accepted.read_id().boxed());
                        }
                        None => warn!("tunnel dropped: every slot is busy"),
                    },
                    // The connection is gone; the next session brings another.
                    None => quic = None,
                },
                Some(_) = serving.join_next(), if !serving.is_empty() => {}
                Some(_) = refusing.join_next(), if !refusing.is_empty() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        serving.shutdown().await;
        refusing.shutdown().await;
    }

    fn spawn(
        &self,
        serving: &mut JoinSet<()>,
        refusing: &mut JoinSet<()>,
        answer: Answer,
        opening: BoxFuture<'static, Option<TunnelStream>>,
    ) {
        let (config, spoke) = (self.config.clone(), self.spoke.clone());
        match answer {
            Answer::Serve => {
                serving.spawn(async move {
                    if let Some(stream) = opening.await {
                        let span = info_span!("tunnel", id = %stream.id);
                        serve_tunnel(stream, spoke, config).instrument(span).await;
                    }
                });
            }
            Answer::Refuse => {
                refusing.spawn(async move {
                    if let Some(stream) = opening.await {
                        let span = info_span!("tunnel", id = %stream.id);
                        refuse_tunnel(stream, config).instrument(span).await;
                    }
                });
            }
        }
    }
}

async fn accept(
    tunnels: Option<&AgentTunnels>,
) -> Option<flotilla_transport::quic::AcceptedTunnel> {
    match tunnels {
        Some(t) => t.accept().await,
        None => std::future::pending().await,
    }
}

/// An upgraded connection's relay, handed from the request handler to the tunnel's task.
type Relay = BoxFuture<'static, ()>;

/// Serves the one request of a tunnel stream, then the relay if it was upgraded.
async fn serve_tunnel(stream: TunnelStream, spoke: Arc<dyn SpokeApi>, config: TunnelConfig) {
    let (relays, mut relay) = mpsc::channel::<Relay>(1);
    let service = hyper::service::service_fn(move |request| {
        let (spoke, config, relays) = (spoke.clone(), config.clone(), relays.clone());
        async move { Ok::<_, std::convert::Infallible>(forward(request, spoke, config, relays).await) }
    });
    let connection = http1_server()
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades();
    if let Err(e) = connection.await {
        debug!(error = %e, "tunnel connection ended");
    }
    if let Ok(relay) = relay.try_recv() {
        relay.await;
    }
}

/// Answers a tunnel with 429: the agent serves as many tunnels as it may already.
async fn refuse_tunnel(stream: TunnelStream, config: TunnelConfig) {
    let service = hyper::service::service_fn(move |_request| {
        let config = config.clone();
        async move {
            Ok::<_, std::convert::Infallible>(failure(
                StatusCode::TOO_MANY_REQUESTS,
                "TooManyRequests",
                &format!(
                    "the agent of cluster {} serves {} tunnels already (its --max-tunnels); try again shortly",
                    config.cluster, config.max_tunnels
                ),
            ))
        }
    });
    let connection = http1_server().serve_connection(TokioIo::new(stream), service);
    let _ = tokio::time::timeout(HEAD_TIMEOUT, connection).await;
}

fn http1_server() -> hyper::server::conn::http1::Builder {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .max_buf_size(MAX_HEADER_BYTES)
        // The hub sends one request per stream and closes its side once it has read the whole
        // response; keeping the connection until then holds the stream open while the
        // response's last bytes are in flight (a gRPC tunnel dropped early is cancelled, and
        // what it had not yet sent is lost). The head timeout bounds the wait.
        .keep_alive(true);
    builder
}

/// Forwards one request to the spoke apiserver and returns its response; an upgrade's relay
/// goes to `relays` for the tunnel's task to run.
async fn forward(
    mut request: Request<hyper::body::Incoming>,
    spoke: Arc<dyn SpokeApi>,
    config: TunnelConfig,
    relays: mpsc::Sender<Relay>,
) -> Response<TunnelBody> {
    let (user, groups) = match tunnel::identity(request.headers()) {
        Ok(identity) => identity,
        Err(refusal) => {
            warn!(%refusal, "tunnel request refused");
            return failure(StatusCode::FORBIDDEN, "Forbidden", &refusal.to_string());
        }
    };
    let upgrade = tunnel::is_upgrade(request.headers());
    let downstream = upgrade.then(|| hyper::upgrade::on(&mut request));
    let (mut parts, body) = request.into_parts();
    debug!(%user, ?groups, method = %parts.method, path = %parts.uri.path(), upgrade, "forwarding to the spoke apiserver");
    // The impersonation the hub set stays; nothing else that could carry credentials does.
    let impersonation: Vec<_> = [tunnel::IMPERSONATE_USER, tunnel::IMPERSONATE_GROUP]
        .into_iter()
        .flat_map(|name| {
            parts
                .headers
                .get_all(&name)
                .iter()
                .map(|v| (name.clone(), v.clone()))
                .collect::<Vec<_>>()
        })
        .collect();
    tunnel::strip_credentials(&mut parts.headers);
    for (name, value) in impersonation {
        parts.headers.append(name, value);
    }
    tunnel::remove_hop_by_hop(&mut parts.headers);
    parts.headers.remove(http::header::HOST);
    parts.headers.remove(tunnel::TUNNEL_ID);
    // Origin form: the spoke client puts its own server in front.
    parts.uri = match parts.uri.path_and_query() {
        Some(pq) => pq.as_str().parse().unwrap_or_default(),
        None => http::Uri::from_static("/"),
    };
    let outbound = Request::from_parts(parts, body.map_err(BoxError::from).boxed());
    let mut response = match spoke.send(outbound).await {
        Ok(response) => response,
        Err(e) => {
            warn!(error = %e, "cannot forward to the spoke apiserver");
            return failure(
                StatusCode::BAD_GATEWAY,
                "ServiceUnavailable",
                &format!("cluster {}: {e}", config.cluster),
            );
        }
    };
    if let Some(downstream) = downstream
        && response.status() == StatusCode::SWITCHING_PROTOCOLS
    {
        let upstream = hyper::upgrade::on(&mut response);
        let idle = config.idle_timeout;
        let relay = async move {
            match tokio::try_join!(downstream, upstream) {
                Ok((down, up)) => {
                    let (sent, received) = flotilla_transport::relay::relay_bytes(
                        TokioIo::new(down),
                        TokioIo::new(up),
                        idle,
                    )
                    .await;
                    debug!(sent, received, "upgraded stream closed");
                }
                Err(e) => warn!(error = %e, "the upgrade did not complete"),
            }
        };
        // The tunnel's task runs it once the response is out; it has room for exactly one.
        let _ = relays.try_send(relay.boxed());
        return response;
    }
    tunnel::remove_hop_by_hop(response.headers_mut());
    response
}

/// A failure of the agent's own, as a Kubernetes Status.
fn failure(status: StatusCode, reason: &str, message: &str) -> Response<TunnelBody> {
    let body = tunnel::status_body(status.as_u16(), reason, message);
    let mut response = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    if status == StatusCode::TOO_MANY_REQUESTS {
        response.headers_mut().insert(
            http::header::RETRY_AFTER,
            http::HeaderValue::from_static("1"),
        );
    }
    response
}
