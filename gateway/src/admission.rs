//! Which clusters may hold a session: the gateway's watch cache of ManagedClusters, checked at
//! every session open, and the trigger that closes live sessions when an operator revokes a
//! cluster.
//!
//! A certificate alone is not enough. A session opens only if the ManagedCluster named in the
//! certificate exists, has `spec.hubAcceptsClient: true`, is not denied, and lists the
//! certificate's public key among its registered keys (annotation [`KEY_PINS_ANNOTATION`],
//! written by the hub at join and at each renewal). This is an allow-list kept in the store, so
//! every gateway enforces the same revocations without a CRL: deleting or denying a cluster
//! removes everything, a rejoin or renewal replaces the keys, and a certificate whose key is
//! not listed is refused even while it is unexpired.
//!
//! The cache is one LIST + WATCH per gateway, of the shards it holds (see
//! [`crate::shards::cache`]); when a cluster stops being admitted (deleted,
//! denied, unaccepted, or the live session's key unlisted), its session here is closed at once.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, RwLock};

use async_trait::async_trait;
use flotilla_proto::api::Kind;
use flotilla_store::{Object, Store, WatchEvent};
use serde_json::Value;
use tokio::sync::watch;
use tracing::info;

use crate::locks::{read, write};
use crate::recorded_health::RecordedHealth;
use crate::registry::Registry;
use crate::shards::ShardViews;
use crate::shards::cache::{ShardCache, ShardLoad, ShardSet, follow_shards};

pub use flotilla_proto::contract::{
    DENIED_ANNOTATION, KEY_PINS_ANNOTATION, REQUESTED_AT_ANNOTATION, TOKEN_ANNOTATION,
};

/// What the store says about one cluster's right to a session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterAdmission {
    /// `spec.hubAcceptsClient`.
    pub accepted: bool,
    /// The deny annotation's reason, if denied.
    pub denied: Option<String>,
    /// Registered public keys, newest first.
    pub key_pins: Vec<String>,
    /// The health the store records, so a reconnect that changes nothing writes nothing.
    pub health: RecordedHealth,
    /// What the policies' hub templates read of the cluster.
    pub facts: ClusterFacts,
}

/// What hub templates (`{{hub ... hub}}`) read of a cluster: `.ManagedClusterLabels` and the
/// claims `fromClusterClaim` reads, from its ManagedCluster.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterFacts {
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// `status.clusterClaims[]`, name to value.
    pub claims: BTreeMap<String, String>,
}

impl ClusterFacts {
    /// Reads a stored ManagedCluster.
    pub fn from_object(obj: &Value) -> ClusterFacts {
        let strings = |value: &Value| {
            value
                .as_object()
                .into_iter()
                .flatten()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        };
        ClusterFacts {
            labels: strings(&obj["metadata"]["labels"]),
            claims: obj["status"]["clusterClaims"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|claim| {
                    Some((
                        claim["name"].as_str()?.to_string(),
                        claim["value"].as_str()?.to_string(),
                    ))
                })
                .collect(),
        }
    }
}

impl ClusterAdmission {
    /// Reads a stored ManagedCluster.
    pub fn from_object(obj: &Value) -> ClusterAdmission {
        let annotations = &obj["metadata"]["annotations"];
        ClusterAdmission {
            accepted: obj["spec"]["hubAcceptsClient"].as_bool().unwrap_or(false),
            denied: annotations[DENIED_ANNOTATION].as_str().map(str::to_string),
            key_pins: key_pins(obj),
            health: RecordedHealth::from_object(obj),
            facts: ClusterFacts::from_object(obj),
        }
    }
}

/// The registered key pins of a stored ManagedCluster, newest first.
pub fn key_pins(obj: &Value) -> Vec<String> {
    obj["metadata"]["annotations"][KEY_PINS_ANNOTATION]
        .as_str()
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::to_string)
        .collect()
}

/// Why a certificate may not open a session. Each says what the operator or the spoke must do;
/// none is retryable until that happens.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionRefusal {
    /// No ManagedCluster of that name: never joined, or deleted (revoked). Not retryable:
    /// the spoke must join again with a bootstrap token.
    #[error(
        "cluster {cluster} is not registered with this hub (never joined, or deleted): join again \
         with a bootstrap token (`flotilla token create`, then `flotilla-agent join`)"
    )]
    NotRegistered { cluster: String },
    /// Denied by an operator. Not retryable: an operator must delete the cluster before it can
    /// join again.
    #[error(
        "cluster {cluster} was denied by the hub: {reason}; an operator must delete it \
         (`flotilla cluster delete {cluster}`) before it can join again"
    )]
    Denied { cluster: String, reason: String },
    /// Registered but not (or no longer) accepted. Not retryable until an operator accepts.
    #[error(
        "cluster {cluster} is not accepted by the hub (spec.hubAcceptsClient is false): an \
         operator must run `flotilla cluster accept {cluster}`"
    )]
    NotAccepted { cluster: String },
    /// The certificate's key is not one the cluster registered (replaced by a rejoin, or
    /// revoked). Not retryable with this certificate: join again with a new token.
    #[error(
        "the certificate's key is not registered for cluster {cluster} (revoked or replaced): \
         join again with a new bootstrap token"
    )]
    KeyNotRegistered { cluster: String },
}

impl AdmissionRefusal {
    /// The kind of refusal, as the agent is told it.
    pub fn refusal(&self) -> flotilla_proto::wire::Refusal {
        use flotilla_proto::wire::Refusal;
        match self {
            AdmissionRefusal::NotRegistered { .. } => Refusal::ClusterNotRegistered,
            AdmissionRefusal::Denied { .. } => Refusal::ClusterDenied,
            AdmissionRefusal::NotAccepted { .. } => Refusal::ClusterNotAccepted,
            AdmissionRefusal::KeyNotRegistered { .. } => Refusal::KeyNotRegistered,
        }
    }
}

/// The gateway's view of every ManagedCluster's admission, kept current by [`Admissions::run`].
#[derive(Default)]
pub struct Admissions {
    clusters: RwLock<HashMap<String, ClusterAdmission>>,
    /// Set once the first list is loaded: a gateway that has not read the clusters yet refuses
    /// nobody by mistake; sessions wait for it.
    ready: watch::Sender<bool>,
    /// The shards listed so far: a session waits for its cluster's shard, so a gateway that
    /// just acquired the shard refuses nobody as "not registered" by mistake.
    load: ShardLoad,
    /// Bumped on every change, for waiters such as a pending join (which thereby costs the
    /// store nothing while it waits).
    changes: watch::Sender<u64>,
}

impl Admissions {
    pub fn new() -> Arc<Admissions> {
        Arc::new(Admissions::default())
    }

    /// True once the first list is loaded.
    pub fn ready(&self) -> watch::Receiver<bool> {
        self.ready.subscribe()
    }

    /// The shards loaded, as they change.
    pub fn loaded_shards(&self) -> watch::Receiver<Option<crate::shards::cache::ShardSet>> {
        self.load.subscribe()
    }

    /// Whether a session for `cluster` authenticated with key `key_sha256` may open.
    pub async fn check(&self, cluster: &str, key_sha256: &str) -> Result<(), AdmissionRefusal> {
        self.load.wait_for(cluster).await;
        let clusters = read(&self.clusters);
        verdict(cluster, clusters.get(cluster), key_sha256)
    }

    /// [`check`](Self::check), reading the cluster from the store when the cache has no such
    /// cluster: one just registered may not carry its shard label yet (the hub's labeller adds
    /// it within a watch event), and a gateway's cache reads only labelled clusters. Costs one
    /// read per session refused as not registered, and those are paced by the session rate.
    pub async fn check_or_read(
        &self,
        store: &dyn Store,
        cluster: &str,
        key_sha256: &str,
    ) -> Result<(), AdmissionRefusal> {
        match self.check(cluster, key_sha256).await {
            Err(AdmissionRefusal::NotRegistered { .. }) => {
                // The store away: the cache's answer stands.
                let stored = store
                    .get(Kind::ManagedCluster, None, cluster)
                    .await
                    .unwrap_or_default();
                let admission = stored.as_ref().map(ClusterAdmission::from_object);
                verdict(cluster, admission.as_ref(), key_sha256)
            }
            other => other,
        }
    }

    /// How many clusters the cache holds; `None` if it is being written at this instant.
    pub fn cached(&self) -> Option<usize> {
        Some(self.clusters.try_read().ok()?.len())
    }

    /// The cached admission of `cluster`, if the cache has seen it.
    pub fn get(&self, cluster: &str) -> Option<ClusterAdmission> {
        read(&self.clusters).get(cluster).cloned()
    }

    /// The clusters recorded Available (Joined and Available True, untainted) that `pick`
    /// selects by name.
    /// Waits for the first list, as [`check`](Self::check) does.
    pub async fn available_where(&self, pick: impl Fn(&str) -> bool) -> Vec<String> {
        let mut ready = self.ready.subscribe();
        let _ = ready.wait_for(|r| *r).await;
        read(&self.clusters)
            .iter()
            .filter(|(name, a)| a.health.available && !a.health.unreachable && pick(name))
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Waits until the cache has listed every shard of `shards` (a shard just taken over is
    /// listed a moment after the view changes). Never returns for a shard that is not
    /// listed again: callers bound the wait.
    pub async fn wait_loaded(&self, shards: &HashSet<u32>) {
        let mut loaded = self.load.subscribe();
        let _ = loaded
            .wait_for(|l| {
                l.as_ref()
                    .is_some_and(|set| shards.iter().all(|s| set.has_shard(*s)))
            })
            .await;
    }

    /// A receiver that changes whenever any cluster's admission may have changed.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Keeps the cache in step with the store's clusters in the shards `shards` says this
    /// gateway holds, until `stop` fires (see [`follow_shards`]), closing the sessions of
    /// clusters that stop being admitted.
    pub async fn run(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        registry: Arc<Registry>,
        shards: ShardViews,
        stop: watch::Receiver<bool>,
    ) {
        let target = Reflecting {
            admissions: &self,
            registry: &registry,
        };
        follow_shards(Kind::ManagedCluster, store.as_ref(), &target, shards, stop).await;
    }

    async fn apply(&self, event: WatchEvent, registry: &Registry) {
        match event {
            WatchEvent::Added(obj) | WatchEvent::Modified(obj) => {
                let Some(name) = obj["metadata"]["name"].as_str().map(str::to_string) else {
                    return;
                };
                let admission = ClusterAdmission::from_object(&obj);
                let before = write(&self.clusters).insert(name.clone(), admission.clone());
                // Most writes of a cluster (its status, as its health is recorded) change
                // nothing here: at 10,000 clusters, waking every follower for each would keep
                // them busy comparing.
                if before.as_ref() != Some(&admission) {
                    self.changed();
                }
                enforce(registry, &name, Some(&admission));
            }
            WatchEvent::Deleted(obj) => {
                let Some(name) = obj["metadata"]["name"].as_str().map(str::to_string) else {
                    return;
                };
                if write(&self.clusters).remove(&name).is_some() {
                    self.changed();
                }
                enforce(registry, &name, None);
            }
        }
    }

    async fn replace(&self, items: Vec<Object>, set: &ShardSet, registry: &Registry) {
        let fresh: HashMap<String, ClusterAdmission> = items
            .iter()
            .filter_map(|obj| {
                let name = obj["metadata"]["name"].as_str()?.to_string();
                // Labelled with a held shard but not of one (a label the hub has yet to
                // correct): not this gateway's.
                set.has_cluster(&name)
                    .then(|| (name, ClusterAdmission::from_object(obj)))
            })
            .collect();
        *write(&self.clusters) = fresh.clone();
        self.changed();
        // A relist can hide a revocation that happened while the watch was down. Only for
        // the clusters this list speaks for: a session of a shard no longer held is being
        // handed over, not revoked.
        for handle in registry.all() {
            if set.has_cluster(&handle.cluster) {
                enforce(registry, &handle.cluster, fresh.get(&handle.cluster));
            }
        }
        info!(clusters = fresh.len(), %set, "cluster admissions loaded");
        self.ready.send_replace(true);
    }

    /// Forgets the clusters outside `set`, closing no session: shards handed over.
    async fn retain(&self, set: &ShardSet) {
        write(&self.clusters).retain(|name, _| set.has_cluster(name));
        self.changed();
    }
}

/// The admissions and the sessions they govern, as one [`Reflector`].
struct Reflecting<'a> {
    admissions: &'a Admissions,
    registry: &'a Registry,
}

#[async_trait]
impl ShardCache for Reflecting<'_> {
    async fn replace(&self, items: Vec<Object>, set: &ShardSet) {
        self.admissions.replace(items, set, self.registry).await;
    }
    async fn apply(&self, event: WatchEvent, set: &ShardSet) {
        if !set.has_cluster(flotilla_store::name_of(event.object())) {
            return;
        }
        self.admissions.apply(event, self.registry).await;
    }
    async fn retain(&self, set: &ShardSet) {
        self.admissions.retain(set).await;
    }
    fn load(&self) -> &ShardLoad {
        &self.admissions.load
    }
}

fn verdict(
    cluster: &str,
    admission: Option<&ClusterAdmission>,
    key_sha256: &str,
) -> Result<(), AdmissionRefusal> {
    let cluster = cluster.to_string();
    let Some(a) = admission else {
        return Err(AdmissionRefusal::NotRegistered { cluster });
    };
    if let Some(reason) = &a.denied {
        return Err(AdmissionRefusal::Denied {
            cluster,
            reason: reason.clone(),
        });
    }
    if !a.accepted {
        return Err(AdmissionRefusal::NotAccepted { cluster });
    }
    if !a.key_pins.iter().any(|p| p == key_sha256) {
        return Err(AdmissionRefusal::KeyNotRegistered { cluster });
    }
    Ok(())
}

/// Closes the cluster's live session on this gateway if it is no longer admitted.
fn enforce(registry: &Registry, cluster: &str, admission: Option<&ClusterAdmission>) {
    let Some(handle) = registry.get(cluster) else {
        return;
    };
    if let Err(refusal) = verdict(cluster, admission, &handle.client_key_sha256) {
        info!(cluster, session = %handle.session_id, reason = %refusal, "closing the session of a revoked cluster");
        handle
            .mailbox
            .refuse(refusal.refusal(), refusal.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(obj: Option<Value>, key: &str, expected: Result<(), &str>) {
        let admission = obj.as_ref().map(ClusterAdmission::from_object);
        let got = verdict("store-1", admission.as_ref(), key).map_err(|e| e.to_string());
        match (got, expected) {
            (Ok(()), Ok(())) => {}
            (Err(msg), Err(want)) => assert!(msg.contains(want), "{msg:?} lacks {want:?}"),
            (got, want) => panic!("got {got:?}, want {want:?} for {obj:?}"),
        }
    }

    fn cluster(accepted: bool, annotations: Value) -> Option<Value> {
        Some(json!({
            "metadata": { "name": "store-1", "annotations": annotations },
            "spec": { "hubAcceptsClient": accepted },
        }))
    }

    #[test]
    fn admission_rules() {
        let pinned = json!({ KEY_PINS_ANNOTATION: "new,old" });
        check(cluster(true, pinned.clone()), "new", Ok(()));
        check(cluster(true, pinned.clone()), "old", Ok(()));
        check(
            cluster(true, pinned.clone()),
            "other",
            Err("key is not registered"),
        );
        check(
            cluster(false, pinned),
            "new",
            Err("flotilla cluster accept store-1"),
        );
        check(
            cluster(
                false,
                json!({ KEY_PINS_ANNOTATION: "new", DENIED_ANNOTATION: "stolen" }),
            ),
            "new",
            Err("denied by the hub: stolen"),
        );
        check(None, "new", Err("not registered with this hub"));
        check(
            cluster(true, json!({})),
            "new",
            Err("key is not registered"),
        );
    }
}
