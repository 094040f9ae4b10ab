//! The gateway's watch cache of desired state: one LIST + WATCH of ManifestWorks against the
//! store for the whole gateway, selected by the shards it holds (see [`crate::shards::cache`]),
//! kept in memory by cluster namespace. Sessions are synced from here, so a reconnect storm
//! costs the store (and the hub apiserver behind it) nothing.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use async_trait::async_trait;
use flotilla_ops::error_chain;
use flotilla_proto::api::content::ContentRef;
use flotilla_proto::api::{Kind, ManifestWork, content_hash};
use flotilla_proto::contract::WORK_CLEANUP_FINALIZER;
use flotilla_proto::session::{Delivered, DesiredWork};
use flotilla_store::{Basis, Object, Revision, Store, WatchEvent, namespace_of};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::finalizers::CleanupFinalizers;
use crate::locks::{read, write};
use crate::mailbox::WorkChange;
use crate::registry::Registry;
use crate::shards::ShardViews;
use crate::shards::cache::{ShardCache, ShardLoad, ShardSet, follow_shards};

/// Desired works by cluster namespace, then by uid.
#[derive(Default)]
pub struct DesiredState {
    works: RwLock<HashMap<String, HashMap<String, DesiredWork>>>,
    /// Works deleted on the hub that a finalizer still holds (`deletionTimestamp` set): their
    /// agents were told to delete them, and may still report their status (`Deleting`) until
    /// the finalizer goes. Namespace → uid → name.
    terminating: RwLock<HashMap<String, HashMap<String, String>>>,
    /// What each work (by uid) was as last listed or watched, with its namespace: its
    /// resourceVersion and fencing record, the basis a status write of it is compared against
    /// when this gateway has written nothing of it yet (see `crate::fencing`).
    bases: RwLock<HashMap<String, (String, Basis)>>,
    /// Set once the first list has been loaded (readiness; sessions wait on `load`).
    ready: watch::Sender<bool>,
    /// The shards listed so far: a session waits for its cluster's shard before syncing, so a
    /// gateway that just started, or just acquired the shard, never tells an agent to delete
    /// what it simply has not read yet.
    load: ShardLoad,
}

impl DesiredState {
    pub fn new() -> Arc<DesiredState> {
        Arc::new(DesiredState::default())
    }

    /// True once the first list is loaded.
    pub fn ready(&self) -> watch::Receiver<bool> {
        self.ready.subscribe()
    }

    /// The shards loaded, as they change.
    pub fn loaded_shards(&self) -> watch::Receiver<Option<crate::shards::cache::ShardSet>> {
        self.load.subscribe()
    }

    /// Waits until the first list is loaded.
    pub async fn wait_ready(&self) {
        let mut rx = self.ready.subscribe();
        let _ = rx.wait_for(|r| *r).await;
    }

    /// Waits until `cluster`'s shard is loaded: only then does the cache speak for it.
    pub async fn wait_loaded(&self, cluster: &str) {
        self.load.wait_for(cluster).await;
    }

    /// Work `uid` as this cache last saw it: its resourceVersion and fencing record. Never
    /// waits.
    pub fn basis(&self, uid: &str) -> Option<Basis> {
        read(&self.bases).get(uid).map(|(_, basis)| basis.clone())
    }

    /// Records `obj`'s basis, as listed or watched.
    fn note_basis(&self, obj: &Object) {
        if let (Some(ns), Some(uid), Some(basis)) = (
            namespace_of(obj),
            obj["metadata"]["uid"].as_str(),
            Basis::of(obj),
        ) {
            write(&self.bases).insert(uid.to_owned(), (ns.to_owned(), basis));
        }
    }

    /// Whether `cluster`'s work `uid` is in the cache now, desired or deleted and held by a
    /// finalizer; `false` while the cluster's shard is not loaded (not yet, or handed over).
    /// Never waits.
    pub fn has_work(&self, cluster: &str, uid: &str) -> bool {
        self.load.has(cluster)
            && (read(&self.works)
                .get(cluster)
                .is_some_and(|m| m.contains_key(uid))
                || read(&self.terminating)
                    .get(cluster)
                    .is_some_and(|m| m.contains_key(uid)))
    }

    /// How many works the cache holds (desired, and deleted but held by a finalizer); `None`
    /// if it is being written at this instant.
    pub fn cached(&self) -> Option<usize> {
        let works: usize = self.works.try_read().ok()?.values().map(HashMap::len).sum();
        let terminating: usize = self
            .terminating
            .try_read()
            .ok()?
            .values()
            .map(HashMap::len)
            .sum();
        Some(works + terminating)
    }

    /// What the cluster should hold now.
    pub fn snapshot(&self, cluster: &str) -> Vec<DesiredWork> {
        read(&self.works)
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
        self.wait_loaded(cluster).await;
        if let Some(name) = read(&self.works)
            .get(cluster)
            .and_then(|m| m.get(uid))
            .map(|w| w.name.clone())
        {
            return Some(name);
        }
        read(&self.terminating).get(cluster)?.get(uid).cloned()
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
        self.wait_loaded(cluster).await;
        let works = read(&self.works);
        let work = works.get(cluster)?.get(uid)?;
        let meta = serde_json::from_slice::<Work>(&work.manifest_work_json).ok()?;
        (!meta
            .metadata
            .finalizers
            .iter()
            .any(|f| f == WORK_CLEANUP_FINALIZER))
        .then(|| work.name.clone())
    }

    /// `cluster`'s desired work `uid` as this cache last saw it, with what a write of it is
    /// judged against: its spec, metadata and resourceVersion as stored then, and the fencing
    /// record of its status (the cache keeps no other status). A write of it conditioned on
    /// that version lands only if nothing changed since, so it needs no read first. `None`
    /// when the work is not one of the cluster's desired works, or its fencing record is not
    /// of the same version.
    pub async fn work_as_seen(&self, cluster: &str, uid: &str) -> Option<Object> {
        self.wait_loaded(cluster).await;
        let mut work: Object = {
            let works = read(&self.works);
            serde_json::from_slice(&works.get(cluster)?.get(uid)?.manifest_work_json).ok()?
        };
        let basis = self.basis(uid)?;
        if Revision::of(&work).as_ref() != Some(&basis.revision) {
            return None;
        }
        if let Some(fence) = basis.fence {
            let mut status = serde_json::json!({});
            fence.set_in(&mut status);
            work["status"] = status;
        }
        Some(work)
    }

    /// The uids of `cluster`'s works deleted on the hub that a finalizer still holds.
    pub async fn terminating(&self, cluster: &str) -> Vec<String> {
        self.wait_loaded(cluster).await;
        read(&self.terminating)
            .get(cluster)
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Whether `uid` is one of `cluster`'s desired works and its content reference names the
    /// chunk `chunk_sha256`: an agent is served only chunks of its own cluster's works.
    pub async fn names_chunk(&self, cluster: &str, uid: &str, chunk_sha256: &str) -> bool {
        self.wait_loaded(cluster).await;
        let works = read(&self.works);
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
    fn note_terminating(&self, obj: &serde_json::Value) -> bool {
        let meta = &obj["metadata"];
        let (Some(ns), Some(uid), Some(name)) = (
            meta["namespace"].as_str(),
            meta["uid"].as_str(),
            meta["name"].as_str(),
        ) else {
            return false;
        };
        let mut terminating = write(&self.terminating);
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

    /// Keeps the cache in step with the store's works in the shards `shards` says this gateway
    /// holds, until `stop` fires (see [`follow_shards`]). Changes go to the sessions of the
    /// clusters they concern.
    /// Deleted works that no agent ever reported on, while their cluster has no session here,
    /// go to `finalizers` to be let go at once (see [`let_go_if_unheard`]).
    pub async fn run(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        registry: Arc<Registry>,
        finalizers: Arc<CleanupFinalizers>,
        shards: ShardViews,
        stop: watch::Receiver<bool>,
    ) {
        let target = Reflecting {
            state: &self,
            registry: &registry,
            finalizers: &finalizers,
            store: store.as_ref(),
        };
        follow_shards(Kind::ManifestWork, store.as_ref(), &target, shards, stop).await;
    }

    /// Replaces the cache with a fresh list of `set` and tells sessions what changed meanwhile.
    async fn replace(
        &self,
        items: Vec<Object>,
        set: &ShardSet,
        registry: &Registry,
        finalizers: &CleanupFinalizers,
        store: &dyn Store,
    ) {
        let mut fresh: HashMap<String, HashMap<String, DesiredWork>> = HashMap::new();
        write(&self.terminating).clear();
        write(&self.bases).clear();
        for obj in items {
            // Labelled with a held shard but of another shard's cluster (a label not yet
            // corrected by the hub): not this gateway's to serve.
            if !namespace_of(&obj).is_some_and(|ns| set.has_cluster(ns)) {
                continue;
            }
            self.note_basis(&obj);
            if self.note_terminating(&obj) {
                let_go_if_unheard(&obj, registry, finalizers);
                continue;
            }
            if let Some(w) = desired_work(obj) {
                fresh
                    .entry(w.namespace.clone())
                    .or_default()
                    .insert(w.uid.clone(), w);
            }
        }
        let old = std::mem::replace(&mut *write(&self.works), fresh.clone());
        // For shards loaded before, a relist can hide changes that happened while the watch
        // was down: diff and deliver them. Sessions of shards loaded now wait for this load
        // and sync from the snapshot.
        let loaded_before = |ns: &str| self.load.has(ns);
        {
            for (ns, works) in fresh.iter().filter(|(ns, _)| loaded_before(ns)) {
                for (uid, w) in works {
                    let before = old.get(ns).and_then(|m| m.get(uid));
                    if before.map(|b| &b.content_hash) != Some(&w.content_hash) {
                        registry.deliver(ns, WorkChange::Upsert(w.clone()));
                    }
                }
            }
            for (ns, works) in old.iter().filter(|(ns, _)| loaded_before(ns)) {
                for (uid, w) in works {
                    if fresh.get(ns).is_none_or(|m| !m.contains_key(uid)) && gone(store, w).await {
                        registry.deliver(ns, deletion(w));
                    }
                }
            }
        }
        let count: usize = fresh.values().map(HashMap::len).sum();
        info!(
            works = count,
            clusters = fresh.len(),
            %set,
            "desired state loaded"
        );
        self.ready.send_replace(true);
    }

    /// Forgets the works of clusters outside `set`, telling no session: shards handed over.
    async fn retain(&self, set: &ShardSet) {
        write(&self.works).retain(|ns, _| set.has_cluster(ns));
        write(&self.terminating).retain(|ns, _| set.has_cluster(ns));
        write(&self.bases).retain(|_, (ns, _)| set.has_cluster(ns));
    }

    async fn apply(
        &self,
        event: WatchEvent,
        registry: &Registry,
        finalizers: &CleanupFinalizers,
        store: &dyn Store,
    ) {
        match &event {
            WatchEvent::Added(obj) | WatchEvent::Modified(obj) => self.note_basis(obj),
            WatchEvent::Deleted(obj) => {
                if let Some(uid) = obj["metadata"]["uid"].as_str() {
                    write(&self.bases).remove(uid);
                }
            }
        }
        match event {
            WatchEvent::Added(obj) | WatchEvent::Modified(obj) if self.note_terminating(&obj) => {
                // Deleted on the hub, held by a finalizer: the agent removes its resources now.
                let_go_if_unheard(&obj, registry, finalizers);
                let Some(w) = desired_work(obj) else { return };
                let removed = {
                    let mut works = write(&self.works);
                    works.get_mut(&w.namespace).and_then(|m| m.remove(&w.uid))
                };
                if removed.is_some() {
                    registry.deliver(&w.namespace.clone(), deletion(&w));
                }
            }
            WatchEvent::Added(obj) | WatchEvent::Modified(obj) => {
                let Some(w) = desired_work(obj) else { return };
                let changed = {
                    let mut works = write(&self.works);
                    let ns = works.entry(w.namespace.clone()).or_default();
                    let changed = ns.get(&w.uid).map(|o| &o.content_hash) != Some(&w.content_hash)
                        || ns.get(&w.uid).map(|o| o.generation) != Some(w.generation);
                    ns.insert(w.uid.clone(), w.clone());
                    changed
                };
                // Status-only writes (ours, from agents) do not change the spec: nothing to send.
                if changed {
                    registry.deliver(&w.namespace.clone(), WorkChange::Upsert(w));
                }
            }
            WatchEvent::Deleted(obj) => {
                self.note_terminating(&serde_json::json!({"metadata": {
                    "namespace": obj["metadata"]["namespace"], "uid": obj["metadata"]["uid"],
                    "name": obj["metadata"]["name"]}}));
                let Some(w) = desired_work(obj) else { return };
                let removed = {
                    let mut works = write(&self.works);
                    works.get_mut(&w.namespace).and_then(|m| m.remove(&w.uid))
                };
                if removed.is_some() && gone(store, &w).await {
                    registry.deliver(&w.namespace.clone(), deletion(&w));
                }
            }
        }
    }
}

/// A work deleted on the hub and held by its cleanup finalizer that no agent ever reported on
/// (its status has no condition and no manifest's status), while its cluster has no session
/// here: its finalizer goes at once, as it would never have been added had the gateway added
/// it on the agent's acknowledgement (the hub puts it on the works it creates). An agent that
/// connects later and holds the work anyway is told in its sync that the work is gone, and
/// removes it. A cluster with a session hears of the deletion now, and its agent releases
/// the work, held or not.
fn let_go_if_unheard(obj: &Object, registry: &Registry, finalizers: &CleanupFinalizers) {
    let meta = &obj["metadata"];
    let (Some(cluster), Some(uid)) = (meta["namespace"].as_str(), meta["uid"].as_str()) else {
        return;
    };
    let held = meta["finalizers"]
        .as_array()
        .is_some_and(|f| f.iter().any(|f| f == WORK_CLEANUP_FINALIZER));
    let status = &obj["status"];
    let reported = status["conditions"]
        .as_array()
        .is_some_and(|c| !c.is_empty())
        || status["resourceStatus"]["manifests"]
            .as_array()
            .is_some_and(|m| !m.is_empty());
    if held && !reported && registry.get(cluster).is_none() {
        debug!(cluster, work_uid = %uid, "deleted work no agent reported on: its finalizer goes");
        finalizers.release(cluster, uid, None);
    }
}

/// The desired state and the sessions it feeds, as one [`Reflector`].
struct Reflecting<'a> {
    state: &'a DesiredState,
    registry: &'a Registry,
    finalizers: &'a CleanupFinalizers,
    store: &'a dyn Store,
}

#[async_trait]
impl ShardCache for Reflecting<'_> {
    async fn replace(&self, items: Vec<Object>, set: &ShardSet) {
        self.state
            .replace(items, set, self.registry, self.finalizers, self.store)
            .await;
    }
    async fn apply(&self, event: WatchEvent, set: &ShardSet) {
        // Labelled with a held shard but of another shard's cluster: not ours to serve.
        if !namespace_of(event.object()).is_some_and(|ns| set.has_cluster(ns)) {
            return;
        }
        self.state
            .apply(event, self.registry, self.finalizers, self.store)
            .await;
    }
    async fn retain(&self, set: &ShardSet) {
        self.state.retain(set).await;
    }
    fn load(&self) -> &ShardLoad {
        &self.state.load
    }
}

/// Whether a work that left the cache is gone from the store, asked before its agent is told to
/// delete it. A selected watch reports a work whose shard label changed (the hub's labeller
/// correcting a label after an upgrade or a change of `--shards`) as deleted, as a relist that
/// no longer finds it does; the agent keeps such a work, and the gateway of its labelled shard
/// serves it. One read per deletion; a store that cannot answer counts as "not gone" (the
/// agent keeps the work until a later change says otherwise, never deletes on a guess).
async fn gone(store: &dyn Store, w: &DesiredWork) -> bool {
    match store
        .get(Kind::ManifestWork, Some(&w.namespace), &w.name)
        .await
    {
        Ok(Some(obj)) if obj["metadata"]["uid"] == w.uid.as_str() => {
            let terminating = !obj["metadata"]["deletionTimestamp"].is_null();
            if !terminating {
                warn!(
                    cluster = %w.namespace, work = %w.name,
                    label = %obj["metadata"]["labels"][flotilla_proto::contract::SHARD_LABEL],
                    "a work left this gateway's cache but is still stored (its shard label changed): its agent keeps it"
                );
            }
            terminating
        }
        // Gone, or replaced by another work of the same name.
        Ok(_) => true,
        Err(e) => {
            warn!(cluster = %w.namespace, work = %w.name, error = %error_chain(&e), "cannot confirm a work's deletion: its agent keeps it for now");
            false
        }
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
        kind: Delivered::Work.kind().to_owned(),
    })
}

#[cfg(test)]
mod tests {
    //! A work held by a finalizer after its deletion is no longer desired, yet its status is
    //! still the cluster's to report.

    use super::*;
    use crate::shards::ShardView;
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
        let stop_tx = follow(&desired, &store, ShardView::all_views());
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
        let stop_tx = follow(&desired, &store, ShardView::all_views());
        desired.wait_ready().await;
        assert_eq!(desired.snapshot("store-1").len(), 1);

        store
            .delete(Kind::ManifestWork, Some("store-1"), "held")
            .await
            .unwrap();
        eventually("the work leaves the desired state", || async {
            desired.snapshot("store-1").is_empty()
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

    /// Every lookup a session's driver makes on behalf of its cluster (whose work a uid is,
    /// whether its cleanup finalizer may be added, whether it names a chunk, which works are
    /// being deleted) answers for that cluster only: another cluster's session naming the
    /// same uid or digest learns nothing and can start no write.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sessions_lookups_answer_for_its_own_cluster_only() {
        use flotilla_proto::api::Manifest;
        use flotilla_proto::api::content;
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        let (reference, chunks) = content::split(&[Manifest(
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "big"}}),
        )]);
        let chunked = store
            .create(json!({
                "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
                "metadata": {"name": "chunked", "namespace": "store-1"},
                "spec": {"workload": {"manifests": [reference.manifest().0]}},
            }))
            .await
            .unwrap();
        let uid = chunked["metadata"]["uid"].as_str().unwrap().to_owned();
        let held = store
            .create(json!({
                "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
                "metadata": {"name": "held", "namespace": "store-1",
                             "finalizers": [WORK_CLEANUP_FINALIZER]},
                "spec": {"workload": {"manifests": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}]}},
            }))
            .await
            .unwrap();
        let held_uid = held["metadata"]["uid"].as_str().unwrap().to_owned();
        store
            .delete(Kind::ManifestWork, Some("store-1"), "held")
            .await
            .unwrap();
        let desired = DesiredState::new();
        let stop_tx = follow(&desired, &store, ShardView::all_views());
        eventually("the deleted work is seen held", || async {
            desired.terminating("store-1").await == [held_uid.clone()]
        })
        .await;
        let sha = &chunks[0].sha256;

        assert_eq!(
            desired.owned_by("store-1", &uid).await.as_deref(),
            Some("chunked")
        );
        assert_eq!(
            desired
                .lacks_cleanup_finalizer("store-1", &uid)
                .await
                .as_deref(),
            Some("chunked")
        );
        assert!(desired.names_chunk("store-1", &uid, sha).await);

        assert_eq!(desired.owned_by("store-2", &uid).await, None);
        assert_eq!(desired.owned_by("store-2", &held_uid).await, None);
        assert_eq!(desired.lacks_cleanup_finalizer("store-2", &uid).await, None);
        assert!(!desired.names_chunk("store-2", &uid, sha).await);
        assert!(desired.terminating("store-2").await.is_empty());
        assert!(desired.snapshot("store-2").is_empty());
        let _ = stop_tx.send(true);
    }

    /// Shards of a 4-shard fleet, and a cluster name in each of two of them.
    const SHARDS: u32 = 4;

    fn two_clusters() -> ((String, u32), (String, u32)) {
        use flotilla_proto::contract::shard_of;
        let a = ("store-1".to_owned(), shard_of("store-1", SHARDS));
        let b = (1..100)
            .map(|i| format!("store-{i}"))
            .map(|c| {
                let s = shard_of(&c, SHARDS);
                (c, s)
            })
            .find(|(_, s)| *s != a.1)
            .expect("some cluster hashes to another shard");
        (a, b)
    }

    /// A work of `cluster`, labelled with its shard as the hub labels it.
    fn labelled_work(cluster: &str, name: &str) -> Object {
        use flotilla_proto::contract::{SHARD_LABEL, shard_label_value, shard_of};
        json!({
            "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
            "metadata": {"name": name, "namespace": cluster,
                         "labels": {SHARD_LABEL: shard_label_value(shard_of(cluster, SHARDS))}},
            "spec": {"workload": {"manifests": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}}]}},
        })
    }

    /// Runs `desired` on `store` with the shard views `views`, until the sender says stop.
    fn follow(
        desired: &Arc<DesiredState>,
        store: &Arc<dyn Store>,
        views: ShardViews,
    ) -> watch::Sender<bool> {
        let (stop_tx, stop) = watch::channel(false);
        tokio::spawn(desired.clone().run(
            store.clone(),
            Arc::new(Registry::default()),
            CleanupFinalizers::for_tests(),
            views,
            stop,
        ));
        stop_tx
    }

    /// A leased view holding `held` (for an hour).
    fn holding(held: &[u32]) -> Arc<ShardView> {
        use crate::shards::{Fence, ShardDirectory};
        let fence = Fence {
            epoch: 1,
            valid_until: tokio::time::Instant::now() + std::time::Duration::from_secs(3600),
        };
        Arc::new(ShardView::leased(
            SHARDS,
            held.iter().map(|s| (*s, fence)).collect(),
            ShardDirectory::default(),
        ))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_cache_follows_the_held_shards_and_drops_the_ones_it_lost() {
        let ((a, shard_a), (b, shard_b)) = two_clusters();
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        store.create(labelled_work(&a, "one")).await.unwrap();
        store.create(labelled_work(&b, "one")).await.unwrap();
        store.create(labelled_work(&b, "two")).await.unwrap();
        let views = watch::Sender::new(holding(&[shard_a]));
        let desired = DesiredState::new();
        let stop_tx = follow(&desired, &store, views.subscribe());
        desired.wait_loaded(&a).await;
        assert_eq!(desired.snapshot(&a).len(), 1);
        assert!(
            desired.snapshot(&b).is_empty(),
            "another shard's works are not cached"
        );
        assert_eq!(desired.cached(), Some(1));
        // Live changes: only the held shard's.
        store.create(labelled_work(&a, "two")).await.unwrap();
        store.create(labelled_work(&b, "three")).await.unwrap();
        eventually("the held shard's new work arrives", || async {
            desired.snapshot(&a).len() == 2
        })
        .await;
        assert!(desired.snapshot(&b).is_empty());

        // The lease round hands shard a over and acquires shard b.
        views.send_replace(holding(&[shard_b]));
        eventually("shard b is loaded", || async { desired.load.has(&b) }).await;
        assert!(!desired.load.has(&a), "a lost shard is not loaded");
        assert_eq!(desired.snapshot(&b).len(), 3);
        assert!(
            desired.snapshot(&a).is_empty(),
            "a lost shard's works leave the cache"
        );
        assert_eq!(desired.cached(), Some(3));
        let _ = stop_tx.send(true);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_session_of_a_newly_acquired_shard_waits_for_its_load() {
        let ((a, shard_a), (b, shard_b)) = two_clusters();
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        store.create(labelled_work(&b, "baseline")).await.unwrap();
        let views = watch::Sender::new(holding(&[shard_a]));
        let desired = DesiredState::new();
        let stop_tx = follow(&desired, &store, views.subscribe());
        desired.wait_loaded(&a).await;
        // A session of b's cluster arrives as the gateway acquires b: it syncs as the driver
        // does (wait for the cluster's load, then take the snapshot).
        views.send_replace(holding(&[shard_a, shard_b]));
        let session = tokio::spawn({
            let (desired, b) = (desired.clone(), b.clone());
            async move {
                desired.wait_loaded(&b).await;
                desired.snapshot(&b)
            }
        });
        let synced = tokio::time::timeout(std::time::Duration::from_secs(10), session)
            .await
            .expect("the session syncs once the shard is loaded")
            .unwrap();
        assert_eq!(
            synced.iter().map(|w| w.name.as_str()).collect::<Vec<_>>(),
            ["baseline"],
            "synced from the loaded shard, never from an empty cache"
        );
        assert!(
            desired.load.has(&a),
            "the shard held all along stays loaded"
        );
        let _ = stop_tx.send(true);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_late_renewal_keeps_the_shard_cached() {
        use crate::shards::{Fence, ShardDirectory};
        let ((a, shard_a), (b, shard_b)) = two_clusters();
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        store.create(labelled_work(&a, "kept")).await.unwrap();
        store.create(labelled_work(&b, "acquired")).await.unwrap();
        let views = watch::Sender::new(holding(&[shard_a]));
        let desired = DesiredState::new();
        let stop_tx = follow(&desired, &store, views.subscribe());
        desired.wait_loaded(&a).await;
        // A lease round late under load: shard a's fence ran out (lapsed, not lost) in the
        // round that acquires shard b.
        let now = tokio::time::Instant::now();
        let lapsed = Fence {
            epoch: 1,
            valid_until: now - std::time::Duration::from_secs(1),
        };
        let held = Fence {
            epoch: 1,
            valid_until: now + std::time::Duration::from_secs(3600),
        };
        views.send_replace(Arc::new(ShardView::leased(
            SHARDS,
            [(shard_a, lapsed), (shard_b, held)].into(),
            ShardDirectory::default(),
        )));
        eventually("shard b is loaded", || async { desired.load.has(&b) }).await;
        assert!(
            desired.load.has(&a),
            "a lapsed shard stays loaded: its sessions need no relist when the renewal lands"
        );
        assert_eq!(
            desired
                .snapshot(&a)
                .iter()
                .map(|w| w.name.as_str())
                .collect::<Vec<_>>(),
            ["kept"]
        );
        let _ = stop_tx.send(true);
    }
}
