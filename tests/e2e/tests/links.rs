//! Agents behind emulated wide-area links (`flotilla-wan`): the agent process runs in the
//! link's network namespace and reaches the hub only across the link. Needs root and the tools
//! `flotilla_wan::check_available` names; where they are missing each test says it is skipped
//! and why.

use std::time::Duration;

use flotilla_e2e::{Hub, on_both_carriers, start_agent_behind, wait_for};
use flotilla_wan::{EmulatedLink, Profile};

const AVAILABLE: &str = "ManagedClusterConditionAvailable";

on_both_carriers! {
    async fn an_agent_behind_a_congested_link_is_available_unknown_when_cut_and_back_after() -> anyhow::Result<()> {
        if let Err(e) = flotilla_wan::check_available() {
            eprintln!("SKIPPED: {e}");
            return Ok(());
        }
        let dir = tempfile::tempdir()?;
        // Heartbeats and grace longer than the test's fast defaults: 300 ms ± 100 round trips
        // with 3 % loss each way (their tuning is measured elsewhere).
        let hub = Hub::start(
            dir.path(),
            &["--heartbeat-interval=1s", "--heartbeat-timeout=5s", "--grace-period=5s"],
        )
        .await?;
        let link = EmulatedLink::create(Profile::Congested.spec(), 28).await?;
        hub.dev_cert("store-7", &dir.path().join("store-7"))?;
        let agent = start_agent_behind(&link, dir.path(), &hub, "store-7", &dir.path().join("store-7"))?;
        wait_for("store-7 Available across the link", Duration::from_secs(60), || async {
            Ok((hub.cluster_condition("store-7", AVAILABLE)?.as_deref() == Some("True")).then_some(()))
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e:#}\nthe agent's log:\n{}", agent.log()))?;
        // The session crossed the link both ways (the agent's namespace has no other way out).
        assert!(link.inbound().delivered > 0 && link.outbound().delivered > 0);

        // Cut the link: with no session the cluster turns Unknown after the grace period.
        link.set_down(true).await?;
        wait_for("store-7 Unknown behind the cut link", Duration::from_secs(60), || async {
            Ok((hub.cluster_condition("store-7", AVAILABLE)?.as_deref() == Some("Unknown")).then_some(()))
        })
        .await?;
        link.set_down(false).await?;
        wait_for("store-7 Available again once the link is back", Duration::from_secs(60), || async {
            Ok((hub.cluster_condition("store-7", AVAILABLE)?.as_deref() == Some("True")).then_some(()))
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e:#}\nthe agent's log:\n{}", agent.log()))?;
        Ok(())
    }
}
