//! The reconciler: the one task that makes the spoke match the cache.
//!
//! It owns applying. On start it reconciles every work in the cache at once, hub or no hub
//! (that is the agent's offline autonomy); after that it reconciles a work when the session
//! driver says it changed or was deleted, retries a work that failed with a growing delay, and
//! every resync interval (jittered) reconciles everything again, which repairs drift: an object
//! changed or deleted by hand is applied again.
//!
//! One work is reconciled by one task at a time, and at most `concurrency` works at once. A
//! reconcile writes the work's new status into the cache's outbox, only when it differs from
//! the last one, and then wakes the session driver through `outbox_changed`. A deleted work
//! whose resources are all gone (or orphaned) is released: forgotten, with its release put in
//! the same outbox, so the hub hears `WorkReleased` and lets the work go.
//!
//! Crash safety: before applying, the ledger is extended with every object the work is about to
//! apply (write-ahead), so a crash mid-apply never leaves an object the agent forgot it owns.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use flotilla_ops::sleep_until;
use flotilla_proto::api::conditions::{WORK_COMPLETE, is_condition_true};
use flotilla_proto::api::{
    DeleteOption, ManifestWork, ManifestWorkStatus, PropagationPolicy, SelectivelyOrphan,
};
use flotilla_proto::session::Jitter;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use tokio::sync::{Mutex, Notify};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::{Instrument as _, debug, info, info_span, warn};

use crate::apply::{
    self, ApplyContext, ApplyTarget, Deletion, FieldManagers, apply_planned, plan_manifests,
};
use crate::cache::{AppliedResource, CacheError, CachedWork, WorkCache, durably};
use crate::metrics::{AgentMetrics, AppliedVersions};
use crate::status::{carry_transition_times, deleting_status, refused_status, work_status};
use crate::watch::{AppliedView, AppliedWatch};
use flotilla_ops::ReadyFlag;

/// Default of `--resync-interval`. Five minutes bounds how long hand-made drift survives, and
/// costs one no-op server-side apply per manifest per interval on the spoke's own apiserver
/// (an unchanged apply writes nothing to etcd): a work of 20 manifests is 0.07 requests/s.
pub const DEFAULT_RESYNC_INTERVAL: Duration = Duration::from_secs(5 * 60);
/// Default of `--apply-concurrency`: works reconciled at once. Each reconcile is sequential
/// apiserver calls, so a few in parallel keep a resync of hundreds of works short without
/// crowding the spoke apiserver.
pub const DEFAULT_APPLY_CONCURRENCY: usize = 4;
/// First retry delay after a failed reconcile; doubles per failure up to the resync interval.
pub const DEFAULT_RETRY_INITIAL: Duration = Duration::from_secs(2);
/// Default of `--feedback-interval`: the shortest time between two statuses of one work that
/// changes on the spoke (feedback values, rule conditions) cause. A resource that changes
/// every second is reported every 5 s with its latest state; a fleet of 1,000 such works sends
/// the hub at most 200 statuses per second.
pub const DEFAULT_FEEDBACK_INTERVAL: Duration = Duration::from_secs(5);

/// How the reconciler paces itself.
#[derive(Clone, Debug)]
pub struct ReconcilerConfig {
    /// How often every work is reconciled again, ±10 % jitter.
    pub resync_interval: Duration,
    /// Works reconciled at once.
    pub concurrency: usize,
    /// First retry delay after a failure.
    pub retry_initial: Duration,
    /// Shortest time between two statuses of one work caused by changes on the spoke.
    pub feedback_interval: Duration,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        Self {
            resync_interval: DEFAULT_RESYNC_INTERVAL,
            concurrency: DEFAULT_APPLY_CONCURRENCY,
            retry_initial: DEFAULT_RETRY_INITIAL,
            feedback_interval: DEFAULT_FEEDBACK_INTERVAL,
        }
    }
}

/// What one reconcile of one work did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reconciled {
    /// The seq of the new status written to the outbox; `None` when the status was unchanged.
    pub new_status: Option<u64>,
    /// Something failed that may succeed later (a manifest, a delete still pending).
    pub retry: bool,
    /// The work was a tombstone and is now gone from the cache, its release in the outbox.
    pub forgotten: bool,
    /// The generation applied and the resourceVersion each object the work owns had after
    /// the apply (empty for a tombstone or a work not applied): how drift is noticed.
    pub applied: Option<(i64, Vec<(AppliedResource, String)>)>,
}

/// Works waiting to be reconciled: an ordered set, so a work changed many times while busy is
/// reconciled once. Its size is bounded by the number of works in the cache (every uid put
/// here is one the cache holds), and the "everything" request is a flag, not a copy.
#[derive(Debug, Default)]
struct WorkQueue {
    state: Mutex<QueueState>,
    wake: Notify,
}

#[derive(Debug, Default)]
struct QueueState {
    order: VecDeque<String>,
    queued: HashSet<String>,
    all: bool,
}

impl WorkQueue {
    async fn mark(&self, uid: &str) {
        let mut state = self.state.lock().await;
        if state.queued.insert(uid.to_owned()) {
            state.order.push_back(uid.to_owned());
        }
        drop(state);
        self.wake.notify_one();
    }

    async fn mark_all(&self) {
        self.state.lock().await.all = true;
        self.wake.notify_one();
    }
}

/// Tells the reconciler about changes; cheap to clone. The session driver holds one.
#[derive(Clone, Debug)]
pub struct ReconcileHandle {
    queue: Arc<WorkQueue>,
}

impl ReconcileHandle {
    /// The work's desired state changed, or it became a tombstone: reconcile it soon.
    pub async fn work_changed(&self, uid: &str) {
        self.queue.mark(uid).await;
    }

    /// Reconcile every work now (as the periodic resync does).
    pub async fn resync_all(&self) {
        self.queue.mark_all().await;
    }
}

/// The reconciler task; see the module docs.
pub struct Reconciler {
    cache: Arc<dyn WorkCache>,
    target: Arc<dyn ApplyTarget>,
    config: ReconcilerConfig,
    queue: Arc<WorkQueue>,
    /// Woken after every new status in the outbox; the session driver waits on it.
    outbox_changed: Arc<Notify>,
    jitter: Box<dyn Jitter + Send + Sync>,
    /// The applied objects whose content the statuses read, watched.
    watch: Arc<AppliedWatch>,
    /// Woken when a watched object changed a work's status inputs.
    dirty_changed: Arc<Notify>,
    /// Apply times and drift repairs are counted here.
    metrics: AgentMetrics,
    /// What each work's objects looked like after its last apply, to notice drift.
    versions: AppliedVersions,
    /// Raised once every work the cache held at start has been reconciled once (`/readyz`).
    first_pass: ReadyFlag,
    /// Who the agent writes as.
    managers: FieldManagers,
}

impl std::fmt::Debug for Reconciler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reconciler")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Reconciler {
    /// A reconciler over `cache` and `target`, and the handle to tell it about changes.
    pub fn new(
        cache: Arc<dyn WorkCache>,
        target: Arc<dyn ApplyTarget>,
        config: ReconcilerConfig,
        outbox_changed: Arc<Notify>,
        jitter: Box<dyn Jitter + Send + Sync>,
    ) -> (Self, ReconcileHandle) {
        let queue = Arc::new(WorkQueue::default());
        let handle = ReconcileHandle {
            queue: Arc::clone(&queue),
        };
        let dirty_changed = Arc::new(Notify::new());
        let watch = Arc::new(AppliedWatch::new(
            Arc::clone(&target),
            Arc::clone(&dirty_changed),
        ));
        let reconciler = Self {
            cache,
            target,
            config,
            queue,
            outbox_changed,
            jitter,
            watch,
            dirty_changed,
            metrics: AgentMetrics::default(),
            versions: AppliedVersions::default(),
            first_pass: ReadyFlag::new("the first reconcile of the cached works has not finished"),
            managers: FieldManagers::sole(),
        };
        (reconciler, handle)
    }

    /// Counts apply times and drift repairs into `metrics`.
    pub fn with_metrics(mut self, metrics: AgentMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Writes as `managers` (the agent of one hub of several) instead of
    /// [`FieldManagers::sole`].
    pub fn with_field_managers(mut self, managers: FieldManagers) -> Self {
        self.managers = managers;
        self
    }

    /// Raises `flag` once every work the cache held at start has been reconciled once, failed
    /// or not (a failure is retried on its own schedule).
    pub fn with_first_pass(mut self, flag: ReadyFlag) -> Self {
        self.first_pass = flag;
        self
    }

    /// Runs until `shutdown` completes. Reconciles in flight are then abandoned: each is
    /// idempotent, and the next start reconciles everything again.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        // Everything in the cache, at once: the hub may be away for hours.
        self.queue.mark_all().await;
        let mut tasks: JoinSet<(String, Result<Reconciled, CacheError>)> = JoinSet::new();
        // Task id → the uid it reconciles; a uid appears at most once.
        let mut running: HashMap<tokio::task::Id, String> = HashMap::new();
        let mut failures: HashMap<String, u32> = HashMap::new();
        let mut retry_at: HashMap<String, Instant> = HashMap::new();
        let mut next_resync = Instant::now() + self.jittered_resync();
        // Status refreshes caused by watched objects: one task per work at a time, at most one
        // per work per feedback interval (the rest wait until `refresh_at`).
        let mut refreshes = Refreshes::default();
        loop {
            self.start_ready(&mut tasks, &mut running, &refreshes.running)
                .await;
            // The start's pass is over once nothing it queued is left or running.
            if !self.first_pass.is_ready() && tasks.is_empty() && self.queue_drained().await {
                self.first_pass.set(true);
            }
            let next_retry = retry_at.values().min().copied();
            let next_refresh = refreshes.deferred.values().min().copied();
            tokio::select! {
                _ = self.queue.wake.notified() => {}
                _ = self.dirty_changed.notified() => {
                    self.refresh_dirty(&mut refreshes, &running).await;
                }
                _ = sleep_until(next_refresh) => {
                    refreshes.deferred.clear();
                    self.refresh_dirty(&mut refreshes, &running).await;
                }
                Some(done) = refreshes.tasks.join_next(), if !refreshes.tasks.is_empty() => {
                    if let Ok(uid) = done {
                        refreshes.running.remove(&uid);
                    }
                }
                Some(joined) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                    let (uid, result) = match joined {
                        Ok((id, done)) => {
                            running.remove(&id);
                            done
                        }
                        Err(e) => {
                            // A panicking reconcile is a bug; the work is retried like a failure.
                            let uid = running.remove(&e.id()).unwrap_or_default();
                            warn!(uid = %uid, error = %e, "work reconcile panicked");
                            (uid, Ok(Reconciled { retry: true, ..Reconciled::default() }))
                        }
                    };
                    let retry = match result {
                        Ok(r) if r.forgotten => {
                            failures.remove(&uid);
                            retry_at.remove(&uid);
                            refreshes.last.remove(&uid);
                            self.versions.forget(&uid);
                            self.watch.forget(&uid).await;
                            continue;
                        }
                        Ok(r) => {
                            if let Some((generation, versions)) = r.applied {
                                let drifted = self.versions.record(&uid, generation, versions);
                                if drifted > 0 {
                                    info!(uid = %uid, objects = drifted, "drift on the spoke repaired");
                                    self.metrics.drift_repaired(drifted);
                                }
                            }
                            r.retry
                        }
                        Err(e) => {
                            warn!(uid = %uid, error = %e, "work reconcile failed on the cache");
                            true
                        }
                    };
                    if retry {
                        let n = failures.entry(uid.clone()).or_insert(0);
                        *n += 1;
                        let delay = self.retry_delay(*n);
                        debug!(uid = %uid, failures = *n, ?delay, "retrying the work later");
                        retry_at.insert(uid, Instant::now() + delay);
                    } else {
                        failures.remove(&uid);
                        retry_at.remove(&uid);
                    }
                }
                _ = tokio::time::sleep_until(next_resync) => {
                    debug!("periodic resync");
                    self.queue.mark_all().await;
                    next_resync = Instant::now() + self.jittered_resync();
                }
                _ = sleep_until(next_retry) => {
                    let now = Instant::now();
                    let due: Vec<String> = retry_at.iter().filter(|(_, at)| **at <= now).map(|(u, _)| u.clone()).collect();
                    for uid in due {
                        retry_at.remove(&uid);
                        self.queue.mark(&uid).await;
                    }
                }
                _ = &mut shutdown => break,
            }
        }
        tasks.shutdown().await;
        refreshes.tasks.shutdown().await;
    }

    /// Starts a status refresh for every work whose watched objects changed, unless it had one
    /// within the feedback interval (then it waits, coalesced) or is being applied right now.
    async fn refresh_dirty(
        &self,
        refreshes: &mut Refreshes,
        running: &HashMap<tokio::task::Id, String>,
    ) {
        let now = Instant::now();
        for (uid, view) in self.watch.take_dirty().await {
            let due = refreshes
                .last
                .get(&uid)
                .map_or(now, |at| *at + self.config.feedback_interval);
            let busy = refreshes.running.contains(&uid) || running.values().any(|r| *r == uid);
            if due > now || busy {
                // Later, with whatever the object looks like then.
                self.watch.mark_dirty(&uid).await;
                let at = if busy { due.max(now + BUSY_RETRY) } else { due };
                let entry = refreshes.deferred.entry(uid).or_insert(at);
                *entry = (*entry).min(at);
                continue;
            }
            refreshes.last.insert(uid.clone(), now);
            refreshes.running.insert(uid.clone());
            let cache = Arc::clone(&self.cache);
            let outbox = Arc::clone(&self.outbox_changed);
            refreshes.tasks.spawn(async move {
                match refresh_status(&cache, &uid, &view).await {
                    Ok(Some(_)) => outbox.notify_one(),
                    Ok(None) => {}
                    Err(e) => warn!(uid = %uid, error = %e, "cannot record a work's status"),
                }
                uid
            });
        }
    }

    /// Starts reconciles for queued works that are not already running, up to the bound.
    async fn start_ready(
        &self,
        tasks: &mut JoinSet<(String, Result<Reconciled, CacheError>)>,
        running: &mut HashMap<tokio::task::Id, String>,
        refreshing: &HashSet<String>,
    ) {
        let mut state = self.queue.state.lock().await;
        if std::mem::take(&mut state.all) {
            match self.cache.works() {
                Ok(works) => {
                    // Policies are the policy desk's: nothing of them is applied here.
                    for work in works.into_iter().filter(|w| !w.policy) {
                        if state.queued.insert(work.uid.clone()) {
                            state.order.push_back(work.uid);
                        }
                    }
                }
                // Nothing to do but try again at the next resync; the log says why.
                Err(e) => warn!(error = %e, "cannot list the cached works"),
            }
        }
        let mut busy = VecDeque::new();
        while tasks.len() < self.config.concurrency.max(1) {
            let Some(uid) = state.order.pop_front() else {
                break;
            };
            if running.values().any(|r| *r == uid) || refreshing.contains(&uid) {
                // Reconciled again once the running one (or its status refresh) ends.
                busy.push_back(uid);
                continue;
            }
            state.queued.remove(&uid);
            let task_uid = uid.clone();
            let cache = Arc::clone(&self.cache);
            let target = Arc::clone(&self.target);
            let managers = self.managers.clone();
            let outbox = Arc::clone(&self.outbox_changed);
            let watch = Arc::clone(&self.watch);
            let metrics = self.metrics.clone();
            let task = tasks.spawn(async move {
                let started = Instant::now();
                let result =
                    reconcile_watched(&cache, target.as_ref(), &managers, Some(&watch), &uid).await;
                if matches!(&result, Ok(r) if r.applied.is_some()) {
                    metrics.observe_apply(started.elapsed());
                }
                if matches!(&result, Ok(r) if r.new_status.is_some() || r.forgotten) {
                    outbox.notify_one();
                }
                (uid, result)
            });
            running.insert(task.id(), task_uid);
        }
        while let Some(uid) = busy.pop_back() {
            state.order.push_front(uid);
        }
    }

    /// Nothing queued, and no request to queue everything pending.
    async fn queue_drained(&self) -> bool {
        let state = self.queue.state.lock().await;
        state.order.is_empty() && !state.all
    }

    fn jittered_resync(&mut self) -> Duration {
        let base = self.config.resync_interval;
        // ±10 %: agents started together (a site powering on) spread their resyncs apart.
        base.mul_f64(0.9) + self.jitter.uniform(base.mul_f64(0.2))
    }

    fn retry_delay(&self, failures: u32) -> Duration {
        let factor = 2u32.saturating_pow(failures.saturating_sub(1).min(16));
        self.config
            .retry_initial
            .saturating_mul(factor)
            .min(self.config.resync_interval)
    }
}

/// How long a refresh waits when its work is being applied or refreshed right now.
const BUSY_RETRY: Duration = Duration::from_millis(200);

/// The reconciler's bookkeeping of status refreshes.
#[derive(Default)]
struct Refreshes {
    tasks: JoinSet<String>,
    /// Works with a refresh task running.
    running: HashSet<String>,
    /// When each work's last refresh started; bounded by the works held (forgotten with them).
    last: HashMap<String, Instant>,
    /// Works waiting for their turn, and when it comes.
    deferred: HashMap<String, Instant>,
}

/// Reconciles one work: applies a live work and records its status, or removes a tombstone's
/// resources and forgets it. Safe to call at any time, any number of times.
pub async fn reconcile_work(
    cache: &Arc<dyn WorkCache>,
    target: &dyn ApplyTarget,
    uid: &str,
) -> Result<Reconciled, CacheError> {
    reconcile_watched(cache, target, &FieldManagers::sole(), None, uid).await
}

/// [`reconcile_work`] by the agent of one hub of several: written as `managers` say, never
/// taking or deleting what another hub's agent applies.
pub async fn reconcile_work_as(
    cache: &Arc<dyn WorkCache>,
    target: &dyn ApplyTarget,
    managers: &FieldManagers,
    uid: &str,
) -> Result<Reconciled, CacheError> {
    reconcile_watched(cache, target, managers, None, uid).await
}

/// [`reconcile_work`], recording what was applied in `watch` so that changes to the applied
/// objects refresh the status.
async fn reconcile_watched(
    cache: &Arc<dyn WorkCache>,
    target: &dyn ApplyTarget,
    managers: &FieldManagers,
    watch: Option<&AppliedWatch>,
    uid: &str,
) -> Result<Reconciled, CacheError> {
    let Some(work) = cache.work(uid)?.filter(|w| !w.policy) else {
        return Ok(Reconciled::default());
    };
    let span = info_span!(
        "reconcile",
        work = %work.display_name(),
        uid = %work.uid,
        generation = work.generation,
        deleting = work.deleting,
    );
    async {
        if work.deleting {
            remove_work(cache, target, managers, &work).await
        } else {
            apply_work(cache, target, managers, watch, &work).await
        }
    }
    .instrument(span)
    .await
}

/// The work's content, or why there is none to apply.
fn load(
    cache: &dyn WorkCache,
    work: &CachedWork,
) -> Result<Result<ManifestWork, String>, CacheError> {
    if let Some(reason) = &work.refused {
        return Ok(Err(reason.clone()));
    }
    let Some(bytes) = cache.manifest_work(&work.uid)? else {
        return Ok(Err(
            "the agent holds no content for this work; the hub resends it on the next session"
                .into(),
        ));
    };
    crate::cache::joined_manifest_work(cache, &bytes)
}

async fn apply_work(
    cache: &Arc<dyn WorkCache>,
    target: &dyn ApplyTarget,
    managers: &FieldManagers,
    watch: Option<&AppliedWatch>,
    work: &CachedWork,
) -> Result<Reconciled, CacheError> {
    let now = now();
    let manifest_work = match load(cache.as_ref(), work)? {
        Ok(mw) => mw,
        Err(reason) => {
            warn!(%reason, "work not applied");
            let status = refused_status(work.generation, &reason, &now);
            let new_status = record_status(cache, work, status).await?;
            // Retrying cannot help until the hub sends another generation.
            return Ok(Reconciled {
                new_status,
                ..Reconciled::default()
            });
        }
    };
    let spec = &manifest_work.spec;
    let planned = plan_manifests(target, spec).await;
    let old: BTreeSet<AppliedResource> = cache.ledger(&work.uid)?.into_iter().collect();
    // ReadOnly objects are never the work's: not in the ledger, never deleted by it.
    let planned_ids: BTreeSet<AppliedResource> = planned
        .iter()
        .filter(|p| p.strategy().owns())
        .filter_map(|p| p.target.as_ref().ok().cloned())
        .collect();
    let ahead: BTreeSet<AppliedResource> = old.union(&planned_ids).cloned().collect();
    if ahead != old {
        set_ledger(cache, &work.uid, &ahead).await?;
    }

    let previous = cache.last_status(&work.uid)?;
    let context = ApplyContext {
        executor: spec.executor.clone(),
        delete_option: spec.delete_option.clone(),
        complete: previous
            .as_ref()
            .map(|p| completed(&p.status))
            .unwrap_or_default(),
        new_generation: previous
            .as_ref()
            .is_none_or(|p| p.generation != work.generation),
        managers: managers.clone(),
    };
    let outcomes = apply_planned(target, &planned, &context).await;
    // Everything the work still names, ReadOnly objects too: none of it is stale.
    let named: BTreeSet<AppliedResource> =
        outcomes.iter().filter_map(|o| o.resource.clone()).collect();
    let current: BTreeSet<AppliedResource> = outcomes
        .iter()
        .filter(|o| o.owned)
        .filter_map(|o| o.resource.clone())
        .collect();

    // Objects of an earlier generation that the work no longer has.
    let stale: Vec<AppliedResource> = old.difference(&named).cloned().collect();
    let mut kept = BTreeSet::new();
    if !stale.is_empty() {
        let owned_elsewhere = owned_by_other_works(cache.as_ref(), &work.uid)?;
        for resource in stale {
            if owned_elsewhere.contains(&resource) {
                debug!(resource = %resource, "left in place: another work applies it too");
                continue;
            }
            match delete_or_let_go(target, managers, &resource).await {
                Ok(Deletion::Gone) => info!(resource = %resource, "gone: removed from the work"),
                Ok(Deletion::Terminating) => {
                    kept.insert(resource);
                }
                Err(e) => {
                    warn!(resource = %resource, error = %e, "cannot delete a resource removed from the work");
                    kept.insert(resource);
                }
            }
        }
    }
    let ledger: BTreeSet<AppliedResource> = current.union(&kept).cloned().collect();
    if ledger != ahead {
        set_ledger(cache, &work.uid, &ledger).await?;
    }

    let failed = outcomes.iter().filter(|o| o.applied.is_err()).count();
    let retry = !kept.is_empty()
        || outcomes
            .iter()
            .any(|o| o.applied.as_ref().is_err_and(|f| f.retryable));
    if failed > 0 {
        warn!(
            failed,
            manifests = outcomes.len(),
            "work applied with failures"
        );
    } else {
        debug!(manifests = outcomes.len(), "work applied");
    }
    let status = work_status(work.generation, &outcomes, &now);
    if let Some(watch) = watch {
        watch.record(&work.uid, work.generation, &outcomes).await;
    }
    let new_status = record_status(cache, work, status).await?;
    let versions = outcomes
        .iter()
        .filter(|o| o.owned && o.applied.is_ok())
        .filter_map(|o| Some((o.resource.clone()?, o.resource_version.clone()?)))
        .collect();
    Ok(Reconciled {
        new_status,
        retry,
        forgotten: false,
        applied: Some((work.generation, versions)),
    })
}

/// Objects whose `Complete` condition the last status shows true: OCM no longer updates them.
fn completed(status: &serde_json::Value) -> BTreeSet<AppliedResource> {
    let Ok(status) = serde_json::from_value::<ManifestWorkStatus>(status.clone()) else {
        return BTreeSet::new();
    };
    status
        .resource_status
        .manifests
        .iter()
        .filter(|m| is_condition_true(&m.conditions, WORK_COMPLETE))
        .map(|m| {
            let r = &m.resource_meta;
            AppliedResource {
                group: r.group.clone(),
                version: r.version.clone(),
                kind: r.kind.clone(),
                resource: r.resource.clone(),
                namespace: r.namespace.clone(),
                name: r.name.clone(),
            }
        })
        .collect()
}

/// A new status for a work from what its watched objects look like now (no apply). Skipped
/// when the work moved on (deleted, or a generation not yet applied).
async fn refresh_status(
    cache: &Arc<dyn WorkCache>,
    uid: &str,
    view: &AppliedView,
) -> Result<Option<u64>, CacheError> {
    let Some(work) = cache.work(uid)? else {
        return Ok(None);
    };
    if work.deleting || work.generation != view.generation {
        return Ok(None);
    }
    let status = work_status(view.generation, &view.outcomes, &now());
    let span = info_span!("status", work = %work.display_name(), uid = %work.uid);
    record_status(cache, &work, status).instrument(span).await
}

async fn remove_work(
    cache: &Arc<dyn WorkCache>,
    target: &dyn ApplyTarget,
    managers: &FieldManagers,
    work: &CachedWork,
) -> Result<Reconciled, CacheError> {
    let mut resources: BTreeSet<AppliedResource> = cache.ledger(&work.uid)?.into_iter().collect();
    let (policy, orphans) = match load(cache.as_ref(), work)? {
        Ok(mw) => {
            // What the content resolves to also counts: an agent that crashed after applying
            // but before its ledger write still finds those objects.
            for p in plan_manifests(target, &mw.spec).await {
                if !p.strategy().owns() {
                    continue;
                }
                if let Ok(resource) = p.target {
                    resources.insert(resource);
                }
            }
            let option = mw.spec.delete_option.unwrap_or_default();
            let rules = option
                .selectively_orphans
                .map(|s| s.orphaning_rules)
                .unwrap_or_default();
            (option.propagation_policy, rules)
        }
        // No content: delete what the ledger says, as the default policy does.
        Err(_) => (PropagationPolicy::Foreground, Vec::new()),
    };
    let owned_elsewhere = owned_by_other_works(cache.as_ref(), &work.uid)?;
    let option = DeleteOption {
        propagation_policy: policy,
        selectively_orphans: Some(SelectivelyOrphan {
            orphaning_rules: orphans,
        }),
        ttl_seconds_after_finished: None,
    };
    let mut remaining = BTreeSet::new();
    for resource in resources {
        let orphan = apply::orphans(&option, &resource);
        if orphan {
            info!(resource = %resource, "orphaned: left on the cluster");
            continue;
        }
        if owned_elsewhere.contains(&resource) {
            info!(resource = %resource, "left in place: another work applies it too");
            continue;
        }
        match delete_or_let_go(target, managers, &resource).await {
            Ok(Deletion::Gone) => info!(resource = %resource, "gone with its work"),
            Ok(Deletion::Terminating) => {
                debug!(resource = %resource, "terminating; waiting for its finalizers");
                remaining.insert(resource);
            }
            Err(e) => {
                warn!(resource = %resource, error = %e, "cannot delete a resource of a deleted work");
                remaining.insert(resource);
            }
        }
    }
    if remaining.is_empty() {
        let uid = work.uid.clone();
        durably(cache, move |c| c.release(&uid)).await?;
        info!("work removed; its release goes to the hub");
        return Ok(Reconciled {
            forgotten: true,
            ..Reconciled::default()
        });
    }
    set_ledger(cache, &work.uid, &remaining).await?;
    // Still removing: say so while the hub keeps the work (a finalizer holds it).
    let previous = cache
        .last_status(&work.uid)?
        .and_then(|p| serde_json::from_value::<ManifestWorkStatus>(p.status).ok());
    let status = deleting_status(previous, work.generation, remaining.len(), &now());
    let new_status = record_status(cache, work, status).await?;
    Ok(Reconciled {
        new_status,
        retry: true,
        ..Reconciled::default()
    })
}

/// Deletes an object a work no longer has, unless another hub's agent also applies it: then
/// only this agent's fields go (an apply of the object's bare identity as its manager gives up
/// every field it owned, and the apiserver removes those no other manager owns) and the object
/// stays with the other hubs' fields. An agent that names no hub deletes, as before.
async fn delete_or_let_go(
    target: &dyn ApplyTarget,
    managers: &FieldManagers,
    resource: &AppliedResource,
) -> Result<Deletion, apply::ApplyError> {
    if managers.hub().is_none() {
        return target.delete(resource).await;
    }
    let Some(object) = target.get(resource).await? else {
        return Ok(Deletion::Gone);
    };
    let others = managers.other_hubs_managing(&object);
    if others.is_empty() {
        return target.delete(resource).await;
    }
    let mut identity = serde_json::json!({
        "apiVersion": resource.api_version(),
        "kind": resource.kind,
        "metadata": {"name": resource.name},
    });
    if !resource.namespace.is_empty() {
        identity["metadata"]["namespace"] = resource.namespace.clone().into();
    }
    target
        .apply(resource, &identity, managers.work(), true)
        .await?;
    info!(resource = %resource, hubs = %others.join(","), "left to the other hubs that apply it; this agent's fields dropped");
    Ok(Deletion::Gone)
}

/// Objects in the ledgers of other live works: deleting them would break those works.
fn owned_by_other_works(
    cache: &dyn WorkCache,
    uid: &str,
) -> Result<HashSet<AppliedResource>, CacheError> {
    let live: HashSet<String> = cache
        .works()?
        .into_iter()
        .filter(|w| !w.deleting && w.uid != uid)
        .map(|w| w.uid)
        .collect();
    Ok(cache
        .ledgers()?
        .into_iter()
        .filter(|(owner, _)| live.contains(owner))
        .flat_map(|(_, resources)| resources)
        .collect())
}

async fn set_ledger(
    cache: &Arc<dyn WorkCache>,
    uid: &str,
    resources: &BTreeSet<AppliedResource>,
) -> Result<(), CacheError> {
    let uid = uid.to_owned();
    let resources: Vec<AppliedResource> = resources.iter().cloned().collect();
    durably(cache, move |c| c.set_ledger(&uid, &resources)).await
}

/// Puts `status` in the outbox unless it equals the last one (ignoring transition times that
/// only moved because it was rebuilt). Returns the new seq.
async fn record_status(
    cache: &Arc<dyn WorkCache>,
    work: &CachedWork,
    mut status: ManifestWorkStatus,
) -> Result<Option<u64>, CacheError> {
    if let Some(previous) = cache.last_status(&work.uid)? {
        // A status written by another agent version may not parse; then it is simply replaced.
        if let Ok(prev) = serde_json::from_value::<ManifestWorkStatus>(previous.status) {
            carry_transition_times(&prev, &mut status);
            if previous.generation == work.generation && prev == status {
                return Ok(None);
            }
        }
    }
    let json = serde_json::to_value(&status).map_err(|source| CacheError::Encode {
        tree: "status",
        uid: work.uid.clone(),
        source,
    })?;
    let uid = work.uid.clone();
    let generation = work.generation;
    let seq = durably(cache, move |c| c.push_status(&uid, generation, &json)).await?;
    debug!(seq, "new status in the outbox");
    Ok(Some(seq))
}

/// Wall-clock time for `lastTransitionTime`, to the second as metav1 stores it.
fn now() -> Time {
    let now = Timestamp::now();
    Time(Timestamp::from_second(now.as_second()).unwrap_or(now))
}

#[cfg(test)]
mod tests;
