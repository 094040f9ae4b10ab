//! Helpers for end-to-end tests: flotilla's real binaries as child processes, their logs in
//! files, and waiting on conditions with deadlines.
//!
//! Not for: anything but tests. The binaries must be built first (`cargo build --workspace
//! --bins`, which the README's test command does).
#![forbid(unsafe_code)]

pub mod browser;
pub mod faults;
pub mod https;
pub mod proxy;
pub mod scripted;
pub mod spoke;

pub use flotilla_transport::Carrier;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use flotilla_proto::wire::{AgentFrame, HubFrame};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use tokio::time::Instant;

/// Path of a workspace binary next to the running test (target/<profile>/<name>).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the binaries first with `cargo build --workspace --bins`",
        path.display()
    );
    path
}

tokio::task_local! {
    /// The carrier the current end-to-end test runs on (set by [`on_both_carriers!`]); a hub
    /// started in it records it and its agents use it.
    pub static CARRIER: Carrier;
}

/// The carrier of the running test: gRPC unless [`on_both_carriers!`] set another.
pub fn current_carrier() -> Carrier {
    CARRIER.try_with(|c| *c).unwrap_or(Carrier::Grpc)
}

/// Defines an end-to-end test that runs once per carrier, from the same code: a module named
/// after the test with `grpc` and `quic` tests in it.
///
/// ```text
/// on_both_carriers! {
///     /// What it checks.
///     async fn delivery_survives_a_restart() -> anyhow::Result<()> { ... }
/// }
/// ```
#[macro_export]
macro_rules! on_both_carriers {
    ($(#[$meta:meta])* async fn $name:ident() -> $ret:ty $body:block) => {
        $(#[$meta])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            async fn body() -> $ret $body

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn grpc() -> $ret {
                $crate::CARRIER.scope($crate::Carrier::Grpc, body()).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn quic() -> $ret {
                $crate::CARRIER.scope($crate::Carrier::Quic, body()).await
            }
        }
    };
}

/// The random source of a torture test: seeded from `FLOTILLA_TORTURE_SEED` to replay a run,
/// or at random, and the seed printed so a failure can be replayed.
pub fn torture_rng() -> (u64, rand::rngs::StdRng) {
    use rand::SeedableRng;
    let seed: u64 = std::env::var("FLOTILLA_TORTURE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("torture seed {seed} (set FLOTILLA_TORTURE_SEED to replay)");
    (seed, rand::rngs::StdRng::seed_from_u64(seed))
}

/// Waits until `check` returns `Some`, failing after `timeout` with the last observation. This
/// is how tests wait: on the condition, with a deadline (the poller all crates' tests share).
pub use flotilla_testenv::wait_for;

/// A loopback port free now, for a process told to listen on it.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// `GET path` from the plain-HTTP `address` (host:port), as a probe or a scraper does: the
/// status code and the body.
pub async fn http_get(address: &str, path: &str) -> anyhow::Result<(u16, String)> {
    http_get_accepting(address, path, "*/*").await
}

/// [`http_get`] with an `Accept` header.
pub async fn http_get_accepting(
    address: &str,
    path: &str,
    accept: &str,
) -> anyhow::Result<(u16, String)> {
    let stream = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::net::TcpStream::connect(address),
    )
    .await
    .with_context(|| format!("connecting to {address}"))??;
    http_exchange(stream, address, path, accept).await
}

/// `GET path` on a connection already open to `address` (host:port): the status code and the
/// body.
async fn http_exchange(
    mut stream: tokio::net::TcpStream,
    address: &str,
    path: &str,
    accept: &str,
) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nAccept: {accept}\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await?;
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut answer))
        .await
        .with_context(|| format!("reading GET {path} from {address}"))??;
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .with_context(|| format!("GET {path} from {address}: no header end in {answer:?}"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("GET {path} from {address}: no status in {head:?}"))?;
    Ok((status, body.to_string()))
}

/// What Prometheus asks for when it scrapes: OpenMetrics first.
const PROMETHEUS_ACCEPT: &str =
    "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// Scrapes `/metrics` at `address` as Prometheus does and reads the page strictly (every
/// sample with HELP and TYPE, Prometheus names, counters in `_total`, cumulative buckets).
pub async fn scrape(address: &str) -> anyhow::Result<flotilla_ops::exposition::Exposition> {
    let (status, body) = http_get_accepting(address, "/metrics", PROMETHEUS_ACCEPT).await?;
    exposition(address, status, body)
}

/// [`scrape`] of a process in `link`'s namespace listening on its `127.0.0.1:port` (an agent
/// behind the link), from inside the namespace: the scrape never crosses the link, and works
/// while the link is down.
pub async fn scrape_behind(
    link: &flotilla_wan::EmulatedLink,
    port: u16,
) -> anyhow::Result<flotilla_ops::exposition::Exposition> {
    let address = format!("127.0.0.1:{port} in {}", link.namespace());
    let socket = link.inside(tokio::net::TcpSocket::new_v4).await?;
    let stream = tokio::time::timeout(
        Duration::from_secs(5),
        socket.connect((std::net::Ipv4Addr::LOCALHOST, port).into()),
    )
    .await
    .with_context(|| format!("connecting to {address}"))??;
    let (status, body) = http_exchange(
        stream,
        &format!("127.0.0.1:{port}"),
        "/metrics",
        PROMETHEUS_ACCEPT,
    )
    .await
    .with_context(|| format!("scraping {address}"))?;
    exposition(&address, status, body)
}

/// A `/metrics` answer read strictly, or why it is not one.
fn exposition(
    address: &str,
    status: u16,
    body: String,
) -> anyhow::Result<flotilla_ops::exposition::Exposition> {
    anyhow::ensure!(
        status == 200,
        "GET /metrics from {address}: {status} {body}"
    );
    flotilla_ops::exposition::check(&body)
        .with_context(|| format!("/metrics of {address} is not a valid exposition:\n{body}"))
}

/// A child process that is killed and reaped when dropped, with its stderr in a file.
pub struct Proc {
    child: Option<Child>,
    log: PathBuf,
    name: String,
}

impl Proc {
    pub fn spawn(name: &str, mut cmd: Command, log: PathBuf) -> anyhow::Result<Proc> {
        let file = std::fs::File::create(&log)?;
        cmd.stdout(Stdio::null()).stderr(file).stdin(Stdio::null());
        let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
        Ok(Proc {
            child: Some(child),
            log,
            name: name.to_string(),
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// Sends a real signal and reaps the process.
    pub fn signal_and_wait(&mut self, signal: Signal) {
        if let Some(mut child) = self.child.take() {
            let _ = kill(Pid::from_raw(child.id() as i32), signal);
            let _ = child.wait();
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Waits for the process to exit on its own, at most `timeout`; its exit status, or `None`
    /// if it is still running.
    pub async fn exited_within(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            let child = self.child.as_mut()?;
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.child.is_some() {
            if std::thread::panicking() {
                eprintln!("--- log of {} ---\n{}", self.name, self.log());
            }
            self.signal_and_wait(Signal::SIGKILL);
        }
    }
}

/// Flags that make a hub notice things in test time rather than production time.
pub const FAST_HEALTH: &[&str] = &[
    "--heartbeat-interval=200ms",
    "--heartbeat-timeout=1s",
    "--grace-period=2s",
];

/// [`FAST_HEALTH`] without the flags `extra` gives: a flag given there replaces the fast
/// default of the same name.
fn fast_health_unless<'a>(extra: &'a [&str]) -> impl Iterator<Item = &'static str> + 'a {
    FAST_HEALTH.iter().copied().filter(move |f| {
        let name = f.split('=').next().unwrap_or(f);
        !extra.iter().any(|e| e.split('=').next() == Some(name))
    })
}

/// A `flotilla-hub` process with its own data dir and ephemeral ports.
pub struct Hub {
    pub proc: Proc,
    pub data_dir: PathBuf,
    pub agents_addr: String,
    pub api_addr: String,
    /// The carrier its agents use (the test's, see [`on_both_carriers!`]).
    pub carrier: Carrier,
    /// Its /metrics, /healthz and /readyz address, when started with `--metrics-addr`.
    pub metrics_addr: Option<String>,
}

impl Hub {
    /// Starts a hub on the sled store (`extra` adds flags, e.g. `--store kube`).
    pub async fn start(dir: &Path, extra: &[&str]) -> anyhow::Result<Hub> {
        Hub::start_listening(dir, "127.0.0.1:0", "127.0.0.1:0", extra).await
    }

    /// Stops the hub with SIGTERM and starts it again on the same data dir and addresses, so
    /// agents find it where they left it.
    pub async fn restart(&mut self, dir: &Path, extra: &[&str]) -> anyhow::Result<()> {
        self.proc.signal_and_wait(Signal::SIGTERM);
        let (agents, api) = (self.agents_addr.clone(), self.api_addr.clone());
        *self = Hub::start_listening(dir, &agents, &api, extra).await?;
        Ok(())
    }

    /// Starts a hub on the given addresses (port 0: any free port).
    pub async fn start_listening(
        dir: &Path,
        agents: &str,
        api: &str,
        extra: &[&str],
    ) -> anyhow::Result<Hub> {
        let data_dir = dir.join("hub-data");
        let mut cmd = Command::new(bin("flotilla-hub"));
        cmd.arg("--data-dir")
            .arg(&data_dir)
            .arg(format!("--listen={agents}"))
            .arg(format!("--api-listen={api}"))
            .args(fast_health_unless(extra))
            .args(extra)
            .env(
                "RUST_LOG",
                "info,flotilla_gateway=debug,flotilla_hub::controllers::governance=debug",
            );
        let _ = std::fs::remove_file(data_dir.join("listen.json"));
        // Each start logs to a new file, so a restarted hub's log does not hide the first one's.
        let log = (1..)
            .map(|n| dir.join(format!("hub-{n}.log")))
            .find(|p| !p.exists())
            .expect("a free log name");
        let mut proc = Proc::spawn("flotilla-hub", cmd, log)?;
        let listen_path = data_dir.join("listen.json");
        let listen: Value = wait_for("the hub to listen", Duration::from_secs(30), || {
            let alive = proc.alive();
            let path = listen_path.clone();
            async move {
                if !alive {
                    bail!("flotilla-hub exited");
                }
                Ok(std::fs::read_to_string(&path)
                    .ok()
                    .and_then(|t| serde_json::from_str(&t).ok()))
            }
        })
        .await
        .with_context(|| format!("hub log:\n{}", proc.log()))?;
        Ok(Hub {
            proc,
            data_dir,
            agents_addr: listen["agents"].as_str().unwrap_or_default().to_string(),
            api_addr: listen["api"].as_str().unwrap_or_default().to_string(),
            carrier: current_carrier(),
            metrics_addr: listen["metrics"].as_str().map(str::to_string),
        })
    }

    /// Issues an agent certificate for `cluster` into `out` with `flotilla-hub dev-cert`.
    pub fn dev_cert(&self, cluster: &str, out: &Path) -> anyhow::Result<()> {
        self.dev_cert_for(cluster, out, "720h")
    }

    /// [`dev_cert`](Self::dev_cert) with a certificate valid for `lifetime` (`6s`, `1h`).
    pub fn dev_cert_for(&self, cluster: &str, out: &Path, lifetime: &str) -> anyhow::Result<()> {
        let output = Command::new(bin("flotilla-hub"))
            .arg("dev-cert")
            .arg("--data-dir")
            .arg(&self.data_dir)
            .args(["--cluster", cluster, "--lifetime", lifetime])
            .arg("--out")
            .arg(out)
            .output()?;
        anyhow::ensure!(
            output.status.success(),
            "dev-cert failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(())
    }

    /// Runs the real `flotilla` CLI against this hub.
    /// Writes a gateway's TLS material from this hub's CA into `dir/gateway-cert` with
    /// `flotilla-hub gateway-cert` (names: localhost and 127.0.0.1) and returns that path.
    pub fn gateway_cert(&self, dir: &Path) -> anyhow::Result<PathBuf> {
        let certs = dir.join("gateway-cert");
        let out = Command::new(bin("flotilla-hub"))
            .arg("gateway-cert")
            .arg("--data-dir")
            .arg(&self.data_dir)
            .args(["--server-name", "localhost,127.0.0.1", "--out"])
            .arg(&certs)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "gateway-cert: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(certs)
    }

    pub fn cli(&self, args: &[&str]) -> anyhow::Result<Output> {
        Ok(Command::new(bin("flotilla"))
            .env(
                "FLOTILLA_CONFIG",
                self.data_dir.join("operator/config.yaml"),
            )
            .args(args)
            .output()?)
    }

    /// `flotilla get clusters -o json`, parsed.
    pub fn clusters(&self) -> anyhow::Result<Vec<Value>> {
        let out = self.cli(&["get", "clusters", "-o", "json"])?;
        anyhow::ensure!(
            out.status.success(),
            "flotilla get clusters failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let list: Value = serde_json::from_slice(&out.stdout)?;
        Ok(list["items"].as_array().cloned().unwrap_or_default())
    }

    /// Status of a condition of a managed cluster as the CLI shows it ("True", "Unknown", ...).
    pub fn cluster_condition(
        &self,
        cluster: &str,
        condition: &str,
    ) -> anyhow::Result<Option<String>> {
        Ok(self
            .clusters()?
            .iter()
            .find(|c| c["metadata"]["name"] == cluster)
            .and_then(|c| condition_status(c, condition)))
    }
}

impl Hub {
    /// ManifestWork `cluster`/`name` as `flotilla get works` shows it.
    pub fn work(&self, cluster: &str, name: &str) -> anyhow::Result<Option<Value>> {
        let out = self.cli(&["get", "works", "--cluster", cluster, "-o", "json"])?;
        anyhow::ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let list: Value = serde_json::from_slice(&out.stdout)?;
        Ok(list["items"].as_array().and_then(|items| {
            items
                .iter()
                .find(|w| w["metadata"]["name"] == name)
                .cloned()
        }))
    }

    /// Waits (a minute at most) until the hub shows `cluster` Available=True.
    pub async fn wait_available(&self, cluster: &str) -> anyhow::Result<()> {
        wait_for(
            &format!("{cluster} Available=True"),
            Duration::from_secs(60),
            || async {
                Ok((self
                    .cluster_condition(cluster, "ManagedClusterConditionAvailable")?
                    .as_deref()
                    == Some("True"))
                .then_some(()))
            },
        )
        .await
    }

    /// Waits until the hub shows the work Applied=True at its current generation.
    pub async fn wait_work_applied(&self, cluster: &str, name: &str) -> anyhow::Result<Value> {
        wait_for(
            &format!("{cluster}/{name} Applied on the hub"),
            Duration::from_secs(60),
            || async {
                let Some(w) = self.work(cluster, name)? else {
                    return Ok(None);
                };
                let generation = w["metadata"]["generation"].as_i64();
                let applied = w["status"]["conditions"]
                    .as_array()
                    .and_then(|cs| cs.iter().find(|c| c["type"] == "Applied"))
                    .is_some_and(|c| {
                        c["status"] == "True" && c["observedGeneration"].as_i64() == generation
                    });
                Ok(applied.then_some(w))
            },
        )
        .await
    }
}

/// Status string of condition `t` in an object's status.conditions.
pub fn condition_status(obj: &Value, t: &str) -> Option<String> {
    obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == t)?["status"]
        .as_str()
        .map(str::to_string)
}

/// A `flotilla-gateway` replica (scale-out mode) serving for the hub of `hub`'s data dir.
pub struct GatewayProc {
    pub proc: Proc,
    pub name: String,
    /// Where agents reach it (TCP and UDP), as it advertises.
    pub address: String,
}

impl GatewayProc {
    /// Starts gateway `name` on a free loopback port, on the hub apiserver of `kubeconfig`,
    /// with the TLS material in `cert_dir` (`flotilla-hub gateway-cert`); `extra` adds flags.
    pub fn start(
        dir: &Path,
        name: &str,
        kubeconfig: &Path,
        cert_dir: &Path,
        extra: &[&str],
    ) -> anyhow::Result<GatewayProc> {
        GatewayProc::start_with_env(dir, name, kubeconfig, cert_dir, extra, &[])
    }

    /// [`GatewayProc::start`] with environment variables `env` set for it (replacing the
    /// defaults of the same name, such as `RUST_LOG`).
    pub fn start_with_env(
        dir: &Path,
        name: &str,
        kubeconfig: &Path,
        cert_dir: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<GatewayProc> {
        let address = format!("127.0.0.1:{}", free_port()?);
        let mut cmd = Command::new(bin("flotilla-gateway"));
        cmd.args(["--name", name])
            .arg(format!("--listen={address}"))
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--cert-dir")
            .arg(cert_dir)
            .args(fast_health_unless(extra))
            .args(extra)
            .env("RUST_LOG", "info,flotilla_gateway=debug")
            .envs(env.iter().copied());
        let proc = Proc::spawn(name, cmd, dir.join(format!("{name}.log")))?;
        Ok(GatewayProc {
            proc,
            name: name.to_string(),
            address,
        })
    }

    /// Clusters whose sessions are established on this gateway now, from its log.
    pub fn sessions(&self) -> std::collections::BTreeSet<String> {
        sessions_in_log(&self.proc.log())
    }
}

/// Clusters with a session open (established and not closed since) in a gateway's log.
pub fn sessions_in_log(log: &str) -> std::collections::BTreeSet<String> {
    let mut open = std::collections::BTreeMap::<String, i64>::new();
    for line in log.lines() {
        let delta = if line.contains("session established") {
            1
        } else if line.contains("session closed") && line.contains("cluster=") {
            -1
        } else {
            continue;
        };
        let Some(cluster) = line
            .split("cluster=")
            .nth(1)
            .and_then(|rest| rest.split([' ', '}', ':']).next())
        else {
            continue;
        };
        *open.entry(cluster.to_string()).or_default() += delta;
    }
    open.into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(c, _)| c)
        .collect()
}

/// Starts `flotilla-agent run` for `cluster` with the certificates in `cert_dir`, for tests about
/// sessions and health: its spoke kubeconfig points at nothing, so the session is all it does.
pub fn start_agent(dir: &Path, hub: &Hub, cluster: &str, cert_dir: &Path) -> anyhow::Result<Proc> {
    agent_process(
        Command::new(bin("flotilla-agent")),
        &hub.agents_addr,
        dir,
        hub,
        cluster,
        cert_dir,
    )
}

/// [`start_agent`] in the namespace of `link`, so every packet of its session crosses the
/// emulated link: it dials the hub's loopback port at the link's host end.
pub fn start_agent_behind(
    link: &flotilla_wan::EmulatedLink,
    dir: &Path,
    hub: &Hub,
    cluster: &str,
    cert_dir: &Path,
) -> anyhow::Result<Proc> {
    let port = hub
        .agents_addr
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .with_context(|| format!("the hub's agent address {} has no port", hub.agents_addr))?;
    let through = format!("{}:{port}", link.host());
    agent_process(
        link.command(bin("flotilla-agent")),
        &through,
        dir,
        hub,
        cluster,
        cert_dir,
    )
}

/// `flotilla-agent run` as `cmd` (the binary, or a wrapper that execs it) dialling `hub_addr`.
fn agent_process(
    mut cmd: Command,
    hub_addr: &str,
    dir: &Path,
    hub: &Hub,
    cluster: &str,
    cert_dir: &Path,
) -> anyhow::Result<Proc> {
    let kubeconfig = no_spoke_kubeconfig(dir)?;
    cmd.arg("run")
        .args([
            "--hub",
            hub_addr,
            "--server-name",
            "localhost",
            "--cluster-name",
            cluster,
        ])
        .arg("--cert-dir")
        .arg(cert_dir)
        .arg("--data-dir")
        .arg(dir.join(format!("agent-{cluster}-data")))
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args([
            "--initial-jitter=0s",
            "--max-backoff=1s",
            "--kubernetes-version=v1.36.3",
        ])
        .arg(format!("--transport={}", hub.carrier))
        .env("RUST_LOG", "info");
    Proc::spawn(
        "flotilla-agent",
        cmd,
        dir.join(format!("agent-{cluster}.log")),
    )
}

/// Writes [`NO_SPOKE_KUBECONFIG`] into `dir` and returns its path. Written to a temporary file
/// and renamed into place, so an agent started a moment before, reading it, never sees it
/// half written.
pub fn no_spoke_kubeconfig(dir: &Path) -> anyhow::Result<PathBuf> {
    let path = dir.join("no-spoke.kubeconfig");
    let partial = tempfile::NamedTempFile::new_in(dir)?;
    std::fs::write(partial.path(), NO_SPOKE_KUBECONFIG)?;
    partial.persist(&path)?;
    Ok(path)
}

/// A kubeconfig whose apiserver is a closed loopback port: for agents whose spoke is not under
/// test.
pub const NO_SPOKE_KUBECONFIG: &str = "apiVersion: v1
kind: Config
clusters:
- name: none
  cluster:
    server: https://127.0.0.1:9
users:
- name: none
  user: {}
contexts:
- name: none
  context:
    cluster: none
    user: none
current-context: none
";

/// A session with frames by hand, for tests that play a misbehaving agent: the real dialer
/// on the hub's carrier, with the identity in `cert_dir`, `first` as the first frame.
pub struct RawSession {
    pub inbound: flotilla_transport::FrameStream<HubFrame>,
    pub outbound: tokio::sync::mpsc::Sender<AgentFrame>,
    _pump: Option<tokio::task::JoinHandle<()>>,
}

impl RawSession {
    pub async fn open(hub: &Hub, cert_dir: &Path, first: AgentFrame) -> anyhow::Result<RawSession> {
        let transport = match hub.carrier {
            Carrier::Grpc => flotilla_agent::connect::Transport::Grpc,
            Carrier::Quic => flotilla_agent::connect::Transport::Quic,
        };
        let dialer = flotilla_agent::connect::Dialer::new(&hub.agents_addr, "localhost", cert_dir)?
            .with_transport(transport);
        let dialed = dialer.connect(first).await?;
        Ok(RawSession {
            inbound: dialed.link.inbound,
            outbound: dialed.link.outbound,
            _pump: dialed.pump.map(tokio::spawn),
        })
    }

    /// The next frame from the hub; `None` once the stream ended.
    pub async fn next(&mut self) -> Option<HubFrame> {
        use futures::StreamExt as _;
        match self.inbound.next().await? {
            Ok(frame) => Some(frame),
            Err(e) => {
                tracing::debug!(error = %e, "raw session stream ended with an error");
                None
            }
        }
    }
}

/// Debian's tinyproxy on loopback, allowing CONNECT to `connect_port` only (anything else gets
/// 403), logging to `<dir>/tinyproxy.log`. Returns the process and its port.
pub async fn start_tinyproxy(dir: &Path, connect_port: u16) -> anyhow::Result<(Proc, u16)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let conf = dir.join("tinyproxy.conf");
    std::fs::write(
        &conf,
        format!(
            "Port {port}\nListen 127.0.0.1\nTimeout 600\nAllow 127.0.0.1\nConnectPort {connect_port}\n\
             LogFile \"{}\"\nLogLevel Info\nPidFile \"{}\"\n",
            dir.join("tinyproxy.log").display(),
            dir.join("tinyproxy.pid").display()
        ),
    )?;
    let mut cmd = Command::new("tinyproxy");
    cmd.arg("-d").arg("-c").arg(&conf);
    let proxy = Proc::spawn("tinyproxy", cmd, dir.join("tinyproxy.stderr")).map_err(|e| {
        anyhow::anyhow!(
            "{e:#}: install it with `apt-get install -y tinyproxy` (scripts/test.sh does)"
        )
    })?;
    wait_for("tinyproxy to listen", Duration::from_secs(30), || async {
        Ok(tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()
            .map(|_| ()))
    })
    .await?;
    Ok((proxy, port))
}

/// Every `status.decisions[].clusterName` of some PlacementDecisions, sorted: what Argo CD's
/// clusterDecisionResource generator reads (`statusListKey: decisions`, `matchKey:
/// clusterName`).
pub fn decision_clusters<'a>(decisions: impl IntoIterator<Item = &'a Value>) -> Vec<String> {
    let mut clusters: Vec<String> = decisions
        .into_iter()
        .flat_map(|d| {
            d["status"]["decisions"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|d| d["clusterName"].as_str().map(str::to_string))
        .collect();
    clusters.sort();
    clusters
}

/// A fresh real apiserver with OCM's CRDs installed, for a hub's `--store kube`, and the path
/// of its kubeconfig.
pub async fn hub_apiserver() -> anyhow::Result<(flotilla_testenv::TestEnv, String)> {
    let env = flotilla_testenv::TestEnv::start().await?;
    env.install_crds(&flotilla_testenv::workspace_root().join("deploy/crds"))
        .await?;
    let kubeconfig = env
        .kubeconfig_path()
        .to_str()
        .context("the kubeconfig path is not UTF-8")?
        .to_string();
    Ok((env, kubeconfig))
}

/// The hub under test and, for the kube backend, its apiserver: what an operator of either
/// backend has in hand.
pub struct Fleet {
    pub hub: Hub,
    pub hub_env: Option<flotilla_testenv::TestEnv>,
}

impl Fleet {
    /// A hub on the sled store, or (`kube`) on a fresh real apiserver with OCM's CRDs.
    pub async fn start(dir: &Path, kube: bool) -> anyhow::Result<Fleet> {
        Fleet::start_with(dir, kube, &[]).await
    }

    /// [`Fleet::start`] with more hub flags.
    pub async fn start_with(dir: &Path, kube: bool, extra: &[&str]) -> anyhow::Result<Fleet> {
        if !kube {
            return Ok(Fleet {
                hub: Hub::start(dir, extra).await?,
                hub_env: None,
            });
        }
        let (env, kubeconfig) = hub_apiserver().await?;
        let mut flags = vec!["--store=kube", "--kubeconfig", &kubeconfig];
        flags.extend_from_slice(extra);
        let hub = Hub::start(dir, &flags).await?;
        Ok(Fleet {
            hub,
            hub_env: Some(env),
        })
    }

    /// Applies OCM YAML the way an operator of this backend would: `kubectl apply` on the
    /// kube backend, `flotilla apply` on the sled one.
    pub fn apply(&self, file: &Path) -> anyhow::Result<()> {
        let out = match &self.hub_env {
            Some(env) => env.kubectl().arg("apply").arg("-f").arg(file).output()?,
            None => self
                .hub
                .cli(&["apply", "-f", file.to_str().unwrap_or_default()])?,
        };
        anyhow::ensure!(
            out.status.success(),
            "apply failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// Writes `doc` to a file in `dir` and applies it.
    pub fn apply_value(&self, dir: &Path, doc: &Value) -> anyhow::Result<()> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let path = dir.join(format!(
            "applied-{}.json",
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, serde_json::to_vec_pretty(doc)?)?;
        self.apply(&path)
    }

    /// Runs the `flotilla` CLI and returns its stdout, failing with its stderr.
    pub fn cli(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = self.hub.cli(args)?;
        anyhow::ensure!(
            out.status.success(),
            "flotilla {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `flotilla get <what> -o json`'s items.
    pub fn list(&self, args: &[&str]) -> anyhow::Result<Vec<Value>> {
        let mut all = vec!["get"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["-o", "json"]);
        let list: Value = serde_json::from_str(&self.cli(&all)?)?;
        Ok(list["items"].as_array().cloned().unwrap_or_default())
    }

    /// The work `name` in `cluster`'s namespace, if the hub has it.
    pub fn work(&self, cluster: &str, name: &str) -> anyhow::Result<Option<Value>> {
        self.hub.work(cluster, name)
    }

    /// The clusters whose namespace holds a work called `name`, sorted.
    pub fn clusters_with_work(&self, name: &str) -> anyhow::Result<Vec<String>> {
        let mut clusters: Vec<String> = self
            .list(&["works"])?
            .iter()
            .filter(|w| w["metadata"]["name"] == name)
            .filter_map(|w| w["metadata"]["namespace"].as_str().map(str::to_string))
            .collect();
        clusters.sort();
        Ok(clusters)
    }

    /// The clusters placement `namespace/name` decided, from its PlacementDecisions, sorted.
    pub fn decided(&self, namespace: &str, name: &str) -> anyhow::Result<Vec<String>> {
        let decisions = self.list(&["placementdecisions", "-n", namespace, "--placement", name])?;
        Ok(decision_clusters(&decisions))
    }

    /// Waits until placement `namespace/name` decides exactly `expected`.
    pub async fn wait_decided(
        &self,
        namespace: &str,
        name: &str,
        expected: &[&str],
    ) -> anyhow::Result<()> {
        wait_for(
            &format!("placement {namespace}/{name} to decide {expected:?}"),
            Duration::from_secs(60),
            || async {
                let got = self.decided(namespace, name)?;
                Ok((got == expected).then_some(()))
            },
        )
        .await
    }

    /// Waits until the hub shows the work Applied=True at its current generation.
    pub async fn wait_applied(&self, cluster: &str, name: &str) -> anyhow::Result<Value> {
        self.hub.wait_work_applied(cluster, name).await
    }
}

/// Waits until cluster `cluster`'s compliance record on the hub (its `ClusterCompliance`, read
/// through the operator API) lists policy `name` as `compliant` ("Compliant" or
/// "NonCompliant"), and returns that entry: what `flotilla describe policy` shows for it.
pub async fn wait_compliance(
    operator: &flotilla_cli::client::OperatorClient,
    cluster: &str,
    name: &str,
    compliant: &str,
    timeout: Duration,
) -> anyhow::Result<Value> {
    let path = flotilla_cli::cli::object_path(
        flotilla_proto::api::Kind::ClusterCompliance,
        Some(cluster),
        cluster,
    );
    wait_for(
        &format!("cluster {cluster} to report policy {name} {compliant}"),
        timeout,
        || async {
            let Ok(record) = operator.get_json(&path).await else {
                return Ok(None);
            };
            Ok(record["status"]["policies"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|e| e["name"] == name && e["compliant"] == compliant)
                .cloned())
        },
    )
    .await
}
