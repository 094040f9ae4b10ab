//! One ConfigurationPolicy template against the spoke: read what proto's [`reads`] asks for,
//! judge with [`evaluate`], make the writes `enforce` needs, and judge again what the writes
//! left. And pruning, when the policy goes away.
//!
//! Writes are OCM's: a missing object is created (a create call), a differing one updated (an
//! update call carrying the `resourceVersion` read, so a concurrent change makes it conflict
//! instead of being overwritten), a `mustnothave` object deleted; all as
//! [`POLICY_FIELD_MANAGER`]. An object the policy creates is marked with
//! [`ANNOTATION_CREATED_BY_POLICY`] (the policy's uid): the mark lives on the spoke, so
//! `DeleteIfCreated` still knows what is the policy's after the agent restarts, and
//! comparisons ignore it.
//!
//! An object-template's managed-cluster templates (`{{ ... }}`) are rendered first, at every
//! evaluation, reading what `lookup`, `fromConfigMap` and `fromClusterClaim` name from the
//! spoke (at most [`MAX_LOOKUPS`] objects, each watched like the template's own reads); one that
//! fails makes its object-template NonCompliant with the template and the error, and changes
//! and prunes nothing.
//!
//! Nothing here stops on the spoke's refusal: a kind it does not serve, a read or a write it
//! refuses, makes the object-template NonCompliant with the spoke's own words and the other
//! object-templates are still evaluated.

use std::collections::BTreeMap;

use flotilla_proto::api::policy::template::{
    self, Dialect, Lookup, MAX_LOOKUPS, RenderError, TemplateData,
};
use flotilla_proto::api::policy::{
    self as policy, ANNOTATION_CREATED_BY_POLICY, Compliance, ComplianceType, ConfigurationPolicy,
    EnforceAction, NamespaceInfo, ObjectDefinition, ObjectProperties, ObjectRead, ObjectTemplate,
    Observed, PruneObjectBehavior, RelatedObject, RemediationAction, TemplateEvaluation, evaluate,
    prune_actions, prune_reads, reads, select_namespaces,
};
use serde_json::{Value, json};
use tracing::warn;

use super::MAX_LISTED_OBJECTS;
use crate::apply::{ApplyError, ApplyTarget, ResourceKind};
use crate::cache::AppliedResource;

/// The field manager of every write a policy makes (OCM's controller has its own too).
pub const POLICY_FIELD_MANAGER: &str = "flotilla-policy-agent";

/// A ConfigurationPolicy as delivered inside a Policy, with what the Policy decides for it.
#[derive(Clone, Debug)]
pub(crate) struct ConfigurationTemplate {
    /// The uid of the root Policy carrying it: the mark on what it creates.
    pub policy_uid: String,
    pub policy: ConfigurationPolicy,
    /// The effective one: the Policy's `remediationAction` overrides the template's.
    pub remediation: RemediationAction,
    pub prune: PruneObjectBehavior,
}

/// What one read covered, so that a change on the spoke can be matched to the templates that
/// read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ReadScope {
    pub kind: ResourceKind,
    /// `None`: every namespace (or a cluster-scoped kind).
    pub namespace: Option<String>,
    /// `None`: every object (a list).
    pub name: Option<String>,
}

impl ReadScope {
    /// Whether a change to the object `namespace`/`name` of this scope's kind could change
    /// what the read returns.
    pub fn covers(&self, namespace: &str, name: &str) -> bool {
        self.namespace.as_deref().is_none_or(|ns| ns == namespace)
            && self.name.as_deref().is_none_or(|n| n == name)
    }
}

/// The result of evaluating one ConfigurationPolicy.
#[derive(Clone, Debug)]
pub(crate) struct TemplateOutcome {
    pub compliance: Compliance,
    /// The object-templates' messages, `; `-separated: each violation names the object and
    /// the fields, or carries the spoke's error.
    pub message: String,
    /// What was read, for the watches.
    pub scopes: Vec<ReadScope>,
    /// The objects its musthave and mustonlyhave object-templates name that exist, with
    /// whether this policy created them: what a later change of the template may prune.
    pub related: Vec<RelatedObject>,
    /// An object-template's templates did not render, so `related` is not all the template
    /// names: what it related to before is kept, and nothing was pruned.
    pub unresolved: bool,
}

/// The outcome of one object-template.
struct ObjectOutcome {
    compliance: Compliance,
    message: String,
    related: Vec<RelatedObject>,
    /// Its templates did not render.
    unresolved: bool,
}

impl ObjectOutcome {
    fn refused(message: String) -> ObjectOutcome {
        ObjectOutcome {
            compliance: Compliance::NonCompliant,
            message,
            related: Vec::new(),
            unresolved: false,
        }
    }
}

/// Evaluates `template` on the spoke; under `enforce` repairs what it can first. `superseded`
/// is what the template related to before the hub changed it: under `enforce` with a
/// `pruneObjectBehavior`, the objects it no longer names are pruned (problems are logged).
pub(crate) async fn evaluate_template(
    target: &dyn ApplyTarget,
    template: &ConfigurationTemplate,
    superseded: Option<&[RelatedObject]>,
) -> TemplateOutcome {
    let mut pass = Pass::new(target, template);
    let mut compliance = Compliance::Compliant;
    let mut messages = Vec::new();
    let mut related = Vec::new();
    let mut unresolved = false;
    for object_template in &template.policy.spec.object_templates {
        let outcome = pass
            .object_template(object_template, template.remediation)
            .await;
        if outcome.compliance == Compliance::NonCompliant {
            compliance = Compliance::NonCompliant;
        }
        messages.push(outcome.message);
        unresolved |= outcome.unresolved;
        if !is_mustnothave(object_template) {
            related.extend(outcome.related);
        }
    }
    // Without every object the template names, a prune could delete one it still names.
    if let Some(previous) = superseded.filter(|_| !unresolved) {
        for problem in pass.prune(previous, &related).await {
            warn!(
                template = %template.policy.metadata.name.as_deref().unwrap_or_default(),
                problem = %problem,
                "pruning an object the changed policy no longer names failed"
            );
        }
    }
    TemplateOutcome {
        compliance,
        message: messages.join("; "),
        scopes: pass.scopes,
        related,
        unresolved,
    }
}

fn is_mustnothave(object_template: &ObjectTemplate) -> bool {
    ComplianceType::parse(&object_template.compliance_type) == Some(ComplianceType::MustNotHave)
}

/// Prunes what `pruneObjectBehavior` says once the policy is gone from the cluster, reading
/// the spoke afresh (the created-by marks on the objects say what is the policy's); returns
/// the problems met, for the caller to log. Only under `enforce`, as in OCM; `mustnothave`
/// object-templates name nothing to prune. `superseded`: what it named before a change the
/// governor had not evaluated yet, pruned too.
pub(crate) async fn prune_template(
    target: &dyn ApplyTarget,
    template: &ConfigurationTemplate,
    superseded: Option<&[RelatedObject]>,
) -> Vec<String> {
    if template.remediation != RemediationAction::Enforce
        || template.prune == PruneObjectBehavior::None
    {
        return Vec::new();
    }
    let mut pass = Pass::new(target, template);
    let mut problems = Vec::new();
    let mut related = Vec::new();
    for object_template in &template.policy.spec.object_templates {
        if is_mustnothave(object_template) {
            continue;
        }
        let object_template = match pass.rendered(object_template).await {
            Ok(rendered) => rendered,
            Err(message) => {
                // What it names is not known: its objects stay.
                problems.push(message);
                continue;
            }
        };
        let outcome = pass
            .read_and_judge(&object_template, RemediationAction::Inform)
            .await;
        match outcome {
            Ok((_, related_now)) => related.extend(related_now),
            Err(message) => problems.push(message),
        }
    }
    related.extend(superseded.into_iter().flatten().cloned());
    problems.extend(pass.prune(&related, &[]).await);
    problems
}

/// One evaluation's reads and writes; the namespaces are listed at most once.
struct Pass<'a> {
    target: &'a dyn ApplyTarget,
    template: &'a ConfigurationTemplate,
    namespaces: Option<Result<Vec<String>, String>>,
    scopes: Vec<ReadScope>,
}

impl<'a> Pass<'a> {
    fn new(target: &'a dyn ApplyTarget, template: &'a ConfigurationTemplate) -> Pass<'a> {
        Pass {
            target,
            template,
            namespaces: None,
            scopes: Vec::new(),
        }
    }

    async fn object_template(
        &mut self,
        object_template: &ObjectTemplate,
        remediation: RemediationAction,
    ) -> ObjectOutcome {
        let object_template = match self.rendered(object_template).await {
            Ok(rendered) => rendered,
            Err(message) => {
                return ObjectOutcome {
                    unresolved: true,
                    ..ObjectOutcome::refused(message)
                };
            }
        };
        let object_template = &object_template;
        let (evaluation, related) = match self.read_and_judge(object_template, remediation).await {
            Ok(judged) => judged,
            Err(message) => return ObjectOutcome::refused(message),
        };
        if evaluation.actions.is_empty() {
            return ObjectOutcome {
                compliance: evaluation.compliance,
                message: describe(&evaluation),
                related,
                unresolved: false,
            };
        }
        let mut refused = Vec::new();
        for action in &evaluation.actions {
            if let Err(message) = self.write(action).await {
                refused.push(message);
            }
        }
        // What the writes left, judged without writing again: a write the spoke refused is
        // not retried until the next evaluation.
        let (after, related) = match self
            .read_and_judge(object_template, RemediationAction::Inform)
            .await
        {
            Ok(judged) => judged,
            Err(message) => return ObjectOutcome::refused(message),
        };
        let mut message = describe(&after);
        let mut compliance = after.compliance;
        if !refused.is_empty() {
            compliance = Compliance::NonCompliant;
            message = format!("{message}; {}", refused.join("; "));
        }
        ObjectOutcome {
            compliance,
            message,
            related,
            unresolved: false,
        }
    }

    /// `object_template` with its managed-cluster templates rendered, reading from the spoke
    /// what they look up; `Err` says which template failed and why.
    async fn rendered(
        &mut self,
        object_template: &ObjectTemplate,
    ) -> Result<ObjectTemplate, String> {
        let definition = &object_template.object_definition.0;
        if !template::has_templates(definition, &Dialect::Managed) {
            return Ok(object_template.clone());
        }
        let mut reads = SpokeReads::default();
        loop {
            // Bound first: nothing of the render may live across the read's await.
            let rendered = template::render(definition, &Dialect::Managed, &reads);
            match rendered {
                Ok(rendered) => {
                    return Ok(ObjectTemplate {
                        object_definition: ObjectDefinition(rendered),
                        ..object_template.clone()
                    });
                }
                Err(RenderError::NeedsRead { lookup }) => {
                    if reads.objects.len() >= MAX_LOOKUPS {
                        return Err(format!(
                            "failed to resolve the templates: they read more than {MAX_LOOKUPS} objects"
                        ));
                    }
                    let answer = self.look_up(&lookup).await;
                    reads.objects.insert(lookup, answer);
                }
                Err(failed) => return Err(failed.to_string()),
            }
        }
    }

    /// One object a template reads: `Null` when it does not exist. The read is watched like
    /// the template's own, so a change to it evaluates the template again.
    async fn look_up(&mut self, lookup: &Lookup) -> Result<Value, String> {
        let kind = self
            .target
            .resolve(&lookup.api_version, &lookup.kind)
            .await
            .map_err(|e| e.to_string())?;
        let namespace =
            (kind.namespaced && !lookup.namespace.is_empty()).then_some(lookup.namespace.as_str());
        if kind.namespaced && namespace.is_none() {
            return Err(format!(
                "{} {} is namespaced; name its namespace",
                lookup.kind, lookup.name
            ));
        }
        let scope = ReadScope {
            kind: kind.clone(),
            namespace: namespace.map(str::to_string),
            name: Some(lookup.name.clone()),
        };
        if !self.scopes.contains(&scope) {
            self.scopes.push(scope);
        }
        self.target
            .get(&resource(&kind, namespace, &lookup.name))
            .await
            .map(Option::unwrap_or_default)
            .map_err(|e| format!("cannot read {} [{}]: {e}", kind.resource, lookup.name))
    }

    /// Deletes what `pruneObjectBehavior` says of the objects in `previous` that are not in
    /// `current`, each read again first; the problems met.
    async fn prune(&self, previous: &[RelatedObject], current: &[RelatedObject]) -> Vec<String> {
        let (behavior, remediation) = (self.template.prune, self.template.remediation);
        let mut problems = Vec::new();
        let mut observed = BTreeMap::new();
        for read in prune_reads(behavior, remediation, previous, current) {
            let kind = match self.target.resolve(&read.api_version, &read.kind).await {
                Ok(kind) => kind,
                Err(e) => {
                    problems.push(e.to_string());
                    continue;
                }
            };
            match self.read(&kind, &read).await {
                Ok(found) => {
                    observed.insert(read, found);
                }
                Err(message) => problems.push(message),
            }
        }
        for action in prune_actions(behavior, remediation, previous, current, &observed) {
            if let Err(message) = self.write(&action).await {
                problems.push(message);
            }
        }
        problems
    }

    /// Reads what `object_template` names and judges it; the objects related, with their
    /// created-by properties. `Err` is the spoke's refusal, as the template's message.
    async fn read_and_judge(
        &mut self,
        object_template: &ObjectTemplate,
        remediation: RemediationAction,
    ) -> Result<(TemplateEvaluation, Vec<RelatedObject>), String> {
        let definition = &object_template.object_definition;
        let (Some(api_version), Some(kind_name)) = (definition.api_version(), definition.kind())
        else {
            // The evaluator words what is missing.
            let evaluation = evaluate(
                object_template,
                remediation,
                &policy::ResourceKind {
                    plural: String::new(),
                    namespaced: false,
                },
                &[],
                &BTreeMap::new(),
            );
            return Err(evaluation.message);
        };
        let kind = self
            .target
            .resolve(api_version, kind_name)
            .await
            .map_err(|e| e.to_string())?;
        let judged_kind = policy::ResourceKind {
            plural: kind.resource.clone(),
            namespaced: kind.namespaced,
        };
        let namespaces = if kind.namespaced && definition.namespace().is_none() {
            self.selected_namespaces().await?
        } else {
            Vec::new()
        };
        let wanted =
            reads(object_template, &judged_kind, &namespaces).map_err(|e| e.to_string())?;
        let mut observed = BTreeMap::new();
        for read in wanted {
            let scope = ReadScope {
                kind: kind.clone(),
                namespace: read.namespace.clone(),
                name: read.name.clone(),
            };
            if !self.scopes.contains(&scope) {
                self.scopes.push(scope);
            }
            let found = self.read(&kind, &read).await?;
            observed.insert(read, found);
        }
        let evaluation = evaluate(
            object_template,
            remediation,
            &judged_kind,
            &namespaces,
            &observed,
        );
        let related = self.related(&evaluation, &observed);
        Ok((evaluation, related))
    }

    /// The namespaces the template's `namespaceSelector` selects, listed once per pass.
    async fn selected_namespaces(&mut self) -> Result<Vec<String>, String> {
        if let Some(selected) = &self.namespaces {
            return selected.clone();
        }
        let selected = self.list_selected_namespaces().await;
        self.namespaces = Some(selected.clone());
        selected
    }

    async fn list_selected_namespaces(&mut self) -> Result<Vec<String>, String> {
        let selector = &self.template.policy.spec.namespace_selector;
        if selector.is_empty() {
            return Ok(Vec::new());
        }
        let kind = self
            .target
            .resolve("v1", "Namespace")
            .await
            .map_err(|e| e.to_string())?;
        self.scopes.push(ReadScope {
            kind: kind.clone(),
            namespace: None,
            name: None,
        });
        let listed = self
            .target
            .list(&kind, None, MAX_LISTED_OBJECTS)
            .await
            .map_err(|e| format!("cannot list the namespaces for namespaceSelector: {e}"))?;
        let namespaces: Vec<NamespaceInfo> = listed.iter().map(namespace_info).collect();
        select_namespaces(selector, &namespaces).map_err(|e| format!("namespaceSelector: {e}"))
    }

    async fn read(&self, kind: &ResourceKind, read: &ObjectRead) -> Result<Observed, String> {
        let location = read
            .namespace
            .as_deref()
            .map(|ns| format!(" in namespace {ns}"))
            .unwrap_or_default();
        match &read.name {
            Some(name) => self
                .target
                .get(&resource(kind, read.namespace.as_deref(), name))
                .await
                .map(Observed::Object)
                .map_err(|e| format!("cannot read {} [{name}]{location}: {e}", kind.resource)),
            None => self
                .target
                .list(kind, read.namespace.as_deref(), MAX_LISTED_OBJECTS)
                .await
                .map(Observed::List)
                .map_err(|e| match e {
                    ApplyError::TooMany { .. } => e.to_string(),
                    e => format!("cannot list {}{location}: {e}", kind.resource),
                }),
        }
    }

    /// Makes one write; `Err` says what the spoke refused, naming the object.
    async fn write(&self, action: &EnforceAction) -> Result<(), String> {
        let field = |object: &Value, pointer: &str| {
            object
                .pointer(pointer)
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        let (verb, api_version, kind, namespace, name) = match action {
            EnforceAction::Create { object } | EnforceAction::Update { object } => (
                if matches!(action, EnforceAction::Create { .. }) {
                    "create"
                } else {
                    "update"
                },
                field(object, "/apiVersion").unwrap_or_default(),
                field(object, "/kind").unwrap_or_default(),
                field(object, "/metadata/namespace"),
                field(object, "/metadata/name").unwrap_or_default(),
            ),
            EnforceAction::Delete {
                api_version,
                kind,
                namespace,
                name,
            } => (
                "delete",
                api_version.clone(),
                kind.clone(),
                namespace.clone(),
                name.clone(),
            ),
        };
        let refused = |e: ApplyError, plural: &str| {
            let location = namespace
                .as_deref()
                .map(|ns| format!(" in namespace {ns}"))
                .unwrap_or_default();
            format!("enforce could not {verb} {plural} [{name}]{location}: {e}")
        };
        let kind = self
            .target
            .resolve(&api_version, &kind)
            .await
            .map_err(|e| refused(e, &kind.to_ascii_lowercase()))?;
        let namespace_of = if kind.namespaced {
            namespace.as_deref()
        } else {
            None
        };
        let at = resource(&kind, namespace_of, &name);
        let result = match action {
            EnforceAction::Create { object } => {
                let mut object = object.clone();
                mark_created(&mut object, &self.template.policy_uid);
                match self.target.create(&at, &object, POLICY_FIELD_MANAGER).await {
                    // Created meanwhile by someone else: the judgement after the writes says
                    // whether it is as the template wants.
                    Err(ApplyError::Rejected { code: 409, .. }) => Ok(()),
                    other => other.map(drop),
                }
            }
            EnforceAction::Update { object } => self
                .target
                .replace(&at, object, POLICY_FIELD_MANAGER)
                .await
                .map(drop),
            EnforceAction::Delete { .. } => self.target.delete(&at).await.map(drop),
        };
        result.map_err(|e| refused(e, &kind.resource))
    }

    /// The related objects of `evaluation` that exist, with whether this policy created them.
    fn related(
        &self,
        evaluation: &TemplateEvaluation,
        observed: &BTreeMap<ObjectRead, Observed>,
    ) -> Vec<RelatedObject> {
        evaluation
            .objects
            .iter()
            .filter_map(|verdict| {
                let meta = &verdict.related.object.metadata;
                let found = observed.iter().find_map(|(read, answer)| {
                    if read.namespace.as_deref().unwrap_or_default() != meta.namespace {
                        return None;
                    }
                    match answer {
                        Observed::Object(Some(object))
                            if read.name.as_deref() == Some(meta.name.as_str()) =>
                        {
                            Some(object)
                        }
                        Observed::List(items) => items.iter().find(|o| {
                            o.pointer("/metadata/name").and_then(Value::as_str)
                                == Some(meta.name.as_str())
                        }),
                        _ => None,
                    }
                })?;
                let mut related = verdict.related.clone();
                related.properties = Some(ObjectProperties {
                    created_by_policy: Some(
                        found
                            .pointer("/metadata/annotations")
                            .and_then(|a| a.get(ANNOTATION_CREATED_BY_POLICY))
                            .and_then(Value::as_str)
                            == Some(self.template.policy_uid.as_str()),
                    ),
                    uid: found
                        .pointer("/metadata/uid")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string(),
                });
                Some(related)
            })
            .collect()
    }
}

/// What the spoke answered to a template's reads so far; `.` is empty on the managed cluster.
struct SpokeReads {
    dot: Value,
    objects: BTreeMap<Lookup, Result<Value, String>>,
}

impl Default for SpokeReads {
    fn default() -> Self {
        SpokeReads {
            dot: json!({}),
            objects: BTreeMap::new(),
        }
    }
}

impl TemplateData for SpokeReads {
    fn dot(&self) -> &Value {
        &self.dot
    }

    fn read(&self, lookup: &Lookup) -> Option<Result<Value, String>> {
        self.objects.get(lookup).cloned()
    }
}

/// The message of one object-template: when it is violated, each violating object's own
/// message (which names the fields that differ), else the evaluator's combined message.
fn describe(evaluation: &TemplateEvaluation) -> String {
    if evaluation.compliance == Compliance::Compliant || evaluation.objects.is_empty() {
        return evaluation.message.clone();
    }
    let mut messages: Vec<&str> = Vec::new();
    for object in &evaluation.objects {
        if object.compliance == Compliance::NonCompliant
            && !messages.contains(&object.message.as_str())
        {
            messages.push(&object.message);
        }
    }
    messages.join("; ")
}

pub(crate) fn mark_created(object: &mut Value, policy_uid: &str) {
    let Some(metadata) = object.as_object_mut().map(|o| {
        o.entry("metadata")
            .or_insert_with(|| Value::Object(Default::default()))
    }) else {
        return;
    };
    let Some(metadata) = metadata.as_object_mut() else {
        return;
    };
    let annotations = metadata
        .entry("annotations")
        .or_insert_with(|| Value::Object(Default::default()));
    if let Some(annotations) = annotations.as_object_mut() {
        annotations.insert(
            ANNOTATION_CREATED_BY_POLICY.to_string(),
            Value::String(policy_uid.to_string()),
        );
    }
}

pub(crate) fn resource(
    kind: &ResourceKind,
    namespace: Option<&str>,
    name: &str,
) -> AppliedResource {
    AppliedResource {
        group: kind.group.clone(),
        version: kind.version.clone(),
        kind: kind.kind.clone(),
        resource: kind.resource.clone(),
        namespace: namespace.unwrap_or_default().to_string(),
        name: name.to_string(),
    }
}

fn namespace_info(namespace: &Value) -> NamespaceInfo {
    let metadata = &namespace["metadata"];
    NamespaceInfo {
        name: metadata["name"].as_str().unwrap_or_default().to_string(),
        labels: metadata["labels"]
            .as_object()
            .map(|labels| {
                labels
                    .iter()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                    .collect()
            })
            .unwrap_or_default(),
        terminating: metadata
            .get("deletionTimestamp")
            .is_some_and(|t| !t.is_null()),
    }
}
