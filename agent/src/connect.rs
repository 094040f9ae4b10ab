//! Dialling the hub on the carrier `--transport` chooses: gRPC (TCP, directly or through an
//! HTTP CONNECT proxy, from a chosen source address if asked, then TLS with the agent's client
//! certificate, then HTTP/2), QUIC (UDP, the same mTLS), or `auto`: QUIC first, gRPC when no
//! QUIC handshake completes within [`QUIC_ATTEMPT_TIMEOUT`] (UDP blocked on the way), with the
//! choice remembered and QUIC tried again after [`QUIC_RETRY_AFTER`].

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use flotilla_proto::wire::AgentFrame;
use flotilla_transport::dial::ProxyUrl;
use flotilla_transport::quic::{QuicClient, QuicSettings};
use flotilla_transport::{Carrier, Dialed, LinkError};
use rustls_pki_types::ServerName;
use tokio::sync::Mutex;
use tokio::time::Instant;
use tracing::info;

/// How long one dial (TCP, proxy, TLS and HTTP/2 together; or the QUIC handshake) may take
/// before it counts as a failed attempt and the agent backs off: without it a SYN into a black
/// hole waits for the kernel's retries (minutes).
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a dial to a redirect target (a gateway named by another as its shard's owner, or
/// the gateway of the last session) may take: one that does not answer may have died, and the
/// agent is better off back at its configured address, where the directory will have caught
/// up. Not much shorter: a gateway busy with a storm takes seconds over a handshake, and one
/// abandoned is work both ends did for nothing (3 s turned a 50,000-agent ramp on two cores
/// into a loop of abandoned handshakes).
pub const REDIRECT_DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// With `--transport auto`: how long QUIC gets before the agent takes gRPC instead.
pub const QUIC_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(3);
/// With `--transport auto`: how long gRPC is used after QUIC failed before QUIC is tried again.
pub const QUIC_RETRY_AFTER: Duration = Duration::from_secs(600);
/// Largest frame either side may send on the session (a ManifestWork is at most ~1.5 MiB).
pub const MAX_FRAME_BYTES: usize = 8 * 1024 * 1024;

/// The QUIC settings of an agent's connections. No idle timeout of the agent's own: the hub's
/// (twice its heartbeat timeout, a minute at least) holds, so a hub stalled for less than its
/// heartbeat timeout keeps its sessions; the agent's own minute closed them sooner. The
/// session's heartbeats still find a hub that has gone.
pub fn quic_settings(congestion: flotilla_transport::quic::QuicCongestion) -> QuicSettings {
    QuicSettings {
        max_frame_bytes: MAX_FRAME_BYTES,
        congestion,
        idle_timeout: None,
        ..QuicSettings::default()
    }
}

/// Which carrier the agent uses (`--transport`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    /// gRPC over HTTP/2 over TLS (TCP). Goes through HTTP CONNECT proxies.
    Grpc,
    /// QUIC (UDP) with the same mTLS.
    Quic,
    /// QUIC, falling back to gRPC when UDP does not get through (and always gRPC behind a
    /// proxy).
    #[default]
    Auto,
}

/// Everything needed to open a session with the hub. The identity files are read again for
/// every connection, so a certificate renewed over the session (or a new CA bundle) is used
/// from the next connection on without a restart. While the identity stays as it is, its TLS
/// configuration and the session tickets the hub's listeners give are kept for the next
/// connection, which resumes (no certificate signed or verified on either end: what a storm
/// of reconnects spends its CPU on); a changed identity starts without tickets, since a
/// resumed connection would speak for the old certificate.
#[derive(Clone)]
pub struct Dialer {
    hub: String,
    server_name: ServerName<'static>,
    cert_dir: PathBuf,
    proxy: Option<ProxyUrl>,
    local_address: Option<IpAddr>,
    transport: Transport,
    quic_congestion: flotilla_transport::quic::QuicCongestion,
    /// How long one dial may take ([`DIAL_TIMEOUT`], or [`REDIRECT_DIAL_TIMEOUT`] to a
    /// redirect target).
    dial_timeout: Duration,
    /// The QUIC endpoint (one UDP socket), made at the first QUIC dial unless given.
    quic: Arc<Mutex<Option<QuicClient>>>,
    /// With `auto`: until when gRPC is used without trying QUIC (it failed before).
    grpc_until: Arc<Mutex<Option<Instant>>>,
    /// The identity last read and its TLS configuration, which holds the session tickets
    /// (rustls resumes only under the configuration a ticket came with); shared with
    /// redirected copies of this dialer.
    tls: Arc<Mutex<Option<KeptTls>>>,
}

impl Dialer {
    /// Checks the identity in `cert_dir` once, so a broken one fails at start.
    pub fn new(hub: &str, server_name: &str, cert_dir: &Path) -> anyhow::Result<Dialer> {
        Identity::read(cert_dir)?.config(rustls::client::Resumption::disabled())?;
        Ok(Dialer {
            hub: hub.to_string(),
            server_name: ServerName::try_from(server_name.to_string())
                .with_context(|| format!("{server_name:?} is not a valid server name"))?,
            cert_dir: cert_dir.to_path_buf(),
            proxy: None,
            local_address: None,
            transport: Transport::Grpc,
            quic_congestion: Default::default(),
            dial_timeout: DIAL_TIMEOUT,
            quic: Arc::default(),
            grpc_until: Arc::default(),
            tls: Arc::default(),
        })
    }

    /// Binds each connection's socket to `address` (port chosen by the kernel) before dialling:
    /// for hosts with several addresses, and for the load test, whose thousands of agents need
    /// more source ports than one address has. A loopback address is not used to dial a hub
    /// (or redirect target) outside loopback, which it cannot reach: the kernel picks the
    /// source of the route then.
    pub fn with_local_address(mut self, address: Option<IpAddr>) -> Dialer {
        self.local_address = address;
        self
    }

    /// The QUIC endpoint's congestion controller (`--quic-congestion`), for the endpoint made
    /// at the first QUIC dial.
    pub fn with_quic_congestion(
        mut self,
        congestion: flotilla_transport::quic::QuicCongestion,
    ) -> Dialer {
        self.quic_congestion = congestion;
        self
    }

    /// Dials through `proxy` (HTTP CONNECT) when given.
    pub fn with_proxy(mut self, proxy: Option<ProxyUrl>) -> Dialer {
        self.proxy = proxy;
        self
    }

    /// Uses `transport` for sessions.
    pub fn with_transport(mut self, transport: Transport) -> Dialer {
        self.transport = transport;
        self
    }

    /// Uses this QUIC endpoint instead of making one (the load test shares one UDP socket
    /// among thousands of agents; a test rebinds it under a live session).
    pub fn with_quic_client(self, client: QuicClient) -> Dialer {
        *self
            .quic
            .try_lock()
            .expect("a new dialer is not shared yet") = Some(client);
        self
    }

    /// The same dialer aimed at `address` (a gateway's redirect): same identity, server name,
    /// carrier and QUIC endpoint.
    pub fn redirected(&self, address: &str) -> Dialer {
        Dialer {
            hub: address.to_string(),
            dial_timeout: REDIRECT_DIAL_TIMEOUT,
            ..self.clone()
        }
    }

    /// The hub's address, as dialled.
    pub fn hub(&self) -> &str {
        &self.hub
    }

    /// The carrier it dials with (`--transport`).
    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// Opens a session with the hub, `first` (the hello) being its first frame, within
    /// [`DIAL_TIMEOUT`] ([`REDIRECT_DIAL_TIMEOUT`] for a redirect target).
    pub async fn connect(&self, first: AgentFrame) -> Result<Dialed, LinkError> {
        match self.transport {
            Transport::Grpc => self.grpc(first).await,
            Transport::Quic => self.quic(first, self.dial_timeout).await,
            Transport::Auto => self.auto(first).await,
        }
    }

    /// QUIC unless it failed recently or a proxy is in the way; gRPC when QUIC does not get
    /// through. A TLS or admission refusal over QUIC is returned as is: gRPC would meet the
    /// same hub and the same answer. So is a gateway over its rate turning the connection
    /// away: QUIC got through, and the agent comes back over it when told.
    async fn auto(&self, first: AgentFrame) -> Result<Dialed, LinkError> {
        if self.proxy.is_some() {
            return self.grpc(first).await;
        }
        let remembered = *self.grpc_until.lock().await;
        if remembered.is_some_and(|until| Instant::now() < until) {
            return self.grpc(first).await;
        }
        match self
            .quic(first.clone(), QUIC_ATTEMPT_TIMEOUT.min(self.dial_timeout))
            .await
        {
            Ok(dialed) => {
                *self.grpc_until.lock().await = None;
                Ok(dialed)
            }
            Err(e @ (LinkError::Tls { .. } | LinkError::TurnedAway { .. })) => Err(e),
            Err(e) => {
                info!(
                    hub = %self.hub,
                    error = %e,
                    retry_quic_in = ?QUIC_RETRY_AFTER,
                    "QUIC did not get through (UDP blocked?); using gRPC over TCP"
                );
                *self.grpc_until.lock().await = Some(Instant::now() + QUIC_RETRY_AFTER);
                self.grpc(first).await
            }
        }
    }

    /// The TLS configuration of the next connection: the identity as it is on disk now, and
    /// the tickets of that certificate.
    async fn tls(&self) -> Result<Arc<rustls::ClientConfig>, LinkError> {
        let identity =
            Identity::read(&self.cert_dir).map_err(|e| LinkError::Transport(format!("{e:#}")))?;
        let digest = identity.digest();
        let mut kept = self.tls.lock().await;
        if let Some((same, config)) = kept.as_ref()
            && *same == digest
        {
            return Ok(config.clone());
        }
        let config = identity
            .config(rustls::client::Resumption::in_memory_sessions(TICKETS_KEPT))
            .map_err(|e| LinkError::Transport(format!("{e:#}")))?;
        *kept = Some((digest, config.clone()));
        Ok(config)
    }

    async fn grpc(&self, first: AgentFrame) -> Result<Dialed, LinkError> {
        let tls = self.tls().await?;
        let dial = async {
            let channel = flotilla_transport::grpc::connect(
                &self.hub,
                self.server_name.clone(),
                tls,
                self.proxy.as_ref(),
                source_for(self.local_address, &self.hub),
            )
            .await?;
            flotilla_transport::grpc::open_session(channel, MAX_FRAME_BYTES, first).await
        };
        let within = self.dial_timeout;
        tokio::time::timeout(within, dial).await.map_err(|_| {
            LinkError::TimedOut(format!(
                "connecting to the hub at {}: no answer within {within:?}",
                self.hub
            ))
        })?
    }

    async fn quic(&self, first: AgentFrame, within: Duration) -> Result<Dialed, LinkError> {
        if self.proxy.is_some() {
            return Err(LinkError::Transport(
                "QUIC cannot go through an HTTP proxy: use --transport grpc (or auto)".into(),
            ));
        }
        let tls = self.tls().await?;
        let addr = self.resolve().await?;
        let client = self.quic_client(addr).await?;
        let name = server_name_text(&self.server_name);
        tokio::time::timeout(within, client.open_session(addr, &name, &tls, first))
            .await
            .map_err(|_| {
                LinkError::TimedOut(format!(
                    "no QUIC handshake with the hub at {} within {within:?}",
                    self.hub
                ))
            })?
    }

    async fn quic_client(&self, hub: SocketAddr) -> Result<QuicClient, LinkError> {
        let mut slot = self.quic.lock().await;
        if let Some(client) = slot.as_ref() {
            return Ok(client.clone());
        }
        let local = match self.local_address {
            Some(ip) => SocketAddr::new(ip, 0),
            None if hub.is_ipv4() => SocketAddr::from(([0, 0, 0, 0], 0)),
            None => SocketAddr::from(([0u16; 8], 0)),
        };
        let client = QuicClient::bind(local, quic_settings(self.quic_congestion))
            .map_err(|e| LinkError::Transport(format!("opening a UDP socket for QUIC: {e}")))?;
        *slot = Some(client.clone());
        Ok(client)
    }

    async fn resolve(&self) -> Result<SocketAddr, LinkError> {
        let mut addrs = tokio::net::lookup_host(&self.hub)
            .await
            .map_err(|e| LinkError::Unreachable(format!("resolving {}: {e}", self.hub)))?;
        addrs
            .next()
            .ok_or_else(|| LinkError::Unreachable(format!("{} has no address", self.hub)))
    }

    /// The carrier the next `auto` dial starts with (for logs and tests).
    pub async fn preferred(&self) -> Carrier {
        match self.transport {
            Transport::Grpc => Carrier::Grpc,
            Transport::Quic => Carrier::Quic,
            Transport::Auto => {
                let grpc = self.proxy.is_some()
                    || self
                        .grpc_until
                        .lock()
                        .await
                        .is_some_and(|until| Instant::now() < until);
                if grpc { Carrier::Grpc } else { Carrier::Quic }
            }
        }
    }
}

fn server_name_text(name: &ServerName<'static>) -> String {
    match name {
        ServerName::DnsName(d) => d.as_ref().to_string(),
        ServerName::IpAddress(ip) => IpAddr::from(*ip).to_string(),
        other => format!("{other:?}"),
    }
}

/// Session tickets an agent keeps (rustls holds up to 8 per server name, so this is room for
/// the names of 8 hubs or gateways; the agent dials all of a hub's gateways by one name).
const TICKETS_KEPT: usize = 64;

/// The digest of the identity files ([`Identity::digest`]) and the TLS configuration made from
/// them.
type KeptTls = ([u8; 32], Arc<rustls::ClientConfig>);

/// The agent's identity as its directory holds it now.
struct Identity {
    cert_dir: PathBuf,
    ca: Vec<u8>,
    cert: Vec<u8>,
    key: Vec<u8>,
}

impl Identity {
    fn read(cert_dir: &Path) -> anyhow::Result<Identity> {
        let read = |f: &str| {
            let p = cert_dir.join(f);
            std::fs::read(&p).with_context(|| {
                format!(
                    "reading {} (the agent's identity: join first with `flotilla-agent join`, or pass --cert-dir)",
                    p.display()
                )
            })
        };
        Ok(Identity {
            cert_dir: cert_dir.to_path_buf(),
            ca: read("ca.crt")?,
            cert: read("tls.crt")?,
            key: read("tls.key")?,
        })
    }

    /// SHA-256 over the three files, each preceded by its length: what a dialer keeps to
    /// tell whether the identity changed (the files themselves are in its configuration).
    fn digest(&self) -> [u8; 32] {
        use sha2::Digest as _;
        let mut hash = sha2::Sha256::new();
        for file in [&self.ca, &self.cert, &self.key] {
            hash.update((file.len() as u64).to_be_bytes());
            hash.update(file);
        }
        hash.finalize().into()
    }

    /// The TLS client configuration of this identity, resuming from `resumption`.
    fn config(
        &self,
        resumption: rustls::client::Resumption,
    ) -> anyhow::Result<Arc<rustls::ClientConfig>> {
        flotilla_transport::tls::client_config_resuming(
            &self.ca,
            &self.cert,
            &self.key,
            &[],
            resumption,
        )
        .with_context(|| format!("the agent's identity in {}", self.cert_dir.display()))
    }
}

/// The source address to dial `hub` from: `local`, unless it is a loopback address and `hub`
/// an IP address outside loopback (no route joins the two; the kernel's choice is used).
fn source_for(local: Option<IpAddr>, hub: &str) -> Option<IpAddr> {
    let outside_loopback = hub
        .parse::<SocketAddr>()
        .is_ok_and(|a| !a.ip().is_loopback());
    local.filter(|l| !(l.is_loopback() && outside_loopback))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_source_is_kept_for_loopback_hubs_and_names_only() {
        let lo: IpAddr = "127.0.0.5".parse().unwrap();
        let veth: IpAddr = "10.213.0.1".parse().unwrap();
        let check = |local, hub, want: Option<IpAddr>| {
            assert_eq!(source_for(local, hub), want, "{local:?} → {hub}");
        };
        check(Some(lo), "127.0.0.1:9443", Some(lo));
        check(Some(lo), "localhost:9443", Some(lo));
        check(Some(lo), "10.213.0.2:9443", None);
        check(Some(veth), "10.213.0.2:9443", Some(veth));
        check(None, "10.213.0.2:9443", None);
    }
}
