//! The first live slice with real processes: hub + agents over mTLS, health from the session,
//! SIGKILL, restart, refusal of strangers.

use std::time::Duration;

use flotilla_e2e::on_both_carriers;
use flotilla_e2e::{Hub, condition_status, start_agent, wait_for};
use nix::sys::signal::Signal;

const AVAILABLE: &str = "ManagedClusterConditionAvailable";
const JOINED: &str = "ManagedClusterJoined";
const UNREACHABLE: &str = "cluster.open-cluster-management.io/unreachable";

async fn wait_condition(hub: &Hub, cluster: &str, want: &str) -> anyhow::Result<()> {
    wait_for(
        &format!("{cluster} Available={want}"),
        Duration::from_secs(30),
        || async {
            Ok((hub.cluster_condition(cluster, AVAILABLE)?.as_deref() == Some(want)).then_some(()))
        },
    )
    .await
}

on_both_carriers! {
    async fn agent_is_available_unknown_after_sigkill_and_available_after_restart() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let hub = Hub::start(dir.path(), &[]).await?;
        let certs = dir.path().join("store-0001");
        hub.dev_cert("store-0001", &certs)?;

        let mut agent = start_agent(dir.path(), &hub, "store-0001", &certs)?;
        wait_condition(&hub, "store-0001", "True").await?;
        let clusters = hub.clusters()?;
        let mc = clusters
            .iter()
            .find(|c| c["metadata"]["name"] == "store-0001")
            .unwrap();
        assert_eq!(condition_status(mc, JOINED).as_deref(), Some("True"));
        assert_eq!(mc["spec"]["hubAcceptsClient"], true);
        assert_eq!(mc["status"]["version"]["kubernetes"], "v1.36.3");

        // The operator's table shows the same.
        let table = hub.cli(&["get", "clusters"])?;
        let table = String::from_utf8(table.stdout)?;
        let row = table
            .lines()
            .find(|l| l.starts_with("store-0001"))
            .expect("cluster row");
        assert!(
            row.split_whitespace().collect::<Vec<_>>()[..4] == ["store-0001", "true", "True", "True"],
            "{table}"
        );

        agent.signal_and_wait(Signal::SIGKILL);
        wait_condition(&hub, "store-0001", "Unknown").await?;
        let mc = hub
            .clusters()?
            .into_iter()
            .find(|c| c["metadata"]["name"] == "store-0001")
            .unwrap();
        let taints = mc["spec"]["taints"].as_array().cloned().unwrap_or_default();
        assert!(
            taints.iter().any(|t| t["key"] == UNREACHABLE),
            "unreachable taint expected: {mc}"
        );

        let _agent = start_agent(dir.path(), &hub, "store-0001", &certs)?;
        wait_condition(&hub, "store-0001", "True").await?;
        let mc = hub
            .clusters()?
            .into_iter()
            .find(|c| c["metadata"]["name"] == "store-0001")
            .unwrap();
        let taints = mc["spec"]["taints"].as_array().cloned().unwrap_or_default();
        assert!(
            !taints.iter().any(|t| t["key"] == UNREACHABLE),
            "taint must be gone: {mc}"
        );
        Ok(())
    }
}

on_both_carriers! {
    async fn certificate_from_another_ca_is_refused_at_tls_and_others_keep_their_session() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let hub = Hub::start(dir.path(), &[]).await?;
        let good = dir.path().join("good");
        hub.dev_cert("store-good", &good)?;
        let _good_agent = start_agent(dir.path(), &hub, "store-good", &good)?;
        wait_condition(&hub, "store-good", "True").await?;

        // A certificate for a plausible name, signed by a different CA, and that CA's own bundle
        // replaced by the real hub CA so the agent itself trusts the hub: only the hub can refuse.
        let other = tempfile::tempdir()?;
        let stranger = dir.path().join("stranger");
        let out = std::process::Command::new(flotilla_e2e::bin("flotilla-hub"))
            .arg("dev-cert")
            .arg("--data-dir")
            .arg(other.path())
            .args(["--cluster", "store-evil", "--out"])
            .arg(&stranger)
            .output()?;
        assert!(out.status.success());
        std::fs::copy(good.join("ca.crt"), stranger.join("ca.crt"))?;
        let mut evil = start_agent(dir.path(), &hub, "store-evil", &stranger)?;

        wait_for(
            "the hub to log the refusal",
            Duration::from_secs(30),
            || async {
                Ok(hub
                    .proc
                    .log()
                    .contains("not signed by the hub CA")
                    .then_some(()))
            },
        )
        .await?;
        let line = hub
            .proc
            .log()
            .lines()
            .find(|l| l.contains("handshake refused"))
            .map(str::to_string);
        assert!(line.is_some(), "hub log must say the handshake was refused");
        wait_for(
            "the agent to report the refusal",
            Duration::from_secs(30),
            || async {
                Ok(evil
                    .log()
                    .contains("refused this agent's certificate")
                    .then_some(()))
            },
        )
        .await?;
        assert!(
            evil.alive(),
            "a refused agent keeps retrying rather than exiting"
        );

        // Nothing about the stranger reached the store, and the good agent is still Available.
        let clusters = hub.clusters()?;
        assert!(
            clusters
                .iter()
                .all(|c| c["metadata"]["name"] != "store-evil")
        );
        assert_eq!(
            hub.cluster_condition("store-good", AVAILABLE)?.as_deref(),
            Some("True")
        );
        Ok(())
    }
}

on_both_carriers! {
    async fn kube_backend_keeps_managed_clusters_on_the_real_apiserver() -> anyhow::Result<()> {
        let env = flotilla_testenv::TestEnv::start().await?;
        env.install_crds(&flotilla_testenv::workspace_root().join("deploy/crds"))
            .await?;
        let dir = tempfile::tempdir()?;
        let kubeconfig = env.kubeconfig_path().to_str().unwrap().to_string();
        let hub = Hub::start(dir.path(), &["--store=kube", "--kubeconfig", &kubeconfig]).await?;
        let certs = dir.path().join("store-0042");
        hub.dev_cert("store-0042", &certs)?;
        let mut agent = start_agent(dir.path(), &hub, "store-0042", &certs)?;

        // What kubectl shows on the hub apiserver, through OCM's printer columns.
        let kubectl_row = |env: &flotilla_testenv::TestEnv| -> anyhow::Result<Vec<String>> {
            let out = env
                .kubectl()
                .args(["get", "managedclusters", "--no-headers"])
                .output()?;
            anyhow::ensure!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            Ok(String::from_utf8(out.stdout)?
                .lines()
                .find(|l| l.starts_with("store-0042"))
                .map(|l| l.split_whitespace().map(str::to_string).collect())
                .unwrap_or_default())
        };
        // Columns: NAME, HUB ACCEPTED, (MANAGED CLUSTER URLS empty), JOINED, AVAILABLE, AGE.
        wait_for(
            "kubectl to show store-0042 available",
            Duration::from_secs(30),
            || async {
                let row = kubectl_row(&env)?;
                Ok(
                    (row.len() >= 4 && row[1] == "true" && row[2] == "True" && row[3] == "True")
                        .then_some(()),
                )
            },
        )
        .await?;

        agent.signal_and_wait(Signal::SIGKILL);
        wait_for(
            "kubectl to show store-0042 unknown",
            Duration::from_secs(30),
            || async {
                let row = kubectl_row(&env)?;
                Ok((row.len() >= 4 && row[3] == "Unknown").then_some(()))
            },
        )
        .await?;
        // The flotilla CLI reads the same objects through the hub.
        assert_eq!(
            hub.cluster_condition("store-0042", AVAILABLE)?.as_deref(),
            Some("Unknown")
        );
        Ok(())
    }
}
