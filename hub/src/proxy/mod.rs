//! The proxy front: kubectl to any cluster of the fleet through the hub, on its own HTTPS
//! listener (`--proxy-listen`). `https://HUB/clusters/NAME/<Kubernetes API path>` is forwarded
//! to cluster NAME's agent over a tunnel stream on its session, and from there to the spoke's
//! apiserver as the hub user (impersonation), so the spoke's RBAC decides.
//!
//! Each request, in order: the user is authenticated ([`authn`]: a hub-issued user certificate
//! or a bearer token), the access rules allow the cluster ([`access`]; read-only users only
//! read), the per-user and per-cluster limits admit it (429 with Retry-After beyond them), its
//! credentials and any impersonation the user sent are removed and the hub's is set, a tunnel
//! stream opens through the [`TunnelRoute`] (503 naming the cluster and since when it has been
//! away when it has no session), and the request travels as HTTP/1.1 on the stream. Bodies
//! stream both ways as they come (watches, `logs -f`); a `101 Switching Protocols` turns the
//! request into a raw byte relay (exec, attach, port-forward over WebSocket or SPDY) closed
//! after `idle_timeout` without a byte. Every request ends in one audit line ([`audit`]).
//!
//! Not for: deciding what a user may do inside a cluster (the spoke's RBAC), or knowing where
//! sessions are held (the route).

pub mod access;
pub mod audit;
pub mod authn;

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use flotilla_gateway::{TunnelError, TunnelRoute};
use flotilla_proto::api::Kind;
use flotilla_proto::tunnel;
use flotilla_store::Store;
use flotilla_transport::tls::{AuthenticatedConn, ConnInfo};
use futures::FutureExt as _;
use futures::future::BoxFuture;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt as _, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::{Instrument as _, debug, info_span, warn};

use self::access::{Access, AccessRules, Decision};
use self::audit::{AuditLine, AuditSink};
use self::authn::{ProxyTokens, ProxyUser};

/// Default of `--proxy-max-per-cluster`. Every tunnel whose user stops reading can hold its
/// stream's flow-control window (1 MiB on both carriers) of the session connection's window
/// (16 MiB); 12 of them hold 12 MiB and leave the session room for its frames and heartbeats.
/// Raise it only with the carriers' connection window.
pub const DEFAULT_MAX_PER_CLUSTER: usize = 12;
/// Default of `--proxy-max-per-user`.
pub const DEFAULT_MAX_PER_USER: usize = 64;
/// Default of `--proxy-idle-timeout`.
pub const DEFAULT_IDLE_TIMEOUT: &str = "30m";
/// Default of `--proxy-max-header-bytes` (hyper's floor is 8 KiB).
pub const DEFAULT_MAX_HEADER_BYTES: usize = 64 * 1024;
/// How long a client may take to send a request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the audit writer may take to write the last lines when the front stops.
const AUDIT_FLUSH: Duration = Duration::from_secs(5);
/// Upgraded streams waiting to be owned by the serving loop, at most.
const RELAY_QUEUE: usize = 1024;
/// Limit entries kept beyond which idle ones are forgotten (names a user typed that match no
/// cluster must not grow the map for ever).
const MAX_LIMIT_KEYS: usize = 100_000;

/// A response body streaming to the user.
pub type ProxyBody = BoxBody<Bytes, BoxError>;
type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The proxy front's settings.
#[derive(Clone, Debug)]
pub struct ProxyLimits {
    /// Requests in flight per cluster (watches and upgraded streams included).
    pub max_per_cluster: usize,
    /// Requests in flight per user.
    pub max_per_user: usize,
    /// An upgraded stream with no byte either way for this long is closed.
    pub idle_timeout: Duration,
    /// Largest request head accepted (hyper answers 431 beyond it).
    pub max_header_bytes: usize,
}

/// Everything a request needs, shared by all connections.
pub struct ProxyFront {
    route: Arc<dyn TunnelRoute>,
    store: Arc<dyn Store>,
    rules: AccessRules,
    tokens: ProxyTokens,
    audit: AuditSink,
    limits: ProxyLimits,
    per_cluster: InFlight,
    per_user: InFlight,
    /// Tunnel ids are `<prefix>-<n>`: the prefix (random per hub start) keeps ids of two hub
    /// runs apart in agents' logs.
    id_prefix: String,
    next_id: AtomicU64,
    relays: mpsc::Sender<BoxFuture<'static, ()>>,
}

impl ProxyFront {
    /// A front and the receiver of the upgraded streams [`serve`] owns.
    pub fn new(
        route: Arc<dyn TunnelRoute>,
        store: Arc<dyn Store>,
        rules: AccessRules,
        tokens: ProxyTokens,
        audit: AuditSink,
        limits: ProxyLimits,
    ) -> (Arc<ProxyFront>, mpsc::Receiver<BoxFuture<'static, ()>>) {
        let (relays, relay_rx) = mpsc::channel(RELAY_QUEUE);
        let front = ProxyFront {
            route,
            store,
            rules,
            tokens,
            audit,
            per_cluster: InFlight::new(limits.max_per_cluster),
            per_user: InFlight::new(limits.max_per_user),
            limits,
            id_prefix: format!("{:08x}", rand::random::<u32>()),
            next_id: AtomicU64::new(1),
            relays,
        };
        (Arc::new(front), relay_rx)
    }
}

/// Why the proxy front stopped serving; retryable only by restarting the hub.
#[derive(Debug, thiserror::Error)]
pub enum ProxyServeError {
    #[error("the proxy front's listener closed")]
    ListenerClosed,
    #[error("the proxy front's audit writer ended")]
    AuditEnded,
}

/// Serves the proxy front on authenticated connections until the listener closes or
/// `shutdown` fires; every connection and upgraded stream is owned here and cut on shutdown,
/// and the audit writer (from [`audit::open`]) runs here until their last lines are written.
pub async fn serve(
    mut conns: mpsc::Receiver<AuthenticatedConn>,
    front: Arc<ProxyFront>,
    mut relay_rx: mpsc::Receiver<BoxFuture<'static, ()>>,
    audit_writer: impl Future<Output = ()>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ProxyServeError> {
    let mut connections = JoinSet::new();
    let mut relays = JoinSet::new();
    tokio::pin!(shutdown);
    tokio::pin!(audit_writer);
    let outcome = loop {
        tokio::select! {
            c = conns.recv() => match c {
                Some(conn) => {
                    let info = conn.info().clone();
                    let front = front.clone();
                    connections.spawn(serve_connection(conn, info, front));
                }
                None => break Err(ProxyServeError::ListenerClosed),
            },
            Some(relay) = relay_rx.recv() => { relays.spawn(relay); }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            Some(_) = relays.join_next(), if !relays.is_empty() => {}
            // Never first while the front holds its sink.
            _ = &mut audit_writer => break Err(ProxyServeError::AuditEnded),
            _ = &mut shutdown => break Ok(()),
        }
    };
    connections.shutdown().await;
    relays.shutdown().await;
    // The requests cut above wrote their lines; with the front gone the writer ends.
    drop(front);
    drop(relay_rx);
    if tokio::time::timeout(AUDIT_FLUSH, audit_writer)
        .await
        .is_err()
    {
        warn!("the proxy audit log did not finish writing in time");
    }
    outcome
}

async fn serve_connection(conn: AuthenticatedConn, info: ConnInfo, front: Arc<ProxyFront>) {
    let max_header = front.limits.max_header_bytes;
    let service = hyper::service::service_fn(move |request| {
        let (front, info) = (front.clone(), info.clone());
        async move { Ok::<_, std::convert::Infallible>(handle(front, &info, request).await) }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .max_buf_size(max_header.max(8192));
    if let Err(e) = builder
        .serve_connection(TokioIo::new(conn), service)
        .with_upgrades()
        .await
    {
        debug!(error = %e, "proxy connection ended");
    }
}

/// One request, start to finish.
async fn handle(
    front: Arc<ProxyFront>,
    info: &ConnInfo,
    mut request: Request<Incoming>,
) -> Response<ProxyBody> {
    let started = Instant::now();
    let tunnel_id = format!(
        "{}-{}",
        front.id_prefix,
        front.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let mut line = AuditLine {
        time: jiff::Timestamp::now().to_string(),
        user: String::new(),
        groups: Vec::new(),
        cluster: String::new(),
        verb: String::new(),
        method: request.method().to_string(),
        path: request.uri().path().to_string(),
        status: 0,
        bytes_in: 0,
        bytes_out: 0,
        duration_ms: 0,
        tunnel: tunnel_id.clone(),
        refused: String::new(),
    };
    let refuse = |mut line: AuditLine, status: StatusCode, reason: &str, message: String| {
        line.status = status.as_u16();
        line.refused = reason.to_string();
        line.duration_ms = started.elapsed().as_millis() as u64;
        let as_text = read_raw_by_kubectl(&line.path);
        front.audit.record(line);
        if as_text {
            text_failure(status, &message)
        } else {
            failure(status, reason, &message)
        }
    };

    let head = match RequestHead::read(request.method(), request.uri(), request.headers()) {
        Ok(head) => head,
        Err(HeadRefusal {
            status,
            reason,
            message,
        }) => return refuse(line, status, reason, message),
    };
    let RequestHead {
        cluster,
        path,
        verb,
        upgrade,
    } = head;
    line.cluster = cluster.clone();
    line.path = path.clone();
    line.verb = verb;

    let user = match front.tokens.authenticate(&info.peer, request.headers()) {
        Ok(user) => user,
        Err(e) => {
            return refuse(
                line,
                StatusCode::UNAUTHORIZED,
                "Unauthorized",
                e.to_string(),
            );
        }
    };
    line.user = user.user.clone();
    line.groups = user.groups.clone();
    let span = info_span!("proxy", tunnel = %tunnel_id, user = %user.user, cluster = %cluster);

    match authorize(&front, &user, &cluster).await {
        Ok(Decision::Allowed { access, rule }) => {
            if access == Access::ReadOnly && !access::is_read_only(request.method(), &path, upgrade)
            {
                let what = if upgrade {
                    "an upgraded stream (exec, attach, port-forward)".to_string()
                } else {
                    format!("verb {}", line.verb)
                };
                return refuse(
                    line.clone(),
                    StatusCode::FORBIDDEN,
                    "Forbidden",
                    format!(
                        "user {} has read-only access to cluster {cluster} (access rule {rule:?}); {what} is not a read",
                        user.user
                    ),
                );
            }
        }
        Ok(Decision::Denied) => {
            return refuse(
                line,
                StatusCode::FORBIDDEN,
                "Forbidden",
                format!(
                    "user {} (groups: {}) may not reach cluster {cluster}: no access rule of the hub allows it (ask an operator to add one to --proxy-access-rules)",
                    user.user,
                    if user.groups.is_empty() {
                        "none".to_string()
                    } else {
                        user.groups.join(", ")
                    }
                ),
            );
        }
        Err(message) => {
            return refuse(
                line,
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                message,
            );
        }
    }

    // kubectl's discovery roots do not count against the user's limit: kubectl drops the
    // message of a 429 there (see `read_raw_by_kubectl`), so a user at the limit would read
    // only "too many requests"; refused on the request that follows discovery, they read
    // why. They are short, and the per-cluster limit still bounds them.
    let user_permit = if read_raw_by_kubectl(&path) {
        Some(None)
    } else {
        front.per_user.try_acquire(&user.user).await.map(Some)
    };
    let permits = match (front.per_cluster.try_acquire(&cluster).await, user_permit) {
        (Some(c), Some(u)) => (c, u),
        (None, _) => {
            return refuse(
                line,
                StatusCode::TOO_MANY_REQUESTS,
                "TooManyRequests",
                format!(
                    "cluster {cluster} has {} requests in flight through the hub already (--proxy-max-per-cluster); try again shortly",
                    front.limits.max_per_cluster
                ),
            );
        }
        (_, None) => {
            return refuse(
                line,
                StatusCode::TOO_MANY_REQUESTS,
                "TooManyRequests",
                format!(
                    "user {} has {} requests in flight through the hub already (--proxy-max-per-user); try again shortly",
                    user.user, front.limits.max_per_user
                ),
            );
        }
    };

    if let Err(e) = forwarded_headers(request.headers_mut(), &user, &tunnel_id) {
        return refuse(line, StatusCode::BAD_REQUEST, "BadRequest", e);
    }
    let forwarded = async {
        let stream = match front.route.open(&cluster, &tunnel_id).await {
            Ok(stream) => stream,
            Err(e @ (TunnelError::NoSession { .. } | TunnelError::Unrouted { .. })) => {
                return Err((StatusCode::SERVICE_UNAVAILABLE, e.to_string()));
            }
            Err(e) => return Err((StatusCode::BAD_GATEWAY, e.to_string())),
        };
        forward(
            &front,
            request,
            path,
            stream,
            line.clone(),
            started,
            permits,
        )
        .await
    };
    match forwarded.instrument(span).await {
        Ok(response) => response,
        Err((status, message)) => {
            let reason = if status == StatusCode::SERVICE_UNAVAILABLE {
                "ServiceUnavailable"
            } else {
                "BadGateway"
            };
            let mut response = refuse(line, status, reason, message);
            response.headers_mut().insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from_static("5"),
            );
            response
        }
    }
}

/// What the access rules say, reading the cluster's labels only when a rule needs them.
async fn authorize(
    front: &ProxyFront,
    user: &ProxyUser,
    cluster: &str,
) -> Result<Decision, String> {
    let mut labels = BTreeMap::new();
    if front.rules.needs_labels(&user.user, &user.groups) {
        let object = front
            .store
            .get(Kind::ManagedCluster, None, cluster)
            .await
            .map_err(|e| format!("cannot read ManagedCluster {cluster} for its labels: {e}"))?;
        if let Some(map) = object
            .as_ref()
            .and_then(|o| o["metadata"]["labels"].as_object())
        {
            for (k, v) in map {
                if let Some(v) = v.as_str() {
                    labels.insert(k.clone(), v.to_string());
                }
            }
        }
    }
    Ok(front
        .rules
        .decide(&user.user, &user.groups, cluster, &labels))
}

/// Sends the request on the tunnel stream and returns the cluster's response as it starts.
async fn forward(
    front: &ProxyFront,
    mut request: Request<Incoming>,
    path: String,
    stream: flotilla_transport::TunnelStream,
    line: AuditLine,
    started: Instant,
    permits: (OwnedSemaphorePermit, Option<OwnedSemaphorePermit>),
) -> Result<Response<ProxyBody>, (StatusCode, String)> {
    let cluster = line.cluster.clone();
    let lost = |e: hyper::Error| {
        (
            StatusCode::BAD_GATEWAY,
            format!("cluster {cluster}: the tunnel to its agent broke: {e}"),
        )
    };
    let (mut sender, connection) = hyper::client::conn::http1::Builder::new()
        .handshake::<_, ProxyBody>(TokioIo::new(stream))
        .await
        .map_err(lost)?;
    // The connection runs as long as the request does: the finish guard aborts it.
    let connection = AbortOnDrop(tokio::spawn(async move {
        if let Err(e) = connection.with_upgrades().await {
            debug!(error = %e, "tunnel connection ended");
        }
    }));
    let upgrade = tunnel::is_upgrade(request.headers());
    let from_user = upgrade.then(|| hyper::upgrade::on(&mut request));
    let (mut parts, body) = request.into_parts();
    parts.uri = cluster_uri(&path, parts.uri.query()).map_err(|e| (StatusCode::BAD_REQUEST, e))?;
    let bytes_in = Arc::new(AtomicU64::new(0));
    let bytes_out = Arc::new(AtomicU64::new(0));
    let body = Counted {
        inner: body,
        count: bytes_in.clone(),
        finish: None,
    }
    .map_err(BoxError::from)
    .boxed();
    let mut response = sender
        .send_request(Request::from_parts(parts, body))
        .await
        .map_err(lost)?;
    let mut finish = Finish {
        line,
        started,
        sink: front.audit.clone(),
        bytes_in,
        bytes_out: bytes_out.clone(),
        _permits: permits,
        _connection: connection,
    };
    finish.line.status = response.status().as_u16();
    if let Some(from_user) = from_user
        && response.status() == StatusCode::SWITCHING_PROTOCOLS
    {
        let to_agent = hyper::upgrade::on(&mut response);
        let idle = front.limits.idle_timeout;
        let relay = async move {
            match tokio::try_join!(from_user, to_agent) {
                Ok((user, agent)) => {
                    let (sent, received) = flotilla_transport::relay::relay_bytes(
                        TokioIo::new(user),
                        TokioIo::new(agent),
                        idle,
                    )
                    .await;
                    finish.bytes_in.fetch_add(sent, Ordering::Relaxed);
                    finish.bytes_out.fetch_add(received, Ordering::Relaxed);
                }
                Err(e) => warn!(error = %e, "the upgrade did not complete"),
            }
            drop(finish);
        };
        if front.relays.try_send(relay.boxed()).is_err() {
            warn!("upgraded stream dropped: the proxy front holds as many as it may");
        }
        return Ok(response.map(|_| Full::new(Bytes::new()).map_err(|n| match n {}).boxed()));
    }
    tunnel::remove_hop_by_hop(response.headers_mut());
    Ok(response.map(|body| {
        Counted {
            inner: body,
            count: bytes_out,
            finish: Some(finish),
        }
        .map_err(BoxError::from)
        .boxed()
    }))
}

/// What the front reads from a request's head before it knows who sent it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RequestHead {
    /// The cluster the request is for.
    pub(crate) cluster: String,
    /// The Kubernetes API path on that cluster (what follows `/clusters/NAME`).
    pub(crate) path: String,
    /// The Kubernetes verb, for the audit line and read-only access.
    pub(crate) verb: String,
    /// Whether it asks to switch protocols (exec, attach, port-forward).
    pub(crate) upgrade: bool,
}

/// Why a request head is refused before anything else is read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HeadRefusal {
    pub(crate) status: StatusCode,
    pub(crate) reason: &'static str,
    /// What is wrong, naming the path.
    pub(crate) message: String,
}

impl RequestHead {
    /// Reads the cluster, path and verb, or says why the path is not a cluster's.
    pub(crate) fn read(
        method: &http::Method,
        uri: &http::Uri,
        headers: &http::HeaderMap,
    ) -> Result<RequestHead, HeadRefusal> {
        let Some((cluster, path)) = cluster_path(uri.path()) else {
            return Err(HeadRefusal {
                status: StatusCode::NOT_FOUND,
                reason: "NotFound",
                message: format!(
                    "{} is not a cluster path; the proxy front serves /clusters/NAME/<Kubernetes API path> (flotilla kubeconfig --cluster NAME writes a kubeconfig for it; with kubectl get --raw, give the whole path, /clusters/NAME/api/...: --raw replaces the kubeconfig server's path)",
                    uri.path()
                ),
            });
        };
        // Normalized by anything on the way (a client library, a proxy, the spoke), a `.` or
        // `..` segment takes the path out of the cluster's API: to another cluster's path, or
        // the hub's own, while the front routed and authorised it for this cluster.
        if path.split('/').any(is_dot_segment) {
            return Err(HeadRefusal {
                status: StatusCode::BAD_REQUEST,
                reason: "BadRequest",
                message: format!(
                    "{}: a path with a `.` or `..` segment is refused; normalized, it would leave cluster {cluster}'s API",
                    uri.path()
                ),
            });
        }
        let verb = audit::verb(method, &path, uri.query());
        Ok(RequestHead {
            cluster,
            path,
            verb,
            upgrade: tunnel::is_upgrade(headers),
        })
    }
}

/// The request's headers as they travel to the agent: the user's credentials and
/// impersonation never pass (nor hop-by-hop headers); the hub user's identity and the tunnel's
/// id do. An error names a user or group that cannot travel in a header.
pub(crate) fn forwarded_headers(
    headers: &mut http::HeaderMap,
    user: &ProxyUser,
    tunnel_id: &str,
) -> Result<(), String> {
    tunnel::strip_credentials(headers);
    tunnel::remove_hop_by_hop(headers);
    tunnel::set_identity(headers, &user.user, &user.groups)?;
    headers.insert(
        tunnel::TUNNEL_ID,
        http::HeaderValue::from_str(tunnel_id).expect("tunnel ids are header-safe"),
    );
    Ok(())
}

/// The request's URI on the cluster: `path` there, with the user's query.
pub(crate) fn cluster_uri(path: &str, query: Option<&str>) -> Result<http::Uri, String> {
    match query {
        Some(q) => format!("{path}?{q}"),
        None => path.to_string(),
    }
    .parse()
    .map_err(|e| format!("bad request path: {e}"))
}

/// `/clusters/NAME/rest` as (NAME, `/rest`), NAME a valid cluster name.
fn cluster_path(path: &str) -> Option<(String, String)> {
    let rest = path.strip_prefix("/clusters/")?;
    let (name, rest) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    flotilla_proto::contract::is_dns1123_label(name).then(|| (name.to_string(), rest.to_string()))
}

/// A `.` or `..` path segment, spelled plainly or percent-encoded (`%2e`, `%2E`).
fn is_dot_segment(segment: &str) -> bool {
    matches!(
        segment.to_ascii_lowercase().replace("%2e", ".").as_str(),
        "." | ".."
    )
}

/// A failure of the hub's own, as a Kubernetes Status kubectl prints.
/// Whether `path` (within a cluster) is a discovery root that kubectl reads without decoding
/// an error body: for those, client-go keeps an error's message only from a `text/` body, and
/// a JSON Status reaches the user as "Error from server (Forbidden): unknown" after five
/// "couldn't get current server API group list: unknown" lines.
fn read_raw_by_kubectl(path: &str) -> bool {
    matches!(path.trim_end_matches('/'), "/api" | "/apis")
}

/// A refusal as plain text (see [`read_raw_by_kubectl`]).
fn text_failure(status: StatusCode, message: &str) -> Response<ProxyBody> {
    let mut response = failure(status, "", message);
    *response.body_mut() = Full::new(Bytes::from(format!("{message}\n")))
        .map_err(|n| match n {})
        .boxed();
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

fn failure(status: StatusCode, reason: &str, message: &str) -> Response<ProxyBody> {
    let body = tunnel::status_body(status.as_u16(), reason, message);
    let mut response = Response::new(Full::new(Bytes::from(body)).map_err(|n| match n {}).boxed());
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

/// Requests in flight per key (cluster or user), each key bounded.
struct InFlight {
    max: usize,
    keys: Mutex<HashMap<String, Arc<Semaphore>>>,
}

impl InFlight {
    fn new(max: usize) -> InFlight {
        InFlight {
            max,
            keys: Mutex::new(HashMap::new()),
        }
    }

    /// A slot for `key`, or `None` when it has `max` in flight.
    async fn try_acquire(&self, key: &str) -> Option<OwnedSemaphorePermit> {
        let semaphore = {
            let mut keys = self.keys.lock().await;
            if keys.len() >= MAX_LIMIT_KEYS && !keys.contains_key(key) {
                keys.retain(|_, s| s.available_permits() < self.max);
            }
            keys.entry(key.to_string())
                .or_insert_with(|| Arc::new(Semaphore::new(self.max)))
                .clone()
        };
        semaphore.try_acquire_owned().ok()
    }
}

/// Held while a request is in flight: its limit slots, its tunnel connection, and the audit
/// line written when it drops (the body ended or was dropped, or the relay closed).
struct Finish {
    line: AuditLine,
    started: Instant,
    sink: AuditSink,
    bytes_in: Arc<AtomicU64>,
    bytes_out: Arc<AtomicU64>,
    _permits: (OwnedSemaphorePermit, Option<OwnedSemaphorePermit>),
    _connection: AbortOnDrop,
}

impl Drop for Finish {
    fn drop(&mut self) {
        let mut line = std::mem::replace(&mut self.line, empty_line());
        line.bytes_in = self.bytes_in.load(Ordering::Relaxed);
        line.bytes_out = self.bytes_out.load(Ordering::Relaxed);
        line.duration_ms = self.started.elapsed().as_millis() as u64;
        self.sink.record(line);
    }
}

fn empty_line() -> AuditLine {
    AuditLine {
        time: String::new(),
        user: String::new(),
        groups: Vec::new(),
        cluster: String::new(),
        verb: String::new(),
        method: String::new(),
        path: String::new(),
        status: 0,
        bytes_in: 0,
        bytes_out: 0,
        duration_ms: 0,
        tunnel: String::new(),
        refused: String::new(),
    }
}

/// A task that ends with its owner.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A body that counts its data bytes and, when it ends or is dropped, drops its finish guard.
struct Counted<B> {
    inner: B,
    count: Arc<AtomicU64>,
    finish: Option<Finish>,
}

impl<B> Body for Counted<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.count.fetch_add(data.len() as u64, Ordering::Relaxed);
                }
            }
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => self.finish = None,
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_paths_name_a_valid_cluster() {
        assert_eq!(
            cluster_path("/clusters/store-1/api/v1/namespaces"),
            Some(("store-1".into(), "/api/v1/namespaces".into()))
        );
        assert_eq!(
            cluster_path("/clusters/store-1"),
            Some(("store-1".into(), "/".into()))
        );
        assert_eq!(cluster_path("/clusters/Store_1/api"), None);
        assert_eq!(cluster_path("/api/v1/namespaces"), None);
    }

    #[test]
    fn paths_that_leave_the_cluster_once_normalized_are_refused() {
        let read = |path: &str| {
            let uri: http::Uri = path.parse().unwrap();
            RequestHead::read(&http::Method::GET, &uri, &http::HeaderMap::new())
        };
        for path in [
            "/clusters/store-1/../store-2/api/v1/secrets",
            "/clusters/store-1/api/%2e%2E/%2E%2e/store-2/api",
            "/clusters/store-1/api/./v1",
            "/clusters/store-1/..",
        ] {
            let refusal = read(path).unwrap_err();
            assert_eq!(refusal.status, StatusCode::BAD_REQUEST, "{path}");
            assert!(refusal.message.starts_with(path), "{}", refusal.message);
            assert!(
                refusal.message.contains("cluster store-1"),
                "{}",
                refusal.message
            );
        }
        // Dots inside a segment are names like any other.
        let head = read("/clusters/store-1/api/v1/namespaces/a..b/configmaps/.x").unwrap();
        assert_eq!(head.path, "/api/v1/namespaces/a..b/configmaps/.x");
    }

    /// A cluster's tunnels, all stalled, must leave the session's connection window room for
    /// its own frames, on both carriers.
    #[test]
    fn stalled_tunnels_cannot_take_a_sessions_whole_window() {
        let grpc = flotilla_transport::grpc::GrpcSettings::default();
        let quic = flotilla_transport::quic::QuicSettings::default();
        for (carrier, stream, connection) in [
            ("grpc", grpc.stream_window, grpc.connection_window),
            ("quic", quic.stream_window, quic.connection_window),
        ] {
            let held = DEFAULT_MAX_PER_CLUSTER as u64 * u64::from(stream);
            assert!(
                held + u64::from(stream) <= u64::from(connection),
                "{carrier}: {DEFAULT_MAX_PER_CLUSTER} stalled tunnels hold {held} bytes of a {connection}-byte window"
            );
        }
    }

    #[tokio::test]
    async fn each_key_has_its_own_bound() {
        let limits = InFlight::new(2);
        let a1 = limits.try_acquire("a").await.unwrap();
        let _a2 = limits.try_acquire("a").await.unwrap();
        assert!(limits.try_acquire("a").await.is_none());
        assert!(limits.try_acquire("b").await.is_some());
        drop(a1);
        assert!(limits.try_acquire("a").await.is_some());
    }
}
