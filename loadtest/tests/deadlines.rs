//! The harness never hangs on a hub that misbehaves: a hub that does not stop when signalled,
//! or one that stopped listening, fails the scenario within its deadline, and the error names
//! the cause. The misbehaving hubs are the real hub behind a small shell wrapper that ignores
//! SIGTERM (and, for the second case, kills the hub under it once it listens).

mod common;

use std::path::Path;
use std::time::Duration;

use common::{args, trace_init};
use flotilla_loadtest::report::Outcome;

/// Longest a whole run may take here: a scenario deadline, the harness's stop bound
/// (`HUB_STOP_TIMEOUT`, 30 s) and a margin. Past it, the harness itself hung.
const RUN_BOUND: Duration = Duration::from_secs(150);

/// Writes an executable wrapper `name` that runs the real hub (this package's binary, `hub`)
/// with the wrapper's arguments, after `before` and with `after` in place of waiting for it.
fn wrapper(dir: &Path, name: &str, body: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    let exe = env!("CARGO_BIN_EXE_flotilla-loadtest");
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\nHUB=\"{exe}\"\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_that_does_not_stop_fails_the_scenario_with_the_reason() {
    trace_init();
    let dir = tempfile::tempdir().unwrap();
    // SIGTERM reaches the wrapper only; it ignores it and keeps waiting for the hub.
    let hub = wrapper(
        dir.path(),
        "stubborn-hub",
        "trap '' TERM\n\"$HUB\" hub \"$@\" &\nwait",
    );
    let mut run = args(
        &dir.path().join("out"),
        &[
            "--agents",
            "20",
            "--scenario",
            "storm",
            "--storm-signal",
            "term",
            "--timeout",
            "30s",
        ],
    );
    run.hub_binary = Some(hub);
    let (report, _) = tokio::time::timeout(RUN_BOUND, flotilla_loadtest::run(run))
        .await
        .expect("the harness itself hung")
        .expect("the run starts");
    let storm = &report.scenarios[0];
    assert_eq!(storm.outcome, Some(Outcome::Failed), "{storm:?}");
    let error = storm.error.as_deref().unwrap_or_default();
    assert!(
        error.contains("did not exit within 30s of SIGTERM; killed it"),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_that_stopped_listening_fails_the_scenario_naming_it() {
    trace_init();
    let dir = tempfile::tempdir().unwrap();
    // Starts the hub, kills it once the harness has enrolled the agents (their identities are
    // on disk beside the hub's data dir) and stays up itself, ignoring SIGTERM: the harness
    // sees a live process and a closed port.
    let hub = wrapper(
        dir.path(),
        "deaf-hub",
        r#""$HUB" hub "$@" &
hub=$!
prev=""; for a in "$@"; do [ "$prev" = "--data-dir" ] && data=$a; prev=$a; done
while [ ! -d "$data/../agent-identities" ]; do sleep 0.05; done
kill -9 $hub
trap '' TERM
while :; do sleep 1; done"#,
    );
    let mut run = args(
        &dir.path().join("out"),
        &[
            "--agents",
            "20",
            "--scenario",
            "connect",
            "--timeout",
            "15s",
            "--max-backoff",
            "1s",
        ],
    );
    run.hub_binary = Some(hub);
    let (report, _) = tokio::time::timeout(RUN_BOUND, flotilla_loadtest::run(run))
        .await
        .expect("the harness itself hung")
        .expect("the run starts");
    let connect = &report.scenarios[0];
    assert_ne!(connect.outcome, Some(Outcome::Completed), "{connect:?}");
    let error = connect.error.as_deref().unwrap_or_default();
    assert!(
        error.contains("the hub stopped listening on 127.0.0.1:"),
        "{error}"
    );
    assert!(
        error.contains("20 agents could not connect: 20 connection refused"),
        "{error}"
    );
}
