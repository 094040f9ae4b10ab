//! Cluster health is the session: a live session keeps the ManagedCluster Joined and Available;
//! once the last session of a cluster has been gone for the grace period, Available turns
//! Unknown and the cluster gets OCM's `unreachable` taint so placements stop choosing it.
//!
//! Writes happen on transitions only (connect, grace expiry), never per heartbeat: the store (and
//! behind it, with the kube backend, the hub apiserver) sees O(transitions), not O(clusters ×
//! heartbeats). A connect that finds the cluster already recorded Available (in the gateway's
//! watch cache of ManagedClusters, see `admission`) with the same version and claims writes
//! nothing and reads nothing: a hub restarted under every session costs the store no request
//! for health.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use flotilla_proto::api::Kind;
use flotilla_proto::api::conditions::{
    self, ConditionStatus, MANAGED_CLUSTER_CONDITION_AVAILABLE, MANAGED_CLUSTER_JOINED,
};
use flotilla_proto::contract::check_cluster_info;
use flotilla_proto::wire;
use flotilla_store::{Store, StoreError};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use serde_json::{Value, json};
use tokio::sync::Mutex;
use tracing::{debug, info, warn};

use crate::admission::Admissions;

pub use flotilla_proto::contract::UNREACHABLE_TAINT;

/// Tracks which clusters hold a session, and writes their health transitions to the store.
pub struct HealthTracker {
    store: Arc<dyn Store>,
    grace_period: Duration,
    /// Per cluster: the id of its current session, or the epoch of its disconnection. A
    /// grace-period timer fires only if the epoch it was armed with is still current, so a
    /// reconnect in between cancels it without any timer bookkeeping.
    state: Mutex<HashMap<String, Presence>>,
    /// The gateway's watch cache of ManagedClusters: what the store records now.
    admissions: Arc<Admissions>,
    /// Clusters this tracker marked Unknown and has not marked Available since. Their watch
    /// event may not have reached the cache yet when the agent comes back, so a connect always
    /// writes for them.
    marked_unknown: Mutex<HashSet<String>>,
    /// The last cluster info written per cluster: a report repeated before the watch cache
    /// has seen the write is not written twice. One entry per cluster that reported.
    last_info: Mutex<HashMap<String, wire::ClusterInfo>>,
}

/// A ManagedCluster's health as stored: what a connect would otherwise write again.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecordedHealth {
    /// Joined and Available are both True.
    pub available: bool,
    /// It carries the unreachable taint.
    pub unreachable: bool,
    /// `status.version.kubernetes`.
    pub kubernetes_version: String,
    /// `status.clusterClaims` as (name, value).
    pub claims: Vec<(String, String)>,
    /// `status.capacity` and `status.allocatable`, quantities as written.
    pub capacity: BTreeMap<String, String>,
    pub allocatable: BTreeMap<String, String>,
}

impl RecordedHealth {
    /// Reads a stored ManagedCluster.
    pub fn from_object(obj: &Value) -> RecordedHealth {
        let conds = read_conditions(&obj["status"]);
        let is_true = |t: &str| conditions::is_condition_true(&conds, t);
        RecordedHealth {
            available: is_true(MANAGED_CLUSTER_JOINED)
                && is_true(MANAGED_CLUSTER_CONDITION_AVAILABLE),
            unreachable: obj["spec"]["taints"]
                .as_array()
                .is_some_and(|t| t.iter().any(|t| t["key"] == UNREACHABLE_TAINT)),
            kubernetes_version: obj["status"]["version"]["kubernetes"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            claims: obj["status"]["clusterClaims"]
                .as_array()
                .map(|claims| {
                    claims
                        .iter()
                        .map(|c| {
                            let field = |f: &str| c[f].as_str().unwrap_or_default().to_string();
                            (field("name"), field("value"))
                        })
                        .collect()
                })
                .unwrap_or_default(),
            capacity: resource_list(&obj["status"]["capacity"]),
            allocatable: resource_list(&obj["status"]["allocatable"]),
        }
    }

    /// Whether storing this report would change nothing.
    fn shows_info(&self, info: &wire::ClusterInfo) -> bool {
        let claims: Vec<(String, String)> = info
            .claims
            .iter()
            .map(|c| (c.name.clone(), c.value.clone()))
            .collect();
        claims == self.claims
            && (info.kubernetes_version.is_empty()
                || info.kubernetes_version == self.kubernetes_version)
            && info.capacity == self.capacity
            && info.allocatable == self.allocatable
    }

    /// Whether marking the cluster Available for this hello would change nothing.
    fn already_shows(&self, hello: &wire::Hello) -> bool {
        let claims: Vec<(String, String)> = hello
            .claims
            .iter()
            .map(|c| (c.name.clone(), c.value.clone()))
            .collect();
        self.available
            && !self.unreachable
            && (hello.kubernetes_version.is_empty()
                || hello.kubernetes_version == self.kubernetes_version)
            && (claims.is_empty() || claims == self.claims)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Presence {
    Connected { session_id: String },
    Gone { epoch: u64 },
}

impl HealthTracker {
    pub fn new(
        store: Arc<dyn Store>,
        grace_period: Duration,
        admissions: Arc<Admissions>,
    ) -> Arc<HealthTracker> {
        Arc::new(HealthTracker {
            store,
            grace_period,
            state: Mutex::new(HashMap::new()),
            admissions,
            marked_unknown: Mutex::new(HashSet::new()),
            last_info: Mutex::new(HashMap::new()),
        })
    }

    /// A session for `cluster` was established: mark it Joined and Available now.
    pub async fn connected(&self, cluster: &str, session_id: &str, hello: &wire::Hello) {
        self.state.lock().await.insert(
            cluster.to_string(),
            Presence::Connected {
                session_id: session_id.to_string(),
            },
        );
        let recorded = self.admissions.get(cluster).await.map(|a| a.health);
        let unknown_here = self.marked_unknown.lock().await.contains(cluster);
        if !unknown_here && recorded.is_some_and(|h| h.already_shows(hello)) {
            debug!(
                cluster,
                "cluster already recorded Available: nothing to write"
            );
            return;
        }
        match self.mark_available(cluster, hello).await {
            Ok(()) => {
                self.marked_unknown.lock().await.remove(cluster);
            }
            Err(e) => warn!(cluster, error = %e, "could not record the cluster as Available"),
        }
    }

    /// The session `session_id` of `cluster` ended. Unless a newer session arrives within the
    /// grace period, the cluster turns Unknown.
    pub async fn disconnected(self: &Arc<Self>, cluster: &str, session_id: &str) {
        static EPOCH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let epoch = EPOCH.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Kept for live sessions only; the watch cache answers for the next one.
        self.last_info.lock().await.remove(cluster);
        {
            let mut state = self.state.lock().await;
            match state.get(cluster) {
                // A newer session already replaced this one: nothing changes.
                Some(Presence::Connected {
                    session_id: current,
                }) if current != session_id => return,
                _ => {
                    state.insert(cluster.to_string(), Presence::Gone { epoch });
                }
            }
        }
        let this = self.clone();
        let cluster = cluster.to_string();
        tokio::spawn(async move {
            tokio::time::sleep(this.grace_period).await;
            let still_gone =
                this.state.lock().await.get(&cluster) == Some(&Presence::Gone { epoch });
            if still_gone {
                // Noted before the write: a connect racing it then writes Available after.
                this.marked_unknown.lock().await.insert(cluster.clone());
                if let Err(e) = this.mark_unknown(&cluster).await {
                    warn!(cluster, error = %e, "could not record the cluster as Unknown");
                }
            }
        });
    }

    /// The agent reported what it knows about its spoke (claims, version, capacity): written
    /// into the ManagedCluster's status when it differs from what the store records, so an
    /// agent that reports the same thing again costs the store nothing. A report beyond the
    /// bounds of `contract::claims` is refused with a warning naming the problem; the session
    /// and what is stored stay as they are.
    pub async fn cluster_info(&self, cluster: &str, info: &wire::ClusterInfo) {
        if let Err(problem) = check_cluster_info(info) {
            warn!(cluster, %problem, "cluster info refused; the ManagedCluster keeps what it has");
            return;
        }
        if self.last_info.lock().await.get(cluster) == Some(info) {
            return;
        }
        let recorded = self.admissions.get(cluster).await.map(|a| a.health);
        if recorded.is_some_and(|h| h.shows_info(info)) {
            debug!(cluster, "cluster info unchanged: nothing to write");
            return;
        }
        match self.write_cluster_info(cluster, info).await {
            Ok(()) => {
                info!(cluster, claims = info.claims.len(), "cluster info updated");
                self.last_info
                    .lock()
                    .await
                    .insert(cluster.to_string(), info.clone());
            }
            Err(e) => warn!(cluster, error = %e, "could not record the cluster's info"),
        }
    }

    /// Writes claims, version, capacity and allocatable into the status, from a fresh read and
    /// with its version as precondition: other writers of the same status (Available, Unknown)
    /// lose nothing, and a conflict is redone from a new read.
    async fn write_cluster_info(
        &self,
        cluster: &str,
        info: &wire::ClusterInfo,
    ) -> Result<(), StoreError> {
        const ATTEMPTS: usize = 5;
        for attempt in 1..=ATTEMPTS {
            let current = self.existing_cluster(cluster).await?;
            let mut status = current.get("status").cloned().unwrap_or_else(|| json!({}));
            status["clusterClaims"] = info
                .claims
                .iter()
                .map(|c| json!({ "name": c.name, "value": c.value }))
                .collect();
            if !info.kubernetes_version.is_empty() {
                status["version"] = json!({ "kubernetes": info.kubernetes_version });
            }
            // Like OCM's agent: capacity entries others added stay; allocatable is the agent's.
            let mut capacity = resource_list(&status["capacity"]);
            capacity.extend(info.capacity.clone());
            status["capacity"] = json!(capacity);
            status["allocatable"] = json!(info.allocatable);
            let expected = flotilla_store::Revision::of(&current);
            match self
                .store
                .update_status(
                    Kind::ManagedCluster,
                    None,
                    cluster,
                    status,
                    expected.as_ref(),
                )
                .await
            {
                Ok(_) => return Ok(()),
                Err(StoreError::Conflict { .. }) if attempt < ATTEMPTS => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    async fn mark_available(&self, cluster: &str, hello: &wire::Hello) -> Result<(), StoreError> {
        let current = self.existing_cluster(cluster).await?;
        let mut status = current.get("status").cloned().unwrap_or_else(|| json!({}));
        let now = now();
        let mut conds = read_conditions(&status);
        conditions::set_condition(
            &mut conds,
            MANAGED_CLUSTER_JOINED,
            ConditionStatus::True,
            "ManagedClusterJoined",
            "Managed cluster joined",
            None,
            now.clone(),
        );
        conditions::set_condition(
            &mut conds,
            MANAGED_CLUSTER_CONDITION_AVAILABLE,
            ConditionStatus::True,
            "ManagedClusterAvailable",
            "Managed cluster is available",
            None,
            now,
        );
        status["conditions"] = serde_json::to_value(&conds).unwrap_or_default();
        if !hello.kubernetes_version.is_empty() {
            status["version"] = json!({ "kubernetes": hello.kubernetes_version });
        }
        if !hello.claims.is_empty() {
            status["clusterClaims"] = hello
                .claims
                .iter()
                .map(|c| json!({ "name": c.name, "value": c.value }))
                .collect();
        }
        let updated = self
            .store
            .update_status(Kind::ManagedCluster, None, cluster, status, None)
            .await?;
        // Remove the unreachable taint the cluster may carry from an earlier outage.
        self.set_unreachable_taint(updated, false).await?;
        info!(cluster, "cluster available");
        Ok(())
    }

    async fn mark_unknown(&self, cluster: &str) -> Result<(), StoreError> {
        let Some(current) = self.store.get(Kind::ManagedCluster, None, cluster).await? else {
            return Ok(()); // deleted meanwhile: nothing to mark
        };
        let mut status = current.get("status").cloned().unwrap_or_else(|| json!({}));
        let mut conds = read_conditions(&status);
        conditions::set_condition(
            &mut conds,
            MANAGED_CLUSTER_CONDITION_AVAILABLE,
            ConditionStatus::Unknown,
            "ManagedClusterLeaseUpdateStopped",
            &format!(
                "Registration agent stopped updating its lease: no session for {}.",
                humantime::format_duration(self.grace_period)
            ),
            None,
            now(),
        );
        status["conditions"] = serde_json::to_value(&conds).unwrap_or_default();
        let updated = self
            .store
            .update_status(Kind::ManagedCluster, None, cluster, status, None)
            .await?;
        self.set_unreachable_taint(updated, true).await?;
        info!(cluster, grace = ?self.grace_period, "cluster unknown: no session within the grace period");
        Ok(())
    }

    /// The stored ManagedCluster. Sessions open only for registered, accepted clusters (see
    /// `admission`), so a missing one was deleted while the session opened: its session is
    /// being closed, and nothing is recreated (a deleted cluster stays revoked).
    async fn existing_cluster(&self, cluster: &str) -> Result<Value, StoreError> {
        self.store
            .get(Kind::ManagedCluster, None, cluster)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                kind: Kind::ManagedCluster,
                namespace: None,
                name: cluster.to_string(),
            })
    }

    /// Adds or removes OCM's unreachable taint. Other writers (registration's key pins,
    /// operators' taints) change the same object, so the write carries the version it read and
    /// is redone from a fresh read on conflict: nothing another writer stored is lost.
    async fn set_unreachable_taint(&self, mut mc: Value, present: bool) -> Result<(), StoreError> {
        const ATTEMPTS: usize = 5;
        for attempt in 1..=ATTEMPTS {
            let taints = mc["spec"]["taints"].as_array().cloned().unwrap_or_default();
            let has = taints.iter().any(|t| t["key"] == UNREACHABLE_TAINT);
            if has == present {
                return Ok(());
            }
            let mut taints: Vec<Value> = taints
                .into_iter()
                .filter(|t| t["key"] != UNREACHABLE_TAINT)
                .collect();
            if present {
                taints.push(json!({
                    "key": UNREACHABLE_TAINT,
                    "effect": "NoSelect",
                    "timeAdded": now(),
                }));
            }
            let name = mc["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            mc["spec"]["taints"] = Value::Array(taints);
            match self.store.update_spec(mc).await {
                Ok(_) => return Ok(()),
                Err(StoreError::Conflict { .. }) if attempt < ATTEMPTS => {
                    let Some(fresh) = self.store.get(Kind::ManagedCluster, None, &name).await?
                    else {
                        return Ok(()); // deleted meanwhile: no taint to keep
                    };
                    mc = fresh;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// A stored resource list (`status.capacity`), quantities as strings (numbers as written).
fn resource_list(list: &Value) -> BTreeMap<String, String> {
    list.as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    let q = match v {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    (k.clone(), q)
                })
                .collect()
        })
        .unwrap_or_default()
}

fn read_conditions(status: &Value) -> Vec<Condition> {
    status
        .get("conditions")
        .cloned()
        .and_then(|c| serde_json::from_value(c).ok())
        .unwrap_or_default()
}

fn now() -> Time {
    Time(jiff::Timestamp::now())
}

#[cfg(test)]
mod tests {
    //! Health writes happen on transitions only: a reconnect that changes nothing costs the
    //! store nothing, a changed version or a cluster marked Unknown is written.

    use super::*;
    use crate::registry::Registry;
    use crate::test_support::eventually;
    use flotilla_store::SledStore;
    use tokio::sync::watch;

    fn hello(version: &str) -> wire::Hello {
        wire::Hello {
            kubernetes_version: version.into(),
            ..Default::default()
        }
    }

    async fn stored(store: &dyn Store) -> (String, RecordedHealth) {
        let mc = store
            .get(Kind::ManagedCluster, None, "store-1")
            .await
            .unwrap()
            .unwrap();
        let rv = mc["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .to_string();
        (rv, RecordedHealth::from_object(&mc))
    }

    /// A store holding accepted cluster `store-1`, and the admissions cache watching it.
    struct OneCluster {
        _dir: tempfile::TempDir,
        store: Arc<dyn Store>,
        admissions: Arc<Admissions>,
        _stop: watch::Sender<bool>,
    }

    async fn one_cluster() -> OneCluster {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        store
            .create(json!({
                "apiVersion": "cluster.open-cluster-management.io/v1", "kind": "ManagedCluster",
                "metadata": {"name": "store-1"}, "spec": {"hubAcceptsClient": true},
            }))
            .await
            .unwrap();
        let admissions = Admissions::new();
        let (stop_tx, stop) = watch::channel(false);
        tokio::spawn(
            admissions
                .clone()
                .run(store.clone(), Arc::new(Registry::default()), stop),
        );
        OneCluster {
            _dir: dir,
            store,
            admissions,
            _stop: stop_tx,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reconnect_that_changes_nothing_writes_nothing() {
        // Held to the end: it keeps the database and the watch alive.
        let fixture = one_cluster().await;
        let (store, admissions) = (fixture.store.clone(), fixture.admissions.clone());
        let cached_available = || async {
            admissions
                .get("store-1")
                .await
                .is_some_and(|a| a.health.available)
        };
        let grace = Duration::from_millis(50);

        let tracker = HealthTracker::new(store.clone(), grace, admissions.clone());
        tracker.connected("store-1", "s1", &hello("v1.36.3")).await;
        let (first, health) = stored(store.as_ref()).await;
        assert!(health.available && !health.unreachable, "{health:?}");
        eventually("the cache sees Available", cached_available).await;

        // A restarted hub (a new tracker) meeting the same agent again: nothing to write.
        let restarted = HealthTracker::new(store.clone(), grace, admissions.clone());
        restarted
            .connected("store-1", "s2", &hello("v1.36.3"))
            .await;
        assert_eq!(stored(store.as_ref()).await.0, first, "no write");

        // The spoke was upgraded: written.
        restarted
            .connected("store-1", "s3", &hello("v1.37.0"))
            .await;
        let (upgraded, health) = stored(store.as_ref()).await;
        assert_ne!(upgraded, first);
        assert_eq!(health.kubernetes_version, "v1.37.0");

        // Gone past the grace period: Unknown and tainted; back at once (before the cache may
        // have seen it): Available again, taint removed.
        restarted.disconnected("store-1", "s3").await;
        eventually("Unknown after the grace period", || async {
            stored(store.as_ref()).await.1.unreachable
        })
        .await;
        restarted
            .connected("store-1", "s4", &hello("v1.37.0"))
            .await;
        let health = stored(store.as_ref()).await.1;
        assert!(health.available && !health.unreachable, "{health:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cluster_info_is_written_when_it_changes_and_refused_beyond_its_bounds() {
        // Held to the end: it keeps the database and the watch alive.
        let fixture = one_cluster().await;
        let (store, admissions) = (fixture.store.clone(), fixture.admissions.clone());
        let tracker =
            HealthTracker::new(store.clone(), Duration::from_secs(60), admissions.clone());
        let claim = |name: &str, value: &str| wire::ClusterClaim {
            name: name.into(),
            value: value.into(),
        };
        let info = wire::ClusterInfo {
            claims: vec![claim("nodecount.flotilla.dev", "3"), claim("region", "eu")],
            kubernetes_version: "v1.36.3".into(),
            capacity: [("cpu".to_string(), "12".to_string())].into(),
            allocatable: [("cpu".to_string(), "11500m".to_string())].into(),
        };
        tracker.cluster_info("store-1", &info).await;
        let (first, health) = stored(store.as_ref()).await;
        assert_eq!(
            health.claims,
            [
                ("nodecount.flotilla.dev".into(), "3".into()),
                ("region".into(), "eu".into())
            ]
        );
        assert_eq!(health.allocatable["cpu"], "11500m");
        assert_eq!(health.kubernetes_version, "v1.36.3");

        // The same report through a new tracker (a restarted hub): nothing written.
        eventually("the cache sees the claims", || async {
            admissions
                .get("store-1")
                .await
                .is_some_and(|a| a.health.claims.len() == 2)
        })
        .await;
        let restarted =
            HealthTracker::new(store.clone(), Duration::from_secs(60), admissions.clone());
        restarted.cluster_info("store-1", &info).await;
        assert_eq!(stored(store.as_ref()).await.0, first, "no write");

        // Thousands of claims: refused, what is stored stays.
        let mut flood = info.clone();
        flood.claims = (0..1000).map(|i| claim(&format!("c{i}"), "x")).collect();
        restarted.cluster_info("store-1", &flood).await;
        assert_eq!(stored(store.as_ref()).await.0, first, "refused");

        // A claim changes on the spoke: written.
        let mut changed = info.clone();
        changed.claims[1].value = "us".into();
        restarted.cluster_info("store-1", &changed).await;
        assert_eq!(stored(store.as_ref()).await.1.claims[1].1, "us");
    }
}
