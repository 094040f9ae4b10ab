//! The relay hop on loopback with real TLS and HTTP/2: a gateway certificate opens a tunnel
//! through the hop and its bytes cross both ways with half-close; an agent's or a kubectl
//! user's certificate is refused before the far gateway opens anything; a tunnel whose reader
//! stalls does not hold up another tunnel on the same hop connection; the far gateway's
//! refusals come back as they were made; `Relay.Presence` answers a gateway certificate about
//! a batch of clusters, and refuses other callers, oversized batches and bad names.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use flotilla_transport::Carrier;
use flotilla_transport::TunnelStream;
use flotilla_transport::grpc::GrpcSettings;
use flotilla_transport::hop::{
    AwaySince, HopClient, HopError, HopRefusal, HopTarget, MAX_PRESENCE_CLUSTERS, OwnerPresence,
    RelayService,
};
use flotilla_transport::tls;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, DuplexStream};
use tokio::sync::{Mutex, mpsc, watch};

/// How long a test waits for one step; far above what loopback needs.
const STEP: Duration = Duration::from_secs(20);

/// A CA and, as PEM (certificate, key): the far gateway's serving certificate, and client
/// certificates of a gateway, an agent and a kubectl user.
struct Pki {
    ca: String,
    server: (String, String),
    gateway: (String, String),
    agent: (String, String),
    user: (String, String),
}

fn pki() -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::default();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "hop CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let issue = |sans: Vec<String>, cn: &str, o: &str| {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(sans).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.distinguished_name.push(DnType::OrganizationName, o);
        let cert = params.signed_by(&key, &issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    Pki {
        ca: ca_cert.pem(),
        server: issue(
            vec!["localhost".into(), "127.0.0.1".into()],
            "gw-2",
            "flotilla:gateways",
        ),
        gateway: issue(vec![], "hub", "flotilla:gateways"),
        agent: issue(vec![], "store-1", "flotilla:clusters"),
        user: issue(vec![], "alice", "flotilla:users"),
    }
}

/// The far gateway's sessions, played by the test: each open hands the test the agent's end
/// of a fresh in-memory stream, or answers with `refusal`.
struct Agents {
    opened: AtomicUsize,
    ends: mpsc::Sender<(String, DuplexStream)>,
    refusal: Mutex<Option<HopRefusal>>,
}

#[tonic::async_trait]
impl HopTarget for Agents {
    async fn open(&self, cluster: &str, id: &str) -> Result<TunnelStream, HopRefusal> {
        self.opened.fetch_add(1, Ordering::SeqCst);
        if let Some(refusal) = self.refusal.lock().await.clone() {
            return Err(refusal);
        }
        // Small buffer: the agent's side pushes back as a real tunnel would.
        let (gateway_end, agent_end) = tokio::io::duplex(16 * 1024);
        self.ends
            .send((format!("{cluster}/{id}"), agent_end))
            .await
            .unwrap();
        Ok(TunnelStream::new(id, gateway_end))
    }

    fn presence(&self, clusters: &[String]) -> Vec<OwnerPresence> {
        clusters.iter().map(|c| played_presence(c)).collect()
    }
}

/// What the far gateway says of each cluster's session: store-1 is connected over QUIC,
/// store-2 left, store-3 is of its shards but never seen, the rest are not its shards.
fn played_presence(cluster: &str) -> OwnerPresence {
    let at = SystemTime::UNIX_EPOCH + Duration::from_millis(1_790_000_000_250);
    match cluster {
        "store-1" => OwnerPresence::Connected {
            carrier: Carrier::Quic,
            since: at,
        },
        "store-2" => OwnerPresence::Departed { at },
        "store-3" => OwnerPresence::Unknown,
        _ => OwnerPresence::NotHeld,
    }
}

/// A far gateway serving `Relay` on loopback; returns its address, its agents' ends, and the
/// count of opens.
async fn far_gateway(
    pki: &Pki,
) -> (
    SocketAddr,
    Arc<Agents>,
    mpsc::Receiver<(String, DuplexStream)>,
    watch::Sender<bool>,
) {
    let server_tls = tls::agent_server_config(
        pki.ca.as_bytes(),
        pki.server.0.as_bytes(),
        pki.server.1.as_bytes(),
        &flotilla_transport::tickets::TicketKeys::random(),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (conns, accept) =
        tls::accept_authenticated(listener, server_tls, Default::default(), "agents");
    tokio::spawn(accept);
    let (ends_tx, ends) = mpsc::channel(16);
    let agents = Arc::new(Agents {
        opened: AtomicUsize::new(0),
        ends: ends_tx,
        refusal: Mutex::new(None),
    });
    let routes = tonic::service::Routes::new(
        RelayService::new(agents.clone(), Duration::from_secs(60)).into_server(),
    );
    let (drain_tx, drain) = watch::channel(false);
    tokio::spawn(flotilla_transport::grpc::serve(
        conns,
        routes,
        GrpcSettings::default(),
        drain,
    ));
    (addr, agents, ends, drain_tx)
}

fn client(pki: &Pki, identity: &(String, String)) -> HopClient {
    HopClient::new(
        tls::client_config(
            pki.ca.as_bytes(),
            identity.0.as_bytes(),
            identity.1.as_bytes(),
            &[],
        )
        .unwrap(),
    )
}

async fn next_agent(ends: &mut mpsc::Receiver<(String, DuplexStream)>) -> (String, DuplexStream) {
    tokio::time::timeout(STEP, ends.recv())
        .await
        .expect("the far gateway opened the tunnel")
        .expect("the far gateway is up")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_certificate_carries_a_tunnel_both_ways_with_half_close() {
    let pki = pki();
    let (addr, _agents, mut ends, _drain) = far_gateway(&pki).await;
    let hub = client(&pki, &pki.gateway);
    let mut tunnel = hub
        .open(&addr.to_string(), "store-1", "t-1", STEP)
        .await
        .unwrap();
    let (target, mut agent) = next_agent(&mut ends).await;
    assert_eq!(target, "store-1/t-1");

    // A request larger than every window, then the user's half-close.
    let request: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let sent = request.clone();
    let writer = tokio::spawn(async move {
        tunnel.write_all(&sent).await.unwrap();
        tunnel.shutdown().await.unwrap();
        tunnel
    });
    let mut got = Vec::new();
    tokio::time::timeout(STEP, agent.read_to_end(&mut got))
        .await
        .expect("the agent saw the request end")
        .unwrap();
    assert_eq!(got, request, "the request crossed the hop intact");
    // The answer comes after the request's half-close, as an HTTP response does.
    agent
        .write_all(b"HTTP/1.1 200 OK\r\n\r\nhello")
        .await
        .unwrap();
    agent.shutdown().await.unwrap();
    let mut tunnel = writer.await.unwrap();
    let mut back = Vec::new();
    tokio::time::timeout(STEP, tunnel.read_to_end(&mut back))
        .await
        .expect("the answer ended")
        .unwrap();
    assert_eq!(back, b"HTTP/1.1 200 OK\r\n\r\nhello");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_and_user_certificates_cannot_open_the_hop() {
    let pki = pki();
    let (addr, agents, _ends, _drain) = far_gateway(&pki).await;
    for (who, identity) in [("agent", &pki.agent), ("kubectl user", &pki.user)] {
        let err = client(&pki, identity)
            .open(&addr.to_string(), "store-1", "t-1", STEP)
            .await
            .unwrap_err();
        match &err {
            HopError::Forbidden { detail, .. } => {
                assert!(detail.contains("only gateway certificates"), "{who}: {err}")
            }
            other => panic!("{who}: expected a refusal, got {other:?}"),
        }
    }
    assert_eq!(
        agents.opened.load(Ordering::SeqCst),
        0,
        "nothing was opened toward an agent for a refused caller"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_reader_does_not_hold_up_another_tunnel_on_the_hop() {
    let pki = pki();
    let (addr, _agents, mut ends, _drain) = far_gateway(&pki).await;
    let hub = client(&pki, &pki.gateway);
    let address = addr.to_string();

    // Tunnel A: the agent answers 8 MiB, far beyond every window on the way, and its reader
    // on the hub side does not read.
    let mut slow = hub.open(&address, "store-1", "slow", STEP).await.unwrap();
    let (_, mut slow_agent) = next_agent(&mut ends).await;
    let answer: Vec<u8> = (0..8 * 1024 * 1024u32).map(|i| (i % 253) as u8).collect();
    let expected = answer.clone();
    let slow_writer = tokio::spawn(async move {
        slow_agent.write_all(&answer).await.unwrap();
        slow_agent.shutdown().await.unwrap();
    });

    // Tunnel B on the same connection round-trips while A is stalled, several times.
    for round in 0..5 {
        let id = format!("quick-{round}");
        let mut quick = hub.open(&address, "store-2", &id, STEP).await.unwrap();
        let (target, mut quick_agent) = next_agent(&mut ends).await;
        assert_eq!(target, format!("store-2/{id}"));
        quick.write_all(b"GET /version").await.unwrap();
        quick.shutdown().await.unwrap();
        let mut request = Vec::new();
        tokio::time::timeout(STEP, quick_agent.read_to_end(&mut request))
            .await
            .expect("a second tunnel's request crossed while the first was stalled")
            .unwrap();
        assert_eq!(request, b"GET /version");
        quick_agent.write_all(b"v1.36").await.unwrap();
        quick_agent.shutdown().await.unwrap();
        let mut response = Vec::new();
        tokio::time::timeout(STEP, quick.read_to_end(&mut response))
            .await
            .expect("a second tunnel's answer crossed while the first was stalled")
            .unwrap();
        assert_eq!(response, b"v1.36");
    }
    assert!(
        !slow_writer.is_finished(),
        "the stalled tunnel is held back by its own window"
    );

    // The stalled reader reads at last: everything arrives, in order.
    let mut got = Vec::new();
    tokio::time::timeout(STEP, slow.read_to_end(&mut got))
        .await
        .expect("the stalled tunnel drained")
        .unwrap();
    assert_eq!(got.len(), expected.len());
    assert!(got == expected, "the stalled tunnel's bytes arrived intact");
    slow_writer.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_far_gateways_refusals_come_back_as_made() {
    let pki = pki();
    let (addr, agents, _ends, _drain) = far_gateway(&pki).await;
    let hub = client(&pki, &pki.gateway);
    let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_790_000_000);
    for refusal in [
        HopRefusal::NoSession {
            cluster: "store-1".into(),
            away: AwaySince { ended: true, at },
        },
        HopRefusal::NotHeld("this gateway does not hold shard 3 of cluster store-1 now".into()),
    ] {
        *agents.refusal.lock().await = Some(refusal.clone());
        let err = hub
            .open(&addr.to_string(), "store-1", "t-1", STEP)
            .await
            .unwrap_err();
        assert_eq!(
            err,
            HopError::Refused {
                address: addr.to_string(),
                refusal
            }
        );
    }
    // A gateway that is not there is an error within the bound, not a hang.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let err = hub
        .open(&closed.to_string(), "store-1", "t-2", STEP)
        .await
        .unwrap_err();
    assert!(matches!(err, HopError::Link { .. }), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presence_answers_a_gateway_about_a_batch_and_refuses_the_rest() {
    let pki = pki();
    let (addr, _agents, _ends, _drain) = far_gateway(&pki).await;
    let address = addr.to_string();
    let hub = client(&pki, &pki.gateway);

    let asked = ["store-1", "store-2", "store-3", "store-9"];
    let answers = hub.presence(&address, &asked, STEP).await.unwrap();
    let expected: HashMap<String, OwnerPresence> = asked
        .iter()
        .map(|c| (c.to_string(), played_presence(c)))
        .collect();
    assert_eq!(answers, expected);

    // Only gateways may ask: an agent or a kubectl user learns nothing of other clusters.
    for (who, identity) in [("agent", &pki.agent), ("kubectl user", &pki.user)] {
        let err = client(&pki, identity)
            .presence(&address, &asked, STEP)
            .await
            .unwrap_err();
        match &err {
            HopError::Forbidden { detail, .. } => {
                assert!(detail.contains("only gateway certificates"), "{who}: {err}")
            }
            other => panic!("{who}: expected a refusal, got {other:?}"),
        }
    }

    // A batch past the bound, or a name that is no cluster's, is refused saying why.
    let names: Vec<String> = (0..=MAX_PRESENCE_CLUSTERS)
        .map(|i| format!("store-{i}"))
        .collect();
    let too_many: Vec<&str> = names.iter().map(String::as_str).collect();
    let err = hub.presence(&address, &too_many, STEP).await.unwrap_err();
    assert!(
        matches!(&err, HopError::Forbidden { detail, .. } if detail.contains("at most 500")),
        "{err:?}"
    );
    let err = hub
        .presence(&address, &["store-1", "Not_A_Cluster"], STEP)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, HopError::Forbidden { detail, .. } if detail.contains("\"Not_A_Cluster\" is not a cluster name")),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_that_never_answers_costs_a_presence_question_its_bound() {
    let pki = pki();
    let hub = client(&pki, &pki.gateway);
    // Takes the connection (the kernel completes the handshake) and never speaks TLS.
    let hung = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = hung.local_addr().unwrap().to_string();
    let asking = hub.presence(&address, &["store-1"], Duration::from_millis(300));
    let err = tokio::time::timeout(STEP, asking)
        .await
        .expect("the question ends at its bound, not at the caller's patience")
        .unwrap_err();
    assert!(
        matches!(
            &err,
            HopError::Link {
                source: flotilla_transport::LinkError::TimedOut(_),
                ..
            }
        ),
        "{err:?}"
    );
}
