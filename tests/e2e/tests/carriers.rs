//! What only one carrier or the choice between them can show: an agent on `--transport auto`
//! whose QUIC does not get through takes gRPC and works normally; a QUIC agent whose UDP
//! socket moves to a new port keeps its session and loses nothing.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use flotilla_agent::apply::MemoryCluster;
use flotilla_agent::cache::{CacheDb, CachedWork};
use flotilla_agent::connect::{Dialer, Transport};
use flotilla_agent::{AgentConfig, Observer, Parts};
use flotilla_e2e::spoke::Spoke;
use flotilla_e2e::{Hub, wait_for};
use flotilla_testenv::workspace_root;
use flotilla_transport::quic::{QuicClient, QuicSettings};

const SEED_WORK: &str = "proto/tests/fixtures/manifestwork_my_first_work.yaml";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_auto_agent_takes_grpc_when_udp_does_not_get_through() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // No QUIC on the hub: UDP to its port goes nowhere, as behind a firewall that drops it.
    let hub = Hub::start(dir.path(), &["--quic=false"]).await?;
    let spoke = Spoke::start(dir.path(), &hub, "cluster1").await?;
    let out = hub.cli(&[
        "apply",
        "-f",
        workspace_root().join(SEED_WORK).to_str().unwrap(),
    ])?;
    anyhow::ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let agent = spoke.start_agent(dir.path(), &hub, &["--transport=auto"])?;
    let log = wait_for(
        "the agent's session, over gRPC",
        Duration::from_secs(60),
        || async {
            let log = agent.log();
            Ok(log
                .lines()
                .any(|l| l.contains("session established") && l.contains("carrier=grpc"))
                .then_some(log))
        },
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e:#}\nthe agent's log:\n{}", agent.log()))?;
    assert!(
        log.contains("QUIC did not get through (UDP blocked?); using gRPC over TCP"),
        "the fallback is said: {log}"
    );
    // And it works normally: the seed work is applied on the spoke and reported.
    spoke
        .wait_deployment_image("nginx-deployment", Some("nginx:1.14.2"))
        .await?;
    hub.wait_work_applied("cluster1", "my-first-work").await?;
    Ok(())
}

/// Counts what the agent's session loop reports.
#[derive(Default)]
struct Counts {
    sessions: AtomicU64,
    works_stored: AtomicU64,
    statuses_acked: AtomicU64,
}

impl Observer for Counts {
    fn session_established(&self) {
        self.sessions.fetch_add(1, Ordering::SeqCst);
    }
    fn work_stored(&self, _work: &CachedWork) {
        self.works_stored.fetch_add(1, Ordering::SeqCst);
    }
    fn status_acked(&self, _uid: &str, _seq: u64) {
        self.statuses_acked.fetch_add(1, Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quic_session_goes_on_when_the_agents_socket_moves_to_a_new_port() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let hub = Hub::start(dir.path(), &[]).await?;
    let certs = dir.path().join("store-q");
    hub.dev_cert("store-q", &certs)?;
    let manifest = dir.path().join("cm.yaml");
    let work = |name: &str| -> anyhow::Result<()> {
        std::fs::write(
            &manifest,
            format!(
                "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: {name}, namespace: default}}\ndata: {{k: v}}\n"
            ),
        )?;
        let out = hub.cli(&[
            "work",
            "create",
            name,
            "-f",
            manifest.to_str().unwrap(),
            "--clusters",
            "store-q",
        ])?;
        anyhow::ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    };

    // The agent library on a QUIC endpoint this test holds.
    let client = QuicClient::bind("127.0.0.1:0".parse()?, QuicSettings::default())?;
    let config = AgentConfig {
        hub: Some(hub.agents_addr.clone()),
        server_name: Some("localhost".into()),
        cluster_name: "store-q".into(),
        hub_name: None,
        cert_dir: Some(certs.clone()),
        proxy_url: None,
        kubeconfig: None,
        data_dir: dir.path().join("agent-data"),
        resync_interval: Duration::from_secs(300),
        apply_concurrency: 4,
        initial_jitter: Duration::ZERO,
        max_backoff: Duration::from_secs(1),
        kubernetes_version: "v1.36.3".into(),
        transport: Transport::Quic,
        quic_congestion: Default::default(),
        feedback_interval: flotilla_agent::reconcile::DEFAULT_FEEDBACK_INTERVAL,
        max_tunnels: flotilla_agent::tunnel::DEFAULT_MAX_TUNNELS,
        tunnel_idle_timeout: flotilla_agent::tunnel::DEFAULT_TUNNEL_IDLE_TIMEOUT,
        spoke_kube_api_qps: flotilla_agent::config::DEFAULT_SPOKE_KUBE_API_QPS,
        spoke_kube_api_burst: flotilla_agent::config::DEFAULT_SPOKE_KUBE_API_BURST,
        failover_order: Vec::new(),
        hub_unreachable_timeout: Duration::from_secs(300),
        ops: Default::default(),
    };
    let db = CacheDb::temporary()?;
    let counts = Arc::new(Counts::default());
    let (_, kubernetes_version) = tokio::sync::watch::channel("v1.36.3".to_string());
    let (_, cluster_info) = tokio::sync::watch::channel(Default::default());
    let parts = Parts {
        dialer: Dialer::new(&hub.agents_addr, "localhost", &certs)?
            .with_transport(Transport::Quic)
            .with_quic_client(client.clone()),
        cache: Arc::new(db.cluster("store-q")),
        target: Arc::new(MemoryCluster::new()),
        spoke_api: Arc::new(flotilla_agent::SimulatedApi::new(10)),
        kubernetes_version,
        cluster_info,
        observer: counts.clone(),
        seed: Some(7),
        metrics: Default::default(),
        applied_once: flotilla_ops::ReadyFlag::new(
            "the first apply pass (nobody probes this agent)",
        ),
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(async move {
        flotilla_agent::run_with(&config, parts, async {
            let _ = stopped.await;
        })
        .await
    });

    work("before")?;
    hub.wait_work_applied("store-q", "before").await?;
    let before = client.local_addr()?;
    let after = client.rebind("127.0.0.1:0".parse()?)?;
    assert_ne!(before.port(), after.port());

    // Everything after the move rides the same session: a new work down, its status up.
    work("after")?;
    hub.wait_work_applied("store-q", "after").await?;
    assert_eq!(
        counts.sessions.load(Ordering::SeqCst),
        1,
        "no reconnect: one session throughout"
    );
    assert_eq!(counts.works_stored.load(Ordering::SeqCst), 2);
    wait_for("both statuses acked", Duration::from_secs(10), || async {
        Ok((counts.statuses_acked.load(Ordering::SeqCst) >= 2).then_some(()))
    })
    .await?;
    let _ = stop.send(());
    agent.await??;
    Ok(())
}
