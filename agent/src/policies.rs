//! The cluster's governance policies between the durable cache and the governor
//! ([`crate::governance`]): a policy
//! the hub delivers is stored and acked as a work is (same frames, same cache, same resume),
//! then handed to the governor from here; its reports go into the cache's status outbox (latest
//! per policy, until the hub acks it) exactly as a work's status does; a policy removed from
//! the cluster is pruned by the governor and only then released, so the hub forgets its
//! compliance once the spoke is clean.
//!
//! Everything the governor is told comes from the cache, never from a frame: on start every
//! policy the cache holds is handed over at once, so the spoke keeps being evaluated and
//! enforced while the hub is away.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, PoisonError};

use flotilla_proto::api::policy::{ComplianceState, DetailsPerTemplate, Policy, PolicyStatus};
use tokio::sync::{Notify, mpsc};
use tracing::{debug, info, warn};

use crate::cache::{CacheError, CachedWork, WorkCache, durably};
use crate::delivery::MAX_BATCH;
use crate::governance::{DeliveredPolicy, GovernorHandle, PolicyReport};

/// Tells the policy desk which cached policies changed; cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct PolicyHandle {
    queue: Arc<ChangedPolicies>,
}

/// The uids changed since the desk last looked: at most one entry per cached policy. A
/// blocking lock held for one set operation, never across an await.
#[allow(clippy::disallowed_types)]
type ChangedSet = std::sync::Mutex<BTreeSet<String>>;

#[derive(Debug, Default)]
struct ChangedPolicies {
    uids: ChangedSet,
    wake: Notify,
}

impl PolicyHandle {
    /// The cached policy `uid` was stored, replaced or marked deleted.
    pub fn changed(&self, uid: &str) {
        self.queue
            .uids
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(uid.to_owned());
        self.queue.wake.notify_one();
    }

    fn take(&self) -> BTreeSet<String> {
        std::mem::take(
            &mut *self
                .queue
                .uids
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }
}

/// The task between the cache and the governor; see the module docs.
pub struct PolicyDesk {
    cache: Arc<dyn WorkCache>,
    governor: GovernorHandle,
    handle: PolicyHandle,
    reports: mpsc::Receiver<PolicyReport>,
    /// Woken after every new status in the outbox, and every release; the session waits on it.
    outbox_changed: Arc<Notify>,
}

impl PolicyDesk {
    /// A desk handing `cache`'s policies to `governor` and its `reports` to the outbox.
    pub fn new(
        cache: Arc<dyn WorkCache>,
        governor: GovernorHandle,
        reports: mpsc::Receiver<PolicyReport>,
        outbox_changed: Arc<Notify>,
    ) -> (PolicyDesk, PolicyHandle) {
        let handle = PolicyHandle::default();
        let desk = PolicyDesk {
            cache,
            governor,
            handle: handle.clone(),
            reports,
            outbox_changed,
        };
        (desk, handle)
    }

    /// Runs until `shutdown` completes.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        match durably(&self.cache, |c| c.works()).await {
            Ok(works) => {
                for work in works.iter().filter(|w| w.policy) {
                    self.handle.changed(&work.uid);
                }
            }
            Err(e) => {
                warn!(error = %e, "cannot list the cached policies; they are evaluated once the hub resends them")
            }
        }
        loop {
            let changed: Vec<String> = self.handle.take().into_iter().collect();
            for uids in changed.chunks(MAX_BATCH) {
                self.hand_over(uids).await;
            }
            tokio::select! {
                _ = self.handle.queue.wake.notified() => {}
                report = self.reports.recv() => match report {
                    Some(report) => {
                        // With the reports that came in meanwhile: one transaction for all.
                        let mut reports = vec![report];
                        while reports.len() < MAX_BATCH
                            && let Ok(report) = self.reports.try_recv()
                        {
                            reports.push(report);
                        }
                        self.record(reports).await;
                    }
                    // The governor has stopped: the agent is stopping with it.
                    None => return,
                },
                _ = &mut shutdown => return,
            }
        }
    }

    /// Tells the governor what the cache now holds of policies `uids`, read together.
    async fn hand_over(&self, uids: &[String]) {
        let keys = uids.to_vec();
        let read = durably(&self.cache, move |c| {
            let mut held = Vec::with_capacity(keys.len());
            for uid in keys {
                let Some(cached) = c.work(&uid)?.filter(|w| w.policy) else {
                    continue;
                };
                let content = if cached.deleting || cached.refused.is_some() {
                    None
                } else {
                    c.manifest_work(&uid)?
                };
                held.push((cached, content));
            }
            Ok(held)
        })
        .await;
        match read {
            Ok(held) => {
                for (cached, content) in held {
                    self.hand_over_one(cached, content).await;
                }
            }
            Err(e) => {
                warn!(policies = uids.len(), error = %e, "cannot read cached policies; they are handed over at the next change")
            }
        }
    }

    /// Tells the governor what the cache holds of one policy: `cached`, with its content.
    async fn hand_over_one(&self, cached: CachedWork, content: Option<Vec<u8>>) {
        let uid = cached.uid.as_str();
        if cached.deleting {
            if self.governor.remove(uid).await.is_err() {
                // Stopping: the tombstone stays, and the next start prunes and releases it.
                return;
            }
            let key = cached.uid.clone();
            match durably(&self.cache, move |c| c.release(&key)).await {
                Ok(()) => {
                    info!(uid, policy = %cached.display_name(), "policy removed from the spoke's evaluation and released");
                    self.outbox_changed.notify_one();
                }
                Err(e) => warn!(uid, error = %e, "cannot record a policy's release"),
            }
            return;
        }
        match load(&cached, content) {
            Ok(policy) => {
                debug!(uid, policy = %cached.display_name(), generation = cached.generation, "policy handed to the governor");
                let delivered = DeliveredPolicy {
                    uid: uid.to_owned(),
                    generation: cached.generation,
                    policy,
                };
                // Err: stopping, and the next start hands every cached policy over again.
                let _ = self.governor.upsert(delivered).await;
            }
            // The agent holds it but cannot evaluate it: the hub hears why, as its compliance.
            Err(reason) => {
                let _ = self.governor.remove(uid).await;
                self.record(vec![unreadable(&cached, &reason)]).await;
            }
        }
    }

    /// Puts reports in the outbox, in one transaction, but for a policy no longer held (a
    /// report racing the policy's removal has nowhere to go). Of two reports of one policy,
    /// the later one.
    async fn record(&self, reports: Vec<PolicyReport>) {
        let mut latest: BTreeMap<String, (i64, serde_json::Value)> = BTreeMap::new();
        for report in reports {
            match serde_json::to_value(&report.status) {
                Ok(status) => {
                    latest.insert(report.uid, (report.generation, status));
                }
                Err(e) => {
                    warn!(uid = %report.uid, error = %e, "a policy report does not serialise; dropped")
                }
            }
        }
        let uids: Vec<String> = latest.keys().cloned().collect();
        let result = durably(&self.cache, move |c| {
            let mut held = Vec::with_capacity(latest.len());
            let mut dropped = Vec::new();
            for (uid, (generation, status)) in latest {
                match c.work(&uid)? {
                    Some(w) if w.policy && !w.deleting => held.push((uid, generation, status)),
                    _ => dropped.push(uid),
                }
            }
            let recorded = held.len();
            if recorded > 0 {
                c.push_statuses(held)?;
            }
            Ok::<_, CacheError>((recorded, dropped))
        })
        .await;
        match result {
            Ok((recorded, dropped)) => {
                for uid in dropped {
                    debug!(uid, "report of a policy no longer held; dropped");
                }
                if recorded > 0 {
                    self.outbox_changed.notify_one();
                }
            }
            Err(e) => {
                warn!(policies = ?uids, error = %e, "cannot record the policies' compliance")
            }
        }
    }
}

/// The policy as held (`content`, read with it), or why it cannot be evaluated.
fn load(cached: &CachedWork, content: Option<Vec<u8>>) -> Result<Policy, String> {
    if let Some(reason) = &cached.refused {
        return Err(reason.clone());
    }
    let Some(bytes) = content else {
        return Err(
            "the agent holds no content for this policy; the hub resends it on the next session"
                .into(),
        );
    };
    serde_json::from_slice(&bytes).map_err(|e| format!("the policy does not parse: {e}"))
}

/// NonCompliant, with why the agent cannot evaluate the policy at all.
fn unreadable(cached: &CachedWork, reason: &str) -> PolicyReport {
    PolicyReport {
        uid: cached.uid.clone(),
        generation: cached.generation,
        status: PolicyStatus {
            compliant: Some(ComplianceState::NonCompliant),
            details: vec![DetailsPerTemplate {
                compliant: Some(ComplianceState::NonCompliant),
                history: vec![flotilla_proto::api::policy::ComplianceHistory {
                    message: format!(
                        "NonCompliant; the agent cannot evaluate policy {}: {reason}",
                        cached.display_name()
                    ),
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        },
    }
}
