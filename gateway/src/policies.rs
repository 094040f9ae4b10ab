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
//!
//! `fromConfigMap` reads the hub's ConfigMaps of the policy's namespace, from a cache that
//! follows exactly the namespaces whose cached policies call it ([`crate::hub_config_maps`]).
//! A policy is never rendered from a namespace that has not been listed yet: a session's sync
//! waits for the list, and a delivery skipped meanwhile is made once it arrives. Each
//! rendering records which ConfigMaps it read; when one is created, edited or deleted, the
//! policies that read it are rendered again for each cluster and sent where the content hash
//! differs from what the cluster was last sent.

use std::cell::RefCell;
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
use tracing::{debug, info, warn};

use crate::admission::{Admissions, ClusterFacts};
use crate::hub_config_maps::{self, Changed, ConfigMapReaders, HubConfigMaps, View};
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
    /// Whether its hub templates call `fromConfigMap`: its namespace's ConfigMaps are followed
    /// while it is cached, and it is rendered only once they are listed.
    reads_config_maps: bool,
}

impl Placed {
    /// What `cluster` is sent: the frame, or the policy rendered with the cluster's facts and
    /// its namespace's ConfigMaps; and which ConfigMaps the rendering read.
    fn render_for(
        &self,
        cluster: &str,
        facts: &ClusterFacts,
        config_maps: Option<View>,
    ) -> (DesiredWork, BTreeSet<String>) {
        let Some(policy) = &self.templated else {
            return (self.frame.clone(), BTreeSet::new());
        };
        let mut policy = Value::clone(policy);
        let data = HubFacts::new(cluster, facts, &self.frame.namespace, config_maps);
        template::render_hub_templates(&mut policy, &data);
        let frame = DesiredWork {
            content_hash: value_hash(&policy["spec"]),
            manifest_work_json: serde_json::to_vec(&policy).unwrap_or_default(),
            ..self.frame.clone()
        };
        (frame, data.read.into_inner())
    }
}

/// What a cluster's hub templates read: `.ManagedClusterName`, `.ManagedClusterLabels`, the
/// claims it reported for `fromClusterClaim`, and the policy's namespace's ConfigMaps for
/// `fromConfigMap`.
struct HubFacts<'a> {
    dot: Value,
    facts: &'a ClusterFacts,
    /// The policy's namespace: the only one whose ConfigMaps its templates read.
    namespace: &'a str,
    /// That namespace's ConfigMaps, when the policy's templates call `fromConfigMap`.
    config_maps: Option<View>,
    /// The ConfigMaps read, found or not: a change to any of them renders the policy again.
    read: RefCell<BTreeSet<String>>,
}

impl<'a> HubFacts<'a> {
    fn new(
        cluster: &str,
        facts: &'a ClusterFacts,
        namespace: &'a str,
        config_maps: Option<View>,
    ) -> HubFacts<'a> {
        HubFacts {
            dot: json!({"ManagedClusterName": cluster, "ManagedClusterLabels": facts.labels}),
            facts,
            namespace,
            config_maps,
            read: RefCell::default(),
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
        // The template engine has already refused another namespace than the policy's.
        if lookup.api_version == "v1"
            && lookup.kind == "ConfigMap"
            && lookup.namespace == self.namespace
            && let Some(view) = &self.config_maps
        {
            self.read.borrow_mut().insert(lookup.name.clone());
            return Some(view.read(&lookup.name));
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
    /// Namespace → how many of its policies call `fromConfigMap`: the namespaces whose
    /// ConfigMaps are followed.
    config_map_readers: HashMap<String, usize>,
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
        if let Some(old) = &old {
            self.uncount_reader(old);
        }
        if placed.reads_config_maps {
            *self
                .config_map_readers
                .entry(placed.frame.namespace.clone())
                .or_default() += 1;
        }
        old
    }

    fn remove(&mut self, uid: &str) -> Option<Arc<Placed>> {
        let old = self.policies.remove(uid)?;
        self.unindex(uid, &old);
        Some(old)
    }

    fn unindex(&mut self, uid: &str, placed: &Placed) {
        for cluster in &placed.clusters {
            self.unindex_one(uid, cluster);
        }
        self.uncount_reader(placed);
    }

    fn unindex_one(&mut self, uid: &str, cluster: &str) {
        if let Some(uids) = self.by_cluster.get_mut(cluster) {
            uids.remove(uid);
            if uids.is_empty() {
                self.by_cluster.remove(cluster);
            }
        }
    }

    /// One policy of `placed`'s namespace fewer reads its ConfigMaps, if it did.
    fn uncount_reader(&mut self, placed: &Placed) {
        if placed.reads_config_maps
            && let Some(readers) = self.config_map_readers.get_mut(&placed.frame.namespace)
        {
            *readers -= 1;
            if *readers == 0 {
                self.config_map_readers.remove(&placed.frame.namespace);
            }
        }
    }

    /// The namespaces whose ConfigMaps some cached policy reads.
    fn config_map_namespaces(&self) -> BTreeSet<String> {
        self.config_map_readers.keys().cloned().collect()
    }
}

/// What a cluster was last sent of one templated policy.
#[derive(Clone, Debug)]
struct SentFrame {
    /// Its content hash: what a new rendering is compared with.
    hash: String,
    /// The ConfigMaps (of the policy's namespace) that rendering read: a change to one of them
    /// renders it again.
    config_maps: BTreeSet<String>,
}

/// What each cluster was last sent of each templated policy, by (cluster, uid).
type Sent = HashMap<(String, String), SentFrame>;

/// The policies each cluster carries; see the module docs.
pub struct DesiredPolicies {
    state: RwLock<State>,
    /// Set once the first list is loaded: sessions sync only after it.
    ready: watch::Sender<bool>,
    /// The clusters' facts, for hub templates.
    facts: Arc<dyn FactSource>,
    /// Held while a templated policy is rendered and sent (after `state`, never before it),
    /// so that a rendering with older facts or ConfigMaps is never recorded or sent after one
    /// with newer: both are read under it.
    sent: SyncMutex<Sent>,
    /// The hub's ConfigMaps of the namespaces whose policies read them (locked after `sent`).
    config_maps: Arc<HubConfigMaps>,
}

impl DesiredPolicies {
    pub fn new(facts: Arc<dyn FactSource>) -> Arc<DesiredPolicies> {
        Arc::new(DesiredPolicies {
            state: RwLock::default(),
            ready: watch::Sender::new(false),
            facts,
            sent: SyncMutex::default(),
            config_maps: Arc::default(),
        })
    }

    fn facts_of(&self, cluster: &str) -> ClusterFacts {
        self.facts.facts(cluster).unwrap_or_default()
    }

    /// What `cluster` is sent of `placed` now, recorded in `sent` when templated; with
    /// `facts` given, else with what the admission cache knows. `None`: templated, and either
    /// the cluster is unknown here (another gateway's, which renders it for its own sessions)
    /// or the policy reads ConfigMaps of a namespace not listed yet (rendered once it is).
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
        let config_maps = if placed.reads_config_maps {
            Some(self.config_maps.view(&placed.frame.namespace)?)
        } else {
            None
        };
        let facts = facts.or_else(|| self.facts.facts(cluster))?;
        let (frame, read) = placed.render_for(cluster, &facts, config_maps);
        sent.insert(
            (cluster.to_owned(), frame.uid.clone()),
            SentFrame {
                hash: frame.content_hash.clone(),
                config_maps: read,
            },
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
    /// "none", and a sync from an empty cache would delete every policy the agent holds. Waits
    /// likewise for the ConfigMaps of the namespaces its policies read: a policy rendered
    /// before they are listed would carry a false "not found".
    pub async fn snapshot(&self, cluster: &str) -> Vec<DesiredWork> {
        self.wait_ready().await;
        let mut listed = self.config_maps.changes();
        loop {
            listed.borrow_and_update();
            let waiting_for = {
                let state = read(&self.state);
                let mut sent = lock(&self.sent);
                // A session here whose cluster the cache has yet to list (just registered): its
                // facts are followed once listed.
                let facts = self.facts_of(cluster);
                let mut frames = Vec::new();
                let mut waiting_for = None;
                for placed in state
                    .by_cluster
                    .get(cluster)
                    .into_iter()
                    .flatten()
                    .filter_map(|uid| state.policies.get(uid))
                {
                    match self.frame_for(&mut sent, placed, cluster, Some(facts.clone())) {
                        Some(frame) => frames.push(frame),
                        None => {
                            waiting_for = Some(placed.frame.namespace.clone());
                            break;
                        }
                    }
                }
                match waiting_for {
                    None => return frames,
                    Some(namespace) => namespace,
                }
            };
            debug!(
                cluster,
                namespace = %waiting_for,
                "the session's sync waits for the namespace's ConfigMaps to be listed"
            );
            if listed.changed().await.is_err() {
                return Vec::new();
            }
        }
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
        let readers: Arc<dyn ConfigMapReaders> = Arc::new(Rerender {
            policies: self.clone(),
            registry: registry.clone(),
        });
        tokio::join!(
            reflect(Kind::Policy, store.as_ref(), &target, stop.clone()),
            self.follow_facts(registry.as_ref(), stop.clone()),
            hub_config_maps::follow(self.config_maps.clone(), store.clone(), readers, stop),
        );
    }

    /// Renders again, for each cluster they reach, the policies of `namespace` that a change
    /// of its ConfigMaps may concern, and sends each cluster what differs from what it was last
    /// sent. After a list that is every such policy, sent before or not (a delivery skipped
    /// while the namespace loaded is made here); after one ConfigMap's change, only the
    /// renderings that read it.
    fn refresh(&self, namespace: &str, what: &Changed, registry: &dyn Sessions) {
        let state = read(&self.state);
        let mut sent = lock(&self.sent);
        let mut delivered = 0usize;
        for placed in state
            .policies
            .values()
            .filter(|p| p.reads_config_maps && p.frame.namespace == namespace)
        {
            for cluster in &placed.clusters {
                let key = (cluster.clone(), placed.frame.uid.clone());
                let before = sent.get(&key);
                if let Changed::One(name) = what
                    && !before.is_some_and(|b| b.config_maps.contains(name))
                {
                    continue;
                }
                let before = before.map(|b| b.hash.clone());
                let Some(frame) = self.frame_for(&mut sent, placed, cluster, None) else {
                    continue;
                };
                if before.as_ref() != Some(&frame.content_hash) {
                    delivered += 1;
                    registry.deliver(cluster, WorkChange::Upsert(frame));
                }
            }
        }
        if delivered > 0 {
            debug!(
                namespace,
                ?what,
                delivered,
                "policies rendered anew from the hub's ConfigMaps"
            );
        }
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
                        let Some(before) = sent.get(&key).map(|s| s.hash.clone()) else {
                            continue;
                        };
                        // None: its namespace's ConfigMaps are being listed, and the list
                        // renders it with the facts of then.
                        let Some(frame) =
                            self.frame_for(&mut sent, placed, cluster, Some(now.clone()))
                        else {
                            continue;
                        };
                        if before != frame.content_hash {
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
        let (before, namespaces) = {
            let mut state = write(&self.state);
            // Most of a root's writes are its clusters' verdicts: neither its content nor its
            // reach moved, and no session has anything to hear.
            if state.policies.get(uid) == now.as_ref() {
                return;
            }
            let before = match &now {
                Some(placed) => state.insert(uid, placed.clone()),
                None => state.remove(uid),
            };
            (before, state.config_map_namespaces())
        };
        // Before telling: a policy whose namespace starts loading here is not rendered until
        // the namespace is listed, and then it is.
        self.config_maps.want(&namespaces);
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
    let reads_config_maps =
        !template::uses(&obj["spec"]["policy-templates"], &hub, "fromConfigMap").is_empty();
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
        reads_config_maps,
    })
}

/// The policies told of their namespaces' ConfigMap changes.
struct Rerender {
    policies: Arc<DesiredPolicies>,
    registry: Arc<dyn Sessions>,
}

impl ConfigMapReaders for Rerender {
    fn changed(&self, namespace: &str, what: &Changed) {
        self.policies
            .refresh(namespace, what, self.registry.as_ref());
    }
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
        let namespaces = fresh.config_map_namespaces();
        let old = std::mem::replace(&mut *write(&self.policies.state), fresh);
        self.policies.config_maps.want(&namespaces);
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
        /// Whether each of `clusters` was told something since it was last taken.
        fn any(&self, clusters: &[&str]) -> bool {
            let told = lock(&self.0);
            clusters
                .iter()
                .all(|c| told.get(*c).is_some_and(|changes| !changes.is_empty()))
        }

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
        // The cache changes before the sessions are told: wait for both.
        eventually("store-3 is told and store-2 loses it", || async {
            policies.reaching("store-3", &uid).await.is_some() && told.any(&["store-2", "store-3"])
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
                && told.any(&["store-1", "store-3"])
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
            policies.snapshot("store-1").await.is_empty() && told.any(&["store-1", "store-3"])
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

    /// A sled store whose ConfigMap lists say which namespace they read, and wait until the
    /// test opens that namespace: how a slow first list of a namespace is played.
    struct GatedLists {
        inner: SledStore,
        /// The namespace of each ConfigMap list asked for, in order.
        lists: SyncMutex<Vec<String>>,
        /// The namespaces whose ConfigMap lists are answered.
        open: watch::Sender<BTreeSet<String>>,
    }

    impl GatedLists {
        fn new(inner: SledStore, open: &[&str]) -> GatedLists {
            GatedLists {
                inner,
                lists: SyncMutex::default(),
                open: watch::Sender::new(open.iter().map(|n| n.to_string()).collect()),
            }
        }

        fn listed(&self) -> Vec<String> {
            lock(&self.lists).clone()
        }

        fn open(&self, namespace: &str) {
            self.open.send_modify(|open| {
                open.insert(namespace.to_owned());
            });
        }
    }

    #[async_trait]
    impl Store for GatedLists {
        async fn get(
            &self,
            kind: Kind,
            namespace: Option<&str>,
            name: &str,
        ) -> Result<Option<Object>, flotilla_store::StoreError> {
            self.inner.get(kind, namespace, name).await
        }
        async fn list(
            &self,
            kind: Kind,
            namespace: Option<&str>,
        ) -> Result<flotilla_store::ObjectList, flotilla_store::StoreError> {
            if kind == Kind::ConfigMap {
                let namespace = namespace.unwrap_or_default().to_owned();
                lock(&self.lists).push(namespace.clone());
                let mut open = self.open.subscribe();
                let _ = open.wait_for(|open| open.contains(&namespace)).await;
            }
            self.inner.list(kind, namespace).await
        }
        async fn watch(
            &self,
            kind: Kind,
            namespace: Option<&str>,
            from: Option<flotilla_store::Revision>,
        ) -> Result<flotilla_store::WatchStream, flotilla_store::StoreError> {
            self.inner.watch(kind, namespace, from).await
        }
        async fn list_selected(
            &self,
            kind: Kind,
            selection: &flotilla_store::Selection,
        ) -> Result<flotilla_store::ObjectList, flotilla_store::StoreError> {
            self.inner.list_selected(kind, selection).await
        }
        async fn watch_selected(
            &self,
            kind: Kind,
            selection: &flotilla_store::Selection,
            from: Option<flotilla_store::Revision>,
        ) -> Result<flotilla_store::WatchStream, flotilla_store::StoreError> {
            self.inner.watch_selected(kind, selection, from).await
        }
        async fn create(&self, object: Object) -> Result<Object, flotilla_store::StoreError> {
            self.inner.create(object).await
        }
        async fn update_spec(&self, object: Object) -> Result<Object, flotilla_store::StoreError> {
            self.inner.update_spec(object).await
        }
        async fn update_status(
            &self,
            kind: Kind,
            namespace: Option<&str>,
            name: &str,
            status: Value,
            expected: Option<&flotilla_store::Revision>,
        ) -> Result<Object, flotilla_store::StoreError> {
            self.inner
                .update_status(kind, namespace, name, status, expected)
                .await
        }
        async fn update_status_fenced(
            &self,
            kind: Kind,
            namespace: Option<&str>,
            name: &str,
            status: Value,
            fence: &flotilla_store::WriteFence,
            basis: Option<&flotilla_store::Basis>,
        ) -> Result<Object, flotilla_store::StoreError> {
            self.inner
                .update_status_fenced(kind, namespace, name, status, fence, basis)
                .await
        }
        async fn update_spec_fenced(
            &self,
            object: Object,
            fence: &flotilla_store::WriteFence,
        ) -> Result<Object, flotilla_store::StoreError> {
            self.inner.update_spec_fenced(object, fence).await
        }
        async fn delete(
            &self,
            kind: Kind,
            namespace: Option<&str>,
            name: &str,
        ) -> Result<(), flotilla_store::StoreError> {
            self.inner.delete(kind, namespace, name).await
        }
        async fn ensure_namespace(&self, name: &str) -> Result<(), flotilla_store::StoreError> {
            self.inner.ensure_namespace(name).await
        }
    }

    /// A Policy in `namespace` placed on `clusters` whose templates make ConfigMap data from
    /// `data`, one template per entry.
    async fn create_templated(
        store: &dyn Store,
        namespace: &str,
        name: &str,
        clusters: &[&str],
        data: &[serde_json::Value],
    ) -> String {
        let mut created = policy(name, clusters);
        created["metadata"]["namespace"] = json!(namespace);
        created["spec"]["policy-templates"] = data
            .iter()
            .enumerate()
            .map(|(i, data)| {
                json!({"objectDefinition": {
                    "apiVersion": "policy.open-cluster-management.io/v1",
                    "kind": "ConfigurationPolicy", "metadata": {"name": format!("{name}-{i}")},
                    "spec": {"remediationAction": "enforce", "object-templates": [{
                        "complianceType": "musthave", "objectDefinition": {
                            "apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": {"name": name, "namespace": "default"},
                            "data": data}}]}}})
            })
            .collect();
        store.create(created.clone()).await.unwrap();
        let stored = store
            .update_status(
                Kind::Policy,
                Some(namespace),
                name,
                created["status"].clone(),
                None,
            )
            .await
            .unwrap();
        stored["metadata"]["uid"].as_str().unwrap().to_owned()
    }

    fn hub_config_map(namespace: &str, name: &str, data: serde_json::Value) -> Object {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": name, "namespace": namespace}, "data": data})
    }

    /// Replaces ConfigMap `namespace/name`'s data, as `flotilla apply` of an edited one does.
    async fn edit_config_map(
        store: &dyn Store,
        namespace: &str,
        name: &str,
        data: serde_json::Value,
    ) {
        let mut current = store
            .get(Kind::ConfigMap, Some(namespace), name)
            .await
            .unwrap()
            .unwrap();
        current["data"] = data;
        store.update_spec(current).await.unwrap();
    }

    impl Told {
        /// The frames `cluster` was sent since the last call (upserts only).
        fn frames(&self, cluster: &str) -> Vec<DesiredWork> {
            lock(&self.0)
                .remove(cluster)
                .unwrap_or_default()
                .into_iter()
                .filter_map(|c| match c {
                    WorkChange::Upsert(w) => Some(w),
                    WorkChange::Delete { .. } => None,
                })
                .collect()
        }
    }

    /// The data template `index` of a delivered frame makes, and its hub error, if any.
    fn rendered(frame: &DesiredWork, index: usize) -> (serde_json::Value, Option<String>) {
        let policy: serde_json::Value = serde_json::from_slice(&frame.manifest_work_json).unwrap();
        let definition = &policy["spec"]["policy-templates"][index]["objectDefinition"];
        (
            definition["spec"]["object-templates"][0]["objectDefinition"]["data"].clone(),
            definition["metadata"]["annotations"][ANNOTATION_HUB_TEMPLATES_ERROR]
                .as_str()
                .map(str::to_owned),
        )
    }

    const TIER: &str = "{{hub fromConfigMap \"\" \"settings\" \"tier\" hub}}";
    const COLOR: &str = "{{hub fromConfigMap \"\" \"settings\" \"color\" hub}}";

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hub_config_maps_are_rendered_per_cluster_and_followed_as_they_change() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        store
            .create(hub_config_map(
                "policies",
                "settings",
                json!({"tier": "gold"}),
            ))
            .await
            .unwrap();
        let uid = create_templated(
            store.as_ref(),
            "policies",
            "tiered",
            &["store-1", "store-2"],
            &[
                json!({"tier": TIER, "cluster": "{{hub .ManagedClusterName hub}}"}),
                json!({"color": COLOR}),
            ],
        )
        .await;
        let facts = Arc::new(Facts::default());
        facts.set("store-1", &[], &[]);
        facts.set("store-2", &[], &[]);
        let told = Arc::new(Told::default());
        let registry: Arc<dyn Sessions> = told.clone();
        let policies = DesiredPolicies::new(facts.clone());
        let (stop_tx, stop) = watch::channel(false);
        tokio::spawn(policies.clone().run(store.clone(), registry, stop));

        let first = policies.snapshot("store-1").await;
        assert_eq!(
            rendered(&first[0], 0),
            (json!({"tier": "gold", "cluster": "store-1"}), None),
            "the hub's ConfigMap, read for the cluster"
        );
        assert_eq!(
            rendered(&first[0], 1),
            (
                json!({"color": COLOR}),
                Some(format!(
                    "failed to resolve the template {COLOR} at spec.policy-templates[1].objectDefinition.spec.object-templates[0].objectDefinition.data.color: fromConfigMap: ConfigMap policies/settings has no key \"color\""
                ))
            ),
            "a missing key travels as OCM's hub-templates-error, for the agent to report"
        );
        let second = policies.snapshot("store-2").await;
        assert_eq!(
            policies
                .config_maps
                .followed()
                .into_keys()
                .collect::<Vec<_>>(),
            ["policies"]
        );

        // Edited: each cluster is sent the policy rendered anew, with a new content hash.
        edit_config_map(
            store.as_ref(),
            "policies",
            "settings",
            json!({"tier": "silver", "color": "red"}),
        )
        .await;
        // (The first list may also have sent each cluster the policy as it synced it.)
        for (cluster, synced) in [("store-1", &first[0]), ("store-2", &second[0])] {
            eventually(&format!("{cluster} is sent the edited tier"), || async {
                told.frames(cluster).iter().any(|f| {
                    f.uid == uid
                        && f.content_hash != synced.content_hash
                        && rendered(f, 0).0["tier"] == "silver"
                        && rendered(f, 1) == (json!({"color": "red"}), None)
                })
            })
            .await;
        }
        // Deleted: reported missing, as a template of a missing ConfigMap is.
        store
            .delete(Kind::ConfigMap, Some("policies"), "settings")
            .await
            .unwrap();
        eventually("store-1 is sent the error", || async {
            told.frames("store-1").iter().any(|f| {
                rendered(f, 0).1.is_some_and(|e| {
                    e.ends_with(
                        "fromConfigMap: configmaps \"settings\" not found in namespace policies",
                    )
                })
            })
        })
        .await;
        // Created again: delivered again.
        store
            .create(hub_config_map(
                "policies",
                "settings",
                json!({"tier": "bronze", "color": "blue"}),
            ))
            .await
            .unwrap();
        eventually("store-2 is sent the new ConfigMap's tier", || async {
            told.frames("store-2")
                .iter()
                .any(|f| rendered(f, 0) == (json!({"tier": "bronze", "cluster": "store-2"}), None))
        })
        .await;
        let _ = stop_tx.send(true);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_namespace_is_followed_only_while_a_policy_reads_it_and_never_read_before_listed() {
        let dir = tempfile::tempdir().unwrap();
        let gated = Arc::new(GatedLists::new(SledStore::open(dir.path()).unwrap(), &[]));
        let store: Arc<dyn Store> = gated.clone();
        for namespace in ["policies", "tiers", "kube-system"] {
            store
                .create(hub_config_map(
                    namespace,
                    "settings",
                    json!({"tier": namespace}),
                ))
                .await
                .unwrap();
        }
        // A policy that reads no ConfigMap: nothing is followed for it.
        create_templated(
            store.as_ref(),
            "kube-system",
            "plain",
            &["store-1"],
            &[json!({"cluster": "{{hub .ManagedClusterName hub}}"})],
        )
        .await;
        create_templated(
            store.as_ref(),
            "policies",
            "tiered",
            &["store-1"],
            &[json!({"tier": TIER})],
        )
        .await;
        let facts = Arc::new(Facts::default());
        facts.set("store-1", &[], &[]);
        let told = Arc::new(Told::default());
        let registry: Arc<dyn Sessions> = told.clone();
        let policies = DesiredPolicies::new(facts.clone());
        let (stop_tx, stop) = watch::channel(false);
        tokio::spawn(policies.clone().run(store.clone(), registry, stop));

        // The sync waits for the namespace's list: nothing rendered from a cache not read yet.
        let sync = tokio::spawn({
            let policies = policies.clone();
            async move { policies.snapshot("store-1").await }
        });
        eventually("the namespace's ConfigMaps are asked for", || async {
            gated.listed() == ["policies"]
        })
        .await;
        assert!(!sync.is_finished(), "the sync did not wait for the list");
        gated.open("policies");
        let synced = sync.await.unwrap();
        let tiered = synced.iter().find(|f| f.name == "tiered").unwrap();
        assert_eq!(rendered(tiered, 0), (json!({"tier": "policies"}), None));

        // A policy in a new namespace, the cluster's session live: nothing sent until the
        // namespace is listed, then the rendering.
        create_templated(
            store.as_ref(),
            "tiers",
            "tiers",
            &["store-1"],
            &[json!({"tier": TIER})],
        )
        .await;
        eventually("the new namespace's ConfigMaps are asked for", || async {
            gated.listed() == ["policies", "tiers"]
        })
        .await;
        assert!(
            !told.frames("store-1").iter().any(|f| f.name == "tiers"),
            "sent before its namespace was listed"
        );
        gated.open("tiers");
        eventually(
            "the policy is sent once its namespace is listed",
            || async {
                told.frames("store-1").iter().any(|f| {
                    f.name == "tiers" && rendered(f, 0) == (json!({"tier": "tiers"}), None)
                })
            },
        )
        .await;
        assert_eq!(
            policies
                .config_maps
                .followed()
                .into_keys()
                .collect::<BTreeSet<_>>(),
            BTreeSet::from(["policies".to_owned(), "tiers".to_owned()]),
            "kube-system's ConfigMaps are read by no template"
        );

        // The last policy of a namespace gone: its ConfigMaps are no longer followed.
        store
            .delete(Kind::Policy, Some("tiers"), "tiers")
            .await
            .unwrap();
        eventually("tiers is released", || async {
            !policies.config_maps.followed().contains_key("tiers")
        })
        .await;
        store
            .delete(Kind::Policy, Some("policies"), "tiered")
            .await
            .unwrap();
        eventually("policies is released", || async {
            policies.config_maps.followed().is_empty()
        })
        .await;
        assert_eq!(
            gated.listed(),
            ["policies", "tiers"],
            "each namespace listed once"
        );
        let _ = stop_tx.send(true);
    }
}
