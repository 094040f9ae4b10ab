//! Group commit: with `CommitMode::Group`, one thread commits the writes of many agents'
//! threads together, one durable transaction (one fsync) for all that arrived while the
//! previous one was on the disk, each writer answered with its own result once its transaction
//! is durable.

use std::sync::{Arc, mpsc};

use redb::Database;

use super::tables::Tables;
use super::work_cache::CacheError;

/// Most writes one group commit puts in a transaction. Writers wait for their commit, so the
/// queue never holds more than there are blocked writers (tokio's blocking pool, 512 by
/// default); this bounds one transaction's size and the time the first writer waits.
const MAX_GROUP: usize = 512;

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

/// The thread that commits a `CommitMode::Group` database's writes: it takes every write
/// queued while the previous transaction was committing (at most [`MAX_GROUP`]) into one
/// transaction, commits it durably, then answers each writer.
pub(super) struct GroupCommitter {
    /// Dropped first on drop, which ends the thread's loop.
    jobs: Option<mpsc::SyncSender<GroupJob>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl GroupCommitter {
    pub(super) fn start(db: Arc<Database>, location: &str) -> Result<Self, CacheError> {
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

    pub(super) fn write<T: Send + 'static>(
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

#[cfg(test)]
mod tests {
    use super::super::db::{CacheDb, CommitMode};
    use super::super::test_support::work;
    use super::super::work_cache::WorkCache;
    use super::super::work_cache::storage;
    use redb::Durability;
    use serde_json::json;

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
}
