//! A CI-sized run of every scenario against a real hub (a child process), agents split over
//! worker processes, and the report checked for internal consistency: every agent accounted
//! for, no status lost or duplicated, percentiles ordered. Speed is not checked here.

mod common;

use std::time::Duration;

use common::{args, trace_init};
use flotilla_loadtest::report::{Outcome, Report, SCHEMA};

/// Agents in the CI run: enough for hundreds of concurrent sessions, small enough for debug
/// builds on 2 shared cores.
const CI_AGENTS: u64 = 200;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ci_sized_run_of_every_scenario_accounts_for_every_agent() {
    trace_init();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let run = args(
        &out,
        &[
            "--agents",
            &CI_AGENTS.to_string(),
            "--processes",
            "2",
            "--scenario",
            "connect,fanout,storm,outage",
            "--outage",
            "2s",
            "--max-backoff",
            "2s",
            "--timeout",
            "90s",
            "--apply-failure-rate",
            "0.05",
        ],
    );
    let (report, written_to) = flotilla_loadtest::run(run).await.expect("the run starts");
    eprintln!("{}", flotilla_loadtest::report::table(&report));

    // The report on disk is the one returned, in the versioned schema.
    let on_disk: serde_json::Value =
        serde_json::from_slice(&std::fs::read(written_to.join("report.json")).unwrap()).unwrap();
    assert_eq!(on_disk["schema"], SCHEMA);
    let parsed: Report = serde_json::from_value(on_disk).unwrap();
    assert_eq!(parsed.scenarios.len(), 4);
    assert!(parsed.machine.cores >= 1 && parsed.machine.memory_bytes > 0);
    assert_eq!(parsed.parameters.agents, CI_AGENTS as usize);

    let n = CI_AGENTS;
    for s in &report.scenarios {
        assert_eq!(
            s.outcome,
            Some(Outcome::Completed),
            "{} did not complete: {:?}",
            s.name,
            s.error
        );
        assert_eq!(s.agents, n, "{}", s.name);
    }
    let [connect, fanout, storm, outage] = &report.scenarios[..] else {
        unreachable!()
    };

    assert_eq!(connect.connected, Some(n));
    assert_eq!(connect.available_on_hub, Some(n));
    let (all_connected, all_available) = (
        connect.time_to_all_connected_s.unwrap(),
        connect.time_to_all_available_s.unwrap(),
    );
    assert!(all_connected > 0.0 && all_available > 0.0);
    assert!(
        connect.hub_rss_per_session_bytes.unwrap() > 0.0,
        "a child hub's RSS is measured"
    );
    assert!(connect.curve.windows(2).all(|w| w[0].t_s <= w[1].t_s));

    assert_eq!(fanout.acked, Some(n), "every agent acked the work");
    assert_eq!(
        fanout.applied_on_hub,
        Some(n),
        "every work is Applied on the hub"
    );
    for p in [fanout.ack_latency.as_ref(), fanout.applied_latency.as_ref()] {
        let p = p.unwrap();
        assert_eq!(p.count, n);
        assert!(p.ordered(), "{p:?}");
        assert!(
            p.cdf
                .windows(2)
                .all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1)
        );
    }

    for s in [storm, outage] {
        assert_eq!(s.sessions_before, Some(n), "{}", s.name);
        assert!(
            s.time_to_all_back_s.unwrap() >= s.hub_down_s.unwrap(),
            "{}",
            s.name
        );
        let audit = s.statuses.as_ref().unwrap();
        assert_eq!(audit.agents, n, "{}: every agent accounted for", s.name);
        assert_eq!(
            (audit.lost, audit.duplicated, audit.unacked),
            (0, 0, 0),
            "{}: {audit:?}",
            s.name
        );
        assert!(
            audit.compared >= 2 * n,
            "{}: fanout and storm works compared: {audit:?}",
            s.name
        );
        // Every agent noticed the hub go and opened a new session (the curve may not show
        // the dip: 200 agents can be back between two 100 ms samples).
        assert!(
            s.sessions_reestablished.unwrap() >= n,
            "{}: every agent reconnected: {:?}",
            s.name,
            s.sessions_reestablished
        );
    }
    assert_eq!(storm.signal.as_deref(), Some("SIGKILL"));
    assert!(outage.hub_down_s.unwrap() >= 2.0);
    assert!(
        outage.resume_frames_out.unwrap() >= n,
        "at least a hello per agent"
    );

    for plot in [
        "connect-ramp.svg",
        "rss-vs-sessions.svg",
        "fanout-cdf.svg",
        "storm-reconnect.svg",
        "outage-reconnect.svg",
    ] {
        let svg = std::fs::read_to_string(written_to.join(plot)).unwrap();
        assert!(svg.starts_with("<svg"), "{plot}");
        assert!(report.plots.iter().any(|p| p == plot));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_process_hub_runs_connect_and_fanout() {
    trace_init();
    let dir = tempfile::tempdir().unwrap();
    let run = args(
        &dir.path().join("out"),
        &[
            "--agents",
            "100",
            "--hub-mode",
            "in-process",
            "--scenario",
            "connect,fanout",
            "--timeout",
            "60s",
        ],
    );
    let (report, _) = flotilla_loadtest::run(run).await.unwrap();
    assert_eq!(report.hub.mode, "in-process");
    let [connect, fanout] = &report.scenarios[..] else {
        unreachable!()
    };
    assert_eq!(
        connect.outcome,
        Some(Outcome::Completed),
        "{:?}",
        connect.error
    );
    assert_eq!(
        connect.hub_rss_per_session_bytes, None,
        "no separate RSS in-process"
    );
    assert_eq!(
        fanout.outcome,
        Some(Outcome::Completed),
        "{:?}",
        fanout.error
    );
    assert_eq!(fanout.acked, Some(100));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_can_join_with_a_bootstrap_token_instead_of_issued_certificates() {
    trace_init();
    let dir = tempfile::tempdir().unwrap();
    let run = args(
        &dir.path().join("out"),
        &[
            "--agents",
            "60",
            "--processes",
            "2",
            "--enroll",
            "join",
            "--scenario",
            "connect,fanout",
            "--timeout",
            "90s",
        ],
    );
    let (report, _) = flotilla_loadtest::run(run).await.unwrap();
    let [connect, fanout] = &report.scenarios[..] else {
        unreachable!()
    };
    assert_eq!(
        connect.outcome,
        Some(Outcome::Completed),
        "{:?}",
        connect.error
    );
    // Every agent made its key, sent a CSR and was auto-accepted before its session.
    assert_eq!(connect.joined, Some(60));
    assert_eq!(connect.join_failures, Some(0));
    assert_eq!(connect.available_on_hub, Some(60));
    assert_eq!(
        fanout.outcome,
        Some(Outcome::Completed),
        "{:?}",
        fanout.error
    );
    assert_eq!(fanout.acked, Some(60));
    assert_eq!(fanout.applied_on_hub, Some(60));
}

#[tokio::test]
async fn bad_input_fails_before_anything_starts() {
    trace_init();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let check = |extra: &[&str], want: &str| {
        let run = args(&out, extra);
        let want = want.to_string();
        let out = out.clone();
        async move {
            let err = tokio::time::timeout(Duration::from_secs(10), flotilla_loadtest::run(run))
                .await
                .expect("fails fast")
                .expect_err("must fail");
            let msg = format!("{err:#}");
            assert!(msg.contains(&want), "{msg:?} lacks {want:?}");
            assert!(!out.exists(), "nothing was started or written");
        }
    };
    // A hub data dir that exists, so only the address is wrong.
    let data_dir = dir.path().join("hub-data");
    std::fs::create_dir_all(data_dir.join("ca")).unwrap();
    std::fs::create_dir_all(data_dir.join("operator")).unwrap();
    std::fs::write(data_dir.join("ca/ca.crt"), "").unwrap();
    std::fs::write(data_dir.join("operator/config.yaml"), "").unwrap();
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let data = data_dir.to_str().unwrap();
    check(
        &[
            "--hub",
            &closed.to_string(),
            "--data-dir",
            data,
            "--scenario",
            "connect",
        ],
        "is unreachable",
    )
    .await;
    check(
        &[
            "--hub",
            "192.0.2.1:9443",
            "--data-dir",
            data,
            "--scenario",
            "connect",
        ],
        "not a loopback address",
    )
    .await;
    check(
        &[
            "--hub",
            "127.0.0.1:9443",
            "--data-dir",
            dir.path().to_str().unwrap(),
            "--scenario",
            "connect",
        ],
        "is not a flotilla hub's data directory",
    )
    .await;
    let (_, hard) = flotilla_loadtest::machine::open_files_limit();
    // Only where the limit is below what cluster names can count (20,000 on the CI machine).
    if hard + 1000 <= 99_999 {
        check(&["--agents", &(hard + 1000).to_string()], "open-file limit").await;
    }
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    check(
        &["--hub-listen", &taken.local_addr().unwrap().to_string()],
        "cannot be used",
    )
    .await;
}

/// The feedback scenario at CI size, agents in two worker processes: every cluster's status
/// changes four times a second, yet each work sends at most one status per feedback interval,
/// and the hub ends with every cluster's latest value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn feedback_statuses_stay_within_the_agents_bound_and_the_latest_value_wins() {
    let agents = 50u64;
    let report = two_process_run(
        agents,
        &[
            "--scenario",
            "feedback",
            "--feedback-duration",
            "6s",
            "--feedback-every",
            "250ms",
            "--feedback-interval",
            "2s",
            "--timeout",
            "90s",
        ],
    )
    .await;
    let f = &report.scenarios[0];
    assert_eq!(f.outcome, Some(Outcome::Completed), "{:?}", f.error);
    let window = f.feedback_window_s.unwrap();
    assert!(window >= 5.5, "{window}");
    assert_eq!(
        f.feedback_changes,
        Some(agents * 24),
        "24 changes per cluster"
    );
    let sent = f.statuses_per_cluster_s.unwrap();
    let bound = f.statuses_bound_per_cluster_s.unwrap();
    // Four changes a second against a bound of about half a status a second.
    assert!(sent > 0.0, "statuses flow while the Deployments change");
    assert!(
        sent <= bound,
        "{sent:.3} statuses/cluster/s exceeds the bound {bound:.3}"
    );
    assert!(
        f.store_writes_per_s.unwrap() <= bound * agents as f64,
        "store writes follow the statuses"
    );
    assert!(f.session_bytes_out_per_cluster_s.unwrap() > 0.0);
    assert_eq!(
        f.feedback_converged,
        Some(agents),
        "every cluster's latest value on the hub"
    );
}

/// The proxy scenario at CI size: requests through the tunnels of agents in two worker
/// processes answer like the same requests sent directly, the large list arrives whole, and a
/// request to every cluster at once succeeds everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_requests_reach_every_cluster_through_its_tunnel() {
    let agents = 20u64;
    let report = two_process_run(agents, &["--scenario", "proxy", "--timeout", "120s"]).await;
    let s = &report.scenarios[0];
    assert_eq!(s.outcome, Some(Outcome::Completed), "{:?}", s.error);
    let p = s.proxy.as_ref().expect("a proxy report");
    assert_eq!(p.concurrent_tunnels, agents);
    assert_eq!(
        p.concurrent_ok, agents,
        "every cluster answered through its tunnel"
    );
    assert_eq!(
        p.tunnel_get.count,
        flotilla_loadtest::proxy::SMALL_GETS as u64
    );
    assert!(
        p.list_bytes > 5_000 * 900,
        "the large list: {} bytes",
        p.list_bytes
    );
    assert!(p.tunnel_list_mb_s > 0.0 && p.direct_list_mb_s > 0.0);
}

/// A run of `agents` agents in two worker processes with `extra` flags; its report, printed.
async fn two_process_run(agents: u64, extra: &[&str]) -> Report {
    trace_init();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let agents = agents.to_string();
    let mut flags = vec!["--agents", agents.as_str(), "--processes", "2"];
    flags.extend_from_slice(extra);
    let (report, _) = flotilla_loadtest::run(args(&out, &flags))
        .await
        .expect("the run starts");
    eprintln!("{}", flotilla_loadtest::report::table(&report));
    report
}
