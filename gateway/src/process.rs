//! `flotilla-gateway` as a process: its flags, parsed and checked once, and [`run`], which
//! serves agents on TCP (gRPC) and UDP (QUIC) with the hub CA's certificate, on the hub's
//! kube-apiserver as store, holding the shards its leases give it. Also [`init_tracing`], which
//! the hub's binaries share.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use flotilla_proto::contract::DEFAULT_SHARDS;
use flotilla_store::KubeStore;
use flotilla_store::leases::KubeLeases;
use flotilla_transport::listen::AgentSockets;
use flotilla_transport::quic::QuicListener;
use flotilla_transport::tls::AcceptLimits;
use futures::FutureExt as _;
use tracing::info;

use crate::certificates::CsrRelay;
use crate::rate::{DEFAULT_SESSION_BURST, DEFAULT_SESSION_RATE};
use crate::shards::{OwnerConfig, ShardLeasing};
use crate::writes::{DEFAULT_WRITE_BURST, DEFAULT_WRITE_CONCURRENCY, DEFAULT_WRITES_PER_SECOND};
use crate::{Gateway, GatewayConfig, Listeners};

/// Namespace of the shard and gateway Leases on the hub apiserver unless configured.
pub const DEFAULT_LEASE_NAMESPACE: &str = "flotilla-system";
/// How long a shard lease stays valid without renewal: how long a dead gateway's shards wait
/// before another gateway takes them.
pub const DEFAULT_LEASE_DURATION: &str = "15s";
/// How often leases are read and renewed (at most a third of the lease duration).
pub const DEFAULT_RENEW_PERIOD: &str = "5s";

/// The largest `--session-rate` and `--session-burst` accepted: beyond it the bucket is no
/// bound at all (and a typo more likely than a plan).
pub const MAX_SESSION_RATE: u32 = 1_000_000;
/// Default of `--max-quic-handshakes`.
pub const DEFAULT_MAX_QUIC_HANDSHAKES: u32 = 256;
/// The most `--max-quic-handshakes` takes: each waiting place holds a first datagram.
pub const MAX_QUIC_HANDSHAKES: u32 = 65_536;

/// The new-session rate (herd control), the same on the hub and on every gateway.
#[derive(Clone, Debug, Args)]
pub struct SessionRateFlags {
    /// New agent connections per second this process lets through to a session (gRPC and
    /// QUIC together). Protects the process from a reconnect storm (a restart, a network
    /// flap, a failed-over gateway): each connection costs a TLS handshake, an admission
    /// check, a sync from the watch caches and a health write, and a herd of them at once
    /// starves the sessions already open. Connections over the rate are counted before their
    /// handshake and turned away at once with a retry-after that brings them back spread at
    /// this rate. Size it to what one process can establish per second with CPU to spare
    /// (measure with flotilla-loadtest), divided across gateways behind one load balancer.
    #[arg(long, env = "FLOTILLA_SESSION_RATE", default_value_t = DEFAULT_SESSION_RATE)]
    pub session_rate: u32,

    /// New agent connections let through at once after a quiet spell, beyond the steady
    /// --session-rate. Large enough for the connections that normally arrive together (a
    /// site's agents after a short outage), small enough that the process handles that many
    /// handshakes at once without missing heartbeats.
    #[arg(long, env = "FLOTILLA_SESSION_BURST", default_value_t = DEFAULT_SESSION_BURST)]
    pub session_burst: u32,

    /// QUIC handshakes this process runs at once; four times as many connections wait for a
    /// slot (2 s at most), and the rest are told before any crypto when to come back, at the
    /// rate handshakes have been finishing. A slot is held from the agent's first packet to
    /// its session stream, round trips to the agent included, so on a process with cores to
    /// spare and agents far away more slots set up more sessions per second.
    #[arg(long, env = "FLOTILLA_MAX_QUIC_HANDSHAKES", default_value_t = DEFAULT_MAX_QUIC_HANDSHAKES)]
    pub max_quic_handshakes: u32,
}

impl SessionRateFlags {
    /// Checks what clap cannot; errors say how to fix the flag.
    pub fn validate(&self) -> anyhow::Result<()> {
        for (flag, value) in [
            ("--session-rate", self.session_rate),
            ("--session-burst", self.session_burst),
        ] {
            anyhow::ensure!(
                value >= 1,
                "{flag} 0 would let no agent open a session: give at least 1 (default {})",
                if flag == "--session-rate" {
                    DEFAULT_SESSION_RATE
                } else {
                    DEFAULT_SESSION_BURST
                }
            );
            anyhow::ensure!(
                value <= MAX_SESSION_RATE,
                "{flag} {value} is above {MAX_SESSION_RATE}, which no single process can serve: \
                 give what one process establishes per second (measure with flotilla-loadtest)"
            );
        }
        anyhow::ensure!(
            (1..=MAX_QUIC_HANDSHAKES).contains(&self.max_quic_handshakes),
            "--max-quic-handshakes {} is outside 1..={MAX_QUIC_HANDSHAKES}: give the QUIC \
             handshakes one process runs at once (default {DEFAULT_MAX_QUIC_HANDSHAKES})",
            self.max_quic_handshakes
        );
        Ok(())
    }
}

/// The gateway's store writes (work statuses and cleanup finalizers), the same on the hub
/// (its in-process gateway) and on every gateway.
#[derive(Clone, Debug, Args)]
pub struct StatusWriteFlags {
    /// Store writes per second this gateway makes for agents' reports at most: work statuses
    /// and cleanup finalizers together, each coalesced per work (only a work's newest status
    /// is written). With the kube backend each is one request to the hub apiserver. Size it to
    /// the write rate the apiserver gives this gateway (its API Priority and Fairness share),
    /// divided across gateways; a fan-out to N clusters of one gateway costs it about 2·N
    /// writes (each work's statuses, coalesced, and its cleanup finalizer), so at R per second
    /// the last status lands after about 2·N/R s.
    /// Keep it below --kube-api-qps, which every request of the process shares.
    #[arg(long, env = "FLOTILLA_STATUS_WRITES_PER_SECOND", default_value_t = DEFAULT_WRITES_PER_SECOND)]
    pub status_writes_per_second: u32,

    /// Status writes let through at once after a quiet spell, beyond --status-writes-per-second.
    #[arg(long, env = "FLOTILLA_STATUS_WRITE_BURST", default_value_t = DEFAULT_WRITE_BURST)]
    pub status_write_burst: u32,

    /// Status writes in flight at once (per writer: statuses, finalizers), never two of one
    /// work. One write at a time caps the rate at 1/(store round trip) whatever the budget: to
    /// use a budget of R per second with a round trip of T seconds, give at least R·T (the
    /// default covers 500/s at up to 30 ms); more only adds load on the apiserver at once.
    #[arg(long, env = "FLOTILLA_STATUS_WRITE_CONCURRENCY", default_value_t = DEFAULT_WRITE_CONCURRENCY)]
    pub status_write_concurrency: usize,
}

/// The largest --status-write-concurrency accepted.
pub const MAX_WRITE_CONCURRENCY: usize = 1024;

impl StatusWriteFlags {
    /// Checks what clap cannot; errors say how to fix the flag.
    pub fn validate(&self) -> anyhow::Result<()> {
        for (flag, value, default) in [
            (
                "--status-writes-per-second",
                self.status_writes_per_second,
                DEFAULT_WRITES_PER_SECOND,
            ),
            (
                "--status-write-burst",
                self.status_write_burst,
                DEFAULT_WRITE_BURST,
            ),
        ] {
            anyhow::ensure!(
                value >= 1,
                "{flag} 0 would never store an agent's status: give at least 1 (default {default})"
            );
            anyhow::ensure!(
                value <= MAX_SESSION_RATE,
                "{flag} {value} is above {MAX_SESSION_RATE}, which bounds nothing: give the \
                 writes per second the hub apiserver gives this gateway"
            );
        }
        anyhow::ensure!(
            (1..=MAX_WRITE_CONCURRENCY).contains(&self.status_write_concurrency),
            "--status-write-concurrency {} must be between 1 and {MAX_WRITE_CONCURRENCY} \
             (default {DEFAULT_WRITE_CONCURRENCY})",
            self.status_write_concurrency
        );
        Ok(())
    }

    /// Sets these flags on `config`.
    pub fn apply(&self, config: &mut GatewayConfig) {
        config.status_writes_per_second = self.status_writes_per_second;
        config.status_write_burst = self.status_write_burst;
        config.status_write_concurrency = self.status_write_concurrency;
    }
}

/// Shard ownership flags, the same on the hub (in scale-out mode) and on every gateway.
#[derive(Clone, Debug, Args)]
pub struct ShardFlags {
    /// Virtual shards clusters are spread over (a stable hash of the name). Every hub and
    /// gateway of one fleet must use the same number.
    #[arg(long, env = "FLOTILLA_SHARDS", default_value_t = DEFAULT_SHARDS)]
    pub shards: u32,

    /// Namespace on the hub apiserver holding the Leases `flotilla-shard-NN` (one per shard)
    /// and `flotilla-gateway-NAME` (one per gateway, with its advertised address); created if
    /// missing.
    #[arg(long, env = "FLOTILLA_LEASE_NAMESPACE", default_value = DEFAULT_LEASE_NAMESPACE)]
    pub lease_namespace: String,

    /// How long a shard lease is valid without renewal: a killed gateway's shards move after
    /// at most this long.
    #[arg(long, env = "FLOTILLA_LEASE_DURATION", default_value = DEFAULT_LEASE_DURATION, value_parser = humantime::parse_duration)]
    pub lease_duration: Duration,

    /// How often leases are read (one list) and renewed; at most a third of --lease-duration.
    #[arg(long, env = "FLOTILLA_RENEW_PERIOD", default_value = DEFAULT_RENEW_PERIOD, value_parser = humantime::parse_duration)]
    pub renew_period: Duration,
}

impl ShardFlags {
    /// Checks what clap cannot; errors say how to fix the flag.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            (1..=10_000).contains(&self.shards),
            "--shards {} must be between 1 and 10000",
            self.shards
        );
        anyhow::ensure!(
            self.lease_duration >= Duration::from_secs(1),
            "--lease-duration {:?} is below the Lease API's one-second resolution",
            self.lease_duration
        );
        anyhow::ensure!(
            !self.renew_period.is_zero() && self.renew_period * 3 <= self.lease_duration,
            "--renew-period ({:?}) must be positive and at most a third of --lease-duration ({:?}), \
             so one failed renewal does not lose the shards",
            self.renew_period,
            self.lease_duration
        );
        Ok(())
    }

    /// Leasing for a gateway named `name` reachable at `address` (`claims: false`: a reader
    /// that only routes, such as the hub).
    pub fn leasing(
        &self,
        client: kube::Client,
        name: &str,
        address: &str,
        claims: bool,
    ) -> ShardLeasing {
        ShardLeasing {
            leases: KubeLeases::new(client, self.lease_namespace.clone()),
            owner: OwnerConfig {
                name: name.to_string(),
                address: address.to_string(),
                shards: self.shards,
                lease_duration: self.lease_duration,
                renew_period: self.renew_period,
                claims,
            },
        }
    }
}

/// `flotilla-gateway`'s configuration.
#[derive(Clone, Debug, Args)]
pub struct GatewayProcessConfig {
    /// This gateway's name, unique in the fleet: the holder identity in its shard leases and
    /// the name of its own lease (a pod name is a good choice).
    #[arg(long, env = "FLOTILLA_GATEWAY_NAME")]
    pub name: String,

    /// Address agents connect to: gRPC over HTTP/2 with mTLS on TCP, and QUIC on UDP at the
    /// same port (see --quic).
    #[arg(long, env = "FLOTILLA_GATEWAY_LISTEN", default_value = "0.0.0.0:9443")]
    pub listen: SocketAddr,

    /// host:port other gateways and the hub redirect this gateway's agents to. Required when
    /// --listen is on all interfaces or on port 0.
    #[arg(long, env = "FLOTILLA_GATEWAY_ADVERTISE_ADDRESS")]
    pub advertise_address: Option<String>,

    /// Serve QUIC (UDP) beside gRPC (TCP) on the agents' address and port.
    #[arg(long, env = "FLOTILLA_GATEWAY_QUIC", default_value_t = true, action = clap::ArgAction::Set)]
    pub quic: bool,

    /// Kubeconfig of the hub apiserver (default: KUBECONFIG / in-cluster). The gateway reads
    /// ManagedClusters and ManifestWorks, writes their status, and reads and writes Leases.
    #[arg(long, env = "FLOTILLA_GATEWAY_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Directory with the gateway's TLS material from the hub CA: `tls.crt` (serving chain),
    /// `tls.key`, and `ca.crt` (the hub CA bundle agents' client certificates are checked
    /// against). `flotilla-hub gateway-cert` writes it.
    #[arg(long, env = "FLOTILLA_GATEWAY_CERT_DIR")]
    pub cert_dir: PathBuf,

    #[command(flatten)]
    pub shards: ShardFlags,

    #[command(flatten)]
    pub session_rate: SessionRateFlags,

    #[command(flatten)]
    pub status_writes: StatusWriteFlags,

    #[command(flatten)]
    pub kube_api: flotilla_ops::KubeApiArgs,

    /// How often agents send a heartbeat (told to them in the Welcome).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub heartbeat_interval: Duration,

    /// Silence after which a session is closed.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub heartbeat_timeout: Duration,

    /// Time without a session before a cluster of this gateway's shards turns Unknown.
    #[arg(long, default_value = "40s", value_parser = humantime::parse_duration)]
    pub grace_period: Duration,

    /// On SIGTERM (and when a shard is handed over) sessions are drained, each agent told to
    /// come back after a delay spread over this window.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub drain_window: Duration,

    /// On SIGTERM, how long drained sessions may take to end before the rest are closed.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,

    /// Bytes per second of large works' content chunks sent to one agent at most (works over
    /// the store's object limit travel in 512 KiB chunks the agent asks for).
    #[arg(long, default_value_t = crate::DEFAULT_CHUNK_BYTES_PER_SECOND, value_parser = clap::value_parser!(u64).range(64 * 1024..))]
    pub chunk_bytes_per_second: u64,

    /// The QUIC carrier's congestion controller for what this side sends: bbr (the default:
    /// paces at the rate and round trip it measures, so the random loss of radio and
    /// congested links does not hold it down), cubic or new-reno (back off on every loss).
    #[arg(long, default_value = "bbr", value_parser = crate::config::quic_congestion)]
    pub quic_congestion: flotilla_transport::quic::QuicCongestion,

    /// Validate the configuration, print it, and exit without starting.
    #[arg(long)]
    pub check_config: bool,

    #[command(flatten)]
    pub ops: flotilla_ops::MetricsArgs,
}

impl GatewayProcessConfig {
    /// Checks what clap cannot; errors say how to fix the flag.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.shards.validate()?;
        self.session_rate.validate()?;
        self.status_writes.validate()?;
        self.kube_api.validate().map_err(anyhow::Error::msg)?;
        anyhow::ensure!(
            flotilla_proto::contract::is_dns1123_label(&self.name),
            "--name {:?} must be a DNS-1123 label (lower-case letters, digits, '-'): it names a Lease",
            self.name
        );
        anyhow::ensure!(
            self.heartbeat_timeout >= 2 * self.heartbeat_interval,
            "--heartbeat-timeout ({:?}) must be at least twice --heartbeat-interval ({:?})",
            self.heartbeat_timeout,
            self.heartbeat_interval
        );
        anyhow::ensure!(
            self.advertise_address.is_some()
                || !(self.listen.ip().is_unspecified() || self.listen.port() == 0),
            "--advertise-address is required when --listen ({}) is on all interfaces or port 0: \
             it is where other gateways send this gateway's agents",
            self.listen
        );
        Ok(())
    }

    fn gateway_config(&self) -> GatewayConfig {
        let mut config = GatewayConfig {
            name: self.name.clone(),
            heartbeat_interval: self.heartbeat_interval,
            heartbeat_timeout: self.heartbeat_timeout,
            grace_period: self.grace_period,
            drain_window: self.drain_window,
            drain_timeout: self.drain_timeout,
            chunk_bytes_per_second: self.chunk_bytes_per_second,
            quic_congestion: self.quic_congestion,
            session_rate: self.session_rate.session_rate,
            session_burst: self.session_rate.session_burst,
            max_quic_handshakes: self.session_rate.max_quic_handshakes as usize,
            ..GatewayConfig::default()
        };
        self.status_writes.apply(&mut config);
        config
    }
}

/// The fault point of fenced writes (see [`crate::fault`]): in a build with
/// `debug_assertions`, armed from the directory the environment variable
/// [`FAULT_DIR_ENV`](crate::fault::FAULT_DIR_ENV) names, for the end-to-end tests that hold a
/// gateway's write between its fence check and its store call. A release build has no such
/// code: no flag or variable arms it.
#[cfg(debug_assertions)]
fn fault_point() -> crate::fault::FaultPoint {
    use crate::fault::{FAULT_DIR_ENV, HoldPoint};
    match std::env::var_os(FAULT_DIR_ENV) {
        Some(dir) => {
            tracing::warn!(dir = %std::path::Path::new(&dir).display(), "{FAULT_DIR_ENV} is set: fenced writes of the clusters it names will be held (a test's fault point)");
            HoldPoint::in_directory(dir).point()
        }
        None => crate::fault::FaultPoint::default(),
    }
}

#[cfg(not(debug_assertions))]
fn fault_point() -> crate::fault::FaultPoint {
    crate::fault::FaultPoint::default()
}

/// Runs a gateway until `shutdown` completes, then drains its sessions and releases its
/// shards.
pub async fn run(
    config: GatewayProcessConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    config.validate()?;
    let read = |file: &str| {
        let path = config.cert_dir.join(file);
        std::fs::read(&path).with_context(|| {
            format!(
                "reading {} (--cert-dir: write it with `flotilla-hub gateway-cert`)",
                path.display()
            )
        })
    };
    let key = read("tls.key")?;
    // From the serving key too, so a gateway restarted in place resumes its agents' sessions.
    let tickets = flotilla_transport::tickets::TicketKeys::derived_from(&key);
    let tls = flotilla_transport::tls::agent_server_config(
        &read("ca.crt")?,
        &read("tls.crt")?,
        &key,
        &tickets,
    )
    .context("the TLS material in --cert-dir")?;
    // From the serving key, so a gateway restarted in place resets its agents' old QUIC
    // connections at their next packet.
    let reset_key = flotilla_transport::quic::ResetKey::derived_from(&key);
    // One request budget for every client of the process (the store and the leases).
    let kube_api = config.kube_api.rate();
    let client = flotilla_store::connect(config.kubeconfig.as_deref(), &kube_api).await?;
    let store = Arc::new(KubeStore::new(client.clone()));

    let sockets = AgentSockets::bind(config.listen, config.quic)
        .await
        .with_context(|| format!("cannot listen for agents on {} (--listen)", config.listen))?;
    let bound = sockets.local_addr()?;
    let address = config
        .advertise_address
        .clone()
        .unwrap_or_else(|| bound.to_string());
    let mut gateway_config = config.gateway_config();
    gateway_config.fault = fault_point();
    let quic = match sockets.udp {
        Some(udp) => Some(
            QuicListener::bind(udp, &tls, gateway_config.quic(), reset_key)
                .context("serving QUIC on the agents' address (turn it off with --quic=false)")?,
        ),
        None => None,
    };
    // Renewals go to the hub, which alone holds the CA key, through the hub apiserver.
    let renewals = CsrRelay::new(client.clone(), config.cert_dir.join("ca.crt"));
    let gateway = Gateway::with_certificates(store, gateway_config, renewals);
    let (conns, accept) = flotilla_transport::tls::accept_authenticated(
        sockets.tcp,
        tls,
        AcceptLimits {
            gate: Some(gateway.connection_gate()),
            ..AcceptLimits::default()
        },
        "agents",
    );
    gateway
        .lease_shards(config.shards.leasing(client, &config.name, &address, true))
        .await;
    info!(gateway = %config.name, listen = %bound, advertise = %address, "gateway serving");
    let mut tasks = flotilla_ops::Tasks::new();
    tasks.spawn(
        "the agents' listener",
        accept.map(|r| r.map_err(Into::into)),
    );
    // The listener ends when the drain stops accepting: expected after `shutdown`, a fault
    // before it.
    let (stopping, mut stop) = tokio::sync::watch::channel(false);
    if let Some(address) = config.ops.metrics_addr {
        let mut registry = flotilla_ops::registry();
        gateway.metrics().register(&mut registry);
        crate::metrics::register_tls_resumptions(&mut registry, tickets.opened());
        kube_api.register(&mut registry);
        let endpoint = gateway.endpoint(registry, gateway.readiness());
        // Served until the process ends: through the drain, /readyz says "draining" and
        // /healthz still answers.
        tasks.spawn(
            "the metrics endpoint",
            serve_endpoint(address, endpoint, std::future::pending()).await?,
        );
    }
    let serving = gateway.serve(Listeners { tcp: conns, quic }, None, async move {
        let _ = stop.wait_for(|s| *s).await;
    });
    tokio::pin!(serving, shutdown);
    let mut listening = true;
    loop {
        tokio::select! {
            served = &mut serving => {
                tasks.stop_within(Duration::ZERO).await;
                return served.context(
                    "flotilla-gateway stopped serving; exiting non-zero so that its supervisor restarts it",
                );
            }
            _ = &mut shutdown, if !*stopping.borrow() => {
                info!("shutting down: draining sessions, then releasing shards");
                stopping.send_replace(true);
            }
            ended = tasks.first_end(), if listening => {
                if !*stopping.borrow() {
                    return Err(anyhow::Error::new(ended).context(
                        "flotilla-gateway's listener ended; exiting non-zero so that its supervisor restarts it",
                    ));
                }
                listening = false;
            }
        }
    }
}

/// Binds `address` and returns the task that serves `endpoint` there until `stop` completes.
pub async fn serve_endpoint(
    address: SocketAddr,
    endpoint: flotilla_ops::Endpoint,
    stop: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<impl Future<Output = flotilla_ops::TaskResult> + Send + 'static> {
    let listener = flotilla_ops::endpoint::bind(address).await?;
    info!(address = %listener.local_addr()?, "serving /metrics, /healthz and /readyz");
    Ok(flotilla_ops::serve(listener, Arc::new(endpoint), stop).map(Ok))
}

/// Logs to stderr in `format`; `RUST_LOG` filters (default info).
pub fn init_tracing(format: flotilla_ops::LogFormat) {
    flotilla_ops::init_tracing(format);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(rate: u32, burst: u32, expected: Result<(), &str>) {
        let flags = SessionRateFlags {
            session_rate: rate,
            session_burst: burst,
            max_quic_handshakes: DEFAULT_MAX_QUIC_HANDSHAKES,
        };
        match (flags.validate().map_err(|e| e.to_string()), expected) {
            (Ok(()), Ok(())) => {}
            (Err(msg), Err(want)) => assert!(msg.contains(want), "{msg:?} lacks {want:?}"),
            (got, want) => panic!("{rate}/{burst}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn status_write_flags_refuse_zero_and_absurd_values_by_name() {
        let check = |rate: u32, burst: u32, concurrency: usize| {
            StatusWriteFlags {
                status_writes_per_second: rate,
                status_write_burst: burst,
                status_write_concurrency: concurrency,
            }
            .validate()
            .map_err(|e| e.to_string())
        };
        assert!(check(500, 500, 16).is_ok());
        assert!(check(1, 1, 1).is_ok());
        for (rate, burst, concurrency, want) in [
            (0, 10, 16, "--status-writes-per-second 0 would never store"),
            (10, 0, 16, "--status-write-burst 0 would never store"),
            (
                2_000_000,
                10,
                16,
                "--status-writes-per-second 2000000 is above",
            ),
            (
                10,
                10,
                0,
                "--status-write-concurrency 0 must be between 1 and 1024",
            ),
            (
                10,
                10,
                5000,
                "--status-write-concurrency 5000 must be between 1 and 1024",
            ),
        ] {
            let err = check(rate, burst, concurrency).unwrap_err();
            assert!(err.contains(want), "{err:?} lacks {want:?}");
        }
    }

    #[test]
    fn session_rate_flags_refuse_zero_and_absurd_values_by_name() {
        check(1000, 1000, Ok(()));
        check(1, 1, Ok(()));
        check(
            0,
            10,
            Err("--session-rate 0 would let no agent open a session"),
        );
        check(
            10,
            0,
            Err("--session-burst 0 would let no agent open a session"),
        );
        check(
            2_000_000,
            10,
            Err("--session-rate 2000000 is above 1000000"),
        );
        check(
            10,
            2_000_000,
            Err("--session-burst 2000000 is above 1000000"),
        );
        for (handshakes, ok) in [(0, false), (1, true), (1024, true), (100_000, false)] {
            let flags = SessionRateFlags {
                session_rate: 1000,
                session_burst: 1000,
                max_quic_handshakes: handshakes,
            };
            match flags.validate() {
                Ok(()) => assert!(ok, "{handshakes} accepted"),
                Err(e) => {
                    assert!(!ok, "{handshakes} refused: {e}");
                    assert!(
                        e.to_string()
                            .contains(&format!("--max-quic-handshakes {handshakes} is outside")),
                        "{e}"
                    );
                }
            }
        }
    }
}
