//! The gateway's watch cache of desired state: one LIST + WATCH of ManifestWorks against the
//! store for the whole gateway, kept in memory by cluster namespace. Sessions are synced from
//! here, so a reconnect storm costs the store (and the hub apiserver behind it) nothing.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use flotilla_proto::api::{Kind, ManifestWork, content_hash};
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
    /// Set once the first list has been loaded: sessions wait for it before syncing, so a
    /// gateway that just started never tells an agent to delete what it simply has not read yet.
    ready: watch::Sender<bool>,
}

impl DesiredState {
    pub fn new() -> Arc<DesiredState> {
        Arc::new(DesiredState::default())
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
    pub async fn owned_by(&self, cluster: &str, uid: &str) -> Option<String> {
        self.works
            .read()
            .await
            .get(cluster)?
            .get(uid)
            .map(|w| w.name.clone())
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
        for obj in items {
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
