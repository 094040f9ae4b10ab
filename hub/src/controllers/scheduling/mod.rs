//! Placement → PlacementDecision: the scheduling controller.
//!
//! [`core`] decides (pure, OCM's semantics), [`fleet`] keeps the model that makes a change cost
//! only what it touches, [`selector`] matches label and claim selectors; this module is the
//! driver: it feeds the model from the store's watches, decides the placements a change made
//! dirty (after a batch of changes, not after each), writes the PlacementDecisions and the
//! Placement's status that differ from what is stored, and decides again when a toleration or
//! a score runs out.
//!
//! Writes are the only slow part: they run for many placements at once (bounded), and a failed
//! one is retried with a growing delay while everything else carries on. PlacementDecisions are
//! written only by this controller; one edited or deleted by someone else is put back.

pub mod core;
pub mod fleet;
pub mod selector;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use flotilla_ops::error_chain;
use flotilla_proto::api::conditions::{ConditionStatus, set_condition};
use flotilla_proto::api::{
    AddOnPlacementScore, DECISION_GROUP_INDEX_LABEL, DECISION_GROUP_NAME_LABEL, Kind,
    ManagedCluster, ManagedClusterSet, ManagedClusterSetBinding, PLACEMENT_LABEL, Placement,
    PlacementDecision, PlacementStatus,
};
use flotilla_store::{Object, Revision, Store, StoreError, WatchEvent, name_of, namespace_of};
use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use self::core::{DecisionObject, Outcome};
use self::fleet::{Fleet, Key};
use super::feed::{self, Known, Readiness, Update};
use super::{ControllerConfig, delay_until, stopped};

/// The kinds the scheduler reads.
const KINDS: [Kind; 6] = [
    Kind::ManagedCluster,
    Kind::ManagedClusterSet,
    Kind::ManagedClusterSetBinding,
    Kind::Placement,
    Kind::PlacementDecision,
    Kind::AddOnPlacementScore,
];

/// First delay before a placement whose writes failed is written again; doubles per failure.
const RETRY_MIN: Duration = Duration::from_millis(500);
/// Longest delay between retries of one placement's writes.
const RETRY_MAX: Duration = Duration::from_secs(30);

/// What the driver knows of one stored PlacementDecision.
#[derive(Clone, Debug, PartialEq)]
struct StoredDecision {
    labels: BTreeMap<String, String>,
    clusters: Vec<String>,
}

/// The scheduling controller's state besides the model.
struct Scheduler {
    store: Arc<dyn Store>,
    config: ControllerConfig,
    fleet: Fleet,
    known: Known,
    readiness: Readiness,
    /// Stored PlacementDecisions by namespace and name.
    decisions: HashMap<(String, String), StoredDecision>,
    /// Revisions this controller's own writes of each PlacementDecision produced, whose watch
    /// events are still to come: an echo of our own write is no news (its intermediate states,
    /// such as a create without status, must not look like someone else's edit).
    ours: HashMap<(String, String), Vec<Revision>>,
    /// Pending rechecks (a toleration or score runs out), earliest first, one per placement.
    rechecks: BTreeMap<Timestamp, BTreeSet<Key>>,
    recheck_of: HashMap<Key, Timestamp>,
    /// Consecutive write failures per placement, for the retry delay.
    failures: HashMap<Key, u32>,
    /// Placements deleted whose decisions are still to be removed.
    orphaned: BTreeSet<Key>,
    /// Whether the first pass over every placement (after the first lists) is done.
    first_pass_done: bool,
}

/// One placement's writes.
struct Plan {
    key: Key,
    /// Decision objects to create or bring in line, with what is stored now.
    upserts: Vec<(DecisionObject, Option<StoredDecision>)>,
    deletes: Vec<String>,
    /// The Placement's new status, when it differs from the stored one.
    status: Option<PlacementStatus>,
    placement_uid: String,
}

/// What a plan's execution changed, to fold back into the driver's state.
struct Written {
    key: Key,
    /// Each decision object written, as stored now, with the revisions the writes made.
    decisions: Vec<(String, StoredDecision, Vec<Revision>)>,
    deleted: Vec<String>,
    placement: Option<Placement>,
    error: Option<StoreError>,
}

/// Runs the scheduler until `stop` turns true.
pub async fn run(store: Arc<dyn Store>, config: ControllerConfig, stop: watch::Receiver<bool>) {
    let (tx, mut rx) = mpsc::channel(config.queue_capacity);
    let mut feeds = JoinSet::new();
    feed::spawn(store.clone(), &KINDS, None, tx, stop.clone(), &mut feeds);
    let mut s = Scheduler {
        store,
        config,
        fleet: Fleet::new(),
        known: Known::default(),
        readiness: Readiness::new(&KINDS),
        decisions: HashMap::new(),
        ours: HashMap::new(),
        rechecks: BTreeMap::new(),
        recheck_of: HashMap::new(),
        failures: HashMap::new(),
        orphaned: BTreeSet::new(),
        first_pass_done: false,
    };
    let mut stop_wait = stop.clone();
    loop {
        let next = s.rechecks.keys().next().copied();
        tokio::select! {
            update = rx.recv() => match update {
                Some(u) => s.handle(u),
                None => break,
            },
            _ = delay_until(next) => s.due_rechecks(),
            _ = stopped(&mut stop_wait) => break,
        }
        // Take what else is waiting, so a burst (a relist, a thousand clusters joining) is
        // decided once, not once per change.
        for _ in 0..s.config.batch {
            match rx.try_recv() {
                Ok(u) => s.handle(u),
                Err(_) => break,
            }
        }
        if s.readiness.ready() {
            s.decide_and_write().await;
        }
    }
    feeds.shutdown().await;
}

impl Scheduler {
    fn handle(&mut self, update: Update) {
        let was_ready = self.readiness.ready();
        let ready = self.readiness.note(&update);
        let now = Timestamp::now();
        for (kind, event) in self.known.changes(update) {
            self.apply(kind, event, now);
        }
        if ready && !was_ready {
            info!(
                clusters = self.fleet.cluster_count(),
                placements = self.fleet.placement_keys().count(),
                "placement scheduler has read the fleet; deciding"
            );
            self.fleet.mark_all_dirty();
            // Decisions of placements deleted while the hub was down.
            let live: BTreeSet<Key> = self.fleet.placement_keys().cloned().collect();
            let orphans: BTreeSet<Key> = self
                .decisions
                .iter()
                .filter_map(|((ns, _), d)| d.labels.get(PLACEMENT_LABEL).map(|p| Key::new(ns, p)))
                .filter(|k| !live.contains(k))
                .collect();
            self.orphaned.extend(orphans);
        }
    }

    fn apply(&mut self, kind: Kind, event: WatchEvent, now: Timestamp) {
        let deleted = matches!(event, WatchEvent::Deleted(_));
        let obj = event.into_object();
        let ns = namespace_of(&obj).unwrap_or_default().to_string();
        let name = name_of(&obj).to_string();
        match kind {
            Kind::ManagedCluster if deleted => self.fleet.delete_cluster(&name, now),
            Kind::ManagedCluster => match typed::<ManagedCluster>(obj) {
                Some(mc) => self.fleet.upsert_cluster(&mc, now),
                None => {
                    warn!(cluster = %name, "stored ManagedCluster does not parse; placements ignore it")
                }
            },
            Kind::ManagedClusterSet if deleted => self.fleet.delete_set(&name, now),
            Kind::ManagedClusterSet => {
                if let Some(set) = typed::<ManagedClusterSet>(obj)
                    && let Some(problem) = self.fleet.upsert_set(&name, &set.spec, now)
                {
                    warn!(set = %name, %problem, "ManagedClusterSet's label selector is invalid; it holds no clusters");
                }
            }
            Kind::ManagedClusterSetBinding if deleted => self.fleet.delete_binding(&ns, &name, now),
            Kind::ManagedClusterSetBinding => {
                if let Some(b) = typed::<ManagedClusterSetBinding>(obj) {
                    self.fleet
                        .upsert_binding(&ns, &name, &b.spec.cluster_set, now);
                }
            }
            Kind::Placement if deleted => {
                let key = Key::new(&ns, &name);
                self.fleet.delete_placement(&key);
                self.cancel_recheck(&key);
                self.failures.remove(&key);
                self.orphaned.insert(key);
            }
            Kind::Placement => match typed::<Placement>(obj) {
                Some(p) => {
                    let key = Key::new(&ns, &name);
                    self.orphaned.remove(&key);
                    self.fleet.upsert_placement(&p, now);
                }
                None => {
                    warn!(placement = %format!("{ns}/{name}"), "stored Placement does not parse; not scheduled")
                }
            },
            Kind::PlacementDecision => self.decision_event(&ns, &name, obj, deleted),
            Kind::AddOnPlacementScore => {
                let status = if deleted {
                    None
                } else {
                    typed::<AddOnPlacementScore>(obj).map(|s| s.status.unwrap_or_default())
                };
                self.fleet.set_score(&ns, &name, status);
            }
            _ => {}
        }
    }

    /// A stored PlacementDecision changed: keep the model's counts, and put it back if it is
    /// not what this controller wrote.
    fn decision_event(&mut self, ns: &str, name: &str, obj: Object, deleted: bool) {
        let slot = (ns.to_string(), name.to_string());
        if let (Some(rv), Some(ours)) = (Revision::of(&obj), self.ours.get_mut(&slot))
            && let Some(at) = ours.iter().position(|r| *r == rv)
        {
            // Our own write (or one before it) coming back: already accounted for.
            ours.drain(..=at);
            if ours.is_empty() {
                self.ours.remove(&slot);
            }
            return;
        }
        let before = self.decisions.get(&slot).cloned();
        let now_stored = if deleted {
            self.decisions.remove(&slot);
            None
        } else {
            let Some(d) = typed::<PlacementDecision>(obj) else {
                return;
            };
            let stored = StoredDecision {
                labels: d.metadata.labels.clone().unwrap_or_default(),
                clusters: d
                    .status
                    .unwrap_or_default()
                    .decisions
                    .into_iter()
                    .map(|c| c.cluster_name)
                    .collect(),
            };
            self.decisions.insert(slot.clone(), stored.clone());
            Some(stored)
        };
        let Some(placement) = now_stored
            .as_ref()
            .or(before.as_ref())
            .and_then(|d| d.labels.get(PLACEMENT_LABEL))
        else {
            return;
        };
        let key = Key::new(ns, placement);
        self.fleet
            .set_stored_decision(&key, name, now_stored.as_ref().map(|d| d.clusters.clone()));
        if before != now_stored {
            // Someone else's edit (ours are recorded before their events arrive).
            self.fleet.mark_dirty(&key);
        }
    }

    fn schedule_recheck(&mut self, key: &Key, at: Option<Timestamp>) {
        self.cancel_recheck(key);
        if let Some(at) = at {
            self.rechecks.entry(at).or_default().insert(key.clone());
            self.recheck_of.insert(key.clone(), at);
        }
    }

    fn cancel_recheck(&mut self, key: &Key) {
        if let Some(at) = self.recheck_of.remove(key)
            && let Some(keys) = self.rechecks.get_mut(&at)
        {
            keys.remove(key);
            if keys.is_empty() {
                self.rechecks.remove(&at);
            }
        }
    }

    fn due_rechecks(&mut self) {
        let now = Timestamp::now();
        while let Some((&at, _)) = self.rechecks.iter().next() {
            if at > now {
                break;
            }
            for key in self.rechecks.remove(&at).unwrap_or_default() {
                self.recheck_of.remove(&key);
                debug!(placement = %key, "a toleration, score or retry is due; deciding again");
                self.fleet.refilter(&key, now);
            }
        }
    }

    /// Decides every dirty placement and writes what differs, many placements at once.
    async fn decide_and_write(&mut self) {
        let now = Timestamp::now();
        let mut plans = Vec::new();
        for key in std::mem::take(&mut self.orphaned) {
            let deletes: Vec<String> = self
                .decisions
                .iter()
                .filter(|((ns, _), d)| {
                    *ns == key.namespace
                        && d.labels.get(PLACEMENT_LABEL).map(String::as_str)
                            == Some(key.name.as_str())
                })
                .map(|((_, name), _)| name.clone())
                .collect();
            if !deletes.is_empty() {
                plans.push(Plan {
                    key,
                    upserts: Vec::new(),
                    deletes,
                    status: None,
                    placement_uid: String::new(),
                });
            }
        }
        for key in self.fleet.take_dirty() {
            let Some(outcome) = self.fleet.decide(&key, now) else {
                continue;
            };
            if !self.failures.contains_key(&key) {
                self.schedule_recheck(&key, outcome.recheck_at);
            }
            if let Some(plan) = self.plan(&key, &outcome, now) {
                plans.push(plan);
            }
        }
        if !self.first_pass_done {
            self.first_pass_done = true;
            info!(
                placements = self.fleet.placement_keys().count(),
                clusters = self.fleet.cluster_count(),
                model_kib = self.fleet.approximate_bytes() / 1024,
                "every placement decided once"
            );
        }
        if plans.is_empty() {
            return;
        }
        debug!(placements = plans.len(), "writing placement decisions");
        let store = self.store.clone();
        let results: Vec<Written> = futures::stream::iter(plans)
            .map(|plan| execute(store.clone(), plan))
            .buffer_unordered(self.config.write_concurrency)
            .collect()
            .await;
        for w in results {
            self.written(w);
        }
    }

    /// The writes that bring one placement's stored decisions and status to `outcome`.
    fn plan(&self, key: &Key, outcome: &Outcome, now: Timestamp) -> Option<Plan> {
        let placement = self.fleet.placement(key)?;
        let mut upserts = Vec::new();
        let wanted: BTreeSet<&str> = outcome.objects.iter().map(|o| o.name.as_str()).collect();
        for o in &outcome.objects {
            let stored = self
                .decisions
                .get(&(key.namespace.clone(), o.name.clone()))
                .cloned();
            let desired = desired_stored(&key.name, o);
            if stored.as_ref() != Some(&desired) {
                upserts.push((o.clone(), stored));
            }
        }
        let deletes: Vec<String> = self
            .decisions
            .iter()
            .filter(|((ns, name), d)| {
                *ns == key.namespace
                    && d.labels.get(PLACEMENT_LABEL) == Some(&key.name)
                    && !wanted.contains(name.as_str())
            })
            .map(|((_, name), _)| name.clone())
            .collect();
        let status = placement_status(placement, outcome, now);
        let status = (placement.status.as_ref() != Some(&status)).then_some(status);
        if upserts.is_empty() && deletes.is_empty() && status.is_none() {
            return None;
        }
        Some(Plan {
            key: key.clone(),
            upserts,
            deletes,
            status,
            placement_uid: placement.metadata.uid.clone().unwrap_or_default(),
        })
    }

    fn written(&mut self, w: Written) {
        /// Echoes remembered per object; older ones are dropped (their events, if any, then
        /// count as news and cost one more look).
        const ECHOES: usize = 8;
        for (name, stored, revisions) in w.decisions {
            self.fleet
                .set_stored_decision(&w.key, &name, Some(stored.clusters.clone()));
            let slot = (w.key.namespace.clone(), name);
            let ours = self.ours.entry(slot.clone()).or_default();
            ours.extend(revisions);
            let excess = ours.len().saturating_sub(ECHOES);
            ours.drain(..excess);
            self.decisions.insert(slot, stored);
        }
        for name in w.deleted {
            self.fleet.set_stored_decision(&w.key, &name, None);
            let slot = (w.key.namespace.clone(), name);
            self.ours.remove(&slot);
            self.decisions.remove(&slot);
        }
        if let Some(p) = w.placement {
            self.fleet.upsert_placement(&p, Timestamp::now());
        }
        match w.error {
            None => {
                self.failures.remove(&w.key);
            }
            Some(e) => {
                let failures = self.failures.entry(w.key.clone()).or_default();
                *failures += 1;
                let delay = RETRY_MIN
                    .saturating_mul(1 << (*failures - 1).min(10))
                    .min(RETRY_MAX);
                warn!(placement = %w.key, error = %error_chain(&e), retry_in = ?delay, "writing placement decisions failed");
                let at =
                    Timestamp::now() + jiff::SignedDuration::try_from(delay).unwrap_or_default();
                let key = w.key.clone();
                self.schedule_recheck(&key, Some(at));
                if self.fleet.placement(&key).is_none() {
                    self.orphaned.insert(key);
                }
            }
        }
    }
}

/// How a decision object is stored once written.
fn desired_stored(placement: &str, o: &DecisionObject) -> StoredDecision {
    StoredDecision {
        labels: decision_labels(placement, o),
        clusters: o.decisions.iter().map(|d| d.cluster_name.clone()).collect(),
    }
}

/// OCM's labels on a PlacementDecision: its placement, group name and group index.
fn decision_labels(placement: &str, o: &DecisionObject) -> BTreeMap<String, String> {
    [
        (PLACEMENT_LABEL.to_string(), placement.to_string()),
        (DECISION_GROUP_NAME_LABEL.to_string(), o.group_name.clone()),
        (
            DECISION_GROUP_INDEX_LABEL.to_string(),
            o.group_index.to_string(),
        ),
    ]
    .into()
}

/// The Placement's status for `outcome`: counts, groups, and the two conditions (their
/// transition times kept while their status holds).
fn placement_status(placement: &Placement, outcome: &Outcome, now: Timestamp) -> PlacementStatus {
    let mut status = placement.status.clone().unwrap_or_default();
    status.number_of_selected_clusters = outcome.report.selection.clusters.len() as i32;
    status.decision_groups = core::decision_group_status(&outcome.objects);
    for c in core::conditions(&outcome.report, &placement.spec.cluster_sets) {
        set_condition(
            &mut status.conditions,
            c.type_,
            ConditionStatus::from(c.status),
            c.reason,
            &c.message,
            None,
            Time(now),
        );
    }
    status
}

/// Carries out one placement's writes, in order: decisions first (consumers read those), then
/// the Placement's status. Stops at the first failure and reports what was done.
async fn execute(store: Arc<dyn Store>, plan: Plan) -> Written {
    let mut w = Written {
        key: plan.key.clone(),
        decisions: Vec::new(),
        deleted: Vec::new(),
        placement: None,
        error: None,
    };
    let ns = plan.key.namespace.as_str();
    for (object, stored) in &plan.upserts {
        let desired = desired_stored(&plan.key.name, object);
        match write_decision(store.as_ref(), &plan, object, stored.as_ref(), &desired).await {
            Ok(revisions) => w.decisions.push((object.name.clone(), desired, revisions)),
            Err(e) => {
                w.error = Some(e);
                return w;
            }
        }
    }
    for name in &plan.deletes {
        match store.delete(Kind::PlacementDecision, Some(ns), name).await {
            Ok(()) | Err(StoreError::NotFound { .. }) => w.deleted.push(name.clone()),
            Err(e) => {
                w.error = Some(e);
                return w;
            }
        }
    }
    if let Some(status) = &plan.status {
        match store
            .update_status(
                Kind::Placement,
                Some(ns),
                &plan.key.name,
                serde_json::to_value(status).unwrap_or(Value::Null),
                None,
            )
            .await
        {
            Ok(obj) => w.placement = typed::<Placement>(obj),
            // Deleted meanwhile: its decisions go with the delete event.
            Err(StoreError::NotFound { .. }) => {}
            Err(e) => w.error = Some(e),
        }
    }
    if w.error.is_none() && !plan.upserts.is_empty() {
        debug!(placement = %plan.key, objects = plan.upserts.len(), "placement decisions written");
    }
    w
}

/// Creates or updates one PlacementDecision: metadata (labels, owner) through the object, the
/// decisions through its status. Returns the revisions its writes made, in order.
async fn write_decision(
    store: &dyn Store,
    plan: &Plan,
    object: &DecisionObject,
    stored: Option<&StoredDecision>,
    desired: &StoredDecision,
) -> Result<Vec<Revision>, StoreError> {
    let ns = plan.key.namespace.as_str();
    let meta = json!({
        "apiVersion": Kind::PlacementDecision.api_version(),
        "kind": Kind::PlacementDecision.name(),
        "metadata": {
            "name": object.name,
            "namespace": ns,
            "labels": desired.labels,
            "ownerReferences": [{
                "apiVersion": Kind::Placement.api_version(),
                "kind": Kind::Placement.name(),
                "name": plan.key.name,
                "uid": plan.placement_uid,
                "controller": true,
                "blockOwnerDeletion": true,
            }],
        },
    });
    let mut revisions = Vec::new();
    let written = match stored {
        None => match store.create(meta.clone()).await {
            Ok(o) => Some(o),
            Err(StoreError::AlreadyExists { .. }) => Some(store.update_spec(meta).await?),
            Err(e) => return Err(e),
        },
        Some(s) if s.labels != desired.labels => Some(store.update_spec(meta).await?),
        Some(_) => None,
    };
    revisions.extend(written.as_ref().and_then(Revision::of));
    if stored.map(|s| &s.clusters) != Some(&desired.clusters) || stored.is_none() {
        let o = store
            .update_status(
                Kind::PlacementDecision,
                Some(ns),
                &object.name,
                json!({ "decisions": object.decisions }),
                None,
            )
            .await?;
        revisions.extend(Revision::of(&o));
    }
    Ok(revisions)
}

fn typed<K: serde::de::DeserializeOwned>(obj: Object) -> Option<K> {
    serde_json::from_value(obj).ok()
}
