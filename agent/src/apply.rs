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

use std::collections::{BTreeSet, HashMap};
use std::fmt;

use async_trait::async_trait;
use flotilla_proto::api::{
    ConditionRule, DeleteOption, FeedbackRule, IgnoreField, Manifest, ManifestConfigOption,
    ManifestResourceMeta, ManifestWorkExecutor, ManifestWorkSpec, PropagationPolicy,
    ResourceIdentifier, UpdateStrategyType, canonical_json,
};
use futures::stream::{BoxStream, StreamExt as _};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::{WatchStreamExt as _, watcher};
use serde_json::Value;
use sha2::{Digest as _, Sha256};
use tokio::sync::RwLock;
use tracing::debug;

pub use memory::MemoryCluster;

use crate::cache::AppliedResource;
use crate::executor;
use crate::jsonpath::{self, JsonPath};

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

/// A change to an object of a watched kind.
#[derive(Clone, Debug, PartialEq)]
pub enum ObjectEvent {
    /// The object is now this (created, changed, or listed when the watch (re)started).
    Changed(Value),
    /// The object is gone.
    Deleted {
        /// Its namespace; empty for cluster-scoped objects.
        namespace: String,
        /// Its name.
        name: String,
    },
}

/// One question to the spoke's authorizer: may `user` (in `groups`) do `verb` on this object?
/// A SubjectAccessReview on a real spoke.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccessCheck {
    /// e.g. `system:serviceaccount:team-a:deployer`.
    pub user: String,
    /// The user's groups, as the apiserver would authenticate them.
    pub groups: Vec<String>,
    /// e.g. `create`.
    pub verb: String,
    /// The object.
    pub resource: AppliedResource,
}

/// The calls the apply engine makes to a cluster. Object-safe so that the agent holds an
/// `Arc<dyn ApplyTarget>`: the real spoke, or a simulated one in the load-test.
#[async_trait]
pub trait ApplyTarget: Send + Sync + fmt::Debug {
    /// Which resource `kind` of `api_version` is, and whether it is namespaced.
    async fn resolve(&self, api_version: &str, kind: &str) -> Result<ResourceKind, ApplyError>;

    /// Server-side applies `manifest` as `resource` (whose namespace is already settled) with
    /// `field_manager`, taking over conflicting fields when `force`; returns the object stored.
    async fn apply(
        &self,
        resource: &AppliedResource,
        manifest: &Value,
        field_manager: &str,
        force: bool,
    ) -> Result<Value, ApplyError>;

    /// Creates the object; 409 `AlreadyExists` if it is there.
    async fn create(&self, resource: &AppliedResource, object: &Value)
    -> Result<Value, ApplyError>;

    /// Replaces the object (an update call); 409 `Conflict` when its
    /// `metadata.resourceVersion` is not the stored one.
    async fn replace(
        &self,
        resource: &AppliedResource,
        object: &Value,
    ) -> Result<Value, ApplyError>;

    /// The object, if present.
    async fn get(&self, resource: &AppliedResource) -> Result<Option<Value>, ApplyError>;

    /// Whether the object exists.
    async fn exists(&self, resource: &AppliedResource) -> Result<bool, ApplyError>;

    /// Deletes the object; its dependents are left to the spoke's garbage collector.
    async fn delete(&self, resource: &AppliedResource) -> Result<Deletion, ApplyError>;

    /// Asks the spoke's authorizer one question (a SubjectAccessReview).
    async fn review_access(&self, check: &AccessCheck) -> Result<bool, ApplyError>;

    /// Server-side applies `manifest` as `resource` in dry-run mode (`dryRun=All`: nothing is
    /// stored) as `user`, impersonated, so that the spoke's own admission decides as it would
    /// for that user: for RBAC objects, the apiserver's escalation check (a Role may grant only
    /// rights its writer holds). A refusal is the apiserver's error.
    async fn dry_run_as(
        &self,
        user: &str,
        resource: &AppliedResource,
        manifest: &Value,
        field_manager: &str,
    ) -> Result<(), ApplyError>;

    /// Every change to objects of `kind`, starting with the objects there now. The stream
    /// re-lists and resumes by itself after errors and never ends while the cluster lives.
    fn watch(&self, kind: &ResourceKind) -> BoxStream<'static, ObjectEvent>;
}

/// The reason of a manifest's `Applied=False` condition when nothing more specific applies.
pub const REASON_APPLY_FAILED: &str = "AppliedManifestFailed";
/// The reason when a server-side apply met fields another field manager owns (OCM's).
pub const REASON_APPLY_CONFLICT: &str = "ApplyConflict";
/// The reason when `ignoreFields` cannot be used (OCM's).
pub const REASON_IGNORE_FIELD_ERROR: &str = "AppliedManifestSSAIgnoreFieldError";

/// Why one manifest was not applied, as its status shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManifestFailure {
    /// The spoke's message verbatim, or what is wrong with the manifest.
    pub message: String,
    /// Whether a retry without a change to the work may succeed.
    pub retryable: bool,
    /// The reason of the manifest's `Applied=False` condition.
    pub reason: &'static str,
}

impl ManifestFailure {
    fn invalid(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            retryable: false,
            reason: REASON_APPLY_FAILED,
        }
    }
}

impl From<ApplyError> for ManifestFailure {
    fn from(e: ApplyError) -> Self {
        Self {
            retryable: e.is_retryable(),
            message: e.to_string(),
            reason: REASON_APPLY_FAILED,
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

/// How a manifest is written to the spoke: OCM's update strategies, and the agent's default.
#[derive(Clone, Debug, PartialEq)]
pub enum WriteStrategy {
    /// No `updateStrategy`: server-side apply as [`FIELD_MANAGER`], taking over conflicts, so
    /// the manifest's fields are enforced and fields other managers set are left alone.
    Default,
    /// `Update`: read, merge labels and annotations, and replace the object with an update
    /// call when it differs from the manifest (or the work has a new generation).
    Update,
    /// `CreateOnly`: create when missing, never change it afterwards.
    CreateOnly,
    /// `ServerSideApply` with OCM's options.
    ServerSideApply {
        /// Defaults to `work-agent`; must start with it.
        field_manager: String,
        /// Take over fields other managers own.
        force: bool,
        /// Fields left alone on the spoke.
        ignore_fields: Vec<IgnoreField>,
    },
    /// `ReadOnly`: only read (for availability and feedback); never created, changed or
    /// deleted.
    ReadOnly,
}

/// OCM's default field manager for the `ServerSideApply` strategy; any other must start with it.
pub const OCM_FIELD_MANAGER: &str = "work-agent";
/// Annotation holding the hash of what a `ServerSideApply` with `ignoreFields` last applied
/// (OCM's key): equal on the spoke means nothing to apply.
pub const CONFIG_SPEC_HASH_ANNOTATION: &str = "open-cluster-management.io/config-spec-hash";

impl WriteStrategy {
    /// The strategy a manifest config asks for.
    pub fn of(config: Option<&ManifestConfigOption>) -> WriteStrategy {
        let Some(strategy) = config.and_then(|c| c.update_strategy.as_ref()) else {
            return WriteStrategy::Default;
        };
        match strategy.type_ {
            UpdateStrategyType::Update => WriteStrategy::Update,
            UpdateStrategyType::CreateOnly => WriteStrategy::CreateOnly,
            UpdateStrategyType::ReadOnly => WriteStrategy::ReadOnly,
            UpdateStrategyType::ServerSideApply => {
                let ssa = strategy.server_side_apply.clone().unwrap_or_default();
                WriteStrategy::ServerSideApply {
                    field_manager: if ssa.field_manager.is_empty() {
                        OCM_FIELD_MANAGER.to_owned()
                    } else {
                        ssa.field_manager
                    },
                    force: ssa.force.unwrap_or(false),
                    ignore_fields: ssa.ignore_fields,
                }
            }
        }
    }

    /// Whether the agent owns the object (applies, and deletes it with the work).
    pub fn owns(&self) -> bool {
        !matches!(self, WriteStrategy::ReadOnly)
    }
}

/// What a work asks of its manifests beyond the manifests themselves.
#[derive(Clone, Debug, Default)]
pub struct ApplyContext {
    /// `spec.executor`: every write is first checked against its rights.
    pub executor: Option<ManifestWorkExecutor>,
    /// `spec.deleteOption`: objects it orphans need no delete right from the executor.
    pub delete_option: Option<DeleteOption>,
    /// Objects whose `Complete` condition is true: OCM no longer updates them.
    pub complete: BTreeSet<AppliedResource>,
    /// The work has a generation the agent has not applied before: `Update` replaces objects
    /// even when they already contain every field of the manifest (a field removed from the
    /// manifest goes away on the spoke too).
    pub new_generation: bool,
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
    /// Its entry of `spec.manifestConfigs`, matched by group, resource, namespace and name.
    pub config: Option<ManifestConfigOption>,
}

impl PlannedManifest {
    /// How it is written.
    pub fn strategy(&self) -> WriteStrategy {
        WriteStrategy::of(self.config.as_ref())
    }
}

/// The rules a manifest's status is computed with.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StatusRules {
    /// `feedbackRules`.
    pub feedback: Vec<FeedbackRule>,
    /// `conditionRules`.
    pub conditions: Vec<ConditionRule>,
}

impl StatusRules {
    fn of(config: Option<&ManifestConfigOption>) -> StatusRules {
        config.map_or_else(StatusRules::default, |c| StatusRules {
            feedback: c.feedback_rules.clone(),
            conditions: c.condition_rules.clone(),
        })
    }

    /// Whether the status needs the object's content (so its changes must be watched).
    pub fn read_object(&self) -> bool {
        !self.feedback.is_empty() || !self.conditions.is_empty()
    }
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
    /// The object as last seen on the spoke, when its status rules need it.
    pub object: Option<Value>,
    /// The rules its status is computed with.
    pub rules: StatusRules,
    /// Whether the agent owns the object (not `ReadOnly`).
    pub owned: bool,
    /// The object's `metadata.resourceVersion` after this pass wrote (or read) it: a later
    /// pass that finds another one knows the object changed in between.
    pub resource_version: Option<String>,
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

/// Checks and resolves every manifest of `spec`, in [`apply_order`]. A manifest that fails here
/// keeps its place with the reason, so the status has an entry for every ordinal.
pub async fn plan_manifests(
    target: &dyn ApplyTarget,
    spec: &ManifestWorkSpec,
) -> Vec<PlannedManifest> {
    let manifests = &spec.workload.manifests;
    let mut planned = Vec::with_capacity(manifests.len());
    for ordinal in apply_order(manifests) {
        planned.push(plan_one(target, ordinal, &manifests[ordinal], &spec.manifest_configs).await);
    }
    planned
}

async fn plan_one(
    target: &dyn ApplyTarget,
    ordinal: usize,
    manifest: &Manifest,
    configs: &[ManifestConfigOption],
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
    let plan = |meta, target: Result<AppliedResource, ManifestFailure>| {
        let config = target
            .as_ref()
            .ok()
            .and_then(|r| find_config(configs, r))
            .cloned();
        PlannedManifest {
            ordinal,
            manifest: manifest.0.clone(),
            meta,
            target,
            config,
        }
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

/// The config whose `resourceIdentifier` names `resource` (group, resource, namespace and
/// name; `*` in a name or namespace matches any run of characters, as OCM allows).
pub fn find_config<'a>(
    configs: &'a [ManifestConfigOption],
    resource: &AppliedResource,
) -> Option<&'a ManifestConfigOption> {
    configs
        .iter()
        .find(|c| identifies(&c.resource_identifier, resource))
}

/// Whether `id` names `resource`.
pub fn identifies(id: &ResourceIdentifier, resource: &AppliedResource) -> bool {
    id.group() == resource.group
        && id.resource == resource.resource
        && glob(id.namespace(), &resource.namespace)
        && glob(&id.name, &resource.name)
}

fn glob(pattern: &str, text: &str) -> bool {
    let Some((head, rest)) = pattern.split_once('*') else {
        return pattern == text;
    };
    let Some(mut text) = text.strip_prefix(head) else {
        return false;
    };
    let parts: Vec<&str> = rest.split('*').collect();
    for (i, part) in parts.iter().enumerate() {
        if i == parts.len() - 1 {
            return text.ends_with(part);
        }
        match text.find(part) {
            Some(at) => text = &text[at + part.len()..],
            None => return false,
        }
    }
    true
}

/// Applies planned manifests one after the other and reports each.
///
/// A manifest whose kind did not resolve is resolved again if a CRD was applied before it in
/// this pass: a work that brings its own CRD then applies in one pass when the spoke serves the
/// new kind in time, and otherwise on the next retry.
pub async fn apply_planned(
    target: &dyn ApplyTarget,
    planned: &[PlannedManifest],
    context: &ApplyContext,
) -> Vec<ManifestOutcome> {
    let mut outcomes = Vec::with_capacity(planned.len());
    let mut crd_applied = false;
    for p in planned {
        let replanned;
        let p = match &p.target {
            Err(f) if f.retryable && crd_applied => {
                let configs: Vec<ManifestConfigOption> = p.config.iter().cloned().collect();
                replanned =
                    plan_one(target, p.ordinal, &Manifest(p.manifest.clone()), &configs).await;
                &replanned
            }
            _ => p,
        };
        let rules = StatusRules::of(p.config.as_ref());
        let owned = p.strategy().owns();
        let outcome = match &p.target {
            Err(failure) => ManifestOutcome {
                meta: p.meta.clone(),
                resource: None,
                applied: Err(failure.clone()),
                available: Availability::Unknown(
                    "the manifest did not resolve to a resource".into(),
                ),
                object: None,
                rules,
                owned,
                resource_version: None,
            },
            Ok(resource) => {
                let (applied, object) = write(target, p, resource, context).await;
                let available = match (&applied, &object) {
                    (_, Some(_)) => Availability::Exists,
                    (Ok(()), None) if matches!(p.strategy(), WriteStrategy::ReadOnly) => {
                        Availability::Missing
                    }
                    _ => match target.exists(resource).await {
                        Ok(true) => Availability::Exists,
                        Ok(false) => Availability::Missing,
                        Err(e) => Availability::Unknown(e.to_string()),
                    },
                };
                if applied.is_ok() && resource.kind == "CustomResourceDefinition" {
                    crd_applied = true;
                }
                let resource_version = object
                    .as_ref()
                    .and_then(|o| o["metadata"]["resourceVersion"].as_str())
                    .map(str::to_owned);
                ManifestOutcome {
                    meta: p.meta.clone(),
                    resource: Some(resource.clone()),
                    applied,
                    available,
                    resource_version,
                    // Kept only when a rule reads it: a work of many large objects stays small
                    // in memory.
                    object: object.filter(|_| rules.read_object()),
                    rules,
                    owned,
                }
            }
        };
        outcomes.push(outcome);
    }
    outcomes
}

/// Writes one resolved manifest as its strategy says; the object as stored when known.
async fn write(
    target: &dyn ApplyTarget,
    p: &PlannedManifest,
    resource: &AppliedResource,
    context: &ApplyContext,
) -> (Result<(), ManifestFailure>, Option<Value>) {
    let strategy = p.strategy();
    if context.complete.contains(resource) || !strategy.owns() {
        // Complete (OCM stops updating it) or ReadOnly: only read.
        if let (false, Some(executor)) = (strategy.owns(), &context.executor)
            && let Err(f) = executor::check(target, executor, resource, &["get"]).await
        {
            return (Err(f), None);
        }
        return match target.get(resource).await {
            Ok(object) => (Ok(()), object),
            Err(e) => (Err(e.into()), None),
        };
    }
    if let Some(executor) = &context.executor {
        let orphaned = context
            .delete_option
            .as_ref()
            .is_some_and(|o| orphans(o, resource));
        let verbs: &[&str] = if orphaned {
            &["create", "update", "patch", "get"]
        } else {
            // Checked now, so an object applied with the executor's rights can also be deleted
            // with them when the work goes (OCM does the same).
            &["create", "update", "patch", "get", "delete"]
        };
        if let Err(f) = executor::check(target, executor, resource, verbs).await {
            return (Err(f), None);
        }
        if let Err(f) = executor::check_escalation(target, executor, resource, &p.manifest).await {
            return (Err(f), None);
        }
    }
    let written = match strategy {
        WriteStrategy::Default => target
            .apply(resource, &p.manifest, FIELD_MANAGER, true)
            .await
            .map_err(ManifestFailure::from),
        WriteStrategy::CreateOnly => create_only(target, resource, &p.manifest).await,
        WriteStrategy::Update => {
            update(target, resource, &p.manifest, context.new_generation).await
        }
        WriteStrategy::ServerSideApply {
            field_manager,
            force,
            ignore_fields,
        } => {
            server_side_apply(
                target,
                resource,
                &p.manifest,
                &field_manager,
                force,
                &ignore_fields,
            )
            .await
        }
        WriteStrategy::ReadOnly => unreachable_read_only(),
    };
    match written {
        Ok(object) => (Ok(()), Some(object)),
        Err(f) => (Err(f), None),
    }
}

/// `ReadOnly` returns before any write; this keeps the match total without a panic.
fn unreachable_read_only() -> Result<Value, ManifestFailure> {
    Err(ManifestFailure::invalid(
        "a ReadOnly manifest is never written",
    ))
}

/// Whether the delete option leaves this object on the cluster when the work goes.
pub fn orphans(option: &DeleteOption, resource: &AppliedResource) -> bool {
    match option.propagation_policy {
        PropagationPolicy::Orphan => true,
        PropagationPolicy::Foreground => false,
        PropagationPolicy::SelectivelyOrphan => option
            .selectively_orphans
            .as_ref()
            .is_some_and(|s| s.orphaning_rules.iter().any(|r| identifies(r, resource))),
    }
}

async fn create_only(
    target: &dyn ApplyTarget,
    resource: &AppliedResource,
    manifest: &Value,
) -> Result<Value, ManifestFailure> {
    if let Some(existing) = target.get(resource).await? {
        return Ok(existing);
    }
    match target.create(resource, manifest).await {
        // Created meanwhile by someone else: CreateOnly leaves it as it is.
        Err(ApplyError::Rejected { code: 409, .. }) => target
            .get(resource)
            .await?
            .ok_or_else(|| ManifestFailure::invalid("the object vanished while being created")),
        other => Ok(other?),
    }
}

/// How often `Update` re-reads and tries again after a conflicting write.
const UPDATE_ATTEMPTS: usize = 3;

async fn update(
    target: &dyn ApplyTarget,
    resource: &AppliedResource,
    manifest: &Value,
    new_generation: bool,
) -> Result<Value, ManifestFailure> {
    let mut last = None;
    for _ in 0..UPDATE_ATTEMPTS {
        let result = match target.get(resource).await? {
            None => target.create(resource, manifest).await,
            Some(existing) => {
                let desired = merged_for_update(manifest, &existing);
                if !new_generation && contains(&existing, &desired) {
                    return Ok(existing);
                }
                target.replace(resource, &desired).await
            }
        };
        match result {
            // Someone wrote in between (or created it first): read again and retry.
            Err(e @ ApplyError::Rejected { code: 409, .. }) => last = Some(e),
            other => return Ok(other?),
        }
    }
    Err(last
        .map(ManifestFailure::from)
        .unwrap_or_else(|| ManifestFailure::invalid("update did not converge")))
}

/// The manifest as an update call writes it over `existing`: labels and annotations merged
/// (the manifest's win), finalizers and owner references kept, `resourceVersion` guarding
/// against a concurrent write, and the status left as it is.
fn merged_for_update(manifest: &Value, existing: &Value) -> Value {
    let mut desired = manifest.clone();
    let meta = &existing["metadata"];
    for field in ["labels", "annotations"] {
        let mut merged = meta[field].as_object().cloned().unwrap_or_default();
        if let Some(own) = manifest["metadata"][field].as_object() {
            merged.extend(own.clone());
        }
        if !merged.is_empty() {
            desired["metadata"][field] = Value::Object(merged);
        }
    }
    for field in ["finalizers", "ownerReferences", "resourceVersion"] {
        if let Some(v) = meta.get(field) {
            desired["metadata"][field] = v.clone();
        }
    }
    if let Some(status) = existing.get("status") {
        desired["status"] = status.clone();
    }
    desired
}

/// Whether `have` already holds every field of `want` with the same value (fields the
/// apiserver defaulted in `have` do not count against it).
fn contains(have: &Value, want: &Value) -> bool {
    match (have, want) {
        (Value::Object(h), Value::Object(w)) => w
            .iter()
            .all(|(k, wv)| h.get(k).is_some_and(|hv| contains(hv, wv))),
        (Value::Array(h), Value::Array(w)) => {
            h.len() == w.len() && h.iter().zip(w).all(|(hv, wv)| contains(hv, wv))
        }
        (Value::Number(h), Value::Number(w)) => h.as_f64() == w.as_f64(),
        _ => have == want,
    }
}

async fn server_side_apply(
    target: &dyn ApplyTarget,
    resource: &AppliedResource,
    manifest: &Value,
    field_manager: &str,
    force: bool,
    ignore_fields: &[IgnoreField],
) -> Result<Value, ManifestFailure> {
    if !field_manager.starts_with(OCM_FIELD_MANAGER) {
        return Err(ManifestFailure::invalid(format!(
            "updateStrategy.serverSideApply.fieldManager {field_manager:?} must start with {OCM_FIELD_MANAGER:?}"
        )));
    }
    let mut to_apply = manifest.clone();
    if !ignore_fields.is_empty() {
        // OnSpokePresent fields are left out of what is applied once the object exists;
        // OnSpokeChange fields are applied only when the manifest itself changed. Both come
        // down to: hash what would be applied, and apply nothing while the spoke's copy
        // carries that hash.
        let mut required = manifest.clone();
        for field in ignore_fields {
            match field.condition.as_str() {
                "OnSpokeChange" => continue,
                "OnSpokePresent" | "" => {}
                other => {
                    return Err(ManifestFailure {
                        message: format!(
                            "ignoreFields condition {other:?} is not OnSpokePresent or OnSpokeChange"
                        ),
                        retryable: false,
                        reason: REASON_IGNORE_FIELD_ERROR,
                    });
                }
            }
            for path in &field.json_paths {
                let parsed = JsonPath::parse(path).map_err(|e| ManifestFailure {
                    message: format!("ignoreFields: {e}"),
                    retryable: false,
                    reason: REASON_IGNORE_FIELD_ERROR,
                })?;
                jsonpath::remove(&mut required, &parsed);
            }
        }
        let hash = hex::encode(Sha256::digest(canonical_json(&required).as_bytes()));
        for object in [&mut required, &mut to_apply] {
            object["metadata"]["annotations"][CONFIG_SPEC_HASH_ANNOTATION] =
                Value::String(hash.clone());
        }
        match target.get(resource).await? {
            // A new object gets every field, the ignored ones included.
            None => {}
            Some(existing)
                if existing["metadata"]["annotations"][CONFIG_SPEC_HASH_ANNOTATION]
                    == Value::String(hash.clone()) =>
            {
                return Ok(existing);
            }
            Some(_) => to_apply = required,
        }
    }
    target
        .apply(resource, &to_apply, field_manager, force)
        .await
        .map_err(|e| match e {
            ApplyError::Rejected {
                code: 409, message, ..
            } => ManifestFailure {
                // The apiserver's message names the manager that owns the fields.
                message,
                // Not without a change: to force, to another field manager, or by the other
                // manager letting go.
                retryable: false,
                reason: REASON_APPLY_CONFLICT,
            },
            other => other.into(),
        })
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

    /// The object a write stored, or the write's error (a 404 forgets the kind's discovery).
    async fn stored(
        &self,
        resource: &AppliedResource,
        result: Result<DynamicObject, kube::Error>,
    ) -> Result<Value, ApplyError> {
        match result {
            Ok(object) => to_json(object),
            Err(e) => {
                self.evict_on_not_found(resource, &e).await;
                Err(spoke_error(e))
            }
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

fn to_json(object: DynamicObject) -> Result<Value, ApplyError> {
    serde_json::to_value(object)
        .map_err(|e| ApplyError::Unreachable(format!("the spoke sent an unreadable object: {e}")))
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

    async fn apply(
        &self,
        resource: &AppliedResource,
        manifest: &Value,
        field_manager: &str,
        force: bool,
    ) -> Result<Value, ApplyError> {
        let mut params = PatchParams::apply(field_manager);
        params.force = force;
        let result = self
            .api(resource)
            .patch(&resource.name, &params, &Patch::Apply(manifest))
            .await;
        self.stored(resource, result).await
    }

    async fn create(
        &self,
        resource: &AppliedResource,
        object: &Value,
    ) -> Result<Value, ApplyError> {
        let object: DynamicObject =
            serde_json::from_value(object.clone()).map_err(|e| ApplyError::Rejected {
                code: 400,
                reason: "BadRequest".into(),
                message: format!("the manifest is not a Kubernetes object: {e}"),
            })?;
        let params = PostParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PostParams::default()
        };
        let result = self.api(resource).create(&params, &object).await;
        self.stored(resource, result).await
    }

    async fn replace(
        &self,
        resource: &AppliedResource,
        object: &Value,
    ) -> Result<Value, ApplyError> {
        let object: DynamicObject =
            serde_json::from_value(object.clone()).map_err(|e| ApplyError::Rejected {
                code: 400,
                reason: "BadRequest".into(),
                message: format!("the manifest is not a Kubernetes object: {e}"),
            })?;
        let params = PostParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PostParams::default()
        };
        let result = self
            .api(resource)
            .replace(&resource.name, &params, &object)
            .await;
        self.stored(resource, result).await
    }

    async fn get(&self, resource: &AppliedResource) -> Result<Option<Value>, ApplyError> {
        match self.api(resource).get_opt(&resource.name).await {
            Ok(found) => found.map(to_json).transpose(),
            Err(e) => Err(spoke_error(e)),
        }
    }

    async fn exists(&self, resource: &AppliedResource) -> Result<bool, ApplyError> {
        match self.api(resource).get_metadata_opt(&resource.name).await {
            Ok(found) => Ok(found.is_some()),
            Err(e) => Err(spoke_error(e)),
        }
    }

    async fn review_access(&self, check: &AccessCheck) -> Result<bool, ApplyError> {
        let r = &check.resource;
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(check.user.clone()),
                groups: Some(check.groups.clone()),
                resource_attributes: Some(ResourceAttributes {
                    group: Some(r.group.clone()),
                    version: Some(r.version.clone()),
                    resource: Some(r.resource.clone()),
                    namespace: (!r.namespace.is_empty()).then(|| r.namespace.clone()),
                    name: Some(r.name.clone()),
                    verb: Some(check.verb.clone()),
                    ..ResourceAttributes::default()
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let api: Api<SubjectAccessReview> = Api::all(self.client.clone());
        match api.create(&PostParams::default(), &review).await {
            Ok(answer) => Ok(answer.status.is_some_and(|s| s.allowed)),
            Err(e) => Err(spoke_error(e)),
        }
    }

    async fn dry_run_as(
        &self,
        user: &str,
        resource: &AppliedResource,
        manifest: &Value,
        field_manager: &str,
    ) -> Result<(), ApplyError> {
        let params = PatchParams::apply(field_manager).force().dry_run();
        let api = self.api(resource);
        let bad = |message: String| ApplyError::Rejected {
            code: 400,
            reason: "BadRequest".into(),
            message,
        };
        let mut request = kube::core::Request::new(api.resource_url())
            .patch(&resource.name, &params, &Patch::Apply(manifest))
            .map_err(|e| bad(format!("cannot build the dry run: {e}")))?;
        // Without Impersonate-Group the apiserver gives a service account its own groups
        // (system:serviceaccounts, system:serviceaccounts:<namespace>), so the agent needs
        // impersonate on serviceaccounts only.
        let value = http::HeaderValue::from_str(user)
            .map_err(|_| bad(format!("{user:?} cannot be impersonated")))?;
        request.headers_mut().insert("Impersonate-User", value);
        let result = self.client.request::<DynamicObject>(request).await;
        self.stored(resource, result).await.map(drop)
    }

    fn watch(&self, kind: &ResourceKind) -> BoxStream<'static, ObjectEvent> {
        let gvk = GroupVersionKind::gvk(&kind.group, &kind.version, &kind.kind);
        let ar = ApiResource::from_gvk_with_plural(&gvk, &kind.resource);
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &ar);
        let what = format!("{}/{}", kind.group, kind.resource);
        // The watcher lists, then watches from the list's version, re-lists on `410 Gone`, and
        // backs off on errors (kube-runtime's default backoff); an error only delays events.
        watcher::watcher(api, watcher::Config::default())
            .default_backoff()
            .filter_map(move |event| {
                let what = what.clone();
                async move {
                    match event {
                        Ok(watcher::Event::Apply(obj) | watcher::Event::InitApply(obj)) => {
                            to_json(obj).ok().map(ObjectEvent::Changed)
                        }
                        Ok(watcher::Event::Delete(obj)) => Some(ObjectEvent::Deleted {
                            namespace: obj.metadata.namespace.unwrap_or_default(),
                            name: obj.metadata.name.unwrap_or_default(),
                        }),
                        Ok(watcher::Event::Init | watcher::Event::InitDone) => None,
                        Err(e) => {
                            debug!(resource = %what, error = %e, "watch of applied objects interrupted; resuming");
                            None
                        }
                    }
                }
            })
            .boxed()
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

    fn spec_of(manifests: Vec<Manifest>) -> ManifestWorkSpec {
        ManifestWorkSpec {
            workload: flotilla_proto::api::ManifestsTemplate { manifests },
            ..ManifestWorkSpec::default()
        }
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
        let planned = runtime.block_on(plan_manifests(
            &cluster,
            &spec_of(vec![Manifest(manifest.clone())]),
        ));
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
            &spec_of(vec![
                Manifest(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}})),
                Manifest(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "n", "namespace": "x"}})),
            ]),
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
        let planned = plan_manifests(&cluster, &spec_of(work.to_vec())).await;
        let outcomes = apply_planned(&cluster, &planned, &ApplyContext::default()).await;
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
        let planned = plan_manifests(&cluster, &spec_of(work.to_vec())).await;
        assert!(
            planned[1].target.is_err(),
            "the kind is unknown before the CRD is applied"
        );
        let outcomes = apply_planned(&cluster, &planned, &ApplyContext::default()).await;
        assert!(outcomes.iter().all(|o| o.applied.is_ok()), "{outcomes:?}");
        assert_eq!(outcomes[1].meta.resource, "widgets");
    }

    fn cm(data: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "cfg", "namespace": "default", "labels": {"from": "hub"}},
               "data": {"k": data}})
    }

    fn cm_id() -> AppliedResource {
        AppliedResource {
            group: String::new(),
            version: "v1".into(),
            kind: "ConfigMap".into(),
            resource: "configmaps".into(),
            namespace: "default".into(),
            name: "cfg".into(),
        }
    }

    /// Applies one ConfigMap with `strategy` (OCM's `updateStrategy` JSON) and `context`.
    async fn apply_with(
        cluster: &MemoryCluster,
        manifest: Value,
        strategy: Value,
        context: &ApplyContext,
    ) -> ManifestOutcome {
        let spec: ManifestWorkSpec = serde_json::from_value(json!({
            "workload": {"manifests": [manifest]},
            "manifestConfigs": [{
                "resourceIdentifier": {"resource": "configmaps", "namespace": "default", "name": "cfg"},
                "updateStrategy": strategy,
            }],
        }))
        .unwrap();
        let planned = plan_manifests(cluster, &spec).await;
        apply_planned(cluster, &planned, context).await.remove(0)
    }

    #[tokio::test]
    async fn create_only_creates_once_and_never_updates() {
        let cluster = MemoryCluster::new();
        let strategy = json!({"type": "CreateOnly"});
        let first = apply_with(
            &cluster,
            cm("one"),
            strategy.clone(),
            &ApplyContext::default(),
        )
        .await;
        assert_eq!(first.applied, Ok(()));
        let again = apply_with(&cluster, cm("two"), strategy, &ApplyContext::default()).await;
        assert_eq!(again.applied, Ok(()));
        assert_eq!(cluster.get(&cm_id()).await.unwrap()["data"]["k"], "one");
    }

    #[tokio::test]
    async fn update_merges_labels_keeps_status_and_replaces_the_rest() {
        let cluster = MemoryCluster::new();
        let mut theirs = cm("spoke");
        theirs["metadata"]["labels"] = json!({"team": "ops"});
        cluster
            .apply(&cm_id(), &theirs, "someone", true)
            .await
            .unwrap();
        cluster.set_status(&cm_id(), json!({"seen": true})).await;
        let strategy = json!({"type": "Update"});
        let new = ApplyContext {
            new_generation: true,
            ..ApplyContext::default()
        };
        let o = apply_with(&cluster, cm("hub"), strategy, &new).await;
        assert_eq!(o.applied, Ok(()));
        let stored = cluster.get(&cm_id()).await.unwrap();
        assert_eq!(stored["data"]["k"], "hub");
        assert_eq!(
            stored["metadata"]["labels"],
            json!({"team": "ops", "from": "hub"})
        );
        assert_eq!(stored["status"], json!({"seen": true}));
    }

    #[tokio::test]
    async fn read_only_never_writes_and_reports_what_is_there() {
        let cluster = MemoryCluster::new();
        let strategy = json!({"type": "ReadOnly"});
        let missing = apply_with(
            &cluster,
            cm("x"),
            strategy.clone(),
            &ApplyContext::default(),
        )
        .await;
        assert_eq!(
            (missing.applied, missing.available),
            (Ok(()), Availability::Missing)
        );
        assert!(!missing.owned);
        assert!(
            cluster.get(&cm_id()).await.is_none(),
            "ReadOnly never creates"
        );
        cluster
            .apply(&cm_id(), &cm("theirs"), "someone", true)
            .await
            .unwrap();
        let present = apply_with(&cluster, cm("ours"), strategy, &ApplyContext::default()).await;
        assert_eq!(present.available, Availability::Exists);
        assert_eq!(cluster.get(&cm_id()).await.unwrap()["data"]["k"], "theirs");
    }

    #[tokio::test]
    async fn server_side_apply_with_ignore_fields_leaves_a_spoke_change_alone() {
        let cluster = MemoryCluster::new();
        let strategy = json!({"type": "ServerSideApply", "serverSideApply": {
            "ignoreFields": [{"condition": "OnSpokePresent", "jsonPaths": [".data.k"]}]}});
        let o = apply_with(
            &cluster,
            cm("hub"),
            strategy.clone(),
            &ApplyContext::default(),
        )
        .await;
        assert_eq!(o.applied, Ok(()));
        let stored = cluster.get(&cm_id()).await.unwrap();
        assert_eq!(stored["data"]["k"], "hub", "a new object gets every field");
        assert!(stored["metadata"]["annotations"][CONFIG_SPEC_HASH_ANNOTATION].is_string());
        // The same manifest again: the hash matches, nothing is applied.
        let mut changed = stored.clone();
        changed["data"]["k"] = json!("spoke");
        cluster
            .apply(&cm_id(), &changed, "someone", true)
            .await
            .unwrap();
        apply_with(
            &cluster,
            cm("hub"),
            strategy.clone(),
            &ApplyContext::default(),
        )
        .await;
        assert_eq!(cluster.get(&cm_id()).await.unwrap()["data"]["k"], "spoke");
        // A bad path is refused with OCM's reason.
        let bad = json!({"type": "ServerSideApply", "serverSideApply": {
            "ignoreFields": [{"condition": "OnSpokePresent", "jsonPaths": ["..k"]}]}});
        let o = apply_with(&cluster, cm("hub"), bad, &ApplyContext::default()).await;
        assert_eq!(o.applied.unwrap_err().reason, REASON_IGNORE_FIELD_ERROR);
        let manager =
            json!({"type": "ServerSideApply", "serverSideApply": {"fieldManager": "mine"}});
        let o = apply_with(&cluster, cm("hub"), manager, &ApplyContext::default()).await;
        assert!(
            o.applied
                .unwrap_err()
                .message
                .contains("must start with \"work-agent\"")
        );
    }

    #[tokio::test]
    async fn a_complete_manifest_is_no_longer_updated() {
        let cluster = MemoryCluster::new();
        let strategy = json!({"type": "Update"});
        apply_with(
            &cluster,
            cm("v1"),
            strategy.clone(),
            &ApplyContext::default(),
        )
        .await;
        let complete = ApplyContext {
            complete: [cm_id()].into(),
            new_generation: true,
            ..ApplyContext::default()
        };
        let o = apply_with(&cluster, cm("v2"), strategy, &complete).await;
        assert_eq!(o.applied, Ok(()));
        assert_eq!(cluster.get(&cm_id()).await.unwrap()["data"]["k"], "v1");
    }

    #[tokio::test]
    async fn an_executor_without_the_right_stops_that_manifest_only() {
        let cluster = MemoryCluster::new();
        cluster
            .deny("system:serviceaccount:apps:deployer", "create")
            .await;
        let executor: ManifestWorkExecutor = serde_json::from_value(json!({"subject": {
            "type": "ServiceAccount", "serviceAccount": {"namespace": "apps", "name": "deployer"}}}))
        .unwrap();
        let context = ApplyContext {
            executor: Some(executor),
            ..ApplyContext::default()
        };
        let o = apply_with(&cluster, cm("x"), json!({"type": "Update"}), &context).await;
        let failure = o.applied.unwrap_err();
        assert!(
            failure
                .message
                .contains("may not create configmaps default/cfg"),
            "{}",
            failure.message
        );
        assert!(cluster.get(&cm_id()).await.is_none());
    }

    #[test]
    fn config_identifiers_match_exactly_or_by_wildcard() {
        let id = |ns: &str, name: &str| ResourceIdentifier {
            group: None,
            resource: "configmaps".into(),
            name: name.into(),
            namespace: Some(ns.into()),
        };
        assert!(identifies(&id("default", "cfg"), &cm_id()));
        assert!(identifies(&id("*", "c*"), &cm_id()));
        assert!(identifies(&id("def*t", "*g"), &cm_id()));
        assert!(!identifies(&id("default", "other"), &cm_id()));
        assert!(!identifies(&id("kube-*", "cfg"), &cm_id()));
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
