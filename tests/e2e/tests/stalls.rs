//! A hub or an agent that stops for less than the hub's heartbeat timeout keeps its session,
//! on both carriers: the carriers' own keep-alives (the HTTP/2 PINGs, QUIC's idle timeout)
//! never cut a session before the session protocol's silence bound does. A starved hub (10,000
//! agents on two cores) lost thousands of sessions so, none to a heartbeat timeout. The stalls
//! are real processes stopped with SIGSTOP; the side that keeps running is the one that would
//! close, and it says so in its log while the other is still stopped.

use std::path::Path;
use std::time::Duration;

use flotilla_e2e::on_both_carriers;
use flotilla_e2e::{Hub, Proc, condition_status, start_agent, wait_for};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const AVAILABLE: &str = "ManagedClusterConditionAvailable";
/// The agent stopped: longer than the hub's HTTP/2 PING once allowed (sent after three
/// heartbeat intervals without a frame, given up 20 s later: 23 s here).
const AGENT_STALL: Duration = Duration::from_secs(30);
/// The hub stopped: longer than the agent's own keep-alives once allowed (gRPC: a PING after
/// 30 s without a frame, given up 20 s later; QUIC: its own 60 s idle timeout).
const HUB_STALL: Duration = Duration::from_secs(70);

/// A work for store-a named `name`: its spoke is a closed port, so the agent's status says the
/// apply failed, which is all the round trip needs.
fn work(name: &str) -> String {
    format!(
        "apiVersion: work.open-cluster-management.io/v1
kind: ManifestWork
metadata:
  name: {name}
  namespace: store-a
spec:
  workload:
    manifests:
    - apiVersion: v1
      kind: ConfigMap
      metadata:
        name: {name}
        namespace: default
"
    )
}

/// A round trip over the session: a work sent to store-a comes back with the agent's status.
/// Both sides have heard each other since it was sent.
async fn round_trip(hub: &Hub, dir: &Path, name: &str) -> anyhow::Result<()> {
    let file = dir.join(format!("{name}.yaml"));
    std::fs::write(&file, work(name))?;
    let applied = hub.cli(&["apply", "-f", file.to_str().unwrap_or_default()])?;
    anyhow::ensure!(
        applied.status.success(),
        "{}",
        String::from_utf8_lossy(&applied.stderr)
    );
    wait_for(
        &format!("the agent's status of {name}"),
        Duration::from_secs(30),
        || async {
            let w = hub.work("store-a", name)?;
            Ok(w.filter(|w| condition_status(w, "Applied").is_some())
                .map(|_| ()))
        },
    )
    .await
}

/// Stops `pid` for `stall`, then lets it go on.
async fn stop_for(pid: u32, stall: Duration) -> anyhow::Result<()> {
    let pid = Pid::from_raw(pid as i32);
    kill(pid, Signal::SIGSTOP)?;
    // The stall is the fault under test: its length is what the test is about.
    tokio::time::sleep(stall).await;
    kill(pid, Signal::SIGCONT)?;
    Ok(())
}

/// Neither side has seen the session end: the hub closed none, the agent lost none (it logs
/// `retry_in` for every session that ended and every dial that failed).
fn session_kept(hub: &Hub, agent: &Proc, after: &str) {
    let hub_log = hub.proc.log();
    assert!(
        !hub_log.contains("session closed") && !hub_log.contains("closing session"),
        "the hub closed the session while {after}:\n{hub_log}"
    );
    let agent_log = agent.log();
    assert!(
        !agent_log.contains("retry_in") && agent_log.matches("session established").count() == 1,
        "the agent lost its session while {after}:\n{agent_log}"
    );
}

on_both_carriers! {
    async fn a_stall_shorter_than_the_heartbeat_timeout_costs_no_session() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let hub = Hub::start(
            dir.path(),
            &[
                // Heartbeats every second; only 90 s of silence ends a session, and the cluster
                // stays Available meanwhile.
                "--heartbeat-interval=1s",
                "--heartbeat-timeout=90s",
                "--grace-period=300s",
            ],
        )
        .await?;
        hub.dev_cert("store-a", &dir.path().join("store-a"))?;
        let agent = start_agent(dir.path(), &hub, "store-a", &dir.path().join("store-a"))?;
        wait_for("store-a Available", Duration::from_secs(30), || async {
            Ok((hub.cluster_condition("store-a", AVAILABLE)?.as_deref() == Some("True")).then_some(()))
        })
        .await?;

        round_trip(&hub, dir.path(), "before-the-stalls").await?;

        // The hub keeps running and hears nothing from the agent.
        stop_for(agent.pid(), AGENT_STALL).await?;
        session_kept(&hub, &agent, "the agent was stopped");
        // Each side hears the other again before the next stall: the agent heard nothing
        // while it was stopped, and the two stalls back to back would be one silence longer
        // than the heartbeat timeout.
        round_trip(&hub, dir.path(), "after-the-agent-stall").await?;

        // The agent keeps running and hears nothing from the hub.
        stop_for(hub.proc.pid(), HUB_STALL).await?;
        session_kept(&hub, &agent, "the hub was stopped");
        round_trip(&hub, dir.path(), "after-the-hub-stall").await?;
        session_kept(&hub, &agent, "both went on");
        Ok(())
    }
}
