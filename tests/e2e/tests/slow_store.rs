//! A store that stops answering for longer than the heartbeat timeout costs no session its
//! heartbeats: the gateway's session drivers hand store and CA work (health, renewal, the sync
//! of a new session) to futures beside their loop and never wait on them. The store here is a
//! real kube-apiserver, frozen with SIGSTOP.

use std::time::Duration;

use flotilla_e2e::on_both_carriers;
use flotilla_e2e::{Hub, start_agent, wait_for};
use flotilla_testenv::{TestEnv, workspace_root};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const AVAILABLE: &str = "ManagedClusterConditionAvailable";
/// How long the store stays frozen at least: four heartbeat timeouts of the hub below.
const FROZEN: Duration = Duration::from_secs(4);
/// store-a's certificate lifetime: its renewal falls due about 9.5 s after it is issued (two
/// thirds of the lifetime plus the issuer's backdating), well after store-a is Available on a
/// loaded machine, and the store stays frozen until the request is made.
const STORE_A_LIFETIME: &str = "15s";
/// The longest the store stays frozen waiting for store-b's session and store-a's request.
const FROZEN_AT_MOST: Duration = Duration::from_secs(20);

on_both_carriers! {
    async fn a_store_that_hangs_costs_no_session_its_heartbeats() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let env = TestEnv::start().await?;
        env.install_crds(&workspace_root().join("deploy/crds")).await?;
        let kubeconfig = env.kubeconfig_path().to_str().unwrap().to_string();
        let hub = Hub::start(
            dir.path(),
            &[
                "--store=kube",
                "--kubeconfig",
                &kubeconfig,
                // Heartbeats every 200 ms, a session silent for 1 s is closed.
                "--heartbeat-interval=200ms",
                "--heartbeat-timeout=1s",
                "--grace-period=30s",
                "--client-cert-lifetime=1h",
            ],
        )
        .await?;
        // store-a's certificate falls due for renewal while the store is frozen; store-b
        // connects during the freeze.
        hub.dev_cert_for("store-a", &dir.path().join("store-a"), STORE_A_LIFETIME)?;
        hub.dev_cert("store-b", &dir.path().join("store-b"))?;
        let a = start_agent(dir.path(), &hub, "store-a", &dir.path().join("store-a"))?;
        wait_for("store-a Available", Duration::from_secs(30), || async {
            Ok((hub.cluster_condition("store-a", AVAILABLE)?.as_deref() == Some("True")).then_some(()))
        })
        .await?;
        anyhow::ensure!(
            !a.log().contains("asking the hub for a new client certificate"),
            "store-a asked for its renewal before the store was frozen (it became Available \
             later than its renewal fell due); the freeze would test nothing:\n{}",
            a.log()
        );

        let apiserver = Pid::from_raw(env.apiserver_pid() as i32);
        kill(apiserver, Signal::SIGSTOP)?;
        let frozen_at = tokio::time::Instant::now();
        let b = start_agent(dir.path(), &hub, "store-b", &dir.path().join("store-b"))?;
        // store-b gets its session although its health cannot be written, and store-a asks for
        // its renewal (which needs the store) while the store is frozen; the store stays frozen
        // until both have happened, and for four heartbeat timeouts at least.
        let during = wait_for("store-b's session and store-a's renewal request", FROZEN_AT_MOST, || async {
            let b_session = b.log().contains("session established");
            let a_asked = a.log().contains("asking the hub for a new client certificate");
            if b_session && a_asked {
                Ok(Some(()))
            } else {
                anyhow::bail!("store-b's session established: {b_session}; store-a asked: {a_asked}")
            }
        })
        .await;
        tokio::time::sleep_until(frozen_at + FROZEN).await;
        kill(apiserver, Signal::SIGCONT)?;
        during?;

        // The renewal completes once the store answers; store-a never lost its session.
        wait_for("store-a's renewal", Duration::from_secs(30), || async {
            Ok(a.log().contains("client certificate renewed").then_some(()))
        })
        .await?;
        assert_eq!(
            a.log().matches("session established").count(),
            1,
            "store-a kept its session through the freeze:\n{}",
            a.log()
        );
        let hub_log = hub.proc.log();
        assert!(
            !hub_log.contains("heartbeat timeout"),
            "no session timed out on the hub:\n{hub_log}"
        );
        wait_for("store-b Available once the store is back", Duration::from_secs(30), || async {
            Ok((hub.cluster_condition("store-b", AVAILABLE)?.as_deref() == Some("True")).then_some(()))
        })
        .await?;
        Ok(())
    }
}
