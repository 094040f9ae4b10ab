//! The content of large works, fetched chunk by chunk over the agent's session: which works
//! wait for chunks, which chunks are asked for, which arrived, and which transfer of a work is
//! its latest. Part of [`AgentSession`](super::AgentSession), which turns its requests into
//! frames; no IO, time passed in.
//!
//! One transfer per large work, in two steps:
//!
//! 1. **Recording.** The work's frame arrived naming its content's chunks; the driver records
//!    the transfer in its durable cache and finds which chunks it already holds
//!    ([`AgentEvent::ContentWanted`](super::AgentEvent::ContentWanted), answered with
//!    [`AgentSession::content_missing`](super::AgentSession::content_missing)). Each frame
//!    starts a transfer of its own, numbered: an answer for an older frame of the same work (one
//!    replaced or deleted since) is not used.
//! 2. **Fetching.** The chunks still missing are asked for, at most [`CHUNK_WINDOW`] at a time;
//!    each that arrives is stored durably by the driver
//!    ([`AgentSession::chunk_stored`](super::AgentSession::chunk_stored)), and once none is
//!    missing the work itself is stored
//!    ([`AgentEvent::ContentHeld`](super::AgentEvent::ContentHeld)).
//!
//! The rule that keeps a transfer from stalling: **every chunk a transfer misses is wanted,
//! asked for, being stored, or due to be asked again**, whatever happens to a request. A
//! refusal, a chunk the driver could not store, a work replaced or deleted mid-transfer, or a
//! chunk two works share touches only the chunks it concerns: a refused chunk is asked again
//! after a delay that doubles up to [`CHUNK_RETRY_MAX`] (the hub refuses a chunk it cannot
//! read now: its apiserver timed out, its cache has not seen the work yet), never left until
//! the next session, which for an agent on a healthy link may be weeks away; the other chunks
//! keep flowing meanwhile. A session that ends takes its requests with it: the next one asks
//! for what its cache still misses.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use super::CHUNK_WINDOW;
use crate::api::ManifestWork;
use crate::api::content::ContentRef;
use crate::wire;

/// The first delay before a refused chunk is asked for again; each refusal of it in a row
/// doubles it.
pub const CHUNK_RETRY_INITIAL: Duration = Duration::from_secs(1);
/// The longest delay before a refused chunk is asked for again: a chunk the hub cannot serve
/// for good (its ManifestChunk deleted) costs the hub one read a minute.
pub const CHUNK_RETRY_MAX: Duration = Duration::from_secs(60);

/// What a work frame asks of the driver.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Received {
    /// A work whose manifests are inline: store it now.
    Store(wire::WorkUpdate),
    /// A large work: record the transfer of `content` and say what is missing.
    Record {
        /// The work's uid.
        uid: String,
        /// Its content.
        content: ContentRef,
        /// Which frame started the transfer.
        transfer: u64,
    },
}

/// A large work waiting for its content.
#[derive(Debug)]
enum Transfer {
    /// The driver is recording the transfer and finding what is missing.
    Recording {
        work: wire::WorkUpdate,
        /// The chunks the content names.
        chunks: HashSet<String>,
        /// Which frame started it.
        transfer: u64,
        /// Chunks of it stored durably while it was being recorded: the cache may have
        /// answered before they landed.
        arrived: HashSet<String>,
    },
    /// Chunks not held yet.
    Fetching {
        work: wire::WorkUpdate,
        missing: HashSet<String>,
    },
}

/// The chunk bookkeeping of one session.
#[derive(Debug, Default)]
pub(super) struct ContentFetch {
    /// Work frames seen this session: each transfer is numbered by the frame that started it.
    frames: u64,
    /// Large works whose content is on the way, by uid (ordered, so requests are repeatable).
    transfers: BTreeMap<String, Transfer>,
    /// Chunks to ask for, in the order found missing, each once. A digest no transfer misses
    /// any more (its work replaced or deleted) is passed over when its turn comes.
    wanted: VecDeque<String>,
    /// Asked for and not answered: digest → the work named in the request.
    in_flight: HashMap<String, String>,
    /// Arrived and handed to the driver to store, not yet confirmed durable.
    storing: HashSet<String>,
    /// Refused or not stored: when each is asked for again.
    retry_at: HashMap<String, Instant>,
    /// Refusals (and failed stores) of each chunk in a row; the retry delay doubles with each.
    failures: HashMap<String, u32>,
    /// Works the hub sent in this session: after the sync, a transfer recorded for any other
    /// (cut off before a restart, its work deleted meanwhile) can be given up.
    received: HashSet<String>,
}

impl ContentFetch {
    /// A work frame arrived. A large work starts a transfer (replacing any earlier one of the
    /// same work); any other ends the work's transfer, if it had one.
    pub(super) fn work_received(&mut self, work: wire::WorkUpdate) -> Received {
        self.frames += 1;
        self.received.insert(work.uid.clone());
        let Some(content) = content_of(&work) else {
            self.transfers.remove(&work.uid);
            return Received::Store(work);
        };
        let uid = work.uid.clone();
        self.transfers.insert(
            uid.clone(),
            Transfer::Recording {
                work,
                chunks: content.chunks.iter().cloned().collect(),
                transfer: self.frames,
                arrived: HashSet::new(),
            },
        );
        Received::Record {
            uid,
            content,
            transfer: self.frames,
        }
    }

    /// The hub deleted the work: its transfer, if any, ends. Chunks only it missed are not
    /// asked for any more.
    pub(super) fn work_deleted(&mut self, uid: &str) {
        self.received.remove(uid);
        self.transfers.remove(uid);
    }

    /// The driver recorded transfer `transfer` of `uid`, and its cache lacks `missing`. Returns
    /// the work when nothing is missing (store it now); ignored for a transfer replaced since.
    pub(super) fn recorded(
        &mut self,
        uid: &str,
        transfer: u64,
        missing: Vec<String>,
    ) -> Option<wire::WorkUpdate> {
        if !self.is_latest(uid, transfer) {
            return None;
        }
        let Some(Transfer::Recording { work, arrived, .. }) = self.transfers.remove(uid) else {
            unreachable!("matched above");
        };
        // In the content's order, so a transfer goes (and resumes) from its first chunk on.
        let missing: Vec<String> = missing
            .into_iter()
            .filter(|sha| !arrived.contains(sha))
            .collect();
        if missing.is_empty() {
            return Some(work);
        }
        for sha in &missing {
            self.want(sha);
        }
        let missing = missing.into_iter().collect();
        self.transfers
            .insert(uid.to_string(), Transfer::Fetching { work, missing });
        None
    }

    /// The driver could not record transfer `transfer` of `uid`: it is given up for this
    /// session (the work is not acked, so the next session's sync sends it again).
    pub(super) fn not_recorded(&mut self, uid: &str, transfer: u64) {
        if self.is_latest(uid, transfer) {
            self.transfers.remove(uid);
        }
    }

    /// Whether a chunk with this digest was asked for and not answered.
    pub(super) fn is_in_flight(&self, sha: &str) -> bool {
        self.in_flight.contains_key(sha)
    }

    /// A chunk asked for arrived (its digest checked); the driver stores it.
    pub(super) fn arrived(&mut self, sha: &str) {
        if self.in_flight.remove(sha).is_some() {
            self.storing.insert(sha.to_string());
        }
    }

    /// The chunk is durable in the driver's cache. Returns the works whose content is now
    /// complete (store each).
    pub(super) fn stored(&mut self, sha: &str) -> Vec<wire::WorkUpdate> {
        self.storing.remove(sha);
        self.failures.remove(sha);
        let mut complete = Vec::new();
        for (uid, transfer) in &mut self.transfers {
            match transfer {
                Transfer::Recording {
                    chunks, arrived, ..
                } if chunks.contains(sha) => {
                    arrived.insert(sha.to_string());
                }
                Transfer::Fetching { missing, .. } => {
                    missing.remove(sha);
                    if missing.is_empty() {
                        complete.push(uid.clone());
                    }
                }
                Transfer::Recording { .. } => {}
            }
        }
        complete
            .into_iter()
            .filter_map(|uid| match self.transfers.remove(&uid) {
                Some(Transfer::Fetching { work, .. }) => Some(work),
                _ => None,
            })
            .collect()
    }

    /// The driver could not store the chunk (a cache error, or its cache no longer names
    /// it): if a transfer still misses it, it is asked for again after a delay. Returns the
    /// delay.
    pub(super) fn not_stored(&mut self, now: Instant, sha: &str) -> Option<Duration> {
        self.storing.remove(sha);
        self.retry_later(now, sha)
    }

    /// The hub refused the request for the chunk. If a transfer still misses it, it is asked
    /// for again after a delay (returned); the other chunks keep their turns meanwhile. When
    /// the work the request named no longer misses it (replaced or deleted since) but another
    /// does, the refusal was about that work, not the chunk: it is asked for again at once,
    /// in the other's name. Ignored (`None`) for a chunk not asked for.
    pub(super) fn refused(&mut self, now: Instant, sha: &str) -> Option<Duration> {
        let named = self.in_flight.remove(sha)?;
        self.missed_by(sha)?;
        if !self.misses(&named, sha) {
            self.want(sha);
            return Some(Duration::ZERO);
        }
        self.retry_later(now, sha)
    }

    fn retry_later(&mut self, now: Instant, sha: &str) -> Option<Duration> {
        self.missed_by(sha)?;
        let failures = self.failures.entry(sha.to_string()).or_default();
        *failures += 1;
        let delay = CHUNK_RETRY_INITIAL
            .checked_mul(1 << (*failures - 1).min(16))
            .unwrap_or(CHUNK_RETRY_MAX)
            .min(CHUNK_RETRY_MAX);
        self.retry_at.insert(sha.to_string(), now + delay);
        Some(delay)
    }

    /// Chunks due to be asked for again go back in line.
    pub(super) fn handle_timeout(&mut self, now: Instant) {
        let due: Vec<String> = self
            .retry_at
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(sha, _)| sha.clone())
            .collect();
        for sha in due {
            self.retry_at.remove(&sha);
            self.want(&sha);
        }
    }

    /// When the next refused chunk is due to be asked for again.
    pub(super) fn poll_timeout(&self) -> Option<Instant> {
        self.retry_at.values().min().copied()
    }

    /// The next chunk to ask for, and the work to name in the request, while the window has
    /// room. Each is counted in flight until its answer arrives.
    pub(super) fn next_request(&mut self) -> Option<(String, String)> {
        while self.in_flight.len() < CHUNK_WINDOW {
            let sha = self.wanted.pop_front()?;
            // Replaced, deleted, or held since it was wanted: its turn passes.
            let Some(uid) = self.missed_by(&sha) else {
                continue;
            };
            let uid = uid.to_string();
            self.in_flight.insert(sha.clone(), uid.clone());
            return Some((uid, sha));
        }
        None
    }

    /// Chunks missing from transfers under way, asked for or not.
    pub(super) fn missing(&self) -> usize {
        let mut missing = HashSet::new();
        for transfer in self.transfers.values() {
            if let Transfer::Fetching { missing: m, .. } = transfer {
                missing.extend(m.iter());
            }
        }
        missing.len()
    }

    /// Works the hub sent in this session, by uid.
    pub(super) fn received(&self) -> Vec<String> {
        let mut received: Vec<String> = self.received.iter().cloned().collect();
        received.sort();
        received
    }

    /// Queues `sha` unless it is already queued, asked for, being stored, or waiting for its
    /// retry.
    fn want(&mut self, sha: &str) {
        let known = self.in_flight.contains_key(sha)
            || self.storing.contains(sha)
            || self.retry_at.contains_key(sha)
            || self.wanted.iter().any(|s| s == sha);
        if !known {
            self.wanted.push_back(sha.to_string());
        }
    }

    /// Whether transfer `transfer` is the latest of `uid` and still waits for the cache's
    /// answer.
    pub(super) fn is_latest(&self, uid: &str, transfer: u64) -> bool {
        matches!(self.transfers.get(uid),
            Some(Transfer::Recording { transfer: latest, .. }) if *latest == transfer)
    }

    /// Whether `uid`'s transfer misses `sha`.
    fn misses(&self, uid: &str, sha: &str) -> bool {
        matches!(self.transfers.get(uid),
            Some(Transfer::Fetching { missing, .. }) if missing.contains(sha))
    }

    /// The first work (by uid) whose transfer misses `sha`.
    fn missed_by(&self, sha: &str) -> Option<&str> {
        self.transfers
            .iter()
            .find_map(|(uid, transfer)| match transfer {
                Transfer::Fetching { missing, .. } if missing.contains(sha) => Some(uid.as_str()),
                _ => None,
            })
    }
}

/// The content reference of a work update, if its manifests are chunked and the reference is
/// well formed (a malformed one is stored as is and refused by the agent's reconciler, which
/// says why).
fn content_of(work: &wire::WorkUpdate) -> Option<ContentRef> {
    let parsed: ManifestWork = serde_json::from_slice(&work.manifest_work_json).ok()?;
    ContentRef::of(&parsed)?.ok()
}

#[cfg(test)]
mod tests {
    //! The bookkeeping alone, on a virtual clock; `tests/session_chunks.rs` runs it inside
    //! both session machines with a paced hub.

    use super::*;
    use crate::api::content::{CHUNK_BYTES, sha256_hex};

    const SECOND: Duration = Duration::from_secs(1);

    /// A large work `uid` at `generation` whose content is the chunks `shas`.
    fn large(uid: &str, generation: i64, shas: &[String]) -> wire::WorkUpdate {
        let reference = ContentRef {
            sha256: sha256_hex(shas.concat().as_bytes()),
            bytes: (shas.len() * CHUNK_BYTES) as u64,
            chunks: shas.to_vec(),
        };
        let work = serde_json::json!({
            "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
            "metadata": {"name": uid, "namespace": "c1", "uid": uid, "generation": generation},
            "spec": {"workload": {"manifests": [reference.manifest().0]}},
        });
        wire::WorkUpdate {
            uid: uid.into(),
            namespace: "c1".into(),
            name: uid.into(),
            generation,
            content_hash: format!("{uid}-{generation}"),
            manifest_work_json: serde_json::to_vec(&work).unwrap(),
            kind: String::new(),
        }
    }

    fn shas(tag: &str, n: usize) -> Vec<String> {
        (0..n)
            .map(|i| sha256_hex(format!("{tag}{i}").as_bytes()))
            .collect()
    }

    /// Records a received large work with `missing` as the cache's answer; its transfer number.
    fn start(fetch: &mut ContentFetch, work: wire::WorkUpdate, missing: &[String]) -> u64 {
        let uid = work.uid.clone();
        let Received::Record { transfer, .. } = fetch.work_received(work) else {
            panic!("a large work is recorded first");
        };
        assert_eq!(fetch.recorded(&uid, transfer, missing.to_vec()), None);
        transfer
    }

    fn requests(fetch: &mut ContentFetch) -> Vec<String> {
        std::iter::from_fn(|| fetch.next_request())
            .map(|(_, sha)| sha)
            .collect()
    }

    #[test]
    fn a_work_with_inline_manifests_is_stored_at_once_and_ends_an_earlier_transfer() {
        let mut fetch = ContentFetch::default();
        let chunks = shas("a", 3);
        start(&mut fetch, large("w", 1, &chunks), &chunks);
        let inline = wire::WorkUpdate {
            manifest_work_json: br#"{"spec":{"workload":{"manifests":[]}}}"#.to_vec(),
            ..large("w", 2, &chunks)
        };
        assert!(matches!(fetch.work_received(inline), Received::Store(_)));
        assert!(
            requests(&mut fetch).is_empty(),
            "nothing is asked for the old content"
        );
        assert_eq!(fetch.missing(), 0);
    }

    #[test]
    fn the_answer_for_a_replaced_transfer_is_not_used() {
        let mut fetch = ContentFetch::default();
        let (old, new) = (shas("old", 2), shas("new", 2));
        let Received::Record {
            transfer: first, ..
        } = fetch.work_received(large("w", 1, &old))
        else {
            panic!()
        };
        start(&mut fetch, large("w", 2, &new), &new);
        assert_eq!(fetch.recorded("w", first, old.clone()), None);
        assert_eq!(
            requests(&mut fetch),
            new,
            "only the new content is asked for"
        );
    }

    #[test]
    fn chunks_stored_while_the_cache_was_recording_are_not_asked_for() {
        let mut fetch = ContentFetch::default();
        let chunks = shas("c", 3);
        let Received::Record { transfer, .. } = fetch.work_received(large("w", 1, &chunks)) else {
            panic!()
        };
        // A chunk of an earlier transfer lands after the cache read what it holds.
        fetch.stored(&chunks[0]);
        assert_eq!(fetch.recorded("w", transfer, chunks.clone()), None);
        assert_eq!(requests(&mut fetch), chunks[1..].to_vec());
    }

    #[test]
    fn a_chunk_two_works_miss_is_asked_for_once_and_completes_both() {
        let mut fetch = ContentFetch::default();
        let chunks = shas("s", 2);
        start(&mut fetch, large("a", 1, &chunks), &chunks);
        start(&mut fetch, large("b", 1, &chunks), &chunks);
        assert_eq!(requests(&mut fetch), chunks);
        for sha in &chunks {
            fetch.arrived(sha);
        }
        assert!(fetch.stored(&chunks[0]).is_empty());
        let done: Vec<String> = fetch
            .stored(&chunks[1])
            .into_iter()
            .map(|w| w.uid)
            .collect();
        assert_eq!(done, ["a", "b"]);
    }

    #[test]
    fn a_refused_chunk_waits_longer_each_time_up_to_the_cap() {
        let mut fetch = ContentFetch::default();
        let chunks = shas("r", 1);
        let mut now = Instant::now();
        start(&mut fetch, large("w", 1, &chunks), &chunks);
        let mut delays = Vec::new();
        for _ in 0..9 {
            assert_eq!(requests(&mut fetch), chunks);
            let delay = fetch.refused(now, &chunks[0]).expect("still missed");
            assert_eq!(fetch.poll_timeout(), Some(now + delay));
            fetch.handle_timeout(now + delay - Duration::from_millis(1));
            assert!(requests(&mut fetch).is_empty(), "not before its delay");
            now += delay;
            fetch.handle_timeout(now);
            delays.push(delay.as_secs());
        }
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(CHUNK_RETRY_MAX, Duration::from_secs(60));
        // It arrives at last: the work is complete.
        assert_eq!(requests(&mut fetch), chunks);
        fetch.arrived(&chunks[0]);
        assert_eq!(fetch.stored(&chunks[0]).len(), 1);
        assert_eq!(fetch.poll_timeout(), None);
    }

    #[test]
    fn a_chunk_the_cache_could_not_store_is_asked_for_again() {
        let mut fetch = ContentFetch::default();
        let chunks = shas("n", 2);
        let now = Instant::now();
        start(&mut fetch, large("w", 1, &chunks), &chunks);
        assert_eq!(requests(&mut fetch), chunks);
        fetch.arrived(&chunks[0]);
        assert_eq!(fetch.not_stored(now, &chunks[0]), Some(SECOND));
        fetch.handle_timeout(now + SECOND);
        assert_eq!(requests(&mut fetch), vec![chunks[0].clone()]);
        assert_eq!(fetch.missing(), 2);
    }

    #[test]
    fn a_refusal_in_the_name_of_a_deleted_work_asks_again_at_once_for_another() {
        let mut fetch = ContentFetch::default();
        let chunks = shas("d", 1);
        let now = Instant::now();
        start(&mut fetch, large("a", 1, &chunks), &chunks);
        start(&mut fetch, large("b", 1, &chunks), &chunks);
        assert_eq!(fetch.next_request(), Some(("a".into(), chunks[0].clone())));
        fetch.work_deleted("a");
        assert_eq!(fetch.refused(now, &chunks[0]), Some(Duration::ZERO));
        assert_eq!(fetch.next_request(), Some(("b".into(), chunks[0].clone())));
        // Deleted too: a refusal leaves nothing to ask for.
        fetch.work_deleted("b");
        assert_eq!(fetch.refused(now, &chunks[0]), None);
        assert_eq!(fetch.next_request(), None);
        assert_eq!(fetch.poll_timeout(), None);
    }

    #[test]
    fn no_more_than_the_window_is_asked_for() {
        let mut fetch = ContentFetch::default();
        let chunks = shas("w", 5);
        start(&mut fetch, large("w", 1, &chunks), &chunks);
        assert_eq!(requests(&mut fetch), chunks[..CHUNK_WINDOW].to_vec());
        fetch.arrived(&chunks[0]);
        assert_eq!(requests(&mut fetch), vec![chunks[2].clone()]);
        assert!(fetch.is_in_flight(&chunks[1]) && !fetch.is_in_flight(&chunks[0]));
    }
}
