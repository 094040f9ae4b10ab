//! What a session works on, on the spoke side: the durable cache, the reconciler's handle, the
//! tunnel server's, and whoever watches the session ([`Observer`]).

use std::sync::Arc;

use flotilla_proto::wire;
use tokio::sync::{Notify, watch};

use crate::cache::{CachedWork, WorkCache};
use crate::metrics::AgentMetrics;
use crate::policies::PolicyHandle;
use crate::reconcile::ReconcileHandle;
use crate::refusal::Refusal;
use crate::tunnel::TunnelHandle;

/// The spoke side of the agent, as the session driver sees it.
#[derive(Clone)]
pub struct Spoke {
    /// The durable cache: works are stored here before they are acked; statuses wait here
    /// until the hub acks them.
    pub cache: Arc<dyn WorkCache>,
    /// Tells the reconciler which works changed.
    pub reconciler: ReconcileHandle,
    /// Tells the policy desk which of the cluster's policies changed.
    pub policies: PolicyHandle,
    /// Woken by the reconciler when the outbox has a new status.
    pub outbox_changed: Arc<Notify>,
    /// The spoke's Kubernetes version for the hello; empty until known.
    pub kubernetes_version: watch::Receiver<String>,
    /// What the agent reports about its spoke; sent after the welcome and on every change.
    pub cluster_info: watch::Receiver<wire::ClusterInfo>,
    /// Told what the session does.
    pub observer: Arc<dyn Observer>,
    /// Hands the session's tunnels to the tunnel server, never waiting on it.
    pub tunnels: TunnelHandle,
    /// Shows whether a session is established, and on which carrier.
    pub metrics: AgentMetrics,
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
    /// A dial or session open failed before Welcome (the hub unreachable, a certificate or
    /// the cluster refused); the agent backs off.
    fn connection_failed(&self, _refusal: &Refusal) {}
    /// The gateway was over its new-session rate and turned the connection away before TLS,
    /// telling the agent to come back after `retry_after`.
    fn turned_away(&self, _retry_after: std::time::Duration) {}
    /// The gateway reached named the gateway that owns this cluster's shard, `to`; the agent
    /// goes there next.
    fn redirected(&self, _to: &str) {}
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
