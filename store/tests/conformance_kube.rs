//! The conformance suite on the kube backend, against a real kube-apiserver with flotilla's CRDs
//! (deploy/crds) installed, plus what only the kube backend does: re-opening watches the
//! apiserver closes, and mapping its 410 to `Gone`.
//!
//! One apiserver for the whole file (each check uses its own namespaces and names), started and
//! dropped inside the test so its processes stop with it.

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use flotilla_proto::api::Kind;
use flotilla_store::conformance::{self, manifest_work};
use flotilla_store::{KubeStore, Revision, Store, StoreError, WatchEvent};
use flotilla_testenv::{TestEnv, workspace_root};
use futures::StreamExt;
use tokio::time::Instant;

const DEADLINE: Duration = Duration::from_secs(30);

fn trace_init() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

async fn start() -> anyhow::Result<TestEnv> {
    let crds = workspace_root().join("deploy/crds");
    let has_crds = std::fs::read_dir(&crds)
        .with_context(|| format!("reading {}", crds.display()))?
        .filter_map(Result::ok)
        .any(|e| e.path().extension().is_some_and(|x| x == "yaml"));
    ensure!(
        has_crds,
        "no CRDs in {}: generate them with FLOTILLA_UPDATE_CRDS=1 cargo test -p flotilla-proto --test api_crds",
        crds.display()
    );
    let env = TestEnv::start().await?;
    env.install_crds(&crds).await?;
    Ok(env)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_backend_conforms() -> anyhow::Result<()> {
    trace_init();
    let env = start().await?;
    let store = KubeStore::new(env.client().await?);
    conformance::run_all(&store, "kube").await?;

    watch_reopens_after_the_apiserver_closes_it(
        KubeStore::new(env.client().await?).with_watch_timeout(1),
    )
    .await
    .context("watch_reopens_after_the_apiserver_closes_it")?;
    watch_from_a_compacted_revision_is_gone(&store)
        .await
        .context("watch_from_a_compacted_revision_is_gone")?;
    Ok(())
}

/// A watch outlives the apiserver's watch timeout and still sees later changes, with nothing
/// repeated.
async fn watch_reopens_after_the_apiserver_closes_it(store: KubeStore) -> anyhow::Result<()> {
    let ns = "kube-reopen";
    store.create(manifest_work(ns, "before", "v1")).await?;
    let mut watch = store.watch(Kind::ManifestWork, Some(ns), None).await?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let pump = tokio::spawn(async move {
        while let Some(event) = watch.next().await {
            if tx.send(event).is_err() {
                break;
            }
        }
    });
    let first = tokio::time::timeout(DEADLINE, rx.recv())
        .await?
        .context("stream ended")??;
    ensure!(
        matches!(&first, WatchEvent::Added(o) if flotilla_store::name_of(o) == "before"),
        "{first:?}"
    );

    // Wait (bounded) until the 1 s watch has been closed and reopened twice.
    let deadline = Instant::now() + DEADLINE;
    while store.watch_restarts() < 2 {
        if Instant::now() > deadline {
            bail!(
                "the watch was reopened {} times in {DEADLINE:?}, want 2",
                store.watch_restarts()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    store.create(manifest_work(ns, "after", "v1")).await?;
    let next = tokio::time::timeout(DEADLINE, rx.recv())
        .await?
        .context("stream ended")??;
    ensure!(
        matches!(&next, WatchEvent::Added(o) if flotilla_store::name_of(o) == "after"),
        "after reopening, expected Added {ns}/after, got {next:?}"
    );
    pump.abort();
    Ok(())
}

/// A revision older than the apiserver's watch history gives Gone (kube's 410), so the caller
/// knows to relist.
async fn watch_from_a_compacted_revision_is_gone(store: &KubeStore) -> anyhow::Result<()> {
    let result: Result<(), StoreError> = match store
        .watch(Kind::ManifestWork, None, Some(Revision::new("1")))
        .await
    {
        Err(e) => Err(e),
        Ok(mut stream) => match tokio::time::timeout(DEADLINE, stream.next()).await? {
            Some(Err(e)) => Err(e),
            other => bail!("watch from revision 1: expected Gone, got {other:?}"),
        },
    };
    match result {
        Err(StoreError::Gone { from }) => {
            ensure!(from.as_str() == "1", "Gone names revision {from}, want 1");
            Ok(())
        }
        other => bail!("watch from revision 1: expected Gone, got {other:?}"),
    }
}
