//! The cache's tables (each holds every cluster's records, keyed by `cluster \0 uid`) and one
//! write transaction's handle on all of them.

use redb::{TableDefinition, WriteTransaction};

use super::work_cache::{CacheError, storage};

/// A table of the cache. Each holds every cluster's records, keyed by `cluster \0 uid`.
#[derive(Clone, Copy)]
pub(super) struct Table(pub(super) &'static str);

impl Table {
    pub(super) fn def(self) -> TableDefinition<'static, &'static [u8], &'static [u8]> {
        TableDefinition::new(self.0)
    }
}

/// uid → [`CachedWork`] (JSON).
pub(super) const WORKS: Table = Table("works");
/// uid → the ManifestWork JSON as received. Apart from `works` so listing stays cheap.
pub(super) const MANIFESTS: Table = Table("manifests");
/// hex SHA-256 → a chunk of large-work content (raw bytes), shared by every work naming it.
pub(super) const CHUNKS: Table = Table("chunks");
/// uid → the hex digests (JSON list) of a large work's content being fetched: the chunks a
/// transfer under way keeps until the work is stored, or the transfer is given up.
pub(super) const FETCHES: Table = Table("fetches");
/// uid → `Vec<AppliedResource>` (JSON).
pub(super) const LEDGER: Table = Table("ledger");
/// uid → [`StatusRecord`] (JSON): the latest status and the outbox in one record, so a new
/// status and an ack meet on one key only.
pub(super) const STATUS: Table = Table("status");
/// uid → nothing: works released from the spoke whose release the hub has not acknowledged.
pub(super) const RELEASED: Table = Table("released");
// The agent's identity (key, certificate, CA bundle) is files in its own directory, written
// atomically (`identity`), not records here.

/// The cache's tables, open in one write transaction.
pub(super) struct Tables<'t> {
    pub(super) works: redb::Table<'t, &'static [u8], &'static [u8]>,
    pub(super) manifests: redb::Table<'t, &'static [u8], &'static [u8]>,
    pub(super) ledger: redb::Table<'t, &'static [u8], &'static [u8]>,
    pub(super) status: redb::Table<'t, &'static [u8], &'static [u8]>,
    pub(super) chunks: redb::Table<'t, &'static [u8], &'static [u8]>,
    pub(super) fetches: redb::Table<'t, &'static [u8], &'static [u8]>,
    pub(super) released: redb::Table<'t, &'static [u8], &'static [u8]>,
}

impl<'t> Tables<'t> {
    pub(super) fn open(txn: &'t WriteTransaction) -> Result<Self, CacheError> {
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
