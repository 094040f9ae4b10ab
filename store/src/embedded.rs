//! The single-node backend: objects in an embedded sled database, watch history in memory.
//!
//! Every write takes the [`EventLog`] lock, commits the object and the next revision in one sled
//! transaction and stages its event, then, with the lock released, waits until a flush covers
//! its revision (group commit, [`Inner::durable`]): one writer flushes for every write staged
//! before it started, publishes their events in revision order into the in-memory history and
//! the live channel, and every writer of that batch is acknowledged. So concurrent writers
//! share one fsync instead of queueing one each, and a watcher still never sees a write before
//! it is on disk. One lock for staging, publishing and watch subscriptions is what makes
//! watches exact: a subscriber sees the history up to revision r and the live channel from
//! r + 1, with nothing lost or repeated.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Weak};

use async_trait::async_trait;
use flotilla_proto::api::Kind;
use serde_json::{Value, json};
use sled::Transactional;
use sled::transaction::{ConflictableTransactionError, TransactionError};
use tokio::sync::{Mutex, broadcast};
use tracing::{debug, warn};

use crate::fence as fencing;
use crate::object::{
    self, ObjectKey, check_scope, check_size, generation_of, remove_meta, resource_version,
    set_meta, spec_changed,
};
use crate::{
    Basis, Object, ObjectList, Revision, Selection, Store, StoreError, WatchEvent, WatchStream,
    WriteFence,
};

/// How many recent events the store keeps in memory so a watch can resume from a revision.
/// A watcher that resumes from further back, or falls further behind, gets `Gone` and relists,
/// like kube's 410. At a busy single-node hub's ~100 writes/s this is a minute and a half of
/// history: enough to ride out a controller restart or a slow consumer, and the memory is one
/// copy of each recent object, shared by every watcher.
pub const DEFAULT_EVENT_BUFFER: usize = 10_000;

/// How many bytes of objects (as stored: compact JSON) the event history keeps at most, beside
/// its count: at 10,000 clusters a root Policy's status is a megabyte, and 10,000 such events
/// would be gigabytes. The oldest events make room; a watch resuming from before them relists.
pub const DEFAULT_EVENT_BUFFER_BYTES: usize = 128 << 20;

/// How far a watcher may fall behind the live channel before it has to catch up from the
/// event history (which it does transparently while the history still covers it).
pub const DEFAULT_LIVE_BUFFER: usize = 1_024;

/// The meta tree key holding the last revision handed out, as a big-endian u64.
const REVISION_KEY: &[u8] = b"revision";

/// Tunables of [`SledStore`]; the defaults suit a hub, tests shrink the buffers.
#[derive(Clone, Debug)]
pub struct SledOptions {
    /// Events kept for watches that resume from a revision; see [`DEFAULT_EVENT_BUFFER`].
    pub event_buffer: usize,
    /// Bytes of those events' objects kept at most; see [`DEFAULT_EVENT_BUFFER_BYTES`].
    pub event_buffer_bytes: usize,
    /// Capacity of the live event channel; see [`DEFAULT_LIVE_BUFFER`].
    pub live_buffer: usize,
}

impl Default for SledOptions {
    fn default() -> Self {
        SledOptions {
            event_buffer: DEFAULT_EVENT_BUFFER,
            event_buffer_bytes: DEFAULT_EVENT_BUFFER_BYTES,
            live_buffer: DEFAULT_LIVE_BUFFER,
        }
    }
}

/// The [`Store`] of a single-node hub: a sled database in a directory. Cheap to clone (handles
/// share one database). Reopening the directory gives back every object, and revisions go on
/// from where they stopped; watch history does not survive a restart, so watches resuming from
/// before it get `Gone` and relist.
#[derive(Clone)]
pub struct SledStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// Kept for its flush, which makes writes durable across both trees.
    db: sled::Db,
    /// Objects by `kind/namespace/name` (`kind//name` for cluster-scoped kinds), as JSON.
    objects: sled::Tree,
    /// The revision counter ([`REVISION_KEY`]).
    meta: sled::Tree,
    /// Held by every write from read-check to staging, by the flusher to publish, and by list
    /// and watch to take a consistent snapshot. Never held across the flush.
    log: Mutex<EventLog>,
    /// Held by the one writer flushing for a batch; the others wait on it and find their
    /// revision covered.
    flush: Mutex<Flushed>,
    /// Flushes done since the store was opened.
    flushes: std::sync::atomic::AtomicU64,
    /// Live events; subscribed to under the `log` lock.
    live: broadcast::Sender<Arc<Recorded>>,
}

/// The revision counter and the recent history of events.
struct EventLog {
    /// The last revision handed out (committed to sled, durable once flushed).
    revision: u64,
    /// Committed events not yet on disk, oldest first: published by the next flush.
    staged: VecDeque<Recorded>,
    /// The last revision published (in `recent` and sent live): every write up to it is durable.
    published: u64,
    /// The most recent events, oldest first, at most `capacity` of them and `byte_capacity`
    /// bytes of objects (`bytes`).
    recent: VecDeque<Arc<Recorded>>,
    capacity: usize,
    bytes: usize,
    byte_capacity: usize,
    /// Every event after this revision is in `recent`: a watch from an older revision cannot be
    /// served. Starts at the revision found on open (history is not persisted), then follows
    /// the events that fall out of `recent`.
    complete_after: u64,
}

/// How far flushes have made the store durable, and the flushes that failed.
struct Flushed {
    /// Every revision up to this one has been flushed (or its flush failed, see `failures`).
    through: u64,
    /// The most recent failed flushes: the revisions each covered and why it failed, so each
    /// writer of such a batch is told; at most [`MAX_FLUSH_FAILURES`].
    failures: VecDeque<(std::ops::RangeInclusive<u64>, String)>,
}

/// Failed flushes remembered for the writers of their batches to find.
const MAX_FLUSH_FAILURES: usize = 64;

/// What a committed change did to its object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Change {
    Added,
    Modified,
    Deleted,
}

/// One committed change, as kept in the history and sent on the live channel. The object is
/// kept as stored (compact JSON, shared by every watcher) and parsed by each watch that sees
/// it: as a `Value` it would take several times the memory.
#[derive(Debug)]
struct Recorded {
    revision: u64,
    kind: Kind,
    namespace: Option<String>,
    change: Change,
    json: Arc<[u8]>,
    /// `metadata.labels` now, for a selected watch to decide by without parsing the object.
    labels: Value,
    /// `metadata.labels` before a `Modified` that may have changed them (a spec update);
    /// `None` when they cannot have changed. What a selected watch decides `Added` or
    /// `Deleted` by when an object comes into or goes out of its selection.
    previous_labels: Option<Value>,
}

impl Recorded {
    fn matches(&self, kind: Kind, namespace: Option<&str>) -> bool {
        self.kind == kind && (namespace.is_none() || self.namespace.as_deref() == namespace)
    }

    /// The object, parsed from what was stored.
    fn object(&self) -> Option<Object> {
        match serde_json::from_slice(&self.json) {
            Ok(object) => Some(object),
            // Written by this store from a Value a moment ago: cannot happen.
            Err(e) => {
                warn!(kind = %self.kind, revision = self.revision, error = %e, "a recorded event does not parse; not delivered");
                None
            }
        }
    }

    /// The event as a watch through `selection` sees it, if it sees it at all.
    fn through(&self, selection: &Selection) -> Option<WatchEvent> {
        let matches = |labels: &Value| selection.matches(&json!({"metadata": {"labels": labels}}));
        let everything = *selection == Selection::Everything;
        let now = everything || matches(&self.labels);
        match self.change {
            Change::Added => now.then(|| self.object().map(WatchEvent::Added))?,
            Change::Deleted => now.then(|| self.object().map(WatchEvent::Deleted))?,
            Change::Modified => {
                let before = match &self.previous_labels {
                    Some(labels) if !everything => matches(labels),
                    _ => now,
                };
                match (before, now) {
                    (true, true) => self.object().map(WatchEvent::Modified),
                    (false, true) => self.object().map(WatchEvent::Added),
                    // As the apiserver does: the object as it last matched (its labels then).
                    (true, false) => {
                        let mut gone = self.object()?;
                        if let Some(labels) = &self.previous_labels {
                            set_meta(&mut gone, "labels", labels.clone());
                        }
                        Some(WatchEvent::Deleted(gone))
                    }
                    (false, false) => None,
                }
            }
        }
    }
}

impl SledStore {
    /// Opens (or creates) the store in directory `path`. Blocks while sled recovers its log.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open_with(path, SledOptions::default())
    }

    /// [`SledStore::open`] with explicit buffer sizes.
    pub fn open_with(path: impl AsRef<Path>, options: SledOptions) -> Result<Self, StoreError> {
        let path = path.as_ref();
        let context = || format!("opening the sled store at {}", path.display());
        let db = sled::open(path).map_err(|e| StoreError::backend(context(), e))?;
        let objects = db
            .open_tree("objects")
            .map_err(|e| StoreError::backend(context(), e))?;
        let meta = db
            .open_tree("meta")
            .map_err(|e| StoreError::backend(context(), e))?;
        let revision = match meta
            .get(REVISION_KEY)
            .map_err(|e| StoreError::backend(context(), e))?
        {
            Some(bytes) => u64::from_be_bytes(bytes.as_ref().try_into().map_err(|_| {
                StoreError::backend(context(), "the revision counter is corrupt (not 8 bytes)")
            })?),
            None => 0,
        };
        debug!(path = %path.display(), revision, objects = objects.len(), "sled store opened");
        let (live, _) = broadcast::channel(options.live_buffer.max(1));
        Ok(SledStore {
            inner: Arc::new(Inner {
                db,
                objects,
                meta,
                log: Mutex::new(EventLog {
                    revision,
                    staged: VecDeque::new(),
                    published: revision,
                    recent: VecDeque::new(),
                    capacity: options.event_buffer.max(1),
                    bytes: 0,
                    byte_capacity: options.event_buffer_bytes,
                    complete_after: revision,
                }),
                flush: Mutex::new(Flushed {
                    through: revision,
                    failures: VecDeque::new(),
                }),
                flushes: std::sync::atomic::AtomicU64::new(0),
                live,
            }),
        })
    }
}

impl SledStore {
    /// Flushes (fsyncs) done since the store was opened: with writers waiting at once, fewer
    /// than the writes they made durable.
    pub fn flushes(&self) -> u64 {
        self.inner
            .flushes
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

fn storage_key(kind: Kind, namespace: Option<&str>, name: &str) -> Vec<u8> {
    format!("{}/{}/{}", kind.name(), namespace.unwrap_or(""), name).into_bytes()
}

/// The key prefix of every object of `kind` in `namespace`, or in all namespaces.
fn storage_prefix(kind: Kind, namespace: Option<&str>) -> Vec<u8> {
    match namespace {
        Some(ns) => format!("{}/{ns}/", kind.name()).into_bytes(),
        None => format!("{}/", kind.name()).into_bytes(),
    }
}

fn parse_revision(from: &Revision) -> Option<u64> {
    from.as_str().parse().ok()
}

impl Inner {
    fn read(&self, key: &ObjectKey) -> Result<Option<Object>, StoreError> {
        let bytes = self
            .objects
            .get(storage_key(key.kind, key.namespace(), &key.name))
            .map_err(|e| StoreError::backend(format!("reading {key}"), e))?;
        bytes
            .map(|b| {
                serde_json::from_slice(&b)
                    .map_err(|e| StoreError::backend(format!("decoding {key}"), e))
            })
            .transpose()
    }

    /// The object's stored JSON, as it is.
    fn read_json(&self, key: &ObjectKey) -> Result<Option<Vec<u8>>, StoreError> {
        let bytes = self
            .objects
            .get(storage_key(key.kind, key.namespace(), &key.name))
            .map_err(|e| StoreError::backend(format!("reading {key}"), e))?;
        Ok(bytes.map(|b| b.to_vec()))
    }

    /// Commits `object` (or the deletion, for `None`) at the next revision and stages `event`
    /// for the next flush to publish. Called with the `log` lock held; the caller releases it
    /// and then waits for [`Inner::durable`] of the returned revision before answering.
    fn commit(
        &self,
        log: &mut EventLog,
        key: &ObjectKey,
        object: Option<&Object>,
        change: Change,
        deleted: Option<Object>,
        previous_labels: Option<Value>,
    ) -> Result<u64, StoreError> {
        let revision = log.revision + 1;
        let storage_key = storage_key(key.kind, key.namespace(), &key.name);
        let bytes = object
            .map(serde_json::to_vec)
            .transpose()
            .map_err(|e| StoreError::backend(format!("encoding {key}"), e))?;
        if let Some(bytes) = &bytes {
            check_size(bytes.len(), || key.clone())?;
        }
        (&self.objects, &self.meta)
            .transaction(|(objects, meta)| {
                match &bytes {
                    Some(bytes) => objects.insert(storage_key.as_slice(), bytes.as_slice())?,
                    None => objects.remove(storage_key.as_slice())?,
                };
                meta.insert(REVISION_KEY, &revision.to_be_bytes())?;
                Ok::<_, ConflictableTransactionError<()>>(())
            })
            .map_err(|e: TransactionError<()>| {
                let context = format!("writing {key}");
                match e {
                    TransactionError::Storage(e) => StoreError::backend(context, e),
                    // Nothing in the transaction aborts it.
                    TransactionError::Abort(()) => {
                        StoreError::backend(context, "the transaction was aborted")
                    }
                }
            })?;
        log.revision = revision;
        let (change, json, labels) = match (bytes, object, deleted) {
            (Some(bytes), Some(o), _) => (change, bytes, o["metadata"]["labels"].clone()),
            (_, _, Some(d)) => (
                change,
                serde_json::to_vec(&d)
                    .map_err(|e| StoreError::backend(format!("encoding {key}"), e))?,
                d["metadata"]["labels"].clone(),
            ),
            _ => (change, b"null".to_vec(), Value::Null),
        };
        log.staged.push_back(Recorded {
            revision,
            kind: key.kind,
            namespace: key.namespace.clone(),
            change,
            json: json.into(),
            labels,
            previous_labels,
        });
        Ok(revision)
    }

    /// Waits until `revision` is on disk and its event published (group commit). The store is
    /// the hub's truth: a write is acknowledged only once it is durable. A flush costs one
    /// fsync (a few ms on SSDs); the writer that finds no flush covering its revision flushes
    /// for every write committed so far, and the writers waiting behind it find theirs covered,
    /// so N concurrent writes cost one fsync rather than N in a row. The events are published
    /// even if the flush fails, so that watchers and readers never disagree about what was
    /// committed in memory; each writer of the failed batch gets the error.
    ///
    /// sled's own `flush_async` can leave its future never woken when flushes overlap (sled
    /// issue 1241): the write would then wait for good, and every later write behind it. A
    /// blocking flush on the blocking pool always returns.
    ///
    /// The wait runs as its own task: a writer that stops waiting (its caller gave up) leaves
    /// its write staged and committed, and the task still publishes it.
    async fn durable(self: &Arc<Self>, revision: u64, key: &ObjectKey) -> Result<(), StoreError> {
        let inner = Arc::clone(self);
        let flushed = tokio::spawn(async move { inner.flush_through(revision).await })
            .await
            .unwrap_or_else(|e| Err(format!("the flush task failed: {e}")));
        flushed.map_err(|e| StoreError::backend(format!("flushing {key}"), e))
    }

    /// Flushes unless a flush already covered `revision`; the error of the flush that covered
    /// it, if it failed.
    async fn flush_through(&self, revision: u64) -> Result<(), String> {
        let mut flushed = self.flush.lock().await;
        if flushed.through < revision {
            // Everything committed so far rides this flush.
            let through = self.log.lock().await.revision;
            let db = self.db.clone();
            self.flushes
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let result = match tokio::task::spawn_blocking(move || db.flush()).await {
                Ok(result) => result.map(|_| ()).map_err(|e| e.to_string()),
                Err(e) => Err(format!("the flush task failed: {e}")),
            };
            let first = flushed.through + 1;
            self.log.lock().await.publish_through(through, &self.live);
            flushed.through = through;
            if let Err(e) = result {
                if flushed.failures.len() == MAX_FLUSH_FAILURES {
                    flushed.failures.pop_front();
                }
                flushed.failures.push_back((first..=through, e));
            }
        }
        match flushed
            .failures
            .iter()
            .find(|(batch, _)| batch.contains(&revision))
        {
            Some((_, e)) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// A live receiver and the events after `from` (or synthetic `Added` for every object when
    /// `from` is `None`), consistent with each other, and the revision they reach.
    async fn subscribe(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        selection: &Selection,
        from: Option<u64>,
        from_text: Option<&Revision>,
    ) -> Result<
        (
            broadcast::Receiver<Arc<Recorded>>,
            VecDeque<WatchEvent>,
            u64,
        ),
        StoreError,
    > {
        let log = self.log.lock().await;
        let rx = self.live.subscribe();
        let pending = match from {
            None => self
                .scan(kind, namespace, selection)?
                .into_iter()
                .map(WatchEvent::Added)
                .collect(),
            Some(from) => {
                if from < log.complete_after || from > log.revision {
                    return Err(StoreError::Gone {
                        from: from_text
                            .cloned()
                            .unwrap_or_else(|| Revision::new(from.to_string())),
                    });
                }
                log.recent
                    .iter()
                    .filter(|r| r.revision > from && r.matches(kind, namespace))
                    .filter_map(|r| r.through(selection))
                    .collect()
            }
        };
        // What the watcher has seen everything up to: a scan reads every committed object,
        // staged ones too, whose events it must then skip when they are published; a resumed
        // watch has the history up to the last published event (or its own `from`, if later),
        // and the staged events come on the live channel.
        let seen = match from {
            None => log.revision,
            Some(from) => from.max(log.published),
        };
        Ok((rx, pending, seen))
    }

    fn scan(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        selection: &Selection,
    ) -> Result<Vec<Object>, StoreError> {
        let context = || format!("listing {kind}");
        let mut selected = Vec::new();
        for v in self
            .objects
            .scan_prefix(storage_prefix(kind, namespace))
            .values()
        {
            let v = v.map_err(|e| StoreError::backend(context(), e))?;
            let object: Object =
                serde_json::from_slice(&v).map_err(|e| StoreError::backend(context(), e))?;
            if selection.matches(&object) {
                selected.push(object);
            }
        }
        Ok(selected)
    }
}

impl EventLog {
    /// Publishes the staged events up to `through` (now on disk), in revision order.
    fn publish_through(&mut self, through: u64, live: &broadcast::Sender<Arc<Recorded>>) {
        while self.staged.front().is_some_and(|r| r.revision <= through) {
            let recorded = self.staged.pop_front().expect("looked at");
            self.published = recorded.revision;
            self.record(live, recorded);
        }
    }

    fn record(&mut self, live: &broadcast::Sender<Arc<Recorded>>, recorded: Recorded) {
        let recorded = Arc::new(recorded);
        let size = recorded.json.len();
        while self.recent.len() >= self.capacity
            || (!self.recent.is_empty() && self.bytes + size > self.byte_capacity)
        {
            let Some(evicted) = self.recent.pop_front() else {
                break;
            };
            self.bytes -= evicted.json.len();
            self.complete_after = evicted.revision;
        }
        self.bytes += size;
        self.recent.push_back(recorded.clone());
        // No receivers is fine: nobody is watching.
        let _ = live.send(recorded);
    }
}

/// `metadata.finalizers`.
fn finalizers(object: &Object) -> Vec<&str> {
    object
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .map(|f| f.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn now_rfc3339() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

impl SledStore {
    async fn list_in(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        selection: &Selection,
    ) -> Result<ObjectList, StoreError> {
        check_scope(kind, namespace, "", false)?;
        // Under the log lock so that the items and the revision agree (sled has no snapshots).
        let log = self.inner.log.lock().await;
        let items = self.inner.scan(kind, namespace, selection)?;
        let revision = Revision::new(log.revision.to_string());
        drop(log);
        Ok(ObjectList { items, revision })
    }

    async fn watch_in(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        selection: Selection,
        from: Option<Revision>,
    ) -> Result<WatchStream, StoreError> {
        check_scope(kind, namespace, "", false)?;

        let from_number = match &from {
            None => None,
            // Not one of ours (say, from another store): only a relist can help.
            Some(r) => Some(parse_revision(r).ok_or_else(|| StoreError::Gone { from: r.clone() })?),
        };
        let (rx, pending, last) = self
            .inner
            .subscribe(kind, namespace, &selection, from_number, from.as_ref())
            .await?;
        debug!(%kind, namespace, from = from_number, pending = pending.len(), "watch started");
        let watcher = Watcher {
            inner: Arc::downgrade(&self.inner),
            kind,
            namespace: namespace.map(str::to_owned),
            selection,
            pending,
            rx,
            last,
            ended: false,
        };
        Ok(Box::pin(futures::stream::unfold(
            watcher,
            |mut w| async move { w.next().await.map(|item| (item, w)) },
        )))
    }

    /// [`Store::update_spec`], with the fencing rule applied first when `fence` is given: to
    /// `object`'s own record when it carries the resourceVersion the write is conditioned on
    /// (as the kube backend does), else to the stored one; under the write lock, so nothing
    /// lands between the compare and the write.
    async fn replace_spec(
        &self,
        mut object: Object,
        fence: Option<&WriteFence>,
    ) -> Result<Object, StoreError> {
        let key = object::validate(&object)?;
        if fence.is_some() {
            fencing::check_kind(&key)?;
        }
        let mut log = self.inner.log.lock().await;
        let current = self.inner.read(&key)?.ok_or_else(|| key.not_found())?;
        if let Some(fence) = fence {
            let judged = match resource_version(&object) {
                Some(_) => &object,
                None => &current,
            };
            fencing::judge(&key, fence, WriteFence::recorded(judged).as_ref())?;
        }
        match fence {
            Some(fence) => fence.set_as_spec_annotation(&mut object),
            None => fencing::keep_stored_spec_record(&key, &mut object, &current),
        }
        let stored_rv = resource_version(&current).unwrap_or("").to_owned();
        if let Some(given) = resource_version(&object)
            && given != stored_rv
        {
            return Err(key.conflict(format!(
                "resourceVersion {given} is stale (stored: {stored_rv}): the object changed \
                 since it was read; get it again and reapply the change"
            )));
        }
        let stored_uid = current
            .pointer("/metadata/uid")
            .cloned()
            .unwrap_or(Value::Null);
        if let Some(given) = object.pointer("/metadata/uid").and_then(Value::as_str)
            && stored_uid.as_str() != Some(given)
        {
            return Err(key.invalid(format!(
                "metadata.uid {given} is not the stored object's ({stored_uid}): it was deleted \
                 and created again; get it again"
            )));
        }
        object::check_replacement(&key, &current, &object)?;
        // deletionTimestamp is the store's to set; while it is set, finalizers may only go away,
        // and the object goes when the last one does.
        let deleting = current.pointer("/metadata/deletionTimestamp").cloned();
        let previous_labels = current
            .pointer("/metadata/labels")
            .cloned()
            .unwrap_or(Value::Null);
        match &deleting {
            Some(since) => {
                let before = finalizers(&current);
                if let Some(added) = finalizers(&object)
                    .into_iter()
                    .find(|f| !before.contains(f))
                {
                    return Err(key.invalid(format!(
                        "metadata.finalizers: no new finalizers can be added while the object \
                         is being deleted (adding {added})"
                    )));
                }
                set_meta(&mut object, "deletionTimestamp", since.clone());
            }
            None => remove_meta(&mut object, "deletionTimestamp"),
        }
        let generation = generation_of(&current) + i64::from(spec_changed(&current, &object));
        if let Some(map) = object.as_object_mut() {
            match current.get("status") {
                Some(status) => map.insert("status".into(), status.clone()),
                None => map.remove("status"),
            };
        }
        set_meta(&mut object, "uid", stored_uid);
        if let Some(created) = current.pointer("/metadata/creationTimestamp") {
            set_meta(&mut object, "creationTimestamp", created.clone());
        }
        set_meta(&mut object, "generation", json!(generation));
        set_meta(
            &mut object,
            "resourceVersion",
            json!((log.revision + 1).to_string()),
        );
        if deleting.is_some() && finalizers(&object).is_empty() {
            let revision = self.inner.commit(
                &mut log,
                &key,
                None,
                Change::Deleted,
                Some(object.clone()),
                None,
            )?;
            drop(log);
            self.inner.durable(revision, &key).await?;
            debug!(kind = %key.kind, namespace = key.namespace(), name = %key.name, revision, "last finalizer removed; deleted");
            return Ok(object);
        }
        let revision = self.inner.commit(
            &mut log,
            &key,
            Some(&object),
            Change::Modified,
            None,
            Some(previous_labels),
        )?;
        drop(log);
        self.inner.durable(revision, &key).await?;
        debug!(kind = %key.kind, namespace = key.namespace(), name = %key.name, revision, generation, "spec updated");
        Ok(object)
    }

    /// [`Store::update_status`] (`fence` = `None`: the stored fencing record stays) or
    /// [`Store::update_status_fenced`] (compared against the stored record and setting it,
    /// under the write lock, so nothing lands between the compare and the write).
    async fn write_status(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
        mut status: Value,
        expected: Option<&Revision>,
        fence: Option<&WriteFence>,
    ) -> Result<Object, StoreError> {
        check_scope(kind, namespace, name, true)?;
        let key = ObjectKey::new(kind, namespace, name);
        if fence.is_some() {
            fencing::check_kind(&key)?;
        }
        object::check_has_status(&key)?;
        if !status.is_object() {
            return Err(key.invalid("status must be a JSON map"));
        }
        let mut log = self.inner.log.lock().await;
        let mut object = self.inner.read(&key)?.ok_or_else(|| key.not_found())?;
        match fence {
            Some(fence) => {
                fencing::judge(&key, fence, WriteFence::recorded(&object).as_ref())?;
                fence.set_in(&mut status);
            }
            None => fencing::keep_stored(&key, &mut status, Some(&object)),
        }
        let stored_rv = resource_version(&object).unwrap_or("").to_owned();
        if let Some(expected) = expected
            && expected.as_str() != stored_rv
        {
            return Err(key.conflict(format!(
                "resourceVersion {expected} is stale (stored: {stored_rv}): the object changed \
                 since it was read; get it again and reapply the status"
            )));
        }
        if let Some(map) = object.as_object_mut() {
            map.insert("status".into(), status);
        }
        set_meta(
            &mut object,
            "resourceVersion",
            json!((log.revision + 1).to_string()),
        );
        let revision =
            self.inner
                .commit(&mut log, &key, Some(&object), Change::Modified, None, None)?;
        drop(log);
        self.inner.durable(revision, &key).await?;
        debug!(%kind, namespace, name, revision, fenced = fence.is_some(), "status updated");
        Ok(object)
    }
}

#[async_trait]
impl Store for SledStore {
    async fn get(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<Object>, StoreError> {
        check_scope(kind, namespace, name, true)?;
        self.inner.read(&ObjectKey::new(kind, namespace, name))
    }

    async fn get_json(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        check_scope(kind, namespace, name, true)?;
        self.inner.read_json(&ObjectKey::new(kind, namespace, name))
    }

    async fn list(&self, kind: Kind, namespace: Option<&str>) -> Result<ObjectList, StoreError> {
        self.list_in(kind, namespace, &Selection::Everything).await
    }

    async fn watch(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        from: Option<Revision>,
    ) -> Result<WatchStream, StoreError> {
        self.watch_in(kind, namespace, Selection::Everything, from)
            .await
    }

    async fn list_selected(
        &self,
        kind: Kind,
        selection: &Selection,
    ) -> Result<ObjectList, StoreError> {
        self.list_in(kind, None, selection).await
    }

    async fn watch_selected(
        &self,
        kind: Kind,
        selection: &Selection,
        from: Option<Revision>,
    ) -> Result<WatchStream, StoreError> {
        self.watch_in(kind, None, selection.clone(), from).await
    }

    async fn create(&self, mut object: Object) -> Result<Object, StoreError> {
        let key = object::validate(&object)?;
        // What the apiserver sets on create, and what it ignores (status comes only through
        // the status subresource).
        set_meta(&mut object, "uid", json!(uuid::Uuid::new_v4().to_string()));
        set_meta(&mut object, "creationTimestamp", json!(now_rfc3339()));
        set_meta(&mut object, "generation", json!(1));
        remove_meta(&mut object, "deletionTimestamp");
        remove_meta(&mut object, "deletionGracePeriodSeconds");
        if let Some(map) = object.as_object_mut() {
            map.remove("status");
        }
        let mut log = self.inner.log.lock().await;
        if self.inner.read(&key)?.is_some() {
            return Err(key.already_exists());
        }
        set_meta(
            &mut object,
            "resourceVersion",
            json!((log.revision + 1).to_string()),
        );
        let revision =
            self.inner
                .commit(&mut log, &key, Some(&object), Change::Added, None, None)?;
        drop(log);
        self.inner.durable(revision, &key).await?;
        debug!(kind = %key.kind, namespace = key.namespace(), name = %key.name, revision, "created");
        Ok(object)
    }

    async fn update_spec(&self, object: Object) -> Result<Object, StoreError> {
        self.replace_spec(object, None).await
    }

    async fn update_spec_fenced(
        &self,
        object: Object,
        fence: &WriteFence,
    ) -> Result<Object, StoreError> {
        self.replace_spec(object, Some(fence)).await
    }

    async fn update_status(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
        status: Value,
        expected: Option<&Revision>,
    ) -> Result<Object, StoreError> {
        self.write_status(kind, namespace, name, status, expected, None)
            .await
    }

    async fn update_status_fenced(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
        status: Value,
        fence: &WriteFence,
        // The compare happens on the stored object under the write lock: no basis needed.
        _basis: Option<&Basis>,
    ) -> Result<Object, StoreError> {
        self.write_status(kind, namespace, name, status, None, Some(fence))
            .await
    }
    async fn delete(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<(), StoreError> {
        check_scope(kind, namespace, name, true)?;
        let key = ObjectKey::new(kind, namespace, name);
        let mut log = self.inner.log.lock().await;
        let mut last = self.inner.read(&key)?.ok_or_else(|| key.not_found())?;
        if !finalizers(&last).is_empty() {
            // Like the apiserver: an object with finalizers is only marked, and goes when an
            // update removes the last finalizer. Marking bumps generation so controllers notice.
            if last.pointer("/metadata/deletionTimestamp").is_some() {
                return Ok(());
            }
            let generation = generation_of(&last) + 1;
            set_meta(&mut last, "deletionTimestamp", json!(now_rfc3339()));
            set_meta(&mut last, "deletionGracePeriodSeconds", json!(0));
            set_meta(&mut last, "generation", json!(generation));
            set_meta(
                &mut last,
                "resourceVersion",
                json!((log.revision + 1).to_string()),
            );
            let revision =
                self.inner
                    .commit(&mut log, &key, Some(&last), Change::Modified, None, None)?;
            drop(log);
            self.inner.durable(revision, &key).await?;
            debug!(%kind, namespace, name, revision, "marked for deletion; waiting for finalizers");
            return Ok(());
        }
        // Like the apiserver: the Deleted event carries the object at the deletion's revision.
        set_meta(
            &mut last,
            "resourceVersion",
            json!((log.revision + 1).to_string()),
        );
        let revision =
            self.inner
                .commit(&mut log, &key, None, Change::Deleted, Some(last), None)?;
        drop(log);
        self.inner.durable(revision, &key).await?;
        debug!(%kind, namespace, name, revision, "deleted");
        Ok(())
    }

    async fn ensure_namespace(&self, _name: &str) -> Result<(), StoreError> {
        // Namespaces are implicit here: a key prefix, nothing to create.
        Ok(())
    }
}

/// The state behind one watch stream.
struct Watcher {
    /// Weak so that dropping every [`SledStore`] handle closes the database and ends watches.
    inner: Weak<Inner>,
    kind: Kind,
    namespace: Option<String>,
    /// Which objects it reports, and how (see [`Recorded::through`]).
    selection: Selection,
    /// Replayed history or synthetic `Added` events, delivered before the live channel.
    pending: VecDeque<WatchEvent>,
    rx: broadcast::Receiver<Arc<Recorded>>,
    /// The revision this watcher has seen everything up to (matching or not).
    last: u64,
    ended: bool,
}

impl Watcher {
    async fn next(&mut self) -> Option<Result<WatchEvent, StoreError>> {
        loop {
            if self.ended {
                return None;
            }
            if let Some(event) = self.pending.pop_front() {
                return Some(Ok(event));
            }
            match self.rx.recv().await {
                Ok(recorded) => {
                    if recorded.revision <= self.last {
                        continue;
                    }
                    self.last = recorded.revision;
                    if recorded.matches(self.kind, self.namespace.as_deref())
                        && let Some(event) = recorded.through(&self.selection)
                    {
                        return Some(Ok(event));
                    }
                }
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    // Fell behind the live channel: catch up from the history, or tell the
                    // caller to relist if the history no longer reaches back far enough.
                    let inner = self.inner.upgrade()?;
                    warn!(kind = %self.kind, namespace = self.namespace.as_deref(), last = self.last, missed, "watcher lagged; catching up from history");
                    match inner
                        .subscribe(
                            self.kind,
                            self.namespace.as_deref(),
                            &self.selection,
                            Some(self.last),
                            None,
                        )
                        .await
                    {
                        Ok((rx, pending, last)) => {
                            self.rx = rx;
                            self.pending = pending;
                            self.last = last;
                        }
                        Err(e) => {
                            self.ended = true;
                            return Some(Err(e));
                        }
                    }
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use std::time::Duration;

    fn work(namespace: &str, name: &str, image: &str) -> Object {
        json!({
            "apiVersion": "work.open-cluster-management.io/v1",
            "kind": "ManifestWork",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"workload": {"manifests": [{"image": image}]}},
        })
    }

    async fn next(stream: &mut WatchStream) -> Result<WatchEvent, StoreError> {
        tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .expect("a watch event within 10s")
            .expect("the stream to go on")
    }

    /// Opens `path` again after the previous store was dropped. sled releases its directory
    /// lock from its background flusher thread a moment after the last handle goes, so poll
    /// for that, with a bound (500 × 10 ms).
    async fn reopen(path: &std::path::Path) -> SledStore {
        for _ in 0..500 {
            match SledStore::open(path) {
                Ok(store) => return store,
                Err(e) if e.to_string().contains("lock") => {
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
                Err(e) => panic!("reopening the store: {e}"),
            }
        }
        panic!(
            "sled kept its lock on {} for 5 s after the store was dropped",
            path.display()
        );
    }

    #[tokio::test]
    async fn reopen_keeps_objects_and_never_reuses_revisions() {
        let dir = tempfile::tempdir().unwrap();
        let before = {
            let store = SledStore::open(dir.path()).unwrap();
            let a = store.create(work("store-1", "a", "v1")).await.unwrap();
            store.create(work("store-1", "b", "v1")).await.unwrap();
            store
                .delete(Kind::ManifestWork, Some("store-1"), "b")
                .await
                .unwrap();
            a
        };
        let store = reopen(dir.path()).await;
        let got = store
            .get(Kind::ManifestWork, Some("store-1"), "a")
            .await
            .unwrap();
        assert_eq!(got.as_ref(), Some(&before), "object survives reopen");
        let list = store.list(Kind::ManifestWork, None).await.unwrap();
        assert_eq!(list.items.len(), 1, "the deletion survives reopen");
        assert_eq!(list.revision.as_str(), "3");
        let c = store.create(work("store-1", "c", "v1")).await.unwrap();
        assert_eq!(resource_version(&c), Some("4"), "revision continues");
        // History did not survive the restart: a watch from before it must relist.
        let err = store
            .watch(Kind::ManifestWork, None, Some(Revision::new("1")))
            .await
            .err()
            .expect("Gone");
        assert!(matches!(err, StoreError::Gone { .. }), "{err}");
        // From the reopen's revision on, history is complete.
        let mut from_reopen = store
            .watch(Kind::ManifestWork, None, Some(Revision::new("3")))
            .await
            .unwrap();
        let e = next(&mut from_reopen).await.unwrap();
        assert_eq!(e, WatchEvent::Added(c));
    }

    #[tokio::test]
    async fn resuming_from_beyond_the_history_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let options = SledOptions {
            event_buffer: 4,
            event_buffer_bytes: DEFAULT_EVENT_BUFFER_BYTES,
            live_buffer: 4,
        };
        let store = SledStore::open_with(dir.path(), options).unwrap();
        let first = store.create(work("n", "w", "v0")).await.unwrap();
        let from = Revision::of(&first).unwrap();
        for i in 1..=4 {
            store
                .update_spec(work("n", "w", &format!("v{i}")))
                .await
                .unwrap();
        }
        // Revisions 2..=5 are buffered: resuming from 1 still works, from 0 does not.
        let mut ok = store
            .watch(Kind::ManifestWork, None, Some(from))
            .await
            .unwrap();
        assert!(matches!(
            next(&mut ok).await.unwrap(),
            WatchEvent::Modified(_)
        ));
        let err = store
            .watch(Kind::ManifestWork, None, Some(Revision::new("0")))
            .await
            .err()
            .expect("Gone");
        assert!(
            matches!(&err, StoreError::Gone { from } if from.as_str() == "0"),
            "{err}"
        );
        let err = store
            .watch(Kind::ManifestWork, None, Some(Revision::new("99")))
            .await
            .err()
            .expect("a revision from the future is Gone too");
        assert!(matches!(err, StoreError::Gone { .. }), "{err}");
    }

    #[tokio::test]
    async fn the_history_keeps_at_most_its_bytes_of_objects() {
        let dir = tempfile::tempdir().unwrap();
        // The object as stored, measured in a store of its own.
        let size = {
            let scratch = tempfile::tempdir().unwrap();
            let store = SledStore::open(scratch.path()).unwrap();
            serde_json::to_vec(&store.create(work("n", "w", "v0")).await.unwrap())
                .unwrap()
                .len()
        };
        // Room for three of these objects, though the count would allow a hundred.
        let options = SledOptions {
            event_buffer: 100,
            event_buffer_bytes: 3 * size + size / 2,
            live_buffer: 4,
        };
        let store = SledStore::open_with(dir.path(), options).unwrap();
        let first = store.create(work("n", "w", "v0")).await.unwrap();
        let mut revisions = vec![Revision::of(&first).unwrap()];
        for i in 1..=4 {
            let o = store
                .update_spec(work("n", "w", &format!("v{i}")))
                .await
                .unwrap();
            revisions.push(Revision::of(&o).unwrap());
        }
        // The last three events are kept: resuming after the second works and sees them in
        // order; resuming after the first would need one that made room.
        let mut ok = store
            .watch(Kind::ManifestWork, None, Some(revisions[1].clone()))
            .await
            .unwrap();
        for want in &revisions[2..] {
            let e = next(&mut ok).await.unwrap();
            assert_eq!(Revision::of(e.object()).as_ref(), Some(want));
        }
        let err = store
            .watch(Kind::ManifestWork, None, Some(revisions[0].clone()))
            .await
            .err()
            .expect("Gone");
        assert!(matches!(err, StoreError::Gone { .. }), "{err}");
    }

    #[tokio::test]
    async fn a_lagging_watcher_catches_up_from_history() {
        let dir = tempfile::tempdir().unwrap();
        let options = SledOptions {
            event_buffer: 100,
            event_buffer_bytes: DEFAULT_EVENT_BUFFER_BYTES,
            live_buffer: 2,
        };
        let store = SledStore::open_with(dir.path(), options).unwrap();
        let mut watch = store
            .watch(Kind::ManifestWork, Some("n"), None)
            .await
            .unwrap();
        for i in 0..20 {
            store
                .create(work("n", &format!("w{i}"), "v"))
                .await
                .unwrap();
        }
        for i in 0..20 {
            let e = next(&mut watch).await.unwrap();
            assert_eq!(
                object::name_of(e.object()),
                format!("w{i}"),
                "in order, none lost"
            );
        }
    }

    #[tokio::test]
    async fn a_watcher_lagging_beyond_the_history_gets_gone() {
        let dir = tempfile::tempdir().unwrap();
        let options = SledOptions {
            event_buffer: 4,
            event_buffer_bytes: DEFAULT_EVENT_BUFFER_BYTES,
            live_buffer: 2,
        };
        let store = SledStore::open_with(dir.path(), options).unwrap();
        let mut watch = store
            .watch(Kind::ManifestWork, Some("n"), None)
            .await
            .unwrap();
        for i in 0..20 {
            store
                .create(work("n", &format!("w{i}"), "v"))
                .await
                .unwrap();
        }
        let err = next(&mut watch).await.expect_err("Gone, not silent loss");
        assert!(matches!(err, StoreError::Gone { .. }), "{err}");
        assert!(
            tokio::time::timeout(Duration::from_secs(10), watch.next())
                .await
                .unwrap()
                .is_none(),
            "the stream ends after its error"
        );
    }

    #[tokio::test]
    async fn concurrent_writers_share_flushes_and_watchers_see_every_write_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let start = store.list(Kind::ManifestWork, None).await.unwrap().revision;
        let mut watch = store
            .watch(Kind::ManifestWork, None, Some(start))
            .await
            .unwrap();
        const WRITERS: usize = 64;
        let writes: Vec<_> = (0..WRITERS)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move {
                    store
                        .create(work("ns", &format!("w{i}"), "app:1"))
                        .await
                        .map(|o| resource_version(&o).unwrap().parse::<u64>().unwrap())
                })
            })
            .collect();
        let mut revisions = Vec::new();
        for write in writes {
            revisions.push(write.await.unwrap().unwrap());
        }
        // Each writer was answered only once its write was flushed, and they shared flushes.
        let flushes = store.flushes();
        assert!(
            flushes < WRITERS as u64 / 2,
            "{flushes} flushes for {WRITERS} concurrent writes"
        );
        // The watch sees every write once, in revision order.
        let mut seen = Vec::new();
        for _ in 0..WRITERS {
            let WatchEvent::Added(o) = next(&mut watch).await.unwrap() else {
                panic!("an Added event")
            };
            seen.push(resource_version(&o).unwrap().parse::<u64>().unwrap());
        }
        revisions.sort_unstable();
        assert_eq!(seen, revisions);
        // A reopened store has every write.
        drop(watch);
        drop(store);
        let store = reopen(dir.path()).await;
        assert_eq!(
            store
                .list(Kind::ManifestWork, None)
                .await
                .unwrap()
                .items
                .len(),
            WRITERS
        );
    }

    #[tokio::test]
    async fn dropping_the_store_ends_watches() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let mut watch = store.watch(Kind::ManagedCluster, None, None).await.unwrap();
        drop(store);
        let end = tokio::time::timeout(Duration::from_secs(10), watch.next())
            .await
            .unwrap();
        assert!(end.is_none());
        // ... and releases the database, so it can be opened again.
        reopen(dir.path()).await;
    }
}
