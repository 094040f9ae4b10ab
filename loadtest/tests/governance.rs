//! CI-sized runs of the governance scenario on both store backends: a few policies bound to
//! every simulated cluster, each evaluated by the cluster's agent against its in-memory API;
//! every cluster's verdict on every policy must reach its root Policy's status on the hub
//! (inform NonCompliant, enforce Compliant), every root must aggregate, and the flip of the
//! inform policies to enforce must turn all of them Compliant. Speed is not checked here.

mod common;

use common::{args, trace_init};
use flotilla_loadtest::report::{Outcome, Percentiles};

const CI_AGENTS: u64 = 20;
const CI_POLICIES: u64 = 6;

fn sane(p: &Percentiles, pairs: u64) {
    assert_eq!(p.count, pairs, "one latency per pair: {p:?}");
    assert!(p.ordered(), "{p:?}");
    assert!(
        p.p50_ms > 0.0,
        "a verdict takes an evaluation and a write: {p:?}"
    );
}

/// Runs the scenario on `store` with the child hub at scheduling priority `nice`.
async fn governance(store: &str, nice: i32) {
    trace_init();
    let dir = tempfile::tempdir().unwrap();
    let nice_flag = format!("--hub-nice={nice}");
    let run = args(
        &dir.path().join("out"),
        &[
            "--agents",
            &CI_AGENTS.to_string(),
            "--store",
            store,
            "--scenario",
            "governance",
            "--policies",
            &CI_POLICIES.to_string(),
            "--timeout",
            "120s",
            &nice_flag,
        ],
    );
    let (report, out) = flotilla_loadtest::run(run).await.expect("the run starts");
    eprintln!("{}", flotilla_loadtest::report::table(&report));
    assert_eq!(
        report.hub.nice,
        Some(nice),
        "the hub runs at the priority asked for"
    );
    let s = &report.scenarios[0];
    assert_eq!(s.outcome, Some(Outcome::Completed), "{:?}", s.error);
    let g = s.governance.as_ref().expect("a governance report");
    assert_eq!((g.clusters, g.policies), (CI_AGENTS, CI_POLICIES));
    assert_eq!((g.inform_policies, g.enforce_policies), (3, 3));

    // Every cluster's verdict on every policy reached its root's status, as the template says.
    let pairs = CI_AGENTS * CI_POLICIES;
    assert_eq!((g.pairs, g.reported), (pairs, pairs));
    assert_eq!(g.unexpected, 0, "{:?}", g.unexpected_examples);
    assert_eq!(g.roots_aggregated, CI_POLICIES);
    sane(g.compliance_latency.as_ref().unwrap(), pairs);
    // Every policy stored by every agent, each before its verdict could reach the hub.
    assert_eq!(g.delivered, pairs);
    let (delivery, compliance) = (
        g.delivery_latency.as_ref().unwrap(),
        g.compliance_latency.as_ref().unwrap(),
    );
    sane(delivery, pairs);
    assert!(
        delivery.p50_ms <= compliance.p50_ms && delivery.max_ms <= compliance.max_ms,
        "stored before reported: {delivery:?} vs {compliance:?}"
    );
    let reported = g.time_to_all_reported_s.unwrap();
    let aggregated = g.time_to_all_aggregated_s.unwrap();
    assert!(reported > 0.0 && aggregated >= reported, "{g:?}");
    // At least one record write per cluster and one status write per root: the fan-out of
    // compliance is visible in the store's revision.
    let writes = g.store_writes.unwrap();
    assert!(writes >= CI_AGENTS + CI_POLICIES, "{g:?}");
    assert!(g.store_writes_per_s.unwrap() > 0.0);
    assert!(g.poll_cycle_ms.unwrap() > 0.0);

    // The churn: the three inform policies enforced, Compliant everywhere.
    let c = g.churn.as_ref().expect("a churn report");
    assert_eq!(c.flipped, 3);
    assert_eq!((c.pairs, c.reported), (3 * CI_AGENTS, 3 * CI_AGENTS));
    assert_eq!(c.roots_aggregated, 3);
    sane(c.latency.as_ref().unwrap(), 3 * CI_AGENTS);
    assert!(c.time_to_all_aggregated_s.unwrap() >= c.time_to_all_reported_s.unwrap());
    assert!(c.store_writes_per_cluster.unwrap() >= 1.0, "{c:?}");

    // The JSON report carries the same.
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    let gj = &json["scenarios"][0]["governance"];
    assert_eq!(gj["reported"], pairs);
    assert_eq!(gj["churn"]["reported"], 3 * CI_AGENTS);
    assert_eq!(json["parameters"]["policies"], CI_POLICIES);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_clusters_compliance_reaches_the_hub_and_follows_a_flip_sled() {
    // Less favoured than the agents (a positive value needs no privilege): the scenario's
    // outcome does not depend on the hub's priority.
    governance("sled", 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_clusters_compliance_reaches_the_hub_and_follows_a_flip_kube() {
    governance("kube", 0).await;
}
