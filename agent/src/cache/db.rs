//! The redb database behind the cache: its tables, each holding every cluster's records under
//! the cluster's key prefix, one ACID transaction per write (durable on return where the
//! protocol relies on it), and [`ClusterCache`], one cluster's records, implementing
//! [`WorkCache`].

use std::collections::HashSet;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use redb::backends::InMemoryBackend;
use redb::{Database, Durability, ReadOnlyTable, ReadableDatabase as _, ReadableTable};
use serde::Serialize;
use tracing::warn;

use super::chunks::{named_chunks, names_chunks, release_unnamed};
use super::group::GroupCommitter;
use super::records::{AppliedResource, CachedWork, PendingStatus, StatusRecord};
use super::tables::{CHUNKS, FETCHES, LEDGER, MANIFESTS, RELEASED, STATUS, Table, Tables, WORKS};
use super::work_cache::{CacheError, WorkCache, storage};

/// redb's page cache. Its default (1 GiB) is sized for a server; an agent on a small edge node
/// holds a few MiB of works, and a load-test database is opened once for all its agents.
const PAGE_CACHE_BYTES: usize = 64 * 1024 * 1024;

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

/// Creates a new cache file whole or not at all: under a temporary name, then renamed into
/// place once redb has written its header. An agent killed while creating it (its first
/// start) left a file without that header, which no later start could open ("Not a redb
/// database"); now it leaves only the temporary file, which the next start replaces. Nothing
/// is lost with it: no work was acked before the cache existed.
fn create_whole(path: &Path) -> Result<(), std::io::Error> {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".creating");
    let creating = path.with_file_name(name);
    match std::fs::remove_file(&creating) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    drop(
        redb::Builder::new()
            .create(&creating)
            .map_err(std::io::Error::other)?,
    );
    std::fs::File::open(&creating)?.sync_all()?;
    std::fs::rename(&creating, path)
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
        if created {
            create_whole(path).map_err(|e| fail(e.into()))?;
        }
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
    pub(super) fn read<T>(
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
    pub(super) fn write<T: Send + 'static>(
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
    pub(super) db: CacheDb,
    /// `cluster \0`: every key of this cluster starts with it.
    pub(super) prefix: Vec<u8>,
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

    /// Removes every record of this cluster (works, contents, chunks, transfers, ledgers,
    /// statuses, releases) in one durable transaction: what an agent leaving a hub keeps of it
    /// is nothing. Other clusters' records are untouched.
    pub fn clear(&self) -> Result<(), CacheError> {
        let prefix = self.prefix.clone();
        self.db.write(Durability::Immediate, move |t| {
            for table in [
                &mut t.works,
                &mut t.manifests,
                &mut t.ledger,
                &mut t.status,
                &mut t.chunks,
                &mut t.fetches,
                &mut t.released,
            ] {
                let mut keys = Vec::new();
                for entry in table.range::<&[u8]>(prefix.as_slice()..).map_err(storage)? {
                    let (key, _) = entry.map_err(storage)?;
                    if !key.value().starts_with(&prefix) {
                        break;
                    }
                    keys.push(key.value().to_vec());
                }
                for key in keys {
                    table.remove(key.as_slice()).map_err(storage)?;
                }
            }
            Ok(())
        })
    }

    pub(super) fn key(&self, uid: &str) -> Vec<u8> {
        let mut key = Vec::with_capacity(self.prefix.len() + uid.len());
        key.extend_from_slice(&self.prefix);
        key.extend_from_slice(uid.as_bytes());
        key
    }

    /// The uids this cluster has keys for in `table`, in order.
    pub(super) fn uids_in(&self, table: Table) -> Result<Vec<String>, CacheError> {
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
        self.scan(table, |uid, bytes| {
            Ok(Some((uid.to_owned(), decode(table.0, uid, bytes)?)))
        })
    }

    /// What `f` makes of each of this cluster's records in `table` (uid and stored bytes), in
    /// uid order, skipping those it answers `None` for; one read transaction.
    fn scan<T>(
        &self,
        table: Table,
        mut f: impl FnMut(&str, &[u8]) -> Result<Option<T>, CacheError>,
    ) -> Result<Vec<T>, CacheError> {
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
                out.extend(f(&String::from_utf8_lossy(uid), value.value())?);
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
        // One transaction, so that a crash never leaves a work with another generation's
        // content.
        let put = self.work_put(work, manifest_work)?;
        let prefix = self.prefix.clone();
        self.db
            .write(Durability::Immediate, move |t| put.run(t, &prefix))
    }

    fn put_works(&self, works: &[(CachedWork, Option<Vec<u8>>)]) -> Result<(), CacheError> {
        let puts = works
            .iter()
            .map(|(work, content)| self.work_put(work, content.as_deref()))
            .collect::<Result<Vec<_>, _>>()?;
        let prefix = self.prefix.clone();
        self.db.write(Durability::Immediate, move |t| {
            puts.iter().try_for_each(|put| put.run(t, &prefix))
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
        let (key, uid, status) = (self.key(uid), uid.to_owned(), status.clone());
        // Read and write in one transaction: write transactions are serialized, so an ack
        // cannot land in between and the new seq is always the previous + 1.
        self.db.write(Durability::Immediate, move |t| {
            push_one(t, &key, &uid, generation, status)
        })
    }

    fn push_statuses(
        &self,
        statuses: Vec<(String, i64, serde_json::Value)>,
    ) -> Result<Vec<u64>, CacheError> {
        let keyed: Vec<_> = statuses
            .into_iter()
            .map(|(uid, generation, status)| (self.key(&uid), uid, generation, status))
            .collect();
        self.db.write(Durability::Immediate, move |t| {
            keyed
                .into_iter()
                .map(|(key, uid, generation, status)| push_one(t, &key, &uid, generation, status))
                .collect()
        })
    }

    fn pending_statuses(&self) -> Result<Vec<PendingStatus>, CacheError> {
        /// A record's seqs only: the status itself is skipped, not parsed, for the records the
        /// hub has acknowledged (most of them, read on every wake of the outbox).
        #[derive(serde::Deserialize)]
        struct Seqs {
            seq: u64,
            acked_seq: u64,
        }
        self.scan(STATUS, |uid, bytes| {
            let seqs: Seqs = decode(STATUS.0, uid, bytes)?;
            if seqs.acked_seq >= seqs.seq {
                return Ok(None);
            }
            let record: StatusRecord = decode(STATUS.0, uid, bytes)?;
            Ok(Some(PendingStatus {
                uid: uid.to_owned(),
                generation: record.generation,
                seq: record.seq,
                status_json: encode(STATUS.0, uid, &record.status)?,
            }))
        })
    }

    fn ack_status(&self, uid: &str, seq: u64) -> Result<bool, CacheError> {
        let (key, uid) = (self.key(uid), uid.to_owned());
        // Not durable: an ack lost in a crash only re-sends a status the hub drops by its seq.
        self.db
            .write(Durability::None, move |t| ack_one(t, &key, &uid, seq))
    }

    fn ack_statuses(&self, acks: &[(String, u64)]) -> Result<Vec<bool>, CacheError> {
        let keyed: Vec<_> = acks
            .iter()
            .map(|(uid, seq)| (self.key(uid), uid.clone(), *seq))
            .collect();
        self.db.write(Durability::None, move |t| {
            keyed
                .iter()
                .map(|(key, uid, seq)| ack_one(t, key, uid, *seq))
                .collect()
        })
    }
}

/// One work's record and content to store, encoded before the write transaction.
struct WorkPut {
    key: Vec<u8>,
    record: Vec<u8>,
    content: Option<Vec<u8>>,
}

impl ClusterCache {
    fn work_put(
        &self,
        work: &CachedWork,
        manifest_work: Option<&[u8]>,
    ) -> Result<WorkPut, CacheError> {
        Ok(WorkPut {
            key: self.key(&work.uid),
            record: encode(WORKS.0, &work.uid, work)?,
            content: manifest_work.map(<[u8]>::to_vec),
        })
    }
}

impl WorkPut {
    /// Stores the work and its content, ends its transfer, and releases the chunks only the
    /// replaced content or the transfer named (of the cluster `prefix`).
    fn run(&self, t: &mut Tables<'_>, prefix: &[u8]) -> Result<(), CacheError> {
        let key = self.key.as_slice();
        t.works
            .insert(key, self.record.as_slice())
            .map_err(storage)?;
        let replaced = match &self.content {
            Some(content) => t.manifests.insert(key, content.as_slice()),
            None => t.manifests.remove(key),
        }
        .map_err(storage)?
        .is_some_and(|old| names_chunks(old.value()));
        // The transfer of this content, if it needed one, is done: the work names it now.
        let fetched = t.fetches.remove(key).map_err(storage)?.is_some();
        if replaced || fetched {
            release_unnamed(t, prefix)?;
        }
        Ok(())
    }
}

/// Records a new status for `uid` under the next seq, in the write transaction `t`.
fn push_one(
    t: &mut Tables<'_>,
    key: &[u8],
    uid: &str,
    generation: i64,
    status: serde_json::Value,
) -> Result<u64, CacheError> {
    let (seq, acked_seq) = match get_json::<StatusRecord>(&t.status, STATUS, key, uid)? {
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
    let bytes = encode(STATUS.0, uid, &record)?;
    t.status.insert(key, bytes.as_slice()).map_err(storage)?;
    Ok(seq)
}

/// Records the hub's ack of `uid`'s status up to `seq`, in the write transaction `t`; whether
/// nothing of it is pending now.
fn ack_one(t: &mut Tables<'_>, key: &[u8], uid: &str, seq: u64) -> Result<bool, CacheError> {
    let Some(mut record) = get_json::<StatusRecord>(&t.status, STATUS, key, uid)? else {
        return Ok(false);
    };
    if seq <= record.acked_seq {
        return Ok(!record.is_pending());
    }
    // The hub may ack a seq above ours only if it saw a status from an earlier life of
    // this cache; never let the ack run past what we produced.
    record.acked_seq = seq.min(record.seq);
    let bytes = encode(STATUS.0, uid, &record)?;
    t.status.insert(key, bytes.as_slice()).map_err(storage)?;
    Ok(!record.is_pending())
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
#[cfg(test)]
mod tests;
