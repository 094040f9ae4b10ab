//! The one list-then-watch loop behind every watch cache: list, watch from the list's revision,
//! and on a watch that ends resume from the last revision seen. Only a `Gone` (the history is
//! too old) lists again. Every failure (a list, a watch that cannot open, a watch that breaks)
//! waits a bounded, growing delay before the next request, so a store that keeps failing costs
//! it a request every few seconds, not a relist of every object in a tight loop. Caches
//! implement [`Reflector`]; the loop owns the store conversation and the resume rules.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use flotilla_ops::error_chain;
use flotilla_proto::api::Kind;
use futures::StreamExt;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::{Object, Revision, Selection, Store, StoreError, WatchEvent};

/// First delay after a failure; doubles with each failure in a row.
pub const RETRY_MIN: Duration = Duration::from_millis(200);
/// Longest delay between two attempts.
pub const RETRY_MAX: Duration = Duration::from_secs(10);
/// A watch that delivered an event, or stayed open this long, counts as healthy: the next
/// failure starts again from [`RETRY_MIN`].
pub const HEALTHY_AFTER: Duration = Duration::from_secs(30);

/// A cache kept in step with one kind of the store.
#[async_trait]
pub trait Reflector: Send + Sync {
    /// Replaces the cache with a complete list. After the first one this also has to deliver
    /// what changed while the watch was down.
    async fn replace(&self, items: Vec<Object>);
    /// Applies one change.
    async fn apply(&self, event: WatchEvent);
}

/// What to ask the store next.
enum Next {
    List,
    Watch(Revision),
}

/// Runs the loop for `kind` (all namespaces) until `stop` turns true or its sender is dropped.
pub async fn reflect(
    kind: Kind,
    store: &dyn Store,
    target: &dyn Reflector,
    stop: watch::Receiver<bool>,
) {
    reflect_selected(kind, &Selection::Everything, store, target, stop).await
}

/// [`reflect`] of the objects of `kind` that `selection` picks: every list and watch asks the
/// store for those only, and an object that leaves the selection arrives as `Deleted`.
pub async fn reflect_selected(
    kind: Kind,
    selection: &Selection,
    store: &dyn Store,
    target: &dyn Reflector,
    stop: watch::Receiver<bool>,
) {
    run(kind, Scope::Selected(selection), store, target, stop).await
}

/// [`reflect`] of the objects of `kind` in one namespace: every list and watch asks the store
/// for that namespace only (how a gateway follows the hub's ConfigMaps of the namespaces its
/// policies read, and not every ConfigMap of the hub).
pub async fn reflect_namespace(
    kind: Kind,
    namespace: &str,
    store: &dyn Store,
    target: &dyn Reflector,
    stop: watch::Receiver<bool>,
) {
    run(kind, Scope::Namespace(namespace), store, target, stop).await
}

/// Which objects of a kind one loop reads.
#[derive(Clone, Copy)]
enum Scope<'a> {
    /// Every namespace's, through a label selection.
    Selected(&'a Selection),
    /// One namespace's, all of them.
    Namespace(&'a str),
}

impl Scope<'_> {
    async fn list(self, store: &dyn Store, kind: Kind) -> Result<crate::ObjectList, StoreError> {
        match self {
            Scope::Selected(selection) => store.list_selected(kind, selection).await,
            Scope::Namespace(namespace) => store.list(kind, Some(namespace)).await,
        }
    }

    async fn watch(
        self,
        store: &dyn Store,
        kind: Kind,
        from: Revision,
    ) -> Result<crate::WatchStream, StoreError> {
        match self {
            Scope::Selected(selection) => store.watch_selected(kind, selection, Some(from)).await,
            Scope::Namespace(namespace) => store.watch(kind, Some(namespace), Some(from)).await,
        }
    }
}

async fn run(
    kind: Kind,
    scope: Scope<'_>,
    store: &dyn Store,
    target: &dyn Reflector,
    mut stop: watch::Receiver<bool>,
) {
    let namespace = match scope {
        Scope::Namespace(namespace) => Some(namespace),
        Scope::Selected(_) => None,
    };
    let mut retry = Retry::default();
    let mut next = Next::List;
    loop {
        if *stop.borrow() {
            return;
        }
        let from = match next {
            Next::List => match scope.list(store, kind).await {
                Ok(list) => {
                    target.replace(list.items).await;
                    list.revision
                }
                Err(e) => {
                    let delay = retry.failed();
                    warn!(%kind, namespace, error = %error_chain(&e), ?delay, "listing failed; retrying");
                    if !pause(delay, &mut stop).await {
                        return;
                    }
                    continue;
                }
            },
            Next::Watch(from) => from,
        };
        let opened = Instant::now();
        let mut events = match scope.watch(store, kind, from.clone()).await {
            Ok(s) => s,
            Err(StoreError::Gone { .. }) => {
                debug!(%kind, namespace, "watch history too old; listing again");
                next = Next::List;
                continue;
            }
            Err(e) => {
                let delay = retry.failed();
                warn!(%kind, namespace, error = %error_chain(&e), ?delay, "watching failed; retrying");
                next = Next::Watch(from);
                if !pause(delay, &mut stop).await {
                    return;
                }
                continue;
            }
        };
        let mut last = from;
        let mut delivered = false;
        let outcome = loop {
            let event = tokio::select! {
                e = events.next() => e,
                _ = stop.wait_for(|s| *s) => return,
            };
            match event {
                Some(Ok(event)) => {
                    if let Some(rev) = event.revision() {
                        last = rev;
                    }
                    delivered = true;
                    target.apply(event).await;
                }
                Some(Err(StoreError::Gone { .. })) => break Ended::Gone,
                None => break Ended::Closed,
                Some(Err(e)) => break Ended::Failed(e),
            }
        };
        if delivered || opened.elapsed() >= HEALTHY_AFTER {
            retry.healthy();
        }
        next = match outcome {
            Ended::Gone => {
                debug!(%kind, namespace, "watch history too old; listing again");
                Next::List
            }
            // A watch the store ended on purpose (the apiserver's timeout): resume where it
            // stopped. One that ends again at once is treated like a failure.
            Ended::Closed if delivered || opened.elapsed() >= HEALTHY_AFTER => {
                debug!(%kind, namespace, "watch ended; resuming");
                Next::Watch(last)
            }
            Ended::Closed => {
                let delay = retry.failed();
                debug!(%kind, namespace, ?delay, "watch ended at once; resuming after a pause");
                if !pause(delay, &mut stop).await {
                    return;
                }
                Next::Watch(last)
            }
            Ended::Failed(e) => {
                let delay = retry.failed();
                warn!(%kind, namespace, error = %error_chain(&e), ?delay, "watch failed; resuming after a pause");
                if !pause(delay, &mut stop).await {
                    return;
                }
                Next::Watch(last)
            }
        };
    }
}

/// Keeps every cache in `readers` current, each of its kind, until `stop`: one loop (one
/// list, one watch) per kind however many caches read it, each cache given every list and
/// change. How the hub's fleet gauges and its status page share their watches.
pub async fn reflect_all(
    store: &dyn Store,
    readers: Vec<(Kind, Arc<dyn Reflector>)>,
    stop: watch::Receiver<bool>,
) {
    let mut by_kind: BTreeMap<Kind, Fanout> = BTreeMap::new();
    for (kind, reader) in readers {
        by_kind.entry(kind).or_default().0.push(reader);
    }
    futures::future::join_all(
        by_kind
            .iter()
            .map(|(kind, fanout)| reflect(*kind, store, fanout, stop.clone())),
    )
    .await;
}

/// Several caches of one kind behind one loop: each gets its own copy of what the loop reads.
#[derive(Default)]
struct Fanout(Vec<Arc<dyn Reflector>>);

#[async_trait]
impl Reflector for Fanout {
    async fn replace(&self, items: Vec<Object>) {
        if let Some((last, rest)) = self.0.split_last() {
            for reader in rest {
                reader.replace(items.clone()).await;
            }
            last.replace(items).await;
        }
    }

    async fn apply(&self, event: WatchEvent) {
        if let Some((last, rest)) = self.0.split_last() {
            for reader in rest {
                reader.apply(event.clone()).await;
            }
            last.apply(event).await;
        }
    }
}

enum Ended {
    Gone,
    Closed,
    Failed(StoreError),
}

/// Delays between failed attempts: doubling from [`RETRY_MIN`] to [`RETRY_MAX`].
#[derive(Default)]
struct Retry {
    failures: u32,
}

impl Retry {
    fn failed(&mut self) -> Duration {
        let delay = RETRY_MIN
            .saturating_mul(1u32 << self.failures.min(16))
            .min(RETRY_MAX);
        self.failures = self.failures.saturating_add(1);
        delay
    }

    fn healthy(&mut self) {
        self.failures = 0;
    }
}

/// Sleeps for `delay`; `false` if `stop` turned true (or was dropped) first.
async fn pause(delay: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(delay) => true,
        _ = stop.wait_for(|s| *s) => false,
    }
}

#[cfg(test)]
mod tests {
    //! The loop's requests to a store that misbehaves: counted, with time paused.

    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use serde_json::json;

    use super::*;
    use crate::{ObjectList, SledStore, WatchStream};

    /// A sled store whose watches fail to open (or end at once) as told, counting requests.
    struct Flaky {
        inner: SledStore,
        watch_fails: bool,
        lists: AtomicUsize,
        watches: AtomicUsize,
    }

    #[async_trait]
    impl Store for Flaky {
        async fn get(
            &self,
            kind: Kind,
            namespace: Option<&str>,
            name: &str,
        ) -> Result<Option<Object>, StoreError> {
            self.inner.get(kind, namespace, name).await
        }
        async fn list(
            &self,
            kind: Kind,
            namespace: Option<&str>,
        ) -> Result<ObjectList, StoreError> {
            self.lists.fetch_add(1, Ordering::SeqCst);
            self.inner.list(kind, namespace).await
        }
        async fn list_selected(
            &self,
            kind: Kind,
            selection: &Selection,
        ) -> Result<ObjectList, StoreError> {
            self.lists.fetch_add(1, Ordering::SeqCst);
            self.inner.list_selected(kind, selection).await
        }
        async fn watch_selected(
            &self,
            kind: Kind,
            _selection: &Selection,
            from: Option<Revision>,
        ) -> Result<WatchStream, StoreError> {
            self.watch(kind, None, from).await
        }
        async fn watch(
            &self,
            _kind: Kind,
            _namespace: Option<&str>,
            _from: Option<Revision>,
        ) -> Result<WatchStream, StoreError> {
            self.watches.fetch_add(1, Ordering::SeqCst);
            if self.watch_fails {
                Err(StoreError::backend("watching", "connection reset"))
            } else {
                Ok(futures::stream::empty().boxed())
            }
        }
        async fn create(&self, object: Object) -> Result<Object, StoreError> {
            self.inner.create(object).await
        }
        async fn update_spec(&self, object: Object) -> Result<Object, StoreError> {
            self.inner.update_spec(object).await
        }
        async fn update_status(
            &self,
            kind: Kind,
            namespace: Option<&str>,
            name: &str,
            status: serde_json::Value,
            expected: Option<&Revision>,
        ) -> Result<Object, StoreError> {
            self.inner
                .update_status(kind, namespace, name, status, expected)
                .await
        }
        async fn update_status_fenced(
            &self,
            kind: Kind,
            namespace: Option<&str>,
            name: &str,
            status: serde_json::Value,
            fence: &crate::WriteFence,
            basis: Option<&crate::Basis>,
        ) -> Result<Object, StoreError> {
            self.inner
                .update_status_fenced(kind, namespace, name, status, fence, basis)
                .await
        }
        async fn update_spec_fenced(
            &self,
            object: Object,
            fence: &crate::WriteFence,
        ) -> Result<Object, StoreError> {
            self.inner.update_spec_fenced(object, fence).await
        }
        async fn delete(
            &self,
            kind: Kind,
            namespace: Option<&str>,
            name: &str,
        ) -> Result<(), StoreError> {
            self.inner.delete(kind, namespace, name).await
        }
        async fn ensure_namespace(&self, name: &str) -> Result<(), StoreError> {
            self.inner.ensure_namespace(name).await
        }
    }

    struct Counting(AtomicUsize);

    #[async_trait]
    impl Reflector for Counting {
        async fn replace(&self, _items: Vec<Object>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        async fn apply(&self, _event: WatchEvent) {}
    }

    async fn run_for(watch_fails: bool, run: Duration) -> (usize, usize) {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Flaky {
            inner: SledStore::open(dir.path()).unwrap(),
            watch_fails,
            lists: AtomicUsize::new(0),
            watches: AtomicUsize::new(0),
        });
        store
            .create(json!({
                "apiVersion": "cluster.open-cluster-management.io/v1", "kind": "ManagedCluster",
                "metadata": {"name": "store-1"}, "spec": {},
            }))
            .await
            .unwrap();
        let target = Arc::new(Counting(AtomicUsize::new(0)));
        let (stop_tx, stop) = watch::channel(false);
        let task = {
            let (store, target) = (store.clone(), target.clone());
            tokio::spawn(async move {
                reflect(Kind::ManagedCluster, store.as_ref(), target.as_ref(), stop).await
            })
        };
        tokio::time::sleep(run).await;
        stop_tx.send(true).unwrap();
        task.await.unwrap();
        (
            store.lists.load(Ordering::SeqCst),
            store.watches.load(Ordering::SeqCst),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_that_keeps_failing_is_retried_with_backoff_and_never_relists() {
        // A minute of a watch that never opens: 0.2+0.4+..+10 s delays, then one every 10 s.
        let (lists, watches) = run_for(true, Duration::from_secs(60)).await;
        assert_eq!(lists, 1, "a failing watch does not relist every object");
        assert!(
            (5..=12).contains(&watches),
            "{watches} watch attempts in a minute: not backed off"
        );
    }

    #[tokio::test]
    async fn caches_of_one_kind_share_one_list_and_one_watch() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Flaky {
            inner: SledStore::open(dir.path()).unwrap(),
            watch_fails: false,
            lists: AtomicUsize::new(0),
            watches: AtomicUsize::new(0),
        });
        let (a, b) = (
            Arc::new(Counting(AtomicUsize::new(0))),
            Arc::new(Counting(AtomicUsize::new(0))),
        );
        let (stop_tx, stop) = watch::channel(false);
        let task = {
            let store = store.clone();
            let readers: Vec<(Kind, Arc<dyn Reflector>)> = vec![
                (Kind::ManagedCluster, a.clone()),
                (Kind::ManagedCluster, b.clone()),
            ];
            tokio::spawn(async move { reflect_all(store.as_ref(), readers, stop).await })
        };
        // Both caches get the list; the store was asked once.
        let listed = async {
            while a.0.load(Ordering::SeqCst) == 0 || b.0.load(Ordering::SeqCst) == 0 {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), listed)
            .await
            .expect("both caches listed within 10 s");
        stop_tx.send(true).unwrap();
        task.await.unwrap();
        assert_eq!(store.lists.load(Ordering::SeqCst), 1);
        assert!(store.watches.load(Ordering::SeqCst) <= 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_that_ends_at_once_is_resumed_with_backoff() {
        let (lists, watches) = run_for(false, Duration::from_secs(60)).await;
        assert_eq!(lists, 1);
        assert!((5..=12).contains(&watches), "{watches} watch attempts");
    }

    /// What a loop gave its cache, as `Listed [names]` and `Added name` lines.
    struct Recording(tokio::sync::mpsc::UnboundedSender<String>);

    #[async_trait]
    impl Reflector for Recording {
        async fn replace(&self, items: Vec<Object>) {
            let names: Vec<&str> = items.iter().map(crate::name_of).collect();
            let _ = self.0.send(format!("Listed {names:?}"));
        }
        async fn apply(&self, event: WatchEvent) {
            let what = match &event {
                WatchEvent::Added(_) => "Added",
                WatchEvent::Modified(_) => "Modified",
                WatchEvent::Deleted(_) => "Deleted",
            };
            let _ = self
                .0
                .send(format!("{what} {}", crate::name_of(event.object())));
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_namespace_loop_reads_that_namespace_only() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(SledStore::open(dir.path()).unwrap());
        let config_map = |namespace: &str, name: &str| {
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": name, "namespace": namespace}, "data": {"k": "v"}})
        };
        store
            .create(config_map("policies", "settings"))
            .await
            .unwrap();
        store
            .create(config_map("kube-system", "other"))
            .await
            .unwrap();
        let (events, mut seen) = tokio::sync::mpsc::unbounded_channel();
        let (stop_tx, stop) = watch::channel(false);
        let task = {
            let store = store.clone();
            tokio::spawn(async move {
                let target = Recording(events);
                reflect_namespace(Kind::ConfigMap, "policies", store.as_ref(), &target, stop).await
            })
        };
        let mut next = async || {
            tokio::time::timeout(Duration::from_secs(10), seen.recv())
                .await
                .expect("an event within 10 s")
                .expect("the loop runs")
        };
        assert_eq!(next().await, "Listed [\"settings\"]");
        store
            .create(config_map("kube-system", "more"))
            .await
            .unwrap();
        store.create(config_map("policies", "tiers")).await.unwrap();
        assert_eq!(
            next().await,
            "Added tiers",
            "kube-system's ConfigMaps never arrive"
        );
        stop_tx.send(true).unwrap();
        task.await.unwrap();
    }
}
