//! kubectl through the hub to clusters held by different gateways (scale-out mode): a hub on a
//! real kube-apiserver with `--gateways external` and its proxy front on, two
//! `flotilla-gateway` processes dividing the shards by Leases, two real spoke apiservers whose
//! agents land on different gateways, and the real `kubectl` reaching both through the hub
//! (`get namespaces`, `apply -f`). The hub holds no session: every request crosses the relay
//! hop to the gateway that does, and the access rules and audit still run once, on the hub.

use std::collections::BTreeMap;
use std::time::Duration;

use flotilla_e2e::proxy::{hub_with_proxy, kubectl_ok};
use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{GatewayProc, on_both_carriers, wait_for};
use flotilla_proto::contract::{shard_lease_name, shard_of};
use flotilla_testenv::{TestEnv, workspace_root};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;

const SHARDS: u32 = 16;
const LEASE_FLAGS: &[&str] = &[
    "--shards=16",
    "--lease-duration=3s",
    "--renew-period=1s",
    "--grace-period=6s",
    "--drain-window=1s",
];
const RULES: &str = r#"
rules:
  - name: ops-everywhere
    groups: [ops]
    clusters: {names: [store-a, store-b, store-c, store-d, store-e, store-f, store-g, store-h]}
    access: full
"#;
const CANDIDATES: &[&str] = &[
    "store-a", "store-b", "store-c", "store-d", "store-e", "store-f", "store-g", "store-h",
];

/// The holder of `cluster`'s shard lease now, if any.
async fn holder(leases: &Api<Lease>, cluster: &str) -> anyhow::Result<Option<String>> {
    let lease = leases
        .get_opt(&shard_lease_name(shard_of(cluster, SHARDS)))
        .await?;
    Ok(lease
        .and_then(|l| l.spec?.holder_identity)
        .filter(|h| !h.is_empty()))
}

on_both_carriers! {
    /// The acceptance item "with two gateways, a request for a cluster held by the other
    /// gateway reaches it", with the real kubectl and real spoke apiservers.
    async fn kubectl_reaches_clusters_held_by_two_gateways() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let dir = dir.path();
        let env = TestEnv::start().await?;
        env.install_crds(&workspace_root().join("deploy/crds")).await?;
        let kubeconfig = env.kubeconfig_path().to_path_buf();
        let kc = kubeconfig.to_str().unwrap();
        // Gateways advertise 127.0.0.1:PORT; their certificate is checked against one name,
        // as in a deployment where they advertise pod IPs.
        let mut extra = vec![
            "--store=kube", "--kubeconfig", kc, "--gateways=external", "--gateway-server-name=localhost",
        ];
        extra.extend(LEASE_FLAGS);
        let hub = hub_with_proxy(dir, RULES, "", &extra).await?;

        let certs = hub.gateway_cert(dir)?;
        let gateways: Vec<GatewayProc> = (1..=2)
            .map(|n| GatewayProc::start(dir, &format!("gw-{n}"), &kubeconfig, &certs, LEASE_FLAGS))
            .collect::<anyhow::Result<_>>()?;
        let logs = || -> String {
            gateways.iter().map(|g| format!("--- {} ---\n{}", g.name, g.proc.log())).collect()
        };

        // Two clusters whose shards the two different gateways hold, once both hold some.
        let leases: Api<Lease> = Api::namespaced(env.client().await?, "flotilla-system");
        let (first, second) = wait_for("two clusters on two different gateways", Duration::from_secs(60), || async {
            let mut by_gateway: BTreeMap<String, &str> = BTreeMap::new();
            for cluster in CANDIDATES {
                if let Some(owner) = holder(&leases, cluster).await? {
                    by_gateway.entry(owner).or_insert(cluster);
                }
            }
            let picked: Vec<&str> = by_gateway.values().copied().collect();
            Ok((picked.len() == 2).then(|| (picked[0].to_string(), picked[1].to_string())))
        })
        .await
        .map_err(|e| e.context(logs()))?;

        let mut spokes = Vec::new();
        let mut agents = Vec::new();
        for cluster in [&first, &second] {
            let spoke = Spoke::start(dir, &hub, cluster).await?;
            agents.push(spoke.start_agent(dir, &hub, &[])?);
            spokes.push(spoke);
        }
        // Each agent's session on its shard's owner, and the two owners differ.
        wait_for("each cluster's session on its shard's owner", Duration::from_secs(60), || async {
            for cluster in [&first, &second] {
                let Some(owner) = holder(&leases, cluster).await? else { return Ok(None) };
                let on_owner = gateways.iter().any(|g| g.name == owner && g.sessions().contains(cluster.as_str()));
                if !on_owner {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        })
        .await
        .map_err(|e| e.context(logs()))?;
        let owners = (holder(&leases, &first).await?, holder(&leases, &second).await?);
        assert_ne!(owners.0, owners.1, "the two clusters are held by different gateways");

        let alice = hub.create_user(dir, "alice", &["ops"])?;
        let kubeconfig_for = |cluster: &str| -> anyhow::Result<std::path::PathBuf> {
            // alice's kubeconfig, pointed at this cluster's proxy path.
            let text = std::fs::read_to_string(&alice)?;
            let mut doc: serde_json::Value = yaml_serde::from_str(&text)?;
            for c in doc["clusters"].as_array_mut().into_iter().flatten() {
                c["cluster"]["server"] = format!("{}/clusters/{cluster}", hub.proxy_url()?).into();
            }
            let path = dir.join(format!("alice-{cluster}.kubeconfig"));
            std::fs::write(&path, serde_json::to_vec(&doc)?)?;
            Ok(path)
        };

        for (cluster, spoke) in [&first, &second].into_iter().zip(&spokes) {
            let kubeconfig = kubeconfig_for(cluster)?;
            // A namespace only this spoke has, made directly on it: what kubectl lists through
            // the hub comes from this cluster's apiserver and no other.
            let marker = format!("only-on-{cluster}");
            let manifest = dir.join(format!("{cluster}-ns.yaml"));
            std::fs::write(&manifest, format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {marker}\n"))?;
            let admin = spoke.env.kubectl().arg("apply").arg("-f").arg(&manifest).output()?;
            anyhow::ensure!(admin.status.success(), "{}", String::from_utf8_lossy(&admin.stderr));

            // alice is cluster-admin on the spoke through impersonation only.
            let binding = dir.join(format!("{cluster}-rbac.yaml"));
            std::fs::write(&binding, "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata:\n  name: ops-admin\nroleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: ClusterRole\n  name: cluster-admin\nsubjects:\n- apiGroup: rbac.authorization.k8s.io\n  kind: Group\n  name: ops\n")?;
            let rbac = spoke.env.kubectl().arg("apply").arg("-f").arg(&binding).output()?;
            anyhow::ensure!(rbac.status.success(), "{}", String::from_utf8_lossy(&rbac.stderr));

            let namespaces = kubectl_ok(&kubeconfig, &["get", "namespaces", "-o", "name"])
                .await
                .map_err(|e| e.context(logs()))?;
            assert!(namespaces.contains(&format!("namespace/{marker}")), "{cluster}: {namespaces}");
            let other = if cluster == &first { &second } else { &first };
            assert!(!namespaces.contains(&format!("only-on-{other}")), "{cluster} answered, not {other}: {namespaces}");

            // A write through the hub lands on this spoke.
            let cm = dir.join(format!("{cluster}-cm.yaml"));
            std::fs::write(&cm, format!("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: via-hub\n  namespace: default\ndata:\n  cluster: {cluster}\n"))?;
            kubectl_ok(&kubeconfig, &["apply", "-f", cm.to_str().unwrap()]).await?;
            let stored = spoke.config_map("default", "via-hub").await?.expect("applied through the hub");
            assert_eq!(stored.data.unwrap_or_default().get("cluster"), Some(cluster));
        }

        // Every request was audited once, on the hub, with its cluster and a 2xx status.
        let audit = hub.audit_lines()?;
        for cluster in [&first, &second] {
            let lines: Vec<_> = audit.iter().filter(|l| l["cluster"] == cluster.as_str()).collect();
            assert!(lines.iter().any(|l| l["verb"] == "list" && l["status"] == 200), "{cluster}: {audit:?}");
            assert!(lines.iter().any(|l| l["method"] == "PATCH" || l["method"] == "POST"), "{cluster}: {audit:?}");
        }
        // The requests crossed the hop to the owners: the hub sent both agents away to them
        // and holds no session itself.
        for agent in &agents {
            assert!(agent.log().contains("redirected to the gateway"), "{}", agent.log());
        }
        Ok(())
    }
}
