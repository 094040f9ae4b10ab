//! Watching applied objects for status: feedback values and condition rules follow the spoke
//! as it changes, not only when the agent applies.
//!
//! [`AppliedWatch`] keeps, per work, the outcome of its last apply, and runs **one watch per
//! resource type in use** (not one per object) for the objects whose status needs their content
//! (a manifest with feedback or condition rules). A change to such an object updates the
//! outcomes of the works that applied it and marks those works dirty; the reconciler turns a
//! dirty work into a new status, at most once per work per interval (see
//! [`crate::reconcile::ReconcilerConfig::feedback_interval`]), so a flapping resource costs the
//! session one status per interval, carrying its latest state.
//!
//! A watch starts with the first work that needs its type and stops with the last. Bounded: the
//! works and objects held are those in the cache; watch streams buffer in their own bounded
//! channels.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use futures::StreamExt as _;
use tokio::sync::{Mutex, Notify};
use tokio::task::AbortHandle;
use tracing::debug;

use crate::apply::{ApplyTarget, Availability, ManifestOutcome, ObjectEvent, ResourceKind};
use crate::cache::AppliedResource;

/// A resource type, as watches are keyed.
type TypeKey = (String, String, String);

fn type_key(r: &AppliedResource) -> TypeKey {
    (r.group.clone(), r.version.clone(), r.resource.clone())
}

/// What a work's last apply left, kept for status refreshes between applies.
#[derive(Clone, Debug)]
pub struct AppliedView {
    /// The generation applied.
    pub generation: i64,
    /// Per manifest, with objects as the watches last saw them.
    pub outcomes: Vec<ManifestOutcome>,
}

/// See the module docs.
pub struct AppliedWatch {
    target: Arc<dyn ApplyTarget>,
    state: Arc<Mutex<State>>,
    /// Woken when a work turns dirty.
    dirty_changed: Arc<Notify>,
}

impl std::fmt::Debug for AppliedWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppliedWatch").finish_non_exhaustive()
    }
}

#[derive(Default)]
struct State {
    works: HashMap<String, AppliedView>,
    /// Object → the works whose status reads it.
    interest: BTreeMap<AppliedResource, BTreeSet<String>>,
    /// Running watches by type.
    watches: HashMap<TypeKey, AbortHandle>,
    /// Works whose objects changed since their last status.
    dirty: BTreeSet<String>,
}

impl AppliedWatch {
    /// Watches on `target`; `dirty_changed` is woken when a work needs a new status.
    pub fn new(target: Arc<dyn ApplyTarget>, dirty_changed: Arc<Notify>) -> AppliedWatch {
        AppliedWatch {
            target,
            state: Arc::new(Mutex::new(State::default())),
            dirty_changed,
        }
    }

    /// Records what applying a work gave, and watches what its status reads.
    pub async fn record(&self, uid: &str, generation: i64, outcomes: &[ManifestOutcome]) {
        let mut state = self.state.lock().await;
        state.works.insert(
            uid.to_owned(),
            AppliedView {
                generation,
                outcomes: outcomes.to_vec(),
            },
        );
        // The status just made is current.
        state.dirty.remove(uid);
        let wanted: HashSet<AppliedResource> = outcomes
            .iter()
            .filter(|o| o.rules.read_object())
            .filter_map(|o| o.resource.clone())
            .collect();
        for (resource, works) in state.interest.iter_mut() {
            if !wanted.contains(resource) {
                works.remove(uid);
            }
        }
        for resource in wanted {
            state
                .interest
                .entry(resource)
                .or_default()
                .insert(uid.to_owned());
        }
        self.retune(&mut state);
    }

    /// Forgets a work (removed from the cache).
    pub async fn forget(&self, uid: &str) {
        let mut state = self.state.lock().await;
        state.works.remove(uid);
        state.dirty.remove(uid);
        for works in state.interest.values_mut() {
            works.remove(uid);
        }
        self.retune(&mut state);
    }

    /// Takes the works that need a new status, with what it is made from.
    pub async fn take_dirty(&self) -> Vec<(String, AppliedView)> {
        let mut state = self.state.lock().await;
        let dirty = std::mem::take(&mut state.dirty);
        dirty
            .into_iter()
            .filter_map(|uid| {
                let view = state.works.get(&uid)?.clone();
                Some((uid, view))
            })
            .collect()
    }

    /// Marks a work dirty again (its refresh had to wait).
    pub async fn mark_dirty(&self, uid: &str) {
        self.state.lock().await.dirty.insert(uid.to_owned());
    }

    /// Types watched now (for tests and logs).
    pub async fn watched_types(&self) -> usize {
        self.state.lock().await.watches.len()
    }

    /// Starts the watches a type newly needs and stops those no work needs any more.
    fn retune(&self, state: &mut State) {
        state.interest.retain(|_, works| !works.is_empty());
        let needed: HashMap<TypeKey, ResourceKind> = state
            .interest
            .keys()
            .map(|r| {
                (
                    type_key(r),
                    ResourceKind {
                        group: r.group.clone(),
                        version: r.version.clone(),
                        kind: r.kind.clone(),
                        resource: r.resource.clone(),
                        namespaced: !r.namespace.is_empty(),
                    },
                )
            })
            .collect();
        state.watches.retain(|key, handle| {
            let keep = needed.contains_key(key);
            if !keep {
                debug!(resource = %key.2, "no work reads this type any more; watch stopped");
                handle.abort();
            }
            keep
        });
        for (key, kind) in needed {
            if state.watches.contains_key(&key) {
                continue;
            }
            debug!(resource = %kind.resource, group = %kind.group, "watching applied objects of this type");
            let events = self.target.watch(&kind);
            let shared = Arc::clone(&self.state);
            let notify = Arc::clone(&self.dirty_changed);
            let task = tokio::spawn(async move {
                let mut events = events;
                while let Some(event) = events.next().await {
                    if observe(&shared, &kind, event).await {
                        notify.notify_one();
                    }
                }
            });
            state.watches.insert(key, task.abort_handle());
        }
    }
}

impl Drop for AppliedWatch {
    fn drop(&mut self) {
        if let Ok(state) = self.state.try_lock() {
            for handle in state.watches.values() {
                handle.abort();
            }
        }
    }
}

/// Applies one watch event to the works that read the object; whether any turned dirty.
async fn observe(state: &Mutex<State>, kind: &ResourceKind, event: ObjectEvent) -> bool {
    let (namespace, name, object) = match event {
        ObjectEvent::Changed(object) => {
            let meta = &object["metadata"];
            (
                meta["namespace"].as_str().unwrap_or("").to_owned(),
                meta["name"].as_str().unwrap_or("").to_owned(),
                Some(object),
            )
        }
        ObjectEvent::Deleted { namespace, name } => (namespace, name, None),
        // The list's objects came as changes; a status reads only objects that exist.
        ObjectEvent::Listed => return false,
    };
    let resource = AppliedResource {
        group: kind.group.clone(),
        version: kind.version.clone(),
        kind: kind.kind.clone(),
        resource: kind.resource.clone(),
        namespace,
        name,
    };
    let mut state = state.lock().await;
    let Some(works) = state.interest.get(&resource).cloned() else {
        return false;
    };
    let mut any = false;
    for uid in works {
        let Some(view) = state.works.get_mut(&uid) else {
            continue;
        };
        let mut changed = false;
        for outcome in &mut view.outcomes {
            if outcome.resource.as_ref() != Some(&resource) {
                continue;
            }
            let available = if object.is_some() {
                Availability::Exists
            } else {
                Availability::Missing
            };
            if outcome.object != object || outcome.available != available {
                outcome.object = object.clone();
                outcome.available = available;
                changed = true;
            }
        }
        if changed {
            state.dirty.insert(uid);
            any = true;
        }
    }
    any
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::{ApplyContext, MemoryCluster, apply_planned, plan_manifests};
    use flotilla_proto::api::ManifestWorkSpec;
    use serde_json::json;
    use std::time::Duration;

    fn spec(with_rules: bool) -> ManifestWorkSpec {
        let mut spec = json!({"workload": {"manifests": [
            {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "namespace": "default"}, "spec": {"replicas": 1}},
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg", "namespace": "default"}},
        ]}});
        if with_rules {
            spec["manifestConfigs"] = json!([{
                "resourceIdentifier": {"group": "apps", "resource": "deployments", "namespace": "default", "name": "web"},
                "feedbackRules": [{"type": "WellKnownStatus"}],
            }]);
        }
        serde_json::from_value(spec).unwrap()
    }

    #[tokio::test]
    async fn a_status_change_marks_the_work_dirty_with_the_new_object() {
        let cluster = Arc::new(MemoryCluster::new());
        let notify = Arc::new(Notify::new());
        let watch = AppliedWatch::new(cluster.clone(), notify.clone());
        let planned = plan_manifests(cluster.as_ref(), &spec(true)).await;
        let outcomes = apply_planned(cluster.as_ref(), &planned, &ApplyContext::default()).await;
        watch.record("w1", 3, &outcomes).await;
        assert_eq!(watch.watched_types().await, 1, "only the type with rules");
        let web = outcomes[0].resource.clone().unwrap();
        assert!(cluster.set_status(&web, json!({"readyReplicas": 1})).await);
        tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                notify.notified().await;
                let dirty = watch.take_dirty().await;
                if let Some((uid, view)) = dirty.into_iter().next() {
                    assert_eq!((uid.as_str(), view.generation), ("w1", 3));
                    let seen = view.outcomes[0].object.as_ref().unwrap();
                    if seen["status"]["readyReplicas"] == 1 {
                        return;
                    }
                }
            }
        })
        .await
        .expect("the change reaches the work");

        // A work without rules watches nothing; forgetting the last reader stops the watch.
        let planned = plan_manifests(cluster.as_ref(), &spec(false)).await;
        let plain = apply_planned(cluster.as_ref(), &planned, &ApplyContext::default()).await;
        watch.record("w1", 4, &plain).await;
        assert_eq!(watch.watched_types().await, 0);
        watch.record("w2", 1, &outcomes).await;
        assert_eq!(watch.watched_types().await, 1);
        watch.forget("w2").await;
        assert_eq!(watch.watched_types().await, 0);
    }
}
