//! The hub's controllers: what acts on Placements, ManagedClusterSets,
//! ManifestWorkReplicaSets and finished ManifestWorks. Each keeps a watch cache of the store
//! with the one list-then-watch loop (`flotilla_store::reflect`, through [`feed`] where it
//! reads several kinds) as a model it owns alone, decides with pure code, and writes back
//! through the `Store` trait only what differs. They run the same on both store backends, in
//! the hub process, started by [`run`].
//!
//! * [`clustersets`]: OCM's `default` and `global` ManagedClusterSets, the default set's label
//!   on clusters without one, `timeAdded` on taints, and the sets' and bindings' conditions.
//! * [`scheduling`]: Placement → PlacementDecision (and the Placement's status).
//! * [`rollout`]: which clusters a rollout strategy lets a new revision reach now (pure).
//! * [`replicaset`]: ManifestWorkReplicaSet → ManifestWorks per placement decision, rolled out
//!   by the strategy, status summarised, cleaned up on delete. `flotilla work create
//!   --placement` creates one.
//! * [`work_ttl`]: deletes ManifestWorks whose `deleteOption.ttlSecondsAfterFinished` has
//!   passed since they turned Complete.
//! * [`acceptance`]: OCM's `HubAcceptedManagedCluster` condition on ManagedClusters, following
//!   `spec.hubAcceptsClient`.
//! * [`governance`]: PlacementBinding → the policies each selected cluster must carry (Policy
//!   subjects, PolicySets expanded), written into the root Policies' `status.placement[]` and
//!   `status.status[]` and the PolicySets' `status.placement[]`, and kept in memory per cluster
//!   ([`governance::PolicyAssignments`]) for delivery; no per-cluster copies are stored.
//! * [`chunk_gc`]: deletes ManifestChunks no ManifestWork in their namespace has named for
//!   the grace period (`--chunk-grace-period`).
//!
//! Not for: anything agents or gateways do; controllers never talk to spokes.

pub mod acceptance;
pub mod chunk_gc;
pub mod clustersets;
pub mod feed;
pub mod governance;
pub mod replicaset;
pub mod rollout;
pub mod scheduling;
pub mod shard_labels;
pub mod work_ttl;

use std::sync::Arc;
use std::time::Duration;

use flotilla_store::Store;
use jiff::Timestamp;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio::task::JoinSet;

/// Puts OCM's cleanup finalizer ([`WORK_CLEANUP_FINALIZER`]) on a ManifestWork the hub is
/// about to create (through its API, or for a ManifestWorkReplicaSet), so that its deletion
/// waits for the agent's release without the gateway writing the work once more when the agent
/// acknowledges it. A gateway lets a deleted work go at once when no agent ever reported on it
/// (see the gateway's finalizers).
pub fn with_cleanup_finalizer(work: &mut flotilla_store::Object) {
    use flotilla_proto::contract::WORK_CLEANUP_FINALIZER;
    use serde_json::Value;
    let Some(meta) = work.get_mut("metadata").and_then(Value::as_object_mut) else {
        return;
    };
    let finalizers = meta
        .entry("finalizers")
        .or_insert_with(|| Value::Array(Vec::new()));
    if finalizers.is_null() {
        *finalizers = Value::Array(Vec::new());
    }
    if let Some(list) = finalizers.as_array_mut()
        && !list.iter().any(|f| f == WORK_CLEANUP_FINALIZER)
    {
        list.push(Value::String(WORK_CLEANUP_FINALIZER.to_owned()));
    }
}

/// Default of [`ControllerConfig::write_concurrency`].
pub const DEFAULT_WRITE_CONCURRENCY: usize = 64;
/// Default of [`ControllerConfig::queue_capacity`].
pub const DEFAULT_QUEUE_CAPACITY: usize = 4096;
/// Default of [`ControllerConfig::batch`].
pub const DEFAULT_BATCH: usize = 20_000;

/// Settings of every controller.
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    /// Create OCM's `default` and `global` ManagedClusterSets and put clusters without a set
    /// label into `default`, as OCM's hub does (its `DefaultClusterSet` feature).
    pub default_cluster_sets: bool,
    /// Writes to the store in flight at once per controller.
    pub write_concurrency: usize,
    /// Changes waiting between the store's watches and a controller; a full queue holds the
    /// watches back.
    pub queue_capacity: usize,
    /// Most changes a controller takes in before it decides and writes.
    pub batch: usize,
    /// How long a ManifestChunk no work names is kept before it is deleted (see [`chunk_gc`]).
    pub chunk_grace_period: Duration,
    /// The fleet's virtual shards (`--shards`): what [`shard_labels`] labels clusters and works
    /// with, and the hub stamps on what it creates.
    pub shards: u32,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            default_cluster_sets: true,
            write_concurrency: DEFAULT_WRITE_CONCURRENCY,
            queue_capacity: DEFAULT_QUEUE_CAPACITY,
            batch: DEFAULT_BATCH,
            chunk_grace_period: humantime::parse_duration(chunk_gc::DEFAULT_CHUNK_GRACE_PERIOD)
                .expect("the default parses"),
            shards: flotilla_proto::contract::DEFAULT_SHARDS,
        }
    }
}

/// What the controllers count, for the hub's metrics endpoint.
#[derive(Clone, Debug, Default)]
pub struct ControllerMetrics {
    /// ManifestChunks deleted because no work named them.
    pub chunks_collected: Counter,
}

impl ControllerMetrics {
    /// Registers every metric under `flotilla_hub_`.
    pub fn register(&self, registry: &mut Registry) {
        registry.sub_registry_with_prefix("hub").register(
            "chunks_collected",
            "ManifestChunks deleted because no ManifestWork in their namespace named them for \
             the grace period (--chunk-grace-period)",
            self.chunks_collected.clone(),
        );
    }
}

/// A controller ended while the hub was serving: the hub cannot place or roll out without it,
/// so it exits and its supervisor restarts it. Not retryable in-process.
#[derive(Debug, thiserror::Error)]
pub enum ControllerEnded {
    /// It returned without being told to stop.
    #[error("the {controller} controller stopped on its own")]
    Stopped { controller: &'static str },
    /// It panicked (a bug; the message says where).
    #[error("the {controller} controller crashed: {cause}")]
    Crashed {
        controller: &'static str,
        cause: String,
    },
}

/// Runs every controller until `stop` turns true (or its sender is dropped), then waits for
/// them to finish their writes in flight. One that ends before that is an error naming it.
/// The governance controller keeps `policies` current (each cluster's policies) and
/// `compliance` (the fleet's compliance, for the metrics and the status page).
pub async fn run(
    store: Arc<dyn Store>,
    config: ControllerConfig,
    metrics: ControllerMetrics,
    policies: governance::PolicyAssignments,
    compliance: governance::ComplianceView,
    stop: watch::Receiver<bool>,
) -> Result<(), ControllerEnded> {
    let mut tasks: JoinSet<()> = JoinSet::new();
    let mut names = std::collections::HashMap::new();
    let mut spawn = |name: &'static str, task: futures::future::BoxFuture<'static, ()>| {
        names.insert(tasks.spawn(task).id(), name);
    };
    spawn(
        "cluster sets",
        Box::pin(clustersets::run(
            store.clone(),
            config.clone(),
            stop.clone(),
        )),
    );
    spawn(
        "placement scheduling",
        Box::pin(scheduling::run(store.clone(), config.clone(), stop.clone())),
    );
    spawn(
        "ManifestWorkReplicaSet",
        Box::pin(replicaset::run(store.clone(), config.clone(), stop.clone())),
    );
    spawn(
        "policy placement",
        Box::pin(governance::run(
            store.clone(),
            config.clone(),
            policies,
            compliance,
            stop.clone(),
        )),
    );
    spawn(
        "ManifestChunk collection",
        Box::pin(chunk_gc::run(
            store.clone(),
            config.chunk_grace_period,
            metrics.chunks_collected,
            stop.clone(),
        )),
    );
    spawn(
        "shard labels",
        Box::pin(shard_labels::run(
            store.clone(),
            config.shards,
            config.write_concurrency,
            config.queue_capacity,
            stop.clone(),
        )),
    );
    spawn(
        "cluster acceptance",
        Box::pin(acceptance::run(
            store.clone(),
            config.queue_capacity,
            stop.clone(),
        )),
    );
    spawn("work TTL", Box::pin(work_ttl::run(store, stop.clone())));
    while let Some(done) = tasks.join_next_with_id().await {
        let stopping = *stop.borrow() || stop.has_changed().is_err();
        let id = match &done {
            Ok((id, ())) => *id,
            Err(e) => e.id(),
        };
        let controller = names.get(&id).copied().unwrap_or("unnamed");
        match done {
            Err(e) if e.is_panic() || !stopping => {
                return Err(ControllerEnded::Crashed {
                    controller,
                    cause: e.to_string(),
                });
            }
            Ok(_) if !stopping => return Err(ControllerEnded::Stopped { controller }),
            // Told to stop: it finished its writes in flight.
            Ok(_) | Err(_) => {}
        }
    }
    Ok(())
}

/// Resolves once `stop` turns true or its sender is gone.
pub(crate) async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Sleeps until `at` (wall clock), or forever when `None`.
pub(crate) async fn delay_until(at: Option<Timestamp>) {
    match at {
        Some(at) => {
            let wait = at.duration_since(Timestamp::now());
            let wait = Duration::try_from(wait).unwrap_or(Duration::ZERO);
            tokio::time::sleep(wait).await;
        }
        None => std::future::pending().await,
    }
}
