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
//! for health. The agent's reports of its spoke (claims, version, capacity) are written when
//! they differ from what the store records, so a report repeated costs the store nothing.
//!
//! Every write is fenced twice: this gateway checks it holds the cluster's shard right before
//! it, and the store refuses it if another gateway wrote the ManagedCluster under a newer epoch
//! of the shard since (`crate::fencing`): a gateway that stalled between the two never lands an
//! Unknown over the new owner's Available.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use flotilla_ops::error_chain;
use flotilla_ops::sleep_until;
use flotilla_proto::api::Kind;
use flotilla_proto::api::conditions::{
    self, ConditionStatus, MANAGED_CLUSTER_CONDITION_AVAILABLE, MANAGED_CLUSTER_JOINED,
};
use flotilla_proto::contract::check_cluster_info;
use flotilla_proto::session::{Presence, PresenceEvent};
use flotilla_proto::wire;
use flotilla_store::{Basis, Store, StoreError};
use futures::StreamExt as _;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::admission::Admissions;
use crate::fencing::{Fencing, Target};
use crate::recorded_health::{read_conditions, resource_list};
use crate::shards::{Held, ShardViews};

pub use flotilla_proto::contract::UNREACHABLE_TAINT;

/// Session reports waiting for the health task: enough for a reconnect storm's burst; a driver
/// that finds it full waits (off its loop) rather than losing a report.
pub const REPORT_BUFFER: usize = 4096;
/// Health writes in flight at once.
pub const WRITE_CONCURRENCY: usize = 16;
/// How often a write whose shard's fence lapsed looks again while the renewal is late.
const LAPSE_POLL: Duration = Duration::from_millis(250);
/// The longest a write waits for a late renewal (a lease round comes well before).
const LAPSE_WAIT_MAX: Duration = Duration::from_secs(30);

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
    /// The agent of `cluster` (the session's certificate's, never a name from the frame)
    /// reported what it knows about its spoke now, whole.
    ClusterInfo {
        cluster: String,
        info: Box<wire::ClusterInfo>,
    },
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
    /// How each write goes to the store under its fence.
    fencing: Fencing,
}

/// The outcome of one health write, back to the task.
enum Written {
    Available { cluster: String, ok: bool },
    Unknown { cluster: String },
    ClusterInfo { cluster: String, ok: bool },
}

impl Written {
    fn cluster(&self) -> &str {
        match self {
            Written::Available { cluster, .. }
            | Written::Unknown { cluster }
            | Written::ClusterInfo { cluster, .. } => cluster,
        }
    }
}

/// Writes waiting for a slot. Writes of one cluster run one at a time, in the order they were
/// queued: each reads the ManagedCluster and writes its status back, so two at once could
/// undo each other (Available over Unknown, or claims a connect wrote over a newer report).
#[derive(Default)]
struct WriteQueue {
    /// Per cluster with writes waiting or running: those waiting, in order.
    waiting: HashMap<String, VecDeque<BoxFuture<'static, Written>>>,
    /// Clusters whose next write may start now (none of theirs is running), in order.
    ready: VecDeque<String>,
}

impl WriteQueue {
    fn push(&mut self, cluster: String, write: BoxFuture<'static, Written>) {
        match self.waiting.get_mut(&cluster) {
            // A write of this cluster is running or waiting; this one follows it.
            Some(queue) => queue.push_back(write),
            None => {
                self.waiting
                    .insert(cluster.clone(), VecDeque::from([write]));
                self.ready.push_back(cluster);
            }
        }
    }

    /// The next write that may start.
    fn next(&mut self) -> Option<BoxFuture<'static, Written>> {
        let cluster = self.ready.pop_front()?;
        self.waiting.get_mut(&cluster)?.pop_front()
    }

    /// A write of `cluster` ended: its next one may start.
    fn done(&mut self, cluster: &str) {
        match self.waiting.get(cluster) {
            Some(queue) if queue.is_empty() => {
                self.waiting.remove(cluster);
            }
            Some(_) => self.ready.push_back(cluster.to_string()),
            None => {}
        }
    }
}

impl HealthWriter {
    /// A writer and the channel drivers report to.
    pub fn new(
        store: Arc<dyn Store>,
        grace_period: Duration,
        admissions: Arc<Admissions>,
        shards: ShardViews,
        fencing: Fencing,
    ) -> (HealthWriter, HealthReports) {
        let (tx, reports) = mpsc::channel(REPORT_BUFFER);
        (
            HealthWriter {
                store,
                grace_period,
                admissions,
                reports,
                shards,
                fencing,
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
        // The last cluster info written or being written per cluster with a live session: a
        // report repeated before the watch cache has seen the write is not written twice.
        let mut last_info: HashMap<String, wire::ClusterInfo> = HashMap::new();
        let mut writes = FuturesUnordered::new();
        let mut queued = WriteQueue::default();
        // Shards taken over whose clusters recorded Available are being read.
        let mut takeovers: FuturesUnordered<BoxFuture<'static, (Instant, usize, Vec<String>)>> =
            FuturesUnordered::new();
        let this = Arc::new(Writes {
            store: self.store.clone(),
            grace_period: self.grace_period,
            shards: self.shards.clone(),
            fencing: self.fencing.clone(),
        });
        // Shards held at the last look, with their epochs: a shard that appears here, or whose
        // epoch changed (lost and taken again between two looks), was just taken over.
        let mut held: HashMap<u32, u32> = HashMap::new();
        self.shards.mark_changed();
        let mut watching_shards = true;
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        tokio::pin!(stopped);
        loop {
            while writes.len() < WRITE_CONCURRENCY {
                let Some(w) = queued.next() else { break };
                writes.push(w);
            }
            let deadline = presence.poll_timeout();
            tokio::select! {
                report = self.reports.recv() => {
                    let Some(report) = report else { return };
                    match report {
                        HealthReport::Connected { cluster, session, hello } => {
                            presence.connected(&cluster, &session);
                            let recorded = self.admissions.get(&cluster).map(|a| a.health);
                            if !marked_unknown.contains(&cluster)
                                && recorded.is_some_and(|h| h.already_shows(&hello))
                            {
                                debug!(cluster, "cluster already recorded Available: nothing to write");
                                continue;
                            }
                            let w = this.clone();
                            queued.push(cluster.clone(), Box::pin(async move {
                                let ok = match w.mark_available(&cluster, &hello).await {
                                    Ok(()) => true,
                                    Err(e) => {
                                        warn!(cluster, error = %error_chain(&e), "could not record the cluster as Available");
                                        false
                                    }
                                };
                                Written::Available { cluster, ok }
                            }));
                        }
                        HealthReport::Disconnected { cluster, session } => {
                            // Kept for live sessions only; the watch cache answers for the next.
                            last_info.remove(&cluster);
                            // A session of a shard this gateway no longer acts for (drained on
                            // its loss, or closed as it resumed from a pause) starts no grace
                            // period: the shard's owner judges the cluster. Left pending, it
                            // would outlive the loss and, were the shard taken again, mark the
                            // cluster before a whole grace period from that takeover while its
                            // agent is still being handed over. A lapsed shard (renewal late)
                            // is still this gateway's until the lease round says otherwise.
                            let now = Instant::now();
                            let view = self.shards.borrow().clone();
                            if view.holds_cluster(&cluster, now) || view.lapsed(&cluster, now) {
                                presence.disconnected(now, &cluster, &session);
                            } else {
                                presence.forget(&cluster);
                            }
                        }
                        HealthReport::ClusterInfo { cluster, info } => {
                            if let Err(problem) = check_cluster_info(&info) {
                                warn!(cluster, %problem, "cluster info refused; the ManagedCluster keeps what it has");
                                continue;
                            }
                            if last_info.get(&cluster) == Some(&*info) {
                                continue;
                            }
                            let recorded = self.admissions.get(&cluster).map(|a| a.health);
                            if recorded.is_some_and(|h| h.shows_info(&info)) {
                                debug!(cluster, "cluster info unchanged: nothing to write");
                                continue;
                            }
                            last_info.insert(cluster.clone(), (*info).clone());
                            let w = this.clone();
                            queued.push(cluster.clone(), Box::pin(async move {
                                let ok = match w.write_cluster_info(&cluster, &info).await {
                                    Ok(true) => {
                                        info!(cluster, claims = info.claims.len(), "cluster info updated");
                                        true
                                    }
                                    // Not this gateway's to write (any more): said where dropped.
                                    Ok(false) => true,
                                    Err(e) => {
                                        warn!(cluster, error = %error_chain(&e), "could not record the cluster's info");
                                        false
                                    }
                                };
                                Written::ClusterInfo { cluster, ok }
                            }));
                        }
                    }
                }
                _ = sleep_until(deadline) => {
                    presence.handle_timeout(Instant::now());
                    while let Some(PresenceEvent::Unreachable { cluster, .. }) = presence.poll_event() {
                        // Noted before the write: a connect racing it then writes Available after.
                        marked_unknown.insert(cluster.clone());
                        let w = this.clone();
                        queued.push(cluster.clone(), Box::pin(async move {
                            if let Err(e) = w.mark_unknown(&cluster).await {
                                warn!(cluster, error = %error_chain(&e), "could not record the cluster as Unknown");
                            }
                            Written::Unknown { cluster }
                        }));
                    }
                }
                Some(written) = writes.next(), if !writes.is_empty() => {
                    queued.done(written.cluster());
                    match written {
                        Written::Available { cluster, ok: true } => {
                            marked_unknown.remove(&cluster);
                        }
                        // Not written: the next report of it is written again.
                        Written::ClusterInfo { cluster, ok: false } => {
                            last_info.remove(&cluster);
                        }
                        Written::Available { ok: false, .. }
                        | Written::Unknown { .. }
                        | Written::ClusterInfo { ok: true, .. } => {}
                    }
                }
                changed = self.shards.changed(), if watching_shards => {
                    if changed.is_err() {
                        // Nobody publishes views any more: the last one stays.
                        watching_shards = false;
                        continue;
                    }
                    let view = self.shards.borrow_and_update().clone();
                    let now = Instant::now();
                    let now_held: HashMap<u32, u32> = view
                        .held(now)
                        .into_iter()
                        .filter_map(|shard| view.holds(shard, now).map(|epoch| (shard, epoch)))
                        .collect();
                    let taken: HashSet<u32> = now_held
                        .iter()
                        .filter(|(shard, epoch)| held.get(shard) != Some(epoch))
                        .map(|(shard, _)| *shard)
                        .collect();
                    let lost: HashSet<u32> = held
                        .iter()
                        .filter(|(shard, epoch)| now_held.get(shard) != Some(epoch))
                        .map(|(shard, _)| *shard)
                        .collect();
                    held = now_held;
                    // Grace periods running for a shard no longer held end here: should it
                    // come back, they start again from that takeover. Left running, a grace
                    // begun at an earlier takeover would mark clusters whose agents are still
                    // being handed over from the gateway that held the shard in between.
                    if !lost.is_empty() {
                        presence.cancel_pending(|cluster| lost.contains(&view.shard_of(cluster)));
                    }
                    // Without leases (single node) the gateway owns every shard from the
                    // start, and nothing is taken over from anyone.
                    if taken.is_empty() || !view.is_leased() {
                        continue;
                    }
                    // A new owner starts from what the store says: clusters recorded
                    // Available with no session here get their grace period from now. Read
                    // once the admissions cache has its first list, in a branch of its own:
                    // waiting for it here would stop the writes in flight, and on the
                    // embedded store the list waits for the write that holds its log.
                    let admissions = self.admissions.clone();
                    // Read once the cache has listed the shards taken (within the grace
                    // period: past it, whatever the cache holds), or their clusters would be
                    // missed and never marked.
                    let wait = self.grace_period;
                    takeovers.push(Box::pin(async move {
                        let _ = tokio::time::timeout(wait, admissions.wait_loaded(&taken)).await;
                        let absent = admissions
                            .available_where(|cluster| taken.contains(&view.shard_of(cluster)))
                            .await;
                        (now, taken.len(), absent)
                    }));
                }
                Some((since, shards, absent)) = takeovers.next(), if !takeovers.is_empty() => {
                    debug!(shards, clusters = absent.len(), "shards taken over: their clusters' grace periods start");
                    // Only those still held: a shard lost again meanwhile starts nothing.
                    let view = self.shards.borrow().clone();
                    let now = Instant::now();
                    for cluster in absent.iter().filter(|c| view.holds_cluster(c, now)) {
                        presence.absent(since, cluster);
                    }
                }
                _ = &mut stopped => return,
            }
        }
    }
}

/// The store writes of cluster health.
struct Writes {
    store: Arc<dyn Store>,
    grace_period: Duration,
    shards: ShardViews,
    fencing: Fencing,
}

impl Writes {
    /// The fence of `cluster`'s shard this gateway's write (`what`) is made under now, or
    /// `None` when it does not act for the shard (its lease is not held, or no longer valid):
    /// then the write is dropped, counted as `not_held`. Asked right before each write. A
    /// shard whose fence ran out while its renewal is late is waited for (see
    /// [`ShardView::lapsed`](crate::shards::ShardView::lapsed)): the next lease round renews
    /// it or drops it, and a write refused in that gap would be lost while the session stays.
    async fn held(&self, cluster: &str, what: &str) -> Option<Held> {
        let mut views = self.shards.clone();
        let give_up = Instant::now() + LAPSE_WAIT_MAX;
        loop {
            let now = Instant::now();
            let (held, lapsed, shard) = {
                let view = views.borrow_and_update();
                (
                    view.held_for(cluster, now),
                    view.lapsed(cluster, now),
                    view.shard_of(cluster),
                )
            };
            if held.is_some() {
                return held;
            }
            if !lapsed || now >= give_up {
                self.fencing.not_held(what, cluster, cluster, shard);
                return None;
            }
            // A new view, or a look again soon: a renewal does not always change the view's
            // shards, only their fences.
            let _ = tokio::time::timeout(LAPSE_POLL, views.changed()).await;
        }
    }

    async fn mark_available(&self, cluster: &str, hello: &wire::Hello) -> Result<(), StoreError> {
        if self.held(cluster, "cluster health").await.is_none() {
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
        let Some(held) = self.held(cluster, "cluster health").await else {
            return Ok(());
        };
        let Some(updated) = self.write_status(cluster, status, held, &current).await? else {
            return Ok(());
        };
        // Remove the unreachable taint the cluster may carry from an earlier outage.
        self.set_unreachable_taint(updated, false, held).await?;
        info!(cluster, "cluster available");
        Ok(())
    }

    /// Writes `status` as `cluster`'s under `held`, on `current` (what it was computed from):
    /// the stored cluster as written, or `None` when the store refused the write (another
    /// gateway wrote it under a newer epoch since: logged and counted where it was refused).
    /// Should another writer change it between the read and the write, the store reads it
    /// again and writes `status` over that, as long as the fence allows.
    async fn write_status(
        &self,
        cluster: &str,
        status: Value,
        held: Held,
        current: &Value,
    ) -> Result<Option<Value>, StoreError> {
        let target = Target {
            kind: Kind::ManagedCluster,
            namespace: None,
            name: cluster,
            cluster,
        };
        match self
            .fencing
            .write_status(
                self.store.as_ref(),
                target,
                status,
                held,
                None,
                Basis::of(current).as_ref(),
            )
            .await
        {
            Ok(written) => Ok(Some(written)),
            Err(StoreError::Fenced { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Writes claims, version, capacity and allocatable into the status, from a fresh read,
    /// compared against and conditioned on it (see [`Writes::write_status`]); `false` when the
    /// write was dropped by either fence.
    async fn write_cluster_info(
        &self,
        cluster: &str,
        info: &wire::ClusterInfo,
    ) -> Result<bool, StoreError> {
        if self.held(cluster, "cluster info").await.is_none() {
            return Ok(false);
        }
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
        let Some(held) = self.held(cluster, "cluster info").await else {
            return Ok(false);
        };
        Ok(self
            .write_status(cluster, status, held, &current)
            .await?
            .is_some())
    }

    async fn mark_unknown(&self, cluster: &str) -> Result<(), StoreError> {
        if self.held(cluster, "cluster health").await.is_none() {
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
        let Some(held) = self.held(cluster, "cluster health").await else {
            return Ok(());
        };
        let Some(updated) = self.write_status(cluster, status, held, &current).await? else {
            return Ok(());
        };
        self.set_unreachable_taint(updated, true, held).await?;
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

    /// Adds or removes OCM's unreachable taint, under `held` (the fence of the status write it
    /// follows). Other writers (registration's key pins, operators' taints) change the same
    /// object, so the write carries the version it read and is redone from a fresh read on
    /// conflict: nothing another writer stored is lost. A write the store refuses (another
    /// gateway wrote the cluster under a newer epoch since) is dropped.
    async fn set_unreachable_taint(
        &self,
        mut mc: Value,
        present: bool,
        held: Held,
    ) -> Result<(), StoreError> {
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
            match self
                .fencing
                .write_spec(self.store.as_ref(), mc, &name, held)
                .await
            {
                Ok(_) | Err(StoreError::Fenced { .. }) => return Ok(()),
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

fn now() -> Time {
    Time(jiff::Timestamp::now())
}

#[cfg(test)]
mod tests {
    //! Health writes happen on transitions only: a reconnect that changes nothing costs the
    //! store nothing, a changed version or a cluster marked Unknown is written.

    use super::*;
    use crate::recorded_health::RecordedHealth;
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

    #[tokio::test]
    async fn one_clusters_writes_run_one_at_a_time_in_order() {
        let write = |cluster: &str| -> BoxFuture<'static, Written> {
            let cluster = cluster.to_string();
            Box::pin(async move { Written::Unknown { cluster } })
        };
        let cluster_of = |w: Option<BoxFuture<'static, Written>>| async move {
            w.expect("a write may start").await.cluster().to_string()
        };
        let mut queue = WriteQueue::default();
        queue.push("a".into(), write("a"));
        queue.push("a".into(), write("a"));
        queue.push("b".into(), write("b"));
        assert_eq!(cluster_of(queue.next()).await, "a");
        // a's second write waits for its first; b's goes ahead.
        assert_eq!(cluster_of(queue.next()).await, "b");
        assert!(queue.next().is_none());
        queue.done("b");
        assert!(queue.next().is_none());
        queue.done("a");
        assert_eq!(cluster_of(queue.next()).await, "a");
        queue.done("a");
        assert!(queue.next().is_none() && queue.waiting.is_empty());
    }

    /// A store holding accepted cluster `store-1`, the admissions cache watching it, and the
    /// switch that stops them.
    async fn one_cluster() -> (
        tempfile::TempDir,
        Arc<dyn Store>,
        Arc<Admissions>,
        watch::Sender<bool>,
        watch::Receiver<bool>,
    ) {
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
            crate::shards::ShardView::all_views(),
            stop.clone(),
        ));
        (dir, store, admissions, stop_tx, stop)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reconnect_that_changes_nothing_writes_nothing() {
        // The directory is held to the end: it keeps the database.
        let (_dir, store, admissions, stop_tx, stop) = one_cluster().await;
        let cached_available = || async {
            admissions
                .get("store-1")
                .is_some_and(|a| a.health.available)
        };
        let grace = Duration::from_millis(50);
        let connected = |session: &str, version: &str| HealthReport::Connected {
            cluster: "store-1".into(),
            session: session.into(),
            hello: Box::new(hello(version)),
        };
        let rv = |v: &str| v.parse::<u64>().unwrap();

        let (writer, reports) = HealthWriter::new(
            store.clone(),
            grace,
            admissions.clone(),
            all_shards(),
            Fencing::default(),
        );
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
        let (writer, reports) = HealthWriter::new(
            store.clone(),
            grace,
            admissions.clone(),
            all_shards(),
            Fencing::default(),
        );
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_owner_writes_health_while_its_admissions_cache_loads() {
        // A gateway that just took a shard over reads which of its clusters are recorded
        // Available once its admissions cache has listed them; on a big fleet or a slow
        // apiserver that list takes a while, and health writes must not wait for it. Here the
        // cache never loads at all.
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        store
            .create(json!({
                "apiVersion": "cluster.open-cluster-management.io/v1", "kind": "ManagedCluster",
                "metadata": {"name": "store-1"}, "spec": {"hubAcceptsClient": true},
            }))
            .await
            .unwrap();
        let shard = crate::shards::ShardView::all(64).shard_of("store-1");
        let fence = crate::shards::Fence {
            epoch: 1,
            valid_until: Instant::now() + Duration::from_secs(3600),
        };
        let (_views_tx, views) = watch::channel(Arc::new(crate::shards::ShardView::leased(
            64,
            [(shard, fence)].into(),
            crate::shards::ShardDirectory::default(),
        )));
        let (stop_tx, stop) = watch::channel(false);
        let (writer, reports) = HealthWriter::new(
            store.clone(),
            Duration::from_secs(60),
            Admissions::new(),
            views,
            Fencing::default(),
        );
        tokio::spawn(writer.run(stop));

        reports
            .send(HealthReport::Connected {
                cluster: "store-1".into(),
                session: "s1".into(),
                hello: Box::new(hello("v1.36.3")),
            })
            .await;
        eventually("the cluster is recorded Available", || async {
            stored(store.as_ref()).await.1.available
        })
        .await;
        let info = wire::ClusterInfo {
            claims: vec![wire::ClusterClaim {
                name: "region".into(),
                value: "eu".into(),
            }],
            ..Default::default()
        };
        reports
            .send(HealthReport::ClusterInfo {
                cluster: "store-1".into(),
                info: Box::new(info),
            })
            .await;
        eventually("its claims are written", || async {
            stored(store.as_ref()).await.1.claims.len() == 1
        })
        .await;
        let _ = stop_tx.send(true);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shard_lost_and_taken_again_gives_its_clusters_a_whole_grace_period_again() {
        lost_and_taken_again(Between::LossSeen).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shard_taken_again_at_a_new_epoch_unseen_lost_gives_a_whole_grace_period_again() {
        // Paused past its lease (SIGSTOP), a gateway may lose a shard and take it again in
        // one lease round: no view without the shard is ever published, only a new epoch.
        lost_and_taken_again(Between::NothingSeen).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_session_closed_after_its_shard_was_lost_starts_no_grace_period() {
        // The agent is here when the shard is lost; its session closes after (drained on the
        // loss, or found dead as the gateway resumes from a pause). Taken again later, the
        // shard's clusters get a whole grace period from that takeover, not one from the
        // close, while the agent is still on the gateway that held the shard in between.
        lost_and_taken_again(Between::SessionClosedAfterTheLoss).await;
    }

    /// What the gateway sees between taking the shard and taking it again.
    #[derive(Clone, Copy, PartialEq)]
    enum Between {
        /// Nothing: only the new epoch tells of the loss.
        NothingSeen,
        /// A view without the shard.
        LossSeen,
        /// The agent connected before the loss, its session closing after it.
        SessionClosedAfterTheLoss,
    }

    async fn lost_and_taken_again(between: Between) {
        // A gateway takes a shard over: store-1 is recorded Available and its agent is not
        // here, so its grace period starts. The shard is lost (another gateway took it, and
        // the agent may be on its way there), then taken again: the agent gets a whole grace
        // period from the second takeover, not what was left of the first.
        let grace = Duration::from_secs(4);
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        let shard = crate::shards::ShardView::all(64).shard_of("store-1");
        // Labelled with its shard, as the hub labels clusters: what shard caches select.
        let label = flotilla_proto::contract::shard_label_value(shard);
        store
            .create(json!({
                "apiVersion": "cluster.open-cluster-management.io/v1", "kind": "ManagedCluster",
                "metadata": {"name": "store-1",
                             "labels": {flotilla_proto::contract::SHARD_LABEL: label}},
                "spec": {"hubAcceptsClient": true},
            }))
            .await
            .unwrap();
        let condition = |kind: &str| {
            json!({"type": kind, "status": "True", "reason": "R", "message": "",
                   "lastTransitionTime": "2026-01-01T00:00:00Z"})
        };
        store
            .update_status(
                Kind::ManagedCluster,
                None,
                "store-1",
                json!({"conditions": [
                    condition(MANAGED_CLUSTER_JOINED),
                    condition(MANAGED_CLUSTER_CONDITION_AVAILABLE),
                ]}),
                None,
            )
            .await
            .unwrap();
        let holding = |epoch: u32| {
            let fence = crate::shards::Fence {
                epoch,
                valid_until: Instant::now() + Duration::from_secs(3600),
            };
            Arc::new(crate::shards::ShardView::leased(
                64,
                [(shard, fence)].into(),
                crate::shards::ShardDirectory::default(),
            ))
        };
        let nothing = Arc::new(crate::shards::ShardView::leased(
            64,
            Default::default(),
            crate::shards::ShardDirectory::default(),
        ));
        let (views, _) = watch::channel(holding(1));
        let (stop_tx, stop) = watch::channel(false);
        let admissions = Admissions::new();
        tokio::spawn(admissions.clone().run(
            store.clone(),
            Arc::new(Registry::default()),
            views.subscribe(),
            stop.clone(),
        ));
        let (writer, reports) = HealthWriter::new(
            store.clone(),
            grace,
            admissions,
            views.subscribe(),
            Fencing::default(),
        );
        tokio::spawn(writer.run(stop));

        if between == Between::SessionClosedAfterTheLoss {
            reports
                .send(HealthReport::Connected {
                    cluster: "store-1".into(),
                    session: "s1".into(),
                    hello: Box::new(hello("v1.36.3")),
                })
                .await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        if between != Between::NothingSeen {
            views.send_replace(nothing);
        }
        if between == Between::SessionClosedAfterTheLoss {
            // The loss first, then the close: the order in which a close started a grace
            // period that outlived the loss (either order must leave none).
            tokio::time::sleep(Duration::from_millis(200)).await;
            reports
                .send(HealthReport::Disconnected {
                    cluster: "store-1".into(),
                    session: "s1".into(),
                })
                .await;
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let retaken = jiff::Timestamp::now();
        views.send_replace(holding(2));

        let unknown_since = flotilla_testenv::wait_for(
            "store-1 marked Unknown",
            Duration::from_secs(30),
            || async {
                let mc = store
                    .get(Kind::ManagedCluster, None, "store-1")
                    .await?
                    .expect("stored");
                let since = mc["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|c| {
                        c["type"] == MANAGED_CLUSTER_CONDITION_AVAILABLE && c["status"] == "Unknown"
                    })
                    .and_then(|c| c["lastTransitionTime"].as_str())
                    .map(str::to_owned);
                anyhow::Ok(since)
            },
        )
        .await
        .unwrap();
        let marked: jiff::Timestamp = unknown_since.parse().unwrap();
        // The condition's time has whole seconds; a grace period from the first takeover
        // would have marked it 1.5 s after the second.
        let earliest = retaken + jiff::SignedDuration::from_secs(3);
        assert!(
            marked >= earliest,
            "marked Unknown at {marked}, before a whole grace period from the takeover at {retaken}"
        );
        let _ = stop_tx.send(true);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cluster_info_is_written_when_it_changes_and_refused_beyond_its_bounds() {
        // The directory is held to the end: it keeps the database.
        let (_dir, store, admissions, stop_tx, stop) = one_cluster().await;
        let grace = Duration::from_secs(60);
        let claim = |name: &str, value: &str| wire::ClusterClaim {
            name: name.into(),
            value: value.into(),
        };
        let report = |info: &wire::ClusterInfo| HealthReport::ClusterInfo {
            cluster: "store-1".into(),
            info: Box::new(info.clone()),
        };
        let info = wire::ClusterInfo {
            claims: vec![claim("nodecount.flotilla.dev", "3"), claim("region", "eu")],
            kubernetes_version: "v1.36.3".into(),
            capacity: [("cpu".to_string(), "12".to_string())].into(),
            allocatable: [("cpu".to_string(), "11500m".to_string())].into(),
        };
        let rv = |v: &str| v.parse::<u64>().unwrap();

        let (writer, reports) = HealthWriter::new(
            store.clone(),
            grace,
            admissions.clone(),
            all_shards(),
            Fencing::default(),
        );
        let first_run = tokio::spawn(writer.run(stop.clone()));
        reports.send(report(&info)).await;
        eventually("the claims are written", || async {
            stored(store.as_ref()).await.1.claims.len() == 2
        })
        .await;
        let (first, health) = stored(store.as_ref()).await;
        assert_eq!(
            health.claims,
            [
                ("nodecount.flotilla.dev".into(), "3".into()),
                ("region".into(), "eu".into())
            ]
        );
        assert_eq!(health.capacity["cpu"], "12");
        assert_eq!(health.allocatable["cpu"], "11500m");
        assert_eq!(health.kubernetes_version, "v1.36.3");
        eventually("the cache sees the claims", || async {
            admissions
                .get("store-1")
                .is_some_and(|a| a.health.claims.len() == 2)
        })
        .await;
        first_run.abort();

        // A restarted hub (a new writer) given the same report: nothing written. Thousands of
        // claims: refused, what is stored stays. Then a claim changes on the spoke: written,
        // so the version moves by exactly one.
        let (writer, reports) = HealthWriter::new(
            store.clone(),
            grace,
            admissions.clone(),
            all_shards(),
            Fencing::default(),
        );
        tokio::spawn(writer.run(stop.clone()));
        reports.send(report(&info)).await;
        let mut flood = info.clone();
        flood.claims = (0..1000).map(|i| claim(&format!("c{i}"), "x")).collect();
        reports.send(report(&flood)).await;
        let mut changed = info.clone();
        changed.claims[1].value = "us".into();
        reports.send(report(&changed)).await;
        eventually("the changed claim is written", || async {
            stored(store.as_ref())
                .await
                .1
                .claims
                .get(1)
                .map(|c| c.1.as_str())
                == Some("us")
        })
        .await;
        let (after, health) = stored(store.as_ref()).await;
        assert_eq!(rv(&after), rv(&first) + 1, "only the change was written");
        assert_eq!(health.claims.len(), 2, "the flood was refused");
        let _ = stop_tx.send(true);
    }
}
