//! The harness's command line: parsed and validated once, then passed down as typed structs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::chaos::schedule::FaultKind;

/// Default of `--agents` for `run`: a CI-sized fleet.
pub const DEFAULT_AGENTS: usize = 200;
/// Default of `--agents` for `demo`.
pub const DEFAULT_DEMO_AGENTS: usize = 1000;
/// Default of `--scenario`: every scenario, in this order.
pub const DEFAULT_SCENARIOS: &str = "connect,fanout,storm,outage";
/// Default of `--feedback-duration`: a minute of changes.
pub const DEFAULT_FEEDBACK_DURATION: &str = "60s";
/// Default of `--feedback-every`: every Deployment's status changes once a second.
pub const DEFAULT_FEEDBACK_EVERY: &str = "1s";

fn default_feedback_duration() -> Duration {
    Duration::from_secs(60)
}

/// Default of `--proxy-lists`.
pub const DEFAULT_PROXY_LISTS: u32 = 5;

fn default_proxy_lists() -> u32 {
    DEFAULT_PROXY_LISTS
}

fn default_chaos_duration() -> Duration {
    humantime::parse_duration(DEFAULT_CHAOS_DURATION).expect("a valid default")
}

fn default_chaos_faults() -> Vec<FaultKind> {
    FaultKind::ALL.to_vec()
}

fn default_feedback_every() -> Duration {
    Duration::from_secs(1)
}

fn default_feedback_interval() -> Duration {
    flotilla_agent::reconcile::DEFAULT_FEEDBACK_INTERVAL
}

/// Default of `--connect-rate`: new agents started per second during the ramp.
pub const DEFAULT_CONNECT_RATE: f64 = 500.0;
/// Default of `--timeout`: the longest any one scenario may run before it stops itself.
pub const DEFAULT_TIMEOUT: &str = "120s";
/// Default of `--source-addresses`: loopback source addresses the agents dial from.
pub const DEFAULT_SOURCE_ADDRESSES: u32 = 16;
/// Default of `--outage`: how long the hub stays down in the outage scenario.
pub const DEFAULT_OUTAGE: &str = "5s";
/// Default of `--max-backoff`: the agents' reconnect backoff ceiling.
pub const DEFAULT_MAX_BACKOFF: &str = "5s";
/// Default of `--poll-interval`: how often the hub's objects are listed while waiting.
pub const DEFAULT_POLL_INTERVAL: &str = "250ms";
/// Default of `--chaos-duration`: how long the chaos scenario injects faults.
pub const DEFAULT_CHAOS_DURATION: &str = "10m";
/// The chaos scenario's fleet when the flags leave it out: agents, gateways and worker
/// processes (the agents' groups for group faults; half of them on each carrier).
pub const CHAOS_AGENTS: usize = 1000;
pub const CHAOS_GATEWAYS: usize = 3;
pub const CHAOS_PROCESSES: usize = 4;
/// Default of `--cluster-prefix`.
pub const DEFAULT_CLUSTER_PREFIX: &str = "lt";
/// Default of `--hub-listen` and `--hub-api-listen`: any free loopback port.
pub const DEFAULT_HUB_LISTEN: &str = "127.0.0.1:0";
/// Default of `--seed`.
pub const DEFAULT_SEED: u64 = 1;
/// Default of `--store`: the embedded store, nothing to install.
pub const DEFAULT_STORE: HubStore = HubStore::Sled;
/// Default of `--baseline-window`: how long `baseline-klusterlet` watches each side idle.
pub const DEFAULT_BASELINE_WINDOW: &str = "30s";
/// Default of `--lease-interval`: OCM's default `ManagedCluster.spec.leaseDurationSeconds`, the
/// period at which its registration agent renews the cluster's Lease on the hub.
pub const DEFAULT_LEASE_INTERVAL: &str = "60s";
/// Default of `--rollout-max-concurrency`.
pub const DEFAULT_ROLLOUT_MAX_CONCURRENCY: &str = "10%";
/// Default of `--placements`: a CI-sized scheduler run.
pub const DEFAULT_PLACEMENTS: usize = 100;
/// Default of `--placement-clusters`.
pub const DEFAULT_PLACEMENT_CLUSTERS: usize = 10;
/// Default of `--regions`.
pub const DEFAULT_REGIONS: usize = 10;
/// Default of `--label-changes`.
pub const DEFAULT_LABEL_CHANGES: usize = 10;
/// Default of `--policies`: the governance scenario's 100 policies over the fleet.
pub const DEFAULT_POLICIES: usize = 100;
/// The most `--policies` accepted: a cluster's compliance record holds an entry per policy it
/// carries, and no more than this.
pub const MAX_GOVERNANCE_POLICIES: usize = flotilla_proto::api::policy::MAX_CLUSTER_POLICIES;
/// The most `--gateways` accepted.
pub const MAX_GATEWAYS: usize = 64;
/// Sessions one harness process may hold per file descriptor budget: each needs one socket,
/// plus headroom for the runtime, the cache and the hub's own sockets when in-process.
pub const FD_HEADROOM: u64 = 256;

#[derive(Debug, Parser)]
#[command(
    name = "flotilla-loadtest",
    version,
    about = "Runs thousands of real agent sessions against a flotilla hub and reports what it measured",
    long_about = "Runs thousands of agents (each the real agent library: its session loop over \
                  real TLS, its cache and reconciler, a simulated cluster behind it) against a flotilla hub it starts itself or an \
                  existing one on loopback, drives scenarios (connect, fanout, storm, outage, \
                  and with --store kube the klusterlet baseline), shows live progress, and \
                  writes a JSON report and SVG plots."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// The whole fabric on this machine in under two minutes: a hub with its gateway, 1,000
    /// agents, a ManifestWork fanned out to all, a gateway restart survived, results printed,
    /// report and plots written.
    Demo(DemoArgs),
    /// Runs scenarios, alone or as a sequence.
    Run(Box<RunArgs>),
    /// The placement scheduler's model alone, in this process (no hub, no store, no writes):
    /// the CPU and memory of deciding many placements over many clusters and of following
    /// label changes. The `schedule` scenario measures the same through a real hub.
    BenchScheduler(crate::bench::BenchArgs),
    /// Makes one emulated link (`--link PROFILE` or `--link-spec SPEC`, as `run` takes them)
    /// and measures it: round trips and their loss with a ping-like UDP probe, goodput with
    /// a bulk TCP transfer, the longest outage; prints each next to what was asked. Needs root.
    LinkCheck(crate::link::LinkCheckArgs),
    /// (internal) One worker process of `--processes`: runs a slice of the agents.
    #[command(hide = true)]
    Worker {
        /// The worker's specification, written by the coordinator.
        #[arg(long)]
        spec: PathBuf,
    },
    /// (internal) The bare carrier server of baseline-bare.
    #[command(hide = true)]
    BareServer(crate::bare::BareArgs),
    /// (internal) The hub as a child process of the harness: `flotilla_hub::run` with the
    /// hub's own flags.
    #[command(hide = true)]
    Hub(Box<flotilla_hub::config::HubConfig>),
    /// (internal) A gateway as a child process of the harness (`--gateways`):
    /// `flotilla_gateway::process::run` with `flotilla-gateway`'s own flags.
    #[command(hide = true)]
    Gateway(Box<flotilla_gateway::process::GatewayProcessConfig>),
}

/// The scenarios. Each one stops itself after `--timeout`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// Ramp the agents up at --connect-rate: time to all Available, handshakes/s, the hub's
    /// RSS per session and CPU.
    Connect,
    /// One ManifestWork to every agent: latency from create to each agent's durable ack and to
    /// Applied on the hub (p50/p90/p99/max).
    Fanout,
    /// Kill (or restart) the hub under all sessions: reconnect curve, time to 100% back, peak
    /// accept rate, lost or duplicated statuses.
    Storm,
    /// Hub down for --outage while agents keep their state: resume volume and convergence.
    Outage,
    /// (--store kube) The pattern flotilla replaces: one klusterlet-style client per cluster
    /// listing and watching a second, fresh apiserver itself, against the hub apiserver's load
    /// under flotilla's agents; requests per phase, watches and apiserver memory side by side.
    BaselineKlusterlet,
    /// A ManifestWorkReplicaSet rolled out Progressive (--rollout-max-concurrency,
    /// maxFailures 0) through a placement to every agent, with --rollout-failures simulated
    /// clusters refusing it: it must stop at the first one and name it, then a fixed revision
    /// must reach every cluster.
    Rollout,
    /// The placement scheduler at scale, no agents started: --placements placements over every
    /// enrolled cluster; time to decisions, label changes followed into the decisions they
    /// affect, the hub's memory.
    Schedule,
    /// The floor: the same agents against a bare carrier server (tonic with default settings,
    /// or quinn with default settings) with the same certificates and TLS, holding sessions and
    /// nothing else; its memory per session and setup rate beside flotilla's from `connect`
    /// in the same run, as ratios. Runs last: it stops the run's agents first.
    BaselineBare,
    /// Every cluster's Deployment changes its status every --feedback-every for
    /// --feedback-duration; its work reports the Deployment's well-known status as feedback:
    /// session bytes per cluster per second, statuses per cluster per second against the
    /// agents' bound, the hub's store writes per second, the latest value on the hub at the end.
    Feedback,
    /// (--store kube, --gateways) Faults at random from --chaos-seed for --chaos-duration
    /// (gateways, hub and groups of agents killed or paused, partitions, an apiserver restart)
    /// while a fan-out and a progressive rollout run; then invariants checked, each with its
    /// evidence: convergence, no status lost, no stale write accepted, no epoch backwards,
    /// every process stopping when asked. Unless given, it runs --store kube, --gateways 3,
    /// 1,000 agents in 4 processes, half on each carrier (--transport both).
    Chaos,
    /// kubectl-shaped requests through the hub's proxy front and the agents' tunnels beside
    /// the same requests sent directly: small-GET latency added (p50, p99), a large list's
    /// throughput ratio, and one request to every cluster at once.
    Proxy,
    /// (--link or --link-spec, --store kube) Each carrier and the klusterlet pattern over links
    /// of the same spec, side by side: time to all connected, a work to every cluster (create →
    /// ack and → Applied, p50/p99, and the status's way back), a 1 MiB and a 10 MiB work, bytes
    /// on the wire per cluster per hour idle (--baseline-window), each session through one
    /// outage of a flapping link, kubectl through the tunnel, and clusters wrongly marked
    /// Unknown. With --transport both one run measures both carriers.
    Links,
    /// Governance over every agent: --policies Policies (half a namespace that must exist,
    /// `inform`; half a ConfigMap that must exist, `enforce`) bound through one Placement, each
    /// evaluated by every simulated spoke: time from each policy's create to each cluster's
    /// compliance on the hub (p50/p90/p99/max) and to every root's aggregate, the hub's store
    /// writes per second, then every inform policy flipped to enforce: time to the new
    /// compliance and the writes it cost per cluster.
    Governance,
}

/// Where the hub under test keeps its objects (`--store`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HubStore {
    /// The embedded sled database in the hub's data dir.
    #[default]
    Sled,
    /// OCM's CRDs on a real kube-apiserver (with etcd) that the harness starts from the test
    /// environment and stops at the end; every scenario then reports the apiserver's load.
    Kube,
}

impl std::fmt::Display for HubStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HubStore::Sled => "sled",
            HubStore::Kube => "kube",
        })
    }
}

/// How the hub under test runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HubMode {
    /// A child process (the harness re-executed as `flotilla-loadtest hub`, or --hub-binary):
    /// needed to measure the hub's RSS and to kill it in `storm` and `outage`.
    Child,
    /// `flotilla_hub::run` inside the harness process: no kill, no separate RSS.
    InProcess,
}

/// How the agents get their identities.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Enrollment {
    /// The harness issues each certificate from the hub's CA and registers its key through
    /// the operator API before the ramp: the ramp then measures sessions alone.
    Issue,
    /// Real registration: each agent joins with one shared bootstrap token (auto-accept),
    /// making its key and sending a CSR as `flotilla-agent join` does, then connects; the
    /// connect scenario's figures include the join.
    Join,
}

/// The carrier the agents' sessions ride (`--transport`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AgentTransport {
    /// gRPC over HTTP/2 over TLS (TCP): one socket per agent.
    #[default]
    Grpc,
    /// QUIC (UDP): the swarm's agents share one UDP socket per source address.
    Quic,
    /// QUIC, falling back to gRPC per agent when UDP does not get through.
    Auto,
    /// Both carriers: the even worker processes gRPC, the odd ones QUIC (needs --processes 2
    /// or more).
    Both,
}

impl AgentTransport {
    /// The agent's own setting.
    pub fn agent(self) -> flotilla_agent::connect::Transport {
        match self {
            AgentTransport::Grpc => flotilla_agent::connect::Transport::Grpc,
            AgentTransport::Quic => flotilla_agent::connect::Transport::Quic,
            AgentTransport::Auto => flotilla_agent::connect::Transport::Auto,
            // Split per worker before it gets here; a swarm given it whole takes QUIC's
            // fallback.
            AgentTransport::Both => flotilla_agent::connect::Transport::Auto,
        }
    }

    /// The carrier of worker process `w`.
    pub fn of_worker(self, w: usize) -> AgentTransport {
        match self {
            AgentTransport::Both if w.is_multiple_of(2) => AgentTransport::Grpc,
            AgentTransport::Both => AgentTransport::Quic,
            other => other,
        }
    }
}

/// Signal sent to the hub in `storm`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StormSignal {
    /// SIGKILL: a crash; agents notice the reset and reconnect with backoff.
    Kill,
    /// SIGTERM: a graceful restart; the gateway says goodbye to every session first.
    Term,
}

#[derive(Clone, Debug, Args)]
pub struct DemoArgs {
    /// Agents to run.
    #[arg(long, default_value_t = DEFAULT_DEMO_AGENTS)]
    pub agents: usize,
    /// Where the report and plots go (default: a fresh folder ./loadtest-<time> it names).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Hide the live progress display.
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Clone, Debug, Args, Serialize, Deserialize)]
pub struct RunArgs {
    /// Scenarios to run, in order (comma-separated).
    #[arg(long = "scenario", value_enum, value_delimiter = ',', default_value = DEFAULT_SCENARIOS)]
    pub scenarios: Vec<Scenario>,

    /// Where the hub keeps its objects: sled (embedded), or kube (OCM's CRDs on a real
    /// kube-apiserver that the harness starts and stops; reports add the apiserver's load).
    #[arg(long, value_enum, default_value_t = DEFAULT_STORE)]
    #[serde(default)]
    pub store: HubStore,

    /// How long baseline-klusterlet watches each side with every agent (client) up and
    /// nothing happening; it is measured twice, once per side.
    #[arg(long, default_value = DEFAULT_BASELINE_WINDOW, value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde_compat", default = "default_baseline_window")]
    pub baseline_window: Duration,

    /// How often each klusterlet client of baseline-klusterlet renews its cluster's Lease
    /// (whole seconds; OCM's default is 60s).
    #[arg(long, default_value = DEFAULT_LEASE_INTERVAL, value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde_compat", default = "default_lease_interval")]
    pub lease_interval: Duration,

    /// Number of agents (clusters) to simulate.
    #[arg(long, default_value_t = DEFAULT_AGENTS)]
    pub agents: usize,

    /// Spread the agents over this many worker processes (the harness re-executes itself).
    /// One process holds fewer sessions than its open-file limit, so large fleets need several.
    #[arg(long, default_value_t = 1)]
    pub processes: usize,

    /// How the harness runs the hub it starts (ignored with --hub).
    #[arg(long, value_enum, default_value_t = HubMode::Child)]
    pub hub_mode: HubMode,

    /// Use this flotilla-hub binary for the child hub instead of re-executing the harness.
    #[arg(long)]
    pub hub_binary: Option<PathBuf>,

    /// Scale-out mode (needs --store kube): the hub runs with `--gateways external` and the
    /// harness starts this many gateway processes on loopback, each with a certificate from
    /// the hub CA; agent i dials gateway i mod N, as a load balancer would spread them, and
    /// follows its redirect to the gateway owning its shard. `storm` and `outage` then stop
    /// every gateway at once (the hub stays up). Default: none, the hub's in-process gateway.
    #[arg(long)]
    #[serde(default)]
    pub gateways: Option<usize>,

    /// Use this flotilla-gateway binary for the gateways instead of re-executing the harness.
    #[arg(long)]
    #[serde(default)]
    pub gateway_binary: Option<PathBuf>,

    /// With --gateways: run this many of the gateways (the first ones) each in a network
    /// namespace the harness creates (`ip netns`, a veth pair with a private /30; needs root),
    /// listening on its own address as a separate host would. The agents reach them from the
    /// host end of the veth; they reach the hub apiserver through a relay there. The
    /// namespaces are deleted when the run ends. gRPC only.
    #[arg(long, default_value_t = 0)]
    #[serde(default)]
    pub gateway_netns: usize,

    #[command(flatten)]
    #[serde(default)]
    pub link: crate::link::LinkArgs,

    /// An extra flag for every gateway, e.g. `--gateway-arg=--drain-window=2s`; repeat for
    /// more (the harness sets --name, --listen, --kubeconfig, --cert-dir and --metrics-addr
    /// itself). The shard flags (--shards, --lease-duration, --renew-period, --lease-namespace)
    /// go to the hub too, since hub and gateways must agree on them.
    #[arg(long = "gateway-arg", allow_hyphen_values = true)]
    #[serde(default)]
    pub gateway_args: Vec<String>,

    /// The carrier of the agents' sessions: grpc (TCP), quic (UDP), or auto (QUIC with a
    /// fallback to gRPC).
    #[arg(long, value_enum, default_value_t = AgentTransport::Grpc)]
    #[serde(default)]
    pub transport: AgentTransport,

    /// An extra flag for the child hub, e.g. `--hub-arg=--drain-window=2s`; repeat for more.
    #[arg(long = "hub-arg", allow_hyphen_values = true)]
    #[serde(default)]
    pub hub_args: Vec<String>,

    /// The child hub's scheduling priority, as nice(1) takes it: -20 (most favoured) to 19;
    /// below 0 needs root. The simulated agents share the hub's cores here, where in a fleet
    /// each spoke has its own: with thousands of them evaluating at once their threads take
    /// most of the CPU from the hub. `--hub-nice=-10` gives each of the hub's threads about
    /// nine times the weight of an agent's, so the hub runs as if on cores of its own as far
    /// as it needs them. 0 (the default) starts it as any other process.
    #[arg(long, default_value_t = 0, allow_hyphen_values = true,
          value_parser = clap::value_parser!(i32).range(-20..=19))]
    #[serde(default)]
    pub hub_nice: i32,

    /// Agent address of the hub the harness starts (loopback; port 0 picks a free port).
    #[arg(long, default_value = DEFAULT_HUB_LISTEN)]
    pub hub_listen: SocketAddr,

    /// Operator API address of the hub the harness starts (loopback; port 0: a free port).
    #[arg(long, default_value = DEFAULT_HUB_LISTEN)]
    pub hub_api_listen: SocketAddr,

    /// Target an existing hub's agent address (loopback only) instead of starting one; needs
    /// --data-dir. Scenarios that stop the hub (storm, outage) cannot run against it.
    #[arg(long, requires = "data_dir")]
    pub hub: Option<SocketAddr>,

    /// The existing hub's data directory: its CA (ca/) signs the agents' certificates and its
    /// operator credentials (operator/config.yaml) register them.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,

    /// How the agents get their identities before connecting.
    #[arg(long, value_enum, default_value_t = Enrollment::Issue)]
    pub enroll: Enrollment,

    /// New agents started per second during the ramp.
    #[arg(long, default_value_t = DEFAULT_CONNECT_RATE)]
    pub connect_rate: f64,

    /// connect: once every agent is up (and on its shard's owner), hold the sessions idle this
    /// long and report what that cost: CPU of the session side and of the agents, apiserver
    /// requests. 0 skips it.
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde_compat", default)]
    pub hold: Duration,

    /// Longest time any one scenario may take; it then stops and reports what it saw.
    #[arg(long, default_value = DEFAULT_TIMEOUT, value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde_compat")]
    pub timeout: Duration,

    /// Loopback source addresses (127.0.0.1, 127.0.0.2, ...) the agents dial from, so the
    /// number of sessions is not bounded by one address's ephemeral ports.
    #[arg(long, default_value_t = DEFAULT_SOURCE_ADDRESSES)]
    pub source_addresses: u32,

    /// Signal the storm scenario sends to the hub.
    #[arg(long, value_enum, default_value_t = StormSignal::Kill)]
    pub storm_signal: StormSignal,

    /// How long the feedback scenario changes the Deployments' statuses.
    #[arg(long, default_value = DEFAULT_FEEDBACK_DURATION, value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde_compat", default = "default_feedback_duration")]
    pub feedback_duration: Duration,

    /// How often each Deployment's status changes in the feedback scenario.
    #[arg(long, default_value = DEFAULT_FEEDBACK_EVERY, value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde_compat", default = "default_feedback_every")]
    pub feedback_every: Duration,

    /// The agents' --feedback-interval: the shortest time between two statuses of one work
    /// that changes on its cluster cause.
    #[arg(long, default_value = flotilla_agent::config::DEFAULT_FEEDBACK_INTERVAL, value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde_compat", default = "default_feedback_interval")]
    pub feedback_interval: Duration,

    /// Large lists the proxy scenario sends each way (directly and through the tunnel,
    /// interleaved); the report gives their medians. More lists steady the ratio on a noisy
    /// machine.
    #[arg(long, default_value_t = DEFAULT_PROXY_LISTS, value_parser = clap::value_parser!(u32).range(1..=1000))]
    #[serde(default = "default_proxy_lists")]
    pub proxy_lists: u32,

    /// How long the hub stays down in the outage scenario.
    #[arg(long, default_value = DEFAULT_OUTAGE, value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde_compat")]
    pub outage: Duration,

    /// The agents' reconnect backoff ceiling (exponential backoff with full jitter).
    #[arg(long, default_value = DEFAULT_MAX_BACKOFF, value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde_compat")]
    pub max_backoff: Duration,

    /// The QUIC congestion controller of the agents, the hub and the gateways (their
    /// --quic-congestion, unless --hub-arg or --gateway-arg gives it): bbr, cubic or new-reno.
    #[arg(long, default_value = "bbr", value_parser = flotilla_gateway::quic_congestion)]
    #[serde(with = "congestion_name", default)]
    pub quic_congestion: flotilla_transport::quic::QuicCongestion,

    /// Time each apply to a simulated cluster takes.
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde_compat")]
    pub apply_delay: Duration,

    /// Fraction (0..1) of applies to simulated clusters that fail as if the spoke apiserver
    /// were unreachable (retried by the agent).
    #[arg(long, default_value_t = 0.0)]
    pub apply_failure_rate: f64,

    /// How often the hub's objects are listed while waiting (the resolution of hub-side
    /// latencies such as Applied).
    #[arg(long, default_value = DEFAULT_POLL_INTERVAL, value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde_compat")]
    pub poll_interval: Duration,

    /// Prefix of the simulated clusters' names (<prefix>-00042).
    #[arg(long, default_value = DEFAULT_CLUSTER_PREFIX)]
    pub cluster_prefix: String,

    /// Seed of every random choice (jitter, injected failures), for reproducible runs.
    #[arg(long, default_value_t = DEFAULT_SEED)]
    pub seed: u64,

    /// Where the report and plots go (default: a fresh folder ./loadtest-<time> it names).
    #[arg(long)]
    pub out: Option<PathBuf>,

    /// Hide the live progress display.
    #[arg(long)]
    pub quiet: bool,

    /// The harness binary re-executed as the child hub and as workers (default: this
    /// executable; tests point it at the built binary).
    #[arg(long, hide = true, env = "FLOTILLA_LOADTEST_EXE")]
    pub harness_exe: Option<PathBuf>,

    /// Keep the hub's and workers' logs and data in <out>/run-* even when every scenario
    /// completed (they are always kept when one did not).
    #[arg(long)]
    pub keep_logs: bool,

    /// rollout: clusters in flight at once, a count or a percentage of the agents.
    #[arg(long, default_value = DEFAULT_ROLLOUT_MAX_CONCURRENCY)]
    #[serde(default = "default_rollout_max_concurrency")]
    pub rollout_max_concurrency: String,

    /// rollout: simulated clusters that refuse the first revision (spread evenly, the first at
    /// the middle of the fleet by name).
    #[arg(long, default_value_t = 1)]
    #[serde(default)]
    pub rollout_failures: usize,

    /// chaos: the seed of the fault schedule, printed at the start; the same seed (with the
    /// same --chaos-duration, --chaos-faults, --gateways and --processes) replays the same
    /// faults. Default: a random seed.
    #[arg(long)]
    #[serde(default)]
    pub chaos_seed: Option<u64>,

    /// chaos: how long faults are injected; every fault is undone within it.
    #[arg(long, default_value = DEFAULT_CHAOS_DURATION, value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde_compat", default = "default_chaos_duration")]
    pub chaos_duration: Duration,

    /// chaos: the kinds of fault to draw from (comma-separated; default all).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "gateway-kill,gateway-stop,hub-kill,hub-stop,agents-kill,agents-stop,gateway-apiserver-partition,agents-gateway-partition,apiserver-restart"
    )]
    #[serde(default = "default_chaos_faults")]
    pub chaos_faults: Vec<FaultKind>,

    /// schedule: placements to create.
    #[arg(long, default_value_t = DEFAULT_PLACEMENTS)]
    #[serde(default)]
    pub placements: usize,

    /// schedule: each placement's numberOfClusters.
    #[arg(long, default_value_t = DEFAULT_PLACEMENT_CLUSTERS)]
    #[serde(default)]
    pub placement_clusters: usize,

    /// schedule: regions the clusters are labelled into; each placement selects one.
    #[arg(long, default_value_t = DEFAULT_REGIONS)]
    #[serde(default)]
    pub regions: usize,

    /// schedule: clusters relabelled into another region, one after the other, each followed
    /// into every decision it affects.
    #[arg(long, default_value_t = DEFAULT_LABEL_CHANGES)]
    #[serde(default)]
    pub label_changes: usize,

    /// governance: Policies to create, each bound to every cluster; the even-numbered ones
    /// inform, the odd-numbered ones enforce.
    #[arg(long, default_value_t = DEFAULT_POLICIES)]
    #[serde(default = "default_policies")]
    pub policies: usize,
}

fn default_policies() -> usize {
    DEFAULT_POLICIES
}

impl RunArgs {
    /// What `demo` runs: the whole fabric with a graceful gateway restart.
    pub fn demo(demo: &DemoArgs) -> RunArgs {
        let mut args = RunArgs::parse_defaults();
        args.agents = demo.agents;
        args.scenarios = vec![Scenario::Connect, Scenario::Fanout, Scenario::Storm];
        args.storm_signal = StormSignal::Term;
        args.out = demo.out.clone();
        args.quiet = demo.quiet;
        args
    }

    /// The defaults, as `run` with no flags has them.
    pub fn parse_defaults() -> RunArgs {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            args: RunArgs,
        }
        Only::parse_from(["run"]).args
    }

    /// The chaos scenario's fleet where the command line left it out: `given(flag id)` says
    /// whether a flag was on it. Runs before [`RunArgs::validate`].
    pub fn apply_chaos_defaults(&mut self, given: impl Fn(&str) -> bool) {
        if !self.scenarios.contains(&Scenario::Chaos) {
            return;
        }
        if !given("store") {
            self.store = HubStore::Kube;
        }
        if !given("gateways") {
            self.gateways = Some(CHAOS_GATEWAYS);
        }
        if !given("agents") {
            self.agents = CHAOS_AGENTS;
        }
        if !given("processes") {
            self.processes = CHAOS_PROCESSES.min(self.agents);
        }
        if !given("transport") && self.processes >= 2 {
            self.transport = AgentTransport::Both;
        }
    }

    /// Checks what clap cannot; every message names the flag and the fix.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.agents >= 1, "--agents must be at least 1");
        anyhow::ensure!(
            self.transport != AgentTransport::Both || self.processes >= 2,
            "--transport both puts the even worker processes on gRPC and the odd ones on QUIC, which needs --processes 2 or more"
        );
        anyhow::ensure!(
            self.transport != AgentTransport::Both
                || !self.scenarios.contains(&Scenario::BaselineBare),
            "scenario baseline-bare compares one carrier with its bare server; use --transport grpc or quic with it"
        );
        if self.scenarios.contains(&Scenario::Chaos) {
            anyhow::ensure!(
                self.store == HubStore::Kube && self.gateways.is_some(),
                "scenario chaos needs --store kube and --gateways N (leave both out for its defaults: kube, 3 gateways)"
            );
            anyhow::ensure!(
                self.scenarios.last() == Some(&Scenario::Chaos),
                "scenario chaos stops every process at its end (that is one of its checks), so it must come last in --scenario"
            );
            anyhow::ensure!(
                self.gateway_netns == 0,
                "scenario chaos partitions gateways with firewall rules on loopback, not with --gateway-netns; leave it out"
            );
            anyhow::ensure!(
                !self.chaos_duration.is_zero() && !self.chaos_faults.is_empty(),
                "--chaos-duration must be positive and --chaos-faults must name at least one kind"
            );
        }
        if self.scenarios.contains(&Scenario::Links) {
            anyhow::ensure!(
                self.link.spec()?.is_some() && self.store == HubStore::Kube,
                "scenario links measures over an emulated link on the kube backend: give --link PROFILE (or --link-spec) and --store kube"
            );
        }
        if self.link.spec()?.is_some() {
            anyhow::ensure!(
                self.gateway_netns == 0,
                "--link puts the agents behind an emulated link to this machine's loopback, where the gateways must listen: leave out --gateway-netns"
            );
            for s in [Scenario::BaselineKlusterlet, Scenario::Chaos] {
                anyhow::ensure!(
                    !self.scenarios.contains(&s),
                    "scenario {s:?} does not run behind --link yet (its clients or faults are on loopback); run it without --link"
                );
            }
        }
        anyhow::ensure!(
            self.hold <= Duration::from_secs(3600),
            "--hold {} is above an hour; hold the sessions for at most 1h",
            humantime::format_duration(self.hold)
        );
        anyhow::ensure!(
            self.agents <= 99_999,
            "--agents {} is above 99,999, the most cluster names <prefix>-NNNNN can tell apart",
            self.agents
        );
        anyhow::ensure!(
            (1..=64).contains(&self.processes),
            "--processes {} is out of range; use 1 to 64",
            self.processes
        );
        anyhow::ensure!(
            self.processes <= self.agents,
            "--processes {} is more than --agents {}",
            self.processes,
            self.agents
        );
        anyhow::ensure!(
            self.connect_rate > 0.0 && self.connect_rate.is_finite(),
            "--connect-rate must be a positive number of agents per second"
        );
        anyhow::ensure!(
            (1..=65_000).contains(&self.source_addresses),
            "--source-addresses {} is out of range; use 1 to 65000 (127.0.0.1 upwards)",
            self.source_addresses
        );
        anyhow::ensure!(
            (0.0..1.0).contains(&self.apply_failure_rate),
            "--apply-failure-rate {} must be at least 0 and below 1",
            self.apply_failure_rate
        );
        anyhow::ensure!(
            !self.timeout.is_zero(),
            "--timeout must be positive, e.g. 120s"
        );
        anyhow::ensure!(
            !self.poll_interval.is_zero(),
            "--poll-interval must be positive, e.g. 250ms"
        );
        anyhow::ensure!(
            flotilla_proto::contract::is_dns1123_label(&format!("{}-00000", self.cluster_prefix)),
            "--cluster-prefix {:?} does not make valid cluster names: use lower-case letters, digits and '-'",
            self.cluster_prefix
        );
        for s in &self.scenarios {
            anyhow::ensure!(
                self.hub.is_none()
                    || !matches!(
                        s,
                        Scenario::Rollout | Scenario::Schedule | Scenario::Governance
                    ),
                "scenario {s:?} places on every cluster of the hub, so it runs only on a hub the harness starts; leave out --hub"
            );
        }
        if self.scenarios.contains(&Scenario::Rollout) {
            let c = &self.rollout_max_concurrency;
            let ok = match c.strip_suffix('%') {
                Some(p) => p.parse::<f64>().is_ok_and(|p| p > 0.0 && p <= 100.0),
                None => c.parse::<usize>().is_ok_and(|n| n > 0),
            };
            anyhow::ensure!(
                ok,
                "--rollout-max-concurrency {c:?} must be a positive count or a percentage such as 10%"
            );
            anyhow::ensure!(
                self.rollout_failures < self.agents,
                "--rollout-failures {} must be below --agents {}",
                self.rollout_failures,
                self.agents
            );
        }
        if self.scenarios.contains(&Scenario::Governance) {
            anyhow::ensure!(
                (2..=MAX_GOVERNANCE_POLICIES).contains(&self.policies),
                "--policies {} is out of range: use 2 to {MAX_GOVERNANCE_POLICIES} (half inform, half enforce; each cluster's compliance record holds at most that many)",
                self.policies
            );
        }
        if self.scenarios.contains(&Scenario::Schedule) {
            anyhow::ensure!(
                self.placements >= 1 && self.placement_clusters >= 1 && self.regions >= 1,
                "--placements, --placement-clusters and --regions must be at least 1"
            );
        }
        if let Some(hub) = self.hub {
            anyhow::ensure!(
                hub.ip().is_loopback(),
                "--hub {hub} is not a loopback address: the harness only sends traffic to this machine (127.0.0.0/8 or ::1)"
            );
            for s in &self.scenarios {
                anyhow::ensure!(
                    !matches!(s, Scenario::Storm | Scenario::Outage),
                    "scenario {s:?} stops the hub, which the harness cannot do to an existing hub (--hub); leave --hub out to let it start one"
                );
            }
        } else if self.data_dir.is_some() {
            anyhow::bail!(
                "--data-dir goes with --hub (an existing hub); leave both out to let the harness start a hub"
            );
        }
        for (flag, addr) in [
            ("--hub-listen", self.hub_listen),
            ("--hub-api-listen", self.hub_api_listen),
        ] {
            anyhow::ensure!(
                addr.ip().is_loopback(),
                "{flag} {addr} is not a loopback address: the harness keeps all traffic on this machine"
            );
        }
        if self.store == HubStore::Kube {
            anyhow::ensure!(
                self.hub.is_none(),
                "--store kube starts a kube-apiserver for the hub the harness starts, so it cannot go with --hub (an existing hub keeps its own store); leave out --hub or --store"
            );
        }
        if self.scenarios.contains(&Scenario::BaselineKlusterlet) {
            anyhow::ensure!(
                self.store == HubStore::Kube,
                "scenario baseline-klusterlet compares the load on a real kube-apiserver, which needs --store kube (the harness then starts kube-apiserver and etcd itself); add --store kube"
            );
            anyhow::ensure!(
                !self.baseline_window.is_zero(),
                "--baseline-window must be positive, e.g. 30s"
            );
            anyhow::ensure!(
                self.baseline_window * 2 < self.timeout,
                "--baseline-window {} is waited out twice in baseline-klusterlet (once per side), so it must be under half of --timeout {}; raise --timeout or shorten --baseline-window",
                humantime::format_duration(self.baseline_window),
                humantime::format_duration(self.timeout)
            );
            anyhow::ensure!(
                self.lease_interval >= Duration::from_secs(1)
                    && self.lease_interval.subsec_nanos() == 0
                    && self.lease_interval.as_secs() <= i32::MAX as u64,
                "--lease-interval {} must be a whole number of seconds, at least 1s (a Lease counts in seconds); OCM's default is 60s",
                humantime::format_duration(self.lease_interval)
            );
        }
        if let Some(n) = self.gateways {
            anyhow::ensure!(
                (1..=MAX_GATEWAYS).contains(&n),
                "--gateways {n} is out of range; use 1 to {MAX_GATEWAYS}"
            );
            anyhow::ensure!(
                self.store == HubStore::Kube,
                "--gateways runs gateway processes that share the hub's kube-apiserver, which needs --store kube; add --store kube"
            );
            anyhow::ensure!(
                self.hub.is_none() && self.hub_mode == HubMode::Child,
                "--gateways needs a hub the harness starts as a child process: leave out --hub and --hub-mode in-process"
            );
            for s in &self.scenarios {
                anyhow::ensure!(
                    !matches!(s, Scenario::BaselineBare | Scenario::Proxy),
                    "scenario {s:?} does not run with --gateways yet (it talks to the hub's own gateway); run it without --gateways"
                );
            }
            self.gateway_process_config("lt-gw-0")?;
            anyhow::ensure!(
                self.gateway_netns <= n,
                "--gateway-netns {} is more than --gateways {n}",
                self.gateway_netns
            );
            anyhow::ensure!(
                self.gateway_netns == 0 || self.transport == AgentTransport::Grpc,
                "--gateway-netns works with --transport grpc only (the agents' shared QUIC sockets are bound to loopback, which cannot reach a namespace); add --transport grpc"
            );
        } else {
            anyhow::ensure!(
                self.gateway_args.is_empty()
                    && self.gateway_binary.is_none()
                    && self.gateway_netns == 0,
                "--gateway-arg, --gateway-binary and --gateway-netns go with --gateways N; add --gateways or leave them out"
            );
        }
        if self.hub_mode == HubMode::InProcess && self.hub.is_none() {
            for s in &self.scenarios {
                anyhow::ensure!(
                    !matches!(s, Scenario::Storm | Scenario::Outage),
                    "scenario {s:?} kills the hub, which needs --hub-mode child"
                );
            }
        }
        Ok(())
    }

    /// The configuration of gateway `name` as `--gateway-arg` makes it (the harness adds the
    /// addresses and certificates it gives each gateway when it starts them).
    pub fn gateway_process_config(
        &self,
        name: &str,
    ) -> anyhow::Result<flotilla_gateway::process::GatewayProcessConfig> {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            config: flotilla_gateway::process::GatewayProcessConfig,
        }
        // The harness sets these itself when it starts each gateway.
        let argv = [
            "gateway",
            "--name",
            name,
            "--cert-dir",
            "unused",
            "--listen",
            "127.0.0.1:9443",
        ]
        .into_iter()
        .map(str::to_string)
        .chain(self.gateway_args.iter().cloned());
        let config = Only::try_parse_from(argv)
            .map_err(|e| anyhow::anyhow!("--gateway-arg: {e}"))?
            .config;
        config
            .validate()
            .map_err(|e| anyhow::anyhow!("--gateway-arg: {e:#}"))?;
        Ok(config)
    }

    /// The binary to re-execute for the child hub and the workers.
    pub fn harness_exe(&self) -> anyhow::Result<PathBuf> {
        match &self.harness_exe {
            Some(p) => Ok(p.clone()),
            None => Ok(std::env::current_exe()?),
        }
    }

    /// Cluster name of agent `i`.
    pub fn cluster_name(&self, i: usize) -> String {
        cluster_name(&self.cluster_prefix, i)
    }
}

/// Cluster name of agent `i` with `prefix`.
pub fn cluster_name(prefix: &str, i: usize) -> String {
    format!("{prefix}-{i:05}")
}

fn default_rollout_max_concurrency() -> String {
    DEFAULT_ROLLOUT_MAX_CONCURRENCY.to_string()
}

fn default_baseline_window() -> Duration {
    humantime::parse_duration(DEFAULT_BASELINE_WINDOW).expect("a valid default")
}

fn default_lease_interval() -> Duration {
    humantime::parse_duration(DEFAULT_LEASE_INTERVAL).expect("a valid default")
}

/// Durations in the report and worker specs as humantime strings ("1m 30s").
mod humantime_serde_compat {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(extra: &[&str], expected: Result<(), &str>) {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            args: RunArgs,
        }
        let mut argv = vec!["run"];
        argv.extend_from_slice(extra);
        let got = Only::try_parse_from(argv)
            .map_err(|e| e.to_string())
            .and_then(|o| o.args.validate().map_err(|e| e.to_string()));
        match (got, expected) {
            (Ok(()), Ok(())) => {}
            (Err(got), Err(want)) => assert!(got.contains(want), "{extra:?}: {got}"),
            (got, want) => panic!("{extra:?}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn defaults_are_valid() {
        let d = RunArgs::parse_defaults();
        assert_eq!(d.agents, DEFAULT_AGENTS);
        assert_eq!(d.scenarios.len(), 4);
        check(&[], Ok(()));
    }

    #[test]
    fn a_link_goes_with_gateways_on_loopback_and_not_with_unshaped_scenarios() {
        check(&["--link", "congested", "--processes", "2"], Ok(()));
        check(&["--link-spec", "lte,loss=2%"], Ok(()));
        check(
            &["--link", "lte", "--store", "kube", "--gateways", "2"],
            Ok(()),
        );
        check(
            &[
                "--link",
                "lte",
                "--store",
                "kube",
                "--gateways",
                "2",
                "--gateway-netns",
                "2",
            ],
            Err("leave out --gateway-netns"),
        );
        check(
            &[
                "--link",
                "lte",
                "--store",
                "kube",
                "--scenario",
                "connect,baseline-klusterlet",
            ],
            Err("does not run behind --link yet"),
        );
        check(&["--link", "dialup"], Err("dialup"));
        check(&["--link-spec", "loss=3"], Err("`loss=3`"));
    }

    #[test]
    fn bad_input_names_the_flag() {
        check(
            &[
                "--hub",
                "10.0.0.1:9443",
                "--data-dir",
                "x",
                "--scenario",
                "connect",
            ],
            Err("not a loopback address"),
        );
        check(
            &["--hub", "127.0.0.1:9443", "--data-dir", "x"],
            Err("stops the hub"),
        );
        check(
            &[
                "--hub",
                "127.0.0.1:9443",
                "--data-dir",
                "x",
                "--scenario",
                "connect,fanout",
            ],
            Ok(()),
        );
        check(&["--data-dir", "x"], Err("--data-dir goes with --hub"));
        check(&["--agents", "0"], Err("--agents"));
        check(&["--processes", "3", "--agents", "2"], Err("--processes 3"));
        check(&["--hub-mode", "in-process"], Err("needs --hub-mode child"));
        check(
            &["--hub-mode", "in-process", "--scenario", "connect,fanout"],
            Ok(()),
        );
        check(
            &["--apply-failure-rate", "1.5"],
            Err("--apply-failure-rate"),
        );
        check(&["--cluster-prefix", "Bad_"], Err("--cluster-prefix"));
        check(&["--scenario", "proxy"], Ok(()));
    }

    #[test]
    fn the_klusterlet_baseline_needs_the_kube_store() {
        check(
            &["--scenario", "connect,baseline-klusterlet"],
            Err(
                "baseline-klusterlet compares the load on a real kube-apiserver, which needs --store kube",
            ),
        );
        check(
            &[
                "--scenario",
                "baseline-klusterlet",
                "--store",
                "kube",
                "--baseline-window",
                "5s",
                "--lease-interval",
                "2s",
            ],
            Ok(()),
        );
        check(
            &[
                "--scenario",
                "baseline-klusterlet",
                "--store",
                "kube",
                "--timeout",
                "60s",
            ],
            Err("--baseline-window 30s is waited out twice"),
        );
        check(
            &[
                "--scenario",
                "baseline-klusterlet",
                "--store",
                "kube",
                "--lease-interval",
                "1500ms",
            ],
            Err("--lease-interval 1s 500ms must be a whole number of seconds"),
        );
        check(
            &[
                "--store",
                "kube",
                "--hub",
                "127.0.0.1:9443",
                "--data-dir",
                "x",
                "--scenario",
                "connect",
            ],
            Err("cannot go with --hub"),
        );
        check(&["--store", "kube"], Ok(()));
        assert_eq!(RunArgs::parse_defaults().store, HubStore::Sled);
    }

    #[test]
    fn gateways_need_the_kube_store_and_a_child_hub() {
        check(&["--gateways", "3"], Err("needs --store kube"));
        check(
            &["--gateways", "0", "--store", "kube"],
            Err("--gateways 0 is out of range"),
        );
        check(
            &[
                "--gateways",
                "3",
                "--store",
                "kube",
                "--hub-mode",
                "in-process",
                "--scenario",
                "connect",
            ],
            Err("needs a hub the harness starts as a child process"),
        );
        check(&["--gateway-arg=--shards=16"], Err("go with --gateways N"));
        check(
            &[
                "--gateways",
                "3",
                "--store",
                "kube",
                "--gateway-arg=--nonsense",
            ],
            Err("--gateway-arg"),
        );
        check(
            &[
                "--gateways",
                "3",
                "--store",
                "kube",
                "--gateway-arg=--lease-duration=3s",
                "--gateway-arg=--renew-period=2s",
            ],
            Err("--renew-period"),
        );
        check(
            &[
                "--gateways",
                "3",
                "--store",
                "kube",
                "--gateway-arg=--shards=16",
                "--gateway-arg=--lease-duration=3s",
                "--gateway-arg=--renew-period=1s",
            ],
            Ok(()),
        );
    }

    #[test]
    fn chaos_checks_its_flags_and_fills_in_its_fleet() {
        check(
            &["--scenario", "chaos"],
            Err("scenario chaos needs --store kube and --gateways N"),
        );
        check(
            &[
                "--scenario",
                "chaos,connect",
                "--store",
                "kube",
                "--gateways",
                "3",
            ],
            Err("must come last"),
        );
        check(&["--transport", "both"], Err("--transport both"));
        check(
            &[
                "--scenario",
                "chaos",
                "--store",
                "kube",
                "--gateways",
                "3",
                "--chaos-faults",
                "gateway-stop,apiserver-restart",
                "--processes",
                "2",
                "--transport",
                "both",
            ],
            Ok(()),
        );
        // Left out, the chaos scenario picks its fleet; given, the flags win.
        let mut args = RunArgs::parse_defaults();
        args.scenarios = vec![Scenario::Chaos];
        args.agents = 300;
        args.apply_chaos_defaults(|id| id == "agents");
        assert_eq!(
            (
                args.store,
                args.gateways,
                args.agents,
                args.processes,
                args.transport
            ),
            (HubStore::Kube, Some(3), 300, 4, AgentTransport::Both)
        );
        args.validate().unwrap();
        let mut other = RunArgs::parse_defaults();
        other.apply_chaos_defaults(|_| false);
        assert_eq!(
            other.store,
            HubStore::Sled,
            "only the chaos scenario changes them"
        );
    }

    #[test]
    fn placement_scenarios_check_their_flags() {
        check(
            &["--scenario", "rollout", "--rollout-max-concurrency", "ten"],
            Err("--rollout-max-concurrency \"ten\" must be a positive count or a percentage"),
        );
        check(
            &[
                "--scenario",
                "rollout",
                "--agents",
                "10",
                "--rollout-failures",
                "10",
            ],
            Err("--rollout-failures 10 must be below --agents 10"),
        );
        check(
            &[
                "--hub",
                "127.0.0.1:9443",
                "--data-dir",
                "x",
                "--scenario",
                "schedule",
            ],
            Err("runs only on a hub the harness starts"),
        );
        check(
            &["--scenario", "schedule", "--placements", "0"],
            Err("--placements"),
        );
        check(&["--scenario", "connect,rollout,schedule"], Ok(()));
    }

    #[test]
    fn the_governance_scenario_checks_its_policies() {
        check(
            &["--scenario", "governance", "--policies", "1"],
            Err("--policies 1 is out of range: use 2 to 1000"),
        );
        check(
            &["--scenario", "governance", "--policies", "1001"],
            Err("--policies 1001 is out of range"),
        );
        check(
            &[
                "--hub",
                "127.0.0.1:9443",
                "--data-dir",
                "x",
                "--scenario",
                "governance",
            ],
            Err("runs only on a hub the harness starts"),
        );
        check(&["--scenario", "governance", "--policies", "2"], Ok(()));
        assert_eq!(RunArgs::parse_defaults().policies, DEFAULT_POLICIES);
    }
}

/// A QUIC congestion controller in the run's saved arguments, by name.
mod congestion_name {
    use flotilla_transport::quic::QuicCongestion;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(c: &QuicCongestion, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(c.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<QuicCongestion, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}
