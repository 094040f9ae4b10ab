//! The hub under test: started by the harness (a child process, or in-process) or an existing
//! one on loopback; stopped, killed and started again by the scenarios; and the agents'
//! enrollment (certificates from the hub's CA, keys registered through the operator API).
//!
//! With `--store kube` the hub keeps its objects on a real kube-apiserver that [`Hub::start`]
//! starts first and that lives exactly as long as the [`Hub`]: restarts of the hub (storm,
//! outage) leave it running, and it stops after the hub, or when the `Hub` is dropped on an
//! error path.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use flotilla_hub::ListenInfo;
use flotilla_hub::ca::Ca;
use flotilla_hub::config::StoreBackend;
use futures::StreamExt;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use tokio::process::{Child, Command};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::info;

use crate::apiserver::{Apiserver, crds_dir};
use crate::cli::{HubMode, HubStore, RunArgs};
use crate::gateways::Gateways;
use crate::machine::ProcStats;
use crate::operator::{OperatorApi, POOL_SIZE};

/// The name agents check the hub's serving certificate against (in the hub's default
/// `--server-name` list).
pub const SERVER_NAME: &str = "localhost";
/// How long a started hub may take to write its listen.json.
pub const HUB_START_TIMEOUT: Duration = Duration::from_secs(60);
/// Lifetime of the agents' certificates: longer than any run, so no renewal happens mid-test.
pub const AGENT_CERT_LIFETIME: Duration = Duration::from_secs(7 * 24 * 3600);
/// How long a signalled hub may take to exit: its drain deadline (`flotilla-hub
/// --drain-timeout`, 20 s by default) and a margin. A hub still running after this is a hang:
/// the harness says so, kills it and fails the scenario.
pub const HUB_STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// One agent's identity: its cluster name, certificate and key.
#[derive(Clone, Serialize, Deserialize)]
pub struct Identity {
    pub name: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl Identity {
    /// An agent that has no identity yet and joins for one.
    pub fn to_join(name: String) -> Identity {
        Identity {
            name,
            cert_pem: String::new(),
            key_pem: String::new(),
        }
    }
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

enum Running {
    /// `flotilla_hub::run` on the harness's runtime.
    InProcess {
        stop: Option<oneshot::Sender<()>>,
        task: tokio::task::JoinHandle<anyhow::Result<()>>,
    },
    /// A child process; `None` while stopped.
    Child(Option<Child>),
    /// Someone else's hub.
    External,
}

/// The hub under test.
pub struct Hub {
    pub mode: &'static str,
    pub data_dir: PathBuf,
    pub agents: SocketAddr,
    pub api: SocketAddr,
    /// The hub's plain-HTTP `/metrics` (the harness turns it on for the hubs it starts).
    pub metrics: Option<SocketAddr>,
    /// The gateway processes with `--gateways` (the hub then runs with `--gateways
    /// external`). Declared before `running`: dropped, they go before the hub.
    gateways: Option<Gateways>,
    running: Running,
    /// Child hub: program and the arguments before `--data-dir`.
    program: Option<(PathBuf, Vec<String>)>,
    /// Where child hubs log (one file per start).
    log_dir: PathBuf,
    starts: usize,
    /// The hub's kube-apiserver with `--store kube`. Declared after `running` so that, when a
    /// `Hub` is dropped, the hub goes before the apiserver it talks to.
    apiserver: Option<Apiserver>,
    /// The chaos scenario's relays from each gateway to the apiserver (see
    /// [`crate::chaos::partition`]).
    relays: Option<crate::chaos::partition::Relays>,
    /// How the child hub last exited when the harness stopped it.
    pub last_exit: Option<std::process::ExitStatus>,
}

impl Hub {
    /// Starts the hub `args` asks for, or attaches to the existing one.
    pub async fn start(args: &RunArgs, run_dir: &Path) -> anyhow::Result<Hub> {
        if let (Some(agents), Some(data_dir)) = (args.hub, &args.data_dir) {
            let api = OperatorApi::from_data_dir(data_dir)?;
            let api_addr = api.address().parse().with_context(|| {
                format!(
                    "the operator API address {} is not host:port with an IP",
                    api.address()
                )
            })?;
            return Ok(Hub {
                mode: "external",
                data_dir: data_dir.clone(),
                agents,
                api: api_addr,
                metrics: None,
                gateways: None,
                running: Running::External,
                program: None,
                log_dir: run_dir.to_path_buf(),
                starts: 1,
                apiserver: None,
                relays: None,
                last_exit: None,
            });
        }
        let data_dir = run_dir.join("hub-data");
        std::fs::create_dir_all(&data_dir)?;
        // `--gateway-netns`: planned now, since the apiserver's certificate names them.
        let netns = crate::netns::plan(if args.gateways.is_some() {
            args.gateway_netns
        } else {
            0
        });
        // Dropped (stopping kube-apiserver and etcd) if the hub then fails to start.
        let apiserver = match args.store {
            HubStore::Sled => None,
            HubStore::Kube => {
                Some(Apiserver::start_serving(&crds_dir(), &crate::netns::addresses(&netns)).await?)
            }
        };
        // The proxy front on, for the `proxy` scenario, unless --hub-arg sets it up itself.
        let mut hub_args = args.hub_args.clone();
        if !hub_args.iter().any(|a| a.starts_with("--proxy-listen")) {
            hub_args.extend(crate::proxy::hub_args(&data_dir)?);
        }
        if !hub_args.iter().any(|a| a.starts_with("--quic-congestion")) {
            hub_args.push(format!("--quic-congestion={}", args.quic_congestion.name()));
        }
        // Its gauges, as an operator would scrape them: the connect scenario counts Available
        // clusters there rather than listing every cluster a few times a second.
        if !hub_args.iter().any(|a| a.starts_with("--metrics-addr")) {
            hub_args.push("--metrics-addr=127.0.0.1:0".to_string());
        }
        match args.hub_mode {
            HubMode::InProcess => {
                let mut config =
                    hub_config(&data_dir, args.hub_listen, args.hub_api_listen, &hub_args)?;
                if let Some(a) = &apiserver {
                    config.store = StoreBackend::Kube;
                    config.kubeconfig = Some(a.kubeconfig_path().to_path_buf());
                }
                let (stop, stopped) = oneshot::channel::<()>();
                let task = tokio::spawn(flotilla_hub::run(config, async {
                    let _ = stopped.await;
                }));
                let listen = wait_listen(&data_dir, || task.is_finished()).await?;
                Ok(Hub {
                    mode: "in-process",
                    data_dir,
                    agents: listen.agents,
                    api: listen.api,
                    metrics: listen.metrics,
                    gateways: None,
                    running: Running::InProcess {
                        stop: Some(stop),
                        task,
                    },
                    program: None,
                    log_dir: run_dir.to_path_buf(),
                    starts: 1,
                    apiserver,
                    relays: None,
                    last_exit: None,
                })
            }
            HubMode::Child => {
                let mut program = match &args.hub_binary {
                    Some(bin) => (bin.clone(), Vec::new()),
                    None => (args.harness_exe()?, vec!["hub".to_string()]),
                };
                if let Some(a) = &apiserver {
                    program.1.extend([
                        "--store=kube".to_string(),
                        format!("--kubeconfig={}", a.kubeconfig_path().display()),
                    ]);
                }
                if args.gateways.is_some() {
                    program.1.push("--gateways=external".to_string());
                    program.1.extend(crate::gateways::shard_args_for_hub(args));
                }
                program.1.extend(hub_args);
                if args.hub_nice != 0 {
                    // nice(1) execs the hub: the same process, its threads at that priority.
                    let (exe, pre) = program;
                    let mut wrapped = vec![
                        "-n".to_string(),
                        args.hub_nice.to_string(),
                        exe.to_string_lossy().into_owned(),
                    ];
                    wrapped.extend(pre);
                    program = (PathBuf::from("nice"), wrapped);
                }
                let mut hub = Hub {
                    mode: "child",
                    data_dir,
                    agents: args.hub_listen,
                    api: args.hub_api_listen,
                    metrics: None,
                    gateways: None,
                    running: Running::Child(None),
                    program: Some(program),
                    log_dir: run_dir.to_path_buf(),
                    starts: 0,
                    apiserver,
                    relays: None,
                    last_exit: None,
                };
                hub.start_again().await?;
                if let (Some(n), Some(a)) = (args.gateways, &hub.apiserver) {
                    let namespaces = match netns.is_empty() {
                        true => None,
                        false => Some(
                            crate::netns::Namespaces::create(
                                netns,
                                a.address()?,
                                a.kubeconfig_path(),
                                run_dir,
                            )
                            .await?,
                        ),
                    };
                    // The chaos scenario: a relay per gateway (to partition each from the
                    // apiserver on its own) and the fenced writes in their JSON logs.
                    let chaos = args.scenarios.contains(&crate::cli::Scenario::Chaos);
                    if chaos {
                        hub.relays = Some(
                            crate::chaos::partition::Relays::start(
                                n,
                                a.address()?,
                                a.kubeconfig_path(),
                                run_dir,
                            )
                            .await?,
                        );
                    }
                    // The fenced-write log the judgement reads, plus whatever the operator
                    // asks for to follow a violation (FLOTILLA_LOADTEST_GATEWAY_LOG).
                    let log = chaos.then(|| crate::gateways::GatewayLog {
                        filter: match std::env::var("FLOTILLA_LOADTEST_GATEWAY_LOG") {
                            Ok(more) => format!(
                                "warn,{more},{}=debug",
                                crate::chaos::fencing::FENCED_WRITE_TARGET
                            ),
                            Err(_) => {
                                format!("warn,{}=debug", crate::chaos::fencing::FENCED_WRITE_TARGET)
                            }
                        },
                        json: true,
                    });
                    let kubeconfigs = hub
                        .relays
                        .as_ref()
                        .map(|r| r.kubeconfigs())
                        .unwrap_or_default();
                    hub.gateways = Some(
                        Gateways::start(
                            args,
                            n,
                            &hub.data_dir,
                            a.kubeconfig_path(),
                            namespaces,
                            run_dir,
                            crate::gateways::ChaosSetup { log, kubeconfigs },
                        )
                        .await?,
                    );
                }
                Ok(hub)
            }
        }
    }

    /// The gateway processes (`--gateways`).
    pub fn gateways(&self) -> Option<&Gateways> {
        self.gateways.as_ref()
    }

    /// The gateway processes (`--gateways`), to stop and start.
    pub fn gateways_mut(&mut self) -> Option<&mut Gateways> {
        self.gateways.as_mut()
    }

    /// The hub's kube-apiserver (`--store kube`).
    pub fn apiserver_mut(&mut self) -> Option<&mut Apiserver> {
        self.apiserver.as_mut()
    }

    /// The chaos scenario's relays from the gateways to the apiserver.
    pub fn relays(&self) -> Option<&crate::chaos::partition::Relays> {
        self.relays.as_ref()
    }

    pub fn apiserver(&self) -> Option<&Apiserver> {
        self.apiserver.as_ref()
    }

    /// The child hub's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        match &self.running {
            Running::Child(Some(c)) => c.id(),
            _ => None,
        }
    }

    /// RSS and CPU of the child hub; `None` for other modes or while it is down.
    pub fn stats(&self) -> Option<ProcStats> {
        ProcStats::read(&self.pid()?.to_string())
    }

    /// Whether the harness can stop and start this hub.
    pub fn can_restart(&self) -> bool {
        matches!(self.running, Running::Child(_))
    }

    /// Sends `signal` to the child hub and waits until it has exited, at most
    /// [`HUB_STOP_TIMEOUT`]. A hub that is still there by then is killed (with everything it
    /// started) and the error says so, with the end of its log.
    pub async fn stop_with(&mut self, signal: Signal) -> anyhow::Result<()> {
        let Running::Child(child) = &mut self.running else {
            bail!("only a child hub can be stopped by the harness");
        };
        let Some(mut c) = child.take() else {
            return Ok(());
        };
        let pid = c.id();
        if let Some(pid) = pid {
            kill(Pid::from_raw(pid as i32), signal)?;
        }
        match tokio::time::timeout(HUB_STOP_TIMEOUT, c.wait()).await {
            Ok(status) => {
                let status = status?;
                info!(?signal, %status, "hub stopped");
                self.last_exit = Some(status);
                Ok(())
            }
            Err(_) => {
                kill_group(pid);
                let _ = c.wait().await;
                let log = self.log_dir.join(format!("hub-{}.log", self.starts));
                bail!(
                    "the hub (pid {}) did not exit within {HUB_STOP_TIMEOUT:?} of {}; killed it. \
                     Its log {}:\n{}",
                    pid.unwrap_or_default(),
                    signal.as_str(),
                    log.display(),
                    tail(&std::fs::read_to_string(&log).unwrap_or_default(), 20)
                )
            }
        }
    }

    /// Whether the child hub has exited on its own (crashed, or exited with an error), with its
    /// exit status; `None` while it runs or for other modes.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        match &mut self.running {
            Running::Child(Some(c)) => c.try_wait().ok().flatten(),
            _ => None,
        }
    }

    /// The log of the hub's current (or last) start, for error messages.
    pub fn log(&self) -> PathBuf {
        self.log_dir.join(format!("hub-{}.log", self.starts))
    }

    /// (Re)starts the child hub on the same data dir and, after the first start, the same
    /// addresses, so agents find it where they left it. Returns once it listens.
    pub async fn start_again(&mut self) -> anyhow::Result<()> {
        let Some((program, pre)) = self.program.clone() else {
            bail!("only a child hub can be started again");
        };
        let _ = std::fs::remove_file(ListenInfo::path(&self.data_dir));
        self.starts += 1;
        let log = self.log_dir.join(format!("hub-{}.log", self.starts));
        let file = std::fs::File::create(&log)?;
        let mut cmd = Command::new(&program);
        cmd.args(&pre)
            .arg("--data-dir")
            .arg(&self.data_dir)
            .arg(format!("--listen={}", self.agents))
            .arg(format!("--api-listen={}", self.api))
            .env(
                "RUST_LOG",
                std::env::var("FLOTILLA_LOADTEST_HUB_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            // Its own process group, so that a hub that will not stop is killed with whatever
            // it started (see `kill_group`).
            .process_group(0)
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting the hub {}", program.display()))?;
        let listen = {
            let mut exited = || matches!(child.try_wait(), Ok(Some(_)));
            wait_listen(&self.data_dir, &mut exited).await
        };
        let listen = listen.with_context(|| {
            format!(
                "hub log {}:\n{}",
                log.display(),
                tail(&std::fs::read_to_string(&log).unwrap_or_default(), 20)
            )
        })?;
        self.agents = listen.agents;
        self.api = listen.api;
        self.metrics = listen.metrics;
        self.running = Running::Child(Some(child));
        Ok(())
    }

    /// Stops the hub (gracefully) if the harness started it, then its kube-apiserver, if any
    /// (also when stopping the hub failed).
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        let gateways = match self.gateways.as_mut() {
            Some(g) => g.shutdown().await,
            None => Ok(()),
        };
        let stopped = match std::mem::replace(&mut self.running, Running::External) {
            Running::InProcess { mut stop, mut task } => {
                if let Some(s) = stop.take() {
                    let _ = s.send(());
                }
                match tokio::time::timeout(HUB_STOP_TIMEOUT, &mut task).await {
                    Ok(joined) => joined.map_err(anyhow::Error::from).and_then(|r| r),
                    Err(_) => {
                        task.abort();
                        Err(anyhow::anyhow!(
                            "the in-process hub did not stop within {HUB_STOP_TIMEOUT:?}; aborted it"
                        ))
                    }
                }
            }
            running @ Running::Child(_) => {
                self.running = running;
                self.stop_with(Signal::SIGTERM).await
            }
            Running::External => Ok(()),
        };
        if let Some(a) = self.apiserver.take() {
            a.stop().await;
        }
        gateways.and(stopped)
    }

    /// The operator API of this hub.
    pub fn operator(&self) -> anyhow::Result<Arc<OperatorApi>> {
        OperatorApi::from_data_dir(&self.data_dir)
    }

    /// A serving identity from the hub's CA for `names`: (CA bundle, certificate chain, key),
    /// PEM; for the bare carrier server of `baseline-bare`.
    pub fn serving_identity(&self, names: &[&str]) -> anyhow::Result<(String, String, String)> {
        let ca = self.ca()?;
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let issued = ca.issue_server(&names)?;
        Ok((
            ca.bundle_pem(),
            ca.serving_chain_pem(&issued.cert_pem),
            issued.key_pem,
        ))
    }

    /// The CA bundle agents trust.
    pub fn ca_bundle(&self) -> anyhow::Result<String> {
        Ok(self.ca()?.bundle_pem())
    }

    fn ca(&self) -> anyhow::Result<Ca> {
        let dir = self.data_dir.join("ca");
        anyhow::ensure!(
            dir.join("ca.crt").exists() && dir.join("ca.key").exists(),
            "{} holds no hub CA (ca.crt and ca.key): is {} the hub's --data-dir?",
            dir.display(),
            self.data_dir.display()
        );
        Ok(Ca::load_or_create(&dir)?)
    }

    /// Issues a certificate for each name from the hub's CA and registers its key with the
    /// hub (accepted), `progress` ticking per cluster.
    pub async fn enroll(
        &self,
        names: Vec<String>,
        progress: &indicatif::ProgressBar,
    ) -> anyhow::Result<Vec<Identity>> {
        let ca = Arc::new(self.ca()?);
        let api = self.operator()?;
        let identities: Vec<anyhow::Result<Identity>> = futures::stream::iter(names)
            .map(|name| {
                let ca = ca.clone();
                let api = api.clone();
                async move {
                    let (identity, pin) =
                        tokio::task::spawn_blocking(move || issue(&ca, name)).await??;
                    api.register_dev_key(&identity.name, &pin).await?;
                    Ok(identity)
                }
            })
            .buffered(POOL_SIZE)
            .inspect(|_| progress.inc(1))
            .collect()
            .await;
        identities.into_iter().collect()
    }
}

fn issue(ca: &Ca, name: String) -> anyhow::Result<(Identity, String)> {
    use rustls_pki_types::{CertificateDer, pem::PemObject};
    let issued = ca.issue_cluster(&name, AGENT_CERT_LIFETIME)?;
    let der = CertificateDer::from_pem_slice(issued.cert_pem.as_bytes())?;
    let pin = flotilla_transport::identity::public_key_sha256(&der)?;
    Ok((
        Identity {
            name,
            cert_pem: issued.cert_pem,
            key_pem: issued.key_pem,
        },
        pin,
    ))
}

fn hub_config(
    data_dir: &Path,
    listen: SocketAddr,
    api: SocketAddr,
    extra: &[String],
) -> anyhow::Result<flotilla_hub::config::HubConfig> {
    use clap::Parser;
    #[derive(Parser)]
    struct Only {
        #[command(flatten)]
        config: flotilla_hub::config::HubConfig,
    }
    let argv = std::iter::once("hub".to_string()).chain(extra.iter().cloned());
    let mut config = Only::try_parse_from(argv)
        .context("--hub-arg: not a flag of flotilla-hub")?
        .config;
    config.data_dir = data_dir.to_path_buf();
    config.listen = listen;
    config.api_listen = api;
    Ok(config)
}

/// Waits for the hub's listen.json, failing early if `exited` says the hub is gone.
async fn wait_listen(
    data_dir: &Path,
    mut exited: impl FnMut() -> bool,
) -> anyhow::Result<ListenInfo> {
    let path = ListenInfo::path(data_dir);
    let deadline = Instant::now() + HUB_START_TIMEOUT;
    loop {
        if let Some(listen) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| serde_json::from_str::<ListenInfo>(&t).ok())
        {
            return Ok(listen);
        }
        if exited() {
            bail!("the hub exited before it listened");
        }
        if Instant::now() >= deadline {
            bail!(
                "the hub did not write {} within {HUB_START_TIMEOUT:?}",
                path.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// SIGKILLs the process group `pid` leads (a child hub started with `process_group(0)`).
fn kill_group(pid: Option<u32>) {
    if let Some(pid) = pid {
        let _ = nix::sys::signal::killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
    }
}

impl Drop for Hub {
    /// A hub still running when the harness gives up (an error path) goes with its group.
    fn drop(&mut self) {
        if let Running::Child(Some(c)) = &self.running {
            kill_group(c.id());
        }
    }
}

pub(crate) fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The scheduling priority of process `pid` (`nice`, field 19 of `/proc/PID/stat`), if it
/// is readable.
pub fn nice_of(pid: u32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count from after it.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(16)?.parse().ok()
}
