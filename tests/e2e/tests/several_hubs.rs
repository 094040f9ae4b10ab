//! One cluster, several hubs, OCM's first way: an agent per hub on one spoke. Two real hubs
//! (one on the kube backend, one on sled) and one real spoke apiserver; two `flotilla-agent`
//! processes, each with its own certificate from its hub, its own data directory and its own
//! `--hub-name`, apply to that one apiserver.
//!
//! These agents are hosted agents (OCM's second way): they run off the spoke, on the test's
//! host, with a kubeconfig to the spoke's apiserver, which is the setup docs/operations.md
//! describes for an agent outside its cluster.

use std::path::Path;
use std::time::Duration;

use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{Fleet, on_both_carriers, wait_for};
use nix::sys::signal::Signal;
use serde_json::{Value, json};

/// The hub names the two agents are given.
const DEPARTMENT: &str = "department";
const CENTRAL: &str = "central-it";

/// A work for `cluster1` of one ConfigMap `cm` in `default` with `data`.
fn configmap_work(name: &str, cm: &str, data: Value) -> Value {
    json!({
        "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
        "metadata": {"name": name, "namespace": "cluster1"},
        "spec": {"workload": {"manifests": [{
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": cm, "namespace": "default"},
            "data": data,
        }]}},
    })
}

/// The spoke's ConfigMap `default/name` data, or `None` when it is not there.
async fn spoke_data(spoke: &Spoke, name: &str) -> anyhow::Result<Option<Value>> {
    Ok(spoke
        .config_map("default", name)
        .await?
        .map(|cm| json!(cm.data.unwrap_or_default())))
}

async fn wait_spoke_data(spoke: &Spoke, name: &str, want: Value) -> anyhow::Result<()> {
    wait_for(
        &format!("ConfigMap default/{name} on the spoke to hold {want}"),
        Duration::from_secs(60),
        || async {
            let got = spoke_data(spoke, name).await?;
            Ok((got.as_ref() == Some(&want)).then_some(()))
        },
    )
    .await
}

/// The first manifest's Applied condition of the work as `fleet`'s hub shows it.
fn manifest_applied(work: &Value) -> Option<&Value> {
    work["status"]["resourceStatus"]["manifests"][0]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Applied")
}

fn start_dir(dir: &Path, name: &str) -> anyhow::Result<std::path::PathBuf> {
    let sub = dir.join(name);
    std::fs::create_dir_all(&sub)?;
    Ok(sub)
}

on_both_carriers! {
    /// Each hub's works are delivered by its own agent; a ConfigMap both hubs apply keeps both
    /// hubs' keys, the overlapping key stays the first hub's and the second hub's work says so
    /// naming it; deleting the first hub's work leaves the object with the second hub's keys;
    /// the first hub killed does not stop the second hub's next work.
    async fn two_hubs_share_one_spoke_through_an_agent_each() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let dept_dir = start_dir(dir.path(), "department")?;
        let central_dir = start_dir(dir.path(), "central")?;
        let mut department = Fleet::start(&dept_dir, true).await?;
        let central = Fleet::start(&central_dir, false).await?;
        let spoke = Spoke::start(dir.path(), &department.hub, "cluster1").await?;
        // A short resync: a field one hub lets go is taken by the other within seconds.
        let fast = ["--resync-interval=2s"];
        let _dept_agent = spoke.start_agent_for_hub(dir.path(), &department.hub, DEPARTMENT, &fast)?;
        let _central_agent = spoke.start_agent_for_hub(dir.path(), &central.hub, CENTRAL, &fast)?;

        // Each hub's own work arrives through its own agent.
        department.apply_value(
            &dept_dir,
            &configmap_work("dept-only", "dept-settings", json!({"store": "7"})),
        )?;
        central.apply_value(
            &central_dir,
            &configmap_work("central-only", "central-settings", json!({"audit": "on"})),
        )?;
        department.wait_applied("cluster1", "dept-only").await?;
        central.wait_applied("cluster1", "central-only").await?;
        wait_spoke_data(&spoke, "dept-settings", json!({"store": "7"})).await?;
        wait_spoke_data(&spoke, "central-settings", json!({"audit": "on"})).await?;

        // One ConfigMap, both hubs: the department first.
        department.apply_value(
            &dept_dir,
            &configmap_work("dept-shared", "shared", json!({"store": "7", "tier": "gold"})),
        )?;
        department.wait_applied("cluster1", "dept-shared").await?;
        central.apply_value(
            &central_dir,
            &configmap_work("central-shared", "shared", json!({"audit": "on", "tier": "bronze"})),
        )?;
        let conflict = wait_for(
            "central-shared's manifest to report the conflict",
            Duration::from_secs(60),
            || async {
                let work = central.work("cluster1", "central-shared")?;
                Ok(work
                    .as_ref()
                    .and_then(manifest_applied)
                    .filter(|c| c["reason"] == "ApplyConflict")
                    .cloned())
            },
        )
        .await?;
        assert_eq!(conflict["status"], "False");
        let message = conflict["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("hub department (flotilla-work-agent/department)")
                && message.contains(".data.tier"),
            "{message}"
        );
        // Both hubs' keys; the overlapping one stays the department's.
        wait_spoke_data(
            &spoke,
            "shared",
            json!({"store": "7", "tier": "gold", "audit": "on"}),
        )
        .await?;

        // Deleting the department's work leaves the object with central IT's keys, and central
        // IT then applies the key it no longer shares.
        department.cli(&["work", "delete", "dept-shared", "--clusters", "cluster1"])?;
        wait_spoke_data(&spoke, "shared", json!({"audit": "on", "tier": "bronze"})).await?;
        central.wait_applied("cluster1", "central-shared").await?;

        // The department's hub dies; central IT's next work is applied all the same.
        department.hub.proc.signal_and_wait(Signal::SIGKILL);
        central.apply_value(
            &central_dir,
            &configmap_work("central-after", "central-after", json!({"after": "yes"})),
        )?;
        central.wait_applied("cluster1", "central-after").await?;
        wait_spoke_data(&spoke, "central-after", json!({"after": "yes"})).await?;
        // What the department's agent applied stays while its hub is away.
        assert_eq!(spoke_data(&spoke, "dept-settings").await?, Some(json!({"store": "7"})));
        Ok(())
    }
}
