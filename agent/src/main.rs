//! `flotilla-agent`: one per spoke cluster; dials out to the hub and keeps one session.

use clap::{Args, Parser, Subcommand};
use flotilla_agent::AgentConfig;
use flotilla_agent::identity::Identity;
use flotilla_agent::join::{BootstrapToken, JoinParams};
use flotilla_ops::shutdown_signal;

#[derive(Parser)]
#[command(
    name = "flotilla-agent",
    version,
    about = "flotilla's spoke agent: dials out to the hub, keeps one session, and applies its ManifestWorks to this cluster"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Connect to the hub with this cluster's certificate and keep the session.
    Run(AgentConfig),
    /// Ask the hub to join with a bootstrap token (as printed by `flotilla token create`), wait
    /// for an operator to accept, store the certificate, then run as `run` does. An agent that
    /// already holds an identity skips the join.
    Join(JoinArgs),
}

#[derive(Args)]
struct JoinArgs {
    /// The bootstrap token, <id>.<secret>. Prefer the environment variable: arguments show in
    /// process listings.
    #[arg(long, env = "FLOTILLA_BOOTSTRAP_TOKEN", hide_env_values = true)]
    token: BootstrapToken,
    /// SHA-256 fingerprint of the hub CA (from the join command): the hub is trusted only if it
    /// presents this CA.
    #[arg(long, env = "FLOTILLA_CA_FINGERPRINT")]
    ca_fingerprint: String,
    /// Labels to ask for on the ManagedCluster (k=v, comma-separated); the hub may add its own.
    #[arg(long, value_delimiter = ',')]
    labels: Vec<String>,
    /// Join, store the identity and exit instead of running the agent.
    #[arg(long)]
    join_only: bool,
    #[command(flatten)]
    agent: AgentConfig,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    flotilla_ops::init_tracing(match &cli.command {
        Command::Run(config) => config.ops.log_format,
        Command::Join(args) => args.agent.ops.log_format,
    });
    warn_retired_variables();
    match cli.command {
        Command::Run(config) => {
            let runtime = tokio::runtime::Runtime::new()?;
            runtime.block_on(flotilla_agent::run(config, shutdown_signal()))?;
            Ok(())
        }
        Command::Join(args) => {
            let runtime = tokio::runtime::Runtime::new()?;
            runtime.block_on(join_then_run(args))
        }
    }
}

async fn join_then_run(args: JoinArgs) -> anyhow::Result<()> {
    let config = args.agent;
    config.validate()?;
    let identity = Identity::new(config.identity_dir());
    identity.recover()?;
    if identity.exists() {
        tracing::info!(dir = %identity.dir().display(), "already joined: using the stored identity");
    } else {
        let params = JoinParams {
            hub: config.hub.clone(),
            server_name: config.server_name(),
            cluster_name: config.cluster_name.clone(),
            token: args.token,
            ca_fingerprint: args.ca_fingerprint,
            labels: args.labels,
            proxy: config.proxy_url.clone(),
            local_address: None,
        };
        if let Err(e) = flotilla_agent::join::join(&params, &identity, shutdown_signal()).await {
            if matches!(e, flotilla_agent::join::JoinError::Shutdown) {
                return Ok(());
            }
            tracing::error!(error = %e, "join failed");
            return Err(e.into());
        }
    }
    if args.join_only {
        return Ok(());
    }
    flotilla_agent::run(config, shutdown_signal()).await?;
    Ok(())
}

/// Variables an earlier release read, and that now mean the hub's settings to `flotilla-hub`:
/// on a box that runs both, an exported one could have pointed the agent at the hub's
/// apiserver. They are ignored; say so.
fn warn_retired_variables() {
    for (old, new) in [
        (
            "FLOTILLA_KUBECONFIG",
            "FLOTILLA_AGENT_KUBECONFIG (the spoke's kubeconfig)",
        ),
        ("FLOTILLA_DATA_DIR", "FLOTILLA_AGENT_DATA_DIR"),
    ] {
        if std::env::var_os(old).is_some() {
            tracing::warn!("{old} is set but no longer read by the agent; use {new}");
        }
    }
}
