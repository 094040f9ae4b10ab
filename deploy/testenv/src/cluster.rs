//! A [`TestEnv`] with a cluster behind it: kube-controller-manager, kube-scheduler and kwok's
//! simulated kubelets on real Node objects, so workloads behave as on a real spoke. Pods are
//! scheduled, run and become Ready, Deployments become Available, Jobs complete, namespaces are
//! finalized and owned objects garbage-collected, all by Kubernetes' own controllers; only the
//! containers are not real (kwok writes the status a kubelet would).
//!
//! kwok also serves the kubelet API of its nodes, over TLS with a certificate the apiserver
//! verifies, so `kubectl logs`, `logs -f`, `attach` and `exec` work on the cluster's pods through
//! the apiserver as on a real cluster. What is behind them is this machine: every container's log
//! is one file the test appends to ([`TestCluster::append_container_log`]), and `exec` runs the
//! command as a real process of this user in [`TestCluster::exec_dir`], with the caller's stdin,
//! stdout and stderr; `port-forward` to any port of any pod reaches
//! [`TestCluster::port_forward_target`], where the test listens. kwok checks no credentials of
//! its caller (a real kubelet would authenticate
//! and authorize the apiserver's client certificate).

use std::io::Write as _;
use std::net::{Ipv4Addr, TcpListener};
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{Node, ServiceAccount};
use kube::Api;
use kube::api::PostParams;
use tokio::time::Instant;

use crate::process::ChildProcess;
use crate::{LOG_TAIL_LINES, POLL_INTERVAL, TestEnv, build_script};

/// The annotation kwok selects the nodes it plays the kubelet of by (`=fake`), as kwok's own
/// documentation marks them.
pub const KWOK_NODE_ANNOTATION: &str = "kwok.x-k8s.io/node";
/// How long the controllers and kwok may take to make the cluster usable: every node Ready and
/// the `default` ServiceAccount made. A few seconds on an idle machine; the margin is for a
/// loaded 2-core runner starting several clusters at once.
const CLUSTER_READY_TIMEOUT: Duration = Duration::from_secs(90);
/// The controllers a spoke's workloads need, and nothing that needs a cloud or real volumes:
/// Deployments and their ReplicaSets, Jobs, namespace deletion, owner-reference garbage
/// collection, the ServiceAccounts (with their tokens and the root CA ConfigMap) that pod
/// admission requires, and node lifecycle, which lifts the `not-ready` taint the apiserver puts on
/// every new Node once kwok reports it Ready (no pod is scheduled onto a node before that).
const CONTROLLERS: &[&str] = &[
    "node-lifecycle-controller",
    "deployment-controller",
    "replicaset-controller",
    "job-controller",
    "namespace-controller",
    "garbage-collector-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
];

/// An apiserver and etcd ([`TestEnv`], which this dereferences to) plus the controller-manager,
/// the scheduler and kwok managing `nodes` Nodes; everything stops on drop.
pub struct TestCluster {
    // `Drop::drop` stops these before `env` (and its directory, which holds their logs) goes.
    controller_manager: ChildProcess,
    scheduler: ChildProcess,
    kwok: ChildProcess,
    nodes: Vec<String>,
    /// The file every container's log is read from (the CRI log format kubelets read).
    container_log: PathBuf,
    /// Where `exec`'s commands run.
    exec_dir: PathBuf,
    /// Where `port-forward` to any pod's port goes.
    port_forward_target: std::net::SocketAddr,
    env: TestEnv,
}

impl TestCluster {
    /// Starts a cluster with two nodes (`kwok-node-0`, `kwok-node-1`).
    pub async fn start() -> anyhow::Result<TestCluster> {
        TestCluster::start_with_nodes(2).await
    }

    /// Builds the extra binaries if this machine lacks them (`build.sh --spoke`), starts a
    /// [`TestEnv`], then the controller-manager, the scheduler and kwok, creates `nodes` Nodes,
    /// and returns once every node is Ready and the `default` namespace has its ServiceAccount.
    pub async fn start_with_nodes(nodes: usize) -> anyhow::Result<TestCluster> {
        let bin = spoke_binaries().await?;
        let env = TestEnv::start().await?;
        let dir = env.workdir().to_path_buf();
        let kubeconfig = env.kubeconfig_path().display().to_string();
        let pki = dir.join("pki");
        let container_log = dir.join("containers.log");
        std::fs::File::create(&container_log).context("creating the container log")?;
        let exec_dir = dir.join("exec");
        std::fs::create_dir(&exec_dir).context("creating the exec directory")?;
        // Both picked free, then given to kwok; another process may take one in between: then
        // kwok exits and `wait_ready` says so with its log, or the test's bind fails.
        let kubelet_port = free_port().context("picking a port for the kubelet API")?;
        let port_forward_target = std::net::SocketAddr::from((
            Ipv4Addr::LOCALHOST,
            free_port().context("picking a port for port-forward")?,
        ));
        let kubelet_config = dir.join("kwok-kubelet.yaml");
        std::fs::write(
            &kubelet_config,
            kubelet_config_yaml(&container_log, &exec_dir, port_forward_target),
        )
        .context("writing kwok's kubelet configuration")?;

        let controllers = CONTROLLERS.join(",");
        let controller_manager = ChildProcess::spawn(
            "kube-controller-manager",
            &bin.join("kube-controller-manager"),
            &[
                format!("--kubeconfig={kubeconfig}"),
                // One instance per cluster: electing a leader would only delay the start.
                "--leader-elect=false".to_owned(),
                // No health endpoint to serve: readiness is judged by what the controllers do.
                "--secure-port=0".to_owned(),
                format!("--controllers={controllers}"),
                format!(
                    "--service-account-private-key-file={}",
                    pki.join("service-account.key").display()
                ),
                format!("--root-ca-file={}", pki.join("serving-ca.crt").display()),
                "--profiling=false".to_owned(),
            ],
            dir.join("kube-controller-manager.log"),
        )?;
        let scheduler = ChildProcess::spawn(
            "kube-scheduler",
            &bin.join("kube-scheduler"),
            &[
                format!("--kubeconfig={kubeconfig}"),
                "--leader-elect=false".to_owned(),
                "--secure-port=0".to_owned(),
                "--profiling=false".to_owned(),
            ],
            dir.join("kube-scheduler.log"),
        )?;
        let kwok = ChildProcess::spawn(
            "kwok",
            &bin.join("kwok"),
            &[
                format!("--kubeconfig={kubeconfig}"),
                format!("--config={}", bin.join("kwok-stages.yaml").display()),
                format!("--config={}", kubelet_config.display()),
                "--manage-all-nodes=false".to_owned(),
                format!("--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake"),
                // Pod IPs come from here; nothing routes to them.
                "--cidr=10.0.128.0/17".to_owned(),
                // Every node's InternalIP, where the apiserver dials its kubelet API
                // (`--kubelet-preferred-address-types=InternalIP`) on the port the node-initialize
                // stage writes into `status.daemonEndpoints`.
                "--node-ip=127.0.0.1".to_owned(),
                format!("--node-port={kubelet_port}"),
                format!("--server-address=127.0.0.1:{kubelet_port}"),
                format!(
                    "--tls-cert-file={}",
                    pki.join("kubelet-serving.crt").display()
                ),
                format!(
                    "--tls-private-key-file={}",
                    pki.join("kubelet-serving.key").display()
                ),
                "--node-lease-duration-seconds=40".to_owned(),
            ],
            dir.join("kwok.log"),
        )?;
        let mut cluster = TestCluster {
            controller_manager,
            scheduler,
            kwok,
            nodes: (0..nodes).map(|i| format!("kwok-node-{i}")).collect(),
            container_log,
            exec_dir,
            port_forward_target,
            env,
        };
        let started = Instant::now();
        cluster.create_nodes().await?;
        cluster.wait_ready().await?;
        tracing::info!(elapsed = ?started.elapsed(), nodes, "test cluster ready");
        Ok(cluster)
    }

    /// The names of the nodes kwok manages.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// Appends `line` to the log of every container on the cluster, which `kubectl logs` shows
    /// and `kubectl logs -f` and `attach` follow, as written to stdout now.
    pub fn append_container_log(&self, line: &str) -> anyhow::Result<()> {
        // The CRI format kubelets read container logs in: time, stream, F(ull line), the line.
        let entry = format!("{} stdout F {line}\n", jiff::Timestamp::now());
        std::fs::OpenOptions::new()
            .append(true)
            .open(&self.container_log)
            .and_then(|mut f| f.write_all(entry.as_bytes()))
            .with_context(|| format!("appending to {}", self.container_log.display()))
    }

    /// The directory the commands of `kubectl exec` (and `cp`) into any pod of the cluster run
    /// in, as processes of this machine.
    pub fn exec_dir(&self) -> &Path {
        &self.exec_dir
    }

    /// Where `kubectl port-forward` to any port of any pod of the cluster connects: a loopback
    /// address nothing listens on until the test binds it.
    pub fn port_forward_target(&self) -> std::net::SocketAddr {
        self.port_forward_target
    }

    /// Each process's name and id, the apiserver's and etcd's included, e.g. to check that all are
    /// gone after drop.
    pub fn pids(&self) -> Vec<(&'static str, u32)> {
        [
            &self.controller_manager,
            &self.scheduler,
            &self.kwok,
            &self.env.apiserver,
            &self.env.etcd,
        ]
        .iter()
        .map(|p| (p.name(), p.pid()))
        .collect()
    }

    /// The last lines of each cluster process's log, for a failing test's message (the whole
    /// logs are in [`TestEnv::workdir`]).
    pub fn log_tails(&self) -> String {
        [
            &self.controller_manager,
            &self.scheduler,
            &self.kwok,
            &self.env.apiserver,
        ]
        .iter()
        .map(|p| {
            format!(
                "--- last lines of {}'s log ---\n{}",
                p.name(),
                p.log_tail(LOG_TAIL_LINES)
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
    }

    async fn create_nodes(&self) -> anyhow::Result<()> {
        let api: Api<Node> = Api::all(self.env.client().await?);
        for name in &self.nodes {
            let node: Node = serde_json::from_value(serde_json::json!({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {KWOK_NODE_ANNOTATION: "fake"},
                    "labels": {
                        "kubernetes.io/hostname": name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "type": "kwok",
                    },
                },
            }))?;
            api.create(&PostParams::default(), &node)
                .await
                .with_context(|| format!("creating node {name}"))?;
        }
        Ok(())
    }

    /// Waits until every node is Ready (kwok runs) and namespace `default` has its
    /// ServiceAccount (the controller-manager runs), failing early if a process exits.
    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let client = self.env.client().await?;
        let nodes: Api<Node> = Api::all(client.clone());
        let accounts: Api<ServiceAccount> = Api::namespaced(client, "default");
        let deadline = Instant::now() + CLUSTER_READY_TIMEOUT;
        loop {
            for process in [
                &mut self.controller_manager,
                &mut self.scheduler,
                &mut self.kwok,
            ] {
                if let Some(status) = process.try_exited()? {
                    bail!(
                        "{} exited ({status}) while the cluster started\n--- last lines of its log ---\n{}",
                        process.name(),
                        process.log_tail(LOG_TAIL_LINES)
                    );
                }
            }
            let mut waiting = Vec::new();
            for name in &self.nodes {
                let ready = nodes.get_opt(name).await?.is_some_and(|node| {
                    node.status
                        .and_then(|s| s.conditions)
                        .unwrap_or_default()
                        .iter()
                        .any(|c| c.type_ == "Ready" && c.status == "True")
                });
                if !ready {
                    waiting.push(format!("node {name} Ready"));
                }
            }
            if accounts.get_opt("default").await?.is_none() {
                waiting.push("serviceaccount default/default".to_owned());
            }
            if waiting.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "the test cluster was not ready after {CLUSTER_READY_TIMEOUT:?}; still waiting for {}\n{}",
                    waiting.join(", "),
                    self.log_tails()
                );
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }
}

impl Deref for TestCluster {
    type Target = TestEnv;

    fn deref(&self) -> &TestEnv {
        &self.env
    }
}

impl std::ops::DerefMut for TestCluster {
    fn deref_mut(&mut self) -> &mut TestEnv {
        &mut self.env
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        // All three at once, then wait: each exits on SIGTERM within a second or two, so the
        // grace periods need not add up. kwok first so no node status is written to a stopping
        // apiserver; the apiserver and etcd stop after, when `env` drops.
        for process in [
            &mut self.kwok,
            &mut self.scheduler,
            &mut self.controller_manager,
        ] {
            process.terminate();
        }
        self.kwok.stop();
        self.scheduler.stop();
        self.controller_manager.stop();
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

/// kwok's kubelet API for every pod on its nodes (its `Cluster*` kinds with no selector match
/// all pods): logs and attach read `container_log`, exec runs the requested command in
/// `exec_dir`, port-forward to any port connects to `forward_to`.
fn kubelet_config_yaml(
    container_log: &Path,
    exec_dir: &Path,
    forward_to: std::net::SocketAddr,
) -> String {
    let forward_address = forward_to.ip();
    let forward_port = forward_to.port();
    let log = serde_json::Value::from(container_log.display().to_string());
    let dir = serde_json::Value::from(exec_dir.display().to_string());
    // JSON strings are YAML strings, quoted whatever the path holds.
    format!(
        "apiVersion: kwok.x-k8s.io/v1alpha1
kind: ClusterLogs
metadata:
  name: container-log
spec:
  logs:
  - logsFile: {log}
    follow: true
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: ClusterAttach
metadata:
  name: container-log
spec:
  attaches:
  - logsFile: {log}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: ClusterExec
metadata:
  name: local-command
spec:
  execs:
  - local:
      workDir: {dir}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: ClusterPortForward
metadata:
  name: local-port
spec:
  forwards:
  - target:
      address: \"{forward_address}\"
      port: {forward_port}
"
    )
}

/// The directory holding kube-controller-manager, kube-scheduler, kwok and kwok's stages,
/// built on first use (`build.sh --spoke`, at most once per process).
async fn spoke_binaries() -> anyhow::Result<&'static Path> {
    static BINARIES: tokio::sync::OnceCell<PathBuf> = tokio::sync::OnceCell::const_new();
    let dir = BINARIES
        .get_or_try_init(|| {
            build_script(
                &["--spoke"],
                &[
                    "kube-controller-manager",
                    "kube-scheduler",
                    "kwok",
                    "kwok-stages.yaml",
                ],
            )
        })
        .await?;
    Ok(dir)
}
