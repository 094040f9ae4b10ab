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
    // The run's links are gone with it.
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
