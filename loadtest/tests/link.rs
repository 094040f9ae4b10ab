//! `run --link`: the agents' worker processes behind emulated links, on both carriers. The
//! link's delay must be in every session's path (the hub is on loopback; only the link reaches
//! it from the workers' namespaces), and the namespaces go when the run ends. Needs root and
//! the tools `flotilla_wan::check_available` names; where they are missing it says it is
//! skipped and why.

mod common;

use common::{args, trace_init};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_behind_a_link_reach_the_hub_through_it_on_both_carriers() {
    trace_init();
    if let Err(e) = flotilla_wan::check_available() {
        eprintln!("SKIPPED: {e}");
        return;
    }
    let _alone = ONE_RUN_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let run = args(
        &dir.path().join("out"),
        &[
            "--agents",
            "10",
            "--processes",
            "2",
            "--transport",
            "both",
            "--scenario",
            "connect,fanout",
            // 200 ms round trip: every hub-to-agent crossing takes at least 100 ms.
            "--link-spec",
            "delay=200ms",
        ],
    );
    let (report, _) = flotilla_loadtest::run(run).await.unwrap();
    let [connect, fanout] = &report.scenarios[..] else {
        panic!("two scenarios: {:?}", report.scenarios.len());
    };
    assert_eq!(connect.connected, Some(10));
    assert_eq!(connect.available_on_hub, Some(10));
    assert_eq!(fanout.acked, Some(10));
    assert_eq!(fanout.applied_on_hub, Some(10));
    // A work reaches each agent across the link: none acked sooner than one way of it.
    let acks = fanout.ack_latency.as_ref().unwrap();
    let fastest = acks.cdf.first().unwrap().0;
    assert!(fastest >= 100.0, "fastest ack {fastest} ms: {acks:?}");
    no_link_left();
}

/// Runs with links one at a time: each checks that its links are gone after it, and this
/// process's links all have names of one pattern.
static ONE_RUN_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The run's links are gone with it.
fn no_link_left() {
    let namespaces = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .unwrap();
    let ours = format!("flotilla-wan-{}-", std::process::id());
    assert!(
        !String::from_utf8_lossy(&namespaces.stdout).contains(&ours),
        "{}",
        String::from_utf8_lossy(&namespaces.stdout)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_behind_links_follow_redirects_to_gateways_on_loopback() {
    trace_init();
    if let Err(e) = flotilla_wan::check_available() {
        eprintln!("SKIPPED: {e}");
        return;
    }
    let _alone = ONE_RUN_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let run = args(
        &dir.path().join("out"),
        &[
            "--agents",
            "20",
            "--processes",
            "2",
            "--transport",
            "both",
            "--store",
            "kube",
            "--gateways",
            "2",
            "--gateway-arg=--shards=16",
            "--scenario",
            "connect,fanout",
            "--link-spec",
            "delay=40ms",
            "--timeout",
            "120s",
        ],
    );
    let (report, _) = flotilla_loadtest::run(run).await.unwrap();
    let [connect, fanout] = &report.scenarios[..] else {
        panic!("two scenarios: {:?}", report.scenarios.len());
    };
    assert_eq!(connect.connected, Some(20));
    assert_eq!(connect.available_on_hub, Some(20));
    // Agents dial the gateways as a load balancer spreads them; those that reach a gateway
    // not owning their shard are redirected to the owner's loopback address, across the link.
    assert!(
        connect.redirects.is_some_and(|r| r > 0),
        "no redirect was followed: {:?}",
        connect.redirects
    );
    assert_eq!(fanout.acked, Some(20));
    assert_eq!(fanout.applied_on_hub, Some(20));
    no_link_left();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_links_scenario_measures_both_carriers_and_the_klusterlet_pattern_over_one_link() {
    trace_init();
    if let Err(e) = flotilla_wan::check_available() {
        eprintln!("SKIPPED: {e}");
        return;
    }
    let _alone = ONE_RUN_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let run = args(
        &dir.path().join("out"),
        &[
            "--agents",
            "6",
            "--processes",
            "2",
            "--transport",
            "both",
            "--store",
            "kube",
            "--scenario",
            "connect,links",
            // Loss on a long path, and an outage of 2 s every 12 s.
            "--link-spec",
            "delay=60ms,loss=1%,flap=2s/12s",
            // Idle: one heartbeat interval (10 s) and two lease renewals of the klusterlet side.
            "--baseline-window",
            "11s",
            "--lease-interval",
            "5s",
            "--timeout",
            "240s",
        ],
    );
    let (report, _) = flotilla_loadtest::run(run).await.unwrap();
    let links = report.scenarios[1]
        .links
        .as_ref()
        .unwrap_or_else(|| panic!("no links report: {:?}", report.scenarios[1].error));
    assert_eq!(
        report.scenarios[1].outcome,
        Some(flotilla_loadtest::report::Outcome::Completed),
        "{:?}",
        report.scenarios[1].error
    );
    let sides: Vec<&str> = links.sides.iter().map(|s| s.side.as_str()).collect();
    assert_eq!(sides, ["grpc", "quic", "klusterlet"]);
    // Each carrier has one worker's 3 clusters; the klusterlet side has all 6, over as many
    // links as the workers have.
    let clusters_of = |s: &flotilla_loadtest::over_links::SideOverLink| match s.side.as_str() {
        "klusterlet" => 6,
        _ => 3,
    };
    for s in &links.sides {
        assert_eq!(
            (s.clusters, s.links),
            (clusters_of(s), clusters_of(s) / 3),
            "{s:?}"
        );
        // Every cluster's work Applied, none faster than the link's one-way delay there and
        // the way back.
        let applied = s.applied.as_ref().unwrap();
        assert_eq!(applied.count, clusters_of(s), "{s:?}");
        assert!(applied.cdf[0].0 >= 60.0, "{s:?}");
        // Idle, each side still speaks: heartbeats, lease renewals.
        assert!(
            s.idle_bytes_per_cluster_hour.is_some_and(|b| b > 0.0),
            "{s:?}"
        );
        // The 1 MiB work reaches the cluster on every side.
        assert!(s.large[0].applied_s.is_some(), "{s:?}");
    }
    for s in &links.sides[..2] {
        // flotilla's sides: acked, the 10 MiB work delivered in chunks, each session through
        // the outage kept or back, kubectl's list whole through the tunnel, no wrong Unknown.
        assert_eq!(s.ack.as_ref().unwrap().count, 3, "{s:?}");
        assert!(s.large[1].applied_s.is_some(), "{s:?}");
        let flap = s.flap.as_ref().unwrap();
        assert_eq!((flap.kept + flap.back, flap.not_back), (3, 0), "{s:?}");
        assert_eq!(flap.after_up_ack.as_ref().unwrap().count, 3, "{s:?}");
        assert_eq!(
            s.kubectl_get.as_ref().unwrap().count as usize,
            flotilla_loadtest::over_links::KUBECTL_GETS
        );
        assert!(s.kubectl_list_bytes.is_some_and(|b| b > 1_000_000), "{s:?}");
        assert_eq!(s.wrong_unknown, Some(0), "{s:?}");
    }
    // A work made as each link came back reached every cluster, on every side.
    for s in &links.sides {
        let flap = s.flap.as_ref().unwrap_or_else(|| panic!("{s:?}"));
        assert_eq!(
            flap.after_up_applied.as_ref().unwrap().count,
            clusters_of(s),
            "{s:?}"
        );
    }
    // Every status flotilla's agents made is on the hub, once.
    let audit = links.statuses.as_ref().unwrap();
    // Two works on every agent (the fan-out, the one made after the outage), two more on
    // the first of each carrier (the large ones).
    assert_eq!(audit.compared, 6 * 2 + 2 * 2, "{audit:?}");
    assert_eq!(
        (audit.lost, audit.duplicated, audit.unacked),
        (0, 0, 0),
        "{audit:?}"
    );
    // The klusterlet pattern's apiserver refuses a 10 MiB work outright.
    let refused = links.sides[2].large[1]
        .refused
        .as_deref()
        .unwrap_or_default();
    assert!(
        refused.contains("413") || refused.contains("too large"),
        "{refused}"
    );
    no_link_left();
}
