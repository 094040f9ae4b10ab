//! The lifecycle of ManifestChunks: a chunk that no ManifestWork in its namespace names is
//! deleted once it has been unnamed for the grace period.
//!
//! `flotilla work create -f` stores a large work's chunks first, one after another, and the
//! work that names them last, so a chunk is unnamed for a while in every healthy create. The
//! grace period (`--chunk-grace-period`) bounds the pause between two steps of a create, not the
//! whole create: a chunk's grace counts from the latest of its creation, the last time the CLI
//! stored it again (a second work with the same content finds the chunk there and marks it with
//! [`STORED_AT_ANNOTATION`] before creating its work), the moment this controller saw the last
//! work naming it go, and the newest of these among the unnamed chunks of its namespace: while
//! a create keeps storing chunks, none of them is collected. (Counting each chunk on its own
//! made the grace a bound on the whole create, which grows with the work's size and the
//! operator's link: 8 chunks stored on a loaded machine took longer than a test's 3 s grace,
//! and the first ones were deleted before the work naming them existed.) A chunk named by any
//! work in its namespace, whatever that work's state, stays.
//!
//! The controller keeps two watch caches (ManifestWorks: only the chunks each one names;
//! ManifestChunks: when each one's grace starts) and decides nothing before the works have been
//! listed once: with no works known, every chunk would look unnamed. Each pass deletes at most
//! [`MAX_DELETES_PER_PASS`] chunks, each read again first (a chunk stored again since the
//! cache saw it is left alone), logs each deletion naming namespace and chunk, and counts it in
//! `flotilla_hub_chunks_collected_total`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use flotilla_ops::error_chain;
use flotilla_proto::api::Kind;
use flotilla_proto::api::content::{STORED_AT_ANNOTATION, chunk_object_name, named_chunk_digests};
use flotilla_store::reflect::{Reflector, reflect};
use flotilla_store::{Object, Store, StoreError, WatchEvent, name_of, namespace_of};
use jiff::{SignedDuration, Timestamp};
use prometheus_client::metrics::counter::Counter;
use serde_json::Value;
use tokio::sync::{Mutex, Notify, watch};
use tracing::{debug, info, warn};

/// Default of `flotilla-hub --chunk-grace-period`.
pub const DEFAULT_CHUNK_GRACE_PERIOD: &str = "5m";

/// Most chunks one pass deletes; the next pass follows at once when more are due.
pub const MAX_DELETES_PER_PASS: usize = 64;

/// Pause before trying again after a failed read or delete.
const RETRY: Duration = Duration::from_secs(5);
/// Longest single sleep: a clock that jumps is noticed within this.
const MAX_SLEEP: Duration = Duration::from_secs(60);

/// The chunk object names a ManifestWork's `ChunkedManifests` reference names (read loosely:
/// what looks named is kept).
pub fn named_chunks(work: &Value) -> Vec<String> {
    named_chunk_digests(work)
        .iter()
        .map(|sha| chunk_object_name(sha))
        .collect()
}

/// When a chunk object's grace starts by what it says itself: the later of its creation and
/// its [`STORED_AT_ANNOTATION`]. `None` when it says neither (then it counts from when it was
/// seen).
pub fn stored_at(chunk: &Value) -> Option<Timestamp> {
    let created = chunk
        .pointer("/metadata/creationTimestamp")
        .and_then(Value::as_str)
        .and_then(|t| t.parse::<Timestamp>().ok());
    let annotated = chunk
        .pointer("/metadata/annotations")
        .and_then(|a| a.get(STORED_AT_ANNOTATION))
        .and_then(Value::as_str)
        .and_then(|t| t.parse::<Timestamp>().ok());
    created.max(annotated)
}

/// (namespace, name) of an object.
type Key = (String, String);

fn key_of(object: &Value) -> Key {
    (
        namespace_of(object).unwrap_or_default().to_owned(),
        name_of(object).to_owned(),
    )
}

/// What the controller knows of the store.
#[derive(Default, Debug)]
pub struct Model {
    /// The chunked works: the chunk names each one's reference names.
    works: HashMap<Key, Vec<String>>,
    /// How many works in a namespace name a chunk: (namespace, chunk name) → count.
    named: HashMap<Key, usize>,
    /// Every chunk, and when its grace starts.
    chunks: BTreeMap<Key, Timestamp>,
    /// The works have been listed once: before that, nothing is unnamed for sure.
    works_listed: bool,
}

impl Model {
    /// A work as it now is (or gone, with `None`); chunks it stopped naming start their grace
    /// at `now`. Says whether the chunks it names changed (a status write changes nothing).
    pub fn set_work(&mut self, key: Key, names: Option<Vec<String>>, now: Timestamp) -> bool {
        let names = names.filter(|n| !n.is_empty());
        let before = match &names {
            Some(names) => self.works.insert(key.clone(), names.clone()),
            None => self.works.remove(&key),
        };
        if before == names {
            return false;
        }
        for name in names.iter().flatten() {
            *self.named.entry((key.0.clone(), name.clone())).or_default() += 1;
        }
        for name in before.into_iter().flatten() {
            let k = (key.0.clone(), name);
            if let Some(count) = self.named.get_mut(&k) {
                *count -= 1;
                if *count == 0 {
                    self.named.remove(&k);
                    if let Some(since) = self.chunks.get_mut(&k) {
                        *since = (*since).max(now);
                    }
                }
            }
        }
        true
    }

    /// Every work at once, from a list.
    pub fn replace_works(&mut self, works: &[Value], now: Timestamp) {
        let listed: HashMap<Key, Vec<String>> = works
            .iter()
            .map(|w| (key_of(w), named_chunks(w)))
            .filter(|(_, names)| !names.is_empty())
            .collect();
        let gone: Vec<Key> = self
            .works
            .keys()
            .filter(|k| !listed.contains_key(*k))
            .cloned()
            .collect();
        for key in gone {
            self.set_work(key, None, now);
        }
        for (key, names) in listed {
            self.set_work(key, Some(names), now);
        }
        self.works_listed = true;
    }

    /// A chunk as it now is.
    pub fn set_chunk(&mut self, chunk: &Value, now: Timestamp) {
        let since = stored_at(chunk).unwrap_or(now);
        let entry = self.chunks.entry(key_of(chunk)).or_insert(since);
        *entry = (*entry).max(since);
    }

    /// Every chunk at once, from a list.
    pub fn replace_chunks(&mut self, chunks: &[Value], now: Timestamp) {
        let listed: BTreeSet<Key> = chunks.iter().map(key_of).collect();
        self.chunks.retain(|k, _| listed.contains(k));
        for chunk in chunks {
            self.set_chunk(chunk, now);
        }
    }

    /// Whether any work in the chunk's namespace names it.
    pub fn is_named(&self, key: &Key) -> bool {
        self.named.contains_key(key)
    }

    /// When the grace of unnamed chunks in each namespace starts at the earliest: the newest
    /// start among them (a create under way there stores one after another).
    fn newest_unnamed(&self) -> HashMap<&str, Timestamp> {
        let mut newest: HashMap<&str, Timestamp> = HashMap::new();
        for (key, since) in &self.chunks {
            if !self.is_named(key) {
                let at = newest.entry(key.0.as_str()).or_insert(*since);
                *at = (*at).max(*since);
            }
        }
        newest
    }

    /// When an unnamed chunk's grace ends; `None` for a named or unknown one.
    pub fn grace_ends(&self, key: &Key, grace: SignedDuration) -> Option<Timestamp> {
        if self.is_named(key) {
            return None;
        }
        self.chunks.get(key)?;
        let since = self.newest_unnamed().get(key.0.as_str()).copied()?;
        Some(since.saturating_add(grace).unwrap_or(since))
    }

    /// The unnamed chunks whose grace has ended by `now` (at most `limit`, oldest first by
    /// key order), and when the next one's ends.
    pub fn due(
        &self,
        now: Timestamp,
        grace: SignedDuration,
        limit: usize,
    ) -> (Vec<Key>, Option<Timestamp>) {
        if !self.works_listed {
            return (Vec::new(), None);
        }
        let newest = self.newest_unnamed();
        let mut due = Vec::new();
        let mut next: Option<Timestamp> = None;
        for (key, since) in &self.chunks {
            if self.is_named(key) {
                continue;
            }
            let since = newest.get(key.0.as_str()).copied().unwrap_or(*since);
            let at = since.saturating_add(grace).unwrap_or(since);
            if at <= now {
                if due.len() < limit {
                    due.push(key.clone());
                } else {
                    // More are due than one pass deletes: the next pass comes at once.
                    next = Some(now);
                }
            } else {
                next = Some(next.map_or(at, |n| n.min(at)));
            }
        }
        (due, next)
    }
}

/// The shared model and its wake-up.
#[derive(Default)]
struct Shared {
    model: Mutex<Model>,
    changed: Notify,
}

/// Feeds the model from the ManifestWork watch.
struct Works(Arc<Shared>);
/// Feeds the model from the ManifestChunk watch.
struct Chunks(Arc<Shared>);

#[async_trait]
impl Reflector for Works {
    async fn replace(&self, items: Vec<Object>) {
        self.0
            .model
            .lock()
            .await
            .replace_works(&items, Timestamp::now());
        self.0.changed.notify_one();
    }

    async fn apply(&self, event: WatchEvent) {
        let now = Timestamp::now();
        let mut model = self.0.model.lock().await;
        let changed = match event {
            WatchEvent::Added(o) | WatchEvent::Modified(o) => {
                model.set_work(key_of(&o), Some(named_chunks(&o)), now)
            }
            WatchEvent::Deleted(o) => model.set_work(key_of(&o), None, now),
        };
        drop(model);
        // Most work events are status writes: they wake no pass.
        if changed {
            self.0.changed.notify_one();
        }
    }
}

#[async_trait]
impl Reflector for Chunks {
    async fn replace(&self, items: Vec<Object>) {
        self.0
            .model
            .lock()
            .await
            .replace_chunks(&items, Timestamp::now());
        self.0.changed.notify_one();
    }

    async fn apply(&self, event: WatchEvent) {
        let now = Timestamp::now();
        let mut model = self.0.model.lock().await;
        match event {
            WatchEvent::Added(o) | WatchEvent::Modified(o) => model.set_chunk(&o, now),
            WatchEvent::Deleted(o) => {
                model.chunks.remove(&key_of(&o));
            }
        }
        drop(model);
        self.0.changed.notify_one();
    }
}

/// Runs the controller until `stop` turns true (or its sender is dropped).
pub async fn run(
    store: Arc<dyn Store>,
    grace: Duration,
    collected: Counter,
    stop: watch::Receiver<bool>,
) {
    let shared = Arc::new(Shared::default());
    let works = tokio::spawn({
        let (store, feed, stop) = (Arc::clone(&store), Works(Arc::clone(&shared)), stop.clone());
        async move { reflect(Kind::ManifestWork, store.as_ref(), &feed, stop).await }
    });
    let chunks = tokio::spawn({
        let (store, feed, stop) = (
            Arc::clone(&store),
            Chunks(Arc::clone(&shared)),
            stop.clone(),
        );
        async move { reflect(Kind::ManifestChunk, store.as_ref(), &feed, stop).await }
    });
    let grace = SignedDuration::try_from(grace).unwrap_or(SignedDuration::MAX);
    collect(store.as_ref(), &shared, grace, &collected, stop).await;
    let _ = works.await;
    let _ = chunks.await;
}

/// Deletes what is due, pass after pass, until `stop`.
async fn collect(
    store: &dyn Store,
    shared: &Shared,
    grace: SignedDuration,
    collected: &Counter,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let now = Timestamp::now();
        let (due, next) = shared
            .model
            .lock()
            .await
            .due(now, grace, MAX_DELETES_PER_PASS);
        let mut failed = false;
        for (ns, name) in due {
            if *stop.borrow() {
                return;
            }
            match delete_if_unnamed(store, shared, &ns, &name, grace).await {
                Ok(true) => {
                    collected.inc();
                    shared.model.lock().await.chunks.remove(&(ns, name));
                }
                Ok(false) => {}
                Err(e) => {
                    warn!(chunk = %format!("{ns}/{name}"), error = %error_chain(&e), "cannot delete an unnamed ManifestChunk; retrying");
                    failed = true;
                }
            }
        }
        let sleep = match next {
            _ if failed => RETRY,
            Some(at) => Duration::try_from(at.duration_since(Timestamp::now()))
                .unwrap_or(Duration::ZERO)
                .min(MAX_SLEEP),
            None => MAX_SLEEP,
        };
        tokio::select! {
            _ = tokio::time::sleep(sleep) => {}
            _ = shared.changed.notified() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// Deletes the chunk if it is still unnamed and past its grace when read again. Whether it was
/// deleted (a chunk already gone counts as not).
async fn delete_if_unnamed(
    store: &dyn Store,
    shared: &Shared,
    ns: &str,
    name: &str,
    grace: SignedDuration,
) -> Result<bool, StoreError> {
    let Some(current) = store.get(Kind::ManifestChunk, Some(ns), name).await? else {
        shared
            .model
            .lock()
            .await
            .chunks
            .remove(&(ns.to_owned(), name.to_owned()));
        return Ok(false);
    };
    let key = (ns.to_owned(), name.to_owned());
    let mut model = shared.model.lock().await;
    if model.is_named(&key) {
        return Ok(false);
    }
    // Stored again since the cache saw it, or another chunk of its namespace stored since
    // the pass began: its grace starts again.
    let now = Timestamp::now();
    let fresh = stored_at(&current)
        .and_then(|at| at.saturating_add(grace).ok())
        .is_some_and(|at| at > now)
        || model.grace_ends(&key, grace).is_some_and(|at| at > now);
    if fresh {
        debug!(chunk = %format!("{ns}/{name}"), "stored again; its grace starts again");
        model.set_chunk(&current, Timestamp::now());
        return Ok(false);
    }
    drop(model);
    match store.delete(Kind::ManifestChunk, Some(ns), name).await {
        Ok(()) => {
            info!(namespace = %ns, chunk = %name, "ManifestChunk deleted: no ManifestWork in its namespace has named it for the grace period");
            Ok(true)
        }
        Err(StoreError::NotFound { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_proto::api::content::{CONTENT_KIND, Chunk, chunk_object, sha256_hex};
    use flotilla_store::SledStore;
    use serde_json::json;

    const A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

    fn work(ns: &str, name: &str, chunks: &[&str]) -> Value {
        json!({"apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
            "metadata": {"namespace": ns, "name": name},
            "spec": {"workload": {"manifests": [{
                "apiVersion": "work.flotilla.io/v1alpha1", "kind": CONTENT_KIND,
                "metadata": {"name": "sha256-c"},
                "content": {"sha256": "c", "bytes": 1, "chunks": chunks}}]}}})
    }

    fn chunk(ns: &str, sha: &str, created: &str) -> Value {
        json!({"metadata": {"namespace": ns, "name": chunk_object_name(sha), "creationTimestamp": created}})
    }

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn names(due: &[Key]) -> Vec<String> {
        due.iter().map(|(ns, n)| format!("{ns}/{n}")).collect()
    }

    #[test]
    fn a_chunk_is_due_only_unnamed_past_its_grace_and_only_in_its_namespace() {
        let grace = SignedDuration::from_mins(5);
        let mut m = Model::default();
        let t0 = at("2026-01-01T00:00:00Z");
        m.replace_chunks(
            &[
                chunk("c1", A, "2026-01-01T00:00:00Z"),
                chunk("c1", B, "2026-01-01T00:00:00Z"),
                chunk("c2", A, "2026-01-01T00:00:00Z"),
            ],
            t0,
        );
        // Nothing before the works are listed, however old.
        assert!(m.due(at("2026-02-01T00:00:00Z"), grace, 10).0.is_empty());
        m.replace_works(&[work("c1", "w1", &[A]), work("c1", "w2", &[A, B])], t0);
        // c2's chunk A is not named by c1's works.
        let (due, next) = m.due(at("2026-01-01T00:04:59Z"), grace, 10);
        assert!(due.is_empty());
        assert_eq!(next, Some(at("2026-01-01T00:05:00Z")));
        assert_eq!(
            names(&m.due(at("2026-01-01T00:05:00Z"), grace, 10).0),
            [format!("c2/sha256-{A}")]
        );
        // w2 goes at 01:00: B is unnamed from then on; A is still named by w1.
        assert!(m.set_work(("c1".into(), "w2".into()), None, at("2026-01-01T01:00:00Z")));
        // A status write to w1 names the same chunks: nothing changes, no pass is woken.
        assert!(!m.set_work(
            ("c1".into(), "w1".into()),
            Some(vec![chunk_object_name(A)]),
            at("2026-01-01T01:01:00Z")
        ));
        assert_eq!(
            names(&m.due(at("2026-01-01T01:04:00Z"), grace, 10).0),
            [format!("c2/sha256-{A}")]
        );
        assert_eq!(
            names(&m.due(at("2026-01-01T01:05:00Z"), grace, 10).0),
            [format!("c1/sha256-{B}"), format!("c2/sha256-{A}")]
        );
        // w1 replaced with content naming B: A goes unnamed, B named again.
        m.set_work(
            ("c1".into(), "w1".into()),
            Some(vec![chunk_object_name(B)]),
            at("2026-01-01T02:00:00Z"),
        );
        assert_eq!(
            names(&m.due(at("2026-01-01T02:05:00Z"), grace, 10).0),
            [format!("c1/sha256-{A}"), format!("c2/sha256-{A}")]
        );
        // The bound per pass, with the next pass at once.
        let (due, next) = m.due(at("2026-01-01T02:05:00Z"), grace, 1);
        assert_eq!(due.len(), 1);
        assert_eq!(next, Some(at("2026-01-01T02:05:00Z")));
    }

    /// The large-works e2e test's stall on a loaded machine: `work create -f` stored a work's
    /// 8 chunks over more than the 3 s grace, and the first ones were collected before the work
    /// naming them was created; the agent was refused them.
    #[test]
    fn a_create_slower_than_the_grace_keeps_every_chunk_until_its_work_names_them() {
        const C: &str = "cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc";
        const D: &str = "dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd";
        let grace = SignedDuration::from_secs(3);
        let mut m = Model::default();
        m.replace_works(&[], at("2026-01-01T00:00:00Z"));
        // One chunk stored a second: the first is older than the grace before the last lands.
        for (i, sha) in [A, B, C].iter().enumerate() {
            let stored = format!("2026-01-01T00:00:0{i}Z");
            m.set_chunk(&chunk("c1", sha, &stored), at(&stored));
        }
        assert!(m.due(at("2026-01-01T00:00:04Z"), grace, 10).0.is_empty());
        // Another cluster's namespace keeps its own time.
        m.set_chunk(
            &chunk("c2", D, "2026-01-01T00:00:00Z"),
            at("2026-01-01T00:00:00Z"),
        );
        assert_eq!(
            names(&m.due(at("2026-01-01T00:00:04Z"), grace, 10).0),
            [format!("c2/sha256-{D}")]
        );
        // The work is created naming them: none is ever due.
        m.set_work(
            ("c1".into(), "w".into()),
            Some([A, B, C].map(chunk_object_name).to_vec()),
            at("2026-01-01T00:00:04Z"),
        );
        assert!(
            !m.due(at("2026-01-02T00:00:00Z"), grace, 10)
                .0
                .iter()
                .any(|(ns, _)| ns == "c1")
        );
        // A create abandoned half-way (the CLI killed): its chunks go a grace after its last.
        m.set_work(("c1".into(), "w".into()), None, at("2026-01-01T00:01:00Z"));
        m.set_chunk(
            &chunk("c1", D, "2026-01-01T00:01:02Z"),
            at("2026-01-01T00:01:02Z"),
        );
        assert_eq!(
            m.grace_ends(&("c1".into(), chunk_object_name(A)), grace),
            Some(at("2026-01-01T00:01:05Z"))
        );
        assert!(
            !m.due(at("2026-01-01T00:01:04Z"), grace, 10)
                .0
                .iter()
                .any(|(ns, _)| ns == "c1")
        );
        assert_eq!(m.due(at("2026-01-01T00:01:05Z"), grace, 10).0.len(), 5);
    }

    #[test]
    fn storing_a_chunk_again_restarts_its_grace() {
        let mut c = chunk("c1", A, "2026-01-01T00:00:00Z");
        assert_eq!(stored_at(&c), Some(at("2026-01-01T00:00:00Z")));
        c["metadata"]["annotations"] = json!({STORED_AT_ANNOTATION: "2026-01-02T00:00:00Z"});
        assert_eq!(stored_at(&c), Some(at("2026-01-02T00:00:00Z")));
        let mut m = Model::default();
        m.replace_works(&[], at("2026-01-01T00:00:00Z"));
        m.set_chunk(
            &chunk("c1", A, "2026-01-01T00:00:00Z"),
            at("2026-01-01T00:00:00Z"),
        );
        m.set_chunk(&c, at("2026-01-02T00:00:00Z"));
        let grace = SignedDuration::from_mins(5);
        assert!(m.due(at("2026-01-02T00:04:00Z"), grace, 10).0.is_empty());
        assert_eq!(m.due(at("2026-01-02T00:05:00Z"), grace, 10).0.len(), 1);
    }

    #[test]
    fn works_without_a_reference_name_nothing() {
        let plain = json!({"spec": {"workload": {"manifests": [{"apiVersion": "v1", "kind": "ConfigMap"}]}}});
        assert!(named_chunks(&plain).is_empty());
        assert_eq!(
            named_chunks(&work("c1", "w", &[A, B])),
            [chunk_object_name(A), chunk_object_name(B)]
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn chunks_of_a_deleted_work_go_after_the_grace_and_shared_ones_stay() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        let piece = |s: &str| {
            let data = s.as_bytes().to_vec();
            Chunk {
                sha256: sha256_hex(&data),
                data,
            }
        };
        let (only, shared, orphan) = (piece("only"), piece("shared"), piece("orphan"));
        for c in [&only, &shared, &orphan] {
            store.create(chunk_object("c1", c)).await.unwrap();
        }
        store
            .create(work("c1", "w1", &[&only.sha256, &shared.sha256]))
            .await
            .unwrap();
        store
            .create(work("c1", "w2", &[&shared.sha256]))
            .await
            .unwrap();
        let (stop_tx, stop) = watch::channel(false);
        let collected = Counter::default();
        let task = tokio::spawn(run(
            Arc::clone(&store),
            Duration::from_millis(300),
            collected.clone(),
            stop,
        ));
        let exists = |c: &Chunk| {
            let store = Arc::clone(&store);
            let name = chunk_object_name(&c.sha256);
            async move {
                store
                    .get(Kind::ManifestChunk, Some("c1"), &name)
                    .await
                    .unwrap()
                    .is_some()
            }
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while exists(&orphan).await {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the orphan chunk stayed"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(exists(&only).await && exists(&shared).await);
        store
            .delete(Kind::ManifestWork, Some("c1"), "w1")
            .await
            .unwrap();
        while exists(&only).await {
            assert!(
                tokio::time::Instant::now() < deadline,
                "w1's own chunk stayed"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Counted once each deletion has returned.
        while collected.get() < 2 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "deletions not counted"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(exists(&shared).await, "a chunk w2 still names was deleted");
        assert_eq!(collected.get(), 2);
        stop_tx.send(true).unwrap();
        task.await.unwrap();
    }
}
