//! A ManagedCluster's health as the store records it (the gateway's last health writes): the
//! admission cache keeps it with each cluster's admission, and the health writer compares a
//! session's reports with it, so a reconnect or a report that changes nothing writes nothing.

use std::collections::BTreeMap;

use flotilla_proto::api::conditions::{
    self, MANAGED_CLUSTER_CONDITION_AVAILABLE, MANAGED_CLUSTER_JOINED,
};
use flotilla_proto::contract::UNREACHABLE_TAINT;
use flotilla_proto::wire;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use serde_json::Value;

/// A ManagedCluster's health as stored: what a connect would otherwise write again.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecordedHealth {
    /// Joined and Available are both True.
    pub available: bool,
    /// It carries the unreachable taint.
    pub unreachable: bool,
    /// `status.version.kubernetes`.
    pub kubernetes_version: String,
    /// `status.clusterClaims` as (name, value).
    pub claims: Vec<(String, String)>,
    /// `status.capacity` and `status.allocatable`, quantities as written.
    pub capacity: BTreeMap<String, String>,
    pub allocatable: BTreeMap<String, String>,
}

impl RecordedHealth {
    /// Reads a stored ManagedCluster.
    pub fn from_object(obj: &Value) -> RecordedHealth {
        let conds = read_conditions(&obj["status"]);
        let is_true = |t: &str| conditions::is_condition_true(&conds, t);
        RecordedHealth {
            available: is_true(MANAGED_CLUSTER_JOINED)
                && is_true(MANAGED_CLUSTER_CONDITION_AVAILABLE),
            unreachable: obj["spec"]["taints"]
                .as_array()
                .is_some_and(|t| t.iter().any(|t| t["key"] == UNREACHABLE_TAINT)),
            kubernetes_version: obj["status"]["version"]["kubernetes"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            claims: obj["status"]["clusterClaims"]
                .as_array()
                .map(|claims| {
                    claims
                        .iter()
                        .map(|c| {
                            let field = |f: &str| c[f].as_str().unwrap_or_default().to_string();
                            (field("name"), field("value"))
                        })
                        .collect()
                })
                .unwrap_or_default(),
            capacity: resource_list(&obj["status"]["capacity"]),
            allocatable: resource_list(&obj["status"]["allocatable"]),
        }
    }

    /// Whether storing this report would change nothing.
    pub(crate) fn shows_info(&self, info: &wire::ClusterInfo) -> bool {
        let claims: Vec<(String, String)> = info
            .claims
            .iter()
            .map(|c| (c.name.clone(), c.value.clone()))
            .collect();
        claims == self.claims
            && (info.kubernetes_version.is_empty()
                || info.kubernetes_version == self.kubernetes_version)
            && info.capacity == self.capacity
            && info.allocatable == self.allocatable
    }

    /// Whether marking the cluster Available for this hello would change nothing.
    pub(crate) fn already_shows(&self, hello: &wire::Hello) -> bool {
        let claims: Vec<(String, String)> = hello
            .claims
            .iter()
            .map(|c| (c.name.clone(), c.value.clone()))
            .collect();
        self.available
            && !self.unreachable
            && (hello.kubernetes_version.is_empty()
                || hello.kubernetes_version == self.kubernetes_version)
            && (claims.is_empty() || claims == self.claims)
    }
}

/// A stored resource list (`status.capacity`), quantities as strings (numbers as written).
pub(crate) fn resource_list(list: &Value) -> BTreeMap<String, String> {
    list.as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    let q = match v {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    (k.clone(), q)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A stored status's conditions; none when they do not parse.
pub(crate) fn read_conditions(status: &Value) -> Vec<Condition> {
    status
        .get("conditions")
        .cloned()
        .and_then(|c| serde_json::from_value(c).ok())
        .unwrap_or_default()
}
