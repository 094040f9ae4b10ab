//! The report: a versioned JSON document (`"schema": "flotilla-loadtest/v1"`), a table for
//! people, and the numbers plots are drawn from.
//!
//! Schema v1, top level: `schema`, `tool_version`, `started_at`/`finished_at` (RFC 3339),
//! `command` (argv), `parameters` (every flag, defaults included), `machine` (cores, memory,
//! kernel, open-file limits, load), `hub` (mode and addresses), `scenarios` (one object per
//! scenario run, in order, with `name`, `outcome` and the scenario's own fields, all optional so
//! a scenario that stopped early still reports what it saw), and `plots` (file names written).
//! Durations are seconds (`_s`) or milliseconds (`_ms`), sizes bytes (`_bytes`). Fields are only
//! ever added within v1.
//!
//! Added within v1: per scenario `rollout` and `schedule`; `parameters.store`, `parameters.baseline_window`,
//! `parameters.lease_interval`; `hub.store`, `hub.apiserver_url`, `hub.apiserver_pid`; per
//! scenario `apiserver` (the hub apiserver's load during the scenario, `--store kube` only) and
//! `baseline` (the `baseline-klusterlet` scenario's comparison); per scenario `governance`
//! and `parameters.policies`; `parameters.hub_nice` and `hub.nice`; `governance.delivered` and
//! `governance.delivery_latency`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::cli::RunArgs;
use crate::machine::Machine;

/// The schema identifier every report carries.
pub const SCHEMA: &str = "flotilla-loadtest/v1";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    pub schema: String,
    pub tool_version: String,
    pub started_at: String,
    pub finished_at: String,
    pub command: Vec<String>,
    pub parameters: RunArgs,
    pub machine: Machine,
    pub hub: HubInfo,
    pub scenarios: Vec<ScenarioReport>,
    pub plots: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct HubInfo {
    /// `child`, `in-process` or `external`.
    pub mode: String,
    pub agents_address: String,
    pub api_address: String,
    /// `sled` or `kube` (`--store`), or `unknown` for an existing hub (`--hub`).
    #[serde(default)]
    pub store: String,
    /// With `--store kube`: the hub's kube-apiserver, and its process id (gone once the run
    /// has returned).
    #[serde(default)]
    pub apiserver_url: Option<String>,
    #[serde(default)]
    pub apiserver_pid: Option<u32>,
    /// A child hub's scheduling priority as the kernel holds it once started (`--hub-nice`).
    #[serde(default)]
    pub nice: Option<i32>,
}

/// How a scenario ended.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Everything it waited for happened.
    Completed,
    /// `--timeout` expired first; the numbers are what it saw until then.
    TimedOut,
    /// It could not run; `error` says why.
    Failed,
}

/// One point of a curve: seconds since the scenario started, and a value.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct Point {
    pub t_s: f64,
    pub value: f64,
}

/// Dials turned away before TLS, and the retry-afters they were given.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct TurnedAway {
    pub count: u64,
    pub mean_retry_after_ms: f64,
    pub max_retry_after_ms: u64,
}

impl TurnedAway {
    /// Between two samples of the agents' counters; `None` when nobody was turned away. The
    /// longest is over the whole run (the counters keep no history).
    pub fn between(before: &crate::swarm::Sample, after: &crate::swarm::Sample) -> Option<Self> {
        let count = after.turned_away - before.turned_away;
        (count > 0).then(|| TurnedAway {
            count,
            mean_retry_after_ms: (after.turned_away_ms_sum - before.turned_away_ms_sum) as f64
                / count as f64,
            max_retry_after_ms: after.turned_away_ms_max,
        })
    }
}

impl std::fmt::Display for TurnedAway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} times, told to come back after {:.0} ms on average (longest {} ms)",
            self.count, self.mean_retry_after_ms, self.max_retry_after_ms
        )
    }
}

/// Percentiles of a latency distribution, in milliseconds.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Percentiles {
    pub count: u64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// (latency ms, fraction of samples at or below it), for the CDF plot.
    pub cdf: Vec<(f64, f64)>,
}

impl Percentiles {
    /// From latencies in microseconds.
    pub fn from_micros(samples: &[u64]) -> Percentiles {
        let mut h = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3)
            .expect("static histogram bounds are valid");
        for s in samples {
            let _ = h.record((*s).clamp(1, 3_600_000_000));
        }
        if h.is_empty() {
            return Percentiles::default();
        }
        let ms = |v: u64| v as f64 / 1000.0;
        let cdf = (0..=100)
            .map(|q| {
                let q = q as f64 / 100.0;
                (ms(h.value_at_quantile(q)), q)
            })
            .collect();
        Percentiles {
            count: h.len(),
            p50_ms: ms(h.value_at_quantile(0.50)),
            p90_ms: ms(h.value_at_quantile(0.90)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            max_ms: ms(h.max()),
            cdf,
        }
    }

    pub fn ordered(&self) -> bool {
        self.p50_ms <= self.p90_ms && self.p90_ms <= self.p99_ms && self.p99_ms <= self.max_ms
    }
}

/// Statuses compared between the agents and the hub.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct StatusAudit {
    /// Agents whose records were read.
    pub agents: u64,
    /// (agent, work) pairs compared.
    pub compared: u64,
    /// The agent's latest status is not what the hub stored (or the hub has none).
    pub lost: u64,
    /// A status seq the hub acknowledged more than once to the same agent.
    pub duplicated: u64,
    /// Statuses still waiting in agents' outboxes when the audit ran.
    pub unacked: u64,
    /// Works an agent holds but has produced no status for yet (still applying).
    pub without_status: u64,
    /// A few mismatches, for a person to look at.
    pub examples: Vec<String>,
}

/// `connect --hold`: the cost of the sessions held idle (heartbeats only) for a while, from the
/// processes' CPU counters over the window.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct IdleReport {
    pub window_s: f64,
    /// Sessions at the start and at the end of the window.
    pub sessions_before: u64,
    pub sessions_after: u64,
    /// CPU seconds over the window: the session side (the gateways, or the hub's in-process
    /// gateway) and the agents' processes (the harness's, when the agents run in it).
    pub sessions_cpu_s: f64,
    pub agents_cpu_s: f64,
    /// The hub apiserver's requests in the window (`--store kube`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub apiserver_requests: Option<u64>,
}

impl IdleReport {
    /// Share of one core the session side spent per 10,000 sessions held.
    pub fn core_share_per_10k(&self) -> Option<f64> {
        let held = self.sessions_before.min(self.sessions_after);
        (held > 0 && self.window_s > 0.0)
            .then(|| self.sessions_cpu_s / self.window_s * 10_000.0 / held as f64)
    }
}

/// One scenario's results. Which fields are set depends on the scenario.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ScenarioReport {
    pub name: String,
    pub outcome: Option<Outcome>,
    pub error: Option<String>,
    pub duration_s: f64,
    /// Agents that took part.
    pub agents: u64,

    // connect
    /// With `--enroll join`: agents that joined with the bootstrap token, and that gave up.
    pub joined: Option<u64>,
    pub join_failures: Option<u64>,
    pub connected: Option<u64>,
    pub available_on_hub: Option<u64>,
    pub time_to_all_connected_s: Option<f64>,
    /// When the first agent dialled (the agents' processes, identities and caches come first);
    /// the setup rate counts from here.
    #[serde(default)]
    pub time_to_first_dial_s: Option<f64>,
    pub time_to_all_available_s: Option<f64>,
    /// Sessions established per second from the first dial to the last welcome.
    pub handshakes_per_s: Option<f64>,
    pub peak_handshakes_per_s: Option<f64>,
    pub failed_attempts: Option<u64>,
    /// Dials the hub turned away before TLS with a time to come back (in `storm`/`outage` from
    /// the stop), and that time's mean and longest.
    #[serde(default)]
    pub turned_away: Option<TurnedAway>,
    /// Redirects to a shard's owner the agents followed (scale-out mode): in `connect` from
    /// the start, in `storm`/`outage` from the stop.
    #[serde(default)]
    pub redirects: Option<u64>,
    pub hub_rss_before_bytes: Option<u64>,
    pub hub_rss_after_bytes: Option<u64>,
    pub hub_rss_per_session_bytes: Option<f64>,
    pub hub_cpu_s: Option<f64>,
    pub harness_cpu_s: Option<f64>,
    /// Hub RSS (bytes) against sessions connected, sampled during the ramp.
    pub rss_curve: Vec<(u64, u64)>,
    /// `--hold`: what holding every session idle cost, once all were up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle: Option<IdleReport>,

    // fanout
    pub work: Option<String>,
    pub create_s: Option<f64>,
    pub acked: Option<u64>,
    pub applied_on_hub: Option<u64>,
    pub ack_latency: Option<Percentiles>,
    pub applied_latency: Option<Percentiles>,
    pub poll_interval_ms: Option<f64>,

    // storm and outage
    pub signal: Option<String>,
    pub sessions_before: Option<u64>,
    pub hub_down_s: Option<f64>,
    pub time_to_all_back_s: Option<f64>,
    /// Sessions established after the hub was stopped (at least one per agent once all are
    /// back).
    pub sessions_reestablished: Option<u64>,
    pub peak_accept_per_s: Option<f64>,
    /// Of the sessions re-established, the TLS handshakes that resumed with a ticket the
    /// stopped process gave (the restarted hub's `flotilla_gateway_tls_resumptions_total`);
    /// the rest ran in full. Not counted with gateways.
    #[serde(default)]
    pub resumed_handshakes: Option<u64>,
    pub resume_frames_in: Option<u64>,
    pub resume_bytes_in: Option<u64>,
    pub resume_frames_out: Option<u64>,
    pub resume_bytes_out: Option<u64>,
    pub convergence_s: Option<f64>,
    pub statuses: Option<StatusAudit>,

    /// Sessions connected over time (every 100 ms), for connect, storm and outage.
    pub curve: Vec<Point>,
    /// Seconds into the scenario when the hub was stopped and started again.
    pub hub_stopped_at_s: Option<f64>,
    pub hub_started_at_s: Option<f64>,

    /// With `--store kube`: what the hub's apiserver served while this scenario ran.
    #[serde(default)]
    pub apiserver: Option<ApiserverLoad>,
    /// With `--gateways` (connect, storm, outage): every gateway at the end of the scenario.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateways: Option<GatewaysReport>,
    /// `baseline-klusterlet`: flotilla against klusterlet-style clients on apiserver load.
    #[serde(default)]
    pub baseline: Option<BaselineReport>,
    /// `proxy`: kubectl-shaped requests through the tunnels beside the same requests direct.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<crate::proxy::ProxyReport>,
    /// `links`: each carrier and the klusterlet pattern over links of one spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub links: Option<crate::over_links::LinksReport>,
    /// `baseline-bare`: the bare carrier beside flotilla.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bare: Option<BareReport>,

    // feedback
    /// How long the simulated Deployments' statuses changed, and how many changes were made.
    #[serde(default)]
    pub feedback_window_s: Option<f64>,
    #[serde(default)]
    pub feedback_changes: Option<u64>,
    /// Session bytes per cluster per second over the window, agent → hub and hub → agent.
    #[serde(default)]
    pub session_bytes_out_per_cluster_s: Option<f64>,
    #[serde(default)]
    pub session_bytes_in_per_cluster_s: Option<f64>,
    /// Statuses the agents sent per cluster per second over the window, and the agents' bound
    /// on it (one per work per feedback interval, plus one the window may start with).
    #[serde(default)]
    pub statuses_per_cluster_s: Option<f64>,
    #[serde(default)]
    pub statuses_bound_per_cluster_s: Option<f64>,
    /// Statuses the hub acknowledged per second over the window: its store writes, since a
    /// status is acknowledged once stored.
    #[serde(default)]
    pub store_writes_per_s: Option<f64>,
    /// Works whose status on the hub shows the last value set, and how long after the window
    /// the last of them got there.
    #[serde(default)]
    pub feedback_converged: Option<u64>,
    #[serde(default)]
    pub feedback_converge_s: Option<f64>,
    /// `rollout`: a Progressive rollout that must stop at a failing cluster, then complete.
    #[serde(default)]
    pub rollout: Option<RolloutReport>,
    /// `schedule`: the placement scheduler at scale.
    #[serde(default)]
    pub schedule: Option<ScheduleReport>,
    /// `governance`: policies over every cluster, their compliance on the hub and its churn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub governance: Option<GovernanceReport>,
    /// `chaos`: the faults injected and the invariants judged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chaos: Option<crate::chaos::ChaosReport>,
}

/// `rollout`: what the Progressive rollout did with a failing cluster, and after the fix.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RolloutReport {
    /// `maxConcurrency` as given, and the clusters it allows in flight.
    pub max_concurrency: String,
    pub window: u64,
    /// The clusters made to refuse revision 1.
    pub failing_clusters: Vec<String>,
    /// The clusters the replica set's `PlacementRolledOut` condition named when it stopped.
    pub reported_failed: Vec<String>,
    /// Seconds from the replica set's create to its stop.
    pub stopped_after_s: Option<f64>,
    /// Which window of `window` clusters (in name order, from 1) held the first failing one.
    pub stopped_in_window: Option<u64>,
    /// Clusters revision 1 had reached when the rollout stopped.
    pub reached_when_stopped: u64,
    /// The most clusters of each revision in flight (reached, not yet Available) at once.
    pub max_in_flight_v1: u64,
    pub max_in_flight_v2: u64,
    /// Seconds from the fixed revision to every cluster Available with it.
    pub complete_after_fix_s: Option<f64>,
    pub reached_v2: u64,
}

/// `schedule`: placements over every enrolled cluster.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ScheduleReport {
    pub clusters: u64,
    pub placements: u64,
    pub regions: u64,
    /// `numberOfClusters` of each placement.
    pub clusters_per_placement: u64,
    /// Labelling every cluster with its region and binding the global set.
    pub setup_s: Option<f64>,
    /// Creating the placements through the operator API.
    pub create_s: Option<f64>,
    /// From the first create to every placement decided.
    pub time_to_all_decided_s: Option<f64>,
    /// Each placement, from its create to its decision being stored.
    pub decision_latency: Option<Percentiles>,
    /// One more placement created on the settled hub, to its decision.
    pub single_placement_s: Option<f64>,
    pub label_changes: u64,
    /// Decisions that held a relabelled cluster (summed over the changes).
    pub affected_decisions: u64,
    /// Each label change, to every affected decision reflecting it.
    pub label_change_all_affected: Option<Percentiles>,
    /// Each affected decision, from the label change to its update.
    pub label_change_per_decision: Option<Percentiles>,
    /// The hub's resident memory with the clusters loaded, before and after the placements.
    pub hub_rss_before_bytes: Option<u64>,
    pub hub_rss_after_bytes: Option<u64>,
    pub poll_interval_ms: f64,
}

/// `governance`: policies bound to every cluster, each cluster's compliance reaching the hub,
/// and the cost of changing it. Times are seconds from the phase's first write (a policy's
/// create, or its flip); a (policy, cluster) pair is stamped when a list of the hub's
/// ClusterCompliance records that came back shows the pair's verdict, so each stamp is late by
/// up to one poll cycle (`poll_cycle_ms`, measured) and never early.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GovernanceReport {
    pub clusters: u64,
    pub policies: u64,
    /// Policies whose template only informs (a namespace the spokes lack: NonCompliant), and
    /// that enforce (a ConfigMap the agents create: Compliant).
    pub inform_policies: u64,
    pub enforce_policies: u64,
    /// Binding the global cluster set and the Placement deciding every cluster.
    pub setup_s: Option<f64>,
    /// Creating every Policy and its PlacementBinding through the operator API.
    pub create_s: Option<f64>,
    /// (policy, cluster) pairs expected (`policies × clusters`), and those whose verdict
    /// (Compliant or NonCompliant) reached the cluster's record on the hub.
    pub pairs: u64,
    pub reported: u64,
    /// Reported pairs whose verdict is not the expected one (inform NonCompliant, enforce
    /// Compliant), and a few of them for a person to look at.
    pub unexpected: u64,
    pub unexpected_examples: Vec<String>,
    /// Each pair, from its policy's create to its verdict in the cluster's record.
    pub compliance_latency: Option<Percentiles>,
    /// Pairs whose policy the cluster's agent stored durably (and acked), and each one's time
    /// from its policy's create: the share of the latency that is delivery.
    #[serde(default)]
    pub delivered: u64,
    #[serde(default)]
    pub delivery_latency: Option<Percentiles>,
    /// From the first create to every pair reported.
    pub time_to_all_reported_s: Option<f64>,
    /// Root Policies whose `status.compliant` is the expected aggregate, and from the first
    /// create to all of them.
    pub roots_aggregated: u64,
    pub time_to_all_aggregated_s: Option<f64>,
    /// Writes to the hub's store (every kind, from the store's revision counter: the sled
    /// store's own, or etcd's with `--store kube`) from the first create to every root
    /// aggregated, and per second over that window.
    pub store_writes: Option<u64>,
    pub store_writes_per_s: Option<f64>,
    /// The churn: every inform policy flipped to enforce once all were reported.
    pub churn: Option<ChurnReport>,
    /// `--poll-interval`, and the measured time between two lists of the records (the list
    /// itself included): the resolution of every stamp.
    pub poll_interval_ms: f64,
    pub poll_cycle_ms: Option<f64>,
}

/// `governance`: every inform policy flipped to enforce, its agents creating the namespace and
/// reporting Compliant.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ChurnReport {
    pub flipped: u64,
    /// (flipped policy, cluster) pairs expected, and those reported Compliant at the flipped
    /// generation.
    pub pairs: u64,
    pub reported: u64,
    /// Each pair, from its policy's flip to Compliant in the cluster's record.
    pub latency: Option<Percentiles>,
    pub time_to_all_reported_s: Option<f64>,
    /// Flipped roots aggregated Compliant, and from the first flip to all of them.
    pub roots_aggregated: u64,
    pub time_to_all_aggregated_s: Option<f64>,
    /// The hub's store writes from the first flip to every flipped root aggregated, per second,
    /// and per cluster.
    pub store_writes: Option<u64>,
    pub store_writes_per_s: Option<f64>,
    pub store_writes_per_cluster: Option<f64>,
}

/// What one kube-apiserver served over a window, from its own `/metrics`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct BareReport {
    /// The carrier both sides used.
    pub carrier: String,
    /// Sessions the bare server held.
    pub sessions: u64,
    /// The bare server's RSS growth per session.
    pub bare_rss_per_session_bytes: Option<f64>,
    /// The hub's, from `connect` in the same run.
    pub flotilla_rss_per_session_bytes: Option<f64>,
    /// flotilla / bare (target: at most 1.0).
    pub memory_ratio: Option<f64>,
    /// Sessions set up per second from the first dial to the last welcome.
    pub bare_setup_per_s: Option<f64>,
    /// The hub's, from `connect` in the same run.
    pub flotilla_setup_per_s: Option<f64>,
    /// flotilla / bare (target: at least 0.9).
    pub setup_ratio: Option<f64>,
}

/// The gateway processes of a `--gateways` run at one moment.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GatewaysReport {
    pub each: Vec<crate::gateways::GatewayReport>,
    /// Sum of the gateways' RSS and CPU seconds.
    pub rss_bytes: u64,
    pub cpu_seconds: f64,
    /// `rss_bytes` over the sessions they hold.
    pub rss_per_session_bytes: Option<f64>,
    /// Every agent held by the gateway owning its shard in the Leases, and by no other.
    pub all_on_owners: bool,
    /// storm and outage: the hub apiserver's load from just before the gateways were stopped
    /// until every agent was back on its shard's owner (statuses had settled before the stop,
    /// so this is what restarting every gateway costs the apiserver). Per gateway it is this
    /// over the number of gateways; each gateway's own count is its `store_requests`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storm_apiserver: Option<ApiserverLoad>,
}

impl GatewaysReport {
    pub fn new(each: Vec<crate::gateways::GatewayReport>, agents: u64) -> GatewaysReport {
        let rss_bytes = each.iter().filter_map(|g| g.rss_bytes).sum::<u64>();
        let sessions = each.iter().map(|g| g.sessions).sum::<u64>();
        GatewaysReport {
            rss_bytes,
            cpu_seconds: each.iter().filter_map(|g| g.cpu_seconds).sum(),
            rss_per_session_bytes: (sessions > 0).then(|| rss_bytes as f64 / sessions as f64),
            all_on_owners: crate::gateways::all_on_owners(&each, agents),
            each,
            storm_apiserver: None,
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ApiserverLoad {
    pub window_s: f64,
    /// Requests that started in the window: `apiserver_request_total` counts a request when it
    /// finishes, so watches still open at the end are added from `apiserver_longrunning_requests`.
    /// Includes the apiserver's own housekeeping (its identity lease, endpoint reconciling), the
    /// same few requests a minute on any apiserver.
    pub requests: u64,
    /// `requests` by verb (`GET`, `LIST`, `WATCH`, `POST`, `PUT`, `PATCH`, ...); sums to
    /// `requests`.
    pub requests_by_verb: BTreeMap<String, u64>,
    /// `requests` by resource (`manifestworks`, `managedclusters/status`, `leases`, ...,
    /// `(non-resource)`); sums to `requests`.
    pub requests_by_resource: BTreeMap<String, u64>,
    /// `requests` by verb and resource together, as `"LIST manifestworks"`; sums to
    /// `requests`.
    #[serde(default)]
    pub requests_by_verb_resource: BTreeMap<String, u64>,
    /// Watches the apiserver held at the end of the window, its own internal ones included.
    pub watches_held: u64,
    /// `watches_held` less the watches the apiserver held for itself before any client came.
    pub watches_held_by_clients: u64,
    /// Resident memory of the kube-apiserver process at the end of the window.
    pub rss_bytes: Option<u64>,
}

impl ApiserverLoad {
    /// Requests per minute over the window.
    pub fn per_minute(&self) -> f64 {
        self.requests as f64 * 60.0 / self.window_s.max(1e-3)
    }
}

/// One side of the baseline: the apiserver load of each phase.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct BaselineSide {
    /// Every agent (client) coming up and becoming Available.
    pub connect: Option<ApiserverLoad>,
    /// One ManifestWork per cluster created, delivered, and Applied and Available.
    pub fanout: Option<ApiserverLoad>,
    /// Every agent (client) up and nothing happening, for `--baseline-window`.
    pub idle: Option<ApiserverLoad>,
    /// Every agent (client) reconnecting at once, until all are back.
    #[serde(default)]
    pub storm: Option<ApiserverLoad>,
}

/// One row of the comparison: apiserver requests of each side and klusterlet / flotilla.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct BaselineRow {
    /// `connect`, `fanout`, `idle_per_minute`, `storm` or `total`.
    pub phase: String,
    pub flotilla: Option<f64>,
    pub klusterlet: Option<f64>,
    /// `klusterlet / flotilla`; absent when either is, or flotilla's is 0.
    pub ratio: Option<f64>,
}

/// `baseline-klusterlet`: the apiserver load of flotilla's agents (on the hub's apiserver)
/// against one klusterlet-style client per cluster listing and watching a second, fresh
/// apiserver itself.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct BaselineReport {
    /// Klusterlet clients the scenario runs: one per agent of the run.
    pub clients: u64,
    /// Clients whose task started.
    pub clients_started: u64,
    /// Clients whose two informers (ManifestWorks in their namespace, their ManagedCluster)
    /// finished their initial list.
    pub clients_synced: u64,
    /// Clients that wrote their ManagedCluster's Available condition and created their Lease.
    pub clients_registered: u64,
    /// Clients whose ManifestWork watch delivered the fan-out work.
    pub clients_saw_work: u64,
    /// ManifestWork status updates the clients wrote (Applied and Available).
    pub statuses_written: u64,
    /// Lease renewals (updates after the create) the clients wrote.
    pub lease_renewals: u64,
    /// Clients that listed both kinds again after the storm's restart.
    #[serde(default)]
    pub clients_resynced: u64,
    /// Client requests that failed and were retried.
    pub client_errors: u64,
    /// A few of those failures, for a person to look at.
    pub client_error_examples: Vec<String>,
    /// The fan-out work's name; one per cluster namespace.
    pub work: Option<String>,
    pub works_created: u64,
    /// Works the apiserver shows with Applied=True and Available=True.
    pub works_applied: u64,
    pub lease_interval_s: f64,
    pub window_s: f64,
    /// From the hub's kill to every agent's new session.
    #[serde(default)]
    pub flotilla_storm_back_s: Option<f64>,
    /// From the clients' restart to every one listed again.
    #[serde(default)]
    pub klusterlet_storm_back_s: Option<f64>,
    /// The hub's apiserver: connect and fanout from the run's earlier `connect` and `fanout`
    /// scenarios (absent unless they ran and completed), idle measured by this scenario.
    pub flotilla: BaselineSide,
    /// The klusterlet clients' apiserver, phase by phase.
    pub klusterlet: BaselineSide,
    /// The comparison; `total` sums the phases both sides measured (idle as its window).
    pub rows: Vec<BaselineRow>,
    /// The klusterlet side's kube-apiserver process (gone once the scenario has returned).
    pub klusterlet_apiserver_pid: Option<u32>,
}

impl BaselineReport {
    /// Fills `rows` from the two sides.
    pub fn compare(&mut self) {
        let f = &self.flotilla;
        let k = &self.klusterlet;
        let requests = |l: &Option<ApiserverLoad>| l.as_ref().map(|l| l.requests as f64);
        let per_minute = |l: &Option<ApiserverLoad>| l.as_ref().map(ApiserverLoad::per_minute);
        let mut rows = vec![
            row("connect", requests(&f.connect), requests(&k.connect)),
            row("fanout", requests(&f.fanout), requests(&k.fanout)),
            row("idle_per_minute", per_minute(&f.idle), per_minute(&k.idle)),
            row("storm", requests(&f.storm), requests(&k.storm)),
        ];
        let both: Vec<(f64, f64)> = [
            (&f.connect, &k.connect),
            (&f.fanout, &k.fanout),
            (&f.idle, &k.idle),
            (&f.storm, &k.storm),
        ]
        .into_iter()
        .filter_map(|(f, k)| Some((requests(f)?, requests(k)?)))
        .collect();
        if !both.is_empty() {
            rows.push(row(
                "total",
                Some(both.iter().map(|(f, _)| f).sum()),
                Some(both.iter().map(|(_, k)| k).sum()),
            ));
        }
        self.rows = rows;
    }
}

fn row(phase: &str, flotilla: Option<f64>, klusterlet: Option<f64>) -> BaselineRow {
    BaselineRow {
        phase: phase.to_string(),
        flotilla,
        klusterlet,
        ratio: match (flotilla, klusterlet) {
            (Some(f), Some(k)) if f > 0.0 => Some(k / f),
            _ => None,
        },
    }
}

impl ScenarioReport {
    pub fn new(name: &str, agents: usize) -> ScenarioReport {
        ScenarioReport {
            name: name.to_string(),
            agents: agents as u64,
            ..Default::default()
        }
    }
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

fn secs(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.2} s"))
}

/// The table printed at the end of a run.
pub fn table(report: &Report) -> String {
    let mut t = String::new();
    let m = &report.machine;
    let _ = writeln!(
        t,
        "flotilla-loadtest: {} agents, hub {} ({} store) at {}, {} cores, {:.1} GiB, kernel {}, load {:.2}",
        report.parameters.agents,
        report.hub.mode,
        report.hub.store,
        report.hub.agents_address,
        m.cores,
        m.memory_bytes as f64 / (1u64 << 30) as f64,
        m.kernel,
        m.load_average_1m
    );
    if let Some(link) = report.parameters.link.describe() {
        let _ = writeln!(t, "agents behind an emulated link: {link}");
    }
    for s in &report.scenarios {
        let outcome = match s.outcome {
            Some(Outcome::Completed) => "completed".to_string(),
            Some(Outcome::TimedOut) => "TIMED OUT".to_string(),
            Some(Outcome::Failed) | None => {
                format!("FAILED: {}", s.error.as_deref().unwrap_or("?"))
            }
        };
        let _ = writeln!(t, "\n{:<10} {} in {:.1} s", s.name, outcome, s.duration_s);
        let mut row = |k: &str, v: String| {
            let _ = writeln!(t, "  {k:<34} {v}");
        };
        match s.name.as_str() {
            "connect" => {
                if let Some(joined) = s.joined {
                    row(
                        "joined (token, CSR, auto-accept)",
                        format!("{joined} / {} ({} gave up)", s.agents, opt(s.join_failures)),
                    );
                }
                row(
                    "sessions connected",
                    format!("{} / {}", opt(s.connected), s.agents),
                );
                row(
                    "Available on the hub",
                    format!("{} / {}", opt(s.available_on_hub), s.agents),
                );
                row("first dial", secs(s.time_to_first_dial_s));
                row("time to all connected", secs(s.time_to_all_connected_s));
                row("time to all Available", secs(s.time_to_all_available_s));
                row(
                    "handshakes/s (mean, peak)",
                    format!(
                        "{:.0}, {:.0}",
                        s.handshakes_per_s.unwrap_or(0.0),
                        s.peak_handshakes_per_s.unwrap_or(0.0)
                    ),
                );
                row("failed attempts", opt(s.failed_attempts));
                if let Some(t) = &s.turned_away {
                    row("turned away before TLS", t.to_string());
                }
                if s.redirects.is_some_and(|r| r > 0) {
                    row("redirects followed", opt(s.redirects));
                }
                row(
                    "hub RSS before → after",
                    match (s.hub_rss_before_bytes, s.hub_rss_after_bytes) {
                        (Some(b), Some(a)) => format!("{:.1} → {:.1} MiB", mib(b), mib(a)),
                        _ => "- (hub not a child process)".into(),
                    },
                );
                row(
                    "hub RSS per session",
                    s.hub_rss_per_session_bytes
                        .map_or("-".into(), |b| format!("{:.1} KiB", b / 1024.0)),
                );
                row("hub CPU", secs(s.hub_cpu_s));
                row("harness CPU", secs(s.harness_cpu_s));
                if let Some(idle) = &s.idle {
                    row(
                        "held idle",
                        format!(
                            "{:.0} s, {} → {} sessions",
                            idle.window_s, idle.sessions_before, idle.sessions_after
                        ),
                    );
                    row(
                        "idle CPU: sessions, agents",
                        format!(
                            "{:.1} %, {:.1} % of a core ({} per 10,000 sessions)",
                            idle.sessions_cpu_s / idle.window_s.max(1e-3) * 100.0,
                            idle.agents_cpu_s / idle.window_s.max(1e-3) * 100.0,
                            idle.core_share_per_10k()
                                .map_or("-".into(), |c| format!("{:.1} %", c * 100.0)),
                        ),
                    );
                    if let Some(n) = idle.apiserver_requests {
                        row(
                            "idle apiserver requests",
                            format!("{n} ({:.1}/s)", n as f64 / idle.window_s.max(1e-3)),
                        );
                    }
                }
            }
            "fanout" => {
                row("ManifestWork", opt(s.work.clone()));
                row("created in", secs(s.create_s));
                row(
                    "acked by agents",
                    format!("{} / {}", opt(s.acked), s.agents),
                );
                row(
                    "Applied on the hub",
                    format!("{} / {}", opt(s.applied_on_hub), s.agents),
                );
                if let Some(p) = &s.ack_latency {
                    row("create → durable ack", pct(p));
                }
                if let Some(p) = &s.applied_latency {
                    let how = match s.poll_interval_ms {
                        Some(ms) => format!("(±{ms:.0} ms)"),
                        None => "(watched)".to_owned(),
                    };
                    row(&format!("create → Applied {how}"), pct(p));
                }
            }
            "baseline-klusterlet" => {
                if let Some(b) = &s.baseline {
                    baseline_rows(b, &mut row);
                }
            }
            "chaos" => {
                if let Some(c) = &s.chaos {
                    crate::chaos::table_rows(c, &mut row);
                }
            }
            "rollout" => {
                if let Some(ro) = &s.rollout {
                    row(
                        "maxConcurrency",
                        format!(
                            "{} ({} clusters in flight at most)",
                            ro.max_concurrency, ro.window
                        ),
                    );
                    row(
                        "failing clusters (injected)",
                        ro.failing_clusters.join(", "),
                    );
                    row(
                        "stopped, naming",
                        format!(
                            "{} after {} (window {}, {} clusters reached)",
                            if ro.reported_failed.is_empty() {
                                "-".to_string()
                            } else {
                                ro.reported_failed.join(", ")
                            },
                            secs(ro.stopped_after_s),
                            opt(ro.stopped_in_window),
                            ro.reached_when_stopped
                        ),
                    );
                    row(
                        "fixed revision complete",
                        format!(
                            "{} ({} / {} clusters)",
                            secs(ro.complete_after_fix_s),
                            ro.reached_v2,
                            s.agents
                        ),
                    );
                    row(
                        "most in flight (v1, v2)",
                        format!("{}, {}", ro.max_in_flight_v1, ro.max_in_flight_v2),
                    );
                }
            }
            "schedule" => {
                if let Some(sc) = &s.schedule {
                    row(
                        "placements x clusters",
                        format!(
                            "{} placements, each {} of a region's clusters ({} regions), over {} clusters",
                            sc.placements, sc.clusters_per_placement, sc.regions, sc.clusters
                        ),
                    );
                    row("created in", secs(sc.create_s));
                    row("time to all decided", secs(sc.time_to_all_decided_s));
                    if let Some(p) = &sc.decision_latency {
                        row(
                            &format!("create → decision (±{:.0} ms)", sc.poll_interval_ms),
                            pct(p),
                        );
                    }
                    row(
                        "one placement on a settled hub",
                        secs(sc.single_placement_s),
                    );
                    if let Some(p) = &sc.label_change_per_decision {
                        row(
                            &format!(
                                "label change → decision ({} of {} changes)",
                                sc.affected_decisions, sc.label_changes
                            ),
                            pct(p),
                        );
                    }
                    if let Some(p) = &sc.label_change_all_affected {
                        row("label change → all affected", pct(p));
                    }
                    row(
                        "hub RSS clusters → + placements",
                        match (sc.hub_rss_before_bytes, sc.hub_rss_after_bytes) {
                            (Some(b), Some(a)) => format!("{:.1} → {:.1} MiB", mib(b), mib(a)),
                            _ => "- (hub not a child process)".into(),
                        },
                    );
                }
            }
            "governance" if s.governance.is_some() => {
                governance_rows(s.governance.as_ref().expect("checked above"), &mut row);
            }
            "links" if s.links.is_some() => {
                for (name, value) in s.links.as_ref().expect("checked above").rows() {
                    row(&name, value);
                }
            }
            "proxy" if s.proxy.is_some() => {
                let p = s.proxy.as_ref().expect("checked above");
                row("cluster", p.cluster.clone());
                row(
                    "small GET p50 / p99 (direct)",
                    format!("{:.2} / {:.2} ms", p.direct_get.p50_ms, p.direct_get.p99_ms),
                );
                row(
                    "small GET p50 / p99 (tunnel)",
                    format!("{:.2} / {:.2} ms", p.tunnel_get.p50_ms, p.tunnel_get.p99_ms),
                );
                row(
                    "added p50 / p99",
                    format!("{:.2} / {:.2} ms", p.added_p50_ms, p.added_p99_ms),
                );
                row(
                    "large list (bytes) direct / tunnel",
                    format!(
                        "({}) {:.1} / {:.1} MB/s, ratio {:.2}",
                        p.list_bytes, p.direct_list_mb_s, p.tunnel_list_mb_s, p.list_ratio
                    ),
                );
                row(
                    "concurrent tunnels ok",
                    format!(
                        "{} / {} in {:.2} s, p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
                        p.concurrent_ok,
                        p.concurrent_tunnels,
                        p.concurrent_wall_s,
                        p.concurrent.p50_ms,
                        p.concurrent.p99_ms,
                        p.concurrent.max_ms
                    ),
                );
            }
            "baseline-bare" if s.bare.is_some() => {
                let b = s.bare.as_ref().expect("checked above");
                let kib = |v: Option<f64>| {
                    v.map_or_else(|| "-".into(), |v| format!("{:.1} KiB", v / 1024.0))
                };
                let rate = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.0}/s"));
                let x = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.2}x"));
                row(
                    "carrier, sessions held",
                    format!("{}, {}", b.carrier, b.sessions),
                );
                row(
                    "RSS per session flotilla / bare",
                    format!(
                        "{} / {} = {} (target ≤ 1.0x)",
                        kib(b.flotilla_rss_per_session_bytes),
                        kib(b.bare_rss_per_session_bytes),
                        x(b.memory_ratio)
                    ),
                );
                row(
                    "setup rate flotilla / bare",
                    format!(
                        "{} / {} = {} (target ≥ 0.9x)",
                        rate(b.flotilla_setup_per_s),
                        rate(b.bare_setup_per_s),
                        x(b.setup_ratio)
                    ),
                );
            }
            "feedback" => {
                let f1 = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.1}"));
                row(
                    "status changes on the spokes",
                    format!(
                        "{} in {}",
                        opt(s.feedback_changes),
                        secs(s.feedback_window_s)
                    ),
                );
                row(
                    "session bytes/cluster/s out, in",
                    format!(
                        "{}, {}",
                        f1(s.session_bytes_out_per_cluster_s),
                        f1(s.session_bytes_in_per_cluster_s)
                    ),
                );
                row(
                    "statuses/cluster/s (bound)",
                    format!(
                        "{} ({})",
                        s.statuses_per_cluster_s
                            .map_or_else(|| "-".into(), |v| format!("{v:.3}")),
                        s.statuses_bound_per_cluster_s
                            .map_or_else(|| "-".into(), |v| format!("{v:.3}"))
                    ),
                );
                row("hub store writes/s", f1(s.store_writes_per_s));
                row(
                    "latest status on the hub",
                    format!(
                        "{} / {} after {}",
                        opt(s.feedback_converged),
                        s.agents,
                        secs(s.feedback_converge_s)
                    ),
                );
            }
            _ => {
                // With --gateways the gateways are stopped, not the hub.
                let what = if s.gateways.is_some() {
                    "gateways"
                } else {
                    "hub"
                };
                row(&format!("{what} stopped with"), opt(s.signal.clone()));
                row("sessions before", opt(s.sessions_before));
                row(&format!("{what} down for"), secs(s.hub_down_s));
                row("time to 100% back", secs(s.time_to_all_back_s));
                row("sessions re-established", opt(s.sessions_reestablished));
                if s.resumed_handshakes.is_some() {
                    row("TLS handshakes resumed", opt(s.resumed_handshakes));
                }
                if let Some(t) = &s.turned_away {
                    row("turned away before TLS", t.to_string());
                }
                if s.redirects.is_some_and(|r| r > 0) {
                    row("redirects followed", opt(s.redirects));
                }
                row(
                    "peak accept rate",
                    s.peak_accept_per_s
                        .map_or("-".into(), |v| format!("{v:.0} sessions/s")),
                );
                if s.resume_frames_in.is_some() {
                    row(
                        "resume volume hub→agents",
                        format!(
                            "{} frames, {} bytes",
                            opt(s.resume_frames_in),
                            opt(s.resume_bytes_in)
                        ),
                    );
                    row(
                        "resume volume agents→hub",
                        format!(
                            "{} frames, {} bytes",
                            opt(s.resume_frames_out),
                            opt(s.resume_bytes_out)
                        ),
                    );
                    row("convergence", secs(s.convergence_s));
                }
                if let Some(a) = &s.statuses {
                    row(
                        "statuses lost / duplicated",
                        format!("{} / {} (of {} compared)", a.lost, a.duplicated, a.compared),
                    );
                }
            }
        }
        if let Some(g) = &s.gateways {
            gateway_rows(g, &mut row);
        }
        if let Some(a) = &s.apiserver {
            apiserver_rows(a, &mut row);
        }
    }
    if !report.plots.is_empty() {
        let _ = writeln!(t, "\nplots: {}", report.plots.join(", "));
    }
    t
}

/// Resources whose requests the table names one by one: flotilla's kinds and what a
/// klusterlet writes besides them. The rest add up to "other".
const NAMED_RESOURCES: &[&str] = &[
    "managedclusters",
    "managedclusters/status",
    "manifestworks",
    "manifestworks/status",
    "leases",
    "namespaces",
];

/// `--gateways`: each gateway's sessions, shards and resources, their sum, and the storm
/// window's apiserver requests by verb and resource.
fn gateway_rows(g: &GatewaysReport, row: &mut impl FnMut(&str, String)) {
    for gw in &g.each {
        row(
            &format!("gateway {}", gw.name),
            format!(
                "{} sessions ({} owned), {} shards, RSS {}, CPU {}",
                gw.sessions,
                gw.owned_clusters,
                gw.shards,
                gw.rss_bytes
                    .map_or("-".into(), |b| format!("{:.1} MiB", mib(b))),
                gw.cpu_seconds.map_or("-".into(), |c| format!("{c:.2} s")),
            ),
        );
    }
    row(
        "gateways RSS, CPU (sum)",
        format!("{:.1} MiB, {:.2} s", mib(g.rss_bytes), g.cpu_seconds),
    );
    row(
        "gateways RSS per session",
        g.rss_per_session_bytes
            .map_or("-".into(), |b| format!("{:.1} KiB", b / 1024.0)),
    );
    row(
        "every agent on its shard's owner",
        if g.all_on_owners { "yes" } else { "NO" }.into(),
    );
    if let Some(a) = &g.storm_apiserver {
        let each: Vec<String> = a
            .requests_by_verb_resource
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        row(
            "storm window apiserver requests",
            format!("{} in {:.1} s: {}", a.requests, a.window_s, each.join(", ")),
        );
    }
}

fn apiserver_rows(a: &ApiserverLoad, row: &mut impl FnMut(&str, String)) {
    let verbs: Vec<String> = a
        .requests_by_verb
        .iter()
        .map(|(v, n)| format!("{v} {n}"))
        .collect();
    row(
        "apiserver requests",
        format!(
            "{} in {:.1} s ({})",
            a.requests,
            a.window_s,
            if verbs.is_empty() {
                "none".to_string()
            } else {
                verbs.join(", ")
            }
        ),
    );
    let mut named: Vec<String> = Vec::new();
    let mut other = 0;
    for (r, n) in &a.requests_by_resource {
        if NAMED_RESOURCES.contains(&r.as_str()) {
            named.push(format!("{r} {n}"));
        } else {
            other += n;
        }
    }
    if other > 0 {
        named.push(format!("other {other}"));
    }
    if !named.is_empty() {
        row("  by resource", named.join(", "));
    }
    row(
        "apiserver watches held (clients)",
        format!("{} ({})", a.watches_held, a.watches_held_by_clients),
    );
    row(
        "apiserver RSS",
        a.rss_bytes
            .map_or("-".into(), |b| format!("{:.1} MiB", mib(b))),
    );
}

fn governance_rows(g: &GovernanceReport, row: &mut impl FnMut(&str, String)) {
    let rate = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.1}/s"));
    row(
        "policies x clusters",
        format!(
            "{} ({} inform, {} enforce) x {}",
            g.policies, g.inform_policies, g.enforce_policies, g.clusters
        ),
    );
    row(
        "setup, policies created in",
        format!("{}, {}", secs(g.setup_s), secs(g.create_s)),
    );
    row(
        "compliance on the hub",
        format!(
            "{} / {} pairs ({} unexpected)",
            g.reported, g.pairs, g.unexpected
        ),
    );
    if let Some(p) = &g.compliance_latency {
        row(
            &format!(
                "create → compliance (±{})",
                g.poll_cycle_ms
                    .map_or_else(|| "-".into(), |c| format!("{c:.0} ms"))
            ),
            pct(p),
        );
    }
    if let Some(p) = &g.delivery_latency {
        row(
            "create → stored by the agent",
            format!("{} / {} pairs, {}", g.delivered, g.pairs, pct(p)),
        );
    }
    row("time to all reported", secs(g.time_to_all_reported_s));
    row(
        "roots aggregated",
        format!(
            "{} / {} after {}",
            g.roots_aggregated,
            g.policies,
            secs(g.time_to_all_aggregated_s)
        ),
    );
    row(
        "hub store writes",
        format!("{} ({})", opt(g.store_writes), rate(g.store_writes_per_s)),
    );
    if let Some(c) = &g.churn {
        row(
            "churn: inform → enforce",
            format!(
                "{} policies, {} / {} pairs Compliant",
                c.flipped, c.reported, c.pairs
            ),
        );
        if let Some(p) = &c.latency {
            row("churn: flip → Compliant", pct(p));
        }
        row(
            "churn: all reported, aggregated",
            format!(
                "{}, {} ({} / {} roots)",
                secs(c.time_to_all_reported_s),
                secs(c.time_to_all_aggregated_s),
                c.roots_aggregated,
                c.flipped
            ),
        );
        row(
            "churn: hub store writes",
            format!(
                "{} ({}, {} per cluster)",
                opt(c.store_writes),
                rate(c.store_writes_per_s),
                c.store_writes_per_cluster
                    .map_or_else(|| "-".into(), |v| format!("{v:.1}"))
            ),
        );
    }
}

fn baseline_rows(b: &BaselineReport, row: &mut impl FnMut(&str, String)) {
    row(
        "klusterlet clients",
        format!(
            "{} started, {} synced, {} registered, {} saw the work, of {}",
            b.clients_started,
            b.clients_synced,
            b.clients_registered,
            b.clients_saw_work,
            b.clients
        ),
    );
    row(
        "works Applied (klusterlet side)",
        format!(
            "{} / {} ({} statuses written, {} lease renewals, {} client errors)",
            b.works_applied, b.works_created, b.statuses_written, b.lease_renewals, b.client_errors
        ),
    );
    let secs = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1} s"));
    row(
        "storm: all back",
        format!(
            "flotilla {} (hub killed), klusterlet {} ({} of {} clients listed again)",
            secs(b.flotilla_storm_back_s),
            secs(b.klusterlet_storm_back_s),
            b.clients_resynced,
            b.clients
        ),
    );
    row(
        "apiserver requests",
        format!("{:>12} {:>12} {:>12}", "flotilla", "klusterlet", "ratio"),
    );
    for r in &b.rows {
        let num = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0}"));
        row(
            &format!("  {}", r.phase.replace('_', " ")),
            format!(
                "{:>12} {:>12} {:>12}",
                num(r.flotilla),
                num(r.klusterlet),
                r.ratio.map_or("-".into(), |x| format!("{x:.1}x"))
            ),
        );
    }
    let idle =
        |s: &BaselineSide, f: fn(&ApiserverLoad) -> String| s.idle.as_ref().map_or("-".into(), f);
    row(
        "watches held by clients (idle)",
        format!(
            "{:>12} {:>12}",
            idle(&b.flotilla, |l| l.watches_held_by_clients.to_string()),
            idle(&b.klusterlet, |l| l.watches_held_by_clients.to_string())
        ),
    );
    row(
        "apiserver RSS (idle)",
        format!(
            "{:>12} {:>12}",
            idle(&b.flotilla, |l| l
                .rss_bytes
                .map_or("-".into(), |b| format!("{:.0} MiB", mib(b)))),
            idle(&b.klusterlet, |l| l
                .rss_bytes
                .map_or("-".into(), |b| format!("{:.0} MiB", mib(b))))
        ),
    );
    if !b.client_error_examples.is_empty() {
        row("client errors, e.g.", b.client_error_examples.join("; "));
    }
}

fn pct(p: &Percentiles) -> String {
    format!(
        "p50 {:.0} ms, p90 {:.0} ms, p99 {:.0} ms, max {:.0} ms (n={})",
        p.p50_ms, p.p90_ms, p.p99_ms, p.max_ms, p.count
    )
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turned_away_counts_the_window_and_says_what_the_agents_were_told() {
        let before = crate::swarm::Sample {
            turned_away: 10,
            turned_away_ms_sum: 1_000,
            turned_away_ms_max: 400,
            ..Default::default()
        };
        let after = crate::swarm::Sample {
            turned_away: 14,
            turned_away_ms_sum: 3_000,
            turned_away_ms_max: 900,
            ..Default::default()
        };
        let t = TurnedAway::between(&before, &after).expect("four were turned away");
        assert_eq!(t.count, 4);
        assert!((t.mean_retry_after_ms - 500.0).abs() < 1e-9);
        assert_eq!(
            t.to_string(),
            "4 times, told to come back after 500 ms on average (longest 900 ms)"
        );
        assert_eq!(TurnedAway::between(&after, &after), None);
    }

    #[test]
    fn idle_core_share_is_per_ten_thousand_sessions_held_throughout() {
        let idle = IdleReport {
            window_s: 30.0,
            sessions_before: 20_000,
            sessions_after: 19_000,
            sessions_cpu_s: 3.8,
            agents_cpu_s: 4.0,
            apiserver_requests: None,
        };
        // 3.8 s over 30 s is 12.7 % of a core for the 19,000 sessions held throughout.
        let share = idle.core_share_per_10k().unwrap();
        assert!(
            (share - 3.8 / 30.0 * 10_000.0 / 19_000.0).abs() < 1e-9,
            "{share}"
        );
        let none_held = IdleReport {
            sessions_after: 0,
            ..idle
        };
        assert_eq!(none_held.core_share_per_10k(), None);
    }

    #[test]
    fn percentiles_are_ordered_and_in_milliseconds() {
        let samples: Vec<u64> = (1..=1000).map(|i| i * 1000).collect();
        let p = Percentiles::from_micros(&samples);
        assert_eq!(p.count, 1000);
        assert!(p.ordered(), "{p:?}");
        assert!((p.p50_ms - 500.0).abs() < 5.0, "{p:?}");
        assert!((p.max_ms - 1000.0).abs() < 5.0, "{p:?}");
        assert_eq!(p.cdf.len(), 101);
        assert_eq!(Percentiles::from_micros(&[]), Percentiles::default());
    }

    fn load(requests: u64, window_s: f64) -> Option<ApiserverLoad> {
        Some(ApiserverLoad {
            requests,
            window_s,
            ..Default::default()
        })
    }

    #[test]
    fn the_baseline_compares_the_phases_both_sides_measured() {
        let mut b = BaselineReport {
            flotilla: BaselineSide {
                connect: None,
                fanout: load(1000, 5.0),
                idle: load(3, 30.0),
                storm: load(3, 12.0),
            },
            klusterlet: BaselineSide {
                connect: load(5000, 4.0),
                fanout: load(3000, 6.0),
                idle: load(600, 30.0),
                storm: load(4000, 9.0),
            },
            ..Default::default()
        };
        b.compare();
        let got: Vec<_> = b
            .rows
            .iter()
            .map(|r| (r.phase.as_str(), r.flotilla, r.klusterlet, r.ratio))
            .collect();
        assert_eq!(
            got,
            vec![
                ("connect", None, Some(5000.0), None),
                ("fanout", Some(1000.0), Some(3000.0), Some(3.0)),
                ("idle_per_minute", Some(6.0), Some(1200.0), Some(200.0)),
                ("storm", Some(3.0), Some(4000.0), Some(4000.0 / 3.0)),
                // Connect is left out: flotilla has no number for it.
                ("total", Some(1006.0), Some(7600.0), Some(7600.0 / 1006.0)),
            ]
        );
        // Nothing measured on flotilla's side: no ratios, and no total.
        b.flotilla = BaselineSide::default();
        b.compare();
        assert!(b.rows.iter().all(|r| r.ratio.is_none()));
        assert!(!b.rows.iter().any(|r| r.phase == "total"));
        let zero = row("idle_per_minute", Some(0.0), Some(10.0));
        assert_eq!(zero.ratio, None, "no ratio against zero");
    }
}
