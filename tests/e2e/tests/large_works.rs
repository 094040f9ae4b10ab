//! ManifestWorks beyond the store's object limit, end to end on the kube backend: a 10 MiB
//! bundle created with `flotilla work create -f`, stored as ManifestChunks on the real hub
//! apiserver, fetched chunk by chunk over the session, resumed after the agent is killed
//! half-way, applied on a real spoke, its status on the hub; a second work with the same
//! content costs no transfer and no cache space.

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
