//! A SIGTERM'd hub always exits, and within its drain deadline, even when the signal lands
//! while agents are connecting, mid-handshake, just established or reconnecting after the last
//! restart: every session that exists at any point during the drain is drained, and what is
//! left at the deadline is closed. Each round stops the hub at a different point of the
//! agents' ramp; a hub that does not exit fails the round (the harness kills it after
//! `HUB_STOP_TIMEOUT` and says so).

mod common;

use std::time::Duration;

use common::{args, trace_init};
use flotilla_loadtest::agents::Agents;
use flotilla_loadtest::fleet::Hub;
use flotilla_loadtest::swarm::SwarmSpec;
use nix::sys::signal::Signal;
use tokio::time::Instant;

const AGENTS: usize = 300;
/// Rounds of SIGTERM and restart, each after a different number of new sessions.
const ROUNDS: [u64; 8] = [1, 5, 20, 60, 120, 200, 3, 280];
/// The hub's drain deadline in this test (`--drain-timeout`).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// What a stopping process may need beyond the drain deadline on a busy 2-core machine
/// (closing sockets, flushing the store, exiting).
const EXIT_MARGIN: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigtermed_hub_exits_within_its_drain_deadline_while_agents_connect() {
    trace_init();
    let dir = tempfile::tempdir().unwrap();
    let args = args(
        &dir.path().join("out"),
        &[
            "--agents",
            &AGENTS.to_string(),
            // Agents start together and come back fast: many are always mid-handshake.
            "--connect-rate",
            "5000",
            "--max-backoff",
            "500ms",
            "--hub-arg=--drain-timeout=5s",
            "--hub-arg=--drain-window=300ms",
        ],
    );
    let mut hub = Hub::start(&args, dir.path()).await.expect("the hub starts");
    let names = (0..AGENTS).map(|i| args.cluster_name(i)).collect();
    let identities = hub
        .enroll(names, &indicatif::ProgressBar::hidden())
        .await
        .expect("agents enrolled");
    let spec = SwarmSpec::for_run(&args, &hub, dir.path(), None).unwrap();
    let agents = Agents::start(
        spec,
        identities,
        1,
        args.harness_exe().unwrap(),
        dir.path(),
        None,
    )
    .await
    .unwrap();

    let mut longest = Duration::ZERO;
    for (round, new_sessions) in ROUNDS.into_iter().enumerate() {
        // Wait for this round's share of new sessions (the ramp, or the reconnects after the
        // last restart), then stop the hub in the middle of it.
        let from = agents.sample().established_total;
        let deadline = Instant::now() + Duration::from_secs(60);
        while agents.sample().established_total < from + new_sessions {
            assert!(
                Instant::now() < deadline,
                "round {round}: agents stopped connecting ({:?})",
                agents.sample()
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let signalled = Instant::now();
        hub.stop_with(Signal::SIGTERM)
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e:#}"));
        let took = signalled.elapsed();
        longest = longest.max(took);
        assert!(
            took <= DRAIN_TIMEOUT + EXIT_MARGIN,
            "round {round}: the hub took {took:?} to exit, its drain deadline is {DRAIN_TIMEOUT:?}"
        );
        hub.start_again().await.expect("the hub starts again");
    }
    eprintln!("longest exit after SIGTERM: {longest:?}");
    agents.stop().await;
    hub.shutdown().await.unwrap();
}
