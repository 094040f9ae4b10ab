//! A swarm: many simulated agents in one process. Each is the agent library's spoke side (its
//! durable cache, reconciler and status logic, over a [`SimCluster`]) behind a session driver
//! that speaks the real protocol (`flotilla_proto::session::AgentSession`) over real TLS and
//! HTTP/2 from a chosen loopback source address, and that counts what a load test needs to see:
//! sessions up, frames and bytes, when each work was durably acked.
//!
//! The driver follows the agent's own (`flotilla_agent::session`) step for step: store a work
//! durably, then ack it, then hand it to the reconciler; statuses leave from the cache's outbox
//! and stay there until the hub acks them. It exists because the agent's `run_with` has no way
//! yet to bind a source address or to report these events; see the crate docs.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use flotilla_agent::cache::{CachedWork, MAX_MANIFEST_WORK_BYTES, SledCacheDb, WorkCache, durably};
use flotilla_agent::reconcile::{ReconcileHandle, Reconciler, ReconcilerConfig};
use flotilla_proto::api::{ManifestWork, ManifestWorkStatus};
use flotilla_proto::session::{
    AgentConfig as SessionConfig, AgentEvent, AgentSession, Backoff, BackoffConfig,
    DEFAULT_WELCOME_TIMEOUT,
};
use flotilla_proto::wire::{self, fleet_client::FleetClient};
use hyper_util::rt::TokioIo;
use prost::Message as _;
use rand::{Rng, SeedableRng};
use rustls_pki_types::ServerName;
use serde::{Deserialize, Serialize};
use tokio::net::TcpSocket;
use tokio::sync::{Mutex, Notify, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Endpoint;
use tracing::{debug, warn};

use crate::clock::{self, Stamp};
use crate::fleet::Identity;
use crate::sim::{Faults, SimCluster};

/// Largest frame a simulated agent accepts (the agent's own bound).
pub const MAX_FRAME_BYTES: usize = 8 * 1024 * 1024;
/// Kubernetes version the simulated clusters report.
pub const SIM_KUBERNETES_VERSION: &str = "v1.36.0-flotilla-loadtest";
/// How long one dial (TCP, TLS, HTTP/2) may take before it counts as failed.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(20);

/// Everything a swarm needs; a worker process reads it from a file.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SwarmSpec {
    /// The hub's agent address.
    pub hub: SocketAddr,
    pub server_name: String,
    /// PEM CA bundle the agents trust.
    pub ca_bundle: String,
    /// Global index of this swarm's first agent: picks source addresses and seeds.
    pub first_index: usize,
    /// Agents started per second by this swarm.
    pub connect_rate: f64,
    pub source_addresses: u32,
    pub seed: u64,
    pub max_backoff_ms: u64,
    pub apply_delay_ms: u64,
    pub apply_failure_rate: f64,
    /// The sled database all the swarm's agents share.
    pub cache_dir: PathBuf,
}

/// Counters of a swarm at one moment. Swarms in several processes add up.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Sample {
    /// Agents whose task has started.
    pub started: u64,
    /// Sessions established right now.
    pub connected: u64,
    /// Sessions established since the start (the hub's accepted handshakes).
    pub established_total: u64,
    /// Dials or session opens that failed.
    pub failed_attempts: u64,
    pub frames_in: u64,
    pub bytes_in: u64,
    pub frames_out: u64,
    pub bytes_out: u64,
    /// Works stored durably and acked.
    pub works_acked: u64,
    pub statuses_sent: u64,
    pub statuses_acked: u64,
    /// Acks of a status seq the agent already had acknowledged (a status stored twice).
    pub duplicate_status_acks: u64,
    /// Successful applies to the simulated clusters, and failures injected on purpose.
    pub applies: u64,
    pub injected_failures: u64,
}

impl Sample {
    pub fn add(&mut self, o: &Sample) {
        self.started += o.started;
        self.connected += o.connected;
        self.established_total += o.established_total;
        self.failed_attempts += o.failed_attempts;
        self.frames_in += o.frames_in;
        self.bytes_in += o.bytes_in;
        self.frames_out += o.frames_out;
        self.bytes_out += o.bytes_out;
        self.works_acked += o.works_acked;
        self.statuses_sent += o.statuses_sent;
        self.statuses_acked += o.statuses_acked;
        self.duplicate_status_acks += o.duplicate_status_acks;
        self.applies += o.applies;
        self.injected_failures += o.injected_failures;
    }
}

#[derive(Default)]
struct Tally {
    started: AtomicU64,
    connected: AtomicI64,
    established_total: AtomicU64,
    failed_attempts: AtomicU64,
    frames_in: AtomicU64,
    bytes_in: AtomicU64,
    frames_out: AtomicU64,
    bytes_out: AtomicU64,
    works_acked: AtomicU64,
    statuses_sent: AtomicU64,
    statuses_acked: AtomicU64,
    duplicate_status_acks: AtomicU64,
}

/// What one agent holds at the end, for the coordinator's accounting.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct AgentRecord {
    pub name: String,
    pub connected: bool,
    pub sessions: u64,
    /// Work name → when its first generation was durably stored and acked.
    pub acks: BTreeMap<String, Stamp>,
    /// The latest status of each work the agent holds.
    pub statuses: Vec<StatusDigest>,
    /// Works held for which the agent has produced no status yet.
    pub works_without_status: Vec<String>,
}

/// The latest status an agent produced for one work, as a digest to compare with the hub's.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StatusDigest {
    pub work: String,
    pub uid: String,
    pub seq: u64,
    pub acked_seq: u64,
    pub digest: u64,
}

/// A stable digest of a ManifestWork status, after the same normalisation the gateway applies
/// before storing it (parse as `ManifestWorkStatus`, serialise again).
pub fn status_digest(status: &serde_json::Value) -> u64 {
    use std::hash::{Hash, Hasher};
    let normal = serde_json::from_value::<ManifestWorkStatus>(status.clone())
        .ok()
        .and_then(|s| serde_json::to_string(&s).ok())
        .unwrap_or_else(|| status.to_string());
    // SipHash with fixed keys: the same in every process of the same build.
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    normal.hash(&mut h);
    h.finish()
}

struct SimAgent {
    name: String,
    /// Global index: source address and seed.
    index: usize,
    tls: TlsConnector,
    cache: Arc<dyn WorkCache>,
    cluster: Arc<SimCluster>,
    connected: AtomicBool,
    sessions: AtomicU64,
    acks: Mutex<BTreeMap<String, Stamp>>,
    /// Highest status seq the hub acked per work uid, to notice a status acked twice.
    acked: Mutex<HashMap<String, u64>>,
}

/// Many agents in this process.
pub struct Swarm {
    agents: Vec<Arc<SimAgent>>,
    tally: Arc<Tally>,
    stop: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl Swarm {
    /// Starts one agent per identity, ramping at the spec's rate. Fails before any agent
    /// starts if a certificate or the cache cannot be used.
    pub fn start(spec: &SwarmSpec, identities: &[Identity]) -> anyhow::Result<Swarm> {
        let db = SledCacheDb::open(&spec.cache_dir)
            .with_context(|| format!("opening the agents' cache {}", spec.cache_dir.display()))?;
        let faults = Faults {
            apply_delay: Duration::from_millis(spec.apply_delay_ms),
            failure_rate: spec.apply_failure_rate,
        };
        let mut agents = Vec::with_capacity(identities.len());
        for (k, id) in identities.iter().enumerate() {
            let index = spec.first_index + k;
            let tls = flotilla_gateway::tls::client_config(
                spec.ca_bundle.as_bytes(),
                id.cert_pem.as_bytes(),
                id.key_pem.as_bytes(),
                &[b"h2"],
            )
            .with_context(|| format!("agent {}: certificate", id.name))?;
            agents.push(Arc::new(SimAgent {
                name: id.name.clone(),
                index,
                tls: TlsConnector::from(tls),
                cache: Arc::new(db.cluster(&id.name)?),
                cluster: SimCluster::new(
                    faults,
                    spec.seed ^ (index as u64).wrapping_mul(0x9E37_79B9),
                ),
                connected: AtomicBool::new(false),
                sessions: AtomicU64::new(0),
                acks: Mutex::new(BTreeMap::new()),
                acked: Mutex::new(HashMap::new()),
            }));
        }
        let tally = Arc::new(Tally::default());
        let (stop, stop_rx) = watch::channel(false);
        let mut tasks = JoinSet::new();
        let t0 = Instant::now();
        let shared = Arc::new(Shared {
            hub: spec.hub,
            server_name: ServerName::try_from(spec.server_name.clone())?,
            ca_sha256: flotilla_gateway::certificates::bundle_sha256(&spec.ca_bundle),
            source_addresses: spec.source_addresses,
            max_backoff: Duration::from_millis(spec.max_backoff_ms),
            seed: spec.seed,
            tally: tally.clone(),
            _db: db,
        });
        for (k, agent) in agents.iter().enumerate() {
            let start_at = t0 + Duration::from_secs_f64(k as f64 / spec.connect_rate);
            tasks.spawn(run_agent(
                agent.clone(),
                shared.clone(),
                start_at,
                stop_rx.clone(),
            ));
        }
        Ok(Swarm {
            agents,
            tally,
            stop,
            tasks,
        })
    }

    pub fn len(&self) -> usize {
        self.agents.len()
    }

    pub fn is_empty(&self) -> bool {
        self.agents.is_empty()
    }

    /// The counters now.
    pub fn sample(&self) -> Sample {
        let t = &self.tally;
        let (applies, injected_failures) = self.agents.iter().fold((0, 0), |(a, f), agent| {
            (
                a + agent.cluster.applied.load(Ordering::Relaxed),
                f + agent.cluster.failed.load(Ordering::Relaxed),
            )
        });
        Sample {
            started: t.started.load(Ordering::Relaxed),
            connected: t.connected.load(Ordering::Relaxed).max(0) as u64,
            established_total: t.established_total.load(Ordering::Relaxed),
            failed_attempts: t.failed_attempts.load(Ordering::Relaxed),
            frames_in: t.frames_in.load(Ordering::Relaxed),
            bytes_in: t.bytes_in.load(Ordering::Relaxed),
            frames_out: t.frames_out.load(Ordering::Relaxed),
            bytes_out: t.bytes_out.load(Ordering::Relaxed),
            works_acked: t.works_acked.load(Ordering::Relaxed),
            statuses_sent: t.statuses_sent.load(Ordering::Relaxed),
            statuses_acked: t.statuses_acked.load(Ordering::Relaxed),
            duplicate_status_acks: t.duplicate_status_acks.load(Ordering::Relaxed),
            applies,
            injected_failures,
        }
    }

    /// Each agent's state, for the accounting at the end of a scenario.
    pub async fn records(&self) -> Vec<AgentRecord> {
        let mut out = Vec::with_capacity(self.agents.len());
        for a in &self.agents {
            let mut statuses = Vec::new();
            let mut works_without_status = Vec::new();
            let works = a.cache.works().unwrap_or_default();
            for w in works.iter().filter(|w| !w.deleting) {
                match a.cache.last_status(&w.uid) {
                    Ok(Some(s)) => statuses.push(StatusDigest {
                        work: w.name.clone(),
                        uid: w.uid.clone(),
                        seq: s.seq,
                        acked_seq: s.acked_seq,
                        digest: status_digest(&s.status),
                    }),
                    _ => works_without_status.push(w.name.clone()),
                }
            }
            out.push(AgentRecord {
                name: a.name.clone(),
                connected: a.connected.load(Ordering::Relaxed),
                sessions: a.sessions.load(Ordering::Relaxed),
                acks: a.acks.lock().await.clone(),
                statuses,
                works_without_status,
            });
        }
        out
    }

    /// Stops every agent (each says goodbye if connected) and waits for them.
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        while self.tasks.join_next().await.is_some() {}
    }
}

struct Shared {
    hub: SocketAddr,
    server_name: ServerName<'static>,
    ca_sha256: String,
    source_addresses: u32,
    max_backoff: Duration,
    seed: u64,
    tally: Arc<Tally>,
    /// Kept open for as long as any agent runs.
    _db: SledCacheDb,
}

/// Loopback source address number `n`: 127.0.0.1, 127.0.0.2, ...
pub fn source_address(n: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(u32::from(Ipv4Addr::new(127, 0, 0, 1)) + n))
}

/// How one session ended.
enum Ended {
    Drained { retry_after: Duration },
    Lost { reason: String },
    Shutdown,
}

async fn run_agent(
    agent: Arc<SimAgent>,
    shared: Arc<Shared>,
    start_at: Instant,
    mut stop: watch::Receiver<bool>,
) {
    tokio::select! {
        _ = tokio::time::sleep_until(start_at) => {}
        _ = stop.wait_for(|s| *s) => return,
    }
    shared.tally.started.fetch_add(1, Ordering::Relaxed);
    let mut rng = rand::rngs::StdRng::seed_from_u64(shared.seed.wrapping_add(agent.index as u64));
    let reconciler_rng = rand::rngs::StdRng::seed_from_u64(rng.random());
    let outbox_changed = Arc::new(Notify::new());
    let (reconciler, handle) = Reconciler::new(
        agent.cache.clone(),
        agent.cluster.clone(),
        ReconcilerConfig::default(),
        outbox_changed.clone(),
        Box::new(jitter(reconciler_rng)),
    );
    let stop_reconciler = stop.clone();
    let reconciler = tokio::spawn(reconciler.run(async move {
        let mut s = stop_reconciler;
        let _ = s.wait_for(|s| *s).await;
    }));
    let mut draw = jitter(rng);
    let mut backoff = Backoff::new(BackoffConfig {
        max: shared.max_backoff,
        initial: shared.max_backoff.min(BackoffConfig::default().initial),
        startup_jitter: Duration::ZERO,
        ..BackoffConfig::default()
    });
    loop {
        let mut established_at = None;
        let ended = session_once(
            &agent,
            &shared,
            &handle,
            &outbox_changed,
            stop.clone(),
            &mut established_at,
        )
        .await;
        if let Some(at) = established_at {
            backoff.connected(at);
        }
        let delay = match ended {
            Ended::Shutdown => break,
            Ended::Drained { retry_after } => {
                backoff.next_delay(Instant::now(), Some(retry_after), &mut draw)
            }
            Ended::Lost { reason } => {
                if established_at.is_none() {
                    shared.tally.failed_attempts.fetch_add(1, Ordering::Relaxed);
                }
                debug!(agent = %agent.name, %reason, "session ended");
                backoff.next_delay(Instant::now(), None, &mut draw)
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
    }
    let _ = reconciler.await;
}

/// A `Jitter` over a seeded RNG.
fn jitter(mut rng: rand::rngs::StdRng) -> impl FnMut(Duration) -> Duration + Send + Sync + 'static {
    move |max: Duration| {
        if max.is_zero() {
            Duration::ZERO
        } else {
            Duration::from_nanos(rng.random_range(0..=max.as_nanos().min(u64::MAX as u128) as u64))
        }
    }
}

async fn dial(agent: &SimAgent, shared: &Shared) -> anyhow::Result<tonic::transport::Channel> {
    let source = source_address(agent.index as u32 % shared.source_addresses);
    let hub = shared.hub;
    let tls = agent.tls.clone();
    let name = shared.server_name.clone();
    let connector = tower::service_fn(move |_uri: http::Uri| {
        let tls = tls.clone();
        let name = name.clone();
        async move {
            let socket = TcpSocket::new_v4()?;
            socket.bind(SocketAddr::new(source, 0))?;
            let tcp = socket.connect(hub).await?;
            tcp.set_nodelay(true)?;
            let tls = tls.connect(name, tcp).await?;
            Ok::<_, std::io::Error>(TokioIo::new(tls))
        }
    });
    let channel = tokio::time::timeout(
        DIAL_TIMEOUT,
        Endpoint::from_shared(format!("http://{hub}"))?.connect_with_connector(connector),
    )
    .await
    .context("dial timed out")??;
    Ok(channel)
}

async fn session_once(
    agent: &SimAgent,
    shared: &Shared,
    reconciler: &ReconcileHandle,
    outbox_changed: &Notify,
    mut stop: watch::Receiver<bool>,
    established_at: &mut Option<Instant>,
) -> Ended {
    let channel = tokio::select! {
        c = dial(agent, shared) => match c {
            Ok(c) => c,
            Err(e) => return Ended::Lost { reason: format!("{e:#}") },
        },
        _ = stop.wait_for(|s| *s) => return Ended::Shutdown,
    };
    let held = durably(&agent.cache, |c| c.held())
        .await
        .unwrap_or_default();
    let mut machine = AgentSession::new(
        Instant::now(),
        SessionConfig {
            cluster_name: agent.name.clone(),
            agent_version: concat!("flotilla-loadtest/", env!("CARGO_PKG_VERSION")).into(),
            kubernetes_version: SIM_KUBERNETES_VERSION.into(),
            claims: Vec::new(),
            welcome_timeout: DEFAULT_WELCOME_TIMEOUT,
        },
        held,
    )
    .with_ca_bundle_sha256(shared.ca_sha256.clone());
    let (tx, rx) = mpsc::channel(32);
    let tally = &shared.tally;
    while let Some(frame) = machine.poll_transmit() {
        count_out(tally, &frame);
        let _ = tx.try_send(frame);
    }
    let mut client = FleetClient::new(channel)
        .max_decoding_message_size(MAX_FRAME_BYTES)
        .max_encoding_message_size(MAX_FRAME_BYTES);
    let mut inbound = match client.session(ReceiverStream::new(rx)).await {
        Ok(r) => r.into_inner(),
        Err(status) => {
            return Ended::Lost {
                reason: format!("hub refused the session: {}", status.message()),
            };
        }
    };
    let mut drained = None;
    let mut reason = String::from("session ended");
    let mut reported: HashMap<String, u64> = HashMap::new();
    let mut shutdown = false;
    loop {
        // Transmit, then act on events, until neither is left: acting on an event (an ack, the
        // outbox on Established) queues frames that must leave now, not at the next wake-up.
        loop {
            while let Some(frame) = machine.poll_transmit() {
                count_out(tally, &frame);
                if tx.send(frame).await.is_err() {
                    break;
                }
            }
            let mut acted = false;
            while let Some(event) = machine.poll_event() {
                acted = true;
                match event {
                    AgentEvent::Established { .. } => {
                        *established_at = Some(Instant::now());
                        agent.connected.store(true, Ordering::Relaxed);
                        agent.sessions.fetch_add(1, Ordering::Relaxed);
                        tally.connected.fetch_add(1, Ordering::Relaxed);
                        tally.established_total.fetch_add(1, Ordering::Relaxed);
                        report_outbox(agent, tally, &mut machine, &mut reported);
                    }
                    AgentEvent::WorkReceived { work } => {
                        receive_work(agent, tally, reconciler, &mut machine, work).await
                    }
                    AgentEvent::WorkDeleted { uid, .. } => {
                        let key = uid.clone();
                        if let Ok(true) =
                            durably(&agent.cache, move |c| c.mark_deleting(&key)).await
                        {
                            reconciler.work_changed(&uid).await;
                        }
                    }
                    AgentEvent::StatusAcked { uid, seq } => {
                        tally.statuses_acked.fetch_add(1, Ordering::Relaxed);
                        {
                            let mut acked = agent.acked.lock().await;
                            let previous = acked.entry(uid.clone()).or_insert(0);
                            if *previous >= seq {
                                tally.duplicate_status_acks.fetch_add(1, Ordering::Relaxed);
                            }
                            *previous = (*previous).max(seq);
                        }
                        if let Ok(true) = agent.cache.ack_status(&uid, seq) {
                            reported.remove(&uid);
                        }
                    }
                    AgentEvent::Drained { retry_after, .. } => drained = Some(retry_after),
                    AgentEvent::Closed { reason: r, .. } => reason = r.to_string(),
                    _ => {}
                }
            }
            if !acted {
                break;
            }
        }
        if machine.is_closed() {
            break;
        }
        let deadline = machine.poll_timeout();
        let established = machine.is_established();
        tokio::select! {
            frame = inbound.message() => match frame {
                Ok(Some(frame)) => {
                    tally.frames_in.fetch_add(1, Ordering::Relaxed);
                    tally.bytes_in.fetch_add(frame.encoded_len() as u64, Ordering::Relaxed);
                    if let Err(e) = machine.handle_frame(Instant::now(), frame) {
                        warn!(agent = %agent.name, error = %e, "protocol error from the hub");
                    }
                }
                Ok(None) => machine.close("hub closed the stream"),
                Err(status) => machine.close(format!("hub ended the session: {}", status.message())),
            },
            _ = sleep_until(deadline) => machine.handle_timeout(Instant::now()),
            _ = outbox_changed.notified(), if established => {
                report_outbox(agent, tally, &mut machine, &mut reported);
            }
            _ = stop.wait_for(|s| *s) => {
                machine.close("agent shutting down");
                while let Some(frame) = machine.poll_transmit() {
                    let _ = tx.try_send(frame);
                }
                shutdown = true;
                break;
            }
        }
    }
    if established_at.is_some() {
        agent.connected.store(false, Ordering::Relaxed);
        tally.connected.fetch_sub(1, Ordering::Relaxed);
    }
    if shutdown {
        return Ended::Shutdown;
    }
    match drained {
        Some(retry_after) => Ended::Drained { retry_after },
        None => Ended::Lost { reason },
    }
}

fn count_out(tally: &Tally, frame: &wire::AgentFrame) {
    tally.frames_out.fetch_add(1, Ordering::Relaxed);
    tally
        .bytes_out
        .fetch_add(frame.encoded_len() as u64, Ordering::Relaxed);
}

/// Stores a work durably, acks it, hands it to the reconciler: the agent's order.
async fn receive_work(
    agent: &SimAgent,
    tally: &Tally,
    reconciler: &ReconcileHandle,
    machine: &mut AgentSession,
    work: wire::WorkUpdate,
) {
    let wire::WorkUpdate {
        uid,
        namespace,
        name,
        generation,
        content_hash,
        manifest_work_json,
    } = work;
    let refused = if manifest_work_json.len() > MAX_MANIFEST_WORK_BYTES {
        Some(format!(
            "the ManifestWork is {} bytes",
            manifest_work_json.len()
        ))
    } else {
        serde_json::from_slice::<ManifestWork>(&manifest_work_json)
            .err()
            .map(|e| format!("the ManifestWork does not parse: {e}"))
    };
    let content = refused.is_none().then_some(manifest_work_json);
    let cached = CachedWork {
        uid: uid.clone(),
        namespace,
        name: name.clone(),
        generation,
        content_hash,
        refused,
        deleting: false,
    };
    if let Ok(Some(held)) = agent.cache.work(&uid)
        && held == cached
    {
        machine.ack_work(uid, generation);
        return;
    }
    match durably(&agent.cache, move |c| {
        c.put_work(&cached, content.as_deref())
    })
    .await
    {
        Ok(()) => {
            machine.ack_work(uid.clone(), generation);
            tally.works_acked.fetch_add(1, Ordering::Relaxed);
            agent
                .acks
                .lock()
                .await
                .entry(name)
                .or_insert_with(clock::now);
            reconciler.work_changed(&uid).await;
        }
        Err(e) => warn!(agent = %agent.name, uid = %uid, error = %e, "cannot store a work"),
    }
}

fn report_outbox(
    agent: &SimAgent,
    tally: &Tally,
    machine: &mut AgentSession,
    reported: &mut HashMap<String, u64>,
) {
    let Ok(pending) = agent.cache.pending_statuses() else {
        return;
    };
    for status in pending {
        if reported
            .get(&status.uid)
            .is_some_and(|seq| *seq >= status.seq)
        {
            continue;
        }
        reported.insert(status.uid.clone(), status.seq);
        tally.statuses_sent.fetch_add(1, Ordering::Relaxed);
        machine.report_status(
            status.uid,
            status.generation,
            status.seq,
            status.status_json,
        );
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
