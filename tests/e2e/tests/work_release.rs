//! A deleted ManifestWork stays on the hub until its agent has cleaned the spoke, as OCM's
//! cleanup finalizer (`cluster.open-cluster-management.io/manifest-work-cleanup`) keeps it:
//! the hub puts the finalizer on the works it creates (a work created around it, with
//! `kubectl`, gets it from the gateway when the agent acknowledges the work), and the gateway
//! removes it when the agent reports the work released, or at once when no agent ever
//! reported on the work. Real hub apiserver (kube backend, every read through it), real spoke
//! apiserver, real agent process.

use std::path::Path;
use std::time::Duration;

use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{Fleet, Proc, condition_status, wait_for};
use flotilla_proto::contract::WORK_CLEANUP_FINALIZER;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use nix::sys::signal::Signal;
use serde_json::{Value, json};

const WORK: &str = "released";
/// A finalizer the test puts on the spoke's ConfigMap to hold the agent's delete, as a
/// controller on the spoke would.
const SPOKE_HOLD: &str = "e2e.flotilla.io/hold";

/// A work of one ConfigMap, `settings`, for `cluster1`.
fn work() -> Value {
    json!({
        "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
        "metadata": {"name": WORK, "namespace": "cluster1"},
        "spec": {"workload": {"manifests": [{
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "settings", "namespace": "default"},
            "data": {"mode": "store"},
        }]}},
    })
}

/// The hub's ManifestWorks in `cluster1`'s namespace, through the hub's apiserver.
async fn hub_works(fleet: &Fleet) -> anyhow::Result<Api<DynamicObject>> {
    let env = fleet.hub_env.as_ref().expect("a kube-backed fleet");
    let gvk = GroupVersionKind::gvk("work.open-cluster-management.io", "v1", "ManifestWork");
    let resource = ApiResource::from_gvk_with_plural(&gvk, "manifestworks");
    Ok(Api::namespaced_with(
        env.client().await?,
        "cluster1",
        &resource,
    ))
}

/// The work as the hub's apiserver has it, as JSON.
async fn stored_work(fleet: &Fleet) -> anyhow::Result<Option<Value>> {
    let works = hub_works(fleet).await?;
    Ok(works
        .get_opt(WORK)
        .await?
        .map(serde_json::to_value)
        .transpose()?)
}

fn has_cleanup_finalizer(work: &Value) -> bool {
    work["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|f| f.iter().any(|f| f == WORK_CLEANUP_FINALIZER))
}

/// `kubectl delete manifestwork` on the hub, without waiting for the finalizers.
fn delete_work(fleet: &Fleet) -> anyhow::Result<()> {
    let env = fleet.hub_env.as_ref().expect("a kube-backed fleet");
    let out = env
        .kubectl()
        .args([
            "delete",
            "manifestwork",
            "-n",
            "cluster1",
            WORK,
            "--wait=false",
        ])
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "kubectl delete: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

async fn wait_work_gone(fleet: &Fleet, why: &str) -> anyhow::Result<()> {
    wait_for(why, Duration::from_secs(60), || async {
        Ok(stored_work(fleet).await?.is_none().then_some(()))
    })
    .await
}

/// How a test's work is created.
#[derive(Clone, Copy, PartialEq)]
enum Created {
    /// `flotilla apply`: the hub creates it, with its cleanup finalizer.
    ThroughTheHub,
    /// `kubectl apply` on the hub's apiserver: the gateway adds the finalizer on the ack.
    AroundTheHub,
}

/// Creates the test's work in `cluster1` the way `how` says.
fn create_work(fleet: &Fleet, dir: &Path, how: Created) -> anyhow::Result<()> {
    match how {
        // `kubectl apply` on the kube-backed fleet's apiserver.
        Created::AroundTheHub => fleet.apply_value(dir, &work()),
        Created::ThroughTheHub => {
            let path = dir.join("work-through-the-hub.json");
            std::fs::write(&path, serde_json::to_vec(&work())?)?;
            fleet.cli(&["apply", "-f", path.to_str().unwrap_or_default()])?;
            Ok(())
        }
    }
}

/// A kube-backed fleet with `cluster1`, its agent (short retries, so a delete the spoke held
/// is tried again soon after it is let go), and the work created as `how` says, applied and
/// held by its finalizer.
async fn fleet_with_held_work(dir: &Path, how: Created) -> anyhow::Result<(Fleet, Spoke, Proc)> {
    let fleet = Fleet::start(dir, true).await?;
    let spoke = Spoke::start(dir, &fleet.hub, "cluster1").await?;
    let agent = spoke.start_agent(dir, &fleet.hub, &["--resync-interval=2s"])?;
    create_work(&fleet, dir, how)?;
    fleet.wait_applied("cluster1", WORK).await?;
    wait_for(
        "the cleanup finalizer on the acknowledged work",
        Duration::from_secs(60),
        || async { Ok(stored_work(&fleet).await?.filter(has_cleanup_finalizer)) },
    )
    .await?;
    Ok((fleet, spoke, agent))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_work_stays_on_the_hub_until_the_spoke_is_clean() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (fleet, spoke, _agent) = fleet_with_held_work(dir.path(), Created::ThroughTheHub).await?;
    assert!(spoke.config_map("default", "settings").await?.is_some());

    // Something on the spoke holds the ConfigMap's deletion.
    let cms: Api<ConfigMap> = Api::namespaced(spoke.env.client().await?, "default");
    cms.patch(
        "settings",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": [SPOKE_HOLD]}})),
    )
    .await?;

    delete_work(&fleet)?;
    // The agent deletes the ConfigMap, which waits; the work waits with it, and says why.
    let deleting = wait_for(
        "the work Deleting on the hub",
        Duration::from_secs(60),
        || async {
            Ok(stored_work(&fleet)
                .await?
                .filter(|w| condition_status(w, "Deleting").as_deref() == Some("True")))
        },
    )
    .await?;
    assert!(
        deleting["metadata"]["deletionTimestamp"].is_string(),
        "{deleting}"
    );
    assert!(has_cleanup_finalizer(&deleting), "{deleting}");
    let held = cms.get("settings").await?;
    assert!(
        held.metadata.deletion_timestamp.is_some(),
        "the agent asked the spoke to delete it"
    );
    assert!(
        stored_work(&fleet).await?.is_some(),
        "the work is still on the hub while the spoke holds its ConfigMap"
    );

    // The spoke lets go: the ConfigMap goes, the agent releases the work, the work goes.
    cms.patch(
        "settings",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await?;
    wait_work_gone(&fleet, "the released work gone from the hub").await?;
    assert!(
        spoke.config_map("default", "settings").await?.is_none(),
        "nothing of the work is left on the spoke"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_work_deleted_while_its_agent_is_away_goes_once_the_agent_is_back_and_clean()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // Created around the hub: held by the finalizer the gateway added on the agent's ack.
    let (fleet, spoke, mut agent) = fleet_with_held_work(dir.path(), Created::AroundTheHub).await?;

    agent.signal_and_wait(Signal::SIGKILL);
    delete_work(&fleet)?;
    // Until the hub has noticed the agent is gone, and after, the work waits for it.
    wait_for(
        "cluster1 Unknown on the hub",
        Duration::from_secs(60),
        || async {
            Ok((fleet
                .hub
                .cluster_condition("cluster1", "ManagedClusterConditionAvailable")?
                .as_deref()
                == Some("Unknown"))
            .then_some(()))
        },
    )
    .await?;
    let waiting = stored_work(&fleet)
        .await?
        .expect("the work stays while its agent is away");
    assert!(
        waiting["metadata"]["deletionTimestamp"].is_string(),
        "{waiting}"
    );
    assert!(
        spoke.config_map("default", "settings").await?.is_some(),
        "nobody removed it yet"
    );

    // Back, the agent hears of the deletion in its sync, removes the ConfigMap and releases.
    let _agent = spoke.start_agent(dir.path(), &fleet.hub, &["--resync-interval=2s"])?;
    wait_work_gone(&fleet, "the work gone once its agent is back").await?;
    assert!(spoke.config_map("default", "settings").await?.is_none());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_work_no_agent_reported_on_is_not_held_for_one() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let fleet = Fleet::start(dir.path(), true).await?;
    // Registered, but its agent never connects.
    let _spoke = Spoke::start(dir.path(), &fleet.hub, "cluster1").await?;

    // Created by the hub, it carries its finalizer from the start; deleted, the gateway lets
    // it go, since no agent ever reported on it.
    create_work(&fleet, dir.path(), Created::ThroughTheHub)?;
    let stored = stored_work(&fleet).await?.expect("the work is stored");
    assert!(has_cleanup_finalizer(&stored), "{stored}");
    delete_work(&fleet)?;
    wait_work_gone(&fleet, "the work no agent reported on let go").await?;

    // Created around the hub, nothing holds it: deleted at once.
    create_work(&fleet, dir.path(), Created::AroundTheHub)?;
    let stored = stored_work(&fleet).await?.expect("the work is stored");
    assert!(!has_cleanup_finalizer(&stored), "{stored}");
    delete_work(&fleet)?;
    assert!(
        stored_work(&fleet).await?.is_none(),
        "nothing holds a work no agent ever had"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphan_decommission_of_an_offline_cluster_leaves_no_work_held() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (fleet, spoke, mut agent) =
        fleet_with_held_work(dir.path(), Created::ThroughTheHub).await?;
    // Offline for good: no agent will ever release the work.
    agent.signal_and_wait(Signal::SIGKILL);
    let out = fleet.hub.cli(&[
        "cluster",
        "decommission",
        "cluster1",
        "--policy",
        "orphan",
        "--timeout",
        "2s",
    ])?;
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        said.contains("step 5/6 delete-works: 1 works deleted (released)"),
        "{said}"
    );
    assert!(
        said.ends_with("cluster cluster1 decommissioned\n"),
        "{said}"
    );
    assert!(
        stored_work(&fleet).await?.is_none(),
        "the decommission let the work go itself"
    );
    assert!(
        spoke.config_map("default", "settings").await?.is_some(),
        "orphaned: left on the spoke"
    );
    Ok(())
}
