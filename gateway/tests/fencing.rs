//! Fencing the store enforces, on both backends (sled, and the kube backend on a real
//! kube-apiserver): two gateways' write paths on one store, with shard views the test moves by
//! hand. Gateway A holds a shard at epoch 1 and its write is parked at the fault point, after
//! its own fence check; the shard moves to B at epoch 2 and B writes; A is released. The store
//! refuses A's write (`stale_epoch`), A counts it, and the object ends as B wrote it: for a
//! work's status, and for A's Unknown pending over B's Available. And a report older than the
//! stored one is refused (`stale_report`) whoever writes it, and acknowledged.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use flotilla_gateway::admission::Admissions;
use flotilla_gateway::desired::DesiredState;
use flotilla_gateway::fault::HoldPoint;
use flotilla_gateway::fencing::{Fencing, WorkBases};
use flotilla_gateway::health::{HealthReport, HealthWriter};
use flotilla_gateway::mailbox::Mailbox;
use flotilla_gateway::metrics::FencedWriteCounters;
use flotilla_gateway::registry::Registry;
use flotilla_gateway::shards::{Fence, ShardDirectory, ShardView};
use flotilla_gateway::statuses::StatusWriter;
use flotilla_gateway::writes::WriteBudget;
use flotilla_proto::api::Kind;
use flotilla_proto::contract::{SHARD_LABEL, shard_label_value, shard_of};
use flotilla_proto::wire;
use flotilla_store::{KubeStore, SledStore, Store, WriteFence};
use flotilla_testenv::{TestEnv, wait_for, workspace_root};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::time::Instant;

const SHARDS: u32 = 64;
const DEADLINE: Duration = Duration::from_secs(30);

fn trace_init() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// A gateway's view holding `shards` at `epoch` (none: it holds nothing).
fn view(shards: &[u32], epoch: u32) -> Arc<ShardView> {
    let valid_until = Instant::now() + Duration::from_secs(3600);
    let fences: BTreeMap<u32, Fence> = shards
        .iter()
        .map(|s| (*s, Fence { epoch, valid_until }))
        .collect();
    Arc::new(ShardView::leased(SHARDS, fences, ShardDirectory::default()))
}

/// One gateway's side of a scenario: its name, what it counts, where its writes may be held.
struct Side {
    fencing: Fencing,
    dropped: FencedWriteCounters,
    views: watch::Sender<Arc<ShardView>>,
}

impl Side {
    fn new(name: &str, hold: Option<&Arc<HoldPoint>>, initial: Arc<ShardView>) -> Side {
        let dropped = FencedWriteCounters::default();
        let fault = hold.map(HoldPoint::point).unwrap_or_default();
        Side {
            fencing: Fencing::new(name, dropped.clone(), fault),
            dropped,
            views: watch::Sender::new(initial),
        }
    }

    fn status_writer(
        &self,
        store: &Arc<dyn Store>,
        stop: &watch::Receiver<bool>,
    ) -> Arc<StatusWriter> {
        let writer = StatusWriter::new(
            Arc::new(WriteBudget::new(1000.0, 1000)),
            4,
            self.views.subscribe(),
            self.fencing.clone(),
            WorkBases::new(),
        );
        tokio::spawn(
            writer
                .clone()
                .run(store.clone(), DesiredState::new(), stop.clone()),
        );
        writer
    }
}

fn labelled(mut object: Value, cluster: &str) -> Value {
    object["metadata"]["labels"] =
        json!({ SHARD_LABEL: shard_label_value(shard_of(cluster, SHARDS)) });
    object
}

/// Creates work `web` of `cluster` and returns its uid.
async fn create_work(store: &dyn Store, cluster: &str) -> anyhow::Result<String> {
    let work = json!({
        "apiVersion": "work.open-cluster-management.io/v1", "kind": "ManifestWork",
        "metadata": {"name": "web", "namespace": cluster},
        "spec": {"workload": {"manifests": []}},
    });
    let created = store.create(labelled(work, cluster)).await?;
    created["metadata"]["uid"]
        .as_str()
        .map(str::to_owned)
        .context("a stored work has a uid")
}

fn status(condition: &str) -> Vec<u8> {
    json!({"conditions": [{
        "type": condition, "status": "True", "reason": "R", "message": "",
        "lastTransitionTime": "2025-01-01T00:00:00Z", "observedGeneration": 1,
    }]})
    .to_string()
    .into_bytes()
}

async fn stored(
    store: &dyn Store,
    kind: Kind,
    namespace: Option<&str>,
    name: &str,
) -> anyhow::Result<Value> {
    store
        .get(kind, namespace, name)
        .await?
        .with_context(|| format!("{kind} {name} is gone"))
}

/// Waits until `mailbox` has status acks, and returns them.
async fn acks(mailbox: &Mailbox) -> anyhow::Result<Vec<(String, u64)>> {
    tokio::time::timeout(DEADLINE, mailbox.ready())
        .await
        .context("no ack")?;
    Ok(mailbox.take().status_acks)
}

/// A's status write parked after its check, the shard moved to B, B's newer status stored, A
/// released: refused as stale, not acknowledged, and the work's status is B's.
async fn a_stale_owners_status_is_refused(store: Arc<dyn Store>) -> anyhow::Result<()> {
    let cluster = "fence-status";
    let shard = shard_of(cluster, SHARDS);
    let uid = create_work(store.as_ref(), cluster).await?;
    let (_stop_tx, stop) = watch::channel(false);
    let hold = HoldPoint::new();
    let a = Side::new("gw-a", Some(&hold), view(&[shard], 1));
    let b = Side::new("gw-b", None, view(&[], 0));
    let (writer_a, writer_b) = (
        a.status_writer(&store, &stop),
        b.status_writer(&store, &stop),
    );

    // A stores a first status (its next write's basis is what this one returned).
    let reporter = Arc::new(Mailbox::default());
    writer_a
        .submit(&reporter, cluster, "web", &uid, 100, &status("Applied"))
        .await?;
    ensure!(
        acks(&reporter).await? == [(uid.clone(), 100)],
        "A's first status acked"
    );

    // A's next one passes A's check and is parked before the store call.
    hold.hold(cluster);
    let a_reporter = Arc::new(Mailbox::default());
    writer_a
        .submit(
            &a_reporter,
            cluster,
            "web",
            &uid,
            101,
            &status("Progressing"),
        )
        .await?;
    let parked = tokio::time::timeout(DEADLINE, hold.parked(cluster))
        .await
        .context("A's write never reached the fault point")?;
    ensure!(parked == format!("ManifestWork {cluster}/web"), "{parked}");

    // The shard moves to B, which stores the agent's newer report.
    a.views.send_replace(view(&[], 0));
    b.views.send_replace(view(&[shard], 2));
    let b_reporter = Arc::new(Mailbox::default());
    writer_b
        .submit(&b_reporter, cluster, "web", &uid, 102, &status("Available"))
        .await?;
    ensure!(
        acks(&b_reporter).await? == [(uid.clone(), 102)],
        "B's status acked"
    );
    let by_b = stored(store.as_ref(), Kind::ManifestWork, Some(cluster), "web").await?;

    // A goes on: the store refuses it, A counts it, the work stays as B wrote it.
    hold.release(cluster);
    let now = wait_for("A's write refused, or stored", DEADLINE, || async {
        let now = stored(store.as_ref(), Kind::ManifestWork, Some(cluster), "web").await?;
        Ok((a.dropped.count("stale_epoch") > 0 || now != by_b).then_some(now))
    })
    .await?;
    ensure!(now == by_b, "A's write landed over B's: {now}");
    ensure!(a.dropped.count("stale_epoch") == 1, "counted once");
    ensure!(
        WriteFence::of_object(&now) == Some(WriteFence::new(shard, 2, "gw-b").with_report(102)),
        "{now}"
    );
    ensure!(
        now["status"]["conditions"][0]["type"] == "Available",
        "{now}"
    );
    ensure!(
        a_reporter.take().status_acks.is_empty(),
        "a status refused as stale_epoch is not acknowledged: its agent reports it to the owner"
    );
    ensure!(writer_a.pending_len() == 0, "refused, not retried");
    ensure!(b.dropped.count("stale_epoch") == 0);
    Ok(())
}

/// A report older than the stored one is refused whoever writes it (here a gateway that took
/// the shard later, under a newer epoch), and acknowledged: something newer is stored.
async fn an_older_report_is_refused_and_acknowledged(store: Arc<dyn Store>) -> anyhow::Result<()> {
    let cluster = "fence-report";
    let shard = shard_of(cluster, SHARDS);
    let uid = create_work(store.as_ref(), cluster).await?;
    let (_stop_tx, stop) = watch::channel(false);
    let b = Side::new("gw-b", None, view(&[shard], 2));
    let c = Side::new("gw-c", None, view(&[shard], 3));
    let writer_b = b.status_writer(&store, &stop);
    let writer_c = c.status_writer(&store, &stop);
    let reporter = Arc::new(Mailbox::default());
    writer_b
        .submit(&reporter, cluster, "web", &uid, 300, &status("Available"))
        .await?;
    ensure!(acks(&reporter).await? == [(uid.clone(), 300)]);
    let by_b = stored(store.as_ref(), Kind::ManifestWork, Some(cluster), "web").await?;

    let late = Arc::new(Mailbox::default());
    writer_c
        .submit(&late, cluster, "web", &uid, 250, &status("Applied"))
        .await?;
    ensure!(
        acks(&late).await? == [(uid.clone(), 250)],
        "a status refused as stale_report is acknowledged"
    );
    let now = stored(store.as_ref(), Kind::ManifestWork, Some(cluster), "web").await?;
    ensure!(now == by_b, "the older report changed the work: {now}");
    ensure!(c.dropped.count("stale_report") == 1, "counted");
    ensure!(c.dropped.count("stale_epoch") == 0);
    Ok(())
}

/// A marks the cluster Unknown after its grace period, parked after its check; the shard moves
/// to B, whose session makes it Available; A's Unknown lands after: refused, and the cluster
/// stays Available and untainted.
async fn a_stale_owners_unknown_never_lands_over_available(
    store: Arc<dyn Store>,
) -> anyhow::Result<()> {
    let cluster = "fence-health";
    let shard = shard_of(cluster, SHARDS);
    let mc = json!({
        "apiVersion": "cluster.open-cluster-management.io/v1", "kind": "ManagedCluster",
        "metadata": {"name": cluster}, "spec": {"hubAcceptsClient": true},
    });
    store.create(labelled(mc, cluster)).await?;
    let (_stop_tx, stop) = watch::channel(false);
    let hold = HoldPoint::new();
    let a = Side::new("gw-a", Some(&hold), view(&[shard], 1));
    let b = Side::new("gw-b", None, view(&[], 0));
    let writer = |side: &Side, grace: Duration| {
        let admissions = Admissions::new();
        tokio::spawn(admissions.clone().run(
            store.clone(),
            Arc::new(Registry::default()),
            side.views.subscribe(),
            stop.clone(),
        ));
        let (writer, reports) = HealthWriter::new(
            store.clone(),
            grace,
            admissions,
            side.views.subscribe(),
            side.fencing.clone(),
        );
        tokio::spawn(writer.run(stop.clone()));
        reports
    };
    let connected = |session: &str, version: &str| HealthReport::Connected {
        cluster: cluster.into(),
        session: session.into(),
        hello: Box::new(wire::Hello {
            kubernetes_version: version.into(),
            ..Default::default()
        }),
    };
    let available = |mc: &Value| {
        mc["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "ManagedClusterConditionAvailable" && c["status"] == "True")
    };
    let reports_a = writer(&a, Duration::from_millis(200));
    let reports_b = writer(&b, Duration::from_secs(3600));

    reports_a.send(connected("a-1", "v1.36.3")).await;
    wait_for("A records the cluster Available", DEADLINE, || async {
        let mc = stored(store.as_ref(), Kind::ManagedCluster, None, cluster).await?;
        Ok(available(&mc).then_some(()))
    })
    .await?;

    // The session goes; past the grace period A's Unknown is parked after its check.
    hold.hold(cluster);
    reports_a
        .send(HealthReport::Disconnected {
            cluster: cluster.into(),
            session: "a-1".into(),
        })
        .await;
    let parked = tokio::time::timeout(DEADLINE, hold.parked(cluster))
        .await
        .context("A's Unknown never reached the fault point")?;
    ensure!(parked == format!("ManagedCluster {cluster}"), "{parked}");

    // B takes the shard and the agent's new session is B's: Available, under epoch 2.
    a.views.send_replace(view(&[], 0));
    b.views.send_replace(view(&[shard], 2));
    reports_b.send(connected("b-1", "v1.37.0")).await;
    let by_b = wait_for("B records the cluster Available", DEADLINE, || async {
        let mc = stored(store.as_ref(), Kind::ManagedCluster, None, cluster).await?;
        let by_b = WriteFence::of_object(&mc).is_some_and(|f| f.gateway == "gw-b" && f.epoch == 2);
        Ok((by_b && available(&mc)).then_some(mc))
    })
    .await?;

    hold.release(cluster);
    let now = wait_for("A's Unknown refused, or stored", DEADLINE, || async {
        let now = stored(store.as_ref(), Kind::ManagedCluster, None, cluster).await?;
        Ok((a.dropped.count("stale_epoch") > 0 || now != by_b).then_some(now))
    })
    .await?;
    ensure!(now == by_b, "A's Unknown landed over B's Available: {now}");
    ensure!(a.dropped.count("stale_epoch") == 1, "counted once");
    ensure!(available(&now), "{now}");
    ensure!(
        now["spec"]["taints"].as_array().is_none_or(Vec::is_empty),
        "tainted unreachable: {now}"
    );
    Ok(())
}

/// Runs every scenario on `store` (each on its own objects) and fails naming each that failed.
async fn all(store: Arc<dyn Store>) -> anyhow::Result<()> {
    let failures: Vec<String> = [
        (
            "a_stale_owners_status_is_refused",
            a_stale_owners_status_is_refused(store.clone()).await,
        ),
        (
            "an_older_report_is_refused_and_acknowledged",
            an_older_report_is_refused_and_acknowledged(store.clone()).await,
        ),
        (
            "a_stale_owners_unknown_never_lands_over_available",
            a_stale_owners_unknown_never_lands_over_available(store).await,
        ),
    ]
    .into_iter()
    .filter_map(|(name, result)| result.err().map(|e| format!("{name}: {e:#}")))
    .collect();
    ensure!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sled_store_refuses_a_stale_owners_writes() -> anyhow::Result<()> {
    trace_init();
    let dir = tempfile::tempdir()?;
    all(Arc::new(SledStore::open(dir.path())?)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kube_store_refuses_a_stale_owners_writes() -> anyhow::Result<()> {
    trace_init();
    let env = TestEnv::start().await?;
    env.install_crds(&workspace_root().join("deploy/crds"))
        .await?;
    all(Arc::new(KubeStore::new(env.client().await?))).await
}
