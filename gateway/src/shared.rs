//! What the gateway's parts share behind one `Arc`: each session's driver reads the config,
//! the watch caches, the writers and the shard view in it; `serve` builds it and runs the
//! gateway-wide tasks it holds until they start. Its own module so that `serve` (which starts
//! drivers) and `driver` (which reads it) both import it and neither imports the other.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use flotilla_store::Store;
use tokio::sync::watch;

use crate::admission::Admissions;
use crate::certificates::ClusterCertificates;
use crate::compliance::ComplianceWriter;
use crate::config::GatewayConfig;
use crate::desired::DesiredState;
use crate::finalizers::CleanupFinalizers;
use crate::health::{HealthReports, HealthWriter};
use crate::locks::SyncMutex;
use crate::metrics::GatewayMetrics;
use crate::policies::DesiredPolicies;
use crate::rate::SessionGate;
use crate::registry::Registry;
use crate::shards::{ShardLeasing, ShardView};
use crate::statuses::StatusWriter;

/// What every session driver shares, and the gateway-wide parts `serve` runs.
pub(crate) struct Shared {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) config: GatewayConfig,
    pub(crate) health: HealthReports,
    pub(crate) registry: Arc<Registry>,
    pub(crate) desired: Arc<DesiredState>,
    /// The governance policies each cluster carries, delivered beside its works.
    pub(crate) policies: Arc<DesiredPolicies>,
    pub(crate) statuses: Arc<StatusWriter>,
    /// Agents' policy compliance, into each cluster's ClusterCompliance.
    pub(crate) compliance: Arc<ComplianceWriter>,
    /// Adds and removes ManifestWorks' cleanup finalizers as agents acknowledge and release.
    pub(crate) finalizers: Arc<CleanupFinalizers>,
    pub(crate) admissions: Arc<Admissions>,
    /// The hub's CA, for renewals over the session; `None` on a gateway that cannot sign.
    pub(crate) certificates: Option<Arc<dyn ClusterCertificates>>,
    pub(crate) next_session: AtomicU64,
    /// When this gateway started (wall time): a cluster that has held no session since is
    /// told so to a kubectl request.
    pub(crate) started: std::time::SystemTime,
    /// Turns true when the gateway starts draining: every session, whenever it opens, is
    /// drained from then on.
    pub(crate) draining: watch::Sender<bool>,
    /// The health task, until `serve` takes it to run.
    pub(crate) health_writer: SyncMutex<Option<HealthWriter>>,
    /// The shards this gateway acts for and who holds the others: every shard (single node)
    /// unless [`crate::Gateway::lease_shards`] put it on leases.
    pub(crate) shards: watch::Sender<Arc<ShardView>>,
    /// The lease driver, until `serve` takes it to run.
    pub(crate) leasing: SyncMutex<Option<ShardLeasing>>,
    /// What `/metrics` shows of the gateway; the store above already counts into it.
    pub(crate) metrics: GatewayMetrics,
    /// The new-session rate both carriers ask before each handshake.
    pub(crate) gate: Arc<SessionGate>,
    /// Whether the gateway serves new connections at all ([`crate::shards::cache::serving`]);
    /// the gate closes them before TLS while it does not.
    pub(crate) serving: watch::Sender<bool>,
    /// Whether the carriers accept new connections ([`crate::shards::cache::accepting`]):
    /// not while the gateway loads the shards it holds, so they wait in the backlog.
    pub(crate) accepting: watch::Sender<bool>,
}
