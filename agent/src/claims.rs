//! What the agent tells the hub about its spoke: OCM's ClusterClaims (the built-in ones it makes
//! itself and the spoke's `ClusterClaim` objects), the Kubernetes version, and the capacity and
//! allocatable resources summed over the nodes. The hub stores them in the ManagedCluster's
//! status, where placements select and rank clusters by them.
//!
//! One watch of Nodes and one of ClusterClaims on the spoke keep a [`ClusterFacts`] current;
//! every change recomputes the report and publishes it only if it differs, so the session sends
//! a `ClusterInfo` frame when something changed and never on a timer. Deciding what the report
//! says ([`ClusterFacts::report`]) is pure and tested here; the watching around it is thin.

use std::collections::BTreeMap;
use std::time::Duration;

use flotilla_proto::api::ClusterClaim;
use flotilla_proto::api::quantity::{Milli, format_quantity, parse_quantity};
use flotilla_proto::contract::claims;
use flotilla_proto::wire;
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio::sync::watch;
use tracing::{debug, info, warn};

/// How long between reads of the `kube-system` namespace while it cannot be read.
const ID_RETRY: Duration = Duration::from_secs(30);

/// What the agent knows about its spoke's nodes and claims. The report is derived from it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClusterFacts {
    /// The spoke apiserver's gitVersion; empty while unknown.
    pub kubernetes_version: String,
    /// The uid of the spoke's `kube-system` namespace: OCM's cluster id.
    pub cluster_id: Option<String>,
    /// Nodes by name.
    pub nodes: BTreeMap<String, NodeFacts>,
    /// ClusterClaim objects on the spoke by name: (value, spoke-only).
    pub custom: BTreeMap<String, (String, bool)>,
}

/// The parts of a Node the report needs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeFacts {
    /// `spec.providerID`, e.g. `aws:///eu-west-1a/i-0abc`.
    pub provider_id: String,
    /// Unschedulable nodes add capacity but no allocatable resources (as in OCM).
    pub unschedulable: bool,
    pub capacity: BTreeMap<String, String>,
    pub allocatable: BTreeMap<String, String>,
    /// Whether the node carries a label that names its distribution (OpenShift, AKS, ...).
    pub product_hint: Option<&'static str>,
}

impl NodeFacts {
    pub fn from_node(node: &Node) -> NodeFacts {
        let quantities = |m: Option<
            &BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
        >| {
            m.map(|m| m.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect())
                .unwrap_or_default()
        };
        let labels = node.metadata.labels.as_ref();
        let has = |l: &str| labels.is_some_and(|ls| ls.keys().any(|k| k.starts_with(l)));
        let product_hint = if has("node.openshift.io/") {
            Some("OpenShift")
        } else if has("kubernetes.azure.com/") {
            Some("AKS")
        } else if has("eks.amazonaws.com/") {
            Some("EKS")
        } else if has("cloud.google.com/gke-") {
            Some("GKE")
        } else {
            None
        };
        NodeFacts {
            provider_id: node
                .spec
                .as_ref()
                .and_then(|s| s.provider_id.clone())
                .unwrap_or_default(),
            unschedulable: node
                .spec
                .as_ref()
                .and_then(|s| s.unschedulable)
                .unwrap_or(false),
            capacity: quantities(node.status.as_ref().and_then(|s| s.capacity.as_ref())),
            allocatable: quantities(node.status.as_ref().and_then(|s| s.allocatable.as_ref())),
            product_hint,
        }
    }
}

impl ClusterFacts {
    /// The report for the hub: the built-in claims first (by name), then up to
    /// [`claims::MAX_CUSTOM`] custom claims by name (those labelled spoke-only stay on the
    /// spoke; a custom claim may not shadow a built-in one), the version, and the resource sums.
    pub fn report(&self) -> wire::ClusterInfo {
        let mut builtin: Vec<wire::ClusterClaim> = Vec::new();
        let mut add = |name: &str, value: String| {
            if !value.is_empty() {
                builtin.push(wire::ClusterClaim {
                    name: name.to_string(),
                    value,
                });
            }
        };
        add(claims::ID, self.cluster_id.clone().unwrap_or_default());
        add(claims::KUBE_VERSION, self.kubernetes_version.clone());
        add(claims::PLATFORM, self.platform().to_string());
        add(claims::PRODUCT, self.product().to_string());
        add(claims::NODE_COUNT, self.nodes.len().to_string());
        builtin.sort_by(|a, b| a.name.cmp(&b.name));
        let custom = self
            .custom
            .iter()
            .filter(|(name, (_, spoke_only))| {
                !spoke_only && !claims::RESERVED.contains(&name.as_str())
            })
            .take(claims::MAX_CUSTOM)
            .map(|(name, (value, _))| wire::ClusterClaim {
                name: name.clone(),
                value: value.chars().take(claims::MAX_VALUE_BYTES).collect(),
            });
        let mut capacity: BTreeMap<String, Milli> = BTreeMap::new();
        let mut allocatable: BTreeMap<String, Milli> = BTreeMap::new();
        for node in self.nodes.values() {
            sum_into(&mut capacity, &node.capacity);
            if !node.unschedulable {
                sum_into(&mut allocatable, &node.allocatable);
            }
        }
        wire::ClusterInfo {
            claims: builtin.into_iter().chain(custom).collect(),
            kubernetes_version: self.kubernetes_version.clone(),
            capacity: format_list(capacity),
            allocatable: format_list(allocatable),
        }
    }

    /// Custom claims beyond the bound, which stay on the spoke.
    pub fn dropped_custom_claims(&self) -> usize {
        self.custom
            .iter()
            .filter(|(name, (_, spoke_only))| {
                !spoke_only && !claims::RESERVED.contains(&name.as_str())
            })
            .count()
            .saturating_sub(claims::MAX_CUSTOM)
    }

    /// The infrastructure, from the first node's provider id; `Other` when none says.
    fn platform(&self) -> &'static str {
        const PROVIDERS: [(&str, &str); 8] = [
            ("aws://", "AWS"),
            ("gce://", "GCP"),
            ("azure://", "Azure"),
            ("ibm://", "IBM"),
            ("vsphere://", "VSphere"),
            ("openstack://", "OpenStack"),
            ("alicloud://", "AlibabaCloud"),
            ("kind://", "Kind"),
        ];
        self.nodes
            .values()
            .find_map(|n| {
                PROVIDERS
                    .iter()
                    .find(|(prefix, _)| n.provider_id.starts_with(prefix))
                    .map(|(_, name)| *name)
            })
            .unwrap_or("Other")
    }

    /// The distribution, from node labels or the version string; `Other` when neither says.
    fn product(&self) -> &'static str {
        if let Some(p) = self.nodes.values().find_map(|n| n.product_hint) {
            return p;
        }
        let v = self.kubernetes_version.to_ascii_lowercase();
        for (marker, product) in [
            ("-eks-", "EKS"),
            ("-gke.", "GKE"),
            ("+k3s", "K3s"),
            ("+rke2", "RKE2"),
            ("-iks", "IKS"),
        ] {
            if v.contains(marker) {
                return product;
            }
        }
        "Other"
    }
}

fn sum_into(total: &mut BTreeMap<String, Milli>, list: &BTreeMap<String, String>) {
    for (name, q) in list {
        match parse_quantity(q) {
            Some(m) => {
                let entry = total.entry(name.clone()).or_default();
                entry.0 = entry.0.saturating_add(m.0);
            }
            None => {
                debug!(resource = %name, quantity = %q, "a node reports a quantity that does not parse; left out")
            }
        }
    }
}

fn format_list(list: BTreeMap<String, Milli>) -> BTreeMap<String, String> {
    list.into_iter()
        .map(|(name, q)| {
            // cpu in cores or millicores, byte-sized resources with binary suffixes.
            let binary =
                name == "memory" || name.contains("storage") || name.starts_with("hugepages");
            let text = format_quantity(q, binary);
            (name, text)
        })
        .collect()
}

/// What the agent reports about its spoke, and the task that keeps it current until it is
/// dropped: watches Nodes and ClusterClaims, reads the cluster id once, follows `version`, and
/// publishes each new report. A spoke without the ClusterClaim CRD reports only built-in
/// claims (said once in the log). The task ends on its own only if a watch stream ends, which
/// its owner reports.
pub fn collect(
    client: kube::Client,
    version: watch::Receiver<String>,
) -> (
    watch::Receiver<wire::ClusterInfo>,
    impl Future<Output = ()> + Send + 'static,
) {
    let (tx, rx) = watch::channel(wire::ClusterInfo::default());
    let task = async move {
        let mut version = version;
        let mut facts = ClusterFacts {
            kubernetes_version: version.borrow().clone(),
            ..ClusterFacts::default()
        };
        let nodes = watcher::watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
            .default_backoff();
        let custom = watcher::watcher(
            Api::<ClusterClaim>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff();
        let mut nodes = std::pin::pin!(nodes);
        let mut custom = std::pin::pin!(custom);
        let mut id = std::pin::pin!(read_cluster_id(client));
        let mut id_known = false;
        let mut warned_claims = false;
        let mut warned_nodes = false;
        let mut version_open = true;
        let mut warned_dropped = 0;
        // Buffers of a relist, swapped in whole at InitDone.
        let mut node_init: Option<BTreeMap<String, NodeFacts>> = None;
        let mut claim_init: Option<BTreeMap<String, (String, bool)>> = None;
        loop {
            tokio::select! {
                event = next(&mut nodes) => match event {
                    Some(Ok(e)) => apply_node(&mut facts.nodes, &mut node_init, e),
                    Some(Err(e)) if !warned_nodes => {
                        warned_nodes = true;
                        warn!(error = %e, "cannot watch the spoke's nodes; node count and resources stay unknown until it can (retrying)");
                    }
                    Some(Err(_)) => {}
                    None => return,
                },
                event = next(&mut custom) => match event {
                    Some(Ok(e)) => apply_claim(&mut facts.custom, &mut claim_init, e),
                    Some(Err(e)) if !warned_claims => {
                        warned_claims = true;
                        if not_found(&e) {
                            info!("the spoke serves no ClusterClaims (their CRD is not installed); reporting built-in claims only until it does");
                        } else {
                            warn!(error = %e, "cannot watch ClusterClaims on the spoke; reporting built-in claims only (retrying)");
                        }
                    }
                    Some(Err(_)) => {}
                    None => return,
                },
                uid = &mut id, if !id_known => {
                    id_known = true;
                    facts.cluster_id = Some(uid);
                }
                changed = version.changed(), if version_open => {
                    if changed.is_err() {
                        // The version's reader is done: it stays what it is.
                        version_open = false;
                        continue;
                    }
                    facts.kubernetes_version = version.borrow().clone();
                }
            }
            let dropped = facts.dropped_custom_claims();
            if dropped > 0 && dropped != warned_dropped {
                warn!(
                    dropped,
                    max = claims::MAX_CUSTOM,
                    "more custom ClusterClaims than the hub takes; those beyond the first by name stay on the spoke"
                );
            }
            warned_dropped = dropped;
            let report = facts.report();
            tx.send_if_modified(|current| {
                if *current == report {
                    false
                } else {
                    debug!(
                        claims = report.claims.len(),
                        nodes = facts.nodes.len(),
                        "spoke facts changed"
                    );
                    *current = report;
                    true
                }
            });
        }
    };
    (rx, task)
}

/// Whether the watch failed because the spoke does not serve the resource at all.
fn not_found(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s)) => s.code == 404,
        _ => false,
    }
}

async fn next<S: Stream + Unpin>(s: &mut S) -> Option<S::Item> {
    s.next().await
}

fn apply_node(
    nodes: &mut BTreeMap<String, NodeFacts>,
    init: &mut Option<BTreeMap<String, NodeFacts>>,
    event: Event<Node>,
) {
    let name = |n: &Node| n.metadata.name.clone().unwrap_or_default();
    match event {
        Event::Apply(n) => {
            nodes.insert(name(&n), NodeFacts::from_node(&n));
        }
        Event::Delete(n) => {
            nodes.remove(&name(&n));
        }
        Event::Init => *init = Some(BTreeMap::new()),
        Event::InitApply(n) => {
            if let Some(buf) = init.as_mut() {
                buf.insert(name(&n), NodeFacts::from_node(&n));
            }
        }
        Event::InitDone => {
            if let Some(buf) = init.take() {
                *nodes = buf;
            }
        }
    }
}

fn apply_claim(
    custom: &mut BTreeMap<String, (String, bool)>,
    init: &mut Option<BTreeMap<String, (String, bool)>>,
    event: Event<ClusterClaim>,
) {
    let entry = |c: &ClusterClaim| {
        let spoke_only = c
            .metadata
            .labels
            .as_ref()
            .is_some_and(|l| l.contains_key(claims::SPOKE_ONLY_LABEL));
        (
            c.metadata.name.clone().unwrap_or_default(),
            (c.spec.value.clone(), spoke_only),
        )
    };
    match event {
        Event::Apply(c) => {
            let (k, v) = entry(&c);
            custom.insert(k, v);
        }
        Event::Delete(c) => {
            custom.remove(&entry(&c).0);
        }
        Event::Init => *init = Some(BTreeMap::new()),
        Event::InitApply(c) => {
            if let Some(buf) = init.as_mut() {
                let (k, v) = entry(&c);
                buf.insert(k, v);
            }
        }
        Event::InitDone => {
            if let Some(buf) = init.take() {
                *custom = buf;
            }
        }
    }
}

/// The uid of `kube-system`, read until it answers.
async fn read_cluster_id(client: kube::Client) -> String {
    let api: Api<Namespace> = Api::all(client);
    let mut warned = false;
    loop {
        match api.get("kube-system").await {
            Ok(ns) => {
                if let Some(uid) = ns.metadata.uid {
                    return uid;
                }
            }
            Err(e) if !warned => {
                warned = true;
                warn!(error = %e, "cannot read the spoke's kube-system namespace for its cluster id; retrying");
            }
            Err(_) => {}
        }
        tokio::time::sleep(ID_RETRY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(provider: &str, cpu: &str, memory: &str, unschedulable: bool) -> NodeFacts {
        NodeFacts {
            provider_id: provider.into(),
            unschedulable,
            capacity: [
                ("cpu".to_string(), cpu.to_string()),
                ("memory".to_string(), memory.to_string()),
            ]
            .into(),
            allocatable: [
                ("cpu".to_string(), cpu.to_string()),
                ("memory".to_string(), memory.to_string()),
            ]
            .into(),
            product_hint: None,
        }
    }

    fn claim_map(report: &wire::ClusterInfo) -> Vec<(String, String)> {
        report
            .claims
            .iter()
            .map(|c| (c.name.clone(), c.value.clone()))
            .collect()
    }

    #[test]
    fn built_in_claims_come_first_then_custom_ones_by_name() {
        let facts = ClusterFacts {
            kubernetes_version: "v1.36.3".into(),
            cluster_id: Some("uid-1".into()),
            nodes: [
                (
                    "n1".to_string(),
                    node("aws:///eu-west-1a/i-1", "4", "16Gi", false),
                ),
                (
                    "n2".to_string(),
                    node("aws:///eu-west-1b/i-2", "2500m", "8Gi", false),
                ),
            ]
            .into(),
            custom: [
                (
                    "region.example.com".to_string(),
                    ("eu-west".to_string(), false),
                ),
                ("a.example.com".to_string(), ("first".to_string(), false)),
                (
                    "secret.example.com".to_string(),
                    ("local".to_string(), true),
                ),
                (claims::PLATFORM.to_string(), ("spoofed".to_string(), false)),
            ]
            .into(),
        };
        let report = facts.report();
        assert_eq!(
            claim_map(&report),
            [
                (claims::ID, "uid-1"),
                (claims::KUBE_VERSION, "v1.36.3"),
                (claims::NODE_COUNT, "2"),
                (claims::PLATFORM, "AWS"),
                (claims::PRODUCT, "Other"),
                ("a.example.com", "first"),
                ("region.example.com", "eu-west"),
            ]
            .map(|(n, v)| (n.to_string(), v.to_string()))
        );
        assert_eq!(report.capacity["cpu"], "6500m");
        assert_eq!(report.capacity["memory"], "24Gi");
        assert_eq!(report.kubernetes_version, "v1.36.3");
    }

    #[test]
    fn unschedulable_nodes_add_capacity_but_not_allocatable() {
        let facts = ClusterFacts {
            nodes: [
                ("n1".to_string(), node("", "4", "16Gi", false)),
                ("n2".to_string(), node("", "4", "16Gi", true)),
            ]
            .into(),
            ..Default::default()
        };
        let report = facts.report();
        assert_eq!(report.capacity["cpu"], "8");
        assert_eq!(report.allocatable["cpu"], "4");
        assert_eq!(report.allocatable["memory"], "16Gi");
    }

    #[test]
    fn custom_claims_beyond_the_bound_stay_on_the_spoke() {
        let facts = ClusterFacts {
            custom: (0..30)
                .map(|i| (format!("c{i:02}.example.com"), ("v".to_string(), false)))
                .collect(),
            ..Default::default()
        };
        let report = facts.report();
        let custom: Vec<_> = report
            .claims
            .iter()
            .filter(|c| c.name.ends_with("example.com"))
            .collect();
        assert_eq!(custom.len(), claims::MAX_CUSTOM);
        assert_eq!(custom[0].name, "c00.example.com");
        assert_eq!(facts.dropped_custom_claims(), 10);
        assert!(flotilla_proto::contract::check_cluster_info(&report).is_ok());
    }

    #[test]
    fn product_comes_from_labels_or_the_version() {
        let mut facts = ClusterFacts {
            kubernetes_version: "v1.30.4-eks-a737599".into(),
            ..Default::default()
        };
        assert_eq!(facts.product(), "EKS");
        facts.kubernetes_version = "v1.31.1+k3s1".into();
        assert_eq!(facts.product(), "K3s");
        let mut n = node("", "1", "1Gi", false);
        n.product_hint = Some("OpenShift");
        facts.nodes.insert("n".into(), n);
        assert_eq!(facts.product(), "OpenShift");
    }
}
