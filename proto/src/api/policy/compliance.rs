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

impl ClusterComplianceStatus {
    /// The entry of the root Policy with `uid`, if the agent has reported on it.
    pub fn entry(&self, uid: &str) -> Option<&PolicyCompliance> {
        self.policies.iter().find(|p| p.uid == uid)
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
