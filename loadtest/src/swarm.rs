//! A swarm: many simulated agents in one process. Each is the agent itself,
//! `flotilla_agent::run_with`: its session loop, durable cache (one redb database shared by the
//! swarm, a prefix per cluster, its writes group-committed), reconciler and status logic, its
//! identity on disk, dialling from a chosen loopback source address, with a [`SimCluster`]
//! where a real agent has its spoke apiserver. The harness watches each agent through the library's [`Observer`] to count
//! what a load test needs to see: sessions up, frames and bytes, when each work was durably
//! acked, statuses sent and acknowledged.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use flotilla_agent::cache::{CacheDb, CachedWork, CommitMode, WorkCache};
use flotilla_agent::connect::Dialer;
use flotilla_agent::identity;
use flotilla_agent::join::{JoinError, JoinParams};
use flotilla_agent::reconcile::{DEFAULT_APPLY_CONCURRENCY, DEFAULT_FEEDBACK_INTERVAL};
use flotilla_agent::refusal::{Refusal, RefusalKind};
use flotilla_agent::{AgentConfig, Observer, Parts};
use flotilla_proto::api::ManifestWorkStatus;
use flotilla_proto::wire;
use flotilla_transport::quic::QuicClient;
use prost::Message as _;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::clock::{self, Stamp};
use crate::fleet::Identity;
use crate::sim::{Faults, SimCluster};

/// Kubernetes version the simulated clusters report.
pub const SIM_KUBERNETES_VERSION: &str = "v1.36.0-flotilla-loadtest";
/// How long stopped agents may take to say goodbye and end.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// The agents' resync interval: the agent's default (5 minutes), so a run's steady state is a
/// fleet's.
pub const RESYNC_INTERVAL: Duration = Duration::from_secs(300);
/// The swarm's cache database, in [`SwarmSpec::cache_dir`].
pub const CACHE_FILE: &str = "agents.redb";

/// Everything a swarm needs; a worker process reads it from a file.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SwarmSpec {
    /// The hub's agent address.
    pub hub: SocketAddr,
    /// With `--gateways`: the gateways' agent addresses; agent i dials number i mod N (as a
    /// load balancer would spread them) instead of the hub, and follows its redirect.
    #[serde(default)]
    pub gateways: Vec<SocketAddr>,
    pub server_name: String,
    /// PEM CA bundle the agents trust.
    pub ca_bundle: String,
    /// Global index of this swarm's first agent: picks source addresses and seeds.
    pub first_index: usize,
    /// Agents started per second by this swarm.
    pub connect_rate: f64,
    pub source_addresses: u32,
    /// With `--link`: the address of the link's namespace this swarm runs in, which every
    /// agent dials from (loopback addresses cannot leave the namespace); `hub` and
    /// `gateways` are then the link's host end.
    #[serde(default)]
    pub link_address: Option<Ipv4Addr>,
    /// The carrier of the sessions.
    #[serde(default)]
    pub transport: crate::cli::AgentTransport,
    pub seed: u64,
    pub max_backoff_ms: u64,
    /// The agents' QUIC congestion controller, by name.
    #[serde(default)]
    pub quic_congestion: String,
    pub apply_delay_ms: u64,
    pub apply_failure_rate: f64,
    /// The agents' `--feedback-interval`, in milliseconds.
    #[serde(default = "default_feedback_interval_ms")]
    pub feedback_interval_ms: u64,
    /// The directory of the cache database all the swarm's agents share ([`CACHE_FILE`]).
    pub cache_dir: PathBuf,
    /// Where each agent's identity directory (`<dir>/<cluster>/`) is written.
    pub identities_dir: PathBuf,
    /// With `--enroll join`: the agents join with this token before connecting, and the
    /// identities they are given carry names only.
    pub join: Option<JoinSpec>,
    /// Cluster → names of objects its simulated cluster refuses (the rollout scenario's
    /// failing clusters).
    #[serde(default)]
    pub rejects: BTreeMap<String, Vec<String>>,
}

impl SwarmSpec {
    /// The swarm of a run: its agents dial `hub` with the run's settings and keep their cache
    /// and identities under `run_dir`; with `join`, they join with its token first.
    pub fn for_run(
        args: &crate::cli::RunArgs,
        hub: &crate::fleet::Hub,
        run_dir: &Path,
        join: Option<JoinSpec>,
    ) -> anyhow::Result<SwarmSpec> {
        Ok(SwarmSpec {
            hub: hub.agents,
            gateways: hub.gateways().map(|g| g.addresses()).unwrap_or_default(),
            server_name: crate::fleet::SERVER_NAME.to_string(),
            ca_bundle: hub.ca_bundle()?,
            first_index: 0,
            connect_rate: args.connect_rate,
            source_addresses: args.source_addresses,
            link_address: None,
            transport: args.transport,
            seed: args.seed,
            max_backoff_ms: args.max_backoff.as_millis() as u64,
            quic_congestion: args.quic_congestion.name().into(),
            apply_delay_ms: args.apply_delay.as_millis() as u64,
            apply_failure_rate: args.apply_failure_rate,
            feedback_interval_ms: args.feedback_interval.as_millis() as u64,
            cache_dir: run_dir.join("agent-cache"),
            identities_dir: run_dir.join("agent-identities"),
            join,
            rejects: if args.scenarios.contains(&crate::cli::Scenario::Rollout) {
                crate::placement::rollout_rejects(args)
            } else {
                Default::default()
            },
        })
    }
}

fn default_feedback_interval_ms() -> u64 {
    DEFAULT_FEEDBACK_INTERVAL.as_millis() as u64
}

/// What joining agents are given: a `flotilla token create` output.
#[derive(Clone, Serialize, Deserialize)]
pub struct JoinSpec {
    /// `<id>.<secret>`: a secret, never printed.
    pub token: String,
    /// The hub CA's SHA-256 fingerprint the agents pin.
    pub ca_fingerprint: String,
}

impl std::fmt::Debug for JoinSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let id = self.token.split('.').next().unwrap_or_default();
        f.debug_struct("JoinSpec")
            .field("token", &format_args!("{id}.<redacted>"))
            .field("ca_fingerprint", &self.ca_fingerprint)
            .finish()
    }
}

/// Counters of a swarm at one moment. Swarms in several processes add up.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Sample {
    /// Agents whose task has started.
    pub started: u64,
    /// With `--enroll join`: agents that joined (identity stored), and that gave up.
    pub joined: u64,
    pub join_failures: u64,
    /// Sessions established right now.
    pub connected: u64,
    /// Sessions established since the start (the hub's accepted handshakes).
    pub established_total: u64,
    /// Dials or session opens that failed.
    pub failed_attempts: u64,
    /// Redirects to a shard's owning gateway followed (scale-out mode).
    #[serde(default)]
    pub redirects: u64,
    /// Dials the hub turned away before TLS (over its new-session rate, or no handshake slot),
    /// with the sum and the longest of the retry-afters it gave, in milliseconds.
    #[serde(default)]
    pub turned_away: u64,
    #[serde(default)]
    pub turned_away_ms_sum: u64,
    #[serde(default)]
    pub turned_away_ms_max: u64,
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
    /// Agents without a session whose last attempt failed, by why.
    #[serde(default)]
    pub failing: Failing,
    /// Statuses the simulated clusters' "controllers" changed (the feedback scenario).
    #[serde(default)]
    pub status_changes: u64,
}

/// Agents whose last attempt to reach the hub failed, by the kind of failure: what a run that
/// cannot connect reports ("180 agents could not connect: connection refused").
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Failing {
    /// Nothing listens at the hub's address.
    pub refused: u64,
    /// No answer in time (dial or handshake timeout).
    pub timed_out: u64,
    /// TLS failed (a certificate refused by either side).
    pub tls: u64,
    /// The hub answered and refused the session (admission, draining).
    pub refused_by_hub: u64,
    /// Anything else.
    pub other: u64,
}

/// The kinds of [`Failing`], as an agent remembers its last one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FailureKind {
    Refused = 1,
    TimedOut = 2,
    Tls = 3,
    RefusedByHub = 4,
    Other = 5,
}

impl FailureKind {
    /// The kind of an agent's refusal.
    pub fn of(refusal: &Refusal) -> FailureKind {
        match refusal.kind {
            RefusalKind::HubUnreachable | RefusalKind::ProxyUnreachable => FailureKind::Refused,
            RefusalKind::HubTimedOut => FailureKind::TimedOut,
            RefusalKind::CertificateNotTrusted
            | RefusalKind::CertificateExpired
            | RefusalKind::HubNotTrusted => FailureKind::Tls,
            RefusalKind::ClusterNotRegistered
            | RefusalKind::ClusterDenied
            | RefusalKind::ClusterNotAccepted
            | RefusalKind::KeyNotRegistered
            | RefusalKind::NotAnAgent
            | RefusalKind::ProxyRefused => FailureKind::RefusedByHub,
            RefusalKind::SessionLost | RefusalKind::Other => FailureKind::Other,
        }
    }

    /// How a report names agents failing this way.
    pub fn describe(self) -> &'static str {
        match self {
            FailureKind::Refused => "connection refused",
            FailureKind::TimedOut => "no answer in time",
            FailureKind::Tls => "TLS refused",
            FailureKind::RefusedByHub => "refused by the hub",
            FailureKind::Other => "other errors",
        }
    }
}

impl Failing {
    pub fn add(&mut self, o: &Failing) {
        self.refused += o.refused;
        self.timed_out += o.timed_out;
        self.tls += o.tls;
        self.refused_by_hub += o.refused_by_hub;
        self.other += o.other;
    }

    /// Kinds with at least one agent, most common first.
    pub fn kinds(&self) -> Vec<(FailureKind, u64)> {
        let mut all = vec![
            (FailureKind::Refused, self.refused),
            (FailureKind::TimedOut, self.timed_out),
            (FailureKind::Tls, self.tls),
            (FailureKind::RefusedByHub, self.refused_by_hub),
            (FailureKind::Other, self.other),
        ];
        all.retain(|(_, n)| *n > 0);
        all.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
        all
    }
}

impl Sample {
    pub fn add(&mut self, o: &Sample) {
        self.started += o.started;
        self.joined += o.joined;
        self.join_failures += o.join_failures;
        self.connected += o.connected;
        self.established_total += o.established_total;
        self.failed_attempts += o.failed_attempts;
        self.redirects += o.redirects;
        self.turned_away += o.turned_away;
        self.turned_away_ms_sum += o.turned_away_ms_sum;
        self.turned_away_ms_max = self.turned_away_ms_max.max(o.turned_away_ms_max);
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
        self.failing.add(&o.failing);
        self.status_changes += o.status_changes;
    }
}

#[derive(Default)]
struct Tally {
    started: AtomicU64,
    joined: AtomicU64,
    join_failures: AtomicU64,
    connected: AtomicI64,
    established_total: AtomicU64,
    failed_attempts: AtomicU64,
    redirects: AtomicU64,
    turned_away: AtomicU64,
    turned_away_ms_sum: AtomicU64,
    turned_away_ms_max: AtomicU64,
    frames_in: AtomicU64,
    bytes_in: AtomicU64,
    frames_out: AtomicU64,
    bytes_out: AtomicU64,
    works_acked: AtomicU64,
    statuses_sent: AtomicU64,
    statuses_acked: AtomicU64,
    duplicate_status_acks: AtomicU64,
    /// Agents whose last attempt failed, indexed by `FailureKind as usize`.
    failing: [AtomicU64; 6],
    status_changes: Arc<AtomicU64>,
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
    /// The agent's latest session changes: (Unix ms, whether a session began or ended), at
    /// most [`SESSION_LOG`] of them, oldest first.
    #[serde(default)]
    pub session_log: Vec<(u64, bool)>,
}

/// Session changes each agent remembers, for the chaos scenario's judgement of Unknown marks.
pub const SESSION_LOG: usize = 256;

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
/// before storing it (parse as `ManifestWorkStatus`, serialise again), without its fence.
pub fn status_digest(status: &serde_json::Value) -> u64 {
    use std::hash::{Hash, Hasher};
    // The fence is the gateway's record of who wrote the status, not what the agent reported.
    let normal = serde_json::from_value::<ManifestWorkStatus>(status.clone())
        .ok()
        .map(|s| ManifestWorkStatus { fence: None, ..s })
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
    /// ca.crt, tls.crt and tls.key, as `flotilla-agent join` leaves them.
    identity_dir: PathBuf,
    cache: Arc<dyn WorkCache>,
    cluster: Arc<SimCluster>,
    tally: Arc<Tally>,
    connected: AtomicBool,
    sessions: AtomicU64,
    /// The kind of this agent's last failed attempt (`FailureKind as u8`), 0 once it has a
    /// session: what the swarm's `failing` counters count.
    last_failure: AtomicU8,
    /// Work name → when its first generation was durably stored and acked.
    acks: SyncMutex<BTreeMap<String, Stamp>>,
    /// Highest status seq the hub acked per work uid, to notice a status acked twice.
    acked: SyncMutex<HashMap<String, u64>>,
    /// Its latest session changes (see [`AgentRecord::session_log`]).
    session_log: SyncMutex<std::collections::VecDeque<(u64, bool)>>,
}

/// The observer's maps are touched for one insert at a time, never across an await, from the
/// agent's own task and from `records`: a plain mutex cannot block the runtime here.
#[allow(clippy::disallowed_types)]
type SyncMutex<T> = std::sync::Mutex<T>;

impl Observer for SimAgent {
    fn session_established(&self) {
        self.log_session(true);
        self.set_failure(None);
        self.connected.store(true, Ordering::Relaxed);
        self.sessions.fetch_add(1, Ordering::Relaxed);
        self.tally.connected.fetch_add(1, Ordering::Relaxed);
        self.tally.established_total.fetch_add(1, Ordering::Relaxed);
    }

    fn session_closed(&self, reason: &str) {
        debug!(agent = %self.name, %reason, "session ended");
        self.log_session(false);
        self.connected.store(false, Ordering::Relaxed);
        self.tally.connected.fetch_sub(1, Ordering::Relaxed);
    }

    fn connection_failed(&self, refusal: &Refusal) {
        debug!(agent = %self.name, %refusal, "connection failed");
        self.tally.failed_attempts.fetch_add(1, Ordering::Relaxed);
        self.set_failure(Some(FailureKind::of(refusal)));
    }

    fn turned_away(&self, retry_after: Duration) {
        let ms = retry_after.as_millis() as u64;
        self.tally.turned_away.fetch_add(1, Ordering::Relaxed);
        self.tally
            .turned_away_ms_sum
            .fetch_add(ms, Ordering::Relaxed);
        self.tally
            .turned_away_ms_max
            .fetch_max(ms, Ordering::Relaxed);
    }

    fn redirected(&self, _to: &str) {
        self.tally.redirects.fetch_add(1, Ordering::Relaxed);
    }

    fn frame_received(&self, frame: &wire::HubFrame) {
        self.tally.frames_in.fetch_add(1, Ordering::Relaxed);
        self.tally
            .bytes_in
            .fetch_add(frame.encoded_len() as u64, Ordering::Relaxed);
    }

    fn frame_sent(&self, frame: &wire::AgentFrame) {
        self.tally.frames_out.fetch_add(1, Ordering::Relaxed);
        self.tally
            .bytes_out
            .fetch_add(frame.encoded_len() as u64, Ordering::Relaxed);
    }

    fn work_stored(&self, work: &CachedWork) {
        self.tally.works_acked.fetch_add(1, Ordering::Relaxed);
        lock(&self.acks)
            .entry(work.name.clone())
            .or_insert_with(clock::now);
    }

    fn status_reported(&self, _uid: &str, _seq: u64) {
        self.tally.statuses_sent.fetch_add(1, Ordering::Relaxed);
    }

    fn status_acked(&self, uid: &str, seq: u64) {
        self.tally.statuses_acked.fetch_add(1, Ordering::Relaxed);
        let mut acked = lock(&self.acked);
        let previous = acked.entry(uid.to_string()).or_insert(0);
        if *previous >= seq {
            self.tally
                .duplicate_status_acks
                .fetch_add(1, Ordering::Relaxed);
        }
        *previous = (*previous).max(seq);
    }
}

impl SimAgent {
    /// Notes a session beginning (`up`) or ending now, keeping the latest [`SESSION_LOG`].
    fn log_session(&self, up: bool) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let mut log = lock(&self.session_log);
        if log.len() == SESSION_LOG {
            log.pop_front();
        }
        log.push_back((now, up));
    }

    /// Records the kind of the agent's last failure (`None`: it has a session now).
    fn set_failure(&self, kind: Option<FailureKind>) {
        let new = kind.map_or(0, |k| k as u8);
        let old = self.last_failure.swap(new, Ordering::Relaxed);
        if old != new {
            if old != 0 {
                self.tally.failing[old as usize].fetch_sub(1, Ordering::Relaxed);
            }
            if new != 0 {
                self.tally.failing[new as usize].fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Locks `m`, carrying on past a poisoned lock: the maps stay consistent after any panic
/// because every update is a single insert.
fn lock<T>(m: &SyncMutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Many agents in this process.
pub struct Swarm {
    agents: Vec<Arc<SimAgent>>,
    tally: Arc<Tally>,
    stop: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl Swarm {
    /// Writes each agent's identity to disk and starts one agent per identity, ramping at the
    /// spec's rate. Fails before any agent starts if a certificate, its directory or the cache
    /// cannot be used.
    pub fn start(spec: &SwarmSpec, identities: &[Identity]) -> anyhow::Result<Swarm> {
        let cache_path = spec.cache_dir.join(CACHE_FILE);
        let db = CacheDb::open_with(&cache_path, CommitMode::Group)
            .with_context(|| format!("opening the agents' cache {}", cache_path.display()))?;
        let faults = Faults {
            apply_delay: Duration::from_millis(spec.apply_delay_ms),
            failure_rate: spec.apply_failure_rate,
            rejects: Vec::new(),
        };
        let tally = Arc::new(Tally::default());
        let mut agents = Vec::with_capacity(identities.len());
        for (k, id) in identities.iter().enumerate() {
            let index = spec.first_index + k;
            let identity_dir = spec.identities_dir.join(&id.name);
            if spec.join.is_none() {
                write_identity(&identity_dir, &spec.ca_bundle, id)
                    .with_context(|| format!("agent {}: writing its identity", id.name))?;
            }
            agents.push(Arc::new(SimAgent {
                name: id.name.clone(),
                index,
                identity_dir,
                cache: Arc::new(db.cluster(&id.name)),
                cluster: SimCluster::new(
                    Faults {
                        rejects: spec.rejects.get(&id.name).cloned().unwrap_or_default(),
                        ..faults.clone()
                    },
                    spec.seed ^ (index as u64).wrapping_mul(0x9E37_79B9),
                ),
                tally: tally.clone(),
                connected: AtomicBool::new(false),
                sessions: AtomicU64::new(0),
                last_failure: AtomicU8::new(0),
                acks: SyncMutex::new(BTreeMap::new()),
                acked: SyncMutex::new(HashMap::new()),
                session_log: SyncMutex::new(Default::default()),
            }));
        }
        let (stop, stop_rx) = watch::channel(false);
        let mut tasks = JoinSet::new();
        let t0 = Instant::now();
        let quic_congestion: flotilla_transport::quic::QuicCongestion =
            match spec.quic_congestion.as_str() {
                "" => Default::default(),
                name => name.parse().map_err(anyhow::Error::msg)?,
            };
        let shared = Arc::new(Shared {
            quic_congestion,
            hub: spec.hub,
            gateways: spec.gateways.clone(),
            server_name: spec.server_name.clone(),
            source_addresses: spec.source_addresses,
            link_address: spec.link_address,
            max_backoff: Duration::from_millis(spec.max_backoff_ms),
            feedback_interval: Duration::from_millis(spec.feedback_interval_ms),
            seed: spec.seed,
            join: spec.join.clone(),
            transport: spec.transport,
            quic: match spec.transport {
                crate::cli::AgentTransport::Grpc => Vec::new(),
                _ => (0..spec.source_addresses.max(1))
                    .map(|i| {
                        let source = spec
                            .link_address
                            .map_or_else(|| source_address(i), IpAddr::V4);
                        QuicClient::bind(
                            std::net::SocketAddr::new(source, 0),
                            flotilla_agent::connect::quic_settings(quic_congestion),
                        )
                        .with_context(|| format!("a UDP socket on {source}"))
                    })
                    .collect::<anyhow::Result<_>>()?,
            },
            // One responder for every simulated cluster: its answers are made once.
            spoke_api: Arc::new(flotilla_agent::SimulatedApi::new(PROXY_LIST_ITEMS)),
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
            joined: t.joined.load(Ordering::Relaxed),
            join_failures: t.join_failures.load(Ordering::Relaxed),
            connected: t.connected.load(Ordering::Relaxed).max(0) as u64,
            established_total: t.established_total.load(Ordering::Relaxed),
            failed_attempts: t.failed_attempts.load(Ordering::Relaxed),
            redirects: t.redirects.load(Ordering::Relaxed),
            turned_away: t.turned_away.load(Ordering::Relaxed),
            turned_away_ms_sum: t.turned_away_ms_sum.load(Ordering::Relaxed),
            turned_away_ms_max: t.turned_away_ms_max.load(Ordering::Relaxed),
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
            failing: {
                let count = |k: FailureKind| t.failing[k as usize].load(Ordering::Relaxed);
                Failing {
                    refused: count(FailureKind::Refused),
                    timed_out: count(FailureKind::TimedOut),
                    tls: count(FailureKind::Tls),
                    refused_by_hub: count(FailureKind::RefusedByHub),
                    other: count(FailureKind::Other),
                }
            },
            status_changes: t.status_changes.load(Ordering::Relaxed),
        }
    }

    /// Changes every agent's simulated Deployment status every `every` for `duration` (the
    /// feedback scenario); returns the steps each made.
    pub async fn flap(&self, duration: Duration, every: Duration) -> u64 {
        let clusters: Vec<Arc<SimCluster>> =
            self.agents.iter().map(|a| a.cluster.clone()).collect();
        crate::feedback::flap_clusters(
            &clusters,
            duration,
            every,
            self.tally.status_changes.clone(),
        )
        .await
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
                acks: lock(&a.acks).clone(),
                statuses,
                works_without_status,
                session_log: lock(&a.session_log).iter().copied().collect(),
            });
        }
        out
    }

    /// Stops every agent (each says goodbye if connected) and waits for them.
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        // Each agent says goodbye and its loop ends; one that does not within the bound is
        // aborted rather than waited for.
        let drained = tokio::time::timeout(STOP_TIMEOUT, async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            warn!(
                left = self.tasks.len(),
                "agents still running {STOP_TIMEOUT:?} after stop; aborting them"
            );
            self.tasks.shutdown().await;
        }
    }
}

/// Objects in a simulated cluster's ConfigMap list, as the proxy scenario's large list reads it.
pub const PROXY_LIST_ITEMS: usize = 5_000;

struct Shared {
    quic_congestion: flotilla_transport::quic::QuicCongestion,
    hub: SocketAddr,
    /// Where agent i dials with `--gateways`: number i mod N.
    gateways: Vec<SocketAddr>,
    server_name: String,
    source_addresses: u32,
    /// See [`SwarmSpec::link_address`].
    link_address: Option<Ipv4Addr>,
    max_backoff: Duration,
    feedback_interval: Duration,
    seed: u64,
    join: Option<JoinSpec>,
    transport: crate::cli::AgentTransport,
    /// With QUIC: one endpoint (one UDP socket) per source address, shared by the agents
    /// dialling from it, as the carrier allows.
    quic: Vec<QuicClient>,
    /// What the agents' tunnel ends forward kubectl requests to (the simulated clusters have
    /// no apiserver).
    spoke_api: Arc<dyn flotilla_agent::SpokeApi>,
    /// Kept open for as long as any agent runs.
    _db: CacheDb,
}

/// Writes an identity as the agent keeps it: the hub CA bundle, the certificate, and the key
/// readable by its owner only.
fn write_identity(dir: &Path, ca_bundle: &str, id: &Identity) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(identity::CA_FILE), ca_bundle)?;
    std::fs::write(dir.join(identity::CERT_FILE), &id.cert_pem)?;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(dir.join(identity::KEY_FILE))?
        .write_all(id.key_pem.as_bytes())
}

/// Loopback source address number `n`: 127.0.0.1, 127.0.0.2, ...
pub fn source_address(n: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(u32::from(Ipv4Addr::new(127, 0, 0, 1)) + n))
}

/// One agent: waits for its turn in the ramp, then runs the agent library until the swarm
/// stops.
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
    agent.tally.started.fetch_add(1, Ordering::Relaxed);
    let source = shared.link_address.map_or_else(
        || source_address(agent.index as u32 % shared.source_addresses),
        IpAddr::V4,
    );
    if let Some(join) = &shared.join {
        match join_hub(&agent, &shared, join, source, &mut stop).await {
            Ok(()) => {
                agent.tally.joined.fetch_add(1, Ordering::Relaxed);
            }
            Err(JoinError::Shutdown) => return,
            Err(e) => {
                warn!(agent = %agent.name, error = %e, "the agent could not join");
                agent.tally.join_failures.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    }
    let dial = match shared.gateways.len() {
        0 => shared.hub,
        n => shared.gateways[agent.index % n],
    };
    let config = AgentConfig {
        hub: Some(dial.to_string()),
        server_name: Some(shared.server_name.clone()),
        cluster_name: agent.name.clone(),
        hub_name: None,
        cert_dir: Some(agent.identity_dir.clone()),
        proxy_url: None,
        kubeconfig: None,
        data_dir: agent.identity_dir.clone(),
        resync_interval: RESYNC_INTERVAL,
        quic_congestion: shared.quic_congestion,
        apply_concurrency: DEFAULT_APPLY_CONCURRENCY,
        feedback_interval: shared.feedback_interval,
        // The ramp spaces the agents out already.
        initial_jitter: Duration::ZERO,
        max_backoff: shared.max_backoff,
        kubernetes_version: SIM_KUBERNETES_VERSION.into(),
        transport: shared.transport.agent(),
        max_tunnels: flotilla_agent::tunnel::DEFAULT_MAX_TUNNELS,
        tunnel_idle_timeout: flotilla_agent::tunnel::DEFAULT_TUNNEL_IDLE_TIMEOUT,
        spoke_kube_api_qps: flotilla_agent::config::DEFAULT_SPOKE_KUBE_API_QPS,
        spoke_kube_api_burst: flotilla_agent::config::DEFAULT_SPOKE_KUBE_API_BURST,
        failover_order: Vec::new(),
        hub_unreachable_timeout: Duration::from_secs(300),
        ops: Default::default(),
    };
    let dialer = match Dialer::new(&dial.to_string(), &shared.server_name, &agent.identity_dir) {
        Ok(d) => {
            let d = d
                .with_local_address(Some(source))
                .with_transport(config.transport);
            let slot = agent.index % shared.quic.len().max(1);
            match shared.quic.get(slot) {
                Some(client) => d.with_quic_client(client.clone()),
                None => d,
            }
        }
        Err(e) => {
            warn!(agent = %agent.name, error = %format!("{e:#}"), "cannot start the agent");
            return;
        }
    };
    let (_, kubernetes_version) = watch::channel(config.kubernetes_version.clone());
    // A simulated cluster has no nodes or ClusterClaims to report beyond the hello's version.
    let (_, cluster_info) = watch::channel(wire::ClusterInfo::default());
    let parts = Parts {
        dialer,
        cache: agent.cache.clone(),
        target: agent.cluster.clone(),
        spoke_api: shared.spoke_api.clone(),
        kubernetes_version,
        cluster_info,
        observer: agent.clone(),
        seed: Some(shared.seed.wrapping_add(agent.index as u64)),
        metrics: Default::default(),
        applied_once: flotilla_ops::ReadyFlag::new(
            "the first apply pass (nobody probes these agents)",
        ),
    };
    let stopped = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    if let Err(e) = flotilla_agent::run_with(&config, parts, stopped).await {
        warn!(agent = %agent.name, error = %e, "the agent stopped with an error");
    }
}

/// `flotilla-agent join`: a key made here, a CSR sent with the shared token, the hub CA pinned
/// by fingerprint, the identity stored in the agent's directory.
async fn join_hub(
    agent: &SimAgent,
    shared: &Shared,
    join: &JoinSpec,
    source: IpAddr,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), JoinError> {
    let params = JoinParams {
        hub: shared.hub.to_string(),
        server_name: shared.server_name.clone(),
        cluster_name: agent.name.clone(),
        token: join
            .token
            .parse()
            .map_err(|e| JoinError::Denied(format!("the harness's bootstrap token: {e}")))?,
        ca_fingerprint: join.ca_fingerprint.clone(),
        labels: Vec::new(),
        proxy: None,
        local_address: Some(source),
    };
    let identity = identity::Identity::new(&agent.identity_dir);
    flotilla_agent::join::join(&params, &identity, async {
        let _ = stop.wait_for(|s| *s).await;
    })
    .await
}
