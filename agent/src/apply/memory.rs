//! An in-memory [`ApplyTarget`]: a map of objects and a table of kinds. Unit tests use it, and
//! the load-test puts one behind each simulated agent. It is not an apiserver: apply replaces
//! the object whole, and nothing is validated except what a test asks to reject.

use std::collections::{BTreeMap, HashMap};

use async_trait::async_trait;
use serde_json::Value;
use tokio::sync::Mutex;

use super::{ApplyError, ApplyTarget, Deletion, ResourceKind};
use crate::cache::AppliedResource;

/// A simulated spoke cluster.
#[derive(Debug, Default)]
pub struct MemoryCluster {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// apiVersion → kind → resource.
    kinds: HashMap<String, HashMap<String, ResourceKind>>,
    objects: BTreeMap<AppliedResource, Value>,
    /// Object name → (HTTP code, message) its apply fails with.
    rejects: HashMap<String, (u16, String)>,
    /// Whether every call fails as if the apiserver were down.
    down: bool,
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
            state: Mutex::new(state),
        }
    }

    /// The object as last applied, if present.
    pub async fn get(&self, resource: &AppliedResource) -> Option<Value> {
        self.state.lock().await.objects.get(resource).cloned()
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
}

impl State {
    fn add_kind(&mut self, api_version: &str, kind: &str, resource: &str, namespaced: bool) {
        let (group, version) = super::split_api_version(api_version);
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

    async fn apply(&self, resource: &AppliedResource, manifest: &Value) -> Result<(), ApplyError> {
        let mut state = self.state.lock().await;
        state.check_up()?;
        if let Some((code, message)) = state.rejects.get(&resource.name) {
            return Err(ApplyError::Rejected {
                code: *code,
                reason: "Invalid".into(),
                message: message.clone(),
            });
        }
        if resource.kind == "CustomResourceDefinition" {
            state.serve_crd(manifest);
        }
        state.objects.insert(resource.clone(), manifest.clone());
        Ok(())
    }

    async fn exists(&self, resource: &AppliedResource) -> Result<bool, ApplyError> {
        let state = self.state.lock().await;
        state.check_up()?;
        Ok(state.objects.contains_key(resource))
    }

    async fn delete(&self, resource: &AppliedResource) -> Result<Deletion, ApplyError> {
        let mut state = self.state.lock().await;
        state.check_up()?;
        state.objects.remove(resource);
        Ok(Deletion::Gone)
    }
}
