//! The chaos scenario's run: every agent connected, the evidence watches started, a fan-out
//! and a progressive rollout set going, the schedule's faults done and undone on time, then
//! convergence waited for and every invariant judged from what was kept.
//!
//! The workload runs beside the faults through the operator API alone (its own task, retrying
//! what a fault makes fail), so the injector holds the processes: the hub, the gateways, the
//! agents' workers and the apiserver.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::chaos::fencing::{self, LeaseChange, LeaseHistory};
use crate::chaos::partition::{Cut, Firewall};
use crate::chaos::requests::{Costs, Meter};
use crate::chaos::schedule::{self, Act, Action, FaultKind, ScheduleSpec, Targets};
use crate::chaos::unknown::{self, UnknownMark};
use crate::chaos::{ActDone, ChaosReport, Invariant, Verdict, fault_before};
use crate::operator::{OperatorApi, condition};
use crate::placement::{NAMESPACE, REPLICA_SET_LABEL, ROLLOUT, bind_global, replica_set};
use crate::report::ScenarioReport;
use crate::scenario::{Clock, Run, bounded, work_json};

/// How often a workload step that a fault made fail is tried again.
const RETRY_EVERY: Duration = Duration::from_millis(500);
/// How often convergence is checked once the faults are over.
const CONVERGE_POLL: Duration = Duration::from_secs(1);
/// The most Lease changes kept (a 64-shard fleet renewing every few seconds for an hour stays
/// well below).
const MAX_LEASE_CHANGES: usize = 1 << 20;
/// The rollout's revisions: the first at the start, the second halfway through the faults.
const ROLLOUT_REVISIONS: [u32; 2] = [1, 2];

impl Run {
    /// `chaos`: see the module doc.
    pub async fn chaos(&mut self) -> ScenarioReport {
        let mut r = ScenarioReport::new("chaos", self.identities.len());
        // Connecting, the faults, then convergence: --timeout is for the parts around them.
        let clock = Clock::new(self.args.chaos_duration + self.args.timeout);
        let result = bounded(&clock, self.chaos_inner(&clock, &mut r)).await;
        if r.chaos.is_some() {
            // It got to its judgement and stopped every process itself: the judgement says
            // what went wrong, not a probe of the stopped hub.
            crate::scenario::finish(&mut r, &clock, result);
        } else {
            self.conclude(&mut r, &clock, result).await;
        }
        r
    }

    async fn chaos_inner(&mut self, clock: &Clock, r: &mut ScenarioReport) -> anyhow::Result<bool> {
        let seed = self
            .args
            .chaos_seed
            .context("the chaos seed is chosen when the run starts")?;
        let (lease_namespace, gateways, gateway_ports) = {
            let g = self.hub.gateways().context("chaos needs --gateways")?;
            (
                g.lease_namespace().to_string(),
                g.len(),
                g.addresses().iter().map(|a| a.port()).collect::<Vec<_>>(),
            )
        };
        let lease_duration = self
            .args
            .gateway_process_config("lt-gw-0")?
            .shards
            .lease_duration;
        self.ensure_connected(clock).await?;
        let spec = ScheduleSpec {
            seed,
            window: self.args.chaos_duration,
            kinds: self.args.chaos_faults.clone(),
            targets: Targets {
                gateways,
                workers: self.agents.as_ref().map_or(0, |a| a.workers()),
            },
            lease_duration,
        };
        let faults = schedule::schedule(&spec);
        let mut report = ChaosReport {
            seed,
            window_s: spec.window.as_secs_f64(),
            faults: faults.clone(),
            ..Default::default()
        };
        for f in &faults {
            *report.faults_by_kind.entry(f.kind.to_string()).or_default() += 1;
        }
        let partitions = faults.iter().any(|f| {
            matches!(
                f.kind,
                FaultKind::GatewayApiserverPartition | FaultKind::AgentsGatewayPartition
            )
        });
        let firewall = if partitions {
            Some(Firewall::create()?)
        } else {
            None
        };

        let apiserver = self
            .hub
            .apiserver()
            .context("chaos needs --store kube")?
            .client()
            .await?;
        let (stop_watches, stopped) = watch::channel(false);
        let lease_watch = tokio::spawn(watch_leases(
            apiserver.clone(),
            lease_namespace,
            stopped.clone(),
        ));
        let unknown_watch = tokio::spawn(watch_unknown(
            apiserver.clone(),
            self.identities.iter().map(|i| i.name.clone()).collect(),
            stopped.clone(),
        ));

        let clusters: Vec<String> = self.identities.iter().map(|i| i.name.clone()).collect();
        let fanout = self.next_work_name("chaos");
        let operator_retries = Arc::new(AtomicU64::new(0));
        let workload = tokio::spawn(workload(
            self.api.clone(),
            clusters.clone(),
            fanout.clone(),
            self.args.rollout_max_concurrency.clone(),
            spec.window / 2,
            operator_retries.clone(),
        ));

        let own_watches = self.hub.apiserver().map_or(0, |a| a.own_watches());
        let mut meter = Meter::default();
        meter.open(self.apiserver_snapshot().await);
        let bar = self.bar("chaos", faults.len() as u64);
        let start = Instant::now();
        let start_unix_ms = unix_ms();
        for action in schedule::actions(&faults) {
            tokio::time::sleep_until(start + action.at).await;
            bar.set_message(format!("{:?} of {}", action.act, action.target));
            let error = self
                .act(action, &firewall, &gateway_ports, &mut meter, own_watches)
                .await
                .err()
                .map(|e| format!("{e:#}"));
            if let Some(e) = &error {
                tracing::warn!(fault = action.fault, act = ?action.act, error = %e, "chaos act failed");
            }
            report.acts.push(ActDone {
                fault: action.fault,
                act: action.act,
                target: action.target,
                due_s: action.at.as_secs_f64(),
                done_s: start.elapsed().as_secs_f64(),
                error,
            });
            if action.act.undone_by().is_none() {
                bar.inc(1);
            }
        }
        // The window's end: nothing is broken any more.
        tokio::time::sleep_until(start + spec.window).await;
        let faults_over_s = start.elapsed().as_secs_f64();
        bar.set_message("workload finishing");
        let workload = workload.await.context("the workload task panicked")?;
        if let Err(e) = &workload {
            tracing::warn!(error = %format!("{e:#}"), "chaos workload");
        }

        bar.set_message("converging");
        let convergence = self
            .wait_converged(clock, &clusters, &fanout, ROLLOUT_REVISIONS[1])
            .await?;
        bar.set_message("auditing statuses");
        let (audit, settled) = self.converge_and_audit(clock, 0).await?;
        bar.finish_and_clear();
        meter.close(self.apiserver_snapshot().await, own_watches);
        let metered = start.elapsed();
        let sessions: HashMap<String, Vec<(u64, bool)>> = self
            .records()
            .await?
            .into_iter()
            .map(|r| (r.name, r.session_log))
            .collect();

        let mut invariants = Vec::new();
        invariants.push(Invariant::new(
            "every cluster converged",
            workload.is_ok() && convergence.missing.is_empty(),
            match &workload {
                Ok(()) => convergence.describe(clusters.len()),
                Err(e) => format!("the workload could not be created: {e:#}"),
            },
        ));
        invariants.push(Invariant::new(
            "no status lost or duplicated",
            settled && audit.lost == 0 && audit.duplicated == 0,
            format!(
                "{} statuses compared, {} lost, {} duplicated acks, {} unacked, {} works without status{}",
                audit.compared,
                audit.lost,
                audit.duplicated,
                audit.unacked,
                audit.without_status,
                if audit.examples.is_empty() {
                    String::new()
                } else {
                    format!(": {}", audit.examples.join("; "))
                }
            ),
        ));

        // Every process asked to stop, each timed: the gateways first (their logs are then
        // complete), the agents, the hub.
        let _ = stop_watches.send(true);
        let lease_changes = lease_watch.await.unwrap_or_default();
        report.lease_changes = lease_changes.len() as u64;
        let marks = unknown_watch.await.unwrap_or_default();
        let wrong = unknown::judge(&marks, &sessions);
        // The gateways run with their default grace period.
        let grace = flotilla_gateway::GatewayConfig::default().grace_period;
        let not_due = unknown::not_due(&marks, &sessions, grace.as_millis() as u64);
        let mut unknown_held = Invariant::new(
            "no cluster marked Unknown while its agent held a session",
            wrong.is_empty(),
            match wrong.first() {
                None => format!(
                    "{} Unknown marks, none on a cluster whose agent held a session for {} s \
                     before; {not_due} made less than a grace period ({} s) after the agent's \
                     last session",
                    marks.len(),
                    unknown::SETTLED_MS / 1000,
                    grace.as_secs()
                ),
                Some(w) => format!(
                    "{} of {} Unknown marks wrong, first {} at {} while its session was up since \
                     {}; {not_due} made less than a grace period ({} s) after the agent's last \
                     session",
                    wrong.len(),
                    marks.len(),
                    w.cluster,
                    w.at_unix_ms,
                    w.session_since_unix_ms,
                    grace.as_secs()
                ),
            },
        );
        if let Some(w) = wrong.first() {
            let at_s = w.at_unix_ms.saturating_sub(start_unix_ms) as f64 / 1000.0;
            unknown_held.after_fault = fault_before(&faults, at_s).map(|f| f.describe());
        }
        invariants.push(unknown_held);

        // The apiserver's requests against the formula of docs/capacity.md.
        let config = self.args.gateway_process_config("lt-gw-0")?;
        let count = |act: Act| report.acts.iter().filter(|a| a.act == act).count() as u64;
        let mut holders: BTreeMap<u32, Option<String>> = BTreeMap::new();
        let mut shard_moves = 0;
        for c in &lease_changes {
            if let Some(before) = holders.insert(c.shard, c.holder.clone())
                && before.is_some()
                && c.holder.is_some()
                && before != c.holder
            {
                shard_moves += 1;
            }
        }
        let per_worker = self.identities.len().div_ceil(spec.targets.workers.max(1)) as u64;
        let costs = Costs {
            deliveries: clusters.len() as u64 * 3,
            gateway_relists: count(Act::StartGateway)
                + gateways as u64 * count(Act::StartApiserver)
                + count(Act::HealGatewayApiserver),
            hub_starts: count(Act::StartHub),
            shard_moves,
            clusters_back: count(Act::StartWorker) * per_worker,
            operator_retries: operator_retries.load(Ordering::Relaxed),
            unknown_marks: marks.len() as u64,
            gateways: gateways as u64,
            shards: u64::from(config.shards.shards),
            renew_period: config.shards.renew_period,
            window: metered,
        };
        let bound = costs.bound();
        if meter.windows == 0 {
            invariants.push(Invariant::not_judged(
                "apiserver requests within the capacity formula",
                "the apiserver's /metrics could not be read".to_string(),
            ));
        } else {
            invariants.push(Invariant::new(
                "apiserver requests within the capacity formula",
                meter.closed <= bound,
                format!(
                    "{} requests over {} windows between restarts, bound {bound} ({costs:?}); the most: {}",
                    meter.closed,
                    meter.windows,
                    top(&meter.by_verb_resource, 6)
                ),
            ));
            report.apiserver_requests = Some(meter.closed);
        }
        report.apiserver_windows = meter.windows;
        report.apiserver_requests_by_verb_resource = meter.by_verb_resource.clone();
        report.apiserver_bound = Some(bound);
        report.apiserver_costs = Some(costs);
        let mut exits_held = true;
        if let Some(g) = self.hub.gateways_mut() {
            let stopped = g.stop_all(Signal::SIGTERM).await;
            exits_held &= stopped.is_ok();
            for l in g.lifecycle.iter().filter(|l| l.event.contains("SIGTERM")) {
                exits_held &= l.event.ends_with("(exit status: 0)");
                report.exits.push(format!("{} {}", l.gateway, l.event));
            }
        }
        if let Some(agents) = self.agents.take() {
            for (exit, success) in agents.stop_reporting().await {
                exits_held &= success;
                report.exits.push(exit);
            }
        }
        let hub_stop = Instant::now();
        match self.hub.stop_with(Signal::SIGTERM).await {
            Ok(()) => {
                let status = self.hub.last_exit;
                exits_held &= status.is_some_and(|s| s.success());
                report.exits.push(format!(
                    "hub exited in {:.1} s of SIGTERM ({})",
                    hub_stop.elapsed().as_secs_f64(),
                    status.map_or_else(|| "not running".to_string(), |s| s.to_string())
                ));
            }
            Err(e) => {
                exits_held = false;
                report.exits.push(format!("hub: {e:#}"));
            }
        }
        invariants.push(Invariant::new(
            "every process exits when asked",
            exits_held,
            report.exits.join("; "),
        ));

        // The fenced writes, from every gateway's logs, against the Leases' history.
        let mut writes = Vec::new();
        let mut unreadable = 0;
        if let Some(g) = self.hub.gateways() {
            for log in g.logs() {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                let (w, u) = fencing::parse_log(&text);
                writes.extend(w);
                unreadable += u;
            }
        }
        let verdict = fencing::judge(
            &writes,
            &LeaseHistory::from_changes(&lease_changes),
            unreadable,
        );
        if verdict.writes == 0 {
            let why = "no fenced write in the gateways' logs: these gateways do not log them (target flotilla::fenced_write)".to_string();
            invariants.push(Invariant::not_judged(
                "no write accepted from a gateway that had lost the shard",
                why.clone(),
            ));
            invariants.push(Invariant::not_judged(
                "no object's epoch went backwards",
                why,
            ));
        } else {
            let mut backwards = Invariant::new(
                "no object's epoch went backwards",
                verdict.epoch_went_backwards.is_empty(),
                match verdict.epoch_went_backwards.first() {
                    None => format!(
                        "{} accepted writes in resourceVersion order per object",
                        verdict.accepted_by_holder + verdict.accepted_stale_harmless
                    ),
                    Some(b) => format!(
                        "{} writes went backwards, first {} after {}",
                        verdict.epoch_went_backwards.len(),
                        b.write,
                        b.after
                    ),
                },
            );
            if let Some(b) = verdict.epoch_went_backwards.first() {
                let at_s = b.sent_at_unix_ms.saturating_sub(start_unix_ms) as f64 / 1000.0;
                backwards.after_fault = fault_before(&faults, at_s).map(|f| f.describe());
            }
            invariants.push(Invariant::new(
                "no write accepted from a gateway that had lost the shard",
                verdict.epoch_went_backwards.is_empty(),
                format!(
                    "{} writes: {} by the holder, {} after a takeover on objects without the newer epoch (harmless), {} over a newer epoch; refused: {:?}; {} unreadable lines; {} Lease changes watched",
                    verdict.writes,
                    verdict.accepted_by_holder,
                    verdict.accepted_stale_harmless,
                    verdict.epoch_went_backwards.len(),
                    verdict.not_written,
                    verdict.unreadable,
                    lease_changes.len()
                ),
            ));
            invariants.push(backwards);
        }
        report.fencing = Some(verdict);

        let failed_acts: Vec<&ActDone> = report.acts.iter().filter(|a| a.error.is_some()).collect();
        invariants.push(Invariant::new(
            "every fault injected and undone",
            failed_acts.is_empty(),
            match failed_acts.first() {
                None => format!(
                    "{} acts for {} faults, the last undone at {:.1} s of {:.1} s",
                    report.acts.len(),
                    faults.len(),
                    report.acts.last().map_or(0.0, |a| a.done_s),
                    faults_over_s
                ),
                Some(a) => format!(
                    "{} acts failed, first {:?} of {} (fault #{}): {}",
                    failed_acts.len(),
                    a.act,
                    a.target,
                    a.fault,
                    a.error.as_deref().unwrap_or_default()
                ),
            },
        ));
        // A violation seen only at the end is named after the last fault of the run.
        let last = faults.last().map(|f| f.describe());
        for i in &mut invariants {
            if i.verdict == Verdict::Violated && i.after_fault.is_none() {
                i.after_fault = last.clone();
            }
        }
        let held = invariants.iter().all(|i| i.verdict != Verdict::Violated);
        if !held {
            let violated: Vec<String> = invariants
                .iter()
                .filter(|i| i.verdict == Verdict::Violated)
                .map(|i| {
                    format!(
                        "{} ({}{})",
                        i.name,
                        i.evidence,
                        i.after_fault
                            .as_deref()
                            .map_or(String::new(), |f| format!("; after {f}"))
                    )
                })
                .collect();
            r.error = Some(format!("invariants violated: {}", violated.join("; ")));
        }
        report.invariants = invariants;
        r.statuses = Some(audit);
        r.chaos = Some(report);
        anyhow::ensure!(
            held,
            "{}",
            r.error
                .clone()
                .unwrap_or_else(|| "invariants violated".into())
        );
        Ok(true)
    }

    /// Does `action` to its target.
    async fn act(
        &mut self,
        action: Action,
        firewall: &Option<Firewall>,
        gateway_ports: &[u16],
        meter: &mut Meter,
        own_watches: u64,
    ) -> anyhow::Result<()> {
        let k = action.target;
        let firewall = || firewall.as_ref().context("no firewall for partitions");
        match action.act {
            Act::KillGateway => {
                self.hub
                    .gateways_mut()
                    .context("no gateways")?
                    .kill(k)
                    .await
            }
            Act::StartGateway => {
                self.hub
                    .gateways_mut()
                    .context("no gateways")?
                    .start_all()
                    .await
            }
            Act::StopGateway => self
                .hub
                .gateways()
                .context("no gateways")?
                .signal(k, Signal::SIGSTOP),
            Act::ContinueGateway => self
                .hub
                .gateways()
                .context("no gateways")?
                .signal(k, Signal::SIGCONT),
            Act::KillHub => self.hub.stop_with(Signal::SIGKILL).await,
            Act::StartHub => self.hub.start_again().await,
            Act::StopHub | Act::ContinueHub => {
                let pid = self.hub.pid().context("the hub is not running")?;
                let signal = if action.act == Act::StopHub {
                    Signal::SIGSTOP
                } else {
                    Signal::SIGCONT
                };
                Ok(kill(Pid::from_raw(pid as i32), signal)?)
            }
            Act::KillWorker => self
                .agents
                .as_mut()
                .context("no agents")?
                .kill_worker(k)
                .await
                .map(|_| ()),
            Act::StartWorker => self.agents.as_mut().context("no agents")?.start_worker(k),
            Act::StopWorker => self
                .agents
                .as_mut()
                .context("no agents")?
                .signal_worker(k, Signal::SIGSTOP),
            Act::ContinueWorker => self
                .agents
                .as_mut()
                .context("no agents")?
                .signal_worker(k, Signal::SIGCONT),
            Act::PartitionGatewayApiserver => {
                let port = self
                    .hub
                    .relays()
                    .and_then(|r| r.port(k))
                    .context("no relay for this gateway")?;
                firewall()?.partition(action.fault, Cut::Tcp(port))
            }
            Act::PartitionAgentsGateway => {
                let port = *gateway_ports.get(k).context("no such gateway")?;
                firewall()?.partition(action.fault, Cut::TcpAndUdp(port))
            }
            Act::HealGatewayApiserver | Act::HealAgentsGateway => firewall()?.heal(action.fault),
            Act::StopApiserver => {
                meter.close(self.apiserver_snapshot().await, own_watches);
                self.hub
                    .apiserver_mut()
                    .context("no apiserver")?
                    .stop_apiserver();
                Ok(())
            }
            Act::StartApiserver => {
                self.hub
                    .apiserver_mut()
                    .context("no apiserver")?
                    .start_apiserver()
                    .await?;
                meter.open(self.apiserver_snapshot().await);
                Ok(())
            }
        }
    }

    /// Waits until every cluster's fan-out work and rollout work are Applied at their
    /// generation, the rollout's at `revision`; at the deadline, says what is missing.
    async fn wait_converged(
        &self,
        clock: &Clock,
        clusters: &[String],
        fanout: &str,
        revision: u32,
    ) -> anyhow::Result<Convergence> {
        let ours: HashSet<&str> = clusters.iter().map(String::as_str).collect();
        let object = crate::placement::rollout_object(revision);
        let set_label = format!("{NAMESPACE}.{ROLLOUT}");
        loop {
            let works = match self.hub_works().await {
                Ok(w) => w,
                Err(e) if !clock.expired() => {
                    tracing::warn!(error = %format!("{e:#}"), "listing works while converging");
                    tokio::time::sleep(CONVERGE_POLL).await;
                    continue;
                }
                Err(e) => return Err(e),
            };
            let mut c = Convergence::default();
            for w in &works {
                let Some(ns) = w["metadata"]["namespace"]
                    .as_str()
                    .filter(|n| ours.contains(n))
                else {
                    continue;
                };
                if w["metadata"]["labels"][REPLICA_SET_LABEL] == set_label.as_str() {
                    c.rollout_works.insert(ns.to_string(), describe_work(w));
                }
                if !applied_at_generation(w) {
                    continue;
                }
                if w["metadata"]["name"] == fanout {
                    c.fanout.insert(ns.to_string());
                } else if w["metadata"]["labels"][REPLICA_SET_LABEL] == set_label.as_str()
                    && w["spec"]["workload"]["manifests"][0]["metadata"]["name"] == object.as_str()
                {
                    c.rollout.insert(ns.to_string());
                }
            }
            c.missing = clusters
                .iter()
                .filter(|n| !c.fanout.contains(*n) || !c.rollout.contains(*n))
                .cloned()
                .collect();
            if c.missing.is_empty() || clock.expired() {
                return Ok(c);
            }
            tokio::time::sleep(CONVERGE_POLL).await;
        }
    }
}

/// Which clusters have their works Applied at the end.
#[derive(Default)]
struct Convergence {
    fanout: HashSet<String>,
    rollout: HashSet<String>,
    missing: Vec<String>,
    /// What the hub holds of each cluster's rollout work, for the evidence of one missing.
    rollout_works: HashMap<String, String>,
}

impl Convergence {
    fn describe(&self, n: usize) -> String {
        let mut s = format!(
            "fan-out work Applied on {} / {n}, rollout revision {} on {} / {n}",
            self.fanout.len(),
            ROLLOUT_REVISIONS[1],
            self.rollout.len()
        );
        if !self.missing.is_empty() {
            let some: Vec<String> = self
                .missing
                .iter()
                .take(5)
                .map(|n| {
                    let work = self.rollout_works.get(n).map_or("none", String::as_str);
                    format!("{n} (rollout work on the hub: {work})")
                })
                .collect();
            s.push_str(&format!("; missing on {}", some.join(", ")));
        }
        s
    }
}

/// A work as the hub holds it, for evidence: its first manifest's name, generation and Applied
/// condition.
fn describe_work(w: &Value) -> String {
    let applied = w["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "Applied"));
    format!(
        "{} at generation {}, Applied {} observed at {}",
        w["spec"]["workload"]["manifests"][0]["metadata"]["name"],
        w["metadata"]["generation"],
        applied.map_or(Value::Null, |c| c["status"].clone()),
        applied.map_or(Value::Null, |c| c["observedGeneration"].clone()),
    )
}

/// Whether a work is Applied=True for its current generation.
fn applied_at_generation(w: &Value) -> bool {
    if condition(w, "Applied") != Some("True") {
        return false;
    }
    let generation = w["metadata"]["generation"].as_i64();
    let observed = w["status"]["conditions"].as_array().and_then(|cs| {
        cs.iter()
            .find(|c| c["type"] == "Applied")
            .and_then(|c| c["observedGeneration"].as_i64())
    });
    match (generation, observed) {
        (Some(g), Some(o)) => o >= g,
        // A condition without observedGeneration says nothing older.
        _ => true,
    }
}

/// The chaos scenario's workload through the operator API: the fan-out work to every
/// cluster, and a Progressive rollout of revision 1, then revision 2 after `second_after`.
/// Each step is tried again until it succeeds, since a fault may take the hub or the
/// apiserver away under it; gives up after the window and a minute.
async fn workload(
    api: Arc<OperatorApi>,
    clusters: Vec<String>,
    fanout: String,
    max_concurrency: String,
    second_after: Duration,
    retries: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    let retries = &*retries;
    let started = Instant::now();
    let deadline = started + second_after * 2 + Duration::from_secs(60);
    retrying(
        deadline,
        retries,
        "binding the global ManagedClusterSet",
        || bind_global(&api),
    )
    .await?;
    let placement = serde_json::json!({
        "apiVersion": flotilla_proto::api::Kind::Placement.api_version(), "kind": "Placement",
        "metadata": { "name": ROLLOUT, "namespace": NAMESPACE },
        "spec": {},
    });
    retrying(
        deadline,
        retries,
        "creating the rollout's Placement",
        || async { api.apply(&placement).await.map(|_| ()) },
    )
    .await?;
    let first = replica_set(ROLLOUT_REVISIONS[0], &max_concurrency);
    retrying(
        deadline,
        retries,
        "creating the ManifestWorkReplicaSet",
        || async { api.apply(&first).await.map(|_| ()) },
    )
    .await?;
    let created = futures::stream::iter(clusters)
        .map(|cluster| {
            let api = api.clone();
            let work = work_json(&cluster, &fanout);
            async move {
                retrying(deadline, retries, "creating the fan-out work", || async {
                    api.apply(&work).await.map(|_| ())
                })
                .await
            }
        })
        .buffer_unordered(crate::operator::POOL_SIZE)
        .collect::<Vec<anyhow::Result<()>>>()
        .await;
    created.into_iter().collect::<anyhow::Result<Vec<()>>>()?;
    tokio::time::sleep_until(started + second_after).await;
    let second = replica_set(ROLLOUT_REVISIONS[1], &max_concurrency);
    retrying(deadline, retries, "rolling out revision 2", || async {
        api.apply(&second).await.map(|_| ())
    })
    .await
}

/// `step` until it succeeds or `deadline` passes (then its last error); each failed try is
/// counted in `retries`.
async fn retrying<F, Fut>(
    deadline: Instant,
    retries: &AtomicU64,
    what: &str,
    mut step: F,
) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    loop {
        match step().await {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() < deadline => {
                retries.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %format!("{e:#}"), "{what}; trying again");
                tokio::time::sleep(RETRY_EVERY).await;
            }
            Err(e) => return Err(e.context(what.to_string())),
        }
    }
}

/// Every change of the shard Leases from the start until `stop`, stamped with the claim time
/// (the Lease's `acquireTime`, else when seen). The watcher lists again after an apiserver
/// restart; a claim it missed meanwhile shows as a later epoch (see [`fencing`]).
async fn watch_leases(
    client: kube::Client,
    namespace: String,
    mut stop: watch::Receiver<bool>,
) -> Vec<LeaseChange> {
    use kube::runtime::{WatchStreamExt, watcher};
    let api = kube::Api::<Lease>::namespaced(client, &namespace);
    let config = watcher::Config::default().labels(crate::gateways::SHARD_LEASE_SELECTOR);
    let mut events = watcher(api, config).default_backoff().boxed();
    let mut changes = Vec::new();
    let mut last: BTreeMap<u32, (u64, Option<String>)> = BTreeMap::new();
    loop {
        let event = tokio::select! {
            _ = stop.wait_for(|s| *s) => return changes,
            e = events.next() => e,
        };
        let lease = match event {
            Some(Ok(watcher::Event::Apply(l) | watcher::Event::InitApply(l))) => l,
            Some(Ok(_)) => continue,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "watching the shard Leases");
                continue;
            }
            None => return changes,
        };
        let Some(shard) = lease
            .metadata
            .name
            .as_deref()
            .and_then(flotilla_proto::contract::shard_of_lease)
        else {
            continue;
        };
        let Some(spec) = lease.spec else { continue };
        let epoch = spec.lease_transitions.unwrap_or(0).max(0) as u64;
        let holder = spec.holder_identity.filter(|h| !h.is_empty());
        // Renewals change nothing the judgement needs.
        if last.get(&shard) == Some(&(epoch, holder.clone())) {
            continue;
        }
        last.insert(shard, (epoch, holder.clone()));
        let acquired = spec
            .acquire_time
            .and_then(|t| serde_json::to_value(t).ok())
            .and_then(|v| v.as_str()?.parse::<jiff::Timestamp>().ok())
            .map(|t| t.as_millisecond().max(0) as u64);
        if changes.len() < MAX_LEASE_CHANGES {
            changes.push(LeaseChange {
                shard,
                epoch,
                holder,
                claimed_at_unix_ms: acquired.unwrap_or_else(unix_ms).min(unix_ms()),
            });
        }
    }
}

/// Every transition of one of `ours` to Available=Unknown from the start until `stop`, at the
/// condition's `lastTransitionTime`.
pub(crate) async fn watch_unknown(
    client: kube::Client,
    ours: HashSet<String>,
    mut stop: watch::Receiver<bool>,
) -> Vec<UnknownMark> {
    use flotilla_proto::api::ManagedCluster;
    use kube::runtime::{WatchStreamExt, watcher};
    let api = kube::Api::<ManagedCluster>::all(client);
    let mut events = watcher(api, watcher::Config::default().any_semantic())
        .default_backoff()
        .boxed();
    let mut marks: Vec<UnknownMark> = Vec::new();
    let mut seen: HashSet<(String, u64)> = HashSet::new();
    loop {
        let event = tokio::select! {
            _ = stop.wait_for(|s| *s) => return marks,
            e = events.next() => e,
        };
        let cluster = match event {
            Some(Ok(watcher::Event::Apply(c) | watcher::Event::InitApply(c))) => c,
            Some(Ok(_)) => continue,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "watching ManagedClusters");
                continue;
            }
            None => return marks,
        };
        let Ok(v) = serde_json::to_value(&cluster) else {
            continue;
        };
        let name = v["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if !ours.contains(&name) {
            continue;
        }
        let Some(available) = v["status"]["conditions"].as_array().and_then(|cs| {
            cs.iter().find(|c| {
                c["type"] == flotilla_proto::api::conditions::MANAGED_CLUSTER_CONDITION_AVAILABLE
                    && c["status"] == "Unknown"
            })
        }) else {
            continue;
        };
        let at = available["lastTransitionTime"]
            .as_str()
            .and_then(|t| t.parse::<jiff::Timestamp>().ok())
            .map_or_else(unix_ms, |t| t.as_millisecond().max(0) as u64);
        if seen.insert((name.clone(), at)) && marks.len() < MAX_LEASE_CHANGES {
            marks.push(UnknownMark {
                cluster: name,
                at_unix_ms: at,
            });
        }
    }
}

/// The `n` largest counts of `by`, as `"PUT leases 290, ..."`.
fn top(by: &BTreeMap<String, u64>, n: usize) -> String {
    let mut all: Vec<(&String, &u64)> = by.iter().collect();
    all.sort_by(|a, b| b.1.cmp(a.1));
    all.iter()
        .take(n)
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn unix_ms() -> u64 {
    jiff::Timestamp::now().as_millisecond().max(0) as u64
}
