//! The scheduler's model of the fleet, updated one change at a time so that a change costs what
//! it touches, not a pass over every cluster for every placement.
//!
//! For each placement the model keeps, as bit sets over cluster ids, the clusters of its
//! eligible sets and each one's [`core::filter`] verdict. A cluster's change re-filters that one
//! cluster for the placements whose sets hold it (before or after); a set, binding or placement
//! change re-filters that placement's members; a score change touches the placements that rank
//! by it. Re-filtering a placement's members finds those its predicates select from inverted
//! indexes of every cluster's labels and claims ([`LabelIndex`]), then checks taints for
//! those only. Placements whose inputs changed are marked dirty, and [`Fleet::decide`] runs
//! [`core::select`], [`core::group`] and [`core::decision_objects`] for one of them. The result
//! equals [`core::schedule`] over the whole world, which the tests check on random histories.
//!
//! Invariant: `members`, `always` and `if_selected` of every placement are exactly what a full
//! [`Fleet::refilter`] would compute, except for verdicts past a toleration's expiry, which the
//! recheck timer corrects (it is armed for each such cluster's earliest expiry).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use flotilla_proto::api::{
    AddOnPlacementScoreStatus, ManagedCluster, ManagedClusterSetSpec, Placement,
};
use jiff::Timestamp;

use super::core::{
    self, Allowed, Cluster, Compiled, DecisionObject, Misconfigured, Outcome, RankingInputs,
    Report, SetRule, Verdict,
};
use super::selector::LabelIndex;

/// A cluster's slot in the bit sets; reused after the cluster is deleted.
pub type ClusterId = usize;

/// `namespace/name` of a namespaced object.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key {
    pub namespace: String,
    pub name: String,
}

impl Key {
    pub fn new(namespace: &str, name: &str) -> Key {
        Key {
            namespace: namespace.to_string(),
            name: name.to_string(),
        }
    }
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A set of cluster ids, one bit each: 10,000 clusters take 1.25 KiB per set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bits(Vec<u64>);

impl Bits {
    pub fn get(&self, id: ClusterId) -> bool {
        self.0
            .get(id / 64)
            .is_some_and(|w| w & (1 << (id % 64)) != 0)
    }

    /// Sets or clears `id`; says whether that changed anything.
    pub fn set(&mut self, id: ClusterId, on: bool) -> bool {
        let (word, bit) = (id / 64, 1u64 << (id % 64));
        if word >= self.0.len() {
            if !on {
                return false;
            }
            self.0.resize(word + 1, 0);
        }
        let before = self.0[word] & bit != 0;
        if on {
            self.0[word] |= bit;
        } else {
            self.0[word] &= !bit;
        }
        before != on
    }

    pub fn count(&self) -> usize {
        self.0.iter().map(|w| w.count_ones() as usize).sum()
    }

    pub fn iter(&self) -> impl Iterator<Item = ClusterId> + '_ {
        self.0.iter().enumerate().flat_map(|(i, w)| {
            let mut w = *w;
            std::iter::from_fn(move || {
                if w == 0 {
                    return None;
                }
                let bit = w.trailing_zeros() as usize;
                w &= w - 1;
                Some(i * 64 + bit)
            })
        })
    }

    /// Keeps only the ids `other` holds too.
    pub fn intersect(&mut self, other: &Bits) {
        self.0.truncate(other.0.len());
        for (w, o) in self.0.iter_mut().zip(&other.0) {
            *w &= o;
        }
    }

    /// Drops the ids `other` holds.
    pub fn subtract(&mut self, other: &Bits) {
        for (w, o) in self.0.iter_mut().zip(&other.0) {
            *w &= !o;
        }
    }

    /// Adds the ids `other` holds.
    pub fn unite(&mut self, other: &Bits) {
        if self.0.len() < other.0.len() {
            self.0.resize(other.0.len(), 0);
        }
        for (w, o) in self.0.iter_mut().zip(&other.0) {
            *w |= o;
        }
    }

    fn clear(&mut self) {
        self.0.clear();
    }

    /// Bytes held, for the memory report.
    fn heap_bytes(&self) -> usize {
        self.0.capacity() * 8
    }
}

/// A ManagedClusterSet: its rule and its members.
#[derive(Debug)]
struct SetState {
    rule: SetRule,
    members: Bits,
}

/// What the model keeps per placement.
#[derive(Debug)]
struct PlacementState {
    placement: Placement,
    compiled: Result<Compiled, Misconfigured>,
    /// Sets bound to the namespace (whose set exists) that the placement may use.
    eligible: Vec<String>,
    /// Clusters in the eligible sets.
    members: Bits,
    /// Members the filters allow always, or only while selected.
    always: Bits,
    if_selected: Bits,
    /// Members whose verdict runs out (a toleration with tolerationSeconds), and when.
    expiring: HashMap<ClusterId, Timestamp>,
    /// The placement's current decisions: Steady's input, and what NoSelectIfNew keeps.
    selected: Bits,
}

/// The fleet as the scheduler sees it. Pure: no IO, no clock.
#[derive(Debug, Default)]
pub struct Fleet {
    /// Id → name and facts; `None` for a free slot.
    clusters: Vec<Option<(Arc<str>, Cluster)>>,
    ids: HashMap<Arc<str>, ClusterId>,
    /// Ids in name order: decisions are listed by name.
    by_name: BTreeMap<Arc<str>, ClusterId>,
    free: Vec<ClusterId>,
    sets: BTreeMap<String, SetState>,
    /// Namespace → binding name → bound set.
    bindings: BTreeMap<String, BTreeMap<String, String>>,
    placements: BTreeMap<Key, PlacementState>,
    scores: HashMap<(String, String), AddOnPlacementScoreStatus>,
    /// Stored PlacementDecisions per placement (from the store, whoever wrote them): what a
    /// placement new to the model starts from as its current decisions.
    stored: BTreeMap<Key, BTreeMap<String, Vec<String>>>,
    /// How many placements currently select each cluster (Balance's input), by id. Kept from
    /// the placements' current decisions as they are decided, so the placements of one batch
    /// see each other's choices as OCM's one-at-a-time scheduler does, not all the same stale
    /// counts.
    counts: Vec<u32>,
    dirty: BTreeSet<Key>,
    /// Every cluster's labels and claims, inverted: what a placement's predicates select is
    /// found from these, not by visiting each member.
    labels: LabelIndex,
    claims: LabelIndex,
}

impl Fleet {
    pub fn new() -> Fleet {
        Fleet::default()
    }

    /// Placements whose decision may have changed since they were last decided.
    pub fn take_dirty(&mut self) -> BTreeSet<Key> {
        std::mem::take(&mut self.dirty)
    }

    pub fn mark_dirty(&mut self, key: &Key) {
        if self.placements.contains_key(key) {
            self.dirty.insert(key.clone());
        }
    }

    /// Every placement, for a full pass (startup, a relist).
    pub fn mark_all_dirty(&mut self) {
        self.dirty.extend(self.placements.keys().cloned());
    }

    pub fn placement(&self, key: &Key) -> Option<&Placement> {
        self.placements.get(key).map(|p| &p.placement)
    }

    pub fn placement_keys(&self) -> impl Iterator<Item = &Key> {
        self.placements.keys()
    }

    pub fn cluster_count(&self) -> usize {
        self.ids.len()
    }

    /// The stored PlacementDecisions of a placement: object name → cluster names.
    pub fn stored_decisions(&self, key: &Key) -> Option<&BTreeMap<String, Vec<String>>> {
        self.stored.get(key)
    }

    // ---- clusters ----

    /// A ManagedCluster was added or changed.
    pub fn upsert_cluster(&mut self, mc: &ManagedCluster, now: Timestamp) {
        let cluster = Cluster::from_managed_cluster(mc);
        if cluster.name.is_empty() {
            return;
        }
        let id = match self.ids.get(cluster.name.as_str()) {
            Some(id) => *id,
            None => self.assign(&cluster.name),
        };
        if self.clusters[id].as_ref().map(|(_, c)| c) == Some(&cluster) {
            return;
        }
        let name = self.clusters[id]
            .as_ref()
            .map(|(n, _)| n.clone())
            .unwrap_or_else(|| Arc::from(cluster.name.as_str()));
        let before = self.clusters[id].replace((name, cluster));
        self.index(id, before.as_ref().map(|(_, c)| c));
        self.cluster_changed(id, before.map(|(_, c)| c), now);
    }

    /// Brings the label and claim indexes in line with cluster `id`, which was `before`.
    fn index(&mut self, id: ClusterId, before: Option<&Cluster>) {
        let after = self.clusters[id].as_ref().map(|(_, c)| c);
        self.labels
            .update(id, before.map(|c| &c.labels), after.map(|c| &c.labels));
        self.claims
            .update(id, before.map(|c| &c.claims), after.map(|c| &c.claims));
    }

    /// A ManagedCluster was deleted.
    pub fn delete_cluster(&mut self, name: &str, now: Timestamp) {
        let Some(id) = self.ids.get(name).copied() else {
            return;
        };
        let before = self.clusters[id].take().map(|(_, c)| c);
        self.index(id, before.as_ref());
        self.cluster_changed(id, before, now);
        for set in self.sets.values_mut() {
            set.members.set(id, false);
        }
        for p in self.placements.values_mut() {
            p.selected.set(id, false);
        }
        self.counts[id] = 0;
        self.ids.remove(name);
        self.by_name.remove(name);
        self.free.push(id);
    }

    fn assign(&mut self, name: &str) -> ClusterId {
        let name: Arc<str> = Arc::from(name);
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                self.clusters.push(None);
                self.counts.push(0);
                self.clusters.len() - 1
            }
        };
        self.counts[id] = 0;
        self.ids.insert(name.clone(), id);
        self.by_name.insert(name.clone(), id);
        // Stored decisions may already name it (decisions listed before clusters).
        for (key, objects) in &self.stored {
            if objects.values().flatten().any(|c| **c == *name)
                && let Some(p) = self.placements.get_mut(key)
                && p.selected.set(id, true)
            {
                self.counts[id] += 1;
            }
        }
        id
    }

    /// Re-derives a cluster's set memberships and its verdict in every placement that could
    /// see it, before or after the change.
    fn cluster_changed(&mut self, id: ClusterId, before: Option<Cluster>, now: Timestamp) {
        let after = self.clusters[id].as_ref().map(|(_, c)| c.clone());
        let mut touched_sets: BTreeSet<String> = BTreeSet::new();
        for (name, set) in self.sets.iter_mut() {
            let was = set.members.get(id);
            let is = after.as_ref().is_some_and(|c| set.rule.contains(c));
            set.members.set(id, is);
            if was || is {
                touched_sets.insert(name.clone());
            }
        }
        if touched_sets.is_empty() {
            return;
        }
        let scoring_changed = match (&before, &after) {
            (Some(b), Some(a)) => {
                b.cpu != a.cpu
                    || b.memory != a.memory
                    || b.labels != a.labels
                    || b.claims != a.claims
            }
            _ => true,
        };
        let keys: Vec<Key> = self
            .placements
            .iter()
            .filter(|(_, p)| p.eligible.iter().any(|s| touched_sets.contains(s)))
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            let changed = self.refilter_one(&key, id, now);
            let p = &self.placements[&key];
            let ranked = p
                .compiled
                .as_ref()
                .is_ok_and(|c| c.number_of_clusters.is_some() || !c.groups.is_empty());
            let relevant = p.always.get(id) || p.if_selected.get(id) || p.selected.get(id);
            if changed || (scoring_changed && ranked && relevant) {
                self.dirty.insert(key);
            }
        }
    }

    /// Recomputes one cluster's membership and verdict in one placement; says whether they
    /// changed.
    fn refilter_one(&mut self, key: &Key, id: ClusterId, now: Timestamp) -> bool {
        let cluster = self.clusters[id].as_ref().map(|(_, c)| c);
        let Some(p) = self.placements.get_mut(key) else {
            return false;
        };
        let member = cluster.is_some()
            && p.eligible
                .iter()
                .any(|s| self.sets.get(s).is_some_and(|set| set.members.get(id)));
        let verdict = match (&p.compiled, cluster) {
            (Ok(compiled), Some(c)) if member => core::filter(compiled, c, now),
            _ => Verdict {
                allowed: Allowed::Never,
                recheck_at: None,
            },
        };
        let mut changed = p.members.set(id, member);
        changed |= p.always.set(id, verdict.allowed == Allowed::Always);
        changed |= p
            .if_selected
            .set(id, verdict.allowed == Allowed::IfSelected);
        let expiry = verdict
            .recheck_at
            .filter(|_| verdict.allowed != Allowed::Never);
        let previous = match expiry {
            Some(t) => p.expiring.insert(id, t),
            None => p.expiring.remove(&id),
        };
        changed | (previous != expiry)
    }

    // ---- sets and bindings ----

    /// A ManagedClusterSet was added or changed; returns a problem with its selector, if any.
    pub fn upsert_set(
        &mut self,
        name: &str,
        spec: &ManagedClusterSetSpec,
        now: Timestamp,
    ) -> Option<String> {
        let (rule, problem) = SetRule::from_spec(name, spec);
        if self.sets.get(name).is_some_and(|s| s.rule == rule) {
            return problem;
        }
        let mut members = Bits::default();
        for (id, slot) in self.clusters.iter().enumerate() {
            if let Some((_, c)) = slot
                && rule.contains(c)
            {
                members.set(id, true);
            }
        }
        self.sets
            .insert(name.to_string(), SetState { rule, members });
        self.set_changed(name, now);
        problem
    }

    pub fn delete_set(&mut self, name: &str, now: Timestamp) {
        if self.sets.remove(name).is_some() {
            self.set_changed(name, now);
        }
    }

    /// Placements that bind or use the set decide again from scratch.
    fn set_changed(&mut self, set: &str, now: Timestamp) {
        let namespaces: BTreeSet<String> = self
            .bindings
            .iter()
            .filter(|(_, b)| b.values().any(|s| s == set))
            .map(|(ns, _)| ns.clone())
            .collect();
        let keys: Vec<Key> = self
            .placements
            .keys()
            .filter(|k| namespaces.contains(&k.namespace))
            .cloned()
            .collect();
        for key in keys {
            self.refilter(&key, now);
        }
    }

    /// A ManagedClusterSetBinding was added or changed: `name` in `namespace` binds `set`.
    pub fn upsert_binding(&mut self, namespace: &str, name: &str, set: &str, now: Timestamp) {
        let bound = self.bindings.entry(namespace.to_string()).or_default();
        if bound.get(name).map(String::as_str) == Some(set) {
            return;
        }
        bound.insert(name.to_string(), set.to_string());
        self.namespace_changed(namespace, now);
    }

    pub fn delete_binding(&mut self, namespace: &str, name: &str, now: Timestamp) {
        if let Some(bound) = self.bindings.get_mut(namespace)
            && bound.remove(name).is_some()
        {
            if bound.is_empty() {
                self.bindings.remove(namespace);
            }
            self.namespace_changed(namespace, now);
        }
    }

    fn namespace_changed(&mut self, namespace: &str, now: Timestamp) {
        let keys: Vec<Key> = self
            .placements
            .keys()
            .filter(|k| k.namespace == namespace)
            .cloned()
            .collect();
        for key in keys {
            self.refilter(&key, now);
        }
    }

    /// Sets bound to `namespace` by a binding whose set exists.
    fn bound(&self, namespace: &str) -> BTreeSet<String> {
        self.bindings
            .get(namespace)
            .map(|b| {
                b.values()
                    .filter(|s| self.sets.contains_key(s.as_str()))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    // ---- placements ----

    /// A Placement was added or changed. A change of status only (the scheduler's own writes
    /// coming back) changes nothing.
    pub fn upsert_placement(&mut self, placement: &Placement, now: Timestamp) {
        let key = Key::new(
            placement.metadata.namespace.as_deref().unwrap_or_default(),
            placement.metadata.name.as_deref().unwrap_or_default(),
        );
        match self.placements.get_mut(&key) {
            Some(p)
                if p.placement.spec == placement.spec
                    && p.placement.metadata.uid == placement.metadata.uid =>
            {
                p.placement = placement.clone();
                return;
            }
            Some(p) => {
                p.compiled = core::compile(placement);
                p.placement = placement.clone();
            }
            None => {
                let mut selected = Bits::default();
                for c in self
                    .stored
                    .get(&key)
                    .into_iter()
                    .flat_map(|o| o.values().flatten())
                {
                    if let Some(id) = self.ids.get(c.as_str()) {
                        selected.set(*id, true);
                    }
                }
                self.placements.insert(
                    key.clone(),
                    PlacementState {
                        placement: placement.clone(),
                        compiled: core::compile(placement),
                        eligible: Vec::new(),
                        members: Bits::default(),
                        always: Bits::default(),
                        if_selected: Bits::default(),
                        expiring: HashMap::new(),
                        selected,
                    },
                );
            }
        }
        self.refilter(&key, now);
    }

    /// A Placement was deleted; its decisions are the driver's to remove.
    pub fn delete_placement(&mut self, key: &Key) -> Option<Placement> {
        self.dirty.remove(key);
        let p = self.placements.remove(key)?;
        for id in p.selected.iter() {
            self.counts[id] = self.counts[id].saturating_sub(1);
        }
        Some(p.placement)
    }

    /// Makes `selected` the placement's current decisions, keeping Balance's counts.
    fn set_selected(&mut self, key: &Key, selected: Bits) {
        let Some(p) = self.placements.get_mut(key) else {
            return;
        };
        for id in p.selected.iter().filter(|id| !selected.get(*id)) {
            self.counts[id] = self.counts[id].saturating_sub(1);
        }
        for id in selected.iter().filter(|id| !p.selected.get(*id)) {
            self.counts[id] += 1;
        }
        p.selected = selected;
    }

    /// Re-filters every member of one placement (its spec, sets or bindings changed, or a
    /// toleration ran out) and marks it dirty.
    pub fn refilter(&mut self, key: &Key, now: Timestamp) {
        let bound = self.bound(&key.namespace);
        let Some(p) = self.placements.get_mut(key) else {
            return;
        };
        let spec_sets = match &p.compiled {
            Ok(c) => c.cluster_sets.clone(),
            Err(_) => p.placement.spec.cluster_sets.clone(),
        };
        p.eligible = core::eligible_sets(&bound, &spec_sets);
        p.members.clear();
        p.always.clear();
        p.if_selected.clear();
        p.expiring.clear();
        for s in &p.eligible {
            if let Some(set) = self.sets.get(s) {
                for id in set.members.iter() {
                    p.members.set(id, true);
                }
            }
        }
        if let Ok(compiled) = &p.compiled {
            let passing = passing_predicates(compiled, &p.members, &self.labels, &self.claims);
            for id in passing.iter() {
                let Some((_, c)) = &self.clusters[id] else {
                    continue;
                };
                let v = core::admit(compiled, c, now);
                p.always.set(id, v.allowed == Allowed::Always);
                p.if_selected.set(id, v.allowed == Allowed::IfSelected);
                if let Some(t) = v.recheck_at.filter(|_| v.allowed != Allowed::Never) {
                    p.expiring.insert(id, t);
                }
            }
        }
        self.dirty.insert(key.clone());
    }

    // ---- scores ----

    /// An AddOnPlacementScore (in cluster namespace `namespace`) was added, changed or deleted.
    pub fn set_score(
        &mut self,
        namespace: &str,
        name: &str,
        status: Option<AddOnPlacementScoreStatus>,
    ) {
        let key = (namespace.to_string(), name.to_string());
        let changed = match status {
            Some(s) => self.scores.insert(key, s.clone()).as_ref() != Some(&s),
            None => self.scores.remove(&key).is_some(),
        };
        if !changed {
            return;
        }
        let Some(id) = self.ids.get(namespace).copied() else {
            return;
        };
        let keys: Vec<Key> = self
            .placements
            .iter()
            .filter(|(_, p)| {
                p.members.get(id)
                    && p.compiled
                        .as_ref()
                        .is_ok_and(|c| c.addon_resources().any(|r| r == name))
            })
            .map(|(k, _)| k.clone())
            .collect();
        self.dirty.extend(keys);
    }

    // ---- stored decisions ----

    /// A PlacementDecision of placement `key` is stored with these clusters (`None`: deleted):
    /// what a placement new to the model (the hub restarted) starts from.
    pub fn set_stored_decision(&mut self, key: &Key, object: &str, clusters: Option<Vec<String>>) {
        let objects = self.stored.entry(key.clone()).or_default();
        match clusters {
            Some(c) => {
                objects.insert(object.to_string(), c);
            }
            None => {
                objects.remove(object);
            }
        }
        if objects.is_empty() {
            self.stored.remove(key);
        }
    }

    // ---- deciding ----

    /// Decides for one placement from the model: what [`core::schedule`] would decide over the
    /// whole world. Updates the placement's current decisions to the result.
    pub fn decide(&mut self, key: &Key, now: Timestamp) -> Option<Outcome> {
        // Verdicts whose toleration has run out are decided again first.
        let expired: Vec<ClusterId> = self
            .placements
            .get(key)?
            .expiring
            .iter()
            .filter(|(_, t)| **t <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            self.refilter_one(key, id, now);
        }
        let bound = self.bound(&key.namespace).len();
        let p = self.placements.get(key)?;
        let name = key.name.clone();
        let mut report = Report {
            bindings: bound,
            eligible_sets: p.eligible.clone(),
            available: p.members.count(),
            ..Report::default()
        };
        let compiled = match &p.compiled {
            Ok(c) => c,
            Err(m) => {
                report.misconfigured = Some(m.clone());
                let objects = core::decision_objects(&name, &[core::Group::default()]);
                self.set_selected(key, Bits::default());
                return Some(Outcome {
                    objects,
                    report,
                    recheck_at: None,
                });
            }
        };
        // Candidates in name order, with their verdicts: a few are sorted, more are read off
        // the name index (walking all of it costs less than sorting a tenth of it).
        let candidates: Vec<(&Cluster, Verdict)> =
            if p.always.count() + p.if_selected.count() * 2 < self.by_name.len() / 64 {
                let mut ids: Vec<ClusterId> = p.always.iter().chain(p.if_selected.iter()).collect();
                ids.sort_unstable_by(|a, b| self.name_of(*a).cmp(self.name_of(*b)));
                ids.into_iter()
                    .filter_map(|id| self.candidate(p, id))
                    .collect()
            } else {
                self.by_name
                    .values()
                    .filter(|id| p.always.get(**id) || p.if_selected.get(**id))
                    .filter_map(|id| self.candidate(p, *id))
                    .collect()
            };
        let balance = compiled
            .prioritizers
            .iter()
            .any(|(pr, _)| *pr == core::Prioritizer::Balance)
            && compiled.truncates(candidates.len());
        let own = |id: ClusterId| u32::from(p.selected.get(id));
        let others_max = if balance {
            self.counts
                .iter()
                .enumerate()
                .map(|(id, c)| c.saturating_sub(own(id)))
                .max()
                .unwrap_or(0)
        } else {
            0
        };
        let selected = |c: &str| self.ids.get(c).is_some_and(|id| p.selected.get(*id));
        let others = |c: &str| {
            self.ids
                .get(c)
                .map_or(0, |id| self.counts[*id].saturating_sub(own(*id)))
        };
        let score =
            |ns: &str, resource: &str| self.scores.get(&(ns.to_string(), resource.to_string()));
        let inputs = RankingInputs {
            selected: &selected,
            others: &others,
            others_max,
            score: &score,
            now,
        };
        let selection = core::select(compiled, &candidates, &inputs);
        let chosen: Vec<&Cluster> = selection
            .clusters
            .iter()
            .filter_map(|n| self.ids.get(n.as_str()))
            .filter_map(|id| self.clusters[*id].as_ref().map(|(_, c)| c))
            .collect();
        let groups = core::group(compiled, &chosen);
        let objects: Vec<DecisionObject> = core::decision_objects(&name, &groups);
        let toleration_recheck = selection
            .clusters
            .iter()
            .filter_map(|n| self.ids.get(n.as_str()))
            .filter_map(|id| p.expiring.get(id).copied())
            .min();
        let recheck_at = [toleration_recheck, selection.recheck_at]
            .into_iter()
            .flatten()
            .min();
        let mut now_selected = Bits::default();
        for n in &selection.clusters {
            if let Some(id) = self.ids.get(n.as_str()) {
                now_selected.set(*id, true);
            }
        }
        report.selection = selection;
        self.set_selected(key, now_selected);
        Some(Outcome {
            objects,
            report,
            recheck_at,
        })
    }

    fn name_of(&self, id: ClusterId) -> &str {
        self.clusters[id].as_ref().map_or("", |(n, _)| n)
    }

    fn candidate<'a>(
        &'a self,
        p: &PlacementState,
        id: ClusterId,
    ) -> Option<(&'a Cluster, Verdict)> {
        let (_, c) = self.clusters[id].as_ref()?;
        let allowed = if p.always.get(id) {
            Allowed::Always
        } else {
            Allowed::IfSelected
        };
        Some((
            c,
            Verdict {
                allowed,
                recheck_at: p.expiring.get(&id).copied(),
            },
        ))
    }

    /// Bytes the model holds beyond the objects' own strings: bit sets and indexes. For the
    /// memory figure next to the process's RSS.
    pub fn approximate_bytes(&self) -> usize {
        let per_placement: usize = self
            .placements
            .values()
            .map(|p| {
                p.members.heap_bytes()
                    + p.always.heap_bytes()
                    + p.if_selected.heap_bytes()
                    + p.selected.heap_bytes()
                    + p.expiring.capacity() * 16
            })
            .sum();
        let sets: usize = self.sets.values().map(|s| s.members.heap_bytes()).sum();
        // Strings with a rough allocation overhead each, and ids in three indexes.
        let text = |s: &str| s.len() + 24;
        let clusters: usize = self
            .clusters
            .iter()
            .flatten()
            .map(|(name, c)| {
                3 * text(name)
                    + 128
                    + c.labels
                        .iter()
                        .chain(&c.claims)
                        .map(|(k, v)| text(k) + text(v))
                        .sum::<usize>()
            })
            .sum();
        let stored: usize = self
            .stored
            .values()
            .flat_map(BTreeMap::values)
            .flatten()
            .map(|c| text(c))
            .sum();
        per_placement
            + sets
            + clusters
            + stored
            + self.counts.capacity() * 4
            + self.labels.approximate_bytes()
            + self.claims.approximate_bytes()
    }
}

/// The members of `within` that pass any of the placement's predicates (all of them when it
/// has none), from the fleet's indexes: [`core::filter`]'s predicate check over a whole set.
fn passing_predicates(
    compiled: &Compiled,
    within: &Bits,
    labels: &LabelIndex,
    claims: &LabelIndex,
) -> Bits {
    if compiled.predicates.is_empty() {
        return within.clone();
    }
    let mut out = Bits::default();
    for p in &compiled.predicates {
        let by_labels = p.labels.matching(within, labels);
        out.unite(&p.claims.matching(&by_labels, claims));
    }
    out
}

#[cfg(test)]
mod tests {
    //! The model against the from-scratch decision: random histories of cluster, set, binding,
    //! placement and time changes; after each, every placement the model did not mark dirty
    //! must still be decided as before, and every dirty one exactly as [`core::schedule`] would.

    use std::collections::{BTreeMap, BTreeSet};

    use flotilla_proto::api::{ManagedClusterSetSpec, Placement};
    use jiff::Timestamp;
    use rand::{Rng, SeedableRng};
    use serde_json::json;

    use super::*;
    use crate::controllers::scheduling::core::{Outcome, SetRule, World, schedule};

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + secs).unwrap()
    }

    fn managed_cluster(name: &str, rng: &mut impl Rng, now: i64) -> ManagedCluster {
        let region = ["eu", "us", "ap"][rng.random_range(0..3)];
        let tier = ["gold", "silver"][rng.random_range(0..2)];
        let mut labels = json!({ "region": region, "tier": tier });
        if rng.random_bool(0.7) {
            labels["cluster.open-cluster-management.io/clusterset"] = "default".into();
        }
        if rng.random_bool(0.4) {
            labels["gpu"] = ["a100", "h100", ""][rng.random_range(0..3)].into();
        }
        let taints = match rng.random_range(0..6) {
            0 => {
                json!([{"key": "cluster.open-cluster-management.io/unreachable", "effect": "NoSelect",
                          "timeAdded": Time(at(now - rng.random_range(0..20)))}])
            }
            1 => json!([{"key": "drain", "effect": "NoSelectIfNew", "timeAdded": Time(at(now))}]),
            _ => json!([]),
        };
        let cpu = rng.random_range(1..16).to_string();
        serde_json::from_value(json!({
            "apiVersion": "cluster.open-cluster-management.io/v1", "kind": "ManagedCluster",
            "metadata": { "name": name, "labels": labels },
            "spec": { "hubAcceptsClient": true, "taints": taints },
            "status": { "allocatable": { "cpu": cpu }, "capacity": { "cpu": cpu },
                        "clusterClaims": [{"name": "tier.example.com", "value": tier}] },
        }))
        .unwrap()
    }

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn placement(name: &str, spec: serde_json::Value) -> Placement {
        serde_json::from_value(json!({
            "apiVersion": "cluster.open-cluster-management.io/v1beta1", "kind": "Placement",
            "metadata": { "name": name, "namespace": "ns", "uid": name },
            "spec": spec,
        }))
        .unwrap()
    }

    fn specs() -> Vec<serde_json::Value> {
        vec![
            json!({}),
            json!({"predicates": [{"requiredClusterSelector": {"labelSelector": {"matchLabels": {"region": "eu"}}}}]}),
            json!({"numberOfClusters": 3}),
            // Every operator, and predicates ORed: what the label and claim indexes answer.
            json!({"predicates": [
                {"requiredClusterSelector": {"labelSelector": {"matchExpressions": [
                    {"key": "region", "operator": "NotIn", "values": ["us"]},
                    {"key": "gpu", "operator": "Exists"}]}}},
                {"requiredClusterSelector": {
                    "labelSelector": {"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]},
                    "claimSelector": {"matchExpressions": [{"key": "tier.example.com", "operator": "NotIn", "values": ["gold"]}]}}}]}),
            json!({"predicates": [{"requiredClusterSelector": {"labelSelector": {"matchExpressions": [
                {"key": "gpu", "operator": "In", "values": ["a100", "h100"]}]}}}]}),
            json!({"numberOfClusters": 2, "tolerations": [{"key": "cluster.open-cluster-management.io/unreachable", "operator": "Exists", "tolerationSeconds": 10}]}),
            json!({"clusterSets": ["eu"], "predicates": [{"requiredClusterSelector": {"claimSelector": {"matchExpressions": [{"key": "tier.example.com", "operator": "In", "values": ["gold"]}]}}}]}),
            json!({"numberOfClusters": 2, "prioritizerPolicy": {"mode": "Exact", "configurations": [{"scoreCoordinate": {"type": "BuiltIn", "builtIn": "ResourceAllocatableCPU"}}]}}),
            json!({"clusterSets": ["default"], "decisionStrategy": {"groupStrategy": {"clustersPerDecisionGroup": 2, "decisionGroups": [{"groupName": "gold", "groupClusterSelector": {"labelSelector": {"matchLabels": {"tier": "gold"}}}}]}}}),
        ]
    }

    /// The world as plain data, to decide from scratch.
    #[derive(Default)]
    struct Mirror {
        clusters: BTreeMap<String, ManagedCluster>,
        sets: BTreeMap<String, ManagedClusterSetSpec>,
        bound: BTreeSet<String>,
        placements: BTreeMap<String, Placement>,
        /// Each placement's last decision (what the model treats as selected).
        last: BTreeMap<String, Outcome>,
    }

    impl Mirror {
        fn schedule(&self, name: &str, now: Timestamp) -> Outcome {
            let clusters: Vec<Cluster> = self
                .clusters
                .values()
                .map(Cluster::from_managed_cluster)
                .collect();
            let sets: BTreeMap<String, SetRule> = self
                .sets
                .iter()
                .map(|(n, s)| (n.clone(), SetRule::from_spec(n, s).0))
                .collect();
            let bound: BTreeSet<String> = self
                .bound
                .iter()
                .filter(|s| self.sets.contains_key(*s))
                .cloned()
                .collect();
            let selected: BTreeSet<String> = self
                .last
                .get(name)
                .map(|o| o.report.selection.clusters.iter().cloned().collect())
                .unwrap_or_default();
            // Balance counts the other placements' current decisions.
            let mut others: BTreeMap<String, u32> = BTreeMap::new();
            for (other, o) in &self.last {
                if other != name && self.placements.contains_key(other) {
                    for c in &o.report.selection.clusters {
                        if self.clusters.contains_key(c) {
                            *others.entry(c.clone()).or_default() += 1;
                        }
                    }
                }
            }
            schedule(
                &self.placements[name],
                &World {
                    clusters: &clusters,
                    sets: &sets,
                    bound: &bound,
                    selected: &selected,
                    others: &others,
                    scores: &BTreeMap::new(),
                    now,
                },
            )
        }
    }

    fn ranked_by_balance(p: &Placement) -> bool {
        core::compile(p).is_ok_and(|c| {
            c.number_of_clusters.is_some()
                && c.prioritizers
                    .iter()
                    .any(|(p, _)| *p == core::Prioritizer::Balance)
        })
    }

    fn set_spec(selector: serde_json::Value) -> ManagedClusterSetSpec {
        serde_json::from_value(json!({ "clusterSelector": selector })).unwrap()
    }

    #[test]
    fn the_model_decides_as_a_full_pass_would_on_random_histories() {
        for seed in 0..20u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut fleet = Fleet::new();
            let mut mirror = Mirror::default();
            let mut now = 0i64;
            for (name, selector) in [
                (
                    "global",
                    json!({"selectorType": "LabelSelector", "labelSelector": {}}),
                ),
                (
                    "default",
                    json!({"selectorType": "ExclusiveClusterSetLabel"}),
                ),
                (
                    "eu",
                    json!({"selectorType": "LabelSelector", "labelSelector": {"matchLabels": {"region": "eu"}}}),
                ),
            ] {
                let spec = set_spec(selector);
                fleet.upsert_set(name, &spec, at(now));
                mirror.sets.insert(name.to_string(), spec);
            }
            for (i, spec) in specs().into_iter().enumerate() {
                let p = placement(&format!("p{i}"), spec);
                fleet.upsert_placement(&p, at(now));
                mirror.placements.insert(format!("p{i}"), p);
            }
            for step in 0..150 {
                match rng.random_range(0..10) {
                    0..=4 => {
                        let name = format!("c{:02}", rng.random_range(0..20));
                        let mc = managed_cluster(&name, &mut rng, now);
                        fleet.upsert_cluster(&mc, at(now));
                        mirror.clusters.insert(name, mc);
                    }
                    5 => {
                        let name = format!("c{:02}", rng.random_range(0..20));
                        fleet.delete_cluster(&name, at(now));
                        mirror.clusters.remove(&name);
                    }
                    6 => {
                        let set = ["global", "default", "eu"][rng.random_range(0..3)];
                        if mirror.bound.insert(set.to_string()) {
                            fleet.upsert_binding("ns", set, set, at(now));
                        } else {
                            mirror.bound.remove(set);
                            fleet.delete_binding("ns", set, at(now));
                        }
                    }
                    7 => {
                        let specs = specs();
                        let i = rng.random_range(0..specs.len());
                        let name = format!("p{}", rng.random_range(0..specs.len()));
                        let p = placement(&name, specs[i].clone());
                        fleet.upsert_placement(&p, at(now));
                        mirror.placements.insert(name, p);
                    }
                    _ => {
                        now += rng.random_range(1..8);
                        // The driver's recheck timer: placements whose decision runs out now.
                        let due: Vec<String> = mirror
                            .last
                            .iter()
                            .filter(|(_, o)| o.recheck_at.is_some_and(|t| t <= at(now)))
                            .map(|(n, _)| n.clone())
                            .collect();
                        for name in due {
                            fleet.refilter(&Key::new("ns", &name), at(now));
                        }
                    }
                }
                let dirty = fleet.take_dirty();
                for name in mirror.placements.keys().cloned().collect::<Vec<_>>() {
                    let key = Key::new("ns", &name);
                    let full = mirror.schedule(&name, at(now));
                    if dirty.contains(&key) || !mirror.last.contains_key(&name) {
                        let model = fleet.decide(&key, at(now)).unwrap();
                        assert_eq!(
                            model.objects, full.objects,
                            "seed {seed} step {step} {name}"
                        );
                        assert_eq!(model.report, full.report, "seed {seed} step {step} {name}");
                        mirror.last.insert(name, model);
                    } else if !ranked_by_balance(&mirror.placements[&name]) {
                        // (A placement that ranks by Balance may rank differently once others
                        // decided; like OCM, it is not decided again for that alone.)
                        assert_eq!(
                            mirror.last[&name].objects, full.objects,
                            "seed {seed} step {step}: {name} changed but was not marked dirty"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_placement_keeps_its_stored_decisions_across_a_restart() {
        // A new model (the hub restarted) reads the stored decisions before deciding: Steady
        // keeps the cluster the placement had, though another sorts first.
        let mut fleet = Fleet::new();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        fleet.upsert_set(
            "global",
            &set_spec(json!({"selectorType": "LabelSelector", "labelSelector": {}})),
            at(0),
        );
        fleet.upsert_binding("ns", "global", "global", at(0));
        let key = Key::new("ns", "p");
        fleet.set_stored_decision(&key, "p-decision-1", Some(vec!["b".into()]));
        fleet.upsert_placement(&placement("p", json!({"numberOfClusters": 1})), at(0));
        for name in ["a", "b"] {
            let mut mc = managed_cluster(name, &mut rng, 0);
            mc.spec.taints.clear();
            fleet.upsert_cluster(&mc, at(0));
        }
        let o = fleet.decide(&key, at(0)).unwrap();
        assert_eq!(o.report.selection.clusters, ["b"]);
    }

    #[test]
    fn bits_set_count_and_iterate() {
        let mut b = Bits::default();
        assert!(b.set(3, true));
        assert!(!b.set(3, true));
        assert!(b.set(200, true));
        assert!(!b.set(1000, false));
        assert_eq!(b.iter().collect::<Vec<_>>(), [3, 200]);
        assert_eq!(b.count(), 2);
        assert!(b.set(3, false));
        assert!(!b.get(3) && b.get(200));
    }
}
