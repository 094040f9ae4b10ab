//! The cache as the agent sees it: the [`WorkCache`] trait (synchronous, object-safe, writes
//! durable on return where the protocol relies on it), its errors, and [`durably`] for callers
//! on the runtime.

use std::fmt;
use std::sync::Arc;

use flotilla_proto::wire::HeldWork;

use super::records::{AppliedResource, CachedWork, PendingStatus, StatusRecord};

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
pub(super) fn storage(e: impl Into<redb::Error>) -> CacheError {
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

    /// *Durable.* Stores several works as [`put_work`](Self::put_work) does, in one
    /// transaction where the cache can: a burst of works from the hub costs one flush.
    fn put_works(&self, works: &[(CachedWork, Option<Vec<u8>>)]) -> Result<(), CacheError> {
        works
            .iter()
            .try_for_each(|(work, content)| self.put_work(work, content.as_deref()))
    }

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

    /// *Durable.* Records several statuses as [`push_status`](Self::push_status) does, in one
    /// transaction where the cache can; their seqs, in order.
    fn push_statuses(
        &self,
        statuses: Vec<(String, i64, serde_json::Value)>,
    ) -> Result<Vec<u64>, CacheError> {
        statuses
            .iter()
            .map(|(uid, generation, status)| self.push_status(uid, *generation, status))
            .collect()
    }

    /// Every status the hub has not acknowledged, one per work.
    fn pending_statuses(&self) -> Result<Vec<PendingStatus>, CacheError>;

    /// The hub stored the work's status up to `seq`. Says whether the outbox entry is now
    /// acknowledged (`false` when a newer status is pending or the work is unknown).
    fn ack_status(&self, uid: &str, seq: u64) -> Result<bool, CacheError>;

    /// The hub's acks of several statuses, as [`ack_status`](Self::ack_status) takes one, in
    /// one transaction where the cache can; for each, whether its outbox entry is acknowledged.
    fn ack_statuses(&self, acks: &[(String, u64)]) -> Result<Vec<bool>, CacheError> {
        acks.iter()
            .map(|(uid, seq)| self.ack_status(uid, *seq))
            .collect()
    }

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
