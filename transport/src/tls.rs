//! TLS for every listener flotilla runs: rustls with the ring provider only, client
//! certificates verified against the hub CA, and the peer's identity read once per connection.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tracing::{debug, warn};

use crate::gate::{ConnectionGate, Entry};
use crate::identity::{Peer, public_key_sha256};
use crate::link::Carrier;

/// Errors building a TLS configuration from PEM material; none is retryable without new files.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    #[error("{what}: no PEM certificate found")]
    NoCertificate { what: &'static str },
    #[error("{what}: PEM does not parse: {source}")]
    Pem {
        what: &'static str,
        source: rustls_pki_types::pem::Error,
    },
    #[error("TLS configuration rejected: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

/// The one crypto provider flotilla uses (ring; aws-lc stays out of the build).
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

pub fn parse_certs(
    pem: &[u8],
    what: &'static str,
) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsConfigError::Pem { what, source })?;
    if certs.is_empty() {
        return Err(TlsConfigError::NoCertificate { what });
    }
    Ok(certs)
}

pub fn parse_key(pem: &[u8], what: &'static str) -> Result<PrivateKeyDer<'static>, TlsConfigError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|source| TlsConfigError::Pem { what, source })
}

pub fn root_store(ca_pem: &[u8]) -> Result<RootCertStore, TlsConfigError> {
    let mut roots = RootCertStore::empty();
    for cert in parse_certs(ca_pem, "CA bundle")? {
        roots.add(cert)?;
    }
    Ok(roots)
}

/// A server configuration that requires a client certificate issued by `ca_pem` and speaks
/// HTTP/2 (gRPC) and HTTP/1.1 (operator API).
pub fn server_config(
    ca_pem: &[u8],
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<Arc<rustls::ServerConfig>, TlsConfigError> {
    let provider = provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(
        Arc::new(root_store(ca_pem)?),
        provider.clone(),
    )
    .build()?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            parse_certs(cert_pem, "server certificate")?,
            parse_key(key_pem, "server key")?,
        )?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The agents' listener: client certificates issued by a CA in `ca_bundle_pem` (during a CA
/// rotation, the old and the new CA) are verified, and a client without one may complete the
/// handshake as [`Peer::Anonymous`] so that a joining agent can reach `Registration.Join`;
/// every other service refuses anonymous peers. `chain_pem` is the serving certificate followed
/// by the CA certificates a joining agent needs to find the CA it pinned by fingerprint. HTTP/2
/// only. Each handshake ends with one session ticket under `tickets` (keyed also by
/// `ca_bundle_pem`), with which the agent's next connection resumes instead of signing and
/// verifying certificates again ([`crate::tickets`]).
pub fn agent_server_config(
    ca_bundle_pem: &[u8],
    chain_pem: &[u8],
    key_pem: &[u8],
    tickets: &crate::tickets::TicketKeys,
) -> Result<Arc<rustls::ServerConfig>, TlsConfigError> {
    let provider = provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(
        Arc::new(root_store(ca_bundle_pem)?),
        provider.clone(),
    )
    .allow_unauthenticated()
    .build()?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            parse_certs(chain_pem, "server certificate chain")?,
            parse_key(key_pem, "server key")?,
        )?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    config.ticketer = tickets.ticketer(ca_bundle_pem);
    // One ticket per handshake: an agent holds one connection, and a resumption (which uses
    // its ticket up) brings the next.
    config.send_tls13_tickets = 1;
    Ok(Arc::new(config))
}

/// The hub's proxy front (kubectl through tunnels): a client certificate from a CA in
/// `ca_bundle_pem` is verified and read, and a client without one completes the handshake as
/// [`Peer::Anonymous`] so that it can authenticate with a bearer token instead. HTTP/1.1 only:
/// kubectl's upgrades (exec, attach, port-forward over WebSocket or SPDY) need it, and each
/// request becomes its own tunnel stream anyway.
pub fn proxy_server_config(
    ca_bundle_pem: &[u8],
    chain_pem: &[u8],
    key_pem: &[u8],
) -> Result<Arc<rustls::ServerConfig>, TlsConfigError> {
    let provider = provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(
        Arc::new(root_store(ca_bundle_pem)?),
        provider.clone(),
    )
    .allow_unauthenticated()
    .build()?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            parse_certs(chain_pem, "server certificate chain")?,
            parse_key(key_pem, "server key")?,
        )?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Where an accept loop takes its TLS configuration from, per connection: a fixed one, or one
/// the hub replaces at run time (a CA rotation changes the serving chain and the client roots;
/// established connections keep theirs, new handshakes use the new one).
#[derive(Clone, Debug)]
pub struct TlsSource(watch::Receiver<Arc<rustls::ServerConfig>>);

impl TlsSource {
    /// A source that can be updated through the returned sender.
    pub fn updatable(
        config: Arc<rustls::ServerConfig>,
    ) -> (watch::Sender<Arc<rustls::ServerConfig>>, TlsSource) {
        let (tx, rx) = watch::channel(config);
        (tx, TlsSource(rx))
    }

    fn current(&self) -> Arc<rustls::ServerConfig> {
        self.0.borrow().clone()
    }
}

impl From<Arc<rustls::ServerConfig>> for TlsSource {
    fn from(config: Arc<rustls::ServerConfig>) -> Self {
        TlsSource::updatable(config).1
    }
}

/// A client configuration that trusts only `ca_pem` and presents the given certificate.
pub fn client_config(
    ca_pem: &[u8],
    cert_pem: &[u8],
    key_pem: &[u8],
    alpn: &[&[u8]],
) -> Result<Arc<rustls::ClientConfig>, TlsConfigError> {
    client_config_resuming(
        ca_pem,
        cert_pem,
        key_pem,
        alpn,
        rustls::client::Resumption::default(),
    )
}

/// [`client_config`] keeping its session tickets in `resumption`: an agent gives each
/// connection the store of the one before (for as long as its certificate stays the same),
/// so that its reconnects resume.
pub fn client_config_resuming(
    ca_pem: &[u8],
    cert_pem: &[u8],
    key_pem: &[u8],
    alpn: &[&[u8]],
    resumption: rustls::client::Resumption,
) -> Result<Arc<rustls::ClientConfig>, TlsConfigError> {
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(root_store(ca_pem)?)
        .with_client_auth_cert(
            parse_certs(cert_pem, "client certificate")?,
            parse_key(key_pem, "client key")?,
        )?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    config.resumption = resumption;
    Ok(Arc::new(config))
}

/// A TLS connection whose client certificate has been verified and read.
pub struct AuthenticatedConn {
    stream: TlsStream<TcpStream>,
    info: ConnInfo,
}

/// What a request handler learns about its connection (a request extension under tonic).
#[derive(Clone, Debug)]
pub struct ConnInfo {
    pub peer: Peer,
    pub remote: SocketAddr,
    /// [`public_key_sha256`](crate::identity::public_key_sha256) of the client certificate;
    /// `None` for anonymous peers. The gateway compares it with the cluster's registered keys.
    pub client_key_sha256: Option<String>,
    /// Set when a QUIC connection arrived over the new-session rate ([`ConnectionGate`]) and
    /// could not be turned away before its handshake (its first packet no longer remembered,
    /// [`crate::quic_turn_away`]): the session on it is to be drained at once, its agent told
    /// to come back after this long. Every other connection over the rate never gets this far.
    ///
    /// [`ConnectionGate`]: crate::gate::ConnectionGate
    pub over_rate: Option<Duration>,
}

impl ConnInfo {
    /// The cluster an agent certificate speaks for; `None` for operators and anonymous peers.
    pub fn cluster(&self) -> Option<&str> {
        match &self.peer {
            Peer::Cluster(name) => Some(name),
            _ => None,
        }
    }
}

impl AuthenticatedConn {
    pub fn info(&self) -> &ConnInfo {
        &self.info
    }
}

impl tonic::transport::server::Connected for AuthenticatedConn {
    type ConnectInfo = ConnInfo;
    fn connect_info(&self) -> ConnInfo {
        self.info.clone()
    }
}

impl AsyncRead for AuthenticatedConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for AuthenticatedConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// Limits of the TLS accept loop.
#[derive(Clone, Debug)]
pub struct AcceptLimits {
    /// Asked once per accepted TCP connection, before its handshake; `None` admits all.
    pub gate: Option<Arc<dyn ConnectionGate>>,
    /// Handshakes in progress at once; the excess waits in the kernel's accept backlog, so a
    /// reconnect storm costs queued SYNs rather than CPU spent on half-finished handshakes.
    /// So does every new connection while the gate says it is not accepting.
    pub max_handshakes: usize,
    /// A client that has not finished its handshake by then is dropped (slowloris guard).
    pub handshake_timeout: Duration,
}

impl Default for AcceptLimits {
    fn default() -> Self {
        AcceptLimits {
            gate: None,
            max_handshakes: 256,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

/// A listener that can no longer accept: the socket itself failed (closed, shut down, not a
/// socket any more). Not retryable in this process: the listener has to be opened again, which
/// is a restart's job.
#[derive(Debug, thiserror::Error)]
#[error("cannot accept on {address} any more ({what}): {source}")]
pub struct ListenerFailed {
    pub what: &'static str,
    pub address: String,
    #[source]
    pub source: io::Error,
}

/// Whether an `accept` error concerns only the connection being accepted, or resources that may
/// come back (file descriptors, memory): the loop goes on. Anything else means the listening
/// socket itself is broken.
fn accept_error_is_transient(e: &io::Error) -> bool {
    match e.raw_os_error() {
        Some(code) => ![
            libc::EINVAL,
            libc::EBADF,
            libc::ENOTSOCK,
            libc::EOPNOTSUPP,
            libc::EFAULT,
        ]
        .contains(&code),
        None => true,
    }
}

/// Most connections over the rate being turned away at once (each for at most
/// [`crate::turn_away::TURN_AWAY_TIMEOUT`]); one more is closed without its notice.
pub const MAX_TURNING_AWAY: usize = 1024;

/// Accepts TCP connections, performs TLS handshakes concurrently (bounded), and yields the
/// connections whose client certificate names a flotilla identity on the returned channel.
/// Refusals are logged here, once, with the peer address and the reason.
///
/// The accept loop is the returned future, for the caller to own (run it under its
/// supervisor): it owns the handshakes in flight, ends with `Ok` when the receiver is dropped,
/// and with [`ListenerFailed`] when the listening socket fails for good. Errors that concern one
/// connection or a resource that may come back (EMFILE) are logged and the loop goes on.
pub fn accept_authenticated(
    listener: TcpListener,
    config: impl Into<TlsSource>,
    limits: AcceptLimits,
    what: &'static str,
) -> (
    mpsc::Receiver<AuthenticatedConn>,
    impl Future<Output = Result<(), ListenerFailed>> + Send + 'static,
) {
    let (tx, rx) = mpsc::channel(64);
    let source = config.into();
    let permits = Arc::new(Semaphore::new(limits.max_handshakes));
    let turning_away = Arc::new(Semaphore::new(MAX_TURNING_AWAY));
    let address = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".to_string());
    let accept_loop = async move {
        let mut handshakes = JoinSet::new();
        let mut accepting = limits.gate.as_ref().and_then(|g| g.accepting());
        loop {
            // Reap finished handshakes so the set holds only those in flight.
            while handshakes.try_join_next().is_some() {}
            let Ok(permit) = permits.clone().acquire_owned().await else {
                return Ok(());
            };
            // A gateway about to serve keeps new connections in the backlog meanwhile.
            tokio::select! {
                _ = crate::gate::until_accepting(&mut accepting) => {}
                _ = tx.closed() => return Ok(()),
            }
            let (tcp, remote) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) if accept_error_is_transient(&e) => {
                        // EMFILE and friends: say so and keep serving the sessions we have.
                        warn!(listener = what, error = %e, "accept failed");
                        drop(permit);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    Err(source) => {
                        return Err(ListenerFailed { what, address, source });
                    }
                },
                _ = tx.closed() => return Ok(()),
            };
            let _ = tcp.set_nodelay(true);
            // Asked before any TLS work: what it costs is what the gate protects.
            match limits.gate.as_ref().map(|g| g.arrived(Carrier::Grpc)) {
                Some(Entry::Admitted) | None => {}
                Some(Entry::OverRate { retry_after }) => {
                    // Told in the clear, before any TLS, when to come back (`turn_away`).
                    drop(permit);
                    match turning_away.clone().try_acquire_owned() {
                        Ok(slot) => {
                            handshakes.spawn(async move {
                                let _slot = slot;
                                crate::turn_away::turn_away(tcp, retry_after).await;
                            });
                        }
                        Err(_) => {
                            debug!(listener = what, peer = %remote, "connection over the rate closed: {MAX_TURNING_AWAY} already being turned away");
                        }
                    }
                    continue;
                }
                Some(Entry::NotReady) => {
                    debug!(listener = what, peer = %remote, "connection closed before TLS: not serving yet");
                    continue;
                }
            }
            let acceptor = TlsAcceptor::from(source.current());
            let tx = tx.clone();
            let timeout = limits.handshake_timeout;
            handshakes.spawn(async move {
                let _permit = permit;
                let stream = match tokio::time::timeout(timeout, acceptor.accept(tcp)).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        warn!(listener = what, peer = %remote, error = %e,
                            "TLS handshake refused: {}", handshake_hint(&e.to_string()));
                        return;
                    }
                    Err(_) => {
                        warn!(listener = what, peer = %remote, "TLS handshake timed out after {timeout:?}");
                        return;
                    }
                };
                let Some(cert) = stream
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .cloned()
                else {
                    // Only a configuration that allows it (the agents' listener, for joining)
                    // completes a handshake without a client certificate.
                    debug!(listener = what, peer = %remote, "TLS connection without client certificate (joining agent)");
                    let info = ConnInfo {
                        peer: Peer::Anonymous,
                        remote,
                        client_key_sha256: None,
                        over_rate: None,
                    };
                    let _ = tx.send(AuthenticatedConn { stream, info }).await;
                    return;
                };
                match Peer::from_der(&cert).and_then(|peer| Ok((peer, public_key_sha256(&cert)?))) {
                    Ok((peer, key)) => {
                        debug!(listener = what, peer = %remote, identity = ?peer, "TLS connection authenticated");
                        let info = ConnInfo {
                            peer,
                            remote,
                            client_key_sha256: Some(key),
                            over_rate: None,
                        };
                        let _ = tx.send(AuthenticatedConn { stream, info }).await;
                    }
                    Err(e) => {
                        warn!(listener = what, peer = %remote, error = %e, "TLS connection refused")
                    }
                }
            });
        }
    };
    (rx, accept_loop)
}

/// One sentence for the operator reading the hub's log, from a handshake error's text.
pub(crate) fn handshake_hint(text: &str) -> &'static str {
    if text.contains("UnknownIssuer") || text.contains("BadSignature") {
        "client certificate is not signed by the hub CA"
    } else if text.contains("Expired") {
        "client certificate has expired"
    } else if text.contains("peer sent no certificates") || text.contains("NoCertificatesPresented")
    {
        "client presented no certificate; agents and operators must use hub-issued certificates"
    } else if text.contains("received fatal alert") {
        "the client rejected the hub's certificate chain (a joining agent with a wrong \
         --ca-fingerprint, or a client that does not trust this hub's CA)"
    } else {
        "TLS handshake failed"
    }
}
