//! How the gateway's watch caches (works, clusters) read only the shards it holds: one list +
//! watch per cache, selected by the hub's shard label ([`SHARD_LABEL`]) on the held shards,
//! re-opened with the new selection when the held set changes.
//!
//! Safety rule: a cache answers for a cluster only once it has listed that cluster's shard.
//! [`ShardLoad`] says which shards a cache has loaded; sessions of a cluster wait on it, so a
//! gateway that has just acquired a shard never tells that shard's agents to delete works it
//! simply has not read yet. A shard no longer held leaves the load at once and its objects
//! leave the cache (silently: its sessions are being handed over, not told their works went).

use std::collections::BTreeSet;
use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use flotilla_proto::api::Kind;
use flotilla_proto::contract::{SHARD_LABEL, shard_label_value, shard_of};
use flotilla_store::reflect::{Reflector, reflect_selected};
use flotilla_store::{Object, Selection, Store, WatchEvent};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::info;

use super::{ShardView, ShardViews};

/// After the held set changes, the watch is re-opened once it has been this quiet: a lease
/// round that acquires several shards one after the other costs one relist, not one each.
pub const RESELECT_QUIET: Duration = Duration::from_millis(300);
/// ... but no later than this after the first change, so a gateway whose leases keep moving
/// still loads what it acquired.
pub const RESELECT_MAX_DELAY: Duration = Duration::from_secs(2);

/// The shards a cache reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShardSet {
    /// Every object, whatever its label (the single-node gateway, holding every shard without
    /// leases): no selector, so objects the hub has not labelled yet are read too.
    All,
    /// The objects labelled with one of `held` among `shards` virtual shards.
    Held { shards: u32, held: BTreeSet<u32> },
}

impl ShardSet {
    /// What a gateway with `view` should read: the shards it keeps (held, or lapsed and not
    /// yet dropped), so a renewal that comes late does not narrow the caches and relist.
    pub fn of(view: &ShardView) -> ShardSet {
        if view.is_leased() {
            ShardSet::Held {
                shards: view.shards,
                held: view.kept().into_iter().collect(),
            }
        } else {
            ShardSet::All
        }
    }

    /// Whether `cluster` (its shard) is in the set.
    pub fn has_cluster(&self, cluster: &str) -> bool {
        match self {
            ShardSet::All => true,
            ShardSet::Held { shards, held } => held.contains(&shard_of(cluster, *shards)),
        }
    }

    /// The store selection that reads the set.
    pub fn selection(&self) -> Selection {
        match self {
            ShardSet::All => Selection::Everything,
            ShardSet::Held { held, .. } => {
                Selection::label_in(SHARD_LABEL, held.iter().map(|s| shard_label_value(*s)))
            }
        }
    }

    /// The shards both sets hold.
    fn intersection(&self, other: &ShardSet) -> ShardSet {
        match (self, other) {
            (ShardSet::All, o) | (o, ShardSet::All) => o.clone(),
            (ShardSet::Held { shards, held: a }, ShardSet::Held { held: b, .. }) => {
                ShardSet::Held {
                    shards: *shards,
                    held: a.intersection(b).copied().collect(),
                }
            }
        }
    }

    /// Whether `shard` is in the set.
    pub fn has_shard(&self, shard: u32) -> bool {
        match self {
            ShardSet::All => true,
            ShardSet::Held { held, .. } => held.contains(&shard),
        }
    }

    /// How many shards (`None`: all).
    pub fn count(&self) -> Option<usize> {
        match self {
            ShardSet::All => None,
            ShardSet::Held { held, .. } => Some(held.len()),
        }
    }
}

impl fmt::Display for ShardSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.selection().to_string())
    }
}

/// Which shards a cache has listed and follows, for readers to wait on. Nothing until the
/// first list.
pub struct ShardLoad {
    loaded: watch::Sender<Option<ShardSet>>,
}

impl Default for ShardLoad {
    fn default() -> Self {
        ShardLoad {
            loaded: watch::Sender::new(None),
        }
    }
}

impl ShardLoad {
    /// Waits until `cluster`'s shard is loaded (at once if it is).
    pub async fn wait_for(&self, cluster: &str) {
        let mut rx = self.loaded.subscribe();
        let _ = rx
            .wait_for(|l| l.as_ref().is_some_and(|s| s.has_cluster(cluster)))
            .await;
    }

    /// Whether `cluster`'s shard is loaded now.
    pub fn has(&self, cluster: &str) -> bool {
        self.loaded
            .borrow()
            .as_ref()
            .is_some_and(|s| s.has_cluster(cluster))
    }

    /// Whether the cache has listed at all (whatever it selected).
    pub fn listed(&self) -> bool {
        self.loaded.borrow().is_some()
    }

    /// What is loaded now.
    pub fn loaded(&self) -> Option<ShardSet> {
        self.loaded.borrow().clone()
    }

    /// A receiver that changes with every load and narrowing.
    pub fn subscribe(&self) -> watch::Receiver<Option<ShardSet>> {
        self.loaded.subscribe()
    }

    /// Only shards also in `set` stay loaded (before the watch is re-opened with `set`).
    fn narrow(&self, set: &ShardSet) {
        self.loaded
            .send_modify(|l| *l = l.as_ref().map(|old| old.intersection(set)));
    }

    /// `set` is loaded: a list of it has replaced the cache.
    fn loaded_now(&self, set: &ShardSet) {
        self.loaded.send_replace(Some(set.clone()));
    }
}

/// Whether a gateway with `view`, whose caches have loaded `clusters` and `works`, serves new
/// connections at all; one that does not closes them before their TLS handshake (see
/// [`flotilla_transport::gate::Entry::NotReady`]) or, while [`accepting`] says no, leaves
/// them unaccepted.
///
/// Without leases it always does: its sessions wait for the one load of the store. With
/// leases it does not before its first lease round has written its claims (it knows neither
/// its shards nor who holds the others), nor while it keeps shards of which either cache has
/// loaded none: a restart under a herd, where every agent let in would cost a handshake and
/// then wait on the same relist. A gateway with some of its shards loaded serves while it
/// loads shards it has just acquired (their sessions wait for their shard), so a handover
/// does not turn the agents it sends over into refusals.
pub fn serving(view: &ShardView, clusters: Option<&ShardSet>, works: Option<&ShardSet>) -> bool {
    if !view.is_leased() {
        return true;
    }
    if !view.is_read() {
        return false;
    }
    let kept = view.kept();
    let some_loaded =
        |load: Option<&ShardSet>| load.is_some_and(|l| kept.iter().any(|s| l.has_shard(*s)));
    kept.is_empty() || (some_loaded(clusters) && some_loaded(works))
}

/// Whether the carriers accept new connections at all: not while the gateway knows its
/// shards and is loading them ([`serving`] in a moment), so the connections of a herd wait in
/// the backlog for it instead of being closed into backoffs that outgrow the load. Before the
/// first lease round it accepts (and [`serving`] closes them before TLS): it cannot tell how
/// long the store will keep it waiting.
pub fn accepting(view: &ShardView, clusters: Option<&ShardSet>, works: Option<&ShardSet>) -> bool {
    !view.is_leased() || !view.is_read() || serving(view, clusters, works)
}

/// Keeps the serving and accepting flags equal to [`serving`] and [`accepting`] of the
/// gateway's view and its two caches' loads, until `stop` turns true.
pub async fn follow_serving(
    mut views: ShardViews,
    mut clusters: watch::Receiver<Option<ShardSet>>,
    mut works: watch::Receiver<Option<ShardSet>>,
    (serving_tx, accepting_tx): (watch::Sender<bool>, watch::Sender<bool>),
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let (view, clusters_loaded, works_loaded) = (
            views.borrow_and_update().clone(),
            clusters.borrow_and_update().clone(),
            works.borrow_and_update().clone(),
        );
        let now = serving(&view, clusters_loaded.as_ref(), works_loaded.as_ref());
        let accept = accepting(&view, clusters_loaded.as_ref(), works_loaded.as_ref());
        // Serving before accepting: a connection the carriers take once they accept again
        // finds the gate open.
        let served = serving_tx.send_if_modified(|was| std::mem::replace(was, now) != now);
        let accepted =
            accepting_tx.send_if_modified(|was| std::mem::replace(was, accept) != accept);
        if served || accepted {
            info!(
                serving = now,
                accepting = accept,
                "new connections {}",
                match (now, accept) {
                    (true, _) => "served",
                    (false, true) => "closed before TLS until the shard leases are read",
                    (false, false) => "left in the backlog until the shards held are loaded",
                }
            );
        }
        tokio::select! {
            Ok(()) = views.changed() => {}
            Ok(()) = clusters.changed() => {}
            Ok(()) = works.changed() => {}
            _ = stop.wait_for(|s| *s) => return,
            else => return,
        }
    }
}

/// A watch cache that follows the gateway's shards.
#[async_trait]
pub trait ShardCache: Send + Sync {
    /// Replaces what the cache holds of `set` with a complete list of it. Changes are told to
    /// sessions of clusters whose shard was loaded before (others wait for the load).
    async fn replace(&self, items: Vec<Object>, set: &ShardSet);
    /// Applies one change read through `set`'s selection.
    async fn apply(&self, event: WatchEvent, set: &ShardSet);
    /// Forgets, without telling anyone, everything outside `set`: shards no longer held.
    async fn retain(&self, set: &ShardSet);
    /// What the cache has loaded.
    fn load(&self) -> &ShardLoad;
}

/// Keeps `cache` in step with the store's objects of `kind` in the shards `views` says the
/// gateway holds, until `stop` turns true: one list + watch at a time, re-opened (after
/// [`RESELECT_QUIET`]) when the held set changes.
pub async fn follow_shards(
    kind: Kind,
    store: &dyn Store,
    cache: &dyn ShardCache,
    mut views: ShardViews,
    mut stop: watch::Receiver<bool>,
) {
    let mut set = ShardSet::of(&views.borrow_and_update());
    loop {
        cache.load().narrow(&set);
        cache.retain(&set).await;
        if set.count() == Some(0) {
            // Nothing held yet (a gateway starting, before its first lease round): nothing to
            // read, and a list and watch of nothing would still cost the apiserver two requests.
            cache.replace(Vec::new(), &set).await;
            cache.load().loaded_now(&set);
            match next_set(&mut views, &set, &mut stop).await {
                Some(next) => set = next,
                None => return,
            }
            continue;
        }
        let selection = set.selection();
        info!(%kind, %selection, shards = ?set.count(), "watching the store for this gateway's shards");
        let reader = Loading { cache, set: &set };
        tokio::select! {
            _ = reflect_selected(kind, &selection, store, &reader, stop.clone()) => return,
            next = next_set(&mut views, &set, &mut stop) => match next {
                Some(next) => set = next,
                None => return,
            },
        }
    }
}

/// The next held set that differs from `current`, once changes have settled; `None` on stop.
async fn next_set(
    views: &mut ShardViews,
    current: &ShardSet,
    stop: &mut watch::Receiver<bool>,
) -> Option<ShardSet> {
    loop {
        let gone = tokio::select! {
            changed = views.changed() => changed.is_err(),
            _ = stop.wait_for(|s| *s) => return None,
        };
        if gone {
            // No more views (the gateway is going away): keep the watch until told to stop.
            let _ = stop.wait_for(|s| *s).await;
            return None;
        }
        if ShardSet::of(&views.borrow_and_update()) == *current {
            continue;
        }
        let latest = Instant::now() + RESELECT_MAX_DELAY;
        loop {
            let quiet = (Instant::now() + RESELECT_QUIET).min(latest);
            tokio::select! {
                changed = views.changed() => if changed.is_err() { break },
                _ = tokio::time::sleep_until(quiet) => break,
                _ = stop.wait_for(|s| *s) => return None,
            }
        }
        let settled = ShardSet::of(&views.borrow_and_update());
        if settled != *current {
            return Some(settled);
        }
    }
}

/// One selection's loop feeding the cache: its lists load `set`.
struct Loading<'a> {
    cache: &'a dyn ShardCache,
    set: &'a ShardSet,
}

#[async_trait]
impl Reflector for Loading<'_> {
    async fn replace(&self, items: Vec<Object>) {
        self.cache.replace(items, self.set).await;
        self.cache.load().loaded_now(self.set);
    }

    async fn apply(&self, event: WatchEvent) {
        self.cache.apply(event, self.set).await;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use super::*;
    use crate::shards::{Fence, ShardDirectory};

    const SHARDS: u32 = 8;

    fn holding(shards: &[u32]) -> ShardView {
        let fences: BTreeMap<u32, Fence> = shards
            .iter()
            .map(|s| {
                let fence = Fence {
                    epoch: 1,
                    valid_until: Instant::now() + Duration::from_secs(15),
                };
                (*s, fence)
            })
            .collect();
        ShardView::leased(SHARDS, fences, ShardDirectory::default())
    }

    fn loaded(shards: &[u32]) -> Option<ShardSet> {
        Some(ShardSet::Held {
            shards: SHARDS,
            held: shards.iter().copied().collect(),
        })
    }

    #[test]
    fn a_leased_gateway_serves_once_it_has_read_the_leases_and_loaded_some_of_its_shards() {
        // Without leases: always (its sessions wait for the one load).
        assert!(serving(&ShardView::all(SHARDS), None, None));
        // Before the first lease round it knows neither its shards nor their owners.
        assert!(!serving(&ShardView::unread(SHARDS), None, None));
        assert!(!serving(
            &holding(&[1, 2]).not_read_yet(),
            loaded(&[1, 2]).as_ref(),
            loaded(&[1, 2]).as_ref()
        ));
        // Holding nothing, it redirects: that needs the directory only.
        assert!(serving(&holding(&[]), None, None));
        // A restart: shards held, neither cache (or only one) has loaded any of them.
        assert!(!serving(&holding(&[1, 2]), None, None));
        assert!(!serving(&holding(&[1, 2]), loaded(&[1, 2]).as_ref(), None));
        assert!(!serving(
            &holding(&[1, 2]),
            loaded(&[]).as_ref(),
            loaded(&[1, 2]).as_ref()
        ));
        assert!(!serving(
            &holding(&[1, 2]),
            loaded(&[3]).as_ref(),
            loaded(&[3]).as_ref()
        ));
        // Loaded: it serves, and goes on serving while it loads a shard it has just acquired.
        assert!(serving(
            &holding(&[1, 2]),
            loaded(&[1, 2]).as_ref(),
            loaded(&[1, 2]).as_ref()
        ));
        assert!(serving(
            &holding(&[1, 2, 3]),
            loaded(&[1, 2]).as_ref(),
            loaded(&[1, 2]).as_ref()
        ));
    }

    /// A gateway holds new connections back (in the backlog) only while it loads the shards it
    /// knows it holds; before it has read the leases it takes them and closes them before TLS,
    /// and once it serves it takes them all.
    #[test]
    fn a_leased_gateway_leaves_connections_unaccepted_only_while_it_loads_its_shards() {
        assert!(accepting(&ShardView::all(SHARDS), None, None));
        assert!(accepting(&ShardView::unread(SHARDS), None, None));
        assert!(accepting(&holding(&[]), None, None));
        assert!(!accepting(&holding(&[1, 2]), None, None));
        assert!(!accepting(
            &holding(&[1, 2]),
            loaded(&[1, 2]).as_ref(),
            None
        ));
        assert!(accepting(
            &holding(&[1, 2]),
            loaded(&[1]).as_ref(),
            loaded(&[2]).as_ref()
        ));
        assert!(accepting(
            &holding(&[1, 2, 3]),
            loaded(&[1, 2]).as_ref(),
            loaded(&[1, 2]).as_ref()
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn the_serving_and_accepting_flags_follow_the_view_and_the_loads() {
        let (views_tx, views) = watch::channel(Arc::new(ShardView::unread(SHARDS)));
        let (clusters_tx, clusters) = watch::channel(None);
        let (works_tx, works) = watch::channel(None);
        let (serving_tx, mut serving_rx) = watch::channel(false);
        let (accepting_tx, mut accepting_rx) = watch::channel(true);
        let (stop_tx, stop) = watch::channel(false);
        let follow = tokio::spawn(follow_serving(
            views,
            clusters,
            works,
            (serving_tx, accepting_tx),
            stop,
        ));
        // Its shards known, none loaded: connections wait.
        views_tx.send_replace(Arc::new(holding(&[4])));
        accepting_rx.wait_for(|a| !*a).await.unwrap();
        assert!(!*serving_rx.borrow());
        clusters_tx.send_replace(loaded(&[4]));
        works_tx.send_replace(loaded(&[4]));
        serving_rx.wait_for(|s| *s).await.unwrap();
        accepting_rx.wait_for(|a| *a).await.unwrap();
        // Restarted under its name: the view is unread again until the round is written; it
        // takes connections and closes them before TLS.
        views_tx.send_replace(Arc::new(ShardView::unread(SHARDS)));
        serving_rx.wait_for(|s| !*s).await.unwrap();
        assert!(*accepting_rx.borrow());
        stop_tx.send_replace(true);
        follow.await.unwrap();
    }
}
