//! The seeds' works on a spoke that runs them: kube-controller-manager, kube-scheduler and kwok's
//! nodes behind the spoke's apiserver, so the status the agent feeds back to the hub is what
//! Kubernetes' own controllers wrote, never a test's patch.

use std::time::Duration;

use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{Fleet, condition_status, on_both_carriers, wait_for};
use flotilla_testenv::workspace_root;
use serde_json::{Value, json};

/// Long enough for a loaded 2-core machine to schedule and run a few pods; each wait ends as soon
/// as its condition holds.
const WORKLOAD_TIMEOUT: Duration = Duration::from_secs(120);

/// Seed 003's scenario 1, OCM's first ManifestWork: a ServiceAccount and a 3-replica nginx
/// Deployment whose pods run as it.
const MY_FIRST_WORK: &str = "proto/tests/fixtures/manifestwork_my_first_work.yaml";

/// The seed's work in `cluster`'s namespace, with `manifest_configs` added.
fn my_first_work(cluster: &str, manifest_configs: Value) -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(workspace_root().join(MY_FIRST_WORK))?;
    let mut work: Value = yaml_serde::from_str(&text)?;
    work["metadata"]["namespace"] = cluster.into();
    work["spec"]["manifestConfigs"] = manifest_configs;
    Ok(work)
}

/// Seed 000's step 6, "Deploy a Workload via ManifestWork", as the seed writes it, in
/// `cluster`'s namespace, with `manifest_configs` added.
fn deploy_nginx(cluster: &str, manifest_configs: Value) -> Value {
    json!({
        "apiVersion": "work.open-cluster-management.io/v1",
        "kind": "ManifestWork",
        "metadata": {"name": "deploy-nginx", "namespace": cluster},
        "spec": {
            "workload": {"manifests": [{
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": "nginx-fleet", "namespace": "default"},
                "spec": {
                    "replicas": 2,
                    "selector": {"matchLabels": {"app": "nginx"}},
                    "template": {
                        "metadata": {"labels": {"app": "nginx"}},
                        "spec": {"containers": [{"name": "nginx", "image": "nginx:1.25"}]},
                    },
                },
            }]},
            "manifestConfigs": manifest_configs,
        },
    })
}

/// The feedback and condition rules an operator would put on a Deployment `name`: OCM's
/// well-known status fields, the Available condition by JSONPath, and a CEL rule.
fn deployment_configs(name: &str) -> Value {
    json!([{
        "resourceIdentifier": {"group": "apps", "resource": "deployments", "namespace": "default", "name": name},
        "feedbackRules": [
            {"type": "WellKnownStatus"},
            {"type": "JSONPaths", "jsonPaths": [
                {"name": "available", "path": ".status.conditions[?(@.type==\"Available\")].status"}]}],
        "conditionRules": [{"type": "CEL", "condition": "AllReplicasReady",
            "celExpressions": ["object.status.readyReplicas == object.spec.replicas"]}],
    }])
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

fn integer(n: i64) -> Option<Value> {
    Some(json!({"type": "Integer", "integer": n}))
}

/// Waits until the hub's copy of `cluster`/`work` shows Deployment `deployment` with `replicas`
/// ready and available replicas fed back, Available "True", and AllReplicasReady True.
async fn wait_real_feedback(
    fleet: &Fleet,
    spoke: &Spoke,
    work: &str,
    deployment: &str,
    replicas: i64,
) -> anyhow::Result<Value> {
    wait_for(
        &format!("{work}: {deployment}'s real status fed back to the hub"),
        WORKLOAD_TIMEOUT,
        || async {
            let Some(w) = fleet.work(&spoke.name, work)? else {
                return Ok(None);
            };
            let done = hub_feedback(&w, deployment, "ReadyReplicas") == integer(replicas)
                && hub_feedback(&w, deployment, "AvailableReplicas") == integer(replicas)
                && condition_status(&w, "AllReplicasReady").as_deref() == Some("True");
            Ok(done.then_some(w))
        },
    )
    .await
    .map_err(|e| e.context(spoke.env.log_tails()))
}

on_both_carriers! {
    /// Seed 003's first work and seed 000's nginx work, applied with kubectl to the hub: their
    /// Deployments become Available on the spoke by the real controllers, and the hub sees the
    /// replicas they count and the conditions the rules derive from that status.
    async fn seed_deployments_become_available_and_feed_back_real_status() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let fleet = Fleet::start(dir.path(), true).await?;
        let spoke = Spoke::start_full(dir.path(), &fleet.hub, "cluster1").await?;
        let _agent = spoke.start_agent(dir.path(), &fleet.hub, &["--feedback-interval=300ms"])?;

        let first = my_first_work("cluster1", deployment_configs("nginx-deployment"))?;
        fleet.apply_value(dir.path(), &first)?;
        fleet.apply_value(dir.path(), &deploy_nginx("cluster1", deployment_configs("nginx-fleet")))?;
        fleet.wait_applied("cluster1", "my-first-work").await?;
        fleet.wait_applied("cluster1", "deploy-nginx").await?;

        let seen = wait_real_feedback(&fleet, &spoke, "my-first-work", "nginx-deployment", 3).await?;
        assert_eq!(
            hub_feedback(&seen, "nginx-deployment", "available"),
            Some(json!({"type": "String", "string": "True"}))
        );
        assert_eq!(hub_feedback(&seen, "nginx-deployment", "Replicas"), integer(3));
        let seen = wait_real_feedback(&fleet, &spoke, "deploy-nginx", "nginx-fleet", 2).await?;
        assert_eq!(
            hub_feedback(&seen, "nginx-fleet", "available"),
            Some(json!({"type": "String", "string": "True"}))
        );

        // The spoke's own view agrees: the controllers made ReplicaSets and pods, the pods run
        // on kwok's nodes as the work's ServiceAccount.
        let deployment = spoke
            .deployment("default", "nginx-deployment")
            .await?
            .expect("applied");
        let status = deployment.status.expect("written by the deployment controller");
        assert_eq!(status.available_replicas, Some(3));
        let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
            kube::Api::namespaced(spoke.env.client().await?, "default");
        let running = pods
            .list(&kube::api::ListParams::default().labels("app=nginx"))
            .await?;
        assert_eq!(running.items.len(), 5, "3 pods of nginx-deployment and 2 of nginx-fleet");
        for pod in &running.items {
            let spec = pod.spec.as_ref().expect("a pod has a spec");
            assert!(
                spec.node_name.as_deref().is_some_and(|n| n.starts_with("kwok-node-")),
                "pod {:?} scheduled onto {:?}",
                pod.metadata.name,
                spec.node_name
            );
            assert_eq!(
                pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Running"),
                "pod {:?}",
                pod.metadata.name
            );
        }
        Ok(())
    }
}

on_both_carriers! {
    /// A Job in a work with OCM's well-known condition rule: the work on the hub turns Complete
    /// when the Job controller marks the real Job Complete after its pod succeeds.
    async fn a_real_job_turns_the_work_complete() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let fleet = Fleet::start(dir.path(), true).await?;
        let spoke = Spoke::start_full(dir.path(), &fleet.hub, "cluster1").await?;
        let _agent = spoke.start_agent(dir.path(), &fleet.hub, &["--feedback-interval=300ms"])?;

        let work = json!({
            "apiVersion": "work.open-cluster-management.io/v1",
            "kind": "ManifestWork",
            "metadata": {"name": "migrate", "namespace": "cluster1"},
            "spec": {
                "workload": {"manifests": [{
                    "apiVersion": "batch/v1", "kind": "Job",
                    "metadata": {"name": "migrate", "namespace": "default"},
                    "spec": {"template": {"spec": {"restartPolicy": "Never",
                        "containers": [{"name": "migrate", "image": "busybox"}]}}},
                }]},
                "manifestConfigs": [{
                    "resourceIdentifier": {"group": "batch", "resource": "jobs", "namespace": "default", "name": "migrate"},
                    "feedbackRules": [{"type": "WellKnownStatus"}],
                    "conditionRules": [{"type": "WellKnownConditions", "condition": "Complete"}],
                }],
            },
        });
        fleet.apply_value(dir.path(), &work)?;
        fleet.wait_applied("cluster1", "migrate").await?;

        let seen = wait_for("work migrate Complete on the hub", WORKLOAD_TIMEOUT, || async {
            let w = fleet.work("cluster1", "migrate")?;
            Ok(w.filter(|w| condition_status(w, "Complete").as_deref() == Some("True")))
        })
        .await
        .map_err(|e| e.context(spoke.env.log_tails()))?;
        assert_eq!(hub_feedback(&seen, "migrate", "JobSucceeded"), integer(1));
        assert_eq!(
            hub_feedback(&seen, "migrate", "JobComplete"),
            Some(json!({"type": "String", "string": "True"}))
        );

        // Complete because the Job controller said so: its own status carries the condition and
        // the count of the pod kwok ran to success.
        let jobs: kube::Api<k8s_openapi::api::batch::v1::Job> =
            kube::Api::namespaced(spoke.env.client().await?, "default");
        let status = jobs.get("migrate").await?.status.expect("written by the job controller");
        assert_eq!(status.succeeded, Some(1));
        assert!(
            status
                .conditions
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Complete" && c.status == "True"),
            "the Job controller marked the Job Complete"
        );
        Ok(())
    }
}
