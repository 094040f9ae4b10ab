//! The gateway's watch cache of desired state: one LIST + WATCH of ManifestWorks against the
//! store for the whole gateway, kept in memory by cluster namespace. Sessions are synced from
//! here, so a reconnect storm costs the store (and the hub apiserver behind it) nothing.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use flotilla_proto::api::content::ContentRef;
use flotilla_proto::api::{Kind, ManifestWork, content_hash};
use flotilla_proto::contract::WORK_CLEANUP_FINALIZER;
use flotilla_proto::session::DesiredWork;
use flotilla_store::{Object, Store, WatchEvent};
use tokio::sync::{RwLock, watch};
use tracing::{info, warn};

use crate::mailbox::WorkChange;
use crate::registry::Registry;
use flotilla_store::reflect::{Reflector, reflect};

/// Desired works by cluster namespace, then by uid.
#[derive(Default)]
pub struct DesiredState {
    works: RwLock<HashMap<String, HashMap<String, DesiredWork>>>,
    /// Works deleted on the hub that a finalizer still holds (`deletionTimestamp` set): their
    /// agents were told to delete them, and may still report their status (`Deleting`) until
    /// the finalizer goes. Namespace → uid → name.
    terminating: RwLock<HashMap<String, HashMap<String, String>>>,
    /// Set once the first list has been loaded: sessions wait for it before syncing, so a
    /// gateway that just started never tells an agent to delete what it simply has not read yet.
    ready: watch::Sender<bool>,
}

impl DesiredState {
    pub fn new() -> Arc<DesiredState> {
        Arc::new(DesiredState::default())
    }

    /// True once the first list is loaded.
    pub fn ready(&self) -> watch::Receiver<bool> {
        self.ready.subscribe()
    }

    /// Waits until the first list is loaded.
    pub async fn wait_ready(&self) {
        let mut rx = self.ready.subscribe();
        let _ = rx.wait_for(|r| *r).await;
    }

    /// What the cluster should hold now.
    pub async fn snapshot(&self, cluster: &str) -> Vec<DesiredWork> {
        self.works
            .read()
            .await
            .get(cluster)
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }

    /// The (namespace, name) of the work with this uid, if it belongs to `cluster`. A session
    /// may write status only for works in its own cluster's namespace.
    ///
    /// Waits for the first list: a gateway that just started has not read any work yet, and an
    /// agent reconnecting to it re-sends its unacknowledged statuses at once. "Not read yet" is
    /// not "not yours"; answering `None` then would drop those statuses until the agent's next
    /// session.
    pub async fn owned_by(&self, cluster: &str, uid: &str) -> Option<String> {
        self.wait_ready().await;
        if let Some(name) = self
            .works
            .read()
            .await
            .get(cluster)
            .and_then(|m| m.get(uid))
            .map(|w| w.name.clone())
        {
            return Some(name);
        }
        self.terminating
            .read()
            .await
            .get(cluster)?
            .get(uid)
            .cloned()
    }

    /// The name of `cluster`'s desired work `uid` if, as last read, it lacks the cleanup
    /// finalizer ([`WORK_CLEANUP_FINALIZER`]): the gateway adds it once the agent acknowledges
    /// the work. `None` when it has it, or is not one of the cluster's desired works.
    pub async fn lacks_cleanup_finalizer(&self, cluster: &str, uid: &str) -> Option<String> {
        #[derive(serde::Deserialize)]
        struct Work {
            metadata: Meta,
        }
        #[derive(serde::Deserialize)]
        struct Meta {
            #[serde(default)]
            finalizers: Vec<String>,
        }
        self.wait_ready().await;
        let works = self.works.read().await;
        let work = works.get(cluster)?.get(uid)?;
        let meta = serde_json::from_slice::<Work>(&work.manifest_work_json).ok()?;
        (!meta
            .metadata
            .finalizers
            .iter()
            .any(|f| f == WORK_CLEANUP_FINALIZER))
        .then(|| work.name.clone())
    }

    /// The uids of `cluster`'s works deleted on the hub that a finalizer still holds.
    pub async fn terminating(&self, cluster: &str) -> Vec<String> {
        self.wait_ready().await;
        self.terminating
            .read()
            .await
            .get(cluster)
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Whether `uid` is one of `cluster`'s desired works and its content reference names the
    /// chunk `chunk_sha256`: an agent is served only chunks of its own cluster's works.
    pub async fn names_chunk(&self, cluster: &str, uid: &str, chunk_sha256: &str) -> bool {
        self.wait_ready().await;
        let works = self.works.read().await;
        let Some(work) = works.get(cluster).and_then(|m| m.get(uid)) else {
            return false;
        };
        serde_json::from_slice::<ManifestWork>(&work.manifest_work_json)
            .ok()
            .and_then(|w| ContentRef::of(&w))
            .and_then(Result::ok)
            .is_some_and(|r| r.chunks.iter().any(|c| c == chunk_sha256))
    }

    /// Records whether a stored work is held by a finalizer after its deletion; `true` when it
    /// is, and so no longer desired.
    async fn note_terminating(&self, obj: &serde_json::Value) -> bool {
        let meta = &obj["metadata"];
        let (Some(ns), Some(uid), Some(name)) = (
            meta["namespace"].as_str(),
            meta["uid"].as_str(),
            meta["name"].as_str(),
        ) else {
            return false;
        };
        let mut terminating = self.terminating.write().await;
        if meta.get("deletionTimestamp").is_some_and(|t| !t.is_null()) {
            terminating
                .entry(ns.to_owned())
                .or_default()
                .insert(uid.to_owned(), name.to_owned());
            true
        } else {
            if let Some(m) = terminating.get_mut(ns) {
                m.remove(uid);
            }
            false
        }
    }

    /// Keeps the cache in step with the store until `stop` fires (see [`reflect`]). Changes go
    /// to the sessions of the clusters they concern.
    pub async fn run(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        registry: Arc<Registry>,
        stop: watch::Receiver<bool>,
    ) {
        let target = Reflecting {
            state: &self,
            registry: &registry,
        };
        reflect(Kind::ManifestWork, store.as_ref(), &target, stop).await;
    }

    /// Replaces the cache with a fresh list and tells sessions what changed meanwhile.
    async fn replace(&self, items: Vec<Object>, registry: &Registry) {
        let mut fresh: HashMap<String, HashMap<String, DesiredWork>> = HashMap::new();
        self.terminating.write().await.clear();
        for obj in items {
            if self.note_terminating(&obj).await {
                continue;
            }
            if let Some(w) = desired_work(obj) {
                fresh
                    .entry(w.namespace.clone())
                    .or_default()
                    .insert(w.uid.clone(), w);
            }
        }
        let old = std::mem::replace(&mut *self.works.write().await, fresh.clone());
        // After the first list, a relist can hide changes that happened while the watch was
        // down: diff and deliver them.
        if *self.ready.borrow() {
            for (ns, works) in &fresh {
                for (uid, w) in works {
                    let before = old.get(ns).and_then(|m| m.get(uid));
                    if before.map(|b| &b.content_hash) != Some(&w.content_hash) {
                        registry.deliver(ns, WorkChange::Upsert(w.clone())).await;
                    }
                }
            }
            for (ns, works) in &old {
                for (uid, w) in works {
                    if fresh.get(ns).is_none_or(|m| !m.contains_key(uid)) {
                        registry.deliver(ns, deletion(w)).await;
                    }
                }
            }
        } else {
            let count: usize = fresh.values().map(HashMap::len).sum();
            info!(
                works = count,
                clusters = fresh.len(),
                "desired state loaded"
            );
            self.ready.send_replace(true);
        }
    }

    async fn apply(&self, event: WatchEvent, registry: &Registry) {
        match event {
            WatchEvent::Added(obj) | WatchEvent::Modified(obj)
                if self.note_terminating(&obj).await =>
            {
                // Deleted on the hub, held by a finalizer: the agent removes its resources now.
                let Some(w) = desired_work(obj) else { return };
                let removed = {
                    let mut works = self.works.write().await;
                    works.get_mut(&w.namespace).and_then(|m| m.remove(&w.uid))
                };
                if removed.is_some() {
                    registry.deliver(&w.namespace.clone(), deletion(&w)).await;
                }
            }
            WatchEvent::Added(obj) | WatchEvent::Modified(obj) => {
                let Some(w) = desired_work(obj) else { return };
                let changed = {
                    let mut works = self.works.write().await;
                    let ns = works.entry(w.namespace.clone()).or_default();
                    let changed = ns.get(&w.uid).map(|o| &o.content_hash) != Some(&w.content_hash)
                        || ns.get(&w.uid).map(|o| o.generation) != Some(w.generation);
                    ns.insert(w.uid.clone(), w.clone());
                    changed
                };
                // Status-only writes (ours, from agents) do not change the spec: nothing to send.
                if changed {
                    registry
                        .deliver(&w.namespace.clone(), WorkChange::Upsert(w))
                        .await;
                }
            }
            WatchEvent::Deleted(obj) => {
                self.note_terminating(&serde_json::json!({"metadata": {
                    "namespace": obj["metadata"]["namespace"], "uid": obj["metadata"]["uid"],
                    "name": obj["metadata"]["name"]}}))
                    .await;
                let Some(w) = desired_work(obj) else { return };
                let removed = {
                    let mut works = self.works.write().await;
                    works.get_mut(&w.namespace).and_then(|m| m.remove(&w.uid))
                };
                if removed.is_some() {
                    registry.deliver(&w.namespace.clone(), deletion(&w)).await;
                }
            }
        }
    }
}

/// The desired state and the sessions it feeds, as one [`Reflector`].
struct Reflecting<'a> {
    state: &'a DesiredState,
    registry: &'a Registry,
}

#[async_trait]
impl Reflector for Reflecting<'_> {
    async fn replace(&self, items: Vec<Object>) {
        self.state.replace(items, self.registry).await;
    }
    async fn apply(&self, event: WatchEvent) {
        self.state.apply(event, self.registry).await;
    }
}

fn deletion(w: &DesiredWork) -> WorkChange {
    WorkChange::Delete {
        uid: w.uid.clone(),
        namespace: w.namespace.clone(),
        name: w.name.clone(),
    }
}

/// The frame that carries a stored ManifestWork to its agent: the object without its status
/// (the agent owns status) and without bookkeeping the agent does not need.
pub fn desired_work(mut obj: serde_json::Value) -> Option<DesiredWork> {
    if let Some(o) = obj.as_object_mut() {
        o.remove("status");
    }
    if let Some(meta) = obj.get_mut("metadata").and_then(|m| m.as_object_mut()) {
        meta.remove("managedFields");
    }
    let work: ManifestWork = match serde_json::from_value(obj.clone()) {
        Ok(w) => w,
        Err(e) => {
            warn!(error = %e, "stored ManifestWork does not parse; not delivered");
            return None;
        }
    };
    let meta = &work.metadata;
    Some(DesiredWork {
        uid: meta.uid.clone()?,
        namespace: meta.namespace.clone()?,
        name: meta.name.clone()?,
        generation: meta.generation.unwrap_or(1),
        content_hash: content_hash(&work.spec),
        manifest_work_json: serde_json::to_vec(&obj).ok()?,
    })
}

#[cfg(test)]
mod tests {
    //! A work held by a finalizer after its deletion is no longer desired, yet its status is
    //! still the cluster's to report.

    use super::*;
    use crate::test_support::eventually;
    use flotilla_store::SledStore;
    use serde_json::json;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_work_asked_about_before_the_first_list_is_found_once_it_is_loaded() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        let stored = store
            .create(json!({
                "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
                "metadata": {"name": "early", "namespace": "store-1"},
                "spec": {"workload": {"manifests": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}]}},
            }))
            .await
            .unwrap();
        let uid = stored["metadata"]["uid"].as_str().unwrap().to_owned();
        let desired = DesiredState::new();
        // Asked first (an agent's status arriving at a gateway that just started), loaded after.
        let asked = tokio::spawn({
            let (desired, uid) = (desired.clone(), uid.clone());
            async move { desired.owned_by("store-1", &uid).await }
        });
        let (stop_tx, stop) = watch::channel(false);
        tokio::spawn(
            desired
                .clone()
                .run(store.clone(), Arc::new(Registry::default()), stop),
        );
        assert_eq!(asked.await.unwrap().as_deref(), Some("early"));
        assert_eq!(
            desired.owned_by("store-2", &uid).await,
            None,
            "not another cluster's"
        );
        let _ = stop_tx.send(true);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_terminating_work_leaves_the_desired_state_but_keeps_its_owner() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        let stored = store
            .create(json!({
                "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
                "metadata": {"name": "held", "namespace": "store-1",
                             "finalizers": ["cluster.open-cluster-management.io/manifest-work-cleanup"]},
                "spec": {"workload": {"manifests": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}]}},
            }))
            .await
            .unwrap();
        let uid = stored["metadata"]["uid"].as_str().unwrap().to_owned();
        let desired = DesiredState::new();
        let (stop_tx, stop) = watch::channel(false);
        tokio::spawn(
            desired
                .clone()
                .run(store.clone(), Arc::new(Registry::default()), stop),
        );
        desired.wait_ready().await;
        assert_eq!(desired.snapshot("store-1").await.len(), 1);

        store
            .delete(Kind::ManifestWork, Some("store-1"), "held")
            .await
            .unwrap();
        eventually("the work leaves the desired state", || async {
            desired.snapshot("store-1").await.is_empty()
        })
        .await;
        assert_eq!(
            desired.owned_by("store-1", &uid).await.as_deref(),
            Some("held")
        );

        // The finalizer goes: the work is gone for good.
        let mut last = store
            .get(Kind::ManifestWork, Some("store-1"), "held")
            .await
            .unwrap()
            .unwrap();
        last["metadata"]["finalizers"] = json!([]);
        store.update_spec(last).await.unwrap();
        eventually("the owner is forgotten", || async {
            desired.owned_by("store-1", &uid).await.is_none()
        })
        .await;
        let _ = stop_tx.send(true);
    }
}
