//! `flotilla-hub`: the fleet's control plane. With the default sled store and the in-process
//! gateway it is a whole fleet in one process.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use flotilla_hub::ca::{self, Ca};
use flotilla_hub::config::HubConfig;

#[derive(Parser)]
#[command(
    name = "flotilla-hub",
    version,
    about = "flotilla's hub: CA, operator API and agent sessions"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: HubConfig,
}

#[derive(Subcommand)]
enum Command {
    /// Issue an agent client certificate from the hub CA without the join flow (development
    /// only; works while the hub runs, reading the CA from the data dir).
    DevCert {
        /// Data directory of the hub whose CA signs.
        #[arg(long, env = "FLOTILLA_DATA_DIR", default_value = "flotilla-data")]
        data_dir: PathBuf,
        /// The managed cluster the certificate speaks for.
        #[arg(long)]
        cluster: String,
        /// Where to write ca.crt, tls.crt and tls.key.
        #[arg(long)]
        out: PathBuf,
        /// Certificate lifetime.
        #[arg(long, default_value = "720h", value_parser = humantime::parse_duration)]
        lifetime: Duration,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    flotilla_hub::init_tracing();
    match cli.command {
        Some(Command::DevCert {
            data_dir,
            cluster,
            out,
            lifetime,
        }) => {
            anyhow::ensure!(
                flotilla_gateway::identity::is_dns1123_label(&cluster),
                "--cluster {cluster:?} is not a valid cluster name: lower-case letters, digits and '-', at most 63"
            );
            let ca = Ca::load_or_create(&data_dir.join("ca"))?;
            let issued = ca.issue_cluster(&cluster, lifetime)?;
            ca::write_bundle(&out, ca.cert_pem(), &issued)?;
            println!(
                "certificate for cluster {cluster} written to {}",
                out.display()
            );
            Ok(())
        }
        None => {
            let config = cli.serve;
            if config.check_config {
                config.validate()?;
                println!("{config:#?}");
                return Ok(());
            }
            let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
            runtime.block_on(flotilla_hub::run(config, flotilla_hub::shutdown_signal()))
        }
    }
}
