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

use std::sync::Arc;
use std::time::Duration;

use flotilla_ops::{ReadyFlag, TaskEnded, Tasks};
use flotilla_proto::wire;
use futures::FutureExt as _;
use rand::{Rng as _, SeedableRng as _};
use tokio::sync::{Notify, watch};
use tracing::{error, info, warn};

use crate::apply::{ApplyTarget, KubeApplyTarget, PolicyWritesAs};
use crate::cache::{self, CacheDb, CacheError, WorkCache};
use crate::config::{AgentConfig, ConfigError};
use crate::connect::Dialer;
use crate::governance::Governor;
use crate::identity::Identity;
use crate::metrics::AgentMetrics;
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
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

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
    /// A task the agent cannot work without (the reconciler, the tunnel server, the claims
    /// watcher, the metrics endpoint) panicked or ended on its own. Not retryable in-process:
    /// the agent exits non-zero so that its supervisor starts it again.
    #[error(transparent)]
    TaskEnded(#[from] TaskEnded),
}

/// The parts [`run_with`] runs on. [`run`] makes them from the agent's flags; the load-test
/// harness makes thousands, sharing one cache database and simulated clusters.
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
/// spoke apiserver, and keeps a session with the hub.
pub async fn run(
    config: AgentConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RunError> {
    config.validate()?;
    let identity = Identity::new(config.identity_dir());
    identity
        .recover()
        .map_err(|e| RunError::Certificates(e.into()))?;
    let dialer = Dialer::new(&config.hub, &config.server_name(), identity.dir())
        .map_err(|e| RunError::Certificates(e.into()))?
        .with_proxy(config.proxy_url.clone())
        .with_transport(config.transport)
        .with_quic_congestion(config.quic_congestion);
    // Every request of the agent's own client takes a token of its spoke budget first.
    let spoke_kube_api = config.spoke_kube_api();
    let client = kube::client::ClientBuilder::try_from(config.spoke_kube_config().await?)
        .map_err(|e| RunError::SpokeClient(e.into()))?
        .with_layer(&spoke_kube_api)
        .build();
    cache::retire_sled_cache(&config.sled_cache_dir());
    let db = CacheDb::open(&config.cache_path())?;
    let cache: Arc<dyn WorkCache> = Arc::new(db.cluster(&config.cluster_name));
    let target: Arc<dyn ApplyTarget> = Arc::new(KubeApplyTarget::new(client.clone()));
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
    let (cluster_info, claims) = crate::claims::collect(client, kubernetes_version.clone());
    tasks.spawn(
        "the claims watcher",
        until_stopped(stop.subscribe(), claims),
    );
    let metrics = AgentMetrics::default();
    let applied_once = ReadyFlag::new(
        "the works in the cache have not all been applied once since the agent started",
    );
    if let Some(address) = config.ops.metrics_addr {
        let listener = flotilla_ops::endpoint::bind(address).await?;
        info!(address = %address, "serving /metrics, /healthz and /readyz");
        let mut registry = flotilla_ops::registry();
        metrics.register(&mut registry);
        spoke_kube_api.register(&mut registry);
        let (outbox, depth) = (Arc::clone(&cache), metrics.clone());
        // The cache is open (or the agent would have stopped above): ready once the start's
        // apply pass is done.
        let endpoint = flotilla_ops::Endpoint::new(
            registry,
            flotilla_ops::Readiness::new([applied_once.clone()]),
        )
        .refresh_with(move || {
            if let Ok(pending) = outbox.pending_statuses() {
                depth.outbox_depth.set(pending.len() as i64);
            }
            if let Ok((count, bytes)) = outbox.chunk_totals() {
                depth.chunks_held.set(count as i64);
                depth.chunk_bytes_held.set(bytes as i64);
            }
        });
        tasks.spawn(
            "the metrics endpoint",
            flotilla_ops::serve(listener, Arc::new(endpoint), stopped(stop.subscribe())).map(Ok),
        );
    }
    let parts = Parts {
        dialer,
        cache,
        target,
        spoke_api,
        kubernetes_version,
        cluster_info,
        observer: Arc::new(Unobserved),
        seed: None,
        metrics,
        applied_once,
    };
    supervise(&config, parts, tasks, stop, shutdown).await
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
    supervise(config, parts, Tasks::new(), stop, shutdown).await
}

/// The session loop beside `tasks` (with the reconciler and the tunnel server added), until
/// `shutdown` completes or a task ends.
async fn supervise(
    config: &AgentConfig,
    parts: Parts,
    mut tasks: Tasks,
    stop: watch::Sender<bool>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RunError> {
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
        "the policy governor",
        governor.run(stopped(stop.subscribe())).map(Ok),
    );
    let (desk, policies) = PolicyDesk::new(
        Arc::clone(&cache),
        governor_handle,
        reports,
        Arc::clone(&outbox_changed),
    );
    tasks.spawn(
        "the policy desk",
        desk.run(stopped(stop.subscribe())).map(Ok),
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
        "the reconciler",
        reconciler.run(stopped(stop.subscribe())).map(Ok),
    );
    // Tunnels run beside the session, never in its loop; they end with the agent.
    let (tunnel_server, tunnels) = TunnelServer::new(config.tunnels(), spoke_api);
    tasks.spawn(
        "the tunnel server",
        tunnel_server.run(stop.subscribe()).map(Ok),
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
    let session = hold_session(config, &dialer, &spoke, jitter, stop.subscribe());
    tokio::pin!(session, shutdown);
    let mut fault = None;
    loop {
        let stopping = *stop.borrow();
        tokio::select! {
            () = &mut session => break,
            // The session says goodbye to the hub; the tasks stop with it.
            () = &mut shutdown, if !stopping => {
                stop.send_replace(true);
            }
            ended = tasks.first_end(), if !stopping => {
                error!(error = %ended, "a task the agent cannot work without ended; the agent stops so that its supervisor starts it again");
                fault = Some(ended);
                stop.send_replace(true);
            }
        }
    }
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
        let config = AgentConfig {
            hub: hub.clone(),
            server_name: Some("localhost".into()),
            cluster_name: "store-7".into(),
            hub_name: None,
            cert_dir: Some(certs.clone()),
            proxy_url: None,
            kubeconfig: None,
            data_dir: dir.path().join("data"),
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
            ops: Default::default(),
        };
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
