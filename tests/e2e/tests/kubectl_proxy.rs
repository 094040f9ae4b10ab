//! The real kubectl against real spoke apiservers through the hub's proxy front, a gateway
//! session and the agent's tunnel end (real processes, real TLS), on both carriers: reads,
//! apply and delete, a watch that sees a later event, a 5,000-object list, `auth can-i` and a
//! Forbidden from the spoke's RBAC for the impersonated user, the hub's own refusals (no rule,
//! read-only) that never reach the agent, bearer tokens, and an audit line for each request
//! with no secret in it.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use flotilla_e2e::on_both_carriers;
use flotilla_e2e::proxy::{hub_with_proxy, kubectl, kubectl_ok};
use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{Hub, wait_for};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, BufReader};

const CLUSTER: &str = "store-1";
/// A bearer token of the tokens file (user carol, group ops).
const CAROL_TOKEN: &str = "carol-0123456789abcdef0123456789";

const RULES: &str = r#"
rules:
  - name: ops-store-1
    groups: [ops]
    clusters: {names: [store-1]}
    access: full
  - name: rita-reads
    users: [rita]
    clusters: {names: [store-1]}
    access: readOnly
"#;

/// The spoke's RBAC for the test's users: groups `ops` and `auditors` read namespaces and
/// ConfigMaps everywhere; user alice may do anything with ConfigMaps in `team-a` and nothing else.
async fn spoke_rbac(client: kube::Client) -> anyhow::Result<()> {
    let pp = PostParams::default();
    for ns in ["team-a", "bulk"] {
        Api::<Namespace>::all(client.clone())
            .create(
                &pp,
                &serde_json::from_value(json!({"metadata": {"name": ns}}))?,
            )
            .await?;
    }
    Api::<ClusterRole>::all(client.clone())
        .create(&pp, &serde_json::from_value(json!({
            "metadata": {"name": "ops-reader"},
            "rules": [{"apiGroups": [""], "resources": ["namespaces", "configmaps"], "verbs": ["get", "list", "watch"]}],
        }))?)
        .await?;
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&pp, &serde_json::from_value(json!({
            "metadata": {"name": "ops-reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "ops-reader"},
            "subjects": [
                {"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "ops"},
                {"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "auditors"},
            ],
        }))?)
        .await?;
    Api::<Role>::namespaced(client.clone(), "team-a")
        .create(
            &pp,
            &serde_json::from_value(json!({
                "metadata": {"name": "configmaps"},
                "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["*"]}],
            }))?,
        )
        .await?;
    Api::<RoleBinding>::namespaced(client, "team-a")
        .create(&pp, &serde_json::from_value(json!({
            "metadata": {"name": "alice-configmaps"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "configmaps"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "alice"}],
        }))?)
        .await?;
    Ok(())
}

/// 5,000 ConfigMaps in `bulk`, written directly to the spoke, 32 at a time.
async fn bulk_config_maps(client: kube::Client, n: usize) -> anyhow::Result<()> {
    let api = Api::<ConfigMap>::namespaced(client, "bulk");
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(0..n)
        .map(|i| {
            let api = api.clone();
            async move {
                let cm: ConfigMap = serde_json::from_value(json!({
                    "metadata": {"name": format!("cm-{i:05}")},
                    "data": {"index": i.to_string()},
                }))?;
                api.create(&PostParams::default(), &cm).await?;
                Ok(())
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    results.into_iter().collect()
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string()
}

/// The audit lines of `user` with `verb` and `status`.
fn audited(lines: &[Value], user: &str, verb: &str, status: u16) -> Vec<Value> {
    lines
        .iter()
        .filter(|l| l["user"] == user && l["verb"] == verb && l["status"] == status)
        .cloned()
        .collect()
}

/// A kubeconfig for a bearer-token user (the file kubectl users of tokens write themselves).
fn token_kubeconfig(dir: &Path, hub: &Hub, token: &str) -> anyhow::Result<std::path::PathBuf> {
    let path = dir.join("carol.kubeconfig");
    let kc = json!({
        "apiVersion": "v1", "kind": "Config", "current-context": CLUSTER,
        "clusters": [{"name": CLUSTER, "cluster": {
            "server": format!("{}/clusters/{CLUSTER}", hub.proxy_url()?),
            "certificate-authority": hub.data_dir.join("operator/ca.crt"),
        }}],
        "users": [{"name": "carol", "user": {"token": token}}],
        "contexts": [{"name": CLUSTER, "context": {"cluster": CLUSTER, "user": "carol"}}],
    });
    std::fs::write(&path, serde_json::to_string(&kc)?)?;
    Ok(path)
}

on_both_carriers! {
    /// Everything a kubectl user does through the hub, with the access rules and the audit.
    async fn kubectl_reaches_a_spoke_through_the_hub() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let hub = hub_with_proxy(
            dir.path(),
            RULES,
            &format!("{CAROL_TOKEN},carol,1001,\"ops\"\n"),
            &[],
        )
        .await?;
        let spoke = Spoke::start(dir.path(), &hub, CLUSTER).await?;
        let agent = spoke.start_agent(dir.path(), &hub, &[])?;
        hub.wait_available(CLUSTER).await?;
        let admin = spoke.env.client().await?;
        spoke_rbac(admin.clone()).await?;
        bulk_config_maps(admin.clone(), 5_000).await?;

        let alice = hub.create_user(dir.path(), "alice", &["ops"])?;
        let rita = hub.create_user(dir.path(), "rita", &["auditors"])?;
        let mallory = hub.create_user(dir.path(), "mallory", &["dev"])?;

        // Reads: the spoke's namespaces, as alice (group ops may list them there).
        let namespaces = kubectl_ok(&alice, &["get", "namespaces", "-o", "name"]).await?;
        assert!(namespaces.contains("namespace/team-a"), "{namespaces}");

        // `get --raw` replaces the kubeconfig server's path with its own: the whole path
        // reaches the cluster, the API path alone is refused saying so.
        let raw = kubectl_ok(&alice, &["get", "--raw", "/clusters/store-1/api/v1/namespaces/team-a"]).await?;
        let namespace: serde_json::Value = serde_json::from_str(&raw)?;
        assert_eq!(namespace["metadata"]["name"], "team-a", "{raw}");
        let bare = kubectl(&alice, &["get", "--raw", "/api/v1/namespaces/team-a"]).await?;
        assert!(
            !bare.status.success()
                && stderr(&bare).contains("with kubectl get --raw, give the whole path, /clusters/NAME/api/..."),
            "{}", stderr(&bare)
        );

        // A watch that sees a ConfigMap created after it started.
        let manifest = dir.path().join("cm.yaml");
        std::fs::write(&manifest, "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: first\n  namespace: team-a\ndata:\n  k: v\n")?;
        kubectl_ok(&alice, &["apply", "-f", manifest.to_str().unwrap()]).await?;
        let mut watch = tokio::process::Command::new("kubectl")
            .arg("--kubeconfig").arg(&alice)
            .args(["get", "configmaps", "-n", "team-a", "-w", "-o", "name"])
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let mut seen = BufReader::new(watch.stdout.take().unwrap()).lines();
        let watched = tokio::time::timeout(Duration::from_secs(60), seen.next_line()).await??;
        assert_eq!(watched.as_deref(), Some("configmap/first"));
        // The list has been served: what comes now comes through the watch.
        std::fs::write(&manifest, "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: later\n  namespace: team-a\n")?;
        kubectl_ok(&alice, &["apply", "-f", manifest.to_str().unwrap()]).await?;
        let watched = tokio::time::timeout(Duration::from_secs(60), seen.next_line()).await??;
        assert_eq!(watched.as_deref(), Some("configmap/later"));
        watch.kill().await?;
        assert!(
            team_a_has(&admin, "later").await?,
            "apply through the proxy created team-a/later on the spoke"
        );
        kubectl_ok(&alice, &["delete", "configmap", "later", "-n", "team-a"]).await?;
        assert!(!team_a_has(&admin, "later").await?, "delete reached the spoke");

        // A list of 5,000 objects (kubectl pages it).
        let listed = kubectl_ok(&alice, &["get", "configmaps", "-n", "bulk", "-o", "name"]).await?;
        assert_eq!(listed.lines().count(), 5_000);

        // auth can-i: the spoke's RBAC for the impersonated user and groups.
        assert_eq!(kubectl_ok(&alice, &["auth", "can-i", "create", "configmaps", "-n", "team-a"]).await?.trim(), "yes");
        let no = kubectl(&alice, &["auth", "can-i", "create", "configmaps", "-n", "default"]).await?;
        assert_eq!(String::from_utf8_lossy(&no.stdout).trim(), "no");
        assert_eq!(kubectl_ok(&alice, &["auth", "can-i", "list", "namespaces"]).await?.trim(), "yes");

        // A Forbidden from the spoke, shown unchanged.
        let forbidden = kubectl(&alice, &["get", "secrets", "-n", "default"]).await?;
        assert!(!forbidden.status.success());
        assert!(
            stderr(&forbidden).contains(r#"Error from server (Forbidden): secrets is forbidden: User "alice" cannot list resource "secrets" in API group "" in the namespace "default""#),
            "{}", stderr(&forbidden)
        );

        // A bearer token instead of a certificate.
        let carol = token_kubeconfig(dir.path(), &hub, CAROL_TOKEN)?;
        assert!(kubectl_ok(&carol, &["get", "namespaces", "-o", "name"]).await?.contains("namespace/bulk"));
        let wrong = token_kubeconfig(dir.path(), &hub, "carol-wrong-wrong-wrong-wrong")?;
        let unauthorized = kubectl(&wrong, &["get", "namespaces"]).await?;
        assert!(
            stderr(&unauthorized).contains("You must be logged in to the server (the bearer token is not known to the hub)"),
            "{}", stderr(&unauthorized)
        );

        // No rule for mallory: 403 from the hub, with the reason, also where kubectl has no
        // discovery cached yet (its first reads are the discovery roots, whose error bodies
        // it does not decode).
        let refused = kubectl(&mallory, &["get", "namespaces"]).await?;
        assert!(
            stderr(&refused).contains("Error from server (Forbidden): user mallory (groups: dev) may not reach cluster store-1: no access rule"),
            "{}", stderr(&refused)
        );
        let no_cache = dir.path().join("mallory-discovery-cache");
        let refused = kubectl(&mallory, &["--cache-dir", no_cache.to_str().unwrap(), "get", "pods", "-A"]).await?;
        assert!(
            stderr(&refused).contains("Error from server (Forbidden): user mallory (groups: dev) may not reach cluster store-1: no access rule")
                && !stderr(&refused).contains("unknown"),
            "{}", stderr(&refused)
        );
        // Read-only rita reads, and cannot apply.
        assert!(kubectl_ok(&rita, &["get", "configmaps", "-n", "team-a", "-o", "name"]).await?.contains("configmap/first"));
        let read_only = kubectl(&rita, &["apply", "-f", manifest.to_str().unwrap()]).await?;
        assert!(!read_only.status.success());
        assert!(stderr(&read_only).contains("user rita has read-only access to cluster store-1"), "{}", stderr(&read_only));

        // Nothing of the refused requests reached the agent; the allowed ones did.
        let agent_log = agent.log();
        assert!(agent_log.contains("user=alice") || agent_log.contains("user=\"alice\""), "the agent logs forwarded users");
        assert!(!agent_log.contains("mallory"), "a refused request reached the agent");

        // The audit: a line for every request, none with a secret.
        let lines = wait_for("audit lines of every request", Duration::from_secs(10), || async {
            let lines = hub.audit_lines()?;
            let mallory = lines.iter().filter(|l| l["user"] == "mallory").count();
            Ok((mallory > 0 && !audited(&lines, "rita", "create", 403).is_empty())
                .then_some(lines))
        })
        .await?;
        assert!(!audited(&lines, "alice", "list", 200).is_empty(), "list namespaces");
        assert!(!audited(&lines, "alice", "watch", 200).is_empty(), "the watch");
        assert!(!audited(&lines, "alice", "create", 201).is_empty(), "apply's create");
        assert!(!audited(&lines, "alice", "delete", 200).is_empty(), "delete");
        let spoke_forbidden = audited(&lines, "alice", "list", 403);
        assert!(
            spoke_forbidden.iter().any(|l| l["path"] == "/api/v1/namespaces/default/secrets" && l.get("refused").is_none()),
            "the spoke's Forbidden: {spoke_forbidden:?}"
        );
        assert!(!audited(&lines, "carol", "list", 200).is_empty(), "the token user");
        // kubectl pages the big list 500 at a time; each page streamed through (compressed).
        let pages: Vec<u64> = audited(&lines, "alice", "list", 200)
            .into_iter()
            .filter(|l| l["path"] == "/api/v1/namespaces/bulk/configmaps")
            .map(|l| l["bytesOut"].as_u64().unwrap_or(0))
            .collect();
        assert!(pages.len() >= 10, "5,000 objects in pages of 500: {pages:?}");
        assert!(pages.iter().sum::<u64>() > 5_000 * 10, "{pages:?}");
        // Every request of mallory's was refused by the hub, none reached the cluster.
        for refusal in lines.iter().filter(|l| l["user"] == "mallory") {
            assert_eq!(refusal["status"], 403, "{refusal}");
            assert_eq!(refusal["refused"], "Forbidden", "{refusal}");
            assert_eq!(refusal["cluster"], CLUSTER);
        }
        assert!(lines.iter().all(|l| l["tunnel"].as_str().is_some_and(|t| !t.is_empty())));
        let text = std::fs::read_to_string(hub.audit_path())?;
        for secret in [CAROL_TOKEN, "carol-wrong", "Bearer", "BEGIN", "PRIVATE KEY"] {
            assert!(!text.contains(secret), "the audit log holds {secret:?}");
        }
        Ok(())
    }
}

/// Whether a ConfigMap exists in team-a on the spoke (read directly, not through the proxy).
async fn team_a_has(client: &kube::Client, name: &str) -> anyhow::Result<bool> {
    Ok(Api::<ConfigMap>::namespaced(client.clone(), "team-a")
        .get_opt(name)
        .await?
        .is_some())
}
