//! What each extra hub costs one agent: `flotilla-agent` joined to 1, 2 and 4 hubs (sled hubs,
//! each its own process) on one real spoke apiserver, its resident memory and CPU measured
//! idle, and during a fan-out of `--works` ManifestWorks from every hub at once.
//!
//! ```sh
//! cargo build --release --workspace --bins
//! cargo run --release -p flotilla-e2e --example agent_hubs_rss -- --works 100
//! ```
//!
//! The binaries are the ones beside the example (`target/<profile>/`), so a release run
//! measures release binaries. Idle: the median of 20 one-second samples of `VmRSS`, 10 s after
//! every session is up, and the CPU the agent used over those 20 s. Fan-out: every hub applies
//! its works (one ConfigMap of about 1 KiB each) at once; the peak `VmRSS` sampled every 100 ms
//! until every ConfigMap is on the spoke, the CPU used and the time that took.

use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{Fleet, free_port, scrape, wait_for};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ListParams};
use serde_json::json;
use tokio::time::Instant;

const CLUSTER: &str = "store-1";
const LABEL: &str = "rss.flotilla.io/fanout";

/// `VmRSS` of `pid`, in KiB.
fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS")
}

/// User plus system CPU time of `pid`, in seconds.
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command's closing parenthesis; utime and stime are the 12th and 13th.
    let after = stat.rsplit_once(')').context("no command in stat")?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    // The clock tick is 100 Hz on Linux.
    Ok(ticks / 100.0)
}

fn median(mut values: Vec<u64>) -> u64 {
    values.sort_unstable();
    values[values.len() / 2]
}

/// A work of `hub` for the cluster: one labelled ConfigMap of about 1 KiB.
fn work(hub: &str, index: usize) -> serde_json::Value {
    json!({
        "apiVersion": "work.open-cluster-management.io/v1",
        "kind": "ManifestWork",
        "metadata": {"name": format!("{hub}-{index}"), "namespace": CLUSTER},
        "spec": {"workload": {"manifests": [{
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": format!("{hub}-{index}"), "namespace": "default",
                         "labels": {LABEL: "yes"}},
            "data": {"payload": "x".repeat(1024)},
        }]}},
    })
}

struct Figures {
    hubs: usize,
    idle_rss_kib: u64,
    idle_cpu_per_s: f64,
    fanout_peak_kib: u64,
    fanout_cpu_s: f64,
    fanout_s: f64,
}

async fn measure(dir: &Path, hubs: usize, works: usize) -> anyhow::Result<Figures> {
    let mut fleets = Vec::new();
    for h in 0..hubs {
        let hub_dir = dir.join(format!("hub{h}"));
        std::fs::create_dir_all(&hub_dir)?;
        fleets.push((hub_dir.clone(), Fleet::start(&hub_dir, false).await?));
    }
    let spoke = Spoke::start_unregistered(dir, CLUSTER).await?;
    let data = dir.join("agent-data");
    for (h, (_, fleet)) in fleets.iter().enumerate() {
        spoke
            .join_hub(dir, &fleet.hub, &format!("hub{h}"), &data)
            .await?;
    }
    let metrics = format!("127.0.0.1:{}", free_port()?);
    let metrics_flag = format!("--metrics-addr={metrics}");
    let agent =
        spoke.start_agent_for_joined_hubs(dir, &fleets[0].1.hub, &data, &[&metrics_flag])?;
    for (_, fleet) in &fleets {
        fleet.hub.wait_available(CLUSTER).await?;
    }
    wait_for("every hub's session", Duration::from_secs(60), || async {
        let page = scrape(&metrics).await?;
        let up = (0..hubs).all(|h| {
            page.value(
                "flotilla_agent_hub_connected",
                &[("hub", &format!("hub{h}"))],
            ) == Some(1.0)
        });
        Ok(up.then_some(()))
    })
    .await?;
    let pid = agent.pid();

    // Idle.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let cpu_before = cpu_seconds(pid)?;
    let mut samples = Vec::new();
    for _ in 0..20 {
        samples.push(rss_kib(pid)?);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let idle_cpu_per_s = (cpu_seconds(pid)? - cpu_before) / 20.0;
    let idle_rss_kib = median(samples);

    // Fan-out from every hub at once, the agent sampled from before the first apply.
    let start = Instant::now();
    let cpu_before = cpu_seconds(pid)?;
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let sampler = tokio::spawn(async move {
        let mut peak = 0;
        loop {
            peak = rss_kib(pid).map_or(peak, |rss| peak.max(rss));
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
                _ = stopped.changed() => return peak,
            }
        }
    });
    let mut applies = Vec::new();
    for (h, (hub_dir, fleet)) in fleets.iter().enumerate() {
        let docs: Vec<String> = (0..works)
            .map(|i| work(&format!("hub{h}"), i).to_string())
            .collect();
        let file = hub_dir.join("works.yaml");
        std::fs::write(&file, docs.join("\n---\n"))?;
        let mut apply = std::process::Command::new(flotilla_e2e::bin("flotilla"));
        apply
            .env(
                "FLOTILLA_CONFIG",
                fleet.hub.data_dir.join("operator/config.yaml"),
            )
            .args(["apply", "-f"])
            .stdout(std::process::Stdio::null())
            .arg(&file);
        applies.push(apply.spawn()?);
    }
    for mut apply in applies {
        anyhow::ensure!(apply.wait()?.success(), "flotilla apply failed");
    }
    let configmaps: Api<ConfigMap> = Api::namespaced(spoke.env.client().await?, "default");
    let want = hubs * works;
    loop {
        let on_spoke = configmaps
            .list_metadata(&ListParams::default().labels(LABEL))
            .await?
            .items
            .len();
        if on_spoke >= want {
            break;
        }
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(600),
            "{on_spoke} of {want} ConfigMaps after 600 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.send_replace(true);
    let peak = sampler.await?;
    let fanout_s = start.elapsed().as_secs_f64();
    Ok(Figures {
        hubs,
        idle_rss_kib,
        idle_cpu_per_s,
        fanout_peak_kib: peak,
        fanout_cpu_s: cpu_seconds(pid)? - cpu_before,
        fanout_s,
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let works = match args.iter().position(|a| a == "--works") {
        Some(i) => args
            .get(i + 1)
            .context("--works needs a number")?
            .parse()
            .context("--works needs a number")?,
        None => 100,
    };
    println!(
        "| hubs | idle RSS | idle CPU | fan-out ({works} works per hub) peak RSS | fan-out CPU | fan-out time |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    for hubs in [1, 2, 4] {
        let dir = tempfile::tempdir()?;
        let f = measure(dir.path(), hubs, works).await?;
        println!(
            "| {} | {:.1} MiB | {:.2} % of a core | {:.1} MiB | {:.2} s | {:.1} s |",
            f.hubs,
            f.idle_rss_kib as f64 / 1024.0,
            f.idle_cpu_per_s * 100.0,
            f.fanout_peak_kib as f64 / 1024.0,
            f.fanout_cpu_s,
            f.fanout_s
        );
    }
    Ok(())
}
