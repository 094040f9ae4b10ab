//! The agent's durable state: what the hub wants here, what the agent applied, and the status
//! the hub has not acknowledged yet. It is what lets the agent ride out a hub outage: on start
//! the agent reconciles from here at once, hub or no hub.
//!
//! Everything sits behind [`WorkCache`], a narrow, object-safe, synchronous trait (writes wait
//! for the disk; callers that must not block a runtime thread use [`durably`]). [`ClusterCache`]
//! is the implementation, one cluster's records in a [`CacheDb`]: a redb database file, which
//! can hold many clusters, each under its own key prefix, so the load-test harness can run
//! thousands of agents on one database instead of thousands of files.
//!
//! redb because the cache must survive the agent being killed at any instant (kill -9, OOM,
//! power cut): each write is one ACID transaction, committed with an fsync and checksummed,
//! and after a crash the file opens at the last committed transaction. sled, used before,
//! lost the whole cache to a kill in the agent's torture test; a cache an older agent left in
//! sled's format is removed on start ([`retire_sled_cache`]) and the agent starts empty.
//!
//! Writes that the protocol relies on are durable when they return: the agent acks a
//! generation only after it is durable, and a status must survive a restart until the hub acks
//! it. Status acks are not: losing one only re-sends a status the hub drops by its seq.
//!
//! One process, one writer at a time: redb serializes write transactions, and each durable
//! commit is an fsync. An agent writes a few records per work change, so its own database
//! commits each write on its own ([`CommitMode::PerWrite`]). The load test's thousands of
//! agents share one database and would queue behind each other's fsyncs, so that database
//! commits in groups ([`CommitMode::Group`]): writes that arrive while a commit is on the disk
//! go into the next transaction together, and each returns once that transaction is durable.

use std::collections::HashSet;
use std::fmt;
use std::path::Path;
use std::sync::{Arc, mpsc};

use flotilla_proto::wire::HeldWork;
use redb::backends::InMemoryBackend;
use redb::{
    Database, Durability, ReadOnlyTable, ReadableDatabase as _, ReadableTable, TableDefinition,
    WriteTransaction,
};
use serde::{Deserialize, Serialize};
use tracing::warn;

/// Largest ManifestWork (as the hub's JSON) the agent keeps. A bigger one is refused: the cache
/// records the refusal instead of the content, and the status says so. The hub's own bound on
/// manifests is 500 KiB of compact JSON; this leaves room for metadata and for a hub that is
/// newer than this agent, while keeping one work's memory bounded.
pub const MAX_MANIFEST_WORK_BYTES: usize = 2 * 1024 * 1024;

/// One work as the agent holds it, without its content (see [`WorkCache::manifest_work`]), so
/// listing works for a hello or a resync never loads every manifest.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct CachedWork {
    /// The ManifestWork's `metadata.uid` on the hub: the key of everything here.
    pub uid: String,
    /// The hub namespace (the cluster's name), for logs and messages.
    pub namespace: String,
    /// The ManifestWork's name, for logs and messages.
    pub name: String,
    /// `metadata.generation` of the spec held.
    pub generation: i64,
    /// The hub's content hash of that spec, echoed in the hello so a resume sends only what
    /// differs.
    pub content_hash: String,
    /// Set when the agent would not keep the content (too large, not a ManifestWork); the
    /// reason goes into the work's status. The generation is still held and acked, so the hub
    /// does not resend the same content on every reconnect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// The hub deleted the work. It stays, as a tombstone, until its resources are deleted or
    /// orphaned as its deleteOption says; then it is forgotten.
    #[serde(default)]
    pub deleting: bool,
}

impl CachedWork {
    /// `namespace/name`, as people write it.
    pub fn display_name(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// What the hello says about this work.
    pub fn held(&self) -> HeldWork {
        HeldWork {
            uid: self.uid.clone(),
            generation: self.generation,
            content_hash: self.content_hash.clone(),
        }
    }
}

/// One resource a work applied, as the ledger remembers it for deletion and orphaning.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AppliedResource {
    /// API group; empty for the core group.
    pub group: String,
    /// API version, e.g. `v1`.
    pub version: String,
    /// Kind, e.g. `Deployment`.
    pub kind: String,
    /// Resource (plural, lower-case), e.g. `deployments`.
    pub resource: String,
    /// Namespace; empty for cluster-scoped resources.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl AppliedResource {
    /// `apiVersion` as written in manifests: `apps/v1`, or `v1` for the core group.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

impl fmt::Display for AppliedResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} ", self.api_version(), self.kind)?;
        if !self.namespace.is_empty() {
            write!(f, "{}/", self.namespace)?;
        }
        f.write_str(&self.name)
    }
}

/// The latest status the agent produced for a work, and how far the hub has acknowledged it.
/// It stays after the ack: the next status is compared with it, so an unchanged status is
/// never produced twice, and its seq keeps counting up across restarts.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct StatusRecord {
    /// The work generation the status was computed for.
    pub generation: i64,
    /// This status's seq; every new status of the work gets the next one.
    pub seq: u64,
    /// The highest seq the hub acknowledged; the status is pending while `acked_seq < seq`.
    pub acked_seq: u64,
    /// The ManifestWork status (conditions, resourceStatus).
    pub status: serde_json::Value,
}

impl StatusRecord {
    /// Whether the hub has yet to acknowledge this status.
    pub fn is_pending(&self) -> bool {
        self.acked_seq < self.seq
    }
}

/// A status the hub has not acknowledged, ready for `report_status`.
#[derive(Clone, Debug, PartialEq)]
pub struct PendingStatus {
    /// The work's uid.
    pub uid: String,
    /// The generation it was computed for.
    pub generation: i64,
    /// Its seq.
    pub seq: u64,
    /// The status as JSON.
    pub status_json: Vec<u8>,
}

/// Why the cache could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The cache file could not be opened. Not retryable: fix the path or its permissions
    /// (`--data-dir`), or stop the other agent using it.
    #[error(
        "cannot open the agent cache at {path}: {source}; pass --data-dir a writable directory that no other agent uses"
    )]
    Open {
        /// The file.
        path: String,
        /// What redb said.
        source: redb::DatabaseError,
    },
    /// redb failed to read, write or commit. Retryable when the disk recovers (full, I/O
    /// error). Shared, because one failed group commit fails every write in it.
    #[error("agent cache storage failed: {0}")]
    Storage(#[source] Arc<redb::Error>),
    /// A stored record does not decode. Not retryable: the record is damaged or from an
    /// incompatible agent version.
    #[error("agent cache record {tree}/{uid} is unreadable: {source}")]
    Corrupt {
        /// Which table.
        tree: &'static str,
        /// Which work.
        uid: String,
        /// The decode error.
        source: serde_json::Error,
    },
    /// A record to store could not be encoded. Not retryable (a bug).
    #[error("cannot encode agent cache record {tree}/{uid}: {source}")]
    Encode {
        /// Which table.
        tree: &'static str,
        /// Which work.
        uid: String,
        /// The encode error.
        source: serde_json::Error,
    },
    /// A blocking cache call could not run (the runtime is shutting down), or the group
    /// committer stopped. Not retryable.
    #[error("agent cache task failed: {0}")]
    Task(String),
}

/// Wraps any redb error as [`CacheError::Storage`].
fn storage(e: impl Into<redb::Error>) -> CacheError {
    CacheError::Storage(Arc::new(e.into()))
}

/// The agent's durable state for one cluster.
///
/// Methods marked *durable* are flushed to disk before they return. Everything is keyed by
/// work uid.
pub trait WorkCache: Send + Sync + fmt::Debug {
    /// Every work held, tombstones included, in uid order.
    fn works(&self) -> Result<Vec<CachedWork>, CacheError>;

    /// The work with this uid, if held.
    fn work(&self, uid: &str) -> Result<Option<CachedWork>, CacheError>;

    /// The ManifestWork JSON as the hub sent it, if held and not refused.
    fn manifest_work(&self, uid: &str) -> Result<Option<Vec<u8>>, CacheError>;

    /// *Durable.* Stores a work and its content (`None` when refused), replacing what was held
    /// for its uid, tombstone included. Its transfer, if one was recorded, is done; chunks only
    /// the replaced content named are released.
    fn put_work(&self, work: &CachedWork, manifest_work: Option<&[u8]>) -> Result<(), CacheError>;

    /// *Durable.* Marks a work deleted by the hub. `false` when the uid is not held.
    fn mark_deleting(&self, uid: &str) -> Result<bool, CacheError>;

    /// *Durable.* Drops everything about a work: content, ledger, status, its transfer under
    /// way, and the chunks of large-work content no other held work (or transfer) names.
    fn forget(&self, uid: &str) -> Result<(), CacheError>;

    /// *Durable.* Drops everything about a deleted work, as [`forget`](Self::forget) does, and
    /// in the same transaction puts its release in the outbox: the hub is told (`WorkReleased`)
    /// on this session and every later one until it acknowledges. Also for a uid not held (a
    /// delete for a work the agent never had, or already released): there is nothing to remove,
    /// and the hub still needs to hear so.
    fn release(&self, uid: &str) -> Result<(), CacheError>;

    /// Releases the hub has not acknowledged, in uid order.
    fn pending_releases(&self) -> Result<Vec<String>, CacheError>;

    /// The hub recorded the release of `uid`: drop it from the outbox.
    fn ack_release(&self, uid: &str) -> Result<(), CacheError>;

    /// The resources the work applied (empty when none).
    fn ledger(&self, uid: &str) -> Result<Vec<AppliedResource>, CacheError>;

    /// Every work's ledger, for checking whether another work also owns a resource.
    fn ledgers(&self) -> Result<Vec<(String, Vec<AppliedResource>)>, CacheError>;

    /// *Durable.* Replaces the work's ledger.
    fn set_ledger(&self, uid: &str, resources: &[AppliedResource]) -> Result<(), CacheError>;

    /// The latest status produced for the work, acknowledged or not.
    fn last_status(&self, uid: &str) -> Result<Option<StatusRecord>, CacheError>;

    /// *Durable.* Records a new status for the work under the next seq and returns that seq.
    /// It replaces any status still pending (the outbox keeps the latest per work).
    fn push_status(
        &self,
        uid: &str,
        generation: i64,
        status: &serde_json::Value,
    ) -> Result<u64, CacheError>;

    /// Every status the hub has not acknowledged, one per work.
    fn pending_statuses(&self) -> Result<Vec<PendingStatus>, CacheError>;

    /// The hub stored the work's status up to `seq`. Says whether the outbox entry is now
    /// acknowledged (`false` when a newer status is pending or the work is unknown).
    fn ack_status(&self, uid: &str, seq: u64) -> Result<bool, CacheError>;

    /// The chunk of large-work content with this hex SHA-256, if held. Chunks are kept once
    /// per content, however many works name them.
    fn chunk(&self, sha256: &str) -> Result<Option<Vec<u8>>, CacheError>;

    /// *Durable.* Keeps a chunk (already checked against its digest) under its digest, if a
    /// held work or a transfer under way ([`WorkCache::begin_fetch`]) names it; says whether it
    /// was kept. A chunk nothing names (one still on the way for a transfer given up) is
    /// dropped, so it cannot outlive the transfer.
    fn put_chunk(&self, sha256: &str, data: &[u8]) -> Result<bool, CacheError>;

    /// *Durable.* Records that the content of work `uid` is being fetched (in place of any
    /// transfer recorded for it before), so that its chunks are kept across a disconnect or a
    /// restart until the work is stored, and releases the chunks nothing names any more (an
    /// earlier transfer's). Returns which of `chunks` are not held, in order.
    fn begin_fetch(&self, uid: &str, chunks: &[String]) -> Result<Vec<String>, CacheError>;

    /// *Durable.* Gives up the transfer of work `uid`, if one is recorded, releasing the chunks
    /// nothing else names. Returns how many chunks were released.
    fn end_fetch(&self, uid: &str) -> Result<u64, CacheError>;

    /// The uids of the works whose transfers are recorded.
    fn fetches(&self) -> Result<Vec<String>, CacheError>;

    /// *Durable.* Gives up the transfers of every work but those in `keep`, releasing the
    /// chunks nothing else names. Returns how many chunks were released.
    fn end_fetches(&self, keep: &[String]) -> Result<u64, CacheError>;

    /// How many chunks are held, and their bytes together.
    fn chunk_totals(&self) -> Result<(u64, u64), CacheError>;

    /// Which of `chunks` are not held, in order: what a transfer still needs, so one cut off
    /// by a disconnect or a restart resumes after the last chunk stored.
    fn missing_chunks(&self, chunks: &[String]) -> Result<Vec<String>, CacheError> {
        let mut missing = Vec::new();
        for sha in chunks {
            if self.chunk(sha)?.is_none() && !missing.contains(sha) {
                missing.push(sha.clone());
            }
        }
        Ok(missing)
    }

    /// What the hello says is being removed: tombstones, then releases not yet acknowledged.
    fn releasing(&self) -> Result<Vec<String>, CacheError> {
        let mut uids: Vec<String> = self
            .works()?
            .into_iter()
            .filter(|w| w.deleting)
            .map(|w| w.uid)
            .collect();
        uids.extend(self.pending_releases()?);
        Ok(uids)
    }

    /// What the hello carries: every live work (not tombstones) with its generation and hash.
    fn held(&self) -> Result<Vec<HeldWork>, CacheError> {
        Ok(self
            .works()?
            .iter()
            .filter(|w| !w.deleting)
            .map(CachedWork::held)
            .collect())
    }
}

/// Runs a cache call on the blocking pool: flushes wait on the disk, and a runtime thread must
/// not.
pub async fn durably<T, F>(cache: &Arc<dyn WorkCache>, f: F) -> Result<T, CacheError>
where
    T: Send + 'static,
    F: FnOnce(&dyn WorkCache) -> Result<T, CacheError> + Send + 'static,
{
    let cache = Arc::clone(cache);
    tokio::task::spawn_blocking(move || f(cache.as_ref()))
        .await
        .map_err(|e| CacheError::Task(e.to_string()))?
}

/// redb's page cache. Its default (1 GiB) is sized for a server; an agent on a small edge node
/// holds a few MiB of works, and a load-test database is opened once for all its agents.
const PAGE_CACHE_BYTES: usize = 64 * 1024 * 1024;

/// Most writes one group commit puts in a transaction. Writers wait for their commit, so the
/// queue never holds more than there are blocked writers (tokio's blocking pool, 512 by
/// default); this bounds one transaction's size and the time the first writer waits.
const MAX_GROUP: usize = 512;

/// A table of the cache. Each holds every cluster's records, keyed by `cluster \0 uid`.
#[derive(Clone, Copy)]
struct Table(&'static str);

impl Table {
    fn def(self) -> TableDefinition<'static, &'static [u8], &'static [u8]> {
        TableDefinition::new(self.0)
    }
}

/// uid → [`CachedWork`] (JSON).
const WORKS: Table = Table("works");
/// uid → the ManifestWork JSON as received. Apart from `works` so listing stays cheap.
const MANIFESTS: Table = Table("manifests");
/// hex SHA-256 → a chunk of large-work content (raw bytes), shared by every work naming it.
const CHUNKS: Table = Table("chunks");
/// uid → the hex digests (JSON list) of a large work's content being fetched: the chunks a
/// transfer under way keeps until the work is stored, or the transfer is given up.
const FETCHES: Table = Table("fetches");
/// uid → `Vec<AppliedResource>` (JSON).
const LEDGER: Table = Table("ledger");
/// uid → [`StatusRecord`] (JSON): the latest status and the outbox in one record, so a new
/// status and an ack meet on one key only.
const STATUS: Table = Table("status");
/// uid → nothing: works released from the spoke whose release the hub has not acknowledged.
const RELEASED: Table = Table("released");
// The agent's identity (key, certificate, CA bundle) is files in its own directory, written
// atomically (`identity`), not records here.

/// How a [`CacheDb`] commits writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitMode {
    /// Each write is its own transaction, committed by the caller's thread. An agent's own
    /// database: simple, and a write waits only for its own fsync.
    PerWrite,
    /// Writes from many threads are committed together by one committer thread, each
    /// returning once the transaction holding it is durable. For one database shared by many
    /// agents (the load test), where per-write commits would queue on each other's fsyncs.
    Group,
}

/// A redb database that holds the caches of one or more clusters. Cheap to clone; the file
/// closes when the last handle (or [`ClusterCache`]) is dropped.
#[derive(Clone)]
pub struct CacheDb {
    inner: Arc<DbInner>,
}

struct DbInner {
    /// With [`CommitMode::Group`]. Declared before `db` so that dropping stops the committer
    /// (which holds the database too) before the database closes.
    committer: Option<GroupCommitter>,
    db: Arc<Database>,
    /// The file, or `memory`, for messages.
    location: String,
}

impl fmt::Debug for CacheDb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CacheDb")
            .field("location", &self.inner.location)
            .field("group_commit", &self.inner.committer.is_some())
            .finish()
    }
}

impl CacheDb {
    /// Opens (creating it and its directory if needed) the database file at `path`, each write
    /// committed on its own. redb locks the file: a second opener gets [`CacheError::Open`].
    /// After a crash the file opens at its last committed transaction (redb repairs its
    /// allocator state first, which takes a moment on a large file).
    pub fn open(path: &Path) -> Result<Self, CacheError> {
        Self::open_with(path, CommitMode::PerWrite)
    }

    /// [`CacheDb::open`] with the given [`CommitMode`].
    pub fn open_with(path: &Path, mode: CommitMode) -> Result<Self, CacheError> {
        let fail = |source: redb::DatabaseError| CacheError::Open {
            path: path.display().to_string(),
            source,
        };
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
        if let Some(dir) = dir {
            std::fs::create_dir_all(dir).map_err(|e| fail(e.into()))?;
        }
        let created = !path.exists();
        let db = redb::Builder::new()
            .set_cache_size(PAGE_CACHE_BYTES)
            .create(path)
            .map_err(fail)?;
        if created && let Some(dir) = dir {
            // redb fsyncs the file on every commit, not the directory: without this a power
            // cut could take the new file's name, and with it every write acked since.
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| fail(e.into()))?;
        }
        Self::start(db, mode, path.display().to_string())
    }

    /// A database in memory, gone when dropped (tests). Same transactions, no durability.
    pub fn temporary() -> Result<Self, CacheError> {
        let db = redb::Builder::new()
            .create_with_backend(InMemoryBackend::new())
            .map_err(storage)?;
        Self::start(db, CommitMode::PerWrite, "memory".to_owned())
    }

    fn start(db: Database, mode: CommitMode, location: String) -> Result<Self, CacheError> {
        // Every table exists from the start, so a read never meets a missing one.
        let txn = db.begin_write().map_err(storage)?;
        Tables::open(&txn)?;
        txn.commit().map_err(storage)?;
        let db = Arc::new(db);
        let committer = match mode {
            CommitMode::PerWrite => None,
            CommitMode::Group => Some(GroupCommitter::start(Arc::clone(&db), &location)?),
        };
        Ok(Self {
            inner: Arc::new(DbInner {
                committer,
                db,
                location,
            }),
        })
    }

    /// The cache of one cluster in this database; clusters never see each other's records.
    pub fn cluster(&self, cluster: &str) -> ClusterCache {
        let mut prefix = cluster.as_bytes().to_vec();
        // Cluster names are DNS labels and never contain NUL, so no prefix is another's prefix.
        prefix.push(0);
        ClusterCache {
            db: self.clone(),
            prefix,
        }
    }

    /// Runs `f` on a consistent snapshot of `table`.
    fn read<T>(
        &self,
        table: Table,
        f: impl FnOnce(&ReadOnlyTable<&'static [u8], &'static [u8]>) -> Result<T, CacheError>,
    ) -> Result<T, CacheError> {
        let txn = self.inner.db.begin_read().map_err(storage)?;
        let t = txn.open_table(table.def()).map_err(storage)?;
        f(&t)
    }

    /// Runs `op` in a write transaction and returns its result once the transaction is
    /// committed: durable with [`Durability::Immediate`], or at the next durable commit (or
    /// lost in a crash) with [`Durability::None`]. `op` must do everything that can fail short
    /// of storage before it writes: in a group its writes commit even when it returns an error.
    fn write<T: Send + 'static>(
        &self,
        durability: Durability,
        op: impl for<'t> FnOnce(&mut Tables<'t>) -> Result<T, CacheError> + Send + 'static,
    ) -> Result<T, CacheError> {
        if let Some(committer) = &self.inner.committer {
            // A group commit is always durable: one fsync for the whole group anyway.
            return committer.write(op);
        }
        let mut txn = self.inner.db.begin_write().map_err(storage)?;
        txn.set_durability(durability).map_err(storage)?;
        let result = op(&mut Tables::open(&txn)?);
        match result {
            Ok(value) => {
                txn.commit().map_err(storage)?;
                Ok(value)
            }
            Err(e) => {
                txn.abort().map_err(storage)?;
                Err(e)
            }
        }
    }
}

/// The cache's tables, open in one write transaction.
struct Tables<'t> {
    works: redb::Table<'t, &'static [u8], &'static [u8]>,
    manifests: redb::Table<'t, &'static [u8], &'static [u8]>,
    ledger: redb::Table<'t, &'static [u8], &'static [u8]>,
    status: redb::Table<'t, &'static [u8], &'static [u8]>,
    chunks: redb::Table<'t, &'static [u8], &'static [u8]>,
    fetches: redb::Table<'t, &'static [u8], &'static [u8]>,
    released: redb::Table<'t, &'static [u8], &'static [u8]>,
}

impl<'t> Tables<'t> {
    fn open(txn: &'t WriteTransaction) -> Result<Self, CacheError> {
        Ok(Tables {
            works: txn.open_table(WORKS.def()).map_err(storage)?,
            manifests: txn.open_table(MANIFESTS.def()).map_err(storage)?,
            ledger: txn.open_table(LEDGER.def()).map_err(storage)?,
            status: txn.open_table(STATUS.def()).map_err(storage)?,
            chunks: txn.open_table(CHUNKS.def()).map_err(storage)?,
            fetches: txn.open_table(FETCHES.def()).map_err(storage)?,
            released: txn.open_table(RELEASED.def()).map_err(storage)?,
        })
    }
}

/// One write handed to the committer: it runs in the group's transaction and says how the
/// writer is to be answered once the transaction is committed (or not).
type GroupJob = Box<dyn for<'t> FnOnce(&mut Tables<'t>) -> GroupDone + Send>;

/// What a [`GroupJob`] left for after the commit.
struct GroupDone {
    /// The write hit a storage error: the transaction must not commit.
    failed: Option<Arc<redb::Error>>,
    /// Answers the writer with its result, or the group's storage error.
    answer: Box<dyn FnOnce(Result<(), Arc<redb::Error>>) + Send>,
}

/// The thread that commits a [`CommitMode::Group`] database's writes: it takes every write
/// queued while the previous transaction was committing (at most [`MAX_GROUP`]) into one
/// transaction, commits it durably, then answers each writer.
struct GroupCommitter {
    /// Dropped first on drop, which ends the thread's loop.
    jobs: Option<mpsc::SyncSender<GroupJob>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl GroupCommitter {
    fn start(db: Arc<Database>, location: &str) -> Result<Self, CacheError> {
        let (jobs, queue) = mpsc::sync_channel::<GroupJob>(MAX_GROUP);
        let thread = std::thread::Builder::new()
            .name("cache-commit".to_owned())
            .spawn(move || {
                while let Ok(first) = queue.recv() {
                    let group: Vec<GroupJob> = std::iter::once(first)
                        .chain(queue.try_iter().take(MAX_GROUP - 1))
                        .collect();
                    commit_group(&db, group);
                }
            })
            .map_err(|e| {
                CacheError::Task(format!("cannot start the committer of {location}: {e}"))
            })?;
        Ok(Self {
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    fn write<T: Send + 'static>(
        &self,
        op: impl for<'t> FnOnce(&mut Tables<'t>) -> Result<T, CacheError> + Send + 'static,
    ) -> Result<T, CacheError> {
        let stopped = || CacheError::Task("the cache's group committer stopped".to_owned());
        let (reply, answer) = mpsc::sync_channel::<Result<T, CacheError>>(1);
        let job: GroupJob = Box::new(move |tables| {
            let result = op(tables);
            let failed = match &result {
                Err(CacheError::Storage(e)) => Some(Arc::clone(e)),
                _ => None,
            };
            GroupDone {
                failed,
                answer: Box::new(move |committed| {
                    let answer = match committed {
                        Ok(()) => result,
                        Err(e) => Err(result.err().unwrap_or(CacheError::Storage(e))),
                    };
                    // The writer waits for this; it is gone only if its thread was torn down.
                    let _ = reply.send(answer);
                }),
            }
        });
        self.jobs
            .as_ref()
            .ok_or_else(stopped)?
            .send(job)
            .map_err(|_| stopped())?;
        answer.recv().map_err(|_| stopped())?
    }
}

impl Drop for GroupCommitter {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            // It finishes the group in hand, then sees the queue closed.
            let _ = thread.join();
        }
    }
}

/// Runs a group's writes in one transaction and commits it durably; every writer gets the
/// outcome. A storage error in any write, or in the commit, fails the whole group (nothing of
/// it is committed).
fn commit_group(db: &Database, group: Vec<GroupJob>) {
    let mut answers = Vec::with_capacity(group.len());
    let outcome = (|| -> Result<(), Arc<redb::Error>> {
        let shared = |e: CacheError| match e {
            CacheError::Storage(e) => e,
            other => Arc::new(redb::Error::Corrupted(other.to_string())),
        };
        let txn = db.begin_write().map_err(|e| Arc::new(e.into()))?;
        let mut failed = None;
        {
            let mut tables = Tables::open(&txn).map_err(shared)?;
            for job in group {
                let done = job(&mut tables);
                failed = failed.or(done.failed);
                answers.push(done.answer);
            }
        }
        if let Some(e) = failed {
            let _ = txn.abort();
            return Err(e);
        }
        txn.commit().map_err(|e| Arc::new(e.into()))
    })();
    for answer in answers {
        answer(outcome.clone());
    }
}

/// Removes the cache directory an agent before redb left (sled's format, which this agent
/// cannot read), saying so. The agent then starts with an empty cache: the hub resends every
/// work on the first session, and statuses the hub had not acknowledged are computed again by
/// the reconciler. Returns whether there was one.
pub fn retire_sled_cache(dir: &Path) -> bool {
    // sled 0.34 keeps `conf` and `db` (and `snap.*`, `blobs/`) in its directory.
    let is_sled = dir.is_dir() && (dir.join("conf").is_file() || dir.join("db").is_file());
    if !is_sled {
        return false;
    }
    match std::fs::remove_dir_all(dir) {
        Ok(()) => warn!(
            path = %dir.display(),
            "removed the cache an earlier agent version kept in sled's format; starting with an \
             empty cache: the hub resends every work on the first session, and statuses it had \
             not acknowledged are computed again"
        ),
        Err(e) => warn!(
            path = %dir.display(),
            error = %e,
            "found the cache an earlier agent version kept in sled's format and could not remove \
             it (it is not read; delete it by hand); starting with an empty cache"
        ),
    }
    true
}

/// [`WorkCache`] for one cluster in a [`CacheDb`].
#[derive(Clone)]
pub struct ClusterCache {
    db: CacheDb,
    /// `cluster \0`: every key of this cluster starts with it.
    prefix: Vec<u8>,
}

impl fmt::Debug for ClusterCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterCache")
            .field(
                "cluster",
                &String::from_utf8_lossy(&self.prefix[..self.prefix.len() - 1]),
            )
            .field("db", &self.db)
            .finish()
    }
}

/// What both read-only and write tables can do.
trait Readable: ReadableTable<&'static [u8], &'static [u8]> {}
impl<T: ReadableTable<&'static [u8], &'static [u8]>> Readable for T {}

impl ClusterCache {
    /// Gives up the transfers whose keys `ended_by` picks, releasing what nothing else names.
    fn end_fetches_where(
        &self,
        ended_by: impl Fn(&[u8]) -> bool + Send + 'static,
    ) -> Result<u64, CacheError> {
        let prefix = self.prefix.clone();
        self.db.write(Durability::Immediate, move |t| {
            let mut ended = Vec::new();
            for entry in t
                .fetches
                .range::<&[u8]>(prefix.as_slice()..)
                .map_err(storage)?
            {
                let (key, _) = entry.map_err(storage)?;
                let key = key.value();
                if !key.starts_with(&prefix) {
                    break;
                }
                if ended_by(key) {
                    ended.push(key.to_vec());
                }
            }
            if ended.is_empty() {
                return Ok(0);
            }
            for key in &ended {
                t.fetches.remove(key.as_slice()).map_err(storage)?;
            }
            release_unnamed(t, &prefix)
        })
    }

    fn key(&self, uid: &str) -> Vec<u8> {
        let mut key = Vec::with_capacity(self.prefix.len() + uid.len());
        key.extend_from_slice(&self.prefix);
        key.extend_from_slice(uid.as_bytes());
        key
    }

    /// The uids this cluster has keys for in `table`, in order.
    fn uids_in(&self, table: Table) -> Result<Vec<String>, CacheError> {
        self.db.read(table, |t| {
            let mut out = Vec::new();
            for entry in t
                .range::<&[u8]>(self.prefix.as_slice()..)
                .map_err(storage)?
            {
                let (key, _) = entry.map_err(storage)?;
                let Some(uid) = key.value().strip_prefix(self.prefix.as_slice()) else {
                    break;
                };
                out.push(String::from_utf8_lossy(uid).into_owned());
            }
            Ok(out)
        })
    }

    fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        table: Table,
        uid: &str,
    ) -> Result<Option<T>, CacheError> {
        let key = self.key(uid);
        self.db.read(table, |t| get_json(t, table, &key, uid))
    }

    fn scan_json<T: serde::de::DeserializeOwned>(
        &self,
        table: Table,
    ) -> Result<Vec<(String, T)>, CacheError> {
        self.db.read(table, |t| {
            let mut out = Vec::new();
            for entry in t
                .range::<&[u8]>(self.prefix.as_slice()..)
                .map_err(storage)?
            {
                let (key, value) = entry.map_err(storage)?;
                let Some(uid) = key.value().strip_prefix(self.prefix.as_slice()) else {
                    break;
                };
                let uid = String::from_utf8_lossy(uid).into_owned();
                let record = decode(table.0, &uid, value.value())?;
                out.push((uid, record));
            }
            Ok(out)
        })
    }
}

fn get_json<T: serde::de::DeserializeOwned>(
    t: &impl Readable,
    table: Table,
    key: &[u8],
    uid: &str,
) -> Result<Option<T>, CacheError> {
    match t.get(key).map_err(storage)? {
        None => Ok(None),
        Some(bytes) => decode(table.0, uid, bytes.value()).map(Some),
    }
}

fn decode<T: serde::de::DeserializeOwned>(
    tree: &'static str,
    uid: &str,
    bytes: &[u8],
) -> Result<T, CacheError> {
    serde_json::from_slice(bytes).map_err(|source| CacheError::Corrupt {
        tree,
        uid: uid.to_owned(),
        source,
    })
}

fn encode<T: Serialize>(tree: &'static str, uid: &str, value: &T) -> Result<Vec<u8>, CacheError> {
    serde_json::to_vec(value).map_err(|source| CacheError::Encode {
        tree,
        uid: uid.to_owned(),
        source,
    })
}

impl WorkCache for ClusterCache {
    fn chunk(&self, sha256: &str) -> Result<Option<Vec<u8>>, CacheError> {
        let key = self.key(sha256);
        self.db.read(CHUNKS, |t| {
            Ok(t.get(key.as_slice())
                .map_err(storage)?
                .map(|v| v.value().to_vec()))
        })
    }

    fn put_chunk(&self, sha256: &str, data: &[u8]) -> Result<bool, CacheError> {
        let (key, data) = (self.key(sha256), data.to_vec());
        let (prefix, sha256) = (self.prefix.clone(), sha256.to_owned());
        self.db.write(Durability::Immediate, move |t| {
            if !named_chunks(t, &prefix)?.contains(&sha256) {
                return Ok(false);
            }
            t.chunks
                .insert(key.as_slice(), data.as_slice())
                .map_err(storage)?;
            Ok(true)
        })
    }

    fn begin_fetch(&self, uid: &str, chunks: &[String]) -> Result<Vec<String>, CacheError> {
        let key = self.key(uid);
        let record = encode(FETCHES.0, uid, &chunks)?;
        let (prefix, chunks) = (self.prefix.clone(), chunks.to_vec());
        self.db.write(Durability::Immediate, move |t| {
            let earlier = t
                .fetches
                .insert(key.as_slice(), record.as_slice())
                .map_err(storage)?
                .is_some();
            if earlier {
                release_unnamed(t, &prefix)?;
            }
            let mut missing = Vec::new();
            for sha in chunks {
                let mut chunk_key = prefix.clone();
                chunk_key.extend_from_slice(sha.as_bytes());
                if t.chunks
                    .get(chunk_key.as_slice())
                    .map_err(storage)?
                    .is_none()
                    && !missing.contains(&sha)
                {
                    missing.push(sha);
                }
            }
            Ok(missing)
        })
    }

    fn fetches(&self) -> Result<Vec<String>, CacheError> {
        self.uids_in(FETCHES)
    }

    fn end_fetch(&self, uid: &str) -> Result<u64, CacheError> {
        if !self.fetches()?.iter().any(|u| u == uid) {
            return Ok(0);
        }
        let key = self.key(uid);
        self.end_fetches_where(move |k| k == key.as_slice())
    }

    fn end_fetches(&self, keep: &[String]) -> Result<u64, CacheError> {
        // Read first: every session's sync asks, and almost never is there a transfer to end;
        // a write would cost a durable commit each time.
        if self.fetches()?.iter().all(|uid| keep.contains(uid)) {
            return Ok(0);
        }
        let keep: HashSet<Vec<u8>> = keep.iter().map(|uid| self.key(uid)).collect();
        self.end_fetches_where(move |k| !keep.contains(k))
    }

    fn chunk_totals(&self) -> Result<(u64, u64), CacheError> {
        self.db.read(CHUNKS, |t| {
            let (mut count, mut bytes) = (0, 0);
            for entry in t
                .range::<&[u8]>(self.prefix.as_slice()..)
                .map_err(storage)?
            {
                let (key, value) = entry.map_err(storage)?;
                if !key.value().starts_with(&self.prefix) {
                    break;
                }
                count += 1;
                bytes += value.value().len() as u64;
            }
            Ok((count, bytes))
        })
    }

    fn works(&self) -> Result<Vec<CachedWork>, CacheError> {
        Ok(self
            .scan_json::<CachedWork>(WORKS)?
            .into_iter()
            .map(|(_, w)| w)
            .collect())
    }

    fn work(&self, uid: &str) -> Result<Option<CachedWork>, CacheError> {
        self.get_json(WORKS, uid)
    }

    fn manifest_work(&self, uid: &str) -> Result<Option<Vec<u8>>, CacheError> {
        let key = self.key(uid);
        self.db.read(MANIFESTS, |t| {
            Ok(t.get(key.as_slice())
                .map_err(storage)?
                .map(|v| v.value().to_vec()))
        })
    }

    fn put_work(&self, work: &CachedWork, manifest_work: Option<&[u8]>) -> Result<(), CacheError> {
        let key = self.key(&work.uid);
        let record = encode(WORKS.0, &work.uid, work)?;
        let content = manifest_work.map(<[u8]>::to_vec);
        // One transaction, so that a crash never leaves a work with another generation's
        // content.
        let prefix = self.prefix.clone();
        self.db.write(Durability::Immediate, move |t| {
            t.works
                .insert(key.as_slice(), record.as_slice())
                .map_err(storage)?;
            let replaced = match &content {
                Some(content) => t.manifests.insert(key.as_slice(), content.as_slice()),
                None => t.manifests.remove(key.as_slice()),
            }
            .map_err(storage)?
            .is_some_and(|old| names_chunks(old.value()));
            // The transfer of this content, if it needed one, is done: the work names it now.
            let fetched = t.fetches.remove(key.as_slice()).map_err(storage)?.is_some();
            if replaced || fetched {
                release_unnamed(t, &prefix)?;
            }
            Ok(())
        })
    }

    fn mark_deleting(&self, uid: &str) -> Result<bool, CacheError> {
        let key = self.key(uid);
        let uid = uid.to_owned();
        self.db.write(Durability::Immediate, move |t| {
            let Some(mut work) = get_json::<CachedWork>(&t.works, WORKS, &key, &uid)? else {
                return Ok(false);
            };
            if !work.deleting {
                work.deleting = true;
                let record = encode(WORKS.0, &uid, &work)?;
                t.works
                    .insert(key.as_slice(), record.as_slice())
                    .map_err(storage)?;
            }
            Ok(true)
        })
    }

    fn forget(&self, uid: &str) -> Result<(), CacheError> {
        let key = self.key(uid);
        let prefix = self.prefix.clone();
        self.db
            .write(Durability::Immediate, move |t| forget_in(t, &key, &prefix))
    }

    fn release(&self, uid: &str) -> Result<(), CacheError> {
        let key = self.key(uid);
        let prefix = self.prefix.clone();
        // One transaction: a crash never leaves a work forgotten whose release is unrecorded
        // (its finalizer would hold it on the hub for good).
        self.db.write(Durability::Immediate, move |t| {
            forget_in(t, &key, &prefix)?;
            t.released
                .insert(key.as_slice(), [].as_slice())
                .map_err(storage)?;
            Ok(())
        })
    }

    fn pending_releases(&self) -> Result<Vec<String>, CacheError> {
        self.uids_in(RELEASED)
    }

    fn ack_release(&self, uid: &str) -> Result<(), CacheError> {
        let key = self.key(uid);
        // Not durable: an ack lost in a crash only re-sends a release the hub answers again.
        self.db.write(Durability::None, move |t| {
            t.released.remove(key.as_slice()).map_err(storage)?;
            Ok(())
        })
    }

    fn ledger(&self, uid: &str) -> Result<Vec<AppliedResource>, CacheError> {
        Ok(self.get_json(LEDGER, uid)?.unwrap_or_default())
    }

    fn ledgers(&self) -> Result<Vec<(String, Vec<AppliedResource>)>, CacheError> {
        self.scan_json(LEDGER)
    }

    fn set_ledger(&self, uid: &str, resources: &[AppliedResource]) -> Result<(), CacheError> {
        let key = self.key(uid);
        let record = if resources.is_empty() {
            None
        } else {
            Some(encode(LEDGER.0, uid, &resources)?)
        };
        self.db.write(Durability::Immediate, move |t| {
            match &record {
                Some(record) => t.ledger.insert(key.as_slice(), record.as_slice()),
                None => t.ledger.remove(key.as_slice()),
            }
            .map_err(storage)?;
            Ok(())
        })
    }

    fn last_status(&self, uid: &str) -> Result<Option<StatusRecord>, CacheError> {
        self.get_json(STATUS, uid)
    }

    fn push_status(
        &self,
        uid: &str,
        generation: i64,
        status: &serde_json::Value,
    ) -> Result<u64, CacheError> {
        let key = self.key(uid);
        let uid = uid.to_owned();
        let status = status.clone();
        // Read and write in one transaction: write transactions are serialized, so an ack
        // cannot land in between and the new seq is always the previous + 1.
        self.db.write(Durability::Immediate, move |t| {
            let (seq, acked_seq) = match get_json::<StatusRecord>(&t.status, STATUS, &key, &uid)? {
                Some(prev) => (prev.seq + 1, prev.acked_seq),
                // No record (a new work, or a cache lost with a rebuilt spoke): start at the wall
                // clock in microseconds, above what an earlier life reported, which the hub
                // keeps and refuses older reports than. A session's TLS keeps the clock right.
                None => (
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(1, |d| d.as_micros() as u64),
                    0,
                ),
            };
            let record = StatusRecord {
                generation,
                seq,
                acked_seq,
                status,
            };
            let bytes = encode(STATUS.0, &uid, &record)?;
            t.status
                .insert(key.as_slice(), bytes.as_slice())
                .map_err(storage)?;
            Ok(seq)
        })
    }

    fn pending_statuses(&self) -> Result<Vec<PendingStatus>, CacheError> {
        let mut out = Vec::new();
        for (uid, record) in self.scan_json::<StatusRecord>(STATUS)? {
            if record.is_pending() {
                let status_json = encode(STATUS.0, &uid, &record.status)?;
                out.push(PendingStatus {
                    uid,
                    generation: record.generation,
                    seq: record.seq,
                    status_json,
                });
            }
        }
        Ok(out)
    }

    fn ack_status(&self, uid: &str, seq: u64) -> Result<bool, CacheError> {
        let key = self.key(uid);
        let uid = uid.to_owned();
        // Not durable: an ack lost in a crash only re-sends a status the hub drops by its seq.
        self.db.write(Durability::None, move |t| {
            let Some(mut record) = get_json::<StatusRecord>(&t.status, STATUS, &key, &uid)? else {
                return Ok(false);
            };
            if seq <= record.acked_seq {
                return Ok(!record.is_pending());
            }
            // The hub may ack a seq above ours only if it saw a status from an earlier life of
            // this cache; never let the ack run past what we produced.
            record.acked_seq = seq.min(record.seq);
            let bytes = encode(STATUS.0, &uid, &record)?;
            t.status
                .insert(key.as_slice(), bytes.as_slice())
                .map_err(storage)?;
            Ok(!record.is_pending())
        })
    }
}

/// Whether stored ManifestWork JSON may name chunks (holds a `ChunkedManifests` reference): a
/// byte search, so works without one are never parsed when chunks are released.
fn names_chunks(manifest_work: &[u8]) -> bool {
    let needle = flotilla_proto::api::content::CONTENT_KIND.as_bytes();
    manifest_work.windows(needle.len()).any(|w| w == needle)
}

/// Every chunk digest one cluster's held works and transfers under way name. Records that do
/// not decode name nothing (such a work is refused anyway; such a transfer asks again).
fn named_chunks(t: &Tables<'_>, prefix: &[u8]) -> Result<HashSet<String>, CacheError> {
    let mut named = HashSet::new();
    for entry in t.fetches.range::<&[u8]>(prefix..).map_err(storage)? {
        let (key, value) = entry.map_err(storage)?;
        if !key.value().starts_with(prefix) {
            break;
        }
        if let Ok(chunks) = serde_json::from_slice::<Vec<String>>(value.value()) {
            named.extend(chunks);
        }
    }
    for entry in t.manifests.range::<&[u8]>(prefix..).map_err(storage)? {
        let (key, value) = entry.map_err(storage)?;
        if !key.value().starts_with(prefix) {
            break;
        }
        if !names_chunks(value.value()) {
            continue;
        }
        if let Ok(work) = serde_json::from_slice::<serde_json::Value>(value.value()) {
            named.extend(flotilla_proto::api::content::named_chunk_digests(&work));
        }
    }
    Ok(named)
}

/// Drops everything about the work under `key` (content, transfer, ledger, status) and the
/// chunks nothing held names any more, in the caller's transaction.
fn forget_in(t: &mut Tables<'_>, key: &[u8], prefix: &[u8]) -> Result<(), CacheError> {
    let named = t
        .manifests
        .remove(key)
        .map_err(storage)?
        .is_some_and(|old| names_chunks(old.value()));
    let fetched = t.fetches.remove(key).map_err(storage)?.is_some();
    for table in [&mut t.works, &mut t.ledger, &mut t.status] {
        table.remove(key).map_err(storage)?;
    }
    if named || fetched {
        release_unnamed(t, prefix)?;
    }
    Ok(())
}

/// Removes one cluster's chunks that no held work and no transfer under way names, in the
/// caller's transaction. Returns how many went.
fn release_unnamed(t: &mut Tables<'_>, prefix: &[u8]) -> Result<u64, CacheError> {
    let named = named_chunks(t, prefix)?;
    let mut unnamed = Vec::new();
    for entry in t.chunks.range::<&[u8]>(prefix..).map_err(storage)? {
        let (key, _) = entry.map_err(storage)?;
        let Some(sha) = key.value().strip_prefix(prefix) else {
            break;
        };
        if !named.contains(String::from_utf8_lossy(sha).as_ref()) {
            unnamed.push(key.value().to_vec());
        }
    }
    for key in &unnamed {
        t.chunks.remove(key.as_slice()).map_err(storage)?;
    }
    Ok(unnamed.len() as u64)
}

/// The ManifestWork to apply from what the cache holds for it: as stored, or, for a large work,
/// with its `ChunkedManifests` reference replaced by the manifests joined from the chunks, every
/// digest checked first.
pub fn joined_manifest_work(
    cache: &dyn WorkCache,
    stored: &[u8],
) -> Result<Result<flotilla_proto::api::ManifestWork, String>, CacheError> {
    use flotilla_proto::api::content::{ContentError, ContentRef};
    let mut work = match serde_json::from_slice::<flotilla_proto::api::ManifestWork>(stored) {
        Ok(work) => work,
        Err(e) => return Ok(Err(format!("the work is not a valid ManifestWork: {e}"))),
    };
    let reference = match ContentRef::of(&work) {
        None => return Ok(Ok(work)),
        Some(Err(e)) => return Ok(Err(e.to_string())),
        Some(Ok(reference)) => reference,
    };
    let mut failed = None;
    let joined = reference.assemble(|_, sha| match cache.chunk(sha) {
        Ok(data) => data,
        Err(e) => {
            failed = Some(e);
            None
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    match joined {
        Ok(manifests) => {
            work.spec.workload.manifests = manifests;
            Ok(Ok(work))
        }
        Err(e @ ContentError::MissingChunk { .. }) => Ok(Err(format!(
            "{e}: the content of {} bytes is not all held yet; the hub resends it on the next session",
            reference.bytes
        ))),
        Err(e) => Ok(Err(format!(
            "content sha256 {} cannot be used: {e}",
            reference.sha256
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chunks_survive_a_reopen_and_a_resume_asks_only_for_the_rest() {
        use flotilla_proto::api::Manifest;
        use flotilla_proto::api::content::split;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache.redb");
        let manifests: Vec<Manifest> = (0..6)
            .map(|i| {
                Manifest(json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": format!("cm-{i}")}, "data": {"x": "y".repeat(300 * 1024)}}))
            })
            .collect();
        let (reference, chunks) = split(&manifests);
        {
            let cache = CacheDb::open(&path).unwrap().cluster("c1");
            assert_eq!(
                cache.begin_fetch("a", &reference.chunks).unwrap(),
                reference.chunks
            );
            for chunk in &chunks[..2] {
                assert!(cache.put_chunk(&chunk.sha256, &chunk.data).unwrap());
            }
        }
        // As after a kill half-way: reopened, only what was not stored is missing, and the
        // transfer is still recorded, so its chunks are kept.
        let cache = CacheDb::open(&path).unwrap().cluster("c1");
        assert_eq!(cache.fetches().unwrap(), ["a"]);
        assert_eq!(
            cache.begin_fetch("a", &reference.chunks).unwrap(),
            reference.chunks[2..].to_vec()
        );
        for chunk in &chunks[2..] {
            assert!(cache.put_chunk(&chunk.sha256, &chunk.data).unwrap());
        }
        assert!(cache.missing_chunks(&reference.chunks).unwrap().is_empty());
        // Two works naming the same content: stored once.
        let stored: Vec<u8> = serde_json::to_vec(&json!({
            "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
            "metadata": {"name": "big", "namespace": "c1"},
            "spec": {"workload": {"manifests": [reference.manifest().0]}},
        }))
        .unwrap();
        cache.put_work(&work("a", 1), Some(&stored)).unwrap();
        cache.put_work(&work("b", 1), Some(&stored)).unwrap();
        assert_eq!(
            cache.chunk_totals().unwrap(),
            (chunks.len() as u64, reference.bytes)
        );
        let joined = joined_manifest_work(&cache, &stored).unwrap().unwrap();
        assert_eq!(joined.spec.workload.manifests, manifests);
    }

    /// A work naming content, as the hub sends it.
    fn large(
        uid: &str,
        reference: &flotilla_proto::api::content::ContentRef,
    ) -> (CachedWork, Vec<u8>) {
        let stored = serde_json::to_vec(&json!({
            "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
            "metadata": {"name": uid, "namespace": "c1", "uid": uid},
            "spec": {"workload": {"manifests": [reference.manifest().0]}},
        }))
        .unwrap();
        (work(uid, 1), stored)
    }

    #[test]
    fn chunks_no_held_work_or_transfer_names_are_released_durably() {
        use flotilla_proto::api::Manifest;
        use flotilla_proto::api::content::split;
        let content = |tag: &str| {
            split(&[Manifest(json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": tag}, "data": {"x": tag.repeat(700 * 1024 / tag.len())}}))])
        };
        let ((x, x_chunks), (y, y_chunks), (z, z_chunks)) =
            (content("x"), content("yy"), content("zzz"));
        let fetch_all = |cache: &ClusterCache,
                         uid: &str,
                         r: &flotilla_proto::api::content::ContentRef,
                         chunks: &[flotilla_proto::api::content::Chunk]| {
            cache.begin_fetch(uid, &r.chunks).unwrap();
            for c in chunks {
                cache.put_chunk(&c.sha256, &c.data).unwrap();
            }
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache.redb");
        {
            let db = CacheDb::open(&path).unwrap();
            let (cache, neighbour) = (db.cluster("c1"), db.cluster("c2"));
            // Another cluster in the same database holds the same content: never touched.
            fetch_all(&neighbour, "n", &x, &x_chunks);
            let (w, stored) = large("n", &x);
            neighbour.put_work(&w, Some(&stored)).unwrap();

            // Nothing names y yet: a chunk of it is not kept.
            assert!(
                !cache
                    .put_chunk(&y_chunks[0].sha256, &y_chunks[0].data)
                    .unwrap()
            );
            assert_eq!(cache.chunk_totals().unwrap(), (0, 0));
            // Works a and b hold content x, stored once.
            fetch_all(&cache, "a", &x, &x_chunks);
            for uid in ["a", "b"] {
                let (w, stored) = large(uid, &x);
                cache.put_work(&w, Some(&stored)).unwrap();
            }
            assert!(
                cache.fetches().unwrap().is_empty(),
                "stored works end their transfers"
            );
            assert_eq!(cache.chunk_totals().unwrap(), (2, x.bytes));
            // a forgotten: b still names x.
            cache.forget("a").unwrap();
            assert_eq!(cache.chunk_totals().unwrap(), (2, x.bytes));
            // b's content replaced by y: x goes once b is stored with y.
            fetch_all(&cache, "b", &y, &y_chunks);
            assert_eq!(cache.chunk_totals().unwrap(), (4, x.bytes + y.bytes));
            let (w, stored) = large("b", &y);
            cache.put_work(&w, Some(&stored)).unwrap();
            assert_eq!(cache.chunk_totals().unwrap(), (2, y.bytes));
            // A transfer cut off half-way, then replaced by another content: the first's part goes.
            cache.begin_fetch("c", &z.chunks).unwrap();
            assert!(
                cache
                    .put_chunk(&z_chunks[0].sha256, &z_chunks[0].data)
                    .unwrap()
            );
            cache.begin_fetch("c", &x.chunks).unwrap();
            assert_eq!(cache.chunk_totals().unwrap(), (2, y.bytes));
            assert!(
                cache
                    .put_chunk(&x_chunks[0].sha256, &x_chunks[0].data)
                    .unwrap()
            );
            // The hub's sync no longer sends c: its transfer is given up.
            assert_eq!(cache.end_fetches(&["b".to_string()]).unwrap(), 1);
            // A chunk of it still on the way is dropped.
            assert!(
                !cache
                    .put_chunk(&x_chunks[1].sha256, &x_chunks[1].data)
                    .unwrap()
            );
            assert_eq!(cache.chunk_totals().unwrap(), (2, y.bytes));
            // A transfer for a work deleted on the hub before it was stored.
            fetch_all(&cache, "d", &z, &z_chunks[..1]);
            assert_eq!(cache.end_fetch("d").unwrap(), 1);
            // b deleted on the hub and removed from the spoke: released, and y with it.
            cache.release("b").unwrap();
            assert_eq!(cache.pending_releases().unwrap(), ["b"]);
        }
        // Reopened: the releases were durable, and the neighbour kept its chunks.
        let db = CacheDb::open(&path).unwrap();
        assert_eq!(db.cluster("c1").chunk_totals().unwrap(), (0, 0));
        assert_eq!(db.cluster("c2").chunk_totals().unwrap(), (2, x.bytes));
    }

    #[test]
    fn a_work_whose_content_is_not_all_held_is_not_applied_and_says_why() {
        use flotilla_proto::api::Manifest;
        use flotilla_proto::api::content::split;
        let cache = CacheDb::temporary().unwrap().cluster("c1");
        let manifests = vec![Manifest(json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "cm"}, "data": {"x": "y".repeat(600 * 1024)}}))];
        let (reference, chunks) = split(&manifests);
        cache.begin_fetch("big", &reference.chunks).unwrap();
        assert!(cache.put_chunk(&chunks[0].sha256, &chunks[0].data).unwrap());
        let stored = serde_json::to_vec(&json!({
            "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
            "metadata": {"name": "big", "namespace": "c1"},
            "spec": {"workload": {"manifests": [reference.manifest().0]}},
        }))
        .unwrap();
        let why = joined_manifest_work(&cache, &stored).unwrap().unwrap_err();
        assert!(
            why.contains("chunk #1") && why.contains("not all held"),
            "{why}"
        );
    }

    fn work(uid: &str, generation: i64) -> CachedWork {
        CachedWork {
            uid: uid.into(),
            namespace: "store-7".into(),
            name: format!("work-{uid}"),
            generation,
            content_hash: format!("hash-{generation}"),
            refused: None,
            deleting: false,
        }
    }

    fn deployment(name: &str) -> AppliedResource {
        AppliedResource {
            group: "apps".into(),
            version: "v1".into(),
            kind: "Deployment".into(),
            resource: "deployments".into(),
            namespace: "default".into(),
            name: name.into(),
        }
    }

    #[test]
    fn works_round_trip_with_content_and_show_in_the_hello() {
        let db = CacheDb::temporary().unwrap();
        let cache = db.cluster("store-7");
        cache
            .put_work(&work("a", 1), Some(br#"{"kind":"ManifestWork"}"#))
            .unwrap();
        let mut refused = work("b", 4);
        refused.refused = Some("too big".into());
        cache.put_work(&refused, None).unwrap();

        assert_eq!(cache.work("a").unwrap(), Some(work("a", 1)));
        assert_eq!(
            cache.manifest_work("a").unwrap().unwrap(),
            br#"{"kind":"ManifestWork"}"#
        );
        assert_eq!(cache.manifest_work("b").unwrap(), None);
        assert_eq!(cache.works().unwrap().len(), 2);
        let held = cache.held().unwrap();
        assert_eq!(held.len(), 2);
        assert_eq!((held[1].uid.as_str(), held[1].generation), ("b", 4));

        // A newer generation replaces the old one, content included.
        cache.put_work(&work("a", 2), Some(b"{}")).unwrap();
        assert_eq!(cache.work("a").unwrap().unwrap().generation, 2);
        assert_eq!(cache.manifest_work("a").unwrap().unwrap(), b"{}");
    }

    #[test]
    fn tombstones_leave_the_hello_and_forget_drops_everything() {
        let db = CacheDb::temporary().unwrap();
        let cache = db.cluster("c");
        cache.put_work(&work("a", 1), Some(b"{}")).unwrap();
        cache.set_ledger("a", &[deployment("web")]).unwrap();
        cache.push_status("a", 1, &json!({"x": 1})).unwrap();

        assert!(cache.mark_deleting("a").unwrap());
        assert!(!cache.mark_deleting("nope").unwrap());
        assert!(cache.work("a").unwrap().unwrap().deleting);
        assert!(cache.held().unwrap().is_empty(), "a tombstone is not held");
        assert_eq!(
            cache.ledger("a").unwrap(),
            vec![deployment("web")],
            "ledger kept for cleanup"
        );

        cache.forget("a").unwrap();
        assert_eq!(cache.work("a").unwrap(), None);
        assert_eq!(cache.manifest_work("a").unwrap(), None);
        assert!(cache.ledger("a").unwrap().is_empty());
        assert_eq!(cache.last_status("a").unwrap(), None);
        assert!(cache.pending_statuses().unwrap().is_empty());
    }

    #[test]
    fn a_release_forgets_the_work_and_stays_in_the_outbox_across_a_restart_until_acked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache.redb");
        {
            let db = CacheDb::open(&path).unwrap();
            let cache = db.cluster("c");
            cache.put_work(&work("a", 1), Some(b"{}")).unwrap();
            cache.put_work(&work("b", 1), Some(b"{}")).unwrap();
            cache.set_ledger("a", &[deployment("web")]).unwrap();
            cache.push_status("a", 1, &json!({"x": 1})).unwrap();
            cache.mark_deleting("a").unwrap();
            cache.mark_deleting("b").unwrap();
            assert_eq!(
                cache.releasing().unwrap(),
                ["a", "b"],
                "tombstones are releasing"
            );

            cache.release("a").unwrap();
            assert_eq!(cache.work("a").unwrap(), None);
            assert!(cache.ledger("a").unwrap().is_empty());
            assert!(cache.pending_statuses().unwrap().is_empty());
            // A delete for a work never held is released too: the hub must still hear it.
            cache.release("never-held").unwrap();
            assert_eq!(cache.pending_releases().unwrap(), ["a", "never-held"]);
            // The other cluster of the same database sees none of it.
            assert!(db.cluster("d").pending_releases().unwrap().is_empty());
        }
        let db = CacheDb::open(&path).unwrap();
        let cache = db.cluster("c");
        assert_eq!(cache.releasing().unwrap(), ["b", "a", "never-held"]);
        cache.ack_release("a").unwrap();
        cache.ack_release("never-held").unwrap();
        assert!(cache.pending_releases().unwrap().is_empty());
        assert_eq!(cache.releasing().unwrap(), ["b"]);
    }

    #[test]
    fn everything_survives_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent").join("cache.redb");
        let reopen = || CacheDb::open(&path).expect("reopening the cache");
        let first;
        {
            let db = CacheDb::open(&path).unwrap();
            let cache = db.cluster("store-7");
            cache.put_work(&work("a", 3), Some(b"{}")).unwrap();
            cache.set_ledger("a", &[deployment("web")]).unwrap();
            first = cache.push_status("a", 3, &json!({"n": 1})).unwrap();
            assert_eq!(
                cache.push_status("a", 3, &json!({"n": 2})).unwrap(),
                first + 1
            );
        }
        let db = reopen();
        let cache = db.cluster("store-7");
        assert_eq!(cache.work("a").unwrap(), Some(work("a", 3)));
        assert_eq!(cache.ledger("a").unwrap(), vec![deployment("web")]);
        let pending = cache.pending_statuses().unwrap();
        assert_eq!(pending.len(), 1);
        assert_eq!((pending[0].seq, pending[0].generation), (first + 1, 3));
        assert_eq!(pending[0].status_json, br#"{"n":2}"#);
        // The seq keeps counting from where it was, even after the hub acked everything.
        assert!(cache.ack_status("a", first + 1).unwrap());
        drop(cache);
        drop(db);
        let db = reopen();
        let cache = db.cluster("store-7");
        assert!(cache.pending_statuses().unwrap().is_empty());
        assert_eq!(
            cache.push_status("a", 4, &json!({"n": 3})).unwrap(),
            first + 2
        );
    }

    #[test]
    fn a_second_opener_of_the_same_file_is_refused_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache.redb");
        let _first = CacheDb::open(&path).unwrap();
        let err = CacheDb::open(&path).unwrap_err();
        let message = err.to_string();
        assert!(
            message.contains("cache.redb") && message.contains("--data-dir"),
            "{message}"
        );
    }

    #[test]
    fn a_file_that_is_not_a_cache_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache.redb");
        std::fs::write(&path, b"not a database, but someone's data").unwrap();
        let err = CacheDb::open(&path).unwrap_err();
        assert!(matches!(err, CacheError::Open { .. }), "{err}");
        assert_eq!(
            std::fs::read(&path).unwrap(),
            b"not a database, but someone's data"
        );
    }

    #[test]
    fn group_commits_answer_every_writer_with_its_own_result_durably() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache.redb");
        const CLUSTERS: usize = 16;
        const STATUSES: u64 = 20;
        // Each cluster's first seq, as its writer was answered.
        let firsts: Vec<u64> = {
            let db = CacheDb::open_with(&path, CommitMode::Group).unwrap();
            std::thread::scope(|s| {
                let writers: Vec<_> = (0..CLUSTERS)
                    .map(|c| {
                        let cache = db.cluster(&format!("store-{c}"));
                        s.spawn(move || {
                            cache.put_work(&work("a", 1), Some(b"{}")).unwrap();
                            let first = cache.push_status("a", 1, &json!({ "n": 1 })).unwrap();
                            for n in 2..=STATUSES {
                                // Seqs count per work even with other clusters' writes in the
                                // same transactions.
                                assert_eq!(
                                    cache.push_status("a", 1, &json!({ "n": n })).unwrap(),
                                    first + n - 1
                                );
                            }
                            assert!(!cache.ack_status("a", first + STATUSES - 2).unwrap());
                            assert!(!cache.mark_deleting("missing").unwrap());
                            first
                        })
                    })
                    .collect();
                writers.into_iter().map(|w| w.join().unwrap()).collect()
            })
        };
        let db = CacheDb::open(&path).unwrap();
        for (c, first) in firsts.into_iter().enumerate() {
            let cache = db.cluster(&format!("store-{c}"));
            assert_eq!(cache.work("a").unwrap(), Some(work("a", 1)));
            let pending = cache.pending_statuses().unwrap();
            assert_eq!(pending.len(), 1, "store-{c}: {pending:?}");
            assert_eq!(pending[0].seq, first + STATUSES - 1);
            assert!(
                first > 1_600_000_000_000_000,
                "the first seq is the wall clock in microseconds: {first}"
            );
            assert_eq!(
                pending[0].status_json,
                format!(r#"{{"n":{STATUSES}}}"#).as_bytes()
            );
        }
    }

    #[test]
    fn a_group_write_that_fails_to_decode_leaves_the_others_committed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache.redb");
        let db = CacheDb::open_with(&path, CommitMode::Group).unwrap();
        let cache = db.cluster("c");
        // A damaged status record: its work's writes fail, naming it; the rest go on.
        let key = cache.key("bad");
        db.write(Durability::Immediate, move |t| {
            t.status
                .insert(key.as_slice(), b"{not json".as_slice())
                .map_err(storage)?;
            Ok(())
        })
        .unwrap();
        let err = cache.push_status("bad", 1, &json!({})).unwrap_err();
        assert!(err.to_string().contains("status/bad"), "{err}");
        let good = cache.push_status("good", 1, &json!({})).unwrap();
        assert_eq!(cache.last_status("good").unwrap().unwrap().seq, good);
        cache.put_work(&work("a", 1), None).unwrap();
        assert_eq!(cache.work("a").unwrap(), Some(work("a", 1)));
    }

    #[test]
    fn an_old_sled_cache_is_removed_and_anything_else_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        // What sled 0.34 leaves in its directory.
        let sled = dir.path().join("cache");
        std::fs::create_dir_all(sled.join("blobs")).unwrap();
        for file in ["conf", "db", "snap.0000000000001A2B"] {
            std::fs::write(sled.join(file), b"sled").unwrap();
        }
        assert!(retire_sled_cache(&sled));
        assert!(!sled.exists());
        assert!(!retire_sled_cache(&sled), "nothing left to retire");

        let other = dir.path().join("identity");
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(other.join("tls.key"), b"key").unwrap();
        assert!(!retire_sled_cache(&other));
        assert!(other.join("tls.key").exists());
    }

    #[test]
    fn clusters_in_one_database_are_isolated() {
        let db = CacheDb::temporary().unwrap();
        // "store-1" is a byte prefix of "store-10": the NUL separator keeps them apart.
        let one = db.cluster("store-1");
        let ten = db.cluster("store-10");
        one.put_work(&work("a", 1), Some(b"{}")).unwrap();
        ten.put_work(&work("b", 1), Some(b"{}")).unwrap();
        one.set_ledger("a", &[deployment("one")]).unwrap();
        one.push_status("a", 1, &json!({})).unwrap();

        assert_eq!(one.works().unwrap(), vec![work("a", 1)]);
        assert_eq!(ten.works().unwrap(), vec![work("b", 1)]);
        assert_eq!(ten.work("a").unwrap(), None);
        assert!(ten.ledgers().unwrap().is_empty());
        assert!(ten.pending_statuses().unwrap().is_empty());
        ten.forget("a").unwrap();
        assert_eq!(one.work("a").unwrap(), Some(work("a", 1)));
    }

    #[test]
    fn the_outbox_keeps_the_latest_status_per_work_with_increasing_seq() {
        let db = CacheDb::temporary().unwrap();
        let cache = db.cluster("c");
        let a1 = cache.push_status("a", 1, &json!({"v": 1})).unwrap();
        assert_eq!(cache.push_status("a", 2, &json!({"v": 2})).unwrap(), a1 + 1);
        let b1 = cache.push_status("b", 1, &json!({"v": 9})).unwrap();
        assert!(
            b1 >= a1,
            "a new work starts at the clock, never below an older one"
        );
        let pending = cache.pending_statuses().unwrap();
        assert_eq!(pending.len(), 2, "coalesced per work: {pending:?}");
        let a = pending.iter().find(|p| p.uid == "a").unwrap();
        assert_eq!((a.generation, a.seq), (2, a1 + 1));
        assert_eq!(a.status_json, br#"{"v":2}"#);
    }

    #[test]
    fn an_ack_for_an_older_seq_keeps_the_newer_status_pending() {
        let db = CacheDb::temporary().unwrap();
        let cache = db.cluster("c");
        let first = cache.push_status("a", 1, &json!({"v": 1})).unwrap();
        cache.push_status("a", 1, &json!({"v": 2})).unwrap();
        assert!(!cache.ack_status("a", first).unwrap());
        assert_eq!(cache.pending_statuses().unwrap()[0].seq, first + 1);
        assert!(cache.ack_status("a", first + 1).unwrap());
        assert!(cache.pending_statuses().unwrap().is_empty());
        // A late duplicate ack changes nothing; an unknown work is not an error.
        assert!(cache.ack_status("a", first).unwrap());
        assert!(!cache.ack_status("zzz", 1).unwrap());
        // The last status stays for comparison after the ack.
        assert_eq!(
            cache.last_status("a").unwrap().unwrap().status,
            json!({"v": 2})
        );
    }

    #[test]
    fn an_ack_past_our_seq_does_not_hide_later_statuses() {
        let db = CacheDb::temporary().unwrap();
        let cache = db.cluster("c");
        let first = cache.push_status("a", 1, &json!({})).unwrap();
        assert!(cache.ack_status("a", first + 6).unwrap());
        assert_eq!(
            cache.push_status("a", 1, &json!({"v": 2})).unwrap(),
            first + 1
        );
        assert_eq!(cache.pending_statuses().unwrap().len(), 1);
    }

    #[test]
    fn ledgers_list_every_work_of_the_cluster() {
        let db = CacheDb::temporary().unwrap();
        let cache = db.cluster("c");
        cache.set_ledger("a", &[deployment("x")]).unwrap();
        cache.set_ledger("b", &[deployment("y")]).unwrap();
        cache.set_ledger("b", &[]).unwrap();
        assert_eq!(
            cache.ledgers().unwrap(),
            vec![("a".to_string(), vec![deployment("x")])]
        );
        assert_eq!(deployment("x").to_string(), "apps/v1 Deployment default/x");
    }
}
