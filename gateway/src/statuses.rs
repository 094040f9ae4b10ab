//! Writing the status agents report into the store, coalesced and rate-limited: one pending
//! entry per work (the newest wins), at most `writes_per_second` store writes, and the agent's
//! status acknowledged only once it is stored.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use flotilla_proto::api::{Kind, ManifestWorkStatus};
use flotilla_store::{Store, StoreError};
use tokio::sync::{Mutex, Notify, watch};
use tracing::{debug, warn};

use crate::registry::Registry;

/// A status waiting to be written.
#[derive(Clone, Debug)]
pub struct PendingStatus {
    pub cluster: String,
    pub name: String,
    pub uid: String,
    pub seq: u64,
    pub status: serde_json::Value,
}

pub struct StatusWriter {
    /// Newest pending status per work uid.
    pending: Mutex<HashMap<String, PendingStatus>>,
    /// Highest seq stored per work uid, to drop stale reports (a reconnecting agent resends
    /// its outbox).
    written: Mutex<HashMap<String, u64>>,
    notify: Notify,
    writes_per_second: u32,
}

/// Why a reported status was refused; none is retryable with the same frame.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("status of ManifestWork {cluster}/{name} is not a ManifestWork status: {reason}")]
    Malformed {
        cluster: String,
        name: String,
        reason: String,
    },
}

impl StatusWriter {
    pub fn new(writes_per_second: u32) -> Arc<StatusWriter> {
        Arc::new(StatusWriter {
            pending: Mutex::new(HashMap::new()),
            written: Mutex::new(HashMap::new()),
            notify: Notify::new(),
            writes_per_second: writes_per_second.max(1),
        })
    }

    /// Queues a status for writing. Validates the shape first, so nothing malformed reaches the
    /// store.
    pub async fn submit(
        &self,
        cluster: &str,
        name: &str,
        uid: &str,
        seq: u64,
        status_json: &[u8],
    ) -> Result<(), StatusError> {
        let malformed = |reason: String| StatusError::Malformed {
            cluster: cluster.into(),
            name: name.into(),
            reason,
        };
        let parsed: ManifestWorkStatus =
            serde_json::from_slice(status_json).map_err(|e| malformed(e.to_string()))?;
        let status = serde_json::to_value(parsed).map_err(|e| malformed(e.to_string()))?;
        let mut pending = self.pending.lock().await;
        if pending.get(uid).is_some_and(|p| p.seq >= seq) {
            return Ok(());
        }
        pending.insert(
            uid.to_string(),
            PendingStatus {
                cluster: cluster.into(),
                name: name.into(),
                uid: uid.into(),
                seq,
                status,
            },
        );
        drop(pending);
        self.notify.notify_one();
        Ok(())
    }

    /// Writes pending statuses until `stop` fires.
    pub async fn run(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        registry: Arc<Registry>,
        mut stop: watch::Receiver<bool>,
    ) {
        let spacing = Duration::from_secs(1) / self.writes_per_second;
        let mut tick = tokio::time::interval(spacing);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let next = { self.pending.lock().await.keys().next().cloned() };
            let Some(uid) = next else {
                tokio::select! {
                    _ = self.notify.notified() => continue,
                    _ = stop.changed() => return,
                }
            };
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            let Some(p) = self.pending.lock().await.remove(&uid) else {
                continue;
            };
            if self
                .written
                .lock()
                .await
                .get(&p.uid)
                .is_some_and(|w| *w >= p.seq)
            {
                // Already stored (a resend after reconnect): just acknowledge again.
                ack(&registry, &p).await;
                continue;
            }
            match store
                .update_status(
                    Kind::ManifestWork,
                    Some(&p.cluster),
                    &p.name,
                    p.status.clone(),
                    None,
                )
                .await
            {
                Ok(_) => {
                    self.written.lock().await.insert(p.uid.clone(), p.seq);
                    debug!(cluster = %p.cluster, work = %p.name, seq = p.seq, "work status stored");
                    ack(&registry, &p).await;
                }
                Err(StoreError::NotFound { .. }) => {
                    // The work was deleted meanwhile: its status has nowhere to go. Acknowledge
                    // so the agent stops resending it.
                    ack(&registry, &p).await;
                }
                Err(e) => {
                    warn!(cluster = %p.cluster, work = %p.name, error = %e, "storing work status failed; will retry");
                    let mut pending = self.pending.lock().await;
                    // Keep it unless a newer one arrived meanwhile.
                    pending.entry(p.uid.clone()).or_insert(p);
                    drop(pending);
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                        _ = stop.changed() => return,
                    }
                }
            }
        }
    }
}

async fn ack(registry: &Registry, p: &PendingStatus) {
    if let Some(h) = registry.get(&p.cluster).await {
        h.mailbox.status_ack(&p.uid, p.seq).await;
    }
}
