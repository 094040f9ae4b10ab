//! CI-sized runs of the placement scenarios on both store backends: a Progressive
//! ManifestWorkReplicaSet (10 % at a time, maxFailures 0) that must stop at the window holding
//! the simulated failing cluster and name it, then complete once the fault is fixed; and the
//! scheduler deciding many placements and following label changes. Speed is not checked here.

mod common;

use common::{args, trace_init};
use flotilla_loadtest::report::{Outcome, ScenarioReport};

/// Agents in the CI runs: ten windows of 10 %.
const CI_AGENTS: usize = 100;

async fn rollout(store: &str) {
    trace_init();
    let dir = tempfile::tempdir().unwrap();
    let run = args(
        &dir.path().join("out"),
        &[
            "--agents",
            &CI_AGENTS.to_string(),
            "--store",
            store,
            "--scenario",
            "connect,rollout",
            "--rollout-max-concurrency",
            "10%",
            "--timeout",
            "120s",
        ],
    );
    let (report, _) = flotilla_loadtest::run(run).await.expect("the run starts");
    eprintln!("{}", flotilla_loadtest::report::table(&report));
    let r: &ScenarioReport = &report.scenarios[1];
    assert_eq!(r.outcome, Some(Outcome::Completed), "{:?}", r.error);
    let ro = r.rollout.as_ref().expect("a rollout report");
    assert_eq!(ro.window, 10);
    // The failing cluster is the middle one; it is the one the replica set names.
    assert_eq!(ro.failing_clusters, ["lt-00050"]);
    assert_eq!(ro.reported_failed, ["lt-00050"]);
    assert_eq!(ro.stopped_in_window, Some(6));
    // Stopped near the failure: the failing cluster was reached, and past it only what the
    // sliding window let through before its failure was reported (OCM's Progressive keeps
    // `maxConcurrency` clusters in flight, and a cluster that succeeds frees its slot).
    assert!(
        ro.reached_when_stopped >= 51 && ro.reached_when_stopped <= 50 + 2 * 10,
        "{ro:?}"
    );
    assert!(
        ro.max_in_flight_v1 <= 10 && ro.max_in_flight_v2 <= 10,
        "{ro:?}"
    );
    assert_eq!(ro.reached_v2, CI_AGENTS as u64);
    assert!(ro.complete_after_fix_s.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_progressive_rollout_stops_at_the_failing_cluster_then_completes_sled() {
    rollout("sled").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_progressive_rollout_stops_at_the_failing_cluster_then_completes_kube() {
    rollout("kube").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_decides_every_placement_and_follows_label_changes() {
    trace_init();
    let dir = tempfile::tempdir().unwrap();
    let run = args(
        &dir.path().join("out"),
        &[
            "--agents",
            "200",
            "--scenario",
            "schedule",
            "--placements",
            "50",
            "--placement-clusters",
            "5",
            "--regions",
            "4",
            "--label-changes",
            "5",
            "--timeout",
            "120s",
        ],
    );
    let (report, _) = flotilla_loadtest::run(run).await.expect("the run starts");
    eprintln!("{}", flotilla_loadtest::report::table(&report));
    let s = &report.scenarios[0];
    assert_eq!(s.outcome, Some(Outcome::Completed), "{:?}", s.error);
    let sc = s.schedule.as_ref().expect("a schedule report");
    assert_eq!(sc.clusters, 200);
    let latency = sc.decision_latency.as_ref().unwrap();
    assert_eq!(latency.count, 50, "every placement decided");
    assert!(latency.ordered());
    assert!(sc.single_placement_s.is_some());
    assert_eq!(sc.label_changes, 5);
    // Each of the 50 placements picks 5 of the 50 clusters of its region: a relabelled
    // cluster sits in some decisions, and each of those was followed.
    let per = sc.label_change_per_decision.as_ref().unwrap();
    assert_eq!(per.count, sc.affected_decisions);
    assert!(sc.hub_rss_after_bytes.unwrap() > 0);
}
