//! The agent's configuration, parsed and validated once at start.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::connect::Transport;
use crate::reconcile::{DEFAULT_APPLY_CONCURRENCY, DEFAULT_RETRY_INITIAL, ReconcilerConfig};
use flotilla_proto::session::BackoffConfig;
use flotilla_transport::dial::ProxyUrl;

/// Upper bound of the random delay before the first connection after process start, so a site
/// that powers on all at once does not reach the hub in the same second.
pub const DEFAULT_INITIAL_JITTER: &str = "2s";
/// Largest backoff between reconnect attempts.
pub const DEFAULT_MAX_BACKOFF: &str = "60s";
/// Where the durable cache lives by default: a path a DaemonSet or Deployment mounts a
/// persistent volume at. Anything run by hand passes `--data-dir`.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/flotilla-agent";
/// The cache's file under `--data-dir`.
pub const CACHE_FILE: &str = "cache.redb";
/// Where agents before the redb cache kept theirs (a sled directory) under `--data-dir`.
pub const SLED_CACHE_SUBDIR: &str = "cache";
/// The identity's directory under `--data-dir` (unless `--cert-dir` says otherwise).
pub const IDENTITY_SUBDIR: &str = "identity";
/// Default of `--resync-interval`; see [`crate::reconcile::DEFAULT_RESYNC_INTERVAL`].
pub const DEFAULT_RESYNC_INTERVAL: &str = "5m";
/// Default of `--feedback-interval`; see [`crate::reconcile::DEFAULT_FEEDBACK_INTERVAL`].
pub const DEFAULT_FEEDBACK_INTERVAL: &str = "5s";
/// Shortest accepted `--feedback-interval`: below it one flapping resource could fill the
/// session with statuses.
pub const MIN_FEEDBACK_INTERVAL: Duration = Duration::from_millis(100);
/// Shortest accepted `--resync-interval`: below it the agent would spend its time re-applying.
pub const MIN_RESYNC_INTERVAL: Duration = Duration::from_secs(1);
/// Default of `--tunnel-idle-timeout`; see [`crate::tunnel::DEFAULT_TUNNEL_IDLE_TIMEOUT`].
pub const DEFAULT_TUNNEL_IDLE_TIMEOUT: &str = "30m";
/// Most tunnels at once that `--max-tunnels` accepts: the carriers allow 128 streams per
/// connection, the session among them.
pub const MAX_TUNNELS: usize = 120;
/// Default of `--spoke-kube-api-qps`.
pub const DEFAULT_SPOKE_KUBE_API_QPS: f64 = 50.0;
/// Default of `--spoke-kube-api-burst`.
pub const DEFAULT_SPOKE_KUBE_API_BURST: u32 = 100;
/// Most works reconciled at once that `--apply-concurrency` accepts.
pub const MAX_APPLY_CONCURRENCY: usize = 64;

#[derive(Clone, Debug, Args)]
pub struct AgentConfig {
    /// The hub's agent address, host:port (a gateway or the single-node hub). Without it, `run`
    /// serves every hub joined in --data-dir (`join --hub-name NAME` adds one; see `leave`),
    /// each with its own session, identity, cache partition and field managers.
    #[arg(long, env = "FLOTILLA_AGENT_HUB")]
    pub hub: Option<String>,

    /// Name the hub's certificate is checked against (default: the host part of --hub).
    #[arg(long, env = "FLOTILLA_AGENT_SERVER_NAME")]
    pub server_name: Option<String>,

    /// The managed cluster this agent speaks for; must match its certificate.
    #[arg(long, env = "FLOTILLA_AGENT_CLUSTER_NAME")]
    pub cluster_name: String,

    /// The hub this agent serves, when agents of several hubs write to this cluster (a DNS
    /// label, e.g. central-it). Works are then applied as field manager
    /// flotilla-work-agent/<NAME> and policies enforced as flotilla-policy-agent/<NAME>; fields
    /// another hub's agent owns are never taken (the manifest reports ApplyConflict naming that
    /// hub) and an object another hub's agent also applies is never deleted with a work, only
    /// this agent's fields are dropped from it. Without it the agent writes as flotilla-agent
    /// and flotilla-policy-agent, forcing, as before. Changing it on an existing agent leaves
    /// the fields written under the old name to that name.
    #[arg(long, env = "FLOTILLA_AGENT_HUB_NAME")]
    pub hub_name: Option<String>,

    /// Directory with ca.crt (the hub CA bundle), tls.crt and tls.key (this cluster's
    /// identity; the key is made here at join and never leaves the spoke). Default:
    /// <data-dir>/identity, where `flotilla-agent join` stores it.
    #[arg(long, env = "FLOTILLA_AGENT_CERT_DIR")]
    pub cert_dir: Option<PathBuf>,

    /// Reach the hub through this HTTP forward proxy (http://host:port, CONNECT); TLS with the
    /// hub stays end to end through it. Used for joining and for sessions.
    #[arg(long, env = "FLOTILLA_AGENT_PROXY_URL")]
    pub proxy_url: Option<ProxyUrl>,

    /// The carrier of the session: grpc (HTTP/2 over TLS, TCP), quic (UDP, the same mTLS), or
    /// auto: QUIC, falling back to gRPC when no QUIC handshake completes within 3 s (UDP
    /// blocked on the way), remembering that for 10 minutes; always gRPC behind --proxy-url.
    #[arg(long, env = "FLOTILLA_AGENT_TRANSPORT", value_enum, default_value_t = Transport::Auto)]
    pub transport: Transport,

    /// The QUIC carrier's congestion controller for what this side sends: bbr (the default:
    /// paces at the rate and round trip it measures, so the random loss of radio and
    /// congested links does not hold it down), cubic or new-reno (back off on every loss).
    #[arg(long, env = "FLOTILLA_AGENT_QUIC_CONGESTION", default_value = "bbr", value_parser = quic_congestion)]
    pub quic_congestion: flotilla_transport::quic::QuicCongestion,

    #[command(flatten)]
    pub ops: flotilla_ops::MetricsArgs,

    /// kubeconfig of the spoke cluster's apiserver, where works are applied. Default: the
    /// KUBECONFIG variable, then ~/.kube/config, then the pod's service account.
    #[arg(long, env = "FLOTILLA_AGENT_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Requests per second the agent sends to its spoke apiserver at most (client-go's QPS
    /// for the agent's own client: applies, reads, watch openings; kubectl requests relayed
    /// through the tunnel are the user's and are not counted). Requests over it wait, in
    /// order; none is dropped. The default lets a start or resync of a few hundred works
    /// through in seconds and keeps a storm from crowding out the spoke's own controllers;
    /// raise it with the spoke's capacity when flotilla_kube_api_requests_waited_total rises
    /// in steady state.
    #[arg(long, env = "FLOTILLA_AGENT_SPOKE_KUBE_API_QPS", default_value_t = DEFAULT_SPOKE_KUBE_API_QPS)]
    pub spoke_kube_api_qps: f64,

    /// Requests the agent may send to its spoke apiserver at once after a quiet spell, beyond
    /// --spoke-kube-api-qps (client-go's Burst).
    #[arg(long, env = "FLOTILLA_AGENT_SPOKE_KUBE_API_BURST", default_value_t = DEFAULT_SPOKE_KUBE_API_BURST)]
    pub spoke_kube_api_burst: u32,

    /// Directory of the agent's durable cache (desired works, what was applied, status not yet
    /// acknowledged). Keep it across restarts: it is how the agent works while the hub is away.
    /// One agent per directory.
    #[arg(long, env = "FLOTILLA_AGENT_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,

    /// How often every work is applied again to repair changes made by hand (±10% jitter).
    #[arg(long, env = "FLOTILLA_AGENT_RESYNC_INTERVAL", default_value = DEFAULT_RESYNC_INTERVAL, value_parser = humantime::parse_duration)]
    pub resync_interval: Duration,

    /// How many works are applied at once.
    #[arg(long, default_value_t = DEFAULT_APPLY_CONCURRENCY)]
    pub apply_concurrency: usize,

    /// Shortest time between two statuses of one work that changes on this cluster cause
    /// (feedback values, condition rules, an applied object deleted). A resource that changes
    /// faster is reported at this pace, with its latest state each time. Applies and new
    /// generations are reported at once regardless.
    #[arg(long, env = "FLOTILLA_FEEDBACK_INTERVAL", default_value = DEFAULT_FEEDBACK_INTERVAL, value_parser = humantime::parse_duration)]
    pub feedback_interval: Duration,

    /// Upper bound of the random delay before the first connection.
    #[arg(long, default_value = DEFAULT_INITIAL_JITTER, value_parser = humantime::parse_duration)]
    pub initial_jitter: Duration,

    /// Largest delay between reconnect attempts (exponential backoff with full jitter).
    #[arg(long, default_value = DEFAULT_MAX_BACKOFF, value_parser = humantime::parse_duration)]
    pub max_backoff: Duration,

    /// kubectl requests the hub's proxy front sends through this agent at once (each its own
    /// tunnel stream to the spoke apiserver); more get 429 with Retry-After.
    #[arg(long, env = "FLOTILLA_AGENT_MAX_TUNNELS", default_value_t = crate::tunnel::DEFAULT_MAX_TUNNELS)]
    pub max_tunnels: usize,

    /// An upgraded tunnel (kubectl exec, attach, port-forward) with no byte either way for this
    /// long is closed.
    #[arg(long, env = "FLOTILLA_AGENT_TUNNEL_IDLE_TIMEOUT", default_value = DEFAULT_TUNNEL_IDLE_TIMEOUT, value_parser = humantime::parse_duration)]
    pub tunnel_idle_timeout: Duration,

    /// Kubernetes version reported to the hub. Default: read from the spoke apiserver's
    /// /version at start.
    #[arg(long, env = "FLOTILLA_AGENT_KUBERNETES_VERSION", default_value = "")]
    pub kubernetes_version: String,

    /// Failover mode (OCM's MultipleHubs): the hubs joined in --data-dir, by name and in order
    /// of preference (comma-separated, every joined hub listed), of which `run` serves one at a
    /// time. When the active hub's session has not been established for
    /// --hub-unreachable-timeout, the agent serves the next; `flotilla-agent failover --to NAME`
    /// moves it back. What a hub applied stays on the spoke, unenforced, while another is
    /// active. Without it, `run` serves every joined hub at once.
    #[arg(long, env = "FLOTILLA_AGENT_FAILOVER_ORDER", value_delimiter = ',')]
    pub failover_order: Vec<String>,

    /// In failover mode, how long the active hub's session may be down (the hub unreachable,
    /// or refusing the cluster) before the agent moves to the next hub of --failover-order.
    #[arg(long, env = "FLOTILLA_AGENT_HUB_UNREACHABLE_TIMEOUT", default_value = crate::failover::DEFAULT_HUB_UNREACHABLE_TIMEOUT, value_parser = humantime::parse_duration)]
    pub hub_unreachable_timeout: Duration,
}

/// A configuration that cannot work. None is retryable: fix the flag named.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// `--cluster-name` is not a DNS label. Not retryable.
    #[error("--cluster-name {0}")]
    ClusterName(flotilla_proto::contract::InvalidClusterName),
    /// `--hub-name` is not a DNS label. Not retryable.
    #[error(transparent)]
    HubName(#[from] crate::apply::HubNameError),
    /// No `--hub`, where one is needed (joining, or running with no hub joined in the data
    /// directory). Not retryable.
    #[error(
        "no hub to serve: pass --hub HOST:PORT, or join one first (flotilla-agent join --hub-name NAME ...)"
    )]
    NoHub,
    /// `--hub` on a data directory that serves joined hubs. Not retryable.
    #[error(
        "--hub {hub} is given, but this data directory serves the hubs joined in {dir}: run without --hub (and --hub-name) to serve them, or use another --data-dir for an agent of one hub"
    )]
    HubWithJoinedHubs { hub: String, dir: String },
    /// `--hub-name` without `--hub` on a data directory that serves joined hubs. Not retryable.
    #[error(
        "--hub-name is given without --hub, but the hubs joined in {dir} are named by their directories: run without --hub-name to serve every one"
    )]
    HubNameWithJoinedHubs { dir: String },
    /// `--failover-order` that does not list the joined hubs. Not retryable.
    #[error("--failover-order {order}: {problem}")]
    FailoverOrder { order: String, problem: String },
    /// `--hub-unreachable-timeout` is too short. Not retryable.
    #[error("--hub-unreachable-timeout {got:?} is shorter than {min:?}; use e.g. 5m")]
    HubUnreachableTimeout { got: Duration, min: Duration },
    /// `--resync-interval` is too short. Not retryable.
    #[error("--resync-interval {got:?} is shorter than {min:?}; use e.g. 5m")]
    ResyncInterval { got: Duration, min: Duration },
    /// `--transport quic` with `--proxy-url`. Not retryable.
    #[error(
        "--transport quic cannot go through --proxy-url (an HTTP CONNECT proxy carries TCP only); use --transport grpc or auto"
    )]
    QuicBehindProxy,
    /// `--feedback-interval` is too short. Not retryable.
    #[error("--feedback-interval {got:?} is shorter than {min:?}; use e.g. 5s")]
    FeedbackInterval { got: Duration, min: Duration },
    /// `--max-tunnels` is out of range. Not retryable.
    #[error("--max-tunnels {0} is out of range; use 1 to {MAX_TUNNELS}")]
    MaxTunnels(usize),
    /// `--tunnel-idle-timeout` is zero. Not retryable.
    #[error("--tunnel-idle-timeout must be positive, e.g. 30m")]
    TunnelIdleTimeout,
    /// `--apply-concurrency` is out of range. Not retryable.
    #[error("--apply-concurrency {0} is out of range; use 1 to {MAX_APPLY_CONCURRENCY}")]
    ApplyConcurrency(usize),
    /// The kubeconfig named by `--kubeconfig` cannot be read. Not retryable.
    #[error("cannot use --kubeconfig {path}: {detail}")]
    Kubeconfig { path: String, detail: String },
    /// No kubeconfig given and none could be inferred. Not retryable.
    #[error(
        "no spoke apiserver configured ({0}); pass --kubeconfig PATH, set KUBECONFIG, or run the agent in a pod with a service account"
    )]
    NoSpoke(String),
    /// `--spoke-kube-api-qps` or `--spoke-kube-api-burst` bounds nothing or lets nothing
    /// through. Not retryable.
    #[error("{0}")]
    SpokeKubeApi(String),
}

impl AgentConfig {
    /// `--hub`, which an agent of one hub needs; one serving the hubs joined in its data
    /// directory has none.
    pub fn hub_address(&self) -> Result<&str, ConfigError> {
        self.hub.as_deref().ok_or(ConfigError::NoHub)
    }

    /// Host part of `--hub`, or `--server-name`.
    pub fn server_name(&self) -> String {
        self.server_name.clone().unwrap_or_else(|| {
            let hub = self.hub.as_deref().unwrap_or_default();
            let host = hub.rsplit_once(':').map_or(hub, |(h, _)| h);
            host.trim_start_matches('[')
                .trim_end_matches(']')
                .to_string()
        })
    }

    /// Where the cache lives: one file under `--data-dir`, beside the agent's identity.
    pub fn cache_path(&self) -> PathBuf {
        self.data_dir.join(CACHE_FILE)
    }

    /// Where an agent before the redb cache kept its sled cache, retired on start.
    pub fn sled_cache_dir(&self) -> PathBuf {
        self.data_dir.join(SLED_CACHE_SUBDIR)
    }

    /// Where the identity (key, certificate, CA bundle) lives: `--cert-dir`, or its own
    /// directory under `--data-dir`.
    pub fn identity_dir(&self) -> PathBuf {
        self.cert_dir
            .clone()
            .unwrap_or_else(|| self.data_dir.join(IDENTITY_SUBDIR))
    }

    /// Checks what can be checked without touching the network or the disk.
    pub fn validate(&self) -> Result<(), ConfigError> {
        flotilla_proto::contract::check_cluster_name(&self.cluster_name)
            .map_err(ConfigError::ClusterName)?;
        self.field_managers()?;
        if self.transport == Transport::Quic && self.proxy_url.is_some() {
            return Err(ConfigError::QuicBehindProxy);
        }
        if self.resync_interval < MIN_RESYNC_INTERVAL {
            return Err(ConfigError::ResyncInterval {
                got: self.resync_interval,
                min: MIN_RESYNC_INTERVAL,
            });
        }
        if !(1..=MAX_APPLY_CONCURRENCY).contains(&self.apply_concurrency) {
            return Err(ConfigError::ApplyConcurrency(self.apply_concurrency));
        }
        if !(1..=MAX_TUNNELS).contains(&self.max_tunnels) {
            return Err(ConfigError::MaxTunnels(self.max_tunnels));
        }
        if self.tunnel_idle_timeout.is_zero() {
            return Err(ConfigError::TunnelIdleTimeout);
        }
        flotilla_ops::rate::check_qps("--spoke-kube-api-qps", self.spoke_kube_api_qps)
            .and_then(|()| {
                flotilla_ops::rate::check_burst("--spoke-kube-api-burst", self.spoke_kube_api_burst)
            })
            .map_err(ConfigError::SpokeKubeApi)?;
        if self.hub_unreachable_timeout < crate::failover::MIN_HUB_UNREACHABLE_TIMEOUT {
            return Err(ConfigError::HubUnreachableTimeout {
                got: self.hub_unreachable_timeout,
                min: crate::failover::MIN_HUB_UNREACHABLE_TIMEOUT,
            });
        }
        if self.feedback_interval < MIN_FEEDBACK_INTERVAL {
            return Err(ConfigError::FeedbackInterval {
                got: self.feedback_interval,
                min: MIN_FEEDBACK_INTERVAL,
            });
        }
        Ok(())
    }

    /// Failover mode's settings, checked against the hubs `joined` in the data directory;
    /// `None` without `--failover-order`.
    pub fn failover(
        &self,
        joined: &[String],
    ) -> Result<Option<crate::failover::Failover>, ConfigError> {
        if self.failover_order.is_empty() {
            return Ok(None);
        }
        let refuse = |problem: String| ConfigError::FailoverOrder {
            order: self.failover_order.join(","),
            problem,
        };
        if self.hub.is_some() || joined.is_empty() {
            return Err(refuse(
                "failover is between hubs joined in --data-dir (flotilla-agent join --hub-name NAME ...), without --hub".into(),
            ));
        }
        if self.failover_order.len() < 2 {
            return Err(refuse("name at least two hubs".into()));
        }
        let mut seen = std::collections::BTreeSet::new();
        for name in &self.failover_order {
            if !seen.insert(name) {
                return Err(refuse(format!("names hub {name} twice")));
            }
            if !joined.contains(name) {
                return Err(refuse(format!(
                    "names hub {name}, which is not joined here (joined: {})",
                    joined.join(", ")
                )));
            }
        }
        if let Some(missing) = joined.iter().find(|name| !seen.contains(name)) {
            return Err(refuse(format!(
                "leaves out the joined hub {missing}: list every joined hub, or leave it (flotilla-agent leave --hub {missing})"
            )));
        }
        Ok(Some(crate::failover::Failover {
            order: self.failover_order.clone(),
            unreachable_timeout: self.hub_unreachable_timeout,
        }))
    }

    /// The field managers the agent writes as (`--hub-name`).
    pub fn field_managers(
        &self,
    ) -> Result<crate::apply::FieldManagers, crate::apply::HubNameError> {
        crate::apply::FieldManagers::from_flag(self.hub_name.as_deref())
    }

    /// The reconciler's pacing from the flags.
    pub fn reconciler(&self) -> ReconcilerConfig {
        ReconcilerConfig {
            resync_interval: self.resync_interval,
            concurrency: self.apply_concurrency,
            retry_initial: DEFAULT_RETRY_INITIAL,
            feedback_interval: self.feedback_interval,
        }
    }

    /// The budget of the agent's requests to its spoke apiserver.
    pub fn spoke_kube_api(&self) -> flotilla_ops::KubeApiRate {
        flotilla_ops::KubeApiRate::new(self.spoke_kube_api_qps, self.spoke_kube_api_burst)
    }

    /// The tunnel end's settings from the flags.
    /// The reconnect backoff: `--max-backoff` caps it (and its first step), `--initial-jitter`
    /// spreads the first dial after start.
    pub fn backoff(&self) -> BackoffConfig {
        BackoffConfig {
            max: self.max_backoff,
            initial: self.max_backoff.min(BackoffConfig::default().initial),
            startup_jitter: self.initial_jitter,
            ..BackoffConfig::default()
        }
    }

    pub fn tunnels(&self) -> crate::tunnel::TunnelConfig {
        crate::tunnel::TunnelConfig {
            cluster: self.cluster_name.clone(),
            max_tunnels: self.max_tunnels,
            idle_timeout: self.tunnel_idle_timeout,
        }
    }

    /// The client configuration of the spoke apiserver: `--kubeconfig`, or inferred. Reads
    /// files only; the apiserver need not be up.
    pub async fn spoke_kube_config(&self) -> Result<kube::Config, ConfigError> {
        match &self.kubeconfig {
            Some(path) => {
                let fail = |detail: String| ConfigError::Kubeconfig {
                    path: path.display().to_string(),
                    detail,
                };
                let kubeconfig =
                    kube::config::Kubeconfig::read_from(path).map_err(|e| fail(e.to_string()))?;
                kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                    .await
                    .map_err(|e| fail(e.to_string()))
            }
            None => kube::Config::infer()
                .await
                .map_err(|e| ConfigError::NoSpoke(e.to_string())),
        }
    }
}

/// `--quic-congestion`'s parser (the transport crate has no clap).
pub fn quic_congestion(s: &str) -> Result<flotilla_transport::quic::QuicCongestion, String> {
    s.parse()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        config: AgentConfig,
    }

    fn parse(extra: &[&str]) -> AgentConfig {
        let mut args = vec!["agent", "--hub", "hub:443", "--cert-dir", "/c"];
        if !extra.contains(&"--cluster-name") {
            args.extend_from_slice(&["--cluster-name", "store-7"]);
        }
        args.extend_from_slice(extra);
        Cli::parse_from(args).config
    }

    fn check(extra: &[&str], expected: Result<(), &str>) {
        let got = parse(extra).validate().map_err(|e| e.to_string());
        match (got, expected) {
            (Ok(()), Ok(())) => {}
            (Err(got), Err(want)) => assert!(got.contains(want), "{extra:?}: {got}"),
            (got, want) => panic!("{extra:?}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn defaults_are_valid_and_documented_values() {
        let config = parse(&[]);
        assert_eq!(config.data_dir, PathBuf::from(DEFAULT_DATA_DIR));
        assert_eq!(config.resync_interval, Duration::from_secs(300));
        assert_eq!(config.apply_concurrency, DEFAULT_APPLY_CONCURRENCY);
        check(&[], Ok(()));
    }

    #[test]
    fn bad_values_name_the_flag_and_the_fix() {
        check(&["--resync-interval", "100ms"], Err("--resync-interval"));
        check(&["--apply-concurrency", "0"], Err("use 1 to 64"));
        check(
            &["--max-tunnels", "500"],
            Err("--max-tunnels 500 is out of range"),
        );
        check(
            &["--tunnel-idle-timeout", "0s"],
            Err("--tunnel-idle-timeout"),
        );
        check(
            &["--cluster-name", "Store_7"],
            Err("--cluster-name \"Store_7\""),
        );
        check(
            &["--hub-name", "Central_IT"],
            Err("--hub-name \"Central_IT\""),
        );
        check(
            &["--resync-interval", "30s", "--apply-concurrency", "8"],
            Ok(()),
        );
        check(&["--hub-name", "central-it"], Ok(()));
    }

    #[test]
    fn the_failover_order_lists_every_joined_hub_once() {
        let failover = |extra: &[&str], joined: &[&str]| {
            let config =
                Cli::parse_from(["agent", "--cluster-name", "store-7"].iter().chain(extra)).config;
            let joined: Vec<String> = joined.iter().map(|s| s.to_string()).collect();
            config.failover(&joined).map_err(|e| e.to_string())
        };
        let two = ["dept", "central"];
        assert_eq!(
            failover(&[], &two),
            Ok(None),
            "without the flag, every hub at once"
        );
        assert_eq!(
            failover(
                &[
                    "--failover-order",
                    "central,dept",
                    "--hub-unreachable-timeout",
                    "30s"
                ],
                &two
            ),
            Ok(Some(crate::failover::Failover {
                order: vec!["central".into(), "dept".into()],
                unreachable_timeout: Duration::from_secs(30),
            }))
        );
        let refused = |extra: &[&str], joined: &[&str], want: &str| {
            let got = failover(extra, joined).unwrap_err();
            assert!(got.contains(want), "{extra:?}: {got}");
        };
        refused(
            &["--failover-order", "dept,central"],
            &[],
            "between hubs joined in --data-dir",
        );
        refused(
            &["--failover-order", "dept,central", "--hub", "hub:443"],
            &two,
            "without --hub",
        );
        refused(
            &["--failover-order", "dept"],
            &two,
            "name at least two hubs",
        );
        refused(
            &["--failover-order", "dept,dept"],
            &two,
            "names hub dept twice",
        );
        refused(
            &["--failover-order", "dept,edge"],
            &two,
            "names hub edge, which is not joined here (joined: dept, central)",
        );
        refused(
            &["--failover-order", "dept,central"],
            &["dept", "central", "edge"],
            "leaves out the joined hub edge",
        );
        check(
            &["--hub-unreachable-timeout", "0s"],
            Err("--hub-unreachable-timeout"),
        );
        assert_eq!(parse(&[]).hub_unreachable_timeout, Duration::from_secs(300));
    }

    #[tokio::test]
    async fn a_missing_kubeconfig_names_the_flag() {
        let config = parse(&["--kubeconfig", "/nonexistent/kubeconfig"]);
        let err = config.spoke_kube_config().await.unwrap_err().to_string();
        assert!(
            err.starts_with("cannot use --kubeconfig /nonexistent/kubeconfig"),
            "{err}"
        );
    }
}
