//! Bad input from one agent closes only that agent's session, with a stated reason, on either
//! carrier.

use std::time::Duration;

use flotilla_e2e::on_both_carriers;
use flotilla_e2e::{Hub, RawSession, start_agent, wait_for};
use flotilla_proto::wire::{AgentFrame, Hello, WorkStatus, agent_frame::Frame, hub_frame};

const AVAILABLE: &str = "ManagedClusterConditionAvailable";

fn hello(cluster: &str) -> AgentFrame {
    AgentFrame {
        frame: Some(Frame::Hello(Hello {
            protocol_version: flotilla_proto::PROTOCOL_VERSION,
            cluster_name: cluster.into(),
            agent_version: "test".into(),
            ..Default::default()
        })),
    }
}

/// The hub's goodbye on `session`, skipping what comes before it.
async fn goodbye(session: &mut RawSession) -> Option<String> {
    while let Some(frame) = session.next().await {
        if let Some(hub_frame::Frame::Goodbye(g)) = frame.frame {
            return Some(g.reason);
        }
    }
    None
}

on_both_carriers! {
    async fn oversized_frame_closes_only_that_session() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let hub = Hub::start(dir.path(), &["--max-frame-bytes=65536"]).await?;
        for c in ["store-a", "store-b", "store-c"] {
            hub.dev_cert(c, &dir.path().join(c))?;
        }
        let good = start_agent(dir.path(), &hub, "store-a", &dir.path().join("store-a"))?;
        wait_for("store-a Available", Duration::from_secs(30), || async {
            Ok((hub.cluster_condition("store-a", AVAILABLE)?.as_deref() == Some("True")).then_some(()))
        })
        .await?;

        // store-b says hello properly, then sends a 100 KiB frame.
        let mut b = RawSession::open(&hub, &dir.path().join("store-b"), hello("store-b")).await?;
        let welcome = b.next().await.expect("welcome");
        assert!(
            matches!(welcome.frame, Some(hub_frame::Frame::Welcome(_))),
            "{welcome:?}"
        );
        b.outbound
            .send(AgentFrame {
                frame: Some(Frame::WorkStatus(WorkStatus {
                    uid: "w".into(),
                    generation: 1,
                    seq: 1,
                    status_json: vec![b'x'; 100 * 1024],
                })),
            })
            .await?;
        let said = goodbye(&mut b).await.expect("a goodbye with the reason");
        assert!(
            said.contains("exceeds the bound of 65536 bytes"),
            "the agent is told why: {said:?}"
        );
        wait_for(
            "the hub to log the reason",
            Duration::from_secs(10),
            || async {
                Ok(hub
                    .proc
                    .log()
                    .contains("exceeds the bound of 65536 bytes")
                    .then_some(()))
            },
        )
        .await?;

        // The hub keeps serving: a new session works, and store-a never lost its session.
        let mut c = RawSession::open(&hub, &dir.path().join("store-c"), hello("store-c")).await?;
        let welcome = c.next().await.expect("welcome");
        assert!(matches!(welcome.frame, Some(hub_frame::Frame::Welcome(_))));
        assert_eq!(
            hub.cluster_condition("store-a", AVAILABLE)?.as_deref(),
            Some("True")
        );
        assert_eq!(
            good.log().matches("session established").count(),
            1,
            "store-a kept its one session"
        );
        Ok(())
    }
}

on_both_carriers! {
    async fn hello_naming_another_cluster_is_refused_with_the_reason() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let hub = Hub::start(dir.path(), &[]).await?;
        hub.dev_cert("store-a", &dir.path().join("store-a"))?;
        let mut a = RawSession::open(&hub, &dir.path().join("store-a"), hello("store-b")).await?;
        let said = goodbye(&mut a).await.unwrap_or_default();
        assert!(
            said.contains("store-a") && said.contains("store-b"),
            "goodbye names both: {said:?}"
        );
        assert!(
            hub.clusters()?
                .iter()
                .all(|c| c["metadata"]["name"] != "store-b")
        );
        Ok(())
    }
}
