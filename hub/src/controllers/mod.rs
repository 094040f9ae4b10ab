//! The hub's controllers: each keeps a watch cache of the store with the one list-then-watch
//! loop (`flotilla_store::reflect`) and writes back through the `Store` trait, so it runs the
//! same on both backends.
//!
//! * [`work_ttl`]: deletes ManifestWorks whose `deleteOption.ttlSecondsAfterFinished` has
//!   passed since they turned Complete.

pub mod work_ttl;

use std::sync::Arc;

use flotilla_store::Store;
use tokio::sync::watch;

/// Runs every controller until `stop` turns true (or its sender is dropped).
pub async fn run(store: Arc<dyn Store>, stop: watch::Receiver<bool>) {
    work_ttl::run(store, stop).await;
}
