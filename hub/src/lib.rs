//! flotilla's control plane: the hub CA, the operator API, the controllers (placement
//! scheduling, cluster sets, ManifestWorkReplicaSet rollouts), and (in single-node mode) the
//! gateway running in-process on the embedded store. Binary: `flotilla-hub` (the server).
//! `fuzzing` (hidden) holds the fuzz targets of the hub's parsers.
//!
//! Not for: holding agent sessions itself (that is `flotilla-gateway`), talking to spokes'
//! apiservers (agents do that), or the operator CLI (`flotilla-cli`, whose config file format
//! and client the hub borrows to write that file and for `flotilla-hub dev-cert`).
#![forbid(unsafe_code)]

pub mod ca;
pub mod config;
pub mod controllers;
pub mod fleet_metrics;
#[doc(hidden)]
pub mod fuzzing;
pub mod governance_metrics;
pub mod operator_api;
pub mod proxy;
pub mod registration;
pub mod renewals;
pub mod status_page;
pub mod tokens;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use flotilla_cli::client::OperatorConfig;
use flotilla_gateway::{Gateway, GatewayConfig, Listeners};
use flotilla_ops::Tasks;
use flotilla_store::Store;
use flotilla_transport::listen::AgentSockets;
use flotilla_transport::quic::{QuicListener, QuicTlsUpdater};
use futures::{FutureExt as _, TryFutureExt as _};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tracing::info;

use crate::ca::Ca;
use crate::config::{GatewayMode, HubConfig, StoreBackend};
use crate::operator_api::RegistrationApi;
use crate::registration::{Authority, HubCertificates, JoinService};
use crate::tokens::BootstrapTokens;
use flotilla_transport::tls::TlsSource;

/// Lifetime of the operator certificate written on first start.
pub const OPERATOR_CERT_LIFETIME: Duration = Duration::from_secs(365 * 24 * 3600);

/// What the hub bound, written to `<data-dir>/listen.json` once it serves (port 0 resolved).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ListenInfo {
    /// The agents' address: TCP (gRPC), and UDP (QUIC) on the same port unless `quic` is off.
    pub agents: std::net::SocketAddr,
    pub api: std::net::SocketAddr,
    /// Whether QUIC is served on the agents' address.
    #[serde(default)]
    pub quic: bool,
    /// The proxy front's address, when it is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<std::net::SocketAddr>,
    /// The plain-HTTP address of /metrics, /healthz and /readyz, when it is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<std::net::SocketAddr>,
}

impl ListenInfo {
    pub fn path(data_dir: &Path) -> PathBuf {
        data_dir.join("listen.json")
    }
}

/// Opens the configured store backend; with kube, its requests take tokens of `kube_api`.
pub async fn open_store(
    config: &HubConfig,
    kube_api: &flotilla_ops::KubeApiRate,
) -> anyhow::Result<Arc<dyn Store>> {
    Ok(match config.store {
        StoreBackend::Sled => {
            let path = config.data_dir.join("store");
            Arc::new(flotilla_store::SledStore::open(&path).with_context(|| {
                format!(
                    "opening the sled store at {} (is another flotilla-hub using this --data-dir?)",
                    path.display()
                )
            })?)
        }
        StoreBackend::Kube => {
            let client = flotilla_store::connect(config.kubeconfig.as_deref(), kube_api).await?;
            Arc::new(flotilla_store::KubeStore::new(client))
        }
    })
}

/// Runs the hub until `shutdown` completes.
pub async fn run(
    config: HubConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    config.validate()?;
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("creating data dir {}", config.data_dir.display()))?;
    let ca_dir = config.data_dir.join("ca");
    let ca = Ca::load_or_create(&ca_dir)?;
    info!(fingerprint = %ca.fingerprint(), rotating = ca.rotating(), "hub CA ready");
    let authority = Authority::new(ca_dir, ca);
    let tokens = Arc::new(BootstrapTokens::open(&config.data_dir)?);
    // One request budget for every client of the hub apiserver the process builds.
    let kube_api = config.kube_api.rate();
    let store = open_store(&config, &kube_api).await?;

    let agents = AgentSockets::bind(config.listen, config.quic)
        .await
        .with_context(|| format!("cannot listen for agents on {} (--listen)", config.listen))?;
    let api = TcpListener::bind(config.api_listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen for the operator API on {} (--api-listen)",
                config.api_listen
            )
        })?;
    let proxy = match config.proxy_listen {
        Some(address) => Some(TcpListener::bind(address).await.with_context(|| {
            format!("cannot listen for the proxy front on {address} (--proxy-listen)")
        })?),
        None => None,
    };
    let metrics = match config.ops.metrics_addr {
        Some(address) => Some(flotilla_ops::endpoint::bind(address).await?),
        None => None,
    };
    let listen = ListenInfo {
        agents: agents.local_addr()?,
        api: api.local_addr()?,
        quic: agents.udp.is_some(),
        proxy: proxy.as_ref().map(TcpListener::local_addr).transpose()?,
        metrics: metrics.as_ref().map(TcpListener::local_addr).transpose()?,
    };

    let ca = authority.current();
    let serving = ca.issue_server(&config.server_names)?;
    // The operator API keeps this configuration until the hub restarts; after a CA rotation
    // the chain's cross-signed certificate lets CLIs that trust the old CA in.
    let api_tls = flotilla_transport::tls::server_config(
        ca.bundle_pem().as_bytes(),
        ca.serving_chain_pem(&serving.cert_pem).as_bytes(),
        serving.key_pem.as_bytes(),
    )?;
    // Agents' handshakes resumed with a session ticket, under this CA's keys and the next's.
    let resumptions = prometheus_client::metrics::counter::Counter::default();
    let agent_tls_now = agent_tls_config(&ca, &config.server_names, &resumptions)?;
    let (agent_tls_tx, agent_tls) = TlsSource::updatable(agent_tls_now.clone());
    let proxy_tls = flotilla_transport::tls::proxy_server_config(
        ca.bundle_pem().as_bytes(),
        ca.serving_chain_pem(&serving.cert_pem).as_bytes(),
        serving.key_pem.as_bytes(),
    )?;
    write_operator_config(&ca, &config, listen.api, listen.proxy)?;

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    let certificates = HubCertificates::new(
        store.clone(),
        authority.clone(),
        config.client_cert_lifetime,
    );
    let gateway =
        Gateway::with_certificates(store.clone(), gateway_config(&config), certificates.clone());
    // With external gateways, the hub apiserver's client that answers their relayed renewals.
    let mut relayed_renewals = None;
    if config.gateways == GatewayMode::External {
        // Sessions are the gateways'; this one holds no shard and redirects by the directory.
        let client = flotilla_store::connect(config.kubeconfig.as_deref(), &kube_api).await?;
        let address = agent_address(&config, listen.agents);
        gateway
            .lease_shards(
                config
                    .shards
                    .leasing(client.clone(), "hub", &address, false),
            )
            .await;
        relayed_renewals = Some(client);
    }
    let join = JoinService::new(
        store.clone(),
        tokens.clone(),
        authority.clone(),
        gateway.admissions(),
        config.client_cert_lifetime,
    )
    .with_shards(config.shards.shards);
    // Every long-lived task of the hub, with one owner: one that ends while the hub serves
    // makes it exit non-zero (see `flotilla_ops::supervise`).
    let mut tasks = Tasks::new();
    let gateway_config = gateway_config(&config);
    let quic = match agents.udp {
        Some(udp) => Some(
            QuicListener::bind(
                udp,
                &agent_tls_now,
                gateway_config.quic(),
                authority.current().quic_reset_key(),
            )
            .context("serving QUIC on the agents' address (turn it off with --quic=false)")?,
        ),
        None => None,
    };
    let quic_tls = quic.as_ref().map(QuicListener::tls_updater);
    let (agent_conns, agent_accept) = flotilla_transport::tls::accept_authenticated(
        agents.tcp,
        agent_tls,
        flotilla_transport::tls::AcceptLimits {
            gate: Some(gateway.connection_gate()),
            ..Default::default()
        },
        "agents",
    );
    tasks.spawn("the agents' listener", agent_accept.err_into());
    // Joining agents dial the same address they will hold their session on.
    let mut routes = tonic::service::RoutesBuilder::default();
    routes.add_service(join.into_server());
    tasks.spawn(
        "the agents' gateway",
        gateway
            .clone()
            .serve(
                Listeners {
                    tcp: agent_conns,
                    quic,
                },
                Some(routes),
                stopped(stop_rx.clone()),
            )
            .err_into(),
    );
    let (api_conns, api_accept) = flotilla_transport::tls::accept_authenticated(
        api,
        api_tls,
        Default::default(),
        "operator-api",
    );
    tasks.spawn("the operator API's listener", api_accept.err_into());
    // In scale-out, how the hub reaches the gateways holding clusters' sessions: the proxy
    // front's tunnels and the status page's questions share its connections.
    let relay_hop = if config.gateways == GatewayMode::External {
        Some(relay_hop_client(&config, &ca)?)
    } else {
        None
    };
    if let Some(listener) = proxy {
        let route = tunnel_route(&gateway, relay_hop.clone());
        let (front, relays, audit_writer) = proxy_front(&config, route, store.clone())?;
        let (proxy_conns, proxy_accept) = flotilla_transport::tls::accept_authenticated(
            listener,
            proxy_tls,
            Default::default(),
            "proxy",
        );
        tasks.spawn("the proxy front's listener", proxy_accept.err_into());
        tasks.spawn(
            "the proxy front",
            proxy::serve(
                proxy_conns,
                front,
                relays,
                audit_writer,
                stopped(stop_rx.clone()),
            )
            .err_into(),
        );
    }
    let (ca_changed, ca_changes) = tokio::sync::watch::channel(0u64);
    let registration = Arc::new(RegistrationApi {
        tokens,
        authority: authority.clone(),
        agent_address: agent_address(&config, listen.agents),
        ca_changed,
    });
    // The status page's model of the fleet; sessions are the in-process gateway's, or in
    // scale-out the shard owners'. Its caches ride the fleet gauges' watches when those run,
    // else watches of their own.
    let sessions: Arc<dyn status_page::LiveSessions> = match relay_hop {
        Some(hop) => Arc::new(status_page::sessions::ShardOwners::new(
            gateway.clone(),
            hop,
        )),
        None => Arc::new(gateway.clone()),
    };
    // The governance controller's aggregation, read by /metrics and the status page.
    let compliance = controllers::governance::ComplianceView::default();
    let status_page =
        status_page::StatusPage::new(Some(sessions)).with_compliance(compliance.clone());
    let controller_metrics = controllers::ControllerMetrics::default();
    let _metrics_endpoint = if let Some(listener) = metrics {
        // The gateway's metrics and the fleet's gauges; ready once the gateway's caches and
        // the gauges' lists are loaded.
        // RHACM's policy_governance_info keeps its own name: the root registry has no prefix,
        // and everything of flotilla's is under `flotilla_` below it.
        let mut root = prometheus_client::registry::Registry::default();
        root.register_collector(Box::new(governance_metrics::GovernanceMetrics::new(
            compliance.clone(),
            config.policy_metrics_max_propagated,
        )));
        let registry = root.sub_registry_with_prefix("flotilla");
        gateway.metrics().register(registry);
        flotilla_gateway::metrics::register_tls_resumptions(registry, resumptions.clone());
        kube_api.register(registry);
        let fleet = fleet_metrics::FleetMetrics::new();
        fleet.register(registry);
        controller_metrics.register(registry);
        let (listed_tx, listed) = tokio::sync::watch::channel(false);
        tasks.spawn(
            "the fleet gauges and the status page's view of the fleet",
            fleet
                .run(
                    store.clone(),
                    listed_tx,
                    status_page.readers(),
                    stop_rx.clone(),
                )
                .map(Ok),
        );
        let mut readiness = gateway.readiness();
        readiness.push(flotilla_ops::ReadyFlag::watching(
            "the fleet gauges (ManagedClusters, ManifestWorks, Placements, \
             ManifestWorkReplicaSets) have not listed from the store yet",
            listed,
        ));
        let endpoint = gateway.endpoint(root, readiness);
        // Served until `run` returns, through the drain: /readyz then says "draining" and
        // /healthz still answers. Not among `tasks`, which must all end for the hub to stop.
        Some(EndsWithRun(tokio::spawn(flotilla_ops::serve(
            listener,
            Arc::new(endpoint),
            std::future::pending(),
        ))))
    } else {
        tasks.spawn(
            "the status page's view of the fleet",
            status_page
                .clone()
                .run(store.clone(), stop_rx.clone())
                .map(Ok),
        );
        None
    };
    if let Some(client) = relayed_renewals {
        let (requesters, stop) = (config.renewal_requesters.clone(), stop_rx.clone());
        tasks.spawn("the signer of relayed renewals", async move {
            renewals::sign_relayed(client, certificates, requesters, stop).await;
            Ok(())
        });
    }
    // Placement, rollout, policy placement and work TTL act on the store beside the gateway.
    // Each cluster's policies are resolved here and held in memory (never as per-cluster
    // copies in the store) for the sessions that will deliver them.
    let policy_assignments = controllers::governance::PolicyAssignments::default();
    tasks.spawn(
        "the hub's controllers",
        controllers::run(
            store.clone(),
            config.controllers(),
            controller_metrics,
            policy_assignments,
            compliance,
            stop_rx.clone(),
        )
        .err_into(),
    );
    tasks.spawn(
        "the operator API",
        operator_api::serve(
            api_conns,
            store,
            Some(registration),
            Some(status_page),
            config.shards.shards,
            stopped(stop_rx.clone()),
        )
        .err_into(),
    );
    tasks.spawn(
        "CA rotation",
        follow_ca_rotation(
            authority,
            config.server_names.clone(),
            resumptions,
            (agent_tls_tx, quic_tls),
            gateway,
            ca_changes,
            stop_rx,
        )
        .map(Ok),
    );

    ca::write(
        &ListenInfo::path(&config.data_dir),
        &serde_json::to_string_pretty(&listen)?,
        false,
    )?;
    info!(agents = %listen.agents, api = %listen.api, metrics = ?listen.metrics, store = ?config.store, "hub serving");

    tokio::select! {
        _ = shutdown => info!("shutting down"),
        ended = tasks.first_end() => {
            tracing::error!(error = %ended, "a serving task ended; the hub cannot serve without it and exits");
            let _ = stop_tx.send(true);
            tasks.stop_within(STOP_AFTER_FAULT).await;
            return Err(anyhow::Error::new(ended).context(
                "flotilla-hub stopped serving; exiting non-zero so that its supervisor restarts it",
            ));
        }
    }
    let _ = stop_tx.send(true);
    // The gateway drains within --drain-timeout; the rest stop at once.
    let aborted = tasks
        .stop_within(config.drain_timeout + STOP_AFTER_FAULT)
        .await;
    if aborted > 0 {
        tracing::warn!(
            aborted,
            "tasks still running after the drain deadline were aborted"
        );
    }
    Ok(())
}

/// A task that lives as long as [`run`]: aborted when dropped, on every way out of it.
struct EndsWithRun(tokio::task::JoinHandle<()>);

impl Drop for EndsWithRun {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How the proxy front reaches clusters' agents: the in-process gateway's own sessions in
/// single-node mode; in scale-out mode (`hop` given) the gateway holding each cluster's shard,
/// by the shard directory, over the relay hop.
fn tunnel_route(
    gateway: &Gateway,
    hop: Option<flotilla_transport::hop::HopClient>,
) -> Arc<dyn flotilla_gateway::TunnelRoute> {
    match hop {
        Some(hop) => Arc::new(flotilla_gateway::ShardRoute::new(gateway.clone(), hop)),
        None => Arc::new(gateway.clone()),
    }
}

/// The relay hop's client of scale-out mode, with a gateway certificate the hub issues itself
/// now.
fn relay_hop_client(
    config: &HubConfig,
    ca: &Ca,
) -> anyhow::Result<flotilla_transport::hop::HopClient> {
    let identity = ca.issue_gateway("hub", &config.server_names)?;
    let tls = flotilla_transport::tls::client_config(
        ca.bundle_pem().as_bytes(),
        identity.cert_pem.as_bytes(),
        identity.key_pem.as_bytes(),
        &[],
    )
    .context("the hub's gateway certificate for the relay hop")?;
    Ok(flotilla_transport::hop::HopClient::new(tls)
        .with_server_name(config.gateway_server_name.clone()))
}

/// The proxy front from the hub's flags: its access rules and tokens read now, its audit log
/// opened, `route` to reach clusters. Returns the writer of the audit log to run.
fn proxy_front(
    config: &HubConfig,
    route: Arc<dyn flotilla_gateway::TunnelRoute>,
    store: Arc<dyn Store>,
) -> anyhow::Result<(
    Arc<proxy::ProxyFront>,
    tokio::sync::mpsc::Receiver<futures::future::BoxFuture<'static, ()>>,
    impl Future<Output = ()> + Send + use<>,
)> {
    let rules = match &config.proxy_access_rules {
        Some(path) => proxy::access::AccessRules::load(path)?,
        None => {
            tracing::warn!(
                "no --proxy-access-rules: the proxy front lets nobody reach any cluster"
            );
            proxy::access::AccessRules::default()
        }
    };
    let tokens = match &config.proxy_token_file {
        Some(path) => proxy::authn::ProxyTokens::load(path)?,
        None => proxy::authn::ProxyTokens::default(),
    };
    let audit_path = config
        .proxy_audit_log
        .clone()
        .unwrap_or_else(|| config.data_dir.join("proxy-audit.log"));
    let (audit, writer) = proxy::audit::open(&audit_path)?;
    let (front, relays) = proxy::ProxyFront::new(
        route,
        store,
        rules,
        tokens,
        audit,
        proxy::ProxyLimits {
            max_per_cluster: config.proxy_max_per_cluster,
            max_per_user: config.proxy_max_per_user,
            idle_timeout: config.proxy_idle_timeout,
            max_header_bytes: config.proxy_max_header_bytes,
        },
    );
    info!(audit = %audit_path.display(), "proxy front ready");
    Ok((front, relays, writer))
}

/// The session tier's settings from the hub's flags.
fn gateway_config(config: &HubConfig) -> GatewayConfig {
    let mut gateway = GatewayConfig {
        heartbeat_interval: config.heartbeat_interval,
        heartbeat_timeout: config.heartbeat_timeout,
        grace_period: config.grace_period,
        max_frame_bytes: config.max_frame_bytes,
        chunk_bytes_per_second: config.chunk_bytes_per_second,
        quic_congestion: config.quic_congestion,
        drain_window: config.drain_window,
        drain_timeout: config.drain_timeout,
        session_rate: config.session_rate.session_rate,
        session_burst: config.session_rate.session_burst,
        max_quic_handshakes: config.session_rate.max_quic_handshakes as usize,
        ..GatewayConfig::default()
    };
    config.status_writes.apply(&mut gateway);
    gateway
}

/// How long the hub's tasks may take to stop once told, beyond the gateway's drain.
const STOP_AFTER_FAULT: Duration = Duration::from_secs(5);

/// After a CA rotation: new handshakes get a serving chain from the new CA and trust both CAs'
/// client certificates; live sessions get the new bundle. Until `stop`.
async fn follow_ca_rotation(
    authority: Arc<Authority>,
    server_names: Vec<String>,
    resumptions: prometheus_client::metrics::counter::Counter,
    (agent_tls, quic_tls): (
        tokio::sync::watch::Sender<Arc<rustls::ServerConfig>>,
        Option<QuicTlsUpdater>,
    ),
    gateway: Gateway,
    mut changes: tokio::sync::watch::Receiver<u64>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { return },
            _ = stop.wait_for(|s| *s) => return,
        }
        match agent_tls_config(&authority.current(), &server_names, &resumptions) {
            Ok(tls) => {
                if let Some(quic) = &quic_tls
                    && let Err(e) = quic.update(&tls)
                {
                    tracing::error!(error = %e, "cannot give QUIC the new CA's TLS configuration");
                }
                agent_tls.send_replace(tls);
                gateway.push_trust_bundle();
                info!("agents' listener now serves from the new CA; sessions told the new bundle");
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot build the agents' TLS configuration after a CA change")
            }
        }
    }
}

/// The agents' listener configuration for CA `ca`: a fresh serving certificate from it, the
/// chain a joining agent searches for its pinned CA, client roots for the whole bundle, and
/// session tickets under the CA's keys (resumptions counted into `resumptions`).
fn agent_tls_config(
    ca: &Ca,
    server_names: &[String],
    resumptions: &prometheus_client::metrics::counter::Counter,
) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let serving = ca.issue_server(server_names)?;
    Ok(flotilla_transport::tls::agent_server_config(
        ca.bundle_pem().as_bytes(),
        ca.serving_chain_pem(&serving.cert_pem).as_bytes(),
        serving.key_pem.as_bytes(),
        &ca.ticket_keys().counted(resumptions.clone()),
    )?)
}

/// host:port for join commands: `--advertise-address`, else the bound address, else (bound to
/// all interfaces) the first server name with the bound port.
fn agent_address(config: &HubConfig, bound: std::net::SocketAddr) -> String {
    if let Some(a) = &config.advertise_address {
        return a.clone();
    }
    if bound.ip().is_unspecified() {
        let host = config
            .server_names
            .first()
            .cloned()
            .unwrap_or_else(|| "localhost".into());
        return format!("{host}:{}", bound.port());
    }
    bound.to_string()
}

/// Issues the operator credentials on first start and (re)writes the CLI config with the API's
/// current address.
fn write_operator_config(
    ca: &Ca,
    config: &HubConfig,
    api: std::net::SocketAddr,
    proxy: Option<std::net::SocketAddr>,
) -> anyhow::Result<()> {
    let dir = config.data_dir.join("operator");
    let current = std::fs::read_to_string(dir.join("tls.crt")).unwrap_or_default();
    // After a CA rotation the operator's certificate comes from the new CA too: once the
    // rotation is finished, the previous CA's certificates are refused, the CLI's included.
    if !dir.join("tls.key").exists() || !ca.issued(&current) {
        let issued = ca.issue_operator("admin", OPERATOR_CERT_LIFETIME)?;
        ca::write_bundle(&dir, &ca.bundle_pem(), &issued)?;
        info!(dir = %dir.display(), "operator credentials for user admin written");
    } else {
        // After a CA rotation the CLI trusts both CAs.
        ca::write(&dir.join("ca.crt"), &ca.bundle_pem(), false)?;
    }
    let url = |address: std::net::SocketAddr| {
        let ip = if address.ip().is_unspecified() {
            std::net::IpAddr::from([127, 0, 0, 1])
        } else {
            address.ip()
        };
        format!("https://{}", std::net::SocketAddr::new(ip, address.port()))
    };
    let cli = OperatorConfig {
        server: url(api),
        proxy_server: proxy.map(url),
        certificate_authority: "ca.crt".into(),
        client_certificate: "tls.crt".into(),
        client_key: "tls.key".into(),
    };
    let path = dir.join("config.yaml");
    ca::write(&path, &yaml_serde::to_string(&cli)?, false)?;
    info!(config = %path.display(), "flotilla CLI config written (export FLOTILLA_CONFIG={})", path.display());
    Ok(())
}

pub use flotilla_gateway::process::init_tracing;
