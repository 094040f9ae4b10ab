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
//!
//! * `work_cache`: the [`WorkCache`] trait, its errors, [`durably`].
//! * `records`: what is stored (works, the ledger's resources, statuses).
//! * `tables`: the tables of the database and the transaction that opens them all.
//! * `db`: the redb database ([`CacheDb`]), its tables, and one cluster's records in it
//!   ([`ClusterCache`]).
//! * `group`: group commit, for the load test's shared database.
//! * `chunks`: large works' content: chunks kept while a held work or a transfer names them,
//!   and joined ([`joined_manifest_work`]) before a work is applied.

mod chunks;
mod db;
mod group;
mod records;
mod tables;
#[cfg(test)]
mod test_support;
mod work_cache;

pub use chunks::joined_manifest_work;
pub use db::{CacheDb, ClusterCache, CommitMode, retire_sled_cache};
pub use records::{
    AppliedResource, CachedWork, MAX_MANIFEST_WORK_BYTES, PendingStatus, StatusRecord,
};
pub use work_cache::{CacheError, WorkCache, durably};
