//! flotilla's control plane: the hub CA, the operator API, and (in single-node mode) the gateway
//! running in-process on the embedded store. Binaries: `flotilla-hub` (the server) and
//! `flotilla` (the operator CLI).
//!
//! Not for: holding agent sessions itself (that is `flotilla-gateway`), or talking to spokes'
//! apiservers (agents do that).
#![forbid(unsafe_code)]

pub mod ca;
pub mod cli;
pub mod client;
pub mod config;
pub mod operator_api;
pub mod table;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use flotilla_gateway::{Gateway, GatewayConfig};
use flotilla_store::Store;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tracing::info;

use crate::ca::Ca;
use crate::client::OperatorConfig;
use crate::config::{HubConfig, StoreBackend};

/// Lifetime of the operator certificate written on first start.
pub const OPERATOR_CERT_LIFETIME: Duration = Duration::from_secs(365 * 24 * 3600);

/// What the hub bound, written to `<data-dir>/listen.json` once it serves (port 0 resolved).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ListenInfo {
    pub agents: std::net::SocketAddr,
    pub api: std::net::SocketAddr,
}

impl ListenInfo {
    pub fn path(data_dir: &Path) -> PathBuf {
        data_dir.join("listen.json")
    }
}

/// Opens the configured store backend.
pub async fn open_store(config: &HubConfig) -> anyhow::Result<Arc<dyn Store>> {
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
            let kube_config = match &config.kubeconfig {
                Some(path) => {
                    let kc = kube::config::Kubeconfig::read_from(path)
                        .with_context(|| format!("reading kubeconfig {}", path.display()))?;
                    kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
                }
                None => kube::Config::infer()
                    .await
                    .context("no --kubeconfig given and none could be inferred")?,
            };
            let client = kube::Client::try_from(kube_config)?;
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
    let ca = Ca::load_or_create(&config.data_dir.join("ca"))?;
    info!(fingerprint = %ca.fingerprint(), "hub CA ready");
    let store = open_store(&config).await?;

    let agents = TcpListener::bind(config.listen)
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
    let listen = ListenInfo {
        agents: agents.local_addr()?,
        api: api.local_addr()?,
    };

    let serving = ca.issue_server(&config.server_names)?;
    let server_tls = flotilla_gateway::tls::server_config(
        ca.cert_pem().as_bytes(),
        serving.cert_pem.as_bytes(),
        serving.key_pem.as_bytes(),
    )?;
    write_operator_config(&ca, &config, listen.api)?;

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    let gateway = Gateway::new(
        store.clone(),
        GatewayConfig {
            heartbeat_interval: config.heartbeat_interval,
            heartbeat_timeout: config.heartbeat_timeout,
            grace_period: config.grace_period,
            max_frame_bytes: config.max_frame_bytes,
            ..GatewayConfig::default()
        },
    );
    let agent_conns = flotilla_gateway::tls::accept_authenticated(
        agents,
        server_tls.clone(),
        Default::default(),
        "agents",
    );
    let gateway_task = tokio::spawn(gateway.serve(agent_conns, stopped(stop_rx.clone())));
    let api_conns = flotilla_gateway::tls::accept_authenticated(
        api,
        server_tls,
        Default::default(),
        "operator-api",
    );
    let api_task = tokio::spawn(operator_api::serve(api_conns, store, stopped(stop_rx)));

    ca::write(
        &ListenInfo::path(&config.data_dir),
        &serde_json::to_string_pretty(&listen)?,
        false,
    )?;
    info!(agents = %listen.agents, api = %listen.api, store = ?config.store, "hub serving");

    shutdown.await;
    info!("shutting down");
    let _ = stop_tx.send(true);
    gateway_task.await??;
    api_task.await?;
    Ok(())
}

/// Issues the operator credentials on first start and (re)writes the CLI config with the API's
/// current address.
fn write_operator_config(
    ca: &Ca,
    config: &HubConfig,
    api: std::net::SocketAddr,
) -> anyhow::Result<()> {
    let dir = config.data_dir.join("operator");
    if !dir.join("tls.key").exists() {
        let issued = ca.issue_operator("admin", OPERATOR_CERT_LIFETIME)?;
        ca::write_bundle(&dir, ca.cert_pem(), &issued)?;
        info!(dir = %dir.display(), "operator credentials for user admin written");
    }
    let host = if api.ip().is_unspecified() {
        "127.0.0.1".to_string()
    } else {
        api.ip().to_string()
    };
    let cli = OperatorConfig {
        server: format!(
            "https://{}",
            std::net::SocketAddr::new(host.parse()?, api.port())
        ),
        certificate_authority: "ca.crt".into(),
        client_certificate: "tls.crt".into(),
        client_key: "tls.key".into(),
    };
    let path = dir.join("config.yaml");
    ca::write(&path, &yaml_serde::to_string(&cli)?, false)?;
    info!(config = %path.display(), "flotilla CLI config written (export FLOTILLA_CONFIG={})", path.display());
    Ok(())
}

/// Completes on SIGTERM or Ctrl-C: the one shutdown trigger of every flotilla binary.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}

/// Logs to stderr; `RUST_LOG` filters (default info), `FLOTILLA_LOG_FORMAT=json` for JSON lines.
pub fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if std::env::var("FLOTILLA_LOG_FORMAT").as_deref() == Ok("json") {
        builder.json().init();
    } else {
        builder.init();
    }
}
