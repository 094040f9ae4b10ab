//! The floor flotilla's figures are compared with: a bare carrier server holding the same
//! sessions with the same certificates and TLS settings, and nothing else. Over gRPC it is a
//! tonic server with default settings whose `Fleet.Session` answers a hello with a welcome and
//! echoes heartbeats; over QUIC it is a quinn endpoint with default transport settings doing the
//! same on each connection's first stream. The `baseline-bare` scenario runs it as a child
//! process (`flotilla-loadtest bare-server`) so its memory is its own.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use anyhow::Context;
use flotilla_proto::wire::fleet_server::{Fleet, FleetServer};
use flotilla_proto::wire::{self, AgentFrame, HubFrame, TunnelFrame, agent_frame, hub_frame};
use flotilla_transport::Carrier;
use flotilla_transport::codec::FrameCodec;
use futures::{SinkExt as _, Stream, StreamExt as _};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::codec::{FramedRead, FramedWrite};
use tonic::{Request, Response, Status, Streaming};

/// Heartbeat settings the bare server tells agents (the hub's defaults).
const HEARTBEAT_INTERVAL_MS: u32 = 10_000;
const HEARTBEAT_TIMEOUT_MS: u32 = 30_000;
/// The frame bound both carriers use.
const MAX_FRAME_BYTES: usize = 4 * 1024 * 1024;

/// `flotilla-loadtest bare-server` flags.
#[derive(Clone, Debug, clap::Args, Serialize, Deserialize)]
pub struct BareArgs {
    /// Which carrier to serve.
    #[arg(long, value_parser = parse_carrier)]
    pub carrier: Carrier,
    /// Where to listen (loopback; port 0 picks one).
    #[arg(long)]
    pub listen: std::net::SocketAddr,
    /// PEM CA bundle client certificates must chain to (the hub's).
    #[arg(long)]
    pub ca: PathBuf,
    /// PEM serving certificate chain and key.
    #[arg(long)]
    pub cert: PathBuf,
    #[arg(long)]
    pub key: PathBuf,
}

fn parse_carrier(s: &str) -> Result<Carrier, String> {
    match s {
        "grpc" => Ok(Carrier::Grpc),
        "quic" => Ok(Carrier::Quic),
        other => Err(format!("{other:?}: grpc or quic")),
    }
}

/// What the server prints once it listens.
#[derive(Serialize, Deserialize)]
pub struct BareListening {
    pub address: std::net::SocketAddr,
}

/// Serves until stdin closes (the harness ends it by closing the pipe, or by a signal).
pub async fn serve(args: BareArgs) -> anyhow::Result<()> {
    let read = |p: &PathBuf| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let key = read(&args.key)?;
    // Session tickets as a gateway issues them (from its serving key).
    let tickets = flotilla_transport::tickets::TicketKeys::derived_from(&key);
    let tls = flotilla_transport::tls::agent_server_config(
        &read(&args.ca)?,
        &read(&args.cert)?,
        &key,
        &tickets,
    )?;
    let stdin_closed = async {
        use tokio::io::AsyncReadExt as _;
        let mut buf = [0u8; 64];
        let mut stdin = tokio::io::stdin();
        while matches!(stdin.read(&mut buf).await, Ok(n) if n > 0) {}
    };
    match args.carrier {
        Carrier::Grpc => {
            let listener = TcpListener::bind(args.listen).await?;
            announce(listener.local_addr()?);
            let acceptor = tokio_rustls::TlsAcceptor::from(tls);
            let (tx, rx) = mpsc::channel::<std::io::Result<BareConn>>(64);
            tokio::spawn(async move {
                loop {
                    let Ok((tcp, _)) = listener.accept().await else {
                        continue;
                    };
                    let acceptor = acceptor.clone();
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        if let Ok(tls) = acceptor.accept(tcp).await {
                            let _ = tx.send(Ok(BareConn(tls))).await;
                        }
                    });
                }
            });
            let service = FleetServer::new(BareFleet)
                .max_decoding_message_size(MAX_FRAME_BYTES)
                .max_encoding_message_size(MAX_FRAME_BYTES);
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(ReceiverStream::new(rx), stdin_closed)
                .await?;
        }
        Carrier::Quic => {
            let mut tls = (*tls).clone();
            tls.alpn_protocols = vec![flotilla_transport::quic::ALPN.to_vec()];
            let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls)?;
            let config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
            // The socket buffers the gateway's listener has, so the baseline is not slowed by
            // drops the fabric does not suffer.
            let socket = std::net::UdpSocket::bind(args.listen)?;
            flotilla_transport::quic::widen_listener_buffers(&socket);
            let endpoint = quinn::Endpoint::new(
                quinn::EndpointConfig::default(),
                Some(config),
                socket,
                Arc::new(quinn::TokioRuntime),
            )?;
            announce(endpoint.local_addr()?);
            tokio::pin!(stdin_closed);
            loop {
                tokio::select! {
                    incoming = endpoint.accept() => {
                        let Some(incoming) = incoming else { break };
                        tokio::spawn(async move {
                            let Ok(connecting) = incoming.accept() else { return };
                            let Ok(conn) = connecting.await else { return };
                            let Ok((send, recv)) = conn.accept_bi().await else { return };
                            let inbound = FramedRead::new(recv, FrameCodec::<AgentFrame>::new(MAX_FRAME_BYTES));
                            let mut outbound = FramedWrite::new(send, FrameCodec::<HubFrame>::new(MAX_FRAME_BYTES));
                            let mut answers = Box::pin(answer(inbound.filter_map(|f| async { f.ok() })));
                            while let Some(frame) = answers.next().await {
                                if outbound.send(frame).await.is_err() {
                                    break;
                                }
                            }
                        });
                    }
                    _ = &mut stdin_closed => break,
                }
            }
        }
    }
    Ok(())
}

fn announce(address: std::net::SocketAddr) {
    println!(
        "{}",
        serde_json::to_string(&BareListening { address }).expect("serializes")
    );
}

/// The whole protocol of the bare server: a welcome for a hello, an echo for a heartbeat.
fn answer(frames: impl Stream<Item = AgentFrame> + Send + 'static) -> impl Stream<Item = HubFrame> {
    frames.filter_map(|frame| async move {
        let reply = match frame.frame? {
            agent_frame::Frame::Hello(_) => hub_frame::Frame::Welcome(wire::Welcome {
                protocol_version: flotilla_proto::PROTOCOL_VERSION,
                session_id: "bare".into(),
                heartbeat_interval_ms: HEARTBEAT_INTERVAL_MS,
                heartbeat_timeout_ms: HEARTBEAT_TIMEOUT_MS,
            }),
            agent_frame::Frame::Heartbeat(hb) => hub_frame::Frame::Heartbeat(hb),
            _ => return None,
        };
        Some(HubFrame { frame: Some(reply) })
    })
}

/// A TLS connection as tonic serves it.
struct BareConn(tokio_rustls::server::TlsStream<tokio::net::TcpStream>);

impl tonic::transport::server::Connected for BareConn {
    type ConnectInfo = ();
    fn connect_info(&self) {}
}

impl tokio::io::AsyncRead for BareConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for BareConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// `Fleet` with nothing behind it.
struct BareFleet;

type Out<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl Fleet for BareFleet {
    type SessionStream = Out<HubFrame>;
    type TunnelStream = Out<TunnelFrame>;

    async fn session(
        &self,
        request: Request<Streaming<AgentFrame>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let inbound = request.into_inner().filter_map(|f| async { f.ok() });
        Ok(Response::new(Box::pin(answer(inbound).map(Ok))))
    }

    async fn tunnel(
        &self,
        _request: Request<Streaming<TunnelFrame>>,
    ) -> Result<Response<Self::TunnelStream>, Status> {
        Err(Status::unimplemented("the bare server has no tunnels"))
    }
}

mod scenario {
    //! The `baseline-bare` scenario.

    use std::process::Stdio;
    use std::time::Duration;

    use anyhow::Context;
    use tokio::io::{AsyncBufReadExt as _, BufReader};
    use tokio::process::Command;

    use super::BareListening;
    use crate::agents::Agents;
    use crate::cli::AgentTransport;
    use crate::machine::ProcStats;
    use crate::report::{BareReport, Point, ScenarioReport};
    use crate::scenario::{Clock, Run, SAMPLE_EVERY, bounded};

    /// How long the bare server may take to say where it listens.
    const START_TIMEOUT: Duration = Duration::from_secs(30);

    impl Run {
        /// `baseline-bare`: see [`crate::cli::Scenario::BaselineBare`].
        pub async fn baseline_bare(&mut self, earlier: &[ScenarioReport]) -> ScenarioReport {
            let mut r = ScenarioReport::new("baseline-bare", self.identities.len());
            let clock = Clock::new(self.args.timeout);
            let carrier = match self.args.transport {
                // `--transport both` is refused with baseline-bare: one bare carrier at a time.
                AgentTransport::Grpc | AgentTransport::Both => "grpc",
                AgentTransport::Quic | AgentTransport::Auto => "quic",
            };
            let mut b = BareReport {
                carrier: carrier.to_string(),
                ..BareReport::default()
            };
            let result = bounded(&clock, self.bare_inner(&clock, &mut r, &mut b, carrier)).await;
            if let Some(connect) = earlier.iter().find(|s| s.name == "connect") {
                b.flotilla_rss_per_session_bytes = connect.hub_rss_per_session_bytes;
                b.flotilla_setup_per_s = connect.handshakes_per_s;
            }
            b.memory_ratio = ratio(
                b.flotilla_rss_per_session_bytes,
                b.bare_rss_per_session_bytes,
            );
            b.setup_ratio = ratio(b.flotilla_setup_per_s, b.bare_setup_per_s);
            r.bare = Some(b);
            self.conclude(&mut r, &clock, result).await;
            r
        }

        async fn bare_inner(
            &mut self,
            clock: &Clock,
            r: &mut ScenarioReport,
            b: &mut BareReport,
            carrier: &str,
        ) -> anyhow::Result<bool> {
            // The run's own agents go first: the bare server gets the machine as the hub had
            // it.
            if let Some(agents) = self.agents.take() {
                agents.stop().await;
            }
            let dir = self.run_dir.join("bare");
            std::fs::create_dir_all(&dir)?;
            let (ca, chain, key) = self.hub.serving_identity(&["localhost", "127.0.0.1"])?;
            std::fs::write(dir.join("ca.crt"), ca)?;
            std::fs::write(dir.join("tls.crt"), chain)?;
            std::fs::write(dir.join("tls.key"), key)?;
            let mut child = Command::new(self.args.harness_exe()?)
                .arg("bare-server")
                .args(["--carrier", carrier, "--listen", "127.0.0.1:0"])
                .arg("--ca")
                .arg(dir.join("ca.crt"))
                .arg("--cert")
                .arg(dir.join("tls.crt"))
                .arg("--key")
                .arg(dir.join("tls.key"))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(std::fs::File::create(dir.join("bare-server.log"))?)
                .kill_on_drop(true)
                .spawn()
                .context("starting the bare server")?;
            let stdout = child.stdout.take().expect("piped");
            let mut lines = BufReader::new(stdout).lines();
            let listening: BareListening = tokio::time::timeout(START_TIMEOUT, lines.next_line())
                .await
                .context("the bare server did not say where it listens")??
                .map(|l| serde_json::from_str(&l))
                .transpose()?
                .context("the bare server exited before listening")?;
            let pid = child.id().context("the bare server's pid")?.to_string();
            let before = ProcStats::read(&pid);

            let mut spec = self.spec.clone();
            spec.hub = listening.address;
            spec.cache_dir = self.run_dir.join("bare-agent-cache");
            spec.identities_dir = self.run_dir.join("bare-agent-identities");
            let n = self.n();
            let started = tokio::time::Instant::now();
            let agents = Agents::start(
                spec,
                self.identities.clone(),
                self.args.processes,
                self.args.harness_exe()?,
                &self.run_dir,
                self.args.link.spec()?.as_ref(),
            )
            .await?;
            let mut all = false;
            let mut first_dial = None;
            while !clock.expired() {
                let s = agents.sample();
                let t = started.elapsed().as_secs_f64();
                if s.started > 0 && first_dial.is_none() {
                    first_dial = Some(t);
                }
                r.curve.push(Point {
                    t_s: t,
                    value: s.connected as f64,
                });
                if let Some(stats) = ProcStats::read(&pid) {
                    r.rss_curve.push((s.connected, stats.rss_bytes));
                }
                if s.connected >= n {
                    r.time_to_all_connected_s = Some(t);
                    r.time_to_first_dial_s = first_dial;
                    b.bare_setup_per_s = Some(crate::scenario::setup_rate(
                        s.established_total,
                        first_dial,
                        t,
                    ));
                    all = true;
                    break;
                }
                tokio::time::sleep(SAMPLE_EVERY).await;
            }
            let s = agents.sample();
            b.sessions = s.connected;
            r.connected = Some(s.connected);
            if let (Some(before), Some(after)) = (before, ProcStats::read(&pid)) {
                b.bare_rss_per_session_bytes = Some(
                    (after.rss_bytes as f64 - before.rss_bytes as f64) / s.connected.max(1) as f64,
                );
            }
            agents.stop().await;
            drop(child.stdin.take());
            if tokio::time::timeout(Duration::from_secs(10), child.wait())
                .await
                .is_err()
            {
                let _ = child.kill().await;
            }
            Ok(all)
        }
    }

    fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
        match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => Some(a / b),
            _ => None,
        }
    }
}
