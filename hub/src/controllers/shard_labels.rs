//! The shard labeller: the only writer of [`SHARD_LABEL`] on ManagedClusters, ManifestWorks and
//! ClusterCompliances (each cluster's compliance record, which gateways write for their shards).
//!
//! Gateways list and watch with a selector on that label, so an object without it (a work a
//! user `kubectl apply`-ed straight to the hub apiserver) or with a wrong one (after a change of
//! `--shards`) reaches no gateway until it is labelled. The hub stamps the label when it
//! creates objects itself; this controller labels everything else. It reads the watches the
//! hub runs anyway, writes only objects whose label differs from the one their cluster's shard
//! gives (so a labelled object is never written again: no flapping), and writes a bounded
//! number at a time, each against the resourceVersion it read (a conflict reads the object
//! again, a bounded number of times).

use std::collections::HashSet;
use std::sync::Arc;

use async_trait::async_trait;
use flotilla_ops::error_chain;
use flotilla_proto::api::Kind;
use flotilla_proto::contract::{SHARD_LABEL, shard_label_value, shard_of};
use flotilla_store::reflect::{Reflector, reflect};
use flotilla_store::{Object, Store, StoreError, WatchEvent, label, name_of, namespace_of};
use serde_json::{Value, json};
use tokio::sync::{Mutex, Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

/// The kinds the label is on: what gateways select by shard.
const LABELLED: [Kind; 3] = [
    Kind::ManagedCluster,
    Kind::ManifestWork,
    Kind::ClusterCompliance,
];

/// The label value `object` should carry among `shards` shards: its cluster's shard (a
/// ManagedCluster's name, a ManifestWork's or ClusterCompliance's namespace).
pub fn wanted_label(object: &Object, shards: u32) -> Option<String> {
    let cluster = match object.get("kind").and_then(Value::as_str)? {
        "ManagedCluster" => name_of(object),
        "ManifestWork" | "ClusterCompliance" => namespace_of(object)?,
        _ => return None,
    };
    Some(shard_label_value(shard_of(cluster, shards)))
}

/// Sets [`SHARD_LABEL`] on a ManagedCluster, ManifestWork or ClusterCompliance about to be
/// written by the hub; other kinds are left alone.
pub fn stamp(object: &mut Object, shards: u32) {
    let Some(value) = wanted_label(object, shards) else {
        return;
    };
    if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        let labels = meta.entry("labels").or_insert_with(|| json!({}));
        if let Some(labels) = labels.as_object_mut() {
            labels.insert(SHARD_LABEL.to_owned(), Value::String(value));
        }
    }
}

/// Whether `object` needs (re)labelling.
fn mislabelled(object: &Object, shards: u32) -> bool {
    // Being deleted: no gateway needs to find it by its label any more than it does now.
    if object.pointer("/metadata/deletionTimestamp").is_some() {
        return false;
    }
    wanted_label(object, shards).is_some_and(|want| label(object, SHARD_LABEL) != Some(&want))
}

/// An object to look at: kind, namespace, name.
type Key = (Kind, Option<String>, String);

fn key_of(kind: Kind, object: &Object) -> Key {
    (
        kind,
        namespace_of(object).map(str::to_owned),
        name_of(object).to_owned(),
    )
}

/// What the watches feed the writer: objects seen mislabelled, each once while pending.
struct Seen {
    kind: Kind,
    shards: u32,
    tx: mpsc::Sender<Key>,
    pending: Arc<Mutex<HashSet<Key>>>,
}

impl Seen {
    async fn look_at(&self, object: &Object) {
        if !mislabelled(object, self.shards) {
            return;
        }
        let key = key_of(self.kind, object);
        if !self.pending.lock().await.insert(key.clone()) {
            return;
        }
        // A full queue holds this watch back; a closed one means the labeller stopped.
        let _ = self.tx.send(key).await;
    }
}

#[async_trait]
impl Reflector for Seen {
    async fn replace(&self, items: Vec<Object>) {
        let wrong = items.iter().filter(|o| mislabelled(o, self.shards)).count();
        if wrong > 0 {
            info!(kind = %self.kind, objects = wrong, shards = self.shards, "labelling objects with their shard");
        }
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

/// Labels every ManagedCluster, ManifestWork and ClusterCompliance with its shard among
/// `shards`, until `stop`:
/// at most `concurrency` writes in flight, at most `queue` objects waiting.
pub async fn run(
    store: Arc<dyn Store>,
    shards: u32,
    concurrency: usize,
    queue: usize,
    stop: watch::Receiver<bool>,
) {
    let (tx, mut rx) = mpsc::channel::<Key>(queue.max(1));
    let pending = Arc::new(Mutex::new(HashSet::new()));
    let mut watches = JoinSet::new();
    for kind in LABELLED {
        let seen = Seen {
            kind,
            shards,
            tx: tx.clone(),
            pending: pending.clone(),
        };
        let (store, stop) = (store.clone(), stop.clone());
        watches.spawn(async move { reflect(kind, store.as_ref(), &seen, stop).await });
    }
    drop(tx);
    let permits = Arc::new(Semaphore::new(concurrency.max(1)));
    let mut writes = JoinSet::new();
    // Ends when every watch has stopped (and dropped its sender).
    while let Some(key) = rx.recv().await {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            break;
        };
        let (store, pending) = (store.clone(), pending.clone());
        writes.spawn(async move {
            if let Err(e) = relabel(store.as_ref(), &key, shards).await {
                warn!(kind = %key.0, namespace = key.1.as_deref(), name = %key.2, error = %error_chain(&e), "labelling with the shard failed; retried at its next change or relist");
            }
            pending.lock().await.remove(&key);
            drop(permit);
        });
        while writes.try_join_next().is_some() {}
    }
    while writes.join_next().await.is_some() {}
    while watches.join_next().await.is_some() {}
}

/// Attempts at one object whose writes conflict (it is changing under the labeller) before
/// leaving it to its next watch event.
const ATTEMPTS: usize = 5;

/// Reads the object and, if its label is still wrong, writes it with the right one; on a
/// conflict (changed since read) reads it again, a bounded number of times. The object's
/// own watch events are not enough to retry on: they may arrive while it is pending here.
async fn relabel(store: &dyn Store, key: &Key, shards: u32) -> Result<(), StoreError> {
    let (kind, namespace, name) = key;
    for _ in 0..ATTEMPTS {
        let Some(mut object) = store.get(*kind, namespace.as_deref(), name).await? else {
            return Ok(());
        };
        if !mislabelled(&object, shards) {
            return Ok(());
        }
        stamp(&mut object, shards);
        match store.update_spec(object).await {
            Ok(_) => {
                debug!(%kind, namespace = namespace.as_deref(), name, "labelled with its shard");
                return Ok(());
            }
            Err(StoreError::Conflict { .. }) => continue,
            Err(StoreError::NotFound { .. }) => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    warn!(%kind, namespace = namespace.as_deref(), name, attempts = ATTEMPTS, "labelling with the shard conflicted every time; left to its next change or relist");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_store::SledStore;
    use std::time::Duration;

    const SHARDS: u32 = 8;

    fn work(ns: &str, name: &str, shard_label: Option<&str>) -> Object {
        let mut o = json!({
            "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"workload": {"manifests": []}},
        });
        if let Some(v) = shard_label {
            o["metadata"]["labels"] = json!({SHARD_LABEL: v});
        }
        o
    }

    async fn until<F: Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
        flotilla_testenv::wait_for(what, Duration::from_secs(10), || {
            let holds = check();
            async { anyhow::Ok(holds.await.then_some(())) }
        })
        .await
        .unwrap_or_else(|e| panic!("never: {e}"));
    }

    async fn shard_label_of(store: &dyn Store, ns: &str, name: &str) -> Option<String> {
        let o = store
            .get(Kind::ManifestWork, Some(ns), name)
            .await
            .unwrap()
            .unwrap();
        label(&o, SHARD_LABEL).map(str::to_owned)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn labels_unlabelled_and_mislabelled_objects_once() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        let right = shard_label_value(shard_of("store-1", SHARDS));
        let wrong = shard_label_value((shard_of("store-1", SHARDS) + 1) % SHARDS);
        let labelled = store
            .create(work("store-1", "labelled", Some(&right)))
            .await
            .unwrap();
        store
            .create(work("store-1", "unlabelled", None))
            .await
            .unwrap();
        store
            .create(work("store-1", "mislabelled", Some(&wrong)))
            .await
            .unwrap();
        store
            .create(
                json!({"apiVersion": "cluster.open-cluster-management.io/v1",
                "kind": "ManagedCluster", "metadata": {"name": "store-1"},
                "spec": {"hubAcceptsClient": true}}),
            )
            .await
            .unwrap();
        let (stop_tx, stop) = watch::channel(false);
        let labeller = tokio::spawn(run(store.clone(), SHARDS, 4, 16, stop));
        until("every object carries its shard", || async {
            shard_label_of(store.as_ref(), "store-1", "unlabelled")
                .await
                .as_ref()
                == Some(&right)
                && shard_label_of(store.as_ref(), "store-1", "mislabelled")
                    .await
                    .as_ref()
                    == Some(&right)
        })
        .await;
        until("the cluster carries its shard", || async {
            let c = store
                .get(Kind::ManagedCluster, None, "store-1")
                .await
                .unwrap()
                .unwrap();
            label(&c, SHARD_LABEL) == Some(right.as_str())
        })
        .await;
        // Created later, straight to the store (as `kubectl apply` would): labelled too.
        store.create(work("store-1", "later", None)).await.unwrap();
        until("a later work is labelled", || async {
            shard_label_of(store.as_ref(), "store-1", "later")
                .await
                .as_ref()
                == Some(&right)
        })
        .await;
        // A cluster's compliance record, made without the label: labelled like its works.
        store
            .create(json!({"apiVersion": Kind::ClusterCompliance.api_version(),
                "kind": "ClusterCompliance",
                "metadata": {"name": "store-1", "namespace": "store-1"}, "spec": {}}))
            .await
            .unwrap();
        until("the compliance record carries its shard", || async {
            let c = store
                .get(Kind::ClusterCompliance, Some("store-1"), "store-1")
                .await
                .unwrap()
                .unwrap();
            label(&c, SHARD_LABEL) == Some(right.as_str())
        })
        .await;
        // A work already right was never written: no flapping, no needless writes.
        let now = store
            .get(Kind::ManifestWork, Some("store-1"), "labelled")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            flotilla_store::resource_version(&now),
            flotilla_store::resource_version(&labelled),
            "a correctly labelled work is not written"
        );
        let _ = stop_tx.send(true);
        tokio::time::timeout(Duration::from_secs(10), labeller)
            .await
            .expect("the labeller stops when told")
            .unwrap();
    }

    #[test]
    fn stamps_only_the_sharded_kinds() {
        let mut w = work("store-1", "w", None);
        stamp(&mut w, SHARDS);
        assert_eq!(
            label(&w, SHARD_LABEL),
            Some(shard_label_value(shard_of("store-1", SHARDS)).as_str())
        );
        let mut placement =
            json!({"kind": "Placement", "metadata": {"name": "p", "namespace": "n"}});
        stamp(&mut placement, SHARDS);
        assert_eq!(label(&placement, SHARD_LABEL), None);
    }
}
