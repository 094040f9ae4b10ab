//! `flotilla`: the operator CLI. Talks to the hub's operator API with the credentials the hub
//! wrote on first start (`<data-dir>/operator/config.yaml`).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use flotilla_cli::cli::{
    apply_label_changes, apply_taint_changes, collection_path, default_namespace, kind_of_document,
    kind_of_resource, manifest_work, modify_cluster, namespaced_name, object_path,
    parse_label_changes, parse_taint_changes, read_documents, replica_set,
};
use flotilla_cli::client::{ApiError, OperatorClient, OperatorConfig};
use flotilla_cli::table;
use flotilla_proto::api::Kind;
use flotilla_transport::files::Access;
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
    /// Show one object in detail.
    Describe {
        #[command(subcommand)]
        what: DescribeWhat,
    },
    /// Create or update hub objects (ManifestWork, Placement, ...) from OCM YAML, like
    /// `kubectl apply -f` against a hub with OCM's CRDs.
    Apply {
        /// A YAML/JSON file (several documents allowed) or a directory of them.
        #[arg(short, long)]
        filename: PathBuf,
        /// Namespace of the namespaced objects whose documents name none (Placements, Policies,
        /// ...; a ManifestWork must name its cluster's), as with `kubectl apply -n`.
        #[arg(short, long, default_value = "default")]
        namespace: String,
        /// Largest manifests a ManifestWork may have. Works over the store's object limit
        /// (1 MiB of manifests) are stored as ManifestChunk objects beside the work.
        #[arg(long, default_value_t = flotilla_proto::api::content::DEFAULT_MAX_WORK_BYTES, value_parser = clap::value_parser!(u64).range(1..=flotilla_proto::api::content::MAX_CONTENT_BYTES))]
        max_work_bytes: u64,
    },
    /// Delete hub objects, like `kubectl delete`: the objects a file's documents are (`-f`), or
    /// one object by its resource and name (`flotilla delete configmap settings -n policies`).
    /// A ManifestWork its agent holds stays (Deleting) until the agent has released it.
    Delete {
        /// The resource: a kind (`ConfigMap`), its singular or its plural (`configmaps`).
        #[arg(required_unless_present = "filename", requires = "name")]
        resource: Option<String>,
        /// The object's name.
        name: Option<String>,
        /// A YAML/JSON file (several documents allowed) or a directory of them, as given to
        /// `flotilla apply`.
        #[arg(short, long, conflicts_with = "resource")]
        filename: Option<PathBuf>,
        /// Namespace of a namespaced object that neither the command nor its document names.
        #[arg(short, long, default_value = "default")]
        namespace: String,
    },
    /// ManifestWorks: resources delivered to clusters (like `clusteradm create work`).
    Work {
        #[command(subcommand)]
        action: WorkAction,
    },
    /// Bootstrap tokens that let spokes ask to join (like `clusteradm get token`).
    Token {
        #[command(subcommand)]
        action: TokenAction,
    },
    /// Accept, deny or remove managed clusters (the hub's half of the double opt-in).
    Cluster {
        #[command(subcommand)]
        action: ClusterAction,
    },
    /// The hub CA: show it, rotate it with an overlap, finish the rotation.
    Ca {
        #[command(subcommand)]
        action: CaAction,
    },
    /// kubectl users of the hub's proxy front (not operators): each gets a client
    /// certificate from the hub CA; access rules (flotilla-hub --proxy-access-rules) say which
    /// clusters they reach.
    User {
        #[command(subcommand)]
        action: UserAction,
    },
    /// Serve the hub's fleet status page to a browser on this machine, like `kubectl proxy`:
    /// listens on loopback and forwards GET /ui/... to the hub's operator API with the
    /// operator's certificate from --config. Open http://127.0.0.1:PORT/ui/ ; the first screen
    /// lists the clusters failing right now, and since when. Read-only; Ctrl-C stops it.
    Dashboard {
        /// Port to listen on (0: any free port, printed).
        #[arg(short, long, default_value_t = flotilla_cli::dashboard::DEFAULT_PORT)]
        port: u16,
        /// Loopback address to listen on: whoever reaches the dashboard acts as the operator,
        /// so other addresses are refused.
        #[arg(long, default_value = "127.0.0.1")]
        address: std::net::IpAddr,
    },
    /// Write a kubeconfig whose contexts reach clusters through the hub's proxy front
    /// (https://HUB/clusters/NAME), so plain kubectl works against clusters behind NAT.
    Kubeconfig {
        /// Clusters to write a context for (comma-separated); the first is current.
        #[arg(long, value_delimiter = ',', required_unless_present = "all")]
        cluster: Vec<String>,
        /// One context per cluster of the fleet.
        #[arg(long, conflicts_with = "cluster")]
        all: bool,
        /// The kubectl user (from `flotilla user create`) whose certificate the kubeconfig
        /// uses. Default: the only one there is.
        #[arg(long)]
        user: Option<String>,
        /// Write to this file (mode 0600) instead of standard output.
        #[arg(short = 'o', long)]
        out: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum UserAction {
    /// Make a key here, have the hub CA sign its certificate (CN=NAME, O=flotilla:users, OU=the
    /// groups), keep both beside the CLI config (users/NAME/), and write NAME's
    /// kubeconfig with a context per cluster of the fleet.
    Create {
        name: String,
        /// Groups the user is in (comma-separated); the spoke's RBAC sees them as the user's
        /// groups and the hub's access rules can name them.
        #[arg(long, value_delimiter = ',')]
        groups: Vec<String>,
        /// How long the certificate is valid (at most 90 days).
        #[arg(long, default_value = "90d", value_parser = humantime::parse_duration)]
        lifetime: std::time::Duration,
        /// Where the kubeconfig goes (default: NAME.kubeconfig in the current directory).
        #[arg(short = 'o', long)]
        out: Option<PathBuf>,
    },
}

/// Default of `flotilla token create --ttl`.
const DEFAULT_TOKEN_TTL: &str = "1h";

#[derive(Subcommand)]
enum TokenAction {
    /// Create a token and print the join command to run on the spoke.
    Create {
        /// How long the token admits joins.
        #[arg(long, default_value = DEFAULT_TOKEN_TTL, value_parser = humantime::parse_duration)]
        ttl: std::time::Duration,
        /// How many clusters may join with it (default: any number until it expires).
        #[arg(long)]
        uses: Option<u32>,
        /// Accept clusters that join with this token at once, and give them these labels
        /// (k=v, comma-separated).
        #[arg(long, value_delimiter = ',')]
        auto_accept_labels: Vec<String>,
        /// Accept clusters that join with this token at once, without labels.
        #[arg(long)]
        auto_accept: bool,
        /// Put this cluster name into the printed join command instead of a placeholder.
        #[arg(long)]
        cluster_name: Option<String>,
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// List tokens (ids, expiry, uses, state; never the secrets).
    List {
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Revoke a token: joins with it are refused from now on.
    Revoke { id: String },
}

#[derive(Subcommand)]
enum ClusterAction {
    /// Accept a cluster's join request (sets spec.hubAcceptsClient: true); its waiting agent
    /// receives its certificate.
    Accept {
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Deny a cluster: a waiting agent gets DENIED, a connected one loses its session at once,
    /// and its certificate stops working.
    Deny {
        #[arg(required = true)]
        names: Vec<String>,
        /// Told to the agent and kept on the ManagedCluster.
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Delete a cluster: its sessions close at once and its certificate stops working; the
    /// spoke must join again with a new token.
    Delete {
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Take a cluster out of the fleet for good, step by step: write the --policy into each of
    /// its ManifestWorks' deleteOption and wait for the agent to report it, take it out of
    /// placements (taint flotilla.io/decommissioning:NoSelect), delete its works, revoke it
    /// (deny) and delete the ManagedCluster. With `orphan` the agent is revoked before any work
    /// is deleted, so an agent that was offline keeps every workload when it comes back, and
    /// the works' cleanup finalizers are removed here; with `clean` the agent deletes them and
    /// must be online to confirm, and the works go once it reports the spoke clean.
    ///
    /// Progress is recorded on the ManagedCluster (annotation flotilla.io/decommission): run
    /// the same command again after an interruption, or a failure it explains, and it
    /// continues where it stopped, never with another policy.
    Decommission {
        /// The ManagedCluster to decommission.
        name: String,
        /// What happens to the workloads the cluster's works applied: `orphan` leaves them on
        /// the spoke, `clean` has the agent delete them. Required to start (a surprise delete
        /// of workloads is the failure this command exists to prevent, and a surprise orphan
        /// leaves them unmanaged); optional when resuming, where it must match.
        #[arg(long, value_enum)]
        policy: Option<flotilla_cli::decommission::Policy>,
        /// How long each waiting step waits: for the agent to report the policy, for
        /// placements to drop the cluster, for its works to go. With `orphan`, an agent that
        /// does not report in time is revoked first; with `clean`, the command stops and says
        /// how to go on.
        #[arg(long, default_value = flotilla_cli::decommission::DEFAULT_TIMEOUT,
              value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
    },
    /// Set or remove labels on a cluster, as `kubectl label managedcluster` does: `key=value`
    /// sets, `key-` removes. Placements select by these labels; they are the hub's to set
    /// (agents report facts as ClusterClaims instead).
    Label {
        name: String,
        /// `key=value` or `key-`, one or more.
        #[arg(required = true)]
        changes: Vec<String>,
        /// Change labels that already have another value.
        #[arg(long)]
        overwrite: bool,
    },
    /// Add or remove taints on a cluster, as `kubectl taint` does: `key[=value]:Effect` adds
    /// (effects NoSelect, PreferNoSelect, NoSelectIfNew), `key-` or `key:Effect-` removes.
    /// Placements that do not tolerate a NoSelect taint drop the cluster.
    Taint {
        name: String,
        #[arg(required = true)]
        changes: Vec<String>,
    },
}

#[derive(Subcommand)]
enum CaAction {
    /// Show the CA fingerprint (what join commands pin) and whether a rotation is in progress.
    Show,
    /// Make a new CA. The old one stays trusted (overlap); agents receive the new bundle over
    /// their sessions, new and renewed certificates come from the new CA.
    Rotate,
    /// End the overlap: stop trusting the previous CA. Run it once every agent has renewed (one
    /// --client-cert-lifetime after the rotation at the latest).
    FinishRotation,
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
    /// Placements: whether they are satisfied, and the clusters they selected.
    Placements {
        /// Only this namespace's (default: every namespace's).
        #[arg(short, long)]
        namespace: Option<String>,
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// PlacementDecisions: the clusters each placement selected, by decision group.
    Placementdecisions {
        #[arg(short, long)]
        namespace: Option<String>,
        /// Only this placement's (its `cluster.open-cluster-management.io/placement` label).
        #[arg(long)]
        placement: Option<String>,
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// ManifestWorkReplicaSets: how far each rollout got (selected, applied, failed) and its
    /// phase (Complete, Progressing, MaxFailuresExceeded).
    #[command(alias = "mwrs")]
    Manifestworkreplicasets {
        #[arg(short, long)]
        namespace: Option<String>,
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// The hub's ConfigMaps: the data hub templates read with
    /// `{{hub fromConfigMap "" "NAME" "KEY" hub}}` from their policy's namespace.
    #[command(alias = "configmap", alias = "cm")]
    Configmaps {
        /// Only this namespace's (default: every namespace's).
        #[arg(short, long, conflicts_with = "all_namespaces")]
        namespace: Option<String>,
        /// Every namespace's (what no -n means too).
        #[arg(short = 'A', long)]
        all_namespaces: bool,
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Root Policies: remediation, compliance, and how many of the clusters each reaches are
    /// non-compliant (CLUSTERS: non-compliant/total).
    #[command(alias = "policy", alias = "plc")]
    Policies {
        /// Only this namespace's (default: every namespace's).
        #[arg(short, long, conflicts_with = "all_namespaces")]
        namespace: Option<String>,
        /// Every namespace's (what no -n means too).
        #[arg(short = 'A', long)]
        all_namespaces: bool,
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
}

#[derive(Subcommand)]
enum DescribeWhat {
    /// A root Policy: its templates, the bindings and placements that place it, each selected
    /// cluster's compliance as far as the hub knows it, and what the failing clusters (at most
    /// 20, non-compliant first) report each unmet template violates.
    #[command(alias = "policies", alias = "plc")]
    Policy {
        name: String,
        #[arg(short, long, default_value = "default")]
        namespace: String,
    },
}

#[derive(Subcommand)]
enum WorkAction {
    /// Wrap the Kubernetes manifests of FILE_OR_DIR in a ManifestWork named NAME for each cluster
    /// (`--clusters`), or for the clusters a placement selects (`--placement NS/NAME`, like
    /// `clusteradm create work --placement`): then a ManifestWorkReplicaSet NS/NAME keeps one
    /// ManifestWork NAME in each selected cluster's namespace, and the work follows the
    /// placement's decisions as they change.
    #[command(group(clap::ArgGroup::new("target").required(true).args(["clusters", "placement"])))]
    Create {
        name: String,
        /// Manifests: a YAML/JSON file (several documents allowed) or a directory of them.
        #[arg(short, long)]
        filename: PathBuf,
        /// Clusters to deliver to, comma-separated.
        #[arg(long, value_delimiter = ',')]
        clusters: Vec<String>,
        /// The placement (NAMESPACE/NAME) whose selected clusters get the work.
        #[arg(long)]
        placement: Option<String>,
        /// Replace the work's manifests if it exists already.
        #[arg(long)]
        overwrite: bool,
        /// Largest manifests the work may have. Over the store's object limit (1 MiB of
        /// manifests) they are stored as ManifestChunk objects beside the work.
        #[arg(long, default_value_t = flotilla_proto::api::content::DEFAULT_MAX_WORK_BYTES, value_parser = clap::value_parser!(u64).range(1..=flotilla_proto::api::content::MAX_CONTENT_BYTES))]
        max_work_bytes: u64,
    },
    /// Delete the work NAME from each cluster (`--clusters`), or the ManifestWorkReplicaSet of
    /// `--placement NS/NAME` with all its ManifestWorks; resources are deleted or orphaned as
    /// the work's deleteOption says. A work its agent has acknowledged stays (Deleting) until
    /// the agent reports its resources removed: its cleanup finalizer holds it.
    #[command(group(clap::ArgGroup::new("target").required(true).args(["clusters", "placement"])))]
    Delete {
        name: String,
        #[arg(long, value_delimiter = ',')]
        clusters: Vec<String>,
        /// The placement the work was created for (its namespace is the replica set's).
        #[arg(long)]
        placement: Option<String>,
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
        Command::Get {
            what: GetWhat::Placements { namespace, output },
        } => {
            let list = client
                .get_json(&collection_path(Kind::Placement, namespace.as_deref()))
                .await?;
            let decisions = client
                .get_json(&collection_path(
                    Kind::PlacementDecision,
                    namespace.as_deref(),
                ))
                .await?;
            let decisions = decisions["items"].as_array().cloned().unwrap_or_default();
            let render = |items: &[Value], now| table::placements(items, &decisions, now);
            print_list_with(&list, output, render)?;
        }
        Command::Get {
            what:
                GetWhat::Placementdecisions {
                    namespace,
                    placement,
                    output,
                },
        } => {
            let mut list = client
                .get_json(&collection_path(
                    Kind::PlacementDecision,
                    namespace.as_deref(),
                ))
                .await?;
            if let (Some(p), Some(items)) = (placement, list["items"].as_array_mut()) {
                items.retain(|d| {
                    d["metadata"]["labels"][flotilla_proto::api::PLACEMENT_LABEL].as_str()
                        == Some(p.as_str())
                });
            }
            print_list(&list, output, table::placement_decisions)?;
        }
        Command::Get {
            what: GetWhat::Manifestworkreplicasets { namespace, output },
        } => {
            let list = client
                .get_json(&collection_path(
                    Kind::ManifestWorkReplicaSet,
                    namespace.as_deref(),
                ))
                .await?;
            print_list(&list, output, table::replica_sets)?;
        }
        Command::Get {
            what:
                GetWhat::Policies {
                    namespace,
                    all_namespaces: _,
                    output,
                },
        } => {
            let list = client
                .get_json(&collection_path(Kind::Policy, namespace.as_deref()))
                .await?;
            print_list(&list, output, table::policies)?;
        }
        Command::Get {
            what:
                GetWhat::Configmaps {
                    namespace,
                    all_namespaces: _,
                    output,
                },
        } => {
            let list = client
                .get_json(&collection_path(Kind::ConfigMap, namespace.as_deref()))
                .await?;
            print_list(&list, output, table::config_maps)?;
        }
        Command::Delete {
            resource,
            name,
            filename,
            namespace,
        } => {
            let targets = match (filename, resource, name) {
                (Some(filename), _, _) => read_documents(&filename)?
                    .into_iter()
                    .map(|mut doc| {
                        let kind = kind_of_document(&doc)?;
                        default_namespace(&mut doc, kind, &namespace);
                        let name = doc["metadata"]["name"]
                            .as_str()
                            .filter(|n| !n.is_empty())
                            .with_context(|| format!("a {kind} document without metadata.name"))?
                            .to_string();
                        let ns = doc["metadata"]["namespace"].as_str().map(str::to_string);
                        Ok((kind, ns, name))
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?,
                (None, Some(resource), Some(name)) => {
                    let kind = kind_of_resource(&resource)?;
                    let ns = kind.namespaced().then_some(namespace);
                    vec![(kind, ns, name)]
                }
                // clap requires a file, or a resource and a name.
                _ => anyhow::bail!("name a file (-f), or a resource and a name"),
            };
            for (kind, ns, name) in targets {
                anyhow::ensure!(
                    !kind.namespaced() || ns.is_some(),
                    "{kind} {name}: metadata.namespace is required (for a ManifestWork: the cluster's name)"
                );
                // The hub's refusals name the object.
                client
                    .request(
                        Method::DELETE,
                        &object_path(kind, ns.as_deref(), &name),
                        None,
                    )
                    .await?;
                let qualified = match &ns {
                    Some(ns) => format!("{ns}/{name}"),
                    None => name.clone(),
                };
                println!("{}/{qualified} deleted", kind.plural());
            }
        }
        Command::Describe {
            what: DescribeWhat::Policy { name, namespace },
        } => {
            let policy = client
                .get_json(&object_path(Kind::Policy, Some(&namespace), &name))
                .await
                .with_context(|| format!("Policy {namespace}/{name}"))?;
            // What the failing clusters report, from their compliance records; a record not
            // there (yet, or any more) explains nothing.
            let mut records = Vec::new();
            for cluster in table::clusters_to_explain(&policy) {
                match client
                    .get_json(&object_path(
                        Kind::ClusterCompliance,
                        Some(&cluster),
                        &cluster,
                    ))
                    .await
                {
                    Ok(record) => records.push(record),
                    Err(e)
                        if e.downcast_ref::<ApiError>()
                            .is_some_and(|e| e.status == http::StatusCode::NOT_FOUND) => {}
                    Err(e) => {
                        return Err(e.context(format!("ClusterCompliance {cluster}/{cluster}")));
                    }
                }
            }
            print!(
                "{}",
                table::describe_policy(&policy, &records, jiff::Timestamp::now())
            );
        }
        Command::Apply {
            filename,
            namespace,
            max_work_bytes,
        } => {
            for mut doc in read_documents(&filename)? {
                let kind = kind_of_document(&doc)?;
                default_namespace(&mut doc, kind, &namespace);
                let (doc, how) = store_chunks(&client, doc, max_work_bytes).await?;
                let verb = upsert(&client, kind, doc.clone(), true).await?;
                println!("{}/{} {verb}{how}", kind.plural(), qualified(&doc));
            }
        }
        Command::Work {
            action:
                WorkAction::Create {
                    name,
                    filename,
                    clusters,
                    placement,
                    overwrite,
                    max_work_bytes,
                },
        } => {
            let manifests = read_documents(&filename)?;
            anyhow::ensure!(
                !manifests.is_empty(),
                "{} holds no manifests",
                filename.display()
            );
            if let Some(placement) = placement {
                let (ns, placement) = namespaced_name(&placement, "--placement")?;
                // Before anything is stored: the set's template is one object.
                flotilla_cli::cli::check_replica_set_size(&name, &ns, &manifests)?;
                client
                    .get_json(&object_path(Kind::Placement, Some(&ns), &placement))
                    .await
                    .with_context(|| format!("--placement {ns}/{placement}"))?;
                let set = replica_set(&name, &ns, &placement, &manifests);
                let verb = upsert(&client, Kind::ManifestWorkReplicaSet, set, overwrite)
                    .await
                    .with_context(|| format!("ManifestWorkReplicaSet {ns}/{name}"))?;
                println!(
                    "manifestworkreplicaset {ns}/{name} {verb}: ManifestWork {name} follows placement {ns}/{placement}"
                );
            }
            for cluster in &clusters {
                let work = manifest_work(&name, cluster, &manifests);
                let (work, how) = store_chunks(&client, work, max_work_bytes).await?;
                // upsert's errors name the work already.
                let verb = upsert(&client, Kind::ManifestWork, work, overwrite).await?;
                println!("manifestwork {cluster}/{name} {verb}{how}");
            }
        }
        Command::Token { action } => token(&client, action).await?,
        Command::Cluster { action } => cluster(&client, action).await?,
        Command::Dashboard { port, address } => {
            let listener =
                flotilla_cli::dashboard::bind(std::net::SocketAddr::new(address, port)).await?;
            let bound = listener.local_addr()?;
            println!("Starting to serve on {bound}");
            println!("Fleet status page: http://{bound}/ui/");
            flotilla_cli::dashboard::serve(listener, std::sync::Arc::new(client), async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await?;
        }
        Command::Ca { action } => {
            let (method, path) = match action {
                CaAction::Show => (Method::GET, "/registration/v1/ca"),
                CaAction::Rotate => (Method::POST, "/registration/v1/ca/rotate"),
                CaAction::FinishRotation => (Method::POST, "/registration/v1/ca/finish-rotation"),
            };
            let (_, ca) = client.request(method, path, None).await?;
            println!("fingerprint: {}", ca["fingerprint"].as_str().unwrap_or(""));
            println!(
                "rotation:    {}",
                if ca["rotating"].as_bool() == Some(true) {
                    "in progress (old and new CA trusted)"
                } else {
                    "none"
                }
            );
        }
        Command::User {
            action:
                UserAction::Create {
                    name,
                    groups,
                    lifetime,
                    out,
                },
        } => {
            let dir = flotilla_cli::cli::user_dir(&cli.config, &name);
            let key = rcgen::KeyPair::generate()?;
            let mut params = rcgen::CertificateParams::default();
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, name.as_str());
            let csr = params.serialize_request(&key)?.pem()?;
            let (_, issued) = client
                .request(
                    Method::POST,
                    "/registration/v1/users",
                    Some(&serde_json::json!({
                        "user": name, "groups": groups, "csr": csr,
                        "lifetimeSeconds": lifetime.as_secs(),
                    })),
                )
                .await?;
            let text = |field: &str| {
                issued[field]
                    .as_str()
                    .map(str::to_string)
                    .with_context(|| format!("the hub's answer has no {field}"))
            };
            flotilla_cli::cli::write_credentials(
                &dir,
                &text("ca")?,
                &text("certificate")?,
                &key.serialize_pem(),
            )?;
            println!("user {name} created; credentials in {}", dir.display());
            let clusters = fleet_clusters(&client).await?;
            let out = out.unwrap_or_else(|| PathBuf::from(format!("{name}.kubeconfig")));
            write_kubeconfig(&cli.config, &client, Some(&name), &clusters, Some(&out))?;
        }
        Command::Kubeconfig {
            cluster,
            all,
            user,
            out,
        } => {
            let clusters = if all {
                fleet_clusters(&client).await?
            } else {
                cluster
            };
            write_kubeconfig(
                &cli.config,
                &client,
                user.as_deref(),
                &clusters,
                out.as_deref(),
            )?;
        }
        Command::Work {
            action:
                WorkAction::Delete {
                    name,
                    clusters,
                    placement,
                },
        } => {
            if let Some(placement) = placement {
                let (ns, _) = namespaced_name(&placement, "--placement")?;
                client
                    .request(
                        Method::DELETE,
                        &object_path(Kind::ManifestWorkReplicaSet, Some(&ns), &name),
                        None,
                    )
                    .await?;
                println!(
                    "manifestworkreplicaset {ns}/{name} deleted (its ManifestWorks go with it)"
                );
            }
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

/// The names of every cluster of the fleet, sorted.
async fn fleet_clusters(client: &OperatorClient) -> anyhow::Result<Vec<String>> {
    let list = client
        .get_json(&collection_path(Kind::ManagedCluster, None))
        .await?;
    let mut names: Vec<String> = list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["metadata"]["name"].as_str().map(str::to_string))
        .collect();
    names.sort();
    Ok(names)
}

/// Writes (or prints) a kubeconfig reaching `clusters` through the proxy front as `user`.
fn write_kubeconfig(
    config: &std::path::Path,
    client: &OperatorClient,
    user: Option<&str>,
    clusters: &[String],
    out: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let proxy = client.proxy_server().with_context(|| {
        format!(
            "the hub at {} serves no proxy front; start flotilla-hub with --proxy-listen",
            client.address()
        )
    })?;
    let (user, dir) = flotilla_cli::cli::find_user(config, user)?;
    let kubeconfig = flotilla_cli::cli::kubeconfig(proxy, &user, &dir, clusters);
    let text = yaml_serde::to_string(&kubeconfig)?;
    match out {
        Some(path) => {
            flotilla_cli::cli::write_file(path, &text, Access::Private)?;
            println!(
                "kubeconfig for user {user} with {} context(s) written to {} (kubectl --kubeconfig {} get namespaces)",
                clusters.len(),
                path.display(),
                path.display()
            );
        }
        None => print!("{text}"),
    }
    Ok(())
}

async fn token(client: &OperatorClient, action: TokenAction) -> anyhow::Result<()> {
    match action {
        TokenAction::Create {
            ttl,
            uses,
            auto_accept_labels,
            auto_accept,
            cluster_name,
            output,
        } => {
            let mut labels = serde_json::Map::new();
            for pair in auto_accept_labels.iter().filter(|p| !p.is_empty()) {
                let (k, v) = pair
                    .split_once('=')
                    .with_context(|| format!("--auto-accept-labels: {pair:?} is not key=value"))?;
                labels.insert(k.to_string(), Value::String(v.to_string()));
            }
            let body = serde_json::json!({
                "ttlSeconds": ttl.as_secs().max(1),
                "uses": uses,
                "autoAccept": auto_accept,
                "labels": labels,
            });
            let (_, mut created) = client
                .request(Method::POST, "/registration/v1/tokens", Some(&body))
                .await?;
            if let Some(name) = cluster_name
                && let Some(cmd) = created["joinCommand"].as_str()
            {
                created["joinCommand"] = Value::String(cmd.replace("<cluster-name>", &name));
            }
            match output {
                Output::Json => println!("{}", serde_json::to_string_pretty(&created)?),
                Output::Yaml => print!("{}", yaml_serde::to_string(&created)?),
                Output::Table => {
                    println!(
                        "token {} created, expires {}",
                        created["id"].as_str().unwrap_or(""),
                        created["expires"].as_str().unwrap_or("")
                    );
                    println!("run this on the spoke cluster to ask to join:\n");
                    println!("{}", created["joinCommand"].as_str().unwrap_or(""));
                }
            }
        }
        TokenAction::List { output } => {
            let list = client.get_json("/registration/v1/tokens").await?;
            match output {
                Output::Json => println!("{}", serde_json::to_string_pretty(&list)?),
                Output::Yaml => print!("{}", yaml_serde::to_string(&list)?),
                Output::Table => {
                    let items = list["items"].as_array().cloned().unwrap_or_default();
                    print!("{}", table::tokens(&items, jiff::Timestamp::now()));
                }
            }
        }
        TokenAction::Revoke { id } => {
            client
                .request(
                    Method::DELETE,
                    &format!("/registration/v1/tokens/{id}"),
                    None,
                )
                .await?;
            println!("token {id} revoked");
        }
    }
    Ok(())
}

async fn cluster(client: &OperatorClient, action: ClusterAction) -> anyhow::Result<()> {
    match action {
        ClusterAction::Accept { names } => {
            for name in names {
                client
                    .request(
                        Method::POST,
                        &format!("/registration/v1/clusters/{name}/accept"),
                        Some(&serde_json::json!({})),
                    )
                    .await
                    .with_context(|| format!("accepting cluster {name}"))?;
                println!("cluster {name} accepted");
            }
        }
        ClusterAction::Deny { names, reason } => {
            for name in names {
                client
                    .request(
                        Method::POST,
                        &format!("/registration/v1/clusters/{name}/deny"),
                        Some(&serde_json::json!({ "reason": reason })),
                    )
                    .await
                    .with_context(|| format!("denying cluster {name}"))?;
                println!("cluster {name} denied");
            }
        }
        ClusterAction::Label {
            name,
            changes,
            overwrite,
        } => {
            let changes = parse_label_changes(&changes)?;
            let changed = modify_cluster(client, &name, |mc| {
                apply_label_changes(mc, &changes, overwrite)
            })
            .await?;
            println!(
                "cluster {name} {}",
                if changed {
                    "labeled"
                } else {
                    "not labeled (no change)"
                }
            );
        }
        ClusterAction::Taint { name, changes } => {
            let changes = parse_taint_changes(&changes)?;
            let now = jiff::Timestamp::now()
                .strftime("%Y-%m-%dT%H:%M:%SZ")
                .to_string();
            let changed =
                modify_cluster(client, &name, |mc| apply_taint_changes(mc, &changes, &now)).await?;
            println!(
                "cluster {name} {}",
                if changed {
                    "tainted"
                } else {
                    "not tainted (no change)"
                }
            );
        }
        ClusterAction::Decommission {
            name,
            policy,
            timeout,
        } => {
            let mut say = |line: String| println!("{line}");
            flotilla_cli::decommission::run(client, &name, policy, timeout, &mut say).await?;
        }
        ClusterAction::Delete { names } => {
            for name in names {
                client
                    .request(
                        Method::DELETE,
                        &object_path(Kind::ManagedCluster, None, &name),
                        None,
                    )
                    .await
                    .with_context(|| format!("deleting cluster {name}"))?;
                println!("cluster {name} deleted");
            }
        }
    }
    Ok(())
}

/// A ManifestWork over the store's object limit: stores its chunks (those already stored, by
/// this work or another with the same content, are kept) and returns the work with its
/// reference in place of the manifests, and how it was stored in words. Anything else is
/// returned as it is.
async fn store_chunks(
    client: &OperatorClient,
    doc: Value,
    cap: u64,
) -> anyhow::Result<(Value, String)> {
    let Some((work, reference, chunks)) = flotilla_cli::cli::chunked_work(&doc, cap)? else {
        return Ok((doc, String::new()));
    };
    let ns = work["metadata"]["namespace"]
        .as_str()
        .context("a ManifestWork needs metadata.namespace (the cluster's name)")?
        .to_string();
    for chunk in &chunks {
        let object = flotilla_proto::api::content::chunk_object(&ns, chunk);
        match client
            .request(
                Method::POST,
                &collection_path(Kind::ManifestChunk, Some(&ns)),
                Some(&object),
            )
            .await
        {
            Ok(_) => {}
            // Content-addressed: the one stored under this name holds these very bytes. It
            // may be a chunk no work names any more, waiting out its grace before the hub
            // collects it: marked as stored now, its grace starts again, so it outlives the
            // creation of this work.
            Err(e)
                if e.downcast_ref::<ApiError>()
                    .is_some_and(|api| api.status == StatusCode::CONFLICT) =>
            {
                let mut object = object;
                object["metadata"]["annotations"] = serde_json::json!({
                    flotilla_proto::api::content::STORED_AT_ANNOTATION:
                        jiff::Timestamp::now().to_string(),
                });
                let name = flotilla_proto::api::content::chunk_object_name(&chunk.sha256);
                client
                    .request(
                        Method::PUT,
                        &object_path(Kind::ManifestChunk, Some(&ns), &name),
                        Some(&object),
                    )
                    .await
                    .with_context(|| {
                        format!(
                            "ManifestWork {}: marking the stored chunk {ns}/{name} as stored again",
                            qualified(&work)
                        )
                    })?;
            }
            Err(e) => {
                return Err(e.context(format!(
                    "ManifestWork {ns}/{}: storing chunk {}",
                    qualified(&work),
                    chunk.sha256
                )));
            }
        }
    }
    let how = format!(
        " (chunked: {} bytes of manifests in {} ManifestChunks of at most {} bytes, content sha256:{})",
        reference.bytes,
        chunks.len(),
        flotilla_proto::api::content::CHUNK_BYTES,
        reference.sha256
    );
    Ok((work, how))
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
            // The hub's messages name the object; a failure to reach it does not.
            Some(_) => Err(e),
            None => Err(e.context(format!("{kind} {}", qualified(&doc)))),
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
    print_list_with(list, output, render)
}

fn print_list_with(
    list: &Value,
    output: Output,
    render: impl Fn(&[Value], jiff::Timestamp) -> String,
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
