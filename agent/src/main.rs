//! `flotilla-agent`: one per spoke cluster; dials out to the hub and keeps one session.

use clap::{Args, Parser, Subcommand};
use flotilla_agent::AgentConfig;
use flotilla_agent::hubs::{JoinedHub, JoinedHubs};
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
    /// already holds an identity skips the join. With --hub-name NAME (and no --cert-dir, on a
    /// data directory without an identity of one hub) the hub is added to the hubs this agent
    /// serves, in <data-dir>/hubs/NAME; join again with another hub's token and name to add
    /// another, and `run` without --hub serves them all.
    Join(JoinArgs),
    /// Stop serving one of the hubs joined in the data directory: remove that hub's works from
    /// the spoke by their deleteOption (an object another hub also applies keeps that hub's
    /// fields), then drop its cache and identity. Run it with the agent stopped; the other
    /// hubs are served as before when it starts again.
    Leave(LeaveArgs),
    /// Failover mode (`run --failover-order`): make one of the joined hubs the active one. A
    /// running agent moves to it within a second (it stops serving the hub it served, whose
    /// objects stay on the spoke unenforced, and resumes the named hub's session from its
    /// cache); a stopped one serves it when it starts.
    Failover(FailoverArgs),
}

#[derive(Args)]
struct FailoverArgs {
    /// The hub to serve, by its name (--hub-name at its join).
    #[arg(long)]
    to: String,
    /// The agent's data directory.
    #[arg(long, env = "FLOTILLA_AGENT_DATA_DIR", default_value = flotilla_agent::config::DEFAULT_DATA_DIR)]
    data_dir: std::path::PathBuf,
}

#[derive(Args)]
struct LeaveArgs {
    /// The hub to leave, by its name (--hub-name at its join).
    #[arg(long = "hub")]
    hub: String,
    /// How long the hub's objects may take to go (finalizers on the spoke hold some); then
    /// leave gives up, the hub still joined, and says which works are left.
    #[arg(long, default_value = flotilla_agent::leave::DEFAULT_LEAVE_TIMEOUT, value_parser = humantime::parse_duration)]
    timeout: std::time::Duration,
    /// The spoke apiserver's kubeconfig (default: as `run` infers it).
    #[arg(long, env = "FLOTILLA_AGENT_KUBECONFIG")]
    kubeconfig: Option<std::path::PathBuf>,
    /// The agent's data directory.
    #[arg(long, env = "FLOTILLA_AGENT_DATA_DIR", default_value = flotilla_agent::config::DEFAULT_DATA_DIR)]
    data_dir: std::path::PathBuf,
    /// The managed cluster this agent speaks for, as at its joins.
    #[arg(long, env = "FLOTILLA_AGENT_CLUSTER_NAME")]
    cluster_name: String,
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
        Command::Leave(_) | Command::Failover(_) => Default::default(),
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
        Command::Leave(args) => {
            let runtime = tokio::runtime::Runtime::new()?;
            runtime.block_on(leave(args))
        }
        Command::Failover(args) => fail_over(args),
    }
}

async fn join_then_run(args: JoinArgs) -> anyhow::Result<()> {
    let config = args.agent;
    config.validate()?;
    let joined_hub = joins_a_hub(&config).map(str::to_owned);
    let hubs = JoinedHubs::in_data_dir(&config.data_dir);
    let identity = match &joined_hub {
        Some(name) => {
            hubs.check_room_for(name)?;
            hubs.identity(name)
        }
        None => Identity::new(config.identity_dir()),
    };
    identity.recover()?;
    if identity.exists() {
        tracing::info!(dir = %identity.dir().display(), "already joined: using the stored identity");
    } else {
        let params = JoinParams {
            hub: config.hub_address()?.to_owned(),
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
    let config = match joined_hub {
        Some(name) => {
            hubs.record(&JoinedHub {
                name: name.clone(),
                address: config.hub_address()?.to_owned(),
                server_name: config.server_name(),
            })?;
            tracing::info!(hub = %name, dir = %hubs.hub_dir(&name).display(), "hub joined; the agent serves every hub joined in its data directory");
            // From here on the agent serves every joined hub, this one among them.
            AgentConfig {
                hub: None,
                server_name: None,
                hub_name: None,
                cert_dir: None,
                ..config
            }
        }
        None => config,
    };
    if args.join_only {
        return Ok(());
    }
    flotilla_agent::run(config, shutdown_signal()).await?;
    Ok(())
}

async fn leave(args: LeaveArgs) -> anyhow::Result<()> {
    /// `run`'s flags, for their defaults: the spoke budget, the paths.
    #[derive(Parser)]
    struct RunFlags {
        #[command(flatten)]
        config: AgentConfig,
    }
    let mut config =
        RunFlags::parse_from(["flotilla-agent", "--cluster-name", &args.cluster_name]).config;
    config.kubeconfig = args.kubeconfig;
    config.data_dir = args.data_dir;
    config.validate()?;
    let left = flotilla_agent::leave::leave(&config, &args.hub, args.timeout).await?;
    println!(
        "left hub {}: {} of its works removed from the spoke",
        args.hub, left.works
    );
    Ok(())
}

fn fail_over(args: FailoverArgs) -> anyhow::Result<()> {
    let hub = JoinedHubs::in_data_dir(&args.data_dir).get(&args.to)?;
    let was = flotilla_agent::failover::read_active(&args.data_dir)?;
    flotilla_agent::failover::write_active(&args.data_dir, &hub.name)?;
    match was {
        Some(was) if was == hub.name => println!("hub {} is already the active hub", hub.name),
        Some(was) => println!(
            "active hub: {} (was {was}); a running agent moves to it within a second",
            hub.name
        ),
        None => println!(
            "active hub: {}; a running agent moves to it within a second",
            hub.name
        ),
    }
    Ok(())
}

/// The hub a join adds to the data directory's joined hubs ([`flotilla_agent::hubs`]):
/// `--hub-name`, unless the agent keeps its identity where an agent of one hub does
/// (`--cert-dir`, or a `<data-dir>/identity` an earlier join made), which then joins and
/// runs exactly as before.
fn joins_a_hub(config: &AgentConfig) -> Option<&str> {
    let single = config.cert_dir.is_some() || config.identity_dir().exists();
    config.hub_name.as_deref().filter(|_| !single)
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
