//! Scale-out mode (`--gateways N`): N `flotilla-gateway` processes on loopback beside a hub
//! run with `--gateways external`, all on the hub's kube-apiserver, dividing the shards
//! through Leases. The harness gives each gateway a certificate from the hub CA, a fixed agent
//! address and a metrics address, stops them all at once in `storm` and `outage`, starts them
//! again on the same addresses, and asks them (their `/metrics`) and the shard Leases where
//! the sessions are.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use flotilla_proto::contract::{shard_of, shard_of_lease};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, ListParams};
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};
use tokio::time::Instant;
use tracing::info;

use crate::cli::RunArgs;
use crate::fleet::{HUB_START_TIMEOUT, HUB_STOP_TIMEOUT, tail};
use crate::machine::ProcStats;

/// The names the gateways' serving certificate carries: the agents check `localhost`
/// ([`crate::fleet::SERVER_NAME`]); the hub's proxy front checks the host of the advertised
/// address (with `--gateway-netns`, the namespaces' addresses are added).
const SERVER_NAMES: [&str; 2] = ["localhost", "127.0.0.1"];
/// The label of shard Leases (`flotilla-shard-NN`) among the gateways' Leases.
pub(crate) const SHARD_LEASE_SELECTOR: &str = "flotilla.io/lease=shard";
/// How long reading one gateway's `/metrics` may take.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);
/// The most bytes of one `/metrics` page read.
const SCRAPE_MAX_BYTES: u64 = 4 << 20;
/// The shard flags of `flotilla-gateway` that the hub must be given the same.
const SHARD_FLAGS: [&str; 4] = [
    "--shards",
    "--lease-duration",
    "--renew-period",
    "--lease-namespace",
];

/// The flags of `--gateway-arg` the hub needs too (the shard flags: hub and gateways must
/// agree on them), unless `--hub-arg` gives them already.
pub fn shard_args_for_hub(args: &RunArgs) -> Vec<String> {
    let given = |flag: &str, list: &[String]| {
        list.iter()
            .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
    };
    SHARD_FLAGS
        .iter()
        .filter(|flag| !given(flag, &args.hub_args))
        .flat_map(|flag| {
            let mut out = Vec::new();
            let mut it = args.gateway_args.iter();
            while let Some(a) = it.next() {
                if a.starts_with(&format!("{flag}=")) {
                    out.push(a.clone());
                } else if a == flag
                    && let Some(v) = it.next()
                {
                    out.push(format!("{flag}={v}"));
                }
            }
            out
        })
        .collect()
}

/// One gateway process; `child` is `None` while it is stopped.
struct GatewayChild {
    name: String,
    /// `--gateway-netns`: the network namespace it runs in.
    netns: Option<String>,
    /// The hub apiserver's kubeconfig as it reaches it (through the relay from a namespace).
    kubeconfig: PathBuf,
    /// Where agents reach it (TCP and UDP), the same across restarts.
    address: SocketAddr,
    /// Its `/metrics`.
    metrics: SocketAddr,
    child: Option<Child>,
    starts: usize,
}

/// The gateways of a run.
pub struct Gateways {
    list: Vec<GatewayChild>,
    /// Program and the arguments before the per-gateway flags.
    program: (PathBuf, Vec<String>),
    log_dir: PathBuf,
    /// Virtual shards and the Leases' namespace, as the gateways were told.
    shards: u32,
    lease_namespace: String,
    /// The gateways' log filter and whether they log JSON lines (the chaos scenario reads
    /// their fenced writes from them); otherwise `FLOTILLA_LOADTEST_GATEWAY_LOG` or warnings.
    log: Option<GatewayLog>,
    /// Every start of a gateway and every exit seen, in order.
    pub lifecycle: Vec<Lifecycle>,
    /// `--gateway-netns`: the namespaces of the first gateways, held until the gateways are
    /// gone (deleted when dropped). Declared last, so that on a
    /// drop the gateways are killed (in `Drop::drop`) before their namespaces are deleted.
    _namespaces: Option<crate::netns::Namespaces>,
}

/// What the chaos scenario changes about the gateways: how they log, and a kubeconfig each
/// (through its own relay to the apiserver). The default changes nothing.
#[derive(Clone, Debug, Default)]
pub struct ChaosSetup {
    pub log: Option<GatewayLog>,
    /// Gateway k's kubeconfig, when given; else the apiserver's own.
    pub kubeconfigs: Vec<PathBuf>,
}

/// How the gateways log.
#[derive(Clone, Debug)]
pub struct GatewayLog {
    /// `RUST_LOG` of every gateway.
    pub filter: String,
    /// JSON lines (one object per event) rather than text.
    pub json: bool,
}

/// A gateway started or seen to exit, as the chaos scenario's evidence of every process
/// stopping when asked.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Lifecycle {
    pub gateway: String,
    /// Seconds since the Unix epoch.
    pub at_unix_ms: u64,
    pub event: String,
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What the harness learns from one gateway's `/metrics` and `/proc`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GatewayReport {
    pub name: String,
    pub address: String,
    /// Sessions open on it (`flotilla_gateway_sessions`, both carriers).
    pub sessions: u64,
    /// Sessions it should hold: the run's clusters whose shard it owns in the Leases.
    pub owned_clusters: u64,
    /// Shards it holds in the Leases.
    pub shards: u64,
    pub rss_bytes: Option<u64>,
    pub cpu_seconds: Option<f64>,
    /// `flotilla_gateway_store_requests_total` by verb since this process started: its own
    /// count of requests to the hub apiserver (lease reads and writes are not among them).
    pub store_requests: BTreeMap<String, u64>,
}

impl Gateways {
    /// Writes the gateways' TLS material from the hub CA in `data_dir` and starts `n`
    /// gateways on `kubeconfig`; returns once every one accepts connections.
    pub async fn start(
        args: &RunArgs,
        n: usize,
        hub_data_dir: &Path,
        kubeconfig: &Path,
        namespaces: Option<crate::netns::Namespaces>,
        run_dir: &Path,
        setup: ChaosSetup,
    ) -> anyhow::Result<Gateways> {
        let ChaosSetup { log, kubeconfigs } = setup;
        let config = args.gateway_process_config("lt-gw-0")?;
        let cert_dir = run_dir.join("gateway-cert");
        let mut names: Vec<String> = SERVER_NAMES.iter().map(|n| n.to_string()).collect();
        if let Some(ns) = &namespaces {
            names.extend((0..ns.len()).filter_map(|j| Some(ns.get(j)?.0.inside.to_string())));
        }
        write_gateway_cert(hub_data_dir, &cert_dir, &names)?;
        let mut pre = match &args.gateway_binary {
            Some(bin) => (bin.clone(), Vec::new()),
            None => (args.harness_exe()?, vec!["gateway".to_string()]),
        };
        pre.1.push(format!("--cert-dir={}", cert_dir.display()));
        pre.1.extend(args.gateway_args.iter().cloned());
        if !args
            .gateway_args
            .iter()
            .any(|a| a.starts_with("--quic-congestion"))
        {
            pre.1
                .push(format!("--quic-congestion={}", args.quic_congestion.name()));
        }
        let mut list = Vec::with_capacity(n);
        for k in 0..n {
            let name = format!("lt-gw-{k}");
            list.push(match namespaces.as_ref().and_then(|ns| ns.get(k)) {
                // Its namespace has its own ports: fixed ones on its own address.
                Some((plan, kubeconfig)) => GatewayChild {
                    name,
                    netns: Some(plan.name.clone()),
                    kubeconfig: kubeconfig.to_path_buf(),
                    address: SocketAddr::new(plan.inside.into(), crate::netns::GATEWAY_PORT),
                    metrics: SocketAddr::new(plan.inside.into(), crate::netns::METRICS_PORT),
                    child: None,
                    starts: 0,
                },
                None => GatewayChild {
                    name,
                    netns: None,
                    // Its own kubeconfig when given one (the chaos scenario's relays).
                    kubeconfig: kubeconfigs
                        .get(k)
                        .cloned()
                        .unwrap_or_else(|| kubeconfig.to_path_buf()),
                    address: free_loopback_port()?,
                    metrics: free_loopback_port()?,
                    child: None,
                    starts: 0,
                },
            });
        }
        let mut gateways = Gateways {
            list,
            program: pre,
            log_dir: run_dir.to_path_buf(),
            shards: config.shards.shards,
            lease_namespace: config.shards.lease_namespace,
            log,
            lifecycle: Vec::new(),
            _namespaces: namespaces,
        };
        gateways.start_all().await?;
        Ok(gateways)
    }

    /// The agents' addresses of the gateways, in order: agent i dials number i mod N.
    pub fn addresses(&self) -> Vec<SocketAddr> {
        self.list.iter().map(|g| g.address).collect()
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Starts every stopped gateway on its address and waits until each accepts connections.
    pub async fn start_all(&mut self) -> anyhow::Result<()> {
        for g in self.list.iter_mut().filter(|g| g.child.is_none()) {
            g.starts += 1;
            let log = self.log_dir.join(format!("{}-{}.log", g.name, g.starts));
            let mut cmd = match &g.netns {
                // `ip netns exec` enters the namespace and execs the program: the pid is the
                // gateway's.
                Some(ns) => {
                    let mut cmd = Command::new("ip");
                    cmd.args(["netns", "exec", ns]).arg(&self.program.0);
                    cmd
                }
                None => Command::new(&self.program.0),
            };
            cmd.args(&self.program.1)
                .arg(format!("--kubeconfig={}", g.kubeconfig.display()))
                .arg(format!("--name={}", g.name))
                .arg(format!("--listen={}", g.address))
                .arg(format!("--metrics-addr={}", g.metrics))
                .env(
                    "RUST_LOG",
                    match &self.log {
                        Some(log) => log.filter.clone(),
                        None => std::env::var("FLOTILLA_LOADTEST_GATEWAY_LOG")
                            .unwrap_or_else(|_| "warn".into()),
                    },
                )
                .env(
                    crate::LOG_FORMAT_ENV,
                    if self.log.as_ref().is_some_and(|l| l.json) {
                        "json"
                    } else {
                        "text"
                    },
                )
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log)?)
                // Its own process group, as the hub's: a gateway that will not stop goes with
                // whatever it started.
                .process_group(0)
                .kill_on_drop(true);
            g.child = Some(
                cmd.spawn()
                    .with_context(|| format!("starting gateway {}", g.name))?,
            );
            self.lifecycle.push(Lifecycle {
                gateway: g.name.clone(),
                at_unix_ms: unix_ms(),
                event: "started".into(),
            });
        }
        let deadline = Instant::now() + HUB_START_TIMEOUT;
        for g in &mut self.list {
            loop {
                if tokio::net::TcpStream::connect(g.address).await.is_ok() {
                    break;
                }
                let exited = g
                    .child
                    .as_mut()
                    .is_none_or(|c| matches!(c.try_wait(), Ok(Some(_))));
                let log = self.log_dir.join(format!("{}-{}.log", g.name, g.starts));
                let why = if exited {
                    "exited before it listened"
                } else if Instant::now() >= deadline {
                    "did not listen in time"
                } else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                bail!(
                    "gateway {} on {} {why}; its log {}:\n{}",
                    g.name,
                    g.address,
                    log.display(),
                    tail(&std::fs::read_to_string(&log).unwrap_or_default(), 20)
                );
            }
        }
        info!(gateways = self.list.len(), "gateways listening");
        Ok(())
    }

    /// Sends `signal` to every gateway at once, then waits until each has exited (at most
    /// [`HUB_STOP_TIMEOUT`] for them all); one still there by then is killed with its group and
    /// the error names it.
    pub async fn stop_all(&mut self, signal: Signal) -> anyhow::Result<()> {
        let mut children: Vec<(String, Child)> = Vec::new();
        for g in &mut self.list {
            if let Some(c) = g.child.take() {
                if let Some(pid) = c.id() {
                    kill(Pid::from_raw(pid as i32), signal)?;
                }
                children.push((g.name.clone(), c));
            }
        }
        let deadline = Instant::now() + HUB_STOP_TIMEOUT;
        let mut hung = Vec::new();
        for (name, mut c) in children {
            let event = match tokio::time::timeout_at(deadline, c.wait()).await {
                Ok(status) => format!(
                    "exited after {} ({})",
                    signal.as_str(),
                    status.map_or_else(|e| e.to_string(), |s| s.to_string())
                ),
                Err(_) => {
                    if let Some(pid) = c.id() {
                        let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
                    }
                    let _ = c.wait().await;
                    hung.push(name.clone());
                    format!(
                        "did not exit within {HUB_STOP_TIMEOUT:?} of {}; killed",
                        signal.as_str()
                    )
                }
            };
            self.lifecycle.push(Lifecycle {
                gateway: name,
                at_unix_ms: unix_ms(),
                event,
            });
        }
        anyhow::ensure!(
            hung.is_empty(),
            "gateways {} did not exit within {HUB_STOP_TIMEOUT:?} of {}; killed them",
            hung.join(", "),
            signal.as_str()
        );
        info!(?signal, "gateways stopped");
        Ok(())
    }

    /// Sends `signal` to gateway `k` alone (SIGSTOP and SIGCONT: a pause).
    pub fn signal(&self, k: usize, signal: Signal) -> anyhow::Result<()> {
        let g = self.list.get(k).context("no such gateway")?;
        let pid = g
            .child
            .as_ref()
            .and_then(Child::id)
            .with_context(|| format!("gateway {} is not running", g.name))?;
        kill(Pid::from_raw(pid as i32), signal)
            .with_context(|| format!("sending {} to gateway {}", signal.as_str(), g.name))
    }

    /// Kills gateway `k` with SIGKILL and waits for it; [`Gateways::start_all`] starts it
    /// again on its address.
    pub async fn kill(&mut self, k: usize) -> anyhow::Result<()> {
        let g = self.list.get_mut(k).context("no such gateway")?;
        let mut c = g
            .child
            .take()
            .with_context(|| format!("gateway {} is not running", g.name))?;
        c.start_kill()?;
        let status = tokio::time::timeout(HUB_STOP_TIMEOUT, c.wait())
            .await
            .with_context(|| format!("gateway {} outlived SIGKILL", g.name))??;
        self.lifecycle.push(Lifecycle {
            gateway: g.name.clone(),
            at_unix_ms: unix_ms(),
            event: format!("killed ({status})"),
        });
        Ok(())
    }

    /// Every log a gateway has written in this run, one per start.
    pub fn logs(&self) -> Vec<PathBuf> {
        self.list
            .iter()
            .flat_map(|g| (1..=g.starts).map(|n| self.log_dir.join(format!("{}-{n}.log", g.name))))
            .collect()
    }

    /// The namespace of the shard Leases.
    pub fn lease_namespace(&self) -> &str {
        &self.lease_namespace
    }

    /// Gateways that exited on their own, with their log.
    pub fn exited(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        for g in &mut self.list {
            if let Some(c) = &mut g.child
                && let Ok(Some(status)) = c.try_wait()
            {
                out.push(format!(
                    "gateway {} exited ({status}); see {}",
                    g.name,
                    self.log_dir
                        .join(format!("{}-{}.log", g.name, g.starts))
                        .display()
                ));
            }
        }
        out
    }

    /// Shard → holder of every held shard Lease now.
    pub async fn owners(&self, client: kube::Client) -> anyhow::Result<BTreeMap<u32, String>> {
        let leases: Api<Lease> = Api::namespaced(client, &self.lease_namespace);
        let list = leases
            .list(&ListParams::default().labels(SHARD_LEASE_SELECTOR))
            .await
            .context("listing the shard Leases")?;
        Ok(list
            .items
            .into_iter()
            .filter_map(|l| {
                let shard = shard_of_lease(l.metadata.name.as_deref()?)?;
                let holder = l.spec?.holder_identity.filter(|h| !h.is_empty())?;
                Some((shard, holder))
            })
            .collect())
    }

    /// Every gateway as it is now: its sessions from its `/metrics`, the clusters of
    /// `clusters` whose shard it owns in the Leases, its RSS and CPU.
    pub async fn report(
        &self,
        client: kube::Client,
        clusters: &[String],
    ) -> anyhow::Result<Vec<GatewayReport>> {
        let owners = self.owners(client).await?;
        let mut out = Vec::with_capacity(self.list.len());
        for g in &self.list {
            let mut r = GatewayReport {
                name: g.name.clone(),
                address: g.address.to_string(),
                shards: owners.values().filter(|h| **h == g.name).count() as u64,
                owned_clusters: clusters
                    .iter()
                    .filter(|c| owners.get(&shard_of(c, self.shards)) == Some(&g.name))
                    .count() as u64,
                ..Default::default()
            };
            if let Some(stats) = g
                .child
                .as_ref()
                .and_then(Child::id)
                .and_then(|pid| ProcStats::read(&pid.to_string()))
            {
                r.rss_bytes = Some(stats.rss_bytes);
                r.cpu_seconds = Some(stats.cpu_seconds);
            }
            let page = scrape(g.metrics)
                .await
                .with_context(|| format!("reading gateway {}'s /metrics", g.name))?;
            for s in crate::prometheus::samples(&page, |n| {
                n == "flotilla_gateway_sessions" || n == "flotilla_gateway_store_requests_total"
            })? {
                let n = s.value.max(0.0).round() as u64;
                if s.name == "flotilla_gateway_sessions" {
                    r.sessions += n;
                } else {
                    *r.store_requests
                        .entry(s.label("verb").to_string())
                        .or_default() += n;
                }
            }
            out.push(r);
        }
        Ok(out)
    }

    /// Stops every gateway gracefully (SIGTERM), as the end of a run does.
    pub async fn shutdown(&mut self) -> anyhow::Result<()> {
        self.stop_all(Signal::SIGTERM).await
    }
}

impl Drop for Gateways {
    /// Gateways still running when the harness gives up (an error path) go with their groups.
    fn drop(&mut self) {
        for g in &self.list {
            if let Some(pid) = g.child.as_ref().and_then(Child::id) {
                let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
            }
        }
    }
}

/// Whether every gateway holds exactly the sessions of the clusters whose shards it owns, and
/// all of `agents` are held: every agent on its shard's owner.
pub fn all_on_owners(reports: &[GatewayReport], agents: u64) -> bool {
    reports.iter().all(|g| g.sessions == g.owned_clusters)
        && reports.iter().map(|g| g.owned_clusters).sum::<u64>() == agents
}

/// The gateways' certificate from the hub CA for `names`, written as `flotilla-hub
/// gateway-cert` does.
fn write_gateway_cert(hub_data_dir: &Path, out: &Path, names: &[String]) -> anyhow::Result<()> {
    use flotilla_hub::ca::{self, Ca};
    let ca = Ca::load_or_create(&hub_data_dir.join("ca"))?;
    let issued = ca.issue_gateway("flotilla-gateway", names)?;
    let chain = ca::IssuedCert {
        cert_pem: ca.serving_chain_pem(&issued.cert_pem),
        key_pem: issued.key_pem,
    };
    ca::write_bundle(out, &ca.bundle_pem(), &chain)?;
    Ok(())
}

/// A loopback port free now, for a gateway to keep across its restarts.
fn free_loopback_port() -> anyhow::Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// `GET /metrics` over plain HTTP/1.0, bounded in time and size.
pub(crate) async fn scrape(address: SocketAddr) -> anyhow::Result<String> {
    tokio::time::timeout(SCRAPE_TIMEOUT, async {
        let mut stream = tokio::net::TcpStream::connect(address).await?;
        stream
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
            .await?;
        let mut body = Vec::new();
        stream.take(SCRAPE_MAX_BYTES).read_to_end(&mut body).await?;
        let text = String::from_utf8_lossy(&body).into_owned();
        let (head, page) = text
            .split_once("\r\n\r\n")
            .context("no end of headers in the answer")?;
        anyhow::ensure!(
            head.starts_with("HTTP/1.") && head.split_whitespace().nth(1) == Some("200"),
            "answered {}",
            head.lines().next().unwrap_or_default()
        );
        Ok(page.to_string())
    })
    .await
    .with_context(|| format!("no answer from {address} within {SCRAPE_TIMEOUT:?}"))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn run_args(extra: &[&str]) -> RunArgs {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            args: RunArgs,
        }
        let mut argv = vec!["run"];
        argv.extend_from_slice(extra);
        Only::parse_from(argv).args
    }

    #[test]
    fn the_hub_gets_the_gateways_shard_flags_unless_it_has_its_own() {
        let args = run_args(&[
            "--gateway-arg=--shards=16",
            "--gateway-arg=--lease-duration",
            "--gateway-arg=3s",
            "--gateway-arg=--drain-window=1s",
            "--hub-arg=--renew-period=1s",
            "--gateway-arg=--renew-period=1s",
        ]);
        assert_eq!(
            shard_args_for_hub(&args),
            ["--shards=16", "--lease-duration=3s"]
        );
        assert!(shard_args_for_hub(&run_args(&[])).is_empty());
    }

    #[test]
    fn agents_are_on_their_owners_only_when_every_count_matches() {
        let g = |sessions, owned_clusters| GatewayReport {
            sessions,
            owned_clusters,
            ..Default::default()
        };
        assert!(all_on_owners(&[g(3, 3), g(2, 2)], 5));
        assert!(!all_on_owners(&[g(4, 3), g(1, 2)], 5), "one on a non-owner");
        assert!(!all_on_owners(&[g(3, 3), g(1, 1)], 5), "a shard unowned");
    }
}
