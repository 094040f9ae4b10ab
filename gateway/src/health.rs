//! Cluster health is the session: a live session keeps the ManagedCluster Joined and Available;
//! once the last session of a cluster has been gone for the grace period, Available turns
//! Unknown and the cluster gets OCM's `unreachable` taint so placements stop choosing it.
//!
//! One task per gateway ([`HealthWriter::run`]) owns it. Session drivers tell it about
//! sessions opening and closing through a bounded channel ([`HealthReports`]) and never wait on
//! the store for it; the grace period is `flotilla_proto::session::Presence`, a sans-IO
//! machine; the writes run here, a bounded number at a time.
//!
//! Writes happen on transitions only (connect, grace expiry), never per heartbeat: the store (and
//! behind it, with the kube backend, the hub apiserver) sees O(transitions), not O(clusters ×
//! heartbeats). A connect that finds the cluster already recorded Available (in the gateway's
//! watch cache of ManagedClusters, see `admission`) with the same version and claims writes
//! nothing and reads nothing: a hub restarted under every session costs the store no request
//! for health.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use flotilla_proto::api::Kind;
use flotilla_proto::api::conditions::{
    self, ConditionStatus, MANAGED_CLUSTER_CONDITION_AVAILABLE, MANAGED_CLUSTER_JOINED,
};
use flotilla_proto::session::{Presence, PresenceEvent};
use flotilla_proto::wire;
use flotilla_store::{Store, StoreError};
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::admission::Admissions;
use crate::shards::ShardViews;

pub use flotilla_proto::contract::UNREACHABLE_TAINT;

/// Session reports waiting for the health task: enough for a reconnect storm's burst; a driver
/// that finds it full waits (off its loop) rather than losing a report.
pub const REPORT_BUFFER: usize = 4096;
/// Health writes in flight at once.
pub const WRITE_CONCURRENCY: usize = 16;

/// What a session driver tells the health task.
#[derive(Debug)]
pub enum HealthReport {
    /// Session `session` of `cluster` is established, with the agent's hello (its version and
    /// claims belong in the ManagedCluster's status).
    Connected {
        cluster: String,
        session: String,
        hello: Box<wire::Hello>,
    },
    /// Session `session` of `cluster` ended.
    Disconnected { cluster: String, session: String },
}

/// The drivers' end of the health task's channel.
#[derive(Clone)]
pub struct HealthReports(mpsc::Sender<HealthReport>);

impl HealthReports {
    /// Hands a report to the health task; waits only while its buffer is full.
    pub async fn send(&self, report: HealthReport) {
        // The task ends only at shutdown; a report then has nobody to act on it.
        let _ = self.0.send(report).await;
    }
}

/// Writes cluster health to the store from session reports and the grace period.
pub struct HealthWriter {
    store: Arc<dyn Store>,
    grace_period: Duration,
    /// The gateway's watch cache of ManagedClusters: what the store records now.
    admissions: Arc<Admissions>,
    reports: mpsc::Receiver<HealthReport>,
    /// The shards this gateway acts for: a write for a cluster of any other shard is not
    /// made, and a shard newly taken starts its clusters' grace periods.
    shards: ShardViews,
}

/// The outcome of one health write, back to the task.
enum Written {
    Available { cluster: String, ok: bool },
    Unknown,
}

impl HealthWriter {
    /// A writer and the channel drivers report to.
    pub fn new(
        store: Arc<dyn Store>,
        grace_period: Duration,
        admissions: Arc<Admissions>,
        shards: ShardViews,
    ) -> (HealthWriter, HealthReports) {
        let (tx, reports) = mpsc::channel(REPORT_BUFFER);
        (
            HealthWriter {
                store,
                grace_period,
                admissions,
                reports,
                shards,
            },
            HealthReports(tx),
        )
    }

    /// Runs until `stop` turns true (or every reporter is gone).
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut presence = Presence::new(self.grace_period);
        // Clusters this task marked Unknown and has not marked Available since. Their watch
        // event may not have reached the cache yet when the agent comes back, so a connect
        // always writes for them.
        let mut marked_unknown: HashSet<String> = HashSet::new();
        let mut writes = FuturesUnordered::new();
        // Writes waiting for a slot, in order.
        let mut queued: std::collections::VecDeque<futures::future::BoxFuture<'static, Written>> =
            std::collections::VecDeque::new();
        let this = Arc::new(Writes {
            store: self.store.clone(),
            grace_period: self.grace_period,
            shards: self.shards.clone(),
        });
        // Shards held at the last look: a shard that appears here was just taken over.
        let mut held: HashSet<u32> = HashSet::new();
        self.shards.mark_changed();
        let mut watching_shards = true;
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        tokio::pin!(stopped);
        loop {
            while writes.len() < WRITE_CONCURRENCY {
                let Some(w) = queued.pop_front() else { break };
                writes.push(w);
            }
            let deadline = presence.poll_timeout();
            tokio::select! {
                report = self.reports.recv() => {
                    let Some(report) = report else { return };
                    match report {
                        HealthReport::Connected { cluster, session, hello } => {
                            presence.connected(&cluster, &session);
                            let recorded = self.admissions.get(&cluster).await.map(|a| a.health);
                            if !marked_unknown.contains(&cluster)
                                && recorded.is_some_and(|h| h.already_shows(&hello))
                            {
                                debug!(cluster, "cluster already recorded Available: nothing to write");
                                continue;
                            }
                            let w = this.clone();
                            queued.push_back(Box::pin(async move {
                                let ok = match w.mark_available(&cluster, &hello).await {
                                    Ok(()) => true,
                                    Err(e) => {
                                        warn!(cluster, error = %e, "could not record the cluster as Available");
                                        false
                                    }
                                };
                                Written::Available { cluster, ok }
                            }));
                        }
                        HealthReport::Disconnected { cluster, session } => {
                            presence.disconnected(Instant::now(), &cluster, &session);
                        }
                    }
                }
                _ = sleep_until(deadline) => {
                    presence.handle_timeout(Instant::now());
                    while let Some(PresenceEvent::Unreachable { cluster, .. }) = presence.poll_event() {
                        // Noted before the write: a connect racing it then writes Available after.
                        marked_unknown.insert(cluster.clone());
                        let w = this.clone();
                        queued.push_back(Box::pin(async move {
                            if let Err(e) = w.mark_unknown(&cluster).await {
                                warn!(cluster, error = %e, "could not record the cluster as Unknown");
                            }
                            Written::Unknown
                        }));
                    }
                }
                Some(written) = writes.next(), if !writes.is_empty() => match written {
                    Written::Available { cluster, ok: true } => {
                        marked_unknown.remove(&cluster);
                    }
                    Written::Available { ok: false, .. } | Written::Unknown => {}
                },
                changed = self.shards.changed(), if watching_shards => {
                    if changed.is_err() {
                        // Nobody publishes views any more: the last one stays.
                        watching_shards = false;
                        continue;
                    }
                    let view = self.shards.borrow_and_update().clone();
                    let now = Instant::now();
                    let now_held: HashSet<u32> = view.held(now).into_iter().collect();
                    let taken: HashSet<u32> = now_held.difference(&held).copied().collect();
                    held = now_held;
                    // Without leases (single node) the gateway owns every shard from the
                    // start, and nothing is taken over from anyone.
                    if taken.is_empty() || !view.is_leased() {
                        continue;
                    }
                    // A new owner starts from what the store says: clusters recorded
                    // Available with no session here get their grace period from now.
                    let absent = self
                        .admissions
                        .available_where(|cluster| taken.contains(&view.shard_of(cluster)))
                        .await;
                    debug!(shards = taken.len(), clusters = absent.len(), "shards taken over: their clusters' grace periods start");
                    for cluster in absent {
                        presence.absent(now, &cluster);
                    }
                }
                _ = &mut stopped => return,
            }
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// The store writes of cluster health.
struct Writes {
    store: Arc<dyn Store>,
    grace_period: Duration,
    shards: ShardViews,
}

impl Writes {
    /// Whether this gateway may write `cluster`'s health now: it acts for the cluster's shard
    /// (its lease is held and valid). Asked right before each write.
    fn fenced(&self, cluster: &str) -> bool {
        let allowed = self.shards.borrow().holds_cluster(cluster, Instant::now());
        if !allowed {
            debug!(
                cluster,
                "not this gateway's shard (any more): health not written"
            );
        }
        !allowed
    }

    async fn mark_available(&self, cluster: &str, hello: &wire::Hello) -> Result<(), StoreError> {
        if self.fenced(cluster) {
            return Ok(());
        }
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
        if self.fenced(cluster) {
            return Ok(());
        }
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
        if self.fenced(cluster) {
            return Ok(());
        }
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
        }
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

    fn all_shards() -> ShardViews {
        watch::channel(Arc::new(crate::shards::ShardView::all(64))).1
    }

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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reconnect_that_changes_nothing_writes_nothing() {
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
        tokio::spawn(admissions.clone().run(
            store.clone(),
            Arc::new(Registry::default()),
            stop.clone(),
        ));
        let cached_available = || async {
            admissions
                .get("store-1")
                .await
                .is_some_and(|a| a.health.available)
        };
        let grace = Duration::from_millis(50);
        let connected = |session: &str, version: &str| HealthReport::Connected {
            cluster: "store-1".into(),
            session: session.into(),
            hello: Box::new(hello(version)),
        };
        let rv = |v: &str| v.parse::<u64>().unwrap();

        let (writer, reports) =
            HealthWriter::new(store.clone(), grace, admissions.clone(), all_shards());
        let first_run = tokio::spawn(writer.run(stop.clone()));
        reports.send(connected("s1", "v1.36.3")).await;
        eventually("Available is written", || async {
            stored(store.as_ref()).await.1.available
        })
        .await;
        let (first, _) = stored(store.as_ref()).await;
        eventually("the cache sees Available", cached_available).await;
        first_run.abort();

        // A restarted hub (a new writer) meeting the same agent again: nothing to write. Then
        // the spoke is upgraded: one write, so the version moves by exactly one.
        let (writer, reports) =
            HealthWriter::new(store.clone(), grace, admissions.clone(), all_shards());
        tokio::spawn(writer.run(stop.clone()));
        reports.send(connected("s2", "v1.36.3")).await;
        reports.send(connected("s3", "v1.37.0")).await;
        eventually("the upgrade is written", || async {
            stored(store.as_ref()).await.1.kubernetes_version == "v1.37.0"
        })
        .await;
        let (upgraded, _) = stored(store.as_ref()).await;
        assert_eq!(rv(&upgraded), rv(&first) + 1, "the reconnect wrote nothing");

        // Gone past the grace period: Unknown and tainted; back at once (before the cache may
        // have seen it): Available again, taint removed.
        reports
            .send(HealthReport::Disconnected {
                cluster: "store-1".into(),
                session: "s3".into(),
            })
            .await;
        eventually("Unknown after the grace period", || async {
            stored(store.as_ref()).await.1.unreachable
        })
        .await;
        reports.send(connected("s4", "v1.37.0")).await;
        eventually("Available again, untainted", || async {
            let health = stored(store.as_ref()).await.1;
            health.available && !health.unreachable
        })
        .await;
        let _ = stop_tx.send(true);
    }
}
