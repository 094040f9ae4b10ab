//! `deleteOption.ttlSecondsAfterFinished`: a ManifestWork that has been `Complete` (its
//! manifests' condition rules say so, as the agent reports) for that many seconds is deleted,
//! as OCM's hub does. Agents never touch the hub's store, so the hub does it.
//!
//! The controller keeps one deadline per completed work with a TTL, from the watch cache of
//! ManifestWorks, and sleeps until the earliest. The clock is the wall clock, because the
//! deadline is counted from the `Complete` condition's `lastTransitionTime`. Before deleting it
//! reads the work again: a work that is no longer Complete, changed its TTL, or was replaced
//! under the same name (another uid) is left alone.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use flotilla_ops::error_chain;
use flotilla_proto::api::Kind;
use flotilla_proto::api::conditions::WORK_COMPLETE;
use flotilla_store::reflect::{Reflector, reflect};
use flotilla_store::{Object, Store, StoreError, WatchEvent};
use jiff::Timestamp;
use serde_json::Value;
use tokio::sync::{Mutex, Notify, watch};
use tracing::{debug, info, warn};

/// Pause before trying a failed delete again.
const RETRY: Duration = Duration::from_secs(5);
/// Longest single sleep: a clock that jumps is noticed within this.
const MAX_SLEEP: Duration = Duration::from_secs(60);

/// When a work is due for deletion: the `Complete=True` condition's `lastTransitionTime` plus
/// `spec.deleteOption.ttlSecondsAfterFinished`. `None` when it has no TTL, is not complete, or
/// is being deleted already.
pub fn deadline(work: &Value) -> Option<Timestamp> {
    if work.pointer("/metadata/deletionTimestamp").is_some() {
        return None;
    }
    let ttl = work
        .pointer("/spec/deleteOption/ttlSecondsAfterFinished")?
        .as_i64()?
        .max(0);
    let complete = work
        .pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c["type"] == WORK_COMPLETE && c["status"] == "True")?;
    let since: Timestamp = complete["lastTransitionTime"].as_str()?.parse().ok()?;
    since.checked_add(jiff::SignedDuration::from_secs(ttl)).ok()
}

/// The completed works with a TTL: (namespace, name) → (deadline, uid).
#[derive(Default)]
struct Due {
    works: Mutex<BTreeMap<(String, String), (Timestamp, String)>>,
    changed: Notify,
}

impl Due {
    async fn track(&self, work: &Value) {
        let (Some(ns), Some(name)) = (
            work.pointer("/metadata/namespace").and_then(Value::as_str),
            work.pointer("/metadata/name").and_then(Value::as_str),
        ) else {
            return;
        };
        let key = (ns.to_owned(), name.to_owned());
        let uid = work
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let mut works = self.works.lock().await;
        match deadline(work) {
            Some(at) => {
                works.insert(key, (at, uid));
            }
            None => {
                works.remove(&key);
            }
        }
        drop(works);
        self.changed.notify_one();
    }
}

#[async_trait]
impl Reflector for Due {
    async fn replace(&self, items: Vec<Object>) {
        self.works.lock().await.clear();
        for item in &items {
            self.track(item).await;
        }
    }

    async fn apply(&self, event: WatchEvent) {
        match event {
            WatchEvent::Added(o) | WatchEvent::Modified(o) => self.track(&o).await,
            WatchEvent::Deleted(o) => {
                let key = (
                    o.pointer("/metadata/namespace")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_owned(),
                    o.pointer("/metadata/name")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_owned(),
                );
                self.works.lock().await.remove(&key);
            }
        }
    }
}

/// Runs the controller until `stop` turns true (or its sender is dropped).
pub async fn run(store: Arc<dyn Store>, stop: watch::Receiver<bool>) {
    let due = Arc::new(Due::default());
    let cache = tokio::spawn({
        let (store, due, stop) = (Arc::clone(&store), Arc::clone(&due), stop.clone());
        async move { reflect(Kind::ManifestWork, store.as_ref(), due.as_ref(), stop).await }
    });
    expire(store.as_ref(), &due, stop).await;
    let _ = cache.await;
}

/// Sleeps until the earliest deadline and deletes what is due, until `stop`.
async fn expire(store: &dyn Store, due: &Due, mut stop: watch::Receiver<bool>) {
    loop {
        let now = Timestamp::now();
        let ready: Vec<((String, String), String)> = due
            .works
            .lock()
            .await
            .iter()
            .filter(|(_, (at, _))| *at <= now)
            .map(|(k, (_, uid))| (k.clone(), uid.clone()))
            .collect();
        let mut failed = false;
        for ((ns, name), uid) in ready {
            match delete_if_still_due(store, &ns, &name, &uid).await {
                Ok(()) => {
                    due.works.lock().await.remove(&(ns, name));
                }
                Err(e) => {
                    warn!(work = %format!("{ns}/{name}"), error = %error_chain(&e), "cannot delete a work past its ttlSecondsAfterFinished; retrying");
                    failed = true;
                }
            }
        }
        let next = due.works.lock().await.values().map(|(at, _)| *at).min();
        let sleep = match next {
            _ if failed => RETRY,
            Some(at) => Duration::try_from(at.duration_since(Timestamp::now()))
                .unwrap_or(Duration::ZERO)
                .min(MAX_SLEEP),
            None => MAX_SLEEP,
        };
        tokio::select! {
            _ = tokio::time::sleep(sleep) => {}
            _ = due.changed.notified() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

async fn delete_if_still_due(
    store: &dyn Store,
    ns: &str,
    name: &str,
    uid: &str,
) -> Result<(), StoreError> {
    let Some(current) = store.get(Kind::ManifestWork, Some(ns), name).await? else {
        return Ok(());
    };
    let same = current.pointer("/metadata/uid").and_then(Value::as_str) == Some(uid);
    if !same || deadline(&current).is_none_or(|at| at > Timestamp::now()) {
        debug!(work = %format!("{ns}/{name}"), "no longer due for deletion");
        return Ok(());
    }
    match store.delete(Kind::ManifestWork, Some(ns), name).await {
        Ok(()) | Err(StoreError::NotFound { .. }) => {
            info!(work = %format!("{ns}/{name}"), "deleted: Complete for longer than its ttlSecondsAfterFinished");
            Ok(())
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_store::SledStore;
    use serde_json::json;

    fn work(ttl: Option<i64>, complete: Option<(&str, &str)>) -> Value {
        let mut w = json!({"metadata": {"namespace": "c1", "name": "w", "uid": "u1"}, "spec": {}});
        if let Some(ttl) = ttl {
            w["spec"]["deleteOption"] =
                json!({"propagationPolicy": "Foreground", "ttlSecondsAfterFinished": ttl});
        }
        if let Some((status, at)) = complete {
            w["status"] = json!({"conditions": [
                {"type": "Applied", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "Complete", "status": status, "lastTransitionTime": at},
            ]});
        }
        w
    }

    fn check(w: Value, expected: Option<&str>) {
        assert_eq!(
            deadline(&w).map(|t| t.to_string()),
            expected.map(str::to_owned),
            "{w}"
        );
    }

    #[test]
    fn deadlines_count_from_the_complete_transition() {
        check(
            work(Some(30), Some(("True", "2026-01-01T00:00:00Z"))),
            Some("2026-01-01T00:00:30Z"),
        );
        check(
            work(Some(0), Some(("True", "2026-01-01T00:00:00Z"))),
            Some("2026-01-01T00:00:00Z"),
        );
        check(work(None, Some(("True", "2026-01-01T00:00:00Z"))), None);
        check(
            work(Some(30), Some(("False", "2026-01-01T00:00:00Z"))),
            None,
        );
        check(work(Some(30), None), None);
        let mut deleting = work(Some(0), Some(("True", "2026-01-01T00:00:00Z")));
        deleting["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:01Z");
        check(deleting, None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_complete_work_past_its_ttl_is_deleted_and_others_stay() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        let mk = |name: &str, ttl: i64| {
            json!({"apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
                "metadata": {"name": name, "namespace": "c1"},
                "spec": {"workload": {"manifests": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}]},
                         "deleteOption": {"propagationPolicy": "Foreground", "ttlSecondsAfterFinished": ttl}}})
        };
        for (name, ttl) in [("done", 1), ("later", 3600), ("running", 0)] {
            store.create(mk(name, ttl)).await.unwrap();
        }
        let now = Timestamp::now().to_string();
        for name in ["done", "later"] {
            store
                .update_status(
                    Kind::ManifestWork,
                    Some("c1"),
                    name,
                    json!({"conditions": [{"type": "Complete", "status": "True", "reason": "ManifestsComplete",
                        "message": "", "lastTransitionTime": now}]}),
                    None,
                )
                .await
                .unwrap();
        }
        let (stop_tx, stop) = watch::channel(false);
        let task = tokio::spawn(run(Arc::clone(&store), stop));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while store
            .get(Kind::ManifestWork, Some("c1"), "done")
            .await
            .unwrap()
            .is_some()
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the expired work was not deleted"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for name in ["later", "running"] {
            assert!(
                store
                    .get(Kind::ManifestWork, Some("c1"), name)
                    .await
                    .unwrap()
                    .is_some(),
                "{name} must stay"
            );
        }
        stop_tx.send(true).unwrap();
        task.await.unwrap();
    }
}
