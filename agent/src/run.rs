//! The agent as a process: its parts built from the flags ([`run`]) or given ready-made
//! ([`run_with`]), and every long-lived task of it under one owner, as the gateway's are
//! (`flotilla_ops::supervise`): the reconciler and the tunnel server beside the session loop,
//! and, in the binary, the claims watcher, the spoke version reader and the metrics endpoint.
//! One that ends while the agent runs (a panic, a watch that stopped) is said at once, naming
//! it, and the agent stops with an error so that its supervisor restarts it; on shutdown the
//! session says goodbye, the tasks are told through one watch and waited for with a bound.
//!
//! The reconciler runs beside the session loop, not inside it, so the spoke is kept as desired
//! whether or not a hub is there.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use flotilla_ops::{ReadyFlag, TaskEnded, Tasks};
use flotilla_proto::wire;
use futures::FutureExt as _;
use rand::{Rng as _, SeedableRng as _};
use tokio::sync::{Notify, watch};
use tracing::{Instrument as _, error, info, warn};

use crate::apply::{ApplyTarget, KubeApplyTarget, PolicyWritesAs};
use crate::cache::{self, CacheDb, CacheError, WorkCache};
use crate::config::{AgentConfig, ConfigError};
use crate::connect::Dialer;
use crate::governance::Governor;
use crate::hubs::{HubsError, JoinedHubs};
use crate::identity::Identity;
use crate::metrics::{AgentMetrics, HubMetricFamilies};
use crate::policies::PolicyDesk;
use crate::reconcile::Reconciler;
use crate::session::{RandJitter, hold_session};
use crate::spoke::{Observer, Spoke, Unobserved};
use crate::spoke_api::{KubeSpoke, SpokeApi};
use crate::tunnel::TunnelServer;

/// How long one read of the spoke's `/version` may take.
const VERSION_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause between reads of the spoke's `/version` while it does not answer.
const VERSION_RETRY: Duration = Duration::from_secs(30);
/// How long the agent's tasks get to stop once told; what is left is aborted (a reconcile in
/// flight is idempotent and runs again at the next start).
pub(crate) const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the agent could not start, or stopped. None is retryable without a change: the message
/// says what to fix.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A flag is wrong. Not retryable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// `--metrics-addr` cannot be listened on. Not retryable without another address.
    #[error(transparent)]
    Metrics(#[from] flotilla_ops::EndpointError),
    /// The certificates in `--cert-dir` cannot be used. Not retryable. The error says which
    /// file and why, its sources the cause below.
    #[error(transparent)]
    Certificates(Box<dyn std::error::Error + Send + Sync + 'static>),
    /// The cache in `--data-dir` cannot be opened. Not retryable.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// The spoke client cannot be built from its kubeconfig. Not retryable.
    #[error("cannot build a client for the spoke apiserver: {0}")]
    SpokeClient(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
    /// The hubs joined in `--data-dir` cannot be read. Not retryable without a fix the error
    /// names.
    #[error(transparent)]
    Hubs(#[from] HubsError),
    /// A task the agent cannot work without (the reconciler, the tunnel server, the claims
    /// watcher, the metrics endpoint) panicked or ended on its own. Not retryable in-process:
    /// the agent exits non-zero so that its supervisor starts it again.
    #[error(transparent)]
    TaskEnded(#[from] TaskEnded),
}

/// The parts [`run_with`] runs on. [`run`] makes them from the agent's flags; the load-test
/// harness makes thousands, sharing one cache database and simulated clusters.
#[derive(Clone)]
pub struct Parts {
    /// Opens connections to the hub.
    pub dialer: Dialer,
    /// This cluster's durable cache.
    pub cache: Arc<dyn WorkCache>,
    /// Where works are applied.
    pub target: Arc<dyn ApplyTarget>,
    /// Where kubectl requests from the hub's proxy front go (the spoke apiserver).
    pub spoke_api: Arc<dyn SpokeApi>,
    /// The spoke's Kubernetes version for the hello; empty until known.
    pub kubernetes_version: watch::Receiver<String>,
    /// What the agent reports about its spoke (claims, version, resources), kept current by
    /// `claims::collect`; each change is sent to the hub.
    pub cluster_info: watch::Receiver<wire::ClusterInfo>,
    /// Told what the session does.
    pub observer: Arc<dyn Observer>,
    /// Seeds the reconnect and resync jitter, for runs that must repeat; `None` draws from
    /// the operating system.
    pub seed: Option<u64>,
    /// Where the session and the reconciler count what they do (`/metrics`).
    pub metrics: AgentMetrics,
    /// Raised once the works cached at start have all been applied once (`/readyz`).
    pub applied_once: ReadyFlag,
}

/// Runs the agent until `shutdown` completes: opens the cache, starts the reconciler on the
/// spoke apiserver, and keeps a session with the hub (`--hub`), or with every hub joined in
/// the data directory ([`crate::hubs`]), each with its own set of tasks beside one spoke client,
/// claims watcher, cache file and metrics endpoint.
pub async fn run(
    config: AgentConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RunError> {
    config.validate()?;
    let served = served_hubs(&config)?;
    let joined_names: Vec<String> = served
        .iter()
        .filter(|(_, _, joined)| *joined)
        .filter_map(|(hub, _, _)| hub.hub_name.clone())
        .collect();
    let failover = config.failover(&joined_names)?;
    // In failover mode one hub is served at a time: ready once the active one's first apply
    // pass is done, whichever it is.
    let one_ready = failover.as_ref().map(|_| {
        ReadyFlag::new(
            "the active hub's cached works have not all been applied once since the agent started",
        )
    });
    // Every request of the agent's own client takes a token of its spoke budget first: one
    // budget for the process, however many hubs it serves.
    let spoke_kube_api = config.spoke_kube_api();
    let client = kube::client::ClientBuilder::try_from(config.spoke_kube_config().await?)
        .map_err(|e| RunError::SpokeClient(e.into()))?
        .with_layer(&spoke_kube_api)
        .build();
    cache::retire_sled_cache(&config.sled_cache_dir());
    let db = CacheDb::open(&config.cache_path())?;
    let spoke_api: Arc<dyn SpokeApi> = Arc::new(
        KubeSpoke::new(&config.spoke_kube_config().await?)
            .map_err(|e| RunError::SpokeClient(e.into()))?,
    );
    let (stop, _) = watch::channel(false);
    let mut tasks = Tasks::new();
    let (version_tx, kubernetes_version) = watch::channel(config.kubernetes_version.clone());
    if config.kubernetes_version.is_empty() {
        let read = read_spoke_version(client.clone(), version_tx);
        // Done once it has read the version: it then waits for the stop like every task.
        tasks.spawn(
            "the spoke version reader",
            until_stopped(stop.subscribe(), read.then(|()| std::future::pending())),
        );
    }
    let (cluster_info, claims) = crate::claims::collect(client.clone(), kubernetes_version.clone());
    tasks.spawn(
        "the claims watcher",
        until_stopped(stop.subscribe(), claims),
    );
    // Each joined hub's series carry its name; an agent of one hub keeps its series as they were.
    let families = HubMetricFamilies::default();
    let mut hubs = Vec::with_capacity(served.len());
    for (hub_config, partition, joined) in served {
        let metrics = match (&hub_config.hub_name, joined) {
            (Some(name), true) => families.for_hub(name),
            _ => AgentMetrics::default(),
        };
        let identity = Identity::new(hub_config.identity_dir());
        identity
            .recover()
            .map_err(|e| RunError::Certificates(e.into()))?;
        let dialer = Dialer::new(
            hub_config.hub_address()?,
            &hub_config.server_name(),
            identity.dir(),
        )
        .map_err(|e| RunError::Certificates(e.into()))?
        .with_proxy(hub_config.proxy_url.clone())
        .with_transport(hub_config.transport)
        .with_quic_congestion(hub_config.quic_congestion);
        let parts = Parts {
            dialer,
            cache: Arc::new(db.cluster(&partition)),
            target: Arc::new(KubeApplyTarget::new(client.clone())),
            spoke_api: Arc::clone(&spoke_api),
            kubernetes_version: kubernetes_version.clone(),
            cluster_info: cluster_info.clone(),
            observer: Arc::new(Unobserved),
            seed: None,
            metrics,
            applied_once: one_ready.clone().unwrap_or_else(|| {
                ReadyFlag::new(
                    "the works in the cache have not all been applied once since the agent started",
                )
            }),
        };
        hubs.push(ServedHub {
            config: hub_config,
            parts,
            joined,
        });
    }
    if let Some(address) = config.ops.metrics_addr {
        let listener = flotilla_ops::endpoint::bind(address).await?;
        info!(address = %address, "serving /metrics, /healthz and /readyz");
        let mut registry = flotilla_ops::registry();
        match hubs.as_slice() {
            [hub] if !hub.joined => hub.parts.metrics.register(&mut registry),
            _ => families.register(&mut registry),
        }
        spoke_kube_api.register(&mut registry);
        let outboxes: Vec<_> = hubs
            .iter()
            .map(|h| (Arc::clone(&h.parts.cache), h.parts.metrics.clone()))
            .collect();
        // The cache is open (or the agent would have stopped above): ready once every hub's
        // start apply pass is done.
        let endpoint = flotilla_ops::Endpoint::new(
            registry,
            flotilla_ops::Readiness::new(hubs.iter().map(|h| h.parts.applied_once.clone())),
        )
        .refresh_with(move || {
            for (outbox, depth) in &outboxes {
                if let Ok(pending) = outbox.pending_statuses() {
                    depth.outbox_depth.set(pending.len() as i64);
                }
                if let Ok((count, bytes)) = outbox.chunk_totals() {
                    depth.chunks_held.set(count as i64);
                    depth.chunk_bytes_held.set(bytes as i64);
                }
            }
        });
        tasks.spawn(
            "the metrics endpoint",
            flotilla_ops::serve(listener, Arc::new(endpoint), stopped(stop.subscribe())).map(Ok),
        );
    }
    match failover {
        Some(failover) => {
            let serving =
                crate::failover::serve(hubs, failover, config.data_dir.clone(), stop.subscribe());
            tasks.spawn("the hub failover", serving);
            supervise(Vec::new(), tasks, stop, shutdown).await
        }
        None => supervise(hubs, tasks, stop, shutdown).await,
    }
}

/// The hubs this process serves, each with its configuration, its cache partition and whether
/// it is one of the data directory's joined hubs: `--hub` alone, or every joined hub.
fn served_hubs(config: &AgentConfig) -> Result<Vec<(AgentConfig, String, bool)>, RunError> {
    let joined = JoinedHubs::in_data_dir(&config.data_dir);
    let hubs = joined.list()?;
    match (&config.hub, hubs.is_empty()) {
        (Some(_), true) => Ok(vec![(config.clone(), config.cluster_name.clone(), false)]),
        (Some(hub), false) => Err(ConfigError::HubWithJoinedHubs {
            hub: hub.clone(),
            dir: joined.dir().display().to_string(),
        }
        .into()),
        (None, true) => Err(ConfigError::NoHub.into()),
        (None, false) if config.hub_name.is_some() => Err(ConfigError::HubNameWithJoinedHubs {
            dir: joined.dir().display().to_string(),
        }
        .into()),
        (None, false) => {
            info!(hubs = %hubs.iter().map(|h| h.name.as_str()).collect::<Vec<_>>().join(","), "serving the hubs joined in the data directory");
            Ok(hubs
                .iter()
                .map(|hub| {
                    (
                        config.for_hub(&joined, hub),
                        crate::hubs::cache_partition(&hub.name, &config.cluster_name),
                        true,
                    )
                })
                .collect())
        }
    }
}

/// One hub the process serves: its configuration (address, identity, field managers) and its
/// parts; `joined` when it is one of the data directory's hubs, whose tasks are then named
/// after it.
#[derive(Clone)]
pub(crate) struct ServedHub {
    pub(crate) config: AgentConfig,
    pub(crate) parts: Parts,
    joined: bool,
}

/// Runs the agent on `parts` until `shutdown` completes: the reconciler and the tunnel server
/// beside the session loop, as [`run`] does. Of `config` it uses the cluster name, the
/// identity directory (read for each session, renewed in place), the reconciler settings and
/// the backoff.
pub async fn run_with(
    config: &AgentConfig,
    parts: Parts,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RunError> {
    let (stop, _) = watch::channel(false);
    let hub = ServedHub {
        config: config.clone(),
        parts,
        joined: false,
    };
    supervise(vec![hub], Tasks::new(), stop, shutdown).await
}

/// Each hub's session loop, reconciler, policy governor, policy desk and tunnel server beside
/// `tasks`, until `shutdown` completes or a task ends. No hub's tasks wait on another's: each
/// is its own task, and a hub that cannot be reached only keeps its own session dialling.
async fn supervise(
    hubs: Vec<ServedHub>,
    mut tasks: Tasks,
    stop: watch::Sender<bool>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RunError> {
    for hub in hubs {
        start_hub(hub, &mut tasks, &stop)?;
    }
    tokio::pin!(shutdown);
    let fault = tokio::select! {
        // The sessions say goodbye to their hubs; the tasks stop with them.
        () = &mut shutdown => None,
        ended = tasks.first_end() => {
            error!(error = %ended, "a task the agent cannot work without ended; the agent stops so that its supervisor starts it again");
            Some(ended)
        }
    };
    stop.send_replace(true);
    let aborted = tasks.stop_within(STOP_TIMEOUT).await;
    if aborted > 0 {
        warn!(aborted, timeout = ?STOP_TIMEOUT, "tasks still running after the stop deadline were aborted");
    }
    match fault {
        Some(ended) => Err(ended.into()),
        None => Ok(()),
    }
}

/// Starts one hub's session loop, reconciler, policy governor, policy desk and tunnel server
/// under `tasks`, told to stop through `stop`.
pub(crate) fn start_hub(
    hub: ServedHub,
    tasks: &mut Tasks,
    stop: &watch::Sender<bool>,
) -> Result<(), RunError> {
    let ServedHub {
        config,
        parts,
        joined,
    } = hub;
    let Parts {
        dialer,
        cache,
        target,
        spoke_api,
        kubernetes_version,
        cluster_info,
        observer,
        seed,
        metrics,
        applied_once,
    } = parts;
    let hub_name = config.hub_name.clone().filter(|_| joined);
    let span = match &hub_name {
        Some(name) => tracing::info_span!("hub", hub = %name),
        None => tracing::Span::none(),
    };
    let named = |task: &'static str| task_name(task, hub_name.as_deref());
    let mut seeds = match seed {
        Some(seed) => rand::rngs::StdRng::seed_from_u64(seed),
        None => rand::rngs::StdRng::from_os_rng(),
    };
    let reconciler_rng = rand::rngs::StdRng::seed_from_u64(seeds.random());
    let outbox_changed = Arc::new(Notify::new());
    // Policies are evaluated on the same spoke the works are applied to, beside them.
    // Validated at start; a config built in code that names a bad hub stops here too.
    let managers = config.field_managers().map_err(ConfigError::from)?;
    let (governor, governor_handle, reports) =
        Governor::new(PolicyWritesAs::wrap(Arc::clone(&target), &managers));
    tasks.spawn(
        named("the policy governor"),
        governor
            .run(stopped(stop.subscribe()))
            .map(Ok)
            .instrument(span.clone()),
    );
    let (desk, policies) = PolicyDesk::new(
        Arc::clone(&cache),
        governor_handle,
        reports,
        Arc::clone(&outbox_changed),
    );
    tasks.spawn(
        named("the policy desk"),
        desk.run(stopped(stop.subscribe()))
            .map(Ok)
            .instrument(span.clone()),
    );
    let (reconciler, handle) = Reconciler::new(
        Arc::clone(&cache),
        target,
        config.reconciler(),
        Arc::clone(&outbox_changed),
        Box::new(RandJitter(reconciler_rng)),
    );
    let reconciler = reconciler
        .with_metrics(metrics.clone())
        .with_first_pass(applied_once)
        .with_field_managers(managers);
    tasks.spawn(
        named("the reconciler"),
        reconciler
            .run(stopped(stop.subscribe()))
            .map(Ok)
            .instrument(span.clone()),
    );
    // Tunnels run beside the session, never in its loop; they end with the agent.
    let (tunnel_server, tunnels) = TunnelServer::new(config.tunnels(), spoke_api);
    tasks.spawn(
        named("the tunnel server"),
        tunnel_server
            .run(stop.subscribe())
            .map(Ok)
            .instrument(span.clone()),
    );
    let spoke = Spoke {
        cache,
        reconciler: handle,
        policies,
        outbox_changed,
        kubernetes_version,
        cluster_info,
        observer,
        tunnels,
        metrics,
    };
    let jitter = RandJitter(rand::rngs::StdRng::seed_from_u64(seeds.random()));
    let stopping = stop.subscribe();
    // The session ends only when told to stop, after its goodbye.
    let session = async move {
        hold_session(&config, &dialer, &spoke, jitter, stopping).await;
        Ok(())
    };
    tasks.spawn(named("the session loop"), session.instrument(span));
    Ok(())
}

/// Names of joined hubs' tasks, made once each and kept for the process: at most
/// [`crate::hubs::MAX_HUBS`] hubs, five tasks each, however often failover mode moves between
/// them. A blocking lock held for one set operation, never across an await.
#[allow(clippy::disallowed_types)]
static TASK_NAMES: std::sync::Mutex<BTreeSet<&'static str>> =
    std::sync::Mutex::new(BTreeSet::new());

/// `task`'s name, or, for a task of a joined hub, `task` of that hub.
fn task_name(task: &'static str, hub: Option<&str>) -> &'static str {
    let Some(hub) = hub else {
        return task;
    };
    let name = format!("{task} of hub {hub}");
    let mut names = TASK_NAMES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(known) = names.get(name.as_str()) {
        return known;
    }
    let name: &'static str = Box::leak(name.into_boxed_str());
    names.insert(name);
    name
}

/// Resolves once `stop` turns true (or its sender is gone).
pub(crate) async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

/// A supervised task that runs `task` until `stop`: `Ok` when told to stop; if `task` ends
/// first, that end is the task stopping on its own, which its owner reports.
async fn until_stopped(
    stop: watch::Receiver<bool>,
    task: impl Future<Output = ()> + Send + 'static,
) -> flotilla_ops::TaskResult {
    tokio::select! {
        () = task => Ok(()),
        () = stopped(stop) => Ok(()),
    }
}

/// Reads the spoke's version until it answers; the apiserver may come up after the agent.
async fn read_spoke_version(client: kube::Client, version: watch::Sender<String>) {
    let mut warned = false;
    loop {
        match tokio::time::timeout(VERSION_TIMEOUT, client.apiserver_version()).await {
            Ok(Ok(info)) => {
                info!(version = %info.git_version, "spoke apiserver version");
                let _ = version.send(info.git_version);
                return;
            }
            Ok(Err(e)) if !warned => {
                warn!(error = %e, "cannot read the spoke apiserver's version; retrying")
            }
            Err(_) if !warned => {
                warn!(timeout = ?VERSION_TIMEOUT, "the spoke apiserver's /version did not answer; retrying")
            }
            _ => {}
        }
        warned = true;
        tokio::time::sleep(VERSION_RETRY).await;
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

    use super::*;
    use crate::apply::MemoryCluster;
    use crate::cache::{AppliedResource, CachedWork, ClusterCache, PendingStatus, StatusRecord};
    use crate::connect::Transport;

    /// A cache whose list of works panics, as a reader crashing on a record might: the
    /// reconciler lists the works at start, the session only on its own blocking threads.

    #[test]
    fn a_hubs_task_names_are_made_once_however_often_its_tasks_start() {
        let first = task_name("the reconciler", Some("department"));
        assert_eq!(first, "the reconciler of hub department");
        let again = task_name("the reconciler", Some("department"));
        assert!(
            std::ptr::eq(first, again),
            "a second start made the name again"
        );
        assert_eq!(task_name("the reconciler", None), "the reconciler");
    }
    #[derive(Debug)]
    struct Poisoned(ClusterCache);

    impl WorkCache for Poisoned {
        fn works(&self) -> Result<Vec<CachedWork>, CacheError> {
            panic!("the cache's records are poisoned")
        }
        fn work(&self, uid: &str) -> Result<Option<CachedWork>, CacheError> {
            self.0.work(uid)
        }
        fn manifest_work(&self, uid: &str) -> Result<Option<Vec<u8>>, CacheError> {
            self.0.manifest_work(uid)
        }
        fn put_work(&self, work: &CachedWork, content: Option<&[u8]>) -> Result<(), CacheError> {
            self.0.put_work(work, content)
        }
        fn mark_deleting(&self, uid: &str) -> Result<bool, CacheError> {
            self.0.mark_deleting(uid)
        }
        fn forget(&self, uid: &str) -> Result<(), CacheError> {
            self.0.forget(uid)
        }
        fn release(&self, uid: &str) -> Result<(), CacheError> {
            self.0.release(uid)
        }
        fn pending_releases(&self) -> Result<Vec<String>, CacheError> {
            self.0.pending_releases()
        }
        fn ack_release(&self, uid: &str) -> Result<(), CacheError> {
            self.0.ack_release(uid)
        }
        fn ledger(&self, uid: &str) -> Result<Vec<AppliedResource>, CacheError> {
            self.0.ledger(uid)
        }
        fn ledgers(&self) -> Result<Vec<(String, Vec<AppliedResource>)>, CacheError> {
            self.0.ledgers()
        }
        fn set_ledger(&self, uid: &str, resources: &[AppliedResource]) -> Result<(), CacheError> {
            self.0.set_ledger(uid, resources)
        }
        fn last_status(&self, uid: &str) -> Result<Option<StatusRecord>, CacheError> {
            self.0.last_status(uid)
        }
        fn push_status(
            &self,
            uid: &str,
            generation: i64,
            status: &serde_json::Value,
        ) -> Result<u64, CacheError> {
            self.0.push_status(uid, generation, status)
        }
        fn pending_statuses(&self) -> Result<Vec<PendingStatus>, CacheError> {
            self.0.pending_statuses()
        }
        fn ack_status(&self, uid: &str, seq: u64) -> Result<bool, CacheError> {
            self.0.ack_status(uid, seq)
        }
        fn chunk(&self, sha256: &str) -> Result<Option<Vec<u8>>, CacheError> {
            self.0.chunk(sha256)
        }
        fn put_chunk(&self, sha256: &str, data: &[u8]) -> Result<bool, CacheError> {
            self.0.put_chunk(sha256, data)
        }
        fn begin_fetch(&self, uid: &str, chunks: &[String]) -> Result<Vec<String>, CacheError> {
            self.0.begin_fetch(uid, chunks)
        }
        fn end_fetch(&self, uid: &str) -> Result<u64, CacheError> {
            self.0.end_fetch(uid)
        }
        fn fetches(&self) -> Result<Vec<String>, CacheError> {
            self.0.fetches()
        }
        fn end_fetches(&self, keep: &[String]) -> Result<u64, CacheError> {
            self.0.end_fetches(keep)
        }
        fn chunk_totals(&self) -> Result<(u64, u64), CacheError> {
            self.0.chunk_totals()
        }
    }

    /// A client certificate for `cluster` and its CA in `dir`, as a joined agent holds them.
    fn identity(dir: &Path, cluster: &str) {
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::default();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
        let issuer = Issuer::new(ca, ca_key);
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, cluster);
        let cert = params.signed_by(&key, &issuer).unwrap();
        std::fs::write(dir.join("ca.crt"), ca_pem).unwrap();
        std::fs::write(dir.join("tls.crt"), cert.pem()).unwrap();
        std::fs::write(dir.join("tls.key"), key.serialize_pem()).unwrap();
    }

    /// The flags of an agent of cluster store-7 with its data in `dir`.
    fn test_config(dir: &Path, hub: Option<String>, certs: &Path) -> AgentConfig {
        AgentConfig {
            hub,
            server_name: Some("localhost".into()),
            cluster_name: "store-7".into(),
            hub_name: None,
            cert_dir: Some(certs.to_path_buf()),
            proxy_url: None,
            kubeconfig: None,
            data_dir: dir.join("data"),
            resync_interval: Duration::from_secs(300),
            apply_concurrency: 4,
            initial_jitter: Duration::ZERO,
            max_backoff: Duration::from_secs(1),
            kubernetes_version: "v1.36.3".into(),
            transport: Transport::Grpc,
            quic_congestion: Default::default(),
            feedback_interval: crate::reconcile::DEFAULT_FEEDBACK_INTERVAL,
            max_tunnels: crate::tunnel::DEFAULT_MAX_TUNNELS,
            tunnel_idle_timeout: crate::tunnel::DEFAULT_TUNNEL_IDLE_TIMEOUT,
            spoke_kube_api_qps: crate::config::DEFAULT_SPOKE_KUBE_API_QPS,
            spoke_kube_api_burst: crate::config::DEFAULT_SPOKE_KUBE_API_BURST,
            failover_order: Vec::new(),
            hub_unreachable_timeout: Duration::from_secs(300),
            ops: Default::default(),
        }
    }

    #[test]
    fn a_data_directory_serves_its_one_hub_or_its_joined_hubs_never_both() {
        let dir = tempfile::tempdir().unwrap();
        let certs = dir.path().join("certs");
        let check = |hub: Option<&str>, hub_name: Option<&str>| {
            let mut config = test_config(dir.path(), hub.map(str::to_owned), &certs);
            config.hub_name = hub_name.map(str::to_owned);
            served_hubs(&config).map_err(|e| e.to_string())
        };
        // An agent of one hub: its cluster's partition, its flags as given.
        let one = check(Some("hub:443"), None).unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!((one[0].1.as_str(), one[0].2), ("store-7", false));
        assert!(
            check(None, None)
                .unwrap_err()
                .starts_with("no hub to serve")
        );

        let hubs = JoinedHubs::in_data_dir(&dir.path().join("data"));
        for name in ["department", "central-it"] {
            let identity = hubs.identity(name);
            std::fs::create_dir_all(identity.dir()).unwrap();
            self::identity(identity.dir(), "store-7");
            hubs.record(&crate::hubs::JoinedHub {
                name: name.into(),
                address: format!("{name}.example:443"),
                server_name: format!("{name}.example"),
            })
            .unwrap();
        }
        let joined = check(None, None).unwrap();
        let served: Vec<_> = joined
            .iter()
            .map(|(config, partition, joined)| {
                (
                    config.hub.clone().unwrap(),
                    config.hub_name.clone().unwrap(),
                    config.identity_dir(),
                    partition.clone(),
                    *joined,
                )
            })
            .collect();
        assert_eq!(
            served,
            [
                (
                    "central-it.example:443".to_owned(),
                    "central-it".to_owned(),
                    hubs.identity("central-it").dir().to_path_buf(),
                    "central-it/store-7".to_owned(),
                    true
                ),
                (
                    "department.example:443".to_owned(),
                    "department".to_owned(),
                    hubs.identity("department").dir().to_path_buf(),
                    "department/store-7".to_owned(),
                    true
                ),
            ]
        );
        let both = check(Some("hub:443"), None).unwrap_err();
        assert!(
            both.starts_with(
                "--hub hub:443 is given, but this data directory serves the hubs joined in"
            ),
            "{both}"
        );
        let named = check(None, Some("department")).unwrap_err();
        assert!(
            named.starts_with("--hub-name is given without --hub"),
            "{named}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reconciler_that_panics_is_reported_at_once_with_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let certs = dir.path().join("certs");
        std::fs::create_dir_all(&certs).unwrap();
        identity(&certs, "store-7");
        // No hub answers: the session loop keeps dialling, the agent keeps running.
        let hub = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().to_string()
        };
        let config = test_config(dir.path(), Some(hub.clone()), &certs);
        let db = CacheDb::temporary().unwrap();
        let (_, kubernetes_version) = watch::channel("v1.36.3".to_string());
        let (_, cluster_info) = watch::channel(wire::ClusterInfo::default());
        let parts = Parts {
            dialer: Dialer::new(&hub, "localhost", &certs).unwrap(),
            cache: Arc::new(Poisoned(db.cluster("store-7"))),
            target: Arc::new(MemoryCluster::new()),
            spoke_api: Arc::new(crate::SimulatedApi::new(10)),
            kubernetes_version,
            cluster_info,
            observer: Arc::new(Unobserved),
            seed: Some(7),
            metrics: AgentMetrics::default(),
            applied_once: ReadyFlag::new("the first apply pass (nobody probes this agent)"),
        };
        // The shutdown never comes: the agent stops because the reconciler is gone, while it
        // runs, not at an exit that would have found it.
        let ended = tokio::time::timeout(
            Duration::from_secs(60),
            run_with(&config, parts, std::future::pending()),
        )
        .await
        .expect("the agent ran on without its reconciler");
        let Err(error) = ended else {
            panic!("the agent stopped as if asked to");
        };
        assert!(
            matches!(
                &error,
                RunError::TaskEnded(TaskEnded::Failed {
                    task: "the reconciler",
                    ..
                })
            ),
            "{error:?}"
        );
        assert_eq!(
            error.to_string(),
            "the reconciler failed: panicked: the cache's records are poisoned"
        );
    }
}
