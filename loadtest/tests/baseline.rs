//! A CI-sized `--store kube` run: the hub on a real kube-apiserver, `connect`, `fanout`, `storm`
//! (the hub killed and restarted, the apiserver staying), then `baseline-klusterlet` (the same
//! clusters as klusterlet-style clients on a second real apiserver). The report is checked for
//! internal consistency: every agent and every client accounted for, every work Applied on both
//! sides, request breakdowns adding up to their totals, ratios that are what the numbers say,
//! both apiservers gone afterwards. Speed is not checked here.

mod common;

use std::time::Duration;

use common::{args, trace_init};
use flotilla_loadtest::cli::HubStore;
use flotilla_loadtest::report::{ApiserverLoad, Outcome, Report, SCHEMA};
use tokio::time::Instant;

/// Agents (and klusterlet clients) in the CI run: hundreds of watches on the baseline's
/// apiserver, small enough for debug builds on 2 shared cores.
const CI_AGENTS: u64 = 100;

/// Waits (bounded) until process `pid` is gone.
async fn gone(pid: u32, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::path::Path::new(&format!("/proc/{pid}")).exists() {
        assert!(
            Instant::now() < deadline,
            "{what} (pid {pid}) still runs after the run returned"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A load's breakdowns add up to its total.
fn consistent(load: &ApiserverLoad, what: &str) {
    assert_eq!(
        load.requests_by_verb.values().sum::<u64>(),
        load.requests,
        "{what}: by verb {load:?}"
    );
    assert_eq!(
        load.requests_by_resource.values().sum::<u64>(),
        load.requests,
        "{what}: by resource {load:?}"
    );
    assert!(load.watches_held >= load.watches_held_by_clients, "{what}");
    assert!(load.rss_bytes.is_some_and(|b| b > 0), "{what}: RSS read");
    assert!(load.window_s > 0.0, "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ci_sized_kube_run_compares_flotilla_with_the_klusterlet_baseline() {
    trace_init();
    let dir = tempfile::tempdir().unwrap();
    let run = args(
        &dir.path().join("out"),
        &[
            "--agents",
            &CI_AGENTS.to_string(),
            "--store",
            "kube",
            "--scenario",
            "connect,fanout,storm,baseline-klusterlet",
            "--baseline-window",
            "5s",
            "--lease-interval",
            "2s",
            "--timeout",
            "120s",
        ],
    );
    let (report, written_to) = flotilla_loadtest::run(run).await.expect("the run starts");
    eprintln!("{}", flotilla_loadtest::report::table(&report));

    let on_disk: serde_json::Value =
        serde_json::from_slice(&std::fs::read(written_to.join("report.json")).unwrap()).unwrap();
    assert_eq!(on_disk["schema"], SCHEMA);
    assert_eq!(on_disk["parameters"]["store"], "kube");
    let parsed: Report = serde_json::from_value(on_disk).unwrap();
    assert_eq!(parsed.parameters.store, HubStore::Kube);
    // What the report on disk says is what the run returned (floats aside: JSON does not
    // keep every last bit of them).
    let accounting = |r: &Report| {
        let b = r.scenarios[3].baseline.clone().unwrap();
        let requests = |s: &flotilla_loadtest::report::BaselineSide| {
            [&s.connect, &s.fanout, &s.idle].map(|l| l.as_ref().map(|l| l.requests))
        };
        (
            [
                b.clients,
                b.clients_started,
                b.clients_synced,
                b.clients_registered,
                b.clients_saw_work,
                b.statuses_written,
                b.works_created,
                b.works_applied,
                b.lease_renewals,
            ],
            requests(&b.flotilla),
            requests(&b.klusterlet),
            b.rows.iter().map(|r| r.phase.clone()).collect::<Vec<_>>(),
        )
    };
    assert_eq!(accounting(&parsed), accounting(&report));
    assert_eq!(report.hub.store, "kube");

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
        let load = s
            .apiserver
            .as_ref()
            .expect("kube mode reports apiserver load");
        consistent(load, &s.name);
    }
    let [connect, fanout, storm, baseline] = &report.scenarios[..] else {
        unreachable!()
    };
    assert_eq!(connect.connected, Some(n));
    assert_eq!(connect.available_on_hub, Some(n));
    assert_eq!(fanout.acked, Some(n), "every agent acked the work");
    assert_eq!(
        fanout.applied_on_hub,
        Some(n),
        "every work Applied on the hub"
    );
    for p in [fanout.ack_latency.as_ref(), fanout.applied_latency.as_ref()] {
        let p = p.unwrap();
        assert_eq!(p.count, n);
        assert!(p.ordered(), "{p:?}");
    }
    // The works were created through the hub, which wrote them to its apiserver.
    let hub_fanout = fanout.apiserver.as_ref().unwrap();
    assert!(
        hub_fanout.requests_by_resource["manifestworks"] >= n,
        "{hub_fanout:?}"
    );

    // The hub was killed under every session and came back on the same apiserver; no status
    // was lost on the way.
    assert_eq!(storm.signal.as_deref(), Some("SIGKILL"));
    assert_eq!(storm.sessions_before, Some(n));
    let audit = storm.statuses.as_ref().unwrap();
    assert_eq!(audit.agents, n, "every agent accounted for");
    assert_eq!(
        (audit.lost, audit.duplicated, audit.unacked),
        (0, 0, 0),
        "{audit:?}"
    );
    assert!(audit.compared >= 2 * n, "fanout and storm works: {audit:?}");

    let b = baseline.baseline.as_ref().expect("the baseline's report");
    assert_eq!(baseline.connected, Some(n), "flotilla's agents stayed up");
    // Every client accounted for.
    assert_eq!(
        (
            b.clients,
            b.clients_started,
            b.clients_synced,
            b.clients_registered,
            b.clients_saw_work
        ),
        (n, n, n, n, n),
        "{b:?}"
    );
    assert_eq!((b.works_created, b.works_applied), (n, n), "{b:?}");
    assert!(b.statuses_written >= n, "{b:?}");
    assert_eq!(b.client_errors, 0, "{:?}", b.client_error_examples);
    // Renewals every 2 s across a 5 s idle window: at least one per client.
    assert!(b.lease_renewals >= n, "{b:?}");

    // Each side, each phase, measured and consistent.
    for (side, phases) in [("flotilla", &b.flotilla), ("klusterlet", &b.klusterlet)] {
        for (phase, load) in [
            ("connect", &phases.connect),
            ("fanout", &phases.fanout),
            ("idle", &phases.idle),
        ] {
            let load = load
                .as_ref()
                .unwrap_or_else(|| panic!("{side} {phase} measured"));
            consistent(load, &format!("{side} {phase}"));
        }
    }
    assert_eq!(
        b.flotilla.connect, connect.apiserver,
        "flotilla's connect is the connect scenario's"
    );
    assert_eq!(b.flotilla.fanout, fanout.apiserver);
    // The hub created the works with their cleanup finalizer: the agents' acks cost no write
    // of the work, only its create and its status.
    let f_fanout = b.flotilla.fanout.as_ref().unwrap();
    let by = |key: &str| {
        f_fanout
            .requests_by_verb_resource
            .get(key)
            .copied()
            .unwrap_or(0)
    };
    assert_eq!(
        (by("POST manifestworks"), by("PUT manifestworks")),
        (n, 0),
        "one create per work, no finalizer write: {f_fanout:?}"
    );
    let k = &b.klusterlet;
    let k_fanout = k.fanout.as_ref().unwrap();
    assert!(
        k_fanout.requests_by_resource["manifestworks/status"] >= n,
        "a status write per client: {k_fanout:?}"
    );
    let k_idle = k.idle.as_ref().unwrap();
    assert!(
        k_idle.watches_held_by_clients >= 2 * n,
        "two watches per client: {k_idle:?}"
    );
    let f_idle = b.flotilla.idle.as_ref().unwrap();
    assert!(
        f_idle.watches_held_by_clients < n,
        "flotilla's agents hold no watches: {f_idle:?}"
    );

    // The rows are the sides' numbers, and the ratio is klusterlet / flotilla.
    let phases: Vec<&str> = b.rows.iter().map(|r| r.phase.as_str()).collect();
    assert_eq!(
        phases,
        ["connect", "fanout", "idle_per_minute", "storm", "total"]
    );
    // The storm: every klusterlet client lists and watches both kinds again; flotilla's hub
    // restarted under every session costs its apiserver what one process's caches cost, not
    // a request per cluster.
    assert_eq!(b.clients_resynced, n, "every client listed again");
    let k_storm = k.storm.as_ref().unwrap();
    // The list of its own ManagedCluster (a metadata.name field selector) is counted as a GET.
    // The window closes when every client has listed again and its watches are open.
    let verb = |v: &str| k_storm.requests_by_verb.get(v).copied().unwrap_or(0);
    assert!(
        verb("LIST") + verb("GET") >= 2 * n && verb("WATCH") >= 2 * n,
        "two lists and two watches per client: {k_storm:?}"
    );
    let f_storm = b.flotilla.storm.as_ref().unwrap();
    assert!(
        f_storm.requests < n && f_storm.requests * 4 < k_storm.requests,
        "the hub's restart costs less than a request per cluster: {f_storm:?} against {k_storm:?}"
    );
    assert!(b.flotilla_storm_back_s.is_some() && b.klusterlet_storm_back_s.is_some());
    for r in &b.rows {
        let (f, kl) = (r.flotilla.unwrap(), r.klusterlet.unwrap());
        assert!(kl > 0.0, "{r:?}");
        if r.phase == "idle_per_minute" && f == 0.0 {
            assert_eq!(r.ratio, None, "{r:?}");
            continue;
        }
        assert!(f > 0.0, "{r:?}");
        let ratio = r.ratio.unwrap();
        assert!((ratio - kl / f).abs() < 1e-9 * ratio.max(1.0), "{r:?}");
    }
    let total = b.rows.last().unwrap();
    let sum = |side: &flotilla_loadtest::report::BaselineSide| -> f64 {
        [&side.connect, &side.fanout, &side.idle, &side.storm]
            .iter()
            .map(|l| l.as_ref().unwrap().requests as f64)
            .sum()
    };
    assert_eq!(total.flotilla, Some(sum(&b.flotilla)));
    assert_eq!(total.klusterlet, Some(sum(&b.klusterlet)));
    assert_eq!(
        b.rows[0].klusterlet,
        Some(k.connect.as_ref().unwrap().requests as f64)
    );

    // Both apiservers (and their etcds) stopped with the run.
    gone(
        report.hub.apiserver_pid.unwrap(),
        "the hub's kube-apiserver",
    )
    .await;
    gone(
        b.klusterlet_apiserver_pid.unwrap(),
        "the baseline's kube-apiserver",
    )
    .await;
}

#[tokio::test]
async fn the_baseline_without_the_kube_store_fails_before_anything_starts() {
    trace_init();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    for extra in [
        &["--scenario", "connect,baseline-klusterlet"][..],
        &["--scenario", "baseline-klusterlet", "--store", "sled"][..],
    ] {
        let err = tokio::time::timeout(
            Duration::from_secs(10),
            flotilla_loadtest::run(args(&out, extra)),
        )
        .await
        .expect("fails fast")
        .expect_err("must fail");
        let msg = format!("{err:#}");
        assert!(
            msg.contains("baseline-klusterlet") && msg.contains("add --store kube"),
            "{extra:?}: {msg}"
        );
        assert!(!out.exists(), "nothing was started or written");
    }
}
