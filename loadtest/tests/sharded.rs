//! Scale-out mode under the harness (`--gateways 3`): a hub with `--gateways external` and
//! three gateway processes on a real kube-apiserver, hundreds of simulated agents spread over
//! the gateways' addresses as a load balancer would and redirected to their shards' owners.
//! Every gateway is SIGKILLed at once and started again, at two agent counts, and the hub
//! apiserver's own request counters say what the restart cost it: a small constant per
//! gateway, the same for 100 agents as for 300. That is the design's promise (agents never
//! touch the apiserver; a gateway's caches are one list and one watch per kind), measured.
//! Then two of three gateways run in network namespaces on their own addresses, as separate
//! hosts would, and the namespaces are gone after the run.

mod common;

use common::{args, trace_init};
use flotilla_loadtest::report::{ApiserverLoad, GatewaysReport, Outcome, Report};

const GATEWAYS: u64 = 3;

/// What one gateway restart may cost the apiserver in requests on ManagedClusters and
/// ManifestWorks (their status subresources included): its caches start with one LIST and
/// one WATCH per kind (4), and serve every reconnecting agent from there, with no GET and no
/// write, since the clusters stayed Available within the grace period and every status and
/// finalizer was written before the stop. Twice that allows one relist and rewatch per kind
/// (a watch the apiserver ends early); anything per agent would be hundreds.
const PER_GATEWAY_RESTART: u64 = 8;

/// The resources the bound is about. Leases are time-driven (each gateway renews its own and
/// its shards' every --renew-period, whatever the agents do), so they are counted apart.
const SESSION_RESOURCES: [&str; 4] = [
    "managedclusters",
    "managedclusters/status",
    "manifestworks",
    "manifestworks/status",
];

fn session_requests(load: &ApiserverLoad) -> u64 {
    SESSION_RESOURCES
        .iter()
        .map(|r| load.requests_by_resource.get(*r).copied().unwrap_or(0))
        .sum()
}

/// A run of `connect,storm` with `agents` agents over three gateways; returns the report.
async fn storm_of_all_gateways(agents: u64, extra: &[&str]) -> Report {
    let dir = tempfile::tempdir().unwrap();
    let agents = agents.to_string();
    let mut flags = vec![
        "--agents",
        &agents,
        "--store",
        "kube",
        "--gateways",
        "3",
        "--scenario",
        "connect,storm",
        "--storm-signal",
        "kill",
        "--timeout",
        "120s",
        "--max-backoff",
        "2s",
        // Short leases, so a killed gateway's shards are claimed again in seconds; a grace
        // period above the restart, so no cluster turns Unknown (its agent is around).
        "--gateway-arg=--shards=16",
        "--gateway-arg=--lease-duration=3s",
        "--gateway-arg=--renew-period=1s",
        "--gateway-arg=--grace-period=30s",
    ];
    flags.extend_from_slice(extra);
    let run = args(&dir.path().join("out"), &flags);
    let (report, _) = flotilla_loadtest::run(run).await.expect("the run");
    if report
        .scenarios
        .iter()
        .any(|s| s.outcome != Some(Outcome::Completed))
    {
        // The harness kept the hub's and gateways' logs in out/run-*: keep them for a person.
        let kept = dir.keep();
        eprintln!(
            "a scenario did not complete; logs kept in {}",
            kept.display()
        );
    }
    report
}

/// The checks both agent counts share; returns the storm window's session-resource requests.
fn check_run(report: &Report, agents: u64) -> u64 {
    let [connect, storm] = &report.scenarios[..] else {
        panic!("two scenarios: {:?}", report.scenarios);
    };
    for s in [connect, storm] {
        assert_eq!(
            s.outcome,
            Some(Outcome::Completed),
            "{agents} agents, {}: {:?}",
            s.name,
            s.error
        );
    }
    // Connect: every agent ended on its shard's owner, the sessions spread over all three.
    let gw: &GatewaysReport = connect.gateways.as_ref().expect("gateways after connect");
    assert_eq!(gw.each.len() as u64, GATEWAYS);
    assert!(gw.all_on_owners, "{agents} agents: {:?}", gw.each);
    assert_eq!(gw.each.iter().map(|g| g.sessions).sum::<u64>(), agents);
    assert!(
        gw.each.iter().all(|g| g.sessions > 0 && g.shards > 0),
        "every gateway holds shards and sessions: {:?}",
        gw.each
    );
    assert!(gw.rss_bytes > 0 && gw.each.iter().all(|g| g.rss_bytes.is_some()));

    // Storm: every agent back, on its owner, no status lost or stored twice.
    assert_eq!(storm.signal.as_deref(), Some("SIGKILL"));
    assert!(storm.time_to_all_back_s.is_some());
    assert!(storm.sessions_reestablished.unwrap() >= agents);
    let audit = storm.statuses.as_ref().expect("status audit");
    assert_eq!(audit.agents, agents);
    assert_eq!((audit.lost, audit.duplicated), (0, 0), "{audit:?}");
    let gw = storm.gateways.as_ref().expect("gateways after the storm");
    assert!(
        gw.all_on_owners,
        "{agents} agents after the storm: {:?}",
        gw.each
    );
    assert_eq!(gw.each.iter().map(|g| g.sessions).sum::<u64>(), agents);
    // Agents dial the gateway of their last session first: restarted in place, it still owns
    // their shards, so few come back through the balancer's pick and its redirect (two in
    // three did on the ramp).
    let (ramp, back) = (connect.redirects.unwrap(), storm.redirects.unwrap());
    assert!(
        ramp > 0 && back * 2 < ramp,
        "{agents} agents: {ramp} redirects on the ramp, {back} in the storm"
    );

    // The apiserver's side of the storm.
    let load = gw.storm_apiserver.as_ref().expect("storm window measured");
    assert_eq!(
        load.requests_by_verb_resource.values().sum::<u64>(),
        load.requests,
        "{load:?}"
    );
    let session = session_requests(load);
    assert!(
        session <= PER_GATEWAY_RESTART * GATEWAYS,
        "{agents} agents: restarting {GATEWAYS} gateways cost the apiserver {session} requests on \
         ManagedClusters and ManifestWorks, above {PER_GATEWAY_RESTART} per gateway: {:#?}",
        load.requests_by_verb_resource
    );
    // Each restarted gateway listed and watched both kinds itself (its own counters, reset by
    // the restart), and its caches answered the reconnecting agents.
    for g in &gw.each {
        let of = |verb: &str| g.store_requests.get(verb).copied().unwrap_or(0);
        assert!(
            (1..=4).contains(&of("list")) && (1..=4).contains(&of("watch")),
            "{}: {:?}",
            g.name,
            g.store_requests
        );
        assert_eq!(
            of("get") + of("create") + of("update") + of("update_status") + of("delete"),
            0,
            "{} read or wrote objects for its reconnecting agents: {:?}",
            g.name,
            g.store_requests
        );
    }
    // Leases were renewed throughout: counted, not bounded here.
    assert!(
        load.requests_by_resource
            .get("leases")
            .copied()
            .unwrap_or(0)
            > 0
    );
    session
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_every_gateway_costs_the_apiserver_the_same_at_100_and_300_agents() {
    trace_init();
    let small = storm_of_all_gateways(100, &[]).await;
    let small_cost = check_run(&small, 100);
    // Three times the agents, over two worker processes (--processes keeps working).
    let large = storm_of_all_gateways(300, &["--processes", "2"]).await;
    let large_cost = check_run(&large, 300);
    // It does not grow with the agents: at most one extra relist and rewatch per kind per
    // gateway apart, where anything per agent would add 200.
    assert!(
        large_cost <= small_cost + 4 * GATEWAYS,
        "storm requests on ManagedClusters and ManifestWorks grew from {small_cost} (100 agents) \
         to {large_cost} (300 agents)"
    );
}

/// Network namespaces whose name this harness process gave them (`flotilla-lt-<pid>-<n>`).
fn our_namespaces() -> Vec<String> {
    let out = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    let prefix = format!("flotilla-lt-{}-", std::process::id());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&prefix))
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_in_network_namespaces_serve_agents_from_their_own_addresses() {
    trace_init();
    let report = storm_of_all_gateways(200, &["--gateway-netns", "2", "--hold", "2s"]).await;
    check_run(&report, 200);
    // --hold: every session stayed up through the idle window, whose cost was read from the
    // gateways' counters and the apiserver's (the 1 s lease renewals at least).
    let idle = report.scenarios[0]
        .idle
        .as_ref()
        .expect("connect --hold reports idle");
    assert!(idle.window_s >= 2.0, "{idle:?}");
    assert_eq!((idle.sessions_before, idle.sessions_after), (200, 200));
    assert!(
        idle.sessions_cpu_s >= 0.0 && idle.agents_cpu_s >= 0.0,
        "{idle:?}"
    );
    assert!(idle.apiserver_requests.is_some_and(|n| n > 0), "{idle:?}");
    let gw = report.scenarios[1].gateways.as_ref().unwrap();
    // The first two listen on their namespaces' addresses (10.213.x.y), the third on loopback,
    // and each holds sessions: agents reached all three, and were redirected across them.
    let ips: Vec<std::net::IpAddr> = gw
        .each
        .iter()
        .map(|g| g.address.parse::<std::net::SocketAddr>().unwrap().ip())
        .collect();
    assert!(
        ips[..2].iter().all(|ip| !ip.is_loopback()) && ips[2].is_loopback(),
        "{ips:?}"
    );
    assert_ne!(ips[0], ips[1]);
    assert!(gw.each.iter().all(|g| g.sessions > 0), "{:?}", gw.each);
    // The namespaces (and their veths with them) are gone once the run returned.
    assert_eq!(our_namespaces(), Vec::<String>::new());
}
