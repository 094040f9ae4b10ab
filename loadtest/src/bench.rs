//! `flotilla-loadtest bench-scheduler`: the placement scheduler's model alone, in this process,
//! with no store and no writes: what deciding costs in CPU and memory, separate from the store
//! writes that the `schedule` scenario's wall-clock figures include.
//!
//! It builds the fleet the `schedule` scenario builds (clusters in regions, every placement
//! picking some of its region's clusters, the global set bound), decides every placement once
//! (as the hub does after its first lists), then moves clusters between regions one at a time
//! and decides every placement each change marks dirty, as the hub's scheduler does.

use clap::Args;
use flotilla_hub::controllers::scheduling::fleet::{Fleet, Key};
use flotilla_proto::api::{ManagedCluster, Placement};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::time::Instant;

use crate::machine::ProcStats;
use crate::report::Percentiles;

#[derive(Clone, Debug, Args, Serialize, Deserialize)]
pub struct BenchArgs {
    /// Managed clusters.
    #[arg(long, default_value_t = 10_000)]
    pub clusters: usize,
    /// Placements, each selecting one region.
    #[arg(long, default_value_t = 1_000)]
    pub placements: usize,
    /// Each placement's numberOfClusters.
    #[arg(long, default_value_t = 100)]
    pub placement_clusters: usize,
    /// Regions the clusters are spread over (a label).
    #[arg(long, default_value_t = 10)]
    pub regions: usize,
    /// Clusters moved to another region, one after the other.
    #[arg(long, default_value_t = 100)]
    pub label_changes: usize,
    #[arg(long, default_value_t = crate::cli::DEFAULT_SEED)]
    pub seed: u64,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    #[serde(default)]
    pub json: bool,
}

/// What the bench measured.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct BenchReport {
    pub args: Option<BenchArgs>,
    /// Loading the clusters into the model.
    pub clusters_s: f64,
    /// Adding every placement (compiling it, filtering every cluster of its sets).
    pub placements_s: f64,
    /// Deciding every placement once.
    pub decide_all_s: f64,
    /// One placement added and decided on the loaded model.
    pub one_placement: Percentiles,
    /// One label change: marking what it affects and deciding those again.
    pub label_change: Percentiles,
    /// Placements decided again per label change, on average.
    pub redecided_per_change: f64,
    /// The model's own estimate of its memory (bit sets, indexes, names).
    pub model_bytes: usize,
    /// This process's resident memory before the fleet was built, and after.
    pub rss_before_bytes: Option<u64>,
    pub rss_after_bytes: Option<u64>,
}

pub fn run(args: &BenchArgs) -> anyhow::Result<BenchReport> {
    anyhow::ensure!(
        args.clusters >= 1 && args.placements >= 1 && args.regions >= 1,
        "--clusters, --placements and --regions must be at least 1"
    );
    let rss = || ProcStats::read("self").map(|s| s.rss_bytes);
    let mut report = BenchReport {
        args: Some(args.clone()),
        rss_before_bytes: rss(),
        ..Default::default()
    };
    let now = jiff::Timestamp::now();
    let mut fleet = Fleet::new();
    fleet.upsert_set(
        "global",
        &serde_json::from_value(
            json!({"clusterSelector": {"selectorType": "LabelSelector", "labelSelector": {}}}),
        )?,
        now,
    );
    fleet.upsert_binding("default", "global", "global", now);
    let cluster = |i: usize, region: usize| -> anyhow::Result<ManagedCluster> {
        Ok(serde_json::from_value(json!({
            "metadata": { "name": format!("c-{i:06}"), "labels": { "region": format!("r{region}") } },
            "spec": { "hubAcceptsClient": true },
        }))?)
    };
    let t = Instant::now();
    for i in 0..args.clusters {
        fleet.upsert_cluster(&cluster(i, i % args.regions)?, now);
    }
    report.clusters_s = t.elapsed().as_secs_f64();
    let placement = |k: usize| -> anyhow::Result<Placement> {
        Ok(serde_json::from_value(json!({
            "metadata": { "name": format!("p-{k:05}"), "namespace": "default", "uid": format!("uid-{k}") },
            "spec": {
                "numberOfClusters": args.placement_clusters,
                "predicates": [{ "requiredClusterSelector": { "labelSelector": {
                    "matchLabels": { "region": format!("r{}", k % args.regions) } } } }],
            },
        }))?)
    };
    let t = Instant::now();
    for k in 0..args.placements {
        fleet.upsert_placement(&placement(k)?, now);
    }
    report.placements_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for key in fleet.take_dirty() {
        fleet.decide(&key, now);
    }
    report.decide_all_s = t.elapsed().as_secs_f64();

    let mut one = Vec::new();
    for k in args.placements..args.placements + 20 {
        let t = Instant::now();
        fleet.upsert_placement(&placement(k)?, now);
        for key in fleet.take_dirty() {
            fleet.decide(&key, now);
        }
        one.push(t.elapsed().as_micros() as u64);
        fleet.delete_placement(&Key::new("default", &format!("p-{k:05}")));
    }
    report.one_placement = Percentiles::from_micros(&one);

    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let mut regions: Vec<usize> = (0..args.clusters).map(|i| i % args.regions).collect();
    let mut changes = Vec::new();
    let mut redecided = 0usize;
    for _ in 0..args.label_changes {
        let i = rng.random_range(0..args.clusters);
        regions[i] = (regions[i] + 1 + rng.random_range(0..args.regions.max(2) - 1)) % args.regions;
        let mc = cluster(i, regions[i])?;
        let t = Instant::now();
        fleet.upsert_cluster(&mc, now);
        let dirty = fleet.take_dirty();
        redecided += dirty.len();
        for key in dirty {
            fleet.decide(&key, now);
        }
        changes.push(t.elapsed().as_micros() as u64);
    }
    report.label_change = Percentiles::from_micros(&changes);
    report.redecided_per_change = redecided as f64 / args.label_changes.max(1) as f64;
    report.model_bytes = fleet.approximate_bytes();
    report.rss_after_bytes = rss();
    Ok(report)
}

/// The bench's result for people.
pub fn table(r: &BenchReport) -> String {
    let Some(a) = r.args.clone() else {
        return String::new();
    };
    let pct = |p: &Percentiles| {
        format!(
            "p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms (n={})",
            p.p50_ms, p.p99_ms, p.max_ms, p.count
        )
    };
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let mut t = format!(
        "scheduler model: {} placements, each {} of a region's clusters ({} regions), over {} clusters\n",
        a.placements, a.placement_clusters, a.regions, a.clusters
    );
    t += &format!("  clusters loaded in              {:.3} s\n", r.clusters_s);
    t += &format!(
        "  placements added in             {:.3} s\n",
        r.placements_s
    );
    t += &format!(
        "  every placement decided in      {:.3} s\n",
        r.decide_all_s
    );
    t += &format!(
        "  one more placement              {}\n",
        pct(&r.one_placement)
    );
    t += &format!(
        "  one label change, decided again {} ({:.0} placements each)\n",
        pct(&r.label_change),
        r.redecided_per_change
    );
    t += &format!(
        "  model memory (its estimate)     {:.1} MiB\n",
        r.model_bytes as f64 / (1u64 << 20) as f64
    );
    if let (Some(b), Some(a)) = (r.rss_before_bytes, r.rss_after_bytes) {
        t += &format!(
            "  process RSS before → after      {:.1} → {:.1} MiB\n",
            mib(b),
            mib(a)
        );
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bench_decides_every_placement_and_follows_each_change() {
        let args = BenchArgs {
            clusters: 300,
            placements: 30,
            placement_clusters: 5,
            regions: 3,
            label_changes: 10,
            seed: 7,
            json: false,
        };
        let r = run(&args).unwrap();
        assert_eq!(r.one_placement.count, 20);
        assert_eq!(r.label_change.count, 10);
        // A cluster moving region changes the candidates of both regions' placements.
        assert!(r.redecided_per_change >= 10.0, "{}", r.redecided_per_change);
        assert!(r.model_bytes > 0);
        assert!(table(&r).contains(
            "30 placements, each 5 of a region's clusters (3 regions), over 300 clusters"
        ));
    }
}
