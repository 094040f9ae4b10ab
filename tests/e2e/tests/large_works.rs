//! ManifestWorks beyond the store's object limit, end to end on the kube backend: a 10 MiB
//! bundle created with `flotilla work create -f`, stored as ManifestChunks on the real hub
//! apiserver, fetched chunk by chunk over the session, resumed after the agent is killed
//! half-way, applied on a real spoke, its status on the hub; a second work with the same
//! content costs no transfer and no cache space.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{Fleet, free_port, on_both_carriers, scrape, wait_for};
use nix::sys::signal::Signal;
use serde_json::{Value, json};

const CONFIG_MAPS: usize = 100;
/// 100 ConfigMaps of ~105 KiB: a bit over 10 MiB of manifests.
const BLOB_BYTES: usize = 105 * 1024;
/// Slow enough (per session) that the test can kill the agent half-way.
const RATE: &str = "--chunk-bytes-per-second=1048576";
const WAIT: Duration = Duration::from_secs(120);

fn bundle(dir: &Path) -> anyhow::Result<std::path::PathBuf> {
    let docs: Vec<String> = (0..CONFIG_MAPS)
        .map(|i| {
            serde_json::to_string(&json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": format!("bundle-{i:03}"), "namespace": "default"},
                "data": {"blob": format!("{i:03}").repeat(BLOB_BYTES / 3)},
            }))
        })
        .collect::<Result<_, _>>()?;
    let path = dir.join("bundle.yaml");
    std::fs::write(&path, docs.join("\n---\n"))?;
    Ok(path)
}

async fn metric(address: &str, name: &str) -> anyhow::Result<f64> {
    Ok(scrape(address).await?.value(name, &[]).unwrap_or(0.0))
}

on_both_carriers! {
    /// The acceptance of issue 15's large works.
    async fn a_ten_mib_work_is_chunked_delivered_resumed_and_cached_once() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let d = dir.path();
        let fleet = Fleet::start_with(d, true, &[RATE]).await?;
        let spoke = Spoke::start(d, &fleet.hub, "cluster1").await?;
        let agent_addr = format!("127.0.0.1:{}", free_port()?);
        let agent_flags = [format!("--metrics-addr={agent_addr}")];
        let agent_flags: Vec<&str> = agent_flags.iter().map(String::as_str).collect();
        let mut agent = spoke.start_agent(d, &fleet.hub, &agent_flags)?;
        let file = bundle(d)?;

        // `kubectl apply` of the whole work still fails at the apiserver (etcd's limit).
        let env = fleet.hub_env.as_ref().context("kube backend")?;
        let manifests: Vec<Value> = std::fs::read_to_string(&file)?
            .split("\n---\n")
            .map(serde_json::from_str)
            .collect::<Result<_, _>>()?;
        let raw = json!({
            "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
            "metadata": {"name": "raw", "namespace": "cluster1"},
            "spec": {"workload": {"manifests": manifests}},
        });
        let raw_path = d.join("raw.json");
        std::fs::write(&raw_path, serde_json::to_vec(&raw)?)?;
        let out = env.kubectl().args(["apply", "--server-side", "-f"]).arg(&raw_path).output()?;
        assert!(!out.status.success(), "kubectl apply of a 10 MiB ManifestWork succeeded");

        // `flotilla work create -f` takes it and says how it was stored.
        let said = fleet.cli(&["work", "create", "big", "-f", file.to_str().unwrap(), "--clusters", "cluster1"])?;
        assert!(said.contains("manifestwork cluster1/big created (chunked:"), "{said}");
        let stored = fleet.work("cluster1", "big")?.context("work stored")?;
        let reference = &stored["spec"]["workload"]["manifests"][0]["content"];
        let content_bytes = reference["bytes"].as_u64().context("content bytes")?;
        let chunk_count = reference["chunks"].as_array().map_or(0, Vec::len);
        assert!(content_bytes > 10 * 1024 * 1024, "{content_bytes}");
        assert_eq!(chunk_count as u64, content_bytes.div_ceil(512 * 1024));
        // Each chunk is its own object on the hub apiserver, in the cluster's namespace.
        let out = env.kubectl().args(["get", "manifestchunks.work.flotilla.io", "-n", "cluster1", "-o", "json"]).output()?;
        let list: Value = serde_json::from_slice(&out.stdout)
            .with_context(|| String::from_utf8_lossy(&out.stderr).into_owned())?;
        assert_eq!(list["items"].as_array().map_or(0, Vec::len), chunk_count);

        // Half-way through the transfer the agent is killed (SIGKILL: nothing flushed on exit).
        let half = content_bytes as f64 / 2.0;
        wait_for("half the content received", WAIT, || async {
            Ok((metric(&agent_addr, "flotilla_agent_chunk_bytes_received_total").await? >= half).then_some(()))
        })
        .await?;
        agent.signal_and_wait(Signal::SIGKILL);
        assert!(fleet.work("cluster1", "big")?.is_some_and(|w| w["status"]["conditions"].is_null()
            || flotilla_e2e::condition_status(&w, "Applied").as_deref() != Some("True")),
            "the work was applied before the kill: the test did not cut the transfer");

        // Restarted on the same cache, it asks only for what it did not store.
        let mut agent = spoke.start_agent(d, &fleet.hub, &agent_flags)?;
        let work = fleet.wait_applied("cluster1", "big").await?;
        let manifests = work["status"]["resourceStatus"]["manifests"].as_array().map_or(0, Vec::len);
        assert_eq!(manifests, CONFIG_MAPS, "status names every ConfigMap");
        let last = spoke.config_map("default", &format!("bundle-{:03}", CONFIG_MAPS - 1)).await?;
        assert!(last.is_some(), "the last ConfigMap of the bundle is on the spoke");
        let after = metric(&agent_addr, "flotilla_agent_chunk_bytes_received_total").await?;
        assert!(after > 0.0 && after <= content_bytes as f64 - half + 2.0 * 512.0 * 1024.0,
            "after the restart {after} bytes of {content_bytes} were sent: not resumed");
        let log = agent.log();
        let need: f64 = log.lines()
            .filter(|l| l.contains("fetching content"))
            .find_map(|l| l.split("need_bytes=").nth(1)?.split_whitespace().next()?.parse().ok())
            .context("the restarted agent logged what it still needed")?;
        assert_eq!(after, need, "bytes received after the restart are exactly the missing chunks'");
        eprintln!("content {content_bytes} bytes in {chunk_count} chunks; after the kill the restarted agent received {after} bytes");

        // A second work with the same content: no bytes sent, stored once.
        let said = fleet.cli(&["work", "create", "big-copy", "-f", file.to_str().unwrap(), "--clusters", "cluster1"])?;
        assert!(said.contains("chunked"), "{said}");
        fleet.wait_applied("cluster1", "big-copy").await?;
        assert_eq!(metric(&agent_addr, "flotilla_agent_chunk_bytes_received_total").await?, after);
        assert_eq!(metric(&agent_addr, "flotilla_agent_chunks_held").await?, chunk_count as f64,
            "the chunks are held once for two works");
        assert_eq!(metric(&agent_addr, "flotilla_agent_chunk_bytes_held").await?, content_bytes as f64);
        agent.signal_and_wait(Signal::SIGTERM);
        Ok(())
    }
}

/// `count` ConfigMaps of ~100 KiB each whose data all say `tag`: content of its own per tag.
fn bundle_of(dir: &Path, tag: &str, count: usize) -> anyhow::Result<std::path::PathBuf> {
    let docs: Vec<String> = (0..count)
        .map(|i| {
            serde_json::to_string(&json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": format!("{tag}-{i:02}"), "namespace": "default"},
                "data": {"blob": tag.repeat(100 * 1024 / tag.len())},
            }))
        })
        .collect::<Result<_, _>>()?;
    let path = dir.join(format!("{tag}.yaml"));
    std::fs::write(&path, docs.join("\n---\n"))?;
    Ok(path)
}

/// The names of the ManifestChunks in `namespace`, listed through the hub's apiserver.
fn hub_chunks(
    env: &flotilla_testenv::TestEnv,
    namespace: &str,
) -> anyhow::Result<BTreeSet<String>> {
    let out = env
        .kubectl()
        .args([
            "get",
            "manifestchunks.work.flotilla.io",
            "-n",
            namespace,
            "-o",
            "json",
        ])
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "kubectl get manifestchunks: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list: Value = serde_json::from_slice(&out.stdout)?;
    Ok(list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["metadata"]["name"].as_str().map(str::to_string))
        .collect())
}

/// The chunk object names a stored work's reference names, and its content's bytes.
fn chunks_of(work: &Value) -> (BTreeSet<String>, u64) {
    let content = &work["spec"]["workload"]["manifests"][0]["content"];
    let names = content["chunks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(|sha| format!("sha256-{sha}"))
        .collect();
    (names, content["bytes"].as_u64().unwrap_or(0))
}

/// Waits until the agent holds `chunks` chunks of `bytes` bytes together.
async fn agent_holds(address: &str, chunks: usize, bytes: u64) -> anyhow::Result<()> {
    wait_for(
        &format!("the agent to hold {chunks} chunks of {bytes} bytes"),
        WAIT,
        || async {
            let page = scrape(address).await?;
            let held = (
                page.value("flotilla_agent_chunks_held", &[])
                    .unwrap_or(-1.0),
                page.value("flotilla_agent_chunk_bytes_held", &[])
                    .unwrap_or(-1.0),
            );
            Ok((held == (chunks as f64, bytes as f64)).then_some(()))
        },
    )
    .await
}

/// The lifecycle of chunks (issue 15's large works): a deleted work's chunks, and a replaced
/// work's old ones, leave the hub after `--chunk-grace-period` and the agent's cache at once,
/// while chunks another work still names stay in both. Also: a chunk whose data does not match
/// its name is refused, and a placement's work over one object's limit is refused, each with
/// nothing stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_no_work_names_leave_the_hub_after_the_grace_and_the_agent_at_once()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    let fleet = Fleet::start_with(
        d,
        true,
        &[
            "--chunk-grace-period=3s",
            "--metrics-addr=127.0.0.1:0",
            RATE,
        ],
    )
    .await?;
    let env = fleet.hub_env.as_ref().context("kube backend")?;
    let hub_metrics = fleet
        .hub
        .metrics_addr
        .clone()
        .context("the hub wrote no metrics address")?;
    let spoke = Spoke::start(d, &fleet.hub, "cluster1").await?;
    let agent_addr = format!("127.0.0.1:{}", free_port()?);
    let agent_flags = [format!("--metrics-addr={agent_addr}")];
    let agent_flags: Vec<&str> = agent_flags.iter().map(String::as_str).collect();
    let mut agent = spoke.start_agent(d, &fleet.hub, &agent_flags)?;

    // Content a (about 1.5 MiB, 3 chunks) for two works, content b (about 1.2 MiB) for a third.
    let (a, b, c) = (
        bundle_of(d, "a", 15)?,
        bundle_of(d, "bb", 12)?,
        bundle_of(d, "ccc", 11)?,
    );
    let path = |p: &std::path::PathBuf| p.to_str().unwrap_or_default().to_string();
    for (work, file) in [("one", &a), ("two", &a), ("three", &b)] {
        let said = fleet.cli(&[
            "work",
            "create",
            work,
            "-f",
            &path(file),
            "--clusters",
            "cluster1",
        ])?;
        assert!(said.contains("chunked"), "{said}");
    }
    for work in ["one", "two", "three"] {
        fleet.wait_applied("cluster1", work).await?;
    }
    let (chunks_a, bytes_a) = chunks_of(&fleet.work("cluster1", "one")?.context("one stored")?);
    let (chunks_b, bytes_b) = chunks_of(&fleet.work("cluster1", "three")?.context("three stored")?);
    assert!(chunks_a.len() >= 3 && chunks_b.len() >= 3 && chunks_a.is_disjoint(&chunks_b));
    let both: BTreeSet<String> = chunks_a.union(&chunks_b).cloned().collect();
    assert_eq!(
        hub_chunks(env, "cluster1")?,
        both,
        "the hub holds each content's chunks once"
    );
    agent_holds(&agent_addr, both.len(), bytes_a + bytes_b).await?;

    // Work one deleted (two still names content a), work three replaced by content c.
    fleet.cli(&["work", "delete", "one", "--clusters", "cluster1"])?;
    let said = fleet.cli(&[
        "work",
        "create",
        "three",
        "-f",
        &path(&c),
        "--clusters",
        "cluster1",
        "--overwrite",
    ])?;
    assert!(said.contains("chunked"), "{said}");
    let replaced = fleet.wait_applied("cluster1", "three").await?;
    let (chunks_c, bytes_c) = chunks_of(&fleet.work("cluster1", "three")?.context("three stored")?);
    assert!(chunks_c.is_disjoint(&chunks_b), "{replaced}");
    wait_for("work one gone from the hub", WAIT, || async {
        Ok(fleet.work("cluster1", "one")?.is_none().then_some(()))
    })
    .await?;
    // The agent lets content b go as soon as it holds content c in its place.
    agent_holds(
        &agent_addr,
        chunks_a.len() + chunks_c.len(),
        bytes_a + bytes_c,
    )
    .await?;
    // The hub, after the grace: b's chunks deleted; a's (named by two) and c's stay.
    let expected: BTreeSet<String> = chunks_a.union(&chunks_c).cloned().collect();
    wait_for("the hub to delete content b's chunks", WAIT, || async {
        let held = hub_chunks(env, "cluster1")?;
        anyhow::ensure!(
            held.is_superset(&expected),
            "a chunk still named was deleted: held {held:?}, named {expected:?}"
        );
        Ok((held == expected).then_some(()))
    })
    .await?;
    // Counted once each deletion has returned: b's chunks, and nothing else.
    let counted = chunks_b.len() as f64;
    wait_for("the hub to count the deletions", WAIT, || async {
        let collected = scrape(&hub_metrics)
            .await?
            .value("flotilla_hub_chunks_collected_total", &[]);
        anyhow::ensure!(
            collected <= Some(counted),
            "more chunks collected than content b's: {collected:?}"
        );
        Ok((collected == Some(counted)).then_some(()))
    })
    .await?;
    let log = fleet.hub.proc.log();
    for name in &chunks_b {
        assert!(
            log.lines().any(|l| l.contains("ManifestChunk deleted")
                && l.contains(name.as_str())
                && l.contains("cluster1")),
            "no log line names the deletion of cluster1/{name}"
        );
    }
    // Still delivered whole: the agent applied two after all this, and three's new content.
    assert!(spoke.config_map("default", "a-00").await?.is_some());
    assert!(spoke.config_map("default", "ccc-10").await?.is_some());

    // A chunk whose data does not match its name: refused, naming both digests; nothing stored.
    // ("not the content", base64-encoded as Kubernetes encodes bytes.)
    let forged = json!({
        "apiVersion": "work.flotilla.io/v1alpha1", "kind": "ManifestChunk",
        "metadata": {"name": "sha256-0000000000000000000000000000000000000000000000000000000000000000", "namespace": "cluster1"},
        "spec": {"data": "bm90IHRoZSBjb250ZW50"},
    });
    let forged_path = d.join("forged.json");
    std::fs::write(&forged_path, serde_json::to_vec(&forged)?)?;
    let out = fleet.hub.cli(&["apply", "-f", &path(&forged_path)])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a forged chunk was stored: {err}");
    assert!(
        err.contains("ManifestChunk cluster1/sha256-0000000000000000000000000000000000000000000000000000000000000000")
            && err.contains(&format!("hashes to sha256 {}", flotilla_proto::api::content::sha256_hex(b"not the content")))
            && err.contains("not 0000000000000000000000000000000000000000000000000000000000000000"),
        "the refusal names the chunk and both digests: {err}"
    );
    assert!(
        !hub_chunks(env, "cluster1")?
            .iter()
            .any(|n| n.starts_with("sha256-0000")),
        "nothing stored"
    );

    // A placement's work over one object's limit: refused before anything is stored.
    let out = fleet.hub.cli(&[
        "work",
        "create",
        "fleet-wide",
        "-f",
        &path(&a),
        "--placement",
        "default/everywhere",
    ])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a ManifestWorkReplicaSet over the limit was made: {err}"
    );
    assert!(
        err.contains("ManifestWorkReplicaSet default/fleet-wide: manifests take")
            && err.contains("more than the 1048576 bytes")
            && err.contains("flotilla work create fleet-wide -f FILE --clusters"),
        "the refusal names the set, its size, the limit and what to do: {err}"
    );
    assert!(
        fleet
            .list(&["manifestworkreplicasets", "-n", "default"])?
            .is_empty(),
        "nothing stored"
    );

    // The last works deleted: every chunk leaves the agent, then the hub.
    for work in ["two", "three"] {
        fleet.cli(&["work", "delete", work, "--clusters", "cluster1"])?;
    }
    agent_holds(&agent_addr, 0, 0).await?;
    wait_for("the hub to delete every chunk", WAIT, || async {
        Ok(hub_chunks(env, "cluster1")?.is_empty().then_some(()))
    })
    .await?;

    // A transfer cut off by a kill, its work deleted on the hub while the agent is down: the
    // part received leaves the agent after its next sync, since the hub no longer sends it.
    let d_file = bundle_of(d, "dddd", 40)?;
    fleet.cli(&[
        "work",
        "create",
        "four",
        "-f",
        &path(&d_file),
        "--clusters",
        "cluster1",
    ])?;
    wait_for("part of work four's content held", WAIT, || async {
        let held = scrape(&agent_addr)
            .await?
            .value("flotilla_agent_chunks_held", &[]);
        Ok((held >= Some(2.0)).then_some(()))
    })
    .await?;
    agent.signal_and_wait(Signal::SIGKILL);
    let four = fleet.work("cluster1", "four")?.context("four stored")?;
    let (chunks_d, _) = chunks_of(&four);
    assert!(
        flotilla_e2e::condition_status(&four, "Applied").as_deref() != Some("True"),
        "work four was applied before the kill: the test did not cut the transfer"
    );
    fleet.cli(&["work", "delete", "four", "--clusters", "cluster1"])?;
    wait_for("work four gone from the hub", WAIT, || async {
        Ok(fleet.work("cluster1", "four")?.is_none().then_some(()))
    })
    .await?;
    let mut agent = spoke.start_agent(d, &fleet.hub, &agent_flags)?;
    agent_holds(&agent_addr, 0, 0).await?;
    let log = agent.log();
    assert!(
        log.contains("released the chunks of transfers the hub no longer asks for"),
        "the restarted agent did not say why it released chunks:\n{log}"
    );
    wait_for("the hub to delete work four's chunks", WAIT, || async {
        let held = hub_chunks(env, "cluster1")?;
        Ok((held.is_empty()).then_some(()))
    })
    .await?;
    assert!(chunks_d.len() >= 8, "{} chunks", chunks_d.len());
    agent.signal_and_wait(Signal::SIGTERM);
    Ok(())
}
