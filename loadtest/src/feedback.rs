//! The `feedback` scenario: every cluster runs a Deployment whose status changes every
//! `--feedback-every` for `--feedback-duration`, as a rolling or autoscaled workload's would, and
//! its work asks for the Deployment's well-known status as feedback. The simulated clusters
//! change the status (no apply involved); the agents' watches turn it into statuses, at most
//! one per work per feedback interval. Measured over the window: session bytes per cluster per
//! second both ways, statuses sent per cluster per second, and statuses acknowledged per
//! second, which is the hub's store writes per second (the gateway acknowledges a status only
//! once it is stored). At the end every work's status on the hub must show the last value set.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use flotilla_agent::cache::AppliedResource;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::operator::condition;
use crate::report::ScenarioReport;
use crate::scenario::{Clock, Run, SAMPLE_EVERY, finish};
use crate::sim::SimCluster;

/// The Deployment each cluster runs.
pub const DEPLOYMENT: &str = "flotilla-loadtest-web";

/// The Deployment as the ledger and the simulated cluster name it.
pub fn deployment() -> AppliedResource {
    AppliedResource {
        group: "apps".into(),
        version: "v1".into(),
        kind: "Deployment".into(),
        resource: "deployments".into(),
        namespace: "default".into(),
        name: DEPLOYMENT.into(),
    }
}

/// The status a controller writes at step `step` of the flapping: the replicas move with it.
pub fn deployment_status(step: u64) -> Value {
    let replicas = 1 + step % 10;
    json!({"replicas": replicas, "readyReplicas": replicas, "availableReplicas": replicas,
           "observedGeneration": 1})
}

/// The ManifestWork of the scenario: the Deployment, with its well-known status as feedback.
pub fn work_json(cluster: &str, name: &str) -> Value {
    json!({
        "apiVersion": "work.open-cluster-management.io/v1",
        "kind": "ManifestWork",
        "metadata": { "name": name, "namespace": cluster },
        "spec": {
            "workload": { "manifests": [{
                "apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": { "name": DEPLOYMENT, "namespace": "default" },
                "spec": {
                    "replicas": 1,
                    "selector": { "matchLabels": { "app": "web" } },
                    "template": { "metadata": { "labels": { "app": "web" } },
                                  "spec": { "containers": [{ "name": "web", "image": "nginx:1.25" }] } },
                },
            }]},
            "manifestConfigs": [{
                "resourceIdentifier": { "group": "apps", "resource": "deployments",
                                        "namespace": "default", "name": DEPLOYMENT },
                "feedbackRules": [{ "type": "WellKnownStatus" }],
            }],
        },
    })
}

impl Run {
    /// `feedback`: see the module docs.
    pub async fn feedback(&mut self) -> ScenarioReport {
        let mut r = ScenarioReport::new("feedback", self.identities.len());
        let clock = Clock::new(self.args.timeout + self.args.feedback_duration);
        let result = self.feedback_inner(&clock, &mut r).await;
        finish(&mut r, &clock, result);
        r
    }

    async fn feedback_inner(
        &mut self,
        clock: &Clock,
        r: &mut ScenarioReport,
    ) -> anyhow::Result<bool> {
        self.ensure_connected(clock).await?;
        let n = self.n();
        let name = self.next_work_name("feedback");
        r.work = Some(name.clone());
        self.create_everywhere_as(&name, work_json).await?;
        // Applied everywhere first: the window measures feedback, not the fan-out.
        let bar = self.bar("applied", n);
        loop {
            let applied = self.applied_on_hub(&name).await?.len() as u64;
            bar.set_position(applied);
            if applied >= n {
                break;
            }
            anyhow::ensure!(
                !clock.expired(),
                "only {applied} of {n} clusters applied the work before the deadline"
            );
            tokio::time::sleep(self.args.poll_interval).await;
        }
        bar.finish_and_clear();

        let every = self.args.feedback_every;
        let duration = self.args.feedback_duration;
        let before = self.sample();
        let started = Instant::now();
        let steps = self
            .agents
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("no agents"))?
            .flap(duration, every)
            .await?;
        let window = started.elapsed().as_secs_f64();
        // Workers report their counters every 100 ms: wait for the one that has every change.
        let made = steps * n;
        let counted = Instant::now();
        while self.sample().status_changes - before.status_changes < made
            && counted.elapsed() < Duration::from_secs(5)
        {
            tokio::time::sleep(SAMPLE_EVERY).await;
        }
        let after = self.sample();
        let per_cluster_s = |v: u64| v as f64 / n.max(1) as f64 / window.max(1e-3);
        r.feedback_window_s = Some(window);
        r.feedback_changes = Some(after.status_changes - before.status_changes);
        r.session_bytes_out_per_cluster_s = Some(per_cluster_s(after.bytes_out - before.bytes_out));
        r.session_bytes_in_per_cluster_s = Some(per_cluster_s(after.bytes_in - before.bytes_in));
        r.statuses_per_cluster_s = Some(per_cluster_s(after.statuses_sent - before.statuses_sent));
        r.store_writes_per_s =
            Some((after.statuses_acked - before.statuses_acked) as f64 / window.max(1e-3));
        // The agents' bound: one status per work per feedback interval, plus the one a window
        // may start with.
        let interval = self.args.feedback_interval.as_secs_f64();
        r.statuses_bound_per_cluster_s = Some(1.0 / interval + 1.0 / window.max(1e-3));

        // The latest state reaches the hub.
        let last = deployment_status(steps.saturating_sub(1));
        let want = last["readyReplicas"].as_i64();
        let settled = Instant::now();
        let bar = self.bar("converge", n);
        let mut done = false;
        while !clock.expired() {
            let converged: HashSet<String> = self
                .api
                .works()
                .await?
                .iter()
                .filter(|w| w["metadata"]["name"] == name.as_str())
                .filter(|w| ready_replicas(w) == want && condition(w, "Applied") == Some("True"))
                .filter_map(|w| w["metadata"]["namespace"].as_str().map(str::to_owned))
                .collect();
            bar.set_position(converged.len() as u64);
            r.feedback_converged = Some(converged.len() as u64);
            if converged.len() as u64 >= n {
                r.feedback_converge_s = Some(settled.elapsed().as_secs_f64());
                done = true;
                break;
            }
            tokio::time::sleep(self.args.poll_interval).await;
        }
        bar.finish_and_clear();
        Ok(done)
    }
}

/// `ReadyReplicas` of the Deployment's feedback in a work's status on the hub.
fn ready_replicas(work: &Value) -> Option<i64> {
    work["status"]["resourceStatus"]["manifests"]
        .as_array()?
        .iter()
        .find(|m| m["resourceMeta"]["name"] == DEPLOYMENT)?["statusFeedback"]["values"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == "ReadyReplicas")?["fieldValue"]["integer"]
        .as_i64()
}

/// Changes every simulated Deployment's status every `every` for `duration`, each agent at its
/// own offset within the period so the fleet's changes spread over it. Returns the steps made.
pub async fn flap_clusters(
    clusters: &[Arc<SimCluster>],
    duration: Duration,
    every: Duration,
    changes: Arc<AtomicU64>,
) -> u64 {
    let resource = deployment();
    let steps = (duration.as_secs_f64() / every.as_secs_f64())
        .ceil()
        .max(1.0) as u64;
    let start = Instant::now();
    let n = clusters.len().max(1) as u32;
    let mut tasks = tokio::task::JoinSet::new();
    for (i, cluster) in clusters.iter().enumerate() {
        let cluster = cluster.clone();
        let resource = resource.clone();
        let offset = every / n * i as u32;
        let changes = changes.clone();
        tasks.spawn(async move {
            for step in 0..steps {
                tokio::time::sleep_until(start + offset + every * step as u32).await;
                if cluster.set_status(&resource, deployment_status(step)).await {
                    changes.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    steps
}
