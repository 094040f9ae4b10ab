//! `flotilla-hub`'s configuration: parsed and validated once at start, then passed down.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

/// Where agents connect by default.
pub const DEFAULT_AGENT_LISTEN: &str = "127.0.0.1:9443";
/// Where the operator API listens by default.
pub const DEFAULT_API_LISTEN: &str = "127.0.0.1:9444";
/// How often agents send a heartbeat.
pub const DEFAULT_HEARTBEAT_INTERVAL: &str = "10s";
/// Silence after which a session is considered dead, on both ends.
pub const DEFAULT_HEARTBEAT_TIMEOUT: &str = "30s";
/// Time without a session after which a cluster turns Unknown and gets the unreachable taint.
pub const DEFAULT_GRACE_PERIOD: &str = "40s";
/// Default of `--renewal-requesters`: the ServiceAccount `deploy/gateway` runs the gateways as.
pub const DEFAULT_RENEWAL_REQUESTER: &str =
    "system:serviceaccount:flotilla-system:flotilla-gateway";
/// Lifetime of the client certificates the hub signs for agents (renewed over the session
/// after two thirds of it).
pub const DEFAULT_CLIENT_CERT_LIFETIME: &str = "720h";
/// On SIGTERM: the window over which drained agents are told to come back, so that they do not
/// all return in the same second.
pub const DEFAULT_DRAIN_WINDOW: &str = "5s";
/// On SIGTERM: how long sessions may take to end after being drained before the hub closes
/// what is left and exits. Below Kubernetes' default termination grace period (30 s).
pub const DEFAULT_DRAIN_TIMEOUT: &str = "20s";
/// Largest frame an agent may send (a ManifestWork status with many resources fits easily).
pub const DEFAULT_MAX_FRAME_BYTES: usize = 4 * 1024 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StoreBackend {
    /// Embedded sled database in the data dir: a whole fleet control plane in one process.
    Sled,
    /// OCM CRDs on a Kubernetes apiserver (install deploy/crds first).
    Kube,
}

/// Where agent sessions are held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GatewayMode {
    /// In this process, for every shard (single node; any store).
    InProcess,
    /// In `flotilla-gateway` replicas that divide the shards through Leases (scale-out; needs
    /// --store kube). The hub still serves joins on its agents' address and redirects any
    /// session that arrives there to its shard's gateway.
    External,
}

#[derive(Clone, Debug, Args)]
pub struct HubConfig {
    /// Directory for the CA, the sled store and the operator credentials; created on first start.
    #[arg(long, env = "FLOTILLA_HUB_DATA_DIR", default_value = "flotilla-data")]
    pub data_dir: PathBuf,

    /// Address agents connect to: gRPC over HTTP/2 with mTLS on TCP, and QUIC with the same
    /// mTLS on UDP at the same port (see --quic). Port 0 picks a free port; the bound addresses
    /// are written to <data-dir>/listen.json.
    #[arg(long, env = "FLOTILLA_HUB_LISTEN", default_value = DEFAULT_AGENT_LISTEN)]
    pub listen: SocketAddr,

    /// Serve QUIC (UDP) beside gRPC (TCP) on the agents' address and port. Agents with
    /// `--transport auto` fall back to gRPC when UDP does not get through.
    #[arg(long, env = "FLOTILLA_HUB_QUIC", default_value_t = true, action = clap::ArgAction::Set)]
    pub quic: bool,

    /// Address of the operator API used by the `flotilla` CLI (HTTPS with client certificates).
    #[arg(long, env = "FLOTILLA_HUB_API_LISTEN", default_value = DEFAULT_API_LISTEN)]
    pub api_listen: SocketAddr,

    /// DNS names and IP addresses agents use to reach this hub; they go into its serving
    /// certificate. Repeat or separate with commas.
    #[arg(long = "server-name", env = "FLOTILLA_HUB_SERVER_NAMES", value_delimiter = ',', default_values_t = ["localhost".to_string(), "127.0.0.1".to_string()])]
    pub server_names: Vec<String>,

    /// host:port agents dial, as printed in join commands (default: the bound agent address,
    /// or the first --server-name with its port when listening on all interfaces).
    #[arg(long, env = "FLOTILLA_HUB_ADVERTISE_ADDRESS")]
    pub advertise_address: Option<String>,

    /// Lifetime of agent client certificates; agents renew over their session after two
    /// thirds of it. Short lifetimes bound how long a stolen key is useful.
    #[arg(long, env = "FLOTILLA_HUB_CLIENT_CERT_LIFETIME", default_value = DEFAULT_CLIENT_CERT_LIFETIME, value_parser = humantime::parse_duration)]
    pub client_cert_lifetime: Duration,

    /// Where the fleet's objects live.
    #[arg(long, env = "FLOTILLA_HUB_STORE", value_enum, default_value_t = StoreBackend::Sled)]
    pub store: StoreBackend,

    /// Kubeconfig of the hub apiserver, with --store kube (default: KUBECONFIG / in-cluster).
    #[arg(long, env = "FLOTILLA_HUB_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Where agent sessions are held: here, or in `flotilla-gateway` replicas (scale-out).
    #[arg(long, env = "FLOTILLA_HUB_GATEWAYS", value_enum, default_value_t = GatewayMode::InProcess)]
    pub gateways: GatewayMode,

    /// With --gateways external: the name the proxy front checks every gateway's certificate
    /// against when it relays a kubectl request to the gateway holding the cluster (one of the
    /// names given to `flotilla-hub gateway-cert`, as agents' --server-name is). Default: the
    /// host of each gateway's advertised address, which its certificate must then name.
    #[arg(long, env = "FLOTILLA_HUB_GATEWAY_SERVER_NAME")]
    pub gateway_server_name: Option<String>,

    /// With --gateways external: the users (as the hub apiserver names them) whose
    /// CertificateSigningRequests the hub answers as renewals relayed by gateways
    /// (comma-separated): the identity of every flotilla-gateway's kubeconfig, its
    /// ServiceAccount in a cluster. A renewal request anyone else creates is denied, so a user
    /// who may create CertificateSigningRequests on the hub apiserver cannot get an agent's
    /// certificate.
    #[arg(
        long,
        env = "FLOTILLA_HUB_RENEWAL_REQUESTERS",
        value_delimiter = ',',
        default_value = DEFAULT_RENEWAL_REQUESTER
    )]
    pub renewal_requesters: Vec<String>,

    #[command(flatten)]
    pub shards: flotilla_gateway::process::ShardFlags,

    #[command(flatten)]
    pub session_rate: flotilla_gateway::process::SessionRateFlags,

    #[command(flatten)]
    pub status_writes: flotilla_gateway::process::StatusWriteFlags,

    /// The budget of requests to the hub apiserver with --store kube (unused with sled).
    #[command(flatten)]
    pub kube_api: flotilla_ops::KubeApiArgs,

    /// How often agents send a heartbeat (told to them in the session's Welcome).
    #[arg(long, default_value = DEFAULT_HEARTBEAT_INTERVAL, value_parser = humantime::parse_duration)]
    pub heartbeat_interval: Duration,

    /// Silence after which a session is closed.
    #[arg(long, default_value = DEFAULT_HEARTBEAT_TIMEOUT, value_parser = humantime::parse_duration)]
    pub heartbeat_timeout: Duration,

    /// Time without a session before a cluster's Available condition turns Unknown.
    #[arg(long, default_value = DEFAULT_GRACE_PERIOD, value_parser = humantime::parse_duration)]
    pub grace_period: Duration,

    /// Largest frame accepted from an agent; a larger one closes that session only.
    #[arg(long, default_value_t = DEFAULT_MAX_FRAME_BYTES)]
    pub max_frame_bytes: usize,

    /// Bytes per second of large works' content chunks sent to one agent at most (works over
    /// the store's object limit travel in 512 KiB chunks the agent asks for).
    #[arg(long, default_value_t = flotilla_gateway::DEFAULT_CHUNK_BYTES_PER_SECOND, value_parser = clap::value_parser!(u64).range(64 * 1024..))]
    pub chunk_bytes_per_second: u64,

    /// The QUIC carrier's congestion controller for what the in-process gateway sends: bbr (the default:
    /// paces at the rate and round trip it measures, so the random loss of radio and
    /// congested links does not hold it down), cubic or new-reno (back off on every loss).
    #[arg(long, default_value = "bbr", value_parser = flotilla_gateway::quic_congestion)]
    pub quic_congestion: flotilla_transport::quic::QuicCongestion,

    /// How long a ManifestChunk that no ManifestWork in its namespace names is kept before the
    /// hub deletes it. Deleting a chunked work, or replacing its content, leaves chunks no work
    /// names; they go after this period. The grace exists because `flotilla work create -f`
    /// stores a work's chunks before the work that names them: a chunk is unnamed for a moment
    /// in every create, and must outlive the slowest create. Counted from the chunk's creation,
    /// the last time the CLI stored it again, or the moment its last work went, whichever is
    /// latest.
    #[arg(long, default_value = crate::controllers::chunk_gc::DEFAULT_CHUNK_GRACE_PERIOD, value_parser = humantime::parse_duration)]
    pub chunk_grace_period: Duration,

    /// Most `policy_governance_info{type="propagated"}` series on /metrics (one per policy per
    /// cluster it reaches): non-compliant ones first, then those without a verdict, then
    /// compliant ones; `flotilla_hub_policy_series_omitted` counts the rest. Root series are
    /// never left out.
    #[arg(long, default_value_t = crate::governance_metrics::DEFAULT_MAX_PROPAGATED)]
    pub policy_metrics_max_propagated: usize,

    /// On SIGTERM every session is drained, each agent told to come back after a delay spread
    /// over this window.
    #[arg(long, default_value = DEFAULT_DRAIN_WINDOW, value_parser = humantime::parse_duration)]
    pub drain_window: Duration,

    /// On SIGTERM, how long drained sessions may take to end before the hub closes the rest
    /// and exits. Keep it under the pod's termination grace period.
    #[arg(long, default_value = DEFAULT_DRAIN_TIMEOUT, value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,

    /// Create OCM's `default` and `global` ManagedClusterSets and put every cluster without a
    /// `cluster.open-cluster-management.io/clusterset` label into `default`, as OCM's hub does.
    /// `--default-cluster-sets=false` leaves sets and labels to the operator.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub default_cluster_sets: bool,
    /// Where the proxy front listens (HTTPS): kubectl reaches cluster NAME at
    /// https://ADDRESS/clusters/NAME (see `flotilla kubeconfig`). Off unless given.
    #[arg(long, env = "FLOTILLA_HUB_PROXY_LISTEN")]
    pub proxy_listen: Option<SocketAddr>,

    /// YAML file of access rules: which users and groups reach which clusters (by name or
    /// ManagedCluster label selector), read-only or full. Without it nobody reaches any
    /// cluster through the proxy front.
    #[arg(long, env = "FLOTILLA_HUB_PROXY_ACCESS_RULES")]
    pub proxy_access_rules: Option<PathBuf>,

    /// Bearer tokens the proxy front accepts, in kube-apiserver's --token-auth-file format:
    /// `token,user,uid,"group1,group2"` per line. Users with certificates from `flotilla user
    /// create` need none.
    #[arg(long, env = "FLOTILLA_HUB_PROXY_TOKEN_FILE")]
    pub proxy_token_file: Option<PathBuf>,

    /// The proxy front's audit log: one JSON line per request (default:
    /// <data-dir>/proxy-audit.log).
    #[arg(long, env = "FLOTILLA_HUB_PROXY_AUDIT_LOG")]
    pub proxy_audit_log: Option<PathBuf>,

    /// Requests in flight through the proxy front per cluster (watches and exec sessions
    /// included); more get 429 with Retry-After.
    #[arg(long, default_value_t = crate::proxy::DEFAULT_MAX_PER_CLUSTER)]
    pub proxy_max_per_cluster: usize,

    /// Requests in flight through the proxy front per user; more get 429 with Retry-After.
    #[arg(long, default_value_t = crate::proxy::DEFAULT_MAX_PER_USER)]
    pub proxy_max_per_user: usize,

    /// An upgraded proxy stream (kubectl exec, attach, port-forward) with no byte either way
    /// for this long is closed.
    #[arg(long, default_value = crate::proxy::DEFAULT_IDLE_TIMEOUT, value_parser = humantime::parse_duration)]
    pub proxy_idle_timeout: Duration,

    /// Largest request head (request line and headers) the proxy front accepts; larger gets
    /// 431. At least 8192.
    #[arg(long, default_value_t = crate::proxy::DEFAULT_MAX_HEADER_BYTES)]
    pub proxy_max_header_bytes: usize,

    /// Validate the configuration, print it, and exit without starting.
    #[arg(long)]
    pub check_config: bool,

    #[command(flatten)]
    pub ops: flotilla_ops::MetricsArgs,
}

impl HubConfig {
    /// The controllers' settings.
    pub fn controllers(&self) -> crate::controllers::ControllerConfig {
        crate::controllers::ControllerConfig {
            default_cluster_sets: self.default_cluster_sets,
            chunk_grace_period: self.chunk_grace_period,
            shards: self.shards.shards,
            ..Default::default()
        }
    }

    /// Checks what clap cannot; errors say how to fix the flag.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.session_rate.validate()?;
        self.status_writes.validate()?;
        self.kube_api.validate().map_err(anyhow::Error::msg)?;
        anyhow::ensure!(
            !self.heartbeat_interval.is_zero(),
            "--heartbeat-interval must be positive"
        );
        anyhow::ensure!(
            self.chunk_grace_period >= Duration::from_secs(1),
            "--chunk-grace-period ({:?}) must be at least 1s: `flotilla work create -f` stores a work's chunks before the work, and a shorter grace deletes them in between",
            self.chunk_grace_period
        );
        anyhow::ensure!(
            self.heartbeat_timeout >= 2 * self.heartbeat_interval,
            "--heartbeat-timeout ({:?}) must be at least twice --heartbeat-interval ({:?}), or one lost heartbeat drops the session",
            self.heartbeat_timeout,
            self.heartbeat_interval
        );
        anyhow::ensure!(
            self.max_frame_bytes >= 64 * 1024,
            "--max-frame-bytes {} is below 64 KiB; a single ManifestWork status would not fit",
            self.max_frame_bytes
        );
        anyhow::ensure!(
            !self.drain_timeout.is_zero(),
            "--drain-timeout must be positive (e.g. 20s): it bounds how long a stopping hub waits"
        );
        anyhow::ensure!(
            !self.server_names.is_empty(),
            "--server-name: give at least one name agents dial"
        );
        anyhow::ensure!(
            self.client_cert_lifetime >= Duration::from_secs(3),
            "--client-cert-lifetime {:?} is too short for an agent to renew in time; use at least 3s (tests) and days in production",
            self.client_cert_lifetime
        );
        if self.gateways == GatewayMode::External {
            anyhow::ensure!(
                self.store == StoreBackend::Kube,
                "--gateways external needs --store kube: the gateways share the hub's apiserver"
            );
            self.shards.validate()?;
        }
        anyhow::ensure!(
            self.proxy_max_per_cluster > 0 && self.proxy_max_per_user > 0,
            "--proxy-max-per-cluster and --proxy-max-per-user must be at least 1"
        );
        anyhow::ensure!(
            !self.proxy_idle_timeout.is_zero(),
            "--proxy-idle-timeout must be positive, e.g. 30m"
        );
        anyhow::ensure!(
            self.proxy_max_header_bytes >= 8192,
            "--proxy-max-header-bytes {} is below 8192; kubectl's requests need more",
            self.proxy_max_header_bytes
        );
        if self.store == StoreBackend::Sled {
            anyhow::ensure!(
                self.kubeconfig.is_none(),
                "--kubeconfig only applies with --store kube"
            );
        }
        Ok(())
    }
}
