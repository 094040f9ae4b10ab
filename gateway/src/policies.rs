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
//!
//! Hub templates (`{{hub ... hub}}`) are resolved here, per cluster, at delivery: a policy that
//! holds any is rendered for each cluster with that cluster's name, labels and claims (from the
//! gateway's ManagedCluster cache, [`FactSource`]), so each cluster's frame has its own content
//! hash; a template that fails is delivered unrendered with its error annotated, for the
//! agent to report. When a cluster's labels or claims change, the policies whose rendering
//! changes with them are delivered to it again. Only clusters the admission cache knows (those
//! of the shards this gateway holds) are rendered: the others' sessions are elsewhere.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, RwLock};

use async_trait::async_trait;
use flotilla_proto::api::policy::template::{
    self, CLUSTER_CLAIM_API_VERSION, Dialect, Lookup, TemplateData,
};
use flotilla_proto::api::{Kind, value_hash};
use flotilla_proto::session::{Delivered, DesiredWork};
use flotilla_store::reflect::{Reflector, reflect};
use flotilla_store::{Object, Store, WatchEvent};
use serde_json::{Value, json};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::admission::{Admissions, ClusterFacts};
use crate::locks::{SyncMutex, lock, read, write};
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

/// What hub templates read of the clusters: their facts, and a signal when any may have
/// changed.
pub trait FactSource: Send + Sync {
    /// The cluster's labels and claims, if the gateway knows the cluster.
    fn facts(&self, cluster: &str) -> Option<ClusterFacts>;
    /// Changes whenever any cluster's facts may have changed.
    fn changes(&self) -> watch::Receiver<u64>;
}

impl FactSource for Admissions {
    fn facts(&self, cluster: &str) -> Option<ClusterFacts> {
        self.get(cluster).map(|admission| admission.facts)
    }

    fn changes(&self) -> watch::Receiver<u64> {
        Admissions::changes(self)
    }
}

/// A root Policy as delivered, and the clusters it reaches.
#[derive(Clone, Debug, PartialEq)]
struct Placed {
    frame: DesiredWork,
    clusters: BTreeSet<String>,
    /// The policy as delivered (without status) when it holds hub templates: each cluster
    /// gets it rendered with its own facts. `None`: every cluster gets `frame`.
    templated: Option<Arc<Value>>,
}

impl Placed {
    /// What `cluster` is sent: the frame, or the policy rendered with the cluster's facts.
    fn render_for(&self, cluster: &str, facts: &ClusterFacts) -> DesiredWork {
        let Some(policy) = &self.templated else {
            return self.frame.clone();
        };
        let mut policy = Value::clone(policy);
        template::render_hub_templates(&mut policy, &HubFacts::new(cluster, facts));
        DesiredWork {
            content_hash: value_hash(&policy["spec"]),
            manifest_work_json: serde_json::to_vec(&policy).unwrap_or_default(),
            ..self.frame.clone()
        }
    }
}

/// What a cluster's hub templates read: `.ManagedClusterName`, `.ManagedClusterLabels`, and
/// the claims it reported for `fromClusterClaim`.
struct HubFacts<'a> {
    dot: Value,
    facts: &'a ClusterFacts,
}

impl<'a> HubFacts<'a> {
    fn new(cluster: &str, facts: &'a ClusterFacts) -> HubFacts<'a> {
        HubFacts {
            dot: json!({"ManagedClusterName": cluster, "ManagedClusterLabels": facts.labels}),
            facts,
        }
    }
}

impl TemplateData for HubFacts<'_> {
    fn dot(&self) -> &Value {
        &self.dot
    }

    fn read(&self, lookup: &Lookup) -> Option<Result<Value, String>> {
        if lookup.api_version == CLUSTER_CLAIM_API_VERSION && lookup.kind == "ClusterClaim" {
            return Some(Ok(self
                .facts
                .claims
                .get(&lookup.name)
                .map_or(Value::Null, |value| json!({"spec": {"value": value}}))));
        }
        Some(Err(format!(
            "hub templates cannot read {} {}/{} on this hub",
            lookup.kind, lookup.namespace, lookup.name
        )))
    }
}

#[derive(Default)]
struct State {
    /// By the root Policy's uid; shared, since a root placed on 10,000 clusters is not small.
    policies: HashMap<String, Arc<Placed>>,
    /// Cluster → the uids of the policies that reach it.
    by_cluster: HashMap<String, BTreeSet<String>>,
}

impl State {
    /// Stores `placed` as the policy `uid`, indexing only the clusters its reach gained or
    /// lost: a root's status is rewritten as its clusters' verdicts move, its reach seldom.
    fn insert(&mut self, uid: &str, placed: Arc<Placed>) -> Option<Arc<Placed>> {
        let old = self.policies.insert(uid.to_owned(), placed.clone());
        let empty = BTreeSet::new();
        let was = old.as_ref().map_or(&empty, |old| &old.clusters);
        let lost: Vec<&String> = was.difference(&placed.clusters).collect();
        for cluster in lost {
            self.unindex_one(uid, cluster);
        }
        for cluster in placed.clusters.difference(was) {
            self.by_cluster
                .entry(cluster.clone())
                .or_default()
                .insert(uid.to_owned());
        }
        old
    }

    fn remove(&mut self, uid: &str) -> Option<Arc<Placed>> {
        let old = self.policies.remove(uid)?;
        self.unindex(uid, &old.clusters);
        Some(old)
    }

    fn unindex(&mut self, uid: &str, clusters: &BTreeSet<String>) {
        for cluster in clusters {
            self.unindex_one(uid, cluster);
        }
    }

    fn unindex_one(&mut self, uid: &str, cluster: &str) {
        if let Some(uids) = self.by_cluster.get_mut(cluster) {
            uids.remove(uid);
            if uids.is_empty() {
                self.by_cluster.remove(cluster);
            }
        }
    }
}

/// The content hash each cluster was last sent of each templated policy, by (cluster, uid):
/// what a change of the cluster's facts is compared with.
type Sent = HashMap<(String, String), String>;

/// The policies each cluster carries; see the module docs.
pub struct DesiredPolicies {
    state: RwLock<State>,
    /// Set once the first list is loaded: sessions sync only after it.
    ready: watch::Sender<bool>,
    /// The clusters' facts, for hub templates.
    facts: Arc<dyn FactSource>,
    /// Held while a templated policy is rendered and sent (after `state`, never before it),
    /// so that a rendering with older facts is never recorded or sent after one with newer.
    sent: SyncMutex<Sent>,
}

impl DesiredPolicies {
    pub fn new(facts: Arc<dyn FactSource>) -> Arc<DesiredPolicies> {
        Arc::new(DesiredPolicies {
            state: RwLock::default(),
            ready: watch::Sender::new(false),
            facts,
            sent: SyncMutex::default(),
        })
    }

    fn facts_of(&self, cluster: &str) -> ClusterFacts {
        self.facts.facts(cluster).unwrap_or_default()
    }

    /// What `cluster` is sent of `placed` now, recorded in `sent` when templated; with
    /// `facts` given, else with what the admission cache knows. `None`: templated, and the
    /// cluster unknown here (another gateway's, which renders it for its own sessions).
    fn frame_for(
        &self,
        sent: &mut Sent,
        placed: &Placed,
        cluster: &str,
        facts: Option<ClusterFacts>,
    ) -> Option<DesiredWork> {
        if placed.templated.is_none() {
            return Some(placed.frame.clone());
        }
        let facts = facts.or_else(|| self.facts.facts(cluster))?;
        let frame = placed.render_for(cluster, &facts);
        sent.insert(
            (cluster.to_owned(), frame.uid.clone()),
            frame.content_hash.clone(),
        );
        Some(frame)
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
        let mut sent = lock(&self.sent);
        state
            .by_cluster
            .get(cluster)
            .into_iter()
            .flatten()
            .filter_map(|uid| state.policies.get(uid))
            // A session here whose cluster the cache has yet to list (just registered): its
            // facts are followed once listed.
            .filter_map(|p| self.frame_for(&mut sent, p, cluster, Some(self.facts_of(cluster))))
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
        tokio::join!(
            reflect(Kind::Policy, store.as_ref(), &target, stop.clone()),
            self.follow_facts(registry.as_ref(), stop),
        );
    }

    /// Delivers again the templated policies whose rendering for a cluster changes when that
    /// cluster's facts change, until `stop` fires. Each is compared with what the cluster was
    /// last sent of it; one never sent needs nothing (its session's sync renders it).
    async fn follow_facts(&self, registry: &dyn Sessions, mut stop: watch::Receiver<bool>) {
        let mut changes = self.facts.changes();
        // The facts each cluster was last looked at with: only a change is worth rendering.
        let mut seen: HashMap<String, ClusterFacts> = HashMap::new();
        loop {
            {
                let state = read(&self.state);
                let mut sent = lock(&self.sent);
                sent.retain(|(cluster, uid), _| {
                    state
                        .by_cluster
                        .get(cluster)
                        .is_some_and(|uids| uids.contains(uid))
                });
                seen.retain(|cluster, _| state.by_cluster.contains_key(cluster));
                // Only the clusters a templated policy reaches: most fleets have few such
                // policies or none, and a pass over every cluster's every policy at 10,000
                // clusters is a million lookups.
                let mut by_cluster: BTreeMap<&str, Vec<&Placed>> = BTreeMap::new();
                for placed in state.policies.values().filter(|p| p.templated.is_some()) {
                    for cluster in &placed.clusters {
                        by_cluster.entry(cluster).or_default().push(placed);
                    }
                }
                for (cluster, templated) in by_cluster {
                    let Some(now) = self.facts.facts(cluster) else {
                        continue;
                    };
                    if seen.get(cluster) == Some(&now) {
                        continue;
                    }
                    seen.insert(cluster.to_owned(), now.clone());
                    for placed in templated {
                        let key = (cluster.to_owned(), placed.frame.uid.clone());
                        let Some(before) = sent.get(&key) else {
                            continue;
                        };
                        let frame = placed.render_for(cluster, &now);
                        if *before != frame.content_hash {
                            sent.insert(key, frame.content_hash.clone());
                            registry.deliver(cluster, WorkChange::Upsert(frame));
                        }
                    }
                }
            }
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return },
                changed = stop.changed() => if changed.is_err() { return },
            }
            if *stop.borrow() {
                return;
            }
        }
    }

    /// Applies one policy's new state (`None`: gone) and tells the clusters what changed for
    /// them.
    fn change(&self, uid: &str, now: Option<Placed>, registry: &dyn Sessions) {
        let now = now.map(Arc::new);
        let before = {
            let mut state = write(&self.state);
            // Most of a root's writes are its clusters' verdicts: neither its content nor its
            // reach moved, and no session has anything to hear.
            if state.policies.get(uid) == now.as_ref() {
                return;
            }
            match &now {
                Some(placed) => state.insert(uid, placed.clone()),
                None => state.remove(uid),
            }
        };
        self.tell(before.as_deref(), now.as_deref(), registry);
    }

    /// Tells each cluster's session what changed for it between `before` and `now` of one
    /// policy.
    fn tell(&self, before: Option<&Placed>, now: Option<&Placed>, registry: &dyn Sessions) {
        let mut sent = lock(&self.sent);
        let empty = BTreeSet::new();
        let was = before.map_or(&empty, |p| &p.clusters);
        if let Some(now) = now {
            let content_changed = before.is_none_or(|b| {
                b.frame.content_hash != now.frame.content_hash
                    || b.frame.generation != now.frame.generation
            });
            for cluster in &now.clusters {
                if (content_changed || !was.contains(cluster))
                    && let Some(frame) = self.frame_for(&mut sent, now, cluster, None)
                {
                    registry.deliver(cluster, WorkChange::Upsert(frame));
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
    let hub = Dialect::Hub {
        policy_namespace: namespace.to_owned(),
    };
    let templated = template::has_templates(&obj["spec"]["policy-templates"], &hub);
    let frame = DesiredWork {
        uid: uid.to_owned(),
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        generation: meta["generation"].as_i64().unwrap_or(1),
        content_hash: value_hash(&obj["spec"]),
        manifest_work_json: serde_json::to_vec(&obj).ok()?,
        kind: Delivered::Policy.kind().to_owned(),
    };
    Some(Placed {
        frame,
        clusters,
        templated: templated.then(|| Arc::new(obj)),
    })
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
                fresh.insert(&uid, Arc::new(placed));
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
                    self.policies.tell(
                        old.policies.get(uid).map(|p| &**p),
                        Some(now),
                        self.registry,
                    );
                }
            }
            for (uid, before) in &old.policies {
                if !state.policies.contains_key(uid) {
                    self.policies.tell(Some(before), None, self.registry);
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
    use crate::test_support::eventually;
    use flotilla_proto::api::policy::ANNOTATION_HUB_TEMPLATES_ERROR;
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

    /// Clusters' facts a test sets.
    #[derive(Default)]
    struct Facts {
        clusters: SyncMutex<HashMap<String, ClusterFacts>>,
        changes: watch::Sender<u64>,
    }

    impl FactSource for Facts {
        fn facts(&self, cluster: &str) -> Option<ClusterFacts> {
            lock(&self.clusters).get(cluster).cloned()
        }

        fn changes(&self) -> watch::Receiver<u64> {
            self.changes.subscribe()
        }
    }

    impl Facts {
        fn set(&self, cluster: &str, labels: &[(&str, &str)], claims: &[(&str, &str)]) {
            let owned = |pairs: &[(&str, &str)]| {
                pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect()
            };
            lock(&self.clusters).insert(
                cluster.to_owned(),
                ClusterFacts {
                    labels: owned(labels),
                    claims: owned(claims),
                },
            );
            self.changes.send_modify(|n| *n += 1);
        }
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
        let policies = DesiredPolicies::new(Arc::new(Facts::default()));
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

    /// The data of the ConfigMap the first object-template of template `index` enforces, as
    /// `cluster` is sent it, and that template's hub error, if any.
    async fn sent(
        policies: &DesiredPolicies,
        cluster: &str,
        index: usize,
    ) -> (serde_json::Value, Option<String>) {
        let snapshot = policies.snapshot(cluster).await;
        let policy: serde_json::Value =
            serde_json::from_slice(&snapshot[0].manifest_work_json).unwrap();
        let definition = &policy["spec"]["policy-templates"][index]["objectDefinition"];
        (
            definition["spec"]["object-templates"][0]["objectDefinition"]["data"].clone(),
            definition["metadata"]["annotations"][ANNOTATION_HUB_TEMPLATES_ERROR]
                .as_str()
                .map(str::to_owned),
        )
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hub_templates_are_rendered_per_cluster_and_follow_its_labels() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        let configuration = |name: &str, data: serde_json::Value| {
            json!({"objectDefinition": {
                "apiVersion": "policy.open-cluster-management.io/v1",
                "kind": "ConfigurationPolicy", "metadata": {"name": name},
                "spec": {"remediationAction": "enforce", "object-templates": [{
                    "complianceType": "musthave", "objectDefinition": {
                        "apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": "facts", "namespace": "default"},
                        "data": data}}]}}})
        };
        let mut created = policy("cluster-facts", &["store-1", "store-2"]);
        created["spec"]["policy-templates"] = json!([
            configuration(
                "facts",
                json!({
                "cluster": "{{hub .ManagedClusterName hub}}",
                "env": "{{hub index .ManagedClusterLabels \"env\" hub}}",
                "spoke": "{{ (lookup \"v1\" \"ConfigMap\" \"default\" \"source\").data.color }}"})
            ),
            configuration(
                "version",
                json!({
                "version": "{{hub fromClusterClaim \"kubeversion.open-cluster-management.io\" hub}}"})
            ),
        ]);
        store.create(created.clone()).await.unwrap();
        store
            .update_status(
                Kind::Policy,
                Some("policies"),
                "cluster-facts",
                created["status"].clone(),
                None,
            )
            .await
            .unwrap();
        let facts = Arc::new(Facts::default());
        facts.set(
            "store-1",
            &[("env", "dev")],
            &[("kubeversion.open-cluster-management.io", "v1.36.3")],
        );
        facts.set("store-2", &[("env", "prod")], &[]);
        let told = Arc::new(Told::default());
        let registry: Arc<dyn Sessions> = told.clone();
        let policies = DesiredPolicies::new(facts.clone());
        let (stop_tx, stop) = watch::channel(false);
        tokio::spawn(policies.clone().run(store.clone(), registry.clone(), stop));

        assert_eq!(
            sent(&policies, "store-1", 0).await,
            (
                json!({"cluster": "store-1", "env": "dev",
                    "spoke": "{{ (lookup \"v1\" \"ConfigMap\" \"default\" \"source\").data.color }}"}),
                None
            ),
            "the cluster's own templates are left for its agent"
        );
        assert_eq!(
            sent(&policies, "store-1", 1).await,
            (json!({"version": "v1.36.3"}), None)
        );
        assert_eq!(sent(&policies, "store-2", 0).await.0["env"], "prod");
        assert_eq!(
            sent(&policies, "store-2", 1).await,
            (
                json!({"version": "{{hub fromClusterClaim \"kubeversion.open-cluster-management.io\" hub}}"}),
                Some("failed to resolve the template {{hub fromClusterClaim \"kubeversion.open-cluster-management.io\" hub}} at spec.policy-templates[1].objectDefinition.spec.object-templates[0].objectDefinition.data.version: fromClusterClaim: clusterclaims \"kubeversion.open-cluster-management.io\" not found".to_owned())
            ),
            "a template that fails travels as written, with its error"
        );
        let hashes: BTreeSet<String> = [
            policies.snapshot("store-1").await,
            policies.snapshot("store-2").await,
        ]
        .iter()
        .map(|s| s[0].content_hash.clone())
        .collect();
        assert_eq!(hashes.len(), 2, "each cluster's frame has its own content");

        // A label no template reads changes nothing; one a template reads re-delivers.
        facts.set("store-2", &[("env", "prod"), ("zone", "b")], &[]);
        facts.set(
            "store-1",
            &[("env", "staging")],
            &[("kubeversion.open-cluster-management.io", "v1.36.3")],
        );
        eventually("store-1 is sent the policy rendered anew", || async {
            !told.take("store-1").is_empty()
        })
        .await;
        assert_eq!(sent(&policies, "store-1", 0).await.0["env"], "staging");
        assert!(
            told.take("store-2").is_empty(),
            "store-2's rendering did not change"
        );
        let _ = stop_tx.send(true);
    }
}
