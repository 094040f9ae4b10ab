//! The gRPC carrier: a session is one bidirectional `Fleet.Session` call on an HTTP/2
//! connection over TLS; a tunnel is one more HTTP/2 stream on the same connection, which the
//! agent opens when the hub's session asks it to (`OpenTunnel`): a plain stream of bytes
//! ([`TunnelBytesService`], `POST /flotilla.v1.TunnelBytes/Open`) when the gateway says it
//! takes them, else a `Fleet.Tunnel` call (agents and gateways of earlier versions), whose bytes
//! travel in protobuf messages: one more copy each way and gRPC's framing on every chunk.
//!
//! The gateway side serves each authenticated TLS connection itself ([`serve`]), with HTTP/2
//! settings sized for tens of thousands of mostly idle sessions, and hands every session call
//! to the gateway as an [`Incoming`]. The agent side turns a connected channel into a [`Link`]
//! ([`open_session`]).

use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use flotilla_proto::wire::fleet_client::FleetClient;
use flotilla_proto::wire::fleet_server::{Fleet, FleetServer};
use flotilla_proto::wire::{AgentFrame, HubFrame, TunnelFrame, tunnel_frame};
use futures::{Stream, StreamExt as _};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tower::{Service as _, ServiceExt as _};
use tracing::debug;

use crate::link::{Carrier, LINK_BUFFER, Link, LinkError, TunnelStream};
use crate::tls::{AuthenticatedConn, ConnInfo};
use crate::{Incoming, TunnelOpener};

/// HTTP/2 settings of the agents' connections.
#[derive(Clone, Debug)]
pub struct GrpcSettings {
    /// Largest session frame either side may send; a larger one closes that session only.
    pub max_frame_bytes: usize,
    /// HTTP/2 PING interval: finds dead TCP connections when the protocol itself is idle.
    pub keepalive_interval: Duration,
    /// How long a PING may go unanswered before the connection is closed.
    pub keepalive_timeout: Duration,
    /// Flow-control window of one stream, receive side. A tunnel moves at most this much per
    /// round trip between the hub and the agent, so it is sized for tunnels (at 64 KiB a large
    /// list through a tunnel ran at a quarter of the direct request's rate). A window is
    /// credit, not a buffer: an idle session holds none of it, a stalled reader at most this.
    pub stream_window: u32,
    /// Flow-control window of the whole connection (the session and its tunnels). Keep it
    /// above the tunnels a cluster may hold at once (the proxy front's
    /// `--proxy-max-per-cluster`) times `stream_window`, so stalled readers can never take the
    /// share of the session's own frames and heartbeats.
    pub connection_window: u32,
    /// Streams one connection may have open: the session, the agent's join, and tunnels.
    pub max_concurrent_streams: u32,
}

impl Default for GrpcSettings {
    fn default() -> Self {
        GrpcSettings {
            max_frame_bytes: 4 * 1024 * 1024,
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(20),
            stream_window: 1024 * 1024,
            connection_window: 16 * 1024 * 1024,
            max_concurrent_streams: 128,
        }
    }
}

impl GrpcSettings {
    /// The settings of a connection from another gateway or the hub (the relay hop, see
    /// [`hop`](crate::hop)): it carries the tunnels of many clusters at once, so it may hold
    /// [`RELAY_HOP_STREAMS`] of them, and its connection window covers every stream's window.
    /// A tunnel whose reader is slow then holds only its own stream's window, never the
    /// connection's: it cannot stall the other tunnels on the hop. Its streams keep the
    /// narrower [`RELAY_HOP_STREAM_WINDOW`], which bounds what stalled readers can hold on one
    /// hop connection to 64 MiB.
    pub fn for_relay_hop(&self) -> GrpcSettings {
        GrpcSettings {
            max_concurrent_streams: RELAY_HOP_STREAMS,
            stream_window: RELAY_HOP_STREAM_WINDOW,
            connection_window: RELAY_HOP_STREAM_WINDOW.saturating_mul(RELAY_HOP_STREAMS),
            ..self.clone()
        }
    }
}

/// Flow-control window of one stream on the relay hop.
pub const RELAY_HOP_STREAM_WINDOW: u32 = 64 * 1024;

/// Largest HTTP/2 DATA frame a peer may send to the hub. Larger frames cut the per-frame work of
/// a tunnel carrying a large answer (16 KiB, HTTP/2's floor, cost a tenth of the throughput).
const MAX_H2_FRAME: u32 = 64 * 1024;

/// Tunnels one relay-hop connection carries at once (HTTP/2 streams): beyond them a new tunnel
/// waits for one to end, within its bounded open.
pub const RELAY_HOP_STREAMS: u32 = 1024;

/// Tunnel calls waiting for the agent, by tunnel id.
#[derive(Default)]
struct PendingTunnels {
    waiting: SyncMutex<HashMap<String, Waiting>>,
}

/// Held for one insert or remove, never across an await: a plain mutex cannot block the
/// runtime here.
#[allow(clippy::disallowed_types)]
type SyncMutex<T> = std::sync::Mutex<T>;

/// A gateway waiting for the agent of `cluster` to open tunnel call `id`.
struct Waiting {
    cluster: String,
    reply: oneshot::Sender<TunnelStream>,
}

impl PendingTunnels {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Waiting>> {
        self.waiting
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The wait for tunnel `id`, if `cluster`'s agent is the one it was asked of. Another
    /// cluster's call leaves it waiting: ids are a per-hub prefix and a counter, so an agent
    /// that has seen its own tunnels' ids can name the next ones, and taking such an entry out
    /// would break another cluster's kubectl request.
    fn take(&self, id: &str, cluster: &str) -> Option<Waiting> {
        let mut tunnels = self.lock();
        match tunnels.get(id) {
            Some(w) if w.cluster == cluster => tunnels.remove(id),
            _ => None,
        }
    }
}

/// The gateway side of the `Fleet` service: session calls go to the gateway, tunnel calls to
/// whoever asked for them.
#[derive(Clone)]
pub struct FleetService {
    sessions: mpsc::Sender<Incoming>,
    tunnels: Arc<PendingTunnels>,
}

impl FleetService {
    /// A service that hands every accepted session call to `sessions`.
    pub fn new(sessions: mpsc::Sender<Incoming>) -> FleetService {
        FleetService {
            sessions,
            tunnels: Arc::default(),
        }
    }

    /// The service taking tunnels as plain HTTP/2 streams, for the same waits as this one's
    /// `Tunnel` calls; served beside it on the same routes.
    pub fn bytes_service(&self) -> TunnelBytesService {
        TunnelBytesService {
            tunnels: self.tunnels.clone(),
        }
    }

    /// The tonic service, with the frame bound in both directions.
    pub fn into_server(self, max_frame_bytes: usize) -> FleetServer<FleetService> {
        FleetServer::new(self)
            .max_decoding_message_size(max_frame_bytes)
            .max_encoding_message_size(max_frame_bytes)
    }
}

type OutStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl Fleet for FleetService {
    type SessionStream = OutStream<HubFrame>;
    type TunnelStream = OutStream<TunnelFrame>;

    async fn session(
        &self,
        request: Request<Streaming<AgentFrame>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let peer = request
            .extensions()
            .get::<ConnInfo>()
            .cloned()
            .ok_or_else(|| Status::internal("connection without TLS information"))?;
        let (tx, rx) = mpsc::channel(LINK_BUFFER);
        let cluster = peer.cluster().map(str::to_string);
        let inbound = request.into_inner().map(|r| r.map_err(link_error)).boxed();
        let incoming = Incoming {
            peer,
            link: Link {
                inbound,
                outbound: tx,
                carrier: Carrier::Grpc,
            },
            tunnels: TunnelOpener::Grpc(GrpcTunnels {
                pending: Arc::downgrade(&self.tunnels),
                cluster: cluster.unwrap_or_default(),
            }),
        };
        self.sessions
            .send(incoming)
            .await
            .map_err(|_| Status::unavailable("the gateway is shutting down; reconnect later"))?;
        Ok(Response::new(Box::pin(ReceiverStream::new(rx).map(Ok))))
    }

    async fn tunnel(
        &self,
        request: Request<Streaming<TunnelFrame>>,
    ) -> Result<Response<Self::TunnelStream>, Status> {
        let cluster = request
            .extensions()
            .get::<ConnInfo>()
            .and_then(|info| info.cluster().map(str::to_string))
            .ok_or_else(|| Status::permission_denied("only agents open tunnels"))?;
        let mut inbound = request.into_inner();
        let id = match inbound.message().await {
            Ok(Some(TunnelFrame {
                frame: Some(tunnel_frame::Frame::TunnelId(id)),
            })) => id,
            _ => return Err(Status::invalid_argument("a tunnel call starts with its id")),
        };
        let Some(waiting) = self.tunnels.take(&id, &cluster) else {
            return Err(Status::not_found(format!(
                "no tunnel {id} is waiting for cluster {cluster}"
            )));
        };
        let (tx, rx) = mpsc::channel::<TunnelFrame>(LINK_BUFFER);
        let stream = TunnelStream::new(id, frames_io(inbound.map(|r| r.map_err(io_error)), tx));
        if waiting.reply.send(stream).is_err() {
            return Err(Status::cancelled("the tunnel's requester went away"));
        }
        Ok(Response::new(Box::pin(ReceiverStream::new(rx).map(Ok))))
    }
}

/// The path an agent posts a tunnel stream to ([`TunnelBytesService`]).
pub const TUNNEL_BYTES_PATH: &str = "/flotilla.v1.TunnelBytes/Open";
/// The header naming the tunnel a [`TUNNEL_BYTES_PATH`] stream answers.
pub const TUNNEL_ID_HEADER: &str = "flotilla-tunnel-id";

/// Tunnels as plain HTTP/2 streams: the agent posts to [`TUNNEL_BYTES_PATH`] naming the
/// tunnel in [`TUNNEL_ID_HEADER`]; the request body is the agent's bytes and the response
/// body the hub's, data frames as they come, with no message framing to add, copy into or
/// parse. The same waits and the same check as a `Fleet.Tunnel` call: only the agent of the
/// cluster the tunnel was asked of may take it.
#[derive(Clone)]
pub struct TunnelBytesService {
    tunnels: Arc<PendingTunnels>,
}

impl tonic::server::NamedService for TunnelBytesService {
    const NAME: &'static str = "flotilla.v1.TunnelBytes";
}

impl tower::Service<http::Request<tonic::body::Body>> for TunnelBytesService {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        std::future::ready(Ok(self.take(request)))
    }
}

impl TunnelBytesService {
    fn take(&self, request: http::Request<tonic::body::Body>) -> http::Response<tonic::body::Body> {
        use http::StatusCode;
        if request.uri().path() != TUNNEL_BYTES_PATH || request.method() != http::Method::POST {
            return refusal(
                StatusCode::NOT_FOUND,
                format!("tunnel streams are a POST to {TUNNEL_BYTES_PATH}"),
            );
        }
        let Some(cluster) = request
            .extensions()
            .get::<ConnInfo>()
            .and_then(|info| info.cluster().map(str::to_string))
        else {
            return refusal(StatusCode::FORBIDDEN, "only agents open tunnels".into());
        };
        let Some(id) = request
            .headers()
            .get(TUNNEL_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
        else {
            return refusal(
                StatusCode::BAD_REQUEST,
                format!("a tunnel stream names its tunnel in the {TUNNEL_ID_HEADER} header"),
            );
        };
        let Some(waiting) = self.tunnels.take(&id, &cluster) else {
            return refusal(
                StatusCode::NOT_FOUND,
                format!("no tunnel {id} is waiting for cluster {cluster}"),
            );
        };
        let (tx, rx) = mpsc::channel::<Bytes>(LINK_BUFFER);
        let inbound = http_body_util::BodyDataStream::new(request.into_body())
            .map(|chunk| chunk.map_err(io_error));
        if waiting
            .reply
            .send(TunnelStream::new(id, bytes_io(inbound, tx)))
            .is_err()
        {
            return refusal(
                StatusCode::SERVICE_UNAVAILABLE,
                "the tunnel's requester went away".into(),
            );
        }
        let body = http_body_util::StreamBody::new(
            ReceiverStream::new(rx).map(|chunk| Ok::<_, Status>(hyper::body::Frame::data(chunk))),
        );
        http::Response::new(tonic::body::Body::new(body))
    }
}

/// A tunnel stream refused, its reason as text for the agent's log.
fn refusal(status: http::StatusCode, reason: String) -> http::Response<tonic::body::Body> {
    let mut response = http::Response::new(tonic::body::Body::new(http_body_util::Full::new(
        Bytes::from(reason),
    )));
    *response.status_mut() = status;
    response
}

/// Opens tunnels to one agent over gRPC: registers the id, the session driver sends
/// `OpenTunnel`, the agent's tunnel stream (a [`TunnelBytesService`] stream or a
/// `Fleet.Tunnel` call) completes it.
#[derive(Clone)]
pub struct GrpcTunnels {
    pending: Weak<PendingTunnels>,
    cluster: String,
}

impl GrpcTunnels {
    /// Waits for the agent to open tunnel `id`, at most `within`. The caller has the session
    /// send `OpenTunnel { id }`.
    pub async fn expect(&self, id: &str, within: Duration) -> Result<TunnelStream, LinkError> {
        let pending = self
            .pending
            .upgrade()
            .ok_or_else(|| LinkError::Transport("the gateway is shutting down".into()))?;
        let (reply, wait) = oneshot::channel();
        pending.lock().insert(
            id.to_string(),
            Waiting {
                cluster: self.cluster.clone(),
                reply,
            },
        );
        let result = tokio::time::timeout(within, wait).await;
        pending.lock().remove(id);
        match result {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(_)) => Err(LinkError::Transport("the gateway is shutting down".into())),
            Err(_) => Err(LinkError::Transport(format!(
                "the agent did not open tunnel {id} within {within:?}"
            ))),
        }
    }
}

/// A tunnel's inbound data: `Ok(Some(bytes))` to read, `Ok(None)` the peer's half-close.
type Inbound = Pin<Box<dyn Stream<Item = std::io::Result<Option<Bytes>>> + Send>>;

/// Tunnel frames as bytes: data frames read, writes become data frames, shutdown sends `end`.
pub(crate) fn frames_io(
    inbound: impl Stream<Item = Result<TunnelFrame, std::io::Error>> + Send + 'static,
    outbound: mpsc::Sender<TunnelFrame>,
) -> impl crate::link::TunnelIo {
    let inbound = inbound.filter_map(|frame| {
        std::future::ready(match frame {
            Ok(TunnelFrame {
                frame: Some(tunnel_frame::Frame::Data(data)),
            }) => Some(Ok(Some(Bytes::from(data)))),
            Ok(TunnelFrame {
                frame: Some(tunnel_frame::Frame::End(true)),
            }) => Some(Ok(None)),
            Ok(_) => None,
            Err(e) => Some(Err(e)),
        })
    });
    CallIo::new(
        Box::pin(inbound),
        DataWriter {
            out: tokio_util::sync::PollSender::new(outbound),
            // The chunk was gathered for this frame alone: its buffer becomes the frame's.
            data: |chunk| TunnelFrame {
                frame: Some(tunnel_frame::Frame::Data(Vec::from(chunk))),
            },
            chunk: CALL_CHUNK,
            end: Some(|| TunnelFrame {
                frame: Some(tunnel_frame::Frame::End(true)),
            }),
            ended: false,
        },
    )
}

/// An HTTP/2 stream's bodies as bytes ([`TunnelBytesService`]): the inbound body's data is
/// read as it comes, writes become data frames of the outbound body, shutdown ends it.
fn bytes_io(
    inbound: impl Stream<Item = std::io::Result<Bytes>> + Send + 'static,
    outbound: mpsc::Sender<Bytes>,
) -> impl crate::link::TunnelIo {
    CallIo::new(
        Box::pin(inbound.map(|chunk| chunk.map(Some))),
        DataWriter {
            out: tokio_util::sync::PollSender::new(outbound),
            data: |chunk| chunk,
            chunk: BYTES_CHUNK,
            end: None,
            ended: false,
        },
    )
}

/// How long a closed tunnel end keeps reading its call once dropped, so that what it wrote
/// reaches the peer (see [`CallIo`]'s `Drop`).
const LINGER: Duration = Duration::from_secs(10);

/// The bytes of one tunnel stream, either end.
///
/// HTTP/2 cancels a stream whose two halves are both dropped before the peer has ended its
/// own, and a cancel discards what this end has written but not yet sent (a stalled window
/// holds it). A relay drops its tunnel as soon as both directions are done, which can be
/// before the peer's end arrives. So an end that closed its writing cleanly hands its inbound
/// half, on drop, to a task that reads it out until the peer ends it, [`LINGER`] at most: the
/// stream then closes without a cancel and nothing written is lost. An end dropped without a
/// clean close is cancelled at once, as before.
struct CallIo<T> {
    reader: tokio_util::io::StreamReader<DataFrames, Bytes>,
    writer: DataWriter<T>,
}

impl<T> CallIo<T> {
    fn new(inbound: Inbound, writer: DataWriter<T>) -> CallIo<T> {
        CallIo {
            reader: tokio_util::io::StreamReader::new(DataFrames {
                inbound: Some(inbound),
                ended: false,
            }),
            writer,
        }
    }
}

impl<T> Drop for CallIo<T> {
    fn drop(&mut self) {
        if !self.writer.ended {
            return;
        }
        let (Some(mut inbound), Ok(runtime)) = (
            self.reader.get_mut().inbound.take(),
            tokio::runtime::Handle::try_current(),
        ) else {
            return;
        };
        runtime.spawn(async move {
            // Until the peer's end or an error: an HTTP/2 body reset by the peer answers every
            // poll after with the same error at once, and reading on would spin this thread
            // for ever (the timeout is only looked at when the loop waits).
            let drained = async { while let Some(Ok(_)) = inbound.next().await {} };
            let _ = tokio::time::timeout(LINGER, drained).await;
        });
    }
}

impl<T: Send + 'static> tokio::io::AsyncRead for CallIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.reader).poll_read(cx, buf)
    }
}

impl<T: Send + 'static> tokio::io::AsyncWrite for CallIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.writer).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.writer).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.writer.is_write_vectored()
    }
    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.writer).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.writer).poll_shutdown(cx)
    }
}

/// A tunnel's data until the peer's half-close; keeps the inbound stream after it so that
/// dropping it is a choice.
struct DataFrames {
    inbound: Option<Inbound>,
    ended: bool,
}

impl Stream for DataFrames {
    type Item = std::io::Result<Bytes>;

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        if self.ended {
            return Poll::Ready(None);
        }
        let Some(inbound) = self.inbound.as_mut() else {
            return Poll::Ready(None);
        };
        match std::task::ready!(inbound.as_mut().poll_next(cx)) {
            Some(Ok(Some(data))) => Poll::Ready(Some(Ok(data))),
            Some(Ok(None)) | None => {
                self.ended = true;
                Poll::Ready(None)
            }
            // Reported once; the stream is over (a reset body repeats its error for ever).
            Some(Err(e)) => {
                self.ended = true;
                Poll::Ready(Some(Err(e)))
            }
        }
    }
}

/// Writes as the stream's data items, flow-controlled by the channel; shutdown sends the
/// `end` item if the stream has one, and closes the channel.
struct DataWriter<T> {
    out: tokio_util::sync::PollSender<T>,
    /// A chunk written, as the stream's item.
    data: fn(Bytes) -> T,
    /// Most bytes in one item.
    chunk: usize,
    /// The half-close, where the stream says it in an item (a `Tunnel` call's `end` frame);
    /// a plain HTTP/2 body ends with the channel.
    end: Option<fn() -> T>,
    ended: bool,
}

impl<T: Send + 'static> DataWriter<T> {
    /// Room for one more item, as the channel's capacity allows.
    fn poll_room(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.out
            .poll_reserve(cx)
            .map_err(|_| std::io::ErrorKind::BrokenPipe.into())
    }

    /// Sends `item` into the room [`poll_room`](Self::poll_room) made.
    fn push(&mut self, item: T) -> std::io::Result<()> {
        self.out
            .send_item(item)
            .map_err(|_| std::io::ErrorKind::BrokenPipe.into())
    }
}

/// Largest chunk a plain tunnel stream writes at once: the gateway's HTTP/2 frame limit, so
/// that a chunk is one DATA frame (32 KiB chunks moved a large list 6 % slower).
const BYTES_CHUNK: usize = MAX_H2_FRAME as usize;
/// Largest data frame a `Tunnel` call writes at once, well inside any session frame bound.
const CALL_CHUNK: usize = 32 * 1024;

impl<T: Send + 'static> tokio::io::AsyncWrite for DataWriter<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.poll_write_vectored(cx, &[std::io::IoSlice::new(buf)])
    }
    /// Gathers what the writer hands over (hyper hands its head and body buffers at once when
    /// a stream takes vectored writes, instead of first copying them into one) into one chunk,
    /// the one copy a written byte costs here.
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            return std::task::Poll::Ready(Ok(0));
        }
        std::task::ready!(self.poll_room(cx))?;
        let mut chunk = bytes::BytesMut::with_capacity(total.min(self.chunk));
        for buf in bufs {
            let room = self.chunk - chunk.len();
            if room == 0 {
                break;
            }
            chunk.extend_from_slice(&buf[..buf.len().min(room)]);
        }
        let n = chunk.len();
        let item = (self.data)(chunk.freeze());
        self.push(item)?;
        std::task::Poll::Ready(Ok(n))
    }
    fn is_write_vectored(&self) -> bool {
        true
    }
    fn poll_flush(
        self: Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.ended {
            return std::task::Poll::Ready(Ok(()));
        }
        if let Some(end) = self.end {
            std::task::ready!(self.poll_room(cx))?;
            self.push(end())?;
        }
        self.ended = true;
        // End the stream in this direction too, so the peer dropping its side later cannot
        // cancel (and discard) what is still in flight.
        self.out.close();
        std::task::Poll::Ready(Ok(()))
    }
}

/// Serves the agents' authenticated TLS connections with HTTP/2 until `drain` turns true,
/// each connection in its own task owned here. On drain it stops taking connections, tells
/// every connection to finish (HTTP/2 GOAWAY: calls in flight go on, no new ones), and waits
/// for them; the caller bounds the wait (dropping this future aborts every connection).
pub async fn serve(
    mut conns: mpsc::Receiver<AuthenticatedConn>,
    routes: tonic::service::Routes,
    settings: GrpcSettings,
    mut drain: watch::Receiver<bool>,
) -> Result<(), ServeError> {
    let mut connections = JoinSet::new();
    let routes = routes.prepare();
    let told = drain.clone();
    let outcome = loop {
        tokio::select! {
            conn = conns.recv() => match conn {
                Some(conn) => {
                    let settings = match conn.info().peer {
                        crate::identity::Peer::Gateway { .. } => settings.for_relay_hop(),
                        _ => settings.clone(),
                    };
                    let service = with_conn_info(routes.clone(), conn.info().clone());
                    connections.spawn(serve_connection(conn, service, settings, told.clone()));
                }
                None => break Err(ServeError::ListenerClosed),
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            _ = drain.wait_for(|d| *d) => break Ok(()),
        }
    };
    drop(conns);
    while connections.join_next().await.is_some() {}
    outcome
}

/// Why the gRPC carrier stopped serving; retryable only by restarting the process.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The stream of accepted connections ended although nobody asked it to stop.
    #[error("the stream of agent connections ended: the listener is gone")]
    ListenerClosed,
}

/// The routes, with the connection's TLS identity on every request (tonic handlers read it
/// from the request's extensions).
fn with_conn_info(
    routes: tonic::service::Routes,
    info: ConnInfo,
) -> impl tower::Service<
    http::Request<hyper::body::Incoming>,
    Response = http::Response<tonic::body::Body>,
    Error = Infallible,
    Future = impl Send,
> + Clone
+ Send
+ 'static {
    routes.map_request(move |mut req: http::Request<hyper::body::Incoming>| {
        req.extensions_mut().insert(info.clone());
        req.map(tonic::body::Body::new)
    })
}

async fn serve_connection<S>(
    conn: AuthenticatedConn,
    service: S,
    settings: GrpcSettings,
    mut drain: watch::Receiver<bool>,
) where
    S: tower::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<tonic::body::Body>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let remote = conn.info().remote;
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .initial_stream_window_size(settings.stream_window)
        .initial_connection_window_size(settings.connection_window)
        .adaptive_window(false)
        .max_concurrent_streams(settings.max_concurrent_streams)
        .max_frame_size(MAX_H2_FRAME)
        .max_send_buf_size(64 * 1024)
        .max_header_list_size(16 * 1024)
        .keep_alive_interval(settings.keepalive_interval)
        .keep_alive_timeout(settings.keepalive_timeout);
    let connection =
        builder.serve_connection(TokioIo::new(conn), TowerToHyperService::new(service));
    tokio::pin!(connection);
    let mut draining = false;
    loop {
        tokio::select! {
            done = &mut connection => {
                if let Err(e) = done {
                    debug!(peer = %remote, error = %e, "agent connection ended");
                }
                return;
            }
            _ = drain.wait_for(|d| *d), if !draining => {
                draining = true;
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}

/// A session call's failure, for the driver.
fn link_error(status: Status) -> LinkError {
    let msg = status.message();
    if msg.contains("message length too large") {
        // "decoded message length too large: found N bytes, the limit is: M bytes"
        let numbers: Vec<usize> = msg
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|n| n.parse().ok())
            .collect();
        if let [size, max, ..] = numbers[..] {
            return LinkError::TooLarge { size, max };
        }
    }
    LinkError::Transport(format!("{msg} ({:?})", status.code()))
}

pub(crate) fn io_error(status: Status) -> std::io::Error {
    std::io::Error::other(format!("{} ({:?})", status.message(), status.code()))
}

/// The agent's side: one HTTP/2 connection to the hub at `hub` (host:port): TCP (through
/// `proxy`, from `local`, as [`dial`](crate::dial::dial) does), TLS with `tls` checking
/// `server_name`, then HTTP/2. Unbounded: the caller puts a deadline on it.
///
/// No HTTP/2 PINGs: the session's heartbeats, at the hub's interval and timeout, are this
/// side's liveness. A PING unanswered for 20 s closed live sessions of a hub stalled for less
/// than its heartbeat timeout (a busy hub's sessions churned so).
pub async fn connect(
    hub: &str,
    server_name: rustls_pki_types::ServerName<'static>,
    tls: Arc<rustls::ClientConfig>,
    proxy: Option<&crate::dial::ProxyUrl>,
    local: Option<std::net::IpAddr>,
) -> Result<tonic::transport::Channel, LinkError> {
    connect_tuned(hub, server_name, tls, proxy, local, |endpoint| endpoint).await
}

/// [`connect`] with the HTTP/2 endpoint adjusted by `tune` (the relay hop widens its windows).
pub(crate) async fn connect_tuned(
    hub: &str,
    server_name: rustls_pki_types::ServerName<'static>,
    tls: Arc<rustls::ClientConfig>,
    proxy: Option<&crate::dial::ProxyUrl>,
    local: Option<std::net::IpAddr>,
    tune: impl FnOnce(tonic::transport::Endpoint) -> tonic::transport::Endpoint,
) -> Result<tonic::transport::Channel, LinkError> {
    let mut tls = (*tls).clone();
    tls.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(tls));
    let target = hub.to_string();
    let proxy = proxy.cloned();
    let connector = tower::service_fn(move |_uri: http::Uri| {
        let (target, proxy, server_name, connector) = (
            target.clone(),
            proxy.clone(),
            server_name.clone(),
            connector.clone(),
        );
        async move {
            let tcp = crate::dial::dial(&target, proxy.as_ref(), local).await?;
            // A gateway over its rate answers the ClientHello with a notice, not TLS.
            let tcp = crate::turn_away::Sniffed::new(tcp);
            let tls = connector.connect(server_name, tcp).await?;
            Ok::<_, std::io::Error>(TokioIo::new(first_answer(tls).await?))
        }
    });
    // The URI only names the HTTP/2 authority; the connector does the dialling and the TLS,
    // which is why the scheme says http.
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{hub}"))
        .map_err(|e| LinkError::from_dial(&e))?;
    tune(endpoint)
        .connect_with_connector(connector)
        .await
        .map_err(|e| LinkError::from_dial(&e))
}

/// Waits for the hub's first bytes on a fresh TLS connection. In TLS 1.3 the client's
/// handshake completes before the server has checked the client's certificate; a hub that
/// refuses it answers with an alert. Reading here turns that alert into this dial's error
/// (`unknown CA`, `certificate expired`) instead of a cancelled call later. A hub that accepts
/// speaks first anyway (HTTP/2 SETTINGS), so this costs no round trip.
async fn first_answer<S>(mut tls: S) -> std::io::Result<Prefixed<S>>
where
    S: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt as _;
    let mut buf = vec![0u8; 1024];
    let n = tls.read(&mut buf).await?;
    if n == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            "the hub closed the connection right after the TLS handshake",
        ));
    }
    buf.truncate(n);
    Ok(Prefixed {
        first: Bytes::from(buf),
        inner: tls,
    })
}

/// A stream whose first bytes were read ahead: they are read again first.
struct Prefixed<S> {
    first: Bytes,
    inner: S,
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if !self.first.is_empty() {
            let n = self.first.len().min(buf.remaining());
            let chunk = self.first.split_to(n);
            buf.put_slice(&chunk);
            return std::task::Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// The agent's side: opens the session call on `channel` (one HTTP/2 connection to the hub)
/// and returns its link, and the tunnels the hub may ask for on the same connection.
pub async fn open_session(
    channel: tonic::transport::Channel,
    max_frame_bytes: usize,
    first: AgentFrame,
) -> Result<crate::Dialed, LinkError> {
    let mut client = FleetClient::new(channel.clone())
        .max_decoding_message_size(max_frame_bytes)
        .max_encoding_message_size(max_frame_bytes);
    let (tx, rx) = mpsc::channel(LINK_BUFFER);
    // The hello goes in before the call starts, so the hub reads it with the headers.
    tx.try_send(first)
        .map_err(|_| LinkError::Transport("the session's first frame did not fit".into()))?;
    let inbound = client
        .session(ReceiverStream::new(rx))
        .await
        .map_err(link_error)?
        .into_inner()
        .map(|r| r.map_err(link_error))
        .boxed();
    Ok(crate::Dialed {
        link: Link {
            inbound,
            outbound: tx,
            carrier: Carrier::Grpc,
        },
        pump: None,
        tunnels: crate::AgentTunnels::Grpc(AgentTunnels { channel }),
    })
}

/// The agent's side of tunnels over gRPC: each one the hub asks for (`OpenTunnel`) is a new
/// stream on the session's connection.
#[derive(Clone)]
pub struct AgentTunnels {
    channel: tonic::transport::Channel,
}

/// Most of a refusal's text the agent reads into its error.
const REFUSAL_TEXT: usize = 1024;

impl AgentTunnels {
    /// Opens tunnel `id` the hub asked for as a plain HTTP/2 stream ([`TunnelBytesService`]).
    pub async fn open_bytes(&self, id: &str) -> Result<TunnelStream, LinkError> {
        use http_body_util::BodyExt as _;
        let (tx, rx) = mpsc::channel::<Bytes>(LINK_BUFFER);
        let body = http_body_util::StreamBody::new(
            ReceiverStream::new(rx)
                .map(|chunk| Ok::<_, Infallible>(hyper::body::Frame::data(chunk))),
        );
        let request = http::Request::builder()
            .method(http::Method::POST)
            .uri(TUNNEL_BYTES_PATH)
            .header(TUNNEL_ID_HEADER, id)
            .header(http::header::CONTENT_TYPE, "application/octet-stream")
            .body(tonic::body::Body::new(body))
            .map_err(|e| LinkError::Transport(format!("tunnel {id}: {e}")))?;
        let mut channel = self.channel.clone();
        let response = channel
            .ready()
            .await
            .map_err(|e| LinkError::Transport(format!("tunnel {id}: {e}")))?
            .call(request)
            .await
            .map_err(|e| LinkError::Transport(format!("tunnel {id}: {e}")))?;
        if !response.status().is_success() {
            let status = response.status();
            let text = http_body_util::Limited::new(response.into_body(), REFUSAL_TEXT)
                .collect()
                .await
                .map(|body| String::from_utf8_lossy(&body.to_bytes()).into_owned())
                .unwrap_or_default();
            return Err(LinkError::Transport(format!(
                "the gateway refused tunnel {id} ({status}): {text}"
            )));
        }
        let inbound = http_body_util::BodyDataStream::new(response.into_body())
            .map(|chunk| chunk.map_err(io_error));
        Ok(TunnelStream::new(id, bytes_io(inbound, tx)))
    }

    /// Opens tunnel `id` the hub asked for.
    pub async fn open(&self, id: &str) -> Result<TunnelStream, LinkError> {
        let (tx, rx) = mpsc::channel(LINK_BUFFER);
        tx.try_send(TunnelFrame {
            frame: Some(tunnel_frame::Frame::TunnelId(id.to_string())),
        })
        .map_err(|_| LinkError::Transport("tunnel id did not fit".into()))?;
        let inbound = FleetClient::new(self.channel.clone())
            .tunnel(ReceiverStream::new(rx))
            .await
            .map_err(link_error)?
            .into_inner();
        Ok(TunnelStream::new(
            id,
            frames_io(inbound.map(|r| r.map_err(io_error)), tx),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tunnel end closed cleanly lingers on its inbound side until the peer ends it. A peer
    /// that resets the stream instead leaves a body answering every poll with the same error
    /// at once: the linger must stop there, not spin its thread (which also kept its runtime
    /// from ever shutting down).
    #[test]
    fn a_lingering_end_whose_peer_resets_lets_its_runtime_go_on() {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .expect("a runtime");
            runtime.block_on(async {
                let reset = futures::stream::repeat_with(|| {
                    Err(std::io::Error::other("stream reset by the peer"))
                });
                let (tx, mut rx) = mpsc::channel::<Bytes>(4);
                let mut end = bytes_io(reset, tx);
                tokio::io::AsyncWriteExt::write_all(&mut end, b"answer")
                    .await
                    .expect("written");
                tokio::io::AsyncWriteExt::shutdown(&mut end)
                    .await
                    .expect("closed");
                drop(end);
                // The linger task runs at the next wait; this side must get its turn back.
                tokio::task::yield_now().await;
                tokio::time::sleep(Duration::from_millis(20)).await;
                assert_eq!(rx.recv().await.as_deref(), Some(&b"answer"[..]));
            });
            let _ = done_tx.send(());
        });
        assert!(
            done_rx.recv_timeout(Duration::from_secs(10)).is_ok(),
            "the lingering end spun its runtime's thread"
        );
    }
}
