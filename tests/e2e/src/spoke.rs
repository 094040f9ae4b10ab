//! Spoke clusters for end-to-end tests: a real kube-apiserver each, and an agent process
//! applying to it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Context as _;
use flotilla_testenv::{TestCluster, TestEnv};
use flotilla_wan::{BesideRelay, EmulatedLink};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use kube::Api;

use crate::{Hub, Proc, bin, wait_for};

/// An agent in a link's namespace ([`Spoke::start_agent_behind`]) and the relay that serves
/// its apiserver beside it; dropping it kills the agent and stops the relay.
pub struct AgentBehind {
    pub proc: Proc,
    pub beside: BesideRelay,
}

/// A managed cluster: its own apiserver, its agent's certificate and data directory.
pub struct Spoke {
    pub name: String,
    pub env: SpokeEnv,
    pub certs: PathBuf,
    pub data: PathBuf,
}

/// What a spoke's apiserver has behind it; either way it is used as the [`TestEnv`] it
/// dereferences to.
pub enum SpokeEnv {
    /// The apiserver and etcd alone: quick to start, enough for whatever the agent itself does.
    Bare(Box<TestEnv>),
    /// With controllers, scheduler and kwok's nodes: for workloads that must really run.
    Full(Box<TestCluster>),
}

impl std::ops::Deref for SpokeEnv {
    type Target = TestEnv;

    fn deref(&self) -> &TestEnv {
        match self {
            SpokeEnv::Bare(env) => env,
            SpokeEnv::Full(cluster) => cluster,
        }
    }
}

impl std::ops::DerefMut for SpokeEnv {
    fn deref_mut(&mut self) -> &mut TestEnv {
        match self {
            SpokeEnv::Bare(env) => env,
            SpokeEnv::Full(cluster) => cluster,
        }
    }
}

impl SpokeEnv {
    /// The cluster behind a full spoke ([`Spoke::start_full`]): its container log and exec
    /// directory. An error for a bare spoke, which has no pods to log or exec into.
    pub fn cluster(&self) -> anyhow::Result<&TestCluster> {
        match self {
            SpokeEnv::Bare(_) => anyhow::bail!("a bare spoke has no cluster behind it"),
            SpokeEnv::Full(cluster) => Ok(cluster),
        }
    }

    /// The cluster processes' log tails, for a failing wait's message; empty for a bare spoke.
    pub fn log_tails(&self) -> String {
        match self {
            SpokeEnv::Bare(_) => String::new(),
            SpokeEnv::Full(cluster) => cluster.log_tails(),
        }
    }
}

impl Spoke {
    /// Starts an apiserver for cluster `name` and issues its agent a certificate from `hub`.
    pub async fn start(dir: &Path, hub: &Hub, name: &str) -> anyhow::Result<Spoke> {
        Spoke::with_env(
            dir,
            hub,
            name,
            SpokeEnv::Bare(Box::new(TestEnv::start().await?)),
        )
    }

    /// [`Spoke::start`] with a whole cluster behind the apiserver ([`TestCluster`]): the spoke's
    /// Deployments, Jobs and pods run and report status as on a real cluster.
    pub async fn start_full(dir: &Path, hub: &Hub, name: &str) -> anyhow::Result<Spoke> {
        Spoke::with_env(
            dir,
            hub,
            name,
            SpokeEnv::Full(Box::new(TestCluster::start().await?)),
        )
    }

    fn with_env(dir: &Path, hub: &Hub, name: &str, env: SpokeEnv) -> anyhow::Result<Spoke> {
        let certs = dir.join(format!("{name}-certs"));
        hub.dev_cert(name, &certs)?;
        Ok(Spoke {
            name: name.into(),
            env,
            certs,
            data: dir.join(format!("{name}-agent-data")),
        })
    }

    /// Starts an apiserver for cluster `name` without a certificate: a cluster that has only a
    /// join command ([`Spoke::join_agent`]), as a new or rebuilt one does.
    pub async fn start_unregistered(dir: &Path, name: &str) -> anyhow::Result<Spoke> {
        Ok(Spoke {
            name: name.into(),
            env: SpokeEnv::Bare(Box::new(TestEnv::start().await?)),
            certs: dir.join(format!("{name}-no-certs")),
            data: dir.join(format!("{name}-no-data")),
        })
    }

    /// Starts this cluster's agent against `hub` (`extra` adds flags).
    pub fn start_agent(&self, dir: &Path, hub: &Hub, extra: &[&str]) -> anyhow::Result<Proc> {
        let program = Command::new(bin("flotilla-agent"));
        let mut cmd = self.agent_command(program, "run", hub, &self.data, extra);
        cmd.args(["--hub", &hub.agents_addr, "--server-name", "localhost"])
            .arg("--cert-dir")
            .arg(&self.certs);
        self.spawn_agent(dir, cmd)
    }

    /// Starts one more agent of this cluster, serving `hub` as `--hub-name hub_name` (OCM's
    /// agent per hub): its own certificate from that hub and its own data directory, both named
    /// after the hub, beside any other agent of this cluster on the same apiserver.
    pub fn start_agent_for_hub(
        &self,
        dir: &Path,
        hub: &Hub,
        hub_name: &str,
        extra: &[&str],
    ) -> anyhow::Result<Proc> {
        let certs = dir.join(format!("{}-{hub_name}-certs", self.name));
        if !certs.join("tls.crt").exists() {
            hub.dev_cert(&self.name, &certs)?;
        }
        let data = dir.join(format!("{}-{hub_name}-agent-data", self.name));
        let program = Command::new(bin("flotilla-agent"));
        let mut cmd = self.agent_command(program, "run", hub, &data, extra);
        cmd.args(["--hub", &hub.agents_addr, "--server-name", "localhost"])
            .args(["--hub-name", hub_name])
            .arg("--cert-dir")
            .arg(&certs);
        self.spawn_agent(dir, cmd)
    }

    /// Starts this cluster's agent in `link`'s namespace, as at an edge site: it reaches `hub`
    /// only across the link (dialling the hub's port at the link's host end), and its own
    /// apiserver beside it, at the kubeconfig's address, without crossing the link (a
    /// [`BesideRelay`], which serves as long as the returned [`AgentBehind`] lives).
    pub async fn start_agent_behind(
        &self,
        link: &EmulatedLink,
        dir: &Path,
        hub: &Hub,
        extra: &[&str],
    ) -> anyhow::Result<AgentBehind> {
        let server = self.env.server_url();
        let apiserver_port = server
            .strip_prefix("https://127.0.0.1:")
            .and_then(|port| port.trim_end_matches('/').parse::<u16>().ok())
            .with_context(|| format!("the spoke's apiserver {server} is not on 127.0.0.1"))?;
        let beside = link.serve_beside(apiserver_port).await?;
        let hub_port = hub
            .agents_addr
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse::<u16>().ok())
            .with_context(|| format!("the hub's agent address {} has no port", hub.agents_addr))?;
        let program = link.command(bin("flotilla-agent"));
        let mut cmd = self.agent_command(program, "run", hub, &self.data, extra);
        cmd.args(["--hub", &format!("{}:{hub_port}", link.host())])
            .args(["--server-name", "localhost"])
            .arg("--cert-dir")
            .arg(&self.certs);
        Ok(AgentBehind {
            proc: self.spawn_agent(dir, cmd)?,
            beside,
        })
    }

    /// Joins this cluster to `hub` with a bootstrap token (`token`: `flotilla token create -o
    /// json`) from a fresh data directory `data`, as a rebuilt spoke does: the key is made
    /// there, and once accepted the process runs on as the agent.
    pub fn join_agent(
        &self,
        dir: &Path,
        hub: &Hub,
        token: &serde_json::Value,
        data: &Path,
    ) -> anyhow::Result<Proc> {
        let text = |field: &str| token[field].as_str().unwrap_or_default().to_string();
        let program = Command::new(bin("flotilla-agent"));
        let mut cmd = self.agent_command(program, "join", hub, data, &[]);
        cmd.args(["--hub", &text("hub")])
            .args(["--ca-fingerprint", &text("caFingerprint")])
            .env("FLOTILLA_BOOTSTRAP_TOKEN", text("token"));
        self.spawn_agent(dir, cmd)
    }

    /// Adds `hub` to the hubs one agent of this cluster serves from `data`, as its operator
    /// would: an auto-accepting bootstrap token from the hub (`flotilla token create`), then
    /// `flotilla-agent join --hub-name hub_name --join-only`, waited for. The agent keeps that
    /// hub's identity in `data/hubs/hub_name`.
    pub async fn join_hub(
        &self,
        dir: &Path,
        hub: &Hub,
        hub_name: &str,
        data: &Path,
    ) -> anyhow::Result<()> {
        let out = hub.cli(&["token", "create", "--auto-accept", "-o", "json"])?;
        anyhow::ensure!(
            out.status.success(),
            "token create failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let token: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let text = |field: &str| token[field].as_str().unwrap_or_default().to_string();
        let program = Command::new(bin("flotilla-agent"));
        let mut cmd = self.agent_command(program, "join", hub, data, &[]);
        cmd.args(["--hub", &text("hub")])
            .args(["--ca-fingerprint", &text("caFingerprint")])
            .args(["--hub-name", hub_name, "--join-only"])
            .env("FLOTILLA_BOOTSTRAP_TOKEN", text("token"));
        let mut join = self.spawn_agent(dir, cmd)?;
        let status = join
            .exited_within(Duration::from_secs(60))
            .await
            .with_context(|| {
                format!("the join of hub {hub_name} did not finish:\n{}", join.log())
            })?;
        anyhow::ensure!(
            status.success(),
            "the join of hub {hub_name} failed ({status}):\n{}",
            join.log()
        );
        Ok(())
    }

    /// Starts the one agent of this cluster that serves every hub joined in `data`
    /// ([`Spoke::join_hub`]): `flotilla-agent run` without `--hub`. `carrier_of` gives the
    /// test's carrier.
    pub fn start_agent_for_joined_hubs(
        &self,
        dir: &Path,
        carrier_of: &Hub,
        data: &Path,
        extra: &[&str],
    ) -> anyhow::Result<Proc> {
        let program = Command::new(bin("flotilla-agent"));
        let cmd = self.agent_command(program, "run", carrier_of, data, extra);
        self.spawn_agent(dir, cmd)
    }

    /// `flotilla-agent leave --hub hub_name` on the agent's data directory `data` (the agent
    /// stopped): that hub's works taken off this spoke, its cache and identity dropped.
    pub fn leave_hub(&self, data: &Path, hub_name: &str) -> anyhow::Result<String> {
        let out = Command::new(bin("flotilla-agent"))
            .arg("leave")
            .args(["--hub", hub_name, "--timeout", "60s"])
            .args(["--cluster-name", &self.name])
            .arg("--data-dir")
            .arg(data)
            .arg("--kubeconfig")
            .arg(self.env.kubeconfig_path())
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "flotilla-agent leave --hub {hub_name} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `flotilla-agent failover --to hub_name` on the agent's data directory `data`: what it
    /// printed.
    pub fn fail_over(&self, data: &Path, hub_name: &str) -> anyhow::Result<String> {
        let out = Command::new(bin("flotilla-agent"))
            .arg("failover")
            .args(["--to", hub_name])
            .arg("--data-dir")
            .arg(data)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "flotilla-agent failover --to {hub_name} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `flotilla-agent SUBCOMMAND` as `cmd` (the binary, or a wrapper that execs it) for this
    /// cluster and its apiserver, state in `data`.
    fn agent_command(
        &self,
        mut cmd: Command,
        subcommand: &str,
        hub: &Hub,
        data: &Path,
        extra: &[&str],
    ) -> Command {
        cmd.arg(subcommand)
            .args(["--cluster-name", &self.name])
            .arg("--data-dir")
            .arg(data)
            .arg("--kubeconfig")
            .arg(self.env.kubeconfig_path())
            .args(["--initial-jitter=0s", "--max-backoff=1s"])
            .args(
                // The test's carrier, unless `extra` chooses one.
                (!extra.iter().any(|e| e.starts_with("--transport")))
                    .then(|| format!("--transport={}", hub.carrier)),
            )
            .args(extra)
            .env("RUST_LOG", "info,flotilla_agent=debug");
        cmd
    }

    fn spawn_agent(&self, dir: &Path, cmd: Command) -> anyhow::Result<Proc> {
        let log = (1..)
            .map(|n| dir.join(format!("agent-{}-{n}.log", self.name)))
            .find(|p| !p.exists())
            .expect("a free log name");
        Proc::spawn("flotilla-agent", cmd, log)
    }

    pub async fn deployment(&self, ns: &str, name: &str) -> anyhow::Result<Option<Deployment>> {
        let api: Api<Deployment> = Api::namespaced(self.env.client().await?, ns);
        Ok(api.get_opt(name).await?)
    }

    pub async fn service_account(
        &self,
        ns: &str,
        name: &str,
    ) -> anyhow::Result<Option<ServiceAccount>> {
        let api: Api<ServiceAccount> = Api::namespaced(self.env.client().await?, ns);
        Ok(api.get_opt(name).await?)
    }

    pub async fn config_map(&self, ns: &str, name: &str) -> anyhow::Result<Option<ConfigMap>> {
        let api: Api<ConfigMap> = Api::namespaced(self.env.client().await?, ns);
        Ok(api.get_opt(name).await?)
    }

    /// Waits until the Deployment exists with this image (or, with `None`, until it is gone).
    pub async fn wait_deployment_image(
        &self,
        name: &str,
        image: Option<&str>,
    ) -> anyhow::Result<()> {
        wait_for(
            &format!("{}: deployment default/{name} image {image:?}", self.name),
            Duration::from_secs(60),
            || async {
                let d = self.deployment("default", name).await?;
                let got = d.as_ref().and_then(|d| {
                    d.spec
                        .as_ref()?
                        .template
                        .spec
                        .as_ref()?
                        .containers
                        .first()?
                        .image
                        .clone()
                });
                Ok((got.as_deref() == image).then_some(()))
            },
        )
        .await
    }
}
