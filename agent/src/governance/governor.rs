//! The governor task: which templates are due (proto's [`EvaluationSchedule`], keyed per
//! template), evaluations run off the loop with a bound, watches that make templates due,
//! removals that prune, and the reports out.
//!
//! A template is due when its policy arrives or changes, when an object it read changes (under
//! `evaluationInterval: watch`, the default) and when its interval runs out. A result is kept
//! only if it is of the policy as it is now (an evaluation of an older delivery is dropped,
//! and the schedule evaluates the new one next); a policy is reported once each of its
//! templates has a result for its current delivery, and again whenever that report changes.
//!
//! Pruning: a removed policy's templates, and a template the hub dropped from its policy, are
//! pruned once no evaluation of the policy is in flight, at most [`MAX_CONCURRENT_PRUNES`] at
//! once and in order per policy; what a changed template no longer names is pruned by the
//! first evaluation of the change.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use flotilla_ops::sleep_until;
use flotilla_proto::api::policy::{
    ANNOTATION_HUB_TEMPLATES_ERROR, Compliance, ConfigurationPolicy, EvaluationInterval,
    EvaluationSchedule, POLICY_GROUP, PruneObjectBehavior, RelatedObject, effective_remediation,
    validate_policy,
};
use k8s_openapi::jiff::Timestamp;
use serde_json::Value;
use sha2::{Digest as _, Sha256};
use tokio::sync::{mpsc, oneshot};
use tokio::task::{Id, JoinSet};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::engine_templates::{
    Engine, EngineTemplate, evaluate_engine_template, remove_engine_template,
};
use super::evaluation::{
    ConfigurationTemplate, ReadScope, TemplateOutcome, evaluate_template, prune_template,
};
use super::history::{PolicyHistory, Stamp};
use super::watches::{KindWatches, WatchedChange, kind_key};
use super::{
    DeliveredPolicy, MAX_CONCURRENT_EVALUATIONS, MAX_CONCURRENT_PRUNES, MAX_POLICIES, PolicyReport,
    REPORT_CHANNEL,
};
use crate::apply::ApplyTarget;

/// Commands queued from the handles.
const COMMAND_CHANNEL: usize = 64;

/// The governor has stopped (the agent is shutting down). Not retryable: the policies are
/// delivered again to the next governor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the policy governor has stopped")]
pub struct GovernorStopped;

enum Command {
    Upsert(Box<DeliveredPolicy>),
    Remove(String, oneshot::Sender<()>),
}

/// Tells the governor what the hub delivered; cheap to clone.
#[derive(Clone, Debug)]
pub struct GovernorHandle {
    commands: mpsc::Sender<Command>,
}

impl GovernorHandle {
    /// The policy arrived or changed: it is evaluated at once. Delivering the same policy
    /// again changes nothing.
    pub async fn upsert(&self, policy: DeliveredPolicy) -> Result<(), GovernorStopped> {
        self.commands
            .send(Command::Upsert(Box::new(policy)))
            .await
            .map_err(|_| GovernorStopped)
    }

    /// The policy is no longer delivered to this cluster: it stops being evaluated, and this
    /// returns once its `pruneObjectBehavior` is carried out (each delete done, or failed and
    /// logged). Removing a policy the governor does not hold returns at once.
    pub async fn remove(&self, uid: &str) -> Result<(), GovernorStopped> {
        let (done, finished) = oneshot::channel();
        self.commands
            .send(Command::Remove(uid.to_string(), done))
            .await
            .map_err(|_| GovernorStopped)?;
        finished.await.map_err(|_| GovernorStopped)
    }
}

/// The agent's policy evaluator; see the module docs.
pub struct Governor {
    target: Arc<dyn ApplyTarget>,
    commands: mpsc::Receiver<Command>,
    reports: mpsc::Sender<PolicyReport>,
}

impl std::fmt::Debug for Governor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Governor").finish_non_exhaustive()
    }
}

impl Governor {
    /// A governor evaluating on `target`, its handle, and the reports it sends (bounded: when
    /// the receiver lags, only the latest report of each policy waits).
    pub fn new(
        target: Arc<dyn ApplyTarget>,
    ) -> (Governor, GovernorHandle, mpsc::Receiver<PolicyReport>) {
        let (commands_tx, commands) = mpsc::channel(COMMAND_CHANNEL);
        let (reports, reports_rx) = mpsc::channel(REPORT_CHANNEL);
        (
            Governor {
                target,
                commands,
                reports,
            },
            GovernorHandle {
                commands: commands_tx,
            },
            reports_rx,
        )
    }

    /// Runs until `shutdown` completes. Evaluations and prunes in flight are then abandoned
    /// (each is idempotent; a removal not finished makes its `remove` fail, so it is asked
    /// again).
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let Governor {
            target,
            mut commands,
            reports,
        } = self;
        let mut state = State::new(target);
        let mut commands_open = true;
        let mut consumer_gone = false;
        loop {
            state.start_due();
            state.start_prunes();
            let timeout = state.schedule.poll_timeout();
            tokio::select! {
                command = commands.recv(), if commands_open => match command {
                    Some(Command::Upsert(policy)) => state.upsert(*policy),
                    Some(Command::Remove(uid, done)) => state.remove(&uid, done),
                    // Every handle is gone: keep evaluating what is held until shutdown.
                    None => commands_open = false,
                },
                Some(change) = state.watches.next_change() => state.object_changed(&change),
                Some(joined) = state.evaluations.join_next_with_id(), if !state.evaluations.is_empty() => {
                    state.evaluated(joined);
                }
                Some(joined) = state.prunes.join_next_with_id(), if !state.prunes.is_empty() => {
                    state.pruned(joined);
                }
                _ = sleep_until(timeout) => state.schedule.handle_timeout(Instant::now()),
                permit = reports.reserve(), if !state.pending.is_empty() && !consumer_gone => {
                    match permit {
                        Ok(permit) => {
                            if let Some((_, report)) = state.pending.pop_first() {
                                permit.send(report);
                            }
                        }
                        Err(_) => {
                            debug!("nobody reads policy reports any more");
                            consumer_gone = true;
                            state.pending.clear();
                        }
                    }
                }
                _ = &mut shutdown => break,
            }
        }
        state.evaluations.shutdown().await;
        state.prunes.shutdown().await;
    }
}

/// What a template is, as far as evaluating it goes.
#[derive(Clone, Debug)]
enum TemplateKind {
    /// Evaluated on the spoke.
    Configuration(Arc<ConfigurationTemplate>),
    /// Applied, and judged by another engine's reports (Gatekeeper, Kyverno).
    Engine(Arc<EngineTemplate>),
    /// Not evaluated: its result is fixed when the policy arrives (an invalid policy, a kind
    /// the agent does not evaluate).
    Fixed,
}

#[derive(Debug)]
struct TemplateSlot {
    name: String,
    kind: TemplateKind,
    /// Its result for the policy as delivered now; `None` until evaluated.
    result: Option<(Compliance, String)>,
    /// What its last evaluation read.
    scopes: Vec<ReadScope>,
    /// What its last evaluation found it names (with whether the policy created each).
    related: Vec<RelatedObject>,
    /// What it named before the hub changed it, until an evaluation of the change prunes what
    /// it no longer names.
    superseded: Option<Arc<Vec<RelatedObject>>>,
}

#[derive(Debug)]
struct PolicyEntry {
    held: Held,
    /// Which delivery this is, to drop results of older ones.
    revision: u64,
    templates: Vec<TemplateSlot>,
}

/// What the governor keeps of a delivery once its templates are built: enough to name it,
/// stamp its history and tell a resend from a change. Not the policy itself: its templates hold
/// what evaluation needs, and a parsed copy of every policy was a quarter of the load test's
/// memory at 10,000 simulated clusters.
#[derive(Debug, PartialEq)]
struct Held {
    generation: i64,
    namespace: String,
    name: String,
    /// SHA-256 of the policy as delivered (its JSON): the same generation can carry other
    /// content (hub templates resolved again).
    digest: [u8; 32],
}

impl Held {
    fn of(delivered: &DeliveredPolicy) -> Held {
        let meta = &delivered.policy.metadata;
        // A typed Policy always serialises; its maps are ordered, so equal policies hash
        // equal.
        let mut digest = Sha256::new();
        let _ = serde_json::to_writer(&mut digest, &delivered.policy);
        Held {
            generation: delivered.generation,
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            digest: digest.finalize().into(),
        }
    }

    /// `namespace/name`, as people write it.
    fn display(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// A prune not started yet: of a removed policy, or of the templates a changed policy dropped.
/// It waits for the policy's evaluations in flight to end, so that an enforce write cannot land
/// after the prune read, then for a prune slot.
#[derive(Default)]
struct Removal {
    /// Taken when its prune starts; with what each named before a change not yet evaluated.
    templates: Vec<(TemplateKind, Option<Arc<Vec<RelatedObject>>>)>,
    /// Told once the prune is over.
    waiters: Vec<oneshot::Sender<()>>,
    /// In `prune_queue`.
    queued: bool,
}

/// A prune running.
struct Pruning {
    uid: String,
    /// Told once it ends.
    waiters: Vec<oneshot::Sender<()>>,
}

/// An evaluation in flight.
struct Running {
    uid: String,
    index: usize,
    revision: u64,
}

struct State {
    target: Arc<dyn ApplyTarget>,
    policies: HashMap<String, PolicyEntry>,
    /// Keyed `uid/index` (see [`schedule_key`]).
    schedule: EvaluationSchedule,
    histories: HashMap<String, PolicyHistory>,
    watches: KindWatches,
    evaluations: JoinSet<TemplateOutcome>,
    running: HashMap<Id, Running>,
    removals: HashMap<String, Removal>,
    /// Removals ready to prune, in order; at most [`MAX_CONCURRENT_PRUNES`] prune at once.
    prune_queue: VecDeque<String>,
    prunes: JoinSet<()>,
    /// Prune task → the policy it prunes.
    pruning: HashMap<Id, Pruning>,
    /// Reports not yet taken by the consumer, one per policy: a newer one replaces it.
    pending: BTreeMap<String, PolicyReport>,
    next_revision: u64,
}

fn schedule_key(uid: &str, index: usize) -> String {
    format!("{uid}/{index}")
}

fn parse_key(key: &str) -> Option<(&str, usize)> {
    let (uid, index) = key.rsplit_once('/')?;
    Some((uid, index.parse().ok()?))
}

impl State {
    fn new(target: Arc<dyn ApplyTarget>) -> State {
        State {
            watches: KindWatches::new(Arc::clone(&target)),
            target,
            policies: HashMap::new(),
            schedule: EvaluationSchedule::new(),
            histories: HashMap::new(),
            evaluations: JoinSet::new(),
            running: HashMap::new(),
            removals: HashMap::new(),
            prune_queue: VecDeque::new(),
            prunes: JoinSet::new(),
            pruning: HashMap::new(),
            pending: BTreeMap::new(),
            next_revision: 0,
        }
    }

    fn upsert(&mut self, delivered: DeliveredPolicy) {
        let uid = delivered.uid.clone();
        let held = Held::of(&delivered);
        if self.policies.get(&uid).is_some_and(|p| p.held == held) {
            // Resent as it was (a session resumed): nothing to do.
            return;
        }
        let previous = self.policies.remove(&uid);
        let mut templates = template_slots(&delivered);
        if previous.is_none() && self.policies.len() >= MAX_POLICIES {
            for slot in &mut templates {
                slot.kind = TemplateKind::Fixed;
                slot.result = Some((
                    Compliance::NonCompliant,
                    format!(
                        "this cluster already evaluates {MAX_POLICIES} policies, the most one agent evaluates; the policy is not evaluated"
                    ),
                ));
            }
        }
        self.next_revision += 1;
        let old_len = previous.as_ref().map_or(0, |p| p.templates.len());
        for index in templates.len()..old_len {
            self.schedule.remove(&schedule_key(&uid, index));
        }
        // Templates are matched by name (validation keeps names unique): a template the hub
        // dropped is pruned as if its policy were removed, as OCM deletes its
        // ConfigurationPolicy from the cluster.
        let mut dropped = Vec::new();
        for old in previous.iter().flat_map(|p| &p.templates) {
            match templates.iter_mut().find(|t| t.name == old.name) {
                Some(slot) => {
                    // Watch on until the new evaluation says what it reads.
                    slot.scopes = old.scopes.clone();
                    carry_related(old, slot);
                }
                None => dropped.push((old.kind.clone(), old.superseded.clone())),
            }
        }
        if !dropped.is_empty() {
            self.queue_prune(&uid, dropped, None);
        }
        for (index, slot) in templates.iter_mut().enumerate() {
            let key = schedule_key(&uid, index);
            match &slot.kind {
                TemplateKind::Configuration(template) => self
                    .schedule
                    .upsert(&key, &template.policy.spec.evaluation_interval),
                // The engine's reports are watched: no interval.
                TemplateKind::Engine(_) => {
                    self.schedule.upsert(&key, &EvaluationInterval::default())
                }
                TemplateKind::Fixed => self.schedule.remove(&key),
            }
        }
        info!(
            policy = %held.display(),
            uid = %uid,
            generation = delivered.generation,
            templates = templates.len(),
            "policy delivered"
        );
        let names: Vec<String> = templates.iter().map(|t| t.name.clone()).collect();
        let history = self.histories.entry(uid.clone()).or_default();
        history.retain(&names);
        let stamp = stamp(&held);
        for slot in &templates {
            if let Some((compliance, message)) = &slot.result {
                history.record(&slot.name, (*compliance).into(), message, &stamp);
            }
        }
        self.policies.insert(
            uid.clone(),
            PolicyEntry {
                held,
                revision: self.next_revision,
                templates,
            },
        );
        self.report_if_changed(&uid);
        self.rewatch();
    }

    fn remove(&mut self, uid: &str, done: oneshot::Sender<()>) {
        let Some(entry) = self.policies.remove(uid) else {
            // Asked again while its prune waits or runs: told when that prune ends.
            if let Some(removal) = self.removals.get_mut(uid) {
                removal.waiters.push(done);
            } else if let Some(prune) = self.pruning.values_mut().find(|p| p.uid == uid) {
                prune.waiters.push(done);
            } else {
                let _ = done.send(());
            }
            return;
        };
        info!(policy = %entry.held.display(), uid = %uid, "policy removed from the cluster");
        for index in 0..entry.templates.len() {
            self.schedule.remove(&schedule_key(uid, index));
        }
        self.histories.remove(uid);
        self.pending.remove(uid);
        self.rewatch();
        let templates = entry
            .templates
            .into_iter()
            .map(|slot| (slot.kind, slot.superseded));
        self.queue_prune(uid, templates, Some(done));
    }

    /// Adds `templates` to the prune of `uid` not started yet (a new one if none), and the
    /// caller to tell when it ends.
    fn queue_prune(
        &mut self,
        uid: &str,
        templates: impl IntoIterator<Item = (TemplateKind, Option<Arc<Vec<RelatedObject>>>)>,
        done: Option<oneshot::Sender<()>>,
    ) {
        let removal = self.removals.entry(uid.to_string()).or_default();
        removal.templates.extend(templates);
        removal.waiters.extend(done);
        self.prune_when_idle(uid);
    }

    /// Queues the prune of `uid` waiting in `removals` unless one of its evaluations or an
    /// earlier prune of it still runs (so that no enforce write lands after the prune read,
    /// and prunes of one policy happen in order).
    fn prune_when_idle(&mut self, uid: &str) {
        if self.running.values().any(|r| r.uid == uid)
            || self.pruning.values().any(|p| p.uid == uid)
        {
            return;
        }
        if let Some(removal) = self.removals.get_mut(uid)
            && !removal.queued
        {
            removal.queued = true;
            self.prune_queue.push_back(uid.to_string());
        }
    }

    /// Starts queued prunes while fewer than [`MAX_CONCURRENT_PRUNES`] run.
    fn start_prunes(&mut self) {
        while self.prunes.len() < MAX_CONCURRENT_PRUNES {
            let Some(uid) = self.prune_queue.pop_front() else {
                return;
            };
            let Some(removal) = self.removals.remove(&uid) else {
                continue;
            };
            let target = Arc::clone(&self.target);
            let task_uid = uid.clone();
            let templates = removal.templates;
            let task = self.prunes.spawn(async move {
                prune_all(target.as_ref(), &task_uid, &templates).await;
            });
            self.pruning.insert(
                task.id(),
                Pruning {
                    uid,
                    waiters: removal.waiters,
                },
            );
        }
    }

    /// A prune ended: its `remove` callers are told, and a later prune of the policy may start.
    fn pruned(&mut self, joined: Result<(Id, ()), tokio::task::JoinError>) {
        let id = match joined {
            Ok((id, ())) => id,
            Err(e) => {
                warn!(error = %e, "pruning a removed policy's objects panicked");
                e.id()
            }
        };
        let Some(prune) = self.pruning.remove(&id) else {
            return;
        };
        for waiter in prune.waiters {
            let _ = waiter.send(());
        }
        self.prune_when_idle(&prune.uid);
    }

    /// Starts due templates while fewer than [`MAX_CONCURRENT_EVALUATIONS`] run.
    fn start_due(&mut self) {
        while self.evaluations.len() < MAX_CONCURRENT_EVALUATIONS {
            let Some(key) = self.schedule.poll_due() else {
                return;
            };
            let Some((uid, index)) = parse_key(&key) else {
                continue;
            };
            let Some(entry) = self.policies.get(uid) else {
                continue;
            };
            let target = Arc::clone(&self.target);
            let Some(slot) = entry.templates.get(index) else {
                continue;
            };
            let task = match &slot.kind {
                TemplateKind::Configuration(template) => {
                    let template = Arc::clone(template);
                    let superseded = slot.superseded.clone();
                    self.evaluations.spawn(async move {
                        evaluate_template(
                            target.as_ref(),
                            &template,
                            superseded.as_deref().map(Vec::as_slice),
                        )
                        .await
                    })
                }
                TemplateKind::Engine(template) => {
                    let template = Arc::clone(template);
                    self.evaluations.spawn(async move {
                        evaluate_engine_template(target.as_ref(), &template).await
                    })
                }
                TemplateKind::Fixed => continue,
            };
            self.running.insert(
                task.id(),
                Running {
                    uid: uid.to_string(),
                    index,
                    revision: entry.revision,
                },
            );
        }
    }

    fn evaluated(&mut self, joined: Result<(Id, TemplateOutcome), tokio::task::JoinError>) {
        let (id, outcome, finished) = match joined {
            Ok((id, outcome)) => (id, outcome, true),
            Err(e) => {
                // A bug; the template is reported as such rather than left without a result.
                warn!(error = %e, "a policy evaluation panicked");
                (
                    e.id(),
                    TemplateOutcome {
                        compliance: Compliance::NonCompliant,
                        message: format!("the agent failed to evaluate the template: {e}"),
                        scopes: Vec::new(),
                        related: Vec::new(),
                        unresolved: false,
                    },
                    false,
                )
            }
        };
        let Some(running) = self.running.remove(&id) else {
            return;
        };
        let key = schedule_key(&running.uid, running.index);
        self.schedule
            .evaluated(Instant::now(), &key, outcome.compliance);
        if self.removals.contains_key(&running.uid) {
            // Removed meanwhile (and perhaps delivered again): its prune may be waiting for
            // this evaluation.
            self.prune_when_idle(&running.uid);
        }
        let Some(entry) = self.policies.get_mut(&running.uid) else {
            return;
        };
        if entry.revision != running.revision {
            return;
        }
        let Some(slot) = entry.templates.get_mut(running.index) else {
            return;
        };
        debug!(
            policy = %entry.held.display(),
            template = %slot.name,
            compliance = outcome.compliance.as_str(),
            "template evaluated"
        );
        let scopes_changed = slot.scopes != outcome.scopes;
        slot.scopes = outcome.scopes;
        if finished && !outcome.unresolved {
            // The evaluation pruned what the change dropped (or logged why not); one whose
            // templates did not render keeps what it related to and any prune pending.
            slot.related = outcome.related;
            slot.superseded = None;
        }
        slot.result = Some((outcome.compliance, outcome.message.clone()));
        let stamp = stamp(&entry.held);
        self.histories
            .entry(running.uid.clone())
            .or_default()
            .record(
                &slot.name,
                outcome.compliance.into(),
                &outcome.message,
                &stamp,
            );
        self.report_if_changed(&running.uid);
        if scopes_changed {
            self.rewatch();
        }
    }

    /// Marks due every template whose last reads cover the changed object (all that read the
    /// kind, on a relist).
    fn object_changed(&mut self, change: &WatchedChange) {
        for (uid, entry) in &self.policies {
            for (index, slot) in entry.templates.iter().enumerate() {
                if slot.scopes.iter().any(|scope| {
                    kind_key(&scope.kind) == change.kind
                        && change
                            .object
                            .as_ref()
                            .is_none_or(|(namespace, name)| scope.covers(namespace, name))
                }) {
                    self.schedule.object_changed(&schedule_key(uid, index));
                }
            }
        }
    }

    /// Queues the policy's report if every template has a result and it differs from the
    /// last one sent.
    fn report_if_changed(&mut self, uid: &str) {
        let Some(entry) = self.policies.get(uid) else {
            return;
        };
        if entry.templates.iter().any(|slot| slot.result.is_none()) {
            return;
        }
        let names: Vec<String> = entry.templates.iter().map(|t| t.name.clone()).collect();
        let history = self.histories.entry(uid.to_string()).or_default();
        let status = history.status(&names);
        if history.is_new(entry.held.generation, &status) {
            self.pending.insert(
                uid.to_string(),
                PolicyReport {
                    uid: uid.to_string(),
                    generation: entry.held.generation,
                    status,
                },
            );
        }
    }

    /// Watches the kinds the templates read now.
    fn rewatch(&mut self) {
        let kinds = self
            .policies
            .values()
            .flat_map(|entry| &entry.templates)
            .flat_map(|slot| &slot.scopes)
            .map(|scope| (kind_key(&scope.kind), scope.kind.clone()))
            .collect();
        self.watches.watch_only(kinds);
    }
}

/// Carries out the `pruneObjectBehavior` of each ConfigurationPolicy template of a removed
/// policy, and removes the objects applied for other engines; problems are logged.
async fn prune_all(
    target: &dyn ApplyTarget,
    uid: &str,
    templates: &[(TemplateKind, Option<Arc<Vec<RelatedObject>>>)],
) {
    for (template, superseded) in templates {
        let problems = match template {
            TemplateKind::Configuration(t) => {
                prune_template(target, t, superseded.as_deref().map(Vec::as_slice)).await
            }
            TemplateKind::Engine(t) => remove_engine_template(target, t)
                .await
                .into_iter()
                .collect(),
            TemplateKind::Fixed => Vec::new(),
        };
        for problem in problems {
            warn!(uid = %uid, problem = %problem, "pruning a removed policy's object failed");
        }
    }
}

/// Hands what a template related to over to its new delivery: as is when what it names did
/// not change, else as superseded, for the first evaluation of the change to prune what it no
/// longer names (with anything superseded before and not yet pruned).
fn carry_related(old: &TemplateSlot, new: &mut TemplateSlot) {
    let names = |kind: &TemplateKind| match kind {
        TemplateKind::Configuration(t) => Some((
            t.policy.spec.object_templates.clone(),
            t.policy.spec.namespace_selector.clone(),
        )),
        _ => None,
    };
    if names(&old.kind).is_none() || names(&old.kind) == names(&new.kind) {
        new.related = old.related.clone();
        new.superseded = old.superseded.clone();
        return;
    }
    let mut superseded: Vec<RelatedObject> = old.superseded.as_deref().cloned().unwrap_or_default();
    superseded.extend(old.related.iter().cloned());
    new.superseded = Some(Arc::new(superseded));
}

/// The templates of a delivered policy. A policy that fails validation gets every template
/// NonCompliant with the validator's message; a template of a kind other than
/// ConfigurationPolicy is NonCompliant saying the agent does not evaluate it.
fn template_slots(delivered: &DeliveredPolicy) -> Vec<TemplateSlot> {
    let policy = &delivered.policy;
    let invalid = validate_policy(policy, None).err().map(|errors| {
        errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    });
    if let Some(invalid) = &invalid
        && policy.spec.policy_templates.is_empty()
    {
        // Nothing to hang the refusal on: the policy itself, or it would count as Compliant.
        return vec![TemplateSlot {
            name: policy.metadata.name.clone().unwrap_or_default(),
            kind: TemplateKind::Fixed,
            result: Some((Compliance::NonCompliant, invalid.clone())),
            scopes: Vec::new(),
            related: Vec::new(),
            superseded: None,
        }];
    }
    policy
        .spec
        .policy_templates
        .iter()
        .enumerate()
        .map(|(index, template)| {
            let definition = &template.object_definition;
            let name = definition
                .name()
                .map_or_else(|| format!("template-{index}"), str::to_string);
            let fixed = |message: String| TemplateSlot {
                name: name.clone(),
                kind: TemplateKind::Fixed,
                result: Some((Compliance::NonCompliant, message)),
                scopes: Vec::new(),
                related: Vec::new(),
                superseded: None,
            };
            if let Some(invalid) = &invalid {
                return fixed(invalid.clone());
            }
            if let Some(error) = definition
                .0
                .pointer("/metadata/annotations")
                .and_then(|a| a.get(ANNOTATION_HUB_TEMPLATES_ERROR))
                .and_then(Value::as_str)
            {
                // The hub could not render it for this cluster: its error is the verdict.
                return fixed(error.to_string());
            }
            let group = definition
                .api_version()
                .and_then(|v| v.split_once('/'))
                .map(|(group, _)| group);
            let kind = definition.kind().unwrap_or("<none>");
            if let Some(engine) = definition.api_version().and_then(Engine::of) {
                return TemplateSlot {
                    name: name.clone(),
                    kind: TemplateKind::Engine(Arc::new(EngineTemplate {
                        policy_uid: delivered.uid.clone(),
                        engine,
                        object: definition.0.clone(),
                    })),
                    result: None,
                    scopes: Vec::new(),
                    related: Vec::new(),
                    superseded: None,
                };
            }
            if group != Some(POLICY_GROUP) || kind != "ConfigurationPolicy" {
                return fixed(format!(
                    "template kind {kind} is not evaluated by flotilla's agent"
                ));
            }
            let configuration: ConfigurationPolicy =
                match serde_json::from_value(definition.0.clone()) {
                    Ok(parsed) => parsed,
                    Err(e) => return fixed(format!("ConfigurationPolicy {name}: {e}")),
                };
            let remediation = effective_remediation(
                policy.spec.remediation_action.as_deref(),
                Some(configuration.spec.remediation_action.as_str()),
            );
            let prune = configuration
                .spec
                .prune_object_behavior
                .as_deref()
                .and_then(PruneObjectBehavior::parse)
                .unwrap_or_default();
            TemplateSlot {
                name: name.clone(),
                kind: TemplateKind::Configuration(Arc::new(ConfigurationTemplate {
                    policy_uid: delivered.uid.clone(),
                    policy: configuration,
                    remediation,
                    prune,
                })),
                result: None,
                scopes: Vec::new(),
                related: Vec::new(),
                superseded: None,
            }
        })
        .collect()
}

/// Now, as a history entry's time and OCM's event name (`<namespace>.<name>.<hex time>`).
fn stamp(held: &Held) -> Stamp {
    let now = Timestamp::now();
    Stamp {
        time: Timestamp::from_second(now.as_second())
            .unwrap_or(now)
            .to_string(),
        event_name: format!("{}.{}.{:x}", held.namespace, held.name, now.as_nanosecond()),
    }
}

#[cfg(test)]
mod tests {
    use flotilla_proto::api::policy::Policy;
    use serde_json::json;

    use super::*;

    fn delivered(spec: serde_json::Value) -> DeliveredPolicy {
        let policy: Policy = serde_json::from_value(json!({
            "apiVersion": "policy.open-cluster-management.io/v1", "kind": "Policy",
            "metadata": {"name": "p", "namespace": "policies"}, "spec": spec,
        }))
        .expect("a Policy");
        DeliveredPolicy {
            uid: "u".into(),
            generation: 1,
            policy,
        }
    }

    fn results(slots: &[TemplateSlot]) -> Vec<(String, Option<(Compliance, String)>)> {
        slots
            .iter()
            .map(|s| (s.name.clone(), s.result.clone()))
            .collect()
    }

    #[test]
    fn a_resend_is_told_from_other_content_at_the_same_generation() {
        let spec = |action: &str| json!({"remediationAction": action, "policy-templates": []});
        let held = Held::of(&delivered(spec("inform")));
        assert_eq!(held, Held::of(&delivered(spec("inform"))), "a resend");
        assert_ne!(
            held,
            Held::of(&delivered(spec("enforce"))),
            "hub templates resolved again change the content, not the generation"
        );
        assert_eq!(
            (held.display(), held.generation),
            ("policies/p".to_string(), 1)
        );
    }

    #[test]
    fn an_invalid_policy_is_noncompliant_even_without_templates() {
        let slots = template_slots(&delivered(
            json!({"remediationAction": "repair", "policy-templates": []}),
        ));
        assert_eq!(
            results(&slots),
            [(
                "p".to_string(),
                Some((
                    Compliance::NonCompliant,
                    "Policy policies/p: spec.remediationAction is \"repair\"; use inform or enforce"
                        .to_string()
                ))
            )]
        );
    }

    #[test]
    fn a_template_the_hub_could_not_render_reports_the_hubs_error() {
        let error = "failed to resolve the template {{hub fromClusterClaim \"region\" hub}} at spec.policy-templates[0].objectDefinition.spec.object-templates[0].objectDefinition.data.tier: fromClusterClaim: the cluster has no claim \"region\"";
        let slots = template_slots(&delivered(json!({"remediationAction": "enforce",
        "policy-templates": [
            {"objectDefinition": {"apiVersion": "policy.open-cluster-management.io/v1",
                "kind": "ConfigurationPolicy", "metadata": {"name": "tiered",
                    "annotations": {ANNOTATION_HUB_TEMPLATES_ERROR: error}},
                "spec": {"remediationAction": "inform", "object-templates": [
                        {"complianceType": "musthave", "objectDefinition": {
                            "apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": {"name": "tier", "namespace": "default"},
                            "data": {"tier": "{{hub fromClusterClaim \"region\" hub}}"}}}]}}},
            {"objectDefinition": {"apiVersion": "policy.open-cluster-management.io/v1",
                "kind": "ConfigurationPolicy", "metadata": {"name": "plain"},
                "spec": {"remediationAction": "inform", "object-templates": [
                        {"complianceType": "musthave", "objectDefinition": {
                            "apiVersion": "v1", "kind": "Namespace",
                            "metadata": {"name": "prod"}}}]}}},
        ]})));
        assert_eq!(
            results(&slots)[0],
            (
                "tiered".to_string(),
                Some((Compliance::NonCompliant, error.to_string()))
            )
        );
        assert!(
            matches!(slots[1].kind, TemplateKind::Configuration(_)),
            "the policy's other templates are evaluated"
        );
    }

    #[test]
    fn templates_are_sorted_into_evaluated_applied_and_refused() {
        let slots = template_slots(&delivered(json!({"remediationAction": "enforce",
        "policy-templates": [
            {"objectDefinition": {"apiVersion": "policy.open-cluster-management.io/v1",
                "kind": "ConfigurationPolicy", "metadata": {"name": "config"},
                "spec": {"remediationAction": "inform", "object-templates": [
                        {"complianceType": "musthave", "objectDefinition": {
                            "apiVersion": "v1", "kind": "Namespace",
                            "metadata": {"name": "prod"}}}]}}},
            {"objectDefinition": {"apiVersion": "constraints.gatekeeper.sh/v1beta1",
                "kind": "K8sRequiredLabels", "metadata": {"name": "labels"}}},
            {"objectDefinition": {"apiVersion": "policy.open-cluster-management.io/v1",
                "kind": "OperatorPolicy", "metadata": {"name": "operator"}}},
        ]})));
        let TemplateKind::Configuration(config) = &slots[0].kind else {
            panic!("{:?}", slots[0]);
        };
        assert_eq!(
            config.remediation,
            flotilla_proto::api::policy::RemediationAction::Enforce,
            "the Policy's remediationAction overrides the template's"
        );
        assert!(matches!(slots[1].kind, TemplateKind::Engine(_)));
        assert_eq!(
            slots[2].result,
            Some((
                Compliance::NonCompliant,
                "template kind OperatorPolicy is not evaluated by flotilla's agent".to_string()
            ))
        );
    }
}
