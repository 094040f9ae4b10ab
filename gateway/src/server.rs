//! The `Fleet` gRPC service and one driver task per session.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use flotilla_proto::session::{HubConfig, HubEvent, HubSession};
use flotilla_proto::wire::fleet_server::{Fleet, FleetServer};
use flotilla_proto::wire::{AgentFrame, HubFrame, TunnelFrame};
use flotilla_store::Store;
use futures::Stream;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{Instrument, debug, info, info_span, warn};

use crate::admission::Admissions;
use crate::certificates::ClusterCertificates;
use crate::desired::DesiredState;
use crate::health::HealthTracker;
use crate::mailbox::{Mailbox, WorkChange};
use crate::registry::{Registry, SessionHandle};
use crate::statuses::StatusWriter;
use flotilla_proto::contract::ca_bundle_sha256;
use flotilla_transport::identity::Peer;
use flotilla_transport::tls::{AuthenticatedConn, ConnInfo};

/// Knobs of the session tier; every queue and size has a bound.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    pub heartbeat_interval: Duration,
    pub heartbeat_timeout: Duration,
    /// A connection that has not said Hello by then is closed.
    pub hello_timeout: Duration,
    /// Time without a session before a cluster turns Unknown.
    pub grace_period: Duration,
    /// Largest frame accepted from an agent; a larger one closes that session only.
    pub max_frame_bytes: usize,
    /// Distinct works that may wait in one session's outbound queue before it is reset.
    pub session_queue_bound: usize,
    /// Frames buffered between a session's driver and its HTTP/2 stream.
    pub send_buffer: usize,
    /// Budget of work-status writes to the store, per second, for the whole gateway.
    pub status_writes_per_second: u32,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            heartbeat_interval: Duration::from_secs(10),
            heartbeat_timeout: Duration::from_secs(30),
            hello_timeout: Duration::from_secs(10),
            grace_period: Duration::from_secs(40),
            max_frame_bytes: 4 * 1024 * 1024,
            session_queue_bound: 4096,
            send_buffer: 32,
            status_writes_per_second: 500,
        }
    }
}

/// Errors that stop the whole gateway; sessions' own failures never surface here.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The HTTP/2 server failed; retryable by restarting the gateway.
    #[error("gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// A session tier over one store.
#[derive(Clone)]
pub struct Gateway {
    shared: Arc<Shared>,
}

struct Shared {
    store: Arc<dyn Store>,
    config: GatewayConfig,
    health: Arc<HealthTracker>,
    registry: Arc<Registry>,
    desired: Arc<DesiredState>,
    statuses: Arc<StatusWriter>,
    admissions: Arc<Admissions>,
    /// The hub's CA, for renewals over the session; `None` on a gateway that cannot sign.
    certificates: Option<Arc<dyn ClusterCertificates>>,
    next_session: AtomicU64,
}

impl Gateway {
    /// A gateway that refuses certificate renewals (it has no CA to ask).
    pub fn new(store: Arc<dyn Store>, config: GatewayConfig) -> Gateway {
        Self::build(store, config, None)
    }

    /// A gateway that answers renewals with the hub's CA (the hub's in-process gateway).
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
        let admissions = Admissions::new();
        let health = HealthTracker::new(store.clone(), config.grace_period, admissions.clone());
        let statuses = StatusWriter::new(config.status_writes_per_second);
        Gateway {
            shared: Arc::new(Shared {
                store,
                config,
                health,
                registry: Arc::new(Registry::default()),
                desired: DesiredState::new(),
                statuses,
                admissions,
                certificates,
                next_session: AtomicU64::new(1),
            }),
        }
    }

    /// The gateway's cache of cluster admissions (the hub's join flow waits on it).
    pub fn admissions(&self) -> Arc<Admissions> {
        self.shared.admissions.clone()
    }

    /// Sends the hub's current CA bundle to every live session (after a CA rotation).
    pub async fn push_trust_bundle(&self) {
        let Some(certs) = &self.shared.certificates else {
            return;
        };
        let bundle = certs.ca_bundle();
        for h in self.shared.registry.all().await {
            h.mailbox.trust_bundle(bundle.clone()).await;
        }
    }

    /// Serves sessions on the authenticated connections until `shutdown` completes, with the
    /// watch cache and the status writer running beside them.
    pub async fn serve(
        self,
        conns: mpsc::Receiver<io::Result<AuthenticatedConn>>,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), GatewayError> {
        self.serve_with(conns, None, shutdown).await
    }

    /// [`serve`](Self::serve), with more gRPC services on the same listener (the hub adds
    /// `Registration`, so a joining agent dials the same address it will hold its session on).
    pub async fn serve_with(
        self,
        conns: mpsc::Receiver<io::Result<AuthenticatedConn>>,
        extra: Option<tonic::service::Routes>,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), GatewayError> {
        let shared = self.shared.clone();
        let (stop_tx, stop_rx) = watch::channel(false);
        let admissions = tokio::spawn(shared.admissions.clone().run(
            shared.store.clone(),
            shared.registry.clone(),
            stop_rx.clone(),
        ));
        let desired = tokio::spawn(shared.desired.clone().run(
            shared.store.clone(),
            shared.registry.clone(),
            stop_rx.clone(),
        ));
        let statuses = tokio::spawn(shared.statuses.clone().run(
            shared.store.clone(),
            shared.registry.clone(),
            shared.desired.clone(),
            stop_rx,
        ));
        let max = shared.config.max_frame_bytes;
        let keepalive = shared.config.heartbeat_interval;
        let service = FleetServer::new(self)
            .max_decoding_message_size(max)
            .max_encoding_message_size(max);
        let mut server = tonic::transport::Server::builder()
            // HTTP/2 pings find dead TCP connections even when the protocol is idle.
            .http2_keepalive_interval(Some(keepalive));
        let router = match extra {
            Some(routes) => server.add_routes(routes).add_service(service),
            None => server.add_service(service),
        };
        let served = router
            .serve_with_incoming_shutdown(ReceiverStream::new(conns), async {
                shutdown.await;
                // Say goodbye on every session so agents reconnect at once elsewhere rather
                // than wait for a heartbeat timeout.
                for h in shared.registry.all().await {
                    h.mailbox.close("gateway shutting down").await;
                }
            })
            .await;
        let _ = stop_tx.send(true);
        let _ = desired.await;
        let _ = statuses.await;
        let _ = admissions.await;
        served?;
        Ok(())
    }

    /// Number of live sessions.
    pub async fn session_count(&self) -> usize {
        self.shared.registry.len().await
    }
}

type HubStream = Pin<Box<dyn Stream<Item = Result<HubFrame, Status>> + Send>>;

#[tonic::async_trait]
impl Fleet for Gateway {
    type SessionStream = HubStream;
    type TunnelStream = HubTunnelStream;

    async fn session(
        &self,
        request: Request<Streaming<AgentFrame>>,
    ) -> Result<Response<HubStream>, Status> {
        let info = request
            .extensions()
            .get::<ConnInfo>()
            .cloned()
            .ok_or_else(|| Status::unauthenticated("no client certificate"))?;
        let cluster = match info.peer {
            Peer::Cluster(cluster) => cluster,
            Peer::Anonymous => {
                return Err(Status::unauthenticated(
                    "no client certificate: an agent joins first (`flotilla-agent join` with a \
                     bootstrap token) and opens its session with the certificate it receives",
                ));
            }
            Peer::Operator { .. } => {
                return Err(Status::permission_denied(
                    "only agent certificates (group flotilla:clusters) may open a session",
                ));
            }
        };
        let key = info.client_key_sha256.clone().unwrap_or_default();
        if let Err(refusal) = self.shared.admissions.check(&cluster, &key).await {
            warn!(cluster = %cluster, peer = %info.remote, reason = %refusal, "session refused");
            return Err(Status::permission_denied(refusal.to_string()));
        }
        let session_id = format!(
            "{cluster}-{}",
            self.shared.next_session.fetch_add(1, Ordering::Relaxed)
        );
        let (tx, rx) = mpsc::channel(self.shared.config.send_buffer);
        let shared = self.shared.clone();
        let span = info_span!("session", cluster = %cluster, id = %session_id, peer = %info.remote);
        tokio::spawn(
            drive(shared, cluster, key, session_id, request.into_inner(), tx).instrument(span),
        );
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn tunnel(
        &self,
        _request: Request<Streaming<TunnelFrame>>,
    ) -> Result<Response<HubTunnelStream>, Status> {
        Err(Status::unimplemented(
            "this gateway does not open tunnels yet",
        ))
    }
}

type HubTunnelStream = Pin<Box<dyn Stream<Item = Result<TunnelFrame, Status>> + Send>>;

/// One session, from the agent's first frame to its end: read input, feed the state machine,
/// write what it emits, arm the timer it asks for.
async fn drive(
    shared: Arc<Shared>,
    cluster: String,
    client_key_sha256: String,
    session_id: String,
    mut inbound: Streaming<AgentFrame>,
    out: mpsc::Sender<Result<HubFrame, Status>>,
) {
    let config = &shared.config;
    let mut machine = HubSession::new(
        Instant::now(),
        HubConfig {
            heartbeat_interval: config.heartbeat_interval,
            heartbeat_timeout: config.heartbeat_timeout,
            hello_timeout: config.hello_timeout,
            max_pending_works: config.session_queue_bound,
        },
        cluster.clone(),
        session_id.clone(),
    );
    let mailbox = Arc::new(Mailbox::default());
    let mut established = false;
    // The status sent to the agent when the transport itself fails (oversized frame, reset).
    let mut transport_error: Option<Status> = None;

    loop {
        // Handling an event can queue frames (the sync after Established) and more events: go
        // round until nothing is left, so nothing waits for the next wake-up.
        loop {
            while let Some(frame) = machine.poll_transmit() {
                if out.send(Ok(frame)).await.is_err() {
                    machine.close("agent stream closed");
                    break;
                }
            }
            let mut handled = false;
            while let Some(event) = machine.poll_event() {
                handled = true;
                match event {
                    HubEvent::Established { hello } => {
                        established = true;
                        // Register before taking the snapshot: a change that lands in between
                        // reaches the mailbox, and the machine treats it as newer than the snapshot.
                        let handle = SessionHandle {
                            cluster: cluster.clone(),
                            session_id: session_id.clone(),
                            client_key_sha256: client_key_sha256.clone(),
                            mailbox: mailbox.clone(),
                        };
                        if let Some(older) = shared.registry.register(&cluster, handle).await {
                            info!(older = %older.session_id, "replacing the cluster's older session");
                            older
                                .mailbox
                                .close("replaced by a newer session of the same cluster")
                                .await;
                        }
                        // A revocation between the check at open and the registration above found
                        // no session to close: look again now that it is registered.
                        if let Err(refusal) =
                            shared.admissions.check(&cluster, &client_key_sha256).await
                        {
                            warn!(reason = %refusal, "cluster revoked while its session opened");
                            machine.close(refusal.to_string());
                            continue;
                        }
                        if let Some(certs) = &shared.certificates {
                            let bundle = certs.ca_bundle();
                            if ca_bundle_sha256(&bundle) != hello.ca_bundle_sha256 {
                                debug!("agent trusts an older CA bundle; sending the current one");
                                machine.send_trust_bundle(bundle);
                            }
                        }
                        info!(agent_version = %hello.agent_version, held = hello.held.len(), "session established");
                        shared.health.connected(&cluster, &session_id, &hello).await;
                        shared.desired.wait_ready().await;
                        machine.begin_sync(shared.desired.snapshot(&cluster).await);
                    }
                    HubEvent::StatusReported {
                        uid,
                        generation,
                        seq,
                        status_json,
                    } => {
                        let Some(name) = shared.desired.owned_by(&cluster, &uid).await else {
                            warn!(work_uid = %uid, "status for a work that is not this cluster's; ignored");
                            continue;
                        };
                        debug!(work = %name, generation, seq, "status reported");
                        if let Err(e) = shared
                            .statuses
                            .submit(&cluster, &name, &uid, seq, &status_json)
                            .await
                        {
                            warn!(error = %e, "status refused");
                        }
                    }
                    HubEvent::WorkAcked {
                        uid,
                        generation,
                        current,
                    } => {
                        debug!(work_uid = %uid, generation, current, "work durable on the agent");
                    }
                    HubEvent::RenewalRequested { csr_pem } => {
                        let Some(certs) = &shared.certificates else {
                            machine.refuse_renewal(
                                "this gateway cannot issue certificates; renew through the hub",
                            );
                            continue;
                        };
                        match certs.renew(&cluster, &client_key_sha256, &csr_pem).await {
                            Ok(renewed) => {
                                info!("client certificate renewed over the session");
                                machine.issue_certificate(
                                    renewed.certificate_pem,
                                    renewed.ca_bundle_pem,
                                );
                            }
                            Err(e) => {
                                warn!(error = %e, "certificate renewal refused");
                                machine.refuse_renewal(e.to_string());
                            }
                        }
                    }
                    HubEvent::ClusterInfoReported { info } => {
                        shared.health.cluster_info(&cluster, &info).await;
                    }
                    HubEvent::Closed { reason, by_peer } => {
                        info!(%reason, by_peer, "session closed");
                    }
                    HubEvent::Alive { .. } => {}
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
        tokio::select! {
            frame = inbound.message() => match frame {
                Ok(Some(frame)) => {
                    // An error has already closed the session (Goodbye queued, Closed emitted).
                    if let Err(e) = machine.handle_frame(Instant::now(), frame) {
                        warn!(error = %e, "protocol error");
                    }
                }
                Ok(None) => machine.close("agent closed the stream"),
                Err(status) => {
                    let reason = describe_transport_error(&status, config.max_frame_bytes);
                    warn!(%reason, "closing session");
                    transport_error = Some(Status::new(status.code(), reason.clone()));
                    machine.close(reason);
                }
            },
            _ = sleep_until(deadline) => machine.handle_timeout(Instant::now()),
            _ = mailbox.ready(), if established => {
                let delivery = mailbox.take().await;
                for change in delivery.works {
                    match change {
                        WorkChange::Upsert(work) => machine.upsert_work(work),
                        WorkChange::Delete { uid, namespace, name } => machine.delete_work(uid, namespace, name),
                    }
                }
                for (uid, seq) in delivery.status_acks {
                    machine.ack_status(uid, seq);
                }
                if let Some(bundle) = delivery.trust_bundle {
                    machine.send_trust_bundle(bundle);
                }
                if let Some(reason) = delivery.close {
                    machine.close(reason);
                }
            }
        }
    }
    // Flush the Goodbye the machine queued on close, then the transport error, if any.
    while let Some(frame) = machine.poll_transmit() {
        let _ = out.try_send(Ok(frame));
    }
    if let Some(status) = transport_error {
        let _ = out.send(Err(status)).await;
    }
    if established {
        shared.registry.unregister(&cluster, &session_id).await;
        shared.health.disconnected(&cluster, &session_id).await;
    }
}

/// What a person needs to know about a transport failure of one session.
fn describe_transport_error(status: &Status, max_frame_bytes: usize) -> String {
    let msg = status.message();
    if msg.contains("message length too large") {
        format!(
            "frame exceeds the gateway's bound of {max_frame_bytes} bytes ({msg}); the session is closed, other sessions are unaffected"
        )
    } else {
        format!("transport error: {msg}")
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
