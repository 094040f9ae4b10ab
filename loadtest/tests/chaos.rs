//! The chaos scenario, CI-sized: three gateways on a real kube-apiserver, a few hundred agents
//! in two worker processes (one on gRPC, one on QUIC), a fan-out and a progressive rollout
//! under a minute and a half of faults drawn from a fixed seed: gateways, the hub and a worker
//! killed and paused, partitions made with nftables, the apiserver restarted. Every fault must
//! have been done and undone, and every invariant must be judged and hold. The schedule in
//! the report is the one the seed gives, and nothing of the run is left behind (its nftables
//! table, its processes).

mod common;

use std::process::Command;
use std::time::Duration;

use common::{args, trace_init};
use flotilla_loadtest::chaos::Verdict;
use flotilla_loadtest::chaos::schedule::{self, FaultKind, ScheduleSpec, Targets};
use flotilla_loadtest::report::Outcome;

const SEED: u64 = 20_261_126;
const AGENTS: &str = "300";
const WINDOW: &str = "90s";
const LEASE: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_from_a_seed_break_no_invariant() {
    trace_init();
    let dir = tempfile::tempdir().unwrap();
    let seed = SEED.to_string();
    let run = args(
        &dir.path().join("out"),
        &[
            "--scenario",
            "chaos",
            "--store",
            "kube",
            "--gateways",
            "3",
            "--agents",
            AGENTS,
            "--processes",
            "2",
            "--transport",
            "both",
            "--chaos-seed",
            &seed,
            "--chaos-duration",
            WINDOW,
            "--timeout",
            "180s",
            "--max-backoff",
            "2s",
            "--rollout-max-concurrency",
            "25%",
            "--gateway-arg=--shards=16",
            "--gateway-arg=--lease-duration=3s",
            "--gateway-arg=--renew-period=1s",
        ],
    );
    let (report, _) = flotilla_loadtest::run(run).await.expect("the run");
    // What a person reading a CI log wants: the faults and every invariant's evidence.
    eprint!("{}", flotilla_loadtest::report::table(&report));
    let [chaos] = &report.scenarios[..] else {
        panic!("one scenario: {:?}", report.scenarios);
    };
    let c = chaos.chaos.as_ref().expect("the chaos report");
    let judged: Vec<String> = c
        .invariants
        .iter()
        .map(|i| format!("{}: {:?}: {}", i.name, i.verdict, i.evidence))
        .collect();
    if chaos.outcome != Some(Outcome::Completed) {
        let kept = dir.keep();
        eprintln!("the chaos scenario failed; logs kept in {}", kept.display());
    }
    assert_eq!(
        chaos.outcome,
        Some(Outcome::Completed),
        "{:?}\n{}",
        chaos.error,
        judged.join("\n")
    );

    // The schedule the seed gives, replayed here, is the one the run did.
    let replay = schedule::schedule(&ScheduleSpec {
        seed: SEED,
        window: humantime::parse_duration(WINDOW).unwrap(),
        kinds: FaultKind::ALL.to_vec(),
        targets: Targets {
            gateways: 3,
            workers: 2,
        },
        lease_duration: LEASE,
    });
    assert_eq!(c.seed, SEED);
    assert_eq!(c.faults, replay);
    assert!(
        c.faults.len() >= 4,
        "a short window still holds faults: {:?}",
        c.faults
    );
    assert_eq!(
        c.acts.len(),
        c.faults.len() * 2,
        "every fault done and undone"
    );
    assert!(c.acts.iter().all(|a| a.error.is_none()), "{:?}", c.acts);

    // Every invariant judged, and held: the gateways log each fenced write they send, so the
    // fencing ones are judged from those logs.
    for name in [
        "every cluster converged",
        "no status lost or duplicated",
        "no write accepted from a gateway that had lost the shard",
        "no object's epoch went backwards",
        "no cluster marked Unknown while its agent held a session",
        "apiserver requests within the capacity formula",
        "every process exits when asked",
        "every fault injected and undone",
    ] {
        let i = c
            .invariants
            .iter()
            .find(|i| i.name == name)
            .unwrap_or_else(|| panic!("no invariant {name}: {judged:?}"));
        assert_eq!(i.verdict, Verdict::Held, "{name}: {}", i.evidence);
    }
    let audit = chaos.statuses.as_ref().expect("status audit");
    assert!(
        audit.compared >= 2 * 300,
        "two works per cluster: {audit:?}"
    );

    // Nothing left behind: the run's nftables table is gone.
    let tables = Command::new("nft")
        .args(["list", "tables"])
        .output()
        .expect("nft list tables");
    let tables = String::from_utf8_lossy(&tables.stdout);
    let ours = format!("flotilla_chaos_{}", std::process::id());
    assert!(!tables.contains(&ours), "left behind: {tables}");
}
