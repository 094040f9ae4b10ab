//! The placement scenarios.
//!
//! * `rollout`: a ManifestWorkReplicaSet rolled out Progressive (`--rollout-max-concurrency`,
//!   maxFailures 0) to every agent through a placement, with `--rollout-failures` simulated
//!   clusters refusing the first revision: the rollout must stop at the window holding the
//!   first failing cluster and name it; a second revision without the fault must then reach
//!   every cluster. The window is watched the whole time: never more clusters in flight than
//!   `maxConcurrency`.
//! * `schedule`: the scheduler at scale, no agents needed: `--placements` placements, each
//!   picking `--placement-clusters` of the clusters of one of `--regions` regions (a hub label),
//!   over every enrolled cluster: time from create to decision per placement and to all, one
//!   more placement on the settled hub, `--label-changes` label changes followed into every
//!   decision they affect, and the hub's memory before and after.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use anyhow::Context;
use flotilla_proto::api::{Kind, PLACEMENT_LABEL};
use futures::StreamExt;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::cli::RunArgs;
use crate::operator::{OperatorApi, POOL_SIZE, condition};
use crate::report::{Percentiles, RolloutReport, ScenarioReport, ScheduleReport};
use crate::scenario::{Clock, Run, finish};

/// Namespace of the scenarios' placements and replica sets (it exists on every backend).
pub(crate) const NAMESPACE: &str = "default";
/// The rollout scenario's placement and replica set.
pub(crate) const ROLLOUT: &str = "flotilla-loadtest-rollout";
/// Label on the schedule scenario's clusters that its placements select by.
const REGION_LABEL: &str = "loadtest.flotilla.dev/region";
/// Label on the rollout's works naming their replica set.
pub(crate) const REPLICA_SET_LABEL: &str = "work.open-cluster-management.io/manifestworkreplicaset";
/// Failing clusters named at most in the report.
const NAMED: usize = 10;

/// The object of revision `n` of the rollout's template; failing clusters refuse revision 1's.
pub fn rollout_object(revision: u32) -> String {
    format!("flotilla-loadtest-rollout-v{revision}")
}

/// The clusters the rollout scenario makes fail, evenly spread over the fleet (the first at the
/// middle when there is one), each refusing revision 1's object.
pub fn rollout_rejects(args: &RunArgs) -> BTreeMap<String, Vec<String>> {
    let n = args.agents;
    let k = args.rollout_failures.min(n);
    (1..=k)
        .map(|i| (args.cluster_name(n * i / (k + 1)), vec![rollout_object(1)]))
        .collect()
}

impl Run {
    /// `rollout`: see the module doc.
    pub async fn rollout(&mut self) -> ScenarioReport {
        let mut r = ScenarioReport::new("rollout", self.identities.len());
        let clock = Clock::new(self.args.timeout);
        let result = self.rollout_inner(&clock, &mut r).await;
        finish(&mut r, &clock, result);
        r
    }

    async fn rollout_inner(
        &mut self,
        clock: &Clock,
        r: &mut ScenarioReport,
    ) -> anyhow::Result<bool> {
        self.ensure_connected(clock).await?;
        let n = self.n() as usize;
        let api = self.api.clone();
        let failing: BTreeSet<String> = self.spec.rejects.keys().cloned().collect();
        let mut report = RolloutReport {
            max_concurrency: self.args.rollout_max_concurrency.clone(),
            failing_clusters: failing.iter().cloned().collect(),
            ..Default::default()
        };
        let window = threshold(&self.args.rollout_max_concurrency, n);
        report.window = window as u64;
        bind_global(&api).await?;
        api.apply(&json!({
            "apiVersion": Kind::Placement.api_version(), "kind": "Placement",
            "metadata": { "name": ROLLOUT, "namespace": NAMESPACE },
            "spec": {},
        }))
        .await?;
        let bar = self.bar("rollout", n as u64);
        bar.set_message("placement deciding");
        while decided(&api, NAMESPACE, ROLLOUT).await?.len() < n {
            anyhow::ensure!(
                !clock.expired(),
                "the placement did not select every cluster in time"
            );
            tokio::time::sleep(self.args.poll_interval).await;
        }
        let started = clock.t();
        api.apply(&replica_set(1, &self.args.rollout_max_concurrency))
            .await?;
        bar.set_message("revision 1");
        let first = follow(&api, clock, &bar, self.args.poll_interval, 1, n).await?;
        report.max_in_flight_v1 = first.max_in_flight;
        if let Some(stopped) = &first.stopped {
            report.stopped_after_s = Some(clock.t() - started);
            report.reached_when_stopped = first.reached;
            report.reported_failed = stopped.clone();
            let first_failing = failing.iter().next().cloned();
            report.stopped_in_window = first_failing.as_ref().and_then(|c| {
                let sorted: Vec<String> = (0..n).map(|i| self.args.cluster_name(i)).collect();
                sorted
                    .iter()
                    .position(|x| x == c)
                    .map(|p| (p / window.max(1) + 1) as u64)
            });
        }
        let fixed_at = clock.t();
        bar.set_message("revision 2 (fault fixed)");
        bar.set_position(0);
        api.apply(&replica_set(2, &self.args.rollout_max_concurrency))
            .await?;
        let second = follow(&api, clock, &bar, self.args.poll_interval, 2, n).await?;
        bar.finish_and_clear();
        report.max_in_flight_v2 = second.max_in_flight;
        report.reached_v2 = second.reached;
        if second.complete {
            report.complete_after_fix_s = Some(clock.t() - fixed_at);
        }
        let stopped_as_expected = failing.is_empty() != first.stopped.is_some()
            && failing
                .iter()
                .next()
                .is_none_or(|c| report.reported_failed.first() == Some(c));
        let done = stopped_as_expected
            && second.complete
            && report.max_in_flight_v1 <= window as u64
            && report.max_in_flight_v2 <= window as u64;
        r.rollout = Some(report);
        Ok(done)
    }

    /// `schedule`: see the module doc.
    pub async fn schedule(&mut self) -> ScenarioReport {
        let mut r = ScenarioReport::new("schedule", self.identities.len());
        let clock = Clock::new(self.args.timeout);
        let result = self.schedule_inner(&clock, &mut r).await;
        finish(&mut r, &clock, result);
        r
    }

    async fn schedule_inner(
        &mut self,
        clock: &Clock,
        r: &mut ScenarioReport,
    ) -> anyhow::Result<bool> {
        let api = self.api.clone();
        let regions = self.args.regions.max(1);
        let per = self.args.placement_clusters;
        let names: Vec<String> = self.identities.iter().map(|i| i.name.clone()).collect();
        let mut report = ScheduleReport {
            clusters: names.len() as u64,
            placements: self.args.placements as u64,
            regions: regions as u64,
            clusters_per_placement: per as u64,
            poll_interval_ms: self.args.poll_interval.as_secs_f64() * 1000.0,
            ..Default::default()
        };
        // Setup: every cluster in a region, the global set bound.
        let t = Instant::now();
        let bar = self.bar("labels", names.len() as u64);
        let region_of: HashMap<String, usize> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), i % regions))
            .collect();
        let results: Vec<anyhow::Result<()>> = futures::stream::iter(names.iter())
            .map(|c| {
                let api = api.clone();
                let region = format!("r{}", region_of[c]);
                async move { set_label(&api, c, &region).await }
            })
            .buffer_unordered(POOL_SIZE)
            .inspect(|_| bar.inc(1))
            .collect()
            .await;
        bar.finish_and_clear();
        results.into_iter().collect::<anyhow::Result<()>>()?;
        bind_global(&api).await?;
        report.setup_s = Some(t.elapsed().as_secs_f64());
        report.hub_rss_before_bytes = self.hub.stats().map(|s| s.rss_bytes);

        // Placements, created as fast as the API takes them; each one's latency from its own
        // create to its decision.
        let expected = |region: usize| {
            let in_region = names.len() / regions + usize::from(region < names.len() % regions);
            in_region.min(per)
        };
        let placement_name = |k: usize| format!("schedule-{k:05}");
        let t0 = Instant::now();
        let created: HashMap<String, Instant> = {
            let bar = self.bar("placements", self.args.placements as u64);
            let sent: Vec<anyhow::Result<(String, Instant)>> =
                futures::stream::iter(0..self.args.placements)
                    .map(|k| {
                        let api = api.clone();
                        let name = placement_name(k);
                        async move {
                            let at = Instant::now();
                            api.apply(&placement(&name, &format!("r{}", k % regions), per))
                                .await?;
                            Ok((name, at))
                        }
                    })
                    .buffer_unordered(POOL_SIZE)
                    .inspect(|_| bar.inc(1))
                    .collect()
                    .await;
            bar.finish_and_clear();
            sent.into_iter().collect::<anyhow::Result<_>>()?
        };
        report.create_s = Some(t0.elapsed().as_secs_f64());
        let bar = self.bar("decided", self.args.placements as u64);
        let mut decided_at: HashMap<String, Instant> = HashMap::new();
        while decided_at.len() < self.args.placements {
            anyhow::ensure!(
                !clock.expired(),
                "only {} placements decided before the deadline",
                decided_at.len()
            );
            let now = Instant::now();
            // The scheduler writes a placement's status after its decisions: a status that
            // counts the expected clusters means the decisions are stored. (Listing the
            // Placements is light; listing every decision would load the hub more than the
            // scheduler does.)
            for p in api.list(Kind::Placement, Some(NAMESPACE)).await? {
                let name = p["metadata"]["name"].as_str().unwrap_or_default();
                let Some(k) = name
                    .strip_prefix("schedule-")
                    .and_then(|k| k.parse::<usize>().ok())
                else {
                    continue;
                };
                if p["status"]["numberOfSelectedClusters"].as_u64()
                    == Some(expected(k % regions) as u64)
                {
                    decided_at.entry(name.to_string()).or_insert(now);
                }
            }
            bar.set_position(decided_at.len() as u64);
            tokio::time::sleep(self.args.poll_interval).await;
        }
        bar.finish_and_clear();
        report.time_to_all_decided_s = Some(t0.elapsed().as_secs_f64());
        let latencies: Vec<u64> = decided_at
            .iter()
            .filter_map(|(p, at)| {
                created
                    .get(p)
                    .map(|c| at.duration_since(*c).as_micros() as u64)
            })
            .collect();
        report.decision_latency = Some(Percentiles::from_micros(&latencies));
        report.hub_rss_after_bytes = self.hub.stats().map(|s| s.rss_bytes);

        // One more placement on the settled hub: KubeFleet's figure is for this case.
        let single = placement_name(self.args.placements);
        let at = Instant::now();
        api.apply(&placement(&single, "r0", per)).await?;
        loop {
            anyhow::ensure!(
                !clock.expired(),
                "the single placement was not decided in time"
            );
            if decided(&api, NAMESPACE, &single).await?.len() == expected(0) {
                report.single_placement_s = Some(at.elapsed().as_secs_f64());
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        // Label changes: a selected cluster moves region; every placement that had it must
        // drop it (and fill its place), read back object by object.
        let mut rng = rand::rngs::StdRng::seed_from_u64(self.args.seed);
        let mut per_change = Vec::new();
        let mut per_affected = Vec::new();
        let mut affected_total = 0;
        for _ in 0..self.args.label_changes {
            anyhow::ensure!(
                !clock.expired(),
                "label changes did not finish before the deadline"
            );
            let cluster = names[rng.random_range(0..names.len())].clone();
            let affected: Vec<String> = all_decisions(&api)
                .await?
                .into_iter()
                .filter(|(_, cs)| cs.contains(&cluster))
                .map(|(p, _)| p)
                .collect();
            let region = region_of[&cluster];
            let to = format!(
                "r{}",
                (region + 1 + rng.random_range(0..regions.max(2) - 1)) % regions
            );
            let at = Instant::now();
            set_label(&api, &cluster, &to).await?;
            let mut pending: BTreeSet<String> = affected.iter().cloned().collect();
            affected_total += pending.len();
            while !pending.is_empty() {
                anyhow::ensure!(
                    !clock.expired(),
                    "a label change was not reflected before the deadline"
                );
                let now = Instant::now();
                for p in pending.clone() {
                    let cs = decided(&api, NAMESPACE, &p).await?;
                    if !cs.contains(&cluster) {
                        per_affected.push(now.duration_since(at).as_micros() as u64);
                        pending.remove(&p);
                    }
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            per_change.push(at.elapsed().as_micros() as u64);
        }
        report.label_changes = self.args.label_changes as u64;
        report.affected_decisions = affected_total as u64;
        report.label_change_all_affected = Some(Percentiles::from_micros(&per_change));
        report.label_change_per_decision = Some(Percentiles::from_micros(&per_affected));
        r.schedule = Some(report);
        Ok(true)
    }
}

/// What following one revision of the rollout saw.
#[derive(Default)]
struct Followed {
    /// The replica set said its rollout stopped, naming these clusters.
    stopped: Option<Vec<String>>,
    complete: bool,
    /// Clusters the revision reached (their work carries it).
    reached: u64,
    /// The most works of the revision seen at once not yet Available.
    max_in_flight: u64,
}

/// Polls the replica set and its works until revision `revision` stopped or completed.
async fn follow(
    api: &OperatorApi,
    clock: &Clock,
    bar: &indicatif::ProgressBar,
    poll: Duration,
    revision: u32,
    n: usize,
) -> anyhow::Result<Followed> {
    let object = rollout_object(revision);
    let mut f = Followed::default();
    while !clock.expired() {
        let works: Vec<Value> = api
            .works()
            .await?
            .into_iter()
            .filter(|w| {
                w["metadata"]["labels"][REPLICA_SET_LABEL] == format!("{NAMESPACE}.{ROLLOUT}")
            })
            .filter(|w| {
                w["spec"]["workload"]["manifests"][0]["metadata"]["name"] == object.as_str()
            })
            .collect();
        f.reached = works.len() as u64;
        let in_flight = works
            .iter()
            .filter(|w| condition(w, "Available") != Some("True"))
            .count() as u64;
        f.max_in_flight = f.max_in_flight.max(in_flight);
        let available = works.len() as u64 - in_flight;
        bar.set_position(available);
        let set = api
            .get(Kind::ManifestWorkReplicaSet, Some(NAMESPACE), ROLLOUT)
            .await?;
        let rolled = set.as_ref().and_then(|s| {
            s["status"]["conditions"]
                .as_array()?
                .iter()
                .find(|c| c["type"] == "PlacementRolledOut")
                .cloned()
        });
        let generation = set
            .as_ref()
            .and_then(|s| s["metadata"]["generation"].as_i64());
        let template_current = set.as_ref().is_some_and(|s| {
            s["spec"]["manifestWorkTemplate"]["workload"]["manifests"][0]["metadata"]["name"]
                == object.as_str()
        });
        if let Some(c) = rolled.filter(|_| template_current && generation.is_some()) {
            if c["reason"] == "MaxFailuresExceeded" && revision == 1 {
                let message = c["message"].as_str().unwrap_or_default();
                let named = message.rsplit_once(": ").map_or("", |(_, n)| n);
                f.stopped = Some(
                    named
                        .split(", ")
                        .map(|s| s.split(' ').next().unwrap_or_default().to_string())
                        .filter(|s| !s.is_empty())
                        .take(NAMED)
                        .collect(),
                );
                return Ok(f);
            }
            if c["status"] == "True" && available as usize >= n {
                f.complete = true;
                return Ok(f);
            }
        }
        tokio::time::sleep(poll).await;
    }
    Ok(f)
}

pub(crate) fn replica_set(revision: u32, max_concurrency: &str) -> Value {
    json!({
        "apiVersion": Kind::ManifestWorkReplicaSet.api_version(), "kind": "ManifestWorkReplicaSet",
        "metadata": { "name": ROLLOUT, "namespace": NAMESPACE },
        "spec": {
            "manifestWorkTemplate": { "workload": { "manifests": [{
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": { "name": rollout_object(revision), "namespace": "default" },
                "data": { "revision": revision.to_string() },
            }]}},
            "placementRefs": [{
                "name": ROLLOUT,
                "rolloutStrategy": { "type": "Progressive", "progressive": {
                    "maxConcurrency": max_concurrency, "maxFailures": 0 } },
            }],
        },
    })
}

fn placement(name: &str, region: &str, clusters: usize) -> Value {
    json!({
        "apiVersion": Kind::Placement.api_version(), "kind": "Placement",
        "metadata": { "name": name, "namespace": NAMESPACE },
        "spec": {
            "numberOfClusters": clusters,
            "predicates": [{ "requiredClusterSelector": { "labelSelector": { "matchLabels": { REGION_LABEL: region } } } }],
        },
    })
}

/// `clusteradm clusterset bind global --namespace default`.
pub(crate) async fn bind_global(api: &OperatorApi) -> anyhow::Result<()> {
    api.apply(&json!({
        "apiVersion": Kind::ManagedClusterSetBinding.api_version(), "kind": "ManagedClusterSetBinding",
        "metadata": { "name": "global", "namespace": NAMESPACE },
        "spec": { "clusterSet": "global" },
    }))
    .await?;
    Ok(())
}

/// Sets the region label of a cluster on a fresh read (retried if someone wrote in between).
async fn set_label(api: &OperatorApi, cluster: &str, region: &str) -> anyhow::Result<()> {
    for _ in 0..5 {
        let mut mc = api
            .get(Kind::ManagedCluster, None, cluster)
            .await?
            .with_context(|| format!("no ManagedCluster {cluster}"))?;
        mc["metadata"]["labels"][REGION_LABEL] = region.into();
        if api.replace(&mc).await.is_ok() {
            return Ok(());
        }
    }
    anyhow::bail!("could not label cluster {cluster} (conflicts)")
}

/// The clusters a placement decided now (every PlacementDecision labelled with it).
pub(crate) async fn decided(
    api: &OperatorApi,
    ns: &str,
    placement: &str,
) -> anyhow::Result<Vec<String>> {
    let mut clusters = Vec::new();
    for i in 1.. {
        let Some(d) = api
            .get(
                Kind::PlacementDecision,
                Some(ns),
                &format!("{placement}-decision-{i}"),
            )
            .await?
        else {
            break;
        };
        clusters.extend(
            d["status"]["decisions"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c["clusterName"].as_str().map(str::to_string)),
        );
    }
    Ok(clusters)
}

/// Every placement's decided clusters, from one list of all PlacementDecisions.
async fn all_decisions(api: &OperatorApi) -> anyhow::Result<BTreeMap<String, Vec<String>>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for d in api.list(Kind::PlacementDecision, Some(NAMESPACE)).await? {
        let Some(p) = d["metadata"]["labels"][PLACEMENT_LABEL].as_str() else {
            continue;
        };
        out.entry(p.to_string()).or_default().extend(
            d["status"]["decisions"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c["clusterName"].as_str().map(str::to_string)),
        );
    }
    Ok(out)
}

/// A count or a percentage of `total`, rounded up (OCM's `maxConcurrency`).
fn threshold(v: &str, total: usize) -> usize {
    match v.strip_suffix('%') {
        Some(p) => p
            .parse::<f64>()
            .map_or(total, |p| (p / 100.0 * total as f64).ceil() as usize),
        None => v.parse().unwrap_or(total),
    }
    .clamp(1, total.max(1))
}
