//! Writing agents' policy compliance into the store: each cluster's `ClusterCompliance` (one
//! object per cluster, in its namespace, created by the hub's governance controller) holds one
//! entry per root Policy its agent reported on. A report replaces its policy's entry; a policy
//! the agent released (no longer carried, its prune done) loses its entry. Both go through the
//! gateway's [`WriteQueue`], keyed by cluster: every change of a cluster waiting at once is
//! one write (a policy created for the whole fleet costs each cluster one write, not one per
//! policy), fenced by the cluster's shard like every write of the gateway, within its write
//! budget, retried; the agent's status is acknowledged only once it is stored, so its outbox
//! keeps it through any failure.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Weak};

use flotilla_ops::error_chain;
use flotilla_proto::api::Kind;
use flotilla_proto::api::policy::{ClusterComplianceStatus, PolicyCompliance, PolicyStatus};
use flotilla_store::{Basis, Store, StoreError};
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::fencing::{Fencing, Target};
use crate::finalizers::CleanupFinalizers;
use crate::mailbox::Mailbox;
use crate::shards::{Held, ShardViews};
use crate::writes::{Coalesce, Outcome, StoreWrite, WriteBudget, WriteQueue};

/// Most bytes of one report: its per-template details and their history are bounded by the
/// agent; this bounds what an agent can make the gateway parse whatever it sends.
pub const MAX_REPORT_BYTES: usize = 64 * 1024;

/// One policy's change waiting to be written.
#[derive(Clone, Debug)]
enum EntryChange {
    /// Replace the entry with `entry`; acknowledge `seq` on `reporter` once stored.
    Report {
        entry: PolicyCompliance,
        seq: u64,
        reporter: Weak<Mailbox>,
    },
    /// Remove the entry; acknowledge the release on `reporter` once done.
    Release { reporter: Weak<Mailbox> },
}

/// A cluster's changes waiting to be written.
#[derive(Clone, Debug)]
pub struct PendingCompliance {
    cluster: String,
    /// By policy uid.
    changes: BTreeMap<String, EntryChange>,
}

impl Coalesce for PendingCompliance {
    fn cluster(&self) -> &str {
        &self.cluster
    }

    fn absorb(&mut self, newer: PendingCompliance) {
        for (uid, change) in newer.changes {
            let keep_older = matches!(
                (self.changes.get(&uid), &change),
                (Some(EntryChange::Report { seq: old, .. }), EntryChange::Report { seq, .. }) if old > seq
            );
            if !keep_older {
                self.changes.insert(uid, change);
            }
        }
    }
}

/// Why a compliance report was refused; none is retryable with the same frame.
#[derive(Debug, thiserror::Error)]
pub enum ComplianceError {
    /// The report is not a policy status, or too large. Not retryable.
    #[error("compliance of cluster {cluster} for Policy {policy} refused: {reason}")]
    Malformed {
        cluster: String,
        policy: String,
        reason: String,
    },
}

/// The writer of clusters' compliance records; see the module docs.
pub struct ComplianceWriter {
    queue: WriteQueue<PendingCompliance>,
    fencing: Fencing,
}

impl ComplianceWriter {
    /// A writer drawing from the gateway's `budget`, at most `concurrency` writes at once,
    /// each under the fence its queue checked (`fencing`).
    pub fn new(
        budget: Arc<WriteBudget>,
        concurrency: usize,
        shards: ShardViews,
        fencing: Fencing,
    ) -> Arc<ComplianceWriter> {
        Arc::new(ComplianceWriter {
            queue: WriteQueue::new(
                "policy compliance",
                budget,
                concurrency,
                shards,
                fencing.clone(),
            ),
            fencing,
        })
    }

    /// Changes waiting to be written.
    pub fn pending_len(&self) -> usize {
        self.queue.pending_len()
    }

    /// Queues the compliance `cluster`'s agent reported for root Policy `namespace/name`
    /// (`uid`, evaluated at `generation`), to be acknowledged as `seq` on `reporter`'s session.
    #[allow(clippy::too_many_arguments)]
    pub fn submit(
        &self,
        reporter: &Arc<Mailbox>,
        cluster: &str,
        (namespace, name): (&str, &str),
        uid: &str,
        generation: i64,
        seq: u64,
        status_json: &[u8],
    ) -> Result<(), ComplianceError> {
        let malformed = |reason: String| ComplianceError::Malformed {
            cluster: cluster.into(),
            policy: format!("{namespace}/{name}"),
            reason,
        };
        if status_json.len() > MAX_REPORT_BYTES {
            return Err(malformed(format!(
                "{} bytes, more than {MAX_REPORT_BYTES}",
                status_json.len()
            )));
        }
        let status: PolicyStatus =
            serde_json::from_slice(status_json).map_err(|e| malformed(e.to_string()))?;
        let entry = PolicyCompliance {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            uid: uid.to_owned(),
            generation,
            compliant: status.compliant,
            details: status.details,
        };
        self.queue.submit(
            cluster,
            PendingCompliance {
                cluster: cluster.to_owned(),
                changes: BTreeMap::from([(
                    uid.to_owned(),
                    EntryChange::Report {
                        entry,
                        seq,
                        reporter: Arc::downgrade(reporter),
                    },
                )]),
            },
        );
        Ok(())
    }

    /// `cluster`'s agent released `uid`, which is not one of the cluster's works: if it is a
    /// policy with an entry in the cluster's record, the entry goes, then the release is
    /// acknowledged; anything else is handed to `finalizers`, which answers every release
    /// that is no work's of the cluster.
    pub fn release(&self, cluster: &str, uid: &str, reporter: &Arc<Mailbox>) {
        self.queue.submit(
            cluster,
            PendingCompliance {
                cluster: cluster.to_owned(),
                changes: BTreeMap::from([(
                    uid.to_owned(),
                    EntryChange::Release {
                        reporter: Arc::downgrade(reporter),
                    },
                )]),
            },
        );
    }

    /// Writes pending changes until `stop` fires.
    pub async fn run(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        finalizers: Arc<CleanupFinalizers>,
        stop: watch::Receiver<bool>,
    ) {
        let writer = ToStore {
            store: store.as_ref(),
            fencing: &self.fencing,
            finalizers: &finalizers,
        };
        self.queue.run(writer, stop).await;
    }
}

struct ToStore<'a> {
    store: &'a dyn Store,
    fencing: &'a Fencing,
    finalizers: &'a CleanupFinalizers,
}

impl StoreWrite<PendingCompliance> for ToStore<'_> {
    async fn write(&self, _cluster: &str, p: &PendingCompliance, held: Held) -> Outcome {
        let cluster = p.cluster.as_str();
        let record = match self
            .store
            .get(Kind::ClusterCompliance, Some(cluster), cluster)
            .await
        {
            Ok(found) => found,
            Err(e) => {
                warn!(cluster, error = %error_chain(&e), "cannot read the cluster's compliance record; will retry");
                return Outcome::Failed;
            }
        };
        let Some(record) = record else {
            // Releases of no policy entry are the finalizers' to answer; reports wait for the
            // hub's governance controller to create the record (it does as soon as the
            // cluster carries a policy).
            self.hand_over_releases(p, |_| true);
            if p.changes
                .values()
                .any(|c| matches!(c, EntryChange::Report { .. }))
            {
                debug!(
                    cluster,
                    "no compliance record for the cluster yet; the reports wait"
                );
                return Outcome::Failed;
            }
            return Outcome::Done;
        };
        let mut status: ClusterComplianceStatus =
            serde_json::from_value(record["status"].clone()).unwrap_or_default();
        let had: BTreeSet<String> = p
            .changes
            .keys()
            .filter(|uid| status.entry(uid).is_some())
            .cloned()
            .collect();
        // Releases of uids with no entry here are a work's (or nothing's): the finalizers'.
        self.hand_over_releases(p, |uid| !had.contains(uid));
        let before = status.clone();
        for (uid, change) in &p.changes {
            match change {
                EntryChange::Report { entry, .. } => {
                    // Within the record's bounds (history and templates trimmed); a new policy
                    // beyond them is said and acknowledged, so its agent stops resending it.
                    if let Err(e) = status.record(entry.clone()) {
                        warn!(cluster, policy_uid = %uid, error = %e, "policy compliance not stored");
                    }
                }
                EntryChange::Release { .. } => {
                    status.release(uid);
                }
            }
        }
        if status == before {
            ack(p, |uid| had.contains(uid));
            return Outcome::Done;
        }
        let status = match serde_json::to_value(&status) {
            Ok(status) => status,
            Err(e) => {
                warn!(cluster, error = %e, "a compliance record does not serialise; not written");
                return Outcome::Refused;
            }
        };
        let target = Target {
            kind: Kind::ClusterCompliance,
            namespace: Some(cluster),
            name: cluster,
            cluster,
        };
        let basis = Basis::of(&record);
        match self
            .fencing
            .write_status(self.store, target, status, held, None, basis.as_ref())
            .await
        {
            Ok(_) => {
                debug!(
                    cluster,
                    changes = p.changes.len(),
                    "policy compliance stored"
                );
                ack(p, |uid| had.contains(uid));
                Outcome::Done
            }
            // Deleted meanwhile (the cluster carries no policy any more): nothing to keep.
            Err(StoreError::NotFound { .. }) => {
                ack(p, |_| true);
                Outcome::Done
            }
            // Another gateway holds the shard now: not acknowledged, so the agent reports to it.
            Err(StoreError::Fenced { .. }) => Outcome::Refused,
            Err(StoreError::Conflict { .. }) => Outcome::Conflict,
            Err(e) => {
                warn!(cluster, error = %error_chain(&e), "storing policy compliance failed; will retry");
                Outcome::Failed
            }
        }
    }
}

impl ToStore<'_> {
    /// Hands the releases of `p` whose uid `to_finalizers` picks to the cleanup finalizers.
    fn hand_over_releases(&self, p: &PendingCompliance, to_finalizers: impl Fn(&str) -> bool) {
        for (uid, change) in &p.changes {
            if let EntryChange::Release { reporter } = change
                && to_finalizers(uid)
            {
                self.finalizers
                    .release(&p.cluster, uid, reporter.upgrade().as_ref());
            }
        }
    }
}

/// Acknowledges what `p` stored: every report, and the releases of the uids `had_entry`
/// picks (the others went to the finalizers, which acknowledge them).
fn ack(p: &PendingCompliance, had_entry: impl Fn(&str) -> bool) {
    for (uid, change) in &p.changes {
        match change {
            EntryChange::Report { seq, reporter, .. } => {
                if let Some(mailbox) = reporter.upgrade() {
                    mailbox.status_ack(uid, *seq);
                }
            }
            EntryChange::Release { reporter } if had_entry(uid) => {
                if let Some(mailbox) = reporter.upgrade() {
                    mailbox.release_ack(uid);
                }
            }
            EntryChange::Release { .. } => {}
        }
    }
}

#[cfg(test)]
mod tests {
    //! A report lands in its cluster's record and is acknowledged only then; a release takes
    //! the policy's entry out; a release that is no policy's goes on to the finalizers.

    use super::*;
    use crate::fencing::WorkBases;
    use crate::shards::ShardView;
    use crate::test_support::eventually;
    use flotilla_proto::api::policy::empty_cluster_compliance;
    use flotilla_store::SledStore;
    use serde_json::{Value, json};

    fn report(compliant: &str, message: &str) -> Vec<u8> {
        json!({
            "compliant": compliant,
            "details": [{
                "templateMeta": {"name": "policy-namespace-prod"},
                "compliant": compliant,
                // More history than the record keeps: the newest entries stay.
                "history": (0..10).map(|i| json!({"message": format!("{message} {i}")})).collect::<Vec<_>>(),
            }],
        })
        .to_string()
        .into_bytes()
    }

    async fn entries(store: &dyn Store, cluster: &str) -> Vec<Value> {
        store
            .get(Kind::ClusterCompliance, Some(cluster), cluster)
            .await
            .unwrap()
            .and_then(|r| r["status"]["policies"].as_array().cloned())
            .unwrap_or_default()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reports_land_in_the_clusters_record_and_releases_take_them_out() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).unwrap());
        let budget = Arc::new(WriteBudget::new(1000.0, 1000));
        let finalizers = CleanupFinalizers::new(
            budget.clone(),
            4,
            ShardView::all_views(),
            Fencing::default(),
            WorkBases::new(),
        );
        let writer = ComplianceWriter::new(budget, 4, ShardView::all_views(), Fencing::default());
        let (stop_tx, stop) = watch::channel(false);
        // The finalizers answer from the desired state, loaded as on a serving gateway.
        let desired = crate::desired::DesiredState::new();
        tokio::spawn(desired.clone().run(
            store.clone(),
            Arc::new(crate::registry::Registry::default()),
            finalizers.clone(),
            ShardView::all_views(),
            stop.clone(),
        ));
        tokio::spawn(finalizers.clone().run(store.clone(), desired, stop.clone()));
        tokio::spawn(writer.clone().run(store.clone(), finalizers, stop));
        let agent = Arc::new(Mailbox::default());

        // Before the hub made the record, the report waits (not acknowledged).
        writer
            .submit(
                &agent,
                "store-1",
                ("policies", "ns"),
                "uid-1",
                2,
                7,
                &report("NonCompliant", "namespaces [prod] not found"),
            )
            .unwrap();
        store
            .create(serde_json::to_value(empty_cluster_compliance("store-1")).unwrap())
            .await
            .unwrap();
        eventually("the report is stored", || async {
            !entries(store.as_ref(), "store-1").await.is_empty()
        })
        .await;
        let stored = entries(store.as_ref(), "store-1").await;
        assert_eq!(stored.len(), 1);
        let entry = &stored[0];
        assert_eq!(
            (
                &entry["namespace"],
                &entry["name"],
                &entry["uid"],
                &entry["generation"],
                &entry["compliant"]
            ),
            (
                &json!("policies"),
                &json!("ns"),
                &json!("uid-1"),
                &json!(2),
                &json!("NonCompliant")
            )
        );
        let history = entry["details"][0]["history"].as_array().unwrap();
        assert_eq!(
            history.len(),
            flotilla_proto::api::policy::MAX_TEMPLATE_HISTORY
        );
        assert_eq!(history[0]["message"], "namespaces [prod] not found 0");
        eventually("the report is acknowledged", || async {
            agent.take().status_acks == [("uid-1".to_owned(), 7)]
        })
        .await;

        // A second policy and a newer report of the first: one record, both entries.
        writer
            .submit(
                &agent,
                "store-1",
                ("policies", "ns"),
                "uid-1",
                3,
                8,
                &report("Compliant", "namespaces [prod] found"),
            )
            .unwrap();
        writer
            .submit(
                &agent,
                "store-1",
                ("policies", "lr"),
                "uid-2",
                1,
                1,
                &report("Compliant", "limitrange found"),
            )
            .unwrap();
        eventually("both are stored", || async {
            let stored = entries(store.as_ref(), "store-1").await;
            stored.len() == 2 && stored.iter().all(|e| e["compliant"] == "Compliant")
        })
        .await;

        // The agent released the first policy: its entry goes, then the release is acked.
        writer.release("store-1", "uid-1", &agent);
        eventually("the released policy's entry goes", || async {
            let stored = entries(store.as_ref(), "store-1").await;
            stored.len() == 1 && stored[0]["uid"] == "uid-2"
        })
        .await;
        let mut acked = Vec::new();
        eventually("the release is acknowledged", || {
            acked.extend(agent.take().release_acks);
            let done = acked.contains(&"uid-1".to_owned());
            async move { done }
        })
        .await;

        // A release of a uid with no entry (a work gone long ago) is the finalizers' to answer:
        // acknowledged, the record untouched.
        writer.release("store-1", "uid-of-a-work", &agent);
        eventually("the finalizers acknowledge it", || {
            let done = agent
                .take()
                .release_acks
                .contains(&"uid-of-a-work".to_owned());
            async move { done }
        })
        .await;
        assert_eq!(entries(store.as_ref(), "store-1").await.len(), 1);

        // A report that is not a policy status is refused, naming the cluster and the policy.
        let refused = writer
            .submit(
                &agent,
                "store-1",
                ("policies", "ns"),
                "uid-3",
                1,
                1,
                b"[1,2]",
            )
            .unwrap_err()
            .to_string();
        assert!(
            refused.contains("store-1") && refused.contains("policies/ns"),
            "{refused}"
        );
        let _ = stop_tx.send(true);
    }
}
