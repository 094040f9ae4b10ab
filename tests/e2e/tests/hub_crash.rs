//! Crash safety of the single-node hub's store: a real `flotilla-hub` on the embedded store is
//! SIGKILLed at random points while operators write ManifestWorks through the real CLI, and
//! reopened each time. What the store acknowledged must be there after every kill.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use flotilla_e2e::{Hub, bin};
use nix::sys::signal::Signal;
use serde_json::{Value, json};

/// Operators writing at once, each to its own works.
const WRITERS: usize = 3;
/// Works per writer, updated round-robin, so most writes are updates of stored objects.
const WORKS_PER_WRITER: usize = 4;

/// What one writer did to one work: the highest version the hub acknowledged (`flotilla apply`
/// exited 0), and the highest it sent (acknowledged or not; a write cut by the kill may or may
/// not have been stored).
#[derive(Clone, Copy, Debug, Default)]
struct Written {
    acked: Option<u64>,
    sent: u64,
}

/// The ManifestWork `name` at `version` (in its ConfigMap's data), as a file for the CLI.
fn work_file(dir: &Path, name: &str, version: u64) -> anyhow::Result<std::path::PathBuf> {
    let work = json!({
        "apiVersion": "work.open-cluster-management.io/v1",
        "kind": "ManifestWork",
        "metadata": { "namespace": "cluster1", "name": name },
        "spec": { "workload": { "manifests": [{
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": { "namespace": "default", "name": name },
            "data": { "version": version.to_string() },
        }]}},
    });
    let path = dir.join(format!("{name}-{version}.json"));
    std::fs::write(&path, serde_json::to_vec(&work)?)?;
    Ok(path)
}

/// One operator: applies its works round-robin with rising versions through the real CLI
/// (`config`: the hub's operator config) until told to stop (the hub is killed under it).
/// Returns what it wrote to each work and how many writes were acknowledged.
fn writer(
    config: &Path,
    dir: &Path,
    writer: usize,
    first_version: u64,
    stop: &AtomicBool,
) -> anyhow::Result<(BTreeMap<String, Written>, usize)> {
    let mut written: BTreeMap<String, Written> = BTreeMap::new();
    let mut acked = 0;
    let mut version = first_version;
    while !stop.load(Ordering::Relaxed) {
        for slot in 0..WORKS_PER_WRITER {
            let name = format!("w-{writer}-{slot}");
            let file = work_file(dir, &name, version)?;
            let entry = written.entry(name).or_default();
            entry.sent = version;
            let out = Command::new(bin("flotilla"))
                .env("FLOTILLA_CONFIG", config)
                .arg("apply")
                .arg("-f")
                .arg(&file)
                .output()?;
            if out.status.success() {
                entry.acked = Some(version);
                acked += 1;
            }
            std::fs::remove_file(file)?;
        }
        version += 1;
    }
    Ok((written, acked))
}

/// What the store holds: every ManifestWork of cluster1 by name, with the version in its
/// ConfigMap and its resourceVersion, and the list's resourceVersion (the store's revision).
struct Stored {
    works: BTreeMap<String, (u64, u64)>,
    revision: u64,
}

/// Lists cluster1's works through the CLI.
fn stored(hub: &Hub) -> anyhow::Result<Stored> {
    let out = hub.cli(&["get", "works", "--cluster", "cluster1", "-o", "json"])?;
    anyhow::ensure!(
        out.status.success(),
        "get works: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list: Value = serde_json::from_slice(&out.stdout)?;
    let number = |v: &Value| v.as_str().and_then(|s| s.parse::<u64>().ok());
    let mut works = BTreeMap::new();
    for item in list["items"].as_array().into_iter().flatten() {
        let name = item["metadata"]["name"].as_str().unwrap_or_default();
        let version = number(&item["spec"]["workload"]["manifests"][0]["data"]["version"]);
        let rv = number(&item["metadata"]["resourceVersion"]);
        let (Some(version), Some(rv)) = (version, rv) else {
            anyhow::bail!("work {name} is stored without its version or resourceVersion: {item}");
        };
        works.insert(name.to_string(), (version, rv));
    }
    let revision = number(&list["metadata"]["resourceVersion"])
        .ok_or_else(|| anyhow::anyhow!("the work list has no resourceVersion: {list}"))?;
    Ok(Stored { works, revision })
}

/// The hub is killed with SIGKILL at random moments while three operators apply ManifestWorks,
/// hundreds of times. After every kill the hub starts on the same data dir (the store opens),
/// every acknowledged write is there (a work holds its last acknowledged version, or a later
/// one that was sent when the kill came), and revisions never go back: a watch resuming from
/// a revision the clients saw must not be served different objects under the same numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hub_store_keeps_every_acknowledged_write_across_sigkills() -> anyhow::Result<()> {
    use rand::Rng;
    const ITERATIONS: usize = 200;
    const TIME_BOUND: Duration = Duration::from_secs(150);

    let dir = tempfile::tempdir()?;
    let files = dir.path().join("works");
    std::fs::create_dir_all(&files)?;
    let (seed, mut rng) = flotilla_e2e::torture_rng();

    let mut hub = Hub::start(dir.path(), &[]).await?;
    let (agents, api) = (hub.agents_addr.clone(), hub.api_addr.clone());
    let config = hub.data_dir.join("operator/config.yaml");
    let mut written: BTreeMap<String, Written> = BTreeMap::new();
    let mut seen_revision = 0;
    let mut acked_writes = 0;
    let started = tokio::time::Instant::now();
    let mut iterations = 0;
    loop {
        let context = format!("after {iterations} kills (seed {seed})");
        // What the reopened store holds against what was acknowledged before.
        let Stored { works, revision } = stored(&hub)?;
        for (name, w) in &written {
            let held = works.get(name).map(|(version, _)| *version);
            match (w.acked, held) {
                (Some(acked), Some(v)) => assert!(
                    (acked..=w.sent).contains(&v),
                    "{context}: {name} holds version {v}, acknowledged {acked}, sent up to {}",
                    w.sent
                ),
                (Some(acked), None) => {
                    panic!("{context}: {name} lost, version {acked} was acknowledged")
                }
                (None, Some(v)) => assert!(v <= w.sent, "{context}: {name} holds unsent {v}"),
                (None, None) => {}
            }
        }
        assert!(
            revision >= seen_revision,
            "{context}: the store's revision went back from {seen_revision} to {revision}"
        );
        if let Some((name, (_, rv))) = works.iter().find(|(_, (_, rv))| *rv > revision) {
            panic!("{context}: {name} has resourceVersion {rv} above the store's {revision}");
        }
        seen_revision = revision;
        if iterations == ITERATIONS || started.elapsed() >= TIME_BOUND {
            break;
        }

        // Writers start above every version sent, so every write is a change.
        let first_version = written.values().map(|w| w.sent).max().unwrap_or(0) + 1;
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..WRITERS)
            .map(|n| {
                let (config, files, stop) = (config.clone(), files.clone(), Arc::clone(&stop));
                tokio::task::spawn_blocking(move || {
                    writer(&config, &files, n, first_version, &stop)
                })
            })
            .collect();
        // The kill point: anywhere in the writes, including before the first one lands.
        let kill_after = Duration::from_millis(rng.random_range(0..300));
        tokio::time::sleep(kill_after).await;
        hub.proc.signal_and_wait(Signal::SIGKILL);
        stop.store(true, Ordering::Relaxed);
        for task in writers {
            let (by_work, acked) = task.await??;
            acked_writes += acked;
            for (name, w) in by_work {
                let entry = written.entry(name).or_default();
                entry.sent = w.sent;
                entry.acked = w.acked.or(entry.acked);
            }
        }
        let log = hub.proc.log();
        assert!(!log.contains("panicked"), "{context}: {log}");
        iterations += 1;
        hub = Hub::start_listening(dir.path(), &agents, &api, &[])
            .await
            .map_err(|e| anyhow::anyhow!("after {iterations} kills (seed {seed}): {e:#}"))?;
    }
    eprintln!(
        "{iterations} kills, {acked_writes} acknowledged writes, in {:?}",
        started.elapsed()
    );
    assert!(
        iterations >= 50,
        "only {iterations} kills in {TIME_BOUND:?}"
    );
    assert!(
        acked_writes >= iterations,
        "only {acked_writes} writes acknowledged in {iterations} kills: the kills came too early to test anything"
    );
    Ok(())
}
