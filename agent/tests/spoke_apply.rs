//! The apply engine, the reconciler and the cache against a real spoke kube-apiserver (no hub):
//! what a ManifestWork does to a cluster and what its status says.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use flotilla_agent::apply::KubeApplyTarget;
use flotilla_agent::cache::{CachedWork, SledCacheDb, WorkCache};
use flotilla_agent::reconcile::{Reconciled, Reconciler, ReconcilerConfig, reconcile_work};
use flotilla_proto::api::conditions::{
    WORK_APPLIED, WORK_AVAILABLE, WORK_DEGRADED, find_condition,
};
use flotilla_proto::api::{ManifestWork, ManifestWorkStatus, content_hash};
use flotilla_proto::session::Jitter;
use flotilla_testenv::TestEnv;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::{Value, json};
use tokio::sync::Notify;
use tokio::time::Instant;

fn trace_init() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "flotilla_agent=debug,info".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// A real spoke apiserver, the agent's kube target on it, and an empty cache.
struct Spoke {
    env: TestEnv,
    client: kube::Client,
    target: Arc<KubeApplyTarget>,
    cache: Arc<dyn WorkCache>,
}

impl Spoke {
    async fn start() -> anyhow::Result<Spoke> {
        let env = TestEnv::start().await?;
        let client = env.client().await?;
        let cache: Arc<dyn WorkCache> = Arc::new(SledCacheDb::temporary()?.cluster("cluster1")?);
        Ok(Spoke {
            target: Arc::new(KubeApplyTarget::new(client.clone())),
            client,
            cache,
            env,
        })
    }

    /// Stores `work` as the session driver does when the hub sends it.
    fn put(&self, uid: &str, generation: i64, work: &ManifestWork) -> anyhow::Result<()> {
        let cached = CachedWork {
            uid: uid.into(),
            namespace: "cluster1".into(),
            name: work.metadata.name.clone().unwrap_or_default(),
            generation,
            content_hash: content_hash(&work.spec),
            refused: None,
            deleting: false,
        };
        self.cache
            .put_work(&cached, Some(&serde_json::to_vec(work)?))?;
        Ok(())
    }

    async fn reconcile(&self, uid: &str) -> anyhow::Result<Reconciled> {
        Ok(reconcile_work(&self.cache, self.target.as_ref(), uid).await?)
    }

    fn status(&self, uid: &str) -> anyhow::Result<ManifestWorkStatus> {
        let record = self.cache.last_status(uid)?.context("no status recorded")?;
        Ok(serde_json::from_value(record.status)?)
    }

    fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), "default")
    }
}

/// OCM's first ManifestWork (seed scenario 1): ServiceAccount my-sa + Deployment nginx-deployment.
fn seed_work() -> ManifestWork {
    let yaml = include_str!("fixtures/my-first-work.yaml");
    yaml_serde::from_str(yaml).expect("the fixture is a ManifestWork")
}

/// A ManifestWork with these manifests (and optional deleteOption).
fn work(name: &str, manifests: Vec<Value>, delete_option: Value) -> ManifestWork {
    let mut spec = json!({"workload": {"manifests": manifests}});
    if !delete_option.is_null() {
        spec["deleteOption"] = delete_option;
    }
    serde_json::from_value(json!({
        "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
        "metadata": {"name": name, "namespace": "cluster1"},
        "spec": spec,
    }))
    .expect("a ManifestWork")
}

fn configmap(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": "default"}, "data": {"owner": "flotilla"}})
}

/// `(status, reason, message)` of a work condition.
fn condition(status: &ManifestWorkStatus, type_: &str) -> (String, String, String) {
    let c = find_condition(&status.conditions, type_)
        .unwrap_or_else(|| panic!("no {type_} condition in {status:?}"));
    (c.status.clone(), c.reason.clone(), c.message.clone())
}

fn image(deployment: &Deployment) -> String {
    deployment
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0]
        .image
        .clone()
        .unwrap_or_default()
}

/// Polls `check` until it holds or `timeout` passes.
async fn eventually<F, Fut>(what: &str, timeout: Duration, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<bool>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await? {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

struct NoJitter;

impl Jitter for NoJitter {
    fn uniform(&mut self, _max: Duration) -> Duration {
        Duration::ZERO
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_work_applies_then_updates_then_drops_a_removed_manifest() -> anyhow::Result<()> {
    trace_init();
    let spoke = Spoke::start().await?;
    let mut mw = seed_work();
    spoke.put("uid-1", 1, &mw)?;

    let r = spoke.reconcile("uid-1").await?;
    assert_eq!((r.new_status, r.retry), (Some(1), false));
    let sa: Api<ServiceAccount> = spoke.api();
    let deployments: Api<Deployment> = spoke.api();
    assert!(sa.get_opt("my-sa").await?.is_some());
    let deployment = deployments.get("nginx-deployment").await?;
    assert_eq!(image(&deployment), "nginx:1.14.2");
    let managers: Vec<_> = deployment
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter_map(|m| m.manager)
        .collect();
    assert!(
        managers.contains(&"flotilla-agent".to_string()),
        "{managers:?}"
    );

    let status = spoke.status("uid-1")?;
    assert_eq!(condition(&status, WORK_APPLIED).0, "True");
    assert_eq!(condition(&status, WORK_AVAILABLE).0, "True");
    assert_eq!(condition(&status, WORK_DEGRADED).0, "False");
    assert_eq!(
        find_condition(&status.conditions, WORK_APPLIED)
            .unwrap()
            .observed_generation,
        Some(1)
    );
    let metas: Vec<_> = status
        .resource_status
        .manifests
        .iter()
        .map(|m| {
            let r = &m.resource_meta;
            format!(
                "{} {}/{} {} {} {}/{}",
                r.ordinal, r.group, r.version, r.kind, r.resource, r.namespace, r.name
            )
        })
        .collect();
    assert_eq!(
        metas,
        [
            "0 /v1 ServiceAccount serviceaccounts default/my-sa",
            "1 apps/v1 Deployment deployments default/nginx-deployment"
        ]
    );
    for m in &status.resource_status.manifests {
        let applied = find_condition(&m.conditions, WORK_APPLIED).unwrap();
        assert_eq!(
            (applied.status.as_str(), applied.reason.as_str()),
            ("True", "AppliedManifestComplete")
        );
        let available = find_condition(&m.conditions, WORK_AVAILABLE).unwrap();
        assert_eq!(
            (available.status.as_str(), available.reason.as_str()),
            ("True", "ResourceAvailable")
        );
    }
    // The hub stores what the agent sends: it must read as OCM's status shape.
    let wire: Value = spoke.cache.last_status("uid-1")?.unwrap().status;
    assert_eq!(
        wire["resourceStatus"]["manifests"][1]["resourceMeta"]["resource"],
        "deployments"
    );

    // Reconciling an unchanged work again produces no new status.
    assert_eq!(spoke.reconcile("uid-1").await?.new_status, None);

    // Generation 2: a new image reaches the Deployment.
    mw.spec.workload.manifests[1].0["spec"]["template"]["spec"]["containers"][0]["image"] =
        json!("nginx:1.25.3");
    spoke.put("uid-1", 2, &mw)?;
    let r = spoke.reconcile("uid-1").await?;
    assert_eq!(r.new_status, Some(2), "a new generation is a new status");
    assert_eq!(
        image(&deployments.get("nginx-deployment").await?),
        "nginx:1.25.3"
    );
    assert_eq!(
        find_condition(&spoke.status("uid-1")?.conditions, WORK_APPLIED)
            .unwrap()
            .observed_generation,
        Some(2)
    );

    // Generation 3: the ServiceAccount is removed from the work, so from the cluster.
    mw.spec.workload.manifests.remove(0);
    spoke.put("uid-1", 3, &mw)?;
    spoke.reconcile("uid-1").await?;
    assert!(
        sa.get_opt("my-sa").await?.is_none(),
        "a manifest removed from the work is deleted"
    );
    assert!(deployments.get_opt("nginx-deployment").await?.is_some());
    assert_eq!(spoke.cache.ledger("uid-1")?.len(), 1);
    assert_eq!(spoke.status("uid-1")?.resource_status.manifests.len(), 1);
    drop(spoke.env);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_work_deletes_or_orphans_as_its_delete_option_says() -> anyhow::Result<()> {
    trace_init();
    let spoke = Spoke::start().await?;
    let cms: Api<ConfigMap> = spoke.api();
    let works = [
        (
            "foreground",
            work(
                "foreground",
                vec![configmap("fg-a"), configmap("fg-b")],
                json!({"propagationPolicy": "Foreground"}),
            ),
        ),
        (
            "default",
            work("default", vec![configmap("df-a")], Value::Null),
        ),
        (
            "orphan",
            work(
                "orphan",
                vec![configmap("or-a"), configmap("or-b")],
                json!({"propagationPolicy": "Orphan"}),
            ),
        ),
        (
            "selective",
            work(
                "selective",
                vec![configmap("so-keep"), configmap("so-drop")],
                json!({"propagationPolicy": "SelectivelyOrphan", "selectivelyOrphans": {"orphaningRules": [
                    {"group": "", "resource": "configmaps", "namespace": "default", "name": "so-keep"}
                ]}}),
            ),
        ),
    ];
    for (uid, mw) in &works {
        spoke.put(uid, 1, mw)?;
        assert!(!spoke.reconcile(uid).await?.retry);
    }
    for name in ["fg-a", "fg-b", "df-a", "or-a", "or-b", "so-keep", "so-drop"] {
        assert!(cms.get_opt(name).await?.is_some(), "{name} applied");
    }
    for (uid, _) in &works {
        assert!(spoke.cache.mark_deleting(uid)?);
        let r = spoke.reconcile(uid).await?;
        assert!(r.forgotten, "{uid}: {r:?}");
        assert!(spoke.cache.work(uid)?.is_none());
    }
    let mut left = Vec::new();
    for name in ["fg-a", "fg-b", "df-a", "or-a", "or-b", "so-keep", "so-drop"] {
        if let Some(cm) = cms.get_opt(name).await? {
            // Orphans keep their content.
            assert_eq!(cm.data.unwrap()["owner"], "flotilla");
            left.push(name);
        }
    }
    assert_eq!(left, ["or-a", "or-b", "so-keep"]);
    drop(spoke.env);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_manifests_fail_alone_and_the_status_names_them_with_the_spokes_error()
-> anyhow::Result<()> {
    trace_init();
    let spoke = Spoke::start().await?;
    let mut bad_deployment = seed_work().spec.workload.manifests[1].0.clone();
    bad_deployment["metadata"]["name"] = json!("bad");
    // The selector no longer matches the template's labels: the apiserver refuses it.
    bad_deployment["spec"]["template"]["metadata"]["labels"] = json!({"app": "other"});
    let mw = work(
        "mixed",
        vec![
            json!({"apiVersion": "v1", "metadata": {"name": "no-kind", "namespace": "default"}}),
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"namespace": "default"}}),
            json!({"apiVersion": "widgets.example.com/v1", "kind": "Widget", "metadata": {"name": "w", "namespace": "default"}}),
            bad_deployment,
            configmap("good"),
        ],
        Value::Null,
    );
    spoke.put("uid-mixed", 1, &mw)?;
    let r = spoke.reconcile("uid-mixed").await?;
    assert!(
        r.retry,
        "an unknown kind may be served later, so the work is retried"
    );

    let cms: Api<ConfigMap> = spoke.api();
    assert!(
        cms.get_opt("good").await?.is_some(),
        "the valid manifest is applied anyway"
    );

    let status = spoke.status("uid-mixed")?;
    let (applied, reason, message) = condition(&status, WORK_APPLIED);
    assert_eq!(
        (applied.as_str(), reason.as_str()),
        ("False", "AppliedManifestWorkFailed")
    );
    assert_eq!(
        message,
        "Failed to apply manifest work: 4 of 5 manifests failed"
    );
    let (degraded, _, message) = condition(&status, WORK_DEGRADED);
    assert_eq!(degraded, "True");
    let failures: Vec<&str> = message.split("; ").collect();
    assert_eq!(
        failures[0],
        "manifest #0 (v1 default/no-kind): manifest has no kind"
    );
    assert_eq!(
        failures[1],
        "manifest #1 (v1 ConfigMap in default): manifest has no metadata.name"
    );
    assert!(
        failures[2].starts_with("manifest #2 (widgets.example.com/v1 Widget default/w): the spoke cluster serves no kind Widget in widgets.example.com/v1"),
        "{}",
        failures[2]
    );
    // The apiserver's own words, verbatim.
    assert!(
        failures[3].starts_with("manifest #3 (apps/v1 Deployment default/bad): Deployment.apps \"bad\" is invalid: spec.template.metadata.labels: Invalid value"),
        "{}",
        failures[3]
    );
    let per_manifest: Vec<(String, String)> = status
        .resource_status
        .manifests
        .iter()
        .map(|m| {
            let c = find_condition(&m.conditions, WORK_APPLIED).unwrap();
            (c.status.clone(), c.reason.clone())
        })
        .collect();
    let failed = ("False".to_string(), "AppliedManifestFailed".to_string());
    let ok = ("True".to_string(), "AppliedManifestComplete".to_string());
    assert_eq!(
        per_manifest,
        [failed.clone(), failed.clone(), failed.clone(), failed, ok]
    );
    let bad = &status.resource_status.manifests[3];
    assert_eq!(bad.resource_meta.resource, "deployments");
    assert_eq!(
        find_condition(&bad.conditions, WORK_AVAILABLE)
            .unwrap()
            .status,
        "False"
    );
    drop(spoke.env);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_hub_the_cache_is_applied_at_start_and_the_resync_repairs_drift()
-> anyhow::Result<()> {
    trace_init();
    let spoke = Spoke::start().await?;
    // The cache as a previous run left it; no hub anywhere in this test.
    spoke.put("uid-1", 4, &seed_work())?;

    let outbox_changed = Arc::new(Notify::new());
    let (reconciler, _handle) = Reconciler::new(
        Arc::clone(&spoke.cache),
        spoke.target.clone(),
        ReconcilerConfig {
            resync_interval: Duration::from_secs(2),
            concurrency: 2,
            retry_initial: Duration::from_millis(200),
        },
        Arc::clone(&outbox_changed),
        Box::new(NoJitter),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(reconciler.run(async {
        let _ = stopped.await;
    }));

    let deployments: Api<Deployment> = spoke.api();
    tokio::time::timeout(Duration::from_secs(30), outbox_changed.notified())
        .await
        .context("no status from the start-up reconcile")?;
    assert!(deployments.get_opt("nginx-deployment").await?.is_some());
    let pending = spoke.cache.pending_statuses()?;
    assert_eq!(
        (pending.len(), pending[0].generation),
        (1, 4),
        "the status waits in the outbox for a hub"
    );

    // Drift: a field changed by hand is taken back ...
    let by_hand = PatchParams::apply("by-hand").force();
    deployments
        .patch("nginx-deployment", &by_hand, &Patch::Apply(json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "nginx-deployment"}, "spec": {"replicas": 1}})))
        .await?;
    eventually(
        "replicas restored to 3",
        Duration::from_secs(30),
        || async {
            Ok(deployments
                .get("nginx-deployment")
                .await?
                .spec
                .unwrap()
                .replicas
                == Some(3))
        },
    )
    .await?;
    // ... and an object deleted by hand comes back.
    deployments
        .delete("nginx-deployment", &DeleteParams::default())
        .await?;
    assert!(deployments.get_opt("nginx-deployment").await?.is_none());
    eventually("the Deployment back", Duration::from_secs(30), || async {
        Ok(deployments.get_opt("nginx-deployment").await?.is_some())
    })
    .await?;

    let _ = stop.send(());
    task.await?;
    drop(spoke.env);
    Ok(())
}
