//! The test environment against itself: real etcd and kube-apiserver processes, real kubectl.

use std::path::{Path, PathBuf};
use std::time::Duration;

use flotilla_testenv::{ADMIN_USER, TestEnv};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
    WatchEvent, WatchParams,
};
use serde_json::json;
use tokio::time::Instant;

/// The CRDs the ManifestWork test installs. A stand-in with the real group, version and kind
/// until the generated OCM CRDs land; then this becomes
/// `flotilla_testenv::workspace_root().join("deploy/crds")`.
fn crd_dir() -> PathBuf {
    PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("run by cargo test"))
        .join("tests/fixtures/crds")
}

fn trace_init() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "flotilla_testenv=debug,info".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// Whether a process with this pid exists (zombies included: they keep their /proc entry).
fn process_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

fn process_cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|bytes| String::from_utf8_lossy(&bytes).replace('\0', " "))
        .unwrap_or_default()
}

fn namespace(name: &str) -> Namespace {
    let mut ns = Namespace::default();
    ns.metadata.name = Some(name.to_owned());
    ns
}

#[tokio::test]
async fn starts_real_apiserver_and_cleans_up() -> anyhow::Result<()> {
    trace_init();
    let started = Instant::now();
    let env = TestEnv::start().await?;
    tracing::info!(elapsed = ?started.elapsed(), "TestEnv::start returned");

    let (apiserver, etcd, workdir) = (
        env.apiserver_pid(),
        env.etcd_pid(),
        env.workdir().to_owned(),
    );
    assert!(
        process_cmdline(apiserver).contains("kube-apiserver"),
        "pid {apiserver} is the apiserver"
    );
    assert!(process_cmdline(etcd).contains("etcd"), "pid {etcd} is etcd");
    assert!(
        env.server_url().starts_with("https://127.0.0.1:"),
        "{}",
        env.server_url()
    );

    let namespaces: Api<Namespace> = Api::all(env.client().await?);
    let names: Vec<String> = namespaces
        .list(&ListParams::default())
        .await?
        .into_iter()
        .filter_map(|ns| ns.metadata.name)
        .collect();
    assert!(
        names.iter().any(|n| n == "default"),
        "namespaces: {names:?}"
    );
    let metrics = env.metrics().await?;
    assert!(
        metrics.contains("apiserver_request_total"),
        "metrics lack apiserver_request_total"
    );

    let stopping = Instant::now();
    drop(env);
    tracing::info!(elapsed = ?stopping.elapsed(), "TestEnv dropped");
    // Drop reaps both children, so their /proc entries are gone by now; the deadline only
    // guards against a slow /proc update.
    let deadline = Instant::now() + Duration::from_secs(5);
    while process_exists(apiserver) || process_exists(etcd) {
        assert!(
            Instant::now() < deadline,
            "apiserver {apiserver} or etcd {etcd} still exists after drop"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!workdir.exists(), "{} not removed", workdir.display());
    Ok(())
}

/// A failing test unwinds through its `TestEnv`, which must still stop both servers.
#[tokio::test]
async fn a_panicking_test_still_cleans_up() -> anyhow::Result<()> {
    trace_init();
    let (pids_tx, pids_rx) = std::sync::mpsc::channel();
    // The panicking "test" runs on its own thread and runtime, as libtest would run it.
    let failing_test = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let env = TestEnv::start().await.expect("start");
            pids_tx
                .send((
                    env.apiserver_pid(),
                    env.etcd_pid(),
                    env.workdir().to_owned(),
                ))
                .expect("send pids");
            panic!("deliberate failure while the environment runs (expected in this test)");
        })
    });
    let outcome = tokio::task::spawn_blocking(move || failing_test.join()).await?;
    assert!(outcome.is_err(), "the inner test should have panicked");

    let (apiserver, etcd, workdir) = pids_rx.recv()?;
    assert!(
        !process_exists(apiserver),
        "apiserver {apiserver} survived the panic"
    );
    assert!(!process_exists(etcd), "etcd {etcd} survived the panic");
    assert!(
        !workdir.exists(),
        "{} survived the panic",
        workdir.display()
    );
    Ok(())
}

#[tokio::test]
async fn two_apiservers_side_by_side() -> anyhow::Result<()> {
    trace_init();
    let (a, b) = tokio::try_join!(TestEnv::start(), TestEnv::start())?;
    assert_ne!(a.server_url(), b.server_url());

    let in_a: Api<Namespace> = Api::all(a.client().await?);
    let in_b: Api<Namespace> = Api::all(b.client().await?);
    in_a.create(&PostParams::default(), &namespace("only-in-a"))
        .await?;

    assert!(in_a.get_opt("only-in-a").await?.is_some());
    assert!(
        in_b.get_opt("only-in-a").await?.is_none(),
        "b sees a's namespace"
    );
    Ok(())
}

#[tokio::test]
async fn the_apiserver_restarts_on_its_port_with_its_data() -> anyhow::Result<()> {
    trace_init();
    let mut env = TestEnv::start().await?;
    let (old_pid, etcd) = (env.apiserver_pid(), env.etcd_pid());
    let client = env.client().await?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(&PostParams::default(), &namespace("before-restart"))
        .await?;

    env.stop_apiserver();
    assert!(
        !process_exists(old_pid),
        "the old kube-apiserver is still there"
    );
    assert!(
        namespaces.get_opt("before-restart").await.is_err(),
        "a request was answered with the apiserver stopped"
    );

    env.start_apiserver().await?;
    assert_ne!(env.apiserver_pid(), old_pid);
    assert_eq!(env.etcd_pid(), etcd, "etcd kept running");
    // The client made before the restart, on the same URL, finds the data kept in etcd.
    assert!(namespaces.get_opt("before-restart").await?.is_some());
    Ok(())
}

#[tokio::test]
async fn kubectl_talks_to_it() -> anyhow::Result<()> {
    trace_init();
    let env = TestEnv::start().await?;
    let namespaces = kubectl(&env, &["get", "namespaces", "-o", "name"]).await?;
    assert!(
        namespaces.lines().any(|l| l == "namespace/default"),
        "{namespaces}"
    );

    let created = kubectl(&env, &["create", "namespace", "x"]).await?;
    assert_eq!(created.trim(), "namespace/x created");
    let api: Api<Namespace> = Api::all(env.client().await?);
    assert!(
        api.get_opt("x").await?.is_some(),
        "kube client does not see kubectl's namespace"
    );

    // The identity comes from the client certificate in the kubeconfig.
    let whoami = kubectl(
        &env,
        &[
            "auth",
            "whoami",
            "-o",
            "jsonpath={.status.userInfo.username}",
        ],
    )
    .await?;
    assert_eq!(whoami.trim(), ADMIN_USER);
    Ok(())
}

/// Runs real kubectl against `env` and returns its stdout; fails with its stderr.
async fn kubectl(env: &TestEnv, args: &[&str]) -> anyhow::Result<String> {
    let out = tokio::process::Command::from(env.kubectl())
        .args(args)
        .output()
        .await?;
    anyhow::ensure!(
        out.status.success(),
        "kubectl {args:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test]
async fn crd_install_create_get_watch() -> anyhow::Result<()> {
    trace_init();
    let env = TestEnv::start().await?;
    env.install_crds(&crd_dir()).await?;
    let client = env.client().await?;

    let ns = "cluster-a";
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace(ns))
        .await?;
    let gvk = GroupVersionKind::gvk("work.open-cluster-management.io", "v1", "ManifestWork");
    let resource = ApiResource::from_gvk_with_plural(&gvk, "manifestworks");
    let works: Api<DynamicObject> = Api::namespaced_with(client, ns, &resource);

    // Watch from the list's resourceVersion, so the stream sees exactly what happens next.
    let version = works
        .list_metadata(&ListParams::default())
        .await?
        .metadata
        .resource_version
        .unwrap_or_default();
    let mut events = works
        .watch(&WatchParams::default().timeout(60), &version)
        .await?
        .boxed();

    let spec = json!({
        "workload": { "manifests": [{
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": { "name": "settings", "namespace": "store" },
            "data": { "greeting": "hello" },
        }]},
    });
    let work = DynamicObject::new("baseline", &resource).data(json!({ "spec": spec }));
    works.create(&PostParams::default(), &work).await?;

    let fetched = works.get("baseline").await?;
    assert_eq!(fetched.data["spec"], spec);

    let added = next_event(&mut events).await?;
    let WatchEvent::Added(added) = added else {
        panic!("expected ADDED, got {added:?}");
    };
    assert_eq!(added.metadata.name.as_deref(), Some("baseline"));

    // Status goes through the status subresource, as the agent will write it.
    let status = json!({ "conditions": [{ "type": "Applied", "status": "True" }] });
    works
        .patch_status(
            "baseline",
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await?;
    let modified = next_event(&mut events).await?;
    let WatchEvent::Modified(modified) = modified else {
        panic!("expected MODIFIED, got {modified:?}");
    };
    assert_eq!(modified.data["status"], status);
    assert_eq!(
        modified.data["spec"], spec,
        "a status write must not touch spec"
    );
    Ok(())
}

/// The next non-bookmark watch event, or an error after a deadline.
async fn next_event(
    events: &mut (impl futures::Stream<Item = kube::Result<WatchEvent<DynamicObject>>> + Unpin),
) -> anyhow::Result<WatchEvent<DynamicObject>> {
    let next = async {
        loop {
            match events.try_next().await? {
                Some(WatchEvent::Bookmark(_)) => continue,
                Some(event) => return anyhow::Ok(event),
                None => anyhow::bail!("watch ended"),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), next)
        .await
        .map_err(|_| anyhow::anyhow!("no watch event within 10 s"))?
}
