//! Bad input from one agent closes only that agent's session, with a stated reason.

use std::time::Duration;

use flotilla_agent::connect::Dialer;
use flotilla_e2e::{Hub, start_agent, wait_for};
use flotilla_proto::wire::fleet_client::FleetClient;
use flotilla_proto::wire::{AgentFrame, Hello, WorkStatus, agent_frame::Frame, hub_frame};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
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
    let dialer = Dialer::new(&hub.agents_addr, "localhost", &dir.path().join("store-b"))?;
    let (tx, rx) = mpsc::channel(4);
    tx.send(hello("store-b")).await?;
    let mut inbound = FleetClient::new(dialer.connect().await?)
        .session(ReceiverStream::new(rx))
        .await?
        .into_inner();
    let welcome = inbound.message().await?.expect("welcome");
    assert!(
        matches!(welcome.frame, Some(hub_frame::Frame::Welcome(_))),
        "{welcome:?}"
    );
    tx.send(AgentFrame {
        frame: Some(Frame::WorkStatus(WorkStatus {
            uid: "w".into(),
            generation: 1,
            seq: 1,
            status_json: vec![b'x'; 100 * 1024],
        })),
    })
    .await?;
    let error = loop {
        match inbound.message().await {
            Ok(Some(_)) => continue, // sync frames and heartbeats before the error
            Ok(None) => panic!("stream ended without a reason"),
            Err(status) => break status,
        }
    };
    assert!(
        error
            .message()
            .contains("exceeds the gateway's bound of 65536 bytes"),
        "the agent is told why: {error:?}"
    );
    wait_for(
        "the hub to log the reason",
        Duration::from_secs(10),
        || async {
            Ok(hub
                .proc
                .log()
                .contains("exceeds the gateway's bound")
                .then_some(()))
        },
    )
    .await?;

    // The hub keeps serving: a new session works, and store-a never lost its session.
    let dialer = Dialer::new(&hub.agents_addr, "localhost", &dir.path().join("store-c"))?;
    let (tx, rx) = mpsc::channel(4);
    tx.send(hello("store-c")).await?;
    let mut inbound = FleetClient::new(dialer.connect().await?)
        .session(ReceiverStream::new(rx))
        .await?
        .into_inner();
    let welcome = inbound.message().await?.expect("welcome");
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
    drop(tx);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hello_naming_another_cluster_is_refused_with_the_reason() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let hub = Hub::start(dir.path(), &[]).await?;
    hub.dev_cert("store-a", &dir.path().join("store-a"))?;
    let dialer = Dialer::new(&hub.agents_addr, "localhost", &dir.path().join("store-a"))?;
    let (tx, rx) = mpsc::channel(4);
    tx.send(hello("store-b")).await?;
    let mut inbound = FleetClient::new(dialer.connect().await?)
        .session(ReceiverStream::new(rx))
        .await?
        .into_inner();
    let mut said = String::new();
    while let Ok(Some(frame)) = inbound.message().await {
        if let Some(hub_frame::Frame::Goodbye(g)) = frame.frame {
            said = g.reason;
        }
    }
    assert!(
        said.contains("store-a") && said.contains("store-b"),
        "goodbye names both: {said:?}"
    );
    assert!(
        hub.clusters()?
            .iter()
            .all(|c| c["metadata"]["name"] != "store-b")
    );
    drop(tx);
    Ok(())
}
