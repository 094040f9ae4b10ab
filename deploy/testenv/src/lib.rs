//! A real Kubernetes API for flotilla's tests: one etcd and one kube-apiserver per [`TestEnv`],
//! started on free loopback ports in a private temporary directory, with generated certificates,
//! an admin kubeconfig that real `kubectl` and kube-rs both use, and cleanup on drop.
//!
//! What it is for: tests that need the API machinery to behave exactly as in production (CRD
//! validation, server-side apply, resource versions, watches, RBAC, metrics). A test can start
//! several environments side by side, e.g. one hub and several spoke clusters.
//!
//! What a [`TestEnv`] is not: a cluster. There is no kubelet, scheduler or controller-manager, so
//! pods never run, Deployments never get ReplicaSets, namespaces stay `Terminating` once deleted
//! (no namespace controller), nothing is garbage-collected, and no namespace gets a `default`
//! ServiceAccount. A [`TestCluster`] is one: the same apiserver and etcd with
//! kube-controller-manager, kube-scheduler and kwok's simulated kubelets behind them, slower to
//! build (once) and to start, for tests whose workloads must really run. Neither is for
//! production code: it is a dev-dependency of the crates' tests, and a dependency of the load-test
//! harness (`flotilla-loadtest --store kube`), a development tool itself.
//!
//! Beside it, [`wait_for`]: the one poller every crate's tests wait with (on the condition,
//! with a deadline).
//!
//! The binaries are built from their Go modules by `deploy/testenv/build.sh` (`--spoke` for a
//! [`TestCluster`]'s) the first time a process needs them (minutes, once per machine; then cached
//! outside the clone).
//!
//! Cleanup: dropping a [`TestEnv`] (also while a test panics and unwinds) stops and reaps both
//! processes and removes the directory. A test process that is SIGKILLed cannot clean up, and its
//! servers keep running; that is why CI checks for stray `etcd`/`kube-apiserver` processes.

#![forbid(unsafe_code)]

mod cluster;
mod pki;
mod poll;
mod process;

use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde::Deserialize as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::time::Instant;
use tracing::instrument::WithSubscriber as _;

pub use cluster::{KWOK_NODE_ANNOTATION, TestCluster};
pub use pki::{ADMIN_GROUP, ADMIN_USER};
pub use poll::wait_for;

use crate::pki::Pki;
use crate::process::ChildProcess;

/// How long etcd may take to answer `/health`.
const ETCD_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long kube-apiserver may take to report `/readyz` ok. It needs about 2 s on an idle machine;
/// the margin is for a loaded 2-core CI runner starting several at once.
const APISERVER_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a CRD may take to become Established.
const CRD_ESTABLISHED_TIMEOUT: Duration = Duration::from_secs(30);
/// How often readiness is polled.
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// Starts retried when a port picked as free was taken before the server bound it.
const START_ATTEMPTS: usize = 3;
/// Log lines shown when a server fails to start.
const LOG_TAIL_LINES: usize = 40;
/// The field manager for server-side apply of CRDs.
const FIELD_MANAGER: &str = "flotilla-testenv";

/// One etcd and one kube-apiserver, running until dropped.
pub struct TestEnv {
    // `Drop::drop` stops both processes before any field is dropped, so `workdir` is removed only
    // once nothing writes to it any more.
    apiserver: ChildProcess,
    etcd: ChildProcess,
    server_url: String,
    kubeconfig_path: PathBuf,
    /// The kubeconfig, parsed once; every client is built from it.
    config: kube::Config,
    /// Data, certificates, kubeconfig and logs (`etcd.log`, `kube-apiserver.log`).
    workdir: tempfile::TempDir,
    /// The kube-apiserver binary and its flags, to start it again on the same port and etcd.
    apiserver_command: (PathBuf, Vec<String>),
    /// Starts of kube-apiserver so far; each start after the first logs to its own file.
    apiserver_starts: usize,
}

impl TestEnv {
    /// Builds the binaries if this machine lacks them, starts etcd and then kube-apiserver, and
    /// returns once the apiserver is ready and the `default` namespace exists.
    pub async fn start() -> anyhow::Result<TestEnv> {
        TestEnv::start_serving(&[]).await
    }

    /// [`TestEnv::start`] with `addresses` in the serving certificate beside 127.0.0.1, for
    /// clients that reach the apiserver through a relay on another address of this machine
    /// (the load test's gateways in network namespaces). The apiserver itself listens on
    /// loopback only.
    pub async fn start_serving(addresses: &[std::net::IpAddr]) -> anyhow::Result<TestEnv> {
        let bin = binaries().await?;
        let mut attempt = 1;
        loop {
            match start_once(bin, addresses).await {
                Ok(env) => return Ok(env),
                Err(StartError::PortTaken(err)) if attempt < START_ATTEMPTS => {
                    tracing::warn!(attempt, error = %format!("{err:#}"), "port taken; retrying");
                    attempt += 1;
                }
                Err(StartError::PortTaken(err) | StartError::Other(err)) => return Err(err),
            }
        }
    }

    /// An admin kubeconfig (client certificate in group `system:masters`, the real serving CA).
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig_path
    }

    /// `https://127.0.0.1:<port>`.
    pub fn server_url(&self) -> &str {
        &self.server_url
    }

    /// A client built from [`TestEnv::kubeconfig_path`], exactly as kubectl would read it.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        kube::Client::try_from(self.config.clone()).context("building a kube client")
    }

    /// Applies every CustomResourceDefinition in the `*.yaml`/`*.yml` files of `dir` (files may
    /// hold several documents; documents of other kinds are skipped), then waits until each is
    /// Established, so the caller can use the new resources at once.
    pub async fn install_crds(&self, dir: &Path) -> anyhow::Result<()> {
        let crds = read_crds(dir)?;
        let api: Api<CustomResourceDefinition> = Api::all(self.client().await?);
        let params = PatchParams::apply(FIELD_MANAGER).force();
        for crd in &crds {
            let name = crd.metadata.name.as_deref().unwrap_or_default();
            api.patch(name, &params, &Patch::Apply(crd))
                .await
                .with_context(|| format!("applying CRD {name}"))?;
        }
        let deadline = Instant::now() + CRD_ESTABLISHED_TIMEOUT;
        for crd in &crds {
            let name = crd.metadata.name.as_deref().unwrap_or_default();
            loop {
                let current = api.get(name).await?;
                if is_established(&current) {
                    break;
                }
                if Instant::now() >= deadline {
                    bail!(
                        "CRD {name} not Established after {CRD_ESTABLISHED_TIMEOUT:?}; conditions: {:?}",
                        current.status.and_then(|s| s.conditions)
                    );
                }
                tokio::time::sleep(POLL_INTERVAL).await;
            }
        }
        Ok(())
    }

    /// `kubectl --kubeconfig <path>`, ready for arguments.
    pub fn kubectl(&self) -> std::process::Command {
        let mut cmd = std::process::Command::new("kubectl");
        cmd.arg("--kubeconfig").arg(&self.kubeconfig_path);
        cmd
    }

    /// The apiserver's `GET /metrics` text (Prometheus exposition format).
    pub async fn metrics(&self) -> anyhow::Result<String> {
        self.get_text("/metrics").await
    }

    /// Stops kube-apiserver (SIGTERM, then SIGKILL after a grace period) and waits until it has
    /// exited; etcd keeps running. Blocking, as dropping does.
    pub fn stop_apiserver(&mut self) {
        self.apiserver.stop();
    }

    /// Starts kube-apiserver again with the same flags, port, certificates and etcd, and waits
    /// until it is ready; its log is `kube-apiserver-<n>.log`. Clients keep their kubeconfig.
    pub async fn start_apiserver(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.etcd.try_exited()? {
            bail!(
                "etcd exited ({status}), so kube-apiserver cannot start again\n--- last lines of its log ---\n{}",
                self.etcd.log_tail(LOG_TAIL_LINES)
            );
        }
        self.apiserver_starts += 1;
        let (program, args) = &self.apiserver_command;
        let log = self
            .workdir
            .path()
            .join(format!("kube-apiserver-{}.log", self.apiserver_starts));
        // The old process is reaped by `stop`; stopping it again is a no-op.
        self.apiserver.stop();
        self.apiserver = ChildProcess::spawn("kube-apiserver", program, args, log)?;
        let client = self.client().await?;
        wait_apiserver_ready(&mut self.apiserver, &client)
            .await
            .map_err(|e| match e {
                StartError::PortTaken(e) | StartError::Other(e) => e.context(format!(
                    "starting kube-apiserver again on {}",
                    self.server_url
                )),
            })
    }

    /// The kube-apiserver's process id, e.g. to check that it is gone after drop.
    pub fn apiserver_pid(&self) -> u32 {
        self.apiserver.pid()
    }

    /// etcd's process id.
    pub fn etcd_pid(&self) -> u32 {
        self.etcd.pid()
    }

    /// The private directory; it holds `kube-apiserver.log` and `etcd.log` for debugging.
    pub fn workdir(&self) -> &Path {
        self.workdir.path()
    }

    async fn get_text(&self, path: &str) -> anyhow::Result<String> {
        let request = http::Request::get(path).body(Vec::new())?;
        let client = self.client().await?;
        client
            .request_text(request)
            .await
            .with_context(|| format!("GET {path} on {}", self.server_url))
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        // The apiserver first: its shutdown still writes to etcd (it removes itself from the
        // `kubernetes` Service's endpoints), and would wait out its grace period without etcd.
        self.apiserver.stop();
        self.etcd.stop();
    }
}

/// The repository root, e.g. for `workspace_root().join("deploy/crds")`.
///
/// Found when first asked, from where this process runs: the package cargo runs it for
/// (`CARGO_MANIFEST_DIR` at run time, set by `cargo test` and `cargo run`), else the current
/// directory, else the checkout this crate was compiled in. Run time first because one target
/// directory serves several checkouts (a CI clone, a worktree): a path fixed at compile time
/// can name a checkout that has since gone, and cargo does not rebuild a crate that moved.
pub fn workspace_root() -> PathBuf {
    static ROOT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    ROOT.get_or_init(|| {
        let compiled_in = Path::new(env!("CARGO_MANIFEST_DIR"))
            .ancestors()
            .nth(2)
            .expect("deploy/testenv sits two levels below the repository root")
            .to_path_buf();
        [
            std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from),
            std::env::current_dir().ok(),
        ]
        .into_iter()
        .flatten()
        .find_map(|start| {
            start
                .ancestors()
                .find(|dir| is_checkout(dir))
                .map(Path::to_path_buf)
        })
        .unwrap_or(compiled_in)
    })
    .clone()
}

/// Whether `dir` is the root of a flotilla checkout.
fn is_checkout(dir: &Path) -> bool {
    dir.join("Cargo.toml").is_file() && dir.join("deploy/testenv/build.sh").is_file()
}

/// The directory holding `etcd` and `kube-apiserver`, built on first use. `build.sh` runs at most
/// once per process (it is quick when the binaries exist, and serialises across processes).
async fn binaries() -> anyhow::Result<&'static Path> {
    static BINARIES: tokio::sync::OnceCell<PathBuf> = tokio::sync::OnceCell::const_new();
    let dir = BINARIES
        .get_or_try_init(|| build_script(&[], &["etcd", "kube-apiserver"]))
        .await?;
    Ok(dir)
}

/// Runs `build.sh` with `args` and returns the directory it printed last, checked to hold
/// every file of `expected`.
async fn build_script(args: &[&str], expected: &[&str]) -> anyhow::Result<PathBuf> {
    let script = workspace_root().join("deploy/testenv/build.sh");
    let started = Instant::now();
    // stderr is inherited: a first build takes minutes, and its progress should show.
    let output = tokio::process::Command::new(&script)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .output()
        .await
        .with_context(|| format!("running {}", script.display()))?;
    if !output.status.success() {
        bail!(
            "{} {} failed ({}); its output is above",
            script.display(),
            args.join(" "),
            output.status
        );
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let dir = PathBuf::from(stdout.lines().last().unwrap_or_default().trim());
    for name in expected {
        if !dir.join(name).is_file() {
            bail!("{} printed {dir:?}, which has no {name}", script.display());
        }
    }
    tracing::debug!(dir = %dir.display(), elapsed = ?started.elapsed(), "testenv binaries");
    Ok(dir)
}

enum StartError {
    /// A server could not bind a port we picked as free; another start may pick better.
    PortTaken(anyhow::Error),
    /// Anything else; retrying would fail the same way.
    Other(anyhow::Error),
}

impl<E: Into<anyhow::Error>> From<E> for StartError {
    fn from(err: E) -> StartError {
        StartError::Other(err.into())
    }
}

async fn start_once(
    bin: &Path,
    serving_addresses: &[std::net::IpAddr],
) -> Result<TestEnv, StartError> {
    let started = Instant::now();
    let workdir = tempfile::Builder::new()
        .prefix("flotilla-testenv-")
        .tempdir()
        .context("creating the testenv directory")?;
    let dir = workdir.path();
    let [etcd_port, peer_port, apiserver_port] = free_ports()?;

    // Unique per environment, so the readiness check can tell our etcd from another one.
    let etcd_name = dir
        .file_name()
        .and_then(|n| n.to_str())
        .context("temporary directory name")?
        .to_owned();
    let mut etcd = start_etcd(bin, dir, &etcd_name, etcd_port, peer_port)?;
    wait_etcd_healthy(&mut etcd, etcd_port, &etcd_name).await?;
    tracing::debug!(elapsed = ?started.elapsed(), "etcd healthy");

    let pki = Pki::generate(serving_addresses)?;
    let pki_dir = dir.join("pki");
    std::fs::create_dir(&pki_dir)?;
    let write = |name: &str, pem: &str| -> std::io::Result<String> {
        let path = pki_dir.join(name);
        std::fs::write(&path, pem)?;
        Ok(path.display().to_string())
    };
    // Not the apiserver's: the controller-manager publishes it to pods (`--root-ca-file`).
    write("serving-ca.crt", &pki.serving_ca_cert)?;
    // Not the apiserver's either: a TestCluster's kwok serves the kubelet API with them.
    write("kubelet-serving.crt", &pki.kubelet_serving_cert)?;
    write("kubelet-serving.key", &pki.kubelet_serving_key)?;
    let args = vec![
        format!("--etcd-servers=http://127.0.0.1:{etcd_port}"),
        "--bind-address=127.0.0.1".to_owned(),
        format!("--secure-port={apiserver_port}"),
        "--advertise-address=127.0.0.1".to_owned(),
        "--service-cluster-ip-range=10.0.0.0/24".to_owned(),
        "--authorization-mode=RBAC".to_owned(),
        format!(
            "--tls-cert-file={}",
            write("serving.crt", &pki.serving_cert)?
        ),
        format!(
            "--tls-private-key-file={}",
            write("serving.key", &pki.serving_key)?
        ),
        format!(
            "--client-ca-file={}",
            write("client-ca.crt", &pki.client_ca_cert)?
        ),
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local".to_owned(),
        format!(
            "--service-account-key-file={}",
            write("service-account.pub", &pki.service_account_public_key)?
        ),
        format!(
            "--service-account-signing-key-file={}",
            write("service-account.key", &pki.service_account_key)?
        ),
        // A TestCluster's kwok serves the kubelet API (logs, exec, attach, port-forward) with a
        // certificate from this CA, at the InternalIP it gives its nodes; the apiserver verifies
        // it as it would a real kubelet's. A bare TestEnv has no nodes, so it never dials one.
        format!(
            "--kubelet-certificate-authority={}",
            write("kubelet-ca.crt", &pki.kubelet_ca_cert)?
        ),
        "--kubelet-preferred-address-types=InternalIP".to_owned(),
        // Never written to (a certificate is given), but keeps any default away from the cwd.
        format!("--cert-dir={}", pki_dir.display()),
        "--profiling=false".to_owned(),
    ];
    let mut apiserver = ChildProcess::spawn(
        "kube-apiserver",
        &bin.join("kube-apiserver"),
        &args,
        dir.join("kube-apiserver.log"),
    )?;

    let server_url = format!("https://127.0.0.1:{apiserver_port}");
    let kubeconfig_path = dir.join("kubeconfig");
    std::fs::write(&kubeconfig_path, kubeconfig(&server_url, &pki)?)?;
    let kubeconfig = Kubeconfig::read_from(&kubeconfig_path).context("reading the kubeconfig")?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .context("loading the kubeconfig")?;
    let client = kube::Client::try_from(config.clone()).context("building a kube client")?;
    wait_apiserver_ready(&mut apiserver, &client).await?;

    tracing::info!(
        url = %server_url,
        dir = %dir.display(),
        elapsed = ?started.elapsed(),
        "testenv ready"
    );
    Ok(TestEnv {
        apiserver,
        etcd,
        server_url,
        kubeconfig_path,
        config,
        workdir,
        apiserver_command: (bin.join("kube-apiserver"), args),
        apiserver_starts: 1,
    })
}

/// Three distinct free loopback ports. The listeners are held until all three are picked (so they
/// differ) and then closed before the servers bind them. Another process can take a port in that
/// gap; `start` notices the bind failure in the server's log and retries with new ports.
fn free_ports() -> anyhow::Result<[u16; 3]> {
    let listeners = [(); 3].map(|()| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)));
    let mut ports = [0; 3];
    for (port, listener) in ports.iter_mut().zip(listeners) {
        *port = listener?.local_addr()?.port();
    }
    Ok(ports)
}

fn start_etcd(
    bin: &Path,
    dir: &Path,
    name: &str,
    port: u16,
    peer_port: u16,
) -> anyhow::Result<ChildProcess> {
    let client_url = format!("http://127.0.0.1:{port}");
    let peer_url = format!("http://127.0.0.1:{peer_port}");
    let args = vec![
        format!("--name={name}"),
        format!("--data-dir={}", dir.join("etcd").display()),
        format!("--listen-client-urls={client_url}"),
        format!("--advertise-client-urls={client_url}"),
        format!("--listen-peer-urls={peer_url}"),
        format!("--initial-advertise-peer-urls={peer_url}"),
        format!("--initial-cluster={name}={peer_url}"),
        // Bounds a runaway test rather than the disk.
        "--quota-backend-bytes=1073741824".to_owned(),
        // The data dies with the test: durability buys nothing, and fsync is slow on shared disks.
        "--unsafe-no-fsync".to_owned(),
        "--log-level=warn".to_owned(),
    ];
    ChildProcess::spawn("etcd", &bin.join("etcd"), &args, dir.join("etcd.log"))
}

/// Waits until etcd is healthy, and is ours: it lists a member named `name`. Without that check a
/// foreign etcd that took our client port in the gap `free_ports` leaves would pass for ours.
/// Raw HTTP/1.0 over TCP is enough for etcd's plain-HTTP client port and needs no HTTP client.
async fn wait_etcd_healthy(
    etcd: &mut ChildProcess,
    port: u16,
    name: &str,
) -> Result<(), StartError> {
    let deadline = Instant::now() + ETCD_READY_TIMEOUT;
    let mut last;
    loop {
        if let Some(status) = etcd.try_exited()? {
            return Err(start_failure("etcd", status.to_string(), etcd));
        }
        match etcd_probe(port, name).await {
            Ok(()) => return Ok(()),
            Err(err) => last = format!("{err:#}"),
        }
        if Instant::now() >= deadline {
            let why = format!("not healthy after {ETCD_READY_TIMEOUT:?} (last: {last})");
            return Err(start_failure("etcd", why, etcd));
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

async fn etcd_probe(port: u16, name: &str) -> anyhow::Result<()> {
    let members: serde_json::Value = serde_json::from_str(
        &etcd_request(
            port,
            "POST /v3/cluster/member/list HTTP/1.0\r\nContent-Type: application/json\r\n\
             Content-Length: 2\r\n\r\n{}",
        )
        .await?,
    )?;
    let names = members["members"].as_array().into_iter().flatten();
    if !names.clone().any(|m| m["name"] == name) {
        bail!("member list lacks {name}: {members}");
    }
    let health = etcd_request(port, "GET /health HTTP/1.0\r\n\r\n").await?;
    if !health.contains(r#""health":"true""#) {
        bail!("/health: {health}");
    }
    Ok(())
}

/// Sends one HTTP/1.0 request and returns the response body (the server closes the connection).
async fn etcd_request(port: u16, request: &str) -> anyhow::Result<String> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await?;
        stream.write_all(request.as_bytes()).await?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await?;
        anyhow::Ok(response)
    };
    let response = tokio::time::timeout(Duration::from_secs(2), exchange)
        .await
        .map_err(|_| anyhow::anyhow!("no answer within 2 s"))??;
    match response.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.0 200") => Ok(body.to_owned()),
        _ => bail!("unexpected answer: {response}"),
    }
}

/// Waits until `/readyz` says ok and the `default` namespace exists (the bootstrap controller makes
/// it shortly after readiness, and tests often use it at once).
async fn wait_apiserver_ready(
    apiserver: &mut ChildProcess,
    client: &kube::Client,
) -> Result<(), StartError> {
    let deadline = Instant::now() + APISERVER_READY_TIMEOUT;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let mut last;
    loop {
        if let Some(status) = apiserver.try_exited()? {
            return Err(start_failure(
                "kube-apiserver",
                status.to_string(),
                apiserver,
            ));
        }
        let probe = async {
            let readyz = client
                .request_text(http::Request::get("/readyz").body(Vec::new())?)
                .await?;
            if readyz.trim() != "ok" {
                bail!("/readyz: {readyz}");
            }
            if namespaces.get_opt("default").await?.is_none() {
                bail!("namespace default not created yet");
            }
            anyhow::Ok(())
        };
        // kube's client logs every failed request at ERROR; a probe expects failures until ready
        // and reports the last one itself, so it runs with tracing off.
        let probe = probe.with_subscriber(tracing::subscriber::NoSubscriber::default());
        match tokio::time::timeout(Duration::from_secs(5), probe).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(err)) => last = format!("{err:#}"),
            Err(_) => last = "probe timed out".to_owned(),
        }
        tracing::trace!(%last, "apiserver not ready");
        if Instant::now() >= deadline {
            let why = format!("not ready after {APISERVER_READY_TIMEOUT:?} (last: {last})");
            return Err(start_failure("kube-apiserver", why, apiserver));
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// An error naming the server, why it failed, and its log's tail; a port clash is retryable.
fn start_failure(name: &str, why: String, process: &ChildProcess) -> StartError {
    let tail = process.log_tail(LOG_TAIL_LINES);
    let err =
        anyhow::anyhow!("{name} failed to start: {why}\n--- last lines of its log ---\n{tail}");
    if tail.contains("address already in use") {
        StartError::PortTaken(err)
    } else {
        StartError::Other(err)
    }
}

/// The admin kubeconfig. JSON is valid YAML, so kubectl and kube-rs both read it; certificates are
/// embedded (`*-data`, base64) so the file stands alone.
fn kubeconfig(server_url: &str, pki: &Pki) -> anyhow::Result<String> {
    // k8s-openapi's ByteString serialises as standard base64, as kubeconfig `*-data` fields want.
    let b64 = |pem: &str| serde_json::to_value(k8s_openapi::ByteString(pem.as_bytes().to_vec()));
    let config = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{
            "name": "flotilla-test",
            "cluster": {
                "server": server_url,
                "certificate-authority-data": b64(&pki.serving_ca_cert)?,
            },
        }],
        "users": [{
            "name": ADMIN_USER,
            "user": {
                "client-certificate-data": b64(&pki.admin_cert)?,
                "client-key-data": b64(&pki.admin_key)?,
            },
        }],
        "contexts": [{
            "name": "flotilla-test",
            "context": { "cluster": "flotilla-test", "user": ADMIN_USER, "namespace": "default" },
        }],
        "current-context": "flotilla-test",
    });
    Ok(serde_json::to_string_pretty(&config)?)
}

/// Every CRD in the YAML files of `dir`, sorted by file name for a stable order.
fn read_crds(dir: &Path) -> anyhow::Result<Vec<CustomResourceDefinition>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading CRD directory {}", dir.display()))?
        .map(|entry| entry.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    files.retain(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"));
    files.sort();
    let mut crds = Vec::new();
    for file in &files {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        for (index, document) in yaml_serde::Deserializer::from_str(&text).enumerate() {
            let at = || format!("{} document #{}", file.display(), index + 1);
            let value = serde_json::Value::deserialize(document).with_context(at)?;
            if value.get("kind").and_then(|k| k.as_str()) != Some("CustomResourceDefinition") {
                // Empty documents and kustomization-style neighbours are not CRDs.
                continue;
            }
            let crd: CustomResourceDefinition = serde_json::from_value(value)
                .with_context(|| format!("{}: not a valid CustomResourceDefinition", at()))?;
            if crd.metadata.name.is_none() {
                bail!("{}: CRD has no metadata.name", at());
            }
            crds.push(crd);
        }
    }
    if crds.is_empty() {
        bail!("no CustomResourceDefinition in {}/*.yaml", dir.display());
    }
    Ok(crds)
}

fn is_established(crd: &CustomResourceDefinition) -> bool {
    crd.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crd_yaml(plural: &str) -> String {
        format!(
            "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\n\
             metadata: {{name: {plural}.example.com}}\n\
             spec: {{group: example.com, scope: Namespaced, \
             names: {{plural: {plural}, kind: K{plural}}}, versions: []}}\n"
        )
    }

    #[test]
    fn read_crds_takes_every_crd_document_and_skips_the_rest() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let multi = format!(
            "{}---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: x}}\n---\n{}",
            crd_yaml("bs"),
            crd_yaml("cs")
        );
        std::fs::write(dir.path().join("b.yaml"), multi)?;
        std::fs::write(dir.path().join("a.yml"), crd_yaml("as"))?;
        std::fs::write(dir.path().join("notes.txt"), crd_yaml("ignored"))?;

        let names: Vec<String> = read_crds(dir.path())?
            .into_iter()
            .filter_map(|crd| crd.metadata.name)
            .collect();
        assert_eq!(
            names,
            ["as.example.com", "bs.example.com", "cs.example.com"]
        );
        Ok(())
    }

    #[test]
    fn read_crds_refuses_a_directory_without_crds() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("kustomization.yaml"), "resources: []\n")?;
        let err = read_crds(dir.path()).expect_err("no CRDs");
        assert!(
            err.to_string().contains("no CustomResourceDefinition"),
            "{err:#}"
        );
        Ok(())
    }

    /// A server that dies because its port was taken makes `start` retry, and the error carries
    /// the server's own words.
    #[tokio::test]
    async fn a_port_clash_is_retryable_and_quotes_the_log() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let [port, ..] = free_ports()?;
        let args = [
            "-c".to_owned(),
            "echo 'listen tcp 127.0.0.1:1: bind: address already in use' >&2; exit 1".to_owned(),
        ];
        let mut fake =
            ChildProcess::spawn("etcd", Path::new("/bin/sh"), &args, dir.path().join("log"))?;
        match wait_etcd_healthy(&mut fake, port, "ours").await {
            Err(StartError::PortTaken(err)) => {
                let message = format!("{err:#}");
                assert!(message.contains("etcd failed to start"), "{message}");
                assert!(
                    message.contains("bind: address already in use"),
                    "{message}"
                );
            }
            Err(StartError::Other(err)) => panic!("not classed as a port clash: {err:#}"),
            Ok(()) => panic!("a dead process passed for healthy"),
        }
        Ok(())
    }
}
