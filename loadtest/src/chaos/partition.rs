//! Partitions for the chaos scenario, made with nftables rules on this machine's loopback.
//!
//! Everything of a run talks over loopback, told apart by port: a gateway's agent port (TCP
//! for gRPC, UDP for QUIC) is its own, and each gateway reaches the hub apiserver through a
//! relay of its own ([`Relays`]), so its apiserver traffic has a port of its own too. A
//! partition is a base chain on the output hook (every loopback packet passes it once) that
//! drops both directions of those ports; healing deletes the chain. Connections open across a
//! partition are not reset: their packets vanish, as on a real network, until the heal or
//! their own timeouts.
//!
//! The rules live in one table named after this process, deleted when [`Firewall`] is dropped
//! (at the end of a run and on every error path).

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// One relay per gateway from a loopback port of its own to the hub apiserver.
pub struct Relays {
    ports: Vec<u16>,
    kubeconfigs: Vec<PathBuf>,
    tasks: Vec<JoinHandle<()>>,
}

impl Relays {
    /// Starts `n` relays to `apiserver` (loopback) and writes, into `dir`, a kubeconfig per
    /// relay from the apiserver's admin `kubeconfig`.
    pub async fn start(
        n: usize,
        apiserver: SocketAddr,
        kubeconfig: &Path,
        dir: &Path,
    ) -> anyhow::Result<Relays> {
        let admin = std::fs::read_to_string(kubeconfig)
            .with_context(|| format!("reading {}", kubeconfig.display()))?;
        let url = format!("https://{apiserver}");
        anyhow::ensure!(
            admin.contains(&url),
            "the apiserver's kubeconfig {} does not name {url}",
            kubeconfig.display()
        );
        let mut relays = Relays {
            ports: Vec::new(),
            kubeconfigs: Vec::new(),
            tasks: Vec::new(),
        };
        for k in 0..n {
            let listener = TcpListener::bind(("127.0.0.1", 0))
                .await
                .context("a relay to the apiserver")?;
            let relay = listener.local_addr()?;
            relays
                .tasks
                .push(tokio::spawn(crate::netns::serve_relay(listener, apiserver)));
            let path = dir.join(format!("gateway-{k}-relay.kubeconfig"));
            std::fs::write(&path, admin.replace(&url, &format!("https://{relay}")))?;
            relays.ports.push(relay.port());
            relays.kubeconfigs.push(path);
        }
        Ok(relays)
    }

    /// Gateway `k`'s relay port.
    pub fn port(&self, k: usize) -> Option<u16> {
        self.ports.get(k).copied()
    }

    /// The kubeconfigs, gateway by gateway.
    pub fn kubeconfigs(&self) -> Vec<PathBuf> {
        self.kubeconfigs.clone()
    }
}

impl Drop for Relays {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// What a partition cuts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// TCP to and from this port: a gateway's relay to the apiserver.
    Tcp(u16),
    /// TCP and UDP to and from this port: a gateway's agent port, both carriers.
    TcpAndUdp(u16),
}

impl Cut {
    /// The nft rules dropping it.
    fn rules(self) -> Vec<String> {
        let (protocols, port): (&[&str], u16) = match self {
            Cut::Tcp(p) => (&["tcp"], p),
            Cut::TcpAndUdp(p) => (&["tcp", "udp"], p),
        };
        protocols
            .iter()
            .flat_map(|proto| {
                ["dport", "sport"].map(|dir| format!("oifname \"lo\" {proto} {dir} {port} drop"))
            })
            .collect()
    }
}

/// The run's nftables table of partitions.
pub struct Firewall {
    table: String,
}

impl Firewall {
    /// Creates the run's table; fails, saying what to install, without nft or root.
    pub fn create() -> anyhow::Result<Firewall> {
        let table = format!("flotilla_chaos_{}", std::process::id());
        // Whatever a crashed run of the same pid left.
        let _ = nft(&format!("delete table inet {table}\n"));
        nft(&format!("add table inet {table}\n"))?;
        Ok(Firewall { table })
    }

    /// Cuts `cut` as partition `id` until [`Firewall::heal`].
    pub fn partition(&self, id: usize, cut: Cut) -> anyhow::Result<()> {
        let chain = format!("inet {} p{id}", self.table);
        let mut script =
            format!("add chain {chain} {{ type filter hook output priority 0; policy accept; }}\n");
        for rule in cut.rules() {
            script.push_str(&format!("add rule {chain} {rule}\n"));
        }
        nft(&script)
    }

    /// Heals partition `id`.
    pub fn heal(&self, id: usize) -> anyhow::Result<()> {
        let chain = format!("inet {} p{id}", self.table);
        nft(&format!("flush chain {chain}\ndelete chain {chain}\n"))
    }
}

impl Drop for Firewall {
    fn drop(&mut self) {
        if let Err(e) = nft(&format!("delete table inet {}\n", self.table)) {
            tracing::warn!(table = %self.table, error = %format!("{e:#}"), "deleting the chaos scenario's nftables table failed");
        }
    }
}

/// Runs `nft -f -` with `script`, failing with its stderr.
fn nft(script: &str) -> anyhow::Result<()> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("running nft: the chaos scenario's partitions need nftables (apt-get install nftables) and root")?;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(script.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "nft: {} (script: {})",
            String::from_utf8_lossy(&out.stderr).trim(),
            script.trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_drops_both_directions_of_its_port_on_loopback() {
        assert_eq!(
            Cut::Tcp(6443).rules(),
            [
                "oifname \"lo\" tcp dport 6443 drop",
                "oifname \"lo\" tcp sport 6443 drop"
            ]
        );
        assert_eq!(Cut::TcpAndUdp(9443).rules().len(), 4);
        assert!(Cut::TcpAndUdp(9443).rules()[2].contains("udp dport 9443"));
    }
}
