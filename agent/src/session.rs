//! The agent's session loop: connect, drive the protocol state machine until the session ends,
//! back off, reconnect. Everything that needs a decision lives in `flotilla_proto::session`; this
//! file moves frames, timers and events between it, the network and the rest of the agent:
//! desired works go into the durable cache (and only then are acked) and on to the reconciler;
//! statuses come out of the cache's outbox and stay there until the hub acks them.
//!
//! The reconciler runs beside the session loop, not inside it, so the spoke is kept as desired
//! whether or not a hub is there.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use flotilla_proto::api::ManifestWork;
use flotilla_proto::session::{
    AgentConfig as SessionConfig, AgentEvent, AgentSession, Backoff, BackoffConfig,
    DEFAULT_WELCOME_TIMEOUT, Jitter, renew_at,
};
use flotilla_proto::wire::{self, fleet_client::FleetClient};
use rand::{Rng as _, SeedableRng as _};
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tracing::{debug, info, warn};

use crate::AgentConfig;
use crate::apply::{ApplyTarget, KubeApplyTarget};
use crate::cache::{
    CacheError, CachedWork, MAX_MANIFEST_WORK_BYTES, SledCacheDb, WorkCache, durably,
};
use crate::config::ConfigError;
use crate::connect::Dialer;
use crate::identity::Identity;
use crate::reconcile::{ReconcileHandle, Reconciler};

/// Largest frame the agent accepts from the hub (a ManifestWork is at most ~1.5 MiB).
pub const MAX_FRAME_BYTES: usize = 8 * 1024 * 1024;
/// How long a session waits for the spoke's version before saying hello without it.
const VERSION_WAIT: Duration = Duration::from_secs(2);
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

/// Where the connection to the hub stands. Each transition is logged once.
#[derive(Debug)]
enum Link {
    /// Waiting before the next attempt; the delay comes from the backoff policy or the hub's
    /// retry-after.
    Disconnected { delay: Duration },
    /// Dialling and saying hello.
    Connecting,
}

/// How one session ended, which decides the next delay.
enum Ended {
    /// The hub asked us to come back later (it is draining).
    Drained { retry_after: Duration },
    /// The connection failed or the session closed; back off.
    Lost { reason: String },
    /// Our own shutdown.
    Shutdown,
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

/// What the session loop tells whoever watches it, as it happens. Every method has an empty
/// default; the agent binary watches nothing ([`Unobserved`]), the load-test harness counts
/// sessions, frames and acks with it. Called on the session's task: keep it cheap and never
/// block.
pub trait Observer: Send + Sync {
    /// A session reached Welcome.
    fn session_established(&self) {}
    /// An established session ended (the hub went away, drained us, or we shut down).
    fn session_closed(&self, _reason: &str) {}
    /// A dial or session open failed before Welcome; the agent backs off.
    fn connection_failed(&self, _reason: &str) {}
    /// A frame arrived from the hub.
    fn frame_received(&self, _frame: &wire::HubFrame) {}
    /// A frame was queued for the hub.
    fn frame_sent(&self, _frame: &wire::AgentFrame) {}
    /// A work from the hub was stored durably and acked.
    fn work_stored(&self, _work: &CachedWork) {}
    /// A status left the outbox for the hub.
    fn status_reported(&self, _uid: &str, _seq: u64) {}
    /// The hub acknowledged a status as stored.
    fn status_acked(&self, _uid: &str, _seq: u64) {}
}

/// The observer of an agent nobody watches.
#[derive(Clone, Copy, Debug, Default)]
pub struct Unobserved;

impl Observer for Unobserved {}

/// The parts [`run_with`] runs on. [`run`] makes them from the agent's flags; the load-test
/// harness makes thousands, sharing one cache database and simulated clusters.
pub struct Parts {
    /// Opens connections to the hub.
    pub dialer: Dialer,
    /// This cluster's durable cache.
    pub cache: Arc<dyn WorkCache>,
    /// Where works are applied.
    pub target: Arc<dyn ApplyTarget>,
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
}

/// The spoke side of the agent, as the session driver sees it.
#[derive(Clone)]
pub struct Spoke {
    /// The durable cache: works are stored here before they are acked; statuses wait here
    /// until the hub acks them.
    pub cache: Arc<dyn WorkCache>,
    /// Tells the reconciler which works changed.
    pub reconciler: ReconcileHandle,
    /// Woken by the reconciler when the outbox has a new status.
    pub outbox_changed: Arc<Notify>,
    /// The spoke's Kubernetes version for the hello; empty until known.
    pub kubernetes_version: watch::Receiver<String>,
    /// What the agent reports about its spoke; sent after the welcome and on every change.
    pub cluster_info: watch::Receiver<wire::ClusterInfo>,
    /// Told what the session does.
    pub observer: Arc<dyn Observer>,
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
        .with_proxy(config.proxy_url.clone());
    let client = kube::Client::try_from(config.spoke_kube_config().await?)
        .map_err(|e| RunError::SpokeClient(e.to_string()))?;
    let db = SledCacheDb::open(&config.cache_dir())?;
    let cache: Arc<dyn WorkCache> = Arc::new(db.cluster(&config.cluster_name)?);
    let target: Arc<dyn ApplyTarget> = Arc::new(KubeApplyTarget::new(client.clone()));
    let (version_tx, kubernetes_version) = watch::channel(config.kubernetes_version.clone());
    let version_task = config
        .kubernetes_version
        .is_empty()
        .then(|| tokio::spawn(read_spoke_version(client.clone(), version_tx)));
    let (cluster_info, claims_task) = crate::claims::collect(client, kubernetes_version.clone());
    let parts = Parts {
        dialer,
        cache,
        target,
        kubernetes_version,
        cluster_info,
        observer: Arc::new(Unobserved),
        seed: None,
    };
    let result = run_with(&config, parts, shutdown).await;
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
        kubernetes_version,
        cluster_info,
        observer,
        seed,
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
    let reconciler = tokio::spawn(reconciler.run(stopped(stop_rx.clone())));
    let spoke = Spoke {
        cache,
        reconciler: handle,
        outbox_changed,
        kubernetes_version,
        cluster_info,
        observer,
    };
    let jitter = RandJitter(rand::rngs::StdRng::seed_from_u64(seeds.random()));
    hold_session(config, &dialer, &spoke, jitter, &stop_tx, stop_rx, shutdown).await;
    let _ = stop_tx.send(true);
    if let Err(e) = reconciler.await {
        warn!(error = %e, "the reconciler ended abnormally");
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

/// The reconnect loop, until `shutdown`.
async fn hold_session(
    config: &AgentConfig,
    dialer: &Dialer,
    spoke: &Spoke,
    mut jitter: RandJitter<rand::rngs::StdRng>,
    stop_tx: &watch::Sender<bool>,
    stop_rx: watch::Receiver<bool>,
    shutdown: impl Future<Output = ()> + Send,
) {
    let mut backoff = Backoff::new(BackoffConfig {
        max: config.max_backoff,
        initial: config.max_backoff.min(BackoffConfig::default().initial),
        startup_jitter: config.initial_jitter,
        ..BackoffConfig::default()
    });
    let mut link = Link::Disconnected {
        delay: backoff.startup_delay(&mut jitter),
    };
    tokio::pin!(shutdown);
    loop {
        match link {
            Link::Disconnected { delay } => {
                tokio::select! {
                    _ = tokio::time::sleep(delay) => link = Link::Connecting,
                    _ = &mut shutdown => return,
                }
            }
            Link::Connecting => {
                let mut established_at = None;
                let ended = {
                    let mut session = std::pin::pin!(session_once(
                        dialer,
                        config,
                        spoke,
                        stop_rx.clone(),
                        &mut established_at
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
                // Only a session that got as far as Welcome counts towards a stable connection.
                if let Some(at) = established_at {
                    backoff.connected(at);
                    spoke.observer.session_closed(match &ended {
                        Ended::Shutdown => "agent shutting down",
                        Ended::Drained { .. } => "hub draining",
                        Ended::Lost { reason } => reason,
                    });
                } else if let Ended::Lost { reason } = &ended {
                    spoke.observer.connection_failed(reason);
                }
                link = match ended {
                    Ended::Shutdown => return,
                    Ended::Drained { retry_after } => {
                        let delay =
                            backoff.next_delay(Instant::now(), Some(retry_after), &mut jitter);
                        info!(?delay, "hub is draining; reconnecting after its delay");
                        Link::Disconnected { delay }
                    }
                    Ended::Lost { reason } => {
                        let delay = backoff.next_delay(Instant::now(), None, &mut jitter);
                        if established_at.is_some() {
                            warn!(%reason, ?delay, "session lost; reconnecting");
                        } else {
                            warn!(%reason, ?delay, "cannot reach the hub; retrying");
                        }
                        Link::Disconnected { delay }
                    }
                };
            }
        }
    }
}

/// One session from dial to end.
async fn session_once(
    dialer: &Dialer,
    config: &AgentConfig,
    spoke: &Spoke,
    mut stop: watch::Receiver<bool>,
    established_at: &mut Option<Instant>,
) -> Ended {
    let channel = tokio::select! {
        dialled = dialer.connect() => match dialled {
            Ok(c) => c,
            Err(e) => {
                return Ended::Lost {
                    reason: format!("{e:#}"),
                };
            }
        },
        _ = stop.wait_for(|stop| *stop) => return Ended::Shutdown,
    };
    // Tell the hub what we hold so it sends only what differs. If the cache cannot say, an
    // empty list is safe: the hub then sends everything, and storing is idempotent.
    let held = durably(&spoke.cache, |c| c.held())
        .await
        .unwrap_or_else(|e| {
            warn!(error = %e, "cannot list the cached works; asking the hub for all of them");
            Vec::new()
        });
    let identity = Identity::new(config.identity_dir());
    let mut version = spoke.kubernetes_version.clone();
    let _ = tokio::time::timeout(VERSION_WAIT, version.wait_for(|v| !v.is_empty())).await;
    let kubernetes_version = version.borrow().clone();
    let mut cluster_info = spoke.cluster_info.clone();
    let claims = cluster_info.borrow_and_update().claims.clone();
    let mut machine = AgentSession::new(
        Instant::now(),
        SessionConfig {
            cluster_name: config.cluster_name.clone(),
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            kubernetes_version,
            claims,
            welcome_timeout: DEFAULT_WELCOME_TIMEOUT,
        },
        held,
    )
    .with_ca_bundle_sha256(identity.ca_bundle_sha256());
    // When to ask for a new certificate over this session; armed once established.
    let mut renew_at: Option<Instant> = None;
    let (tx, rx) = mpsc::channel(32);
    // The hello must be in the request stream before the call starts.
    while let Some(frame) = machine.poll_transmit() {
        spoke.observer.frame_sent(&frame);
        let _ = tx.try_send(frame);
    }
    let mut client = FleetClient::new(channel)
        .max_decoding_message_size(MAX_FRAME_BYTES)
        .max_encoding_message_size(MAX_FRAME_BYTES);
    let mut inbound = match client.session(ReceiverStream::new(rx)).await {
        Ok(r) => r.into_inner(),
        Err(status) => {
            return Ended::Lost {
                reason: hub_refusal(&status),
            };
        }
    };
    let mut drained = None;
    let mut last_reason = String::from("session ended");
    // The statuses reported in this session (uid → seq), so a new status of one work does not
    // re-send every other pending one. Bounded by the number of works; a new session starts
    // empty and re-reports the whole outbox.
    let mut reported: HashMap<String, u64> = HashMap::new();
    loop {
        // Handling an event can queue frames (acks, the outbox on Established) and more events:
        // go round until nothing is left, so nothing waits for the next wake-up.
        loop {
            while let Some(frame) = machine.poll_transmit() {
                spoke.observer.frame_sent(&frame);
                if tx.send(frame).await.is_err() {
                    break;
                }
            }
            let mut handled = false;
            while let Some(event) = machine.poll_event() {
                handled = true;
                let Some(event) =
                    on_delivery_event(&mut machine, spoke, &mut reported, event).await
                else {
                    continue;
                };
                match event {
                    AgentEvent::Established { session_id, .. } => {
                        *established_at = Some(Instant::now());
                        info!(session = %session_id, "session established");
                        spoke.observer.session_established();
                        report_outbox(&mut machine, spoke, &mut reported);
                        report_cluster_info(&mut machine, &mut cluster_info);
                        renew_at = renewal_deadline(&identity);
                    }
                    AgentEvent::CertificateIssued {
                        certificate_pem,
                        ca_bundle_pem,
                    } => match identity.complete_renewal(&certificate_pem, &ca_bundle_pem) {
                        Ok(()) => {
                            info!(
                                "client certificate renewed; the next connection uses it, this session carries on"
                            );
                            // Never back to back, whatever the certificate says.
                            let earliest = Instant::now() + RENEWAL_MIN_INTERVAL;
                            renew_at = renewal_deadline(&identity).map(|at| at.max(earliest));
                        }
                        Err(e) => {
                            warn!(error = %e, "cannot store the renewed certificate; asking again later");
                            renew_at = Some(Instant::now() + renewal_retry(&identity));
                        }
                    },
                    AgentEvent::RenewalRefused { reason } => {
                        let retry = renewal_retry(&identity);
                        warn!(%reason, ?retry, "the hub refused to renew the certificate; asking again later");
                        renew_at = Some(Instant::now() + retry);
                    }
                    AgentEvent::TrustBundleUpdated { ca_bundle_pem } => {
                        match identity.update_ca_bundle(&ca_bundle_pem) {
                            Ok(()) => info!(
                                "the hub's CA bundle changed (CA rotation); stored for the next connection"
                            ),
                            Err(e) => warn!(error = %e, "cannot store the hub's new CA bundle"),
                        }
                    }
                    AgentEvent::Synced { sent } => info!(sent, "in sync with the hub"),
                    AgentEvent::Drained { retry_after, .. } => drained = Some(retry_after),
                    AgentEvent::Closed { reason, .. } => last_reason = reason.to_string(),
                    // Tunnels are not handled by this driver yet.
                    _ => {}
                }
            }
            if !handled {
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
                    spoke.observer.frame_received(&frame);
                    // An error has already closed the session; the log says why.
                    if let Err(e) = machine.handle_frame(Instant::now(), frame) {
                        warn!(error = %e, "protocol error from the hub");
                    }
                }
                Ok(None) => machine.close("hub closed the stream"),
                Err(status) => machine.close(hub_refusal(&status)),
            },
            _ = sleep_until(deadline) => machine.handle_timeout(Instant::now()),
            _ = sleep_until(renew_at), if established => {
                renew_at = None;
                match identity.renewal_request(&config.cluster_name) {
                    Ok(csr) => {
                        if machine.renew_certificate(csr) {
                            info!("asking the hub for a new client certificate over the session");
                        }
                    }
                    Err(e) => {
                        warn!(error = %e, "cannot make a renewal request; trying again later");
                        renew_at = Some(Instant::now() + renewal_retry(&identity));
                    }
                }
            }
            // Only once established: until then a status has nowhere to go, and the wake-up
            // stays stored for later.
            _ = spoke.outbox_changed.notified(), if established => {
                report_outbox(&mut machine, spoke, &mut reported);
            }
            // A claim, node or version changed on the spoke.
            Ok(()) = cluster_info.changed(), if established => {
                report_cluster_info(&mut machine, &mut cluster_info);
            }
            _ = stop.changed() => {
                machine.close("agent shutting down");
                while let Some(frame) = machine.poll_transmit() {
                    let _ = tx.try_send(frame);
                }
                return Ended::Shutdown;
            }
        }
    }
    match drained {
        Some(retry_after) => Ended::Drained { retry_after },
        None => Ended::Lost {
            reason: last_reason,
        },
    }
}

/// Sends what the agent knows about its spoke now, unless it knows nothing yet.
fn report_cluster_info(
    machine: &mut AgentSession,
    cluster_info: &mut watch::Receiver<wire::ClusterInfo>,
) {
    let info = cluster_info.borrow_and_update().clone();
    if info != wire::ClusterInfo::default() {
        machine.report_cluster_info(info);
    }
}

/// Acts on the events about works and statuses; hands back the others (connection events)
/// for the loop.
async fn on_delivery_event(
    machine: &mut AgentSession,
    spoke: &Spoke,
    reported: &mut HashMap<String, u64>,
    event: AgentEvent,
) -> Option<AgentEvent> {
    match event {
        AgentEvent::WorkReceived { work } => receive_work(machine, spoke, work).await,
        AgentEvent::WorkDeleted {
            uid,
            namespace,
            name,
        } => delete_work(spoke, uid, &namespace, &name).await,
        AgentEvent::StatusAcked { uid, seq } => {
            spoke.observer.status_acked(&uid, seq);
            match spoke.cache.ack_status(&uid, seq) {
                Ok(true) => {
                    reported.remove(&uid);
                }
                Ok(false) => {}
                // The status stays pending and is re-sent next session; the hub drops it by seq.
                Err(e) => {
                    warn!(uid = %uid, seq, error = %e, "cannot record the hub's status ack")
                }
            }
        }
        other => return Some(other),
    }
    None
}

/// Stores a work from the hub durably, acks it, and hands it to the reconciler, in that order:
/// an acked generation must survive a crash.
async fn receive_work(machine: &mut AgentSession, spoke: &Spoke, work: wire::WorkUpdate) {
    let wire::WorkUpdate {
        uid,
        namespace,
        name,
        generation,
        content_hash,
        manifest_work_json,
    } = work;
    if uid.is_empty() {
        warn!(work = %format!("{namespace}/{name}"), "the hub sent a work without a uid; ignored");
        return;
    }
    let size = manifest_work_json.len();
    let refused = if size > MAX_MANIFEST_WORK_BYTES {
        Some(format!(
            "the ManifestWork is {size} bytes, more than the agent's limit of {MAX_MANIFEST_WORK_BYTES} bytes; \
             split its manifests over several ManifestWorks"
        ))
    } else {
        serde_json::from_slice::<ManifestWork>(&manifest_work_json)
            .err()
            .map(|e| format!("the hub sent a ManifestWork the agent cannot read: {e}"))
    };
    // Neither a refused nor a held-already body is kept in memory past this point.
    let content = refused.is_none().then_some(manifest_work_json);
    let cached = CachedWork {
        uid: uid.clone(),
        namespace,
        name,
        generation,
        content_hash,
        refused,
        deleting: false,
    };
    match spoke.cache.work(&uid) {
        Ok(Some(held)) if held == cached => {
            // A resume after a lost ack: already durable, nothing to apply.
            machine.ack_work(uid, generation);
            return;
        }
        Ok(_) => {}
        Err(e) => warn!(uid = %uid, error = %e, "cannot read the cached work; storing it again"),
    }
    if let Some(reason) = &cached.refused {
        warn!(work = %cached.display_name(), uid = %uid, %reason, "work refused");
    }
    let work_name = cached.display_name();
    let stored = cached.clone();
    match durably(&spoke.cache, move |c| {
        c.put_work(&cached, content.as_deref())
    })
    .await
    {
        Ok(()) => {
            debug!(work = %work_name, uid = %uid, generation, "work stored");
            machine.ack_work(uid.clone(), generation);
            spoke.observer.work_stored(&stored);
            spoke.reconciler.work_changed(&uid).await;
        }
        // Not acked: the next session's hello does not hold it, so the hub sends it again.
        Err(e) => {
            warn!(work = %work_name, uid = %uid, error = %e, "cannot store a work from the hub")
        }
    }
}

/// Marks a work deleted by the hub as a tombstone and hands it to the reconciler, which
/// removes or orphans its resources and then forgets it.
async fn delete_work(spoke: &Spoke, uid: String, namespace: &str, name: &str) {
    let key = uid.clone();
    match durably(&spoke.cache, move |c| c.mark_deleting(&key)).await {
        Ok(true) => {
            info!(uid = %uid, work = %format!("{namespace}/{name}"), "work deleted on the hub");
            spoke.reconciler.work_changed(&uid).await;
        }
        Ok(false) => debug!(uid = %uid, "the hub deleted a work this agent does not hold"),
        // Still held: the hub repeats the delete on the next session, where the hello lists it.
        Err(e) => warn!(uid = %uid, error = %e, "cannot record a work deletion"),
    }
}

/// Reports every outbox status not yet reported in this session.
fn report_outbox(machine: &mut AgentSession, spoke: &Spoke, reported: &mut HashMap<String, u64>) {
    let pending = match spoke.cache.pending_statuses() {
        Ok(p) => p,
        Err(e) => {
            warn!(error = %e, "cannot read the status outbox");
            return;
        }
    };
    for status in pending {
        if reported
            .get(&status.uid)
            .is_some_and(|seq| *seq >= status.seq)
        {
            continue;
        }
        debug!(uid = %status.uid, seq = status.seq, "reporting status");
        reported.insert(status.uid.clone(), status.seq);
        spoke.observer.status_reported(&status.uid, status.seq);
        machine.report_status(
            status.uid,
            status.generation,
            status.seq,
            status.status_json,
        );
    }
}

/// Shortest time between two renewals of one agent.
const RENEWAL_MIN_INTERVAL: Duration = Duration::from_secs(1);
/// Longest wait before asking again after a refused or failed renewal.
const RENEWAL_RETRY_MAX: Duration = Duration::from_secs(30);

/// When to renew the stored certificate: [`renew_at`] of its validity, as a tokio instant. `None`
/// (and a warning) if it cannot be read; a dev certificate without one simply never renews.
fn renewal_deadline(identity: &Identity) -> Option<Instant> {
    let (not_before, not_after) = match identity.validity() {
        Ok(v) => v,
        Err(e) => {
            warn!(error = %e, "cannot read the certificate's validity; not renewing");
            return None;
        }
    };
    let at = renew_at(not_before, not_after);
    let wait = at
        .duration_since(std::time::SystemTime::now())
        .unwrap_or(Duration::ZERO);
    debug!(in_ = ?wait, "certificate renewal scheduled");
    Some(Instant::now() + wait)
}

/// How long to wait before asking again: a quarter of what is left of the certificate's life,
/// between one second and [`RENEWAL_RETRY_MAX`], so a short-lived certificate still gets
/// several tries before it expires.
fn renewal_retry(identity: &Identity) -> Duration {
    let left = identity
        .validity()
        .ok()
        .and_then(|(_, to)| to.duration_since(std::time::SystemTime::now()).ok())
        .unwrap_or(RENEWAL_RETRY_MAX);
    (left / 4).clamp(Duration::from_secs(1), RENEWAL_RETRY_MAX)
}

/// The hub's reason, as a sentence.
fn hub_refusal(status: &tonic::Status) -> String {
    format!(
        "hub ended the session: {} ({:?})",
        status.message(),
        status.code()
    )
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    //! The driver's delivery half against the hub's real protocol machine, frames passed in
    //! memory: what is acked is durable, statuses flow and are acked, a resume re-sends nothing.

    use super::*;
    use crate::apply::MemoryCluster;
    use crate::reconcile::ReconcilerConfig;
    use flotilla_proto::api::content_hash;
    use flotilla_proto::session::{HubConfig, HubEvent, HubSession};
    use serde_json::json;

    struct NoJitter;
    impl Jitter for NoJitter {
        fn uniform(&mut self, _max: Duration) -> Duration {
            Duration::ZERO
        }
    }

    /// One agent (cache, simulated cluster, reconciler task) and helpers to run sessions.
    struct Agent {
        spoke: Spoke,
        cluster: Arc<MemoryCluster>,
        _stop: tokio::sync::oneshot::Sender<()>,
    }

    impl Agent {
        fn start(cache: Arc<dyn WorkCache>) -> Agent {
            let cluster = Arc::new(MemoryCluster::new());
            let outbox_changed = Arc::new(Notify::new());
            let (reconciler, handle) = Reconciler::new(
                Arc::clone(&cache),
                cluster.clone(),
                // No retries or resyncs within a test: each status here comes from a step.
                ReconcilerConfig {
                    retry_initial: Duration::from_secs(3600),
                    resync_interval: Duration::from_secs(3600),
                    ..ReconcilerConfig::default()
                },
                Arc::clone(&outbox_changed),
                Box::new(NoJitter),
            );
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            tokio::spawn(reconciler.run(async {
                let _ = stopped.await;
            }));
            let (_, kubernetes_version) = watch::channel("v1.36.3".to_string());
            let (_, cluster_info) = watch::channel(wire::ClusterInfo::default());
            Agent {
                spoke: Spoke {
                    cache,
                    reconciler: handle,
                    outbox_changed,
                    kubernetes_version,
                    cluster_info,
                    observer: Arc::new(Unobserved),
                },
                cluster,
                _stop: stop,
            }
        }
    }

    /// One session between the agent's machine and the hub's, connected in memory.
    struct Session<'a> {
        agent: &'a Agent,
        machine: AgentSession,
        hub: HubSession,
        reported: HashMap<String, u64>,
        /// Events the hub side saw, in order.
        hub_events: Vec<HubEvent>,
        /// Works the agent received.
        received: Vec<String>,
    }

    impl<'a> Session<'a> {
        fn open(agent: &'a Agent) -> Session<'a> {
            let now = Instant::now();
            let held = agent.spoke.cache.held().unwrap();
            let machine = AgentSession::new(
                now,
                SessionConfig {
                    cluster_name: "store-7".into(),
                    agent_version: "test".into(),
                    kubernetes_version: "v1.36.3".into(),
                    claims: Vec::new(),
                    welcome_timeout: DEFAULT_WELCOME_TIMEOUT,
                },
                held,
            );
            Session {
                agent,
                machine,
                hub: HubSession::new(now, HubConfig::default(), "store-7", "s1"),
                reported: HashMap::new(),
                hub_events: Vec::new(),
                received: Vec::new(),
            }
        }

        /// Moves frames both ways and handles events until both sides are quiet.
        async fn pump(&mut self) {
            loop {
                let mut moved = false;
                while let Some(frame) = self.machine.poll_transmit() {
                    self.hub.handle_frame(Instant::now(), frame).unwrap();
                    moved = true;
                }
                while let Some(event) = self.hub.poll_event() {
                    if let HubEvent::WorkAcked {
                        uid, generation, ..
                    } = &event
                    {
                        // The point of the ordering: whatever the hub sees acked is durable.
                        let held = self
                            .agent
                            .spoke
                            .cache
                            .work(uid)
                            .unwrap()
                            .expect("acked but not cached");
                        assert_eq!(held.generation, *generation);
                    }
                    self.hub_events.push(event);
                    moved = true;
                }
                while let Some(frame) = self.hub.poll_transmit() {
                    self.machine.handle_frame(Instant::now(), frame).unwrap();
                    moved = true;
                }
                while let Some(event) = self.machine.poll_event() {
                    moved = true;
                    if let AgentEvent::WorkReceived { work } = &event {
                        self.received.push(work.uid.clone());
                    }
                    let spoke = &self.agent.spoke;
                    let left =
                        on_delivery_event(&mut self.machine, spoke, &mut self.reported, event)
                            .await;
                    if let Some(AgentEvent::Established { .. }) = left {
                        report_outbox(&mut self.machine, spoke, &mut self.reported);
                    }
                }
                if !moved {
                    return;
                }
            }
        }

        /// Waits for the reconciler's next status and sends the outbox, as the driver does.
        async fn next_status(&mut self) {
            tokio::time::timeout(
                Duration::from_secs(10),
                self.agent.spoke.outbox_changed.notified(),
            )
            .await
            .expect("no status from the reconciler");
            report_outbox(&mut self.machine, &self.agent.spoke, &mut self.reported);
            self.pump().await;
        }

        fn hello_held(&self) -> Vec<wire::HeldWork> {
            self.hub_events
                .iter()
                .find_map(|e| match e {
                    HubEvent::Established { hello } => Some(hello.held.clone()),
                    _ => None,
                })
                .expect("established")
        }

        /// Statuses the hub received as (uid, seq); the hub acks each.
        fn statuses(&mut self) -> Vec<(String, u64)> {
            let got: Vec<(String, u64)> = self
                .hub_events
                .iter()
                .filter_map(|e| match e {
                    HubEvent::StatusReported { uid, seq, .. } => Some((uid.clone(), *seq)),
                    _ => None,
                })
                .collect();
            self.hub_events
                .retain(|e| !matches!(e, HubEvent::StatusReported { .. }));
            for (uid, seq) in &got {
                self.hub.ack_status(uid.clone(), *seq);
            }
            got
        }
    }

    fn desired(uid: &str, generation: i64, configmaps: &[&str]) -> wire::WorkUpdate {
        let manifests: Vec<_> = configmaps
            .iter()
            .map(|n| json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": n, "namespace": "default"}}))
            .collect();
        let mw: ManifestWork = serde_json::from_value(json!({
            "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
            "metadata": {"name": "w", "namespace": "store-7", "uid": uid, "generation": generation},
            "spec": {"workload": {"manifests": manifests}},
        }))
        .unwrap();
        wire::WorkUpdate {
            uid: uid.into(),
            namespace: "store-7".into(),
            name: "w".into(),
            generation,
            content_hash: content_hash(&mw.spec),
            manifest_work_json: serde_json::to_vec(&mw).unwrap(),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn works_are_stored_before_the_ack_and_statuses_flow_until_acked() {
        let db = SledCacheDb::temporary().unwrap();
        let cache: Arc<dyn WorkCache> = Arc::new(db.cluster("store-7").unwrap());
        let agent = Agent::start(Arc::clone(&cache));

        let mut s = Session::open(&agent);
        s.pump().await;
        assert!(s.hello_held().is_empty());
        s.hub.begin_sync([desired("a", 1, &["x"])]);
        s.pump().await;
        assert!(
            s.hub_events
                .iter()
                .any(|e| matches!(e, HubEvent::WorkAcked { uid, generation: 1, .. } if uid == "a"))
        );
        s.next_status().await;
        assert_eq!(s.statuses(), [("a".to_string(), 1)]);
        s.pump().await;
        assert!(
            cache.pending_statuses().unwrap().is_empty(),
            "the hub's ack empties the outbox"
        );
        assert_eq!(agent.cluster.objects().await.len(), 1);

        // A live update: stored, acked, applied, reported with the next seq.
        s.hub.upsert_work(desired("a", 2, &["x", "y"]));
        s.pump().await;
        s.next_status().await;
        assert_eq!(s.statuses(), [("a".to_string(), 2)]);
        s.pump().await;
        assert_eq!(agent.cluster.objects().await.len(), 2);

        // The hub goes away; a drift repair during the outage leaves a status in the outbox.
        drop(s);
        agent.cluster.set_down(true).await;
        agent.spoke.reconciler.resync_all().await;
        tokio::time::timeout(
            Duration::from_secs(10),
            agent.spoke.outbox_changed.notified(),
        )
        .await
        .expect("a status while the hub is away");
        assert_eq!(cache.pending_statuses().unwrap().len(), 1);
        agent.cluster.set_down(false).await;

        // Resume: the hello holds generation 2, the hub sends nothing, the outbox is delivered.
        let mut s = Session::open(&agent);
        s.pump().await;
        let held = s.hello_held();
        assert_eq!((held.len(), held[0].generation), (1, 2));
        s.hub.begin_sync([desired("a", 2, &["x", "y"])]);
        s.pump().await;
        assert!(s.received.is_empty());
        assert!(
            !s.hub_events
                .iter()
                .any(|e| matches!(e, HubEvent::WorkAcked { .. })),
            "nothing re-sent"
        );
        assert_eq!(
            s.statuses(),
            [("a".to_string(), 3)],
            "the outage's status, once"
        );
        s.pump().await;
        assert!(cache.pending_statuses().unwrap().is_empty());

        // Deleted on the hub: a tombstone, then the resources and the work are gone.
        s.hub.delete_work("a", "store-7", "w");
        s.pump().await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while cache.work("a").unwrap().is_some() {
            assert!(
                Instant::now() < deadline,
                "the tombstone was not cleaned up"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(agent.cluster.objects().await.is_empty());
        assert!(s.statuses().is_empty(), "no status for a deleted work");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_oversized_work_is_acked_but_refused_with_a_status_naming_the_limit() {
        let db = SledCacheDb::temporary().unwrap();
        let cache: Arc<dyn WorkCache> = Arc::new(db.cluster("store-7").unwrap());
        let agent = Agent::start(Arc::clone(&cache));
        let mut s = Session::open(&agent);
        s.pump().await;
        let mut big = desired("big", 1, &["x"]);
        big.manifest_work_json = vec![b' '; MAX_MANIFEST_WORK_BYTES + 1];
        s.hub.begin_sync([big]);
        s.pump().await;
        assert!(
            cache.manifest_work("big").unwrap().is_none(),
            "the content is not kept"
        );
        assert!(cache.work("big").unwrap().unwrap().refused.is_some());
        s.next_status().await;
        let status = cache.last_status("big").unwrap().unwrap().status;
        let degraded = status["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Degraded")
            .unwrap();
        assert_eq!(degraded["status"], "True");
        let message = degraded["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("{} bytes", MAX_MANIFEST_WORK_BYTES + 1)),
            "{message}"
        );
        assert!(
            message.contains(&format!("limit of {MAX_MANIFEST_WORK_BYTES} bytes")),
            "{message}"
        );
        assert!(agent.cluster.objects().await.is_empty());
    }
}
