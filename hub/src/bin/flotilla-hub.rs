//! `flotilla-hub`: the fleet's control plane. With the default sled store and the in-process
//! gateway it is a whole fleet in one process.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use flotilla_cli::client::{OperatorClient, OperatorConfig};
use flotilla_hub::ca::{self, Ca};
use flotilla_hub::config::HubConfig;

/// mimalloc rather than the C library's allocator: the process allocates and frees small JSON
/// maps by the million (watch events, statuses of 10,000 clusters), where glibc's malloc spent
/// half of a loaded hub's CPU (see docs/performance.md, "The allocator").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// Issue a flotilla-gateway's certificate from the hub CA (scale-out mode; O=flotilla:gateways,
    /// for serving agents and for the relay hop between gateways): writes
    /// ca.crt (the CA bundle agents' certificates are checked against), tls.crt (the serving
    /// chain) and tls.key into --out, the directory `flotilla-gateway --cert-dir` reads. The
    /// names must include what agents dial (the load balancer's name and each gateway's
    /// advertised host).
    GatewayCert {
        /// Data directory of the hub whose CA signs.
        #[arg(long, env = "FLOTILLA_HUB_DATA_DIR", default_value = "flotilla-data")]
        data_dir: PathBuf,
        /// DNS names and IP addresses for the certificate. Repeat or separate with commas.
        #[arg(long = "server-name", value_delimiter = ',', required = true)]
        server_names: Vec<String>,
        /// Where to write ca.crt, tls.crt and tls.key.
        #[arg(long)]
        out: PathBuf,
    },
    /// Issue an agent client certificate from the hub CA without the join flow (development
    /// only; reads the CA from the data dir). If the hub of that data dir is running, the
    /// cluster is also registered through its operator API as accepted, with this
    /// certificate's key: without that, the hub refuses the certificate.
    DevCert {
        /// Data directory of the hub whose CA signs.
        #[arg(long, env = "FLOTILLA_HUB_DATA_DIR", default_value = "flotilla-data")]
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
    flotilla_hub::init_tracing(cli.serve.ops.log_format);
    warn_retired_variables();
    match cli.command {
        Some(Command::GatewayCert {
            data_dir,
            server_names,
            out,
        }) => {
            let ca = Ca::load_or_create(&data_dir.join("ca"))?;
            // A gateway certificate also opens the relay hop to other gateways.
            let issued = ca.issue_gateway("flotilla-gateway", &server_names)?;
            let chain = ca::IssuedCert {
                cert_pem: ca.serving_chain_pem(&issued.cert_pem),
                key_pem: issued.key_pem,
            };
            ca::write_bundle(&out, &ca.bundle_pem(), &chain)?;
            println!(
                "gateway certificate for {} written to {}",
                server_names.join(", "),
                out.display()
            );
            Ok(())
        }
        Some(Command::DevCert {
            data_dir,
            cluster,
            out,
            lifetime,
        }) => {
            flotilla_proto::contract::check_cluster_name(&cluster)
                .map_err(|invalid| anyhow::anyhow!("--cluster {invalid}"))?;
            let ca = Ca::load_or_create(&data_dir.join("ca"))?;
            let issued = ca.issue_cluster(&cluster, lifetime)?;
            ca::write_bundle(&out, &ca.bundle_pem(), &issued)?;
            println!(
                "certificate for cluster {cluster} written to {}",
                out.display()
            );
            let operator = data_dir.join("operator").join("config.yaml");
            if !operator.exists() {
                eprintln!(
                    "note: no running hub uses {} (no operator/config.yaml): cluster {cluster} is \
                     not registered, and a hub will refuse this certificate until it is",
                    data_dir.display()
                );
                return Ok(());
            }
            let key = {
                use rustls_pki_types::{CertificateDer, pem::PemObject};
                let der = CertificateDer::from_pem_slice(issued.cert_pem.as_bytes())?;
                flotilla_transport::identity::public_key_sha256(&der)?
            };
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime
                .block_on(async {
                    let client = OperatorClient::new(&OperatorConfig::load(&operator)?)?;
                    client
                        .request(
                            http::Method::POST,
                            &format!("/registration/v1/clusters/{cluster}/dev-key"),
                            Some(&serde_json::json!({ "keySha256": key })),
                        )
                        .await
                })
                .with_context(|| {
                    format!(
                        "registering cluster {cluster} with the hub of {}",
                        data_dir.display()
                    )
                })?;
            println!("cluster {cluster} registered as accepted with this certificate's key");
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
            runtime.block_on(flotilla_hub::run(config, flotilla_ops::shutdown_signal()))
        }
    }
}

/// Variables an earlier release read under names the agent used too; they are ignored now.
fn warn_retired_variables() {
    for (old, new) in [
        (
            "FLOTILLA_KUBECONFIG",
            "FLOTILLA_HUB_KUBECONFIG (the hub's store apiserver)",
        ),
        ("FLOTILLA_DATA_DIR", "FLOTILLA_HUB_DATA_DIR"),
    ] {
        if std::env::var_os(old).is_some() {
            tracing::warn!("{old} is set but no longer read by flotilla-hub; use {new}");
        }
    }
}
