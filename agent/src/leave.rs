//! `flotilla-agent leave --hub NAME`: the agent stops serving one of its joined hubs
//! ([`crate::hubs`]) and takes from the spoke only what was that hub's.
//!
//! Every work of the hub is removed as its deletion from the hub would remove it: each object
//! by the work's `deleteOption` (orphaned objects stay), and an object another hub's agent also
//! applies keeps that hub's fields (only this hub's go). Then the hub's cache partition and
//! its identity are dropped. Run it with the agent stopped: the cache file is the agent's
//! while it runs, and a second opener is refused. The hub itself is not told: it still lists
//! the cluster until its operator removes it there (`flotilla cluster decommission`).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::info;

use crate::apply::{FieldManagers, HubNameError, KubeApplyTarget};
use crate::cache::{CacheDb, CacheError, WorkCache};
use crate::config::{AgentConfig, ConfigError};
use crate::hubs::{HubsError, JoinedHubs, cache_partition};
use crate::reconcile::reconcile_work_as;

/// Default of `leave --timeout`: how long the hub's objects may take to go (finalizers on the
/// spoke hold some) before `leave` gives up and says which works are left.
pub const DEFAULT_LEAVE_TIMEOUT: &str = "5m";
/// Pause between passes over the works whose objects are not gone yet.
const LEAVE_RETRY: Duration = Duration::from_secs(1);

/// Why a hub could not be left. Only [`LeaveError::NotGone`] is retryable (run `leave`
/// again); the others name what to fix.
#[derive(Debug, thiserror::Error)]
pub enum LeaveError {
    /// The hub is not joined, or the hubs cannot be read. Not retryable.
    #[error(transparent)]
    Hubs(#[from] HubsError),
    /// The hub's name in its file is not a DNS label. Not retryable.
    #[error(transparent)]
    HubName(#[from] HubNameError),
    /// The cache cannot be opened: the agent still runs, most likely. Not retryable until it
    /// is stopped.
    #[error("{0} (stop the agent before `flotilla-agent leave`: the cache is the running agent's)")]
    Open(CacheError),
    /// The cache cannot be read or written. Retryable once the disk is fixed.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// The spoke cannot be reached with the configured kubeconfig. Not retryable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The spoke client cannot be built. Not retryable.
    #[error("cannot build a client for the spoke apiserver: {0}")]
    SpokeClient(String),
    /// Some objects of the hub's works are not gone within the timeout (finalizers, or the
    /// spoke refusing). Retryable: `leave` again carries on where this one stopped.
    #[error(
        "hub {hub}: {count} of its works still have objects on the spoke after {timeout:?} ({works}); the hub stays joined: see the objects' finalizers, then run leave again"
    )]
    NotGone {
        hub: String,
        count: usize,
        works: String,
        timeout: Duration,
    },
}

/// What leaving took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Left {
    /// The hub's works removed from the spoke.
    pub works: usize,
}

/// Removes hub `hub`'s works from the spoke by their delete options, then its cache partition
/// and identity; gives up after `timeout` with the hub still joined.
pub async fn leave(config: &AgentConfig, hub: &str, timeout: Duration) -> Result<Left, LeaveError> {
    let hubs = JoinedHubs::in_data_dir(&config.data_dir);
    let joined = hubs.get(hub)?;
    let managers = FieldManagers::for_hub(&joined.name)?;
    let spoke_kube_api = config.spoke_kube_api();
    let client = kube::client::ClientBuilder::try_from(config.spoke_kube_config().await?)
        .map_err(|e| LeaveError::SpokeClient(e.to_string()))?
        .with_layer(&spoke_kube_api)
        .build();
    let target = KubeApplyTarget::new(client);
    let db = CacheDb::open(&config.cache_path()).map_err(LeaveError::Open)?;
    let partition = db.cluster(&cache_partition(&joined.name, &config.cluster_name));
    let cache: Arc<dyn WorkCache> = Arc::new(partition.clone());
    let works: Vec<_> = cache.works()?.into_iter().filter(|w| !w.policy).collect();
    for work in &works {
        cache.mark_deleting(&work.uid)?;
    }
    let deadline = Instant::now() + timeout;
    loop {
        let left: Vec<_> = cache.works()?.into_iter().filter(|w| !w.policy).collect();
        for work in &left {
            reconcile_work_as(&cache, &target, &managers, &work.uid).await?;
        }
        let left: Vec<_> = cache.works()?.into_iter().filter(|w| !w.policy).collect();
        if left.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            return Err(LeaveError::NotGone {
                hub: joined.name,
                count: left.len(),
                works: left
                    .iter()
                    .map(|w| w.display_name())
                    .collect::<Vec<_>>()
                    .join(", "),
                timeout,
            });
        }
        tokio::time::sleep(LEAVE_RETRY).await;
    }
    partition.clear()?;
    hubs.remove(&joined.name)?;
    info!(hub = %joined.name, works = works.len(), "left the hub: its works are removed from the spoke, its cache and identity dropped");
    Ok(Left { works: works.len() })
}
