//! Applying a work's manifests to the spoke cluster, and removing them.
//!
//! The engine ([`plan_manifests`], [`apply_planned`]) is written against [`ApplyTarget`], the
//! few calls it needs from a cluster: resolve a kind, server-side apply, check existence, delete.
//! [`KubeApplyTarget`] is the real one (kube-rs against the spoke apiserver);
//! [`MemoryCluster`] is an in-memory one for unit tests and for the load-test's simulated
//! clusters.
//!
//! Semantics follow OCM's work agent: manifests are applied in order, Namespaces and CRDs first;
//! each manifest gets its own result, and one failing manifest never stops the others; the
//! spoke apiserver's error is reported verbatim.

mod memory;

use std::collections::HashMap;
use std::fmt;

use async_trait::async_trait;
use flotilla_proto::api::{Manifest, ManifestResourceMeta};
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::Value;
use tokio::sync::RwLock;

pub use memory::MemoryCluster;

use crate::cache::AppliedResource;

/// The field manager of every server-side apply the agent makes.
pub const FIELD_MANAGER: &str = "flotilla-agent";

/// What a kind resolves to on the spoke.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceKind {
    /// API group; empty for the core group.
    pub group: String,
    /// API version.
    pub version: String,
    /// Kind.
    pub kind: String,
    /// Resource (plural, lower-case).
    pub resource: String,
    /// Whether objects of this kind live in a namespace.
    pub namespaced: bool,
}

/// What a delete achieved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deletion {
    /// The object is gone (or was never there).
    Gone,
    /// The object is terminating and waits for its finalizers; ask again later.
    Terminating,
}

/// Why a call to the spoke failed. The message is what a person sees in the work's status.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    /// The spoke apiserver refused the request; `message` is its own, verbatim. Retryable only
    /// for conflicts, throttling and server errors (see [`ApplyError::is_retryable`]).
    #[error("{message}")]
    Rejected {
        /// HTTP status code.
        code: u16,
        /// The apiserver's machine-readable reason, e.g. `Invalid`.
        reason: String,
        /// The apiserver's message.
        message: String,
    },
    /// The spoke serves no such kind (unknown group, version or kind). Retryable: a CRD
    /// applied just before may not be served yet.
    #[error("the spoke cluster serves no kind {kind} in {api_version}: {detail}")]
    UnknownKind {
        /// The manifest's apiVersion.
        api_version: String,
        /// The manifest's kind.
        kind: String,
        /// What discovery said.
        detail: String,
    },
    /// The spoke apiserver could not be reached or answered nonsense. Retryable.
    #[error("cannot reach the spoke apiserver: {0}")]
    Unreachable(String),
}

impl ApplyError {
    /// Whether trying again later, without a change to the work, may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            ApplyError::Rejected { code, .. } => matches!(code, 409 | 429 | 500..),
            ApplyError::UnknownKind { .. } | ApplyError::Unreachable(_) => true,
        }
    }
}

/// The calls the apply engine makes to a cluster. Object-safe so that the agent holds an
/// `Arc<dyn ApplyTarget>`: the real spoke, or a simulated one in the load-test.
#[async_trait]
pub trait ApplyTarget: Send + Sync + fmt::Debug {
    /// Which resource `kind` of `api_version` is, and whether it is namespaced.
    async fn resolve(&self, api_version: &str, kind: &str) -> Result<ResourceKind, ApplyError>;

    /// Server-side applies `manifest` as `resource` (whose namespace is already settled),
    /// taking over conflicting fields.
    async fn apply(&self, resource: &AppliedResource, manifest: &Value) -> Result<(), ApplyError>;

    /// Whether the object exists.
    async fn exists(&self, resource: &AppliedResource) -> Result<bool, ApplyError>;

    /// Deletes the object; its dependents are left to the spoke's garbage collector.
    async fn delete(&self, resource: &AppliedResource) -> Result<Deletion, ApplyError>;
}

/// Why one manifest was not applied, as its status shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManifestFailure {
    /// The spoke's message verbatim, or what is wrong with the manifest.
    pub message: String,
    /// Whether a retry without a change to the work may succeed.
    pub retryable: bool,
}

impl ManifestFailure {
    fn invalid(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            retryable: false,
        }
    }
}

impl From<ApplyError> for ManifestFailure {
    fn from(e: ApplyError) -> Self {
        Self {
            retryable: e.is_retryable(),
            message: e.to_string(),
        }
    }
}

/// Whether a manifest's object exists on the spoke.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Availability {
    /// It exists.
    Exists,
    /// It does not.
    Missing,
    /// Could not tell: the manifest does not resolve, or the spoke did not answer.
    Unknown(String),
}

/// One manifest, checked and resolved, ready to apply.
#[derive(Clone, Debug)]
pub struct PlannedManifest {
    /// Position in `spec.workload.manifests`, from 0.
    pub ordinal: usize,
    /// The manifest as written.
    pub manifest: Value,
    /// As much of its identity as could be worked out (`resource` is empty when the kind did
    /// not resolve).
    pub meta: ManifestResourceMeta,
    /// The object it resolves to, or why it cannot be applied.
    pub target: Result<AppliedResource, ManifestFailure>,
}

/// The result of applying one manifest.
#[derive(Clone, Debug, PartialEq)]
pub struct ManifestOutcome {
    /// Its identity for the status.
    pub meta: ManifestResourceMeta,
    /// The object, when the manifest resolved.
    pub resource: Option<AppliedResource>,
    /// Applied, or why not.
    pub applied: Result<(), ManifestFailure>,
    /// Whether the object exists.
    pub available: Availability,
}

/// The order OCM applies manifests in: Namespaces and CRDs first (so what depends on them
/// finds them), then everything else in the order written. Returns ordinals.
pub fn apply_order(manifests: &[Manifest]) -> Vec<usize> {
    let first = |m: &Manifest| {
        let api = m.api_version().unwrap_or("");
        match m.kind().unwrap_or("") {
            "Namespace" => api == "v1",
            "CustomResourceDefinition" => api.starts_with("apiextensions.k8s.io/"),
            _ => false,
        }
    };
    let mut order: Vec<usize> = (0..manifests.len()).collect();
    // Stable: within each class the written order holds.
    order.sort_by_key(|&i| !first(&manifests[i]));
    order
}

/// Checks and resolves every manifest, in [`apply_order`]. A manifest that fails here keeps
/// its place with the reason, so the status has an entry for every ordinal.
pub async fn plan_manifests(
    target: &dyn ApplyTarget,
    manifests: &[Manifest],
) -> Vec<PlannedManifest> {
    let mut planned = Vec::with_capacity(manifests.len());
    for ordinal in apply_order(manifests) {
        planned.push(plan_one(target, ordinal, &manifests[ordinal]).await);
    }
    planned
}

async fn plan_one(
    target: &dyn ApplyTarget,
    ordinal: usize,
    manifest: &Manifest,
) -> PlannedManifest {
    let non_empty = |s: Option<&str>| s.filter(|s| !s.is_empty()).map(str::to_owned);
    let api_version = non_empty(manifest.api_version());
    let kind = non_empty(manifest.kind());
    let name = non_empty(manifest.name());
    let (group, version) = match api_version.as_deref() {
        Some(av) => split_api_version(av),
        None => (String::new(), String::new()),
    };
    let mut meta = ManifestResourceMeta {
        ordinal: i32::try_from(ordinal).unwrap_or(i32::MAX),
        group,
        version,
        kind: kind.clone().unwrap_or_default(),
        resource: String::new(),
        name: name.clone().unwrap_or_default(),
        namespace: manifest.namespace().unwrap_or_default().to_owned(),
    };
    let plan = |meta, target| PlannedManifest {
        ordinal,
        manifest: manifest.0.clone(),
        meta,
        target,
    };
    if !manifest.0.is_object() {
        return plan(
            meta,
            Err(ManifestFailure::invalid("manifest is not an object")),
        );
    }
    let (Some(api_version), Some(kind), Some(name)) = (api_version, kind, name) else {
        let missing: Vec<&str> = [
            (
                manifest.api_version().is_none_or(str::is_empty),
                "apiVersion",
            ),
            (manifest.kind().is_none_or(str::is_empty), "kind"),
            (manifest.name().is_none_or(str::is_empty), "metadata.name"),
        ]
        .into_iter()
        .filter_map(|(missing, field)| missing.then_some(field))
        .collect();
        let failure =
            ManifestFailure::invalid(format!("manifest has no {}", missing.join(", no ")));
        return plan(meta, Err(failure));
    };
    let resolved = match target.resolve(&api_version, &kind).await {
        Ok(r) => r,
        Err(e) => return plan(meta, Err(e.into())),
    };
    meta.resource = resolved.resource.clone();
    meta.namespace = if resolved.namespaced {
        // As kubectl does: a namespaced object without a namespace goes to `default`.
        manifest
            .namespace()
            .filter(|ns| !ns.is_empty())
            .unwrap_or("default")
            .to_owned()
    } else {
        String::new()
    };
    let resource = AppliedResource {
        group: resolved.group,
        version: resolved.version,
        kind: resolved.kind,
        resource: resolved.resource,
        namespace: meta.namespace.clone(),
        name,
    };
    plan(meta, Ok(resource))
}

/// Applies planned manifests one after the other and reports each.
///
/// A manifest whose kind did not resolve is resolved again if a CRD was applied before it in
/// this pass: a work that brings its own CRD then applies in one pass when the spoke serves the
/// new kind in time, and otherwise on the next retry.
pub async fn apply_planned(
    target: &dyn ApplyTarget,
    planned: &[PlannedManifest],
) -> Vec<ManifestOutcome> {
    let mut outcomes = Vec::with_capacity(planned.len());
    let mut crd_applied = false;
    for p in planned {
        let replanned;
        let p = match &p.target {
            Err(f) if f.retryable && crd_applied => {
                replanned = plan_one(target, p.ordinal, &Manifest(p.manifest.clone())).await;
                &replanned
            }
            _ => p,
        };
        let outcome = match &p.target {
            Err(failure) => ManifestOutcome {
                meta: p.meta.clone(),
                resource: None,
                applied: Err(failure.clone()),
                available: Availability::Unknown(
                    "the manifest did not resolve to a resource".into(),
                ),
            },
            Ok(resource) => {
                let applied = target
                    .apply(resource, &p.manifest)
                    .await
                    .map_err(ManifestFailure::from);
                let available = match &applied {
                    Ok(()) => {
                        crd_applied |= resource.kind == "CustomResourceDefinition";
                        Availability::Exists
                    }
                    Err(_) => match target.exists(resource).await {
                        Ok(true) => Availability::Exists,
                        Ok(false) => Availability::Missing,
                        Err(e) => Availability::Unknown(e.to_string()),
                    },
                };
                ManifestOutcome {
                    meta: p.meta.clone(),
                    resource: Some(resource.clone()),
                    applied,
                    available,
                }
            }
        };
        outcomes.push(outcome);
    }
    outcomes
}

/// `apps/v1` → (`apps`, `v1`); `v1` → (``, `v1`).
fn split_api_version(api_version: &str) -> (String, String) {
    match api_version.split_once('/') {
        Some((group, version)) => (group.to_owned(), version.to_owned()),
        None => (String::new(), api_version.to_owned()),
    }
}

/// The spoke's kube-apiserver as an [`ApplyTarget`]: server-side apply as [`FIELD_MANAGER`]
/// with force (OCM's ServerSideApply strategy), kinds resolved through discovery.
pub struct KubeApplyTarget {
    client: kube::Client,
    /// apiVersion → kind → resource, filled one group version at a time (one request serves
    /// every kind of it). A kind missing from a cached group version refreshes that group
    /// version, so CRDs installed later are found; a 404 on an object evicts its group version
    /// in case the CRD went away.
    kinds: RwLock<HashMap<String, HashMap<String, ResourceKind>>>,
}

impl fmt::Debug for KubeApplyTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KubeApplyTarget").finish_non_exhaustive()
    }
}

impl KubeApplyTarget {
    /// A target on the spoke `client` talks to.
    pub fn new(client: kube::Client) -> Self {
        Self {
            client,
            kinds: RwLock::new(HashMap::new()),
        }
    }

    async fn cached(&self, api_version: &str, kind: &str) -> Option<ResourceKind> {
        self.kinds.read().await.get(api_version)?.get(kind).cloned()
    }

    async fn discover(
        &self,
        api_version: &str,
    ) -> Result<HashMap<String, ResourceKind>, kube::Error> {
        let list = if api_version.contains('/') {
            self.client.list_api_group_resources(api_version).await?
        } else {
            self.client.list_core_api_resources(api_version).await?
        };
        let (group, version) = split_api_version(api_version);
        Ok(list
            .resources
            .into_iter()
            // `deployments/status` and the like are subresources, not kinds to apply.
            .filter(|r| !r.name.contains('/'))
            .map(|r| {
                let kind = ResourceKind {
                    group: group.clone(),
                    version: version.clone(),
                    kind: r.kind.clone(),
                    resource: r.name,
                    namespaced: r.namespaced,
                };
                (r.kind, kind)
            })
            .collect())
    }

    fn api(&self, resource: &AppliedResource) -> Api<DynamicObject> {
        let gvk = GroupVersionKind::gvk(&resource.group, &resource.version, &resource.kind);
        let ar = ApiResource::from_gvk_with_plural(&gvk, &resource.resource);
        if resource.namespace.is_empty() {
            Api::all_with(self.client.clone(), &ar)
        } else {
            Api::namespaced_with(self.client.clone(), &resource.namespace, &ar)
        }
    }

    async fn evict_on_not_found(&self, resource: &AppliedResource, error: &kube::Error) {
        if let kube::Error::Api(status) = error
            && status.code == 404
        {
            self.kinds.write().await.remove(&resource.api_version());
        }
    }
}

fn spoke_error(error: kube::Error) -> ApplyError {
    match error {
        kube::Error::Api(status) => ApplyError::Rejected {
            code: status.code,
            reason: status.reason,
            message: status.message,
        },
        other => ApplyError::Unreachable(other.to_string()),
    }
}

#[async_trait]
impl ApplyTarget for KubeApplyTarget {
    async fn resolve(&self, api_version: &str, kind: &str) -> Result<ResourceKind, ApplyError> {
        if let Some(found) = self.cached(api_version, kind).await {
            return Ok(found);
        }
        let unknown = |detail: String| ApplyError::UnknownKind {
            api_version: api_version.to_owned(),
            kind: kind.to_owned(),
            detail,
        };
        let kinds = match self.discover(api_version).await {
            Ok(kinds) => kinds,
            Err(kube::Error::Api(status)) if status.code == 404 => {
                return Err(unknown(format!(
                    "the apiserver does not serve {api_version} ({})",
                    status.message
                )));
            }
            Err(e) => return Err(spoke_error(e)),
        };
        let found = kinds.get(kind).cloned();
        self.kinds
            .write()
            .await
            .insert(api_version.to_owned(), kinds);
        found.ok_or_else(|| unknown(format!("{api_version} has no kind {kind}")))
    }

    async fn apply(&self, resource: &AppliedResource, manifest: &Value) -> Result<(), ApplyError> {
        let params = PatchParams::apply(FIELD_MANAGER).force();
        match self
            .api(resource)
            .patch(&resource.name, &params, &Patch::Apply(manifest))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) => {
                self.evict_on_not_found(resource, &e).await;
                Err(spoke_error(e))
            }
        }
    }

    async fn exists(&self, resource: &AppliedResource) -> Result<bool, ApplyError> {
        match self.api(resource).get_metadata_opt(&resource.name).await {
            Ok(found) => Ok(found.is_some()),
            Err(e) => Err(spoke_error(e)),
        }
    }

    async fn delete(&self, resource: &AppliedResource) -> Result<Deletion, ApplyError> {
        // Background, not Foreground: the object goes at once and the garbage collector removes
        // its dependents. Foreground would park the object behind a finalizer only the garbage
        // collector removes, and the work's tombstone with it.
        match self
            .api(resource)
            .delete(&resource.name, &DeleteParams::background())
            .await
        {
            Ok(either) => match either.left() {
                Some(obj)
                    if obj.metadata.deletion_timestamp.is_some()
                        && !obj.metadata.finalizers.as_ref().is_none_or(Vec::is_empty) =>
                {
                    Ok(Deletion::Terminating)
                }
                _ => Ok(Deletion::Gone),
            },
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(Deletion::Gone),
            Err(e) => Err(spoke_error(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn manifests(kinds: &[(&str, &str)]) -> Vec<Manifest> {
        kinds
            .iter()
            .enumerate()
            .map(|(i, (api, kind))| {
                Manifest(
                    json!({"apiVersion": api, "kind": kind, "metadata": {"name": format!("m{i}")}}),
                )
            })
            .collect()
    }

    fn check_order(kinds: &[(&str, &str)], expected: &[usize]) {
        assert_eq!(apply_order(&manifests(kinds)), expected, "{kinds:?}");
    }

    #[test]
    fn namespaces_and_crds_go_first_and_the_rest_keep_their_order() {
        check_order(
            &[("v1", "ServiceAccount"), ("apps/v1", "Deployment")],
            &[0, 1],
        );
        check_order(&[("apps/v1", "Deployment"), ("v1", "Namespace")], &[1, 0]);
        check_order(
            &[
                ("example.com/v1", "Widget"),
                ("v1", "ConfigMap"),
                ("apiextensions.k8s.io/v1", "CustomResourceDefinition"),
                ("v1", "Namespace"),
                ("v1", "Secret"),
            ],
            &[2, 3, 0, 1, 4],
        );
        // Only the real Namespace kind counts, not a CRD that happens to be called so.
        check_order(
            &[("v1", "ConfigMap"), ("example.com/v1", "Namespace")],
            &[0, 1],
        );
        check_order(&[], &[]);
    }

    fn check_plan_failure(manifest: Value, expected: &str) {
        let cluster = MemoryCluster::new();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let planned = runtime.block_on(plan_manifests(&cluster, &[Manifest(manifest.clone())]));
        let failure = planned[0].target.clone().expect_err("should not resolve");
        assert_eq!(failure.message, expected, "{manifest}");
    }

    #[test]
    fn manifests_that_cannot_be_applied_say_why() {
        check_plan_failure(json!("just a string"), "manifest is not an object");
        check_plan_failure(
            json!({"apiVersion": "v1", "metadata": {"name": "x"}}),
            "manifest has no kind",
        );
        check_plan_failure(
            json!({"apiVersion": "v1", "kind": "ConfigMap"}),
            "manifest has no metadata.name",
        );
        check_plan_failure(
            json!({"kind": "ConfigMap", "metadata": {}}),
            "manifest has no apiVersion, no metadata.name",
        );
        check_plan_failure(
            json!({"apiVersion": "widgets.example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}),
            "the spoke cluster serves no kind Widget in widgets.example.com/v1: no such group version",
        );
    }

    #[tokio::test]
    async fn namespaced_objects_default_to_the_default_namespace_and_cluster_objects_have_none() {
        let cluster = MemoryCluster::new();
        let planned = plan_manifests(
            &cluster,
            &[
                Manifest(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}})),
                Manifest(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "n", "namespace": "x"}})),
            ],
        )
        .await;
        let ns = planned[0].target.as_ref().unwrap();
        assert_eq!(
            (
                ns.kind.as_str(),
                ns.namespace.as_str(),
                ns.resource.as_str()
            ),
            ("Namespace", "", "namespaces")
        );
        let cm = planned[1].target.as_ref().unwrap();
        assert_eq!(
            (cm.namespace.as_str(), planned[1].meta.ordinal),
            ("default", 0)
        );
    }

    #[tokio::test]
    async fn one_failing_manifest_does_not_stop_the_others() {
        let cluster = MemoryCluster::new();
        cluster
            .reject(
                "bad",
                422,
                "ConfigMap \"bad\" is invalid: data: Invalid value",
            )
            .await;
        let work = [
            Manifest(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "bad"}})),
            Manifest(
                json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "good"}}),
            ),
        ];
        let planned = plan_manifests(&cluster, &work).await;
        let outcomes = apply_planned(&cluster, &planned).await;
        let failure = outcomes[0].applied.clone().unwrap_err();
        assert_eq!(
            failure.message,
            "ConfigMap \"bad\" is invalid: data: Invalid value"
        );
        assert!(!failure.retryable);
        assert_eq!(outcomes[0].available, Availability::Missing);
        assert_eq!(outcomes[1].applied, Ok(()));
        assert_eq!(outcomes[1].available, Availability::Exists);
        assert!(
            cluster
                .get(outcomes[1].resource.as_ref().unwrap())
                .await
                .is_some()
        );
    }

    #[tokio::test]
    async fn a_crd_applied_first_makes_its_kind_resolvable() {
        let cluster = MemoryCluster::new();
        let crd = json!({
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": "widgets.example.com"},
            "spec": {"group": "example.com", "scope": "Namespaced",
                     "names": {"kind": "Widget", "plural": "widgets"},
                     "versions": [{"name": "v1"}]}
        });
        let widget =
            json!({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}});
        // Written after the widget; applied before it, and the widget resolves in the same pass.
        let work = [Manifest(widget), Manifest(crd)];
        let planned = plan_manifests(&cluster, &work).await;
        assert!(
            planned[1].target.is_err(),
            "the kind is unknown before the CRD is applied"
        );
        let outcomes = apply_planned(&cluster, &planned).await;
        assert!(outcomes.iter().all(|o| o.applied.is_ok()), "{outcomes:?}");
        assert_eq!(outcomes[1].meta.resource, "widgets");
    }

    #[test]
    fn retryability_follows_the_status_code() {
        let rejected = |code| ApplyError::Rejected {
            code,
            reason: String::new(),
            message: String::new(),
        };
        assert!(!rejected(422).is_retryable());
        assert!(!rejected(403).is_retryable());
        assert!(rejected(409).is_retryable());
        assert!(rejected(429).is_retryable());
        assert!(rejected(503).is_retryable());
        assert!(ApplyError::Unreachable("x".into()).is_retryable());
    }
}
