//! The gRPC carrier: a session is one bidirectional `Fleet.Session` call on an HTTP/2
//! connection over TLS; a tunnel is one more `Fleet.Tunnel` call on the same connection, which
//! the agent opens when the hub's session asks it to (`OpenTunnel`).
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
use tower::ServiceExt as _;
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
        // Only the agent the tunnel was asked of may answer it, and another cluster's call
        // leaves it waiting: ids are a per-hub prefix and a counter, so an agent that has seen
        // its own tunnels' ids can name the next ones, and taking such an entry out would
        // break another cluster's kubectl request.
        let waiting = {
            let mut tunnels = self.tunnels.lock();
            match tunnels.get(&id) {
                Some(w) if w.cluster == cluster => tunnels.remove(&id),
                _ => None,
            }
        };
        let Some(waiting) = waiting else {
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

/// Opens tunnels to one agent over gRPC: registers the id, the session driver sends
/// `OpenTunnel`, the agent's `Fleet.Tunnel` call completes it.
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

/// A tunnel call's inbound frames.
type Frames = Pin<Box<dyn Stream<Item = Result<TunnelFrame, std::io::Error>> + Send>>;

/// Tunnel frames as bytes: data frames read, writes become data frames, shutdown sends `end`.
pub(crate) fn frames_io(
    inbound: impl Stream<Item = Result<TunnelFrame, std::io::Error>> + Send + 'static,
    outbound: mpsc::Sender<TunnelFrame>,
) -> impl crate::link::TunnelIo {
    CallIo {
        reader: tokio_util::io::StreamReader::new(DataFrames {
            inbound: Some(Box::pin(inbound)),
            ended: false,
        }),
        writer: DataWriter::new(outbound),
    }
}

/// How long a closed tunnel end keeps reading its call once dropped, so that what it wrote
/// reaches the peer (see [`CallIo`]'s `Drop`).
const LINGER: Duration = Duration::from_secs(10);

/// The bytes of one `Fleet.Tunnel` call, either end.
///
/// HTTP/2 cancels a call whose two halves are both dropped before the peer has ended its own,
/// and a cancel discards what this end has written but not yet sent (a stalled window holds
/// it). A relay drops its tunnel as soon as both directions are done, which can be before the
/// peer's end of the call arrives. So an end that closed its writing cleanly hands its inbound
/// half, on drop, to a task that reads it out until the peer ends it, [`LINGER`] at most: the
/// call then closes without a cancel and nothing written is lost. An end dropped without a
/// clean close is cancelled at once, as before.
struct CallIo {
    reader: tokio_util::io::StreamReader<DataFrames, Bytes>,
    writer: DataWriter,
}

impl Drop for CallIo {
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
            let drained = async { while inbound.next().await.is_some() {} };
            let _ = tokio::time::timeout(LINGER, drained).await;
        });
    }
}

impl tokio::io::AsyncRead for CallIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.reader).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for CallIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.writer).poll_write(cx, buf)
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

/// The data frames of a tunnel call until the peer's half-close (`End`); other frames carry
/// nothing to read. Keeps the call's stream after `End` so that dropping it is a choice.
struct DataFrames {
    inbound: Option<Frames>,
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
        loop {
            match std::task::ready!(inbound.as_mut().poll_next(cx)) {
                Some(Ok(TunnelFrame {
                    frame: Some(tunnel_frame::Frame::Data(data)),
                })) => return Poll::Ready(Some(Ok(Bytes::from(data)))),
                Some(Ok(TunnelFrame {
                    frame: Some(tunnel_frame::Frame::End(true)),
                }))
                | None => {
                    self.ended = true;
                    return Poll::Ready(None);
                }
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
            }
        }
    }
}

/// Writes as `TunnelFrame::Data`, flow-controlled by the channel; shutdown sends `End`.
struct DataWriter {
    out: tokio_util::sync::PollSender<TunnelFrame>,
    ended: bool,
}

impl DataWriter {
    fn new(out: mpsc::Sender<TunnelFrame>) -> DataWriter {
        DataWriter {
            out: tokio_util::sync::PollSender::new(out),
            ended: false,
        }
    }

    fn send(
        &mut self,
        cx: &mut std::task::Context<'_>,
        frame: tunnel_frame::Frame,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        match self.out.poll_reserve(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(_)) => Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into())),
            Poll::Ready(Ok(())) => Poll::Ready(
                self.out
                    .send_item(TunnelFrame { frame: Some(frame) })
                    .map_err(|_| std::io::ErrorKind::BrokenPipe.into()),
            ),
        }
    }
}

/// Largest data frame a tunnel writes at once.
const TUNNEL_CHUNK: usize = 32 * 1024;

impl tokio::io::AsyncWrite for DataWriter {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let n = buf.len().min(TUNNEL_CHUNK);
        self.send(cx, tunnel_frame::Frame::Data(buf[..n].to_vec()))
            .map_ok(|()| n)
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
        let sent = self.send(cx, tunnel_frame::Frame::End(true));
        if let std::task::Poll::Ready(Ok(())) = sent {
            self.ended = true;
            // End the call's stream in this direction too, so the peer dropping its side
            // later cannot cancel (and discard) what is still in flight.
            self.out.close();
        }
        sent
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
    let mut client = FleetClient::new(channel)
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
        tunnels: crate::AgentTunnels::Grpc(AgentTunnels { client }),
    })
}

/// The agent's side of tunnels over gRPC: each one the hub asks for (`OpenTunnel`) is a new
/// `Fleet.Tunnel` call on the session's connection.
#[derive(Clone)]
pub struct AgentTunnels {
    client: FleetClient<tonic::transport::Channel>,
}

impl AgentTunnels {
    /// Opens tunnel `id` the hub asked for.
    pub async fn open(&self, id: &str) -> Result<TunnelStream, LinkError> {
        let (tx, rx) = mpsc::channel(LINK_BUFFER);
        tx.try_send(TunnelFrame {
            frame: Some(tunnel_frame::Frame::TunnelId(id.to_string())),
        })
        .map_err(|_| LinkError::Transport("tunnel id did not fit".into()))?;
        let inbound = self
            .client
            .clone()
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
