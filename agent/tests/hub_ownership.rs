//! Two hubs' agents writing to one real spoke kube-apiserver (no hub processes): whose fields
//! are whose, a conflict between hubs said in the manifest's status, and deleting one hub's
//! work leaving what the other hub applies.

use std::sync::Arc;

use anyhow::Context as _;
use flotilla_agent::apply::{ApplyTarget, FieldManagers, KubeApplyTarget, PolicyWritesAs};
use flotilla_agent::cache::{AppliedResource, CacheDb, CachedWork, WorkCache};
use flotilla_agent::governance::POLICY_FIELD_MANAGER;
use flotilla_agent::reconcile::{Reconciled, reconcile_work_as};
use flotilla_proto::api::conditions::{WORK_APPLIED, find_condition};
use flotilla_proto::api::{ManifestWork, ManifestWorkStatus, content_hash};
use flotilla_testenv::TestEnv;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};

/// One hub's agent: its own cache and managers, the shared spoke's target.
struct HubAgent {
    managers: FieldManagers,
    cache: Arc<dyn WorkCache>,
    target: Arc<KubeApplyTarget>,
}

impl HubAgent {
    fn new(hub: &str, client: &kube::Client) -> anyhow::Result<HubAgent> {
        Ok(HubAgent {
            managers: FieldManagers::for_hub(hub)?,
            cache: Arc::new(CacheDb::temporary()?.cluster("cluster1")),
            target: Arc::new(KubeApplyTarget::new(client.clone())),
        })
    }

    fn put(&self, uid: &str, work: &ManifestWork) -> anyhow::Result<()> {
        let cached = CachedWork {
            uid: uid.into(),
            namespace: "cluster1".into(),
            name: work.metadata.name.clone().unwrap_or_default(),
            generation: 1,
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
        Ok(reconcile_work_as(&self.cache, self.target.as_ref(), &self.managers, uid).await?)
    }

    /// `(status, reason, message)` of the one manifest's Applied condition.
    fn applied(&self, uid: &str) -> anyhow::Result<(String, String, String)> {
        let record = self.cache.last_status(uid)?.context("no status recorded")?;
        let status: ManifestWorkStatus = serde_json::from_value(record.status)?;
        let manifest = status
            .resource_status
            .manifests
            .first()
            .context("no manifest status")?;
        let c = find_condition(&manifest.conditions, WORK_APPLIED).context("no Applied")?;
        Ok((c.status.clone(), c.reason.clone(), c.message.clone()))
    }
}

fn configmap_work(name: &str, data: Value) -> ManifestWork {
    serde_json::from_value(json!({
        "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
        "metadata": {"name": name, "namespace": "cluster1"},
        "spec": {"workload": {"manifests": [{
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "shared", "namespace": "default"},
            "data": data,
        }]}},
    }))
    .expect("a ManifestWork")
}

async fn data(api: &Api<ConfigMap>) -> anyhow::Result<Option<Value>> {
    Ok(api
        .get_opt("shared")
        .await?
        .map(|cm| json!(cm.data.unwrap_or_default())))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hubs_keep_their_own_keys_say_conflicts_and_delete_only_their_own() -> anyhow::Result<()>
{
    let env = TestEnv::start().await?;
    let client = env.client().await?;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let a = HubAgent::new("department", &client)?;
    let b = HubAgent::new("central-it", &client)?;

    // Someone who is no hub's agent set a key first: a hub's agent takes it, as every agent
    // always did.
    let by_hand = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "shared", "namespace": "default"}, "data": {"tier": "by-hand"}});
    api.patch(
        "shared",
        &PatchParams::apply("an-operator"),
        &Patch::Apply(&by_hand),
    )
    .await?;

    a.put(
        "work-a",
        &configmap_work(
            "a",
            json!({"department": "yes", "tier": "gold", "both": "from-a"}),
        ),
    )?;
    a.reconcile("work-a").await?;
    assert_eq!(a.applied("work-a")?.0, "True", "{:?}", a.applied("work-a"));

    b.put(
        "work-b",
        &configmap_work("b", json!({"central": "yes", "both": "from-b"})),
    )?;
    let r = b.reconcile("work-b").await?;
    assert!(!r.retry, "a conflict between hubs waits for a change");
    // Both hubs' keys, the overlapping one as the first hub applied it.
    assert_eq!(
        data(&api).await?,
        Some(json!({"department": "yes", "tier": "gold", "both": "from-a", "central": "yes"}))
    );
    let (status, reason, message) = b.applied("work-b")?;
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "ApplyConflict")
    );
    assert!(
        message.contains("hub department (flotilla-work-agent/department)")
            && message.contains(".data.both"),
        "{message}"
    );
    // A resync is no tug of war: the first hub's apply stays as it is.
    a.reconcile("work-a").await?;
    b.reconcile("work-b").await?;
    assert_eq!(data(&api).await?.unwrap()["both"], "from-a");

    // Deleting hub a's work leaves the object with hub b's keys: a's own fields go.
    a.cache.mark_deleting("work-a")?;
    let r = a.reconcile("work-a").await?;
    assert!(r.forgotten, "{r:?}");
    assert_eq!(data(&api).await?, Some(json!({"central": "yes"})));

    // Now only hub b applies it: its deletion deletes it.
    b.cache.mark_deleting("work-b")?;
    assert!(b.reconcile("work-b").await?.forgotten);
    assert_eq!(data(&api).await?, None);

    // What the policy governor writes is recorded as the hub's policy manager.
    let spoke: Arc<dyn ApplyTarget> = a.target.clone();
    let governed = PolicyWritesAs::wrap(spoke, &a.managers);
    let resource = AppliedResource {
        group: String::new(),
        version: "v1".into(),
        kind: "ConfigMap".into(),
        resource: "configmaps".into(),
        namespace: "default".into(),
        name: "enforced".into(),
    };
    let object = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "enforced", "namespace": "default"}, "data": {"k": "v"}});
    let stored = governed
        .create(&resource, &object, POLICY_FIELD_MANAGER)
        .await?;
    let managers: Vec<&str> = stored["metadata"]["managedFields"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["manager"].as_str())
        .collect();
    assert_eq!(managers, ["flotilla-policy-agent/department"]);
    Ok(())
}
