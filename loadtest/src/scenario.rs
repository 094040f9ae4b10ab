//! The scenarios. Each waits on conditions with the run's `--timeout` as its deadline, and on
//! expiry stops and reports what it saw (outcome `timed_out`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use flotilla_proto::api::conditions::{MANAGED_CLUSTER_CONDITION_AVAILABLE, WORK_APPLIED};
use flotilla_proto::contract::WORK_CLEANUP_FINALIZER;
use futures::StreamExt;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::agents::Agents;
use crate::apiserver::Apiserver;
use crate::cli::{RunArgs, StormSignal};
use crate::clock::{self, Stamp};
use crate::fleet::{Hub, Identity};
use crate::machine::ProcStats;
use crate::operator::{OperatorApi, POOL_SIZE, condition};
use crate::report::{
    GatewaysReport, IdleReport, Outcome, Percentiles, Point, ScenarioReport, StatusAudit,
    TurnedAway,
};
use crate::swarm::{AgentRecord, Sample, SwarmSpec, status_digest};

/// How often sessions are counted for the curves.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(100);
/// Window over which handshake and accept rates are measured.
const RATE_WINDOW: Duration = Duration::from_secs(1);
/// Mismatches quoted in a status audit.
const AUDIT_EXAMPLES: usize = 5;
/// The hub's gauge of ManagedClusters by their Available condition.
const AVAILABLE_GAUGE: &str = "flotilla_hub_managedclusters";
/// Objects per page when the harness lists the hub apiserver itself.
const HUB_LIST_PAGE: u32 = 1000;
/// How many times a paged list whose continue token expired is started again before the run
/// fails.
const MAX_LIST_RESTARTS: u32 = 3;
/// How long a scenario may run past its `--timeout` (its accounting, a hub stop or start that
/// is itself bounded) before the harness stops it and says what it found wrong: no scenario
/// outlives `--timeout` plus this.
pub const OVERRUN: Duration = Duration::from_secs(120);

/// Everything the scenarios share.
pub struct Run {
    pub args: RunArgs,
    pub hub: Hub,
    pub api: Arc<OperatorApi>,
    pub identities: Vec<Identity>,
    pub spec: SwarmSpec,
    pub agents: Option<Agents>,
    pub progress: MultiProgress,
    pub run_dir: std::path::PathBuf,
    /// Works created so far, to name the next one.
    works_created: usize,
    /// When the agents were started (Unix ms), for times to connected read from their
    /// session logs.
    pub(crate) agents_started_unix_ms: Option<u64>,
}

/// A deadline and a clock for one scenario.
pub(crate) struct Clock {
    pub(crate) start: Instant,
    pub(crate) deadline: Instant,
}

impl Clock {
    pub(crate) fn new(timeout: Duration) -> Clock {
        let start = Instant::now();
        Clock {
            start,
            deadline: start + timeout,
        }
    }
    pub(crate) fn t(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }
    pub(crate) fn expired(&self) -> bool {
        Instant::now() >= self.deadline
    }
}

/// The most a counter grew per second over any window of at least [`RATE_WINDOW`], in a series
/// of (seconds, counter). Samples further apart than the window count as one window.
fn peak_rate(series: &[(f64, u64)]) -> f64 {
    let w = RATE_WINDOW.as_secs_f64();
    let mut peak = 0.0f64;
    let mut j = 0;
    for i in 1..series.len() {
        while j + 1 < i && series[i].0 - series[j + 1].0 >= w {
            j += 1;
        }
        let dt = (series[i].0 - series[j].0).max(w);
        peak = peak.max(series[i].1.saturating_sub(series[j].1) as f64 / dt);
    }
    peak
}

impl Run {
    pub fn new(
        args: RunArgs,
        hub: Hub,
        api: Arc<OperatorApi>,
        identities: Vec<Identity>,
        spec: SwarmSpec,
        progress: MultiProgress,
        run_dir: std::path::PathBuf,
    ) -> Run {
        Run {
            args,
            hub,
            api,
            identities,
            spec,
            agents: None,
            progress,
            run_dir,
            works_created: 0,
            agents_started_unix_ms: None,
        }
    }

    pub(crate) fn n(&self) -> u64 {
        self.identities.len() as u64
    }

    pub(crate) fn bar(&self, what: &str, len: u64) -> ProgressBar {
        let bar = self.progress.add(ProgressBar::new(len));
        bar.set_style(
            ProgressStyle::with_template(
                "{prefix:>10} [{elapsed_precise}] {bar:40.cyan/blue} {pos:>6}/{len:6} {msg}",
            )
            .expect("static template")
            .progress_chars("=> "),
        );
        bar.set_prefix(what.to_string());
        bar
    }

    pub(crate) fn sample(&self) -> Sample {
        self.agents.as_ref().map(Agents::sample).unwrap_or_default()
    }

    async fn start_agents(&mut self) -> anyhow::Result<()> {
        if self.agents.is_none() {
            self.agents_started_unix_ms = Some(crate::over_links::unix_ms());
            self.agents = Some(
                Agents::start(
                    self.spec.clone(),
                    self.identities.clone(),
                    self.args.processes,
                    self.args.harness_exe()?,
                    &self.run_dir,
                    self.args.link.spec()?.as_ref(),
                )
                .await?,
            );
        }
        Ok(())
    }

    /// Makes sure every agent runs and is connected (for scenarios run without `connect`).
    pub(crate) async fn ensure_connected(&mut self, clock: &Clock) -> anyhow::Result<()> {
        self.start_agents().await?;
        let bar = self.bar("sessions", self.n());
        while self.sample().connected < self.n() {
            anyhow::ensure!(
                !clock.expired(),
                "only {} of {} agents connected before the deadline",
                self.sample().connected,
                self.n()
            );
            bar.set_position(self.sample().connected);
            tokio::time::sleep(SAMPLE_EVERY).await;
        }
        bar.finish_and_clear();
        Ok(())
    }

    /// `connect`: ramp every agent up and wait for all to be Available on the hub.
    pub async fn connect(&mut self) -> ScenarioReport {
        let mut r = ScenarioReport::new("connect", self.identities.len());
        let clock = Clock::new(self.args.timeout);
        let result = bounded(&clock, self.connect_inner(&clock, &mut r)).await;
        let hold = matches!(result, Ok(true)) && !self.args.hold.is_zero();
        self.conclude(&mut r, &clock, result).await;
        if hold {
            r.idle = Some(self.hold_idle().await);
        }
        r
    }

    /// `--hold`: keeps every session up and idle for the hold, and reads what that cost from
    /// the processes' CPU counters and the apiserver's request counters.
    async fn hold_idle(&mut self) -> IdleReport {
        let bar = self.bar("hold", self.args.hold.as_secs());
        let sessions_before = self.sample().connected;
        let side_before = self.session_side_cpu().await;
        let agents_before = self.agents.as_ref().map_or(0.0, Agents::cpu_seconds);
        let api_before = self.apiserver_snapshot().await;
        let t0 = Instant::now();
        let end = t0 + self.args.hold;
        while Instant::now() < end {
            bar.set_position(t0.elapsed().as_secs());
            tokio::time::sleep_until(end.min(Instant::now() + Duration::from_secs(1))).await;
        }
        let window_s = t0.elapsed().as_secs_f64();
        let sessions_after = self.sample().connected;
        let side_after = self.session_side_cpu().await;
        let agents_after = self.agents.as_ref().map_or(0.0, Agents::cpu_seconds);
        let own = self.hub.apiserver().map_or(0, Apiserver::own_watches);
        let apiserver_requests = match (api_before, self.apiserver_snapshot().await) {
            (Some(b), Some(a)) => Some(a.load_since(&b, own).requests),
            _ => None,
        };
        bar.finish_and_clear();
        IdleReport {
            window_s,
            sessions_before,
            sessions_after,
            sessions_cpu_s: side_after - side_before,
            agents_cpu_s: agents_after - agents_before,
            apiserver_requests,
        }
    }

    /// CPU seconds of the processes holding the sessions: the gateways, else the hub child
    /// (0 when neither can be read).
    async fn session_side_cpu(&self) -> f64 {
        if self.hub.gateways().is_some() {
            return match self.gateways_report().await {
                Ok(Some(g)) => g.cpu_seconds,
                _ => 0.0,
            };
        }
        self.hub.stats().map_or(0.0, |s| s.cpu_seconds)
    }

    async fn connect_inner(
        &mut self,
        clock: &Clock,
        r: &mut ScenarioReport,
    ) -> anyhow::Result<bool> {
        anyhow::ensure!(
            self.agents.is_none(),
            "connect must be the first scenario of a run"
        );
        let hub_before = self.hub.stats();
        let self_before = ProcStats::read("self");
        r.hub_rss_before_bytes = hub_before.map(|s| s.rss_bytes);
        let n = self.n();
        self.start_agents().await?;
        let bar = self.bar("connect", n);
        let mut established = Vec::new();
        // Available is counted beside the 100 ms sampling: on the kube backend from a watch of
        // the hub apiserver's ManagedClusters (one list, then events: listing 100,000 clusters
        // every poll interval would load the apiserver more than the fleet does); otherwise from
        // the hub's gauge every --poll-interval, confirmed by one list of the clusters once it
        // reaches the fleet (listing 10,000 clusters four times a second took a third of the
        // hub's CPU in a ramp, competing with the handshakes measured); on a hub without a
        // known /metrics, by that list every --poll-interval.
        let (available_tx, available_rx) = tokio::sync::watch::channel((0u64, clock.t()));
        let ours: HashSet<String> = self.identities.iter().map(|i| i.name.clone()).collect();
        let start = clock.start;
        let poller = match self.hub.apiserver() {
            Some(a) => {
                let client = a.client().await?;
                tokio::spawn(available_by_watch(client, ours, start, available_tx))
            }
            None => {
                let api = self.api.clone();
                let every = self.args.poll_interval;
                let metrics = self.hub.metrics;
                tokio::spawn(async move {
                    loop {
                        let gauge = match metrics {
                            Some(address) => available_by_gauge(address).await.ok(),
                            None => None,
                        };
                        let count = match gauge {
                            // Below the fleet: the gauge may count other clusters too, so it
                            // is never taken for "all"; at or above it, the list says which.
                            Some(count) if count < ours.len() as u64 => Ok(count),
                            _ => available_among(&api, &ours).await,
                        };
                        if let Ok(count) = count {
                            let _ = available_tx.send((count, start.elapsed().as_secs_f64()));
                        }
                        tokio::time::sleep(every).await;
                    }
                })
            }
        };
        let mut available = 0;
        let mut done = false;
        let mut first_dial = None;
        while !clock.expired() {
            let s = self.sample();
            anyhow::ensure!(
                s.join_failures == 0,
                "{} agents could not join with the bootstrap token (the hub's log says why)",
                s.join_failures
            );
            let t = clock.t();
            r.curve.push(Point {
                t_s: t,
                value: s.connected as f64,
            });
            established.push((t, s.established_total));
            if s.started > 0 && first_dial.is_none() {
                first_dial = Some(t);
            }
            if let Some(h) = self.hub.stats() {
                r.rss_curve.push((s.connected, h.rss_bytes));
            }
            if s.connected >= n && r.time_to_all_connected_s.is_none() {
                r.time_to_all_connected_s = Some(t);
            }
            let (count, seen_at) = *available_rx.borrow();
            available = count;
            if available >= n && r.time_to_all_available_s.is_none() {
                r.time_to_all_available_s = Some(seen_at);
            }
            bar.set_position(s.connected);
            bar.set_message(format!("connected, {available} Available on the hub"));
            if r.time_to_all_connected_s.is_some() && r.time_to_all_available_s.is_some() {
                done = true;
                break;
            }
            tokio::time::sleep(SAMPLE_EVERY).await;
        }
        poller.abort();
        bar.finish_and_clear();
        let s = self.sample();
        if self.spec.join.is_some() {
            r.joined = Some(s.joined);
            r.join_failures = Some(s.join_failures);
        }
        r.connected = Some(s.connected);
        r.available_on_hub = Some(available);
        r.failed_attempts = Some(s.failed_attempts);
        r.turned_away = TurnedAway::between(&Sample::default(), &s);
        r.redirects = Some(s.redirects);
        r.time_to_first_dial_s = first_dial;
        r.handshakes_per_s = r
            .time_to_all_connected_s
            .map(|t| setup_rate(s.established_total, first_dial, t));
        r.peak_handshakes_per_s = Some(peak_rate(&established));
        let hub_after = self.hub.stats();
        r.hub_rss_after_bytes = hub_after.map(|s| s.rss_bytes);
        if let (Some(b), Some(a)) = (hub_before, hub_after) {
            r.hub_rss_per_session_bytes =
                Some((a.rss_bytes as f64 - b.rss_bytes as f64) / s.connected.max(1) as f64);
            r.hub_cpu_s = Some(a.cpu_seconds - b.cpu_seconds);
        }
        if let (Some(b), Some(a)) = (self_before, ProcStats::read("self")) {
            r.harness_cpu_s = Some(a.cpu_seconds - b.cpu_seconds);
        }
        // With gateways the sessions live there: where each agent ended up, and what holding
        // them costs each gateway.
        if done && self.hub.gateways().is_some() {
            let mut report = self.gateways_report().await?;
            while !report.as_ref().is_some_and(|g| g.all_on_owners) && !clock.expired() {
                tokio::time::sleep(self.args.poll_interval).await;
                report = self.gateways_report().await?;
            }
            done = report.as_ref().is_some_and(|g| g.all_on_owners);
            r.gateways = report;
        }
        Ok(done)
    }

    pub(crate) fn next_work_name(&mut self, what: &str) -> String {
        self.works_created += 1;
        format!("{what}-{}", self.works_created)
    }

    /// Creates ManifestWork `name` in every cluster's namespace; returns when each create was
    /// sent (clock stamps) per cluster.
    pub(crate) async fn create_everywhere(
        &self,
        name: &str,
    ) -> anyhow::Result<HashMap<String, Stamp>> {
        self.create_everywhere_as(name, work_json).await
    }

    /// [`Self::create_everywhere`] with the work `make(cluster, name)`.
    pub(crate) async fn create_everywhere_as(
        &self,
        name: &str,
        make: fn(&str, &str) -> Value,
    ) -> anyhow::Result<HashMap<String, Stamp>> {
        let bar = self.bar("create", self.n());
        let api = self.api.clone();
        let results: Vec<anyhow::Result<(String, Stamp)>> =
            futures::stream::iter(self.identities.iter().map(|i| i.name.clone()))
                .map(|cluster| {
                    let api = api.clone();
                    let work = make(&cluster, name);
                    async move {
                        let sent = clock::now();
                        api.create_work(&work)
                            .await
                            .with_context(|| format!("creating ManifestWork {cluster}/{name}"))?;
                        Ok((cluster, sent))
                    }
                })
                .buffer_unordered(POOL_SIZE)
                .inspect(|_| bar.inc(1))
                .collect()
                .await;
        bar.finish_and_clear();
        results.into_iter().collect()
    }

    /// Clusters whose work `name` the hub shows Applied=True.
    pub(crate) async fn applied_on_hub(&self, name: &str) -> anyhow::Result<Vec<String>> {
        Ok(self
            .api
            .works()
            .await?
            .iter()
            .filter(|w| w["metadata"]["name"] == name && condition(w, WORK_APPLIED) == Some("True"))
            .filter_map(|w| w["metadata"]["namespace"].as_str().map(str::to_string))
            .collect())
    }

    /// `fanout`: one ManifestWork to every agent; latency to durable ack and to Applied.
    pub async fn fanout(&mut self) -> ScenarioReport {
        let mut r = ScenarioReport::new("fanout", self.identities.len());
        let clock = Clock::new(self.args.timeout);
        let result = bounded(&clock, self.fanout_inner(&clock, &mut r)).await;
        self.conclude(&mut r, &clock, result).await;
        r
    }

    async fn fanout_inner(
        &mut self,
        clock: &Clock,
        r: &mut ScenarioReport,
    ) -> anyhow::Result<bool> {
        self.ensure_connected(clock).await?;
        let n = self.n();
        let name = self.next_work_name("fanout");
        r.work = Some(name.clone());
        r.poll_interval_ms = Some(self.args.poll_interval.as_secs_f64() * 1000.0);
        let acked_before = self.sample().works_acked;
        let t0 = clock.t();
        // Applied is watched from the first create on: a work applied while later ones are
        // still being created is stamped when the hub shows it, not once all are created.
        let creating = async {
            let created = self.create_everywhere(&name).await?;
            anyhow::Ok((created, clock.t() - t0))
        };
        let bar = self.bar("fanout", n);
        // On the kube backend the works are watched on the hub apiserver (only this work's
        // name, every namespace): each is stamped as the event arrives. Otherwise the hub is
        // polled every --poll-interval.
        let apiserver = match self.hub.apiserver() {
            Some(a) => Some(a.client().await?),
            None => None,
        };
        if apiserver.is_some() {
            r.poll_interval_ms = None;
        }
        let watching = async {
            if let Some(client) = apiserver {
                return self
                    .applied_by_watch(client, &name, clock, &bar, acked_before)
                    .await;
            }
            let mut applied_at: HashMap<String, Stamp> = HashMap::new();
            while !clock.expired() {
                // Stamped when the list has come back: never earlier than the hub showed it.
                let applied = self.applied_on_hub(&name).await?;
                let now = clock::now();
                for cluster in applied {
                    applied_at.entry(cluster).or_insert(now);
                }
                let acked = self.sample().works_acked - acked_before;
                bar.set_position(applied_at.len() as u64);
                bar.set_message(format!("Applied on the hub, {acked} acked by agents"));
                if acked >= n && applied_at.len() as u64 >= n {
                    return anyhow::Ok((applied_at, true));
                }
                tokio::time::sleep(self.args.poll_interval).await;
            }
            anyhow::Ok((applied_at, false))
        };
        let ((created, create_s), (applied_at, done)) =
            futures::future::try_join(creating, watching).await?;
        r.create_s = Some(create_s);
        bar.finish_and_clear();
        let records = self.records().await?;
        let mut ack_us = Vec::new();
        for rec in &records {
            if let (Some(ack), Some(sent)) = (rec.acks.get(&name), created.get(&rec.name)) {
                ack_us.push(clock::between(*sent, *ack).as_micros() as u64);
            }
        }
        let applied_us: Vec<u64> = applied_at
            .iter()
            .filter_map(|(c, at)| {
                created
                    .get(c)
                    .map(|sent| clock::between(*sent, *at).as_micros() as u64)
            })
            .collect();
        r.acked = Some(ack_us.len() as u64);
        r.applied_on_hub = Some(applied_us.len() as u64);
        r.ack_latency = Some(Percentiles::from_micros(&ack_us));
        r.applied_latency = Some(Percentiles::from_micros(&applied_us));
        Ok(done)
    }

    /// When each cluster's work `name` showed Applied=True on the hub apiserver, from a watch
    /// of that name in every namespace; done once every agent acked and every work is Applied.
    pub(crate) async fn applied_by_watch(
        &self,
        client: kube::Client,
        name: &str,
        clock: &Clock,
        bar: &ProgressBar,
        acked_before: u64,
    ) -> anyhow::Result<(HashMap<String, Stamp>, bool)> {
        use flotilla_proto::api::ManifestWork;
        use kube::runtime::{WatchStreamExt, watcher};
        let n = self.n();
        let api = kube::Api::<ManifestWork>::all(client);
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let mut events = watcher(api, config).default_backoff().boxed();
        let mut applied_at: HashMap<String, Stamp> = HashMap::new();
        while !clock.expired() {
            let event = tokio::time::timeout(self.args.poll_interval, events.next()).await;
            let now = clock::now();
            match event {
                Ok(Some(Ok(watcher::Event::Apply(w) | watcher::Event::InitApply(w)))) => {
                    let applied = serde_json::to_value(&w)
                        .is_ok_and(|v| condition(&v, WORK_APPLIED) == Some("True"));
                    if let (true, Some(ns)) = (applied, w.metadata.namespace) {
                        applied_at.entry(ns).or_insert(now);
                    }
                }
                Ok(Some(Ok(_))) | Err(_) => {}
                Ok(Some(Err(e))) => tracing::warn!(error = %e, "watching ManifestWorks {name}"),
                Ok(None) => anyhow::bail!("the watch of ManifestWorks {name} ended"),
            }
            let acked = self.sample().works_acked - acked_before;
            bar.set_position(applied_at.len() as u64);
            bar.set_message(format!("Applied on the hub, {acked} acked by agents"));
            if acked >= n && applied_at.len() as u64 >= n {
                return Ok((applied_at, true));
            }
        }
        Ok((applied_at, false))
    }

    pub(crate) async fn records(&mut self) -> anyhow::Result<Vec<AgentRecord>> {
        match self.agents.as_mut() {
            Some(a) => a.records().await,
            None => Ok(Vec::new()),
        }
    }

    /// Every ManifestWork on the hub, as stored. On the kube backend read from its apiserver a
    /// page at a time: one list of 50,000 works through the operator API outlasts the API's
    /// 60 s bound on an apiserver busy with a storm. Otherwise through the operator API.
    pub(crate) async fn hub_works(&self) -> anyhow::Result<Vec<Value>> {
        use kube::api::{ApiResource, DynamicObject, ListParams};
        let Some(apiserver) = self.hub.apiserver() else {
            return self.api.works().await;
        };
        let resource = ApiResource {
            group: "work.open-cluster-management.io".into(),
            version: "v1".into(),
            api_version: "work.open-cluster-management.io/v1".into(),
            kind: "ManifestWork".into(),
            plural: "manifestworks".into(),
        };
        let api = kube::Api::<DynamicObject>::all_with(apiserver.client().await?, &resource);
        let mut works = Vec::new();
        let mut page = ListParams::default().limit(HUB_LIST_PAGE);
        let mut restarts = 0;
        loop {
            let list = match api.list(&page).await {
                // A list paged for longer than the apiserver keeps its continue tokens (its
                // compaction interval, 5 min by default: 100 pages on an apiserver busy with a
                // storm of 50,000 agents took longer) is read again from the start.
                Err(kube::Error::Api(e)) if e.code == 410 && restarts < MAX_LIST_RESTARTS => {
                    restarts += 1;
                    tracing::warn!(restarts, error = %e, "the paged list of ManifestWorks expired; listing again");
                    works.clear();
                    page = ListParams::default().limit(HUB_LIST_PAGE);
                    continue;
                }
                listed => listed.context("listing the ManifestWorks on the hub apiserver")?,
            };
            for work in list.items {
                works.push(serde_json::to_value(work)?);
            }
            match list.metadata.continue_ {
                Some(token) if !token.is_empty() => page = page.continue_token(&token),
                _ => return Ok(works),
            }
        }
    }

    /// Compares what each agent last reported with what the hub stored.
    async fn audit(&mut self, duplicates: u64) -> anyhow::Result<StatusAudit> {
        let records = self.records().await?;
        let hub: HashMap<(String, String), u64> = self
            .hub_works()
            .await?
            .iter()
            .filter_map(|w| {
                let ns = w["metadata"]["namespace"].as_str()?.to_string();
                let name = w["metadata"]["name"].as_str()?.to_string();
                let status = w.get("status").filter(|s| !s.is_null())?;
                Some(((ns, name), status_digest(status)))
            })
            .collect();
        let mut audit = StatusAudit {
            agents: records.len() as u64,
            duplicated: duplicates,
            ..Default::default()
        };
        for rec in &records {
            audit.without_status += rec.works_without_status.len() as u64;
            for s in &rec.statuses {
                audit.compared += 1;
                if s.acked_seq < s.seq {
                    audit.unacked += 1;
                }
                let stored = hub.get(&(rec.name.clone(), s.work.clone()));
                if stored != Some(&s.digest) {
                    audit.lost += 1;
                    if audit.examples.len() < AUDIT_EXAMPLES {
                        audit.examples.push(format!(
                            "{}/{}: agent's status seq {} (acked up to {}) {}",
                            rec.name,
                            s.work,
                            s.seq,
                            s.acked_seq,
                            if stored.is_some() {
                                "differs from the hub's"
                            } else {
                                "is not on the hub"
                            }
                        ));
                    }
                }
            }
        }
        Ok(audit)
    }

    /// Waits until no agent has an unacknowledged status and the hub holds each agent's
    /// latest status, then audits; on the deadline, audits what is there.
    pub(crate) async fn converge_and_audit(
        &mut self,
        clock: &Clock,
        duplicates_before: u64,
    ) -> anyhow::Result<(StatusAudit, bool)> {
        loop {
            let duplicates = self.sample().duplicate_status_acks - duplicates_before;
            let audit = self.audit(duplicates).await?;
            tracing::info!(compared = audit.compared, unacked = audit.unacked, lost = audit.lost, examples = ?audit.examples, "status audit");
            let converged = audit.unacked == 0 && audit.lost == 0 && audit.without_status == 0;
            if converged || clock.expired() {
                return Ok((audit, converged));
            }
            tokio::time::sleep(Duration::from_millis(500).max(self.args.poll_interval)).await;
        }
    }

    /// `storm` and `outage`: stop the hub under every session, start it again (at once, or
    /// after `down`), and follow the sessions back.
    pub async fn storm(&mut self, outage: bool) -> ScenarioReport {
        let mut r = ScenarioReport::new(
            if outage { "outage" } else { "storm" },
            self.identities.len(),
        );
        let clock = Clock::new(self.args.timeout);
        let result = bounded(&clock, self.storm_inner(&clock, &mut r, outage)).await;
        self.conclude(&mut r, &clock, result).await;
        r
    }

    async fn storm_inner(
        &mut self,
        clock: &Clock,
        r: &mut ScenarioReport,
        outage: bool,
    ) -> anyhow::Result<bool> {
        let sharded = self.hub.gateways().is_some();
        anyhow::ensure!(
            sharded || self.hub.can_restart(),
            "needs a hub the harness started as a child process"
        );
        self.ensure_connected(clock).await?;
        let n = self.n();
        let (signal, down) = if outage {
            (Signal::SIGKILL, self.args.outage)
        } else {
            match self.args.storm_signal {
                StormSignal::Kill => (Signal::SIGKILL, Duration::ZERO),
                StormSignal::Term => (Signal::SIGTERM, Duration::ZERO),
            }
        };
        r.signal = Some(signal.as_str().to_string());
        let before = self.sample();
        r.sessions_before = Some(before.connected);
        // In a storm, statuses are in flight when the hub goes: a new work for everyone first.
        if !outage {
            let name = self.next_work_name("storm");
            self.create_everywhere(&name).await?;
        }
        // With gateways, the storm's apiserver window measures the restart alone: the new
        // work's statuses are written first, so the window holds no write an agent caused
        // before the stop.
        let mut storm_before = None;
        if sharded {
            let (audit, settled) = self
                .converge_and_audit(clock, before.duplicate_status_acks)
                .await?;
            anyhow::ensure!(
                settled,
                "the statuses did not settle before the gateways were to be stopped: {audit:?}"
            );
            self.wait_finalizers_held(clock).await?;
            storm_before = self.apiserver_snapshot().await;
        }
        let mut established = Vec::new();
        let mut sample_curve = |r: &mut ScenarioReport, s: &Sample| {
            let t = clock.t();
            r.curve.push(Point {
                t_s: t,
                value: s.connected as f64,
            });
            established.push((t, s.established_total));
        };
        sample_curve(r, &before);
        r.hub_stopped_at_s = Some(clock.t());
        match self.hub.gateways_mut() {
            Some(gateways) => gateways.stop_all(signal).await?,
            None => self.hub.stop_with(signal).await?,
        }
        let stopped = Instant::now();
        let bar = self.bar(if outage { "outage" } else { "storm" }, n);
        while stopped.elapsed() < down && !clock.expired() {
            let s = self.sample();
            sample_curve(r, &s);
            bar.set_position(s.connected);
            bar.set_message(format!(
                "hub down for {:.0?} more",
                down.saturating_sub(stopped.elapsed())
            ));
            tokio::time::sleep(SAMPLE_EVERY).await;
        }
        let at_restart = self.sample();
        match self.hub.gateways_mut() {
            Some(gateways) => gateways.start_all().await?,
            None => self.hub.start_again().await?,
        }
        r.hub_started_at_s = Some(clock.t());
        r.hub_down_s = Some(stopped.elapsed().as_secs_f64());
        let mut back = false;
        while !clock.expired() {
            let s = self.sample();
            sample_curve(r, &s);
            bar.set_position(s.connected);
            bar.set_message("sessions back");
            // Back means a new session for every agent, not a count that has not noticed the
            // kill yet.
            let renewed = s.established_total - before.established_total;
            r.sessions_reestablished = Some(renewed);
            r.redirects = Some(s.redirects - before.redirects);
            if renewed >= n && s.connected >= n && r.time_to_all_back_s.is_none() {
                r.time_to_all_back_s = Some(stopped.elapsed().as_secs_f64());
                back = true;
                break;
            }
            tokio::time::sleep(SAMPLE_EVERY).await;
        }
        if sharded && back {
            bar.set_message("sessions moving to their shards' owners");
            let mut report = self.gateways_report().await?;
            while !report.as_ref().is_some_and(|g| g.all_on_owners) && !clock.expired() {
                tokio::time::sleep(self.args.poll_interval).await;
                report = self.gateways_report().await?;
            }
            back = report.as_ref().is_some_and(|g| g.all_on_owners);
            if let (Some(report), Some(before), Some(after)) = (
                report.as_mut(),
                storm_before.as_ref(),
                self.apiserver_snapshot().await,
            ) {
                let own = self.hub.apiserver().map_or(0, Apiserver::own_watches);
                report.storm_apiserver = Some(after.load_since(before, own));
            }
            r.gateways = report;
        }
        if !sharded && let Some(address) = self.hub.metrics {
            r.resumed_handshakes = resumed_handshakes(address).await.ok();
        }
        bar.set_message("statuses converging");
        let (audit, converged) = self
            .converge_and_audit(clock, before.duplicate_status_acks)
            .await?;
        bar.finish_and_clear();
        let after = self.sample();
        r.turned_away = TurnedAway::between(&before, &after);
        if outage {
            r.resume_frames_in = Some(after.frames_in - at_restart.frames_in);
            r.resume_bytes_in = Some(after.bytes_in - at_restart.bytes_in);
            r.resume_frames_out = Some(after.frames_out - at_restart.frames_out);
            r.resume_bytes_out = Some(after.bytes_out - at_restart.bytes_out);
            r.convergence_s = converged.then(|| clock.t() - r.hub_started_at_s.unwrap_or(0.0));
        }
        r.peak_accept_per_s = Some(peak_rate(&established));
        r.statuses = Some(audit);
        Ok(back && converged)
    }

    /// Waits until every work of the run's clusters carries the cleanup finalizer: the hub
    /// puts it on the works it creates, and the gateways add it (paced) to any other once the
    /// agent has acknowledged it, so after this no write for them is pending.
    async fn wait_finalizers_held(&self, clock: &Clock) -> anyhow::Result<()> {
        let ours: HashSet<&str> = self.identities.iter().map(|i| i.name.as_str()).collect();
        loop {
            let works = self.hub_works().await?;
            let pending = works
                .iter()
                .filter(|w| {
                    w["metadata"]["namespace"]
                        .as_str()
                        .is_some_and(|ns| ours.contains(ns))
                })
                .filter(|w| {
                    !w["metadata"]["finalizers"].as_array().is_some_and(|f| {
                        f.iter().any(|f| f.as_str() == Some(WORK_CLEANUP_FINALIZER))
                    })
                })
                .count();
            if pending == 0 {
                return Ok(());
            }
            anyhow::ensure!(
                !clock.expired(),
                "{pending} works still lack the cleanup finalizer {WORK_CLEANUP_FINALIZER} at the deadline: the gateways have not caught up with the agents' acknowledgements"
            );
            tokio::time::sleep(self.args.poll_interval).await;
        }
    }

    /// With `--gateways`: every gateway now (sessions, owners, RSS, CPU, store requests).
    pub(crate) async fn gateways_report(&self) -> anyhow::Result<Option<GatewaysReport>> {
        let (Some(gateways), Some(apiserver)) = (self.hub.gateways(), self.hub.apiserver()) else {
            return Ok(None);
        };
        let names: Vec<String> = self.identities.iter().map(|i| i.name.clone()).collect();
        let each = gateways.report(apiserver.client().await?, &names).await?;
        Ok(Some(GatewaysReport::new(each, self.n())))
    }

    /// The hub apiserver's counters now (`--store kube`); `None` (logged) when unreadable.
    pub(crate) async fn apiserver_snapshot(&self) -> Option<crate::apiserver::ApiserverSnapshot> {
        match self.hub.apiserver()?.snapshot().await {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "reading the hub apiserver's metrics failed");
                None
            }
        }
    }

    /// Stops the agents and the hub.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        if let Some(a) = self.agents {
            a.stop().await;
        }
        self.hub.shutdown().await
    }
}

/// How many of `ours` the hub shows Available=True.
async fn available_among(api: &OperatorApi, ours: &HashSet<String>) -> anyhow::Result<u64> {
    Ok(api
        .clusters()
        .await?
        .iter()
        .filter(|c| {
            c["metadata"]["name"]
                .as_str()
                .is_some_and(|n| ours.contains(n))
                && condition(c, MANAGED_CLUSTER_CONDITION_AVAILABLE) == Some("True")
        })
        .count() as u64)
}

/// Sessions set up per second from the first dial (seconds into the scenario, as sampled) to
/// the last welcome at `all`: the agents' own start (their processes, identities and caches)
/// before the first dial is not the carrier's.
pub(crate) fn setup_rate(sessions: u64, first_dial: Option<f64>, all: f64) -> f64 {
    sessions as f64 / (all - first_dial.unwrap_or(0.0)).max(1e-3)
}

/// The hub's count of Available ManagedClusters, from its `/metrics` at `address` (the
/// gauge `flotilla_hub_managedclusters{available="True"}`): every cluster of the hub, ours or
/// not.
async fn available_by_gauge(address: std::net::SocketAddr) -> anyhow::Result<u64> {
    let page = crate::gateways::scrape(address).await?;
    let samples = crate::prometheus::samples(&page, |n| n == AVAILABLE_GAUGE)?;
    samples
        .iter()
        .find(|s| s.label("available") == "True")
        .map(|s| s.value as u64)
        .with_context(|| {
            format!("no {AVAILABLE_GAUGE}{{available=\"True\"}} on the hub's /metrics")
        })
}

/// The TLS handshakes on the hub's agents' listener that resumed, from its `/metrics` at
/// `address`.
async fn resumed_handshakes(address: std::net::SocketAddr) -> anyhow::Result<u64> {
    const RESUMED: &str = "flotilla_gateway_tls_resumptions_total";
    let page = crate::gateways::scrape(address).await?;
    let samples = crate::prometheus::samples(&page, |n| n == RESUMED)?;
    samples
        .first()
        .map(|s| s.value as u64)
        .with_context(|| format!("no {RESUMED} on the hub's /metrics"))
}

/// Counts `ours` among the hub apiserver's ManagedClusters that are Available, from a watch, and
/// sends the count (with the seconds since `start`) whenever it changes. The initial list asks
/// for any resourceVersion, which the apiserver serves from its watch cache; runs until aborted.
async fn available_by_watch(
    client: kube::Client,
    ours: HashSet<String>,
    start: Instant,
    counts: tokio::sync::watch::Sender<(u64, f64)>,
) {
    use flotilla_proto::api::ManagedCluster;
    use kube::runtime::{WatchStreamExt, watcher};
    let api = kube::Api::<ManagedCluster>::all(client);
    let mut events = watcher(api, watcher::Config::default().any_semantic())
        .default_backoff()
        .boxed();
    let mut available: HashSet<String> = HashSet::new();
    // A (re)list is counted whole: no partial count is sent while it arrives.
    let mut listing = false;
    while let Some(event) = events.next().await {
        let (name, up) = match event {
            Ok(watcher::Event::Apply(c) | watcher::Event::InitApply(c)) => {
                let up = serde_json::to_value(&c).is_ok_and(|v| {
                    condition(&v, MANAGED_CLUSTER_CONDITION_AVAILABLE) == Some("True")
                });
                (c.metadata.name.unwrap_or_default(), up)
            }
            Ok(watcher::Event::Delete(c)) => (c.metadata.name.unwrap_or_default(), false),
            Ok(watcher::Event::Init) => {
                available.clear();
                listing = true;
                continue;
            }
            Ok(watcher::Event::InitDone) => {
                listing = false;
                let _ = counts.send((available.len() as u64, start.elapsed().as_secs_f64()));
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "watching ManagedClusters");
                continue;
            }
        };
        if !ours.contains(&name) {
            continue;
        }
        let changed = if up {
            available.insert(name)
        } else {
            available.remove(&name)
        };
        if changed && !listing {
            let _ = counts.send((available.len() as u64, start.elapsed().as_secs_f64()));
        }
    }
}

/// Runs a scenario's body with the whole-scenario deadline: `--timeout` plus [`OVERRUN`].
pub(crate) async fn bounded(
    clock: &Clock,
    body: impl Future<Output = anyhow::Result<bool>>,
) -> anyhow::Result<bool> {
    match tokio::time::timeout_at(clock.deadline + OVERRUN, body).await {
        Ok(result) => result,
        Err(_) => Err(anyhow::anyhow!(
            "still running {OVERRUN:?} after its deadline: stopped"
        )),
    }
}

impl Run {
    /// Sets the scenario's outcome and, unless it completed, adds what the harness can see is
    /// wrong with the hub and the agents (see [`Run::diagnose`]).
    pub(crate) async fn conclude(
        &mut self,
        r: &mut ScenarioReport,
        clock: &Clock,
        result: anyhow::Result<bool>,
    ) {
        finish(r, clock, result);
        if r.outcome == Some(Outcome::Completed) {
            return;
        }
        let found = self.diagnose().await;
        if found.is_empty() {
            return;
        }
        let found = found.join("; ");
        r.error = Some(match r.error.take() {
            Some(e) => format!("{e}: {found}"),
            None => format!("did not finish within --timeout: {found}"),
        });
    }

    /// What is visibly wrong: the hub exited, or stopped listening, or does not answer; and
    /// how many agents cannot connect, by why.
    pub(crate) async fn diagnose(&mut self) -> Vec<String> {
        let mut found = Vec::new();
        if let Some(gateways) = self.hub.gateways_mut() {
            found.extend(gateways.exited());
        }
        let address = self.hub.agents;
        if let Some(status) = self.hub.exited() {
            found.push(format!(
                "the hub exited ({status}); see {}",
                self.hub.log().display()
            ));
        } else {
            let probe = tokio::time::timeout(
                Duration::from_secs(2),
                tokio::net::TcpStream::connect(address),
            )
            .await;
            match probe {
                Ok(Ok(_)) => {}
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    found.push(format!("the hub stopped listening on {address}"))
                }
                Ok(Err(e)) => found.push(format!("the hub at {address} cannot be reached: {e}")),
                Err(_) => found.push(format!(
                    "the hub at {address} does not accept connections (no answer within 2s)"
                )),
            }
        }
        let s = self.sample();
        let missing = self.n().saturating_sub(s.connected);
        if self.agents.is_some() && missing > 0 {
            let why: Vec<String> = s
                .failing
                .kinds()
                .iter()
                .map(|(kind, n)| format!("{n} {}", kind.describe()))
                .collect();
            if why.is_empty() {
                found.push(format!("{missing} agents have no session"));
            } else {
                found.push(format!(
                    "{missing} agents could not connect: {}",
                    why.join(", ")
                ));
            }
        }
        found
    }
}

pub(crate) fn finish(r: &mut ScenarioReport, clock: &Clock, result: anyhow::Result<bool>) {
    r.duration_s = clock.t();
    match result {
        Ok(true) => r.outcome = Some(Outcome::Completed),
        Ok(false) => r.outcome = Some(Outcome::TimedOut),
        Err(e) => {
            r.outcome = Some(Outcome::Failed);
            r.error = Some(format!("{e:#}"));
        }
    }
}

/// The ManifestWork a scenario sends: one ConfigMap, small, like most fleet config.
pub(crate) fn work_json(cluster: &str, name: &str) -> Value {
    json!({
        "apiVersion": "work.open-cluster-management.io/v1",
        "kind": "ManifestWork",
        "metadata": { "name": name, "namespace": cluster },
        "spec": { "workload": { "manifests": [{
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": { "name": format!("flotilla-loadtest-{name}"), "namespace": "default" },
            "data": { "work": name, "cluster": cluster },
        }]}},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_rate_finds_the_busiest_second() {
        let series: Vec<(f64, u64)> = (0..50)
            .map(|i| (i as f64 * 0.1, if i < 20 { 0 } else { (i - 20) * 10 }))
            .collect();
        let peak = peak_rate(&series);
        assert!((peak - 100.0).abs() < 1e-6, "{peak}");
        assert_eq!(peak_rate(&[]), 0.0);
        // Sparse samples: 3 s apart, 900 more each time: 300/s.
        let sparse = [(0.0, 0), (3.0, 900), (6.0, 1800)];
        assert!((peak_rate(&sparse) - 300.0).abs() < 1e-6);
    }

    #[test]
    fn the_setup_rate_does_not_count_the_agents_own_start() {
        // 10,000 sessions, the first dial 12 s in (the agents writing their identities), the
        // last welcome at 22 s: 1,000 a second, not 455.
        assert!((setup_rate(10_000, Some(12.0), 22.0) - 1000.0).abs() < 1e-6);
        assert!((setup_rate(10_000, None, 20.0) - 500.0).abs() < 1e-6);
    }
}
