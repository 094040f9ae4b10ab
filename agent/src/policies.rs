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

use std::collections::BTreeSet;
use std::sync::{Arc, PoisonError};

use flotilla_proto::api::policy::{ComplianceState, DetailsPerTemplate, Policy, PolicyStatus};
use tokio::sync::{Notify, mpsc};
use tracing::{debug, info, warn};

use crate::cache::{CacheError, CachedWork, WorkCache, durably};
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
            for uid in self.handle.take() {
                self.hand_over(&uid).await;
            }
            tokio::select! {
                _ = self.handle.queue.wake.notified() => {}
                report = self.reports.recv() => match report {
                    Some(report) => self.record(report).await,
                    // The governor has stopped: the agent is stopping with it.
                    None => return,
                },
                _ = &mut shutdown => return,
            }
        }
    }

    /// Tells the governor what the cache now holds of policy `uid`.
    async fn hand_over(&self, uid: &str) {
        let key = uid.to_owned();
        let cached = match durably(&self.cache, move |c| c.work(&key)).await {
            Ok(Some(cached)) if cached.policy => cached,
            Ok(_) => return,
            Err(e) => {
                warn!(uid, error = %e, "cannot read a cached policy; it is handed over at the next change");
                return;
            }
        };
        if cached.deleting {
            if self.governor.remove(uid).await.is_err() {
                // Stopping: the tombstone stays, and the next start prunes and releases it.
                return;
            }
            let key = uid.to_owned();
            match durably(&self.cache, move |c| c.release(&key)).await {
                Ok(()) => {
                    info!(uid, policy = %cached.display_name(), "policy removed from the spoke's evaluation and released");
                    self.outbox_changed.notify_one();
                }
                Err(e) => warn!(uid, error = %e, "cannot record a policy's release"),
            }
            return;
        }
        match load(&self.cache, &cached).await {
            Ok(Ok(policy)) => {
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
            Ok(Err(reason)) => {
                let _ = self.governor.remove(uid).await;
                self.record(unreadable(&cached, &reason)).await;
            }
            Err(e) => warn!(uid, error = %e, "cannot read a cached policy's content"),
        }
    }

    /// Puts a report in the outbox, unless its policy is no longer held (a report racing the
    /// policy's removal has nowhere to go).
    async fn record(&self, report: PolicyReport) {
        let uid = report.uid.clone();
        let status = match serde_json::to_value(&report.status) {
            Ok(status) => status,
            Err(e) => {
                warn!(uid, error = %e, "a policy report does not serialise; dropped");
                return;
            }
        };
        let generation = report.generation;
        let result = durably(&self.cache, move |c| {
            match c.work(&uid)? {
                Some(w) if w.policy && !w.deleting => {}
                _ => return Ok(false),
            }
            c.push_status(&uid, generation, &status)?;
            Ok::<_, CacheError>(true)
        })
        .await;
        match result {
            Ok(true) => self.outbox_changed.notify_one(),
            Ok(false) => debug!(uid = %report.uid, "report of a policy no longer held; dropped"),
            Err(e) => warn!(uid = %report.uid, error = %e, "cannot record a policy's compliance"),
        }
    }
}

/// The policy as held, or why it cannot be evaluated.
async fn load(
    cache: &Arc<dyn WorkCache>,
    cached: &CachedWork,
) -> Result<Result<Policy, String>, CacheError> {
    if let Some(reason) = &cached.refused {
        return Ok(Err(reason.clone()));
    }
    let uid = cached.uid.clone();
    let Some(bytes) = durably(cache, move |c| c.manifest_work(&uid)).await? else {
        return Ok(Err(
            "the agent holds no content for this policy; the hub resends it on the next session"
                .into(),
        ));
    };
    Ok(serde_json::from_slice(&bytes).map_err(|e| format!("the policy does not parse: {e}")))
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
