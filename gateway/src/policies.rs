//! The gateway's watch cache of governance policies: one LIST + WATCH of root Policies for
//! the whole gateway (every namespace; a fleet has hundreds of policies, not a shard's worth),
//! and which clusters each reaches, as the hub's governance controller writes it in the root's
//! `status.status[]`. A cluster's sessions carry its policies beside its works: the same
//! frames (`WorkUpdate` of kind `Policy`), the same sync at hello, the same resume by uid,
//! generation and content hash; a policy that stops reaching a cluster (unbound, the cluster
//! left the placement, the policy disabled or deleted) is deleted from its agent.
//!
//! The hub decides the reach; the gateway never resolves bindings itself, so there is one
//! answer fleet-wide and a gateway restart costs one list.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, RwLock};

use async_trait::async_trait;
use flotilla_proto::api::{Kind, value_hash};
use flotilla_proto::session::{Delivered, DesiredWork};
use flotilla_store::reflect::{Reflector, reflect};
use flotilla_store::{Object, Store, WatchEvent};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::locks::{read, write};
use crate::mailbox::WorkChange;
use crate::registry::Registry;

/// Where a cluster's policy changes go: its live session's mailbox, if it has one here (the
/// registry); a session that opens later syncs from the snapshot.
pub trait Sessions: Send + Sync {
    fn deliver(&self, cluster: &str, change: WorkChange);
}

impl Sessions for Registry {
    fn deliver(&self, cluster: &str, change: WorkChange) {
        Registry::deliver(self, cluster, change);
    }
}

/// A root Policy as delivered, and the clusters it reaches.
#[derive(Clone, Debug, PartialEq)]
struct Placed {
    frame: DesiredWork,
    clusters: BTreeSet<String>,
}

#[derive(Default)]
struct State {
    /// By the root Policy's uid.
    policies: HashMap<String, Placed>,
    /// Cluster → the uids of the policies that reach it.
    by_cluster: HashMap<String, BTreeSet<String>>,
}

impl State {
    fn insert(&mut self, uid: &str, placed: Placed) -> Option<Placed> {
        let old = self.policies.insert(uid.to_owned(), placed.clone());
        if let Some(old) = &old {
            self.unindex(uid, &old.clusters);
        }
        for cluster in &placed.clusters {
            self.by_cluster
                .entry(cluster.clone())
                .or_default()
                .insert(uid.to_owned());
        }
        old
    }

    fn remove(&mut self, uid: &str) -> Option<Placed> {
        let old = self.policies.remove(uid)?;
        self.unindex(uid, &old.clusters);
        Some(old)
    }

    fn unindex(&mut self, uid: &str, clusters: &BTreeSet<String>) {
        for cluster in clusters {
            if let Some(uids) = self.by_cluster.get_mut(cluster) {
                uids.remove(uid);
                if uids.is_empty() {
                    self.by_cluster.remove(cluster);
                }
            }
        }
    }
}

/// The policies each cluster carries; see the module docs.
#[derive(Default)]
pub struct DesiredPolicies {
    state: RwLock<State>,
    /// Set once the first list is loaded: sessions sync only after it.
    ready: watch::Sender<bool>,
}

impl DesiredPolicies {
    pub fn new() -> Arc<DesiredPolicies> {
        Arc::new(DesiredPolicies::default())
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

    /// The policies `cluster` should hold now. Waits for the first list: "not read yet" is not
    /// "none", and a sync from an empty cache would delete every policy the agent holds.
    pub async fn snapshot(&self, cluster: &str) -> Vec<DesiredWork> {
        self.wait_ready().await;
        let state = read(&self.state);
        state
            .by_cluster
            .get(cluster)
            .into_iter()
            .flatten()
            .filter_map(|uid| state.policies.get(uid))
            .map(|p| p.frame.clone())
            .collect()
    }

    /// The root Policy (namespace, name) with this uid if it reaches `cluster` now: only then
    /// is a compliance report of `cluster`'s agent about it written.
    pub async fn reaching(&self, cluster: &str, uid: &str) -> Option<(String, String)> {
        self.wait_ready().await;
        let state = read(&self.state);
        state.by_cluster.get(cluster)?.get(uid)?;
        let frame = &state.policies.get(uid)?.frame;
        Some((frame.namespace.clone(), frame.name.clone()))
    }

    /// How many policies the cache holds; `None` if it is being written at this instant.
    pub fn cached(&self) -> Option<usize> {
        Some(self.state.try_read().ok()?.policies.len())
    }

    /// Keeps the cache in step with the store's Policies until `stop` fires; changes go to
    /// the sessions of the clusters they concern.
    pub async fn run(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        registry: Arc<dyn Sessions>,
        stop: watch::Receiver<bool>,
    ) {
        let target = Reflecting {
            policies: &self,
            registry: registry.as_ref(),
        };
        reflect(Kind::Policy, store.as_ref(), &target, stop).await;
    }

    /// Applies one policy's new state (`None`: gone) and tells the clusters what changed for
    /// them.
    fn change(&self, uid: &str, now: Option<Placed>, registry: &dyn Sessions) {
        let before = {
            let mut state = write(&self.state);
            match &now {
                Some(placed) => state.insert(uid, placed.clone()),
                None => state.remove(uid),
            }
        };
        tell(before.as_ref(), now.as_ref(), registry);
    }
}

/// Tells each cluster's session what changed for it between `before` and `now` of one policy.
fn tell(before: Option<&Placed>, now: Option<&Placed>, registry: &dyn Sessions) {
    let empty = BTreeSet::new();
    let was = before.map_or(&empty, |p| &p.clusters);
    if let Some(now) = now {
        let content_changed = before.is_none_or(|b| {
            b.frame.content_hash != now.frame.content_hash
                || b.frame.generation != now.frame.generation
        });
        for cluster in &now.clusters {
            if content_changed || !was.contains(cluster) {
                registry.deliver(cluster, WorkChange::Upsert(now.frame.clone()));
            }
        }
    }
    if let Some(before) = before {
        let kept = now.map_or(&empty, |p| &p.clusters);
        for cluster in was.difference(kept) {
            registry.deliver(
                cluster,
                WorkChange::Delete {
                    uid: before.frame.uid.clone(),
                    namespace: before.frame.namespace.clone(),
                    name: before.frame.name.clone(),
                },
            );
        }
    }
}

/// The frame that carries a stored root Policy to its clusters' agents (the object without
/// its status and bookkeeping), and the clusters its status says it reaches.
fn placed(mut obj: Object) -> Option<Placed> {
    let clusters: BTreeSet<String> = obj["status"]["status"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|entry| entry["clustername"].as_str())
        .map(str::to_owned)
        .collect();
    if let Some(o) = obj.as_object_mut() {
        o.remove("status");
    }
    if let Some(meta) = obj.get_mut("metadata").and_then(|m| m.as_object_mut()) {
        meta.remove("managedFields");
    }
    let meta = &obj["metadata"];
    let (Some(uid), Some(namespace), Some(name)) = (
        meta["uid"].as_str(),
        meta["namespace"].as_str(),
        meta["name"].as_str(),
    ) else {
        warn!("a stored Policy lacks its uid, namespace or name; not delivered");
        return None;
    };
    let frame = DesiredWork {
        uid: uid.to_owned(),
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        generation: meta["generation"].as_i64().unwrap_or(1),
        content_hash: value_hash(&obj["spec"]),
        manifest_work_json: serde_json::to_vec(&obj).ok()?,
        kind: Delivered::Policy.kind().to_owned(),
    };
    Some(Placed { frame, clusters })
}

fn uid_of(obj: &Object) -> Option<&str> {
    obj["metadata"]["uid"].as_str()
}

/// The cache and the sessions it feeds, as one [`Reflector`].
struct Reflecting<'a> {
    policies: &'a DesiredPolicies,
    registry: &'a dyn Sessions,
}

#[async_trait]
impl Reflector for Reflecting<'_> {
    async fn replace(&self, items: Vec<Object>) {
        let mut fresh = State::default();
        for obj in items {
            if let Some(uid) = uid_of(&obj).map(str::to_owned)
                && let Some(placed) = placed(obj)
            {
                fresh.insert(&uid, placed);
            }
        }
        let loaded_before = *self.policies.ready.borrow();
        let old = std::mem::replace(&mut *write(&self.policies.state), fresh);
        // A relist can hide changes made while the watch was down: deliver them. Before the
        // first load no session has synced, and each syncs from the snapshot.
        if loaded_before {
            let state = read(&self.policies.state);
            for (uid, now) in &state.policies {
                if old.policies.get(uid) != Some(now) {
                    tell(old.policies.get(uid), Some(now), self.registry);
                }
            }
            for (uid, before) in &old.policies {
                if !state.policies.contains_key(uid) {
                    tell(Some(before), None, self.registry);
                }
            }
        }
        let state = read(&self.policies.state);
        info!(
            policies = state.policies.len(),
            clusters = state.by_cluster.len(),
            "policies loaded"
        );
        drop(state);
        self.policies.ready.send_replace(true);
    }

    async fn apply(&self, event: WatchEvent) {
        match event {
            WatchEvent::Added(obj) | WatchEvent::Modified(obj) => {
                let Some(uid) = uid_of(&obj).map(str::to_owned) else {
                    return;
                };
                // A policy that no longer parses as an object reaches no one.
                let now = placed(obj);
                self.policies.change(&uid, now, self.registry);
            }
            WatchEvent::Deleted(obj) => {
                if let Some(uid) = uid_of(&obj) {
                    self.policies.change(uid, None, self.registry);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Each cluster's session is told exactly the policies that reach it, as their reach and
    //! content change.

    use super::*;
    use crate::locks::{SyncMutex, lock};
    use crate::test_support::eventually;
    use flotilla_store::SledStore;
    use serde_json::json;

    fn policy(name: &str, clusters: &[&str]) -> serde_json::Value {
        json!({
            "apiVersion": "policy.open-cluster-management.io/v1", "kind": "Policy",
            "metadata": {"name": name, "namespace": "policies"},
            "spec": {"disabled": false, "remediationAction": "inform", "policy-templates": []},
            "status": {"status": clusters.iter().map(|c| json!({"clustername": c, "clusternamespace": c})).collect::<Vec<_>>()},
        })
    }

    /// What each cluster's session was told, in order.
    #[derive(Default)]
    struct Told(SyncMutex<HashMap<String, Vec<WorkChange>>>);

    impl Sessions for Told {
        fn deliver(&self, cluster: &str, change: WorkChange) {
            lock(&self.0)
                .entry(cluster.to_owned())
                .or_default()
                .push(change);
        }
    }

    impl Told {
        /// What `cluster` was told since the last call: (name, upsert?) per change.
        fn take(&self, cluster: &str) -> Vec<(String, bool)> {
            lock(&self.0)
                .remove(cluster)
                .unwrap_or_default()
                .into_iter()
                .map(|c| match c {
                    WorkChange::Upsert(w) => {
                        assert_eq!(w.kind, "Policy");
                        (w.name, true)
                    }
                    WorkChange::Delete { name, .. } => (name, false),
                })
                .collect()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_policy_reaches_the_clusters_its_status_names_and_leaves_those_it_drops() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        // Created, then placed by the hub's controller (a create stores no status).
        let created = policy("ns-must-exist", &["store-1", "store-2"]);
        store.create(created.clone()).await.unwrap();
        let stored = store
            .update_status(
                Kind::Policy,
                Some("policies"),
                "ns-must-exist",
                created["status"].clone(),
                None,
            )
            .await
            .unwrap();
        let uid = stored["metadata"]["uid"].as_str().unwrap().to_owned();
        let told = Arc::new(Told::default());
        let registry: Arc<dyn Sessions> = told.clone();
        let policies = DesiredPolicies::new();
        let (stop_tx, stop) = watch::channel(false);
        tokio::spawn(policies.clone().run(store.clone(), registry.clone(), stop));

        let snapshot = policies.snapshot("store-1").await;
        assert_eq!(snapshot.len(), 1);
        assert_eq!(snapshot[0].uid, uid);
        assert_eq!(snapshot[0].kind, "Policy");
        let delivered: serde_json::Value =
            serde_json::from_slice(&snapshot[0].manifest_work_json).unwrap();
        assert!(
            delivered.get("status").is_none(),
            "the status stays on the hub"
        );
        assert!(policies.snapshot("store-3").await.is_empty());
        assert_eq!(
            policies.reaching("store-2", &uid).await,
            Some(("policies".to_owned(), "ns-must-exist".to_owned()))
        );
        assert_eq!(policies.reaching("store-3", &uid).await, None);

        // The hub's controller moves the policy from store-2 to store-3.
        let mut moved = stored.clone();
        moved["status"] =
            json!({"status": [{"clustername": "store-1"}, {"clustername": "store-3"}]});
        store
            .update_status(
                Kind::Policy,
                Some("policies"),
                "ns-must-exist",
                moved["status"].clone(),
                None,
            )
            .await
            .unwrap();
        eventually("store-3 is told and store-2 loses it", || async {
            policies.reaching("store-3", &uid).await.is_some()
        })
        .await;
        assert_eq!(
            told.take("store-3"),
            vec![("ns-must-exist".to_owned(), true)]
        );
        assert_eq!(
            told.take("store-2"),
            vec![("ns-must-exist".to_owned(), false)]
        );
        assert!(
            told.take("store-1").is_empty(),
            "a status change alone sends store-1 nothing"
        );

        // A spec change goes to every cluster it reaches; deletion leaves them all.
        let mut current = store
            .get(Kind::Policy, Some("policies"), "ns-must-exist")
            .await
            .unwrap()
            .unwrap();
        current["spec"]["remediationAction"] = json!("enforce");
        store.update_spec(current).await.unwrap();
        eventually("the new spec reaches store-1", || async {
            policies.snapshot("store-1").await[0].content_hash != snapshot[0].content_hash
        })
        .await;
        assert_eq!(
            told.take("store-1"),
            vec![("ns-must-exist".to_owned(), true)]
        );
        assert_eq!(
            told.take("store-3"),
            vec![("ns-must-exist".to_owned(), true)]
        );
        store
            .delete(Kind::Policy, Some("policies"), "ns-must-exist")
            .await
            .unwrap();
        eventually("the policy leaves every cluster", || async {
            policies.snapshot("store-1").await.is_empty()
        })
        .await;
        assert_eq!(
            told.take("store-1"),
            vec![("ns-must-exist".to_owned(), false)]
        );
        assert_eq!(
            told.take("store-3"),
            vec![("ns-must-exist".to_owned(), false)]
        );
        let _ = stop_tx.send(true);
    }
}
