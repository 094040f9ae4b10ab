//! `--gateway-netns K`: network namespaces for K of the gateways, so they run on their own
//! addresses as separate hosts would. Each namespace gets a veth pair with a private /30: the
//! host end in the root namespace, the other end inside, where its gateway listens. Agents in
//! the root namespace reach a namespaced gateway through the veth (the kernel picks the host
//! end as their source, since no loopback address routes there). The gateways inside reach the
//! hub apiserver, which listens on loopback only, through a relay the harness runs on the host
//! end of their veth; the apiserver's serving certificate names those addresses. Traffic stays
//! on loopback and these veths.
//!
//! The namespaces and their veths are deleted when [`Namespaces`] is dropped: at the end of a
//! run and on every error path.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use anyhow::{Context, bail};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tracing::{info, warn};

/// Port a namespaced gateway serves agents on (its namespace has its own ports).
pub const GATEWAY_PORT: u16 = 9443;
/// Port of a namespaced gateway's `/metrics`.
pub const METRICS_PORT: u16 = 9090;
/// Connections one relay to the apiserver carries at once: a gateway opens a few.
const RELAY_CONNECTIONS: usize = 64;
/// The most namespaces: the /30s of one /24.
pub const MAX_NAMESPACES: usize = 64;

/// One namespace as planned: its name, veth ends and addresses.
#[derive(Clone, Debug)]
pub struct Plan {
    pub name: String,
    host_if: String,
    inside_if: String,
    /// The host end of the veth, in the root namespace.
    pub host: Ipv4Addr,
    /// The end inside the namespace, where its gateway listens.
    pub inside: Ipv4Addr,
}

/// The namespaces of a run: named and addressed after this process's id, so two harnesses on
/// one machine do not collide.
pub fn plan(count: usize) -> Vec<Plan> {
    let pid = std::process::id();
    // 10.213.<pid mod 256>.0/24, one /30 per namespace.
    let third = (pid % 256) as u8;
    (0..count.min(MAX_NAMESPACES))
        .map(|j| {
            let base = (j * 4) as u8;
            let tag = pid % 100_000;
            Plan {
                name: format!("flotilla-lt-{pid}-{j}"),
                host_if: format!("flt{tag}h{j}"),
                inside_if: format!("flt{tag}g{j}"),
                host: Ipv4Addr::new(10, 213, third, base + 1),
                inside: Ipv4Addr::new(10, 213, third, base + 2),
            }
        })
        .collect()
}

/// The host ends and the insides of `plans`: the addresses the apiserver's serving certificate
/// and the gateways' certificate must name.
pub fn addresses(plans: &[Plan]) -> Vec<IpAddr> {
    plans
        .iter()
        .flat_map(|p| [IpAddr::V4(p.host), IpAddr::V4(p.inside)])
        .collect()
}

/// Namespaces that exist, with a relay to the apiserver on each host end.
pub struct Namespaces {
    made: Vec<Plan>,
    relays: Vec<JoinHandle<()>>,
    /// Per namespace: a kubeconfig of the hub apiserver through its relay.
    kubeconfigs: Vec<PathBuf>,
}

impl Namespaces {
    /// Creates the namespaces of `plans` with their veths and addresses, and a relay on each
    /// host end to the apiserver at `apiserver` (loopback), whose admin kubeconfig is
    /// `kubeconfig`; writes each namespace's kubeconfig into `dir`. On an error, what was made
    /// is deleted again.
    pub async fn create(
        plans: Vec<Plan>,
        apiserver: SocketAddr,
        kubeconfig: &Path,
        dir: &Path,
    ) -> anyhow::Result<Namespaces> {
        let mut made = Namespaces {
            made: Vec::new(),
            relays: Vec::new(),
            kubeconfigs: Vec::new(),
        };
        let admin = std::fs::read_to_string(kubeconfig)
            .with_context(|| format!("reading {}", kubeconfig.display()))?;
        let loopback_url = format!("https://{apiserver}");
        anyhow::ensure!(
            admin.contains(&loopback_url),
            "the apiserver's kubeconfig {} does not name {loopback_url}",
            kubeconfig.display()
        );
        for p in plans {
            // Whatever a crashed run of the same pid left.
            let _ = run(&["netns", "del", &p.name]);
            made.made.push(p.clone());
            let (host, inside) = (format!("{}/30", p.host), format!("{}/30", p.inside));
            for step in [
                vec!["netns", "add", &p.name],
                vec![
                    "link",
                    "add",
                    &p.host_if,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &p.inside_if,
                ],
                vec!["link", "set", &p.inside_if, "netns", &p.name],
                vec!["addr", "add", &host, "dev", &p.host_if],
                vec!["link", "set", &p.host_if, "up"],
                vec!["-n", &p.name, "addr", "add", &inside, "dev", &p.inside_if],
                vec!["-n", &p.name, "link", "set", &p.inside_if, "up"],
                vec!["-n", &p.name, "link", "set", "lo", "up"],
            ] {
                run(&step)?;
            }
            let listener = TcpListener::bind((p.host, 0))
                .await
                .with_context(|| format!("a relay to the apiserver on {}", p.host))?;
            let relay = listener.local_addr()?;
            made.relays
                .push(tokio::spawn(serve_relay(listener, apiserver)));
            let path = dir.join(format!("{}.kubeconfig", p.name));
            std::fs::write(
                &path,
                admin.replace(&loopback_url, &format!("https://{relay}")),
            )?;
            made.kubeconfigs.push(path);
            info!(namespace = %p.name, host = %p.host, inside = %p.inside, %relay, "network namespace ready");
        }
        Ok(made)
    }

    /// Namespace `j`'s plan and its kubeconfig of the hub apiserver.
    pub fn get(&self, j: usize) -> Option<(&Plan, &Path)> {
        Some((self.made.get(j)?, self.kubeconfigs.get(j)?.as_path()))
    }

    pub fn len(&self) -> usize {
        self.made.len()
    }

    pub fn is_empty(&self) -> bool {
        self.made.is_empty()
    }
}

impl Drop for Namespaces {
    /// Deletes every namespace made (its veth pair goes with it) and stops the relays.
    fn drop(&mut self) {
        for r in &self.relays {
            r.abort();
        }
        for p in &self.made {
            if let Err(e) = run(&["netns", "del", &p.name]) {
                warn!(namespace = %p.name, error = %format!("{e:#}"), "deleting the network namespace failed");
            }
            // Gone with the namespace unless the peer never moved into it.
            let _ = run(&["link", "del", &p.host_if]);
        }
    }
}

/// `ip <args>`, failing with its stderr.
fn run(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running ip (iproute2): --gateway-netns needs it, and root")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Forwards each connection on `listener` to `target`, at most [`RELAY_CONNECTIONS`] at once.
pub(crate) async fn serve_relay(listener: TcpListener, target: SocketAddr) {
    let slots = Arc::new(Semaphore::new(RELAY_CONNECTIONS));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let Ok((mut inbound, _)) = listener.accept().await else {
            return;
        };
        tokio::spawn(async move {
            let _permit = permit;
            if let Ok(mut outbound) = TcpStream::connect(target).await {
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            }
        });
    }
}

/// Whether this process may create network namespaces (root) and has `ip`.
pub fn check_available() -> anyhow::Result<()> {
    // The effective uid, second of the `Uid:` line of /proc/self/status.
    let euid = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(str::to_string))
        });
    anyhow::ensure!(
        euid.as_deref() == Some("0"),
        "--gateway-netns creates network namespaces and veth pairs, which needs root; run as root or leave out --gateway-netns"
    );
    let ok = Command::new("ip")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    anyhow::ensure!(
        ok,
        "--gateway-netns runs `ip netns` and `ip link` (iproute2), which is not installed; install iproute2 or leave out --gateway-netns"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_namespace_has_its_own_slash_30_and_short_interface_names() {
        let plans = plan(MAX_NAMESPACES + 5);
        assert_eq!(plans.len(), MAX_NAMESPACES);
        for (j, p) in plans.iter().enumerate() {
            assert!(p.host_if.len() <= 15 && p.inside_if.len() <= 15, "{p:?}");
            let [_, _, _, h] = p.host.octets();
            let [_, _, _, i] = p.inside.octets();
            assert_eq!((h, i), (4 * j as u8 + 1, 4 * j as u8 + 2));
            assert_eq!(p.host.octets()[..3], p.inside.octets()[..3]);
        }
        assert_eq!(addresses(&plans[..2]).len(), 4);
    }
}
