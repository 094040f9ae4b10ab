//! `flotilla-agent`: one per spoke cluster; dials out to the hub and keeps one session.

use clap::{Parser, Subcommand};
use flotilla_agent::AgentConfig;

#[derive(Parser)]
#[command(name = "flotilla-agent", version, about = "flotilla's spoke agent: dials out to the hub and keeps one session")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Connect to the hub with this cluster's certificate and keep the session.
    Run(AgentConfig),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_tracing();
    match cli.command {
        Command::Run(config) => {
            let runtime = tokio::runtime::Runtime::new()?;
            runtime.block_on(flotilla_agent::run(config, shutdown_signal()))
        }
    }
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}

fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if std::env::var("FLOTILLA_LOG_FORMAT").as_deref() == Ok("json") {
        builder.json().init();
    } else {
        builder.init();
    }
}
