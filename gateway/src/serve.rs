//! The session tier as one process part: both carriers' listeners, a driver task per session,
//! the watch caches, the status and health writers, every one with an owner, and the drain.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use flotilla_store::Store;
use flotilla_transport::gate::ConnectionGate;
use flotilla_transport::grpc::FleetService;
use flotilla_transport::hop::RelayService;
use flotilla_transport::quic::QuicListener;
use flotilla_transport::tls::AuthenticatedConn;
use flotilla_transport::{Incoming, TunnelStream};
use futures::FutureExt as _;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::{Instrument as _, info, info_span, warn};

use crate::admission::Admissions;
use crate::certificates::ClusterCertificates;
use crate::compliance::ComplianceWriter;
use crate::config::GatewayConfig;
use crate::desired::DesiredState;
use crate::driver::drive;
use crate::fencing::{Fencing, WorkBases};
use crate::finalizers::CleanupFinalizers;
use crate::health::HealthWriter;
use crate::locks::{SyncMutex, lock};
use crate::metrics::GatewayMetrics;
use crate::policies::DesiredPolicies;
use crate::rate::{SessionGate, SessionRate};
use crate::registry::Registry;
use crate::shards::{ShardLeasing, ShardView};
use crate::shared::Shared;
use crate::statuses::StatusWriter;
use crate::tunnel::{Away, TunnelError};
use crate::writes::WriteBudget;
use flotilla_ops::{TaskEnded, Tasks};

/// Errors that stop the whole gateway; sessions' own failures never surface here. Each is
/// retryable by restarting the process (its supervisor does), none in-process.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// One of the gateway's own tasks (a carrier, the watch caches, a writer) ended while
    /// serving.
    #[error(transparent)]
    TaskEnded(#[from] TaskEnded),
}

/// Where agents reach this gateway: authenticated TLS connections for the gRPC carrier, and a
/// QUIC listener (usually on the same port, over UDP) unless QUIC is off.
pub struct Listeners {
    pub tcp: mpsc::Receiver<AuthenticatedConn>,
    pub quic: Option<QuicListener>,
}

/// Sessions handed from the carriers to the gateway; a burst beyond it waits in the carriers.
const INCOMING_BUFFER: usize = 1024;
/// How long the gateway's own tasks may take to stop once told.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// A session tier over one store.
#[derive(Clone)]
pub struct Gateway {
    shared: Arc<Shared>,
}

impl Gateway {
    /// A gateway that refuses certificate renewals (it has no CA to ask).
    pub fn new(store: Arc<dyn Store>, config: GatewayConfig) -> Gateway {
        Self::build(store, config, None)
    }

    /// A gateway that answers renewals: with the hub's CA (the hub's in-process gateway), or by
    /// relaying them to the hub (`flotilla-gateway`, see [`crate::certificates::CsrRelay`]).
    pub fn with_certificates(
        store: Arc<dyn Store>,
        config: GatewayConfig,
        certificates: Arc<dyn ClusterCertificates>,
    ) -> Gateway {
        Self::build(store, config, Some(certificates))
    }

    fn build(
        store: Arc<dyn Store>,
        config: GatewayConfig,
        certificates: Option<Arc<dyn ClusterCertificates>>,
    ) -> Gateway {
        let metrics = GatewayMetrics::new();
        // Every request the gateway's parts make, counted by verb.
        let store = metrics.metered(store);
        let admissions = Admissions::new();
        let shards = watch::Sender::new(Arc::new(ShardView::all(
            flotilla_proto::contract::DEFAULT_SHARDS,
        )));
        // Every write the gateway makes for a cluster carries its fence, under its name.
        let fencing = Fencing::new(
            config.name.as_str(),
            metrics.fenced_write_counters(),
            config.fault.clone(),
        );
        // What the last write of each work returned, shared by the writers of works: a
        // finalizer's write is the basis of the work's first status write.
        let bases = WorkBases::new();
        let (health_writer, health) = HealthWriter::new(
            store.clone(),
            config.grace_period,
            admissions.clone(),
            shards.subscribe(),
            fencing.clone(),
        );
        // One budget for every writer of the gateway: the hub apiserver sees at most this
        // many writes per second from it, whatever mix of statuses and finalizers.
        let budget = Arc::new(WriteBudget::new(
            f64::from(config.status_writes_per_second),
            config.status_write_burst,
        ));
        let statuses = StatusWriter::new(
            budget.clone(),
            config.status_write_concurrency,
            shards.subscribe(),
            fencing.clone(),
            bases.clone(),
        );
        let compliance = ComplianceWriter::new(
            budget.clone(),
            config.status_write_concurrency,
            shards.subscribe(),
            fencing.clone(),
        );
        // Without leases the gateway serves from the start (sessions wait for the first load);
        // `lease_shards` turns this off until the shards it holds are loaded.
        let serving = watch::Sender::new(true);
        let accepting = watch::Sender::new(true);
        let gate = SessionGate::new(
            SessionRate::new(config.session_rate, config.session_burst),
            serving.subscribe(),
            accepting.subscribe(),
            metrics.new_connection_counters(),
        );
        // Within the same budget as status writes: a fleet-wide rollout acknowledged at once
        // must not turn into a burst of work updates on the hub apiserver.
        let finalizers = CleanupFinalizers::new(
            budget,
            config.status_write_concurrency,
            shards.subscribe(),
            fencing,
            bases,
        );
        Gateway {
            shared: Arc::new(Shared {
                store,
                config,
                health,
                registry: Arc::new(Registry::default()),
                desired: DesiredState::new(),
                policies: DesiredPolicies::new(admissions.clone()),
                statuses,
                compliance,
                finalizers,
                admissions,
                certificates,
                next_session: AtomicU64::new(1),
                started: std::time::SystemTime::now(),
                draining: watch::Sender::new(false),
                health_writer: SyncMutex::new(Some(health_writer)),
                shards,
                leasing: SyncMutex::new(None),
                metrics,
                gate,
                serving,
                accepting,
            }),
        }
    }

    /// Puts shard ownership on leases (scale-out mode): from now until the first lease round
    /// the gateway acts for no shard; then for those it holds, redirecting sessions of the
    /// others to their owners. Call before [`serve`](Self::serve), which runs the leasing.
    pub async fn lease_shards(&self, leasing: ShardLeasing) {
        self.shared
            .shards
            .send_replace(Arc::new(leasing.initial_view()));
        self.shared.serving.send_replace(false);
        *lock(&self.shared.leasing) = Some(leasing);
    }

    /// The shards this gateway acts for and the directory of the rest, as it changes.
    pub fn shard_views(&self) -> crate::shards::ShardViews {
        self.shared.shards.subscribe()
    }

    /// The gateway's cache of cluster admissions (the hub's join flow waits on it).
    pub fn admissions(&self) -> Arc<Admissions> {
        self.shared.admissions.clone()
    }

    /// Sends the hub's current CA bundle to every live session (after a CA rotation).
    pub fn push_trust_bundle(&self) {
        let Some(certs) = &self.shared.certificates else {
            return;
        };
        let bundle = certs.ca_bundle();
        for h in self.shared.registry.all() {
            h.mailbox.trust_bundle(bundle.clone());
        }
    }

    /// The new-session rate, for the TCP accept loop to ask before each handshake
    /// ([`AcceptLimits::gate`](flotilla_transport::tls::AcceptLimits::gate)); the QUIC
    /// listener given to [`serve`](Self::serve) asks it too.
    pub fn connection_gate(&self) -> Arc<dyn ConnectionGate> {
        self.shared.gate.clone()
    }

    /// The gateway's metrics, to register where `/metrics` is served.
    pub fn metrics(&self) -> &GatewayMetrics {
        &self.shared.metrics
    }

    /// Sets the gauges read at scrape time (the status write queue, the shards held). Never
    /// waits on the store.
    pub fn refresh_metrics(&self) {
        let shared = &self.shared;
        shared
            .metrics
            .status_queue
            .set(shared.statuses.pending_len() as i64);
        let held = shared.shards.borrow().held(Instant::now()).len();
        shared.metrics.shards_owned.set(held as i64);
        if let Some(works) = shared.desired.cached() {
            shared.metrics.cached_works.set(works as i64);
        }
        if let Some(clusters) = shared.admissions.cached() {
            shared.metrics.cached_clusters.set(clusters as i64);
        }
    }

    /// What a process with this gateway serves on `--metrics-addr`: `registry` (with the
    /// gateway's metrics in it) refreshed from the gateway at each scrape, and `readiness`.
    pub fn endpoint(
        &self,
        registry: prometheus_client::registry::Registry,
        readiness: Vec<flotilla_ops::ReadyFlag>,
    ) -> flotilla_ops::Endpoint {
        let refreshed = self.clone();
        flotilla_ops::Endpoint::new(registry, flotilla_ops::Readiness::new(readiness))
            .refresh_with(move || refreshed.refresh_metrics())
    }

    /// What the gateway needs before it can serve sessions: both watch caches listed from the
    /// store (which is then reachable). Until then sessions wait, and `/readyz` says why. A
    /// draining gateway is not ready either: a load balancer should send it no new agents.
    pub fn readiness(&self) -> Vec<flotilla_ops::ReadyFlag> {
        vec![
            flotilla_ops::ReadyFlag::unless(
                "the gateway is draining its sessions (shutting down)",
                self.shared.draining.subscribe(),
            ),
            flotilla_ops::ReadyFlag::watching(
                "the ManagedCluster watch cache (admissions) has not listed from the store yet",
                self.shared.admissions.ready(),
            ),
            flotilla_ops::ReadyFlag::watching(
                "the ManifestWork watch cache (desired state) has not listed from the store yet",
                self.shared.desired.ready(),
            ),
            flotilla_ops::ReadyFlag::watching(
                "the Policy watch cache (governance) has not listed from the store yet",
                self.shared.policies.ready(),
            ),
            flotilla_ops::ReadyFlag::watching(
                "the gateway has not read the shard leases yet (new connections are closed before \
                 TLS), or has loaded none of the shards it holds (they wait in the backlog)",
                self.shared.serving.subscribe(),
            ),
        ]
    }

    /// Number of live sessions.
    pub fn session_count(&self) -> usize {
        self.shared.registry.len()
    }

    /// Whether `cluster` holds a session on this gateway (and on which carrier, since when), or
    /// when its last one here ended.
    pub fn session_presence(&self, cluster: &str) -> Option<crate::registry::SessionPresence> {
        self.shared.registry.presence(cluster)
    }

    /// What the sessions' drivers share, for the crate's tests.
    #[cfg(test)]
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Replaces the shard view, as a lease round would.
    #[cfg(test)]
    pub(crate) fn set_shard_view(&self, view: ShardView) {
        self.shared.shards.send_replace(Arc::new(view));
    }

    /// How long this gateway waits for an agent to take a tunnel it asked for.
    pub(crate) fn tunnel_open_timeout(&self) -> Duration {
        self.shared.config.tunnel_open_timeout
    }

    /// Opens tunnel stream `id` to `cluster`'s agent over its session's connection (a QUIC
    /// stream, or a `Fleet.Tunnel` call the session asks the agent to open).
    pub async fn open_tunnel(&self, cluster: &str, id: &str) -> Result<TunnelStream, TunnelError> {
        let registry = &self.shared.registry;
        let Some(handle) = registry.get(cluster) else {
            let away = match registry.departed(cluster) {
                Some(at) => Away::Since(at),
                None => Away::NotSince(self.shared.started),
            };
            return Err(TunnelError::NoSession {
                cluster: cluster.to_string(),
                away,
            });
        };
        let within = self.shared.config.tunnel_open_timeout;
        let opening = handle.tunnels.open(id, within);
        if handle.tunnels.needs_open_tunnel_frame() {
            // The tunnel is awaited (first poll) before the agent is asked to open it.
            let ask = async { handle.mailbox.open_tunnel(id) };
            let (opened, ()) = tokio::join!(opening, ask);
            opened
        } else {
            opening.await
        }
        .map_err(|source| TunnelError::Link {
            cluster: cluster.to_string(),
            source,
        })
    }

    /// Serves sessions from `listeners` until `shutdown` completes, then drains: stops
    /// accepting, drains every session that exists at any point of the drain (each told to
    /// come back after its share of the drain window), and at the drain deadline closes
    /// what is left. `extra` adds gRPC services on the same listener (the hub's
    /// `Registration`, so a joining agent dials the address it will hold its session on).
    pub async fn serve(
        self,
        listeners: Listeners,
        extra: Option<tonic::service::RoutesBuilder>,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), GatewayError> {
        let shared = self.shared.clone();
        let (stop_tx, stop_rx) = watch::channel(false);
        let config = &shared.config;
        // The caches and writers run until told to stop; one that ends before is a fault the
        // gateway cannot serve through (sessions would be synced from a dead cache).
        let mut tasks = Tasks::new();
        tasks.spawn(
            "the ManagedCluster watch cache",
            shared
                .admissions
                .clone()
                .run(
                    shared.store.clone(),
                    shared.registry.clone(),
                    shared.shards.subscribe(),
                    stop_rx.clone(),
                )
                .map(Ok),
        );
        tasks.spawn(
            "the ManifestWork watch cache",
            shared
                .desired
                .clone()
                .run(
                    shared.store.clone(),
                    shared.registry.clone(),
                    shared.finalizers.clone(),
                    shared.shards.subscribe(),
                    stop_rx.clone(),
                )
                .map(Ok),
        );
        tasks.spawn(
            "the Policy watch cache",
            shared
                .policies
                .clone()
                .run(
                    shared.store.clone(),
                    shared.registry.clone(),
                    stop_rx.clone(),
                )
                .map(Ok),
        );
        tasks.spawn(
            "the status writer",
            shared
                .statuses
                .clone()
                .run(
                    shared.store.clone(),
                    shared.desired.clone(),
                    stop_rx.clone(),
                )
                .map(Ok),
        );
        tasks.spawn(
            "the policy compliance writer",
            shared
                .compliance
                .clone()
                .run(
                    shared.store.clone(),
                    shared.finalizers.clone(),
                    stop_rx.clone(),
                )
                .map(Ok),
        );
        tasks.spawn(
            "the cleanup finalizer writer",
            shared
                .finalizers
                .clone()
                .run(
                    shared.store.clone(),
                    shared.desired.clone(),
                    stop_rx.clone(),
                )
                .map(Ok),
        );
        let leasing = lock(&shared.leasing).take();
        if let Some(leasing) = leasing {
            tasks.spawn(
                "the shard leases",
                leasing
                    .run(
                        shared.shards.clone(),
                        shared.registry.clone(),
                        config.drain_window,
                        stop_rx.clone(),
                    )
                    .map(Ok),
            );
        }
        tasks.spawn(
            "the serving flag",
            crate::shards::cache::follow_serving(
                shared.shards.subscribe(),
                shared.admissions.loaded_shards(),
                shared.desired.loaded_shards(),
                (shared.serving.clone(), shared.accepting.clone()),
                stop_rx.clone(),
            )
            .map(Ok),
        );
        let health = lock(&shared.health_writer).take();
        if let Some(health) = health {
            tasks.spawn("the health writer", health.run(stop_rx.clone()).map(Ok));
        }

        // The carriers stop accepting when the drain starts, and end when their last
        // connection does: during a drain their end is expected.
        let (incoming_tx, mut incoming) = mpsc::channel::<Incoming>(INCOMING_BUFFER);
        let mut routes = extra.unwrap_or_default();
        let fleet = FleetService::new(incoming_tx.clone());
        // Tunnels as plain HTTP/2 streams, beside the `Tunnel` calls of earlier agents.
        routes.add_service(fleet.bytes_service());
        routes.add_service(fleet.into_server(config.max_frame_bytes));
        // Tunnels other gateways and the hub relay through this one to the sessions it holds.
        routes.add_service(
            RelayService::new(Arc::new(self.clone()), config.relay_idle_timeout).into_server(),
        );
        let routes = routes.routes();
        let mut carriers = Tasks::new();
        carriers.spawn(
            "the gRPC carrier",
            flotilla_transport::grpc::serve(
                listeners.tcp,
                routes,
                config.grpc(),
                shared.draining.subscribe(),
            )
            .map(|r| r.map_err(Into::into)),
        );
        if let Some(quic) = listeners.quic {
            let drain = shared.draining.subscribe();
            carriers.spawn(
                "the QUIC carrier",
                quic.gated(self.connection_gate())
                    .serve(incoming_tx.clone(), config.max_quic_handshakes, drain)
                    .map(Ok),
            );
        }
        drop(incoming_tx);

        let mut drivers = JoinSet::new();
        tokio::pin!(shutdown);
        let ended = loop {
            tokio::select! {
                Some(session) = incoming.recv() => self.spawn_driver(&mut drivers, session),
                Some(_) = drivers.join_next(), if !drivers.is_empty() => {}
                ended = tasks.first_end() => break Some(ended),
                ended = carriers.first_end() => break Some(ended),
                _ = &mut shutdown => break None,
            }
        };
        if let Some(ended) = ended {
            let _ = stop_tx.send(true);
            drivers.shutdown().await;
            carriers.stop_within(Duration::ZERO).await;
            tasks.stop_within(STOP_TIMEOUT).await;
            return Err(ended.into());
        }

        let sessions = drivers.len();
        info!(sessions, "draining sessions");
        shared.draining.send_replace(true);
        let deadline = Instant::now() + config.drain_timeout;
        // Sessions still arriving (handshakes that were in flight) are drained as they open.
        let mut carriers_done = false;
        loop {
            if carriers_done && drivers.is_empty() {
                break;
            }
            tokio::select! {
                Some(session) = incoming.recv() => self.spawn_driver(&mut drivers, session),
                Some(_) = drivers.join_next(), if !drivers.is_empty() => {}
                _ = carriers.first_end(), if !carriers.is_empty() => {}
                _ = std::future::ready(()), if carriers.is_empty() && !carriers_done => carriers_done = true,
                _ = tokio::time::sleep_until(deadline) => {
                    warn!(left = drivers.len(), drain_timeout = ?config.drain_timeout, "drain deadline reached; closing the sessions left");
                    break;
                }
            }
        }
        drivers.shutdown().await;
        carriers.stop_within(Duration::ZERO).await;
        let _ = stop_tx.send(true);
        tasks.stop_within(STOP_TIMEOUT).await;
        Ok(())
    }

    fn spawn_driver(&self, drivers: &mut JoinSet<()>, session: Incoming) {
        let n = self.shared.next_session.fetch_add(1, Ordering::Relaxed);
        let who = session.peer.cluster().unwrap_or("-").to_string();
        let session_id = format!("{who}-{n}");
        let span =
            info_span!("session", cluster = %who, id = %session_id, peer = %session.peer.remote);
        drivers.spawn(drive(self.shared.clone(), session, session_id).instrument(span));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The gauges read at scrape time: statuses waiting for the writer (not running here, so
    /// they wait), and the shards held (all of them without leases).
    #[tokio::test]
    async fn the_status_queue_and_the_shards_are_read_at_each_scrape() {
        let dir = tempfile::tempdir().unwrap();
        let store = flotilla_store::SledStore::open(dir.path().join("store")).unwrap();
        let gateway = Gateway::new(Arc::new(store), GatewayConfig::default());
        let reporter = Arc::new(crate::mailbox::Mailbox::default());
        for (name, uid) in [("a", "uid-a"), ("b", "uid-b")] {
            gateway
                .shared
                .statuses
                .submit(&reporter, "store-1", name, uid, 1, b"{}")
                .await
                .unwrap();
        }
        let mut registry = flotilla_ops::registry();
        gateway.metrics().register(&mut registry);
        let endpoint = gateway.endpoint(registry, gateway.readiness());
        let page = flotilla_ops::exposition::check(&endpoint.metrics_text()).unwrap();
        assert_eq!(
            page.value("flotilla_gateway_status_write_queue_depth", &[]),
            Some(2.0)
        );
        assert_eq!(
            page.value("flotilla_gateway_shards_owned", &[]),
            Some(f64::from(flotilla_proto::contract::DEFAULT_SHARDS))
        );
        // Nothing has listed: not ready, and the probe says which caches.
        let (status, body) = endpoint.readyz();
        assert_eq!(status, 503);
        assert!(body.contains("ManagedCluster watch cache"), "{body}");
        assert!(!body.contains("draining"), "{body}");
        gateway.shared.draining.send_replace(true);
        let (_, body) = endpoint.readyz();
        assert!(body.contains("the gateway is draining"), "{body}");
    }
}
