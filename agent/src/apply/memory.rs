//! An in-memory [`ApplyTarget`]: a map of objects and a table of kinds. Unit tests use it, and
//! the load-test puts one behind each simulated agent. It is not an apiserver: apply replaces
//! the object whole (keeping its status, which only [`MemoryCluster::set_status`] writes),
//! nothing is validated except what a test asks to reject, and every access review is allowed
//! unless a test denies it. Watches see every change, as on an apiserver.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use async_trait::async_trait;
use futures::stream::{self, BoxStream, StreamExt as _};
use serde_json::Value;
use tokio::sync::{Mutex, broadcast};

use super::target::{AccessCheck, ApplyError, ApplyTarget, Deletion, ObjectEvent, ResourceKind};
use crate::cache::AppliedResource;

/// Changes buffered per watcher; one that falls further behind is sent the whole kind again.
const WATCH_BUFFER: usize = 64;

/// A simulated spoke cluster.
#[derive(Debug)]
pub struct MemoryCluster {
    /// Shared with the watches, which list from it.
    state: Arc<Mutex<State>>,
    /// Every change, for watches.
    changes: broadcast::Sender<Change>,
}

/// An object written (as stored, shared with the map: the channel keeps its last
/// [`WATCH_BUFFER`] changes, which must not be copies of a cluster's objects) or deleted.
type Change = (AppliedResource, Option<Arc<Value>>);

impl Default for MemoryCluster {
    fn default() -> Self {
        MemoryCluster::new()
    }
}

#[derive(Debug, Default)]
struct State {
    /// apiVersion → kind → resource.
    kinds: HashMap<String, HashMap<String, ResourceKind>>,
    objects: BTreeMap<AppliedResource, Arc<Value>>,
    /// Object name → (HTTP code, message) its apply fails with.
    rejects: HashMap<String, (u16, String)>,
    /// Whether every call fails as if the apiserver were down.
    down: bool,
    /// (user, verb) pairs access reviews refuse.
    denied: HashSet<(String, String)>,
    /// Objects created so far, for their uids.
    created: u64,
}

/// Kinds every cluster serves: (apiVersion, kind, resource, namespaced).
const BUILT_IN: &[(&str, &str, &str, bool)] = &[
    ("v1", "Namespace", "namespaces", false),
    ("v1", "ConfigMap", "configmaps", true),
    ("v1", "Secret", "secrets", true),
    ("v1", "Service", "services", true),
    ("v1", "ServiceAccount", "serviceaccounts", true),
    ("apps/v1", "Deployment", "deployments", true),
    ("apps/v1", "DaemonSet", "daemonsets", true),
    ("apps/v1", "StatefulSet", "statefulsets", true),
    ("batch/v1", "Job", "jobs", true),
    ("v1", "Pod", "pods", true),
    (
        "rbac.authorization.k8s.io/v1",
        "ClusterRole",
        "clusterroles",
        false,
    ),
    ("rbac.authorization.k8s.io/v1", "Role", "roles", true),
    (
        "apiextensions.k8s.io/v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
        false,
    ),
];

impl MemoryCluster {
    /// An empty cluster that serves the common built-in kinds.
    pub fn new() -> Self {
        let mut state = State::default();
        for (api_version, kind, resource, namespaced) in BUILT_IN {
            state.add_kind(api_version, kind, resource, *namespaced);
        }
        Self {
            state: Arc::new(Mutex::new(state)),
            changes: broadcast::channel(WATCH_BUFFER).0,
        }
    }

    /// The object as last applied, if present.
    pub async fn get(&self, resource: &AppliedResource) -> Option<Value> {
        let state = self.state.lock().await;
        state.objects.get(resource).map(|o| Value::clone(o))
    }

    /// Every object present.
    pub async fn objects(&self) -> Vec<AppliedResource> {
        self.state.lock().await.objects.keys().cloned().collect()
    }

    /// Removes an object behind the agent's back (drift).
    pub async fn remove(&self, resource: &AppliedResource) -> bool {
        self.state.lock().await.objects.remove(resource).is_some()
    }

    /// Makes applies of objects named `name` fail with `code` and `message`.
    pub async fn reject(&self, name: &str, code: u16, message: &str) {
        self.state
            .lock()
            .await
            .rejects
            .insert(name.to_owned(), (code, message.to_owned()));
    }

    /// [`MemoryCluster::reject`] for a cluster no task uses yet (while it is being built).
    pub fn reject_now(&self, name: &str, code: u16, message: &str) {
        if let Ok(mut state) = self.state.try_lock() {
            state
                .rejects
                .insert(name.to_owned(), (code, message.to_owned()));
        }
    }

    /// Makes every call fail as if the apiserver were unreachable, or stop doing so.
    pub async fn set_down(&self, down: bool) {
        self.state.lock().await.down = down;
    }

    /// Makes access reviews of `user` doing `verb` answer no.
    pub async fn deny(&self, user: &str, verb: &str) {
        self.state
            .lock()
            .await
            .denied
            .insert((user.to_owned(), verb.to_owned()));
    }

    /// Writes the object's status, as a controller on the spoke would; `false` when there is
    /// no such object.
    pub async fn set_status(&self, resource: &AppliedResource, status: Value) -> bool {
        let mut state = self.state.lock().await;
        let Some(object) = state.objects.get_mut(resource) else {
            return false;
        };
        Arc::make_mut(object)["status"] = status;
        let object = object.clone();
        drop(state);
        self.changed(resource, Some(object));
        true
    }

    /// Tells the watches: `object` as it now is, `None` when deleted.
    fn changed(&self, resource: &AppliedResource, object: Option<Arc<Value>>) {
        // No receiver is fine: nobody watches.
        let _ = self.changes.send((resource.clone(), object));
    }
}

impl State {
    fn add_kind(&mut self, api_version: &str, kind: &str, resource: &str, namespaced: bool) {
        let (group, version) = super::target::split_api_version(api_version);
        self.kinds
            .entry(api_version.to_owned())
            .or_default()
            .insert(
                kind.to_owned(),
                ResourceKind {
                    group,
                    version,
                    kind: kind.to_owned(),
                    resource: resource.to_owned(),
                    namespaced,
                },
            );
    }

    fn check_up(&self) -> Result<(), ApplyError> {
        if self.down {
            return Err(ApplyError::Unreachable(
                "connection refused (simulated)".into(),
            ));
        }
        Ok(())
    }

    /// A CRD makes its kinds served, as the apiextensions apiserver would once Established.
    fn serve_crd(&mut self, crd: &Value) {
        let spec = &crd["spec"];
        let (Some(group), Some(kind), Some(plural)) = (
            spec["group"].as_str(),
            spec["names"]["kind"].as_str(),
            spec["names"]["plural"].as_str(),
        ) else {
            return;
        };
        let namespaced = spec["scope"].as_str() != Some("Cluster");
        let versions: Vec<String> = spec["versions"]
            .as_array()
            .map(|vs| {
                vs.iter()
                    .filter_map(|v| v["name"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        for version in versions {
            self.add_kind(&format!("{group}/{version}"), kind, plural, namespaced);
        }
    }
}

#[async_trait]
impl ApplyTarget for MemoryCluster {
    async fn resolve(&self, api_version: &str, kind: &str) -> Result<ResourceKind, ApplyError> {
        let state = self.state.lock().await;
        state.check_up()?;
        let unknown = |detail: &str| ApplyError::UnknownKind {
            api_version: api_version.to_owned(),
            kind: kind.to_owned(),
            detail: detail.to_owned(),
        };
        let kinds = state
            .kinds
            .get(api_version)
            .ok_or_else(|| unknown("no such group version"))?;
        kinds
            .get(kind)
            .cloned()
            .ok_or_else(|| unknown("no such kind"))
    }

    async fn apply(
        &self,
        resource: &AppliedResource,
        manifest: &Value,
        _field_manager: &str,
        _force: bool,
    ) -> Result<Value, ApplyError> {
        self.write(resource, manifest, Write::Apply).await
    }

    async fn create(
        &self,
        resource: &AppliedResource,
        object: &Value,
        _field_manager: &str,
    ) -> Result<Value, ApplyError> {
        self.write(resource, object, Write::Create).await
    }

    async fn replace(
        &self,
        resource: &AppliedResource,
        object: &Value,
        _field_manager: &str,
    ) -> Result<Value, ApplyError> {
        self.write(resource, object, Write::Replace).await
    }

    async fn get(&self, resource: &AppliedResource) -> Result<Option<Value>, ApplyError> {
        let state = self.state.lock().await;
        state.check_up()?;
        Ok(state.objects.get(resource).map(|o| Value::clone(o)))
    }

    async fn list(
        &self,
        kind: &ResourceKind,
        namespace: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Value>, ApplyError> {
        let state = self.state.lock().await;
        state.check_up()?;
        let objects: Vec<Value> = state
            .objects
            .iter()
            .filter(|(r, _)| {
                r.group == kind.group
                    && r.version == kind.version
                    && r.resource == kind.resource
                    && namespace.is_none_or(|ns| r.namespace == ns)
            })
            .map(|(_, object)| Value::clone(object))
            .collect();
        if objects.len() > limit {
            return Err(ApplyError::TooMany {
                resource: kind.resource.clone(),
                location: namespace
                    .map(|ns| format!(" in namespace {ns}"))
                    .unwrap_or_default(),
                limit,
            });
        }
        Ok(objects)
    }

    async fn exists(&self, resource: &AppliedResource) -> Result<bool, ApplyError> {
        let state = self.state.lock().await;
        state.check_up()?;
        Ok(state.objects.contains_key(resource))
    }

    async fn delete(&self, resource: &AppliedResource) -> Result<Deletion, ApplyError> {
        let mut state = self.state.lock().await;
        state.check_up()?;
        if state.objects.remove(resource).is_some() {
            drop(state);
            self.changed(resource, None);
        }
        Ok(Deletion::Gone)
    }

    async fn review_access(&self, check: &AccessCheck) -> Result<bool, ApplyError> {
        let state = self.state.lock().await;
        state.check_up()?;
        Ok(!state
            .denied
            .contains(&(check.user.clone(), check.verb.clone())))
    }

    /// Refused, as the apiserver refuses an escalation, for a user denied `escalate`.
    async fn dry_run_as(
        &self,
        user: &str,
        resource: &AppliedResource,
        _manifest: &Value,
        _field_manager: &str,
    ) -> Result<(), ApplyError> {
        let state = self.state.lock().await;
        state.check_up()?;
        if state
            .denied
            .contains(&(user.to_owned(), "escalate".to_owned()))
        {
            return Err(ApplyError::Rejected {
                code: 403,
                reason: "Forbidden".into(),
                message: format!(
                    "{} {:?} is forbidden: user {user:?} is attempting to grant RBAC permissions not currently held",
                    resource.resource, resource.name
                ),
            });
        }
        Ok(())
    }

    fn watch(&self, kind: &ResourceKind) -> BoxStream<'static, ObjectEvent> {
        let watch = KindWatch {
            kind: kind.clone(),
            state: self.state.clone(),
            // Subscribed before the first list: no change falls between the two.
            changes: self.changes.subscribe(),
            queued: VecDeque::new(),
            relist: true,
        };
        stream::unfold(watch, |mut watch| async move {
            let event = watch.next().await?;
            Some((event, watch))
        })
        .boxed()
    }
}

/// One watch of a kind: the kind's objects and `Listed` first, then every change of the kind;
/// one that falls more than [`WATCH_BUFFER`] changes behind lists the kind again, as a
/// reflector re-lists after its watch expired.
struct KindWatch {
    kind: ResourceKind,
    state: Arc<Mutex<State>>,
    changes: broadcast::Receiver<Change>,
    /// A list not yet handed out.
    queued: VecDeque<ObjectEvent>,
    relist: bool,
}

impl KindWatch {
    fn matches(&self, r: &AppliedResource) -> bool {
        r.group == self.kind.group
            && r.version == self.kind.version
            && r.resource == self.kind.resource
    }

    async fn next(&mut self) -> Option<ObjectEvent> {
        loop {
            if let Some(event) = self.queued.pop_front() {
                return Some(event);
            }
            if self.relist {
                self.relist = false;
                let state = self.state.lock().await;
                let mut listed: VecDeque<ObjectEvent> = state
                    .objects
                    .iter()
                    .filter(|(r, _)| self.matches(r))
                    .map(|(_, o)| ObjectEvent::Changed(Value::clone(o)))
                    .collect();
                drop(state);
                listed.push_back(ObjectEvent::Listed);
                self.queued = listed;
                continue;
            }
            match self.changes.recv().await {
                Ok((r, change)) if self.matches(&r) => {
                    return Some(match change {
                        Some(object) => ObjectEvent::Changed(Value::clone(&object)),
                        None => ObjectEvent::Deleted {
                            namespace: r.namespace,
                            name: r.name,
                        },
                    });
                }
                Ok(_) => {}
                Err(broadcast::error::RecvError::Lagged(_)) => self.relist = true,
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

/// Which write [`MemoryCluster::write`] makes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Write {
    Apply,
    Create,
    Replace,
}

impl MemoryCluster {
    async fn write(
        &self,
        resource: &AppliedResource,
        manifest: &Value,
        how: Write,
    ) -> Result<Value, ApplyError> {
        let mut state = self.state.lock().await;
        state.check_up()?;
        if let Some((code, message)) = state.rejects.get(&resource.name) {
            return Err(ApplyError::Rejected {
                code: *code,
                reason: "Invalid".into(),
                message: message.clone(),
            });
        }
        let existing = state.objects.get(resource).cloned();
        match (how, &existing) {
            (Write::Create, Some(_)) => {
                return Err(ApplyError::Rejected {
                    code: 409,
                    reason: "AlreadyExists".into(),
                    message: format!("{resource} already exists"),
                });
            }
            (Write::Replace, None) => {
                return Err(ApplyError::Rejected {
                    code: 404,
                    reason: "NotFound".into(),
                    message: format!("{resource} not found"),
                });
            }
            _ => {}
        }
        if resource.kind == "CustomResourceDefinition" {
            state.serve_crd(manifest);
        }
        let mut object = manifest.clone();
        // Status is the spoke's: a write of the spec keeps it.
        if let Some(status) = existing.as_ref().and_then(|e| e.get("status")).cloned() {
            object["status"] = status;
        }
        // An object has a uid from its creation on, as on an apiserver: what tells a
        // re-created object from the one before (pruning by uid depends on it).
        let uid = match existing
            .as_ref()
            .and_then(|e| e.pointer("/metadata/uid"))
            .cloned()
        {
            Some(uid) => uid,
            None => {
                state.created += 1;
                Value::String(format!("memory-{}", state.created))
            }
        };
        if let Some(metadata) = object.get_mut("metadata").and_then(Value::as_object_mut) {
            metadata.insert("uid".to_owned(), uid);
        }
        let unchanged = existing.as_deref() == Some(&object);
        let object = Arc::new(object);
        state.objects.insert(resource.clone(), object.clone());
        drop(state);
        let written = Value::clone(&object);
        if !unchanged {
            self.changed(resource, Some(object));
        }
        Ok(written)
    }
}
