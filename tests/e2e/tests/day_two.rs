//! Day-two operations end to end, with real processes (hub, agents, CLI) and real spoke
//! apiservers.
//!
//! `flotilla cluster decommission`: seed 001's failure mode is the point. A cluster
//! decommissioned while its agent is offline must keep its workloads (policy orphan) when the
//! agent comes back, even though the agent's cached copy of the work still says Foreground; a
//! clean decommission has the agent remove them; a decommission killed half-way resumes.
//!
//! The DR bootstrap of docs/operations.md: a spoke rebuilt from nothing joins again under its
//! old name with a fresh token, once the old registration is cleared, and gets its works back.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{Fleet, Proc, bin, wait_for};
use flotilla_testenv::workspace_root;
use nix::sys::signal::Signal;
use serde_json::Value;

const SEED_WORK: &str = "proto/tests/fixtures/manifestwork_my_first_work.yaml";
const WORK: &str = "my-first-work";
const DEPLOYMENT: &str = "nginx-deployment";

/// A fleet (the hub on sled, or on a real apiserver when `kube`) with one spoke, `cluster1`,
/// whose agent runs and has applied the seed's work (a ServiceAccount and a Deployment;
/// deleteOption unset, so Foreground).
async fn fleet_with_applied_work(dir: &Path, kube: bool) -> anyhow::Result<(Fleet, Spoke, Proc)> {
    let fleet = Fleet::start(dir, kube).await?;
    let spoke = Spoke::start(dir, &fleet.hub, "cluster1").await?;
    let agent = spoke.start_agent(dir, &fleet.hub, &[])?;
    fleet.apply(&workspace_root().join(SEED_WORK))?;
    spoke
        .wait_deployment_image(DEPLOYMENT, Some("nginx:1.14.2"))
        .await?;
    fleet.wait_applied("cluster1", WORK).await?;
    Ok((fleet, spoke, agent))
}

/// `flotilla cluster decommission cluster1 ARGS...`, run to its end.
fn decommission(fleet: &Fleet, args: &[&str]) -> anyhow::Result<std::process::Output> {
    let mut all = vec!["cluster", "decommission", "cluster1"];
    all.extend_from_slice(args);
    fleet.hub.cli(&all)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn managed_cluster(fleet: &Fleet) -> anyhow::Result<Option<Value>> {
    Ok(fleet
        .hub
        .clusters()?
        .into_iter()
        .find(|c| c["metadata"]["name"] == "cluster1"))
}

fn progress(fleet: &Fleet) -> anyhow::Result<Option<String>> {
    Ok(managed_cluster(fleet)?.and_then(|mc| {
        mc["metadata"]["annotations"]["flotilla.io/decommission"]
            .as_str()
            .map(str::to_string)
    }))
}

/// Waits until the agent's log says `refusal`: the hub refuses it, and it can never hear of a
/// deletion.
async fn wait_refused(agent: &Proc, refusal: &str) -> anyhow::Result<()> {
    wait_for(
        &format!("the agent to be refused: {refusal}"),
        Duration::from_secs(60),
        || async { Ok(agent.log().contains(refusal).then_some(())) },
    )
    .await
}

/// A placement in `default` that selects cluster1 while it is unreachable (its agent is
/// offline), and also while it is being decommissioned when `tolerant`.
fn placement(tolerant: bool) -> Value {
    let mut tolerations = vec![
        serde_json::json!({"key": "cluster.open-cluster-management.io/unreachable", "operator": "Exists"}),
    ];
    if tolerant {
        tolerations
            .push(serde_json::json!({"key": "flotilla.io/decommissioning", "operator": "Exists"}));
    }
    serde_json::json!({
        "apiVersion": "cluster.open-cluster-management.io/v1beta1",
        "kind": "Placement",
        "metadata": {"name": "keep-cluster1", "namespace": "default"},
        "spec": {"numberOfClusters": 1, "tolerations": tolerations},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offline_cluster_decommissioned_with_orphan_keeps_its_workloads_and_an_interrupted_run_resumes()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (fleet, spoke, mut agent) = fleet_with_applied_work(dir.path(), false).await?;

    // The agent goes offline holding the work with the default (Foreground) deleteOption.
    agent.signal_and_wait(Signal::SIGKILL);

    // The decommission writes Orphan into the work, then waits for the offline agent; it is
    // killed while it waits.
    let log = dir.path().join("decommission-1.out");
    let mut cli = Command::new(bin("flotilla"));
    cli.env(
        "FLOTILLA_CONFIG",
        fleet.hub.data_dir.join("operator/config.yaml"),
    )
    .args([
        "cluster",
        "decommission",
        "cluster1",
        "--policy",
        "orphan",
        "--timeout",
        "10m",
    ]);
    cli.stdout(Stdio::from(std::fs::File::create(&log)?))
        .stderr(Stdio::null());
    let mut first = cli.spawn()?;
    wait_for(
        "the decommission to wait for the agent's confirmation",
        Duration::from_secs(30),
        || async {
            let at_confirm = progress(&fleet)?.as_deref() == Some("policy=orphan,step=confirm");
            Ok((at_confirm
                && std::fs::read_to_string(&log)?
                    .contains("decommissioning cluster cluster1 with policy orphan"))
            .then_some(()))
        },
    )
    .await?;
    assert!(
        first.try_wait()?.is_none(),
        "the first run ended on its own: {}",
        std::fs::read_to_string(&log)?
    );
    first.kill()?;
    first.wait()?;
    let work = fleet
        .work("cluster1", WORK)?
        .expect("the work is still on the hub");
    assert_eq!(work["spec"]["deleteOption"]["propagationPolicy"], "Orphan");
    assert_eq!(work["metadata"]["generation"], 2);

    // Another policy on resume is refused, and changes nothing.
    let out = decommission(&fleet, &["--policy", "clean"])?;
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains(
            "cluster cluster1 is being decommissioned with --policy orphan (next step confirm)"
        ) && err.contains("flotilla cluster decommission cluster1 --policy orphan"),
        "{err}"
    );
    assert_eq!(
        progress(&fleet)?.as_deref(),
        Some("policy=orphan,step=confirm")
    );

    // A placement that tolerates the decommission's taint holds the cluster: the run
    // continues at the wait, gives up on the offline agent, revokes it before deleting
    // anything, and stops at the placement, naming it.
    fleet.apply(
        &workspace_root().join("proto/tests/fixtures/managedclustersetbinding_default.yaml"),
    )?;
    fleet.apply_value(dir.path(), &placement(true))?;
    fleet
        .wait_decided("default", "keep-cluster1", &["cluster1"])
        .await?;
    let out = decommission(&fleet, &["--timeout", "2s"])?;
    let said = text(&out.stdout);
    assert!(!out.status.success(), "{said}");
    let line = |n: usize| said.lines().nth(n).unwrap_or_default();
    assert_eq!(
        line(0),
        "resuming the decommission of cluster cluster1 (policy orphan) at step 2/6 confirm"
    );
    assert!(
        line(1).starts_with(
            "step 2/6 confirm: the agent did not report the Orphan policy of my-first-work"
        ),
        "{said}"
    );
    // Revoked before anything is unplaced or deleted.
    assert!(
        line(2).starts_with("step 3/6 revoke: cluster cluster1 denied"),
        "{said}"
    );
    let err = text(&out.stderr);
    assert!(
        err.contains("placements default/keep-cluster1 still select it")
            && err.contains("do they tolerate it?"),
        "{err}"
    );
    assert_eq!(
        progress(&fleet)?.as_deref(),
        Some("policy=orphan,step=unplace")
    );

    // The agent comes back in the middle, with its old cache (Foreground): revoked, it hears
    // nothing, and the workloads stay.
    let agent = spoke.start_agent(dir.path(), &fleet.hub, &[])?;
    wait_refused(&agent, "an operator denied this cluster").await?;
    assert!(spoke.deployment("default", DEPLOYMENT).await?.is_some());

    // The placement lets go; the same command finishes the job.
    fleet.apply_value(dir.path(), &placement(false))?;
    let out = decommission(&fleet, &["--policy", "orphan", "--timeout", "60s"])?;
    let said = text(&out.stdout);
    assert!(out.status.success(), "{said}\n{}", text(&out.stderr));
    let steps: Vec<&str> = said
        .lines()
        .map(|l| l.split(':').next().unwrap_or(""))
        .collect();
    assert_eq!(
        steps,
        [
            "resuming the decommission of cluster cluster1 (policy orphan) at step 4/6 unplace",
            "step 4/6 unplace",
            "step 5/6 delete-works",
            "step 6/6 delete-cluster",
            "cluster cluster1 decommissioned"
        ],
        "{said}"
    );
    assert!(managed_cluster(&fleet)?.is_none(), "the cluster is deleted");
    assert!(
        fleet.work("cluster1", WORK)?.is_none(),
        "the work is deleted"
    );

    // Deleted now, the cluster's agent stays refused, and what it applied stays where it is.
    wait_refused(&agent, "the hub has no cluster of this name").await?;
    assert!(spoke.deployment("default", DEPLOYMENT).await?.is_some());
    assert!(spoke.service_account("default", "my-sa").await?.is_some());

    // Running it once more says there is nothing left to do.
    let out = decommission(&fleet, &["--policy", "orphan"])?;
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("cluster cluster1 not found: there is nothing to decommission"),
        "{}",
        text(&out.stderr)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_decommission_waits_for_the_agent_then_has_it_remove_the_workloads_on_sled()
-> anyhow::Result<()> {
    clean_decommission(false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_decommission_waits_for_the_agent_then_has_it_remove_the_workloads_on_kube()
-> anyhow::Result<()> {
    clean_decommission(true).await
}

async fn clean_decommission(kube: bool) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (fleet, spoke, mut agent) = fleet_with_applied_work(dir.path(), kube).await?;

    // Offline: clean cannot go on without the agent, so it stops before removing anything
    // and says how to continue.
    agent.signal_and_wait(Signal::SIGKILL);
    let out = decommission(&fleet, &["--policy", "clean", "--timeout", "2s"])?;
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("the agent did not report the Foreground delete policy of my-first-work")
            && err.contains("Nothing was removed")
            && err.contains("--policy clean` again"),
        "{err}"
    );
    let mc = managed_cluster(&fleet)?.expect("the cluster is still there");
    assert_eq!(mc["spec"]["hubAcceptsClient"], true, "not revoked: {mc}");
    assert!(fleet.work("cluster1", WORK)?.is_some());
    assert!(spoke.deployment("default", DEPLOYMENT).await?.is_some());

    // The agent is back: the same command goes on from the wait and the agent deletes.
    let _agent = spoke.start_agent(dir.path(), &fleet.hub, &[])?;
    let out = decommission(&fleet, &["--policy", "clean", "--timeout", "60s"])?;
    let said = text(&out.stdout);
    assert!(out.status.success(), "{said}\n{}", text(&out.stderr));
    assert!(
        said.starts_with(
            "resuming the decommission of cluster cluster1 (policy clean) at step 2/6 confirm"
        ),
        "{said}"
    );
    assert!(
        said.contains(
            "step 2/6 confirm: the agent reported the Foreground policy of all its works (1)"
        ),
        "{said}"
    );
    assert!(
        said.ends_with("cluster cluster1 decommissioned\n"),
        "{said}"
    );
    // The works went only once the agent released them: the spoke is clean when the command
    // ends, not some time after.
    assert!(
        spoke.deployment("default", DEPLOYMENT).await?.is_none(),
        "the Deployment removed before the decommission ended"
    );
    assert!(
        spoke.service_account("default", "my-sa").await?.is_none(),
        "the ServiceAccount removed before the decommission ended"
    );
    assert!(managed_cluster(&fleet)?.is_none());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuilt_spoke_joins_again_under_its_name_once_the_old_registration_is_cleared()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (fleet, spoke, mut agent) = fleet_with_applied_work(dir.path(), false).await?;
    fleet.cli(&["cluster", "label", "cluster1", "region=eu"])?;

    // The store burns down: its agent, its volume and its apiserver are gone.
    agent.signal_and_wait(Signal::SIGKILL);
    drop(spoke);
    // A new apiserver, and no certificate: what it has is a join command.
    let rebuilt = Spoke::start_unregistered(dir.path(), "cluster1").await?;
    let token = |labels: &str| -> anyhow::Result<Value> {
        let out = fleet.cli(&[
            "token",
            "create",
            "--ttl",
            "1h",
            "--uses",
            "1",
            "--auto-accept-labels",
            labels,
            "-o",
            "json",
        ])?;
        Ok(serde_json::from_str(&out)?)
    };

    // A fresh token alone does not take the name over: the old key still holds it.
    let mut join = rebuilt.join_agent(
        dir.path(),
        &fleet.hub,
        &token("region=eu")?,
        &dir.path().join("rebuilt-1"),
    )?;
    wait_for(
        "the join to be refused for the name",
        Duration::from_secs(60),
        || async {
            Ok(join
                .log()
                .contains("is already registered with a different key")
                .then_some(()))
        },
    )
    .await?;
    assert!(
        join.log().contains("flotilla cluster delete cluster1"),
        "the refusal says how to clear the name: {}",
        join.log()
    );
    join.signal_and_wait(Signal::SIGKILL);

    // As docs/operations.md says: delete the old registration, join with a new token whose
    // labels are the old ones.
    fleet.cli(&["cluster", "delete", "cluster1"])?;
    let _agent = rebuilt.join_agent(
        dir.path(),
        &fleet.hub,
        &token("region=eu")?,
        &dir.path().join("rebuilt-2"),
    )?;
    rebuilt
        .wait_deployment_image(DEPLOYMENT, Some("nginx:1.14.2"))
        .await?;
    fleet.wait_applied("cluster1", WORK).await?;
    let mc = managed_cluster(&fleet)?.expect("cluster1 is registered again");
    assert_eq!(mc["metadata"]["labels"]["region"], "eu", "{mc}");
    assert_eq!(mc["spec"]["hubAcceptsClient"], true, "{mc}");
    Ok(())
}

/// docs/operations.md, "The hub CA through an outage": an agent offline through `flotilla ca
/// rotate` comes back during the overlap on its old trust and certificate and receives the
/// new bundle; one that is still on its old certificate when the overlap ends is refused, and
/// the documented out-of-band path (delete, a token pinning the new CA, a fresh identity)
/// brings it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_offline_through_a_ca_rotation_returns_in_the_overlap_and_rejoins_after_it()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut fleet = Fleet::start(dir.path(), false).await?;
    let spoke = Spoke::start_unregistered(dir.path(), "cluster1").await?;
    let token = |fleet: &Fleet| -> anyhow::Result<Value> {
        let out = fleet.cli(&["token", "create", "--auto-accept", "-o", "json"])?;
        Ok(serde_json::from_str(&out)?)
    };
    let available = |fleet: &Fleet| -> anyhow::Result<bool> {
        Ok(fleet
            .hub
            .cluster_condition("cluster1", "ManagedClusterConditionAvailable")?
            .as_deref()
            == Some("True"))
    };
    let data = dir.path().join("cluster1-agent");
    let before = token(&fleet)?;
    let mut agent = spoke.join_agent(dir.path(), &fleet.hub, &before, &data)?;
    wait_for("cluster1 Available", Duration::from_secs(60), || async {
        Ok(available(&fleet)?.then_some(()))
    })
    .await?;

    // Offline through the rotation (and the hub restart the docs ask for).
    agent.signal_and_wait(Signal::SIGKILL);
    assert!(fleet.cli(&["ca", "rotate"])?.contains("in progress"));
    fleet.hub.restart(dir.path(), &[]).await?;
    let agent = spoke.join_agent(dir.path(), &fleet.hub, &before, &data)?;
    wait_for(
        "the returning agent to store the new CA bundle",
        Duration::from_secs(60),
        || async {
            Ok(agent
                .log()
                .contains("the hub's CA bundle changed")
                .then_some(()))
        },
    )
    .await?;
    let bundle = std::fs::read_to_string(data.join("identity/ca.crt"))?;
    assert_eq!(
        bundle.matches("BEGIN CERTIFICATE").count(),
        2,
        "old and new CA"
    );
    wait_for(
        "cluster1 Available again",
        Duration::from_secs(60),
        || async { Ok(available(&fleet)?.then_some(())) },
    )
    .await?;

    // The overlap ends before it renewed: its old-CA certificate is refused.
    drop(agent);
    fleet.cli(&["ca", "finish-rotation"])?;
    fleet.hub.restart(dir.path(), &[]).await?;
    let agent = spoke.join_agent(dir.path(), &fleet.hub, &before, &data)?;
    wait_refused(&agent, "refused this agent's certificate").await?;
    drop(agent);

    // The out-of-band path: the join command pins the new CA.
    fleet.cli(&["cluster", "delete", "cluster1"])?;
    let after = token(&fleet)?;
    assert_ne!(after["caFingerprint"], before["caFingerprint"]);
    std::fs::remove_dir_all(data.join("identity"))?;
    let _agent = spoke.join_agent(dir.path(), &fleet.hub, &after, &data)?;
    wait_for(
        "cluster1 Available after the rejoin",
        Duration::from_secs(60),
        || async { Ok(available(&fleet)?.then_some(())) },
    )
    .await?;
    Ok(())
}
