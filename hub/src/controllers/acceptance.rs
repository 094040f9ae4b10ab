//! OCM's `HubAcceptedManagedCluster` condition on every ManagedCluster: what the hub decided
//! about the cluster's join, for OCM's clients and `kubectl get` to read.
//!
//! The decision itself is `spec.hubAcceptsClient`, set by `flotilla cluster accept`/`deny`, a
//! join token's auto-accept, or an admin editing the ManagedCluster on the kube backend; this
//! controller watches the clusters and makes the condition follow it, as OCM's registration
//! controller does: `True` with reason `HubClusterAdminAccepted` while accepted; `False` with
//! reason `HubClusterAdminDenied` once a cluster that was accepted no longer is; no condition for
//! a cluster never accepted. It writes only a cluster whose condition disagrees (so never twice
//! for one decision), one at a time, against the resourceVersion it read.

use std::collections::HashSet;
use std::sync::Arc;

use async_trait::async_trait;
use flotilla_ops::error_chain;
use flotilla_proto::api::conditions::{
    ConditionStatus, HUB_ACCEPTED_MANAGED_CLUSTER, find_condition, set_condition,
};
use flotilla_proto::api::{Kind, ManagedCluster};
use flotilla_store::reflect::{Reflector, reflect};
use flotilla_store::{Object, Revision, Store, StoreError, WatchEvent, name_of};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};
use tokio::sync::{Mutex, mpsc, watch};
use tracing::{debug, warn};

/// OCM's reason while the hub accepts the cluster.
pub const REASON_ACCEPTED: &str = "HubClusterAdminAccepted";
/// OCM's reason once the hub no longer accepts a cluster it had accepted.
pub const REASON_DENIED: &str = "HubClusterAdminDenied";

/// The condition a cluster should carry, when it differs from the one it carries: status,
/// reason and message.
fn wanted(object: &Object) -> Option<(ConditionStatus, &'static str, &'static str)> {
    if object.pointer("/metadata/deletionTimestamp").is_some() {
        return None;
    }
    let cluster: ManagedCluster = serde_json::from_value(object.clone()).ok()?;
    let conditions = cluster
        .status
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    let current = find_condition(conditions, HUB_ACCEPTED_MANAGED_CLUSTER);
    let want = if cluster.spec.hub_accepts_client {
        (
            ConditionStatus::True,
            REASON_ACCEPTED,
            "Accepted by hub cluster admin",
        )
    } else if current.is_some() {
        // Denied after it was accepted; a cluster never accepted has no condition, as in OCM.
        (
            ConditionStatus::False,
            REASON_DENIED,
            "Denied by hub cluster admin",
        )
    } else {
        return None;
    };
    let agrees = current.is_some_and(|c| c.status == want.0.as_str() && c.reason == want.1);
    (!agrees).then_some(want)
}

/// What the watch feeds the writer: clusters whose condition disagrees, each once while pending.
struct Seen {
    /// The cluster as the watch last showed it: written from that, without a read first.
    tx: mpsc::Sender<Object>,
    pending: Arc<Mutex<HashSet<String>>>,
}

impl Seen {
    async fn look_at(&self, object: &Object) {
        if wanted(object).is_none() {
            return;
        }
        let name = name_of(object).to_owned();
        if !self.pending.lock().await.insert(name.clone()) {
            return;
        }
        // A full queue holds the watch back; a closed one means the writer stopped.
        let _ = self.tx.send(object.clone()).await;
    }
}

#[async_trait]
impl Reflector for Seen {
    async fn replace(&self, items: Vec<Object>) {
        for object in &items {
            self.look_at(object).await;
        }
    }

    async fn apply(&self, event: WatchEvent) {
        if let WatchEvent::Added(o) | WatchEvent::Modified(o) = &event {
            self.look_at(o).await;
        }
    }
}

/// Keeps every ManagedCluster's `HubAcceptedManagedCluster` condition in line with its
/// `spec.hubAcceptsClient`, until `stop`; at most `queue` clusters wait for a write.
pub async fn run(store: Arc<dyn Store>, queue: usize, stop: watch::Receiver<bool>) {
    let (tx, mut rx) = mpsc::channel::<Object>(queue.max(1));
    let pending = Arc::new(Mutex::new(HashSet::new()));
    let seen = Seen {
        tx,
        pending: pending.clone(),
    };
    let watcher = {
        let store = store.clone();
        tokio::spawn(
            async move { reflect(Kind::ManagedCluster, store.as_ref(), &seen, stop).await },
        )
    };
    // A fleet registered at once (a hub's first start on an existing fleet, a load test) is
    // one write per cluster: a few at a time, so the backlog clears in seconds and does not
    // linger into what comes next.
    let mut writes = tokio::task::JoinSet::new();
    // Ends when the watch has stopped (and dropped its sender).
    while let Some(object) = rx.recv().await {
        while writes.len() >= WRITE_CONCURRENCY {
            writes.join_next().await;
        }
        let (store, pending) = (store.clone(), pending.clone());
        writes.spawn(async move {
            let name = name_of(&object).to_owned();
            if let Err(e) = record(store.as_ref(), object).await {
                warn!(cluster = %name, error = %error_chain(&e), "writing the HubAcceptedManagedCluster condition failed; retried at its next change or relist");
            }
            pending.lock().await.remove(&name);
        });
    }
    while writes.join_next().await.is_some() {}
    let _ = watcher.await;
}

/// Condition writes in flight at once.
const WRITE_CONCURRENCY: usize = 8;

/// Attempts at one cluster whose writes conflict (it is changing under the controller) before
/// leaving it to its next watch event.
const ATTEMPTS: usize = 5;

/// Writes the cluster's status with the right condition, conditioned on the resourceVersion of
/// `seen` (the watch's copy, so no read comes first); on a conflict reads it again and, if the
/// condition still disagrees, writes again.
async fn record(store: &dyn Store, seen: Object) -> Result<(), StoreError> {
    let name = name_of(&seen).to_owned();
    let mut object = Some(seen);
    for _ in 0..ATTEMPTS {
        let current = match object.take() {
            Some(o) => o,
            None => match store.get(Kind::ManagedCluster, None, &name).await? {
                Some(o) => o,
                None => return Ok(()),
            },
        };
        let Some((status, reason, message)) = wanted(&current) else {
            return Ok(());
        };
        let mut stored = current.get("status").cloned().unwrap_or_else(|| json!({}));
        let mut conditions =
            serde_json::from_value(stored["conditions"].clone()).unwrap_or_else(|_| Vec::new());
        set_condition(
            &mut conditions,
            HUB_ACCEPTED_MANAGED_CLUSTER,
            status,
            reason,
            message,
            None,
            Time(jiff::Timestamp::now()),
        );
        stored["conditions"] = serde_json::to_value(&conditions).unwrap_or(Value::Null);
        let revision = Revision::of(&current);
        match store
            .update_status(Kind::ManagedCluster, None, &name, stored, revision.as_ref())
            .await
        {
            Ok(_) => {
                debug!(cluster = %name, %reason, "HubAcceptedManagedCluster recorded");
                return Ok(());
            }
            Err(StoreError::Conflict { .. }) => continue,
            Err(StoreError::NotFound { .. }) => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    warn!(cluster = %name, attempts = ATTEMPTS, "writing the HubAcceptedManagedCluster condition conflicted every time; left to its next change or relist");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_store::SledStore;
    use std::time::Duration;

    fn cluster(name: &str, accepted: bool) -> Object {
        json!({"apiVersion": "cluster.open-cluster-management.io/v1",
               "kind": "ManagedCluster", "metadata": {"name": name},
               "spec": {"hubAcceptsClient": accepted}})
    }

    /// The cluster's `HubAcceptedManagedCluster` condition as (status, reason), if any.
    async fn accepted_condition(store: &dyn Store, name: &str) -> Option<(String, String)> {
        let c = store
            .get(Kind::ManagedCluster, None, name)
            .await
            .unwrap()
            .unwrap();
        c["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == HUB_ACCEPTED_MANAGED_CLUSTER)
            .map(|c| {
                (
                    c["status"].as_str().unwrap_or_default().to_owned(),
                    c["reason"].as_str().unwrap_or_default().to_owned(),
                )
            })
    }

    async fn until<F: Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
        flotilla_testenv::wait_for(what, Duration::from_secs(10), || {
            let holds = check();
            async { anyhow::Ok(holds.await.then_some(())) }
        })
        .await
        .unwrap_or_else(|e| panic!("never: {e}"));
    }

    fn pair(status: &str, reason: &str) -> Option<(String, String)> {
        Some((status.to_owned(), reason.to_owned()))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_condition_follows_hub_accepts_client() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        store.create(cluster("accepted", true)).await.unwrap();
        store.create(cluster("waiting", false)).await.unwrap();
        let (stop_tx, stop) = watch::channel(false);
        let controller = tokio::spawn(run(store.clone(), 16, stop));
        until("the accepted cluster says so", || async {
            accepted_condition(store.as_ref(), "accepted").await == pair("True", REASON_ACCEPTED)
        })
        .await;
        // Accepting the waiting cluster (what `flotilla cluster accept` writes) sets it True.
        crate::registration::accept(store.as_ref(), "waiting")
            .await
            .unwrap();
        until("the cluster accepted later says so", || async {
            accepted_condition(store.as_ref(), "waiting").await == pair("True", REASON_ACCEPTED)
        })
        .await;
        let before = store
            .get(Kind::ManagedCluster, None, "waiting")
            .await
            .unwrap()
            .unwrap();
        // Denying an accepted cluster turns it False with OCM's reason.
        crate::registration::deny(store.as_ref(), "accepted", "retired")
            .await
            .unwrap();
        until("the denied cluster says so", || async {
            accepted_condition(store.as_ref(), "accepted").await == pair("False", REASON_DENIED)
        })
        .await;
        // A cluster whose condition already agrees is not written again.
        let after = store
            .get(Kind::ManagedCluster, None, "waiting")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            flotilla_store::resource_version(&after),
            flotilla_store::resource_version(&before),
            "a cluster whose condition agrees is not written"
        );
        let _ = stop_tx.send(true);
        tokio::time::timeout(Duration::from_secs(10), controller)
            .await
            .expect("the controller stops when told")
            .unwrap();
    }

    #[test]
    fn a_cluster_never_accepted_has_no_condition() {
        assert_eq!(wanted(&cluster("new", false)), None);
        assert_eq!(
            wanted(&cluster("new", true)).map(|w| w.1),
            Some(REASON_ACCEPTED)
        );
    }
}
