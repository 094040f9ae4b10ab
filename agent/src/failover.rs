//! Failover between joined hubs (OCM's MultipleHubs): with `--failover-order A,B,...` the agent
//! serves one of the hubs joined in its data directory at a time, the active one, and keeps the
//! others joined and idle. When the active hub's session has not been established for
//! `--hub-unreachable-timeout` (a hub down, unreachable, or refusing the cluster), the agent
//! stops serving it and serves the next hub of the order (after the last, the first again);
//! `flotilla-agent failover --to NAME` makes a hub the active one, and the running agent moves
//! to it within [`POLL_INTERVAL`]. The active hub is kept in `<data-dir>/active-hub`, so a
//! restarted agent serves the hub it served before.
//!
//! What a hub applied stays on the spoke when the agent moves away from it: its works and
//! enforced policies are neither deleted nor enforced (orphaned, the cache partition of that
//! hub kept as it was) until the agent serves that hub again, which then resumes its session
//! from that cache, or until the operator removes the hub (`flotilla-agent leave`). Only the
//! active hub's session, reconciler, governor and tunnel end run.

use std::path::{Path, PathBuf};
use std::time::Duration;

use flotilla_ops::{TaskError, TaskResult, Tasks};
use flotilla_transport::files::{Access, write_atomic};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::run::{STOP_TIMEOUT, ServedHub, start_hub, stopped};

/// The file under `--data-dir` that names the active hub.
pub const ACTIVE_HUB_FILE: &str = "active-hub";
/// Default of `--hub-unreachable-timeout`.
pub const DEFAULT_HUB_UNREACHABLE_TIMEOUT: &str = "5m";
/// Shortest accepted `--hub-unreachable-timeout`: below it a session's ordinary reconnect
/// (a gateway restart, its backoff) would already move the cluster to another hub.
pub const MIN_HUB_UNREACHABLE_TIMEOUT: Duration = Duration::from_secs(1);
/// How often the agent looks at the active hub's session and at the active-hub file.
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// How the agent fails over: the hubs in order of preference and how long the active one may
/// be unreachable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failover {
    /// Hub names, the first preferred.
    pub order: Vec<String>,
    pub unreachable_timeout: Duration,
}

/// `<data-dir>/active-hub`.
pub fn active_hub_path(data_dir: &Path) -> PathBuf {
    data_dir.join(ACTIVE_HUB_FILE)
}

/// The hub the active-hub file names, if the file exists and names one.
pub fn read_active(data_dir: &Path) -> std::io::Result<Option<String>> {
    match std::fs::read_to_string(active_hub_path(data_dir)) {
        Ok(text) => Ok(Some(text.trim().to_string()).filter(|name| !name.is_empty())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Names `hub` the active hub (durably: a crash leaves the old name or the new one).
pub fn write_active(data_dir: &Path, hub: &str) -> std::io::Result<()> {
    write_atomic(
        &active_hub_path(data_dir),
        format!("{hub}\n").as_bytes(),
        Access::Public,
    )
}

/// Serves `hubs` (in `failover.order`, every one joined) one at a time, as the module says,
/// until `stop` turns true. Ends with an error only when a task of the active hub ends on its
/// own, as any of the agent's tasks would.
pub(crate) async fn serve(
    hubs: Vec<ServedHub>,
    failover: Failover,
    data_dir: PathBuf,
    stop: watch::Receiver<bool>,
) -> TaskResult {
    let position = |name: &str| failover.order.iter().position(|n| n == name);
    let mut active = match read_active(&data_dir) {
        Ok(Some(name)) if position(&name).is_some() => name,
        Ok(Some(name)) => {
            warn!(hub = %name, order = %failover.order.join(","), "the active-hub file names a hub outside --failover-order; serving the first of the order");
            failover.order[0].clone()
        }
        Ok(None) => failover.order[0].clone(),
        Err(e) => {
            warn!(error = %e, "cannot read the active-hub file; serving the first of --failover-order");
            failover.order[0].clone()
        }
    };
    loop {
        let Some(hub) = hubs
            .iter()
            .find(|h| h.config.hub_name.as_deref() == Some(&active))
        else {
            return Err(format!("hub {active} of --failover-order is not served").into());
        };
        if let Err(e) = write_active(&data_dir, &active) {
            warn!(error = %e, hub = %active, "cannot record the active hub; a restart may serve another");
        }
        let connected = hub.parts.metrics.clone();
        let (hub_stop, _) = watch::channel(false);
        let mut tasks = Tasks::new();
        start_hub(hub.clone(), &mut tasks, &hub_stop).map_err(|e| Box::new(e) as TaskError)?;
        info!(hub = %active, standby = %failover.order.iter().filter(|n| **n != active).cloned().collect::<Vec<_>>().join(","), "serving the active hub of the failover order");
        let next = tokio::select! {
            () = stopped(stop.clone()) => None,
            ended = tasks.first_end() => return Err(Box::new(ended)),
            next = next_hub(&active, &failover, &data_dir, || connected.is_connected()) => Some(next),
        };
        hub_stop.send_replace(true);
        let aborted = tasks.stop_within(STOP_TIMEOUT).await;
        if aborted > 0 {
            warn!(aborted, hub = %active, "tasks of the hub left were aborted at the stop deadline");
        }
        match next {
            Some(next) => active = next,
            None => return Ok(()),
        }
    }
}

/// Waits until the agent should serve another hub than `active`, and names it: the one the
/// active-hub file names when the operator changed it, or the next of the order once
/// `active`'s session has not been established for the timeout.
async fn next_hub(
    active: &str,
    failover: &Failover,
    data_dir: &Path,
    connected: impl Fn() -> bool,
) -> String {
    let mut last_connected = Instant::now();
    let mut ticks = tokio::time::interval(POLL_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if let Ok(Some(told)) = read_active(data_dir)
            && told != active
        {
            if failover.order.contains(&told) {
                info!(from = %active, to = %told, "told to serve another hub");
                return told;
            }
            warn!(hub = %told, order = %failover.order.join(","), "the active-hub file names a hub outside --failover-order; ignored");
        }
        if connected() {
            last_connected = Instant::now();
            continue;
        }
        if last_connected.elapsed() >= failover.unreachable_timeout {
            let at = failover
                .order
                .iter()
                .position(|n| n == active)
                .unwrap_or_default();
            let next = failover.order[(at + 1) % failover.order.len()].clone();
            warn!(from = %active, to = %next, timeout = ?failover.unreachable_timeout, "the active hub has been unreachable for the timeout; failing over");
            return next;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    fn failover(timeout: Duration) -> Failover {
        Failover {
            order: vec!["dept".into(), "central".into(), "edge".into()],
            unreachable_timeout: timeout,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_unreachable_hub_is_left_for_the_next_after_the_timeout_only() {
        let dir = tempfile::tempdir().unwrap();
        let failover = failover(Duration::from_secs(30));
        let up = Arc::new(AtomicBool::new(true));
        let connected = {
            let up = Arc::clone(&up);
            move || up.load(Ordering::Relaxed)
        };
        let next = tokio::spawn({
            let (failover, data_dir) = (failover.clone(), dir.path().to_path_buf());
            async move { next_hub("central", &failover, &data_dir, connected).await }
        });
        // Connected for a minute: the hub is kept.
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!next.is_finished(), "a connected hub was left");
        // Down: left once it has been down for the timeout, for the next of the order.
        up.store(false, Ordering::Relaxed);
        let down_at = Instant::now();
        assert_eq!(next.await.unwrap(), "edge");
        let down = down_at.elapsed();
        assert!(
            down >= Duration::from_secs(29) && down <= Duration::from_secs(31),
            "left after {down:?} down"
        );
        // After the last of the order comes the first.
        up.store(false, Ordering::Relaxed);
        let never = || false;
        assert_eq!(next_hub("edge", &failover, dir.path(), never).await, "dept");
    }

    #[tokio::test(start_paused = true)]
    async fn the_operator_names_the_next_hub_in_the_active_hub_file() {
        let dir = tempfile::tempdir().unwrap();
        let failover = failover(Duration::from_secs(300));
        write_active(dir.path(), "central").unwrap();
        let next = tokio::spawn({
            let (failover, data_dir) = (failover.clone(), dir.path().to_path_buf());
            async move { next_hub("central", &failover, &data_dir, || true).await }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(
            !next.is_finished(),
            "the file names the active hub: nothing to do"
        );
        // A hub outside the order is ignored; one in it is served next.
        write_active(dir.path(), "elsewhere").unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!next.is_finished(), "moved to a hub outside the order");
        write_active(dir.path(), "dept").unwrap();
        assert_eq!(next.await.unwrap(), "dept");
        assert_eq!(read_active(dir.path()).unwrap().as_deref(), Some("dept"));
    }
}
