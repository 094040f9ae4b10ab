//! Checks that run before anything starts, so bad input fails at once with a message that
//! names the flag and the fix: too many agents (or klusterlet clients) for the open-file limit,
//! a port in use, an unreachable or non-loopback hub, a missing hub binary, missing CRDs.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail};

use crate::cli::{AgentTransport, FD_HEADROOM, HubMode, HubStore, RunArgs, Scenario};
use crate::klusterlet::CONNECTIONS_PER_CLIENT;
use crate::machine::raise_open_files_limit;

/// How long the harness waits for an existing hub to accept a TCP connection.
pub const REACH_TIMEOUT: Duration = Duration::from_secs(3);

/// File descriptors a process needs for `sessions` sessions (one socket each, plus headroom).
pub fn fds_needed(sessions: u64) -> u64 {
    sessions + FD_HEADROOM
}

/// Checks the file-descriptor budget of each process against RLIMIT_NOFILE (raising the soft
/// limit to the hard one first, as child processes inherit it).
pub fn check_fds(args: &RunArgs, limit: u64) -> anyhow::Result<()> {
    let n = args.agents as u64;
    let per_process = n.div_ceil(args.processes as u64);
    let in_process_hub = args.hub.is_none() && args.hub_mode == HubMode::InProcess;
    // The hub's end of the sessions: a socket each over TCP; over QUIC one UDP socket for all.
    let hub_sockets = if args.transport == AgentTransport::Quic {
        0
    } else {
        n
    };
    // An in-process hub holds the server end of every session in this process too.
    let here = if args.processes == 1 {
        per_process + if in_process_hub { hub_sockets } else { 0 }
    } else {
        if in_process_hub { hub_sockets } else { 0 }
    };
    if fds_needed(here) > limit || fds_needed(per_process) > limit {
        let most = limit.saturating_sub(FD_HEADROOM);
        let per = if in_process_hub { most / 2 } else { most };
        bail!(
            "--agents {n} needs about {} open files in one process ({} per agent{}), but the \
             open-file limit (ulimit -n, RLIMIT_NOFILE) is {limit}: use --processes {} or more{}, \
             or raise the hard limit",
            fds_needed(here.max(per_process)),
            if in_process_hub {
                "2 with the in-process hub"
            } else {
                "1"
            },
            if args.processes > 1 {
                format!(" with {per_process} agents per process")
            } else {
                String::new()
            },
            n.div_ceil(per.max(1)).max(2),
            if in_process_hub {
                " and --hub-mode child"
            } else {
                ""
            },
        );
    }
    // baseline-klusterlet's clients run in this process beside the agents that live here,
    // each holding its own connections to the apiserver.
    let clients = if args.scenarios.contains(&Scenario::BaselineKlusterlet) {
        n * CONNECTIONS_PER_CLIENT
    } else {
        0
    };
    if clients > 0 && fds_needed(here + clients) > limit {
        let per_agent =
            CONNECTIONS_PER_CLIENT + u64::from(args.processes == 1) + u64::from(in_process_hub);
        bail!(
            "scenario baseline-klusterlet runs one klusterlet client per agent in this process, \
             each with its own kube client holding about {CONNECTIONS_PER_CLIENT} connections \
             (two watches and one for writes): --agents {n} needs about {} open files here with \
             the {here} the agents{} hold, but the open-file limit (ulimit -n, RLIMIT_NOFILE) is \
             {limit}: lower --agents to about {}{}, or raise the hard limit",
            fds_needed(here + clients),
            if in_process_hub {
                " and the in-process hub"
            } else {
                ""
            },
            limit.saturating_sub(FD_HEADROOM) / per_agent,
            if args.processes == 1 {
                " (or move the agents into workers with --processes 2)"
            } else {
                ""
            },
        );
    }
    if let Some(gateways) = args.gateways {
        if args.gateway_netns > 0 {
            crate::netns::check_available()?;
        }
        // A gateway holds the sessions of its fair share of the shards, and first takes the
        // connections the load balancer sends it (one in N) to redirect those not its own.
        let shards = args.gateway_process_config("lt-gw-0")?.shards.shards as u64;
        let per_gateway_shards = shards.div_ceil(gateways as u64);
        let held = (n * per_gateway_shards).div_ceil(shards);
        let arriving = n.div_ceil(gateways as u64);
        let needed = fds_needed(held + arriving);
        if needed > limit {
            bail!(
                "--agents {n} over --gateways {gateways}: each gateway holds the sessions of up to \
                 {per_gateway_shards} of the {shards} shards (about {held}) and first takes about \
                 {arriving} connections to redirect, about {needed} open files, but the open-file \
                 limit (ulimit -n, RLIMIT_NOFILE) is {limit}: use more --gateways or raise the \
                 hard limit"
            );
        }
        return Ok(());
    }
    if args.hub.is_none() && args.hub_mode == HubMode::Child && fds_needed(hub_sockets) > limit {
        bail!(
            "--agents {n}: the hub is one process and holds one socket per session, but the \
             open-file limit is {limit}, so one hub can hold at most about {} sessions on this \
             machine; lower --agents or raise the hard limit (ulimit -Hn)",
            limit.saturating_sub(FD_HEADROOM)
        );
    }
    Ok(())
}

/// A port the harness is asked to bind must be free now.
pub fn check_port_free(flag: &str, addr: SocketAddr) -> anyhow::Result<()> {
    if addr.port() == 0 {
        return Ok(());
    }
    std::net::TcpListener::bind(addr).map(drop).map_err(|e| {
        anyhow::anyhow!(
            "{flag} {addr} cannot be used: {e} (is another hub running there? pick another port, \
             or 0 for any free one)"
        )
    })
}

/// Every check; nothing has started when it fails.
pub async fn check(args: &RunArgs) -> anyhow::Result<()> {
    let limit = raise_open_files_limit();
    check_fds(args, limit)?;
    if args.link.spec()?.is_some() {
        flotilla_wan::check_available()?;
    }
    match (args.hub, &args.data_dir) {
        (Some(hub), Some(data_dir)) => {
            anyhow::ensure!(
                data_dir.join("ca/ca.crt").exists()
                    && data_dir.join("operator/config.yaml").exists(),
                "--data-dir {} is not a flotilla hub's data directory (no ca/ca.crt or \
                 operator/config.yaml); give the --data-dir the hub was started with",
                data_dir.display()
            );
            tokio::time::timeout(REACH_TIMEOUT, tokio::net::TcpStream::connect(hub))
                .await
                .map_err(|_| anyhow::anyhow!("--hub {hub} did not answer within {REACH_TIMEOUT:?}"))?
                .with_context(|| format!("--hub {hub} is unreachable: is the hub running and listening for agents there?"))?;
        }
        _ => {
            check_port_free("--hub-listen", args.hub_listen)?;
            check_port_free("--hub-api-listen", args.hub_api_listen)?;
            if args.store == HubStore::Kube {
                let crds = crate::apiserver::crds_dir();
                anyhow::ensure!(
                    crds.is_dir(),
                    "--store kube installs flotilla's CRDs from {}, which does not exist: run the \
                     harness built from a flotilla checkout that has deploy/crds",
                    crds.display()
                );
            }
            if let Some(bin) = &args.hub_binary {
                anyhow::ensure!(
                    bin.is_file(),
                    "--hub-binary {} does not exist (build it with `cargo build --release -p flotilla-hub`)",
                    bin.display()
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> RunArgs {
        use clap::Parser;
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
    fn the_fd_budget_names_the_fix() {
        let err = check_fds(&args(&["--agents", "30000"]), 20_000)
            .unwrap_err()
            .to_string();
        assert!(err.contains("use --processes 2 or more"), "{err}");
        let err = check_fds(&args(&["--agents", "30000", "--processes", "2"]), 20_000)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("one hub can hold at most about 19744 sessions"),
            "{err}"
        );
        let err = check_fds(
            &args(&[
                "--agents",
                "12000",
                "--hub-mode",
                "in-process",
                "--scenario",
                "connect",
            ]),
            20_000,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("--hub-mode child"), "{err}");
        check_fds(&args(&["--agents", "15000"]), 20_000).unwrap();
        let baseline = |agents: &str, extra: &[&str]| {
            let mut a = vec![
                "--agents",
                agents,
                "--store",
                "kube",
                "--scenario",
                "connect,baseline-klusterlet",
            ];
            a.extend_from_slice(extra);
            check_fds(&args(&a), 20_000)
        };
        let err = baseline("5000", &[]).unwrap_err().to_string();
        assert!(
            err.contains("about 3 connections")
                && err.contains("lower --agents to about 4936 (or move the agents into workers"),
            "{err}"
        );
        baseline("4900", &[]).unwrap();
        // With the agents in workers, the clients alone count here.
        baseline("6000", &["--processes", "2"]).unwrap();
        check_fds(&args(&["--agents", "19000", "--processes", "2"]), 20_000).unwrap();
        // Over QUIC the hub holds one UDP socket for every session: only the agents' side
        // counts.
        let quic = ["--transport", "quic", "--processes", "4"];
        check_fds(&args(&[&["--agents", "50000"], &quic[..]].concat()), 20_000).unwrap();
        let err = check_fds(&args(&[&["--agents", "90000"], &quic[..]].concat()), 20_000)
            .unwrap_err()
            .to_string();
        assert!(err.contains("with 22500 agents per process"), "{err}");
    }

    #[test]
    fn each_gateway_has_its_own_budget() {
        let sharded = |agents: &str, gateways: &str| {
            args(&[
                "--agents",
                agents,
                "--processes",
                "8",
                "--store",
                "kube",
                "--gateways",
                gateways,
                "--gateway-arg=--shards=64",
            ])
        };
        // 60,000 agents over 6 gateways: 11 of 64 shards (10,313 sessions) and 10,000 arriving
        // connections each: over 20,000 files.
        let err = check_fds(&sharded("60000", "6"), 20_000)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--agents 60000 over --gateways 6")
                && err.contains("use more --gateways or raise the hard limit"),
            "{err}"
        );
        // Over 8 gateways (8 shards, 7,500 sessions and 7,500 arriving each) it fits, although
        // one hub could not hold them all.
        check_fds(&sharded("60000", "8"), 20_000).unwrap();
    }

    #[test]
    fn a_port_in_use_is_refused() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let err = check_port_free("--hub-listen", addr)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(&format!("--hub-listen {addr} cannot be used")),
            "{err}"
        );
        check_port_free("--hub-listen", "127.0.0.1:0".parse().unwrap()).unwrap();
    }
}
