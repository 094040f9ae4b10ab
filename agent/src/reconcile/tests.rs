use super::*;
use crate::apply::MemoryCluster;
use crate::cache::CacheDb;
use flotilla_proto::api::conditions::{WORK_APPLIED, is_condition_true};
use flotilla_proto::session::NoJitter;
use serde_json::{Value, json};

fn cache() -> Arc<dyn WorkCache> {
    Arc::new(CacheDb::temporary().unwrap().cluster("store-7"))
}

fn configmap(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": "default"}, "data": {"k": name}})
}

fn cm_id(name: &str) -> AppliedResource {
    AppliedResource {
        group: String::new(),
        version: "v1".into(),
        kind: "ConfigMap".into(),
        resource: "configmaps".into(),
        namespace: "default".into(),
        name: name.into(),
    }
}

async fn put(
    cache: &Arc<dyn WorkCache>,
    uid: &str,
    generation: i64,
    manifests: Vec<Value>,
    delete_option: Value,
) {
    let mw = json!({
        "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
        "metadata": {"name": format!("w-{uid}"), "namespace": "store-7", "uid": uid, "generation": generation},
        "spec": {"workload": {"manifests": manifests}, "deleteOption": delete_option},
    });
    let work = CachedWork {
        uid: uid.into(),
        namespace: "store-7".into(),
        name: format!("w-{uid}"),
        generation,
        content_hash: format!("h{generation}"),
        refused: None,
        deleting: false,
        policy: false,
    };
    cache
        .put_work(&work, Some(&serde_json::to_vec(&mw).unwrap()))
        .unwrap();
}

fn status(cache: &Arc<dyn WorkCache>, uid: &str) -> ManifestWorkStatus {
    serde_json::from_value(cache.last_status(uid).unwrap().unwrap().status).unwrap()
}

#[tokio::test]
async fn an_unchanged_work_produces_no_new_status() {
    let cache = cache();
    let cluster = MemoryCluster::new();
    put(&cache, "a", 1, vec![configmap("x")], Value::Null).await;
    let first = reconcile_work(&cache, &cluster, "a").await.unwrap();
    let seq = cache.last_status("a").unwrap().map(|s| s.seq);
    assert!(seq.is_some());
    assert_eq!(first.new_status, seq);
    assert!(is_condition_true(
        &status(&cache, "a").conditions,
        WORK_APPLIED
    ));
    let again = reconcile_work(&cache, &cluster, "a").await.unwrap();
    // What it applied is reported each time (drift is noticed from it); nothing else.
    assert!(again.applied.is_some());
    let again = Reconciled {
        applied: None,
        ..again
    };
    assert_eq!(again, Reconciled::default(), "idle: no status traffic");
    // Drift is repaired and, the status being the same, still says nothing new.
    cluster.remove(&cm_id("x")).await;
    reconcile_work(&cache, &cluster, "a").await.unwrap();
    assert!(cluster.get(&cm_id("x")).await.is_some());
}

#[tokio::test]
async fn removed_manifests_are_deleted_unless_another_work_applies_them() {
    let cache = cache();
    let cluster = MemoryCluster::new();
    put(
        &cache,
        "a",
        1,
        vec![configmap("x"), configmap("shared"), configmap("y")],
        Value::Null,
    )
    .await;
    put(&cache, "b", 1, vec![configmap("shared")], Value::Null).await;
    let a1 = reconcile_work(&cache, &cluster, "a").await.unwrap();
    reconcile_work(&cache, &cluster, "b").await.unwrap();
    put(&cache, "a", 2, vec![configmap("x")], Value::Null).await;
    let r = reconcile_work(&cache, &cluster, "a").await.unwrap();
    assert_eq!(r.new_status, a1.new_status.map(|seq| seq + 1));
    assert_eq!(cluster.objects().await, vec![cm_id("shared"), cm_id("x")]);
    assert_eq!(cache.ledger("a").unwrap(), vec![cm_id("x")]);
}

async fn delete_with(option: Value) -> Vec<AppliedResource> {
    let cache = cache();
    let cluster = MemoryCluster::new();
    put(&cache, "a", 1, vec![configmap("x"), configmap("y")], option).await;
    reconcile_work(&cache, &cluster, "a").await.unwrap();
    cache.mark_deleting("a").unwrap();
    let r = reconcile_work(&cache, &cluster, "a").await.unwrap();
    assert!(r.forgotten);
    assert_eq!(cache.work("a").unwrap(), None);
    assert_eq!(cache.last_status("a").unwrap(), None);
    assert_eq!(cache.pending_releases().unwrap(), ["a"], "the hub is told");
    cluster.objects().await
}

#[tokio::test]
async fn deleting_a_work_honours_its_delete_option() {
    assert_eq!(delete_with(Value::Null).await, vec![]);
    assert_eq!(
        delete_with(json!({"propagationPolicy": "Foreground"})).await,
        vec![]
    );
    assert_eq!(
        delete_with(json!({"propagationPolicy": "Orphan"})).await,
        vec![cm_id("x"), cm_id("y")]
    );
    let selective = json!({"propagationPolicy": "SelectivelyOrphan", "selectivelyOrphans": {"orphaningRules": [
        {"group": "", "resource": "configmaps", "namespace": "default", "name": "y"}
    ]}});
    assert_eq!(delete_with(selective).await, vec![cm_id("y")]);
}

#[tokio::test]
async fn an_unreachable_spoke_keeps_the_tombstone_until_the_deletes_succeed() {
    let cache = cache();
    let cluster = MemoryCluster::new();
    put(&cache, "a", 1, vec![configmap("x")], Value::Null).await;
    reconcile_work(&cache, &cluster, "a").await.unwrap();
    cache.mark_deleting("a").unwrap();
    cluster.set_down(true).await;
    let r = reconcile_work(&cache, &cluster, "a").await.unwrap();
    assert!(r.retry && !r.forgotten);
    assert!(cache.work("a").unwrap().is_some());
    assert!(
        cache.pending_releases().unwrap().is_empty(),
        "not released while its object may still be there"
    );
    assert_eq!(cache.releasing().unwrap(), ["a"]);
    cluster.set_down(false).await;
    assert!(
        reconcile_work(&cache, &cluster, "a")
            .await
            .unwrap()
            .forgotten
    );
    assert!(cluster.objects().await.is_empty());
}

#[tokio::test]
async fn a_refused_work_gets_a_degraded_status_and_no_retry() {
    let cache = cache();
    let cluster = MemoryCluster::new();
    let work = CachedWork {
        uid: "big".into(),
        namespace: "store-7".into(),
        name: "big".into(),
        generation: 2,
        content_hash: "h".into(),
        refused: Some("the ManifestWork is 3 MiB".into()),
        deleting: false,
        policy: false,
    };
    cache.put_work(&work, None).unwrap();
    let r = reconcile_work(&cache, &cluster, "big").await.unwrap();
    let seq = cache.last_status("big").unwrap().map(|s| s.seq);
    assert!(seq.is_some());
    assert_eq!((r.new_status, r.retry), (seq, false));
    let status = status(&cache, "big");
    assert!(is_condition_true(&status.conditions, "Degraded"));
}

#[test]
fn retries_back_off_up_to_the_resync_interval() {
    let (reconciler, _) = Reconciler::new(
        cache(),
        Arc::new(MemoryCluster::new()),
        ReconcilerConfig {
            resync_interval: Duration::from_secs(60),
            concurrency: 1,
            retry_initial: Duration::from_secs(2),
            ..ReconcilerConfig::default()
        },
        Arc::new(Notify::new()),
        Box::new(NoJitter),
    );
    let delays: Vec<u64> = (1..=7)
        .map(|n| reconciler.retry_delay(n).as_secs())
        .collect();
    assert_eq!(delays, [2, 4, 8, 16, 32, 60, 60]);
}

#[tokio::test(start_paused = true)]
async fn the_task_reconciles_the_cache_at_start_and_drift_at_each_resync() {
    let cache = cache();
    let cluster = Arc::new(MemoryCluster::new());
    put(&cache, "a", 1, vec![configmap("x")], Value::Null).await;
    let outbox = Arc::new(Notify::new());
    let (reconciler, handle) = Reconciler::new(
        Arc::clone(&cache),
        cluster.clone(),
        ReconcilerConfig {
            resync_interval: Duration::from_secs(100),
            ..ReconcilerConfig::default()
        },
        Arc::clone(&outbox),
        Box::new(NoJitter),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(reconciler.run(async {
        let _ = stopped.await;
    }));
    // Offline start: applied with no hub and no call from the driver.
    outbox.notified().await;
    assert!(cluster.get(&cm_id("x")).await.is_some());

    // A change through the handle is applied without waiting for the resync.
    put(&cache, "a", 2, vec![configmap("y")], Value::Null).await;
    handle.work_changed("a").await;
    outbox.notified().await;
    assert_eq!(cluster.objects().await, vec![cm_id("y")]);

    // Drift: removed by hand, back after the resync interval (90 s with no jitter).
    cluster.remove(&cm_id("y")).await;
    tokio::time::sleep(Duration::from_secs(89)).await;
    assert!(cluster.get(&cm_id("y")).await.is_none());
    let deadline = Instant::now() + Duration::from_secs(5);
    while cluster.get(&cm_id("y")).await.is_none() {
        assert!(
            Instant::now() < deadline,
            "drift not repaired by the resync"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop.send(());
    task.await.unwrap();
}

/// `/readyz` of the agent: the first-pass flag goes up only once every work the cache held
/// at start is on the spoke with its status recorded, and at once for an empty cache.
#[tokio::test]
async fn ready_once_the_works_cached_at_start_are_applied() {
    for works in [0, 3] {
        let cache = cache();
        let cluster = Arc::new(MemoryCluster::new());
        for n in 0..works {
            let uid = format!("w{n}");
            put(
                &cache,
                &uid,
                1,
                vec![configmap(&format!("cm{n}"))],
                Value::Null,
            )
            .await;
        }
        let (reconciler, _handle) = Reconciler::new(
            Arc::clone(&cache),
            cluster.clone(),
            ReconcilerConfig {
                concurrency: 1,
                ..ReconcilerConfig::default()
            },
            Arc::new(Notify::new()),
            Box::new(NoJitter),
        );
        let ready = ReadyFlag::new("the first pass");
        let reconciler = reconciler.with_first_pass(ready.clone());
        assert!(!ready.is_ready());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(reconciler.run(async {
            let _ = stopped.await;
        }));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ready.is_ready() {
            assert!(Instant::now() < deadline, "never ready with {works} works");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for n in 0..works {
            assert!(
                cluster.get(&cm_id(&format!("cm{n}"))).await.is_some(),
                "cm{n} not applied"
            );
            assert!(
                cache.last_status(&format!("w{n}")).unwrap().is_some(),
                "w{n} has no status"
            );
        }
        let _ = stop.send(());
        task.await.unwrap();
    }
}
