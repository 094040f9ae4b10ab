//! The apply engine, the reconciler and the cache against a real spoke kube-apiserver (no hub):
//! what a ManifestWork does to a cluster and what its status says.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use flotilla_agent::apply::KubeApplyTarget;
use flotilla_agent::cache::{CacheDb, CachedWork, WorkCache};
use flotilla_agent::reconcile::{Reconciled, Reconciler, ReconcilerConfig, reconcile_work};
use flotilla_proto::api::conditions::{
    WORK_APPLIED, WORK_AVAILABLE, WORK_DEGRADED, find_condition,
};
use flotilla_proto::api::{ManifestWork, ManifestWorkStatus, content_hash};
use flotilla_proto::session::NoJitter;
use flotilla_testenv::{TestEnv, wait_for};
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
        let cache: Arc<dyn WorkCache> = Arc::new(CacheDb::temporary()?.cluster("cluster1"));
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
            policy: false,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_work_applies_then_updates_then_drops_a_removed_manifest() -> anyhow::Result<()> {
    trace_init();
    let spoke = Spoke::start().await?;
    let mut mw = seed_work();
    spoke.put("uid-1", 1, &mw)?;

    let r = spoke.reconcile("uid-1").await?;
    let first = spoke.cache.last_status("uid-1")?.map(|s| s.seq);
    assert!(first.is_some());
    assert_eq!((r.new_status, r.retry), (first, false));
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
    assert_eq!(
        r.new_status,
        first.map(|seq| seq + 1),
        "a new generation is a new status"
    );
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
            ..ReconcilerConfig::default()
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
    wait_for(
        "replicas restored to 3",
        Duration::from_secs(30),
        || async {
            let replicas = deployments
                .get("nginx-deployment")
                .await?
                .spec
                .unwrap()
                .replicas;
            Ok((replicas == Some(3)).then_some(()))
        },
    )
    .await?;
    // ... and an object deleted by hand comes back.
    deployments
        .delete("nginx-deployment", &DeleteParams::default())
        .await?;
    assert!(deployments.get_opt("nginx-deployment").await?.is_none());
    wait_for("the Deployment back", Duration::from_secs(30), || async {
        Ok(deployments.get_opt("nginx-deployment").await?.map(drop))
    })
    .await?;

    let _ = stop.send(());
    task.await?;
    drop(spoke.env);
    Ok(())
}

/// A work with `manifests` and `manifestConfigs` (and more of its spec, e.g. an executor).
fn configured_work(manifests: Vec<Value>, configs: Value, extra: Value) -> ManifestWork {
    let mut spec = json!({"workload": {"manifests": manifests}, "manifestConfigs": configs});
    if let Value::Object(more) = extra {
        for (k, v) in more {
            spec[k] = v;
        }
    }
    serde_json::from_value(json!({
        "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
        "metadata": {"name": "configured", "namespace": "cluster1"},
        "spec": spec,
    }))
    .expect("a ManifestWork")
}

fn config_for(resource: &str, group: &str, name: &str, rest: Value) -> Value {
    let mut c = json!({"resourceIdentifier": {"group": group, "resource": resource, "namespace": "default", "name": name}});
    if let Value::Object(more) = rest {
        for (k, v) in more {
            c[k] = v;
        }
    }
    c
}

fn data(cm: &ConfigMap, key: &str) -> Option<String> {
    cm.data.as_ref()?.get(key).cloned()
}

fn manifest_status(
    status: &ManifestWorkStatus,
    name: &str,
) -> flotilla_proto::api::ManifestCondition {
    status
        .resource_status
        .manifests
        .iter()
        .find(|m| m.resource_meta.name == name)
        .cloned()
        .unwrap_or_else(|| panic!("no manifest {name} in {status:?}"))
}

fn applied_condition(status: &ManifestWorkStatus, name: &str) -> (String, String, String) {
    let m = manifest_status(status, name);
    let c = find_condition(&m.conditions, WORK_APPLIED).expect("an Applied condition");
    (c.status.clone(), c.reason.clone(), c.message.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_create_only_and_read_only_do_what_ocm_says() -> anyhow::Result<()> {
    trace_init();
    let spoke = Spoke::start().await?;
    let cms: Api<ConfigMap> = spoke.api();
    // Made by someone else; the work only observes it.
    cms.create(
        &Default::default(),
        &serde_json::from_value(
            json!({"metadata": {"name": "observed"}, "data": {"owner": "spoke"}}),
        )?,
    )
    .await?;
    let cm = |name: &str, value: &str| {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": "default", "labels": {"from": "hub"}}, "data": {"v": value}})
    };
    let configs = json!([
        config_for(
            "configmaps",
            "",
            "upd",
            json!({"updateStrategy": {"type": "Update"}})
        ),
        config_for(
            "configmaps",
            "",
            "once",
            json!({"updateStrategy": {"type": "CreateOnly"}})
        ),
        config_for(
            "configmaps",
            "",
            "observed",
            json!({"updateStrategy": {"type": "ReadOnly"}})
        ),
    ]);
    let at = |v: &str| {
        configured_work(
            vec![cm("upd", v), cm("once", v), cm("observed", v)],
            configs.clone(),
            Value::Null,
        )
    };
    spoke.put("w", 1, &at("1"))?;
    spoke.reconcile("w").await?;
    assert_eq!(data(&cms.get("upd").await?, "v").as_deref(), Some("1"));
    assert_eq!(data(&cms.get("once").await?, "v").as_deref(), Some("1"));
    assert_eq!(
        data(&cms.get("observed").await?, "owner").as_deref(),
        Some("spoke"),
        "ReadOnly never writes"
    );
    let status = spoke.status("w")?;
    assert_eq!(condition(&status, WORK_APPLIED).0, "True", "{status:?}");

    // Someone labels the Update object on the spoke; a new generation replaces the data and
    // keeps their label; CreateOnly keeps what it created.
    cms.patch(
        "upd",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"team": "ops"}}})),
    )
    .await?;
    spoke.put("w", 2, &at("2"))?;
    spoke.reconcile("w").await?;
    let upd = cms.get("upd").await?;
    assert_eq!(data(&upd, "v").as_deref(), Some("2"));
    let labels = upd.metadata.labels.unwrap_or_default();
    assert_eq!(
        (labels["from"].as_str(), labels["team"].as_str()),
        ("hub", "ops")
    );
    assert!(
        upd.metadata
            .managed_fields
            .unwrap_or_default()
            .iter()
            .any(|m| m.operation.as_deref() == Some("Update")),
        "written with an update call"
    );
    assert_eq!(
        data(&cms.get("once").await?, "v").as_deref(),
        Some("1"),
        "CreateOnly never updates"
    );

    // Deleting the work deletes what it owns, never the ReadOnly object.
    spoke.cache.mark_deleting("w")?;
    assert!(spoke.reconcile("w").await?.forgotten);
    assert!(cms.get_opt("upd").await?.is_none());
    assert!(cms.get_opt("once").await?.is_none());
    assert!(
        cms.get_opt("observed").await?.is_some(),
        "ReadOnly is never deleted"
    );
    drop(spoke.env);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_side_apply_conflicts_name_the_other_manager_and_ignore_fields_keep_spoke_changes()
-> anyhow::Result<()> {
    trace_init();
    let spoke = Spoke::start().await?;
    let deployments: Api<Deployment> = spoke.api();
    let mut web = seed_work().spec.workload.manifests[1].0.clone();
    web["metadata"]["name"] = json!("web");
    // An HPA-like controller owns the replicas.
    let mut theirs = web.clone();
    theirs["spec"] = json!({"replicas": 5, "selector": web["spec"]["selector"], "template": web["spec"]["template"]});
    deployments
        .patch(
            "web",
            &PatchParams::apply("autoscaler"),
            &Patch::Apply(&theirs),
        )
        .await?;
    let ssa = |force: bool| {
        configured_work(
            vec![web.clone()],
            json!([config_for(
                "deployments",
                "apps",
                "web",
                json!({"updateStrategy": {
                "type": "ServerSideApply", "serverSideApply": {"force": force}}})
            )]),
            Value::Null,
        )
    };
    spoke.put("ssa", 1, &ssa(false))?;
    let r = spoke.reconcile("ssa").await?;
    assert!(
        !r.retry,
        "a conflict is not retried without a change to the work"
    );
    let (status, reason, message) = applied_condition(&spoke.status("ssa")?, "web");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "ApplyConflict")
    );
    assert!(
        message.contains("autoscaler"),
        "names the other manager: {message}"
    );
    assert!(message.contains(".spec.replicas"), "{message}");
    assert_eq!(
        deployments.get("web").await?.spec.unwrap().replicas,
        Some(5)
    );

    // force takes the field over, as work-agent (OCM's default manager).
    spoke.put("ssa", 2, &ssa(true))?;
    spoke.reconcile("ssa").await?;
    assert_eq!(applied_condition(&spoke.status("ssa")?, "web").0, "True");
    let d = deployments.get("web").await?;
    assert_eq!(d.spec.as_ref().unwrap().replicas, Some(3));
    let managers: Vec<String> = d
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter_map(|m| m.manager)
        .collect();
    assert!(managers.contains(&"work-agent".to_string()), "{managers:?}");

    // The work with `image` and `.spec.replicas` ignored under `condition`.
    let ignoring_replicas = |condition: &str, image: &str| {
        let mut m = web.clone();
        m["spec"]["template"]["spec"]["containers"][0]["image"] = json!(image);
        configured_work(
            vec![m],
            json!([config_for(
                "deployments",
                "apps",
                "web",
                json!({"updateStrategy": {
                "type": "ServerSideApply", "serverSideApply": {"force": true,
                    "ignoreFields": [{"condition": condition, "jsonPaths": [".spec.replicas"]}]}}})
            )]),
            Value::Null,
        )
    };
    // ignoreFields OnSpokePresent: the spoke's replicas stay, the rest follows the hub.
    let ignoring = |image: &str| ignoring_replicas("OnSpokePresent", image);
    spoke.put("ssa", 3, &ignoring("nginx:1.14.2"))?;
    spoke.reconcile("ssa").await?;
    deployments
        .patch(
            "web",
            &PatchParams::apply("autoscaler").force(),
            &Patch::Apply(json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"}, "spec": {"replicas": 7}})),
        )
        .await?;
    spoke.reconcile("ssa").await?;
    assert_eq!(
        deployments.get("web").await?.spec.unwrap().replicas,
        Some(7),
        "resync keeps the spoke's replicas"
    );
    spoke.put("ssa", 4, &ignoring("nginx:1.25.3"))?;
    spoke.reconcile("ssa").await?;
    let d = deployments.get("web").await?;
    assert_eq!(image(&d), "nginx:1.25.3", "the hub's change is applied");
    assert_eq!(
        d.spec.unwrap().replicas,
        Some(7),
        "the ignored field is not"
    );
    assert_eq!(applied_condition(&spoke.status("ssa")?, "web").0, "True");

    // ignoreFields OnSpokeChange: the field follows the hub whenever the manifest changes, and
    // the spoke's own change to it stands until then.
    let on_change = |image: &str| ignoring_replicas("OnSpokeChange", image);
    spoke.put("ssa", 5, &on_change("nginx:1.25.3"))?;
    spoke.reconcile("ssa").await?;
    assert_eq!(
        deployments.get("web").await?.spec.unwrap().replicas,
        Some(3),
        "a changed work applies an OnSpokeChange field"
    );
    deployments
        .patch(
            "web",
            &PatchParams::apply("autoscaler").force(),
            &Patch::Apply(json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"}, "spec": {"replicas": 9}})),
        )
        .await?;
    spoke.reconcile("ssa").await?;
    assert_eq!(
        deployments.get("web").await?.spec.unwrap().replicas,
        Some(9),
        "resync keeps the spoke's change while the work is unchanged"
    );
    spoke.put("ssa", 6, &on_change("nginx:1.26.0"))?;
    spoke.reconcile("ssa").await?;
    let d = deployments.get("web").await?;
    assert_eq!(image(&d), "nginx:1.26.0", "the hub's change is applied");
    assert_eq!(
        d.spec.unwrap().replicas,
        Some(3),
        "and with it the OnSpokeChange field, over the spoke's change"
    );
    assert_eq!(applied_condition(&spoke.status("ssa")?, "web").0, "True");
    drop(spoke.env);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_lacking_a_permission_is_refused_for_that_manifest_only() -> anyhow::Result<()>
{
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    trace_init();
    let spoke = Spoke::start().await?;
    let sas: Api<ServiceAccount> = spoke.api();
    sas.create(
        &Default::default(),
        &serde_json::from_value(json!({"metadata": {"name": "deployer"}}))?,
    )
    .await?;
    // ConfigMaps yes, Secrets no.
    let roles: Api<Role> = spoke.api();
    roles
        .create(
            &Default::default(),
            &serde_json::from_value(json!({"metadata": {"name": "configmaps"}, "rules": [{
                "apiGroups": [""], "resources": ["configmaps"],
                "verbs": ["create", "update", "patch", "get", "delete"]}]}))?,
        )
        .await?;
    let bindings: Api<RoleBinding> = spoke.api();
    bindings
        .create(
            &Default::default(),
            &serde_json::from_value(json!({"metadata": {"name": "deployer"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "configmaps"},
                "subjects": [{"kind": "ServiceAccount", "name": "deployer", "namespace": "default"}]}))?,
        )
        .await?;
    let secret = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "token", "namespace": "default"}, "stringData": {"k": "v"}});
    let mw = configured_work(
        vec![configmap("allowed"), secret],
        json!([]),
        json!({"executor": {"subject": {"type": "ServiceAccount", "serviceAccount": {"namespace": "default", "name": "deployer"}}}}),
    );
    spoke.put("exec", 1, &mw)?;
    let r = spoke.reconcile("exec").await?;
    assert!(
        r.retry,
        "a missing right may be granted later: retried with backoff"
    );
    let cms: Api<ConfigMap> = spoke.api();
    assert!(cms.get_opt("allowed").await?.is_some());
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = spoke.api();
    assert!(
        secrets.get_opt("token").await?.is_none(),
        "nothing written beyond the executor's rights"
    );
    let status = spoke.status("exec")?;
    assert_eq!(applied_condition(&status, "allowed").0, "True");
    let (applied, reason, message) = applied_condition(&status, "token");
    assert_eq!(
        (applied.as_str(), reason.as_str()),
        ("False", "AppliedManifestFailed")
    );
    assert_eq!(
        message,
        "executor ServiceAccount default/deployer may not create secrets default/token; grant it create, update, patch, get, delete on secrets in namespace default"
    );
    assert_eq!(condition(&status, WORK_APPLIED).0, "False");
    drop(spoke.env);
    Ok(())
}

/// A SubjectAccessReview says the executor may create Roles, not whether a Role grants more
/// than the executor holds: the spoke apiserver's own escalation check decides, on a dry run as
/// the executor, and a refused Role is neither created nor hides the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_cannot_write_a_role_granting_what_it_does_not_hold() -> anyhow::Result<()> {
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    trace_init();
    let spoke = Spoke::start().await?;
    let sas: Api<ServiceAccount> = spoke.api();
    sas.create(
        &Default::default(),
        &serde_json::from_value(json!({"metadata": {"name": "role-writer"}}))?,
    )
    .await?;
    // It may write Roles, and only read ConfigMaps.
    let roles: Api<Role> = spoke.api();
    roles
        .create(
            &Default::default(),
            &serde_json::from_value(json!({"metadata": {"name": "role-writer"}, "rules": [
                {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles"],
                 "verbs": ["create", "update", "patch", "get", "delete"]},
                {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}]}))?,
        )
        .await?;
    let bindings: Api<RoleBinding> = spoke.api();
    bindings
        .create(
            &Default::default(),
            &serde_json::from_value(json!({"metadata": {"name": "role-writer"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "role-writer"},
                "subjects": [{"kind": "ServiceAccount", "name": "role-writer", "namespace": "default"}]}))?,
        )
        .await?;
    let role = |name: &str, verbs: Value| {
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": name, "namespace": "default"},
               "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": verbs}]})
    };
    let mw = configured_work(
        vec![
            role("reader", json!(["get"])),
            role("writer", json!(["get", "create", "delete"])),
        ],
        json!([]),
        json!({"executor": {"subject": {"type": "ServiceAccount", "serviceAccount": {"namespace": "default", "name": "role-writer"}}}}),
    );
    spoke.put("escalate", 1, &mw)?;
    let r = spoke.reconcile("escalate").await?;
    assert!(r.retry, "a right granted later lets it through: retried");

    assert!(
        roles.get_opt("reader").await?.is_some(),
        "a Role within the executor's rights is written"
    );
    assert!(
        roles.get_opt("writer").await?.is_none(),
        "nothing is created for the refused Role"
    );
    let status = spoke.status("escalate")?;
    assert_eq!(applied_condition(&status, "reader").0, "True");
    let (applied, reason, message) = applied_condition(&status, "writer");
    assert_eq!((applied.as_str(), reason.as_str()), ("False", "Forbidden"));
    assert!(
        message.starts_with(
            "executor ServiceAccount default/role-writer may not write Role default/writer: the spoke refused it (Forbidden): "
        ),
        "{message}"
    );
    // The apiserver's own words for an escalation.
    assert!(
        message.contains("is attempting to grant RBAC permissions not currently held"),
        "{message}"
    );
    assert_eq!(condition(&status, WORK_APPLIED).0, "False");
    drop(spoke.env);
    Ok(())
}

/// The reconciler task with a short feedback interval, on `spoke`.
fn start_reconciler(
    spoke: &Spoke,
) -> (
    Arc<Notify>,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let outbox_changed = Arc::new(Notify::new());
    let (reconciler, _handle) = Reconciler::new(
        Arc::clone(&spoke.cache),
        spoke.target.clone(),
        ReconcilerConfig {
            resync_interval: Duration::from_secs(3600),
            feedback_interval: Duration::from_millis(300),
            ..ReconcilerConfig::default()
        },
        Arc::clone(&outbox_changed),
        Box::new(NoJitter),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(reconciler.run(async {
        let _ = stopped.await;
    }));
    (outbox_changed, stop, task)
}

fn feedback_value(status: &ManifestWorkStatus, manifest: &str, name: &str) -> Option<Value> {
    let m = manifest_status(status, manifest);
    let v = m.status_feedback.values.iter().find(|v| v.name == name)?;
    serde_json::to_value(&v.field_value).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn feedback_and_condition_rules_follow_status_written_on_the_spoke() -> anyhow::Result<()> {
    use k8s_openapi::api::batch::v1::Job;
    trace_init();
    let spoke = Spoke::start().await?;
    let mut web = seed_work().spec.workload.manifests[1].0.clone();
    web["metadata"]["name"] = json!("web");
    let job = |label: &str| {
        json!({"apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "migrate", "namespace": "default", "labels": {"step": label}},
        "spec": {"template": {"spec": {"restartPolicy": "Never",
            "containers": [{"name": "m", "image": "busybox"}]}}}})
    };
    let configs = json!([
        config_for(
            "deployments",
            "apps",
            "web",
            json!({
                "feedbackRules": [
                    {"type": "WellKnownStatus"},
                    {"type": "JSONPaths", "jsonPaths": [{"name": "isAvailable", "path": ".status.conditions[?(@.type==\"Available\")].status"}]},
                ],
                "conditionRules": [{"type": "CEL", "condition": "AllReplicasReady",
                    "celExpressions": ["object.status.readyReplicas == object.spec.replicas"],
                    "messageExpression": "result ? 'all ' + string(object.status.readyReplicas) + ' ready' : 'waiting'"}],
            })
        ),
        config_for(
            "jobs",
            "batch",
            "migrate",
            json!({
                "conditionRules": [{"type": "WellKnownConditions"}],
                "feedbackRules": [{"type": "WellKnownStatus"}],
            })
        ),
    ]);
    let work_at =
        |label: &str| configured_work(vec![web.clone(), job(label)], configs.clone(), Value::Null);
    spoke.put("fb", 1, &work_at("one"))?;
    let (outbox, stop, task) = start_reconciler(&spoke);
    let status_where =
        |what: &'static str, check: Box<dyn Fn(&ManifestWorkStatus) -> bool + Send + Sync>| {
            let spoke = &spoke;
            let outbox = &outbox;
            async move {
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    if let Ok(s) = spoke.status("fb")
                        && check(&s)
                    {
                        return Ok::<_, anyhow::Error>(s);
                    }
                    anyhow::ensure!(Instant::now() < deadline, "timed out waiting for {what}");
                    let _ =
                        tokio::time::timeout(Duration::from_millis(500), outbox.notified()).await;
                }
            }
        };
    let first = status_where(
        "the first status",
        Box::new(|s| condition(s, WORK_APPLIED).0 == "True"),
    )
    .await?;
    assert_eq!(
        manifest_status(&first, "web").status_feedback.values.len(),
        0,
        "no status written yet"
    );

    // A controller reports the Deployment ready, as the kube-controller-manager would.
    let deployments: Api<Deployment> = spoke.api();
    deployments
        .patch_status(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"replicas": 3, "readyReplicas": 3, "availableReplicas": 3,
                "conditions": [{"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable",
                    "lastUpdateTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})),
        )
        .await?;
    let ready = status_where(
        "feedback from the Deployment",
        Box::new(|s| feedback_value(s, "web", "ReadyReplicas").is_some()),
    )
    .await?;
    assert_eq!(
        feedback_value(&ready, "web", "ReadyReplicas"),
        Some(json!({"type": "Integer", "integer": 3}))
    );
    assert_eq!(
        feedback_value(&ready, "web", "AvailableReplicas"),
        Some(json!({"type": "Integer", "integer": 3}))
    );
    assert_eq!(
        feedback_value(&ready, "web", "isAvailable"),
        Some(json!({"type": "String", "string": "True"}))
    );
    let web_status = manifest_status(&ready, "web");
    let rule = find_condition(&web_status.conditions, "AllReplicasReady")
        .expect("the CEL rule's condition");
    assert_eq!(
        (
            rule.status.as_str(),
            rule.reason.as_str(),
            rule.message.as_str()
        ),
        ("True", "ConditionRuleEvaluated", "all 3 ready")
    );
    assert_eq!(
        condition(&ready, "AllReplicasReady").0,
        "True",
        "aggregated on the work"
    );
    assert_eq!(
        condition(&ready, "Complete").0,
        "False",
        "the Job has not finished"
    );

    // The Job finishes: Complete on the manifest and the work; later updates leave it alone.
    let jobs: Api<Job> = spoke.api();
    jobs.patch_status(
        "migrate",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"startTime": "2026-01-01T00:00:00Z", "completionTime": "2026-01-01T00:01:00Z",
            "succeeded": 1, "conditions": [
                {"type": "SuccessCriteriaMet", "status": "True", "lastProbeTime": "2026-01-01T00:01:00Z", "lastTransitionTime": "2026-01-01T00:01:00Z"},
                {"type": "Complete", "status": "True", "lastProbeTime": "2026-01-01T00:01:00Z", "lastTransitionTime": "2026-01-01T00:01:00Z"}]}})),
    )
    .await?;
    let complete = status_where(
        "the work Complete",
        Box::new(|s| condition(s, "Complete").0 == "True"),
    )
    .await?;
    let (_, reason, message) = condition(&complete, "Complete");
    assert_eq!(
        (reason.as_str(), message.as_str()),
        (
            "ManifestsComplete",
            "1 of 1 completable manifests are complete"
        )
    );
    let migrate = manifest_status(&complete, "migrate");
    let c = find_condition(&migrate.conditions, "Complete").unwrap();
    assert_eq!(
        (c.status.as_str(), c.message.as_str()),
        ("True", "Job is finished")
    );

    // A new generation, reconciled as the session driver's call would have it.
    spoke.put("fb", 2, &work_at("two"))?;
    spoke.reconcile("fb").await?;
    let j = jobs.get("migrate").await?;
    assert_eq!(
        j.metadata.labels.unwrap_or_default()["step"],
        "one",
        "a complete Job is not updated any more"
    );
    let _ = stop.send(());
    task.await?;
    drop(spoke.env);
    Ok(())
}
