//! The agent's reconnect loop: connect, drive one session until it ends (`driver`), back off,
//! reconnect. Everything that needs a decision lives in `flotilla_proto::session` (the
//! reconnect policy in its `Reconnect` machine); this file holds the loop and the parts the
//! driver works on.
//!
//! The reconciler runs beside the session loop, not inside it, so the spoke is kept as desired
//! whether or not a hub is there.

use std::sync::Arc;
use std::time::Duration;

use flotilla_proto::session::{Jitter, Reconnect, SessionEnd, Target};
use flotilla_proto::wire;
use rand::{Rng as _, SeedableRng as _};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use crate::apply::{ApplyTarget, KubeApplyTarget};
use crate::cache::{self, CacheDb, CacheError, WorkCache};
use crate::config::{AgentConfig, ConfigError};
use crate::connect::Dialer;
use crate::driver::{Ended, session_once};
use crate::identity::Identity;
use crate::metrics::AgentMetrics;
use crate::reconcile::Reconciler;
use crate::refusal::RefusalKind;
use crate::spoke::{Observer, Spoke, Unobserved};
use crate::spoke_api::{KubeSpoke, SpokeApi};
use crate::tunnel::TunnelServer;
use flotilla_ops::ReadyFlag;

pub use crate::connect::MAX_FRAME_BYTES;
/// How long one read of the spoke's `/version` may take.
const VERSION_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause between reads of the spoke's `/version` while it does not answer.
const VERSION_RETRY: Duration = Duration::from_secs(30);

/// Why the agent could not start. None is retryable without a change: the message says what
/// to fix.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A flag is wrong. Not retryable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// `--metrics-addr` cannot be listened on. Not retryable without another address.
    #[error(transparent)]
    Metrics(#[from] flotilla_ops::EndpointError),
    /// The certificates in `--cert-dir` cannot be used. Not retryable.
    #[error("{0}")]
    Certificates(String),
    /// The cache in `--data-dir` cannot be opened. Not retryable.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// The spoke client cannot be built from its kubeconfig. Not retryable.
    #[error("cannot build a client for the spoke apiserver: {0}")]
    SpokeClient(String),
}

/// `rand` behind the protocol's jitter interface.
pub(crate) struct RandJitter<R>(pub R);

impl<R: rand::Rng> Jitter for RandJitter<R> {
    fn uniform(&mut self, max: Duration) -> Duration {
        if max.is_zero() {
            return Duration::ZERO;
        }
        Duration::from_nanos(
            self.0
                .random_range(0..=max.as_nanos().min(u64::MAX as u128) as u64),
        )
    }
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
        .map_err(|e| RunError::Certificates(e.to_string()))?;
    let dialer = Dialer::new(&config.hub, &config.server_name(), identity.dir())
        .map_err(|e| RunError::Certificates(format!("{e:#}")))?
        .with_proxy(config.proxy_url.clone())
        .with_transport(config.transport);
    // Every request of the agent's own client takes a token of its spoke budget first.
    let spoke_kube_api = config.spoke_kube_api();
    let client = kube::client::ClientBuilder::try_from(config.spoke_kube_config().await?)
        .map_err(|e| RunError::SpokeClient(e.to_string()))?
        .with_layer(&spoke_kube_api)
        .build();
    cache::retire_sled_cache(&config.sled_cache_dir());
    let db = CacheDb::open(&config.cache_path())?;
    let cache: Arc<dyn WorkCache> = Arc::new(db.cluster(&config.cluster_name));
    let target: Arc<dyn ApplyTarget> = Arc::new(KubeApplyTarget::new(client.clone()));
    let spoke_api: Arc<dyn SpokeApi> = Arc::new(
        KubeSpoke::new(&config.spoke_kube_config().await?)
            .map_err(|e| RunError::SpokeClient(e.to_string()))?,
    );
    let (version_tx, kubernetes_version) = watch::channel(config.kubernetes_version.clone());
    let version_task = config
        .kubernetes_version
        .is_empty()
        .then(|| tokio::spawn(read_spoke_version(client.clone(), version_tx)));
    let (cluster_info, claims_task) = crate::claims::collect(client, kubernetes_version.clone());
    let metrics = AgentMetrics::default();
    let applied_once = ReadyFlag::new(
        "the works in the cache have not all been applied once since the agent started",
    );
    let (stop_endpoint, endpoint_stop) = watch::channel(false);
    let endpoint = match config.ops.metrics_addr {
        Some(address) => {
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
            Some(tokio::spawn(flotilla_ops::serve(
                listener,
                Arc::new(endpoint),
                stopped(endpoint_stop),
            )))
        }
        None => None,
    };
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
    let result = run_with(&config, parts, shutdown).await;
    stop_endpoint.send_replace(true);
    if let Some(endpoint) = endpoint {
        let _ = endpoint.await;
    }
    if let Some(task) = version_task {
        task.abort();
    }
    claims_task.abort();
    result
}

/// Runs the agent on `parts` until `shutdown` completes: the reconciler beside the session
/// loop, as [`run`] does. Of `config` it uses the cluster name, the identity directory (read
/// for each session, renewed in place), the reconciler settings and the backoff.
pub async fn run_with(
    config: &AgentConfig,
    parts: Parts,
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
    let (stop_tx, stop_rx) = watch::channel(false);
    let outbox_changed = Arc::new(Notify::new());
    let (reconciler, handle) = Reconciler::new(
        Arc::clone(&cache),
        target,
        config.reconciler(),
        Arc::clone(&outbox_changed),
        Box::new(RandJitter(reconciler_rng)),
    );
    let reconciler = reconciler
        .with_metrics(metrics.clone())
        .with_first_pass(applied_once);
    let reconciler = tokio::spawn(reconciler.run(stopped(stop_rx.clone())));
    // Tunnels run beside the session, never in its loop; they end with the agent.
    let (tunnel_server, tunnels) = TunnelServer::new(config.tunnels(), spoke_api);
    let tunnel_server = tokio::spawn(tunnel_server.run(stop_rx.clone()));
    let spoke = Spoke {
        cache,
        reconciler: handle,
        outbox_changed,
        kubernetes_version,
        cluster_info,
        observer,
        tunnels,
        metrics,
    };
    let jitter = RandJitter(rand::rngs::StdRng::seed_from_u64(seeds.random()));
    hold_session(config, &dialer, &spoke, jitter, &stop_tx, stop_rx, shutdown).await;
    let _ = stop_tx.send(true);
    if let Err(e) = reconciler.await {
        warn!(error = %e, "the reconciler ended abnormally");
    }
    if let Err(e) = tunnel_server.await {
        warn!(error = %e, "the tunnel server ended abnormally");
    }
    Ok(())
}

/// Resolves once `stop` turns true (or its sender is gone).
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
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

/// The reconnect loop, until `shutdown`: wait, dial, drive one session until it ends
/// (`driver`), and ask the protocol's [`Reconnect`] machine where and when to dial next. Every
/// decision (the backoff, redirects and their bound, the home gateway and its misses) is the
/// machine's; this loop moves between it and the network and says in the log what was decided.
async fn hold_session(
    config: &AgentConfig,
    dialer: &Dialer,
    spoke: &Spoke,
    mut jitter: RandJitter<rand::rngs::StdRng>,
    stop_tx: &watch::Sender<bool>,
    stop_rx: watch::Receiver<bool>,
    shutdown: impl Future<Output = ()> + Send,
) {
    let mut reconnect = Reconnect::new(Instant::now(), config.backoff(), &mut jitter);
    tokio::pin!(shutdown);
    loop {
        // Disconnected: wait out the delay the machine chose.
        if let Some(until) = reconnect.poll_timeout() {
            tokio::select! {
                _ = tokio::time::sleep_until(until) => {}
                _ = &mut shutdown => return,
            }
        }
        let Some(target) = reconnect.connect(Instant::now()) else {
            continue;
        };
        if let Target::Home(home) = &target {
            debug!(gateway = %home, "dialling the gateway of the last session first");
        }
        let redirected = target.address().map(|to| dialer.redirected(to));
        let ended = {
            let mut session = std::pin::pin!(session_once(
                redirected.as_ref().unwrap_or(dialer),
                config,
                spoke,
                stop_rx.clone(),
                &mut reconnect,
            ));
            tokio::select! {
                ended = &mut session => ended,
                _ = &mut shutdown => {
                    // Let the session say goodbye before we exit.
                    let _ = stop_tx.send(true);
                    session.await
                }
            }
        };
        let Some(end) = observe(spoke, &ended, reconnect.is_connected()) else {
            return;
        };
        let home = reconnect.home().map(str::to_owned);
        let next = reconnect.ended(Instant::now(), end, &mut jitter);
        if let Some(home) = home
            && reconnect.home().is_none()
        {
            debug!(gateway = %home, "the gateway of the last session did not take a session; back to the configured address");
        }
        match (&ended, &next.target) {
            (Ended::Drained { retry_after, .. }, Target::Redirect(to)) => {
                info!(gateway = %to, ?retry_after, "redirected to the gateway that owns this cluster's shard");
                spoke.observer.redirected(to);
            }
            (Ended::Drained { .. }, _) => info!(
                delay = ?next.delay,
                "the hub is draining this session (shutting down, moving it, or over its new-session rate); reconnecting after its delay"
            ),
            (Ended::Lost { refusal }, _) if refusal.kind.is_retryable() => {
                warn!(retry_in = ?next.delay, "{refusal}")
            }
            // Someone has to act; the agent keeps trying meanwhile.
            (Ended::Lost { refusal }, _) => error!(retry_in = ?next.delay, "{refusal}"),
            (Ended::Shutdown, _) => {}
        }
    }
}

/// Tells the observer how the session ended, and the reconnect machine's view of it: `None`
/// for the agent's own shutdown.
fn observe(spoke: &Spoke, ended: &Ended, established: bool) -> Option<SessionEnd> {
    match ended {
        Ended::Shutdown => {
            if established {
                spoke.observer.session_closed("agent shutting down");
            }
            None
        }
        Ended::Drained {
            retry_after,
            redirect,
        } => {
            if established {
                spoke.observer.session_closed("hub draining");
            }
            Some(SessionEnd::Drained {
                retry_after: *retry_after,
                redirect: redirect.clone(),
            })
        }
        Ended::Lost { refusal } => {
            if established {
                spoke.observer.session_closed(&refusal.to_string());
            } else {
                spoke.observer.connection_failed(refusal);
            }
            // Nothing listening (or answering) there: that gateway is gone, not cold.
            let gone = matches!(
                refusal.kind,
                RefusalKind::HubUnreachable | RefusalKind::HubTimedOut
            );
            Some(if gone {
                SessionEnd::Unreachable
            } else {
                SessionEnd::Lost
            })
        }
    }
}
