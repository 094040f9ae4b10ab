//! What a kubectl user meets at the edges of the proxy front, with the real kubectl on both
//! carriers: the per-user limit and the agent's `--max-tunnels` answer 429 with a message naming
//! the limit (kubectl shows it after its own retries) while everyone else is served and the
//! refused user is served again once their stream ends; and `flotilla kubeconfig --cluster` /
//! `--all` write contexts that reach each cluster, and only it.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use flotilla_e2e::proxy::{hub_with_proxy, kubectl, kubectl_ok};
use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{on_both_carriers, wait_for};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio::io::{AsyncBufReadExt as _, BufReader};

const RULES: &str = r#"
rules:
  - name: ops-everywhere
    groups: [ops]
    clusters: {selector: {}}
    access: full
"#;

/// How long a refused user may wait for their permit back after their stream ended.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(30);

/// Group `ops` may read namespaces on the spoke (the hub's users act as themselves there).
async fn ops_reads_namespaces(client: kube::Client) -> anyhow::Result<()> {
    let pp = PostParams::default();
    Api::<ClusterRole>::all(client.clone())
        .create(&pp, &serde_json::from_value(json!({
            "metadata": {"name": "ops-namespaces"},
            "rules": [{"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]}],
        }))?)
        .await?;
    Api::<ClusterRoleBinding>::all(client)
        .create(&pp, &serde_json::from_value(json!({
            "metadata": {"name": "ops-namespaces"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "ops-namespaces"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "ops"}],
        }))?)
        .await?;
    Ok(())
}

/// A watch of namespaces on `cluster` through `kubeconfig`, one request held open: returned once
/// it has shown its first event, so the request is in flight (and holds its permits) from then
/// on. (`get --raw` takes the whole path: it replaces the kubeconfig server's `/clusters/NAME`.)
async fn held_watch(kubeconfig: &Path, cluster: &str) -> anyhow::Result<tokio::process::Child> {
    let mut watch = tokio::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args([
            "get",
            "--raw",
            &format!("/clusters/{cluster}/api/v1/namespaces?watch=1"),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(watch.stdout.take().expect("piped")).lines();
    let first = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .map_err(|_| anyhow::anyhow!("the watch showed no event within 60 s"))??;
    anyhow::ensure!(
        first.as_deref().is_some_and(|l| l.contains("ADDED")),
        "the watch's first line: {first:?}"
    );
    // The rest of the stream must not fill the pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(watch)
}

/// `kubectl get namespaces` through `kubeconfig`, discovery cached in `cache`, is refused with
/// 429 and `message` (after kubectl's own retries, which honour the Retry-After).
async fn refused_with(kubeconfig: &Path, cache: &Path, message: &str) -> anyhow::Result<()> {
    let cache = format!("--cache-dir={}", cache.display());
    let out = kubectl(kubeconfig, &[&cache, "get", "namespaces"]).await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(
        !out.status.success(),
        "not refused: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    anyhow::ensure!(
        stderr.contains("(TooManyRequests)") && stderr.contains(message),
        "kubectl said: {stderr}"
    );
    Ok(())
}

/// `kubectl get namespaces` through `kubeconfig` is served, once the refusal's cause is gone.
async fn served_again(kubeconfig: &Path) -> anyhow::Result<()> {
    wait_for("kubectl to be served again", RELEASE_TIMEOUT, || async {
        let out = kubectl(kubeconfig, &["get", "namespaces", "--request-timeout=10s"]).await?;
        Ok(out.status.success().then_some(()))
    })
    .await
}

on_both_carriers! {
    /// `--proxy-max-per-user 1`: alice's second request while her watch is open gets 429
    /// naming her and the flag, shown by kubectl even on its first run (the discovery it does
    /// first is not counted, so the refusal lands on a request whose message kubectl prints);
    /// bob is served meanwhile; alice is served once her watch ends.
    async fn the_per_user_limit_refuses_only_that_user() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let hub = hub_with_proxy(dir.path(), RULES, "", &["--proxy-max-per-user=1"]).await?;
        let spoke = Spoke::start(dir.path(), &hub, "store-1").await?;
        let _agent = spoke.start_agent(dir.path(), &hub, &[])?;
        hub.wait_available("store-1").await?;
        ops_reads_namespaces(spoke.env.client().await?).await?;
        let alice = hub.create_user(dir.path(), "alice", &["ops"])?;
        let bob = hub.create_user(dir.path(), "bob", &["ops"])?;

        let mut watch = held_watch(&alice, "store-1").await?;
        refused_with(
            &alice,
            &dir.path().join("alice-cold-cache"),
            "user alice has 1 requests in flight through the hub already (--proxy-max-per-user)",
        )
        .await?;
        kubectl_ok(&bob, &["get", "namespace", "default"]).await?;
        watch.kill().await?;
        served_again(&alice).await
    }
}

on_both_carriers! {
    /// An agent with `--max-tunnels 1`: while alice's watch holds its one tunnel, bob's request
    /// gets the agent's 429 naming the cluster and the flag; he is served once the watch ends.
    /// Bob's kubectl has its discovery cached, as a day-to-day user's has: discovery needs a
    /// tunnel too, and kubectl keeps no message of a 429 there.
    async fn the_agents_tunnel_limit_answers_429_naming_it() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let hub = hub_with_proxy(dir.path(), RULES, "", &[]).await?;
        let spoke = Spoke::start(dir.path(), &hub, "store-1").await?;
        let _agent = spoke.start_agent(dir.path(), &hub, &["--max-tunnels=1"])?;
        hub.wait_available("store-1").await?;
        ops_reads_namespaces(spoke.env.client().await?).await?;
        let alice = hub.create_user(dir.path(), "alice", &["ops"])?;
        let bob = hub.create_user(dir.path(), "bob", &["ops"])?;

        let bobs_cache = dir.path().join("bob-cache");
        let warm = format!("--cache-dir={}", bobs_cache.display());
        kubectl_ok(&bob, &[&warm, "get", "namespaces"]).await?;
        let mut watch = held_watch(&alice, "store-1").await?;
        refused_with(
            &bob,
            &bobs_cache,
            "the agent of cluster store-1 serves 1 tunnels already (its --max-tunnels)",
        )
        .await?;
        watch.kill().await?;
        served_again(&bob).await
    }
}

on_both_carriers! {
    /// `flotilla kubeconfig --cluster store-2` and `--all`: each context reaches its own
    /// cluster (a namespace only store-2 has is found through store-2's context and not through
    /// store-1's), and `--all` has a context for every cluster.
    async fn kubeconfig_contexts_reach_their_own_cluster() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let hub = hub_with_proxy(dir.path(), RULES, "", &[]).await?;
        let mut agents = Vec::new();
        let mut spokes = Vec::new();
        for name in ["store-1", "store-2"] {
            let spoke = Spoke::start(dir.path(), &hub, name).await?;
            agents.push(spoke.start_agent(dir.path(), &hub, &[])?);
            hub.wait_available(name).await?;
            ops_reads_namespaces(spoke.env.client().await?).await?;
            spokes.push(spoke);
        }
        Api::<Namespace>::all(spokes[1].env.client().await?)
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": "only-on-store-2"}}))?,
            )
            .await?;
        hub.create_user(dir.path(), "alice", &["ops"])?;

        let one = dir.path().join("store-2.kubeconfig");
        let out = hub.cli(&[
            "kubeconfig", "--cluster", "store-2", "--user", "alice", "-o", &one.display().to_string(),
        ])?;
        anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        kubectl_ok(&one, &["get", "namespace", "only-on-store-2"]).await?;

        let out = hub.cli(&["kubeconfig", "--all", "--user", "alice"])?;
        anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let all = dir.path().join("all.kubeconfig");
        std::fs::write(&all, &out.stdout)?;
        let contexts = kubectl_ok(&all, &["config", "get-contexts", "-o", "name"]).await?;
        let mut contexts: Vec<&str> = contexts.lines().collect();
        contexts.sort();
        assert_eq!(contexts, ["store-1", "store-2"]);
        kubectl_ok(&all, &["--context", "store-2", "get", "namespace", "only-on-store-2"]).await?;
        let elsewhere = kubectl(&all, &["--context", "store-1", "get", "namespace", "only-on-store-2"]).await?;
        let stderr = String::from_utf8_lossy(&elsewhere.stderr);
        assert!(
            !elsewhere.status.success() && stderr.contains("NotFound"),
            "store-1's context reached a namespace only store-2 has: {stderr}"
        );
        Ok(())
    }
}
