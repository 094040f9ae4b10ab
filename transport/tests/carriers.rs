//! Both carriers through the seam, on loopback with real TLS: the gateway's side receives the
//! agent's session with its identity from the certificate, frames flow both ways, an
//! oversized frame ends only that session, a tunnel carries bytes both ways, and the agent's
//! QUIC socket can move to a new port under a live session, and a gateway that does not serve
//! yet closes connections before any TLS work, or holds them unaccepted while it loads, and
//! one over its rate tells the agent when to come back before any TLS work.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use flotilla_proto::wire::{self, agent_frame, hub_frame};
use flotilla_transport::gate::{ConnectionGate, Entry};
use flotilla_transport::grpc::{FleetService, GrpcSettings};
use flotilla_transport::identity::Peer;
use flotilla_transport::quic::{QuicClient, QuicListener, QuicSettings, ResetKey};
use flotilla_transport::tickets::TicketKeys;
use flotilla_transport::{Carrier, Dialed, Incoming, LinkError, tls};
use futures::StreamExt as _;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls_pki_types::ServerName;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::{mpsc, watch};

const MAX_FRAME: usize = 64 * 1024;

/// A CA, the gateway's serving certificate, and two agents' client certificates (store-1's
/// and its neighbour store-2's), as PEM.
struct Pki {
    ca: String,
    server: (String, String),
    agent: (String, String),
    neighbour: (String, String),
}

fn pki() -> Pki {
    pki_named("test CA")
}

fn pki_named(ca_name: &str) -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::default();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, ca_name);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let server_key = KeyPair::generate().unwrap();
    let server = CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .signed_by(&server_key, &issuer)
        .unwrap();
    let agent = |cluster: &str| {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, cluster);
        params
            .distinguished_name
            .push(DnType::OrganizationName, "flotilla:clusters");
        let cert = params.signed_by(&key, &issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    Pki {
        ca: ca_cert.pem(),
        server: (server.pem(), server_key.serialize_pem()),
        agent: agent("store-1"),
        neighbour: agent("store-2"),
    }
}

fn hello() -> wire::AgentFrame {
    wire::AgentFrame {
        frame: Some(agent_frame::Frame::Hello(wire::Hello {
            cluster_name: "store-1".into(),
            ..Default::default()
        })),
    }
}

fn heartbeat(seq: u64) -> wire::HubFrame {
    wire::HubFrame {
        frame: Some(hub_frame::Frame::Heartbeat(wire::Heartbeat { seq })),
    }
}

/// A gateway side on loopback for `carrier`; returns where it listens, the sessions it
/// accepts, and the switch that drains it.
async fn gateway(
    pki: &Pki,
    carrier: Carrier,
) -> (SocketAddr, mpsc::Receiver<Incoming>, watch::Sender<bool>) {
    gateway_with(pki, carrier, 16).await
}

/// [`gateway`] with QUIC handshakes in progress bounded at `quic_handshakes`.
async fn gateway_with(
    pki: &Pki,
    carrier: Carrier,
    quic_handshakes: usize,
) -> (SocketAddr, mpsc::Receiver<Incoming>, watch::Sender<bool>) {
    gateway_gated(pki, carrier, quic_handshakes, None).await
}

/// [`gateway_with`] asking `gate` about each new connection before its handshake.
async fn gateway_gated(
    pki: &Pki,
    carrier: Carrier,
    quic_handshakes: usize,
    gate: Option<Arc<dyn ConnectionGate>>,
) -> (SocketAddr, mpsc::Receiver<Incoming>, watch::Sender<bool>) {
    gateway_serving(server_tls(pki), carrier, quic_handshakes, gate).await
}

/// The gateway's serving TLS configuration from `pki`.
fn server_tls(pki: &Pki) -> Arc<rustls::ServerConfig> {
    tls::agent_server_config(
        pki.ca.as_bytes(),
        pki.server.0.as_bytes(),
        pki.server.1.as_bytes(),
        &TicketKeys::random(),
    )
    .unwrap()
}

/// A gateway side on loopback for `carrier` with `server_tls`, asking `gate` about each new
/// connection before its handshake.
async fn gateway_serving(
    server_tls: Arc<rustls::ServerConfig>,
    carrier: Carrier,
    quic_handshakes: usize,
    gate: Option<Arc<dyn ConnectionGate>>,
) -> (SocketAddr, mpsc::Receiver<Incoming>, watch::Sender<bool>) {
    let (sessions_tx, sessions) = mpsc::channel(16);
    let (drain_tx, drain) = watch::channel(false);
    let addr = match carrier {
        Carrier::Grpc => {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let limits = tls::AcceptLimits {
                gate: gate.clone(),
                ..Default::default()
            };
            let (conns, accept) = tls::accept_authenticated(listener, server_tls, limits, "agents");
            tokio::spawn(accept);
            let fleet = FleetService::new(sessions_tx);
            let routes = tonic::service::Routes::new(fleet.bytes_service())
                .add_service(fleet.into_server(MAX_FRAME));
            tokio::spawn(flotilla_transport::grpc::serve(
                conns,
                routes,
                GrpcSettings {
                    max_frame_bytes: MAX_FRAME,
                    ..Default::default()
                },
                drain,
            ));
            addr
        }
        Carrier::Quic => {
            let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            let mut listener =
                QuicListener::bind(socket, &server_tls, quic_settings(), ResetKey::random())
                    .unwrap();
            if let Some(gate) = gate {
                listener = listener.gated(gate);
            }
            let addr = listener.local_addr().unwrap();
            tokio::spawn(listener.serve(sessions_tx, quic_handshakes, drain));
            addr
        }
    };
    (addr, sessions, drain_tx)
}

fn quic_settings() -> QuicSettings {
    QuicSettings {
        max_frame_bytes: MAX_FRAME,
        ..Default::default()
    }
}

/// The agent's client TLS configuration from `pki`.
fn agent_tls(pki: &Pki) -> std::sync::Arc<rustls::ClientConfig> {
    tls::client_config(
        pki.ca.as_bytes(),
        pki.agent.0.as_bytes(),
        pki.agent.1.as_bytes(),
        &[],
    )
    .unwrap()
}

/// The neighbour agent's (store-2's) client TLS configuration from `pki`.
fn neighbour_tls(pki: &Pki) -> std::sync::Arc<rustls::ClientConfig> {
    tls::client_config(
        pki.ca.as_bytes(),
        pki.neighbour.0.as_bytes(),
        pki.neighbour.1.as_bytes(),
        &[],
    )
    .unwrap()
}

/// The agent's gRPC channel to the gateway at `addr` (named `localhost` in its certificate).
async fn grpc_channel(
    addr: SocketAddr,
    client_tls: std::sync::Arc<rustls::ClientConfig>,
) -> Result<tonic::transport::Channel, LinkError> {
    let server = ServerName::try_from("localhost").unwrap();
    flotilla_transport::grpc::connect(&addr.to_string(), server, client_tls, None, None).await
}

/// A dial of `carrier` to `addr` with `client_tls` that must fail: its error.
async fn refused_dial(
    carrier: Carrier,
    addr: SocketAddr,
    client_tls: std::sync::Arc<rustls::ClientConfig>,
) -> LinkError {
    match carrier {
        Carrier::Grpc => match grpc_channel(addr, client_tls).await {
            Err(e) => e,
            Ok(_) => panic!("grpc: the dial got a connection"),
        },
        Carrier::Quic => {
            let client = QuicClient::bind("127.0.0.1:0".parse().unwrap(), quic_settings()).unwrap();
            match client
                .open_session(addr, "localhost", &client_tls, hello())
                .await
            {
                Err(e) => e,
                Ok(_) => panic!("quic: the dial got a session"),
            }
        }
    }
}

/// The agent's side of `carrier` to `addr`, saying hello. Its own frame bound is four times
/// the gateway's, so a test can send what the gateway must refuse.
async fn dial(pki: &Pki, carrier: Carrier, addr: SocketAddr) -> (Dialed, Option<QuicClient>) {
    dial_as(agent_tls(pki), carrier, addr).await
}

/// [`dial`] with `client_tls`.
async fn dial_as(
    client_tls: Arc<rustls::ClientConfig>,
    carrier: Carrier,
    addr: SocketAddr,
) -> (Dialed, Option<QuicClient>) {
    match carrier {
        Carrier::Grpc => {
            let channel = grpc_channel(addr, client_tls).await.unwrap();
            (
                flotilla_transport::grpc::open_session(channel, 4 * MAX_FRAME, hello())
                    .await
                    .unwrap(),
                None,
            )
        }
        Carrier::Quic => {
            let settings = QuicSettings {
                max_frame_bytes: 4 * MAX_FRAME,
                ..Default::default()
            };
            let client = QuicClient::bind("127.0.0.1:0".parse().unwrap(), settings).unwrap();
            let dialed = client
                .open_session(addr, "localhost", &client_tls, hello())
                .await
                .unwrap();
            (dialed, Some(client))
        }
    }
}

/// Opens one session the way the real ends do: the agent says hello and the gateway answers
/// (a dial returns once the hub has answered, as a hub answers every hello). Both sides come
/// back with those two frames read and the agent's writer running.
async fn open(
    pki: &Pki,
    carrier: Carrier,
    addr: SocketAddr,
    sessions: &mut mpsc::Receiver<Incoming>,
) -> (Dialed, Option<QuicClient>, Incoming) {
    open_as(agent_tls(pki), carrier, addr, sessions).await
}

/// [`open`] with `client_tls`. The agent reads the gateway's answer after the handshake, so
/// any session ticket sent with it has been taken in.
async fn open_as(
    client_tls: Arc<rustls::ClientConfig>,
    carrier: Carrier,
    addr: SocketAddr,
    sessions: &mut mpsc::Receiver<Incoming>,
) -> (Dialed, Option<QuicClient>, Incoming) {
    let accept = async {
        let mut hub = tokio::time::timeout(Duration::from_secs(10), sessions.recv())
            .await
            .expect("the gateway got the session")
            .unwrap();
        assert_eq!(hub.link.inbound.next().await.unwrap().unwrap(), hello());
        hub.link.outbound.send(heartbeat(0)).await.unwrap();
        hub
    };
    let ((mut agent, client), hub) = tokio::join!(dial_as(client_tls, carrier, addr), accept);
    if let Some(pump) = agent.pump.take() {
        tokio::spawn(pump);
    }
    assert_eq!(
        agent.link.inbound.next().await.unwrap().unwrap(),
        heartbeat(0),
        "{carrier}: the hub's answer"
    );
    (agent, client, hub)
}

/// How a gRPC agent opens a tunnel the session asks for.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Opened {
    /// A plain HTTP/2 stream (`TunnelBytes`), as the gateway asks of agents now.
    Bytes,
    /// A `Fleet.Tunnel` call: an agent of an earlier version, or a gateway that does not ask
    /// for bytes.
    Call,
}

/// Opens tunnel `id` on a live session: the gateway opens it (over gRPC the session asks the
/// agent to, once the gateway is waiting for it, as the session driver does, and the agent
/// opens it as `how` says). Returns the gateway's end and the agent's.
async fn open_tunnel(
    hub: &mut Incoming,
    agent: &mut Dialed,
    id: &str,
    how: Opened,
) -> (
    flotilla_transport::TunnelStream,
    flotilla_transport::TunnelStream,
) {
    let opener = hub.tunnels.clone();
    let opening = opener.open(id, Duration::from_secs(10));
    let agent_tunnels = agent.tunnels.clone();
    let needs_frame = hub.tunnels.needs_open_tunnel_frame();
    let agent_side = async {
        if needs_frame {
            // What the session machine sends; this test plays its part.
            let open = wire::HubFrame {
                frame: Some(hub_frame::Frame::OpenTunnel(wire::OpenTunnel {
                    id: id.into(),
                    bytes: how == Opened::Bytes,
                })),
            };
            hub.link.outbound.send(open).await.unwrap();
            let got = agent.link.inbound.next().await.unwrap().unwrap();
            assert!(matches!(got.frame, Some(hub_frame::Frame::OpenTunnel(_))));
        }
        match agent_tunnels.open_requested(id, how == Opened::Bytes).await {
            Some(opened) => opened.unwrap(),
            None => agent_tunnels
                .accept()
                .await
                .unwrap()
                .read_id()
                .await
                .unwrap(),
        }
    };
    // In order: the gateway's side is polled first, so it waits for the tunnel before the
    // agent is asked to open it.
    let (opened, agent_end) = futures::join!(opening, agent_side);
    (opened.unwrap(), agent_end)
}

async fn session_and_tunnel(carrier: Carrier, how: Opened) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pki = pki();
    let (addr, mut sessions, _drain) = gateway(&pki, carrier).await;
    let (mut agent, _client, mut hub) = open(&pki, carrier, addr, &mut sessions).await;
    assert_eq!(hub.peer.peer, Peer::Cluster("store-1".into()), "{carrier}");
    assert_eq!(hub.link.carrier, carrier);

    // Frames the other way.
    hub.link.outbound.send(heartbeat(7)).await.unwrap();
    assert_eq!(
        agent.link.inbound.next().await.unwrap().unwrap(),
        heartbeat(7)
    );

    // A tunnel: the gateway opens it.
    let (mut tunnel, mut stream) = open_tunnel(&mut hub, &mut agent, "t-1", how).await;
    let echo = tokio::spawn(async move {
        assert_eq!(stream.id, "t-1");
        let mut buf = Vec::new();
        stream.read_to_end(&mut buf).await.unwrap();
        stream.write_all(&buf).await.unwrap();
        stream.shutdown().await.unwrap();
    });
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    // Its start as a vectored write of several slices (as hyper writes a head and a body),
    // the rest as plain writes.
    let slices = [
        std::io::IoSlice::new(&payload[..7]),
        std::io::IoSlice::new(&payload[7..1000]),
        std::io::IoSlice::new(&payload[1000..50_000]),
    ];
    let written = tunnel.write_vectored(&slices).await.unwrap();
    assert!(written > 0, "{carrier}");
    tunnel.write_all(&payload[written..]).await.unwrap();
    tunnel.shutdown().await.unwrap();
    let mut back = Vec::new();
    tunnel.read_to_end(&mut back).await.unwrap();
    assert_eq!(back.len(), payload.len(), "{carrier}");
    assert!(back == payload, "{carrier}: bytes came back intact");
    echo.await.unwrap();

    // The session still works after the tunnel, and an oversized frame ends it.
    let big = wire::AgentFrame {
        frame: Some(agent_frame::Frame::Goodbye(wire::Goodbye {
            reason: "x".repeat(MAX_FRAME + 1),
            refusal: 0,
        })),
    };
    let _ = agent.link.outbound.send(big).await;
    match hub.link.inbound.next().await {
        Some(Err(LinkError::TooLarge { size, max })) => {
            assert_eq!(max, MAX_FRAME, "{carrier}");
            assert!(size > MAX_FRAME, "{carrier}: {size}");
        }
        other => panic!("{carrier}: expected the frame bound, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_carries_a_session_and_a_tunnel() {
    session_and_tunnel(Carrier::Grpc, Opened::Bytes).await;
}

/// A gateway of this version still takes the `Fleet.Tunnel` calls of agents before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_carries_the_tunnel_call_of_an_earlier_agent() {
    session_and_tunnel(Carrier::Grpc, Opened::Call).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_carries_a_session_and_a_tunnel() {
    session_and_tunnel(Carrier::Quic, Opened::Bytes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quic_session_survives_the_agent_moving_to_a_new_port() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pki = pki();
    let (addr, mut sessions, _drain) = gateway(&pki, Carrier::Quic).await;
    let (mut agent, client, mut hub) = open(&pki, Carrier::Quic, addr, &mut sessions).await;
    let client = client.unwrap();
    let before = client.local_addr().unwrap();
    let after = client.rebind("127.0.0.1:0".parse().unwrap()).unwrap();
    assert_ne!(before.port(), after.port());
    for seq in 1..=20 {
        // Both directions after the move, on the same session.
        hub.link.outbound.send(heartbeat(seq)).await.unwrap();
        assert_eq!(
            agent.link.inbound.next().await.unwrap().unwrap(),
            heartbeat(seq)
        );
        let up = wire::AgentFrame {
            frame: Some(agent_frame::Frame::Heartbeat(wire::Heartbeat { seq })),
        };
        agent.link.outbound.send(up.clone()).await.unwrap();
        assert_eq!(hub.link.inbound.next().await.unwrap().unwrap(), up);
    }
    assert!(
        tokio::time::timeout(Duration::from_millis(200), sessions.recv())
            .await
            .is_err(),
        "no second session: the first one went on"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_of_another_ca_is_refused_by_both_carriers() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let hub_pki = pki();
    let mut stranger = pki_named("another CA");
    // The stranger trusts the hub's CA but its certificate is from its own.
    stranger.ca = hub_pki.ca.clone();
    for carrier in [Carrier::Grpc, Carrier::Quic] {
        let (addr, mut sessions, _drain) = gateway(&hub_pki, carrier).await;
        let refused = refused_dial(carrier, addr, agent_tls(&stranger)).await;
        // The hub's TLS alert 48, "unknown CA": the agent can say its certificate is not the
        // hub's, on either carrier.
        assert!(
            matches!(
                refused,
                LinkError::Tls {
                    alert: 48,
                    by_peer: true,
                    ..
                }
            ),
            "{carrier}: {refused:?}"
        );
        assert!(
            sessions.try_recv().is_err(),
            "{carrier}: no session reached the gateway"
        );
    }
}

/// Over gRPC an agent answers `OpenTunnel` with a stream naming the tunnel's id, and ids are
/// a counter an agent can guess from its own. Another cluster's agent naming a tunnel that
/// waits for store-1 is refused, and the tunnel goes on waiting for store-1's agent, which
/// then opens it and carries its bytes.
async fn a_stream_naming_another_clusters_tunnel_leaves_it_waiting(how: Opened) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pki = pki();
    let (addr, mut sessions, _drain) = gateway(&pki, Carrier::Grpc).await;
    let (agent, _client, hub) = open(&pki, Carrier::Grpc, addr, &mut sessions).await;
    let neighbour_hello = wire::AgentFrame {
        frame: Some(agent_frame::Frame::Hello(wire::Hello {
            cluster_name: "store-2".into(),
            ..Default::default()
        })),
    };
    let channel = grpc_channel(addr, neighbour_tls(&pki)).await.unwrap();
    let neighbour = flotilla_transport::grpc::open_session(channel, MAX_FRAME, neighbour_hello)
        .await
        .unwrap();

    let opening = hub.tunnels.open("t-1", Duration::from_secs(10));
    // Polled after the gateway's side has registered its wait (join! polls in order).
    let answers = async {
        let bytes = how == Opened::Bytes;
        let taken = neighbour
            .tunnels
            .open_requested("t-1", bytes)
            .await
            .expect("grpc");
        let own = agent
            .tunnels
            .open_requested("t-1", bytes)
            .await
            .expect("grpc");
        (taken, own)
    };
    let (opened, (taken, own)) = futures::join!(opening, answers);
    let refused = taken.expect_err("store-2's agent answered store-1's tunnel");
    assert!(
        refused
            .to_string()
            .contains("no tunnel t-1 is waiting for cluster store-2"),
        "{how:?}: {refused}"
    );
    let mut own = own.expect("store-1's agent still opens its tunnel");
    let mut opened = opened.expect("the gateway's side still gets store-1's tunnel");
    opened.write_all(b"ping").await.unwrap();
    opened.shutdown().await.unwrap();
    let mut got = Vec::new();
    own.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, b"ping");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_stream_naming_another_clusters_tunnel_leaves_it_waiting() {
    a_stream_naming_another_clusters_tunnel_leaves_it_waiting(Opened::Bytes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_call_naming_another_clusters_tunnel_leaves_it_waiting() {
    a_stream_naming_another_clusters_tunnel_leaves_it_waiting(Opened::Call).await;
}

/// A gate that says the gateway does not serve yet until switched on, counting what it is asked.
#[derive(Debug, Default)]
struct Warming {
    serving: AtomicBool,
    asked: AtomicUsize,
}

impl ConnectionGate for Warming {
    fn arrived(&self, _carrier: Carrier) -> Entry {
        self.asked.fetch_add(1, Ordering::SeqCst);
        if self.serving.load(Ordering::SeqCst) {
            Entry::Admitted
        } else {
            Entry::NotReady
        }
    }
}

/// A gateway that does not serve yet closes a new connection before its TLS handshake, on
/// either carrier: the agent's dial fails as a transport failure (no TLS alert, no session),
/// and once the gateway serves, the same agent's next dial opens its session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_not_serving_yet_closes_connections_before_tls() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pki = pki();
    for carrier in [Carrier::Grpc, Carrier::Quic] {
        let gate = Arc::new(Warming::default());
        let (addr, mut sessions, _drain) =
            gateway_gated(&pki, carrier, 16, Some(gate.clone())).await;
        let refused = refused_dial(carrier, addr, agent_tls(&pki)).await;
        assert!(
            !matches!(refused, LinkError::Tls { .. }),
            "{carrier}: closed before TLS, not refused in it: {refused:?}"
        );
        assert_eq!(
            gate.asked.load(Ordering::SeqCst),
            1,
            "{carrier}: the gate was asked once"
        );
        assert!(
            sessions.try_recv().is_err(),
            "{carrier}: no session reached the gateway"
        );
        gate.serving.store(true, Ordering::SeqCst);
        let (_agent, _client, _hub) = open(&pki, carrier, addr, &mut sessions).await;
        assert_eq!(
            gate.asked.load(Ordering::SeqCst),
            2,
            "{carrier}: the second dial was asked too"
        );
    }
}

/// A gate that says the first connection is over the rate, to come back after
/// [`TOLD_RETRY_AFTER`], and admits every other.
#[derive(Debug, Default)]
struct OverRateOnce {
    asked: AtomicUsize,
}

const TOLD_RETRY_AFTER: Duration = Duration::from_millis(1_234);

impl ConnectionGate for OverRateOnce {
    fn arrived(&self, _carrier: Carrier) -> Entry {
        match self.asked.fetch_add(1, Ordering::SeqCst) {
            0 => Entry::OverRate {
                retry_after: TOLD_RETRY_AFTER,
            },
            _ => Entry::Admitted,
        }
    }
}

/// The gateway's certificate chooser, counting the handshakes that got as far as choosing it:
/// what a connection turned away before TLS never reaches.
#[derive(Debug)]
struct CountingHandshakes {
    inner: Arc<dyn rustls::server::ResolvesServerCert>,
    handshakes: AtomicUsize,
}

impl rustls::server::ResolvesServerCert for CountingHandshakes {
    fn resolve(
        &self,
        hello: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        self.handshakes.fetch_add(1, Ordering::SeqCst);
        self.inner.resolve(hello)
    }
}

/// A connection over the gateway's rate is told when to come back before any TLS work, on
/// either carrier (over QUIC in the gateway's first answer to the agent's first packet): the
/// agent's dial ends as `TurnedAway` with the gate's retry-after, the gateway chose no
/// certificate for it and no session reached it; the same agent's next dial is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_over_the_rate_is_told_when_to_come_back_before_tls() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pki = pki();
    for carrier in [Carrier::Grpc, Carrier::Quic] {
        let gate = Arc::new(OverRateOnce::default());
        let mut tls = (*server_tls(&pki)).clone();
        let counting = Arc::new(CountingHandshakes {
            inner: tls.cert_resolver.clone(),
            handshakes: AtomicUsize::new(0),
        });
        tls.cert_resolver = counting.clone();
        let (addr, mut sessions, _drain) =
            gateway_serving(Arc::new(tls), carrier, 16, Some(gate.clone())).await;
        // Bounded: a dial not turned away would wait for an answer no session driver gives.
        let refused = tokio::time::timeout(
            Duration::from_secs(60),
            refused_dial(carrier, addr, agent_tls(&pki)),
        )
        .await
        .unwrap_or_else(|_| panic!("{carrier}: the dial was not turned away"));
        match refused {
            LinkError::TurnedAway { retry_after, .. } => assert_eq!(
                retry_after, TOLD_RETRY_AFTER,
                "{carrier}: the gate's retry-after reached the agent"
            ),
            other => panic!("{carrier}: not turned away: {other:?}"),
        }
        assert_eq!(
            counting.handshakes.load(Ordering::SeqCst),
            0,
            "{carrier}: no handshake was begun for the connection turned away"
        );
        assert!(
            sessions.try_recv().is_err(),
            "{carrier}: no session reached the gateway"
        );
        let (_agent, _client, _hub) = open(&pki, carrier, addr, &mut sessions).await;
        assert_eq!(
            gate.asked.load(Ordering::SeqCst),
            2,
            "{carrier}: each dial was asked once"
        );
        assert_eq!(
            counting.handshakes.load(Ordering::SeqCst),
            1,
            "{carrier}: the admitted dial had its handshake"
        );
    }
}

/// A gate of a gateway loading its shards: it does not accept until switched on, and says
/// "not ready" to any connection taken before that (as a gateway not serving yet does).
#[derive(Debug)]
struct Loading {
    accepting: watch::Sender<bool>,
    asked: AtomicUsize,
}

impl ConnectionGate for Loading {
    fn arrived(&self, _carrier: Carrier) -> Entry {
        self.asked.fetch_add(1, Ordering::SeqCst);
        if *self.accepting.borrow() {
            Entry::Admitted
        } else {
            Entry::NotReady
        }
    }

    fn accepting(&self) -> Option<watch::Receiver<bool>> {
        Some(self.accepting.subscribe())
    }
}

/// A gateway loading its shards leaves new connections unaccepted instead of closing them:
/// the agent's one dial waits, and opens its session as soon as the gateway accepts, with no
/// failed attempt (which would cost it a backoff). Over TCP the connection is complete (the
/// kernel's backlog holds it) before the gateway takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_loading_its_shards_holds_new_connections_until_it_accepts() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pki = pki();
    for carrier in [Carrier::Grpc, Carrier::Quic] {
        let gate = Arc::new(Loading {
            accepting: watch::Sender::new(false),
            asked: AtomicUsize::new(0),
        });
        let (addr, mut sessions, _drain) =
            gateway_gated(&pki, carrier, 16, Some(gate.clone())).await;
        let waiting = match carrier {
            Carrier::Grpc => {
                let tcp = tokio::net::TcpStream::connect(addr)
                    .await
                    .expect("the kernel completes the connection while the gateway loads");
                let connector = tokio_rustls::TlsConnector::from(agent_tls(&pki));
                let name = ServerName::try_from("localhost").unwrap();
                tokio::spawn(async move { connector.connect(name, tcp).await.map(|_| ()) })
            }
            Carrier::Quic => {
                let tls = agent_tls(&pki);
                tokio::spawn(async move {
                    let client =
                        QuicClient::bind("127.0.0.1:0".parse().unwrap(), quic_settings()).unwrap();
                    let dialed = client
                        .open_session(addr, "localhost", &tls, hello())
                        .await
                        .map_err(std::io::Error::other)?;
                    // Held until the gateway's side has the session.
                    std::future::pending::<()>().await;
                    drop((dialed, client));
                    Ok(())
                })
            }
        };
        assert_eq!(
            gate.asked.load(Ordering::SeqCst),
            0,
            "{carrier}: nothing was taken while the gateway loads"
        );
        assert!(sessions.try_recv().is_err(), "{carrier}: no session yet");
        gate.accepting.send_replace(true);
        match carrier {
            Carrier::Grpc => waiting
                .await
                .unwrap()
                .expect("grpc: the waiting connection's handshake completes"),
            Carrier::Quic => {
                tokio::time::timeout(Duration::from_secs(10), sessions.recv())
                    .await
                    .expect("quic: the waiting dial's session reaches the gateway")
                    .unwrap();
                assert!(!waiting.is_finished(), "quic: the dial did not fail");
                waiting.abort();
            }
        }
        assert_eq!(
            gate.asked.load(Ordering::SeqCst),
            1,
            "{carrier}: the one connection was taken, once, after the gateway accepted"
        );
    }
}

/// An end that writes, closes its side and is dropped at once (as a relay drops a tunnel as
/// soon as both directions are done) loses nothing it wrote, even while its peer reads slowly
/// and has not closed its own side.
async fn a_closed_and_dropped_end_delivers_what_it_wrote(carrier: Carrier, how: Opened) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pki = pki();
    let (addr, mut sessions, _drain) = gateway(&pki, carrier).await;
    let (mut agent, _client, mut hub) = open(&pki, carrier, addr, &mut sessions).await;
    // Many windows' worth, so the writer's last bytes may still wait to be sent at the drop;
    // whether they do is a matter of timing, so each direction is tried ten times.
    let payload: Vec<u8> = (0..512 * 1024u32).map(|i| (i % 251) as u8).collect();
    for round in 0..20 {
        let writer_is_agent = round % 2 == 0;
        let id = format!("t-{round}");
        let (hub_end, agent_end) = open_tunnel(&mut hub, &mut agent, &id, how).await;
        let (mut writer, mut reader) = match writer_is_agent {
            true => (agent_end, hub_end),
            false => (hub_end, agent_end),
        };
        let sent = payload.clone();
        let writing = tokio::spawn(async move {
            writer.write_all(&sent).await.unwrap();
            writer.shutdown().await.unwrap();
            drop(writer);
        });
        // A slow reader: a little at a time, letting everything else run in between.
        let reading = async {
            let mut back = Vec::new();
            let mut buf = [0u8; 2048];
            loop {
                match reader.read(&mut buf).await.unwrap() {
                    0 => return back,
                    n => back.extend_from_slice(&buf[..n]),
                }
                tokio::task::yield_now().await;
            }
        };
        let back = tokio::time::timeout(Duration::from_secs(30), reading)
            .await
            .expect("the reader saw the end");
        writing.await.unwrap();
        let side = if writer_is_agent { "agent" } else { "gateway" };
        assert_eq!(
            back.len(),
            payload.len(),
            "{carrier}: bytes the {side} wrote were lost"
        );
        assert!(back == payload, "{carrier}: bytes the {side} wrote changed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_delivers_what_a_closed_and_dropped_end_wrote() {
    a_closed_and_dropped_end_delivers_what_it_wrote(Carrier::Grpc, Opened::Bytes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_tunnel_call_delivers_what_a_closed_and_dropped_end_wrote() {
    a_closed_and_dropped_end_delivers_what_it_wrote(Carrier::Grpc, Opened::Call).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_delivers_what_a_closed_and_dropped_end_wrote() {
    a_closed_and_dropped_end_delivers_what_it_wrote(Carrier::Quic, Opened::Bytes).await;
}

/// Agents arriving while every QUIC handshake slot is taken wait for one instead of being
/// refused into a backoff: five dials at once through a single slot all get their session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_dials_beyond_the_handshake_slots_wait_for_one() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pki = pki();
    let (addr, mut sessions, _drain) = gateway_with(&pki, Carrier::Quic, 1).await;
    // The gateway's side answers every hello, as a hub does.
    tokio::spawn(async move {
        while let Some(mut hub) = sessions.recv().await {
            tokio::spawn(async move {
                assert_eq!(hub.link.inbound.next().await.unwrap().unwrap(), hello());
                hub.link.outbound.send(heartbeat(0)).await.unwrap();
                // Held open until the agent goes.
                while hub.link.inbound.next().await.is_some() {}
            });
        }
    });
    let dials = (0..5).map(|_| dial(&pki, Carrier::Quic, addr));
    let dialed = tokio::time::timeout(Duration::from_secs(30), futures::future::join_all(dials))
        .await
        .expect("every dial ended");
    for (mut agent, _client) in dialed {
        if let Some(pump) = agent.pump.take() {
            tokio::spawn(pump);
        }
        assert_eq!(
            agent.link.inbound.next().await.unwrap().unwrap(),
            heartbeat(0),
            "each agent got the hub's answer"
        );
    }
}

/// Dials that find the only QUIC handshake slot taken and its waiting places full, or that
/// wait longer than their wait allows, are not refused into a blind backoff: each is turned
/// away before its handshake, told when to come back, those turned away together spread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_dials_finding_no_handshake_slot_are_told_when_to_come_back() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pki = pki();
    let (addr, _sessions, _drain) = gateway_with(&pki, Carrier::Quic, 1).await;
    // One connection holds the only slot: its handshake done, its session stream never opened.
    let mut tls = (*agent_tls(&pki)).clone();
    tls.alpn_protocols = vec![flotilla_transport::quic::ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let mut holder = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    holder.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    let _held = holder
        .connect(addr, "localhost")
        .unwrap()
        .await
        .expect("the holder's handshake completes");
    // One slot and four places to wait in: of eight dials, four wait and four do not.
    let dials = (0..8).map(|_| refused_dial(Carrier::Quic, addr, agent_tls(&pki)));
    let refused = tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(dials))
        .await
        .expect("every dial ended");
    let told: Vec<Duration> = refused
        .into_iter()
        .map(|e| match e {
            LinkError::TurnedAway { retry_after, .. } => retry_after,
            other => panic!("a dial was not told when to come back: {other:?}"),
        })
        .collect();
    assert!(
        told.iter().all(|t| *t > Duration::ZERO),
        "each after the handshakes ahead of it: {told:?}"
    );
    // The four turned away at once are told four times (the waiters, turned away as their
    // waits end, may meet those at millisecond resolution).
    let distinct: std::collections::BTreeSet<Duration> = told.iter().copied().collect();
    assert!(distinct.len() >= 4, "spread: {told:?}");
}

/// A gateway whose session tickets derive from `secret`, counting the ones that open.
async fn gateway_of_secret(
    pki: &Pki,
    carrier: Carrier,
    secret: &[u8],
) -> (
    SocketAddr,
    mpsc::Receiver<Incoming>,
    watch::Sender<bool>,
    prometheus_client::metrics::counter::Counter,
) {
    let tickets = TicketKeys::derived_from(secret);
    let tls = tls::agent_server_config(
        pki.ca.as_bytes(),
        pki.server.0.as_bytes(),
        pki.server.1.as_bytes(),
        &tickets,
    )
    .unwrap();
    let (addr, sessions, drain) = gateway_serving(tls, carrier, 16, None).await;
    (addr, sessions, drain, tickets.opened())
}

/// An agent reconnecting to its gateway restarted in place (a new process, the same serving
/// key) resumes its TLS session instead of a full handshake, on either carrier, and the
/// resumed connection speaks for the same cluster and key as the first. A gateway of another
/// key takes the agent in a full handshake. Tickets belong to the client configuration that
/// got them: another certificate's configuration sharing the ticket store does not resume
/// with them, and its connection is its own cluster's.
async fn a_reconnect_to_a_gateway_restarted_in_place_resumes(carrier: Carrier) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pki = pki();
    let store: Arc<dyn rustls::client::ClientSessionStore> =
        Arc::new(rustls::client::ClientSessionMemoryCache::new(64));
    let config_of = |cert: &(String, String)| {
        tls::client_config_resuming(
            pki.ca.as_bytes(),
            cert.0.as_bytes(),
            cert.1.as_bytes(),
            &[],
            rustls::client::Resumption::store(store.clone()),
        )
        .unwrap()
    };
    let (store_1, store_2) = (config_of(&pki.agent), config_of(&pki.neighbour));
    let tls_of = |cert: &(String, String)| match cert == &pki.agent {
        true => store_1.clone(),
        false => store_2.clone(),
    };

    let (addr, mut sessions, drain, resumed) =
        gateway_of_secret(&pki, carrier, b"serving key").await;
    let (agent, _, first) = open_as(tls_of(&pki.agent), carrier, addr, &mut sessions).await;
    assert_eq!(first.peer.peer, Peer::Cluster("store-1".into()));
    assert_eq!(
        resumed.get(),
        0,
        "{carrier}: the first connection ran in full"
    );
    drop((agent, first));
    drain.send_replace(true);

    let (addr, mut sessions, _drain, resumed) =
        gateway_of_secret(&pki, carrier, b"serving key").await;
    let (_agent, _, second) = open_as(tls_of(&pki.agent), carrier, addr, &mut sessions).await;
    assert_eq!(resumed.get(), 1, "{carrier}: the reconnect resumed");
    assert_eq!(second.peer.peer, first_peer());
    assert!(second.peer.client_key_sha256.is_some());

    let (addr, mut sessions, _drain, resumed) =
        gateway_of_secret(&pki, carrier, b"another gateway's key").await;
    let (_agent, _, third) = open_as(tls_of(&pki.agent), carrier, addr, &mut sessions).await;
    assert_eq!(
        resumed.get(),
        0,
        "{carrier}: another key's gateway ran it in full"
    );
    assert_eq!(third.peer.peer, first_peer());

    // store-2's configuration, store-1's ticket of this gateway in the shared store.
    let (_agent, _, fourth) = open_as(tls_of(&pki.neighbour), carrier, addr, &mut sessions).await;
    assert_eq!(resumed.get(), 0, "{carrier}: store-2 ran in full");
    assert_eq!(fourth.peer.peer, Peer::Cluster("store-2".into()));
    assert_ne!(fourth.peer.client_key_sha256, third.peer.client_key_sha256);
}

fn first_peer() -> Peer {
    Peer::Cluster("store-1".into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_reconnect_to_a_gateway_restarted_in_place_resumes() {
    a_reconnect_to_a_gateway_restarted_in_place_resumes(Carrier::Grpc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quic_reconnect_to_a_gateway_restarted_in_place_resumes() {
    a_reconnect_to_a_gateway_restarted_in_place_resumes(Carrier::Quic).await;
}
