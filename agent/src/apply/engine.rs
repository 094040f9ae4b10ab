//! The engine that writes a work's manifests to a cluster: checks and resolves each one
//! ([`plan_manifests`], in OCM's order), then writes each by its update strategy
//! ([`apply_planned`]): server-side apply with force by default, OCM's `Update`, `CreateOnly`,
//! `ServerSideApply` (with `ignoreFields`) and `ReadOnly`, after the executor's access checks.
//! One failing manifest never stops the others; the spoke's error is reported verbatim.

use std::collections::BTreeSet;

use flotilla_proto::api::{
    ConditionRule, DeleteOption, FeedbackRule, IgnoreField, Manifest, ManifestConfigOption,
    ManifestResourceMeta, ManifestWorkExecutor, ManifestWorkSpec, PropagationPolicy,
    ResourceIdentifier, UpdateStrategyType, canonical_json,
};
use serde_json::Value;
use sha2::{Digest as _, Sha256};

use super::managers::{FieldConflict, FieldManagers, parse_conflicts, remove_field_path};
use super::target::{
    ApplyError, ApplyTarget, ManifestFailure, REASON_APPLY_CONFLICT, REASON_IGNORE_FIELD_ERROR,
    split_api_version,
};
use crate::cache::AppliedResource;
use crate::executor;
use crate::jsonpath::{self, JsonPath};

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
    /// No `updateStrategy`: server-side apply as the agent's work manager, taking over
    /// conflicts, so the manifest's fields are enforced and fields other managers set are left
    /// alone; an agent that names its hub never takes fields from another hub's agent (see
    /// [`FieldManagers`]).
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
    /// Who the agent writes as, and which other hubs' fields it must not take.
    pub managers: FieldManagers,
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
    let manager = context.managers.work();
    let written = match strategy {
        WriteStrategy::Default if context.managers.hub().is_some() => {
            return apply_beside_other_hubs(target, resource, &p.manifest, &context.managers).await;
        }
        WriteStrategy::Default => target
            .apply(resource, &p.manifest, manager, true)
            .await
            .map_err(ManifestFailure::from),
        WriteStrategy::CreateOnly => create_only(target, resource, &p.manifest, manager).await,
        WriteStrategy::Update => {
            update(
                target,
                resource,
                &p.manifest,
                context.new_generation,
                manager,
            )
            .await
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
    manager: &str,
) -> Result<Value, ManifestFailure> {
    if let Some(existing) = target.get(resource).await? {
        return Ok(existing);
    }
    match target.create(resource, manifest, manager).await {
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
    manager: &str,
) -> Result<Value, ManifestFailure> {
    let mut last = None;
    for _ in 0..UPDATE_ATTEMPTS {
        let result = match target.get(resource).await? {
            None => target.create(resource, manifest, manager).await,
            Some(existing) => {
                let desired = merged_for_update(manifest, &existing);
                if !new_generation && contains(&existing, &desired) {
                    return Ok(existing);
                }
                target.replace(resource, &desired, manager).await
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

/// Removes the field an RFC 6901 JSON pointer names (`/spec/replicas`, `/data/a~1b` for the
/// key `a/b`); a pointer to nothing removes nothing, as a JSON path that matches nothing does.
fn remove_pointer(object: &mut Value, pointer: &str) -> Result<(), String> {
    let Some(rest) = pointer.strip_prefix('/') else {
        return Err(format!(
            "ignoreFields jsonPointer {pointer:?} must start with \"/\" (RFC 6901)"
        ));
    };
    let tokens: Vec<String> = rest
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect();
    let (last, parents) = tokens
        .split_last()
        .expect("split yields at least one token");
    let mut node = object;
    for token in parents {
        let next = match node {
            Value::Object(map) => map.get_mut(token),
            Value::Array(items) => token.parse::<usize>().ok().and_then(|i| items.get_mut(i)),
            _ => None,
        };
        match next {
            Some(child) => node = child,
            None => return Ok(()),
        }
    }
    match node {
        Value::Object(map) => {
            map.remove(last);
        }
        Value::Array(items) => {
            if let Some(i) = last.parse::<usize>().ok().filter(|i| *i < items.len()) {
                items.remove(i);
            }
        }
        _ => {}
    }
    Ok(())
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
            let refused = |message: String| ManifestFailure {
                message,
                retryable: false,
                reason: REASON_IGNORE_FIELD_ERROR,
            };
            if !field.jq_path_expressions.is_empty() {
                return Err(refused(
                    "ignoreFields jqPathExpressions: flotilla does not implement jq expressions \
                     yet; use jsonPaths or jsonPointers"
                        .to_owned(),
                ));
            }
            for path in &field.json_paths {
                let parsed =
                    JsonPath::parse(path).map_err(|e| refused(format!("ignoreFields: {e}")))?;
                jsonpath::remove(&mut required, &parsed);
            }
            for pointer in &field.json_pointers {
                remove_pointer(&mut required, pointer).map_err(refused)?;
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

/// How often a named hub's apply meets new conflicts and tries again without the fields other
/// hubs own: each round leaves out what the last one met, so only hubs writing concurrently
/// need more than two.
const HUB_APPLY_ATTEMPTS: usize = 3;

/// The default strategy of an agent that names its hub: server-side apply without force, so
/// the apiserver says whose fields the manifest would change. A conflict only with managers
/// that are not another hub's agent (kubectl, controllers, this agent before it had a hub
/// name) is taken over by force, as without a hub name. Fields another hub's agent owns are
/// left to it: the rest of the manifest is applied without them, and the manifest reports
/// `ApplyConflict` naming the hubs and the fields. When a field cannot be left out (an item of
/// a list), nothing is applied and the conflict is reported the same way.
async fn apply_beside_other_hubs(
    target: &dyn ApplyTarget,
    resource: &AppliedResource,
    manifest: &Value,
    managers: &FieldManagers,
) -> (Result<(), ManifestFailure>, Option<Value>) {
    let mut intent = manifest.clone();
    let mut left_to_others: Vec<FieldConflict> = Vec::new();
    let mut stored = None;
    for _ in 0..HUB_APPLY_ATTEMPTS {
        let message = match target
            .apply(resource, &intent, managers.work(), false)
            .await
        {
            Ok(object) => {
                stored = Some(object);
                break;
            }
            Err(ApplyError::Rejected {
                code: 409, message, ..
            }) => message,
            Err(e) => return (Err(e.into()), None),
        };
        let conflicts = parse_conflicts(&message);
        let (hubs, others): (Vec<FieldConflict>, Vec<FieldConflict>) = conflicts
            .into_iter()
            .partition(|c| managers.other_hub(&c.manager).is_some());
        if hubs.is_empty() && !others.is_empty() {
            // Nobody's hub: take the fields as every agent does.
            return match target.apply(resource, &intent, managers.work(), true).await {
                Ok(object) => (conflict_outcome(managers, &left_to_others), Some(object)),
                Err(e) => (Err(e.into()), None),
            };
        }
        if hubs.is_empty() {
            // A 409 that is not a field conflict (the object changed in between).
            return (
                Err(ApplyError::Rejected {
                    code: 409,
                    reason: "Conflict".into(),
                    message,
                }
                .into()),
                None,
            );
        }
        let removable = hubs
            .iter()
            .all(|c| remove_field_path(&mut intent, &c.field));
        left_to_others.extend(hubs);
        if !removable {
            return (
                conflict_outcome(managers, &left_to_others),
                target.get(resource).await.ok().flatten(),
            );
        }
    }
    match stored {
        Some(object) => (conflict_outcome(managers, &left_to_others), Some(object)),
        None => (
            Err(ManifestFailure {
                message: format!(
                    "other hubs kept changing fields of this object while it was applied: {}",
                    describe_conflicts(managers, &left_to_others)
                ),
                retryable: true,
                reason: REASON_APPLY_CONFLICT,
            }),
            None,
        ),
    }
}

/// `Ok` when no field was left to another hub, else the manifest's `ApplyConflict`.
fn conflict_outcome(
    managers: &FieldManagers,
    left_to_others: &[FieldConflict],
) -> Result<(), ManifestFailure> {
    if left_to_others.is_empty() {
        return Ok(());
    }
    Err(ManifestFailure {
        message: format!(
            "{}; the other fields of the manifest are applied",
            describe_conflicts(managers, left_to_others)
        ),
        // Not without a change: to either hub's work, or the other hub letting go.
        retryable: false,
        reason: REASON_APPLY_CONFLICT,
    })
}

/// "hub b (flotilla-work-agent/b) owns .data.x, .data.y with other values", one clause per
/// manager, in the order met.
fn describe_conflicts(managers: &FieldManagers, conflicts: &[FieldConflict]) -> String {
    let mut by_manager: Vec<(&str, Vec<&str>)> = Vec::new();
    for c in conflicts {
        match by_manager.iter_mut().find(|(m, _)| *m == c.manager) {
            Some((_, fields)) => fields.push(&c.field),
            None => by_manager.push((&c.manager, vec![&c.field])),
        }
    }
    let clauses: Vec<String> = by_manager
        .into_iter()
        .map(|(manager, fields)| {
            let who = managers.other_hub(manager).map_or_else(
                || manager.to_owned(),
                |hub| format!("hub {hub} ({manager})"),
            );
            format!("{who} applies {} with other values", fields.join(", "))
        })
        .collect();
    format!(
        "not applied where another hub's agent owns the field: {}",
        clauses.join("; ")
    )
}
