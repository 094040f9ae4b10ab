//! The one list-then-watch loop behind every watch cache in the gateway: list, watch from the
//! list's revision, and list again whenever the watch ends (`Gone`, a broken stream), with a
//! bounded backoff when listing fails. Caches implement [`Reflector`]; the loop owns the store
//! conversation and the resume rules.

use std::time::Duration;

use async_trait::async_trait;
use flotilla_proto::api::Kind;
use flotilla_store::{Object, Store, StoreError, WatchEvent};
use futures::StreamExt;
use tokio::sync::watch;
use tracing::{debug, warn};

/// Backoff bounds for a failing list.
const RELIST_BACKOFF_MIN: Duration = Duration::from_millis(200);
const RELIST_BACKOFF_MAX: Duration = Duration::from_secs(10);

/// A cache kept in step with one kind of the store.
#[async_trait]
pub trait Reflector: Send + Sync {
    /// Replaces the cache with a complete list. After the first one this also has to deliver
    /// what changed while the watch was down.
    async fn replace(&self, items: Vec<Object>);
    /// Applies one change.
    async fn apply(&self, event: WatchEvent);
}

/// Runs the loop for `kind` (all namespaces) until `stop` fires.
pub async fn reflect(
    kind: Kind,
    store: &dyn Store,
    target: &dyn Reflector,
    mut stop: watch::Receiver<bool>,
) {
    let mut retry = RELIST_BACKOFF_MIN;
    loop {
        let list = match store.list(kind, None).await {
            Ok(list) => list,
            Err(e) => {
                warn!(%kind, error = %e, ?retry, "listing failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(retry) => {}
                    _ = stop.changed() => return,
                }
                retry = (retry * 2).min(RELIST_BACKOFF_MAX);
                continue;
            }
        };
        retry = RELIST_BACKOFF_MIN;
        let revision = list.revision.clone();
        target.replace(list.items).await;
        let mut events = match store.watch(kind, None, Some(revision)).await {
            Ok(s) => s,
            Err(e) => {
                warn!(%kind, error = %e, "watching failed; listing again");
                continue;
            }
        };
        loop {
            let event = tokio::select! {
                e = events.next() => e,
                _ = stop.changed() => return,
            };
            match event {
                Some(Ok(event)) => target.apply(event).await,
                Some(Err(StoreError::Gone { .. })) | None => {
                    debug!(%kind, "watch ended; listing again");
                    break;
                }
                Some(Err(e)) => {
                    warn!(%kind, error = %e, "watch failed; listing again");
                    break;
                }
            }
        }
    }
}
