//! Policy compliance on `/metrics` as Red Hat ACM's governance exposes it, so that its alerts
//! and dashboards work unchanged: the gauge `policy_governance_info` (no `flotilla_` prefix)
//! with labels `type` (`root` or `propagated`), `policy`, `policy_namespace` and
//! `cluster_namespace`, 0 for Compliant and 1 for NonCompliant.
//!
//! Where flotilla differs, on purpose: a root or cluster with no verdict yet (Pending, or not
//! reported) is -1, where OCM's propagator leaves the gauge unset (0, "compliant", when new);
//! and the propagated series (one per policy per cluster in OCM: a million at 10,000 clusters ×
//! 100 policies) are bounded by `--policy-metrics-max-propagated`, non-compliant first, then
//! those without a verdict, then compliant ones, with `flotilla_hub_policy_series_omitted`
//! counting what was left out. A root series has `cluster_namespace="<null>"`, OCM's sentinel;
//! a disabled policy has no series, as in OCM.
//!
//! Read at scrape time from the governance controller's last aggregation
//! ([`ComplianceView`]): a scrape costs one pass over it and nothing in the store.

use flotilla_proto::api::policy::ComplianceState;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;

use crate::controllers::governance::{ComplianceSnapshot, ComplianceView};

/// Default of `--policy-metrics-max-propagated`.
pub const DEFAULT_MAX_PROPAGATED: usize = 10_000;

/// The metric's name, as RHACM's.
pub const METRIC: &str = "policy_governance_info";

/// OCM's value of `cluster_namespace` on a root series.
const ROOT_CLUSTER_NAMESPACE: &str = "<null>";

/// One sample of [`METRIC`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Series {
    /// `root` or `propagated`.
    pub type_: &'static str,
    pub policy: String,
    pub policy_namespace: String,
    pub cluster_namespace: String,
    pub value: i64,
}

/// 0 Compliant, 1 NonCompliant, -1 anything else (Pending, or no report yet).
pub fn value(compliant: Option<ComplianceState>) -> i64 {
    match compliant {
        Some(ComplianceState::Compliant) => 0,
        Some(ComplianceState::NonCompliant) => 1,
        _ => -1,
    }
}

/// Every root series, and at most `max_propagated` propagated ones (non-compliant first, then
/// those without a verdict, then compliant, each in the snapshot's order: by policy, then by
/// cluster); the second value is how many propagated series were left out.
pub fn series(snapshot: &ComplianceSnapshot, max_propagated: usize) -> (Vec<Series>, usize) {
    let mut out: Vec<Series> = snapshot
        .policies
        .iter()
        .map(|p| Series {
            type_: "root",
            policy: p.key.name.clone(),
            policy_namespace: p.key.namespace.clone(),
            cluster_namespace: ROOT_CLUSTER_NAMESPACE.to_owned(),
            value: value(p.compliant),
        })
        .collect();
    let total: usize = snapshot.policies.iter().map(|p| p.clusters.len()).sum();
    let mut room = max_propagated;
    for wanted in [1, -1, 0] {
        for p in &snapshot.policies {
            for (cluster, compliant) in p.clusters.iter() {
                if room == 0 {
                    break;
                }
                if value(*compliant) != wanted {
                    continue;
                }
                out.push(Series {
                    type_: "propagated",
                    policy: p.key.name.clone(),
                    policy_namespace: p.key.namespace.clone(),
                    cluster_namespace: cluster.clone(),
                    value: wanted,
                });
                room -= 1;
            }
        }
    }
    let shown = max_propagated - room;
    (out, total - shown)
}

/// The collector registered on the hub's `/metrics`.
#[derive(Debug)]
pub struct GovernanceMetrics {
    view: ComplianceView,
    max_propagated: usize,
}

impl GovernanceMetrics {
    pub fn new(view: ComplianceView, max_propagated: usize) -> GovernanceMetrics {
        GovernanceMetrics {
            view,
            max_propagated,
        }
    }
}

impl Collector for GovernanceMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let (series, omitted) = series(&self.view.snapshot(), self.max_propagated);
        let family = ConstGauge::new(0i64);
        let mut metric = encoder.encode_descriptor(
            METRIC,
            "The compliance status of the named policy: 0 Compliant, 1 NonCompliant, -1 \
             Pending or not reported yet (type root: the policy's aggregate; type propagated: \
             one cluster's, at most --policy-metrics-max-propagated series, non-compliant first)",
            None,
            family.metric_type(),
        )?;
        for s in &series {
            let labels = [
                ("type", s.type_),
                ("policy", s.policy.as_str()),
                ("policy_namespace", s.policy_namespace.as_str()),
                ("cluster_namespace", s.cluster_namespace.as_str()),
            ];
            ConstGauge::new(s.value).encode(metric.encode_family(&labels)?)?;
        }
        let omitted_gauge = ConstGauge::new(i64::try_from(omitted).unwrap_or(i64::MAX));
        omitted_gauge.encode(encoder.encode_descriptor(
            "flotilla_hub_policy_series_omitted",
            "Propagated policy_governance_info series (one policy on one cluster) left out by \
             --policy-metrics-max-propagated",
            None,
            omitted_gauge.metric_type(),
        )?)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controllers::governance::RootCompliance;
    use crate::controllers::scheduling::fleet::Key;
    use ComplianceState::*;

    fn snapshot() -> ComplianceSnapshot {
        ComplianceSnapshot {
            policies: vec![
                RootCompliance {
                    key: Key::new("policies", "limits"),
                    compliant: Some(Compliant),
                    clusters: vec![("c1".into(), Some(Compliant))].into(),
                },
                RootCompliance {
                    key: Key::new("policies", "namespace"),
                    compliant: Some(NonCompliant),
                    clusters: vec![
                        ("c1".into(), Some(Compliant)),
                        ("c2".into(), Some(NonCompliant)),
                        ("c3".into(), None),
                        ("c4".into(), Some(Pending)),
                    ]
                    .into(),
                },
                RootCompliance {
                    key: Key::new("policies", "new"),
                    compliant: None,
                    clusters: vec![].into(),
                },
            ],
        }
    }

    fn short(series: &[Series]) -> Vec<(&str, &str, &str, i64)> {
        series
            .iter()
            .map(|s| {
                (
                    s.type_,
                    s.policy.as_str(),
                    s.cluster_namespace.as_str(),
                    s.value,
                )
            })
            .collect()
    }

    #[test]
    fn roots_always_and_propagated_within_the_bound_failing_first() {
        let (all, omitted) = series(&snapshot(), 100);
        assert_eq!(omitted, 0);
        assert_eq!(
            short(&all),
            [
                ("root", "limits", "<null>", 0),
                ("root", "namespace", "<null>", 1),
                ("root", "new", "<null>", -1),
                ("propagated", "namespace", "c2", 1),
                ("propagated", "namespace", "c3", -1),
                ("propagated", "namespace", "c4", -1),
                ("propagated", "limits", "c1", 0),
                ("propagated", "namespace", "c1", 0),
            ]
        );
        assert!(all.iter().all(|s| s.policy_namespace == "policies"));
        let (bounded, omitted) = series(&snapshot(), 2);
        assert_eq!(omitted, 3);
        assert_eq!(
            short(&bounded)[3..],
            [
                ("propagated", "namespace", "c2", 1),
                ("propagated", "namespace", "c3", -1)
            ]
        );
        let (none, omitted) = series(&snapshot(), 0);
        assert_eq!((none.len(), omitted), (3, 5), "roots are never left out");
    }

    #[test]
    fn the_page_has_ocms_metric_and_what_was_left_out() {
        let view = ComplianceView::default();
        view.publish(snapshot());
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(GovernanceMetrics::new(view, 1)));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "# TYPE policy_governance_info gauge",
            r#"policy_governance_info{type="root",policy="namespace",policy_namespace="policies",cluster_namespace="<null>"} 1"#,
            r#"policy_governance_info{type="propagated",policy="namespace",policy_namespace="policies",cluster_namespace="c2"} 1"#,
            "flotilla_hub_policy_series_omitted 4",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} not in:\n{text}");
        }
    }
}
