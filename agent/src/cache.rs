//! The agent's durable state: what the hub wants here, what the agent applied, and the status
//! the hub has not acknowledged yet. It is what lets the agent ride out a hub outage: on start
//! the agent reconciles from here at once, hub or no hub.
//!
//! Everything sits behind [`WorkCache`], a narrow, object-safe, synchronous trait (sled is
//! synchronous and its calls are short; callers that must not block a runtime thread use
//! [`durably`]). [`SledCache`] is the implementation: one sled database can hold many clusters,
//! each under its own key prefix, so the load-test harness can run thousands of agents on one
//! database instead of thousands of databases.
//!
//! Writes that the protocol relies on are flushed before they return: the agent acks a
//! generation only after it is durable, and a status must survive a restart until the hub acks
//! it. Status acks are not flushed: losing one only re-sends a status the hub drops by its seq.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use flotilla_proto::wire::HeldWork;
use serde::{Deserialize, Serialize};
use sled::Transactional as _;
use sled::transaction::{ConflictableTransactionError, TransactionError};

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
    /// The cache directory could not be opened. Not retryable: fix the path or its permissions
    /// (`--data-dir`), or stop the other agent using it.
    #[error(
        "cannot open the agent cache at {path}: {source}; pass --data-dir a writable directory that no other agent uses"
    )]
    Open {
        /// The directory.
        path: String,
        /// What sled said.
        source: sled::Error,
    },
    /// sled failed to read, write or flush. Retryable when the disk recovers (full, I/O error).
    #[error("agent cache storage failed: {0}")]
    Storage(#[from] sled::Error),
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
    /// A blocking cache call could not run (the runtime is shutting down). Not retryable.
    #[error("agent cache task failed: {0}")]
    Task(String),
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
    /// for its uid, tombstone included.
    fn put_work(&self, work: &CachedWork, manifest_work: Option<&[u8]>) -> Result<(), CacheError>;

    /// *Durable.* Marks a work deleted by the hub. `false` when the uid is not held.
    fn mark_deleting(&self, uid: &str) -> Result<bool, CacheError>;

    /// *Durable.* Drops everything about a work: content, ledger, status.
    fn forget(&self, uid: &str) -> Result<(), CacheError>;

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

/// sled's in-memory page cache. Its default (1 GiB) is sized for a server; an agent on a small
/// edge node holds a few MiB of works, and a load-test database is opened once for all.
const SLED_CACHE_BYTES: u64 = 64 * 1024 * 1024;

/// Tree names. Each tree holds every cluster's records, keyed by `cluster \0 uid`.
const WORKS: &str = "works";
const MANIFESTS: &str = "manifests";
const LEDGER: &str = "ledger";
const STATUS: &str = "status";
// The registration work adds the agent's identity (certificate and key) in its own tree,
// keyed by the cluster prefix alone.

/// A sled database that holds the caches of one or more clusters.
#[derive(Clone, Debug)]
pub struct SledCacheDb {
    db: sled::Db,
}

impl SledCacheDb {
    /// Opens (creating if needed) the database in `dir`. sled locks the directory: a second
    /// process gets [`CacheError::Open`].
    pub fn open(dir: &Path) -> Result<Self, CacheError> {
        let db = sled::Config::new()
            .path(dir)
            .cache_capacity(SLED_CACHE_BYTES)
            .open()
            .map_err(|source| CacheError::Open {
                path: dir.display().to_string(),
                source,
            })?;
        Ok(Self { db })
    }

    /// A database in a temporary directory that is removed on drop (tests, load tests).
    pub fn temporary() -> Result<Self, CacheError> {
        let db = sled::Config::new()
            .temporary(true)
            .cache_capacity(SLED_CACHE_BYTES)
            .open()?;
        Ok(Self { db })
    }

    /// The cache of one cluster in this database; clusters never see each other's records.
    pub fn cluster(&self, cluster: &str) -> Result<SledCache, CacheError> {
        let mut prefix = cluster.as_bytes().to_vec();
        // Cluster names are DNS labels and never contain NUL, so no prefix is another's prefix.
        prefix.push(0);
        Ok(SledCache {
            db: self.db.clone(),
            prefix,
            works: self.db.open_tree(WORKS)?,
            manifests: self.db.open_tree(MANIFESTS)?,
            ledger: self.db.open_tree(LEDGER)?,
            status: self.db.open_tree(STATUS)?,
        })
    }
}

/// [`WorkCache`] for one cluster in a [`SledCacheDb`].
#[derive(Clone)]
pub struct SledCache {
    db: sled::Db,
    /// `cluster \0`: every key of this cluster starts with it.
    prefix: Vec<u8>,
    /// uid → [`CachedWork`] (JSON).
    works: sled::Tree,
    /// uid → the ManifestWork JSON as received. Apart from `works` so listing stays cheap.
    manifests: sled::Tree,
    /// uid → `Vec<AppliedResource>` (JSON).
    ledger: sled::Tree,
    /// uid → [`StatusRecord`] (JSON): the latest status and the outbox in one record, so a new
    /// status and an ack race on one key only.
    status: sled::Tree,
}

impl fmt::Debug for SledCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SledCache")
            .field(
                "cluster",
                &String::from_utf8_lossy(&self.prefix[..self.prefix.len() - 1]),
            )
            .finish_non_exhaustive()
    }
}

impl SledCache {
    fn key(&self, uid: &str) -> Vec<u8> {
        let mut key = Vec::with_capacity(self.prefix.len() + uid.len());
        key.extend_from_slice(&self.prefix);
        key.extend_from_slice(uid.as_bytes());
        key
    }

    fn uid_of<'a>(&self, key: &'a [u8]) -> std::borrow::Cow<'a, str> {
        String::from_utf8_lossy(&key[self.prefix.len()..])
    }

    fn flush(&self) -> Result<(), CacheError> {
        self.db.flush()?;
        Ok(())
    }

    fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        tree: &sled::Tree,
        name: &'static str,
        uid: &str,
    ) -> Result<Option<T>, CacheError> {
        match tree.get(self.key(uid))? {
            None => Ok(None),
            Some(bytes) => decode(name, uid, &bytes).map(Some),
        }
    }

    fn scan_json<T: serde::de::DeserializeOwned>(
        &self,
        tree: &sled::Tree,
        name: &'static str,
    ) -> Result<Vec<(String, T)>, CacheError> {
        let mut out = Vec::new();
        for entry in tree.scan_prefix(&self.prefix) {
            let (key, bytes) = entry?;
            let uid = self.uid_of(&key).into_owned();
            let value = decode(name, &uid, &bytes)?;
            out.push((uid, value));
        }
        Ok(out)
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

fn transaction_error(e: TransactionError<()>) -> CacheError {
    match e {
        TransactionError::Storage(e) => CacheError::Storage(e),
        // Nothing here aborts on purpose.
        TransactionError::Abort(()) => CacheError::Task("cache transaction aborted".to_owned()),
    }
}

impl WorkCache for SledCache {
    fn works(&self) -> Result<Vec<CachedWork>, CacheError> {
        Ok(self
            .scan_json::<CachedWork>(&self.works, WORKS)?
            .into_iter()
            .map(|(_, w)| w)
            .collect())
    }

    fn work(&self, uid: &str) -> Result<Option<CachedWork>, CacheError> {
        self.get_json(&self.works, WORKS, uid)
    }

    fn manifest_work(&self, uid: &str) -> Result<Option<Vec<u8>>, CacheError> {
        Ok(self.manifests.get(self.key(uid))?.map(|v| v.to_vec()))
    }

    fn put_work(&self, work: &CachedWork, manifest_work: Option<&[u8]>) -> Result<(), CacheError> {
        let key = self.key(&work.uid);
        let record = encode(WORKS, &work.uid, work)?;
        // One transaction so that a crash never leaves a work with another generation's content.
        (&self.works, &self.manifests)
            .transaction(|(works, manifests)| {
                works.insert(key.as_slice(), record.as_slice())?;
                match manifest_work {
                    Some(content) => {
                        manifests.insert(key.as_slice(), content)?;
                    }
                    None => {
                        manifests.remove(key.as_slice())?;
                    }
                }
                Ok::<_, ConflictableTransactionError<()>>(())
            })
            .map_err(transaction_error)?;
        self.flush()
    }

    fn mark_deleting(&self, uid: &str) -> Result<bool, CacheError> {
        let Some(mut work) = self.work(uid)? else {
            return Ok(false);
        };
        if !work.deleting {
            work.deleting = true;
            self.works
                .insert(self.key(uid), encode(WORKS, uid, &work)?)?;
            self.flush()?;
        }
        Ok(true)
    }

    fn forget(&self, uid: &str) -> Result<(), CacheError> {
        let key = self.key(uid);
        (&self.works, &self.manifests, &self.ledger, &self.status)
            .transaction(|(works, manifests, ledger, status)| {
                works.remove(key.as_slice())?;
                manifests.remove(key.as_slice())?;
                ledger.remove(key.as_slice())?;
                status.remove(key.as_slice())?;
                Ok::<_, ConflictableTransactionError<()>>(())
            })
            .map_err(transaction_error)?;
        self.flush()
    }

    fn ledger(&self, uid: &str) -> Result<Vec<AppliedResource>, CacheError> {
        Ok(self
            .get_json(&self.ledger, LEDGER, uid)?
            .unwrap_or_default())
    }

    fn ledgers(&self) -> Result<Vec<(String, Vec<AppliedResource>)>, CacheError> {
        self.scan_json(&self.ledger, LEDGER)
    }

    fn set_ledger(&self, uid: &str, resources: &[AppliedResource]) -> Result<(), CacheError> {
        let key = self.key(uid);
        if resources.is_empty() {
            self.ledger.remove(key)?;
        } else {
            self.ledger.insert(key, encode(LEDGER, uid, &resources)?)?;
        }
        self.flush()
    }

    fn last_status(&self, uid: &str) -> Result<Option<StatusRecord>, CacheError> {
        self.get_json(&self.status, STATUS, uid)
    }

    fn push_status(
        &self,
        uid: &str,
        generation: i64,
        status: &serde_json::Value,
    ) -> Result<u64, CacheError> {
        let key = self.key(uid);
        // Read-modify-write by compare-and-swap: an ack landing between the read and the write
        // makes the swap fail and the loop re-read, so the new seq is always previous + 1.
        loop {
            let current = self.status.get(&key)?;
            let (seq, acked_seq) = match &current {
                Some(bytes) => {
                    let prev: StatusRecord = decode(STATUS, uid, bytes)?;
                    (prev.seq + 1, prev.acked_seq)
                }
                None => (1, 0),
            };
            let record = StatusRecord {
                generation,
                seq,
                acked_seq,
                status: status.clone(),
            };
            let new = encode(STATUS, uid, &record)?;
            if self
                .status
                .compare_and_swap(&key, current, Some(new))?
                .is_ok()
            {
                self.flush()?;
                return Ok(seq);
            }
        }
    }

    fn pending_statuses(&self) -> Result<Vec<PendingStatus>, CacheError> {
        let mut out = Vec::new();
        for (uid, record) in self.scan_json::<StatusRecord>(&self.status, STATUS)? {
            if record.is_pending() {
                let status_json = encode(STATUS, &uid, &record.status)?;
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
        loop {
            let Some(current) = self.status.get(&key)? else {
                return Ok(false);
            };
            let mut record: StatusRecord = decode(STATUS, uid, &current)?;
            if seq <= record.acked_seq {
                return Ok(!record.is_pending());
            }
            // The hub may ack a seq above ours only if it saw a status from an earlier life of
            // this cache; never let the ack run past what we produced.
            record.acked_seq = seq.min(record.seq);
            let new = encode(STATUS, uid, &record)?;
            if self
                .status
                .compare_and_swap(&key, Some(current), Some(new))?
                .is_ok()
            {
                return Ok(!record.is_pending());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
        let db = SledCacheDb::temporary().unwrap();
        let cache = db.cluster("store-7").unwrap();
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
        let db = SledCacheDb::temporary().unwrap();
        let cache = db.cluster("c").unwrap();
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

    /// Opens `dir` again after the previous handles were dropped. sled releases its directory
    /// lock from its background flusher thread a moment after the last handle goes, so poll
    /// for that, with a bound (500 × 10 ms).
    #[allow(clippy::disallowed_methods)]
    fn reopen(dir: &Path) -> SledCacheDb {
        for _ in 0..500 {
            match SledCacheDb::open(dir) {
                Ok(db) => return db,
                Err(CacheError::Open { source, .. }) if source.to_string().contains("lock") => {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(e) => panic!("reopening the cache: {e}"),
            }
        }
        panic!(
            "sled kept its lock on {} for 5 s after every handle was dropped",
            dir.display()
        );
    }

    #[test]
    fn everything_survives_reopening() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = SledCacheDb::open(dir.path()).unwrap();
            let cache = db.cluster("store-7").unwrap();
            cache.put_work(&work("a", 3), Some(b"{}")).unwrap();
            cache.set_ledger("a", &[deployment("web")]).unwrap();
            assert_eq!(cache.push_status("a", 3, &json!({"n": 1})).unwrap(), 1);
            assert_eq!(cache.push_status("a", 3, &json!({"n": 2})).unwrap(), 2);
        }
        let db = reopen(dir.path());
        let cache = db.cluster("store-7").unwrap();
        assert_eq!(cache.work("a").unwrap(), Some(work("a", 3)));
        assert_eq!(cache.ledger("a").unwrap(), vec![deployment("web")]);
        let pending = cache.pending_statuses().unwrap();
        assert_eq!(pending.len(), 1);
        assert_eq!((pending[0].seq, pending[0].generation), (2, 3));
        assert_eq!(pending[0].status_json, br#"{"n":2}"#);
        // The seq keeps counting from where it was, even after the hub acked everything.
        assert!(cache.ack_status("a", 2).unwrap());
        drop(cache);
        drop(db);
        let db = reopen(dir.path());
        let cache = db.cluster("store-7").unwrap();
        assert!(cache.pending_statuses().unwrap().is_empty());
        assert_eq!(cache.push_status("a", 4, &json!({"n": 3})).unwrap(), 3);
    }

    #[test]
    fn a_second_process_cannot_open_the_same_directory() {
        let dir = tempfile::tempdir().unwrap();
        let _first = SledCacheDb::open(dir.path()).unwrap();
        let err = SledCacheDb::open(dir.path()).unwrap_err();
        assert!(err.to_string().contains("--data-dir"), "{err}");
    }

    #[test]
    fn clusters_in_one_database_are_isolated() {
        let db = SledCacheDb::temporary().unwrap();
        // "store-1" is a byte prefix of "store-10": the NUL separator keeps them apart.
        let one = db.cluster("store-1").unwrap();
        let ten = db.cluster("store-10").unwrap();
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
        let db = SledCacheDb::temporary().unwrap();
        let cache = db.cluster("c").unwrap();
        assert_eq!(cache.push_status("a", 1, &json!({"v": 1})).unwrap(), 1);
        assert_eq!(cache.push_status("a", 2, &json!({"v": 2})).unwrap(), 2);
        assert_eq!(cache.push_status("b", 1, &json!({"v": 9})).unwrap(), 1);
        let pending = cache.pending_statuses().unwrap();
        assert_eq!(pending.len(), 2, "coalesced per work: {pending:?}");
        let a = pending.iter().find(|p| p.uid == "a").unwrap();
        assert_eq!((a.generation, a.seq), (2, 2));
        assert_eq!(a.status_json, br#"{"v":2}"#);
    }

    #[test]
    fn an_ack_for_an_older_seq_keeps_the_newer_status_pending() {
        let db = SledCacheDb::temporary().unwrap();
        let cache = db.cluster("c").unwrap();
        cache.push_status("a", 1, &json!({"v": 1})).unwrap();
        cache.push_status("a", 1, &json!({"v": 2})).unwrap();
        assert!(!cache.ack_status("a", 1).unwrap());
        assert_eq!(cache.pending_statuses().unwrap()[0].seq, 2);
        assert!(cache.ack_status("a", 2).unwrap());
        assert!(cache.pending_statuses().unwrap().is_empty());
        // A late duplicate ack changes nothing; an unknown work is not an error.
        assert!(cache.ack_status("a", 1).unwrap());
        assert!(!cache.ack_status("zzz", 1).unwrap());
        // The last status stays for comparison after the ack.
        assert_eq!(
            cache.last_status("a").unwrap().unwrap().status,
            json!({"v": 2})
        );
    }

    #[test]
    fn an_ack_past_our_seq_does_not_hide_later_statuses() {
        let db = SledCacheDb::temporary().unwrap();
        let cache = db.cluster("c").unwrap();
        cache.push_status("a", 1, &json!({})).unwrap();
        assert!(cache.ack_status("a", 7).unwrap());
        assert_eq!(cache.push_status("a", 1, &json!({"v": 2})).unwrap(), 2);
        assert_eq!(cache.pending_statuses().unwrap().len(), 1);
    }

    #[test]
    fn ledgers_list_every_work_of_the_cluster() {
        let db = SledCacheDb::temporary().unwrap();
        let cache = db.cluster("c").unwrap();
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
