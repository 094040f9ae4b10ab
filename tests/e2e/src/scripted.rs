//! An agent's session played by a test, for tests about what a session may and may not do:
//! the real carriers and TLS with whatever certificate the test presents, frames chosen by the
//! test, every frame the hub sends kept for assertions, heartbeats at the interval the hub's
//! welcome asks for, and each tunnel the hub opens answered with one canned HTTP/1.1 response
//! naming the cluster (what a spoke apiserver would answer through the agent's tunnel end).
//!
//! Not for: the agent's behaviour (caching, applying, reconnecting): tests of those run the real
//! `flotilla-agent`.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use flotilla_proto::wire::{AgentFrame, HubFrame, agent_frame, hub_frame};
use flotilla_transport::quic::{QuicClient, QuicSettings};
use flotilla_transport::{AgentTunnels, Carrier, Dialed, TunnelStream};
use futures::StreamExt as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::{Mutex, Notify, mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_rustls::rustls;

/// What the hub's listeners are told the server is called (its certificate names it).
pub const SERVER_NAME: &str = "localhost";

/// A certificate from the hub CA, as the hub and the CLI write them: `ca.crt`, `tls.crt` and
/// `tls.key` in one directory (an agent's, an operator's, a kubectl user's or a gateway's).
pub fn identity_tls(dir: &Path, alpn: &[&[u8]]) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let read =
        |f: &str| std::fs::read(dir.join(f)).with_context(|| format!("{}/{f}", dir.display()));
    Ok(flotilla_transport::tls::client_config(
        &read("ca.crt")?,
        &read("tls.crt")?,
        &read("tls.key")?,
        alpn,
    )?)
}

/// A client that trusts the hub CA in `ca_crt` and presents no certificate.
pub fn anonymous_tls(ca_crt: &Path, alpn: &[&[u8]]) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let ca = std::fs::read(ca_crt).with_context(|| ca_crt.display().to_string())?;
    let mut config =
        rustls::ClientConfig::builder_with_provider(flotilla_transport::tls::provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(flotilla_transport::tls::root_store(&ca)?)
            .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// A connection to the agents' listener at `address` on `carrier` with `tls`, its session
/// opened with `first`; the QUIC endpoint (if any) must live as long as the session.
pub async fn dial(
    address: &str,
    carrier: Carrier,
    tls: Arc<rustls::ClientConfig>,
    first: AgentFrame,
) -> anyhow::Result<(Dialed, Option<QuicClient>)> {
    match carrier {
        Carrier::Grpc => {
            let name = rustls_pki_types::ServerName::try_from(SERVER_NAME)?;
            let channel = flotilla_transport::grpc::connect(address, name, tls, None, None).await?;
            let dialed = flotilla_transport::grpc::open_session(
                channel,
                flotilla_agent::connect::MAX_FRAME_BYTES,
                first,
            )
            .await?;
            Ok((dialed, None))
        }
        Carrier::Quic => {
            let settings = QuicSettings {
                max_frame_bytes: flotilla_agent::connect::MAX_FRAME_BYTES,
                ..QuicSettings::default()
            };
            let client = QuicClient::bind("127.0.0.1:0".parse()?, settings)?;
            let address: SocketAddr = address.parse()?;
            let dialed = client
                .open_session(address, SERVER_NAME, &tls, first)
                .await?;
            Ok((dialed, Some(client)))
        }
    }
}

/// How a scripted agent behaves beyond sending what the test tells it to.
#[derive(Clone, Debug, Default)]
pub struct Script {
    /// Works (by name) whose updates it acknowledges, as an agent acks what it has cached.
    pub ack_works: Vec<String>,
    /// The body of its tunnels' answers: something the test can look for wherever it must
    /// not be.
    pub tunnel_answer: String,
}

/// The requests the agent's tunnels carried, as their heads arrived.
#[derive(Default)]
struct Tunnels {
    heads: Mutex<Vec<String>>,
    /// Ids of the tunnels the hub opened: asked for with `OpenTunnel` (gRPC), or streams it
    /// opened itself (QUIC).
    asked: Mutex<Vec<String>>,
}

/// One scripted session; its tasks end when it is dropped.
pub struct ScriptedAgent {
    pub cluster: String,
    outbound: mpsc::Sender<AgentFrame>,
    /// Every frame the hub sent, in order.
    received: Arc<Mutex<Vec<HubFrame>>>,
    /// Told whenever a frame arrives or the stream ends.
    changed: Arc<Notify>,
    ended: Arc<watch::Sender<bool>>,
    tunnels: Arc<Tunnels>,
    /// While true, tunnels the hub opens wait unanswered (and, over gRPC, unopened).
    hold: watch::Sender<bool>,
    agent_tunnels: AgentTunnels,
    tasks: Vec<JoinHandle<()>>,
    _quic: Option<QuicClient>,
}

impl Drop for ScriptedAgent {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl ScriptedAgent {
    /// Plays `cluster`'s agent on a connection already dialled (see [`dial`]).
    pub fn start(
        cluster: &str,
        (dialed, quic): (Dialed, Option<QuicClient>),
        script: Script,
    ) -> ScriptedAgent {
        let Dialed {
            link,
            pump,
            tunnels: agent_tunnels,
        } = dialed;
        let received = Arc::new(Mutex::new(Vec::new()));
        let changed = Arc::new(Notify::new());
        let (ended, _) = watch::channel(false);
        let ended = Arc::new(ended);
        let tunnels = Arc::new(Tunnels::default());
        let (hold, held) = watch::channel(false);
        let script = Arc::new(script);
        let outbound = link.outbound.clone();
        let mut tasks = Vec::new();
        if let Some(pump) = pump {
            tasks.push(tokio::spawn(pump));
        }
        let reader = {
            let (received, changed, ended, tunnels) = (
                received.clone(),
                changed.clone(),
                ended.clone(),
                tunnels.clone(),
            );
            let (outbound, agent_tunnels, script, held) = (
                outbound.clone(),
                agent_tunnels.clone(),
                script.clone(),
                held.clone(),
            );
            let mut inbound = link.inbound;
            tokio::spawn(async move {
                let mut beating: Option<JoinHandle<()>> = None;
                while let Some(Ok(frame)) = inbound.next().await {
                    match &frame.frame {
                        Some(hub_frame::Frame::Welcome(w)) if beating.is_none() => {
                            let every = Duration::from_millis(u64::from(w.heartbeat_interval_ms));
                            beating = Some(tokio::spawn(heartbeats(outbound.clone(), every)));
                        }
                        Some(hub_frame::Frame::WorkUpdate(u))
                            if script.ack_works.contains(&u.name) =>
                        {
                            let ack = agent_frame::Frame::WorkAck(flotilla_proto::wire::WorkAck {
                                uid: u.uid.clone(),
                                generation: u.generation,
                            });
                            let _ = outbound.send(AgentFrame { frame: Some(ack) }).await;
                        }
                        Some(hub_frame::Frame::OpenTunnel(open)) => {
                            tunnels.asked.lock().await.push(open.id.clone());
                            let (id, bytes, agent_tunnels, tunnels, script, mut held) = (
                                open.id.clone(),
                                open.bytes,
                                agent_tunnels.clone(),
                                tunnels.clone(),
                                script.clone(),
                                held.clone(),
                            );
                            tokio::spawn(async move {
                                let _ = held.wait_for(|h| !*h).await;
                                if let Some(Ok(stream)) =
                                    agent_tunnels.open_requested(&id, bytes).await
                                {
                                    let _ = answer(stream, &tunnels, &script.tunnel_answer).await;
                                }
                            });
                        }
                        _ => {}
                    }
                    received.lock().await.push(frame);
                    changed.notify_waiters();
                }
                if let Some(beating) = beating {
                    beating.abort();
                }
                ended.send_replace(true);
                changed.notify_waiters();
            })
        };
        tasks.push(reader);
        // Over QUIC the gateway opens the tunnels' streams itself.
        let acceptor = {
            let (agent_tunnels, tunnels, script, mut held) = (
                agent_tunnels.clone(),
                tunnels.clone(),
                script.clone(),
                held.clone(),
            );
            tokio::spawn(async move {
                while let Some(accepted) = agent_tunnels.accept().await {
                    let Some(stream) = accepted.read_id().await else {
                        continue;
                    };
                    tunnels.asked.lock().await.push(stream.id.clone());
                    let (tunnels, script) = (tunnels.clone(), script.clone());
                    let _ = held.wait_for(|h| !*h).await;
                    tokio::spawn(async move {
                        let _ = answer(stream, &tunnels, &script.tunnel_answer).await;
                    });
                }
            })
        };
        tasks.push(acceptor);
        ScriptedAgent {
            cluster: cluster.to_string(),
            outbound,
            received,
            changed,
            ended,
            tunnels,
            hold,
            agent_tunnels,
            tasks,
            _quic: quic,
        }
    }

    /// Sends one frame on the session.
    pub async fn send(&self, frame: agent_frame::Frame) -> anyhow::Result<()> {
        self.outbound
            .send(AgentFrame { frame: Some(frame) })
            .await
            .map_err(|_| anyhow::anyhow!("{}'s session is closed", self.cluster))
    }

    /// Every frame the hub has sent so far.
    pub async fn received(&self) -> Vec<HubFrame> {
        self.received.lock().await.clone()
    }

    /// Waits (at most `within`) for a frame from the hub that `pick` takes, and returns what it
    /// took; fails naming `what` and the frames that did come.
    pub async fn wait_frame<T>(
        &self,
        what: &str,
        within: Duration,
        pick: impl Fn(&hub_frame::Frame) -> Option<T>,
    ) -> anyhow::Result<T> {
        let deadline = Instant::now() + within;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(found) = self
                .received
                .lock()
                .await
                .iter()
                .find_map(|f| f.frame.as_ref().and_then(&pick))
            {
                return Ok(found);
            }
            if *self.ended.borrow() {
                // The reader keeps every frame before it marks the end: one that came between
                // the look above and this one is there now.
                if let Some(found) = self
                    .received
                    .lock()
                    .await
                    .iter()
                    .find_map(|f| f.frame.as_ref().and_then(&pick))
                {
                    return Ok(found);
                }
                anyhow::bail!(
                    "{}'s session ended without {what}; it received {:?}",
                    self.cluster,
                    self.received().await
                );
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                anyhow::bail!(
                    "{} did not receive {what} within {within:?}; it received {:?}",
                    self.cluster,
                    self.received().await
                );
            }
        }
    }

    /// Waits (at most `within`) for the hub to end the session.
    pub async fn wait_ended(&self, within: Duration) -> anyhow::Result<()> {
        let mut ended = self.ended.subscribe();
        tokio::time::timeout(within, ended.wait_for(|e| *e))
            .await
            .with_context(|| format!("{}'s session did not end within {within:?}", self.cluster))?
            .map(drop)
            .map_err(|_| anyhow::anyhow!("{}'s session reader is gone", self.cluster))
    }

    /// Whether the session is still open.
    pub fn is_open(&self) -> bool {
        !*self.ended.borrow()
    }

    /// The request heads its tunnels carried, in order.
    pub async fn tunnel_requests(&self) -> Vec<String> {
        self.tunnels.heads.lock().await.clone()
    }

    /// The ids of the tunnels the hub opened to this agent, in order, answered or held.
    pub async fn tunnels_opened(&self) -> Vec<String> {
        self.tunnels.asked.lock().await.clone()
    }

    /// Holds (`true`) or releases the tunnels the hub opens: held ones wait unanswered.
    pub fn hold_tunnels(&self, hold: bool) {
        self.hold.send_replace(hold);
    }

    /// The connection's tunnel calls, for a test that answers (or tries to) itself.
    pub fn agent_tunnels(&self) -> AgentTunnels {
        self.agent_tunnels.clone()
    }
}

async fn heartbeats(outbound: mpsc::Sender<AgentFrame>, every: Duration) {
    let mut tick = tokio::time::interval(every.max(Duration::from_millis(10)));
    for seq in 1.. {
        tick.tick().await;
        let beat = agent_frame::Frame::Heartbeat(flotilla_proto::wire::Heartbeat { seq });
        if outbound
            .send(AgentFrame { frame: Some(beat) })
            .await
            .is_err()
        {
            return;
        }
    }
}

/// Reads one HTTP/1.1 request from a tunnel stream, records its head, and answers `body`.
async fn answer(mut stream: TunnelStream, tunnels: &Tunnels, body: &str) -> anyhow::Result<()> {
    let head = read_head(&mut stream).await?;
    let length = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    let mut request_body = vec![0; length.min(1 << 20)];
    stream.read_exact(&mut request_body).await?;
    tunnels.heads.lock().await.push(head);
    let answer = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(answer.as_bytes()).await?;
    stream.shutdown().await?;
    Ok(())
}

/// Reads an HTTP/1.1 head (to the blank line) byte by byte: nothing after it is consumed.
pub async fn read_head<S: tokio::io::AsyncRead + Unpin>(conn: &mut S) -> anyhow::Result<String> {
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let byte = conn
            .read_u8()
            .await
            .context("the stream closed before the head ended")?;
        head.push(byte);
        anyhow::ensure!(head.len() < 64 * 1024, "head too long");
    }
    Ok(String::from_utf8(head)?)
}
