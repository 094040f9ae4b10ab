//! `flotilla`: the operator CLI. Talks to the hub's operator API with the credentials the hub
//! wrote on first start (`<data-dir>/operator/config.yaml`).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use flotilla_hub::cli::{
    collection_path, kind_of_document, manifest_work, object_path, read_documents,
};
use flotilla_hub::client::{ApiError, OperatorClient, OperatorConfig};
use flotilla_hub::table;
use flotilla_proto::api::Kind;
use http::{Method, StatusCode};
use serde_json::Value;

#[derive(Parser)]
#[command(
    name = "flotilla",
    version,
    about = "Operate a flotilla fleet: clusters, works, placements"
)]
struct Cli {
    /// CLI config written by the hub (server address and operator certificate).
    #[arg(
        long,
        env = "FLOTILLA_CONFIG",
        global = true,
        default_value = "flotilla-data/operator/config.yaml"
    )]
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
    /// Create or update hub objects (ManifestWork, Placement, ...) from OCM YAML, like
    /// `kubectl apply -f` against a hub with OCM's CRDs.
    Apply {
        /// A YAML/JSON file (several documents allowed) or a directory of them.
        #[arg(short, long)]
        filename: PathBuf,
    },
    /// ManifestWorks: resources delivered to clusters (like `clusteradm create work`).
    Work {
        #[command(subcommand)]
        action: WorkAction,
    },
}

#[derive(Subcommand)]
enum GetWhat {
    /// Managed clusters with their acceptance, join and availability state (like
    /// `clusteradm get clusters`).
    Clusters {
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// ManifestWorks with their Applied / Available / Degraded state.
    Works {
        /// Only this cluster's works (default: every cluster's).
        #[arg(long)]
        cluster: Option<String>,
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
}

#[derive(Subcommand)]
enum WorkAction {
    /// Wrap the Kubernetes manifests of FILE_OR_DIR in a ManifestWork named NAME for each cluster.
    Create {
        name: String,
        /// Manifests: a YAML/JSON file (several documents allowed) or a directory of them.
        #[arg(short, long)]
        filename: PathBuf,
        /// Clusters to deliver to, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        clusters: Vec<String>,
        /// Replace the work's manifests if it exists already.
        #[arg(long)]
        overwrite: bool,
    },
    /// Delete the work NAME from each cluster; its resources are deleted or orphaned as its
    /// deleteOption says.
    Delete {
        name: String,
        #[arg(long, value_delimiter = ',', required = true)]
        clusters: Vec<String>,
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
        Command::Get {
            what: GetWhat::Clusters { output },
        } => {
            let list = client
                .get_json(&collection_path(Kind::ManagedCluster, None))
                .await?;
            print_list(&list, output, table::clusters)?;
        }
        Command::Get {
            what: GetWhat::Works { cluster, output },
        } => {
            let list = client
                .get_json(&collection_path(Kind::ManifestWork, cluster.as_deref()))
                .await?;
            print_list(&list, output, table::works)?;
        }
        Command::Apply { filename } => {
            for doc in read_documents(&filename)? {
                let kind = kind_of_document(&doc)?;
                let verb = upsert(&client, kind, doc.clone(), true).await?;
                println!("{}/{} {verb}", kind.plural(), qualified(&doc));
            }
        }
        Command::Work {
            action:
                WorkAction::Create {
                    name,
                    filename,
                    clusters,
                    overwrite,
                },
        } => {
            let manifests = read_documents(&filename)?;
            anyhow::ensure!(
                !manifests.is_empty(),
                "{} holds no manifests",
                filename.display()
            );
            for cluster in &clusters {
                let work = manifest_work(&name, cluster, &manifests);
                let verb = upsert(&client, Kind::ManifestWork, work, overwrite)
                    .await
                    .with_context(|| format!("ManifestWork {cluster}/{name}"))?;
                println!("manifestwork {cluster}/{name} {verb}");
            }
        }
        Command::Work {
            action: WorkAction::Delete { name, clusters },
        } => {
            for cluster in &clusters {
                client
                    .request(
                        Method::DELETE,
                        &object_path(Kind::ManifestWork, Some(cluster), &name),
                        None,
                    )
                    .await?;
                println!("manifestwork {cluster}/{name} deleted");
            }
        }
    }
    Ok(())
}

/// Creates the object, or (when `replace`) replaces an existing one. Returns what happened.
async fn upsert(
    client: &OperatorClient,
    kind: Kind,
    doc: Value,
    replace: bool,
) -> anyhow::Result<&'static str> {
    let ns = doc["metadata"]["namespace"].as_str().map(str::to_string);
    let name = doc["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    anyhow::ensure!(!name.is_empty(), "{kind} without metadata.name");
    anyhow::ensure!(
        !kind.namespaced() || ns.is_some(),
        "{kind} {name}: metadata.namespace is required (for a ManifestWork: the cluster's name)"
    );
    match client
        .request(
            Method::POST,
            &collection_path(kind, ns.as_deref()),
            Some(&doc),
        )
        .await
    {
        Ok(_) => Ok("created"),
        Err(e) => match e.downcast_ref::<ApiError>() {
            Some(api) if api.status == StatusCode::CONFLICT && replace => {
                client
                    .request(
                        Method::PUT,
                        &object_path(kind, ns.as_deref(), &name),
                        Some(&doc),
                    )
                    .await?;
                Ok("configured")
            }
            Some(api) if api.status == StatusCode::CONFLICT => Err(anyhow::anyhow!(
                "{}; pass --overwrite to replace it",
                api.message
            )),
            _ => Err(e),
        },
    }
}

fn qualified(doc: &Value) -> String {
    let name = doc["metadata"]["name"].as_str().unwrap_or("");
    match doc["metadata"]["namespace"].as_str() {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_string(),
    }
}

fn print_list(
    list: &Value,
    output: Output,
    render: fn(&[Value], jiff::Timestamp) -> String,
) -> anyhow::Result<()> {
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(list)?),
        Output::Yaml => print!("{}", yaml_serde::to_string(list)?),
        Output::Table => {
            let items = list["items"].as_array().cloned().unwrap_or_default();
            print!("{}", render(&items, jiff::Timestamp::now()));
        }
    }
    Ok(())
}
