//! `flotilla`: the operator CLI. Talks to the hub's operator API with the credentials the hub
//! wrote on first start (`<data-dir>/operator/config.yaml`).

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use flotilla_hub::client::{OperatorClient, OperatorConfig};
use flotilla_hub::table;

#[derive(Parser)]
#[command(name = "flotilla", version, about = "Operate a flotilla fleet")]
struct Cli {
    /// CLI config written by the hub (server address and operator certificate).
    #[arg(long, env = "FLOTILLA_CONFIG", global = true, default_value = "flotilla-data/operator/config.yaml")]
    config: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show fleet objects.
    Get {
        #[command(subcommand)]
        what: GetWhat,
    },
}

#[derive(Subcommand)]
enum GetWhat {
    /// Managed clusters with their acceptance, join and availability state (like
    /// `clusteradm get clusters`).
    Clusters {
        /// Output format.
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Table,
    Json,
    Yaml,
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    if let Err(e) = run(Cli::parse()).await {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let client = OperatorClient::new(&OperatorConfig::load(&cli.config)?)?;
    match cli.command {
        Command::Get { what: GetWhat::Clusters { output } } => {
            let list = client
                .get_json("/apis/cluster.open-cluster-management.io/v1/managedclusters")
                .await?;
            let items = list["items"].as_array().cloned().unwrap_or_default();
            match output {
                Output::Json => println!("{}", serde_json::to_string_pretty(&list)?),
                Output::Yaml => print!("{}", yaml_serde::to_string(&list)?),
                Output::Table => print!("{}", table::clusters(&items, jiff::Timestamp::now())),
            }
        }
    }
    Ok(())
}
