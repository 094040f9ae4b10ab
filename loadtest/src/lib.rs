//! flotilla's load-test harness: thousands of agents, each the real agent library (its session
//! loop over real TLS and HTTP/2, cache, reconciler and status logic) over an in-memory
//! cluster, against a real hub that the harness starts (a child process or in-process) or finds
//! on loopback. It drives scenarios (connect, fanout, storm, outage, feedback, and with
//! `--store kube` baseline-klusterlet), shows progress, and writes a versioned JSON report, a table and SVG
//! plots.
//!
//! Not for: proving correctness in the small (the crates' own tests do that), or traffic to
//! anything but this machine: every address it dials or binds is loopback (or, with
//! `--gateway-netns`, a veth pair it creates to a network namespace on this machine).
//!
//! * [`cli`]: flags, defaults and their validation; [`bench`]: the placement scheduler's model
//!   alone (`bench-scheduler`).
//! * [`preflight`]: checks that fail before anything starts (file descriptors, ports, the hub).
//! * [`fleet`]: the hub under test, and enrolling the agents with its CA and operator API;
//!   [`gateways`]: with `--gateways N`, the gateway processes beside it (scale-out mode);
//!   [`netns`]: with `--gateway-netns K`, network namespaces for some of them; [`link`]:
//!   with `--link`, the agents' worker processes behind emulated wide-area links, and
//!   `link-check`, which measures one.
//! * [`swarm`]: many agents in one process; [`agents`]: one swarm here, or one per worker
//!   process (`--processes`).
//! * [`scenario`]: the scenarios; [`placement`]: the placement ones (`rollout`, `schedule`);
//!   [`governance`]: policies over the fleet and their compliance on the hub;
//!   [`report`] and [`plot`]: what comes out.
//! * [`apiserver`] (with [`prometheus`]): with `--store kube`, the hub's real kube-apiserver and
//!   the load each scenario puts on it; [`klusterlet`] and [`baseline`]: the
//!   `baseline-klusterlet` scenario, the same clusters as klusterlet-style clients that each
//!   list and watch an apiserver themselves.
//!
//! Each simulated agent is `flotilla_agent::run_with`, the agent binary's own loop, watched
//! through its `Observer`; only the spoke apiserver is simulated.
#![forbid(unsafe_code)]

pub mod agents;
pub mod apiserver;
pub mod bare;
pub mod baseline;
pub mod bench;
pub mod chaos;
pub mod cli;
pub mod clock;
pub mod feedback;
pub mod fleet;
pub mod gateways;
pub mod governance;
pub mod klusterlet;
pub mod link;
pub mod machine;
pub mod netns;
pub mod operator;
pub mod over_links;
pub mod placement;
pub mod plot;
pub mod preflight;
pub use flotilla_ops::exposition as prometheus;
pub mod proxy;
pub mod report;
pub mod scenario;
pub mod sim;
pub mod swarm;

use std::path::PathBuf;

use anyhow::Context;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::apiserver::{Apiserver, ApiserverSnapshot};
use crate::cli::{Enrollment, RunArgs, Scenario};
use crate::fleet::{Hub, Identity};
use crate::machine::Machine;
use crate::report::{HubInfo, Report, SCHEMA};
use crate::scenario::Run;
use crate::swarm::{JoinSpec, SwarmSpec};

/// The environment variable that makes a process of the harness (the hub or a gateway it
/// re-executes) log JSON lines, one object per event, instead of text.
pub const LOG_FORMAT_ENV: &str = "FLOTILLA_LOADTEST_LOG_FORMAT";

/// Where a run's outputs go: `--out`, or a fresh `./loadtest-<time>`.
pub fn out_dir(args: &RunArgs) -> PathBuf {
    args.out.clone().unwrap_or_else(|| {
        let stamp = jiff::Zoned::now().strftime("%Y%m%d-%H%M%S").to_string();
        PathBuf::from(format!("loadtest-{stamp}"))
    })
}

/// Runs the scenarios of `args`; writes `report.json` and the plots into the output directory
/// and returns the report with that directory.
pub async fn run(mut args: RunArgs) -> anyhow::Result<(Report, PathBuf)> {
    args.validate()?;
    if args.scenarios.contains(&Scenario::Chaos) {
        let seed = *args.chaos_seed.get_or_insert_with(rand::random);
        // Printed before anything can fail, so a run that dies can still be replayed.
        eprintln!("chaos seed {seed} (replay with --chaos-seed {seed})");
    }
    let out = out_dir(&args);
    preflight::check(&args).await?;
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let out = out.canonicalize()?;
    let started_at = jiff::Timestamp::now().to_string();
    let machine = Machine::read();
    let progress = MultiProgress::with_draw_target(if args.quiet {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr()
    });
    let status = progress.add(ProgressBar::new_spinner());
    status.set_style(ProgressStyle::with_template("{spinner} {msg}").expect("static template"));
    status.enable_steady_tick(std::time::Duration::from_millis(200));

    status.set_message("starting the hub");
    let run_dir = tempfile::Builder::new().prefix("run-").tempdir_in(&out)?;
    let hub = Hub::start(&args, run_dir.path()).await?;
    let hub_info = HubInfo {
        mode: hub.mode.to_string(),
        agents_address: hub.agents.to_string(),
        api_address: hub.api.to_string(),
        store: if args.hub.is_some() {
            // An existing hub's store is its own business.
            "unknown".to_string()
        } else {
            args.store.to_string()
        },
        apiserver_url: hub.apiserver().map(|a| a.url().to_string()),
        apiserver_pid: hub.apiserver().map(Apiserver::pid),
        nice: hub.pid().and_then(fleet::nice_of),
    };
    let api = hub.operator()?;

    let names: Vec<String> = (0..args.agents).map(|i| args.cluster_name(i)).collect();
    let (identities, join) = match args.enroll {
        Enrollment::Issue => {
            status.set_message(format!(
                "enrolling {} agents (certificates from the hub CA)",
                args.agents
            ));
            let bar = progress.add(ProgressBar::new(args.agents as u64));
            let identities = hub.enroll(names, &bar).await?;
            bar.finish_and_clear();
            (identities, None)
        }
        Enrollment::Join => {
            status.set_message("creating a bootstrap token for the agents to join with");
            // Good for every scenario's longest run, and no longer.
            let ttl = args.timeout * (args.scenarios.len() as u32 + 1);
            let (token, ca_fingerprint) = api.bootstrap_token(args.agents, ttl).await?;
            let identities = names.into_iter().map(Identity::to_join).collect();
            let join = JoinSpec {
                token,
                ca_fingerprint,
            };
            (identities, Some(join))
        }
    };
    let spec = SwarmSpec::for_run(&args, &hub, run_dir.path(), join)?;
    let mut run = Run::new(
        args.clone(),
        hub,
        api,
        identities,
        spec,
        progress.clone(),
        run_dir.path().to_path_buf(),
    );
    let mut scenarios = Vec::new();
    for s in &args.scenarios {
        status.set_message(format!("scenario {s:?}"));
        let before = apiserver_snapshot(&run.hub).await;
        let mut report = match s {
            Scenario::Connect => run.connect().await,
            Scenario::Fanout => run.fanout().await,
            Scenario::Storm => run.storm(false).await,
            Scenario::Outage => run.storm(true).await,
            Scenario::BaselineKlusterlet => run.baseline_klusterlet(&scenarios).await,
            Scenario::Rollout => run.rollout().await,
            Scenario::Schedule => run.schedule().await,
            Scenario::BaselineBare => run.baseline_bare(&scenarios).await,
            Scenario::Feedback => run.feedback().await,
            Scenario::Proxy => run.proxy().await,
            Scenario::Links => run.links().await,
            Scenario::Chaos => run.chaos().await,
            Scenario::Governance => run.governance().await,
        };
        // The chaos scenario restarts the apiserver, whose counters then start again: it counts
        // its requests itself, window by window.
        let restarts = *s == Scenario::Chaos;
        if let (false, Some(before), Some(after)) =
            (restarts, before, apiserver_snapshot(&run.hub).await)
        {
            let own = run.hub.apiserver().map_or(0, Apiserver::own_watches);
            report.apiserver = Some(after.load_since(&before, own));
        }
        scenarios.push(report);
    }
    status.set_message("stopping agents and hub");
    let shutdown = run.shutdown().await;
    status.finish_and_clear();

    let mut report = Report {
        schema: SCHEMA.to_string(),
        tool_version: env!("CARGO_PKG_VERSION").to_string(),
        started_at,
        finished_at: jiff::Timestamp::now().to_string(),
        command: std::env::args().collect(),
        parameters: args,
        machine,
        hub: hub_info,
        scenarios,
        plots: Vec::new(),
    };
    report.plots = plot::write_all(&report, &out)?;
    std::fs::write(
        out.join("report.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    if let Err(e) = shutdown {
        tracing::warn!(error = %format!("{e:#}"), "stopping the hub failed");
    }
    // Keep hub and worker logs only when something went wrong.
    let failed = report
        .scenarios
        .iter()
        .any(|s| s.outcome != Some(report::Outcome::Completed));
    if failed || report.parameters.keep_logs {
        let kept = run_dir.keep();
        let _ = std::fs::remove_dir_all(kept.join("hub-data/store"));
        let _ = std::fs::remove_dir_all(kept.join("agent-cache"));
        let _ = std::fs::remove_dir_all(kept.join("agent-identities"));
    }
    Ok((report, out))
}

/// The hub apiserver's counters now (`--store kube`); a failure to read them is logged and
/// leaves the scenario without an `apiserver` field rather than failing it.
async fn apiserver_snapshot(hub: &Hub) -> Option<ApiserverSnapshot> {
    match hub.apiserver()?.snapshot().await {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "reading the hub apiserver's metrics failed");
            None
        }
    }
}
