//! What the rest of the gateway reads about shards: [`ShardView`], published by the lease
//! driver on every change (a `watch`), with the shards this gateway may act for (each with
//! its [`Fence`]) and the [`ShardDirectory`] of who owns the others.

use std::collections::BTreeMap;
use std::sync::Arc;

use flotilla_proto::contract::shard_of;
use tokio::sync::watch;
use tokio::time::Instant;

/// This gateway's right to act for one shard: the lease's epoch when it was claimed, and the
/// local instant until which it may act without a renewal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fence {
    /// `leaseTransitions` of the shard's lease as this gateway claimed it.
    pub epoch: u32,
    /// Past this instant the gateway stops acting for the shard, renewed or not (see `owner`).
    pub valid_until: Instant,
}

/// What a gateway's write for a cluster is fenced by: the cluster's shard and the epoch this
/// gateway holds it at, as its view said right before the write. The store refuses the write if
/// the object it writes was written under a newer epoch since (`flotilla_proto::contract::fence`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    pub shard: u32,
    pub epoch: u32,
}

/// One shard's owner as the leases say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirectoryEntry {
    /// The owning gateway's name.
    pub owner: String,
    /// Its advertised host:port, if its own lease is current.
    pub address: Option<String>,
    /// The lease's epoch.
    pub epoch: u32,
}

/// Which gateway holds which shard, derived from the shard and gateway leases: readable by
/// the hub and by every gateway without asking any of them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardDirectory {
    shards: u32,
    entries: BTreeMap<u32, DirectoryEntry>,
}

impl ShardDirectory {
    pub fn new(shards: u32, entries: BTreeMap<u32, DirectoryEntry>) -> ShardDirectory {
        ShardDirectory { shards, entries }
    }

    /// The owner of `shard`, if a live gateway holds it.
    pub fn owner(&self, shard: u32) -> Option<&DirectoryEntry> {
        self.entries.get(&shard)
    }

    /// The gateway holding `cluster`'s session, if any holds its shard.
    pub fn route(&self, cluster: &str) -> Option<&DirectoryEntry> {
        self.owner(shard_of(cluster, self.shards))
    }

    /// Every owned shard with its owner.
    pub fn entries(&self) -> impl Iterator<Item = (u32, &DirectoryEntry)> {
        self.entries.iter().map(|(s, e)| (*s, e))
    }
}

/// Where a session for a cluster belongs, seen from this gateway.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// This gateway holds the shard (at this epoch).
    Here { shard: u32, epoch: u32 },
    /// Another gateway holds it and can be reached at `address`.
    Elsewhere {
        shard: u32,
        owner: String,
        address: String,
    },
    /// Nobody (reachable) holds it now: a handover or a takeover is under way.
    Unowned { shard: u32 },
}

/// This gateway's shards and the directory, as of the last lease round.
#[derive(Clone, Debug)]
pub struct ShardView {
    /// Virtual shards of the fleet.
    pub shards: u32,
    /// The shards this gateway may act for; `None`: all of them, unleased (the single-node
    /// hub's in-process gateway, alone on its store).
    fences: Option<BTreeMap<u32, Fence>>,
    /// Who holds the others.
    pub directory: ShardDirectory,
    /// Whether a lease round has read the leases and written its claims (`false` only for
    /// the view a leased gateway starts with: it knows neither its shards nor their owners).
    read: bool,
}

/// The shard view as gateway parts receive it.
pub type ShardViews = watch::Receiver<Arc<ShardView>>;

impl ShardView {
    /// A gateway that owns every shard without leases (single node).
    pub fn all(shards: u32) -> ShardView {
        ShardView {
            shards,
            fences: None,
            directory: ShardDirectory::default(),
            read: true,
        }
    }

    /// A gateway holding `fences`, with the directory of the rest.
    pub fn leased(
        shards: u32,
        fences: BTreeMap<u32, Fence>,
        directory: ShardDirectory,
    ) -> ShardView {
        ShardView {
            shards,
            fences: Some(fences),
            directory,
            read: true,
        }
    }

    /// The view of a leased gateway before its first lease round: nothing held, nobody known.
    pub fn unread(shards: u32) -> ShardView {
        ShardView {
            read: false,
            ..ShardView::leased(shards, BTreeMap::new(), ShardDirectory::default())
        }
    }

    /// This view, marked as not read yet (a first round's view before its claims are written).
    pub(crate) fn not_read_yet(self) -> ShardView {
        ShardView {
            read: false,
            ..self
        }
    }

    /// Whether a lease round has read the leases (always, without leases).
    pub fn is_read(&self) -> bool {
        self.read
    }

    /// Views of a gateway holding every shard without leases, for tests.
    #[cfg(test)]
    pub(crate) fn all_views() -> ShardViews {
        watch::channel(Arc::new(ShardView::all(
            flotilla_proto::contract::DEFAULT_SHARDS,
        )))
        .1
    }

    /// Whether ownership is on leases (scale-out), rather than every shard held (single node).
    pub fn is_leased(&self) -> bool {
        self.fences.is_some()
    }

    /// `cluster`'s shard.
    pub fn shard_of(&self, cluster: &str) -> u32 {
        shard_of(cluster, self.shards)
    }

    /// The epoch this gateway holds `shard` at, if it may act for it at `now`. Every store
    /// write a gateway makes for a cluster (health, status) asks this first.
    pub fn holds(&self, shard: u32, now: Instant) -> Option<u32> {
        match &self.fences {
            None => Some(0),
            Some(fences) => fences
                .get(&shard)
                .filter(|f| now < f.valid_until)
                .map(|f| f.epoch),
        }
    }

    /// Whether this gateway claimed `cluster`'s shard but its fence ran out at `now`, the shard
    /// not lost: its renewal is late (a slow store, a loaded machine). The next lease round
    /// renews the fence or drops the shard from the view; a write that finds its shard lapsed
    /// waits for that rather than being dropped while the cluster's session is still here
    /// (the agent sends a status once per session).
    pub fn lapsed(&self, cluster: &str, now: Instant) -> bool {
        self.fences.as_ref().is_some_and(|fences| {
            fences
                .get(&self.shard_of(cluster))
                .is_some_and(|f| now >= f.valid_until)
        })
    }

    /// Whether this gateway may act for `cluster` at `now`.
    pub fn holds_cluster(&self, cluster: &str, now: Instant) -> bool {
        self.holds(self.shard_of(cluster), now).is_some()
    }

    /// The shard and epoch this gateway's writes for `cluster` are fenced by at `now`, if it
    /// may act for the cluster (epoch 0 without leases).
    pub fn held_for(&self, cluster: &str, now: Instant) -> Option<Held> {
        let shard = self.shard_of(cluster);
        self.holds(shard, now).map(|epoch| Held { shard, epoch })
    }

    /// Where `cluster`'s session belongs at `now`.
    pub fn route(&self, cluster: &str, now: Instant) -> Route {
        let shard = self.shard_of(cluster);
        if let Some(epoch) = self.holds(shard, now) {
            return Route::Here { shard, epoch };
        }
        if self.fences.as_ref().is_some_and(|f| f.contains_key(&shard)) {
            // Claimed here and lapsed, not lost: the directory still names this gateway, from
            // its own lease. Sent there, the session would come straight back, again and
            // again until its agent gave up for a while; the next lease round renews the shard
            // or says who took it.
            return Route::Unowned { shard };
        }
        match self.directory.owner(shard) {
            Some(DirectoryEntry {
                owner,
                address: Some(address),
                ..
            }) => Route::Elsewhere {
                shard,
                owner: owner.clone(),
                address: address.clone(),
            },
            _ => Route::Unowned { shard },
        }
    }

    /// The shards this gateway has claimed and not lost: held, or lapsed (a renewal late) and
    /// still to be renewed or dropped by the next lease round (every shard without leases).
    /// The watch caches keep these: a late renewal must not cost a relist of its shards.
    pub fn kept(&self) -> Vec<u32> {
        match &self.fences {
            None => (0..self.shards).collect(),
            Some(fences) => fences.keys().copied().collect(),
        }
    }

    /// The shards held at `now` (every shard without leases).
    pub fn held(&self, now: Instant) -> Vec<u32> {
        (0..self.shards)
            .filter(|s| self.holds(*s, now).is_some())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn routes_follow_fences_and_the_directory() {
        let now = Instant::now();
        let cluster = "store-0042";
        let shard = shard_of(cluster, 64);
        let fence = Fence {
            epoch: 3,
            valid_until: now + Duration::from_secs(10),
        };
        let here = ShardView::leased(64, [(shard, fence)].into(), ShardDirectory::default());
        assert_eq!(here.route(cluster, now), Route::Here { shard, epoch: 3 });
        assert_eq!(
            here.route(cluster, now + Duration::from_secs(10)),
            Route::Unowned { shard },
            "a fence that ran out is no right to act"
        );
        assert!(!here.lapsed(cluster, now));
        assert!(
            here.lapsed(cluster, now + Duration::from_secs(10)),
            "claimed, not renewed in time, not lost: lapsed"
        );
        assert!(!ShardView::all(64).lapsed(cluster, now));
        let owner = |address: Option<&str>| {
            ShardDirectory::new(
                64,
                [(
                    shard,
                    DirectoryEntry {
                        owner: "gw-2".into(),
                        address: address.map(str::to_string),
                        epoch: 4,
                    },
                )]
                .into(),
            )
        };
        let elsewhere = ShardView::leased(64, BTreeMap::new(), owner(Some("10.0.0.2:9443")));
        assert_eq!(
            elsewhere.route(cluster, now),
            Route::Elsewhere {
                shard,
                owner: "gw-2".into(),
                address: "10.0.0.2:9443".into()
            }
        );
        let unreachable = ShardView::leased(64, BTreeMap::new(), owner(None));
        assert_eq!(unreachable.route(cluster, now), Route::Unowned { shard });
        // This gateway's own lease still names it while its fence has run out.
        let lapsed = ShardView::leased(64, [(shard, fence)].into(), owner(Some("10.0.0.2:9443")));
        assert_eq!(
            lapsed.route(cluster, now + Duration::from_secs(10)),
            Route::Unowned { shard },
            "a lapsed shard's sessions are not sent to the directory's owner: its own lease"
        );
        assert_eq!(ShardView::all(64).held(now).len(), 64);
    }
}
