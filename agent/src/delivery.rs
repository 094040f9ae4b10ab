//! Delivery between the hub's frames and the durable cache, off the session driver's loop:
//! works from the hub go into the cache one batch at a time (what arrived together is stored
//! in one transaction), in the order the frames asked for them, and are acked only once
//! durable; deletes become tombstones for the reconciler;
//! the hub's status and release acks are recorded; statuses and releases come out of the
//! cache's outboxes for the hub until it acks them.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use flotilla_proto::api::ManifestWork;
use flotilla_proto::api::content::ContentRef;
use flotilla_proto::api::policy::{MAX_POLICY_BYTES, Policy};
use flotilla_proto::session::{AgentSession, Delivered};
use flotilla_proto::wire;
use futures::future::BoxFuture;
use tracing::{debug, info, warn};

use crate::cache::{CacheError, CachedWork, MAX_MANIFEST_WORK_BYTES, durably};
use crate::spoke::Spoke;

/// Work on the durable cache, in order.
#[derive(Debug)]
pub(crate) enum CacheOp {
    Store(wire::WorkUpdate),
    /// Records the transfer of a large work's content and finds which chunks it needs.
    Fetch {
        uid: String,
        /// `namespace/name`, for logs.
        name: String,
        content: ContentRef,
        /// Which transfer of the work it is (the session's machine tells the latest).
        transfer: u64,
    },
    /// Gives up the transfers of works the hub did not send in this session's sync.
    EndFetches {
        keep: Vec<String>,
    },
    Delete {
        uid: String,
        namespace: String,
        name: String,
    },
    AckStatus {
        uid: String,
        seq: u64,
    },
    AckRelease {
        uid: String,
    },
}

/// What a cache operation did.
#[derive(Debug)]
pub(crate) enum CacheDone {
    /// The work is durable at this generation (ack it); `changed` when the reconciler must look.
    Stored {
        uid: String,
        generation: i64,
        stored: Option<CachedWork>,
    },
    /// Not stored (the error is logged): not acked, so the hub sends it again.
    NotStored,
    /// A large work's transfer is recorded: which chunks it still needs.
    Fetch {
        uid: String,
        name: String,
        content: ContentRef,
        transfer: u64,
        missing: Result<Vec<String>, CacheError>,
    },
    /// Transfers given up (or not: the error is logged).
    FetchesEnded,
    Deleted,
    /// The hub's release ack is recorded (or logged as not).
    ReleaseAcked,
    StatusAcked {
        uid: String,
        acked: bool,
    },
}

impl CacheDone {
    /// The ack the machine sends for it, if any; tells the observer.
    pub(crate) fn ack(&self, spoke: &Spoke) -> Option<(String, i64)> {
        match self {
            CacheDone::Stored {
                uid,
                generation,
                stored,
            } => {
                if let Some(work) = stored {
                    spoke.observer.work_stored(work);
                }
                Some((uid.clone(), *generation))
            }
            _ => None,
        }
    }
}

/// Most operations run together as one batch (one transaction, one flush): a burst of works
/// from the hub, or of its status acks, waiting in the queue at once.
pub(crate) const MAX_BATCH: usize = 64;

/// Cache operations run one batch at a time, in the order the hub's frames asked for them, off
/// the driver's loop. Consecutive stores of distinct works are one batch, and so are
/// consecutive status acks: what arrived while the previous batch was on the disk costs one
/// flush, not one each.
#[derive(Default)]
pub(crate) struct CacheQueue {
    waiting: VecDeque<CacheOp>,
    running: Option<BoxFuture<'static, Vec<CacheDone>>>,
}

/// Operations run together.
#[derive(Debug)]
enum Batch {
    Stores(Vec<wire::WorkUpdate>),
    Acks(Vec<(String, u64)>),
    One(CacheOp),
}

impl CacheQueue {
    pub(crate) fn push(&mut self, op: CacheOp) {
        self.waiting.push_back(op);
    }

    pub(crate) fn is_busy(&self) -> bool {
        self.running.is_some() || !self.waiting.is_empty()
    }

    /// The next batch's results, in the order of its operations (starting it if none runs).
    pub(crate) async fn next(&mut self, spoke: &Spoke) -> Vec<CacheDone> {
        if self.running.is_none() {
            let batch = self.take_batch();
            self.running = Some(Box::pin(run_batch(spoke.clone(), batch)));
        }
        let done = self.running.as_mut().expect("set above").await;
        self.running = None;
        done
    }

    /// The operation at the front, with those after it that run with it: stores of works not
    /// already in the batch (two generations of one work stay in order, one batch each), or
    /// status acks; at most [`MAX_BATCH`].
    fn take_batch(&mut self) -> Batch {
        match self.waiting.pop_front().expect("called only when busy") {
            CacheOp::Store(work) => {
                let mut uids = HashSet::from([work.uid.clone()]);
                let mut works = vec![work];
                while works.len() < MAX_BATCH
                    && let Some(CacheOp::Store(next)) = self.waiting.front()
                    && uids.insert(next.uid.clone())
                {
                    let Some(CacheOp::Store(next)) = self.waiting.pop_front() else {
                        unreachable!("matched above")
                    };
                    works.push(next);
                }
                Batch::Stores(works)
            }
            CacheOp::AckStatus { uid, seq } => {
                let mut acks = vec![(uid, seq)];
                while acks.len() < MAX_BATCH
                    && matches!(self.waiting.front(), Some(CacheOp::AckStatus { .. }))
                {
                    let Some(CacheOp::AckStatus { uid, seq }) = self.waiting.pop_front() else {
                        unreachable!("matched above")
                    };
                    acks.push((uid, seq));
                }
                Batch::Acks(acks)
            }
            op => Batch::One(op),
        }
    }

    /// At the session's end: lets an operation already under way finish (its write is not torn
    /// off half-way), then records the status acks still queued, all `within`. The hub has
    /// stored those statuses; an ack forgotten here would make the agent send them again next
    /// session. Works and deletes still queued are left: they were not acked, so the hub sends
    /// them again.
    pub(crate) async fn finish(&mut self, spoke: &Spoke, within: Duration) {
        let running = self.running.take();
        let mut status_acks = Vec::new();
        let mut release_acks = Vec::new();
        for op in self.waiting.drain(..) {
            match op {
                CacheOp::AckStatus { uid, seq } => status_acks.push((uid, seq)),
                op @ CacheOp::AckRelease { .. } => release_acks.push(op),
                _ => {}
            }
        }
        let _ = tokio::time::timeout(within, async {
            if let Some(running) = running {
                running.await;
            }
            if !status_acks.is_empty() {
                run_batch(spoke.clone(), Batch::Acks(status_acks)).await;
            }
            for ack in release_acks {
                run_cache_op(spoke.clone(), ack).await;
            }
        })
        .await;
    }
}

/// Runs a batch of cache operations; their results in order.
async fn run_batch(spoke: Spoke, batch: Batch) -> Vec<CacheDone> {
    match batch {
        Batch::Stores(works) => store_works(&spoke, works).await,
        Batch::Acks(acks) => ack_statuses(&spoke, acks).await,
        Batch::One(op) => vec![run_cache_op(spoke, op).await],
    }
}

/// Records the hub's acks of statuses, in one transaction.
async fn ack_statuses(spoke: &Spoke, acks: Vec<(String, u64)>) -> Vec<CacheDone> {
    let uids: Vec<String> = acks.iter().map(|(uid, _)| uid.clone()).collect();
    match durably(&spoke.cache, move |c| c.ack_statuses(&acks)).await {
        Ok(acked) => uids
            .into_iter()
            .zip(acked)
            .map(|(uid, acked)| CacheDone::StatusAcked { uid, acked })
            .collect(),
        // The statuses stay pending and are re-sent next session; the hub drops them by seq.
        Err(e) => {
            warn!(statuses = uids.len(), error = %e, "cannot record the hub's status acks");
            uids.into_iter()
                .map(|uid| CacheDone::StatusAcked { uid, acked: false })
                .collect()
        }
    }
}

/// Runs one cache operation.
async fn run_cache_op(spoke: Spoke, op: CacheOp) -> CacheDone {
    match op {
        // A store or an ack alone is a batch of one: one result.
        CacheOp::Store(work) => store_works(&spoke, vec![work])
            .await
            .pop()
            .expect("a result per work"),
        CacheOp::Fetch {
            uid,
            name,
            content,
            transfer,
        } => {
            let (key, chunks) = (uid.clone(), content.chunks.clone());
            let missing = durably(&spoke.cache, move |c| c.begin_fetch(&key, &chunks)).await;
            CacheDone::Fetch {
                uid,
                name,
                content,
                transfer,
                missing,
            }
        }
        CacheOp::EndFetches { keep } => {
            match durably(&spoke.cache, move |c| c.end_fetches(&keep)).await {
                Ok(0) => {}
                Ok(released) => {
                    info!(
                        chunks = released,
                        "released the chunks of transfers the hub no longer asks for"
                    )
                }
                Err(e) => {
                    warn!(error = %e, "cannot give up stale transfers; trying after the next sync")
                }
            }
            CacheDone::FetchesEnded
        }
        CacheOp::Delete {
            uid,
            namespace,
            name,
        } => {
            delete_work(&spoke, uid, &namespace, &name).await;
            CacheDone::Deleted
        }
        CacheOp::AckRelease { uid } => {
            let key = uid.clone();
            if let Err(e) = durably(&spoke.cache, move |c| c.ack_release(&key)).await {
                // Sent again next session; the hub answers it again.
                warn!(uid = %uid, error = %e, "cannot record the hub's release ack");
            }
            CacheDone::ReleaseAcked
        }
        CacheOp::AckStatus { uid, seq } => ack_statuses(&spoke, vec![(uid, seq)])
            .await
            .pop()
            .expect("a result per ack"),
    }
}

/// Stores works from the hub durably, in one transaction, and hands each to the reconciler
/// (or the policy desk); the caller acks each one `Stored`. An acked generation must survive a
/// crash. A work already held as sent (a resume after a lost ack) is acked without a write.
async fn store_works(spoke: &Spoke, works: Vec<wire::WorkUpdate>) -> Vec<CacheDone> {
    let mut done: Vec<CacheDone> = Vec::with_capacity(works.len());
    // (index in `done`, the record, its content)
    let mut storing: Vec<(usize, CachedWork, Option<Vec<u8>>)> = Vec::new();
    for work in works {
        let wire::WorkUpdate {
            uid,
            namespace,
            name,
            generation,
            content_hash,
            manifest_work_json,
            kind,
        } = work;
        if uid.is_empty() {
            warn!(work = %format!("{namespace}/{name}"), "the hub sent a work without a uid; ignored");
            done.push(CacheDone::NotStored);
            continue;
        }
        let delivered = Delivered::of(&kind);
        let refused = refusal(delivered, &kind, &manifest_work_json);
        // Neither a refused nor a held-already body is kept in memory past this point.
        let content = refused.is_none().then_some(manifest_work_json);
        let cached = CachedWork {
            uid,
            namespace,
            name,
            generation,
            content_hash,
            refused,
            deleting: false,
            policy: delivered == Some(Delivered::Policy),
        };
        done.push(CacheDone::NotStored);
        storing.push((done.len() - 1, cached, content));
    }
    if storing.is_empty() {
        return done;
    }
    let keys: Vec<String> = storing.iter().map(|(_, w, _)| w.uid.clone()).collect();
    let held = match durably(&spoke.cache, move |c| {
        keys.iter()
            .map(|uid| c.work(uid))
            .collect::<Result<Vec<_>, _>>()
    })
    .await
    {
        Ok(held) => held,
        Err(e) => {
            warn!(works = storing.len(), error = %e, "cannot read the cached works; storing them again");
            vec![None; storing.len()]
        }
    };
    let mut puts = Vec::with_capacity(storing.len());
    for ((at, cached, content), held) in storing.into_iter().zip(held) {
        if held.as_ref() == Some(&cached) {
            // A resume after a lost ack: already durable, nothing to apply.
            done[at] = CacheDone::Stored {
                uid: cached.uid,
                generation: cached.generation,
                stored: None,
            };
            continue;
        }
        if let Some(reason) = &cached.refused {
            warn!(work = %cached.display_name(), uid = %cached.uid, %reason, "work refused");
        }
        puts.push((at, cached, content));
    }
    if puts.is_empty() {
        return done;
    }
    let mut at = Vec::with_capacity(puts.len());
    let puts: Vec<_> = puts
        .into_iter()
        .map(|(index, cached, content)| {
            at.push(index);
            (cached, content)
        })
        .collect();
    let (result, puts) = match durably(&spoke.cache, move |c| {
        let result = c.put_works(&puts);
        // Handed back without their contents: only the records are needed past here.
        let records: Vec<CachedWork> = puts.into_iter().map(|(work, _)| work).collect();
        Ok::<_, CacheError>((result, records))
    })
    .await
    {
        Ok(stored) => stored,
        Err(e) => {
            // The blocking task did not run (the runtime is stopping): nothing is acked.
            warn!(works = at.len(), error = %e, "cannot store works from the hub");
            return done;
        }
    };
    match result {
        Ok(()) => {
            for (at, stored) in at.into_iter().zip(puts) {
                debug!(work = %stored.display_name(), uid = %stored.uid, generation = stored.generation, "work stored");
                if stored.policy {
                    spoke.policies.changed(&stored.uid);
                } else {
                    spoke.reconciler.work_changed(&stored.uid).await;
                }
                done[at] = CacheDone::Stored {
                    uid: stored.uid.clone(),
                    generation: stored.generation,
                    stored: Some(stored),
                };
            }
        }
        // Not acked: the next session's hello does not hold them, so the hub sends them again.
        Err(e) => {
            for stored in &puts {
                warn!(work = %stored.display_name(), uid = %stored.uid, error = %e, "cannot store a work from the hub");
            }
        }
    }
    done
}

/// Why the agent will not keep what a `WorkUpdate` of `kind` carries, if it will not: too
/// large, of a kind it does not know, or not the kind it says. The generation is still held
/// and acked, and the reason goes into its status.
fn refusal(delivered: Option<Delivered>, kind: &str, json: &[u8]) -> Option<String> {
    let size = json.len();
    match delivered {
        None => Some(format!(
            "the hub sent a {kind:?}, which this agent does not know; upgrade the agent to one that serves it"
        )),
        Some(Delivered::Work) if size > MAX_MANIFEST_WORK_BYTES => Some(format!(
            "the ManifestWork is {size} bytes, more than the agent's limit of {MAX_MANIFEST_WORK_BYTES} bytes; \
             split its manifests over several ManifestWorks"
        )),
        Some(Delivered::Work) => serde_json::from_slice::<ManifestWork>(json)
            .err()
            .map(|e| format!("the hub sent a ManifestWork the agent cannot read: {e}")),
        // The hub refuses a Policy spec over MAX_POLICY_BYTES; the agent's bound is its bound
        // for any one object it holds.
        Some(Delivered::Policy) if size > MAX_MANIFEST_WORK_BYTES => Some(format!(
            "the Policy is {size} bytes, more than the agent's limit of {MAX_MANIFEST_WORK_BYTES} bytes \
             (the hub allows {MAX_POLICY_BYTES} of spec); split its templates over several Policies"
        )),
        Some(Delivered::Policy) => serde_json::from_slice::<Policy>(json)
            .err()
            .map(|e| format!("the hub sent a Policy the agent cannot read: {e}")),
    }
}

/// Marks a work deleted by the hub as a tombstone and hands it to the reconciler, which
/// removes or orphans its resources and then forgets it; a policy goes to the governor, which
/// prunes what its `pruneObjectBehavior` says and then releases it.
async fn delete_work(spoke: &Spoke, uid: String, namespace: &str, name: &str) {
    // A delete found during the hello sync carries only the uid: the name is in the cache.
    let key = uid.clone();
    let cached = durably(&spoke.cache, move |c| c.work(&key))
        .await
        .ok()
        .flatten();
    let work = match (&cached, name.is_empty()) {
        (Some(cached), true) => cached.display_name(),
        (None, true) => format!("uid {uid}"),
        (_, false) => format!("{namespace}/{name}"),
    };
    let key = uid.clone();
    match durably(&spoke.cache, move |c| c.mark_deleting(&key)).await {
        Ok(true) if cached.as_ref().is_some_and(|c| c.policy) => {
            info!(uid = %uid, policy = %work, "policy removed from this cluster on the hub");
            spoke.policies.changed(&uid);
        }
        Ok(true) => {
            info!(uid = %uid, %work, "work deleted on the hub");
            spoke.reconciler.work_changed(&uid).await;
        }
        Ok(false) => {
            // Nothing of it is here (never stored, or already released). Its content may have
            // been on the way: what came of it goes. And it is released, so the hub does not
            // keep the work waiting for this agent.
            debug!(uid = %uid, "the hub deleted a work this agent does not hold; released");
            let key = uid.clone();
            if let Err(e) = durably(&spoke.cache, move |c| c.end_fetch(&key)).await {
                warn!(uid = %uid, error = %e, "cannot give up the transfer of a deleted work; given up after the next sync");
            }
            let key = uid.clone();
            match durably(&spoke.cache, move |c| c.release(&key)).await {
                Ok(()) => spoke.outbox_changed.notify_one(),
                Err(e) => warn!(uid = %uid, error = %e, "cannot record a work release"),
            }
        }
        // Still held: the hub repeats the delete on the next session, where the hello lists it.
        Err(e) => warn!(uid = %uid, error = %e, "cannot record a work deletion"),
    }
}

/// Reports every outbox status not yet reported in this session. The outbox is read from the
/// cache (a read transaction, served from its page cache; no write, no fsync).
pub(crate) fn report_outbox(
    machine: &mut AgentSession,
    spoke: &Spoke,
    reported: &mut HashMap<String, u64>,
) {
    let pending = match spoke.cache.pending_statuses() {
        Ok(p) => p,
        Err(e) => {
            warn!(error = %e, "cannot read the status outbox");
            return;
        }
    };
    for status in pending {
        if reported
            .get(&status.uid)
            .is_some_and(|seq| *seq >= status.seq)
        {
            continue;
        }
        debug!(uid = %status.uid, seq = status.seq, "reporting status");
        reported.insert(status.uid.clone(), status.seq);
        spoke.observer.status_reported(&status.uid, status.seq);
        machine.report_status(
            status.uid,
            status.generation,
            status.seq,
            status.status_json,
        );
    }
}

/// Reports every release in the outbox not yet reported in this session.
pub(crate) fn report_releases(
    machine: &mut AgentSession,
    spoke: &Spoke,
    released: &mut HashSet<String>,
) {
    let pending = match spoke.cache.pending_releases() {
        Ok(p) => p,
        Err(e) => {
            warn!(error = %e, "cannot read the release outbox");
            return;
        }
    };
    for uid in pending {
        if released.insert(uid.clone()) {
            debug!(uid = %uid, "reporting a released work");
            machine.release_work(uid);
        }
    }
}

#[cfg(test)]
mod tests;
