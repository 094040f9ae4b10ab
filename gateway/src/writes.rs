//! The gateway's fenced writes to the store, one queue type for all of them ([`WriteQueue`]):
//! work statuses (`statuses`) and cleanup finalizers (`finalizers`).
//!
//! What a queue guarantees:
//! * Coalesced per key: one value waits per key, a newer submission folded into it
//!   ([`Coalesce::absorb`]), so a burst of reports about one work costs one write, or two when
//!   the burst starts while a write of it is in flight.
//! * Bounded concurrency: at most `concurrency` writes in flight, and never two of one key, so
//!   the writes of one work reach the store in the order they were made.
//! * A budget: every write takes a token of the gateway's [`WriteBudget`] first, which all its
//!   queues share, so the store sees at most `rate·t + burst` writes in any `t` seconds.
//! * Fenced: right before each write the queue asks whether this gateway still acts for the
//!   value's cluster; a value it no longer holds is dropped (neither written nor acknowledged:
//!   its agent reports again to the shard's new owner), counted as `not_held`, unless its
//!   source is still here ([`Coalesce::waits_for_shard`]: the agent's session that reported it
//!   has not left this gateway, so it will not report it to anyone else): then it waits, and
//!   is written if this gateway takes the shard back, or dropped once its source is gone. The fence it
//!   checked ([`Held`]: the shard and this gateway's epoch of it) goes to the writer with the
//!   value, and the store refuses the write if the object was written under a newer epoch
//!   since: a write that stalled past the check is never the one that lands last (see
//!   `fencing`). A refused write is dropped, never retried.
//! * Retried: a write that failed is tried again after a delay that grows with each failure of
//!   the key, up to [`MAX_RETRY_DELAY`], with the newest value by then (a newer submission
//!   replaces the failed one as `absorb` says); a conflict is retried at once, on a fresh read.
//!
//! The queue's state is a few maps behind one lock held for no await; the writes themselves run
//! in the queue's task, `concurrency` futures at a time.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use flotilla_ops::TokenBucket;
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tracing::debug;

use crate::fencing::Fencing;
use crate::locks::{SyncMutex, lock};
use crate::shards::{Held, ShardViews};

/// Default of `--status-writes-per-second`: the gateway's store writes per second, all queues.
pub const DEFAULT_WRITES_PER_SECOND: u32 = 500;
/// Default of `--status-write-burst`.
pub const DEFAULT_WRITE_BURST: u32 = 500;
/// Default of `--status-write-concurrency`: writes in flight at once per queue. With a store
/// round trip of a few milliseconds against an apiserver, one write at a time caps a queue at
/// a few hundred writes a second whatever the budget; 16 covers 500/s at up to 30 ms each.
pub const DEFAULT_WRITE_CONCURRENCY: usize = 16;
/// The first retry of a failed write waits this long; each further failure of the same key
/// doubles it, up to [`MAX_RETRY_DELAY`].
pub const FIRST_RETRY_DELAY: Duration = Duration::from_millis(500);
/// The longest a failed write waits before its next try.
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(10);
/// How soon a write whose shard's fence lapsed (its renewal late) is looked at again.
pub const LAPSE_RETRY: Duration = Duration::from_millis(250);

/// The gateway's budget of store writes, shared by all its queues: a token bucket of `rate`
/// writes per second with room for `burst` at once.
pub type WriteBudget = TokenBucket;

/// A value waiting in a [`WriteQueue`].
pub trait Coalesce: Send + 'static {
    /// The cluster the write is for: its shard fences the write.
    fn cluster(&self) -> &str;
    /// Folds `newer`, submitted after `self` for the same key, into `self`: what is written
    /// next is `self` afterwards.
    fn absorb(&mut self, newer: Self);
    /// Whether the value, its cluster's shard not held here (any more), waits for the shard
    /// to come back to this gateway instead of being dropped. Dropping is right when the
    /// value's source will give it again to the shard's owner; a value whose source stays
    /// here (an agent's session that reported it, still on this gateway) would otherwise be
    /// lost when this gateway takes the shard back under a newer epoch.
    fn waits_for_shard(&self) -> bool {
        false
    }
}

/// What a write came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Done: written, or found to need no write. Nothing is retried.
    Done,
    /// The store refused it: the object holds something newer (another gateway's write under
    /// a newer epoch, or a newer report). Dropped, never retried.
    Refused,
    /// Lost a race with another writer of the object: tried again at once (it reads fresh).
    Conflict,
    /// The store failed: tried again after a delay.
    Failed,
}

/// How a queue writes its values to the store.
pub trait StoreWrite<V>: Send + Sync {
    /// Writes `value` (of `key`), which the queue has just fenced: under `held`.
    fn write(&self, key: &str, value: &V, held: Held) -> impl Future<Output = Outcome> + Send;
}

/// A queue of fenced, coalesced, budgeted writes; see the module docs.
pub struct WriteQueue<V> {
    /// What the queue says in its logs ("work status", "cleanup finalizer").
    what: &'static str,
    state: SyncMutex<State<V>>,
    /// Woken on every submission, so an idle writer starts at once.
    notify: Notify,
    budget: Arc<WriteBudget>,
    concurrency: usize,
    /// The shards this gateway acts for: no write for any other shard's cluster.
    shards: ShardViews,
    /// Counts and logs what the fence check drops.
    fencing: Fencing,
}

struct State<V> {
    /// The value waiting per key: ready, or waiting for a retry.
    pending: HashMap<String, V>,
    /// Keys with a pending value that may be written now, oldest first.
    ready: VecDeque<String>,
    /// Keys being written; their newer values wait in `pending` until the write ends.
    in_flight: HashSet<String>,
    /// Keys waiting for a retry, by when (with a sequence number to keep each entry apart).
    retries: BTreeMap<(Instant, u64), String>,
    /// Keys retrying, with their consecutive failures; a key here is in `retries`, in flight,
    /// or ready for its retry.
    failures: HashMap<String, u32>,
    next_retry: u64,
}

impl<V: Coalesce> WriteQueue<V> {
    /// An empty queue drawing from `budget`, at most `concurrency` (at least 1) writes at once.
    pub fn new(
        what: &'static str,
        budget: Arc<WriteBudget>,
        concurrency: usize,
        shards: ShardViews,
        fencing: Fencing,
    ) -> WriteQueue<V> {
        WriteQueue {
            what,
            state: SyncMutex::new(State {
                pending: HashMap::new(),
                ready: VecDeque::new(),
                in_flight: HashSet::new(),
                retries: BTreeMap::new(),
                failures: HashMap::new(),
                next_retry: 0,
            }),
            notify: Notify::new(),
            budget,
            concurrency: concurrency.max(1),
            shards,
            fencing,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State<V>> {
        lock(&self.state)
    }

    /// Queues `value` for `key`, folded into the value already waiting, if any.
    pub fn submit(&self, key: &str, value: V) {
        let mut guard = self.state();
        let state = &mut *guard;
        match state.pending.get_mut(key) {
            // Already ready, retrying or waiting for its write to end: it goes when that is.
            Some(waiting) => waiting.absorb(value),
            None => {
                state.pending.insert(key.to_owned(), value);
                if !state.in_flight.contains(key) && !state.failures.contains_key(key) {
                    state.ready.push_back(key.to_owned());
                }
            }
        }
        drop(guard);
        self.notify.notify_one();
    }

    /// Values waiting (ready or retrying; not those in flight).
    pub fn pending_len(&self) -> usize {
        self.state().pending.len()
    }

    /// Writes what is submitted with `writer` until `stop` fires.
    pub async fn run(&self, writer: impl StoreWrite<V>, mut stop: watch::Receiver<bool>) {
        let writer = &writer;
        let mut in_flight = FuturesUnordered::new();
        // A budget token reserved for the next write, usable once this sleep ends.
        let mut token: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
        loop {
            let now = Instant::now();
            let (can_start, next_retry) = {
                let mut state = self.state();
                state.release_due_retries(now);
                let can_start = !state.ready.is_empty() && in_flight.len() < self.concurrency;
                (can_start, state.retries.keys().next().map(|(at, _)| *at))
            };
            if can_start && token.is_none() {
                token = Some(Box::pin(tokio::time::sleep(self.budget.reserve(now))));
            }
            tokio::select! {
                _ = stop.changed() => return,
                Some((key, value, outcome)) = in_flight.next(), if !in_flight.is_empty() => {
                    self.finished(key, value, outcome);
                }
                _ = async { token.as_mut().expect("reserved").await }, if can_start => {
                    token = None;
                    if let Some((key, value, held)) = self.take_next() {
                        in_flight.push(async move {
                            let outcome = writer.write(&key, &value, held).await;
                            (key, value, outcome)
                        });
                    }
                }
                _ = self.notify.notified() => {}
                _ = tokio::time::sleep_until(next_retry.unwrap_or(now)), if next_retry.is_some() => {}
            }
        }
    }

    /// The next ready value, marked in flight, with the fence it is written under, if this
    /// gateway still acts for its cluster; one it does not is dropped (and the next one looked
    /// at).
    fn take_next(&self) -> Option<(String, V, Held)> {
        let mut state = self.state();
        while let Some(key) = state.ready.pop_front() {
            let Some(value) = state.pending.remove(&key) else {
                continue;
            };
            // Fenced: checked right before the write, never written nor acknowledged if not
            // ours (any more). A shard whose renewal is late (lapsed) is not lost yet: the
            // value waits for the next lease round rather than being dropped while its session
            // stays here.
            let now = Instant::now();
            let (held, lapsed, shard) = {
                let view = self.shards.borrow();
                (
                    view.held_for(value.cluster(), now),
                    view.lapsed(value.cluster(), now),
                    view.shard_of(value.cluster()),
                )
            };
            if held.is_none() && (lapsed || value.waits_for_shard()) {
                debug!(cluster = %value.cluster(), key = %key, what = self.what, lapsed,
                    "shard not held (its renewal late, or its source still here): write waits");
                state.pending.insert(key.clone(), value);
                let n = state.next_retry;
                state.next_retry += 1;
                state.retries.insert((now + LAPSE_RETRY, n), key);
                continue;
            }
            let Some(held) = held else {
                self.fencing
                    .not_held(self.what, value.cluster(), &key, shard);
                state.failures.remove(&key);
                continue;
            };
            state.in_flight.insert(key.clone());
            return Some((key, value, held));
        }
        None
    }

    /// A write of `key` ended with `outcome`.
    fn finished(&self, key: String, written: V, outcome: Outcome) {
        let mut state = self.state();
        let state = &mut *state;
        state.in_flight.remove(&key);
        match outcome {
            Outcome::Done | Outcome::Refused => {
                state.failures.remove(&key);
                if state.pending.contains_key(&key) {
                    state.ready.push_back(key);
                }
            }
            Outcome::Conflict | Outcome::Failed => {
                // The failed value again, with whatever arrived meanwhile folded in.
                let mut retry = written;
                if let Some(newer) = state.pending.remove(&key) {
                    retry.absorb(newer);
                }
                state.pending.insert(key.clone(), retry);
                if outcome == Outcome::Conflict {
                    state.ready.push_back(key);
                    return;
                }
                let failures = state.failures.entry(key.clone()).or_insert(0);
                *failures += 1;
                let delay = retry_delay(*failures);
                debug!(key = %key, what = self.what, failures = *failures, ?delay, "write failed; retrying");
                let n = state.next_retry;
                state.next_retry += 1;
                state.retries.insert((Instant::now() + delay, n), key);
            }
        }
    }
}

impl<V> State<V> {
    /// Moves the keys whose retry is due to the ready queue.
    fn release_due_retries(&mut self, now: Instant) {
        while let Some(entry) = self.retries.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let key = entry.remove();
            if self.pending.contains_key(&key) {
                self.ready.push_back(key);
            }
        }
    }
}

/// The delay before the retry after `failures` consecutive failures of one key.
fn retry_delay(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    (FIRST_RETRY_DELAY * 2u32.pow(doublings)).min(MAX_RETRY_DELAY)
}

#[cfg(test)]
mod tests {
    //! The queue against a store stub whose writes take simulated time (tokio's paused clock)
    //! and fail when told to.

    use super::*;
    use crate::shards::{Fence, ShardDirectory, ShardView};
    use std::collections::BTreeMap as Map;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A value: a sequence number (the newest wins) for a cluster.
    #[derive(Clone, Debug, PartialEq)]
    struct Seq {
        cluster: String,
        seq: u64,
    }

    impl Coalesce for Seq {
        fn cluster(&self) -> &str {
            &self.cluster
        }
        fn absorb(&mut self, newer: Seq) {
            if newer.seq > self.seq {
                *self = newer;
            }
        }
    }

    fn seq(seq: u64) -> Seq {
        Seq {
            cluster: "store-1".into(),
            seq,
        }
    }

    /// What the stub store saw.
    #[derive(Default)]
    struct Seen {
        /// Every write, in the order they started: (key, seq).
        writes: Vec<(String, u64)>,
        in_flight: HashSet<String>,
        most_in_flight: usize,
        /// Keys written while a write of theirs was in flight.
        doubled: Vec<String>,
        /// Keys (with the seq) whose next write fails, once per entry.
        fail: Vec<(String, u64)>,
        /// Keys (with the seq) whose writes the store refuses.
        refuse: Vec<(String, u64)>,
    }

    #[derive(Clone)]
    struct Stub {
        seen: Arc<SyncMutex<Seen>>,
        takes: Duration,
    }

    impl Stub {
        fn new(takes: Duration) -> Stub {
            Stub {
                seen: Arc::default(),
                takes,
            }
        }
        fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
            lock(&self.seen)
        }
    }

    impl StoreWrite<Seq> for Stub {
        async fn write(&self, key: &str, value: &Seq, _held: Held) -> Outcome {
            let (fails, refused) = {
                let mut seen = self.seen();
                seen.writes.push((key.to_owned(), value.seq));
                if !seen.in_flight.insert(key.to_owned()) {
                    seen.doubled.push(key.to_owned());
                }
                seen.most_in_flight = seen.most_in_flight.max(seen.in_flight.len());
                let failing = (key.to_owned(), value.seq);
                let refused = seen.refuse.contains(&failing);
                let fails = match seen.fail.iter().position(|f| *f == failing) {
                    Some(i) => {
                        seen.fail.remove(i);
                        true
                    }
                    None => false,
                };
                (fails, refused)
            };
            tokio::time::sleep(self.takes).await;
            self.seen().in_flight.remove(key);
            if refused {
                Outcome::Refused
            } else if fails {
                Outcome::Failed
            } else {
                Outcome::Done
            }
        }
    }

    fn all_shards() -> ShardViews {
        watch::channel(Arc::new(ShardView::all(64))).1
    }

    fn queue(rate: u32, burst: u32, concurrency: usize) -> Arc<WriteQueue<Seq>> {
        let budget = Arc::new(WriteBudget::new(f64::from(rate), burst));
        Arc::new(WriteQueue::new(
            "test",
            budget,
            concurrency,
            all_shards(),
            Fencing::default(),
        ))
    }

    /// Runs `queue` with `stub` in a task; stops it when the returned sender drops.
    fn start(queue: &Arc<WriteQueue<Seq>>, stub: &Stub) -> watch::Sender<bool> {
        let (stop_tx, stop) = watch::channel(false);
        let (queue, stub) = (queue.clone(), stub.clone());
        tokio::spawn(async move { queue.run(stub, stop).await });
        stop_tx
    }

    /// Lets simulated time pass in steps, so the queue's task runs at each.
    async fn pass(d: Duration) {
        let step = Duration::from_millis(1);
        let until = Instant::now() + d;
        while Instant::now() < until {
            tokio::time::sleep(step).await;
        }
    }

    /// Writes of many works overlap up to the bound and never beyond it, and never two of one
    /// work at once, however its values keep coming.
    #[tokio::test(start_paused = true)]
    async fn at_most_n_in_flight_and_never_two_of_one_key() {
        let queue = queue(100_000, 100_000, 8);
        let stub = Stub::new(Duration::from_millis(20));
        let _stop = start(&queue, &stub);
        for round in 1..=5 {
            for work in 0..40 {
                queue.submit(&format!("w{work}"), seq(round));
            }
            pass(Duration::from_millis(7)).await;
        }
        pass(Duration::from_secs(2)).await;
        let seen = stub.seen();
        assert_eq!(seen.most_in_flight, 8, "the bound is reached, never passed");
        assert!(seen.doubled.is_empty(), "doubled: {:?}", seen.doubled);
        // Each work's writes in the order its values came, ending with the newest.
        for work in 0..40 {
            let key = format!("w{work}");
            let seqs: Vec<u64> = seen
                .writes
                .iter()
                .filter(|(k, _)| *k == key)
                .map(|(_, s)| *s)
                .collect();
            assert!(seqs.is_sorted(), "{key}: {seqs:?}");
            assert_eq!(seqs.last(), Some(&5), "{key}: {seqs:?}");
        }
        assert_eq!(queue.pending_len(), 0);
    }

    /// A burst of 100 statuses of one work costs at most two writes (the first, already in
    /// flight, and the newest), whatever the concurrency.
    #[tokio::test(start_paused = true)]
    async fn a_burst_of_one_key_costs_at_most_two_writes() {
        let queue = queue(1000, 1000, 16);
        let stub = Stub::new(Duration::from_millis(5));
        let _stop = start(&queue, &stub);
        queue.submit("w", seq(1));
        tokio::task::yield_now().await;
        for s in 2..=100 {
            queue.submit("w", seq(s));
        }
        pass(Duration::from_secs(1)).await;
        let seen = stub.seen();
        assert!(seen.writes.len() <= 2, "{:?}", seen.writes);
        assert_eq!(seen.writes.last(), Some(&("w".into(), 100)));
    }

    /// Over a simulated second the store sees at most rate + burst writes, and the budget is
    /// used (the writes are not held back further).
    #[tokio::test(start_paused = true)]
    async fn writes_keep_within_the_budget() {
        let queue = queue(100, 20, 16);
        let stub = Stub::new(Duration::from_millis(2));
        let _stop = start(&queue, &stub);
        for work in 0..1000 {
            queue.submit(&format!("w{work}"), seq(1));
        }
        let mut written_by = Vec::new();
        for _ in 0..4 {
            pass(Duration::from_millis(250)).await;
            written_by.push(stub.seen().writes.len());
        }
        // t = 1 s: rate·1 + burst.
        assert!(written_by[3] <= 120, "{written_by:?}");
        assert!(written_by[3] >= 110, "the budget is used: {written_by:?}");
        for (quarter, written) in written_by.iter().enumerate() {
            let bound = 25 * (quarter + 1) + 20;
            assert!(*written <= bound, "{written_by:?}");
        }
    }

    /// Two queues sharing one budget together keep within it.
    #[tokio::test(start_paused = true)]
    async fn queues_share_the_gateway_budget() {
        let budget = Arc::new(WriteBudget::new(50.0, 10));
        let queues: Vec<Arc<WriteQueue<Seq>>> = (0..2)
            .map(|_| {
                Arc::new(WriteQueue::new(
                    "test",
                    budget.clone(),
                    16,
                    all_shards(),
                    Fencing::default(),
                ))
            })
            .collect();
        let stub = Stub::new(Duration::from_millis(1));
        let _stops: Vec<_> = queues.iter().map(|q| start(q, &stub)).collect();
        for (i, q) in queues.iter().enumerate() {
            for work in 0..200 {
                q.submit(&format!("q{i}-w{work}"), seq(1));
            }
        }
        pass(Duration::from_secs(1)).await;
        let written = stub.seen().writes.len();
        assert!((55..=60).contains(&written), "{written} writes in 1 s");
    }

    /// A failed write is tried again after a delay, with the same value when nothing newer
    /// came, with the newer value when one did (the failed one is not written again).
    #[tokio::test(start_paused = true)]
    async fn a_failed_write_is_retried_unless_a_newer_value_arrived() {
        let queue = queue(1000, 1000, 4);
        let stub = Stub::new(Duration::from_millis(1));
        stub.seen().fail = vec![("a".into(), 1), ("b".into(), 1), ("b".into(), 2)];
        let _stop = start(&queue, &stub);
        queue.submit("a", seq(1));
        queue.submit("b", seq(1));
        pass(Duration::from_millis(100)).await;
        assert_eq!(
            stub.seen().writes,
            [("a".into(), 1), ("b".into(), 1)],
            "no retry before the delay"
        );
        // b's newer value arrives while it waits to retry: the retry writes it instead.
        queue.submit("b", seq(2));
        pass(FIRST_RETRY_DELAY).await;
        let mut retried = stub.seen().writes[2..].to_vec();
        retried.sort();
        assert_eq!(retried, [("a".into(), 1), ("b".into(), 2)]);
        // b failed twice: its next retry waits twice as long.
        pass(FIRST_RETRY_DELAY).await;
        assert_eq!(stub.seen().writes.len(), 4, "still backing off");
        pass(FIRST_RETRY_DELAY).await;
        assert_eq!(stub.seen().writes.last(), Some(&("b".into(), 2)));
        assert_eq!(stub.seen().writes.len(), 5);
        assert_eq!(queue.pending_len(), 0, "both stored in the end");
    }

    /// A newer value that arrives while a write is failing replaces the failed one in the
    /// retry: the failed value is not written again.
    #[tokio::test(start_paused = true)]
    async fn a_value_newer_than_a_failing_write_is_what_the_retry_writes() {
        let queue = queue(1000, 1000, 4);
        let stub = Stub::new(Duration::from_millis(50));
        stub.seen().fail = vec![("c".into(), 1)];
        let _stop = start(&queue, &stub);
        queue.submit("c", seq(1));
        pass(Duration::from_millis(10)).await;
        assert_eq!(stub.seen().in_flight.len(), 1, "c's first write in flight");
        queue.submit("c", seq(2));
        pass(FIRST_RETRY_DELAY + Duration::from_millis(200)).await;
        assert_eq!(stub.seen().writes, [("c".into(), 1), ("c".into(), 2)]);
        assert_eq!(queue.pending_len(), 0);
    }

    /// A value of a cluster whose shard this gateway no longer holds is dropped at the
    /// fence: never written; values of the shards it holds still are.
    #[tokio::test(start_paused = true)]
    async fn fencing_drops_what_is_no_longer_ours() {
        let (views_tx, views) = watch::channel(Arc::new(ShardView::all(64)));
        let budget = Arc::new(WriteBudget::new(1000.0, 1000));
        let fencing = Fencing::default();
        let queue = Arc::new(WriteQueue::new("test", budget, 4, views, fencing.clone()));
        let ours = "store-1";
        let shard = ShardView::all(64).shard_of(ours);
        let theirs = (0..)
            .map(|i| format!("store-{i}"))
            .find(|c| ShardView::all(64).shard_of(c) != shard)
            .unwrap();
        let fences = Map::from([(
            shard,
            Fence {
                epoch: 1,
                valid_until: Instant::now() + Duration::from_secs(3600),
            },
        )]);
        views_tx.send_replace(Arc::new(ShardView::leased(
            64,
            fences,
            ShardDirectory::default(),
        )));
        let stub = Stub::new(Duration::from_millis(1));
        let _stop = start(&queue, &stub);
        let value = |cluster: &str| Seq {
            cluster: cluster.into(),
            seq: 1,
        };
        queue.submit("theirs", value(&theirs));
        queue.submit("ours", value(ours));
        pass(Duration::from_millis(100)).await;
        assert_eq!(stub.seen().writes, [("ours".into(), 1)]);
        assert_eq!(queue.pending_len(), 0, "dropped, not kept");
        assert_eq!(fencing.dropped().count("not_held"), 1, "counted");
    }

    /// A write the store refused (the object holds something newer) is dropped, never
    /// retried; a value submitted meanwhile is still written after it.
    #[tokio::test(start_paused = true)]
    async fn a_refused_write_is_dropped_not_retried() {
        let queue = queue(1000, 1000, 4);
        let stub = Stub::new(Duration::from_millis(50));
        stub.seen().refuse = vec![("r".into(), 1), ("s".into(), 1)];
        let _stop = start(&queue, &stub);
        queue.submit("r", seq(1));
        queue.submit("s", seq(1));
        pass(Duration::from_millis(10)).await;
        queue.submit("s", seq(2));
        pass(MAX_RETRY_DELAY * 2).await;
        let mut writes = stub.seen().writes.clone();
        writes.sort();
        assert_eq!(
            writes,
            [("r".into(), 1), ("s".into(), 1), ("s".into(), 2)],
            "r once, s's newer value after its refusal"
        );
        assert_eq!(queue.pending_len(), 0);
    }

    /// A value whose shard's fence ran out while the renewal is late waits for the next lease
    /// round instead of being dropped: renewed, it is written; its shard lost, it is dropped.
    #[tokio::test(start_paused = true)]
    async fn a_lapsed_fence_delays_a_write_and_a_renewal_lets_it_through() {
        let ours = "store-1";
        let shard = ShardView::all(64).shard_of(ours);
        let view = |valid_for: Option<Duration>| {
            let fences = valid_for
                .map(|d| {
                    Map::from([(
                        shard,
                        Fence {
                            epoch: 1,
                            valid_until: Instant::now() + d,
                        },
                    )])
                })
                .unwrap_or_default();
            Arc::new(ShardView::leased(64, fences, ShardDirectory::default()))
        };
        let (views_tx, views) = watch::channel(view(Some(Duration::ZERO)));
        let budget = Arc::new(WriteBudget::new(1000.0, 1000));
        let queue = Arc::new(WriteQueue::new(
            "test",
            budget,
            4,
            views,
            Fencing::default(),
        ));
        let stub = Stub::new(Duration::from_millis(1));
        let _stop = start(&queue, &stub);
        let value = |seq| Seq {
            cluster: ours.into(),
            seq,
        };
        queue.submit("late", value(1));
        pass(Duration::from_secs(2)).await;
        assert!(stub.seen().writes.is_empty(), "not written while lapsed");
        assert_eq!(queue.pending_len(), 1, "kept while lapsed");
        views_tx.send_replace(view(Some(Duration::from_secs(3600))));
        pass(Duration::from_secs(1)).await;
        assert_eq!(stub.seen().writes, [("late".into(), 1)], "renewed: written");

        views_tx.send_replace(view(Some(Duration::ZERO)));
        queue.submit("late", value(2));
        pass(Duration::from_secs(1)).await;
        views_tx.send_replace(view(None));
        pass(Duration::from_secs(1)).await;
        assert_eq!(stub.seen().writes.len(), 1, "lost: never written");
        assert_eq!(queue.pending_len(), 0, "lost: dropped");
    }

    /// A value whose source is still here waits while its shard is held elsewhere, and is
    /// written once this gateway takes the shard back under a newer epoch; once its source is
    /// gone it is dropped like any other.
    #[tokio::test(start_paused = true)]
    async fn a_value_whose_source_stays_waits_for_its_shard_to_come_back() {
        #[derive(Clone, Debug)]
        struct Sourced {
            cluster: String,
            seq: u64,
            source: Arc<AtomicBool>,
        }
        impl Coalesce for Sourced {
            fn cluster(&self) -> &str {
                &self.cluster
            }
            fn absorb(&mut self, newer: Sourced) {
                *self = newer;
            }
            fn waits_for_shard(&self) -> bool {
                self.source.load(Ordering::SeqCst)
            }
        }
        #[derive(Clone, Default)]
        struct Epochs(Arc<SyncMutex<Vec<(u64, u32)>>>);
        impl StoreWrite<Sourced> for Epochs {
            async fn write(&self, _key: &str, value: &Sourced, held: Held) -> Outcome {
                lock(&self.0).push((value.seq, held.epoch));
                Outcome::Done
            }
        }

        let ours = "store-1";
        let shard = ShardView::all(64).shard_of(ours);
        let view = |epoch: Option<u32>| {
            let fences = epoch
                .map(|epoch| {
                    Map::from([(
                        shard,
                        Fence {
                            epoch,
                            valid_until: Instant::now() + Duration::from_secs(3600),
                        },
                    )])
                })
                .unwrap_or_default();
            Arc::new(ShardView::leased(64, fences, ShardDirectory::default()))
        };
        let (views_tx, views) = watch::channel(view(None));
        let budget = Arc::new(WriteBudget::new(1000.0, 1000));
        let fencing = Fencing::default();
        let queue = Arc::new(WriteQueue::new("test", budget, 4, views, fencing.clone()));
        let store = Epochs::default();
        let (_stop, stop) = watch::channel(false);
        tokio::spawn({
            let (queue, store) = (queue.clone(), store.clone());
            async move { queue.run(store, stop).await }
        });
        let source = Arc::new(AtomicBool::new(true));
        let value = |seq| Sourced {
            cluster: ours.into(),
            seq,
            source: source.clone(),
        };

        // The shard is another gateway's (its lease lost during an apiserver outage): the
        // value waits, however long, while its session is here.
        queue.submit("w", value(1));
        pass(Duration::from_secs(5)).await;
        assert!(lock(&store.0).is_empty(), "not written while not held");
        assert_eq!(queue.pending_len(), 1, "kept while its source is here");
        // Taken back under epoch 3: written under it.
        views_tx.send_replace(view(Some(3)));
        pass(Duration::from_secs(1)).await;
        assert_eq!(*lock(&store.0), [(1, 3)], "written under the new epoch");

        // Lost again, and the session leaves: dropped, counted, never written.
        views_tx.send_replace(view(None));
        queue.submit("w", value(2));
        pass(Duration::from_secs(1)).await;
        assert_eq!(queue.pending_len(), 1);
        source.store(false, Ordering::SeqCst);
        pass(Duration::from_secs(1)).await;
        assert_eq!(queue.pending_len(), 0, "dropped once its source is gone");
        assert_eq!(fencing.dropped().count("not_held"), 1);
        views_tx.send_replace(view(Some(4)));
        pass(Duration::from_secs(1)).await;
        assert_eq!(
            lock(&store.0).len(),
            1,
            "the dropped value is never written"
        );
    }

    #[test]
    fn retry_delays_grow_and_are_bounded() {
        let delays: Vec<Duration> = (1..=8).map(retry_delay).collect();
        assert_eq!(delays[0], FIRST_RETRY_DELAY);
        assert_eq!(delays[1], FIRST_RETRY_DELAY * 2);
        assert!(delays.is_sorted());
        assert_eq!(delays[7], MAX_RETRY_DELAY);
        assert_eq!(retry_delay(u32::MAX), MAX_RETRY_DELAY);
    }
}
