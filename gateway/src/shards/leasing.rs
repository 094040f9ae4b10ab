//! The lease driver: every renew period it lists flotilla's leases (one request), feeds them
//! to the [`ShardOwner`], makes the writes it decides (a bounded number at once, each with its
//! resourceVersion precondition), publishes the new [`ShardView`], and drains the sessions of
//! shards this gateway no longer acts for. A shard handed over is drained first (its sessions
//! told to come back after a spread retry-after, by then to the new owner) and released after,
//! so the new owner admits them only once the old one has let go.

use std::sync::Arc;
use std::time::Duration;

use flotilla_ops::error_chain;
use flotilla_store::leases::{KubeLeases, LeaseError};
use futures::StreamExt as _;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::owner::{Intent, LeaseWrite, OwnerConfig, ShardOwner, WriteOutcome};
use super::view::{Route, ShardView};
use crate::registry::Registry;

/// Lease writes in flight at once (a gateway claiming its share at start writes that many).
const WRITE_CONCURRENCY: usize = 16;
/// On shutdown, how long releasing the held shards may take.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(3);

/// Shard ownership on the hub apiserver's Leases, for one gateway (or, with
/// `claims: false`, for a reader such as the hub that only routes by the directory).
pub struct ShardLeasing {
    pub leases: KubeLeases,
    pub owner: OwnerConfig,
}

impl ShardLeasing {
    /// The view before the first round: nothing held, nobody known.
    pub fn initial_view(&self) -> ShardView {
        ShardView::unread(self.owner.shards)
    }

    /// Runs lease rounds until `stop`, then releases what it holds so others take over at
    /// once. Sessions of shards given up or lost are drained with a retry-after spread over
    /// `drain_window` (and the owner's address when known).
    pub async fn run(
        self,
        view: watch::Sender<Arc<ShardView>>,
        registry: Arc<Registry>,
        drain_window: Duration,
        mut stop: watch::Receiver<bool>,
    ) {
        let ShardLeasing { leases, owner } = self;
        if owner.claims {
            leases.ensure_namespace().await;
        }
        info!(
            gateway = %owner.name, namespace = leases.namespace(), shards = owner.shards,
            lease_duration = ?owner.lease_duration, renew_period = ?owner.renew_period,
            "shard leasing started"
        );
        let mut tick = tokio::time::interval(owner.renew_period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut owner = ShardOwner::new(owner);
        // Until a round has read the leases the gateway knows neither its shards nor their
        // owners: its view stays unread (it serves no one).
        let mut read = false;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
            // Every step of a round is bounded by the renew period: a request that never
            // answers must not stop the rounds (the shards would stay claimed by a gateway that
            // no longer renews them, and its sessions never drained).
            let bound = owner.config().renew_period;
            let now = Instant::now();
            match tokio::time::timeout(bound, leases.list()).await {
                Ok(Ok(records)) => {
                    owner.observe(now, records);
                    read = true;
                }
                Ok(Err(e)) => {
                    warn!(error = %error_chain(&e), "cannot read the shard leases; held shards stay valid until their leases would expire");
                    owner.expire(now);
                }
                Err(_) => {
                    warn!(
                        ?bound,
                        "reading the shard leases took longer than the renew period; held shards stay valid until their leases would expire"
                    );
                    owner.expire(now);
                }
            }
            let writes = owner.plan(now);
            // Shards being released are no longer acted for from here on. Until the first
            // round's claims are written the view stays unread: the gateway is not serving yet.
            let written_before = view.borrow().is_read();
            publish(&owner, &view, written_before);
            for w in &writes {
                if let Intent::Release(shard) = w.intent {
                    info!(
                        shard,
                        "handing the shard over (fair share): draining its sessions"
                    );
                    drain_shard(&registry, &view, shard, drain_window);
                }
            }
            // Writes cut short leave their shards' fences as they were: a renewal not known to
            // be stored lapses, and the next round renews (or claims) it again.
            bounded(
                bound,
                "writing the shard leases",
                write_all(&leases, &mut owner, writes),
            )
            .await;
            publish(&owner, &view, read);
            drain_not_held(&registry, &view, drain_window);
        }
        // Shutdown: the gateway has drained its sessions; give the shards up for the others.
        let releases = owner.release_all();
        if !releases.is_empty() {
            let n = releases
                .iter()
                .filter(|w| matches!(w.intent, Intent::Release(_)))
                .count();
            let released =
                tokio::time::timeout(RELEASE_TIMEOUT, write_all(&leases, &mut owner, releases))
                    .await;
            match released {
                Ok(()) => info!(shards = n, "shards released on shutdown"),
                Err(_) => warn!("releasing shards on shutdown timed out; they expire instead"),
            }
        }
    }
}

/// Runs `step` for at most `bound`, warning when it is cut short.
async fn bounded(bound: Duration, what: &str, step: impl Future<Output = ()>) {
    if tokio::time::timeout(bound, step).await.is_err() {
        warn!(
            ?bound,
            step = what,
            "a lease round's step took longer than the renew period; cut short"
        );
    }
}

/// Makes `writes`, at most [`WRITE_CONCURRENCY`] at once, and tells `owner` how each went.
async fn write_all(leases: &KubeLeases, owner: &mut ShardOwner, writes: Vec<LeaseWrite>) {
    let results: Vec<_> = futures::stream::iter(writes)
        .map(|w| async move {
            let sent_at = Instant::now();
            let result = leases
                .write(&w.record, matches!(w.intent, Intent::Claim(_)))
                .await;
            (w, result, sent_at)
        })
        .buffer_unordered(WRITE_CONCURRENCY)
        .collect()
        .await;
    for (w, result, sent_at) in results {
        let outcome = match result {
            Ok(record) => {
                match w.intent {
                    Intent::Claim(shard) => {
                        info!(shard, epoch = record.transitions, "shard claimed")
                    }
                    Intent::Release(shard) => info!(shard, "shard released"),
                    _ => {}
                }
                WriteOutcome::Stored(record)
            }
            Err(LeaseError::Conflict { .. }) => {
                match w.intent {
                    Intent::Renew(shard) => {
                        warn!(
                            shard,
                            "shard lease taken by another gateway; no longer acting for it"
                        )
                    }
                    Intent::Claim(shard) => {
                        debug!(shard, "another gateway claimed the shard first")
                    }
                    _ => {}
                }
                WriteOutcome::Conflict
            }
            Err(e) => {
                warn!(error = %error_chain(&e), "lease write failed");
                WriteOutcome::Failed
            }
        };
        owner.written(&w, outcome, sent_at);
    }
}

fn publish(owner: &ShardOwner, view: &watch::Sender<Arc<ShardView>>, read: bool) {
    let now = Instant::now();
    let next = ShardView::leased(owner.config().shards, owner.fences(), owner.directory(now));
    let next = if read { next } else { next.not_read_yet() };
    view.send_if_modified(|current| {
        let changed = current.held(now) != next.held(now)
            || current.kept() != next.kept()
            || current.directory != next.directory
            || current.is_read() != next.is_read();
        *current = Arc::new(next);
        changed
    });
}

/// Drains the sessions of `shard` (handover), each told to come back after its share of the
/// window: by then the new owner holds it.
fn drain_shard(
    registry: &Registry,
    view: &watch::Sender<Arc<ShardView>>,
    shard: u32,
    window: Duration,
) {
    let shards = view.borrow().shards;
    for handle in registry.all() {
        if flotilla_proto::contract::shard_of(&handle.cluster, shards) == shard {
            let retry_after = spread_over(window, &handle.session_id);
            handle.mailbox.drain(
                retry_after,
                None,
                format!("shard {shard} is moving to another gateway"),
            );
        }
    }
}

/// Drains every session this gateway no longer acts for (a lease lost or expired), pointing
/// each to its shard's owner when known.
fn drain_not_held(registry: &Registry, view: &watch::Sender<Arc<ShardView>>, window: Duration) {
    let current = view.borrow().clone();
    let now = Instant::now();
    for handle in registry.all() {
        match current.route(&handle.cluster, now) {
            Route::Here { .. } => {}
            Route::Elsewhere {
                shard,
                owner,
                address,
            } => handle.mailbox.drain(
                Duration::ZERO,
                Some(address),
                format!("shard {shard} is now held by gateway {owner}"),
            ),
            // A renewal late, not lost: the next round renews it or drops it.
            Route::Unowned { .. } if current.lapsed(&handle.cluster, now) => {}
            Route::Unowned { shard } => {
                let retry_after = spread_over(window, &handle.session_id);
                handle.mailbox.drain(
                    retry_after,
                    None,
                    format!("this gateway no longer holds shard {shard}"),
                )
            }
        }
    }
}

/// This session's share of the drain window: spread by its id, so agents drained together
/// come back apart.
pub(crate) fn spread_over(window: Duration, session_id: &str) -> Duration {
    use std::hash::{Hash as _, Hasher as _};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    session_id.hash(&mut h);
    let window_ms = window.as_millis().max(1) as u64;
    Duration::from_millis(h.finish() % window_ms)
}
