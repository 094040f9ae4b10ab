//! ManifestWork delivery end to end: real hub, real agents, real spoke apiservers.

use std::path::Path;
use std::time::Duration;

use flotilla_e2e::on_both_carriers;
use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{Fleet, Hub, condition_status, wait_for};
use flotilla_testenv::workspace_root;
use nix::sys::signal::Signal;
use serde_json::Value;

const SEED_WORK: &str = "proto/tests/fixtures/manifestwork_my_first_work.yaml";

/// The seed's ManifestWork, retargeted at `cluster` and edited by `edit`, written to a file.
fn seed_work(
    dir: &Path,
    cluster: &str,
    edit: impl FnOnce(&mut Value),
) -> anyhow::Result<std::path::PathBuf> {
    let text = std::fs::read_to_string(workspace_root().join(SEED_WORK))?;
    let mut work: Value = yaml_serde::from_str(&text)?;
    work["metadata"]["namespace"] = cluster.into();
    edit(&mut work);
    let path = dir.join(format!("work-{cluster}-{}.json", rand_suffix()));
    std::fs::write(&path, serde_json::to_vec_pretty(&work)?)?;
    Ok(path)
}

/// Status and message of a condition of one `status.resourceStatus.manifests[]` entry.
fn manifest_condition(manifest: &Value, t: &str) -> (Option<String>, String) {
    let c = manifest["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == t));
    (
        c.and_then(|c| c["status"].as_str()).map(str::to_string),
        c.and_then(|c| c["message"].as_str())
            .unwrap_or("")
            .to_string(),
    )
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn set_image(work: &mut Value, image: &str) {
    work["spec"]["workload"]["manifests"][1]["spec"]["template"]["spec"]["containers"][0]["image"] =
        image.into();
}

async fn delivery(kube: bool) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let fleet = Fleet::start(dir.path(), kube).await?;
    let spokes = [
        Spoke::start(dir.path(), &fleet.hub, "cluster1").await?,
        Spoke::start(dir.path(), &fleet.hub, "cluster2").await?,
    ];
    let _agents = spokes
        .iter()
        .map(|s| s.start_agent(dir.path(), &fleet.hub, &[]))
        .collect::<anyhow::Result<Vec<_>>>()?;

    // cluster1 gets the seed's YAML unchanged (it names namespace cluster1), cluster2 a copy.
    fleet.apply(&workspace_root().join(SEED_WORK))?;
    fleet.apply(&seed_work(dir.path(), "cluster2", |_| {})?)?;
    for spoke in &spokes {
        spoke
            .wait_deployment_image("nginx-deployment", Some("nginx:1.14.2"))
            .await?;
        assert!(spoke.service_account("default", "my-sa").await?.is_some());
        let work = fleet.wait_applied(&spoke.name, "my-first-work").await?;
        let manifests = work["status"]["resourceStatus"]["manifests"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let kinds: Vec<&str> = manifests
            .iter()
            .filter_map(|m| m["resourceMeta"]["kind"].as_str())
            .collect();
        assert_eq!(
            kinds,
            ["ServiceAccount", "Deployment"],
            "per-resource status: {work}"
        );
        for m in &manifests {
            assert_eq!(
                manifest_condition(m, "Applied").0.as_deref(),
                Some("True"),
                "{m}"
            );
        }
        assert_eq!(manifests[1]["resourceMeta"]["resource"], "deployments");
        assert_eq!(manifests[1]["resourceMeta"]["group"], "apps");
    }

    // An update of the work reaches the spokes.
    for spoke in &spokes {
        fleet.apply(&seed_work(dir.path(), &spoke.name, |w| {
            set_image(w, "nginx:1.25.5")
        })?)?;
    }
    for spoke in &spokes {
        spoke
            .wait_deployment_image("nginx-deployment", Some("nginx:1.25.5"))
            .await?;
    }

    // Removing a manifest from the work deletes its resource on the spokes.
    for spoke in &spokes {
        fleet.apply(&seed_work(dir.path(), &spoke.name, |w| {
            set_image(w, "nginx:1.25.5");
            let deployment = w["spec"]["workload"]["manifests"][1].clone();
            w["spec"]["workload"]["manifests"] = Value::Array(vec![deployment]);
        })?)?;
    }
    for spoke in &spokes {
        wait_for(
            &format!("{}: my-sa deleted", spoke.name),
            Duration::from_secs(60),
            || async {
                Ok(spoke
                    .service_account("default", "my-sa")
                    .await?
                    .is_none()
                    .then_some(()))
            },
        )
        .await?;
        assert!(
            spoke
                .deployment("default", "nginx-deployment")
                .await?
                .is_some()
        );
    }

    // Deleting the work: Orphan on cluster1 leaves the Deployment, Foreground on cluster2
    // removes it. Both are checked after the agents have finished with the deletion (the works
    // are gone from the hub once their agents released them), not merely soon after.
    fleet.apply(&seed_work(dir.path(), "cluster1", |w| {
        set_image(w, "nginx:1.25.5");
        w["spec"]["deleteOption"] = serde_json::json!({ "propagationPolicy": "Orphan" });
    })?)?;
    fleet.wait_applied("cluster1", "my-first-work").await?;
    let out = fleet.hub.cli(&[
        "work",
        "delete",
        "my-first-work",
        "--clusters",
        "cluster1,cluster2",
    ])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Each work stays on the hub (its cleanup finalizer) until its agent has released it.
    for spoke in &spokes {
        wait_for(
            &format!("{}'s agent to release the deleted work", spoke.name),
            Duration::from_secs(60),
            || async {
                Ok(fleet
                    .work(&spoke.name, "my-first-work")?
                    .is_none()
                    .then_some(()))
            },
        )
        .await?;
    }
    assert!(
        spokes[1]
            .deployment("default", "nginx-deployment")
            .await?
            .is_none(),
        "Foreground: released only once the Deployment is gone from cluster2"
    );
    assert!(
        spokes[0]
            .deployment("default", "nginx-deployment")
            .await?
            .is_some(),
        "Orphan must leave the Deployment on cluster1"
    );
    Ok(())
}

on_both_carriers! {
    async fn seed_work_reaches_two_spokes_follows_updates_and_deletes_sled() -> anyhow::Result<()> {
        delivery(false).await
    }
}

on_both_carriers! {
    async fn seed_work_reaches_two_spokes_follows_updates_and_deletes_kube() -> anyhow::Result<()> {
        delivery(true).await
    }
}

on_both_carriers! {
    /// The hub goes away; the agent keeps enforcing its cache, even across its own restart; the
    /// statuses it recorded meanwhile reach the hub when it returns.
    async fn agent_rides_out_a_hub_outage() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let mut fleet = Fleet::start(dir.path(), false).await?;
        let spoke = Spoke::start(dir.path(), &fleet.hub, "cluster1").await?;
        let resync = ["--resync-interval=1s"];
        let mut agent = spoke.start_agent(dir.path(), &fleet.hub, &resync)?;

        fleet.apply(&workspace_root().join(SEED_WORK))?;
        // A second work that cannot apply yet: its namespace does not exist on the spoke.
        let late = seed_work(dir.path(), "cluster1", |w| {
            w["metadata"]["name"] = "late-work".into();
            w["spec"]["workload"]["manifests"] = serde_json::json!([{
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": { "namespace": "created-later", "name": "settings" },
                "data": { "mode": "store" },
            }]);
        })?;
        fleet.apply(&late)?;
        fleet.wait_applied("cluster1", "my-first-work").await?;
        wait_for(
            "late-work Degraded on the hub",
            Duration::from_secs(60),
            || async {
                let w = fleet.work("cluster1", "late-work")?;
                Ok(
                    w.filter(|w| condition_status(w, "Applied").as_deref() == Some("False"))
                        .map(|_| ()),
                )
            },
        )
        .await?;

        // The hub stops. The Deployment is deleted by hand and the agent restarts, hub still down.
        fleet.hub.proc.signal_and_wait(Signal::SIGTERM);
        let client = spoke.env.client().await?;
        let deployments: kube::Api<k8s_openapi::api::apps::v1::Deployment> =
            kube::Api::namespaced(client.clone(), "default");
        deployments
            .delete("nginx-deployment", &Default::default())
            .await?;
        agent.signal_and_wait(Signal::SIGKILL);
        let _agent = spoke.start_agent(dir.path(), &fleet.hub, &resync)?;
        spoke
            .wait_deployment_image("nginx-deployment", Some("nginx:1.14.2"))
            .await?;

        // While the hub is away the blocker goes: the late work now applies, and that status waits
        // in the agent's outbox.
        let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(client);
        namespaces
            .create(
                &Default::default(),
                &serde_json::from_value(serde_json::json!({"metadata": {"name": "created-later"}}))?,
            )
            .await?;
        wait_for(
            "the ConfigMap applied during the outage",
            Duration::from_secs(60),
            || async {
                Ok(spoke
                    .config_map("created-later", "settings")
                    .await?
                    .map(|_| ()))
            },
        )
        .await?;

        fleet.hub.restart(dir.path(), &[]).await?;
        fleet.wait_applied("cluster1", "late-work").await?;
        fleet.wait_applied("cluster1", "my-first-work").await?;
        Ok(())
    }
}

on_both_carriers! {
    /// Invalid manifests fail alone, with the spoke's own words; the rest of the work applies. A
    /// manifest without a kind never gets that far: the hub refuses the work on both backends.
    async fn invalid_manifests_are_reported_per_manifest_and_the_rest_applies() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        // The kube backend: kubectl stores what the CRD schema admits, so the agent is the judge.
        let fleet = Fleet::start(dir.path(), true).await?;
        let spoke = Spoke::start(dir.path(), &fleet.hub, "cluster1").await?;
        let _agent = spoke.start_agent(dir.path(), &fleet.hub, &[])?;

        let no_kind = seed_work(dir.path(), "cluster1", |w| {
            w["metadata"]["name"] = "no-kind".into();
            w["spec"]["workload"]["manifests"] = serde_json::json!([{ "apiVersion": "v1", "metadata": { "namespace": "default", "name": "x" } }]);
        })?;
        let err = fleet.apply(&no_kind).unwrap_err().to_string();
        assert!(err.contains("kind"), "the hub names what is missing: {err}");
        let sled_dir = dir.path().join("sled");
        std::fs::create_dir_all(&sled_dir)?;
        let sled = Fleet::start(&sled_dir, false).await?;
        let err = sled.apply(&no_kind).unwrap_err().to_string();
        assert!(
            err.contains("manifest #0 has no kind"),
            "the operator API names the manifest: {err}"
        );

        let work = seed_work(dir.path(), "cluster1", |w| {
            w["metadata"]["name"] = "mixed".into();
            w["spec"]["workload"]["manifests"] = serde_json::json!([
                { "apiVersion": "v1", "kind": "ConfigMap", "metadata": { "namespace": "default", "name": "good" } },
                { "apiVersion": "v1", "kind": "ConfigMap", "metadata": { "namespace": "default" } },
                { "apiVersion": "widgets.example.com/v1", "kind": "Widget", "metadata": { "namespace": "default", "name": "w" } },
                { "apiVersion": "apps/v1", "kind": "Deployment", "metadata": { "namespace": "default", "name": "bad" },
                  "spec": { "replicas": -1, "selector": { "matchLabels": { "a": "b" } },
                            "template": { "metadata": { "labels": { "a": "b" } }, "spec": { "containers": [{ "name": "c", "image": "x" }] } } } },
            ]);
        })?;
        fleet.apply(&work)?;
        let status = wait_for(
            "mixed work Degraded with per-manifest status",
            Duration::from_secs(60),
            || async {
                let Some(w) = fleet.work("cluster1", "mixed")? else {
                    return Ok(None);
                };
                let n = w["status"]["resourceStatus"]["manifests"]
                    .as_array()
                    .map_or(0, Vec::len);
                Ok(
                    (n == 4 && condition_status(&w, "Degraded").as_deref() == Some("True"))
                        .then_some(w),
                )
            },
        )
        .await?;
        assert!(
            spoke.config_map("default", "good").await?.is_some(),
            "the valid manifest applies"
        );
        let manifests = status["status"]["resourceStatus"]["manifests"]
            .as_array()
            .unwrap();
        let applied: Vec<Option<String>> = manifests
            .iter()
            .map(|m| manifest_condition(m, "Applied").0)
            .collect();
        assert_eq!(applied[0].as_deref(), Some("True"));
        for (i, m) in manifests.iter().enumerate().skip(1) {
            assert_eq!(applied[i].as_deref(), Some("False"), "manifest #{i}: {m}");
        }
        let message = |i: usize| manifest_condition(&manifests[i], "Applied").1;
        assert!(message(1).contains("name"), "no name: {}", message(1));
        assert!(
            message(2).contains("widgets.example.com"),
            "unknown group: {}",
            message(2)
        );
        // The spoke apiserver's own validation message, verbatim.
        assert!(
            message(3).contains("spec.replicas"),
            "rejected field: {}",
            message(3)
        );
        Ok(())
    }
}

on_both_carriers! {
    /// Frames that the protocol queues while handling another (the sync after a hello, the acks and
    /// statuses after a work) go out at once, not with the next heartbeat: with heartbeats an hour
    /// apart, a work created before the agent connects is still applied and reported.
    async fn delivery_does_not_wait_for_heartbeats() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let hub = Hub::start(
            dir.path(),
            &["--heartbeat-interval=1h", "--heartbeat-timeout=3h"],
        )
        .await?;
        let fleet = Fleet { hub, hub_env: None };
        let spoke = Spoke::start(dir.path(), &fleet.hub, "cluster1").await?;
        fleet.apply(&workspace_root().join(SEED_WORK))?;
        let _agent = spoke.start_agent(dir.path(), &fleet.hub, &[])?;
        spoke
            .wait_deployment_image("nginx-deployment", Some("nginx:1.14.2"))
            .await?;
        fleet.wait_applied("cluster1", "my-first-work").await?;
        Ok(())
    }
}

on_both_carriers! {
    /// A work close to one stored object's limit is stored inline, delivered and applied; one
    /// over it is stored in chunks by `flotilla apply` (sled backend) and applied the same; one
    /// over `--max-work-bytes` is refused with its size and the cap, and nothing is stored.
    async fn large_works_are_delivered_and_ones_over_the_cap_refused_with_their_size() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let fleet = Fleet::start(dir.path(), false).await?;
        let spoke = Spoke::start(dir.path(), &fleet.hub, "cluster1").await?;
        let _agent = spoke.start_agent(dir.path(), &fleet.hub, &[])?;
        // Two ConfigMaps of 450 KiB each (a ConfigMap itself may hold at most 1 MiB): 900 KiB of
        // manifests against the 1 MiB limit.
        let blob = "x".repeat(450 * 1024);
        let manifests = serde_json::json!([
            { "apiVersion": "v1", "kind": "ConfigMap", "metadata": { "namespace": "default", "name": "big-a" }, "data": { "blob": blob } },
            { "apiVersion": "v1", "kind": "ConfigMap", "metadata": { "namespace": "default", "name": "big-b" }, "data": { "blob": blob } },
        ]);
        let big = seed_work(dir.path(), "cluster1", |w| {
            w["metadata"]["name"] = "big".into();
            w["spec"]["workload"]["manifests"] = manifests.clone();
        })?;
        fleet.apply(&big)?;
        fleet.wait_applied("cluster1", "big").await?;
        for name in ["big-a", "big-b"] {
            let cm = spoke
                .config_map("default", name)
                .await?
                .expect("applied on the spoke");
            assert_eq!(cm.data.unwrap_or_default()["blob"].len(), 450 * 1024);
        }

        let too_big = seed_work(dir.path(), "cluster1", |w| {
            w["metadata"]["name"] = "too-big".into();
            let mut m = manifests.clone();
            m.as_array_mut().unwrap().push(serde_json::json!({
                "apiVersion": "v1", "kind": "ConfigMap", "metadata": { "namespace": "default", "name": "big-c" },
                "data": { "blob": blob },
            }));
            w["spec"]["workload"]["manifests"] = m;
        })?;
        let path = too_big.to_str().unwrap_or_default();
        let capped = fleet
            .hub
            .cli(&["apply", "-f", path, "--max-work-bytes", "1048576"])?;
        let err = String::from_utf8_lossy(&capped.stderr);
        assert!(
            !capped.status.success()
                && err.contains("ManifestWork cluster1/too-big: manifests take")
                && err.contains("more than the cap of 1048576 (--max-work-bytes)"),
            "the refusal names the work, its size and the cap: {err}"
        );
        assert!(
            fleet.work("cluster1", "too-big")?.is_none(),
            "nothing stored"
        );
        // Under the default cap the same work is stored in chunks and applied like any other.
        let stored = fleet.hub.cli(&["apply", "-f", path])?;
        anyhow::ensure!(
            stored.status.success(),
            "apply failed: {}",
            String::from_utf8_lossy(&stored.stderr)
        );
        let said = String::from_utf8_lossy(&stored.stdout).to_string()
            + &String::from_utf8_lossy(&stored.stderr);
        assert!(said.contains("chunk"), "apply says how the work was stored: {said}");
        fleet.wait_applied("cluster1", "too-big").await?;
        let cm = spoke
            .config_map("default", "big-c")
            .await?
            .expect("the chunked work's third ConfigMap applied on the spoke");
        assert_eq!(cm.data.unwrap_or_default()["blob"].len(), 450 * 1024);
        assert!(
            fleet.work("cluster1", "big")?.is_some(),
            "what was stored stays"
        );
        Ok(())
    }
}

on_both_carriers! {
    /// Crash safety: the agent is SIGKILLed at random points while it applies and caches, hundreds
    /// of times; after each kill its cache opens, and in the end the desired state in the cache is
    /// intact (the agent restores the spoke from it with the hub down) and the spoke converges.
    async fn agent_survives_sigkill_at_random_points() -> anyhow::Result<()> {
        use rand::Rng;
        const ITERATIONS: usize = 300;
        const TIME_BOUND: Duration = Duration::from_secs(120);
        const CONFIG_MAPS: usize = 20;

        let dir = tempfile::tempdir()?;
        let mut fleet = Fleet::start(dir.path(), false).await?;
        let spoke = Spoke::start(dir.path(), &fleet.hub, "cluster1").await?;
        let work_at = |version: usize| {
            seed_work(dir.path(), "cluster1", |w| {
                w["metadata"]["name"] = "torture".into();
                let mut manifests = vec![serde_json::json!({
                    "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": "torture" },
                })];
                for i in 0..CONFIG_MAPS {
                    manifests.push(serde_json::json!({
                        "apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": { "namespace": "torture", "name": format!("cm-{i}") },
                        "data": { "version": version.to_string() },
                    }));
                }
                w["spec"]["workload"]["manifests"] = Value::Array(manifests);
            })
        };
        let (seed, mut rng) = flotilla_e2e::torture_rng();
        let resync = ["--resync-interval=1s"];

        let started = tokio::time::Instant::now();
        let mut version = 0;
        let mut iterations = 0;
        while iterations < ITERATIONS && started.elapsed() < TIME_BOUND {
            if iterations % 25 == 0 {
                version = iterations;
                fleet.apply(&work_at(version)?)?;
            }
            let mut agent = spoke.start_agent(dir.path(), &fleet.hub, &resync)?;
            // The kill point: anywhere from process start through connect, receive, cache, apply.
            let kill_after = Duration::from_millis(rng.random_range(0..400));
            tokio::time::sleep(kill_after).await;
            agent.signal_and_wait(Signal::SIGKILL);
            let log = agent.log();
            for bad in [
                "Error:",
                "panicked",
                "unreadable",
                "cannot open the agent cache",
            ] {
                assert!(
                    !log.contains(bad),
                    "iteration {iterations} (seed {seed}, killed after {kill_after:?}): {log}"
                );
            }
            iterations += 1;
        }
        eprintln!("{iterations} kills in {:?}", started.elapsed());
        assert!(
            iterations >= 100,
            "only {iterations} iterations in {TIME_BOUND:?}"
        );

        // Converge with the hub, so the final desired state is acked (durable in the cache).
        let mut agent = spoke.start_agent(dir.path(), &fleet.hub, &resync)?;
        fleet.wait_applied("cluster1", "torture").await?;
        agent.signal_and_wait(Signal::SIGKILL);

        // The desired state in the cache is intact: with the hub down, a fresh agent restores
        // everything deleted on the spoke, at the last version.
        fleet.hub.proc.signal_and_wait(Signal::SIGTERM);
        let client = spoke.env.client().await?;
        let cms: kube::Api<k8s_openapi::api::core::v1::ConfigMap> =
            kube::Api::namespaced(client, "torture");
        for i in 0..CONFIG_MAPS {
            cms.delete(&format!("cm-{i}"), &Default::default()).await?;
        }
        let _agent = spoke.start_agent(dir.path(), &fleet.hub, &resync)?;
        let want = version.to_string();
        wait_for(
            "every ConfigMap restored from the cache",
            Duration::from_secs(60),
            || async {
                for i in 0..CONFIG_MAPS {
                    let Some(cm) = spoke.config_map("torture", &format!("cm-{i}")).await? else {
                        return Ok(None);
                    };
                    if cm.data.unwrap_or_default().get("version") != Some(&want) {
                        return Ok(None);
                    }
                }
                Ok(Some(()))
            },
        )
        .await?;
        fleet.hub.restart(dir.path(), &[]).await?;
        fleet.wait_applied("cluster1", "torture").await?;
        Ok(())
    }
}

/// A value of `status.resourceStatus.manifests[name].statusFeedback`, as the hub stores it.
fn hub_feedback(work: &Value, manifest: &str, value: &str) -> Option<Value> {
    work["status"]["resourceStatus"]["manifests"]
        .as_array()?
        .iter()
        .find(|m| m["resourceMeta"]["name"] == manifest)?["statusFeedback"]["values"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == value)
        .map(|v| v["fieldValue"].clone())
}

on_both_carriers! {
    /// Feedback, condition rules and ttlSecondsAfterFinished through the whole fabric, with the
    /// work applied by kubectl to the kube backend: a controller's status on the spoke reaches the
    /// hub's ManifestWork, a finished Job completes the work, and the hub deletes it after its TTL.
    async fn feedback_conditions_and_ttl_reach_the_hub() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let fleet = Fleet::start(dir.path(), true).await?;
        let spoke = Spoke::start(dir.path(), &fleet.hub, "cluster1").await?;
        let _agent = spoke.start_agent(dir.path(), &fleet.hub, &["--feedback-interval=300ms"])?;
        let work = seed_work(dir.path(), "cluster1", |w| {
            w["metadata"]["name"] = "observed".into();
            let deployment = w["spec"]["workload"]["manifests"][1].clone();
            w["spec"]["workload"]["manifests"] = serde_json::json!([deployment, {
                "apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": "migrate", "namespace": "default"},
                "spec": {"template": {"spec": {"restartPolicy": "Never",
                    "containers": [{"name": "m", "image": "busybox"}]}}},
            }]);
            w["spec"]["deleteOption"] =
                serde_json::json!({"propagationPolicy": "Foreground", "ttlSecondsAfterFinished": 2});
            w["spec"]["manifestConfigs"] = serde_json::json!([
                {"resourceIdentifier": {"group": "apps", "resource": "deployments", "namespace": "default", "name": "nginx-deployment"},
                 "feedbackRules": [
                    {"type": "WellKnownStatus"},
                    {"type": "JSONPaths", "jsonPaths": [{"name": "available", "path": ".status.conditions[?(@.type==\"Available\")].status"}]}],
                 "conditionRules": [{"type": "CEL", "condition": "AllReplicasReady",
                    "celExpressions": ["object.status.readyReplicas == object.spec.replicas"]}]},
                {"resourceIdentifier": {"group": "batch", "resource": "jobs", "namespace": "default", "name": "migrate"},
                 "conditionRules": [{"type": "WellKnownConditions", "condition": "Complete"}]},
            ]);
        })?;
        fleet.apply(&work)?;
        fleet.wait_applied("cluster1", "observed").await?;

        // The kube-controller-manager would write this; there is none, so the test does.
        let client = spoke.env.client().await?;
        let deployments: kube::Api<k8s_openapi::api::apps::v1::Deployment> =
            kube::Api::namespaced(client.clone(), "default");
        deployments
            .patch_status(
                "nginx-deployment",
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(serde_json::json!({"status": {
                    "replicas": 3, "readyReplicas": 3, "availableReplicas": 3,
                    "conditions": [{"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable",
                        "lastUpdateTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})),
            )
            .await?;
        let seen = wait_for(
            "the Deployment's feedback on the hub",
            Duration::from_secs(60),
            || async {
                let w = fleet.work("cluster1", "observed")?;
                Ok(w.filter(|w| {
                    hub_feedback(w, "nginx-deployment", "ReadyReplicas").is_some()
                        && condition_status(w, "AllReplicasReady").as_deref() == Some("True")
                }))
            },
        )
        .await?;
        assert_eq!(
            hub_feedback(&seen, "nginx-deployment", "ReadyReplicas"),
            Some(serde_json::json!({"type": "Integer", "integer": 3}))
        );
        assert_eq!(
            hub_feedback(&seen, "nginx-deployment", "available"),
            Some(serde_json::json!({"type": "String", "string": "True"}))
        );
        assert_eq!(
            condition_status(&seen, "Complete").as_deref(),
            Some("False")
        );

        // The Job finishes: the work turns Complete, and two seconds later the hub deletes it,
        // and with it (Foreground) what it applied.
        let jobs: kube::Api<k8s_openapi::api::batch::v1::Job> =
            kube::Api::namespaced(client, "default");
        jobs.patch_status(
            "migrate",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"status": {
                "startTime": "2026-01-01T00:00:00Z", "completionTime": "2026-01-01T00:01:00Z", "succeeded": 1,
                "conditions": [
                    {"type": "SuccessCriteriaMet", "status": "True", "lastProbeTime": "2026-01-01T00:01:00Z", "lastTransitionTime": "2026-01-01T00:01:00Z"},
                    {"type": "Complete", "status": "True", "lastProbeTime": "2026-01-01T00:01:00Z", "lastTransitionTime": "2026-01-01T00:01:00Z"}]}})),
        )
        .await?;
        wait_for(
            "the work deleted by its ttlSecondsAfterFinished",
            Duration::from_secs(60),
            || async { Ok(fleet.work("cluster1", "observed")?.is_none().then_some(())) },
        )
        .await?;
        let hub_log = std::fs::read_to_string(dir.path().join("hub-1.log"))?;
        assert!(
            hub_log.contains("Complete for longer than its ttlSecondsAfterFinished"),
            "the hub says why it deleted the work"
        );
        spoke
            .wait_deployment_image("nginx-deployment", None)
            .await?;
        Ok(())
    }
}
