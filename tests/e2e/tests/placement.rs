//! Placement end to end, with OCM's own user scenarios (seed 003): the real hub, agents on
//! real spoke apiservers, the real CLI and kubectl. Each test reads as the scenario it is.

use std::path::Path;
use std::time::Duration;

use flotilla_e2e::on_both_carriers;
use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{Fleet, Proc, condition_status, decision_clusters, wait_for};
use flotilla_testenv::workspace_root;
use nix::sys::signal::Signal;
use serde_json::{Value, json};

fn fixture(name: &str) -> std::path::PathBuf {
    workspace_root().join("proto/tests/fixtures").join(name)
}

fn fixture_value(name: &str) -> anyhow::Result<Value> {
    Ok(yaml_serde::from_str(&std::fs::read_to_string(fixture(
        name,
    ))?)?)
}

/// The manifests of seed 003's `work.yaml`: the ServiceAccount and Deployment of
/// `my-first-work`, as a file of two YAML documents.
fn work_yaml(dir: &Path) -> anyhow::Result<std::path::PathBuf> {
    let work = fixture_value("manifestwork_my_first_work.yaml")?;
    let docs: Vec<String> = work["spec"]["workload"]["manifests"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(yaml_serde::to_string)
        .collect::<Result<_, _>>()?;
    let path = dir.join("work.yaml");
    std::fs::write(&path, docs.join("---\n"))?;
    Ok(path)
}

/// Spokes with their agents running against `fleet`.
async fn spokes(
    dir: &Path,
    fleet: &Fleet,
    names: &[&str],
) -> anyhow::Result<(Vec<Spoke>, Vec<Proc>)> {
    let mut spokes = Vec::new();
    for name in names {
        spokes.push(Spoke::start(dir, &fleet.hub, name).await?);
    }
    let agents = spokes
        .iter()
        .map(|s| s.start_agent(dir, &fleet.hub, &[]))
        .collect::<anyhow::Result<Vec<_>>>()?;
    for name in names {
        wait_for(
            &format!("{name} Available"),
            Duration::from_secs(60),
            || async {
                let available = fleet
                    .hub
                    .cluster_condition(name, "ManagedClusterConditionAvailable")?;
                Ok((available.as_deref() == Some("True")).then_some(()))
            },
        )
        .await?;
    }
    Ok((spokes, agents))
}

/// The ManagedCluster as the hub stores it.
fn managed_cluster(fleet: &Fleet, name: &str) -> anyhow::Result<Value> {
    fleet
        .hub
        .clusters()?
        .into_iter()
        .find(|c| c["metadata"]["name"] == name)
        .ok_or_else(|| anyhow::anyhow!("no ManagedCluster {name}"))
}

fn claim(mc: &Value, name: &str) -> Option<String> {
    mc["status"]["clusterClaims"]
        .as_array()?
        .iter()
        .find(|c| c["name"] == name)?["value"]
        .as_str()
        .map(str::to_string)
}

on_both_carriers! {
    /// Seed 003 scenario 2, verbatim: bind the default set, a placement of 2 clusters, `work
    /// create --placement`, then the placement patched to 1 with kubectl; the work follows the
    /// decision, off cluster2's namespace and off its spoke.
    async fn scenario_2_the_work_follows_the_placement_from_two_clusters_to_one() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let fleet = Fleet::start(dir.path(), true).await?;
        let (spokes, _agents) = spokes(dir.path(), &fleet, &["cluster1", "cluster2"]).await?;

        // `clusteradm get clustersets`: the hub made the default set, with both clusters in it.
        wait_for(
            "the default set holds both clusters",
            Duration::from_secs(30),
            || async {
                let sets: Vec<Value> = serde_json::from_slice(
                    &fleet
                        .hub_env
                        .as_ref()
                        .unwrap()
                        .kubectl()
                        .args(["get", "managedclustersets", "-o", "json"])
                        .output()?
                        .stdout,
                )
                .map(|l: Value| l["items"].as_array().cloned().unwrap_or_default())?;
                let default = sets.iter().find(|s| s["metadata"]["name"] == "default");
                Ok(default
                    .and_then(|s| s["status"]["conditions"].as_array().cloned())
                    .filter(|cs| {
                        cs.iter().any(|c| {
                            c["type"] == "ClusterSetEmpty"
                                && c["status"] == "False"
                                && c["message"] == "2 ManagedClusters selected"
                        })
                    })
                    .map(|_| ()))
            },
        )
        .await?;
        fleet.apply(&fixture("managedclustersetbinding_default.yaml"))?;
        fleet.apply(&fixture("placement_placement1.yaml"))?;
        fleet
            .wait_decided("default", "placement1", &["cluster1", "cluster2"])
            .await?;

        let created = fleet.cli(&[
            "work",
            "create",
            "my-first-work",
            "-f",
            work_yaml(dir.path())?.to_str().unwrap(),
            "--placement",
            "default/placement1",
        ])?;
        assert!(
            created.contains("manifestworkreplicaset default/my-first-work created"),
            "{created}"
        );
        for spoke in &spokes {
            fleet.wait_applied(&spoke.name, "my-first-work").await?;
            spoke
                .wait_deployment_image("nginx-deployment", Some("nginx:1.14.2"))
                .await?;
        }
        assert_eq!(
            fleet.clusters_with_work("my-first-work")?,
            ["cluster1", "cluster2"]
        );

        // The seed's patch, verbatim.
        let env = fleet.hub_env.as_ref().unwrap();
        let out = env
            .kubectl()
            .args([
                "patch",
                "placement",
                "placement1",
                "-n",
                "default",
                "--patch",
                r#"{"spec": {"clusterSets": ["default"],"numberOfClusters": 1}}"#,
                "--type=merge",
            ])
            .output()?;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        fleet
            .wait_decided("default", "placement1", &["cluster1"])
            .await?;
        wait_for(
            "my-first-work only in cluster1",
            Duration::from_secs(60),
            || async { Ok((fleet.clusters_with_work("my-first-work")? == ["cluster1"]).then_some(())) },
        )
        .await?;
        spokes[1]
            .wait_deployment_image("nginx-deployment", None)
            .await?;
        assert!(
            spokes[0]
                .deployment("default", "nginx-deployment")
                .await?
                .is_some()
        );

        // What an operator sees.
        let table = fleet.cli(&["get", "placements"])?;
        let row = table
            .lines()
            .find(|l| l.contains("placement1"))
            .unwrap_or_default()
            .to_string();
        assert!(
            row.contains("True") && row.contains("AllDecisionsScheduled") && row.contains("cluster1"),
            "{table}"
        );
        let table = fleet.cli(&["get", "manifestworkreplicasets"])?;
        let row = table
            .lines()
            .find(|l| l.contains("my-first-work"))
            .unwrap_or_default()
            .to_string();
        assert!(
            row.contains("placement1") && row.contains("Complete"),
            "{table}"
        );

        // Deleting the replica set takes its works, and their resources, with it.
        let out = fleet.cli(&[
            "work",
            "delete",
            "my-first-work",
            "--placement",
            "default/placement1",
        ])?;
        assert!(out.contains("deleted"), "{out}");
        spokes[0]
            .wait_deployment_image("nginx-deployment", None)
            .await?;
        wait_for(
            "the replica set and its works gone",
            Duration::from_secs(60),
            || async {
                let gone = fleet.clusters_with_work("my-first-work")?.is_empty()
                    && fleet.list(&["manifestworkreplicasets"])?.is_empty();
                Ok(gone.then_some(()))
            },
        )
        .await?;
        Ok(())
    }
}

on_both_carriers! {
    /// Seed 003 scenario 4: a hub label and a ClusterClaim on the spoke both select; the claim is
    /// projected into the ManagedCluster as soon as it is applied and again when it changes, next
    /// to the agent's built-in claims (version, node count) and the spoke's node resources.
    async fn scenario_4_labels_and_cluster_claims_select_clusters() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let fleet = Fleet::start(dir.path(), false).await?;
        let claim_crd = dir.path().join("claim-crd");
        std::fs::create_dir_all(&claim_crd)?;
        std::fs::copy(
            workspace_root().join("deploy/crds/cluster.open-cluster-management.io_clusterclaims.yaml"),
            claim_crd.join("clusterclaims.yaml"),
        )?;
        let (spokes, _agents) = {
            let mut started = Vec::new();
            for name in ["cluster1", "cluster2"] {
                let spoke = Spoke::start(dir.path(), &fleet.hub, name).await?;
                spoke.env.install_crds(&claim_crd).await?;
                started.push(spoke);
            }
            let agents = started
                .iter()
                .map(|s| s.start_agent(dir.path(), &fleet.hub, &[]))
                .collect::<anyhow::Result<Vec<_>>>()?;
            (started, agents)
        };

        // Built-in claims, and a node appearing on the spoke: counted and summed.
        let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"},
            "status": {"capacity": {"cpu": "4", "memory": "16Gi"}, "allocatable": {"cpu": "3500m", "memory": "15Gi"}}});
        let node_file = dir.path().join("node.json");
        std::fs::write(&node_file, serde_json::to_vec(&node)?)?;
        let out = spokes[0]
            .env
            .kubectl()
            .arg("create")
            .arg("-f")
            .arg(&node_file)
            .output()?;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mc = wait_for(
            "cluster1's built-in claims and resources",
            Duration::from_secs(60),
            || async {
                let mc = managed_cluster(&fleet, "cluster1")?;
                let ready = claim(&mc, "nodecount.flotilla.dev").as_deref() == Some("1")
                    && mc["status"]["allocatable"]["cpu"] == "3500m";
                Ok(ready.then_some(mc))
            },
        )
        .await?;
        assert!(
            claim(&mc, "kubeversion.open-cluster-management.io").is_some_and(|v| v.starts_with('v'))
        );
        assert_eq!(
            claim(&mc, "platform.open-cluster-management.io").as_deref(),
            Some("Other")
        );
        assert!(claim(&mc, "id.k8s.io").is_some_and(|v| !v.is_empty()));
        assert_eq!(mc["status"]["capacity"]["memory"], "16Gi");

        // The seed's ClusterClaim, verbatim, on cluster1: "instantly reflected".
        let out = spokes[0]
            .env
            .kubectl()
            .arg("apply")
            .arg("-f")
            .arg(fixture("clusterclaim_id.yaml"))
            .output()?;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        wait_for(
            "the claim on cluster1's ManagedCluster",
            Duration::from_secs(30),
            || async {
                let mc = managed_cluster(&fleet, "cluster1")?;
                Ok((claim(&mc, "id.open-cluster-management.io").as_deref()
                    == Some("95f91f25-d7a2-4fc3-9237-2ef633d8451c"))
                .then_some(()))
            },
        )
        .await?;

        // Placements: one by claim, one by hub label.
        fleet.apply(&fixture("managedclustersetbinding_default.yaml"))?;
        let by_claim = json!({"apiVersion": "cluster.open-cluster-management.io/v1beta1", "kind": "Placement",
            "metadata": {"name": "by-claim", "namespace": "default"},
            "spec": {"predicates": [{"requiredClusterSelector": {"claimSelector": {"matchExpressions": [
                {"key": "id.open-cluster-management.io", "operator": "In", "values": ["95f91f25-d7a2-4fc3-9237-2ef633d8451c"]}]}}}]}});
        let by_label = json!({"apiVersion": "cluster.open-cluster-management.io/v1beta1", "kind": "Placement",
            "metadata": {"name": "by-label", "namespace": "default"},
            "spec": {"predicates": [{"requiredClusterSelector": {"labelSelector": {"matchLabels": {"environment": "dev"}}}}]}});
        fleet.apply_value(dir.path(), &by_claim)?;
        fleet.apply_value(dir.path(), &by_label)?;
        fleet
            .wait_decided("default", "by-claim", &["cluster1"])
            .await?;
        fleet.wait_decided("default", "by-label", &[]).await?;

        fleet.cli(&["cluster", "label", "cluster2", "environment=dev"])?;
        fleet
            .wait_decided("default", "by-label", &["cluster2"])
            .await?;
        let err = fleet
            .cli(&["cluster", "label", "cluster2", "environment=prod"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("pass --overwrite"), "{err}");
        fleet.cli(&["cluster", "label", "cluster1", "environment=dev"])?;
        fleet.cli(&["cluster", "label", "cluster2", "environment-"])?;
        fleet
            .wait_decided("default", "by-label", &["cluster1"])
            .await?;

        // The claim changes on the spoke: refreshed, and the placement follows.
        let out = spokes[0]
            .env
            .kubectl()
            .args([
                "patch",
                "clusterclaim",
                "id.open-cluster-management.io",
                "--type=merge",
                "-p",
                r#"{"spec":{"value":"replaced"}}"#,
            ])
            .output()?;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        fleet.wait_decided("default", "by-claim", &[]).await?;
        assert_eq!(
            claim(
                &managed_cluster(&fleet, "cluster1")?,
                "id.open-cluster-management.io"
            )
            .as_deref(),
            Some("replaced")
        );
        Ok(())
    }
}

on_both_carriers! {
    /// Seed 003 scenario 3: an AddOnPlacementScore picks the cluster with the highest
    /// `cpuAvailable`; once that score has expired it is ignored and the other cluster wins.
    async fn scenario_3_addon_placement_scores_pick_the_highest_and_ignore_expired_ones() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let fleet = Fleet::start(dir.path(), true).await?;
        let (_spokes, _agents) = spokes(dir.path(), &fleet, &["cluster1", "cluster2"]).await?;
        let env = fleet.hub_env.as_ref().unwrap();
        // The addon's score in each cluster's namespace: the seed's object, with cluster2 given
        // more CPU available.
        let set_score = |cluster: &str, cpu: i64, valid_until: Option<&str>| -> anyhow::Result<()> {
            let mut score = fixture_value("addonplacementscore_resource_usage_score.yaml")?;
            score["metadata"] = json!({"name": "resource-usage-score", "namespace": cluster});
            score["status"]["scores"][0]["value"] = cpu.into();
            if let Some(v) = valid_until {
                score["status"]["validUntil"] = v.into();
            }
            let file = dir.path().join(format!("score-{cluster}.json"));
            std::fs::write(&file, serde_json::to_vec(&score)?)?;
            let out = env.kubectl().arg("apply").arg("-f").arg(&file).output()?;
            anyhow::ensure!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let status = json!({"status": score["status"]}).to_string();
            let out = env
                .kubectl()
                .args([
                    "patch",
                    "addonplacementscore",
                    "resource-usage-score",
                    "-n",
                    cluster,
                    "--subresource=status",
                    "--type=merge",
                    "-p",
                    &status,
                ])
                .output()?;
            anyhow::ensure!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            Ok(())
        };
        set_score("cluster1", 12, None)?;
        set_score("cluster2", 66, None)?;
        fleet.apply(&fixture("managedclustersetbinding_default.yaml"))?;
        fleet.apply(&fixture("placement_placement1_addon_score.yaml"))?;
        fleet
            .wait_decided("default", "placement1", &["cluster2"])
            .await?;

        // cluster2's score expired an hour ago: ignored, cluster1's 12 now wins.
        set_score("cluster2", 66, Some("2020-01-01T00:00:00Z"))?;
        fleet
            .wait_decided("default", "placement1", &["cluster1"])
            .await?;
        Ok(())
    }
}

on_both_carriers! {
    /// Seed 003 scenario 7: cluster1's agent stops (SIGSTOP, like `docker pause`); the hub marks it
    /// Unknown and taints it unreachable; the placement tolerates that for its tolerationSeconds
    /// (shortened to 5 s here), then moves the work to cluster2; cluster1's copy stays, marked
    /// for deletion, until its agent is back and has removed it. After cluster1 is back, a manual
    /// `maintenance` taint on cluster2 repels the placement back to cluster1.
    async fn scenario_7_an_unreachable_cluster_loses_its_work_after_the_toleration() -> anyhow::Result<()> {
        const TOLERATION_SECONDS: i64 = 5;
        let dir = tempfile::tempdir()?;
        let fleet = Fleet::start(dir.path(), false).await?;
        let (spokes, mut agents) = spokes(dir.path(), &fleet, &["cluster1", "cluster2"]).await?;
        fleet.apply(&fixture("managedclustersetbinding_default.yaml"))?;
        let mut placement = fixture_value("placement_guestbook_toleration.yaml")?;
        placement["metadata"]["namespace"] = "default".into();
        placement["spec"]["tolerations"][0]["tolerationSeconds"] = TOLERATION_SECONDS.into();
        fleet.apply_value(dir.path(), &placement)?;
        fleet
            .wait_decided("default", "guestbook-app-placement", &["cluster1"])
            .await?;
        fleet.cli(&[
            "work",
            "create",
            "guestbook",
            "-f",
            work_yaml(dir.path())?.to_str().unwrap(),
            "--placement",
            "default/guestbook-app-placement",
        ])?;
        fleet.wait_applied("cluster1", "guestbook").await?;

        // Pause cluster1's agent: Unknown, then the unreachable taint.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(agents[0].pid() as i32),
            Signal::SIGSTOP,
        )?;
        let tainted_at = wait_for(
            "cluster1 Unknown with the unreachable taint",
            Duration::from_secs(60),
            || async {
                let mc = managed_cluster(&fleet, "cluster1")?;
                let unknown = condition_status(&mc, "ManagedClusterConditionAvailable").as_deref()
                    == Some("Unknown");
                let added = mc["spec"]["taints"].as_array().and_then(|ts| {
                    ts.iter()
                        .find(|t| {
                            t["key"] == "cluster.open-cluster-management.io/unreachable"
                                && t["effect"] == "NoSelect"
                        })
                        .and_then(|t| t["timeAdded"].as_str().map(str::to_string))
                });
                Ok(added.filter(|_| unknown))
            },
        )
        .await?;
        let tainted_at: jiff::Timestamp = tainted_at.parse()?;
        // Tolerated for now: the decision stays, checked well inside the toleration.
        if jiff::Timestamp::now() < tainted_at + jiff::SignedDuration::from_secs(TOLERATION_SECONDS - 2)
        {
            assert_eq!(
                fleet.decided("default", "guestbook-app-placement")?,
                ["cluster1"]
            );
        }
        // Past it: the work moves to cluster2.
        fleet
            .wait_decided("default", "guestbook-app-placement", &["cluster2"])
            .await?;
        assert!(
            jiff::Timestamp::now() >= tainted_at + jiff::SignedDuration::from_secs(TOLERATION_SECONDS),
            "the placement moved before its toleration ran out"
        );
        fleet.wait_applied("cluster2", "guestbook").await?;
        spokes[1]
            .wait_deployment_image("nginx-deployment", Some("nginx:1.14.2"))
            .await?;
        // cluster1's work is deleted, but its agent is away: the work stays, marked, until the
        // agent is back and has removed what it applied (its cleanup finalizer).
        wait_for(
            "the work in cluster1's namespace marked for deletion",
            Duration::from_secs(30),
            || async {
                Ok(fleet
                    .work("cluster1", "guestbook")?
                    .filter(|w| w["metadata"]["deletionTimestamp"].is_string()))
            },
        )
        .await?;
        assert!(
            spokes[0]
                .deployment("default", "nginx-deployment")
                .await?
                .is_some(),
            "nobody removed cluster1's Deployment yet"
        );

        // cluster1 comes back: its agent cleans up and the work goes; then cluster2 goes into
        // maintenance by hand.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(agents[0].pid() as i32),
            Signal::SIGCONT,
        )?;
        wait_for(
            "the work gone from cluster1's namespace",
            Duration::from_secs(60),
            || async { Ok(fleet.work("cluster1", "guestbook")?.is_none().then_some(())) },
        )
        .await?;
        assert!(
            spokes[0]
                .deployment("default", "nginx-deployment")
                .await?
                .is_none(),
            "released only once the Deployment is gone from cluster1"
        );
        wait_for(
            "cluster1 Available without the taint",
            Duration::from_secs(60),
            || async {
                let mc = managed_cluster(&fleet, "cluster1")?;
                let ok = condition_status(&mc, "ManagedClusterConditionAvailable").as_deref()
                    == Some("True")
                    && mc["spec"]["taints"].as_array().is_none_or(Vec::is_empty);
                Ok(ok.then_some(()))
            },
        )
        .await?;
        let out = fleet.cli(&["cluster", "taint", "cluster2", "maintenance:NoSelect"])?;
        assert!(out.contains("cluster cluster2 tainted"), "{out}");
        fleet
            .wait_decided("default", "guestbook-app-placement", &["cluster1"])
            .await?;
        fleet.wait_applied("cluster1", "guestbook").await?;
        spokes[0]
            .wait_deployment_image("nginx-deployment", Some("nginx:1.14.2"))
            .await?;
        agents[0].signal_and_wait(Signal::SIGKILL);
        Ok(())
    }
}

/// Argo CD's clusterDecisionResource generator, as seed 003 scenario 5 configures it
/// (`apiVersion: cluster.open-cluster-management.io/v1beta1`, `kind: placementdecisions`,
/// `statusListKey: decisions`, `matchKey: clusterName`), reading from the kube backend what
/// it reads: every PlacementDecision labelled with the placement, each cluster's name under
/// `status.decisions[].clusterName`, over however many objects the decisions take.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn argo_cd_cluster_decision_resource_generator_reads_every_decision() -> anyhow::Result<()> {
    use kube::api::{Api, ApiResource, DynamicObject, ListParams};
    const CLUSTERS: usize = 150;
    let dir = tempfile::tempdir()?;
    let fleet = Fleet::start(dir.path(), true).await?;
    let env = fleet.hub_env.as_ref().unwrap();
    let mut docs = String::new();
    for i in 0..CLUSTERS {
        docs.push_str(&format!(
            "---\napiVersion: cluster.open-cluster-management.io/v1\nkind: ManagedCluster\nmetadata:\n  name: store-{i:03}\nspec:\n  hubAcceptsClient: true\n"
        ));
    }
    let file = dir.path().join("clusters.yaml");
    std::fs::write(&file, docs)?;
    for args in [
        vec!["create", "namespace", "argocd"],
        vec!["apply", "-f", file.to_str().unwrap()],
    ] {
        let out = env.kubectl().args(&args).output()?;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // `clusteradm clusterset bind global --namespace argocd`, then the seed's placement
    // without its limit of 10, so the decisions need two objects.
    fleet.apply_value(
        dir.path(),
        &json!({"apiVersion": "cluster.open-cluster-management.io/v1beta2",
        "kind": "ManagedClusterSetBinding", "metadata": {"name": "global", "namespace": "argocd"},
        "spec": {"clusterSet": "global"}}),
    )?;
    let mut placement = fixture_value("placement_guestbook_app.yaml")?;
    placement["spec"] = json!({});
    fleet.apply_value(dir.path(), &placement)?;

    // The generator's request: list by label selector in the placement's namespace.
    let resource = ApiResource {
        group: "cluster.open-cluster-management.io".into(),
        version: "v1beta1".into(),
        api_version: "cluster.open-cluster-management.io/v1beta1".into(),
        kind: "PlacementDecision".into(),
        plural: "placementdecisions".into(),
    };
    let api: Api<DynamicObject> = Api::namespaced_with(env.client().await?, "argocd", &resource);
    let params = ListParams::default()
        .labels("cluster.open-cluster-management.io/placement=guestbook-app-placement");
    let (objects, clusters) = wait_for(
        "every cluster in the generator's view",
        Duration::from_secs(60),
        || async {
            let list = api.list(&params).await?;
            let clusters = decision_clusters(list.items.iter().map(|o| &o.data));
            Ok((clusters.len() == CLUSTERS).then_some((list.items, clusters)))
        },
    )
    .await?;
    let expected: Vec<String> = (0..CLUSTERS).map(|i| format!("store-{i:03}")).collect();
    assert_eq!(clusters, expected);
    let mut names: Vec<&str> = objects
        .iter()
        .filter_map(|o| o.metadata.name.as_deref())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "guestbook-app-placement-decision-1",
            "guestbook-app-placement-decision-2"
        ]
    );
    for o in &objects {
        let labels = o.metadata.labels.clone().unwrap_or_default();
        assert_eq!(
            labels["cluster.open-cluster-management.io/decision-group-index"],
            "0"
        );
        assert!(o.data["status"]["decisions"].as_array().unwrap().len() <= 100);
        let owner = &o.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str()),
            ("Placement", "guestbook-app-placement")
        );
    }
    Ok(())
}
