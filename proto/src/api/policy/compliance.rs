//! `ClusterCompliance` (`governance.flotilla.io/v1alpha1`): what one cluster's agent reported
//! about every root Policy it carries, in one object per cluster.
//!
//! OCM keeps a replicated copy of each root Policy in every selected cluster's namespace and
//! its status holds that cluster's compliance: at 10,000 clusters × 100 policies, a million
//! objects. flotilla keeps one record per cluster instead, in the cluster's namespace and
//! named as the cluster, holding one [`PolicyCompliance`] per root Policy: 10,000 objects. The
//! hub creates it (empty) when the cluster carries its first policy and deletes it once the
//! cluster carries none and nothing is reported in it; the gateway holding the cluster's shard
//! writes its status (a fenced status write, as a ManifestWork's: `status.fence`), replacing
//! the entry of one root Policy (by uid) per report and removing it when the agent releases
//! the policy. The hub aggregates the entries into each root Policy's `status.status[]` and
//! `status.compliant`.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::types::{ComplianceState, DetailsPerTemplate};
use crate::api::serde_util::null_as_default;
use crate::contract::fence::WriteFence;

/// The API group of flotilla's governance records.
pub const COMPLIANCE_GROUP: &str = "governance.flotilla.io";

/// Most root Policies one cluster's record holds an entry for (`status.policies`; the CRD's
/// `maxItems`). A cluster assigned more has the rest of its reports dropped by the gateway
/// (logged, naming the cluster and the policy): those policies stay without a compliance for
/// that cluster (absent in the root's `status.status[]`, so the root never aggregates to
/// Compliant), rather than the whole record being refused.
pub const MAX_CLUSTER_POLICIES: usize = 1_000;

/// Most history entries kept per template in a record (the CRD's `maxItems`): OCM keeps ten on
/// a replicated Policy; here one object holds every policy of the cluster within the store's
/// object bound, so the writer keeps the most recent few.
pub const MAX_TEMPLATE_HISTORY: usize = 3;

/// One cluster's compliance record (its `spec` is empty: everything is reported status).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[kube(
    group = "governance.flotilla.io",
    version = "v1alpha1",
    kind = "ClusterCompliance",
    namespaced,
    status = "ClusterComplianceStatus",
    printcolumn = r#"{"name": "Noncompliant", "type": "string", "jsonPath": ".status.policies[?(@.compliant==\"NonCompliant\")].name"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#,
    derive = "PartialEq",
    derive = "Default",
    doc = "ClusterCompliance is one managed cluster's compliance with every root Policy it carries, in the cluster's namespace and named as the cluster. The hub creates and deletes it; the gateway of the cluster's shard writes its status from the agent's reports."
)]
pub struct ClusterComplianceSpec {}

/// What the cluster's agent reported, one entry per root Policy.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ClusterComplianceStatus {
    /// One entry per root Policy the agent has reported on (at most 1,000, the bound
    /// `MAX_CLUSTER_POLICIES`); each root's uid appears once.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub policies: Vec<PolicyCompliance>,
    /// The fencing record of the last gateway write of this status, as a ManifestWork's
    /// `status.fence`: the store refuses a gateway's write under an older epoch of the same
    /// shard, or of an older report; other writers keep the record as stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<WriteFence>,
}

/// One root Policy's compliance on the record's cluster.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PolicyCompliance {
    /// The root Policy's namespace.
    pub namespace: String,
    /// The root Policy's name.
    pub name: String,
    /// The root Policy's `metadata.uid`: a Policy deleted and created again under the same
    /// name is another policy, and a report of the old one does not count for it.
    pub uid: String,
    /// The root's `metadata.generation` the agent evaluated.
    #[serde(default)]
    pub generation: i64,
    /// NonCompliant if any template is, Pending if any waits, else Compliant; absent before
    /// the first evaluation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compliant: Option<ComplianceState>,
    /// Per template (by `templateMeta.name`): its compliance and most recent history first.
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub details: Vec<DetailsPerTemplate>,
}

/// A report the record cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// The record holds [`MAX_CLUSTER_POLICIES`] entries and this report is on another policy.
    /// Not retryable as it is: it fits once the cluster carries fewer policies (an entry is
    /// released).
    #[error(
        "the compliance record holds {MAX_CLUSTER_POLICIES} policies already; the report on \
         {policy} is dropped until the cluster carries fewer"
    )]
    Full { policy: String },
    /// The report names no root Policy uid, so it could not be matched to its root. Not
    /// retryable: the reporter must send the uid.
    #[error("the report on {policy} names no uid of its root Policy")]
    NoUid { policy: String },
}

impl ClusterComplianceStatus {
    /// The entry of the root Policy with `uid`, if the agent has reported on it.
    pub fn entry(&self, uid: &str) -> Option<&PolicyCompliance> {
        self.policies.iter().find(|p| p.uid == uid)
    }

    /// Takes one report in, as a gateway writes it: the entry of `report.uid` is replaced (or
    /// added, entries kept in namespace/name order), its templates' history cut to the latest
    /// [`MAX_TEMPLATE_HISTORY`] and its templates to [`MAX_POLICY_TEMPLATES`](super::MAX_POLICY_TEMPLATES),
    /// so the record always fits its schema. A new policy beyond [`MAX_CLUSTER_POLICIES`] is
    /// refused and the record left as it was.
    pub fn record(&mut self, mut report: PolicyCompliance) -> Result<(), RecordError> {
        if report.uid.is_empty() {
            return Err(RecordError::NoUid {
                policy: report.qualified_name(),
            });
        }
        report.details.truncate(super::MAX_POLICY_TEMPLATES);
        for template in &mut report.details {
            template.history.truncate(MAX_TEMPLATE_HISTORY);
        }
        if let Some(entry) = self.policies.iter_mut().find(|p| p.uid == report.uid) {
            *entry = report;
            return Ok(());
        }
        if self.policies.len() >= MAX_CLUSTER_POLICIES {
            return Err(RecordError::Full {
                policy: report.qualified_name(),
            });
        }
        let at = self.policies.partition_point(|p| {
            (&p.namespace, &p.name, &p.uid) < (&report.namespace, &report.name, &report.uid)
        });
        self.policies.insert(at, report);
        Ok(())
    }

    /// Removes the entry of `uid` (the agent released the policy); whether there was one.
    pub fn release(&mut self, uid: &str) -> bool {
        let before = self.policies.len();
        self.policies.retain(|p| p.uid != uid);
        self.policies.len() != before
    }
}

impl PolicyCompliance {
    /// `namespace/name` of the root Policy, as the hub's messages name it.
    pub fn qualified_name(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// A record for `cluster`, empty, as the hub creates it.
pub fn empty_cluster_compliance(cluster: &str) -> ClusterCompliance {
    let mut record = ClusterCompliance::new(cluster, ClusterComplianceSpec {});
    record.metadata.namespace = Some(cluster.to_owned());
    record
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::{CustomResourceExt, Resource};
    use serde_json::json;

    fn report(name: &str, uid: &str, compliant: ComplianceState) -> PolicyCompliance {
        use super::super::types::ComplianceHistory;
        PolicyCompliance {
            namespace: "policies".into(),
            name: name.into(),
            uid: uid.into(),
            generation: 1,
            compliant: Some(compliant),
            details: vec![DetailsPerTemplate {
                compliant: Some(compliant),
                history: (0..10)
                    .map(|i| ComplianceHistory {
                        message: format!("event {i}"),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }],
        }
    }

    #[test]
    fn reports_replace_their_entry_by_uid_within_the_bounds() {
        use ComplianceState::*;
        let mut status = ClusterComplianceStatus::default();
        status.record(report("b", "uid-b", NonCompliant)).unwrap();
        status.record(report("a", "uid-a", Compliant)).unwrap();
        let names: Vec<&str> = status.policies.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["a", "b"], "kept in namespace/name order");
        assert_eq!(
            status.entry("uid-b").unwrap().details[0].history.len(),
            MAX_TEMPLATE_HISTORY,
            "only the latest history fits"
        );
        assert_eq!(
            status.entry("uid-b").unwrap().details[0].history[0].message,
            "event 0"
        );
        // The next report on b replaces its entry.
        status.record(report("b", "uid-b", Compliant)).unwrap();
        assert_eq!(status.policies.len(), 2);
        assert_eq!(status.entry("uid-b").unwrap().compliant, Some(Compliant));
        // Released: gone; releasing again says there was nothing.
        assert!(status.release("uid-a"));
        assert!(!status.release("uid-a"));
        assert_eq!(status.policies.len(), 1);
        assert_eq!(
            status.record(report("c", "", Compliant)),
            Err(RecordError::NoUid {
                policy: "policies/c".into()
            })
        );
        // Full: a new policy is refused, an existing one still reports.
        for i in 0..MAX_CLUSTER_POLICIES - 1 {
            status
                .record(report(&format!("p{i:04}"), &format!("uid-{i}"), Compliant))
                .unwrap();
        }
        assert_eq!(status.policies.len(), MAX_CLUSTER_POLICIES);
        let refused = status.record(report("late", "uid-late", NonCompliant));
        assert_eq!(
            refused,
            Err(RecordError::Full {
                policy: "policies/late".into()
            })
        );
        assert!(
            refused
                .unwrap_err()
                .to_string()
                .contains("policies/late is dropped")
        );
        status.record(report("b", "uid-b", NonCompliant)).unwrap();
        assert_eq!(status.entry("uid-b").unwrap().compliant, Some(NonCompliant));
    }

    #[test]
    fn the_record_has_the_agreed_coordinates_and_shape() {
        let crd = ClusterCompliance::crd();
        assert_eq!(crd.spec.group, COMPLIANCE_GROUP);
        assert_eq!(crd.spec.names.plural, "clustercompliances");
        assert_eq!(crd.spec.scope, "Namespaced");
        assert_eq!(
            ClusterCompliance::api_version(&()),
            "governance.flotilla.io/v1alpha1"
        );
        let record: ClusterCompliance = serde_json::from_value(json!({
            "apiVersion": "governance.flotilla.io/v1alpha1",
            "kind": "ClusterCompliance",
            "metadata": {"name": "store-0042", "namespace": "store-0042"},
            "spec": {},
            "status": {
                "policies": [{
                    "namespace": "policies", "name": "policy-namespace", "uid": "5c1d",
                    "generation": 3, "compliant": "NonCompliant",
                    "details": [{
                        "templateMeta": {"name": "policy-namespace-example"},
                        "compliant": "NonCompliant",
                        "history": [{"lastTimestamp": "2026-11-26T22:00:00Z",
                                     "message": "NonCompliant; violation - namespaces [prod] not found"}],
                    }],
                }],
                "fence": {"shard": 7, "epoch": 2, "gateway": "gw-2", "reportSequence": 9},
            },
        }))
        .unwrap();
        let status = record.status.as_ref().unwrap();
        let entry = status.entry("5c1d").unwrap();
        assert_eq!(entry.qualified_name(), "policies/policy-namespace");
        assert_eq!(entry.compliant, Some(ComplianceState::NonCompliant));
        assert_eq!(
            entry.details[0].history[0].message,
            "NonCompliant; violation - namespaces [prod] not found"
        );
        assert_eq!(status.fence.as_ref().map(|f| f.epoch), Some(2));
        assert!(status.entry("other").is_none());
        let empty = serde_json::to_value(empty_cluster_compliance("store-0042")).unwrap();
        assert_eq!(
            empty,
            json!({
                "apiVersion": "governance.flotilla.io/v1alpha1",
                "kind": "ClusterCompliance",
                "metadata": {"name": "store-0042", "namespace": "store-0042"},
                "spec": {},
            })
        );
    }
}
